//! The core slice: plugin source -> replication loop -> SQLite change log.
//! Cases follow Zero's change-streamer tests (§8.1) that need neither
//! Postgres nor subscribers, plus plugin faults and the command line.

#[macro_use]
mod common;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::process::{free_addr, http_get, sluice};
use common::*;
use serde_json::json;
use sluice::plugin::{Registry, SandboxLimits};
use sluice::source::model::{Control, Message};
use sluice::source::scripted::{begin, commit, insert, relation, status, Scripted};
use sluice::source::ChangeSource;
use sluice::streamer::StreamerOptions;

const WAIT: Duration = Duration::from_secs(60);

on_both_backends!(
    large_transactions_and_rollbacks_share_storage_transactions,
    stores_every_transaction_in_order_with_its_content,
    rolled_back_transactions_are_not_stored,
    interrupted_transactions_are_aborted_and_redelivered_once,
    retries_after_a_source_error,
    recovers_from_a_trapping_plugin,
    recovers_from_a_hanging_plugin,
    recovers_from_a_plugin_that_exhausts_memory,
    resumes_after_the_last_durable_watermark,
    acks_commits_once_durable_and_echoes_statuses_after_them,
    a_stream_failing_mid_transaction_is_reopened_at_the_durable_watermark,
    reset_required_is_recorded_and_auto_reset_starts_a_new_lineage,
    reset_required_without_auto_reset_is_recorded_and_streaming_goes_on,
    a_different_replica_version_resets_the_log,
    the_table_state_follows_every_kind_of_change
);

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn all(n: u64) -> Vec<String> {
    (1..=n).map(lexi).collect()
}

async fn stores_every_transaction_in_order_with_its_content(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let h =
        start_mock(&spec, json!({"transactions": 20, "rows_per_tx": 3, "tables": 2}), SandboxLimits::default()).await;
    h.wait_for_watermark(&lexi(20), WAIT).await;
    h.stop().await.unwrap();

    let rows = spec.rows().await;
    assert_eq!(rows.len(), 2 + 20 * 5, "two seed rows, then begin + 3 inserts + commit per transaction");
    assert_eq!((rows[0].tag.as_str(), rows[1].tag.as_str()), ("begin", "commit"));
    assert_eq!(rows[0].watermark, "00");
    spec.assert_whole().await;
    assert_eq!(spec.committed().await, all(20));
    assert_eq!(spec.last_watermark().await, lexi(20));

    // Transaction 2's first row is row id 3 of the mock's deterministic stream.
    let insert = rows.iter().find(|r| r.watermark == lexi(2) && r.pos == 1).unwrap();
    assert_eq!(insert.tag, "insert");
    let v: serde_json::Value = serde_json::from_str(&insert.change).unwrap();
    assert_eq!(v["relation"]["name"], "table1");
    assert_eq!(v["relation"]["rowKey"]["columns"], json!(["id"]));
    assert_eq!(v["new"]["id"], 3);
    assert_eq!(v["new"]["tx"], lexi(2));
    // 2^60 + 3: beyond 2^53, kept exact in the stored text.
    assert!(insert.change.contains("\"big\":1152921504606846979"), "{}", insert.change);
}

async fn rolled_back_transactions_are_not_stored(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let h =
        start_mock(&spec, json!({"transactions": 10, "rows_per_tx": 2, "rollback_every": 3}), SandboxLimits::default())
            .await;
    h.wait_for_watermark(&lexi(10), WAIT).await;
    h.stop().await.unwrap();
    let expected: Vec<String> = (1..=10).filter(|i| i % 3 != 0).map(lexi).collect();
    assert_eq!(spec.committed().await, expected);
    spec.assert_whole().await;
}

async fn large_transactions_and_rollbacks_share_storage_transactions(backend: Backend) {
    // Transactions larger than a write batch are written before their commit
    // (behind a savepoint when they share the storage transaction); every
    // second one rolls back and must leave nothing behind.
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let config = json!({"transactions": 9, "rows_per_tx": 2500, "rollback_every": 2, "row_bytes": 20});
    let h = start_mock(&spec, config, SandboxLimits::default()).await;
    h.wait_for_watermark(&lexi(9), WAIT).await;
    h.stop().await.unwrap();
    assert_eq!(spec.committed().await, [1, 3, 5, 7, 9].map(lexi));
    spec.assert_whole().await;
    assert_eq!(spec.rows().await.len(), 2 + 5 * 2502);
}

