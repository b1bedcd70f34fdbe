//! mariadb-source: MariaDB's row-based binary log as a Sluice source.
//!
//! `open` checks the server's settings, then either takes an initial
//! snapshot (a consistent-snapshot transaction whose binlog position becomes
//! the GTID position the stream starts from) or resumes from the GTID
//! position carried in the last durable watermark. The stream is a binlog
//! dump by GTID (`@mariadb_slave_capability=4`): a GTID event opens a
//! transaction, XID or COMMIT closes it, rows events carry the row images,
//! QUERY events carry DDL.
//!
//! Watermarks are `LEXI.GTIDS`: a LexiVersion of the GTID sequence number
//! (with more than one replication domain, the sum of the domains' sequence
//! numbers, and never less than one more than the previous watermark's, so
//! watermarks sort in commit order whatever the domains) and the GTID
//! position after that transaction, which is what `@slave_connect_state`
//! takes to resume right after it.
//!
//! Modules: `wire` (packets), `client` (handshake, auth, queries),
//! `binlog` (events), `types` (column values), `ddl` (statements to schema
//! changes), `tables` (relations and schemas the stream declared),
//! `snapshot` and `replication` (the two phases of a stream).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

pub mod binlog;
pub mod client;
pub mod ddl;
pub mod lag;
mod replication;
mod snapshot;
mod tables;
pub mod types;
pub mod wire;

use client::{Client, ClientError};
pub use sluice_plugin_sdk::types::Value;
use sluice_plugin_sdk::types::{Message, PluginError};
use sluice_plugin_sdk::{Progress, Resume, Source};

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
    pub user: String,
    #[serde(default)]
    pub password: String,
    /// Databases to capture, every table in them.
    #[serde(default)]
    pub databases: Vec<String>,
    /// Or single tables, as `db.table`.
    #[serde(default)]
    pub tables: Vec<String>,
    /// The replica server id Sluice registers with (unique among the
    /// server's replicas).
    #[serde(default = "default_server_id")]
    pub server_id: u32,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// How often the server sends a heartbeat on a quiet binlog; three
    /// missed heartbeats end the connection (and the host reconnects).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_ms: u64,
    /// Snapshot rows per `next-batch` call at most.
    #[serde(default = "default_snapshot_batch")]
    pub snapshot_batch_rows: u32,
    /// TLS to the server, through the host's tunnel (the contract's `tls`
    /// interface): the plugin upgrades inside the protocol, the host does
    /// the handshake and checks the certificate (`tls_ca`, read by the
    /// host, else the system's CAs).
    #[serde(default)]
    pub tls: bool,
    #[serde(default)]
    pub tls_ca: Option<String>,
}

fn default_port() -> u16 {
    3306
}
fn default_server_id() -> u32 {
    5_381_001
}
fn default_connect_timeout() -> u64 {
    3000
}
fn default_heartbeat() -> u64 {
    1000
}
fn default_snapshot_batch() -> u32 {
    2000
}

impl Config {
    pub fn parse(text: &str) -> Result<Config, PluginError> {
        let c: Config = serde_json::from_str(text)
            .map_err(|e| PluginError::InvalidConfig(format!("mariadb-source config: {e}")))?;
        if c.databases.is_empty() && c.tables.is_empty() {
            return Err(PluginError::InvalidConfig(
                "mariadb-source config: name the `databases` (or `tables`, as db.table) to capture".into(),
            ));
        }
        if let Some(bad) = c.tables.iter().find(|t| t.split('.').count() != 2) {
            return Err(PluginError::InvalidConfig(format!("mariadb-source config: table {bad:?} is not db.table")));
        }
        if c.server_id == 0 {
            return Err(PluginError::InvalidConfig("mariadb-source config: server_id must not be 0".into()));
        }
        Ok(c)
    }

    pub fn captures(&self, db: &str, table: &str) -> bool {
        self.databases.iter().any(|d| d == db)
            || self.tables.iter().any(|t| t.split_once('.').is_some_and(|(d, n)| d == db && n == table))
    }

    pub fn captures_db(&self, db: &str) -> bool {
        self.databases.iter().any(|d| d == db)
            || self.tables.iter().any(|t| t.split_once('.').is_some_and(|(d, _)| d == db))
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.max(100))
    }

    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Connects and authenticates; a refused password is a configuration
    /// error (retrying will not help), anything else transient.
    pub fn connect(&self) -> Result<Client, PluginError> {
        Client::connect(&self.host, self.port, &self.user, &self.password, self.timeout(), self.tls).map_err(
            |e| match e {
                ClientError::Server { code: client::ACCESS_DENIED, message } => {
                    PluginError::InvalidConfig(format!("MariaDB at {} refused the login: {message}", self.endpoint()))
                }
                e => PluginError::Transient(format!("cannot reach MariaDB at {}: {e}", self.endpoint())),
            },
        )
    }
}

