//! One subscriber: a replica following the stream.
//!
//! A subscriber starts catching up: live changes go to a backlog while rows
//! from the change log are sent. Once caught up, the backlog is drained in
//! order and live changes go straight out. Every change is filtered by the
//! subscriber's watermark (the last commit it was sent), so replays and the
//! overlap between catch-up and live traffic are dropped: each transaction
//! arrives exactly once.
//!
//! Messages go to the connection task through a queue ([`queue`], filled and
//! emptied in batches) whose bytes are counted; the connection reports
//! consumption (the peer's acks), which is what flow control, acks and
//! purging are based on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::change::{Change, Kind};

pub mod budget;
pub mod outbox;
mod queue;
pub mod sending;
mod signal;
pub mod trim;

pub use budget::MemoryBudget;
pub use queue::FrameReceiver;
use queue::FrameSender;
pub use sending::Sending;
use signal::Signal;

/// The queue entry and bookkeeping of one message, held until it is
/// acknowledged (the JSON itself is held only until it is written).
const MESSAGE_OVERHEAD: usize = 96;

/// What one queued message costs this subscriber: its JSON (shared with the
/// other subscribers, but pinned by this one until consumed) plus the queue
/// entry and bookkeeping of its own.
fn queued_cost(json_len: usize) -> usize {
    json_len + MESSAGE_OVERHEAD
}

/// Of [`queued_cost`], what the subscriber counts against the memory budget
/// itself: a live change's JSON the budget counts once for everyone.
fn own_cost(frame: &Frame) -> usize {
    match frame {
        Frame::Message { live: true, .. } => MESSAGE_OVERHEAD,
        other => queued_cost(other.json_len()),
    }
}

/// Zero's error types for subscribers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorType {
    /// Anything else (a failing subscriber filter).
    Unknown = 0,
    WrongReplicaVersion = 1,
    WatermarkTooOld = 2,
    StreamTooFarBehind = 3,
}

/// A change and the commit watermark of its transaction.
#[derive(Debug, Clone)]
pub struct Entry {
    pub watermark: Arc<str>,
    pub change: Change,
}

/// What the connection task sends.
#[derive(Debug)]
pub enum Frame {
    /// A message (already JSON). `commit` is set for commits, whose
    /// consumption advances the subscriber's ack. `live`: a change from the
    /// forwarder, whose JSON the memory budget counts once for everyone.
    Message { json: Arc<str>, commit: Option<Arc<str>>, live: bool },
    /// Send this error message, then close once it is consumed.
    Error(String),
    /// Close now, without an error (the peer reconnects and retries).
    Close,
}

