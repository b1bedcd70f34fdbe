//! The built-in Postgres source: logical replication with pgoutput.
//!
//! * [`setup`]: checks the server, creates the publication, the slot and
//!   Sluice's bookkeeping (schema `_sluice`) and the DDL event trigger.
//! * [`snapshot`]: the first transaction of a new slot, copied at the slot's
//!   exported snapshot.
//! * [`stream`]: `START_REPLICATION`, decoding, acks and keepalives.
//! * [`wire`], [`pgoutput`], [`values`], [`schema`]: the protocol pieces.
//! * [`zero_shard`]: Zero's upstream tables, created and streamed on request.
//! * [`retained_wal`]: the WAL the slot holds, watched beside the loop.

pub mod pgoutput;
pub mod retained_wal;
pub mod schema;
pub mod setup;
pub mod snapshot;
pub mod stream;
pub mod values;
pub mod wire;
pub mod zero_shard;

use async_trait::async_trait;
use serde::Deserialize;

use crate::source::{ChangeSource, ChangeStream, Resume, SourceError};

/// `--source-config` of `--source postgres`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresSourceConfig {
    /// postgres://user:password@host:port/database
    pub url: String,
    /// Publications to replicate. Empty: Sluice creates and uses
    /// `_sluice_public_<slot>`, all tables of schema `public`.
    #[serde(default)]
    pub publications: Vec<String>,
    /// The replication slot's name (also keys Sluice's bookkeeping).
    #[serde(default = "default_slot")]
    pub slot: String,
    /// Rows per batch when copying the initial snapshot.
    #[serde(default = "default_snapshot_batch_rows")]
    pub snapshot_batch_rows: u32,
    /// Create Zero's tables for this app and shard in the upstream, and
    /// replicate them ([`zero_shard`]).
    #[serde(default)]
    pub zero: Option<zero_shard::ZeroShard>,
    /// Milliseconds of silence on the replication link (no data, and no
    /// answer to the status requests sent after 2 s of it) before the link
    /// is given up as dead and reopened from the durable position.
    #[serde(default)]
    pub silence_timeout_ms: Option<u64>,
}

fn default_slot() -> String {
    "sluice".into()
}

fn default_snapshot_batch_rows() -> u32 {
    5000
}

/// Zero's rule for publication names.
fn valid_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 63
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl PostgresSourceConfig {
    pub fn parse(json: &str) -> Result<Self, String> {
        let config: PostgresSourceConfig =
            serde_json::from_str(json).map_err(|e| format!("postgres source config: {e}"))?;
        if !config.slot.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            || config.slot.is_empty()
            || config.slot.len() > 40
        {
            return Err(format!(
                "postgres source config: slot {:?}: use 1 to 40 lower-case letters, digits and _",
                config.slot
            ));
        }
        for p in &config.publications {
            if !valid_identifier(p) || p.starts_with('_') {
                return Err(format!(
                    "postgres source config: publication {p:?}: use letters, digits and _ (not first), at most 63"
                ));
            }
        }
        if let Some(zero) = &config.zero {
            zero.check()?;
        }
        if config.snapshot_batch_rows == 0 {
            return Err("postgres source config: snapshot_batch_rows must be at least 1".into());
        }
        Ok(config)
    }

    /// See `silence_timeout_ms` (at least 3 s: the first request for an
    /// answer goes out after 2 s).
    pub fn silence_limit(&self) -> std::time::Duration {
        self.silence_timeout_ms
            .map(|ms| std::time::Duration::from_millis(ms.max(3000)))
            .unwrap_or(stream::SILENCE_LIMIT)
    }

    /// The publications the slot streams.
    pub fn publication_names(&self) -> Vec<String> {
        let mut p =
            if self.publications.is_empty() { vec![self.default_publication()] } else { self.publications.clone() };
        p.extend(self.zero.as_ref().map(|z| z.publication()));
        p.sort();
        p.dedup();
        p
    }

    /// The publication Sluice creates when none is configured.
    pub fn default_publication(&self) -> String {
        format!("_sluice_public_{}", self.slot)
    }
}

/// The longest a step of reopening the stream may take (each connection is
/// bounded by its own `connect_timeout`; this bounds what follows on a link
/// that went silent after the login). Creating a slot and copying a snapshot
/// are not bounded: they wait for the upstream's own transactions.
const OPEN_STEP_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

async fn bounded<T>(
    what: &str,
    step: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T, SourceError> {
    tokio::time::timeout(OPEN_STEP_LIMIT, step).await.unwrap_or_else(|_| {
        Err(SourceError::Transient(format!(
            "{what}: no answer within {} s (a silent network path or a stuck server)",
            OPEN_STEP_LIMIT.as_secs()
        )))
    })
}

pub struct PostgresSource {
    config: PostgresSourceConfig,
    pg: crate::pgconn::PgTarget,
    warned_degraded: bool,
}

impl PostgresSource {
    pub fn new(config_json: &str) -> Result<Self, String> {
        let config = PostgresSourceConfig::parse(config_json)?;
        let pg =
            crate::pgconn::PgTarget::parse(&config.url).map_err(|e| format!("postgres source config: url: {e}"))?;
        Ok(PostgresSource { config, pg, warned_degraded: false })
    }
}

#[async_trait]
impl ChangeSource for PostgresSource {
    fn name(&self) -> &str {
        "postgres"
    }

    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError> {
        let upstream = bounded("connecting to the upstream", setup::Upstream::connect(&self.pg, &self.config)).await?;
        if !upstream.ddl_detection && !self.warned_degraded {
            self.warned_degraded = true;
            tracing::warn!(
                "cannot install the DDL event trigger (it needs a superuser): schema changes are detected from \
                 relation messages, and those that cannot be followed require a reset"
            );
        }
        if let Some(watermark) = resume.map(|r| r.watermark) {
            match bounded("reading the replication slot", upstream.existing_slot()).await? {
                // The snapshot never made it into the change log: take a new one.
                setup::SlotState::Usable { replica_version } if replica_version == watermark => {}
                setup::SlotState::Usable { replica_version } => {
                    let start = stream::resume_lsn(watermark).ok_or_else(|| {
                        SourceError::Fatal(format!("resume watermark {watermark} is not a Postgres position"))
                    })?;
                    let silence = self.config.silence_limit();
                    let stream = stream::ReplicationStream::start(upstream, &self.pg, replica_version, start, silence);
                    return bounded("starting replication", stream).await;
                }
                setup::SlotState::Lost { replica_version, reason } => {
                    return Ok(Box::new(stream::LostStream::new(replica_version, reason)));
                }
            }
        }
        let created = upstream.create_slot(&self.pg).await?;
        Ok(Box::new(snapshot::SnapshotStream::start(upstream, created, &self.pg, &self.config).await?))
    }
}
