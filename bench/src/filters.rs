//! Cost of one filter evaluation per change: each bundled filter through the
//! host's filter path (routing, the outcome cache, the plugin boundary and
//! the guest's logic) at several batch sizes, beside the same logic compiled
//! natively (`filter_kit`) and driven the same way (route, policy, decide).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use filter_kit::Filter;
use sluice::change::{Encoder, Event};
use sluice::filter::{route, ChangeFilter, FilterSpec, Route};
use sluice::plugin::{FilterPlugins, Registry, SandboxLimits, WasmFilter};
use sluice::source::model::{Insert, KeyType, Message, Relation, Value};

use super::plugin_dir;

const CHANGES: usize = 65_536;

/// Insert messages over two tables (`public.keep`, `public.skip`) with
/// 100-byte payloads, in Zero's JSON, each its own shared text.
fn messages() -> anyhow::Result<Vec<Arc<str>>> {
    let mut enc = Encoder::default();
    for (id, name) in [(1u32, "keep"), (2, "skip")] {
        enc.encode(Message::Relation(Relation {
            id,
            schema: "public".into(),
            name: name.into(),
            columns: vec!["id".into(), "payload".into(), "n".into()],
            key_columns: vec!["id".into()],
            key_type: KeyType::Default,
        }))?;
    }
    let payload = "x".repeat(100);
    let mut out = Vec::with_capacity(CHANGES);
    for i in 0..CHANGES {
        let msg = Message::Insert(Insert {
            relation: 1 + (i % 2) as u32,
            new: vec![Value::Int(i as i64), Value::Text(payload.clone()), Value::Int((i % 100) as i64)],
        });
        if let Event::Change(c) = enc.encode(msg)? {
            out.push(c.json.clone());
        }
    }
    Ok(out)
}

fn configs() -> Vec<(&'static str, serde_json::Value)> {
    vec![
        ("table-filter", serde_json::json!({"exclude": ["public.skip"]})),
        ("row-filter", serde_json::json!({"table": "public.*", "where": {"column": "n", "op": "<", "value": 50}})),
        ("redact", serde_json::json!({"drop": ["payload"]})),
    ]
}

/// The native logic, driven like the host drives a plugin.
fn native<F: Filter>(filter: &F, messages: &[Arc<str>]) -> usize {
    // By schema, then name, as the host keeps them: no allocation per lookup.
    let mut policies: HashMap<String, HashMap<String, filter_kit::Policy>> = HashMap::new();
    let mut kept = 0;
    for m in messages {
        let inner = &m[8..m.len() - 1];
        let verdict = match route(inner) {
            Route::Row { tag, schema, name } => {
                let known = policies.get(schema).and_then(|t| t.get(name)).copied();
                let policy = known.unwrap_or_else(|| {
                    let p = filter.policy(schema, name);
                    policies.entry(schema.to_string()).or_default().insert(name.to_string(), p);
                    p
                });
                match policy {
                    filter_kit::Policy::KeepAll => filter_kit::Verdict::Keep,
                    filter_kit::Policy::DropAll => filter_kit::Verdict::Drop,
                    filter_kit::Policy::Inspect => filter.decide(tag, inner),
                }
            }
            Route::Other => filter.decide("", inner),
        };
        kept += (verdict != filter_kit::Verdict::Drop) as usize;
    }
    kept
}

/// One round of the native logic over `messages`: ns per change.
fn native_round(name: &str, config: &str, messages: &[Arc<str>]) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let kept = match name {
        "table-filter" => {
            native(&filter_kit::table::TableFilter::from_config(config).map_err(anyhow::Error::msg)?, messages)
        }
        "row-filter" => native(&filter_kit::row::RowFilter::from_config(config).map_err(anyhow::Error::msg)?, messages),
        _ => native(&filter_kit::redact::Redact::from_config(config).map_err(anyhow::Error::msg)?, messages),
    };
    std::hint::black_box(kept);
    Ok(t0.elapsed().as_nanos() as f64 / messages.len() as f64)
}

