//! TLS for source plugins, done by the host: a plugin whose `url` is
//! `wss://` or `https://` dials a loopback forwarder instead, and the
//! forwarder opens the TLS connection to the upstream with rustls, checking
//! its certificate (the system's CAs, or the config's `tls_ca` file) and
//! name. The guest needs no TLS stack, and its network grant holds only the
//! forwarder's address.
//!
//! The host adds `"tls_via": "127.0.0.1:PORT"` to the plugin's config; a
//! plugin that supports this dials it and still names the upstream in what
//! it sends (the WebSocket handshake's Host).
//!
//! Two kinds of upstream:
//! * a `wss://` or `https://` `url`: TLS from the first byte;
//! * `"tls": true` beside `host` and `port`: MySQL/MariaDB, where TLS
//!   starts inside the protocol. The forwarder passes the server's greeting
//!   to the plugin, turns the plugin's handshake response into an SSL
//!   request, upgrades, sends the response over TLS and renumbers the
//!   packets of the login exchange (each side counts its own); after the
//!   login it only copies bytes.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};

use crate::pgconn::tls::SslMode;

/// The upstream behind a TLS URL in a plugin config, if there is one.
struct TlsUpstream {
    host: String,
    port: u16,
    ca: Option<PathBuf>,
    /// TLS starts after the MySQL greeting, not at once.
    mysql: bool,
}

fn tls_upstream(config: &serde_json::Map<String, serde_json::Value>) -> anyhow::Result<Option<TlsUpstream>> {
    let ca = match config.get("tls_ca") {
        Some(v) => Some(PathBuf::from(v.as_str().context("source config: `tls_ca` must be a file path")?)),
        None => None,
    };
    if config.get("tls") == Some(&serde_json::Value::Bool(true)) {
        let host = config.get("host").and_then(|h| h.as_str()).context("source config: `tls` needs `host`")?;
        let port = config.get("port").and_then(|p| p.as_u64()).and_then(|p| u16::try_from(p).ok()).unwrap_or(3306);
        return Ok(Some(TlsUpstream { host: host.to_string(), port, ca, mysql: true }));
    }
    let Some(url) = config.get("url").and_then(|u| u.as_str()) else { return Ok(None) };
    let parsed = url::Url::parse(url).with_context(|| format!("source config: `url` {url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "wss" | "https") {
        return Ok(None);
    }
    let host = parsed.host_str().with_context(|| format!("source config: `url` {url:?} has no host"))?;
    Ok(Some(TlsUpstream {
        host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
        port: parsed.port().unwrap_or(443),
        ca,
        mysql: false,
    }))
}

/// When the config's `url` is `wss://` or `https://`: starts the forwarder
/// and returns the config with `tls_via` set. Otherwise the config as given.
pub async fn prepare(config: &str) -> anyhow::Result<String> {
    let Ok(serde_json::Value::Object(mut map)) = serde_json::from_str::<serde_json::Value>(config) else {
        return Ok(config.to_string());
    };
    let Some(upstream) = tls_upstream(&map)? else { return Ok(config.to_string()) };
    let client = client_config(upstream.ca.as_ref())?;
    let listener = TcpListener::bind("127.0.0.1:0").await.context("starting the TLS forwarder")?;
    let via = listener.local_addr()?;
    tracing::info!(
        upstream = format!("{}:{}", upstream.host, upstream.port),
        via = %via,
        "the source plugin reaches its TLS upstream through the host's forwarder"
    );
    tokio::spawn(forward(listener, upstream, client));
    map.insert("tls_via".into(), via.to_string().into());
    Ok(serde_json::Value::Object(map).to_string())
}

/// The check `verify-full` makes for PostgreSQL: the chain against
/// `tls_ca` (or the system's CAs) and the name.
fn client_config(ca: Option<&PathBuf>) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let roots = ca.map(|f| f.display().to_string()).unwrap_or_else(|| "system".into());
    let settings = crate::pgconn::tls::TlsSettings::new(Some(SslMode::VerifyFull), Some(roots), None, None)
        .map_err(|e| anyhow::anyhow!("the CA for the source's TLS upstream (`tls_ca`): {e}"))?;
    Ok(settings.client_config())
}

async fn forward(listener: TcpListener, upstream: TlsUpstream, client: Arc<rustls::ClientConfig>) {
    let upstream = Arc::new(upstream);
    loop {
        let Ok((plugin_side, _)) = listener.accept().await else { continue };
        let (upstream, client) = (upstream.clone(), client.clone());
        tokio::spawn(async move {
            if let Err(e) = pipe(plugin_side, &upstream, client).await {
                // The plugin sees its connection closed and retries; this
                // line says why.
                tracing::warn!("TLS to the source's upstream {}:{}: {e:#}", upstream.host, upstream.port);
            }
        });
    }
}

