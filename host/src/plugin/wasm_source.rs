//! A change source backed by a WebAssembly plugin.

use async_trait::async_trait;
use sluice_contract::source_world::exports::sluice::plugin::source::ResumePoint;
use sluice_contract::source_world::{SourcePlugin, SourcePluginPre};
use wasmtime::component::ResourceAny;
use wasmtime::{Engine, Store};

use super::sandbox::{self, HostState, NetGrant, SandboxLimits};
use crate::source::model::{Message, PluginError};
use crate::source::{ChangeSource, ChangeStream, Resume, SourceError};

pub struct WasmSource {
    engine: Engine,
    name: String,
    pre: SourcePluginPre<HostState>,
    config: String,
    limits: SandboxLimits,
    net: NetGrant,
}

impl WasmSource {
    pub(super) fn new(
        engine: Engine,
        name: String,
        pre: SourcePluginPre<HostState>,
        config: String,
        limits: SandboxLimits,
        net: NetGrant,
    ) -> Self {
        WasmSource { engine, name, pre, config, limits, net }
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

    async fn open(&mut self, resume: Option<Resume<'_>>) -> Result<Box<dyn ChangeStream>, SourceError> {
        // A fresh Store for every open: a trap or a timed-out call poisons the
        // Store, and reopening is how the loop recovers.
        let mut store = sandbox::new_store(&self.engine, &self.name, self.limits, &self.net);
        let fail = |store: &Store<HostState>, e: wasmtime::Error| {
            SourceError::Transient(format!(
                "source plugin {} {}",
                self.name,
                sandbox::describe_failure(&e, store.data(), self.limits)
            ))
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let plugin = match self.pre.instantiate_async(&mut store).await {
            Ok(p) => p,
            Err(e) => return Err(fail(&store, e)),
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let opened =
            plugin.sluice_plugin_source().call_open(&mut store, &self.config, resume.map(resume_point).as_ref()).await;
        let handle = match opened {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => return Err(plugin_error(&self.name, e)),
            Err(e) => return Err(fail(&store, e)),
        };
        store.data_mut().arm_deadline(self.limits.call_deadline);
        let rv = plugin.sluice_plugin_source().change_stream().call_replica_version(&mut store, handle).await;
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
    plugin: SourcePlugin,
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
        let stream = self.plugin.sluice_plugin_source().change_stream();
        match stream.call_next_batch(&mut self.store, self.handle, max).await {
            Ok(Ok(batch)) => Ok(batch),
            Ok(Err(e)) => Err(plugin_error(&self.name, e)),
            Err(e) => Err(self.failure(e)),
        }
    }

    async fn ack(&mut self, watermark: &str) -> Result<(), SourceError> {
        self.arm();
        let stream = self.plugin.sluice_plugin_source().change_stream();
        match stream.call_ack(&mut self.store, self.handle, &watermark.to_string()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(plugin_error(&self.name, e)),
            Err(e) => Err(self.failure(e)),
        }
    }
}
