//! bad-filter: a filter that misbehaves on purpose, so the tests can check
//! that only the subscriptions using it are closed.
//!
//! Config: `{"mode": "trap" | "hang" | "oom" | "wrong-count" | "not-json" |
//! "reject" | "many-columns", "after": N}`: keeps the first N changes it
//! sees, then misbehaves (`reject` refuses the configuration at create,
//! `many-columns` names more `row-columns` than the host accepts).

use std::cell::Cell;

use serde::Deserialize;

// The raw world, not `export_filter!`: this filter breaks the contract in
// ways the SDK would not let it.
use sluice_plugin_sdk::filter_world::exports::sluice::plugin::filter::{
    Batch, ChangeFilter, Decision, Guest, GuestChangeFilter, TablePolicy,
};
use sluice_plugin_sdk::types::PluginError;

#[derive(Deserialize)]
struct Config {
    mode: String,
    #[serde(default)]
    after: u64,
}

struct Bad {
    mode: String,
    after: u64,
    seen: Cell<u64>,
}

struct Component;

impl Guest for Component {
    type ChangeFilter = Bad;

    fn create(config: String) -> Result<ChangeFilter, PluginError> {
        let c: Config = serde_json::from_str(&config).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        if c.mode == "reject" {
            return Err(PluginError::InvalidConfig("this configuration is refused on purpose".into()));
        }
        Ok(ChangeFilter::new(Bad { mode: c.mode, after: c.after, seen: Cell::new(0) }))
    }
}

impl GuestChangeFilter for Bad {
    fn table_policy(&self, _schema: String, _name: String) -> TablePolicy {
        TablePolicy::Inspect
    }

    fn row_columns(&self) -> Option<Vec<String>> {
        (self.mode == "many-columns").then(|| (0..1000).map(|i| format!("c{i}")).collect())
    }

    fn apply(&self, batch: Batch) -> Vec<Decision> {
        let batch: Vec<()> = batch.ends.iter().map(|_| ()).collect();
        let seen = self.seen.get() + batch.len() as u64;
        self.seen.set(seen);
        if seen <= self.after {
            return batch.iter().map(|_| Decision::Keep).collect();
        }
        match self.mode.as_str() {
            "trap" => panic!("bad-filter traps on purpose"),
            "hang" => loop {
                std::hint::spin_loop();
            },
            "oom" => {
                let mut hog: Vec<Vec<u8>> = Vec::new();
                loop {
                    hog.push(vec![1u8; 1 << 20]);
                }
            }
            "wrong-count" => Vec::new(),
            "not-json" => batch.iter().map(|_| Decision::Replace("not json".into())).collect(),
            _ => batch.iter().map(|_| Decision::Keep).collect(),
        }
    }
}

sluice_plugin_sdk::filter_world::export_filter_world!(Component with_types_in sluice_plugin_sdk::filter_world);
