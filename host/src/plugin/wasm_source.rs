//! A change source backed by a WebAssembly plugin.
//!
//! When the plugin's file is replaced while Sluice runs, the source tells
//! the replication loop (see [`ChangeSource::replacement`]), which ends the
//! stream at a transaction boundary and opens it again from the durable
//! watermark: the new code continues where the old one's durable work ends.

use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use sluice_contract::source_world::exports::sluice::plugin::source::{self as source_export, ResumePoint};
use sluice_contract::source_world::exports::sluice::plugin::source_progress;
use wasmtime::component::{InstancePre, ResourceAny};
use wasmtime::{Engine, Store};

use super::sandbox::{self, HostState, NetGrant, SandboxLimits};
use super::Registry;
use crate::source::model::{Message, PluginError};
use crate::source::{ChangeSource, ChangeStream, Resume, SourceError, SourceProgress};

/// A source plugin ready to instantiate: its `source` export, and its
/// `source-progress` export when it has one (optional since 0.3.1, so a
/// plugin built against 0.3.0 still runs).
#[derive(Clone)]
pub struct SourcePre {
    instance: InstancePre<HostState>,
    source: source_export::GuestIndices,
    progress: Option<source_progress::GuestIndices>,
}

/// The exports of one instance of a source plugin.
pub(super) struct SourceExports {
    source: source_export::Guest,
    progress: Option<source_progress::Guest>,
}

impl SourcePre {
    pub(super) fn new(instance: InstancePre<HostState>) -> wasmtime::Result<SourcePre> {
        let source = source_export::GuestIndices::new(&instance)?;
        let progress = source_progress::GuestIndices::new(&instance).ok();
        Ok(SourcePre { instance, source, progress })
    }

    pub(super) async fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<SourceExports> {
        let instance = self.instance.instantiate_async(&mut *store).await?;
        let source = self.source.load(&mut *store, &instance)?;
        let progress = match &self.progress {
            Some(indices) => Some(indices.load(&mut *store, &instance)?),
            None => None,
        };
        Ok(SourceExports { source, progress })
    }
}

/// The source plugin `name` from `registry`, with its configuration (JSON
/// text): its network grant is the upstream the configuration names plus
/// `allow_net`, and TLS tunnels to those (see `tls_tunnel`) trust the
/// config's `tls_ca`.
pub async fn build_source(
    registry: &Arc<Registry>,
    name: &str,
    config: &str,
    limits: SandboxLimits,
    allow_net: &[String],
) -> anyhow::Result<WasmSource> {
    let net = super::net::grant_for(config, allow_net)?;
    registry.source(name, config.to_string(), limits, net).await.map_err(anyhow::Error::msg)
}

pub struct WasmSource {
    registry: Arc<Registry>,
    name: String,
    pre: SourcePre,
    /// The registry's generation of `pre`.
    generation: u64,
    config: String,
    limits: SandboxLimits,
    net: NetGrant,
}

impl WasmSource {
    pub(super) fn new(
        registry: Arc<Registry>,
        name: String,
        (pre, generation): (SourcePre, u64),
        config: String,
        limits: SandboxLimits,
        net: NetGrant,
    ) -> Self {
        WasmSource { registry, name, pre, generation, config, limits, net }
    }

    fn engine(&self) -> &Engine {
        self.registry.engine_ref()
    }
}

fn plugin_error(name: &str, e: PluginError) -> SourceError {
    match e {
        PluginError::InvalidConfig(m) => {
            SourceError::Fatal(format!("source plugin {name}: invalid configuration: {m}"))
        }
        PluginError::Transient(m) => SourceError::Transient(format!("source plugin {name}: {m}")),
        PluginError::Fatal(m) => SourceError::Fatal(format!("source plugin {name}: {m}")),
    }
}

fn resume_point(r: Resume<'_>) -> ResumePoint {
    ResumePoint { watermark: r.watermark.to_string(), replica_version: r.replica_version.to_string() }
}

