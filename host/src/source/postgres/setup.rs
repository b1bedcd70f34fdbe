//! Upstream set-up: server checks, publications, Sluice's bookkeeping in
//! schema `_sluice`, the DDL event trigger, and the replication slot.

use std::time::{Duration, Instant};

use super::schema::{self, Schema};
use super::wire::{parse_lsn, ReplConnection};
use super::PostgresSourceConfig;
use crate::pgconn::{self, PgTarget};
use crate::source::SourceError;
use crate::watermark::to_lexi;

/// Session settings both connections use, so values arrive in the text forms
/// [`super::values`] parses.
const SESSION_OPTIONS: &str =
    "-c datestyle=ISO -c timezone=UTC -c bytea_output=hex -c extra_float_digits=3 -c intervalstyle=postgres";

pub const APPLICATION_NAME: &str = "sluice-replicator";

/// The upstream URL's settings plus [`SESSION_OPTIONS`].
pub fn session_config(pg: &PgTarget) -> tokio_postgres::Config {
    let mut cfg = pg.config.clone();
    let options = match pg.config.get_options() {
        Some(user) => format!("{SESSION_OPTIONS} {user}"),
        None => SESSION_OPTIONS.to_string(),
    };
    cfg.options(options);
    if cfg.get_application_name().is_none() {
        cfg.application_name(APPLICATION_NAME);
    }
    cfg
}

/// A failure of the normal (non-replication) upstream connection.
pub fn pg_error(what: &str, e: tokio_postgres::Error) -> SourceError {
    let text = format!("{what}: {}", pgconn::error_text(&e));
    let code = e.code().map(|c| c.code().to_string()).unwrap_or_default();
    // Wrong credentials, no such database, no privilege, no password to
    // send: retrying will not help.
    if code.starts_with("28") || code == "3D000" || code == "42501" || pgconn::is_config_error(&e) {
        SourceError::Fatal(text)
    } else {
        SourceError::Transient(text)
    }
}

/// A failure to connect: as [`pg_error`], with what to change for TLS
/// failures, and fatal where the next attempt would fail alike.
pub fn connect_error(pg: &PgTarget, what: &str, e: pgconn::ConnectError) -> SourceError {
    let what = format!("{what} {}", pg.describe());
    let error = match e {
        pgconn::ConnectError::Postgres(e) => pg_error(&what, e),
        timed_out => SourceError::Transient(format!("{what}: {timed_out}")),
    };
    match error {
        SourceError::Transient(text) if pgconn::is_tls_refusal(&text) => SourceError::Fatal(pgconn::explain(text, pg)),
        SourceError::Transient(text) => SourceError::Transient(pgconn::explain(text, pg)),
        SourceError::Fatal(text) => SourceError::Fatal(pgconn::explain(text, pg)),
    }
}

pub async fn connect_client(pg: &PgTarget, what: &str) -> Result<pgconn::PgClient, SourceError> {
    pgconn::connect(pg, &session_config(pg)).await.map_err(|e| connect_error(pg, what, e))
}

/// A checked upstream with Sluice's objects in place.
pub struct Upstream {
    pub client: pgconn::PgClient,
    pub slot: String,
    pub publications: Vec<String>,
    /// The event trigger is installed: schema changes arrive as messages.
    pub ddl_detection: bool,
}

pub enum SlotState {
    Usable { replica_version: String },
    Lost { replica_version: String, reason: String },
}

pub struct CreatedSlot {
    pub replica_version: String,
    pub consistent_point: u64,
    pub snapshot_name: String,
    /// The replication connection that exported the snapshot; it must stay
    /// open and idle until the snapshot has been read.
    pub connection: ReplConnection,
}

