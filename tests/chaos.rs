//! Crash safety: a chaos driver that SIGKILLs the `sluice` process at random
//! moments while the upstream keeps producing and subscribers keep reading
//! (one steady, one that drops its own connection at random), restarts it,
//! and checks that every committed upstream transaction reached each
//! subscriber exactly once, whole and in commit order, and that the change
//! log never holds a partial transaction.
//!
//! Variants: the mock source into SQLite and into the Postgres change DB,
//! the mock source with a different fault knob at every restart (stream cut
//! inside a transaction, error, trap, memory exhaustion), and the built-in
//! Postgres source and the mariadb-source plugin under a write workload,
//! compared row by row with the upstream table.
//!
//! `make test` runs each variant for a few seconds; `make chaos` for longer
//! (`SLUICE_CHAOS_SECONDS`). Every run prints its seed; `SLUICE_CHAOS_SEED`
//! replays the same kill schedule.

#[macro_use]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::host::{stored_watermark, Host};
use common::oracle::*;
use common::pgserver::PgServer;
use common::process::Rng;
use common::*;
use futures::{SinkExt, StreamExt};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message as Ws;

/// splitmix64: small, seedable, good enough to schedule faults.
/// How long and with which seed: from the environment, printed either way.
fn plan(variant: &str) -> (Duration, u64) {
    let secs: f64 = std::env::var("SLUICE_CHAOS_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6.0);
    let seed = std::env::var("SLUICE_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("chaos {variant}: seed {seed} ({secs} s of kills; replay with SLUICE_CHAOS_SEED={seed})");
    (Duration::from_secs_f64(secs), seed)
}

/// The kill schedule: SIGKILL after a random 100-700 ms (one time in four
/// 1-2.5 s, so purges run and get killed too), down for 0-150 ms,
/// restart (with `restart_args` chosen anew each time); returns the number of kills.
async fn kill_loop(
    host: &mut Host,
    rng: &mut Rng,
    run_for: Duration,
    mut restart_args: impl FnMut(&mut Rng) -> Vec<String>,
) -> u32 {
    let deadline = Instant::now() + run_for;
    let mut kills = 0;
    while Instant::now() < deadline {
        let up_for = if rng.range(0, 4) == 0 { rng.range(1000, 2500) } else { rng.range(100, 700) };
        tokio::time::sleep(Duration::from_millis(up_for)).await;
        host.kill();
        kills += 1;
        tokio::time::sleep(Duration::from_millis(rng.range(0, 150))).await;
        let extra = restart_args(rng);
        host.start(&extra);
    }
    kills
}

/// The mock source under the kill schedule; `faults` adds a plugin fault at
/// every restart; `change_db_server` puts the Postgres change DB on a
/// private server that is also restarted at random.
async fn mock_chaos(variant: &str, backend: Backend, faults: bool, change_db_server: Option<Arc<PgServer>>) {
    let (run_for, seed) = plan(variant);
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut spec = LogSpec::new(backend, dir.path());
    let change_db_url = change_db_server.as_ref().map(|s| s.url()).unwrap_or_else(common::pg_url);
    if let Some(pg) = spec.pg.as_mut() {
        pg.target = sluice::pgconn::PgTarget::parse(&change_db_url).unwrap();
    }
    let change_db = match &spec.pg {
        None => vec!["--change-db".to_string(), format!("sqlite:{}", spec.sqlite.display())],
        Some(pg) => vec!["--change-db".into(), change_db_url.clone(), "--app-id".into(), pg.app_id.clone()],
    };
    let mut args: Vec<String> = ["--source", "mock-source", "--plugins"].iter().map(|s| s.to_string()).collect();
    args.push(plugin_dir().display().to_string());
    args.extend(change_db);
    args.extend(["--plugin-memory-mb".into(), "64".into()]);
    let mut host = Host::new(dir.path(), args);
    let base = serde_json::json!({"rows_per_tx": ROWS, "tables": 2, "rate": 500});
    let config = move |rng: &mut Rng| {
        let mut c = base.clone();
        if faults {
            // A different fault each time the host starts; each fires once per open.
            let (knob, n) = match rng.range(0, 4) {
                0 => ("interrupt_every", rng.range(2, 20)),
                1 => ("fail_after", rng.range(10, 400)),
                2 => ("trap_after", rng.range(10, 400)),
                _ => ("oom_after", rng.range(10, 400)),
            };
            c[knob] = n.into();
        }
        vec!["--source-config".to_string(), c.to_string()]
    };
    let first = config(&mut rng);
    host.start(&first);
    let rv = Arc::new(Mutex::new("00".to_string()));
    let subs = Subscribers::start(&host.addr, rv, seed);
    // (The server lives until the end of the run, beyond the restarter.)
    let restarter = change_db_server.clone().map(|pg| restart_at_random(pg, rng.next(), run_for));
    let kills = kill_loop(&mut host, &mut rng, run_for, config).await;
    let server_restarts = match restarter {
        Some(r) => r.await.unwrap(),
        None => 0,
    };
    let target = stored_watermark(&host).await;
    subs.reach(&target, &host).await;
    let seen = subs.stop().await;
    host.kill();
    let (checked, stored) = check_mock_run(&seen, &spec).await;
    let s = seen.iter().map(|s| s.lock().unwrap()).collect::<Vec<_>>();
    println!(
        "chaos {variant}: {kills} kills, {} starts, {server_restarts} change-DB server restarts, {} and {} \
         transactions checked by the two subscribers ({} and {} connections, {} self-inflicted drops), log holds \
         {} whole transactions: none lost or duplicated",
        host.starts,
        checked[0],
        checked[1],
        s[0].connections,
        s[1].connections,
        s[1].drops,
        stored.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mock_source_sqlite() {
    mock_chaos("mock-source/sqlite", Backend::Sqlite, false, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mock_source_postgres_change_db() {
    mock_chaos("mock-source/postgres-change-db", Backend::Postgres, false, None).await;
}

/// The source plugin's file replaced while it streams, at random moments
/// and in the ways an operator's copy can land: renamed into place whole,
/// overwritten in place (so a half-written file is seen now and then), and
/// half a file first. Each replacement that loads restarts the source from
/// the durable watermark with the new code; the subscribers must see every
/// transaction exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_plugin_replaced_under_load_loses_and_duplicates_nothing() {
    let (run_for, seed) = plan("mock-source replaced under load");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let wasm = std::fs::read(plugin_dir().join("mock-source.wasm")).unwrap();
    let file = plugins.join("mock-source.wasm");
    std::fs::write(&file, &wasm).unwrap();
    let args: Vec<String> = vec![
        "--source".into(),
        "mock-source".into(),
        "--plugins".into(),
        plugins.display().to_string(),
        "--change-db".into(),
        format!("sqlite:{}", spec.sqlite.display()),
        "--source-config".into(),
        serde_json::json!({"rows_per_tx": ROWS, "tables": 2, "rate": 500}).to_string(),
    ];
    let mut host = Host::new(dir.path(), args);
    host.start(&[]);
    let subs = Subscribers::start(&host.addr, Arc::new(Mutex::new("00".to_string())), seed);
    host.replica_version().await;
    let generation = |host: &Host| -> Option<u64> {
        let list = host.get("/plugins")?;
        list["plugins"].as_array()?.iter().find(|p| p["name"] == "mock-source")?["generation"].as_u64()
    };
    let mut last = generation(&host).expect("GET /plugins lists the source");
    let deadline = Instant::now() + run_for;
    let mut replacements = 0u32;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 700))).await;
        match rng.range(0, 3) {
            0 => {
                let part = plugins.join(".mock-source.part");
                std::fs::write(&part, &wasm).unwrap();
                std::fs::rename(&part, &file).unwrap();
            }
            1 => std::fs::write(&file, &wasm).unwrap(),
            _ => {
                std::fs::write(&file, &wasm[..wasm.len() / 2]).unwrap();
                tokio::time::sleep(Duration::from_millis(rng.range(0, 500))).await;
                std::fs::write(&file, &wasm).unwrap();
            }
        }
        replacements += 1;
        // The new file is loaded (a true condition, not a guess at timing).
        let until = Instant::now() + Duration::from_secs(60);
        while generation(&host).is_none_or(|g| g <= last) {
            assert!(Instant::now() < until, "the replacement is not loaded; log:\n{}", host.log_tail());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        last = generation(&host).unwrap_or(last);
    }
    let target = stored_watermark(&host).await;
    subs.reach(&target, &host).await;
    // Every replacement reopened the source with the new code.
    let until = Instant::now() + Duration::from_secs(60);
    let reopened = |host: &Host| {
        let text = std::fs::read_to_string(&host.log).unwrap_or_default();
        text.lines().filter(|l| l.contains("opening the source with its new code")).count() as u32
    };
    while reopened(&host) < replacements {
        assert!(Instant::now() < until, "{replacements} replacements, {} reopens", reopened(&host));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let target = stored_watermark(&host).await;
    subs.reach(&target, &host).await;
    let seen = subs.stop().await;
    assert!(host.running() && host.exited().is_none(), "the host kept running; log:\n{}", host.log_tail());
    host.kill();
    let (checked, stored) = check_mock_run(&seen, &spec).await;
    println!(
        "chaos replaced source: {replacements} replacements, {} and {} transactions checked, log holds {}: none lost or duplicated",
        checked[0],
        checked[1],
        stored.len()
    );
}

/// The change DB's own server restarted (fast and immediate) beside the kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mock_source_postgres_change_db_with_server_restarts() {
    let server = Arc::new(PgServer::start(&[]));
    mock_chaos("mock-source/postgres-change-db+server-restarts", Backend::Postgres, false, Some(server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mock_source_with_plugin_faults() {
    mock_chaos("mock-source+faults/sqlite", Backend::Sqlite, true, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_source_under_writes() {
    pg_source_chaos("postgres-source/sqlite", pg_url(), None).await;
}

/// The same on a private server that is also restarted at random, with
/// `pg_ctl restart -m fast` and `-m immediate` (a crash of the upstream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_source_with_upstream_restarts() {
    let server = Arc::new(PgServer::start(&["wal_level=logical", "max_wal_senders=5", "max_replication_slots=5"]));
    pg_source_chaos("postgres-source+upstream-restarts/sqlite", server.url(), Some(server.clone())).await;
}

/// Restarts a Postgres server every 1-3 s for `run_for`, with `pg_ctl
/// restart -m fast` or `-m immediate` (a crash); returns the restart count.
fn restart_at_random(pg: Arc<PgServer>, seed: u64, run_for: Duration) -> tokio::task::JoinHandle<u32> {
    let mut rng = Rng(seed);
    let deadline = Instant::now() + run_for;
    tokio::spawn(async move {
        let mut n = 0u32;
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(rng.range(1000, 3000))).await;
            let mode = if rng.range(0, 2) == 0 { "fast" } else { "immediate" };
            let pg = pg.clone();
            tokio::task::spawn_blocking(move || pg.restart(mode)).await.unwrap();
            n += 1;
        }
        n
    })
}

async fn pg_source_chaos(variant: &str, server: String, restarts: Option<Arc<PgServer>>) {
    let (run_for, seed) = plan(variant);
    let mut rng = Rng(seed);
    let db = format!("chaos_{}", std::process::id());
    let admin = connect_pg(&server).await;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await.unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {db}")).await.unwrap();
    let url = format!("{}/{db}", server.rsplit_once('/').unwrap().0);
    let up = connect_pg(&url).await;
    up.batch_execute(
        "CREATE TABLE events (id int PRIMARY KEY, big int8);
         INSERT INTO events SELECT g, (1::int8 << 60) + g FROM generate_series(0, 99) g",
    )
    .await
    .unwrap();
    let slot = format!("chaos_{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let config = serde_json::json!({"url": url, "slot": slot}).to_string();
    let args = vec![
        "--source".to_string(),
        "postgres".into(),
        "--source-config".into(),
        config,
        "--change-db".into(),
        format!("sqlite:{}", spec.sqlite.display()),
    ];
    let mut host = Host::new(dir.path(), args);
    host.start(&[]);
    let rv = Arc::new(Mutex::new(host.replica_version().await));
    let subs = Subscribers::start(&host.addr, rv.clone(), seed);
    // A witness slot on the same publication, created before the writes:
    // afterwards it lists every streamed transaction's commit LSN.
    let witness = format!("witness_{}", std::process::id());
    let publication = format!("_sluice_public_{slot}");
    connect_pg(&url)
        .await
        .execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&witness])
        .await
        .unwrap();

    // The upstream keeps committing 1-4 rows per transaction throughout.
    let (stop_writer, mut writer_stop) = watch::channel(false);
    let writer_seed = rng.next();
    let writer_url = url.clone();
    let writer = tokio::spawn(async move {
        let mut rng = Rng(writer_seed);
        let mut up = up;
        let mut next: i32 = 100;
        loop {
            let n = rng.range(1, 5) as i32;
            let insert = "INSERT INTO events SELECT g, (1::int8 << 60) + g FROM generate_series($1::int, $2::int) g";
            if up.execute(insert, &[&next, &(next + n - 1)]).await.is_err() {
                // The server restarted: the insert may or may not have
                // committed, so continue after whatever the table holds.
                up = loop {
                    match tokio_postgres::connect(&writer_url, tokio_postgres::NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(conn);
                            break c;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                };
                let row = up.query_one("SELECT coalesce(max(id), -1) + 1 FROM events", &[]).await.unwrap();
                next = row.get(0);
                continue;
            }
            next += n;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(rng.range(1, 8))) => {}
                _ = writer_stop.changed() => return next,
            }
        }
    });
    // Upstream restarts, beside the kills.
    let restarter = restarts.map(|pg| restart_at_random(pg, rng.next(), run_for));
    // At every kill (the host down, its log still): the slot's confirmed
    // position, every commit the log has ever held, and the lowest it still
    // holds (what was purged below it had been durable).
    type Sample = (u64, std::collections::BTreeSet<String>, String);
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let durable: Arc<Mutex<std::collections::BTreeSet<String>>> = Arc::default();
    let sample = {
        let (samples, durable, url, slot, db) =
            (samples.clone(), durable.clone(), url.clone(), slot.clone(), spec.sqlite.clone());
        move |_: &mut Rng| {
            if let Some(confirmed) =
                tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(confirmed_flush(&url, &slot)))
            {
                let mut d = durable.lock().unwrap();
                let mut held: Vec<String> = Vec::new();
                if let Ok(conn) = rusqlite::Connection::open(&db) {
                    let sql = r#"SELECT DISTINCT watermark FROM "changeLog" WHERE tag = 'commit' AND pos > 1"#;
                    if let Ok(mut q) = conn.prepare(sql) {
                        held = q.query_map([], |r| r.get::<_, String>(0)).unwrap().filter_map(Result::ok).collect();
                    }
                }
                let low = held.iter().min().cloned().unwrap_or_default();
                d.extend(held);
                samples.lock().unwrap().push((confirmed, d.clone(), low));
            }
            Vec::new()
        }
    };
    let kills = kill_loop(&mut host, &mut rng, run_for, sample).await;
    let upstream_restarts = match restarter {
        Some(r) => r.await.unwrap(),
        None => 0,
    };
    let _ = stop_writer.send(true);
    let rows = writer.await.unwrap();
    // The replica version can change only if the host died before its
    // snapshot was stored; the subscribers follow it.
    if let Some(v) = host.status().and_then(|s| s["replicaVersion"].as_str().map(str::to_string)) {
        *rv.lock().unwrap() = v;
    }
    // Wait for every upstream row to arrive at both subscribers.
    subs.wait_for_rows(rows as usize, &host).await;
    let seen = subs.stop().await;
    host.kill();
    let txs = each_row_exactly_once(&seen, &(0..rows as i64).collect::<Vec<_>>());
    spec.assert_whole().await;

    // Upstream acks never ran ahead of the log: at each kill, every
    // transaction that committed before the slot's confirmed position was
    // durable in the change log.
    let up = connect_pg(&url).await;
    let changes = up
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', \
             'publication_names', $2)",
            &[&witness, &publication],
        )
        .await
        .unwrap();
    let commits: Vec<u64> = changes
        .iter()
        .filter_map(|r| match sluice::source::postgres::pgoutput::decode(r.get::<_, &[u8]>(0), false) {
            Ok((sluice::source::postgres::pgoutput::PgOutput::Commit { commit_lsn, .. }, _)) => Some(commit_lsn),
            _ => None,
        })
        .collect();
    assert!(commits.len() + 1 >= txs[0].min(txs[1]), "the witness saw the workload");
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    for (confirmed, durable, low) in samples.iter() {
        for lsn in commits.iter().filter(|l| **l < *confirmed) {
            let w = sluice::source::postgres::stream::watermark(*lsn);
            assert!(
                durable.contains(&w) || w < *low,
                "the slot confirmed {confirmed:x} past commit {lsn:x}, which was not durable (log from {low})"
            );
        }
    }
    let admin = connect_pg(&server).await;
    for s in [&slot, &witness] {
        admin
            .execute("SELECT pg_drop_replication_slot($1) FROM pg_replication_slots WHERE slot_name = $1", &[s])
            .await
            .unwrap();
    }
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await.unwrap();
    println!(
        "chaos {variant}: {kills} kills, {} starts, {upstream_restarts} upstream restarts, {rows} upstream rows \
         in {} and {} transactions checked row by row at the two subscribers: none lost or duplicated; \
         the slot's confirmed position checked at {} kills against {} upstream commits: never ahead of the log",
        host.starts,
        txs[0],
        txs[1],
        samples.len(),
        commits.len()
    );
}

