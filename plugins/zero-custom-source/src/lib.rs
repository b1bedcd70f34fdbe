//! zero-custom-source: Zero's "custom change source" protocol as a Sluice
//! source plugin.
//!
//! zero-cache can take its changes from any backend that serves
//! `/changes/v0/stream` over WebSocket (ZERO_UPSTREAM_TYPE=custom). This
//! plugin is the client side of that protocol, so Sluice can stand in for
//! zero-cache's change-streamer in front of every such backend: it dials the
//! endpoint with the same query parameters zero-cache sends, turns each
//! `ChangeStreamMessage` frame into WIT messages, and answers the host's
//! acks with the protocol's upstream `status` frames.
//!
//! Lineage: on a fresh start the endpoint's first transaction is the initial
//! snapshot, and its commit watermark `W` is the replica version. The change
//! log already holds an empty transaction at the replica version, so the
//! snapshot is stored at `W.01` (just after `W`, before anything the
//! upstream sends later); resuming after `W.01` asks the endpoint for what
//! follows `W`.
//!
//! Two connections, as zero-cache: its initial sync reads exactly one
//! transaction from a connection without `lastWatermark` and closes it;
//! streaming starts on a new connection with `lastWatermark=W` and
//! `replicaVersion=W`. A server written for zero-cache may send nothing
//! after the snapshot on the first connection, so this plugin reads nothing
//! past the snapshot there: once the host has made the snapshot durable (its
//! ack), it closes that connection and resumes on a new one. Servers that do
//! stream on the first connection resend those transactions on the second.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tungstenite::http::Uri;

mod protocol;
mod socket;

use protocol::{Converter, FrameError, Kind};
use sluice_plugin_sdk::types::{Message, PluginError};
use sluice_plugin_sdk::{Resume, Source};
use socket::{Frame, Socket};

/// The path zero-cache's custom change sources serve.
const STREAM_PATH: &str = "changes/v0/stream";
/// Appended to the snapshot's watermark `W` to store it just after `W`.
const SNAPSHOT_SUFFIX: &str = ".01";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Config {
    /// `ws://` or `http://` URL of the endpoint, or of its base (then
    /// `changes/v0/stream` is appended).
    url: String,
    #[serde(rename = "appID", default = "default_app_id")]
    app_id: String,
    #[serde(default)]
    shard_num: u32,
    #[serde(default)]
    publications: Vec<String>,
    /// The CA file the host checks a `wss://` or `https://` upstream with
    /// (read by the host, which does the TLS; the system's CAs without it).
    #[serde(rename = "tls_ca", default)]
    _tls_ca: Option<String>,
    /// Connect and handshake timeout.
    #[serde(default = "default_connect_timeout")]
    connect_timeout_ms: u64,
    /// How long `open` waits for the initial snapshot to begin (keep it
    /// under the host's plugin call deadline).
    #[serde(default = "default_snapshot_wait")]
    snapshot_wait_ms: u64,
    /// Liveness pings (every 3 s): an upstream that answers neither pong nor
    /// message between two pings is given up and reconnected, so a silent
    /// network path costs at most 6 s.
    #[serde(default = "default_ping_interval")]
    ping_interval_ms: u64,
}

fn default_app_id() -> String {
    "zero".into()
}
fn default_connect_timeout() -> u64 {
    2000
}
fn default_snapshot_wait() -> u64 {
    3500
}
fn default_ping_interval() -> u64 {
    3_000
}

impl Config {
    fn parse(text: &str) -> Result<Config, PluginError> {
        let c: Config = serde_json::from_str(text)
            .map_err(|e| PluginError::InvalidConfig(format!("zero-custom-source config: {e}")))?;
        if c.app_id.is_empty() {
            return Err(PluginError::InvalidConfig("zero-custom-source config: appID is empty".into()));
        }
        Ok(c)
    }

