//! Zero's own client against Sluice: `ChangeStreamerHttpClient` from the
//! published `@rocicorp/zero` 1.9.0 package (installed by `make test` into
//! tests/interop/node_modules) subscribes to a running Sluice fed by the mock
//! source. Every message must pass Zero's downstream schema and every
//! transaction must arrive once and in order, across a SIGKILL and restart of
//! Sluice in the middle.

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

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
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
    let addr = free_port();
    across_a_restart(&db, &addr, &format!("ws://{addr}/"));
}

/// With a Postgres change DB, Zero's client finds Sluice the way a
/// view-syncer does: from `replicationState.ownerAddress`.
#[test]
fn zeros_client_discovers_sluice_from_the_change_db() {
    let url = common::pg_url();
    let addr = free_port();
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

    let mut node = Command::new("node")
        .arg(interop_dir().join("subscribe.mjs"))
        .args([target, "00", "300", "interop"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node is installed");
    let (lines_tx, lines) = mpsc::channel::<String>();
    let stdout = node.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });

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
    let status = node.wait().unwrap();
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    let summary: serde_json::Value = serde_json::from_str(summary.as_deref().unwrap()).unwrap();
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["commits"], 300, "{summary}");
    assert!(summary["reconnects"].as_u64().unwrap() >= 1, "the restart forced a reconnect: {summary}");
    assert!(status.success(), "{summary}");
}