/// The mariadb-source plugin under a write workload: MariaDB keeps
/// committing small transactions through its own client while the host is
/// killed and restarted; each subscriber must see every row exactly once,
/// and the ids it saw must be exactly the table's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mariadb_source_under_writes() {
    let (run_for, seed) = plan("mariadb-source/sqlite");
    let mut rng = Rng(seed);
    let m = common::mariadb::shared();
    let db = format!("chaos_maria_{}", std::process::id());
    m.database(&db);
    let first: Vec<String> = (0..100).map(|i| format!("({i}, (1 << 63) + {i})")).collect();
    m.sql(&format!(
        "CREATE TABLE {db}.events (id int PRIMARY KEY, big bigint unsigned); INSERT INTO {db}.events VALUES {}",
        first.join(", ")
    ));
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let mut args: Vec<String> = ["--source", "mariadb-source", "--plugins"].iter().map(|s| s.to_string()).collect();
    args.push(plugin_dir().display().to_string());
    args.extend(["--source-config".into(), m.config(&[&db]).to_string()]);
    args.extend(["--change-db".into(), format!("sqlite:{}", spec.sqlite.display())]);
    let mut host = Host::new(dir.path(), args);
    host.start(&[]);
    let rv = Arc::new(Mutex::new(host.replica_version().await));
    let subs = Subscribers::start(&host.addr, rv.clone(), seed);
    // When the writer's input ends, everything it sent has committed.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = m.writer(&db, 100, |i| format!("({i}, (1 << 63) + {i})"), stop.clone(), written, rng.next());
    let kills = kill_loop(&mut host, &mut rng, run_for, |_| Vec::new()).await;
    let (rows, txs) = finish_maria_run(&m, &db, &stop, writer, subs, &mut host, &spec).await;
    println!(
        "chaos mariadb-source/sqlite: {kills} kills, {} starts, {rows} upstream rows in {} and {} transactions \
         checked against the MariaDB table at the two subscribers: none lost or duplicated",
        host.starts, txs[0], txs[1]
    );
}

