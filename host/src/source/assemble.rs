//! Building the source `sluice run` names: one of the sources compiled into
//! the host (the table below), or a source plugin from the plugin
//! directory. A built-in source may bring a task to run beside the loop.

use std::sync::Arc;

use futures::future::BoxFuture;

use super::ChangeSource;
use crate::plugin::{Registry, SandboxLimits};
use crate::status::Status;

/// A source, and what runs beside it.
pub struct BuiltSource {
    pub source: Box<dyn ChangeSource>,
    /// Started once the service runs, with its status; stopped with it.
    pub beside: Option<BesideTask>,
}

/// A task that runs beside the replication loop (it reports into `/status`).
pub type BesideTask = Box<dyn FnOnce(Arc<Status>) -> BoxFuture<'static, ()> + Send>;

/// A source compiled into the host: its name and how to build it from its
/// configuration (JSON text).
struct BuiltIn {
    name: &'static str,
    build: fn(&str) -> anyhow::Result<BuiltSource>,
}

/// Every built-in source; any other name is a plugin's file stem.
const BUILT_IN: &[BuiltIn] = &[BuiltIn { name: "postgres", build: postgres }];

/// Whether `name` is a built-in source (which needs no plugin directory).
pub fn is_built_in(name: &str) -> bool {
    BUILT_IN.iter().any(|b| b.name == name)
}

/// The names of the built-in sources, for messages.
pub fn built_in_names() -> Vec<&'static str> {
    BUILT_IN.iter().map(|b| b.name).collect()
}

/// What a plugin source is given besides its configuration.
pub struct PluginGrant {
    pub limits: SandboxLimits,
    /// `HOST:PORT`s it may reach besides the upstream its config names.
    pub allow_net: Vec<String>,
}

/// The source named `name` with its configuration (JSON text): a built-in
/// one, or a plugin from `plugins`.
pub async fn build(
    name: &str,
    config: &str,
    plugins: Option<&Arc<Registry>>,
    grant: PluginGrant,
) -> anyhow::Result<BuiltSource> {
    if let Some(built_in) = BUILT_IN.iter().find(|b| b.name == name) {
        return (built_in.build)(config);
    }
    let Some(registry) = plugins else {
        anyhow::bail!(
            "source {name:?}: not built in ({}) and there is no plugin directory to find it in",
            built_in_names().join(", ")
        );
    };
    let source = crate::plugin::build_source(registry, name, config, grant.limits, &grant.allow_net).await?;
    Ok(BuiltSource { source: Box::new(source), beside: None })
}

fn postgres(config: &str) -> anyhow::Result<BuiltSource> {
    let source = super::postgres::PostgresSource::new(config).map_err(anyhow::Error::msg)?;
    let config = config.to_string();
    Ok(BuiltSource {
        source: Box::new(source),
        beside: Some(Box::new(move |status| Box::pin(super::postgres::retained_wal::watch(config, status)))),
    })
}
