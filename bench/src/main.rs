//! `make bench`: throughput and boundary cost, reported (never asserted).
//!
//! Everything runs on this machine with the real plugin files and real
//! SQLite files in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::change::Encoder;
use sluice::plugin::{NetGrant, Registry, SandboxLimits};
use sluice::service::{Service, ServiceConfig};
use sluice::source::ChangeSource;
use sluice::status::Status;
use sluice::storage::open::{ChangeDb, LogStore, StoreOptions};
use sluice::storage::sqlite::Durability;
use sluice::storage::{ChangeLog, LogReader};

mod custom_source;
mod filters;
mod fleet;
mod lean_ws;
mod mariadb_source;
mod pg_source;
mod send_lag;
mod zero_cache;

fn plugin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("sluice-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let registry = std::sync::Arc::new(Registry::load(&plugin_dir(), Some(tmp.join("cache"))).await?);
    // `sluice-bench [boundary|store|custom|postgres|pgsource|tls|zero|sendlag|mariadb|fanout|fleet|filters|filter-cost|catchup ...]`: all by default.
    let only: Vec<String> = std::env::args().skip(1).collect();
    let run = |section: &str| only.is_empty() || only.iter().any(|o| o == section);
    println!("# Sluice benchmarks ({} cores)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0));

    if run("boundary") {
        println!("\n## Plugin boundary (mock-source next-batch(512), guest generation included)");
        for row_bytes in [100usize, 1024] {
            boundary(&registry, row_bytes).await?;
        }
    }

    if run("store") {
        println!(
            "\n## Mock source -> SQLite change log, durable changes/s (data changes; begin/commit rows not counted)"
        );
        for (rows, row_bytes) in [(1u32, 100usize), (10, 100), (100, 100), (10, 1024)] {
            for durability in [Durability::Full, Durability::Normal] {
                store(&registry, &tmp, rows, row_bytes, durability, false).await?;
            }
        }
        // The same with the table state kept (`--table-state`): every row
        // also goes into the state (the mock source only inserts, so the
        // state grows as the log does).
        for (rows, row_bytes) in [(10u32, 100usize), (100, 100), (10, 1024)] {
            store(&registry, &tmp, rows, row_bytes, Durability::Full, true).await?;
        }
        sqlite_ceiling(&tmp)?;
    }
    if run("custom") {
        println!("\n## zero-custom-source (local WebSocket upstream) vs mock-source -> SQLite (sync Full), durable changes/s");
        custom_source::run(&registry, &tmp).await?;
    }
    let pg_url = std::env::var("SLUICE_TEST_PG_URL").ok();
    if pg_url.is_none() {
        println!("\n(no SLUICE_TEST_PG_URL: Postgres figures skipped; `make bench` starts a server)");
    }
    if let (true, Some(url)) = (run("postgres"), &pg_url) {
        println!("\n## Mock source -> Postgres change DB (synchronous_commit on), durable changes/s");
        for (rows, row_bytes) in [(1u32, 100usize), (10, 100), (100, 100), (10, 1024)] {
            store_pg(&registry, &tmp, url, rows, row_bytes, false).await?;
        }
        for (rows, row_bytes) in [(10u32, 100usize), (10, 1024)] {
            store_pg(&registry, &tmp, url, rows, row_bytes, true).await?;
        }
        pg_ceiling(&tmp, url)?;
    }
    if let (true, Some(url)) = (run("pgsource"), &pg_url) {
        println!("\n## Postgres source (pgoutput) -> durable SQLite change log -> 1 subscriber, upstream on the same machine");
        pg_source::run(url, &tmp).await?;
    }
    if let (true, Some(url)) = (run("zero"), &pg_url) {
        println!("\n## zero-cache 1.9.0 on Sluice vs on its own Postgres source (same table, same machine)");
        // SLUICE_BENCH_ZERO_ROWS (1,000,000) and SLUICE_BENCH_ZERO_SECS (10) size it.
        zero_cache::run(url, &tmp).await?;
    }
    if let (true, Some(url)) = (run("sendlag"), &pg_url) {
        println!(
            "\n## Send lag: a subscriber on Sluice and one on zero-cache's change-streamer, same upstream, same run"
        );
        // SLUICE_BENCH_LAG_SECS (20) sizes it; SLUICE_BENCH_ZERO_HOG=N adds load.
        send_lag::run(url, &tmp).await?;
    }
    if run("tls") {
        println!(
            "\n## TLS cost on the endpoint: fan-out, plain WebSockets and over TLS (10 rows of 100 B per transaction)"
        );
        let tls = BenchTls::new(&tmp)?;
        // At 1,000 tx/s both set-ups keep up, so the latency compares
        // them; unthrottled, it measures how far behind each falls.
        for (subscribers, rate) in [(10usize, 1000.0f64), (100, 1000.0), (10, 0.0), (100, 0.0)] {
            let txs = if rate > 0.0 { (rate * 10.0) as u64 } else { 200_000 / subscribers.min(10) as u64 };
            for over in [None, Some(&tls)] {
                fanout_over(&tmp, subscribers, rate, txs, FanoutFilter::None, over).await?;
            }
        }
        if let Some(url) = &pg_url {
            tls_cost(&registry, &tmp, url).await?;
        }
    }
    if run("mariadb") {
        match (std::env::var("SLUICE_TEST_MARIADB"), std::env::var("SLUICE_TEST_MARIADB_SOCKET")) {
            (Ok(addr), Ok(socket)) => {
                println!("\n## mariadb-source: MariaDB binlog -> plugin -> durable SQLite change log -> 1 subscriber");
                mariadb_source::run(&registry, (addr, socket), &tmp).await?;
            }
            _ => println!("\n(no SLUICE_TEST_MARIADB: MariaDB figures skipped; `make bench` starts a server)"),
        }
    }
    if run("fanout") {
        println!("\n## Fan-out over WebSockets (sluice process on the mock source, 10 rows of 100 B per transaction)");
        // SLUICE_BENCH_SUBSCRIBERS=1,10 limits the subscriber counts.
        let counts: Vec<usize> = std::env::var("SLUICE_BENCH_SUBSCRIBERS")
            .ok()
            .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![1, 10, 100]);
        machine_jitter();
        for n in counts {
            fanout(&tmp, n, 0.0).await?;
            if n <= 10 {
                // 1,000 changes/s: the latency target.
                fanout(&tmp, n, 100.0).await?;
            }
            fanout(&tmp, n, 1000.0).await?;
        }
    }
    if run("fleet") {
        println!("\n## Thousands of subscribers (sluice process on the mock source, SQLite change log)");
        // SLUICE_BENCH_FLOOD, SLUICE_BENCH_CATCHUP=subscribers,changes and
        // SLUICE_BENCH_IDLE size it.
        fleet::run(&tmp).await?;
    }
    if run("filters") || run("filter-cost") {
        println!("\n## Filters: cost per change evaluation (host routing + cache + plugin boundary + logic)");
        filters::per_change(&tmp).await?;
    }
    if run("filters") {
        println!("\n## Filters: fan-out to 100 subscribers (2,000 transactions of 10 rows, source unthrottled)");
        // SLUICE_BENCH_FANOUT=shared (or none, distinct) runs one of the three.
        let only = std::env::var("SLUICE_BENCH_FANOUT").ok();
        let kinds =
            [("none", FanoutFilter::None), ("shared", FanoutFilter::Shared), ("distinct", FanoutFilter::Distinct)];
        for (_, f) in kinds.into_iter().filter(|(name, _)| only.as_deref().is_none_or(|o| o == *name)) {
            fanout_with(&tmp, 100, 0.0, 2_000, f).await?;
        }
    }
    if run("catchup") {
        println!("\n## Catch-up: one subscriber replaying the change log");
        let db = tmp.join("catchup.db");
        let log = LogStore::Sqlite { path: db, durability: Durability::Normal }.open(false)?;
        catchup(&registry, "SQLite", log.writer, log.reader).await?;
        if let Some(url) = &pg_url {
            let log = tokio::task::block_in_place(|| pg_store(url, "benchcatchup").open(false))?;
            catchup(&registry, "Postgres", log.writer, log.reader).await?;
        }
    }
    // SLUICE_BENCH_KEEP_TMP=1 keeps the processes' logs and files to read.
    if std::env::var_os("SLUICE_BENCH_KEEP_TMP").is_some() {
        println!("(kept {})", tmp.display());
    } else {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(())
}

/// The cost of TLS to PostgreSQL: the same runs with `sslmode=disable` and
/// `sslmode=require` against one server that offers both (`make bench`
/// starts it with SLUICE_TEST_PG_SSL=1).
async fn tls_cost(registry: &std::sync::Arc<Registry>, tmp: &Path, url: &str) -> anyhow::Result<()> {
    let probe = sluice::pgconn::PgTarget::parse(&format!("{url}?sslmode=require")).map_err(anyhow::Error::msg)?;
    if sluice::pgconn::connect(&probe, &probe.config).await.is_err() {
        println!("\n(the Postgres server offers no TLS: TLS figures skipped; `make bench` starts one that does)");
        return Ok(());
    }
    for mode in ["disable", "require"] {
        let url = format!("{url}?sslmode={mode}");
        println!("\n## TLS cost, sslmode={mode}: mock source -> Postgres change DB, durable changes/s");
        store_pg(registry, tmp, &url, 10, 100, false).await?;
        println!("\n## TLS cost, sslmode={mode}: catch-up from the Postgres change DB");
        let store = pg_store(&url, &format!("benchtls{}", mode.replace('-', "")));
        let log = tokio::task::block_in_place(|| store.open(false))?;
        catchup(registry, "Postgres", log.writer, log.reader).await?;
        println!("\n## TLS cost, sslmode={mode}: Postgres source (pgoutput) -> SQLite change log -> 1 subscriber");
        pg_source::run_with(url.split('?').next().unwrap_or(url.as_str()), tmp, Some(mode)).await?;
    }
    Ok(())
}

/// One line: the share of the run's wall time each stage took (the storer
/// runs beside the loop, so shares can add up to more than 100 %).
fn stage_line(status: &Status, secs: f64) -> String {
    let st = status.snapshot().stages;
    let pct = |ns: u64| ns as f64 / 1e9 / secs * 100.0;
    format!(
        "      time: source {:.0} %, loop {:.0} %, storage writes {:.0} %, storage commits {:.0} %",
        pct(st.source_ns),
        pct(st.loop_ns),
        pct(st.write_ns),
        pct(st.commit_ns)
    )
}

fn sluice_binary() -> PathBuf {
    // Built by `make bench` beside this binary.
    std::env::current_exe().expect("own path").with_file_name("sluice")
}

/// `sluice run` on the mock source with `config`, serving on `addr`, its
/// change log in the SQLite file `db`; the caller adds its own flags.
fn mock_sluice(addr: &str, db: &Path, config: &serde_json::Value) -> std::process::Command {
    let mut command = std::process::Command::new(sluice_binary());
    command
        .args(["run", "--source", "mock-source", "--listen", addr])
        .arg("--plugins")
        .arg(plugin_dir())
        .arg("--change-db")
        .arg(format!("sqlite:{}", db.display()))
        .arg("--source-config")
        .arg(config.to_string());
    command
}

/// Where a fan-out run's `sluice` logs: appended to the file
/// `SLUICE_BENCH_SERVER_LOG` names, or nowhere.
fn server_log() -> anyhow::Result<std::process::Stdio> {
    let Some(path) = std::env::var_os("SLUICE_BENCH_SERVER_LOG") else { return Ok(std::process::Stdio::null()) };
    let file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    Ok(file.into())
}

/// `GET /status` of a running `sluice` process, as JSON.
async fn http_status(addr: &str) -> anyhow::Result<serde_json::Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET /status HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(serde_json::from_str(body.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or(""))?)
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("bound").to_string()
}