/// A GTID position: the last sequence number per replication domain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GtidPos(pub BTreeMap<u32, (u32, u64)>);

impl GtidPos {
    pub fn parse(s: &str) -> Result<GtidPos, String> {
        let mut m = BTreeMap::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let f: Vec<&str> = part.split('-').collect();
            let bad = || format!("{part:?} is not a GTID (domain-server-seq)");
            if f.len() != 3 {
                return Err(bad());
            }
            let d = f[0].parse().map_err(|_| bad())?;
            let sv = f[1].parse().map_err(|_| bad())?;
            let n = f[2].parse().map_err(|_| bad())?;
            m.insert(d, (sv, n));
        }
        Ok(GtidPos(m))
    }

    pub fn set(&mut self, domain: u32, server: u32, seq: u64) {
        self.0.insert(domain, (server, seq));
    }

    /// The sum of the sequence numbers: grows with every transaction in any
    /// domain, and is the sequence number itself with one domain.
    pub fn seq_sum(&self) -> u64 {
        self.0.values().fold(0u64, |a, (_, n)| a.saturating_add(*n))
    }
}

impl std::fmt::Display for GtidPos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for (d, (s, n)) in &self.0 {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{d}-{s}-{n}")?;
        }
        Ok(())
    }
}

/// Zero's LexiVersion of a counter.
pub fn to_lexi(n: u64) -> String {
    sluice_plugin_sdk::watermark::to_lexi(n.into())
}

pub fn from_lexi(s: &str) -> Option<u64> {
    sluice_plugin_sdk::watermark::from_lexi(s).and_then(|n| u64::try_from(n).ok())
}

/// A watermark: the counter, then the GTID position after the transaction.
pub fn watermark(counter: u64, pos: &GtidPos) -> String {
    format!("{}.{pos}", to_lexi(counter))
}

pub fn parse_watermark(w: &str) -> Option<(u64, GtidPos)> {
    let (n, pos) = w.split_once('.')?;
    Some((from_lexi(n)?, GtidPos::parse(pos).ok()?))
}

