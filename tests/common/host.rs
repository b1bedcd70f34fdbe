//! `sluice run` as a child process that a test can kill and restart, with
//! its `/status`, `/readyz` and log.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `sluice run` process, restartable with the same arguments.
pub struct Host {
    args: Vec<String>,
    pub addr: String,
    pub log: PathBuf,
    child: Option<Child>,
    pub starts: u32,
}

impl Host {
    pub fn new(dir: &std::path::Path, args: Vec<String>) -> Host {
        Host::named(dir, "sluice", args)
    }

    pub fn named(dir: &std::path::Path, name: &str, args: Vec<String>) -> Host {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        Host { args, addr, log: dir.join(format!("{name}.log")), child: None, starts: 0 }
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Reaps a process that exited by itself; returns its exit status.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    pub fn start(&mut self, extra: &[String]) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("run")
            .args(&self.args)
            .args(extra)
            // Purge every second. A subscriber between connections holds
            // the floor for 3 s (and nothing is purged for 3 s after a start
            // on an existing log), so purges run between the kills; the
            // newest 2,000 transactions are kept too, for a subscriber on a
            // host that just lost ownership, which no floor of this host
            // counts (it would get WatermarkTooOld, which is correct but not
            // what this checks).
            .args(["--listen", &self.addr, "--purge-interval-secs", "1", "--retain-transactions", "2000"])
            .args(["--subscriber-retention-secs", "3"])
            .env("RUST_LOG", "sluice=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.starts += 1;
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        self.get("/status")
    }

    /// `GET path` as JSON, if the host answers.
    pub fn get(&self, path: &str) -> Option<serde_json::Value> {
        serde_json::from_str(self.request(path)?.split_once("\r\n\r\n")?.1).ok()
    }

    /// The whole response to `GET path`, if the host answers.
    fn request(&self, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        Some(text)
    }

    /// The replica version the host reports, once its source has opened.
    pub async fn replica_version(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(v) = self.status().and_then(|s| s["replicaVersion"].as_str().map(str::to_string)) {
                return v;
            }
            assert!(Instant::now() < deadline, "no replica version; log:\n{}", self.log_tail());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether `GET /readyz` answers 200 (`None` while nothing answers).
    pub fn ready(&self) -> Option<bool> {
        let response = self.request("/readyz")?;
        Some(response.split_whitespace().nth(1)? == "200")
    }

    /// The tail of the host's log, for a failure message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The host's stored watermark once it serves again after the last restart.
pub async fn stored_watermark(host: &Host) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(w) = host.status().and_then(|s| s["lastWatermark"].as_str().map(str::to_string)) {
            return w;
        }
        assert!(Instant::now() < deadline, "the host does not come back; log:\n{}", host.log_tail());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
