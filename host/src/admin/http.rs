//! Reaching a running Sluice's endpoint as a client, over TCP or TLS, with
//! its token: one HTTP request for the admin commands (no HTTP client
//! crate), and the connection `sluice tail` opens its WebSocket on.

use std::path::Path;

use anyhow::Context;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::pgconn::tls::{pinned_client_config, SslMode, TlsSettings};

/// The bound on reaching the endpoint (TCP and TLS) and on one request's
/// answer: a Sluice that is stopped or unreachable fails the admin
/// command (and a container's HEALTHCHECK) instead of hanging it.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Where a running Sluice is and how to get in.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `http://HOST:PORT` or `https://HOST:PORT` (`ws://` and `wss://` are
    /// taken as the same).
    pub url: String,
    pub token: Option<String>,
    /// The CA that signed an `https` endpoint's certificate (default: the
    /// system's roots).
    pub ca: Option<std::path::PathBuf>,
    /// Instead of a CA and the host's name: trust exactly this certificate
    /// (PEM), the server's own `--tls-cert`, for a check made on the
    /// server's machine that dials it by a loopback address.
    pub pinned: Option<std::path::PathBuf>,
}

/// An answer: the status code and the body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// A byte stream to the endpoint, plain or TLS.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

impl Endpoint {
    /// The endpoint's URL, parsed: `(tls, host, authority)`.
    pub fn parts(&self) -> anyhow::Result<(bool, String, String)> {
        let url = url::Url::parse(&self.url)
            .with_context(|| format!("{}: expected http://HOST:PORT or https://HOST:PORT", self.url))?;
        let tls = match url.scheme() {
            "http" | "ws" => false,
            "https" | "wss" => true,
            other => anyhow::bail!("{}: scheme {other}: is not http, https, ws or wss", self.url),
        };
        let host = url.host_str().with_context(|| format!("{}: no host", self.url))?.to_string();
        let port = url.port_or_known_default().unwrap_or(if tls { 443 } else { 80 });
        let authority = format!("{host}:{port}");
        Ok((tls, host.trim_matches(['[', ']']).to_string(), authority))
    }

    /// The `Authorization` header's value, when there is a token.
    pub fn authorization(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// A connection to the endpoint: TCP, with TLS for `https`/`wss`
    /// (checked against `ca` or the system's roots, and the host's name).
    pub async fn connect(&self) -> anyhow::Result<Box<dyn Io>> {
        let (_, _, authority) = self.parts()?;
        tokio::time::timeout(CALL_TIMEOUT, self.connect_unbounded()).await.unwrap_or_else(|_| {
            anyhow::bail!("{authority} did not accept a connection within {} s", CALL_TIMEOUT.as_secs())
        })
    }

    async fn connect_unbounded(&self) -> anyhow::Result<Box<dyn Io>> {
        let (tls, host, authority) = self.parts()?;
        let tcp = tokio::net::TcpStream::connect(&authority)
            .await
            .with_context(|| format!("connecting to {authority} (is Sluice running there?)"))?;
        let _ = tcp.set_nodelay(true);
        if !tls {
            return Ok(Box::new(tcp));
        }
        let config = match &self.pinned {
            Some(cert) => pinned_client_config(cert).map_err(|e| anyhow::anyhow!("TLS: {e}"))?,
            None => {
                let root = self.ca.as_deref().map(Path::display).map(|p| p.to_string()).unwrap_or("system".into());
                TlsSettings::new(Some(SslMode::VerifyFull), Some(root), None, None)
                    .map_err(|e| anyhow::anyhow!("TLS: {e}"))?
                    .client_config()
            }
        };
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .with_context(|| format!("{host} is not a valid TLS server name"))?;
        let stream = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS handshake with {authority}"))?;
        Ok(Box::new(stream))
    }

    /// `METHOD path`, returning the answer whatever its status.
    pub async fn request(&self, method: &str, path: &str) -> anyhow::Result<Answer> {
        let (_, _, authority) = self.parts()?;
        let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {authority}\r\nContent-Length: 0\r\n");
        if let Some(value) = self.authorization() {
            request.push_str(&format!("Authorization: {value}\r\n"));
        }
        request.push_str("\r\n");
        let stream = self.connect().await?;
        let raw = tokio::time::timeout(CALL_TIMEOUT, exchange(stream, &request)).await.unwrap_or_else(|_| {
            anyhow::bail!("{authority} did not answer {method} {path} within {} s", CALL_TIMEOUT.as_secs())
        })?;
        let (head, body) = raw.split_once("\r\n\r\n").context("malformed HTTP answer")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("malformed HTTP status line: {}", head.lines().next().unwrap_or("")))?;
        Ok(Answer { status, body: body.to_string() })
    }
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, request: &str) -> anyhow::Result<String> {
    stream.write_all(request.as_bytes()).await.context("sending the request")?;
    let mut raw = Vec::new();
    // The server closes an HTTP/1.0 connection after its answer; a TLS
    // peer that skips close_notify is still a complete answer here.
    match stream.read_to_end(&mut raw).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e).context("reading the answer"),
    }
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

/// `sluice health [--ready]`: an error (exit 2) unless the answer is 200.
pub async fn health(endpoint: &Endpoint, ready: bool) -> anyhow::Result<()> {
    let path = if ready { "/readyz" } else { "/healthz" };
    let answer = endpoint.request("GET", path).await?;
    anyhow::ensure!(answer.status == 200, "{path}: {} {}", answer.status, answer.body.trim());
    println!("{}", answer.body.trim());
    Ok(())
}

/// `sluice reload`: `POST /plugins/reload`, and what it changed.
pub async fn reload(endpoint: &Endpoint) -> anyhow::Result<()> {
    let answer = endpoint.request("POST", "/plugins/reload").await?;
    anyhow::ensure!(answer.status == 200, "{} answered {}: {}", endpoint.url, answer.status, answer.body.trim());
    let report: serde_json::Value = serde_json::from_str(&answer.body).context("parsing the answer")?;
    let names = |key: &str| -> Vec<String> {
        report[key].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_string)).collect()
    };
    let mut said = false;
    for (key, what) in [("added", "added"), ("replaced", "replaced"), ("removed", "removed")] {
        for name in names(key) {
            println!("{what:<9} {name}");
            said = true;
        }
    }
    for refused in report["refused"].as_array().into_iter().flatten() {
        println!("refused   {}: {}", refused["name"].as_str().unwrap_or("?"), refused["error"].as_str().unwrap_or("?"));
        said = true;
    }
    if !said {
        println!("unchanged");
    }
    Ok(())
}
