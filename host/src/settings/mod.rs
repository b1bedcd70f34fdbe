//! `sluice run`'s settings, typed, from one layering: the command line,
//! then `SLUICE_*` variables, then a TOML file (`--config`), then the
//! defaults (see [`layers`]). Everything `run` builds is decided from a
//! [`Settings`]: `Service::build` takes one.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::storage::open::{ChangeDb, LogStore, StoreOptions};
use crate::storage::sqlite::Durability;

pub mod layers;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// For people.
    Text,
    /// One object per line, for a log collector.
    Json,
}

/// Which change log: shared by `run` and `sluice log`.
#[derive(clap::Args, Debug, Clone)]
pub struct ChangeLogArgs {
    /// Where the change log lives: `sqlite:PATH` (default), a path, or a
    /// PostgreSQL connection string, URL or `key=value` (Zero's change DB
    /// schema; libpq's sslmode, sslrootcert, sslcert, sslkey).
    #[arg(long, default_value = "sqlite:sluice-data/changelog.db", env = "SLUICE_CHANGE_DB", hide_env_values = true, value_parser = ChangeDb::parse)]
    pub change_db: ChangeDb,
    /// Zero app ID: the Postgres change DB schema is "<app-id>_<shard-num>/cdc".
    #[arg(long, default_value = "zero", env = "SLUICE_APP_ID", value_parser = app_id)]
    pub app_id: String,
    #[arg(long, default_value_t = 0, env = "SLUICE_SHARD_NUM")]
    pub shard_num: u32,
}

impl ChangeLogArgs {
    /// The store, as an admin command opens it (`sluice run` adds its own
    /// options through [`Settings::log_store`]).
    pub fn store(&self) -> LogStore {
        self.change_db.store(&StoreOptions {
            app_id: self.app_id.clone(),
            shard_num: self.shard_num,
            application_name: "sluice-admin".into(),
            ..StoreOptions::default()
        })
    }
}

/// A bearer token, given directly or in a file.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TokenArgs {
    /// The endpoint's token: `run` requires it of subscribers and zero-caches,
    /// admin commands present it (see docs/security.md). Prefer --token-file
    /// or the variable, which `ps` does not show.
    #[arg(long = "token", env = "SLUICE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the token (its first line).
    #[arg(long = "token-file", env = "SLUICE_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The token from `--token` or the first line of `--token-file`.
    pub fn read(&self) -> anyhow::Result<Option<String>> {
        let token = match (&self.token, &self.token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(file)) => Some(
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading --token-file {}", file.display()))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            ),
            (None, None) => None,
        };
        anyhow::ensure!(token.as_ref().is_none_or(|t| !t.is_empty()), "the token is empty (--token / --token-file)");
        Ok(token)
    }
}

/// `--source-config`: JSON text, or `@FILE` to read it from a file. The
/// JSON is checked by [`check_source_config`], whose error does not repeat
/// the text (it may hold a password).
pub fn source_config(arg: &str) -> Result<String, String> {
    match arg.strip_prefix('@') {
        Some(file) => std::fs::read_to_string(file).map_err(|e| format!("reading {file}: {e}")),
        None => Ok(arg.to_string()),
    }
}

/// Whether the source's configuration is JSON.
pub fn check_source_config(text: &str) -> anyhow::Result<()> {
    serde_json::from_str::<serde_json::Value>(text).context("--source-config is not valid JSON")?;
    Ok(())
}

/// `--app-id`: it names a Postgres schema, so only what needs no quoting.
fn app_id(arg: &str) -> Result<String, String> {
    if arg.is_empty() || !arg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return Err("only lower-case letters, digits and _ are allowed".into());
    }
    Ok(arg.to_string())
}

