//! A real zero-cache 1.9.0 replicating from Sluice through Zero's custom
//! change-source protocol (`/changes/v0/stream`), and Zero's own client
//! (the `Zero` class, in Node with an in-memory store) reading through it.
//! Everything is real: PostgreSQL upstream, Sluice as a process (SIGKILLed
//! in the middle), zero-cache as a process, Zero's client over its sync
//! WebSocket. `make test` installs the npm package and starts PostgreSQL.

mod common;

use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::zero_cache::{
    bootstrap_replica, bootstrap_replica_via, bootstrap_replica_with_token, copy_kept_replica, fresh_database, psql,
    psql_value, replica_file, run_copy_kept_replica, run_zero_replica, start_on_sluice, start_view_syncer, KeptReplica,
    Streamer, ZeroCache, ZeroClient,
};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(90);

/// Zero permissions that let anyone read `tables`.
fn readable(tables: &[&str]) -> String {
    let rules: serde_json::Map<String, Value> = tables
        .iter()
        .map(|t| (t.to_string(), json!({"row": {"select": [["allow", {"type": "and", "conditions": []}]]}})))
        .collect();
    json!({ "tables": rules }).to_string()
}

/// Sluice as a process, with the compacted table state zero-cache's initial
/// sync is served from; its log goes to `dir/sluice.log`, its change log to
/// `dir/log.db` unless `extra` names another, and Zero's permissions come
/// from `dir/permissions.json` if it exists.
fn spawn_sluice(dir: &std::path::Path, addr: &str, source: &str, config: &str, extra: &[&str]) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("sluice.log")).unwrap();
    let mut command = common::process::sluice();
    command
        .args(["run", "--source", source, "--source-config", config, "--listen", addr, "--table-state"])
        .arg("--plugins")
        .arg(common::plugin_dir());
    if !extra.contains(&"--change-db") {
        command.arg("--change-db").arg(format!("sqlite:{}", dir.join("log.db").display()));
    }
    if dir.join("permissions.json").exists() {
        command.arg("--zero-permissions").arg(dir.join("permissions.json"));
    }
    command.args(extra).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap()
}