/// Peak resident memory of a process, from /proc.
fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// CPU time (user + system) a process has used, from /proc; Linux counts
/// it in ticks of 1/100 s on every platform this runs on (USER_HZ).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// A frame `{"id":N,"msg":M}` as (N, M) without parsing M, so the client
/// costs little next to the server on these two cores.
fn split_frame(text: &str) -> anyhow::Result<(u64, &str)> {
    let (id, msg) = frame_parts(text.as_bytes())?;
    Ok((id, text.get(msg).unwrap_or_default()))
}

/// [`split_frame`] on bytes not checked for UTF-8: N, and where M lies.
fn frame_parts(text: &[u8]) -> anyhow::Result<(u64, std::ops::Range<usize>)> {
    let bad = || anyhow::anyhow!("bad frame {}", String::from_utf8_lossy(text));
    let comma = text.iter().position(|b| *b == b',').ok_or_else(bad)?;
    let id = std::str::from_utf8(text.get(6..comma).ok_or_else(bad)?)?.parse()?;
    // Within the text even when it is cut short (M is then empty).
    let start = (comma + 7).min(text.len());
    Ok((id, start..(text.len() - 1).max(start)))
}

/// One subscriber in the bench process: counts changes, measures commit
/// latency. It acks every message as the protocol asks, but writes the acks
/// of all the frames that arrived together with one flush (as a client that
/// reads its socket in batches would), so the client's own cost on these two
/// shared cores stays small next to the server's. Latency counts only commits
/// sent after the subscriber had been live for half a second: earlier ones
/// came by catch-up from the log, which is not what live latency means.
async fn bench_subscriber(addr: String, id: usize, last: String, extra: String) -> anyhow::Result<(u64, Vec<u64>)> {
    bench_subscriber_over(addr, id, last, extra, None).await.map(|r| (r.changes, r.latencies))
}