    /// The endpoint URL with zero-cache's query parameters.
    fn stream_url(&self, resume: Option<(&str, &str)>) -> Result<Endpoint, PluginError> {
        let invalid =
            |m: String| PluginError::InvalidConfig(format!("zero-custom-source config: url {:?}: {m}", self.url));
        let uri: Uri = self.url.parse().map_err(|e: tungstenite::http::uri::InvalidUri| invalid(e.to_string()))?;
        let tls = match uri.scheme_str() {
            Some("ws" | "http") => false,
            Some("wss" | "https") => true,
            Some(other) => return Err(invalid(format!("scheme {other}: is not ws://, wss://, http:// or https://"))),
            None => return Err(invalid("no scheme (ws:// or wss://)".into())),
        };
        let authority = uri.authority().filter(|a| !a.host().is_empty()).ok_or_else(|| invalid("no host".into()))?;
        let mut path = uri.path().trim_end_matches('/').to_string();
        if !path.ends_with(&format!("/{STREAM_PATH}")) {
            path = format!("{path}/{STREAM_PATH}");
        }
        // Keep the operator's own parameters; ours replace any of the same name.
        const OURS: [&str; 5] = ["appID", "shardNum", "publications", "lastWatermark", "replicaVersion"];
        let mut q = form_urlencoded::Serializer::new(String::new());
        for (k, v) in form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes()) {
            if !OURS.contains(&k.as_ref()) {
                q.append_pair(&k, &v);
            }
        }
        q.append_pair("appID", &self.app_id);
        q.append_pair("shardNum", &self.shard_num.to_string());
        for p in &self.publications {
            q.append_pair("publications", p);
        }
        if let Some((last, rv)) = resume {
            q.append_pair("lastWatermark", last);
            q.append_pair("replicaVersion", rv);
        }
        // `[::1]` -> `::1` for the socket address.
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_string();
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        // The handshake is plain WebSocket inside the host's TLS tunnel.
        Ok(Endpoint { url: format!("ws://{}{path}?{}", authority.as_str(), q.finish()), host, port, tls })
    }
}

/// Where to connect and what to ask for.
pub struct Endpoint {
    pub url: String,
    pub host: String,
    pub port: u16,
    /// Through the host's TLS tunnel (a `wss://` or `https://` URL).
    pub tls: bool,
}

struct Stream {
    config: Config,
    socket: Socket,
    convert: Converter,
    replica_version: String,
    /// A fresh connection whose initial snapshot has not begun yet.
    awaiting_snapshot: bool,
    /// The initial snapshot's (upstream watermark `W`, the `W.01` it is
    /// stored at), once it began.
    snapshot_label: Option<(String, String)>,
    /// The initial snapshot's transaction is open.
    in_snapshot: bool,
    /// The commit watermark of the open transaction, as the upstream sent it.
    open_tx: Option<String>,
    last_commit: Option<String>,
    last_status: Option<String>,
    /// Status watermarks the upstream wants echoed with `ack: true`.
    echo: VecDeque<String>,
    /// Commits of `skipAck` transactions, never acked upstream.
    skip_ack: VecDeque<String>,
    /// Messages converted during `open`, handed out first.
    ready: Vec<Message>,
    /// An error met after part of a batch was converted: reported next call.
    deferred: Option<PluginError>,
    /// Where an initial connection stands after its snapshot.
    handoff: Handoff,
}

/// zero-cache's move from the initial-sync connection to the streaming one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handoff {
    /// Reading normally (a resume connection, or the snapshot is not done).
    None,
    /// The snapshot's commit was read from an initial connection: nothing
    /// more is read from it, and the host has not made the snapshot durable.
    AwaitingDurable,
    /// The snapshot is durable: the next call opens the resume connection.
    Resume,
}

/// A frame's first bytes, to name it in an error.
fn excerpt(frame: &str) -> String {
    let mut end = frame.len().min(160);
    while !frame.is_char_boundary(end) {
        end -= 1;
    }
    if end < frame.len() {
        format!("{}...", &frame[..end])
    } else {
        frame.to_string()
    }
}

impl Stream {
    /// Reads until the initial snapshot begins, so the replica version (its
    /// commit watermark) is known when `open` returns.
    fn await_snapshot(&mut self, wait: Duration) -> Result<(), PluginError> {
        let started = Instant::now();
        let mut out = Vec::new();
        while self.awaiting_snapshot {
            if started.elapsed() >= wait {
                return Err(PluginError::Transient(format!(
                    "the upstream began no initial snapshot within {} ms",
                    wait.as_millis()
                )));
            }
            match self.socket.read(true).map_err(PluginError::Transient)? {
                Frame::Idle => continue,
                Frame::Text(frame) => self.handle(frame.as_str(), &mut out)?,
            }
        }
        self.ready = out;
        Ok(())
    }

