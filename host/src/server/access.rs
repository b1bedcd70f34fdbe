//! Who may use the endpoint, and how many at once: the shared token, and the
//! caps on open stream connections (in total and per client address).
//!
//! The token is accepted three ways, for the clients Sluice serves:
//! `Authorization: Bearer TOKEN`; `Authorization: Basic` with TOKEN as the
//! password (any user name), which is what zero-cache sends for a
//! `ZERO_CHANGE_STREAMER_URI` or custom upstream URI of the form
//! `ws://sluice:TOKEN@host:port`; and `?token=TOKEN` for clients that can only
//! set a URL and keep its query (zero-cache's custom upstream does; its
//! change-streamer client drops the query but keeps the user info).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;

#[derive(Debug, Clone, Default)]
pub struct AccessOptions {
    /// Required on every request but the health checks (`None`: open).
    pub token: Option<String>,
    /// Open stream connections in total (0: no cap).
    pub max_connections: usize,
    /// Open stream connections from one client address (0: no cap).
    pub max_per_address: usize,
}

pub struct Access {
    options: AccessOptions,
    open: Mutex<Counts>,
    /// Notified when the last stream connection ends.
    all_closed: tokio::sync::Notify,
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// A connection refused for the caps: 503 with the reason, retry later.
pub struct Refusal(pub String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "5")], self.0).into_response()
    }
}

/// One admitted stream connection; dropping it frees its place.
pub struct Permit {
    access: Arc<Access>,
    ip: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut open = self.access.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total = open.total.saturating_sub(1);
        if open.total == 0 {
            self.access.all_closed.notify_waiters();
        }
        if let Some(n) = open.by_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.by_address.remove(&self.ip);
            }
        }
    }
}

impl Access {
    pub fn new(options: AccessOptions) -> Arc<Access> {
        Arc::new(Access { options, open: Mutex::new(Counts::default()), all_closed: tokio::sync::Notify::new() })
    }

    /// No token and no caps (tests, and `sluice run` without the options).
    pub fn open() -> Arc<Access> {
        Access::new(AccessOptions::default())
    }

    pub fn requires_token(&self) -> bool {
        self.options.token.is_some()
    }

    /// Open stream connections now.
    pub fn connections(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    /// Resolves once no stream connection is open (at once if none is): a
    /// graceful shutdown waits here for every subscriber's close handshake.
    pub async fn all_closed(&self) {
        loop {
            let notified = self.all_closed.notified();
            if self.connections() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// A place for one more stream connection from `peer`, or the refusal
    /// (logged once here).
    pub fn admit(self: &Arc<Self>, peer: SocketAddr) -> Result<Permit, Refusal> {
        let ip = peer.ip();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let from_peer = open.by_address.get(&ip).copied().unwrap_or(0);
        let refusal = if self.options.max_connections > 0 && open.total >= self.options.max_connections {
            Some(format!("too many connections: {} open, the limit is {}", open.total, self.options.max_connections))
        } else if self.options.max_per_address > 0 && from_peer >= self.options.max_per_address {
            Some(format!(
                "too many connections from {ip}: {from_peer} open, the limit per address is {}",
                self.options.max_per_address
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            tracing::warn!(peer = %peer, "refused a stream connection: {reason}");
            return Err(Refusal(reason));
        }
        open.total += 1;
        *open.by_address.entry(ip).or_default() += 1;
        Ok(Permit { access: self.clone(), ip })
    }

    fn token_ok(&self, headers: &HeaderMap, query: Option<&str>) -> bool {
        let Some(expected) = &self.options.token else { return true };
        let offered = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(token_of_authorization)
            .or_else(|| {
                query.and_then(|q| {
                    url::form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "token").map(|(_, v)| v.into_owned())
                })
            });
        offered.is_some_and(|t| same(t.as_bytes(), expected.as_bytes()))
    }
}

/// The token in `Bearer TOKEN` or in the password of `Basic base64(user:TOKEN)`.
fn token_of_authorization(value: &str) -> Option<String> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        Some(rest.trim().to_string())
    } else if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD.decode(rest.trim()).ok()?;
        let text = String::from_utf8(decoded).ok()?;
        text.split_once(':').map(|(_, password)| password.to_string())
    } else {
        None
    }
}

/// Compares without stopping at the first difference, so the time taken
/// does not tell how much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware: 401 with one log line for a request without the token.
pub async fn require_token(
    State(app): State<AppState>,
    ConnectInfo(super::Peer(peer)): ConnectInfo<super::Peer>,
    request: Request,
    next: Next,
) -> Response {
    if app.access.token_ok(request.headers(), request.uri().query()) {
        return next.run(request).await;
    }
    let had = request.headers().contains_key(header::AUTHORIZATION)
        || request.uri().query().is_some_and(|q| q.contains("token="));
    tracing::warn!(
        peer = %peer,
        path = request.uri().path(),
        "refused a request: {}",
        if had { "wrong token" } else { "no token (send Authorization: Bearer TOKEN)" }
    );
    (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], "a valid token is required\n").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_from_bearer_basic_and_the_query() {
        let access = Access::new(AccessOptions { token: Some("s3cret".into()), ..Default::default() });
        let with = |value: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, value.parse().unwrap());
            h
        };
        assert!(access.token_ok(&with("Bearer s3cret"), None));
        // "sluice:s3cret", as `ws` sends for ws://sluice:s3cret@host/.
        assert!(access.token_ok(&with("Basic c2x1aWNlOnMzY3JldA=="), None));
        assert!(access.token_ok(&HeaderMap::new(), Some("a=1&token=s3cret")));
        assert!(!access.token_ok(&with("Bearer s3cre"), None));
        assert!(!access.token_ok(&with("Basic c2x1aWNlOnMzY3JldA"), Some("token=no")));
        assert!(!access.token_ok(&HeaderMap::new(), None));
        assert!(Access::open().token_ok(&HeaderMap::new(), None));
    }

    #[test]
    fn caps_count_open_connections() {
        let access = Access::new(AccessOptions { max_connections: 3, max_per_address: 2, ..Default::default() });
        let a: SocketAddr = "10.0.0.1:1000".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1000".parse().unwrap();
        let first = access.admit(a).ok().unwrap();
        let _second = access.admit(a).ok().unwrap();
        assert!(access.admit(a).is_err(), "a third from one address");
        let _third = access.admit(b).ok().unwrap();
        assert!(access.admit(b).is_err(), "a fourth in total");
        drop(first);
        assert_eq!(access.connections(), 2);
        assert!(access.admit(a).is_ok());
    }
}
