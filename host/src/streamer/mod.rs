//! The replication loop: source -> storer (and forwarder), with Zero's rules.
//!
//! One pass of the loop opens the source after the log's durable watermark,
//! checks the lineage, starts a storer and pulls batches until something
//! fails. Failures are sorted into "retry" (back off 25 ms doubling to 10 s and
//! reopen from the durable watermark) and "fatal" (stop with the message).

pub mod acker;
pub mod backoff;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::change::{Change, Encoder, Event, Kind};
use crate::forwarder;
use crate::hub::Hub;
use crate::source::model::{Control, Message};
use crate::source::{ChangeSource, ChangeStream, Resume, SourceError};
use crate::status::{LineageState, SourceState, Stage, Status, TableProgress};
use crate::storage::{ChangeLog, LogError, LogResult, NewLineage};
use crate::storer::{Establish, Storer, StorerOptions};
use crate::telemetry::TARGET;
use acker::UpstreamAcker;
use backoff::Backoff;

#[derive(Debug, Clone)]
pub struct StreamerOptions {
    /// Messages asked of the source per call.
    pub batch_max: u32,
    pub storer: StorerOptions,
    /// How long the storer may take to write what is queued when a stream ends.
    pub drain_timeout: Duration,
    /// On `control reset-required`, wipe the log and start a new lineage
    /// instead of only reporting it.
    pub auto_reset: bool,
    pub task_id: String,
    /// Where subscribers reach this host (recorded as the log's owner address).
    pub advertise: String,
    /// Forwarded bytes after which the loop waits for subscribers (Zero: 64 KiB).
    pub flow_control_bytes: usize,
    /// Zero's consensus timeout proportion; negative waits for everyone.
    pub consensus_proportion: f64,
    /// While the loop waits on back-pressure, a storer that processes
    /// nothing for this long is considered wedged and the service stops.
    pub wedge_timeout: Duration,
}

impl Default for StreamerOptions {
    fn default() -> Self {
        StreamerOptions {
            batch_max: 512,
            storer: StorerOptions::default(),
            drain_timeout: Duration::from_secs(30),
            auto_reset: false,
            task_id: "sluice".into(),
            advertise: "127.0.0.1:4849".into(),
            flow_control_bytes: 64 << 10,
            consensus_proportion: 2.0,
            wedge_timeout: Duration::from_secs(20),
        }
    }
}

/// Why one pass of the loop ended.
#[derive(Debug)]
enum PassEnd {
    /// Shutdown was requested.
    Shutdown,
    /// Reopen at once (a new lineage or an auto-reset), no back-off.
    Restart,
    /// Back off, then reopen from the durable watermark.
    Retry(String),
    /// As `Retry`, for a failure of the change log: the upstream is not
    /// to blame for the time it waits.
    RetryStorage(String),
    /// Stop for good.
    Fatal(String),
    /// Stop cleanly: another host owns the log, or its tables are gone.
    Stop(String),
}

/// A change-log failure: stop cleanly for ownership loss or dropped
/// tables, retry for anything else (a lost connection, a full disk).
fn storage_end(e: &LogError) -> PassEnd {
    match e {
        LogError::OwnershipLost(_) | LogError::Gone(_) => PassEnd::Stop(e.to_string()),
        LogError::Backend(e) => PassEnd::RetryStorage(format!("change log: {e:#}")),
    }
}

impl From<SourceError> for PassEnd {
    fn from(e: SourceError) -> Self {
        match e {
            SourceError::Transient(m) => PassEnd::Retry(m),
            SourceError::Fatal(m) => PassEnd::Fatal(m),
        }
    }
}

pub struct Streamer {
    source: Box<dyn ChangeSource>,
    hub: Arc<Hub>,
    log: Option<Box<dyn ChangeLog>>,
    options: StreamerOptions,
    status: Arc<Status>,
    acker: UpstreamAcker,
    /// The next open ignores the log's position (the lineage was reset).
    open_fresh: bool,
    /// This host has taken ownership of the log (once per process).
    claimed: bool,
    /// The hub knows the existing log's lineage (`seed_hub` ran).
    seeded: bool,
    /// The lineage's snapshot is not durable yet: nothing is served until
    /// the storer's first commit establishes it (progress goes to `/status`).
    snapshotting: bool,
    /// When the snapshot's progress was last logged, and its rows then.
    snapshot_line: Option<(std::time::Instant, u64)>,
}

