//! Streaming: `START_REPLICATION`, pgoutput to messages, acks and keepalives.
//!
//! A task owns the replication connection. It decodes every frame into the
//! WIT messages and hands them over in batches through a bounded channel, so
//! the loop's back-pressure reaches the socket, while the task keeps answering
//! the server (keepalives and a status update every 10 s) even when the loop
//! is not pulling. Acks travel the other way through a watch channel and are
//! sent as standby status updates: the slot's flush position only ever moves
//! to what the change log has made durable.
//!
//! Watermarks are `lexi(commit LSN)`, as in Zero; a stream resumes at the
//! position after the last durable commit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};

use super::pgoutput::{self, Datum, PgOutput, RelationMsg};
use super::schema::{self, Schema, TableInfo};
use super::setup::{session_config, Upstream, APPLICATION_NAME};
use super::values::from_text;
use super::wire::{lsn_text, standby_status, ReplConnection, WireError};
use crate::source::model::{
    Begin, Commit, Control, Delete, Insert, KeyType, Message, Relation, Status, Truncate, Update, Value,
};
use crate::source::{ChangeStream, SourceError};
use crate::watermark::{from_lexi, to_lexi};

/// Messages per batch handed to the loop.
const BATCH_MESSAGES: usize = 1024;
/// Batches that may wait in the channel.
const CHANNEL_BATCHES: usize = 16;
const STATUS_INTERVAL: Duration = Duration::from_secs(10);
/// Silence after which the server is asked to answer at once (a status
/// update with the reply flag set), once a second until it does. A server
/// that Sluice keeps up to date with status updates sends no keepalives of
/// its own, so without asking an idle link and a dead one look alike.
const PROBE_AFTER: Duration = Duration::from_secs(2);
/// Silence after which the link is given up as dead and reopened, unless
/// the source config says otherwise (`silence_timeout_ms`).
pub const SILENCE_LIMIT: Duration = Duration::from_secs(10);

/// When the server was last heard from, shared between the task that reads
/// the link and the stream's owner (`silent_for`).
#[derive(Default)]
struct LastHeard(std::sync::atomic::AtomicU64);

