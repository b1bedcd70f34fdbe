//! The wake-up a subscriber's waiters share: flow control waiting for acks,
//! a catch-up waiting for room, a write waiting for a close.
//!
//! Acks arrive once per message, so waking must cost next to nothing when
//! nobody waits: one fence and one atomic load. Waiters count themselves in
//! before they check their condition; with a sequentially consistent fence
//! on both sides, either the waker sees the count or the waiter sees the
//! change, so no wake-up is lost.

use std::sync::atomic::{fence, AtomicUsize, Ordering};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Signal {
    waiters: AtomicUsize,
    notify: Notify,
}

impl Signal {
    /// Call after changing what waiters check.
    pub fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// Resolves once `ready()` holds; it is checked at once and after each
    /// wake-up.
    pub async fn until(&self, mut ready: impl FnMut() -> bool) {
        let _counted = Counted::new(&self.waiters);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a wake between the check and the
            // await is not missed.
            notified.as_mut().enable();
            fence(Ordering::SeqCst);
            if ready() {
                return;
            }
            notified.await;
        }
    }
}

/// Counts one waiter for as long as it lives (a dropped wait included).
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(waiters: &'a AtomicUsize) -> Self {
        waiters.fetch_add(1, Ordering::SeqCst);
        Counted(waiters)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_wake_is_lost_between_the_check_and_the_wait() {
        // Many rounds of a waiter racing a waker on another thread: each
        // round must end, which it would not if a wake slipped between the
        // waiter's check and its registration.
        for _ in 0..2000 {
            let signal = Arc::new(Signal::default());
            let flag = Arc::new(AtomicBool::new(false));
            let waiter = {
                let (signal, flag) = (signal.clone(), flag.clone());
                tokio::spawn(async move { signal.until(|| flag.load(Ordering::Acquire)).await })
            };
            tokio::task::yield_now().await;
            flag.store(true, Ordering::Release);
            signal.wake();
            tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
                .await
                .expect("the waiter saw the change")
                .expect("the waiter ran");
            assert_eq!(signal.waiters.load(Ordering::SeqCst), 0, "the waiter counted itself out");
        }
    }

    #[tokio::test]
    async fn waking_with_nobody_waiting_is_a_no_op() {
        let signal = Signal::default();
        signal.wake();
        // A later waiter whose condition holds returns at once.
        signal.until(|| true).await;
    }
}
