//! Admin commands of the `sluice` binary: talking to a running Sluice
//! (`sluice reload`, `sluice health`), listing plugins, and working on what
//! Sluice keeps (the change log) or created upstream (the Postgres slot and
//! publication).

pub mod http;
pub mod log;
pub mod plugins;
pub mod postgres;

/// A connection for an admin command to a PostgreSQL server, named
/// `sluice-admin` in `pg_stat_activity`; `what` names the server in errors
/// ("the change DB", "the upstream").
pub(crate) async fn connect_postgres(
    target: &crate::pgconn::PgTarget,
    what: &str,
) -> anyhow::Result<crate::pgconn::PgClient> {
    let mut config = target.config.clone();
    config.application_name("sluice-admin");
    crate::pgconn::connect(target, &config)
        .await
        .map_err(|e| anyhow::anyhow!("connecting to {what} {}: {}", target.describe(), e.text()))
}
