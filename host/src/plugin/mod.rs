//! WebAssembly plugins: discovery, compilation, sandboxing.
//!
//! Every `*.wasm` file in the plugin directory is a component; its name is the
//! file stem and its kind comes from the interfaces it exports. A file that
//! fails to load is reported with the cause and skipped; the others load.

mod cache;
pub mod net;
mod registry;
mod sandbox;
mod tls_tunnel;
mod wasm_filter;
mod wasm_source;
pub mod watch;

pub use registry::{PluginInfo, PluginKind, Refused, Registry, Rescan};
pub use sandbox::{
    describe_failure, new_store, HostState, NetGrant, PluginCalls, SandboxLimits, FILTER_CALLS, SOURCE_CALLS,
};
pub use wasm_filter::{FilterPlugins, WasmFilter};
pub use wasm_source::{build_source, WasmSource};

/// The WIT package version this host speaks.
pub use sluice_contract::{WIT_PACKAGE, WIT_VERSION};
