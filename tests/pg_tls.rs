//! TLS to PostgreSQL, against a private server that accepts only TLS over
//! TCP, with a CA and certificates made by the test (`common::pki`):
//! replication, the Postgres change DB and catch-up from it all over TLS with
//! channel binding; `require`, `verify-ca`, `verify-full` and client
//! certificates; certificates that do not verify refused with one line that
//! says what to change, before anything is stored; and passwords that appear
//! in no log line and no `/status`.

#[macro_use]
mod common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::pgserver::PgServer;
use common::pki::Pki;
use common::process::{free_addr, sluice, status};
use common::replica::{follow, key_of};
use sluice::pgconn::{self, PgTarget};

const WAIT: Duration = Duration::from_secs(60);
const PASSWORD: &str = "tls-Secret-8127";

fn tls_url(server: &PgServer, user: &str, params: &str) -> String {
    format!("postgres://{user}@127.0.0.1:{}/postgres?{params}", server.port)
}

async fn client(url: &str) -> Result<pgconn::PgClient, String> {
    let target = PgTarget::parse(url)?;
    pgconn::connect(&target, &target.config).await.map_err(|e| pgconn::explain(e.text(), &target))
}

/// The server, with the roles the tests use.
async fn tls_server(pki: &Pki) -> (PgServer, pgconn::PgClient) {
    let server = PgServer::start_tls(pki);
    let ca = pki.path("ca.crt");
    let admin = client(&tls_url(&server, "postgres", &format!("sslmode=verify-full&sslrootcert={}", ca.display())))
        .await
        .unwrap();
    admin
        .batch_execute(&format!(
            "CREATE ROLE sluice_scram LOGIN SUPERUSER REPLICATION PASSWORD '{PASSWORD}';
             CREATE ROLE sluice_cert LOGIN;"
        ))
        .await
        .unwrap();
    (server, admin)
}

fn spawn(args: &[String], log: &std::path::Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    sluice().args(args).stdout(Stdio::null()).stderr(out).spawn().unwrap()
}

