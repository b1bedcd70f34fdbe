//! Connection strings read as libpq reads them: the `postgres://` URL and
//! the `key=value` form, the TLS settings tokio-postgres does not know
//! (`sslmode=verify-ca|verify-full`, `sslrootcert`, `sslcert`, `sslkey`),
//! and the password from `PGPASSWORD` or a password file when the string has
//! none.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::Host;

use super::tls::{SslMode, TlsSettings};

/// Where and how to connect to one PostgreSQL server.
#[derive(Clone)]
pub struct PgTarget {
    pub config: tokio_postgres::Config,
    pub tls: TlsSettings,
    /// A password file that was skipped for its permissions (libpq skips it
    /// too): named in the error when the server then asks for a password.
    pub ignored_passfile: Option<PathBuf>,
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The keys Sluice reads itself; everything else goes to tokio-postgres.
/// (`tcp_user_timeout` is read here because libpq reads it in milliseconds
/// and tokio-postgres in seconds.)
const OWN_KEYS: &[&str] = &["sslmode", "sslrootcert", "sslcert", "sslkey", "passfile", "tcp_user_timeout"];

/// The libpq keys tokio-postgres reads (its own error does not name a key
/// it does not know, so unknown keys are refused here, by name).
const PASSED_KEYS: &[&str] = &[
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "sslnegotiation",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

fn check_key(key: &str) -> Result<(), String> {
    if OWN_KEYS.contains(&key) || PASSED_KEYS.contains(&key) {
        Ok(())
    } else {
        Err(format!(
            "connection option {key:?} is not supported (supported: {}, {})",
            OWN_KEYS.join(", "),
            PASSED_KEYS.join(", ")
        ))
    }
}

impl PgTarget {
    /// Parses a URL (`postgres://` or `postgresql://`) or a keyword string
    /// (`host=... dbname=...`). Anything else is an error, never a guess.
    pub fn parse(text: &str) -> Result<PgTarget, String> {
        let text = text.trim();
        let (rest, own, given) = if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            split_url(text)?
        } else if text.contains('=') {
            split_keywords(text)?
        } else {
            return Err(
                "not a PostgreSQL connection string: expected a postgres:// URL or key=value pairs (host=... dbname=...)"
                    .into(),
            );
        };
        let mut config = tokio_postgres::Config::from_str(&rest).map_err(|e| e.to_string())?;
        if let Some((_, ms)) = own.iter().rev().find(|(k, _)| k == "tcp_user_timeout") {
            let ms: u64 = ms.parse().map_err(|_| format!("tcp_user_timeout={ms}: expected milliseconds"))?;
            // 0: the system's default, as in libpq.
            if ms > 0 {
                config.tcp_user_timeout(Duration::from_millis(ms));
            }
        }
        apply_network_defaults(&mut config, &given);
        let get = |key: &str, env: &str| {
            own.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone()).or_else(|| std::env::var(env).ok())
        };
        let mode = get("sslmode", "PGSSLMODE").map(|m| SslMode::parse(&m)).transpose()?;
        let tls = TlsSettings::new(
            mode,
            get("sslrootcert", "PGSSLROOTCERT"),
            get("sslcert", "PGSSLCERT").map(PathBuf::from),
            get("sslkey", "PGSSLKEY").map(PathBuf::from),
        )?;
        config.ssl_mode(tls.wire_mode());
        let mut ignored_passfile = None;
        if config.get_password().is_none() {
            if let Ok(password) = std::env::var("PGPASSWORD") {
                config.password(password);
            } else if let Some(file) = get("passfile", "PGPASSFILE").map(PathBuf::from).or_else(default_passfile) {
                match passfile_lookup(&file, &config) {
                    Ok(Some(password)) => {
                        config.password(password);
                    }
                    Ok(None) => {}
                    Err(Ignored) => ignored_passfile = Some(file),
                }
            }
        }
        Ok(PgTarget { config, tls, ignored_passfile })
    }

    /// Why there is no password to send, when a password file was skipped.
    pub fn password_hint(&self) -> Option<String> {
        let file = self.ignored_passfile.as_ref()?;
        Some(format!(
            "the password file {} was ignored because group or others can read it (chmod 0600 it)",
            file.display()
        ))
    }

