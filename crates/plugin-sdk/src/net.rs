//! Reaching an upstream from the sandbox. Plugins get no sockets beyond the
//! endpoints the operator allowed (`--allow-net`, or the `host`/`url` in the
//! plugin's configuration); within those, plain blocking `std::net` works,
//! and WASI turns it into host polls.

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
