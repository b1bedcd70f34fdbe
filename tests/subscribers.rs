//! Subscribers over real WebSockets: catch-up and live hand-off, acks,
//! purging, errors and bad requests (Zero's §8.1, §8.4-§8.6 cases).

#[macro_use]
mod common;

use std::sync::Arc;

use common::feed::*;
use common::ws::*;
use common::*;
use futures::{SinkExt, StreamExt};
use sluice::cleanup::{purge_once, CleanupOptions};
use sluice::hub::Hub;
use sluice::service::{Service, ServiceConfig};
use sluice::source::model::Message;
use sluice::status::{LineageState, Status};
use tokio_tungstenite::tungstenite::Message as Ws;

on_both_backends!(
    a_subscriber_before_the_snapshot_is_durable_is_closed_and_served_after,
    a_snapshot_reports_rows_and_bytes_per_table,
    the_retention_window_holds_the_log_without_subscribers,
    a_catching_up_subscriber_past_its_backlog_limit_keeps_reading_the_log,
    catches_up_from_the_log_then_continues_live,
    live_rollbacks_reach_subscribers,
    a_subscriber_ahead_of_the_log_gets_only_newer_transactions,
    live_and_caught_up_frames_are_byte_identical_with_big_integers_intact,
    status_first_or_watermark_too_old_after_a_purge,
    purge_floor_is_the_slowest_ack_and_keeps_the_latest_transaction,
    a_departed_subscribers_ack_holds_the_log_while_it_reconnects,
    wrong_replica_version_is_an_error,
    a_dying_source_rolls_back_the_open_transaction_exactly_once,
    subscribers_joining_mid_transaction_get_each_transaction_once,
    a_subscriber_that_stops_reading_does_not_hold_the_others,
    bad_requests_close_with_zeros_reasons,
    an_out_of_order_ack_closes_the_stream,
    an_oversized_subscriber_message_is_refused_and_the_others_continue
);

struct Server {
    addr: String,
    spec: LogSpec,
    status: Arc<Status>,
    hub: Arc<Hub>,
    feed: Feed,
    /// Dropping it stops the service.
    _service: Service,
    _dir: tempfile::TempDir,
}

async fn server_with(backend: Backend, limits: sluice::subscriber::Limits) -> Server {
    let s = start_server(backend, limits, Feed::with_snapshot()).await;
    // Subscribers are served once the source's snapshot is durable.
    let st = s.status.clone();
    wait_until("the snapshot to be stored", WAIT, || {
        let rv = st.snapshot().replica_version;
        async move { rv.is_some() }
    })
    .await;
    s
}

async fn start_server(backend: Backend, limits: sluice::subscriber::Limits, feed: Feed) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(backend, dir.path());
    let (log, reader) = spec.open();
    let config = ServiceConfig {
        subscriber_limits: limits,
        cleanup: None,
        ..ServiceConfig::new(Box::new(feed.clone()), log, reader)
    };
    let service = Service::start(config).await.unwrap();
    let (addr, status, hub) = (service.addr().to_string(), service.status().clone(), service.hub().clone());
    Server { addr, spec, status, hub, feed, _service: service, _dir: dir }
}

async fn server(backend: Backend) -> Server {
    server_with(backend, sluice::subscriber::Limits::default()).await
}

impl Server {
    async fn stored(&self, w: &str) {
        wait_stored(&self.status, w).await;
    }
}

