//! The memory budget shared by every subscriber.
//!
//! Each subscriber already has its own limits; this bounds their sum. What
//! counts is what Sluice holds for a subscriber: frames queued for its
//! connection, its live backlog while it catches up, and a little
//! bookkeeping per message sent and not yet acknowledged.
//!
//! When the sum passes the budget, a subscriber that receives more while it
//! holds more than its fair share (the budget divided among everyone
//! connected) is closed with `StreamTooFarBehind`; it reconnects and catches
//! up from the log. Subscribers within their share, the well-behaved ones
//! at the head among them, are never closed by it. Catch-ups are slowed
//! instead: their window shrinks to the share.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The default budget: 512 MiB.
pub const DEFAULT_BUDGET_BYTES: usize = 512 << 20;

#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
    subscribers: AtomicUsize,
    closed: AtomicU64,
}

/// The budget as `/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetView {
    pub budget_bytes: usize,
    pub used_bytes: usize,
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
        MemoryBudget { limit, used: AtomicUsize::new(0), subscribers: AtomicUsize::new(0), closed: AtomicU64::new(0) }
    }

    pub fn charge(&self, bytes: usize) {
        self.used.fetch_add(bytes, Ordering::AcqRel);
    }

    pub fn release(&self, bytes: usize) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(bytes)));
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
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
            share_bytes: self.share(),
            closed_total: self.closed.load(Ordering::Relaxed),
        }
    }
}
