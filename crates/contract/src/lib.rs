//! The contract at the bottom of Sluice: `wit/sluice.wit` as host-side Rust.
//!
//! [`model`] is the change model (transactions, rows, schema changes) that
//! every source produces, whether it is a WebAssembly plugin or native code
//! like the Postgres source; everything downstream of a source speaks it.
//! [`source_world`] and [`filter_world`] are the worlds the plugin host
//! instantiates. Generating the bindings here, once, keeps the host's core
//! modules from depending on the plugin host, and keeps the macro expansion
//! out of the host crate's incremental builds.

/// The fullest source world (`source-plugin-with-tls`): the optional
/// progress export and the `tls` import the host provides; it also
/// generates the shared `sluice:plugin/types` interface. The host loads the
/// exports one by one (`GuestIndices`), so a source without
/// `source-progress` runs too, and one that does not import `tls` simply
/// never asks for it.
pub mod source_world {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "source-plugin-with-tls",
        exports: { default: async },
        imports: { default: async | trappable },
    });
}

/// The filter world (`filter-plugin`), sharing the types generated above.
pub mod filter_world {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "filter-plugin",
        exports: { default: async },
        with: { "sluice:plugin/types": crate::source_world::sluice::plugin::types },
    });
}

/// The change model: what a source produces, one [`model::Message`] at a time.
pub use source_world::sluice::plugin::types as model;

/// TLS for a source's connections, which the host provides (`tls`).
pub mod tls {
    pub use crate::source_world::sluice::plugin::tls::{add_to_linker, Host, TlsStart, Tunnel};
}

/// What a filter plugin is asked and answers.
pub mod filter {
    pub use crate::filter_world::exports::sluice::plugin::filter::{Batch, Decision, TablePolicy};
}

/// The WIT package this contract is, and its version: the host loads
/// plugins built against any `WIT_VERSION` minor (0.3.x).
pub const WIT_PACKAGE: &str = "sluice:plugin";
pub const WIT_VERSION: (u64, u64) = (0, 3);
/// The exact version of `wit/sluice.wit` this is built from.
pub const WIT_RELEASE: &str = "0.3.2";

#[cfg(test)]
mod tests {
    #[test]
    fn the_release_is_the_wit_files_package_version() {
        let wit = include_str!("../../../wit/sluice.wit");
        let package = format!("package {}@{};", super::WIT_PACKAGE, super::WIT_RELEASE);
        assert!(wit.lines().any(|l| l.trim() == package), "wit/sluice.wit does not declare `{package}`");
        let (major, minor) = super::WIT_VERSION;
        assert!(super::WIT_RELEASE.starts_with(&format!("{major}.{minor}.")));
    }
}
