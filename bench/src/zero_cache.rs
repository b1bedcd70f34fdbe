//! A real zero-cache 1.9.0 fed three ways from the same Postgres table, in
//! one run:
//!
//! 1. Postgres -> Sluice (built-in source, table state kept) -> zero-cache
//!    through Zero's custom change-source protocol;
//! 2. Postgres -> Sluice -> a zero-cache view-syncer on Sluice's
//!    `/replication/v6/changes`, its replica written by
//!    `tools/zero-replica.mjs` (and a second one started from a copy of a
//!    replica the tool keeps current beside Sluice: its start only);
//! 3. Postgres -> zero-cache's own Postgres change source (single node).
//!
//! For each: the start-up (from process start until zero-cache reports
//! ready, which includes its initial sync) and the live latency at 1,000
//! changes/s from an upstream commit to the row being readable in
//! zero-cache's replica file and, for 2 and 3, to a Zero client showing it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zero_harness::{database_url, interop_dir, Streamer, Upstream, ZeroCache};

use super::{free_addr, percentile, sluice_binary};

const DB: &str = "sluice_bench_zero";
const SLOT: &str = "sluice_bench_zero";

pub(crate) fn now_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1000.0
}

pub(crate) async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

/// Drops the replication slots on the bench database (Sluice's, and the
/// ones zero-cache's own source made), so the database can be dropped.
async fn drop_slots(admin: &tokio_postgres::Client) -> anyhow::Result<()> {
    drop_slots_where(admin, &format!("(database = '{DB}' OR slot_name = '{SLOT}')")).await
}

/// Drops the replication slots `ours` (a condition on
/// `pg_replication_slots`) selects, ending their walsenders first.
pub(crate) async fn drop_slots_where(admin: &tokio_postgres::Client, ours: &str) -> anyhow::Result<()> {
    // A stopped zero-cache's walsender may outlive it for a moment.
    admin
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE {ours} AND active_pid IS NOT NULL"
        ))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let dropped = admin
            .batch_execute(&format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE {ours}"
            ))
            .await;
        match dropped {
            Ok(()) => return Ok(()),
            // Still held by a walsender that is terminating.
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => return Err(e.into()),
        }
    }
}

