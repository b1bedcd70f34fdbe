//! A real zero-cache 1.9.0 fed two ways from the same Postgres table, in one
//! run:
//!
//! 1. Postgres -> Sluice (built-in source, table state kept) -> zero-cache
//!    through Zero's custom change-source protocol;
//! 2. Postgres -> zero-cache's own Postgres change source.
//!
//! For each: the initial sync of the table (from process start until
//! zero-cache reports ready, which it does once its replica holds every
//! row) and the live latency from an upstream commit to the row being
//! readable in zero-cache's replica file, at 1,000 changes/s.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use zero_harness::{database_url, interop_dir, Upstream, ZeroCache};

use super::{free_addr, percentile, sluice_binary};

const DB: &str = "sluice_bench_zero";
const SLOT: &str = "sluice_bench_zero";

fn now_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1000.0
}

async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

/// Drops the replication slots on the bench database (Sluice's, and the
/// ones zero-cache's own source made), so the database can be dropped.
async fn drop_slots(admin: &tokio_postgres::Client) -> anyhow::Result<()> {
    admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE database = '{DB}' OR slot_name = '{SLOT}'"
        ))
        .await?;
    Ok(())
}

pub async fn run(server: &str, tmp: &Path) -> anyhow::Result<()> {
    let rows: u64 = std::env::var("SLUICE_BENCH_ZERO_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let live_secs: u64 = std::env::var("SLUICE_BENCH_ZERO_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    if !zero_harness::installed() {
        println!("(@rocicorp/zero is not installed in tests/interop: run `make interop-deps`; skipped)");
        return Ok(());
    }
    let admin = connect(server).await?;
    drop_slots(&admin).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    admin.batch_execute(&format!("CREATE DATABASE {DB}")).await?;
    let up_url = database_url(server, DB);
    let up = connect(&up_url).await?;
    let loaded = Instant::now();
    up.batch_execute(&format!(
        "CREATE TABLE items (id int8 PRIMARY KEY, name text NOT NULL, t float8 NOT NULL);
         INSERT INTO items SELECT g, 'item number ' || g, 0 FROM generate_series(1, {rows}) g"
    ))
    .await?;
    up.batch_execute("VACUUM ANALYZE items").await?;
    println!("upstream: {rows} rows (int8 id, ~20 B text, float8) loaded in {:.1} s", loaded.elapsed().as_secs_f64());
    let dir = tmp.join("zero");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("permissions.json"),
        r#"{"tables": {"items": {"row": {"select": [["allow", {"type": "and", "conditions": []}]]}}}}"#,
    )?;

    // 1. Through Sluice.
    let addr = free_addr();
    let started = Instant::now();
    let mut sluice = spawn_sluice(&dir, &addr, &up_url)?;
    let deadline = Instant::now() + Duration::from_secs(1200);
    while super::http_status(&addr).await.ok().and_then(|s| s["replicaVersion"].as_str().map(str::to_string)).is_none()
    {
        anyhow::ensure!(Instant::now() < deadline, "Sluice did not store its snapshot");
        anyhow::ensure!(sluice.try_wait()?.is_none(), "Sluice exited; see {}", dir.join("sluice.log").display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "Sluice: its snapshot of {rows} rows durable (change log + table state, SQLite) {secs:.1} s after process start: {:.0} rows/s",
        rows as f64 / secs
    );
    let (messages, secs) = read_initial_sync(&addr).await?;
    println!(
        "Sluice: the initial sync ({messages} messages) read by a client that only counts them, in {secs:.2} s: {:.0} rows/s",
        rows as f64 / secs
    );
    let (zc, secs) = start_zero_cache("bench_zc_sluice", Upstream::Sluice(addr.clone()), server, &dir).await?;
    println!(
        "zero-cache on Sluice: initial sync of {rows} rows, process start to ready, {secs:.1} s: {:.0} rows/s",
        rows as f64 / secs
    );
    live_latency("zero-cache on Sluice", &zc, &up, rows, live_secs).await?;
    drop(zc);
    let _ = sluice.kill();
    let _ = sluice.wait();
    up.batch_execute(&format!("DELETE FROM items WHERE id > {rows}")).await?;
    drop_slots(&admin).await?;

    // 2. zero-cache's own Postgres source, on the same rows.
    let (zc, secs) = start_zero_cache("bench_zc_pg", Upstream::Postgres(up_url.clone()), server, &dir).await?;
    println!(
        "zero-cache on its own Postgres source: initial sync of {rows} rows, process start to ready, {secs:.1} s: {:.0} rows/s",
        rows as f64 / secs
    );
    live_latency("zero-cache on its own Postgres source", &zc, &up, rows, live_secs).await?;
    drop(zc);
    drop(up);
    drop_slots(&admin).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    Ok(())
}

/// Reads one initial sync from Sluice's `/changes/v0/stream` as fast as it
/// comes, counting messages until the commit: Sluice's side of the initial
/// sync, without zero-cache's work of applying it.
async fn read_initial_sync(addr: &str) -> anyhow::Result<(u64, f64)> {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message as Ws;
    let started = Instant::now();
    let url = format!("ws://{addr}/changes/v0/stream?appID=bench&shardNum=0");
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await?;
    let mut messages = 0u64;
    while let Some(frame) = ws.next().await {
        let Ws::Text(text) = frame? else { continue };
        messages += 1;
        if text.starts_with("[\"commit\"") {
            return Ok((messages, started.elapsed().as_secs_f64()));
        }
    }
    anyhow::bail!("Sluice closed the stream before the initial sync's commit")
}

fn spawn_sluice(dir: &Path, addr: &str, up_url: &str) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join("sluice.log"))?;
    let config = serde_json::json!({ "url": up_url, "slot": SLOT }).to_string();
    Ok(Command::new(sluice_binary())
        .args(["run", "--source", "postgres", "--source-config", &config, "--listen", addr, "--table-state"])
        .arg("--change-db")
        .arg(format!("sqlite:{}", dir.join("sluice.db").display()))
        .arg("--zero-permissions")
        .arg(dir.join("permissions.json"))
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()?)
}

