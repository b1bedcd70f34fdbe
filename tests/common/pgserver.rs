//! A private PostgreSQL server for tests that restart or misconfigure it
//! (the shared one from `tests/pg/with-postgres.sh` serves everyone else).
//! It uses the binaries that script found (`SLUICE_TEST_PG_BINDIR`) and runs
//! them as an unprivileged user when the tests run as root.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct PgServer {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    pub port: u16,
    options: String,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn as_server_user(program: &Path) -> Command {
    // SAFETY-free check for root: the effective uid from `id -u`.
    let root = Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl PgServer {
    /// initdb and start, with extra `-c name=value` settings.
    pub fn start(settings: &[&str]) -> PgServer {
        PgServer::start_on(free_port(), settings)
    }

    /// [`PgServer::start`] on a given port.
    pub fn start_on(port: u16, settings: &[&str]) -> PgServer {
        PgServer::start_prepared(port, settings, |_| {})
    }

    /// A server that accepts only TLS over TCP (`hostssl` lines alone), with
    /// the certificates of `pki`: `sluice_cert` must show a client
    /// certificate, `sluice_scram` a password (SCRAM), everyone else is
    /// trusted.
    pub fn start_tls(pki: &super::pki::Pki) -> PgServer {
        let settings = [
            "ssl=on",
            "ssl_cert_file=server.crt",
            "ssl_key_file=server.key",
            "ssl_ca_file=ca.crt",
            "wal_level=logical",
            "max_wal_senders=10",
            "max_replication_slots=10",
        ];
        PgServer::start_prepared(free_port(), &settings, |data| {
            pki.install_server_files(data);
            let hba = "local all all trust\n\
                       hostssl all sluice_cert 127.0.0.1/32 cert\n\
                       hostssl replication sluice_cert 127.0.0.1/32 cert\n\
                       hostssl all sluice_scram 127.0.0.1/32 scram-sha-256\n\
                       hostssl replication sluice_scram 127.0.0.1/32 scram-sha-256\n\
                       hostssl all all 127.0.0.1/32 trust\n\
                       hostssl replication all 127.0.0.1/32 trust\n";
            std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        })
    }

    /// initdb, then `prepare` the data directory, then start.
    pub fn start_prepared(port: u16, settings: &[&str], prepare: impl FnOnce(&Path)) -> PgServer {
        let bindir = PathBuf::from(std::env::var("SLUICE_TEST_PG_BINDIR").expect(
            "SLUICE_TEST_PG_BINDIR is unset: run the tests through `make test` (tests/pg/with-postgres.sh sets it)",
        ));
        let dir = tempfile::Builder::new().prefix("sluice-pgserver").tempdir().unwrap();
        let _ = Command::new("chown").arg("postgres").arg(dir.path()).status();
        let _ = Command::new("chmod").arg("755").arg(dir.path()).status();
        let data = dir.path().join("data");
        let out = as_server_user(&bindir.join("initdb"))
            .args(["-D", data.to_str().unwrap(), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .output()
            .unwrap();
        assert!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
        prepare(&data);
        let _ = Command::new("chown").arg("-R").arg("postgres").arg(&data).output();
        let mut options = format!("-k {} -c listen_addresses=127.0.0.1", dir.path().display());
        for s in settings {
            options.push_str(&format!(" -c {s}"));
        }
        let server = PgServer { dir, bindir, port, options };
        server.ctl(&["start", "-w", "-t", "60"]);
        server
    }

    fn ctl(&self, args: &[&str]) {
        let data = self.dir.path().join("data");
        let log = self.dir.path().join("server.log");
        let options = format!("-p {} {}", self.port, self.options);
        let out = as_server_user(&self.bindir.join("pg_ctl"))
            .args(["-D", data.to_str().unwrap(), "-l", log.to_str().unwrap(), "-o", &options])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Restarts with `pg_ctl -m MODE` (fast or immediate).
    pub fn restart(&self, mode: &str) {
        self.ctl(&["restart", "-w", "-t", "60", "-m", mode]);
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = as_server_user(&self.bindir.join("pg_ctl"))
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "-w", "stop"])
            .output();
    }
}