    /// Closes the initial connection and continues on a new one after the
    /// snapshot's watermark `W`, with the parameters zero-cache sends then.
    fn resume_after_snapshot(&mut self) -> Result<(), PluginError> {
        let Some((w, _)) = self.snapshot_label.clone() else { return Ok(()) };
        let url = self.config.stream_url(Some((&w, &w)))?;
        // Replacing the socket closes the old connection.
        self.socket = Socket::connect(
            &url,
            Duration::from_millis(self.config.connect_timeout_ms),
            Duration::from_millis(self.config.ping_interval_ms),
        )
        .map_err(|e| {
            PluginError::Transient(format!("cannot reach the upstream at {} after the snapshot: {e}", self.config.url))
        })?;
        self.handoff = Handoff::None;
        Ok(())
    }

    /// Reports `e` now, or after the messages already converted.
    fn fail(&mut self, out: Vec<Message>, e: PluginError) -> Result<Vec<Message>, PluginError> {
        if out.is_empty() {
            Err(e)
        } else {
            self.deferred = Some(e);
            Ok(out)
        }
    }

    /// Converts one frame and checks it against the protocol's order.
    fn handle(&mut self, frame: &str, out: &mut Vec<Message>) -> Result<(), PluginError> {
        let start = out.len();
        let kind = self.convert.convert(frame, out).map_err(|e| frame_error(e, frame))?;
        let refuse = |why: String| PluginError::Transient(format!("{why}: {}", excerpt(frame)));
        match kind {
            Kind::Begin { watermark, skip_ack } => {
                if let Some(open) = &self.open_tx {
                    return Err(refuse(format!("begin while transaction {open} is still open")));
                }
                if let Some(last) = self.last_commit.as_ref().filter(|l| watermark <= **l) {
                    return Err(refuse(format!("commit watermark {watermark} does not follow the last commit {last}")));
                }
                if self.awaiting_snapshot {
                    self.awaiting_snapshot = false;
                    self.replica_version = watermark.clone();
                    self.snapshot_label = Some((watermark.clone(), format!("{watermark}{SNAPSHOT_SUFFIX}")));
                    self.in_snapshot = true;
                    relabel(out, start, &format!("{watermark}{SNAPSHOT_SUFFIX}"));
                }
                if skip_ack {
                    self.skip_ack.push_back(watermark.clone());
                }
                self.open_tx = Some(watermark);
            }
            Kind::Commit { watermark } => {
                let Some(open) = self.open_tx.take() else {
                    return Err(refuse("commit outside a transaction".into()));
                };
                if open != watermark {
                    return Err(refuse(format!("commit watermark {watermark} differs from its begin's {open}")));
                }
                if self.in_snapshot {
                    self.in_snapshot = false;
                    if let Some((_, label)) = &self.snapshot_label {
                        relabel(out, start, label);
                    }
                    // zero-cache's initial sync ends here, on this connection.
                    self.handoff = Handoff::AwaitingDurable;
                }
                self.last_commit = Some(watermark);
            }
            Kind::Rollback => {
                if self.open_tx.take().is_none() {
                    return Err(refuse("rollback outside a transaction".into()));
                }
                if self.in_snapshot {
                    return Err(refuse("the upstream rolled back its initial snapshot".into()));
                }
                self.skip_ack.retain(|w| Some(w) <= self.last_commit.as_ref());
            }
            Kind::Change => {
                if self.open_tx.is_none() {
                    return Err(refuse("a data change outside a transaction".into()));
                }
            }
            Kind::Status { watermark, ack } => {
                if let Some(last) = self.last_status.as_ref().filter(|l| watermark < **l) {
                    return Err(refuse(format!("status watermark {watermark} goes back from {last}")));
                }
                // Statuses before and during the initial snapshot are noise
                // (zero-cache ignores them too).
                if !self.awaiting_snapshot && !self.in_snapshot {
                    if ack {
                        self.echo.push_back(watermark.clone());
                    }
                    out.push(Message::Status(sluice_plugin_sdk::types::Status { watermark: watermark.clone(), ack }));
                }
                self.last_status = Some(watermark);
            }
            Kind::ResetRequired => {
                if self.awaiting_snapshot {
                    return Err(PluginError::Transient(format!(
                        "the upstream requires a reset before it sent an initial snapshot: {}",
                        excerpt(frame)
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Puts the snapshot's stored watermark on the begin or commit just converted.
fn relabel(out: &mut [Message], start: usize, label: &str) {
    for m in &mut out[start..] {
        match m {
            Message::Begin(b) => b.commit_watermark = label.to_string(),
            Message::Commit(c) => c.watermark = label.to_string(),
            _ => {}
        }
    }
}

fn frame_error(e: FrameError, frame: &str) -> PluginError {
    let text = format!("bad message from the upstream ({}): {}", e.message, excerpt(frame));
    if e.unsupported {
        PluginError::Fatal(text)
    } else {
        PluginError::Transient(text)
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

impl Source for Stream {
    fn open(config: &str, resume: Option<Resume>) -> Result<Stream, PluginError> {
        let config = Config::parse(config)?;
        let upstream_resume = resume.as_ref().map(|r| {
            let snapshot = format!("{}{SNAPSHOT_SUFFIX}", r.replica_version);
            let last = if r.watermark == snapshot { r.replica_version.as_str() } else { r.watermark.as_str() };
            (last, r.replica_version.as_str())
        });
        let url = config.stream_url(upstream_resume)?;
        let socket = Socket::connect(
            &url,
            Duration::from_millis(config.connect_timeout_ms),
            Duration::from_millis(config.ping_interval_ms),
        )
        .map_err(|e| PluginError::Transient(format!("cannot reach the upstream at {}: {e}", config.url)))?;
        let mut stream = Stream {
            config,
            socket,
            convert: Converter::default(),
            replica_version: resume.as_ref().map(|r| r.replica_version.clone()).unwrap_or_default(),
            awaiting_snapshot: resume.is_none(),
            snapshot_label: None,
            in_snapshot: false,
            open_tx: None,
            last_commit: None,
            last_status: None,
            echo: VecDeque::new(),
            skip_ack: VecDeque::new(),
            ready: Vec::new(),
            deferred: None,
            handoff: Handoff::None,
        };
        if stream.awaiting_snapshot {
            stream.await_snapshot(Duration::from_millis(stream.config.snapshot_wait_ms))?;
        }
        Ok(stream)
    }

    fn replica_version(&self) -> String {
        self.replica_version.clone()
    }

    fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, PluginError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        if self.handoff == Handoff::Resume {
            self.resume_after_snapshot()?;
        }
        let max = max.max(1) as usize;
        let mut out = std::mem::take(&mut self.ready);
        while out.len() < max && self.handoff == Handoff::None {
            // Wait only while the batch is empty; once it has something,
            // take what has arrived and hand it over.
            let frame = match self.socket.read(out.is_empty()) {
                Ok(Frame::Text(f)) => f,
                Ok(Frame::Idle) => break,
                Err(e) => return self.fail(out, PluginError::Transient(e)),
            };
            let before = out.len();
            if let Err(e) = self.handle(frame.as_str(), &mut out) {
                out.truncate(before);
                return self.fail(out, e);
            }
        }
        Ok(out)
    }

    /// The host made everything through `watermark` durable (or asks to
    /// echo a status): tell the upstream as zero-cache would.
    fn ack(&mut self, watermark: &str) -> Result<(), PluginError> {
        let echoed = self.echo.iter().any(|w| w == watermark);
        self.echo.retain(|w| w.as_str() > watermark);
        let skipped = self.skip_ack.iter().any(|w| w == watermark);
        self.skip_ack.retain(|w| w.as_str() > watermark);
        let snapshot = self.snapshot_label.as_ref().is_some_and(|(_, label)| label == watermark);
        if snapshot && self.handoff == Handoff::AwaitingDurable {
            self.handoff = Handoff::Resume;
        }
        let frame = if echoed {
            format!("[\"status\",{{\"ack\":true}},{{\"watermark\":{}}}]", json_string(watermark))
        } else if skipped || snapshot {
            // zero-cache never acks a skipAck transaction nor the initial sync.
            return Ok(());
        } else {
            format!("[\"status\",{{\"tag\":\"commit\"}},{{\"watermark\":{}}}]", json_string(watermark))
        };
        self.socket.send(frame).map_err(PluginError::Transient)
    }
}

sluice_plugin_sdk::export_source!(Stream);
