//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use sluice::plugin::{Limits, NetGrant, Registry};
use sluice::status::Status;
use sluice::storage::sqlite::{Durability, SqliteChangeLog};
use sluice::streamer::{Streamer, StreamerOptions};
use tokio::sync::watch;

/// `target/plugins`, where `make plugins` puts the bundled plugins.
pub fn plugin_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins");
    assert!(
        dir.join("mock-source.wasm").exists(),
        "{} has no mock-source.wasm: run `make plugins` (make test does)",
        dir.display()
    );
    dir
}

pub fn lexi(n: u64) -> String {
    sluice::watermark::to_lexi(n as u128)
}

/// Polls `check` until it holds, failing the test after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A change log row as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub watermark: String,
    pub pos: i64,
    pub tag: String,
    pub change: String,
    pub precommit: Option<String>,
}

pub fn rows(db: &Path) -> Vec<Row> {
    let c = Connection::open(db).unwrap();
    let mut stmt =
        c.prepare(r#"SELECT watermark, pos, tag, change, precommit FROM "changeLog" ORDER BY watermark, pos"#).unwrap();
    stmt.query_map([], |r| {
        Ok(Row { watermark: r.get(0)?, pos: r.get(1)?, tag: r.get(2)?, change: r.get(3)?, precommit: r.get(4)? })
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

pub fn last_watermark(db: &Path) -> String {
    let c = Connection::open(db).unwrap();
    c.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0)).unwrap()
}

/// Distinct commit watermarks in the log, in order (excluding the seed).
pub fn committed(db: &Path) -> Vec<String> {
    rows(db).into_iter().filter(|r| r.tag == "commit" && r.pos > 1).map(|r| r.watermark).collect()
}

/// Checks that every transaction in the log is whole: begin at pos 0,
/// consecutive positions, a commit last.
pub fn assert_whole_transactions(db: &Path) {
    let all = rows(db);
    let mut i = 0;
    while i < all.len() {
        let w = &all[i].watermark;
        let tx: Vec<&Row> = all[i..].iter().take_while(|r| &r.watermark == w).collect();
        assert_eq!(tx[0].tag, "begin", "transaction {w} starts with begin");
        assert_eq!(tx.last().unwrap().tag, "commit", "transaction {w} ends with commit");
        for (p, r) in tx.iter().enumerate() {
            assert_eq!(r.pos, p as i64, "transaction {w} positions are consecutive");
        }
        assert_eq!(tx.last().unwrap().precommit.as_deref(), Some(w.as_str()));
        i += tx.len();
    }
}

/// A streamer on the mock-source plugin and a SQLite log in `dir`.
pub struct Harness {
    pub db: PathBuf,
    pub status: Arc<Status>,
    stop: watch::Sender<bool>,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

pub async fn start_mock(dir: &Path, config: serde_json::Value, limits: Limits) -> Harness {
    let registry = Registry::load(&plugin_dir(), Some(dir.join("cache"))).await.unwrap();
    let source = registry.source("mock-source", config.to_string(), limits, NetGrant::default()).unwrap();
    start(dir, Box::new(source), StreamerOptions::default())
}

pub fn start(dir: &Path, source: Box<dyn sluice::source::ChangeSource>, options: StreamerOptions) -> Harness {
    let db = dir.join("log.db");
    let log = SqliteChangeLog::open(&db, Durability::Full).unwrap();
    let status = Arc::new(Status::default());
    let (stop, stop_rx) = watch::channel(false);
    let hub = sluice::hub::Hub::new(Arc::new(sluice::storage::sqlite::SqliteReader::new(&db)), status.clone());
    let streamer = Streamer::new(source, Box::new(log), hub, options, status.clone());
    let task = tokio::spawn(streamer.run(stop_rx));
    Harness { db, status, stop, task }
}

impl Harness {
    pub async fn wait_for_watermark(&self, w: &str, timeout: Duration) {
        let status = self.status.clone();
        wait_until(&format!("lastWatermark {w}"), timeout, || {
            let s = status.snapshot();
            async move { s.last_watermark.as_deref() >= Some(w) }
        })
        .await;
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await.unwrap()
    }
}
