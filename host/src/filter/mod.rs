//! Subscriber filters: per-subscriber views of the stream, computed by filter
//! plugins (`wit/sluice.wit`, world `filter-plugin`).
//!
//! A subscriber names a chain of filters (`filters=[{"plugin":..,"config":..}]`
//! on the changes endpoint). Subscribers with the same chain share one
//! [`FilterGroup`]: one instance of each filter, and a cache of the outcome of
//! each live change, so a change forwarded to a hundred subscribers of one
//! chain is evaluated once. Filtering happens where frames leave for the
//! socket, so catch-up and live changes take the same path and a subscriber
//! sees the same view whichever way a change reached it.

mod route;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock, Weak};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use async_trait::async_trait;
pub use route::{route, Route};
pub use sluice_contract::filter::{Decision, TablePolicy};

/// One filter of a chain, created from one configuration. In Sluice it is a
/// filter plugin instance (`plugin::WasmFilter`); the group below only needs
/// these calls.
#[async_trait]
pub trait ChangeFilter: Send {
    /// The plugin's name, for errors and logs.
    fn name(&self) -> &str;
    /// What the filter does with the row changes of a table.
    async fn policy(&mut self, schema: &str, table: &str) -> Result<TablePolicy, String>;
    /// One decision per change object (JSON text), in order.
    async fn apply(&mut self, changes: &[&str]) -> Result<Vec<Decision>, String>;
}

/// Where filters come from: the plugin directory (`plugin::FilterPlugins`).
#[async_trait]
pub trait FilterFactory: Send + Sync {
    /// A filter `plugin` configured with `config` (a JSON text), or an error
    /// naming the plugin and the cause.
    async fn create(&self, plugin: &str, config: &str) -> Result<Box<dyn ChangeFilter>, String>;

    /// Which version of `plugin` [`FilterFactory::create`] would use now
    /// (plugins can be replaced while Sluice runs): a group is shared only
    /// by subscriptions made with the same versions.
    async fn generation(&self, _plugin: &str) -> Option<u64> {
        None
    }
}

/// One filter of a chain, as a subscriber asks for it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FilterSpec {
    pub plugin: String,
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// Parses the `filters` query parameter: a JSON array of filter specs.
pub fn parse_specs(text: &str) -> Result<Vec<FilterSpec>, String> {
    let specs: Vec<FilterSpec> = serde_json::from_str(text).map_err(|e| {
        format!("invalid filters parameter (expected [{{\"plugin\":NAME,\"config\":{{...}}}}, ...]): {e}")
    })?;
    if specs.is_empty() {
        return Err("invalid filters parameter: the list is empty".into());
    }
    Ok(specs)
}

/// What a change becomes for the subscribers of a group.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Keep,
    Drop,
    /// The full message to send instead (`["data",{...}]`).
    Replace(Arc<str>),
}

/// Outcomes of recent changes, by their text: a live change forwarded to
/// many subscribers and the same change replayed from the log to a
/// catching-up one find the same entry. A lookup hashes the text once and
/// compares it only on a hash match (most often the same shared pointer).
/// One entry per hash: a colliding text replaces the older entry, which only
/// costs that change a second evaluation.
struct Cache {
    map: FxHashMap<u64, (Arc<str>, Outcome)>,
    /// Hashes in the order they went in, to let the oldest go.
    order: VecDeque<u64>,
}

impl Cache {
    fn new() -> Self {
        Cache { map: FxHashMap::default(), order: VecDeque::new() }
    }

    fn get(&self, k: u64, text: &Arc<str>) -> Option<Outcome> {
        let (held, outcome) = self.map.get(&k)?;
        (Arc::ptr_eq(held, text) || **held == **text).then(|| outcome.clone())
    }