/// A slot's `confirmed_flush_lsn` as a number (`None` while the server is down).
async fn confirmed_flush(url: &str, slot: &str) -> Option<u64> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.ok()?;
    tokio::spawn(conn);
    let row = client
        .query_one("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
        .await
        .ok()?;
    let text: Option<String> = row.get(0);
    let (hi, lo) = text?.split_once('/').map(|(h, l)| (h.to_string(), l.to_string()))?;
    Some((u64::from_str_radix(&hi, 16).ok()? << 32) | u64::from_str_radix(&lo, 16).ok()?)
}

async fn connect_pg(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// How long each fuzzer runs (`SLUICE_FUZZ_SECONDS`, default 1 s in `make test`).
fn fuzz_budget(name: &str) -> (Instant, u64) {
    let secs: f64 = std::env::var("SLUICE_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let seed = std::env::var("SLUICE_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("fuzz {name}: seed {seed} for {secs} s (replay with SLUICE_CHAOS_SEED={seed})");
    (Instant::now() + Duration::from_secs_f64(secs), seed)
}

/// A well-formed pgoutput message of a random kind, as the walsender sends it.
fn pgoutput_message(rng: &mut Rng, in_stream: bool) -> Vec<u8> {
    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }
    fn tuple(out: &mut Vec<u8>, rng: &mut Rng) {
        let n = rng.range(0, 5) as i16;
        out.extend_from_slice(&n.to_be_bytes());
        for _ in 0..n {
            match rng.range(0, 4) {
                0 => out.push(b'n'),
                1 => out.push(b'u'),
                k => {
                    out.push(if k == 2 { b't' } else { b'b' });
                    let texts = [
                        "42",
                        "-9223372036854775808",
                        "3.14",
                        "t",
                        "{1,2}",
                        "\\x0aff",
                        "2024-01-02 03:04:05+00",
                        "héllo",
                    ];
                    let t = texts[rng.range(0, texts.len() as u64) as usize];
                    out.extend_from_slice(&(t.len() as i32).to_be_bytes());
                    out.extend_from_slice(t.as_bytes());
                }
            }
        }
    }
    let mut out = Vec::new();
    let tags = [b'B', b'C', b'R', b'I', b'U', b'D', b'T', b'M', b'S', b'E', b'c', b'A', b'Y', b'O'];
    let tag = tags[rng.range(0, tags.len() as u64) as usize];
    out.push(tag);
    if in_stream && matches!(tag, b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M') {
        out.extend_from_slice(&(rng.next() as u32).to_be_bytes());
    }
    let u64s = |out: &mut Vec<u8>, rng: &mut Rng, n: usize| {
        for _ in 0..n {
            out.extend_from_slice(&rng.next().to_be_bytes());
        }
    };
    match tag {
        b'B' => {
            u64s(&mut out, rng, 2);
            out.extend_from_slice(&(rng.next() as u32).to_be_bytes());
        }
        b'C' => {
            out.push(0);
            u64s(&mut out, rng, 3);
        }
        b'R' => {
            out.extend_from_slice(&(rng.range(1, 5) as u32).to_be_bytes());
            cstr(&mut out, "public");
            cstr(&mut out, "t");
            out.push(b"dnfi"[rng.range(0, 4) as usize]);
            let n = rng.range(0, 4) as i16;
            out.extend_from_slice(&n.to_be_bytes());
            for i in 0..n {
                out.push(rng.range(0, 2) as u8);
                cstr(&mut out, &format!("c{i}"));
                let oids = [16u32, 20, 21, 23, 25, 114, 700, 701, 1082, 1083, 1114, 1184, 1700, 17, 3802, 1007, 1009];
                out.extend_from_slice(&oids[rng.range(0, oids.len() as u64) as usize].to_be_bytes());
                out.extend_from_slice(&(-1i32).to_be_bytes());
            }
        }
        b'I' => {
            out.extend_from_slice(&(rng.range(1, 5) as u32).to_be_bytes());
            out.push(b'N');
            tuple(&mut out, rng);
        }
        b'U' => {
            out.extend_from_slice(&(rng.range(1, 5) as u32).to_be_bytes());
            if rng.range(0, 2) == 0 {
                out.push(b"KO"[rng.range(0, 2) as usize]);
                tuple(&mut out, rng);
            }
            out.push(b'N');
            tuple(&mut out, rng);
        }
        b'D' => {
            out.extend_from_slice(&(rng.range(1, 5) as u32).to_be_bytes());
            out.push(b"KO"[rng.range(0, 2) as usize]);
            tuple(&mut out, rng);
        }
        b'T' => {
            let n = rng.range(0, 4) as u32;
            out.extend_from_slice(&n.to_be_bytes());
            out.push(0);
            for _ in 0..n {
                out.extend_from_slice(&(rng.range(1, 5) as u32).to_be_bytes());
            }
        }
        b'M' => {
            out.push(1);
            u64s(&mut out, rng, 1);
            cstr(&mut out, "sluice/ddl");
            let body = br#"{"tag":"ALTER TABLE","schema":{}}"#;
            out.extend_from_slice(&(body.len() as u32).to_be_bytes());
            out.extend_from_slice(body);
        }
        b'S' => {
            out.extend_from_slice(&(rng.next() as u32).to_be_bytes());
            out.push(1);
        }
        b'c' => {
            out.extend_from_slice(&(rng.next() as u32).to_be_bytes());
            out.push(0);
            u64s(&mut out, rng, 3);
        }
        b'A' => u64s(&mut out, rng, 1),
        _ => u64s(&mut out, rng, 1),
    }
    out
}

/// The pgoutput decoder and the value typing behind it, on valid messages
/// and on mutations of them (bytes flipped, cut short, lengths corrupted,
/// garbage appended): every input decodes or is refused with an error, and
/// nothing panics.
#[test]
fn fuzz_pgoutput_decoding() {
    use sluice::source::postgres::pgoutput::{decode, Datum, PgOutput};
    use sluice::source::postgres::values::from_text;
    let (until, seed) = fuzz_budget("pgoutput");
    let mut rng = Rng(seed);
    let (mut runs, mut decoded, mut refused) = (0u64, 0u64, 0u64);
    while Instant::now() < until {
        for _ in 0..1000 {
            let in_stream = rng.range(0, 2) == 0;
            let mut msg = pgoutput_message(&mut rng, in_stream);
            match rng.range(0, 5) {
                0 => {}
                1 => {
                    for _ in 0..rng.range(1, 4) {
                        let i = rng.range(0, msg.len() as u64) as usize;
                        msg[i] = rng.next() as u8;
                    }
                }
                2 => msg.truncate(rng.range(0, msg.len() as u64) as usize),
                3 => msg.extend((0..rng.range(1, 16)).map(|_| rng.next() as u8)),
                _ => {
                    // A length field (4 bytes) set to something huge or negative.
                    if msg.len() > 8 {
                        let i = rng.range(1, msg.len() as u64 - 4) as usize;
                        msg[i..i + 4].copy_from_slice(&[0x7f, 0xff, 0xff, rng.next() as u8]);
                    }
                }
            }
            runs += 1;
            match decode(&msg, in_stream) {
                Ok((m, _)) => {
                    decoded += 1;
                    let tuples = match &m {
                        PgOutput::Insert { new, .. } => vec![new.clone()],
                        PgOutput::Update { old, new, .. } => {
                            old.iter().map(|(_, t)| t.clone()).chain(std::iter::once(new.clone())).collect()
                        }
                        PgOutput::Delete { old, .. } => vec![old.1.clone()],
                        _ => Vec::new(),
                    };
                    for t in tuples {
                        for d in t {
                            if let Datum::Text(b) = d {
                                let text = String::from_utf8_lossy(b);
                                for oid in
                                    [16u32, 20, 21, 23, 700, 701, 1082, 1083, 1114, 1184, 1266, 1700, 17, 3802, 1007]
                                {
                                    let _ = from_text(oid, &text);
                                }
                            }
                        }
                    }
                }
                Err(_) => refused += 1,
            }
        }
    }
    assert!(decoded > 0 && refused > 0, "the mutations exercise both paths ({decoded} decoded, {refused} refused)");
    println!("fuzz pgoutput: {runs} inputs, {decoded} decoded, {refused} refused with an error, no panic");
}

/// The subscriber endpoint against random requests: query strings built
/// from valid and hostile pieces, every protocol version in and out of range,
/// then random client frames (text that is not JSON, acks out of order or
/// absurd, binary, pings). Each request gets a status or a close with a
/// reason, the host never stops, and a well-formed subscriber afterwards
/// still receives the whole stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_subscriber_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let harness = start_mock(
        &spec,
        serde_json::json!({"transactions": 50, "rows_per_tx": 2}),
        sluice::plugin::SandboxLimits::default(),
    )
    .await;
    harness.wait_for_watermark(&lexi(50), Duration::from_secs(60)).await;
    let (_stop, stop_rx) = watch::channel(false);
    let app = sluice::server::AppState {
        hub: harness.hub.clone(),
        status: harness.status.clone(),
        subscriber_limits: sluice::subscriber::Limits::default(),
        ping_interval: Duration::from_secs(30),
        filters: sluice::filter::FilterHost::none(),
        zero_permissions: None,
        access: sluice::server::access::Access::open(),
        ready_backoff: Duration::from_secs(30),
        shutdown: stop_rx.clone(),
        plugins: None,
    };
    let (addr, serve) = sluice::server::bind("127.0.0.1:0", sluice::server::router(app), stop_rx).await.unwrap();
    tokio::spawn(serve);

    let (until, seed) = fuzz_budget("subscriber endpoint");
    let mut rng = Rng(seed);
    let keys = ["id", "taskID", "replicaVersion", "watermark", "mode", "initial", "filters", "logsChangeStream"];
    let long = "w".repeat(5000);
    let values = [
        "",
        "00",
        "01",
        "0a",
        "zz",
        "%",
        "%ZZ",
        "%00",
        "%E2%82",
        "serving",
        "backup",
        "true",
        "[]",
        "[{}]",
        r#"[{"plugin":"nope"}]"#,
        "-1",
        "x%26y%3Dz",
        "\u{7f}",
        &long,
    ];
    let (mut requests, mut statuses, mut closes, mut refused) = (0u64, 0u64, 0u64, 0u64);
    while Instant::now() < until {
        requests += 1;
        let version = [6u64, 6, 6, 5, 4, 0, 3, 7, 99][rng.range(0, 9) as usize];
        let mut query = Vec::new();
        for k in keys {
            if rng.range(0, 5) > 0 {
                let v = values[rng.range(0, values.len() as u64) as usize];
                let v = if k == "watermark" && rng.range(0, 2) == 0 { lexi(rng.range(0, 60)) } else { v.to_string() };
                query.push(format!("{k}={v}"));
            }
            if rng.range(0, 10) == 0 {
                query.push(format!("{k}=dup"));
            }
        }
        let url = format!("ws://{addr}/replication/v{version}/changes?{}", query.join("&"));
        let Ok(Ok((mut ws, _))) =
            tokio::time::timeout(Duration::from_secs(5), tokio_tungstenite::connect_async(url)).await
        else {
            refused += 1; // an HTTP-level refusal (not a WebSocket)
            continue;
        };
        // A few random client frames, then read what the server says.
        for _ in 0..rng.range(0, 4) {
            let frame = match rng.range(0, 5) {
                0 => Ws::Text(format!("{{\"ack\":{}}}", rng.next() as i64).into()),
                1 => Ws::Text("{\"ack\":".into()),
                2 => Ws::Text(String::from_utf8_lossy(&rng.next().to_le_bytes()).into_owned().into()),
                3 => Ws::Binary(rng.next().to_le_bytes().to_vec().into()),
                _ => Ws::Ping(Vec::new().into()),
            };
            if ws.send(frame).await.is_err() {
                break;
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await {
            Ok(Some(Ok(Ws::Text(t)))) => {
                let v: serde_json::Value = serde_json::from_str(&t).expect("the server sends JSON");
                let kind = v["msg"][0].as_str().unwrap_or("").to_string();
                assert!(kind == "status" || kind == "error", "first message {t}");
                statuses += 1;
            }
            Ok(Some(Ok(Ws::Close(Some(f))))) => {
                assert!(!f.reason.is_empty(), "a close names its cause");
                closes += 1;
            }
            _ => closes += 1,
        }
        let _ = ws.close(None).await;
    }
    // The host still serves a well-formed subscriber the whole stream.
    let mut client = common::ws::Client::subscribe_at(&addr.to_string(), "00", "00").await;
    let mut commits = 0;
    while commits < 50 {
        let m = client.next().await.expect("the stream");
        if m.starts_with("[\"commit\"") {
            commits += 1;
        }
    }
    assert!(!harness.is_finished(), "the replication loop keeps running");
    println!(
        "fuzz subscriber endpoint: {requests} requests ({statuses} got a status or error message, {closes} closed, \
         {refused} refused before the upgrade); the host kept serving"
    );
}

/// Plugin messages crossing into the replication loop, in random and
/// malformed orders: begins inside transactions, data outside them,
/// mismatched and backward commit watermarks, rollbacks, statuses, resets,
/// rows naming undeclared relations or carrying the wrong number of values,
/// invalid numeric and JSON text, and streams failing at random points. The
/// loop must never panic, the log must hold only whole transactions, and
/// each stored transaction must be one the source sent whole (begin, its
/// rows, commit), in increasing watermark order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_plugin_messages_into_the_loop() {
    use common::feed::{begin, commit, insert, Feed};
    use sluice::source::model::{Control, Insert, Message, Status, Value};
    let (until, seed) = fuzz_budget("plugin messages");
    let mut rng = Rng(seed);
    let (mut runs, mut messages, mut stored_txs, mut stopped) = (0u64, 0u64, 0usize, 0u64);
    while Instant::now() < until {
        runs += 1;
        let dir = tempfile::tempdir().unwrap();
        let spec = LogSpec::new(Backend::Sqlite, dir.path());
        let feed = Feed::default();
        let mut sent: Vec<Option<Message>> = Vec::new();
        let mut k = 1u64;
        for _ in 0..rng.range(3, 30) {
            let w = lexi(k);
            match rng.range(0, 12) {
                // Mostly whole transactions, some rolled back.
                0..=6 => {
                    sent.push(Some(begin(&w)));
                    for _ in 0..rng.range(0, 4) {
                        sent.push(Some(insert(rng.range(0, 100) as i64)));
                    }
                    sent.push(Some(if rng.range(0, 8) == 0 { Message::Rollback } else { commit(&w) }));
                    k += 1;
                }
                // A stream that fails inside a transaction.
                7 => {
                    sent.extend([Some(begin(&w)), Some(insert(1)), None]);
                    k += 1;
                }
                8 => sent.push(Some(Message::Status(Status { watermark: lexi(k), ack: rng.range(0, 2) == 0 }))),
                // One malformed or out-of-order message.
                _ => sent.push(match rng.range(0, 9) {
                    0 => Some(begin(&lexi(rng.range(0, k + 2)))),
                    1 => Some(insert(5)),
                    2 => Some(commit(&lexi(rng.range(0, k + 2)))),
                    3 => Some(Message::Rollback),
                    4 => Some(Message::Status(Status { watermark: lexi(rng.range(0, k)), ack: true })),
                    5 => Some(Message::Insert(Insert { relation: rng.range(1, 4) as u32, new: vec![Value::Int(1)] })),
                    6 => Some(Message::Insert(Insert { relation: 0, new: vec![Value::Int(1)] })),
                    7 => Some(Message::Insert(Insert {
                        relation: 0,
                        new: vec![
                            Value::Int(rng.range(0, 100) as i64),
                            [Value::Numeric("abc".into()), Value::Json("{bad".into()), Value::Numeric("1e5".into())]
                                [rng.range(0, 3) as usize]
                                .clone(),
                        ],
                    })),
                    _ => Some(Message::Control(Control::ResetRequired(Some("fuzz".into())))),
                }),
            }
        }
        // End on a known transaction after a failure (which aborts anything open).
        let sentinel = lexi(1_000_000);
        sent.push(None);
        sent.extend([Some(begin(&sentinel)), Some(insert(7)), Some(commit(&sentinel))]);
        messages += sent.len() as u64;
        for m in &sent {
            match m {
                Some(m) => feed.push(m.clone()),
                None => feed.fail(),
            }
        }
        let mut harness = start(&spec, Box::new(feed.clone()), sluice::streamer::StreamerOptions::default()).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let done = harness.status.snapshot().last_watermark.as_deref() == Some(sentinel.as_str());
            if done || harness.is_finished() {
                break;
            }
            assert!(Instant::now() < deadline, "the loop neither stored the sentinel nor stopped (seed {seed})");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if harness.is_finished() {
            stopped += 1;
            // A protocol violation stops the loop with a message; a panic would be a JoinError.
            if let Err(e) = harness.finished().await {
                assert!(!format!("{e:#}").contains("panicked"), "the replication loop does not panic: {e:#}");
            }
        } else {
            harness.stop().await.expect("a clean stop");
        }
        spec.assert_whole().await;

        // What the source sent whole: watermark -> ids, for runs of
        // begin, inserts (with ids), commit of the same watermark.
        let mut whole: Vec<(String, Vec<i64>)> = Vec::new();
        let mut open: Option<(String, Vec<i64>, bool)> = None;
        for m in &sent {
            match m {
                Some(Message::Begin(b)) => open = Some((b.commit_watermark.clone(), Vec::new(), true)),
                Some(Message::Insert(i)) => {
                    if let Some((_, ids, ok)) = &mut open {
                        match i.new.first() {
                            Some(Value::Int(id)) => ids.push(*id),
                            _ => *ok = false,
                        }
                    }
                }
                Some(Message::Commit(c)) => {
                    if let Some((w, ids, true)) = open.take() {
                        if w == c.watermark {
                            whole.push((w, ids));
                        }
                    }
                }
                Some(Message::Rollback) | None => open = None,
                Some(_) => {}
            }
        }
        let rows = spec.rows().await;
        let mut stored: Vec<(String, Vec<i64>)> = Vec::new();
        for r in rows.iter().filter(|r| r.watermark != "01") {
            match r.tag.as_str() {
                "begin" => stored.push((r.watermark.clone(), Vec::new())),
                "insert" => {
                    let v: serde_json::Value = serde_json::from_str(&r.change).unwrap();
                    stored.last_mut().unwrap().1.push(v["new"]["id"].as_i64().unwrap());
                }
                _ => {}
            }
        }
        for pair in stored.windows(2) {
            assert!(pair[0].0 < pair[1].0, "stored watermarks increase (seed {seed}): {stored:?}");
        }
        for tx in &stored {
            assert!(whole.contains(tx), "stored {tx:?} was never sent whole (seed {seed}); sent {sent:?}");
        }
        stored_txs += stored.len();
    }
    println!(
        "fuzz plugin messages: {runs} streams of {messages} messages, {stored_txs} transactions stored and each \
         matched a whole one sent, {stopped} streams stopped on a protocol violation; no panic, no partial transaction"
    );
}

