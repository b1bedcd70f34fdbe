//! Purging the change log and closing laggards, on timers.
//!
//! The purge floor is the lowest ack of the connected subscribers (and, when
//! configured, the retention window: the newest N transactions and those
//! stored within T). With no subscribers only the retention window holds the
//! log. Only rows strictly below the floor are deleted and the newest
//! transaction always stays, so a subscriber at the floor can still catch up.
//! Subscribers that disconnected a moment ago still count (see
//! `crate::reservations`), and for that while after a start, when the acks
//! of the previous process's subscribers are unknown, nothing is purged.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::hub::Hub;
use crate::status::Status;

#[derive(Debug, Clone)]
pub struct CleanupOptions {
    pub purge_interval: Duration,
    pub retain_transactions: Option<u64>,
    pub retain_for: Option<Duration>,
    /// Zero's slow-subscriber grace period; `None` disables laggard closing.
    pub lag_grace: Option<Duration>,
}

impl Default for CleanupOptions {
    fn default() -> Self {
        CleanupOptions {
            purge_interval: Duration::from_secs(30),
            retain_transactions: None,
            retain_for: None,
            lag_grace: Some(Duration::from_secs(30)),
        }
    }
}

/// One purge pass. Returns the floor used and the rows deleted.
/// Blocking: run it on a blocking thread.
pub fn purge_once(hub: &Hub, options: &CleanupOptions) -> anyhow::Result<(Option<String>, u64)> {
    // While a lineage is being established the log may be replaced under
    // any floor computed now.
    let Some(replica_version) = hub.replica_version() else { return Ok((None, 0)) };
    let reader = hub.reader();
    let bounds = reader.bounds()?;
    let mut floor = match hub.min_ack() {
        Some(ack) => ack.to_string(),
        None => bounds.last_watermark.clone(),
    };
    if options.retain_transactions.is_some() || options.retain_for.is_some() {
        if let Some(keep) = reader.retention_floor(options.retain_transactions, options.retain_for)? {
            floor = floor.min(keep);
        }
    }
    if hub.holding_for_returning_subscribers() {
        if let Some(min) = &bounds.min_watermark {
            floor = floor.min(min.clone());
        }
    }
    if bounds.min_watermark.as_deref().is_some_and(|min| min >= floor.as_str()) {
        return Ok((Some(floor), 0));
    }
    let deleted = reader.purge_before(&floor, &replica_version)?;
    Ok((Some(floor), deleted))
}

pub async fn run(hub: Arc<Hub>, status: Arc<Status>, options: CleanupOptions, mut shutdown: watch::Receiver<bool>) {
    let mut purge = tokio::time::interval(options.purge_interval);
    purge.tick().await;
    let mut monitor = tokio::time::interval(Duration::from_secs(1));
    let mut trimmer = crate::subscriber::trim::Trimmer::default();
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = monitor.tick() => {
                hub.check_laggards(options.lag_grace);
                hub.enforce_budget();
                let budget = hub.budget();
                if trimmer.observe(budget.used(), budget.subscribers()) {
                    tokio::task::spawn_blocking(|| {
                        let started = std::time::Instant::now();
                        crate::subscriber::trim::release_free_memory();
                        tracing::debug!(elapsed_ms = started.elapsed().as_millis() as u64, "returned freed memory to the system");
                    });
                }
            }
            _ = purge.tick() => {
                let (h, o) = (hub.clone(), options.clone());
                let pass = tokio::task::spawn_blocking(move || {
                    let waiting = h.holding_for_returning_subscribers();
                    let purged = purge_once(&h, &o)?;
                    // The size is for `/status` and `/metrics`; not knowing it is no failure.
                    let size = h.reader().size_bytes().unwrap_or(None);
                    Ok::<_, anyhow::Error>((purged, h.reader().bounds()?, size, waiting))
                });
                match pass.await {
                    Ok(Ok(((floor, deleted), bounds, log_bytes, waiting))) => {
                        if deleted > 0 {
                            tracing::info!(floor = floor.as_deref().unwrap_or("-"), deleted, "purged the change log");
                        }
                        status.update(|s| {
                            s.min_watermark = bounds.min_watermark;
                            let report = s.purge.get_or_insert_with(Default::default);
                            report.floor = floor;
                            report.passes += 1;
                            report.deleted_rows += deleted;
                            report.log_bytes = log_bytes;
                            report.waiting_for_returning_subscribers = waiting;
                        });
                    }
                    Ok(Err(e)) => tracing::warn!("purging the change log failed (retrying next pass): {e:#}"),
                    Err(e) => tracing::warn!("purge task failed: {e}"),
                }
            }
        }
    }
}
