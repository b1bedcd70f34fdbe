//! Reaching an upstream from the sandbox. Plugins get no sockets beyond the
//! endpoints the operator allowed (`--allow-net`, or the `host`/`url` in the
//! plugin's configuration); within those, plain blocking `std::net` works,
//! and WASI turns it into host polls.
//!
//! TLS is the host's (the contract's `tls` interface): [`connect_tls`] for
//! a protocol that is TLS from the first byte, [`Tunnel`] for one that
//! upgrades in-band. The plugin reads and writes plain bytes either way.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Connects to `host:port`, trying each address it resolves to within
/// `timeout`, and sets `timeout` as the read and write timeout. The error
/// names the address and the cause ("cannot connect to 127.0.0.1:3306:
/// connection refused").
pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, String> {
    let addrs = (host, port).to_socket_addrs().map_err(|e| format!("cannot resolve {host}:{port}: {e}"))?;
    let mut last = format!("{host}:{port} resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                stream.set_read_timeout(Some(timeout)).map_err(|e| format!("setting a read timeout: {e}"))?;
                stream.set_write_timeout(Some(timeout)).map_err(|e| format!("setting a write timeout: {e}"))?;
                return Ok(stream);
            }
            Err(e) => last = format!("cannot connect to {addr}: {e}"),
        }
    }
    Err(last)
}

use crate::source_world::sluice::plugin::tls;

/// Connects to `host:port` over TLS from the first byte (HTTPS, WSS): the
/// host does the handshake and checks the certificate (the config's
/// `tls_ca`, else the system's CAs) before this returns. The stream is
/// plain to the plugin; timeouts as for [`connect`].
pub fn connect_tls(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, String> {
    let tunnel = tls::open_tunnel(host, port, tls::TlsStart::AtOnce)?;
    dial_tunnel(&tunnel.address, timeout)
}

/// A connection whose TLS starts when the protocol says so (MySQL's SSL
/// request): plain until [`Tunnel::start_tls`], TLS to the upstream after.
pub struct Tunnel {
    id: u32,
}

impl Tunnel {
    /// Connects to `host:port` in the clear, through the host, which can
    /// start TLS on it later.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<(Tunnel, TcpStream), String> {
        let tunnel = tls::open_tunnel(host, port, tls::TlsStart::OnRequest)?;
        let stream = dial_tunnel(&tunnel.address, timeout)?;
        Ok((Tunnel { id: tunnel.id }, stream))
    }

    /// Starts TLS after the first `sent` bytes the plugin wrote (every byte
    /// it has written so far); returns once the handshake is done and the
    /// certificate checked. Write nothing more before it returns.
    pub fn start_tls(&self, sent: u64) -> Result<(), String> {
        tls::start_tls(self.id, sent)
    }
}

fn dial_tunnel(address: &str, timeout: Duration) -> Result<TcpStream, String> {
    let (host, port) =
        address.rsplit_once(':').ok_or_else(|| format!("the host's tunnel {address:?} is not HOST:PORT"))?;
    let port = port.parse().map_err(|_| format!("the host's tunnel {address:?} is not HOST:PORT"))?;
    connect(host, port, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connects_or_names_the_address_and_cause() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stream = connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        assert_eq!(stream.read_timeout().unwrap(), Some(Duration::from_secs(5)));
        drop(listener);
        let err = connect("127.0.0.1", port, Duration::from_secs(5)).unwrap_err();
        assert!(err.starts_with(&format!("cannot connect to 127.0.0.1:{port}: ")), "{err}");
        let err = connect("no-such-host.invalid", 1, Duration::from_secs(5)).unwrap_err();
        assert!(err.starts_with("cannot resolve no-such-host.invalid:1: "), "{err}");
    }
}
