//! `GET /metrics`: the Prometheus text format, through prometheus-client.
//!
//! Most values are read from [`Status`] at scrape time (one collector), so
//! the hot path keeps updating what it already updates; the storage commit
//! histogram is observed by the storer as it commits.

use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::hub::Hub;
use crate::plugin::{FILTER_CALLS, SOURCE_CALLS};
use crate::server::access::Access;
use crate::status::{LineageState, SourceState, Status};

pub struct Metrics {
    registry: Registry,
}

struct StatusCollector {
    status: Arc<Status>,
    access: Arc<Access>,
    hub: Arc<Hub>,
    /// `--ready-backoff-secs`, for `sluice_ready` (as `/readyz` decides).
    ready_backoff: std::time::Duration,
}

/// Per-subscriber series beyond this many (those with the most bytes
/// pending are kept) would make a scrape of a large fleet expensive; the
/// totals cover everyone.
const MAX_SUBSCRIBER_SERIES: usize = 500;

impl std::fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Metrics {
    pub fn new(status: Arc<Status>, access: Arc<Access>, hub: Arc<Hub>, ready_backoff: std::time::Duration) -> Metrics {
        // `process_*` as every client library names them; the rest `sluice_*`.
        let mut root = Registry::default();
        root.register_collector(Box::new(process::Collector));
        let registry = root.sub_registry_with_prefix("sluice");
        registry.register_with_unit(
            "storage_commit",
            "Duration of each change log commit (a group of transactions made durable)",
            Unit::Seconds,
            status.commit_seconds().clone(),
        );
        registry.register_with_unit(
            "source_lag",
            "Upstream commit to durable in the change log, per transaction (sources that give commit times: Postgres, MariaDB)",
            Unit::Seconds,
            status.source_lag_seconds().clone(),
        );
        registry.register_collector(Box::new(StatusCollector { status, access, hub, ready_backoff }));
        Metrics { registry: root }
    }

    /// The text exposition.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

impl prometheus_client::collector::Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        build_info(&mut encoder)?;
        gauge_value(
            &mut encoder,
            "ready",
            "1 when this host should get traffic (GET /readyz answers 200)",
            None,
            if self.status.readiness(self.ready_backoff).is_ok() { 1.0 } else { 0.0 },
        )?;
        let s = self.status.snapshot();
        counter_value(
            &mut encoder,
            "transactions_stored",
            "Transactions stored in the change log since start",
            None,
            s.transactions as f64,
        )?;
        counter_value(
            &mut encoder,
            "changes_stored",
            "Data and schema changes stored since start",
            None,
            s.changes as f64,
        )?;
        let seconds = |ns: u64| ns as f64 / 1e9;
        counter_value(
            &mut encoder,
            "stage_source",
            "Time spent waiting on the source",
            Some(&Unit::Seconds),
            seconds(s.stages.source_ns),
        )?;
        counter_value(
            &mut encoder,
            "stage_loop",
            "Time the replication loop spent on its own work",
            Some(&Unit::Seconds),
            seconds(s.stages.loop_ns),
        )?;
        counter_value(
            &mut encoder,
            "stage_storage_write",
            "Time the storer spent writing rows",
            Some(&Unit::Seconds),
            seconds(s.stages.write_ns),
        )?;
        counter_value(
            &mut encoder,
            "stage_storage_commit",
            "Time the storer spent committing",
            Some(&Unit::Seconds),
            seconds(s.stages.commit_ns),
        )?;

