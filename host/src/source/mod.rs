//! Change sources: where transactions come from.
//!
//! Every source, a WebAssembly plugin or a native one, implements
//! [`ChangeSource`] and produces [`model::Message`]s (the change model of the
//! WIT contract, crate `sluice-contract`), so everything downstream is shared.

use async_trait::async_trait;

pub mod assemble;
pub mod postgres;
pub mod scripted;

/// The change model from the WIT contract.
pub use sluice_contract::model;

/// Why a source call failed, and so what the replication loop does next.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Retry: reopen from the last durable watermark after a back-off.
    #[error("{0}")]
    Transient(String),
    /// Stop: the configuration or the source itself cannot go on.
    #[error("{0}")]
    Fatal(String),
}

#[async_trait]
pub trait ChangeSource: Send {
    /// A name for logs and status ("mock-source", "postgres").
    fn name(&self) -> &str;

    /// Opens a stream that continues after `resume.watermark`, or from the
    /// start of the upstream's lineage when it is `None`.
    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError>;

    /// Resolves, with a line saying why, when the source's code was
    /// replaced while it runs (a plugin file copied over the old one): the
    /// replication loop then ends the stream at a transaction boundary and
    /// opens it again from the durable watermark. `None`: never replaced.
    fn replacement(&self) -> Option<futures::future::BoxFuture<'static, String>> {
        None
    }
}

/// Where the change log stands when a source is reopened.
#[derive(Debug, Clone, Copy)]
pub struct Resume<'a> {
    /// The last durable commit watermark.
    pub watermark: &'a str,
    /// The lineage the change log holds. Equal to `watermark` when the initial
    /// snapshot was never stored.
    pub replica_version: &'a str,
}

#[async_trait]
pub trait ChangeStream: Send {
    /// The identity of the lineage this stream's watermarks belong to.
    fn replica_version(&self) -> &str;

    /// Up to `max` messages; empty means nothing right now.
    async fn next_batch(&mut self, max: u32) -> Result<Vec<model::Message>, SourceError>;

    /// Everything through `watermark` is durable downstream.
    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError>;

    /// How far the stream is from its upstream, as far as the source can
    /// tell. The replication loop asks about once a second.
    async fn progress(&mut self) -> Result<SourceProgress, SourceError> {
        Ok(SourceProgress::default())
    }

    /// How long since the upstream was last heard from (any byte, a
    /// keepalive included), for streams that watch their link; `None` for
    /// those that cannot tell, which count as heard while their calls return.
    fn silent_for(&self) -> Option<std::time::Duration> {
        None
    }
}

/// What a stream knows of its distance to the upstream (`None`: unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceProgress {
    /// Upstream log written but not read yet (MariaDB: the binlog position
    /// gap). The Postgres source's retained WAL is measured on the side.
    pub behind_bytes: Option<u64>,
    /// While the initial snapshot is sent: about how many rows it holds
    /// (for the progress line's ETA).
    pub snapshot_rows_estimate: Option<u64>,
}