/// Waits for a child to exit by itself; its exit status and log.
fn exit_of(mut child: Child, log: &std::path::Path) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, std::fs::read_to_string(log).unwrap());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("sluice did not stop; its log:\n{}", std::fs::read_to_string(log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Postgres source (SCRAM with channel binding required, verify-full)
/// and the Postgres change DB (the keyword form, verify-ca) on the TLS-only
/// server: the snapshot and live changes are stored; a subscriber from the
/// start catches up from the change DB and follows live; every connection
/// is encrypted; the password is in no log line and not in `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_change_db_and_catch_up_over_tls() {
    let pki = Pki::new();
    let (server, admin) = tls_server(&pki).await;
    admin.batch_execute("CREATE TABLE items (id int PRIMARY KEY, name text)").await.unwrap();
    admin.batch_execute("INSERT INTO items SELECT i, 'row ' || i FROM generate_series(1, 200) i").await.unwrap();

    let ca = pki.path("ca.crt");
    let source_url = format!(
        "postgres://sluice_scram:{PASSWORD}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}&channel_binding=require",
        server.port,
        ca.display()
    );
    let change_db = format!(
        "host=127.0.0.1 port={} dbname=postgres user=sluice_scram password={PASSWORD} sslmode=verify-ca \
         sslrootcert='{}' channel_binding=require",
        server.port,
        ca.display()
    );
    let config = serde_json::json!({ "url": source_url, "slot": "tls_slot" }).to_string();
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let log = dir.path().join("sluice.log");
    let args: Vec<String> =
        ["run", "--source", "postgres", "--source-config", &config, "--change-db", &change_db, "--listen", &addr]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut child = spawn(&args, &log);

    let deadline = Instant::now() + WAIT;
    let replica_version = loop {
        if let Some(v) = status(&addr).and_then(|s| s["replicaVersion"].as_str().map(str::to_string)) {
            break v;
        }
        assert!(child.try_wait().unwrap().is_none(), "sluice exited: {}", std::fs::read_to_string(&log).unwrap());
        assert!(Instant::now() < deadline, "no replica version: {}", std::fs::read_to_string(&log).unwrap());
        std::thread::sleep(Duration::from_millis(50));
    };
    admin.batch_execute("INSERT INTO items SELECT i, 'live ' || i FROM generate_series(201, 300) i").await.unwrap();
    admin.batch_execute("UPDATE items SET name = 'changed' WHERE id <= 10").await.unwrap();

    // From the start: the snapshot is read back from the change DB (catch-up), then live.
    let replica = follow(&addr, &replica_version).await;
    let admin = &admin;
    common::replica::converge(&replica, &["public.items"], WAIT, |_| async move {
        let rows = admin.query("SELECT to_jsonb(t)::text FROM items t", &[]).await.unwrap();
        rows.iter()
            .map(|r| {
                let v: serde_json::Value = serde_json::from_str(r.get::<_, &str>(0)).unwrap();
                (key_of(&v, &["id".to_string()]), v)
            })
            .collect()
    })
    .await;

    // Every connection Sluice holds is encrypted: the walsender, the source's
    // and the change DB's.
    let rows = admin
        .query(
            "SELECT a.backend_type, a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'sluice_scram'",
            &[],
        )
        .await
        .unwrap();
    let connections: Vec<(String, String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert!(connections.iter().any(|(t, _, _)| t == "walsender"), "no walsender among {connections:?}");
    assert!(connections.iter().any(|(_, a, _)| a == "zero-change-streamer"), "no change DB session: {connections:?}");
    assert!(connections.iter().all(|(_, _, ssl)| *ssl), "a plain connection: {connections:?}");

    let status_text = common::process::http_get(&addr, "/status").unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert!(!status_text.contains(PASSWORD), "the password is in /status: {status_text}");
    assert!(!log_text.contains(PASSWORD), "the password is in the log:\n{log_text}");
    assert!(log_text.contains("sluice_scram@127.0.0.1"), "the log names the change DB without secrets:\n{log_text}");
}

/// A server certificate that does not verify stops Sluice with one line that
/// says what to change, and nothing is created upstream or stored: a CA that
/// did not sign it (source and change DB), and a host name it does not list
/// (verify-full; verify-ca accepts the same connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_that_do_not_verify_are_refused() {
    let pki = Pki::new();
    let (server, admin) = tls_server(&pki).await;
    let ca = pki.path("ca.crt").display().to_string();
    let wrong = pki.path("wrong-ca.crt").display().to_string();
    let localhost = format!("postgres://postgres@localhost:{}/postgres", server.port);
    let cases = [
        (
            tls_url(&server, "postgres", &format!("sslmode=verify-full&sslrootcert={wrong}")),
            None,
            "is not signed by the CA in sslrootcert",
        ),
        (format!("{localhost}?sslmode=verify-full&sslrootcert={ca}"), None, "does not name the host localhost"),
        (
            tls_url(&server, "postgres", &format!("sslmode=verify-full&sslrootcert={ca}")),
            Some(tls_url(&server, "postgres", &format!("sslmode=verify-ca&sslrootcert={wrong}"))),
            "is not signed by the CA in sslrootcert",
        ),
    ];
    for (i, (source_url, change_db, expected)) in cases.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sluice.log");
        let config = serde_json::json!({ "url": source_url, "slot": format!("refused_{i}") }).to_string();
        let sqlite = format!("sqlite:{}", dir.path().join("log.db").display());
        let change_db = change_db.clone().unwrap_or(sqlite);
        let args: Vec<String> = [
            "run",
            "--source",
            "postgres",
            "--source-config",
            &config,
            "--change-db",
            &change_db,
            "--listen",
            &free_addr(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let started = Instant::now();
        let (exit, text) = exit_of(spawn(&args, &log), &log);
        assert!(!exit.success(), "case {i}: sluice exited 0:\n{text}");
        assert!(started.elapsed() < Duration::from_secs(30), "case {i}: retried instead of stopping:\n{text}");
        let errors: Vec<&str> = text.lines().filter(|l| l.contains(expected)).collect();
        assert!(!errors.is_empty(), "case {i}: no line says {expected:?}:\n{text}");
        let slots: i64 = admin.query_one("SELECT count(*) FROM pg_replication_slots", &[]).await.unwrap().get(0);
        assert_eq!(slots, 0, "case {i}: a slot was created:\n{text}");
        if change_db.starts_with("sqlite:") && dir.path().join("log.db").exists() {
            let db = rusqlite::Connection::open(dir.path().join("log.db")).unwrap();
            let stored: i64 =
                db.query_row("SELECT count(*) FROM sqlite_master WHERE name = 'changeLog'", [], |r| r.get(0))
                    .and_then(|n: i64| {
                        if n == 0 {
                            Ok(0)
                        } else {
                            db.query_row("SELECT count(*) FROM changeLog", [], |r| r.get(0))
                        }
                    })
                    .unwrap();
            assert_eq!(stored, 0, "case {i}: changes were stored");
        }
    }
    // The same host name passes verify-ca: only the chain is checked.
    let c = client(&format!("{localhost}?sslmode=verify-ca&sslrootcert={ca}")).await.unwrap();
    let ssl: bool = c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get(0);
    assert!(ssl);
}

/// `require` encrypts without a CA; a client certificate logs in where
/// pg_hba asks for `cert`, and its absence is refused; a plain server
/// refuses `require` with a line that says so, and serves `prefer` in the
/// clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_client_certificates_and_plain_servers() {
    let pki = Pki::new();
    let (server, _admin) = tls_server(&pki).await;
    let ssl_of = |c: pgconn::PgClient| async move {
        c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get::<_, bool>(0)
    };
    assert!(ssl_of(client(&tls_url(&server, "postgres", "sslmode=require")).await.unwrap()).await);
    // The default (prefer) takes TLS where offered.
    assert!(ssl_of(client(&tls_url(&server, "postgres", "")).await.unwrap()).await);
    // Without TLS the server has no entry for us, and the line says what to change.
    let e = client(&tls_url(&server, "postgres", "sslmode=disable")).await.unwrap_err();
    assert!(e.contains("use sslmode=require"), "{e}");

    let cert = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        pki.path("ca.crt").display(),
        pki.path("client.crt").display(),
        pki.path("client.key").display()
    );
    let c = client(&tls_url(&server, "sluice_cert", &cert)).await.unwrap();
    let who: String = c.query_one("SELECT current_user::text", &[]).await.unwrap().get(0);
    assert_eq!(who, "sluice_cert");
    let e = client(&tls_url(&server, "sluice_cert", "sslmode=require")).await.unwrap_err();
    assert!(e.contains("certificate"), "{e}");

    // The shared test server has no TLS.
    let plain = common::pg_url();
    let sep = if plain.contains('?') { '&' } else { '?' };
    let e = client(&format!("{plain}{sep}sslmode=require")).await.unwrap_err();
    assert!(e.contains("does not accept TLS"), "{e}");
    assert!(!ssl_of(client(&format!("{plain}{sep}sslmode=prefer")).await.unwrap()).await);
}
