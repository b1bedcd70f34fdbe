//! Zero's own client against Sluice: `ChangeStreamerHttpClient` from the
//! published `@rocicorp/zero` 1.9.0 package (installed by `make test` into
//! tests/interop/node_modules) subscribes to a running Sluice fed by the mock
//! source. Every message must pass Zero's downstream schema and every
//! transaction must arrive once and in order, across a SIGKILL and restart of
//! Sluice in the middle. The same client then follows the Postgres source,
//! a custom upstream and MariaDB (the mariadb-source plugin).

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn interop_dir() -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/interop");
    assert!(
        dir.join("node_modules/@rocicorp/zero/package.json").exists(),
        "@rocicorp/zero is not installed in {}: run `make interop-deps` (make test does)",
        dir.display()
    );
    dir
}

/// Zero's client (`subscribe.mjs`) as a child process, its output lines
/// forwarded to a channel.
struct ZeroClient {
    node: Child,
    lines: mpsc::Receiver<String>,
}

impl ZeroClient {
    fn spawn(args: &[&str]) -> ZeroClient {
        let mut node = Command::new("node")
            .arg(interop_dir().join("subscribe.mjs"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node is installed");
        let stdout = node.stdout.take().unwrap();
        let (lines_tx, lines) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    return;
                }
            }
        });
        ZeroClient { node, lines }
    }

    /// Waits (up to two minutes) for the client's summary line and its exit.
    fn finish(mut self) -> (serde_json::Value, std::process::ExitStatus) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let summary = loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("the client finishes");
            if line.starts_with('{') {
                break line;
            }
        };
        (serde_json::from_str(&summary).unwrap(), self.node.wait().unwrap())
    }
}

fn spawn_sluice(change_db: &str, addr: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "--source", "mock-source", "--listen", addr, "--app-id", "interop"])
        .args(["--source-config", r#"{"transactions": 300, "rows_per_tx": 3, "rate": 150}"#])
        .arg("--plugins")
        .arg(common::plugin_dir())
        .arg("--change-db")
        .arg(change_db)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn zeros_client_receives_every_transaction_once_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("log.db").display());
    let addr = common::process::free_addr();
    across_a_restart(&db, &addr, &format!("ws://{addr}/"));
}

