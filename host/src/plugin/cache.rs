//! Compiled-code cache: a restart deserializes instead of recompiling.
//!
//! Entries are keyed by a hash of the wasm bytes and the engine's
//! compatibility hash (settings such as epoch interruption change the code),
//! written as temp file + rename, and only ever files this host wrote.
//!
//! Plugins replaced while Sluice runs leave entries behind, so the cache
//! keeps the [`MAX_ENTRIES`] most recently used and deletes the rest.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use anyhow::Context;
use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Compiled plugins kept (a few MiB each): the bundled plugins and a few
/// versions of each.
pub const MAX_ENTRIES: usize = 32;

#[derive(Clone)]
pub struct CodeCache {
    dir: Option<PathBuf>,
}

impl CodeCache {
    /// `None` disables caching.
    pub fn new(dir: Option<PathBuf>) -> Self {
        CodeCache { dir }
    }

    fn entry(&self, engine: &Engine, bytes: &[u8]) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let mut engine_hash = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut engine_hash);
        let mut h = Sha256::new();
        h.update(bytes);
        h.update(engine_hash.finish().to_le_bytes());
        let digest = h.finalize();
        let name: String = digest.iter().take(20).map(|b| format!("{b:02x}")).collect();
        Some(dir.join(format!("{name}.cwasm")))
    }

    /// [`CodeCache::load`] for a blocking task that owns its inputs.
    pub fn load_owned(self, engine: &Engine, bytes: &[u8]) -> anyhow::Result<(Component, bool)> {
        self.load(engine, bytes)
    }

    /// Loads the component, from the cache when possible. Returns it and
    /// whether it came from the cache.
    pub fn load(&self, engine: &Engine, bytes: &[u8]) -> anyhow::Result<(Component, bool)> {
        let entry = self.entry(engine, bytes);
        if let Some(path) = &entry {
            if path.exists() {
                // SAFETY: the file was produced by `precompile_component` of an
                // engine with the same compatibility hash (part of the file
                // name), written by this host and renamed into place whole.
                match unsafe { Component::deserialize_file(engine, path) } {
                    Ok(c) => {
                        // Recently used: the last to be pruned.
                        let _ = std::fs::File::options()
                            .append(true)
                            .open(path)
                            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
                        return Ok((c, true));
                    }
                    Err(e) => {
                        tracing::warn!(path = %path.display(), "ignoring unusable cache entry: {e}")
                    }
                }
            }
        }
        let compiled = engine.precompile_component(bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
        if let Some(path) = &entry {
            if let Err(e) = write_atomically(path, &compiled) {
                tracing::warn!(path = %path.display(), "could not write the compiled-code cache: {e:#}");
            }
            if let Some(dir) = &self.dir {
                prune(dir, MAX_ENTRIES);
            }
        }
        // SAFETY: `compiled` was just produced by this engine.
        let component = unsafe { Component::deserialize(engine, &compiled) }.map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((component, false))
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    Ok(())
}

/// Deletes all but the `keep` most recently used entries of `dir`.
pub fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if entries.len() <= keep {
        return;
    }
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, path) in &entries[keep..] {
        match std::fs::remove_file(path) {
            Ok(()) => tracing::debug!(path = %path.display(), "pruned from the compiled-code cache"),
            Err(e) => tracing::warn!(path = %path.display(), "cannot prune the compiled-code cache: {e}"),
        }
    }
}
