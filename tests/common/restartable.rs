//! Sluice in-process over a SQLite change log, whose replication loop a test
//! stops and starts again (on a new source each time) while the endpoint
//! and its subscribers stay: the harness of the source tests.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sluice::service::{Service, ServiceConfig};
use sluice::source::ChangeSource;
use sluice::status::{SourceState, Status};
use sluice::streamer::StreamerOptions;

use super::replica::Replica;
use super::{wait_until, Backend, LogSpec};

const WAIT: Duration = Duration::from_secs(60);

/// Makes the source each run of the loop starts on.
pub type SourceFactory = Box<dyn Fn() -> Pin<Box<dyn Future<Output = Box<dyn ChangeSource>> + Send>> + Send + Sync>;

pub struct Restartable {
    pub dir: tempfile::TempDir,
    pub addr: String,
    pub status: Arc<Status>,
    pub service: Service,
    source: SourceFactory,
}

impl Restartable {
    /// Starts the service (no cleanup, so the log keeps everything) with a
    /// first source from `source`; `dir` holds the change log.
    pub async fn start(dir: tempfile::TempDir, options: StreamerOptions, source: SourceFactory) -> Restartable {
        let (log, reader) = LogSpec::new(Backend::Sqlite, dir.path()).open();
        let config =
            ServiceConfig { cleanup: None, streamer: options, ..ServiceConfig::new(source().await, log, reader) };
        let service = Service::start(config).await.unwrap();
        let (addr, status) = (service.addr().to_string(), service.status().clone());
        Restartable { dir, addr, status, service, source }
    }

    pub fn spec(&self) -> LogSpec {
        LogSpec::new(Backend::Sqlite, self.dir.path())
    }

    /// Stops the replication loop (the storer drains what is queued) and
    /// returns how it ended.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.service.stop_replication().await
    }

    /// Starts the replication loop again, on a new source.
    pub async fn run(&mut self) {
        let (log, _) = self.spec().open();
        self.service.start_replication((self.source)().await, log).unwrap();
    }

    pub async fn restart(&mut self) {
        self.stop().await.unwrap();
        self.run().await;
    }

    pub async fn replica_version(&self) -> String {
        super::replica::replica_version(&self.status, WAIT).await
    }

    /// A subscriber from the replica version, applying to a [`Replica`].
    pub async fn subscribe(&self) -> Arc<Mutex<Replica>> {
        super::replica::follow(&self.addr, &self.replica_version().await).await
    }

    /// Waits until `w` is the last durable watermark.
    pub async fn stored(&self, w: &str) {
        super::wait_stored(&self.status, w).await;
    }

    /// Waits until everything `replica` has received is durable in the log
    /// (subscribers get live transactions before the storer commits them).
    pub async fn durable_through(&self, replica: &Arc<Mutex<Replica>>) {
        let last = replica.lock().unwrap().commits.last().cloned().unwrap_or_default();
        let st = self.status.clone();
        wait_until(&format!("{last} to be durable"), WAIT, || {
            let stored = st.snapshot().last_watermark.unwrap_or_default();
            let done = stored >= last;
            async move { done }
        })
        .await;
    }

    /// The rows of `schema.name` in the log's table state, keyed by their
    /// `id` as the upstream's rows are (see `Upstream::rows`).
    pub async fn state_rows(&self, schema: &str, name: &str) -> BTreeMap<String, Value> {
        let reader = self.spec().open().1;
        let table = sluice::storage::state::object_key(schema, name);
        tokio::task::spawn_blocking(move || {
            let mut snapshot = reader.snapshot().unwrap();
            assert!(snapshot.state_kept().unwrap(), "the table state is kept");
            let mut out = BTreeMap::new();
            let mut after: Option<(String, String)> = None;
            loop {
                let cursor = after.as_ref().map(|(t, k)| (t.as_str(), k.as_str()));
                let rows = snapshot.state_rows(cursor, 100).unwrap();
                let Some(last) = rows.last() else { return out };
                after = Some((last.table.clone(), last.key.clone()));
                for r in rows.into_iter().filter(|r| r.table == table) {
                    let v: Value = serde_json::from_str(&r.row).unwrap();
                    out.insert(super::replica::key_of(&v, &["id".to_string()]), v);
                }
            }
        })
        .await
        .unwrap()
    }

    /// Waits for the source to be backing off with an error containing
    /// `text`; returns the error.
    pub async fn backing_off_with(&self, text: &str) -> String {
        let last_error = || match self.status.snapshot().source {
            SourceState::BackingOff { last_error, .. } => Some(last_error),
            _ => None,
        };
        wait_until(&format!("a back-off naming {text:?}"), WAIT, || {
            let found = last_error().is_some_and(|e| e.contains(text));
            async move { found }
        })
        .await;
        last_error().unwrap_or_default()
    }

    /// Waits until the upstream required a reset and the change log recorded
    /// it; returns the reason.
    pub async fn wait_for_reset(&self) -> String {
        let st = self.status.clone();
        wait_until("reset required", WAIT, || {
            let s = st.snapshot();
            async move { s.reset_required }
        })
        .await;
        let spec = self.spec();
        wait_until("the change log to record the reset", WAIT, || {
            let spec = spec.clone();
            async move { spec.replication().await.2 }
        })
        .await;
        self.status.snapshot().reset_reason.unwrap_or_default()
    }
}