/// Checks the settings a row-based binlog reader depends on: each missing
/// one is a clear error that says how to set it.
pub fn check_server(c: &mut Client, endpoint: &str) -> Result<(), PluginError> {
    let rows = c
        .query("SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata")
        .map_err(|e| PluginError::Transient(format!("MariaDB at {endpoint}: reading the binlog settings: {e}")))?;
    let row: Vec<String> = rows
        .into_iter()
        .next()
        .unwrap_or_default()
        .into_iter()
        .map(|v| v.map(client::text).unwrap_or_default())
        .collect();
    let get = |i: usize| row.get(i).map(String::as_str).unwrap_or("");
    let mut problems = Vec::new();
    if get(0) != "1" {
        problems.push("the binary log is off (start the server with log_bin)".to_string());
    }
    if !get(1).eq_ignore_ascii_case("ROW") {
        problems.push(format!("binlog_format is {}, not ROW (SET GLOBAL binlog_format=ROW)", get(1)));
    }
    if !get(2).eq_ignore_ascii_case("FULL") {
        problems.push(format!("binlog_row_image is {}, not FULL (SET GLOBAL binlog_row_image=FULL)", get(2)));
    }
    if !get(3).eq_ignore_ascii_case("FULL") {
        problems.push(format!(
            "binlog_row_metadata is {}, not FULL (SET GLOBAL binlog_row_metadata=FULL; MariaDB 10.5 or later)",
            if get(3).is_empty() { "missing" } else { get(3) }
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(PluginError::Fatal(format!(
            "MariaDB at {endpoint} cannot be read as a row-based binlog: {}",
            problems.join("; ")
        )))
    }
}

enum Phase {
    Snapshot(Box<snapshot::Snapshot>),
    Replicating(Box<replication::Replication>),
    /// After reset-required: nothing more from this stream.
    Done(String),
}

/// The plugin's stream: the snapshot, then the binlog.
pub struct Stream {
    config: Config,
    phase: Phase,
    /// An error met after part of a batch was converted: reported next call.
    deferred: Option<PluginError>,
    /// Asks the server how much binlog there is (`progress`).
    monitor: lag::Monitor,
}

impl Source for Stream {
    fn open(config: &str, resume: Option<Resume>) -> Result<Stream, PluginError> {
        let config = Config::parse(config)?;
        let phase = match resume {
            None => Phase::Snapshot(snapshot::Snapshot::start(&config)?),
            Some(r) => {
                let (counter, pos) = parse_watermark(&r.watermark).ok_or_else(|| {
                    PluginError::Fatal(format!(
                        "the change log's watermark {:?} is not a mariadb-source watermark (LEXI.GTID)",
                        r.watermark
                    ))
                })?;
                Phase::Replicating(replication::Replication::start(
                    &config,
                    r.replica_version,
                    counter,
                    pos,
                    tables::Tables::default(),
                )?)
            }
        };
        Ok(Stream { config, phase, deferred: None, monitor: lag::Monitor::default() })
    }

    fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, PluginError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let max = max.max(1) as usize;
        let mut out = Vec::new();
        let result = match &mut self.phase {
            Phase::Snapshot(s) => match s.next_batch(&self.config, max, &mut out) {
                Ok(Some(next)) => {
                    self.phase = Phase::Replicating(next);
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            },
            Phase::Replicating(r) => r.next_batch(&self.config, max, &mut out),
            Phase::Done(_) => Ok(()),
        };
        if matches!(&self.phase, Phase::Replicating(r) if r.ended) {
            let rv = self.replica_version();
            self.phase = Phase::Done(rv);
        }
        match result {
            Ok(()) => Ok(out),
            Err(e) if out.is_empty() => Err(e),
            Err(e) => {
                self.deferred = Some(e);
                Ok(out)
            }
        }
    }

    fn replica_version(&self) -> String {
        match &self.phase {
            Phase::Snapshot(s) => s.replica_version.clone(),
            Phase::Replicating(r) => r.replica_version.clone(),
            Phase::Done(rv) => rv.clone(),
        }
    }

    /// MariaDB keeps its binlog by its own retention settings
    /// (binlog_expire_logs_seconds); there is nothing to release.
    fn ack(&mut self, _watermark: &str) -> Result<(), PluginError> {
        Ok(())
    }

    /// The binlog position gap (while the snapshot runs: the binlog written
    /// since its position), and the snapshot's row estimate.
    fn progress(&mut self) -> Progress {
        let (read, snapshot_rows_estimate) = match &self.phase {
            Phase::Snapshot(s) => (&s.binlog, s.rows_estimate),
            Phase::Replicating(r) => (&r.read, None),
            Phase::Done(_) => return Progress { behind_bytes: None, snapshot_rows_estimate: None },
        };
        Progress { behind_bytes: self.monitor.measure(&self.config, read), snapshot_rows_estimate }
    }
}

/// The binlog reader built natively, for `sluice-bench`: streams from the
/// GTID position `pos` through the same client, decoder and conversion the
/// plugin runs, until `rows` row changes came out; returns the time taken.
pub fn stream_natively(config: &str, pos: &str, rows: u64) -> Result<Duration, String> {
    let text = |e: PluginError| format!("{e:?}");
    let config = Config::parse(config).map_err(text)?;
    let pos = GtidPos::parse(pos)?;
    let started = std::time::Instant::now();
    let mut stream =
        replication::Replication::start(&config, String::new(), 0, pos, tables::Tables::default()).map_err(text)?;
    let (mut seen, mut out) = (0u64, Vec::new());
    while seen < rows {
        if started.elapsed() > Duration::from_secs(300) {
            return Err(format!("only {seen} of {rows} row changes in 300 s"));
        }
        out.clear();
        stream.next_batch(&config, 512, &mut out).map_err(text)?;
        seen += out.iter().filter(|m| matches!(m, Message::Insert(_) | Message::Update(_) | Message::Delete(_))).count()
            as u64;
    }
    Ok(started.elapsed())
}

// Natively (unit tests, the decoder benchmark) the crate is a plain library.
#[cfg(target_arch = "wasm32")]
sluice_plugin_sdk::export_source!(Stream);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_sort_by_counter_and_carry_the_gtid_position() {
        let mut pos = GtidPos::parse("0-1-118,2-7-5").unwrap();
        assert_eq!(pos.to_string(), "0-1-118,2-7-5");
        let a = watermark(35, &pos);
        pos.set(0, 1, 119);
        let b = watermark(36, &pos);
        assert!(a < b, "{a} < {b}");
        assert_eq!(parse_watermark(&b), Some((36, pos)));
        assert_eq!(parse_watermark(&watermark(7, &GtidPos::default())), Some((7, GtidPos::default())));
        assert_eq!(from_lexi(&to_lexi(u64::MAX)), Some(u64::MAX));
        assert!(GtidPos::parse("0-1").is_err());
    }
}
