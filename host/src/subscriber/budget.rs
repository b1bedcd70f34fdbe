//! The memory budget shared by every subscriber.
//!
//! Each subscriber already has its own limits; this bounds their sum. What
//! counts is what Sluice holds for a subscriber: frames queued for its
//! connection, its live backlog while it catches up, and a little
//! bookkeeping per message sent and not yet acknowledged.
//!
//! The JSON of a live change is one allocation shared by every subscriber
//! it is queued for, so it is counted once, however many hold it: the
//! budget keeps the live changes forwarded to subscribers in order, and
//! drops each from the count once nothing but this record holds it (every
//! queue it was in took it). Live queues all end at the head, so what is
//! held is about the span from the slowest subscriber's oldest change to the
//! head. Each subscriber counts its own bookkeeping, the changes its
//! catch-up read, and what it is writing.
//!
//! When the sum passes the budget, a subscriber that receives more while it
//! holds more than its fair share (the budget divided among everyone
//! connected) is closed with `StreamTooFarBehind`; it reconnects and catches
//! up from the log. Subscribers within their share, the well-behaved ones
//! at the head among them, are never closed by it. Catch-ups are slowed
//! instead: their window shrinks to the share.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The default budget: 512 MiB.
pub const DEFAULT_BUDGET_BYTES: usize = 512 << 20;

#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    /// What subscribers hold of their own.
    used: AtomicUsize,
    /// The live changes' JSON that queues hold (see [`Live`]).
    shared: AtomicUsize,
    live: Mutex<Live>,
    subscribers: AtomicUsize,
    closed: AtomicU64,
}

/// Live changes forwarded to subscribers, oldest first, while a queue may
/// hold them.
#[derive(Debug, Default)]
struct Live {
    changes: VecDeque<Arc<str>>,
    bytes: usize,
}

/// The budget as `/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetView {
    pub budget_bytes: usize,
    pub used_bytes: usize,
    /// Of `used_bytes`, the live changes' JSON, counted once however many
    /// subscribers hold it.
    pub shared_bytes: usize,
    /// The most one subscriber may hold while the budget is exceeded.
    pub share_bytes: usize,
    /// Subscribers closed so far for holding more than their share.
    pub closed_total: u64,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget::new(DEFAULT_BUDGET_BYTES)
    }
}

impl MemoryBudget {
    pub fn new(limit: usize) -> MemoryBudget {
        MemoryBudget {
            limit,
            used: AtomicUsize::new(0),
            shared: AtomicUsize::new(0),
            live: Mutex::default(),
            subscribers: AtomicUsize::new(0),
            closed: AtomicU64::new(0),
        }
    }

    /// `json` is being forwarded to subscribers (in order): count it once
    /// while any of them holds it.
    pub fn forwarding(&self, json: &Arc<str>) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.changes.push_back(json.clone());
        live.bytes += json.len();
        self.drop_released(&mut live);
    }

    /// Stops counting the oldest live changes nothing else holds any more.
    /// (Called as changes are forwarded, and every second while idle.)
    pub fn release_consumed(&self) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        self.drop_released(&mut live);
    }

    fn drop_released(&self, live: &mut Live) {
        // Queues release changes in order, so the oldest go first; one still
        // held keeps the newer counted (an upper bound).
        while live.changes.front().is_some_and(|json| Arc::strong_count(json) == 1) {
            if let Some(json) = live.changes.pop_front() {
                live.bytes -= json.len();
            }
        }
        if live.changes.is_empty() && live.changes.capacity() > 4096 {
            live.changes.shrink_to(4096);
        }
        self.shared.store(live.bytes, Ordering::Release);
    }

    pub fn charge(&self, bytes: usize) {
        self.used.fetch_add(bytes, Ordering::AcqRel);
    }

    pub fn release(&self, bytes: usize) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(bytes)));
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire) + self.shared.load(Ordering::Acquire)
    }

    pub fn exceeded(&self) -> bool {
        self.used() > self.limit
    }

    /// The budget divided among the subscribers connected.
    pub fn share(&self) -> usize {
        self.limit / self.subscribers.load(Ordering::Acquire).max(1)
    }

    pub(super) fn joined(&self) {
        self.subscribers.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn left(&self) {
        self.subscribers.fetch_sub(1, Ordering::AcqRel);
    }

    /// Subscribers connected.
    pub fn subscribers(&self) -> usize {
        self.subscribers.load(Ordering::Acquire)
    }

    pub(super) fn count_closed(&self) {
        self.closed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn view(&self) -> BudgetView {
        BudgetView {
            budget_bytes: self.limit,
            used_bytes: self.used(),
            shared_bytes: self.shared.load(Ordering::Acquire),
            share_bytes: self.share(),
            closed_total: self.closed.load(Ordering::Relaxed),
        }
    }
}