pub async fn run(server: &str, tmp: &Path) -> anyhow::Result<()> {
    let rows: u64 = std::env::var("SLUICE_BENCH_ZERO_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let live_secs: u64 = std::env::var("SLUICE_BENCH_ZERO_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    // Each zero-cache first streams this long unmeasured: one that has just
    // become ready is still settling (its first live transactions, caches).
    let warm_secs: u64 = std::env::var("SLUICE_BENCH_ZERO_WARMUP_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
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
    let _hog = Hog::from_env();

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
    up.batch_execute(
        r#"UPDATE zero.permissions SET permissions =
           '{"tables": {"items": {"row": {"select": [["allow", {"type": "and", "conditions": []}]]}}}}'"#,
    )
    .await?;
    println!(
        "Sluice: its snapshot of {rows} rows durable (change log + table state, SQLite) {secs:.1} s after process start: {:.0} rows/s",
        rows as f64 / secs
    );
    let (messages, secs) = read_initial_sync(&addr).await?;
    println!(
        "Sluice: the initial sync ({messages} messages) read by a client that only counts them, in {secs:.2} s: {:.0} rows/s",
        rows as f64 / secs
    );
    let mut next = rows + 1;
    let (zc, secs) = start_zero_cache("bench_zc_sluice", Upstream::Sluice(addr.clone()), server, &dir).await?;
    println!(
        "zero-cache on Sluice: initial sync of {rows} rows, process start to ready, {secs:.1} s: {:.0} rows/s",
        rows as f64 / secs
    );
    warm_up("zero-cache on Sluice", &zc, &up, &mut next, warm_secs).await?;
    replica_latency("zero-cache on Sluice", &zc, &up, &mut next, live_secs).await?;
    drop(zc);

    // 2. A view-syncer on Sluice, its replica written by the tool's bulk
    // route, after a replica by zero-cache's own initial-sync route was
    // timed beside it (and thrown away).
    let name = "bench_zc_vs";
    let by_zero = dir.join("by-zero-initial-sync.db");
    let initial_sync = write_replica(&addr, &by_zero, "initial-sync").await?;
    std::fs::remove_file(&by_zero)?;
    let bootstrap = write_replica(&addr, &zero_harness::replica_file(name, &dir), "bulk").await?;
    let view_syncer = Upstream::ViewSyncer { streamer: Streamer::Uri(addr.clone()), upstream: up_url.clone() };
    let (zc, secs) = start_zero_cache(name, view_syncer, server, &dir).await?;
    println!(
        "view-syncer on Sluice: replica written by tools/zero-replica.mjs in {bootstrap:.1} s (its initial-sync route, zero-cache's own code: {initial_sync:.1} s), then process start to ready {secs:.1} s: {:.1} s in all",
        bootstrap + secs
    );
    warm_up("view-syncer on Sluice", &zc, &up, &mut next, warm_secs).await?;
    replica_latency("view-syncer on Sluice", &zc, &up, &mut next, live_secs).await?;
    client_latency("view-syncer on Sluice", &zc, &up, &mut next, live_secs).await?;
    drop(zc);

    // 2b. A view-syncer started from a copy of a replica kept current
    // beside Sluice (`--keep`, then `--from`): the keeper is a standing
    // part of the deployment, so its own start is reported but not counted;
    // it follows live writes for a while before the copy.
    let kept = dir.join("kept.db");
    let (keeper, keeper_secs) = {
        let (addr, kept) = (addr.clone(), kept.clone());
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            (zero_harness::KeptReplica::start(&addr, &kept), started.elapsed().as_secs_f64())
        })
        .await?
    };
    write_live(&up, &mut next, 2).await?;
    let name = "bench_zc_kept";
    let copy_secs = {
        let (addr, kept, file) = (addr.clone(), kept.clone(), zero_harness::replica_file(name, &dir));
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            zero_harness::copy_kept_replica(&addr, &kept, &file);
            started.elapsed().as_secs_f64()
        })
        .await?
    };
    let view_syncer = Upstream::ViewSyncer { streamer: Streamer::Uri(addr.clone()), upstream: up_url.clone() };
    let (zc, secs) = start_zero_cache(name, view_syncer, server, &dir).await?;
    println!(
        "view-syncer on Sluice from a kept replica: copied by tools/zero-replica.mjs --from in {copy_secs:.1} s (the keeper's own start, not counted: {keeper_secs:.1} s), then process start to ready {secs:.1} s: {:.1} s in all",
        copy_secs + secs
    );
    drop(zc);
    drop(keeper);
    drop(sluice);
    drop_slots(&admin).await?;
    // zero-cache's own set-up creates its shard's tables without IF NOT
    // EXISTS: take Sluice's away (the permissions row stays).
    up.batch_execute("DROP SCHEMA zero_0 CASCADE; DROP PUBLICATION IF EXISTS _zero_metadata_0").await?;
    let live_rows = next - rows - 1;
    up.batch_execute(&format!("DELETE FROM items WHERE id > {rows}")).await?;

    // 3. zero-cache's own Postgres source, on the same rows.
    let (zc, secs) = start_zero_cache("bench_zc_pg", Upstream::Postgres(up_url.clone()), server, &dir).await?;
    println!(
        "zero-cache on its own Postgres source: initial sync of {rows} rows, process start to ready, {secs:.1} s: {:.0} rows/s",
        rows as f64 / secs
    );
    next = rows + live_rows + 1;
    warm_up("zero-cache on its own Postgres source", &zc, &up, &mut next, warm_secs).await?;
    replica_latency("zero-cache on its own Postgres source", &zc, &up, &mut next, live_secs).await?;
    client_latency("zero-cache on its own Postgres source", &zc, &up, &mut next, live_secs).await?;
    drop(zc);
    drop(up);
    drop_slots(&admin).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)")).await?;
    Ok(())
}

