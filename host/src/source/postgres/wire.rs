//! A walsender client: the part of the Postgres wire protocol a replication
//! connection needs (startup with `replication=database`, password / md5 /
//! SCRAM authentication, simple queries, and the CopyBoth stream that
//! `START_REPLICATION` opens).
//!
//! tokio-postgres cannot open such a connection (it has no replication
//! startup parameter and no CopyBoth), so the frames are read here; the
//! message writers and SCRAM come from `postgres-protocol`, the crate
//! tokio-postgres itself is built on.

use std::fmt;

use bytes::{Buf, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_postgres::config::Host;

use crate::pgconn::tls::{self, SslMode};
use crate::pgconn::PgTarget;

trait Socket: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Socket for T {}

/// An error the server sent (ErrorResponse), or a failure of the connection.
#[derive(Debug, Clone)]
pub enum WireError {
    Server { code: String, message: String, detail: Option<String> },
    Io(String),
    Protocol(String),
}

impl WireError {
    pub fn code(&self) -> Option<&str> {
        match self {
            WireError::Server { code, .. } => Some(code),
            _ => None,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Server { code, message, detail } => {
                write!(f, "{message} (SQLSTATE {code})")?;
                if let Some(d) = detail {
                    write!(f, ": {d}")?;
                }
                Ok(())
            }
            WireError::Io(e) => write!(f, "replication connection: {e}"),
            WireError::Protocol(e) => write!(f, "replication protocol: {e}"),
        }
    }
}

impl std::error::Error for WireError {}

fn io(e: std::io::Error) -> WireError {
    WireError::Io(e.to_string())
}

/// Sends SSLRequest; true when the server answers `S` (go ahead with TLS).
async fn accepts_tls(socket: &mut tokio::net::TcpStream) -> Result<bool, WireError> {
    let mut request = BytesMut::new();
    frontend::ssl_request(&mut request);
    socket.write_all(&request).await.map_err(io)?;
    let mut answer = [0u8; 1];
    socket.read_exact(&mut answer).await.map_err(io)?;
    match answer[0] {
        b'S' => Ok(true),
        b'N' => Ok(false),
        other => Err(WireError::Protocol(format!("unexpected answer {other:#x} to SSLRequest"))),
    }
}

/// The connection string's TCP keepalive and `tcp_user_timeout` (with
/// Sluice's defaults, see [`crate::pgconn::conninfo`]) on the walsender
/// socket, as tokio-postgres applies them to the sockets it opens: a server
/// whose machine died is noticed in seconds, not after the kernel's two hours.
fn tcp_liveness(socket: &tokio::net::TcpStream, config: &tokio_postgres::Config) -> std::io::Result<()> {
    let sock = socket2::SockRef::from(socket);
    if config.get_keepalives() {
        let mut keepalive = socket2::TcpKeepalive::new().with_time(config.get_keepalives_idle());
        if let Some(interval) = config.get_keepalives_interval() {
            keepalive = keepalive.with_interval(interval);
        }
        if let Some(retries) = config.get_keepalives_retries() {
            keepalive = keepalive.with_retries(retries);
        }
        sock.set_tcp_keepalive(&keepalive)?;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Some(timeout) = config.get_tcp_user_timeout() {
        sock.set_tcp_user_timeout(Some(*timeout))?;
    }
    Ok(())
}

/// One backend message: its tag and body.
pub struct Frame {
    pub tag: u8,
    pub body: BytesMut,
}

pub struct ReplConnection {
    socket: Box<dyn Socket>,
    read: BytesMut,
    write: BytesMut,
}

/// The rows of a simple query, as text (`None` is SQL NULL).
pub type TextRows = Vec<Vec<Option<String>>>;

impl ReplConnection {
    /// Connects and authenticates with `replication=database`, over TLS as
    /// the target's `sslmode` asks. The whole attempt is bounded by the
    /// target's `connect_timeout`, as libpq bounds it.
    pub async fn connect(
        target: &PgTarget,
        config: &tokio_postgres::Config,
        application_name: &str,
    ) -> Result<Self, WireError> {
        let bound = config.get_connect_timeout().copied().unwrap_or(crate::pgconn::conninfo::CONNECT_TIMEOUT);
        tokio::time::timeout(bound, Self::connect_unbounded(target, config, application_name)).await.map_err(|_| {
            WireError::Io(format!("no answer from the server within {} s (connect_timeout)", bound.as_secs_f64()))
        })?
    }

    async fn connect_unbounded(
        target: &PgTarget,
        config: &tokio_postgres::Config,
        application_name: &str,
    ) -> Result<Self, WireError> {
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let mut binding = None;
        let socket: Box<dyn Socket> = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => {
                let mut s = tokio::net::TcpStream::connect((host.as_str(), port))
                    .await
                    .map_err(|e| WireError::Io(format!("connecting to {host}:{port}: {e}")))?;
                s.set_nodelay(true).map_err(io)?;
                tcp_liveness(&s, config).map_err(io)?;
                if target.tls.mode != SslMode::Disable && accepts_tls(&mut s).await? {
                    let tls = tls::handshake(target.tls.client_config(), host, s)
                        .await
                        .map_err(|e| WireError::Io(format!("error performing TLS handshake: {e}")))?;
                    binding = tls::server_end_point(&tls);
                    Box::new(tls)
                } else if target.tls.mode.requires_tls() {
                    return Err(WireError::Protocol(format!(
                        "server does not support TLS (sslmode={})",
                        target.tls.mode
                    )));
                } else {
                    Box::new(s)
                }
            }
            Some(Host::Unix(dir)) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                Box::new(
                    tokio::net::UnixStream::connect(&path)
                        .await
                        .map_err(|e| WireError::Io(format!("connecting to {}: {e}", path.display())))?,
                )
            }
            None => return Err(WireError::Protocol("the upstream URL names no host".into())),
        };
        let mut conn = ReplConnection { socket, read: BytesMut::with_capacity(64 << 10), write: BytesMut::new() };
        let user = config.get_user().unwrap_or("postgres").to_string();
        let database = config.get_dbname().unwrap_or(&user).to_string();
        let mut params = vec![
            ("user", user.as_str()),
            ("database", database.as_str()),
            ("replication", "database"),
            ("application_name", application_name),
            ("client_encoding", "UTF8"),
        ];
        if let Some(options) = config.get_options() {
            params.push(("options", options));
        }
        frontend::startup_message(params.iter().copied(), &mut conn.write).map_err(io)?;
        conn.flush().await?;
        conn.authenticate(&user, config.get_password(), binding, config.get_channel_binding()).await?;
        // Parameter statuses and the backend key, up to ReadyForQuery.
        loop {
            let f = conn.next_frame().await?;
            match f.tag {
                b'Z' => return Ok(conn),
                b'E' => return Err(server_error(f.body)),
                _ => {}
            }
        }
    }

    /// Password, md5 or SCRAM; SCRAM-SHA-256-PLUS when on TLS with a
    /// certificate hash (`binding`) and the server offers it.
    async fn authenticate(
        &mut self,
        user: &str,
        password: Option<&[u8]>,
        mut binding: Option<Vec<u8>>,
        policy: tokio_postgres::config::ChannelBinding,
    ) -> Result<(), WireError> {
        use tokio_postgres::config::ChannelBinding as Policy;
        let mut bound = false;
        let need_password = || {
            password.ok_or_else(|| WireError::Protocol("the server asks for a password and the URL has none".into()))
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            let mut f = self.next_frame().await?;
            match f.tag {
                b'E' => return Err(server_error(f.body)),
                b'R' => {}
                other => {
                    return Err(WireError::Protocol(format!(
                        "unexpected message {:?} during authentication",
                        other as char
                    )))
                }
            }
            if f.body.len() < 4 {
                return Err(WireError::Protocol("short authentication message".into()));
            }
            match f.body.get_i32() {
                0 if policy == Policy::Require && !bound => {
                    return Err(WireError::Protocol(
                        "channel_binding=require, but the server did not authenticate with SCRAM-SHA-256-PLUS".into(),
                    ))
                }
                0 => return Ok(()),
                3 => {
                    frontend::password_message(need_password()?, &mut self.write).map_err(io)?;
                }
                5 => {
                    if f.body.len() < 4 {
                        return Err(WireError::Protocol("short md5 salt".into()));
                    }
                    let salt = [f.body[0], f.body[1], f.body[2], f.body[3]];
                    let hash = postgres_protocol::authentication::md5_hash(user.as_bytes(), need_password()?, salt);
                    frontend::password_message(hash.as_bytes(), &mut self.write).map_err(io)?;
                }
                10 => {
                    let offered = String::from_utf8_lossy(&f.body).to_string();
                    let plus = offered.split('\0').any(|m| m == "SCRAM-SHA-256-PLUS");
                    if !plus && !offered.split('\0').any(|m| m == "SCRAM-SHA-256") {
                        return Err(WireError::Protocol(format!("no supported SASL mechanism offered ({offered:?})")));
                    }
                    let (mechanism, channel) = match binding.take() {
                        Some(hash) if plus && policy != Policy::Disable => {
                            bound = true;
                            ("SCRAM-SHA-256-PLUS", ChannelBinding::tls_server_end_point(hash))
                        }
                        // On TLS but not binding: say so, so a downgrade is detectable.
                        Some(_) if policy != Policy::Disable => ("SCRAM-SHA-256", ChannelBinding::unrequested()),
                        _ => ("SCRAM-SHA-256", ChannelBinding::unsupported()),
                    };
                    if policy == Policy::Require && !bound {
                        return Err(WireError::Protocol(
                            "channel_binding=require, but the connection has no TLS channel to bind (or the server does \
                             not offer SCRAM-SHA-256-PLUS)"
                                .into(),
                        ));
                    }
                    let s = ScramSha256::new(need_password()?, channel);
                    frontend::sasl_initial_response(mechanism, s.message(), &mut self.write).map_err(io)?;
                    scram = Some(s);
                }
                11 => {
                    let s = scram.as_mut().ok_or_else(|| WireError::Protocol("SASL continue before start".into()))?;
                    s.update(&f.body).map_err(|e| WireError::Protocol(format!("SCRAM: {e}")))?;
                    frontend::sasl_response(s.message(), &mut self.write).map_err(io)?;
                }
                12 => {
                    let s = scram.as_mut().ok_or_else(|| WireError::Protocol("SASL final before start".into()))?;
                    s.finish(&f.body).map_err(|e| WireError::Protocol(format!("SCRAM: {e}")))?;
                    continue;
                }
                code => return Err(WireError::Protocol(format!("unsupported authentication method (code {code})"))),
            }
            self.flush().await?;
        }
    }

    /// Runs one command in the simple query protocol and returns its rows.
    pub async fn simple_query(&mut self, sql: &str) -> Result<TextRows, WireError> {
        frontend::query(sql, &mut self.write).map_err(io)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let mut f = self.next_frame().await?;
            match f.tag {
                b'D' => rows.push(data_row(&mut f.body)?),
                b'E' => error = Some(server_error(f.body)),
                b'Z' => return error.map_or(Ok(rows), Err),
                _ => {}
            }
        }
    }

    /// Sends a `START_REPLICATION` command and waits for the CopyBoth stream.
    pub async fn start_copy_both(&mut self, sql: &str) -> Result<(), WireError> {
        frontend::query(sql, &mut self.write).map_err(io)?;
        self.flush().await?;
        loop {
            let f = self.next_frame().await?;
            match f.tag {
                b'W' => return Ok(()),
                b'E' => {
                    let e = server_error(f.body);
                    // Drain to ReadyForQuery so the error is the only thing said.
                    return Err(e);
                }
                b'N' | b'S' => {}
                other => {
                    return Err(WireError::Protocol(format!(
                        "unexpected message {:?} after START_REPLICATION",
                        other as char
                    )))
                }
            }
        }
    }

    /// Queues a CopyData message (sent by the next [`flush`](Self::flush)).
    pub fn queue_copy_data(&mut self, payload: &[u8]) -> Result<(), WireError> {
        frontend::CopyData::new(payload).map_err(io)?.write(&mut self.write);
        Ok(())
    }

    pub async fn flush(&mut self) -> Result<(), WireError> {
        if !self.write.is_empty() {
            self.socket.write_all(&self.write).await.map_err(io)?;
            self.write.clear();
        }
        Ok(())
    }

    /// A complete frame already read, if any.
    pub fn try_frame(&mut self) -> Result<Option<Frame>, WireError> {
        if self.read.len() < 5 {
            return Ok(None);
        }
        let len = i32::from_be_bytes([self.read[1], self.read[2], self.read[3], self.read[4]]);
        if len < 4 {
            return Err(WireError::Protocol(format!("bad frame length {len}")));
        }
        let total = len as usize + 1;
        if self.read.len() < total {
            self.read.reserve(total - self.read.len());
            return Ok(None);
        }
        let mut frame = self.read.split_to(total);
        let tag = frame[0];
        frame.advance(5);
        Ok(Some(Frame { tag, body: frame }))
    }

    /// Reads more bytes from the socket. Cancel safe.
    pub async fn fill(&mut self) -> Result<(), WireError> {
        if self.read.capacity() - self.read.len() < 8192 {
            self.read.reserve(64 << 10);
        }
        let n = self.socket.read_buf(&mut self.read).await.map_err(io)?;
        if n == 0 {
            return Err(WireError::Io("the server closed the connection".into()));
        }
        Ok(())
    }

    pub async fn next_frame(&mut self) -> Result<Frame, WireError> {
        loop {
            if let Some(f) = self.try_frame()? {
                return Ok(f);
            }
            self.fill().await?;
        }
    }
}

