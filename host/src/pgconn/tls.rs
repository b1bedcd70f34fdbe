//! TLS to PostgreSQL with rustls, following libpq's `sslmode`:
//!
//! | sslmode | TLS | certificate checked |
//! |---|---|---|
//! | disable | never | - |
//! | allow, prefer (default) | when the server offers it | no |
//! | require | always | no; as verify-ca when `sslrootcert` is given |
//! | verify-ca | always | signed by `sslrootcert` |
//! | verify-full | always | signed by `sslrootcert` and naming the host |
//!
//! `sslrootcert=system` uses the system's CAs and implies verify-full.
//! `allow` tries TLS first (libpq tries plain first); both end connected.
//! The same client configuration serves tokio-postgres (through
//! [`MakeRustls`]) and the walsender client, which upgrades its socket with
//! [`handshake`]. Both offer SCRAM-SHA-256-PLUS channel binding with the
//! server certificate's hash ([`end_point_hash`]).

use std::fmt;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::Digest;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(text: &str) -> Result<SslMode, String> {
        Ok(match text {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other}: expected disable, allow, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }

    /// TLS is a must: a server without it is refused.
    pub fn requires_tls(self) -> bool {
        matches!(self, SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// How one target's connections use TLS; the rustls configuration is built
/// once, when the connection string is read, so a missing CA file is an
/// error at start rather than at the first connection.
#[derive(Clone)]
pub struct TlsSettings {
    pub mode: SslMode,
    client: Arc<ClientConfig>,
}

enum Check {
    Nothing,
    Chain,
    ChainAndName,
}

impl TlsSettings {
    pub fn new(
        mode: Option<SslMode>,
        root_cert: Option<String>,
        client_cert: Option<PathBuf>,
        client_key: Option<PathBuf>,
    ) -> Result<TlsSettings, String> {
        let system = root_cert.as_deref() == Some("system");
        let mode = match mode {
            Some(m) if system && m != SslMode::VerifyFull => {
                return Err(format!(
                "sslrootcert=system needs sslmode=verify-full (got sslmode={m}); drop sslmode or set it to verify-full"
            ))
            }
            Some(m) => m,
            None if system => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        let check = match mode {
            SslMode::VerifyFull => Check::ChainAndName,
            SslMode::VerifyCa => Check::Chain,
            SslMode::Require if root_cert.is_some() => Check::Chain,
            _ => Check::Nothing,
        };
        let provider = crate::tls::crypto_provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS set-up: {e}"))?;
        let builder = match check {
            Check::Nothing => builder.dangerous().with_custom_certificate_verifier(Arc::new(NoCheck(provider, None))),
            Check::Chain | Check::ChainAndName => {
                let roots = Arc::new(load_roots(root_cert.as_deref(), mode)?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| format!("sslrootcert: {e}"))?;
                match check {
                    Check::Chain => builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly(webpki))),
                    _ => builder.with_webpki_verifier(webpki),
                }
            }
        };
        let client = match (client_cert, client_key) {
            (Some(cert), Some(key)) => {
                let chain = crate::tls::read_certs(&cert).map_err(|e| format!("sslcert={}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(&key).map_err(|e| format!("sslkey={}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| format!("sslcert/sslkey: {e}"))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err("sslcert and sslkey go together: give both or neither".into()),
        };
        Ok(TlsSettings { mode, client: Arc::new(client) })
    }

    /// The mode tokio-postgres itself knows, for its SSLRequest decision; the
    /// checking is done by this configuration's verifier.
    pub fn wire_mode(&self) -> tokio_postgres::config::SslMode {
        match self.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }

    pub fn connector(&self) -> MakeRustls {
        MakeRustls { client: self.client.clone() }
    }

    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }
}

fn load_roots(root_cert: Option<&str>, mode: SslMode) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    if root_cert == Some("system") {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err("sslrootcert=system: no CA certificates found on this system (install ca-certificates, or \
                        give sslrootcert=/path/to/ca.pem)"
                .into());
        }
        return Ok(roots);
    }
    // libpq's default: ~/.postgresql/root.crt.
    let path = match root_cert {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
            .filter(|p| p.exists())
            .ok_or_else(|| {
                format!(
                    "sslmode={mode} checks the server's certificate and needs its CA: set \
                     sslrootcert=/path/to/ca.pem (or sslrootcert=system for the system's CAs)"
                )
            })?,
    };
    let certs = crate::tls::read_certs(&path).map_err(|e| format!("sslrootcert={}: {e}", path.display()))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!("sslrootcert={}: no certificate in the file", path.display()));
    }
    Ok(roots)
}

