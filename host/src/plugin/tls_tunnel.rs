//! The `tls` interface of the plugin contract (`wit/sluice.wit`, since
//! 0.3.2): TLS to a source's upstream, done by the host. A guest has no TLS
//! stack; it asks for a tunnel, dials the tunnel's loopback address with an
//! ordinary socket and speaks plain bytes, and the host carries them to the
//! upstream over TLS, checking the certificate chain (the config's
//! `tls_ca`, else the system's CAs) and the upstream's name.
//!
//! A tunnel starts TLS at once (HTTPS, WSS), with the handshake done before
//! `open-tunnel` returns so a certificate problem is the call's answer; or
//! when the plugin asks (`start-tls`), for protocols that upgrade in-band
//! (MySQL's SSL request), after exactly the bytes the plugin says it sent.
//! The protocol itself stays in the plugin; the host only copies bytes and
//! does the handshake.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::ServerName;
use sluice_contract::tls::{TlsStart, Tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::pgconn::tls::SslMode;

/// How long a tunnel waits for the plugin to dial it.
const DIAL_WITHIN: Duration = Duration::from_secs(30);
/// The bound on reaching the upstream and on the TLS handshake.
const UPSTREAM_WITHIN: Duration = Duration::from_secs(10);

/// One plugin instance's tunnels and what it may reach.
pub struct Tunnels {
    /// Upstream addresses the plugin is granted (its config and `--allow-net`).
    granted: Vec<SocketAddr>,
    /// What the plugin's sockets may dial: the grant plus every open
    /// tunnel's loopback address (shared with the socket check).
    dialable: Arc<RwLock<Vec<SocketAddr>>>,
    /// The trust anchors (`tls_ca` of the plugin's config; `None`: the system's).
    ca: Option<PathBuf>,
    /// Tunnels waiting for `start-tls`, by id.
    upgrades: HashMap<u32, mpsc::Sender<Upgrade>>,
    next_id: u32,
}

/// A `start-tls` call, handed to its tunnel's task.
struct Upgrade {
    sent: u64,
    done: oneshot::Sender<Result<(), String>>,
}

impl Tunnels {
    pub fn new(granted: Vec<SocketAddr>, dialable: Arc<RwLock<Vec<SocketAddr>>>, ca: Option<PathBuf>) -> Tunnels {
        Tunnels { granted, dialable, ca, upgrades: HashMap::new(), next_id: 1 }
    }

    /// `open-tunnel`.
    pub async fn open(&mut self, host: String, port: u16, start: TlsStart) -> Result<Tunnel, String> {
        let upstream = format!("{host}:{port}");
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| format!("cannot resolve {upstream}: {e}"))?
            .collect();
        let addrs: Vec<SocketAddr> = addrs.into_iter().filter(|a| self.granted.contains(a)).collect();
        if addrs.is_empty() {
            return Err(format!(
                "{upstream} is not an upstream this plugin may reach (its config's url or host and port, or --allow-net)"
            ));
        }
        let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']').to_string())
            .map_err(|e| format!("{upstream}: not a name TLS can check: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(client_config(self.ca.as_ref())?);
        let tcp = connect(&addrs, &upstream).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("opening a tunnel: {e}"))?;
        let address = listener.local_addr().map_err(|e| format!("opening a tunnel: {e}"))?;
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        match start {
            TlsStart::AtOnce => {
                let tls = handshake(&connector, name, tcp, &upstream).await?;
                let dialable = self.dialable.clone();
                tokio::spawn(async move {
                    if let Some(plugin) = accept(listener, &dialable).await {
                        splice(plugin, tls).await;
                    }
                });
            }
            TlsStart::OnRequest => {
                let (tx, rx) = mpsc::channel(1);
                self.upgrades.retain(|_, t| !t.is_closed());
                self.upgrades.insert(id, tx);
                let dialable = self.dialable.clone();
                tokio::spawn(async move {
                    if let Some(plugin) = accept(listener, &dialable).await {
                        relay_then_upgrade(plugin, tcp, connector, name, upstream, rx).await;
                    }
                });
            }
        }
        self.dialable.write().unwrap_or_else(|e| e.into_inner()).push(address);
        Ok(Tunnel { id, address: address.to_string() })
    }

    /// `start-tls`.
    pub async fn start_tls(&mut self, id: u32, sent: u64) -> Result<(), String> {
        let tunnel = self.upgrades.remove(&id).ok_or_else(|| format!("no tunnel {id} waits for start-tls"))?;
        let (done, answer) = oneshot::channel();
        tunnel.send(Upgrade { sent, done }).await.map_err(|_| format!("tunnel {id} is closed"))?;
        // Reaching `sent` and the handshake (itself bounded) must not hold the
        // plugin's call forever: a plugin that names bytes it never wrote.
        match tokio::time::timeout(UPSTREAM_WITHIN * 2, answer).await {
            Ok(answer) => answer.map_err(|_| format!("tunnel {id} closed before its TLS handshake"))?,
            Err(_) => Err(format!(
                "tunnel {id}: TLS did not start within {} s (were {sent} bytes written to the tunnel?)",
                (UPSTREAM_WITHIN * 2).as_secs()
            )),
        }
    }
}