impl LastHeard {
    fn now(&self) {
        self.0.store(epoch_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        Duration::from_millis(epoch_ms().saturating_sub(self.0.load(std::sync::atomic::Ordering::Relaxed)))
    }
}

fn epoch_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The position a stream continues from after `watermark`.
pub fn resume_lsn(watermark: &str) -> Option<u64> {
    let major = watermark.split('.').next()?;
    u64::try_from(from_lexi(major)?).ok()?.checked_add(1)
}

/// The LSN a watermark acknowledges.
fn ack_lsn(watermark: &str) -> Option<u64> {
    u64::try_from(from_lexi(watermark.split('.').next()?)?).ok()
}

pub fn watermark(lsn: u64) -> String {
    to_lexi(lsn as u128)
}

/// Unix milliseconds (with microseconds as the fraction) from a replication
/// timestamp (µs since 2000-01-01).
fn unix_millis(pg_micros: i64) -> f64 {
    pg_micros as f64 / 1000.0 + 946_684_800_000.0
}

pub struct ReplicationStream {
    replica_version: String,
    rx: mpsc::Receiver<Vec<Message>>,
    acks: watch::Sender<u64>,
    failure: Arc<Mutex<Option<SourceError>>>,
    heard: Arc<LastHeard>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReplicationStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ReplicationStream {
    /// Opens a replication connection and streams from `start`.
    pub async fn start(
        upstream: Upstream,
        pg: &crate::pgconn::PgTarget,
        replica_version: String,
        start: u64,
        silence_limit: Duration,
    ) -> Result<Box<dyn ChangeStream>, SourceError> {
        let connection = ReplConnection::connect(pg, &session_config(pg), APPLICATION_NAME).await.map_err(|e| {
            let text = crate::pgconn::explain(format!("opening the replication connection: {e}"), pg);
            // Credentials the server refuses, or none to send: the next
            // attempt would fail alike.
            let refused = e.code().is_some_and(|c| c.starts_with("28"))
                || matches!(&e, WireError::Protocol(m) if m.contains("password"));
            if refused {
                SourceError::Fatal(text)
            } else {
                SourceError::Transient(text)
            }
        })?;
        Self::start_on(connection, upstream, replica_version, start, None, silence_limit).await
    }

    /// Streams from `start` on an open replication connection. `snapshot_schema`
    /// is the published schema as of `start` when the caller knows it (an
    /// initial snapshot read it in its snapshot transaction); degraded mode
    /// compares relation messages against it.
    pub async fn start_on(
        mut connection: ReplConnection,
        upstream: Upstream,
        replica_version: String,
        start: u64,
        snapshot_schema: Option<Schema>,
        silence_limit: Duration,
    ) -> Result<Box<dyn ChangeStream>, SourceError> {
        let publications = upstream.publications.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(",");
        let sql = format!(
            "START_REPLICATION SLOT \"{}\" LOGICAL {} (proto_version '2', streaming 'on', publication_names '{}', messages 'true')",
            upstream.slot,
            lsn_text(start),
            publications
        );
        if let Err(e) = connection.start_copy_both(&sql).await {
            let text = format!("starting replication from slot {}: {e}", upstream.slot);
            return match e.code() {
                // Invalidated or missing slot: the lineage cannot continue.
                Some("55000") | Some("42704") => Ok(Box::new(LostStream::new(replica_version, text))),
                _ => Err(SourceError::Transient(text)),
            };
        }
        // Degraded mode needs the schema as of `start`. The catalog now may be
        // later than that (a DDL committed after the snapshot but before this
        // point would match its own relation message and go unnoticed), so
        // the snapshot's schema is used when there is one. On a resume the
        // catalog is the best there is: DDL committed while Sluice was down
        // and before the first change to its table cannot be told apart.
        let baseline = match (upstream.ddl_detection, snapshot_schema) {
            (true, _) => None,
            (false, Some(schema)) => Some(schema),
            (false, None) => Some(upstream.current_schema().await?),
        }
        .map(|schema| schema.tables.into_iter().map(|t| (t.oid, t)).collect());
        tracing::info!(slot = %upstream.slot, from = %lsn_text(start), "streaming from the upstream");
        let (tx, rx) = mpsc::channel(CHANNEL_BATCHES);
        let (acks, acked) = watch::channel(start.saturating_sub(1));
        let failure = Arc::new(Mutex::new(None));
        let heard = Arc::new(LastHeard::default());
        heard.now();
        let decoder = Decoder::new(upstream, baseline);
        let link = Link { limit: silence_limit, heard: heard.clone() };
        let task = tokio::spawn(run(connection, decoder, tx, acked, start, link, failure.clone()));
        Ok(Box::new(ReplicationStream { replica_version, rx, acks, failure, heard, task }))
    }
}

impl ReplicationStream {
    /// Why the task stopped.
    fn ended(&self) -> SourceError {
        let failure = self.failure.lock().ok().and_then(|mut f| f.take());
        failure.unwrap_or_else(|| SourceError::Transient("the replication stream ended".into()))
    }
}

#[async_trait]
impl ChangeStream for ReplicationStream {
    fn replica_version(&self) -> &str {
        &self.replica_version
    }

