//! MariaDB's packet framing over one TCP stream, and a cursor for reading
//! the little-endian fields inside packets and binlog events.
//!
//! A packet is a 3-byte length, a 1-byte sequence number and the payload;
//! payloads of 16 MiB - 1 or more continue in the following packets. Reads
//! go through our own buffer so that a binlog event can arrive over several
//! non-blocking reads (WASI has no `dup`, so there is one stream and no
//! separate reader and writer).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const MAX_PAYLOAD: usize = 0xff_ffff;

pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Start of the unread bytes in `buf`.
    pos: usize,
    seq: u8,
    nonblocking: bool,
    /// The read timeout in blocking mode.
    timeout: Duration,
    /// Bytes written to the server so far (where TLS starts, see
    /// `Client::connect`).
    written: u64,
}

/// What a non-blocking read produced.
pub enum Poll {
    Packet(Vec<u8>),
    /// No whole packet has arrived yet.
    Pending,
}

impl Conn {
    /// A connection over `stream`, whose read and write timeouts are
    /// `timeout` already (`sluice_plugin_sdk::net::connect` sets them).
    pub fn new(stream: TcpStream, timeout: Duration) -> Result<Conn, String> {
        Ok(Conn { stream, buf: Vec::with_capacity(64 << 10), pos: 0, seq: 0, nonblocking: false, timeout, written: 0 })
    }

    /// Every byte written to the server so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Starts a new command: the client's first packet has sequence 0.
    pub fn reset_seq(&mut self) {
        self.seq = 0;
    }

    pub fn write_packet(&mut self, payload: &[u8]) -> Result<(), String> {
        self.set_nonblocking(false)?;
        let mut out = Vec::with_capacity(payload.len() + 4);
        let mut chunks = payload.chunks(MAX_PAYLOAD).peekable();
        if payload.is_empty() {
            out.extend_from_slice(&[0, 0, 0, self.seq]);
            self.seq = self.seq.wrapping_add(1);
        }
        while let Some(chunk) = chunks.next() {
            let n = chunk.len();
            out.extend_from_slice(&[n as u8, (n >> 8) as u8, (n >> 16) as u8, self.seq]);
            out.extend_from_slice(chunk);
            self.seq = self.seq.wrapping_add(1);
            if n == MAX_PAYLOAD && chunks.peek().is_none() {
                out.extend_from_slice(&[0, 0, 0, self.seq]);
                self.seq = self.seq.wrapping_add(1);
            }
        }
        self.stream.write_all(&out).map_err(|e| io_error("writing to the server", e))?;
        self.written += out.len() as u64;
        Ok(())
    }

    /// Reads one whole packet, waiting up to the connection's timeout.
    pub fn read_packet(&mut self) -> Result<Vec<u8>, String> {
        self.set_nonblocking(false)?;
        loop {
            if let Some(p) = self.take_packet() {
                return Ok(p);
            }
            match self.fill() {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(format!("the server sent nothing for {} ms", self.timeout.as_millis()))
                }
                Err(e) => return Err(io_error("reading from the server", e)),
            }
        }
    }

    /// Returns a packet if one has arrived, waiting at most `wait`
    /// (`None`: not at all).
    pub fn poll_packet(&mut self, wait: Option<Duration>) -> Result<Poll, String> {
        if let Some(p) = self.take_packet() {
            return Ok(Poll::Packet(p));
        }
        match wait {
            None => self.set_nonblocking(true)?,
            Some(w) => {
                self.set_nonblocking(false)?;
                self.stream.set_read_timeout(Some(w.max(Duration::from_millis(1)))).map_err(|e| e.to_string())?;
            }
        }
        let got = self.fill();
        if wait.is_some() {
            self.stream.set_read_timeout(Some(self.timeout)).map_err(|e| e.to_string())?;
        }
        match got {
            Ok(()) => Ok(self.take_packet().map_or(Poll::Pending, Poll::Packet)),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(Poll::Pending),
            Err(e) => Err(io_error("reading from the server", e)),
        }
    }

    /// One read from the socket into the buffer. End of stream is an error.
    fn fill(&mut self) -> std::io::Result<()> {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > (1 << 20) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let len = self.buf.len();
        let want = (64 << 10).max(self.missing());
        self.buf.resize(len + want, 0);
        let got = self.stream.read(&mut self.buf[len..]);
        match got {
            Ok(0) => {
                self.buf.truncate(len);
                Err(std::io::Error::new(ErrorKind::UnexpectedEof, "the server closed the connection"))
            }
            Ok(n) => {
                self.buf.truncate(len + n);
                Ok(())
            }
            Err(e) => {
                self.buf.truncate(len);
                Err(e)
            }
        }
    }

    /// Bytes still missing from the packet at the head of the buffer.
    fn missing(&self) -> usize {
        let have = &self.buf[self.pos..];
        if have.len() < 4 {
            return 4;
        }
        let n = u32::from_le_bytes([have[0], have[1], have[2], 0]) as usize;
        (n + 4).saturating_sub(have.len())
    }

    /// A whole packet (with its continuations) from the buffer, if present.
    fn take_packet(&mut self) -> Option<Vec<u8>> {
        let mut at = self.pos;
        let mut total = 0usize;
        // First check that every part has arrived.
        loop {
            let head = self.buf.get(at..at + 4)?;
            let n = u32::from_le_bytes([head[0], head[1], head[2], 0]) as usize;
            if self.buf.len() < at + 4 + n {
                return None;
            }
            total += n;
            at += 4 + n;
            if n < MAX_PAYLOAD {
                break;
            }
        }
        let mut out = Vec::with_capacity(total);
        let mut at2 = self.pos;
        while at2 < at {
            let head = &self.buf[at2..at2 + 4];
            let n = u32::from_le_bytes([head[0], head[1], head[2], 0]) as usize;
            self.seq = head[3].wrapping_add(1);
            out.extend_from_slice(&self.buf[at2 + 4..at2 + 4 + n]);
            at2 += 4 + n;
        }
        self.pos = at;
        Some(out)
    }

    fn set_nonblocking(&mut self, on: bool) -> Result<(), String> {
        if self.nonblocking != on {
            self.stream.set_nonblocking(on).map_err(|e| format!("switching socket mode: {e}"))?;
            self.nonblocking = on;
        }
        Ok(())
    }
}