/// What one bench subscriber got.
struct Received {
    /// Data changes of whole transactions.
    changes: u64,
    /// Live commit latencies (µs).
    latencies: Vec<u64>,
    /// Times the server closed it as too far behind (`StreamTooFarBehind`,
    /// type 3: its backlog, its unconsumed bytes or the memory budget), after
    /// which it resumed from its last commit, as Zero's client does.
    too_far_behind: u32,
    /// Connections that ended without an error message (and why, the last
    /// time); it resumed after those too.
    lost: u32,
    lost_why: Option<String>,
}

/// A byte stream a WebSocket runs over: TCP, or TLS over TCP.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A WebSocket to `url` at `addr`, over TLS when `tls` is given.
async fn ws_connect(
    addr: &str,
    url: String,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> anyhow::Result<tokio_tungstenite::WebSocketStream<Box<dyn Io>>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let stream: Box<dyn Io> = match tls {
        Some(config) => {
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
            Box::new(tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp).await?)
        }
        None => Box::new(tcp),
    };
    let (ws, _) = tokio_tungstenite::client_async(url, stream).await?;
    Ok(ws)
}

async fn bench_subscriber_over(
    addr: String,
    id: usize,
    last: String,
    extra: String,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> anyhow::Result<Received> {
    use futures::{FutureExt, SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message as Ws;
    let now_us = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64);
    let live_from = now_us()? + 500_000;
    let (mut changes, mut latencies) = (0u64, Vec::new());
    // The last commit received: a connection the server closes cleanly (it
    // was not ready yet) is resumed from there, as Zero's client does.
    let mut resume = "00".to_string();
    let (mut attempts, mut too_far_behind, mut lost, mut lost_why) = (0, 0, 0, None);
    loop {
        let scheme = if tls.is_some() { "wss" } else { "ws" };
        let url = format!(
            "{scheme}://{addr}/replication/v6/changes?id=bench-{id}&replicaVersion=00&watermark={resume}{extra}"
        );
        let mut ws = ws_connect(&addr, url, tls.as_ref()).await?;
        // Changes of a transaction count once its commit arrives (a cut
        // transaction is sent again whole).
        let mut in_tx = 0u64;
        let (mut done, mut closed) = (false, false);
        while !done && !closed {
            let Some(first) = ws.next().await else { break };
            let mut frame = Some(first);
            while let Some(f) = frame {
                let f = match f {
                    Ok(f) => f,
                    Err(e) => {
                        lost += 1;
                        lost_why = Some(e.to_string());
                        closed = true;
                        break;
                    }
                };
                if let Ws::Text(text) = f {
                    // Only commits are parsed in full.
                    let (msg_id, msg) = split_frame(&text)?;
                    ws.feed(Ws::Text(format!("{{\"ack\":{msg_id}}}").into())).await?;
                    if msg.starts_with("[\"data\"") {
                        in_tx += 1;
                    } else if msg.starts_with("[\"commit\"") {
                        changes += std::mem::take(&mut in_tx);
                        let msg: serde_json::Value = serde_json::from_str(msg)?;
                        if let Some(sent) = msg[1]["sentAtUs"].as_u64().filter(|s| *s >= live_from) {
                            latencies.push(now_us()?.saturating_sub(sent));
                        }
                        if let Some(w) = msg[2]["watermark"].as_str() {
                            resume = w.to_string();
                        }
                        if resume == last {
                            done = true;
                            break;
                        }
                    } else if msg.starts_with("[\"error\"") {
                        let error: serde_json::Value = serde_json::from_str(msg)?;
                        anyhow::ensure!(error[1]["type"] == 3, "subscriber {id}: {msg}");
                        too_far_behind += 1;
                        closed = true;
                        break;
                    }
                }
                // Frames that already arrived, without waiting for more.
                frame = ws.next().now_or_never().flatten();
            }
            if closed {
                break; // the server is closing the socket: nothing to flush
            }
            if let Err(e) = ws.flush().await {
                lost += 1;
                lost_why = Some(e.to_string());
                break;
            }
        }
        if done {
            return Ok(Received { changes, latencies, too_far_behind, lost, lost_why });
        }
        attempts += 1;
        anyhow::ensure!(attempts < 50, "subscriber {id}: closed by the server {attempts} times");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which filters the fan-out subscribers use.
#[derive(Clone, Copy, PartialEq)]
enum FanoutFilter {
    None,
    /// One row-filter configuration for all.
    Shared,
    /// A row-filter configuration of its own for each subscriber.
    Distinct,
}

/// How late this machine wakes a thread that sleeps 1 ms, 5,000 times: the
/// floor under any latency percentile measured here (a virtual machine whose
/// CPUs are now and then taken away for milliseconds shows it in its p99).
fn machine_jitter() {
    let mut late: Vec<u64> = (0..5000)
        .map(|_| {
            let t = Instant::now();
            std::thread::sleep(Duration::from_millis(1));
            (t.elapsed().as_micros() as u64).saturating_sub(1000)
        })
        .collect();
    late.sort_unstable();
    println!(
        "machine: a 1 ms sleep wakes late by p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} of 5000 more than 2 ms late)",
        percentile(&late, 0.5),
        percentile(&late, 0.99),
        late.last().copied().unwrap_or(0) as f64 / 1000.0,
        late.iter().filter(|l| **l > 2000).count()
    );
}

async fn fanout(tmp: &Path, subscribers: usize, rate: f64) -> anyhow::Result<()> {
    // Throttled runs last about ten seconds (1,000 commits at 100 tx/s, for the p99).
    let txs: u64 = if rate > 0.0 { (rate * 10.0) as u64 } else { 200_000 / subscribers.min(10) as u64 };
    fanout_with(tmp, subscribers, rate, txs, FanoutFilter::None).await
}

async fn fanout_with(tmp: &Path, subscribers: usize, rate: f64, txs: u64, filter: FanoutFilter) -> anyhow::Result<()> {
    fanout_over(tmp, subscribers, rate, txs, filter, None).await
}

/// The endpoint's certificate for the TLS fan-out: files for `sluice run`
/// and the client configuration that trusts them.
struct BenchTls {
    cert: PathBuf,
    key: PathBuf,
    client: Arc<rustls::ClientConfig>,
}

impl BenchTls {
    fn new(tmp: &Path) -> anyhow::Result<BenchTls> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse()?)];
        let cert = params.self_signed(&key)?;
        let (cert_file, key_file) = (tmp.join("endpoint.crt"), tmp.join("endpoint.key"));
        std::fs::write(&cert_file, cert.pem())?;
        std::fs::write(&key_file, key.serialize_pem())?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone())?;
        let client = rustls::ClientConfig::builder_with_provider(sluice::tls::crypto_provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(BenchTls { cert: cert_file, key: key_file, client: Arc::new(client) })
    }
}