/// The first of `addrs` that answers, within the bound.
async fn connect(addrs: &[SocketAddr], upstream: &str) -> Result<TcpStream, String> {
    let mut last = String::new();
    for addr in addrs {
        match tokio::time::timeout(UPSTREAM_WITHIN, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => {
                let _ = tcp.set_nodelay(true);
                return Ok(tcp);
            }
            Ok(Err(e)) => last = format!("cannot connect to {upstream} ({addr}): {e}"),
            Err(_) => last = format!("cannot connect to {upstream} ({addr}): no answer within {UPSTREAM_WITHIN:?}"),
        }
    }
    Err(last)
}

async fn handshake(
    connector: &tokio_rustls::TlsConnector,
    name: ServerName<'static>,
    tcp: TcpStream,
    upstream: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    match tokio::time::timeout(UPSTREAM_WITHIN, connector.connect(name, tcp)).await {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(e)) => {
            let hint = if e.to_string().contains("invalid peer certificate") {
                " (check `tls_ca` in the source config, and that the certificate names the upstream's host)"
            } else {
                ""
            };
            Err(format!("TLS handshake with {upstream}: {e}{hint}"))
        }
        Err(_) => Err(format!("TLS handshake with {upstream}: no answer within {UPSTREAM_WITHIN:?}")),
    }
}

/// The plugin's one connection to the tunnel, then the address is closed
/// to it again.
async fn accept(listener: TcpListener, dialable: &RwLock<Vec<SocketAddr>>) -> Option<TcpStream> {
    let address = listener.local_addr().ok();
    let accepted = tokio::time::timeout(DIAL_WITHIN, listener.accept()).await;
    if let Some(address) = address {
        dialable.write().unwrap_or_else(|e| e.into_inner()).retain(|a| *a != address);
    }
    let (plugin, _) = accepted.ok()?.ok()?;
    let _ = plugin.set_nodelay(true);
    Some(plugin)
}

/// Copies bytes both ways in the clear until the plugin asks for TLS, then
/// upgrades the upstream side after exactly the bytes it names, and copies
/// through TLS from then on.
async fn relay_then_upgrade(
    plugin: TcpStream,
    mut upstream: TcpStream,
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
    label: String,
    mut requests: mpsc::Receiver<Upgrade>,
) {
    let (mut from_plugin, mut to_plugin) = plugin.into_split();
    let mut sent: u64 = 0;
    // Bytes read from the plugin past the point TLS starts (it should write
    // none before `start-tls` returns), sent once TLS is up.
    let mut after = Vec::new();
    let mut wanted: Option<Upgrade> = None;
    let (mut up, mut down) = (vec![0u8; 16 << 10], vec![0u8; 16 << 10]);
    loop {
        if let Some(upgrade) = &wanted {
            if sent == upgrade.sent {
                break;
            }
        }
        tokio::select! {
            read = from_plugin.read(&mut up) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                let room = wanted.as_ref().map_or(n as u64, |u| u.sent - sent);
                let take = (n as u64).min(room) as usize;
                if upstream.write_all(&up[..take]).await.is_err() {
                    return;
                }
                sent += take as u64;
                after.extend_from_slice(&up[take..n]);
            }
            read = upstream.read(&mut down) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if to_plugin.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
            request = requests.recv(), if wanted.is_none() => {
                let Some(upgrade) = request else { return };
                if upgrade.sent < sent {
                    let _ = upgrade.done.send(Err(format!(
                        "start-tls after {} bytes, but the plugin has already sent {sent} in the clear",
                        upgrade.sent
                    )));
                    return;
                }
                wanted = Some(upgrade);
            }
        }
    }
    let Some(upgrade) = wanted else { return };
    let mut tls = match handshake(&connector, name, upstream, &label).await {
        Ok(tls) => {
            let _ = upgrade.done.send(Ok(()));
            tls
        }
        Err(e) => {
            let _ = upgrade.done.send(Err(e));
            return;
        }
    };
    let Ok(plugin) = from_plugin.reunite(to_plugin) else { return };
    if !after.is_empty() && tls.write_all(&after).await.is_err() {
        return;
    }
    splice(plugin, tls).await;
}

/// Copies both ways until either side ends, then drops both: the plugin
/// closing its socket (after its own read timeout, on a silent upstream)
/// closes the upstream connection too, so no tunnel outlives its plugin
/// connection waiting on a peer that will never answer.
async fn splice(plugin: TcpStream, upstream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin) {
    let (mut plugin_read, mut plugin_write) = tokio::io::split(plugin);
    let (mut upstream_read, mut upstream_write) = tokio::io::split(upstream);
    tokio::select! {
        _ = tokio::io::copy(&mut plugin_read, &mut upstream_write) => {}
        _ = tokio::io::copy(&mut upstream_read, &mut plugin_write) => {}
    }
}

