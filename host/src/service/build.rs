//! `sluice run`'s assembly: every part built from one [`Settings`], in the
//! order that keeps a failure cheap (the writer lock and the settings are
//! checked before anything is opened, the source before the change log).
//! `storage::open` chooses the change log, `source::assemble` the source;
//! this file only joins them.

use std::sync::Arc;
use std::time::Duration;

use super::{Service, ServiceConfig};
use crate::catchup::CatchupOptions;
use crate::cleanup::CleanupOptions;
use crate::plugin::{FilterPlugins, Registry, SandboxLimits};
use crate::server::access::{Access, AccessOptions};
use crate::settings::Settings;
use crate::source::assemble::{self, PluginGrant};
use crate::storer::StorerOptions;
use crate::streamer::StreamerOptions;

impl Service {
    /// Builds and starts everything `settings` describe: the change log,
    /// the source, plugins and filters, the endpoint. Returns once it
    /// serves.
    pub async fn build(settings: &Settings) -> anyhow::Result<Service> {
        settings.check()?;
        let store = settings.log_store();
        // One writer per SQLite log, checked before anything is opened.
        let mut writer_lock = store.lock_writer(&format!("listening on {}", settings.listen))?;
        let zero_permissions =
            settings.zero_permissions.as_deref().map(crate::server::zero_tables::Permissions::from_file).transpose()?;
        let endpoint_tls = match (&settings.tls_cert, &settings.tls_key) {
            (Some(cert), Some(key)) => Some(crate::server::tls::EndpointTls::load(cert, key)?),
            _ => None,
        };
        let access = Access::new(AccessOptions {
            token: settings.token.read()?,
            max_connections: settings.max_connections,
            max_per_address: settings.max_connections_per_address,
        });

        // A built-in source needs no plugin directory; filters come from it
        // when there is one.
        let plugin_dir = settings.plugin_dir();
        let registry = if !assemble::is_built_in(&settings.source) || plugin_dir.is_dir() {
            Some(Arc::new(Registry::open(&plugin_dir, Some(settings.cache_dir())).await?))
        } else {
            None
        };
        let grant = PluginGrant {
            limits: SandboxLimits {
                call_deadline: Duration::from_millis(settings.plugin_deadline_ms),
                memory_bytes: settings.plugin_memory_mb << 20,
            },
            allow_net: settings.allow_net.clone(),
        };
        let source = assemble::build(&settings.source, &settings.source_config, registry.as_ref(), grant).await?;
        // The source is ready; compile the other plugins beside replication,
        // and pick up files dropped in while Sluice runs.
        if let Some(registry) = &registry {
            registry.warm_up();
            let every = (settings.plugin_rescan_secs > 0).then(|| Duration::from_secs(settings.plugin_rescan_secs));
            crate::plugin::watch::spawn(registry.clone(), every);
        }
        let filter_limits = SandboxLimits {
            call_deadline: Duration::from_millis(settings.filter_deadline_ms),
            memory_bytes: settings.filter_memory_mb << 20,
        };
        let filters = FilterPlugins::host_allowing(registry.clone(), filter_limits, settings.allow_filter.clone());

        let log = tokio::task::block_in_place(|| store.open(settings.table_state))?;
        let config = ServiceConfig {
            listen: settings.listen.clone(),
            advertise: settings.advertise.clone(),
            streamer: StreamerOptions {
                storer: StorerOptions { queue_budget: settings.queue_budget_mb << 20, ..StorerOptions::default() },
                auto_reset: settings.auto_reset,
                task_id: settings.task_id.clone(),
                wedge_timeout: Duration::from_millis(settings.statement_timeout_ms),
                ..StreamerOptions::default()
            },
            cleanup: Some(CleanupOptions {
                purge_interval: Duration::from_secs(settings.purge_interval_secs.max(1)),
                retain_transactions: settings.retain_transactions,
                retain_for: settings.retain_secs.map(Duration::from_secs),
                lag_grace: (settings.lag_grace_secs > 0).then(|| Duration::from_secs(settings.lag_grace_secs)),
            }),
            subscriber_limits: crate::subscriber::Limits {
                backlog_bytes: settings.backlog_mb << 20,
                budget: Arc::new(crate::subscriber::MemoryBudget::new(settings.subscriber_memory_mb << 20)),
                ..crate::subscriber::Limits::default()
            },
            catchup: CatchupOptions {
                readers: settings.catchup_readers.unwrap_or(CatchupOptions::default().readers),
                shared: !settings.no_shared_catchup,
                ..CatchupOptions::default()
            },
            filters,
            zero_permissions,
            retention: crate::reservations::Retention {
                consumer: Duration::from_secs(settings.consumer_retention_secs),
                subscriber: Duration::from_secs(settings.subscriber_retention_secs),
            },
            log_progress: true,
            access,
            endpoint_tls,
            ready_backoff: Duration::from_secs(settings.ready_backoff_secs),
            plugins: registry,
            ..ServiceConfig::new(source.source, log.writer, log.reader)
        };
        let tls = config.endpoint_tls.is_some();
        let mut service = Service::start(config).await?;
        if let Some(beside) = source.beside {
            service.spawn_beside(beside(service.status().clone()));
        }
        let addr = service.addr();
        let (ws, http) = if tls { ("wss", "https") } else { ("ws", "http") };
        if let Some(lock) = writer_lock.as_mut() {
            if let Err(e) = lock.record(&format!("listening on {ws}://{addr}")) {
                tracing::warn!("recording this process in {}: {e}", lock.path().display());
            }
        }
        service.writer_lock = writer_lock;
        tracing::info!(
            "sluice listening on {ws}://{addr}/replication/v6/changes (status: {http}://{addr}/status); change log {}",
            log.description
        );
        Ok(service)
    }
}
