//! Sluice: a change streamer with WebAssembly plugins.
//!
//! Data flows `source` -> `streamer` (the replication loop) -> `storer`
//! (durable change log in `storage`) and through `hub` / `forwarder` to each
//! `subscriber`, whose frames leave through `server` (optionally through a
//! `filter` chain). Plugins sit at the edge in `plugin`. `service` assembles
//! them into a running change streamer from one typed `settings::Settings`;
//! `cli` is the command line over it.

pub mod admin;
pub mod catchup;
pub mod change;
pub mod cleanup;
pub mod cli;
pub mod filter;
pub mod forwarder;
pub mod hub;
pub mod metrics;
pub mod pgconn;
pub mod plugin;
pub mod reservations;
pub mod server;
pub mod service;
pub mod settings;
pub mod source;
pub mod status;
pub mod storage;
pub mod storer;
pub mod streamer;
pub mod subscriber;
pub mod tail;
pub mod telemetry;
pub mod tls;
pub mod watermark;
