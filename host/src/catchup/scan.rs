//! One shared scan of the change log: read a batch, encode it once, hand it
//! to every member past its own position, then wait for the members.
//!
//! A member that falls behind the others leaves the scan (it keeps its
//! position) and rejoins [`Catchups`] once it has room again, so one slow
//! subscriber does not hold the rest.

use std::cmp::Ordering as Cmp;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};

use super::{Catchups, CATCHUP_READ_ROWS};
use crate::change::Change;
use crate::storage::{LogSnapshot, StoredRow};
use crate::subscriber::{Entry, ErrorType, Subscriber};

/// A place in the log: a transaction's commit watermark and a row position
/// in it; `i64::MAX` stands for the whole transaction.
type Position = (Arc<str>, i64);

fn cmp(a: (&str, i64), b: &Position) -> Cmp {
    a.cmp(&(&*b.0, b.1))
}

/// How long a scan whose members all lack room waits before letting them
/// all go (which releases its snapshot); each rejoins once it has room.
const STALL: Duration = Duration::from_secs(5);
/// The least time members that lack room get once another has room.
const MIN_GRACE: Duration = Duration::from_millis(250);

/// A subscriber in a scan.
pub(super) struct Member {
    pub sub: Arc<Subscriber>,
    /// Where its catch-up starts ([`Subscriber::catchup_from`]).
    from: Arc<str>,
    replica_version: String,
    /// Every row up to here was handed over, or the subscriber holds it.
    at: Position,
    /// The row at the subscriber's start was seen (or it starts at the
    /// replica version, which has no row to match).
    found: bool,
    /// The [`Catchups::start`] call that brought it.
    epoch: u64,
}

impl Member {
    pub fn new(sub: Arc<Subscriber>, replica_version: &str, epoch: u64) -> Member {
        let from = sub.catchup_from();
        let at = (from.clone(), i64::MAX);
        Member { found: *from == *replica_version, at, from, replica_version: replica_version.to_string(), sub, epoch }
    }

    /// Hands over the rows of a batch that lie after this member's
    /// position, adding how many to `sent` first (so the count never trails
    /// what the subscriber may already have received).
    fn take(&mut self, rows: &[StoredRow], entries: &[Entry], sent: &AtomicU64) {
        let mut first = None;
        for (i, row) in rows.iter().enumerate() {
            if !self.found {
                match row.watermark.as_str().cmp(&self.from) {
                    Cmp::Less => continue,
                    Cmp::Equal => self.found = true,
                    Cmp::Greater => {
                        self.sub.close(Some((
                            ErrorType::WatermarkTooOld,
                            format!("earliest supported watermark is {} (requested {})", row.watermark, self.from),
                        )));
                        return;
                    }
                }
            }
            if cmp((&row.watermark, row.pos), &self.at) == Cmp::Greater {
                first = Some(i);
                break;
            }
        }
        if let (Some(last), Some(entry)) = (rows.last(), entries.last()) {
            if cmp((&last.watermark, last.pos), &self.at) == Cmp::Greater {
                self.at = (entry.watermark.clone(), last.pos);
            }
        }
        let Some(i) = first else { return };
        sent.fetch_add((entries.len() - i) as u64, Ordering::Relaxed);
        self.sub.catchup_many(&entries[i..]);
    }

    /// The snapshot ended and holds everything this member needs. Returns
    /// it when it must catch up again (its live backlog overflowed).
    fn caught_up(self, last_watermark: &str) -> Option<(Arc<Subscriber>, String)> {
        if !self.found && *self.from > *last_watermark {
            // Forwarding runs ahead of storage, so a subscriber can be ahead
            // of the log; it dedups the live changes it already has.
            tracing::info!(subscriber = %self.sub.id, "subscriber at {} is ahead of the change log ({last_watermark})", self.from);
        }
        tracing::debug!(subscriber = %self.sub.id, "caught up");
        (!self.sub.set_caught_up()).then_some((self.sub, self.replica_version))
    }
}

pub(super) struct Scan {
    state: Mutex<ScanState>,
}

/// Encodes rows once for every member; rows of a transaction share one
/// watermark.
fn encode(rows: &[StoredRow]) -> Vec<Entry> {
    let mut watermark: Arc<str> = Arc::from("");
    rows.iter()
        .map(|row| {
            if *watermark != *row.watermark {
                watermark = row.watermark.as_str().into();
            }
            Entry { watermark: watermark.clone(), change: Change::from_stored(&row.tag, &row.change, &row.watermark) }
        })
        .collect()
}

struct ScanState {
    /// Rows from this watermark on are read.
    from: Arc<str>,
    /// The last row read (or skipped over).
    cursor: Option<Position>,
    members: Vec<Member>,
    /// Ended: it takes no one any more.
    done: bool,
    /// Waiting for members to make room: a newcomer would wait with them
    /// (up to [`STALL`]) for rows it may be far from needing, so it is not
    /// admitted and starts or joins a scan that is moving.
    waiting: bool,
}

