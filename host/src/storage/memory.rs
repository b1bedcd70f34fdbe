//! A change log in memory, for unit tests of the storer, the hub and the
//! streamer without a database (and for tools that want no file).
//!
//! It keeps the semantics the storer relies on: a storage transaction is
//! invisible until it commits and vanishes on rollback, savepoints nest one
//! upstream transaction, and a reader's snapshot holds what was committed
//! when it was taken. Tests can hold commits at a gate (so upstream
//! transactions queue up behind one in flight) and count what happened.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Bounds, ChangeLog, LogReader, LogResult, LogRow, LogSnapshot, LogState, NewLineage, StoredRow};

/// What is committed (or being written in a storage transaction).
#[derive(Debug, Clone, Default)]
struct Contents {
    /// (replicaVersion, resetRequired)
    config: Option<(String, bool)>,
    /// (lastWatermark, owner)
    state: Option<(String, Option<String>)>,
    /// (watermark, pos) -> (tag, change)
    rows: BTreeMap<(String, i64), (String, String)>,
}

/// Counters a test can assert on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub commits: u64,
    pub rollbacks: u64,
    pub savepoints: u64,
    pub savepoint_rollbacks: u64,
    /// `append` calls (batches written).
    pub appends: u64,
}

#[derive(Default)]
struct Shared {
    committed: Contents,
    stats: MemoryStats,
    /// Commits wait while this is set.
    gate_closed: bool,
    /// A commit is waiting at the gate.
    waiting: bool,
}

/// The writer's handle; [`MemoryChangeLog::reader`] and [`MemoryChangeLog::probe`]
/// share its contents.
pub struct MemoryChangeLog {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    /// The open storage transaction's contents, and its savepoint.
    tx: Option<Contents>,
    savepoint: Option<Contents>,
}

/// Looks at and steers a [`MemoryChangeLog`] from a test.
#[derive(Clone)]
pub struct MemoryProbe {
    shared: Arc<(Mutex<Shared>, Condvar)>,
}

impl Default for MemoryChangeLog {
    fn default() -> Self {
        MemoryChangeLog { shared: Arc::new((Mutex::default(), Condvar::new())), tx: None, savepoint: None }
    }
}

fn lock(shared: &(Mutex<Shared>, Condvar)) -> MutexGuard<'_, Shared> {
    shared.0.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryChangeLog {
    pub fn reader(&self) -> Arc<dyn LogReader> {
        Arc::new(MemoryProbe { shared: self.shared.clone() })
    }

    pub fn probe(&self) -> MemoryProbe {
        MemoryProbe { shared: self.shared.clone() }
    }

    fn open_tx(&mut self) -> anyhow::Result<&mut Contents> {
        self.tx.as_mut().ok_or_else(|| anyhow::anyhow!("no storage transaction is open"))
    }
}

impl MemoryProbe {
    /// Committed rows as (watermark, pos, tag), in order.
    pub fn rows(&self) -> Vec<(String, i64, String)> {
        lock(&self.shared).committed.rows.iter().map(|((w, p), (t, _))| (w.clone(), *p, t.clone())).collect()
    }

    /// (replicaVersion, lastWatermark, owner), if a lineage is recorded.
    pub fn lineage(&self) -> Option<(String, String, Option<String>)> {
        let s = lock(&self.shared);
        let (rv, _) = s.committed.config.clone()?;
        let (last, owner) = s.committed.state.clone()?;
        Some((rv, last, owner))
    }

    pub fn stats(&self) -> MemoryStats {
        lock(&self.shared).stats
    }

    /// Holds every commit until [`MemoryProbe::open_gate`].
    pub fn close_gate(&self) {
        lock(&self.shared).gate_closed = true;
    }

    pub fn open_gate(&self) {
        lock(&self.shared).gate_closed = false;
        self.shared.1.notify_all();
    }

