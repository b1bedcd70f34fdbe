//! A WebSocket client for the fleet bench that costs little CPU.
//!
//! The bench runs a thousand subscribers in its own process on the same two
//! cores as `sluice`. With tungstenite they spent more CPU per change than
//! `sluice` did (a payload allocation and UTF-8 check per message, a
//! formatted ack and a frame per ack), so a shared catch-up measured the
//! clients more than the server. This client reads frames in place from one
//! buffer and writes the acks of everything read together with one write.
//! It still speaks the protocol in full: every message acked, masked client
//! frames, pings answered. Only what the bench needs is here: one
//! unfragmented frame per message, as `sluice` sends.

use std::ops::Range;

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const READ_CHUNK: usize = 64 * 1024;

/// A frame read from the server: its opcode and where its payload lies in
/// [`LeanSocket::payload`].
pub struct Frame {
    pub opcode: u8,
    payload: Range<usize>,
}

pub const TEXT: u8 = 0x1;
pub const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;

pub struct LeanSocket {
    stream: TcpStream,
    /// Bytes read; frames are parsed from `start` on.
    inbuf: Vec<u8>,
    start: usize,
    /// Frames to send, written by [`LeanSocket::flush`].
    out: Vec<u8>,
    /// Masking keys (xorshift: client frames must be masked, with keys the
    /// server cannot guess; the bench needs no stronger randomness).
    mask_state: u32,
}

impl LeanSocket {
    /// Opens `ws://{addr}{path}`.
    pub async fn connect(addr: &str, path: &str) -> anyhow::Result<LeanSocket> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos() | 1;
        // The handshake key: 16 bytes, base64-encoded (any will do; the
        // server only hashes it).
        let key_bytes: Vec<u8> = (0..16u32).map(|i| seed.rotate_left(i * 5) as u8).collect();
        let key = base64::engine::general_purpose::STANDARD.encode(key_bytes);
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        let mut inbuf = Vec::with_capacity(1024);
        let end = loop {
            if let Some(end) = inbuf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            anyhow::ensure!(inbuf.len() < 16 * 1024, "response headers too long");
            anyhow::ensure!(stream.read_buf(&mut inbuf).await? > 0, "closed during the handshake");
        };
        let head = String::from_utf8_lossy(&inbuf[..end]).to_string();
        anyhow::ensure!(head.starts_with("HTTP/1.1 101"), "no upgrade: {}", head.lines().next().unwrap_or(""));
        Ok(LeanSocket { stream, inbuf, start: end, out: Vec::with_capacity(4096), mask_state: seed })
    }

    /// The next frame already read, if a whole one is buffered.
    pub fn buffered_frame(&mut self) -> anyhow::Result<Option<Frame>> {
        let buf = &self.inbuf[self.start..];
        if buf.len() < 2 {
            return Ok(None);
        }
        anyhow::ensure!(buf[0] & 0x80 != 0, "fragmented message (the bench expects none)");
        anyhow::ensure!(buf[1] & 0x80 == 0, "masked frame from the server");
        let (len, header) = match buf[1] & 0x7f {
            126 if buf.len() >= 4 => (u16::from_be_bytes([buf[2], buf[3]]) as usize, 4),
            127 if buf.len() >= 10 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&buf[2..10]);
                (usize::try_from(u64::from_be_bytes(b))?, 10)
            }
            126 | 127 => return Ok(None),
            n => (n as usize, 2),
        };
        if buf.len() < header + len {
            return Ok(None);
        }
        let opcode = buf[0] & 0x0f;
        let payload = self.start + header..self.start + header + len;
        self.start = payload.end;
        if opcode == PING {
            let data = self.inbuf[payload.clone()].to_vec();
            self.queue(PONG, &data);
        }
        Ok(Some(Frame { opcode, payload }))
    }

    pub fn payload(&self, frame: &Frame) -> &[u8] {
        &self.inbuf[frame.payload.clone()]
    }

    /// Waits for more bytes from the server; false when it closed.
    pub async fn read_more(&mut self) -> anyhow::Result<bool> {
        // Parsed bytes are dropped once they are most of the buffer.
        if self.start > 0 && self.start * 2 >= self.inbuf.len() {
            self.inbuf.drain(..self.start);
            self.start = 0;
        }
        self.inbuf.reserve(READ_CHUNK);
        Ok(self.stream.read_buf(&mut self.inbuf).await? > 0)
    }

    /// Queues a text message (sent by [`LeanSocket::flush`]).
    pub fn queue_text(&mut self, payload: &[u8]) {
        self.queue(TEXT, payload);
    }

    fn queue(&mut self, opcode: u8, payload: &[u8]) {
        self.out.push(0x80 | opcode);
        match payload.len() {
            n @ 0..=125 => self.out.push(0x80 | n as u8),
            n @ 126..=0xffff => {
                self.out.push(0x80 | 126);
                self.out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                self.out.push(0x80 | 127);
                self.out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        self.mask_state ^= self.mask_state << 13;
        self.mask_state ^= self.mask_state >> 17;
        self.mask_state ^= self.mask_state << 5;
        let mask = self.mask_state.to_be_bytes();
        self.out.extend_from_slice(&mask);
        self.out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    }

    /// Writes what was queued.
    pub async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.out.is_empty() {
            self.stream.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }
}
