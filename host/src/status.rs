//! What `GET /status` reports: shared, cheap to update, read rarely.

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
    pub source: SourceState,
    pub reset_required: bool,
}

#[derive(Default)]
pub struct Status {
    inner: Mutex<Snapshot>,
}

impl Status {
    pub fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
    }

    pub fn snapshot(&self) -> Snapshot {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
