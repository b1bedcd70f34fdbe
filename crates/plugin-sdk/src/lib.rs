//! The Sluice plugin SDK: what a plugin written in Rust needs from Sluice.
//!
//! - A **source** implements [`Source`] and exports it with
//!   [`export_source!`]: the SDK holds the stream resource, applies the
//!   resume rule and hands the source a [`Resume`] only when it is to
//!   continue an existing lineage.
//! - A **filter** implements [`Filter`] and exports it with
//!   [`export_filter!`]: the SDK splits each batch into change objects, reads
//!   their tags and passes on the host's column spans.
//! - [`types`] is the change model both speak (`wit/sluice.wit`),
//!   [`watermark`] Zero's LexiVersion, [`scan`] reads change objects without
//!   parsing them, and [`net::connect`] dials an upstream from the sandbox
//!   ([`net::connect_tls`] and [`net::Tunnel`] over TLS, done by the host).
//!
//! The raw worlds ([`source_world`], [`filter_world`]) stay available for
//! plugins that need the contract as it is (the host's tests use one to
//! break it on purpose).

pub mod filter;
pub mod net;
pub mod source;

/// The `source-plugin-with-tls` world as wit-bindgen generates it: the
/// source and progress exports and the host's `tls` import (it also
/// generates the shared `sluice:plugin/types` interface).
pub mod source_world {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "source-plugin-with-tls",
        additional_derives: [PartialEq],
        pub_export_macro: true,
        export_macro_name: "export_source_world",
        default_bindings_module: "sluice_plugin_sdk::source_world",
    });
}

/// The `filter-plugin` world, sharing the types generated above.
pub mod filter_world {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "filter-plugin",
        pub_export_macro: true,
        export_macro_name: "export_filter_world",
        additional_derives: [PartialEq],
        default_bindings_module: "sluice_plugin_sdk::filter_world",
        with: { "sluice:plugin/types@0.3.2": crate::source_world::sluice::plugin::types },
    });
}

pub use filter::{Filter, Policy, Verdict};
pub use source::{Progress, Resume, Source};
/// The change model: messages, rows, values, schema changes, errors.
pub use source_world::sluice::plugin::types;

/// Zero's LexiVersion watermarks (`to_lexi`, `from_lexi`) and the resume
/// rule (`resumes`), as the host uses them.
pub use sluice_watermark as watermark;

/// Reading change objects (the JSON a filter receives) without parsing them.
pub use json_scan as scan;
