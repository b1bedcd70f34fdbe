//! What Sluice tells its operators besides `/status` and `/metrics`: log
//! lines (`tracing` to stderr, text or JSON) and, when the standard
//! `OTEL_*` variables ask for it, OpenTelemetry over OTLP/HTTP:
//!
//! * traces of a transaction's path: the source batch it arrived in, the
//!   transaction, its fan-out to subscribers and the storage commit that
//!   made it durable ([`TARGET`] spans), and each subscriber's catch-up
//!   scan;
//! * every `/metrics` family, bridged into the SDK's meters ([`bridge`]).
//!
//! Off unless an OTLP endpoint is configured, and then free on the hot
//! path: the spans live under their own target, which no log filter ever
//! enables, so with OpenTelemetry off every span macro there is a disabled
//! callsite (one relaxed atomic load) and nothing is allocated or sent.

pub mod bridge;
mod otlp;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::settings::LogFormat;

/// The `tracing` target of the spans that are exported as traces (and
/// never printed as log lines).
pub const TARGET: &str = "sluice::otel";

/// What [`install`] set up; [`Telemetry::shutdown`] flushes it at exit.
pub struct Telemetry {
    exporters: Option<otlp::Exporters>,
}

impl Telemetry {
    /// Sends what is still buffered (bounded by the exporters' timeouts).
    /// Call it outside the async runtime: the exporters block.
    pub fn shutdown(self) {
        if let Some(exporters) = self.exporters {
            exporters.shutdown();
        }
    }
}

/// Installs the global `tracing` subscriber (logs to stderr in `format`)
/// and, when configured by the `OTEL_*` variables, the OpenTelemetry
/// exporters. Call before the async runtime starts.
pub fn install(format: LogFormat) -> anyhow::Result<Telemetry> {
    let exporters = otlp::Exporters::from_env()?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,wasmtime=warn,cranelift=warn"))
        // The transaction-path spans are for traces only, whatever RUST_LOG says.
        .add_directive(format!("{TARGET}=off").parse()?);
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = match format {
        LogFormat::Json => logs.json().boxed(),
        // Colour only for a person at a terminal, never into a collector's file.
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).boxed(),
    };
    let traces = exporters.as_ref().and_then(|e| e.trace_layer());
    tracing_subscriber::registry().with(traces).with(logs.with_filter(filter)).init();
    if let Some(exporters) = &exporters {
        tracing::info!("OpenTelemetry: {}", exporters.describe());
    }
    Ok(Telemetry { exporters })
}
