//! Many subscribers at once, over real WebSockets: peers that never
//! acknowledge beside a well-behaved one, the subscribers' memory budget,
//! and catch-ups that share scans of the log.

#[macro_use]
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::feed::*;
use common::*;
use futures::{SinkExt, StreamExt};
use sluice::hub::Hub;
use sluice::service::{Service, ServiceConfig};
use sluice::source::model::{Insert, Message, Value};
use sluice::status::Status;
use sluice::subscriber::{Limits, MemoryBudget};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message as Ws;
use tokio_tungstenite::WebSocketStream;

on_both_backends!(catchups_joining_at_different_watermarks_while_the_source_streams_get_each_transaction_once);

const WAIT: Duration = Duration::from_secs(60);

struct Server {
    addr: String,
    status: Arc<Status>,
    hub: Arc<Hub>,
    feed: Feed,
    _service: Service,
    _dir: tempfile::TempDir,
}

async fn server(backend: Backend, budget_bytes: usize) -> Server {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(backend, dir.path());
    let (log, reader) = spec.open();
    let feed = Feed::with_snapshot();
    let limits = Limits { budget: Arc::new(MemoryBudget::new(budget_bytes)), ..Limits::default() };
    let config = ServiceConfig {
        subscriber_limits: limits,
        cleanup: None,
        ..ServiceConfig::new(Box::new(feed.clone()), log, reader)
    };
    let service = Service::start(config).await.unwrap();
    let (addr, status, hub) = (service.addr().to_string(), service.status().clone(), service.hub().clone());
    let st = status.clone();
    wait_until("the snapshot to be stored", WAIT, || {
        let rv = st.snapshot().replica_version;
        async move { rv.is_some() }
    })
    .await;
    Server { addr, status, hub, feed, _service: service, _dir: dir }
}

/// Transaction `n` (watermark `lexi(n)`): `rows` inserts with ids
/// `n * 100 ..`, each carrying `bytes` of text.
fn push_tx(feed: &Feed, n: u64, rows: u64, bytes: usize) {
    let w = lexi(n);
    feed.push(begin(&w));
    for r in 0..rows {
        let id = (n * 100 + r) as i64;
        feed.push(Message::Insert(Insert { relation: 0, new: vec![Value::Int(id), Value::Text("x".repeat(bytes))] }));
    }
    feed.push(commit(&w));
}

type Socket = WebSocketStream<tokio::net::TcpStream>;

/// A WebSocket. With `small_buffer`, its receive buffer is 4 KiB, so a peer
/// that stops reading makes the server queue frames soon rather than after
/// megabytes of kernel buffers. Only peers that stall get one: on loopback
/// (an MSS of 64 KiB) a window that small stays under one segment, so the
/// sender's kernel sends only at its window probes, which back off up to
/// two minutes (seen with `ss -ti`: `rwnd_limited` 100 %, the reader's queue
/// empty); a reader there stalls however fast it reads.
async fn connect(addr: &str, id: &str, watermark: &str, small_buffer: bool) -> Socket {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    if small_buffer {
        socket.set_recv_buffer_size(4096).unwrap();
    }
    let stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    let url = format!(
        "ws://{addr}/replication/v6/changes?id={id}&taskID=t&replicaVersion={SNAPSHOT_RV}&watermark={watermark}"
    );
    tokio_tungstenite::client_async(url, stream).await.unwrap().0
}

/// What one subscriber saw over all its connections.
#[derive(Default, Debug)]
struct Seen {
    /// Each transaction's commit watermark and row ids, in arrival order.
    commits: Vec<(String, Vec<i64>)>,
    problems: Vec<String>,
    /// Times it was closed for the memory budget.
    budget_closes: usize,
    /// For each of those closes: the server's message, when it came (since
    /// the recorder started) and the last commit before it.
    budget_close_notes: Vec<String>,
}

