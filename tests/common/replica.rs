//! An in-memory replica built from a subscriber's stream, to compare row by
//! row with an upstream's tables.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

/// A subscriber over a WebSocket from `replica_version`, applying what it
/// receives to a new [`Replica`].
pub async fn follow(addr: &str, replica_version: &str) -> Arc<Mutex<Replica>> {
    let replica = Arc::new(Mutex::new(Replica::default()));
    let mut client = super::ws::Client::subscribe_at(addr, replica_version, replica_version).await;
    let r = replica.clone();
    tokio::spawn(async move {
        while let Some(m) = client.next().await {
            r.lock().unwrap().apply(&m);
        }
    });
    replica
}

/// The replica version a host reports, once it has one.
pub async fn replica_version(status: &sluice::status::Status, wait: Duration) -> String {
    super::wait_until("a replica version", wait, || {
        let rv = status.snapshot().replica_version;
        async move { rv.is_some() }
    })
    .await;
    status.snapshot().replica_version.unwrap_or_default()
}

pub fn key_of(row: &Value, columns: &[String]) -> String {
    let key: serde_json::Map<String, Value> =
        columns.iter().map(|c| (c.clone(), row.get(c).cloned().unwrap_or(Value::Null))).collect();
    Value::Object(key).to_string()
}

/// What a subscriber built from the stream: tables of rows, the commits in
/// order, and the raw text of every data change.
#[derive(Default, Clone)]
pub struct Replica {
    pub tables: HashMap<String, BTreeMap<String, Value>>,
    pub commits: Vec<String>,
    /// The commit objects, in order (what a source added to them included).
    pub commit_bodies: Vec<Value>,
    pub rollbacks: usize,
    pub pending: Vec<Value>,
    pub raw: Vec<String>,
    pub schema_changes: Vec<String>,
    pub in_tx: bool,
    pub problems: Vec<String>,
}

pub fn table_of(v: &Value) -> String {
    format!("{}.{}", v["schema"].as_str().unwrap_or(""), v["name"].as_str().unwrap_or(""))
}

impl Replica {
    pub fn apply(&mut self, text: &str) {
        let msg: Value = serde_json::from_str(text).unwrap();
        match msg[0].as_str().unwrap() {
            "begin" => {
                if self.in_tx {
                    self.problems.push("begin inside a transaction".into());
                }
                self.in_tx = true;
            }
            "data" => {
                self.raw.push(text.to_string());
                self.pending.push(msg[1].clone());
            }
            "rollback" => {
                self.in_tx = false;
                self.rollbacks += 1;
                self.pending.clear();
            }
            "commit" => {
                self.in_tx = false;
                let w = msg[2]["watermark"].as_str().unwrap().to_string();
                if self.commits.last().is_some_and(|last| *last >= w) {
                    self.problems.push(format!("commit {w} after {:?}", self.commits.last()));
                }
                self.commits.push(w);
                self.commit_bodies.push(msg[1].clone());
                for change in std::mem::take(&mut self.pending) {
                    self.change(&change);
                }
            }
            _ => {}
        }
    }

    fn change(&mut self, c: &Value) {
        let tag = c["tag"].as_str().unwrap();
        let keys = |c: &Value| -> Vec<String> {
            c["relation"]["rowKey"]["columns"]
                .as_array()
                .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
                .unwrap_or_default()
        };
        match tag {
            "insert" => {
                let t = table_of(&c["relation"]);
                let key = key_of(&c["new"], &keys(c));
                self.tables.entry(t).or_default().insert(key, c["new"].clone());
            }
            "update" => {
                let t = self.tables.entry(table_of(&c["relation"])).or_default();
                let cols = keys(c);
                let new_key = key_of(&c["new"], &cols);
                let old_key = if c["key"].is_null() { new_key.clone() } else { key_of(&c["key"], &cols) };
                let mut row = t.remove(&old_key).unwrap_or_else(|| json!({}));
                for (k, v) in c["new"].as_object().unwrap() {
                    row[k] = v.clone();
                }
                t.insert(new_key, row);
            }
            "delete" => {
                let t = self.tables.entry(table_of(&c["relation"])).or_default();
                t.remove(&key_of(&c["key"], &keys(c)));
            }
            "truncate" => {
                for r in c["relations"].as_array().unwrap() {
                    self.tables.remove(&table_of(r));
                }
            }
            other => {
                self.schema_changes.push(other.to_string());
                match other {
                    "drop-table" => {
                        self.tables.remove(&table_of(&c["id"]));
                    }
                    "rename-table" => {
                        if let Some(rows) = self.tables.remove(&table_of(&c["old"])) {
                            self.tables.insert(table_of(&c["new"]), rows);
                        }
                    }
                    "update-column" => {
                        let (from, to) = (c["old"]["name"].as_str().unwrap(), c["new"]["name"].as_str().unwrap());
                        for row in self.tables.entry(table_of(&c["table"])).or_default().values_mut() {
                            let row = row.as_object_mut().unwrap();
                            if let Some(v) = row.remove(from) {
                                row.insert(to.to_string(), v);
                            }
                        }
                    }
                    "add-column" => {
                        // Existing rows take the default; the tests only use
                        // text literals ('x'::text).
                        let name = c["column"]["name"].as_str().unwrap();
                        let dflt = c["column"]["spec"]["dflt"]
                            .as_str()
                            .and_then(|d| d.strip_prefix('\'')?.split_once("'::").map(|(v, _)| json!(v)))
                            .unwrap_or(Value::Null);
                        for row in self.tables.entry(table_of(&c["table"])).or_default().values_mut() {
                            row.as_object_mut().unwrap().entry(name).or_insert(dflt.clone());
                        }
                    }
                    "drop-column" => {
                        let col = c["column"].as_str().unwrap();
                        for row in self.tables.entry(table_of(&c["table"])).or_default().values_mut() {
                            row.as_object_mut().unwrap().remove(col);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    pub fn rows(&self, table: &str) -> BTreeMap<String, Value> {
        self.tables.get(table).cloned().unwrap_or_default()
    }
}

/// Waits until the replica's copy of each table equals the upstream's.
pub async fn converge<F, Fut>(replica: &Arc<Mutex<Replica>>, tables: &[&str], wait: Duration, mut upstream_rows: F)
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = BTreeMap<String, Value>>,
{
    let r = replica.clone();
    super::wait_until("the initial snapshot", wait, || {
        let snapshot_in = !r.lock().unwrap().commits.is_empty();
        async move { snapshot_in }
    })
    .await;
    let deadline = std::time::Instant::now() + wait;
    loop {
        let mut same = true;
        for t in tables {
            let expected = upstream_rows(t.to_string()).await;
            let got = replica.lock().unwrap().rows(t);
            if expected != got {
                same = false;
                if std::time::Instant::now() > deadline {
                    let diff: Vec<_> = expected
                        .iter()
                        .filter(|(k, v)| got.get(*k) != Some(v))
                        .map(|(k, v)| format!("{k}: upstream {v} replica {:?}", got.get(k)))
                        .take(5)
                        .collect();
                    panic!(
                        "{t} never converged: upstream {} rows, replica {} rows; first differences: {diff:#?}",
                        expected.len(),
                        got.len()
                    );
                }
            }
        }
        if same {
            let r = replica.lock().unwrap();
            assert!(r.problems.is_empty(), "{:?}", r.problems);
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
