//! The embedded change log: one SQLite file in WAL mode.
//!
//! Tables mirror Zero's change DB: `changeLog` (watermark, pos, change,
//! precommit, plus the tag so replay needs no JSON parsing),
//! `replicationConfig` and `replicationState`. Beside them, the compacted
//! table state ([`super::state`]): `stateRows`, `stateSchema`, and
//! `stateConfig`, whose one row names the lineage the state has been kept
//! for since its start (a log written by an older Sluice has none).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rusqlite::{params, Connection, OptionalExtension};

use super::state::{self, StateStore};
use super::{
    Bounds, ChangeLog, LogReader, LogResult, LogRow, LogSnapshot, LogState, NewLineage, StateRow, StoredRow,
    SQLITE_INSERT_ROWS,
};

/// 2 added the table state; a version-1 file is upgraded in place (its
/// state starts with its next lineage).
const SCHEMA_VERSION: i64 = 2;

/// How hard SQLite works to make each commit durable (`--sync`; a Postgres
/// change DB's `synchronous_commit` follows it too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Durability {
    /// `synchronous=FULL`: a commit survives power loss (default).
    Full,
    /// `synchronous=NORMAL`: a commit survives a process crash, and may be
    /// lost on power loss. Faster; opt in with `--sync normal`.
    Normal,
}

pub struct SqliteChangeLog {
    conn: Connection,
    /// The relation object last written to `stateTables` for each table in
    /// this connection's view; forgotten on any rollback.
    relations: HashMap<String, String>,
    /// Keep the table state (opt-in: `with_table_state`).
    state_enabled: bool,
    /// The table state is kept for the current lineage (read at each
    /// `begin`): a log upgraded from before the state, one that ran without
    /// it, or one whose state met a change it could not follow, keeps none
    /// until its next lineage.
    keep_state: bool,
}

