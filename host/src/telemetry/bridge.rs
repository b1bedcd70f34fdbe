//! The `/metrics` families as OpenTelemetry instruments, so an OTLP
//! collector gets the same series a Prometheus scrape does, under the same
//! names (`sluice_transactions_stored` becomes `..._total` again in a
//! collector's Prometheus exporter).
//!
//! Counters and gauges are observable instruments whose callbacks read one
//! rendering of the registry per collection (every
//! `OTEL_METRIC_EXPORT_INTERVAL`, default 60 s), so nothing on the hot
//! path changes. OpenTelemetry has no observable histogram, so the two
//! histograms (storage commit, source lag) are also recorded into SDK
//! histograms where they are observed ([`crate::status::Status`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use crate::metrics::Metrics;
use crate::status::Status;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// OTLP metrics are on (set once, at start).
pub(super) fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Registers every family of `metrics` on the global meter, when OTLP
/// metrics are on; otherwise does nothing.
pub fn export(metrics: Arc<Metrics>, status: &Status) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let meter = opentelemetry::global::meter("sluice");
    let reading = Arc::new(Reading { metrics, last: Mutex::new(None) });
    for family in reading.families().iter() {
        let (name, help, unit) = (family.name.clone(), family.help.clone(), otel_unit(&family.unit));
        let samples = {
            let (reading, name) = (reading.clone(), family.name.clone());
            move |observe: &dyn Fn(f64, &[KeyValue])| {
                if let Some(family) = reading.families().iter().find(|f| f.name == name) {
                    for (labels, value) in &family.samples {
                        observe(*value, labels);
                    }
                }
            }
        };
        match family.kind {
            Kind::Counter => {
                meter
                    .f64_observable_counter(name)
                    .with_description(help)
                    .with_unit(unit)
                    .with_callback(move |o| samples(&|v, l| o.observe(v, l)))
                    .build();
            }
            Kind::Gauge => {
                meter
                    .f64_observable_gauge(name)
                    .with_description(help)
                    .with_unit(unit)
                    .with_callback(move |o| samples(&|v, l| o.observe(v, l)))
                    .build();
            }
            Kind::Other => {}
        }
    }
    status.export_histograms(
        meter
            .f64_histogram("sluice_storage_commit_seconds")
            .with_description("Duration of each change log commit (a group of transactions made durable)")
            .with_unit("s")
            .with_boundaries(exponential(0.00025, 2.0, 16))
            .build(),
        meter
            .f64_histogram("sluice_source_lag_seconds")
            .with_description("Upstream commit to durable in the change log, per transaction")
            .with_unit("s")
            .with_boundaries(exponential(0.001, 2.5, 18))
            .build(),
    );
}

fn exponential(start: f64, factor: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |b| Some(b * factor)).take(count).collect()
}

/// OpenTelemetry's unit codes (UCUM) for the Prometheus units in use.
fn otel_unit(unit: &str) -> String {
    match unit {
        "seconds" => "s".into(),
        "bytes" => "By".into(),
        other => other.into(),
    }
}

/// The registry, rendered at most once per second: the callbacks of one
/// collection all read the same rendering.
struct Reading {
    metrics: Arc<Metrics>,
    last: Mutex<Option<(Instant, Arc<Vec<Family>>)>>,
}

impl Reading {
    fn families(&self) -> Arc<Vec<Family>> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, families)) = last.as_ref() {
            if at.elapsed() < Duration::from_secs(1) {
                return families.clone();
            }
        }
        let families = Arc::new(self.metrics.render().map(|text| parse(&text)).unwrap_or_default());
        *last = Some((Instant::now(), families.clone()));
        families
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Counter,
    Gauge,
    /// Histograms (recorded directly) and anything else.
    Other,
}

#[derive(Debug)]
struct Family {
    name: String,
    kind: Kind,
    help: String,
    unit: String,
    samples: Vec<(Vec<KeyValue>, f64)>,
}