/// How a recorder behaves.
struct Plan {
    /// The last transaction: once the test knows it, it sends it.
    last: watch::Receiver<Option<String>>,
    /// Stalls left to every recorder (see [`record`]).
    stalls: Arc<AtomicUsize>,
    hub: Arc<Hub>,
}

impl Plan {
    fn new(hub: &Arc<Hub>, last: Option<u64>) -> (Plan, watch::Sender<Option<String>>) {
        let (tx, last) = watch::channel(last.map(lexi));
        (Plan { last, stalls: Arc::new(AtomicUsize::new(0)), hub: hub.clone() }, tx)
    }

    fn clone_with(&self, stalls: usize) -> Plan {
        self.stalls.fetch_add(stalls, Ordering::SeqCst);
        Plan { last: self.last.clone(), stalls: self.stalls.clone(), hub: self.hub.clone() }
    }

    fn is_last(&self, w: &str) -> bool {
        self.last.borrow().as_deref() == Some(w)
    }
}

/// A subscriber that acknowledges everything, reconnects from its last
/// commit whenever its connection ends (dropping a partial transaction,
/// as Zero's clients do), until it has the plan's last transaction. With
/// `stalls`, it stops reading at its third commit on a connection until the
/// server has closed it, until it has been closed for the budget that many
/// times.
async fn record(addr: String, id: String, from: String, mut stalls: usize, plan: Plan) -> Seen {
    let mut seen = Seen::default();
    let began = std::time::Instant::now();
    'connect: loop {
        let after = seen.commits.last().map_or(from.clone(), |(w, _)| w.clone());
        if plan.is_last(&after) {
            return seen;
        }
        let mut ws = connect(&addr, &id, &after, stalls > 0).await;
        let mut open: Option<(String, Vec<i64>)> = None;
        let mut commits_here = 0;
        let mut stalled = false;
        loop {
            if stalls > 0 && commits_here == 3 && !stalled {
                stalled = true;
                let hub = plan.hub.clone();
                wait_until("the server to close this subscriber", WAIT, || {
                    let open = hub.subscriber_views().iter().any(|v| v.id == id);
                    async move { !open }
                })
                .await;
            }
            // The next frame; or the end, once the last transaction is known
            // and already here.
            let started = std::time::Instant::now();
            let frame = loop {
                match tokio::time::timeout(Duration::from_millis(100), ws.next()).await {
                    Ok(frame) => break frame,
                    Err(_) if seen.commits.last().is_some_and(|(w, _)| plan.is_last(w)) => return seen,
                    Err(_) => assert!(started.elapsed() < WAIT, "{id}: no frame in time"),
                }
            };
            let Some(Ok(frame)) = frame else { continue 'connect };
            let text = match frame {
                Ws::Text(t) => t,
                Ws::Close(_) => continue 'connect,
                _ => continue,
            };
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            if ws.send(Ws::Text(format!("{{\"ack\":{}}}", v["id"]).into())).await.is_err() {
                continue 'connect;
            }
            let msg = &v["msg"];
            match msg[0].as_str().unwrap_or("") {
                "begin" => {
                    if let Some((w, _)) = &open {
                        seen.problems.push(format!("begin inside {w}"));
                    }
                    open = Some((msg[2]["commitWatermark"].as_str().unwrap().to_string(), Vec::new()));
                }
                "data" => match &mut open {
                    Some((_, ids)) => ids.push(msg[1]["new"]["id"].as_i64().unwrap()),
                    None => seen.problems.push(format!("data outside a transaction: {msg}")),
                },
                "commit" => {
                    let w = msg[2]["watermark"].as_str().unwrap().to_string();
                    match open.take() {
                        Some((b, ids)) if b == w => seen.commits.push((w.clone(), ids)),
                        other => seen.problems.push(format!("commit {w} closing {other:?}")),
                    }
                    commits_here += 1;
                    if plan.is_last(&w) {
                        return seen;
                    }
                }
                "error" if msg[1]["type"] == 3 && msg[1]["message"].as_str().is_some_and(|m| m.contains("budget")) => {
                    seen.budget_closes += 1;
                    seen.budget_close_notes.push(format!(
                        "{} at {:.3} s after commit {:?}",
                        msg[1]["message"],
                        began.elapsed().as_secs_f64(),
                        seen.commits.last().map(|(w, _)| w)
                    ));
                    if stalls > 0 {
                        stalls -= 1;
                        plan.stalls.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                "error" => seen.problems.push(format!("error: {msg}")),
                _ => {}
            }
        }
    }
}

/// Every transaction after `from` up to `last`, once each, whole, in order.
fn assert_exactly_once(who: &str, seen: &Seen, from: u64, last: u64, rows: u64) {
    assert_eq!(seen.problems, Vec::<String>::new(), "{who}");
    let got: Vec<&str> = seen.commits.iter().map(|(w, _)| w.as_str()).collect();
    let expected: Vec<String> = (from + 1..=last).map(lexi).collect();
    assert_eq!(got, expected, "{who}: each transaction once, in commit order");
    for (i, (w, ids)) in seen.commits.iter().enumerate() {
        let n = from + 1 + i as u64;
        let rows: Vec<i64> = (0..rows).map(|r| (n * 100 + r) as i64).collect();
        assert_eq!(*ids, rows, "{who}: the rows of {w}");
    }
}

/// Peers that never acknowledge (half of them do not even read) join
/// beside a subscriber that does; it must receive every commit in order
/// while they are connected, and the budget closes them as they pile up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_peers_that_never_ack_does_not_hold_a_well_behaved_subscriber() {
    let budget_bytes = 4 << 20;
    let s = server(Backend::Sqlite, budget_bytes).await;
    let mut silent = Vec::new();
    let (stop, stopped) = watch::channel(false);
    let mut readers = Vec::new();
    for i in 0..30 {
        silent.push(connect(&s.addr, &format!("silent{i}"), SNAPSHOT, true).await);
        let mut ws = connect(&s.addr, &format!("mute{i}"), SNAPSHOT, true).await;
        let mut stopped = stopped.clone();
        // Reads everything, acknowledges nothing.
        readers.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    f = ws.next() => if !matches!(f, Some(Ok(_))) { return },
                    _ = stopped.changed() => return,
                }
            }
        }));
    }
    let st = s.status.clone();
    wait_until("the flood to be registered", WAIT, || {
        let n = st.snapshot().subscribers;
        async move { n == 60 }
    })
    .await;
    let budget = s.hub.budget().clone();
    let (plan, _last) = Plan::new(&s.hub, Some(601));
    let good = tokio::spawn(record(s.addr.clone(), "good".into(), SNAPSHOT.into(), 0, plan));
    wait_until("the well-behaved subscriber to be registered", WAIT, || {
        let n = st.snapshot().subscribers;
        async move { n == 61 }
    })
    .await;
    // 600 transactions of 4 rows of 1 KiB: 2.4 MB for each subscriber.
    for n in 2..=601 {
        push_tx(&s.feed, n, 4, 1024);
    }
    let seen = good.await.unwrap();
    assert_exactly_once("the well-behaved subscriber", &seen, 1, 601, 4);
    assert_eq!(
        seen.budget_closes, 0,
        "the well-behaved subscriber is never over its share: {:?}",
        seen.budget_close_notes
    );
    assert!(budget.view().closed_total >= 30, "the silent peers were closed for the budget: {:?}", budget.view());
    // Their connections end and what they held is given back.
    wait_until("the memory held to fall under the budget", WAIT, || {
        let used = budget.used();
        async move { used <= budget_bytes }
    })
    .await;
    let _ = stop.send(true);
    for r in readers {
        let _ = r.await;
    }
    drop(silent);
}

