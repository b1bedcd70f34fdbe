//! The mariadb-source plugin: row events/s from MariaDB's binlog through the
//! plugin into a durable SQLite change log and one WebSocket subscriber,
//! beside the same reader and decoder built natively.
//!
//! The workload (100,000 row events in 100 transactions: 60k inserts, 30k
//! updates, 10k deletes, 100-byte rows) is written while Sluice is down, so
//! both readers stream the same backlog as fast as they can.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice::plugin::{Registry, SandboxLimits};
use sluice::source::{ChangeSource, Resume};

use super::{free_addr, http_status, peak_rss_mib, sluice_binary, split_frame};

const DB: &str = "sluice_bench_maria";
const ROWS: u64 = 100_000;

fn sql(socket: &str, sql: &str) -> anyhow::Result<String> {
    let out =
        Command::new("mariadb").args(["--no-defaults", "-S", socket, "-u", "root", "-N", "-B", "-e", sql]).output()?;
    anyhow::ensure!(out.status.success(), "{sql}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[derive(Default)]
struct Seen {
    changes: AtomicU64,
    last_commit: Mutex<String>,
}

async fn subscribe(addr: String, rv: String, seen: Arc<Seen>) -> anyhow::Result<()> {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message as Ws;
    let url = format!("ws://{addr}/replication/v6/changes?id=bench&replicaVersion={rv}&watermark={rv}");
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await?;
    while let Some(frame) = ws.next().await {
        let Ws::Text(text) = frame? else { continue };
        let (id, msg) = split_frame(&text)?;
        ws.send(Ws::Text(format!("{{\"ack\":{id}}}").into())).await?;
        if msg.starts_with("[\"data\"") {
            seen.changes.fetch_add(1, Ordering::Relaxed);
        } else if msg.starts_with("[\"commit\"") {
            let v: serde_json::Value = serde_json::from_str(msg)?;
            if let (Some(w), Ok(mut last)) = (v[2]["watermark"].as_str(), seen.last_commit.lock()) {
                *last = w.to_string();
            }
        }
    }
    Ok(())
}

fn start_sluice(addr: &str, config: &str, log: &std::path::Path) -> anyhow::Result<std::process::Child> {
    Ok(Command::new(sluice_binary())
        .args(["run", "--source", "mariadb-source", "--listen", addr, "--source-config", config])
        .arg("--plugins")
        .arg(super::plugin_dir())
        .arg("--change-db")
        .arg(format!("sqlite:{}", log.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log.with_extension("log"))?)
        .spawn()?)
}

async fn wait_for<F: Fn() -> bool>(what: &str, check: F) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

pub async fn run(
    registry: &std::sync::Arc<Registry>,
    addr_and_socket: (String, String),
    tmp: &std::path::Path,
) -> anyhow::Result<()> {
    let (server, socket) = addr_and_socket;
    let (host, port) = server.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("SLUICE_TEST_MARIADB is HOST:PORT"))?;
    sql(
        &socket,
        &format!(
            "CREATE USER IF NOT EXISTS 'bench'@'127.0.0.1' IDENTIFIED VIA mysql_native_password USING PASSWORD('bench');
             GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'bench'@'127.0.0.1';
             DROP DATABASE IF EXISTS {DB}; CREATE DATABASE {DB};
             CREATE TABLE {DB}.events (id int PRIMARY KEY, v int NOT NULL, filler varchar(100))"
        ),
    )?;
    let start_pos = sql(&socket, "SELECT @@gtid_binlog_pos")?;
    let config = serde_json::json!({
        "host": host, "port": port.parse::<u16>()?, "user": "bench", "password": "bench", "databases": [DB],
    })
    .to_string();
    let addr = free_addr();
    let log = tmp.join("mariadb.db");
    // The snapshot of the empty table, stored, then Sluice goes down.
    let mut child = start_sluice(&addr, &config, &log)?;
    let started = Instant::now();
    let rv = loop {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "sluice did not start");
        if let Ok(s) = http_status(&addr).await {
            // A replica version is reported only once its snapshot is
            // durable, so a restart resumes it.
            if let Some(rv) = s["replicaVersion"].as_str() {
                break rv.to_string();
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = child.kill();
    let _ = child.wait();

    let t0 = Instant::now();
    let mut stmts = Vec::new();
    for k in 0..60 {
        stmts.push(format!(
            "INSERT INTO {DB}.events WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < 1000) \
             SELECT n + {k} * 1000, n, REPEAT('x', 80) FROM s"
        ));
    }
    for k in 0..30 {
        stmts.push(format!("UPDATE {DB}.events SET v = v + 1 WHERE id > {} AND id <= {}", k * 1000, (k + 1) * 1000));
    }
    for k in 0..10 {
        stmts.push(format!(
            "DELETE FROM {DB}.events WHERE id > {} AND id <= {}",
            50_000 + k * 1000,
            50_000 + (k + 1) * 1000
        ));
    }
    sql(&socket, &stmts.join(";\n"))?;
    println!(
        "workload: {ROWS} row events (60k inserts, 30k updates, 10k deletes) in 100 transactions, written in {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    // Through the plugin: Sluice streams the backlog.
    let mut child = start_sluice(&addr, &config, &log)?;
    let t1 = Instant::now();
    let seen = Arc::new(Seen::default());
    let subscriber = loop {
        anyhow::ensure!(t1.elapsed() < Duration::from_secs(60), "sluice did not restart");
        if http_status(&addr).await.is_ok() {
            break tokio::spawn(subscribe(addr.clone(), rv.clone(), seen.clone()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let s = seen.clone();
    if let Err(e) = wait_for("the subscriber", move || s.changes.load(Ordering::Relaxed) >= ROWS).await {
        let sluice_log = std::fs::read_to_string(log.with_extension("log")).unwrap_or_default();
        let tail: Vec<&str> = sluice_log.lines().rev().take(20).collect();
        let got = seen.changes.load(Ordering::Relaxed);
        anyhow::bail!(
            "{e} ({got} of {ROWS} changes); sluice's log ends:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let delivered = t1.elapsed().as_secs_f64();
    let last = seen.last_commit.lock().map(|l| l.clone()).unwrap_or_default();
    loop {
        let stored = http_status(&addr).await.ok().and_then(|s| s["lastWatermark"].as_str().map(str::to_string));
        if stored.as_deref() >= Some(last.as_str()) {
            break;
        }
        anyhow::ensure!(t1.elapsed() < Duration::from_secs(300), "the change log did not reach {last}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let durable = t1.elapsed().as_secs_f64();
    let rss = peak_rss_mib(child.id()).unwrap_or(0.0);
    let _ = child.kill();
    let _ = child.wait();
    subscriber.abort();
    println!(
        "plugin (wasm32-wasip2): {:>7.0} row events/s to 1 subscriber, {:>7.0} row events/s durable in SQLite \
         (sync Full), from process start (plugin load included); sluice peak RSS {rss:.0} MiB",
        ROWS as f64 / delivered,
        ROWS as f64 / durable
    );

    // The plugin alone, in this process: the wasm reader and the boundary,
    // with no storage and no subscriber.
    let grant = sluice::plugin::net::grant_for(&config, &[])?;
    let mut source = registry
        .source("mariadb-source", config.clone(), SandboxLimits::default(), grant)
        .await
        .map_err(anyhow::Error::msg)?;
    let from = format!("{}.{start_pos}", mariadb_source::to_lexi(0));
    let t2 = Instant::now();
    let mut stream = source.open(Some(Resume { watermark: &from, replica_version: "00" })).await?;
    let mut n = 0u64;
    while n < ROWS {
        anyhow::ensure!(t2.elapsed() < Duration::from_secs(300), "the plugin stalled at {n}");
        let batch = stream.next_batch(512).await?;
        n += batch
            .iter()
            .filter(|m| {
                use sluice::source::model::Message as M;
                matches!(m, M::Insert(_) | M::Update(_) | M::Delete(_))
            })
            .count() as u64;
    }
    println!(
        "plugin alone (next-batch(512)):   {:>7.0} row events/s (reader, decoder and boundary; no storage)",
        ROWS as f64 / t2.elapsed().as_secs_f64()
    );
    drop(stream);

    // The same reader natively: TCP, decode, CRC, conversion to messages.
    let native = tokio::task::spawn_blocking(move || mariadb_source::stream_natively(&config, &start_pos, ROWS))
        .await?
        .map_err(|e| anyhow::anyhow!("native reader: {e}"))?;
    println!(
        "native (same reader and decoder):  {:>7.0} row events/s decoded into messages (no storage, no subscriber)",
        ROWS as f64 / native.as_secs_f64()
    );
    let _ = sql(&socket, &format!("DROP DATABASE IF EXISTS {DB}"));
    Ok(())
}
