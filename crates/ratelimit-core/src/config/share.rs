//! A rule's limit shared among its keys, the tenants (`share`): their weights, the bands, the
//! line refused requests may wait in, and the capacity's parameters.
//!
//! Uses the configuration's numbers read from requests and, below the configuration, the shared
//! capacity's parameters ([`crate::share`]).

use super::{Carried, FromRequest, Source};

/// A rule's limit shared among its keys, the tenants (`share`): see [`crate::share`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareConfig {
    /// A tenant's weight when the request carries none (or `weight` is a number).
    pub weight: u16,
    /// Where each request's weight is read, if it is.
    pub weight_from: Option<FromRequest>,
    /// The bands' names, highest priority first.
    pub bands: Vec<String>,
    /// Where each request's band name is read (two bands or more).
    pub band_from: Option<Source>,
    /// The band of a request whose band is missing or names none (an index into `bands`).
    pub band_default: u8,
    /// How the capacity is shared.
    pub params: crate::share::Share,
    /// Whose answers hold the capacity to the provider's own (`share.learn`).
    pub learn: Option<crate::share::learn::Learn>,
    /// How long a refused request may wait in line for its turn, ms (0: refused at once).
    pub max_wait_ms: u64,
    /// The most requests waiting in the line (per worker in the wasm build, per process in
    /// the native one).
    pub max_queued: usize,
    /// The most requests of one tenant waiting in the line.
    pub max_queued_per_tenant: usize,
    /// Leased across Envoys, each tenant's share is computed over the whole fleet from
    /// counters kept in the rate limit service (`share.fleet: "fair"`, [`crate::share::fair`]),
    /// not by each Envoy from the part of the capacity it holds (`"local"`, the default).
    pub fleet_fair: bool,
}

impl ShareConfig {
    /// The band a carried value names: its index, or the default's.
    pub fn band_of(&self, value: Option<Carried<'_>>) -> u8 {
        let Some(Carried::Text(t)) = value else {
            return self.band_default;
        };
        let t = t.trim_ascii();
        self.bands
            .iter()
            .position(|b| b.as_bytes() == t)
            .and_then(|i| u8::try_from(i).ok())
            .unwrap_or(self.band_default)
    }
}

/// Default `share.active_s`.
pub const DEFAULT_ACTIVE_S: u64 = 10;

/// Default `share.saturation`, permille.
pub const DEFAULT_SATURATION: u64 = 800;

/// Default `share.target`, permille.
pub const DEFAULT_TARGET: u64 = 970;
