//! The zero-custom-source plugin from a local test upstream (Zero's custom
//! change-source protocol over a WebSocket on this machine) into the durable
//! SQLite change log, beside the mock-source plugin on the same shape: the
//! difference is the cost of the socket, the WebSocket framing and the JSON
//! path inside the sandbox.

use std::path::Path;

use sluice::plugin::{Registry, SandboxLimits};
use sluice::storage::sqlite::Durability;

use custom_upstream::{Tx, Upstream};

pub async fn run(registry: &std::sync::Arc<Registry>, tmp: &Path) -> anyhow::Result<()> {
    for (rows, row_bytes) in [(1u32, 100usize), (10, 100), (100, 100), (10, 1024)] {
        let changes: u64 = if row_bytes > 512 { 100_000 } else { 200_000 };
        let txs = (changes / rows as u64).max(1);
        one(registry, tmp, txs, rows, row_bytes).await?;
        super::store_with(registry, tmp, txs, rows, row_bytes, Durability::Full, false).await?;
    }
    Ok(())
}

/// Rows shaped like the mock source's: id, a big integer, a payload, the tx.
fn history(txs: u64, rows: u32, row_bytes: usize) -> (Tx, Vec<Tx>) {
    let relation = serde_json::json!({"schema": "public", "name": "bench", "rowKey": {"columns": ["id"]}});
    let snapshot = Tx::new(
        "0a",
        &[serde_json::json!({"tag": "create-table", "spec": {"schema": "public",
        "name": "bench", "columns": {"id": {"pos": 1, "dataType": "int8"}, "big": {"pos": 2, "dataType": "int8"},
        "payload": {"pos": 3, "dataType": "text"}, "tx": {"pos": 4, "dataType": "int8"}}, "primaryKey": ["id"]}})],
    );
    let payload = "x".repeat(row_bytes.saturating_sub(40));
    let history = (1..=txs)
        .map(|t| {
            let changes: Vec<serde_json::Value> = (0..rows as u64)
                .map(|r| {
                    let id = t * rows as u64 + r;
                    serde_json::json!({"tag": "insert", "relation": relation,
                        "new": {"id": id, "big": (1u64 << 60) + id, "payload": payload, "tx": t}})
                })
                .collect();
            Tx::new(&watermark(t), &changes)
        })
        .collect();
    (snapshot, history)
}

fn watermark(t: u64) -> String {
    format!("1{t:09}")
}

async fn one(
    registry: &std::sync::Arc<Registry>,
    tmp: &Path,
    txs: u64,
    rows: u32,
    row_bytes: usize,
) -> anyhow::Result<()> {
    let (snapshot, history) = history(txs, rows, row_bytes);
    let up = Upstream::start(snapshot).await;
    for tx in history {
        up.append(tx);
    }
    let config = serde_json::json!({"url": up.url()}).to_string();
    let grant = sluice::plugin::net::grant_for(&config, &[])?;
    let source = registry
        .source("zero-custom-source", config, SandboxLimits::default(), grant)
        .await
        .map_err(anyhow::Error::msg)?;
    let db = tmp.join(format!("custom-{rows}-{row_bytes}.db"));
    let log = sluice::storage::open::LogStore::sqlite(db).open(false)?;
    let (service, secs) = super::store_until(Box::new(source), log.writer, log.reader, &watermark(txs)).await?;
    let status = service.status().clone();
    service.stop().await?;
    up.shutdown();
    println!(
        "zero-custom-source {rows:>3} rows/tx of {row_bytes:>4} B: {:>8.0} tx/s, {:>9.0} changes/s ({txs} tx in {secs:.2} s)",
        txs as f64 / secs,
        (txs * rows as u64) as f64 / secs,
    );
    println!("{}", super::stage_line(&status, secs));
    Ok(())
}
