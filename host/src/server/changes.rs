//! `GET /replication/v{N}/changes`: Zero's change-streamer WebSocket protocol.
//!
//! Frames out are `{"id":n,"msg":<downstream message>}` with `n` counting
//! from 1; the peer answers `{"ack":n}` when it has processed message `n`.
//! Sending is pipelined: messages go out without waiting, and each counts as
//! consumed when its ack arrives, in order. Pings every 10 s; a peer that
//! answers neither pong nor message between two pings is dropped, and so is
//! one that takes nothing of a write for [`WRITE_STALL_LIMIT`] (a silent
//! network path: its socket buffers are full and nothing drains them).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::response::Response;

use super::access::Refusal;
use super::closing::{close_with_error, elide, until_closed, PROTOCOL_ERROR};
use super::websocket::{self, Incoming, Socket};
use super::AppState;
use crate::filter::FilterGroup;
use crate::subscriber::sending::{AckOutcome, Batch, Released};
use crate::subscriber::{Connection, ErrorType, Frame, Mode, Sending, Subscriber};

/// Protocol versions of `@rocicorp/zero` 1.9.0's change-streamer.
pub const MIN_PROTOCOL: u32 = 1;
pub const MAX_PROTOCOL: u32 = 6;

/// The largest message a subscriber may send. It sends acks of a few dozen
/// bytes; a bigger message is refused as it arrives instead of buffered.
pub const MAX_SUBSCRIBER_MESSAGE: usize = 64 << 10;

/// Frames taken off a subscriber's queue for one write (and one flush).
const WRITE_BATCH_FRAMES: usize = 256;
/// The JSON bytes of one write, at most (one frame may be larger).
const WRITE_BATCH_BYTES: usize = 64 << 10;

/// A socket of the snapshot endpoint: a small read buffer (the default
/// 128 KiB per connection adds up over many peers) and a cap on what it may
/// send.
fn limited(ws: WebSocketUpgrade) -> WebSocketUpgrade {
    ws.read_buffer_size(8 << 10).max_message_size(MAX_SUBSCRIBER_MESSAGE).max_frame_size(MAX_SUBSCRIBER_MESSAGE)
}

/// What a subscriber asked for.
#[derive(Debug, Clone)]
pub struct SubscriberContext {
    pub protocol: u32,
    pub id: String,
    pub task_id: String,
    pub mode: Mode,
    pub replica_version: String,
    pub watermark: String,
    /// The filter chain asked for (`filters=[...]`).
    pub filters: Option<Vec<crate::filter::FilterSpec>>,
}

/// Checks the `v{N}` path segment as Zero does.
pub fn check_protocol(segment: &str, path: &str) -> Result<u32, String> {
    let digits = segment.strip_prefix('v').filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
    let Some(digits) = digits else {
        return Err(format!("invalid path: {path}"));
    };
    let v: u64 = digits.parse().map_err(|_| format!("invalid path: {path}"))?;
    if v < MIN_PROTOCOL as u64 || v > MAX_PROTOCOL as u64 {
        return Err(format!(
            "Cannot service client at protocol v{v}. Supported protocols: [v{MIN_PROTOCOL} ... v{MAX_PROTOCOL}]"
        ));
    }
    Ok(v as u32)
}

fn param<'a>(q: &'a HashMap<String, String>, name: &str, required: bool) -> Result<Option<&'a str>, String> {
    match q.get(name).map(String::as_str).filter(|v| !v.is_empty()) {
        Some(v) => Ok(Some(v)),
        None if required => Err(format!("invalid querystring - missing {name}")),
        None => Ok(None),
    }
}

/// Parses the request in Zero's order, so the first problem is the one named.
pub fn parse_context(segment: &str, query: &HashMap<String, String>) -> Result<SubscriberContext, String> {
    let path = format!("/replication/{segment}/changes");
    let protocol = check_protocol(segment, &path)?;
    let id = param(query, "id", true)?.unwrap_or_default().to_string();
    let task_id = param(query, "taskID", false)?.unwrap_or_default().to_string();
    let mode = if param(query, "mode", false)? == Some("backup") { Mode::Backup } else { Mode::Serving };
    let replica_version = param(query, "replicaVersion", true)?.unwrap_or_default().to_string();
    let watermark = param(query, "watermark", true)?.unwrap_or_default().to_string();
    let filters = param(query, "filters", false)?.map(crate::filter::parse_specs).transpose()?;
    Ok(SubscriberContext { protocol, id, task_id, mode, replica_version, watermark, filters })
}

