//! The storer: the single writer of the change log.
//!
//! It runs on a thread of its own (storage calls block) and takes commands
//! from the replication loop in stream order. Complete upstream transactions
//! that queue up while a storage commit is in flight are written together in
//! the next storage transaction (group commit), each inside a savepoint so it
//! stays atomic; a lone transaction is committed at once. After each storage
//! commit the storer reports the last durable commit watermark, which is what
//! the replication loop acks upstream.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{mpsc, Notify};

use crate::catchup::Catchups;
use crate::change::{Change, Kind};
use crate::status::{Stage, Status};
use crate::storage::{ChangeLog, LogError, LogResult, LogRow, NewLineage};
use crate::subscriber::Subscriber;

/// Tuning of the storer.
#[derive(Debug, Clone, Copy)]
pub struct StorerOptions {
    /// Bytes that may wait in the queue before the loop stops pulling from
    /// the source.
    pub queue_budget: usize,
    /// Rows buffered before they are inserted, at most (the log's own
    /// [`crate::storage::ChangeLog::append_batch_rows`] applies too).
    pub batch_rows: usize,
    /// Upper bounds for one storage transaction made of several upstream ones.
    pub group_bytes: usize,
    pub group_transactions: usize,
}

impl Default for StorerOptions {
    fn default() -> Self {
        StorerOptions { queue_budget: 32 << 20, batch_rows: usize::MAX, group_bytes: 8 << 20, group_transactions: 1000 }
    }
}

enum Command {
    Change {
        watermark: Arc<str>,
        change: Change,
    },
    /// A traced transaction (its commit follows): the storage commit that
    /// makes it durable is a span of its trace.
    Traced(Arc<str>, tracing::Span),
    /// The stream ended inside a transaction: drop what was written of it.
    Abort,
    MarkResetRequired,
    /// Catch a subscriber up once everything queued before it is durable.
    Catchup(Arc<Subscriber>, String),
    /// The loop's handle is gone: finish as if the queue had closed.
    Stop,
}

/// The loop's end of the command queue. Dropping it (in [`Storer::stop`],
/// or with the loop's task when a runtime shuts down) stops the thread
/// after what is queued. A closed queue alone would not do: the hub keeps a
/// [`CatchupQueue`] into it, and until a new lineage's snapshot is durable
/// the thread itself keeps the hub (through [`Establish::on_durable`]), so
/// the thread would wait for a command forever, and so would the runtime's
/// shutdown.
struct LoopSender(mpsc::UnboundedSender<Command>);

impl Drop for LoopSender {
    fn drop(&mut self) {
        let _ = self.0.send(Command::Stop);
    }
}

/// A lineage whose first transaction (its snapshot) is not durable yet.
pub struct Establish {
    /// Written in the storage transaction of the first commit, when the log
    /// is to hold a new lineage: the replica version becomes durable (and
    /// discoverable) together with its snapshot.
    pub lineage: Option<NewLineage>,
    /// Called with the watermark once that commit is durable, before the
    /// storer reports it anywhere else (`/status`, the loop), so whatever
    /// sees the snapshot stored also sees the lineage served.
    pub on_durable: OnEstablished,
}

/// Called with the snapshot's watermark once a new lineage is durable.
pub type OnEstablished = Box<dyn FnOnce(&str) + Send>;

/// Lets the hub queue catch-ups in stream order.
#[derive(Clone)]
pub struct CatchupQueue(mpsc::UnboundedSender<Command>);

impl CatchupQueue {
    /// False when the storer has already exited.
    pub fn push(&self, sub: Arc<Subscriber>, replica_version: String) -> bool {
        self.0.send(Command::Catchup(sub, replica_version)).is_ok()
    }
}

/// Bytes queued between the loop and the storer, with a gate for the loop.
struct Budget {
    queued: AtomicUsize,
    /// Commands processed so far: the wedge watchdog's sign of life.
    processed: std::sync::atomic::AtomicU64,
    limit: usize,
    drained: Notify,
}

impl Budget {
    fn release(&self, n: usize) {
        let before = self.queued.fetch_sub(n, Ordering::AcqRel);
        let after = before - n;
        if before > self.low_water() && after <= self.low_water() || after == 0 {
            self.drained.notify_waiters();
        }
    }