fn data_row(body: &mut BytesMut) -> Result<Vec<Option<String>>, WireError> {
    let short = || WireError::Protocol("short DataRow".into());
    if body.len() < 2 {
        return Err(short());
    }
    let n = body.get_i16();
    let mut row = Vec::with_capacity(n.max(0) as usize);
    for _ in 0..n {
        if body.len() < 4 {
            return Err(short());
        }
        let len = body.get_i32();
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        if body.len() < len {
            return Err(short());
        }
        row.push(Some(String::from_utf8_lossy(&body[..len]).into_owned()));
        body.advance(len);
    }
    Ok(row)
}

/// Parses an ErrorResponse body.
pub fn server_error(body: BytesMut) -> WireError {
    let (mut code, mut message, mut detail) = (String::new(), String::new(), None);
    for field in body[..].split(|b| *b == 0) {
        let Some((&kind, value)) = field.split_first() else { continue };
        let value = String::from_utf8_lossy(value).into_owned();
        match kind {
            b'C' => code = value,
            b'M' => message = value,
            b'D' => detail = Some(value),
            _ => {}
        }
    }
    WireError::Server { code, message, detail }
}

/// Microseconds since 2000-01-01, the clock of replication messages.
pub fn pg_now_micros() -> i64 {
    const PG_EPOCH_OFFSET_SECS: u64 = 946_684_800;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.as_micros() as i64 - (PG_EPOCH_OFFSET_SECS as i64 * 1_000_000)
}