/// Subscribers that stop reading are closed with `StreamTooFarBehind`
/// once the budget is exceeded (not the one that keeps up); each
/// reconnects from its last commit and ends with every transaction once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_closes_the_subscribers_that_hold_most_and_they_catch_up_exactly_once() {
    let s = server(Backend::Sqlite, 1 << 20).await;
    let (plan, last) = Plan::new(&s.hub, None);
    let mut tasks = Vec::new();
    for (i, stalls) in [0usize, 2, 2, 2].into_iter().enumerate() {
        let task = record(s.addr.clone(), format!("sub{i}"), SNAPSHOT.into(), stalls, plan.clone_with(stalls));
        tasks.push(tokio::spawn(task));
    }
    let st = s.status.clone();
    wait_until("the subscribers to be registered", WAIT, || {
        let n = st.snapshot().subscribers;
        async move { n == 4 }
    })
    .await;
    // The source streams until every stall has ended in a close.
    let mut n = 1;
    while plan.stalls.load(Ordering::SeqCst) > 0 {
        assert!(tasks.iter().all(|t| !t.is_finished()), "a subscriber ended early");
        assert!(n < 30_000, "the stalls did not end in closes: {:?}", s.hub.subscriber_views());
        for _ in 0..50 {
            n += 1;
            push_tx(&s.feed, n, 3, 512);
        }
        // The next batch waits until the subscriber that keeps up has
        // consumed this one, so it keeps up by construction however busy
        // the machine is (it holds at most a batch, under its share); a
        // loaded machine otherwise made it miss a flow-control deadline,
        // and the budget rightly closed it as behind.
        let (hub, target) = (s.hub.clone(), lexi(n));
        wait_until("the subscriber that keeps up to consume the batch", WAIT, || {
            let done = hub.subscriber_views().iter().any(|v| v.id == "sub0" && v.acked >= target);
            async move { done }
        })
        .await;
    }
    let end = n;
    last.send_replace(Some(lexi(end)));
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.unwrap());
    }
    for (i, seen) in seen.iter().enumerate() {
        assert_exactly_once(&format!("subscriber {i}"), seen, 1, end, 3);
    }
    assert_eq!(
        seen[0].budget_closes,
        0,
        "the subscriber that keeps up is never closed: {:?}; the stallers' closes: {:?}",
        seen[0].budget_close_notes,
        seen[1..].iter().map(|s| &s.budget_close_notes).collect::<Vec<_>>()
    );
    let stallers_closed: usize = seen[1..].iter().map(|s| s.budget_closes).sum();
    assert!(stallers_closed >= 6, "each of the six stalls ended with a close for the budget: {stallers_closed}");
}

