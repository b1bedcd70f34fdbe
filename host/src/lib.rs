//! Sluice: a change streamer with WebAssembly plugins.
//!
//! Data flows `source` -> `streamer` (the replication loop) -> `storer`
//! (durable change log in `storage`) and, in later layers, to subscribers.
//! Plugins sit at the edge in `plugin`.

pub mod change;
pub mod http;
pub mod plugin;
pub mod source;
pub mod status;
pub mod storage;
pub mod storer;
pub mod streamer;
pub mod watermark;