impl Streamer {
    pub fn new(
        source: Box<dyn ChangeSource>,
        log: Box<dyn ChangeLog>,
        hub: Arc<Hub>,
        options: StreamerOptions,
        status: Arc<Status>,
    ) -> Self {
        status.update(|s| s.source_name = source.name().to_string());
        if log.shared() {
            // Another host may own it and still be committing.
            hub.hold_until_claimed();
        }
        Streamer {
            source,
            hub,
            log: Some(Box::new(crate::storage::watched::WatchedLog::new(log, status.clone()))),
            options,
            status,
            acker: UpstreamAcker::default(),
            open_fresh: false,
            claimed: false,
            seeded: false,
            snapshotting: false,
            snapshot_line: None,
        }
    }

    /// Tells the hub (and `/status`) the lineage of an existing log, so
    /// subscribers can catch up from it while the source is still connecting
    /// (or down). Once: `run` does it if it was not done; call it before
    /// serving subscribers, so the first ones are not turned away as if
    /// there were no log yet.
    pub fn seed_hub(&mut self) {
        if std::mem::replace(&mut self.seeded, true) {
            return;
        }
        // A log whose snapshot never became durable (written by an older
        // Sluice) promises nothing: its lineage may yet be abandoned.
        if let Ok(Some(state)) = self.with_log(|log| log.state()).map(|s| s.filter(|s| s.established())) {
            self.hub.inherited_log();
            self.hub.set_replica_version(Some(&state.replica_version));
            self.status.update(|s| {
                s.replica_version = Some(state.replica_version.clone());
                s.lineage = LineageState::Established;
                s.last_watermark = Some(state.last_watermark.clone());
            });
        }
    }

