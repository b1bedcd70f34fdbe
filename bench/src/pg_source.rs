//! The built-in Postgres source under pgbench-style workloads: a `sluice`
//! process replicates a database of the bench server into a durable SQLite
//! change log and one WebSocket subscriber, which counts the rows it receives
//! and the lag from each upstream commit (its commit timestamp) to receipt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{free_addr, peak_rss_mib, percentile, sluice_binary, split_frame};

const DB: &str = "sluice_bench_src";
const SLOT: &str = "sluice_bench";

async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

fn now_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1000.0
}

/// What the subscriber has seen so far.
#[derive(Default)]
struct Seen {
    changes: AtomicU64,
    /// Commit-to-receipt lag of each transaction, in µs.
    lags: Mutex<Vec<u64>>,
}

async fn subscribe(addr: String, replica_version: String, seen: Arc<Seen>) -> anyhow::Result<()> {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message as Ws;
    let url = format!(
        "ws://{addr}/replication/v6/changes?id=bench&replicaVersion={replica_version}&watermark={replica_version}"
    );
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await?;
    while let Some(frame) = ws.next().await {
        let Ws::Text(text) = frame? else { continue };
        let (id, msg) = split_frame(&text)?;
        ws.send(Ws::Text(format!("{{\"ack\":{id}}}").into())).await?;
        if msg.starts_with("[\"data\"") {
            seen.changes.fetch_add(1, Ordering::Relaxed);
        } else if msg.starts_with("[\"commit\"") {
            let received = now_ms();
            let msg: serde_json::Value = serde_json::from_str(msg)?;
            if let Some(committed) = msg[1]["commitTimeMs"].as_f64() {
                let lag_us = ((received - committed) * 1000.0).max(0.0) as u64;
                seen.lags.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push(lag_us);
            }
        } else if msg.starts_with("[\"error\"") {
            anyhow::bail!("subscriber: {msg}");
        }
    }
    Ok(())
}

async fn replica_version(addr: &str) -> anyhow::Result<Option<String>> {
    Ok(super::http_status(addr).await?["replicaVersion"].as_str().map(str::to_string))
}

/// One workload: `txs` transactions of `rows` rows, spread over `clients`
/// connections, at most `rate` transactions/s in total (0: as fast as the
/// upstream takes them).
struct Workload {
    name: &'static str,
    sql: String,
    rows: u64,
    txs: u64,
    clients: u64,
    rate: f64,
}

pub async fn run(url: &str, tmp: &std::path::Path) -> anyhow::Result<()> {
    run_with(url, tmp, None).await
}

