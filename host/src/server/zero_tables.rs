//! Zero's required tables in an initial sync served to zero-cache.
//!
//! zero-cache refuses an initial sync that lacks `<app>_<shard>.clients`,
//! `<app>_<shard>.mutations` (the custom-source flavour, with a `mutation`
//! json column) and `<app>.permissions` (one row, `lock` as its key). A
//! Postgres upstream set up for Zero has them, and Sluice passes them through
//! like any table. For any other upstream Sluice declares the missing ones
//! itself, for the app and shard the consumer asked for: `clients` and
//! `mutations` empty, and the permissions row from the operator's file
//! (`--zero-permissions`), or `NULL` permissions without one, which is what
//! zero-cache's own set-up writes before `zero-deploy-permissions` runs.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The permissions row's content: the rules (a JSON value, as json columns
/// travel) and their hash (which zero-cache compares to notice new rules).
#[derive(Debug, Clone, PartialEq)]
pub struct Permissions {
    pub rules: Value,
    pub hash: String,
}

impl Permissions {
    /// Reads and checks the operator's permissions file: Zero's compiled
    /// permissions, a JSON object such as `{"tables": {...}}`.
    pub fn from_file(path: &std::path::Path) -> anyhow::Result<Permissions> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading the Zero permissions file {}: {e}", path.display()))?;
        Permissions::parse(&text).map_err(|e| anyhow::anyhow!("the Zero permissions file {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Permissions> {
        let value: Value = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("not JSON: {e}"))?;
        anyhow::ensure!(value.is_object(), "expected a JSON object such as {{\"tables\": {{...}}}}");
        let hash = Sha256::digest(value.to_string().as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        Ok(Permissions { rules: value, hash })
    }
}

fn column(pos: u32, data_type: &str, not_null: bool) -> Value {
    json!({"pos": pos, "dataType": data_type, "notNull": not_null})
}

/// One table's declaration, its unique key index, and its rows, as the
/// `data` messages' bodies.
fn table(schema: &str, name: &str, columns: Value, key: &[&str], rows: Vec<Value>) -> Vec<String> {
    let index_columns: serde_json::Map<String, Value> = key.iter().map(|c| (c.to_string(), json!("ASC"))).collect();
    let relation = json!({"schema": schema, "name": name, "rowKey": {"columns": key, "type": "default"}});
    let mut out = vec![
        json!({"tag": "create-table", "spec": {"schema": schema, "name": name, "columns": columns, "primaryKey": key}})
            .to_string(),
        json!({"tag": "create-index", "spec": {
            "schema": schema, "name": format!("{name}_pkey"), "tableName": name,
            "unique": true, "columns": index_columns,
        }})
        .to_string(),
    ];
    out.extend(rows.into_iter().map(|new| json!({"tag": "insert", "relation": relation, "new": new}).to_string()));
    out
}

/// The `(schema, name)` a `create-table` change declares.
fn declared(change: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(change).ok()?;
    if v.get("tag")?.as_str()? != "create-table" {
        return None;
    }
    let spec = v.get("spec")?;
    Some((spec.get("schema")?.as_str()?.to_string(), spec.get("name")?.as_str()?.to_string()))
}

/// The changes that declare (and fill) whichever of Zero's required tables
/// `schema` (the table state's declarations) lacks, for `app_id` and
/// `shard_num`.
pub fn missing(schema: &[String], app_id: &str, shard_num: &str, permissions: Option<&Permissions>) -> Vec<String> {
    let have: Vec<(String, String)> = schema.iter().filter_map(|c| declared(c)).collect();
    let has = |s: &str, n: &str| have.iter().any(|(hs, hn)| hs == s && hn == n);
    let shard = format!("{app_id}_{shard_num}");
    let mut out = Vec::new();
    if !has(&shard, "clients") {
        let columns = json!({
            "clientGroupID": column(1, "text", true),
            "clientID": column(2, "text", true),
            "lastMutationID": column(3, "int8", true),
            "userID": column(4, "text", false),
        });
        out.extend(table(&shard, "clients", columns, &["clientGroupID", "clientID"], vec![]));
    }
    if !has(&shard, "mutations") {
        let columns = json!({
            "clientGroupID": column(1, "text", true),
            "clientID": column(2, "text", true),
            "mutationID": column(3, "int8", true),
            "mutation": column(4, "json", true),
        });
        out.extend(table(&shard, "mutations", columns, &["clientGroupID", "clientID", "mutationID"], vec![]));
    }
    if !has(app_id, "permissions") {
        let columns = json!({
            "permissions": column(1, "jsonb", false),
            "hash": column(2, "text", false),
            "lock": column(3, "bool", true),
        });
        let row = match permissions {
            Some(p) => json!({"permissions": p.rules, "hash": p.hash, "lock": true}),
            None => json!({"permissions": null, "hash": null, "lock": true}),
        };
        out.extend(table(app_id, "permissions", columns, &["lock"], vec![row]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(changes: &[String]) -> Vec<(String, String)> {
        changes.iter().filter_map(|c| declared(c)).collect()
    }

    #[test]
    fn all_three_are_declared_for_the_requested_app_and_shard() {
        let out = missing(&[], "app", "3", None);
        let names = tables(&out);
        assert_eq!(
            names,
            [
                ("app_3".into(), "clients".into()),
                ("app_3".into(), "mutations".into()),
                ("app".into(), "permissions".into())
            ]
        );
        // Each has a unique index over its key, which zero-cache requires.
        let indexes: Vec<Value> = out.iter().map(|c| serde_json::from_str::<Value>(c).unwrap()).collect();
        let unique = indexes.iter().filter(|c| c["tag"] == "create-index" && c["spec"]["unique"] == true).count();
        assert_eq!(unique, 3);
        // The custom flavour of mutations: a `mutation` json column.
        let mutations: Value = serde_json::from_str(&out[2]).unwrap();
        assert_eq!(mutations["spec"]["columns"]["mutation"]["dataType"], "json");
        // One permissions row, NULL without a file.
        let row: Value = serde_json::from_str(out.last().unwrap()).unwrap();
        assert_eq!(row["tag"], "insert");
        assert_eq!(row["new"], json!({"permissions": null, "hash": null, "lock": true}));
    }

    #[test]
    fn tables_the_upstream_has_pass_through() {
        let upstream = json!({"tag": "create-table", "spec": {"schema": "zero", "name": "permissions", "columns": {}}});
        let out = missing(&[upstream.to_string()], "zero", "0", None);
        assert_eq!(tables(&out).len(), 2);
        assert!(!out.iter().any(|c| c.contains("\"permissions\"")));
    }

    #[test]
    fn the_permissions_file_fills_the_row_and_its_hash_follows_the_rules() {
        let a = Permissions::parse(
            r#"{"tables": {"t": {"row": {"select": [["allow", {"type": "and", "conditions": []}]]}}}}"#,
        )
        .unwrap();
        let b = Permissions::parse(r#"{"tables": {}}"#).unwrap();
        assert_ne!(a.hash, b.hash);
        let out = missing(&[], "zero", "0", Some(&a));
        let row: Value = serde_json::from_str(out.last().unwrap()).unwrap();
        assert_eq!(row["new"]["permissions"], a.rules);
        assert_eq!(row["new"]["hash"], a.hash);
        let err = Permissions::parse("[1]").unwrap_err().to_string();
        assert!(err.contains("JSON object"), "{err}");
        assert!(Permissions::parse("{").unwrap_err().to_string().contains("not JSON"));
    }
}
