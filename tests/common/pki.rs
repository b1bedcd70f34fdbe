//! Certificates for the TLS tests, made fresh by each test: a CA, a server
//! certificate it signs (for 127.0.0.1 only), a client certificate for the
//! role `sluice_cert`, and a second CA that signed none of them.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};

pub struct Pki {
    pub dir: tempfile::TempDir,
}

fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::Builder::new().prefix("sluice-pki").tempdir().unwrap();
        let ca = new_ca("Sluice test CA");
        let write = |name: &str, text: String| std::fs::write(dir.path().join(name), text).unwrap();
        write("ca.crt", ca.pem());
        write("wrong-ca.crt", new_ca("Another CA").pem());

        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().unwrap())];
        params.distinguished_name.push(DnType::CommonName, "127.0.0.1");
        write("server.crt", params.signed_by(&key, &ca).unwrap().pem());
        write("server.key", key.serialize_pem());

        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, "sluice_cert");
        write("client.crt", params.signed_by(&key, &ca).unwrap().pem());
        write("client.key", key.serialize_pem());
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Copies the server's files into `data` (a server data directory).
    pub fn install_server_files(&self, data: &Path) {
        for name in ["ca.crt", "server.crt", "server.key"] {
            std::fs::copy(self.path(name), data.join(name)).unwrap();
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(data.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        }
    }
}
