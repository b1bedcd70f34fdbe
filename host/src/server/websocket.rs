//! The server side of WebSocket (RFC 6455) for the subscriber endpoint.
//!
//! Subscribers are the hot path: every change goes to every subscriber as
//! one text message, and every message comes back as one ack. A general
//! WebSocket library costs here: an owned `String` and `Message` per change,
//! a copy into its own write buffer, a lock between the halves of a split
//! socket and an allocation per incoming ack. This socket does the least the
//! protocol needs: outgoing frames (Zero's envelope around the shared JSON)
//! are written straight into one write buffer, and incoming frames are
//! parsed in place and handed to a closure without being copied.
//!
//! What it supports is what subscribers use: HTTP/1.1 upgrade, text and
//! binary messages (fragmented or not), ping, pong and close. No extensions
//! are negotiated (so no compression, as before), and client frames must be
//! masked. tungstenite keeps serving the other WebSocket endpoints and the
//! clients.

use std::io;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::{header, request::Parts, HeaderMap, HeaderValue, Method, StatusCode, Version};
use axum::response::Response;
use bytes::{Buf, BytesMut};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Write-buffer capacity kept between batches; a larger one (a catch-up
/// batch) is given back once its connection has nothing more to write.
const KEEP_WRITE_CAPACITY: usize = 16 << 10;
/// Read-buffer growth step: acks are tiny, so reads are small.
const READ_CHUNK: usize = 4 << 10;

/// A request to upgrade to a WebSocket (an axum extractor).
pub struct Upgrade {
    key: HeaderValue,
    on_upgrade: hyper::upgrade::OnUpgrade,
}

impl<S: Send + Sync> FromRequestParts<S> for Upgrade {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let bad = |why| Err((StatusCode::BAD_REQUEST, why));
        if parts.version != Version::HTTP_11 {
            return bad("WebSocket upgrades need HTTP/1.1");
        }
        if parts.method != Method::GET {
            return Err((StatusCode::METHOD_NOT_ALLOWED, "a WebSocket upgrade is a GET request"));
        }
        if !header_has_token(&parts.headers, header::CONNECTION, "upgrade") {
            return Err((StatusCode::UPGRADE_REQUIRED, "Connection header did not include 'upgrade'"));
        }
        if !header_has_token(&parts.headers, header::UPGRADE, "websocket") {
            return Err((StatusCode::UPGRADE_REQUIRED, "Upgrade header did not include 'websocket'"));
        }
        if parts.headers.get(header::SEC_WEBSOCKET_VERSION).map(HeaderValue::as_bytes) != Some(b"13") {
            return bad("Sec-WebSocket-Version header must be 13");
        }
        let Some(key) = parts.headers.get(header::SEC_WEBSOCKET_KEY).cloned() else {
            return bad("Sec-WebSocket-Key header missing");
        };
        let Some(on_upgrade) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
            return bad("connection not upgradable");
        };
        Ok(Upgrade { key, on_upgrade })
    }
}

fn header_has_token(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes())))
}

impl Upgrade {
    /// Answers the upgrade and runs `serve` on the socket once the client
    /// has it.
    pub fn on_upgrade<F, Fut>(self, serve: F) -> Response
    where
        F: FnOnce(Socket<TokioIo<hyper::upgrade::Upgraded>>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(self.key.as_bytes());
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            match on_upgrade.await {
                Ok(upgraded) => serve(Socket::new(TokioIo::new(upgraded))).await,
                Err(e) => tracing::debug!("WebSocket upgrade failed: {e}"),
            }
        });
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let headers = response.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(accept) = HeaderValue::from_str(&accept) {
            headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
        }
        response
    }
}