/// Narrowing for profiling one case (callgrind, perf): `SLUICE_BENCH_FILTER`
/// (one filter), `SLUICE_BENCH_BATCH` (one batch size, no "apply alone"),
/// `SLUICE_BENCH_ROUNDS` (rounds per figure, default 7).
struct Only {
    filter: Option<String>,
    batch: Option<usize>,
    rounds: usize,
}

impl Only {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        Only {
            filter: var("SLUICE_BENCH_FILTER"),
            batch: var("SLUICE_BENCH_BATCH").and_then(|b| b.parse().ok()),
            rounds: var("SLUICE_BENCH_ROUNDS").and_then(|r| r.parse().ok()).unwrap_or(7),
        }
    }
}

pub async fn per_change(tmp: &std::path::Path) -> anyhow::Result<()> {
    let only = Only::from_env();
    let registry = Arc::new(Registry::load(&plugin_dir(), Some(tmp.join("cache"))).await?);
    for (name, config) in configs() {
        if only.filter.as_deref().is_some_and(|f| f != name) {
            continue;
        }
        // The rounds of every column are interleaved (native, then each
        // batch size, round after round), so a slow spell of this shared
        // machine hits all columns alike and each keeps its best round.
        let batches: Vec<usize> =
            [1usize, 64, 1024].into_iter().filter(|b| only.batch.is_none_or(|o| o == *b)).collect();
        let mut groups = Vec::new();
        for _ in &batches {
            // A group of its own for each column (one host each: a host
            // shares the groups of equal chains). One subscriber holds each,
            // so the outcome cache is off and every round evaluates every
            // change.
            let host = FilterPlugins::host(Some(registry.clone()), SandboxLimits::default());
            let specs = vec![FilterSpec { plugin: name.to_string(), config: config.clone() }];
            groups.push(host.group(&specs).await.map_err(anyhow::Error::msg)?);
        }
        let messages = messages()?;
        let mut native = f64::MAX;
        let mut best = vec![f64::MAX; batches.len()];
        for _ in 0..only.rounds {
            native = native.min(native_round(name, &config.to_string(), &messages)?);
            for ((batch, group), best) in batches.iter().zip(&groups).zip(best.iter_mut()) {
                let t0 = Instant::now();
                let mut kept = 0;
                for chunk in messages.chunks(*batch) {
                    let outcomes = group.apply(chunk).await.map_err(anyhow::Error::msg)?;
                    kept += outcomes.iter().filter(|o| **o != sluice::filter::Outcome::Drop).count();
                }
                *best = best.min(t0.elapsed().as_nanos() as f64 / messages.len() as f64);
                // Each of these configurations keeps half of the rows or all.
                anyhow::ensure!(kept >= messages.len() / 2, "{name}: kept {kept} of {}", messages.len());
            }
        }
        let mut line = format!("{name:<13} native {native:>6.0} ns/change; plugin");
        for (batch, ns) in batches.iter().zip(best) {
            line.push_str(&format!(" batch {batch:>4}: {ns:>6.0} ns"));
        }
        // The plugin call alone (batch 1024, every change inspected, best of
        // 20 rounds): what the boundary and the guest cost without the host.
        // (table-filter decides rows by table: the host never sends it rows.)
        if name == "table-filter" || only.batch.is_some() {
            println!("{line}");
            continue;
        }
        let (engine, pre) = registry.filter(name).await.map_err(anyhow::Error::msg)?;
        let mut instance = WasmFilter::create(&engine, &pre, name, &config.to_string(), SandboxLimits::default())
            .await
            .map_err(anyhow::Error::msg)?;
        let inner: Vec<&str> = messages.iter().map(|m| &m[8..m.len() - 1]).collect();
        let mut ns = f64::MAX;
        for _ in 0..20 {
            let t0 = Instant::now();
            for chunk in inner.chunks(1024) {
                instance.apply(chunk).await.map_err(anyhow::Error::msg)?;
            }
            ns = ns.min(t0.elapsed().as_nanos() as f64 / inner.len() as f64);
        }
        line.push_str(&format!("; apply alone {ns:>6.0} ns"));
        println!("{line}");
    }
    Ok(())
}
