//! A fault-injecting TCP proxy for the network-fault tests: it forwards a
//! loopback port to a target and, on command, stops forwarding with the
//! sockets left open (a silent partition: what a NAT or load balancer that
//! dropped the flow, or a dead machine, looks like to the other end), closes
//! every connection, or delays each chunk.
//!
//! A blackhole stops reading from both sides, so what was sent waits in the
//! kernel's buffers and arrives in order once the link heals, as after a
//! real partition that TCP outlived; new connections are accepted (the
//! proxy's kernel does that) and hang the same way.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Bytes flow.
    Up,
    /// Nothing flows either way; sockets stay open.
    Blackhole,
    /// Every chunk waits this long before it is passed on.
    Slow(Duration),
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    link: watch::Sender<Link>,
    /// Bumped to reset every open connection.
    resets: watch::Sender<u64>,
    connections: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Forwards a fresh loopback port to `target`.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (link, link_rx) = watch::channel(Link::Up);
        let (resets, resets_rx) = watch::channel(0u64);
        let connections = Arc::new(Mutex::new(0));
        let counted = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                *counted.lock().unwrap() += 1;
                let (link, resets) = (link_rx.clone(), resets_rx.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else { return };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let mut reset = resets.clone();
                    reset.borrow_and_update();
                    tokio::select! {
                        _ = pipe(cr, sw, link.clone()) => {}
                        _ = pipe(sr, cw, link) => {}
                        _ = reset.changed() => {}
                    }
                    // Dropping both halves closes both sockets.
                });
            }
        });
        FaultProxy { addr, link, resets, connections, task }
    }

    /// `host:port` of the proxy's end.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    pub fn set(&self, link: Link) {
        self.link.send_replace(link);
    }

    /// Closes every connection open now, both ways at once (new ones are
    /// proxied as before).
    pub fn reset_all(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        *self.connections.lock().unwrap()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` while the link allows it.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: watch::Receiver<Link>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // Hold here while blackholed: nothing is read, so nothing is lost.
        let state = loop {
            let state = *link.borrow_and_update();
            if state != Link::Blackhole {
                break state;
            }
            if link.changed().await.is_err() {
                return;
            }
        };
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            // A blackhole that begins while waiting to read takes effect now.
            _ = link.changed() => continue,
        };
        if let Link::Slow(delay) = state {
            tokio::time::sleep(delay).await;
        }
        // Bytes read just as the blackhole began wait until it ends.
        while *link.borrow() == Link::Blackhole {
            if link.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
