//! wasm-ratelimit: HTTP rate limiting inside Envoy, as a proxy-wasm filter or an Envoy dynamic
//! module, from one core.
//!
//! A request is decided in [`runtime`], the same way whichever host runs it: rules matched and
//! keys built by [`key`], each rule's algorithm in [`limiter`], state updated with
//! compare-and-swap by [`engine`] over a [`store::Store`] laid out by [`table`], and the answer
//! written by [`headers`]. [`runtime`] holds a compiled configuration ([`config`]) and its
//! [`metrics`]; [`global`] and [`rls`] speak to rate limit services. All of it is plain Rust,
//! compiled and tested natively; [`host`] holds the only code that knows its host. The
//! `ratelimit-config` CLI's modules (`manifest`, `summary`, `replay`) are in neither filter.

pub mod config;
pub mod elastic;
pub mod engine;
pub mod error;
pub mod global;
pub mod headers;
pub mod key;
pub mod limiter;
pub mod metrics;
pub mod rls;
pub mod runtime;
pub mod store;
pub mod table;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