    /// Runs until shutdown (Ok) or a fatal error (Err, with the reason).
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
        self.seed_hub();
        let mut backoff = Backoff::default();
        loop {
            if *shutdown.borrow() {
                self.status.update(|s| s.source = SourceState::Stopped { error: None });
                return Ok(());
            }
            let (end, progressed) = self.pass(&mut shutdown).await;
            if progressed {
                backoff.reset();
            }
            let storage_failed = matches!(end, PassEnd::RetryStorage(_));
            match end {
                PassEnd::Shutdown => {
                    self.status.update(|s| s.source = SourceState::Stopped { error: None });
                    return Ok(());
                }
                PassEnd::Restart => continue,
                PassEnd::Stop(msg) => {
                    tracing::warn!("replication stopped: {msg}");
                    self.status.update(|s| s.source = SourceState::Stopped { error: Some(msg) });
                    return Ok(());
                }
                PassEnd::Fatal(msg) => {
                    tracing::error!("replication stopped: {msg}");
                    self.status.update(|s| s.source = SourceState::Stopped { error: Some(msg.clone()) });
                    anyhow::bail!(msg);
                }
                PassEnd::Retry(msg) | PassEnd::RetryStorage(msg) => {
                    if storage_failed {
                        // Not listening to the upstream while the change log recovers.
                        self.status.source_heard(None);
                    }
                    let delay = backoff.next_delay();
                    let line = format!("{msg}; retrying in {} ms", delay.as_millis());
                    if delay < Duration::from_secs(1) {
                        tracing::info!("{line}");
                    } else if delay < Duration::from_millis(6500) {
                        tracing::warn!("{line}");
                    } else {
                        tracing::error!("{line}");
                    }
                    self.status.update(|s| {
                        s.source = SourceState::BackingOff { last_error: msg, retry_in_ms: delay.as_millis() as u64 }
                    });
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.changed() => {}
                    }
                }
            }
        }
    }

    /// Makes this host the log's owner (again after a reset, which clears it).
    fn claim(&mut self) -> Result<(), PassEnd> {
        let (task, addr) = (self.options.task_id.clone(), self.options.advertise.clone());
        self.with_log(|log| log.assume_ownership(&task, &addr))?;
        self.claimed = true;
        self.hub.claimed();
        Ok(())
    }

    /// Runs blocking change-log work without stalling the runtime's other tasks.
    fn with_log<R>(&mut self, f: impl FnOnce(&mut dyn ChangeLog) -> LogResult<R>) -> Result<R, PassEnd> {
        let log = self.log.as_mut().expect("the change log is home between passes");
        tokio::task::block_in_place(|| f(log.as_mut())).map_err(|e| storage_end(&e))
    }

    /// Opens the source and settles the lineage. Returns the stream and the
    /// watermark it continues after.
    /// Also returns what the storer must establish, when the log holds no
    /// established lineage of this stream.
    async fn open(&mut self) -> Result<(Box<dyn ChangeStream>, String, Option<Establish>), PassEnd> {
        let task = self.options.task_id.clone();
        if !self.claimed {
            // Take ownership before reading where to resume: in a shared change
            // DB the takeover waits for the old owner's open storage
            // transaction, and each later one sees ownership lost. Reading
            // first would let the old owner commit past the watermark this
            // host resumes from.
            self.claim()?;
        }
        let state = self.with_log(|log| log.state())?;
        if let Some(owner) = state.as_ref().and_then(|s| s.owner.as_deref()).filter(|o| *o != task) {
            // Later passes never take the log back: the new owner may be
            // writing, and subscribers here may have caught up from its rows.
            return Err(PassEnd::Stop(format!("changeLog ownership has been assumed by {owner}")));
        }
        let reset_requested = state.as_ref().is_some_and(|s| s.reset_required) && self.options.auto_reset;
        let resume = match &state {
            Some(s) if !self.open_fresh && !reset_requested => Some(s.last_watermark.clone()),
            _ => None,
        };
        // Opening is listening: while it waits or keeps failing, the time
        // since the upstream was last heard from grows into a stall.
        let stream = match (&resume, &state) {
            (Some(watermark), Some(s)) => {
                self.source.open(Some(Resume { watermark, replica_version: &s.replica_version })).await?
            }
            _ => self.source.open(None).await?,
        };
        self.status.source_heard(stream.silent_for());
        let rv = stream.replica_version().to_string();
        let logged_rv = state.as_ref().map(|s| s.replica_version.as_str());
        let new_lineage = match state.as_ref() {
            None => {
                tracing::info!(replica_version = %rv, "starting the change log; it is served once its snapshot is stored");
                true
            }
            Some(s) if s.replica_version != rv || reset_requested => {
                if reset_requested {
                    tracing::warn!(replica_version = %rv, "auto-reset: the change log starts a new lineage");
                } else {
                    tracing::warn!(
                        "the source reports replica version {rv} but the change log holds {}: starting a new lineage",
                        s.replica_version
                    );
                }
                if resume.is_some() {
                    // The stream was positioned in the old lineage; start over.
                    // Its subscribers can never continue.
                    self.set_snapshotting();
                    self.open_fresh = true;
                    return Err(PassEnd::Restart);
                }
                true
            }
            Some(s) if s.reset_required => {
                tracing::error!(
                    "the upstream required a reset of replica version {} (restart with --auto-reset to rebuild the change log)",
                    s.replica_version
                );
                false
            }
            Some(_) => false,
        };
        self.open_fresh = false;
        let established = !new_lineage && state.as_ref().is_some_and(|s| s.established());
        let after = resume.unwrap_or_else(|| rv.clone());
        tracing::info!(
            source = self.source.name(),
            replica_version = %rv,
            resume_after = %after,
            was = logged_rv.unwrap_or("-"),
            "replicating"
        );
        if established {
            self.snapshotting = false;
            self.hub.set_replica_version(Some(&rv));
            let bounds = self.with_log(|log| log.bounds())?;
            self.status.update(|s| {
                s.replica_version = Some(rv.clone());
                s.lineage = LineageState::Established;
                s.last_watermark = Some(bounds.last_watermark.clone());
                s.min_watermark = bounds.min_watermark.clone();
            });
        } else {
            self.set_snapshotting();
            // A durable position of a lineage being replaced must not hold
            // back the new one's acks.
            self.acker = UpstreamAcker::default();
        }
        self.status.update(|s| s.source = SourceState::Running);
        self.status.source_message();
        let establish = (!established).then(|| {
            let (hub, status, rv) = (self.hub.clone(), self.status.clone(), rv.clone());
            Establish {
                lineage: new_lineage.then(|| NewLineage {
                    replica_version: rv.clone(),
                    owner: self.options.task_id.clone(),
                    owner_address: self.options.advertise.clone(),
                }),
                on_durable: Box::new(move |w: &str| {
                    tracing::info!(replica_version = %rv, snapshot = w, "the lineage's snapshot is durable; serving subscribers");
                    hub.set_replica_version(Some(&rv));
                    status.update(|s| {
                        // The log was seeded at the replica version.
                        s.min_watermark = Some(rv.clone());
                        s.replica_version = Some(rv);
                        s.lineage = LineageState::Established;
                        s.snapshot_tables.clear();
                        s.snapshot_rows_estimate = None;
                    });
                }),
            }
        });
        Ok((stream, after, establish))
    }

    /// A lineage is being established: serve nothing until its snapshot is
    /// durable (the storer establishes it: see [`Establish`]).
    fn set_snapshotting(&mut self) {
        self.snapshotting = true;
        self.hub.set_replica_version(None);
        self.status.update(|s| {
            s.replica_version = None;
            s.lineage = LineageState::Snapshotting { tables: 0, rows: 0 };
            s.snapshot_tables.clear();
            s.snapshot_rows_estimate = None;
            s.last_watermark = None;
            s.min_watermark = None;
        });
        self.snapshot_line = None;
    }

    /// The storer made everything through `w` durable (and established a
    /// pending lineage with its first commit). Returns the acks now due
    /// upstream.
    fn on_durable(&mut self, w: &str, state: &mut StreamState) -> Vec<String> {
        state.stored_any = true;
        self.snapshotting = false;
        self.acker.on_durable(w)
    }

    /// One stream, from open to failure. Returns why it ended and whether a
    /// transaction was stored (progress resets the back-off).
    async fn pass(&mut self, shutdown: &mut watch::Receiver<bool>) -> (PassEnd, bool) {
        let (mut stream, resume_after, establish) = match self.open().await {
            Ok(s) => s,
            Err(end) => return (end, false),
        };
        let (durable_tx, mut durable_rx) = mpsc::unbounded_channel();
        let log = self.log.take().expect("the change log is home between passes");
        let storer = Storer::start(
            log,
            self.hub.catchups().clone(),
            self.options.storer,
            establish,
            durable_tx,
            self.status.clone(),
        );
        self.hub.storer_started(storer.catchup_queue());
        self.acker.reset();
        let mut state = StreamState::new(resume_after);
        let mut replaced = self.source.replacement().unwrap_or_else(|| Box::pin(futures::future::pending()));

        let end = self.pump(stream.as_mut(), &storer, &mut durable_rx, &mut state, shutdown, &mut replaced).await;
        // No stream, no distance to report (a back-off must not show the last one).
        self.status.update(|s| s.upstream_behind_bytes = None);

        if let Some(w) = &state.tx {
            tracing::warn!("aborting interrupted transaction {w}");
            storer.abort();
            // Subscribers always see a transaction end.
            self.hub.forward_only(w, Change::rollback());
        }
        drop(stream);
        self.hub.storer_stopping();
        let stopped = storer.stop(self.options.drain_timeout).await;
        self.hub.storer_stopped();
        let end = match stopped {
            Ok(exit) => {
                self.log = Some(exit.log);
                match exit.result {
                    Err(e) if !matches!(end, PassEnd::Fatal(_)) => storage_end(&e),
                    _ => end,
                }
            }
            // The storer still holds the log and may never give it back. A
            // wedge the loop noticed is the cause; the drain failed because of it.
            Err(e) => {
                let reason = match end {
                    PassEnd::Fatal(cause) => format!("{cause} ({e:#})"),
                    _ => format!("{e:#}"),
                };
                return (PassEnd::Fatal(reason), state.stored_any);
            }
        };
        while let Ok(w) = durable_rx.try_recv() {
            // The stream is gone: these acks can no longer be sent.
            self.on_durable(&w, &mut state);
        }
        (end, state.stored_any)
    }

    async fn pump(
        &mut self,
        stream: &mut dyn ChangeStream,
        storer: &Storer,
        durable_rx: &mut mpsc::UnboundedReceiver<Arc<str>>,
        state: &mut StreamState,
        shutdown: &mut watch::Receiver<bool>,
        replaced: &mut futures::future::BoxFuture<'static, String>,
    ) -> PassEnd {
        let mut encoder = Encoder::default();
        let mut acks: Vec<String> = Vec::new();
        let mut idle = Duration::from_millis(1);
        let mut quiet = QuietSource::default();
        let mut next_progress = std::time::Instant::now();
        // Set when the source's code was replaced: the stream ends at the
        // next transaction boundary, so nothing is rolled back for it.
        let mut reopen: Option<String> = None;
        loop {
            // Polled, never raced against `next_batch`: cancelling a call
            // would lose what the plugin already took from its upstream.
            if reopen.is_none() {
                reopen = futures::FutureExt::now_or_never(&mut *replaced);
            }
            if let Some(why) = reopen.as_ref().filter(|_| state.tx.is_none()) {
                tracing::info!("{why}");
                return PassEnd::Restart;
            }
            while let Ok(w) = durable_rx.try_recv() {
                acks.extend(self.on_durable(&w, state));
            }
            for w in acks.drain(..) {
                if let Err(e) = stream.ack(&w).await {
                    return e.into();
                }
            }
            let pulled = std::time::Instant::now();
            let batch = tokio::select! {
                biased;
                _ = shutdown.changed() => return PassEnd::Shutdown,
                _ = storer.finished() => return PassEnd::RetryStorage("the change log writer stopped".into()),
                batch = stream.next_batch(self.options.batch_max) => batch,
            };
            self.status.count(Stage::Source, pulled);
            self.status.source_heard(stream.silent_for());
            let batch = match batch {
                Ok(b) => b,
                Err(e) => return e.into(),
            };
            if pulled >= next_progress {
                // Asked after a batch, so a snapshot's first batch (which
                // makes the estimate) is already counted.
                next_progress = pulled + PROGRESS_EVERY;
                match stream.progress().await {
                    Ok(p) => self.status.update(|s| {
                        s.upstream_behind_bytes = p.behind_bytes;
                        s.snapshot_rows_estimate = p.snapshot_rows_estimate.filter(|_| self.snapshotting);
                    }),
                    Err(e) => return e.into(),
                }
            }
            if batch.is_empty() {
                quiet.check(self.source.name());
                // Nothing now: call again once `idle` (longer while it stays
                // quiet) has passed since this call began, waking for durable
                // commits so acks are not held back. A source that waited for
                // data itself (the Postgres source and I/O plugins wait up to
                // ~100 ms) is called again at once: a pause after its wait
                // would hold a change that arrives in it by up to 20 ms.
                let rest = idle.saturating_sub(pulled.elapsed());
                if !rest.is_zero() {
                    tokio::select! {
                        _ = tokio::time::sleep(rest) => {}
                        Some(w) = durable_rx.recv() => acks.extend(self.on_durable(&w, state)),
                        _ = shutdown.changed() => return PassEnd::Shutdown,
                    }
                }
                idle = (idle * 2).min(Duration::from_millis(20));
                continue;
            }
            idle = Duration::from_millis(1);
            quiet = QuietSource::default();
            self.status.source_message();
            let mut started = std::time::Instant::now();
            // The root of the traces of the transactions that begin in it.
            let batch_span = tracing::debug_span!(
                target: TARGET, "sluice.source.batch", source = %self.source.name(), messages = batch.len()
            );
            for msg in batch {
                if let Err(end) = self.process(msg, &mut encoder, storer, state, &mut acks, &batch_span) {
                    return end;
                }
                if state.unflushed_bytes >= self.options.flow_control_bytes {
                    self.status.count(Stage::Loop, started);
                    // Let subscribers consume before sending more (Zero's
                    // forwardWithFlowControl); a source failure or shutdown
                    // ends the wait.
                    state.unflushed_bytes = 0;
                    let targets = self.hub.broadcast_targets();
                    let broadcast = forwarder::broadcast(targets, self.options.consensus_proportion);
                    tokio::pin!(broadcast);
                    let mut listening = tokio::time::interval(Duration::from_secs(1));
                    loop {
                        tokio::select! {
                            _ = &mut broadcast => break,
                            // Waiting for subscribers is not waiting for the upstream.
                            _ = listening.tick() => self.status.source_heard(None),
                            _ = storer.finished() => return PassEnd::RetryStorage("the change log writer stopped".into()),
                            _ = shutdown.changed() => return PassEnd::Shutdown,
                        }
                    }
                    self.status.source_heard(stream.silent_for());
                    started = std::time::Instant::now();
                }
            }
            self.status.count(Stage::Loop, started);
            if storer.queued_bytes() > self.options.storer.queue_budget {
                // Back-pressure, with Zero's watchdog for a wedged change log.
                let mut seen = storer.progress();
                let mut listening = tokio::time::interval(Duration::from_secs(1));
                let wedge_every = self.options.wedge_timeout.max(Duration::from_millis(1));
                let mut wedge_check = tokio::time::interval_at(tokio::time::Instant::now() + wedge_every, wedge_every);
                loop {
                    tokio::select! {
                        _ = storer.ready_for_more() => break,
                        // Held back by storage, not by the upstream.
                        _ = listening.tick() => self.status.source_heard(None),
                        _ = storer.finished() => return PassEnd::RetryStorage("the change log writer stopped".into()),
                        _ = shutdown.changed() => return PassEnd::Shutdown,
                        _ = wedge_check.tick() => {
                            if storer.progress() == seen {
                                return PassEnd::Fatal(format!(
                                    "No statement processed within the last {}ms. Considering the change-log to be wedged.",
                                    self.options.wedge_timeout.as_millis()
                                ));
                            }
                            seen = storer.progress();
                        }
                    }
                }
            }
        }
    }

    /// Applies Zero's stream rules to one message and hands it on.
    fn process(
        &mut self,
        msg: Message,
        encoder: &mut Encoder,
        storer: &Storer,
        state: &mut StreamState,
        acks: &mut Vec<String>,
        batch_span: &tracing::Span,
    ) -> Result<(), PassEnd> {
        let watermark = match &msg {
            Message::Begin(b) => Some(b.commit_watermark.clone()),
            Message::Commit(c) => Some(c.watermark.clone()),
            _ => None,
        };
        let event = encoder.encode(msg).map_err(|e| PassEnd::Retry(e.to_string()))?;
        let change = match event {
            Event::Declared => return Ok(()),
            Event::Status { watermark, ack } => {
                if watermark < state.last_status {
                    return Err(PassEnd::Fatal(format!(
                        "status watermark {watermark} is before the previous status {}",
                        state.last_status
                    )));
                }
                state.last_status = watermark.clone();
                if ack {
                    acks.extend(self.acker.on_status(&watermark));
                }
                return Ok(());
            }
            Event::Control(Control::ResetRequired(message)) => {
                let why = message.unwrap_or_else(|| "no reason given".into());
                tracing::error!("the upstream requires a reset: {why}");
                storer.mark_reset_required();
                self.status.update(|s| {
                    s.reset_required = true;
                    s.reset_reason = Some(why.clone());
                });
                if self.options.auto_reset {
                    return Err(PassEnd::Restart);
                }
                return Ok(());
            }
            Event::Change(c) => c,
        };
        match change.kind {
            Kind::Begin => {
                let w = watermark.unwrap_or_default();
                if let Some(open) = &state.tx {
                    return Err(PassEnd::Fatal(format!("begin {w} received inside transaction {open}")));
                }
                if w <= state.last_commit {
                    if state.commits == 0 && state.skipping.is_none() {
                        // A source replaying what the log already has: skip it.
                        tracing::warn!("skipping transaction {w}: the change log already holds it");
                        state.skipping = Some(w);
                        return Ok(());
                    }
                    return Err(PassEnd::Fatal(format!(
                        "commit watermarks must grow: transaction {w} follows {}",
                        state.last_commit
                    )));
                }
                state.skipping = None;
                state.tx_span =
                    tracing::debug_span!(target: TARGET, parent: batch_span, "sluice.transaction", watermark = %w);
                state.tx = Some(Arc::from(w));
            }
            Kind::Data | Kind::Rollback | Kind::Commit if state.skipping.is_some() => {
                if change.kind == Kind::Commit {
                    let w = watermark.unwrap_or_default();
                    if Some(&w) != state.skipping.as_ref() {
                        return Err(PassEnd::Fatal(format!(
                            "commit watermark {w} does not match 'begin' watermark {}",
                            state.skipping.as_deref().unwrap_or_default()
                        )));
                    }
                    acks.extend(self.acker.on_commit(&w));
                }
                if change.kind != Kind::Data {
                    state.skipping = None;
                }
                return Ok(());
            }
            Kind::Data | Kind::Rollback if state.tx.is_none() => {
                return Err(PassEnd::Fatal(format!(
                    "{} change ({}) received before 'begin' message",
                    if change.kind == Kind::Data { "data" } else { "rollback" },
                    change.tag
                )));
            }
            Kind::Commit => {
                let w = watermark.unwrap_or_default();
                match &state.tx {
                    None => {
                        return Err(PassEnd::Fatal(format!("commit change {w} received before 'begin' message")));
                    }
                    Some(open) if **open != *w => {
                        return Err(PassEnd::Fatal(format!(
                            "commit watermark {w} does not match 'begin' watermark {open}"
                        )));
                    }
                    Some(_) => {}
                }
            }
            Kind::Data | Kind::Rollback => {}
        }
        let tx = state.tx.clone().expect("checked above: a transaction is open");
        let kind = change.kind;
        if kind == Kind::Data && self.snapshotting {
            self.count_snapshot_progress(&change);
        }
        state.unflushed_bytes += change.json.len();
        if kind == Kind::Commit && !state.tx_span.is_disabled() {
            // Traced: the storer's commit span joins this transaction's
            // trace, and the commit's hand-off to every subscriber is one.
            let tx_span = std::mem::replace(&mut state.tx_span, tracing::Span::none());
            let fan_out = tracing::debug_span!(
                target: TARGET, parent: &tx_span, "sluice.fan_out", subscribers = self.hub.subscriber_count()
            );
            storer.trace(&tx, tx_span);
            fan_out.in_scope(|| self.hub.publish(storer, &tx, change));
        } else {
            self.hub.publish(storer, &tx, change);
        }
        match kind {
            Kind::Commit => {
                state.last_commit = tx.to_string();
                state.commits += 1;
                state.tx = None;
                acks.extend(self.acker.on_commit(&tx));
            }
            Kind::Rollback => {
                state.tx = None;
                state.tx_span = tracing::Span::none();
            }
            Kind::Begin | Kind::Data => {}
        }
        Ok(())
    }
}