/// The check `verify-full` makes for PostgreSQL: the chain against
/// `tls_ca` (or the system's CAs) and the name.
fn client_config(ca: Option<&PathBuf>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = ca.map(|f| f.display().to_string()).unwrap_or_else(|| "system".into());
    let settings = crate::pgconn::tls::TlsSettings::new(Some(SslMode::VerifyFull), Some(roots), None, None)
        .map_err(|e| format!("the CA for the source's TLS upstream (`tls_ca`): {e}"))?;
    Ok(settings.client_config())
}

/// The host side of the contract's `tls` interface, for every plugin
/// instance (a filter has no network grant, so its tunnels are refused).
impl sluice_contract::tls::Host for super::sandbox::HostState {
    async fn open_tunnel(
        &mut self,
        host: String,
        port: u16,
        start: TlsStart,
    ) -> wasmtime::Result<Result<Tunnel, String>> {
        Ok(self.tunnels.open(host, port, start).await)
    }

    async fn start_tls(&mut self, tunnel: u32, sent: u64) -> wasmtime::Result<Result<(), String>> {
        Ok(self.tunnels.start_tls(tunnel, sent).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};

    /// A CA (written to `dir/ca.crt`) and a TLS acceptor with a certificate
    /// it signed for 127.0.0.1.
    fn pki(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
        let other = CertifiedIssuer::self_signed(
            {
                let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
                p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
                p
            },
            KeyPair::generate().unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("wrong-ca.crt"), other.pem()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().unwrap())];
        let cert = params.signed_by(&key, &ca).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let config = rustls::ServerConfig::builder_with_provider(crate::tls::crypto_provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)
            .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// An upstream that greets in the clear, waits for `STARTTLS\n`, then
    /// answers `ok:` and what it read over TLS.
    async fn upgrading_upstream(acceptor: tokio_rustls::TlsAcceptor) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            socket.write_all(b"HELLO\n").await.unwrap();
            let mut ask = [0u8; 9];
            socket.read_exact(&mut ask).await.unwrap();
            assert_eq!(&ask, b"STARTTLS\n");
            let Ok(mut tls) = acceptor.accept(socket).await else { return };
            let mut secret = [0u8; 6];
            tls.read_exact(&mut secret).await.unwrap();
            tls.write_all(&[b"ok:".as_slice(), &secret].concat()).await.unwrap();
            tls.flush().await.unwrap();
        });
        addr
    }

    fn tunnels(granted: SocketAddr, ca: PathBuf) -> Tunnels {
        Tunnels::new(vec![granted], Arc::new(RwLock::new(vec![granted])), Some(ca))
    }

    #[tokio::test]
    async fn an_in_band_upgrade_starts_tls_after_exactly_the_plain_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let upstream = upgrading_upstream(pki(dir.path())).await;
        let mut tunnels = tunnels(upstream, dir.path().join("ca.crt"));
        let tunnel = tunnels.open("127.0.0.1".into(), upstream.port(), TlsStart::OnRequest).await.unwrap();
        let address: SocketAddr = tunnel.address.parse().unwrap();
        assert!(tunnels.dialable.read().unwrap().contains(&address), "the plugin may dial its tunnel");
        let mut plugin = TcpStream::connect(address).await.unwrap();
        let mut hello = [0u8; 6];
        plugin.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"HELLO\n");
        plugin.write_all(b"STARTTLS\n").await.unwrap();
        tunnels.start_tls(tunnel.id, 9).await.unwrap();
        // Plain again for the plugin; TLS between the host and the upstream.
        plugin.write_all(b"secret").await.unwrap();
        let mut answer = [0u8; 9];
        plugin.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"ok:secret");
        assert!(!tunnels.dialable.read().unwrap().contains(&address), "a tunnel is dialled once");
        let again = tunnels.start_tls(tunnel.id, 9).await.unwrap_err();
        assert!(again.contains("no tunnel"), "{again}");
    }

    #[tokio::test]
    async fn tunnels_reach_only_granted_upstreams_that_prove_who_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let acceptor = pki(dir.path());
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((socket, _)) = upstream.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move { drop(acceptor.accept(socket).await) });
            }
        });
        let mut trusted = tunnels(addr, dir.path().join("ca.crt"));
        assert!(trusted.open("127.0.0.1".into(), addr.port(), TlsStart::AtOnce).await.is_ok());

        let mut wrong = tunnels(addr, dir.path().join("wrong-ca.crt"));
        let e = wrong.open("127.0.0.1".into(), addr.port(), TlsStart::AtOnce).await.unwrap_err();
        assert!(e.contains("invalid peer certificate") && e.contains("tls_ca"), "{e}");

        let e = trusted.open("127.0.0.1".into(), addr.port() ^ 1, TlsStart::AtOnce).await.unwrap_err();
        assert!(e.contains("is not an upstream this plugin may reach"), "{e}");
    }
}
