//! `GET /changes/v0/stream`: Zero's custom change-source protocol, served
//! from the change log, so that a zero-cache can take Sluice as its upstream
//! (`ZERO_UPSTREAM_TYPE=custom`).
//!
//! Frames are the change-streamer's messages without an envelope:
//! `["begin",..]`, `["data",..]`, `["commit",..]`, and
//! `["control",{"tag":"reset-required"}]`. The consumer acks commits with
//! `["status",{"tag":"commit"},{"watermark":W}]`: that is its durable
//! position, which holds the purge floor like any subscriber's ack.
//!
//! A connection without `lastWatermark` is an initial sync. Its first
//! transaction is the table state at the log's last watermark `W` (so the
//! change log must keep it: `--table-state`), and `W` becomes the consumer's
//! replica version; the stream then goes on after `W`. A connection with
//! `lastWatermark` resumes after it; one whose position the log no longer
//! holds, or whose replica version is older than the log's lineage, is told
//! `reset-required` (zero-cache then syncs again from the start).

use std::sync::Arc;

use axum::extract::ws::{Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, RawQuery, State};
use axum::response::Response;
use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};

use super::changes::MAX_PROTOCOL;
use super::closing::{close_with_error, error_close, WRITE_STALL_LIMIT};
use super::{zero_tables, AppState};
use crate::reservations::Reservation;
use crate::subscriber::{Connection, Frame, Mode, Subscriber};

/// State rows read per page of an initial sync.
const STATE_PAGE_ROWS: usize = 1000;

/// What a consumer asked for.
#[derive(Debug, PartialEq)]
pub struct StreamRequest {
    pub app_id: String,
    pub shard_num: String,
    /// `lastWatermark` and `replicaVersion`, when resuming.
    pub resume: Option<(String, String)>,
}

/// Parses the query string zero-cache sends (`publications` may repeat; it
/// is accepted and not used: Sluice streams what its source captures).
pub fn parse_request(query: &str) -> Result<StreamRequest, String> {
    let (mut app_id, mut shard_num, mut last, mut rv) = (None, None, None, None);
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "appID" => app_id = Some(v.into_owned()),
            "shardNum" => shard_num = Some(v.into_owned()),
            "lastWatermark" => last = Some(v.into_owned()),
            "replicaVersion" => rv = Some(v.into_owned()),
            _ => {}
        }
    }
    let resume = match (last, rv) {
        (None, None) => None,
        (Some(l), Some(r)) => Some((l, r)),
        _ => return Err("lastWatermark and replicaVersion go together".into()),
    };
    Ok(StreamRequest {
        app_id: app_id.unwrap_or_else(|| "zero".into()),
        shard_num: shard_num.unwrap_or_else(|| "0".into()),
        resume,
    })
}

pub async fn stream(
    ws: WebSocketUpgrade,
    RawQuery(query): RawQuery,
    ConnectInfo(super::Peer(peer)): ConnectInfo<super::Peer>,
    State(app): State<AppState>,
) -> Result<Response, super::access::Refusal> {
    let permit = app.access.admit(peer)?;
    let request = parse_request(query.as_deref().unwrap_or(""));
    Ok(ws.on_upgrade(move |socket| async move {
        let _permit = permit;
        match request {
            Err(message) => close_with_error(socket, &message).await,
            Ok(request) => serve(socket, request, app).await,
        }
    }))
}

fn text(s: String) -> Message {
    Message::Text(Utf8Bytes::from(s))
}

