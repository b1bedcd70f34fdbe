//! Which network addresses a source plugin may reach.
//!
//! A plugin gets no network unless the host grants it, and the host grants
//! only what the operator wrote: the upstream named in the plugin's own
//! configuration (a `url`, or `host` and `port`) plus any `--allow-net`
//! addresses. Names are resolved once, when the host starts.

use std::net::{SocketAddr, ToSocketAddrs};

use anyhow::Context;

use super::NetGrant;

/// The `HOST:PORT` endpoints a source configuration names.
///
/// * `"url": "ws://host:port/path"`: the URL's host and port; without a port,
///   the scheme's default (ws/http 80, wss/https 443, postgres 5432,
///   mysql/mariadb 3306).
/// * `"host": "...", "port": N`: that address.
pub fn config_endpoints(config: &str) -> anyhow::Result<Vec<String>> {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(config) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    if let Some(url) = map.get("url") {
        let text = url.as_str().context("source config: `url` must be a string")?;
        let parsed = url::Url::parse(text).with_context(|| format!("source config: `url` {text:?} is not a URL"))?;
        let host = parsed.host_str().with_context(|| format!("source config: `url` {text:?} has no host"))?;
        let port = parsed.port().or_else(|| default_port(parsed.scheme())).with_context(|| {
            format!("source config: `url` {text:?} has no port and {}: has no default", parsed.scheme())
        })?;
        out.push(join(host, port));
    }
    if let Some(host) = map.get("host") {
        let host = host.as_str().context("source config: `host` must be a string")?;
        let port = match map.get("port") {
            Some(p) => p
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .context("source config: `port` must be a number from 0 to 65535")?,
            None => anyhow::bail!("source config: `host` needs a `port` beside it"),
        };
        out.push(join(host, port));
    }
    Ok(out)
}

/// What a source plugin with `config` may reach: the upstream its
/// configuration names plus `allow_net`, and the trust anchors for TLS to
/// them (`tls_ca`).
pub fn grant_for(config: &str, allow_net: &[String]) -> anyhow::Result<NetGrant> {
    let mut endpoints = config_endpoints(config)?;
    endpoints.extend(allow_net.iter().cloned());
    let mut grant = resolve(&endpoints)?;
    grant.tls_ca = config_tls_ca(config)?;
    if !grant.connect.is_empty() {
        tracing::info!(endpoints = ?endpoints, "the source plugin may connect to {} address(es)", grant.connect.len());
    }
    Ok(grant)
}

/// The `tls_ca` a source configuration names: the PEM file the host checks
/// its TLS upstream's certificate with.
pub fn config_tls_ca(config: &str) -> anyhow::Result<Option<std::path::PathBuf>> {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(config) else {
        return Ok(None);
    };
    match map.get("tls_ca") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => {
            let path = v.as_str().context("source config: `tls_ca` must be a file path")?;
            anyhow::ensure!(std::path::Path::new(path).is_file(), "source config: `tls_ca` {path:?} is not a file");
            Ok(Some(path.into()))
        }
    }
}

fn default_port(scheme: &str) -> Option<u16> {
    Some(match scheme {
        "ws" | "http" => 80,
        "wss" | "https" => 443,
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        _ => return None,
    })
}

fn join(host: &str, port: u16) -> String {
    // `Url::host_str` keeps IPv6 brackets, which `ToSocketAddrs` wants too.
    format!("{host}:{port}")
}

/// Resolves every endpoint into the addresses the plugin may connect to.
pub fn resolve(endpoints: &[String]) -> anyhow::Result<NetGrant> {
    let mut connect: Vec<SocketAddr> = Vec::new();
    for e in endpoints {
        let addrs = e.to_socket_addrs().with_context(|| format!("network grant {e}: not a HOST:PORT that resolves"))?;
        for a in addrs {
            if !connect.contains(&a) {
                connect.push(a);
            }
        }
    }
    Ok(NetGrant { connect, tls_ca: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_from_config() {
        let e = |c: &str| config_endpoints(c).unwrap();
        assert_eq!(e(r#"{"url":"ws://127.0.0.1:9000/changes/v0/stream"}"#), ["127.0.0.1:9000"]);
        assert_eq!(e(r#"{"url":"http://example.com/x"}"#), ["example.com:80"]);
        assert_eq!(e(r#"{"url":"wss://[::1]/x"}"#), ["[::1]:443"]);
        assert_eq!(e(r#"{"host":"db","port":3306,"user":"u"}"#), ["db:3306"]);
        assert!(e(r#"{"rate":5}"#).is_empty());
        assert!(e("").is_empty());
        assert!(config_endpoints(r#"{"url":"nonsense"}"#).is_err());
        assert!(config_endpoints(r#"{"url":"foo://h/x"}"#).unwrap_err().to_string().contains("no default"));
        assert!(config_endpoints(r#"{"host":"db"}"#).unwrap_err().to_string().contains("port"));
        assert!(config_endpoints(r#"{"host":"db","port":70000}"#).is_err());
    }

    #[test]
    fn resolves_and_dedups() {
        let g = resolve(&["127.0.0.1:9000".into(), "127.0.0.1:9000".into()]).unwrap();
        assert_eq!(g.connect, vec!["127.0.0.1:9000".parse::<SocketAddr>().unwrap()]);
        assert!(resolve(&["no port".into()]).is_err());
    }
}