impl Streamer {
    /// `/status` progress of a lineage being established: rows and bytes
    /// per table (rows belong to the table begun last), and a log line
    /// with the rate every [`SNAPSHOT_LINE_EVERY`].
    fn count_snapshot_progress(&mut self, change: &Change) {
        let (table, row) = (change.tag == "create-table", change.tag == "insert");
        if !(table || row) {
            return;
        }
        let name = table.then(|| {
            let spec = serde_json::from_str::<serde_json::Value>(change.stored()).unwrap_or_default();
            format!(
                "{}.{}",
                spec["spec"]["schema"].as_str().unwrap_or("?"),
                spec["spec"]["name"].as_str().unwrap_or("?")
            )
        });
        let bytes = change.json.len() as u64;
        let mut total = 0;
        self.status.update(|s| {
            if let LineageState::Snapshotting { tables, rows } = &mut s.lineage {
                *tables += table as u64;
                *rows += row as u64;
                total = *rows;
            }
            if let Some(name) = name {
                s.snapshot_tables.push(TableProgress { table: name, rows: 0, bytes: 0 });
            } else if let Some(current) = s.snapshot_tables.last_mut() {
                current.rows += 1;
                current.bytes += bytes;
            }
        });
        let now = std::time::Instant::now();
        let (since, rows_then) = *self.snapshot_line.get_or_insert((now, total));
        if now.duration_since(since) >= SNAPSHOT_LINE_EVERY {
            let s = self.status.snapshot();
            let rate = (total - rows_then) as f64 / now.duration_since(since).as_secs_f64();
            let bytes: u64 = s.snapshot_tables.iter().map(|t| t.bytes).sum();
            let current =
                s.snapshot_tables.last().map(|t| format!("{} ({} rows)", t.table, t.rows)).unwrap_or_default();
            tracing::info!(
                "snapshot: {total} rows, {:.1} MiB in {} tables so far, {rate:.0} rows/s{}; copying {current}",
                bytes as f64 / (1 << 20) as f64,
                s.snapshot_tables.len(),
                eta_text(total, s.snapshot_rows_estimate, rate),
            );
            self.snapshot_line = Some((now, total));
        }
    }
}

