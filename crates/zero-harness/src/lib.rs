//! A real zero-cache 1.9.0 (from the `@rocicorp/zero` npm package that
//! `make interop-deps` installs into tests/interop), with Sluice as its
//! custom upstream or with a Postgres upstream of its own, and Zero's own
//! client (`tests/interop/zero-client.mjs`) querying it. Used by
//! `tests/zero_cache.rs` and by `make bench`.
//!
//! zero-cache's CVR and change databases are fresh databases on a
//! PostgreSQL server the caller names; its replica file and log go in the
//! caller's directory.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Whether `make interop-deps` has installed `@rocicorp/zero`.
pub fn installed() -> bool {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/node_modules/@rocicorp/zero/package.json").exists()
}

pub fn interop_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop");
    assert!(
        dir.join("node_modules/@rocicorp/zero/package.json").exists(),
        "@rocicorp/zero is not installed in {}: run `make interop-deps` (make test does)",
        dir.display()
    );
    dir
}

/// Runs one SQL statement with psql, panicking on failure.
pub fn psql(url: &str, sql: &str) {
    let out = Command::new("psql").args(["-qAt", "-v", "ON_ERROR_STOP=1", url, "-c", sql]).output().unwrap();
    assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The single value a query returns, with psql.
pub fn psql_value(url: &str, sql: &str) -> String {
    let out = Command::new("psql").args(["-qAt", "-v", "ON_ERROR_STOP=1", url, "-c", sql]).output().unwrap();
    assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim_end().to_string()
}

/// A new, empty database `name` on the server at `server` (a superuser
/// URL); its URL.
pub fn fresh_database(server: &str, name: &str) -> String {
    psql(server, &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
    psql(server, &format!("CREATE DATABASE {name}"));
    database_url(server, name)
}

/// The URL of database `name` on the server at `server`.
pub fn database_url(server: &str, name: &str) -> String {
    format!("{}/{name}", server.rsplit_once('/').map_or(server, |(base, _)| base))
}

/// The replica file of zero-cache `name` started in `dir`.
pub fn replica_file(name: &str, dir: &Path) -> PathBuf {
    dir.join(format!("{name}-replica.db"))
}

/// Where a zero-cache replicates from.
#[derive(Clone, Debug)]
pub enum Upstream {
    /// Zero's custom change-source protocol at Sluice's address (HOST:PORT).
    Sluice(String),
    /// zero-cache's own Postgres change source, on this database URL.
    Postgres(String),
    /// A view-syncer on `streamer`; `upstream` is the Postgres database its
    /// mutations go to. Its replica file must already be synced
    /// ([`bootstrap_replica`]).
    ViewSyncer { streamer: Streamer, upstream: String },
}

/// How a view-syncer finds its change-streamer.
#[derive(Clone, Debug)]
pub enum Streamer {
    /// `ZERO_CHANGE_STREAMER_URI` at Sluice's address (HOST:PORT).
    Uri(String),
    /// `ZERO_CHANGE_STREAMER_MODE=discover`: the address Sluice records in
    /// its Postgres change DB, which is then also the view-syncer's
    /// `ZERO_CHANGE_DB`.
    Discover { change_db: String },
}

/// Writes a synced replica file for a view-syncer on Sluice at `sluice`
/// with `tools/zero-replica.mjs`; returns what it printed
/// (`{"replicaVersion", "watermark"}`).
pub fn bootstrap_replica(sluice: &str, file: &Path) -> Value {
    bootstrap_replica_with_token(sluice, file, None)
}

/// [`bootstrap_replica`] by the tool's route `via` (`bulk`, its default, or
/// `initial-sync`, zero-cache's own custom-source initial sync).
pub fn bootstrap_replica_via(sluice: &str, file: &Path, via: &str) -> Value {
    checked(run_zero_replica_with(sluice, file, None, &["--via", via]))
}

/// Runs `tools/zero-replica.mjs` with `token` in `SLUICE_TOKEN` (as an
/// operator is told to pass it: never on the command line); returns what
/// the process did.
pub fn run_zero_replica(sluice: &str, file: &Path, token: Option<&str>) -> std::process::Output {
    run_zero_replica_with(sluice, file, token, &[])
}

fn run_zero_replica_with(sluice: &str, file: &Path, token: Option<&str>, extra: &[&str]) -> std::process::Output {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/zero-replica.mjs");
    let mut command = Command::new("node");
    command.arg(tool).args(["--sluice", sluice, "--file"]).arg(file).args(extra).current_dir(interop_dir());
    command.env_remove("SLUICE_TOKEN");
    if let Some(token) = token {
        command.env("SLUICE_TOKEN", token);
    }
    command.output().expect("node is installed")
}

/// [`bootstrap_replica`] for a Sluice that requires `token`.
pub fn bootstrap_replica_with_token(sluice: &str, file: &Path, token: Option<&str>) -> Value {
    checked(run_zero_replica(sluice, file, token))
}

/// Writes `file` as a copy of the replica `kept` that [`KeptReplica`]
/// keeps (`tools/zero-replica.mjs --from`); returns what it printed
/// (`{"replicaVersion", "watermark", "copiedFrom"}`).
pub fn copy_kept_replica(sluice: &str, kept: &Path, file: &Path) -> Value {
    checked(run_copy_kept_replica(sluice, kept, file))
}

/// Runs `tools/zero-replica.mjs --from kept`; returns what the process did.
pub fn run_copy_kept_replica(sluice: &str, kept: &Path, file: &Path) -> std::process::Output {
    let kept = kept.to_str().expect("a UTF-8 path");
    run_zero_replica_with(sluice, file, None, &["--from", kept])
}

/// `tools/zero-replica.mjs --keep`: a replica file written from Sluice and
/// kept current with it until dropped (SIGTERM).
pub struct KeptReplica {
    child: Child,
    file: PathBuf,
}

impl KeptReplica {
    /// Starts the keeper on `file` and waits until the file is synced
    /// (the tool prints its position); panics with its stderr if it exits.
    pub fn start(sluice: &str, file: &Path) -> KeptReplica {
        let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/zero-replica.mjs");
        let stderr = std::fs::File::create(file.with_extension("keeper.log")).expect("a log file");
        let mut child = Command::new("node")
            .arg(tool)
            .args(["--sluice", sluice, "--keep", "--file"])
            .arg(file)
            .current_dir(interop_dir())
            .env_remove("SLUICE_TOKEN")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .expect("node is installed");
        let mut line = String::new();
        let read = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
        let kept = KeptReplica { child, file: file.to_path_buf() };
        if !matches!(read, Ok(n) if n > 0) {
            panic!("the keeper of {} printed nothing:\n{}", file.display(), kept.log_text());
        }
        kept
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.file.with_extension("keeper.log")).unwrap_or_default()
    }

    /// The watermark the kept file holds now (zero-cache's replication state).
    pub fn watermark(&self) -> String {
        let state = replica_rows(&self.file, "_zero.replicationState", "stateVersion");
        state.first().and_then(|s| s["stateVersion"].as_str()).expect("the kept replica has a replication state").into()
    }

    pub fn file(&self) -> &Path {
        &self.file
    }

    /// SIGKILLs the keeper (and its worker thread with it).
    pub fn kill(mut self) {
        signal_group(&self.child, "-KILL");
        let _ = self.child.wait();
    }

    /// Stops the keeper with SIGTERM; returns how it exited.
    pub fn stop(mut self) -> std::process::ExitStatus {
        stop_group(&mut self.child, Duration::from_secs(10));
        self.child.wait().expect("the keeper was started")
    }
}

impl Drop for KeptReplica {
    fn drop(&mut self) {
        stop_group(&mut self.child, Duration::from_secs(10));
    }
}

/// What a successful `tools/zero-replica.mjs` printed.
fn checked(out: std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "tools/zero-replica.mjs failed ({}):\n{}",
        out.status,
        tail(&String::from_utf8_lossy(&out.stderr), 4000)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("zero-replica printed {:?}: {e}", out.stdout))
}

