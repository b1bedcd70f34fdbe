//! What `GET /status` reports: shared, cheap to update, read rarely.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase", tag = "state")]
pub enum SourceState {
    #[default]
    Starting,
    Running,
    BackingOff {
        #[serde(rename = "lastError")]
        last_error: String,
        #[serde(rename = "retryInMs")]
        retry_in_ms: u64,
    },
    Stopped {
        error: Option<String>,
    },
}

/// Where the lineage subscribers follow stands.
#[derive(Debug, Clone, Serialize, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase", tag = "state")]
pub enum LineageState {
    /// Nothing is known yet (the change log is empty and the source has not
    /// been opened).
    #[default]
    None,
    /// A new lineage's first transaction (the snapshot) is being stored.
    /// Its replica version is not reported and no subscriber is accepted
    /// until it is durable: a restart now would begin another lineage.
    Snapshotting {
        /// Tables begun (`create-table` changes received).
        tables: u64,
        /// Rows received so far.
        rows: u64,
    },
    /// The snapshot is durable: `replicaVersion` is served.
    Established,
}

#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub source_name: String,
    /// Set only once the lineage is established (see [`LineageState`]).
    pub replica_version: Option<String>,
    pub lineage: LineageState,
    pub last_watermark: Option<String>,
    pub min_watermark: Option<String>,
    /// Transactions stored since start.
    pub transactions: u64,
    /// Data and schema changes stored since start.
    pub changes: u64,
    pub subscribers: usize,
    /// Subscribers connected but not yet joined: a takeover of the change
    /// log from another host is under way, or a storer is draining.
    pub held_subscribers: usize,
    pub source: SourceState,
    /// While the source is running: milliseconds since it last sent a
    /// message (a stalled upstream shows here instead of looking healthy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_idle_ms: Option<u64>,
    pub reset_required: bool,
    /// Why the upstream required a reset, when it did in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_reason: Option<String>,
    pub stages: StageTimes,
    /// While a snapshot is stored: rows and bytes per table, in the order
    /// the tables were begun.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub snapshot_tables: Vec<TableProgress>,
    /// While a snapshot is stored: about how many rows it holds, when the
    /// source can tell (Postgres from the planner's statistics, MariaDB from
    /// InnoDB's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_rows_estimate: Option<u64>,
    /// The last purge: the floor it used (nothing below it is kept), what it
    /// deleted, and the change log's size on disk after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub purge: Option<PurgeReport>,
    /// The built-in Postgres source: WAL the upstream keeps for its slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retained_wal_bytes: Option<u64>,
    /// Upstream log the running stream has not read yet, for sources that
    /// can tell (MariaDB: the binlog position gap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_behind_bytes: Option<u64>,
    /// For sources that give commit times (`commitTimeMs`): how long the
    /// last durable transaction took from its upstream commit. While the
    /// change log is stalled it grows with the stall.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_lag_ms: Option<f64>,
    /// The network paths stalled now (see [`Stalls`]), empty when none is.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stalls: Vec<StallReport>,
}

/// A path Sluice waits on over the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum NetPath {
    /// The upstream: the source's link (the replication connection for the
    /// Postgres source), or the attempts to reopen it.
    Source,
    /// The change log: a storage call waiting for its answer (the change DB
    /// for Postgres, the disk for SQLite).
    ChangeLog,
}

impl NetPath {
    pub const ALL: [NetPath; 2] = [NetPath::Source, NetPath::ChangeLog];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            NetPath::Source => "source",
            NetPath::ChangeLog => "change_log",
        }
    }

    fn describe(self, for_ms: u64) -> String {
        let secs = for_ms as f64 / 1e3;
        match self {
            NetPath::Source => format!("nothing heard from the upstream for {secs:.1} s"),
            NetPath::ChangeLog => format!("a change log call has waited {secs:.1} s for its answer"),
        }
    }
}

