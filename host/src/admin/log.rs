//! `sluice log inspect` and `sluice log reset`: the change log as it is at
//! rest, in either store, without a running Sluice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use crate::pgconn::PgTarget;
use crate::storage::open::LogStore;
use crate::storage::postgres::quote_ident;

/// What `sluice log inspect` reports.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LogReport {
    pub place: String,
    /// False: no change log there yet.
    pub exists: bool,
    pub replica_version: Option<String>,
    pub reset_required: bool,
    pub owner: Option<String>,
    pub owner_address: Option<String>,
    pub min_watermark: Option<String>,
    pub last_watermark: Option<String>,
    pub transactions: u64,
    pub changes: u64,
    /// Bytes on disk (the SQLite files; the Postgres schema's tables with
    /// their indexes and TOAST).
    pub size_bytes: u64,
    /// Row changes per table in the log.
    pub tables: Vec<TableCount>,
}

#[derive(Debug, Serialize)]
pub struct TableCount {
    pub table: String,
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
}

/// `sluice log inspect`: what the log holds, read in one snapshot.
pub async fn inspect(store: &LogStore) -> anyhow::Result<LogReport> {
    match store {
        LogStore::Sqlite { path, .. } => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || inspect_sqlite(&path)).await?
        }
        LogStore::Postgres { settings, .. } => inspect_postgres(&settings.target, &settings.schema_name()).await,
    }
}

/// `sluice log reset`: empties the change log, so the next `sluice run`
/// starts a new lineage from a fresh snapshot and every subscriber syncs
/// again. Refused while a writer holds an SQLite log (whatever the flags),
/// while a Sluice answers at the owner address the log records (unless
/// `force`), and without `yes`.
pub async fn reset(store: &LogStore, yes: bool, force: bool) -> anyhow::Result<()> {
    let nothing = || println!("{}: there is no change log to reset", store.describe());
    if matches!(store, LogStore::Sqlite { path, .. } if !path.exists()) {
        nothing();
        return Ok(());
    }
    // Held from the first check through the deletion, so no writer starts
    // meanwhile.
    let _lock = store.lock_writer("sluice log reset")?;
    let report = inspect(store).await?;
    if !report.exists {
        nothing();
        return Ok(());
    }
    if let Some(address) = report.owner_address.as_deref().filter(|_| !force) {
        let answers = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(address))
            .await
            .is_ok_and(|c| c.is_ok());
        anyhow::ensure!(
            !answers,
            "a Sluice answers at {address}, the owner address this log records: stop it first (or pass --force)"
        );
    }
    anyhow::ensure!(
        yes,
        "this deletes the change log at {} (lineage {}, {} transactions); every subscriber will sync again. Pass --yes to do it",
        store.describe(),
        report.replica_version.as_deref().unwrap_or("-"),
        report.transactions
    );
    match store {
        LogStore::Sqlite { path, .. } => {
            for suffix in ["", "-wal", "-shm"] {
                let file = PathBuf::from(format!("{}{suffix}", path.display()));
                match std::fs::remove_file(&file) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).with_context(|| format!("removing {}", file.display())),
                }
            }
        }
        LogStore::Postgres { settings, .. } => {
            let schema = settings.schema_name();
            let client = super::connect_postgres(&settings.target, "the change DB").await?;
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", quote_ident(&schema)))
                .await
                .with_context(|| format!("dropping schema {schema}"))?;
        }
    }
    println!("deleted the change log at {}; the next `sluice run` starts a new lineage", store.describe());
    Ok(())
}