        gauge_value(&mut encoder, "subscribers", "Subscribers connected and following", None, s.subscribers as f64)?;
        gauge_value(
            &mut encoder,
            "held_subscribers",
            "Subscribers connected but waiting (a takeover or a drain)",
            None,
            s.held_subscribers as f64,
        )?;
        gauge_value(
            &mut encoder,
            "stream_connections",
            "Open stream connections (subscribers and zero-caches)",
            None,
            self.access.connections() as f64,
        )?;
        gauge_value(
            &mut encoder,
            "reset_required",
            "1 when the upstream required a reset",
            None,
            if s.reset_required { 1.0 } else { 0.0 },
        )?;
        let established = matches!(s.lineage, LineageState::Established);
        gauge_value(
            &mut encoder,
            "lineage_established",
            "1 once the lineage's snapshot is durable",
            None,
            if established { 1.0 } else { 0.0 },
        )?;
        if let LineageState::Snapshotting { rows, tables } = s.lineage {
            gauge_value(
                &mut encoder,
                "snapshot_rows",
                "Rows of the initial snapshot received so far",
                None,
                rows as f64,
            )?;
            gauge_value(
                &mut encoder,
                "snapshot_tables",
                "Tables of the initial snapshot begun so far",
                None,
                tables as f64,
            )?;
        }
        if let Some(idle) = s.source_idle_ms {
            gauge_value(
                &mut encoder,
                "source_idle",
                "Time since the running source last sent anything",
                Some(&Unit::Seconds),
                idle as f64 / 1e3,
            )?;
        }
        {
            let mut family = encoder.encode_descriptor(
                "stalled",
                "How long each network path has been stalled (0: not stalled; a path counts as stalled after 5 s without an answer)",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?;
            for path in crate::status::NetPath::ALL {
                let secs = s.stalls.iter().find(|st| st.path == path).map_or(0.0, |st| st.for_ms as f64 / 1e3);
                ConstGauge::new(secs).encode(family.encode_family(&[("path", path.label())])?)?;
            }
        }
        let catchup = self.hub.catchups().view();
        counter_value(
            &mut encoder,
            "catchup_changes",
            "Rows sent from the change log to catching-up subscribers (its rate is the catch-up throughput)",
            None,
            catchup.changes_sent as f64,
        )?;
        counter_value(
            &mut encoder,
            "catchup_rows_read",
            "Rows read from the change log for catch-ups (shared scans read once for many subscribers)",
            None,
            catchup.rows_read as f64,
        )?;
        counter_value(
            &mut encoder,
            "catchup_scans",
            "Snapshots of the change log pinned for catch-up scans",
            None,
            catchup.scans_total as f64,
        )?;
        counter_value(
            &mut encoder,
            "catchup_repeated",
            "Catch-ups run again from where one ended, because live changes outran it (a backlog past --backlog-mb)",
            None,
            catchup.repeated as f64,
        )?;
        gauge_value(&mut encoder, "catchup_scans_running", "Catch-up scans running now", None, catchup.scans as f64)?;
        let budget = self.hub.budget().view();
        gauge_value(
            &mut encoder,
            "subscriber_memory_budget",
            "The memory budget for everything held for subscribers",
            Some(&Unit::Bytes),
            budget.budget_bytes as f64,
        )?;
        gauge_value(
            &mut encoder,
            "subscriber_memory",
            "Memory held for subscribers: queued frames, live backlogs, per-message bookkeeping",
            Some(&Unit::Bytes),
            budget.used_bytes as f64,
        )?;
        gauge_value(
            &mut encoder,
            "subscriber_memory_shared",
            "Of the memory held for subscribers, the live changes' JSON their queues share (counted once)",
            Some(&Unit::Bytes),
            budget.shared_bytes as f64,
        )?;
        counter_value(
            &mut encoder,
            "subscribers_closed_by_budget",
            "Subscribers closed for holding more than their share of an exceeded memory budget",
            None,
            budget.closed_total as f64,
        )?;
        if let Some(purge) = &s.purge {
            counter_value(
                &mut encoder,
                "purged_rows",
                "Change log rows deleted by purges",
                None,
                purge.deleted_rows as f64,
            )?;
            if let Some(bytes) = purge.log_bytes {
                gauge_value(
                    &mut encoder,
                    "change_log_size",
                    "The change log's size on disk",
                    Some(&Unit::Bytes),
                    bytes as f64,
                )?;
            }
        }
        if let Some(bytes) = s.retained_wal_bytes {
            gauge_value(
                &mut encoder,
                "source_retained_wal",
                "WAL the upstream keeps for the Postgres source's replication slot",
                Some(&Unit::Bytes),
                bytes as f64,
            )?;
        }
        if let Some(bytes) = s.upstream_behind_bytes {
            gauge_value(
                &mut encoder,
                "source_upstream_behind",
                "Upstream log the source has not read yet (MariaDB: the binlog position gap)",
                Some(&Unit::Bytes),
                bytes as f64,
            )?;
        }
        if let Some(estimate) = s.snapshot_rows_estimate {
            gauge_value(
                &mut encoder,
                "snapshot_rows_estimate",
                "About how many rows the initial snapshot holds (from the upstream's planner statistics)",
                None,
                estimate as f64,
            )?;
        }
        let total_bytes: u64 = s.snapshot_tables.iter().map(|t| t.bytes).sum();
        if !s.snapshot_tables.is_empty() {
            gauge_value(
                &mut encoder,
                "snapshot",
                "Bytes of the initial snapshot received so far",
                Some(&Unit::Bytes),
                total_bytes as f64,
            )?;
            let mut family = encoder.encode_descriptor(
                "snapshot_table_rows",
                "Rows of each table of the initial snapshot received so far",
                None,
                MetricType::Gauge,
            )?;
            for t in &s.snapshot_tables {
                ConstGauge::new(t.rows as i64).encode(family.encode_family(&[("table", t.table.as_str())])?)?;
            }
        }

        // Subscribers: totals, and the first few by bytes pending.
        let mut views = self.hub.subscriber_views();
        let pending: usize = views.iter().map(|v| v.pending_bytes).sum();
        gauge_value(
            &mut encoder,
            "subscribers_pending",
            "Bytes queued for or in flight to subscribers, not yet consumed",
            Some(&Unit::Bytes),
            pending as f64,
        )?;
        let head = s.last_watermark.as_deref().unwrap_or_default();
        let behind = views.iter().filter(|v| v.acked.as_str() < head).count();
        gauge_value(
            &mut encoder,
            "subscribers_behind_head",
            "Subscribers whose last ack is behind the newest stored commit",
            None,
            behind as f64,
        )?;
        let catching_up = views.iter().filter(|v| v.catching_up).count();
        gauge_value(
            &mut encoder,
            "subscribers_catching_up",
            "Subscribers reading the change log, not yet live",
            None,
            catching_up as f64,
        )?;
        let max_lag = views.iter().map(|v| v.lagging_ms).max().unwrap_or(0);
        gauge_value(
            &mut encoder,
            "subscriber_lagging_max",
            "Longest time any subscriber has been lagging behind the live stream",
            Some(&Unit::Seconds),
            max_lag as f64 / 1e3,
        )?;
        let distance = |v: &crate::subscriber::SubscriberView| crate::watermark::distance(&v.acked, head);
        // Present at 0 with no subscriber, so an alert on it has a series.
        let max_distance = views.iter().filter_map(distance).max().unwrap_or(0);
        gauge_value(
            &mut encoder,
            "subscriber_watermark_distance_max",
            "How far the subscriber furthest behind is from the newest stored commit, in watermark units (WAL bytes for the Postgres source; 0 with no subscriber)",
            None,
            max_distance as f64,
        )?;
        views.sort_by_key(|v| std::cmp::Reverse(v.pending_bytes));
        views.truncate(MAX_SUBSCRIBER_SERIES);
        let mut family = encoder.encode_descriptor(
            "subscriber_watermark_distance",
            "How far one subscriber's last ack is from the newest stored commit, in watermark units (the 500 with the most pending)",
            None,
            MetricType::Gauge,
        )?;
        for v in &views {
            if let Some(d) = distance(v) {
                let labels = [("subscriber", v.id.as_str()), ("task", v.task_id.as_str())];
                ConstGauge::new(d as f64).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "subscriber_pending",
            "Bytes queued for or in flight to one subscriber (the 500 with the most)",
            Some(&Unit::Bytes),
            MetricType::Gauge,
        )?;
        for v in &views {
            let labels = [("subscriber", v.id.as_str()), ("task", v.task_id.as_str())];
            ConstGauge::new(v.pending_bytes as i64).encode(family.encode_family(&labels)?)?;
        }

        // Plugins, by kind.
        for (name, help, unit, read) in [
            (
                "plugin_calls",
                "Calls into plugins",
                None,
                (|c: &crate::plugin::PluginCalls| c.calls.load(std::sync::atomic::Ordering::Relaxed) as f64)
                    as fn(&crate::plugin::PluginCalls) -> f64,
            ),
            ("plugin_call", "Time spent in calls into plugins", Some(Unit::Seconds), |c| {
                c.nanos.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9
            }),
            ("plugin_traps", "Plugin calls that trapped", None, |c| {
                c.traps.load(std::sync::atomic::Ordering::Relaxed) as f64
            }),
            ("plugin_deadline_hits", "Plugin calls interrupted at their deadline", None, |c| {
                c.deadline_hits.load(std::sync::atomic::Ordering::Relaxed) as f64
            }),
            ("plugin_memory_limit_hits", "Plugin calls that exceeded the memory cap", None, |c| {
                c.memory_hits.load(std::sync::atomic::Ordering::Relaxed) as f64
            }),
        ] {
            let mut family = encoder.encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
            for (kind, calls) in [("source", &SOURCE_CALLS), ("filter", &FILTER_CALLS)] {
                ConstCounter::new(read(calls)).encode(family.encode_family(&[("kind", kind)])?)?;
            }
        }

        // One series per state, 1 for the current one.
        let current = match s.source {
            SourceState::Starting => "starting",
            SourceState::Running => "running",
            SourceState::BackingOff { .. } => "backing_off",
            SourceState::Stopped { .. } => "stopped",
        };
        let mut family = encoder.encode_descriptor(
            "source_state",
            "The source's state (1 for the current one)",
            None,
            MetricType::Gauge,
        )?;
        for state in ["starting", "running", "backing_off", "stopped"] {
            let labels = [("state", state)];
            ConstGauge::new(if state == current { 1i64 } else { 0 }).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

fn gauge_value(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
}

fn counter_value(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
}

/// `sluice_build_info{version, revision, wit}`: always 1, for joining a
/// version onto other series and for alerting on a fleet's mixed versions.
fn build_info(encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let (major, minor) = crate::plugin::WIT_VERSION;
    let wit = format!("{major}.{minor}");
    let labels = [("version", env!("CARGO_PKG_VERSION")), ("revision", env!("SLUICE_GIT_REV")), ("wit", wit.as_str())];
    let mut family = encoder.encode_descriptor(
        "build_info",
        "Sluice's version, git revision and plugin contract (always 1)",
        None,
        MetricType::Gauge,
    )?;
    ConstGauge::new(1i64).encode(family.encode_family(&labels)?)
}

/// The process's own figures, as Prometheus's client libraries name them
/// (`process_*`, without the `sluice_` prefix): read from `/proc/self` on
/// Linux at scrape time; absent elsewhere.
mod process {
    use prometheus_client::encoding::DescriptorEncoder;

    use super::{counter_value, gauge_value};

    #[derive(Debug)]
    pub struct Collector;

    impl prometheus_client::collector::Collector for Collector {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            let Some(f) = read() else { return Ok(()) };
            let e = &mut encoder;
            counter_value(e, "process_cpu_seconds", "User and system CPU time", None, f.cpu_seconds)?;
            gauge_value(e, "process_resident_memory_bytes", "Resident memory", None, f.rss_bytes)?;
            gauge_value(e, "process_open_fds", "Open file descriptors (sockets included)", None, f.open_fds)?;
            gauge_value(e, "process_start_time_seconds", "Start time since the Unix epoch", None, f.start_time)
        }
    }

    struct Figures {
        cpu_seconds: f64,
        rss_bytes: f64,
        open_fds: f64,
        start_time: f64,
    }

    #[cfg(target_os = "linux")]
    fn read() -> Option<Figures> {
        // SAFETY: sysconf has no preconditions.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        if ticks <= 0 || page <= 0 {
            return None;
        }
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The fields after the command name, which is in parentheses and may hold spaces.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<f64>().ok());
        let (utime, stime, start_ticks, rss_pages) = (field(14)?, field(15)?, field(22)?, field(24)?);
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ").and_then(|b| b.trim().parse::<f64>().ok()))?;
        let open_fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as f64).unwrap_or(0.0);
        Some(Figures {
            cpu_seconds: (utime + stime) / ticks as f64,
            rss_bytes: rss_pages * page as f64,
            open_fds,
            start_time: boot + start_ticks / ticks as f64,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn read() -> Option<Figures> {
        None
    }
}
