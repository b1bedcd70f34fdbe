//! One filter plugin instance: its own Store (memory cap, per-call deadline,
//! no WASI capabilities beyond stderr to the log) and the `change-filter`
//! resource created from one configuration. [`FilterPlugins`] creates them
//! for the filter host from the plugin directory.

use std::sync::Arc;

use async_trait::async_trait;
use json_scan::ColumnLocator;
use rustc_hash::FxHashMap;
use sluice_contract::filter::{Batch, Decision, TablePolicy};
use sluice_contract::filter_world::{FilterPlugin, FilterPluginPre};
use sluice_contract::model::PluginError;
use wasmtime::component::ResourceAny;
use wasmtime::{Engine, Store};

use super::sandbox::{describe_failure, new_store, HostState, NetGrant, SandboxLimits, FILTER_CALLS};
use super::Registry;
use crate::filter::{ChangeFilter, FilterFactory, FilterHost};

/// The filters of a plugin directory, each instance in its own sandbox.
pub struct FilterPlugins {
    registry: Arc<Registry>,
    limits: SandboxLimits,
    /// The filters subscribers may ask for (`None`: every filter plugin in
    /// the directory).
    allowed: Option<Vec<String>>,
}

impl FilterPlugins {
    /// The filter host subscribers' chains are built by: the plugin
    /// directory's filters, or none without a directory.
    pub fn host(registry: Option<Arc<Registry>>, limits: SandboxLimits) -> Arc<FilterHost> {
        Self::host_allowing(registry, limits, None)
    }

    /// As [`FilterPlugins::host`], with only the `allowed` filters usable.
    pub fn host_allowing(
        registry: Option<Arc<Registry>>,
        limits: SandboxLimits,
        allowed: Option<Vec<String>>,
    ) -> Arc<FilterHost> {
        FilterHost::new(registry.map(|registry| {
            Arc::new(FilterPlugins { registry, limits, allowed: allowed.clone() }) as Arc<dyn FilterFactory>
        }))
    }
}

#[async_trait]
impl FilterFactory for FilterPlugins {
    async fn create(&self, plugin: &str, config: &str) -> Result<Box<dyn ChangeFilter>, String> {
        if let Some(allowed) = &self.allowed {
            if !allowed.iter().any(|a| a == plugin) {
                return Err(format!(
                    "filter {plugin:?} is not allowed on this Sluice (allowed: {})",
                    if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
                ));
            }
        }
        let (engine, pre) = self.registry.filter(plugin).await?;
        Ok(Box::new(WasmFilter::create(&engine, &pre, plugin, config, self.limits).await?))
    }

    async fn generation(&self, plugin: &str) -> Option<u64> {
        self.registry.generation(plugin).await
    }
}

pub struct WasmFilter {
    name: String,
    store: Store<HostState>,
    plugin: FilterPlugin,
    handle: ResourceAny,
    limits: SandboxLimits,
    /// Answers of `table-policy`, asked once per table (by schema, then
    /// name, so a lookup allocates nothing).
    policies: FxHashMap<String, FxHashMap<String, TablePolicy>>,
    /// The filter's `row-columns`, found here in each change it is sent.
    locator: Option<ColumnLocator>,
    /// The last batch sent, its buffers reused for the next.
    batch: Batch,
}

/// Batch buffers larger than this are freed after the call.
const KEPT_BATCH_BYTES: usize = 1 << 20;

fn empty_batch() -> Batch {
    Batch { texts: String::new(), ends: Vec::new(), spans: Vec::new() }
}

/// The most `row-columns` a filter may name (each costs 16 bytes per change
/// sent to it).
const MAX_ROW_COLUMNS: usize = 64;