fn inspect_sqlite(path: &Path) -> anyhow::Result<LogReport> {
    let mut report = LogReport { place: format!("SQLite {}", path.display()), ..LogReport::default() };
    if !path.exists() {
        return Ok(report);
    }
    let mut conn = rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .with_context(|| format!("opening {}", path.display()))?;
    // One read transaction: every figure from the same state of a log that
    // a running Sluice may be writing.
    let conn = conn.transaction().context("starting a read transaction")?;
    let has_log: bool = conn.query_row(
        "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'changeLog'",
        [],
        |r| r.get(0),
    )?;
    if !has_log {
        anyhow::bail!("{} is not a Sluice change log (no changeLog table)", path.display());
    }
    report.exists = true;
    let config = conn.query_row(r#"SELECT replicaVersion, resetRequired FROM "replicationConfig""#, [], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? != 0))
    });
    if let Ok((version, reset)) = config {
        report.replica_version = Some(version);
        report.reset_required = reset;
    }
    if let Ok((last, owner, address)) =
        conn.query_row(r#"SELECT lastWatermark, owner, ownerAddress FROM "replicationState""#, [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
    {
        (report.last_watermark, report.owner, report.owner_address) = (Some(last), owner, address);
    }
    report.min_watermark = conn.query_row(r#"SELECT min(watermark) FROM "changeLog""#, [], |r| r.get(0))?;
    (report.transactions, report.changes) = conn.query_row(
        r#"SELECT count(*) FILTER (WHERE tag = 'commit'), count(*) FILTER (WHERE tag NOT IN ('begin', 'commit', 'rollback')) FROM "changeLog""#,
        [],
        |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
    )?;
    let mut per_table = conn.prepare(
        r#"SELECT json_extract(change, '$.relation.schema') || '.' || json_extract(change, '$.relation.name') AS t,
                  count(*) FILTER (WHERE tag = 'insert'), count(*) FILTER (WHERE tag = 'update'),
                  count(*) FILTER (WHERE tag = 'delete')
           FROM "changeLog" WHERE tag IN ('insert', 'update', 'delete') GROUP BY t ORDER BY t"#,
    )?;
    report.tables = per_table
        .query_map([], |r| {
            Ok(TableCount {
                table: r.get::<_, Option<String>>(0)?.unwrap_or_else(|| "?".into()),
                inserts: r.get::<_, i64>(1)? as u64,
                updates: r.get::<_, i64>(2)? as u64,
                deletes: r.get::<_, i64>(3)? as u64,
            })
        })?
        .collect::<Result<_, _>>()?;
    report.size_bytes = ["", "-wal"]
        .iter()
        .filter_map(|s| std::fs::metadata(format!("{}{s}", path.display())).ok())
        .map(|m| m.len())
        .sum();
    Ok(report)
}

async fn inspect_postgres(target: &PgTarget, schema: &str) -> anyhow::Result<LogReport> {
    let mut report =
        LogReport { place: format!("Postgres schema {schema} at {}", target.describe()), ..Default::default() };
    let client = super::connect_postgres(target, "the change DB").await?;
    let exists = client
        .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
        .await
        .context("looking for the change log's schema")?
        .is_some();
    if !exists {
        return Ok(report);
    }
    report.exists = true;
    // One snapshot: every figure from the same state of a log that a
    // running Sluice may be writing.
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .context("starting a read transaction")?;
    let s = quote_ident(schema);
    if let Some(row) = client
        .query_opt(
            &format!(r#"SELECT "replicaVersion", coalesce("resetRequired", false) FROM {s}."replicationConfig""#),
            &[],
        )
        .await
        .context("reading replicationConfig")?
    {
        report.replica_version = Some(row.get(0));
        report.reset_required = row.get(1);
    }
    if let Some(row) = client
        .query_opt(&format!(r#"SELECT "lastWatermark", "owner", "ownerAddress" FROM {s}."replicationState""#), &[])
        .await
        .context("reading replicationState")?
    {
        (report.last_watermark, report.owner, report.owner_address) = (Some(row.get(0)), row.get(1), row.get(2));
    }
    let row = client
        .query_one(
            &format!(
                r#"SELECT min(watermark), count(*) FILTER (WHERE change->>'tag' = 'commit'),
                          count(*) FILTER (WHERE change->>'tag' NOT IN ('begin', 'commit', 'rollback'))
                   FROM {s}."changeLog""#
            ),
            &[],
        )
        .await
        .context("counting the change log")?;
    report.min_watermark = row.get(0);
    report.transactions = row.get::<_, i64>(1) as u64;
    report.changes = row.get::<_, i64>(2) as u64;
    let rows = client
        .query(
            &format!(
                r#"SELECT (change->'relation'->>'schema') || '.' || (change->'relation'->>'name') AS t,
                          count(*) FILTER (WHERE change->>'tag' = 'insert'),
                          count(*) FILTER (WHERE change->>'tag' = 'update'),
                          count(*) FILTER (WHERE change->>'tag' = 'delete')
                   FROM {s}."changeLog" WHERE change->>'tag' IN ('insert', 'update', 'delete')
                   GROUP BY t ORDER BY t"#
            ),
            &[],
        )
        .await
        .context("counting changes per table")?;
    report.tables = rows
        .iter()
        .map(|r| TableCount {
            table: r.get::<_, Option<String>>(0).unwrap_or_else(|| "?".into()),
            inserts: r.get::<_, i64>(1) as u64,
            updates: r.get::<_, i64>(2) as u64,
            deletes: r.get::<_, i64>(3) as u64,
        })
        .collect();
    let size: i64 = client
        .query_one(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'",
            &[&schema],
        )
        .await
        .context("measuring the change log")?
        .get(0);
    report.size_bytes = size as u64;
    Ok(report)
}

impl std::fmt::Display for LogReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "change log      {}", self.place)?;
        if !self.exists {
            return writeln!(f, "                (none yet: the next `sluice run` starts one)");
        }
        let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        writeln!(
            f,
            "lineage         {}{}",
            or_dash(&self.replica_version),
            if self.reset_required { " (reset required)" } else { "" }
        )?;
        writeln!(f, "owner           {} at {}", or_dash(&self.owner), or_dash(&self.owner_address))?;
        writeln!(f, "watermarks      {} .. {}", or_dash(&self.min_watermark), or_dash(&self.last_watermark))?;
        writeln!(f, "transactions    {}", self.transactions)?;
        writeln!(f, "changes         {}", self.changes)?;
        writeln!(f, "size            {:.1} MiB", self.size_bytes as f64 / (1 << 20) as f64)?;
        if !self.tables.is_empty() {
            writeln!(f, "{:<40} {:>10} {:>10} {:>10}", "TABLE", "INSERTS", "UPDATES", "DELETES")?;
            for t in &self.tables {
                writeln!(f, "{:<40} {:>10} {:>10} {:>10}", t.table, t.inserts, t.updates, t.deletes)?;
            }
        }
        Ok(())
    }
}