/// Subscribers join at different watermarks while the source streams: the
/// catch-ups share scans, and each subscriber gets every transaction after
/// its watermark once, whole and in order, through the hand-off to live.
async fn catchups_joining_at_different_watermarks_while_the_source_streams_get_each_transaction_once(backend: Backend) {
    let s = server(backend, 512 << 20).await;
    let stored: u64 = 2000;
    for n in 2..=stored {
        push_tx(&s.feed, n, 2, 64);
    }
    wait_stored(&s.status, &lexi(stored)).await;
    let end: u64 = stored + 1000;
    let (plan, _last) = Plan::new(&s.hub, Some(end));
    let mut tasks = Vec::new();
    let mut next = stored + 1;
    for i in 0..24u64 {
        // Joins at 24 positions across the log, while 40 more transactions
        // stream in between joins.
        let from = 1 + i * 80;
        let task = record(s.addr.clone(), format!("late{i}"), lexi(from), 0, plan.clone_with(0));
        tasks.push((from, tokio::spawn(task)));
        for _ in 0..40 {
            push_tx(&s.feed, next, 2, 64);
            next += 1;
        }
    }
    while next <= end {
        push_tx(&s.feed, next, 2, 64);
        next += 1;
    }
    for (from, t) in tasks {
        let seen = t.await.unwrap();
        assert_exactly_once(&format!("subscriber from {from}"), &seen, from, end, 2);
    }
    let view = s.hub.catchups().view();
    assert!(view.changes_sent > 0 && view.rows_read > 0, "the catch-ups read the log: {view:?}");
}