async fn pipe(
    mut plugin_side: TcpStream,
    upstream: &TlsUpstream,
    client: Arc<rustls::ClientConfig>,
) -> anyhow::Result<()> {
    let mut tcp = TcpStream::connect((upstream.host.as_str(), upstream.port)).await.context("connecting")?;
    tcp.set_nodelay(true)?;
    plugin_side.set_nodelay(true)?;
    let response = match upstream.mysql {
        true => Some(mysql::start(&mut plugin_side, &mut tcp).await?),
        false => None,
    };
    let name = ServerName::try_from(upstream.host.clone()).context("the upstream's name")?;
    let mut tls = tokio_rustls::TlsConnector::from(client).connect(name, tcp).await.map_err(|e| {
        let hint = if e.to_string().contains("invalid peer certificate") {
            " (check `tls_ca` in the source config, and that the certificate names the URL's host)"
        } else {
            ""
        };
        anyhow::anyhow!("TLS handshake: {e}{hint}")
    })?;
    if let Some(response) = response {
        mysql::login(&mut plugin_side, &mut tls, response).await?;
    }
    // Either side closing ends both.
    let _ = tokio::io::copy_bidirectional(&mut plugin_side, &mut tls).await;
    Ok(())
}

/// MySQL/MariaDB's in-protocol TLS upgrade, seen from the middle.
mod mysql {
    use anyhow::{bail, Context};
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

    /// The capability bit of TLS.
    const CLIENT_SSL: u32 = 0x0800;

    struct Packet {
        seq: u8,
        payload: Vec<u8>,
    }

    async fn read(from: &mut (impl AsyncRead + Unpin)) -> anyhow::Result<Packet> {
        let mut header = [0u8; 4];
        from.read_exact(&mut header).await.context("reading a packet")?;
        let len = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await.context("reading a packet")?;
        Ok(Packet { seq: header[3], payload })
    }

    async fn write(to: &mut (impl AsyncWrite + Unpin), seq: u8, payload: &[u8]) -> anyhow::Result<()> {
        let len = (payload.len() as u32).to_le_bytes();
        to.write_all(&[len[0], len[1], len[2], seq]).await?;
        to.write_all(payload).await?;
        to.flush().await?;
        Ok(())
    }

    /// Relays the greeting, then sends the SSL request built from the
    /// plugin's handshake response; returns that response (with the TLS bit
    /// set) for after the upgrade.
    pub async fn start(
        plugin: &mut tokio::net::TcpStream,
        server: &mut tokio::net::TcpStream,
    ) -> anyhow::Result<Vec<u8>> {
        let greeting = read(server).await.context("the server's greeting")?;
        if greeting.payload.first() == Some(&0xff) {
            bail!(
                "the server refused the connection: {}",
                String::from_utf8_lossy(&greeting.payload[3.min(greeting.payload.len())..])
            );
        }
        // Protocol 10: version, NUL, thread id (4), scramble (8), filler, capabilities (low 2 bytes).
        let caps_at = greeting.payload.iter().position(|b| *b == 0).map(|nul| nul + 1 + 4 + 8 + 1);
        let caps = caps_at
            .and_then(|at| greeting.payload.get(at..at + 2))
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .context("a greeting too short to hold the server's capabilities")?;
        if caps & CLIENT_SSL == 0 {
            bail!("the MariaDB server does not offer TLS (start it with ssl_cert and ssl_key), and the source config asks for it");
        }
        write(plugin, greeting.seq, &greeting.payload).await?;
        let mut response = read(plugin).await.context("the plugin's handshake response")?;
        if response.payload.len() < 32 {
            bail!("the plugin's handshake response is too short ({} bytes)", response.payload.len());
        }
        let flags =
            u32::from_le_bytes([response.payload[0], response.payload[1], response.payload[2], response.payload[3]]);
        response.payload[..4].copy_from_slice(&(flags | CLIENT_SSL).to_le_bytes());
        // The SSL request is the response's first 32 bytes: capabilities,
        // max packet size, character set, reserved.
        write(server, response.seq, &response.payload[..32]).await?;
        Ok(response.payload)
    }

    /// Sends the handshake response over TLS and relays the login exchange,
    /// each packet renumbered by one (the SSL request took a number on the
    /// server's side only), until the server's OK or error.
    pub async fn login(
        plugin: &mut tokio::net::TcpStream,
        server: &mut (impl AsyncRead + AsyncWrite + Unpin),
        response: Vec<u8>,
    ) -> anyhow::Result<()> {
        write(server, 2, &response).await?;
        loop {
            let from_server = read(server).await.context("the login")?;
            let done = matches!(from_server.payload.first(), Some(0x00) | Some(0xff));
            write(plugin, from_server.seq.wrapping_sub(1), &from_server.payload).await?;
            if done {
                return Ok(());
            }
            let from_plugin = read(plugin).await.context("the login")?;
            write(server, from_plugin.seq.wrapping_add(1), &from_plugin.payload).await?;
        }
    }
}
