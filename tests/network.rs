//! Network faults: a fault proxy between Sluice and each peer it waits on
//! silently partitions the link (sockets open, nothing flows) under a
//! steady upstream writer, then heals it. Each case checks that the stall
//! is noticed (`/readyz` 503, the path in `/status`, one log line), that
//! Sluice recovers by itself, and that every transaction reaches the
//! subscribers exactly once (the crash suite's oracle).
//!
//! Times are measured and printed, never asserted. `make test` partitions
//! for `SLUICE_PARTITION_SECS` (default 12); `make chaos` for longer. Each
//! cut lands at a random moment; `SLUICE_CHAOS_SEED` replays a run.

#[macro_use]
mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::faultproxy::{FaultProxy, Link};
use common::host::{stored_watermark, Host};
use common::oracle::*;
use common::process::Rng;
use common::*;

/// Waits 0-1.5 s (from the run's seed), so the cut lands at a different
/// point of the stream each run.
async fn at_a_random_moment(rng: &mut Rng) {
    tokio::time::sleep(Duration::from_millis(rng.range(0, 1500))).await;
}

/// How long each partition lasts.
fn partition() -> Duration {
    let secs = std::env::var("SLUICE_PARTITION_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12.0);
    Duration::from_secs_f64(secs)
}

/// The address a `postgres://user@host:port/db` URL points at.
fn addr_of(url: &str) -> SocketAddr {
    let target = sluice::pgconn::PgTarget::parse(url).unwrap();
    let port = target.config.get_ports().first().copied().unwrap_or(5432);
    format!("{}:{port}", target.host()).parse().unwrap()
}

/// `url` with its host and port replaced by the proxy's.
fn through(url: &str, proxy: &FaultProxy) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap();
    let user = authority.rsplit_once('@').map(|(u, _)| format!("{u}@")).unwrap_or_default();
    format!("{scheme}://{user}{}/{path}", proxy.host_port())
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// `sluice run` arguments for the mock source at `rate` transactions/s
/// into `change_db` (a Postgres change DB under `app_id`, or `sqlite:PATH`
/// when `app_id` is `None`), as task `task`.
fn mock_host_args(rate: u32, change_db: &str, app_id: Option<&str>, task: &str) -> Vec<String> {
    let config = serde_json::json!({"rows_per_tx": ROWS, "tables": 2, "rate": rate}).to_string();
    let plugins = plugin_dir().display().to_string();
    let mut list = args(&["--source", "mock-source", "--source-config", &config, "--change-db", change_db]);
    if let Some(app_id) = app_id {
        list.extend(args(&["--app-id", app_id]));
    }
    list.extend(args(&["--task-id", task, "--plugins", &plugins]));
    list
}

fn last_watermark(host: &Host) -> Option<String> {
    host.status().and_then(|s| s["lastWatermark"].as_str().map(str::to_string))
}

/// Waits for `check`, polling every 50 ms, up to `limit`; returns how long it took.
async fn until(what: &str, host: &Host, limit: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "{what} did not happen within {limit:?}; log:\n{}", host.log_tail());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// The stalls `/status` reports, as `path` names.
fn stalled_paths(host: &Host) -> Vec<String> {
    let Some(status) = host.status() else { return Vec::new() };
    status["stalls"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["path"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// The host's log holds a stall line for `path` and, after it, the line
/// saying it recovered.
fn logged_stall_and_recovery(host: &Host, path: &str) -> bool {
    let log = std::fs::read_to_string(&host.log).unwrap_or_default();
    let Some(stalled) = log.find(&format!("{path} stalled:")) else { return false };
    log[stalled..].contains(&format!("{path} recovered from a stall"))
}

/// The mock source into a Postgres change DB behind the proxy. The change
/// DB link goes silent for a while: the storer's call passes its deadline,
/// the connection is dropped and reopened once the link heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_change_db_link_is_noticed_and_storage_resumes_after_it() {
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network change-db partition");
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Postgres, dir.path());
    let pg = spec.pg.clone().unwrap();
    let server = pg_url();
    let proxy = FaultProxy::start(addr_of(&server)).await;
    let change_db = through(&server, &proxy);
    let mut host = Host::new(dir.path(), mock_host_args(200, &change_db, Some(&pg.app_id), "sluice"));
    host.start(&[]);
    let subs = Subscribers::start(&host.addr, Arc::new(Mutex::new("00".into())), rng.next());
    until("storing", &host, Duration::from_secs(60), || {
        host.ready() == Some(true) && last_watermark(&host).is_some_and(|w| w >= lexi(50))
    })
    .await;

    at_a_random_moment(&mut rng).await;
    proxy.set(Link::Blackhole);
    let noticed = until("/readyz 503 while the change DB is silent", &host, Duration::from_secs(30), || {
        host.ready() == Some(false)
    })
    .await;
    assert!(stalled_paths(&host).contains(&"changeLog".to_string()), "/status names the stalled path");
    let lag_during = host.status().and_then(|s| s["sourceLagMs"].as_f64());
    tokio::time::sleep(partition().saturating_sub(noticed)).await;
    let lag_later = host.status().and_then(|s| s["sourceLagMs"].as_f64());
    if let (Some(a), Some(b)) = (lag_during, lag_later) {
        assert!(b > a, "sourceLagMs grows while storage is stalled ({a} then {b})");
    }
    let at_heal = last_watermark(&host).unwrap();
    proxy.set(Link::Up);
    let healed = Instant::now();
    until("storage resumes after the heal", &host, Duration::from_secs(60), || {
        last_watermark(&host).is_some_and(|w| w > at_heal)
    })
    .await;
    let resumed = healed.elapsed();
    until("/readyz 200 again", &host, Duration::from_secs(60), || host.ready() == Some(true)).await;
    let ready_again = healed.elapsed();
    until("the stall and its end in the log", &host, Duration::from_secs(10), || {
        logged_stall_and_recovery(&host, "change_log")
    })
    .await;

    let target = stored_watermark(&host).await;
    subs.reach(&target, &host).await;
    let seen = subs.stop().await;
    host.kill();
    let (checked, stored) = check_mock_run(&seen, &spec).await;
    println!(
        "network change-db partition of {:.1} s: noticed (/readyz 503) after {:.1} s, storage resumed {:.1} s and \
         /readyz 200 {:.1} s after the heal; {} and {} transactions checked by the two subscribers, the log holds {} \
         whole transactions: none lost or duplicated",
        partition().as_secs_f64(),
        noticed.as_secs_f64(),
        resumed.as_secs_f64(),
        ready_again.as_secs_f64(),
        checked[0],
        checked[1],
        stored.len()
    );
}

/// The owner's change DB link goes silent inside a storage transaction (as
/// when its machine dies: no close ever reaches the server) and a standby
/// starts on the same change DB. The owner's server session holds the
/// `replicationState` row lock until the server ends it
/// (idle_in_transaction_session_timeout, or statement_timeout in the middle
/// of a statement); then the standby owns the log and subscribers continue
/// from it exactly once. When the link heals, the old owner finds
/// ownership gone and stops by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_an_owner_whose_change_db_link_went_silent() {
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network takeover");
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Postgres, dir.path());
    let pg = spec.pg.clone().unwrap();
    let server = pg_url();
    let proxy = FaultProxy::start(addr_of(&server)).await;
    let host_args = |task: &str, change_db: &str| mock_host_args(1000, change_db, Some(&pg.app_id), task);
    let mut owner = Host::named(dir.path(), "owner", host_args("owner", &through(&server, &proxy)));
    let mut standby = Host::named(dir.path(), "standby", host_args("standby", &server));
    let subs = start_owner_with_subscribers(&mut owner, &standby, &mut rng).await;

    // Cut the link while the owner's session holds the lock (it is inside a
    // storage transaction): the case a dead machine leaves behind. A cut
    // that lands just after a commit is healed and tried again.
    let admin = connect_pg(&server).await;
    let table = format!(r#"{}."replicationState""#, spec.schema());
    let lock_held = || async {
        let sql = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                   WHERE l.locktype = 'relation' AND l.granted AND l.relation = $1::text::regclass \
                   AND a.application_name = 'zero-change-streamer'";
        admin.query_one(sql, &[&table]).await.unwrap().get::<_, i64>(0) > 0
    };
    let mut attempts = 0;
    let cut = loop {
        attempts += 1;
        assert!(attempts <= 100, "never cut the link inside a storage transaction");
        while !lock_held().await {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        proxy.set(Link::Blackhole);
        let cut = Instant::now();
        // What was in flight lands; a transaction still open now cannot end.
        tokio::time::sleep(Duration::from_millis(300)).await;
        if lock_held().await {
            break cut;
        }
        proxy.set(Link::Up);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let before = last_watermark(&owner).unwrap();
    standby.start(&[]);
    until("the standby owning and storing past the owner", &standby, Duration::from_secs(90), || {
        last_watermark(&standby).is_some_and(|w| w > before) && standby.ready() == Some(true)
    })
    .await;
    let took_over = cut.elapsed();
    let owner_noticed = owner.ready() == Some(false);

    proxy.set(Link::Up);
    let deadline = Instant::now() + Duration::from_secs(90);
    let stopped = loop {
        if let Some(status) = owner.exited() {
            break status;
        }
        assert!(Instant::now() < deadline, "the old owner did not stop by itself; log:\n{}", owner.log_tail());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(stopped.success(), "the old owner exits cleanly: {stopped}; log:\n{}", owner.log_tail());
    let target = stored_watermark(&standby).await;
    subs.reach_any(&target, &[&owner, &standby]).await;
    let seen = subs.stop().await;
    standby.kill();
    let (checked, _) = check_mock_run(&seen, &spec).await;
    let standby_log = std::fs::read_to_string(&standby.log).unwrap_or_default();
    let lock_line = standby_log.lines().find(|l| l.contains("replicationState row is held by")).unwrap_or("none");
    println!(
        "network takeover: the standby owned the log and stored past the silent owner {:.1} s after the owner's \
         change DB link went silent inside a storage transaction (cut on attempt {attempts}; the owner's /readyz \
         was {} then); {} and {} transactions checked by the two subscribers: none lost or duplicated; the \
         standby's line on who held the lock: {lock_line}",
        took_over.as_secs_f64(),
        if owner_noticed { "503" } else { "200" },
        checked[0],
        checked[1]
    );
}

/// A host cut off in the middle of a `COPY` into the change DB leaves its
/// session waiting for the rest of the data while it holds the
/// replicationState lock. No server timeout ends such a session:
/// `statement_timeout` is acted on only once data arrives, the session is
/// not idle in its transaction, and its keepalives may be answered by a
/// middlebox. The test plays that session itself, deterministically (it
/// locks the row as a storage transaction does, starts the COPY and sends
/// half a row, then goes silent with its socket open); the standby must
/// end it and take over, and every transaction arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_ends_an_owner_session_left_in_the_middle_of_a_copy() {
    use futures::SinkExt;
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network stuck copy");
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Postgres, dir.path());
    let pg = spec.pg.clone().unwrap();
    let server = pg_url();
    // A 2 s call timeout: a session stuck for 4 s is ended.
    let host_args = |task: &str| {
        let mut list = mock_host_args(1000, &server, Some(&pg.app_id), task);
        list.extend(args(&["--change-db-timeout-ms", "2000"]));
        list
    };
    let mut owner = Host::named(dir.path(), "owner", host_args("owner"));
    let mut standby = Host::named(dir.path(), "standby", host_args("standby"));
    let subs = start_owner_with_subscribers(&mut owner, &standby, &mut rng).await;
    owner.kill();

    // The owner's session, cut off in the middle of a storage transaction's COPY.
    let stuck = connect_pg(&server).await;
    let s = spec.schema();
    stuck.batch_execute("SET application_name = 'zero-change-streamer'").await.unwrap();
    stuck.batch_execute("BEGIN").await.unwrap();
    let row = stuck.query_one(&format!(r#"SELECT "lastWatermark" FROM {s}."replicationState" FOR UPDATE"#), &[]).await;
    let before: String = row.unwrap().get(0);
    let copy = format!(r#"COPY {s}."changeLog" (watermark, pos, change, precommit) FROM STDIN (FORMAT binary)"#);
    let sink = stuck.copy_in::<_, bytes::Bytes>(copy.as_str()).await.unwrap();
    futures::pin_mut!(sink);
    // The binary COPY header, then a row whose first field promises 100 bytes and carries 3.
    let mut half = b"PGCOPY\n\xff\r\n\0".to_vec();
    half.extend_from_slice(&[0; 8]);
    half.extend_from_slice(&4i16.to_be_bytes());
    half.extend_from_slice(&100i32.to_be_bytes());
    half.extend_from_slice(b"zzz");
    sink.send(bytes::Bytes::from(half)).await.unwrap();
    let admin = connect_pg(&server).await;
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'zero-change-streamer' \
                   AND state = 'active' AND wait_event = 'ClientRead' AND query LIKE 'COPY%'";
    let started = Instant::now();
    while admin.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "the COPY never waited for the rest of its data");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let stuck_since = Instant::now();
    standby.start(&[]);
    until("the standby owning and storing past the stuck session", &standby, Duration::from_secs(60), || {
        last_watermark(&standby).is_some_and(|w| w > before) && standby.ready() == Some(true)
    })
    .await;
    let took_over = stuck_since.elapsed();
    let ended = sink.finish().await;
    assert!(ended.is_err(), "the stuck session was ended, so its COPY cannot finish");
    let standby_log = std::fs::read_to_string(&standby.log).unwrap_or_default();
    let line = standby_log.lines().find(|l| l.contains("ended the change DB session pid"));
    assert!(line.is_some(), "one line says which session was ended and why; log:\n{}", standby.log_tail());

    let target = stored_watermark(&standby).await;
    subs.reach_any(&target, &[&owner, &standby]).await;
    let seen = subs.stop().await;
    standby.kill();
    let (checked, _) = check_mock_run(&seen, &spec).await;
    println!(
        "stuck copy: the standby ended the session left in the middle of a COPY and stored past it {:.1} s after \
         the session went silent (call timeout 2 s, so stuck after 4 s); {} and {} transactions checked by the two \
         subscribers: none lost or duplicated; {}",
        took_over.as_secs_f64(),
        checked[0],
        checked[1],
        line.unwrap_or_default().trim()
    );
}

/// Starts `owner` with two subscribers that move to `standby` when the
/// owner goes, and waits until the owner has stored 50 transactions.
async fn start_owner_with_subscribers(owner: &mut Host, standby: &Host, rng: &mut Rng) -> Subscribers {
    owner.start(&[]);
    let subs = Subscribers::start_on(
        vec![owner.addr.clone(), standby.addr.clone()],
        Arc::new(Mutex::new("00".into())),
        rng.next(),
    );
    until("the owner storing", owner, Duration::from_secs(60), || last_watermark(owner).is_some_and(|w| w >= lexi(50)))
        .await;
    subs
}

/// The built-in Postgres source behind the proxy (its replication and
/// normal connections) while the upstream keeps committing: the silent
/// replication link is noticed by its probes, reopened once it heals, and
/// the replica catches up with every row exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_upstream_link_is_noticed_and_replication_catches_up() {
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network upstream partition");
    let server = pg_url();
    let db = format!("netfault_{}", std::process::id());
    let admin = connect_pg(&server).await;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await.unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {db}")).await.unwrap();
    let url = format!("{}/{db}", server.rsplit_once('/').unwrap().0);
    let up = connect_pg(&url).await;
    up.batch_execute("CREATE TABLE events (id int PRIMARY KEY)").await.unwrap();
    let proxy = FaultProxy::start(addr_of(&server)).await;
    let slot = format!("netfault_{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let config = serde_json::json!({"url": through(&url, &proxy), "slot": slot}).to_string();
    let change_db = format!("sqlite:{}", spec.sqlite.display());
    let mut host =
        Host::new(dir.path(), args(&["--source", "postgres", "--source-config", &config, "--change-db", &change_db]));
    host.start(&[]);
    let rv = Arc::new(Mutex::new(host.replica_version().await));
    let subs = Subscribers::start(&host.addr, rv, rng.next());

    // The upstream commits 1-4 rows per transaction, about 200 a second.
    let written = Arc::new(AtomicI32::new(0));
    let (stop_writer, mut writer_stop) = tokio::sync::watch::channel(false);
    let writer = {
        let written = written.clone();
        let mut rng = Rng(rng.next());
        tokio::spawn(async move {
            let mut next = 0;
            loop {
                let n = rng.range(1, 5) as i32;
                let insert = "INSERT INTO events SELECT generate_series($1::int, $2::int)";
                up.execute(insert, &[&next, &(next + n - 1)]).await.unwrap();
                next += n;
                written.store(next, Ordering::Release);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                    _ = writer_stop.changed() => return next,
                }
            }
        })
    };
    subs.wait_for_rows(200, &host).await;
    until("ready", &host, Duration::from_secs(30), || host.ready() == Some(true)).await;

    at_a_random_moment(&mut rng).await;
    proxy.set(Link::Blackhole);
    let noticed = until("/readyz 503 while the upstream is silent", &host, Duration::from_secs(30), || {
        host.ready() == Some(false)
    })
    .await;
    assert!(stalled_paths(&host).contains(&"source".to_string()), "/status names the stalled path");
    tokio::time::sleep(partition().saturating_sub(noticed)).await;
    proxy.set(Link::Up);
    let healed = Instant::now();
    let rows_at_heal = written.load(Ordering::Acquire) as usize;
    subs.wait_for_rows(rows_at_heal, &host).await;
    let caught_up = healed.elapsed();
    until("/readyz 200 again", &host, Duration::from_secs(60), || host.ready() == Some(true)).await;
    let ready_again = healed.elapsed();
    until("the stall and its end in the log", &host, Duration::from_secs(10), || {
        logged_stall_and_recovery(&host, "source")
    })
    .await;

    let _ = stop_writer.send(true);
    let rows = writer.await.unwrap();
    subs.wait_for_rows(rows as usize, &host).await;
    let seen = subs.stop().await;
    host.kill();
    let txs = each_row_exactly_once(&seen, &(0..rows as i64).collect::<Vec<_>>());
    spec.assert_whole().await;
    admin
        .execute("SELECT pg_drop_replication_slot($1) FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
        .await
        .unwrap();
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await.unwrap();
    println!(
        "network upstream partition of {:.1} s: noticed (/readyz 503) after {:.1} s, the subscribers had every row \
         written before the heal {:.1} s and /readyz 200 {:.1} s after it; {rows} rows in {} and {} transactions \
         checked row by row: none lost or duplicated",
        partition().as_secs_f64(),
        noticed.as_secs_f64(),
        caught_up.as_secs_f64(),
        ready_again.as_secs_f64(),
        txs[0],
        txs[1]
    );
}

async fn connect_pg(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// The mariadb-source plugin behind the proxy while MariaDB keeps
/// committing: the silent binlog link is noticed through the plugin's
/// heartbeats and calls, reopened once it heals, and every row arrives
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_mariadb_link_is_noticed_and_replication_catches_up() {
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network mariadb partition");
    let m = common::mariadb::shared();
    let db = format!("netfault_maria_{}", std::process::id());
    m.database(&db);
    m.sql(&format!("CREATE TABLE {db}.events (id int PRIMARY KEY)"));
    let proxy = FaultProxy::start(format!("{}:{}", m.host, m.port).parse().unwrap()).await;
    let mut config = m.config(&[&db]);
    config["host"] = proxy.addr.ip().to_string().into();
    config["port"] = proxy.addr.port().into();
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let plugins = plugin_dir().display().to_string();
    let change_db = format!("sqlite:{}", spec.sqlite.display());
    let mut host = Host::new(
        dir.path(),
        args(&[
            "--source",
            "mariadb-source",
            "--plugins",
            &plugins,
            "--source-config",
            &config.to_string(),
            "--change-db",
            &change_db,
        ]),
    );
    host.start(&[]);
    let rv = Arc::new(Mutex::new(host.replica_version().await));
    let subs = Subscribers::start(&host.addr, rv, rng.next());

    // Over MariaDB's socket, not through the proxy.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = m.writer(&db, 0, |i| format!("({i})"), stop.clone(), written.clone(), rng.next());
    subs.wait_for_rows(200, &host).await;
    until("ready", &host, Duration::from_secs(30), || host.ready() == Some(true)).await;

    at_a_random_moment(&mut rng).await;
    proxy.set(Link::Blackhole);
    let noticed =
        until("/readyz 503 while MariaDB is silent", &host, Duration::from_secs(30), || host.ready() == Some(false))
            .await;
    tokio::time::sleep(partition().saturating_sub(noticed)).await;
    proxy.set(Link::Up);
    let healed = Instant::now();
    // The rows committed by now (the writer's count is of rows sent).
    let rows_at_heal: usize = m.sql(&format!("SELECT COUNT(*) FROM {db}.events")).trim().parse().unwrap();
    subs.wait_for_rows(rows_at_heal, &host).await;
    let caught_up = healed.elapsed();
    until("/readyz 200 again", &host, Duration::from_secs(60), || host.ready() == Some(true)).await;
    let ready_again = healed.elapsed();

    let (rows, txs) = finish_maria_run(&m, &db, &stop, writer, subs, &mut host, &spec).await;
    println!(
        "network mariadb partition of {:.1} s: noticed (/readyz 503) after {:.1} s, the subscribers had the rows \
         written before the heal {:.1} s and /readyz 200 {:.1} s after it; {rows} rows in {} and {} transactions \
         checked against the table: none lost or duplicated",
        partition().as_secs_f64(),
        noticed.as_secs_f64(),
        caught_up.as_secs_f64(),
        ready_again.as_secs_f64(),
        txs[0],
        txs[1]
    );
}

/// A subscriber whose link goes silent (its machine died, or a middlebox
/// dropped the flow) while Sluice streams to it: Sluice closes it within
/// its ping bound and frees what it held, while another subscriber on a
/// healthy link goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_subscriber_is_closed_and_its_memory_freed() {
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network silent subscriber");
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let change_db = format!("sqlite:{}", spec.sqlite.display());
    let mut host = Host::new(dir.path(), mock_host_args(500, &change_db, None, "sluice"));
    host.start(&[]);
    host.replica_version().await;
    let proxy = FaultProxy::start(host.addr.parse().unwrap()).await;
    let healthy = Subscribers::start(&host.addr, Arc::new(Mutex::new("00".into())), rng.next());
    let url = format!(
        "ws://{}/replication/v6/changes?id=silent&taskID=silent&replicaVersion=00&watermark=00",
        proxy.host_port()
    );
    let (mut silent, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    // It reads and acks like any subscriber until its link goes silent.
    let reading = tokio::spawn(async move {
        use futures::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::Message as Ws;
        while let Some(Ok(frame)) = silent.next().await {
            if let Ws::Text(t) = frame {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                if silent.send(Ws::Text(format!("{{\"ack\":{}}}", v["id"]).into())).await.is_err() {
                    return;
                }
            }
        }
    });
    let subscribers = |host: &Host| host.status().and_then(|s| s["subscribers"].as_u64()).unwrap_or(0);
    until("both subscribers served", &host, Duration::from_secs(30), || subscribers(&host) >= 3).await;
    at_a_random_moment(&mut rng).await;
    proxy.set(Link::Blackhole);
    let closed = until("the silent subscriber closed", &host, Duration::from_secs(60), || {
        host.status().is_some_and(|s| {
            s["subscriberPositions"].as_array().is_some_and(|p| p.iter().all(|sub| sub["id"] != "silent"))
        })
    })
    .await;
    let log = std::fs::read_to_string(&host.log).unwrap_or_default();
    let line = log.lines().find(|l| l.contains("subscriber disconnected") && l.contains("silent")).map(str::to_string);
    assert!(line.is_some(), "one line says why it was closed:\n{}", host.log_tail());
    let target = stored_watermark(&host).await;
    healthy.reach(&target, &host).await;
    let seen = healthy.stop().await;
    reading.abort();
    host.kill();
    let (checked, _) = check_mock_run(&seen, &spec).await;
    println!(
        "network silent subscriber: closed {:.1} s after its link went silent ({}); the healthy subscribers went on \
         ({} and {} transactions, exactly once)",
        closed.as_secs_f64(),
        line.unwrap_or_default().split("subscriber disconnected: ").nth(1).unwrap_or(""),
        checked[0],
        checked[1]
    );
}

/// The zero-custom-source plugin with its upstream (Zero's custom
/// change-source protocol) behind the proxy: the silent link is noticed by
/// the plugin's pings, `/readyz` turns 503 while it cannot reconnect, and
/// once the link heals every transaction appended meanwhile arrives
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_custom_upstream_link_is_noticed_and_replication_resumes() {
    use custom_upstream::{event, snapshot, Tx, Upstream, SNAPSHOT};
    let mut rng = Rng::from_env("SLUICE_CHAOS_SEED", "network custom-upstream partition");
    let wm = |i: u32| format!("1{i:04}");
    let up = Upstream::start(snapshot(2)).await;
    let proxy = FaultProxy::start(up.addr).await;
    let config = serde_json::json!({
        "url": format!("ws://{}/", proxy.host_port()), "appID": "zero", "shardNum": 0, "publications": ["pub_a"],
    })
    .to_string();
    let dir = tempfile::tempdir().unwrap();
    let registry =
        Arc::new(sluice::plugin::Registry::load(&plugin_dir(), Some(dir.path().join("cache"))).await.unwrap());
    let grant = sluice::plugin::net::grant_for(&config, &[]).unwrap();
    let source: common::restartable::SourceFactory = Box::new(move || {
        let (registry, config, grant) = (registry.clone(), config.clone(), grant.clone());
        Box::pin(async move {
            let source = registry.source("zero-custom-source", config, sluice::plugin::SandboxLimits::default(), grant);
            Box::new(source.await.unwrap()) as Box<dyn sluice::source::ChangeSource>
        })
    });
    let sluice =
        common::restartable::Restartable::start(dir, sluice::streamer::StreamerOptions::default(), source).await;
    sluice.stored(&format!("{SNAPSHOT}.01")).await;
    let mut client = common::ws::Client::subscribe_at(&sluice.addr, SNAPSHOT, SNAPSHOT).await;
    let mut history: Vec<Tx> = Vec::new();
    let mut append = |i: u32| {
        let tx = Tx::new(&wm(i), &[event(i as i64 * 10), event(i as i64 * 10 + 1)]);
        up.append(tx.clone());
        history.push(tx);
    };
    for i in 1..=5 {
        append(i);
    }
    let mut got = read_through(&mut client, &wm(5)).await;
    let ready = |s: &sluice::status::Status| s.readiness(Duration::from_secs(30)).is_ok();
    assert!(ready(&sluice.status), "ready before the fault");

    at_a_random_moment(&mut rng).await;
    proxy.set(Link::Blackhole);
    let cut = Instant::now();
    for i in 6..=10 {
        append(i);
    }
    // The subscriber reads on throughout, as zero-cache does (one that
    // stops reading stops answering pings and is closed).
    let rest = tokio::spawn(async move { read_through(&mut client, &wm(10)).await });
    while ready(&sluice.status) {
        assert!(cut.elapsed() < Duration::from_secs(60), "/readyz never turned 503 while the upstream was silent");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let noticed = cut.elapsed();
    let reason = sluice.status.readiness(Duration::from_secs(30)).unwrap_err();
    tokio::time::sleep(partition().saturating_sub(noticed)).await;
    proxy.set(Link::Up);
    let healed = Instant::now();
    got.extend(rest.await.unwrap());
    let caught_up = healed.elapsed();
    assert_custom_exactly_once(&got, &history, SNAPSHOT);
    println!(
        "network custom-upstream partition of {:.1} s: noticed (/readyz 503: {reason}) after {:.1} s, the transactions \
         appended meanwhile arrived {:.1} s after the heal, each exactly once",
        partition().as_secs_f64(),
        noticed.as_secs_f64(),
        caught_up.as_secs_f64()
    );
}

/// Messages up to and including the commit at `last`, as JSON.
async fn read_through(client: &mut common::ws::Client, last: &str) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    loop {
        let m = client.next().await.expect("the stream stays open");
        let v: serde_json::Value = serde_json::from_str(&m).unwrap();
        let done = v[0] == "commit" && v[2]["watermark"] == last;
        out.push(v);
        if done {
            return out;
        }
    }
}

/// Every transaction of `history` arrived once, whole and in order, after
/// the snapshot; an interrupted one ends in a rollback.
fn assert_custom_exactly_once(messages: &[serde_json::Value], history: &[custom_upstream::Tx], snapshot: &str) {
    let mut expected = vec![format!("{snapshot}.01")];
    expected.extend(history.iter().map(|t| t.watermark.clone()));
    let commits: Vec<String> =
        messages.iter().filter(|m| m[0] == "commit").map(|m| m[2]["watermark"].as_str().unwrap().to_string()).collect();
    assert_eq!(commits, expected);
    let mut open = false;
    for m in messages {
        match m[0].as_str().unwrap() {
            "begin" => {
                assert!(!open, "begin inside a transaction: {m}");
                open = true;
            }
            "commit" | "rollback" => {
                assert!(open, "{m} outside a transaction");
                open = false;
            }
            "data" => assert!(open, "data outside a transaction: {m}"),
            _ => {}
        }
    }
}
