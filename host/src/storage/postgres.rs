//! The change log in a Postgres change DB, in Zero's own schema
//! (`"<appID>_<shardNum>/cdc"`, version 6), so several hosts can share it
//! with one writer at a time and Zero's view-syncers discover the writer
//! from `replicationState.ownerAddress`.
//!
//! Ownership: each storage transaction first locks the `replicationState`
//! row (`FOR UPDATE`) and checks at commit that this host still owns the
//! log; a host that took over makes this one stop without writing another
//! row, and a takeover waits for an open transaction. Lock order is always
//! `replicationState`, then `changeLog`, then the `replicationState` update.
//!
//! The calls are blocking (the storer runs on its own thread); each one
//! drives tokio-postgres on the runtime through `Handle::block_on`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::runtime::Handle;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use crate::pgconn::{self, PgClient, PgTarget};

use super::{
    Bounds, ChangeLog, LogError, LogReader, LogResult, LogRow, LogSnapshot, LogState, NewLineage, StateRow, StoredRow,
};

/// The current schema version of Zero's change DB, and the oldest it reads.
const SCHEMA_VERSION: i32 = 6;
const MIN_SAFE_VERSION: i32 = 1;

/// The default of [`PgSettings::call_timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Connection settings shared by the writer and the readers.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// The change DB (`--change-db`), TLS settings included.
    pub target: PgTarget,
    pub app_id: String,
    pub shard_num: u32,
    pub task_id: String,
    pub statement_timeout: Duration,
    /// The longest one call may wait for the change DB's answer before the
    /// connection is given up as dead (`--change-db-timeout-ms`): a silent
    /// network path is never noticed by the server-side `statement_timeout`,
    /// which needs the server to hear from the client.
    pub call_timeout: Duration,
    /// Zero's change-streamer connects as `zero-change-streamer`.
    pub application_name: String,
    /// `synchronous_commit` for this host's sessions: on (durable at commit,
    /// the default) or off (`--sync normal`: a server crash may lose the last
    /// commits, never corrupt the log).
    pub synchronous_commit: bool,
}

impl PgSettings {
    /// `"zero_0/cdc"`, quoted: the `/` makes quoting mandatory.
    pub fn schema(&self) -> String {
        quote_ident(&self.schema_name())
    }

    /// `zero_0/cdc`, as it appears in the catalog.
    pub fn schema_name(&self) -> String {
        format!("{}_{}/cdc", self.app_id, self.shard_num)
    }

    async fn connect(&self) -> anyhow::Result<PgClient> {
        let mut config = self.target.config.clone();
        config.application_name(&self.application_name);
        let client = pgconn::connect(&self.target, &config).await.map_err(|e| {
            // The error itself follows in the chain; the context adds what to change.
            let what = format!("connecting to the change DB {}", self.target.describe());
            let password = e.text().contains("password").then(|| self.target.password_hint()).flatten();
            let context = match pgconn::tls_hint(&e.text(), &self.target).or(password) {
                Some(hint) => format!("{what} ({hint})"),
                None => what,
            };
            anyhow::Error::new(e).context(context)
        })?;
        let settings = format!(
            "SET statement_timeout = {}; SET synchronous_commit = {}; {}",
            self.statement_timeout.as_millis(),
            if self.synchronous_commit { "on" } else { "off" },
            server_side_liveness(self.call_timeout),
        );
        within(self.call_timeout, "setting up the session", async {
            client.batch_execute(&settings).await.context("setting up the change DB session")
        })
        .await?;
        // Newer servers also bound unacknowledged sends (12 and later) and
        // notice a vanished client during a long statement (14 and later);
        // older ones do not know the settings, and do without.
        let newer = [
            format!("SET tcp_user_timeout = {}", pgconn::conninfo::TCP_USER_TIMEOUT.as_millis()),
            "SET client_connection_check_interval = 2000".to_string(),
        ];
        for sql in newer {
            let _ = within(self.call_timeout, "setting up the session", async { Ok(client.batch_execute(&sql).await) })
                .await;
        }
        Ok(client)
    }

    /// How long a session may wait for its client's data in the middle of
    /// a statement before a writer waiting for its lock ends it: twice the
    /// call timeout, as for a transaction left idle.
    fn stuck_after(&self) -> Duration {
        self.call_timeout * 2
    }

    /// A writer's connection: as [`PgSettings::connect`], and a transaction
    /// left idle by a client that vanished is ended by the server (its row
    /// locks would otherwise block a standby's takeover until TCP noticed,
    /// two hours with the kernel's defaults).
    async fn connect_writer(&self) -> anyhow::Result<PgClient> {
        let client = self.connect().await?;
        let idle = self.call_timeout * 2;
        let sql = format!("SET idle_in_transaction_session_timeout = {}", idle.as_millis());
        within(self.call_timeout, "setting up the session", async {
            client.batch_execute(&sql).await.context("setting idle_in_transaction_session_timeout")
        })
        .await?;
        Ok(client)
    }
}

/// Session settings with which the server itself notices a client whose
/// machine died (TCP keepalive on the server's end; `tcp_user_timeout` is
/// set where the server has it), and gives up waiting for a lock before the client gives up waiting for
/// the server, so the error says who holds it.
fn server_side_liveness(call_timeout: Duration) -> String {
    let lock_wait = call_timeout.saturating_sub(Duration::from_secs(1)).max(Duration::from_millis(500));
    format!(
        "SET lock_timeout = {}; SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; \
         SET tcp_keepalives_count = {}",
        lock_wait.as_millis(),
        pgconn::conninfo::KEEPALIVES_IDLE.as_secs(),
        pgconn::conninfo::KEEPALIVES_INTERVAL.as_secs(),
        pgconn::conninfo::KEEPALIVES_RETRIES,
    )
}

/// The change DB did not answer a call within its deadline.
#[derive(Debug, thiserror::Error)]
#[error(
    "the change DB did not answer within {} s while {what}; the connection was dropped (a silent network path or a stuck server)",
    .limit.as_secs_f64()
)]
pub struct NoAnswer {
    pub limit: Duration,
    pub what: String,
}

/// `work`, or [`NoAnswer`] once `limit` has passed.
async fn within<T>(
    limit: Duration,
    what: &str,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, work).await {
        Ok(result) => result,
        Err(_) => Err(NoAnswer { limit, what: what.to_string() }.into()),
    }
}

