//! The initial snapshot: the first transaction of a new slot.
//!
//! The slot exports a snapshot; a second connection reads every published
//! table at it (in batches through a cursor, so a large table never sits in
//! memory) and the rows leave as one transaction: create-table and
//! create-index for each table, then its rows. Its watermark is
//! `<replica version>.01`, after the replica version and before the first
//! streamed commit, so a subscriber at the replica version receives the
//! whole content and then every later change, with no gap and no duplicate.
//! Only when the copy is done does `START_REPLICATION` run on the slot's
//! connection (which ends the exported snapshot).

use std::collections::VecDeque;

use async_trait::async_trait;
use tokio_postgres::SimpleQueryMessage;

use super::schema::{Schema, TableInfo};
use super::setup::{connect_client, pg_error, CreatedSlot, Upstream};
use super::stream::{resume_lsn, ReplicationStream};
use super::values::from_text;
use super::wire::ReplConnection;
use super::PostgresSourceConfig;
use crate::source::model::{Begin, Commit, CreateTable, Insert, Message, SchemaChange, Value};
use crate::source::SourceProgress;
use crate::source::{ChangeStream, SourceError};

enum Phase {
    /// Not started: the snapshot transaction is opened on the first pull.
    Start,
    /// Copying; the front table's cursor is open when `cursor_open`.
    Copying,
    /// The copy is done and replication runs.
    Streaming(Box<dyn ChangeStream>),
}

pub struct SnapshotStream {
    replica_version: String,
    watermark: String,
    snapshot_name: String,
    client: crate::pgconn::PgClient,
    /// Kept for START_REPLICATION once the copy is done.
    connection: Option<ReplConnection>,
    upstream: Option<Upstream>,
    tables: VecDeque<TableInfo>,
    /// The planner's row count of the published tables, when every one of
    /// them has been analyzed.
    rows_estimate: Option<u64>,
    schema: Schema,
    cursor_open: bool,
    batch_rows: u32,
    /// The stream's `silence_timeout_ms`, for the replication that follows.
    silence_limit: std::time::Duration,
    phase: Phase,
}

impl SnapshotStream {
    pub async fn start(
        upstream: Upstream,
        slot: CreatedSlot,
        pg: &crate::pgconn::PgTarget,
        config: &PostgresSourceConfig,
    ) -> Result<Self, SourceError> {
        let client = connect_client(pg, "connecting to the upstream for the snapshot").await?;
        Ok(SnapshotStream {
            watermark: format!("{}.01", slot.replica_version),
            replica_version: slot.replica_version,
            snapshot_name: slot.snapshot_name,
            client,
            connection: Some(slot.connection),
            upstream: Some(upstream),
            tables: VecDeque::new(),
            rows_estimate: None,
            schema: Schema::default(),
            cursor_open: false,
            batch_rows: config.snapshot_batch_rows,
            silence_limit: config.silence_limit(),
            phase: Phase::Start,
        })
    }

