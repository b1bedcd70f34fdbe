//! A change log whose calls are watched: while one waits for its answer,
//! `/status`, `/readyz` and the metrics can say so (a change DB behind a
//! silent network path, a disk that stopped answering), instead of the
//! host looking healthy with a frozen watermark.

use std::sync::Arc;

use super::{Bounds, ChangeLog, LogResult, LogRow, LogState, NewLineage};
use crate::status::Status;

pub struct WatchedLog {
    inner: Box<dyn ChangeLog>,
    status: Arc<Status>,
}

impl WatchedLog {
    pub fn new(inner: Box<dyn ChangeLog>, status: Arc<Status>) -> Self {
        WatchedLog { inner, status }
    }
}

/// Each call marks itself in flight for as long as it runs.
macro_rules! watched {
    ($self:ident, $call:expr) => {{
        let _in_flight = $self.status.change_log_call();
        $call
    }};
}

impl ChangeLog for WatchedLog {
    fn state(&mut self) -> LogResult<Option<LogState>> {
        watched!(self, self.inner.state())
    }
    fn reset(&mut self, replica_version: &str) -> LogResult<()> {
        watched!(self, self.inner.reset(replica_version))
    }
    fn start_lineage(&mut self, lineage: &NewLineage) -> LogResult<()> {
        watched!(self, self.inner.start_lineage(lineage))
    }
    fn mark_reset_required(&mut self) -> LogResult<()> {
        watched!(self, self.inner.mark_reset_required())
    }
    fn assume_ownership(&mut self, task_id: &str, address: &str) -> LogResult<()> {
        watched!(self, self.inner.assume_ownership(task_id, address))
    }
    fn shared(&self) -> bool {
        self.inner.shared()
    }
    fn append_batch_rows(&self) -> usize {
        self.inner.append_batch_rows()
    }
    fn begin(&mut self) -> LogResult<()> {
        watched!(self, self.inner.begin())
    }
    fn savepoint(&mut self) -> LogResult<()> {
        watched!(self, self.inner.savepoint())
    }
    fn release_savepoint(&mut self) -> LogResult<()> {
        watched!(self, self.inner.release_savepoint())
    }
    fn rollback_to_savepoint(&mut self) -> LogResult<()> {
        watched!(self, self.inner.rollback_to_savepoint())
    }
    fn append(&mut self, rows: &[LogRow<'_>]) -> LogResult<()> {
        watched!(self, self.inner.append(rows))
    }
    fn commit(&mut self, last_watermark: &str) -> LogResult<()> {
        watched!(self, self.inner.commit(last_watermark))
    }
    fn rollback(&mut self) -> LogResult<()> {
        watched!(self, self.inner.rollback())
    }
    fn bounds(&mut self) -> LogResult<Bounds> {
        watched!(self, self.inner.bounds())
    }
}