/// `sluice run`: what to replicate, where to keep it, how to serve it.
#[derive(clap::Args, Debug, Clone)]
pub struct Settings {
    /// Directory of plugin components (`*.wasm`).
    /// Default: `target/plugins` in a checkout, else `../lib/sluice/plugins`
    /// or `plugins` beside the binary, whichever exists.
    #[arg(long, env = "SLUICE_PLUGINS")]
    pub plugins: Option<PathBuf>,
    /// The source: `postgres` (built in) or the name of a source plugin (its file stem).
    #[arg(long, env = "SLUICE_SOURCE")]
    pub source: String,
    /// The source's configuration: JSON text, or @FILE to read it from a file.
    /// In a `--config` file it may also be a TOML table (`[source-config]`).
    #[arg(long, default_value = "{}", env = "SLUICE_SOURCE_CONFIG", hide_env_values = true, value_parser = source_config)]
    pub source_config: String,
    #[command(flatten)]
    pub change_log: ChangeLogArgs,
    /// Address for the HTTP/WebSocket endpoint.
    #[arg(long, default_value = "127.0.0.1:4849", env = "SLUICE_LISTEN")]
    pub listen: String,
    /// This host's identity as the change log's owner.
    #[arg(long, default_value = "sluice", env = "SLUICE_TASK_ID")]
    pub task_id: String,
    /// The address subscribers should dial (defaults to the listen address).
    #[arg(long, env = "SLUICE_ADVERTISE")]
    pub advertise: Option<String>,
    /// On `reset-required` from the upstream, wipe the change log and start a
    /// new lineage instead of only reporting it.
    #[arg(long, env = "SLUICE_AUTO_RESET")]
    pub auto_reset: bool,
    /// Keep the compacted table state beside the change log: the
    /// latest row of every key, updated in the same commit as the log, so a
    /// consumer can start from the current data even after a purge. Costs
    /// write throughput (see docs/benchmarks.md); starts with the next
    /// lineage.
    #[arg(long, env = "SLUICE_TABLE_STATE")]
    pub table_state: bool,
    /// Zero's permissions (compiled rules, a JSON object `{"tables": ...}`)
    /// for the `<app>.permissions` row Sluice serves a zero-cache whose
    /// upstream lacks Zero's tables. Without it the row holds NULL
    /// permissions, which zero-cache treats as no rules: clients' ad-hoc
    /// queries see no rows (see docs/zero-cache.md).
    #[arg(long, env = "SLUICE_ZERO_PERMISSIONS")]
    pub zero_permissions: Option<PathBuf>,
    /// Seconds a zero-cache's position in the change log is kept after it
    /// disconnects (and from the start of its initial sync), so it can
    /// resume after a restart; later it must sync again.
    #[arg(long, default_value_t = 600, env = "SLUICE_CONSUMER_RETENTION_SECS")]
    pub consumer_retention_secs: u64,
    /// Seconds a change-streamer subscriber's last ack still holds the change
    /// log after it disconnects, so a replica reconnecting after a dropped
    /// link or a restart resumes instead of finding its position purged.
    #[arg(long, default_value_t = 30, env = "SLUICE_SUBSCRIBER_RETENTION_SECS")]
    pub subscriber_retention_secs: u64,
    /// SQLite durability: `full` (default; commits survive power loss) or
    /// `normal` (commits survive a crash of Sluice, not of the machine).
    #[arg(long, value_enum, default_value = "full", env = "SLUICE_SYNC")]
    pub sync: Durability,
    /// Longest one call into a plugin may run, in milliseconds.
    #[arg(long, default_value_t = 5000, env = "SLUICE_PLUGIN_DEADLINE_MS")]
    pub plugin_deadline_ms: u64,
    /// Memory cap of one plugin instance, in MiB.
    #[arg(long, default_value_t = 256, env = "SLUICE_PLUGIN_MEMORY_MB")]
    pub plugin_memory_mb: usize,
    /// Longest one call into a subscriber filter may run, in milliseconds.
    #[arg(long, default_value_t = 1000, env = "SLUICE_FILTER_DEADLINE_MS")]
    pub filter_deadline_ms: u64,
    /// Memory cap of one filter instance, in MiB.
    #[arg(long, default_value_t = 64, env = "SLUICE_FILTER_MEMORY_MB")]
    pub filter_memory_mb: usize,
    /// Let the source plugin connect to HOST:PORT (repeatable), besides the
    /// upstream its config names (`url`, or `host` and `port`), which it may
    /// always reach. Nothing else is reachable.
    #[arg(long = "allow-net", env = "SLUICE_ALLOW_NET", value_delimiter = ',')]
    pub allow_net: Vec<String>,
    /// Compiled-plugin cache directory (default: `.cache` inside the data directory).
    #[arg(long, env = "SLUICE_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Bytes of changes that may wait for storage before the source is paused, in MiB.
    #[arg(long, default_value_t = 32, env = "SLUICE_QUEUE_BUDGET_MB")]
    pub queue_budget_mb: usize,
    /// Seconds between purges of the change log.
    #[arg(long, default_value_t = 30, env = "SLUICE_PURGE_INTERVAL_SECS")]
    pub purge_interval_secs: u64,
    /// Always keep at least the newest N transactions.
    #[arg(long, env = "SLUICE_RETAIN_TRANSACTIONS")]
    pub retain_transactions: Option<u64>,
    /// Always keep the transactions stored within the last N seconds.
    #[arg(long, env = "SLUICE_RETAIN_SECS")]
    pub retain_secs: Option<u64>,
    /// Close a subscriber that lags continuously for this long (0: never).
    #[arg(long, default_value_t = 30, env = "SLUICE_LAG_GRACE_SECS")]
    pub lag_grace_secs: u64,
    /// Postgres change DB statement timeout, in milliseconds.
    #[arg(long, default_value_t = 20000, env = "SLUICE_STATEMENT_TIMEOUT_MS")]
    pub statement_timeout_ms: u64,
    /// The longest a Postgres change DB call may wait for an answer, in
    /// milliseconds, before its connection is given up as dead and opened
    /// again (a silent network path). A transaction the server sees left
    /// idle for twice this long is ended by the server, so a standby can
    /// take over from a host that vanished.
    #[arg(long, default_value_t = 10000, env = "SLUICE_CHANGE_DB_TIMEOUT_MS")]
    pub change_db_timeout_ms: u64,
    /// Catch-ups reading the Postgres change DB at once (each holds a
    /// connection); more wait for a place.
    #[arg(long, default_value_t = crate::storage::postgres::DEFAULT_MAX_SNAPSHOTS, env = "SLUICE_CHANGE_DB_READERS")]
    pub change_db_readers: usize,
    /// Live changes a catching-up subscriber may buffer, in MiB; past it
    /// they are let go and read from the log in a further catch-up.
    #[arg(long, default_value_t = 16, env = "SLUICE_BACKLOG_MB")]
    pub backlog_mb: usize,
    /// Memory budget for everything held for subscribers (queued frames,
    /// live backlogs, per-message bookkeeping), in MiB. Past it, subscribers
    /// holding more than their share are closed and catch up later.
    #[arg(long, default_value_t = 512, env = "SLUICE_SUBSCRIBER_MEMORY_MB")]
    pub subscriber_memory_mb: usize,
    /// Catch-up batch reads running at once (default: half the cores, at
    /// least one); catch-ups over the same part of the log share them.
    #[arg(long, env = "SLUICE_CATCHUP_READERS")]
    pub catchup_readers: Option<usize>,
    /// Each catch-up scans the log on its own instead of joining a scan
    /// already running (for comparing the two in benchmarks).
    #[arg(long, hide = true)]
    pub no_shared_catchup: bool,
    /// Serve subscribers over TLS with this certificate chain (PEM); read
    /// again on SIGHUP.
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Seconds a graceful shutdown (SIGTERM, SIGINT) may take before Sluice
    /// exits anyway.
    #[arg(long, default_value_t = 30, env = "SLUICE_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: u64,
    /// Seconds the source may back off before `GET /readyz` answers 503.
    #[arg(long, default_value_t = 30, env = "SLUICE_READY_BACKOFF_SECS")]
    pub ready_backoff_secs: u64,
    #[command(flatten)]
    pub token: TokenArgs,
    /// Most stream connections open at once (0: no cap).
    #[arg(long, default_value_t = 10_000, env = "SLUICE_MAX_CONNECTIONS")]
    pub max_connections: usize,
    /// Most stream connections open at once from one client address (0: no cap).
    #[arg(long, default_value_t = 0, env = "SLUICE_MAX_CONNECTIONS_PER_ADDRESS")]
    pub max_connections_per_address: usize,
    /// The filter plugins subscribers may use (repeatable; default: every
    /// filter in the plugin directory).
    #[arg(long = "allow-filter", env = "SLUICE_ALLOW_FILTER", value_delimiter = ',')]
    pub allow_filter: Option<Vec<String>>,
    /// The plugin directory is watched for files added, replaced or
    /// removed; it is also rescanned every N seconds, for filesystems
    /// whose changes are not reported (0: only when watched or on SIGHUP).
    #[arg(long, default_value_t = 30, env = "SLUICE_PLUGIN_RESCAN_SECS")]
    pub plugin_rescan_secs: u64,
}