impl WasmFilter {
    pub async fn create(
        engine: &Engine,
        pre: &FilterPluginPre<HostState>,
        name: &str,
        config: &str,
        limits: SandboxLimits,
    ) -> Result<Self, String> {
        let mut store = new_store(engine, name, limits, &NetGrant::default());
        store.data_mut().arm_running_time(limits.call_deadline);
        let plugin = match pre.instantiate_async(&mut store).await {
            Ok(p) => p,
            Err(e) => return Err(format!("filter plugin {name} {}", describe_failure(&e, store.data(), limits))),
        };
        store.data_mut().arm_running_time(limits.call_deadline);
        let created = plugin.sluice_plugin_filter().call_create(&mut store, config).await;
        let handle = match created {
            Ok(Ok(h)) => h,
            Ok(Err(PluginError::InvalidConfig(m))) => {
                return Err(format!("filter plugin {name} rejected its configuration: {m}"))
            }
            Ok(Err(PluginError::Transient(m) | PluginError::Fatal(m))) => {
                return Err(format!("filter plugin {name} could not start: {m}"))
            }
            Err(e) => return Err(format!("filter plugin {name} {}", describe_failure(&e, store.data(), limits))),
        };
        store.data_mut().arm_running_time(limits.call_deadline);
        let filter = plugin.sluice_plugin_filter().change_filter();
        let columns = match filter.call_row_columns(&mut store, handle).await {
            Ok(c) => c,
            Err(e) => return Err(format!("filter plugin {name} {}", describe_failure(&e, store.data(), limits))),
        };
        if let Some(c) = &columns {
            if c.len() > MAX_ROW_COLUMNS {
                return Err(format!(
                    "filter plugin {name} names {} row columns, more than the {MAX_ROW_COLUMNS} the host locates",
                    c.len()
                ));
            }
        }
        Ok(WasmFilter {
            name: name.to_string(),
            store,
            plugin,
            handle,
            limits,
            policies: FxHashMap::default(),
            locator: columns.filter(|c| !c.is_empty()).map(ColumnLocator::new),
            batch: empty_batch(),
        })
    }

    fn failure(&self, e: wasmtime::Error) -> String {
        format!("filter plugin {} {}", self.name, describe_failure(&e, self.store.data(), self.limits))
    }
}

#[async_trait]
impl ChangeFilter for WasmFilter {
    async fn policy(&mut self, schema: &str, table: &str) -> Result<TablePolicy, String> {
        if let Some(p) = self.policies.get(schema).and_then(|t| t.get(table)) {
            return Ok(*p);
        }
        self.store.data_mut().arm_running_time(self.limits.call_deadline);
        let filter = self.plugin.sluice_plugin_filter().change_filter();
        let started = std::time::Instant::now();
        let called = filter.call_table_policy(&mut self.store, self.handle, schema, table).await;
        FILTER_CALLS.record(started, &called, self.store.data());
        let policy = match called {
            Ok(p) => p,
            Err(e) => return Err(self.failure(e)),
        };
        self.policies.entry(schema.to_string()).or_default().insert(table.to_string(), policy);
        Ok(policy)
    }

    /// Decisions for change objects (JSON texts), one per change.
    async fn apply(&mut self, changes: &[&str]) -> Result<Vec<Decision>, String> {
        // The batch's buffers are kept between calls (this runs for every
        // batch a subscriber is sent), and let go when a batch was large.
        let batch = &mut self.batch;
        batch.texts.clear();
        batch.ends.clear();
        batch.spans.clear();
        batch.texts.reserve(changes.iter().map(|c| c.len()).sum());
        batch.ends.reserve(changes.len());
        for c in changes {
            batch.texts.push_str(c);
            batch.ends.push(batch.texts.len() as u32);
        }
        if let Some(locator) = &self.locator {
            batch.spans.reserve(changes.len() * 4 * locator.columns().len());
            for c in changes {
                locator.locate(c, &mut batch.spans);
            }
        }
        self.store.data_mut().arm_running_time(self.limits.call_deadline);
        let filter = self.plugin.sluice_plugin_filter().change_filter();
        let started = std::time::Instant::now();
        let called = filter.call_apply(&mut self.store, self.handle, &self.batch).await;
        FILTER_CALLS.record(started, &called, self.store.data());
        if self.batch.texts.capacity() > KEPT_BATCH_BYTES {
            self.batch = empty_batch();
        }
        let decisions = match called {
            Ok(d) => d,
            Err(e) => return Err(self.failure(e)),
        };
        if decisions.len() != changes.len() {
            return Err(format!(
                "filter plugin {} answered {} decisions for {} changes",
                self.name,
                decisions.len(),
                changes.len()
            ));
        }
        Ok(decisions)
    }

    fn name(&self) -> &str {
        &self.name
    }
}
