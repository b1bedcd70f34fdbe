//! The exactly-once oracle of the crash and network-fault suites:
//! subscribers over real WebSockets that reconnect from their last commit,
//! and the checks of what they saw against the upstream and the change log.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message as Ws;

use super::host::Host;
use super::process::Rng;
use super::{lexi, LogSpec};

/// What one subscriber saw: its committed transactions with the ids they
/// inserted, and anything that broke the protocol's promises.
#[derive(Default)]
pub struct Seen {
    pub commits: Vec<(String, Vec<i64>)>,
    pub problems: Vec<String>,
    pub connections: u64,
    pub drops: u64,
}

impl Seen {
    pub fn last(&self) -> Option<&str> {
        self.commits.last().map(|(w, _)| w.as_str())
    }
}

/// A subscriber over a real WebSocket that reconnects from its last commit
/// whenever the connection ends (a killed host, or its own random drop when
/// `drop_one_in` is set: the socket is dropped without a close handshake,
/// as when a subscriber process is killed).
async fn subscriber(
    addrs: Vec<String>,
    replica_version: Arc<Mutex<String>>,
    seen: Arc<Mutex<Seen>>,
    drop_one_in: Option<(u64, u64)>,
    mut stop: watch::Receiver<bool>,
) {
    let mut rng = Rng(drop_one_in.map(|(s, _)| s).unwrap_or(0));
    let mut attempt = 0usize;
    loop {
        if *stop.borrow() {
            return;
        }
        // With two hosts, whichever serves.
        let addr = &addrs[attempt % addrs.len()];
        attempt += 1;
        let rv = replica_version.lock().unwrap().clone();
        let after = seen.lock().unwrap().last().map(str::to_string).unwrap_or_else(|| rv.clone());
        let url =
            format!("ws://{addr}/replication/v6/changes?id=chaos&taskID=chaos&replicaVersion={rv}&watermark={after}");
        let Ok(Ok((mut ws, _))) =
            tokio::time::timeout(Duration::from_secs(2), tokio_tungstenite::connect_async(url)).await
        else {
            tokio::time::sleep(Duration::from_millis(30)).await;
            continue;
        };
        seen.lock().unwrap().connections += 1;
        let mut open: Option<(String, Vec<i64>)> = None;
        let mut killed = false;
        loop {
            let frame = tokio::select! {
                f = ws.next() => f,
                _ = stop.changed() => return,
            };
            let Some(Ok(Ws::Text(text))) = frame else { break };
            let v: serde_json::Value = match serde_json::from_str(&text) {
                Ok(v) => v,
                Err(e) => {
                    seen.lock().unwrap().problems.push(format!("unparsable frame {text}: {e}"));
                    break;
                }
            };
            if ws.send(Ws::Text(format!("{{\"ack\":{}}}", v["id"]).into())).await.is_err() {
                break;
            }
            let msg = &v["msg"];
            let mut s = seen.lock().unwrap();
            match msg[0].as_str().unwrap_or("") {
                "begin" => {
                    if let Some((w, _)) = &open {
                        s.problems.push(format!("begin inside transaction {w}"));
                    }
                    open = Some((msg[2]["commitWatermark"].as_str().unwrap_or("").to_string(), Vec::new()));
                }
                "data" => match &mut open {
                    Some((_, ids)) if msg[1]["tag"] == "insert" => ids.push(msg[1]["new"]["id"].as_i64().unwrap_or(-1)),
                    Some(_) => {}
                    None => s.problems.push(format!("data outside a transaction: {msg}")),
                },
                "rollback" => open = None,
                "commit" => {
                    let w = msg[2]["watermark"].as_str().unwrap_or("").to_string();
                    match open.take() {
                        Some((b, ids)) if b == w => {
                            if let Some(last) = s.last().filter(|l| w.as_str() <= *l) {
                                let problem = format!("commit {w} again or out of order after {last}");
                                s.problems.push(problem);
                            }
                            s.commits.push((w, ids));
                        }
                        other => s.problems.push(format!("commit {w} closing {other:?}")),
                    }
                    if let Some((_, n)) = drop_one_in {
                        if rng.range(0, n) == 0 {
                            s.drops += 1;
                            killed = true;
                            break;
                        }
                    }
                }
                "error" => {
                    // A lineage that was never stored can be replaced (the
                    // host died before the snapshot was durable).
                    if msg[1]["type"] == 1 && s.commits.is_empty() {
                        break;
                    }
                    s.problems.push(format!("error from the server: {msg}"));
                    break;
                }
                _ => {}
            }
        }
        if !killed {
            let _ = ws.close(None).await;
        }
    }
}