fn reset_required(message: &str) -> Message {
    let message = serde_json::to_string(message).unwrap_or_else(|_| "\"\"".into());
    text(format!(r#"["control",{{"tag":"reset-required","message":{message}}}]"#))
}

async fn serve(socket: WebSocket, request: StreamRequest, app: AppState) {
    let consumer = format!("zero-cache {}_{}", request.app_id, request.shard_num);
    let Some(lineage) = app.hub.replica_version() else {
        return close_with_error(socket, "Sluice serves no lineage yet (its snapshot is not durable)").await;
    };
    let (mut tx, rx) = socket.split();
    let reservations = app.hub.reservations().clone();
    // The consumer's position is held from before its initial sync is read
    // until the retention period after it disconnects (crate::reservations).
    let (start, reservation) = match request.resume {
        None => {
            let before = app.status.snapshot().last_watermark.unwrap_or_else(|| lineage.clone());
            let during = reservations.reserve(&format!("{consumer} initial sync"), &before);
            match initial_sync(&mut tx, &app, &request).await {
                Ok(w) => {
                    tracing::info!(%consumer, watermark = %w, "initial sync sent from the table state");
                    let held = reservations.reserve(&format!("{consumer} @ {w}"), &w);
                    drop(during);
                    (w, held)
                }
                Err(e) => {
                    tracing::warn!(%consumer, "initial sync failed: {e}");
                    let _ = tx.send(error_close(&e)).await;
                    return;
                }
            }
        }
        Some((last, replica_version)) => {
            // A consumer's replica version is the watermark of its initial
            // sync: one from before this lineage began cannot continue.
            if replica_version.as_str() < lineage.as_str() {
                let why = format!("replica version {replica_version} predates the change log's lineage {lineage}");
                tracing::info!(%consumer, "{why}: reset required");
                let _ = tx.send(reset_required(&why)).await;
                return;
            }
            let held = reservations.reserve(&format!("{consumer} @ {replica_version}"), &last);
            (last, held)
        }
    };
    let (sub, conn) =
        Subscriber::new(consumer.clone(), consumer.clone(), Mode::Serving, MAX_PROTOCOL, start, app.subscriber_limits);
    app.hub.subscribe(sub.clone(), &lineage);
    let reason = pump(tx, rx, &sub, conn, &reservation, app.ping_interval, app.shutdown.clone()).await;
    app.hub.unsubscribe_reserved(&sub);
    tracing::info!(%consumer, acked = %sub.acked(), "upstream consumer disconnected: {reason}");
}

/// Sends the table state as one transaction at the log's last watermark,
/// which it returns.
async fn initial_sync(
    tx: &mut SplitSink<WebSocket, Message>,
    app: &AppState,
    request: &StreamRequest,
) -> Result<String, String> {
    let reader = app.hub.reader().clone();
    let blocking = |e: tokio::task::JoinError| e.to_string();
    let (mut snapshot, schema) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut snapshot = reader.snapshot()?;
        anyhow::ensure!(
            snapshot.state_kept()?,
            "the change log keeps no table state for its lineage (run sluice with --table-state; it starts with the next lineage)"
        );
        let schema = snapshot.state_schema()?;
        Ok((snapshot, schema))
    })
    .await
    .map_err(blocking)?
    .map_err(|e| format!("{e:#}"))?;
    let w = snapshot.last_watermark().to_string();
    let send_err = |e: axum::Error| format!("sending the initial sync: {e}");
    tx.feed(text(format!(r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{w}"}}]"#))).await.map_err(send_err)?;
    let zero_tables =
        zero_tables::missing(&schema, &request.app_id, &request.shard_num, app.zero_permissions.as_deref());
    for change in schema.iter().chain(&zero_tables) {
        tx.feed(text(format!(r#"["data",{change}]"#))).await.map_err(send_err)?;
    }
    let mut after: Option<(String, String)> = None;
    loop {
        let cursor = after.clone();
        let (back, page) = tokio::task::spawn_blocking(move || {
            let page = snapshot.state_rows(cursor.as_ref().map(|(t, k)| (t.as_str(), k.as_str())), STATE_PAGE_ROWS);
            (snapshot, page)
        })
        .await
        .map_err(blocking)?;
        snapshot = back;
        let page = page.map_err(|e| format!("reading the table state: {e:#}"))?;
        let Some(last) = page.last() else { break };
        after = Some((last.table.clone(), last.key.clone()));
        for row in &page {
            let message = format!(r#"["data",{{"tag":"insert","relation":{},"new":{}}}]"#, row.relation, row.row);
            tx.feed(text(message)).await.map_err(send_err)?;
        }
        tx.flush().await.map_err(send_err)?;
    }
    drop(snapshot);
    tx.send(text(format!(r#"["commit",{{"tag":"commit"}},{{"watermark":"{w}"}}]"#))).await.map_err(send_err)?;
    Ok(w)
}

/// The watermark of a consumer's commit ack.
fn parse_status(text: &str) -> Result<String, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("invalid message {text:?}: {e}"))?;
    match (v.get(0).and_then(|t| t.as_str()), v.get(2).and_then(|b| b.get("watermark")).and_then(|w| w.as_str())) {
        (Some("status"), Some(w)) => Ok(w.to_string()),
        _ => Err(format!("expected a status message, got {text:?}")),
    }
}

async fn pump(
    mut tx: SplitSink<WebSocket, Message>,
    mut rx: futures::stream::SplitStream<WebSocket>,
    sub: &Arc<Subscriber>,
    mut conn: Connection,
    reservation: &Reservation,
    ping_every: std::time::Duration,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> String {
    let stopping = super::stopping(shutdown);
    tokio::pin!(stopping);
    let mut alive = true;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + ping_every, ping_every);
    loop {
        tokio::select! {
            frame = conn.frames.recv() => {
                if let Err(end) = write_queued(&mut tx, frame, &mut conn, sub).await {
                    return end;
                }
            }
            msg = rx.next() => {
                alive = true;
                match msg {
                    Some(Ok(Message::Text(t))) => match parse_status(&t) {
                        // The consumer's durable position: the purge floor.
                        Ok(w) => {
                            reservation.advance(&w);
                            sub.consumed(0, Some(&Arc::from(w.as_str())));
                        }
                        Err(e) => {
                            let _ = tx.send(error_close(&e)).await;
                            return e;
                        }
                    },
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Binary(_))) => {
                        let e = "Expected string message".to_string();
                        let _ = tx.send(error_close(&e)).await;
                        return e;
                    }
                    Some(Ok(Message::Close(_))) | None => return "closed by the peer".into(),
                    Some(Err(e)) => return format!("connection error: {e}"),
                }
            }
            _ = ping.tick() => {
                if let Err(e) = ping_peer(&mut alive, &mut tx).await {
                    return e;
                }
            }
            _ = &mut stopping => {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), tx.send(super::going_away())).await;
                // Read what the consumer still sends (statuses in flight) up
                // to its answering close: unread data would make the kernel
                // reset the connection, discarding the close frame.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
                    while let Some(Ok(msg)) = rx.next().await {
                        if matches!(msg, Message::Close(_)) {
                            break;
                        }
                    }
                })
                .await;
                return "Sluice is shutting down".into();
            }
        }
    }
}

/// Messages written before one flush, at most (and about 64 KiB).
const WRITE_BATCH_MESSAGES: usize = 256;
const WRITE_BATCH_BYTES: usize = 64 << 10;

/// Writes `first` and whatever else is already queued (up to a batch) with
/// one flush: a syscall per batch rather than per change, and nothing waits
/// for a batch to fill. Returns why the connection ends, if it does.
async fn write_queued(
    tx: &mut SplitSink<WebSocket, Message>,
    first: Option<Frame>,
    conn: &mut Connection,
    sub: &Arc<Subscriber>,
) -> Result<(), String> {
    let (mut messages, mut bytes) = (0u64, 0usize);
    let mut next = first;
    let mut ending = None;
    let written = tokio::time::timeout(WRITE_STALL_LIMIT, async {
        loop {
            match next.take() {
                Some(Frame::Message { json, .. }) => {
                    // The change-streamer's greeting (`["status",{"tag":
                    // "status"}]`) has no place in this protocol, whose
                    // status messages carry a watermark.
                    if json.starts_with("[\"status\"") && !json.contains("\"watermark\"") {
                        sub.consumed(json.len(), None);
                    } else {
                        tx.feed(text(json.to_string())).await?;
                        messages += 1;
                        bytes += json.len();
                    }
                }
                Some(Frame::Error(json)) => {
                    ending = Some(json);
                    break;
                }
                Some(Frame::Close) | None => {
                    ending = Some(String::new());
                    break;
                }
            }
            if messages as usize >= WRITE_BATCH_MESSAGES || bytes >= WRITE_BATCH_BYTES {
                break;
            }
            match conn.frames.try_recv() {
                Some(frame) => next = Some(frame),
                None => break,
            }
        }
        tx.flush().await
    })
    .await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("sending: {e}")),
        Err(_) => {
            return Err(format!(
                "the peer took nothing of a write for {} s (a silent network path or a stuck reader)",
                WRITE_STALL_LIMIT.as_secs()
            ))
        }
    }
    // A message counts as consumed once written: the consumer acks commits
    // only once it has stored them, while Sluice may be waiting (flow
    // control) in the middle of the next transaction, whose commit it has
    // not sent. A consumer that stops reading still hits the subscriber
    // limits (its frames queue unsent).
    if messages > 0 {
        sub.consumed_many(messages, bytes, None);
    }
    match ending {
        None => Ok(()),
        // Zero's WrongReplicaVersion (1) and WatermarkTooOld (2): the
        // consumer must start over.
        Some(json) if json.contains("\"type\":1") || json.contains("\"type\":2") => {
            let _ = tx.send(reset_required(&json)).await;
            Err(format!("reset required: {json}"))
        }
        Some(json) if !json.is_empty() => {
            let _ = tx.send(error_close(&json)).await;
            Err(format!("closed with {json}"))
        }
        Some(_) => Err("closed by the server".into()),
    }
}