    fn put(&mut self, k: u64, text: &Arc<str>, outcome: Outcome) {
        if self.map.insert(k, (text.clone(), outcome)).is_some() {
            // The hash is queued already (same text, or a collision).
            return;
        }
        self.order.push_back(k);
        while self.order.len() > CACHE_ENTRIES {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

const CACHE_ENTRIES: usize = 16_384;

/// A fast hash of a change's text, eight bytes at a time (entries are
/// compared in full on a match, so collisions cost a comparison only).
fn key(text: &str) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let bytes = text.as_bytes();
    let mut h = bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    for &b in chunks.remainder() {
        h = (h.rotate_left(5) ^ b as u64).wrapping_mul(K);
    }
    h
}

/// What a chain does with the row changes of one table, learned from its
/// filters' table policies.
#[derive(Clone, Copy)]
enum TableVerdict {
    /// Every filter decides by table: each row change is kept, or dropped.
    Decided(bool),
    /// The filters before `first` keep every row; filter `first` inspects
    /// each one (and the filters after it are asked as usual).
    Inspect { first: usize },
}

struct Chain {
    filters: Vec<Box<dyn ChangeFilter>>,
    /// Set once a filter failed; the group serves no one after that.
    failed: Option<String>,
}

/// A filter chain shared by the subscribers that asked for the same one.
pub struct FilterGroup {
    /// "table-filter -> redact", for logs.
    pub label: String,
    chain: tokio::sync::Mutex<Chain>,
    cache: Mutex<Cache>,
    /// Per table (schema, then name): what the chain does with its rows.
    tables: RwLock<FxHashMap<String, FxHashMap<String, TableVerdict>>>,
    evaluations: std::sync::atomic::AtomicU64,
    /// A filter failed (see `Chain::failed`).
    broken: std::sync::atomic::AtomicBool,
}

impl FilterGroup {
    /// Data changes filter plugins have evaluated (cache misses).
    pub fn evaluations(&self) -> u64 {
        self.evaluations.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn failed(&self) -> bool {
        self.broken.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Fills the outcomes still missing from the cache (`keys`: each
    /// message's hash).
    fn fill_from_cache(&self, out: &mut [Option<Outcome>], messages: &[Arc<str>], keys: &[u64]) -> Result<(), String> {
        let cache = self.cache.lock().map_err(|_| "filter cache poisoned".to_string())?;
        for ((o, m), k) in out.iter_mut().zip(messages).zip(keys) {
            if o.is_none() {
                *o = cache.get(*k, m);
            }
        }
        Ok(())
    }

    /// The outcome of each data message (`["data",{...}]`), in order. An
    /// error names the filter and the cause; the group is then unusable.
    pub async fn apply(self: &Arc<Self>, messages: &[Arc<str>]) -> Result<Vec<Outcome>, String> {
        // The outcome cache only pays when another subscriber can hit it.
        let shared = Arc::strong_count(self) > 1;
        if self.broken.load(std::sync::atomic::Ordering::Acquire) {
            let chain = self.chain.lock().await;
            return Err(chain.failed.clone().unwrap_or_else(|| "the filter failed".into()));
        }
        // One pass over the messages: each one's route and, for row
        // changes, its table's verdict (`None`: not a row change, or a
        // table not seen yet). Row changes of tables the chain decides by
        // table cost a lookup.
        let n = messages.len();
        let mut routes: Vec<Route<'_>> = Vec::with_capacity(n);
        let mut verdicts: Vec<Option<TableVerdict>> = Vec::with_capacity(n);
        let mut out: Vec<Option<Outcome>> = Vec::with_capacity(n);
        {
            let tables = self.tables.read().map_err(|_| "filter table verdicts poisoned".to_string())?;
            let mut recent: Recent<Option<TableVerdict>> = Recent::default();
            for m in messages {
                let r = route(inner_object(m));
                let verdict = match r {
                    Route::Row { schema, name, .. } => match recent.get(schema, name) {
                        Some(v) => *v,
                        None => {
                            let v = tables.get(schema).and_then(|t| t.get(name)).copied();
                            recent.put(schema, name, v);
                            v
                        }
                    },
                    Route::Other => None,
                };
                out.push(match verdict {
                    Some(TableVerdict::Decided(keep)) => Some(if keep { Outcome::Keep } else { Outcome::Drop }),
                    _ => None,
                });
                routes.push(r);
                verdicts.push(verdict);
            }
        }
        if out.iter().all(Option::is_some) {
            return Ok(out.into_iter().flatten().collect());
        }
        // Hashed once, for both lookups and the insert (when shared).
        let keys: Vec<u64> = if shared {
            out.iter().zip(messages).map(|(o, m)| if o.is_none() { key(m) } else { 0 }).collect()
        } else {
            Vec::new()
        };
        // Evaluations so far: if none happen before this one holds the
        // chain, the cache cannot have learned anything meanwhile.
        let evaluated_before = self.evaluations.load(std::sync::atomic::Ordering::Acquire);
        if shared {
            self.fill_from_cache(&mut out, messages, &keys)?;
        }
        if out.iter().all(Option::is_some) {
            return Ok(out.into_iter().flatten().collect());
        }
        let mut chain = self.chain.lock().await;
        if let Some(f) = &chain.failed {
            return Err(f.clone());
        }
        // Another subscriber may have evaluated them while this one waited.
        if shared && self.evaluations.load(std::sync::atomic::Ordering::Acquire) != evaluated_before {
            self.fill_from_cache(&mut out, messages, &keys)?;
        }
        let misses: Vec<usize> = (0..messages.len()).filter(|i| out[*i].is_none()).collect();
        let items = misses.iter().map(|i| Item::new(&messages[*i], routes[*i], verdicts[*i]));
        let evaluated = match evaluate(&mut chain.filters, items).await {
            Ok(e) => e,
            Err(e) => {
                chain.failed = Some(e.clone());
                self.broken.store(true, std::sync::atomic::Ordering::Release);
                return Err(e);
            }
        };
        let evaluated_now = misses.len() as u64;
        let mut learned = Vec::new();
        {
            let mut cache = self.cache.lock().map_err(|_| "filter cache poisoned".to_string())?;
            for (i, outcome) in misses.into_iter().zip(evaluated) {
                // Row changes of a table not seen yet: its verdict is
                // learned below. (Tables decided as a whole never get here.)
                if let (None, Route::Row { schema, name, .. }) = (&verdicts[i], &routes[i]) {
                    if !learned.iter().any(|(s, n)| s == schema && n == name) {
                        learned.push((schema.to_string(), name.to_string()));
                    }
                }
                if shared {
                    cache.put(keys[i], &messages[i], outcome.clone());
                }
                out[i] = Some(outcome);
            }
        }
        // Counted after the cache learned the outcomes (Release), so a
        // subscriber that sees the count (Acquire) finds them there.
        self.evaluations.fetch_add(evaluated_now, std::sync::atomic::Ordering::Release);
        // The policies of these tables are known now (no plugin call).
        for (schema, name) in learned {
            let mut verdict = TableVerdict::Decided(true);
            for (f, filter) in chain.filters.iter_mut().enumerate() {
                match filter.policy(&schema, &name).await? {
                    TablePolicy::KeepAll => {}
                    TablePolicy::DropAll => {
                        verdict = TableVerdict::Decided(false);
                        break;
                    }
                    TablePolicy::Inspect => {
                        verdict = TableVerdict::Inspect { first: f };
                        break;
                    }
                }
            }
            if let Ok(mut tables) = self.tables.write() {
                tables.entry(schema).or_default().insert(name, verdict);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

/// Answers for the last few tables looked up. Changes come in runs over a
/// handful of tables, so comparing a few short names beats hashing them.
struct Recent<'a, V> {
    entries: Vec<(&'a str, &'a str, V)>,
    next: usize,
}

impl<V> Default for Recent<'_, V> {
    fn default() -> Self {
        Recent { entries: Vec::new(), next: 0 }
    }
}

impl<'a, V> Recent<'a, V> {
    const SIZE: usize = 4;

    fn get(&self, schema: &str, name: &str) -> Option<&V> {
        // `same`: short names compare inline, not through a `memcmp` call.
        let same = json_scan::same;
        self.entries
            .iter()
            .find(|(s, n, _)| same(n.as_bytes(), name.as_bytes()) && same(s.as_bytes(), schema.as_bytes()))
            .map(|(_, _, v)| v)
    }

    fn put(&mut self, schema: &'a str, name: &'a str, v: V) {
        if self.entries.len() < Self::SIZE {
            self.entries.push((schema, name, v));
        } else {
            self.entries[self.next] = (schema, name, v);
            self.next = (self.next + 1) % Self::SIZE;
        }
    }
}

/// One change on its way through the chain.
struct Item<'a> {
    /// The message as it arrived.
    original: &'a Arc<str>,
    /// Its route, read once (for the original, not a replacement).
    route: Route<'a>,
    /// Its table's verdict, if the chain has seen the table before.
    verdict: Option<TableVerdict>,
    /// The message a filter's replacement made of it (`["data",{...}]`,
    /// built once: later filters read its inner object, the subscriber all).
    replaced: Option<String>,
    dropped: bool,
}

impl<'a> Item<'a> {
    fn new(original: &'a Arc<str>, route: Route<'a>, verdict: Option<TableVerdict>) -> Self {
        Item { original, route, verdict, replaced: None, dropped: false }
    }

    fn inner(&self) -> &str {
        inner_object(self.replaced.as_deref().unwrap_or(self.original))
    }
}

/// The table of a row change whose names the fast route could not read.
fn slow_row_table(inner: &str) -> Option<(String, String)> {
    #[derive(Deserialize)]
    struct Rel {
        schema: String,
        name: String,
    }
    #[derive(Deserialize)]
    struct Row {
        tag: String,
        relation: Rel,
    }
    let row: Row = serde_json::from_str(inner).ok()?;
    matches!(row.tag.as_str(), "insert" | "update" | "delete").then_some((row.relation.schema, row.relation.name))
}

/// Runs data messages through each filter of the chain in turn. Only the
/// changes a filter must inspect are copied across its boundary.
async fn evaluate<'a>(
    filters: &mut [Box<dyn ChangeFilter>],
    items: impl Iterator<Item = Item<'a>>,
) -> Result<Vec<Outcome>, String> {
    let mut items: Vec<Item<'_>> = items.collect();
    for (f, filter) in filters.iter_mut().enumerate() {
        let mut index = Vec::with_capacity(items.len());
        let mut recent = Recent::default();
        for (i, item) in items.iter_mut().enumerate() {
            if item.dropped {
                continue;
            }
            // The table's verdict answers for the filters up to the first
            // that inspects its rows, without asking them.
            if let (None, Some(TableVerdict::Inspect { first })) = (&item.replaced, item.verdict) {
                if f < first {
                    continue;
                }
                if f == first {
                    index.push(i);
                    continue;
                }
            }
            let policy = match (&item.replaced, item.route) {
                (None, Route::Row { schema, name, .. }) => match recent.get(schema, name) {
                    Some(p) => Some(*p),
                    None => {
                        let p = filter.policy(schema, name).await?;
                        recent.put(schema, name, p);
                        Some(p)
                    }
                },
                _ => match route(item.inner()) {
                    Route::Row { schema, name, .. } => Some(filter.policy(schema, name).await?),
                    Route::Other => match slow_row_table(item.inner()) {
                        Some((schema, name)) => Some(filter.policy(&schema, &name).await?),
                        None => None,
                    },
                },
            };
            match policy {
                Some(TablePolicy::KeepAll) => {}
                Some(TablePolicy::DropAll) => item.dropped = true,
                Some(TablePolicy::Inspect) | None => index.push(i),
            }
        }
        if index.is_empty() {
            continue;
        }
        let batch: Vec<&str> = index.iter().map(|i| items[*i].inner()).collect();
        let decisions = filter.apply(&batch).await?;
        for (i, d) in index.into_iter().zip(decisions) {
            match d {
                Decision::Keep => {}
                Decision::Drop => items[i].dropped = true,
                Decision::Replace(text) => {
                    let doc = crate::change::json::validate(&text)
                        .map_err(|e| format!("filter plugin {} replaced a change with {e}", filter.name()))?;
                    if !doc.starts_with('{') {
                        return Err(format!(
                            "filter plugin {} replaced a change with something that is not a JSON object",
                            filter.name()
                        ));
                    }
                    let mut message = String::with_capacity(doc.len() + 9);
                    message.push_str("[\"data\",");
                    message.push_str(doc);
                    message.push(']');
                    items[i].replaced = Some(message);
                }
            }
        }
    }
    Ok(items
        .into_iter()
        .map(|item| match (item.dropped, item.replaced) {
            (true, _) => Outcome::Drop,
            (false, Some(message)) => Outcome::Replace(Arc::from(message)),
            (false, None) => Outcome::Keep,
        })
        .collect())
}

/// `{...}` of a `["data",{...}]` message.
fn inner_object(message: &str) -> &str {
    message.strip_prefix("[\"data\",").and_then(|m| m.strip_suffix(']')).unwrap_or(message)
}

/// Whether a message is a data or schema change (what filters see).
pub fn is_data(message: &str) -> bool {
    message.starts_with("[\"data\",")
}

/// Creates and shares filter groups.
pub struct FilterHost {
    factory: Option<Arc<dyn FilterFactory>>,
    groups: tokio::sync::Mutex<HashMap<String, Weak<FilterGroup>>>,
}

impl FilterHost {
    /// `factory`: where filters come from, if anywhere (`None`: Sluice runs
    /// without a plugin directory).
    pub fn new(factory: Option<Arc<dyn FilterFactory>>) -> Arc<FilterHost> {
        Arc::new(FilterHost { factory, groups: Default::default() })
    }

    /// No filters available (no plugin directory).
    pub fn none() -> Arc<FilterHost> {
        Self::new(None)
    }

    /// The group for `specs`, shared with subscribers that asked for the same
    /// chain, or an error naming the plugin and the cause.
    pub async fn group(&self, specs: &[FilterSpec]) -> Result<Arc<FilterGroup>, String> {
        let mut key = serde_json::to_string(specs).map_err(|e| e.to_string())?;
        if let Some(factory) = &self.factory {
            for spec in specs {
                if let Some(generation) = factory.generation(&spec.plugin).await {
                    key.push_str(&format!(" {}@{generation}", spec.plugin));
                }
            }
        }
        let mut groups = self.groups.lock().await;
        if let Some(g) = groups.get(&key).and_then(Weak::upgrade).filter(|g| !g.failed()) {
            return Ok(g);
        }
        groups.retain(|_, g| g.strong_count() > 0);
        let factory =
            self.factory.as_ref().ok_or("filters are not available: sluice runs without a plugin directory")?;
        let mut filters = Vec::with_capacity(specs.len());
        for spec in specs {
            filters.push(factory.create(&spec.plugin, &spec.config.to_string()).await?);
        }
        let label = specs.iter().map(|s| s.plugin.as_str()).collect::<Vec<_>>().join(" -> ");
        let group = Arc::new(FilterGroup {
            label,
            chain: tokio::sync::Mutex::new(Chain { filters, failed: None }),
            cache: Mutex::new(Cache::new()),
            tables: RwLock::new(FxHashMap::default()),
            evaluations: Default::default(),
            broken: Default::default(),
        });
        groups.insert(key, Arc::downgrade(&group));
        Ok(group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_clear_errors() {
        let specs = parse_specs(r#"[{"plugin":"table-filter","config":{"include":["public.*"]}},{"plugin":"redact"}]"#)
            .unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].config, serde_json::json!({}));
        assert!(parse_specs("[]").unwrap_err().contains("empty"));
        assert!(parse_specs("{").unwrap_err().contains("invalid filters parameter"));
        assert!(parse_specs(r#"[{"plugin":"x","other":1}]"#).unwrap_err().contains("unknown field"));
    }

    /// A native filter for the group's tests: drops the rows of `secret`
    /// by table, inspects `items` (dropping odd ids, blanking `note`), keeps
    /// the rest; counts what it is asked, and fails when told to.
    struct Native {
        calls: Arc<std::sync::atomic::AtomicUsize>,
        inspected: Arc<std::sync::atomic::AtomicUsize>,
        fail: bool,
    }

    #[async_trait]
    impl ChangeFilter for Native {
        fn name(&self) -> &str {
            "native"
        }
        async fn policy(&mut self, _schema: &str, table: &str) -> Result<TablePolicy, String> {
            Ok(match table {
                "secret" => TablePolicy::DropAll,
                "items" => TablePolicy::Inspect,
                _ => TablePolicy::KeepAll,
            })
        }
        async fn apply(&mut self, changes: &[&str]) -> Result<Vec<Decision>, String> {
            use std::sync::atomic::Ordering::Relaxed;
            if self.fail {
                return Err("filter native failed on purpose".into());
            }
            self.calls.fetch_add(1, Relaxed);
            self.inspected.fetch_add(changes.len(), Relaxed);
            Ok(changes
                .iter()
                .map(|c| {
                    let v: serde_json::Value = serde_json::from_str(c).unwrap();
                    match v["new"]["id"].as_i64() {
                        Some(id) if id % 2 == 1 => Decision::Drop,
                        Some(_) => Decision::Replace(c.replace("\"note\":\"x\"", "\"note\":null")),
                        None => Decision::Keep,
                    }
                })
                .collect())
        }
    }

    struct Natives {
        calls: Arc<std::sync::atomic::AtomicUsize>,
        inspected: Arc<std::sync::atomic::AtomicUsize>,
    }

    #[async_trait]
    impl FilterFactory for Natives {
        async fn create(&self, plugin: &str, _config: &str) -> Result<Box<dyn ChangeFilter>, String> {
            match plugin {
                "native" | "failing" => Ok(Box::new(Native {
                    calls: self.calls.clone(),
                    inspected: self.inspected.clone(),
                    fail: plugin == "failing",
                })),
                _ => Err(format!("no filter plugin {plugin}")),
            }
        }
    }

    fn insert(table: &str, id: i64) -> Arc<str> {
        Arc::from(format!(
            r#"["data",{{"tag":"insert","relation":{{"schema":"public","name":"{table}","rowKey":{{"columns":["id"]}}}},"new":{{"id":{id},"note":"x"}}}}]"#
        ))
    }

    fn spec(plugin: &str) -> Vec<FilterSpec> {
        vec![FilterSpec { plugin: plugin.into(), config: empty_object() }]
    }

    #[tokio::test]
    async fn a_group_decides_by_table_once_known_and_inspects_only_what_it_must() {
        use std::sync::atomic::Ordering::Relaxed;
        let natives = Arc::new(Natives { calls: Default::default(), inspected: Default::default() });
        let host = FilterHost::new(Some(natives.clone()));
        let group = host.group(&spec("native")).await.unwrap();
        let batch = [insert("items", 1), insert("items", 2), insert("secret", 3), insert("other", 4)];
        let out = group.apply(&batch).await.unwrap();
        assert_eq!(out[0], Outcome::Drop);
        assert_eq!(out[1], Outcome::Replace(Arc::from(batch[1].replace(r#""note":"x""#, r#""note":null"#))));
        assert_eq!(out[2..], [Outcome::Drop, Outcome::Keep]);
        assert_eq!(natives.inspected.load(Relaxed), 2, "only the rows of the inspected table cross");
        // The tables are known now: `secret` and `other` cost no call.
        let evaluations = group.evaluations();
        let out = group.apply(&[insert("secret", 5), insert("other", 6)]).await.unwrap();
        assert_eq!(out, [Outcome::Drop, Outcome::Keep]);
        assert_eq!(group.evaluations(), evaluations);
        assert_eq!(natives.calls.load(Relaxed), 1);
        // A chain asked for again is the same group.
        assert!(Arc::ptr_eq(&group, &host.group(&spec("native")).await.unwrap()));
        assert!(host.group(&spec("missing")).await.err().unwrap().contains("no filter plugin missing"));
    }

    #[tokio::test]
    async fn subscribers_of_a_group_share_each_outcome() {
        use std::sync::atomic::Ordering::Relaxed;
        let natives = Arc::new(Natives { calls: Default::default(), inspected: Default::default() });
        let host = FilterHost::new(Some(natives.clone()));
        let group = host.group(&spec("native")).await.unwrap();
        let second = host.group(&spec("native")).await.unwrap();
        let batch: Vec<Arc<str>> = (10..20).map(|id| insert("items", id)).collect();
        let first_out = group.apply(&batch).await.unwrap();
        // The same changes replayed from the log (equal texts, other
        // pointers) for the other subscriber: answered from the cache.
        let replayed: Vec<Arc<str>> = batch.iter().map(|m| Arc::from(m.to_string())).collect();
        assert_eq!(second.apply(&replayed).await.unwrap(), first_out);
        assert_eq!(natives.inspected.load(Relaxed), 10);
        assert_eq!(group.evaluations(), 10);
    }

    #[tokio::test]
    async fn a_failed_chain_fails_its_subscribers_and_a_new_one_is_built() {
        let natives = Arc::new(Natives { calls: Default::default(), inspected: Default::default() });
        let host = FilterHost::new(Some(natives));
        let group = host.group(&spec("failing")).await.unwrap();
        let err = group.apply(&[insert("items", 1)]).await.unwrap_err();
        assert!(err.contains("failed on purpose"), "{err}");
        assert_eq!(group.apply(&[insert("other", 1)]).await.unwrap_err(), err, "the group stays failed");
        let fresh = host.group(&spec("failing")).await.unwrap();
        assert!(!Arc::ptr_eq(&group, &fresh));
        assert!(FilterHost::none().group(&spec("native")).await.err().unwrap().contains("without a plugin directory"));
    }

    #[test]
    fn the_cache_holds_what_it_keys() {
        let mut c = Cache::new();
        let a: Arc<str> = Arc::from("[\"data\",{}]");
        let same_text: Arc<str> = Arc::from("[\"data\",{}]");
        c.put(key(&a), &a, Outcome::Drop);
        assert_eq!(c.get(key(&a), &a), Some(Outcome::Drop));
        assert_eq!(c.get(key(&same_text), &same_text), Some(Outcome::Drop), "a replayed copy of the text hits too");
        let other: Arc<str> = Arc::from("[\"data\",{\"x\":1}]");
        assert_eq!(c.get(key(&other), &other), None);
        // A colliding key still compares the text, and a colliding text
        // takes the entry over.
        assert_eq!(c.get(key(&a), &other), None);
        c.put(key(&a), &other, Outcome::Keep);
        assert_eq!(c.get(key(&a), &other), Some(Outcome::Keep));
        assert_eq!(c.get(key(&a), &a), None);
        assert_eq!(c.order.len(), 1);
        for i in 0..CACHE_ENTRIES + 10 {
            let t: Arc<str> = Arc::from(format!("{i}"));
            c.put(key(&t), &t, Outcome::Keep);
        }
        assert_eq!(c.get(key(&a), &a), None, "the oldest entries go first");
        assert!(c.order.len() <= CACHE_ENTRIES);
    }
}
