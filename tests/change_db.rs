//! The Postgres change DB: Zero's schema, single-owner handoff, purge rules,
//! dropped tables, lost connections and the wedge watchdog (§8.1 and §8.3).

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::feed::*;
use common::*;
use serde_json::json;
use sluice::plugin::SandboxLimits;
use sluice::storage::LogError;
use sluice::storer::StorerOptions;
use sluice::streamer::StreamerOptions;

const WAIT: Duration = Duration::from_secs(60);

fn options() -> StreamerOptions {
    StreamerOptions {
        task_id: "task-id".into(),
        advertise: "change.streamer:12345".into(),
        ..StreamerOptions::default()
    }
}

async fn stored(h: &Harness, w: &str) {
    let st = h.status.clone();
    wait_until(&format!("{w} stored"), WAIT, || {
        let s = st.snapshot();
        async move { s.last_watermark.as_deref() == Some(w) }
    })
    .await;
}

fn pg_spec(dir: &tempfile::TempDir) -> LogSpec {
    LogSpec::with_task(Backend::Postgres, dir.path(), "task-id")
}

/// A streamer as task "task-id" on a fed source, over a fresh Postgres log.
async fn fed_harness() -> (tempfile::TempDir, LogSpec, Feed, Harness) {
    let dir = tempfile::tempdir().unwrap();
    let spec = pg_spec(&dir);
    let feed = Feed::default();
    let h = start(&spec, Box::new(feed.clone()), options()).await;
    (dir, spec, feed, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uses_zeros_schema_and_records_the_owner() {
    let (_dir, spec, feed, h) = fed_harness().await;
    feed.tx("09", &[1, 2]);
    stored(&h, "09").await;
    let c = spec.pg_client().await;
    let s = spec.schema();
    assert!(s.ends_with("_0/cdc\""), "{s}");
    let row = c
        .query_one(&format!(r#"SELECT "owner", "ownerAddress", "lastWatermark" FROM {s}."replicationState""#), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("task-id"));
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("change.streamer:12345"));
    assert_eq!(row.get::<_, String>(2), "09");
    let ty: String = c
        .query_one(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'changeLog' AND column_name = 'change'",
            &[&s.trim_matches('"')],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ty, "json", "change is JSON, not JSONB");
    let v: (i32, i32, i32) = {
        let r = c
            .query_one(
                &format!(r#"SELECT "dataVersion", "schemaVersion", "minSafeVersion" FROM {s}."versionHistory""#),
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(v, (6, 6, 1));
    let tags: Vec<(String, i64, String)> = spec.rows().await.into_iter().map(|r| (r.watermark, r.pos, r.tag)).collect();
    assert_eq!(tags[..2], [("01".into(), 0, "begin".into()), ("01".into(), 1, "commit".into())], "seed rows");
    h.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_before_a_transaction_stops_the_old_owner_without_writing() {
    let (_dir, spec, feed, mut h) = fed_harness().await;
    feed.tx("0d", &[1]);
    stored(&h, "0d").await;
    let c = spec.pg_client().await;
    let s = spec.schema();
    c.execute(
        &format!(
            r#"UPDATE {s}."replicationState" SET "owner" = 'other-task', "ownerAddress" = 'change.streamer3:7645'"#
        ),
        &[],
    )
    .await
    .unwrap();
    feed.tx("0f", &[2]);
    // The streamer stops on its own, cleanly.
    let result = tokio::time::timeout(WAIT, h.finished()).await.expect("the streamer stops");
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(spec.committed().await, ["0d"]);
    let row = c
        .query_one(&format!(r#"SELECT "owner", "ownerAddress", "lastWatermark" FROM {s}."replicationState""#), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "other-task");
    assert_eq!(row.get::<_, String>(1), "change.streamer3:7645");
    assert_eq!(row.get::<_, String>(2), "0d");
}

/// A host that stored transaction 03 and is inside 05 (begin and one row
/// written, so its storage transaction holds the `replicationState` row);
/// also a client of the change DB and the query that probes the lock.
async fn owner_inside_a_transaction() -> (tempfile::TempDir, LogSpec, Feed, Harness, sluice::pgconn::PgClient, String) {
    let (dir, spec, feed, h) = fed_harness().await;
    feed.tx("03", &[1]);
    stored(&h, "03").await;
    feed.push(begin("05"));
    feed.push(insert(2));
    let c = spec.pg_client().await;
    let locked = wait_for_row_lock(&c, &spec.schema()).await;
    (dir, spec, feed, h, c, locked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_an_open_transaction() {
    let (_dir, _spec, feed, h, c, locked) = owner_inside_a_transaction().await;
    feed.push(commit("05"));
    stored(&h, "05").await;
    c.batch_execute("BEGIN").await.unwrap();
    let owner: String = c.query_one(&locked, &[]).await.unwrap().get(0);
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(owner, "task-id");
    h.stop().await.unwrap();
}

/// Waits until a storage transaction holds the `replicationState` row lock;
/// returns the query that probes it.
async fn wait_for_row_lock(c: &tokio_postgres::Client, s: &str) -> String {
    let locked = format!(r#"SELECT "owner" FROM {s}."replicationState" FOR UPDATE NOWAIT"#);
    let mut err = None;
    for _ in 0..500 {
        c.batch_execute("BEGIN").await.unwrap();
        let r = c.query(&locked, &[]).await;
        c.batch_execute("ROLLBACK").await.unwrap();
        if let Err(e) = r {
            err = Some(e);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let err = err.expect("the open transaction holds the replicationState row");
    assert!(
        err.as_db_error().unwrap().message().contains("could not obtain lock on row in relation \"replicationState\""),
        "{err}"
    );
    locked
}

/// Regression (found by the two-host chaos test): a new owner must read where
/// to resume only after it holds ownership. Otherwise the old owner commits in
/// between, the new owner resumes from before that commit, and a live
/// subscriber misses what the old owner stored last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_resumes_after_the_old_owners_last_commit() {
    let (_dir, spec, feed, mut old_owner, c, _) = owner_inside_a_transaction().await;

    let next = Feed::default();
    let new_owner = start_new_owner(&spec, &next).await;
    // The takeover queues behind the old owner's open storage transaction.
    wait_for_takeover_lock(&c).await;
    assert!(next.opens.lock().unwrap().is_empty(), "the source is opened only after ownership is held");

    feed.push(commit("05"));
    wait_until("the new owner opens its source", WAIT, || {
        let opened = !next.opens.lock().unwrap().is_empty();
        async move { opened }
    })
    .await;
    assert_eq!(*next.opens.lock().unwrap(), [Some("05".to_string())], "resumes after the old owner's last commit");
    assert_eq!(spec.committed().await, ["03", "05"]);
    // The old owner notices at its next storage transaction and stops cleanly.
    feed.tx("07", &[3]);
    let result = tokio::time::timeout(WAIT, old_owner.finished()).await.expect("the old owner stops");
    assert!(result.is_ok(), "{result:?}");
    next.tx("09", &[4]);
    stored(&new_owner, "09").await;
    assert_eq!(spec.committed().await, ["03", "05", "09"]);
    new_owner.stop().await.unwrap();
}

/// Host "task-b" on `feed`, over the same change DB.
async fn start_new_owner(spec: &LogSpec, feed: &Feed) -> Harness {
    let options = StreamerOptions { task_id: "task-b".into(), advertise: "b:1".into(), ..options() };
    start(&spec.as_task("task-b"), Box::new(feed.clone()), options).await
}

/// Waits until a takeover (the `owner` update) waits for the row lock.
async fn wait_for_takeover_lock(c: &tokio_postgres::Client) {
    wait_until("the takeover waits for the row lock", WAIT, || async move {
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%SET \"owner\"%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        waiting > 0
    })
    .await;
}

/// Regression (found by the two-host chaos test): a subscriber that reaches
/// a host while its takeover waits for the old owner's open storage
/// transaction must not catch up from the log as it is then. The old owner
/// commits that transaction, the new owner's stream starts after it, and a
/// snapshot taken before would leave it out of the subscriber's view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_during_a_takeover_waits_for_it() {
    let (_dir, spec, feed, old_owner, c, _) = owner_inside_a_transaction().await;

    let next = Feed::default();
    let new_owner = start_new_owner(&spec, &next).await;
    wait_for_takeover_lock(&c).await;
    let served = serve_hub(new_owner.hub.clone(), new_owner.status.clone()).await;
    let mut sub = ws::Client::subscribe(&served.addr, "03").await;
    let status = new_owner.status.clone();
    wait_until("the subscriber is held", WAIT, || {
        let held = status.snapshot().held_subscribers;
        async move { held == 1 }
    })
    .await;

    feed.push(commit("05"));
    wait_until("the new owner opens its source", WAIT, || {
        let opened = !next.opens.lock().unwrap().is_empty();
        async move { opened }
    })
    .await;
    next.tx("09", &[4]);
    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("commit 09") {
        seen.push(ws::summary(&sub.next().await.expect("stream still open")));
    }
    assert_eq!(
        seen,
        ["status", "begin 05", "insert 2", "commit 05", "begin 09", "insert 4", "commit 09"],
        "the old owner's last transaction from the log, then the new owner's live"
    );
    assert_eq!(new_owner.status.snapshot().held_subscribers, 0);
    new_owner.stop().await.unwrap();
    let _ = old_owner.stop().await;
}

async fn stops_cleanly_when(drop_sql: &str) {
    let (_dir, spec, feed, mut h) = fed_harness().await;
    feed.tx("03", &[1]);
    stored(&h, "03").await;
    let c = spec.pg_client().await;
    c.batch_execute(&drop_sql.replace("{s}", &spec.schema())).await.unwrap();
    // The stream fails, the reopen finds the tables gone.
    feed.fail();
    feed.tx("05", &[2]);
    let result = tokio::time::timeout(WAIT, h.finished()).await.expect("the streamer stops");
    assert!(result.is_ok(), "a clean stop, not an error: {result:?}");
    let state = h.status.snapshot().source;
    assert!(format!("{state:?}").contains("gone"), "{state:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_table_stops_the_service_cleanly() {
    stops_cleanly_when(r#"DROP TABLE {s}."replicationState""#).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_schema_stops_the_service_cleanly() {
    stops_cleanly_when("DROP SCHEMA {s} CASCADE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_below_the_floor_and_keeps_the_latest_transaction() {
    let (_dir, spec, feed, h) = fed_harness().await;
    feed.tx("03", &[1]);
    feed.tx("06", &[2]);
    stored(&h, "06").await;
    let reader = h.hub.reader().clone();
    let purge = |w: &'static str| {
        let r = reader.clone();
        tokio::task::block_in_place(move || r.purge_before(w, "01")).unwrap()
    };
    let watermarks =
        || async { spec.rows().await.into_iter().map(|r| r.watermark).collect::<std::collections::BTreeSet<_>>() };
    let r = reader.clone();
    let other_lineage = tokio::task::block_in_place(move || r.purge_before("04", "00")).unwrap();
    assert_eq!(other_lineage, 0, "a floor computed for another lineage deletes nothing");
    assert_eq!(purge("02"), 2, "the two seed rows");
    assert_eq!(purge("03"), 0);
    assert_eq!(watermarks().await.into_iter().collect::<Vec<_>>(), ["03", "06"]);
    assert_eq!(purge("04"), 3);
    assert_eq!(purge("06"), 0);
    assert_eq!(purge("99"), 0, "the newest transaction always stays");
    assert_eq!(watermarks().await.into_iter().collect::<Vec<_>>(), ["06"]);

    // A purge lock on the first row makes purging fail fast, nothing deleted.
    feed.tx("08", &[3]);
    stored(&h, "08").await;
    let locker = spec.pg_client().await;
    locker.batch_execute("BEGIN").await.unwrap();
    locker
        .query(
            &format!(
                r#"SELECT watermark FROM {}."changeLog" ORDER BY watermark, pos LIMIT 1 FOR SHARE"#,
                spec.schema()
            ),
            &[],
        )
        .await
        .unwrap();
    let r = reader.clone();
    let err = tokio::task::block_in_place(move || r.purge_before("08", "01")).unwrap_err();
    assert!(format!("{err:#}").contains("could not obtain lock"), "{err:#}");
    assert_eq!(watermarks().await.into_iter().collect::<Vec<_>>(), ["06", "08"]);
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(purge("08"), 3);

    // A host that lost ownership does not purge.
    feed.tx("0a", &[4]);
    stored(&h, "0a").await;
    h.stop().await.unwrap();
    locker
        .execute(&format!(r#"UPDATE {}."replicationState" SET "owner" = 'different-task-id'"#, spec.schema()), &[])
        .await
        .unwrap();
    let r = reader.clone();
    let err = tokio::task::block_in_place(move || r.purge_before("0a", "01")).unwrap_err();
    assert!(matches!(err.downcast_ref::<LogError>(), Some(LogError::OwnershipLost(_))));
    assert_eq!(err.to_string(), "aborting changeLog purge to 0a because ownership has been taken by different-task-id");
    assert_eq!(watermarks().await.into_iter().collect::<Vec<_>>(), ["08", "0a"]);
}

/// A catch-up reader jumps past a transaction (its cursor is declared
/// again after the jump) and otherwise continues where it stood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catch_up_cursor_continues_and_jumps() {
    let (_dir, _spec, feed, h) = fed_harness().await;
    feed.tx("03", &(1..=50).collect::<Vec<_>>());
    feed.tx("06", &[51]);
    stored(&h, "06").await;
    let reader = h.hub.reader().clone();
    let positions = tokio::task::block_in_place(move || {
        let mut snapshot = reader.snapshot().unwrap();
        let at = |rows: &[sluice::storage::StoredRow]| -> Vec<(String, i64)> {
            rows.iter().map(|r| (r.watermark.clone(), r.pos)).collect()
        };
        let first = snapshot.read("03", None, 10).unwrap();
        let last = first.last().map(|r| (r.watermark.clone(), r.pos)).unwrap();
        let next = snapshot.read("03", Some((&last.0, last.1)), 10).unwrap();
        let jumped = snapshot.read("03", Some(("03", i64::MAX)), 10).unwrap();
        (at(&first), at(&next), at(&jumped))
    });
    let (first, next, jumped) = positions;
    assert_eq!(first.len(), 10);
    assert!(first.iter().all(|(w, _)| w == "03"));
    assert!(next.len() == 10 && next[0].1 > first[9].1 && next.iter().all(|(w, _)| w == "03"), "{next:?}");
    // Past 03: only 06's begin, row and commit.
    assert_eq!(jumped.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>(), ["06", "06", "06"]);
    h.stop().await.unwrap();
}

/// Catch-ups beyond the cap wait for a connection instead of opening one
/// each: with a cap of 2, a third snapshot waits until one is dropped, then
/// reads the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_up_connections_are_capped() {
    let (_dir, spec, feed, h) = fed_harness().await;
    feed.tx("03", &[1, 2, 3]);
    stored(&h, "03").await;
    let settings = spec.pg.clone().unwrap();
    let reader = Arc::new(
        sluice::storage::postgres::PostgresReader::new(settings, tokio::runtime::Handle::current())
            .with_max_snapshots(2),
    );
    let open = |r: Arc<sluice::storage::postgres::PostgresReader>| {
        std::thread::spawn(move || {
            let mut s = sluice::storage::LogReader::snapshot(&*r).unwrap();
            let rows = s.read("03", None, 100).unwrap().len();
            (s, rows)
        })
    };
    let (first, rows) = open(reader.clone()).join().unwrap();
    let (_second, _) = open(reader.clone()).join().unwrap();
    let third = open(reader.clone());
    let r = reader.clone();
    wait_until("the third catch-up to wait", WAIT, || {
        let waiting = r.snapshots_waiting();
        async move { waiting == 1 }
    })
    .await;
    assert!(!third.is_finished(), "a third connection was opened past the cap");
    drop(first);
    let (_third, third_rows) = tokio::task::spawn_blocking(move || third.join().unwrap()).await.unwrap();
    assert_eq!((rows, third_rows), (5, 5), "begin, three rows, commit");
    h.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_retried_and_loses_nothing() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    // The mock harness runs as the default task, "sluice".
    let spec = LogSpec::new(Backend::Postgres, dir.path());
    let h =
        start_mock(&spec, json!({"transactions": 600, "rows_per_tx": 5, "rate": 600}), SandboxLimits::default()).await;
    let c = spec.pg_client().await;
    // Cut the writer's connections often, at uneven intervals, while it
    // streams: some cuts land inside a storage transaction.
    let mut killed = 0;
    for pause in [150, 20, 45, 70, 15, 90, 30, 60, 25, 80, 35, 55] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        killed += cut_connections(&c, &spec).await;
    }
    assert!(killed > 0, "no connection was cut");
    h.wait_for_watermark(&lexi(600), WAIT).await;
    h.stop().await.unwrap();
    assert_eq!(spec.committed().await, (1..=600).map(lexi).collect::<Vec<_>>());
    spec.assert_whole().await;
}

/// Terminates the server sessions of `spec`'s writer (by its application
/// name); how many were cut.
async fn cut_connections(c: &tokio_postgres::Client, spec: &LogSpec) -> usize {
    let app = &spec.pg.as_ref().expect("a Postgres log").application_name;
    let cut: i64 = c
        .query_one(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
            &[app],
        )
        .await
        .unwrap()
        .get(0);
    cut as usize
}

/// The connection dies between a storage transaction's COPY and its commit:
/// the commit must fail (the server rolled the rows back), not reconnect and
/// record a lastWatermark over rows that are not there (the loss the test
/// above once caught).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_inside_a_storage_transaction_fails_it() {
    use sluice::storage::postgres::PostgresChangeLog;
    use sluice::storage::{ChangeLog, LogRow};
    const BEGIN: &str = r#"{"tag":"begin"}"#;
    const INSERT: &str = r#"{"tag":"insert","relation":{"schema":"public","name":"t"},"new":{"id":1}}"#;
    const COMMIT: &str = r#"{"tag":"commit"}"#;
    fn tx(w: &str) -> [LogRow<'_>; 3] {
        [
            LogRow { watermark: w, pos: 0, tag: "begin", change: BEGIN, precommit: None },
            LogRow { watermark: w, pos: 1, tag: "insert", change: INSERT, precommit: None },
            LogRow { watermark: w, pos: 2, tag: "commit", change: COMMIT, precommit: Some(w) },
        ]
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = pg_spec(&dir);
    let pg = spec.pg.clone().unwrap();
    let rt = tokio::runtime::Handle::current();
    let mut log = tokio::task::block_in_place(|| {
        let mut log = PostgresChangeLog::open(pg.clone(), rt).unwrap();
        log.reset("00").unwrap();
        log.assume_ownership("task-id", "here").unwrap();
        log.begin().unwrap();
        log.append(&tx("05")).unwrap();
        log
    });
    let c = spec.pg_client().await;
    assert_eq!(cut_connections(&c, &spec).await, 1, "the writer's one connection");
    // Once the writer has seen the loss, its next call is the one that
    // would reconnect.
    wait_until("the writer sees its connection closed", WAIT, || {
        let closed = !log.connected();
        async move { closed }
    })
    .await;
    let err = tokio::task::block_in_place(|| log.commit("05")).unwrap_err();
    assert!(format!("{err:#}").contains("lost inside a storage transaction"), "{err:#}");
    let s = spec.schema();
    let last: String =
        c.query_one(&format!(r#"SELECT "lastWatermark" FROM {s}."replicationState""#), &[]).await.unwrap().get(0);
    assert_eq!(last, "00", "lastWatermark stays at the last durable commit");
    assert_eq!(spec.committed().await, Vec::<String>::new());
    // The next storage transaction reconnects and writes.
    tokio::task::block_in_place(|| {
        log.begin().unwrap();
        log.append(&tx("07")).unwrap();
        log.commit("07").unwrap();
    });
    assert_eq!(spec.committed().await, ["07"]);
    spec.assert_whole().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_change_db_stops_the_service() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let spec = pg_spec(&dir);
    let options = StreamerOptions {
        storer: StorerOptions { queue_budget: 16 << 10, ..StorerOptions::default() },
        wedge_timeout: Duration::from_millis(500),
        drain_timeout: Duration::from_millis(200),
        ..options()
    };
    let feed = Feed::default();
    let mut h = start(&spec, Box::new(feed.clone()), options).await;
    feed.tx("03", &[1]);
    stored(&h, "03").await;
    // Another session holds the change log hostage.
    let c = spec.pg_client().await;
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&format!(r#"LOCK TABLE {}."changeLog" IN ACCESS EXCLUSIVE MODE"#, spec.schema())).await.unwrap();
    for i in 0..200 {
        feed.tx(&lexi(10 + i), &[i as i64; 20]);
    }
    let result = tokio::time::timeout(WAIT, h.finished()).await.expect("the streamer stops");
    let err = result.unwrap_err().to_string();
    // The watchdog's reason is what is returned, not the drain that failed because of it.
    assert!(err.contains("Considering the change-log to be wedged"), "{err}");
    c.batch_execute("ROLLBACK").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_never_run_ahead_of_the_durable_log() {
    let (_dir, spec, feed, h) = fed_harness().await;
    feed.tx("03", &[1]);
    stored(&h, "03").await;
    let acks = feed.acks.clone();
    wait_until("the ack of 03", WAIT, || {
        let a = acks.lock().unwrap().clone();
        async move { a.last().map(String::as_str) == Some("03") }
    })
    .await;
    // Block the change log: transactions are forwarded but cannot be stored.
    let c = spec.pg_client().await;
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&format!(r#"LOCK TABLE {}."changeLog" IN ACCESS EXCLUSIVE MODE"#, spec.schema())).await.unwrap();
    for i in 0..20 {
        feed.tx(&lexi(10 + i), &[i as i64]);
    }
    // Every message has been taken from the source ...
    let items = feed.items.clone();
    wait_until("the source to be drained", WAIT, || {
        let empty = items.lock().unwrap().is_empty();
        async move { empty }
    })
    .await;
    // ... and still nothing past 03 is acked, because nothing is durable.
    assert_eq!(feed.acks.lock().unwrap().last().map(String::as_str), Some("03"));
    c.batch_execute("ROLLBACK").await.unwrap();
    let last = lexi(29);
    wait_until("the ack of the last transaction", WAIT, || {
        let a = acks.lock().unwrap().clone();
        let last = last.clone();
        async move { a.last() == Some(&last) }
    })
    .await;
    // Each ack names a transaction the log holds, in order.
    let logged = spec.committed().await;
    let acked = feed.acks.lock().unwrap().clone();
    assert!(acked.windows(2).all(|w| w[0] < w[1]), "{acked:?}");
    assert!(acked.iter().all(|a| logged.contains(a)), "{acked:?} vs {logged:?}");
    h.stop().await.unwrap();
}
