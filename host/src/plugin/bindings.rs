//! Host-side bindings generated from `wit/`. The generated `types` module is the
//! change model for every source, native or plugin.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "source-plugin",
    exports: { default: async },
});

/// The filter world, sharing the `types` interface generated above.
pub mod filter {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "filter-plugin",
        exports: { default: async },
        with: { "sluice:plugin/types": super::sluice::plugin::types },
    });
}