    async fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, SourceError> {
        // What is ready without waiting; else wait a little (no timer is set
        // up while the stream is busy).
        let mut batch = match self.rx.try_recv() {
            Ok(b) => b,
            Err(mpsc::error::TryRecvError::Disconnected) => return Err(self.ended()),
            Err(mpsc::error::TryRecvError::Empty) => {
                match tokio::time::timeout(Duration::from_millis(100), self.rx.recv()).await {
                    Err(_) => return Ok(Vec::new()),
                    Ok(Some(b)) => b,
                    Ok(None) => return Err(self.ended()),
                }
            }
        };
        while batch.len() < max as usize {
            match self.rx.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        Ok(batch)
    }

    fn silent_for(&self) -> Option<Duration> {
        Some(self.heard.silent_for())
    }

    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        if let Some(lsn) = ack_lsn(watermark) {
            self.acks.send_if_modified(|v| {
                let newer = lsn > *v;
                if newer {
                    *v = lsn;
                }
                newer
            });
        }
        Ok(())
    }
}

/// How the task watches its link: the silence it tolerates, and where it
/// records hearing from the server.
struct Link {
    limit: Duration,
    heard: Arc<LastHeard>,
}

/// The task that owns the replication connection.
async fn run(
    mut conn: ReplConnection,
    mut decoder: Decoder,
    tx: mpsc::Sender<Vec<Message>>,
    mut acked: watch::Receiver<u64>,
    start: u64,
    link: Link,
    failure: Arc<Mutex<Option<SourceError>>>,
) {
    let mut feedback = Feedback { received: start, flushed: *acked.borrow(), limit: link.limit };
    let result: Result<(), SourceError> = async {
        let mut ticker = tokio::time::interval(STATUS_INTERVAL);
        let mut probe = tokio::time::interval(Duration::from_secs(1));
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut out: Vec<Message> = Vec::new();
        let mut heard = Instant::now();
        loop {
            // Decode everything already read.
            while let Some(frame) = conn.try_frame().map_err(lost)? {
                match frame.tag {
                    b'd' => decoder.on_copy_data(&frame.body, &mut out, &mut feedback, &mut conn).await?,
                    b'E' => return Err(lost(super::wire::server_error(frame.body))),
                    b'c' => return Err(SourceError::Transient("the server ended the replication stream".into())),
                    _ => {}
                }
                if out.len() >= BATCH_MESSAGES {
                    break;
                }
            }
            feedback.flush(&mut conn).await?;
            if !out.is_empty() {
                // Wait for room, still answering the server meanwhile.
                let permit = loop {
                    tokio::select! {
                        permit = tx.reserve() => break permit,
                        _ = ticker.tick() => feedback.send(&mut conn, false).await?,
                        Ok(()) = acked.changed() => {
                            feedback.flushed = feedback.flushed.max(*acked.borrow_and_update());
                            feedback.send(&mut conn, false).await?;
                        }
                    }
                };
                match permit {
                    Ok(p) => p.send(std::mem::take(&mut out)),
                    Err(_) => return Ok(()),
                }
                // Nothing was read while the loop held back: silence is
                // counted from when reading resumes.
                heard = Instant::now();
                link.heard.now();
                continue;
            }
            tokio::select! {
                read = conn.fill() => {
                    read.map_err(lost)?;
                    heard = Instant::now();
                    link.heard.now();
                }
                _ = probe.tick() => {
                    let silent = heard.elapsed();
                    if silent >= link.limit {
                        return Err(SourceError::Transient(format!(
                            "replication stream: nothing received from the server for {} s (it did not answer \
                             status requests: a silent network path or a stuck server)",
                            silent.as_secs()
                        )));
                    }
                    if silent >= PROBE_AFTER {
                        feedback.send(&mut conn, true).await?;
                    }
                }
                _ = ticker.tick() => feedback.send(&mut conn, false).await?,
                changed = acked.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    feedback.flushed = feedback.flushed.max(*acked.borrow_and_update());
                    feedback.send(&mut conn, false).await?;
                }
            }
        }
    }
    .await;
    if let Err(e) = result {
        if let Ok(mut f) = failure.lock() {
            *f = Some(e);
        }
    }
}

fn lost(e: WireError) -> SourceError {
    SourceError::Transient(format!("replication stream: {e}"))
}

struct Feedback {
    received: u64,
    flushed: u64,
    /// How long a write may wait for the socket (a link whose buffers are
    /// full because nothing flows).
    limit: Duration,
}

impl Feedback {
    /// A standby status update; `reply` asks the server to answer at once.
    async fn send(&self, conn: &mut ReplConnection, reply: bool) -> Result<(), SourceError> {
        conn.queue_copy_data(&standby_status(self.received.max(self.flushed), self.flushed, reply)).map_err(lost)?;
        self.flush(conn).await
    }

