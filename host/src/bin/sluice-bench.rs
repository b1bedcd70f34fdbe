//! `make bench`: throughput and boundary cost, reported (never asserted).
//!
//! Everything runs on this machine with the real plugin files and real
//! SQLite files in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::change::Encoder;
use sluice::plugin::{Limits, NetGrant, Registry};
use sluice::source::ChangeSource;
use sluice::status::Status;
use sluice::storage::sqlite::{Durability, SqliteChangeLog};
use sluice::streamer::{Streamer, StreamerOptions};
use tokio::sync::watch;

fn plugin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("sluice-bench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let registry = Registry::load(&plugin_dir(), Some(tmp.join("cache"))).await?;
    println!("# Sluice benchmarks ({} cores)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0));

    println!("\n## Plugin boundary (mock-source next-batch(512), guest generation included)");
    for row_bytes in [100usize, 1024] {
        boundary(&registry, row_bytes).await?;
    }

    println!("\n## Mock source -> SQLite change log (synchronous=FULL), 10 rows per transaction");
    for row_bytes in [100usize, 1024] {
        for durability in [Durability::Full, Durability::Normal] {
            store(&registry, &tmp, row_bytes, durability).await?;
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}

async fn boundary(registry: &Registry, row_bytes: usize) -> anyhow::Result<()> {
    let config = serde_json::json!({"rows_per_tx": 100, "row_bytes": row_bytes}).to_string();
    let mut source =
        registry.source("mock-source", config, Limits::default(), NetGrant::default()).map_err(anyhow::Error::msg)?;
    let mut stream = source.open(None).await?;
    let mut encoder = Encoder::default();
    let target = 300_000usize;
    let (mut n, mut pull, mut encode) = (0usize, Duration::ZERO, Duration::ZERO);
    while n < target {
        let t = Instant::now();
        let batch = stream.next_batch(512).await?;
        pull += t.elapsed();
        n += batch.len();
        let t = Instant::now();
        for m in batch {
            let _ = encoder.encode(m)?;
        }
        encode += t.elapsed();
    }
    println!(
        "row {row_bytes:>5} B: {:>6.0} ns/change across the boundary, {:>5.0} ns/change to encode JSON once ({n} changes)",
        pull.as_nanos() as f64 / n as f64,
        encode.as_nanos() as f64 / n as f64
    );
    Ok(())
}

async fn store(registry: &Registry, tmp: &Path, row_bytes: usize, durability: Durability) -> anyhow::Result<()> {
    let txs: u64 = if row_bytes > 512 { 20_000 } else { 50_000 };
    let config = serde_json::json!({"transactions": txs, "rows_per_tx": 10, "row_bytes": row_bytes}).to_string();
    let source =
        registry.source("mock-source", config, Limits::default(), NetGrant::default()).map_err(anyhow::Error::msg)?;
    let db = tmp.join(format!("store-{row_bytes}-{durability:?}.db"));
    let log = SqliteChangeLog::open(&db, durability)?;
    let status = Arc::new(Status::default());
    let (stop, stop_rx) = watch::channel(false);
    let hub = sluice::hub::Hub::new(Arc::new(sluice::storage::sqlite::SqliteReader::new(&db)), status.clone());
    let streamer = Streamer::new(Box::new(source), Box::new(log), hub, StreamerOptions::default(), status.clone());
    let started = Instant::now();
    let task = tokio::spawn(streamer.run(stop_rx));
    let last = sluice::watermark::to_lexi(txs as u128);
    loop {
        if status.snapshot().last_watermark.as_deref() == Some(last.as_str()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = stop.send(true);
    task.await??;
    let bytes =
        std::fs::metadata(&db)?.len() + std::fs::metadata(db.with_extension("db-wal")).map(|m| m.len()).unwrap_or(0);
    println!(
        "row {row_bytes:>5} B, sync {:<6}: {:>8.0} tx/s, {:>9.0} changes/s ({txs} tx in {secs:.2} s, log {} MiB)",
        format!("{durability:?}"),
        txs as f64 / secs,
        (txs * 10) as f64 / secs,
        bytes >> 20
    );
    Ok(())
}
