//! The OTLP exporters, configured as every OpenTelemetry SDK is: by the
//! standard variables. An endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the
//! per-signal `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
//! `..._METRICS_ENDPOINT`) turns a signal on; `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none` / `OTEL_METRICS_EXPORTER=none` turn it off.
//! The SDK itself reads the rest (`..._HEADERS`, `..._PROTOCOL`
//! `http/protobuf` or `http/json`, `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_BSP_*`). Sluice adds the bound on
//! every request (`OTEL_EXPORTER_OTLP_TIMEOUT`, default 10 s) and TLS on
//! its own rustls set-up (`OTEL_EXPORTER_OTLP_CERTIFICATE`, and
//! `..._CLIENT_CERTIFICATE` / `..._CLIENT_KEY` for mutual TLS).
//!
//! Export happens on the SDK's own threads (a batch span processor, a
//! periodic metric reader), never on the async runtime; a collector that
//! is down costs dropped spans and points, not a stalled change stream.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::Layer;

use crate::pgconn::tls::{SslMode, TlsSettings};

/// The exporters the variables asked for.
pub struct Exporters {
    traces: Option<SdkTracerProvider>,
    metrics: Option<SdkMeterProvider>,
    describe: String,
}

/// One variable, unset when empty.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Which signals are on, from the variables (read through `var`, so tests
/// can give their own).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Wanted {
    pub traces: bool,
    pub metrics: bool,
}

pub(super) fn wanted(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Wanted> {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(Wanted { traces: false, metrics: false });
    }
    for name in
        ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"]
    {
        match var(name).as_deref() {
            None | Some("http/protobuf") | Some("http/json") => {}
            Some(other) => anyhow::bail!(
                "{name}={other}: Sluice sends OTLP over HTTP; use http/protobuf (or http/json) and the \
                 collector's HTTP port (4318)"
            ),
        }
    }
    let exporter = |name: &str| -> anyhow::Result<bool> {
        match var(name).as_deref() {
            None | Some("otlp") => Ok(true),
            Some("none") => Ok(false),
            Some(other) => anyhow::bail!("{name}={other}: Sluice exports `otlp` (or `none`)"),
        }
    };
    let endpoint = var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
    Ok(Wanted {
        traces: exporter("OTEL_TRACES_EXPORTER")? && (endpoint || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()),
        metrics: exporter("OTEL_METRICS_EXPORTER")?
            && (endpoint || var("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT").is_some()),
    })
}

impl Exporters {
    /// `None` when no signal is configured.
    pub fn from_env() -> anyhow::Result<Option<Exporters>> {
        let wanted = wanted(var)?;
        if !wanted.traces && !wanted.metrics {
            return Ok(None);
        }
        let client = http_client().context("OpenTelemetry")?;
        let resource = resource();
        let mut on = Vec::new();
        let traces = if wanted.traces {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(protocol("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
                .with_http_client(client.clone())
                .build()
                .context("OpenTelemetry: the OTLP span exporter")?;
            on.push("traces");
            Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.clone()).build())
        } else {
            None
        };
        let metrics = if wanted.metrics {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_protocol(protocol("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"))
                .with_http_client(client)
                .build()
                .context("OpenTelemetry: the OTLP metric exporter")?;
            let provider = SdkMeterProvider::builder().with_periodic_exporter(exporter).with_resource(resource).build();
            // The bridge registers its instruments on the global meter.
            opentelemetry::global::set_meter_provider(provider.clone());
            super::bridge::enable();
            on.push("metrics");
            Some(provider)
        } else {
            None
        };
        let endpoint = var("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_else(|| "the per-signal endpoints".into());
        let describe = format!("{} over OTLP/HTTP to {endpoint}", on.join(" and "));
        Ok(Some(Exporters { traces, metrics, describe }))
    }

    /// What is exported where, for the start-up line.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// The `tracing` layer that turns [`super::TARGET`] spans into
    /// OpenTelemetry spans, when traces are on.
    pub fn trace_layer<S>(&self) -> Option<Box<dyn Layer<S> + Send + Sync>>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
    {
        let provider = self.traces.as_ref()?;
        let tracer = opentelemetry::trace::TracerProvider::tracer(provider, "sluice");
        let ours = tracing_subscriber::filter::Targets::new().with_target(super::TARGET, tracing::Level::TRACE);
        Some(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(ours).boxed())
    }

    pub fn shutdown(self) {
        if let Some(traces) = self.traces {
            if let Err(e) = traces.shutdown() {
                eprintln!("OpenTelemetry: flushing the last spans: {e}");
            }
        }
        if let Some(metrics) = self.metrics {
            if let Err(e) = metrics.shutdown() {
                eprintln!("OpenTelemetry: flushing the last metrics: {e}");
            }
        }
    }
}

/// The signal's protocol: its own variable, else the general one, else
/// the standard default, http/protobuf (with JSON compiled in too, the
/// crate would otherwise default to JSON). Checked by [`wanted`].
fn protocol(signal_var: &str) -> Protocol {
    match var(signal_var).or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL")).as_deref() {
        Some("http/json") => Protocol::HttpJson,
        _ => Protocol::HttpBinary,
    }
}