/// A ping, unless nothing (not even a pong) came since the last one: then
/// the peer is gone.
async fn ping_peer(alive: &mut bool, tx: &mut SplitSink<WebSocket, Message>) -> Result<(), String> {
    if !*alive {
        return Err("no pong or message since the last ping".into());
    }
    *alive = false;
    match tokio::time::timeout(WRITE_STALL_LIMIT, tx.send(Message::Ping(Default::default()))).await {
        Ok(Ok(())) => Ok(()),
        _ => Err("ping failed".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_as_zero_cache_sends_them() {
        let r = parse_request("appID=zero&shardNum=0&publications=a&publications=b").unwrap();
        assert_eq!(r, StreamRequest { app_id: "zero".into(), shard_num: "0".into(), resume: None });
        let r = parse_request("appID=app&shardNum=2&lastWatermark=0b&replicaVersion=0a").unwrap();
        assert_eq!(r.resume, Some(("0b".into(), "0a".into())));
        assert!(parse_request("lastWatermark=0b").unwrap_err().contains("go together"));
    }

    #[test]
    fn commit_acks_are_status_messages() {
        assert_eq!(parse_status(r#"["status",{"tag":"commit"},{"watermark":"0c"}]"#).unwrap(), "0c");
        assert!(parse_status(r#"{"ack":1}"#).unwrap_err().contains("expected a status message"));
        assert!(parse_status("nope").unwrap_err().contains("invalid message"));
    }
}
