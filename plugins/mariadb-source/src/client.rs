//! The client side of MariaDB's protocol that a binlog reader needs: connect,
//! authenticate with mysql_native_password, run text queries, and stream the
//! rows of a large result set.

use std::time::Duration;

use sha1::{Digest, Sha1};

use crate::wire::{put_lenenc, Conn, Cursor};

const CLIENT_LONG_PASSWORD: u32 = 1;
const CLIENT_LONG_FLAG: u32 = 4;
const CLIENT_PROTOCOL_41: u32 = 0x200;
/// TLS: asked for with an SSL request before the handshake response.
const CLIENT_SSL: u32 = 0x800;
const CLIENT_TRANSACTIONS: u32 = 0x2000;
const CLIENT_SECURE_CONNECTION: u32 = 0x8000;
const CLIENT_MULTI_RESULTS: u32 = 0x2_0000;
const CLIENT_PLUGIN_AUTH: u32 = 0x8_0000;
const CLIENT_PLUGIN_AUTH_LENENC: u32 = 0x20_0000;
/// utf8mb4_general_ci.
const UTF8MB4: u8 = 45;

const COM_QUIT: u8 = 0x01;
const COM_QUERY: u8 = 0x03;

/// An error from the client: either the server's own (with its code) or the
/// connection's.
#[derive(Debug)]
pub enum ClientError {
    Server { code: u16, message: String },
    Io(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Server { code, message } => write!(f, "server error {code}: {message}"),
            ClientError::Io(m) => f.write_str(m),
        }
    }
}

impl From<String> for ClientError {
    fn from(s: String) -> Self {
        ClientError::Io(s)
    }
}

pub type CResult<T> = Result<T, ClientError>;

/// ER_ACCESS_DENIED_ERROR.
pub const ACCESS_DENIED: u16 = 1045;

pub struct Client {
    pub conn: Conn,
    pub server_version: String,
}

/// One result-set row: each column's text, or `None` for NULL.
pub type Row = Vec<Option<Vec<u8>>>;

impl Client {
    /// With `tls`, the connection goes through the host's TLS tunnel and
    /// upgrades as the protocol does: after the greeting, an SSL request
    /// (the first 32 bytes of the handshake response) in the clear, then
    /// the host's handshake, then the handshake response over TLS, its
    /// sequence numbers continuing from the SSL request's.
    pub fn connect(host: &str, port: u16, user: &str, password: &str, timeout: Duration, tls: bool) -> CResult<Client> {
        let (stream, tunnel) = if tls {
            let (tunnel, stream) = sluice_plugin_sdk::net::Tunnel::connect(host, port, timeout)?;
            (stream, Some(tunnel))
        } else {
            (sluice_plugin_sdk::net::connect(host, port, timeout)?, None)
        };
        let mut conn = Conn::new(stream, timeout)?;
        let hello = conn.read_packet()?;
        if hello.first() == Some(&0xff) {
            return Err(server_error(&hello));
        }
        let hs = Handshake::parse(&hello).map_err(|e| format!("bad handshake from the server: {e}"))?;
        let mut caps = CLIENT_LONG_PASSWORD
            | CLIENT_LONG_FLAG
            | CLIENT_PROTOCOL_41
            | CLIENT_TRANSACTIONS
            | CLIENT_SECURE_CONNECTION
            | CLIENT_MULTI_RESULTS
            | CLIENT_PLUGIN_AUTH
            | CLIENT_PLUGIN_AUTH_LENENC;
        if hs.capabilities & CLIENT_PROTOCOL_41 == 0 {
            return Err(ClientError::Io("the server does not speak protocol 4.1".into()));
        }
        if let Some(tunnel) = &tunnel {
            if hs.capabilities & CLIENT_SSL == 0 {
                return Err(ClientError::Io(
                    "the MariaDB server does not offer TLS (start it with ssl_cert and ssl_key), and the source \
                     config asks for it"
                        .into(),
                ));
            }
            caps |= CLIENT_SSL;
            let mut request = Vec::with_capacity(32);
            request.extend_from_slice(&caps.to_le_bytes());
            request.extend_from_slice(&(16u32 << 20).to_le_bytes());
            request.push(UTF8MB4);
            request.extend_from_slice(&[0u8; 23]);
            conn.write_packet(&request)?;
            tunnel.start_tls(conn.written()).map_err(ClientError::Io)?;
        }
        // Answer with mysql_native_password whatever the server's default
        // plugin is; a user set up with another plugin gets an AuthSwitch.
        let plugin = "mysql_native_password";
        let auth = native_password(password, &hs.scramble);
        let mut resp = Vec::with_capacity(128);
        resp.extend_from_slice(&caps.to_le_bytes());
        resp.extend_from_slice(&(16u32 << 20).to_le_bytes());
        resp.push(UTF8MB4);
        resp.extend_from_slice(&[0u8; 23]);
        resp.extend_from_slice(user.as_bytes());
        resp.push(0);
        put_lenenc(&mut resp, auth.len() as u64);
        resp.extend_from_slice(&auth);
        resp.extend_from_slice(plugin.as_bytes());
        resp.push(0);
        conn.write_packet(&resp)?;
        loop {
            let p = conn.read_packet()?;
            match p.first() {
                Some(0x00) => break,
                Some(0xff) => return Err(server_error(&p)),
                Some(0xfe) => {
                    // AuthSwitchRequest: plugin name, then its data.
                    let mut c = Cursor::new(&p[1..]);
                    let name = String::from_utf8_lossy(c.nul_str()?).into_owned();
                    if name != "mysql_native_password" {
                        return Err(ClientError::Io(format!(
                            "the server asks for authentication plugin {name}; this plugin supports \
                             mysql_native_password only (ALTER USER ... IDENTIFIED VIA mysql_native_password)"
                        )));
                    }
                    let data = c.rest();
                    let scramble = data.strip_suffix(&[0]).unwrap_or(data);
                    conn.write_packet(&native_password(password, scramble))?;
                }
                _ => return Err(ClientError::Io(format!("unexpected authentication reply 0x{:02x}", p[0]))),
            }
        }
        Ok(Client { conn, server_version: hs.server_version })
    }

