//! The WebSocket connection to the custom change-source endpoint.
//!
//! Plain blocking `std::net` I/O, which WASI turns into host polls. Reads wait
//! at most `WAIT` when the host has nothing else from us, and not at all once
//! a batch has started, so a batch is returned as soon as the socket is
//! drained instead of after a timeout.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};

/// How long an idle `next-batch` waits for a frame before returning nothing.
pub const WAIT: Duration = Duration::from_millis(100);

pub struct Socket {
    ws: WebSocket<TcpStream>,
    nonblocking: bool,
    /// When anything (a frame, a pong) last arrived.
    last_heard: Instant,
    /// When the last liveness ping went out.
    last_ping: Instant,
    ping_every: Duration,
}

/// What one read produced.
pub enum Frame {
    Text(tungstenite::Utf8Bytes),
    /// Nothing arrived in time.
    Idle,
}

impl Socket {
    /// Connects and completes the WebSocket handshake within `timeout`.
    pub fn connect(endpoint: &crate::Endpoint, timeout: Duration, ping_every: Duration) -> Result<Socket, String> {
        let stream = if endpoint.tls {
            sluice_plugin_sdk::net::connect_tls(&endpoint.host, endpoint.port, timeout)?
        } else {
            sluice_plugin_sdk::net::connect(&endpoint.host, endpoint.port, timeout)?
        };
        let config = WebSocketConfig::default();
        let (ws, _response) = tungstenite::client::client_with_config(endpoint.url.as_str(), stream, Some(config))
            .map_err(|e| match e {
                tungstenite::HandshakeError::Interrupted(_) => {
                    format!("the WebSocket handshake did not complete within {} ms", timeout.as_millis())
                }
                tungstenite::HandshakeError::Failure(e) => format!("the WebSocket handshake failed: {e}"),
            })?;
        ws.get_ref().set_read_timeout(Some(WAIT)).map_err(|e| format!("setting a read timeout: {e}"))?;
        let now = Instant::now();
        Ok(Socket { ws, nonblocking: false, last_heard: now, last_ping: now, ping_every })
    }

    /// Reads one frame: waits up to `WAIT` when `wait`, else only takes what
    /// has already arrived. Control frames are handled here.
    pub fn read(&mut self, wait: bool) -> Result<Frame, String> {
        self.set_nonblocking(!wait)?;
        loop {
            match self.ws.read() {
                Ok(Message::Text(t)) => {
                    self.last_heard = Instant::now();
                    return Ok(Frame::Text(t));
                }
                Ok(Message::Binary(b)) => {
                    return Err(format!("the upstream sent a binary frame of {} bytes; the protocol is text", b.len()))
                }
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => {
                    // tungstenite queues the pong reply itself.
                    self.last_heard = Instant::now();
                }
                Ok(Message::Close(frame)) => {
                    return Err(match frame {
                        Some(f) => format!("the upstream closed the stream ({} {})", u16::from(f.code), f.reason),
                        None => "the upstream closed the stream".to_string(),
                    })
                }
                Err(tungstenite::Error::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    self.check_liveness()?;
                    return Ok(Frame::Idle);
                }
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    return Err("the upstream closed the connection".to_string())
                }
                Err(e) => return Err(format!("reading from the upstream: {e}")),
            }
        }
    }

    /// Sends one text frame (an upstream status).
    pub fn send(&mut self, text: String) -> Result<(), String> {
        self.set_nonblocking(false)?;
        match self.ws.send(Message::text(text)) {
            Ok(()) => Ok(()),
            // Written into tungstenite's buffer; flushed with the next I/O.
            Err(tungstenite::Error::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(()),
            Err(e) => Err(format!("sending to the upstream: {e}")),
        }
    }

    /// Pings as zero-cache does: every `ping_every`, and gives up when
    /// nothing, not even a pong, came back since the previous ping.
    fn check_liveness(&mut self) -> Result<(), String> {
        if self.last_ping.elapsed() < self.ping_every {
            return Ok(());
        }
        if self.last_heard < self.last_ping {
            return Err(format!(
                "the upstream sent nothing, not even a pong, for {} ms",
                self.last_ping.elapsed().as_millis()
            ));
        }
        self.last_ping = Instant::now();
        match self.ws.send(Message::Ping(Vec::new().into())) {
            Ok(()) => Ok(()),
            Err(tungstenite::Error::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(()),
            Err(e) => Err(format!("pinging the upstream: {e}")),
        }
    }

    fn set_nonblocking(&mut self, on: bool) -> Result<(), String> {
        if self.nonblocking != on {
            self.ws.get_ref().set_nonblocking(on).map_err(|e| format!("switching socket mode: {e}"))?;
            self.nonblocking = on;
        }
        Ok(())
    }
}
