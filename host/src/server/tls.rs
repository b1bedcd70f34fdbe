//! TLS on the subscriber endpoint (`--tls-cert`, `--tls-key`): a listener
//! that hands axum connections whose handshake is done, and a certificate
//! that can be replaced while Sluice runs (`reload`, on SIGHUP). New
//! connections get the new certificate; open ones keep their session.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client may take over its handshake before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The endpoint's certificate and key files, loaded and reloadable.
pub struct EndpointTls {
    files: Arc<CertFiles>,
    acceptor: TlsAcceptor,
}

#[derive(Debug)]
struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

fn load(cert: &Path, key: &Path) -> anyhow::Result<Arc<CertifiedKey>> {
    let chain = crate::tls::read_certs(cert).with_context(|| format!("--tls-cert {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "--tls-cert {}: no certificate in the file", cert.display());
    let private = PrivateKeyDer::from_pem_file(key).with_context(|| format!("--tls-key {}", key.display()))?;
    let certified = CertifiedKey::from_der(chain, private, &crate::tls::crypto_provider())
        .with_context(|| format!("--tls-cert {} with --tls-key {}", cert.display(), key.display()))?;
    Ok(Arc::new(certified))
}

impl EndpointTls {
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Arc<EndpointTls>> {
        let files = Arc::new(CertFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: RwLock::new(load(cert, key)?),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(crate::tls::crypto_provider())
            .with_safe_default_protocol_versions()
            .context("TLS set-up")?
            .with_no_client_auth()
            .with_cert_resolver(files.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(EndpointTls { files, acceptor: TlsAcceptor::from(Arc::new(config)) }))
    }

    /// Reads the files again; on failure the old certificate stays in use.
    pub fn reload(&self) -> anyhow::Result<()> {
        let fresh = load(&self.files.cert, &self.files.key)?;
        *self.files.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    /// Serves TLS on `tcp`: handshakes run in their own tasks, so a slow or
    /// silent client holds up no one else.
    pub fn listen(self: &Arc<Self>, tcp: TcpListener) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = self.acceptor.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = tcp.accept() => a,
                    // The server stopped: let the port go.
                    _ = tx.closed() => return,
                };
                let (socket, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::debug!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = socket.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::info!(peer = %peer, "TLS handshake failed: {e}"),
                        Err(_) => tracing::info!(peer = %peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

/// Connections whose handshake is done, for `axum::serve`.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(accepted) => accepted,
            // The accepting task ended only because we were dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}
