//! How much WAL the upstream keeps for the slot (`/status`
//! `retainedWalBytes`, `sluice_source_retained_wal_bytes`), measured beside
//! the replication loop on a connection of its own: every 15 s, and every
//! 2 s while the slot does not exist yet.

use std::sync::Arc;
use std::time::Duration;

use crate::status::Status;

/// Measures until dropped (aborted with the service).
pub async fn watch(source_config: String, status: Arc<Status>) {
    let Ok(upstream) = crate::admin::postgres::Upstream::from_config(&source_config) else {
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
