//! One provider's capacity shared fairly across three Envoys (`share.fleet: "fair"`), in the
//! build under test: the capacity leased from the rate limit service, and each tenant's share
//! computed over the whole fleet from counters in the same service (the test service counting
//! each descriptor by its own `hits_addend`, as envoyproxy/ratelimit does, over the limitador
//! engine and Redis). Tenants are pinned to Envoys (each keeps its connection to one replica),
//! the case local sharing gets wrong, or spread over them, evenly or not. Three shared rules run
//! at once for SHARE_SECONDS (40 by default), each in front of the stand-in provider's 200
//! requests a second:
//!
//! - `/f1`: `solo` alone on the first Envoy, `b1` and `b2` on the second, `c1` (weight 2) and
//!   `light` (10 a second) on the third; the others ask 120 a second each;
//! - `/f2`: weights 1, 2 and 4, one per Envoy, each asking 200 a second;
//! - `/f3`: `k1` sending 80 % of its requests to the first Envoy and 10 % to each other, `k2`
//!   (weight 2) and `spread` (10 a second) spread evenly; `k1` and `k2` ask 150 a second.
//!
//! The checks: [`common::fair`].
mod common;

use common::fair::{fair_fleet, To};
use common::share::{tenant, Tenant, RATE};

const PROXIES: usize = 3;
/// The least part of its requests a tenant under its share gets through, as runs measured it
/// (docs/src/performance/evidence.md, shared capacity): 97.5 to 100 % on a quiet machine, 93.6
/// to 100 % beside two CPU hogs. What is refused is refused at the end of a window whose quota
/// ran out (`reason=capacity`): the last grants are kept for the tenants under their shares only
/// as far as each Envoy's latest answer from the service tells what the fleet has left.
const LIGHT_SERVED: f64 = 0.95;
const RULES: [&str; 3] = ["f1", "f2", "f3"];

/// The tenants, each with the Envoys it sends to and its weight.
fn tenants() -> Vec<(Tenant, To, f64)> {
    let w = |n: &'static str| [("x-weight", n)];
    let p = To::Pinned;
    vec![
        (tenant("/f1/x", "solo", 120.0, &w("1")), p(0), 1.0),
        (tenant("/f1/x", "b1", 120.0, &w("1")), p(1), 1.0),
        (tenant("/f1/x", "b2", 120.0, &w("1")), p(1), 1.0),
        (tenant("/f1/x", "c1", 120.0, &w("2")), p(2), 2.0),
        (tenant("/f1/x", "light", 10.0, &w("1")), p(2), 1.0),
        (tenant("/f2/x", "w1", RATE, &w("1")), p(0), 1.0),
        (tenant("/f2/x", "w2", RATE, &w("2")), p(1), 2.0),
        (tenant("/f2/x", "w4", RATE, &w("4")), p(2), 4.0),
        (tenant("/f3/x", "k1", 150.0, &w("1")), To::Skewed, 1.0),
        (tenant("/f3/x", "k2", 150.0, &w("2")), To::Even, 2.0),
        (tenant("/f3/x", "spread", 10.0, &w("1")), To::Even, 1.0),
    ]
}

#[test]
fn tenants_pinned_to_envoys_get_the_fleets_fair_shares() {
    fair_fleet(PROXIES, &RULES, &tenants(), LIGHT_SERVED);
}
