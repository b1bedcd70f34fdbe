//! `sluice tail`: a small subscriber for people. Prints each message, acks
//! as it goes. It reaches the endpoint as the admin commands do
//! (`admin::http::Endpoint`: the token, TLS with `--ca`).

use std::io::Write;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use serde_json::value::RawValue;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::admin::http::Endpoint;

pub struct TailOptions {
    /// `ws://` or `wss://HOST:PORT` (or `http://`, `https://`), the token
    /// and the CA.
    pub endpoint: Endpoint,
    /// Start at the newest transaction the server has, not the oldest.
    pub from_head: bool,
    pub watermark: Option<String>,
    pub replica_version: Option<String>,
    /// Exit after this many commits.
    pub max_tx: Option<u64>,
    /// Print raw messages instead of one readable line each.
    pub json: bool,
    /// `NAME` or `NAME=CONFIG_JSON` of each filter, in order.
    pub filters: Vec<String>,
}

/// The `filters` query parameter's value for `--filter` arguments (JSON;
/// the URL encodes it).
pub fn filters_param(filters: &[String]) -> anyhow::Result<Option<String>> {
    if filters.is_empty() {
        return Ok(None);
    }
    let mut specs = Vec::new();
    for f in filters {
        let (plugin, config) = match f.split_once('=') {
            Some((p, c)) => {
                let c: serde_json::Value =
                    serde_json::from_str(c).with_context(|| format!("--filter {f}: the config is not valid JSON"))?;
                (p, c)
            }
            None => (f.as_str(), serde_json::json!({})),
        };
        specs.push(serde_json::json!({ "plugin": plugin, "config": config }));
    }
    Ok(Some(serde_json::Value::Array(specs).to_string()))
}

/// `GET /status` from the server, for defaults.
async fn status(endpoint: &Endpoint) -> anyhow::Result<serde_json::Value> {
    let answer = endpoint.request("GET", "/status").await?;
    anyhow::ensure!(
        answer.status == 200,
        "{}/status answered {}: {}{}",
        endpoint.url.trim_end_matches('/'),
        answer.status,
        answer.body.trim(),
        if answer.status == 401 { " (pass --token or set SLUICE_TOKEN)" } else { "" }
    );
    serde_json::from_str(&answer.body).context("parsing /status")
}

/// One readable line for a downstream message.
pub fn describe(msg: &serde_json::Value) -> String {
    let kind = msg[0].as_str().unwrap_or("?");
    let body = &msg[1];
    match kind {
        "begin" => format!("begin  {}", msg[2]["commitWatermark"].as_str().unwrap_or("?")),
        "commit" => format!("commit {}", msg[2]["watermark"].as_str().unwrap_or("?")),
        "rollback" => "rollback".into(),
        "status" => "status".into(),
        "error" => format!("error  type={} {}", body["type"], body["message"].as_str().unwrap_or("")),
        "data" => {
            let tag = body["tag"].as_str().unwrap_or("?");
            let rel = &body["relation"];
            let table = format!("{}.{}", rel["schema"].as_str().unwrap_or("?"), rel["name"].as_str().unwrap_or("?"));
            match tag {
                "insert" | "update" => format!("  {tag} {table} {}", body["new"]),
                "delete" => format!("  {tag} {table} {}", body["key"]),
                _ => format!("  {tag} {}", body),
            }
        }
        _ => msg.to_string(),
    }
}

/// The subscription's URL: `/replication/v6/changes` on the endpoint, with
/// Zero's query parameters.
fn stream_url(endpoint: &Endpoint, rv: &str, wm: &str, filters: Option<String>) -> anyhow::Result<url::Url> {
    let (tls, _, authority) = endpoint.parts()?;
    let base = format!("{}://{authority}/replication/v6/changes", if tls { "wss" } else { "ws" });
    let mut url = url::Url::parse(&base).with_context(|| format!("{base} is not a URL"))?;
    url.query_pairs_mut()
        .append_pair("id", &format!("tail-{}", std::process::id()))
        .append_pair("taskID", "tail")
        .append_pair("mode", "serving")
        .append_pair("replicaVersion", rv)
        .append_pair("watermark", wm)
        .append_pair("initial", "false");
    if let Some(f) = filters {
        url.query_pairs_mut().append_pair("filters", &f);
    }
    Ok(url)
}

pub async fn run(opts: TailOptions) -> anyhow::Result<()> {
    let endpoint = &opts.endpoint;
    let (rv, wm) = match (opts.replica_version.clone(), opts.watermark.clone()) {
        (Some(rv), Some(wm)) => (rv, wm),
        (rv, wm) => {
            let s = status(endpoint).await?;
            let rv = rv.or_else(|| s["replicaVersion"].as_str().map(str::to_string));
            let rv = rv.context("the server has no replica version yet; pass --replica-version")?;
            // The oldest kept, or with --from-head the newest: what follows it.
            let start = if opts.from_head { "lastWatermark" } else { "minWatermark" };
            let wm = wm.or_else(|| s[start].as_str().map(str::to_string)).unwrap_or_else(|| rv.clone());
            (rv, wm)
        }
    };
    let url = stream_url(endpoint, &rv, &wm, filters_param(&opts.filters)?)?;
    let mut request = url.as_str().into_client_request().context("the subscription request")?;
    if let Some(value) = endpoint.authorization() {
        request.headers_mut().insert("authorization", value.parse().context("the token is not a valid header value")?);
    }
    let stream = endpoint.connect().await?;
    let (mut ws, _) = tokio_tungstenite::client_async_with_config(request, stream, None)
        .await
        .with_context(|| format!("subscribing at {url}"))?;
    #[derive(serde::Deserialize)]
    struct Frame<'a> {
        id: u64,
        #[serde(borrow)]
        msg: &'a RawValue,
    }
    let mut commits = 0u64;
    let mut stdout = std::io::stdout().lock();
    while let Some(frame) = ws.next().await {
        match frame.context("reading from the server")? {
            Message::Text(text) => {
                let frame: Frame<'_> = serde_json::from_str(&text).context("server sent an invalid frame")?;
                let id = frame.id;
                let msg: serde_json::Value = serde_json::from_str(frame.msg.get())?;
                let line = if opts.json { frame.msg.get().to_string() } else { describe(&msg) };
                if writeln!(stdout, "{line}").is_err() {
                    // The reader went away (`| head`): a normal way to stop.
                    return Ok(());
                }
                ws.send(Message::Text(format!("{{\"ack\":{id}}}").into())).await?;
                if msg[0] == "error" {
                    anyhow::bail!("the server ended the subscription: {}", msg[1]["message"]);
                }
                if msg[0] == "commit" {
                    commits += 1;
                    if opts.max_tx.is_some_and(|n| commits >= n) {
                        let _ = ws.close(None).await;
                        // Finish the closing handshake.
                        while let Some(Ok(_)) = ws.next().await {}
                        return Ok(());
                    }
                }
            }
            Message::Close(frame) => {
                if let Some(f) = frame.filter(|f| !f.reason.is_empty()) {
                    anyhow::bail!("the server closed the connection: {} {}", u16::from(f.code), f.reason);
                }
                return Ok(());
            }
            _ => {}
        }
    }
    Ok(())
}
