//! Choosing and opening a change log: the one place that knows which stores
//! exist. `sluice run`, the admin commands, the benchmarks and the tests all
//! open their logs here, so a new store is added in `storage/` alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::postgres::{PgSettings, PostgresChangeLog, PostgresReader};
use super::sqlite::{Durability, SqliteChangeLog, SqliteReader};
use super::writer_lock::WriterLock;
use super::{ChangeLog, LogReader};
use crate::pgconn::PgTarget;

/// Where the change log lives, as `--change-db` names it.
#[derive(Clone, Debug)]
pub enum ChangeDb {
    Sqlite(PathBuf),
    /// A PostgreSQL server holding Zero's change DB schema.
    Postgres(Box<PgTarget>),
}

impl ChangeDb {
    /// `sqlite:PATH`, a bare path (SQLite), or a Postgres connection string
    /// in either libpq form. A keyword string (`host=... dbname=...`) is
    /// Postgres: anything with `=` that fails to parse as one is an error,
    /// not a file name.
    pub fn parse(text: &str) -> Result<ChangeDb, String> {
        if let Some(path) = text.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err("sqlite: needs a file path".into());
            }
            return Ok(ChangeDb::Sqlite(PathBuf::from(path)));
        }
        if text.starts_with("postgres://") || text.starts_with("postgresql://") || text.contains('=') {
            return PgTarget::parse(text).map(|t| ChangeDb::Postgres(Box::new(t)));
        }
        if text.is_empty() {
            return Err("expected sqlite:PATH or a Postgres connection string".into());
        }
        Ok(ChangeDb::Sqlite(PathBuf::from(text)))
    }

    /// The directory beside the log for Sluice's own files (the compiled
    /// plugin cache): the SQLite file's, or `sluice-data`.
    pub fn data_dir(&self) -> PathBuf {
        match self {
            ChangeDb::Sqlite(path) => path.parent().map(Path::to_path_buf).unwrap_or_default(),
            ChangeDb::Postgres(_) => PathBuf::from("sluice-data"),
        }
    }

    /// The store for this place, with `options` for what a store needs
    /// beyond its address.
    pub fn store(&self, options: &StoreOptions) -> LogStore {
        match self {
            ChangeDb::Sqlite(path) => LogStore::Sqlite { path: path.clone(), durability: options.durability },
            ChangeDb::Postgres(target) => LogStore::Postgres {
                settings: Box::new(PgSettings {
                    target: (**target).clone(),
                    app_id: options.app_id.clone(),
                    shard_num: options.shard_num,
                    task_id: options.task_id.clone(),
                    statement_timeout: options.statement_timeout,
                    call_timeout: options.call_timeout,
                    application_name: options.application_name.clone(),
                    synchronous_commit: options.durability == Durability::Full,
                }),
                readers: options.readers,
                wait_up_to: options.wait_up_to,
            },
        }
    }
}

/// What opening a store takes beyond its address (`sluice run`'s flags);
/// the defaults are `sluice run`'s.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Zero's app ID and shard: a Postgres change DB keeps the log in schema
    /// `<app-id>_<shard-num>/cdc`.
    pub app_id: String,
    pub shard_num: u32,
    /// This host's identity as the log's owner.
    pub task_id: String,
    pub durability: Durability,
    pub statement_timeout: Duration,
    pub call_timeout: Duration,
    /// The name a Postgres change DB sees in `pg_stat_activity`.
    pub application_name: String,
    /// Catch-ups reading a Postgres change DB at once.
    pub readers: usize,
    /// How long to wait for a change DB that cannot be reached yet.
    pub wait_up_to: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            app_id: "zero".into(),
            shard_num: 0,
            task_id: "sluice".into(),
            durability: Durability::Full,
            statement_timeout: Duration::from_secs(20),
            call_timeout: super::postgres::DEFAULT_CALL_TIMEOUT,
            // Zero's change-streamer connects under this name.
            application_name: "zero-change-streamer".into(),
            readers: super::postgres::DEFAULT_MAX_SNAPSHOTS,
            wait_up_to: Duration::ZERO,
        }
    }
}

/// A change log store, ready to open.
#[derive(Clone, Debug)]
pub enum LogStore {
    Sqlite {
        path: PathBuf,
        durability: Durability,
    },
    Postgres {
        settings: Box<PgSettings>,
        /// Catch-ups reading at once (each holds a connection).
        readers: usize,
        /// How long `open` waits out a change DB that cannot be reached.
        wait_up_to: Duration,
    },
}

/// An open change log: its single writer, a reader beside it, and a line
/// naming it for logs and `/status`.
pub struct OpenedLog {
    pub writer: Box<dyn ChangeLog>,
    pub reader: Arc<dyn LogReader>,
    pub description: String,
}

