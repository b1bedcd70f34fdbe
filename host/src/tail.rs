//! `sluice tail`: a small subscriber for people. Prints each message, acks
//! as it goes.

use std::io::Write;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use serde_json::value::RawValue;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

pub struct TailOptions {
    /// `ws://HOST:PORT` (or `http://`).
    pub url: String,
    pub watermark: Option<String>,
    pub replica_version: Option<String>,
    /// Exit after this many commits.
    pub max_tx: Option<u64>,
    /// Print raw messages instead of one readable line each.
    pub json: bool,
    /// `NAME` or `NAME=CONFIG_JSON` of each filter, in order.
    pub filters: Vec<String>,
}

/// The `filters` query parameter for `--filter` arguments.
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
    Ok(Some(percent_encode(&serde_json::Value::Array(specs).to_string())))
}

/// Query-string encoding: unreserved characters as they are, the rest as %XX.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn host_port(url: &str) -> anyhow::Result<String> {
    let rest = url
        .strip_prefix("ws://")
        .or_else(|| url.strip_prefix("http://"))
        .with_context(|| format!("{url}: expected ws://HOST:PORT"))?;
    Ok(rest.trim_end_matches('/').to_string())
}

/// `GET /status` from the server, for defaults.
async fn status(addr: &str) -> anyhow::Result<serde_json::Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    s.write_all(format!("GET /status HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    let (_, json) = body.split_once("\r\n\r\n").context("malformed /status response")?;
    serde_json::from_str(json).context("parsing /status")
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

pub async fn run(opts: TailOptions) -> anyhow::Result<()> {
    let addr = host_port(&opts.url)?;
    let (rv, wm) = match (opts.replica_version.clone(), opts.watermark.clone()) {
        (Some(rv), Some(wm)) => (rv, wm),
        (rv, wm) => {
            let s = status(&addr).await?;
            let rv = rv.or_else(|| s["replicaVersion"].as_str().map(str::to_string));
            let rv = rv.context("the server has no replica version yet; pass --replica-version")?;
            let wm = wm.or_else(|| s["minWatermark"].as_str().map(str::to_string)).unwrap_or_else(|| rv.clone());
            (rv, wm)
        }
    };
    let mut url = format!(
        "ws://{addr}/replication/v6/changes?id=tail-{}&taskID=tail&mode=serving&replicaVersion={rv}&watermark={wm}&initial=false",
        std::process::id()
    );
    if let Some(f) = filters_param(&opts.filters)? {
        url.push_str("&filters=");
        url.push_str(&f);
    }
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(&url, None, true)
        .await
        .with_context(|| format!("connecting to {url}"))?;
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