async fn survives_fault(backend: Backend, config: serde_json::Value, limits: SandboxLimits) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let h = start_mock(&spec, config, limits).await;
    h.wait_for_watermark(&lexi(30), WAIT).await;
    h.stop().await.unwrap();
    assert_eq!(spec.committed().await, all(30), "every transaction exactly once, in order");
    spec.assert_whole().await;
}

async fn interrupted_transactions_are_aborted_and_redelivered_once(backend: Backend) {
    survives_fault(
        backend,
        json!({"transactions": 30, "rows_per_tx": 4, "interrupt_every": 4}),
        SandboxLimits::default(),
    )
    .await;
}

async fn retries_after_a_source_error(backend: Backend) {
    survives_fault(backend, json!({"transactions": 30, "rows_per_tx": 4, "fail_after": 25}), SandboxLimits::default())
        .await;
}

async fn recovers_from_a_trapping_plugin(backend: Backend) {
    survives_fault(backend, json!({"transactions": 30, "rows_per_tx": 4, "trap_after": 40}), SandboxLimits::default())
        .await;
}

async fn recovers_from_a_hanging_plugin(backend: Backend) {
    let limits = SandboxLimits { call_deadline: Duration::from_millis(300), ..SandboxLimits::default() };
    survives_fault(backend, json!({"transactions": 30, "rows_per_tx": 4, "hang_after": 20}), limits).await;
}

async fn recovers_from_a_plugin_that_exhausts_memory(backend: Backend) {
    let limits = SandboxLimits { memory_bytes: 48 << 20, ..SandboxLimits::default() };
    survives_fault(backend, json!({"transactions": 30, "rows_per_tx": 4, "oom_after": 20}), limits).await;
}

async fn resumes_after_the_last_durable_watermark(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let h = start_mock(&spec, json!({"transactions": 10}), SandboxLimits::default()).await;
    h.wait_for_watermark(&lexi(10), WAIT).await;
    h.stop().await.unwrap();
    let h = start_mock(&spec, json!({"transactions": 25}), SandboxLimits::default()).await;
    h.wait_for_watermark(&lexi(25), WAIT).await;
    h.stop().await.unwrap();
    assert_eq!(spec.committed().await, all(25));
}

// ---- Protocol rules, driven by a scripted source -------------------------
// (The rules that need no real store, such as a data change before its
// begin, a commit unlike its begin and replayed transactions, are tested
// beside the loop, in `host/src/streamer/rules.rs`.)