    fn low_water(&self) -> usize {
        self.limit / 10 * 8
    }
}

/// The loop's handle on a running storer.
pub struct Storer {
    commands: LoopSender,
    budget: Arc<Budget>,
    thread: tokio::task::JoinHandle<StorerExit>,
    exited: Arc<Exited>,
}

/// Set by the thread as it ends, so the loop can notice an early exit.
#[derive(Default)]
struct Exited {
    flag: std::sync::atomic::AtomicBool,
    notify: Notify,
}

/// What the storer thread hands back: the log (for the next run) and why it
/// ended (a failure of the log keeps its kind: stop or retry).
pub struct StorerExit {
    pub log: Box<dyn ChangeLog>,
    pub result: LogResult<()>,
}

impl Storer {
    /// Starts a storer over `log`. Durable commit watermarks are sent to
    /// `durable`. With `establish`, the first storage commit establishes a
    /// lineage (see [`Establish`]).
    pub fn start(
        log: Box<dyn ChangeLog>,
        catchup: Arc<Catchups>,
        options: StorerOptions,
        establish: Option<Establish>,
        durable: mpsc::UnboundedSender<Arc<str>>,
        status: Arc<Status>,
    ) -> Storer {
        let (commands, mut rx) = mpsc::unbounded_channel();
        let budget = Arc::new(Budget {
            queued: AtomicUsize::new(0),
            processed: Default::default(),
            limit: options.queue_budget,
            drained: Notify::new(),
        });
        let worker_budget = budget.clone();
        let exited = Arc::new(Exited::default());
        let worker_exited = exited.clone();
        let thread = tokio::task::spawn_blocking(move || {
            let mut worker = Worker::new(log, catchup, options, durable, status, worker_budget);
            worker.establish = establish;
            let result = worker.run(&mut rx).map_err(LogError::from);
            // Catch-ups this storer will never serve: their subscribers are
            // already forwarded to, so they must reconnect rather than wait.
            // Closing the queue first makes the hub hold later subscribers
            // until the pass ends (see `Hub::subscribe`).
            rx.close();
            while let Ok(cmd) = rx.try_recv() {
                if let Command::Catchup(sub, rv) = cmd {
                    worker.catchups.push((sub, rv));
                }
            }
            for (sub, _) in worker.catchups.drain(..) {
                sub.close(None);
            }
            if result.is_err() {
                if let Err(e) = worker.log.rollback() {
                    tracing::warn!("rolling back the change log after an error: {e:#}");
                }
            }
            if let Err(e) = &result {
                tracing::error!("change log write failed: {e:#}");
            }
            worker_exited.flag.store(true, Ordering::Release);
            worker_exited.notify.notify_waiters();
            worker.budget.drained.notify_waiters();
            StorerExit { log: worker.log, result }
        });
        Storer { commands: LoopSender(commands), budget, thread, exited }
    }

    pub fn catchup_queue(&self) -> CatchupQueue {
        CatchupQueue(self.commands.0.clone())
    }

    /// Queues a change of the transaction at `watermark`. Never blocks.
    pub fn store(&self, watermark: &Arc<str>, change: &Change) {
        self.budget.queued.fetch_add(change.json.len(), Ordering::AcqRel);
        // A send fails only once the thread has exited; `finished` reports why.
        let _ = self.commands.0.send(Command::Change { watermark: watermark.clone(), change: change.clone() });
    }

    /// Traces the storage commit of transaction `watermark` under `span`
    /// (sent before its commit, only when traces are on).
    pub fn trace(&self, watermark: &Arc<str>, span: tracing::Span) {
        let _ = self.commands.0.send(Command::Traced(watermark.clone(), span));
    }

    pub fn abort(&self) {
        let _ = self.commands.0.send(Command::Abort);
    }

    /// Resolves once the queue is below its budget (immediately if it is).
    pub async fn ready_for_more(&self) {
        loop {
            let drained = self.budget.drained.notified();
            if self.budget.queued.load(Ordering::Acquire) <= self.budget.limit
                || self.exited.flag.load(Ordering::Acquire)
            {
                return;
            }
            drained.await;
        }
    }

    pub fn queued_bytes(&self) -> usize {
        self.budget.queued.load(Ordering::Acquire)
    }

    /// How many commands the storer has processed (grows while it works).
    pub fn progress(&self) -> u64 {
        self.budget.processed.load(Ordering::Acquire)
    }