/// Until a lineage's first transaction (its snapshot) is durable, its replica
/// version is neither reported nor recorded, and a subscriber is closed
/// without an error, as by a Zero change-streamer that is not up yet: it
/// retries, and is served once the snapshot is stored.
async fn a_subscriber_before_the_snapshot_is_durable_is_closed_and_served_after(backend: Backend) {
    // A plain feed (replica version 01) sends nothing until the test pushes.
    let s = start_server(backend, sluice::subscriber::Limits::default(), Feed::default()).await;
    let st = s.status.clone();
    wait_until("the source to open", WAIT, || {
        let snapshotting = matches!(st.snapshot().lineage, LineageState::Snapshotting { .. });
        async move { snapshotting }
    })
    .await;
    let body = serde_json::to_value(s.status.snapshot()).unwrap();
    assert_eq!(body["replicaVersion"], serde_json::Value::Null, "{body}");
    assert_eq!(body["lineage"], serde_json::json!({"state": "snapshotting", "tables": 0, "rows": 0}), "{body}");
    let mut early = Client::subscribe_at(&s.addr, "01", "01").await;
    assert_eq!(early.next().await, None, "closed, with no error message");
    assert!(s.spec.rows().await.is_empty(), "nothing recorded before the snapshot is durable");

    s.feed.tx("02", &[1]);
    s.stored("02").await;
    assert_eq!(s.status.snapshot().replica_version.as_deref(), Some("01"));
    assert_eq!(s.status.snapshot().lineage, LineageState::Established);
    assert_eq!(s.spec.replication().await, ("01".to_string(), "02".to_string(), false));
    let mut c = Client::subscribe_at(&s.addr, "01", "01").await;
    assert_eq!(c.take(4).await, ["status", "begin 02", "insert 1", "commit 02"]);
}

/// While a snapshot is stored, `/status` counts rows and bytes per table
/// (rows belong to the table begun last); the counts go once it is durable.
async fn a_snapshot_reports_rows_and_bytes_per_table(backend: Backend) {
    use sluice::source::model::{CreateTable, SchemaChange, TableSpec};
    let s = start_server(backend, sluice::subscriber::Limits::default(), Feed::default()).await;
    let table = |name: &str| {
        Message::Schema(SchemaChange::CreateTable(CreateTable {
            spec: TableSpec { schema: "public".into(), name: name.into(), columns: vec![], primary_key: None },
            metadata: None,
        }))
    };
    s.feed.push(relation());
    s.feed.push(begin("02"));
    s.feed.push(table("first"));
    s.feed.push(insert(1));
    s.feed.push(table("second"));
    for id in 2..5 {
        s.feed.push(insert(id));
    }
    let st = s.status.clone();
    wait_until("the snapshot's rows to be counted", WAIT, || {
        let rows = st.snapshot().snapshot_tables.iter().map(|t| t.rows).sum::<u64>();
        async move { rows == 4 }
    })
    .await;
    let body = serde_json::to_value(s.status.snapshot()).unwrap();
    let tables = body["snapshotTables"].as_array().unwrap();
    let counts: Vec<(&str, u64)> =
        tables.iter().map(|t| (t["table"].as_str().unwrap(), t["rows"].as_u64().unwrap())).collect();
    assert_eq!(counts, [("public.first", 1), ("public.second", 3)], "{body}");
    assert!(tables.iter().all(|t| t["bytes"].as_u64().unwrap() > 0), "{body}");
    assert_eq!(body["lineage"], serde_json::json!({"state": "snapshotting", "tables": 2, "rows": 4}), "{body}");
    s.feed.push(commit("02"));
    s.stored("02").await;
    assert!(s.status.snapshot().snapshot_tables.is_empty());
}

async fn catches_up_from_the_log_then_continues_live(backend: Backend) {
    let s = server(backend).await;
    s.feed.tx("09", &[1, 2]);
    s.stored("09").await;
    let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(c.take(5).await, ["status", "begin 09", "insert 1", "insert 2", "commit 09"]);
    s.feed.push(begin("0b"));
    s.feed.push(delete(1));
    s.feed.push(commit("0b"));
    assert_eq!(c.take(3).await, ["begin 0b", "delete 1", "commit 0b"]);
}

async fn live_rollbacks_reach_subscribers(backend: Backend) {
    let s = server(backend).await;
    s.feed.tx("09", &[1]);
    s.stored("09").await;
    let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(c.take(4).await, ["status", "begin 09", "insert 1", "commit 09"]);
    s.feed.push(begin("0a"));
    s.feed.push(delete(1));
    s.feed.push(Message::Rollback);
    s.feed.tx("0c", &[3]);
    assert_eq!(c.take(6).await, ["begin 0a", "delete 1", "rollback", "begin 0c", "insert 3", "commit 0c"]);
    s.stored("0c").await;
    assert_eq!(s.spec.committed().await, ["09", "0c"]);
}

