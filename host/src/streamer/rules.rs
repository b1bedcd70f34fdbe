//! The replication loop's rules, tested beside the loop on the in-memory
//! log with a scripted source: what a source may send and in what order,
//! and what the loop stores, stops for or skips. (`tests/core.rs` keeps the
//! cases that need a real store or a real plugin.)

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{Streamer, StreamerOptions};
use crate::hub::Hub;
use crate::source::scripted::{begin, commit, insert, relation, Scripted};
use crate::status::Status;
use crate::storage::memory::{MemoryChangeLog, MemoryProbe};

/// A loop over `source` and an empty in-memory log.
struct Running {
    log: MemoryProbe,
    status: Arc<Status>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

fn run(source: Scripted) -> Running {
    let log = MemoryChangeLog::default();
    let probe = log.probe();
    let status = Arc::new(Status::default());
    let hub = Hub::new(log.reader(), status.clone());
    let mut streamer = Streamer::new(Box::new(source), Box::new(log), hub, StreamerOptions::default(), status.clone());
    streamer.seed_hub();
    let (stop, stop_rx) = watch::channel(false);
    Running { log: probe, status, stop, task: tokio::spawn(streamer.run(stop_rx)) }
}

impl Running {
    /// How the loop ended by itself.
    async fn ended(self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(20), self.task).await.expect("the loop ends").expect("no panic")
    }

    /// Waits for `watermark` to be durable, then stops the loop.
    async fn stop_at(self, watermark: &str) -> MemoryProbe {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self.status.snapshot().last_watermark.as_deref() != Some(watermark) {
            assert!(tokio::time::Instant::now() < deadline, "{watermark} never became durable");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = self.stop.send(true);
        self.task.await.expect("no panic").expect("a clean stop");
        self.log
    }
}

/// The commit watermarks of the stored transactions, past the lineage's seed.
fn committed(log: &MemoryProbe) -> Vec<String> {
    let rv = log.lineage().map(|(rv, _, _)| rv).unwrap_or_default();
    log.rows().into_iter().filter(|(w, _, tag)| tag == "commit" && *w != rv).map(|(w, _, _)| w).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_change_before_its_begin_stops_the_loop_and_stores_nothing() {
    let running = run(Scripted::new(vec![("01", vec![relation(), insert(1)])]));
    let log = running.log.clone();
    let err = running.ended().await.unwrap_err().to_string();
    assert_eq!(err, "data change (insert) received before 'begin' message");
    assert!(log.rows().is_empty(), "no lineage is recorded before its first transaction is durable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_watermark_unlike_its_begins_stops_the_loop() {
    let running = run(Scripted::new(vec![("01", vec![relation(), begin("0b"), insert(1), commit("0c")])]));
    let log = running.log.clone();
    let err = running.ended().await.unwrap_err().to_string();
    assert_eq!(err, "commit watermark 0c does not match 'begin' watermark 0b");
    assert!(log.rows().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_a_resumed_upstream_replays_are_skipped_not_stored_twice() {
    let source = Scripted::new(vec![
        ("01", vec![relation(), begin("05"), insert(1), commit("05"), Err("the stream drops".into())]),
        // A sloppy upstream replays 05 after resuming from it.
        ("01", vec![relation(), begin("05"), insert(1), commit("05"), begin("07"), insert(2), commit("07")]),
    ]);
    let log = run(source.clone()).stop_at("07").await;
    assert_eq!(committed(&log), ["05", "07"]);
    assert_eq!(source.opens()[..2], [None, Some("05".to_string())], "the second open resumed at 05");
    let inserts = log.rows().into_iter().filter(|(_, _, tag)| tag == "insert").count();
    assert_eq!(inserts, 2, "one insert per transaction, none replayed");
}