impl Frame {
    /// The length of the JSON it carries.
    pub fn json_len(&self) -> usize {
        match self {
            Frame::Message { json, .. } => json.len(),
            Frame::Error(json) => json.len(),
            Frame::Close => 0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Limits {
    /// Backlog kept while catching up; beyond it the subscriber is closed
    /// (it reconnects and catches up further from the log).
    pub backlog_bytes: usize,
    /// Sent but unconsumed bytes a caught-up subscriber may have; beyond it
    /// the subscriber is closed the same way.
    pub pending_bytes: usize,
    /// Shared by every subscriber of the service (see [`budget`]).
    pub budget: Arc<MemoryBudget>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { backlog_bytes: 16 << 20, pending_bytes: 64 << 20, budget: Arc::new(MemoryBudget::default()) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Serving,
    Backup,
}

pub struct Subscriber {
    pub id: String,
    pub task_id: String,
    pub mode: Mode,
    pub protocol: u32,
    /// The watermark it asked to start after.
    pub start: String,
    limits: Limits,
    state: Mutex<State>,
    out: FrameSender,
    /// Bytes queued for or sent to the peer and not yet consumed.
    pending_bytes: AtomicUsize,
    /// Messages consumed so far (for flow control waits).
    consumed: AtomicU64,
    /// Wakes those waiting on acks (and on the close).
    signal: Signal,
    /// Wakes those waiting only for the close (every socket write does;
    /// they need no wake-up per ack).
    close_signal: Signal,
    /// Messages handed to the connection so far.
    enqueued: AtomicU64,
    /// What Sluice holds for this subscriber (its share of the memory
    /// budget is measured in this).
    held: AtomicUsize,
    /// Of `held`, what it counts against the budget itself (not the live
    /// changes' JSON, which the budget counts once).
    charged: AtomicUsize,
    /// Bytes of messages it has acknowledged so far.
    acked_bytes: AtomicUsize,
    /// Closed: it takes nothing more. Set under the state lock, read
    /// without it (the forwarder asks for every change).
    closed: AtomicBool,
}

struct State {
    /// Last commit sent.
    watermark: Arc<str>,
    /// Last commit consumed.
    acked: Arc<str>,
    /// Live changes while catching up, shared with every other subscriber
    /// (a pointer each: 2,000 catch-ups during a flood held millions).
    backlog: Option<VecDeque<Arc<Entry>>>,
    backlog_bytes: usize,
    /// The backlog passed its limit and was let go: live changes are
    /// dropped until this catch-up ends, and another one, from where this
    /// one ends, covers them.
    overflowed: bool,
    /// Where the current catch-up starts: `start`, then the last commit
    /// sent when a catch-up is run again after an overflow.
    catchup_from: Arc<str>,
    initialized: bool,
    missed_last_timeout: bool,
    /// Messages it had to consume by the deadline it missed.
    missed_target: u64,
    lagging_since: Option<Instant>,
    samples: VecDeque<(Instant, u64)>,
}

/// One subscriber as `/status` lists it.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriberView {
    pub id: String,
    pub task_id: String,
    /// The last commit sent to it.
    pub sent: String,
    /// The last commit it consumed (acked).
    pub acked: String,
    /// Bytes queued for it or in flight, not yet consumed.
    pub pending_bytes: usize,
    /// What it counts against the subscribers' memory budget.
    pub held_bytes: usize,
    /// Still reading the change log (not yet following live).
    pub catching_up: bool,
    /// How long it has been lagging behind the live stream (0: it is not).
    pub lagging_ms: u64,
}

/// Handed to the connection task: where to read frames from.
pub struct Connection {
    pub frames: FrameReceiver,
}

impl Subscriber {
    pub fn new(
        id: String,
        task_id: String,
        mode: Mode,
        protocol: u32,
        watermark: String,
        limits: Limits,
    ) -> (Arc<Subscriber>, Connection) {
        let (out, frames) = queue::queue();
        let w: Arc<str> = watermark.as_str().into();
        limits.budget.joined();
        let sub = Subscriber {
            id,
            task_id,
            mode,
            protocol,
            start: watermark,
            limits,
            state: Mutex::new(State {
                watermark: w.clone(),
                acked: w.clone(),
                backlog: Some(VecDeque::new()),
                backlog_bytes: 0,
                overflowed: false,
                catchup_from: w,
                initialized: false,
                missed_last_timeout: false,
                missed_target: 0,
                lagging_since: None,
                samples: VecDeque::from([(Instant::now(), 0)]),
            }),
            out,
            pending_bytes: AtomicUsize::new(0),
            consumed: AtomicU64::new(0),
            signal: Signal::default(),
            close_signal: Signal::default(),
            enqueued: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            charged: AtomicUsize::new(0),
            acked_bytes: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        };
        (Arc::new(sub), Connection { frames })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where this subscriber stands, for `/status` and `/metrics`.
    pub fn view(&self) -> SubscriberView {
        let st = self.lock();
        SubscriberView {
            id: self.id.clone(),
            task_id: self.task_id.clone(),
            sent: st.watermark.to_string(),
            acked: st.acked.to_string(),
            pending_bytes: self.pending_bytes(),
            held_bytes: self.held(),
            catching_up: st.backlog.is_some(),
            lagging_ms: st.lagging_since.map_or(0, |since| since.elapsed().as_millis() as u64),
        }
    }

    /// The last commit consumed: this subscriber's contribution to the purge floor.
    pub fn acked(&self) -> Arc<str> {
        self.lock().acked.clone()
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// A live change from the forwarder.
    pub fn send(&self, entry: &Arc<Entry>) {
        if self.is_closed() {
            return;
        }
        let mut st = self.lock();
        if self.is_closed() || *entry.watermark <= *st.watermark {
            return;
        }
        if st.overflowed {
            // The next catch-up reads it from the log.
            return;
        }
        if let Some(backlog) = st.backlog.as_mut() {
            backlog.push_back(entry.clone());
            st.backlog_bytes += entry.change.json.len();
            // Live JSON: the budget counts it once for everyone.
            self.charge(entry.change.json.len(), 0);
            if !self.is_closed() && self.over_share(&st) {
                self.close_over_budget(&mut st);
            } else if st.backlog_bytes > self.limits.backlog_bytes {
                self.overflow(&mut st);
            }
            return;
        }
        self.send_change(&mut st, entry);
        if !self.is_closed() && self.over_share(&st) {
            self.close_over_budget(&mut st);
        }
    }

    /// The memory budget is exceeded and this subscriber holds more than
    /// its share of it. One that keeps acknowledging in time (it holds flow
    /// control) only has a backlog of the moment, and is let be up to four
    /// shares; so is one that was sent nothing yet (its catch-up has not
    /// reached it, so it had nothing to acknowledge).
    fn over_share(&self, st: &State) -> bool {
        let budget = &self.limits.budget;
        if !budget.exceeded() {
            return false;
        }
        let held = self.held();
        let keeping_up = self.flow_control_locked(st) || self.enqueued() == 0;
        held > budget.share() && (held > 4 * budget.share() || !keeping_up)
    }

    /// Closes it for holding more than its share of an exceeded budget.
    pub fn close_for_budget(&self) {
        let mut st = self.lock();
        if !self.is_closed() {
            self.close_over_budget(&mut st);
        }
    }

    fn close_over_budget(&self, st: &mut State) {
        let budget = &self.limits.budget;
        tracing::info!(
            subscriber = %self.id,
            "subscribers hold more than the {} MiB memory budget and this one holds {} KiB (its share: {} KiB); \
             closing it so it reconnects and catches up from the log",
            budget.view().budget_bytes >> 20,
            self.held() >> 10,
            budget.share() >> 10
        );
        budget.count_closed();
        self.close_locked(
            st,
            Some((
                ErrorType::StreamTooFarBehind,
                format!(
                    "subscriber memory budget exceeded: held {} bytes, share {} bytes",
                    self.held(),
                    budget.share()
                ),
            )),
        );
    }

    /// What this subscriber counts against the memory budget.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Holds `held` more bytes, `charged` of them counted against the budget
    /// by this subscriber.
    fn charge(&self, held: usize, charged: usize) {
        self.held.fetch_add(held, Ordering::AcqRel);
        self.charged.fetch_add(charged, Ordering::AcqRel);
        self.limits.budget.charge(charged);
    }

    fn release(&self, held: usize, charged: usize) {
        let _ = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| Some(h.saturating_sub(held)));
        let before =
            self.charged.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c.saturating_sub(charged)));
        self.limits.budget.release(charged.min(before.unwrap_or_else(|c| c)));
    }

    /// The connection is writing `bytes` of frames to the socket: they are
    /// held (as frames and in the WebSocket's buffer) until the write is
    /// flushed, which takes as long as the peer takes to read them.
    pub fn writing(&self, bytes: usize) {
        self.charge(bytes, bytes);
    }

    /// The write of [`Subscriber::writing`] is done (or given up).
    pub fn written(&self, bytes: usize) {
        self.release(bytes, bytes);
    }

    /// The connection took messages of `json_bytes` off its queue (one
    /// call per batch), `own_json_bytes` of them not live changes' (which
    /// the budget counts apart): their JSON is no longer held for this
    /// subscriber (their bookkeeping is, until acknowledged).
    pub fn taken(&self, json_bytes: usize, own_json_bytes: usize) {
        self.release(json_bytes, own_json_bytes);
    }

    /// A change read from the change log during catch-up.
    pub fn catchup(&self, entry: &Entry) {
        self.catchup_many(std::slice::from_ref(entry));
    }

    /// Changes read from the change log during catch-up, in order.
    pub fn catchup_many(&self, entries: &[Entry]) {
        let mut st = self.lock();
        if self.is_closed() {
            return;
        }
        self.initialize(&mut st);
        // Queued (and counted) as one batch; sized for all rows, since
        // `filter_map` gives `collect` no size to start from.
        let mut frames = Vec::with_capacity(entries.len());
        frames.extend(entries.iter().filter_map(|entry| self.frame_for(&mut st, entry, false)));
        self.push_many(&mut st, frames);
    }

    /// Live changes arrive faster than the catch-up reaches them: rather
    /// than hold more of them (or close the connection, which makes the
    /// peer reconnect and start over), let them go and read them from the
    /// log too, in another catch-up once this one ends.
    fn overflow(&self, st: &mut State) {
        tracing::info!(
            subscriber = %self.id,
            "live backlog passed {} MiB while catching up; it keeps reading the change log, past this catch-up's end, before it follows live",
            self.limits.backlog_bytes >> 20
        );
        if st.backlog.as_mut().map(std::mem::take).is_some() {
            self.release(st.backlog_bytes, 0);
        }
        st.backlog_bytes = 0;
        st.overflowed = true;
    }

    /// Where its catch-up starts: the watermark it asked for, or, for a
    /// catch-up run again after an overflow, the last commit it was sent.
    pub fn catchup_from(&self) -> Arc<str> {
        self.lock().catchup_from.clone()
    }

    /// Prepares another catch-up after an overflow, from the last commit
    /// sent (a catch-up ends at a commit): live changes from here on are
    /// kept again. Called with the forwarder's lock held, as it is
    /// re-added, so the next catch-up's snapshot and this backlog meet.
    pub fn restart_catchup(&self) {
        let mut st = self.lock();
        st.backlog = Some(VecDeque::new());
        st.backlog_bytes = 0;
        st.overflowed = false;
        st.catchup_from = st.watermark.clone();
    }

    /// Catch-up is done: send the backlog, then go live. False when its
    /// backlog overflowed: it must catch up again ([`Self::restart_catchup`]).
    pub fn set_caught_up(&self) -> bool {
        let mut st = self.lock();
        if self.is_closed() {
            return true;
        }
        if st.overflowed {
            return false;
        }
        self.initialize(&mut st);
        if let Some(backlog) = st.backlog.take() {
            self.release(st.backlog_bytes, 0);
            st.backlog_bytes = 0;
            for entry in &backlog {
                self.send_change(&mut st, entry);
            }
        }
        true
    }

    fn initialize(&self, st: &mut State) {
        if !st.initialized {
            st.initialized = true;
            let status = Arc::from("[\"status\",{\"tag\":\"status\"}]");
            self.push(st, Frame::Message { json: status, commit: None, live: false });
        }
    }

    /// A live change (from the forwarder, or the backlog kept while catching up).
    fn send_change(&self, st: &mut State, entry: &Entry) {
        if let Some(frame) = self.frame_for(st, entry, true) {
            self.push(st, frame);
        }
    }

    /// The message `entry` is for this subscriber, unless it was sent
    /// already (or its protocol has no such message).
    fn frame_for(&self, st: &mut State, entry: &Entry, live: bool) -> Option<Frame> {
        if *entry.watermark <= *st.watermark {
            return None;
        }
        if entry.change.tag == "update-table-metadata" && self.protocol < 5 {
            return None;
        }
        let commit = if entry.change.kind == Kind::Commit {
            st.watermark = entry.watermark.clone();
            Some(entry.watermark.clone())
        } else {
            None
        };
        Some(Frame::Message { json: entry.change.json.clone(), commit, live })
    }

    fn push(&self, st: &mut State, frame: Frame) {
        let (cost, own) = (queued_cost(frame.json_len()), own_cost(&frame));
        self.queue(st, 1, cost, own, |out| out.send(frame));
    }

    fn push_many(&self, st: &mut State, frames: Vec<Frame>) {
        if frames.is_empty() {
            return;
        }
        let cost = frames.iter().map(|f| queued_cost(f.json_len())).sum();
        let own = frames.iter().map(own_cost).sum();
        self.queue(st, frames.len() as u64, cost, own, |out| out.send_many(frames));
    }

    /// Counts `messages` costing `cost` as queued (`own` of it against the
    /// budget: see [`own_cost`]), and queues them.
    fn queue(
        &self,
        st: &mut State,
        messages: u64,
        cost: usize,
        own: usize,
        send: impl FnOnce(&FrameSender) -> Result<(), queue::Gone>,
    ) {
        let pending = self.pending_bytes.fetch_add(cost, Ordering::AcqRel) + cost;
        self.charge(cost, own);
        self.enqueued.fetch_add(messages, Ordering::AcqRel);
        if send(&self.out).is_err() {
            self.closed.store(true, Ordering::Release);
            return;
        }
        if pending > self.limits.pending_bytes && st.backlog.is_none() {
            tracing::info!(
                subscriber = %self.id,
                "more than {} MiB sent but not consumed; closing so it reconnects and catches up from the log",
                self.limits.pending_bytes >> 20
            );
            self.close_locked(st, None);
        }
    }

    /// Called by the connection when the peer consumed a message.
    /// `bytes` is the length of the message's JSON.
    pub fn consumed(&self, bytes: usize, commit: Option<&Arc<str>>) {
        self.consumed_many(1, bytes, commit);
    }

    /// Called by the connection when the peer consumed `messages` messages
    /// whose JSON is `bytes` long in all; `commit` is the last commit among
    /// them. One call for all the acks that arrived together.
    pub fn consumed_many(&self, messages: u64, bytes: usize, commit: Option<&Arc<str>>) {
        let cost = bytes + messages as usize * MESSAGE_OVERHEAD;
        self.acked_bytes.fetch_add(bytes, Ordering::AcqRel);
        let _ = self.pending_bytes.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| Some(p.saturating_sub(cost)));
        self.release(messages as usize * MESSAGE_OVERHEAD, messages as usize * MESSAGE_OVERHEAD);
        if let Some(w) = commit {
            let mut st = self.lock();
            if **w > *st.acked {
                st.acked = w.clone();
            }
        }
        self.consumed.fetch_add(messages, Ordering::AcqRel);
        self.signal.wake();
    }

    /// Bytes of messages it has acknowledged so far.
    pub fn acked_bytes(&self) -> usize {
        self.acked_bytes.load(Ordering::Acquire)
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes.load(Ordering::Acquire)
    }

    /// Resolves once the subscriber is closed.
    pub async fn closed(&self) {
        self.close_signal.until(|| self.is_closed()).await
    }

    /// Waits until fewer than `bytes` are pending (or the subscriber closed).
    pub async fn wait_pending_below(&self, bytes: usize) {
        self.signal.until(|| self.pending_bytes() < bytes || self.is_closed()).await
    }

    /// A flow-control target: the count of messages enqueued so far.
    pub fn enqueued(&self) -> u64 {
        self.enqueued.load(Ordering::Acquire)
    }

    /// Resolves once `target` messages were consumed, the backlog (while
    /// catching up) is below its limit, or the subscriber closed.
    pub async fn wait_consumed(&self, target: u64) {
        let ready = || {
            if self.is_closed() || self.consumed.load(Ordering::Acquire) >= target {
                return true;
            }
            let st = self.lock();
            st.backlog.as_ref().is_some_and(|_| st.backlog_bytes < self.limits.backlog_bytes / 10 * 8)
        };
        // The backlog shrinks without a wake-up (it drains as the catch-up
        // ends): look again every 200 ms.
        while tokio::time::timeout(Duration::from_millis(200), self.signal.until(ready)).await.is_err() {}
    }

    /// Ends the subscription; with an error, that message is sent first.
    pub fn close(&self, error: Option<(ErrorType, String)>) {
        let mut st = self.lock();
        self.close_locked(&mut st, error);
    }

    fn close_locked(&self, st: &mut State, error: Option<(ErrorType, String)>) {
        if self.is_closed() {
            return;
        }
        self.closed.store(true, Ordering::Release);
        st.backlog = None;
        st.backlog_bytes = 0;
        // It takes nothing more and its connection ends soon: what it holds
        // no longer counts against the budget, so the budget stops pressing
        // on the others at once.
        self.release(self.held(), self.charged.load(Ordering::Acquire));
        let frame = match error {
            Some((kind, message)) => {
                let mut json = format!("[\"error\",{{\"type\":{},\"message\":", kind as u8);
                crate::change::json::push_str(&mut json, &message);
                json.push_str("}]");
                Frame::Error(json)
            }
            None => Frame::Close,
        };
        let _ = self.out.send(frame);
        self.signal.wake();
        self.close_signal.wake();
    }

    // ---- Laggard detection (Zero's progress monitor) ----

    /// The outcome of a flow-control wait for `target` messages consumed.
    pub fn track_response(&self, on_time: bool, target: u64) {
        let mut st = self.lock();
        st.missed_last_timeout = !on_time;
        if !on_time {
            st.missed_target = target;
        }
        if on_time {
            st.lagging_since = None;
        }
    }

    /// Whether flow control waits for this subscriber. Not before it has
    /// acknowledged anything (a peer that never acks cannot hold the stream
    /// for everyone), nor after it missed a deadline until it has consumed
    /// what it had to by then (the laggard check deals with it meanwhile).
    /// A backup replicator is always waited for, as in Zero.
    pub fn holds_flow_control(&self) -> bool {
        self.flow_control_locked(&self.lock())
    }

    fn flow_control_locked(&self, st: &State) -> bool {
        if self.mode == Mode::Backup {
            return true;
        }
        let consumed = self.consumed.load(Ordering::Acquire);
        consumed > 0 && !(st.missed_last_timeout && consumed < st.missed_target)
    }

    pub fn missed_last_timeout(&self) -> bool {
        self.lock().missed_last_timeout
    }

    /// Records a sample of consumed messages; keeps the last ten.
    pub fn sample(&self, now: Instant) {
        let n = self.consumed.load(Ordering::Acquire);
        let mut st = self.lock();
        while st.samples.len() >= 10 {
            st.samples.pop_front();
        }
        st.samples.push_back((now, n));
    }

    /// Messages consumed per second over the samples.
    pub fn process_rate(&self) -> f64 {
        let st = self.lock();
        match (st.samples.front(), st.samples.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => (n1 - n0) as f64 / (*t1 - *t0).as_secs_f64(),
            _ => 0.0,
        }
    }

    /// For a subscriber that missed the last timeout: `lagging` starts (or
    /// continues) its clock and returns how long it has lagged;
    /// catching up resets it.
    pub fn report_lag(&self, now: Instant, lagging: bool) -> Duration {
        let mut st = self.lock();
        if !lagging {
            st.lagging_since = None;
            return Duration::ZERO;
        }
        let since = *st.lagging_since.get_or_insert(now);
        now - since
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        // Whatever is still queued goes with the connection.
        self.limits.budget.release(self.charged.load(Ordering::Acquire));
        self.limits.budget.left();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(w: &str, tag: &str, json: &str) -> Arc<Entry> {
        let stored = &json[json.find(',').unwrap() + 1..if tag == "begin" || tag == "commit" {
            json.rfind(',').unwrap()
        } else {
            json.len() - 1
        }];
        Arc::new(Entry { watermark: w.into(), change: Change::from_stored(tag, stored, w) })
    }

    fn begin(w: &str) -> Arc<Entry> {
        entry(w, "begin", &format!("[\"begin\",{{\"tag\":\"begin\"}},{{\"commitWatermark\":\"{w}\"}}]"))
    }
    fn commit(w: &str) -> Arc<Entry> {
        entry(w, "commit", &format!("[\"commit\",{{\"tag\":\"commit\"}},{{\"watermark\":\"{w}\"}}]"))
    }

    fn drain(conn: &mut Connection) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(f) = conn.frames.try_recv() {
            out.push(match f {
                Frame::Message { json, .. } => json.to_string(),
                Frame::Error(e) => format!("error {e}"),
                Frame::Close => "close".into(),
            });
        }
        out
    }

    fn sub(w: &str) -> (Arc<Subscriber>, Connection) {
        Subscriber::new("s".into(), "t".into(), Mode::Serving, 6, w.into(), Limits::default())
    }

    #[test]
    fn catchup_then_backlog_then_live() {
        let (s, mut c) = sub("01");
        s.send(&begin("12"));
        s.send(&commit("12"));
        s.catchup(&begin("02"));
        s.catchup(&commit("02"));
        assert_eq!(drain(&mut c).len(), 3, "status + catch-up, backlog held");
        s.set_caught_up();
        s.send(&begin("22"));
        s.send(&commit("22"));
        let got = drain(&mut c);
        assert_eq!(got.len(), 4);
        assert!(got[0].contains("\"commitWatermark\":\"12\"") && got[3].contains("\"watermark\":\"22\""));
    }

    #[test]
    fn watermark_filters_replays() {
        let (s, mut c) = sub("123");
        s.catchup(&begin("01"));
        s.catchup(&commit("01"));
        s.set_caught_up();
        for w in ["121", "123", "124", "125", "124", "125"] {
            s.send(&begin(w));
            s.send(&commit(w));
        }
        let got = drain(&mut c);
        assert_eq!(got.len(), 5, "status, 124 and 125 once each: {got:?}");
        assert_eq!(got[0], "[\"status\",{\"tag\":\"status\"}]");
    }

    #[test]
    fn acks_advance_on_consumed_commits_and_close_sends_the_error() {
        let (s, mut c) = sub("00");
        s.set_caught_up();
        s.send(&begin("02"));
        s.send(&commit("02"));
        let _ = drain(&mut c);
        let w: Arc<str> = "02".into();
        s.consumed(10, Some(&w));
        assert_eq!(&*s.acked(), "02");
        s.close(Some((ErrorType::WatermarkTooOld, "too old".into())));
        assert_eq!(drain(&mut c), ["error [\"error\",{\"type\":2,\"message\":\"too old\"}]"]);
        s.send(&begin("03"));
        assert!(drain(&mut c).is_empty(), "nothing after close");
    }

    #[test]
    fn over_budget_one_sent_nothing_yet_is_let_be_up_to_four_shares() {
        let budget = Arc::new(MemoryBudget::new(2000));
        let limits = Limits { budget: budget.clone(), ..Limits::default() };
        let new = |id: &str| Subscriber::new(id.into(), "t".into(), Mode::Serving, 6, "00".into(), limits.clone());
        // Its catch-up has not reached it: nothing was sent to acknowledge.
        let (waiting, _waiting_conn) = new("waiting");
        // Was sent its catch-up's first rows and acknowledged nothing.
        let (silent, _silent_conn) = new("silent");
        silent.catchup(&begin("01"));
        let share = budget.share();
        let (mut i, mut most) = (10, 0);
        let live = |i: u32| {
            for e in [begin(&format!("{i:03}")), commit(&format!("{i:03}"))] {
                budget.forwarding(&e.change.json);
                waiting.send(&e);
                silent.send(&e);
            }
        };
        while !silent.is_closed() {
            live(i);
            i += 1;
            assert!(i < 100, "the silent one was never closed");
        }
        while waiting.held() <= 2 * share {
            assert!(!waiting.is_closed(), "closed at {} bytes, share {share}", waiting.held());
            live(i);
            i += 1;
        }
        assert!(budget.exceeded());
        while !waiting.is_closed() {
            most = waiting.held();
            live(i);
            i += 1;
            assert!(i < 500, "the waiting one is bounded too");
        }
        assert!(most > 3 * share, "closed at {most} bytes, share {share}");
    }

    #[test]
    fn a_live_changes_json_counts_once_however_many_subscribers_hold_it() {
        let budget = Arc::new(MemoryBudget::new(1 << 30));
        let limits = Limits { budget: budget.clone(), ..Limits::default() };
        let mut subs: Vec<_> = (0..100)
            .map(|i| Subscriber::new(format!("s{i}"), "t".into(), Mode::Serving, 6, "00".into(), limits.clone()))
            .collect();
        for (s, _) in &subs {
            s.set_caught_up();
        }
        let mut json_bytes = 0;
        for i in 1..=50 {
            for e in [begin(&format!("{i:03}")), commit(&format!("{i:03}"))] {
                budget.forwarding(&e.change.json);
                json_bytes += e.change.json.len();
                for (s, _) in &subs {
                    s.send(&e);
                }
            }
        }
        let view = budget.view();
        assert_eq!(view.shared_bytes, json_bytes, "one copy");
        let status_cost = queued_cost("[\"status\",{\"tag\":\"status\"}]".len());
        assert_eq!(
            view.used_bytes - view.shared_bytes,
            100 * (status_cost + 100 * MESSAGE_OVERHEAD),
            "bookkeeping each"
        );
        let held: usize = subs.iter().map(|(s, _)| s.held()).sum();
        assert!(held > 99 * json_bytes, "each still holds (and is measured by) all of it: {held}");
        // While one queue holds the changes they stay counted.
        for (_, c) in &mut subs[1..] {
            drain(c);
        }
        budget.release_consumed();
        assert_eq!(budget.view().shared_bytes, json_bytes);
        // Closed with its queue full: the queue goes with its connection.
        let (last, conn) = subs.swap_remove(0);
        last.close(None);
        drop(conn);
        budget.release_consumed();
        assert_eq!(budget.view().shared_bytes, 0);
        drop(last);
        drop(subs);
        assert_eq!(budget.used(), 0, "nothing is left counted");
    }

    #[test]
    fn lag_clock_accumulates_and_resets() {
        let (s, _c) = sub("00");
        let t0 = Instant::now();
        assert_eq!(s.report_lag(t0, true), Duration::ZERO);
        assert_eq!(s.report_lag(t0 + Duration::from_millis(500), true), Duration::from_millis(500));
        assert_eq!(s.report_lag(t0 + Duration::from_millis(600), false), Duration::ZERO);
        assert_eq!(s.report_lag(t0 + Duration::from_millis(700), true), Duration::ZERO);
        s.track_response(true, 0);
        assert_eq!(s.report_lag(t0 + Duration::from_millis(900), true), Duration::ZERO);
    }
}
