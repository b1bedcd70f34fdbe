//! The subscriber endpoint as an operator locks it down, through the real
//! `sluice` process and real sockets: the token (refused without it or with a
//! wrong one, accepted as Bearer, as the password of a `ws://user:TOKEN@`
//! URL and as `?token=`), the cap on connections (refused beyond it while the
//! others keep streaming), filters the operator did not allow, and settings
//! taken from a TOML file and `SLUICE_*` variables under the command line.

#[macro_use]
mod common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::process::{free_addr, sluice};
use common::ws::Client;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Error as WsError;

const TOKEN: &str = "endpoint-token-4711";
const WAIT: Duration = Duration::from_secs(60);

struct Host {
    child: Child,
    addr: String,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Host {
    /// The mock source at 200 tx/s, settings from a file (the source's
    /// configuration as a TOML table), the token from the environment, the
    /// listen address on the command line (the file names another, which
    /// must lose).
    fn start() -> Host {
        Host::start_with(tempfile::tempdir().unwrap(), &[])
    }

    fn start_with(dir: tempfile::TempDir, extra: &[String]) -> Host {
        Host::start_with_env(dir, extra, &[])
    }

    fn start_with_env(dir: tempfile::TempDir, extra: &[String], env: &[(&str, &str)]) -> Host {
        let addr = free_addr();
        let config = dir.path().join("sluice.toml");
        std::fs::write(
            &config,
            "listen = \"127.0.0.1:1\"\nmax-connections = 3\nallow-filter = [\"redact\"]\n\
             [source_config]\nrate = 200\nrows_per_tx = 2\n",
        )
        .unwrap();
        let log = dir.path().join("sluice.log");
        // `--config` before the subcommand, as a global flag may be.
        let child = sluice()
            .arg("--config")
            .arg(&config)
            .args(["run", "--source", "mock-source", "--listen", &addr])
            .args(if extra.iter().any(|a| a == "--plugins") {
                vec![]
            } else {
                vec!["--plugins".into(), common::plugin_dir().display().to_string()]
            })
            .arg("--change-db")
            .arg(format!("sqlite:{}", dir.path().join("log.db").display()))
            .args(extra)
            .env("SLUICE_TOKEN", TOKEN)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let host = Host { child, addr, log, _dir: dir };
        let deadline = Instant::now() + WAIT;
        while !host.log_text().contains("sluice listening on") {
            assert!(Instant::now() < deadline, "sluice does not answer:\n{}", host.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        // Subscribers are served once the snapshot is durable (before, they
        // are closed without an error, as by Zero's change-streamer).
        while !host.log_text().contains("serving subscribers") {
            assert!(Instant::now() < deadline, "the snapshot is not durable:\n{}", host.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        host
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit by itself.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A subscription from the start, with `header` as Authorization.
    async fn subscribe(&self, query: &str, header: Option<String>) -> Result<Client, WsError> {
        let url =
            format!("ws://{}/replication/v6/changes?id=s&taskID=t&replicaVersion=00&watermark=00{query}", self.addr);
        let mut request = url.into_client_request().unwrap();
        if let Some(value) = header {
            request.headers_mut().insert("authorization", value.parse().unwrap());
        }
        tokio_tungstenite::connect_async(request).await.map(|(ws, _)| Client { ws })
    }
}

fn bearer() -> Option<String> {
    Some(format!("Bearer {TOKEN}"))
}

fn status_of(result: Result<Client, WsError>) -> u16 {
    match result {
        Err(WsError::Http(response)) => response.status().as_u16(),
        Err(e) => panic!("not an HTTP refusal: {e}"),
        Ok(_) => 101,
    }
}

/// `GET path` with an optional Authorization header: the status code.
fn get_status(addr: &str, path: &str, header: Option<&str>) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let auth = header.map(|h| format!("Authorization: {h}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_required_and_accepted_as_clients_send_it() {
    let host = Host::start();
    assert_eq!(status_of(host.subscribe("", None).await), 401);
    assert_eq!(status_of(host.subscribe("", Some("Bearer not-it".into())).await), 401);
    assert_eq!(status_of(host.subscribe("&token=not-it", None).await), 401);
    assert_eq!(get_status(&host.addr, "/status", None), 401);
    // The health check stays open.
    assert_eq!(get_status(&host.addr, "/keepalive", None), 200);
    assert_eq!(get_status(&host.addr, "/status", Some(&format!("Bearer {TOKEN}"))), 200);

    // Bearer, Basic (what `ws` sends for ws://sluice:TOKEN@host/) and the query.
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("sluice:{TOKEN}"));
    for (query, header) in
        [("", bearer()), ("", Some(format!("Basic {basic}"))), (&format!("&token={TOKEN}")[..], None)]
    {
        let mut client = host.subscribe(query, header.clone()).await.expect("served with the token");
        // The status message, then a transaction.
        let first = client.take(3).await;
        assert!(first.iter().any(|m| m.starts_with("begin")), "{first:?}");
    }
    let refusals = host.log_text().lines().filter(|l| l.contains("refused a request")).count();
    assert_eq!(refusals, 4, "one line per refused request:\n{}", host.log_text());
    assert!(!host.log_text().contains(TOKEN), "the token is in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_refused_while_the_others_stream() {
    let host = Host::start();
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut c = host.subscribe("", bearer()).await.unwrap();
        c.next().await.expect("streaming");
        open.push(c);
    }
    assert_eq!(status_of(host.subscribe("", bearer()).await), 503);
    assert!(host.log_text().contains("too many connections: 3 open, the limit is 3"), "{}", host.log_text());
    // The three keep streaming: each reads a further 50 messages.
    for c in &mut open {
        c.take(50).await;
    }
    // A place freed is a place taken.
    drop(open.pop());
    let deadline = Instant::now() + WAIT;
    let mut again = loop {
        match host.subscribe("", bearer()).await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("no place after one closed: {e}"),
        }
    };
    again.next().await.expect("streaming");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowed_filters_are_served() {
    let host = Host::start();
    let filters = |plugin: &str| {
        let spec = serde_json::json!([{"plugin": plugin, "config": {"drop": ["secret"]}}]).to_string();
        format!("&filters={}", url_encode(&spec))
    };
    let refused = host.subscribe(&filters("bad-filter"), bearer()).await.unwrap();
    let (code, reason) = refused.close_reason().await;
    assert_eq!(code, 1002);
    assert!(reason.contains("\"bad-filter\" is not allowed"), "{reason}");
    // A refusal longer than a close frame holds arrives whole first, as the
    // protocol's error message; the close reason sums it up.
    let long = "a-filter-nobody-installed-".repeat(5);
    let mut refused = host.subscribe(&filters(&long), bearer()).await.unwrap();
    let first: serde_json::Value = serde_json::from_str(&refused.next().await.expect("the error first")).unwrap();
    assert_eq!(first[0], "error", "{first}");
    assert!(first[1]["message"].as_str().is_some_and(|m| m.contains(&long)), "{first}");
    let (code, reason) = refused.close_reason().await;
    assert!(code == 1002 && reason.len() <= 123 && reason.starts_with("Error: "), "{code} {reason}");
    let mut served = host.subscribe(&filters("redact"), bearer()).await.unwrap();
    let first = served.take(3).await;
    assert!(first.iter().any(|m| m.starts_with("begin")), "{first:?}");
}

/// `GET path` with the token: the body as JSON.
fn get_json(addr: &str, path: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    serde_json::from_str(text.split_once("\r\n\r\n").unwrap().1).unwrap()
}

/// The generation of plugin `name` as `GET /plugins` lists it (`None`: not listed).
fn plugin_generation(host: &Host, name: &str) -> Option<u64> {
    let list = get_json(&host.addr, "/plugins");
    list["plugins"].as_array()?.iter().find(|p| p["name"] == name)?["generation"].as_u64()
}

/// Waits, up to `WAIT`, until `what` holds.
fn wait_for(what: &str, host: &Host, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", host.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Filters dropped into, replaced in and removed from the plugin directory
/// while Sluice runs and a subscriber streams through one of them; a
/// half-copied file is refused and the loaded version stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_load_while_sluice_runs() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(common::plugin_dir().join("mock-source.wasm"), plugins.join("mock-source.wasm")).unwrap();
    let plugins_arg: Vec<String> =
        ["--plugins", &plugins.display().to_string(), "--max-connections", "0"].map(String::from).to_vec();
    let host = Host::start_with(dir, &plugins_arg);
    let redact = serde_json::json!([{"plugin": "redact", "config": {"drop": ["secret"]}}]).to_string();
    let with_redact = format!("&filters={}", url_encode(&redact));
    let (code, reason) = host.subscribe(&with_redact, bearer()).await.unwrap().close_reason().await;
    assert_eq!(code, 1002);
    assert!(reason.contains("unknown filter \"redact\""), "{reason}");

    // Added: the watcher loads it, and the next subscription uses it.
    let copy_in = |from: &str| {
        let tmp = plugins.join(".redact.wasm.part");
        std::fs::copy(common::plugin_dir().join(from), &tmp).unwrap();
        std::fs::rename(&tmp, plugins.join("redact.wasm")).unwrap();
    };
    copy_in("redact.wasm");
    wait_for("the watcher to load redact", &host, || plugin_generation(&host, "redact").is_some());
    let first = plugin_generation(&host, "redact").unwrap();
    let mut old = host.subscribe(&with_redact, bearer()).await.unwrap();
    assert!(old.take(3).await.iter().any(|m| m.starts_with("begin")));

    // Replaced by other code under the same name (table-filter, which
    // refuses redact's configuration): new subscriptions get the new code,
    // the open one keeps its instance.
    copy_in("table-filter.wasm");
    wait_for("the watcher to load the new redact", &host, || plugin_generation(&host, "redact") > Some(first));
    let (code, reason) = host.subscribe(&with_redact, bearer()).await.unwrap().close_reason().await;
    assert_eq!(code, 1002);
    assert!(reason.contains("rejected its configuration"), "the new code runs: {reason}");
    assert_eq!(old.take(20).await.len(), 20, "the open subscription streams on");
    // (A subscriber that stops reading holds back the others' live stream.)
    drop(old);
    let second = plugin_generation(&host, "redact").unwrap();
    let tables = serde_json::json!([{"plugin": "redact", "config": {"exclude": ["nothing.here"]}}]).to_string();
    let with_tables = format!("&filters={}", url_encode(&tables));

    // Half a file (a copy in progress): refused in one line, the loaded
    // code keeps serving, and it is not tried again until it changes.
    let whole = std::fs::read(common::plugin_dir().join("redact.wasm")).unwrap();
    std::fs::write(plugins.join("redact.wasm"), &whole[..whole.len() / 2]).unwrap();
    let refused = |host: &Host| host.log_text().lines().filter(|l| l.contains("the new file is refused")).count();
    wait_for("the half file to be refused", &host, || refused(&host) == 1);
    assert_eq!(plugin_generation(&host, "redact"), Some(second));
    let mut served = host.subscribe(&with_tables, bearer()).await.unwrap();
    assert!(served.take(3).await.iter().any(|m| m.starts_with("begin")), "generation {second} still serves");
    drop(served);
    let reload = sluice()
        .args(["reload", "--url", &format!("http://{}", host.addr)])
        .env("SLUICE_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(reload.status.success(), "{}", String::from_utf8_lossy(&reload.stderr));
    assert_eq!(String::from_utf8_lossy(&reload.stdout).trim(), "unchanged");
    assert_eq!(refused(&host), 1, "a refused file is not tried again until it changes");
    let unauthorized = sluice().args(["reload", "--url", &format!("http://{}", host.addr)]).output().unwrap();
    assert!(!unauthorized.status.success());
    assert!(String::from_utf8_lossy(&unauthorized.stderr).contains("401"));

    // Removed: new subscriptions are refused.
    std::fs::remove_file(plugins.join("redact.wasm")).unwrap();
    wait_for("the watcher to drop redact", &host, || plugin_generation(&host, "redact").is_none());
    let (code, reason) = host.subscribe(&with_tables, bearer()).await.unwrap().close_reason().await;
    assert_eq!(code, 1002);
    assert!(reason.contains("unknown filter \"redact\""), "{reason}");
}

fn url_encode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// A subscription over TLS that trusts only `ca`: the first messages' text,
/// and the server's certificate.
async fn tls_subscribe(addr: &str, ca: &std::path::Path) -> Result<(Vec<String>, Vec<u8>), String> {
    use futures::StreamExt;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from_pem_file(ca).unwrap()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(sluice::tls::crypto_provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let cert = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let url = format!("wss://{addr}/replication/v6/changes?id=s&taskID=t&replicaVersion=00&watermark=00&token={TOKEN}");
    let (mut ws, _) = tokio_tungstenite::client_async(url, tls).await.map_err(|e| e.to_string())?;
    let mut texts = Vec::new();
    while texts.len() < 3 {
        match tokio::time::timeout(WAIT, ws.next()).await.expect("a message in time") {
            Some(Ok(m)) if m.is_text() => texts.push(m.into_text().unwrap().to_string()),
            Some(Ok(_)) => {}
            other => return Err(format!("stream ended: {other:?}")),
        }
    }
    Ok((texts, cert))
}

/// `--tls-cert` / `--tls-key`: subscribers are served over TLS (and a plain
/// one is not); after the files are replaced and SIGHUP is sent, new
/// connections get the new certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_endpoint_serves_and_reloads_its_certificate() {
    let first = common::pki::Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("endpoint.crt"), dir.path().join("endpoint.key"));
    std::fs::copy(first.path("server.crt"), &cert).unwrap();
    std::fs::copy(first.path("server.key"), &key).unwrap();
    let extra =
        vec!["--tls-cert".to_string(), cert.display().to_string(), "--tls-key".to_string(), key.display().to_string()];
    let host = Host::start_with(dir, &extra);
    assert!(host.log_text().contains("listening on wss://"), "{}", host.log_text());

    let (texts, served) = tls_subscribe(&host.addr, &first.path("ca.crt")).await.expect("served over TLS");
    assert!(texts.iter().any(|t| t.contains("\"begin\"")), "{texts:?}");
    assert!(host.subscribe("", bearer()).await.is_err(), "a plain WebSocket was served");

    let second = common::pki::Pki::new();
    std::fs::copy(second.path("server.crt"), &cert).unwrap();
    std::fs::copy(second.path("server.key"), &key).unwrap();
    let pid = host.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    let deadline = Instant::now() + WAIT;
    while !host.log_text().contains("reloaded the endpoint's TLS certificate") {
        assert!(Instant::now() < deadline, "no reload:\n{}", host.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, now_served) = tls_subscribe(&host.addr, &second.path("ca.crt")).await.expect("the new certificate");
    assert_ne!(now_served, served);
    let refused = tls_subscribe(&host.addr, &first.path("ca.crt")).await.unwrap_err();
    assert!(refused.contains("invalid peer certificate"), "{refused}");
}

/// `GET /healthz` answers at once and needs no token; `GET /readyz` says
/// 200 once the lineage is established; `--log-format json` writes one JSON
/// object per line and no colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_json_logs() {
    let host = Host::start_with(tempfile::tempdir().unwrap(), &["--log-format".to_string(), "json".to_string()]);
    assert_eq!(get_status(&host.addr, "/healthz", None), 200);
    let deadline = Instant::now() + WAIT;
    while get_status(&host.addr, "/readyz", None) != 200 {
        assert!(Instant::now() < deadline, "never ready:\n{}", host.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = host.log_text();
    assert!(!log.contains('\u{1b}'), "colour codes in a log file:\n{log}");
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{line}");
    }
}

/// With JSON logs, the line that says why Sluice stopped is JSON too (a log
/// collector drops what does not parse): a second writer on a SQLite log
/// exits 2 with every stderr line one JSON object, the last an error that
/// names the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_error_is_a_json_line_too() {
    let dir = tempfile::tempdir().unwrap();
    let first = Host::start_with(tempfile::tempdir().unwrap(), &[]);
    let log_db = first._dir.path().join("log.db");
    // The log format from the file, as any global flag may come.
    let config = dir.path().join("sluice.toml");
    std::fs::write(&config, "log-format = \"json\"\n").unwrap();
    let out = sluice()
        .args(["run", "--config"])
        .arg(&config)
        .args(["--source", "mock-source", "--listen", &free_addr()])
        .arg("--plugins")
        .arg(common::plugin_dir())
        .arg("--change-db")
        .arg(format!("sqlite:{}", log_db.display()))
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> =
        stderr.lines().map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))).collect();
    let last = lines.last().expect("a line");
    assert_eq!(last["level"], "ERROR", "{last}");
    let message = last["fields"]["message"].as_str().unwrap();
    assert!(message.contains("is being written by another Sluice") && message.contains("log.db"), "{message}");
}

/// SIGTERM: every subscriber gets a close frame with 1001 (going away), the
/// storer finishes, and the process exits 0 by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_subscribers_with_going_away_and_exits_zero() {
    let mut host = Host::start();
    let mut a = host.subscribe("", bearer()).await.unwrap();
    let mut b = host.subscribe("", bearer()).await.unwrap();
    for c in [&mut a, &mut b] {
        for _ in 0..5 {
            assert!(c.next().await.is_some(), "closed early:\n{}", host.log_text());
        }
    }
    let pid = host.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    for client in [a, b] {
        let (code, reason) = client.close_reason().await;
        assert_eq!((code, reason.as_str()), (1001, "Sluice is shutting down"));
    }
    let status = host.wait_exit();
    assert!(status.success(), "exit {status}:\n{}", host.log_text());
    assert!(host.log_text().contains("stopped"), "{}", host.log_text());
}

/// How a reader of [`read_to_close`] behaves.
#[derive(Clone, Copy, PartialEq)]
enum Reader {
    /// A subscriber acking every message, reading at a modest pace.
    Slow,
    /// A subscriber acking every message as fast as it comes.
    Fast,
    /// A zero-cache on `/changes/v0/stream`: it reads and sends nothing
    /// (it reports its position only once it has stored a commit).
    Consumer,
}

/// A subscriber that reads on until the connection ends and reports how it
/// ended: the close frame's code and reason, and whether the TCP connection
/// then ended cleanly (end of stream, no reset).
async fn read_to_close(mut client: Client, reader: Reader) -> (u16, String, bool) {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message as Ws;
    let mut closed = None;
    let mut read = 0u64;
    loop {
        let frame = match tokio::time::timeout(WAIT, client.ws.next()).await {
            Ok(frame) => frame,
            Err(_) => panic!("nothing for {WAIT:?} after {read} frames (close {closed:?})"),
        };
        match frame {
            Some(Ok(Ws::Text(t))) => {
                read += 1;
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                if reader != Reader::Consumer {
                    let _ = client.ws.send(Ws::Text(format!("{{\"ack\":{}}}", v["id"]).into())).await;
                }
                if reader == Reader::Slow && read.is_multiple_of(20) {
                    // A catch-up read at a modest pace: it is still running at the signal.
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }
            Some(Ok(Ws::Close(Some(f)))) => closed = Some((u16::from(f.code), f.reason.to_string())),
            Some(Ok(Ws::Close(None))) => closed = Some((1005, String::new())),
            Some(Ok(_)) => {}
            // After the close frame: the end of the stream, clean or not.
            None => {
                let (code, reason) = closed.unwrap_or((1006, "no close frame".into()));
                return (code, reason, true);
            }
            Some(Err(e)) => {
                let (code, reason) = closed.unwrap_or((1006, format!("no close frame: {e}")));
                return (code, reason, false);
            }
        }
    }
}

/// SIGTERM with subscribers live and catching up (reading a long backlog at
/// a modest pace) and a zero-cache on the custom change-source endpoint,
/// twice in a row, the second time with the signal sent
/// twice a few milliseconds apart (a repeat within a second is the same
/// request): every subscriber receives 1001 and a clean end of stream, and
/// Sluice exits 0 each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_reaches_live_and_catching_up_subscribers_alike() {
    for run in 0..2 {
        let run_dir = tempfile::tempdir().unwrap();
        let extra = [
            "--source-config".to_string(),
            serde_json::json!({"rate": 3000, "rows_per_tx": 2}).to_string(),
            "--max-connections".into(),
            "10".into(),
        ];
        let mut host = Host::start_with(run_dir, &extra);
        let deadline = Instant::now() + WAIT;
        while common::process::status_with(&host.addr, TOKEN)
            .and_then(|s| s["transactions"].as_u64())
            .is_none_or(|n| n < 3000)
        {
            assert!(Instant::now() < deadline, "no backlog:\n{}", host.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut readers = Vec::new();
        // Two from the start of the log, read at a modest pace: catching up
        // at the signal.
        for _ in 0..2 {
            let client = host.subscribe("", bearer()).await.unwrap();
            readers.push(tokio::spawn(read_to_close(client, Reader::Slow)));
        }
        // Two from the head: live at the signal.
        let head =
            common::process::status_with(&host.addr, TOKEN).unwrap()["lastWatermark"].as_str().unwrap().to_string();
        for _ in 0..2 {
            let url = format!(
                "ws://{}/replication/v6/changes?id=live&taskID=t&replicaVersion=00&watermark={head}",
                host.addr
            );
            let mut request = url.into_client_request().unwrap();
            request.headers_mut().insert("authorization", bearer().unwrap().parse().unwrap());
            let (ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
            readers.push(tokio::spawn(read_to_close(Client { ws }, Reader::Fast)));
        }
        // A zero-cache resuming on the custom change-source endpoint.
        let url = format!(
            "ws://{}/changes/v0/stream?appID=zero&shardNum=0&lastWatermark={head}&replicaVersion=00",
            host.addr
        );
        let mut request = url.into_client_request().unwrap();
        request.headers_mut().insert("authorization", bearer().unwrap().parse().unwrap());
        let (ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        readers.push(tokio::spawn(read_to_close(Client { ws }, Reader::Consumer)));
        // Let every reader get going.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let pid = host.child.id().to_string();
        let signals = if run == 0 { 1 } else { 2 };
        for _ in 0..signals {
            assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for (i, reader) in readers.into_iter().enumerate() {
            let (code, reason, clean) = reader.await.unwrap();
            let kind = ["catching up", "catching up", "live", "live", "zero-cache on /changes/v0/stream"][i];
            assert_eq!(
                (code, reason.as_str(), clean),
                (1001, "Sluice is shutting down", true),
                "run {run}, subscriber {i} ({kind}):\n{}",
                host.log_text()
            );
        }
        let status = host.wait_exit();
        assert!(status.success(), "run {run}: exit {status}:\n{}", host.log_text());
    }
}

/// `GET /metrics` (with the token) parses as Prometheus text: the stored
/// counts grow, the subscriber and connection gauges count the one open
/// subscription, the source state is `running`, and the commit histogram
/// has observations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text() {
    let host = Host::start_with(tempfile::tempdir().unwrap(), &["--purge-interval-secs".into(), "1".into()]);
    let mut client = host.subscribe("", bearer()).await.unwrap();
    client.take(20).await;
    // It keeps reading: a lone subscriber that stops holds the live stream
    // (and the storer's open transaction) until it is closed as a laggard.
    let reading = tokio::spawn(async move { while client.next().await.is_some() {} });
    assert_eq!(get_status(&host.addr, "/metrics", None), 401);
    let scrape = || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&host.addr).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let body = text.split_once("\r\n\r\n").unwrap().1.to_string();
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text")
    };
    let value = |scrape: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>| -> f64 {
        let sample = scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .unwrap_or_else(|| {
                panic!("no {name} among {:?}", scrape.samples.iter().map(|s| &s.metric).collect::<Vec<_>>())
            });
        match &sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            other => panic!("{name}: {other:?}"),
        }
    };
    let first = scrape();
    assert!(value(&first, "sluice_transactions_stored_total", None) > 0.0);
    let build = first.samples.iter().find(|s| s.metric == "sluice_build_info").expect("sluice_build_info");
    assert_eq!(build.labels.get("version"), Some(env!("CARGO_PKG_VERSION")));
    assert!(build.labels.get("revision").is_some_and(|r| !r.is_empty()) && build.labels.get("wit").is_some());
    // The process's own figures, as every Prometheus client library names them.
    assert!(value(&first, "process_resident_memory_bytes", None) > 1e6);
    assert!(value(&first, "process_open_fds", None) >= 3.0);
    assert!(value(&first, "process_cpu_seconds_total", None) > 0.0);
    let started = value(&first, "process_start_time_seconds", None);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(started <= now && started > now - 600.0, "started {started}, now {now}");
    assert_eq!(value(&first, "sluice_subscribers", None), 1.0);
    assert_eq!(value(&first, "sluice_stream_connections", None), 1.0);
    assert_eq!(value(&first, "sluice_source_state", Some(("state", "running"))), 1.0);
    assert_eq!(value(&first, "sluice_source_state", Some(("state", "backing_off"))), 0.0);
    let commits = first.samples.iter().find(|s| s.metric == "sluice_storage_commit_seconds").expect("the histogram");
    match &commits.value {
        prometheus_parse::Value::Histogram(buckets) => {
            assert!(buckets.last().is_some_and(|b| b.count > 0.0), "{buckets:?}")
        }
        other => panic!("not a histogram: {other:?}"),
    }
    // This subscriber read the log from the start, through the source plugin.
    assert!(value(&first, "sluice_catchup_changes_total", None) > 0.0);
    assert!(value(&first, "sluice_plugin_calls_total", Some(("kind", "source"))) > 0.0);
    assert!(value(&first, "sluice_plugin_call_seconds_total", Some(("kind", "source"))) > 0.0);
    assert_eq!(value(&first, "sluice_plugin_traps_total", Some(("kind", "source"))), 0.0);
    let series = first.samples.iter().filter(|s| s.metric == "sluice_subscriber_pending_bytes").count();
    assert_eq!(series, 1, "one series for the one subscriber");
    assert!(value(&first, "sluice_subscribers_pending_bytes", None) >= 0.0);
    // How far behind the head it is, in watermark units (the mock's are a counter).
    let distances = first.samples.iter().filter(|s| s.metric == "sluice_subscriber_watermark_distance").count();
    assert_eq!(distances, 1, "a distance for the one subscriber");
    let one = value(&first, "sluice_subscriber_watermark_distance", Some(("subscriber", "s")));
    assert_eq!(value(&first, "sluice_subscriber_watermark_distance_max", None), one);
    // A purge pass (every second here) measures the log.
    let deadline = Instant::now() + WAIT;
    while !scrape().samples.iter().any(|s| s.metric == "sluice_change_log_size_bytes") {
        assert!(Instant::now() < deadline, "no change log size after purges; log:\n{}", host.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(value(&scrape(), "sluice_change_log_size_bytes", None) > 0.0);
    let status = get_json(&host.addr, "/status");
    let positions = status["subscriberPositions"].as_array().unwrap();
    assert_eq!(positions.len(), 1, "{status}");
    assert_eq!(positions[0]["id"], "s");
    assert!(status["purge"]["logBytes"].as_u64().unwrap() > 0, "{status}");
    // A new lineage: no earlier process's subscribers to wait for.
    assert_eq!(status["purge"]["waitingForReturningSubscribers"], false, "{status}");
    // The shared part of the budget is a part of it.
    let memory = scrape();
    assert!(
        value(&memory, "sluice_subscriber_memory_shared_bytes", None)
            <= value(&memory, "sluice_subscriber_memory_bytes", None)
    );
    // The source keeps storing (200 tx/s): the counter grows between scrapes.
    let before = value(&first, "sluice_transactions_stored_total", None);
    let deadline = Instant::now() + WAIT;
    while value(&scrape(), "sluice_transactions_stored_total", None) <= before {
        assert!(Instant::now() < deadline, "the stored count did not grow from {before}");
        std::thread::sleep(Duration::from_millis(20));
    }
    reading.abort();
}

/// `sluice tail` against a secured Sluice: TLS checked with `--ca`, the
/// token from `--token` or `SLUICE_TOKEN`, and `--from-head`, which starts
/// after the newest stored transaction. Without the token it is refused
/// with a line saying how to pass one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_reads_a_secured_sluice_with_its_token_over_tls() {
    let pki = common::pki::Pki::new();
    let extra: Vec<String> = ["--tls-cert", "server.crt", "--tls-key", "server.key"]
        .iter()
        .map(|a| if a.starts_with("--") { a.to_string() } else { pki.path(a).display().to_string() })
        .collect();
    let host = Host::start_with(tempfile::tempdir().unwrap(), &extra);
    let url = format!("wss://{}", host.addr);
    let ca = pki.path("ca.crt");
    let tail = |args: &[&str]| {
        sluice().arg("tail").arg(&url).arg("--ca").arg(&ca).args(args).env_remove("SLUICE_TOKEN").output().unwrap()
    };

    let refused = tail(&["--max-tx", "1"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("401") && err.contains("--token"), "{err}");

    // The head now, read as tail reads it (the library's client).
    let endpoint = sluice::admin::http::Endpoint {
        url: format!("https://{}", host.addr),
        token: Some(TOKEN.into()),
        ca: Some(ca.clone()),
        pinned: None,
    };
    let status: serde_json::Value =
        serde_json::from_str(&endpoint.request("GET", "/status").await.unwrap().body).unwrap();
    let head = status["lastWatermark"].as_str().expect("a head").to_string();

    let out = tail(&["--from-head", "--max-tx", "10", "--token", TOKEN]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let commits: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("commit ")).collect();
    assert_eq!(commits.len(), 10, "{text}");
    assert!(commits.windows(2).all(|w| w[0] < w[1]), "in order: {commits:?}");
    assert!(commits[0] > head.as_str(), "from the head ({head}) on: {commits:?}");

    let with_env = sluice()
        .arg("tail")
        .arg(&url)
        .arg("--ca")
        .arg(&ca)
        .args(["--max-tx", "1"])
        .env("SLUICE_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(with_env.status.success(), "{}", String::from_utf8_lossy(&with_env.stderr));

    // `sluice health` with no URL, as a container's HEALTHCHECK runs it:
    // the address and TLS come from the server's own settings, and the
    // check trusts exactly the certificate it is configured to serve.
    let health = |cert: &str| {
        sluice()
            .args(["health", "--ready"])
            .env_remove("SLUICE_URL")
            .env("SLUICE_LISTEN", host.addr.to_string().replace("127.0.0.1", "0.0.0.0"))
            .env("SLUICE_TLS_CERT", pki.path(cert))
            .output()
            .unwrap()
    };
    let healthy = health("server.crt");
    assert!(healthy.status.success(), "{}", String::from_utf8_lossy(&healthy.stderr));
    let other = health("ca.crt");
    assert!(!other.status.success());
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(err.contains("not the one configured"), "{err}");
}

/// A real Prometheus (Debian's package, unpacked by
/// tests/prometheus/promtool.sh) scrapes a running Sluice with its token and
/// evaluates the packaged alert rules: every rule evaluates without error,
/// every series the rules watch on a running host is scraped, and every
/// query of the packaged Grafana dashboard returns series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_sluice_and_evaluates_the_packaged_alert_rules() {
    let host = Host::start();
    let dir = tempfile::tempdir().unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rules = repo.join("packaging/prometheus/sluice-alerts.yml");
    let web = free_addr();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: ['{}']\nscrape_configs:\n  \
             - job_name: sluice\n    authorization:\n      credentials: {TOKEN}\n    static_configs:\n      \
             - targets: ['{}']\n",
            rules.display(),
            host.addr
        ),
    )
    .unwrap();
    let log = dir.path().join("prometheus.log");
    /// Stopped however the test ends.
    struct Stopped(Child);
    impl Drop for Stopped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _prometheus = Stopped(
        std::process::Command::new(repo.join("tests/prometheus/promtool.sh"))
            .env("PROMETHEUS_BIN", "prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let api = |path: &str| -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&web).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {web}\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        serde_json::from_str(text.split_once("\r\n\r\n")?.1).ok()
    };
    let query = |expr: &str| -> Vec<serde_json::Value> {
        let q: String = url::form_urlencoded::byte_serialize(expr.as_bytes()).collect();
        api(&format!("/api/v1/query?query={q}"))
            .and_then(|v| v["data"]["result"].as_array().cloned())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + WAIT;
    let evaluated = loop {
        let up = query("up{job=\"sluice\"}");
        let rules = api("/api/v1/rules").and_then(|v| v["data"]["groups"][0]["rules"].as_array().cloned());
        if let (Some(up), Some(rules)) = (up.first(), rules) {
            if up["value"][1] == "1"
                && !rules.is_empty()
                && rules.iter().all(|r| r["lastEvaluation"] != "0001-01-01T00:00:00Z")
            {
                break rules;
            }
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape Sluice:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // What the rules watch (the Postgres source's retained WAL aside: this
    // host runs the mock source) is scraped, at a healthy value.
    for (series, healthy) in [
        ("sluice_ready", Some("1")),
        ("sluice_reset_required", Some("0")),
        ("sluice_stalled_seconds{path=\"change_log\"}", Some("0")),
        ("sluice_stalled_seconds{path=\"source\"}", Some("0")),
        ("sluice_subscriber_lagging_max_seconds", Some("0")),
        ("sluice_subscriber_memory_bytes", None),
        ("sluice_subscriber_memory_budget_bytes", None),
        ("sluice_source_lag_seconds_bucket", None),
        ("sluice_build_info", Some("1")),
    ] {
        let found = query(series);
        assert!(!found.is_empty(), "no {series} in Prometheus");
        if let Some(value) = healthy {
            assert_eq!(found[0]["value"][1], value, "{series}: {found:?}");
        }
    }
    // The dashboard's queries, with every instance selected.
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo.join("packaging/grafana/sluice-dashboard.json")).unwrap())
            .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().replace("$instance", ".*"))
        .collect();
    assert!(exprs.len() >= 15, "{exprs:?}");
    for expr in &exprs {
        // Only a Postgres source has a slot, and the log's size comes with the first purge.
        if expr.contains("retained_wal") || expr.contains("change_log_size") {
            continue;
        }
        let deadline = Instant::now() + WAIT;
        while query(expr).is_empty() {
            assert!(Instant::now() < deadline, "the dashboard's {expr} returns no series");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert_eq!(evaluated.len(), 9, "every packaged rule is loaded");
    for rule in &evaluated {
        assert_eq!(rule["health"], "ok", "{}: {}", rule["name"], rule["lastError"]);
    }
}

/// What an OTLP/HTTP receiver got, decoded with the official protobuf
/// definitions (the opentelemetry-proto crate): every span with its
/// resource's `service.name`, and every metric.
#[derive(Default)]
struct Received {
    spans: Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>,
    metrics: Vec<opentelemetry_proto::tonic::metrics::v1::Metric>,
}

/// An OTLP/HTTP (protobuf) receiver on a free port: `/v1/traces` and
/// `/v1/metrics`.
async fn otlp_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Received>>) {
    use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message;
    type Shared = std::sync::Arc<std::sync::Mutex<Received>>;
    let received: Shared = Default::default();
    let service = |resource: Option<&opentelemetry_proto::tonic::resource::v1::Resource>| -> String {
        resource
            .into_iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default()
    };
    let traces = {
        let received = received.clone();
        move |body: axum::body::Bytes| async move {
            let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
            let mut r = received.lock().unwrap();
            for rs in request.resource_spans {
                let name = service(rs.resource.as_ref());
                for ss in rs.scope_spans {
                    r.spans.extend(ss.spans.into_iter().map(|s| (name.clone(), s)));
                }
            }
            axum::http::StatusCode::OK
        }
    };
    let metrics = {
        let received = received.clone();
        move |body: axum::body::Bytes| async move {
            let request = ExportMetricsServiceRequest::decode(body).expect("an OTLP metrics export");
            let mut r = received.lock().unwrap();
            for rm in request.resource_metrics {
                assert_eq!(service(rm.resource.as_ref()), "sluice");
                for sm in rm.scope_metrics {
                    r.metrics.extend(sm.metrics);
                }
            }
            axum::http::StatusCode::OK
        }
    };
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(traces))
        .route("/v1/metrics", axum::routing::post(metrics));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

/// OpenTelemetry configured by the standard variables, as for zero-cache:
/// a real OTLP/HTTP receiver gets the trace of a transaction's path (its
/// source batch, the transaction, its fan-out and the storage commit that
/// made it durable, all one trace, each the child of the right span), a
/// subscriber's catch-up scan, and the `/metrics` families as OTLP metrics
/// (a counter as a monotonic sum, a gauge with its attributes, the commit
/// histogram), under `service.name` "sluice".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opentelemetry_exports_a_transactions_trace_and_the_metrics_over_otlp() {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use opentelemetry_proto::tonic::metrics::v1::metric::Data;
    use opentelemetry_proto::tonic::metrics::v1::number_data_point;
    let (endpoint, received) = otlp_receiver().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "300"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let host = Host::start_with_env(tempfile::tempdir().unwrap(), &[], &env);
    assert!(host.log_text().contains(&format!("OpenTelemetry: traces and metrics over OTLP/HTTP to {endpoint}")));
    // A subscriber from the start is caught up from the log: a scan.
    let mut client = host.subscribe("", Some(format!("Bearer {TOKEN}"))).await.expect("subscribed");
    assert!(client.next().await.is_some());

    let attr = |span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str| -> Option<String> {
        span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            _ => None,
        })
    };
    let deadline = Instant::now() + WAIT;
    let (transaction, path) = loop {
        {
            let r = received.lock().unwrap();
            let spans: Vec<&opentelemetry_proto::tonic::trace::v1::Span> = r.spans.iter().map(|(_, s)| s).collect();
            let named = |name: &'static str| spans.iter().copied().filter(move |s| s.name == name);
            let child_of = |name: &'static str, parent: &opentelemetry_proto::tonic::trace::v1::Span| {
                named(name).find(|s| s.trace_id == parent.trace_id && s.parent_span_id == parent.span_id).cloned()
            };
            let found = named("sluice.transaction").find_map(|tx| {
                let batch = named("sluice.source.batch")
                    .find(|b| b.span_id == tx.parent_span_id && b.trace_id == tx.trace_id)?;
                let fan_out = child_of("sluice.fan_out", tx)?;
                let commit = child_of("sluice.storage.commit", tx)?;
                Some((tx.clone(), [batch.clone(), fan_out, commit]))
            });
            if let (Some(found), true) = (found, named("sluice.catchup.scan").next().is_some()) {
                assert!(r.spans.iter().all(|(service, _)| service == "sluice"));
                break found;
            }
        }
        assert!(Instant::now() < deadline, "no whole transaction trace arrived:\n{}", host.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let [batch, fan_out, commit] = path;
    let watermark = attr(&transaction, "watermark").expect("the transaction's watermark");
    assert_eq!(attr(&batch, "source").as_deref(), Some("mock-source"));
    assert!(
        attr(&batch, "messages").and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 4),
        "begin, 2 rows, commit"
    );
    assert!(attr(&fan_out, "subscribers").is_some());
    assert!(attr(&commit, "watermark").is_some_and(|w| w >= watermark), "{watermark}");
    // The commit span ends when the change log has made it durable; the
    // transaction span ends then too, so it covers the whole path.
    assert!(transaction.start_time_unix_nano <= fan_out.start_time_unix_nano);
    assert!(commit.end_time_unix_nano <= transaction.end_time_unix_nano);

    let deadline = Instant::now() + WAIT;
    loop {
        {
            let r = received.lock().unwrap();
            let metric = |name: &str| r.metrics.iter().rev().find(|m| m.name == name);
            let stored = metric("sluice_transactions_stored").and_then(|m| match m.data.as_ref()? {
                Data::Sum(sum) if sum.is_monotonic => sum.data_points.first().and_then(|p| match p.value? {
                    number_data_point::Value::AsDouble(v) => Some(v),
                    number_data_point::Value::AsInt(v) => Some(v as f64),
                }),
                _ => None,
            });
            let build_info = metric("sluice_build_info").and_then(|m| match m.data.as_ref()? {
                Data::Gauge(g) => g.data_points.first().map(|p| {
                    p.attributes.iter().any(|kv| {
                        kv.key == "version"
                            && matches!(kv.value.as_ref().and_then(|v| v.value.as_ref()),
                                Some(Value::StringValue(v)) if v == env!("CARGO_PKG_VERSION"))
                    })
                }),
                _ => None,
            });
            let commits = metric("sluice_storage_commit_seconds").and_then(|m| match m.data.as_ref()? {
                Data::Histogram(h) if m.unit == "s" => h.data_points.first().map(|p| p.count),
                _ => None,
            });
            if stored.is_some_and(|n| n > 0.0) && build_info == Some(true) && commits.is_some_and(|n| n > 0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "metrics: stored {stored:?}, build_info {build_info:?}, commits {commits:?}; names: {:?}",
                r.metrics.iter().map(|m| m.name.as_str()).collect::<std::collections::BTreeSet<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
