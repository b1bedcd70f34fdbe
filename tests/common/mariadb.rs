//! MariaDB for the mariadb-source tests: the shared server that
//! tests/mariadb/with-mariadb.sh starts (`SLUICE_TEST_MARIADB`), private
//! servers for tests that restart or misconfigure one, and SQL through
//! MariaDB's own command-line client (not the plugin's client under test).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The user the plugin logs in as, with the grants a binlog reader needs.
pub const USER: &str = "cdc";
pub const PASSWORD: &str = "cdc-secret";

/// A server reachable as root over its socket and as [`USER`] over TCP.
pub struct Maria {
    pub host: String,
    pub port: u16,
    pub socket: String,
}

/// The shared server.
pub fn shared() -> Maria {
    let addr = std::env::var("SLUICE_TEST_MARIADB").unwrap_or_else(|_| {
        panic!(
            "this test needs MariaDB: run it through `make test` (which starts a private server), \
             or `tests/mariadb/with-mariadb.sh cargo test ...`"
        )
    });
    let socket = std::env::var("SLUICE_TEST_MARIADB_SOCKET").expect("SLUICE_TEST_MARIADB_SOCKET");
    let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
    let m = Maria { host: host.to_string(), port: port.parse().expect("a port"), socket };
    m.create_user();
    m
}

impl Maria {
    /// Runs SQL as root; panics with the server's message on failure.
    pub fn sql(&self, sql: &str) -> String {
        self.try_sql(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub fn try_sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new("mariadb")
            .args([
                "--no-defaults",
                "--default-character-set=utf8mb4",
                "-S",
                &self.socket,
                "-u",
                "root",
                "-N",
                "-B",
                "--raw",
            ])
            .args(["-e", sql])
            .output()
            .map_err(|e| format!("running mariadb: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    fn create_user(&self) {
        self.sql(&format!(
            "CREATE USER IF NOT EXISTS '{USER}'@'127.0.0.1' IDENTIFIED VIA mysql_native_password \
             USING PASSWORD('{PASSWORD}'); \
             GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO '{USER}'@'127.0.0.1'"
        ));
    }

    /// A fresh database of the test's own.
    pub fn database(&self, name: &str) {
        self.sql(&format!("DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}"));
    }

    /// The plugin configuration for capturing `databases`.
    pub fn config(&self, databases: &[&str]) -> serde_json::Value {
        serde_json::json!({
            "host": self.host, "port": self.port, "user": USER, "password": PASSWORD,
            "databases": databases, "heartbeat_ms": 500,
        })
    }

    /// A writer: one client session over the root socket, fed statement by
    /// statement (autocommit), inserting 1-4 rows per transaction into
    /// `db.events` a few milliseconds apart, with ids from `first` on and
    /// `row(id)` as each row's values, until `stop`. `written` follows the
    /// next id to write; the thread returns it once its session has ended,
    /// when everything it sent has committed.
    pub fn writer(
        &self,
        db: &str,
        first: u64,
        row: fn(u64) -> String,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        written: std::sync::Arc<std::sync::atomic::AtomicU64>,
        seed: u64,
    ) -> std::thread::JoinHandle<u64> {
        use std::sync::atomic::Ordering;
        let (socket, db) = (self.socket.clone(), db.to_string());
        std::thread::spawn(move || {
            use std::io::Write;
            let mut rng = super::process::Rng(seed);
            let mut child = Command::new("mariadb")
                .args(["--no-defaults", "-S", &socket, "-u", "root", &db])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            let mut input = child.stdin.take().unwrap();
            let mut next = first;
            while !stop.load(Ordering::Relaxed) {
                let n = rng.range(1, 5);
                let rows: Vec<String> = (next..next + n).map(row).collect();
                writeln!(input, "INSERT INTO events VALUES {};", rows.join(", ")).unwrap();
                input.flush().unwrap();
                next += n;
                written.store(next, Ordering::Release);
                std::thread::sleep(Duration::from_millis(rng.range(1, 6)));
            }
            drop(input);
            assert!(child.wait().unwrap().success(), "the writer's session failed");
            next
        })
    }

    /// Each row of `SELECT JSON_OBJECT(...)` as JSON, keyed like the
    /// replica keys its rows (by the first column named, the primary key).
    pub fn rows(&self, table: &str, columns: &[&str]) -> std::collections::BTreeMap<String, serde_json::Value> {
        let pairs: Vec<String> = columns.iter().map(|c| format!("'{c}', `{c}`")).collect();
        let out = self.sql(&format!("SELECT JSON_OBJECT({}) FROM {table}", pairs.join(", ")));
        out.lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
                (super::replica::key_of(&v, &[columns[0].to_string()]), v)
            })
            .collect()
    }
}

/// A private server (its own data directory and port), for tests that stop
/// and restart it or start it with other settings.
pub struct Server {
    dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<Child>,
    pub maria: Maria,
}

fn as_mysql(cmd: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "mysql", "--", cmd]);
        c
    } else {
        Command::new(cmd)
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false)
}

