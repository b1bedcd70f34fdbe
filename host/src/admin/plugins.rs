//! `sluice plugins`: the plugins in a directory, and whether each loads.

use std::path::{Path, PathBuf};

use crate::plugin::Registry;

/// Prints one line per plugin file: name, kind, contract version, error.
pub async fn list(dir: &Path, cache_dir: PathBuf) -> anyhow::Result<()> {
    let registry = Registry::load(dir, Some(cache_dir)).await?;
    println!("{:<24} {:<8} {:<8} {:<40} ERROR", "NAME", "KIND", "WIT", "FILE");
    for p in registry.infos() {
        println!(
            "{:<24} {:<8} {:<8} {:<40} {}",
            p.name,
            p.kind.map(|k| k.to_string()).unwrap_or_else(|| "-".into()),
            p.wit_version.as_deref().unwrap_or("-"),
            p.file.display(),
            p.error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}
