//! Records the git revision the binary is built from, for `sluice --version`.
//!
//! Cargo reruns a build script when a path it names changes, and always
//! when a named path does not exist; so only files that exist are named
//! (a checkout may have no `packed-refs`, a source tarball no `.git` at
//! all), and without git the script is rerun only when it changes itself.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let rev = git(&["rev-parse", "--short=12", "HEAD"]);
    println!("cargo:rustc-env=SLUICE_GIT_REV={}", rev.as_deref().unwrap_or("unknown"));
    println!("cargo:rerun-if-changed=build.rs");
    if rev.is_none() {
        return;
    }
    // A new commit or checkout changes HEAD, a branch's ref file, or
    // packed-refs (in the common directory when this is a worktree).
    let dirs: Vec<PathBuf> =
        [git(&["rev-parse", "--absolute-git-dir"]), git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])]
            .into_iter()
            .flatten()
            .map(PathBuf::from)
            .collect();
    let mut named = Vec::new();
    for dir in &dirs {
        for file in ["HEAD", "refs/heads", "packed-refs"] {
            let path = dir.join(file);
            if path.exists() && !named.contains(&path) {
                println!("cargo:rerun-if-changed={}", path.display());
                named.push(path);
            }
        }
    }
}
