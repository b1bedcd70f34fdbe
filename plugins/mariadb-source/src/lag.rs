//! How far the binlog stream is behind the server: the binlog position gap.
//!
//! The stream knows where it has read to (the file from ROTATE events, the
//! offset from each event's `log_pos`, and the server's own word in
//! heartbeats). The server's side comes from `SHOW BINARY LOGS` on a
//! connection of its own (the replication connection is busy with the
//! dump): the rest of the file being read, plus every later file. That
//! statement needs the BINLOG MONITOR privilege (REPLICATION CLIENT before
//! MariaDB 10.5); without it the gap is unknown and says so once on stderr.

use std::time::{Duration, Instant};

use crate::client::{text, Client};
use crate::Config;

/// Where in the binlog a stream has read to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadPosition {
    /// The file being read; empty until the dump names it.
    pub file: String,
    /// The offset in it after the last event read.
    pub offset: u64,
}

impl ReadPosition {
    /// A ROTATE event: reading continues in `file` at `offset`.
    pub fn rotate(&mut self, offset: u64, file: String) {
        self.file = file;
        self.offset = offset;
    }

    /// An event's header: `log_pos` is the offset just after it (0 for the
    /// artificial events a dump starts with, which say nothing).
    pub fn advance(&mut self, log_pos: u32) {
        if log_pos != 0 {
            self.offset = u64::from(log_pos);
        }
    }
}

/// Bytes between `read` and the end of the server's binlog, from the
/// server's list of files and sizes (oldest first). `None` when the file
/// being read is not (or no longer) in the list.
pub fn gap(read: &ReadPosition, logs: &[(String, u64)]) -> Option<u64> {
    let at = logs.iter().position(|(name, _)| *name == read.file)?;
    let rest_of_current = logs[at].1.saturating_sub(read.offset);
    Some(rest_of_current + logs[at + 1..].iter().map(|(_, size)| size).sum::<u64>())
}

/// How long to leave the server alone after `SHOW BINARY LOGS` failed.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// The side connection that asks the server for its binlog files.
#[derive(Default)]
pub struct Monitor {
    client: Option<Client>,
    retry_at: Option<Instant>,
    /// The last failure, said once on stderr until it changes.
    said: Option<String>,
}

impl Monitor {
    /// The gap for `read`, or `None` when it cannot be measured now.
    pub fn measure(&mut self, config: &Config, read: &ReadPosition) -> Option<u64> {
        if read.file.is_empty() || self.retry_at.is_some_and(|at| Instant::now() < at) {
            return None;
        }
        match self.binary_logs(config) {
            Ok(logs) => {
                self.retry_at = None;
                self.said = None;
                gap(read, &logs)
            }
            Err(why) => {
                self.retry_at = Some(Instant::now() + RETRY_AFTER);
                if self.said.as_deref() != Some(why.as_str()) {
                    eprintln!(
                        "mariadb-source: cannot measure the binlog position gap (SHOW BINARY LOGS needs \
                         BINLOG MONITOR); trying again in {} s: {why}",
                        RETRY_AFTER.as_secs()
                    );
                    self.said = Some(why);
                }
                None
            }
        }
    }

    /// The server's binlog files and sizes. A failed connection is dropped
    /// (the next try connects again).
    fn binary_logs(&mut self, config: &Config) -> Result<Vec<(String, u64)>, String> {
        let mut client = match self.client.take() {
            Some(c) => c,
            None => config.connect().map_err(|e| format!("{e:?}"))?,
        };
        let rows = client.query("SHOW BINARY LOGS").map_err(|e| e.to_string())?;
        self.client = Some(client);
        rows.into_iter()
            .map(|row| {
                let mut it = row.into_iter().map(|v| v.map(text).unwrap_or_default());
                let name = it.next().unwrap_or_default();
                let size = it.next().unwrap_or_default();
                let size = size.parse().map_err(|_| format!("binlog {name:?} has size {size:?}"))?;
                Ok((name, size))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logs() -> Vec<(String, u64)> {
        vec![("bin.000007".into(), 1_000), ("bin.000008".into(), 500), ("bin.000009".into(), 256)]
    }

    #[test]
    fn the_gap_is_the_rest_of_the_file_and_every_later_one() {
        let mut read = ReadPosition::default();
        assert_eq!(gap(&read, &logs()), None, "no file read yet");
        read.rotate(4, "bin.000008".into());
        read.advance(0);
        assert_eq!(read.offset, 4, "artificial events leave the offset");
        read.advance(300);
        assert_eq!(gap(&read, &logs()), Some(200 + 256));
        read.rotate(4, "bin.000009".into());
        read.advance(256);
        assert_eq!(gap(&read, &logs()), Some(0), "caught up");
        read.rotate(4, "bin.000003".into());
        assert_eq!(gap(&read, &logs()), None, "a purged file");
        read.rotate(4, "bin.000007".into());
        read.advance(2_000);
        assert_eq!(gap(&read, &logs()), Some(500 + 256), "a file that grew since the list was taken");
    }
}
