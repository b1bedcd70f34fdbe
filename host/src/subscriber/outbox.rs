//! One subscriber connection's outbox: Zero's envelope and ack rules.
//!
//! Every message goes out as `{"id":n,"msg":M}` with n counting from 1, and
//! stays in flight until the peer acks it with `{"ack":n}`. Acks must come in
//! order: anything else is the protocol's "Unexpected ack for X: Y".

use std::collections::VecDeque;
use std::sync::Arc;

/// A message sent and not yet acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    pub id: u64,
    /// What the subscriber counts as pending until the ack.
    pub bytes: usize,
    /// Set for a commit: its ack advances the subscriber's position.
    pub commit: Option<Arc<str>>,
    /// Close the connection once this one is acked (an error message).
    pub last: bool,
}

#[derive(Debug, Default)]
pub struct Outbox {
    next_id: u64,
    in_flight: VecDeque<InFlight>,
    /// The bytes of the messages in flight.
    bytes: usize,
}

/// The text of message `id` (its digits) wrapping `msg` (JSON), in the
/// parts a WebSocket frame is written from.
pub fn envelope<'a>(id: &'a str, msg: &'a str) -> [&'a [u8]; 5] {
    [b"{\"id\":", id.as_bytes(), b",\"msg\":", msg.as_bytes(), b"}"]
}

impl Outbox {
    /// Keeps a message in flight; returns its id, for [`envelope`].
    pub fn push(&mut self, bytes: usize, commit: Option<Arc<str>>, last: bool) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.bytes += bytes;
        self.in_flight.push_back(InFlight { id, bytes, commit, last });
        id
    }

    /// The peer acked message `id`: the oldest one in flight, or an error
    /// with Zero's text when it is not the one expected.
    pub fn ack(&mut self, id: u64) -> Result<InFlight, String> {
        match self.in_flight.front() {
            Some(front) if front.id == id => {
                let front = self.in_flight.pop_front().expect("checked: a message is in flight");
                self.bytes -= front.bytes;
                Ok(front)
            }
            front => {
                let expected = front.map_or(self.next_id + 1, |f| f.id);
                Err(format!("Unexpected ack for {expected}: {id}"))
            }
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The bytes sent and not yet acknowledged.
    pub fn bytes_in_flight(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_count_from_one_in_zeros_envelope() {
        let mut out = Outbox::default();
        let text = |id: u64, msg: &str| envelope(itoa::Buffer::new().format(id), msg).concat();
        let first = out.push(0, None, false);
        assert_eq!(text(first, r#"["status",{"tag":"status"}]"#), br#"{"id":1,"msg":["status",{"tag":"status"}]}"#);
        assert_eq!(text(out.push(3, None, false), "[1]"), br#"{"id":2,"msg":[1]}"#);
        assert_eq!(out.in_flight(), 2);
    }

    #[test]
    fn acks_in_order_release_each_message_once() {
        let mut out = Outbox::default();
        out.push(3, None, false);
        out.push(3, Some("05".into()), false);
        out.push(0, None, true);
        assert_eq!(out.bytes_in_flight(), 6);
        assert_eq!(out.ack(1), Ok(InFlight { id: 1, bytes: 3, commit: None, last: false }));
        assert_eq!(out.bytes_in_flight(), 3);
        let commit = out.ack(2).unwrap();
        assert_eq!(commit.commit.as_deref(), Some("05"));
        assert!(out.ack(3).unwrap().last, "the error message ends the connection once acked");
        assert_eq!((out.in_flight(), out.bytes_in_flight()), (0, 0));
    }

    #[test]
    fn an_ack_out_of_order_is_named_as_zero_names_it() {
        let mut out = Outbox::default();
        out.push(3, None, false);
        out.push(3, None, false);
        assert_eq!(out.ack(2), Err("Unexpected ack for 1: 2".to_string()));
        assert_eq!(out.ack(1).map(|f| f.id), Ok(1), "a refused ack changes nothing");
        assert_eq!(out.ack(1), Err("Unexpected ack for 2: 1".to_string()), "no ack twice");
        out.ack(2).unwrap();
        assert_eq!(out.ack(7), Err("Unexpected ack for 3: 7".to_string()), "none in flight: the next id is expected");
    }
}
