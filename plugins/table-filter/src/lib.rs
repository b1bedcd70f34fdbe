//! table-filter: include or exclude tables by `schema.table` glob patterns.
//!
//! Config: `{"include": ["public.*"], "exclude": ["public.secret_*"]}` (both
//! optional; no include means every table). Row changes are decided per table
//! through `table-policy`, so they never cross the plugin boundary. Schema
//! changes follow the same rule; a table renamed out of the view becomes a
//! `drop-table`, and one renamed into it is dropped too (its rows were never
//! sent, so a replica could not have them). A truncate keeps only the
//! included tables. `drop-index` names no table and always passes.

use filter_kit::{table_name, table_of, TablePatterns};
use serde::Deserialize;
use serde_json::{json, Value};

wit_bindgen::generate!({ path: "../../wit", world: "filter-plugin" });

use exports::sluice::plugin::filter::{Change, ChangeFilter, Decision, Guest, GuestChangeFilter, TablePolicy};
use sluice::plugin::types::PluginError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    include: Vec<String>,
    #[serde(default)]
    exclude: Vec<String>,
}

struct TableFilter {
    tables: TablePatterns,
}

impl TableFilter {
    fn keeps(&self, t: Option<(&str, &str)>) -> bool {
        t.is_none_or(|(s, n)| self.tables.matches(s, n))
    }

    fn decide(&self, change: &Change) -> Decision {
        let Ok(v) = serde_json::from_str::<Value>(&change.json) else { return Decision::Keep };
        match change.tag.as_str() {
            "truncate" => {
                let all = v["relations"].as_array().cloned().unwrap_or_default();
                let kept: Vec<Value> = all.iter().filter(|r| self.keeps(table_name(r))).cloned().collect();
                if kept.is_empty() {
                    Decision::Drop
                } else if kept.len() == all.len() {
                    Decision::Keep
                } else {
                    Decision::Replace(json!({"tag": "truncate", "relations": kept}).to_string())
                }
            }
            "rename-table" => match (self.keeps(table_name(&v["old"])), self.keeps(table_name(&v["new"]))) {
                (true, true) => Decision::Keep,
                (true, false) => Decision::Replace(json!({"tag": "drop-table", "id": v["old"]}).to_string()),
                (false, _) => Decision::Drop,
            },
            _ => {
                if self.keeps(table_of(&v)) {
                    Decision::Keep
                } else {
                    Decision::Drop
                }
            }
        }
    }
}

struct Component;

impl Guest for Component {
    type ChangeFilter = TableFilter;

    fn create(config: String) -> Result<ChangeFilter, PluginError> {
        let c: Config = serde_json::from_str(&config).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        let tables = TablePatterns::new(c.include, c.exclude).map_err(PluginError::InvalidConfig)?;
        Ok(ChangeFilter::new(TableFilter { tables }))
    }
}

impl GuestChangeFilter for TableFilter {
    fn table_policy(&self, schema: String, name: String) -> TablePolicy {
        if self.tables.matches(&schema, &name) {
            TablePolicy::KeepAll
        } else {
            TablePolicy::DropAll
        }
    }

    fn apply(&self, batch: Vec<Change>) -> Vec<Decision> {
        batch.iter().map(|c| self.decide(c)).collect()
    }
}

export!(Component);
