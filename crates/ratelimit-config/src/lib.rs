//! The `ratelimit-config` CLI's library: reading Istio `WasmPlugin` manifests ([`manifest`]),
//! summarising a configuration's rules ([`summary`]), explaining what its rules make of one
//! request ([`explain`]), and replaying Envoy access logs through
//! the filter's own pipeline ([`replay`]). None of it is in either filter.

pub mod explain;
pub mod flags;
pub mod manifest;
pub mod replay;
pub mod summary;
