//! Host-side bindings generated from `wit/`. The generated `types` module is the
//! change model for every source, native or plugin.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "source-plugin",
    exports: { default: async },
});
