//! table-filter: include or exclude tables by `schema.table` glob patterns.
//!
//! Config: `{"include": ["public.*"], "exclude": ["public.secret_*"]}` (both
//! optional; no include means every table). Row changes are decided per table
//! through `table-policy`, so they never cross the plugin boundary. Schema
//! changes follow the same rule; a table renamed out of the view becomes a
//! `drop-table`, and one renamed into it is dropped too (its rows were never
//! sent, so a replica could not have them). A truncate keeps only the
//! included tables. `drop-index` names no table and always passes.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::{table_name, table_of, Filter, Policy, TablePatterns, Verdict};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    include: Vec<String>,
    #[serde(default)]
    exclude: Vec<String>,
}

pub struct TableFilter {
    tables: TablePatterns,
}

impl TableFilter {
    fn keeps(&self, t: Option<(&str, &str)>) -> bool {
        t.is_none_or(|(s, n)| self.tables.matches(s, n))
    }

    fn verdict(&self, tag: &str, json: &str) -> Verdict {
        let Ok(v) = serde_json::from_str::<Value>(json) else { return Verdict::Keep };
        match tag {
            "truncate" => {
                let all = v["relations"].as_array().cloned().unwrap_or_default();
                let kept: Vec<Value> = all.iter().filter(|r| self.keeps(table_name(r))).cloned().collect();
                if kept.is_empty() {
                    Verdict::Drop
                } else if kept.len() == all.len() {
                    Verdict::Keep
                } else {
                    Verdict::Replace(json!({"tag": "truncate", "relations": kept}).to_string())
                }
            }
            "rename-table" => match (self.keeps(table_name(&v["old"])), self.keeps(table_name(&v["new"]))) {
                (true, true) => Verdict::Keep,
                (true, false) => Verdict::Replace(json!({"tag": "drop-table", "id": v["old"]}).to_string()),
                (false, _) => Verdict::Drop,
            },
            _ => {
                if self.keeps(table_of(&v)) {
                    Verdict::Keep
                } else {
                    Verdict::Drop
                }
            }
        }
    }
}

impl Filter for TableFilter {
    fn from_config(config: &str) -> Result<Self, String> {
        let c: Config = serde_json::from_str(config).map_err(|e| e.to_string())?;
        Ok(TableFilter { tables: TablePatterns::new(c.include, c.exclude)? })
    }

    fn policy(&self, schema: &str, table: &str) -> Policy {
        if self.tables.matches(schema, table) {
            Policy::KeepAll
        } else {
            Policy::DropAll
        }
    }

    fn decide(&self, tag: &str, json: &str) -> Verdict {
        self.verdict(tag, json)
    }
}