/// How a batch ended.
enum Batch {
    More,
    /// The snapshot is read; members that joined after it was pinned remain.
    EndOfSnapshot,
    Done,
}

impl ScanState {
    /// Where the next read starts: after the cursor, or further on when every
    /// member already holds more (a subscriber at a snapshot's transaction
    /// needs none of its rows; 1M rows took 25 s to skip one by one).
    fn next_read(&mut self) -> (Arc<str>, Option<Position>) {
        // From the first read on, `from` is fixed: a subscriber below it can
        // no longer join (the read in flight would pass its rows by).
        // Position -1 is before every row of `from`.
        let mut after = Some(self.cursor.get_or_insert_with(|| (self.from.clone(), -1)).clone());
        if self.members.iter().all(|m| m.found) {
            let lowest = self.members.iter().map(|m| &m.at).min_by(|a, b| cmp((&a.0, a.1), b));
            if let Some(lowest) = lowest {
                if after.as_ref().is_none_or(|a| cmp((&a.0, a.1), lowest) == Cmp::Less) {
                    after = Some(lowest.clone());
                    // Skipped over: a subscriber that needs those rows must
                    // not join while the read is in flight (it would get
                    // only what comes after them).
                    self.cursor = after.clone();
                }
            }
        }
        (self.from.clone(), after)
    }
}

