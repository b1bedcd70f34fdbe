//! The zero-custom-source plugin against a test upstream that speaks Zero's
//! custom change-source protocol over a real socket: the initial snapshot,
//! every message and change tag, upstream acks, a connection cut inside a
//! transaction, restarts of Sluice, malformed and out-of-order frames, an
//! upstream that is not reachable yet, and the network sandbox.

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::restartable::{Restartable, SourceFactory};
use common::ws::Client;
use common::*;
use custom_upstream::{column, event, insert, param, query_params, relation, snapshot, Fault, Tx, Upstream, SNAPSHOT};
use serde_json::{json, Value};
use sluice::plugin::{NetGrant, Registry, SandboxLimits};
use sluice::source::ChangeSource;
use sluice::streamer::StreamerOptions;

const WAIT: Duration = Duration::from_secs(60);

fn wm(i: u32) -> String {
    format!("1{i:04}")
}

/// Sluice with the zero-custom-source plugin over a SQLite change log,
/// restartable (see [`Restartable`]).
async fn start_sluice(config: Value) -> Restartable {
    let config = config.to_string();
    let grant = sluice::plugin::net::grant_for(&config, &[]).unwrap();
    start_sluice_with_grant(config, grant).await
}

async fn start_sluice_with_grant(config: String, grant: NetGrant) -> Restartable {
    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(Registry::load(&plugin_dir(), Some(dir.path().join("cache"))).await.unwrap());
    let source: SourceFactory = Box::new(move || {
        let (registry, config, grant) = (registry.clone(), config.clone(), grant.clone());
        Box::pin(async move { source(&registry, &config, &grant).await })
    });
    Restartable::start(dir, StreamerOptions::default(), source).await
}

async fn source(registry: &Arc<Registry>, config: &str, grant: &NetGrant) -> Box<dyn ChangeSource> {
    let source = registry.source("zero-custom-source", config.to_string(), SandboxLimits::default(), grant.clone());
    Box::new(source.await.unwrap())
}

fn config(up: &Upstream) -> Value {
    json!({"url": up.url(), "appID": "zero", "shardNum": 0, "publications": ["pub_a", "pub_b"]})
}

/// Reads messages up to and including the commit at `last`, returning them
/// as parsed JSON.
async fn read_through(client: &mut Client, last: &str) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let m = client.next().await.expect("the stream stays open");
        let v: Value = serde_json::from_str(&m).unwrap();
        let done = v[0] == "commit" && v[2]["watermark"] == last;
        out.push(v);
        if done {
            return out;
        }
    }
}

/// Commit watermarks in the order received.
fn commits(messages: &[Value]) -> Vec<String> {
    messages.iter().filter(|m| m[0] == "commit").map(|m| m[2]["watermark"].as_str().unwrap().to_string()).collect()
}

