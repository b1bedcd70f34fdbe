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

#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub source_name: String,
    pub replica_version: Option<String>,
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
    pub reset_required: bool,
    /// Why the upstream required a reset, when it did in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_reason: Option<String>,
    pub stages: StageTimes,
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

#[derive(Default)]
pub struct Status {
    inner: Mutex<Snapshot>,
    source_ns: AtomicU64,
    loop_ns: AtomicU64,
    write_ns: AtomicU64,
    commit_ns: AtomicU64,
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
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        s.stages = StageTimes {
            source_ns: self.source_ns.load(Ordering::Relaxed),
            loop_ns: self.loop_ns.load(Ordering::Relaxed),
            write_ns: self.write_ns.load(Ordering::Relaxed),
            commit_ns: self.commit_ns.load(Ordering::Relaxed),
        };
        s
    }

    /// Adds the time since `since` to a stage.
    pub fn count(&self, stage: Stage, since: std::time::Instant) {
        let ns = since.elapsed().as_nanos() as u64;
        let counter = match stage {
            Stage::Source => &self.source_ns,
            Stage::Loop => &self.loop_ns,
            Stage::Write => &self.write_ns,
            Stage::Commit => &self.commit_ns,
        };
        counter.fetch_add(ns, Ordering::Relaxed);
    }
}