    async fn flush(&self, conn: &mut ReplConnection) -> Result<(), SourceError> {
        match tokio::time::timeout(self.limit, conn.flush()).await {
            Ok(result) => result.map_err(lost),
            Err(_) => Err(SourceError::Transient(format!(
                "replication stream: a write to the server did not complete within {} s",
                self.limit.as_secs()
            ))),
        }
    }
}

/// pgoutput to messages, with the state that needs: relations, streamed
/// transactions waiting for their commit, and where the stream stands.
struct Decoder {
    upstream: Upstream,
    relations: HashMap<u32, RelationMsg>,
    /// The top-level xid of the streamed chunk being read.
    chunk: Option<u32>,
    /// Streamed transactions: (subtransaction xid, message) in order.
    streamed: HashMap<u32, Vec<(u32, Message)>>,
    /// Inside a Begin..Commit that is being passed on.
    in_tx: bool,
    /// A keepalive position seen inside a transaction, reported after it.
    pending_status: Option<u64>,
    last_status: u64,
    /// Degraded mode: the schema the stream is known to be at, by table oid.
    baseline: Option<HashMap<u32, TableInfo>>,
    /// A reset was required: nothing more is passed on.
    halted: bool,
}

impl Decoder {
    fn new(upstream: Upstream, baseline: Option<HashMap<u32, TableInfo>>) -> Self {
        Decoder {
            upstream,
            relations: HashMap::new(),
            chunk: None,
            streamed: HashMap::new(),
            in_tx: false,
            pending_status: None,
            last_status: 0,
            baseline,
            halted: false,
        }
    }

    async fn on_copy_data(
        &mut self,
        body: &[u8],
        out: &mut Vec<Message>,
        feedback: &mut Feedback,
        conn: &mut ReplConnection,
    ) -> Result<(), SourceError> {
        match body.first() {
            Some(b'w') if body.len() >= 25 => {
                let wal_start = u64::from_be_bytes(body[1..9].try_into().unwrap_or_default());
                feedback.received = feedback.received.max(wal_start);
                if self.halted {
                    return Ok(());
                }
                self.on_pgoutput(&body[25..], out)
                    .await
                    .map_err(|e| SourceError::Transient(format!("replication stream at {}: {e}", lsn_text(wal_start))))
            }
            Some(b'k') if body.len() >= 18 => {
                let wal_end = u64::from_be_bytes(body[1..9].try_into().unwrap_or_default());
                feedback.received = feedback.received.max(wal_end);
                if body[17] == 1 {
                    feedback.send(conn, false).await?;
                }
                if !self.halted {
                    if self.in_tx {
                        self.pending_status = Some(wal_end);
                    } else {
                        self.status(wal_end, out);
                    }
                }
                Ok(())
            }
            _ => Err(SourceError::Transient("replication stream: unknown CopyData message".into())),
        }
    }

    fn status(&mut self, lsn: u64, out: &mut Vec<Message>) {
        if lsn > self.last_status {
            self.last_status = lsn;
            out.push(Message::Status(Status { watermark: watermark(lsn), ack: true }));
        }
    }

    /// Where a data message goes: the streamed transaction it belongs to, or
    /// straight out.
    fn emit(&mut self, xid: Option<u32>, msg: Message, out: &mut Vec<Message>) {
        match (self.chunk, xid) {
            (Some(top), sub) => self.streamed.entry(top).or_default().push((sub.unwrap_or(top), msg)),
            (None, _) => out.push(msg),
        }
    }

