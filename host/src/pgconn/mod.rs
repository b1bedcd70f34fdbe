//! Connecting to PostgreSQL, for the Postgres source and the Postgres change
//! DB alike: connection strings as libpq reads them ([`conninfo`]), TLS with
//! rustls ([`tls`]), and error lines that say what to change.

pub mod conninfo;
pub mod tls;

pub use conninfo::PgTarget;

/// Opens a normal (non-replication) connection with `config` (the target's,
/// possibly with session settings added) and the target's TLS; the
/// connection's task is spawned.
pub async fn connect(
    target: &PgTarget,
    config: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(target.tls.connector()).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("PostgreSQL connection closed: {e}");
        }
    });
    Ok(client)
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
    match tls_hint(&error, target) {
        Some(hint) => format!("{error}: {hint}"),
        None => error,
    }
}