async fn fanout_over(
    tmp: &Path,
    subscribers: usize,
    rate: f64,
    txs: u64,
    filter: FanoutFilter,
    tls: Option<&BenchTls>,
) -> anyhow::Result<()> {
    let addr = free_addr();
    let db = tmp.join(format!(
        "fanout-{subscribers}-{rate}-{txs}-{}{}.db",
        filter as u8,
        if tls.is_some() { "-tls" } else { "" }
    ));
    let config =
        serde_json::json!({"transactions": txs, "rows_per_tx": 10, "row_bytes": 100, "rate": rate, "timestamps": true});
    // Subscribers connect at the replica version while the source runs;
    // catch-up covers what was stored before they joined.
    let mut child = mock_sluice(&addr, &db, &config)
        .args(["--lag-grace-secs", "0"])
        .args(
            tls.map(|t| vec!["--tls-cert".into(), t.cert.clone(), "--tls-key".into(), t.key.clone()])
                .unwrap_or_default(),
        )
        .stdout(std::process::Stdio::null())
        .stderr(server_log()?)
        .spawn()?;
    // Wait for the endpoint.
    let started = Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "sluice did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last = sluice::watermark::to_lexi(txs as u128);
    let t0 = Instant::now();
    let extra = |i: usize| {
        // Every row passes (ids stay far below the bound), so the figures
        // compare with the unfiltered run; only the evaluation is added.
        let bound = match filter {
            FanoutFilter::None => return String::new(),
            FanoutFilter::Shared => 1_000_000_000u64,
            FanoutFilter::Distinct => 1_000_000_000 + i as u64,
        };
        let spec = serde_json::json!([{"plugin": "row-filter", "config":
            {"table": "public.*", "where": {"column": "id", "op": "<", "value": bound}}}]);
        let encoded: String = spec
            .to_string()
            .bytes()
            .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect();
        format!("&filters={encoded}")
    };
    let client = tls.map(|t| t.client.clone());
    let tasks: Vec<_> = (0..subscribers)
        .map(|i| tokio::spawn(bench_subscriber_over(addr.clone(), i, last.clone(), extra(i), client.clone())))
        .collect();
    let (mut changes, mut latencies, mut too_far_behind, mut lost, mut lost_why) = (0u64, Vec::new(), 0, 0, None);
    for t in tasks {
        let received = t.await??;
        changes += received.changes;
        latencies.extend(received.latencies);
        too_far_behind += received.too_far_behind;
        lost += received.lost;
        lost_why = received.lost_why.or(lost_why);
    }
    let secs = t0.elapsed().as_secs_f64();
    let rss = peak_rss_mib(child.id());
    let _ = child.kill();
    let _ = child.wait();
    latencies.sort_unstable();
    let filtered = match filter {
        FanoutFilter::None => "",
        FanoutFilter::Shared => ", one shared row-filter",
        FanoutFilter::Distinct => ", a row-filter config each",
    };
    // Latency is sampled from commits sent 0.5 s after the start; a source
    // that finished sooner leaves none.
    let latency = if latencies.is_empty() {
        "commit latency: no commit after the first 0.5 s".to_string()
    } else {
        format!(
            "commit latency p50 {:>7.2} ms p99 {:>7.2} ms",
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99)
        )
    };
    // A close as too far behind is reported, not fatal: the subscriber
    // resumed, and the figures include its catch-up.
    let mut resumed = String::new();
    if too_far_behind > 0 {
        resumed.push_str(&format!(", {too_far_behind} closes as too far behind (resumed)"));
    }
    if let Some(why) = lost_why {
        resumed.push_str(&format!(", {lost} connections lost (resumed; last: {why})"));
    }
    println!(
        "{subscribers:>3} subscribers{filtered}{}, {}: {:>9.0} changes/s delivered in total, {latency}, sluice peak RSS {:.0} MiB{resumed}",
        if tls.is_some() { " over TLS" } else { "" },
        if rate > 0.0 { format!("source at {rate:.0} tx/s") } else { "source unthrottled".to_string() },
        changes as f64 / secs,
        rss.unwrap_or(0.0)
    );
    Ok(())
}

