//! Catch-up: replaying the change log to subscribers that join behind the head.
//!
//! Subscribers catching up over the same part of the log share one scan
//! ([`scan`]): rows are read and encoded once and handed to every member. A
//! subscriber joins a running scan if the scan has not yet passed its
//! position; otherwise it starts a new one. Many catch-ups at once (a fleet
//! restarting after a deploy) thus cost a few reads of the log, not one each.
//!
//! Reading is bounded: every batch read (and its hand-out) takes a permit
//! from a small fair pool, so catch-ups share a bounded amount of work and
//! live delivery to subscribers at the head keeps the rest of the machine.
//!
//! Consistency: a subscriber is handed to [`Catchups::start`] at a point
//! where the log holds everything forwarded before it joined the forwarder
//! (its live backlog covers the rest). Each call opens an epoch; a scan's
//! snapshot covers every member of an epoch up to the one current when it
//! was pinned. Members that joined later are finished from a newer snapshot,
//! pinned when the scan reaches the end of its current one.

mod scan;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Semaphore;

use crate::storage::LogReader;
use crate::subscriber::{MemoryBudget, Subscriber};
use scan::{Member, Scan};

/// Rows per read.
pub const CATCHUP_READ_ROWS: usize = 1000;

/// What catch-ups have done so far (for `/status` and `/metrics`).
#[derive(Debug, Default)]
struct Counters {
    /// Rows handed to catching-up subscribers, summed over subscribers.
    sent: AtomicU64,
    /// Rows read from the change log: far fewer when scans are shared.
    read: AtomicU64,
    /// Snapshots of the log pinned for scans.
    scans: AtomicU64,
    /// Catch-ups run again because live changes outran them.
    again: AtomicU64,
}

/// How catch-ups are run.
#[derive(Debug, Clone, Copy)]
pub struct CatchupOptions {
    /// Batch reads (with their hand-out to members) running at once.
    pub readers: usize,
    /// Catch-up rows a subscriber may hold unconsumed before its scan waits
    /// for it. Paid per subscriber: the JSON is shared, the queue is not.
    pub window_bytes: usize,
    /// Subscribers join scans already running; off, each catch-up scans the
    /// log on its own (for comparison in benchmarks).
    pub shared: bool,
}

impl Default for CatchupOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        CatchupOptions { readers: (cores / 2).max(1), window_bytes: 1 << 20, shared: true }
    }
}

/// Every catch-up of one change log.
pub struct Catchups {
    reader: Arc<dyn LogReader>,
    options: CatchupOptions,
    /// The subscribers' memory budget: while many catch up, each one's
    /// window shrinks to its share.
    budget: Arc<MemoryBudget>,
    permits: Arc<Semaphore>,
    counters: Counters,
    inner: Mutex<Inner>,
    /// Where a subscriber goes that must catch up again (see
    /// [`Catchups::on_catch_up_again`]).
    again: OnceLock<CatchUpAgain>,
}

/// Takes a subscriber (and its replica version) that must catch up again.
pub type CatchUpAgain = Box<dyn Fn(Arc<Subscriber>, String) + Send + Sync>;

#[derive(Default)]
struct Inner {
    /// Bumped by every [`Catchups::start`]; see the module notes.
    epoch: u64,
    scans: Vec<Arc<Scan>>,
}

/// Catch-up work in progress, for `/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CatchupView {
    /// Scans running (each reads the log once for all its members).
    pub scans: usize,
    /// Subscribers being served by them.
    pub members: usize,
    /// Scans waiting for their members to make room (they admit no one).
    pub waiting: usize,
    /// Rows handed to catching-up subscribers so far, summed over
    /// subscribers (its rate is the catch-up throughput).
    pub changes_sent: u64,
    /// Rows read from the change log for them so far.
    pub rows_read: u64,
    /// Snapshots of the log pinned for scans so far.
    pub scans_total: u64,
    /// Catch-ups run again so far, from where one ended, because live
    /// changes outran it (the subscriber's backlog passed `--backlog-mb`).
    pub repeated: u64,
}

