//! Loading the plugin directory.
//!
//! A running host compiles a plugin when it is first needed (the source at
//! start, a filter when a subscriber first asks for it) and warms up the
//! rest in the background, so a host restarting in a crash loop is
//! replicating again after compiling (or loading from the cache) one plugin,
//! not the whole directory. `sluice plugins` and tests load everything.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use sluice_contract::filter_world::FilterPluginPre;
use sluice_contract::source_world::SourcePluginPre;
use wasmtime::component::{Component, Linker};
use wasmtime::Engine;

use super::cache::CodeCache;
use super::sandbox::{self, HostState, NetGrant, SandboxLimits};
use super::wasm_source::WasmSource;
use super::{WIT_PACKAGE, WIT_VERSION};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    Source,
    Filter,
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PluginKind::Source => "source",
            PluginKind::Filter => "filter",
        })
    }
}

/// What `sluice plugins` shows for one file.
#[derive(Debug, Clone)]
pub struct PluginInfo {
    pub name: String,
    pub file: PathBuf,
    pub kind: Option<PluginKind>,
    /// The `sluice:plugin` version the plugin exports, e.g. "0.3.0".
    pub wit_version: Option<String>,
    /// Why the plugin could not be loaded.
    pub error: Option<String>,
    /// Whether the compiled code came from the cache.
    pub cached: bool,
}

struct Loaded {
    info: PluginInfo,
    pre: Option<Pre>,
}

/// A plugin ready to instantiate, by kind.
enum Pre {
    Source(SourcePluginPre<HostState>),
    Filter(FilterPluginPre<HostState>),
}

pub struct Registry {
    engine: Engine,
    linker: Linker<HostState>,
    cache: CodeCache,
    slots: Vec<Slot>,
}

/// One `*.wasm` file, loaded at most once.
struct Slot {
    name: String,
    file: PathBuf,
    loaded: tokio::sync::OnceCell<Loaded>,
}