impl SqliteChangeLog {
    pub fn open(path: &Path, durability: Durability) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let conn = Connection::open(path).with_context(|| format!("opening change log {}", path.display()))?;
        conn.busy_timeout(std::time::Duration::from_secs(20))?;
        keep_plans(&conn)?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        anyhow::ensure!(mode.eq_ignore_ascii_case("wal"), "{} cannot use WAL mode (got {mode})", path.display());
        conn.pragma_update(None, "synchronous", if durability == Durability::Full { "FULL" } else { "NORMAL" })?;
        // Each upstream transaction runs in a savepoint: the pages it changes
        // (the table state's, mostly) are copied to a sub-journal first,
        // which is better kept in memory than in a temporary file.
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        anyhow::ensure!(
            (0..=SCHEMA_VERSION).contains(&version),
            "{} has change-log schema version {version}; this Sluice reads version {SCHEMA_VERSION}",
            path.display()
        );
        conn.execute_batch(
            r#"
            CREATE TABLE IF NOT EXISTS "changeLog" (
              watermark TEXT NOT NULL,
              pos INTEGER NOT NULL,
              tag TEXT NOT NULL,
              change TEXT NOT NULL,
              precommit TEXT,
              storedAtMs INTEGER,
              PRIMARY KEY (watermark, pos)
            );
            CREATE TABLE IF NOT EXISTS "replicationConfig" (
              replicaVersion TEXT NOT NULL,
              resetRequired INTEGER NOT NULL DEFAULT 0,
              lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock = 1)
            );
            CREATE TABLE IF NOT EXISTS "replicationState" (
              lastWatermark TEXT NOT NULL,
              owner TEXT,
              ownerAddress TEXT,
              lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock = 1)
            );
            -- Rows live in rowid order (appended, not split into a B-tree
            -- ordered by key: rows are large); the unique index finds them.
            CREATE TABLE IF NOT EXISTS "stateRows" (
              tableKey TEXT NOT NULL,
              rowKey TEXT NOT NULL,
              row TEXT NOT NULL,
              UNIQUE (tableKey, rowKey)
            );
            CREATE TABLE IF NOT EXISTS "stateSchema" (
              watermark TEXT NOT NULL,
              pos INTEGER NOT NULL,
              tableKey TEXT NOT NULL,
              indexKey TEXT,
              change TEXT NOT NULL,
              PRIMARY KEY (watermark, pos)
            );
            CREATE TABLE IF NOT EXISTS "stateTables" (
              tableKey TEXT PRIMARY KEY,
              relation TEXT NOT NULL
            );
            CREATE TABLE IF NOT EXISTS "stateConfig" (
              replicaVersion TEXT NOT NULL,
              lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock = 1)
            );
            PRAGMA user_version = 2;
            "#,
        )
        .context("creating change-log tables")?;
        conn.create_scalar_function(
            "sluice_merge_rows",
            2,
            rusqlite::functions::FunctionFlags::SQLITE_UTF8 | rusqlite::functions::FunctionFlags::SQLITE_DETERMINISTIC,
            |ctx| {
                let (stored, patch) = (ctx.get_raw(0).as_str()?, ctx.get_raw(1).as_str()?);
                state::merge_rows(stored, patch).map_err(|e| rusqlite::Error::UserFunctionError(e.into()))
            },
        )?;
        Ok(SqliteChangeLog { conn, relations: HashMap::new(), state_enabled: false, keep_state: false })
    }

    /// Keeps the compacted table state ([`state`]) beside the log, from the
    /// next lineage on (a lineage's state must start with its snapshot).
    /// Without it, a state kept by an earlier run is marked as no longer
    /// kept: the log goes on without it.
    pub fn with_table_state(mut self, on: bool) -> anyhow::Result<Self> {
        self.state_enabled = on;
        if on {
            if self.state()?.is_some() && !self.state_kept()? {
                tracing::warn!(
                    "the table state is kept from the change log's next lineage on (this one began without it)"
                );
            }
        } else if self.conn.execute(r#"DELETE FROM "stateConfig""#, [])? > 0 {
            tracing::warn!("the table state is no longer kept for this lineage (Sluice runs without --table-state)");
        }
        Ok(self)
    }

    /// Whether the state is kept for the recorded lineage.
    fn state_kept(&self) -> rusqlite::Result<bool> {
        self.conn
            .query_row(
                r#"SELECT count(*) FROM "stateConfig" WHERE replicaVersion = (SELECT replicaVersion FROM "replicationConfig")"#,
                [],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n > 0)
    }

    /// Applies the rows to the table state. A change the state cannot
    /// follow (which would be a bug in Sluice's own encoding) turns the state
    /// off for this lineage, with one line naming it; the log goes on.
    fn keep_state(&mut self, rows: &[LogRow<'_>]) -> anyhow::Result<()> {
        if !self.keep_state {
            return Ok(());
        }
        let mut store = SqliteState { conn: &self.conn, relations: &mut self.relations, pending: Vec::new() };
        for row in rows {
            if let Err(e) = state::apply(&mut store, (row.watermark, row.pos), row.tag, row.change) {
                if e.downcast_ref::<rusqlite::Error>().is_some() {
                    return Err(e);
                }
                tracing::error!("{e:#}; the table state is no longer kept for this lineage");
                self.conn.execute(r#"DELETE FROM "stateConfig""#, [])?;
                self.keep_state = false;
                return Ok(());
            }
        }
        store.flush()
    }

    fn insert_statement(n: usize) -> String {
        let mut sql =
            String::from(r#"INSERT INTO "changeLog" (watermark, pos, tag, change, precommit, storedAtMs) VALUES "#);
        for i in 0..n {
            if i > 0 {
                sql.push(',');
            }
            sql.push_str("(?,?,?,?,?,?)");
        }
        sql
    }
}

/// Empties the log and seeds it for `replica_version` (see `ChangeLog::reset`),
/// on whatever transaction `conn` is in.
fn seed_lineage(
    conn: &Connection,
    replica_version: &str,
    owner: Option<(&str, &str)>,
    keep_state: bool,
) -> rusqlite::Result<()> {
    conn.execute_batch(
        r#"DELETE FROM "replicationState"; DELETE FROM "changeLog"; DELETE FROM "replicationConfig";
           DELETE FROM "stateRows"; DELETE FROM "stateSchema"; DELETE FROM "stateTables";
           DELETE FROM "stateConfig";"#,
    )?;
    conn.execute(r#"INSERT INTO "replicationConfig" (replicaVersion) VALUES (?)"#, [replica_version])?;
    if keep_state {
        conn.execute(r#"INSERT INTO "stateConfig" (replicaVersion) VALUES (?)"#, [replica_version])?;
    }
    let (owner, address) = owner.unzip();
    conn.execute(
        r#"INSERT INTO "replicationState" (lastWatermark, owner, ownerAddress) VALUES (?, ?, ?)"#,
        params![replica_version, owner, address],
    )?;
    conn.execute(
        r#"INSERT INTO "changeLog" (watermark, pos, tag, change, precommit) VALUES
           (?1, 0, 'begin', '{"tag":"begin"}', NULL), (?1, 1, 'commit', '{"tag":"commit"}', ?1)"#,
        [replica_version],
    )?;
    Ok(())
}

impl ChangeLog for SqliteChangeLog {
    fn state(&mut self) -> LogResult<Option<LogState>> {
        let config: Option<(String, bool)> = self
            .conn
            .query_row(r#"SELECT replicaVersion, resetRequired FROM "replicationConfig""#, [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        let Some((replica_version, reset_required)) = config else {
            return Ok(None);
        };
        let state: Option<(String, Option<String>)> = self
            .conn
            .query_row(r#"SELECT lastWatermark, owner FROM "replicationState""#, [], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let (last_watermark, owner) = state.unwrap_or_else(|| (replica_version.clone(), None));
        Ok(Some(LogState { replica_version, last_watermark, reset_required, owner }))
    }

    fn reset(&mut self, replica_version: &str) -> LogResult<()> {
        self.relations.clear();
        let tx = self.conn.transaction()?;
        seed_lineage(&tx, replica_version, None, self.state_enabled)?;
        tx.commit()?;
        self.keep_state = self.state_enabled;
        Ok(())
    }

    fn start_lineage(&mut self, lineage: &NewLineage) -> LogResult<()> {
        super::ensure_log!(!self.conn.is_autocommit(), "a lineage starts inside a storage transaction");
        self.relations.clear();
        let owner = Some((lineage.owner.as_str(), lineage.owner_address.as_str()));
        seed_lineage(&self.conn, &lineage.replica_version, owner, self.state_enabled)
            .with_context(|| format!("starting lineage {}", lineage.replica_version))?;
        self.keep_state = self.state_enabled;
        Ok(())
    }

    fn mark_reset_required(&mut self) -> LogResult<()> {
        self.conn.execute(r#"UPDATE "replicationConfig" SET resetRequired = 1"#, [])?;
        Ok(())
    }

    fn assume_ownership(&mut self, task_id: &str, address: &str) -> LogResult<()> {
        self.conn.execute(r#"UPDATE "replicationState" SET owner = ?, ownerAddress = ?"#, params![task_id, address])?;
        Ok(())
    }

    fn begin(&mut self) -> LogResult<()> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        self.keep_state = self.state_enabled && self.state_kept()?;
        Ok(())
    }

    fn savepoint(&mut self) -> LogResult<()> {
        self.conn.execute_batch("SAVEPOINT upstream_tx")?;
        Ok(())
    }

    fn release_savepoint(&mut self) -> LogResult<()> {
        self.conn.execute_batch("RELEASE upstream_tx")?;
        Ok(())
    }

    fn rollback_to_savepoint(&mut self) -> LogResult<()> {
        self.relations.clear();
        self.conn.execute_batch("ROLLBACK TO upstream_tx; RELEASE upstream_tx")?;
        self.keep_state = self.state_enabled && self.state_kept()?;
        Ok(())
    }

    fn append(&mut self, rows: &[LogRow<'_>]) -> LogResult<()> {
        // Commit rows carry the time they were stored, for the retention window.
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        for chunk in rows.chunks(SQLITE_INSERT_ROWS) {
            let mut stmt = self.conn.prepare_cached(&Self::insert_statement(chunk.len()))?;
            let mut i = 1;
            for row in chunk {
                stmt.raw_bind_parameter(i, row.watermark)?;
                stmt.raw_bind_parameter(i + 1, row.pos)?;
                stmt.raw_bind_parameter(i + 2, row.tag)?;
                stmt.raw_bind_parameter(i + 3, row.change)?;
                stmt.raw_bind_parameter(i + 4, row.precommit)?;
                stmt.raw_bind_parameter(i + 5, (row.tag == "commit").then_some(now_ms))?;
                i += 6;
            }
            stmt.raw_execute().with_context(|| {
                format!("inserting {} change-log rows at watermark {}", chunk.len(), chunk[0].watermark)
            })?;
        }
        Ok(self.keep_state(rows)?)
    }

    fn commit(&mut self, last_watermark: &str) -> LogResult<()> {
        self.conn.prepare_cached(r#"UPDATE "replicationState" SET lastWatermark = ?"#)?.execute([last_watermark])?;
        self.conn.execute_batch("COMMIT")?;
        Ok(())
    }

    fn rollback(&mut self) -> LogResult<()> {
        self.relations.clear();
        if !self.conn.is_autocommit() {
            self.conn.execute_batch("ROLLBACK")?;
        }
        Ok(())
    }

    fn bounds(&mut self) -> LogResult<Bounds> {
        let min_watermark: Option<String> =
            self.conn.query_row(r#"SELECT min(watermark) FROM "changeLog""#, [], |r| r.get(0))?;
        let last_watermark: String =
            self.conn.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0))?;
        Ok(Bounds { min_watermark, last_watermark })
    }
}

/// The table state's statements on the writer's connection.
struct SqliteState<'a> {
    conn: &'a Connection,
    relations: &'a mut HashMap<String, String>,
    /// Upserts not written yet: consecutive ones go in multi-row statements
    /// (SQLite applies their rows in order, so a key may repeat). Every
    /// other statement writes them first.
    pending: Vec<(String, String, String)>,
}

impl SqliteState<'_> {
    fn flush(&mut self) -> anyhow::Result<()> {
        for chunk in self.pending.chunks(SQLITE_INSERT_ROWS) {
            let mut sql = String::from(r#"INSERT INTO "stateRows" (tableKey, rowKey, row) VALUES "#);
            for i in 0..chunk.len() {
                sql.push_str(if i == 0 { "(?,?,?)" } else { ",(?,?,?)" });
            }
            sql.push_str(" ON CONFLICT (tableKey, rowKey) DO UPDATE SET row = sluice_merge_rows(row, excluded.row)");
            let mut stmt = self.conn.prepare_cached(&sql)?;
            for (i, (table, key, row)) in chunk.iter().enumerate() {
                stmt.raw_bind_parameter(3 * i + 1, table)?;
                stmt.raw_bind_parameter(3 * i + 2, key)?;
                stmt.raw_bind_parameter(3 * i + 3, row)?;
            }
            stmt.raw_execute()?;
        }
        self.pending.clear();
        Ok(())
    }
}

impl StateStore for SqliteState<'_> {
    fn upsert(&mut self, table: &str, key: &str, row: &str, relation: &str, _whole: bool) -> anyhow::Result<()> {
        // A whole row merged over a stored one replaces every member, so
        // one statement serves both.
        if self.relations.get(table).map(String::as_str) != Some(relation) {
            self.conn
                .prepare_cached(
                    r#"INSERT INTO "stateTables" (tableKey, relation) VALUES (?, ?)
                       ON CONFLICT (tableKey) DO UPDATE SET relation = excluded.relation"#,
                )?
                .execute([table, relation])?;
            self.relations.insert(table.to_string(), relation.to_string());
        }
        self.pending.push((table.to_string(), key.to_string(), row.to_string()));
        if self.pending.len() >= SQLITE_INSERT_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    fn rekey(&mut self, table: &str, old: &str, new: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.delete(table, new)?;
        self.conn
            .prepare_cached(r#"UPDATE "stateRows" SET rowKey = ? WHERE tableKey = ? AND rowKey = ?"#)?
            .execute(params![new, table, old])?;
        Ok(())
    }

    fn delete(&mut self, table: &str, key: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.conn
            .prepare_cached(r#"DELETE FROM "stateRows" WHERE tableKey = ? AND rowKey = ?"#)?
            .execute(params![table, key])?;
        Ok(())
    }

    fn clear(&mut self, table: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.conn.execute(r#"DELETE FROM "stateRows" WHERE tableKey = ?"#, [table])?;
        Ok(())
    }

    fn add_schema(&mut self, at: (&str, i64), table: &str, index: Option<&str>, change: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.conn.execute(
            r#"INSERT INTO "stateSchema" (watermark, pos, tableKey, indexKey, change) VALUES (?, ?, ?, ?, ?)"#,
            params![at.0, at.1, table, index, change],
        )?;
        Ok(())
    }

    fn drop_table(&mut self, table: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.clear(table)?;
        self.relations.remove(table);
        self.conn.execute(r#"DELETE FROM "stateTables" WHERE tableKey = ?"#, [table])?;
        self.conn.execute(r#"DELETE FROM "stateSchema" WHERE tableKey = ?"#, [table])?;
        Ok(())
    }

    fn drop_index(&mut self, index: &str) -> anyhow::Result<()> {
        self.flush()?;
        self.conn.execute(r#"DELETE FROM "stateSchema" WHERE indexKey = ?"#, [index])?;
        Ok(())
    }

    fn rename_table(&mut self, old: &str, new: &str) -> anyhow::Result<()> {
        self.flush()?;
        // The relation object still names the old table: the next row
        // change of the new one writes its own.
        self.relations.remove(old);
        self.relations.remove(new);
        self.conn.execute(r#"DELETE FROM "stateTables" WHERE tableKey = ?1"#, [new])?;
        self.conn.execute(r#"UPDATE "stateTables" SET tableKey = ?1 WHERE tableKey = ?2"#, [new, old])?;
        self.conn.execute(r#"UPDATE "stateRows" SET tableKey = ?1 WHERE tableKey = ?2"#, [new, old])?;
        self.conn.execute(r#"UPDATE "stateSchema" SET tableKey = ?1 WHERE tableKey = ?2"#, [new, old])?;
        Ok(())
    }

    fn edit_column(&mut self, table: &str, column: &str, rename_to: Option<&str>) -> anyhow::Result<()> {
        self.flush()?;
        let rows: Vec<(String, String)> = self
            .conn
            .prepare(r#"SELECT rowKey, row FROM "stateRows" WHERE tableKey = ?"#)?
            .query_map([table], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        let mut update = self.conn.prepare(r#"UPDATE "stateRows" SET row = ? WHERE tableKey = ? AND rowKey = ?"#)?;
        for (key, row) in rows {
            let edited = state::edit_column(&row, column, rename_to).map_err(anyhow::Error::msg)?;
            update.execute(params![edited, table, key])?;
        }
        Ok(())
    }
}

/// Cached statements keep their plan whatever values are bound. Without
/// this, SQLite (built with STAT4) marks a statement whose `LIMIT ?` or
/// compared parameter is bound again as expired and compiles it anew on
/// every run: a catch-up read of 1,000 rows spent a quarter of its time
/// re-preparing its query.
fn keep_plans(conn: &Connection) -> anyhow::Result<()> {
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    Ok(())
}

/// Reads beside the writer, each on its own connection (WAL lets readers
/// run while the writer commits).
pub struct SqliteReader {
    path: PathBuf,
}

impl SqliteReader {
    pub fn new(path: &Path) -> Self {
        SqliteReader { path: path.to_path_buf() }
    }

    fn connect(&self) -> anyhow::Result<Connection> {
        let conn = Connection::open(&self.path).with_context(|| format!("opening {}", self.path.display()))?;
        conn.busy_timeout(std::time::Duration::from_secs(20))?;
        keep_plans(&conn)?;
        // A reader scans forward once; the default 2 MiB page cache per
        // connection bought nothing but memory (100 catching-up subscribers
        // held 200 MB of it in a heap profile). The OS caches the file.
        conn.pragma_update(None, "cache_size", -256)?;
        Ok(conn)
    }
}

/// A batch of the log after a cursor.
const READ_ROWS: &str = r#"SELECT watermark, pos, tag, change FROM "changeLog"
    WHERE watermark >= ?1 AND watermark <= ?2 AND (watermark > ?1 OR pos > ?3)
    ORDER BY watermark, pos LIMIT ?4"#;

struct SqliteSnapshot {
    conn: Connection,
    last_watermark: String,
}

impl LogSnapshot for SqliteSnapshot {
    fn last_watermark(&self) -> &str {
        &self.last_watermark
    }

    fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>> {
        // The lower bound is the cursor's watermark, so each batch is an index
        // range scan rather than a scan from `from`.
        let (low, ap) = match after {
            Some((w, p)) => (w.max(from), p),
            None => (from, -1),
        };
        let mut stmt = self.conn.prepare_cached(READ_ROWS)?;
        let mut rows = Vec::with_capacity(limit.min(4096));
        for row in stmt.query_map(params![low, self.last_watermark, ap, limit as i64], |r| {
            Ok(StoredRow { watermark: r.get(0)?, pos: r.get(1)?, tag: r.get(2)?, change: r.get(3)? })
        })? {
            rows.push(row?);
        }
        Ok(rows)
    }

    fn state_kept(&mut self) -> anyhow::Result<bool> {
        let kept: Option<i64> = self
            .conn
            .query_row(
                r#"SELECT 1 FROM "stateConfig" WHERE replicaVersion = (SELECT replicaVersion FROM "replicationConfig")"#,
                [],
                |r| r.get(0),
            )
            .optional()?;
        Ok(kept.is_some())
    }

    fn state_schema(&mut self) -> anyhow::Result<Vec<String>> {
        let mut stmt = self.conn.prepare(r#"SELECT change FROM "stateSchema" ORDER BY watermark, pos"#)?;
        let changes = stmt.query_map([], |r| r.get(0))?.collect::<Result<Vec<String>, _>>()?;
        Ok(changes)
    }

    fn state_rows(&mut self, after: Option<(&str, &str)>, limit: usize) -> anyhow::Result<Vec<StateRow>> {
        let (table, key) = after.unwrap_or(("", ""));
        let mut stmt = self.conn.prepare_cached(
            r#"SELECT r.tableKey, r.rowKey, r.row, t.relation
               FROM "stateRows" r JOIN "stateTables" t ON t.tableKey = r.tableKey
               WHERE (r.tableKey, r.rowKey) > (?1, ?2)
               ORDER BY r.tableKey, r.rowKey LIMIT ?3"#,
        )?;
        let rows = stmt
            .query_map(params![table, key, limit as i64], |r| {
                Ok(StateRow { table: r.get(0)?, key: r.get(1)?, row: r.get(2)?, relation: r.get(3)? })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

impl Drop for SqliteSnapshot {
    fn drop(&mut self) {
        let _ = self.conn.execute_batch("COMMIT");
    }
}

impl LogReader for SqliteReader {
    fn size_bytes(&self) -> anyhow::Result<Option<u64>> {
        // The database and its write-ahead log (checkpointed into it).
        let with = |suffix: &str| std::fs::metadata(format!("{}{suffix}", self.path.display())).map_or(0, |m| m.len());
        Ok(Some(with("") + with("-wal")))
    }

    fn snapshot(&self) -> anyhow::Result<Box<dyn LogSnapshot>> {
        let conn = self.connect()?;
        // The first read inside the transaction pins the WAL snapshot.
        conn.execute_batch("BEGIN DEFERRED")?;
        let last_watermark: String =
            conn.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0))?;
        Ok(Box::new(SqliteSnapshot { conn, last_watermark }))
    }

    fn bounds(&self) -> anyhow::Result<Bounds> {
        let conn = self.connect()?;
        let min_watermark: Option<String> =
            conn.query_row(r#"SELECT min(watermark) FROM "changeLog""#, [], |r| r.get(0))?;
        let last_watermark: String =
            conn.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0))?;
        Ok(Bounds { min_watermark, last_watermark })
    }

    fn purge_before(&self, floor: &str, replica_version: &str) -> anyhow::Result<u64> {
        let conn = self.connect()?;
        let n = conn.execute(
            r#"DELETE FROM "changeLog" WHERE watermark < ?1
               AND watermark < (SELECT max(watermark) FROM "changeLog")
               AND (SELECT replicaVersion FROM "replicationConfig") = ?2"#,
            [floor, replica_version],
        )?;
        Ok(n as u64)
    }

    fn retention_floor(
        &self,
        transactions: Option<u64>,
        age: Option<std::time::Duration>,
    ) -> anyhow::Result<Option<String>> {
        let conn = self.connect()?;
        let mut floor: Option<String> = None;
        if let Some(n) = transactions.filter(|n| *n > 0) {
            let w: Option<String> = conn
                .query_row(
                    r#"SELECT watermark FROM "changeLog" WHERE tag = 'commit'
                       ORDER BY watermark DESC LIMIT 1 OFFSET ?1"#,
                    [n as i64 - 1],
                    |r| r.get(0),
                )
                .optional()?;
            // Fewer than n transactions: keep everything.
            floor = Some(w.unwrap_or_default());
        }
        if let Some(age) = age {
            let cutoff = std::time::SystemTime::now()
                .checked_sub(age)
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0);
            let w: Option<String> = conn
                .query_row(
                    r#"SELECT min(watermark) FROM "changeLog" WHERE tag = 'commit' AND storedAtMs >= ?1"#,
                    [cutoff],
                    |r| r.get(0),
                )
                .optional()?
                .flatten();
            // Nothing that young: the window keeps nothing extra.
            if let Some(w) = w {
                floor = Some(floor.map_or(w.clone(), |f| f.min(w)));
            }
        }
        Ok(floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row<'a>(w: &'a str, pos: i64, tag: &'a str) -> LogRow<'a> {
        LogRow { watermark: w, pos, tag, change: "{}", precommit: None }
    }

    #[test]
    fn a_catch_up_read_keeps_its_compiled_statement_from_batch_to_batch() {
        let dir = tempdir();
        let path = dir.join("log.db");
        let mut log = SqliteChangeLog::open(&path, Durability::Full).unwrap();
        log.reset("00").unwrap();
        for w in ["01", "02", "03"] {
            log.begin().unwrap();
            log.append(&[row(w, 0, "begin"), row(w, 1, "insert"), row(w, 2, "commit")]).unwrap();
            log.commit(w).unwrap();
        }
        let conn = SqliteReader::new(&path).connect().unwrap();
        let mut snapshot = SqliteSnapshot { conn, last_watermark: "03".into() };
        let mut after = None;
        let mut read = Vec::new();
        loop {
            let rows = snapshot.read("00", after.as_ref().map(|(w, p): &(String, i64)| (w.as_str(), *p)), 2).unwrap();
            let Some(last) = rows.last() else { break };
            after = Some((last.watermark.clone(), last.pos));
            read.extend(rows.into_iter().map(|r| (r.watermark, r.pos)));
        }
        // The reset's rows at 00, then three transactions of three.
        assert_eq!(read.len(), 11, "{read:?}");
        // Each batch bound new values to the same cached statement; none
        // made SQLite compile it again.
        let stmt = snapshot.conn.prepare_cached(READ_ROWS).unwrap();
        assert!(stmt.get_status(rusqlite::StatementStatus::Run) >= 5);
        assert_eq!(stmt.get_status(rusqlite::StatementStatus::RePrepare), 0);
    }

    #[test]
    fn seeds_resets_and_appends() {
        let dir = tempdir();
        let path = dir.join("log.db");
        let mut log = SqliteChangeLog::open(&path, Durability::Full).unwrap();
        assert_eq!(log.state().unwrap(), None);
        log.reset("00").unwrap();
        assert_eq!(
            log.state().unwrap(),
            Some(LogState {
                replica_version: "00".into(),
                last_watermark: "00".into(),
                reset_required: false,
                owner: None
            })
        );
        log.begin().unwrap();
        let rows: Vec<_> = (0..600).map(|p| row("01", p, "commit")).collect();
        log.append(&rows).unwrap();
        log.commit("01").unwrap();
        drop(log);
        let mut log = SqliteChangeLog::open(&path, Durability::Full).unwrap();
        assert_eq!(log.bounds().unwrap(), Bounds { min_watermark: Some("00".into()), last_watermark: "01".into() });
        let n: i64 = log.conn.query_row(r#"SELECT count(*) FROM "changeLog""#, [], |r| r.get(0)).unwrap();
        assert_eq!(n, 602);
        log.reset("05").unwrap();
        let n: i64 = log.conn.query_row(r#"SELECT count(*) FROM "changeLog""#, [], |r| r.get(0)).unwrap();
        assert_eq!(n, 2);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn savepoints_drop_only_the_rolled_back_transaction() {
        let dir = tempdir();
        let mut log = SqliteChangeLog::open(&dir.join("log.db"), Durability::Normal).unwrap();
        log.reset("00").unwrap();
        log.begin().unwrap();
        log.append(&[row("01", 0, "begin")]).unwrap();
        log.savepoint().unwrap();
        log.append(&[row("02", 0, "begin")]).unwrap();
        log.rollback_to_savepoint().unwrap();
        log.commit("01").unwrap();
        let ws: Vec<String> = log
            .conn
            .prepare(r#"SELECT watermark FROM "changeLog" ORDER BY watermark, pos"#)
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(ws, ["00", "00", "01"]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    const ITEMS: &str = r#"{"schema":"public","name":"items","rowKey":{"columns":["id"],"type":"default"}}"#;

    fn change(tag: &str, rest: &str) -> String {
        format!(r#"{{"tag":"{tag}",{rest}}}"#)
    }

    fn data(tag: &str, key: Option<&str>, new: Option<&str>) -> String {
        let mut rest = format!(r#""relation":{ITEMS}"#);
        if let Some(k) = key {
            rest.push_str(&format!(r#","key":{k}"#));
        }
        if let Some(n) = new {
            rest.push_str(&format!(r#","new":{n}"#));
        }
        change(tag, &rest)
    }

    /// Appends one transaction of `(tag, change)` at `w` and commits it.
    fn tx(log: &mut SqliteChangeLog, w: &str, changes: &[(&str, String)]) {
        log.begin().unwrap();
        append_tx(log, w, changes);
        log.commit(w).unwrap();
    }

    fn append_tx(log: &mut SqliteChangeLog, w: &str, changes: &[(&str, String)]) {
        let mut rows =
            vec![LogRow { watermark: w, pos: 0, tag: "begin", change: r#"{"tag":"begin"}"#, precommit: None }];
        for (i, (tag, c)) in changes.iter().enumerate() {
            rows.push(LogRow { watermark: w, pos: i as i64 + 1, tag, change: c, precommit: None });
        }
        log.append(&rows).unwrap();
    }

    fn state_of(path: &Path) -> (bool, Vec<String>, Vec<(String, String)>) {
        let mut snap = SqliteReader::new(path).snapshot().unwrap();
        let rows = snap.state_rows(None, 100).unwrap().into_iter().map(|r| (r.key, r.row)).collect();
        (snap.state_kept().unwrap(), snap.state_schema().unwrap(), rows)
    }

    #[test]
    fn the_table_state_follows_every_kind_of_change_and_rolls_back_with_the_log() {
        let dir = tempdir();
        let path = dir.join("log.db");
        let mut log = SqliteChangeLog::open(&path, Durability::Normal).unwrap().with_table_state(true).unwrap();
        log.reset("00").unwrap();
        let create = change(
            "create-table",
            r#""spec":{"schema":"public","name":"items","columns":{"id":{"pos":1,"dataType":"int8"}},"primaryKey":["id"]}"#,
        );
        let index = change(
            "create-index",
            r#""spec":{"schema":"public","name":"items_pkey","tableName":"items","columns":{"id":"ASC"},"unique":true}"#,
        );
        let insert =
            |id: i64, a: &str| data("insert", None, Some(&format!(r#"{{"id":{id},"a":"{a}","big":"toast{id}"}}"#)));
        tx(
            &mut log,
            "01",
            &[
                ("create-table", create.clone()),
                ("create-index", index.clone()),
                ("insert", insert(1, "x")),
                ("insert", insert(2, "x")),
                ("insert", insert(3, "x")),
            ],
        );
        // An update that leaves out an unchanged column keeps its value; a
        // key change moves the row; a delete removes it.
        tx(
            &mut log,
            "02",
            &[
                ("update", data("update", Some("null"), Some(r#"{"id":1,"a":"y"}"#))),
                ("update", data("update", Some(r#"{"id":2}"#), Some(r#"{"id":20,"a":"moved","big":"toast2"}"#))),
                ("delete", data("delete", Some(r#"{"id":3}"#), None)),
            ],
        );
        // A transaction rolled back to its savepoint leaves no trace.
        log.begin().unwrap();
        log.savepoint().unwrap();
        append_tx(
            &mut log,
            "03",
            &[("insert", insert(4, "gone")), ("truncate", change("truncate", &format!(r#""relations":[{ITEMS}]"#)))],
        );
        log.rollback_to_savepoint().unwrap();
        log.commit("02").unwrap();
        let (kept, schema, rows) = state_of(&path);
        assert!(kept);
        assert_eq!(schema, [create.clone(), index.clone()]);
        assert_eq!(
            rows,
            [
                ("[1]".to_string(), r#"{"id":1,"a":"y","big":"toast1"}"#.to_string()),
                ("[20]".to_string(), r#"{"id":20,"a":"moved","big":"toast2"}"#.to_string()),
            ]
        );
        // A dropped column leaves every row; a renamed one is renamed in
        // each; a renamed table keeps its rows and history.
        let drop_a = change("drop-column", r#""table":{"schema":"public","name":"items"},"column":"a""#);
        let rename_big = change(
            "update-column",
            r#""table":{"schema":"public","name":"items"},"old":{"name":"big","spec":{"pos":3,"dataType":"text"}},"new":{"name":"payload","spec":{"pos":3,"dataType":"text"}}"#,
        );
        let rename = change(
            "rename-table",
            r#""old":{"schema":"public","name":"items"},"new":{"schema":"public","name":"goods"}"#,
        );
        tx(
            &mut log,
            "04",
            &[("drop-column", drop_a.clone()), ("update-column", rename_big.clone()), ("rename-table", rename.clone())],
        );
        let (_, schema, rows) = state_of(&path);
        assert_eq!(schema, [create.clone(), index.clone(), drop_a, rename_big, rename]);
        assert_eq!(rows[0].1, r#"{"id":1,"payload":"toast1"}"#);
        let mut snap = SqliteReader::new(&path).snapshot().unwrap();
        let first = snap.state_rows(None, 1).unwrap();
        assert_eq!(first[0].table, state::object_key("public", "goods"));
        assert_eq!(first[0].relation, ITEMS, "the relation its rows were last changed with");
        let next = snap.state_rows(Some((&first[0].table, &first[0].key)), 10).unwrap();
        assert_eq!(next.len(), 1, "paging resumes after the cursor");
        drop(snap);
        // Truncate and drop-table empty it; drop-index takes the index out.
        let goods = r#"{"schema":"public","name":"goods","rowKey":{"columns":["id"],"type":"default"}}"#;
        tx(&mut log, "05", &[("truncate", change("truncate", &format!(r#""relations":[{goods}]"#)))]);
        assert!(state_of(&path).2.is_empty());
        tx(
            &mut log,
            "06",
            &[
                ("drop-index", change("drop-index", r#""id":{"schema":"public","name":"items_pkey"}"#)),
                ("drop-table", change("drop-table", r#""id":{"schema":"public","name":"goods"}"#)),
            ],
        );
        assert_eq!(state_of(&path).1, Vec::<String>::new());
        // A new lineage starts the state again.
        log.reset("07").unwrap();
        assert_eq!(state_of(&path), (true, vec![], vec![]));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_log_without_a_kept_state_says_so_and_still_stores() {
        let dir = tempdir();
        let path = dir.join("log.db");
        let mut log = SqliteChangeLog::open(&path, Durability::Normal).unwrap().with_table_state(true).unwrap();
        log.reset("00").unwrap();
        // As a log upgraded from before the state: no stateConfig row.
        log.conn.execute(r#"DELETE FROM "stateConfig""#, []).unwrap();
        tx(&mut log, "01", &[("insert", data("insert", None, Some(r#"{"id":1}"#)))]);
        assert_eq!(state_of(&path), (false, vec![], vec![]));
        // A change the state cannot follow turns it off; the log goes on.
        log.reset("02").unwrap();
        tx(&mut log, "03", &[("insert", change("insert", r#""relation":{"schema":"s","name":"t"},"new":{"id":1}"#))]);
        assert!(!state_of(&path).0);
        assert_eq!(log.bounds().unwrap().last_watermark, "03");
        // A run without the state marks a kept one as no longer kept.
        log.reset("04").unwrap();
        assert!(state_of(&path).0);
        drop(log);
        let mut log = SqliteChangeLog::open(&path, Durability::Normal).unwrap().with_table_state(false).unwrap();
        assert!(!state_of(&path).0);
        tx(&mut log, "05", &[("insert", data("insert", None, Some(r#"{"id":1}"#)))]);
        assert_eq!(state_of(&path), (false, vec![], vec![]));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "sluice-sqlite-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
