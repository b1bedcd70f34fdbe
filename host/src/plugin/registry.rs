//! Loading the plugin directory, and loading it again while Sluice runs.
//!
//! A running host compiles a plugin when it is first needed (the source at
//! start, a filter when a subscriber first asks for it) and warms up the
//! rest in the background, so a host restarting in a crash loop is
//! replicating again after compiling (or loading from the cache) one plugin,
//! not the whole directory. `sluice plugins` and tests load everything.
//!
//! [`Registry::rescan`] picks up files added, replaced or removed since (the
//! directory watcher in `plugin::watch`, SIGHUP and `sluice reload` call it).
//! A replacement takes effect only once it has loaded: a broken or
//! half-copied file is refused with one line and the loaded version stays.
//! Instances already made (a subscriber's filter, the running source's
//! stream) keep their code; the next ones get the new code.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use anyhow::Context;
use sluice_contract::filter_world::FilterPluginPre;
use tokio::sync::watch;
use wasmtime::component::{Component, Linker};
use wasmtime::Engine;

use super::cache::CodeCache;
use super::sandbox::{self, HostState, NetGrant, SandboxLimits};
use super::wasm_source::{SourcePre, WasmSource};
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
    /// Which load of the directory's files this is: a replaced file gets a
    /// higher number.
    pub generation: u64,
}

/// What one [`Registry::rescan`] changed.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Rescan {
    /// New files, loaded (or failed: see `refused`).
    pub added: Vec<String>,
    /// Files whose new content loaded and replaced the old.
    pub replaced: Vec<String>,
    /// Files gone: new subscriptions cannot use them.
    pub removed: Vec<String>,
    /// Files that failed to load, with why. A replaced file that failed
    /// leaves the old version in place.
    pub refused: Vec<Refused>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Refused {
    pub name: String,
    pub error: String,
}

impl Rescan {
    pub fn changed(&self) -> bool {
        !(self.added.is_empty() && self.replaced.is_empty() && self.removed.is_empty())
    }
}

struct Loaded {
    info: PluginInfo,
    pre: Option<Pre>,
}

/// A plugin ready to instantiate, by kind.
enum Pre {
    Source(SourcePre),
    Filter(FilterPluginPre<HostState>),
}

pub struct Registry {
    dir: PathBuf,
    engine: Engine,
    linker: Linker<HostState>,
    cache: CodeCache,
    /// The directory's files by name, as last scanned.
    slots: RwLock<BTreeMap<String, Arc<Slot>>>,
    /// New versions that failed to load while an older one stays: not tried
    /// again until the file changes again.
    refused: Mutex<HashMap<String, FileStamp>>,
    /// One rescan at a time.
    rescanning: tokio::sync::Mutex<()>,
    generations: AtomicU64,
    /// Bumped whenever a rescan changed something.
    changed: watch::Sender<u64>,
}

/// Enough of a file's metadata to notice that it was written again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(meta);
        #[cfg(not(unix))]
        let inode = 0;
        FileStamp { len: meta.len(), modified: meta.modified().ok(), inode }
    }
}

/// One version of one `*.wasm` file, loaded at most once.
struct Slot {
    name: String,
    file: PathBuf,
    stamp: Option<FileStamp>,
    generation: u64,
    loaded: tokio::sync::OnceCell<Loaded>,
}

impl Slot {
    /// Loaded, and without error.
    fn usable(&self) -> bool {
        self.loaded.get().is_some_and(|l| l.info.error.is_none())
    }
}