    /// The first host, as written (or the socket directory).
    pub fn host(&self) -> String {
        match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        }
    }

    /// `user@host:port/dbname (sslmode=...)`: the target without any secret,
    /// for log lines and `/status`.
    pub fn describe(&self) -> String {
        let c = &self.config;
        let host = self.host();
        let port = c.get_ports().first().copied().unwrap_or(5432);
        let user = c.get_user().unwrap_or("postgres");
        let db = c.get_dbname().unwrap_or(user);
        format!("{user}@{host}:{port}/{db} (sslmode={})", self.tls.mode)
    }
}

/// What is passed to tokio-postgres, Sluice's own keys with their values,
/// and every key the string names.
type Split = (String, Vec<(String, String)>, Vec<String>);

/// How long a connection attempt (TCP connect, TLS and login together)
/// may take, unless `connect_timeout` says otherwise.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive: probe an idle connection after this long ...
pub const KEEPALIVES_IDLE: Duration = Duration::from_secs(5);
/// ... then every this long, and give up after this many unanswered probes.
pub const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(2);
pub const KEEPALIVES_RETRIES: u32 = 3;
/// Data sent and not acknowledged by the peer's kernel for this long ends
/// the connection (`TCP_USER_TIMEOUT`).
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// libpq waits for the kernel's defaults (keepalive after 2 hours, no
/// connect bound), so a server whose machine died or whose link was cut
/// would hold Sluice for hours. Unless the string sets them, every
/// connection gets bounds of seconds: a dead peer is noticed in about 11 s
/// when idle (5 + 3 x 2) and 10 s when data is waiting.
fn apply_network_defaults(config: &mut tokio_postgres::Config, given: &[String]) {
    let unset = |key: &str| !given.iter().any(|k| k == key);
    if unset("connect_timeout") {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if unset("keepalives_idle") {
        config.keepalives_idle(KEEPALIVES_IDLE);
    }
    if unset("keepalives_interval") {
        config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    if unset("keepalives_retries") {
        config.keepalives_retries(KEEPALIVES_RETRIES);
    }
    if unset("tcp_user_timeout") {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
}

/// Removes Sluice's own keys from a URL's query; returns the rest and them.
fn split_url(text: &str) -> Result<Split, String> {
    let Some((base, query)) = text.split_once('?') else {
        return Ok((text.to_string(), Vec::new(), Vec::new()));
    };
    let mut given = Vec::new();
    let mut kept = Vec::new();
    let mut own = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = url::form_urlencoded::parse(pair.as_bytes()).next().unwrap_or_default();
        check_key(&key)?;
        given.push(key.to_string());
        if OWN_KEYS.contains(&key.as_ref()) {
            own.push((key.into_owned(), value.into_owned()));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rest, own, given))
}

/// Splits `key=value` pairs (values may be 'quoted' with \\ escapes), keeps
/// Sluice's own keys and writes the rest back for tokio-postgres.
fn split_keywords(text: &str) -> Result<Split, String> {
    let mut chars = text.chars().peekable();
    let mut kept = String::new();
    let mut own = Vec::new();
    let mut given = Vec::new();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!("invalid connection string: {key:?} has no value (expected {key}=VALUE)"));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("invalid connection string: the value of {key} has no closing quote")),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        check_key(&key)?;
        given.push(key.clone());
        if OWN_KEYS.contains(&key.as_str()) {
            own.push((key, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push_str(&format!("{key}='{quoted}' "));
        }
    }
    Ok((kept, own, given))
}

fn default_passfile() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| Path::new(&home).join(".pgpass"))
}

/// The password a libpq password file gives for this target: the first line
/// `host:port:database:user:password` whose fields match (`*` matches
/// anything; `\:` and `\\` are escapes). As libpq does, a file others can
/// read is ignored with a warning.
fn passfile_lookup(file: &Path, config: &tokio_postgres::Config) -> Result<Option<String>, Ignored> {
    let Ok(meta) = std::fs::metadata(file) else { return Ok(None) };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!("password file {} has group or world access and is ignored; chmod 0600 it", file.display());
            return Err(Ignored);
        }
    }
    let _ = meta;
    let Ok(text) = std::fs::read_to_string(file) else { return Ok(None) };
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        _ => "localhost".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = config.get_user().unwrap_or("postgres").to_string();
    let db = config.get_dbname().unwrap_or(&user).to_string();
    let wanted = [host.as_str(), port.as_str(), db.as_str(), user.as_str()];
    Ok(text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).find_map(|line| {
        let fields = passfile_fields(line);
        if fields.len() < 5 {
            return None;
        }
        let matches = wanted.iter().zip(&fields).all(|(want, field)| field == "*" || field == want);
        matches.then(|| fields[4..].join(":"))
    }))
}