/// Two subscribers (steady, and one that drops itself now and then) running
/// beside the kill schedule.
pub struct Subscribers {
    seen: Vec<Arc<Mutex<Seen>>>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Subscribers {
    pub fn start(addr: &str, replica_version: Arc<Mutex<String>>, seed: u64) -> Subscribers {
        Subscribers::start_on(vec![addr.to_string()], replica_version, seed)
    }

    pub fn start_on(addrs: Vec<String>, replica_version: Arc<Mutex<String>>, seed: u64) -> Subscribers {
        let (stop, stop_rx) = watch::channel(false);
        let mut seen = Vec::new();
        let mut tasks = Vec::new();
        for drop in [None, Some((seed ^ 0x5eed, 40))] {
            let s = Arc::new(Mutex::new(Seen::default()));
            seen.push(s.clone());
            tasks.push(tokio::spawn(subscriber(addrs.clone(), replica_version.clone(), s, drop, stop_rx.clone())));
        }
        Subscribers { seen, stop, tasks }
    }

    /// Waits until every subscriber's last commit is at least `w`.
    pub async fn reach(&self, w: &str, host: &Host) {
        self.reach_any(w, &[host]).await
    }

    pub async fn reach_any(&self, w: &str, hosts: &[&Host]) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let done = self.seen.iter().all(|s| s.lock().unwrap().last().is_some_and(|l| l >= w));
            if done {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "subscribers did not reach {w} ({}); host logs:\n{}",
                self.progress(),
                hosts.iter().map(|h| h.log_tail()).collect::<Vec<_>>().join("\n----\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every subscriber has received at least `rows` inserted rows.
    pub async fn wait_for_rows(&self, rows: usize, host: &Host) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let done = self
                .seen
                .iter()
                .all(|s| s.lock().unwrap().commits.iter().map(|(_, ids)| ids.len()).sum::<usize>() >= rows);
            if done {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "subscribers did not receive {rows} rows ({}); log:\n{}",
                self.progress(),
                host.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Where each subscriber is, and the last problems it saw, for a
    /// failed wait's message.
    fn progress(&self) -> String {
        let each = self.seen.iter().enumerate().map(|(i, s)| {
            let s = s.lock().unwrap();
            let rows: usize = s.commits.iter().map(|(_, ids)| ids.len()).sum();
            let recent: Vec<&String> = s.problems.iter().rev().take(3).collect();
            format!(
                "subscriber {i}: {rows} rows, last commit {:?}, {} connections, {} problems, latest {recent:?}",
                s.last(),
                s.connections,
                s.problems.len()
            )
        });
        each.collect::<Vec<_>>().join("; ")
    }

    pub async fn stop(self) -> Vec<Arc<Mutex<Seen>>> {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.seen
    }
}

/// Checks that each subscriber saw no protocol problem and each of `ids`
/// exactly once (and nothing else); returns how many transactions each saw.
pub fn each_row_exactly_once(seen: &[Arc<Mutex<Seen>>], ids: &[i64]) -> Vec<usize> {
    let mut txs = Vec::new();
    for (i, s) in seen.iter().enumerate() {
        let s = s.lock().unwrap();
        assert_eq!(s.problems, Vec::<String>::new(), "subscriber {i}");
        let mut count: BTreeMap<i64, u32> = BTreeMap::new();
        for id in s.commits.iter().flat_map(|(_, ids)| ids) {
            *count.entry(*id).or_default() += 1;
        }
        let wrong: Vec<_> = count.iter().filter(|(_, n)| **n != 1).collect();
        assert!(wrong.is_empty(), "subscriber {i}: rows not seen exactly once: {wrong:?}");
        assert_eq!(count.keys().copied().collect::<Vec<_>>(), ids, "subscriber {i}: exactly the upstream's rows");
        txs.push(s.commits.len());
    }
    txs
}

pub const ROWS: u64 = 3;

/// Mock transactions 1..=n, each with its rows (ids (i-1)*ROWS ..).
pub fn check_mock(seen: &Seen, who: &str) -> usize {
    assert_eq!(seen.problems, Vec::<String>::new(), "{who}");
    for (i, (w, ids)) in seen.commits.iter().enumerate() {
        let tx = i as u64 + 1;
        assert_eq!(*w, lexi(tx), "{who}: commit #{tx}");
        let expected: Vec<i64> = ((tx - 1) * ROWS..tx * ROWS).map(|id| id as i64).collect();
        assert_eq!(*ids, expected, "{who}: rows of transaction {tx}");
    }
    seen.commits.len()
}

/// Both subscribers saw mock transactions 1..=N exactly once, and the log
/// holds whole transactions, a consecutive run of them (purged below the
/// acked floor). Returns the counts checked and the stored watermarks.
pub async fn check_mock_run(seen: &[Arc<Mutex<Seen>>], spec: &LogSpec) -> (Vec<usize>, Vec<String>) {
    let checked =
        seen.iter().enumerate().map(|(i, s)| check_mock(&s.lock().unwrap(), &format!("subscriber {i}"))).collect();
    spec.assert_whole().await;
    let stored = spec.committed().await;
    let first = stored.first().and_then(|w| sluice::watermark::from_lexi(w)).unwrap_or(1) as u64;
    let expected: Vec<String> = (first..first + stored.len() as u64).map(lexi).collect();
    assert_eq!(stored, expected, "the change log skips or repeats a transaction");
    (checked, stored)
}

/// Ends a MariaDB run: stops `writer` (see [`super::mariadb::Maria::writer`]),
/// checks that `db.events` holds exactly the ids written, waits for the
/// subscribers to have every row, stops `host`, and checks each row reached
/// each subscriber exactly once and the log holds whole transactions.
/// Returns the rows written and the transactions each subscriber saw.
pub async fn finish_maria_run(
    m: &super::mariadb::Maria,
    db: &str,
    stop: &std::sync::atomic::AtomicBool,
    writer: std::thread::JoinHandle<u64>,
    subs: Subscribers,
    host: &mut Host,
    spec: &LogSpec,
) -> (u64, Vec<usize>) {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rows = tokio::task::spawn_blocking(move || writer.join().unwrap()).await.unwrap();
    let upstream: Vec<i64> =
        m.sql(&format!("SELECT id FROM {db}.events ORDER BY id")).lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(upstream, (0..rows as i64).collect::<Vec<_>>(), "the upstream table holds what was written");
    subs.wait_for_rows(rows as usize, host).await;
    let seen = subs.stop().await;
    host.kill();
    let txs = each_row_exactly_once(&seen, &upstream);
    spec.assert_whole().await;
    m.sql(&format!("DROP DATABASE {db}"));
    (rows, txs)
}