pub async fn changes(
    ws: websocket::Upgrade,
    Path(segment): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    ConnectInfo(super::Peer(peer)): ConnectInfo<super::Peer>,
    State(app): State<AppState>,
) -> Result<Response, Refusal> {
    let permit = app.access.admit(peer)?;
    let ctx = parse_context(&segment, &query);
    Ok(ws.on_upgrade(move |socket| async move {
        let _permit = permit;
        let socket = socket.max_message_size(MAX_SUBSCRIBER_MESSAGE);
        match ctx {
            Err(message) => refuse(socket, &message).await,
            Ok(ctx) => serve(socket, ctx, app).await,
        }
    }))
}

pub async fn snapshot(
    ws: WebSocketUpgrade,
    Path(segment): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    ConnectInfo(super::Peer(peer)): ConnectInfo<super::Peer>,
    State(app): State<AppState>,
) -> Result<Response, Refusal> {
    let permit = app.access.admit(peer)?;
    let path = format!("/replication/{segment}/snapshot");
    let result: Result<(), String> = check_protocol(&segment, &path).and_then(|_| {
        if param(&query, "taskID", false)?.is_none() {
            return Err("Missing taskID in snapshot request".to_string());
        }
        Err("backups are not configured".to_string())
    });
    Ok(limited(ws).on_upgrade(move |socket| async move {
        let _permit = permit;
        if let Err(message) = result {
            close_with_error(socket, &message).await;
        }
    }))
}

/// Refuses a subscription: the close `closing::close_with_error` sends, on
/// a subscriber socket.
async fn refuse<S: Io>(mut socket: Socket<S>, message: &str) {
    tracing::info!("closing subscriber connection: {message}");
    let reason = format!("Error: {message}");
    if reason.len() > 123 {
        // A close frame holds 123 bytes of reason: the whole message goes
        // first, as the protocol's error message, and the close sums it up.
        let error = serde_json::json!(["error", {"type": ErrorType::Unknown as u8, "message": message}]).to_string();
        socket.queue_text(&[b"{\"id\":1,\"msg\":", error.as_bytes(), b"}"]);
    }
    // Awaited, not in the background: the connection's permit is held
    // until the socket is gone.
    socket.close_gracefully(PROTOCOL_ERROR, &elide(&reason, 123)).await;
}

impl<S: Io> crate::subscriber::sending::Outgoing for Socket<S> {
    fn reserve(&mut self, bytes: usize) {
        Socket::reserve(self, bytes);
    }
    fn queue_text(&mut self, parts: &[&[u8]]) {
        Socket::queue_text(self, parts);
    }
}

/// The byte stream under a subscriber's WebSocket.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Io for T {}

async fn serve<S: Io>(socket: Socket<S>, ctx: SubscriberContext, app: AppState) {
    // A filter chain that cannot be built refuses the subscription before
    // any change is sent.
    let filter = match &ctx.filters {
        None => None,
        Some(specs) => match app.filters.group(specs).await {
            Ok(group) => Some(group),
            Err(message) => {
                tracing::warn!(subscriber = %ctx.id, "refusing subscriber: {message}");
                return refuse(socket, &message).await;
            }
        },
    };
    let (sub, conn) = Subscriber::new(
        ctx.id.clone(),
        ctx.task_id.clone(),
        ctx.mode,
        ctx.protocol,
        ctx.watermark.clone(),
        app.subscriber_limits,
    );
    tracing::info!(
        subscriber = %ctx.id,
        task = %ctx.task_id,
        watermark = %ctx.watermark,
        protocol = ctx.protocol,
        filters = filter.as_ref().map(|f| f.label.as_str()).unwrap_or("-"),
        "subscriber connected"
    );
    app.hub.subscribe(sub.clone(), &ctx.replica_version);
    let reason = pump(socket, &sub, conn, app.ping_interval, filter, app.shutdown.clone()).await;
    app.hub.unsubscribe(&sub);
    tracing::info!(subscriber = %ctx.id, acked = %sub.acked(), "subscriber disconnected: {reason}");
}

/// What the peer sent, taken out of the socket's read buffer.
enum Read {
    Ack(Result<u64, String>),
    Binary,
    Ping,
    Pong,
    Close,
}

