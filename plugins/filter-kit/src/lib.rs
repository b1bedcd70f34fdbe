//! The bundled filter plugins as plain Rust (so they are tested and
//! benchmarked natively too) and what they share: `schema.table` glob
//! patterns and reading Zero's change objects (the JSON a filter receives).
//! Each is a [`Filter`] of the plugin SDK; its plugin crate is one
//! `sluice_plugin_sdk::export_filter!` line.

pub mod redact;
pub mod row;
pub mod table;

/// The filter trait and its answers, from the plugin SDK.
pub use sluice_plugin_sdk::filter::split;
pub use sluice_plugin_sdk::scan;
pub use sluice_plugin_sdk::scan::tag_of;
pub use sluice_plugin_sdk::{Filter, Policy, Verdict};

use serde::Deserialize;
use serde_json::Value;

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