async fn catchup(
    registry: &std::sync::Arc<Registry>,
    label: &str,
    log: Box<dyn sluice::storage::ChangeLog>,
    reader: Arc<dyn sluice::storage::LogReader>,
) -> anyhow::Result<()> {
    let txs: u64 = 100_000;
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": 10, "row_bytes": 100}).to_string();
    let source = registry
        .source("mock-source", config, SandboxLimits::default(), NetGrant::default())
        .await
        .map_err(anyhow::Error::msg)?;
    let last = sluice::watermark::to_lexi(txs as u128);
    let (service, _) = store_until(Box::new(source), log, reader, &last).await?;
    let t0 = Instant::now();
    let (changes, _) = bench_subscriber(service.addr().to_string(), 0, last, String::new()).await?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{label}: replayed {changes} changes ({} messages with begin/commit) in {secs:.2} s: {:.0} changes/s",
        changes + 2 * txs,
        changes as f64 / secs
    );
    service.stop().await
}

/// Sluice (the service, without cleanup) on `source` and `log`, once `last`
/// is durable, and the seconds that took.
pub async fn store_until(
    source: Box<dyn ChangeSource>,
    log: Box<dyn ChangeLog>,
    reader: Arc<dyn LogReader>,
    last: &str,
) -> anyhow::Result<(Service, f64)> {
    let started = Instant::now();
    let service = Service::start(ServiceConfig { cleanup: None, ..ServiceConfig::new(source, log, reader) }).await?;
    let status = service.status().clone();
    while status.snapshot().last_watermark.as_deref() != Some(last) {
        anyhow::ensure!(
            !service.is_finished(),
            "the streamer stopped before storing {last}: {:?}",
            status.snapshot().source
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok((service, started.elapsed().as_secs_f64()))
}

async fn boundary(registry: &std::sync::Arc<Registry>, row_bytes: usize) -> anyhow::Result<()> {
    let config = serde_json::json!({"rows_per_tx": 100, "row_bytes": row_bytes}).to_string();
    let mut source = registry
        .source("mock-source", config, SandboxLimits::default(), NetGrant::default())
        .await
        .map_err(anyhow::Error::msg)?;
    let mut stream = source.open(None).await?;
    let mut encoder = Encoder::default();
    let target = 300_000usize;
    let (mut n, mut pull, mut encode) = (0usize, Duration::ZERO, Duration::ZERO);
    while n < target {
        let t = Instant::now();
        let batch = stream.next_batch(512).await?;
        pull += t.elapsed();
        n += batch.len();
        let t = Instant::now();
        for m in batch {
            let _ = encoder.encode(m)?;
        }
        encode += t.elapsed();
    }
    println!(
        "row {row_bytes:>5} B: {:>6.0} ns/change across the boundary, {:>5.0} ns/change to encode JSON once ({n} changes)",
        pull.as_nanos() as f64 / n as f64,
        encode.as_nanos() as f64 / n as f64
    );
    Ok(())
}

async fn store(
    registry: &std::sync::Arc<Registry>,
    tmp: &Path,
    rows: u32,
    row_bytes: usize,
    durability: Durability,
    table_state: bool,
) -> anyhow::Result<()> {
    let txs: u64 = (if row_bytes > 512 { 200_000 } else { 500_000 } / rows as u64).clamp(2_000, 200_000);
    store_with(registry, tmp, txs, rows, row_bytes, durability, table_state).await
}

async fn store_with(
    registry: &std::sync::Arc<Registry>,
    tmp: &Path,
    txs: u64,
    rows: u32,
    row_bytes: usize,
    durability: Durability,
    table_state: bool,
) -> anyhow::Result<()> {
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": rows, "row_bytes": row_bytes}).to_string();
    let source = registry
        .source("mock-source", config, SandboxLimits::default(), NetGrant::default())
        .await
        .map_err(anyhow::Error::msg)?;
    let db = tmp.join(format!("store-{rows}-{row_bytes}-{durability:?}.db"));
    // A fresh log each time: sections that run the same shape (`store` and
    // `custom`) would otherwise find it complete and measure nothing.
    for leftover in [db.clone(), db.with_extension("db-wal"), db.with_extension("db-shm")] {
        if leftover.exists() {
            std::fs::remove_file(&leftover)?;
        }
    }
    let log = LogStore::Sqlite { path: db.clone(), durability }.open(table_state)?;
    let last = sluice::watermark::to_lexi(txs as u128);
    let (service, secs) = store_until(Box::new(source), log.writer, log.reader, &last).await?;
    let status = service.status().clone();
    service.stop().await?;
    let bytes =
        std::fs::metadata(&db)?.len() + std::fs::metadata(db.with_extension("db-wal")).map(|m| m.len()).unwrap_or(0);
    println!(
        "mock-source        {rows:>3} rows/tx of {row_bytes:>4} B, sync {:<6}: {:>8.0} tx/s, {:>9.0} changes/s ({txs} tx in {secs:.2} s, log {} MiB)",
        format!("{durability:?}{}", if table_state { " + table state" } else { "" }),
        txs as f64 / secs,
        (txs * rows as u64) as f64 / secs,
        bytes >> 20
    );
    println!("{}", stage_line(&status, secs));
    Ok(())
}

/// A Postgres change DB log in schema `<app_id>_0/cdc`, with `sluice run`'s options.
fn pg_store(url: &str, app_id: &str) -> LogStore {
    let target = sluice::pgconn::PgTarget::parse(url).expect("a Postgres URL");
    ChangeDb::Postgres(Box::new(target)).store(&StoreOptions { app_id: app_id.to_string(), ..StoreOptions::default() })
}

async fn store_pg(
    registry: &std::sync::Arc<Registry>,
    tmp: &Path,
    url: &str,
    rows: u32,
    row_bytes: usize,
    table_state: bool,
) -> anyhow::Result<()> {
    let txs: u64 = (if row_bytes > 512 { 100_000 } else { 200_000 } / rows as u64).clamp(2_000, 50_000);
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": rows, "row_bytes": row_bytes}).to_string();
    let source = registry
        .source("mock-source", config, SandboxLimits::default(), NetGrant::default())
        .await
        .map_err(anyhow::Error::msg)?;
    // One schema per shape, table state and TLS, so no run finds another's log.
    let tls = if url.contains("sslmode=require") { "tls" } else { "" };
    let store = pg_store(url, &format!("bench{rows}x{row_bytes}{}{tls}", if table_state { "s" } else { "" }));
    let log = tokio::task::block_in_place(|| store.open(table_state))?;
    let last = sluice::watermark::to_lexi(txs as u128);
    let (service, secs) = store_until(Box::new(source), log.writer, log.reader, &last).await?;
    let status = service.status().clone();
    service.stop().await?;
    let _ = tmp;
    println!(
        "{rows:>3} rows/tx of {row_bytes:>4} B{}: {:>8.0} tx/s, {:>9.0} changes/s ({txs} tx in {secs:.2} s)",
        if table_state { " + table state" } else { "" },
        txs as f64 / secs,
        (txs * rows as u64) as f64 / secs
    );
    println!("{}", stage_line(&status, secs));
    Ok(())
}

/// What SQLite itself allows on this disk: the same row shape, 10,000 rows
/// per multi-row-insert transaction, synchronous=FULL, WAL.
fn sqlite_ceiling(tmp: &Path) -> anyhow::Result<()> {
    let db = tmp.join("ceiling.db");
    let conn = rusqlite::Connection::open(&db)?;
    conn.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(
        "CREATE TABLE ceiling (watermark TEXT NOT NULL, pos INTEGER NOT NULL, tag TEXT NOT NULL, change TEXT NOT NULL, precommit TEXT, storedAtMs INTEGER, PRIMARY KEY (watermark, pos))",
    )?;
    let payload: String = std::iter::repeat_n('x', 100).collect();
    let change = format!(
        "{{\"tag\":\"insert\",\"relation\":{{\"schema\":\"public\",\"name\":\"table0\",\"rowKey\":{{\"columns\":[\"id\"],\"type\":\"default\"}}}},\"new\":{{\"id\":1,\"big\":1152921504606846977,\"payload\":\"{payload}\",\"tx\":\"01\"}}}}"
    );
    let mut sql = String::from("INSERT INTO ceiling VALUES ");
    for i in 0..250 {
        if i > 0 {
            sql.push(',');
        }
        sql.push_str("(?,?,'insert',?,NULL,NULL)");
    }
    let (commits, per_commit) = (50usize, 10_000usize);
    let t0 = Instant::now();
    let mut n = 0u64;
    for _ in 0..commits {
        let tx = conn.unchecked_transaction()?;
        {
            let mut stmt = tx.prepare_cached(&sql)?;
            for _ in 0..per_commit / 250 {
                let mut i = 1;
                for _ in 0..250 {
                    let w = sluice::watermark::to_lexi(n as u128 / 10 + 1);
                    stmt.raw_bind_parameter(i, w.as_str())?;
                    stmt.raw_bind_parameter(i + 1, (n % 10) as i64)?;
                    stmt.raw_bind_parameter(i + 2, change.as_str())?;
                    i += 3;
                    n += 1;
                }
                stmt.raw_execute()?;
            }
        }
        tx.commit()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "ceiling: SQLite inserts {n} rows of the same shape, 10,000 per commit, in {secs:.2} s: {:.0} rows/s",
        n as f64 / secs
    );
    Ok(())
}

/// What Postgres itself allows: the same 100 B rows loaded by psql, 20,000
/// per commit, once as INSERTs of 2,000 rows and once as a COPY (what the
/// change log uses, in its binary form). Each row's change is the text the
/// change log stores for a mock-source row (relation with its row key, a
/// big integer, the payload, the transaction): the server validates every
/// byte of it as JSON, so a shorter text would flatter the ceiling.
fn pg_ceiling(tmp: &Path, url: &str) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let payload: String = std::iter::repeat_n('x', 100).collect();
    let (commits, rows_per_commit) = (10usize, 20_000usize);
    let row = |n: usize| {
        let watermark = sluice::watermark::to_lexi(n as u128 / 10 + 1);
        let big = (1u64 << 60) + n as u64;
        let change = format!(
            "{{\"tag\":\"insert\",\"relation\":{{\"schema\":\"public\",\"name\":\"table0\",\"rowKey\":{{\"columns\":[\"id\"],\"type\":\"default\"}}}},\"new\":{{\"id\":{n},\"big\":{big},\"payload\":\"{payload}\",\"tx\":\"{watermark}\"}}}}"
        );
        (watermark, n % 10, change)
    };
    let create = "DROP TABLE IF EXISTS ceiling; CREATE TABLE ceiling (watermark TEXT, pos INT8, change JSON NOT NULL, precommit TEXT, PRIMARY KEY (watermark, pos));\n";
    let mut inserts = String::from(create);
    let mut copies = String::from(create);
    for c in 0..commits {
        inserts.push_str("BEGIN;\n");
        copies.push_str("BEGIN;\nCOPY ceiling FROM STDIN;\n");
        for r in 0..rows_per_commit {
            let n = c * rows_per_commit + r;
            let (watermark, pos, change) = row(n);
            if r % 2000 == 0 {
                inserts.push_str("INSERT INTO ceiling VALUES ");
            } else {
                inserts.push(',');
            }
            let _ = write!(inserts, "('{watermark}',{pos},'{change}',NULL)");
            if r % 2000 == 1999 {
                inserts.push_str(";\n");
            }
            // Text COPY: tab-separated, \N for null (the rows have no tabs or backslashes).
            let _ = writeln!(copies, "{watermark}\t{pos}\t{change}\t\\N");
        }
        inserts.push_str("COMMIT;\n");
        copies.push_str("\\.\nCOMMIT;\n");
    }
    let rows = commits * rows_per_commit;
    for (how, sql) in [("inserts", inserts), ("copies", copies)] {
        let file = tmp.join(format!("ceiling-{how}.sql"));
        std::fs::write(&file, sql)?;
        let t0 = Instant::now();
        let out =
            std::process::Command::new("psql").args(["-q", "-v", "ON_ERROR_STOP=1", url, "-f"]).arg(&file).output()?;
        let secs = t0.elapsed().as_secs_f64();
        anyhow::ensure!(out.status.success(), "psql failed: {}", String::from_utf8_lossy(&out.stderr));
        println!("ceiling: psql {how} {rows} rows of the same shape in {secs:.2} s: {:.0} rows/s", rows as f64 / secs);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_frame_splits_into_its_id_and_message() {
        let frame = r#"{"id":42,"msg":["data",{"tag":"insert"}]}"#;
        assert_eq!(super::split_frame(frame).unwrap(), (42, r#"["data",{"tag":"insert"}]"#));
        let (id, msg) = super::frame_parts(frame.as_bytes()).unwrap();
        assert_eq!((id, &frame.as_bytes()[msg]), (42, &br#"["data",{"tag":"insert"}]"#[..]));
        assert!(super::split_frame(r#"{"id":x,"msg":[]}"#).is_err());
        assert!(super::split_frame("{}").is_err());
        assert_eq!(super::frame_parts(br#"{"id":7,}"#).unwrap(), (7, 9..9), "cut short: no message");
    }
}