/// One stalled path, as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StallReport {
    pub path: NetPath,
    pub for_ms: u64,
    pub reason: String,
}

/// A path counts as stalled once it has waited this long: past the
/// Postgres source's first request for an answer (2 s) and any healthy
/// commit, well before a link is given up as dead (10 s by default).
pub const STALL_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct TableProgress {
    pub table: String,
    pub rows: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct PurgeReport {
    pub floor: Option<String>,
    /// Purge passes completed since start (whether they deleted anything):
    /// a pass counted after a change of acks or reservations has seen it.
    pub passes: u64,
    /// Rows deleted by every purge since start.
    pub deleted_rows: u64,
    /// `None` where the store cannot tell.
    pub log_bytes: Option<u64>,
    /// The pass deleted nothing because this process started on an
    /// existing log less than `--subscriber-retention-secs` ago: the
    /// previous process's subscribers may still be reconnecting.
    pub waiting_for_returning_subscribers: bool,
}

/// Where the time goes: cumulative nanoseconds per stage of the pipeline.
#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct StageTimes {
    /// Waiting on the source (`next-batch`, including the plugin's own work).
    pub source_ns: u64,
    /// The loop's own work: rules, encoding, queueing and forwarding.
    pub loop_ns: u64,
    /// The storer inserting rows.
    pub write_ns: u64,
    /// The storer's commits (the durable sync).
    pub commit_ns: u64,
}

pub struct Status {
    inner: Mutex<Snapshot>,
    source_ns: AtomicU64,
    loop_ns: AtomicU64,
    write_ns: AtomicU64,
    commit_ns: AtomicU64,
    /// When the source last sent a message (ms since the Unix epoch; 0: never).
    source_message_ms: AtomicU64,
    /// When the source began backing off, this time (ms since the Unix
    /// epoch; 0: it is not backing off).
    backing_off_since_ms: AtomicU64,
    /// Each storage commit's duration, for `/metrics`.
    commit_seconds: prometheus_client::metrics::histogram::Histogram,
    /// Upstream commit to durable, per transaction whose source gave its
    /// commit time.
    source_lag_seconds: prometheus_client::metrics::histogram::Histogram,
    /// When the upstream was last heard from, while the loop listens (ms
    /// since the Unix epoch; 0: not yet).
    source_heard_ms: AtomicU64,
    /// Since when a change log call has been waiting (0: none is).
    change_log_call_ms: AtomicU64,
    /// When the last durable transaction's lag was measured.
    source_lag_at_ms: AtomicU64,
    /// The two histograms again, as OpenTelemetry instruments, once OTLP
    /// metrics are on (`telemetry::bridge`).
    otel_histograms: std::sync::OnceLock<[opentelemetry::metrics::Histogram<f64>; 2]>,
}

/// Marks a change log call in flight until dropped (see
/// [`Status::change_log_call`]).
pub struct CallInFlight<'a>(&'a AtomicU64);

impl Drop for CallInFlight<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

impl Default for Status {
    fn default() -> Self {
        Status {
            inner: Mutex::default(),
            source_ns: AtomicU64::default(),
            loop_ns: AtomicU64::default(),
            write_ns: AtomicU64::default(),
            commit_ns: AtomicU64::default(),
            source_message_ms: AtomicU64::default(),
            backing_off_since_ms: AtomicU64::default(),
            source_heard_ms: AtomicU64::default(),
            change_log_call_ms: AtomicU64::default(),
            source_lag_at_ms: AtomicU64::default(),
            otel_histograms: std::sync::OnceLock::new(),
            // 0.25 ms to about 8 s.
            commit_seconds: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.00025, 2.0, 16),
            ),
            // 1 ms to about 9 hours (a source replaying a long backlog).
            source_lag_seconds: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.5, 18),
            ),
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A pipeline stage whose time is counted.
#[derive(Debug, Clone, Copy)]
pub enum Stage {
    Source,
    Loop,
    Write,
    Commit,
}

