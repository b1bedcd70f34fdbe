//! `sluice postgres status | drop-slot | uninstall`: what the built-in
//! Postgres source keeps in the upstream (its replication slot, its
//! publication, the `_sluice` schema and the DDL event trigger), and
//! removing it when Sluice is retired. An abandoned slot makes the server
//! keep WAL for it forever (up to `max_slot_wal_keep_size`).

use anyhow::Context;
use serde::Serialize;

use crate::pgconn::PgTarget;
use crate::source::postgres::PostgresSourceConfig;

/// The upstream and the names the source's configuration gives.
pub struct Upstream {
    target: PgTarget,
    config: PostgresSourceConfig,
}

/// What `sluice postgres status` reports.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UpstreamStatus {
    pub upstream: String,
    pub slot: String,
    /// `None`: the slot does not exist.
    pub slot_state: Option<SlotStatus>,
    /// The publications the source reads, and whether each exists.
    pub publications: Vec<(String, bool)>,
    pub sluice_schema: bool,
    pub event_trigger: bool,
    /// Slots recorded in `_sluice.slots` (this one and any other Sluice's).
    pub recorded_slots: Vec<String>,
    pub max_slot_wal_keep_size: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotStatus {
    pub active: bool,
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (pg_replication_slots).
    pub wal_status: Option<String>,
    pub restart_lsn: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    /// WAL the server keeps for this slot, in bytes.
    pub retained_wal_bytes: Option<i64>,
}

impl Upstream {
    /// From the source configuration `sluice run --source postgres` takes.
    pub fn from_config(config_json: &str) -> anyhow::Result<Upstream> {
        let config = PostgresSourceConfig::parse(config_json).map_err(anyhow::Error::msg)?;
        let target = PgTarget::parse(&config.url).map_err(|e| anyhow::anyhow!("postgres source config: url: {e}"))?;
        Ok(Upstream { target, config })
    }

    async fn connect(&self) -> anyhow::Result<crate::pgconn::PgClient> {
        super::connect_postgres(&self.target, "the upstream").await
    }

    pub async fn status(&self) -> anyhow::Result<UpstreamStatus> {
        let client = self.connect().await?;
        let slot = &self.config.slot;
        let slot_state = client
            .query_opt(
                "SELECT active, active_pid, wal_status, restart_lsn::text, confirmed_flush_lsn::text, \
                        pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[slot],
            )
            .await
            .context("reading pg_replication_slots")?
            .map(|r| SlotStatus {
                active: r.get(0),
                active_pid: r.get(1),
                wal_status: r.get(2),
                restart_lsn: r.get(3),
                confirmed_flush_lsn: r.get(4),
                retained_wal_bytes: r.get(5),
            });
        let mut publications = Vec::new();
        for name in self.config.publication_names() {
            let exists = client
                .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
                .await
                .context("reading pg_publication")?
                .is_some();
            publications.push((name, exists));
        }
        let recorded = recorded_slots(&client).await?;
        let sluice_schema = recorded.is_some();
        let event_trigger = client
            .query_opt("SELECT 1 FROM pg_event_trigger WHERE evtname = '_sluice_ddl'", &[])
            .await
            .context("reading pg_event_trigger")?
            .is_some();
        let recorded_slots = recorded.unwrap_or_default();
        let max_slot_wal_keep_size: String = client
            .query_one("SHOW max_slot_wal_keep_size", &[])
            .await
            .context("reading max_slot_wal_keep_size")?
            .get(0);
        Ok(UpstreamStatus {
            upstream: self.target.describe(),
            slot: slot.clone(),
            slot_state,
            publications,
            sluice_schema,
            event_trigger,
            recorded_slots,
            max_slot_wal_keep_size,
        })
    }

    /// Drops the replication slot (refused while a Sluice streams from it).
    /// Returns whether there was one.
    pub async fn drop_slot(&self) -> anyhow::Result<bool> {
        let client = self.connect().await?;
        self.drop_slot_with(&client).await
    }

    async fn drop_slot_with(&self, client: &tokio_postgres::Client) -> anyhow::Result<bool> {
        let slot = &self.config.slot;
        let row = client
            .query_opt("SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = $1", &[slot])
            .await
            .context("reading pg_replication_slots")?;
        let dropped = match row {
            None => false,
            Some(r) if r.get::<_, bool>(0) => anyhow::bail!(
                "slot {slot} is in use (by backend pid {}): stop the Sluice that streams from it first",
                r.get::<_, Option<i32>>(1).map(|p| p.to_string()).unwrap_or_else(|| "?".into())
            ),
            Some(_) => {
                client
                    .execute("SELECT pg_drop_replication_slot($1)", &[slot])
                    .await
                    .with_context(|| format!("dropping slot {slot}"))?;
                true
            }
        };
        // Forget it, so a later start takes a new snapshot rather than
        // looking for the slot.
        if recorded_slots(client).await?.is_some() {
            client
                .execute("DELETE FROM _sluice.slots WHERE slot = $1", &[slot])
                .await
                .context("updating _sluice.slots")?;
        }
        Ok(dropped)
    }

