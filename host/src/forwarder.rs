//! The forwarder: fans live changes out to subscribers.
//!
//! A subscriber added in the middle of a transaction is queued and becomes
//! active at the next transaction boundary; until then the storer's catch-up
//! covers it. Flow control follows Zero's Broadcast: the loop waits for a
//! majority of subscribers to consume what was sent, then gives the rest a
//! proportional grace before moving on, so one slow subscriber cannot hold
//! the stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};

use crate::change::Kind;
use crate::subscriber::{Entry, ErrorType, Subscriber};

#[derive(Default)]
pub struct Forwarder {
    active: Vec<Arc<Subscriber>>,
    queued: Vec<Arc<Subscriber>>,
    in_transaction: bool,
}

impl Forwarder {
    pub fn add(&mut self, sub: Arc<Subscriber>) {
        if self.in_transaction {
            self.queued.push(sub);
        } else {
            self.active.push(sub);
        }
    }

    /// Removes `sub`; whether it was there.
    pub fn remove(&mut self, sub: &Arc<Subscriber>) -> bool {
        let before = self.len();
        self.active.retain(|s| !Arc::ptr_eq(s, sub));
        self.queued.retain(|s| !Arc::ptr_eq(s, sub));
        self.len() < before
    }

    pub fn forward(&mut self, entry: &Arc<Entry>) {
        for sub in &self.active {
            sub.send(entry);
        }
        match entry.change.kind {
            Kind::Begin => self.in_transaction = true,
            Kind::Commit | Kind::Rollback => {
                self.in_transaction = false;
                self.active.append(&mut self.queued);
            }
            Kind::Data => {}
        }
        if self.active.iter().any(|s| s.is_closed()) {
            self.active.retain(|s| !s.is_closed());
        }
    }

    /// Everyone connected (active or queued).
    pub fn subscribers(&self) -> impl Iterator<Item = &Arc<Subscriber>> {
        self.active.iter().chain(self.queued.iter())
    }

    pub fn len(&self) -> usize {
        self.active.len() + self.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What a flow-control wait waits for: each active subscriber that
    /// holds flow control ([`Subscriber::holds_flow_control`]) and the number
    /// of messages it must have consumed.
    pub fn broadcast_targets(&self) -> Vec<(Arc<Subscriber>, u64)> {
        self.active
            .iter()
            .filter(|s| !s.is_closed() && s.holds_flow_control())
            .map(|s| (s.clone(), s.enqueued()))
            .collect()
    }

    /// Zero's laggard detection, run every second: a subscriber that missed
    /// the last flow-control timeout and processes slower than the slowest
    /// on-time subscriber is lagging; lagging continuously for `grace` closes
    /// it with StreamTooFarBehind.
    pub fn check_laggards(&self, now: Instant, grace: Option<Duration>) {
        for s in &self.active {
            s.sample(now);
        }
        let Some(grace) = grace else { return };
        let baseline = self
            .active
            .iter()
            .filter(|s| !s.missed_last_timeout())
            .map(|s| s.process_rate())
            .min_by(|a, b| a.total_cmp(b));
        let Some(baseline) = baseline else { return };
        for s in self.active.iter().filter(|s| s.missed_last_timeout()) {
            let lagged = s.report_lag(now, s.process_rate() < baseline);
            if lagged >= grace {
                s.close(Some((
                    ErrorType::StreamTooFarBehind,
                    format!("lagging for over {}ms ({}ms)", grace.as_millis(), lagged.as_millis()),
                )));
            }
        }
    }
}

/// How a flow-control wait ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Release {
    AllSubscribers,
    ConsensusTimeout,
}

/// How long a wait without a majority lasts (with a non-negative
/// proportion): a majority that stopped acknowledging together must not
/// hold the stream for the rest.
pub const NO_MAJORITY_TIMEOUT: Duration = Duration::from_secs(1);