/// Every transaction in `history` arrived exactly once, whole and in order,
/// after the snapshot; interrupted attempts end in a rollback.
fn assert_exactly_once(messages: &[Value], history: &[Tx]) {
    let mut expected: Vec<String> = vec![format!("{SNAPSHOT}.01")];
    expected.extend(history.iter().map(|t| t.watermark.clone()));
    assert_eq!(commits(messages), expected);
    let mut open: Option<String> = None;
    for m in messages {
        match m[0].as_str().unwrap() {
            "begin" => {
                assert!(open.is_none(), "begin inside {open:?}");
                open = Some(m[2]["commitWatermark"].as_str().unwrap().to_string());
            }
            "commit" | "rollback" => assert!(open.take().is_some(), "{m} outside a transaction"),
            "data" => assert!(open.is_some(), "data outside a transaction: {m}"),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_every_message_and_tag_converted() {
    init_logs();
    let up = Upstream::start(snapshot(3)).await;
    let history = vec![
        // Rows: a key change, an update without one, a delete, JSON and exact numbers.
        Tx::new(
            &wm(1),
            &[
                insert("events", 10, json!({"big": 18446744073709551615u64, "note": "line\n\"quoted\""})),
                json!({"tag": "update", "relation": relation("events"), "key": {"id": 10}, "new": {"id": 11, "big": 5, "note": null}}),
                json!({"tag": "update", "relation": relation("events"), "key": null, "new": {"id": 11, "big": 6, "note": "x"}}),
                json!({"tag": "delete", "relation": relation("events"), "key": {"id": 0}}),
                json!({"tag": "truncate", "relations": [relation("events")]}),
            ],
        ),
        // Deprecated keyColumns/replicaIdentity instead of rowKey, and a
        // table whose rows name columns at different times.
        Tx::new(
            &wm(2),
            &[
                json!({"tag": "insert", "relation": {"schema": "public", "name": "docs", "keyColumns": ["id"], "replicaIdentity": "full"},
                   "new": {"id": 1, "doc": {"a": [1, 2, {"b": null}]}}}),
                json!({"tag": "insert", "relation": {"schema": "public", "name": "docs", "keyColumns": ["id"], "replicaIdentity": "full"},
                   "new": {"id": 2, "doc": [], "added": true}}),
            ],
        ),
        // Every schema change.
        Tx::new(
            &wm(3),
            &[
                json!({"tag": "add-column", "table": {"schema": "public", "name": "events"},
                   "column": {"name": "extra", "spec": {"pos": 4, "dataType": "varchar", "characterMaximumLength": 20, "notNull": false, "dflt": "'x'::text"}},
                   "tableMetadata": {"rowKey": {"id": {"attNum": 1}}}}),
                json!({"tag": "update-column", "table": {"schema": "public", "name": "events"},
                   "old": {"name": "extra", "spec": column(4, "varchar")}, "new": {"name": "extra2", "spec": column(4, "text")}}),
                json!({"tag": "drop-column", "table": {"schema": "public", "name": "events"}, "column": "extra2"}),
                json!({"tag": "rename-table", "old": {"schema": "public", "name": "docs"}, "new": {"schema": "public", "name": "documents"}}),
                json!({"tag": "update-table-metadata", "table": {"schema": "public", "name": "events"},
                   "old": {"rowKey": {"id": {"attNum": 1}}}, "new": {"rowKey": {"id": {"attNum": 1}}, "v": 2}}),
                json!({"tag": "create-index", "spec": {"schema": "public", "name": "ix", "tableName": "events", "unique": false,
                   "columns": {"big": "DESC", "id": "ASC"}}}),
                json!({"tag": "drop-index", "id": {"schema": "public", "name": "ix"}}),
                json!({"tag": "drop-table", "id": {"schema": "public", "name": "documents"}}),
                json!({"tag": "create-table", "spec": {"schema": "public", "name": "later", "columns": {"k": {"pos": 1, "dataType": "text", "pgTypeClass": "b"}}},
                   "metadata": {"rowKey": {"k": {"attNum": 1}}}}),
            ],
        ),
        // Begin extras (stringified JSON values) and commit extras pass on.
        Tx::with_begin(
            &wm(4),
            json!({"tag": "begin", "json": "s", "xid": 77}),
            &[insert("events", 20, json!({"big": 1, "note": "{\"stringified\":true}"}))],
        ),
    ];
    for tx in &history {
        up.append(tx.clone());
    }
    let sluice = start_sluice(config(&up)).await;
    sluice.stored(&wm(4)).await;
    assert_eq!(sluice.status.snapshot().replica_version.as_deref(), Some(SNAPSHOT));

    // zero-cache's query parameters on a fresh connection.
    let q = &up.connections()[0];
    assert_eq!(param(q, "appID").as_deref(), Some("zero"));
    assert_eq!(param(q, "shardNum").as_deref(), Some("0"));
    assert_eq!(query_params(q, "publications"), ["pub_a", "pub_b"]);
    assert_eq!(param(q, "lastWatermark"), None);
    assert_eq!(param(q, "replicaVersion"), None);

    let mut client = Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    let got = read_through(&mut client, &wm(4)).await;
    assert_eq!(got[0][0], "status");
    assert_exactly_once(&got, &history);

    // Every change arrives as the upstream sent it. (Rows of a relation are
    // compared as objects: Sluice lists key columns first.)
    let sent: Vec<Value> = std::iter::once(snapshot(3))
        .chain(history.iter().cloned())
        .flat_map(|t| t.frames)
        .map(|f| serde_json::from_str::<Value>(&f).unwrap())
        .filter(|f| f[0] == "data")
        .map(|f| f[1].clone())
        .collect();
    let received: Vec<Value> = got.iter().filter(|m| m[0] == "data").map(|m| m[1].clone()).collect();
    assert_eq!(received.len(), sent.len());
    for (r, s) in received.iter().zip(&sent) {
        let mut expected = s.clone();
        // Relations arrive in the current form (rowKey), as Zero normalises them.
        if let Some(rel) = expected.get_mut("relation") {
            if let Some(cols) = rel.get("keyColumns").cloned() {
                let kind = rel["replicaIdentity"].clone();
                *rel = json!({"schema": rel["schema"], "name": rel["name"], "rowKey": {"columns": cols, "type": kind}});
            }
        }
        assert_eq!(r, &expected);
    }
    // Exact numbers: u64::MAX and 2^60 + id, as written.
    let text: Vec<String> = got.iter().map(|m| m.to_string()).collect();
    assert!(text.iter().any(|t| t.contains("18446744073709551615")));
    assert!(text.iter().any(|t| t.contains(&((1i64 << 60) + 2).to_string())));
    // Begin and commit extras.
    let begin4 = got.iter().find(|m| m[0] == "begin" && m[2]["commitWatermark"] == wm(4).as_str()).unwrap();
    assert_eq!(begin4[1], json!({"tag": "begin", "json": "s", "xid": 77}));

    // The host's acks reach the upstream as zero-cache's status frames.
    let acked = json!(["status", {"tag": "commit"}, {"watermark": wm(4)}]);
    wait_until("the upstream to receive the commit ack", WAIT, || {
        let got = up.received();
        let acked = acked.clone();
        async move { got.contains(&acked) }
    })
    .await;
    // The initial snapshot is not acked (zero-cache never acks its initial sync).
    assert!(!up.received().iter().any(|f| f[2]["watermark"] == SNAPSHOT || f[2]["watermark"] == "0a.01"));
}

/// Waits until the upstream received `frame`.
/// Waits for the streaming connection, which follows the snapshot's (so a
/// fault injected now hits it, not the initial one the plugin is leaving).
async fn streaming(up: &Upstream) {
    wait_until("the resume connection after the snapshot", WAIT, || {
        let n = up.connections().len();
        async move { n == 2 }
    })
    .await;
}

async fn upstream_receives(up: &Upstream, frame: Value) {
    wait_until(&format!("the upstream to receive {frame}"), WAIT, || {
        let got = up.received();
        let frame = frame.clone();
        async move { got.contains(&frame) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_are_echoed_and_skip_ack_transactions_are_not_acked() {
    init_logs();
    let up = Upstream::start(snapshot(1)).await;
    let sluice = start_sluice(config(&up)).await;
    up.append(Tx::new(&wm(1), &[event(1)]));
    upstream_receives(&up, json!(["status", {"tag": "commit"}, {"watermark": wm(1)}])).await;
    // A status asking for an ack is echoed once every commit before it is durable.
    let status1 = format!("{}x", wm(1));
    up.append_status(&status1);
    upstream_receives(&up, json!(["status", {"ack": true}, {"watermark": status1}])).await;
    // A skipAck transaction is stored but never acked; the echo of a later
    // status (which the host sends only after acking that commit) proves
    // the ack was withheld, not merely late.
    up.append(Tx::with_begin(&wm(2), json!({"tag": "begin", "skipAck": true}), &[event(2)]));
    sluice.stored(&wm(2)).await;
    let status2 = format!("{}x", wm(2));
    up.append_status(&status2);
    upstream_receives(&up, json!(["status", {"ack": true}, {"watermark": status2}])).await;
    assert!(!up.received().iter().any(|f| f[2]["watermark"] == wm(2).as_str()), "{:?}", up.received());
}

/// zero-cache's own sequence with a custom source: the initial connection
/// carries the snapshot alone and is closed once it is durable; the stream
/// follows on a new connection with `lastWatermark` = `replicaVersion` = W.
/// An upstream written for zero-cache sends nothing more on the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_cache_style_upstream_is_resumed_after_the_snapshot() {
    init_logs();
    let up = Upstream::start(snapshot(2)).await;
    up.snapshot_only_on_initial();
    let history: Vec<Tx> = (1..=3u32).map(|i| Tx::new(&wm(i), &[event(10 + i as i64)])).collect();
    for tx in &history {
        up.append(tx.clone());
    }
    let sluice = start_sluice(config(&up)).await;
    sluice.stored(&wm(3)).await;
    let conns = up.connections();
    assert_eq!(conns.len(), 2, "{conns:?}");
    assert_eq!(param(&conns[0], "lastWatermark"), None);
    assert_eq!(param(&conns[1], "lastWatermark").as_deref(), Some(SNAPSHOT));
    assert_eq!(param(&conns[1], "replicaVersion").as_deref(), Some(SNAPSHOT));
    let mut client = Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    assert_exactly_once(&read_through(&mut client, &wm(3)).await, &history);
    upstream_receives(&up, json!(["status", {"tag": "commit"}, {"watermark": wm(3)}])).await;
    // The snapshot itself is never acked (nor is it by zero-cache).
    assert!(!up.received().iter().any(|f| f[2]["watermark"] == SNAPSHOT), "{:?}", up.received());
    // A quiet source shows how long it has been quiet.
    assert!(sluice.status.snapshot().source_idle_ms.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_inside_a_transaction_is_rolled_back_and_delivered_whole_later() {
    init_logs();
    let up = Upstream::start(snapshot(2)).await;
    let sluice = start_sluice(config(&up)).await;
    sluice.stored(&format!("{SNAPSHOT}.01")).await;
    streaming(&up).await;
    let mut client = Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    let mut history = Vec::new();
    for i in 1..=3u32 {
        history.push(Tx::new(&wm(i), &[event(i as i64 * 10), event(i as i64 * 10 + 1), event(i as i64 * 10 + 2)]));
    }
    up.fault(Fault::CutInside(wm(2)));
    for tx in &history {
        up.append(tx.clone());
    }
    let got = read_through(&mut client, &wm(3)).await;
    assert_exactly_once(&got, &history);
    // The cut transaction began, was rolled back, and came again whole.
    let begins2 = got.iter().filter(|m| m[0] == "begin" && m[2]["commitWatermark"] == wm(2).as_str()).count();
    assert_eq!(begins2, 2, "{got:?}");
    assert!(got.iter().any(|m| m[0] == "rollback"));
    // The reconnection resumed after the last durable commit.
    let conns = up.connections();
    let last = conns.last().unwrap();
    assert_eq!(param(last, "lastWatermark"), Some(wm(1)), "{conns:?}");
    assert_eq!(param(last, "replicaVersion").as_deref(), Some(SNAPSHOT));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_with_last_watermark_and_replica_version() {
    init_logs();
    let up = Upstream::start(snapshot(2)).await;
    let mut sluice = start_sluice(config(&up)).await;
    sluice.stored(&format!("{SNAPSHOT}.01")).await;
    // Restart with only the snapshot stored: the upstream is asked for what
    // follows the snapshot's own watermark.
    sluice.restart().await;
    let mut history = vec![Tx::new(&wm(1), &[event(100)]), Tx::new(&wm(2), &[event(101)])];
    for tx in &history {
        up.append(tx.clone());
    }
    sluice.stored(&wm(2)).await;
    sluice.restart().await;
    history.push(Tx::new(&wm(3), &[event(102)]));
    up.append(history[2].clone());
    sluice.stored(&wm(3)).await;

    // After the initial connection: the resume after the snapshot (zero-cache's
    // second connection, unless the restart came first) and the first
    // restart ask for what follows the snapshot; the second restart for
    // what follows wm(2). All with the replica version.
    let conns = up.connections();
    let (first, rest) = conns.split_first().unwrap();
    assert_eq!(param(first, "lastWatermark"), None);
    assert!(rest.len() == 2 || rest.len() == 3, "{conns:?}");
    assert!(rest.iter().all(|q| param(q, "replicaVersion").as_deref() == Some(SNAPSHOT)), "{conns:?}");
    let (last, middle) = rest.split_last().unwrap();
    assert!(middle.iter().all(|q| param(q, "lastWatermark").as_deref() == Some(SNAPSHOT)), "{conns:?}");
    assert_eq!(param(last, "lastWatermark"), Some(wm(2)));

    // A subscriber from the start sees every transaction once.
    let mut client = Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    let got = read_through(&mut client, &wm(3)).await;
    assert_exactly_once(&got, &history);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_out_of_order_frames_are_named_and_the_stream_recovers() {
    init_logs();
    let up = Upstream::start(snapshot(1)).await;
    let sluice = start_sluice(config(&up)).await;
    sluice.stored(&format!("{SNAPSHOT}.01")).await;
    streaming(&up).await;
    let mut client = Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    let history: Vec<Tx> = (1..=3).map(|i| Tx::new(&wm(i), &[event(i as i64)])).collect();
    up.fault(Fault::MalformedBefore(wm(2)));
    up.fault(Fault::FrameBefore(json!(["data", event(99)]).to_string(), wm(3)));
    up.append(history[0].clone());
    up.append(history[1].clone());
    let err = sluice.backing_off_with("bad message from the upstream").await;
    assert!(err.contains("{not json"), "{err}");
    sluice.stored(&wm(2)).await;
    up.append(history[2].clone());
    let err = sluice.backing_off_with("a data change outside a transaction").await;
    assert!(err.contains("\"id\":99"), "{err}");
    let got = read_through(&mut client, &wm(3)).await;
    assert_exactly_once(&got, &history);
    assert!(!got.iter().any(|m| m[1]["new"]["id"] == 99));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_upstream_is_told_apart_by_pings_and_left() {
    init_logs();
    let up = Upstream::start(snapshot(1)).await;
    let mut cfg = config(&up);
    cfg["pingIntervalMs"] = json!(300);
    let sluice = start_sluice(cfg).await;
    streaming(&up).await;
    let history: Vec<Tx> = (1..=2).map(|i| Tx::new(&wm(i), &[event(i as i64)])).collect();
    up.fault(Fault::StallBefore(wm(2)));
    up.append(history[0].clone());
    up.append(history[1].clone());
    // The stalled connection holds the TCP socket open: only the missing
    // pongs tell it apart from a quiet upstream.
    sluice.backing_off_with("not even a pong").await;
    sluice.stored(&wm(2)).await;
    assert!(up.connections().len() >= 3);
    up.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_retried_until_it_comes_up() {
    init_logs();
    // A port nothing listens on yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let cfg = json!({"url": format!("http://{addr}/changes/v0/stream"), "appID": "zero"});
    let sluice = start_sluice(cfg).await;
    let err = sluice.backing_off_with("cannot reach the upstream").await;
    assert!(err.contains(&addr.to_string()), "{err}");
    let up = Upstream::start_on(addr, snapshot(2)).await;
    up.append(Tx::new(&wm(1), &[event(5)]));
    sluice.stored(&wm(1)).await;
    assert_eq!(param(&up.connections()[0], "appID").as_deref(), Some("zero"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_network_grant_the_plugin_reaches_nothing() {
    init_logs();
    let up = Upstream::start(snapshot(1)).await;
    let sluice = start_sluice_with_grant(config(&up).to_string(), NetGrant::default()).await;
    let err = sluice.backing_off_with("cannot reach the upstream").await;
    assert!(err.to_lowercase().contains("permission denied"), "{err}");
    assert!(up.connections().is_empty());
}

/// Sluice as zero-cache's upstream: a second Sluice, whose zero-custom-source
/// plugin speaks zero-cache's side of the custom change-source protocol (an
/// initial-sync connection, then a resume connection after the snapshot),
/// follows the first one's `/changes/v0/stream` while it is still
/// replicating. It initial-syncs from the first one's table state, then
/// streams from its log, and ends with the same table state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sluice_serves_the_custom_protocol_from_its_table_state_and_log() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    // An unbounded stream at 50 transactions/s: the follower joins while it
    // runs, and the upstream stops only once the follower streams live.
    let mut upstream =
        start_mock(&spec, json!({"rows_per_tx": 5, "tables": 2, "rate": 50}), SandboxLimits::default()).await;
    // Part of the stream is in the log before the follower starts.
    let st = upstream.status.clone();
    wait_until("the upstream to store 50 transactions", WAIT, || {
        let last = st.snapshot().last_watermark.unwrap_or_default();
        async move { last >= lexi(50) }
    })
    .await;
    let config = json!({"url": format!("ws://{}", upstream.service.addr())}).to_string();
    let grant = sluice::plugin::net::grant_for(&config, &[]).unwrap();
    let follower = start_sluice_with_grant(config, grant).await;
    // Past its initial sync (stored at `W.01`), a transaction streamed live.
    let fst = follower.status.clone();
    wait_until("the follower to stream past its initial sync", WAIT, || {
        let last = fst.snapshot().last_watermark;
        async move { last.is_some_and(|w| !w.contains('.')) }
    })
    .await;
    upstream.service.stop_replication().await.unwrap();
    let last = upstream.status.snapshot().last_watermark.unwrap();
    // The follower's watermarks are the upstream's.
    wait_until("the follower to store everything", WAIT, || {
        let stored = fst.snapshot().last_watermark.unwrap_or_default();
        let done = stored.as_str() >= last.as_str();
        async move { done }
    })
    .await;
    let (kept, theirs) = spec.state().await;
    let (follower_kept, ours) = follower.spec().state().await;
    assert!(kept && follower_kept);
    assert!(theirs.len() >= 50 * 5);
    let rows = |s: &[sluice::storage::StateRow]| {
        s.iter().map(|r| (r.table.clone(), r.key.clone(), r.row.clone())).collect::<Vec<_>>()
    };
    // The follower also holds Zero's tables, which the upstream declared in
    // its initial sync because the mock source has none: the permissions
    // row (NULL permissions, no --zero-permissions here).
    let (zero, ours): (Vec<_>, Vec<_>) =
        ours.into_iter().partition(|r| r.table.starts_with("[\"zero\"") || r.table.starts_with("[\"zero_0\""));
    assert_eq!(
        rows(&zero),
        [(
            "[\"zero\",\"permissions\"]".into(),
            "[true]".into(),
            r#"{"lock":true,"hash":null,"permissions":null}"#.into()
        )]
    );
    assert_eq!(rows(&ours), rows(&theirs), "the follower holds the upstream's rows");
    // The follower's first transaction was the initial sync, stored just
    // after the upstream watermark it was taken at.
    let follower_rows = follower.spec().rows().await;
    let first = follower_rows.iter().find(|r| r.tag == "commit" && r.watermark.ends_with(".01")).unwrap();
    let snapshot_at = first.watermark.trim_end_matches(".01");
    assert!(snapshot_at >= lexi(50).as_str() && snapshot_at < last.as_str(), "{snapshot_at}");
    follower.spec().assert_whole().await;
    // A consumer whose replica version predates the follower's lineage (its
    // initial sync at `snapshot_at`) is told to start over.
    let url =
        format!("ws://{}/changes/v0/stream?appID=zero&shardNum=0&lastWatermark=01&replicaVersion=01", follower.addr);
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    let first = futures::StreamExt::next(&mut ws).await.unwrap().unwrap().into_text().unwrap();
    assert!(first.starts_with(r#"["control",{"tag":"reset-required""#), "{first}");
}

/// A TLS terminator in front of a plain upstream, with the test CA's
/// certificate for 127.0.0.1: what a `wss://` endpoint looks like.
async fn tls_front(pki: &common::pki::Pki, backend: String) -> String {
    use rustls::pki_types::pem::PemObject;
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(pki.path("server.crt"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(pki.path("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(sluice::tls::crypto_provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (acceptor, backend) = (acceptor.clone(), backend.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else { return };
                let mut plain = tokio::net::TcpStream::connect(backend).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}

/// `wss://`: the plugin has no TLS stack, so `sluice run` gives it a
/// loopback forwarder that opens the TLS connection and checks the
/// certificate with `tls_ca`. The snapshot and a live transaction arrive;
/// with a CA that did not sign the certificate, one line says so and
/// nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wss_upstream_is_reached_through_the_hosts_tls() {
    let pki = common::pki::Pki::new();
    let up = Upstream::start(snapshot(2)).await;
    let backend = up.url().trim_start_matches("ws://").trim_end_matches('/').to_string();
    let front = tls_front(&pki, backend).await;
    let run = |ca: &str| {
        let dir = tempfile::tempdir().unwrap();
        let addr = common::process::free_addr();
        let config = json!({"url": format!("wss://{front}/"), "tls_ca": ca, "appID": "zero", "shardNum": 0});
        let log = dir.path().join("sluice.log");
        let child = common::process::sluice()
            .args(["run", "--source", "zero-custom-source", "--listen", &addr, "--source-config", &config.to_string()])
            .arg("--plugins")
            .arg(plugin_dir())
            .arg("--change-db")
            .arg(format!("sqlite:{}", dir.path().join("log.db").display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        (dir, addr, log, KillOnDrop(child))
    };

    let (_dir, addr, log, child) = run(&pki.path("ca.crt").display().to_string());
    let deadline = std::time::Instant::now() + WAIT;
    let rv = loop {
        if let Some(rv) = common::process::status(&addr).and_then(|s| s["replicaVersion"].as_str().map(str::to_string))
        {
            break rv;
        }
        assert!(std::time::Instant::now() < deadline, "no lineage:\n{}", std::fs::read_to_string(&log).unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    up.append(Tx::new(&wm(1), &[event(10)]));
    let mut client = Client::subscribe_at(&addr, &rv, &rv).await;
    let messages = read_through(&mut client, &wm(1)).await;
    let ids: Vec<i64> = messages
        .iter()
        .filter(|m| m[0] == "data" && m[1]["tag"] == "insert" && m[1]["relation"]["name"] == "events")
        .filter_map(|m| m[1]["new"]["id"].as_i64())
        .collect();
    assert_eq!(ids, [0, 1, 10], "the snapshot's rows, then the live insert");
    drop(child);

    let (dir, addr, log, child) = run(&pki.path("wrong-ca.crt").display().to_string());
    let deadline = std::time::Instant::now() + WAIT;
    while !std::fs::read_to_string(&log).unwrap().contains("invalid peer certificate") {
        assert!(std::time::Instant::now() < deadline, "no TLS error:\n{}", std::fs::read_to_string(&log).unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = common::process::status(&addr).unwrap();
    assert!(status["lastWatermark"].is_null(), "something was stored: {status}");
    drop(child);
    drop(dir);
}

/// A child process killed when the test ends, also by a failed assertion.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
