//! wasm-ratelimit: HTTP rate limiting inside Envoy, as a proxy-wasm filter or an Envoy dynamic
//! module, from one core.
//!
//! A request is decided in [`runtime`], the same way whichever host runs it, and each stream
//! goes through one state machine there ([`runtime::StreamState`]): rules matched and keys
//! built by [`key`], each rule's algorithm in [`limiter`], state updated with compare-and-swap
//! by [`engine`] over a [`store::Store`] laid out by [`table`], and the answer written by
//! [`headers`] (in an LLM API's own dialect by [`dialect`]). [`runtime`] holds a compiled configuration ([`config`]) and its [`metrics`];
//! [`global`] and [`rls`] speak to rate limit services; [`error`] has the typed errors. All of
//! it is plain Rust with no host dependency, compiled and tested natively (`testkit`, behind
//! the feature of that name, has a fake host). The hosts are the crates `filter-wasm` and
//! `filter-native` (over `envoy-dm-abi`); the CLI is `ratelimit-config`.
//!
//! The modules stand on floors, each using only the modules below its own: `floors.py`, beside
//! this crate's manifest, declares them, and `make lint` checks them.

pub mod config;
pub mod dialect;
pub mod elastic;
pub mod engine;
pub mod error;
pub mod global;
pub mod headers;
pub mod http;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod provider;
pub mod rls;
pub mod runtime;
pub mod seed;
pub mod share;
pub mod store;
pub mod table;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod usage;
