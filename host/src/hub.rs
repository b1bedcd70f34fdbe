//! The hub: where the replication loop and subscribers meet.
//!
//! Everything that must happen in lock step goes through the hub's one lock:
//! queueing a change to the storer and forwarding it, and adding a subscriber
//! to the forwarder and queueing its catch-up behind what the storer already
//! has. So each transaction reaches a new subscriber exactly once, either
//! from the log or live.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::catchup::{CatchupOptions, Catchups};
use crate::change::Change;
use crate::forwarder::Forwarder;
use crate::reservations::{Reservations, Retention};
use crate::status::Status;
use crate::storage::LogReader;
use crate::storer::{CatchupQueue, Storer};
use crate::subscriber::{Entry, ErrorType, MemoryBudget, Subscriber};

pub struct Hub {
    inner: Mutex<Inner>,
    reader: Arc<dyn LogReader>,
    /// Catch-ups from the log, shared among subscribers at nearby positions.
    catchups: Arc<Catchups>,
    /// The memory budget every subscriber counts against.
    budget: Arc<MemoryBudget>,
    status: Arc<Status>,
    /// Positions held for consumers between their connections.
    reservations: Arc<Reservations>,
    /// How long a departed subscriber's last ack holds the log.
    subscriber_retention: Duration,
    /// Until when purges wait for the subscribers of the process that wrote
    /// the log before this one (see [`Hub::inherited_log`]).
    purge_hold: Mutex<Option<Instant>>,
}

struct Inner {
    forwarder: Forwarder,
    storer: StorerSlot,
    replica_version: Option<String>,
}

enum StorerSlot {
    /// No storer: the log holds everything forwarded; read it directly.
    Idle,
    /// Catch-ups queue behind the storer's work.
    Running(CatchupQueue),
    /// A storer has stopped or is draining; new subscribers wait, outside the
    /// forwarder, until the log is final.
    Stopping(Vec<(Arc<Subscriber>, String)>),
    /// A shared change DB this host does not own yet: the old owner may still
    /// commit, and this host resumes after whatever it committed, so a
    /// snapshot now could miss transactions the stream will not repeat.
    /// Subscribers wait, outside the forwarder, until ownership is taken.
    Unclaimed(Vec<(Arc<Subscriber>, String)>),
}

impl Hub {
    pub fn new(reader: Arc<dyn LogReader>, status: Arc<Status>) -> Arc<Hub> {
        Hub::with_options(reader, status, Retention::default(), CatchupOptions::default(), Arc::default())
    }