    async fn begin(&mut self) -> Result<Vec<Message>, SourceError> {
        let sql = format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{}'",
            self.snapshot_name.replace('\'', "''")
        );
        self.client.batch_execute(&sql).await.map_err(|e| pg_error("opening the snapshot transaction", e))?;
        let pubs = self.upstream.as_ref().map(|u| u.publications.clone()).unwrap_or_default();
        self.schema = super::setup::read_schema(&self.client).await?.published_in(&pubs);
        self.tables = self.schema.tables.iter().cloned().collect();
        self.rows_estimate = estimate_rows(&self.client, &self.tables).await;
        tracing::info!(
            tables = self.tables.len(),
            rows_estimate = self.rows_estimate,
            watermark = %self.watermark,
            "copying the initial snapshot"
        );
        self.phase = Phase::Copying;
        Ok(vec![Message::Begin(Begin { commit_watermark: self.watermark.clone(), extra: None })])
    }

    /// One batch of the front table, declaring it first.
    async fn copy(&mut self) -> Result<Vec<Message>, SourceError> {
        let Some(table) = self.tables.front().cloned() else { return self.finish().await };
        let mut out = Vec::new();
        if !self.cursor_open {
            out.push(Message::Relation(table.relation()));
            out.push(Message::Schema(SchemaChange::CreateTable(CreateTable { spec: table.spec(), metadata: None })));
            for index in self.schema.indexes.iter().filter(|i| i.table_oid == table.oid) {
                out.push(Message::Schema(SchemaChange::CreateIndex(index.spec())));
            }
            let columns: Vec<String> = table.columns.iter().map(|c| quote(&c.name)).collect();
            let select = if columns.is_empty() { "1".to_string() } else { columns.join(", ") };
            let sql = format!(
                "DECLARE sluice_snapshot NO SCROLL CURSOR FOR SELECT {select} FROM {}.{}",
                quote(&table.schema),
                quote(&table.name)
            );
            self.client.batch_execute(&sql).await.map_err(|e| pg_error("opening a snapshot cursor", e))?;
            self.cursor_open = true;
        }
        let fetched = self
            .client
            .simple_query(&format!("FETCH FORWARD {} FROM sluice_snapshot", self.batch_rows))
            .await
            .map_err(|e| pg_error(&format!("copying {}.{}", table.schema, table.name), e))?;
        let mut rows = 0;
        for m in fetched {
            if let SimpleQueryMessage::Row(r) = m {
                rows += 1;
                let new: Vec<Value> = table
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| match r.get(i) {
                        None => Value::Null,
                        Some(text) => from_text(c.type_oid, text),
                    })
                    .collect();
                out.push(Message::Insert(Insert { relation: table.oid, new }));
            }
        }
        if rows < self.batch_rows as usize {
            self.client.batch_execute("CLOSE sluice_snapshot").await.map_err(|e| pg_error("closing a cursor", e))?;
            self.cursor_open = false;
            self.tables.pop_front();
        }
        Ok(out)
    }

    async fn finish(&mut self) -> Result<Vec<Message>, SourceError> {
        self.client.batch_execute("COMMIT").await.map_err(|e| pg_error("ending the snapshot transaction", e))?;
        let (Some(connection), Some(upstream)) = (self.connection.take(), self.upstream.take()) else {
            return Err(SourceError::Transient("the snapshot ended twice".into()));
        };
        let start = resume_lsn(&self.watermark)
            .ok_or_else(|| SourceError::Fatal(format!("bad snapshot watermark {}", self.watermark)))?;
        let stream = ReplicationStream::start_on(
            connection,
            upstream,
            self.replica_version.clone(),
            start,
            Some(self.schema.clone()),
            self.silence_limit,
        )
        .await?;
        self.phase = Phase::Streaming(stream);
        tracing::info!(watermark = %self.watermark, "initial snapshot copied");
        Ok(vec![Message::Commit(Commit { watermark: self.watermark.clone(), extra: None })])
    }
}

fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The planner's statistics (`reltuples`): free to read, and close
/// enough for an ETA. A table never analyzed has none (-1), and then no
/// estimate is better than a wrong one.
async fn estimate_rows(client: &tokio_postgres::Client, tables: &VecDeque<TableInfo>) -> Option<u64> {
    let oids: Vec<u32> = tables.iter().map(|t| t.oid).collect();
    let sql = "SELECT coalesce(sum(reltuples), 0)::int8, count(*) FILTER (WHERE reltuples < 0)
               FROM pg_class WHERE oid = ANY($1)";
    match client.query_one(sql, &[&oids]).await {
        Ok(row) => {
            let (rows, unknown): (i64, i64) = (row.get(0), row.get(1));
            (unknown == 0).then_some(rows.max(0) as u64)
        }
        Err(e) => {
            tracing::debug!("estimating the snapshot's rows: {e}");
            None
        }
    }
}

#[async_trait]
impl ChangeStream for SnapshotStream {
    fn replica_version(&self) -> &str {
        &self.replica_version
    }

    async fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, SourceError> {
        match &mut self.phase {
            Phase::Start => self.begin().await,
            Phase::Copying => self.copy().await,
            Phase::Streaming(stream) => stream.next_batch(max).await,
        }
    }

    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        match &mut self.phase {
            Phase::Streaming(stream) => stream.ack(watermark).await,
            _ => Ok(()),
        }
    }

    async fn progress(&mut self) -> Result<SourceProgress, SourceError> {
        match &mut self.phase {
            Phase::Streaming(stream) => stream.progress().await,
            _ => Ok(SourceProgress { behind_bytes: None, snapshot_rows_estimate: self.rows_estimate }),
        }
    }

    fn silent_for(&self) -> Option<std::time::Duration> {
        match &self.phase {
            Phase::Streaming(stream) => stream.silent_for(),
            // Copying: each batch is a query that returns or fails.
            _ => None,
        }
    }
}