    /// Runs a statement that returns no rows.
    pub fn execute(&mut self, sql: &str) -> CResult<()> {
        let cols = self.start_query(sql)?;
        if cols > 0 {
            while self.next_row(cols)?.is_some() {}
        }
        Ok(())
    }

    /// Runs a query and collects every row.
    pub fn query(&mut self, sql: &str) -> CResult<Vec<Row>> {
        let cols = self.start_query(sql)?;
        let mut rows = Vec::new();
        if cols > 0 {
            while let Some(r) = self.next_row(cols)? {
                rows.push(r);
            }
        }
        Ok(rows)
    }

    /// Sends a query and reads its column definitions. Returns the number of
    /// columns (0 for a statement without a result set); then call
    /// `next_row` until it returns `None`.
    pub fn start_query(&mut self, sql: &str) -> CResult<usize> {
        self.conn.reset_seq();
        let mut p = Vec::with_capacity(sql.len() + 1);
        p.push(COM_QUERY);
        p.extend_from_slice(sql.as_bytes());
        self.conn.write_packet(&p)?;
        let first = self.conn.read_packet()?;
        match first.first() {
            Some(0x00) => return Ok(0),
            Some(0xff) => return Err(server_error(&first)),
            None => return Err(ClientError::Io("empty reply to a query".into())),
            _ => {}
        }
        let cols = Cursor::new(&first).lenenc_int()? as usize;
        for _ in 0..cols {
            self.conn.read_packet()?;
        }
        let eof = self.conn.read_packet()?;
        if eof.first() != Some(&0xfe) {
            return Err(ClientError::Io("expected EOF after the column definitions".into()));
        }
        Ok(cols)
    }

    /// The next row of the running query, or `None` after the last.
    pub fn next_row(&mut self, cols: usize) -> CResult<Option<Row>> {
        let p = self.conn.read_packet()?;
        match p.first() {
            Some(0xfe) if p.len() < 9 => return Ok(None),
            Some(0xff) => return Err(server_error(&p)),
            _ => {}
        }
        let mut c = Cursor::new(&p);
        let mut row = Vec::with_capacity(cols);
        for _ in 0..cols {
            row.push(c.lenenc_bytes()?.map(|b| b.to_vec()));
        }
        Ok(Some(row))
    }