/// A message from the peer, borrowed from the socket's read buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming<'a> {
    Text(&'a str),
    Binary(&'a [u8]),
    /// Its pong is queued.
    Ping,
    Pong,
    /// The peer's close frame (its answer is queued), or the end of the stream.
    Close,
}

/// Why a peer's frames were refused (the connection ends).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// tungstenite's words, which subscribers and tests already know.
    #[error("Space limit exceeded: Message too long: {0} > {1}")]
    TooLong(u64, usize),
    #[error("WebSocket protocol error: {0}")]
    Protocol(&'static str),
}

const CONTINUATION: u8 = 0x0;
const TEXT: u8 = 0x1;
const BINARY: u8 = 0x2;
const CLOSE: u8 = 0x8;
const PING: u8 = 0x9;
const PONG: u8 = 0xA;

/// One WebSocket connection, server side.
pub struct Socket<S> {
    io: S,
    read: BytesMut,
    write: Vec<u8>,
    /// The opcode and payload so far of a fragmented message.
    fragments: Option<(u8, Vec<u8>)>,
    max_message: usize,
}

/// A complete frame at the front of the read buffer.
struct FrameAt {
    fin: bool,
    opcode: u8,
    /// Where the (unmasked) payload starts, and its length.
    start: usize,
    len: usize,
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Socket<S> {
    pub fn new(io: S) -> Socket<S> {
        Socket { io, read: BytesMut::new(), write: Vec::new(), fragments: None, max_message: 64 << 20 }
    }

    /// Refuses messages (and frames) over `max` bytes as they arrive.
    pub fn max_message_size(mut self, max: usize) -> Self {
        self.max_message = max;
        self
    }

    /// Queues a text frame whose payload is `parts`, in order.
    pub fn queue_text(&mut self, parts: &[&[u8]]) {
        let len = parts.iter().map(|p| p.len()).sum();
        self.queue_header(TEXT, len);
        for part in parts {
            self.write.extend_from_slice(part);
        }
    }

    pub fn queue_ping(&mut self) {
        self.queue_header(PING, 0);
    }

    /// Queues a close frame; `reason` is cut to the 123 bytes a control
    /// frame leaves for it (at a character boundary).
    pub fn queue_close(&mut self, code: u16, reason: &str) {
        let mut end = reason.len().min(123);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        self.queue_header(CLOSE, 2 + end);
        self.write.extend_from_slice(&code.to_be_bytes());
        self.write.extend_from_slice(&reason.as_bytes()[..end]);
    }

    /// Sends a close frame after what is queued.
    pub async fn close(&mut self, code: u16, reason: &str) {
        self.queue_close(code, reason);
        self.flush_before_end().await;
    }

    /// [`Socket::close`], then ends the connection cleanly, as a shutdown
    /// must for every peer: the write side is shut (a FIN after the close
    /// frame) and whatever the peer still sends (acks in flight, its
    /// answering close) is read and dropped until it closes too, for up to
    /// two seconds. Dropped with unread data, a socket is reset by the
    /// kernel, and a reset discards what was still unsent: the close frame
    /// among it.
    pub async fn close_gracefully(&mut self, code: u16, reason: &str) {
        self.close(code, reason).await;
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
            let _ = self.io.shutdown().await;
            let mut discard = [0u8; 4096];
            while let Ok(n) = self.io.read(&mut discard).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }

    /// [`Socket::close_gracefully`] in a task of its own: the peer reads
    /// the close frame (and, over TLS, `close_notify`) instead of a reset,
    /// while the connection's owner moves on at once (unregisters the
    /// subscriber and frees what it held).
    pub fn close_in_background(mut self, code: u16, reason: &str)
    where
        S: Send + 'static,
    {
        self.shrink();
        let reason = reason.to_string();
        tokio::spawn(async move { self.close_gracefully(code, &reason).await });
    }

    /// Writes what is queued (the answer to a peer's close, say) as the
    /// connection ends: gives up after a second, since it ends either way.
    pub async fn flush_before_end(&mut self) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), self.flush()).await;
    }

    fn queue_header(&mut self, opcode: u8, len: usize) {
        // Server frames are never masked.
        self.write.push(0x80 | opcode);
        if len < 126 {
            self.write.push(len as u8);
        } else if len <= u16::MAX as usize {
            self.write.push(126);
            self.write.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.write.push(127);
            self.write.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }

    /// Makes room for `bytes` more to be queued.
    pub fn reserve(&mut self, bytes: usize) {
        self.write.reserve(bytes);
    }

    /// Bytes queued and not yet flushed.
    pub fn queued(&self) -> usize {
        self.write.len()
    }

    /// Writes what is queued. Not cancel safe: a write given up half-way
    /// leaves the stream mid-frame, so the connection must end.
    pub async fn flush(&mut self) -> io::Result<()> {
        if !self.write.is_empty() {
            self.io.write_all(&self.write).await?;
            self.write.clear();
        }
        self.io.flush().await
    }

    /// Gives back a write buffer grown by a big batch; called when nothing
    /// more is about to be written, so a connection that is only kept open
    /// costs little.
    pub fn shrink(&mut self) {
        if self.write.is_empty() && self.write.capacity() > KEEP_WRITE_CAPACITY {
            self.write = Vec::new();
        }
        if self.read.is_empty() && self.read.capacity() > KEEP_WRITE_CAPACITY {
            self.read = BytesMut::new();
        }
    }

    /// Waits for the peer's next message and hands it to `take`. A ping
    /// gets its pong queued and a close its answer queued (the caller
    /// flushes them). Cancel safe: nothing is consumed or written until a
    /// whole frame has arrived.
    pub async fn next<R>(&mut self, take: impl FnOnce(Incoming<'_>) -> R) -> Result<R, ReadError> {
        loop {
            if let Some(frame) = self.complete_frame()? {
                return self.deliver(frame, take);
            }
            self.read.reserve(READ_CHUNK);
            if self.io.read_buf(&mut self.read).await? == 0 {
                return Ok(take(Incoming::Close));
            }
        }
    }

    /// The next message if it has already arrived (no waiting): acks that
    /// came together are taken in one go.
    pub fn next_buffered<R>(&mut self, take: impl FnOnce(Incoming<'_>) -> R) -> Result<Option<R>, ReadError> {
        match self.complete_frame()? {
            Some(frame) => self.deliver(frame, take).map(Some),
            None => Ok(None),
        }
    }

    /// The last frame of a message (or a control frame) once it has all
    /// arrived; the frames before it are kept aside.
    fn complete_frame(&mut self) -> Result<Option<FrameAt>, ReadError> {
        loop {
            match self.parse()? {
                Some(frame) if !frame.fin => self.stash(frame),
                complete => return Ok(complete),
            }
        }
    }

    /// The frame at the front of the read buffer, unmasked in place, if it
    /// has all arrived.
    fn parse(&mut self) -> Result<Option<FrameAt>, ReadError> {
        let buf = &self.read[..];
        if buf.len() < 2 {
            return Ok(None);
        }
        let (b0, b1) = (buf[0], buf[1]);
        if b0 & 0x70 != 0 {
            return Err(ReadError::Protocol("reserved bits set (no extension was negotiated)"));
        }
        if b1 & 0x80 == 0 {
            return Err(ReadError::Protocol("unmasked frame from a client"));
        }
        let (fin, opcode) = (b0 & 0x80 != 0, b0 & 0x0F);
        let (len, mut at) = match b1 & 0x7F {
            126 if buf.len() >= 4 => (u16::from_be_bytes([buf[2], buf[3]]) as u64, 4),
            127 if buf.len() >= 10 => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&buf[2..10]);
                (u64::from_be_bytes(n), 10)
            }
            126 | 127 => return Ok(None),
            n => (n as u64, 2),
        };
        match opcode {
            CLOSE | PING | PONG if !fin || len > 125 => {
                return Err(ReadError::Protocol("fragmented or oversized control frame"));
            }
            CLOSE | PING | PONG => {}
            CONTINUATION if self.fragments.is_none() => {
                return Err(ReadError::Protocol("continuation frame without a message to continue"));
            }
            TEXT | BINARY if self.fragments.is_some() => {
                return Err(ReadError::Protocol("new message before the last one was finished"));
            }
            CONTINUATION | TEXT | BINARY => {
                let so_far = self.fragments.as_ref().map_or(0, |(_, payload)| payload.len() as u64);
                let total = len.saturating_add(so_far);
                if total > self.max_message as u64 {
                    return Err(ReadError::TooLong(total, self.max_message));
                }
            }
            _ => return Err(ReadError::Protocol("unknown opcode")),
        }
        let len = len as usize;
        if buf.len() < at + 4 + len {
            return Ok(None);
        }
        let mask = [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
        at += 4;
        for (i, byte) in self.read[at..at + len].iter_mut().enumerate() {
            *byte ^= mask[i & 3];
        }
        Ok(Some(FrameAt { fin, opcode, start: at, len }))
    }

    /// Keeps a frame of a message that is not finished yet.
    fn stash(&mut self, frame: FrameAt) {
        let (_, payload) = self.fragments.get_or_insert_with(|| (frame.opcode, Vec::new()));
        payload.extend_from_slice(&self.read[frame.start..frame.start + frame.len]);
        self.read.advance(frame.start + frame.len);
    }

    fn deliver<R>(&mut self, frame: FrameAt, take: impl FnOnce(Incoming<'_>) -> R) -> Result<R, ReadError> {
        let FrameAt { opcode, start, len, .. } = frame;
        let end = start + len;
        let result = match opcode {
            PING => {
                // Answered with the same payload.
                self.queue_header(PONG, len);
                self.write.extend_from_slice(&self.read[start..end]);
                Ok(take(Incoming::Ping))
            }
            PONG => Ok(take(Incoming::Pong)),
            CLOSE => {
                // The peer's code is echoed (a close without one gets 1000).
                let code = match self.read[start..end] {
                    [a, b, ..] => u16::from_be_bytes([a, b]),
                    _ => 1000,
                };
                self.queue_close(code, "");
                Ok(take(Incoming::Close))
            }
            _ => {
                let (kind, joined) = match self.fragments.take() {
                    Some((kind, mut payload)) => {
                        payload.extend_from_slice(&self.read[start..end]);
                        (kind, Some(payload))
                    }
                    None => (opcode, None),
                };
                let payload = joined.as_deref().unwrap_or(&self.read[start..end]);
                if kind == TEXT {
                    match std::str::from_utf8(payload) {
                        Ok(text) => Ok(take(Incoming::Text(text))),
                        Err(_) => Err(ReadError::Protocol("text message is not UTF-8")),
                    }
                } else {
                    Ok(take(Incoming::Binary(payload)))
                }
            }
        };
        self.read.advance(end);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::protocol::{frame::coding::CloseCode, Role};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    /// A server socket and a tungstenite client over an in-memory pipe.
    async fn pair() -> (Socket<tokio::io::DuplexStream>, WebSocketStream<tokio::io::DuplexStream>) {
        let (server, client) = tokio::io::duplex(1 << 20);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        (Socket::new(server).max_message_size(200_000), client)
    }

    async fn text(server: &mut Socket<tokio::io::DuplexStream>) -> Result<String, ReadError> {
        server
            .next(|m| match m {
                Incoming::Text(t) => t.to_string(),
                other => format!("{other:?}"),
            })
            .await
    }

    #[tokio::test]
    async fn text_frames_of_every_length_encoding_reach_a_client() {
        let (mut server, mut client) = pair().await;
        // 7-bit, 16-bit and 64-bit lengths, at their edges.
        for n in [0usize, 125, 126, 65_535, 65_536, 100_000] {
            let body = "x".repeat(n);
            server.queue_text(&[b"{\"id\":", n.to_string().as_bytes(), b"}", body.as_bytes()]);
            server.flush().await.unwrap();
            let got = client.next().await.unwrap().unwrap();
            assert_eq!(got, Message::text(format!("{{\"id\":{n}}}{body}")));
        }
    }

    #[tokio::test]
    async fn masked_client_messages_of_any_size_and_fragmented_ones_are_read() {
        let (mut server, mut client) = pair().await;
        for n in [1usize, 125, 126, 70_000] {
            let body = "é".repeat(n / 2);
            client.send(Message::text(body.clone())).await.unwrap();
            assert_eq!(text(&mut server).await.unwrap(), body);
        }
        // A message in three frames, as a client may send it.
        use tokio_tungstenite::tungstenite::protocol::frame::{coding::Data, coding::OpCode, Frame};
        let part = |op, fin, s: &str| Frame::message(s.as_bytes().to_vec(), op, fin);
        client.send(Message::Frame(part(OpCode::Data(Data::Text), false, "{\"ack\""))).await.unwrap();
        client.send(Message::Frame(part(OpCode::Data(Data::Continue), false, ":4"))).await.unwrap();
        client.send(Message::Frame(part(OpCode::Data(Data::Continue), true, "2}"))).await.unwrap();
        assert_eq!(text(&mut server).await.unwrap(), "{\"ack\":42}");
        client.send(Message::binary(vec![1, 2, 3])).await.unwrap();
        let binary = server.next(|m| matches!(m, Incoming::Binary([1, 2, 3]))).await.unwrap();
        assert!(binary);
    }

    #[tokio::test]
    async fn pings_are_answered_and_pongs_and_closes_handed_on() {
        let (mut server, mut client) = pair().await;
        client.send(Message::Ping(b"hi".to_vec().into())).await.unwrap();
        assert_eq!(text(&mut server).await.unwrap(), "Ping");
        server.flush().await.unwrap();
        assert_eq!(client.next().await.unwrap().unwrap(), Message::Pong(b"hi".to_vec().into()));
        server.queue_ping();
        server.flush().await.unwrap();
        // tungstenite answers the ping while reading.
        assert!(matches!(client.next().await.unwrap().unwrap(), Message::Ping(_)));
        client.flush().await.unwrap();
        assert_eq!(text(&mut server).await.unwrap(), "Pong");
        client.close(None).await.unwrap();
        assert_eq!(text(&mut server).await.unwrap(), "Close");
        server.flush().await.unwrap();
        assert!(matches!(client.next().await.unwrap().unwrap(), Message::Close(_)), "the close is answered");
    }

    #[tokio::test]
    async fn a_close_reason_is_cut_to_fit_a_control_frame() {
        let (mut server, mut client) = pair().await;
        server.queue_close(1011, &"é".repeat(100));
        server.flush().await.unwrap();
        let Message::Close(Some(close)) = client.next().await.unwrap().unwrap() else { panic!("no close") };
        assert_eq!(close.code, CloseCode::Error);
        assert_eq!(close.reason.len(), 122, "123 bytes would split a character");
    }

    #[tokio::test]
    async fn oversized_messages_and_unmasked_frames_are_refused() {
        let (mut server, mut client) = pair().await;
        client.send(Message::text("x".repeat(200_001))).await.unwrap();
        let e = text(&mut server).await.unwrap_err();
        assert_eq!(e.to_string(), "Space limit exceeded: Message too long: 200001 > 200000");

        let (server_io, mut raw) = tokio::io::duplex(1024);
        let mut server = Socket::new(server_io);
        raw.write_all(&[0x81, 0x02, b'h', b'i']).await.unwrap();
        assert!(matches!(text(&mut server).await, Err(ReadError::Protocol("unmasked frame from a client"))));
    }

    #[tokio::test]
    async fn a_message_split_across_reads_is_read_once_whole() {
        let (server_io, mut raw) = tokio::io::duplex(1024);
        let mut server = Socket::new(server_io);
        let mask = [1u8, 2, 3, 4];
        let payload: Vec<u8> = b"{\"ack\":7}".iter().enumerate().map(|(i, b)| b ^ mask[i % 4]).collect();
        let mut frame = vec![0x81, 0x80 | payload.len() as u8];
        frame.extend_from_slice(&mask);
        frame.extend_from_slice(&payload);
        let reader = tokio::spawn(async move { text(&mut server).await.unwrap() });
        for byte in frame {
            raw.write_all(&[byte]).await.unwrap();
            raw.flush().await.unwrap();
            tokio::task::yield_now().await;
        }
        assert_eq!(reader.await.unwrap(), "{\"ack\":7}");
    }
}
