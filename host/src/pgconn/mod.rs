//! Connecting to PostgreSQL, for the Postgres source and the Postgres change
//! DB alike: connection strings as libpq reads them ([`conninfo`]), TLS with
//! rustls ([`tls`]), and error lines that say what to change.

pub mod conninfo;
pub mod tls;

pub use conninfo::PgTarget;

/// A normal connection: the client, and the task that drives its socket.
/// Dropping it ends the task too, so a connection given up on (a deadline
/// passed on a silent link) does not linger with its socket until the kernel
/// notices.
pub struct PgClient {
    client: tokio_postgres::Client,
    task: tokio::task::AbortHandle,
}

impl std::ops::Deref for PgClient {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.client
    }
}

impl std::fmt::Debug for PgClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.client.fmt(f)
    }
}

impl Drop for PgClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Opens a normal (non-replication) connection with `config` (the target's,
/// possibly with session settings added) and the target's TLS; the
/// connection's task is spawned. The whole attempt (TCP, TLS, login) is
/// bounded by `connect_timeout`, as libpq bounds it: tokio-postgres bounds
/// only the TCP connect, and a server that accepts and then says nothing
/// would hold the attempt forever.
pub async fn connect(target: &PgTarget, config: &tokio_postgres::Config) -> Result<PgClient, ConnectError> {
    let bound = config.get_connect_timeout().copied().unwrap_or(conninfo::CONNECT_TIMEOUT);
    let (client, connection) = tokio::time::timeout(bound, config.connect(target.tls.connector()))
        .await
        .map_err(|_| ConnectError::TimedOut(bound))??;
    let task = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("PostgreSQL connection closed: {e}");
        }
    });
    Ok(PgClient { client, task: task.abort_handle() })
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("no answer within {} s (connect_timeout)", .0.as_secs_f64())]
    TimedOut(std::time::Duration),
}

impl ConnectError {
    /// The text of the error with its causes (see [`error_text`]).
    pub fn text(&self) -> String {
        match self {
            ConnectError::Postgres(e) => error_text(e),
            ConnectError::TimedOut(_) => self.to_string(),
        }
    }

    pub fn postgres(&self) -> Option<&tokio_postgres::Error> {
        match self {
            ConnectError::Postgres(e) => Some(e),
            ConnectError::TimedOut(_) => None,
        }
    }
}

/// A tokio-postgres error with its causes: its own `Display` stops at
/// "error performing TLS handshake" or "db error".
pub fn error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} (SQLSTATE {})", db.message(), db.code().code());
    }
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// What to change, for the TLS failures an operator can fix.
pub fn tls_hint(error: &str, target: &PgTarget) -> Option<String> {
    let mode = target.tls.mode;
    if error.contains("UnknownIssuer") || error.contains("BadSignature") {
        Some(format!(
            "the server's certificate is not signed by the CA in sslrootcert (sslmode={mode}); give the CA that \
             signed it, or use sslmode=require to encrypt without checking"
        ))
    } else if error.contains("NotValidForName") || error.contains("not valid for name") {
        Some(format!(
            "the server's certificate does not name the host {} (sslmode=verify-full); connect by a name the \
             certificate lists, or use sslmode=verify-ca",
            target.host()
        ))
    } else if error.contains("Expired") || error.contains("NotValidYet") {
        Some("the server's certificate is outside its validity period; renew it".into())
    } else if error.contains("server does not support TLS") || error.contains("does not accept TLS") {
        Some(format!(
            "the server does not accept TLS (sslmode={mode}); turn ssl on in the server, or use sslmode=prefer"
        ))
    } else if error.contains("no pg_hba.conf entry") && error.contains("no encryption") {
        Some("the server accepts only TLS connections; use sslmode=require or stronger".into())
    } else {
        None
    }
}

/// A TLS failure the next attempt will hit again (a certificate that does
/// not verify): stop instead of retrying.
pub fn is_tls_refusal(error: &str) -> bool {
    error.contains("invalid peer certificate") || error.contains("server does not support TLS")
}

/// `error` with the hint appended, if there is one.
pub fn explain(error: String, target: &PgTarget) -> String {
    let password = (error.contains("password")).then(|| target.password_hint()).flatten();
    match tls_hint(&error, target).or(password) {
        Some(hint) => format!("{error}: {hint}"),
        None => error,
    }
}

/// A connection the client refused to attempt for its configuration (no
/// password for a server that asks for one, an impossible option): the
/// next attempt would fail alike, so it is not retried.
pub fn is_config_error(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_none() && error_text(e).starts_with("invalid configuration")
}