    async fn on_pgoutput(&mut self, payload: &[u8], out: &mut Vec<Message>) -> Result<(), String> {
        let (msg, xid) = pgoutput::decode(payload, self.chunk.is_some()).map_err(|e| e.to_string())?;
        match msg {
            PgOutput::Begin { final_lsn, xid, .. } => {
                self.in_tx = true;
                out.push(Message::Begin(Begin {
                    commit_watermark: watermark(final_lsn),
                    extra: Some(format!("{{\"xid\":{xid}}}")),
                }));
            }
            PgOutput::Commit { commit_lsn, commit_time, .. } => {
                self.in_tx = false;
                out.push(commit(commit_lsn, commit_time));
                if let Some(lsn) = self.pending_status.take() {
                    self.status(lsn, out);
                }
            }
            PgOutput::Relation(rel) => {
                let changes = self.degraded_check(&rel).await?;
                let declared = relation(&rel);
                self.relations.insert(rel.oid, rel);
                for c in changes {
                    self.emit(xid, c, out);
                }
                self.emit(xid, Message::Relation(declared), out);
            }
            PgOutput::Insert { relation, new } => {
                let rel = self.relation(relation)?;
                let new = row(rel, &new, None)?;
                self.emit(xid, Message::Insert(Insert { relation, new }), out);
            }
            PgOutput::Update { relation, old, new } => {
                let rel = self.relation(relation)?;
                let old = match old {
                    Some((kind, datums)) => Some(old_row(rel, kind, &datums)?),
                    None => None,
                };
                let new = row(rel, &new, old.as_deref())?;
                self.emit(xid, Message::Update(Update { relation, old, new }), out);
            }
            PgOutput::Delete { relation, old: (kind, datums) } => {
                let rel = self.relation(relation)?;
                let old = old_row(rel, kind, &datums)?;
                self.emit(xid, Message::Delete(Delete { relation, old }), out);
            }
            PgOutput::Truncate { relations } => {
                for r in &relations {
                    self.relation(*r)?;
                }
                self.emit(xid, Message::Truncate(Truncate { relations }), out);
            }
            PgOutput::Message { transactional, prefix, content } => {
                if prefix == schema::DDL_PREFIX && transactional {
                    let text = std::str::from_utf8(content).map_err(|_| "a DDL message is not UTF-8".to_string())?;
                    for m in self.ddl(text)? {
                        self.emit(xid, m, out);
                    }
                }
            }
            PgOutput::StreamStart { xid } => self.chunk = Some(xid),
            PgOutput::StreamStop => self.chunk = None,
            PgOutput::StreamCommit { xid, commit_lsn, commit_time, .. } => {
                let messages = self.streamed.remove(&xid).unwrap_or_default();
                let w = watermark(commit_lsn);
                out.push(Message::Begin(Begin { commit_watermark: w, extra: Some(format!("{{\"xid\":{xid}}}")) }));
                for (_, m) in messages {
                    if let Message::Control(_) = m {
                        // A schema change that needs a reset: end here.
                        out.push(Message::Rollback);
                        out.push(m);
                        self.halted = true;
                        return Ok(());
                    }
                    out.push(m);
                }
                out.push(commit(commit_lsn, commit_time));
            }
            PgOutput::StreamAbort { xid, subxid } => {
                if xid == subxid {
                    self.streamed.remove(&xid);
                } else if let Some(list) = self.streamed.get_mut(&xid) {
                    list.retain(|(sub, _)| *sub != subxid);
                }
            }
            PgOutput::Ignored(_) => {}
        }
        if self.halted {
            self.streamed.clear();
        }
        Ok(())
    }

    fn relation(&self, oid: u32) -> Result<&RelationMsg, String> {
        self.relations.get(&oid).ok_or_else(|| format!("a row refers to relation {oid}, which was never described"))
    }

    /// Turns a DDL message into schema changes, or a reset.
    fn ddl(&mut self, text: &str) -> Result<Vec<Message>, String> {
        #[derive(serde::Deserialize)]
        struct Ddl {
            tag: String,
            previous: Option<Schema>,
            schema: Schema,
        }
        let ddl: Ddl = serde_json::from_str(text).map_err(|e| format!("a DDL message does not parse: {e}"))?;
        let pubs = &self.upstream.publications;
        let Some(previous) = ddl.previous else {
            tracing::warn!("a DDL message without the previous schema ({}) was ignored", ddl.tag);
            return Ok(Vec::new());
        };
        match schema::diff(&previous.published_in(pubs), &ddl.schema.published_in(pubs), &ddl.tag) {
            Ok(changes) => Ok(changes.into_iter().map(Message::Schema).collect()),
            Err(reason) => Ok(self.reset(reason)),
        }
    }