async fn a_subscriber_ahead_of_the_log_gets_only_newer_transactions(backend: Backend) {
    let s = server(backend).await;
    s.feed.tx("09", &[1]);
    s.stored("09").await;
    let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "0b").await;
    assert_eq!(c.take(1).await, ["status"]);
    s.feed.tx("0b", &[2]);
    s.feed.tx("0c", &[3]);
    assert_eq!(c.take(3).await, ["begin 0c", "insert 3", "commit 0c"]);
}

async fn live_and_caught_up_frames_are_byte_identical_with_big_integers_intact(backend: Backend) {
    let s = server(backend).await;
    let mut live = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(live.take(1).await, ["status"]);
    s.feed.tx("05", &[7]);
    let mut from_live = Vec::new();
    for _ in 0..3 {
        from_live.push(live.next().await.unwrap());
    }
    s.stored("05").await;
    let mut replay = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(replay.take(1).await, ["status"]);
    let mut from_log = Vec::new();
    for _ in 0..3 {
        from_log.push(replay.next().await.unwrap());
    }
    assert_eq!(from_live, from_log);
    assert!(from_live[1].contains("\"big\":987654321987654328"), "{}", from_live[1]);
}

async fn status_first_or_watermark_too_old_after_a_purge(backend: Backend) {
    let s = server(backend).await;
    for w in ["04", "06", "08"] {
        s.feed.tx(w, &[1]);
    }
    s.stored("08").await;
    // Retention keeps the last three transactions: the seed rows and the
    // (empty) snapshot go.
    let opts = CleanupOptions { retain_transactions: Some(3), ..CleanupOptions::default() };
    let (_, deleted) = tokio::task::block_in_place(|| purge_once(&s.hub, &opts)).unwrap();
    assert_eq!(deleted, 4, "the two seed rows and the snapshot's begin and commit");
    for w in ["04", "08"] {
        let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, w).await;
        assert_eq!(c.take(1).await, ["status"], "subscriber at {w}");
    }
    let mut old = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "02").await;
    assert_eq!(old.take(1).await, ["error 2 earliest supported watermark is 04 (requested 02)"]);
    assert_eq!(old.close_reason().await.0, 1000);
}

async fn purge_floor_is_the_slowest_ack_and_keeps_the_latest_transaction(backend: Backend) {
    let s = server(backend).await;
    for w in ["03", "04", "05", "06", "07", "08"] {
        s.feed.tx(w, &[1]);
    }
    s.stored("08").await;
    let mut at6 = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "06").await;
    let mut at4 = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "04").await;
    assert_eq!(at6.take(1).await, ["status"]);
    assert_eq!(at4.take(1).await, ["status"]);
    let opts = CleanupOptions::default();
    let (floor, _) = tokio::task::block_in_place(|| purge_once(&s.hub, &opts)).unwrap();
    assert_eq!(floor.as_deref(), Some("04"));
    let first = s.spec.rows().await[0].watermark.clone();
    assert_eq!(first, "04");
    // The subscriber at 04 consumes through 08 (acking the last commit by
    // pulling one more message is not needed: acks go per message).
    assert_eq!(at4.take(12).await.last().unwrap(), "commit 08");
    assert_eq!(at6.take(6).await.last().unwrap(), "commit 08");
    wait_until("acks to reach 08", WAIT, || {
        let a = s.hub.min_ack();
        async move { a.as_deref() == Some("08") }
    })
    .await;
    let (floor, _) = tokio::task::block_in_place(|| purge_once(&s.hub, &opts)).unwrap();
    assert_eq!(floor.as_deref(), Some("08"));
    assert_eq!(s.spec.committed().await, ["08"], "only the latest transaction survives");
    drop((at4, at6));
    let old = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "04").await;
    let mut old = old;
    assert_eq!(old.take(1).await, ["error 2 earliest supported watermark is 08 (requested 04)"]);
}

