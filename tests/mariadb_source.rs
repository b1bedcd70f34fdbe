//! The mariadb-source plugin against a real MariaDB server: the initial
//! snapshot, every kind of row change, multi-statement and rolled-back
//! transactions, each value type (the same from the snapshot and from the
//! binlog), DDL in the middle of the stream, restarts of Sluice and of the
//! server, a cut binlog connection, a purged binlog, and set-up errors.
//!
//! A subscriber over a real WebSocket applies what it receives to an
//! in-memory replica, which is compared row by row with the MariaDB tables
//! (read with MariaDB's own client).

#[macro_use]
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::mariadb::{self, Maria};
use common::replica::Replica;
use common::restartable::{Restartable, SourceFactory};
use common::*;
use serde_json::{json, Value};
use sluice::plugin::{Registry, SandboxLimits};
use sluice::source::ChangeSource;
use sluice::streamer::StreamerOptions;

const WAIT: Duration = Duration::from_secs(60);

/// Sluice with the mariadb-source plugin over a SQLite change log,
/// restartable (see [`Restartable`]).
async fn start_sluice(config: Value) -> Restartable {
    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(Registry::load(&plugin_dir(), Some(dir.path().join("cache"))).await.unwrap());
    let config = config.to_string();
    let source: SourceFactory = Box::new(move || {
        let (registry, config) = (registry.clone(), config.clone());
        Box::pin(async move { source(&registry, &config).await })
    });
    Restartable::start(dir, StreamerOptions::default(), source).await
}

/// An instance of the mariadb-source plugin, allowed to reach the server
/// its configuration names.
async fn source(registry: &Arc<Registry>, config: &str) -> Box<dyn ChangeSource> {
    let grant = sluice::plugin::net::grant_for(config, &[]).unwrap();
    Box::new(registry.source("mariadb-source", config.to_string(), SandboxLimits::default(), grant).await.unwrap())
}

/// Waits until the replica holds exactly the rows of each `db.table` (the
/// columns named).
async fn converge(m: &Maria, replica: &Arc<Mutex<Replica>>, tables: &[(&str, &[&str])]) {
    let names: Vec<&str> = tables.iter().map(|(t, _)| *t).collect();
    common::replica::converge(replica, &names, WAIT, |t| {
        let cols = tables.iter().find(|(n, _)| *n == t).map(|(_, c)| *c).unwrap_or(&[]);
        let rows = m.rows(&t, cols);
        async move { rows }
    })
    .await
}