/// A standby status update ('r'): received, flushed and applied positions.
pub fn standby_status(received: u64, flushed: u64, reply_requested: bool) -> [u8; 34] {
    let mut out = [0u8; 34];
    out[0] = b'r';
    out[1..9].copy_from_slice(&received.to_be_bytes());
    out[9..17].copy_from_slice(&flushed.to_be_bytes());
    out[17..25].copy_from_slice(&flushed.to_be_bytes());
    out[25..33].copy_from_slice(&pg_now_micros().to_be_bytes());
    out[33] = reply_requested as u8;
    out
}

/// `H/L` text of an LSN.
pub fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// Parses `H/L` text.
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (h, l) = text.split_once('/')?;
    Some((u64::from_str_radix(h, 16).ok()? << 32) | u64::from_str_radix(l, 16).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trip() {
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(lsn_text(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("0/A"), Some(10));
        assert_eq!(parse_lsn("x/1"), None);
        assert_eq!(parse_lsn("12"), None);
    }

    #[test]
    fn error_fields() {
        let body = BytesMut::from(&b"SERROR\0C55000\0Mslot is gone\0Dmore\0\0"[..]);
        let e = server_error(body);
        assert_eq!(e.code(), Some("55000"));
        assert_eq!(e.to_string(), "slot is gone (SQLSTATE 55000): more");
    }
}