/// A purge that runs while a subscriber reconnects (its link dropped, its
/// process restarted) keeps what it still needs: its last ack holds the
/// floor for the subscriber retention, though another subscriber acked
/// further.
async fn a_departed_subscribers_ack_holds_the_log_while_it_reconnects(backend: Backend) {
    let s = server(backend).await;
    for w in ["03", "04", "05", "06", "07", "08"] {
        s.feed.tx(w, &[1]);
    }
    s.stored("08").await;
    let mut ahead = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "08").await;
    assert_eq!(ahead.take(1).await, ["status"]);
    let mut behind = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "04").await;
    assert_eq!(behind.take(4).await, ["status", "begin 05", "insert 1", "commit 05"]);
    // Gone without a close handshake, its ack of 05 sent.
    drop(behind);
    let hub = s.hub.clone();
    wait_until("the departed subscriber's position to be kept", WAIT, || {
        let kept = hub.reservations().list().contains(&("subscriber test".into(), "05".into(), false));
        async move { kept }
    })
    .await;
    let (floor, _) = tokio::task::block_in_place(|| purge_once(&s.hub, &CleanupOptions::default())).unwrap();
    assert_eq!(floor.as_deref(), Some("05"), "the connected subscriber acked 08");
    assert_eq!(s.spec.rows().await[0].watermark, "05");
    let mut back = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "05").await;
    assert_eq!(back.take(4).await, ["status", "begin 06", "insert 1", "commit 06"]);
    drop(ahead);
}

async fn wrong_replica_version_is_an_error(backend: Backend) {
    let s = server(backend).await;
    let mut c = Client::connect(&s.addr, "id=x&replicaVersion=00foobar&watermark=01").await;
    assert_eq!(c.take(1).await, ["error 1 current replica version is 00 (requested 00foobar)"]);
}

async fn a_dying_source_rolls_back_the_open_transaction_exactly_once(backend: Backend) {
    let s = server(backend).await;
    let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(c.take(1).await, ["status"]);
    s.feed.push(begin("09"));
    s.feed.push(insert(1));
    s.feed.fail();
    // The next stream delivers 09 in full.
    s.feed.tx("09", &[1]);
    assert_eq!(c.take(6).await, ["begin 09", "insert 1", "rollback", "begin 09", "insert 1", "commit 09"]);
    // An explicit rollback followed by a failure: one rollback, not two.
    s.feed.push(begin("0a"));
    s.feed.push(insert(2));
    s.feed.push(Message::Rollback);
    s.feed.fail();
    s.feed.tx("0b", &[3]);
    assert_eq!(c.take(6).await, ["begin 0a", "insert 2", "rollback", "begin 0b", "insert 3", "commit 0b"]);
    assert_eq!(s.feed.opens.lock().unwrap().len(), 3);
}

async fn subscribers_joining_mid_transaction_get_each_transaction_once(backend: Backend) {
    let s = server(backend).await;
    s.feed.tx("03", &[1]);
    s.stored("03").await;
    // Many subscribers join while transactions stream in.
    let mut clients = Vec::new();
    for i in 0..20u64 {
        let w = lexi(i * 5 + 10);
        s.feed.tx(&w, &[i as i64, i as i64 + 100]);
        clients.push(Client::subscribe_at(&s.addr, SNAPSHOT_RV, "03").await);
    }
    let last = lexi(19 * 5 + 10);
    for (n, c) in clients.iter_mut().enumerate() {
        let mut got = Vec::new();
        loop {
            let m = summary(&c.next().await.unwrap());
            let done = m == format!("commit {last}");
            got.push(m);
            if done {
                break;
            }
        }
        let commits: Vec<&String> = got.iter().filter(|m| m.starts_with("commit")).collect();
        let expected: Vec<String> = (0..20u64).map(|i| format!("commit {}", lexi(i * 5 + 10))).collect();
        assert_eq!(commits, expected.iter().collect::<Vec<_>>(), "subscriber {n}");
        assert_eq!(got.len(), 1 + 20 * 4, "subscriber {n}: status + 20 whole transactions, nothing twice");
    }
}