impl Settings {
    /// The change log store `run` writes, with its options.
    pub fn log_store(&self) -> LogStore {
        let log = &self.change_log;
        log.change_db.store(&StoreOptions {
            app_id: log.app_id.clone(),
            shard_num: log.shard_num,
            task_id: self.task_id.clone(),
            durability: self.sync,
            statement_timeout: Duration::from_millis(self.statement_timeout_ms),
            call_timeout: Duration::from_millis(self.change_db_timeout_ms.max(1000)),
            readers: self.change_db_readers,
            // A host restarted beside its database must come up, not exit.
            wait_up_to: Duration::from_secs(600),
            ..StoreOptions::default()
        })
    }

    /// The plugin directory: `--plugins`, or where a checkout or an
    /// installation keeps it.
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugins.clone().unwrap_or_else(default_plugin_dir)
    }

    /// The compiled-plugin cache: `--cache-dir`, or `.cache` beside the log.
    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(|| self.change_log.change_db.data_dir().join(".cache"))
    }

    /// What the settings cannot say through their types alone.
    pub fn check(&self) -> anyhow::Result<()> {
        check_source_config(&self.source_config)?;
        if let Some(advertise) = &self.advertise {
            if let Ok(addr) = advertise.parse::<std::net::SocketAddr>() {
                anyhow::ensure!(
                    !addr.ip().is_unspecified(),
                    "--advertise {advertise}: subscribers cannot dial an unspecified address; give this host's name or IP"
                );
            }
        }
        Ok(())
    }
}

/// The plugin directory when none is given: the build tree's when run from
/// a checkout, else where an installation keeps it beside the binary
/// (`PREFIX/bin/sluice` with `PREFIX/lib/sluice/plugins`, or an unpacked
/// archive with `plugins/` next to the binary).
pub fn default_plugin_dir() -> PathBuf {
    let build_tree = PathBuf::from("target/plugins");
    let beside_binary = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.to_path_buf()));
    let installed = beside_binary.as_ref().map(|d| d.join("../lib/sluice/plugins"));
    let unpacked = beside_binary.as_ref().map(|d| d.join("plugins"));
    [Some(build_tree), installed.clone(), unpacked]
        .into_iter()
        .flatten()
        .find(|d| d.is_dir())
        .or(installed)
        .unwrap_or_else(|| PathBuf::from("target/plugins"))
}
