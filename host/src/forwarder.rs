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

    pub fn remove(&mut self, sub: &Arc<Subscriber>) {
        self.active.retain(|s| !Arc::ptr_eq(s, sub));
        self.queued.retain(|s| !Arc::ptr_eq(s, sub));
    }

    pub fn forward(&mut self, entry: &Entry) {
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

    /// What a flow-control wait waits for: each active subscriber and the
    /// number of messages it must have consumed.
    pub fn broadcast_targets(&self) -> Vec<(Arc<Subscriber>, u64)> {
        self.active.iter().filter(|s| !s.is_closed()).map(|s| (s.clone(), s.enqueued())).collect()
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

/// Waits for the targets: all of them, or a majority plus
/// `elapsed × proportion` (negative proportion: wait for all).
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
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, waits.next()).await {
                Ok(n) => n,
                Err(_) => {
                    for (i, (s, _)) in targets.iter().enumerate() {
                        s.track_response(done[i]);
                    }
                    return Release::ConsensusTimeout;
                }
            },
            None => waits.next().await,
        };
        let Some(i) = next else { break };
        done[i] = true;
        completed += 1;
        if completed >= majority && deadline.is_none() && proportion >= 0.0 && completed < targets.len() {
            let grace = Duration::from_secs_f64((start.elapsed().as_secs_f64() * proportion).max(0.001));
            deadline = Some(tokio::time::Instant::now() + grace);
        }
    }
    for (s, _) in &targets {
        s.track_response(true);
    }
    Release::AllSubscribers
}
