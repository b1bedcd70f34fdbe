//! How the stream endpoints end a connection, shared by the subscriber
//! endpoint (`changes.rs`) and the custom change-source endpoint
//! (`upstream.rs`): Zero's error close, and the bound on a write a peer
//! does not take.

use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket};

use crate::subscriber::Subscriber;

/// The close code of an error (Zero closes with 1002 and `Error: ...`).
pub const PROTOCOL_ERROR: u16 = 1002;

/// Closes with 1002 and `Error: <message>`, cut to 123 bytes like Zero's `elide`.
pub async fn close_with_error(mut socket: WebSocket, message: &str) {
    tracing::info!("closing subscriber connection: {message}");
    let _ = socket.send(error_close(message)).await;
}

/// The close frame [`close_with_error`] sends.
pub fn error_close(message: &str) -> Message {
    let reason = elide(&format!("Error: {message}"), 123);
    Message::Close(Some(CloseFrame { code: PROTOCOL_ERROR, reason: reason.into() }))
}

/// `s` cut to `max` bytes with `...`, like Zero's `elide`.
pub fn elide(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// The longest one write (at most 64 KiB) may wait for the peer to take
/// it. A reader that slow (3 KiB/s) is better off catching up anew.
pub const WRITE_STALL_LIMIT: Duration = Duration::from_secs(20);

/// Runs a socket write, giving up once the subscriber has been closed for a
/// second: a peer that stops reading fills the socket and blocks writes, and
/// closing it must still end the connection.
pub async fn until_closed<E: std::fmt::Display>(
    sub: &Subscriber,
    write: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), String> {
    tokio::select! {
        r = write => r.map_err(|e| format!("send failed: {e}")),
        _ = tokio::time::sleep(WRITE_STALL_LIMIT) => Err(format!(
            "the peer took nothing of a write for {} s (a silent network path or a stuck reader)",
            WRITE_STALL_LIMIT.as_secs()
        )),
        _ = async {
            sub.closed().await;
            // Give what was queued before the close a moment to go out.
            tokio::time::sleep(Duration::from_secs(1)).await;
        } => Err("closed while the peer was not reading".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elides_long_reasons_to_123_bytes() {
        let long = "x".repeat(300);
        let e = elide(&long, 123);
        assert_eq!(e.len(), 123);
        assert!(e.ends_with("..."));
        assert_eq!(elide("short", 123), "short");
    }
}