    /// Ends the stream with reset-required: a rollback first when a
    /// transaction is open, then nothing more.
    fn reset(&mut self, reason: String) -> Vec<Message> {
        let control = Message::Control(Control::ResetRequired(Some(reason)));
        if self.chunk.is_some() {
            // Inside a streamed transaction: it decides at its commit.
            return vec![control];
        }
        self.halted = true;
        if self.in_tx {
            vec![Message::Rollback, control]
        } else {
            vec![control]
        }
    }

    /// Degraded mode (no event trigger): compares a relation with the schema
    /// known so far and turns what differs into schema changes where the
    /// catalog can say what happened, or a reset where it cannot.
    async fn degraded_check(&mut self, rel: &RelationMsg) -> Result<Vec<Message>, String> {
        let Some(baseline) = &self.baseline else { return Ok(Vec::new()) };
        let known = baseline.get(&rel.oid);
        let same = known.is_some_and(|t| {
            t.schema == rel.schema
                && t.name == rel.name
                && t.columns.len() == rel.columns.len()
                && t.columns.iter().zip(&rel.columns).all(|(a, b)| a.name == b.name && a.type_oid == b.type_oid)
        });
        if same {
            return Ok(Vec::new());
        }
        let current = self.upstream.current_schema().await.map_err(|e| e.to_string())?;
        let Some(now) = current.tables.iter().find(|t| t.oid == rel.oid).cloned() else {
            return Ok(self.reset(format!("{}.{} changed and is no longer published", rel.schema, rel.name)));
        };
        let Some(old) = known.cloned() else {
            return Ok(self.reset(format!(
                "table {}.{} appeared in the stream; without the DDL event trigger (install it as a superuser) \
                 Sluice cannot tell whether it had rows before",
                rel.schema, rel.name
            )));
        };
        if let Some(b) = self.baseline.as_mut() {
            b.insert(now.oid, now.clone());
        }
        match schema::diff_table(&old, &now, "ALTER TABLE") {
            Ok(changes) => Ok(changes.into_iter().map(Message::Schema).collect()),
            Err(reason) => Ok(self.reset(reason)),
        }
    }
}

fn commit(commit_lsn: u64, commit_time: i64) -> Message {
    Message::Commit(Commit {
        watermark: watermark(commit_lsn),
        extra: Some(format!("{{\"commitTimeMs\":{:.3}}}", unix_millis(commit_time))),
    })
}

fn relation(rel: &RelationMsg) -> Relation {
    let key_type = match rel.identity {
        b'f' => KeyType::Full,
        b'i' => KeyType::Index,
        b'n' => KeyType::Nothing,
        _ => KeyType::Default,
    };
    Relation {
        id: rel.oid,
        schema: rel.schema.clone(),
        name: rel.name.clone(),
        columns: rel.columns.iter().map(|c| c.name.clone()).collect(),
        key_columns: rel.columns.iter().filter(|c| c.key).map(|c| c.name.clone()).collect(),
        key_type,
    }
}

fn value(type_oid: u32, datum: &Datum<'_>) -> Result<Value, String> {
    Ok(match datum {
        Datum::Null => Value::Null,
        Datum::Unchanged => Value::Absent,
        Datum::Text(bytes) => {
            from_text(type_oid, std::str::from_utf8(bytes).map_err(|_| "a text value is not UTF-8".to_string())?)
        }
        Datum::Binary(bytes) => Value::Bytes(bytes.to_vec()),
    })
}

fn check_width(rel: &RelationMsg, n: usize) -> Result<(), String> {
    if n != rel.columns.len() {
        return Err(format!(
            "a row of {}.{} has {n} columns; its relation has {}",
            rel.schema,
            rel.name,
            rel.columns.len()
        ));
    }
    Ok(())
}

/// A new row. Unchanged TOASTed values come from the old full row when there
/// is one, and are otherwise left out (`absent`), never sent as NULL.
fn row(rel: &RelationMsg, datums: &[Datum<'_>], old: Option<&[Value]>) -> Result<Vec<Value>, String> {
    check_width(rel, datums.len())?;
    datums
        .iter()
        .zip(&rel.columns)
        .enumerate()
        .map(|(i, (d, c))| match d {
            Datum::Unchanged => {
                Ok(old.and_then(|o| o.get(i)).filter(|v| !matches!(v, Value::Absent)).cloned().unwrap_or(Value::Absent))
            }
            d => value(c.type_oid, d),
        })
        .collect()
}

/// An old image: a key (`K`, non-key columns absent) or a full row (`O`).
fn old_row(rel: &RelationMsg, kind: u8, datums: &[Datum<'_>]) -> Result<Vec<Value>, String> {
    check_width(rel, datums.len())?;
    datums
        .iter()
        .zip(&rel.columns)
        .map(|(d, c)| if kind == b'K' && !c.key { Ok(Value::Absent) } else { value(c.type_oid, d) })
        .collect()
}

/// A lineage that cannot continue: says reset-required once, then nothing.
pub struct LostStream {
    replica_version: String,
    reason: Option<String>,
}

impl LostStream {
    pub fn new(replica_version: String, reason: String) -> Self {
        LostStream { replica_version, reason: Some(reason) }
    }
}

#[async_trait]
impl ChangeStream for LostStream {
    fn replica_version(&self) -> &str {
        &self.replica_version
    }

    async fn next_batch(&mut self, _max: u32) -> Result<Vec<Message>, SourceError> {
        match self.reason.take() {
            Some(reason) => Ok(vec![Message::Control(Control::ResetRequired(Some(reason)))]),
            None => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(Vec::new())
            }
        }
    }

    async fn ack(&mut self, _watermark: &str) -> Result<(), SourceError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_positions() {
        let w = watermark(0x16_B374_D848);
        assert_eq!(resume_lsn(&w), Some(0x16_B374_D849));
        assert_eq!(ack_lsn(&w), Some(0x16_B374_D848));
        // The snapshot's watermark sits between the replica version and the
        // first transaction at the consistent point.
        let rv = watermark(99);
        let snapshot = format!("{rv}.01");
        assert!(rv < snapshot && snapshot < watermark(100));
        assert_eq!(resume_lsn(&snapshot), Some(100));
    }

    fn rel() -> RelationMsg {
        RelationMsg {
            oid: 5,
            schema: "public".into(),
            name: "t".into(),
            identity: b'd',
            columns: vec![
                pgoutput::RelationColumn { key: true, name: "id".into(), type_oid: 20, type_modifier: -1 },
                pgoutput::RelationColumn { key: false, name: "doc".into(), type_oid: 25, type_modifier: -1 },
            ],
        }
    }

    #[test]
    fn toast_and_key_images() {
        let r = rel();
        let old = old_row(&r, b'K', &[Datum::Text(b"7"), Datum::Null]).unwrap();
        assert!(matches!(old[..], [Value::Int(7), Value::Absent]));
        let new = row(&r, &[Datum::Text(b"8"), Datum::Unchanged], Some(&old)).unwrap();
        assert!(matches!(new[..], [Value::Int(8), Value::Absent]), "never NULL for an unchanged value");
        let full = old_row(&r, b'O', &[Datum::Text(b"7"), Datum::Text(b"big")]).unwrap();
        let new = row(&r, &[Datum::Text(b"7"), Datum::Unchanged], Some(&full)).unwrap();
        assert!(matches!(&new[1], Value::Text(t) if t == "big"));
        assert!(row(&r, &[Datum::Null], None).is_err());
    }
}