/// Seconds `tools/zero-replica.mjs --via via` takes to write `file` from
/// Sluice at `addr`.
async fn write_replica(addr: &str, file: &Path, via: &'static str) -> anyhow::Result<f64> {
    let (addr, file) = (addr.to_string(), file.to_path_buf());
    let started = Instant::now();
    tokio::task::spawn_blocking(move || zero_harness::bootstrap_replica_via(&addr, &file, via)).await?;
    Ok(started.elapsed().as_secs_f64())
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

fn spawn_sluice(dir: &Path, addr: &str, up_url: &str) -> anyhow::Result<Sluice> {
    // Zero's upstream tables are created and replicated, for the view-syncer.
    let config = serde_json::json!({ "url": up_url, "slot": SLOT, "zero": {"app_id": "zero", "shard_num": 0} });
    spawn_postgres_sluice(dir, addr, &config, &["--table-state"])
}

/// A `sluice` process the bench started: killed when dropped, so a bench
/// that fails part-way leaves none behind.
pub(crate) struct Sluice(Child);

impl std::ops::Deref for Sluice {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Sluice {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sluice run` on the built-in Postgres source with `config`, serving on
/// `addr`, its SQLite change log and its log in `dir`, plus `extra` flags.
pub(crate) fn spawn_postgres_sluice(
    dir: &Path,
    addr: &str,
    config: &serde_json::Value,
    extra: &[&str],
) -> anyhow::Result<Sluice> {
    let log = std::fs::File::create(dir.join("sluice.log"))?;
    Ok(Sluice(
        Command::new(sluice_binary())
            .args(["run", "--source", "postgres", "--source-config", &config.to_string(), "--listen", addr])
            .args(extra)
            .arg("--change-db")
            .arg(format!("sqlite:{}", dir.join("sluice.db").display()))
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()?,
    ))
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

/// Rows per live commit (`SLUICE_BENCH_ZERO_ROWS_PER_COMMIT`, 10): a commit
/// every that many ms, so 1,000 changes/s whatever the size (1: 1,000
/// one-row transactions/s).
fn rows_per_commit() -> u64 {
    std::env::var("SLUICE_BENCH_ZERO_ROWS_PER_COMMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(10).clamp(1, 1000)
}

/// Commits [`rows_per_commit`] rows every as many ms for `secs` seconds
/// (1,000 changes/s) from id `next` on, each stamped with the time just
/// before its commit.
async fn write_live(up: &tokio_postgres::Client, next: &mut u64, secs: u64) -> anyhow::Result<()> {
    let rows = rows_per_commit();
    let mut tick = tokio::time::interval(Duration::from_millis(rows));
    for _ in 0..secs * 1000 / rows {
        tick.tick().await;
        let t = now_ms();
        let values: Vec<String> = (*next..*next + rows).map(|id| format!("({id}, 'live {id}', {t})")).collect();
        up.batch_execute(&format!("INSERT INTO items VALUES {}", values.join(","))).await?;
        *next += rows;
    }
    Ok(())
}

/// Other work on the machine's cores while the set-ups run
/// (`SLUICE_BENCH_ZERO_HOG`: that many threads that spin), for the tail
/// under load; stopped when dropped.
pub(crate) struct Hog(Arc<std::sync::atomic::AtomicBool>, Vec<std::thread::JoinHandle<()>>);

impl Hog {
    pub(crate) fn from_env() -> Hog {
        let n: usize = std::env::var("SLUICE_BENCH_ZERO_HOG").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                        }
                    }
                })
            })
            .collect();
        if n > 0 {
            println!("other work: {n} threads spinning on the cores throughout");
        }
        Hog(stop, threads)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.1.drain(..) {
            let _ = t.join();
        }
    }
}

/// `secs` of live rows, measured like [`replica_latency`] but reported as
/// a warm-up.
async fn warm_up(
    what: &str,
    zc: &ZeroCache,
    up: &tokio_postgres::Client,
    next: &mut u64,
    secs: u64,
) -> anyhow::Result<()> {
    if secs > 0 {
        replica_latency(&format!("{what} (warm-up, not counted)"), zc, up, next, secs).await?;
    }
    Ok(())
}

/// Live rows while a watcher reads zero-cache's replica file: commit to
/// readable there.
async fn replica_latency(
    what: &str,
    zc: &ZeroCache,
    up: &tokio_postgres::Client,
    next: &mut u64,
    secs: u64,
) -> anyhow::Result<()> {
    let total = secs * 1000;
    let watcher = Command::new("node")
        .arg(interop_dir().join("replica-latency.mjs"))
        .arg(zc.replica())
        .args(["items", &(*next - 1).to_string(), &total.to_string(), &((secs + 60) * 1000).to_string()])
        .current_dir(interop_dir())
        .stdout(Stdio::piped())
        .spawn()?;
    let watching = tokio::task::spawn_blocking(move || watcher.wait_with_output());
    write_live(up, next, secs).await?;
    let out = watching.await??;
    report(what, "readable in its replica", total, secs, &out.stdout)
}

/// Live rows while Zero's own client (`tests/interop/client-latency.mjs`)
/// queries them through zero-cache: commit to shown by the client.
async fn client_latency(
    what: &str,
    zc: &ZeroCache,
    up: &tokio_postgres::Client,
    next: &mut u64,
    secs: u64,
) -> anyhow::Result<()> {
    use std::io::BufRead;
    let total = secs * 1000;
    let mut client = Command::new("node")
        .arg(interop_dir().join("client-latency.mjs"))
        // Zero's client trips Node's listener-count warning; it is harmless.
        .env("NODE_NO_WARNINGS", "1")
        .args([&zc.server(), "items", &(*next - 1).to_string(), &total.to_string(), &((secs + 90) * 1000).to_string()])
        .current_dir(interop_dir())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = client.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let reading = tokio::task::spawn_blocking(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines.next().transpose()?;
        let _ = ready_tx.send(first);
        let report = lines.next().transpose()?.unwrap_or_default();
        let _ = client.wait();
        anyhow::Ok(report)
    });
    let first = tokio::time::timeout(Duration::from_secs(120), ready_rx).await??;
    anyhow::ensure!(first.as_deref().is_some_and(|l| l.contains("ready")), "the client never got ready: {first:?}");
    write_live(up, next, secs).await?;
    let out = reading.await??;
    report(what, "shown by a Zero client", total, secs, out.as_bytes())
}

fn report(what: &str, where_: &str, total: u64, secs: u64, json: &[u8]) -> anyhow::Result<()> {
    let report: serde_json::Value = serde_json::from_slice(json)?;
    let mut lat: Vec<u64> = report["latenciesMs"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).map(|ms| (ms.max(0.0) * 1000.0) as u64).collect())
        .unwrap_or_default();
    lat.sort_unstable();
    println!(
        "{what}: live, 1,000 changes/s ({}-row commits) for {secs} s: {} of {total} rows seen; commit to {where_} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        rows_per_commit(),
        lat.len(),
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    Ok(())
}
