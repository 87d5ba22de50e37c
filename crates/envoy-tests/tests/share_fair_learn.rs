//! One provider account shared fairly across three Envoys (`share.fleet: "fair"`), in the
//! build under test, where the provider admits less than the rule is configured to: 120
//! requests a second where the rule says 200, stated in OpenAI's `x-ratelimit-*-requests`
//! fields of every answer. Each Envoy reads the same account's answers and learns the limit
//! (`share.learn`), so every Envoy computes the fleet's level from the same 120: the tenants of
//! `/f1` in `share_fair.rs` (`solo` alone on the first Envoy, `b1` and `b2` on the second, `c1`
//! of weight 2 and `light` at 10 a second on the third) get their water-filling shares of 97 %
//! of 120, and from the warm-up on the provider refuses nothing, for SHARE_SECONDS (40 by
//! default). The checks: [`common::fair`].
mod common;

use common::fair::{fair_fleet_of, To};
use common::share::tenant;

/// What the provider admits, requests a second (the rule is configured to `RATE`, 200).
const ACCOUNT: f64 = 120.0;
/// The least part of its requests the light tenant gets through, as `share_fair.rs` holds:
/// 99.3 % to 99.7 % in two runs per build beside two CPU hogs once the warm-up counted from the
/// traffic's start and the fleet's last grants were kept for it (92.7 % to 97.4 % in wasm before,
/// the first seconds of traffic partly measured). What is refused is refused when the fleet's
/// quota of a window runs out before its end (`reason=capacity`).
const LIGHT_SERVED: f64 = 0.95;

#[test]
fn the_fleet_shares_the_limit_the_provider_states() {
    let w = |n: &'static str| [("x-weight", n)];
    let p = To::Pinned;
    let tenants = vec![
        (tenant("/f1/x", "solo", 80.0, &w("1")), p(0), 1.0),
        (tenant("/f1/x", "b1", 80.0, &w("1")), p(1), 1.0),
        (tenant("/f1/x", "b2", 80.0, &w("1")), p(1), 1.0),
        (tenant("/f1/x", "c1", 80.0, &w("2")), p(2), 2.0),
        (tenant("/f1/x", "light", 10.0, &w("1")), p(2), 1.0),
    ];
    fair_fleet_of(3, &["f1"], &tenants, LIGHT_SERVED, Some(ACCOUNT));
}