impl Status {
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
        if matches!(s.source, SourceState::BackingOff { .. }) {
            let _ = self.backing_off_since_ms.compare_exchange(0, now_ms(), Ordering::Relaxed, Ordering::Relaxed);
        } else {
            self.backing_off_since_ms.store(0, Ordering::Relaxed);
        }
    }

    /// Whether this host should get traffic (`GET /readyz`): its lineage is
    /// established, the upstream needs no reset, and the source runs or has
    /// been backing off for less than `backoff_limit`. The reason when not.
    pub fn readiness(&self, backoff_limit: std::time::Duration) -> Result<(), String> {
        if let Some(stall) = self.stalls().into_iter().next() {
            return Err(format!("stalled: {}", stall.reason));
        }
        let s = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if s.reset_required {
            return Err(format!(
                "the upstream requires a reset: {}",
                s.reset_reason.as_deref().unwrap_or("no reason given")
            ));
        }
        match &s.source {
            SourceState::Stopped { error } => {
                return Err(format!("the source stopped: {}", error.as_deref().unwrap_or("no error")))
            }
            SourceState::BackingOff { last_error, .. } => {
                let since = self.backing_off_since_ms.load(Ordering::Relaxed);
                let for_ms = now_ms().saturating_sub(since);
                if since > 0 && for_ms >= backoff_limit.as_millis() as u64 {
                    return Err(format!("the source has been backing off for {} s: {last_error}", for_ms / 1000));
                }
            }
            SourceState::Starting | SourceState::Running => {}
        }
        match s.lineage {
            LineageState::Established => Ok(()),
            LineageState::Snapshotting { .. } => Err("the initial snapshot is being stored".into()),
            LineageState::None => Err("no lineage yet (the source is starting)".into()),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        s.stages = StageTimes {
            source_ns: self.source_ns.load(Ordering::Relaxed),
            loop_ns: self.loop_ns.load(Ordering::Relaxed),
            write_ns: self.write_ns.load(Ordering::Relaxed),
            commit_ns: self.commit_ns.load(Ordering::Relaxed),
        };
        let last = self.source_message_ms.load(Ordering::Relaxed);
        s.source_idle_ms =
            (matches!(s.source, SourceState::Running) && last > 0).then(|| now_ms().saturating_sub(last));
        s.stalls = self.stalls();
        // Nothing becomes durable while the change log is stalled, and the
        // upstream goes on committing: the lag grows from its last measure.
        if s.stalls.iter().any(|st| st.path == NetPath::ChangeLog) {
            let measured = self.source_lag_at_ms.load(Ordering::Relaxed);
            if let (Some(lag), true) = (s.source_lag_ms.as_mut(), measured > 0) {
                *lag += now_ms().saturating_sub(measured) as f64;
            }
        }
        s
    }

    /// How long `path` has been stalled, when it has been for at least
    /// [`STALL_AFTER`].
    pub fn stalled_for(&self, path: NetPath) -> Option<std::time::Duration> {
        let since = match path {
            NetPath::Source => self.source_heard_ms.load(Ordering::Relaxed),
            NetPath::ChangeLog => self.change_log_call_ms.load(Ordering::Relaxed),
        };
        let waited = std::time::Duration::from_millis(now_ms().saturating_sub(since));
        (since > 0 && waited >= STALL_AFTER).then_some(waited)
    }

    /// Every path stalled now.
    pub fn stalls(&self) -> Vec<StallReport> {
        let source_stopped =
            matches!(self.inner.lock().unwrap_or_else(|p| p.into_inner()).source, SourceState::Stopped { .. });
        NetPath::ALL
            .into_iter()
            .filter(|path| !(source_stopped && *path == NetPath::Source))
            .filter_map(|path| {
                let waited = self.stalled_for(path)?.as_millis() as u64;
                Some(StallReport { path, for_ms: waited, reason: path.describe(waited) })
            })
            .collect()
    }

    /// The loop is listening to the upstream, which was last heard from
    /// `silent_for` ago (`None`: the source cannot tell, and its calls
    /// return, which counts as heard).
    pub fn source_heard(&self, silent_for: Option<std::time::Duration>) {
        let ago = silent_for.map_or(0, |d| d.as_millis() as u64);
        self.source_heard_ms.store(now_ms().saturating_sub(ago).max(1), Ordering::Relaxed);
    }

    /// A change log call begins; it is in flight until the guard is dropped.
    pub fn change_log_call(&self) -> CallInFlight<'_> {
        self.change_log_call_ms.store(now_ms(), Ordering::Relaxed);
        CallInFlight(&self.change_log_call_ms)
    }

    /// The histogram of storage commit durations.
    pub fn commit_seconds(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.commit_seconds
    }

    /// The histogram of upstream-commit-to-durable times.
    pub fn source_lag_seconds(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.source_lag_seconds
    }

    /// Records the commit and source-lag histograms into these
    /// OpenTelemetry instruments too, from now on.
    pub fn export_histograms(
        &self,
        commit: opentelemetry::metrics::Histogram<f64>,
        lag: opentelemetry::metrics::Histogram<f64>,
    ) {
        let _ = self.otel_histograms.set([commit, lag]);
    }

    /// Transactions committed upstream at `commit_times_ms` (ms since the
    /// Unix epoch) are durable now. A clock behind the upstream's counts as
    /// no lag rather than a negative one.
    pub fn durable_after_upstream(&self, commit_times_ms: &[f64]) {
        let Some(last) = commit_times_ms.last() else { return };
        let now = now_ms() as f64;
        let otel = self.otel_histograms.get().map(|[_, lag]| lag);
        for t in commit_times_ms {
            let seconds = (now - t).max(0.0) / 1e3;
            self.source_lag_seconds.observe(seconds);
            if let Some(lag) = otel {
                lag.record(seconds, &[]);
            }
        }
        self.source_lag_at_ms.store(now as u64, Ordering::Relaxed);
        self.update(|s| s.source_lag_ms = Some((now - last).max(0.0)));
    }

    /// The source just sent something (or was opened).
    pub fn source_message(&self) {
        self.source_message_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Adds the time since `since` to a stage.
    pub fn count(&self, stage: Stage, since: std::time::Instant) {
        let elapsed = since.elapsed();
        let ns = elapsed.as_nanos() as u64;
        if let Stage::Commit = stage {
            self.commit_seconds.observe(elapsed.as_secs_f64());
            if let Some([commit, _]) = self.otel_histograms.get() {
                commit.record(elapsed.as_secs_f64(), &[]);
            }
        }
        let counter = match stage {
            Stage::Source => &self.source_ns,
            Stage::Loop => &self.loop_ns,
            Stage::Write => &self.write_ns,
            Stage::Commit => &self.commit_ns,
        };
        counter.fetch_add(ns, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn readiness_follows_the_lineage_the_source_and_resets() {
        let status = Status::default();
        assert!(status.readiness(Duration::from_secs(30)).unwrap_err().contains("no lineage"));
        status.update(|s| {
            s.lineage = LineageState::Established;
            s.source = SourceState::Running;
        });
        assert_eq!(status.readiness(Duration::from_secs(30)), Ok(()));
        status.update(|s| s.source = SourceState::BackingOff { last_error: "refused".into(), retry_in_ms: 10 });
        // Within the limit still ready; past it (a zero limit) not.
        assert_eq!(status.readiness(Duration::from_secs(30)), Ok(()));
        assert!(status.readiness(Duration::ZERO).unwrap_err().contains("refused"));
        status.update(|s| s.source = SourceState::Running);
        assert_eq!(status.readiness(Duration::ZERO), Ok(()));
        status.update(|s| {
            s.reset_required = true;
            s.reset_reason = Some("slot lost".into());
        });
        assert!(status.readiness(Duration::from_secs(30)).unwrap_err().contains("slot lost"));
    }
}
