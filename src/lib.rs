//! wasm-ratelimit: HTTP rate limiting inside Envoy, as a proxy-wasm filter.
//!
//! A request is decided in [`limiter::decide`]. Everything but [`filter`] is pure Rust that
//! compiles and is tested natively; [`filter`] is the thin proxy-wasm layer, built for wasm32.

pub mod config;
pub mod hash;
pub mod headers;
pub mod key;
pub mod limiter;
#[cfg(not(target_arch = "wasm32"))]
pub mod manifest;
pub mod rls;
pub mod store;
pub mod table;

#[cfg(target_arch = "wasm32")]
pub mod filter;
