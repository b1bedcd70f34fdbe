//! The durable change log: every stored transaction, row by row.
//!
//! [`ChangeLog`] is the seam between the storer and a database. SQLite is the
//! embedded default; a Postgres change DB plugs in beside it. Calls are
//! blocking: the storer runs them on a thread of its own.

pub mod memory;
pub mod open;
pub mod postgres;
mod postgres_state;
pub mod sqlite;
pub mod state;
pub mod watched;
pub mod writer_lock;

/// Why a change-log write failed, and so what the replication loop does
/// next: stop cleanly (`OwnershipLost`, `Gone`), or retry from what is durable.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Another host owns the change log now.
    #[error("{0}")]
    OwnershipLost(String),
    /// The change log's schema or tables were dropped.
    #[error("the change log's tables are gone ({0})")]
    Gone(String),
    /// Anything else: a lost connection, a full disk, a statement that
    /// failed. Retried from the durable watermark after a back-off.
    #[error(transparent)]
    Backend(anyhow::Error),
}

/// What every [`ChangeLog`] call returns.
pub type LogResult<T> = Result<T, LogError>;

/// `anyhow::ensure!` for a [`LogResult`]: a failed check is a backend failure.
macro_rules! ensure_log {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::storage::LogError::Backend(anyhow::anyhow!($($arg)+)));
        }
    };
}
pub(crate) use ensure_log;

impl From<anyhow::Error> for LogError {
    /// A stop raised deep inside a store, and given context on its way up,
    /// stays a stop; anything else is a backend failure.
    fn from(e: anyhow::Error) -> Self {
        match e.downcast::<LogError>() {
            Ok(stop) => stop,
            Err(e) => LogError::Backend(e),
        }
    }
}

impl From<rusqlite::Error> for LogError {
    fn from(e: rusqlite::Error) -> Self {
        LogError::Backend(e.into())
    }
}

/// One row of the `changeLog` table.
#[derive(Debug, Clone, Copy)]
pub struct LogRow<'a> {
    /// The transaction's commit watermark (all rows of a transaction share it).
    pub watermark: &'a str,
    /// Position within the transaction, from 0 (the begin).
    pub pos: i64,
    pub tag: &'a str,
    /// The inner JSON object of the change.
    pub change: &'a str,
    /// Set on the commit row only: the watermark its begin carried.
    pub precommit: Option<&'a str>,
}

/// The lineage and resume point recorded in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogState {
    pub replica_version: String,
    pub last_watermark: String,
    pub reset_required: bool,
    /// The task that owns the log (None after a reset, before a claim).
    pub owner: Option<String>,
}

/// A lineage the storer writes with its first transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLineage {
    pub replica_version: String,
    /// The owning task and the address subscribers reach it at.
    pub owner: String,
    pub owner_address: String,
}

impl LogState {
    /// The lineage's first transaction (its snapshot) is durable: only then
    /// is the replica version a promise that subscribers may hold.
    pub fn established(&self) -> bool {
        self.last_watermark.as_str() > self.replica_version.as_str()
    }
}

/// Earliest and latest watermarks a subscriber can catch up between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounds {
    pub min_watermark: Option<String>,
    pub last_watermark: String,
}

/// Rows per multi-row INSERT statement in the SQLite log (its limit on bound
/// parameters keeps statements modest; the storer's batches are larger).
pub const SQLITE_INSERT_ROWS: usize = 256;

pub trait ChangeLog: Send {
    /// The recorded lineage, or `None` for a log that was never initialized.
    fn state(&mut self) -> LogResult<Option<LogState>>;

    /// Empties the log and seeds it for `replica_version`: the two initial
    /// rows (begin at pos 0, commit at pos 1) that make a subscriber at the
    /// replica version servable, and `lastWatermark = replica_version`.
    /// Committed at once, with no owner; for tests and tools. The replication
    /// loop uses [`ChangeLog::start_lineage`] instead.
    fn reset(&mut self, replica_version: &str) -> LogResult<()>;