/// With `sslmode`, the source connects with it (the cost of TLS): the
/// snapshot and two of the workloads only.
pub async fn run_with(url: &str, tmp: &std::path::Path, sslmode: Option<&str>) -> anyhow::Result<()> {
    let admin = connect(url).await?;
    admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        ))
        .await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    admin.batch_execute(&format!("CREATE DATABASE {DB}")).await?;
    let db_url = format!("{}/{DB}", url.rsplit_once('/').map(|(b, _)| b).unwrap_or(url));
    let db = connect(&db_url).await?;
    let accounts = 100_000u64;
    db.batch_execute(&format!(
        "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int NOT NULL, filler char(84));
         INSERT INTO accounts SELECT g, 0, '' FROM generate_series(1, {accounts}) g;
         CREATE TABLE history (id bigserial PRIMARY KEY, aid int, delta int, mtime timestamptz DEFAULT now(), filler text)"
    ))
    .await?;
    db.batch_execute("VACUUM ANALYZE accounts").await?;

    let addr = free_addr();
    let log = tmp.join("pgsource.db");
    // A log left by an earlier run would be served (and replaced) first.
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(tmp.join(format!("pgsource.db{suffix}")));
    }
    let source_url = match sslmode {
        Some(mode) => format!("{db_url}?sslmode={mode}"),
        None => db_url.clone(),
    };
    let config = serde_json::json!({ "url": source_url, "slot": SLOT }).to_string();
    let mut child = std::process::Command::new(sluice_binary())
        .args(["run", "--source", "postgres", "--listen", &addr, "--source-config", &config])
        .arg("--change-db")
        .arg(format!("sqlite:{}", log.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(tmp.join("pgsource.log"))?)
        .spawn()?;
    let started = Instant::now();
    let rv = loop {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "sluice did not start");
        if let Ok(Some(rv)) = replica_version(&addr).await {
            break rv;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let seen = Arc::new(Seen::default());
    let subscriber = tokio::spawn(subscribe(addr.clone(), rv, seen.clone()));
    let sluice_log = tmp.join("pgsource.log");
    let wait_for = |n: u64| {
        let (seen, sluice_log) = (seen.clone(), sluice_log.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            while seen.changes.load(Ordering::Relaxed) < n {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the subscriber stalled at {} of {n} changes; sluice's log:\n{}",
                    seen.changes.load(Ordering::Relaxed),
                    std::fs::read_to_string(&sluice_log).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<_, anyhow::Error>(())
        }
    };
    wait_for(accounts).await?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "initial snapshot: {accounts} rows of 100 B (pgbench accounts) to the subscriber in {secs:.2} s from process start: {:.0} rows/s",
        accounts as f64 / secs
    );

    let small = "repeat('x', 80)";
    let kib = "repeat('x', 1000)";
    let workloads = [
        Workload {
            name: "pgbench tpcb-like (update account + insert history)",
            sql: "BEGIN; UPDATE accounts SET abalance = abalance + 1 WHERE aid = {aid};
                  INSERT INTO history (aid, delta, filler) VALUES ({aid}, 1, ''); COMMIT"
                .into(),
            rows: 2,
            txs: 10_000,
            clients: 4,
            rate: 0.0,
        },
        Workload {
            name: "1 row/tx, 100 B",
            sql: format!("INSERT INTO history (aid, delta, filler) VALUES ({{aid}}, 1, {small})"),
            rows: 1,
            txs: 20_000,
            clients: 4,
            rate: 0.0,
        },
        Workload {
            name: "100 rows/tx, 100 B",
            sql: format!(
                "INSERT INTO history (aid, delta, filler) SELECT g, 1, {small} FROM generate_series(1, 100) g"
            ),
            rows: 100,
            txs: 2_000,
            clients: 2,
            rate: 0.0,
        },
        Workload {
            name: "1 row/tx, 1 KiB",
            sql: format!("INSERT INTO history (aid, delta, filler) VALUES ({{aid}}, 1, {kib})"),
            rows: 1,
            txs: 10_000,
            clients: 4,
            rate: 0.0,
        },
        Workload {
            name: "100 rows/tx, 1 KiB",
            sql: format!("INSERT INTO history (aid, delta, filler) SELECT g, 1, {kib} FROM generate_series(1, 100) g"),
            rows: 100,
            txs: 500,
            clients: 2,
            rate: 0.0,
        },
        Workload {
            name: "1 row/tx, 100 B, at 2,000 tx/s",
            sql: format!("INSERT INTO history (aid, delta, filler) VALUES ({{aid}}, 1, {small})"),
            rows: 1,
            txs: 10_000,
            clients: 2,
            rate: 2000.0,
        },
        Workload {
            name: "1 row/tx, 100 B, at 500 tx/s",
            sql: format!("INSERT INTO history (aid, delta, filler) VALUES ({{aid}}, 1, {small})"),
            rows: 1,
            txs: 2_500,
            clients: 1,
            rate: 500.0,
        },
    ];
    let chosen = |w: &Workload| sslmode.is_none() || w.name == "1 row/tx, 100 B" || w.name == "100 rows/tx, 1 KiB";
    for w in workloads.into_iter().filter(chosen) {
        let base = seen.changes.load(Ordering::Relaxed);
        if let Ok(mut lags) = seen.lags.lock() {
            lags.clear();
        }
        let t0 = Instant::now();
        let per_client = w.txs / w.clients;
        let mut writers = Vec::new();
        for c in 0..w.clients {
            let (url, sql, rate) = (db_url.clone(), w.sql.clone(), w.rate / w.clients as f64);
            writers.push(tokio::spawn(async move {
                let client = connect(&url).await?;
                let start = Instant::now();
                for i in 0..per_client {
                    if rate > 0.0 {
                        let due = start + Duration::from_secs_f64(i as f64 / rate);
                        tokio::time::sleep_until(due.into()).await;
                    }
                    let aid = (c * per_client + i) % 100_000 + 1;
                    client.batch_execute(&sql.replace("{aid}", &aid.to_string())).await?;
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for wr in writers {
            wr.await??;
        }
        let upstream_secs = t0.elapsed().as_secs_f64();
        let expected = base + per_client * w.clients * w.rows;
        wait_for(expected).await?;
        let secs = t0.elapsed().as_secs_f64();
        let mut lags = seen.lags.lock().map(|l| l.clone()).unwrap_or_default();
        lags.sort_unstable();
        let rows = per_client * w.clients * w.rows;
        println!(
            "{:<52} {rows:>7} rows: {:>7.0} rows/s delivered (upstream wrote them at {:>7.0}/s), lag commit->subscriber p50 {:>6.2} ms p99 {:>7.2} ms",
            w.name,
            rows as f64 / secs,
            rows as f64 / upstream_secs,
            percentile(&lags, 0.5),
            percentile(&lags, 0.99)
        );
    }
    let rss = peak_rss_mib(child.id());
    if sslmode.is_none() {
        println!("sluice peak RSS over the Postgres source runs: {:.0} MiB", rss.unwrap_or(0.0));
    }
    let _ = child.kill();
    let _ = child.wait();
    subscriber.abort();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{SLOT}' AND NOT active"
        ))
        .await;
    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await;
    Ok(())
}