impl LogStore {
    /// An SQLite log at `path`, durable at each commit.
    pub fn sqlite(path: impl Into<PathBuf>) -> LogStore {
        LogStore::Sqlite { path: path.into(), durability: Durability::Full }
    }

    /// A Postgres change DB log, opened at once or not at all.
    pub fn postgres(settings: PgSettings) -> LogStore {
        LogStore::Postgres {
            settings: Box::new(settings),
            readers: super::postgres::DEFAULT_MAX_SNAPSHOTS,
            wait_up_to: Duration::ZERO,
        }
    }

    /// "SQLite PATH" or "Postgres schema S at HOST".
    pub fn describe(&self) -> String {
        match self {
            LogStore::Sqlite { path, .. } => format!("SQLite {}", path.display()),
            LogStore::Postgres { settings, .. } => {
                format!("Postgres schema {} at {}", settings.schema_name(), settings.target.describe())
            }
        }
    }

    /// A reader of the log, without a writer (no connection is opened yet).
    /// Needs a Tokio runtime for a Postgres store.
    pub fn reader(&self) -> anyhow::Result<Arc<dyn LogReader>> {
        Ok(match self {
            LogStore::Sqlite { path, .. } => Arc::new(SqliteReader::new(path)),
            LogStore::Postgres { settings, readers, .. } => {
                Arc::new(PostgresReader::new((**settings).clone(), runtime()?).with_max_snapshots(*readers))
            }
        })
    }

    /// Opens the log's writer (creating the log if there is none) and a
    /// reader beside it. `table_state` keeps the compacted table state from
    /// the next lineage on. Blocking: call it from a blocking thread or
    /// inside `tokio::task::block_in_place`; a Postgres store needs a Tokio
    /// runtime.
    pub fn open(&self, table_state: bool) -> anyhow::Result<OpenedLog> {
        let writer: Box<dyn ChangeLog> = match self {
            LogStore::Sqlite { path, durability } => {
                Box::new(SqliteChangeLog::open(path, *durability)?.with_table_state(table_state)?)
            }
            LogStore::Postgres { settings, wait_up_to, .. } => {
                let log = if wait_up_to.is_zero() {
                    PostgresChangeLog::open((**settings).clone(), runtime()?)?
                } else {
                    PostgresChangeLog::open_when_reachable((**settings).clone(), runtime()?, *wait_up_to)?
                };
                Box::new(log.with_table_state(table_state)?)
            }
        };
        Ok(OpenedLog { writer, reader: self.reader()?, description: self.describe() })
    }

    /// One writer per SQLite file: the lock held while this process writes
    /// it, labelled `holder` for whoever finds it taken. `None` for stores
    /// whose writers hand ownership over in the database itself.
    pub fn lock_writer(&self, holder: &str) -> anyhow::Result<Option<WriterLock>> {
        Ok(match self {
            LogStore::Sqlite { path, .. } => Some(WriterLock::acquire(path, holder)?),
            LogStore::Postgres { .. } => None,
        })
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current()
        .map_err(|_| anyhow::anyhow!("a Postgres change DB is opened inside a Tokio runtime"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn change_db_names_a_store_by_its_form() {
        assert!(matches!(ChangeDb::parse("sqlite:a/b.db"), Ok(ChangeDb::Sqlite(p)) if p == Path::new("a/b.db")));
        assert!(matches!(ChangeDb::parse("b.db"), Ok(ChangeDb::Sqlite(_))));
        assert!(matches!(ChangeDb::parse("postgres://u@h/db"), Ok(ChangeDb::Postgres(_))));
        assert!(matches!(ChangeDb::parse("host=h dbname=d"), Ok(ChangeDb::Postgres(_))));
        assert!(ChangeDb::parse("sqlite:").is_err());
        assert!(ChangeDb::parse("").is_err());
        assert!(ChangeDb::parse("host=h bogus_key=1").is_err(), "a broken keyword string is not a file name");
    }

    #[test]
    fn a_sqlite_store_opens_writer_and_reader_on_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChangeDb::Sqlite(dir.path().join("log.db")).store(&StoreOptions::default());
        let mut log = store.open(false).unwrap();
        log.writer.reset("01").unwrap();
        assert_eq!(log.reader.bounds().unwrap().last_watermark, "01");
        assert_eq!(log.description, format!("SQLite {}", dir.path().join("log.db").display()));
        let lock = store.lock_writer("test").unwrap();
        assert!(lock.is_some());
        assert!(store.lock_writer("second").is_err(), "one writer per file");
    }
}