/// Waits for the targets: all of them, or a majority plus
/// `elapsed × proportion` (negative proportion: wait for all). Without a
/// majority the wait ends after [`NO_MAJORITY_TIMEOUT`].
pub async fn broadcast(targets: Vec<(Arc<Subscriber>, u64)>, proportion: f64) -> Release {
    if targets.is_empty() {
        return Release::AllSubscribers;
    }
    let start = Instant::now();
    // Zero's majority, except that of two subscribers one is enough: otherwise
    // a pair would always wait for its slower half.
    let majority = if targets.len() == 2 { 1 } else { targets.len() / 2 + 1 };

    let mut waits: FuturesUnordered<_> = targets
        .iter()
        .enumerate()
        .map(|(i, (s, target))| {
            let s = s.clone();
            let target = *target;
            async move {
                s.wait_consumed(target).await;
                i
            }
        })
        .collect();
    let mut done = vec![false; targets.len()];
    let mut completed = 0;
    let mut deadline: Option<tokio::time::Instant> =
        (proportion >= 0.0).then(|| tokio::time::Instant::now() + NO_MAJORITY_TIMEOUT);
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, waits.next()).await {
                Ok(n) => n,
                Err(_) => {
                    for (i, (s, target)) in targets.iter().enumerate() {
                        s.track_response(done[i], *target);
                    }
                    return Release::ConsensusTimeout;
                }
            },
            None => waits.next().await,
        };
        let Some(i) = next else { break };
        done[i] = true;
        completed += 1;
        if completed == majority && proportion >= 0.0 && completed < targets.len() {
            let grace = Duration::from_secs_f64((start.elapsed().as_secs_f64() * proportion).max(0.001));
            deadline = Some(tokio::time::Instant::now() + grace);
        }
    }
    for (s, target) in &targets {
        s.track_response(true, *target);
    }
    Release::AllSubscribers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change::Change;
    use crate::subscriber::{Connection, Frame, Limits, Mode};

    fn entry(w: &str, tag: &str) -> Arc<Entry> {
        let stored = format!("{{\"tag\":\"{tag}\"}}");
        Arc::new(Entry { watermark: w.into(), change: Change::from_stored(tag, &stored, w) })
    }

    fn sub(w: &str) -> (Arc<Subscriber>, Connection) {
        let (s, c) = Subscriber::new("s".into(), "t".into(), Mode::Serving, 6, w.into(), Limits::default());
        s.set_caught_up();
        (s, c)
    }

    fn seen(c: &mut Connection) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Frame::Message { json, .. }) = c.frames.try_recv() {
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            out.push(match v[0].as_str().unwrap() {
                "begin" => format!("begin {}", v[2]["commitWatermark"].as_str().unwrap()),
                "commit" => format!("commit {}", v[2]["watermark"].as_str().unwrap()),
                "data" => v[1]["tag"].as_str().unwrap().to_string(),
                other => other.to_string(),
            });
        }
        out
    }

    fn queueing(end: &str) -> Vec<Vec<String>> {
        let mut f = Forwarder::default();
        let (s1, mut c1) = sub("00");
        f.add(s1);
        f.forward(&entry("13", "begin"));
        let (s2, mut c2) = sub("00");
        f.add(s2);
        f.forward(&entry("13", "truncate"));
        f.forward(&entry("13", end));
        let (s3, mut c3) = sub("00");
        f.add(s3);
        f.forward(&entry("15", "begin"));
        let (s4, mut c4) = sub("00");
        f.add(s4);
        vec![seen(&mut c1), seen(&mut c2), seen(&mut c3), seen(&mut c4)]
    }

    #[test]
    fn subscribers_added_in_a_transaction_start_with_the_next_one() {
        let got = queueing("commit");
        assert_eq!(got[0], ["status", "begin 13", "truncate", "commit 13", "begin 15"]);
        assert_eq!(got[1], ["status", "begin 15"]);
        assert_eq!(got[2], ["status", "begin 15"]);
        assert_eq!(got[3], ["status"]);
    }

    #[test]
    fn the_same_after_a_rollback() {
        let got = queueing("rollback");
        assert_eq!(got[0], ["status", "begin 13", "truncate", "rollback", "begin 15"]);
        assert_eq!(got[1], ["status", "begin 15"]);
        assert_eq!(got[3], ["status"]);
    }

    #[tokio::test]
    async fn broadcast_releases_on_consensus_and_marks_the_late_one() {
        let subs: Vec<_> = (0..3).map(|_| sub("00")).collect();
        let targets: Vec<_> = subs.iter().map(|(s, _)| (s.clone(), s.enqueued())).collect();
        // Two of three consume their status message; the third never does.
        for (s, _) in &subs[..2] {
            s.consumed(0, None);
        }
        let release = broadcast(targets, 2.0).await;
        assert_eq!(release, Release::ConsensusTimeout);
        assert!(!subs[0].0.missed_last_timeout());
        assert!(subs[2].0.missed_last_timeout());
    }

    #[tokio::test]
    async fn broadcast_waits_for_all_without_early_release() {
        let subs: Vec<_> = (0..3).map(|_| sub("00")).collect();
        let targets: Vec<_> = subs.iter().map(|(s, _)| (s.clone(), s.enqueued())).collect();
        for (s, _) in &subs[..2] {
            s.consumed(0, None);
        }
        let late = subs[2].0.clone();
        let wait = tokio::spawn(broadcast(targets, -1.0));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!wait.is_finished(), "still waiting for the third");
        late.consumed(0, None);
        assert_eq!(wait.await.unwrap(), Release::AllSubscribers);
    }

    #[test]
    fn a_lagging_subscriber_is_closed_after_the_grace_period() {
        let (healthy, _c1) = sub("00");
        let (laggard, mut c2) = sub("00");
        let mut f = Forwarder::default();
        f.add(healthy.clone());
        f.add(laggard.clone());
        let t0 = Instant::now();
        let grace = Some(Duration::from_secs(1));
        // Every half second the healthy one processes 10 messages, the laggard
        // one, and the laggard misses the flow-control timeout. Its lagging
        // clock starts at the first report (t0 + 1 s), as in Zero's test.
        let step = |ms: u64| {
            for _ in 0..10 {
                healthy.consumed(0, None);
            }
            laggard.consumed(0, None);
            laggard.track_response(false, laggard.enqueued());
            f.check_laggards(t0 + Duration::from_millis(ms), grace);
        };
        for ms in [1000, 1500] {
            step(ms);
            assert!(!laggard.is_closed(), "at {ms} ms it has lagged less than the grace period");
        }
        step(2000);
        assert!(laggard.is_closed());
        assert!(!healthy.is_closed());
        let last = std::iter::from_fn(|| c2.frames.try_recv()).last();
        assert!(
            matches!(last, Some(Frame::Error(e)) if e.contains("\"type\":3") && e.contains("lagging for over 1000ms"))
        );
    }
}
