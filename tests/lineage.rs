//! A replica version is a promise to subscribers: Sluice reports it in
//! `/status`, records it in the change log (where view-syncers discover it)
//! and accepts subscriptions for it only once the lineage's first
//! transaction, the snapshot, is durable. Killed before that, a restart
//! takes a new snapshot under a new replica version, and nobody may have
//! been told about the old one.
//!
//! The test kills Sluice (the binary, SIGKILL) at random moments of a
//! Postgres snapshot, many times, on both change logs, and checks after
//! every kill that nothing advertised or recorded was abandoned.

#[macro_use]
mod common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::process::{free_addr, sluice, status, Rng};
use common::*;

/// Rows in the upstream table: enough for a snapshot that takes a while.
const ROWS: u64 = 20_000;
/// Kills per backend, then one run that must finish the job.
const KILLS: usize = 10;
const WAIT: Duration = Duration::from_secs(120);

on_both_backends!(kills_during_snapshots_never_abandon_an_advertised_replica_version);

/// When a run is killed.
#[derive(Debug, Clone, Copy)]
enum Moment {
    /// This long after the process started (it may not be listening yet).
    After(Duration),
    /// Once `/status` shows the snapshot past this many rows (or done).
    Rows(u64),
}

async fn upstream(name: &str) -> String {
    let server = pg_url();
    let (admin, conn) = tokio_postgres::connect(&server, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    for sql in [
        format!("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{name}'"),
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        admin.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let url = format!("{}/{name}", server.rsplit_once('/').unwrap().0);
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    db.batch_execute(&format!(
        "CREATE TABLE items (id bigint PRIMARY KEY, payload text);
         INSERT INTO items SELECT g, repeat(md5(g::text), 3) FROM generate_series(1, {ROWS}) g;"
    ))
    .await
    .unwrap();
    url
}

fn spawn(spec: &LogSpec, addr: &str, source_config: &str) -> Child {
    let mut cmd = sluice();
    cmd.args(["run", "--source", "postgres", "--listen", addr, "--source-config", source_config]);
    match &spec.pg {
        None => cmd.arg("--change-db").arg(format!("sqlite:{}", spec.sqlite.display())),
        Some(pg) => cmd.args(["--change-db", &common::pg_url(), "--app-id", &pg.app_id]),
    };
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// `/status` without blocking the runtime.
async fn status_of(addr: &str) -> Option<serde_json::Value> {
    let addr = addr.to_string();
    tokio::task::spawn_blocking(move || status(&addr)).await.unwrap()
}

async fn kills_during_snapshots_never_abandon_an_advertised_replica_version(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(backend, dir.path());
    let name = match backend {
        Backend::Sqlite => "lineage_sqlite",
        Backend::Postgres => "lineage_pg",
    };
    let url = upstream(name).await;
    let source_config = serde_json::json!({ "url": url, "slot": name, "snapshot_batch_rows": 500 }).to_string();
    let addr = free_addr();
    let mut rng = Rng::from_env("SLUICE_LINEAGE_SEED", &format!("lineage kills ({backend:?})"));

    // The replica version /status reported first; it may never change.
    let mut advertised: Option<String> = None;
    let mut kills_while_snapshotting = 0;
    for run in 0..KILLS {
        // The first kill always lands inside the snapshot (the target is
        // far from its end, and /status is polled every 5 ms); later ones
        // sometimes let a run finish it.
        let moment = if run == 0 {
            Moment::Rows(rng.range(0, ROWS / 4))
        } else if rng.range(0, 5) == 0 {
            Moment::After(Duration::from_millis(rng.range(0, 1500)))
        } else {
            Moment::Rows(rng.range(0, ROWS))
        };
        let mut child = spawn(&spec, &addr, &source_config);
        let started = Instant::now();
        let mut state = String::from("unreachable");
        loop {
            if let Some(v) = status_of(&addr).await {
                state = v["lineage"]["state"].as_str().unwrap_or("?").to_string();
                if let Some(rv) = v["replicaVersion"].as_str() {
                    assert_eq!(state, "established", "run {run}: {v}");
                    match &advertised {
                        Some(a) => assert_eq!(a, rv, "run {run}: {a} was advertised, then abandoned for {rv}"),
                        None => advertised = Some(rv.to_string()),
                    }
                }
                if let Moment::Rows(n) = moment {
                    if state == "established" || v["lineage"]["rows"].as_u64().is_some_and(|r| r >= n) {
                        break;
                    }
                }
            }
            if let Moment::After(d) = moment {
                if started.elapsed() >= d {
                    break;
                }
            }
            assert!(started.elapsed() < WAIT, "run {run}: no progress in {WAIT:?} (lineage {state})");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        println!("run {run}: killed at {moment:?} while {state}");
        kills_while_snapshotting += (state == "snapshotting") as usize;

        // What the log records is what a view-syncer would discover: it
        // must be a lineage whose snapshot is durable, and the advertised one.
        match spec.lineage().await {
            Some((rv, last)) => {
                assert!(last > rv, "run {run}: the log records replica version {rv} with no durable snapshot");
                if let Some(a) = &advertised {
                    assert_eq!(*a, rv, "run {run}: the log replaced the advertised lineage {a}");
                }
            }
            None => assert!(advertised.is_none(), "run {run}: the advertised lineage is gone from the log"),
        }
    }
    assert!(kills_while_snapshotting > 0, "no kill landed inside a snapshot: the test proved nothing");

    // Left alone, Sluice serves a lineage: the advertised one if there was
    // one, with every upstream row in its snapshot.
    let mut child = spawn(&spec, &addr, &source_config);
    let deadline = Instant::now() + WAIT;
    let served = loop {
        if let Some(rv) = status_of(&addr).await.and_then(|v| v["replicaVersion"].as_str().map(str::to_string)) {
            break Some(rv);
        }
        assert!(Instant::now() < deadline, "the final run serves no replica version");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let rv = served.unwrap();
    if let Some(a) = &advertised {
        assert_eq!(*a, rv, "the final run abandoned the advertised lineage");
    }
    let replica = common::replica::follow(&addr, &rv).await;
    wait_until("the snapshot's rows at a subscriber", WAIT, || {
        let rows = replica.lock().unwrap().tables.get("public.items").map_or(0, |t| t.len());
        async move { rows as u64 == ROWS }
    })
    .await;
    assert_eq!(replica.lock().unwrap().problems, Vec::<String>::new());
    child.kill().unwrap();
    child.wait().unwrap();
}
