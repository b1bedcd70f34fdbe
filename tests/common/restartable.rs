//! Sluice in-process over a SQLite change log, whose replication loop a test
//! stops and starts again (on a new source each time) while the endpoint
//! and its subscribers stay: the harness of the source tests.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