    /// Removes everything the source created: the slot, the publication
    /// it made (never one the configuration names), and, when no other
    /// slot is recorded, the event trigger and schema `_sluice`. Returns a
    /// line per thing done or kept.
    pub async fn uninstall(&self) -> anyhow::Result<Vec<String>> {
        let client = self.connect().await?;
        let mut done = Vec::new();
        let slot = &self.config.slot;
        if self.drop_slot_with(&client).await? {
            done.push(format!("dropped replication slot {slot}"));
        } else {
            done.push(format!("no replication slot {slot}"));
        }
        if self.config.publications.is_empty() {
            let name = self.config.default_publication();
            client
                .batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", crate::storage::postgres::quote_ident(&name)))
                .await
                .with_context(|| format!("dropping publication {name}"))?;
            done.push(format!("dropped publication {name} (if it existed)"));
        } else {
            done.push(format!(
                "kept publications {} (yours: the configuration names them)",
                self.config.publications.join(", ")
            ));
        }
        let others = recorded_slots(&client).await?.unwrap_or_default();
        if others.is_empty() {
            client
                .batch_execute("DROP EVENT TRIGGER IF EXISTS _sluice_ddl; DROP SCHEMA IF EXISTS _sluice CASCADE")
                .await
                .context("dropping the event trigger _sluice_ddl and schema _sluice")?;
            done.push("dropped event trigger _sluice_ddl and schema _sluice".into());
        } else {
            done.push(format!(
                "kept event trigger _sluice_ddl and schema _sluice: other slots use them ({})",
                others.join(", ")
            ));
        }
        if let Some(zero) = &self.config.zero {
            done.push(format!(
                "kept Zero's tables of app {} shard {} (zero-cache's, not Sluice's)",
                zero.app_id, zero.shard_num
            ));
        }
        Ok(done)
    }
}

/// The slots recorded in `_sluice.slots`, or `None` without schema `_sluice`.
async fn recorded_slots(client: &tokio_postgres::Client) -> anyhow::Result<Option<Vec<String>>> {
    let schema = client
        .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = '_sluice'", &[])
        .await
        .context("reading pg_namespace")?;
    if schema.is_none() {
        return Ok(None);
    }
    let rows =
        client.query("SELECT slot FROM _sluice.slots ORDER BY slot", &[]).await.context("reading _sluice.slots")?;
    Ok(Some(rows.iter().map(|r| r.get(0)).collect()))
}

impl std::fmt::Display for UpstreamStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "upstream        {}", self.upstream)?;
        match &self.slot_state {
            None => writeln!(f, "slot            {} (does not exist)", self.slot)?,
            Some(s) => {
                let user = match (s.active, s.active_pid) {
                    (true, Some(pid)) => format!("active, backend pid {pid}"),
                    (true, None) => "active".into(),
                    _ => "inactive: nothing streams from it".into(),
                };
                writeln!(f, "slot            {} ({user})", self.slot)?;
                writeln!(f, "wal status      {}", s.wal_status.as_deref().unwrap_or("-"))?;
                writeln!(
                    f,
                    "positions       restart {} confirmed {}",
                    s.restart_lsn.as_deref().unwrap_or("-"),
                    s.confirmed_flush_lsn.as_deref().unwrap_or("-")
                )?;
                if let Some(bytes) = s.retained_wal_bytes {
                    writeln!(f, "retained WAL    {:.1} MiB", bytes as f64 / (1 << 20) as f64)?;
                }
            }
        }
        for (name, exists) in &self.publications {
            writeln!(f, "publication     {name}{}", if *exists { "" } else { " (does not exist)" })?;
        }
        writeln!(f, "schema _sluice  {}", if self.sluice_schema { "present" } else { "absent" })?;
        writeln!(f, "event trigger   {}", if self.event_trigger { "present" } else { "absent" })?;
        if !self.recorded_slots.is_empty() {
            writeln!(f, "recorded slots  {}", self.recorded_slots.join(", "))?;
        }
        writeln!(f, "max_slot_wal_keep_size {}", self.max_slot_wal_keep_size)
    }
}
