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

use std::cell::RefCell;
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
    /// Each masked column's mask as a JSON string, encoded once.
    mask: HashMap<String, String>,
    hash: Vec<String>,
    hmac: Hmac,
    /// The row-key columns of recent relations, by their raw text.
    keys: RefCell<RecentKeys>,
}

/// The row-key columns of the last few relations seen: a stream runs over a
/// handful of tables at a time, so most rows skip parsing their relation.
#[derive(Default)]
struct RecentKeys {
    entries: Vec<(String, Vec<String>)>,
    next: usize,
}

impl RecentKeys {
    const SIZE: usize = 8;

    fn of(&mut self, relation: &str) -> &[String] {
        let found = self.entries.iter().position(|(r, _)| scan::same(r.as_bytes(), relation.as_bytes()));
        let i = found.unwrap_or_else(|| {
            let entry = (relation.to_string(), crate::key_columns(relation));
            if self.entries.len() < Self::SIZE {
                self.entries.push(entry);
                self.entries.len() - 1
            } else {
                let i = self.next;
                self.entries[i] = entry;
                self.next = (i + 1) % Self::SIZE;
                i
            }
        });
        &self.entries[i].1
    }
}

/// HMAC-SHA256 under one key, with the padded key blocks hashed once.
struct Hmac {
    inner: Sha256,
    outer: Sha256,
}

impl Hmac {
    fn new(key: &[u8]) -> Hmac {
        let mut k = [0u8; 64];
        if key.len() > 64 {
            k[..32].copy_from_slice(&Sha256::digest(key));
        } else {
            k[..key.len()].copy_from_slice(key);
        }
        let padded = |b: u8| Sha256::new().chain_update(k.map(|x| x ^ b));
        Hmac { inner: padded(0x36), outer: padded(0x5c) }
    }

    fn sign(&self, message: &[u8]) -> [u8; 32] {
        let inner = self.inner.clone().chain_update(message).finalize();
        self.outer.clone().chain_update(inner).finalize().into()
    }
}

/// `bytes` in lower-case hex, as a JSON string.
fn hex_string(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len() + 2);
    out.push('"');
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out.push('"');
    out
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
        let mut recent = self.keys.borrow_mut();
        let keys = recent.of(c.relation);
        let (new, a) = self.raw_row(c.new, keys)?;
        let (key, b) = self.raw_row(c.key, keys)?;
        if !(a || b) {
            return Some(Verdict::Keep);
        }
        let mut out = String::with_capacity(json.len());
        // `tag` is insert, update or delete: no escaping needed.
        out.push_str("{\"tag\":\"");
        out.push_str(tag);
        out.push_str("\",\"relation\":");
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
        // Walked, not collected: a malformed member ends it all with `None`.
        for member in scan::Members::of(raw)? {
            let (raw_key, v) = member.ok()?;
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
                Some(mask.clone())
            } else if self.hash.iter().any(|h| *h == *k) {
                Some(hex_string(&self.hmac.sign(v.as_bytes())))
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
        let mask = c
            .mask
            .into_iter()
            .map(|(column, text)| serde_json::to_string(&text).map(|json| (column, json)))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Redact {
            tables: TablePatterns::new(c.tables, Vec::new())?,
            drop: c.drop,
            mask,
            hash: c.hash,
            hmac: Hmac::new(c.hash_key.unwrap_or_default().as_bytes()),
            keys: RefCell::default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        hex_string(bytes).trim_matches('"').to_string()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2, and test case 6 (a key longer than a block).
        let h = Hmac::new(b"Jefe").sign(b"what do ya want for nothing?");
        assert_eq!(hex(&h), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        let h = Hmac::new(&[0xaa; 131]).sign(b"Test Using Larger Than Block-Size Key - Hash Key First");
        assert_eq!(hex(&h), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn rows_of_two_tables_keep_their_own_keys() {
        let r = Redact::from_config(r#"{"drop":["a"],"mask":{"b":"x\"y"},"hash":["c"],"hash_key":"Jefe"}"#).unwrap();
        let row = |table: &str, key: &str| {
            format!(
                r#"{{"tag":"insert","relation":{{"schema":"public","name":"{table}","rowKey":{{"columns":["{key}"]}}}},"new":{{"a":1,"b":2,"c":"v"}}}}"#
            )
        };
        let sign = hex_string(&Hmac::new(b"Jefe").sign(br#""v""#));
        let expect = |table: &str, key: &str, new: &str| {
            Verdict::Replace(format!(
                r#"{{"tag":"insert","relation":{{"schema":"public","name":"{table}","rowKey":{{"columns":["{key}"]}}}},"new":{new}}}"#
            ))
        };
        // The relation memo must follow the relation: `a` is the key of t1
        // (kept), not of t2 (dropped), and again of t1; and after the memo
        // has turned over.
        let t1 = || expect("t1", "a", &format!(r#"{{"a":1,"b":"x\"y","c":{sign}}}"#));
        assert_eq!(r.decide("insert", &row("t1", "a")), t1());
        assert_eq!(r.decide("insert", &row("t2", "b")), expect("t2", "b", &format!(r#"{{"b":2,"c":{sign}}}"#)));
        assert_eq!(r.decide("insert", &row("t1", "a")), t1());
        for t in 0..2 * RecentKeys::SIZE {
            let other = format!("o{t}");
            assert_eq!(r.decide("insert", &row(&other, "c")), expect(&other, "c", r#"{"b":"x\"y","c":"v"}"#));
        }
        assert_eq!(r.decide("insert", &row("t1", "a")), t1());
    }
}