    /// Inside the open storage transaction: empties the log and seeds it for
    /// a new lineage as [`ChangeLog::reset`] does, with `lineage.owner` as
    /// its owner. Nothing of it is visible before the storage transaction
    /// commits, and the storer commits it together with the lineage's first
    /// transaction (the snapshot): a replica version is never recorded, and
    /// so never discovered, before its snapshot is durable.
    fn start_lineage(&mut self, lineage: &NewLineage) -> LogResult<()>;

    /// Records that the upstream asked for a reset (`control reset-required`).
    fn mark_reset_required(&mut self) -> LogResult<()>;

    /// Records which host writes the log, and where subscribers reach it.
    fn assume_ownership(&mut self, task_id: &str, address: &str) -> LogResult<()>;

    /// Other hosts may write this log (they hand ownership over through
    /// it): until this host takes ownership, another may still commit.
    fn shared(&self) -> bool {
        false
    }

    /// How many rows the storer hands [`ChangeLog::append`] at most at once
    /// (the storer's own bounds on bytes apply too).
    fn append_batch_rows(&self) -> usize {
        2000
    }

    /// Opens a storage transaction.
    fn begin(&mut self) -> LogResult<()>;
    /// Marks a point inside the storage transaction to roll back to.
    fn savepoint(&mut self) -> LogResult<()>;
    fn release_savepoint(&mut self) -> LogResult<()>;
    fn rollback_to_savepoint(&mut self) -> LogResult<()>;
    /// Inserts rows (in batches, not one statement per row).
    fn append(&mut self, rows: &[LogRow<'_>]) -> LogResult<()>;
    /// Sets `lastWatermark` and commits; durable when it returns.
    fn commit(&mut self, last_watermark: &str) -> LogResult<()>;
    /// Abandons the storage transaction.
    fn rollback(&mut self) -> LogResult<()>;

    fn bounds(&mut self) -> LogResult<Bounds>;
}

/// A row read back for catch-up.
#[derive(Debug, Clone)]
pub struct StoredRow {
    pub watermark: String,
    pub pos: i64,
    pub tag: String,
    pub change: String,
}

/// A row of the compacted table state ([`state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRow {
    /// `["schema","name"]` ([`state::object_key`]).
    pub table: String,
    /// The row key ([`state`]: the key columns' values as a JSON array).
    pub key: String,
    /// The row, a JSON object.
    pub row: String,
    /// The table's relation object, as its row changes carry it.
    pub relation: String,
}

/// A consistent read view of the log, pinned when it was taken: it holds
/// every transaction committed before and none after.
pub trait LogSnapshot: Send {
    fn last_watermark(&self) -> &str;
    /// Rows with `from <= watermark <= last_watermark`, in (watermark, pos)
    /// order, after the `after` cursor, at most `limit`.
    fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>>;

    /// Whether the log has kept the table state since its lineage began, so
    /// that the state is whole at `last_watermark`.
    fn state_kept(&mut self) -> anyhow::Result<bool> {
        Ok(false)
    }
    /// The schema changes that build the state's tables and indexes, in log
    /// order (inner JSON objects).
    fn state_schema(&mut self) -> anyhow::Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// State rows after the cursor `after` (table, key), in (table, key)
    /// order, at most `limit`.
    fn state_rows(&mut self, _after: Option<(&str, &str)>, _limit: usize) -> anyhow::Result<Vec<StateRow>> {
        Ok(Vec::new())
    }
}

/// Reading and cleaning the log beside the single writer.
pub trait LogReader: Send + Sync {
    fn snapshot(&self) -> anyhow::Result<Box<dyn LogSnapshot>>;
    fn bounds(&self) -> anyhow::Result<Bounds>;
    /// Deletes transactions below `floor`, always keeping the newest one,
    /// and only while the log is still on `replica_version` (the floor was
    /// computed for that lineage; a new one may have replaced it since).
    /// Returns the number of rows deleted.
    fn purge_before(&self, floor: &str, replica_version: &str) -> anyhow::Result<u64>;
    /// The oldest commit watermark a retention window keeps: the newest
    /// `transactions` transactions, and those stored within `age`.
    fn retention_floor(
        &self,
        transactions: Option<u64>,
        age: Option<std::time::Duration>,
    ) -> anyhow::Result<Option<String>>;
    /// The change log's size on disk, where the store can tell.
    fn size_bytes(&self) -> anyhow::Result<Option<u64>> {
        Ok(None)
    }
}