#[async_trait]
impl ChangeSource for WasmSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn replacement(&self) -> Option<BoxFuture<'static, String>> {
        let (registry, name, running) = (self.registry.clone(), self.name.clone(), self.generation);
        Some(Box::pin(async move {
            let mut changes = registry.changes();
            loop {
                if let Some((_, generation)) = registry.current_source(&name).filter(|(_, g)| *g != running) {
                    return format!(
                        "source plugin {name} was replaced (generation {running} -> {generation}): reopening from the durable watermark with the new code"
                    );
                }
                if changes.changed().await.is_err() {
                    return futures::future::pending().await;
                }
            }
        }))
    }

    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError> {
        // The file may have been replaced since the last open (a removed
        // file leaves the loaded code running).
        if let Some((pre, generation)) = self.registry.current_source(&self.name) {
            if generation != self.generation {
                tracing::info!(source = %self.name, generation, "opening the source with its new code");
                (self.pre, self.generation) = (pre, generation);
            }
        }
        // A fresh Store for every open: a trap or a timed-out call poisons the
        // Store, and reopening is how the loop recovers.
        let mut store = sandbox::new_store(self.engine(), &self.name, self.limits, &self.net);
        let fail = |store: &Store<HostState>, e: wasmtime::Error| {
            SourceError::Transient(format!(
                "source plugin {} {}",
                self.name,
                sandbox::describe_failure(&e, store.data(), self.limits)
            ))
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let plugin = match self.pre.instantiate(&mut store).await {
            Ok(p) => p,
            Err(e) => return Err(fail(&store, e)),
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let opened = plugin.source.call_open(&mut store, &self.config, resume.map(resume_point).as_ref()).await;
        let handle = match opened {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => return Err(plugin_error(&self.name, e)),
            Err(e) => return Err(fail(&store, e)),
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let rv = plugin.source.change_stream().call_replica_version(&mut store, handle).await;
        let replica_version = match rv {
            Ok(v) => v,
            Err(e) => return Err(fail(&store, e)),
        };
        if replica_version.is_empty() {
            return Err(SourceError::Fatal(format!("source plugin {} reported an empty replica version", self.name)));
        }
        Ok(Box::new(WasmStream {
            name: self.name.clone(),
            store,
            plugin,
            handle,
            replica_version,
            limits: self.limits,
        }))
    }
}

struct WasmStream {
    name: String,
    store: Store<HostState>,
    plugin: SourceExports,
    handle: ResourceAny,
    replica_version: String,
    limits: SandboxLimits,
}

impl WasmStream {
    fn failure(&self, e: wasmtime::Error) -> SourceError {
        SourceError::Transient(format!(
            "source plugin {} {}",
            self.name,
            sandbox::describe_failure(&e, self.store.data(), self.limits)
        ))
    }

    fn arm(&mut self) {
        self.store.data_mut().arm_deadline(self.limits.call_deadline);
    }
}

#[async_trait]
impl ChangeStream for WasmStream {
    fn replica_version(&self) -> &str {
        &self.replica_version
    }

    async fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, SourceError> {
        self.arm();
        let stream = self.plugin.source.change_stream();
        let started = std::time::Instant::now();
        let called = stream.call_next_batch(&mut self.store, self.handle, max).await;
        sandbox::SOURCE_CALLS.record(started, &called, self.store.data());
        match called {
            Ok(Ok(batch)) => Ok(batch),
            Ok(Err(e)) => Err(plugin_error(&self.name, e)),
            Err(e) => Err(self.failure(e)),
        }
    }

    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        self.arm();
        let stream = self.plugin.source.change_stream();
        let started = std::time::Instant::now();
        let called = stream.call_ack(&mut self.store, self.handle, &watermark.to_string()).await;
        sandbox::SOURCE_CALLS.record(started, &called, self.store.data());
        match called {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(plugin_error(&self.name, e)),
            Err(e) => Err(self.failure(e)),
        }
    }

    async fn progress(&mut self) -> Result<SourceProgress, SourceError> {
        let Some(progress) = self.plugin.progress.clone() else {
            return Ok(SourceProgress::default());
        };
        self.arm();
        let started = std::time::Instant::now();
        let called = progress.call_progress(&mut self.store, self.handle).await;
        sandbox::SOURCE_CALLS.record(started, &called, self.store.data());
        match called {
            Ok(p) => {
                Ok(SourceProgress { behind_bytes: p.behind_bytes, snapshot_rows_estimate: p.snapshot_rows_estimate })
            }
            Err(e) => Err(self.failure(e)),
        }
    }
}
