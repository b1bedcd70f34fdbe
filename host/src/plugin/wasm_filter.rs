//! One filter plugin instance: its own Store (memory cap, per-call deadline,
//! no WASI capabilities beyond stderr to the log) and the `change-filter`
//! resource created from one configuration.

use json_scan::ColumnLocator;
use rustc_hash::FxHashMap;

use wasmtime::component::ResourceAny;
use wasmtime::{Engine, Store};

use crate::plugin::bindings::filter::exports::sluice::plugin::filter::{Batch, Decision, TablePolicy};
use crate::plugin::bindings::filter::{FilterPlugin, FilterPluginPre};
use crate::plugin::{describe_failure, new_store, HostState, NetGrant, SandboxLimits};
use crate::source::model::PluginError;

pub struct FilterInstance {
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

impl FilterInstance {
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
        Ok(FilterInstance {
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

    pub async fn policy(&mut self, schema: &str, table: &str) -> Result<TablePolicy, String> {
        if let Some(p) = self.policies.get(schema).and_then(|t| t.get(table)) {
            return Ok(*p);
        }
        self.store.data_mut().arm_running_time(self.limits.call_deadline);
        let filter = self.plugin.sluice_plugin_filter().change_filter();
        let policy = match filter.call_table_policy(&mut self.store, self.handle, schema, table).await {
            Ok(p) => p,
            Err(e) => return Err(self.failure(e)),
        };
        self.policies.entry(schema.to_string()).or_default().insert(table.to_string(), policy);
        Ok(policy)
    }

    /// Decisions for change objects (JSON texts), one per change.
    pub async fn apply(&mut self, changes: &[&str]) -> Result<Vec<Decision>, String> {
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
        let called = filter.call_apply(&mut self.store, self.handle, &self.batch).await;
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

    pub fn name(&self) -> &str {
        &self.name
    }
}