/// With a Postgres change DB, Zero's client finds Sluice the way a
/// view-syncer does: from `replicationState.ownerAddress`.
#[test]
fn zeros_client_discovers_sluice_from_the_change_db() {
    let url = common::pg_url();
    let addr = common::process::free_addr();
    // A fresh schema for this run.
    let status = Command::new("psql")
        .args(["-q", "-v", "ON_ERROR_STOP=1", &url, "-c", r#"DROP SCHEMA IF EXISTS "interop_0/cdc" CASCADE"#])
        .status()
        .expect("psql is installed");
    assert!(status.success());
    across_a_restart(&url, &addr, &url);
}

fn across_a_restart(change_db: &str, addr: &str, target: &str) {
    let mut sluice = spawn_sluice(change_db, addr);

    let mut client = ZeroClient::spawn(&[target, "00", "300", "interop"]);
    let lines = &client.lines;

    // Let Zero's client take 100 transactions, then kill Sluice under it.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut commits = 0;
    let mut summary = None;
    while commits < 100 {
        let line = lines.recv_timeout(deadline - Instant::now()).expect("the client makes progress");
        if line.starts_with("commit ") {
            commits += 1;
        } else if line.starts_with('{') {
            summary = Some(line);
            break;
        }
    }
    assert!(summary.is_none(), "the client finished early: {summary:?}");
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    let mut sluice = spawn_sluice(change_db, addr);

    while summary.is_none() {
        let line = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("the client finishes");
        if line.starts_with('{') {
            summary = Some(line);
        }
    }
    let status = client.node.wait().unwrap();
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    let summary: serde_json::Value = serde_json::from_str(summary.as_deref().unwrap()).unwrap();
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["commits"], 300, "{summary}");
    assert!(summary["reconnects"].as_u64().unwrap() >= 1, "the restart forced a reconnect: {summary}");
    assert!(status.success(), "{summary}");
}

/// Zero's client on the built-in Postgres source: the initial snapshot and
/// then every upstream transaction once, in order, with big integers
/// intact, across a SIGKILL of Sluice while the upstream keeps writing.
#[test]
fn zeros_client_follows_the_postgres_source_across_a_kill() {
    let server = common::pg_url();
    let db = "interop_pgsource";
    let psql = |url: &str, sql: &str| {
        let ok = Command::new("psql").args(["-q", "-v", "ON_ERROR_STOP=1", url, "-c", sql]).status().unwrap();
        assert!(ok.success(), "psql {sql}");
    };
    psql(&server, "SELECT pg_drop_replication_slot('interop') FROM pg_replication_slots WHERE slot_name = 'interop'");
    psql(&server, &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"));
    psql(&server, &format!("CREATE DATABASE {db}"));
    let url = format!("{}/{db}", server.rsplit_once('/').unwrap().0);
    psql(&url, "CREATE TABLE events (id int PRIMARY KEY, big bigint)");
    psql(&url, "INSERT INTO events SELECT g, (1::int8 << 60) + g FROM generate_series(0, 49) g");

    let dir = tempfile::tempdir().unwrap();
    let change_db = format!("sqlite:{}", dir.path().join("log.db").display());
    let addr = common::process::free_addr();
    let config = serde_json::json!({ "url": url, "slot": "interop" }).to_string();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--source", "postgres", "--listen", &addr, "--source-config", &config])
            .args(["--change-db", &change_db])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let write = |from: i32, to: i32| {
        for id in from..to {
            psql(&url, &format!("INSERT INTO events VALUES ({id}, (1::int8 << 60) + {id})"));
        }
    };
    follow_events_across_a_kill(&addr, spawn, write);
}

/// Zero's client follows a database source whose table `events` holds rows
/// 0..49 at the snapshot: `write(a, b)` commits rows a..b, one transaction
/// each. 1 snapshot + 200 transactions (250 events) must arrive once, in
/// order, although Sluice is SIGKILLed and restarted in the middle.
fn follow_events_across_a_kill(addr: &str, spawn: impl Fn() -> Child, write: impl Fn(i32, i32)) {
    let mut sluice = spawn();
    let replica_version = wait_for_replica_version(addr);
    let client =
        ZeroClient::spawn(&[&format!("ws://{addr}/"), replica_version.as_str(), "201", "zero", "events", "250"]);
    write(50, 150);
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    write(150, 200);
    let mut sluice = spawn();
    write(200, 250);

    let (summary, status) = client.finish();
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["commits"], 201, "{summary}");
    assert!(status.success(), "{summary}");
}

/// The replica version from Sluice's /status, once the source has opened.
fn wait_for_replica_version(addr: &str) -> String {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "sluice reports no replica version");
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let _ = write!(s, "GET /status HTTP/1.0\r\nHost: {addr}\r\n\r\n");
            let mut body = String::new();
            let _ = s.read_to_string(&mut body);
            if let Some((_, json)) = body.split_once("\r\n\r\n") {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(json) {
                    if let Some(rv) = v["replicaVersion"].as_str() {
                        return rv.to_string();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Zero's client on the zero-custom-source plugin: a custom upstream (Zero's
/// custom change-source protocol, served by the test upstream) streams a
/// snapshot and 3,000 transactions through a Sluice process that is
/// SIGKILLed and restarted in the middle; the snapshot and every transaction
/// arrive once, in order, and pass Zero's downstream schema, and the upstream
/// is acked up to the last commit.
#[test]
fn zeros_client_follows_a_custom_upstream_across_a_kill() {
    custom_upstream_across_a_kill(false);
}

/// The same against an upstream that serves as zero-cache reads it: the
/// snapshot alone on a connection without `lastWatermark`, the stream only
/// on one with it.
#[test]
fn zeros_client_follows_a_zero_cache_style_custom_upstream_across_a_kill() {
    custom_upstream_across_a_kill(true);
}

fn custom_upstream_across_a_kill(zero_cache_style: bool) {
    use custom_upstream::{event, snapshot, Tx, Upstream};
    const EVENTS: i64 = 3050;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let up = rt.block_on(Upstream::start(snapshot(50)));
    if zero_cache_style {
        up.snapshot_only_on_initial();
    }
    let dir = tempfile::tempdir().unwrap();
    let change_db = format!("sqlite:{}", dir.path().join("log.db").display());
    let addr = common::process::free_addr();
    let config = serde_json::json!({ "url": up.url(), "appID": "zero" }).to_string();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--source", "zero-custom-source", "--listen", &addr, "--source-config", &config])
            .arg("--plugins")
            .arg(common::plugin_dir())
            .args(["--change-db", &change_db])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut sluice = spawn();
    let replica_version = wait_for_replica_version(&addr);
    assert_eq!(replica_version, custom_upstream::SNAPSHOT);

    // 1 snapshot (events 0..49) + one transaction per later event.
    let commits = (EVENTS - 50 + 1).to_string();
    let client = ZeroClient::spawn(&[
        &format!("ws://{addr}/"),
        replica_version.as_str(),
        &commits,
        "zero",
        "events",
        &EVENTS.to_string(),
    ]);
    let lines = &client.lines;
    let watermark = |id: i64| format!("1{id:04}");
    let write = |from: i64, to: i64| {
        for id in from..to {
            up.append(Tx::new(&watermark(id), &[event(id)]));
        }
    };
    write(50, 1550);
    // Kill in the middle, once the client has seen a thousand of them, so it
    // reconnects too.
    let deadline = Instant::now() + Duration::from_secs(120);
    let middle = watermark(1000);
    loop {
        let line = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap();
        if line.strip_prefix("commit ").is_some_and(|w| w.len() == middle.len() && *w >= *middle) {
            break;
        }
    }
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    write(1550, 2300);
    let mut sluice = spawn();
    write(2300, EVENTS);

    let (summary, status) = client.finish();
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["commits"], EVENTS - 50 + 1, "{summary}");
    assert!(status.success(), "{summary}");
    // Acks reach the upstream up to the last commit.
    let last = watermark(EVENTS - 1);
    let deadline = Instant::now() + Duration::from_secs(60);
    while up.acked().as_deref() != Some(last.as_str()) {
        assert!(Instant::now() < deadline, "the upstream was acked up to {:?}, not {last}", up.acked());
        std::thread::sleep(Duration::from_millis(20));
    }
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    // The restarted Sluice resumed the upstream where the log ended; only
    // the very first connection asked for a snapshot.
    let conns = up.connections();
    assert!(conns.len() >= 2, "{conns:?}");
    assert!(conns[1..].iter().all(|q| custom_upstream::param(q, "lastWatermark").is_some()), "{conns:?}");
}

/// Zero's client on the mariadb-source plugin: the initial snapshot and then
/// every MariaDB transaction once, in order, with big integers intact and
/// every message passing Zero's downstream schema, across a SIGKILL of
/// Sluice while MariaDB keeps committing.
#[test]
fn zeros_client_follows_mariadb_across_a_kill() {
    let m = common::mariadb::shared();
    let db = "interop_mariadb";
    m.database(db);
    let first: Vec<String> = (0..50).map(|i| format!("({i}, (1 << 60) + {i})")).collect();
    m.sql(&format!(
        "CREATE TABLE {db}.events (id int PRIMARY KEY, big bigint); INSERT INTO {db}.events VALUES {}",
        first.join(", ")
    ));

    let dir = tempfile::tempdir().unwrap();
    let change_db = format!("sqlite:{}", dir.path().join("log.db").display());
    let addr = common::process::free_addr();
    let config = m.config(&[db]).to_string();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--source", "mariadb-source", "--listen", &addr, "--source-config", &config])
            .arg("--plugins")
            .arg(common::plugin_dir())
            .args(["--change-db", &change_db])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let write = |from: i32, to: i32| {
        let stmts: Vec<String> =
            (from..to).map(|id| format!("INSERT INTO {db}.events VALUES ({id}, (1 << 60) + {id})")).collect();
        m.sql(&stmts.join(";"));
    };
    follow_events_across_a_kill(&addr, spawn, write);
}
