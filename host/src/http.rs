//! The HTTP endpoint: health checks and `GET /status`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use tokio::sync::watch;

use crate::status::{Snapshot, Status};

pub fn router(status: Arc<Status>) -> Router {
    Router::new()
        .route("/", get(ok))
        .route("/keepalive", get(ok))
        .route("/status", get(status_json))
        .with_state(status)
}

async fn ok() -> &'static str {
    "OK"
}

async fn status_json(State(status): State<Arc<Status>>) -> Json<Snapshot> {
    Json(status.snapshot())
}

/// Binds `addr` (so a taken port fails start-up with a clear error) and
/// returns the bound address and the serving future.
pub async fn bind(
    addr: &str,
    router: Router,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<(
    SocketAddr,
    impl std::future::Future<Output = std::io::Result<()>>,
)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    });
    Ok((local, async move { serve.await }))
}
