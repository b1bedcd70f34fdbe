//! Shared pieces of the bundled filter plugins: `schema.table` glob patterns,
//! reading Zero's change objects (the JSON a filter receives), the three
//! bundled filters as plain Rust (so they are tested and benchmarked natively
//! too), and [`export_filter!`], the WIT glue that turns one into a plugin.

pub mod redact;
pub mod row;
pub mod table;

/// The JSON scanner and tag reader, shared with the host.
pub use json_scan as scan;
pub use json_scan::tag_of;

use serde::Deserialize;
use serde_json::Value;

/// How a filter treats one table's row changes (the WIT `table-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    KeepAll,
    DropAll,
    Inspect,
}

/// What becomes of one change (the WIT `decision`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    Drop,
    Replace(String),
}

/// A filter's logic, independent of the plugin boundary.
pub trait Filter: Sized {
    /// Builds the filter from the subscriber's configuration (JSON text).
    fn from_config(config: &str) -> Result<Self, String>;
    fn policy(&self, schema: &str, table: &str) -> Policy;
    /// Decides one change object (`tag` and its JSON text).
    fn decide(&self, tag: &str, json: &str) -> Verdict;
    /// The columns the filter judges rows by (the WIT `row-columns`), if it
    /// reads only a few: the host then finds their values for it.
    fn row_columns(&self) -> Option<Vec<String>> {
        None
    }
    /// Decides one change with the host's spans of [`Filter::row_columns`]
    /// in it ([`scan::ColumnLocator`]'s layout: four numbers per column).
    fn decide_located(&self, tag: &str, json: &str, _spans: &[u32]) -> Verdict {
        self.decide(tag, json)
    }
}

/// Exports a [`Filter`] as a `filter-plugin` component. Invoke it once at the
/// root of a `cdylib` crate in `plugins/` (the WIT path is relative to it).
#[macro_export]
macro_rules! export_filter {
    ($filter:ty) => {
        wit_bindgen::generate!({ path: "../../wit", world: "filter-plugin" });

        use exports::sluice::plugin::filter::{Batch, ChangeFilter, Decision, Guest, GuestChangeFilter, TablePolicy};
        use sluice::plugin::types::PluginError;

        struct Component;
        /// The filter and how many `row-columns` it named.
        struct Instance($filter, usize);

        impl Guest for Component {
            type ChangeFilter = Instance;
            fn create(config: String) -> Result<ChangeFilter, PluginError> {
                let filter = <$filter as $crate::Filter>::from_config(&config).map_err(PluginError::InvalidConfig)?;
                let columns = $crate::Filter::row_columns(&filter).map_or(0, |c| c.len());
                Ok(ChangeFilter::new(Instance(filter, columns)))
            }
        }

        impl GuestChangeFilter for Instance {
            fn table_policy(&self, schema: String, name: String) -> TablePolicy {
                match $crate::Filter::policy(&self.0, &schema, &name) {
                    $crate::Policy::KeepAll => TablePolicy::KeepAll,
                    $crate::Policy::DropAll => TablePolicy::DropAll,
                    $crate::Policy::Inspect => TablePolicy::Inspect,
                }
            }
            fn row_columns(&self) -> Option<Vec<String>> {
                $crate::Filter::row_columns(&self.0)
            }
            fn apply(&self, batch: Batch) -> Vec<Decision> {
                let per_change = 4 * self.1;
                // Sized up front: a collected `map_while` would grow step by step.
                let mut decisions = Vec::with_capacity(batch.ends.len());
                decisions.extend($crate::split(&batch.texts, &batch.ends)
                    .enumerate()
                    .map(|(i, json)| {
                        let tag = $crate::tag_of(json);
                        let verdict = if per_change == 0 {
                            $crate::Filter::decide(&self.0, tag, json)
                        } else {
                            let spans = batch.spans.get(i * per_change..(i + 1) * per_change).unwrap_or(&[]);
                            $crate::Filter::decide_located(&self.0, tag, json, spans)
                        };
                        match verdict {
                            $crate::Verdict::Keep => Decision::Keep,
                            $crate::Verdict::Drop => Decision::Drop,
                            $crate::Verdict::Replace(text) => Decision::Replace(text),
                        }
                    }));
                decisions
            }
        }

        export!(Component);
    };
}