fn binary() -> PathBuf {
    for p in ["/usr/sbin/mariadbd", "/usr/bin/mariadbd"] {
        if std::path::Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from("mariadbd")
}

impl Server {
    /// Starts a server with the binlog settings a reader needs, plus
    /// `extra` server options (later options win).
    pub fn start(extra: &[&str]) -> Server {
        let dir = tempfile::Builder::new().prefix("sluice-mariadb-").tempdir().unwrap();
        let root = is_root();
        if root {
            Command::new("chown").args(["mysql", dir.path().to_str().unwrap()]).status().unwrap();
        }
        let data = dir.path().join("data");
        // Its own temporary directory: servers bootstrapping side by side in
        // one shared /tmp have collided on temporary table files.
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        if root {
            Command::new("chown").args(["mysql", tmp.to_str().unwrap()]).status().unwrap();
        }
        let user = if root {
            "mysql".to_string()
        } else {
            String::from_utf8_lossy(&Command::new("id").arg("-un").output().unwrap().stdout).trim().to_string()
        };
        let out = as_mysql("mariadb-install-db")
            .args(["--no-defaults", &format!("--datadir={}", data.display()), &format!("--user={user}")])
            .arg(format!("--tmpdir={}", tmp.display()))
            .args(["--auth-root-authentication-method=socket", "--skip-test-db"])
            .output()
            .unwrap();
        assert!(out.status.success(), "mariadb-install-db: {}", String::from_utf8_lossy(&out.stderr));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let socket = dir.path().join("mysqld.sock").display().to_string();
        let mut args = vec![
            "--no-defaults".to_string(),
            format!("--datadir={}", data.display()),
            format!("--tmpdir={}", tmp.display()),
            format!("--socket={socket}"),
            format!("--pid-file={}", dir.path().join("mysqld.pid").display()),
            format!("--log-error={}", dir.path().join("server.log").display()),
            format!("--port={port}"),
            "--bind-address=127.0.0.1".into(),
            "--skip-name-resolve".into(),
            "--server-id=1".into(),
            format!("--log-bin={}", data.join("binlog").display()),
            "--binlog-format=ROW".into(),
            "--binlog-row-image=FULL".into(),
            "--binlog-row-metadata=FULL".into(),
            "--innodb-buffer-pool-size=32M".into(),
            "--innodb-flush-log-at-trx-commit=2".into(),
            "--sync-binlog=0".into(),
            "--character-set-server=utf8mb4".into(),
            "--collation-server=utf8mb4_general_ci".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut s = Server { dir, args, child: None, maria: Maria { host: "127.0.0.1".into(), port, socket } };
        s.run();
        s.maria.create_user();
        s
    }

    fn run(&mut self) {
        let child = as_mysql(binary().to_str().unwrap())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.maria.try_sql("SELECT 1").is_err() {
            assert!(Instant::now() < deadline, "mariadbd did not start: {}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Stops the server: `kill` sends SIGKILL (a crash), otherwise a clean
    /// shutdown.
    pub fn stop(&mut self, kill: bool) {
        self.wake_runuser();
        if let Some(mut c) = self.child.take() {
            if kill {
                let pid = std::fs::read_to_string(self.dir.path().join("mysqld.pid")).unwrap_or_default();
                let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            } else {
                let _ = self.maria.try_sql("SHUTDOWN");
            }
            let _ = c.wait();
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: a server that
    /// neither answers nor closes connections.
    pub fn freeze(&self, on: bool) {
        let pid = std::fs::read_to_string(self.dir.path().join("mysqld.pid")).unwrap_or_default();
        let _ = Command::new("kill").args([if on { "-STOP" } else { "-CONT" }, pid.trim()]).status();
        if !on {
            // runuser stops itself when its child stops; wake it too.
            self.wake_runuser();
        }
    }

    fn wake_runuser(&self) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").args(["-CONT", &c.id().to_string()]).status();
        }
    }

    pub fn restart(&mut self, kill: bool) {
        self.stop(kill);
        self.run();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop(true);
    }
}
