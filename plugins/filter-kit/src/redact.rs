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

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{scan, table_of, Filter, Policy, TablePatterns, Verdict};

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

pub struct Redact {
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

    /// A row change redacted on its raw JSON: only the row objects are taken
    /// apart, and only into (key, raw value) pairs. `None`: not parseable so,
    /// the caller takes the general path.
    fn row_change(&self, tag: &str, json: &str) -> Option<Verdict> {
        let c = scan::row_parts(json)?;
        let keys = crate::key_columns(c.relation);
        let (new, a) = self.raw_row(c.new, &keys)?;
        let (key, b) = self.raw_row(c.key, &keys)?;
        if !(a || b) {
            return Some(Verdict::Keep);
        }
        let mut out = String::with_capacity(json.len());
        out.push_str("{\"tag\":");
        out.push_str(&serde_json::to_string(tag).ok()?);
        out.push_str(",\"relation\":");
        out.push_str(c.relation);
        if tag != "insert" {
            out.push_str(",\"key\":");
            out.push_str(key.as_deref().unwrap_or("null"));
        }
        if let Some(new) = new {
            out.push_str(",\"new\":");
            out.push_str(&new);
        }
        out.push('}');
        Some(Verdict::Replace(out))
    }

    /// One row object rebuilt without dropped columns and with masked and
    /// hashed values; and whether anything changed.
    fn raw_row(&self, raw: Option<&str>, keys: &[String]) -> Option<(Option<String>, bool)> {
        let Some(raw) = raw else { return Some((None, false)) };
        let mut changed = false;
        let mut out = String::with_capacity(raw.len());
        out.push('{');
        for (raw_key, v) in scan::members(raw)? {
            let k = scan::key_text(raw_key)?;
            let protected = keys.iter().any(|c| *c == *k);
            let null = v == "null";
            if !protected && self.drop.iter().any(|d| *d == *k) {
                changed = true;
                continue;
            }
            let replacement = if protected || null {
                None
            } else if let Some(mask) = self.mask.get(&*k) {
                Some(serde_json::to_string(mask).ok()?)
            } else if self.hash.iter().any(|h| *h == *k) {
                Some(format!("\"{}\"", hex(&hmac_sha256(&self.key, v.as_bytes()))))
            } else {
                None
            };
            if out.len() > 1 {
                out.push(',');
            }
            // The key as it was written (escapes included).
            out.push('"');
            out.push_str(raw_key);
            out.push_str("\":");
            match replacement {
                Some(r) => {
                    changed = true;
                    out.push_str(&r);
                }
                None => out.push_str(v),
            }
        }
        out.push('}');
        Some((Some(out), changed))
    }

    fn verdict(&self, tag: &str, json: &str) -> Verdict {
        if matches!(tag, "insert" | "update" | "delete") {
            return self.row_change(tag, json).unwrap_or(Verdict::Keep);
        }
        let Ok(mut v) = serde_json::from_str::<Value>(json) else { return Verdict::Keep };
        if !table_of(&v).is_some_and(|(s, n)| self.tables.matches(s, n)) {
            return Verdict::Keep;
        }
        let dropped = |c: &str| self.drop.iter().any(|d| d == c);
        let changed = match tag {
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
                    return Verdict::Drop;
                }
                self.spec(&name, &mut v["column"]["spec"])
            }
            "update-column" => {
                let old = v["old"]["name"].as_str().unwrap_or("").to_string();
                let new = v["new"]["name"].as_str().unwrap_or("").to_string();
                if dropped(&old) || dropped(&new) {
                    return Verdict::Drop;
                }
                let a = self.spec(&old, &mut v["old"]["spec"]);
                let b = self.spec(&new, &mut v["new"]["spec"]);
                a | b
            }
            _ => false,
        };
        if changed {
            Verdict::Replace(v.to_string())
        } else {
            Verdict::Keep
        }
    }
}

impl Filter for Redact {
    fn from_config(config: &str) -> Result<Self, String> {
        let c: Config = serde_json::from_str(config).map_err(|e| e.to_string())?;
        if !c.hash.is_empty() && c.hash_key.as_deref().unwrap_or("").is_empty() {
            return Err("hash needs a non-empty hash_key".into());
        }
        if c.drop.is_empty() && c.mask.is_empty() && c.hash.is_empty() {
            return Err("nothing to redact: give drop, mask or hash".into());
        }
        Ok(Redact {
            tables: TablePatterns::new(c.tables, Vec::new())?,
            drop: c.drop,
            mask: c.mask,
            hash: c.hash,
            key: c.hash_key.unwrap_or_default().into_bytes(),
        })
    }

    fn policy(&self, schema: &str, table: &str) -> Policy {
        if self.tables.matches(schema, table) {
            Policy::Inspect
        } else {
            Policy::KeepAll
        }
    }

    fn decide(&self, tag: &str, json: &str) -> Verdict {
        self.verdict(tag, json)
    }
}
