//! The only code that knows its host. Each host reads request attributes, carries out what
//! [`crate::pipeline`] decides, keeps the state in its own [`crate::store::Store`] and publishes
//! the metrics; nothing is decided here.
//!
//! - `wasm`: proxy-wasm, for Envoy's Wasm filter and Istio's `WasmPlugin` (built for wasm32);
//! - `native`: an Envoy dynamic module (built with the `native-module` feature).

#[cfg(target_arch = "wasm32")]
mod wasm;

#[cfg(all(feature = "native-module", not(target_arch = "wasm32")))]
mod native;
