//! A fleet model beyond one machine: 3 to 100 proxies and their shared rate limit service,
//! simulated on a virtual clock over the core's own decision code ([`fleet`]), to measure
//! what each global mode admits beyond the limit, refuses below it, and asks of the service,
//! for each flush interval and block size ([`sweep`]).
//!
//! - [`traffic`]: which key each request is for (one hot key, uniform, Zipf) and when it comes.
//! - [`service`]: the rate limit service, as the limitador engine counts, but atomic.
//! - [`fleet`]: the proxies (each a `Runtime` driven through `StreamState` and `Background`,
//!   as the hosts drive them), the calls, the clock.
//! - [`tally`]: what was admitted, window by window of the service, against an exact limiter.
//! - [`sweep`]: the default sweep, its markdown table and JSON.
//! - [`share`]: a shared capacity split statically over the fleet (`C / P` a proxy, each
//!   counting its own tenants), against the fleet-wide water-filling allocation (`--share`).
//! - [`lease_model`]: that capacity leased for the whole fleet: the service counting it in
//!   fixed windows, each proxy's lease of it and the part it learns.
//! - [`leased`]: the leased runs beside the static split, their tables and JSON
//!   (`--share --lease`).
//! - [`fair_model`]: that capacity leased and fair across the whole fleet, each proxy learning
//!   every tenant's fleet-wide share from counters in the same service.
//! - [`fair`]: the fair runs beside the leased ones, their tables and JSON (`--share --fair`).
//! - [`fair_runtime`]: the fair runs through the filter's own runtime, every proxy a
//!   `Runtime` with a rule of `share.fleet: "fair"` (`--share --fair --runtime`).

pub mod fair;
pub mod fair_model;
pub mod fair_runtime;
pub mod fleet;
pub mod lease_model;
pub mod leased;
pub mod service;
pub mod share;
pub mod sweep;
pub mod tally;
pub mod traffic;

pub use fleet::{run, Error, Load, Mode, Outcome, Scenario};
pub use traffic::Traffic;