/// The progress line's estimate, when the source gave a row count: the
/// share done and the time left at the current rate. Past the estimate
/// (statistics are approximate) it says so instead of counting down.
fn eta_text(rows: u64, estimate: Option<u64>, rate: f64) -> String {
    let Some(estimate) = estimate.filter(|&e| e > 0) else { return String::new() };
    if rows >= estimate {
        return format!(", past the ~{estimate} rows estimated");
    }
    let percent = rows as f64 * 100.0 / estimate as f64;
    if rate <= 0.0 {
        return format!(", {percent:.0}% of ~{estimate} rows");
    }
    let left = ((estimate - rows) as f64 / rate).ceil() as u64;
    let left = match left {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s.div_ceil(60)),
        s => format!("{:.1} h", s as f64 / 3600.0),
    };
    format!(", {percent:.0}% of ~{estimate} rows, about {left} left")
}

/// How often a snapshot being stored reports its progress in the log.
const SNAPSHOT_LINE_EVERY: Duration = Duration::from_secs(10);
/// How often the loop asks the source how far it is from its upstream.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// A connected source that sends nothing (not even a status) for long may
/// be stalled: say so in the log, after a minute and then at doubling
/// intervals. `/status` shows the time since its last message throughout.
struct QuietSource {
    since: std::time::Instant,
    next_report: Duration,
}