async fn a_subscriber_that_stops_reading_does_not_hold_the_others(backend: Backend) {
    let limits = sluice::subscriber::Limits { pending_bytes: 256 << 10, ..Default::default() };
    let s = server_with(backend, limits).await;
    let mut stuck = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(stuck.take(1).await, ["status"]);
    let mut reader = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(reader.take(1).await, ["status"]);
    for i in 0..400u64 {
        s.feed.tx(&lexi(i + 2), &[i as i64; 10]);
    }
    let last = lexi(401);
    let mut n = 0;
    loop {
        let m = summary(&reader.next().await.unwrap());
        n += 1;
        if m == format!("commit {last}") {
            break;
        }
    }
    assert_eq!(n, 400 * 12);
    // The stuck one was cut off once its unconsumed bytes passed the limit:
    // its connection ends (it never reads, so the close may be abrupt).
    let st = s.status.clone();
    wait_until("the stuck subscriber to be dropped", WAIT, || {
        let n = st.snapshot().subscribers;
        async move { n == 1 }
    })
    .await;
    loop {
        match tokio::time::timeout(WAIT, stuck.ws.next()).await.expect("the stuck connection ends") {
            Some(Ok(Ws::Close(_))) | Some(Err(_)) | None => break,
            Some(Ok(_)) => {}
        }
    }
}

async fn bad_requests_close_with_zeros_reasons(backend: Backend) {
    let s = server(backend).await;
    let cases = [
        ("/replication/v6/changes", "Error: invalid querystring - missing id"),
        ("/replication/v6/changes?id=foo", "Error: invalid querystring - missing replicaVersion"),
        (
            "/replication/v6/changes?id=foo&replicaVersion=00&initial=true&taskID=t",
            "Error: invalid querystring - missing watermark",
        ),
        ("/replication/v7/changes", "Error: Cannot service client at protocol v7. Supported protocols: [v1 ... v6]"),
        ("/replication/v7/snapshot", "Error: Cannot service client at protocol v7. Supported protocols: [v1 ... v6]"),
        ("/replication/v6/snapshot", "Error: Missing taskID in snapshot request"),
    ];
    for (path, reason) in cases {
        let (ws, _) = tokio_tungstenite::connect_async(format!("ws://{}{path}", s.addr)).await.unwrap();
        let (code, got) = Client { ws }.close_reason().await;
        assert_eq!((code, got.as_str()), (1002, reason), "{path}");
    }
    for path in ["/", "/?foo=bar", "/keepalive"] {
        let body = reqwest_get(&s.addr, path).await;
        assert_eq!(body, "OK", "{path}");
    }
}

async fn reqwest_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await.unwrap();
    let mut buf = String::new();
    sock.read_to_string(&mut buf).await.unwrap();
    buf.split_once("\r\n\r\n").unwrap().1.to_string()
}

async fn an_out_of_order_ack_closes_the_stream(backend: Backend) {
    let s = server(backend).await;
    let url = format!("ws://{}/replication/v6/changes?id=x&replicaVersion=00&watermark=01", s.addr);
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await.unwrap();
    let _status = ws.next().await.unwrap().unwrap();
    ws.send(Ws::Text("{\"ack\":5}".into())).await.unwrap();
    let (code, reason) = Client { ws }.close_reason().await;
    assert_eq!(code, 1011);
    assert_eq!(reason, "Error: Unexpected ack for 1: 5");
}

