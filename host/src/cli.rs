//! The `sluice` command line: its commands and flags, and the admin
//! commands' dispatch. `run` is the binary's own (it owns signals and the
//! shutdown); everything else is answered here. Parsing goes through
//! [`crate::settings::layers`], so every flag can also come from
//! `SLUICE_*` or the `--config` file.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::settings::{check_source_config, source_config, ChangeLogArgs, LogFormat, Settings, TokenArgs};

/// `sluice --version`: the crate version, the git revision it was built
/// from, and the plugin contract (WIT) version it loads.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let (major, minor) = crate::plugin::WIT_VERSION;
    format!(
        "{} (git {}, plugin WIT {}@{}, loads {major}.{minor}.x)",
        env!("CARGO_PKG_VERSION"),
        env!("SLUICE_GIT_REV"),
        crate::plugin::WIT_PACKAGE,
        sluice_contract::WIT_RELEASE
    )
});

#[derive(Parser, Debug)]
#[command(name = "sluice", version = VERSION.as_str(), about = "A pluggable change streamer that speaks Zero's change-streamer protocol")]
pub struct Cli {
    /// Log lines as `text` (for people) or `json` (one object per line, for
    /// a log collector).
    #[arg(long, global = true, value_enum, default_value = "text", env = "SLUICE_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// A TOML file of settings, named as the flags are (`listen = "..."`,
    /// `allow-filter = ["redact"]`, `[source-config]`). Flags and `SLUICE_*`
    /// variables win over it.
    #[arg(long, global = true, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line of this process, layered (see `settings::layers`).
    pub fn from_env() -> Result<Cli, clap::Error> {
        crate::settings::layers::parse(std::env::args_os())
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Replicate from a source into the change log and serve subscribers.
    Run(Box<Settings>),
    /// Subscribe to a Sluice (or Zero change-streamer) and print the stream.
    Tail {
        /// `ws://HOST:PORT` of the server, or `wss://HOST:PORT` when it
        /// serves TLS.
        url: String,
        #[command(flatten)]
        token: TokenArgs,
        /// The CA certificate (PEM) of a `wss` endpoint (default: the system's roots).
        #[arg(long)]
        ca: Option<PathBuf>,
        /// Start after this watermark (default: the earliest the server has).
        #[arg(long, conflicts_with = "from_head")]
        watermark: Option<String>,
        /// Start at the newest transaction the server has: print only what
        /// comes from now on.
        #[arg(long)]
        from_head: bool,
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the manual page (roff), for `man -l -` or a man directory.
    Man,
    /// List the plugins in a directory and whether they load.
    Plugins {
        /// Default: as for `run`.
        #[arg(long, env = "SLUICE_PLUGINS")]
        plugins: Option<PathBuf>,
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
pub enum LogCommand {
    /// Lineage, owner, watermarks, size and per-table counts.
    Inspect {
        #[command(flatten)]
        log: ChangeLogArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete the change log: the next `sluice run` takes a new snapshot
    /// under a new lineage, and every subscriber syncs again.
    Reset {
        #[command(flatten)]
        log: ChangeLogArgs,
        /// Yes, delete it.
        #[arg(long)]
        yes: bool,
        /// Even though a Sluice answers at the owner address the log records.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum PostgresCommand {
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

#[derive(clap::Args, Debug)]
pub struct SourceConfigArg {
    /// The Postgres source's configuration as `run` takes it: JSON text or @FILE.
    #[arg(long, env = "SLUICE_SOURCE_CONFIG", hide_env_values = true, value_parser = source_config)]
    source_config: String,
}

/// How an admin command reaches a running Sluice: `--url`, or else the
/// address and TLS that `run` is configured with (`--listen`, `--tls-cert`,
/// from the same flags, variables or `--config` file), dialled on loopback.
#[derive(clap::Args, Debug)]
pub struct EndpointArgs {
    /// The endpoint: `http://HOST:PORT`, or `https://HOST:PORT` when it
    /// serves TLS. Default: from `--listen` and `--tls-cert`.
    #[arg(long, env = "SLUICE_URL")]
    url: Option<String>,
    #[command(flatten)]
    token: TokenArgs,
    /// The CA certificate (PEM) of an `https` endpoint (default: the system's
    /// roots; without `--url`, the server's own `--tls-cert`).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Without `--url`: the address Sluice listens on, as for `run`.
    #[arg(long, default_value = "127.0.0.1:4849", env = "SLUICE_LISTEN")]
    listen: String,
    /// Without `--url`: the certificate Sluice serves, as for `run`; the
    /// check trusts exactly that certificate.
    #[arg(long, env = "SLUICE_TLS_CERT")]
    tls_cert: Option<PathBuf>,
}

impl EndpointArgs {
    fn endpoint(&self) -> anyhow::Result<crate::admin::http::Endpoint> {
        let token = self.token.read()?;
        if let Some(url) = &self.url {
            return Ok(crate::admin::http::Endpoint { url: url.clone(), token, ca: self.ca.clone(), pinned: None });
        }
        let scheme = if self.tls_cert.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", loopback_for(&self.listen));
        let pinned = if self.ca.is_some() { None } else { self.tls_cert.clone() };
        Ok(crate::admin::http::Endpoint { url, token, ca: self.ca.clone(), pinned })
    }
}

/// The address to dial for a listen address: the same, but a wildcard
/// (`0.0.0.0`, `[::]`) becomes its loopback.
fn loopback_for(listen: &str) -> String {
    let Ok(address) = listen.parse::<std::net::SocketAddr>() else {
        return listen.to_string(); // HOST:PORT
    };
    let ip = match address.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, address.port()).to_string()
}

/// Runs an admin command (every command but `run`).
pub async fn execute(command: Command) -> anyhow::Result<()> {
    use crate::admin;
    match command {
        Command::Run(_) => anyhow::bail!("`run` is started by the binary"),
        Command::Reload(endpoint) => admin::http::reload(&endpoint.endpoint()?).await,
        Command::Health { endpoint, ready } => admin::http::health(&endpoint.endpoint()?, ready).await,
        Command::Log { command: LogCommand::Inspect { log, json } } => {
            print_report(&admin::log::inspect(&log.store()).await?, json)
        }
        Command::Log { command: LogCommand::Reset { log, yes, force } } => {
            admin::log::reset(&log.store(), yes, force).await
        }
        Command::Postgres { command } => postgres(command).await,
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "sluice",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Man => {
            let page = clap_mangen::Man::new(<Cli as clap::CommandFactory>::command());
            page.render(&mut std::io::stdout()).context("writing the manual page")
        }
        Command::Plugins { plugins, cache_dir } => {
            let dir = plugins.unwrap_or_else(crate::settings::default_plugin_dir);
            admin::plugins::list(&dir, cache_dir.unwrap_or_else(|| PathBuf::from("sluice-data/.cache"))).await
        }
        Command::Tail { url, token, ca, watermark, from_head, replica_version, max_tx, json, filters } => {
            let endpoint = admin::http::Endpoint { url, token: token.read()?, ca, pinned: None };
            let options =
                crate::tail::TailOptions { endpoint, from_head, watermark, replica_version, max_tx, json, filters };
            crate::tail::run(options).await
        }
    }
}

async fn postgres(command: PostgresCommand) -> anyhow::Result<()> {
    use crate::admin::postgres::Upstream;
    let (PostgresCommand::Status { source, .. }
    | PostgresCommand::DropSlot { source }
    | PostgresCommand::Uninstall { source, .. }) = &command;
    check_source_config(&source.source_config)?;
    match command {
        PostgresCommand::Status { source, json } => {
            print_report(&Upstream::from_config(&source.source_config)?.status().await?, json)
        }
        PostgresCommand::DropSlot { source } => {
            if Upstream::from_config(&source.source_config)?.drop_slot().await? {
                println!("dropped the replication slot; the next `sluice run` takes a new snapshot");
            } else {
                println!("there is no such replication slot");
            }
            Ok(())
        }
        PostgresCommand::Uninstall { source, yes } => {
            anyhow::ensure!(
                yes,
                "this removes the replication slot, the publication Sluice created, the event trigger and schema _sluice; pass --yes to do it"
            );
            for line in Upstream::from_config(&source.source_config)?.uninstall().await? {
                println!("{line}");
            }
            Ok(())
        }
    }
}

/// An admin report as JSON (`--json`) or as lines for a person.
fn print_report<R: serde::Serialize + std::fmt::Display>(report: &R, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report).context("writing the report as JSON")?);
    } else {
        print!("{report}");
    }
    Ok(())
}