/// A password file skipped for its permissions.
struct Ignored;

fn passfile_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut().expect("one field").extend(chars.next()),
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("one field").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_keywords_read_alike() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["ca.test".to_string()]).unwrap().self_signed(&key).unwrap();
        std::fs::write(&ca, cert.pem()).unwrap();
        let url = PgTarget::parse(&format!(
            "postgres://u:secret@db.example:6543/app?sslmode=verify-full&sslrootcert={}&application_name=x",
            ca.display()
        ))
        .unwrap();
        let kw = PgTarget::parse(&format!(
            "host=db.example port=6543 dbname=app user=u password='sec\\'ret' sslmode=verify-full sslrootcert={}",
            ca.display()
        ))
        .unwrap();
        for t in [&url, &kw] {
            assert_eq!(t.describe(), "u@db.example:6543/app (sslmode=verify-full)");
            assert_eq!(t.tls.mode, SslMode::VerifyFull);
            assert_eq!(t.config.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        }
        assert_eq!(url.config.get_application_name(), Some("x"));
        assert_eq!(kw.config.get_password(), Some(&b"sec'ret"[..]));
        assert!(!url.describe().contains("secret"));
    }

    #[test]
    fn network_bounds_apply_unless_the_string_sets_them() {
        let t = PgTarget::parse("postgres://u@h/db").unwrap();
        assert_eq!(t.config.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
        assert_eq!(t.config.get_keepalives_idle(), KEEPALIVES_IDLE);
        assert_eq!(t.config.get_keepalives_interval(), Some(KEEPALIVES_INTERVAL));
        assert_eq!(t.config.get_keepalives_retries(), Some(KEEPALIVES_RETRIES));
        assert_eq!(t.config.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let own = PgTarget::parse("host=h dbname=db connect_timeout=3 keepalives_idle=60 tcp_user_timeout=0").unwrap();
        assert_eq!(own.config.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(own.config.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(own.config.get_tcp_user_timeout(), None, "0 is the system's default, as in libpq");
        // Milliseconds, as libpq reads it.
        let url = PgTarget::parse("postgres://u@h/db?tcp_user_timeout=2500").unwrap();
        assert_eq!(url.config.get_tcp_user_timeout(), Some(&Duration::from_millis(2500)));
        assert_eq!(own.config.get_keepalives_interval(), Some(KEEPALIVES_INTERVAL), "the rest keep Sluice's");
    }

    #[test]
    fn no_silent_fallback() {
        let e = PgTarget::parse("changelog.db").unwrap_err();
        assert!(e.contains("not a PostgreSQL connection string"), "{e}");
        let e = PgTarget::parse("postgres://h/db?sslmode=sometimes").unwrap_err();
        assert!(e.contains("sslmode"), "{e}");
        let e = PgTarget::parse("host=h dbname").unwrap_err();
        assert!(e.contains("dbname"), "{e}");
        let e = PgTarget::parse("host=h bogus=1").unwrap_err();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn the_password_file_is_read_as_libpq_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pgpass");
        std::fs::write(&file, "# comment\nother:5432:*:u:nope\ndb.example:*:app:u:pa\\:ss:word\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let url = format!("postgres://u@db.example:6543/app?passfile={}", file.display());
        let t = PgTarget::parse(&url).unwrap();
        assert_eq!(t.config.get_password(), Some(&b"pa:ss:word"[..]));
        let t = PgTarget::parse(&format!("postgres://u@db.example/other?passfile={}", file.display())).unwrap();
        assert_eq!(t.config.get_password(), None);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let ignored = PgTarget::parse(&url).unwrap();
            assert_eq!(ignored.config.get_password(), None);
            // The error a server asking for a password then causes says why there was none.
            let hint = ignored.password_hint().unwrap();
            assert!(hint.contains(&file.display().to_string()) && hint.contains("chmod 0600"), "{hint}");
            let line = crate::pgconn::explain("invalid configuration: password missing".into(), &ignored);
            assert!(line.ends_with(&hint), "{line}");
        }
    }
}
