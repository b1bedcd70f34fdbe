//! What every TLS connection of Sluice shares: the rustls crypto provider
//! and reading PEM certificate files. Postgres connections
//! (`pgconn::tls`), the subscriber endpoint (`server::tls`) and the source
//! plugins' TLS tunnels (`plugin::tls_tunnel`) build on it.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// rustls's ring provider. rustls 0.23.48 marks it deprecated because it lacks
/// the post-quantum key exchange aws-lc-rs has; ring is kept because it
/// builds without cmake and quickly on small machines. The classical suites
/// it offers are those PostgreSQL servers negotiate today.
#[allow(deprecated)]
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file, in order.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, rustls::pki_types::pem::Error> {
    CertificateDer::pem_file_iter(path)?.collect()
}
