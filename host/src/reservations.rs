//! Positions in the change log held for consumers between connections.
//!
//! A connected subscriber holds the purge floor with its ack. A zero-cache
//! that takes Sluice as its upstream is not always connected: it closes the
//! initial-sync connection and opens a streaming one, and it restarts on
//! deploys. Each of its connections therefore holds a reservation at its
//! position (the initial sync's watermark, then its acks), and the
//! reservation outlives the connection by the retention period, so a
//! consumer that comes back within it finds the log where it left it.
//!
//! A change-streamer subscriber (a replica) that disconnects leaves its last
//! ack here for a shorter while (`--subscriber-retention-secs`), so a purge
//! that runs while it reconnects (after a dropped link or a restart) does
//! not delete what it still needs and force it to sync again. Zero gets the
//! same from purging 30 s after the backup watermark it purges to.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a consumer's position is kept after it disconnects, unless
/// configured otherwise.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(600);

/// How long a disconnected subscriber's last ack is kept, unless configured
/// otherwise: longer than a replica's reconnect backoff (Zero's is at most
/// 10 s), as Zero's own purge delay is.
pub const DEFAULT_SUBSCRIBER_RETENTION: Duration = Duration::from_secs(30);

/// How long positions are held after their holders disconnect.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// A zero-cache consumer of the custom upstream.
    pub consumer: Duration,
    /// A change-streamer subscriber.
    pub subscriber: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { consumer: DEFAULT_RETENTION, subscriber: DEFAULT_SUBSCRIBER_RETENTION }
    }
}

pub struct Reservations {
    table: Mutex<Table>,
    next_id: AtomicU64,
    retention: Duration,
}

#[derive(Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    /// The entry each departed subscriber keeps: one per subscriber, its
    /// latest position, however often it reconnects.
    departed: HashMap<String, u64>,
}

struct Entry {
    /// Who holds it (for `/status` and logs), e.g. `zero-cache zero_0 @ 0a`.
    holder: String,
    watermark: Arc<str>,
    released_at: Option<Instant>,
    /// How long it is kept once released.
    keep: Duration,
}

/// One connection's reservation; released (and kept for the retention
/// period) when dropped.
pub struct Reservation {
    owner: Arc<Reservations>,
    id: u64,
}

impl Reservations {
    pub fn new(retention: Duration) -> Arc<Reservations> {
        Arc::new(Reservations { table: Mutex::default(), next_id: AtomicU64::new(0), retention })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds the log from `watermark` on for `holder`. Released
    /// reservations of the same holder at or below `watermark` are
    /// superseded: the holder came back and holds its position again.
    pub fn reserve(self: &Arc<Self>, holder: &str, watermark: &str) -> Reservation {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut table = self.lock();
        let entries = &mut table.entries;
        entries.retain(|_, e| !(e.holder == holder && e.released_at.is_some() && *e.watermark <= *watermark));
        let entry = Entry {
            holder: holder.to_string(),
            watermark: Arc::from(watermark),
            released_at: None,
            keep: self.retention,
        };
        entries.insert(id, entry);
        Reservation { owner: self.clone(), id }
    }

    /// Holds the log from `watermark` on for `keep` from now, for `holder`
    /// that has just disconnected (in place of what it kept when it last
    /// disconnected: it came back since, and left from `watermark`).
    pub fn keep_released(&self, holder: &str, watermark: &str, keep: Duration) {
        if keep.is_zero() {
            return;
        }
        let mut table = self.lock();
        let id = match table.departed.get(holder) {
            Some(id) if table.entries.contains_key(id) => *id,
            _ => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                table.departed.insert(holder.to_string(), id);
                id
            }
        };
        let entry = Entry {
            holder: holder.to_string(),
            watermark: Arc::from(watermark),
            released_at: Some(Instant::now()),
            keep,
        };
        table.entries.insert(id, entry);
    }

    /// The lowest reserved watermark, dropping reservations released longer
    /// than the retention period ago.
    pub fn floor(&self) -> Option<Arc<str>> {
        let now = Instant::now();
        let mut table = self.lock();
        let Table { entries, departed } = &mut *table;
        entries.retain(|_, e| e.released_at.is_none_or(|at| now.duration_since(at) < e.keep));
        departed.retain(|_, id| entries.contains_key(id));
        entries.values().map(|e| e.watermark.clone()).min()
    }

    /// Reservations held now: (holder, watermark, connected).
    pub fn list(&self) -> Vec<(String, String, bool)> {
        let _ = self.floor();
        let mut out: Vec<_> = self
            .lock()
            .entries
            .values()
            .map(|e| (e.holder.clone(), e.watermark.to_string(), e.released_at.is_none()))
            .collect();
        out.sort();
        out
    }
}

impl Reservation {
    /// The holder has what precedes `watermark` durably: hold from there.
    pub fn advance(&self, watermark: &str) {
        if let Some(e) = self.owner.lock().entries.get_mut(&self.id) {
            if *e.watermark < *watermark {
                e.watermark = Arc::from(watermark);
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(e) = self.owner.lock().entries.get_mut(&self.id) {
            e.released_at = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_holds_until_its_retention_ends() {
        let r = Reservations::new(Duration::from_millis(200));
        assert_eq!(r.floor(), None);
        let a = r.reserve("a", "05");
        let b = r.reserve("b", "03");
        assert_eq!(r.floor().as_deref(), Some("03"));
        b.advance("07");
        b.advance("06"); // never back
        assert_eq!(r.floor().as_deref(), Some("05"));
        drop(a);
        // Released, but kept.
        assert_eq!(r.floor().as_deref(), Some("05"));
        assert_eq!(r.list(), [("a".into(), "05".into(), false), ("b".into(), "07".into(), true)]);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(r.floor().as_deref(), Some("07"));
    }

    #[test]
    fn a_holder_that_comes_back_supersedes_its_released_reservation() {
        let r = Reservations::new(Duration::from_secs(60));
        drop(r.reserve("zc", "03"));
        drop(r.reserve("other", "02"));
        let again = r.reserve("zc", "04");
        assert_eq!(r.list().len(), 2);
        drop(r.reserve("other-lower", "01"));
        assert_eq!(r.floor().as_deref(), Some("01"));
        drop(again);
    }

    #[test]
    fn a_departed_subscribers_position_is_kept_for_its_own_while() {
        let r = Reservations::new(Duration::from_secs(60));
        let held = r.reserve("zc", "05");
        r.keep_released("subscriber a", "03", Duration::from_millis(200));
        r.keep_released("subscriber b", "02", Duration::ZERO);
        assert_eq!(r.floor().as_deref(), Some("03"));
        assert_eq!(r.list(), [("subscriber a".into(), "03".into(), false), ("zc".into(), "05".into(), true)]);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(r.floor().as_deref(), Some("05"));
        drop(held);
    }

    #[test]
    fn a_subscriber_that_keeps_reconnecting_keeps_one_position_its_latest() {
        let r = Reservations::new(Duration::from_secs(60));
        for w in ["03", "04", "06"] {
            r.keep_released("subscriber a", w, Duration::from_secs(30));
        }
        r.keep_released("subscriber b", "05", Duration::from_secs(30));
        assert_eq!(
            r.list(),
            [("subscriber a".into(), "06".into(), false), ("subscriber b".into(), "05".into(), false)]
        );
        assert_eq!(r.floor().as_deref(), Some("05"));
    }
}