    /// The same, keeping a disconnected consumer's position for `retention`
    /// (see [`Reservations`]), running catch-ups with `catchup`, and
    /// enforcing `budget` (the one the subscribers' limits carry).
    pub fn with_options(
        reader: Arc<dyn LogReader>,
        status: Arc<Status>,
        retention: Retention,
        catchup: CatchupOptions,
        budget: Arc<MemoryBudget>,
    ) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            catchups: Catchups::new(reader.clone(), catchup, budget.clone()),
            budget,
            inner: Mutex::new(Inner {
                forwarder: Forwarder::default(),
                storer: StorerSlot::Idle,
                replica_version: None,
            }),
            reader,
            status,
            reservations: Reservations::new(retention.consumer),
            subscriber_retention: retention.subscriber,
            purge_hold: Mutex::new(None),
        });
        let weak = Arc::downgrade(&hub);
        hub.catchups.on_catch_up_again(Box::new(move |sub, replica_version| match weak.upgrade() {
            Some(hub) => hub.catch_up_again(sub, replica_version),
            None => sub.close(None),
        }));
        hub
    }

    pub fn reservations(&self) -> &Arc<Reservations> {
        &self.reservations
    }

    /// For a change log other hosts may write (a Postgres change DB): hold
    /// subscribers until this host owns it ([`Hub::claimed`]).
    pub fn hold_until_claimed(&self) {
        let mut inner = self.lock();
        if matches!(inner.storer, StorerSlot::Idle) {
            inner.storer = StorerSlot::Unclaimed(Vec::new());
        }
    }

    /// This host owns the change log now and no pass runs yet: nobody else
    /// writes it, so the subscribers held meanwhile catch up from it directly.
    pub fn claimed(&self) {
        let waiting = {
            let mut inner = self.lock();
            match std::mem::replace(&mut inner.storer, StorerSlot::Idle) {
                StorerSlot::Unclaimed(waiting) => waiting,
                other => {
                    inner.storer = other;
                    return;
                }
            }
        };
        self.release_held(waiting);
    }

    /// Subscribers that waited while no snapshot could be trusted join the
    /// forwarder and catch up from the log directly (no pass is running).
    fn release_held(&self, held: Vec<(Arc<Subscriber>, String)>) {
        self.status.update(|s| s.held_subscribers = 0);
        for (sub, rv) in held {
            if sub.is_closed() {
                continue;
            }
            self.join_forwarder(self.lock(), &sub);
            self.start_direct_catchup(sub, rv);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn reader(&self) -> &Arc<dyn LogReader> {
        &self.reader
    }

    /// The lineage subscribers must be on, or `None` while a lineage is
    /// being established (nothing is served then). A change closes everyone:
    /// they reconnect and learn the new version.
    pub fn set_replica_version(&self, rv: Option<&str>) {
        let mut inner = self.lock();
        if inner.replica_version.as_deref() != rv {
            if inner.replica_version.is_some() {
                for s in inner.forwarder.subscribers() {
                    s.close(None);
                }
                inner.forwarder = Forwarder::default();
            }
            inner.replica_version = rv.map(str::to_string);
        }
    }

    /// The lineage being served, if one is established.
    pub fn replica_version(&self) -> Option<String> {
        self.lock().replica_version.clone()
    }

    pub fn storer_started(&self, queue: CatchupQueue) {
        let mut inner = self.lock();
        debug_assert!(!matches!(inner.storer, StorerSlot::Unclaimed(_)), "a pass starts only once the log is claimed");
        inner.storer = StorerSlot::Running(queue);
    }

    pub fn storer_stopping(&self) {
        let mut inner = self.lock();
        if !matches!(inner.storer, StorerSlot::Stopping(_)) {
            inner.storer = StorerSlot::Stopping(Vec::new());
        }
    }

    /// The storer is gone and the log is final (no pass is running, so
    /// nothing is forwarded): waiting subscribers join and catch up.
    pub fn storer_stopped(&self) {
        let waiting = match std::mem::replace(&mut self.lock().storer, StorerSlot::Idle) {
            StorerSlot::Stopping(waiting) => waiting,
            _ => Vec::new(),
        };
        self.release_held(waiting);
    }

    fn start_direct_catchup(&self, sub: Arc<Subscriber>, rv: String) {
        self.catchups.start([(sub, rv)]);
    }

    pub fn catchups(&self) -> &Arc<Catchups> {
        &self.catchups
    }

    /// Stores and forwards one change, in lock step with subscriptions.
    pub fn publish(&self, storer: &Storer, watermark: &Arc<str>, change: Change) {
        let mut inner = self.lock();
        storer.store(watermark, &change);
        if !inner.forwarder.is_empty() {
            self.budget.forwarding(&change.json);
        }
        // Always forward, even to nobody: the forwarder tracks transaction
        // boundaries for subscribers that join later.
        inner.forwarder.forward(&Arc::new(Entry { watermark: watermark.clone(), change }));
    }

    /// How many subscribers the forwarder serves (for a trace's fan-out span).
    pub fn subscriber_count(&self) -> usize {
        self.lock().forwarder.len()
    }

    /// Forwards without storing (the synthetic rollback of an interrupted
    /// transaction).
    pub fn forward_only(&self, watermark: &Arc<str>, change: Change) {
        let mut inner = self.lock();
        if !inner.forwarder.is_empty() {
            self.budget.forwarding(&change.json);
        }
        inner.forwarder.forward(&Arc::new(Entry { watermark: watermark.clone(), change }));
    }

    /// Adds a subscriber: checks its replica version, then starts its
    /// catch-up behind everything already queued for storage.
    pub fn subscribe(&self, sub: Arc<Subscriber>, replica_version: &str) {
        let inner = self.lock();
        let Some(rv) = inner.replica_version.clone() else {
            // As a Zero change-streamer that is not up yet: no error, the
            // subscriber retries.
            tracing::info!(
                subscriber = %sub.id,
                "no replica version is served yet (the lineage's snapshot is not durable); closing so the subscriber retries"
            );
            sub.close(None);
            return;
        };
        if rv != replica_version {
            sub.close(Some((
                ErrorType::WrongReplicaVersion,
                format!("current replica version is {rv} (requested {replica_version})"),
            )));
            return;
        }
        self.start_catchup(inner, sub, rv);
    }

    /// A subscriber whose live backlog overflowed while it caught up has
    /// read its catch-up to the end: it leaves the live fan-out and joins
    /// again as a subscriber at its last commit does, so the next catch-up
    /// covers the live changes it let go, and its new backlog the rest.
    pub fn catch_up_again(&self, sub: Arc<Subscriber>, replica_version: String) {
        let mut inner = self.lock();
        if sub.is_closed() || !inner.forwarder.remove(&sub) {
            return;
        }
        let count = inner.forwarder.len();
        self.status.update(|s| s.subscribers = count);
        if inner.replica_version.as_deref() != Some(replica_version.as_str()) {
            // A new lineage began meanwhile: it reconnects, as to a new log.
            drop(inner);
            sub.close(None);
            return;
        }
        sub.restart_catchup();
        self.start_catchup(inner, sub, replica_version);
    }

    /// Queues `sub`'s catch-up behind everything queued for storage and
    /// adds it to the live fan-out, under the one lock.
    fn start_catchup(&self, mut inner: MutexGuard<'_, Inner>, sub: Arc<Subscriber>, rv: String) {
        let direct = match &mut inner.storer {
            // The storer serves the catch-up after everything already queued,
            // which is everything forwarded before this subscriber joins.
            StorerSlot::Running(q) if q.push(sub.clone(), rv.clone()) => false,
            // The storer failed while the loop may still be forwarding what it
            // will never store: a snapshot now plus live changes would leave a
            // gap. Wait until the pass ends.
            StorerSlot::Running(_) => {
                inner.storer = StorerSlot::Stopping(vec![(sub, rv)]);
                // Reported under the hub's lock, so concurrent changes reach
                // `/status` in the order they happened.
                self.status.update(|s| s.held_subscribers = 1);
                drop(inner);
                return;
            }
            StorerSlot::Stopping(waiting) | StorerSlot::Unclaimed(waiting) => {
                waiting.push((sub, rv));
                let held = waiting.len();
                self.status.update(|s| s.held_subscribers = held);
                drop(inner);
                return;
            }
            StorerSlot::Idle => true,
        };
        self.join_forwarder(inner, &sub);
        if direct {
            // No storer running: everything forwarded is already in the log
            // (or was rolled back), so a snapshot now is consistent.
            self.start_direct_catchup(sub, rv);
        }
    }

    /// Adds `sub` to the live fan-out (under the caller's lock, so nothing is
    /// forwarded between its check of the storer and this) and reports the
    /// count. The report is made under the lock too: made after it, two
    /// subscribers joining at once could leave the smaller count last.
    fn join_forwarder(&self, mut inner: MutexGuard<'_, Inner>, sub: &Arc<Subscriber>) {
        inner.forwarder.add(sub.clone());
        let count = inner.forwarder.len();
        self.status.update(|s| s.subscribers = count);
        drop(inner);
    }

    /// Removes a subscriber that disconnected, keeping its last ack in the
    /// purge floor for the subscriber retention (it may be reconnecting).
    pub fn unsubscribe(&self, sub: &Arc<Subscriber>) {
        self.leave(sub, true);
    }

    /// Removes a consumer whose own [`crate::reservations::Reservation`]
    /// holds its position.
    pub fn unsubscribe_reserved(&self, sub: &Arc<Subscriber>) {
        self.leave(sub, false);
    }

    fn leave(&self, sub: &Arc<Subscriber>, keep_position: bool) {
        let mut inner = self.lock();
        let served = inner.forwarder.remove(sub);
        let count = inner.forwarder.len();
        self.status.update(|s| s.subscribers = count);
        drop(inner);
        sub.close(None);
        if served && keep_position {
            let holder = format!("subscriber {}", sub.id);
            self.reservations.keep_released(&holder, &sub.acked(), self.subscriber_retention);
        }
    }

    /// Every connected subscriber, as `/status` lists it.
    pub fn subscriber_views(&self) -> Vec<crate::subscriber::SubscriberView> {
        let subscribers: Vec<Arc<Subscriber>> = self.lock().forwarder.subscribers().cloned().collect();
        subscribers.iter().map(|s| s.view()).collect()
    }

    pub fn broadcast_targets(&self) -> Vec<(Arc<Subscriber>, u64)> {
        self.lock().forwarder.broadcast_targets()
    }

    /// The lowest ack among connected subscribers and reserved positions,
    /// if there are any.
    pub fn min_ack(&self) -> Option<Arc<str>> {
        let inner = self.lock();
        // Subscribers held until the log is final count too: they start at
        // their ack once served.
        let held = match &inner.storer {
            StorerSlot::Stopping(waiting) | StorerSlot::Unclaimed(waiting) => waiting.as_slice(),
            StorerSlot::Idle | StorerSlot::Running(_) => &[],
        };
        let acked = inner.forwarder.subscribers().chain(held.iter().map(|(s, _)| s)).map(|s| s.acked()).min();
        drop(inner);
        acked.into_iter().chain(self.reservations.floor()).min()
    }

    /// This process serves a lineage an earlier process (or another host)
    /// served: that one's subscribers may be reconnecting, and their acks
    /// went with it, so nothing is purged for the subscriber retention from
    /// the first call.
    pub fn inherited_log(&self) {
        let mut hold = self.purge_hold.lock().unwrap_or_else(|e| e.into_inner());
        hold.get_or_insert_with(|| Instant::now() + self.subscriber_retention);
    }

    /// Whether purges wait for an earlier process's subscribers.
    pub fn holding_for_returning_subscribers(&self) -> bool {
        let hold = *self.purge_hold.lock().unwrap_or_else(|e| e.into_inner());
        hold.is_some_and(|until| Instant::now() < until)
    }

    pub fn check_laggards(&self, grace: Option<Duration>) {
        self.lock().forwarder.check_laggards(Instant::now(), grace);
    }

    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// While the memory budget is exceeded, closes the subscribers holding
    /// the most, each above its share, until the rest fit. (Subscribers are
    /// also closed as they receive more; this catches those that do not.)
    pub fn enforce_budget(&self) {
        self.budget.release_consumed();
        let Some(mut excess) = self.budget.used().checked_sub(self.budget.view().budget_bytes) else { return };
        let mut subscribers: Vec<(usize, Arc<Subscriber>)> =
            self.lock().forwarder.subscribers().map(|s| (s.held(), s.clone())).collect();
        subscribers.sort_by_key(|(held, _)| std::cmp::Reverse(*held));
        let share = self.budget.share();
        for (held, sub) in subscribers {
            if excess == 0 || held <= share {
                break;
            }
            sub.close_for_budget();
            excess = excess.saturating_sub(held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::memory::MemoryChangeLog;
    use crate::storage::{ChangeLog, LogRow};
    use crate::subscriber::{Connection, Frame, Limits, Mode};

    /// A log of lineage 00 holding one transaction at 01.
    fn log_with_one_transaction() -> MemoryChangeLog {
        let mut log = MemoryChangeLog::default();
        log.reset("00").unwrap();
        log.begin().unwrap();
        let row = |pos, tag, change| LogRow { watermark: "01", pos, tag, change, precommit: None };
        log.append(&[
            row(0, "begin", r#"{"tag":"begin"}"#),
            row(1, "insert", r#"{"tag":"insert","new":{"id":1}}"#),
            LogRow { precommit: Some("01"), ..row(2, "commit", r#"{"tag":"commit"}"#) },
        ])
        .unwrap();
        log.commit("01").unwrap();
        log
    }

    fn hub() -> (Arc<Hub>, Arc<Status>) {
        let status = Arc::new(Status::default());
        (Hub::new(log_with_one_transaction().reader(), status.clone()), status)
    }

    #[test]
    fn an_inherited_log_is_not_purged_while_its_subscribers_may_return() {
        use crate::cleanup::{purge_once, CleanupOptions};
        let retention = Retention { subscriber: Duration::from_millis(300), ..Retention::default() };
        let reader = log_with_one_transaction().reader();
        let hub = Hub::with_options(reader, Arc::default(), retention, CatchupOptions::default(), Arc::default());
        hub.set_replica_version(Some("00"));
        hub.inherited_log();
        assert!(hub.holding_for_returning_subscribers());
        let (floor, deleted) = purge_once(&hub, &CleanupOptions::default()).unwrap();
        assert_eq!((floor.as_deref(), deleted), (Some("00"), 0));
        std::thread::sleep(Duration::from_millis(350));
        // Once per process: a later call holds nothing.
        hub.inherited_log();
        assert!(!hub.holding_for_returning_subscribers());
        let (floor, deleted) = purge_once(&hub, &CleanupOptions::default()).unwrap();
        assert_eq!(floor.as_deref(), Some("01"));
        assert!(deleted > 0, "the seed rows below 01 go");
    }

    fn subscriber(watermark: &str) -> (Arc<Subscriber>, Connection) {
        Subscriber::new("sub".into(), "task".into(), Mode::Serving, 6, watermark.into(), Limits::default())
    }

    /// The next frame, summarised: `begin W`, `commit W`, another message's
    /// tag, the error message (JSON) or `close`.
    async fn next(conn: &mut Connection) -> String {
        let frame = tokio::time::timeout(Duration::from_secs(10), conn.frames.recv()).await;
        match frame.expect("a frame in time").expect("the subscriber's channel is open") {
            Frame::Message { json, .. } => {
                let v: serde_json::Value = serde_json::from_str(&json).unwrap();
                match v[0].as_str().unwrap() {
                    "begin" => format!("begin {}", v[2]["commitWatermark"].as_str().unwrap()),
                    "commit" => format!("commit {}", v[2]["watermark"].as_str().unwrap()),
                    "data" => v[1]["tag"].as_str().unwrap().to_string(),
                    other => other.to_string(),
                }
            }
            Frame::Error(m) => m,
            Frame::Close => "close".into(),
        }
    }

    async fn caught_up(conn: &mut Connection) {
        for expected in ["status", "begin 01", "insert", "commit 01"] {
            assert_eq!(next(conn).await, expected);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_an_established_lineage_subscribers_are_closed_without_an_error() {
        let (hub, _) = hub();
        let (sub, mut conn) = subscriber("00");
        hub.subscribe(sub, "00");
        assert_eq!(next(&mut conn).await, "close");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_replica_version_is_an_error_and_a_new_lineage_closes_everyone() {
        let (hub, status) = hub();
        hub.set_replica_version(Some("00"));
        let (wrong, mut wrong_conn) = subscriber("00");
        hub.subscribe(wrong, "0x");
        assert_eq!(
            next(&mut wrong_conn).await,
            r#"["error",{"type":1,"message":"current replica version is 00 (requested 0x)"}]"#
        );

        let (sub, mut conn) = subscriber("00");
        hub.subscribe(sub.clone(), "00");
        caught_up(&mut conn).await;
        assert_eq!(status.snapshot().subscribers, 1);
        // A lineage being established: the old one's subscribers can never continue.
        hub.set_replica_version(None);
        assert_eq!(next(&mut conn).await, "close");
        assert!(sub.is_closed());
    }

    /// `hold` puts the hub in a state that holds new subscribers; a
    /// subscriber that comes then gets nothing until `release`, and then
    /// catches up from the log.
    async fn held_until_released(hold: impl Fn(&Hub), release: impl Fn(&Hub)) {
        let (hub, status) = hub();
        hub.set_replica_version(Some("00"));
        hold(&hub);
        let (sub, mut conn) = subscriber("00");
        hub.subscribe(sub, "00");
        assert_eq!(status.snapshot().held_subscribers, 1);
        assert!(conn.frames.try_recv().is_none(), "nothing is served while held");
        release(&hub);
        caught_up(&mut conn).await;
        assert_eq!((status.snapshot().held_subscribers, status.snapshot().subscribers), (0, 1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unclaimed_log_holds_subscribers_until_this_host_owns_it() {
        held_until_released(Hub::hold_until_claimed, Hub::claimed).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopping_storer_holds_subscribers_until_the_log_is_final() {
        held_until_released(Hub::storer_stopping, Hub::storer_stopped).await;
    }
}