/// The families of an OpenMetrics text exposition (as prometheus-client
/// writes it): `# TYPE`, `# HELP`, `# UNIT`, then the samples, a counter's
/// with the `_total` suffix.
fn parse(text: &str) -> Vec<Family> {
    let mut families: Vec<Family> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut family = |name: &str, families: &mut Vec<Family>| -> usize {
        *index.entry(name.to_string()).or_insert_with(|| {
            families.push(Family {
                name: name.to_string(),
                kind: Kind::Other,
                help: String::new(),
                unit: String::new(),
                samples: Vec::new(),
            });
            families.len() - 1
        })
    };
    let mut current: Option<usize> = None;
    for line in text.lines() {
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let (Some(what), Some(name)) = (parts.next(), parts.next()) else { continue };
            let rest = parts.next().unwrap_or("").to_string();
            if !matches!(what, "TYPE" | "HELP" | "UNIT") {
                continue;
            }
            let i = family(name, &mut families);
            current = Some(i);
            match what {
                "TYPE" => {
                    families[i].kind = match rest.as_str() {
                        "counter" => Kind::Counter,
                        "gauge" => Kind::Gauge,
                        _ => Kind::Other,
                    }
                }
                "HELP" => families[i].help = rest,
                _ => families[i].unit = rest,
            }
            continue;
        }
        let Some(i) = current else { continue };
        let Some((name, labels, value)) = sample(line) else { continue };
        let f = &mut families[i];
        let expected = if f.kind == Kind::Counter { format!("{}_total", f.name) } else { f.name.clone() };
        if f.kind != Kind::Other && name == expected {
            f.samples.push((labels, value));
        }
    }
    families
}

/// `name{a="x",b="y"} value`: the name, the labels as attributes, the value.
fn sample(line: &str) -> Option<(&str, Vec<KeyValue>, f64)> {
    let line = line.trim();
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        let end = loop {
            let (at, c) = chars.next()?;
            match c {
                '}' => break at,
                ',' | ' ' => {}
                '=' => {
                    // A quoted value with \\, \" and \n escapes.
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push(KeyValue::new(std::mem::take(&mut key), value));
                }
                other => key.push(other),
            }
        };
        rest = &inner[end + 1..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_becomes_families_with_their_samples() {
        let text = "# HELP sluice_transactions_stored Transactions stored.\n\
                    # TYPE sluice_transactions_stored counter\n\
                    sluice_transactions_stored_total 42\n\
                    # HELP sluice_subscriber_lag Lag, per subscriber.\n\
                    # TYPE sluice_subscriber_lag gauge\n\
                    # UNIT sluice_subscriber_lag bytes\n\
                    sluice_subscriber_lag{subscriber=\"a \\\"quoted\\\" one\",mode=\"serving\"} 7.5\n\
                    sluice_subscriber_lag{subscriber=\"b\",mode=\"backup\"} 0\n\
                    # TYPE sluice_storage_commit_seconds histogram\n\
                    sluice_storage_commit_seconds_bucket{le=\"+Inf\"} 3\n\
                    # EOF\n";
        let families = parse(text);
        assert_eq!(families.len(), 3, "{families:?}");
        assert_eq!(families[0].name, "sluice_transactions_stored");
        assert_eq!(families[0].kind, Kind::Counter);
        assert_eq!(families[0].help, "Transactions stored.");
        assert_eq!(families[0].samples, vec![(vec![], 42.0)]);
        assert_eq!(families[1].kind, Kind::Gauge);
        assert_eq!(families[1].unit, "bytes");
        assert_eq!(
            families[1].samples[0],
            (vec![KeyValue::new("subscriber", "a \"quoted\" one"), KeyValue::new("mode", "serving")], 7.5)
        );
        assert_eq!(families[1].samples.len(), 2);
        assert_eq!(families[2].kind, Kind::Other);
        assert!(families[2].samples.is_empty());
    }

    #[test]
    fn every_family_of_a_real_registry_is_read() {
        let status = Arc::new(Status::default());
        let log = crate::storage::memory::MemoryChangeLog::default();
        let metrics = Metrics::new(
            status.clone(),
            crate::server::access::Access::new(Default::default()),
            crate::hub::Hub::new(log.reader(), status.clone()),
            Duration::from_secs(5),
        );
        let text = metrics.render().unwrap();
        let families = parse(&text);
        let named = |n: &str| families.iter().find(|f| f.name == n).unwrap_or_else(|| panic!("{n} in {families:?}"));
        assert_eq!(named("sluice_transactions_stored").kind, Kind::Counter);
        assert_eq!(named("sluice_transactions_stored").samples.len(), 1);
        let info = named("sluice_build_info");
        assert!(info.samples[0].0.iter().any(|kv| kv.key.as_str() == "version"), "{info:?}");
        // Every counter and gauge sample line of the text is in a family.
        let histograms: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" histogram")).collect();
        let histogram_line = |l: &str| histograms.iter().any(|h| l.starts_with(h));
        let sample_lines = text.lines().filter(|l| !l.starts_with('#') && !histogram_line(l)).count();
        let read: usize = families.iter().map(|f| f.samples.len()).sum();
        assert_eq!(read, sample_lines, "{text}");
    }
}
