//! Send lag, side by side in one run: a change-streamer subscriber on
//! Sluice (built-in Postgres source, SQLite change log) and one on
//! zero-cache 1.9.0's own change-streamer (its own Postgres source), both
//! fed by logical replication from the same table at the same time. Rows
//! are committed one per transaction, 1,000 a second, each stamped with the
//! time just before its commit; each subscriber, in this process, notes when
//! the row's message arrives. Both speak the same protocol
//! (`/replication/v6/changes`, every message acked, TCP_NODELAY as Zero's
//! client sets it), so the difference is the streamer's path from the WAL
//! to the subscriber's socket.
//!
//! Three windows: both streamers at once (the same commits reach both),
//! then zero-cache's with Sluice stopped, then Sluice's with zero-cache
//! stopped. Each reports the upstream's own share beside it: a commit's
//! round trip and how late the writer woke for its ticks.
//!
//! `SLUICE_BENCH_ZERO_HOG=N` keeps N threads spinning on the cores
//! throughout, for the tail when other work shares the machine.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message as Ws;
use zero_harness::{database_url, interop_dir, Upstream, ZeroCache};

use super::zero_cache::{connect, drop_slots_where, now_ms, spawn_postgres_sluice, Hog, Sluice};
use super::{free_addr, http_status, percentile, split_frame};

const DB: &str = "sluice_bench_lag";
const SLOT: &str = "sluice_bench_lag";
/// Connections committing in turn (one row each, a commit every
/// millisecond among them).
const WRITERS: usize = 4;

/// Each row a subscriber saw with its arrival lag: (row id, lag in µs).
type Lags = Vec<(u64, u64)>;

pub async fn run(server: &str, tmp: &Path) -> anyhow::Result<()> {
    let secs: u64 = std::env::var("SLUICE_BENCH_LAG_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    // One-row transactions per second (1,000; a low rate shows what waits
    // between quiet moments).
    let rate: u64 =
        std::env::var("SLUICE_BENCH_LAG_RATE").ok().and_then(|v| v.parse().ok()).unwrap_or(1000).clamp(1, 1000);
    let warm_secs: u64 = std::env::var("SLUICE_BENCH_ZERO_WARMUP_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    if !zero_harness::installed() {
        println!("(@rocicorp/zero is not installed in tests/interop: run `make interop-deps`; skipped)");
        return Ok(());
    }
    let admin = connect(server).await?;
    let ours = format!("(database = '{DB}' OR slot_name = '{SLOT}')");
    drop_slots_where(&admin, &ours).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    admin.batch_execute(&format!("CREATE DATABASE {DB}")).await?;
    let up_url = database_url(server, DB);
    let up = connect(&up_url).await?;
    // 100,000 rows: zero-cache's initial sync copies each table on a
    // connection of its own only while the big one is still copying; on
    // Node 20 a second COPY on one connection can hang (zero-cache warns of
    // it), which a table of 1,000 rows finished in 16 ms made happen.
    let rows: u64 = 100_000;
    up.batch_execute(&format!(
        "CREATE TABLE items (id int8 PRIMARY KEY, name text NOT NULL, t float8 NOT NULL);
         INSERT INTO items SELECT g, 'item number ' || g, 0 FROM generate_series(1, {rows}) g"
    ))
    .await?;
    up.batch_execute("VACUUM ANALYZE items").await?;
    let dir = tmp.join("lag");
    std::fs::create_dir_all(&dir)?;
    let _hog = Hog::from_env();

    // Zero's change-streamer first: its set-up creates its own schema and
    // publication; Sluice's source needs neither.
    let (zc_server, zc_dir, zc_up) = (server.to_string(), dir.clone(), up_url.clone());
    let zc = tokio::task::spawn_blocking(move || {
        ZeroCache::start("bench_lag_zc", Upstream::Postgres(zc_up), &zc_server, &zc_dir)
    })
    .await?;

    let addr = free_addr();
    let mut sluice = spawn_sluice(&dir, &addr, &up_url)?;
    let mut next = rows + 1;
    let zero_streamer = format!("ws://{}", zc.change_streamer());
    let sluice_streamer = format!("ws://{addr}");
    let timing = Timing { warm_secs, secs, rate };
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        writers.push(Arc::new(connect(&up_url).await?));
    }

    // Side by side: both streamers on the cores at once, as the same commits
    // reach both.
    let (rv, w) = sluice_position(&addr, &mut sluice, &dir).await?;
    let (zrv, zw) = replica_position(zc.replica())?;
    window(
        "side by side",
        &writers,
        &mut next,
        timing,
        vec![
            ("Sluice", sluice_streamer.clone(), rv, w),
            ("zero-cache's change-streamer", zero_streamer.clone(), zrv, zw),
        ],
    )
    .await?;
    // Each alone: Zero's with Sluice stopped, then Sluice's (started again
    // on its log and slot) with zero-cache stopped.
    drop(sluice);
    let (zrv, zw) = replica_position(zc.replica())?;
    window("alone", &writers, &mut next, timing, vec![("zero-cache's change-streamer", zero_streamer, zrv, zw)])
        .await?;
    drop(zc);
    let mut sluice = spawn_sluice(&dir, &addr, &up_url)?;
    let (rv, w) = sluice_position(&addr, &mut sluice, &dir).await?;
    window("alone", &writers, &mut next, timing, vec![("Sluice", sluice_streamer, rv, w)]).await?;
    drop(sluice);
    drop((up, writers));
    drop_slots_where(&admin, &ours).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    Ok(())
}

