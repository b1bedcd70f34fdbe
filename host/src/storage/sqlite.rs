//! The embedded change log: one SQLite file in WAL mode.
//!
//! Tables mirror Zero's change DB: `changeLog` (watermark, pos, change,
//! precommit, plus the tag so replay needs no JSON parsing),
//! `replicationConfig` and `replicationState`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rusqlite::{params, Connection, OptionalExtension};

use super::{Bounds, ChangeLog, LogReader, LogRow, LogSnapshot, LogState, NewLineage, StoredRow, SQLITE_INSERT_ROWS};

const SCHEMA_VERSION: i64 = 1;

/// How hard SQLite works to make each commit durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// `synchronous=FULL`: a commit survives power loss (default).
    Full,
    /// `synchronous=NORMAL`: a commit survives a process crash, and may be
    /// lost on power loss. Faster; opt in with `--sync normal`.
    Normal,
}

pub struct SqliteChangeLog {
    conn: Connection,
}

impl SqliteChangeLog {
    pub fn open(path: &Path, durability: Durability) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let conn = Connection::open(path).with_context(|| format!("opening change log {}", path.display()))?;
        conn.busy_timeout(std::time::Duration::from_secs(20))?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        anyhow::ensure!(mode.eq_ignore_ascii_case("wal"), "{} cannot use WAL mode (got {mode})", path.display());
        conn.pragma_update(None, "synchronous", if durability == Durability::Full { "FULL" } else { "NORMAL" })?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        anyhow::ensure!(
            version == 0 || version == SCHEMA_VERSION,
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
            PRAGMA user_version = 1;
            "#,
        )
        .context("creating change-log tables")?;
        Ok(SqliteChangeLog { conn })
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
fn seed_lineage(conn: &Connection, replica_version: &str, owner: Option<(&str, &str)>) -> rusqlite::Result<()> {
    conn.execute_batch(r#"DELETE FROM "replicationState"; DELETE FROM "changeLog"; DELETE FROM "replicationConfig";"#)?;
    conn.execute(r#"INSERT INTO "replicationConfig" (replicaVersion) VALUES (?)"#, [replica_version])?;
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
    fn state(&mut self) -> anyhow::Result<Option<LogState>> {
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

    fn reset(&mut self, replica_version: &str) -> anyhow::Result<()> {
        let tx = self.conn.transaction()?;
        seed_lineage(&tx, replica_version, None)?;
        tx.commit()?;
        Ok(())
    }

    fn start_lineage(&mut self, lineage: &NewLineage) -> anyhow::Result<()> {
        anyhow::ensure!(!self.conn.is_autocommit(), "a lineage starts inside a storage transaction");
        seed_lineage(&self.conn, &lineage.replica_version, Some((&lineage.owner, &lineage.owner_address)))
            .with_context(|| format!("starting lineage {}", lineage.replica_version))
    }

    fn mark_reset_required(&mut self) -> anyhow::Result<()> {
        self.conn.execute(r#"UPDATE "replicationConfig" SET resetRequired = 1"#, [])?;
        Ok(())
    }

    fn assume_ownership(&mut self, task_id: &str, address: &str) -> anyhow::Result<()> {
        self.conn.execute(r#"UPDATE "replicationState" SET owner = ?, ownerAddress = ?"#, params![task_id, address])?;
        Ok(())
    }

    fn begin(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        Ok(())
    }

    fn savepoint(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("SAVEPOINT upstream_tx")?;
        Ok(())
    }

    fn release_savepoint(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("RELEASE upstream_tx")?;
        Ok(())
    }

    fn rollback_to_savepoint(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("ROLLBACK TO upstream_tx; RELEASE upstream_tx")?;
        Ok(())
    }

    fn append(&mut self, rows: &[LogRow<'_>]) -> anyhow::Result<()> {
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
        Ok(())
    }

    fn commit(&mut self, last_watermark: &str) -> anyhow::Result<()> {
        self.conn.prepare_cached(r#"UPDATE "replicationState" SET lastWatermark = ?"#)?.execute([last_watermark])?;
        self.conn.execute_batch("COMMIT")?;
        Ok(())
    }

    fn rollback(&mut self) -> anyhow::Result<()> {
        if !self.conn.is_autocommit() {
            self.conn.execute_batch("ROLLBACK")?;
        }
        Ok(())
    }

    fn bounds(&mut self) -> anyhow::Result<Bounds> {
        let min_watermark: Option<String> =
            self.conn.query_row(r#"SELECT min(watermark) FROM "changeLog""#, [], |r| r.get(0))?;
        let last_watermark: String =
            self.conn.query_row(r#"SELECT lastWatermark FROM "replicationState""#, [], |r| r.get(0))?;
        Ok(Bounds { min_watermark, last_watermark })
    }
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
        // A reader scans forward once; the default 2 MiB page cache per
        // connection bought nothing but memory (100 catching-up subscribers
        // held 200 MB of it in a heap profile). The OS caches the file.
        conn.pragma_update(None, "cache_size", -256)?;
        Ok(conn)
    }
}

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
        let mut stmt = self.conn.prepare_cached(
            r#"SELECT watermark, pos, tag, change FROM "changeLog"
               WHERE watermark >= ?1 AND watermark <= ?2 AND (watermark > ?1 OR pos > ?3)
               ORDER BY watermark, pos LIMIT ?4"#,
        )?;
        let rows = stmt
            .query_map(params![low, self.last_watermark, ap, limit as i64], |r| {
                Ok(StoredRow { watermark: r.get(0)?, pos: r.get(1)?, tag: r.get(2)?, change: r.get(3)? })
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
        let rows: Vec<_> = (0..600).map(|p| row("01", p, "insert")).collect();
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