/// The `*.wasm` files of `dir`: name, path and stamp.
fn list_dir(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf, Option<FileStamp>)>> {
    let mut files: Vec<(String, PathBuf, Option<FileStamp>)> = std::fs::read_dir(dir)
        .with_context(|| format!("reading plugin directory {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
        .map(|file| {
            let name = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let stamp = std::fs::metadata(&file).ok().map(|m| FileStamp::of(&m));
            (name, file, stamp)
        })
        .collect();
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

impl Registry {
    /// Finds every `*.wasm` in `dir`; each is compiled when first used. Only
    /// an unreadable directory is an error here.
    pub async fn open(dir: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<Registry> {
        let engine = sandbox::engine()?;
        let mut linker: Linker<HostState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| anyhow::anyhow!("{e}"))?;
        // The contract's own import: TLS tunnels for source plugins.
        sluice_contract::tls::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let cache = CodeCache::new(cache_dir);
        let registry = Registry {
            dir: dir.to_path_buf(),
            engine,
            linker,
            cache,
            slots: RwLock::new(BTreeMap::new()),
            refused: Mutex::new(HashMap::new()),
            rescanning: tokio::sync::Mutex::new(()),
            generations: AtomicU64::new(0),
            changed: watch::channel(0).0,
        };
        let slots = list_dir(dir)?
            .into_iter()
            .map(|(name, file, stamp)| (name.clone(), registry.new_slot(name, file, stamp)))
            .collect();
        *registry.slots.write().unwrap_or_else(|e| e.into_inner()) = slots;
        Ok(registry)
    }

    /// Loads every `*.wasm` in `dir` now. A plugin that fails is recorded
    /// with its error and logged.
    pub async fn load(dir: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<Registry> {
        let registry = Registry::open(dir, cache_dir).await?;
        registry.load_all().await;
        Ok(registry)
    }

    /// The directory this registry loads.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn new_slot(&self, name: String, file: PathBuf, stamp: Option<FileStamp>) -> Arc<Slot> {
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        Arc::new(Slot { name, file, stamp, generation, loaded: tokio::sync::OnceCell::new() })
    }

    fn current(&self) -> BTreeMap<String, Arc<Slot>> {
        self.slots.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn slot(&self, name: &str) -> Option<Arc<Slot>> {
        self.slots.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    async fn load_all(&self) {
        for slot in self.current().values() {
            self.get(slot).await;
        }
    }

    /// Compiles the plugins not used yet in the background: load errors are
    /// reported soon after start, and the code cache is warm for the next one.
    pub fn warm_up(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move { this.load_all().await });
    }

    /// Loads `slot` (once), logging a failure.
    async fn get<'a>(&self, slot: &'a Slot) -> &'a Loaded {
        slot.loaded
            .get_or_init(|| async {
                let loaded = self.load_slot(slot).await;
                if let Some(e) = loaded.info.error.as_deref().filter(|e| *e != STOPPING) {
                    // A compile cut short because Sluice is stopping is not
                    // the plugin's fault; say nothing of it.
                    tracing::error!("plugin {} ({}): {e}", slot.name, slot.file.display());
                }
                loaded
            })
            .await
    }

    async fn load_slot(&self, slot: &Slot) -> Loaded {
        let mut info = PluginInfo {
            name: slot.name.clone(),
            file: slot.file.clone(),
            kind: None,
            wit_version: None,
            error: None,
            cached: false,
            generation: slot.generation,
        };
        let pre = match load_one(&self.engine, &self.linker, &self.cache, &mut info).await {
            Ok(pre) => Some(pre),
            Err(e) => {
                info.error = Some(e);
                None
            }
        };
        if let Some(kind) = info.kind.filter(|_| info.error.is_none()) {
            tracing::info!(plugin = %info.name, %kind, cached = info.cached, generation = info.generation, "loaded plugin");
        }
        Loaded { info, pre }
    }

    /// Reads the directory again and applies what changed: new files load,
    /// changed files replace the loaded version once they load, removed
    /// files are forgotten. Only an unreadable directory is an error.
    pub async fn rescan(&self) -> anyhow::Result<Rescan> {
        let _one = self.rescanning.lock().await;
        let files = list_dir(&self.dir)?;
        let before = self.current();
        let mut report = Rescan::default();
        for (name, file, stamp) in &files {
            let old = before.get(name);
            if old.is_some_and(|s| s.stamp == *stamp) {
                continue;
            }
            let refused_before = self.refused.lock().unwrap_or_else(|e| e.into_inner()).get(name) == stamp.as_ref();
            if refused_before && stamp.is_some() {
                continue;
            }
            let slot = self.new_slot(name.clone(), file.clone(), *stamp);
            let loaded = slot.loaded.get_or_init(|| self.load_slot(&slot)).await;
            if let Some(error) = &loaded.info.error {
                report.refused.push(Refused { name: name.clone(), error: error.clone() });
                if let Some(old) = old.filter(|old| old.usable()) {
                    tracing::error!(
                        "plugin {name} ({}): the new file is refused: {error}; generation {} keeps running",
                        file.display(),
                        old.generation
                    );
                    if let Some(stamp) = stamp {
                        self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(name.clone(), *stamp);
                    }
                    continue;
                }
                tracing::error!("plugin {name} ({}): {error}", file.display());
            } else if old.is_some() {
                tracing::info!(
                    plugin = %name,
                    generation = slot.generation,
                    "plugin replaced: new subscriptions (or the restarted source) use the new code"
                );
            } else {
                tracing::info!(plugin = %name, generation = slot.generation, "plugin added");
            }
            if old.is_some() {
                report.replaced.push(name.clone());
            } else {
                report.added.push(name.clone());
            }
            self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
            self.slots.write().unwrap_or_else(|e| e.into_inner()).insert(name.clone(), slot);
        }
        for name in before.keys().filter(|n| !files.iter().any(|(f, _, _)| f == *n)) {
            tracing::info!(plugin = %name, "plugin removed: new subscriptions cannot use it");
            self.slots.write().unwrap_or_else(|e| e.into_inner()).remove(name);
            self.refused.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
            report.removed.push(name.clone());
        }
        if report.changed() {
            self.changed.send_modify(|n| *n += 1);
        }
        Ok(report)
    }

    /// Rescans if the file of `name` is not the one loaded (added, changed
    /// or removed since), so a subscription sees the directory as it is
    /// now even before the watcher reports it. One `stat`.
    async fn refresh(&self, name: &str) {
        // A subscriber names the plugin: never a path outside the directory.
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return;
        }
        let path = self.dir.join(format!("{name}.wasm"));
        let now = std::fs::metadata(&path).ok().map(|m| FileStamp::of(&m));
        let loaded = self.slot(name).map(|s| s.stamp);
        let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner()).get(name).copied();
        if loaded != Some(now) && (now.is_none() || refused != now) {
            if let Err(e) = self.rescan().await {
                tracing::warn!("plugin directory: {e:#}");
            }
        }
    }

    /// The generation of `name`'s file as it is now (after a rescan if it
    /// changed), `None` if there is none.
    pub async fn generation(&self, name: &str) -> Option<u64> {
        self.refresh(name).await;
        self.slot(name).map(|s| s.generation)
    }

    /// The plugins loaded so far (all of them after [`Registry::load`]).
    pub fn infos(&self) -> impl Iterator<Item = PluginInfo> {
        self.current()
            .into_values()
            .filter_map(|s| s.loaded.get().map(|l| l.info.clone()))
            .collect::<Vec<_>>()
            .into_iter()
    }

    /// The loaded plugin called `name`, or why there is none usable.
    async fn find(&self, name: &str, kind: PluginKind) -> Result<Arc<Slot>, String> {
        self.refresh(name).await;
        let Some(slot) = self.slot(name) else {
            // Name what is available, which takes knowing every plugin's kind.
            self.load_all().await;
            let names: Vec<String> =
                self.infos().filter(|i| i.kind == Some(kind) && i.error.is_none()).map(|i| i.name).collect();
            return Err(format!(
                "unknown {kind} {name:?}: the plugin directory has no {name}.wasm ({kind}s available: {})",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            ));
        };
        let p = self.get(&slot).await;
        if let Some(err) = &p.info.error {
            return Err(format!("{kind} plugin {name} failed to load: {err}"));
        }
        if p.info.kind != Some(kind) {
            let actual = p.info.kind.map(|k| k.to_string()).unwrap_or_default();
            return Err(format!("plugin {name} is a {actual}, not a {kind}"));
        }
        Ok(slot)
    }

    /// A source backed by the plugin called `name`. It reopens with the
    /// plugin's new code when the file is replaced (see [`WasmSource`]).
    pub async fn source(
        self: &Arc<Self>,
        name: &str,
        config: String,
        limits: SandboxLimits,
        net: NetGrant,
    ) -> Result<WasmSource, String> {
        let slot = self.find(name, PluginKind::Source).await?;
        match slot.loaded.get().and_then(|l| l.pre.as_ref()) {
            Some(Pre::Source(pre)) => {
                Ok(WasmSource::new(self.clone(), name.to_string(), (pre.clone(), slot.generation), config, limits, net))
            }
            _ => Err(format!("plugin {name} is not a source")),
        }
    }

    /// The source plugin `name` as loaded now, with its generation, if it
    /// loaded as a source.
    pub(super) fn current_source(&self, name: &str) -> Option<(SourcePre, u64)> {
        let slot = self.slot(name)?;
        match slot.loaded.get()?.pre.as_ref()? {
            Pre::Source(pre) => Some((pre.clone(), slot.generation)),
            Pre::Filter(_) => None,
        }
    }

    pub(super) fn engine_ref(&self) -> &Engine {
        &self.engine
    }

    /// Tells when a rescan changed something.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The filter plugin called `name`, ready to instantiate.
    pub async fn filter(&self, name: &str) -> Result<(Engine, FilterPluginPre<HostState>), String> {
        let slot = self.find(name, PluginKind::Filter).await?;
        match slot.loaded.get().and_then(|l| l.pre.as_ref()) {
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
            let pre = SourcePre::new(pre).map_err(|e| format!("does not match the source interface: {e}"))?;
            pre.instantiate(&mut store).await.map_err(|e| format!("trial instantiation failed: {e}"))?;
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