impl Upstream {
    pub async fn connect(pg: &PgTarget, config: &PostgresSourceConfig) -> Result<Self, SourceError> {
        let client = connect_client(pg, "connecting to the upstream").await?;
        let q = |sql: &'static str| {
            let client = &client;
            async move { client.query_one(sql, &[]).await.map(|r| r.get::<_, String>(0)).map_err(|e| pg_error(sql, e)) }
        };
        let version: i64 = q("SHOW server_version_num").await?.parse().unwrap_or(0);
        if version < 150000 {
            return Err(SourceError::Fatal(format!(
                "the upstream runs PostgreSQL {}.{}; Sluice needs 15 or later",
                version / 10000,
                version % 10000 / 100
            )));
        }
        let wal_level = q("SHOW wal_level").await?;
        if wal_level != "logical" {
            return Err(SourceError::Fatal(format!(
                "the upstream has wal_level = {wal_level}; logical replication needs wal_level = logical \
                 (ALTER SYSTEM SET wal_level = logical, then restart the server)"
            )));
        }
        client
            .batch_execute(&schema::metadata_sql())
            .await
            .map_err(|e| pg_error("creating Sluice's schema _sluice in the upstream", e))?;
        if let Some(zero) = &config.zero {
            client.batch_execute(&zero.setup_sql()).await.map_err(|e| {
                pg_error(&format!("creating Zero's tables for app {} shard {}", zero.app_id, zero.shard_num), e)
            })?;
        }
        let publications = config.publication_names();
        if config.publications.is_empty() {
            let name = &config.default_publication();
            let exists = client
                .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[name])
                .await
                .map_err(|e| pg_error("reading publications", e))?;
            if exists.is_none() {
                client
                    .batch_execute(&format!(
                        "CREATE PUBLICATION \"{name}\" FOR TABLES IN SCHEMA public WITH (publish_via_partition_root = true)"
                    ))
                    .await
                    .map_err(|e| {
                        pg_error(
                            &format!(
                                "creating publication {name} (without superuser rights, create a publication \
                                 FOR TABLE ... yourself and list it in \"publications\")"
                            ),
                            e,
                        )
                    })?;
                tracing::info!("created publication {name} for all tables of schema public");
            }
        }
        for name in &publications {
            let row = client
                .query_opt(
                    "SELECT pubinsert AND pubupdate AND pubdelete AND pubtruncate FROM pg_publication WHERE pubname = $1",
                    &[name],
                )
                .await
                .map_err(|e| pg_error("reading publications", e))?;
            match row {
                None => {
                    return Err(SourceError::Fatal(format!(
                        "publication {name} does not exist in the upstream (CREATE PUBLICATION {name} FOR TABLE ...)"
                    )))
                }
                Some(r) if !r.get::<_, bool>(0) => {
                    return Err(SourceError::Fatal(format!(
                        "publication {name} must publish insert, update, delete and truncate"
                    )))
                }
                Some(_) => {}
            }
        }
        check_published_tables(&client, &publications).await?;
        let ddl_detection = match client.batch_execute(schema::TRIGGER_SQL).await {
            Ok(()) => true,
            Err(e) if e.code().map(|c| c.code()) == Some("42501") => false,
            Err(e) => return Err(pg_error("installing the DDL event trigger", e)),
        };
        Ok(Upstream { client, slot: config.slot.clone(), publications, ddl_detection })
    }

    /// The published schema as the catalog says now.
    pub async fn current_schema(&self) -> Result<Schema, SourceError> {
        read_schema(&self.client).await.map(|s| s.published_in(&self.publications))
    }

    /// Ends any session still streaming from the slot (a previous run of
    /// ours whose connection the server has not noticed is gone).
    async fn release_slot(&self) -> Result<Option<(Option<String>, Option<String>)>, SourceError> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let row = self
                .client
                .query_opt(
                    "SELECT active_pid, wal_status, restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .map_err(|e| pg_error("reading replication slots", e))?;
            let Some(row) = row else { return Ok(None) };
            let pid: Option<i32> = row.get(0);
            match pid {
                None => return Ok(Some((row.get(1), row.get(2)))),
                Some(pid) if Instant::now() < deadline => {
                    self.client
                        .execute("SELECT pg_terminate_backend($1)", &[&pid])
                        .await
                        .map_err(|e| pg_error("ending the slot's previous session", e))?;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Some(pid) => {
                    return Err(SourceError::Transient(format!(
                        "replication slot {} is still in use by process {pid}",
                        self.slot
                    )))
                }
            }
        }
    }

    /// Whether the slot recorded for this configuration can continue.
    pub async fn existing_slot(&self) -> Result<SlotState, SourceError> {
        let row = self
            .client
            .query_opt("SELECT replica_version, publications FROM _sluice.slots WHERE slot = $1", &[&self.slot])
            .await
            .map_err(|e| pg_error("reading _sluice.slots", e))?;
        let Some(row) = row else {
            return Ok(SlotState::Lost {
                replica_version: String::new(),
                reason: format!("the upstream has no record of replication slot {}", self.slot),
            });
        };
        let replica_version: String = row.get(0);
        let mut recorded: Vec<String> = row.get(1);
        recorded.sort();
        if recorded != self.publications {
            let reason = format!(
                "the configured publications ({}) differ from those of slot {} ({})",
                self.publications.join(", "),
                self.slot,
                recorded.join(", ")
            );
            return Ok(SlotState::Lost { replica_version, reason });
        }
        match self.release_slot().await? {
            None => Ok(SlotState::Lost {
                replica_version,
                reason: format!("replication slot {} no longer exists in the upstream", self.slot),
            }),
            Some((wal_status, restart_lsn)) if wal_status.as_deref() == Some("lost") || restart_lsn.is_none() => {
                Ok(SlotState::Lost {
                    replica_version,
                    reason: format!(
                        "replication slot {} was invalidated: the server removed WAL it still needed (see max_slot_wal_keep_size)",
                        self.slot
                    ),
                })
            }
            Some(_) => Ok(SlotState::Usable { replica_version }),
        }
    }

    /// Drops any old slot of this name and creates a new one with an
    /// exported snapshot.
    pub async fn create_slot(&self, pg: &PgTarget) -> Result<CreatedSlot, SourceError> {
        if self.release_slot().await?.is_some() {
            self.client
                .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                .await
                .map_err(|e| pg_error(&format!("dropping the old replication slot {}", self.slot), e))?;
            tracing::warn!("dropped replication slot {} to start a new lineage", self.slot);
        }
        // The trigger diffs against this; it must describe the schema the
        // snapshot will see.
        self.client
            .batch_execute(
                "INSERT INTO _sluice.published_schema (lock, current) VALUES (true, _sluice.schema_specs()) \
                 ON CONFLICT (lock) DO UPDATE SET current = EXCLUDED.current",
            )
            .await
            .map_err(|e| pg_error("recording the published schema", e))?;
        let mut connection = ReplConnection::connect(pg, &session_config(pg), APPLICATION_NAME)
            .await
            .map_err(|e| SourceError::Transient(format!("opening the replication connection: {e}")))?;
        let rows = connection
            .simple_query(&format!("CREATE_REPLICATION_SLOT \"{}\" LOGICAL pgoutput (SNAPSHOT 'export')", self.slot))
            .await
            .map_err(|e| {
                let text = format!("creating replication slot {}: {e}", self.slot);
                match e.code() {
                    Some("53400") | Some("42501") => SourceError::Fatal(text),
                    _ => SourceError::Transient(text),
                }
            })?;
        let row =
            rows.first().ok_or_else(|| SourceError::Transient("CREATE_REPLICATION_SLOT returned no row".into()))?;
        let field = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
        let consistent_point = parse_lsn(&field(1))
            .ok_or_else(|| SourceError::Transient(format!("bad consistent point {:?}", field(1))))?;
        let snapshot_name = field(2);
        // One below the consistent point: a transaction can commit exactly at
        // it, and its watermark must sort after the snapshot's.
        let replica_version = to_lexi(consistent_point.saturating_sub(1) as u128);
        self.client
            .execute(
                "INSERT INTO _sluice.slots (slot, replica_version, publications) VALUES ($1, $2, $3) \
                 ON CONFLICT (slot) DO UPDATE SET replica_version = EXCLUDED.replica_version, \
                 publications = EXCLUDED.publications, created_at = now()",
                &[&self.slot, &replica_version, &self.publications],
            )
            .await
            .map_err(|e| pg_error("recording the slot in _sluice.slots", e))?;
        tracing::info!(
            slot = %self.slot,
            consistent_point = %super::wire::lsn_text(consistent_point),
            replica_version = %replica_version,
            "created replication slot"
        );
        Ok(CreatedSlot { replica_version, consistent_point, snapshot_name, connection })
    }
}