    /// One value: the first column of the first row, as text.
    pub fn query_value(&mut self, sql: &str) -> CResult<Option<String>> {
        let rows = self.query(sql)?;
        Ok(rows.into_iter().next().and_then(|r| r.into_iter().next().flatten()).map(text))
    }

    pub fn quit(mut self) {
        self.conn.reset_seq();
        let _ = self.conn.write_packet(&[COM_QUIT]);
    }
}

pub fn text(b: Vec<u8>) -> String {
    String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// A string literal for SQL text (backslash and quote escaped).
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            '\0' => out.push_str("\\0"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// An identifier for SQL text.
pub fn ident(s: &str) -> String {
    format!("`{}`", s.replace('`', "``"))
}

pub fn server_error(p: &[u8]) -> ClientError {
    let mut c = Cursor::new(p);
    let _ = c.u8();
    let code = c.u16().unwrap_or(0);
    let mut rest = c.rest();
    if rest.first() == Some(&b'#') && rest.len() >= 6 {
        rest = &rest[6..];
    }
    ClientError::Server { code, message: String::from_utf8_lossy(rest).into_owned() }
}

struct Handshake {
    server_version: String,
    capabilities: u32,
    scramble: Vec<u8>,
}

impl Handshake {
    fn parse(p: &[u8]) -> Result<Handshake, String> {
        let mut c = Cursor::new(p);
        let protocol = c.u8()?;
        if protocol != 10 {
            return Err(format!("protocol version {protocol}, expected 10"));
        }
        let server_version = String::from_utf8_lossy(c.nul_str()?).into_owned();
        c.skip(4)?; // connection id
        let mut scramble = c.bytes(8)?.to_vec();
        c.skip(1)?;
        let cap_low = c.u16()? as u32;
        let mut capabilities = cap_low;
        if !c.is_empty() {
            c.skip(1)?; // charset
            c.skip(2)?; // status
            capabilities |= (c.u16()? as u32) << 16;
            let auth_len = c.u8()? as usize;
            c.skip(10)?;
            if capabilities & CLIENT_SECURE_CONNECTION != 0 {
                let n = auth_len.saturating_sub(8).max(13);
                let part = c.bytes(n.min(c.remaining()))?;
                scramble.extend_from_slice(part.strip_suffix(&[0]).unwrap_or(part));
            }
            // The plugin name follows; we answer with mysql_native_password
            // whatever it says, and a server that wants another switches us.
        }
        Ok(Handshake { server_version, capabilities, scramble })
    }
}

/// mysql_native_password: SHA1(pw) XOR SHA1(scramble ++ SHA1(SHA1(pw))).
pub fn native_password(password: &str, scramble: &[u8]) -> Vec<u8> {
    if password.is_empty() {
        return Vec::new();
    }
    let stage1 = Sha1::digest(password.as_bytes());
    let stage2 = Sha1::digest(stage1);
    let mut h = Sha1::new();
    h.update(scramble);
    h.update(stage2);
    let mix = h.finalize();
    stage1.iter().zip(mix.iter()).map(|(a, b)| a ^ b).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_password_matches_the_servers_formula() {
        // The server keeps SHA1(SHA1(pw)); it recovers SHA1(pw) from our
        // answer and checks that it hashes to what it keeps.
        let scramble = b"abcdefghij0123456789";
        let answer = native_password("secret", scramble);
        let stage2 = Sha1::digest(Sha1::digest(b"secret"));
        let mut h = Sha1::new();
        h.update(scramble);
        h.update(stage2);
        let mix = h.finalize();
        let stage1: Vec<u8> = answer.iter().zip(mix.iter()).map(|(a, b)| a ^ b).collect();
        assert_eq!(Sha1::digest(&stage1).as_slice(), stage2.as_slice());
        assert!(native_password("", scramble).is_empty());
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("it's \\"), "'it''s \\\\'");
        assert_eq!(ident("a`b"), "`a``b`");
    }
}
