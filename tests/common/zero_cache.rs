//! zero-cache and Zero's client (crates/zero-harness) on the test
//! PostgreSQL server that `make test` starts.

use std::path::Path;

// Not every test binary that includes `common` uses all of them.
#[allow(unused_imports)]
pub use zero_harness::{
    bootstrap_replica, bootstrap_replica_via, bootstrap_replica_with_token, copy_kept_replica, psql, psql_value,
    replica_file, replica_rows, run_copy_kept_replica, run_zero_replica, KeptReplica, Streamer, Upstream, ZeroCache,
    ZeroClient,
};

/// A new, empty database `name` on the test server; its URL.
pub fn fresh_database(name: &str) -> String {
    zero_harness::fresh_database(&super::pg_url(), name)
}

/// Starts zero-cache `name` with Sluice at `sluice` (HOST:PORT) as its
/// custom upstream, its CVR and change databases on the test server, and
/// waits until it is ready (its initial sync done).
pub fn start_on_sluice(name: &str, sluice: &str, dir: &Path) -> ZeroCache {
    ZeroCache::start(name, Upstream::Sluice(sluice.to_string()), &super::pg_url(), dir)
}

/// Starts zero-cache `name` as a view-syncer on `streamer` (Sluice), with
/// `upstream` as its mutations' database; its replica file must have been
/// bootstrapped.
pub fn start_view_syncer(name: &str, streamer: Streamer, upstream: &str, dir: &Path) -> ZeroCache {
    let to = Upstream::ViewSyncer { streamer, upstream: upstream.to_string() };
    ZeroCache::start(name, to, &super::pg_url(), dir)
}
