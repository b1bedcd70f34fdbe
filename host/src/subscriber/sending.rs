//! The sending side of one subscriber's connection, apart from its
//! transport: which frames go out and as what text (the filter chain,
//! Zero's envelope), the send window, what the peer's acks release, and
//! what is being written counted against the memory budget. The transport
//! (`server/changes.rs`) reads acks and writes the text this produces.

use std::sync::Arc;

use super::outbox::{envelope, Outbox};
use super::{ErrorType, Frame, Subscriber};
use crate::filter::{FilterGroup, Outcome};

/// Bytes a subscriber may have sent to it and not acknowledged. A Zero
/// client acknowledges as it reads, so only a peer that stopped
/// acknowledging (or reading) reaches it.
pub const SEND_WINDOW_BYTES: usize = 1 << 20;

pub struct Sending {
    sub: Arc<Subscriber>,
    outbox: Outbox,
    filter: Option<Arc<FilterGroup>>,
    /// The filter failed: nothing more reaches this subscriber.
    filter_failed: bool,
}

/// What acks read in one go released.
#[derive(Default)]
pub struct Released {
    pub messages: u64,
    /// Their JSON bytes.
    pub bytes: usize,
    /// The last commit among them.
    pub commit: Option<Arc<str>>,
}

/// What one ack did.
pub enum AckOutcome {
    /// A message was released (see [`Released`]).
    Released,
    /// The error message sent was acknowledged: close the connection.
    ErrorAcknowledged,
}

/// Where prepared texts go: the transport's write buffer.
pub trait Outgoing {
    /// Room for `bytes` more, so a batch grows the buffer once.
    fn reserve(&mut self, bytes: usize);
    /// One text message, from its parts.
    fn queue_text(&mut self, parts: &[&[u8]]);
}

/// One batch of frames, ready for the transport.
pub enum Batch {
    /// Nothing to write.
    Empty,
    /// Texts were written through the callback; close after them when
    /// `closing` (the subscriber's queue ended).
    Written { closing: bool },
}

impl Sending {
    pub fn new(sub: Arc<Subscriber>, filter: Option<Arc<FilterGroup>>) -> Sending {
        Sending { sub, outbox: Outbox::default(), filter, filter_failed: false }
    }

    /// The peer holds a window's worth unacknowledged: send it nothing more
    /// until it acknowledges (or is closed). What waits stays queued, where
    /// the memory budget sees it.
    pub fn window_full(&self) -> bool {
        self.outbox.bytes_in_flight() >= SEND_WINDOW_BYTES && !self.sub.is_closed()
    }

    /// The peer acked message `id` (adding to `released`), or broke Zero's
    /// ack order (the error says how, in Zero's words).
    pub fn ack(&mut self, id: u64, released: &mut Released) -> Result<AckOutcome, String> {
        let front = self.outbox.ack(id)?;
        if front.last {
            // The error message (never counted as pending).
            return Ok(AckOutcome::ErrorAcknowledged);
        }
        released.messages += 1;
        released.bytes += front.bytes;
        if front.commit.is_some() {
            released.commit = front.commit;
        }
        Ok(AckOutcome::Released)
    }

    /// The messages `released` are consumed: flow control, acks upstream
    /// and purging follow.
    pub fn consumed(&self, released: &Released) {
        if released.messages > 0 {
            self.sub.consumed_many(released.messages, released.bytes, released.commit.as_ref());
        }
    }

    /// Turns `frames` (taken off the subscriber's queue, `batch_bytes` of
    /// JSON) into texts queued on `out`: each message through the filter
    /// chain and into Zero's envelope.
    pub async fn prepare(
        &mut self,
        mut frames: Vec<Option<Frame>>,
        batch_bytes: usize,
        out: &mut impl Outgoing,
    ) -> Batch {
        let (mut json_bytes, mut own_json_bytes) = (0, 0);
        for frame in frames.iter().flatten() {
            if let Frame::Message { json, live, .. } = frame {
                json_bytes += json.len();
                if !live {
                    own_json_bytes += json.len();
                }
            }
        }
        self.sub.taken(json_bytes, own_json_bytes);
        if self.sub.is_closed() {
            // Closed (for its limits or the memory budget): what is still
            // queued would only delay the error message behind it; the peer
            // resumes from its last commit anyway.
            frames.retain(|f| !matches!(f, Some(Frame::Message { .. })));
            if frames.is_empty() {
                return Batch::Empty;
            }
        }
        let mut outcomes = self.filter_outcomes(&frames).await.into_iter();
        // An envelope and frame header take under 48 bytes.
        out.reserve(batch_bytes + 48 * frames.len());
        let mut ids = itoa::Buffer::new();
        for frame in frames {
            let (json, bytes, commit, last) = match frame {
                Some(Frame::Message { json, commit, .. }) => {
                    let n = json.len();
                    if self.filter.is_some() && crate::filter::is_data(&json) {
                        match outcomes.next() {
                            Some(Outcome::Keep) => (json, n, commit, false),
                            Some(Outcome::Replace(other)) => (other, n, commit, false),
                            // Dropped (or the filter failed): consumed as if acked.
                            Some(Outcome::Drop) | None => {
                                self.sub.consumed(n, None);
                                continue;
                            }
                        }
                    } else if self.filter_failed {
                        self.sub.consumed(n, None);
                        continue;
                    } else {
                        (json, n, commit, false)
                    }
                }
                Some(Frame::Error(json)) => (Arc::from(json.as_str()), 0, None, true),
                Some(Frame::Close) | None => return Batch::Written { closing: true },
            };
            // The shared JSON goes straight into the transport's buffer
            // inside Zero's envelope: no text of its own per subscriber.
            let id = self.outbox.push(bytes, commit, last);
            out.queue_text(&envelope(ids.format(id), &json));
        }
        Batch::Written { closing: false }
    }

    /// The filter's outcome for each data message among `frames`, in order
    /// (none without a filter, or once it failed).
    async fn filter_outcomes(&mut self, frames: &[Option<Frame>]) -> Vec<Outcome> {
        let Some(group) = self.filter.as_ref().filter(|_| !self.filter_failed) else { return Vec::new() };
        let data: Vec<Arc<str>> = frames
            .iter()
            .filter_map(|f| match f {
                Some(Frame::Message { json, .. }) if crate::filter::is_data(json) => Some(json.clone()),
                _ => None,
            })
            .collect();
        if data.is_empty() {
            return Vec::new();
        }
        match group.apply(&data).await {
            Ok(outcomes) => outcomes,
            Err(message) => {
                // Nothing more reaches this subscriber unfiltered.
                tracing::warn!("closing a filtered subscriber: {message}");
                self.filter_failed = true;
                self.sub.close(Some((ErrorType::Unknown, message)));
                Vec::new()
            }
        }
    }

    /// `bytes` are being written: they count against the memory budget
    /// until [`Sending::written`].
    pub fn writing(&self, bytes: usize) {
        self.sub.writing(bytes);
    }

    pub fn written(&self, bytes: usize) {
        self.sub.written(bytes);
    }
}