fn inserts_into(r: &Replica, table: &str) -> usize {
    r.raw.iter().filter(|m| m.contains("\"tag\":\"insert\"") && m.contains(&format!("\"name\":\"{table}\""))).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_every_kind_of_row_change() {
    init_logs();
    let m = mariadb::shared();
    m.database("msrc_rows");
    m.database("msrc_rows_other");
    m.sql(
        "CREATE TABLE msrc_rows.items (id int PRIMARY KEY, name varchar(50), n bigint);
         CREATE TABLE msrc_rows.kv (k varchar(10) PRIMARY KEY, v int);
         CREATE TABLE msrc_rows_other.ignored (id int PRIMARY KEY);
         INSERT INTO msrc_rows.items VALUES (1, 'one', 10), (2, 'two', 20), (3, 'three', 30);
         INSERT INTO msrc_rows.kv VALUES ('a', 1)",
    );
    let sluice = start_sluice(m.config(&["msrc_rows"])).await;
    let replica = sluice.subscribe().await;
    let items: (&str, &[&str]) = ("msrc_rows.items", &["id", "name", "n"]);
    let kv: (&str, &[&str]) = ("msrc_rows.kv", &["k", "v"]);
    converge(&m, &replica, &[items, kv]).await;
    assert_eq!(replica.lock().unwrap().commits.len(), 1, "the snapshot is one transaction");

    // Eight upstream transactions that touch captured tables, one rolled
    // back, one in another database.
    m.sql(
        "INSERT INTO msrc_rows.items VALUES (4, 'four', 40);
         UPDATE msrc_rows.items SET name = 'uno' WHERE id = 1;
         UPDATE msrc_rows.items SET id = 102 WHERE id = 2;
         DELETE FROM msrc_rows.items WHERE id = 3;
         UPDATE msrc_rows.kv SET k = 'b', v = 2 WHERE k = 'a';
         BEGIN; INSERT INTO msrc_rows.items VALUES (5, 'five', 50), (6, 'six', 60);
                UPDATE msrc_rows.items SET n = n + 1; DELETE FROM msrc_rows.items WHERE id = 4;
                INSERT INTO msrc_rows.kv VALUES ('c', 3); COMMIT;
         BEGIN; INSERT INTO msrc_rows.items VALUES (999, 'never', 0); ROLLBACK;
         INSERT INTO msrc_rows_other.ignored VALUES (1);
         UPDATE msrc_rows.items SET name = NULL WHERE id = 5;
         INSERT INTO msrc_rows.items SELECT id + 1000, name, n FROM msrc_rows.items",
    );
    converge(&m, &replica, &[items, kv]).await;
    let r = replica.lock().unwrap().clone();
    // The snapshot, then one commit per upstream transaction on a captured table.
    assert_eq!(r.commits.len(), 1 + 8, "{:?}", r.commits);
    assert_eq!(r.rollbacks, 0);
    assert!(!r.raw.iter().any(|m| m.contains("999") || m.contains("ignored")), "rolled back or not captured");
    // The key change carries the old key; a plain update carries none.
    assert!(r.raw.iter().any(|m| m.contains("\"key\":{\"id\":2}") && m.contains("\"id\":102")));
    assert!(r.raw.iter().any(|m| m.contains("\"key\":null") && m.contains("\"name\":\"uno\"")));
    assert!(r.raw.iter().any(|m| m.contains("\"tag\":\"delete\"") && m.contains("\"key\":{\"id\":3}")));
    // Binlog commits carry their upstream time (whole seconds), from which
    // the host measures the source's lag.
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as f64;
    let commit_times: Vec<f64> = r.commit_bodies.iter().filter_map(|c| c["commitTimeMs"].as_f64()).collect();
    assert_eq!(commit_times.len(), 8, "every binlog commit has a time, the snapshot none");
    for t in commit_times {
        assert!(t <= now_ms + 1_000.0 && t > now_ms - 600_000.0, "committed upstream just now: {t} vs {now_ms}");
    }
    // Watermarks: LexiVersions of the GTID sequence, with the position after.
    for w in &r.commits {
        let (lexi, gtid) = w.split_once('.').unwrap();
        let seq = sluice::watermark::from_lexi(lexi).unwrap();
        assert!(gtid.ends_with(&format!("-{seq}")), "{w}: the counter is the GTID sequence");
    }
    sluice.spec().assert_whole().await;
}

/// The server's binlog head: the file being written and its size.
fn binlog_head(m: &Maria) -> (String, u64) {
    let status = m.sql("SHOW MASTER STATUS");
    let mut fields = status.split('\t');
    let file = fields.next().unwrap_or_default().to_string();
    let offset = fields.next().and_then(|p| p.trim().parse().ok()).expect("SHOW MASTER STATUS gives the position");
    (file, offset)
}

/// Pulls batches until the stream's binlog position gap is zero (the
/// stream has read everything the server wrote); returns the row inserts
/// pulled on the way.
async fn read_until_caught_up(stream: &mut dyn sluice::source::ChangeStream) -> usize {
    let deadline = std::time::Instant::now() + WAIT;
    let mut inserts = 0;
    loop {
        let batch = stream.next_batch(1000).await.unwrap();
        inserts += batch.iter().filter(|m| matches!(m, sluice::source::model::Message::Insert(_))).count();
        if batch.is_empty() && stream.progress().await.unwrap().behind_bytes == Some(0) {
            return inserts;
        }
        assert!(std::time::Instant::now() < deadline, "the binlog position gap never fell to zero");
    }
}

/// The plugin's `source-progress`: the snapshot's row estimate from
/// InnoDB's statistics, and the binlog position gap, which grows by what
/// the server writes while the stream does not read, and falls back to
/// zero once it has. The replication loop puts the gap in `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_estimate_and_the_binlog_position_gap() {
    init_logs();
    let m = mariadb::shared();
    m.database("msrc_progress");
    m.sql(
        "CREATE TABLE msrc_progress.t (id int PRIMARY KEY, v varchar(60));
         INSERT INTO msrc_progress.t SELECT seq, CONCAT('row number ', seq) FROM msrc_progress.seq_1_to_3000;
         ANALYZE TABLE msrc_progress.t",
    );
    let registry = Arc::new(Registry::load(&plugin_dir(), None).await.unwrap());
    // A replica id of its own: the server closes a dump when another
    // replica connects with the same id (other tests use the default).
    let mut config = m.config(&["msrc_progress"]);
    config["server_id"] = json!(5_381_042);
    let mut source = source(&registry, &config.to_string()).await;
    let mut stream = source.open(None).await.unwrap();
    let first = stream.next_batch(100).await.unwrap();
    assert!(matches!(first.first(), Some(sluice::source::model::Message::Begin(_))), "the snapshot begins");
    let during = stream.progress().await.unwrap();
    let estimate = during.snapshot_rows_estimate.expect("InnoDB estimates the table's rows");
    assert!((1_500..=6_000).contains(&estimate), "about 3000 rows, estimated {estimate}");
    assert!(during.behind_bytes.is_some(), "the binlog written since the snapshot's position is measured");

    let first_rows = first.iter().filter(|m| matches!(m, sluice::source::model::Message::Insert(_))).count();
    let snapshot_rows = first_rows + read_until_caught_up(stream.as_mut()).await;
    assert_eq!(snapshot_rows, 3000, "the snapshot, and nothing since");
    assert_eq!(stream.progress().await.unwrap().snapshot_rows_estimate, None, "no snapshot runs any more");

    // The server writes while the stream reads nothing: the gap is at
    // least what was written (other tests may write too).
    let before = binlog_head(&m);
    m.sql("INSERT INTO msrc_progress.t SELECT id + 10000, v FROM msrc_progress.t");
    let after = binlog_head(&m);
    let written = if after.0 == before.0 { after.1 - before.1 } else { after.1 };
    assert!(written > 50_000, "3000 rows make a large binlog event: {written}");
    let gap = stream.progress().await.unwrap().behind_bytes.expect("the gap is measured");
    assert!(gap >= written, "the gap {gap} covers the {written} bytes written");
    assert_eq!(read_until_caught_up(stream.as_mut()).await, 3000, "the stream read what the gap counted");
    drop(stream);

    // Through the replication loop, the gap reaches /status.
    let sluice = start_sluice(config).await;
    wait_until("the binlog position gap in /status", WAIT, || {
        let gap = sluice.status.snapshot().upstream_behind_bytes;
        async move { gap == Some(0) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_of_every_type_are_the_same_from_the_snapshot_and_the_binlog() {
    init_logs();
    let m = mariadb::shared();
    m.database("msrc_types");
    let columns = "id int PRIMARY KEY, i8 tinyint, u8 tinyint unsigned, i16 smallint, u16 smallint unsigned, \
         i24 mediumint, u24 mediumint unsigned, i32 int, u32 int unsigned, i64 bigint, u64 bigint unsigned, \
         dec1 decimal(10,2), dec2 decimal(30,10), f float, d double, dt date, dtm datetime, dtm3 datetime(3), \
         ts timestamp(6) NULL, tm time, tm2 time(2), yr year, c char(5), vc varchar(300), bin binary(4), \
         vb varbinary(10), tx text, bl blob, lt longtext, e enum('red','green','blue'), s set('a','b','c'), \
         j json, bt bit(12), nul int";
    let values = "-128, 255, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295, \
         -9223372036854775808, 18446744073709551615, -12345678.90, 12345678901234567890.0123456789, \
         0.1, 2.718281828459045, '2024-02-29', '1999-12-31 23:59:59', '2024-01-02 03:04:05.678', \
         '2024-05-06 07:08:09.123456', '-838:59:59', '12:34:56.78', 2024, 'ab', REPEAT('x', 300), \
         x'0102', x'00ff', 'héllo wörld ✓', x'deadbeef', 'long text', 'green', 'a,c', '{\"k\": [1, 2]}', \
         b'101010101010', NULL";
    m.sql(&format!("CREATE TABLE msrc_types.t ({columns}); INSERT INTO msrc_types.t VALUES (1, {values})"));
    let sluice = start_sluice(m.config(&["msrc_types"])).await;
    let replica = sluice.subscribe().await;
    m.sql(&format!(
        "INSERT INTO msrc_types.t VALUES (2, {values}); INSERT INTO msrc_types.t (id, nul) VALUES (3, 7); \
         INSERT INTO msrc_types.t (id, i64, u64, dec1) VALUES (4, 9007199254740993, 9223372036854775808, 0)"
    ));
    let r = replica.clone();
    wait_until("the rows from the binlog", WAIT, || {
        let n = r.lock().unwrap().rows("msrc_types.t").len();
        async move { n == 4 }
    })
    .await;
    let r = replica.lock().unwrap().clone();
    let rows = r.rows("msrc_types.t");
    let row = |id: i64| -> Value {
        let mut v = rows.values().find(|v| v["id"] == id).unwrap().clone();
        v.as_object_mut().unwrap().remove("id");
        v
    };
    // The snapshot's row 1 and the binlog's row 2 hold the same values.
    assert_eq!(row(1), row(2));
    let from_binlog = r.raw.iter().find(|m| m.contains("\"tag\":\"insert\"") && m.contains("\"id\":2")).unwrap();
    let from_snapshot = r.raw.iter().find(|m| m.contains("\"tag\":\"insert\"") && m.contains("\"id\":1,")).unwrap();
    for expected in [
        "\"i8\":-128",
        "\"u8\":255",
        "\"u24\":16777215",
        "\"i64\":-9223372036854775808",
        "\"u64\":18446744073709551615",
        "\"dec1\":-12345678.90",
        "\"dec2\":12345678901234567890.0123456789",
        "\"f\":0.1",
        "\"d\":2.718281828459045",
        // Dates and times are milliseconds, as Zero reads them.
        "\"dt\":1709164800000,",
        "\"dtm\":946684799000,",
        "\"dtm3\":1704164645678,",
        "\"ts\":1714979289123.456,",
        "\"tm\":-3020399000,",
        "\"tm2\":45296780,",
        "\"yr\":2024",
        "\"c\":\"ab\"",
        "\"bin\":\"\\\\x01020000\"",
        "\"vb\":\"\\\\x00ff\"",
        "\"tx\":\"héllo wörld ✓\"",
        "\"bl\":\"\\\\xdeadbeef\"",
        "\"e\":\"green\"",
        "\"s\":\"a,c\"",
        "\"j\":\"{\\\"k\\\": [1, 2]}\"",
        "\"bt\":2730",
        "\"nul\":null",
    ] {
        assert!(from_binlog.contains(expected), "binlog row lacks {expected}: {from_binlog}");
        assert!(from_snapshot.contains(expected), "snapshot row lacks {expected}: {from_snapshot}");
    }
    // Integers beyond 2^53 stay exact.
    let big = r.raw.iter().find(|m| m.contains("\"id\":4")).unwrap();
    assert!(big.contains("\"i64\":9007199254740993") && big.contains("\"u64\":9223372036854775808"), "{big}");
    assert!(big.contains("\"dec1\":0.00"), "{big}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ddl_in_the_middle_of_the_stream_becomes_schema_changes() {
    init_logs();
    let m = mariadb::shared();
    m.database("msrc_ddl");
    m.sql("CREATE TABLE msrc_ddl.t (id int PRIMARY KEY, a varchar(10)); INSERT INTO msrc_ddl.t VALUES (1, 'x')");
    let sluice = start_sluice(m.config(&["msrc_ddl"])).await;
    let replica = sluice.subscribe().await;
    converge(&m, &replica, &[("msrc_ddl.t", &["id", "a"])]).await;
    m.sql(
        "ALTER TABLE msrc_ddl.t ADD COLUMN b int AFTER id;
         INSERT INTO msrc_ddl.t VALUES (2, 20, 'y');
         ALTER TABLE msrc_ddl.t RENAME COLUMN a TO a2;
         UPDATE msrc_ddl.t SET a2 = 'z' WHERE id = 1;
         CREATE TABLE msrc_ddl.u (id bigint unsigned PRIMARY KEY, label varchar(20) NOT NULL DEFAULT 'none');
         INSERT INTO msrc_ddl.u VALUES (1, 'first');
         RENAME TABLE msrc_ddl.u TO msrc_ddl.v;
         INSERT INTO msrc_ddl.v VALUES (2, 'second');
         ALTER TABLE msrc_ddl.t DROP COLUMN b, ADD INDEX (a2);
         INSERT INTO msrc_ddl.t VALUES (3, 'w');
         CREATE TABLE msrc_ddl.gone (id int PRIMARY KEY); INSERT INTO msrc_ddl.gone VALUES (1); DROP TABLE msrc_ddl.gone;
         CREATE TABLE msrc_ddl.trunc (id int PRIMARY KEY); INSERT INTO msrc_ddl.trunc VALUES (1), (2);
         TRUNCATE TABLE msrc_ddl.trunc; INSERT INTO msrc_ddl.trunc VALUES (3);
         CREATE DATABASE IF NOT EXISTS msrc_ddl_other; CREATE TABLE IF NOT EXISTS msrc_ddl_other.x (id int PRIMARY KEY)",
    );
    converge(
        &m,
        &replica,
        &[("msrc_ddl.t", &["id", "a2"]), ("msrc_ddl.v", &["id", "label"]), ("msrc_ddl.trunc", &["id"])],
    )
    .await;
    let r = replica.lock().unwrap().clone();
    assert_eq!(
        r.schema_changes,
        [
            // Each table comes with the unique index over its primary key.
            "create-table", // the snapshot
            "create-index",
            "add-column",
            "update-column",
            "create-table",
            "create-index",
            "rename-table",
            "drop-column",
            "create-table",
            "create-index",
            "drop-table",
            "create-table",
            "create-index",
        ]
    );
    assert!(r.rows("msrc_ddl.gone").is_empty());
    let create_u = r.raw.iter().find(|m| m.contains("\"create-table\"") && m.contains("\"name\":\"u\"")).unwrap();
    assert!(create_u.contains("\"label\":{\"pos\":2,\"dataType\":\"varchar\""), "{create_u}");
    assert!(create_u.contains("\"primaryKey\":[\"id\"]"), "{create_u}");
    assert!(!r.raw.iter().any(|m| m.contains("msrc_ddl_other")), "another database's DDL");

    // A statement it cannot express requires a reset, naming the statement.
    m.sql("CREATE TABLE msrc_ddl.copy LIKE msrc_ddl.t");
    let reason = sluice.wait_for_reset().await;
    assert!(reason.contains("CREATE TABLE msrc_ddl.copy LIKE msrc_ddl.t"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_of_sluice_and_of_the_server_lose_and_duplicate_nothing() {
    init_logs();
    let mut server = mariadb::Server::start(&[]);
    let m = &server.maria;
    m.database("msrc_restart");
    // A snapshot of 3,000 rows handed over 500 at a time.
    let first: Vec<String> = (0..3000).map(|i| format!("({}, -3)", 10_000 + i)).collect();
    m.sql(&format!(
        "CREATE TABLE msrc_restart.events (id int PRIMARY KEY, at int); INSERT INTO msrc_restart.events VALUES {}",
        first.join(", ")
    ));
    let mut config = m.config(&["msrc_restart"]);
    config["snapshot_batch_rows"] = json!(500);
    let mut sluice = start_sluice(config).await;
    let replica = sluice.subscribe().await;
    converge(m, &replica, &[("msrc_restart.events", &["id", "at"])]).await;
    // Sluice restarted in the middle of a stream of small transactions.
    let socket = m.socket.clone();
    let writer = std::thread::spawn(move || {
        let m = Maria { host: String::new(), port: 0, socket };
        for i in 0..20 {
            let values: Vec<String> = (0..25).map(|j| format!("({}, {i})", i * 25 + j)).collect();
            let stmts: Vec<String> =
                values.iter().map(|v| format!("INSERT INTO msrc_restart.events VALUES {v}")).collect();
            m.sql(&stmts.join(";"));
        }
    });
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        sluice.restart().await;
    }
    writer.join().unwrap();
    converge(&server.maria, &replica, &[("msrc_restart.events", &["id", "at"])]).await;

    // The server restarted cleanly, then killed, then the binlog connection cut.
    let mut next = 500;
    for kill in [false, true] {
        server.restart(kill);
        for _ in 0..20 {
            server.maria.sql(&format!("INSERT INTO msrc_restart.events VALUES ({next}, -1)"));
            next += 1;
        }
        converge(&server.maria, &replica, &[("msrc_restart.events", &["id", "at"])]).await;
    }
    let m = &server.maria;
    m.sql(
        "SELECT CONCAT('KILL ', MIN(ID)) INTO @k FROM information_schema.PROCESSLIST \
         WHERE COMMAND LIKE 'Binlog Dump%'; EXECUTE IMMEDIATE @k",
    );
    m.sql("INSERT INTO msrc_restart.events VALUES (1000, -2), (1001, -2)");
    converge(m, &replica, &[("msrc_restart.events", &["id", "at"])]).await;

    // A second GTID domain, and Sluice restarted with a position in both.
    m.sql(
        "SET SESSION gtid_domain_id = 5; INSERT INTO msrc_restart.events VALUES (2000, 5); \
         INSERT INTO msrc_restart.events VALUES (2001, 5)",
    );
    converge(m, &replica, &[("msrc_restart.events", &["id", "at"])]).await;
    sluice.restart().await;
    m.sql("INSERT INTO msrc_restart.events VALUES (2002, 0); SET SESSION gtid_domain_id = 5; INSERT INTO msrc_restart.events VALUES (2003, 5)");
    converge(m, &replica, &[("msrc_restart.events", &["id", "at"])]).await;
    let r = replica.lock().unwrap().clone();
    assert_eq!(inserts_into(&r, "events"), 3000 + 500 + 40 + 2 + 4, "every row exactly once");
    let last = r.commits.last().unwrap();
    let (lexi, pos) = last.split_once('.').unwrap();
    let sum: u64 = pos.split(',').map(|g| g.rsplit('-').next().unwrap().parse::<u64>().unwrap()).sum();
    assert!(pos.starts_with("0-1-") && pos.contains(",5-1-"), "{last}: both domains");
    assert_eq!(sluice::watermark::from_lexi(lexi), Some(sum as u128), "{last}: the counter sums the domains");
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    sluice.spec().assert_whole().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_is_told_apart_from_a_quiet_one() {
    init_logs();
    let server = mariadb::Server::start(&[]);
    let m = &server.maria;
    m.database("msrc_quiet");
    m.sql("CREATE TABLE msrc_quiet.t (id int PRIMARY KEY); INSERT INTO msrc_quiet.t VALUES (1)");
    let sluice = start_sluice(m.config(&["msrc_quiet"])).await;
    let replica = sluice.subscribe().await;
    converge(m, &replica, &[("msrc_quiet.t", &["id"])]).await;
    // Quiet for several heartbeat periods (500 ms): still running.
    let st = sluice.status.clone();
    let quiet_until = std::time::Instant::now() + Duration::from_secs(4);
    while std::time::Instant::now() < quiet_until {
        assert!(matches!(st.snapshot().source, sluice::status::SourceState::Running), "{:?}", st.snapshot().source);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Frozen: no heartbeats, and the stream is given up with the reason.
    server.freeze(true);
    wait_until("the missed heartbeats to be noticed", WAIT, || {
        let s = st.snapshot();
        async move {
            matches!(&s.source, sluice::status::SourceState::BackingOff { last_error, .. }
                if last_error.contains("no binlog event or heartbeat"))
        }
    })
    .await;
    server.freeze(false);
    m.sql("INSERT INTO msrc_quiet.t VALUES (2)");
    converge(m, &replica, &[("msrc_quiet.t", &["id"])]).await;
    assert_eq!(inserts_into(&replica.lock().unwrap(), "t"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_binlog_requires_a_reset_with_the_reason() {
    init_logs();
    let server = mariadb::Server::start(&[]);
    let m = &server.maria;
    m.database("msrc_purge");
    m.sql("CREATE TABLE msrc_purge.t (id int PRIMARY KEY); INSERT INTO msrc_purge.t VALUES (1)");
    let mut sluice = start_sluice(m.config(&["msrc_purge"])).await;
    let replica = sluice.subscribe().await;
    converge(m, &replica, &[("msrc_purge.t", &["id"])]).await;
    sluice.stop().await.unwrap();
    // What Sluice has not read yet goes with the purged files.
    m.sql("INSERT INTO msrc_purge.t VALUES (2); FLUSH BINARY LOGS; INSERT INTO msrc_purge.t VALUES (3); FLUSH BINARY LOGS");
    // The server keeps a file until its binlog checkpoint has passed it:
    // purge until only the newest remains.
    wait_until("the older binlogs to be purged", WAIT, || {
        let logs = m.sql("SHOW BINARY LOGS");
        let newest = logs.lines().last().unwrap().split('\t').next().unwrap().to_string();
        m.sql(&format!("PURGE BINARY LOGS TO '{newest}'"));
        let left = m.sql("SHOW BINARY LOGS").lines().count();
        async move { left == 1 }
    })
    .await;
    sluice.run().await;
    let reason = sluice.wait_for_reset().await;
    assert!(reason.contains("cannot continue from GTID"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_up_errors_are_clear() {
    init_logs();
    let registry = Arc::new(Registry::load(&plugin_dir(), None).await.unwrap());
    let open = |config: Value| {
        let registry = &registry;
        async move {
            let config = config.to_string();
            let grant = sluice::plugin::net::grant_for(&config, &[]).unwrap();
            let mut source = registry.source("mariadb-source", config, SandboxLimits::default(), grant).await.unwrap();
            sluice::source::ChangeSource::open(&mut source, None).await.err().map(|e| e.to_string())
        }
    };
    // A server without the settings a row-based reader needs.
    let server = mariadb::Server::start(&["--binlog-format=MIXED", "--binlog-row-metadata=MINIMAL"]);
    server.maria.database("msrc_setup");
    let err = open(server.maria.config(&["msrc_setup"])).await.expect("refused");
    assert!(err.contains("binlog_format is MIXED, not ROW (SET GLOBAL binlog_format=ROW)"), "{err}");
    assert!(err.contains("binlog_row_metadata is MINIMAL, not FULL"), "{err}");
    drop(server);

    let m = mariadb::shared();
    m.database("msrc_setup");
    let mut wrong = m.config(&["msrc_setup"]);
    wrong["password"] = json!("wrong");
    let err = open(wrong).await.expect("refused");
    assert!(err.contains("refused the login") && err.contains("Access denied"), "{err}");
    let mut nothing = m.config(&[]);
    nothing.as_object_mut().unwrap().remove("databases");
    let err = open(nothing).await.expect("refused");
    assert!(err.contains("name the `databases`"), "{err}");
    let mut unknown = m.config(&["msrc_setup"]);
    unknown["colour"] = json!("blue");
    let err = open(unknown).await.expect("refused");
    assert!(err.contains("unknown field `colour`"), "{err}");
    // Nothing listens: a transient error naming the address.
    let mut closed = m.config(&["msrc_setup"]);
    closed["port"] = json!(std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let err = open(closed).await.expect("refused");
    assert!(err.contains("cannot reach MariaDB at 127.0.0.1:"), "{err}");
}

/// TLS: a server that accepts only secure transport, with a certificate the
/// test made. The plugin has no TLS stack: it asks the host for a tunnel
/// (the contract's `tls` interface), sends MariaDB's SSL request itself,
/// and the host does the handshake and checks the certificate with
/// `tls_ca`. The snapshot and live rows arrive, over TLS connections the
/// server counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_done_by_the_host_through_the_contracts_tunnel() {
    init_logs();
    let pki = common::pki::Pki::new();
    // Files the server's user can read.
    let files = tempfile::Builder::new().prefix("sluice-mariadb-tls").tempdir().unwrap();
    for name in ["ca.crt", "server.crt", "server.key"] {
        std::fs::copy(pki.path(name), files.path().join(name)).unwrap();
    }
    let _ = std::process::Command::new("chmod").args(["-R", "a+rX"]).arg(files.path()).status();
    let arg = |flag: &str, name: &str| format!("--{flag}={}", files.path().join(name).display());
    let server = mariadb::Server::start(&[
        &arg("ssl-ca", "ca.crt"),
        &arg("ssl-cert", "server.crt"),
        &arg("ssl-key", "server.key"),
        "--require-secure-transport=ON",
    ]);
    let m = &server.maria;
    m.database("msrc_tls");
    m.sql("CREATE TABLE msrc_tls.t (id int PRIMARY KEY, note text); INSERT INTO msrc_tls.t VALUES (1, 'a'), (2, 'b')");
    let mut config = m.config(&["msrc_tls"]);
    config["tls"] = json!(true);
    config["tls_ca"] = json!(pki.path("ca.crt").display().to_string());
    let sluice = start_sluice(config).await;
    let replica = sluice.subscribe().await;
    converge(m, &replica, &[("msrc_tls.t", &["id", "note"])]).await;
    m.sql("INSERT INTO msrc_tls.t VALUES (3, 'live'); UPDATE msrc_tls.t SET note = 'changed' WHERE id = 1");
    converge(m, &replica, &[("msrc_tls.t", &["id", "note"])]).await;
    let accepted: u64 =
        m.sql("SHOW GLOBAL STATUS LIKE 'Ssl_accepts'").split_whitespace().last().unwrap().parse().unwrap();
    assert!(accepted >= 2, "the server accepted {accepted} TLS connections");
}