/// Two hosts share one Postgres change DB and take it over from each other
/// at random (starting the idle one makes it the owner; the old owner must
/// stop by itself, cleanly) while either may also be SIGKILLed. Subscribers
/// follow whichever host serves. This found the takeover race fixed in
/// `Streamer::open` (the resume watermark was read before ownership was taken,
/// so the old owner's last commits could be skipped by a live subscriber);
/// `a_takeover_resumes_after_the_old_owners_last_commit` pins it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_two_hosts_take_over_a_postgres_change_db() {
    let (run_for, seed) = plan("two-hosts/postgres-change-db");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Postgres, dir.path());
    let pg = spec.pg.clone().unwrap();
    let change_db_url = common::pg_url();
    let config = serde_json::json!({"rows_per_tx": ROWS, "tables": 2, "rate": 500}).to_string();
    let args = |task: &str| -> Vec<String> {
        [
            "--source",
            "mock-source",
            "--source-config",
            &config,
            "--change-db",
            &change_db_url,
            "--app-id",
            &pg.app_id,
            "--task-id",
            task,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(["--plugins".to_string(), plugin_dir().display().to_string()])
        .collect()
    };
    let mut hosts = [Host::named(dir.path(), "a", args("a")), Host::named(dir.path(), "b", args("b"))];
    hosts[0].start(&[]);
    let addrs = hosts.iter().map(|h| h.addr.clone()).collect();
    let subs = Subscribers::start_on(addrs, Arc::new(Mutex::new("00".into())), seed);
    let (mut kills, mut takeovers, mut stepped_down) = (0u32, 0u32, 0u32);
    let deadline = Instant::now() + run_for;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.range(100, 900))).await;
        for h in hosts.iter_mut() {
            if let Some(status) = h.exited() {
                assert!(status.success(), "a host that lost ownership exits cleanly: {status}; log:\n{}", h.log_tail());
                stepped_down += 1;
            }
        }
        let i = rng.range(0, 2) as usize;
        match rng.range(0, 5) {
            0 | 1 if hosts[i].running() => {
                hosts[i].kill();
                kills += 1;
            }
            0..=3 if !hosts[i].running() => {
                if hosts[1 - i].running() {
                    takeovers += 1;
                }
                hosts[i].start(&[]);
            }
            _ => {}
        }
        if !hosts.iter().any(Host::running) {
            hosts[i].start(&[]);
        }
    }
    // Settle: one host, which takes ownership when it starts.
    for h in hosts.iter_mut() {
        h.kill();
    }
    let last = rng.range(0, 2) as usize;
    hosts[last].start(&[]);
    let target = stored_watermark(&hosts[last]).await;
    subs.reach_any(&target, &[&hosts[0], &hosts[1]]).await;
    let seen = subs.stop().await;
    for h in hosts.iter_mut() {
        h.kill();
    }
    let (checked, _) = check_mock_run(&seen, &spec).await;
    println!(
        "chaos two-hosts/postgres-change-db: {kills} kills, {takeovers} takeovers ({stepped_down} old owners \
         stopped by themselves), {} and {} transactions checked by the two subscribers: none lost or duplicated",
        checked[0], checked[1]
    );
}

/// Regression (found by the change-DB restart variant): a host started while
/// its Postgres change DB is down or still starting up exited; it must wait
/// for the database, saying so, and then replicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_started_before_its_change_db_waits_for_it() {
    let port = common::pgserver::free_port();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let args: Vec<String> = ["--source", "mock-source", "--change-db", &url, "--app-id", "waits", "--plugins"]
        .iter()
        .map(|s| s.to_string())
        .chain([plugin_dir().display().to_string()])
        .collect();
    let mut host = Host::new(dir.path(), args);
    host.start(&["--source-config".into(), r#"{"transactions": 20}"#.into()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&host.log).unwrap_or_default().contains("change DB not reachable") {
        assert!(Instant::now() < deadline, "no retry line; log:\n{}", host.log_tail());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(host.exited().is_none(), "the host waits instead of exiting; log:\n{}", host.log_tail());
    let _server = PgServer::start_on(port, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while host.status().and_then(|s| s["lastWatermark"].as_str().map(str::to_string)) != Some(lexi(20)) {
        assert!(Instant::now() < deadline, "the host did not replicate once the DB came up; log:\n{}", host.log_tail());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    host.kill();
}