async fn an_oversized_subscriber_message_is_refused_and_the_others_continue(backend: Backend) {
    let s = server(backend).await;
    let mut other = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    assert_eq!(other.take(1).await, ["status"]);
    let url = format!("ws://{}/replication/v6/changes?id=big&replicaVersion=00&watermark=01", s.addr);
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await.unwrap();
    let _status = ws.next().await.unwrap().unwrap();
    let big = format!("{{\"ack\":{}}}", "1".repeat(sluice::server::changes::MAX_SUBSCRIBER_MESSAGE));
    ws.send(Ws::Text(big.into())).await.unwrap();
    let (code, reason) = Client { ws }.close_reason().await;
    assert_eq!(code, 1011);
    assert!(reason.starts_with("Error: connection error: Space limit exceeded: Message too long"), "{reason}");
    s.feed.tx("05", &[1]);
    assert_eq!(other.take(3).await, ["begin 05", "insert 1", "commit 05"]);
}

async fn the_retention_window_holds_the_log_without_subscribers(backend: Backend) {
    let s = server(backend).await;
    for i in 0..10u64 {
        s.feed.tx(&lexi(i + 2), &[i as i64]);
    }
    s.stored(&lexi(11)).await;
    let keep4 = CleanupOptions { retain_transactions: Some(4), ..CleanupOptions::default() };
    let (floor, _) = tokio::task::block_in_place(|| purge_once(&s.hub, &keep4)).unwrap();
    assert_eq!(floor.as_deref(), Some(lexi(8).as_str()));
    assert_eq!(s.spec.committed().await, (8..=11).map(lexi).collect::<Vec<_>>());
    // No window and no subscribers: only the newest transaction stays.
    let (floor, _) = tokio::task::block_in_place(|| purge_once(&s.hub, &CleanupOptions::default())).unwrap();
    assert_eq!(floor.as_deref(), Some(lexi(11).as_str()));
    assert_eq!(s.spec.committed().await, [lexi(11)]);
}

async fn a_catching_up_subscriber_past_its_backlog_limit_keeps_reading_the_log(backend: Backend) {
    // A tiny backlog: live traffic during catch-up overflows it at once.
    let limits = sluice::subscriber::Limits { backlog_bytes: 1, ..Default::default() };
    let s = server_with(backend, limits).await;
    // A log larger than the catch-up window (1 MiB unconsumed): a subscriber
    // that does not read yet stays in catch-up while live traffic arrives.
    for i in 0..6000u64 {
        s.feed.tx(&lexi(i + 2), &[i as i64; 5]);
    }
    s.stored(&lexi(6001)).await;
    let mut c = Client::subscribe_at(&s.addr, SNAPSHOT_RV, "01").await;
    let st = s.status.clone();
    wait_until("the subscriber to be registered", WAIT, || {
        let n = st.snapshot().subscribers;
        async move { n == 1 }
    })
    .await;
    for i in 0..50u64 {
        s.feed.tx(&lexi(i + 7000), &[i as i64]);
    }
    // It stays connected: the live changes it let go come from the log in
    // a second catch-up, and everything arrives once, in order.
    let expected: Vec<(String, usize)> =
        (0..6000u64).map(|i| (lexi(i + 2), 5)).chain((0..50u64).map(|i| (lexi(i + 7000), 1))).collect();
    let mut got: Vec<(String, usize)> = Vec::new();
    let mut rows = 0;
    while got.len() < expected.len() {
        let m = summary(&c.next().await.expect("the subscriber is not closed"));
        assert!(!m.starts_with("error"), "{m}");
        if m.starts_with("insert") {
            rows += 1;
        } else if let Some(w) = m.strip_prefix("commit ") {
            got.push((w.to_string(), std::mem::take(&mut rows)));
        }
    }
    assert_eq!(got, expected);
    assert!(s.hub.catchups().view().repeated >= 1, "its catch-up was run again: {:?}", s.hub.catchups().view());
    // Then it follows live.
    s.feed.tx(&lexi(8000), &[1, 2]);
    let tail = c.take(4).await;
    assert_eq!(
        tail,
        [format!("begin {}", lexi(8000)), "insert 1".into(), "insert 2".into(), format!("commit {}", lexi(8000))]
    );
}
