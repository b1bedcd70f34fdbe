//! A test upstream for the zero-custom-source plugin: a WebSocket server that
//! speaks Zero's custom change-source protocol (`/changes/v0/stream`) over a
//! real socket, from a history of transactions the test controls.
//!
//! A connection without `lastWatermark` gets the initial snapshot and then
//! the whole history (or, in zero-cache's style, see
//! [`Upstream::snapshot_only_on_initial`], the snapshot alone); one with
//! `lastWatermark=L` gets every transaction after `L`. Transactions appended
//! later are streamed live. Faults are one-shot: cut the connection inside a
//! transaction, or send a malformed frame.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use futures::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::Message as Ws;

/// One upstream transaction: its commit watermark and its frames, begin to commit.
#[derive(Clone, Debug)]
pub struct Tx {
    pub watermark: String,
    pub frames: Vec<String>,
}

impl Tx {
    /// `begin`, one `data` frame per change body, `commit`.
    pub fn new(watermark: &str, changes: &[serde_json::Value]) -> Tx {
        Tx::with_begin(watermark, serde_json::json!({"tag": "begin"}), changes)
    }

    pub fn with_begin(watermark: &str, begin: serde_json::Value, changes: &[serde_json::Value]) -> Tx {
        let mut frames = vec![serde_json::json!(["begin", begin, {"commitWatermark": watermark}]).to_string()];
        frames.extend(changes.iter().map(|c| serde_json::json!(["data", c]).to_string()));
        frames.push(serde_json::json!(["commit", {"tag": "commit"}, {"watermark": watermark}]).to_string());
        Tx { watermark: watermark.to_string(), frames }
    }
}

#[derive(Clone, Debug)]
pub enum Fault {
    /// Send half of this transaction's frames, then drop the connection.
    CutInside(String),
    /// Send a frame that is not JSON just before this transaction.
    MalformedBefore(String),
    /// Send this frame (verbatim) just before this transaction.
    FrameBefore(String, String),
    /// Go silent before this transaction: keep the connection open but
    /// neither send nor read (so pings go unanswered).
    StallBefore(String),
}

#[derive(Default)]
struct State {
    snapshot: Option<Tx>,
    history: Vec<Tx>,
    /// Query strings of every connection, in order.
    connections: Vec<String>,
    /// Text frames the client sent (upstream acks).
    received: Vec<String>,
    faults: Vec<Fault>,
    snapshot_only_on_initial: bool,
}

#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    appended: Arc<Notify>,
    stop: Arc<Notify>,
}

impl Upstream {
    pub async fn start(snapshot: Tx) -> Upstream {
        Upstream::start_on("127.0.0.1:0".parse().unwrap(), snapshot).await
    }

