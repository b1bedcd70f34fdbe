//! UpstreamAcker: what to acknowledge to the source, and when (Zero §2.7).
//!
//! A commit is acked once it is durable in the change log. A status that
//! asked to be acked is echoed only once every commit before it is durable,
//! so an idle upstream can advance without ever running ahead of the log.

#[derive(Debug, Default)]
pub struct UpstreamAcker {
    /// Durable watermark of the change log; survives reconnects.
    durable: String,
    // Per stream: the last commit seen, the last ack-requesting status, the
    // last ack sent.
    last_tx: String,
    last_status: String,
    last_ack: String,
}

impl UpstreamAcker {
    /// Starts a new stream: nothing has been acked on it yet.
    pub fn reset(&mut self) {
        self.last_tx.clear();
        self.last_status.clear();
        self.last_ack.clear();
    }

    pub fn on_commit(&mut self, watermark: &str) -> Vec<String> {
        self.last_tx = watermark.to_string();
        self.acks()
    }

    pub fn on_status(&mut self, watermark: &str) -> Vec<String> {
        self.last_status = watermark.to_string();
        self.acks()
    }

    pub fn on_durable(&mut self, watermark: &str) -> Vec<String> {
        if *watermark > *self.durable {
            self.durable = watermark.to_string();
        }
        self.acks()
    }

    fn acks(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if self.durable > self.last_ack {
            self.last_ack = self.durable.clone();
            out.push(self.last_ack.clone());
        }
        if self.last_ack >= self.last_tx && self.last_status > self.last_ack {
            self.last_ack = self.last_status.clone();
            out.push(self.last_ack.clone());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_commits_when_durable_and_statuses_after_them() {
        let mut a = UpstreamAcker::default();
        assert!(a.on_commit("09").is_empty());
        assert!(a.on_status("0a").is_empty(), "0a waits for 09");
        assert!(a.on_commit("0b").is_empty());
        assert!(a.on_status("0d").is_empty());
        assert_eq!(a.on_durable("09"), ["09"]);
        assert_eq!(a.on_durable("0b"), ["0b", "0d"], "0a is superseded by 0d");
        assert!(a.on_durable("0b").is_empty(), "no re-ack");
    }

    #[test]
    fn status_is_acked_at_once_with_no_commit_outstanding() {
        let mut a = UpstreamAcker::default();
        assert_eq!(a.on_status("05"), ["05"]);
    }

    #[test]
    fn replayed_commit_after_reconnect_is_acked_from_the_log() {
        let mut a = UpstreamAcker::default();
        a.on_commit("05");
        assert_eq!(a.on_durable("05"), ["05"]);
        a.reset();
        assert_eq!(a.on_commit("05"), ["05"], "the log already holds it");
    }
}