/// `service.name` is `sluice` unless the variables name it.
fn resource() -> Resource {
    let named = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES")
            .is_some_and(|a| a.split(',').any(|kv| kv.trim().starts_with("service.name=")));
    let builder = Resource::builder().with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if named {
        builder.build()
    } else {
        builder.with_service_name("sluice").build()
    }
}

/// The exporters' HTTP client, which says once when the collector stops
/// answering (spans and points are dropped meanwhile; the change stream
/// does not wait for them) and once when it answers again, instead of a
/// line per failed export.
#[derive(Debug, Clone)]
struct Collector {
    client: reqwest::blocking::Client,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Collector {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<opentelemetry_http::Response<opentelemetry_http::Bytes>, opentelemetry_http::HttpError> {
        use std::sync::atomic::Ordering;
        let uri = request.uri().to_string();
        let result = self.client.send_bytes(request).await;
        let failure = match &result {
            Ok(response) if response.status().is_success() => None,
            Ok(response) => Some(format!("it answered {}", response.status())),
            Err(e) => {
                // reqwest's own text omits the cause (refused, timed out).
                let causes = std::iter::successors(e.source(), |c| c.source()).map(|c| c.to_string());
                Some(std::iter::once(e.to_string()).chain(causes).collect::<Vec<_>>().join(": "))
            }
        };
        match failure {
            Some(why) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                "OpenTelemetry: the collector at {uri} does not take exports ({why}); spans and metric points \
                 are dropped until it does"
            ),
            None if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!("OpenTelemetry: the collector at {uri} takes exports again")
            }
            _ => {}
        }
        result
    }
}

/// The HTTP client of both exporters: every request bounded, TLS through
/// the same rustls set-up as every other connection Sluice makes.
fn http_client() -> anyhow::Result<Collector> {
    let timeout = var("OTEL_EXPORTER_OTLP_TIMEOUT")
        .map(|ms| ms.parse::<u64>().with_context(|| format!("OTEL_EXPORTER_OTLP_TIMEOUT={ms}: expected milliseconds")))
        .transpose()?
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(10));
    // reqwest asks rustls for the process's default provider even for plain
    // http: make it the ring provider every other connection uses.
    let _ = rustls::crypto::CryptoProvider::install_default((*crate::tls::crypto_provider()).clone());
    let builder =
        reqwest::blocking::Client::builder().timeout(timeout).connect_timeout(timeout.min(Duration::from_secs(5)));
    let https =
        ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"]
            .iter()
            .any(|name| var(name).is_some_and(|url| url.starts_with("https:")));
    let builder = if https {
        let roots = var("OTEL_EXPORTER_OTLP_CERTIFICATE").unwrap_or_else(|| "system".into());
        let tls = TlsSettings::new(
            Some(SslMode::VerifyFull),
            Some(roots),
            var("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE").map(PathBuf::from),
            var("OTEL_EXPORTER_OTLP_CLIENT_KEY").map(PathBuf::from),
        )
        .map_err(|e| anyhow::anyhow!("TLS to the OTLP endpoint: {e}"))?;
        builder.tls_backend_preconfigured((*tls.client_config()).clone())
    } else {
        builder
    };
    let client = builder.build().context("building the OTLP HTTP client")?;
    Ok(Collector { client, failing: Default::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> anyhow::Result<Wanted> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        wanted(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn an_endpoint_turns_the_signals_on_and_the_standard_switches_turn_them_off() {
        assert_eq!(with(&[]).unwrap(), Wanted { traces: false, metrics: false });
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        assert_eq!(with(&[endpoint]).unwrap(), Wanted { traces: true, metrics: true });
        assert_eq!(
            with(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")]).unwrap(),
            Wanted { traces: true, metrics: false }
        );
        assert_eq!(
            with(&[endpoint, ("OTEL_METRICS_EXPORTER", "none")]).unwrap(),
            Wanted { traces: true, metrics: false }
        );
        assert_eq!(with(&[endpoint, ("OTEL_SDK_DISABLED", "true")]).unwrap(), Wanted { traces: false, metrics: false });
    }

    #[test]
    fn grpc_and_unknown_exporters_are_refused_with_what_to_use() {
        let err = with(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("http/protobuf") && err.contains("4318"), "{err}");
        let err = with(&[("OTEL_TRACES_EXPORTER", "zipkin")]).unwrap_err().to_string();
        assert!(err.contains("OTEL_TRACES_EXPORTER=zipkin"), "{err}");
    }
}