async fn acks_commits_once_durable_and_echoes_statuses_after_them(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let src = Scripted::new(vec![(
        "01",
        vec![
            status("05", false),
            relation(),
            begin("09"),
            insert(1),
            insert(2),
            commit("09"),
            status("0b", false),
            status("0d", true),
        ],
    )]);
    let h = start(&spec, Box::new(src.clone()), StreamerOptions::default()).await;
    let acks = src.clone();
    wait_until("acks", WAIT, || {
        let n = acks.acks().len();
        async move { n >= 2 }
    })
    .await;
    h.stop().await.unwrap();
    assert_eq!(src.acks(), ["09", "0d"]);
    let rows = spec.rows().await;
    let tags: Vec<(&str, i64, &str)> = rows.iter().map(|r| (r.watermark.as_str(), r.pos, r.tag.as_str())).collect();
    assert_eq!(
        tags,
        [
            ("01", 0, "begin"),
            ("01", 1, "commit"),
            ("09", 0, "begin"),
            ("09", 1, "insert"),
            ("09", 2, "insert"),
            ("09", 3, "commit")
        ]
    );
    assert_eq!(rows[5].change, r#"{"tag":"commit","extra":"fields"}"#);
    assert_eq!(spec.last_watermark().await, "09");
}

async fn a_stream_failing_mid_transaction_is_reopened_at_the_durable_watermark(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let src = Scripted::new(vec![
        (
            "01",
            vec![
                relation(),
                begin("05"),
                insert(1),
                commit("05"),
                begin("09"),
                insert(2),
                Err("connection reset".into()),
            ],
        ),
        ("01", vec![relation(), begin("09"), insert(2), commit("09")]),
    ]);
    let h = start(&spec, Box::new(src.clone()), StreamerOptions::default()).await;
    h.wait_for_watermark("09", WAIT).await;
    h.stop().await.unwrap();
    assert_eq!(src.opens()[..2], [None, Some("05".to_string())], "a new log opens from the start");
    assert_eq!(spec.committed().await, ["05", "09"]);
    spec.assert_whole().await;
}

async fn reset_required_is_recorded_and_auto_reset_starts_a_new_lineage(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let reset = Ok(Message::Control(Control::ResetRequired(Some("slot dropped".into()))));
    let src = Scripted::new(vec![
        ("01", vec![relation(), begin("05"), insert(1), commit("05"), reset]),
        ("0z", vec![relation(), begin("110"), insert(1), commit("110")]),
    ]);
    let options = StreamerOptions { auto_reset: true, ..StreamerOptions::default() };
    let h = start(&spec, Box::new(src.clone()), options).await;
    h.wait_for_watermark("110", WAIT).await;
    h.stop().await.unwrap();
    // The second open asked for a fresh lineage; the log was rebuilt for it.
    assert_eq!(src.opens()[..2], [None, None]);
    let rows = spec.rows().await;
    assert_eq!(rows[0].watermark, "0z", "seeded at the new replica version");
    assert_eq!(spec.committed().await, ["110"]);
    let (rv, _, reset) = spec.replication().await;
    assert_eq!((rv.as_str(), reset), ("0z", false));
}

async fn reset_required_without_auto_reset_is_recorded_and_streaming_goes_on(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let reset = Ok(Message::Control(Control::ResetRequired(None)));
    let src = Scripted::new(vec![(
        "01",
        vec![relation(), begin("05"), insert(1), commit("05"), reset, begin("07"), insert(2), commit("07")],
    )]);
    let h = start(&spec, Box::new(src), StreamerOptions::default()).await;
    h.wait_for_watermark("07", WAIT).await;
    assert!(h.status.snapshot().reset_required);
    h.stop().await.unwrap();
    assert!(spec.replication().await.2);
}

async fn a_different_replica_version_resets_the_log(backend: Backend) {
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let first = Scripted::new(vec![("01", vec![relation(), begin("05"), insert(1), commit("05")])]);
    let h = start(&spec, Box::new(first), StreamerOptions::default()).await;
    h.wait_for_watermark("05", WAIT).await;
    h.stop().await.unwrap();

    let second = Scripted::new(vec![("02", vec![relation(), begin("03"), insert(9), commit("03")])]);
    let h = start(&spec, Box::new(second.clone()), StreamerOptions::default()).await;
    let status = h.status.clone();
    wait_until("the new lineage at 03", WAIT, || {
        let s = status.snapshot();
        async move { s.replica_version.as_deref() == Some("02") && s.last_watermark.as_deref() == Some("03") }
    })
    .await;
    h.stop().await.unwrap();
    // First opened at the old position, then from scratch in the new lineage.
    assert_eq!(second.opens()[..2], [Some("05".to_string()), None]);
    assert_eq!(spec.rows().await[0].watermark, "02");
    assert_eq!(spec.committed().await, ["03"]);
}

// ---- Plugin loading ------------------------------------------------------

/// Regression (found by the chaos driver): a host must not compile the whole
/// plugin directory before it replicates, or a crash loop never recovers.
/// Opening the source compiles that plugin alone; the rest warm up later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_source_plugin_compiles_before_replication_starts() {
    let dir = tmp();
    let registry = Arc::new(Registry::open(&plugin_dir(), Some(dir.path().join("cache"))).await.unwrap());
    assert_eq!(registry.infos().count(), 0, "nothing compiled by opening the directory");
    registry.source("mock-source", "{}".into(), SandboxLimits::default(), Default::default()).await.unwrap();
    let loaded: Vec<String> = registry.infos().map(|i| i.name.clone()).collect();
    assert_eq!(loaded, ["mock-source"]);
    registry.warm_up();
    let files = std::fs::read_dir(plugin_dir())
        .unwrap()
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "wasm")));
    let total = files.count();
    let r = registry.clone();
    wait_until("every plugin to warm up", WAIT, || {
        let n = r.infos().count();
        async move { n == total }
    })
    .await;
    assert!(registry.infos().all(|i| i.error.is_none()), "the bundled plugins all load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_plugin_files_are_reported_and_the_rest_load() {
    let dir = tmp();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let good = std::fs::read(plugin_dir().join("mock-source.wasm")).unwrap();
    std::fs::write(plugins.join("good.wasm"), &good).unwrap();
    std::fs::write(plugins.join("garbage.wasm"), b"this is not wasm at all").unwrap();
    std::fs::write(plugins.join("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let newer = replace_all(&good, b"@0.3.2", b"@0.4.0");
    std::fs::write(plugins.join("newer.wasm"), newer).unwrap();
    std::fs::write(plugins.join("ignored.txt"), b"not a plugin").unwrap();

    let registry = Arc::new(Registry::load(&plugins, Some(dir.path().join("cache"))).await.unwrap());
    let infos: Vec<_> = registry.infos().collect();
    let by = |n: &str| infos.iter().find(|i| i.name == n).unwrap_or_else(|| panic!("{n} listed"));
    assert_eq!(infos.len(), 4, "only *.wasm files");
    assert_eq!(by("good").error, None);
    assert_eq!(by("good").wit_version.as_deref(), Some("0.3.2"));
    assert!(by("garbage").error.as_deref().unwrap().contains("not a WebAssembly file"));
    assert!(by("core").error.as_deref().unwrap().contains("core WebAssembly module, not a component"));
    let newer = by("newer").error.as_deref().unwrap();
    assert!(newer.contains("speaks sluice:plugin@0.4.0, but this host speaks sluice:plugin@0.3.x"), "{newer}");
    assert!(registry.source("garbage", "{}".into(), SandboxLimits::default(), Default::default()).await.is_err());
    let err = registry.source("nope", "{}".into(), SandboxLimits::default(), Default::default()).await.err().unwrap();
    assert!(err.contains("unknown source \"nope\"") && err.contains("good"), "{err}");

    // A second load comes from the compiled-code cache.
    let again = Registry::load(&plugins, Some(dir.path().join("cache"))).await.unwrap();
    assert!(again.infos().find(|i| i.name == "good").unwrap().cached);
}

/// Source plugins built against an older 0.3 contract keep running: ones
/// that speak 0.3.0 and 0.3.1 (before the `tls` import), and one without
/// the optional `source-progress` export (new in 0.3.1), whose progress is
/// then unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_plugins_without_the_optional_progress_export_still_run() {
    let dir = tmp();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let current = std::fs::read(plugin_dir().join("mock-source.wasm")).unwrap();
    std::fs::write(plugins.join("current.wasm"), &current).unwrap();
    std::fs::write(plugins.join("older.wasm"), replace_all(&current, b"@0.3.2", b"@0.3.0")).unwrap();
    std::fs::write(plugins.join("previous.wasm"), replace_all(&current, b"@0.3.2", b"@0.3.1")).unwrap();
    // Renaming the export hides it from the host, as if it were never built.
    let hidden = replace_all(&current, b"/source-progress@", b"/source-pqrstuvw@");
    assert_ne!(hidden, current, "the plugin exports source-progress");
    std::fs::write(plugins.join("no-progress.wasm"), hidden).unwrap();

    let registry = Arc::new(Registry::load(&plugins, None).await.unwrap());
    for (name, version, reports) in [
        ("current", "0.3.2", true),
        ("previous", "0.3.1", true),
        ("older", "0.3.0", true),
        ("no-progress", "0.3.2", false),
    ] {
        let info = registry.infos().find(|i| i.name == name).unwrap();
        assert_eq!(info.error, None, "{name} loads");
        assert_eq!(info.wit_version.as_deref(), Some(version), "{name}");
        let config = json!({"transactions": 3, "rows_per_tx": 7}).to_string();
        let mut source = registry.source(name, config, SandboxLimits::default(), Default::default()).await.unwrap();
        let mut stream = source.open(None).await.unwrap();
        let mut commits = Vec::new();
        let mut estimates = Vec::new();
        while commits.len() < 3 {
            estimates.push(stream.progress().await.unwrap().snapshot_rows_estimate);
            for m in stream.next_batch(4).await.unwrap() {
                if let Message::Commit(c) = m {
                    commits.push(c.watermark);
                }
            }
        }
        assert_eq!(commits, all(3), "{name} streams");
        // The mock source knows its first transaction (the lineage's
        // snapshot) holds 7 rows, until it has handed it out.
        let expected = if reports { Some(7) } else { None };
        assert_eq!(estimates.first(), Some(&expected), "{name}");
        assert_eq!(estimates.last(), Some(&None), "{name}: no snapshot any more");
    }
}

fn replace_all(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut out = haystack.to_vec();
    let mut i = 0;
    while i + from.len() <= out.len() {
        if &out[i..i + from.len()] == from {
            out[i..i + from.len()].copy_from_slice(to);
            i += from.len();
        } else {
            i += 1;
        }
    }
    out
}

// ---- The binary ----------------------------------------------------------

/// Shell completions and the man page come from the same command
/// definition: every subcommand is in both.
#[test]
fn completions_and_the_man_page_name_every_command() {
    let out = sluice().args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bash = String::from_utf8_lossy(&out.stdout);
    let out = sluice().arg("man").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let man = String::from_utf8_lossy(&out.stdout);
    assert!(man.starts_with(".ie") || man.starts_with(".TH"), "roff: {}", &man[..man.len().min(80)]);
    for command in ["run", "tail", "log", "postgres", "health", "reload", "plugins"] {
        assert!(bash.contains(command), "bash completions lack {command}");
        assert!(man.contains(&format!("sluice\\-{command}(1)")), "the man page lacks {command}");
    }
    assert!(bash.contains("--change-db") && bash.contains("--from-head"), "flags complete too");
    let out = sluice().args(["completions", "nushell"]).output().unwrap();
    assert!(!out.status.success(), "an unknown shell is refused");
}

#[test]
fn bad_source_config_and_unknown_source_exit_with_a_clear_error() {
    let dir = tmp();
    let db = format!("sqlite:{}", dir.path().join("log.db").display());
    let plugins = plugin_dir();
    // `sluice run` with these arguments must fail, saying `expected` on stderr.
    let fails_with = |args: &[&str], expected: &str| {
        let out = sluice()
            .arg("run")
            .args(args)
            .args(["--change-db", &db, "--listen", "127.0.0.1:0"])
            .arg("--plugins")
            .arg(&plugins)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    };
    fails_with(
        &["--source", "mock-source", "--source-config", "{not json"],
        "error: --source-config is not valid JSON",
    );
    fails_with(&["--source", "nope"], "unknown source \"nope\"");

    let out = sluice().arg("plugins").arg("--plugins").arg(&plugins).output().unwrap();
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.lines().any(|l| l.starts_with("mock-source") && l.contains("source") && l.contains("0.3.2")),
        "{table}"
    );
}