fn io_error(what: &str, e: std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof => "the server closed the connection".to_string(),
        _ => format!("{what}: {e}"),
    }
}

/// Reads fields from a packet or event body. Every read checks the length,
/// so a short or corrupt packet is an error, never a panic.
pub struct Cursor<'a> {
    pub data: &'a [u8],
    pub pos: usize,
}

pub type Res<T> = Result<T, String>;

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8]) -> Cursor<'a> {
        Cursor { data, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    pub fn bytes(&mut self, n: usize) -> Res<&'a [u8]> {
        if self.remaining() < n {
            return Err(format!("truncated: wanted {n} bytes at offset {}, {} left", self.pos, self.remaining()));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.data[self.pos..];
        self.pos = self.data.len();
        s
    }

    pub fn skip(&mut self, n: usize) -> Res<()> {
        self.bytes(n).map(|_| ())
    }

    pub fn u8(&mut self) -> Res<u8> {
        Ok(self.bytes(1)?[0])
    }

    pub fn u16(&mut self) -> Res<u16> {
        let b = self.bytes(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub fn u24(&mut self) -> Res<u32> {
        let b = self.bytes(3)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], 0]))
    }

    pub fn u32(&mut self) -> Res<u32> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u48(&mut self) -> Res<u64> {
        self.uint_le(6)
    }

    pub fn u64(&mut self) -> Res<u64> {
        self.uint_le(8)
    }

    /// An unsigned little-endian integer of `n` (at most 8) bytes.
    pub fn uint_le(&mut self, n: usize) -> Res<u64> {
        let b = self.bytes(n)?;
        Ok(b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | x as u64))
    }

    /// An unsigned big-endian integer of `n` (at most 8) bytes.
    pub fn uint_be(&mut self, n: usize) -> Res<u64> {
        let b = self.bytes(n)?;
        Ok(b.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64))
    }

    /// A length-encoded integer. `None` is the NULL marker (0xfb).
    pub fn lenenc(&mut self) -> Res<Option<u64>> {
        Ok(match self.u8()? {
            0xfb => None,
            0xfc => Some(self.u16()? as u64),
            0xfd => Some(self.u24()? as u64),
            0xfe => Some(self.u64()?),
            0xff => return Err("0xff is not a length-encoded integer".into()),
            n => Some(n as u64),
        })
    }

    pub fn lenenc_int(&mut self) -> Res<u64> {
        self.lenenc()?.ok_or_else(|| "unexpected NULL".to_string())
    }

    pub fn lenenc_bytes(&mut self) -> Res<Option<&'a [u8]>> {
        match self.lenenc()? {
            None => Ok(None),
            Some(n) => self.bytes(usize::try_from(n).map_err(|_| format!("length {n} is too large"))?).map(Some),
        }
    }

    pub fn lenenc_str(&mut self) -> Res<String> {
        let b = self.lenenc_bytes()?.unwrap_or_default();
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    /// Bytes up to (not including) a NUL, which is consumed.
    pub fn nul_str(&mut self) -> Res<&'a [u8]> {
        let rest = &self.data[self.pos..];
        let end = rest.iter().position(|&b| b == 0).ok_or("missing NUL terminator")?;
        self.pos += end + 1;
        Ok(&rest[..end])
    }
}

pub fn put_lenenc(out: &mut Vec<u8>, n: u64) {
    match n {
        0..=250 => out.push(n as u8),
        251..=0xffff => {
            out.push(0xfc);
            out.extend_from_slice(&(n as u16).to_le_bytes());
        }
        0x1_0000..=0xff_ffff => {
            out.push(0xfd);
            out.extend_from_slice(&(n as u32).to_le_bytes()[..3]);
        }
        _ => {
            out.push(0xfe);
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
}
