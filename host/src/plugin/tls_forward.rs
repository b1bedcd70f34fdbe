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

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};

/// The upstream behind a TLS URL in a plugin config, if there is one.
struct TlsUpstream {
    host: String,
    port: u16,
    ca: Option<PathBuf>,
}

fn tls_upstream(config: &serde_json::Map<String, serde_json::Value>) -> anyhow::Result<Option<TlsUpstream>> {
    let Some(url) = config.get("url").and_then(|u| u.as_str()) else { return Ok(None) };
    let parsed = url::Url::parse(url).with_context(|| format!("source config: `url` {url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "wss" | "https") {
        return Ok(None);
    }
    let host = parsed.host_str().with_context(|| format!("source config: `url` {url:?} has no host"))?;
    let ca = match config.get("tls_ca") {
        Some(v) => Some(PathBuf::from(v.as_str().context("source config: `tls_ca` must be a file path")?)),
        None => None,
    };
    Ok(Some(TlsUpstream {
        host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
        port: parsed.port().unwrap_or(443),
        ca,
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

fn client_config(ca: Option<&PathBuf>) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(file) => {
            let certs = CertificateDer::pem_file_iter(file)
                .and_then(|c| c.collect::<Result<Vec<_>, _>>())
                .with_context(|| format!("source config: tls_ca {}", file.display()))?;
            roots.add_parsable_certificates(certs);
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    anyhow::ensure!(
        !roots.is_empty(),
        "no CA certificates to check the source's TLS upstream with: set `tls_ca` in the source config, or install \
         the system's CA certificates"
    );
    let config = rustls::ClientConfig::builder_with_provider(crate::pgconn::tls::crypto_provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
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
    let tcp = TcpStream::connect((upstream.host.as_str(), upstream.port)).await.context("connecting")?;
    tcp.set_nodelay(true)?;
    plugin_side.set_nodelay(true)?;
    let name = ServerName::try_from(upstream.host.clone()).context("the upstream's name")?;
    let mut tls = tokio_rustls::TlsConnector::from(client).connect(name, tcp).await.map_err(|e| {
        let hint = if e.to_string().contains("invalid peer certificate") {
            " (check `tls_ca` in the source config, and that the certificate names the URL's host)"
        } else {
            ""
        };
        anyhow::anyhow!("TLS handshake: {e}{hint}")
    })?;
    // Either side closing ends both.
    let _ = tokio::io::copy_bidirectional(&mut plugin_side, &mut tls).await;
    Ok(())
}
