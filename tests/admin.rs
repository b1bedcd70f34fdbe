//! The admin commands of the `sluice` binary against real parts: the change
//! log inspected and reset in both stores (a SQLite file and a Postgres
//! change DB), and the Postgres source's slot, publication, schema and event
//! trigger listed, dropped and uninstalled on a private PostgreSQL server.

#[macro_use]
mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::pgserver::PgServer;
use common::process::{free_addr, sluice, status};

const WAIT: Duration = Duration::from_secs(60);

/// A `sluice run` process, stopped with SIGTERM (and killed) on drop.
struct Running {
    child: Child,
    addr: String,
    log: std::path::PathBuf,
}

impl Running {
    fn start(args: &[String], dir: &std::path::Path) -> Running {
        let addr = free_addr();
        let log = dir.join(format!("sluice-{}.log", addr.replace([':', '.'], "_")));
        let child = sluice()
            .arg("run")
            .args(args)
            .args(["--listen", &addr, "--plugins"])
            .arg(common::plugin_dir())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Running { child, addr, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `/status` satisfies `check`.
    fn wait_status(&self, what: &str, check: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = status(&self.addr).filter(|s| check(s)) {
                return s;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the process to exit by itself.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "sluice does not exit; log:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, and wait for the exit (at once if it has exited).
    fn stop(mut self) {
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + WAIT;
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "sluice does not stop; log:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn admin(args: &[&str]) -> Output {
    sluice().args(args).output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)))
}

/// Inspect what a running Sluice wrote, refuse to reset it while it runs
/// (saying `refusal`), then reset it once stopped.
async fn inspect_and_reset(change_db: &[String], refusal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> =
        ["--source", "mock-source", "--source-config", r#"{"rate": 300, "rows_per_tx": 2, "tables": 2}"#]
            .map(String::from)
            .to_vec();
    args.extend(change_db.iter().cloned());
    let host = Running::start(&args, dir.path());
    host.wait_status("20 stored transactions", |s| s["transactions"].as_u64().is_some_and(|n| n >= 20));

    let mut inspect: Vec<&str> = vec!["log", "inspect", "--json"];
    inspect.extend(change_db.iter().map(String::as_str));
    let report = json(&admin(&inspect));
    let live = status(&host.addr).unwrap();
    assert_eq!(report["exists"], true);
    assert_eq!(report["replicaVersion"], live["replicaVersion"]);
    assert_eq!(report["owner"], "sluice");
    assert!(report["transactions"].as_u64().unwrap() >= 20, "{report}");
    assert!(report["sizeBytes"].as_u64().unwrap() > 0, "{report}");
    let tables = report["tables"].as_array().unwrap();
    let names: Vec<&str> = tables.iter().map(|t| t["table"].as_str().unwrap()).collect();
    assert_eq!(names, ["public.table0", "public.table1"], "{report}");
    let inserts: u64 = tables.iter().map(|t| t["inserts"].as_u64().unwrap()).sum();
    assert_eq!(inserts, report["changes"].as_u64().unwrap(), "the mock source only inserts: {report}");

    let mut reset: Vec<&str> = vec!["log", "reset", "--yes"];
    reset.extend(change_db.iter().map(String::as_str));
    let refused = admin(&reset);
    assert!(!refused.status.success());
    assert!(text(&refused).contains(refusal), "{}", text(&refused));
    assert!(json(&admin(&inspect))["exists"] == true, "nothing deleted while a writer runs");
    host.stop();

    let unconfirmed = admin(&reset[..2].iter().chain(&reset[3..]).copied().collect::<Vec<_>>());
    assert!(!unconfirmed.status.success());
    assert!(text(&unconfirmed).contains("Pass --yes"), "{}", text(&unconfirmed));
    assert!(json(&admin(&inspect))["exists"] == true, "nothing deleted without --yes");
    let done = admin(&reset);
    assert!(done.status.success(), "{}", text(&done));
    assert_eq!(json(&admin(&inspect))["exists"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_log_is_inspected_and_reset() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("log.db").display());
    inspect_and_reset(&["--change-db".into(), db.clone()], "is being written by another Sluice").await;
}

/// One writer per SQLite change log: of two `sluice run` on one file, the
/// second (started later, or at the same moment) exits non-zero with one
/// line naming the file and the holder, the first runs on with no error in
/// its log, `log reset` is refused even with `--force` while it runs, and
/// the log holds whole transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_log_has_one_writer() {
    let dir = tempfile::tempdir().unwrap();
    let spec = common::LogSpec::new(common::Backend::Sqlite, dir.path());
    let db = format!("sqlite:{}", spec.sqlite.display());
    let args: Vec<String> =
        ["--source", "mock-source", "--source-config", r#"{"rate": 300, "rows_per_tx": 2}"#, "--change-db", &db]
            .map(String::from)
            .to_vec();
    let first = Running::start(&args, dir.path());
    first.wait_status("10 stored transactions", |s| s["transactions"].as_u64().is_some_and(|n| n >= 10));
    let mut second = Running::start(&args, dir.path());
    let exit = second.wait_exit();
    assert!(!exit.success(), "the second writer exits non-zero");
    let line = second.log_text();
    assert!(line.contains("is being written by another Sluice"), "{line}");
    assert!(line.contains(&spec.sqlite.display().to_string()), "names the file: {line}");
    assert!(line.contains(&format!("pid {}", first.child.id())), "names the holder's pid: {line}");
    assert!(line.contains(&first.addr), "names the holder's address: {line}");
    let forced = admin(&["log", "reset", "--yes", "--force", "--change-db", &db]);
    assert!(
        !forced.status.success() && text(&forced).contains("is being written by another Sluice"),
        "{}",
        text(&forced)
    );
    first.wait_status("more stored transactions", |s| s["transactions"].as_u64().is_some_and(|n| n >= 40));
    let log = first.log_text();
    assert!(!log.contains("ERROR"), "the first writer logged an error:\n{log}");
    first.stop();
    spec.assert_whole().await;

    // Two at the same moment: exactly one runs.
    let mut pair = [Running::start(&args, dir.path()), Running::start(&args, dir.path())];
    let deadline = Instant::now() + WAIT;
    let loser = loop {
        if let Some(i) = (0..2).find(|&i| pair[i].child.try_wait().unwrap().is_some()) {
            break i;
        }
        assert!(Instant::now() < deadline, "neither exited:\n{}\n----\n{}", pair[0].log_text(), pair[1].log_text());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(pair[loser].log_text().contains("is being written by another Sluice"), "{}", pair[loser].log_text());
    let winner = &mut pair[1 - loser];
    let before = winner.wait_status("the winner serving", |s| s["lastWatermark"].is_string())["transactions"]
        .as_u64()
        .unwrap_or(0);
    winner.wait_status("the winner storing", |s| s["transactions"].as_u64().is_some_and(|n| n > before + 10));
    assert!(winner.child.try_wait().unwrap().is_none(), "the winner runs on");
    let [a, b] = pair;
    for host in [a, b] {
        host.stop();
    }
    spec.assert_whole().await;
    let done = admin(&["log", "reset", "--yes", "--change-db", &db]);
    assert!(done.status.success(), "reset once released: {}", text(&done));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_change_db_is_inspected_and_reset() {
    let app = format!("admin{}", std::process::id());
    inspect_and_reset(&["--change-db".into(), common::pg_url(), "--app-id".into(), app], "a Sluice answers at").await;
}

/// Status while streaming and after; a slot in use is not dropped; the
/// slot keeps WAL once nothing reads it; uninstall removes all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sources_upstream_objects_are_listed_and_removed() {
    let server = PgServer::start(&["wal_level=logical", "max_wal_senders=5", "max_replication_slots=5"]);
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client.batch_execute("CREATE TABLE items (id int PRIMARY KEY, note text)").await.unwrap();
    let config = serde_json::json!({"url": server.url(), "slot": "admin_slot"}).to_string();
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("log.db").display());
    let args: Vec<String> =
        ["--source", "postgres", "--source-config", &config, "--change-db", &db].map(String::from).to_vec();
    let host = Running::start(&args, dir.path());
    host.wait_status("the snapshot", |s| s["lineage"]["state"] == "established");
    // The host measures what the slot retains (a true condition once measured).
    host.wait_status("the retained WAL", |s| s["retainedWalBytes"].is_u64());
    // A transaction streamed now is measured from its upstream commit time.
    client.batch_execute("INSERT INTO items VALUES (0, 'lag')").await.unwrap();
    host.wait_status("the source lag of a streamed commit", |s| s["sourceLagMs"].is_number());
    let metrics = common::process::http_get(&host.addr, "/metrics").unwrap();
    assert!(metrics.contains("sluice_source_retained_wal_bytes "), "{metrics}");
    let lagged: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("sluice_source_lag_seconds_count "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(lagged >= 1.0, "the streamed commit is in the lag histogram: {metrics}");

    let pg_status = || json(&admin(&["postgres", "status", "--json", "--source-config", &config]));
    let up = pg_status();
    assert_eq!(up["slot"], "admin_slot");
    assert_eq!(up["slotState"]["active"], true, "{up}");
    assert_eq!(up["publications"], serde_json::json!([["_sluice_public_admin_slot", true]]));
    assert_eq!((up["sluiceSchema"].clone(), up["eventTrigger"].clone()), (true.into(), true.into()), "{up}");
    assert_eq!(up["recordedSlots"], serde_json::json!(["admin_slot"]));

    let in_use = admin(&["postgres", "drop-slot", "--source-config", &config]);
    assert!(!in_use.status.success());
    assert!(text(&in_use).contains("slot admin_slot is in use"), "{}", text(&in_use));
    host.stop();

    // Nothing reads the slot now: writes upstream pile up behind it.
    client
        .batch_execute("INSERT INTO items SELECT g, repeat('x', 500) FROM generate_series(1, 20000) g")
        .await
        .unwrap();
    let up = pg_status();
    assert_eq!(up["slotState"]["active"], false, "{up}");
    let retained = up["slotState"]["retainedWalBytes"].as_i64().unwrap();
    assert!(retained > 10_000_000, "the slot holds the WAL of 10 MB of rows: {retained}");
    let human = text(&admin(&["postgres", "status", "--source-config", &config]));
    assert!(human.contains("inactive: nothing streams from it") && human.contains("retained WAL"), "{human}");

    let unconfirmed = admin(&["postgres", "uninstall", "--source-config", &config]);
    assert!(!unconfirmed.status.success());
    let done = admin(&["postgres", "uninstall", "--yes", "--source-config", &config]);
    assert!(done.status.success(), "{}", text(&done));
    assert!(text(&done).contains("dropped replication slot admin_slot"), "{}", text(&done));
    let up = pg_status();
    assert_eq!(up["slotState"], serde_json::Value::Null, "{up}");
    assert_eq!(up["publications"], serde_json::json!([["_sluice_public_admin_slot", false]]));
    assert_eq!((up["sluiceSchema"].clone(), up["eventTrigger"].clone()), (false.into(), false.into()), "{up}");
}
