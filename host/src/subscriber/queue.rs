//! The queue between a subscriber and its connection task.
//!
//! Every change goes through it once per subscriber, so it is built for
//! batches: a catch-up hands a subscriber a thousand rows under one lock, the
//! connection takes a write's worth under one lock, and the connection task
//! is woken only when the queue goes from empty to not empty (a channel
//! wakes per message). The bytes it holds are counted by the subscriber.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use super::Frame;

/// Queue slots kept once it is emptied.
const KEEP_SLOTS: usize = 64;

#[derive(Default)]
struct Shared {
    frames: Mutex<VecDeque<Frame>>,
    /// Holds a permit when frames were queued into an empty queue.
    ready: Notify,
    sender_gone: AtomicBool,
    receiver_gone: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Frame>> {
        self.frames.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The subscriber's end.
pub struct FrameSender(Arc<Shared>);

/// The connection task's end.
pub struct FrameReceiver(Arc<Shared>);

/// The connection has gone: nothing queued will be sent.
#[derive(Debug, PartialEq, Eq)]
pub struct Gone;

pub fn queue() -> (FrameSender, FrameReceiver) {
    let shared = Arc::new(Shared::default());
    (FrameSender(shared.clone()), FrameReceiver(shared))
}

impl FrameSender {
    pub fn send(&self, frame: Frame) -> Result<(), Gone> {
        self.send_many(std::iter::once(frame))
    }

    /// Queues `frames` in order, under one lock and with one wake-up at most.
    pub fn send_many(&self, frames: impl IntoIterator<Item = Frame>) -> Result<(), Gone> {
        if self.0.receiver_gone.load(Ordering::Acquire) {
            return Err(Gone);
        }
        let was_empty = {
            let mut queue = self.0.lock();
            let was_empty = queue.is_empty();
            queue.extend(frames);
            was_empty && !queue.is_empty()
        };
        if was_empty {
            // Stored as a permit when the receiver is not waiting yet.
            self.0.ready.notify_one();
        }
        Ok(())
    }
}

impl Drop for FrameSender {
    fn drop(&mut self) {
        self.0.sender_gone.store(true, Ordering::Release);
        self.0.ready.notify_one();
    }
}

impl FrameReceiver {
    /// The next frame; `None` once the subscriber is gone and nothing is
    /// left. Cancel safe.
    pub async fn recv(&mut self) -> Option<Frame> {
        loop {
            if let Some(frame) = self.0.lock().pop_front() {
                return Some(frame);
            }
            if self.0.sender_gone.load(Ordering::Acquire) {
                return self.0.lock().pop_front();
            }
            // A frame queued since the check left a permit: no wake-up is lost.
            self.0.ready.notified().await;
        }
    }

    pub fn try_recv(&mut self) -> Option<Frame> {
        self.0.lock().pop_front()
    }

    /// Moves queued frames to `into`, under one lock: up to `max_frames`
    /// in all, and no more once `into` holds `max_bytes` of JSON. Returns
    /// the JSON bytes moved.
    pub fn take_into(&mut self, into: &mut Vec<Option<Frame>>, max_frames: usize, max_bytes: usize) -> usize {
        let mut queue = self.0.lock();
        let mut bytes = 0;
        while into.len() < max_frames && bytes < max_bytes {
            let Some(frame) = queue.pop_front() else { break };
            bytes += frame.json_len();
            into.push(Some(frame));
        }
        bytes
    }

    /// Gives back the slots a catch-up's thousand rows grew, if nothing is
    /// queued (a subscriber that follows live needs a few); returns whether
    /// the queue is empty.
    pub fn shrink_if_empty(&mut self) -> bool {
        let mut queue = self.0.lock();
        if queue.is_empty() && queue.capacity() > KEEP_SLOTS {
            queue.shrink_to(KEEP_SLOTS);
        }
        queue.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for FrameReceiver {
    fn drop(&mut self) {
        self.0.receiver_gone.store(true, Ordering::Release);
        // What is queued is not going anywhere.
        self.0.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn message(json: &str) -> Frame {
        Frame::Message { json: Arc::from(json), commit: None, live: false }
    }

    fn text(frame: Option<Frame>) -> String {
        match frame {
            Some(Frame::Message { json, .. }) => json.to_string(),
            other => format!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn frames_arrive_in_order_and_a_waiting_receiver_is_woken() {
        let (tx, mut rx) = queue();
        let waiting = tokio::spawn(async move {
            let first = text(rx.recv().await);
            (first, rx)
        });
        tokio::task::yield_now().await;
        tx.send_many([message("[1]"), message("[2]"), message("[3]")]).unwrap();
        let (first, mut rx) = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
        assert_eq!(first, "[1]");
        let mut batch = Vec::new();
        assert_eq!(rx.take_into(&mut batch, 10, 1 << 20), 6);
        assert_eq!(batch.into_iter().map(text).collect::<Vec<_>>(), ["[2]", "[3]"]);
        assert!(rx.is_empty());
    }

    #[tokio::test]
    async fn a_batch_stops_at_its_frame_or_byte_limit() {
        let (tx, mut rx) = queue();
        tx.send_many((0..10).map(|i| message(&format!("[{i}]")))).unwrap();
        let mut batch = Vec::new();
        rx.take_into(&mut batch, 4, 1 << 20);
        assert_eq!(batch.len(), 4);
        batch.clear();
        // 3 bytes each: the batch ends once it holds 5 bytes or more.
        assert_eq!(rx.take_into(&mut batch, 100, 5), 6);
        assert_eq!(rx.len(), 4);
        // Emptied, a queue a catch-up grew gives its slots back.
        tx.send_many((0..1000).map(|_| message("[0]"))).unwrap();
        while rx.take_into(&mut Vec::new(), 256, 1 << 20) > 0 {}
        assert!(rx.shrink_if_empty());
        assert!(rx.0.lock().capacity() <= KEEP_SLOTS);
    }

    #[tokio::test]
    async fn a_frame_queued_before_the_wait_is_not_missed_and_ends_are_seen() {
        let (tx, mut rx) = queue();
        tx.send(message("[1]")).unwrap();
        assert_eq!(text(rx.try_recv()), "[1]");
        tx.send(message("[2]")).unwrap();
        assert_eq!(text(tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap()), "[2]");
        tx.send(message("[3]")).unwrap();
        drop(tx);
        assert_eq!(text(rx.recv().await), "[3]", "what was queued still arrives");
        assert!(rx.recv().await.is_none(), "then the end");

        let (tx, rx) = queue();
        drop(rx);
        assert_eq!(tx.send(message("[1]")), Err(Gone));
    }
}
