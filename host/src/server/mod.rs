//! The HTTP endpoint: health checks, `GET /status`, the subscriber
//! WebSocket protocol in `changes`, and Zero's custom change-source protocol
//! (Sluice as zero-cache's upstream) in `upstream`.

pub mod access;
pub mod changes;
pub mod closing;
pub mod plugins;
pub mod tls;
pub mod upstream;
pub mod websocket;
pub mod zero_tables;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use tokio::sync::watch;

use crate::hub::Hub;
use crate::status::Status;
use crate::subscriber;

/// What request handlers share.
#[derive(Clone)]
pub struct AppState {
    pub hub: Arc<Hub>,
    pub status: Arc<Status>,
    pub subscriber_limits: subscriber::Limits,
    pub ping_interval: std::time::Duration,
    /// Subscriber filters (`FilterHost::none()` without a plugin directory).
    pub filters: Arc<crate::filter::FilterHost>,
    /// The permissions row of Zero's tables when Sluice declares them for
    /// a zero-cache (`--zero-permissions`).
    pub zero_permissions: Option<Arc<zero_tables::Permissions>>,
    /// The token and the connection caps.
    pub access: Arc<access::Access>,
    /// How long the source may back off before `/readyz` says not ready.
    pub ready_backoff: std::time::Duration,
    /// Becomes true when the service stops: every stream connection is
    /// closed with 1001 (going away).
    pub shutdown: watch::Receiver<bool>,
    /// The plugin directory, for `/plugins` (`None`: none is used).
    pub plugins: Option<Arc<crate::plugin::Registry>>,
}

/// The reason of the close (1001, going away) every stream connection gets
/// when Sluice shuts down.
pub const SHUTTING_DOWN: &str = "Sluice is shutting down";

/// That close frame, on a tungstenite socket.
pub fn going_away() -> axum::extract::ws::Message {
    axum::extract::ws::Message::Close(Some(axum::extract::ws::CloseFrame { code: 1001, reason: SHUTTING_DOWN.into() }))
}

/// Resolves once the service is stopping (or its stop signal is gone).
pub async fn stopping(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// The routes. The health checks stay open; everything else needs the
/// token when one is set.
pub fn router(state: AppState) -> Router {
    let metrics = Arc::new(crate::metrics::Metrics::new(
        state.status.clone(),
        state.access.clone(),
        state.hub.clone(),
        state.ready_backoff,
    ));
    // The same families over OTLP, when that is configured.
    crate::telemetry::bridge::export(metrics.clone(), &state.status);
    let guarded = Router::new()
        .route("/status", get(status_json))
        .route("/metrics", get(move || metrics_text(metrics.clone())))
        .route("/plugins", get(plugins::list))
        .route("/plugins/reload", axum::routing::post(plugins::reload))
        .route("/replication/{version}/changes", get(changes::changes))
        .route("/replication/{version}/snapshot", get(changes::snapshot))
        .route("/changes/v0/stream", get(upstream::stream))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), access::require_token));
    Router::new()
        .route("/", get(ok))
        .route("/keepalive", get(ok))
        .route("/healthz", get(ok))
        .route("/readyz", get(ready))
        .merge(guarded)
        .with_state(state)
}

/// 200 when this host should get traffic, else 503 with the reason (see
/// [`crate::status::Status::readiness`]).
async fn ready(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match state.status.readiness(state.ready_backoff) {
        Ok(()) => "ready\n".into_response(),
        Err(reason) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")).into_response(),
    }
}

async fn metrics_text(metrics: Arc<crate::metrics::Metrics>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match metrics.render() {
        Ok(text) => {
            ([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
                .into_response()
        }
        Err(_) => axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn ok() -> &'static str {
    "OK"
}

/// The status snapshot, and the positions reserved for consumers.
async fn status_json(State(state): State<AppState>) -> Json<serde_json::Value> {
    let mut status = serde_json::to_value(state.status.snapshot()).unwrap_or_default();
    let reservations: Vec<serde_json::Value> = state
        .hub
        .reservations()
        .list()
        .into_iter()
        .map(|(holder, watermark, connected)| serde_json::json!({"holder": holder, "watermark": watermark, "connected": connected}))
        .collect();
    if let Some(map) = status.as_object_mut() {
        map.insert("reservations".into(), reservations.into());
        let views = state.hub.subscriber_views();
        map.insert("subscriberPositions".into(), serde_json::to_value(views).unwrap_or_default());
        map.insert("subscriberMemory".into(), serde_json::to_value(state.hub.budget().view()).unwrap_or_default());
        map.insert("catchup".into(), serde_json::to_value(state.hub.catchups().view()).unwrap_or_default());
    }
    Json(status)
}

/// The client's address, for the connection caps and log lines (axum's
/// own `SocketAddr` connect info covers only its TCP listener, not TLS).
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

impl<'a> axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, NoDelay>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'a, NoDelay>) -> Self {
        Peer(*stream.remote_addr())
    }
}

impl<'a> axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, tls::TlsListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'a, tls::TlsListener>) -> Self {
        Peer(*stream.remote_addr())
    }
}

/// A plain TCP listener whose connections have TCP_NODELAY: small frames
/// and acks go back and forth, and without it each flow-control round trip
/// waits for a delayed ACK (~40 ms).
pub struct NoDelay(tokio::net::TcpListener);

impl axum::serve::Listener for NoDelay {
    type Io = tokio::net::TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (tcp, peer) = axum::serve::Listener::accept(&mut self.0).await;
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        (tcp, peer)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// The server's future (boxed: plain and TLS listeners differ in type).
pub type Serving = std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<()>> + Send>>;

/// Binds `addr` (so a taken port fails start-up with a clear error) and
/// returns the bound address and the serving future; with `tls`, every
/// connection is TLS.
pub async fn bind(
    addr: &str,
    router: Router,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<(SocketAddr, Serving)> {
    bind_with_tls(addr, router, shutdown, None).await
}

pub async fn bind_with_tls(
    addr: &str,
    router: Router,
    mut shutdown: watch::Receiver<bool>,
    tls: Option<Arc<tls::EndpointTls>>,
) -> anyhow::Result<(SocketAddr, Serving)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    let service = router.into_make_service_with_connect_info::<Peer>();
    let stopped = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    if let Some(tls) = tls {
        let serve = axum::serve(tls.listen(listener)?, service).with_graceful_shutdown(stopped);
        return Ok((local, Box::pin(async move { serve.await })));
    }
    let serve = axum::serve(NoDelay(listener), service).with_graceful_shutdown(stopped);
    Ok((local, Box::pin(async move { serve.await })))
}