impl Catchups {
    pub fn new(reader: Arc<dyn LogReader>, options: CatchupOptions, budget: Arc<MemoryBudget>) -> Arc<Catchups> {
        let permits = Arc::new(Semaphore::new(options.readers.max(1)));
        let (counters, inner) = (Counters::default(), Mutex::new(Inner::default()));
        Arc::new(Catchups { reader, options, budget, permits, counters, inner, again: OnceLock::new() })
    }

    /// Sets who takes a subscriber whose live backlog overflowed while it
    /// caught up, once its catch-up has ended: the hub, which runs another
    /// catch-up from there behind what is queued for storage (the log must
    /// hold the live changes it let go). Without one, it is closed, and
    /// reconnects.
    pub fn on_catch_up_again(&self, hook: CatchUpAgain) {
        let _ = self.again.set(hook);
    }

    fn again(&self, subscribers: Vec<(Arc<Subscriber>, String)>) {
        for (sub, replica_version) in subscribers {
            self.counters.again.fetch_add(1, Ordering::Relaxed);
            match self.again.get() {
                Some(hook) => hook(sub, replica_version),
                None => sub.close(None),
            }
        }
    }

    /// Catch-up rows `sub` may hold unconsumed now: the window, shrunk to
    /// its share of the memory budget, and opened gradually (a slow start):
    /// a subscriber gets at most 16 KiB more than it has acknowledged so
    /// far, so a peer that never acknowledges costs little to serve.
    fn window(&self, sub: &Subscriber) -> usize {
        const FIRST: usize = 16 << 10;
        self.options.window_bytes.min(self.budget.share().max(FIRST)).min(FIRST + sub.acked_bytes())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Catches these subscribers up. The log must already hold everything
    /// forwarded before they joined the forwarder. Must run on the runtime
    /// (or a blocking thread of it).
    pub fn start(self: &Arc<Self>, subscribers: impl IntoIterator<Item = (Arc<Subscriber>, String)>) {
        let mut inner = self.lock();
        inner.epoch += 1;
        let epoch = inner.epoch;
        for (sub, replica_version) in subscribers {
            if sub.is_closed() {
                continue;
            }
            let member = Member::new(sub, &replica_version, epoch);
            self.place(&mut inner, member);
        }
    }

    /// A member that left a scan (it was too slow for it) and is ready again.
    fn rejoin(self: &Arc<Self>, member: Member) {
        if member.sub.is_closed() {
            return;
        }
        let mut inner = self.lock();
        self.place(&mut inner, member);
    }

    /// Joins a scan that has not passed the member's position, or starts one.
    fn place(self: &Arc<Self>, inner: &mut Inner, member: Member) {
        inner.scans.retain(|s| !s.is_done());
        let mut member = member;
        for scan in inner.scans.iter().filter(|_| self.options.shared) {
            match scan.admit(member) {
                None => return,
                Some(refused) => member = refused,
            }
        }
        let scan = Scan::new(member);
        inner.scans.push(scan.clone());
        let catchups = self.clone();
        tokio::spawn(async move { catchups.run(scan).await });
    }

    fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Scans and members right now.
    pub fn view(&self) -> CatchupView {
        let inner = self.lock();
        let live: Vec<_> = inner.scans.iter().filter(|s| !s.is_done()).collect();
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CatchupView {
            scans: live.len(),
            members: live.iter().map(|s| s.members()).sum(),
            waiting: live.iter().filter(|s| s.is_waiting()).count(),
            changes_sent: count(&self.counters.sent),
            rows_read: count(&self.counters.read),
            scans_total: count(&self.counters.scans),
            repeated: count(&self.counters.again),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::storage::memory::MemoryChangeLog;
    use crate::storage::{Bounds, ChangeLog, LogRow, LogSnapshot, StoredRow};
    use crate::subscriber::{Connection, Frame, Limits, Mode};

    /// A reader that counts the snapshots it pins and the rows it hands out.
    struct Counting {
        inner: Arc<dyn LogReader>,
        snapshots: Arc<AtomicUsize>,
        rows: Arc<AtomicUsize>,
    }

    struct CountingSnapshot(Box<dyn LogSnapshot>, Arc<AtomicUsize>);

    impl LogSnapshot for CountingSnapshot {
        fn last_watermark(&self) -> &str {
            self.0.last_watermark()
        }
        fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>> {
            let rows = self.0.read(from, after, limit)?;
            self.1.fetch_add(rows.len(), Ordering::Relaxed);
            Ok(rows)
        }
    }

    impl LogReader for Counting {
        fn snapshot(&self) -> anyhow::Result<Box<dyn LogSnapshot>> {
            self.snapshots.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(CountingSnapshot(self.inner.snapshot()?, self.rows.clone())))
        }
        fn bounds(&self) -> anyhow::Result<Bounds> {
            self.inner.bounds()
        }
        fn purge_before(&self, floor: &str, replica_version: &str) -> anyhow::Result<u64> {
            self.inner.purge_before(floor, replica_version)
        }
        fn retention_floor(&self, t: Option<u64>, age: Option<Duration>) -> anyhow::Result<Option<String>> {
            self.inner.retention_floor(t, age)
        }
    }

    fn counting(log: &MemoryChangeLog) -> (Arc<Counting>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let (snapshots, rows) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        (Arc::new(Counting { inner: log.reader(), snapshots: snapshots.clone(), rows: rows.clone() }), snapshots, rows)
    }

    fn commit(log: &mut MemoryChangeLog, watermark: &str, inserts: i64) {
        let inserted: Vec<String> =
            (1..=inserts).map(|i| format!(r#"{{"tag":"insert","new":{{"id":{i}}}}}"#)).collect();
        let row = |pos, tag, change| LogRow { watermark, pos, tag, change, precommit: None };
        let mut rows = vec![row(0, "begin", r#"{"tag":"begin"}"#)];
        rows.extend(inserted.iter().zip(1..).map(|(change, i)| row(i, "insert", change)));
        rows.push(LogRow { precommit: Some(watermark), ..row(inserts + 1, "commit", r#"{"tag":"commit"}"#) });
        log.begin().unwrap();
        log.append(&rows).unwrap();
        log.commit(watermark).unwrap();
    }

    fn w(i: u32) -> String {
        format!("{i:03}")
    }

    fn subscriber(start: &str) -> (Arc<Subscriber>, Connection) {
        Subscriber::new(format!("s{start}"), "t".into(), Mode::Serving, 6, start.into(), Limits::default())
    }

    /// Reads a subscriber's frames until it is caught up to `last`,
    /// acknowledging each as consumed; returns the transactions (commit
    /// watermarks) in the order they came, and the rows of each.
    async fn read_to(sub: &Subscriber, conn: &mut Connection, last: &str) -> Vec<(String, usize)> {
        let mut txs: Vec<(String, usize)> = Vec::new();
        let mut rows = 0;
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(20), conn.frames.recv()).await;
            let Ok(Some(Frame::Message { json, commit, .. })) = frame else { panic!("{}: no frame in time", sub.id) };
            sub.consumed(json.len(), commit.as_ref());
            if json.starts_with("[\"data\"") {
                rows += 1;
            } else if let Some(c) = commit {
                txs.push((c.to_string(), rows));
                rows = 0;
                if *c == *last {
                    return txs;
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_transaction_a_subscriber_holds_is_skipped_not_read() {
        // A snapshot transaction of 20,000 rows at 01, then one row at 02.
        let mut log = MemoryChangeLog::default();
        log.reset("00").unwrap();
        commit(&mut log, "01", 20_000);
        commit(&mut log, "02", 1);
        let (reader, _, read) = counting(&log);
        let catchups = Catchups::new(reader, CatchupOptions::default(), Arc::default());
        let (sub, mut conn) = subscriber("01");
        catchups.start([(sub.clone(), "00".to_string())]);
        assert_eq!(read_to(&sub, &mut conn, "02").await, [("02".to_string(), 1)]);
        // The first batch found 01; the rest of 01 was jumped over.
        let n = read.load(Ordering::Relaxed);
        assert!(n <= CATCHUP_READ_ROWS + 3, "read {n} rows to catch up one transaction");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn subscribers_at_different_watermarks_share_one_read_of_the_log() {
        // 60 transactions of 30 rows: 1,920 rows, two batches.
        let mut log = MemoryChangeLog::default();
        log.reset("000").unwrap();
        for i in 1..=60 {
            commit(&mut log, &w(i), 30);
        }
        let (reader, snapshots, read) = counting(&log);
        let catchups = Catchups::new(reader, CatchupOptions::default(), Arc::default());
        // Arriving together, at 20 different positions (000 is the replica version).
        let subs: Vec<_> = (0..20).map(|i| subscriber(&w(i * 3))).collect();
        catchups.start(subs.iter().map(|(s, _)| (s.clone(), "000".to_string())));
        let tasks: Vec<_> = subs
            .into_iter()
            .map(|(sub, mut conn)| {
                tokio::spawn(async move { (sub.start.clone(), read_to(&sub, &mut conn, "060").await) })
            })
            .collect();
        for task in tasks {
            let (start, txs) = task.await.unwrap();
            let from: u32 = start.parse().unwrap();
            let expected: Vec<(String, usize)> = (from + 1..=60).map(|i| (w(i), 30)).collect();
            assert_eq!(txs, expected, "subscriber at {start}: every later transaction once, whole, in order");
        }
        assert_eq!(snapshots.load(Ordering::Relaxed), 1, "one scan for all");
        let total = log.reader().snapshot().unwrap().read("", None, usize::MAX).unwrap().len();
        assert!(read.load(Ordering::Relaxed) <= total, "the log ({total} rows) was read once: {read:?} rows");
        let view = catchups.view();
        assert_eq!((view.scans, view.members), (0, 0), "the scan ended with its members");
    }

    /// 300 transactions of 30 rows, each row ~40 B, caught up through one
    /// reader with 16 KiB windows (a member needs many batches); and the
    /// count of snapshots pinned.
    fn small_windows_over_300_transactions() -> (Arc<Catchups>, Arc<AtomicUsize>) {
        let mut log = MemoryChangeLog::default();
        log.reset("000").unwrap();
        for i in 1..=300 {
            commit(&mut log, &w(i), 30);
        }
        let (reader, snapshots, _) = counting(&log);
        let options = CatchupOptions { readers: 1, window_bytes: 16 << 10, shared: true };
        (Catchups::new(reader, options, Arc::default()), snapshots)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_newcomer_does_not_wait_in_a_scan_whose_members_have_no_room() {
        let (catchups, snapshots) = small_windows_over_300_transactions();
        // A member that reads nothing: after its first batch its scan waits
        // for it (up to STALL).
        let (stuck, _stuck_conn) = subscriber("000");
        catchups.start([(stuck.clone(), "000".to_string())]);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while catchups.view().waiting == 0 {
            assert!(tokio::time::Instant::now() < deadline, "the scan never waited for its member");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A subscriber near the end arrives: it gets a scan of its own
        // instead of waiting with the stuck one, and is served in full.
        let (late, mut late_conn) = subscriber("290");
        catchups.start([(late.clone(), "000".to_string())]);
        assert_eq!(catchups.view().scans, 2, "the newcomer started a scan of its own");
        let got = read_to(&late, &mut late_conn, "300").await;
        let expected: Vec<(String, usize)> = (291..=300).map(|i| (w(i), 30)).collect();
        assert_eq!(got, expected);
        assert_eq!(snapshots.load(Ordering::Relaxed), 2);
        assert!(!stuck.is_closed());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_too_slow_for_its_scan_leaves_it_and_still_gets_everything_once() {
        let (catchups, snapshots) = small_windows_over_300_transactions();
        let (fast, mut fast_conn) = subscriber("000");
        let (slow, mut slow_conn) = subscriber("000");
        catchups.start([(fast.clone(), "000".to_string()), (slow.clone(), "000".to_string())]);
        // The fast one reads everything while the slow one reads nothing.
        let got = read_to(&fast, &mut fast_conn, "300").await;
        assert_eq!(got.len(), 300);
        assert!(!slow.is_closed());
        // Now the slow one reads: it rejoins from where it stopped.
        let got = read_to(&slow, &mut slow_conn, "300").await;
        let expected: Vec<(String, usize)> = (1..=300).map(|i| (w(i), 30)).collect();
        assert_eq!(got, expected, "the slow member, whole transactions once each, in order");
        assert!(snapshots.load(Ordering::Relaxed) >= 2, "it finished on a scan of its own");
    }
}
