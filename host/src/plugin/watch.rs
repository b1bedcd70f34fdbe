//! Watching the plugin directory: a change there makes the registry rescan
//! it, so a file dropped in (or replaced, or removed) takes effect while
//! Sluice runs.
//!
//! Events are debounced (a copy writes many times), and a periodic rescan
//! covers what events can miss: filesystems without notifications (some
//! network and container mounts) or a watcher that could not start.

use std::sync::Arc;
use std::time::Duration;

use notify::Watcher;
use tokio::sync::mpsc;

use super::Registry;

/// How long the directory must be quiet after an event before a rescan.
const SETTLE: Duration = Duration::from_millis(300);

/// Watches the registry's directory until the runtime stops, rescanning on
/// change and every `every` (`None`: only on change).
pub fn spawn(registry: Arc<Registry>, every: Option<Duration>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.send(());
        }
    })
    .and_then(|mut w| w.watch(registry.dir(), notify::RecursiveMode::NonRecursive).map(|()| w));
    let watcher = match watcher {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(
                dir = %registry.dir().display(),
                "cannot watch the plugin directory ({e}); it is rescanned every {} s and on SIGHUP",
                every.unwrap_or(FALLBACK).as_secs()
            );
            None
        }
    };
    let every = if watcher.is_some() { every } else { Some(every.unwrap_or(FALLBACK)) };
    tokio::spawn(async move {
        // Owned here: dropping the watcher stops the events.
        let _watcher = watcher;
        let mut tick = every.map(|d| tokio::time::interval_at(tokio::time::Instant::now() + d, d));
        let mut watching = _watcher.is_some();
        loop {
            if !watching && tick.is_none() {
                return;
            }
            tokio::select! {
                event = rx.recv(), if watching => {
                    if event.is_none() {
                        watching = false;
                        continue;
                    }
                    // Wait for the writes to settle.
                    while let Ok(Some(())) = tokio::time::timeout(SETTLE, rx.recv()).await {}
                }
                _ = async { tick.as_mut().expect("guarded").tick().await }, if tick.is_some() => {}
            }
            if let Err(e) = registry.rescan().await {
                tracing::warn!("plugin directory: {e:#}");
            }
        }
    });
}

/// Rescan interval when the directory cannot be watched.
const FALLBACK: Duration = Duration::from_secs(10);