impl Read {
    fn of(incoming: Incoming<'_>) -> Read {
        match incoming {
            Incoming::Text(text) => Read::Ack(parse_ack(text)),
            Incoming::Binary(_) => Read::Binary,
            Incoming::Ping => Read::Ping,
            Incoming::Pong => Read::Pong,
            Incoming::Close => Read::Close,
        }
    }
}

/// What the reads taken in one go did.
#[derive(Default)]
struct Taken {
    released: Released,
    /// A ping came: its pong is queued.
    pong: bool,
}

/// How reading ended the connection, if it did.
enum Ending {
    Not,
    /// The error message sent was acknowledged: close.
    AfterError,
    /// The peer closed.
    Peer,
    /// The peer broke the protocol: close with the error message.
    Refused(String),
    /// The peer's frames broke WebSocket's rules.
    Protocol(&'static str),
    /// The connection failed.
    Lost(String),
}

/// Takes `first` and every read that has already arrived after it, releasing
/// acknowledged messages, until one ends the connection.
fn take_reads<S: Io>(
    first: Result<Read, websocket::ReadError>,
    socket: &mut Socket<S>,
    sending: &mut Sending,
) -> (Taken, Ending) {
    let mut taken = Taken::default();
    let mut read = first;
    loop {
        match read {
            Ok(Read::Ack(Ok(id))) => match sending.ack(id, &mut taken.released) {
                Ok(AckOutcome::Released) => {}
                Ok(AckOutcome::ErrorAcknowledged) => return (taken, Ending::AfterError),
                Err(e) => return (taken, Ending::Refused(e)),
            },
            Ok(Read::Ack(Err(e))) => return (taken, Ending::Refused(e)),
            Ok(Read::Binary) => return (taken, Ending::Refused("Expected string message".into())),
            Ok(Read::Ping) => taken.pong = true,
            Ok(Read::Pong) => {}
            Ok(Read::Close) => return (taken, Ending::Peer),
            // Tell the subscriber why (a reset needs no close frame, and
            // gets none).
            Err(e @ websocket::ReadError::TooLong(..)) => {
                return (taken, Ending::Refused(format!("connection error: {e}")));
            }
            Err(websocket::ReadError::Protocol(why)) => return (taken, Ending::Protocol(why)),
            Err(e) => return (taken, Ending::Lost(format!("connection error: {e}"))),
        }
        read = match socket.next_buffered(Read::of) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => return (taken, Ending::Not),
            Err(e) => Err(e),
        };
    }
}

/// Sends the subscriber's queue and reads its acks until either side ends;
/// returns why. What to send, and what an ack releases, is [`Sending`]'s;
/// this is the transport: pings, reads, writes, and how the socket ends.
async fn pump<S: Io>(
    mut socket: Socket<S>,
    sub: &Arc<Subscriber>,
    mut conn: Connection,
    ping_every: Duration,
    filter: Option<Arc<FilterGroup>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> String {
    let stopping = super::stopping(shutdown);
    tokio::pin!(stopping);
    let mut sending = Sending::new(sub.clone(), filter);
    let mut alive = true;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + ping_every, ping_every);
    loop {
        let window_full = sending.window_full();
        // In this order: stopping, pings and acks are cheap and come first
        // (acks make room for what waits), then what there is to write.
        tokio::select! {
            biased;
            _ = &mut stopping => {
                socket.close_gracefully(1001, super::SHUTTING_DOWN).await;
                return "Sluice is shutting down".into();
            }
            _ = ping.tick() => {
                // Nothing (not even a pong) since the last ping: the peer is gone.
                if !alive {
                    return "no pong or message since the last ping".into();
                }
                alive = false;
                socket.queue_ping();
                if until_closed(sub, socket.flush()).await.is_err() {
                    return "ping failed".into();
                }
            }
            read = socket.next(Read::of) => {
                alive = true;
                // This read and every other that has already arrived.
                let (taken, ending) = take_reads(read, &mut socket, &mut sending);
                sending.consumed(&taken.released);
                match ending {
                    Ending::Not if taken.pong => {
                        // A pong is queued.
                        if let Err(e) = until_closed(sub, socket.flush()).await {
                            return e;
                        }
                    }
                    Ending::Not => {}
                    Ending::AfterError => {
                        // The error message was acknowledged.
                        socket.close_in_background(1000, "");
                        return "closed after sending an error".into();
                    }
                    Ending::Peer => {
                        // The answer to its close, if it sent one, is queued.
                        socket.flush_before_end().await;
                        return "closed by the peer".into();
                    }
                    Ending::Refused(e) => return close_with_error_on(socket, e),
                    Ending::Protocol(why) => {
                        socket.close_in_background(PROTOCOL_ERROR, why);
                        return format!("connection error: {why}");
                    }
                    Ending::Lost(e) => return e,
                }
            }
            _ = sub.closed(), if window_full => {}
            frame = conn.frames.recv(), if !window_full => {
                // Take what else is already queued and write it with one flush.
                let first_bytes = frame.as_ref().map_or(0, Frame::json_len);
                let mut frames = Vec::with_capacity(conn.frames.len().min(WRITE_BATCH_FRAMES - 1) + 1);
                frames.push(frame);
                let batch_bytes = first_bytes + conn.frames.take_into(&mut frames, WRITE_BATCH_FRAMES, WRITE_BATCH_BYTES.saturating_sub(first_bytes));
                let closing = match sending.prepare(frames, batch_bytes, &mut socket).await {
                    Batch::Empty => continue,
                    Batch::Written { closing } => closing,
                };
                // What is being written counts against the memory budget
                // until it is out.
                let writing = socket.queued();
                sending.writing(writing);
                let written = until_closed(sub, socket.flush()).await;
                sending.written(writing);
                if let Err(e) = written {
                    return e;
                }
                if closing {
                    socket.close_in_background(1000, "");
                    return "closed by the server".into();
                }
                // Nothing more came while writing: what a batch grew goes back.
                if conn.frames.shrink_if_empty() {
                    socket.shrink();
                }
            }
        }
    }
}

