//! The `sluice` binary: parses the command line (`sluice::cli`), sets up
//! logging and the runtime, owns the signals (SIGTERM and SIGINT stop
//! gracefully, SIGHUP reloads) and turns the outcome into an exit code.
//! Everything `run` builds is assembled by `Service::build`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use sluice::cli::{Cli, Command};
use sluice::service::Service;
use sluice::settings::{LogFormat, Settings};

fn main() -> ExitCode {
    let cli = match Cli::from_env() {
        Ok(cli) => cli,
        // Help, the version and usage errors, printed as clap prints them.
        Err(e) => e.exit(),
    };
    let json_logs = cli.log_format == LogFormat::Json;
    let telemetry = match sluice::telemetry::install(cli.log_format) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(settings) => run(&settings).await,
            admin => sluice::cli::execute(admin).await,
        }
    });
    // The graceful part is done or past its bound: a call still running on a
    // blocking thread (storage, a plugin) must not keep the process alive.
    runtime.shutdown_timeout(Duration::from_secs(1));
    telemetry.shutdown();
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

/// `sluice run`: serves until the loop ends by itself or a signal asks it
/// to stop.
async fn run(settings: &Settings) -> anyhow::Result<()> {
    let mut service = Service::build(settings).await?;
    let mut hangups = Signal::new(Kind::Hangup);
    let mut stops = Signal::new(Kind::Stop);
    loop {
        tokio::select! {
            result = service.finished() => return result,
            _ = hangups.recv() => {
                tracing::info!("SIGHUP: reloading the endpoint's certificate and the plugin directory");
                service.reload().await;
            }
            _ = stops.recv() => break,
        }
    }
    // Graceful: stop accepting, close every subscriber with 1001, let the
    // storer finish and ack upstream what is durable. A second signal, or
    // the bound, ends it at once.
    let bound = Duration::from_secs(settings.shutdown_timeout_secs);
    tracing::info!("shutting down (within {} s; a second signal exits at once)", bound.as_secs());
    let first_signal = Instant::now();
    tokio::spawn(async move {
        // A repeat within a second is the same request (a supervisor that
        // signals the process group, or a double Ctrl-C), not an order to
        // skip the graceful part.
        loop {
            stops.recv().await;
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

#[derive(Clone, Copy)]
enum Kind {
    /// SIGTERM or SIGINT (Ctrl-C).
    Stop,
    /// SIGHUP.
    Hangup,
}

/// A stream of one kind of signal; one that cannot be watched never fires.
struct Signal {
    #[cfg(unix)]
    streams: Vec<tokio::signal::unix::Signal>,
    #[cfg(not(unix))]
    kind: Kind,
}

impl Signal {
    fn new(kind: Kind) -> Signal {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let kinds = match kind {
                Kind::Stop => vec![SignalKind::terminate(), SignalKind::interrupt()],
                Kind::Hangup => vec![SignalKind::hangup()],
            };
            let streams = kinds
                .into_iter()
                .filter_map(|k| signal(k).inspect_err(|e| tracing::warn!("cannot watch a signal: {e}")).ok())
                .collect();
            Signal { streams }
        }
        #[cfg(not(unix))]
        Signal { kind }
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            if self.streams.is_empty() {
                return std::future::pending().await;
            }
            let waits = self.streams.iter_mut().map(|s| Box::pin(s.recv()));
            futures::future::select_all(waits).await;
        }
        #[cfg(not(unix))]
        match self.kind {
            Kind::Stop => drop(tokio::signal::ctrl_c().await),
            Kind::Hangup => std::future::pending::<()>().await,
        }
    }
}
