//! The built-in Postgres source against a real PostgreSQL 15 server: the
//! initial snapshot, every kind of row change and value type, TOAST, replica
//! identity FULL, streamed (larger than logical_decoding_work_mem) and
//! rolled-back transactions, schema changes, restarts of Sluice and of the
//! server, a lost slot, and set-up errors.
//!
//! Each test has its own database and slot. A subscriber over a real
//! WebSocket applies what it receives to an in-memory replica, which is
//! compared row by row with the upstream tables.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::pgserver::PgServer;
use common::replica::{key_of, Replica};
use common::restartable::{Restartable, SourceFactory};
use common::*;
use serde_json::{json, Value};
use sluice::source::postgres::PostgresSource;
use sluice::source::ChangeSource;
use sluice::streamer::StreamerOptions;

const WAIT: Duration = Duration::from_secs(60);

/// A database of the test's own in a Postgres server.
struct Upstream {
    url: String,
    client: tokio_postgres::Client,
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

fn with_database(url: &str, db: &str) -> String {
    let base = url.rsplit_once('/').map(|(b, _)| b).unwrap_or(url);
    format!("{base}/{db}")
}

async fn upstream_on(server_url: &str, name: &str) -> Upstream {
    let admin = connect(server_url).await;
    for sql in [
        format!("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{name}'"),
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        admin.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let url = with_database(server_url, name);
    let client = connect(&url).await;
    Upstream { url, client }
}

async fn upstream(name: &str) -> Upstream {
    upstream_on(&pg_url(), name).await
}

impl Upstream {
    fn config(&self, slot: &str) -> String {
        json!({ "url": self.url, "slot": slot, "snapshot_batch_rows": 100 }).to_string()
    }

    async fn exec(&self, sql: &str) {
        if let Err(e) = self.client.batch_execute(sql).await {
            panic!("{sql}: {}", e.as_db_error().map(|d| d.message().to_string()).unwrap_or(e.to_string()));
        }
    }

    /// Drops a slot once the walsender that used it has gone.
    async fn drop_slot(&self, slot: &str) {
        let sql = format!(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{slot}' AND active_pid IS NOT NULL"
        );
        let (client, sql) = (&self.client, &sql);
        wait_until("the slot to be released", WAIT, || async move {
            client.query_opt(sql.as_str(), &[]).await.unwrap().is_none()
        })
        .await;
        self.exec(&format!("SELECT pg_drop_replication_slot('{slot}')")).await;
    }

    /// `table`'s rows as JSON objects keyed by their `id`.
    async fn rows(&self, table: &str) -> BTreeMap<String, Value> {
        let rows = self.client.query(&format!("SELECT to_jsonb(t)::text FROM {table} t"), &[]).await.unwrap();
        rows.iter()
            .map(|r| {
                let v: Value = serde_json::from_str(r.get::<_, &str>(0)).unwrap();
                (key_of(&v, &["id".to_string()]), v)
            })
            .collect()
    }
}

/// Sluice with the Postgres source over a SQLite change log, restartable
/// (see [`Restartable`]).
async fn start_sluice(config: String) -> Restartable {
    start_sluice_with(config, false).await
}

async fn start_sluice_with(config: String, auto_reset: bool) -> Restartable {
    let source: SourceFactory = Box::new(move || {
        let source: Box<dyn ChangeSource> = Box::new(PostgresSource::new(&config).unwrap());
        Box::pin(async move { source })
    });
    let options = StreamerOptions { auto_reset, ..StreamerOptions::default() };
    Restartable::start(tempfile::tempdir().unwrap(), options, source).await
}

async fn converge(up: &Upstream, replica: &Arc<Mutex<Replica>>, tables: &[&str]) {
    common::replica::converge(replica, tables, WAIT, |t| async move { up.rows(&t).await }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_every_kind_of_row_change() {
    init_logs();
    let up = upstream("pgsrc_changes").await;
    up.exec(
        "CREATE TABLE items (id bigint PRIMARY KEY, name text, n int);
         INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 250) g;
         CREATE TABLE other (id int PRIMARY KEY, label text)",
    )
    .await;
    let sluice = start_sluice(up.config("pgsrc_changes")).await;
    let replica = sluice.subscribe().await;
    // The snapshot (250 rows, in batches of 100) is the first transaction.
    converge(&up, &replica, &["public.items"]).await;
    assert_eq!(replica.lock().unwrap().commits.len(), 1, "one snapshot transaction");
    let rv = sluice.replica_version().await;
    assert_eq!(replica.lock().unwrap().commits[0], format!("{rv}.01"));
    assert_eq!(
        replica.lock().unwrap().schema_changes,
        ["create-table", "create-index", "create-table", "create-index"]
    );

    up.exec("INSERT INTO items VALUES (1000, 'new', 1)").await;
    up.exec("UPDATE items SET name = 'renamed' WHERE id = 1").await;
    up.exec("UPDATE items SET id = 2000 WHERE id = 2").await;
    up.exec("DELETE FROM items WHERE id BETWEEN 3 AND 10").await;
    up.exec("BEGIN; INSERT INTO other VALUES (1, 'a'), (2, 'b'); UPDATE items SET n = n + 1; COMMIT").await;
    converge(&up, &replica, &["public.items", "public.other"]).await;
    up.exec("TRUNCATE other").await;
    up.exec("INSERT INTO other VALUES (3, 'after truncate')").await;
    converge(&up, &replica, &["public.items", "public.other"]).await;
    // The log's table state holds the upstream's rows: updates, a key
    // change, deletes and a truncate applied.
    sluice.durable_through(&replica).await;
    for table in ["items", "other"] {
        assert_eq!(sluice.state_rows("public", table).await, up.rows(&format!("public.{table}")).await, "{table}");
    }

    let r = replica.lock().unwrap();
    let key_change = r.raw.iter().find(|m| m.contains("\"id\":2000")).unwrap();
    assert!(key_change.contains("\"key\":{\"id\":2}"), "the old key travels with a key change: {key_change}");
    let plain = r.raw.iter().find(|m| m.contains("renamed")).unwrap();
    assert!(plain.contains("\"key\":null"), "no old key when the key did not change: {plain}");
    assert_eq!(r.rollbacks, 0);
}

/// The snapshot's size is estimated from the planner's statistics (for the
/// progress line's ETA) when every table was analyzed, and not otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_estimates_its_rows_from_the_statistics() {
    init_logs();
    let up = upstream("pgsrc_estimate").await;
    up.exec(
        "CREATE TABLE big (id int PRIMARY KEY); INSERT INTO big SELECT generate_series(1, 3000);
         CREATE TABLE small (id int PRIMARY KEY); INSERT INTO small SELECT generate_series(1, 500);
         ANALYZE big; ANALYZE small",
    )
    .await;
    let first_batch_estimate = |slot: &'static str| {
        let config = up.config(slot);
        async move {
            let mut source = PostgresSource::new(&config).unwrap();
            let mut stream = source.open(None).await.unwrap();
            let first = stream.next_batch(100).await.unwrap();
            assert!(matches!(first.first(), Some(sluice::source::model::Message::Begin(_))), "the snapshot begins");
            stream.progress().await.unwrap().snapshot_rows_estimate
        }
    };
    assert_eq!(first_batch_estimate("pgsrc_estimate").await, Some(3500));
    // A table never analyzed has no statistics: no estimate at all.
    up.exec("CREATE TABLE fresh (id int PRIMARY KEY); INSERT INTO fresh VALUES (1)").await;
    up.drop_slot("pgsrc_estimate").await;
    assert_eq!(first_batch_estimate("pgsrc_estimate").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_keep_their_types_and_unchanged_toast_is_never_null() {
    init_logs();
    let up = upstream("pgsrc_types").await;
    up.exec(
        "CREATE TABLE typed (id bigint PRIMARY KEY, big bigint, amount numeric, doc jsonb, raw bytea,
           at timestamptz, day date, flag bool, tags text[], nums int8[], ratio float8, note varchar(20));
         CREATE TABLE docs (id int PRIMARY KEY, body text, n int);
         CREATE TABLE docs_full (id int PRIMARY KEY, body text, n int);
         ALTER TABLE docs_full REPLICA IDENTITY FULL;
         INSERT INTO typed VALUES (1, 9007199254740993, 12345678901234567890.123456789, '{\"a\": [1, 2]}',
           '\\x00ff', '2024-03-01 12:34:56.789+00', '2000-01-01', true, '{a,\"b c\",NULL}', '{1,9007199254740993}',
           0.5, 'short')",
    )
    .await;
    let sluice = start_sluice(up.config("pgsrc_types")).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.docs", "public.docs_full"]).await;
    // A TOASTed value: incompressible and far over the 2 kB threshold.
    let body = "SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g";
    up.exec(&format!(
        "INSERT INTO docs VALUES (1, ({body}), 0); INSERT INTO docs_full VALUES (1, ({body}), 0);
         INSERT INTO typed VALUES (2, -9223372036854775808, 'NaN', 'null', '\\x', '1969-12-31 23:59:59+00', '1970-01-02',
           false, '{{}}', NULL, 'Infinity', NULL)"
    ))
    .await;
    up.exec("UPDATE docs SET n = 1; UPDATE docs_full SET n = 1; DELETE FROM docs_full").await;
    up.exec("UPDATE docs SET n = 2").await;
    let sql_body = up.client.query_one(body, &[]).await.unwrap().get::<_, String>(0);
    let stored = up.client.query_one("SELECT n FROM docs WHERE id = 1", &[]).await.unwrap().get::<_, i32>(0);
    assert_eq!(stored, 2);
    let deadline = std::time::Instant::now() + WAIT;
    while replica.lock().unwrap().raw.iter().filter(|m| m.contains("\"tag\":\"update\"")).count() < 3 {
        assert!(std::time::Instant::now() < deadline, "the updates arrive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = replica.lock().unwrap().clone();
    let typed: Vec<&String> = r.raw.iter().filter(|m| m.contains("\"name\":\"typed\"")).collect();
    let first = typed.iter().find(|m| m.contains("\"id\":1,")).unwrap();
    for expected in [
        "\"big\":9007199254740993",
        "\"amount\":12345678901234567890.123456789",
        "\"doc\":{\"a\": [1, 2]}",
        "\"raw\":\"\\\\x00ff\"",
        "\"at\":1709296496789",
        "\"day\":946684800000",
        "\"flag\":true",
        "\"tags\":[\"a\",\"b c\",null]",
        "\"nums\":[1,9007199254740993]",
        "\"ratio\":0.5",
        "\"note\":\"short\"",
    ] {
        assert!(first.contains(expected), "{expected} in {first}");
    }
    let second = typed.iter().find(|m| m.contains("\"id\":2,")).unwrap();
    for expected in ["\"big\":-9223372036854775808", "\"amount\":\"NaN\"", "\"at\":-1000", "\"nums\":null"] {
        assert!(second.contains(expected), "{expected} in {second}");
    }
    // Default identity: the unchanged TOASTed body is left out, not NULL.
    let updates: Vec<&String> =
        r.raw.iter().filter(|m| m.contains("\"tag\":\"update\"") && m.contains("\"name\":\"docs\"")).collect();
    assert_eq!(updates.len(), 2);
    for u in &updates {
        assert!(!u.contains("\"body\""), "unchanged TOAST is absent: {u}");
    }
    // FULL identity: the old row carries it, so the new row has it.
    let full = r.raw.iter().find(|m| m.contains("\"tag\":\"update\"") && m.contains("docs_full")).unwrap();
    assert!(full.contains(&format!("\"body\":\"{sql_body}\"")), "the body is taken from the old row");
    let delete = r.raw.iter().find(|m| m.contains("\"tag\":\"delete\"") && m.contains("docs_full")).unwrap();
    assert!(delete.contains("\"type\":\"full\"") && delete.contains("\"n\":1"), "{delete}");
    drop(r);
    converge(&up, &replica, &["public.docs", "public.docs_full"]).await;
    // The table state merged the updates into the stored row: the body
    // they left out is still there.
    sluice.durable_through(&replica).await;
    assert_eq!(sluice.state_rows("public", "docs").await, up.rows("public.docs").await);
    assert_eq!(sluice.state_rows("public", "typed").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transactions_are_streamed_and_rolled_back_work_is_never_stored() {
    init_logs();
    let up = upstream("pgsrc_streamed").await;
    up.exec("CREATE TABLE big (id int PRIMARY KEY, payload text); CREATE TABLE small (id int PRIMARY KEY)").await;
    let sluice = start_sluice(up.config("pgsrc_streamed")).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.big"]).await;
    let other = connect(&up.url).await;
    // The server streams anything over logical_decoding_work_mem (64kB in
    // the test server) before it commits; a small transaction commits in
    // the middle of the big one.
    up.exec("BEGIN; INSERT INTO big SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g").await;
    other.batch_execute("INSERT INTO small VALUES (1)").await.unwrap();
    up.exec("SAVEPOINT s; INSERT INTO big SELECT g, 'dropped' FROM generate_series(3001, 6000) g; ROLLBACK TO s").await;
    up.exec("INSERT INTO big VALUES (7000, 'last'); COMMIT").await;
    up.exec("BEGIN; INSERT INTO big SELECT g, repeat('y', 100) FROM generate_series(10001, 14000) g; ROLLBACK").await;
    other.batch_execute("INSERT INTO small VALUES (2)").await.unwrap();
    converge(&up, &replica, &["public.big", "public.small"]).await;

    let streamed: i64 = up
        .client
        .query_one("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = 'pgsrc_streamed'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(streamed >= 2, "the big transactions were streamed ({streamed})");
    let r = replica.lock().unwrap().clone();
    assert_eq!(r.rollbacks, 0, "aborted work never reaches subscribers");
    assert!(!r.raw.iter().any(|m| m.contains("dropped") || m.contains("yyyy")));
    // Commit order: small(1), the big one, small(2).
    assert_eq!(r.commits.len(), 4, "{:?}", r.commits);
    drop(r);
    sluice.durable_through(&replica).await;
    let rows = sluice.spec().rows().await;
    let per_tx = |w: &str| rows.iter().filter(|row| row.watermark == w && row.tag == "insert").count();
    let commits = replica.lock().unwrap().commits.clone();
    assert_eq!(per_tx(&commits[1]), 1);
    assert_eq!(per_tx(&commits[2]), 3001, "the streamed transaction is stored whole");
    assert_eq!(per_tx(&commits[3]), 1);
    sluice.spec().assert_whole().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_of_every_kind_arrive_in_their_transaction() {
    init_logs();
    let up = upstream("pgsrc_ddl").await;
    up.exec("CREATE TABLE t (id int PRIMARY KEY, a text, b int)").await;
    let mut sluice = start_sluice(up.config("pgsrc_ddl")).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.t"]).await;
    let steps = [
        (
            "CREATE TABLE u (id int PRIMARY KEY, v text); INSERT INTO u VALUES (1, 'one')",
            vec!["create-table", "create-index"],
        ),
        ("ALTER TABLE t ADD COLUMN c text DEFAULT 'dflt'", vec!["add-column"]),
        ("ALTER TABLE t RENAME COLUMN a TO a2", vec!["update-column"]),
        ("ALTER TABLE t ALTER COLUMN b TYPE bigint", vec!["update-column"]),
        ("ALTER TABLE t DROP COLUMN a2", vec!["drop-column"]),
        ("ALTER TABLE u RENAME TO u2", vec!["rename-table"]),
        ("CREATE INDEX t_b ON t (b DESC)", vec!["create-index"]),
        ("DROP INDEX t_b", vec!["drop-index"]),
        ("DROP TABLE u2", vec!["drop-table"]),
    ];
    let base = replica.lock().unwrap().schema_changes.len();
    let mut expected: Vec<&str> = Vec::new();
    for (i, (sql, tags)) in steps.iter().enumerate() {
        up.exec(&format!("BEGIN; {sql}; INSERT INTO t (id) VALUES ({}); COMMIT", 100 + i)).await;
        expected.extend(tags);
    }
    converge(&up, &replica, &["public.t"]).await;
    let got: Vec<String> = replica.lock().unwrap().schema_changes[base..].to_vec();
    assert_eq!(got, expected);
    // Each change sits in the same transaction as the row written with it.
    sluice.durable_through(&replica).await;
    let rows = sluice.spec().rows().await;
    let add = rows.iter().find(|r| r.tag == "add-column").unwrap();
    assert!(add.change.contains("\"dflt\":\"'dflt'::text\""), "{}", add.change);
    assert!(rows.iter().any(|r| r.watermark == add.watermark && r.change.contains("\"id\":101")));

    // A column whose default a replica cannot compute needs a new snapshot.
    up.exec("ALTER TABLE t ADD COLUMN at timestamptz DEFAULT now()").await;
    sluice.wait_for_reset().await;
    sluice.stop().await.unwrap();
}

/// Many small transactions, each inserting one `events` row and bumping a
/// counter row, while Sluice is restarted; every event must arrive once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_sluice_mid_workload_loses_and_duplicates_nothing() {
    init_logs();
    let up = upstream("pgsrc_restart").await;
    up.exec(
        "CREATE TABLE events (id int PRIMARY KEY, at int); CREATE TABLE counters (id int PRIMARY KEY, n int);
             INSERT INTO counters SELECT g, 0 FROM generate_series(1, 10) g",
    )
    .await;
    let mut sluice = start_sluice(up.config("pgsrc_restart")).await;
    sluice.replica_version().await;
    let url = up.url.clone();
    let writer = tokio::spawn(async move {
        let c = connect(&url).await;
        for i in 0..1500 {
            c.batch_execute(&format!(
                "BEGIN; INSERT INTO events VALUES ({i}, {i}); UPDATE counters SET n = n + 1 WHERE id = {}; COMMIT",
                i % 10 + 1
            ))
            .await
            .unwrap();
        }
    });
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        sluice.restart().await;
    }
    writer.await.unwrap();
    // A subscriber from the start sees every event exactly once.
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.events", "public.counters"]).await;
    let r = replica.lock().unwrap().clone();
    let inserts = r.raw.iter().filter(|m| m.contains("\"tag\":\"insert\"") && m.contains("\"events\"")).count();
    assert_eq!(inserts, 1500, "each event once");
    assert_eq!(r.commits.len(), 1501, "the snapshot and each upstream transaction once");
    drop(r);
    sluice.spec().assert_whole().await;
    // Acks reached the slot: it confirmed at least the last stored commit
    // (keepalive positions past it are confirmed once nothing is pending, so
    // it may be further), and the restarts above lost nothing by it.
    let last = sluice.spec().last_watermark().await;
    let slot = "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'pgsrc_restart'";
    let last_lsn = sluice::watermark::from_lexi(last.split('.').next().unwrap()).unwrap() as u64;
    let client = &up.client;
    wait_until("the slot to confirm the last commit", WAIT, || async move {
        let confirmed: String = client.query_one(slot, &[]).await.unwrap().get(0);
        let (h, l) = confirmed.split_once('/').unwrap();
        let confirmed = (u64::from_str_radix(h, 16).unwrap() << 32) | u64::from_str_radix(l, 16).unwrap();
        confirmed >= last_lsn
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_survives_the_server_restarting_and_connections_being_cut() {
    init_logs();
    let server = PgServer::start(&[
        "wal_level=logical",
        "max_wal_senders=5",
        "max_replication_slots=5",
        "logical_decoding_work_mem=64kB",
    ]);
    let mut up = upstream_on(&server.url(), "pgsrc_server").await;
    up.exec("CREATE TABLE events (id int PRIMARY KEY)").await;
    let sluice = start_sluice(up.config("pgsrc_server")).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.events"]).await;
    let mut next = 0;
    for mode in ["fast", "immediate"] {
        for _ in 0..50 {
            up.exec(&format!("INSERT INTO events VALUES ({next})")).await;
            next += 1;
        }
        server.restart(mode);
        up.client = connect(&up.url).await;
        for _ in 0..50 {
            up.exec(&format!("INSERT INTO events VALUES ({next})")).await;
            next += 1;
        }
        converge(&up, &replica, &["public.events"]).await;
    }
    // A cut replication connection: the stream resumes where it was.
    up.exec("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'pgsrc_server'").await;
    up.exec("INSERT INTO events SELECT g FROM generate_series(1000, 1100) g").await;
    converge(&up, &replica, &["public.events"]).await;
    let r = replica.lock().unwrap();
    let inserts = r.raw.iter().filter(|m| m.contains("\"tag\":\"insert\"")).count();
    assert_eq!(inserts, next + 101, "every row once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_requires_a_reset_and_auto_reset_rebuilds() {
    init_logs();
    let up = upstream("pgsrc_lost").await;
    up.exec("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)").await;
    let mut sluice = start_sluice(up.config("pgsrc_lost")).await;
    let first_rv = sluice.replica_version().await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.t"]).await;
    sluice.stop().await.unwrap();
    up.drop_slot("pgsrc_lost").await;
    sluice.run().await;
    sluice.wait_for_reset().await;
    sluice.stop().await.unwrap();

    // With auto-reset the next run takes a new slot and snapshot.
    up.exec("INSERT INTO t VALUES (2)").await;
    sluice.service.streamer_options().auto_reset = true;
    sluice.run().await;
    let st = sluice.status.clone();
    let old = first_rv.clone();
    wait_until("a new replica version", WAIT, || {
        let rv = st.snapshot().replica_version;
        let old = old.clone();
        async move { rv.is_some_and(|rv| rv != old) }
    })
    .await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.t"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_up_errors_are_clear() {
    init_logs();
    // wal_level is not logical.
    let server = PgServer::start(&["wal_level=replica"]);
    let mut source = PostgresSource::new(&json!({ "url": server.url() }).to_string()).unwrap();
    let err = sluice::source::ChangeSource::open(&mut source, None).await.err().unwrap().to_string();
    assert!(err.contains("wal_level = replica") && err.contains("wal_level = logical"), "{err}");

    // A publication that does not exist.
    let up = upstream("pgsrc_setup").await;
    let config = json!({ "url": up.url, "slot": "pgsrc_setup", "publications": ["nope"] }).to_string();
    let mut source = PostgresSource::new(&config).unwrap();
    let err = sluice::source::ChangeSource::open(&mut source, None).await.err().unwrap().to_string();
    assert!(err.contains("publication nope does not exist"), "{err}");

    // A row filter: the snapshot could not match the stream.
    up.exec(
        "CREATE TABLE filtered (id int PRIMARY KEY); CREATE PUBLICATION filtered_pub FOR TABLE filtered WHERE (id > 5)",
    )
    .await;
    let config = json!({ "url": up.url, "slot": "pgsrc_setup", "publications": ["filtered_pub"] }).to_string();
    let mut source = PostgresSource::new(&config).unwrap();
    let err = sluice::source::ChangeSource::open(&mut source, None).await.err().unwrap().to_string();
    assert!(err.contains("filtered_pub publishes public.filtered with a row filter"), "{err}");

    // Bad configuration never reaches the server.
    for (config, expected) in [
        (json!({ "url": up.url, "slot": "Bad-Slot" }), "slot \"Bad-Slot\""),
        (json!({ "url": up.url, "publications": ["x;drop"] }), "publication \"x;drop\""),
        (json!({ "url": up.url, "extra": 1 }), "unknown field `extra`"),
        (json!({ "url": "nonsense://" }), "url"),
    ] {
        let err = PostgresSource::new(&config.to_string()).err().unwrap();
        assert!(err.contains(expected), "{err} should mention {expected}");
    }

    // Password (SCRAM) authentication on both connections, and a wrong one.
    up.exec(
        "DO $$ BEGIN CREATE ROLE sluice_scram LOGIN REPLICATION SUPERUSER PASSWORD 'secret';
         EXCEPTION WHEN duplicate_object THEN NULL; END $$",
    )
    .await;
    let with_user = |pw: &str| up.url.replacen("postgres://postgres@", &format!("postgres://sluice_scram:{pw}@"), 1);
    let mut source =
        PostgresSource::new(&json!({ "url": with_user("wrong"), "slot": "pgsrc_setup" }).to_string()).unwrap();
    let err = sluice::source::ChangeSource::open(&mut source, None).await.err().unwrap();
    assert!(matches!(err, sluice::source::SourceError::Fatal(_)), "{err}");
    assert!(err.to_string().contains("password authentication failed"), "{err}");
    up.exec("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)").await;
    let sluice = start_sluice(json!({ "url": with_user("secret"), "slot": "pgsrc_setup" }).to_string()).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.t"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_event_trigger_schema_changes_come_from_relation_messages() {
    init_logs();
    let up = upstream("pgsrc_degraded").await;
    up.exec(
        "DO $$ BEGIN CREATE ROLE sluice_plain LOGIN REPLICATION;
         EXCEPTION WHEN duplicate_object THEN NULL; END $$;
         ALTER DATABASE pgsrc_degraded OWNER TO sluice_plain;",
    )
    .await;
    let url = up.url.replacen("postgres://postgres@", "postgres://sluice_plain@", 1);
    let plain = Upstream { url: url.clone(), client: connect(&url).await };
    plain
        .exec("CREATE TABLE t (id int PRIMARY KEY, a text); INSERT INTO t VALUES (1, 'x'); CREATE PUBLICATION mine FOR TABLE t")
        .await;
    // The default publication (all of schema public) needs a superuser.
    let mut source = PostgresSource::new(&plain.config("pgsrc_degraded")).unwrap();
    let err = sluice::source::ChangeSource::open(&mut source, None).await.err().unwrap().to_string();
    assert!(err.contains("must be superuser") && err.contains("\"publications\""), "{err}");
    let config = json!({ "url": url, "slot": "pgsrc_degraded", "publications": ["mine"] }).to_string();
    let sluice = start_sluice(config).await;
    let replica = sluice.subscribe().await;
    converge(&plain, &replica, &["public.t"]).await;
    plain.exec("ALTER TABLE t ADD COLUMN b int; INSERT INTO t VALUES (2, 'y', 5)").await;
    converge(&plain, &replica, &["public.t"]).await;
    assert!(replica.lock().unwrap().schema_changes.iter().any(|c| c == "add-column"));
    // A new table cannot be followed without the trigger: a reset.
    plain.exec("CREATE TABLE fresh (id int PRIMARY KEY); ALTER PUBLICATION mine ADD TABLE fresh").await;
    plain.exec("INSERT INTO fresh VALUES (1)").await;
    sluice.wait_for_reset().await;
}

/// A slot the server invalidated (it removed WAL the slot still needed,
/// past `max_slot_wal_keep_size`) while Sluice was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_requires_a_reset_with_the_reason() {
    init_logs();
    let server = PgServer::start(&[
        "wal_level=logical",
        "max_wal_senders=5",
        "max_replication_slots=5",
        "max_slot_wal_keep_size=1MB",
        "min_wal_size=32MB",
        "max_wal_size=32MB",
    ]);
    let up = upstream_on(&server.url(), "pgsrc_invalid").await;
    up.exec("CREATE TABLE t (id int PRIMARY KEY, pad text); INSERT INTO t VALUES (1, 'x')").await;
    let mut sluice = start_sluice(up.config("pgsrc_invalid")).await;
    let replica = sluice.subscribe().await;
    converge(&up, &replica, &["public.t"]).await;
    sluice.stop().await.unwrap();
    // Write and recycle far more WAL than the slot may hold.
    let client = &up.client;
    wait_until("the slot to be invalidated", WAIT, || async move {
        client
            .batch_execute(
                "INSERT INTO t SELECT g, repeat('p', 1000) FROM generate_series(2, 20000) g ON CONFLICT (id) DO UPDATE SET pad = EXCLUDED.pad",
            )
            .await
            .unwrap();
        client.batch_execute("SELECT pg_switch_wal(); CHECKPOINT").await.unwrap();
        let status: Option<String> = client
            .query_one("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'pgsrc_invalid'", &[])
            .await
            .unwrap()
            .get(0);
        status.as_deref() == Some("lost")
    })
    .await;
    sluice.run().await;
    let reason = sluice.wait_for_reset().await;
    assert!(reason.contains("pgsrc_invalid was invalidated"), "{reason}");
    sluice.stop().await.unwrap();
}
