//! redact: drop columns, or replace their values with a mask or a keyed hash.
//!
//! Config:
//! ```json
//! {"tables": ["public.users"], "drop": ["password"], "mask": {"ssn": "***"},
//!  "hash": ["email"], "hash_key": "a secret"}
//! ```
//! `tables` are `schema.table` globs (default: every table). Dropped columns
//! leave rows and schema changes (`create-table`, `add-column`, ...), so a
//! replica never has them. Masked and hashed columns keep their name and
//! become text: the mask string, or the hex HMAC-SHA256 of the value's JSON
//! text under `hash_key` (equal values hash equally, so joins still work).
//! NULL stays NULL. Row-key columns are never redacted: a replica needs them
//! to find rows.

use filter_kit::{row_key, table_of, TablePatterns};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;

wit_bindgen::generate!({ path: "../../wit", world: "filter-plugin" });

use exports::sluice::plugin::filter::{Change, ChangeFilter, Decision, Guest, GuestChangeFilter, TablePolicy};
use sluice::plugin::types::PluginError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    tables: Vec<String>,
    #[serde(default)]
    drop: Vec<String>,
    #[serde(default)]
    mask: HashMap<String, String>,
    #[serde(default)]
    hash: Vec<String>,
    hash_key: Option<String>,
}

struct Redact {
    tables: TablePatterns,
    drop: Vec<String>,
    mask: HashMap<String, String>,
    hash: Vec<String>,
    key: Vec<u8>,
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(message).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Redact {
    /// Redacts one row object in place; returns whether anything changed.
    fn row(&self, row: &mut Value, keys: &[&str]) -> bool {
        let Some(row) = row.as_object_mut() else { return false };
        let mut changed = false;
        for c in self.drop.iter().filter(|c| !keys.contains(&c.as_str())) {
            changed |= row.remove(c).is_some();
        }
        for (c, mask) in self.mask.iter().filter(|(c, _)| !keys.contains(&c.as_str())) {
            if let Some(v) = row.get_mut(c).filter(|v| !v.is_null()) {
                *v = Value::String(mask.clone());
                changed = true;
            }
        }
        for c in self.hash.iter().filter(|c| !keys.contains(&c.as_str())) {
            if let Some(v) = row.get_mut(c).filter(|v| !v.is_null()) {
                *v = Value::String(hex(&hmac_sha256(&self.key, v.to_string().as_bytes())));
                changed = true;
            }
        }
        changed
    }

    fn rewritten(&self, name: &str) -> bool {
        self.mask.contains_key(name) || self.hash.iter().any(|h| h == name)
    }

    /// A column spec of a masked or hashed column becomes text.
    fn spec(&self, name: &str, spec: &mut Value) -> bool {
        if self.rewritten(name) && spec.get("dataType") != Some(&Value::String("text".into())) {
            spec["dataType"] = Value::String("text".into());
            return true;
        }
        false
    }

    fn decide(&self, change: &Change) -> Decision {
        let Ok(mut v) = serde_json::from_str::<Value>(&change.json) else { return Decision::Keep };
        if !table_of(&v).is_some_and(|(s, n)| self.tables.matches(s, n)) {
            return Decision::Keep;
        }
        let dropped = |c: &str| self.drop.iter().any(|d| d == c);
        let changed = match change.tag.as_str() {
            "insert" | "update" | "delete" => {
                let keys: Vec<String> = row_key(&v).0.iter().map(|s| s.to_string()).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let a = self.row(&mut v["new"], &keys);
                let b = self.row(&mut v["key"], &keys);
                a | b
            }
            "create-table" => {
                let keys: Vec<String> = v["spec"]["primaryKey"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|k| k.as_str().map(str::to_string)).collect())
                    .unwrap_or_default();
                let mut changed = false;
                if let Some(cols) = v["spec"]["columns"].as_object_mut() {
                    let before = cols.len();
                    cols.retain(|name, _| keys.contains(name) || !dropped(name));
                    changed |= cols.len() != before;
                    for (name, spec) in cols.iter_mut().filter(|(name, _)| !keys.contains(name)) {
                        changed |= self.spec(name, spec);
                    }
                }
                changed
            }
            "add-column" | "drop-column" => {
                let name = v["column"]["name"].as_str().or(v["column"].as_str()).unwrap_or("").to_string();
                if dropped(&name) {
                    return Decision::Drop;
                }
                self.spec(&name, &mut v["column"]["spec"])
            }
            "update-column" => {
                let old = v["old"]["name"].as_str().unwrap_or("").to_string();
                let new = v["new"]["name"].as_str().unwrap_or("").to_string();
                if dropped(&old) || dropped(&new) {
                    return Decision::Drop;
                }
                let a = self.spec(&old, &mut v["old"]["spec"]);
                let b = self.spec(&new, &mut v["new"]["spec"]);
                a | b
            }
            _ => false,
        };
        if changed {
            Decision::Replace(v.to_string())
        } else {
            Decision::Keep
        }
    }
}

struct Component;

impl Guest for Component {
    type ChangeFilter = Redact;

    fn create(config: String) -> Result<ChangeFilter, PluginError> {
        let c: Config = serde_json::from_str(&config).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        if !c.hash.is_empty() && c.hash_key.as_deref().unwrap_or("").is_empty() {
            return Err(PluginError::InvalidConfig("hash needs a non-empty hash_key".into()));
        }
        if c.drop.is_empty() && c.mask.is_empty() && c.hash.is_empty() {
            return Err(PluginError::InvalidConfig("nothing to redact: give drop, mask or hash".into()));
        }
        let tables = TablePatterns::new(c.tables, Vec::new()).map_err(PluginError::InvalidConfig)?;
        Ok(ChangeFilter::new(Redact {
            tables,
            drop: c.drop,
            mask: c.mask,
            hash: c.hash,
            key: c.hash_key.unwrap_or_default().into_bytes(),
        }))
    }
}

impl GuestChangeFilter for Redact {
    fn table_policy(&self, schema: String, name: String) -> TablePolicy {
        if self.tables.matches(&schema, &name) {
            TablePolicy::Inspect
        } else {
            TablePolicy::KeepAll
        }
    }

    fn apply(&self, batch: Vec<Change>) -> Vec<Decision> {
        batch.iter().map(|c| self.decide(c)).collect()
    }
}

export!(Component);
