//! Subscriber filters over real WebSockets with the bundled filter plugins:
//! each filter's semantics (row movement, schema changes), the same view on
//! catch-up and live, a chain of two filters, filtered and unfiltered
//! subscribers side by side, shared evaluation, bad filter requests, and
//! filters that trap, hang, run out of memory or answer nonsense.

#[macro_use]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::feed::*;
use common::ws::*;
use common::*;
use serde_json::{json, Value as Json};
use sluice::filter::{FilterHost, FilterSpec};
use sluice::plugin::{FilterPlugins, Registry, SandboxLimits};
use sluice::service::{Service, ServiceConfig};
use sluice::source::model::{
    ColumnSpec, CreateTable, Insert, KeyType, Message, Relation, SchemaChange, TableName, TableSpec, Truncate, Update,
    Value,
};
use sluice::status::Status;

struct Server {
    addr: String,
    feed: Feed,
    status: Arc<Status>,
    filters: Arc<FilterHost>,
    /// Dropping it stops the service.
    _service: Service,
    _dir: tempfile::TempDir,
}

async fn server() -> Server {
    let limits = SandboxLimits { call_deadline: Duration::from_millis(300), memory_bytes: 32 << 20 };
    let dir = tempfile::tempdir().unwrap();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let (log, reader) = spec.open();
    let registry = Registry::load(&plugin_dir(), Some(dir.path().join("cache"))).await.unwrap();
    let filters = FilterPlugins::host(Some(Arc::new(registry)), limits);
    let feed = Feed::with_snapshot();
    let config = ServiceConfig {
        filters: filters.clone(),
        cleanup: None,
        ..ServiceConfig::new(Box::new(feed.clone()), log, reader)
    };
    let service = Service::start(config).await.unwrap();
    let (addr, status) = (service.addr(), service.status().clone());
    let st = status.clone();
    wait_until("the snapshot to be stored", WAIT, || {
        let rv = st.snapshot().replica_version;
        async move { rv.is_some() }
    })
    .await;
    Server { addr: addr.to_string(), feed, status, filters, _service: service, _dir: dir }
}

impl Server {
    async fn stored(&self, w: &str) {
        wait_stored(&self.status, w).await;
    }

    /// A subscriber from the start of the log through `filters` (JSON).
    async fn subscribe(&self, filters: Option<Json>) -> Client {
        let mut query = "id=f&taskID=t&replicaVersion=00&watermark=01".to_string();
        if let Some(f) = filters {
            query.push_str("&filters=");
            query.push_str(&encode(&f.to_string()));
        }
        Client::connect(&self.addr, &query).await
    }
}

fn encode(s: &str) -> String {
    s.bytes().map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}

/// Reads messages until the commit of `w`, returning them (status excluded).
async fn until_commit(client: &mut Client, w: &str) -> Vec<Json> {
    let mut out = Vec::new();
    loop {
        let m = client.next().await.expect("stream open");
        let v: Json = serde_json::from_str(&m).unwrap();
        if v[0] == "status" {
            continue;
        }
        let done = v[0] == "commit" && v[2]["watermark"] == w;
        out.push(v);
        if done {
            return out;
        }
    }
}

/// The data changes of messages, as `tag table` plus the change itself.
fn data(messages: &[Json]) -> Vec<Json> {
    messages.iter().filter(|m| m[0] == "data").map(|m| m[1].clone()).collect()
}

fn relation(id: u32, schema: &str, name: &str, columns: &[&str], key: &[&str], key_type: KeyType) -> Message {
    Message::Relation(Relation {
        id,
        schema: schema.into(),
        name: name.into(),
        columns: columns.iter().map(|c| c.to_string()).collect(),
        key_columns: key.iter().map(|c| c.to_string()).collect(),
        key_type,
    })
}

fn ins(relation: u32, new: Vec<Value>) -> Message {
    Message::Insert(Insert { relation, new })
}

fn upd(relation: u32, old: Option<Vec<Value>>, new: Vec<Value>) -> Message {
    Message::Update(Update { relation, old, new })
}

fn text(s: &str) -> Value {
    Value::Text(s.into())
}

fn column(name: &str, pos: i32, data_type: &str) -> ColumnSpec {
    ColumnSpec {
        name: name.into(),
        pos,
        data_type: data_type.into(),
        not_null: None,
        default: None,
        character_max_length: None,
        pg_type_class: None,
        elem_pg_type_class: None,
    }
}