impl Default for QuietSource {
    fn default() -> Self {
        QuietSource { since: std::time::Instant::now(), next_report: Duration::from_secs(60) }
    }
}

impl QuietSource {
    fn check(&mut self, source: &str) {
        let quiet = self.since.elapsed();
        if quiet >= self.next_report {
            tracing::warn!(
                "the source {source} is connected but has sent nothing for {} s (see sourceIdleMs in /status)",
                quiet.as_secs()
            );
            self.next_report *= 2;
        }
    }
}

/// What the loop tracks about the stream it is reading.
struct StreamState {
    /// The open transaction's commit watermark.
    tx: Option<Arc<str>>,
    last_commit: String,
    last_status: String,
    commits: u64,
    /// A replayed transaction being skipped.
    skipping: Option<String>,
    stored_any: bool,
    /// Bytes forwarded since the last flow-control wait.
    unflushed_bytes: usize,
    /// The open transaction's trace span (disabled unless traces are on).
    tx_span: tracing::Span,
}

impl StreamState {
    fn new(resume_after: String) -> Self {
        StreamState {
            tx: None,
            last_commit: resume_after,
            last_status: String::new(),
            commits: 0,
            skipping: None,
            stored_any: false,
            unflushed_bytes: 0,
            tx_span: tracing::Span::none(),
        }
    }
}

#[cfg(test)]
mod rules;

#[cfg(test)]
mod tests {
    use super::eta_text;

    #[test]
    fn the_progress_line_counts_down_to_the_estimate() {
        assert_eq!(eta_text(100, None, 50.0), "", "no estimate, no ETA");
        assert_eq!(eta_text(250, Some(1000), 50.0), ", 25% of ~1000 rows, about 15 s left");
        assert_eq!(eta_text(0, Some(1_000_000), 1000.0), ", 0% of ~1000000 rows, about 17 min left");
        assert_eq!(eta_text(0, Some(100_000_000), 1000.0), ", 0% of ~100000000 rows, about 27.8 h left");
        assert_eq!(eta_text(10, Some(100), 0.0), ", 10% of ~100 rows");
        assert_eq!(eta_text(120, Some(100), 50.0), ", past the ~100 rows estimated");
    }
}