/// `e`, classified; when it is a lock wait that timed out, with who holds
/// the `replicationState` lock and since when, so an operator can tell a
/// live owner from the session of a host that vanished.
///
/// A holder that has been waiting for its own client's data, in the middle
/// of a statement (a `COPY FROM STDIN` cut by a silent network path), for
/// longer than `stuck_after` is ended here: the server's timeouts never end
/// it (`statement_timeout` is acted on only when data arrives, and the
/// session is not idle), and its keepalives may be answered by a middlebox,
/// so it would hold the lock indefinitely. A live client never leaves a
/// statement half-sent for that long: each call gives up after
/// `--change-db-timeout-ms` and drops its connection.
async fn lock_wait_error(
    c: &Client,
    s: &str,
    e: tokio_postgres::Error,
    what: &str,
    stuck_after: Duration,
) -> anyhow::Error {
    if e.code() != Some(&SqlState::LOCK_NOT_AVAILABLE) {
        return classify(e, what);
    }
    let holders = c
        .query(
            "SELECT DISTINCT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local socket'), \
                    coalesce(a.state, '?'), coalesce(a.wait_event, ''), \
                    extract(epoch FROM now() - a.state_change)::float8, \
                    bool_or(l.mode IN ('RowShareLock', 'RowExclusiveLock')) OVER (PARTITION BY a.pid) \
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() \
               AND l.relation = $1::text::regclass",
            &[&format!(r#"{s}."replicationState""#)],
        )
        .await;
    let mut ended = Vec::new();
    let who = match holders {
        Ok(rows) if !rows.is_empty() => {
            let mut described = Vec::new();
            for r in &rows {
                let (pid, state, wait) = (r.get::<_, i32>(0), r.get::<_, String>(3), r.get::<_, String>(4));
                let secs = r.get::<_, Option<f64>>(5).unwrap_or(0.0);
                let waiting = if wait.is_empty() { String::new() } else { format!(", waiting on {wait}") };
                described.push(format!(
                    "pid {pid} ({} from {}, {state}{waiting} for {secs:.0} s)",
                    r.get::<_, String>(1),
                    r.get::<_, String>(2),
                ));
                // Only a writer's lock (`FOR UPDATE`, `UPDATE`) blocks a takeover.
                let writer = r.get::<_, Option<bool>>(6).unwrap_or(false);
                if writer && state == "active" && wait == "ClientRead" && secs > stuck_after.as_secs_f64() {
                    ended.push(end_stuck_session(c, pid, secs).await);
                }
            }
            described.join(", ")
        }
        Ok(_) => "a session that has just let go of it".into(),
        Err(_) => "a session Sluice could not look up".into(),
    };
    let outcome = if ended.is_empty() {
        "a live owner lets go at its next commit, and the server ends the session of an owner whose client \
         vanished once it has been idle in its transaction for idle_in_transaction_session_timeout (twice \
         --change-db-timeout-ms)"
            .to_string()
    } else {
        ended.join("; ")
    };
    anyhow::Error::new(e).context(format!("{what}: the replicationState row is held by {who}; {outcome}"))
}

/// Ends session `pid`, left in the middle of a statement by a client that
/// went silent `secs` ago; says what happened, for the retry line.
async fn end_stuck_session(c: &Client, pid: i32, secs: f64) -> String {
    let ended = c.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await;
    match ended {
        Ok(row) if row.get::<_, bool>(0) => {
            tracing::warn!(
                "ended the change DB session pid {pid}: it held the replicationState lock while waiting {secs:.0} s \
                 for data its client never sent (a client cut off in the middle of a statement)"
            );
            format!("ended pid {pid}, which had waited {secs:.0} s for its client in the middle of a statement; the next attempt takes the lock")
        }
        Ok(_) => format!("pid {pid} had waited {secs:.0} s for its client, but is already gone"),
        Err(e) => format!(
            "pid {pid} has waited {secs:.0} s for its client in the middle of a statement, and could not be ended \
             ({e}; the change DB role needs pg_signal_backend, or to be the role of that session)"
        ),
    }
}

pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Turns Postgres errors that mean "stop" into [`LogError`]s that stop.
fn classify(e: tokio_postgres::Error, what: &str) -> anyhow::Error {
    if let Some(db) = e.as_db_error() {
        if *db.code() == SqlState::UNDEFINED_TABLE || *db.code() == SqlState::INVALID_SCHEMA_NAME {
            return LogError::Gone(format!("{what}: {}", db.message())).into();
        }
    }
    anyhow::Error::new(e).context(what.to_string())
}

pub struct PostgresChangeLog {
    settings: PgSettings,
    schema: String,
    rt: Handle,
    client: Option<Arc<PgClient>>,
    /// The prepared batch COPY, for the current connection.
    insert: Option<tokio_postgres::Statement>,
    /// The change-log COPY the last `append` sent, not yet answered: the
    /// server works through it while the storer gathers and encodes the
    /// next batch. Every other call on the connection waits for it first
    /// (`settle`), so its failure fails the storage transaction as before.
    copying: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// The owner read at the start of the open storage transaction.
    owner_at_begin: Option<Option<String>>,
    /// A storage transaction is open on `client`: a lost connection must
    /// fail it, never be replaced under it (the server rolled back what was
    /// written, and a fresh connection would commit the rest on its own).
    in_transaction: bool,
    /// Keep the table state (opt-in: `with_table_state`).
    state_enabled: bool,
    /// The table state is kept for the current lineage and is up to date
    /// (read at each `begin`; see `STATE_KEPT`).
    keep_state: bool,
    /// The relation object last written per table; forgotten on rollback.
    relations: HashMap<String, String>,
}

/// Whether the table state is kept for the recorded lineage and was
/// updated with the last commit: `stateWatermark` moves with
/// `lastWatermark` in every commit that keeps the state, so a log written
/// meanwhile by a Sluice that does not know the state (it cannot clear it)
/// shows as not kept.
const STATE_KEPT: &str = r#"(SELECT count(*) FROM {s}."stateConfig" c
      JOIN {s}."replicationConfig" r ON r."replicaVersion" = c."replicaVersion"
      JOIN {s}."replicationState" st ON st."lastWatermark" = c."stateWatermark")"#;

async fn state_kept(c: &Client, s: &str) -> anyhow::Result<bool> {
    let kept: i64 = c
        .query_one(&format!("SELECT {}", STATE_KEPT.replace("{s}", s)), &[])
        .await
        .map_err(|e| classify(e, "reading the table state's lineage"))?
        .get(0);
    Ok(kept > 0)
}

impl PostgresChangeLog {
    /// Connects and creates the schema if it does not exist.
    /// [`PostgresChangeLog::open`], waiting out a change DB that cannot be
    /// reached yet or is restarting (a host restarted beside its database
    /// must come up, not exit): one line per attempt, with back-off.
    /// Configuration errors (authentication, a missing database) fail at once.
    pub fn open_when_reachable(settings: PgSettings, rt: Handle, give_up_after: Duration) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let mut delay = Duration::from_millis(100);
        loop {
            match PostgresChangeLog::open(settings.clone(), rt.clone()) {
                Ok(log) => return Ok(log),
                Err(e) if is_unreachable(&e) && started.elapsed() < give_up_after => {
                    tracing::warn!("change DB not reachable ({e:#}); retrying in {} ms", delay.as_millis());
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub fn open(settings: PgSettings, rt: Handle) -> anyhow::Result<Self> {
        let schema = settings.schema();
        let mut log = PostgresChangeLog {
            settings,
            schema,
            rt,
            client: None,
            insert: None,
            copying: None,
            owner_at_begin: None,
            in_transaction: false,
            state_enabled: false,
            keep_state: false,
            relations: HashMap::new(),
        };
        log.setup()?;
        Ok(log)
    }

    /// Keeps the compacted table state beside the log, from the next
    /// lineage on; without it, a state kept by an earlier run is marked as
    /// no longer kept (see the SQLite log).
    pub fn with_table_state(mut self, on: bool) -> anyhow::Result<Self> {
        self.state_enabled = on;
        let s = self.schema.clone();
        let kept = self.run(async |c| state_kept(c, &s).await)?;
        if on && !kept && self.state()?.is_some() {
            tracing::warn!("the table state is kept from the change log's next lineage on (this one began without it)");
        } else if !on {
            let removed = self.run(async |c| {
                c.execute(&format!(r#"DELETE FROM {s}."stateConfig""#), &[])
                    .await
                    .map_err(|e| classify(e, "clearing the table state's lineage"))
            })?;
            if removed > 0 {
                tracing::warn!(
                    "the table state is no longer kept for this lineage (Sluice runs without --table-state)"
                );
            }
        }
        Ok(self)
    }

    /// The live connection, reconnecting after a loss between storage
    /// transactions only.
    fn client(&mut self) -> anyhow::Result<&Client> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            anyhow::ensure!(
                !self.in_transaction,
                "the change DB connection was lost inside a storage transaction (the server rolled it back)"
            );
            let settings = self.settings.clone();
            self.insert = None;
            self.client = None;
            self.client = Some(Arc::new(self.rt.block_on(settings.connect_writer())?));
        }
        Ok(self.client.as_deref().expect("connected above"))
    }

    /// Waits for the COPY in flight, if any (bounded as every storage call
    /// is, inside it); a connection that stopped answering is dropped as in
    /// [`Self::run`].
    fn settle(&mut self) -> LogResult<()> {
        let Some(copying) = self.copying.take() else { return Ok(()) };
        let result = match self.rt.block_on(copying) {
            Ok(result) => result,
            Err(e) => Err(anyhow::anyhow!("the change-log COPY's task ended: {e}")),
        };
        if result.as_ref().is_err_and(|e| e.downcast_ref::<NoAnswer>().is_some()) {
            self.client = None;
            self.insert = None;
        }
        result.map_err(LogError::from)
    }

    /// Applies the rows to the table state (see the SQLite log's
    /// `keep_state`; a change the state cannot follow turns it off).
    fn keep_state(&mut self, rows: &[LogRow<'_>]) -> anyhow::Result<()> {
        if !self.keep_state {
            return Ok(());
        }
        let s = self.schema.clone();
        // The plan borrows the relations while the call borrows the log.
        let mut relations = std::mem::take(&mut self.relations);
        let mut plan = super::postgres_state::Plan::new(&s, &mut relations);
        let mut failed = None;
        for row in rows {
            if let Err(e) = super::state::apply(&mut plan, (row.watermark, row.pos), row.tag, row.change) {
                failed = Some(e);
                break;
            }
        }
        match failed {
            None => {
                let result = self.run(async |c| plan.run(c).await.context("keeping the table state"));
                self.relations = relations;
                Ok(result?)
            }
            Some(e) => {
                drop(plan);
                self.relations = relations;
                tracing::error!("{e:#}; the table state is no longer kept for this lineage");
                self.keep_state = false;
                self.run(async |c| {
                    c.execute(&format!(r#"DELETE FROM {s}."stateConfig""#), &[])
                        .await
                        .map_err(|e| classify(e, "turning the table state off"))
                })?;
                Ok(())
            }
        }
    }

    /// Whether the connection is open (a test waits on this after cutting it).
    pub fn connected(&self) -> bool {
        self.client.as_ref().is_some_and(|c| !c.is_closed())
    }

    /// One call on the writer's connection, within the call deadline. A
    /// call that passes it drops the connection: inside a storage
    /// transaction the next call fails (the storer rolls back and the loop
    /// retries from what is durable), and the next `begin` reconnects.
    fn run<T>(&mut self, f: impl AsyncFnOnce(&Client) -> anyhow::Result<T>) -> LogResult<T> {
        self.settle()?;
        let rt = self.rt.clone();
        let limit = self.settings.call_timeout;
        let client = self.client()?;
        let result = rt.block_on(within(limit, "waiting for a storage call", f(client)));
        if result.as_ref().is_err_and(|e| e.downcast_ref::<NoAnswer>().is_some()) {
            self.client = None;
            self.insert = None;
        }
        result.map_err(LogError::from)
    }

    fn setup(&mut self) -> anyhow::Result<()> {
        let s = self.schema.clone();
        Ok(self.run(async |c| {
            c.batch_execute(&format!(
                r#"
                CREATE SCHEMA IF NOT EXISTS {s};
                CREATE TABLE IF NOT EXISTS {s}."versionHistory" (
                  "dataVersion" int NOT NULL,
                  "schemaVersion" int NOT NULL,
                  "minSafeVersion" int NOT NULL,
                  "lock" char(1) NOT NULL DEFAULT 'v' CHECK ("lock" = 'v') PRIMARY KEY
                );
                CREATE TABLE IF NOT EXISTS {s}."changeLog" (
                  watermark TEXT,
                  pos INT8,
                  change JSON NOT NULL,
                  precommit TEXT,
                  PRIMARY KEY (watermark, pos)
                );
                CREATE TABLE IF NOT EXISTS {s}."replicationState" (
                  "lastWatermark" TEXT NOT NULL,
                  "owner" TEXT,
                  "ownerAddress" TEXT,
                  "lock" INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
                );
                CREATE TABLE IF NOT EXISTS {s}."replicationConfig" (
                  "replicaVersion" TEXT NOT NULL,
                  "publications" TEXT[] NOT NULL,
                  "resetRequired" BOOL,
                  "lock" INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
                );
                CREATE TABLE IF NOT EXISTS {s}."tableMetadata" (
                  "schema" TEXT NOT NULL,
                  "table" TEXT NOT NULL,
                  "metadata" JSONB NOT NULL,
                  PRIMARY KEY("schema", "table")
                );
                CREATE TABLE IF NOT EXISTS {s}."stateRows" (
                  "tableKey" TEXT,
                  "rowKey" TEXT,
                  "row" TEXT NOT NULL,
                  PRIMARY KEY ("tableKey", "rowKey")
                );
                CREATE TABLE IF NOT EXISTS {s}."stateTables" (
                  "tableKey" TEXT PRIMARY KEY,
                  "relation" TEXT NOT NULL
                );
                CREATE TABLE IF NOT EXISTS {s}."stateSchema" (
                  watermark TEXT,
                  pos INT8,
                  "tableKey" TEXT NOT NULL,
                  "indexKey" TEXT,
                  change TEXT NOT NULL,
                  PRIMARY KEY (watermark, pos)
                );
                CREATE TABLE IF NOT EXISTS {s}."stateConfig" (
                  "replicaVersion" TEXT NOT NULL,
                  "stateWatermark" TEXT NOT NULL,
                  "lock" INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
                );
                CREATE TABLE IF NOT EXISTS {s}."backfilling" (
                  "schema" TEXT NOT NULL,
                  "table" TEXT NOT NULL,
                  "column" TEXT NOT NULL,
                  "backfill" JSONB NOT NULL,
                  PRIMARY KEY("schema", "table", "column")
                );
                INSERT INTO {s}."versionHistory" ("dataVersion", "schemaVersion", "minSafeVersion")
                  VALUES ({SCHEMA_VERSION}, {SCHEMA_VERSION}, {MIN_SAFE_VERSION})
                  ON CONFLICT ("lock") DO NOTHING;
                "#
            ))
            .await
            .map_err(|e| classify(e, "creating the change DB schema"))?;
            let row = c
                .query_one(&format!(r#"SELECT "schemaVersion", "minSafeVersion" FROM {s}."versionHistory""#), &[])
                .await
                .map_err(|e| classify(e, "reading versionHistory"))?;
            let (version, min_safe): (i32, i32) = (row.get(0), row.get(1));
            anyhow::ensure!(
                version == SCHEMA_VERSION || (version > SCHEMA_VERSION && min_safe <= SCHEMA_VERSION),
                "the change DB schema {s} is at version {version}; this Sluice writes version {SCHEMA_VERSION}"
            );
            Ok(())
        })?)
    }
}

impl ChangeLog for PostgresChangeLog {
    fn shared(&self) -> bool {
        true
    }

    fn state(&mut self) -> LogResult<Option<LogState>> {
        let s = self.schema.clone();
        self.run(async |c| {
            let config = c
                .query_opt(&format!(r#"SELECT "replicaVersion", "resetRequired" FROM {s}."replicationConfig""#), &[])
                .await
                .map_err(|e| classify(e, "reading replicationConfig"))?;
            let Some(config) = config else { return Ok(None) };
            let replica_version: String = config.get(0);
            let reset_required: Option<bool> = config.get(1);
            let last = c
                .query_opt(&format!(r#"SELECT "lastWatermark", "owner" FROM {s}."replicationState""#), &[])
                .await
                .map_err(|e| classify(e, "reading replicationState"))?;
            let (last_watermark, owner) = match last {
                Some(r) => (r.get(0), r.get(1)),
                None => (replica_version.clone(), None),
            };
            Ok(Some(LogState {
                last_watermark,
                replica_version,
                reset_required: reset_required.unwrap_or(false),
                owner,
            }))
        })
    }

    fn reset(&mut self, replica_version: &str) -> LogResult<()> {
        let s = self.schema.clone();
        let rv = replica_version.to_string();
        let keep = self.state_enabled;
        self.relations.clear();
        self.keep_state = keep;
        self.run(async |c| {
            c.batch_execute("BEGIN").await.map_err(|e| classify(e, "BEGIN"))?;
            match seed_lineage(c, &s, &rv, None, keep).await {
                Ok(()) => c.batch_execute("COMMIT").await.map_err(|e| classify(e, "resetting the change DB")),
                Err(e) => {
                    let _ = c.batch_execute("ROLLBACK").await;
                    Err(classify(e, "resetting the change DB"))
                }
            }
        })
    }

    fn start_lineage(&mut self, lineage: &NewLineage) -> LogResult<()> {
        super::ensure_log!(self.in_transaction, "a lineage starts inside a storage transaction");
        let s = self.schema.clone();
        let owner = (lineage.owner.as_str(), lineage.owner_address.as_str());
        let keep = self.state_enabled;
        self.relations.clear();
        self.keep_state = keep;
        self.run(async |c| {
            seed_lineage(c, &s, &lineage.replica_version, Some(owner), keep)
                .await
                .map_err(|e| classify(e, &format!("starting lineage {}", lineage.replica_version)))
        })?;
        // The tables were emptied under this transaction's locks: whoever
        // owned the old lineage, the new one is this host's.
        self.owner_at_begin = Some(Some(lineage.owner.clone()));
        Ok(())
    }

    fn mark_reset_required(&mut self) -> LogResult<()> {
        let s = self.schema.clone();
        self.run(async |c| {
            c.execute(&format!(r#"UPDATE {s}."replicationConfig" SET "resetRequired" = true"#), &[])
                .await
                .map_err(|e| classify(e, "marking reset required"))?;
            Ok(())
        })
    }

    fn assume_ownership(&mut self, task_id: &str, address: &str) -> LogResult<()> {
        let s = self.schema.clone();
        let (task, addr) = (task_id.to_string(), address.to_string());
        let stuck_after = self.settings.stuck_after();
        self.run(async |c| {
            let taken = c
                .execute(
                    &format!(r#"UPDATE {s}."replicationState" SET "owner" = $1, "ownerAddress" = $2"#),
                    &[&task, &addr],
                )
                .await;
            match taken {
                Ok(_) => Ok(()),
                Err(e) => Err(lock_wait_error(c, &s, e, "taking ownership of the change DB", stuck_after).await),
            }
        })
    }

    fn begin(&mut self) -> LogResult<()> {
        // Whatever came before is over (the storer rolls back after an
        // error), so a lost connection may be replaced here.
        self.in_transaction = false;
        let s = self.schema.clone();
        let stuck_after = self.settings.stuck_after();
        let owner = self.run(async |c| {
            c.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED").await.map_err(|e| classify(e, "BEGIN"))?;
            // Lock the row first: a takeover now waits for this transaction.
            // No row yet: a new change DB, whose lineage this transaction starts.
            let row = match c.query_opt(&format!(r#"SELECT "owner" FROM {s}."replicationState" FOR UPDATE"#), &[]).await
            {
                Ok(row) => row,
                Err(e) => return Err(lock_wait_error(c, &s, e, "locking replicationState", stuck_after).await),
            };
            let kept = state_kept(c, &s).await?;
            Ok((row.and_then(|r| r.get::<_, Option<String>>(0)), kept))
        });
        match owner {
            Ok((owner, kept)) => {
                self.owner_at_begin = Some(owner);
                self.in_transaction = true;
                self.keep_state = self.state_enabled && kept;
                Ok(())
            }
            Err(e) => {
                let _ = self.rollback();
                Err(e)
            }
        }
    }

    fn savepoint(&mut self) -> LogResult<()> {
        self.run(async |c| c.batch_execute("SAVEPOINT upstream_tx").await.map_err(|e| classify(e, "SAVEPOINT")))
    }

    fn release_savepoint(&mut self) -> LogResult<()> {
        self.run(async |c| c.batch_execute("RELEASE SAVEPOINT upstream_tx").await.map_err(|e| classify(e, "RELEASE")))
    }

    fn rollback_to_savepoint(&mut self) -> LogResult<()> {
        self.relations.clear();
        let s = self.schema.clone();
        let kept = self.run(async |c| {
            c.batch_execute("ROLLBACK TO SAVEPOINT upstream_tx; RELEASE SAVEPOINT upstream_tx")
                .await
                .map_err(|e| classify(e, "ROLLBACK TO SAVEPOINT"))?;
            state_kept(c, &s).await
        })?;
        self.keep_state = self.state_enabled && kept;
        Ok(())
    }

    /// Each append is one COPY, which the server works through while the
    /// storer waits: fewer, larger ones keep it busier. 20,000 rather than
    /// 2,000 stored 13-17 % more changes/s (docs/benchmarks.md); the
    /// storer's 8 MiB bound on a group's bytes still caps each one.
    fn append_batch_rows(&self) -> usize {
        20_000
    }

    fn append(&mut self, rows: &[LogRow<'_>]) -> LogResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        // One binary COPY per batch: the server reads each field as sent
        // (the change's JSON is validated once, as a `json` value), with no
        // statement text to parse and no per-row SQL.
        let data = copy_rows(rows)?;
        let s = self.schema.clone();
        let first = rows[0].watermark.to_string();
        let n = rows.len();
        let what = move || format!("copying {n} change-log rows at watermark {first}");
        let stmt = match self.insert.clone() {
            Some(stmt) => {
                // The previous COPY must be through before this one is sent,
                // on a connection that is still there (as `run` checks).
                self.settle()?;
                self.client()?;
                stmt
            }
            None => self.run(async |c| {
                c.prepare(&format!(
                    r#"COPY {s}."changeLog" (watermark, pos, change, precommit) FROM STDIN (FORMAT binary)"#
                ))
                .await
                .map_err(|e| classify(e, "preparing the change-log COPY"))
            })?,
        };
        self.insert = Some(stmt.clone());
        let copy = async move |c: &Client| -> anyhow::Result<()> {
            let sink = c.copy_in::<_, bytes::Bytes>(&stmt).await.map_err(|e| classify(e, &what()))?;
            futures::pin_mut!(sink);
            futures::SinkExt::send(&mut sink, data).await.map_err(|e| classify(e, &what()))?;
            let copied = sink.finish().await.map_err(|e| classify(e, &what()))?;
            anyhow::ensure!(copied == n as u64, "{}: the server took {copied} rows", what());
            Ok(())
        };
        if self.keep_state {
            // The table state's statements follow the COPY at once.
            self.run(copy)?;
            return Ok(self.keep_state(rows)?);
        }
        // Sent on the runtime: the storer returns to gather the next batch.
        let client = Arc::clone(self.client.as_ref().expect("connected by client or run above"));
        let limit = self.settings.call_timeout;
        self.copying =
            Some(self.rt.spawn(async move { within(limit, "waiting for a storage call", copy(&client)).await }));
        Ok(())
    }

    fn commit(&mut self, last_watermark: &str) -> LogResult<()> {
        let owner = self.owner_at_begin.take().flatten();
        if owner.as_deref() != Some(self.settings.task_id.as_str()) {
            let _ = self.rollback();
            return Err(LogError::OwnershipLost(format!(
                "changeLog ownership has been assumed by {}",
                owner.as_deref().unwrap_or("nobody")
            )));
        }
        let s = self.schema.clone();
        let last = last_watermark.to_string();
        let keep_state = self.keep_state;
        let result = self.run(async |c| {
            c.execute(&format!(r#"UPDATE {s}."replicationState" SET "lastWatermark" = $1"#), &[&last])
                .await
                .map_err(|e| classify(e, "updating lastWatermark"))?;
            if keep_state {
                c.execute(&format!(r#"UPDATE {s}."stateConfig" SET "stateWatermark" = $1"#), &[&last])
                    .await
                    .map_err(|e| classify(e, "updating the table state's watermark"))?;
            }
            c.batch_execute("COMMIT").await.map_err(|e| classify(e, "COMMIT"))
        });
        match result {
            Ok(()) => self.in_transaction = false,
            Err(_) => {
                let _ = self.rollback();
            }
        }
        result
    }

    fn rollback(&mut self) -> LogResult<()> {
        // A COPY still in flight belongs to the transaction rolled back:
        // its outcome no longer matters, only that it is through.
        let _ = self.settle();
        self.relations.clear();
        self.owner_at_begin = None;
        self.in_transaction = false;
        if self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            self.run(async |c| c.batch_execute("ROLLBACK").await.map_err(|e| classify(e, "ROLLBACK")))?;
        }
        Ok(())
    }

    fn bounds(&mut self) -> LogResult<Bounds> {
        let s = self.schema.clone();
        self.run(async |c| bounds(c, &s).await)
    }
}

/// Log rows in COPY's binary format: a signature and two zero words, then
/// per row a field count and each field as a length (-1: null) and its bytes
/// (text and `json` as UTF-8, `int8` as 8 big-endian bytes), then -1.
fn copy_rows(rows: &[LogRow<'_>]) -> anyhow::Result<bytes::Bytes> {
    use bytes::BufMut;
    fn text(out: &mut bytes::BytesMut, t: &str) -> anyhow::Result<()> {
        // Postgres caps a field at 1 GB; a length must fit the format's i32.
        let len = i32::try_from(t.len()).map_err(|_| anyhow::anyhow!("a change-log field of {} bytes", t.len()))?;
        out.put_i32(len);
        out.put_slice(t.as_bytes());
        Ok(())
    }
    let size = rows.iter().map(|r| 34 + 2 * r.watermark.len() + r.change.len()).sum::<usize>();
    let mut out = bytes::BytesMut::with_capacity(21 + size);
    out.put_slice(b"PGCOPY\n\xff\r\n\0");
    out.put_i32(0);
    out.put_i32(0);
    for r in rows {
        out.put_i16(4);
        text(&mut out, r.watermark)?;
        out.put_i32(8);
        out.put_i64(r.pos);
        text(&mut out, r.change)?;
        match r.precommit {
            Some(p) => text(&mut out, p)?,
            None => out.put_i32(-1),
        }
    }
    out.put_i16(-1);
    Ok(out.freeze())
}

/// Empties the change DB's tables and seeds them for `rv` (Zero's
/// ensureReplicationConfig, in its lock order), on whatever transaction `c`
/// is in.
async fn seed_lineage(
    c: &Client,
    s: &str,
    rv: &str,
    owner: Option<(&str, &str)>,
    keep_state: bool,
) -> Result<(), tokio_postgres::Error> {
    c.batch_execute(&format!(
        r#"TRUNCATE TABLE {s}."replicationState";
           TRUNCATE TABLE {s}."changeLog";
           TRUNCATE TABLE {s}."replicationConfig";
           TRUNCATE TABLE {s}."tableMetadata";
           TRUNCATE TABLE {s}."backfilling";
           TRUNCATE TABLE {s}."stateRows", {s}."stateTables", {s}."stateSchema", {s}."stateConfig";"#
    ))
    .await?;
    if keep_state {
        c.execute(
            &format!(r#"INSERT INTO {s}."stateConfig" ("replicaVersion", "stateWatermark") VALUES ($1, $1)"#),
            &[&rv],
        )
        .await?;
    }
    c.execute(
        &format!(r#"INSERT INTO {s}."replicationConfig" ("replicaVersion", "publications") VALUES ($1, '{{}}')"#),
        &[&rv],
    )
    .await?;
    let (owner, address) = owner.unzip();
    c.execute(
        &format!(
            r#"INSERT INTO {s}."replicationState" ("lastWatermark", "owner", "ownerAddress") VALUES ($1, $2, $3)"#
        ),
        &[&rv, &owner, &address],
    )
    .await?;
    c.execute(
        &format!(
            r#"INSERT INTO {s}."changeLog" (watermark, pos, change) VALUES
               ($1, 0, '{{"tag":"begin"}}'), ($1, 1, '{{"tag":"commit"}}')"#
        ),
        &[&rv],
    )
    .await?;
    Ok(())
}

async fn bounds(c: &Client, s: &str) -> anyhow::Result<Bounds> {
    let min = c
        .query_one(&format!(r#"SELECT min(watermark) FROM {s}."changeLog""#), &[])
        .await
        .map_err(|e| classify(e, "reading the change log"))?;
    let last = c
        .query_one(&format!(r#"SELECT "lastWatermark" FROM {s}."replicationState""#), &[])
        .await
        .map_err(|e| classify(e, "reading replicationState"))?;
    Ok(Bounds { min_watermark: min.get(0), last_watermark: last.get(0) })
}

/// Snapshots and purges, each on a connection of its own.
pub struct PostgresReader {
    settings: PgSettings,
    schema: String,
    rt: Handle,
    /// Caps the catch-up snapshots open at once (each holds a connection
    /// and a transaction on the change DB).
    snapshots: Arc<tokio::sync::Semaphore>,
    waiting: Arc<std::sync::atomic::AtomicUsize>,
}

/// Catch-up snapshots open at once on the Postgres change DB, unless set.
pub const DEFAULT_MAX_SNAPSHOTS: usize = 16;

impl PostgresReader {
    pub fn new(settings: PgSettings, rt: Handle) -> Self {
        PostgresReader {
            schema: settings.schema(),
            settings,
            rt,
            snapshots: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_SNAPSHOTS)),
            waiting: Default::default(),
        }
    }

    /// At most `n` catch-up snapshots (connections) at once; more wait.
    pub fn with_max_snapshots(mut self, n: usize) -> Self {
        self.snapshots = Arc::new(tokio::sync::Semaphore::new(n.max(1)));
        self
    }

    /// Catch-ups waiting for a connection now.
    pub fn snapshots_waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }
}

struct PgSnapshot {
    /// This snapshot's place under the cap, freed when it is dropped.
    _permit: tokio::sync::OwnedSemaphorePermit,
    client: PgClient,
    rt: Handle,
    schema: String,
    last_watermark: String,
    /// The deadline of each read (see [`PgSettings::call_timeout`]).
    call_timeout: Duration,
    /// Where the open catch-up cursor stands: `None` before it is declared,
    /// then the last row it returned (or the cursor it started after).
    cursor_at: Option<Option<(String, i64)>>,
}

impl LogSnapshot for PgSnapshot {
    fn last_watermark(&self) -> &str {
        &self.last_watermark
    }

    /// Reads the next batch from the snapshot's server-side cursor, which
    /// keeps the position; `after` matters only when it differs from where
    /// the cursor stands.
    fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>> {
        let s = self.schema.clone();
        let (from, last) = (from.to_string(), self.last_watermark.clone());
        let after = after.map(|(w, p)| (w.to_string(), p));
        // One server-side cursor streams the rows; it is declared again when
        // the caller's cursor is not where it stands (a catch-up jumping past
        // a transaction the subscriber already holds).
        let declare = match &self.cursor_at {
            None => Some(false),
            Some(at) if *at != after => Some(true),
            Some(_) => None,
        };
        let c = &self.client;
        let rows = self.rt.block_on(within(self.call_timeout, "reading the change log", async {
            if let Some(close_first) = declare {
                if close_first {
                    c.batch_execute("CLOSE catchup").await.map_err(|e| classify(e, "closing the catch-up cursor"))?;
                }
                let past = match &after {
                    Some((w, p)) => {
                        format!(" AND (watermark > {w} OR (watermark = {w} AND pos > {p}))", w = quote_literal(w))
                    }
                    None => String::new(),
                };
                let from = quote_literal(&from);
                let last = quote_literal(&last);
                c.batch_execute(&format!(
                    r#"DECLARE catchup NO SCROLL CURSOR FOR
                       SELECT watermark, pos, change::text FROM {s}."changeLog"
                       WHERE watermark >= {from} AND watermark <= {last}{past} ORDER BY watermark, pos"#
                ))
                .await
                .map_err(|e| classify(e, "opening the catch-up cursor"))?;
            }
            let rows = c
                .query(&format!("FETCH {limit} FROM catchup"), &[])
                .await
                .map_err(|e| classify(e, "reading the change log"))?;
            anyhow::Ok(
                rows.iter()
                    .map(|r| {
                        let change: String = r.get(2);
                        StoredRow { watermark: r.get(0), pos: r.get(1), tag: tag_of(&change), change }
                    })
                    .collect::<Vec<_>>(),
            )
        }))?;
        self.cursor_at = Some(rows.last().map(|r| (r.watermark.clone(), r.pos)).or(after));
        Ok(rows)
    }

    fn state_kept(&mut self) -> anyhow::Result<bool> {
        self.rt.block_on(within(self.call_timeout, "reading the table state", state_kept(&self.client, &self.schema)))
    }

    fn state_schema(&mut self) -> anyhow::Result<Vec<String>> {
        let s = &self.schema;
        let sql = format!(r#"SELECT change FROM {s}."stateSchema" ORDER BY watermark, pos"#);
        let rows = self.rt.block_on(within(self.call_timeout, "reading the table state", async {
            self.client.query(&sql, &[]).await.map_err(|e| classify(e, "reading the table state"))
        }))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn state_rows(&mut self, after: Option<(&str, &str)>, limit: usize) -> anyhow::Result<Vec<StateRow>> {
        let s = &self.schema;
        let (table, key) = after.unwrap_or(("", ""));
        // Compared and ordered byte-wise, whatever the database's collation.
        let sql = format!(
            r#"SELECT r."tableKey", r."rowKey", r."row", t."relation"
               FROM {s}."stateRows" r JOIN {s}."stateTables" t ON t."tableKey" = r."tableKey"
               WHERE (r."tableKey" COLLATE "C", r."rowKey" COLLATE "C") > ($1 COLLATE "C", $2 COLLATE "C")
               ORDER BY r."tableKey" COLLATE "C", r."rowKey" COLLATE "C" LIMIT $3"#
        );
        let rows = self.rt.block_on(within(self.call_timeout, "reading the table state", async {
            self.client
                .query(&sql, &[&table, &key, &(limit as i64)])
                .await
                .map_err(|e| classify(e, "reading the table state"))
        }))?;
        Ok(rows
            .iter()
            .map(|r| StateRow { table: r.get(0), key: r.get(1), row: r.get(2), relation: r.get(3) })
            .collect())
    }
}

/// A stored change's tag, read here rather than by the server
/// (`change->>'tag'` parsed every row's JSON there, the bulk of a catch-up's
/// cost): from the front of the text as Sluice writes it, else by parsing.
fn tag_of(change: &str) -> String {
    #[derive(serde::Deserialize)]
    struct Tagged {
        #[serde(default)]
        tag: String,
    }
    match json_scan::tag_of(change) {
        "" => serde_json::from_str::<Tagged>(change).map(|t| t.tag).unwrap_or_default(),
        tag => tag.to_string(),
    }
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

impl LogReader for PostgresReader {
    fn size_bytes(&self) -> anyhow::Result<Option<u64>> {
        let settings = self.settings.clone();
        let schema = format!("{}_{}/cdc", settings.app_id, settings.shard_num);
        let limit = settings.call_timeout * 2;
        self.rt.block_on(within(limit, "measuring the change log", async {
            let c = settings.connect().await?;
            let size: i64 = c
                .query_one(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 FROM pg_class c \
                     JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'",
                    &[&schema],
                )
                .await?
                .get(0);
            Ok(Some(size as u64))
        }))
    }

    fn snapshot(&self) -> anyhow::Result<Box<dyn LogSnapshot>> {
        let s = self.schema.clone();
        let settings = self.settings.clone();
        let (snapshots, waiting) = (self.snapshots.clone(), self.waiting.clone());
        let (permit, client, last_watermark) = self.rt.block_on(async {
            let permit = match snapshots.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    waiting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let p = snapshots.acquire_owned().await;
                    waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    p.map_err(|_| anyhow::anyhow!("the change DB reader is closed"))?
                }
            };
            // Waiting for a place is not waiting on the network: the deadline
            // starts once there is one.
            within(settings.call_timeout * 2, "opening a catch-up snapshot", async {
                let c = settings.connect().await?;
                c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?;
                // The first query pins the snapshot.
                let row = c
                    .query_one(&format!(r#"SELECT "lastWatermark" FROM {s}."replicationState""#), &[])
                    .await
                    .map_err(|e| classify(e, "pinning the catch-up snapshot"))?;
                anyhow::Ok((permit, c, row.get::<_, String>(0)))
            })
            .await
        })?;
        Ok(Box::new(PgSnapshot {
            _permit: permit,
            client,
            rt: self.rt.clone(),
            schema: self.schema.clone(),
            last_watermark,
            call_timeout: self.settings.call_timeout,
            cursor_at: None,
        }))
    }

    fn bounds(&self) -> anyhow::Result<Bounds> {
        let s = self.schema.clone();
        let settings = self.settings.clone();
        self.rt.block_on(within(settings.call_timeout * 2, "reading the change log's bounds", async {
            let c = settings.connect().await?;
            bounds(&c, &s).await
        }))
    }

    /// Zero's purgeRecordsBefore: fail fast if a purge lock holds the first
    /// row, delete below the floor but never the newest transaction, and
    /// re-check ownership in the same transaction.
    fn purge_before(&self, floor: &str, replica_version: &str) -> anyhow::Result<u64> {
        let s = self.schema.clone();
        let settings = self.settings.clone();
        let floor = floor.to_string();
        let rv = replica_version.to_string();
        // A purge may run as long as a statement may.
        let limit = settings.statement_timeout + settings.call_timeout * 2;
        self.rt.block_on(within(limit, "purging the change log", async {
            let c = settings.connect().await?;
            c.batch_execute("BEGIN").await?;
            let result = async {
                c.query(
                    &format!(
                        r#"SELECT watermark FROM {s}."changeLog" ORDER BY watermark, pos LIMIT 1 FOR UPDATE NOWAIT"#
                    ),
                    &[],
                )
                .await
                .map_err(|e| classify(e, "locking the change log for purging"))?;
                let deleted = c
                    .execute(
                        &format!(
                            r#"DELETE FROM {s}."changeLog" WHERE watermark < $1
                               AND watermark < (SELECT max(watermark) FROM {s}."changeLog")
                               AND (SELECT "replicaVersion" FROM {s}."replicationConfig") = $2"#
                        ),
                        &[&floor, &rv],
                    )
                    .await
                    .map_err(|e| classify(e, "purging the change log"))?;
                let owner: Option<String> = c
                    .query_one(&format!(r#"SELECT "owner" FROM {s}."replicationState" FOR SHARE"#), &[])
                    .await
                    .map_err(|e| classify(e, "reading the owner"))?
                    .get(0);
                if owner.as_deref() != Some(settings.task_id.as_str()) {
                    anyhow::bail!(LogError::OwnershipLost(format!(
                        "aborting changeLog purge to {floor} because ownership has been taken by {}",
                        owner.as_deref().unwrap_or("nobody")
                    )));
                }
                Ok(deleted)
            }
            .await;
            match result {
                Ok(n) => {
                    c.batch_execute("COMMIT").await?;
                    Ok(n)
                }
                Err(e) => {
                    let _ = c.batch_execute("ROLLBACK").await;
                    Err(e)
                }
            }
        }))
    }

    /// By transaction count only: Zero's schema records no time per row.
    fn retention_floor(&self, transactions: Option<u64>, _age: Option<Duration>) -> anyhow::Result<Option<String>> {
        let Some(n) = transactions.filter(|n| *n > 0) else { return Ok(None) };
        let s = self.schema.clone();
        let settings = self.settings.clone();
        let limit = settings.statement_timeout + settings.call_timeout * 2;
        self.rt.block_on(within(limit, "reading the retention window", async {
            let c = settings.connect().await?;
            let row = c
                .query_opt(
                    &format!(
                        r#"SELECT watermark FROM {s}."changeLog" WHERE change->>'tag' = 'commit'
                           ORDER BY watermark DESC LIMIT 1 OFFSET $1"#
                    ),
                    &[&(n as i64 - 1)],
                )
                .await
                .map_err(|e| classify(e, "reading the retention window"))?;
            Ok(Some(row.map(|r| r.get::<_, String>(0)).unwrap_or_default()))
        }))
    }
}

/// A connection that failed for want of a server (refused, reset, the server
/// starting up or shutting down, too many connections), as opposed to one the
/// server refused for its configuration (authentication, a missing database).
fn is_unreachable(e: &anyhow::Error) -> bool {
    // A backend failure carried up as an error of the log: look inside.
    if let Some(LogError::Backend(inner)) = e.downcast_ref::<LogError>() {
        return is_unreachable(inner);
    }
    let silent = |c: &(dyn std::error::Error + 'static)| {
        c.downcast_ref::<NoAnswer>().is_some()
            || matches!(c.downcast_ref::<pgconn::ConnectError>(), Some(pgconn::ConnectError::TimedOut(_)))
    };
    if e.chain().any(silent) {
        return true;
    }
    // A connection error wraps the tokio-postgres error transparently.
    let Some(pg) = e.chain().find_map(|c| {
        c.downcast_ref::<tokio_postgres::Error>()
            .or_else(|| c.downcast_ref::<pgconn::ConnectError>().and_then(pgconn::ConnectError::postgres))
    }) else {
        return false;
    };
    match pg.as_db_error() {
        // A certificate that does not verify will not verify next time either.
        None if pgconn::is_tls_refusal(&pgconn::error_text(pg)) || pgconn::is_config_error(pg) => false,
        None => true, // I/O: refused, reset, closed
        Some(db) => {
            let code = db.code().code();
            code.starts_with("57") || code.starts_with("08") || code.starts_with("53")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_read_from_the_front_or_by_parsing() {
        // As Sluice writes changes, then as another writer might.
        assert_eq!(tag_of(r#"{"tag":"insert","relation":{"schema":"public"}}"#), "insert");
        assert_eq!(tag_of(r#"{"tag":"create-table","spec":{}}"#), "create-table");
        assert_eq!(tag_of(r#"{"relation":{"tag":"x"},"tag":"update"}"#), "update");
        assert_eq!(tag_of(r#"{ "tag" : "commit" }"#), "commit");
        assert_eq!(tag_of(r#"{"tag":"a\"b"}"#), "a\"b");
        assert_eq!(tag_of(r#"{"begin":true}"#), "");
        assert_eq!(tag_of("[1]"), "");
    }
}