/// Ends a subscriber's connection for `message` (a close with 1011);
/// returns the message.
fn close_with_error_on<S: Io>(socket: Socket<S>, message: String) -> String {
    tracing::warn!("closing subscriber connection: {message}");
    socket.close_in_background(1011, &elide(&format!("Error: {message}"), 123));
    message
}

fn parse_ack(text: &str) -> Result<u64, String> {
    // One ack per message: the form clients send is read without a parser.
    let digits = text.strip_prefix("{\"ack\":").and_then(|t| t.strip_suffix('}'));
    if let Some(n) = digits.filter(|d| (1..=19).contains(&d.len()) && d.bytes().all(|b| b.is_ascii_digit())) {
        if let Ok(n) = n.parse() {
            return Ok(n);
        }
    }
    #[derive(serde::Deserialize)]
    struct Ack {
        ack: u64,
    }
    serde_json::from_str::<Ack>(text).map(|a| a.ack).map_err(|e| format!("invalid ack {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn bad_requests_name_the_first_problem_as_zero_does() {
        assert_eq!(parse_context("v6", &q(&[])).unwrap_err(), "invalid querystring - missing id");
        assert_eq!(
            parse_context("v6", &q(&[("id", "foo"), ("taskID", "t")])).unwrap_err(),
            "invalid querystring - missing replicaVersion"
        );
        assert_eq!(
            parse_context("v6", &q(&[("id", "foo"), ("replicaVersion", "01"), ("initial", "true")])).unwrap_err(),
            "invalid querystring - missing watermark"
        );
        assert_eq!(
            parse_context("v7", &q(&[])).unwrap_err(),
            "Cannot service client at protocol v7. Supported protocols: [v1 ... v6]"
        );
        assert_eq!(parse_context("x6", &q(&[])).unwrap_err(), "invalid path: /replication/x6/changes");
        let ok =
            parse_context("v5", &q(&[("id", "a"), ("replicaVersion", "01"), ("watermark", "02"), ("mode", "backup")]))
                .unwrap();
        assert_eq!((ok.protocol, ok.mode, ok.watermark.as_str()), (5, Mode::Backup, "02"));
    }

    #[test]
    fn acks_parse_in_their_usual_form_and_any_other_json_form() {
        assert_eq!(parse_ack("{\"ack\":17}"), Ok(17));
        assert_eq!(parse_ack("{ \"ack\" : 18 }"), Ok(18));
        assert!(parse_ack("{\"ack\":-1}").is_err());
        assert!(parse_ack("{\"ack\":}").is_err());
        assert!(parse_ack("{\"ack\":99999999999999999999}").is_err(), "beyond u64");
    }
}