    /// Blocks until a commit waits at the closed gate.
    pub fn wait_for_commit_at_gate(&self) {
        let mut s = lock(&self.shared);
        while !s.waiting {
            s = self.shared.1.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl ChangeLog for MemoryChangeLog {
    fn state(&mut self) -> LogResult<Option<LogState>> {
        let s = lock(&self.shared);
        let Some((replica_version, reset_required)) = s.committed.config.clone() else { return Ok(None) };
        let (last_watermark, owner) = s.committed.state.clone().unwrap_or_else(|| (replica_version.clone(), None));
        Ok(Some(LogState { replica_version, last_watermark, reset_required, owner }))
    }

    fn reset(&mut self, replica_version: &str) -> LogResult<()> {
        let mut s = lock(&self.shared);
        seed(&mut s.committed, replica_version, None);
        Ok(())
    }

    fn start_lineage(&mut self, lineage: &NewLineage) -> LogResult<()> {
        let tx = self.open_tx()?;
        seed(tx, &lineage.replica_version, Some(lineage.owner.clone()));
        Ok(())
    }

    fn mark_reset_required(&mut self) -> LogResult<()> {
        if let Some((_, reset)) = lock(&self.shared).committed.config.as_mut() {
            *reset = true;
        }
        Ok(())
    }

    fn assume_ownership(&mut self, task_id: &str, _address: &str) -> LogResult<()> {
        if let Some((_, owner)) = lock(&self.shared).committed.state.as_mut() {
            *owner = Some(task_id.to_string());
        }
        Ok(())
    }

    fn begin(&mut self) -> LogResult<()> {
        super::ensure_log!(self.tx.is_none(), "a storage transaction is already open");
        self.tx = Some(lock(&self.shared).committed.clone());
        Ok(())
    }

    fn savepoint(&mut self) -> LogResult<()> {
        self.savepoint = Some(self.open_tx()?.clone());
        lock(&self.shared).stats.savepoints += 1;
        Ok(())
    }

    fn release_savepoint(&mut self) -> LogResult<()> {
        self.savepoint = None;
        Ok(())
    }

    fn rollback_to_savepoint(&mut self) -> LogResult<()> {
        let saved = self.savepoint.take().ok_or_else(|| anyhow::anyhow!("no savepoint"))?;
        self.tx = Some(saved);
        lock(&self.shared).stats.savepoint_rollbacks += 1;
        Ok(())
    }

    fn append(&mut self, rows: &[LogRow<'_>]) -> LogResult<()> {
        let tx = self.open_tx()?;
        for r in rows {
            let key = (r.watermark.to_string(), r.pos);
            super::ensure_log!(!tx.rows.contains_key(&key), "duplicate row {} {}", r.watermark, r.pos);
            tx.rows.insert(key, (r.tag.to_string(), r.change.to_string()));
        }
        lock(&self.shared).stats.appends += 1;
        Ok(())
    }

    fn commit(&mut self, last_watermark: &str) -> LogResult<()> {
        let mut tx = self.tx.take().ok_or_else(|| anyhow::anyhow!("no storage transaction is open"))?;
        self.savepoint = None;
        let owner = tx.state.take().and_then(|(_, owner)| owner);
        tx.state = Some((last_watermark.to_string(), owner));
        let mut s = lock(&self.shared);
        while s.gate_closed {
            s.waiting = true;
            self.shared.1.notify_all();
            s = self.shared.1.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.waiting = false;
        s.committed = tx;
        s.stats.commits += 1;
        Ok(())
    }

    fn rollback(&mut self) -> LogResult<()> {
        if self.tx.take().is_some() {
            lock(&self.shared).stats.rollbacks += 1;
        }
        self.savepoint = None;
        Ok(())
    }

    fn bounds(&mut self) -> LogResult<Bounds> {
        Ok(self.probe().bounds()?)
    }
}

fn seed(c: &mut Contents, replica_version: &str, owner: Option<String>) {
    let rv = replica_version.to_string();
    c.config = Some((rv.clone(), false));
    c.state = Some((rv.clone(), owner));
    c.rows.clear();
    c.rows.insert((rv.clone(), 0), ("begin".into(), r#"{"tag":"begin"}"#.into()));
    c.rows.insert((rv, 1), ("commit".into(), r#"{"tag":"commit"}"#.into()));
}

/// A snapshot: the committed rows when it was taken.
struct MemorySnapshot {
    rows: Vec<StoredRow>,
    last_watermark: String,
}

impl LogSnapshot for MemorySnapshot {
    fn last_watermark(&self) -> &str {
        &self.last_watermark
    }

    fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>> {
        Ok(self
            .rows
            .iter()
            .filter(|r| r.watermark.as_str() >= from && r.watermark <= self.last_watermark)
            .filter(|r| after.is_none_or(|(w, p)| (r.watermark.as_str(), r.pos) > (w, p)))
            .take(limit)
            .cloned()
            .collect())
    }
}

impl LogReader for MemoryProbe {
    fn snapshot(&self) -> anyhow::Result<Box<dyn LogSnapshot>> {
        let s = lock(&self.shared);
        let last_watermark = s.committed.state.as_ref().map(|(w, _)| w.clone()).unwrap_or_default();
        let rows = s
            .committed
            .rows
            .iter()
            .map(|((w, p), (t, c))| StoredRow { watermark: w.clone(), pos: *p, tag: t.clone(), change: c.clone() })
            .collect();
        Ok(Box::new(MemorySnapshot { rows, last_watermark }))
    }

    fn bounds(&self) -> anyhow::Result<Bounds> {
        let s = lock(&self.shared);
        let last_watermark =
            s.committed.state.as_ref().map(|(w, _)| w.clone()).ok_or_else(|| anyhow::anyhow!("no lineage yet"))?;
        let min_watermark = s.committed.rows.keys().next().map(|(w, _)| w.clone());
        Ok(Bounds { min_watermark, last_watermark })
    }

    fn purge_before(&self, floor: &str, replica_version: &str) -> anyhow::Result<u64> {
        let mut s = lock(&self.shared);
        if s.committed.config.as_ref().map(|(rv, _)| rv.as_str()) != Some(replica_version) {
            return Ok(0);
        }
        let newest = s.committed.rows.keys().next_back().map(|(w, _)| w.clone()).unwrap_or_default();
        let before = s.committed.rows.len();
        s.committed.rows.retain(|(w, _), _| w.as_str() >= floor || *w == newest);
        Ok((before - s.committed.rows.len()) as u64)
    }

    fn retention_floor(
        &self,
        transactions: Option<u64>,
        _age: Option<std::time::Duration>,
    ) -> anyhow::Result<Option<String>> {
        let Some(n) = transactions.filter(|n| *n > 0) else { return Ok(None) };
        let s = lock(&self.shared);
        let commits: Vec<&String> =
            s.committed.rows.iter().filter(|(_, (t, _))| t == "commit").map(|((w, _), _)| w).collect();
        Ok(Some(commits.iter().rev().nth(n as usize - 1).map(|w| w.to_string()).unwrap_or_default()))
    }
}