/// `*` matches any run of characters, `?` any one character.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Include / exclude patterns over `schema.table`. With no include pattern
/// every table is included; an exclude pattern wins over an include.
#[derive(Debug, Clone, Default)]
pub struct TablePatterns {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl TablePatterns {
    /// Checks that each pattern has the `schema.table` form.
    pub fn new(include: Vec<String>, exclude: Vec<String>) -> Result<Self, String> {
        for p in include.iter().chain(&exclude) {
            if !p.contains('.') {
                return Err(format!("table pattern {p:?} must have the form schema.table (globs * and ? allowed)"));
            }
        }
        Ok(TablePatterns { include, exclude })
    }

    pub fn matches(&self, schema: &str, table: &str) -> bool {
        let full = format!("{schema}.{table}");
        let included = self.include.is_empty() || self.include.iter().any(|p| glob_match(p, &full));
        included && !self.exclude.iter().any(|p| glob_match(p, &full))
    }
}

/// The row-key columns named by a relation's raw JSON.
pub fn key_columns(relation: &str) -> Vec<String> {
    #[derive(Deserialize)]
    struct RowKey {
        #[serde(default)]
        columns: Vec<String>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Rel {
        row_key: RowKey,
    }
    serde_json::from_str::<Rel>(relation).map(|r| r.row_key.columns).unwrap_or_default()
}

/// The change texts of a batch (`texts` cut at `ends`); a bad offset ends
/// the iteration early, which the host reports as a wrong decision count.
pub fn split<'a>(texts: &'a str, ends: &'a [u32]) -> impl Iterator<Item = &'a str> + 'a {
    let mut start = 0usize;
    ends.iter().map_while(move |&end| {
        let piece = texts.get(start..end as usize)?;
        start = end as usize;
        Some(piece)
    })
}

/// `{"schema":..,"name":..}` as a pair.
pub fn table_name(v: &Value) -> Option<(&str, &str)> {
    Some((v.get("schema")?.as_str()?, v.get("name")?.as_str()?))
}

/// The table a row or schema change is about, where it names exactly one.
pub fn table_of(change: &Value) -> Option<(&str, &str)> {
    match change.get("tag")?.as_str()? {
        "insert" | "update" | "delete" => table_name(change.get("relation")?),
        "create-table" => table_name(change.get("spec")?),
        "drop-table" => table_name(change.get("id")?),
        "add-column" | "update-column" | "drop-column" => table_name(change.get("table")?),
        "create-index" => {
            let spec = change.get("spec")?;
            Some((spec.get("schema")?.as_str()?, spec.get("tableName")?.as_str()?))
        }
        _ => None,
    }
}

/// The row key columns of a row change's relation, and its replica identity.
pub fn row_key(change: &Value) -> (Vec<&str>, &str) {
    let key = &change["relation"]["rowKey"];
    let columns = key["columns"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    (columns, key["type"].as_str().unwrap_or("default"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("public.*", "public.items"));
        assert!(glob_match("*.audit_?", "app.audit_1"));
        assert!(!glob_match("*.audit_?", "app.audit_12"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("public.items", "public.itemsx"));
    }

    #[test]
    fn patterns() {
        let p = TablePatterns::new(vec!["public.*".into()], vec!["public.secret_*".into()]).unwrap();
        assert!(p.matches("public", "items"));
        assert!(!p.matches("public", "secret_keys"));
        assert!(!p.matches("other", "items"));
        assert!(TablePatterns::new(vec!["items".into()], vec![]).is_err());
        assert!(TablePatterns::default().matches("any", "thing"));
    }

    #[test]
    fn tables_of_changes() {
        let v: Value =
            serde_json::from_str(r#"{"tag":"create-index","spec":{"schema":"s","name":"i","tableName":"t"}}"#).unwrap();
        assert_eq!(table_of(&v), Some(("s", "t")));
        let v: Value = serde_json::from_str(r#"{"tag":"drop-index","id":{"schema":"s","name":"i"}}"#).unwrap();
        assert_eq!(table_of(&v), None);
    }
}
