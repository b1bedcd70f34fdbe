//! Catch-up: replaying the change log to one subscriber from a snapshot.
//!
//! Rows are read in bounded batches from one consistent snapshot; the next
//! batch is read only once the subscriber has consumed enough, so at most
//! about two batches per subscriber are in memory.

use std::sync::Arc;

use crate::change::Change;
use crate::storage::{LogReader, LogSnapshot};
use crate::subscriber::{Entry, ErrorType, Subscriber};

/// Rows per read.
pub const CATCHUP_READ_ROWS: usize = 1000;
/// Read the next batch once fewer bytes than this are unconsumed. Each
/// catching-up subscriber holds its own replayed frames, so this is paid per
/// subscriber: 100 of them behind a fast source held 290 MB at 4 MiB and
/// 2000-row batches, 85 MB now, while one replays as fast (350-450k changes/s).
const WINDOW_BYTES: usize = 1 << 20;

/// Pins a snapshot of the log now (blocking) and catches `sub` up from it; if
/// the log cannot be read, the subscriber is closed cleanly and retries.
/// Rows sent from the change log to catching-up subscribers, process-wide
/// (`sluice_catchup_changes_total`; its rate is the catch-up throughput).
pub static CHANGES_SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn pin_and_start(reader: &dyn LogReader, sub: Arc<Subscriber>, replica_version: String) {
    match reader.snapshot() {
        Ok(snapshot) => start(snapshot, sub, replica_version),
        Err(e) => {
            tracing::warn!(subscriber = %sub.id, "cannot read the change log for catch-up: {e:#}");
            sub.close(None);
        }
    }
}

/// Starts catching `sub` up from `snapshot` on the runtime.
fn start(snapshot: Box<dyn LogSnapshot>, sub: Arc<Subscriber>, replica_version: String) {
    tokio::spawn(async move {
        if let Err(e) = run(snapshot, sub.clone(), replica_version).await {
            tracing::warn!(subscriber = %sub.id, "catch-up failed: {e:#}");
            // A clean close: the subscriber reconnects and tries again.
            sub.close(None);
        }
    });
}

async fn run(mut snapshot: Box<dyn LogSnapshot>, sub: Arc<Subscriber>, replica_version: String) -> anyhow::Result<()> {
    let start = sub.start.clone();
    // A subscriber at the replica version is new: there is no row to match.
    let mut found = start == replica_version;
    let mut cursor: Option<(String, i64)> = None;
    let mut sent = 0u64;
    loop {
        let from = start.clone();
        let after = cursor.clone();
        let (snap, rows) = tokio::task::spawn_blocking(move || {
            let rows = snapshot.read(&from, after.as_ref().map(|(w, p)| (w.as_str(), *p)), CATCHUP_READ_ROWS);
            (snapshot, rows)
        })
        .await?;
        snapshot = snap;
        let rows = rows?;
        let full = rows.len() == CATCHUP_READ_ROWS;
        for row in &rows {
            if row.watermark == start {
                found = true;
                continue;
            }
            if !found {
                sub.close(Some((
                    ErrorType::WatermarkTooOld,
                    format!("earliest supported watermark is {} (requested {start})", row.watermark),
                )));
                return Ok(());
            }
            let watermark: Arc<str> = row.watermark.as_str().into();
            sub.catchup(&Entry { change: Change::from_stored(&row.tag, &row.change, &row.watermark), watermark });
            sent += 1;
            CHANGES_SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(last) = rows.last() {
            // The subscriber holds the whole transaction at `start`: jump
            // past the rest of it instead of reading it row by row (a
            // snapshot's transaction holds every row of the upstream; 1M
            // rows took 25 s to skip).
            let pos = if last.watermark == start { i64::MAX } else { last.pos };
            cursor = Some((last.watermark.clone(), pos));
        }
        if !full || sub.is_closed() {
            break;
        }
        sub.wait_pending_below(WINDOW_BYTES).await;
    }
    if !found && start.as_str() > snapshot.last_watermark() {
        // Forwarding runs ahead of storage, so a subscriber can be ahead of
        // the log; it dedups the live changes it already has.
        tracing::info!(subscriber = %sub.id, "subscriber at {start} is ahead of the change log ({})", snapshot.last_watermark());
    }
    tracing::debug!(subscriber = %sub.id, sent, "caught up");
    sub.set_caught_up();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::storage::memory::MemoryChangeLog;
    use crate::storage::{ChangeLog, LogRow, StoredRow};
    use crate::subscriber::{Frame, Limits, Mode};

    /// A snapshot that counts the rows it hands out.
    struct Counting(Box<dyn LogSnapshot>, Arc<AtomicUsize>);

    impl LogSnapshot for Counting {
        fn last_watermark(&self) -> &str {
            self.0.last_watermark()
        }
        fn read(&mut self, from: &str, after: Option<(&str, i64)>, limit: usize) -> anyhow::Result<Vec<StoredRow>> {
            let rows = self.0.read(from, after, limit)?;
            self.1.fetch_add(rows.len(), Ordering::Relaxed);
            Ok(rows)
        }
    }

    fn commit(log: &mut MemoryChangeLog, watermark: &str, inserts: i64) {
        let inserted: Vec<String> =
            (1..=inserts).map(|i| format!(r#"{{"tag":"insert","new":{{"id":{i}}}}}"#)).collect();
        let row = |pos, tag, change| LogRow { watermark, pos, tag, change, precommit: None };
        let mut rows = vec![row(0, "begin", r#"{"tag":"begin"}"#)];
        rows.extend(inserted.iter().zip(1..).map(|(change, i)| row(i, "insert", change)));
        rows.push(LogRow { precommit: Some(watermark), ..row(inserts + 1, "commit", r#"{"tag":"commit"}"#) });
        log.begin().unwrap();
        log.append(&rows).unwrap();
        log.commit(watermark).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_transaction_a_subscriber_holds_is_skipped_not_read() {
        // A snapshot transaction of 20,000 rows at 01, then one row at 02.
        let mut log = MemoryChangeLog::default();
        log.reset("00").unwrap();
        commit(&mut log, "01", 20_000);
        commit(&mut log, "02", 1);
        let read = Arc::new(AtomicUsize::new(0));
        let snapshot = Box::new(Counting(log.reader().snapshot().unwrap(), read.clone()));
        let (sub, mut conn) = Subscriber::new("s".into(), "t".into(), Mode::Serving, 6, "01".into(), Limits::default());
        start(snapshot, sub, "00".into());
        let mut got = Vec::new();
        while got.len() < 3 {
            match tokio::time::timeout(Duration::from_secs(10), conn.frames.recv()).await {
                Ok(Some(Frame::Message { json, .. })) if !json.starts_with("[\"status\"") => got.push(json.to_string()),
                Ok(Some(Frame::Message { .. })) => {}
                other => panic!("expected transaction 02, got {other:?}"),
            }
        }
        assert!(got[0].contains("begin") && got[1].contains(r#""id":1"#) && got[2].contains("commit"), "{got:?}");
        // The first batch found 01; the rest of 01 was jumped over.
        let n = read.load(Ordering::Relaxed);
        assert!(n <= CATCHUP_READ_ROWS + 3, "read {n} rows to catch up one transaction");
    }
}