/// A port for zero-cache (`ZERO_PORT`) with the two after it free as well
/// (its change streamer listens on +1, litestream on +2), picked at random
/// below the kernel's ephemeral range. Every other server in the tests binds
/// port 0 and gets an ephemeral one, so none of them can take these between
/// this check and zero-cache's listen (seen once as `EADDRINUSE` on +1 when
/// the pair came from the ephemeral range).
fn free_port_pair() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.saturating_sub(3).max(10_001));
    let seed = std::collections::hash_map::RandomState::new();
    for attempt in 0u64.. {
        let mut h = seed.build_hasher();
        h.write_u64(attempt);
        let port = low + (h.finish() % u64::from(high - low)) as u16;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 1) && free(port + 2) {
            return port;
        }
    }
    unreachable!("the loop above returns")
}

/// A task ID for one zero-cache process. zero-cache makes one with nanoid
/// when none is given, and passes it to its workers as an argument: one
/// starting with `-` (1 in 64) is read as a flag and the worker exits with
/// "Expected string at taskID. Got true". This one starts with the name.
fn task_id(name: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

/// The rows of `table` in the replica `file`, ordered by `key`, without
/// zero-cache's bookkeeping columns.
pub fn replica_rows(file: &Path, table: &str, key: &str) -> Vec<Value> {
    let out = Command::new("node")
        .arg(interop_dir().join("replica-rows.mjs"))
        .arg(file)
        .args([table, key])
        .output()
        .expect("node is installed");
    assert!(out.status.success(), "reading the replica: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("replica-rows prints JSON");
    v["rows"].as_array().cloned().unwrap_or_default()
}

/// Kills a process group started with `process_group(0)`: SIGTERM, and
/// SIGKILL if it has not exited within `grace`.
fn stop_group(child: &mut Child, grace: Duration) {
    signal_group(child, "-TERM");
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Also the workers zero-cache forked, should one outlive its parent.
    signal_group(child, "-KILL");
    let _ = child.wait();
}

/// Sends `signal` (`-TERM`, `-KILL`) to the process group `child` leads.
fn signal_group(child: &Child, signal: &str) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args([signal, "--", &group]).stderr(Stdio::null()).status();
}

/// A running zero-cache.
pub struct ZeroCache {
    child: Child,
    launch: Launch,
}

/// What a zero-cache is started with, kept for its restarts.
struct Launch {
    name: String,
    port: u16,
    replica: PathBuf,
    log: PathBuf,
    upstream: Upstream,
    server: String,
}

impl Launch {
    fn spawn(&self) -> Child {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut command = Command::new("node");
        command.arg(interop_dir().join("node_modules/@rocicorp/zero/out/zero/src/cli.js")).current_dir(interop_dir());
        match &self.upstream {
            Upstream::Sluice(addr) => {
                command
                    .env("ZERO_UPSTREAM_TYPE", "custom")
                    .env("ZERO_UPSTREAM_DB", format!("ws://{addr}/changes/v0/stream"));
            }
            Upstream::Postgres(url) => {
                command.env("ZERO_UPSTREAM_TYPE", "pg").env("ZERO_UPSTREAM_DB", url);
            }
            Upstream::ViewSyncer { streamer, upstream } => {
                command.env("ZERO_UPSTREAM_DB", upstream);
                match streamer {
                    Streamer::Uri(sluice) => command.env("ZERO_CHANGE_STREAMER_URI", format!("http://{sluice}/")),
                    Streamer::Discover { .. } => command.env("ZERO_CHANGE_STREAMER_MODE", "discover"),
                };
            }
        }
        let change_db = match &self.upstream {
            Upstream::ViewSyncer { streamer: Streamer::Discover { change_db }, .. } => change_db.clone(),
            _ => database_url(&self.server, &format!("{}_change", self.name)),
        };
        command
            .env("ZERO_CVR_DB", database_url(&self.server, &format!("{}_cvr", self.name)))
            .env("ZERO_CHANGE_DB", change_db)
            .env("ZERO_REPLICA_FILE", &self.replica)
            .env("ZERO_PORT", self.port.to_string())
            .env("ZERO_TASK_ID", task_id(&self.name))
            .env("ZERO_NUM_SYNC_WORKERS", "1")
            .env("ZERO_ADMIN_PASSWORD", "sluice-test")
            .env("ZERO_LOG_LEVEL", "info")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("node is installed")
    }
}

impl ZeroCache {
    /// Starts zero-cache `name` (which also names its CVR and change
    /// databases, made fresh on `server`) on `upstream`, with its replica
    /// file in `dir`, and waits until it is ready, which includes its
    /// initial sync.
    pub fn start(name: &str, upstream: Upstream, server: &str, dir: &Path) -> ZeroCache {
        fresh_database(server, &format!("{name}_cvr"));
        fresh_database(server, &format!("{name}_change"));
        let launch = Launch {
            name: name.to_string(),
            port: free_port_pair(),
            replica: replica_file(name, dir),
            log: dir.join(format!("{name}.log")),
            upstream,
            server: server.to_string(),
        };
        std::fs::write(&launch.log, "").unwrap();
        let mut zc = ZeroCache { child: launch.spawn(), launch };
        zc.wait_for_log("zero-cache ready", Duration::from_secs(600));
        zc
    }

    pub fn name(&self) -> &str {
        &self.launch.name
    }

    /// Its replica file.
    pub fn replica(&self) -> &Path {
        &self.launch.replica
    }

    /// Starts it again after it exited (as an orchestrator would), with
    /// its databases, replica file and ports, and waits until it is ready.
    pub fn restart(&mut self) {
        stop_group(&mut self.child, Duration::from_secs(10));
        let before = self.log_text().len();
        self.child = self.launch.spawn();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.log_text().get(before..).unwrap_or("").contains("zero-cache ready") {
            let exited = self.child.try_wait().unwrap();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "zero-cache {} did not get ready again ({exited:?}); its log ends:\n{}",
                self.launch.name,
                tail(&self.log_text(), 40000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the process exits on its own; its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "zero-cache {} is still running; its log ends:\n{}",
                self.launch.name,
                tail(&self.log_text(), 40000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn server(&self) -> String {
        format!("http://127.0.0.1:{}", self.launch.port)
    }

    /// Where its change-streamer listens (HOST:PORT, the port after its own).
    pub fn change_streamer(&self) -> String {
        format!("127.0.0.1:{}", self.launch.port + 1)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.launch.log).unwrap_or_default()
    }

    /// Waits until zero-cache's log contains `line`; fails with the log's
    /// end if it exits or the time runs out.
    pub fn wait_for_log(&mut self, line: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log_text();
            if log.contains(line) {
                return;
            }
            let exited = self.child.try_wait().unwrap();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "zero-cache {} did not log {line:?} ({}); its log ends:\n{}",
                self.launch.name,
                exited.map_or("timed out".to_string(), |s| format!("exited: {s}")),
                tail(&log, 40000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One table of its replica file, ordered by `key`, as zero-cache
    /// stored it (integers as strings, so they compare exactly).
    pub fn replica_rows(&self, table: &str, key: &str) -> Vec<Value> {
        replica_rows(&self.launch.replica, table, key)
    }
}

impl Drop for ZeroCache {
    fn drop(&mut self) {
        stop_group(&mut self.child, Duration::from_secs(10));
    }
}

fn tail(text: &str, n: usize) -> &str {
    let mut start = text.len().saturating_sub(n);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// Zero's own client, querying one table through a zero-cache.
pub struct ZeroClient {
    child: Child,
    lines: mpsc::Receiver<String>,
    latest: Vec<Value>,
}

impl ZeroClient {
    /// `columns`: `[(name, "string" | "number" | "boolean" | "json")]`, the
    /// primary key first.
    pub fn start(zero_cache: &ZeroCache, table: &str, columns: &[(&str, &str)]) -> ZeroClient {
        Self::spawn(zero_cache, table, columns, None)
    }

    /// Like [`ZeroClient::start`], and the client inserts `row` with Zero's
    /// CRUD mutator (zero-cache writes it to its upstream Postgres).
    pub fn start_inserting(zero_cache: &ZeroCache, table: &str, columns: &[(&str, &str)], row: &Value) -> ZeroClient {
        Self::spawn(zero_cache, table, columns, Some(row))
    }

    fn spawn(zero_cache: &ZeroCache, table: &str, columns: &[(&str, &str)], insert: Option<&Value>) -> ZeroClient {
        let key = columns[0].0.to_string();
        let columns: serde_json::Map<String, Value> =
            columns.iter().map(|(c, t)| (c.to_string(), Value::from(*t))).collect();
        let mut child = Command::new("node")
            .arg(interop_dir().join("zero-client.mjs"))
            .args([&zero_cache.server(), table, &key, &Value::Object(columns).to_string()])
            .args(insert.map(|row| row.to_string()))
            .current_dir(interop_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .expect("node is installed");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ZeroClient { child, lines, latest: Vec::new() }
    }

    /// Waits until the rows the client shows satisfy `done`; returns them.
    pub fn wait_rows(&mut self, what: &str, timeout: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if done(&self.latest) {
                return self.latest.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("client line {line}: {e}"));
                    self.latest = v["rows"].as_array().cloned().unwrap_or_default();
                }
                Err(_) => panic!(
                    "the Zero client never showed {what}; its last rows: {}",
                    serde_json::to_string(&self.latest).unwrap()
                ),
            }
        }
    }
}

impl Drop for ZeroClient {
    fn drop(&mut self) {
        stop_group(&mut self.child, Duration::from_secs(5));
    }
}