impl Registry {
    /// Finds every `*.wasm` in `dir`; each is compiled when first used. Only
    /// an unreadable directory is an error here.
    pub async fn open(dir: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<Registry> {
        let engine = sandbox::engine()?;
        let mut linker: Linker<HostState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| anyhow::anyhow!("{e}"))?;
        let cache = CodeCache::new(cache_dir);

        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading plugin directory {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
            .collect();
        files.sort();
        let slots = files
            .into_iter()
            .map(|file| Slot {
                name: file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
                file,
                loaded: tokio::sync::OnceCell::new(),
            })
            .collect();
        Ok(Registry { engine, linker, cache, slots })
    }

    /// Loads every `*.wasm` in `dir` now. A plugin that fails is recorded
    /// with its error and logged.
    pub async fn load(dir: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<Registry> {
        let registry = Registry::open(dir, cache_dir).await?;
        registry.load_all().await;
        Ok(registry)
    }

    async fn load_all(&self) {
        for slot in &self.slots {
            self.get(slot).await;
        }
    }

    /// Compiles the plugins not used yet in the background: load errors are
    /// reported soon after start, and the code cache is warm for the next one.
    pub fn warm_up(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move { this.load_all().await });
    }

    async fn get<'a>(&'a self, slot: &'a Slot) -> &'a Loaded {
        slot.loaded
            .get_or_init(|| async {
                let mut info = PluginInfo {
                    name: slot.name.clone(),
                    file: slot.file.clone(),
                    kind: None,
                    wit_version: None,
                    error: None,
                    cached: false,
                };
                let pre = match load_one(&self.engine, &self.linker, &self.cache, &mut info).await {
                    Ok(pre) => Some(pre),
                    Err(e) => {
                        // A compile cut short because Sluice is stopping is
                        // not the plugin's fault; say nothing of it.
                        if e != STOPPING {
                            tracing::error!("plugin {} ({}): {e}", info.name, info.file.display());
                        }
                        info.error = Some(e);
                        None
                    }
                };
                if let Some(kind) = info.kind.filter(|_| info.error.is_none()) {
                    tracing::info!(plugin = %info.name, %kind, cached = info.cached, "loaded plugin");
                }
                Loaded { info, pre }
            })
            .await
    }

    /// The plugins loaded so far (all of them after [`Registry::load`]).
    pub fn infos(&self) -> impl Iterator<Item = &PluginInfo> {
        self.slots.iter().filter_map(|s| s.loaded.get()).map(|p| &p.info)
    }

    /// The loaded plugin called `name`, or why there is none usable.
    async fn find(&self, name: &str, kind: PluginKind) -> Result<&Loaded, String> {
        let slot = self.slots.iter().find(|s| s.name == name);
        let Some(p) = (match slot {
            Some(s) => Some(self.get(s).await),
            None => None,
        }) else {
            // Name what is available, which takes knowing every plugin's kind.
            self.load_all().await;
            let names: Vec<&str> =
                self.infos().filter(|i| i.kind == Some(kind) && i.error.is_none()).map(|i| i.name.as_str()).collect();
            return Err(format!(
                "unknown {kind} {name:?}: the plugin directory has no {name}.wasm ({kind}s available: {})",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            ));
        };
        if let Some(err) = &p.info.error {
            return Err(format!("{kind} plugin {name} failed to load: {err}"));
        }
        if p.info.kind != Some(kind) {
            let actual = p.info.kind.map(|k| k.to_string()).unwrap_or_default();
            return Err(format!("plugin {name} is a {actual}, not a {kind}"));
        }
        Ok(p)
    }

    /// A source backed by the plugin called `name`.
    pub async fn source(
        &self,
        name: &str,
        config: String,
        limits: SandboxLimits,
        net: NetGrant,
    ) -> Result<WasmSource, String> {
        match &self.find(name, PluginKind::Source).await?.pre {
            Some(Pre::Source(pre)) => {
                Ok(WasmSource::new(self.engine.clone(), name.to_string(), pre.clone(), config, limits, net))
            }
            _ => Err(format!("plugin {name} is not a source")),
        }
    }

    /// The filter plugin called `name`, ready to instantiate.
    pub async fn filter(&self, name: &str) -> Result<(Engine, FilterPluginPre<HostState>), String> {
        match &self.find(name, PluginKind::Filter).await?.pre {
            Some(Pre::Filter(pre)) => Ok((self.engine.clone(), pre.clone())),
            _ => Err(format!("plugin {name} is not a filter")),
        }
    }
}

/// Why a load ended when the runtime cancelled its compile task.
const STOPPING: &str = "not loaded: Sluice is stopping";

async fn load_one(
    engine: &Engine,
    linker: &Linker<HostState>,
    cache: &CodeCache,
    info: &mut PluginInfo,
) -> Result<Pre, String> {
    let bytes = std::fs::read(&info.file).map_err(|e| format!("cannot read the file: {e}"))?;
    check_header(&bytes)?;
    let engine2 = engine.clone();
    let (component, cached) = {
        let cache = cache.clone();
        tokio::task::spawn_blocking(move || cache.load_owned(&engine2, &bytes))
    }
    .await
    .map_err(|e| if e.is_cancelled() { STOPPING.to_string() } else { format!("compiling: {e}") })?
    .map_err(|e| format!("not a valid component: {e:#}"))?;
    info.cached = cached;
    let (kind, version) = classify(engine, &component)?;
    info.kind = Some(kind);
    info.wit_version = Some(version);
    let pre = linker
        .instantiate_pre(&component)
        .map_err(|e| format!("cannot be linked (it imports something this host does not provide): {e}"))?;
    // Structure is only checked at instantiation, so instantiate once now.
    let mut store = sandbox::new_store(engine, &info.name, SandboxLimits::default(), &NetGrant::default());
    match kind {
        PluginKind::Source => {
            let pre = SourcePluginPre::new(pre).map_err(|e| format!("does not match the source interface: {e}"))?;
            pre.instantiate_async(&mut store).await.map_err(|e| format!("trial instantiation failed: {e}"))?;
            Ok(Pre::Source(pre))
        }
        PluginKind::Filter => {
            let pre = FilterPluginPre::new(pre).map_err(|e| format!("does not match the filter interface: {e}"))?;
            pre.instantiate_async(&mut store).await.map_err(|e| format!("trial instantiation failed: {e}"))?;
            Ok(Pre::Filter(pre))
        }
    }
}

fn check_header(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 8 || &bytes[0..4] != b"\0asm" {
        return Err("not a WebAssembly file".into());
    }
    match &bytes[4..8] {
        [0x0d, 0x00, 0x01, 0x00] => Ok(()),
        [0x01, 0x00, 0x00, 0x00] => {
            Err("is a core WebAssembly module, not a component (build it for the wasm32-wasip2 target)".into())
        }
        other => Err(format!("unknown WebAssembly version/layer bytes {other:02x?}")),
    }
}

/// Finds the Sluice interface the component exports and checks its version.
fn classify(engine: &Engine, component: &Component) -> Result<(PluginKind, String), String> {
    let mut found = Vec::new();
    for (name, _) in component.component_type().exports(engine) {
        let Some((iface, version)) = name.split_once('@') else {
            continue;
        };
        let Some((package, interface)) = iface.split_once('/') else {
            continue;
        };
        if package == WIT_PACKAGE {
            found.push((interface.to_string(), version.to_string()));
        }
    }
    if found.is_empty() {
        return Err(format!("exports no {WIT_PACKAGE} interface (a source exports {WIT_PACKAGE}/source@{v}, a filter {WIT_PACKAGE}/filter@{v})", v = format_args!("{}.{}.x", WIT_VERSION.0, WIT_VERSION.1)));
    }
    for (interface, version) in &found {
        if !compatible(version) {
            return Err(format!(
                "speaks {WIT_PACKAGE}@{version}, but this host speaks {WIT_PACKAGE}@{}.{}.x",
                WIT_VERSION.0, WIT_VERSION.1
            ));
        }
        match interface.as_str() {
            "source" => return Ok((PluginKind::Source, version.clone())),
            "filter" => return Ok((PluginKind::Filter, version.clone())),
            _ => {}
        }
    }
    Err(format!(
        "exports {} but no interface this host runs",
        found.iter().map(|(i, v)| format!("{WIT_PACKAGE}/{i}@{v}")).collect::<Vec<_>>().join(", ")
    ))
}

/// Semver compatibility as wasmtime applies it: 0.x matches on minor, >=1 on major.
fn compatible(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u64>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (parts.next(), parts.next()) else {
        return false;
    };
    if major == 0 {
        (major, minor) == WIT_VERSION
    } else {
        major == WIT_VERSION.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert!(compatible("0.3.0"));
        assert!(compatible("0.3.7"));
        assert!(!compatible("0.2.0"));
        assert!(!compatible("0.4.0"));
        assert!(!compatible("1.0.0"));
        assert!(!compatible("x"));
    }

    #[test]
    fn headers() {
        assert!(check_header(b"\0asm\x0d\x00\x01\x00rest").is_ok());
        assert!(check_header(b"\0asm\x01\x00\x00\x00").unwrap_err().contains("core WebAssembly module"));
        assert!(check_header(b"hello world").unwrap_err().contains("not a WebAssembly file"));
    }
}
