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
        }
        if let Some(last) = rows.last() {
            cursor = Some((last.watermark.clone(), last.pos));
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
