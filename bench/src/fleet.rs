//! Thousands of subscribers on one `sluice run` process (mock source, SQLite
//! change log): a flood of peers that never acknowledge beside a
//! well-behaved subscriber, many catch-ups of the same log at once (shared
//! scans against one scan each), and idle connections.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::lean_ws::{self, LeanSocket};
use crate::{cpu_seconds, frame_parts, free_addr, http_status, mock_sluice, peak_rss_mib, percentile};

/// A `sluice run` the bench started; stopped when dropped, also when a part
/// fails half-way.
struct Sluice(Child);

impl Sluice {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `sluice run` on the mock source with `config`, and its address.
async fn start(tmp: &Path, name: &str, config: serde_json::Value, extra: &[&str]) -> anyhow::Result<(Sluice, String)> {
    let addr = free_addr();
    let db = tmp.join(format!("fleet-{name}.db"));
    let child = Sluice(
        mock_sluice(&addr, &db, &config)
            .args(["--max-connections", "0"])
            .args(extra)
            .stdout(Stdio::null())
            // Sluice's log, for when a part fails.
            .stderr(std::fs::File::create(std::env::temp_dir().join("sluice-bench-fleet.log"))?)
            .spawn()?,
    );
    let started = Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "sluice did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((child, addr))
}

fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Waits until `/status` satisfies `check`.
async fn wait_status(
    addr: &str,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let started = Instant::now();
    loop {
        if let Ok(s) = http_status(addr).await {
            if check(&s) {
                return Ok(s);
            }
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(600), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The subscription path for subscriber `id` from `watermark`.
fn changes_path(id: &str, watermark: &str) -> String {
    format!("/replication/v6/changes?id={id}&replicaVersion=00&watermark={watermark}")
}

/// A peer that reads and never acknowledges; when closed it comes back
/// from watermark 00, as a fleet of such peers would.
async fn never_acks(addr: String, id: usize, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        if let Ok((mut ws, _)) =
            tokio_tungstenite::connect_async(format!("ws://{addr}{}", changes_path(&format!("flood-{id}"), "00"))).await
        {
            while let Some(Ok(_)) = ws.next().await {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A subscriber from `from` that acknowledges every message; returns the
/// latencies (µs) of commits the source wrote after it was connected, until `last`.
/// It uses the lean client so that a thousand of them leave the cores to `sluice`.
async fn acking(
    addr: String,
    id: String,
    from: String,
    last: String,
    counted: Arc<AtomicU64>,
) -> anyhow::Result<Vec<u64>> {
    let now_us = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64);
    let mut ws = LeanSocket::connect(&addr, &changes_path(&id, &from)).await?;
    let mut latencies = Vec::new();
    let mut in_tx = 0u64;
    // Latency counts commits the source wrote once this subscriber was live
    // (its first message, the status, arrived); earlier ones came from the log.
    let mut live_from: Option<u64> = None;
    // Every transaction arrives once and in order: commit watermarks rise.
    let mut last_commit = String::new();
    let mut ack = Vec::with_capacity(32);
    loop {
        // Everything read in one go is acked with one write.
        while let Some(frame) = ws.buffered_frame()? {
            match frame.opcode {
                lean_ws::TEXT => {}
                lean_ws::CLOSE => anyhow::bail!("{id}: closed by the server"),
                _ => continue,
            }
            let payload = ws.payload(&frame);
            let (n, at) = frame_parts(payload)?;
            let msg = &payload[at];
            if live_from.is_none() {
                live_from = Some(now_us()?);
            }
            let mut done = false;
            if msg.starts_with(b"[\"data\"") {
                in_tx += 1;
            } else if msg.starts_with(b"[\"commit\"") {
                counted.fetch_add(std::mem::take(&mut in_tx), Ordering::Relaxed);
                let msg: serde_json::Value = serde_json::from_slice(msg)?;
                if let Some(sent) = msg[1]["sentAtUs"].as_u64().filter(|s| Some(*s) >= live_from) {
                    latencies.push(now_us()?.saturating_sub(sent));
                }
                let watermark = msg[2]["watermark"].as_str().unwrap_or_default();
                anyhow::ensure!(*watermark > *last_commit, "{id}: commit {watermark} after {last_commit}");
                last_commit = watermark.to_string();
                done = watermark == last;
            } else if msg.starts_with(b"[\"error\"") {
                anyhow::bail!("{id}: {}", String::from_utf8_lossy(msg));
            }
            ack.clear();
            write!(ack, "{{\"ack\":{n}}}")?;
            ws.queue_text(&ack);
            if done {
                ws.flush().await?;
                return Ok(latencies);
            }
        }
        ws.flush().await?;
        anyhow::ensure!(ws.read_more().await?, "{id}: closed by the server");
    }
}

pub async fn run(tmp: &Path) -> anyhow::Result<()> {
    let sizes = |var: &str, default: &[usize]| -> Vec<usize> {
        std::env::var(var)
            .ok()
            .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
            .unwrap_or_else(|| default.to_vec())
    };
    // SLUICE_BENCH_FLEET=flood,catchup,idle picks parts (all by default).
    let parts = std::env::var("SLUICE_BENCH_FLEET").unwrap_or_else(|_| "flood,catchup,idle".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    if part("flood") {
        flood(tmp, sizes("SLUICE_BENCH_FLOOD", &[2000])[0]).await?;
    }
    if part("catchup") {
        // SLUICE_BENCH_CATCHUP=subscribers,changes; SLUICE_BENCH_CATCHUP_MODES=shared,independent
        let catchup_size = sizes("SLUICE_BENCH_CATCHUP", &[1000, 20_000]);
        let modes = std::env::var("SLUICE_BENCH_CATCHUP_MODES").unwrap_or_else(|_| "shared,independent".into());
        let mode = |name: &str| modes.split(',').any(|m| m.trim() == name);
        for shared in [true, false].into_iter().filter(|&shared| mode(if shared { "shared" } else { "independent" })) {
            catchups(tmp, catchup_size[0], catchup_size[1], shared).await?;
        }
    }
    if part("idle") {
        idle(tmp, sizes("SLUICE_BENCH_IDLE", &[10_000])[0]).await?;
    }
    Ok(())
}

/// `n` peers that never acknowledge, from watermark 00 (and back when
/// closed), while the source writes 200 transactions/s; one subscriber at
/// the head acknowledges and measures commit latency.
async fn flood(tmp: &Path, n: usize) -> anyhow::Result<()> {
    let secs = 30u64;
    // 10 s of history first, then the flood for the rest.
    let txs = 200 * (secs + 10);
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": 10, "row_bytes": 100, "rate": 200.0, "timestamps": true});
    let (child, addr) = start(tmp, "flood", config, &[]).await?;
    let head = sluice::watermark::to_lexi(2000);
    wait_status(&addr, "10 s of history", |s| s["lastWatermark"].as_str().is_some_and(|w| w >= head.as_str())).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let peers: Vec<_> = (0..n).map(|i| tokio::spawn(never_acks(addr.clone(), i, stop.clone()))).collect();
    let from = http_status(&addr).await?["lastWatermark"].as_str().unwrap_or("00").to_string();
    let last = sluice::watermark::to_lexi(txs as u128);
    let sampling = Arc::new(AtomicBool::new(true));
    let watch = {
        let (addr, sampling) = (addr.clone(), sampling.clone());
        tokio::spawn(async move {
            // The most held for subscribers, sampled every 100 ms.
            let (mut most, mut closed) = (0u64, 0u64);
            while sampling.load(Ordering::Relaxed) {
                if let Ok(s) = http_status(&addr).await {
                    most = most.max(s["subscriberMemory"]["usedBytes"].as_u64().unwrap_or(0));
                    closed = s["subscriberMemory"]["closedTotal"].as_u64().unwrap_or(0);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (most, closed)
        })
    };
    let mut latencies =
        acking(addr.clone(), "well-behaved".into(), from, last.clone(), Arc::new(AtomicU64::new(0))).await?;
    stop.store(true, Ordering::Relaxed);
    let peak = peak_rss_mib(child.id()).unwrap_or(0.0);
    sampling.store(false, Ordering::Relaxed);
    let (most, closed) = watch.await?;
    for p in peers {
        p.abort();
    }
    // What stays once the peers are gone.
    wait_status(&addr, "the flood to leave", |s| s["subscribers"].as_u64() == Some(0)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_mib(child.id()).unwrap_or(0.0);
    let left = http_status(&addr).await?;
    let (held_after, scans_after) = (left["subscriberMemory"]["usedBytes"].clone(), left["catchup"]["scans"].clone());
    drop(child);
    if let Ok(path) = std::env::var("SLUICE_BENCH_DUMP") {
        let lines: Vec<String> = latencies.iter().map(|l| l.to_string()).collect();
        std::fs::write(path, lines.join("\n"))?;
    }
    latencies.sort_unstable();
    println!(
        "{n} peers never acking + 1 at the head, source at 200 tx/s for {secs} s: head commit latency p50 {:.2} ms p99 {:.2} ms ({} commits); \
         held for subscribers at most {:.0} MiB (budget 512), {closed} closed by the budget; sluice peak RSS {peak:.0} MiB, {after:.0} MiB after they left (then held {held_after} B, {scans_after} scans running)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.len(),
        most as f64 / (1 << 20) as f64,
    );
    Ok(())
}

/// `n` subscribers catching up the same `changes` at once.
async fn catchups(tmp: &Path, n: usize, changes: usize, shared: bool) -> anyhow::Result<()> {
    let txs = changes / 10;
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": 10, "row_bytes": 100});
    let name = if shared { "catchup-shared" } else { "catchup-independent" };
    let extra: &[&str] = if shared { &[] } else { &["--no-shared-catchup"] };
    let (child, addr) = start(tmp, name, config, extra).await?;
    let last = sluice::watermark::to_lexi(txs as u128);
    wait_status(&addr, "the log to be stored", |s| s["lastWatermark"].as_str() == Some(last.as_str())).await?;
    let counts: Vec<_> = (0..n).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let t0 = Instant::now();
    let cpu0 = cpu_seconds(child.id()).unwrap_or(0.0);
    let clients_cpu0 = cpu_seconds(std::process::id()).unwrap_or(0.0);
    let subs: Vec<_> = counts
        .iter()
        .enumerate()
        .map(|(i, counted)| {
            tokio::spawn(acking(addr.clone(), format!("catchup-{i}"), "00".into(), last.clone(), counted.clone()))
        })
        .collect();
    for s in subs {
        s.await??;
    }
    // Each got every change once.
    let short: Vec<_> = counts
        .iter()
        .enumerate()
        .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
        .filter(|(_, c)| *c != changes as u64)
        .collect();
    anyhow::ensure!(short.is_empty(), "subscribers that did not get {changes} changes (id, count): {short:?}");
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(child.id()).unwrap_or(0.0) - cpu0;
    let clients_cpu = cpu_seconds(std::process::id()).unwrap_or(0.0) - clients_cpu0;
    let status = http_status(&addr).await?;
    let peak = peak_rss_mib(child.id()).unwrap_or(0.0);
    drop(child);
    let delivered: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    let read = status["catchup"]["rowsRead"].as_u64().unwrap_or(0);
    println!(
        "{n} subscribers catching up {changes} changes at once, {}: {:.0} changes/s delivered in total ({delivered} in {secs:.1} s), \
         sluice CPU {:.2} s per million delivered (the bench's clients {:.2}), log read {:.1} times ({} scans), sluice peak RSS {peak:.0} MiB",
        if shared { "shared scans" } else { "one scan each" },
        delivered as f64 / secs,
        cpu / (delivered.max(1) as f64 / 1e6),
        clients_cpu / (delivered.max(1) as f64 / 1e6),
        read as f64 / (changes as f64 * 1.2),
        status["catchup"]["scansTotal"],
    );
    Ok(())
}

/// `n` subscribers at the head that acknowledge what they get from a source
/// writing one transaction a second: sluice's memory per connection.
async fn idle(tmp: &Path, n: usize) -> anyhow::Result<()> {
    let config = serde_json::json!({"transactions": 1_000_000, "rows_per_tx": 1, "row_bytes": 100, "rate": 1.0});
    let (child, addr) = start(tmp, "idle", config, &[]).await?;
    let status = wait_status(&addr, "a stored transaction", |s| s["lastWatermark"].is_string()).await?;
    let from = status["lastWatermark"].as_str().unwrap_or("00").to_string();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = rss_mib(child.id()).unwrap_or(0.0);
    let never = "~".to_string();
    let subs: Vec<_> = (0..n)
        .map(|i| {
            tokio::spawn(acking(
                addr.clone(),
                format!("idle-{i}"),
                from.clone(),
                never.clone(),
                Arc::new(AtomicU64::new(0)),
            ))
        })
        .collect();
    wait_status(&addr, "every idle subscriber", |s| s["subscribers"].as_u64() == Some(n as u64)).await?;
    // Two more transactions reach everyone.
    let now = http_status(&addr).await?["lastWatermark"].as_str().unwrap_or("").to_string();
    wait_status(&addr, "two more transactions", |s| s["lastWatermark"].as_str().is_some_and(|w| w > now.as_str()))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_mib(child.id()).unwrap_or(0.0);
    for s in subs {
        s.abort();
    }
    drop(child);
    println!(
        "{n} idle subscribers acking at the head: sluice RSS {before:.0} MiB before, {after:.0} MiB with them: {:.1} KiB each",
        (after - before) * 1024.0 / n as f64
    );
    Ok(())
}