fn create_table(schema: &str, name: &str, columns: Vec<ColumnSpec>) -> Message {
    Message::Schema(SchemaChange::CreateTable(CreateTable {
        spec: TableSpec { schema: schema.into(), name: name.into(), columns, primary_key: Some(vec!["id".into()]) },
        metadata: None,
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_filter_keeps_included_tables_beside_an_unfiltered_subscriber() {
    let s = server().await;
    let mut all = s.subscribe(None).await;
    let mut filtered =
        s.subscribe(Some(json!([{"plugin": "table-filter", "config": {"include": ["public.*"]}}]))).await;
    s.feed.push(relation(1, "public", "items", &["id", "name"], &["id"], KeyType::Default));
    s.feed.push(relation(2, "secret", "keys", &["id", "k"], &["id"], KeyType::Default));
    s.feed.push(begin("02"));
    s.feed.push(create_table("secret", "keys", vec![column("id", 1, "int8"), column("k", 2, "text")]));
    s.feed.push(create_table("public", "items", vec![column("id", 1, "int8"), column("name", 2, "text")]));
    s.feed.push(ins(1, vec![Value::Int(1), text("a")]));
    s.feed.push(ins(2, vec![Value::Int(1), text("hidden")]));
    s.feed.push(Message::Truncate(Truncate { relations: vec![1, 2] }));
    s.feed.push(Message::Schema(SchemaChange::RenameTable(sluice::source::model::RenameTable {
        old: TableName { schema: "public".into(), name: "items".into() },
        new: TableName { schema: "secret".into(), name: "items".into() },
    })));
    s.feed.push(commit("02"));
    let everything = until_commit(&mut all, "02").await;
    let view = until_commit(&mut filtered, "02").await;
    assert_eq!(data(&everything).len(), 6);
    let tags: Vec<String> = data(&view).iter().map(|c| c["tag"].as_str().unwrap().to_string()).collect();
    assert_eq!(tags, ["create-table", "insert", "truncate", "drop-table"]);
    let d = data(&view);
    assert_eq!(d[0]["spec"]["name"], "items");
    assert_eq!(d[1]["new"]["name"], "a");
    assert_eq!(d[2]["relations"].as_array().unwrap().len(), 1, "the truncate keeps only public.items");
    assert_eq!(d[3]["id"], json!({"schema": "public", "name": "items"}), "renamed out of the view: dropped");
    // Transaction structure always passes.
    assert_eq!(view.first().unwrap()[0], "begin");
    assert_eq!(view.last().unwrap()[0], "commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_filter_moves_rows_into_and_out_of_the_view() {
    let s = server().await;
    let where_ = json!({"column": "n", "op": ">=", "value": 10});
    let mut client =
        s.subscribe(Some(json!([{"plugin": "row-filter", "config": {"table": "public.*", "where": where_}}]))).await;
    // FULL identity: old rows are complete; default: only a changed key.
    s.feed.push(relation(1, "public", "full", &["id", "n"], &["id", "n"], KeyType::Full));
    s.feed.push(relation(2, "public", "dflt", &["id", "n"], &["id"], KeyType::Default));
    let row = |id: i64, n: i64| vec![Value::Int(id), Value::Int(n)];
    s.feed.push(begin("02"));
    s.feed.push(ins(1, row(1, 5))); // out
    s.feed.push(ins(1, row(2, 20))); // in
    s.feed.push(upd(1, Some(row(3, 5)), row(3, 20))); // moves in: insert
    s.feed.push(upd(1, Some(row(2, 20)), row(2, 5))); // moves out: delete of the key
    s.feed.push(upd(1, Some(row(4, 1)), row(4, 2))); // stays out: dropped
    s.feed.push(upd(1, Some(row(2, 30)), row(2, 40))); // stays in: update
    s.feed.push(upd(2, None, row(5, 1))); // old unknown, new out: delete of the key
    s.feed.push(upd(2, None, row(6, 50))); // old unknown, new in: update
    s.feed.push(ins(2, vec![Value::Int(7), Value::Null])); // NULL never matches
    s.feed.push(Message::Delete(sluice::source::model::Delete { relation: 1, old: row(8, 3) })); // was out
    s.feed
        .push(Message::Delete(sluice::source::model::Delete { relation: 2, old: vec![Value::Int(9), Value::Absent] }));
    s.feed.push(commit("02"));
    let got: Vec<String> = data(&until_commit(&mut client, "02").await)
        .iter()
        .map(|c| {
            let id = c["new"]["id"].as_i64().or(c["key"]["id"].as_i64()).unwrap();
            format!("{} {} {id}", c["tag"].as_str().unwrap(), c["relation"]["name"].as_str().unwrap())
        })
        .collect();
    assert_eq!(
        got,
        [
            "insert full 2",
            "insert full 3",
            "delete full 2",
            "update full 2",
            "delete dflt 5",
            "update dflt 6",
            "delete dflt 9"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redact_drops_masks_and_hashes_rows_and_schema() {
    let s = server().await;
    let config = json!({"tables": ["public.users"], "drop": ["password", "id"], "mask": {"ssn": "***"},
                        "hash": ["email"], "hash_key": "k"});
    let mut client = s.subscribe(Some(json!([{"plugin": "redact", "config": config}]))).await;
    let cols = ["id", "email", "ssn", "password"];
    s.feed.push(relation(1, "public", "users", &cols, &["id"], KeyType::Default));
    s.feed.push(begin("02"));
    s.feed.push(create_table(
        "public",
        "users",
        vec![
            column("id", 1, "int8"),
            column("email", 2, "text"),
            column("ssn", 3, "int8"),
            column("password", 4, "text"),
        ],
    ));
    s.feed.push(ins(1, vec![Value::Int(1), text("a@x"), Value::Int(123), text("pw")]));
    s.feed.push(ins(1, vec![Value::Int(2), text("a@x"), Value::Null, text("pw2")]));
    s.feed.push(commit("02"));
    let d = data(&until_commit(&mut client, "02").await);
    let columns = d[0]["spec"]["columns"].as_object().unwrap();
    assert!(!columns.contains_key("password"), "a dropped column leaves the schema");
    assert!(columns.contains_key("id"), "key columns are never redacted");
    assert_eq!(columns["ssn"]["dataType"], "text", "a masked column becomes text");
    let (a, b) = (&d[1]["new"], &d[2]["new"]);
    assert_eq!(a["id"], 1);
    assert!(a.get("password").is_none());
    assert_eq!(a["ssn"], "***");
    assert_eq!(b["ssn"], Json::Null, "NULL stays NULL");
    let hash = a["email"].as_str().unwrap();
    assert_eq!(hash.len(), 64);
    assert_ne!(hash, "a@x");
    assert_eq!(b["email"], a["email"], "equal values hash equally");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_up_and_live_see_the_same_view_through_a_chain() {
    let s = server().await;
    let chain = json!([
        {"plugin": "table-filter", "config": {"exclude": ["public.skip"]}},
        {"plugin": "redact", "config": {"drop": ["secret"]}}
    ]);
    let mut live = s.subscribe(Some(chain.clone())).await;
    s.feed.push(relation(1, "public", "keep", &["id", "secret"], &["id"], KeyType::Default));
    s.feed.push(relation(2, "public", "skip", &["id", "secret"], &["id"], KeyType::Default));
    for i in 0..20i64 {
        let w = lexi(2 + i as u64);
        s.feed.push(begin(&w));
        s.feed.push(ins(1, vec![Value::Int(i), text("s")]));
        s.feed.push(ins(2, vec![Value::Int(i), text("s")]));
        s.feed.push(commit(&w));
    }
    let last = lexi(21);
    let live_view = until_commit(&mut live, &last).await;
    s.stored(&last).await;
    let mut late = s.subscribe(Some(chain)).await;
    let caught_up = until_commit(&mut late, &last).await;
    assert_eq!(live_view, caught_up, "the same frames whichever way they came");
    let d = data(&live_view);
    assert_eq!(d.len(), 20);
    assert!(d.iter().all(|c| c["relation"]["name"] == "keep" && c["new"].get("secret").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_with_the_same_chain_share_one_evaluation() {
    let s = server().await;
    let chain = json!([{"plugin": "row-filter", "config": {"table": "public.*", "where": {"column": "id", "op": "<", "value": 50}}}]);
    let mut clients = Vec::new();
    for _ in 0..5 {
        clients.push(s.subscribe(Some(chain.clone())).await);
    }
    s.feed.push(relation(1, "public", "t", &["id"], &["id"], KeyType::Default));
    s.feed.push(begin("02"));
    for i in 0..100 {
        s.feed.push(ins(1, vec![Value::Int(i)]));
    }
    s.feed.push(commit("02"));
    for c in clients.iter_mut() {
        assert_eq!(data(&until_commit(c, "02").await).len(), 50);
    }
    let specs: Vec<FilterSpec> = serde_json::from_value(chain).unwrap();
    let group = s.filters.group(&specs).await.unwrap();
    assert_eq!(group.evaluations(), 100, "100 changes evaluated once for five subscribers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_filter_requests_are_refused_before_any_change() {
    let s = server().await;
    s.feed.tx("02", &[1]);
    s.stored("02").await;
    for (filters, expected) in [
        ("[{\"plugin\":\"nope\"}]", "unknown filter \"nope\""),
        ("[{\"plugin\":\"mock-source\"}]", "plugin mock-source is a source, not a filter"),
        (
            "[{\"plugin\":\"row-filter\",\"config\":{\"table\":\"x\"}}]",
            "filter plugin row-filter rejected its configuration",
        ),
        ("[{\"plugin\":\"bad-filter\",\"config\":{\"mode\":\"reject\"}}]", "refused on purpose"),
        (
            "[{\"plugin\":\"bad-filter\",\"config\":{\"mode\":\"many-columns\"}}]",
            "filter plugin bad-filter names 1000 row columns, more than the 64",
        ),
        ("not json", "invalid filters parameter"),
        ("[]", "the list is empty"),
    ] {
        let query = format!("id=f&taskID=t&replicaVersion=00&watermark=01&filters={}", encode(filters));
        let mut client = Client::connect(&s.addr, &query).await;
        // No status, no change: the close comes first, or, when the reason
        // is longer than a close frame holds, the whole error message and
        // then the close.
        use tokio_tungstenite::tungstenite::Message as Ws;
        let mut first = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut client.ws)).await.unwrap();
        if let Some(Ok(Ws::Text(t))) = &first {
            let v: serde_json::Value = serde_json::from_str(t).unwrap();
            assert_eq!(v["msg"][0], "error", "{filters}: {t}");
            let whole = v["msg"][1]["message"].as_str().unwrap();
            assert!(whole.contains(expected) && whole.len() > 116, "{filters}: {whole}");
            first = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut client.ws)).await.unwrap();
        }
        match first {
            Some(Ok(Ws::Close(Some(f)))) => {
                assert_eq!(u16::from(f.code), 1002);
                assert!(f.reason.len() <= 123, "{}", f.reason);
                assert!(f.reason.contains(expected), "{} should mention {expected}", f.reason);
            }
            other => panic!("{filters}: expected a close, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_filter_closes_only_its_own_subscribers() {
    let s = server().await;
    s.feed.push(relation(1, "public", "t", &["id"], &["id"], KeyType::Default));
    let mut plain = s.subscribe(None).await;
    let mut good = s.subscribe(Some(json!([{"plugin": "table-filter", "config": {}}]))).await;
    let modes = [
        ("trap", "trapped"),
        ("hang", "did not return within its call deadline of 300 ms"),
        ("oom", "exceeded its memory limit of 32 MiB"),
        ("wrong-count", "answered 0 decisions for"),
        ("not-json", "replaced a change with invalid JSON"),
    ];
    let mut bad = Vec::new();
    for (mode, _) in modes {
        bad.push(s.subscribe(Some(json!([{"plugin": "bad-filter", "config": {"mode": mode, "after": 2}}]))).await);
    }
    for i in 0..4u64 {
        s.feed.tx(&lexi(2 + i), &[i as i64]);
    }
    for (client, (mode, cause)) in bad.iter_mut().zip(modes) {
        let mut error = None;
        while let Some(m) = client.next().await {
            let v: Json = serde_json::from_str(&m).unwrap();
            if v[0] == "error" {
                error = Some(v.clone());
            }
            if v[0] == "data" {
                assert!(v[1]["new"]["id"].as_i64().unwrap() < 2, "{mode}: nothing unfiltered after the failure");
            }
        }
        let error = error.unwrap_or_else(|| panic!("{mode}: an error message before the close"));
        let message = error[1]["message"].as_str().unwrap();
        assert!(message.contains("filter plugin bad-filter") && message.contains(cause), "{mode}: {message}");
    }
    // Everyone else carries on.
    s.feed.tx(&lexi(6), &[10]);
    assert_eq!(data(&until_commit(&mut plain, &lexi(6)).await).len(), 5);
    assert_eq!(data(&until_commit(&mut good, &lexi(6)).await).len(), 5);
    s.stored(&lexi(6)).await;
}
