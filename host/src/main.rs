//! The `sluice` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use sluice::cleanup::CleanupOptions;
use sluice::pgconn::PgTarget;
use sluice::plugin::{NetGrant, Registry, SandboxLimits};
use sluice::service::{Service, ServiceConfig};
use sluice::source::postgres::PostgresSource;
use sluice::source::ChangeSource;
use sluice::storage::postgres::{PgSettings, PostgresChangeLog, PostgresReader};
use sluice::storage::sqlite::{Durability, SqliteChangeLog, SqliteReader};
use sluice::storer::StorerOptions;
use sluice::streamer::StreamerOptions;

/// `sluice --version`: the crate version, the git revision it was built
/// from, and the plugin contract (WIT) version it loads.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let (major, minor) = sluice::plugin::WIT_VERSION;
    format!(
        "{} (git {}, plugin WIT {}@{major}.{minor})",
        env!("CARGO_PKG_VERSION"),
        env!("SLUICE_GIT_REV"),
        sluice::plugin::WIT_PACKAGE
    )
});

#[derive(Parser)]
#[command(name = "sluice", version = VERSION.as_str(), about = "A pluggable change streamer that speaks Zero's change-streamer protocol")]
struct Cli {
    /// Log lines as `text` (for people) or `json` (one object per line, for
    /// a log collector).
    #[arg(long, global = true, default_value = "text", env = "SLUICE_LOG_FORMAT", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replicate from a source into the change log and serve subscribers.
    Run(Box<RunArgs>),
    /// Subscribe to a Sluice (or Zero change-streamer) and print the stream.
    Tail {
        /// `ws://HOST:PORT` of the server.
        url: String,
        /// Start after this watermark (default: the earliest the server has).
        #[arg(long)]
        watermark: Option<String>,
        /// The replica version (default: the server's).
        #[arg(long)]
        replica_version: Option<String>,
        /// Exit after this many commits.
        #[arg(long)]
        max_tx: Option<u64>,
        /// Print each message as raw JSON.
        #[arg(long)]
        json: bool,
        /// View the stream through a filter plugin: NAME or NAME=CONFIG_JSON
        /// (repeatable; applied in order).
        #[arg(long = "filter")]
        filters: Vec<String>,
    },
    /// Look at or reset the change log (no running Sluice needed).
    Log {
        #[command(subcommand)]
        command: LogCommand,
    },
    /// What the built-in Postgres source keeps in the upstream: status,
    /// dropping its slot, removing all it created.
    Postgres {
        #[command(subcommand)]
        command: PostgresCommand,
    },
    /// Ask a running Sluice whether it serves (`/healthz`) or, with
    /// `--ready`, should get traffic (`/readyz`); exit 0 if so, else 2.
    /// For container health checks, where there may be no curl.
    Health {
        #[command(flatten)]
        endpoint: EndpointArgs,
        #[arg(long)]
        ready: bool,
    },
    /// Make a running Sluice rescan its plugin directory now (as SIGHUP
    /// does), and print what changed.
    Reload(EndpointArgs),
    /// List the plugins in a directory and whether they load.
    Plugins {
        /// Default: as for `run`.
        #[arg(long, env = "SLUICE_PLUGINS")]
        plugins: Option<PathBuf>,
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum LogCommand {
    /// Lineage, owner, watermarks, size and per-table counts.
    Inspect {
        #[command(flatten)]
        log: LogArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete the change log: the next `sluice run` takes a new snapshot
    /// under a new lineage, and every subscriber syncs again.
    Reset {
        #[command(flatten)]
        log: LogArgs,
        /// Yes, delete it.
        #[arg(long)]
        yes: bool,
        /// Even though a Sluice answers at the owner address the log records.
        #[arg(long)]
        force: bool,
    },
}

/// Which change log: as for `run`.
#[derive(clap::Args)]
struct LogArgs {
    #[arg(long, default_value = "sqlite:sluice-data/changelog.db", env = "SLUICE_CHANGE_DB", hide_env_values = true)]
    change_db: String,
    #[arg(long, default_value = "zero", env = "SLUICE_APP_ID")]
    app_id: String,
    #[arg(long, default_value_t = 0, env = "SLUICE_SHARD_NUM")]
    shard_num: u32,
}

impl LogArgs {
    fn place(&self) -> anyhow::Result<sluice::admin::log::LogPlace> {
        Ok(match parse_change_db(&self.change_db)? {
            ChangeDb::Sqlite(path) => sluice::admin::log::LogPlace::Sqlite(path),
            ChangeDb::Postgres(target) => sluice::admin::log::LogPlace::Postgres {
                target,
                schema: format!("{}_{}/cdc", self.app_id, self.shard_num),
            },
        })
    }
}

#[derive(Subcommand)]
enum PostgresCommand {
    /// The slot (active or not, WAL it retains), publications, schema
    /// `_sluice` and the event trigger.
    Status {
        #[command(flatten)]
        source: SourceConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// Drop the replication slot (refused while a Sluice streams from it).
    DropSlot {
        #[command(flatten)]
        source: SourceConfigArg,
    },
    /// Remove the slot, the publication Sluice created, the event trigger
    /// and schema `_sluice` (kept while other slots use them).
    Uninstall {
        #[command(flatten)]
        source: SourceConfigArg,
        /// Yes, remove them.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(clap::Args)]
struct SourceConfigArg {
    /// The Postgres source's configuration as `run` takes it: JSON text or @FILE.
    #[arg(long, env = "SLUICE_SOURCE_CONFIG", hide_env_values = true)]
    source_config: String,
}

impl SourceConfigArg {
    fn upstream(&self) -> anyhow::Result<sluice::admin::postgres::Upstream> {
        sluice::admin::postgres::Upstream::from_config(&read_source_config(&self.source_config)?)
    }
}

/// How an admin command reaches a running Sluice.
#[derive(clap::Args)]
struct EndpointArgs {
    /// The endpoint: `http://HOST:PORT`, or `https://HOST:PORT` when it
    /// serves TLS.
    #[arg(long, default_value = "http://127.0.0.1:4849", env = "SLUICE_URL")]
    url: String,
    /// The endpoint's token, if it has one.
    #[arg(long, env = "SLUICE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the token (its first line).
    #[arg(long, env = "SLUICE_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// The CA certificate (PEM) of an `https` endpoint (default: the system's roots).
    #[arg(long)]
    ca: Option<PathBuf>,
}

impl EndpointArgs {
    fn endpoint(&self) -> anyhow::Result<sluice::admin::http::Endpoint> {
        Ok(sluice::admin::http::Endpoint {
            url: self.url.clone(),
            token: read_token(&self.token, &self.token_file)?,
            ca: self.ca.clone(),
        })
    }
}

/// The token from `--token` or the first line of `--token-file`.
fn read_token(token: &Option<String>, file: &Option<PathBuf>) -> anyhow::Result<Option<String>> {
    let token = match (token, file) {
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

#[derive(clap::Args)]
struct RunArgs {
    /// Directory of plugin components (`*.wasm`).
    /// Default: `target/plugins` in a checkout, else `../lib/sluice/plugins`
    /// or `plugins` beside the binary, whichever exists.
    #[arg(long, env = "SLUICE_PLUGINS")]
    plugins: Option<PathBuf>,
    /// The source: `postgres` (built in) or the name of a source plugin (its file stem).
    #[arg(long, env = "SLUICE_SOURCE")]
    source: String,
    /// The source's configuration: JSON text, or @FILE to read it from a file.
    #[arg(long, default_value = "{}", env = "SLUICE_SOURCE_CONFIG", hide_env_values = true)]
    source_config: String,
    /// Where the change log lives: `sqlite:PATH` (default), a path, or a
    /// PostgreSQL connection string, URL or `key=value` (Zero's change DB
    /// schema; libpq's sslmode, sslrootcert, sslcert, sslkey).
    #[arg(long, default_value = "sqlite:sluice-data/changelog.db", env = "SLUICE_CHANGE_DB", hide_env_values = true)]
    change_db: String,
    /// Address for the HTTP/WebSocket endpoint.
    #[arg(long, default_value = "127.0.0.1:4849", env = "SLUICE_LISTEN")]
    listen: String,
    /// This host's identity as the change log's owner.
    #[arg(long, default_value = "sluice", env = "SLUICE_TASK_ID")]
    task_id: String,
    /// The address subscribers should dial (defaults to the listen address).
    #[arg(long, env = "SLUICE_ADVERTISE")]
    advertise: Option<String>,
    /// On `reset-required` from the upstream, wipe the change log and start a
    /// new lineage instead of only reporting it.
    #[arg(long, env = "SLUICE_AUTO_RESET")]
    auto_reset: bool,
    /// Keep the compacted table state beside the change log: the
    /// latest row of every key, updated in the same commit as the log, so a
    /// consumer can start from the current data even after a purge. Costs
    /// write throughput (see docs/benchmarks.md); starts with the next
    /// lineage.
    #[arg(long, env = "SLUICE_TABLE_STATE")]
    table_state: bool,
    /// Zero's permissions (compiled rules, a JSON object `{"tables": ...}`)
    /// for the `<app>.permissions` row Sluice serves a zero-cache whose
    /// upstream lacks Zero's tables. Without it the row holds NULL
    /// permissions, which zero-cache treats as no rules: clients' ad-hoc
    /// queries see no rows (see docs/zero-cache.md).
    #[arg(long, env = "SLUICE_ZERO_PERMISSIONS")]
    zero_permissions: Option<PathBuf>,
    /// Seconds a zero-cache's position in the change log is kept after it
    /// disconnects (and from the start of its initial sync), so it can
    /// resume after a restart; later it must sync again.
    #[arg(long, default_value_t = 600, env = "SLUICE_CONSUMER_RETENTION_SECS")]
    consumer_retention_secs: u64,
    /// SQLite durability: `full` (default; commits survive power loss) or
    /// `normal` (commits survive a crash of Sluice, not of the machine).
    #[arg(long, default_value = "full", env = "SLUICE_SYNC")]
    sync: String,
    /// Longest one call into a plugin may run, in milliseconds.
    #[arg(long, default_value_t = 5000, env = "SLUICE_PLUGIN_DEADLINE_MS")]
    plugin_deadline_ms: u64,
    /// Memory cap of one plugin instance, in MiB.
    #[arg(long, default_value_t = 256, env = "SLUICE_PLUGIN_MEMORY_MB")]
    plugin_memory_mb: usize,
    /// Longest one call into a subscriber filter may run, in milliseconds.
    #[arg(long, default_value_t = 1000, env = "SLUICE_FILTER_DEADLINE_MS")]
    filter_deadline_ms: u64,
    /// Memory cap of one filter instance, in MiB.
    #[arg(long, default_value_t = 64, env = "SLUICE_FILTER_MEMORY_MB")]
    filter_memory_mb: usize,
    /// Let the source plugin connect to HOST:PORT (repeatable), besides the
    /// upstream its config names (`url`, or `host` and `port`), which it may
    /// always reach. Nothing else is reachable.
    #[arg(long = "allow-net", env = "SLUICE_ALLOW_NET", value_delimiter = ',')]
    allow_net: Vec<String>,
    /// Compiled-plugin cache directory (default: `.cache` inside the data directory).
    #[arg(long, env = "SLUICE_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Bytes of changes that may wait for storage before the source is paused, in MiB.
    #[arg(long, default_value_t = 32, env = "SLUICE_QUEUE_BUDGET_MB")]
    queue_budget_mb: usize,
    /// Seconds between purges of the change log.
    #[arg(long, default_value_t = 30, env = "SLUICE_PURGE_INTERVAL_SECS")]
    purge_interval_secs: u64,
    /// Always keep at least the newest N transactions.
    #[arg(long, env = "SLUICE_RETAIN_TRANSACTIONS")]
    retain_transactions: Option<u64>,
    /// Always keep the transactions stored within the last N seconds.
    #[arg(long, env = "SLUICE_RETAIN_SECS")]
    retain_secs: Option<u64>,
    /// Close a subscriber that lags continuously for this long (0: never).
    #[arg(long, default_value_t = 30, env = "SLUICE_LAG_GRACE_SECS")]
    lag_grace_secs: u64,
    /// Zero app ID: the Postgres change DB schema is "<app-id>_<shard-num>/cdc".
    #[arg(long, default_value = "zero", env = "SLUICE_APP_ID")]
    app_id: String,
    #[arg(long, default_value_t = 0, env = "SLUICE_SHARD_NUM")]
    shard_num: u32,
    /// Postgres change DB statement timeout, in milliseconds.
    #[arg(long, default_value_t = 20000, env = "SLUICE_STATEMENT_TIMEOUT_MS")]
    statement_timeout_ms: u64,
    /// The longest a Postgres change DB call may wait for an answer, in
    /// milliseconds, before its connection is given up as dead and opened
    /// again (a silent network path). A transaction the server sees left
    /// idle for twice this long is ended by the server, so a standby can
    /// take over from a host that vanished.
    #[arg(long, default_value_t = 10000, env = "SLUICE_CHANGE_DB_TIMEOUT_MS")]
    change_db_timeout_ms: u64,
    /// Catch-ups reading the Postgres change DB at once (each holds a
    /// connection); more wait for a place.
    #[arg(long, default_value_t = sluice::storage::postgres::DEFAULT_MAX_SNAPSHOTS, env = "SLUICE_CHANGE_DB_READERS")]
    change_db_readers: usize,
    /// Backlog a catching-up subscriber may accumulate, in MiB.
    #[arg(long, default_value_t = 16, env = "SLUICE_BACKLOG_MB")]
    backlog_mb: usize,
    /// Memory budget for everything held for subscribers (queued frames,
    /// live backlogs, per-message bookkeeping), in MiB. Past it, subscribers
    /// holding more than their share are closed and catch up later.
    #[arg(long, default_value_t = 512, env = "SLUICE_SUBSCRIBER_MEMORY_MB")]
    subscriber_memory_mb: usize,
    /// Catch-up batch reads running at once (default: half the cores, at
    /// least one); catch-ups over the same part of the log share them.
    #[arg(long, env = "SLUICE_CATCHUP_READERS")]
    catchup_readers: Option<usize>,
    /// Each catch-up scans the log on its own instead of joining a scan
    /// already running (for comparing the two in benchmarks).
    #[arg(long, hide = true)]
    no_shared_catchup: bool,
    /// Serve subscribers over TLS with this certificate chain (PEM); read
    /// again on SIGHUP.
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Seconds a graceful shutdown (SIGTERM, SIGINT) may take before Sluice
    /// exits anyway.
    #[arg(long, default_value_t = 30, env = "SLUICE_SHUTDOWN_TIMEOUT_SECS")]
    shutdown_timeout_secs: u64,
    /// Seconds the source may back off before `GET /readyz` answers 503.
    #[arg(long, default_value_t = 30, env = "SLUICE_READY_BACKOFF_SECS")]
    ready_backoff_secs: u64,
    /// A TOML file of settings, named as the flags are (`listen = "..."`,
    /// `allow-filter = ["redact"]`). Flags and `SLUICE_*` variables win over it.
    #[arg(long, env = "SLUICE_CONFIG")]
    config: Option<PathBuf>,
    /// Subscribers and zero-caches must present this token (see
    /// docs/security.md); prefer --token-file or the variable, which `ps`
    /// does not show.
    #[arg(long, env = "SLUICE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the token (its first line).
    #[arg(long, env = "SLUICE_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// Most stream connections open at once (0: no cap).
    #[arg(long, default_value_t = 10_000, env = "SLUICE_MAX_CONNECTIONS")]
    max_connections: usize,
    /// Most stream connections open at once from one client address (0: no cap).
    #[arg(long, default_value_t = 0, env = "SLUICE_MAX_CONNECTIONS_PER_ADDRESS")]
    max_connections_per_address: usize,
    /// The filter plugins subscribers may use (repeatable; default: every
    /// filter in the plugin directory).
    #[arg(long = "allow-filter", env = "SLUICE_ALLOW_FILTER", value_delimiter = ',')]
    allow_filter: Option<Vec<String>>,
    /// The plugin directory is watched for files added, replaced or
    /// removed; it is also rescanned every N seconds, for filesystems
    /// whose changes are not reported (0: only when watched or on SIGHUP).
    #[arg(long, default_value_t = 30, env = "SLUICE_PLUGIN_RESCAN_SECS")]
    plugin_rescan_secs: u64,
}

fn main() -> ExitCode {
    let cli = match with_config_file(std::env::args().collect()) {
        Ok(argv) => Cli::parse_from(argv),
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,wasmtime=warn,cranelift=warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into a collector's file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let json_logs = cli.log_format == "json";
    if json_logs {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(*args).await,
            Command::Reload(endpoint) => reload(endpoint).await,
            Command::Health { endpoint, ready } => health(endpoint, ready).await,
            Command::Log { command } => log_command(command).await,
            Command::Postgres { command } => postgres_command(command).await,
            Command::Plugins { plugins, cache_dir } => {
                list_plugins(plugins.unwrap_or_else(default_plugin_dir), cache_dir).await
            }
            Command::Tail { url, watermark, replica_version, max_tx, json, filters } => {
                sluice::tail::run(sluice::tail::TailOptions { url, watermark, replica_version, max_tx, json, filters })
                    .await
            }
        }
    });
    // The graceful part is done or past its bound: a call still running on a
    // blocking thread (storage, a plugin) must not keep the process alive.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if json_logs {
                // A collector reading JSON lines must get the line that matters as one too.
                tracing::error!(exit = true, "{e:#}");
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::from(2)
        }
    }
}

/// The plugin directory when none is given: the build tree's when run from
/// a checkout, else where an installation keeps it beside the binary
/// (`PREFIX/bin/sluice` with `PREFIX/lib/sluice/plugins`, or an unpacked
/// archive with `plugins/` next to the binary).
fn default_plugin_dir() -> PathBuf {
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

/// `argv` with the settings of `run --config FILE` (or `SLUICE_CONFIG`)
/// appended as flags (see `sluice::settings_file`).
fn with_config_file(mut argv: Vec<String>) -> anyhow::Result<Vec<String>> {
    if argv.get(1).map(String::as_str) != Some("run") {
        return Ok(argv);
    }
    let mut file = std::env::var_os("SLUICE_CONFIG").map(PathBuf::from);
    for (i, a) in argv.iter().enumerate() {
        if let Some(f) = a.strip_prefix("--config=") {
            file = Some(PathBuf::from(f));
        } else if a == "--config" {
            file = argv.get(i + 1).map(PathBuf::from);
        }
    }
    if let Some(file) = file {
        let command = <Cli as clap::CommandFactory>::command();
        let run = command.find_subcommand("run").expect("the run subcommand");
        let flags = sluice::settings_file::flags_from_file(&file, run, &argv[2..])?;
        argv.extend(flags);
    }
    Ok(argv)
}

/// Where the change log lives.
enum ChangeDb {
    Sqlite(PathBuf),
    Postgres(Box<PgTarget>),
}

/// `sqlite:PATH`, a bare path (SQLite), or a Postgres connection string in
/// either libpq form. A keyword string (`host=... dbname=...`) is Postgres:
/// anything with `=` that fails to parse as one is an error, not a file name.
fn parse_change_db(change_db: &str) -> anyhow::Result<ChangeDb> {
    if let Some(path) = change_db.strip_prefix("sqlite:") {
        anyhow::ensure!(!path.is_empty(), "--change-db sqlite: needs a file path");
        return Ok(ChangeDb::Sqlite(PathBuf::from(path)));
    }
    if change_db.starts_with("postgres://") || change_db.starts_with("postgresql://") || change_db.contains('=') {
        let target = PgTarget::parse(change_db).map_err(|e| anyhow::anyhow!("--change-db: {e}"))?;
        return Ok(ChangeDb::Postgres(Box::new(target)));
    }
    anyhow::ensure!(!change_db.is_empty(), "--change-db needs sqlite:PATH or a Postgres connection string");
    Ok(ChangeDb::Sqlite(PathBuf::from(change_db)))
}

fn read_source_config(arg: &str) -> anyhow::Result<String> {
    let text = match arg.strip_prefix('@') {
        Some(file) => std::fs::read_to_string(file).with_context(|| format!("reading --source-config file {file}"))?,
        None => arg.to_string(),
    };
    serde_json::from_str::<serde_json::Value>(&text).with_context(|| "--source-config is not valid JSON")?;
    Ok(text)
}

/// The plugin's network: the upstream its configuration names, plus `--allow-net`.
fn resolve_net(config: &str, allow: &[String]) -> anyhow::Result<NetGrant> {
    let mut endpoints = sluice::plugin::net::config_endpoints(config)?;
    endpoints.extend(allow.iter().cloned());
    let grant = sluice::plugin::net::resolve(&endpoints)?;
    if !grant.connect.is_empty() {
        tracing::info!(endpoints = ?endpoints, "the source plugin may connect to {} address(es)", grant.connect.len());
    }
    Ok(grant)
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let config = read_source_config(&args.source_config)?;
    let source_config = config.clone();
    let change_db = parse_change_db(&args.change_db)?;
    // One writer per SQLite log, held until this function returns (or the
    // process dies), checked before anything is opened or written.
    let mut writer_lock = match &change_db {
        ChangeDb::Sqlite(path) => {
            Some(sluice::storage::writer_lock::WriterLock::acquire(path, &format!("listening on {}", args.listen))?)
        }
        ChangeDb::Postgres(_) => None,
    };
    let durability = match args.sync.as_str() {
        "full" => Durability::Full,
        "normal" => Durability::Normal,
        other => anyhow::bail!("--sync {other}: expected full or normal"),
    };
    let zero_permissions =
        args.zero_permissions.as_deref().map(sluice::server::zero_tables::Permissions::from_file).transpose()?;
    let limits = SandboxLimits {
        call_deadline: Duration::from_millis(args.plugin_deadline_ms),
        memory_bytes: args.plugin_memory_mb << 20,
    };
    let data_dir = match &change_db {
        ChangeDb::Sqlite(path) => path.parent().map(|p| p.to_path_buf()).unwrap_or_default(),
        ChangeDb::Postgres(_) => PathBuf::from("sluice-data"),
    };
    let cache_dir = args.cache_dir.clone().unwrap_or_else(|| data_dir.join(".cache"));
    // `postgres` is built in and needs no plugin directory; any other source
    // is a plugin. Filters come from the same directory.
    let builtin = args.source == "postgres";
    let plugins = args.plugins.clone().unwrap_or_else(default_plugin_dir);
    let registry = if !builtin || plugins.is_dir() {
        Some(Arc::new(Registry::open(&plugins, Some(cache_dir)).await?))
    } else {
        None
    };
    let source: Box<dyn ChangeSource> = match &registry {
        _ if builtin => Box::new(PostgresSource::new(&config).map_err(anyhow::Error::msg)?),
        Some(registry) => {
            let config = sluice::plugin::tls_forward::prepare(&config).await?;
            let net = resolve_net(&config, &args.allow_net)?;
            Box::new(registry.source(&args.source, config, limits, net).await.map_err(anyhow::Error::msg)?)
        }
        None => unreachable!("plugin sources load the registry"),
    };
    // The source is ready; compile the other plugins beside replication,
    // and pick up files dropped in while Sluice runs.
    if let Some(registry) = &registry {
        registry.warm_up();
        let every = (args.plugin_rescan_secs > 0).then(|| Duration::from_secs(args.plugin_rescan_secs));
        sluice::plugin::watch::spawn(registry.clone(), every);
    }
    let filter_limits = SandboxLimits {
        call_deadline: Duration::from_millis(args.filter_deadline_ms),
        memory_bytes: args.filter_memory_mb << 20,
    };
    let filters =
        sluice::plugin::FilterPlugins::host_allowing(registry.clone(), filter_limits, args.allow_filter.clone());
    let token = read_token(&args.token, &args.token_file)?;
    let access = sluice::server::access::Access::new(sluice::server::access::AccessOptions {
        token,
        max_connections: args.max_connections,
        max_per_address: args.max_connections_per_address,
    });
    let endpoint_tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(sluice::server::tls::EndpointTls::load(cert, key)?),
        _ => None,
    };
    tokio::spawn(reload_on_hangup(endpoint_tls.clone(), registry.clone()));
    if let Some(advertise) = &args.advertise {
        if let Ok(addr) = advertise.parse::<std::net::SocketAddr>() {
            anyhow::ensure!(
                !addr.ip().is_unspecified(),
                "--advertise {advertise}: subscribers cannot dial an unspecified address; give this host's name or IP"
            );
        }
    }
    anyhow::ensure!(
        !args.app_id.is_empty()
            && args.app_id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "--app-id {:?}: only lower-case letters, digits and _ are allowed",
        args.app_id
    );
    let (log, reader, where_): (Box<dyn sluice::storage::ChangeLog>, Arc<dyn sluice::storage::LogReader>, String) =
        match &change_db {
            ChangeDb::Sqlite(path) => (
                Box::new(SqliteChangeLog::open(path, durability)?.with_table_state(args.table_state)?),
                Arc::new(SqliteReader::new(path)),
                path.display().to_string(),
            ),
            ChangeDb::Postgres(target) => {
                let settings = PgSettings {
                    target: (**target).clone(),
                    app_id: args.app_id.clone(),
                    shard_num: args.shard_num,
                    task_id: args.task_id.clone(),
                    statement_timeout: Duration::from_millis(args.statement_timeout_ms),
                    call_timeout: Duration::from_millis(args.change_db_timeout_ms.max(1000)),
                    application_name: "zero-change-streamer".into(),
                    synchronous_commit: durability == Durability::Full,
                };
                let rt = tokio::runtime::Handle::current();
                let log = tokio::task::block_in_place(|| {
                    PostgresChangeLog::open_when_reachable(settings.clone(), rt.clone(), Duration::from_secs(600))?
                        .with_table_state(args.table_state)
                })?;
                let schema = settings.schema();
                let place = format!("Postgres schema {schema} at {}", target.describe());
                let reader = PostgresReader::new(settings, rt).with_max_snapshots(args.change_db_readers);
                (Box::new(log), Arc::new(reader), place)
            }
        };

    let cleanup = CleanupOptions {
        purge_interval: Duration::from_secs(args.purge_interval_secs.max(1)),
        retain_transactions: args.retain_transactions,
        retain_for: args.retain_secs.map(Duration::from_secs),
        lag_grace: (args.lag_grace_secs > 0).then(|| Duration::from_secs(args.lag_grace_secs)),
    };
    let config = ServiceConfig {
        listen: args.listen.clone(),
        advertise: args.advertise.clone(),
        streamer: StreamerOptions {
            storer: StorerOptions { queue_budget: args.queue_budget_mb << 20, ..StorerOptions::default() },
            auto_reset: args.auto_reset,
            task_id: args.task_id.clone(),
            wedge_timeout: Duration::from_millis(args.statement_timeout_ms),
            ..StreamerOptions::default()
        },
        cleanup: Some(cleanup),
        subscriber_limits: sluice::subscriber::Limits {
            backlog_bytes: args.backlog_mb << 20,
            budget: Arc::new(sluice::subscriber::MemoryBudget::new(args.subscriber_memory_mb << 20)),
            ..sluice::subscriber::Limits::default()
        },
        catchup: sluice::catchup::CatchupOptions {
            readers: args.catchup_readers.unwrap_or(sluice::catchup::CatchupOptions::default().readers),
            shared: !args.no_shared_catchup,
            ..sluice::catchup::CatchupOptions::default()
        },
        filters,
        zero_permissions,
        consumer_retention: Duration::from_secs(args.consumer_retention_secs),
        log_progress: true,
        access,
        endpoint_tls: endpoint_tls.clone(),
        ready_backoff: Duration::from_secs(args.ready_backoff_secs),
        plugins: registry.clone(),
        ..ServiceConfig::new(source, log, reader)
    };
    let mut service = Service::start(config).await?;
    if builtin {
        tokio::spawn(watch_retained_wal(source_config.clone(), service.status().clone()));
    }
    let addr = service.addr();
    let (ws, http) = if endpoint_tls.is_some() { ("wss", "https") } else { ("ws", "http") };
    if let Some(lock) = writer_lock.as_mut() {
        if let Err(e) = lock.record(&format!("listening on {ws}://{addr}")) {
            tracing::warn!("recording this process in {}: {e}", lock.path().display());
        }
    }
    tracing::info!(
        "sluice listening on {ws}://{addr}/replication/v6/changes (status: {http}://{addr}/status); change log {}",
        where_
    );
    tokio::select! {
        result = service.finished() => return result,
        _ = wait_for_signal() => {}
    }
    // Graceful: stop accepting, close every subscriber with 1001, let the
    // storer finish and ack upstream what is durable. A second signal, or
    // the bound, ends it at once.
    let bound = Duration::from_secs(args.shutdown_timeout_secs);
    tracing::info!("shutting down (within {} s; a second signal exits at once)", bound.as_secs());
    let first_signal = std::time::Instant::now();
    tokio::spawn(async move {
        // A repeat within a second is the same request (a supervisor that
        // signals the process group, or a double Ctrl-C), not an order to
        // skip the graceful part.
        loop {
            wait_for_signal().await;
            if first_signal.elapsed() >= Duration::from_secs(1) {
                break;
            }
        }
        tracing::error!("a second signal: exiting without waiting for the shutdown");
        std::process::exit(130);
    });
    match tokio::time::timeout(bound, service.stop()).await {
        Ok(result) => {
            tracing::info!("stopped");
            result
        }
        Err(_) => anyhow::bail!("the shutdown did not finish within {} s (--shutdown-timeout-secs)", bound.as_secs()),
    }
}

/// The built-in Postgres source: how much WAL the upstream keeps for the
/// slot (`/status` `retainedWalBytes`, `sluice_source_retained_wal_bytes`),
/// measured every 15 s on a connection of its own (every 2 s while the
/// slot does not exist yet).
async fn watch_retained_wal(source_config: String, status: Arc<sluice::status::Status>) {
    let Ok(upstream) = sluice::admin::postgres::Upstream::from_config(&source_config) else {
        return;
    };
    loop {
        let bytes = match upstream.status().await {
            Ok(up) => up.slot_state.and_then(|s| s.retained_wal_bytes).map(|b| b.max(0) as u64),
            Err(e) => {
                tracing::debug!("measuring the slot's retained WAL: {e:#}");
                None
            }
        };
        status.update(|s| s.retained_wal_bytes = bytes);
        // Until the slot exists (the source is starting), look again soon.
        tokio::time::sleep(Duration::from_secs(if bytes.is_some() { 15 } else { 2 })).await;
    }
}

/// SIGHUP: read the endpoint's certificate and key again, and rescan the
/// plugin directory.
async fn reload_on_hangup(tls: Option<Arc<sluice::server::tls::EndpointTls>>, plugins: Option<Arc<Registry>>) {
    #[cfg(unix)]
    {
        let Ok(mut hangup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
            return;
        };
        while hangup.recv().await.is_some() {
            if let Some(tls) = &tls {
                match tls.reload() {
                    Ok(()) => tracing::info!("SIGHUP: reloaded the endpoint's TLS certificate"),
                    Err(e) => tracing::error!(
                        "SIGHUP: the endpoint's TLS certificate was not reloaded ({e:#}); the old one stays"
                    ),
                }
            }
            if let Some(plugins) = &plugins {
                match plugins.rescan().await {
                    Ok(report) if !report.changed() && report.refused.is_empty() => {
                        tracing::info!("SIGHUP: the plugin directory is unchanged")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!("SIGHUP: plugin directory: {e:#}"),
                }
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (tls, plugins);
}

/// An admin report as JSON (`--json`) or as lines for a person.
fn print_report<R: serde::Serialize + std::fmt::Display>(report: &R, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

async fn log_command(command: LogCommand) -> anyhow::Result<()> {
    match command {
        LogCommand::Inspect { log, json } => print_report(&log.place()?.inspect().await?, json),
        LogCommand::Reset { log, yes, force } => {
            let place = log.place()?;
            // A running writer is never deleted from under, --force or not.
            if let sluice::admin::log::LogPlace::Sqlite(path) = &place {
                if let Some(holder) = sluice::storage::writer_lock::held_by(path)? {
                    anyhow::bail!(sluice::storage::writer_lock::LockError::Held {
                        log: path.display().to_string(),
                        holder
                    });
                }
            }
            let report = place.inspect().await?;
            if !report.exists {
                println!("{}: there is no change log to reset", place.describe());
                return Ok(());
            }
            if let Some(address) = report.owner_address.as_deref().filter(|_| !force) {
                let answers = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(address))
                    .await
                    .is_ok_and(|c| c.is_ok());
                anyhow::ensure!(
                    !answers,
                    "a Sluice answers at {address}, the owner address this log records: stop it first (or pass --force)"
                );
            }
            anyhow::ensure!(
                yes,
                "this deletes the change log at {} (lineage {}, {} transactions); every subscriber will sync again. Pass --yes to do it",
                place.describe(),
                report.replica_version.as_deref().unwrap_or("-"),
                report.transactions
            );
            place.reset().await?;
            println!("deleted the change log at {}; the next `sluice run` starts a new lineage", place.describe());
            Ok(())
        }
    }
}

async fn postgres_command(command: PostgresCommand) -> anyhow::Result<()> {
    match command {
        PostgresCommand::Status { source, json } => print_report(&source.upstream()?.status().await?, json)?,
        PostgresCommand::DropSlot { source } => {
            let upstream = source.upstream()?;
            if upstream.drop_slot().await? {
                println!("dropped the replication slot; the next `sluice run` takes a new snapshot");
            } else {
                println!("there is no such replication slot");
            }
        }
        PostgresCommand::Uninstall { source, yes } => {
            anyhow::ensure!(
                yes,
                "this removes the replication slot, the publication Sluice created, the event trigger and schema _sluice; pass --yes to do it"
            );
            for line in source.upstream()?.uninstall().await? {
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// `sluice health [--ready]`: an error (exit 2) unless the answer is 200.
async fn health(endpoint: EndpointArgs, ready: bool) -> anyhow::Result<()> {
    let path = if ready { "/readyz" } else { "/healthz" };
    let answer = endpoint.endpoint()?.request("GET", path).await?;
    anyhow::ensure!(answer.status == 200, "{path}: {} {}", answer.status, answer.body.trim());
    println!("{}", answer.body.trim());
    Ok(())
}

/// `sluice reload`: `POST /plugins/reload`, and what it changed.
async fn reload(args: EndpointArgs) -> anyhow::Result<()> {
    let answer = args.endpoint()?.request("POST", "/plugins/reload").await?;
    anyhow::ensure!(answer.status == 200, "{} answered {}: {}", args.url, answer.status, answer.body.trim());
    let report: serde_json::Value = serde_json::from_str(&answer.body).context("parsing the answer")?;
    let names = |key: &str| -> Vec<String> {
        report[key].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_string)).collect()
    };
    let mut said = false;
    for (key, what) in [("added", "added"), ("replaced", "replaced"), ("removed", "removed")] {
        for name in names(key) {
            println!("{what:<9} {name}");
            said = true;
        }
    }
    for refused in report["refused"].as_array().into_iter().flatten() {
        println!("refused   {}: {}", refused["name"].as_str().unwrap_or("?"), refused["error"].as_str().unwrap_or("?"));
        said = true;
    }
    if !said {
        println!("unchanged");
    }
    Ok(())
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

async fn list_plugins(dir: PathBuf, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let registry = Registry::load(&dir, cache_dir.or_else(|| Some(PathBuf::from("sluice-data/.cache")))).await?;
    println!("{:<24} {:<8} {:<8} {:<40} ERROR", "NAME", "KIND", "WIT", "FILE");
    for p in registry.infos() {
        println!(
            "{:<24} {:<8} {:<8} {:<40} {}",
            p.name,
            p.kind.map(|k| k.to_string()).unwrap_or_else(|| "-".into()),
            p.wit_version.as_deref().unwrap_or("-"),
            p.file.display(),
            p.error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