fn wait_for_lineage(dir: &std::path::Path, addr: &str) {
    let deadline = Instant::now() + WAIT;
    while common::process::status(addr).and_then(|s| s["replicaVersion"].as_str().map(str::to_string)).is_none() {
        assert!(
            Instant::now() < deadline,
            "Sluice at {addr} reports no replica version; its log:\n{}",
            std::fs::read_to_string(dir.join("sluice.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Postgres upstream -> Sluice (the built-in Postgres source) -> zero-cache
/// -> Zero's client. The client sees the snapshot's rows with Zero's value
/// types, then live inserts, updates and deletes, and a column added
/// upstream. Then Sluice is SIGKILLed and restarted three times while the
/// upstream keeps writing, and zero-cache's replica ends equal to the
/// upstream, row by row, as does what the client shows.
#[test]
fn zero_cache_and_its_client_follow_postgres_through_sluice() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    psql(&server, "SELECT pg_drop_replication_slot('zc_pg') FROM pg_replication_slots WHERE slot_name = 'zc_pg'");
    let up = fresh_database("zc_pg_upstream");
    psql(
        &up,
        "CREATE TABLE items (id int8 PRIMARY KEY, name text, amount numeric(12,2), at timestamptz, \
         doc json, ok bool, big int8)",
    );
    psql(
        &up,
        "INSERT INTO items VALUES \
         (1, 'one', 12345.67, '2024-01-02 03:04:05.678+00', '{\"a\": [1, 2]}', true, 9007199254740991), \
         (2, 'two', 0.10, '1999-12-31 23:59:59+00', '\"s\"', false, -9007199254740991), \
         (3, 'three', NULL, NULL, NULL, NULL, NULL)",
    );
    std::fs::write(dir.path().join("permissions.json"), readable(&["items"])).unwrap();
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_pg" }).to_string();
    let spawn = || spawn_sluice(dir.path(), &addr, "postgres", &config, &[]);
    let mut sluice = spawn();
    wait_for_lineage(dir.path(), &addr);

    let zc = start_on_sluice("zc_pg", &addr, dir.path());
    let columns = [
        ("id", "number"),
        ("name", "string"),
        ("amount", "number"),
        ("at", "number"),
        ("doc", "json"),
        ("ok", "boolean"),
        ("big", "number"),
    ];
    let mut client = ZeroClient::start(&zc, "items", &columns);
    // Zero's value types: numbers (timestamps as epoch milliseconds, the
    // largest safe integers exact), json as values, booleans.
    let snapshot = json!([
        {"id": 1, "name": "one", "amount": 12345.67, "at": 1704164645678i64, "doc": {"a": [1, 2]}, "ok": true,
         "big": 9007199254740991i64},
        {"id": 2, "name": "two", "amount": 0.1, "at": 946684799000i64, "doc": "s", "ok": false,
         "big": -9007199254740991i64},
        {"id": 3, "name": "three", "amount": null, "at": null, "doc": null, "ok": null, "big": null},
    ]);
    let rows = client.wait_rows("the snapshot's three rows", WAIT, |rows| rows.len() == 3);
    assert_eq!(Value::Array(rows), snapshot);

    // Live changes, in one transaction and then one by one.
    psql(&up, "BEGIN; INSERT INTO items (id, name, big) VALUES (4, 'four', 4); UPDATE items SET name = 'uno' WHERE id = 1; COMMIT");
    psql(&up, "DELETE FROM items WHERE id = 2");
    let rows = client.wait_rows("the insert, update and delete", WAIT, |rows| {
        let ids: Vec<i64> = rows.iter().filter_map(|r| r["id"].as_i64()).collect();
        ids == [1, 3, 4] && rows[0]["name"] == "uno"
    });
    assert_eq!(
        rows[2],
        json!({"id": 4, "name": "four", "amount": null, "at": null, "doc": null, "ok": null, "big": 4})
    );
    assert_eq!(rows[0]["amount"], json!(12345.67));

    // A column added upstream reaches zero-cache; a client that knows it
    // reads it.
    psql(&up, "ALTER TABLE items ADD COLUMN note text");
    psql(&up, "UPDATE items SET note = 'added' WHERE id = 4");
    let mut with_note = ZeroClient::start(&zc, "items", &[("id", "number"), ("note", "string")]);
    with_note.wait_rows("the added column", WAIT, |rows| {
        rows.len() == 3 && rows[2]["note"] == "added" && rows[0]["note"].is_null()
    });

    // Writes go on while Sluice is SIGKILLed and restarted three times.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (up, writing) = (up.clone(), writing.clone());
        std::thread::spawn(move || {
            let mut i = 100;
            while writing.load(Ordering::Relaxed) {
                psql(
                    &up,
                    &format!(
                        "BEGIN; INSERT INTO items (id, name, big, note) VALUES ({i}, 'n{i}', {i}, 'k'); \
                         UPDATE items SET note = 'u{i}' WHERE id = {}; DELETE FROM items WHERE id = {} AND id % 3 = 0; COMMIT",
                        i - 1,
                        i - 5
                    ),
                );
                i += 1;
            }
            i - 100
        })
    };
    let mut rng = common::process::Rng::from_env("SLUICE_ZERO_CACHE_SEED", "zero-cache kill moments");
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
        sluice.kill().unwrap();
        sluice.wait().unwrap();
        std::thread::sleep(Duration::from_millis(rng.range(0, 500)));
        sluice = spawn();
    }
    std::thread::sleep(Duration::from_millis(rng.range(300, 1000)));
    writing.store(false, Ordering::Relaxed);
    let written = writer.join().unwrap();
    assert!(written >= 20, "the writer committed only {written} transactions while Sluice was killed");

    // The upstream's rows, as zero-cache keeps them (integers as text).
    let upstream = || -> Vec<Value> {
        let text = psql_value(
            &up,
            "SELECT coalesce(json_agg(json_build_object('id', id::text, 'name', name, 'big', big::text, \
             'note', note) ORDER BY id), '[]') FROM items",
        );
        serde_json::from_str::<Value>(&text).unwrap().as_array().unwrap().clone()
    };
    let want = upstream();
    let deadline = Instant::now() + WAIT;
    loop {
        let replica: Vec<Value> = zc
            .replica_rows("items", "id")
            .into_iter()
            .map(|r| json!({"id": r["id"], "name": r["name"], "big": r["big"], "note": r["note"]}))
            .collect();
        if replica == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "zero-cache's replica differs from the upstream:\nreplica: {replica:?}\nupstream: {want:?}\nzero-cache log ends:\n{}",
            zc.log_text().chars().rev().take(3000).collect::<String>().chars().rev().collect::<String>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The client shows the same rows.
    let want_ids: Vec<i64> = want.iter().map(|r| r["id"].as_str().unwrap().parse().unwrap()).collect();
    let rows = with_note.wait_rows("the upstream's final rows", WAIT, |rows| {
        rows.iter().filter_map(|r| r["id"].as_i64()).collect::<Vec<_>>() == want_ids
    });
    for (got, want) in rows.iter().zip(&want) {
        assert_eq!(got["note"], want["note"], "{got} vs {want}");
    }
    drop(with_note);
    drop(client);
    drop(zc);
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, "SELECT pg_drop_replication_slot('zc_pg') FROM pg_replication_slots WHERE slot_name = 'zc_pg'");
}

/// Mock source (declaring its table in transaction 1) -> Sluice -> zero-cache
/// A. Once Sluice has purged its log past that declaration (A acks as it
/// goes), zero-cache B initial-syncs from Sluice's table state, and both
/// follow live to the end of the stream, each with its own position. Both
/// replicas end with exactly the source's rows, and B's client sees them.
#[test]
fn a_second_zero_cache_initial_syncs_after_the_log_was_purged() {
    const TRANSACTIONS: u64 = 500;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("permissions.json"), readable(&["table0"])).unwrap();
    let addr = common::process::free_addr();
    let config = json!({"transactions": TRANSACTIONS, "rows_per_tx": 2, "rate": 50, "schema": true}).to_string();
    let mut sluice = spawn_sluice(dir.path(), &addr, "mock-source", &config, &["--purge-interval-secs", "1"]);
    wait_for_lineage(dir.path(), &addr);
    let a = start_on_sluice("zc_mock_a", &addr, dir.path());

    // Transaction 1, which declared the table, is purged.
    let deadline = Instant::now() + WAIT;
    loop {
        let floor = common::process::status(&addr).and_then(|s| s["minWatermark"].as_str().map(str::to_string));
        if floor.as_deref().is_some_and(|f| f > common::lexi(1).as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "Sluice never purged transaction 1 (floor {floor:?})");
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = start_on_sluice("zc_mock_b", &addr, dir.path());
    let columns = [("id", "number"), ("big", "number"), ("payload", "string"), ("tx", "string")];
    let mut client = ZeroClient::start(&b, "table0", &columns);
    let rows_total = (TRANSACTIONS * 2) as usize;
    let shown = client.wait_rows("every row of the stream", WAIT, |rows| rows.len() == rows_total);

    // Each row is the source's: ids 0.., two per transaction.
    let check = |rows: &[Value], what: &str| {
        assert_eq!(rows.len(), rows_total, "{what}");
        for (i, row) in rows.iter().enumerate() {
            let tx = common::lexi(i as u64 / 2 + 1);
            assert_eq!(row["id"].to_string().trim_matches('"'), i.to_string(), "{what}: {row}");
            assert_eq!(row["tx"], tx.as_str(), "{what}: {row}");
            assert_eq!(
                row["big"].to_string().trim_matches('"'),
                ((1u64 << 52) + i as u64).to_string(),
                "{what}: {row}"
            );
        }
    };
    check(&shown, "B's client");
    let deadline = Instant::now() + WAIT;
    let (ra, rb) = loop {
        let (ra, rb) = (a.replica_rows("table0", "id"), b.replica_rows("table0", "id"));
        if ra.len() == rows_total && rb.len() == rows_total {
            break (ra, rb);
        }
        assert!(Instant::now() < deadline, "replicas hold {} and {} of {rows_total} rows", ra.len(), rb.len());
        std::thread::sleep(Duration::from_millis(200));
    };
    check(&ra, "A's replica");
    assert_eq!(ra, rb, "the two replicas differ");
    for (row, seen) in rb.iter().zip(&shown) {
        assert_eq!(row["payload"], seen["payload"]);
    }
    drop(client);
    drop((a, b));
    sluice.kill().unwrap();
    sluice.wait().unwrap();
}

/// Sluice's change log is lost and rebuilt (a new lineage, from a new
/// snapshot of the upstream) while a zero-cache that synced from the old
/// one is away. When it comes back with its old replica version, Sluice
/// tells it `reset-required`; zero-cache shuts down for its auto-reset,
/// and on restart syncs again from the new lineage, including what the
/// upstream wrote in between, then follows live.
#[test]
fn a_zero_cache_from_another_lineage_is_reset_and_syncs_again() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot =
        "SELECT pg_drop_replication_slot('zc_lineage') FROM pg_replication_slots WHERE slot_name = 'zc_lineage'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_lineage_upstream");
    psql(&up, "CREATE TABLE items (id int8 PRIMARY KEY, name text); INSERT INTO items VALUES (1, 'a'), (2, 'b')");
    std::fs::write(dir.path().join("permissions.json"), readable(&["items"])).unwrap();
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_lineage" }).to_string();
    let spawn = |log: &str| {
        let change_db = format!("sqlite:{}", dir.path().join(log).display());
        spawn_sluice(dir.path(), &addr, "postgres", &config, &["--change-db", &change_db])
    };
    let mut sluice = spawn("first.db");
    wait_for_lineage(dir.path(), &addr);
    let first_lineage = common::process::status(&addr).unwrap()["replicaVersion"].as_str().unwrap().to_string();
    let mut zc = start_on_sluice("zc_lineage", &addr, dir.path());
    let replica_version = |zc: &ZeroCache| {
        zc.replica_rows("_zero.replicationConfig", "replicaVersion")[0]["replicaVersion"].as_str().unwrap().to_string()
    };
    let synced_at = replica_version(&zc);
    assert!(synced_at >= first_lineage, "zero-cache's replica version {synced_at} is of Sluice's lineage");
    let names = |zc: &ZeroCache| -> Vec<(String, Value)> {
        zc.replica_rows("items", "id")
            .iter()
            .map(|r| (r["id"].as_str().unwrap_or("?").to_string(), r["name"].clone()))
            .collect()
    };
    assert_eq!(names(&zc), [("1".into(), json!("a")), ("2".into(), json!("b"))]);

    // The change log is lost; the upstream goes on; a new Sluice builds a
    // new lineage from a new slot.
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
    psql(&up, "INSERT INTO items VALUES (3, 'c'); UPDATE items SET name = 'A' WHERE id = 1");
    let mut sluice = spawn("second.db");
    wait_for_lineage(dir.path(), &addr);
    let second_lineage = common::process::status(&addr).unwrap()["replicaVersion"].as_str().unwrap().to_string();
    assert!(second_lineage > synced_at, "the new lineage {second_lineage} starts after {synced_at}");

    // zero-cache reconnects on its own, is told to reset, and shuts down.
    zc.wait_for_log("shutting down for auto-reset", WAIT);
    zc.wait_exit(WAIT);
    let log = std::fs::read_to_string(dir.path().join("sluice.log")).unwrap();
    assert!(
        log.contains(&format!("replica version {synced_at} predates the change log's lineage {second_lineage}")),
        "{log}"
    );
    // Restarted (as its orchestrator would), it syncs the new lineage.
    zc.restart();
    let resynced_at = replica_version(&zc);
    assert!(resynced_at >= second_lineage, "zero-cache's replica version {resynced_at} is of the new lineage");
    assert_eq!(names(&zc), [("1".into(), json!("A")), ("2".into(), json!("b")), ("3".into(), json!("c"))]);
    psql(&up, "DELETE FROM items WHERE id = 2");
    let deadline = Instant::now() + WAIT;
    while names(&zc).len() != 2 {
        assert!(Instant::now() < deadline, "the live delete never reached zero-cache: {:?}", names(&zc));
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(zc);
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// Two zero-cache view-syncers with Sluice as their change-streamer, one
/// through `ZERO_CHANGE_STREAMER_URI`, one discovering Sluice through the
/// address it records in its Postgres change DB. Both start on an empty
/// disk after Sluice purged its snapshot: `tools/zero-replica.mjs` writes
/// each replica from Sluice's table state, with Sluice's replica version.
/// Each then subscribes to `/replication/v6/changes` from there and serves
/// a Zero client the upstream's rows (also those written between the
/// bootstrap and its start) and live changes. A CRUD insert through one
/// round-trips through the upstream and Sluice to the other. Sluice is
/// SIGKILLed twice while the upstream writes, and both replicas end equal
/// to the upstream, row by row.
#[test]
fn view_syncers_bootstrapped_after_a_purge_serve_clients() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot = "SELECT pg_drop_replication_slot('zc_vs') FROM pg_replication_slots WHERE slot_name = 'zc_vs'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_vs_upstream");
    let change_db = fresh_database("zc_vs_sluice_change");
    psql(&up, "CREATE TABLE items (id int8 PRIMARY KEY, name text); INSERT INTO items VALUES (1, 'a'), (2, 'b')");
    let addr = common::process::free_addr();
    // Zero's tables are created in the upstream and replicated; the
    // permissions let anyone read and insert items.
    let config = json!({ "url": up, "slot": "zc_vs", "zero": {"app_id": "zero", "shard_num": 0} }).to_string();
    let extra = ["--purge-interval-secs", "1", "--change-db", &change_db];
    let spawn = || spawn_sluice(dir.path(), &addr, "postgres", &config, &extra);
    let mut sluice = spawn();
    wait_for_lineage(dir.path(), &addr);
    let allow = json!([["allow", {"type": "and", "conditions": []}]]);
    let rules = json!({"tables": {"items": {"row": {"select": allow, "insert": allow}}}});
    psql(&up, &format!("UPDATE zero.permissions SET permissions = '{rules}'"));
    let status = || common::process::status(&addr).unwrap();
    let replica_version = status()["replicaVersion"].as_str().unwrap().to_string();
    let recorded = psql_value(&change_db, r#"SELECT "ownerAddress" FROM "zero_0/cdc"."replicationState""#);
    assert_eq!(recorded, addr, "the address recorded for discovery");

    // The snapshot's transaction (at the replica version, or a watermark
    // derived from it) is purged once later ones are stored.
    let deadline = Instant::now() + WAIT;
    let mut n = 3;
    while status()["minWatermark"].as_str().is_none_or(|floor| floor.starts_with(replica_version.as_str())) {
        assert!(Instant::now() < deadline, "Sluice never purged its snapshot: {}", status());
        psql(&up, &format!("INSERT INTO items VALUES ({n}, 'n{n}')"));
        n += 1;
        std::thread::sleep(Duration::from_millis(300));
    }
    let mut view_syncers = Vec::new();
    for (name, streamer) in
        [("zc_vs_a", Streamer::Uri(addr.clone())), ("zc_vs_b", Streamer::Discover { change_db: change_db.clone() })]
    {
        let written = bootstrap_replica(&addr, &replica_file(name, dir.path()));
        assert_eq!(written["replicaVersion"], replica_version.as_str(), "{written}");
        assert!(written["watermark"].as_str().unwrap() > replica_version.as_str(), "{written}");
        psql(&up, &format!("INSERT INTO items VALUES ({n}, 'between the bootstrap and the start')"));
        n += 1;
        view_syncers.push(start_view_syncer(name, streamer, &up, dir.path()));
    }
    let mut clients: Vec<ZeroClient> =
        view_syncers.iter().map(|vs| ZeroClient::start(vs, "items", &[("id", "number"), ("name", "string")])).collect();
    let count = n - 1;
    for client in &mut clients {
        client.wait_rows("the upstream's rows", WAIT, |rows| rows.len() as i64 == count);
    }
    psql(&up, "BEGIN; INSERT INTO items VALUES (1000, 'live'); UPDATE items SET name = 'A' WHERE id = 1; DELETE FROM items WHERE id = 2; COMMIT");
    for client in &mut clients {
        let rows = client.wait_rows("the live insert, update and delete", WAIT, |rows| {
            rows.len() as i64 == count && rows[0]["name"] == "A" && rows.last().is_some_and(|r| r["id"] == 1000)
        });
        assert_eq!(rows[1]["id"], 3, "row 2 is deleted");
    }

    // A CRUD insert through view-syncer A: zero-cache writes it to the
    // upstream with the client's last mutation ID, both come back through
    // Sluice (the ID confirms the mutation), and B's client shows the row.
    let columns = [("id", "number"), ("name", "string")];
    let row = json!({"id": 2000, "name": "from a client"});
    let _writer = ZeroClient::start_inserting(&view_syncers[0], "items", &columns, &row);
    clients[1].wait_rows("the row a client of A inserted", WAIT, |rows| {
        rows.last().is_some_and(|r| r["id"] == 2000 && r["name"] == "from a client")
    });
    assert_eq!(psql_value(&up, "SELECT name FROM items WHERE id = 2000"), "from a client");
    let confirmed = psql_value(&up, r#"SELECT "lastMutationID" FROM zero_0.clients"#);
    assert_eq!(confirmed, "1", "the upstream's last mutation ID");
    let deadline = Instant::now() + WAIT;
    while view_syncers[0].replica_rows("zero_0.clients", "clientID").first().map(|r| r["lastMutationID"].clone())
        != Some(json!("1"))
    {
        assert!(Instant::now() < deadline, "the last mutation ID never came back to A through Sluice");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(_writer);

    let discovered = format!("connecting to change-streamer@ws://{addr}/");
    assert!(view_syncers[1].log_text().contains(&discovered), "zc_vs_b did not discover {addr}");

    // Writes go on while Sluice is SIGKILLed and restarted twice; the
    // view-syncers reconnect on their own.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (up, writing) = (up.clone(), writing.clone());
        std::thread::spawn(move || {
            let mut i = 3000;
            while writing.load(Ordering::Relaxed) {
                psql(
                    &up,
                    &format!("BEGIN; INSERT INTO items VALUES ({i}, 'w'); UPDATE items SET name = 'u{i}' WHERE id = 3; COMMIT"),
                );
                i += 1;
            }
        })
    };
    let mut rng = common::process::Rng::from_env("SLUICE_ZERO_CACHE_SEED", "view-syncer kill moments");
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
        sluice.kill().unwrap();
        sluice.wait().unwrap();
        sluice = spawn();
    }
    std::thread::sleep(Duration::from_millis(rng.range(300, 1000)));
    writing.store(false, Ordering::Relaxed);
    writer.join().unwrap();

    // Each view-syncer's replica equals the upstream, row by row.
    let upstream = upstream_items(&up);
    for vs in &view_syncers {
        let deadline = Instant::now() + WAIT;
        loop {
            let replica = Value::Array(vs.replica_rows("items", "id"));
            if replica == upstream {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}'s replica {replica} differs from the upstream {upstream}",
                vs.name()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    drop(clients);
    drop(view_syncers);
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// MariaDB (the mariadb-source plugin) -> Sluice -> zero-cache -> Zero's
/// client: MariaDB's types arrive as Zero's value types, and a column
/// added upstream reaches the client.
#[test]
fn zero_cache_and_its_client_follow_mariadb_through_sluice() {
    let m = common::mariadb::shared();
    let db = "zc_maria";
    m.database(db);
    m.sql(&format!(
        "CREATE TABLE {db}.items (id bigint unsigned PRIMARY KEY, name varchar(20), price decimal(10,2), \
         at datetime(3), ts timestamp(3) NULL, kind enum('a','b'), tags set('x','y'), flags bit(4), \
         data blob, doc json); \
         SET time_zone = '+00:00'; \
         INSERT INTO {db}.items VALUES (9007199254740991, 'one', 12345678.91, '2024-01-02 03:04:05.678', \
         '2024-01-02 03:04:05.678', 'b', 'x,y', b'1010', x'0102', '{{\"k\": 1}}'), \
         (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
    ));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("permissions.json"), readable(&[&format!("{db}.items")])).unwrap();
    let addr = common::process::free_addr();
    let config = m.config(&[db]).to_string();
    let mut sluice = spawn_sluice(dir.path(), &addr, "mariadb-source", &config, &[]);
    wait_for_lineage(dir.path(), &addr);
    let zc = start_on_sluice("zc_maria", &addr, dir.path());
    let columns = [
        ("id", "number"),
        ("name", "string"),
        ("price", "number"),
        ("at", "number"),
        ("ts", "number"),
        ("kind", "string"),
        ("tags", "string"),
        ("flags", "number"),
        ("doc", "string"),
    ];
    let table = format!("{db}.items");
    let mut client = ZeroClient::start(&zc, &table, &columns);
    let rows = client.wait_rows("the snapshot's rows", WAIT, |rows| rows.len() == 2);
    assert_eq!(
        rows[1],
        json!({"id": 9007199254740991u64, "name": "one", "price": 12345678.91, "at": 1704164645678i64,
               "ts": 1704164645678i64, "kind": "b", "tags": "x,y", "flags": 10, "doc": "{\"k\": 1}"})
    );
    assert_eq!(rows[0]["id"], 2);
    assert!(rows[0]["name"].is_null() && rows[0]["price"].is_null());

    // Live, and a column added upstream.
    m.sql(&format!("UPDATE {db}.items SET name = 'two' WHERE id = 2; INSERT INTO {db}.items (id) VALUES (3)"));
    client.wait_rows("the update and the insert", WAIT, |rows| rows.len() == 3 && rows[0]["name"] == "two");
    m.sql(&format!("ALTER TABLE {db}.items ADD COLUMN note varchar(10)"));
    m.sql(&format!("UPDATE {db}.items SET note = 'added' WHERE id = 3"));
    let mut with_note = ZeroClient::start(&zc, &table, &[("id", "number"), ("note", "string")]);
    with_note.wait_rows("the added column", WAIT, |rows| rows.len() == 3 && rows[1]["note"] == "added");
    drop((client, with_note, zc));
    sluice.kill().unwrap();
    sluice.wait().unwrap();
}

/// The secured set-up of docs/view-syncers.md end to end: Sluice with
/// `--token-file`; `tools/zero-replica.mjs` refuses with a clear line
/// without the token and with a wrong one, and bootstraps the replica with
/// it from `SLUICE_TOKEN`; a zero-cache view-syncer given the token in
/// `ZERO_CHANGE_STREAMER_URI` serves a Zero client the rows and a live
/// change.
#[test]
fn a_view_syncer_bootstraps_from_and_follows_a_sluice_with_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot = "SELECT pg_drop_replication_slot('zc_tok') FROM pg_replication_slots WHERE slot_name = 'zc_tok'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_tok_upstream");
    psql(&up, "CREATE TABLE items (id int8 PRIMARY KEY, name text); INSERT INTO items VALUES (1, 'a'), (2, 'b')");
    let token = "view-syncer-token-0815";
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_tok", "zero": {"app_id": "zero", "shard_num": 0} }).to_string();
    let token_arg = token_file.display().to_string();
    let mut sluice = spawn_sluice(dir.path(), &addr, "postgres", &config, &["--token-file", &token_arg]);
    let deadline = Instant::now() + WAIT;
    let replica_version = loop {
        let status = common::process::status_with(&addr, token);
        if let Some(v) = status.and_then(|s| s["replicaVersion"].as_str().map(str::to_string)) {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "no lineage:\n{}",
            std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let allow = json!([["allow", {"type": "and", "conditions": []}]]);
    let rules = json!({"tables": {"items": {"row": {"select": allow}}}});
    psql(&up, &format!("UPDATE zero.permissions SET permissions = '{rules}'"));

    let file = replica_file("zc_tok", dir.path());
    for (given, says) in [(None, "requires a token (401)"), (Some("not-the-token"), "refused the token (401)")] {
        let out = run_zero_replica(&addr, &file, given);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{given:?}: {stderr}");
        assert!(!file.exists(), "no replica file is written without the token");
    }
    let written = bootstrap_replica_with_token(&addr, &file, Some(token));
    assert_eq!(written["replicaVersion"], replica_version.as_str(), "{written}");
    psql(&up, "INSERT INTO items VALUES (3, 'between the bootstrap and the start')");
    let view_syncer = start_view_syncer("zc_tok", Streamer::Uri(format!("sluice:{token}@{addr}")), &up, dir.path());
    let mut client = ZeroClient::start(&view_syncer, "items", &[("id", "number"), ("name", "string")]);
    client.wait_rows("the upstream's rows", WAIT, |rows| rows.len() == 3);
    psql(&up, "INSERT INTO items VALUES (4, 'live')");
    client.wait_rows("a live insert", WAIT, |rows| rows.last().is_some_and(|r| r["id"] == 4 && r["name"] == "live"));
    drop(client);
    drop(view_syncer);
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// `tools/zero-replica.mjs` has two routes: zero-cache's own custom-source
/// initial sync, and the bulk route (its default) that parses, checks and
/// inserts rows its own way around zero-cache's code. Both write a replica
/// from the same Sluice table state here, over a table of most column types
/// (values beyond 2^53, JSON, arrays, bytes, nulls, text that looks like the
/// row's own JSON), a composite key, an empty table and 3,000 plain rows;
/// the two files hold the same schema and the same rows, value for value
/// and type for type, in every table, zero-cache's bookkeeping and SQLite's
/// statistics included. Only the clock readings differ.
#[test]
fn the_bulk_route_writes_the_replica_zero_caches_own_initial_sync_writes() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot = "SELECT pg_drop_replication_slot('zc_bulk') FROM pg_replication_slots WHERE slot_name = 'zc_bulk'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_bulk_upstream");
    psql(
        &up,
        r#"CREATE TABLE kinds (id int8 PRIMARY KEY, big int8, small int2, amount numeric, doc jsonb, plain json,
             raw bytea, at timestamptz, day date, flag bool, tags text[], nums int8[], ratio float8, r4 float4,
             note varchar(40), txt text, u uuid);
           INSERT INTO kinds VALUES
             (1, 9007199254740993, -32768, 12345678901234567890.125, '{"a": [1, 2.5, null, "x"], "n": 12345678901234567890}',
              '{"k": "v", "new": 1}', '\xdeadbeef', '2026-12-07 10:00:00.123456+00', '2026-12-07', true,
              '{a,"b c","new"}', '{1,9007199254740993}', -0.000001, 1.5, 'he said "hi", "new":1', 'Grüße 🎉 12345678901234567',
              'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'),
             (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
             (3, -9223372036854775808, 0, 0, 'null', '[]', '\x', '1970-01-01 00:00:00+00', '1970-01-01', false,
              '{}', '{}', 1e300, 0, '', '}]', '00000000-0000-0000-0000-000000000000');
           CREATE TABLE pairs (a int4, b text, v text, PRIMARY KEY (a, b));
           INSERT INTO pairs VALUES (1, 'x', 'one x'), (1, 'y', NULL), (2, 'x', 'two x');
           CREATE TABLE empty (id int4 PRIMARY KEY, v text);
           CREATE TABLE items (id int8 PRIMARY KEY, name text NOT NULL, t float8 NOT NULL);
           INSERT INTO items SELECT g, 'item number ' || g, g / 7.0 FROM generate_series(1, 3000) g"#,
    );
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_bulk", "zero": {"app_id": "zero", "shard_num": 0} }).to_string();
    let mut sluice = spawn_sluice(dir.path(), &addr, "postgres", &config, &[]);
    wait_for_lineage(dir.path(), &addr);

    let (by_zero, bulk) = (dir.path().join("initial-sync.db"), dir.path().join("bulk.db"));
    let written_by_zero = bootstrap_replica_via(&addr, &by_zero, "initial-sync");
    let written_in_bulk = bootstrap_replica_via(&addr, &bulk, "bulk");
    assert_eq!(written_in_bulk, written_by_zero, "the replica versions and watermarks the two routes recorded");
    let (expected, got) = (replica_dump(&by_zero), replica_dump(&bulk));

    // The comparison is not between two empty files: zero-cache's route
    // holds every row, with values exact.
    let rows = |table: &str| expected.get(table).map_or(0, Vec::len);
    assert_eq!((rows("kinds"), rows("pairs"), rows("empty"), rows("items")), (3, 3, 0, 3000));
    let first_kind = &expected["kinds"][0];
    assert_eq!(first_kind[1], rusqlite::types::Value::Integer(9007199254740993), "{first_kind:?}");
    assert!(rows("zero.permissions") == 1 && rows("_zero.column_metadata") > 20, "{:?}", expected.keys());

    assert_eq!(got.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "the tables");
    for (name, rows) in &expected {
        let bulk_rows = &got[name];
        if let Some(i) = (0..rows.len().max(bulk_rows.len())).find(|&i| rows.get(i) != bulk_rows.get(i)) {
            panic!(
                "table {name}, row {i} of {} (bulk route {}): zero-cache's route wrote {:?}, the bulk route {:?}",
                rows.len(),
                bulk_rows.len(),
                rows.get(i),
                bulk_rows.get(i)
            );
        }
    }
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// A view-syncer started from a copy of a kept replica. The keeper
/// (`tools/zero-replica.mjs --keep`, zero-cache's own replicator) follows
/// Sluice while the upstream writes and Sluice purges every second; the
/// copy (`--from`) is taken once the snapshot is long purged. Sluice holds
/// the copy's position although the keeper acks past it and purges go on;
/// a view-syncer started on the copy, after more writes, serves every row
/// and follows live; the copy, the kept file and the view-syncer's replica
/// each equal the upstream at their point.
#[test]
fn a_view_syncer_starts_from_a_copy_of_a_kept_replica() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot = "SELECT pg_drop_replication_slot('zc_kept') FROM pg_replication_slots WHERE slot_name = 'zc_kept'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_kept_upstream");
    psql(&up, "CREATE TABLE items (id int8 PRIMARY KEY, name text); INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 500) g");
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_kept", "zero": {"app_id": "zero", "shard_num": 0} }).to_string();
    // Consumer positions are held 30 s rather than 600: the keeper's own
    // initial sync reserves one, which must be gone before the copy, so
    // that only the copy's reservation can hold the copy's position.
    let extra = ["--purge-interval-secs", "1", "--consumer-retention-secs", "30"];
    let mut sluice = spawn_sluice(dir.path(), &addr, "postgres", &config, &extra);
    wait_for_lineage(dir.path(), &addr);
    let allow = json!([["allow", {"type": "and", "conditions": []}]]);
    psql(
        &up,
        &format!(
            "UPDATE zero.permissions SET permissions = '{}'",
            json!({"tables": {"items": {"row": {"select": allow}}}})
        ),
    );
    let status = || common::process::status(&addr).unwrap();
    let replica_version = status()["replicaVersion"].as_str().unwrap().to_string();
    let mut n = 501;
    let mut write = |what: &str| {
        psql(&up, &format!("INSERT INTO items VALUES ({n}, '{what} {n}')"));
        n += 1;
    };

    // The keeper follows while the upstream writes, until Sluice has
    // purged its snapshot, the reservation of the keeper's initial sync has
    // expired, and the kept file holds every write.
    let keeper = KeptReplica::start(&addr, &dir.path().join("kept.db"));
    let deadline = Instant::now() + WAIT;
    loop {
        let s = status();
        let purged = s["minWatermark"].as_str().is_some_and(|floor| !floor.starts_with(replica_version.as_str()));
        let kept = keeper.watermark();
        let reservations = s["reservations"].as_array().unwrap();
        // None at or below the kept position: the copy's own will be the
        // only one that can hold it.
        let unreserved = reservations.iter().all(|r| r["watermark"].as_str() > Some(kept.as_str()));
        if purged && unreserved && s["lastWatermark"].as_str().is_some_and(|last| kept.as_str() >= last) {
            break;
        }
        assert!(Instant::now() < deadline, "the keeper never caught up past a purge: {s}\n{}", keeper.log_text());
        write("before the copy");
        std::thread::sleep(Duration::from_millis(200));
    }

    let kept_at = keeper.watermark();
    let copy = replica_file("zc_kept_vs", dir.path());
    let copied = copy_kept_replica(&addr, keeper.file(), &copy);
    assert_eq!(copied["replicaVersion"], replica_version.as_str(), "{copied}");
    let copy_at = copied["watermark"].as_str().unwrap().to_string();
    assert!(copy_at >= kept_at, "the copy at {copy_at} predates the kept file's {kept_at}");
    let in_copy = Value::Array(common::zero_cache::replica_rows(&copy, "items", "id"));
    assert_eq!(in_copy, upstream_items(&up), "the copy's rows");

    // The keeper moves past the copy and acks; Sluice's purges go on, and
    // still keep the copy's position.
    let deadline = Instant::now() + WAIT;
    let passes_then = loop {
        write("after the copy");
        let s = status();
        let keeper_acked = s["subscriberPositions"].as_array().into_iter().flatten().any(|v| {
            v["taskId"] == "sluice-replica-keeper" && v["acked"].as_str().is_some_and(|a| a > copy_at.as_str())
        });
        if keeper_acked {
            break s["purge"]["passes"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "the keeper never acked past the copy: {s}\n{}", keeper.log_text());
        std::thread::sleep(Duration::from_millis(200));
    };
    let deadline = Instant::now() + WAIT;
    while status()["purge"]["passes"].as_u64().unwrap() < passes_then + 2 {
        assert!(Instant::now() < deadline, "Sluice stopped purging: {}", status());
        std::thread::sleep(Duration::from_millis(100));
    }
    let s = status();
    assert!(
        s["minWatermark"].as_str().is_some_and(|min| min <= copy_at.as_str()),
        "Sluice purged the copy's position {copy_at}: {s}"
    );

    let vs = start_view_syncer("zc_kept_vs", Streamer::Uri(addr.clone()), &up, dir.path());
    let mut client = ZeroClient::start(&vs, "items", &[("id", "number"), ("name", "string")]);
    let count = (n - 1) as usize;
    client.wait_rows("the upstream's rows", WAIT, |rows| rows.len() == count);
    psql(&up, "BEGIN; INSERT INTO items VALUES (100000, 'live'); UPDATE items SET name = 'first' WHERE id = 1; COMMIT");
    client.wait_rows("the live insert and update", WAIT, |rows| {
        rows.len() == count + 1 && rows[0]["name"] == "first" && rows.last().is_some_and(|r| r["id"] == 100000)
    });
    assert!(!vs.log_text().contains("WatermarkTooOld"), "the view-syncer was told its watermark is too old");

    // Writes go on while Sluice is SIGKILLed and restarted, then the keeper
    // is SIGKILLed and started again on its file: it takes it up from the
    // watermark it holds.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (up, writing) = (up.clone(), writing.clone());
        std::thread::spawn(move || {
            let mut i = 200_000;
            while writing.load(Ordering::Relaxed) {
                psql(&up, &format!("BEGIN; INSERT INTO items VALUES ({i}, 'w'); UPDATE items SET name = 'u{i}' WHERE id = 2; COMMIT"));
                i += 1;
            }
        })
    };
    let mut rng = common::process::Rng::from_env("SLUICE_ZERO_CACHE_SEED", "kept replica kill moments");
    std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    sluice = spawn_sluice(dir.path(), &addr, "postgres", &config, &extra);
    std::thread::sleep(Duration::from_millis(rng.range(300, 1500)));
    let kept_file = keeper.file().to_path_buf();
    keeper.kill();
    let keeper = KeptReplica::start(&addr, &kept_file);
    std::thread::sleep(Duration::from_millis(rng.range(300, 1000)));
    writing.store(false, Ordering::Relaxed);
    writer.join().unwrap();

    // The kept file and the view-syncer's replica end equal to the upstream.
    let upstream = upstream_items(&up);
    let deadline = Instant::now() + WAIT;
    for (what, file) in
        [("the kept file", keeper.file().to_path_buf()), ("the view-syncer's replica", vs.replica().to_path_buf())]
    {
        while Value::Array(common::zero_cache::replica_rows(&file, "items", "id")) != upstream {
            assert!(Instant::now() < deadline, "{what} never equalled the upstream");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    drop(client);
    drop(vs);
    let stopped = keeper.stop();
    assert!(stopped.success(), "the keeper did not stop cleanly on SIGTERM: {stopped}");
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// A keeper that was away while Sluice purged past its file: a copy of
/// the stale file is refused with one line saying why, and the keeper,
/// started again, rebuilds the file from the table state and follows on.
#[test]
fn a_keeper_back_after_its_position_was_purged_rebuilds_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::pg_url();
    let drop_slot = "SELECT pg_drop_replication_slot('zc_away') FROM pg_replication_slots WHERE slot_name = 'zc_away'";
    psql(&server, drop_slot);
    let up = fresh_database("zc_away_upstream");
    psql(&up, "CREATE TABLE items (id int8 PRIMARY KEY, name text); INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 100) g");
    let addr = common::process::free_addr();
    let config = json!({ "url": up, "slot": "zc_away", "zero": {"app_id": "zero", "shard_num": 0} }).to_string();
    // Positions are held one second after their holders leave.
    let extra = ["--purge-interval-secs", "1", "--consumer-retention-secs", "1", "--subscriber-retention-secs", "1"];
    let mut sluice = spawn_sluice(dir.path(), &addr, "postgres", &config, &extra);
    wait_for_lineage(dir.path(), &addr);
    let status = || common::process::status(&addr).unwrap();
    let mut n = 101;
    let mut write = || {
        psql(&up, &format!("INSERT INTO items VALUES ({n}, 'n{n}')"));
        n += 1;
    };
    let kept_file = dir.path().join("kept.db");
    let keeper = KeptReplica::start(&addr, &kept_file);
    write();
    let deadline = Instant::now() + WAIT;
    while status()["lastWatermark"].as_str().is_none_or(|last| keeper.watermark().as_str() < last) {
        assert!(Instant::now() < deadline, "the keeper never caught up: {}\n{}", status(), keeper.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let away_at = keeper.watermark();
    keeper.kill();

    // Away: writes go on and Sluice purges past the kept file's position.
    let deadline = Instant::now() + WAIT;
    while status()["minWatermark"].as_str().is_none_or(|min| min <= away_at.as_str()) {
        assert!(Instant::now() < deadline, "Sluice never purged past {away_at}: {}", status());
        write();
        std::thread::sleep(Duration::from_millis(200));
    }
    let copy = dir.path().join("copy.db");
    let refused = run_copy_kept_replica(&addr, &kept_file, &copy);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("no longer holds"), "the copy of a stale file: {said}");
    assert!(!copy.exists(), "the refused copy left its file");

    // Back: the keeper rebuilds the file and follows on.
    let keeper = KeptReplica::start(&addr, &kept_file);
    write();
    let deadline = Instant::now() + WAIT;
    while Value::Array(common::zero_cache::replica_rows(&kept_file, "items", "id")) != upstream_items(&up) {
        assert!(Instant::now() < deadline, "the kept file never equalled the upstream:\n{}", keeper.log_text());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(keeper.log_text().contains("rebuilding it from Sluice's table state"), "{}", keeper.log_text());
    assert!(keeper.watermark() > away_at);
    let copied = copy_kept_replica(&addr, &kept_file, &copy);
    assert!(copied["watermark"].as_str().unwrap() > away_at.as_str(), "{copied}");
    let stopped = keeper.stop();
    assert!(stopped.success(), "the keeper did not stop cleanly on SIGTERM: {stopped}");
    sluice.kill().unwrap();
    sluice.wait().unwrap();
    psql(&server, drop_slot);
}

/// The upstream's `items (id int8, name text)` as replica rows show them
/// (ids as strings, in id order).
fn upstream_items(up: &str) -> Value {
    let rows =
        psql_value(up, "SELECT json_agg(json_build_object('id', id::text, 'name', name) ORDER BY id) FROM items");
    serde_json::from_str(&rows).unwrap()
}

/// Every table of a replica file, `sqlite_master` included, as its rows in
/// rowid order with SQLite's own types; the clock readings zero-cache
/// records (when the sync ran, when the watermark was written) are blanked.
fn replica_dump(file: &std::path::Path) -> std::collections::BTreeMap<String, Vec<Vec<rusqlite::types::Value>>> {
    use rusqlite::types::Value as Sql;
    let db = rusqlite::Connection::open_with_flags(file, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let mut tables: Vec<String> = db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    tables.push("sqlite_master".into());
    let mut dump = std::collections::BTreeMap::new();
    for table in tables {
        let order = if table == "sqlite_master" { "name" } else { "rowid" };
        let mut statement = db.prepare(&format!("SELECT * FROM \"{table}\" ORDER BY {order}")).unwrap();
        let columns: Vec<String> = statement.column_names().into_iter().map(str::to_string).collect();
        let rows = statement
            .query_map([], |r| {
                (0..columns.len())
                    .map(|i| {
                        let value: Sql = r.get(i)?;
                        Ok(match (table.as_str(), columns[i].as_str(), value) {
                            ("_zero.replicationConfig", "initialSyncContext", Sql::Text(context)) => {
                                let mut context: Value = serde_json::from_str(&context).unwrap();
                                context.as_object_mut().unwrap().remove("timestamp");
                                Sql::Text(context.to_string())
                            }
                            ("_zero.replicationState", "writeTimeMs", _) | ("_zero.runtimeEvents", "timestamp", _) => {
                                Sql::Null
                            }
                            (_, _, value) => value,
                        })
                    })
                    .collect::<Result<Vec<Sql>, _>>()
            })
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        dump.insert(table, rows);
    }
    dump
}
