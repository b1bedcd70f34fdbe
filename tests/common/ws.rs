//! A subscriber over a real WebSocket, speaking Zero's change-streamer
//! protocol: it acks every message it reads.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message as Ws;

pub const WAIT: Duration = Duration::from_secs(30);

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub struct Client {
    pub ws: Socket,
}

impl Client {
    pub async fn connect(addr: &str, query: &str) -> Client {
        let url = format!("ws://{addr}/replication/v6/changes?{query}");
        let (ws, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await.unwrap();
        Client { ws }
    }

    pub async fn subscribe(addr: &str, watermark: &str) -> Client {
        Client::subscribe_at(addr, "01", watermark).await
    }

    pub async fn subscribe_at(addr: &str, replica_version: &str, watermark: &str) -> Client {
        Client::connect(addr, &format!("id=test&taskID=t&replicaVersion={replica_version}&watermark={watermark}")).await
    }

    /// The next message's JSON (raw text of `msg`), acking it.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            let frame = tokio::time::timeout(WAIT, self.ws.next()).await.expect("a message in time")?.ok()?;
            match frame {
                Ws::Text(t) => {
                    #[derive(serde::Deserialize)]
                    struct Frame<'a> {
                        id: u64,
                        #[serde(borrow)]
                        msg: &'a serde_json::value::RawValue,
                    }
                    let f: Frame<'_> = serde_json::from_str(&t).unwrap();
                    self.ws.send(Ws::Text(format!("{{\"ack\":{}}}", f.id).into())).await.ok()?;
                    return Some(f.msg.get().to_string());
                }
                Ws::Close(_) => return None,
                _ => continue,
            }
        }
    }

    /// Reads `n` messages and summarises each as "tag watermark-or-detail".
    pub async fn take(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..n {
            let m = self.next().await.expect("stream still open");
            out.push(summary(&m));
        }
        out
    }

    pub async fn close_reason(mut self) -> (u16, String) {
        loop {
            match tokio::time::timeout(WAIT, self.ws.next()).await.expect("close in time") {
                Some(Ok(Ws::Close(Some(f)))) => return (u16::from(f.code), f.reason.to_string()),
                Some(Ok(Ws::Close(None))) | None => return (1005, String::new()),
                Some(Ok(_)) => continue,
                Some(Err(e)) => panic!("socket error before close: {e}"),
            }
        }
    }
}

pub fn summary(msg: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(msg).unwrap();
    match v[0].as_str().unwrap() {
        "begin" => format!("begin {}", v[2]["commitWatermark"].as_str().unwrap()),
        "commit" => format!("commit {}", v[2]["watermark"].as_str().unwrap()),
        "data" => format!(
            "{} {}",
            v[1]["tag"].as_str().unwrap(),
            v[1]["new"]["id"].as_i64().or(v[1]["key"]["id"].as_i64()).unwrap_or(-1)
        ),
        "error" => format!("error {} {}", v[1]["type"], v[1]["message"].as_str().unwrap_or("")),
        other => other.to_string(),
    }
}