/// Every published table and index, as JSON from [`schema::SPECS_SQL`].
pub async fn read_schema(client: &tokio_postgres::Client) -> Result<Schema, SourceError> {
    let row =
        client.query_one(schema::SPECS_SQL, &[]).await.map_err(|e| pg_error("reading the published schema", e))?;
    Schema::parse(row.get::<_, &str>(0)).map_err(SourceError::Transient)
}

/// Refuses what the snapshot cannot reproduce (row filters, column lists),
/// and warns about tables whose updates and deletes the server will reject.
async fn check_published_tables(client: &tokio_postgres::Client, publications: &[String]) -> Result<(), SourceError> {
    let rows = client
        .query(
            "SELECT pt.pubname::text, pt.schemaname || '.' || pt.tablename, pt.rowfilter IS NOT NULL,
                    cardinality(pt.attnames) < (SELECT count(*) FROM pg_attribute a
                                                WHERE a.attrelid = c.oid AND a.attnum > 0
                                                  AND NOT a.attisdropped AND a.attgenerated = ''),
                    c.relreplident = 'n' OR (c.relreplident = 'd' AND NOT EXISTS
                      (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))
             FROM pg_publication_tables pt
             JOIN pg_namespace n ON n.nspname = pt.schemaname
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
             WHERE pt.pubname = ANY($1)",
            &[&publications],
        )
        .await
        .map_err(|e| pg_error("reading the published tables", e))?;
    for r in &rows {
        let (publication, table): (String, String) = (r.get(0), r.get(1));
        if r.get::<_, bool>(2) || r.get::<_, bool>(3) {
            return Err(SourceError::Fatal(format!(
                "publication {publication} publishes {table} with a row filter or a column list, which Sluice does \
                 not support (the snapshot would not match the stream)"
            )));
        }
        if r.get::<_, bool>(4) {
            tracing::warn!(
                "{table} has no primary key and no replica identity: the server rejects its updates and deletes \
                 while it is published (add a primary key, or ALTER TABLE {table} REPLICA IDENTITY FULL)"
            );
        }
    }
    Ok(())
}