    /// Resolves when the thread has exited on its own (after a storage error).
    pub async fn finished(&self) {
        loop {
            let notified = self.exited.notify.notified();
            if self.exited.flag.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Records that the upstream asked for a reset, in stream order.
    pub fn mark_reset_required(&self) {
        let _ = self.commands.0.send(Command::MarkResetRequired);
    }

    /// Lets the storer write what is queued, then returns the log. Fails with
    /// a drain timeout when storage does not keep up.
    pub async fn stop(self, drain_timeout: Duration) -> anyhow::Result<StorerExit> {
        drop(self.commands);
        match tokio::time::timeout(drain_timeout, self.thread).await {
            Ok(exit) => exit.context("storer thread panicked"),
            Err(_) => anyhow::bail!("change log did not drain within {} ms", drain_timeout.as_millis()),
        }
    }
}

/// The upstream transaction the storer is in the middle of.
struct CurrentTx {
    watermark: Arc<str>,
    next_pos: i64,
    /// Where its rows start in the pending rows.
    first_row: usize,
    /// Some of its rows are already written.
    flushed: bool,
    /// It sits behind a savepoint (it shares the storage transaction with
    /// committed upstream transactions and has written rows).
    savepoint: bool,
}

/// A row waiting to be inserted. Holds the shared change, so no copy is made.
struct PendingRow {
    watermark: Arc<str>,
    pos: i64,
    change: Change,
    precommit: Option<Arc<str>>,
}

struct Worker {
    log: Box<dyn ChangeLog>,
    catchup: Arc<Catchups>,
    /// Subscribers waiting for the open transaction to end.
    catchups: Vec<(Arc<Subscriber>, String)>,
    options: StorerOptions,
    durable: mpsc::UnboundedSender<Arc<str>>,
    status: Arc<Status>,
    budget: Arc<Budget>,
    /// A lineage not established yet: started in each storage transaction
    /// until one of them commits (a rolled-back one takes it along, so the
    /// next one starts it again).
    establish: Option<Establish>,
    /// A storage transaction is open.
    storage_open: bool,
    /// Upstream transactions committed inside the open storage transaction.
    group_transactions: usize,
    group_changes: u64,
    group_bytes: usize,
    group_last_commit: Option<Arc<str>>,
    /// Upstream commit times (ms) of the group's transactions, for the
    /// sources that give them.
    group_commit_times: Vec<f64>,
    /// Traced transactions not yet durable, in commit order.
    traced: Vec<(Arc<str>, tracing::Span)>,
    /// The upstream transaction being written.
    current: Option<CurrentTx>,
    rows: Vec<PendingRow>,
    rows_bytes: usize,
}

impl Worker {
    fn new(
        log: Box<dyn ChangeLog>,
        catchup: Arc<Catchups>,
        options: StorerOptions,
        durable: mpsc::UnboundedSender<Arc<str>>,
        status: Arc<Status>,
        budget: Arc<Budget>,
    ) -> Self {
        Worker {
            log,
            catchup,
            catchups: Vec::new(),
            options,
            durable,
            status,
            budget,
            establish: None,
            storage_open: false,
            group_transactions: 0,
            group_changes: 0,
            group_bytes: 0,
            group_last_commit: None,
            group_commit_times: Vec::new(),
            traced: Vec::new(),
            current: None,
            rows: Vec::new(),
            rows_bytes: 0,
        }
    }

    fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Command>) -> anyhow::Result<()> {
        loop {
            // Between upstream transactions, commit as soon as nothing else is
            // waiting: that is what keeps a quiet stream's latency low.
            let cmd = if self.storage_open && self.current.is_none() {
                match rx.try_recv() {
                    Ok(cmd) => cmd,
                    Err(mpsc::error::TryRecvError::Empty) => {
                        self.commit_group()?;
                        continue;
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            } else {
                match rx.blocking_recv() {
                    Some(cmd) => cmd,
                    None => break,
                }
            };
            match cmd {
                Command::Change { watermark, change } => {
                    let bytes = change.json.len();
                    let result = self.apply(watermark, change);
                    self.budget.processed.fetch_add(1, Ordering::AcqRel);
                    self.budget.release(bytes);
                    result?;
                }
                Command::Traced(watermark, span) => self.traced.push((watermark, span)),
                Command::Abort => self.abort_current()?,
                Command::Catchup(sub, rv) => self.catchups.push((sub, rv)),
                Command::Stop => break,
                Command::MarkResetRequired => {
                    if self.storage_open && self.current.is_none() {
                        self.commit_group()?;
                    }
                    if self.establish.as_ref().is_some_and(|e| e.lineage.is_some()) {
                        // The log still holds the lineage being replaced, which
                        // this request is not about; the upstream repeats it
                        // when the new one is reopened.
                        tracing::warn!("reset required before the new lineage's snapshot was stored; not recorded");
                    } else {
                        self.log.mark_reset_required()?;
                    }
                }
            }
            if !self.catchups.is_empty() && self.current.is_none() {
                self.start_catchups()?;
            }
        }
        // The loop stopped: keep the complete transactions, drop a partial one.
        self.abort_current()?;
        if self.storage_open {
            self.commit_group()?;
        }
        Ok(())
    }

    fn apply(&mut self, watermark: Arc<str>, change: Change) -> anyhow::Result<()> {
        match change.kind {
            Kind::Begin => {
                anyhow::ensure!(self.current.is_none(), "begin {watermark} while a transaction is open");
                if !self.storage_open {
                    self.log.begin()?;
                    self.storage_open = true;
                    if let Some(lineage) = self.establish.as_ref().and_then(|e| e.lineage.as_ref()) {
                        self.log.start_lineage(lineage)?;
                    }
                }
                self.current = Some(CurrentTx {
                    watermark: watermark.clone(),
                    next_pos: 1,
                    first_row: self.rows.len(),
                    flushed: false,
                    savepoint: false,
                });
                self.push_row(PendingRow { watermark, pos: 0, change, precommit: None });
            }
            Kind::Data => {
                let Some(tx) = self.current.as_mut() else {
                    anyhow::bail!("{} change outside a transaction", change.tag);
                };
                let row = PendingRow { watermark: tx.watermark.clone(), pos: tx.next_pos, change, precommit: None };
                tx.next_pos += 1;
                self.push_row(row);
                let batch_rows = self.options.batch_rows.min(self.log.append_batch_rows());
                if self.rows.len() >= batch_rows || self.rows_bytes >= self.options.group_bytes {
                    self.flush_open_transaction()?;
                }
            }
            Kind::Commit => {
                let Some(tx) = self.current.take() else {
                    anyhow::bail!("commit {watermark} outside a transaction");
                };
                let pos = tx.next_pos;
                if let Some(t) = commit_time_ms(&change) {
                    self.group_commit_times.push(t);
                }
                self.push_row(PendingRow { watermark: watermark.clone(), pos, change, precommit: Some(tx.watermark) });
                if tx.savepoint {
                    // Its earlier rows are written; the rest go with the group.
                    self.flush_rows()?;
                    self.log.release_savepoint()?;
                }
                self.group_transactions += 1;
                // Positions run begin = 0, data 1..pos-1, commit = pos.
                self.group_changes += (pos - 1) as u64;
                self.group_last_commit = Some(watermark);
                if self.group_transactions >= self.options.group_transactions
                    || self.group_bytes >= self.options.group_bytes
                {
                    self.commit_group()?;
                }
            }
            Kind::Rollback => self.abort_current()?,
        }
        Ok(())
    }

    /// A large open transaction must write rows before its commit. If the
    /// storage transaction already holds committed upstream transactions,
    /// those are written first and this one goes behind a savepoint, so a
    /// rollback drops only its own rows.
    fn flush_open_transaction(&mut self) -> anyhow::Result<()> {
        let Some(tx) = self.current.as_ref() else { return self.flush_rows() };
        let (first_row, needs_savepoint) = (tx.first_row, !tx.flushed && self.group_transactions > 0);
        if needs_savepoint {
            let own = self.rows.split_off(first_row);
            self.flush_rows()?;
            self.rows = own;
            self.rows_bytes = self.rows.iter().map(|r| r.change.stored().len()).sum();
            self.log.savepoint()?;
        }
        self.flush_rows()?;
        let tx = self.current.as_mut().expect("checked above");
        tx.savepoint |= needs_savepoint;
        tx.flushed = true;
        tx.first_row = 0;
        Ok(())
    }

    /// Between transactions: make everything so far durable, then pin a
    /// snapshot for each waiting subscriber. The snapshot holds exactly what
    /// was forwarded before the subscriber was added.
    fn start_catchups(&mut self) -> anyhow::Result<()> {
        if self.storage_open {
            self.commit_group()?;
        }
        self.catchup.start(self.catchups.drain(..));
        Ok(())
    }

    fn push_row(&mut self, row: PendingRow) {
        self.rows_bytes += row.change.stored().len();
        self.group_bytes += row.change.stored().len();
        self.rows.push(row);
    }

    fn flush_rows(&mut self) -> anyhow::Result<()> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let rows: Vec<LogRow<'_>> = self
            .rows
            .iter()
            .map(|r| LogRow {
                watermark: &r.watermark,
                pos: r.pos,
                tag: r.change.tag,
                change: r.change.stored(),
                precommit: r.precommit.as_deref(),
            })
            .collect();
        let t = std::time::Instant::now();
        self.log.append(&rows)?;
        self.status.count(Stage::Write, t);
        self.rows.clear();
        self.rows_bytes = 0;
        Ok(())
    }

    /// Drops the upstream transaction being written, if any.
    fn abort_current(&mut self) -> anyhow::Result<()> {
        let Some(tx) = self.current.take() else { return Ok(()) };
        let dropped: usize = self.rows[tx.first_row..].iter().map(|r| r.change.stored().len()).sum();
        self.rows.truncate(tx.first_row);
        self.rows_bytes -= dropped;
        self.group_bytes = self.group_bytes.saturating_sub(dropped);
        if tx.savepoint {
            self.log.rollback_to_savepoint()?;
        } else if tx.flushed {
            // Nothing committed shares the storage transaction: drop it all.
            self.log.rollback()?;
            self.storage_open = false;
            self.rows.clear();
            self.rows_bytes = 0;
            self.reset_group();
        }
        // Otherwise none of its rows were written: dropping them was enough.
        Ok(())
    }

    fn reset_group(&mut self) {
        self.group_transactions = 0;
        self.group_changes = 0;
        self.group_bytes = 0;
        self.group_last_commit = None;
        self.group_commit_times.clear();
    }

    /// Makes every upstream transaction in the open storage transaction durable.
    fn commit_group(&mut self) -> anyhow::Result<()> {
        debug_assert!(self.current.is_none());
        let Some(last) = self.group_last_commit.clone() else {
            if self.storage_open {
                self.log.rollback()?;
                self.storage_open = false;
            }
            self.rows.clear();
            self.rows_bytes = 0;
            return Ok(());
        };
        self.flush_rows()?;
        let span = self.commit_span(&last);
        let t = std::time::Instant::now();
        span.in_scope(|| self.log.commit(&last))
            .with_context(|| format!("committing the change log through {last}"))?;
        self.status.count(Stage::Commit, t);
        drop(span);
        self.storage_open = false;
        if let Some(established) = self.establish.take() {
            (established.on_durable)(&last);
        }
        let (txs, changes) = (self.group_transactions as u64, self.group_changes);
        self.status.durable_after_upstream(&self.group_commit_times);
        self.reset_group();
        self.status.update(|s| {
            s.last_watermark = Some(last.to_string());
            s.transactions += txs;
            s.changes += changes;
        });
        let _ = self.durable.send(last);
        Ok(())
    }

    /// The span of a storage commit through `last`, in the trace of the
    /// last traced transaction it makes durable (whose span stays open
    /// until it ends) and linked to the others (disabled when none is
    /// traced).
    fn commit_span(&mut self, last: &str) -> tracing::Span {
        if self.traced.is_empty() {
            return tracing::Span::none();
        }
        let durable = self.traced.iter().take_while(|(w, _)| **w <= *last).count();
        let group: Vec<(Arc<str>, tracing::Span)> = self.traced.drain(..durable).collect();
        let Some((_, parent)) = group.last() else { return tracing::Span::none() };
        let span = tracing::debug_span!(
            target: crate::telemetry::TARGET, parent: parent, "sluice.storage.commit",
            transactions = self.group_transactions, watermark = %last
        );
        for (_, other) in &group[..group.len() - 1] {
            span.follows_from(other);
        }
        span
    }
}

/// The upstream commit time a source put in its commit (`commitTimeMs`,
/// ms since the Unix epoch), if any.
fn commit_time_ms(commit: &Change) -> Option<f64> {
    json_scan::member(commit.stored(), "commitTimeMs")?.parse().ok().filter(|t: &f64| t.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::memory::{MemoryChangeLog, MemoryProbe};

    fn begin(w: &str) -> Change {
        Change::from_stored("begin", r#"{"tag":"begin"}"#, w)
    }
    fn insert(w: &str, id: u32) -> Change {
        Change::from_stored("insert", &format!(r#"{{"tag":"insert","new":{{"id":{id}}}}}"#), w)
    }
    fn commit(w: &str) -> Change {
        Change::from_stored("commit", r#"{"tag":"commit"}"#, w)
    }

    fn start(log: MemoryChangeLog, options: StorerOptions, establish: Option<Establish>) -> Running {
        let catchup = Catchups::new(log.reader(), Default::default(), Arc::default());
        let (tx, durable) = mpsc::unbounded_channel();
        let status = Arc::new(Status::default());
        let storer = Storer::start(Box::new(log), catchup, options, establish, tx, status.clone());
        Running { storer, durable, status }
    }

    struct Running {
        storer: Storer,
        durable: mpsc::UnboundedReceiver<Arc<str>>,
        status: Arc<Status>,
    }

    impl Running {
        fn send(&self, w: &str, change: Change) {
            self.storer.store(&Arc::from(w), &change);
        }

        /// A whole upstream transaction with `rows` inserts.
        fn tx(&self, w: &str, rows: u32) {
            self.send(w, begin(w));
            for id in 0..rows {
                self.send(w, insert(w, id));
            }
            self.send(w, commit(w));
        }

        async fn durable(&mut self) -> String {
            let w = tokio::time::timeout(Duration::from_secs(10), self.durable.recv()).await;
            w.expect("a durable commit in time").expect("the storer is running").to_string()
        }

        async fn stop(self) {
            let exit = self.storer.stop(Duration::from_secs(10)).await.expect("the storer drains");
            exit.result.expect("no storage error");
        }
    }

    fn watermarks(probe: &MemoryProbe) -> Vec<String> {
        let mut w: Vec<String> = probe.rows().into_iter().map(|(w, _, _)| w).collect();
        w.dedup();
        w
    }

    fn seeded() -> MemoryChangeLog {
        let mut log = MemoryChangeLog::default();
        log.reset("00").unwrap();
        log
    }

    /// The loop's task can be dropped without stopping the storer (a runtime
    /// shutting down drops it) while a new lineage's snapshot is still being
    /// written. The thread must end all the same, though the lineage's
    /// callback keeps the hub, and the hub a queue into the thread.
    #[test]
    fn the_thread_ends_when_its_handle_is_dropped_before_the_snapshot_is_durable() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let mut durable = runtime.block_on(async {
            let hub = Arc::new(std::sync::Mutex::new(None::<CatchupQueue>));
            let held = hub.clone();
            let establish = Establish { lineage: None, on_durable: Box::new(move |_| drop(held)) };
            let s = start(seeded(), StorerOptions::default(), Some(establish));
            *hub.lock().unwrap() = Some(s.storer.catchup_queue());
            s.send("01", begin("01"));
            s.durable
        });
        // The thread drops its end of `durable` as it exits.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let ended = loop {
            match durable.try_recv() {
                Err(mpsc::error::TryRecvError::Disconnected) => break true,
                Ok(w) => panic!("{w} became durable: the snapshot was never committed"),
                Err(mpsc::error::TryRecvError::Empty) if std::time::Instant::now() > deadline => break false,
                Err(mpsc::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        // Dropping the runtime would wait for the thread: if it still runs, forever.
        runtime.shutdown_background();
        assert!(ended, "the storer thread still runs after its handle was dropped");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_source_lag_is_measured_from_the_upstream_commit_time() {
        let mut s = start(seeded(), StorerOptions::default(), None);
        s.tx("01", 1);
        assert_eq!(s.durable().await, "01");
        assert_eq!(s.status.snapshot().source_lag_ms, None, "no commit time, no lag");
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
        let committed = now_ms - 5_000;
        s.send("02", begin("02"));
        s.send("02", insert("02", 0));
        let json = format!(r#"{{"tag":"commit","commitTimeMs":{committed}.5}}"#);
        s.send("02", Change::from_stored("commit", &json, "02"));
        assert_eq!(s.durable().await, "02");
        let lag = s.status.snapshot().source_lag_ms.expect("a lag once a commit time came");
        assert!((4_990.0..60_000.0).contains(&lag), "committed 5 s ago, durable now: {lag} ms");
        s.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transactions_queued_behind_a_commit_share_the_next_storage_transaction() {
        let log = seeded();
        let probe = log.probe();
        probe.close_gate();
        let mut s = start(log, StorerOptions::default(), None);
        s.tx("01", 1);
        let p = probe.clone();
        tokio::task::spawn_blocking(move || p.wait_for_commit_at_gate()).await.unwrap();
        for w in ["02", "03", "04"] {
            s.tx(w, 2);
        }
        probe.open_gate();
        assert_eq!(s.durable().await, "01");
        assert_eq!(s.durable().await, "04", "02..04 were committed together");
        s.stop().await;
        assert_eq!(probe.stats().commits, 2);
        assert_eq!(watermarks(&probe), ["00", "01", "02", "03", "04"]);
        assert_eq!(probe.lineage().unwrap().1, "04");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_transaction_sharing_a_storage_transaction_rolls_back_alone() {
        let log = seeded();
        let probe = log.probe();
        probe.close_gate();
        let options = StorerOptions { batch_rows: 4, ..StorerOptions::default() };
        let mut s = start(log, options, None);
        s.tx("01", 1);
        let p = probe.clone();
        tokio::task::spawn_blocking(move || p.wait_for_commit_at_gate()).await.unwrap();
        // 02 commits into the next group; 03 outgrows a write batch, so it is
        // written early behind a savepoint, then rolls back; 04 follows.
        s.tx("02", 1);
        s.send("03", begin("03"));
        for id in 0..6 {
            s.send("03", insert("03", id));
        }
        s.send("03", Change::rollback());
        s.tx("04", 1);
        probe.open_gate();
        assert_eq!(s.durable().await, "01");
        assert_eq!(s.durable().await, "04");
        s.stop().await;
        let stats = probe.stats();
        assert_eq!((stats.commits, stats.savepoints, stats.savepoint_rollbacks), (2, 1, 1), "{stats:?}");
        assert_eq!(watermarks(&probe), ["00", "01", "02", "04"], "only 03's rows are gone");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_lineage_is_written_with_its_first_commit_and_not_before() {
        let log = seeded();
        let probe = log.probe();
        let (established_tx, mut established) = mpsc::unbounded_channel();
        let establish = Establish {
            lineage: Some(NewLineage {
                replica_version: "05".into(),
                owner: "task".into(),
                owner_address: "here:1".into(),
            }),
            on_durable: Box::new(move |w: &str| {
                let _ = established_tx.send(w.to_string());
            }),
        };
        let mut s = start(log, StorerOptions { batch_rows: 2, ..StorerOptions::default() }, Some(establish));
        // The snapshot is cut off after some of its rows were written: the
        // storage transaction that started the lineage is rolled back with it.
        s.send("06", begin("06"));
        for id in 0..3 {
            s.send("06", insert("06", id));
        }
        s.storer.abort();
        // The next storage transaction starts the lineage again.
        probe.close_gate();
        s.tx("07", 2);
        let p = probe.clone();
        tokio::task::spawn_blocking(move || p.wait_for_commit_at_gate()).await.unwrap();
        assert_eq!(probe.lineage().unwrap().0, "00", "nothing of the new lineage is visible before its commit");
        assert!(established.try_recv().is_err());
        probe.open_gate();
        assert_eq!(s.durable().await, "07");
        assert_eq!(established.try_recv().as_deref(), Ok("07"), "established before the loop hears of it");
        s.tx("08", 1);
        assert_eq!(s.durable().await, "08");
        s.stop().await;
        assert!(established.try_recv().is_err(), "established once");
        assert_eq!(probe.lineage(), Some(("05".into(), "08".into(), Some("task".into()))));
        assert_eq!(watermarks(&probe), ["05", "07", "08"], "the old lineage is gone, and the cut snapshot");
        assert_eq!(probe.stats().rollbacks, 1);
    }
}