/// Starts a zero-cache and returns it with the seconds from its start until
/// it was ready.
async fn start_zero_cache(
    name: &str,
    upstream: Upstream,
    server: &str,
    dir: &Path,
) -> anyhow::Result<(ZeroCache, f64)> {
    let (name, server, dir) = (name.to_string(), server.to_string(), dir.to_path_buf());
    Ok(tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let zc = ZeroCache::start(&name, upstream, &server, &dir);
        (zc, started.elapsed().as_secs_f64())
    })
    .await?)
}

/// Commits 10 rows every 10 ms for `secs` seconds (1,000 changes/s), each
/// stamped with the time just before its commit, while a watcher reads
/// zero-cache's replica file; prints p50/p99/max of commit to readable.
async fn live_latency(
    what: &str,
    zc: &ZeroCache,
    up: &tokio_postgres::Client,
    after: u64,
    secs: u64,
) -> anyhow::Result<()> {
    let total = secs * 1000;
    let watcher = Command::new("node")
        .arg(interop_dir().join("replica-latency.mjs"))
        .arg(zc.replica())
        .args(["items", &after.to_string(), &total.to_string(), &((secs + 60) * 1000).to_string()])
        .current_dir(interop_dir())
        .stdout(Stdio::piped())
        .spawn()?;
    let watching = tokio::task::spawn_blocking(move || watcher.wait_with_output());
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut next = after + 1;
    for _ in 0..secs * 100 {
        tick.tick().await;
        let t = now_ms();
        let values: Vec<String> = (next..next + 10).map(|id| format!("({id}, 'live {id}', {t})")).collect();
        up.batch_execute(&format!("INSERT INTO items VALUES {}", values.join(","))).await?;
        next += 10;
    }
    let out = watching.await??;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut lat: Vec<u64> = report["latenciesMs"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).map(|ms| (ms.max(0.0) * 1000.0) as u64).collect())
        .unwrap_or_default();
    lat.sort_unstable();
    println!(
        "{what}: live, 1,000 changes/s (10-row commits) for {secs} s: {} of {total} rows seen; commit to readable in the replica p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        lat.len(),
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    Ok(())
}
