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

use crate::server::access::Access;
use crate::status::{LineageState, SourceState, Status};

pub struct Metrics {
    registry: Registry,
}

struct StatusCollector {
    status: Arc<Status>,
    access: Arc<Access>,
}

impl std::fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Metrics {
    pub fn new(status: Arc<Status>, access: Arc<Access>) -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        registry.register_with_unit(
            "storage_commit",
            "Duration of each change log commit (a group of transactions made durable)",
            Unit::Seconds,
            status.commit_seconds().clone(),
        );
        registry.register_collector(Box::new(StatusCollector { status, access }));
        Metrics { registry }
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
        let s = self.status.snapshot();
        let mut counter = |name: &str, help: &str, unit: Option<&Unit>, value: f64| -> Result<(), std::fmt::Error> {
            let metric = ConstCounter::new(value);
            metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
        };
        counter(
            "transactions_stored",
            "Transactions stored in the change log since start",
            None,
            s.transactions as f64,
        )?;
        counter("changes_stored", "Data and schema changes stored since start", None, s.changes as f64)?;
        let seconds = |ns: u64| ns as f64 / 1e9;
        counter("stage_source", "Time spent waiting on the source", Some(&Unit::Seconds), seconds(s.stages.source_ns))?;
        counter(
            "stage_loop",
            "Time the replication loop spent on its own work",
            Some(&Unit::Seconds),
            seconds(s.stages.loop_ns),
        )?;
        counter(
            "stage_storage_write",
            "Time the storer spent writing rows",
            Some(&Unit::Seconds),
            seconds(s.stages.write_ns),
        )?;
        counter(
            "stage_storage_commit",
            "Time the storer spent committing",
            Some(&Unit::Seconds),
            seconds(s.stages.commit_ns),
        )?;

        let mut gauge = |name: &str, help: &str, unit: Option<&Unit>, value: f64| -> Result<(), std::fmt::Error> {
            let metric = ConstGauge::new(value);
            metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
        };
        gauge("subscribers", "Subscribers connected and following", None, s.subscribers as f64)?;
        gauge(
            "held_subscribers",
            "Subscribers connected but waiting (a takeover or a drain)",
            None,
            s.held_subscribers as f64,
        )?;
        gauge(
            "stream_connections",
            "Open stream connections (subscribers and zero-caches)",
            None,
            self.access.connections() as f64,
        )?;
        gauge(
            "reset_required",
            "1 when the upstream required a reset",
            None,
            if s.reset_required { 1.0 } else { 0.0 },
        )?;
        let established = matches!(s.lineage, LineageState::Established);
        gauge(
            "lineage_established",
            "1 once the lineage's snapshot is durable",
            None,
            if established { 1.0 } else { 0.0 },
        )?;
        if let LineageState::Snapshotting { rows, tables } = s.lineage {
            gauge("snapshot_rows", "Rows of the initial snapshot received so far", None, rows as f64)?;
            gauge("snapshot_tables", "Tables of the initial snapshot begun so far", None, tables as f64)?;
        }
        if let Some(idle) = s.source_idle_ms {
            gauge(
                "source_idle",
                "Time since the running source last sent anything",
                Some(&Unit::Seconds),
                idle as f64 / 1e3,
            )?;
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