fn status_watermark(addr: &str) -> Option<String> {
    let body = http_get(addr, "/status")?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["lastWatermark"].as_str().map(str::to_string)
}

fn spawn_host(db: &Path, addr: &str, config: &str) -> std::process::Child {
    sluice()
        .args(["run", "--source", "mock-source", "--source-config", config, "--listen", addr])
        .arg("--plugins")
        .arg(plugin_dir())
        .arg("--change-db")
        .arg(format!("sqlite:{}", db.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_host_resumes_at_the_right_watermark() {
    let dir = tmp();
    let spec = LogSpec::new(Backend::Sqlite, dir.path());
    let db = spec.sqlite.clone();
    let config = r#"{"transactions": 400, "rows_per_tx": 5, "rate": 200}"#;
    let addr = free_addr();
    let mut host = spawn_host(&db, &addr, config);
    let a = addr.clone();
    wait_until("the first host to store 50 transactions", WAIT, || {
        let w = status_watermark(&a);
        async move { w.is_some_and(|w| w >= lexi(50)) }
    })
    .await;
    host.kill().unwrap(); // SIGKILL: no chance to drain
    host.wait().unwrap();
    let before = spec.committed().await;
    assert!(before.len() >= 50 && before.len() < 400, "killed mid-stream ({} stored)", before.len());

    let addr = free_addr();
    let mut host = spawn_host(&db, &addr, config);
    let a = addr.clone();
    wait_until("the restarted host to reach transaction 400", WAIT, || {
        let w = status_watermark(&a);
        async move { w.as_deref() == Some(lexi(400).as_str()) }
    })
    .await;
    let body = http_get(&addr, "/status").unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["replicaVersion"], "00");
    assert_eq!(v["source"]["state"], "running");
    assert_eq!(http_get(&addr, "/keepalive").as_deref(), Some("OK"));
    host.kill().unwrap();
    host.wait().unwrap();
    assert_eq!(spec.committed().await, all(400), "every transaction exactly once across the kill");
    spec.assert_whole().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_tail_prints_the_stream_and_stops_after_n_commits() {
    let dir = tmp();
    let db = dir.path().join("log.db");
    let addr = free_addr();
    let mut host = spawn_host(&db, &addr, r#"{"transactions": 20, "rows_per_tx": 2}"#);
    let a = addr.clone();
    wait_until("20 transactions stored", WAIT, || {
        let w = status_watermark(&a);
        async move { w.as_deref() == Some(lexi(20).as_str()) }
    })
    .await;
    // Defaults come from /status: the server's replica version and earliest watermark.
    let out = sluice().args(["tail", &format!("ws://{addr}"), "--max-tx", "3"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "status");
    assert_eq!(lines[1], "begin  01");
    assert!(lines[2].starts_with("  insert public.table0 {"), "{}", lines[2]);
    assert_eq!(lines.iter().filter(|l| l.starts_with("commit")).count(), 3);
    assert_eq!(*lines.last().unwrap(), "commit 03");

    let out = sluice()
        .args([
            "tail",
            &format!("ws://{addr}"),
            "--watermark",
            "0j",
            "--replica-version",
            "00",
            "--max-tx",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], r#"["status",{"tag":"status"}]"#);
    assert_eq!(lines[1], r#"["begin",{"tag":"begin"},{"commitWatermark":"0k"}]"#);
    // The raw message, big integers intact.
    assert!(lines[2].contains(r#""big":1152921504606847014"#), "{}", lines[2]);

    let out = sluice()
        .args(["tail", &format!("ws://{addr}"), "--watermark", "01", "--replica-version", "zz"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("current replica version is 00 (requested zz)"));
    host.kill().unwrap();
    host.wait().unwrap();
}

/// The compacted table state, written through the `ChangeLog` trait as the
/// storer writes it, on both change logs: every kind of change, a savepoint
/// rolled back, and paging through the result from a pinned snapshot.
async fn the_table_state_follows_every_kind_of_change(backend: Backend) {
    use sluice::storage::{ChangeLog, LogRow};
    const ITEMS: &str = r#"{"schema":"public","name":"items","rowKey":{"columns":["id"],"type":"default"}}"#;
    let data = |tag: &str, key: Option<&str>, new: Option<&str>| {
        let mut c = format!(r#"{{"tag":"{tag}","relation":{ITEMS}"#);
        if let Some(k) = key {
            c.push_str(&format!(r#","key":{k}"#));
        }
        if let Some(n) = new {
            c.push_str(&format!(r#","new":{n}"#));
        }
        c.push('}');
        c
    };
    fn append(log: &mut dyn ChangeLog, w: &str, changes: &[(&str, String)]) {
        let mut rows =
            vec![LogRow { watermark: w, pos: 0, tag: "begin", change: r#"{"tag":"begin"}"#, precommit: None }];
        for (i, (tag, c)) in changes.iter().enumerate() {
            rows.push(LogRow { watermark: w, pos: i as i64 + 1, tag, change: c, precommit: None });
        }
        log.append(&rows).unwrap();
    }
    let dir = tmp();
    let spec = LogSpec::new(backend, dir.path());
    let (mut log, reader) = spec.open();
    let state = || {
        let reader = reader.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let mut snap = reader.snapshot().unwrap();
                let first = snap.state_rows(None, 1).unwrap();
                let rest = match first.first() {
                    Some(r) => snap.state_rows(Some((&r.table, &r.key)), 100).unwrap(),
                    None => Vec::new(),
                };
                let rows: Vec<(String, String)> = first.into_iter().chain(rest).map(|r| (r.key, r.row)).collect();
                (snap.state_kept().unwrap(), snap.state_schema().unwrap(), rows)
            })
            .await
            .unwrap()
        }
    };
    let create = r#"{"tag":"create-table","spec":{"schema":"public","name":"items","columns":{"id":{"pos":1,"dataType":"int8"}},"primaryKey":["id"]}}"#.to_string();
    let insert = |id: i64| data("insert", None, Some(&format!(r#"{{"id":{id},"a":"x","big":"toast{id}"}}"#)));
    let log = &mut *log;
    tokio::task::block_in_place(|| {
        log.reset("00").unwrap();
        log.assume_ownership("sluice", "127.0.0.1:1").unwrap();
        log.begin().unwrap();
        append(
            log,
            "01",
            &[("create-table", create.clone()), ("insert", insert(1)), ("insert", insert(2)), ("insert", insert(3))],
        );
        // In one batch: a partial update merged into a row inserted just
        // before, a key change, a delete, a row deleted then inserted again.
        append(
            log,
            "02",
            &[
                ("insert", insert(4)),
                ("update", data("update", Some("null"), Some(r#"{"id":4,"a":"y"}"#))),
                ("update", data("update", Some(r#"{"id":2}"#), Some(r#"{"id":20,"a":"moved","big":"toast2"}"#))),
                ("delete", data("delete", Some(r#"{"id":3}"#), None)),
                ("update", data("update", Some("null"), Some(r#"{"id":1,"a":"z"}"#))),
            ],
        );
        log.commit("02").unwrap();
        // Rolled back to its savepoint: no trace.
        log.begin().unwrap();
        log.savepoint().unwrap();
        append(log, "03", &[("insert", insert(5)), ("delete", data("delete", Some(r#"{"id":1}"#), None))]);
        log.rollback_to_savepoint().unwrap();
        log.commit("02").unwrap();
    });
    let (kept, schema, rows) = state().await;
    assert!(kept, "{backend:?}: the state is kept");
    assert_eq!(schema, std::slice::from_ref(&create));
    let rows: Vec<(String, serde_json::Value)> =
        rows.into_iter().map(|(k, r)| (k, serde_json::from_str(&r).unwrap())).collect();
    assert_eq!(
        rows,
        [
            ("[1]".to_string(), json!({"id": 1, "a": "z", "big": "toast1"})),
            ("[20]".to_string(), json!({"id": 20, "a": "moved", "big": "toast2"})),
            ("[4]".to_string(), json!({"id": 4, "a": "y", "big": "toast4"})),
        ],
        "{backend:?}"
    );
    // Column edits, a rename, then truncate and drop.
    let drop_a = r#"{"tag":"drop-column","table":{"schema":"public","name":"items"},"column":"a"}"#.to_string();
    let rename_big = r#"{"tag":"update-column","table":{"schema":"public","name":"items"},"old":{"name":"big","spec":{"pos":3,"dataType":"text"}},"new":{"name":"payload","spec":{"pos":3,"dataType":"text"}}}"#.to_string();
    let rename =
        r#"{"tag":"rename-table","old":{"schema":"public","name":"items"},"new":{"schema":"public","name":"goods"}}"#
            .to_string();
    tokio::task::block_in_place(|| {
        log.begin().unwrap();
        append(
            log,
            "04",
            &[("drop-column", drop_a.clone()), ("update-column", rename_big.clone()), ("rename-table", rename.clone())],
        );
        log.commit("04").unwrap();
    });
    let (_, schema, rows) = state().await;
    assert_eq!(schema, [create, drop_a, rename_big, rename]);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&rows[0].1).unwrap(), json!({"id": 1, "payload": "toast1"}));
    tokio::task::block_in_place(|| {
        log.begin().unwrap();
        append(
            log,
            "05",
            &[("drop-table", r#"{"tag":"drop-table","id":{"schema":"public","name":"goods"}}"#.to_string())],
        );
        log.commit("05").unwrap();
    });
    assert_eq!(state().await, (true, vec![], vec![]));
}
