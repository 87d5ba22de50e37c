//! One provider's capacity shared fairly across six Envoys (`share.fleet: "fair"`), in the
//! build under test, as `share_fair` does across three: one shared rule in front of the
//! stand-in provider's 200 requests a second for SHARE_SECONDS (40 by default), tenants of
//! weights 1, 2 and 4 pinned one per Envoy (twice over), asking 100 a second each, and a light
//! one (10 a second) sending 80 % of its requests to the first Envoy and 10 % to each of two
//! others. The checks: [`common::fair`].

mod common;

use common::fair::{fair_fleet, To};
use common::share::tenant;

/// The least part of its requests the light tenant gets through, as runs measured it
/// (docs/src/performance/evidence.md, shared capacity): the fleet's quota of a window, when
/// it runs out, is refused to whoever asks then.
const LIGHT_SERVED: f64 = 0.97;

#[test]
fn six_envoys_share_one_capacity_fairly() {
    let w = |n: &'static str| [("x-weight", n)];
    let pinned = [
        ("a1", "1"),
        ("a2", "2"),
        ("a4", "4"),
        ("b1", "1"),
        ("b2", "2"),
        ("b4", "4"),
    ];
    let mut tenants: Vec<_> = pinned
        .iter()
        .enumerate()
        .map(|(i, &(name, weight))| {
            let t = tenant("/f1/x", name, 100.0, &w(weight));
            (t, To::Pinned(i), weight.parse().unwrap_or(1.0))
        })
        .collect();
    tenants.push((tenant("/f1/x", "light", 10.0, &w("1")), To::Skewed, 1.0));
    fair_fleet(6, &["f1"], &tenants, LIGHT_SERVED);
}
