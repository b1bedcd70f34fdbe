//! One writer per SQLite change log, enforced by the operating system.
//!
//! A running `sluice run` holds an exclusive advisory lock (`flock`) on a
//! file beside the log (`changelog.db.lock`) for its whole life. The kernel
//! lets go when the process dies, however it dies, so a crash never leaves
//! a lock behind; and a second writer, or an admin command that would
//! delete the log under a running one, is refused with who holds it. The
//! file's text (the holder's pid and address) is only for that message:
//! the lock is what counts, never the text.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// Held for as long as this value lives.
#[derive(Debug)]
pub struct WriterLock {
    file: File,
    path: PathBuf,
}

/// The lock file of the log at `log`.
pub fn lock_path(log: &Path) -> PathBuf {
    PathBuf::from(format!("{}.lock", log.display()))
}

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "the change log {log} is being written by another Sluice ({holder}); a SQLite change log has one writer: \
         stop that one first, or give this one a --change-db of its own"
    )]
    Held { log: String, holder: String },
    #[error("locking the change log {log} ({lock}): {source}")]
    Io {
        log: String,
        lock: String,
        #[source]
        source: std::io::Error,
    },
}

impl WriterLock {
    /// Takes the lock of the log at `log`, recording `holder` (this
    /// process's pid is added) for whoever is refused next.
    pub fn acquire(log: &Path, holder: &str) -> Result<WriterLock, LockError> {
        let path = lock_path(log);
        let io = |source| LockError::Io { log: log.display().to_string(), lock: path.display().to_string(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = match text.trim() {
                    "" => "a process that has not said who it is yet".to_string(),
                    t => t.to_string(),
                };
                return Err(LockError::Held { log: log.display().to_string(), holder });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let mut lock = WriterLock { file, path: path.clone() };
        lock.record(holder).map_err(io)?;
        Ok(lock)
    }

    /// Rewrites who holds the lock (the address is known once bound).
    pub fn record(&mut self, holder: &str) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.rewind()?;
        writeln!(self.file, "pid {}, {holder}", std::process::id())?;
        self.file.flush()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("changelog.db");
        let first = WriterLock::acquire(&log, "listening on 127.0.0.1:1").unwrap();
        // flock conflicts between two open files, in one process as in two.
        match WriterLock::acquire(&log, "listening on 127.0.0.1:2") {
            Err(LockError::Held { holder, .. }) => {
                assert!(holder.contains("127.0.0.1:1") && holder.contains(&std::process::id().to_string()), "{holder}")
            }
            other => panic!("a second writer got {other:?}"),
        }
        drop(first);
        let _second = WriterLock::acquire(&log, "listening on 127.0.0.1:2").unwrap();
    }
}