    /// Serves on `addr` (for an upstream that comes up where a client has
    /// been trying to reach it).
    pub async fn start_on(addr: SocketAddr, snapshot: Tx) -> Upstream {
        let listener = TcpListener::bind(addr).await.expect("binding the test upstream");
        let up = Upstream {
            addr: listener.local_addr().unwrap(),
            state: Arc::new(Mutex::new(State { snapshot: Some(snapshot), ..State::default() })),
            appended: Arc::new(Notify::new()),
            stop: Arc::new(Notify::new()),
        };
        let server = up.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((socket, _)) = accepted else { return };
                        tokio::spawn(server.clone().serve(socket));
                    }
                    _ = server.stop.notified() => return,
                }
            }
        });
        up
    }

    /// Stops listening (open connections end with their next send).
    pub fn shutdown(&self) {
        self.stop.notify_waiters();
    }

    /// `ws://ADDR/`: the base URL, as an operator would configure it.
    pub fn url(&self) -> String {
        format!("ws://{}/", self.addr)
    }

    pub fn append(&self, tx: Tx) {
        self.state.lock().unwrap().history.push(tx);
        self.appended.notify_waiters();
    }

    /// A `status` frame (asking to be acked) at `watermark`, between transactions.
    pub fn append_status(&self, watermark: &str) {
        let frame = serde_json::json!(["status", {"ack": true}, {"watermark": watermark}]).to_string();
        self.append(Tx { watermark: watermark.to_string(), frames: vec![frame] });
    }

    /// Serve as a server written for zero-cache may: a connection without
    /// `lastWatermark` gets the snapshot and nothing more (zero-cache reads
    /// one transaction there, then resumes on a new connection).
    pub fn snapshot_only_on_initial(&self) {
        self.state.lock().unwrap().snapshot_only_on_initial = true;
    }

    /// The highest watermark the client acked with a commit status.
    pub fn acked(&self) -> Option<String> {
        self.received()
            .iter()
            .filter(|f| f[0] == "status" && f[1]["tag"] == "commit")
            .filter_map(|f| f[2]["watermark"].as_str().map(str::to_string))
            .max()
    }

    pub fn fault(&self, f: Fault) {
        self.state.lock().unwrap().faults.push(f);
    }

    pub fn connections(&self) -> Vec<String> {
        self.state.lock().unwrap().connections.clone()
    }

    pub fn received(&self) -> Vec<serde_json::Value> {
        self.state.lock().unwrap().received.iter().filter_map(|t| serde_json::from_str(t).ok()).collect()
    }

    async fn serve(self, socket: tokio::net::TcpStream) {
        let mut query = String::new();
        #[allow(clippy::result_large_err)] // tungstenite's callback signature
        let callback = |req: &Request, resp: Response| {
            query = req.uri().query().unwrap_or_default().to_string();
            Ok(resp)
        };
        let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(socket, callback).await else { return };
        let last = query_param(&query, "lastWatermark");
        let mut pending: Vec<Tx> = Vec::new();
        let (me, mut next) = {
            let mut st = self.state.lock().unwrap();
            st.connections.push(query.clone());
            let me = st.connections.len();
            if last.is_none() {
                pending.extend(st.snapshot.clone());
            }
            let next = match &last {
                // Never reaches the history.
                None if st.snapshot_only_on_initial => usize::MAX,
                None => 0,
                Some(l) => {
                    st.history.iter().position(|t| t.watermark.as_str() > l.as_str()).unwrap_or(st.history.len())
                }
            };
            (me, next)
        };
        loop {
            // Everything appended so far, then wait for more.
            let wake = self.appended.notified();
            if next != usize::MAX {
                let st = self.state.lock().unwrap();
                pending.extend(st.history[next..].iter().cloned());
                next = st.history.len();
            }
            for tx in pending.drain(..) {
                let fault = {
                    let mut st = self.state.lock().unwrap();
                    // Faults are for the client's current connection. One it
                    // has replaced may not have seen its close yet, and must
                    // not use up a fault meant for its successor.
                    let newest = st.connections.len() == me;
                    let i = st.faults.iter().position(|f| {
                        newest
                            && match f {
                                Fault::CutInside(w)
                                | Fault::MalformedBefore(w)
                                | Fault::FrameBefore(_, w)
                                | Fault::StallBefore(w) => *w == tx.watermark,
                            }
                    });
                    i.map(|i| st.faults.remove(i))
                };
                let frames = match fault {
                    Some(Fault::CutInside(_)) => {
                        for f in &tx.frames[..tx.frames.len() / 2] {
                            if ws.feed(Ws::Text(f.clone().into())).await.is_err() {
                                return;
                            }
                        }
                        let _ = ws.flush().await;
                        // Drop the TCP connection without a close frame.
                        return;
                    }
                    Some(Fault::MalformedBefore(_)) => {
                        let _ = ws.feed(Ws::Text("[\"data\", {not json".into())).await;
                        tx.frames
                    }
                    Some(Fault::StallBefore(_)) => {
                        let _ = ws.flush().await;
                        self.stop.notified().await;
                        return;
                    }
                    Some(Fault::FrameBefore(frame, _)) => {
                        let _ = ws.feed(Ws::Text(frame.into())).await;
                        tx.frames
                    }
                    None => tx.frames,
                };
                // Queued, and written in large chunks.
                for f in frames {
                    if ws.feed(Ws::Text(f.into())).await.is_err() {
                        return;
                    }
                }
            }
            if ws.flush().await.is_err() {
                return;
            }
            tokio::select! {
                _ = wake => {}
                _ = self.stop.notified() => return,
                frame = ws.next() => match frame {
                    Some(Ok(Ws::Text(t))) => self.state.lock().unwrap().received.push(t.to_string()),
                    Some(Ok(_)) => {}
                    _ => return,
                },
            }
        }
    }
}

/// The snapshot's watermark in the helpers below, and so the replica version.
pub const SNAPSHOT: &str = "0a";

pub fn relation(name: &str) -> serde_json::Value {
    serde_json::json!({"schema": "public", "name": name, "rowKey": {"columns": ["id"], "type": "default"}})
}

pub fn insert(table: &str, id: i64, extra: serde_json::Value) -> serde_json::Value {
    let mut new = serde_json::json!({"id": id});
    new.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    serde_json::json!({"tag": "insert", "relation": relation(table), "new": new})
}

pub fn column(pos: i32, ty: &str) -> serde_json::Value {
    serde_json::json!({"pos": pos, "dataType": ty})
}

/// The initial snapshot: the tables zero-cache requires of a custom
/// upstream, an `events` table with an index, and rows.
pub fn snapshot(events: i64) -> Tx {
    let mut changes = vec![
        serde_json::json!({"tag": "create-table", "spec": {"schema": "public", "name": "events",
            "columns": {"id": column(1, "int8"), "big": column(2, "int8"), "note": column(3, "text")},
            "primaryKey": ["id"]}}),
        serde_json::json!({"tag": "create-index", "spec": {"schema": "public", "name": "events_pkey", "tableName": "events",
            "unique": true, "columns": {"id": "ASC"}}}),
        serde_json::json!({"tag": "create-table", "spec": {"schema": "zero_0", "name": "clients",
            "columns": {"clientGroupID": column(1, "text"), "clientID": column(2, "text"),
                        "lastMutationID": column(3, "int8"), "userID": column(4, "text")},
            "primaryKey": ["clientGroupID", "clientID"]}}),
    ];
    for id in 0..events {
        changes.push(event(id));
    }
    Tx::new(SNAPSHOT, &changes)
}

/// Event `id`: big = 2^60 + id, beyond JavaScript's safe integers.
pub fn event(id: i64) -> serde_json::Value {
    insert("events", id, serde_json::json!({"big": (1i64 << 60) + id, "note": format!("event {id}")}))
}

fn query_param(query: &str, key: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == key).map(|(_, v)| v.into_owned())
}

/// All values of a repeated query parameter.
pub fn query_params(query: &str, key: &str) -> Vec<String> {
    url::form_urlencoded::parse(query.as_bytes()).filter(|(k, _)| k == key).map(|(_, v)| v.into_owned()).collect()
}

pub fn param(query: &str, key: &str) -> Option<String> {
    query_param(query, key)
}