#[derive(Clone, Copy)]
struct Timing {
    /// Seconds of rows before the measured ones (not counted).
    warm_secs: u64,
    /// Seconds of measured rows.
    secs: u64,
    /// One-row transactions a second.
    rate: u64,
}

/// Sluice's replica version and last stored watermark, once it has a
/// snapshot.
async fn sluice_position(addr: &str, sluice: &mut Child, dir: &Path) -> anyhow::Result<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = http_status(addr).await.ok();
        let at = |k: &str| status.as_ref().and_then(|s| s[k].as_str().map(str::to_string));
        if let (Some(rv), Some(w)) = (at("replicaVersion"), at("lastWatermark")) {
            return Ok((rv, w));
        }
        anyhow::ensure!(Instant::now() < deadline, "Sluice did not store its snapshot");
        anyhow::ensure!(sluice.try_wait()?.is_none(), "Sluice exited; see {}", dir.join("sluice.log").display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One measured window: a subscriber on each of `streamers` (name, base
/// URL, replica version, watermark), a marker row that every one of them
/// must have received (so none starts behind), then `warm_secs` of rows
/// not counted and `secs` of rows measured, `rate` one-row transactions
/// a second.
async fn window(
    label: &str,
    writers: &[Arc<tokio_postgres::Client>],
    next: &mut u64,
    timing: Timing,
    streamers: Vec<(&str, String, String, String)>,
) -> anyhow::Result<()> {
    let marker = *next;
    let first_measured = marker + 1 + timing.warm_secs * timing.rate;
    let total = timing.secs * timing.rate;
    let last = first_measured + total - 1;
    // Committed after every writer is done, so it comes after all of them.
    let end = last + 1;
    let mut running = Vec::new();
    for (name, base, rv, watermark) in streamers {
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
        running.push((name, seen_rx, tokio::spawn(subscribe(base, rv, watermark, marker, end, seen_tx))));
    }
    writers[0].batch_execute(&format!("INSERT INTO items VALUES ({marker}, 'marker', 0)")).await?;
    *next += 1;
    for (name, seen, _) in &mut running {
        tokio::time::timeout(Duration::from_secs(180), seen)
            .await
            .map_err(|_| anyhow::anyhow!("{name}'s subscriber did not receive the marker row in 3 minutes"))??;
    }
    // The upstream's own share of the lag: each commit's round trip (WAL
    // flush included), and how late its writer woke for it. Writers take
    // turns, each on a connection of its own, so a round trip that takes
    // longer than a millisecond (a busy machine) does not slow the rate.
    let first = *next;
    let start = tokio::time::Instant::now();
    let mut writing = Vec::new();
    let writers_len = writers.len();
    let every = Duration::from_micros(writers_len as u64 * 1_000_000 / timing.rate);
    for (k, writer) in writers.iter().enumerate() {
        let writer = writer.clone();
        writing.push(tokio::spawn(async move {
            let (mut commits, mut wakes, mut since) = (Vec::new(), Vec::new(), None);
            let mut tick = tokio::time::interval_at(start + every / writers_len as u32 * k as u32, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for id in (first + k as u64..=last).step_by(writers_len) {
                let due = tick.tick().await;
                let t = now_ms();
                let woke = due.elapsed();
                let started = Instant::now();
                writer.batch_execute(&format!("INSERT INTO items VALUES ({id}, 'live {id}', {t})")).await?;
                if id >= first_measured {
                    since.get_or_insert(started);
                    commits.push((id, started.elapsed().as_micros() as u64));
                    wakes.push(woke.as_micros() as u64);
                }
            }
            anyhow::Ok((commits, wakes, since))
        }));
    }
    let (mut commits, mut wakes, mut since) = (Vec::new(), Vec::new(), None::<Instant>);
    for w in writing {
        let (c, wk, s) = w.await??;
        commits.extend(c);
        wakes.extend(wk);
        since = since.into_iter().chain(s).min();
    }
    writers[0].batch_execute(&format!("INSERT INTO items VALUES ({end}, 'end', 0)")).await?;
    *next = end + 1;
    // Each row's own commit round trip, to tell a tail that waited on the
    // upstream from one that waited on the streamer.
    let round_trip: std::collections::HashMap<u64, u64> = commits.iter().copied().collect();
    let mut commits: Vec<u64> = commits.into_iter().map(|(_, us)| us).collect();
    commits.sort_unstable();
    wakes.sort_unstable();
    // Writers that fell behind their ticks (a saturated machine) commit
    // slower than the rate offered: the rate they reached is reported.
    let rate = total as f64 / since.map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
    for (name, _, task) in running {
        let lags = tokio::time::timeout(Duration::from_secs(180), task)
            .await
            .map_err(|_| anyhow::anyhow!("{name}'s subscriber did not receive the last row in 3 minutes"))???;
        let measured: Vec<(u64, u64)> =
            lags.iter().filter(|(id, _)| (first_measured..=last).contains(id)).copied().collect();
        let mut lat: Vec<u64> = measured.iter().map(|(_, l)| *l).collect();
        lat.sort_unstable();
        // The rows above p99: how many of them spent at least half their lag
        // in their own commit (upstream), and their lags.
        let p99 = (percentile(&lat, 0.99) * 1000.0) as u64;
        let mut tail: Vec<(u64, u64)> = measured.iter().filter(|(_, l)| *l > p99).copied().collect();
        tail.sort_unstable_by_key(|(_, l)| std::cmp::Reverse(*l));
        let upstream_bound = tail.iter().filter(|(id, l)| round_trip.get(id).is_some_and(|rt| rt * 2 >= *l)).count();
        println!(
            "{name}, {label}: {} s of one-row transactions, {}/s offered ({} s before not counted): {} of {total} rows received; commit to subscriber p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms",
            timing.secs,
            timing.rate,
            timing.warm_secs,
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 0.999),
            lat.last().copied().unwrap_or(0) as f64 / 1000.0
        );
        let slowest: Vec<String> = tail
            .iter()
            .take(5)
            .map(|(id, l)| {
                format!("{:.1}/{:.1}", *l as f64 / 1000.0, round_trip.get(id).copied().unwrap_or(0) as f64 / 1000.0)
            })
            .collect();
        println!(
            "  {name}, {label}: of the {} rows above p99, {upstream_bound} spent at least half their lag in their own commit; the slowest, lag/commit ms: {}",
            tail.len(),
            slowest.join(" ")
        );
    }
    println!(
        "  upstream, {label}: {rate:.0} commits/s reached; a commit's round trip p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms; the writer woke late for its tick by p50 {:.2} ms, p99 {:.2} ms",
        percentile(&commits, 0.5),
        percentile(&commits, 0.99),
        percentile(&commits, 0.999),
        commits.last().copied().unwrap_or(0) as f64 / 1000.0,
        percentile(&wakes, 0.5),
        percentile(&wakes, 0.99)
    );
    Ok(())
}

/// The replica version and watermark of a zero-cache replica file, as its
/// own view-syncers subscribe with them (read with Zero's SQLite build:
/// the file is in wal2 mode).
fn replica_position(replica: &Path) -> anyhow::Result<(String, String)> {
    let read = |table: &str, column: &str| -> anyhow::Result<String> {
        let out = Command::new("node")
            .arg(interop_dir().join("replica-rows.mjs"))
            .arg(replica)
            .args([table, column])
            .output()?;
        anyhow::ensure!(out.status.success(), "reading {table}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        v["rows"][0][column].as_str().map(str::to_string).ok_or_else(|| anyhow::anyhow!("no {column} in {table}: {v}"))
    };
    Ok((read("_zero.replicationConfig", "replicaVersion")?, read("_zero.replicationState", "stateVersion")?))
}

fn spawn_sluice(dir: &Path, addr: &str, up_url: &str) -> anyhow::Result<Sluice> {
    spawn_postgres_sluice(dir, addr, &serde_json::json!({ "url": up_url, "slot": SLOT }), &[])
}

/// A subscriber at `base` (`ws://HOST:PORT`) from `watermark`: acks every
/// message as it reads it, says when row `marker` has come, and notes each
/// inserted row's lag from the time stamped in it, until row `last` (the
/// window's end marker) has come.
async fn subscribe(
    base: String,
    rv: String,
    watermark: String,
    marker: u64,
    last: u64,
    marker_seen: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<Lags> {
    let url =
        format!("{base}/replication/v6/changes?id=lag-bench&taskID=bench&replicaVersion={rv}&watermark={watermark}");
    // TCP_NODELAY, as Zero's client (Node's `ws`) sets it: acks go out at
    // once instead of waiting on the server's delayed ACK.
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(&url, None, true).await?;
    let mut marker_seen = Some(marker_seen);
    let mut lags = Lags::new();
    while let Some(frame) = ws.next().await {
        let text = match frame? {
            Ws::Text(text) => text,
            Ws::Close(c) => anyhow::bail!("{base} closed the subscription: {c:?}"),
            _ => continue,
        };
        let arrived = now_ms();
        let (id, msg) = split_frame(&text)?;
        let mut done = false;
        if msg.starts_with("[\"data\"") {
            let v: serde_json::Value = serde_json::from_str(msg)?;
            let row = &v[1]["new"];
            let t = row["t"].as_f64().unwrap_or(0.0);
            let row_id = row["id"].as_u64().or_else(|| row["id"].as_str().and_then(|s| s.parse().ok())).unwrap_or(0);
            if row_id == marker {
                if let Some(seen) = marker_seen.take() {
                    let _ = seen.send(());
                }
            }
            if t > 0.0 {
                lags.push((row_id, ((arrived - t).max(0.0) * 1000.0) as u64));
            }
            done = row_id == last;
        } else if msg.starts_with("[\"error\"") {
            anyhow::bail!("{base} sent an error: {msg}");
        }
        ws.send(Ws::Text(format!("{{\"ack\":{id}}}").into())).await?;
        if done {
            return Ok(lags);
        }
    }
    anyhow::bail!("{base}: the stream ended before row {last}")
}
