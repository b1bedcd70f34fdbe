//! Sluice as a child process: its binary, a free address, its `/status`, and
//! a seeded random generator for tests that kill it at random moments.

use std::io::{Read, Write};
use std::process::Command;

/// The `sluice` binary of this build.
pub fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

/// A loopback address no one listens on (yet).
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// The body of `GET path`, or `None` while nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

/// `/status` as JSON, or `None` while the host is not answering.
pub fn status(addr: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&http_get(addr, "/status")?).ok()
}

/// `/status` of a host that requires `token`.
pub fn status_with(addr: &str, token: &str) -> Option<serde_json::Value> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(s, "GET /status HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.split_once("\r\n\r\n")?.1).ok()
}

/// splitmix64: small, seeded, reproducible.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from `var` when set, else from the clock; prints the seed so a
    /// failing run can be replayed.
    pub fn from_env(var: &str, what: &str) -> Rng {
        let seed = std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
        println!("{what}: seed {seed} (replay with {var}={seed})");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }
}