/// A client that trusts exactly the first certificate in `cert_file` (PEM),
/// whatever name it is dialled by: a server's own certificate, for a check
/// made beside it (`sluice health` in its container). The handshake
/// signatures are checked as always, so only the holder of its key passes.
pub fn pinned_client_config(cert_file: &std::path::Path) -> Result<Arc<ClientConfig>, String> {
    let chain = crate::tls::read_certs(cert_file).map_err(|e| format!("{}: {e}", cert_file.display()))?;
    let pinned =
        chain.into_iter().next().ok_or_else(|| format!("{}: no certificate in the file", cert_file.display()))?;
    let provider = crate::tls::crypto_provider();
    let config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoCheck(provider, Some(pinned))))
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// `prefer` and `require` without a CA: encrypted, but any certificate is
/// accepted (as libpq); or, pinned, exactly one certificate. The handshake
/// signatures are still checked.
#[derive(Debug)]
struct NoCheck(Arc<rustls::crypto::CryptoProvider>, Option<CertificateDer<'static>>);

impl ServerCertVerifier for NoCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match &self.1 {
            Some(pinned) if pinned.as_ref() != end_entity.as_ref() => {
                Err(rustls::Error::General("the server's certificate is not the one configured (--tls-cert)".into()))
            }
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to the CA; the name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The TLS name for a host: an IP address or a DNS name.
fn server_name(host: &str) -> io::Result<ServerName<'static>> {
    ServerName::try_from(host.to_string())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{host:?} is not a valid TLS server name")))
}

/// Runs the TLS handshake on a socket the server agreed to upgrade (after
/// SSLRequest was answered `S`).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    client: Arc<ClientConfig>,
    host: &str,
    socket: S,
) -> io::Result<tokio_rustls::client::TlsStream<S>> {
    tokio_rustls::TlsConnector::from(client).connect(server_name(host)?, socket).await
}

/// RFC 5929 tls-server-end-point: the server certificate hashed with its
/// signature's hash (SHA-256 for SHA-1, SHA-256 and anything unknown), as
/// PostgreSQL computes it for SCRAM-SHA-256-PLUS. `None` where no hash
/// applies (Ed25519, RSASSA-PSS), as PostgreSQL refuses binding then.
pub fn end_point_hash(cert_der: &[u8]) -> Option<Vec<u8>> {
    const SHA384_RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0c];
    const SHA512_RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0d];
    const RSA_PSS: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a];
    const SHA384_ECDSA: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03];
    const SHA512_ECDSA: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x04];
    const ED25519: &[u8] = &[0x2b, 0x65, 0x70];
    const ED448: &[u8] = &[0x2b, 0x65, 0x71];
    let oid = signature_algorithm(cert_der)?;
    Some(match oid {
        SHA384_RSA | SHA384_ECDSA => sha2::Sha384::digest(cert_der).to_vec(),
        SHA512_RSA | SHA512_ECDSA => sha2::Sha512::digest(cert_der).to_vec(),
        RSA_PSS | ED25519 | ED448 => return None,
        _ => sha2::Sha256::digest(cert_der).to_vec(),
    })
}

/// The OID of `Certificate.signatureAlgorithm` (the second element of the
/// outer DER SEQUENCE).
fn signature_algorithm(der: &[u8]) -> Option<&[u8]> {
    fn tlv(bytes: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = bytes.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (first as usize, rest)
        } else {
            let n = (first & 0x7f) as usize;
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            (rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize), &rest[n..])
        };
        (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
    }
    let (_, certificate, _) = tlv(der)?;
    let (_, _tbs, rest) = tlv(certificate)?;
    let (_, algorithm, _) = tlv(rest)?;
    let (tag, oid, _) = tlv(algorithm)?;
    (tag == 0x06).then_some(oid)
}

/// tokio-postgres's TLS hook, backed by rustls.
#[derive(Clone)]
pub struct MakeRustls {
    client: Arc<ClientConfig>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> MakeTlsConnect<S> for MakeRustls {
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsConnect> {
        // tokio-postgres passes "" for Unix sockets, where servers never offer TLS.
        Ok(RustlsConnect { client: self.client.clone(), host: domain.to_string() })
    }
}

pub struct RustlsConnect {
    client: Arc<ClientConfig>,
    host: String,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for RustlsConnect {
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move { handshake(self.client, &self.host, stream).await.map(RustlsStream) })
    }
}

pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

/// The channel binding data of an established TLS connection: the
/// [`end_point_hash`] of the server's certificate.
pub fn server_end_point<S>(stream: &tokio_rustls::client::TlsStream<S>) -> Option<Vec<u8>> {
    let (_, session) = stream.get_ref();
    session.peer_certificates()?.first().and_then(|c| end_point_hash(c))
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        match server_end_point(&self.0) {
            Some(hash) => ChannelBinding::tls_server_end_point(hash),
            None => ChannelBinding::none(),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_point_hash_follows_the_signature() {
        for (alg, len) in [(&rcgen::PKCS_ECDSA_P256_SHA256, 32), (&rcgen::PKCS_ECDSA_P384_SHA384, 48)] {
            let key = rcgen::KeyPair::generate_for(alg).unwrap();
            let cert = rcgen::CertificateParams::new(vec!["db.test".to_string()]).unwrap().self_signed(&key).unwrap();
            let hash = end_point_hash(cert.der()).expect("a hash");
            assert_eq!(hash.len(), len);
        }
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["db.test".to_string()]).unwrap().self_signed(&key).unwrap();
        assert_eq!(end_point_hash(cert.der()), None);
        assert_eq!(end_point_hash(b"\x30\x03\x02\x01"), None);
    }

    #[test]
    fn sslrootcert_system_means_verify_full() {
        let e = TlsSettings::new(Some(SslMode::Require), Some("system".into()), None, None).err().unwrap();
        assert!(e.contains("verify-full"), "{e}");
        let e =
            TlsSettings::new(Some(SslMode::VerifyCa), Some("/nonexistent/ca.pem".into()), None, None).err().unwrap();
        assert!(e.contains("sslrootcert=/nonexistent/ca.pem"), "{e}");
        let e = TlsSettings::new(Some(SslMode::Prefer), None, Some("/c.pem".into()), None).err().unwrap();
        assert!(e.contains("sslcert and sslkey"), "{e}");
    }
}