impl Scan {
    pub fn new(first: Member) -> Arc<Scan> {
        let from = first.at.0.clone();
        Arc::new(Scan {
            state: Mutex::new(ScanState { from, cursor: None, members: vec![first], done: false, waiting: false }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, ScanState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_done(&self) -> bool {
        self.lock().done
    }

    pub fn is_waiting(&self) -> bool {
        self.lock().waiting
    }

    pub fn members(&self) -> usize {
        self.lock().members.len()
    }

    /// Takes `member` if this scan has not yet passed its position; gives it
    /// back otherwise.
    pub fn admit(&self, mut member: Member) -> Option<Member> {
        let mut st = self.lock();
        if st.done || st.waiting {
            return Some(member);
        }
        match &st.cursor {
            None => {
                if member.at.0 < st.from {
                    st.from = member.at.0.clone();
                }
            }
            Some(cursor) => {
                if cmp((&cursor.0, cursor.1), &member.at) == Cmp::Greater {
                    return Some(member);
                }
                // The scan has read rows of the member's start: it is in the log.
                if *cursor.0 == *member.from && cursor.1 >= 0 {
                    member.found = true;
                }
            }
        }
        st.members.push(member);
        None
    }

    /// Reads the next batch and hands it to the members. `pinned` is the
    /// epoch the snapshot covers.
    fn read_and_hand_out(
        &self,
        snapshot: &mut dyn LogSnapshot,
        pinned: u64,
        catchups: &Catchups,
    ) -> anyhow::Result<Batch> {
        let counters = &catchups.counters;
        let (from, after) = {
            let mut st = self.lock();
            if st.members.is_empty() {
                st.done = true;
                return Ok(Batch::Done);
            }
            st.next_read()
        };
        let rows = snapshot.read(&from, after.as_ref().map(|(w, p)| (&**w, *p)), CATCHUP_READ_ROWS)?;
        counters.read.fetch_add(rows.len() as u64, Ordering::Relaxed);
        // Encoded once for every member.
        let entries = encode(&rows);
        // The hand-out runs without the lock (it can take a while with many
        // members; the storer must not wait for it to admit a subscriber).
        // The cursor moves first: whoever joins meanwhile needs only later rows.
        let mut members = {
            let mut st = self.lock();
            st.cursor = match rows.last() {
                Some(last) => Some((last.watermark.as_str().into(), last.pos)),
                None => after.or(st.cursor.take()),
            };
            std::mem::take(&mut st.members)
        };
        for m in &mut members {
            m.take(&rows, &entries, &counters.sent);
        }
        members.retain(|m| !m.sub.is_closed());
        let mut st = self.lock();
        members.append(&mut st.members);
        st.members = members;
        if rows.len() == CATCHUP_READ_ROWS {
            if st.members.is_empty() {
                st.done = true;
                return Ok(Batch::Done);
            }
            return Ok(Batch::More);
        }
        // The end of this snapshot: the members it covers are caught up
        // (outside the scan's lock: one that must catch up again goes back
        // through the hub, whose lock comes first).
        let finished: Vec<Member> = st.members.extract_if(.., |m| m.epoch <= pinned).collect();
        let batch = if st.members.is_empty() {
            st.done = true;
            Batch::Done
        } else {
            Batch::EndOfSnapshot
        };
        drop(st);
        let last = snapshot.last_watermark();
        let again: Vec<_> = finished.into_iter().filter_map(|m| m.caught_up(last)).collect();
        catchups.again(again);
        Ok(batch)
    }

    /// Ends the scan (it failed): its members, to be closed.
    fn end(&self) -> Vec<Member> {
        let mut st = self.lock();
        st.done = true;
        std::mem::take(&mut st.members)
    }

    /// Takes out the members `slow` picks.
    fn detach(&self, slow: impl Fn(&Subscriber) -> bool) -> Vec<Member> {
        let mut st = self.lock();
        st.members.extract_if(.., |m| slow(&m.sub)).collect()
    }

    fn subscribers(&self) -> Vec<Arc<Subscriber>> {
        self.lock().members.iter().map(|m| m.sub.clone()).collect()
    }

    fn set_waiting(&self, waiting: bool) {
        self.lock().waiting = waiting;
    }
}

impl Catchups {
    /// Runs one scan until it has no members left.
    pub(super) async fn run(self: Arc<Self>, scan: Arc<Scan>) {
        // A trace of its own (traces on only): the scan and each batch read.
        let span =
            tracing::debug_span!(target: crate::telemetry::TARGET, "sluice.catchup.scan", subscribers = scan.members());
        if let Err(e) = tracing::Instrument::instrument(self.run_scan(&scan), span).await {
            tracing::warn!("catch-up failed, closing its subscribers so they retry: {e:#}");
            for m in scan.end() {
                m.sub.close(None);
            }
        }
    }

    async fn run_scan(self: &Arc<Self>, scan: &Arc<Scan>) -> anyhow::Result<()> {
        loop {
            let mut permit = Some(self.permits.clone().acquire_owned().await?);
            let pinned = self.epoch();
            let reader = self.reader.clone();
            let mut snapshot = tokio::task::spawn_blocking(move || reader.snapshot()).await??;
            self.counters.scans.fetch_add(1, Ordering::Relaxed);
            loop {
                let held = match permit.take() {
                    Some(p) => p,
                    None => self.permits.clone().acquire_owned().await?,
                };
                let (shared, catchups) = (scan.clone(), self.clone());
                let read = tracing::debug_span!(target: crate::telemetry::TARGET, "sluice.catchup.read");
                let (snap, batch) = tokio::task::spawn_blocking(move || {
                    let _read = read.enter();
                    let batch = shared.read_and_hand_out(snapshot.as_mut(), pinned, &catchups);
                    (snapshot, batch)
                })
                .await?;
                snapshot = snap;
                drop(held);
                match batch? {
                    Batch::More => self.pace(scan).await,
                    Batch::EndOfSnapshot => break,
                    Batch::Done => return Ok(()),
                }
            }
        }
    }

    /// Waits until the members have room for another batch. Once one has,
    /// the others get a grace in proportion to the wait (as Zero's flow
    /// control does); those still without room then leave the scan and
    /// rejoin on their own once they have it.
    async fn pace(self: &Arc<Self>, scan: &Arc<Scan>) {
        let has_room = |s: &Subscriber| s.is_closed() || s.pending_bytes() < self.window(s);
        let members = scan.subscribers();
        let mut waits: FuturesUnordered<_> = members
            .iter()
            .filter(|s| !has_room(s))
            .map(|s| {
                let (s, window) = (s.clone(), self.window(s));
                async move { s.wait_pending_below(window).await }
            })
            .collect();
        if waits.is_empty() {
            return;
        }
        scan.set_waiting(true);
        let started = Instant::now();
        let stalled = waits.len() == members.len() && tokio::time::timeout(STALL, waits.next()).await.is_err();
        if !stalled {
            let grace = (started.elapsed() * 2).max(MIN_GRACE);
            let _ = tokio::time::timeout(grace, async { while waits.next().await.is_some() {} }).await;
        }
        self.detach_slow(scan);
        scan.set_waiting(false);
    }

    fn detach_slow(self: &Arc<Self>, scan: &Scan) {
        for member in scan.detach(|s| !s.is_closed() && s.pending_bytes() >= self.window(s)) {
            let catchups = self.clone();
            tokio::spawn(async move {
                let window = catchups.window(&member.sub);
                member.sub.wait_pending_below(window).await;
                catchups.rejoin(member);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subscriber::{Limits, Mode};

    fn member(start: &str, at: (&str, i64)) -> Member {
        let (sub, _) = Subscriber::new(start.into(), String::new(), Mode::Serving, 6, start.into(), Limits::default());
        Member { sub, from: start.into(), replica_version: "00".into(), at: (at.0.into(), at.1), found: true, epoch: 1 }
    }

    #[test]
    fn a_subscriber_needing_rows_a_read_skips_over_does_not_join_during_it() {
        // The scan has read up to row 7 of 02; its only member holds
        // everything up to row 4 of 09, so the next read starts there.
        let scan = Scan::new(member("09", ("09", 4)));
        scan.lock().cursor = Some(("02".into(), 7));
        let (_, after) = scan.lock().next_read();
        assert_eq!(after, Some(("09".into(), 4)));
        // One at 05 needs rows of 03 to 09 that this read passes by.
        assert!(scan.admit(member("05", ("05", i64::MAX))).is_some(), "it must catch up elsewhere");
        assert!(scan.admit(member("09", ("09", 6))).is_none(), "one past the skipped rows can join");
    }
}
