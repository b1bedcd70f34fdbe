//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod faultproxy;
pub mod feed;
pub mod host;
pub mod mariadb;
pub mod oracle;
pub mod pgserver;
pub mod pki;
pub mod process;
pub mod replica;
pub mod restartable;
pub mod ws;
pub mod zero_cache;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use sluice::plugin::{NetGrant, Registry, SandboxLimits};
use sluice::service::{Service, ServiceConfig};
use sluice::status::Status;
use sluice::storage::open::LogStore;
use sluice::storage::postgres::PgSettings;
use sluice::storage::{ChangeLog, LogReader};
use sluice::streamer::StreamerOptions;
use tokio::sync::watch;

/// Generates a `sqlite` and a `postgres` test for each storage test
/// function `name(backend: Backend)`.
#[allow(unused_macros)]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name(super::Backend::Sqlite).await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name(super::Backend::Postgres).await
                }
            }
        )*
    };
}

/// `target/test-plugins`, where `make test-plugins` puts the bundled plugins
/// and the test-only ones.
pub fn plugin_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-plugins");
    assert!(
        dir.join("mock-source.wasm").exists() && dir.join("bad-filter.wasm").exists(),
        "{} lacks mock-source.wasm or bad-filter.wasm: run `make test-plugins` (make test does)",
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

/// Waits until the change log's last watermark is `w`.
pub async fn wait_stored(status: &Arc<Status>, w: &str) {
    let st = status.clone();
    wait_until(&format!("{w} stored"), Duration::from_secs(30), || {
        let s = st.snapshot();
        async move { s.last_watermark.as_deref() == Some(w) }
    })
    .await;
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

/// Which change log a test runs against. The storage tests run on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The Postgres server for tests: `SLUICE_TEST_PG_URL`, which `make test`
/// sets after starting a private server (tests/pg/with-postgres.sh).
pub fn pg_url() -> String {
    std::env::var("SLUICE_TEST_PG_URL").unwrap_or_else(|_| {
        panic!(
            "this test needs PostgreSQL: run it through `make test` (which starts a private server), \
             or `tests/pg/with-postgres.sh cargo test`, or set SLUICE_TEST_PG_URL to a superuser URL"
        )
    })
}

/// One change log for a test: a SQLite file, or a schema of its own in the
/// test Postgres server.
#[derive(Debug, Clone)]
pub struct LogSpec {
    pub backend: Backend,
    pub sqlite: PathBuf,
    pub pg: Option<PgSettings>,
}

impl LogSpec {
    pub fn new(backend: Backend, dir: &Path) -> LogSpec {
        Self::with_task(backend, dir, "sluice")
    }

    pub fn with_task(backend: Backend, dir: &Path, task_id: &str) -> LogSpec {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let pg = (backend == Backend::Postgres).then(|| {
            let app_id = format!("t{}x{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            PgSettings {
                target: sluice::pgconn::PgTarget::parse(&pg_url()).unwrap(),
                // Per test, so a test can find (and cut) its own connections.
                application_name: format!("sluice-test-{app_id}"),
                synchronous_commit: true,
                app_id,
                shard_num: 0,
                task_id: task_id.to_string(),
                statement_timeout: Duration::from_secs(20),
                call_timeout: sluice::storage::postgres::DEFAULT_CALL_TIMEOUT,
            }
        });
        LogSpec { backend, sqlite: dir.join("log.db"), pg }
    }

    /// The same log, written by another host.
    pub fn as_task(&self, task_id: &str) -> LogSpec {
        let mut other = self.clone();
        if let Some(pg) = other.pg.as_mut() {
            pg.task_id = task_id.to_string();
        }
        other
    }

    /// Every row of the log's table state, paged from one snapshot, with
    /// whether the state is kept.
    pub async fn state(&self) -> (bool, Vec<sluice::storage::StateRow>) {
        let reader = self.reader();
        tokio::task::spawn_blocking(move || {
            let mut snapshot = reader.snapshot().unwrap();
            let kept = snapshot.state_kept().unwrap();
            let mut rows = Vec::new();
            loop {
                let cursor = rows.last().map(|r: &sluice::storage::StateRow| (r.table.clone(), r.key.clone()));
                let page = snapshot.state_rows(cursor.as_ref().map(|(t, k)| (t.as_str(), k.as_str())), 1000).unwrap();
                if page.is_empty() {
                    return (kept, rows);
                }
                rows.extend(page);
            }
        })
        .await
        .unwrap()
    }

    /// The store, as `sluice run` opens it.
    pub fn store(&self) -> LogStore {
        match &self.pg {
            None => LogStore::sqlite(&self.sqlite),
            Some(pg) => LogStore::postgres(pg.clone()),
        }
    }

    /// A reader of the log (no writer).
    pub fn reader(&self) -> Arc<dyn LogReader> {
        self.store().reader().unwrap()
    }

    /// The log's writer and a reader. The tests keep the table state, so
    /// every run also exercises it.
    pub fn open(&self) -> (Box<dyn ChangeLog>, Arc<dyn LogReader>) {
        let log = tokio::task::block_in_place(|| self.store().open(true)).unwrap();
        (log.writer, log.reader)
    }

    pub async fn pg_client(&self) -> sluice::pgconn::PgClient {
        let target = &self.pg.as_ref().expect("a Postgres log").target;
        sluice::pgconn::connect(target, &target.config).await.unwrap()
    }

    pub fn schema(&self) -> String {
        self.pg.as_ref().expect("a Postgres log").schema()
    }

    pub async fn rows(&self) -> Vec<Row> {
        match self.backend {
            Backend::Sqlite => {
                let c = Connection::open(&self.sqlite).unwrap();
                let mut stmt = c
                    .prepare(
                        r#"SELECT watermark, pos, tag, change, precommit FROM "changeLog" ORDER BY watermark, pos"#,
                    )
                    .unwrap();
                stmt.query_map([], |r| {
                    Ok(Row {
                        watermark: r.get(0)?,
                        pos: r.get(1)?,
                        tag: r.get(2)?,
                        change: r.get(3)?,
                        precommit: r.get(4)?,
                    })
                })
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
            }
            Backend::Postgres => {
                let c = self.pg_client().await;
                let sql = format!(
                    r#"SELECT watermark, pos, change->>'tag', change::text, precommit FROM {}."changeLog" ORDER BY watermark, pos"#,
                    self.schema()
                );
                c.query(&sql, &[])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| Row {
                        watermark: r.get(0),
                        pos: r.get(1),
                        tag: r.get(2),
                        change: r.get(3),
                        precommit: r.get(4),
                    })
                    .collect()
            }
        }
    }

    pub async fn last_watermark(&self) -> String {
        self.replication().await.1
    }

    /// (replicaVersion, lastWatermark, resetRequired)
    pub async fn replication(&self) -> (String, String, bool) {
        match self.backend {
            Backend::Sqlite => {
                let c = Connection::open(&self.sqlite).unwrap();
                let (rv, reset): (String, bool) = c
                    .query_row(r#"SELECT replicaVersion, resetRequired FROM "replicationConfig""#, [], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })
                    .unwrap();
                let last: String =
                    c.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0)).unwrap();
                (rv, last, reset)
            }
            Backend::Postgres => {
                let c = self.pg_client().await;
                let s = self.schema();
                let cfg = c
                    .query_one(
                        &format!(r#"SELECT "replicaVersion", "resetRequired" FROM {s}."replicationConfig""#),
                        &[],
                    )
                    .await
                    .unwrap();
                let st =
                    c.query_one(&format!(r#"SELECT "lastWatermark" FROM {s}."replicationState""#), &[]).await.unwrap();
                (cfg.get(0), st.get(0), cfg.get::<_, Option<bool>>(1).unwrap_or(false))
            }
        }
    }

    /// (replicaVersion, lastWatermark) as recorded, or `None` where the log
    /// records no lineage (or does not exist yet).
    pub async fn lineage(&self) -> Option<(String, String)> {
        match self.backend {
            Backend::Sqlite => {
                let c = Connection::open(&self.sqlite).ok()?;
                c.query_row(
                    r#"SELECT c.replicaVersion, s.lastWatermark FROM "replicationConfig" c, "replicationState" s"#,
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .ok()
            }
            Backend::Postgres => {
                // One table per statement: a storage transaction of a host
                // that was just killed may still hold (and be taking) its
                // locks until its backend notices, and a join could deadlock
                // with it.
                let c = self.pg_client().await;
                let s = self.schema();
                let read = async |sql: String| match c.query_opt(&sql, &[]).await {
                    Ok(row) => row.map(|r| r.get::<_, String>(0)),
                    // Killed before it created its schema or tables.
                    Err(e)
                        if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE)
                            || e.code() == Some(&tokio_postgres::error::SqlState::INVALID_SCHEMA_NAME) =>
                    {
                        None
                    }
                    Err(e) => panic!("{sql}: {e} {:?}", e.as_db_error()),
                };
                let last = read(format!(r#"SELECT "lastWatermark" FROM {s}."replicationState""#)).await;
                let rv = read(format!(r#"SELECT "replicaVersion" FROM {s}."replicationConfig""#)).await;
                match (rv, last) {
                    (Some(rv), Some(last)) => Some((rv, last)),
                    (None, None) => None,
                    other => panic!("replicationConfig and replicationState disagree: {other:?}"),
                }
            }
        }
    }

    /// Distinct commit watermarks in the log, in order (excluding the seed).
    pub async fn committed(&self) -> Vec<String> {
        self.rows().await.into_iter().filter(|r| r.tag == "commit" && r.pos > 1).map(|r| r.watermark).collect()
    }

    /// Every transaction in the log is whole: begin at pos 0, consecutive
    /// positions, a commit last (with precommit set on SQLite, as Zero does).
    pub async fn assert_whole(&self) {
        let all = self.rows().await;
        let mut i = 0;
        while i < all.len() {
            let w = &all[i].watermark;
            let tx: Vec<&Row> = all[i..].iter().take_while(|r| &r.watermark == w).collect();
            assert_eq!(tx[0].tag, "begin", "transaction {w} starts with begin");
            assert_eq!(tx.last().unwrap().tag, "commit", "transaction {w} ends with commit");
            for (p, r) in tx.iter().enumerate() {
                assert_eq!(r.pos, p as i64, "transaction {w} positions are consecutive");
            }
            if tx.len() > 2 || self.backend == Backend::Sqlite {
                assert_eq!(tx.last().unwrap().precommit.as_deref(), Some(w.as_str()));
            }
            i += tx.len();
        }
        self.assert_state_follows_the_log(&all).await;
    }

    /// The table state, where the log keeps one and still holds its whole
    /// lineage, equals the log's row changes folded by key, computed here
    /// independently of Sluice's own code. Logs with schema changes beyond
    /// create-table and create-index are not modelled and are left out.
    async fn assert_state_follows_the_log(&self, all: &[Row]) {
        use serde_json::{Map, Value};
        type Key = (Value, Value);
        let Some(first) = all.first() else { return };
        if first.watermark != self.replication().await.0 {
            return; // purged: the log no longer holds the whole lineage
        }
        let reader = self.reader();
        let state = tokio::task::spawn_blocking(move || {
            let mut snapshot = reader.snapshot().unwrap();
            if !snapshot.state_kept().unwrap() {
                return None;
            }
            let mut rows = Vec::new();
            let mut after: Option<(String, String)> = None;
            loop {
                let cursor = after.as_ref().map(|(t, k)| (t.as_str(), k.as_str()));
                let page = snapshot.state_rows(cursor, 1000).unwrap();
                let Some(last) = page.last() else { return Some(rows) };
                after = Some((last.table.clone(), last.key.clone()));
                rows.extend(page);
            }
        })
        .await
        .unwrap();
        let Some(state) = state else { return };
        let table_of = |rel: &Value| Value::from(vec![rel["schema"].clone(), rel["name"].clone()]);
        let key_of = |rel: &Value, row: &Value| -> Value {
            let columns = rel["rowKey"]["columns"].as_array().cloned().unwrap_or_default();
            Value::from(columns.iter().map(|c| row[c.as_str().unwrap()].clone()).collect::<Vec<_>>())
        };
        let mut folded: std::collections::HashMap<Key, Map<String, Value>> = Default::default();
        for r in all {
            let v: Value = serde_json::from_str(&r.change).unwrap();
            match r.tag.as_str() {
                "begin" | "commit" | "create-table" | "create-index" => {}
                "insert" | "update" => {
                    let rel = &v["relation"];
                    let new_key = (table_of(rel), key_of(rel, &v["new"]));
                    let mut row = Map::new();
                    if !v["key"].is_null() {
                        let old_key = (table_of(rel), key_of(rel, &v["key"]));
                        row = folded.remove(&old_key).unwrap_or_default();
                    }
                    if let Some(existing) = folded.remove(&new_key) {
                        row = existing.into_iter().chain(row).collect();
                    }
                    row.extend(v["new"].as_object().unwrap().clone());
                    folded.insert(new_key, row);
                }
                "delete" => {
                    let rel = &v["relation"];
                    folded.remove(&(table_of(rel), key_of(rel, &v["key"])));
                }
                "truncate" => {
                    for rel in v["relations"].as_array().unwrap() {
                        let t = table_of(rel);
                        folded.retain(|(table, _), _| *table != t);
                    }
                }
                _ => return,
            }
        }
        let state: std::collections::HashMap<Key, Map<String, Value>> = state
            .into_iter()
            .map(|r| {
                let row: Value = serde_json::from_str(&r.row).unwrap();
                let key = (serde_json::from_str(&r.table).unwrap(), serde_json::from_str(&r.key).unwrap());
                (key, row.as_object().unwrap().clone())
            })
            .collect();
        assert_eq!(state.len(), folded.len(), "the table state holds as many rows as the log's changes leave");
        for (key, row) in &folded {
            assert_eq!(state.get(key), Some(row), "the table state's row {key:?} is the log's");
        }
    }
}

/// Sluice on a source, over a change log, assembled as `sluice run` does
/// (endpoint on a free port), without cleanup, so a test sees every row.
pub struct Harness {
    pub status: Arc<Status>,
    pub hub: Arc<sluice::hub::Hub>,
    pub service: Service,
}

pub async fn start_mock(spec: &LogSpec, config: serde_json::Value, limits: SandboxLimits) -> Harness {
    let dir = spec.sqlite.parent().unwrap().to_path_buf();
    let registry = Arc::new(Registry::load(&plugin_dir(), Some(dir.join("cache"))).await.unwrap());
    let source = registry.source("mock-source", config.to_string(), limits, NetGrant::default()).await.unwrap();
    start(spec, Box::new(source), StreamerOptions::default()).await
}

pub async fn start(spec: &LogSpec, source: Box<dyn sluice::source::ChangeSource>, options: StreamerOptions) -> Harness {
    let (log, reader) = spec.open();
    let config = ServiceConfig {
        // What the test's options say is recorded as the owner's address.
        advertise: Some(options.advertise.clone()),
        streamer: options,
        cleanup: None,
        ..ServiceConfig::new(source, log, reader)
    };
    let service = Service::start(config).await.unwrap();
    Harness { status: service.status().clone(), hub: service.hub().clone(), service }
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
        self.service.stop().await
    }

    /// Resolves when the replication loop ends by itself (with its error).
    pub async fn finished(&mut self) -> anyhow::Result<()> {
        self.service.finished().await
    }

    pub fn is_finished(&self) -> bool {
        self.service.is_finished()
    }
}

/// The subscriber endpoint (no filters, default limits) on a free port.
pub struct Served {
    pub addr: String,
    pub status: Arc<Status>,
    pub hub: Arc<sluice::hub::Hub>,
    /// Dropping it stops the server.
    pub stop: watch::Sender<bool>,
}

/// The subscriber endpoint for an existing hub (a streamer's).
pub async fn serve_hub(hub: Arc<sluice::hub::Hub>, status: Arc<Status>) -> Served {
    let (stop, stop_rx) = watch::channel(false);
    let app = sluice::server::AppState {
        hub: hub.clone(),
        status: status.clone(),
        subscriber_limits: sluice::subscriber::Limits::default(),
        ping_interval: Duration::from_secs(30),
        filters: sluice::filter::FilterHost::none(),
        zero_permissions: None,
        access: sluice::server::access::Access::open(),
        ready_backoff: Duration::from_secs(30),
        shutdown: stop_rx.clone(),
        plugins: None,
    };
    let (addr, serve) = sluice::server::bind("127.0.0.1:0", sluice::server::router(app), stop_rx).await.unwrap();
    tokio::spawn(serve);
    Served { addr: addr.to_string(), status, hub, stop }
}

/// Sends the host's logs to the test output (shown for failing tests).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("sluice=debug").try_init();
}
