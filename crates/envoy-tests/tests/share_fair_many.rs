//! Several backlogged tenants an Envoy, fair across the fleet (`share.fleet: "fair"`), in the
//! build under test: three Envoys, one rule of 200 requests a second in front of the stand-in
//! provider, tenants pinned PER_ENVOY to each Envoy (10 by default), each asking ASKS a second
//! (20 by default: three times the capacity in all); those of the third Envoy of weight 2.
//!
//! The checks, on the provider's side from the warm-up to the end of SHARE_SECONDS (40 by
//! default): no provider 429s; the tenants of weight 1 and of weight 2 each within ±5 % of
//! their water-filling shares in all; Jain's index of the tenants' rates per unit of weight;
//! the capacity used.
//!
//! What it found (2026-12-05): with more than a few tenants an Envoy the fleet left the account
//! partly unused, about an eighth and up to two fifths of what the service granted lapsing in
//! the Envoys (native, ten an Envoy: 57.5 to 83.0 % used, 1,217 to 2,933 of 7,800 lapsed;
//! three an Envoy 97.0 %). Every request that had to claim while another request's claim was
//! on its way claimed a block, each twice the one before: the requests of one round trip at a
//! window's start claimed much of the window, more the more tenants (and the slower the
//! service, whose reports grow with the tenants). The fleet model showed it once its answers
//! came late (fleet-sim's `requests_during_a_claims_round_trip_claim_their_own_cost`). Since
//! such a request claims its own cost (`limiter::lease::State::asking`): ten an Envoy, 97.1 %
//! used (native) and 97.3 % (wasm), 132 and 159 lapsed, each weight at its share within 0.3 %.
//!
//! Not yet: shares of about a request a window or less (a hundred tenants an Envoy at 2 a
//! second, `PER_ENVOY=100 ASKS=2`: 71.0 % used, weight 2 at half its share, 67 service calls
//! per 100 requests).

mod common;

use common::fair::{config, limits, To, USED};
use common::provider::Provider;
use common::share::{drive_to, jain, tenant, Outcome, RATE, WARMUP_S};
use common::{bootstrap_with, free_port, redis, rls_cluster, rls_server_each, Envoy, Listener};
use ratelimit_core::testkit::fair::water_fill;
use std::net::SocketAddr;
use std::sync::Arc;

const PROXIES: usize = 3;
const PER_ENVOY: usize = 10;
/// What each tenant asks, requests a second: 600 a second in all, three times the capacity.
const ASKS: f64 = 20.0;
/// How far each weight's tenants may be from their water-filling shares in all.
const WITHIN: f64 = 0.05;
/// Jain's index of the tenants' rates per unit of weight, at least (1.0000 in the runs above).
const JAIN: f64 = 0.99;

#[test]
fn several_tenants_pinned_to_each_envoy_get_the_fleets_shares() {
    let run_s = common::env_number("SHARE_SECONDS", 40);
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    // One call at a time: the engine's own race would grant past the limit.
    let _rls = rls_server_each(rls_port, redis_port, &limits(&["f1"]), true);
    let provider = Arc::new(Provider::start(RATE));
    let listener = Listener::to(provider.addr);
    let yaml = format!(
        "{}{}",
        bootstrap_with(&config(&["f1"], false, "allow"), &listener),
        rls_cluster(rls_port, "1s")
    );
    let workers = common::env_number("WORKERS", 2) as u32;
    let proxies: Vec<Envoy> = (0..PROXIES)
        .map(|_| Envoy::start_yaml_workers(&yaml, workers))
        .collect();
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();

    let weight_of = |envoy: usize| if envoy == PROXIES - 1 { 2.0 } else { 1.0 };
    let per_envoy = common::env_number("PER_ENVOY", PER_ENVOY as u64) as usize;
    let asks = common::env_number("ASKS", ASKS as u64) as f64;
    let placed: Vec<(usize, f64)> = (0..PROXIES * per_envoy)
        .map(|i| (i / per_envoy, weight_of(i / per_envoy)))
        .collect();
    let tenants: Vec<_> = placed
        .iter()
        .enumerate()
        .map(|(i, &(_, w))| {
            let weight = if w > 1.0 { "2" } else { "1" };
            tenant("/f1/x", &format!("t{i:03}"), asks, &[("x-weight", weight)])
        })
        .collect();
    let driven = drive_to(
        |n| To::Pinned(placed[n].0).addrs(&addrs),
        &provider,
        &tenants,
        run_s,
        WARMUP_S,
    );
    let out = Outcome::new(&provider, &tenants, driven, RATE);
    common::share::print_counters(&proxies, &["f1"]);
    for (i, p) in proxies.iter().enumerate() {
        let stat = |name: &str| p.stat(&common::metric(Some("f1"), name)).unwrap_or(0);
        eprintln!(
            "envoy {i}: allowed {} lease_claims {} lease_granted {} lease_lapsed {} \
             lease_refused {} share_refused {}",
            stat("allowed"),
            stat("lease_claims"),
            stat("lease_granted"),
            stat("lease_lapsed"),
            stat("lease_refused"),
            stat("share_refused")
        );
    }
    let got = out.admitted("f1");
    let total: f64 = got.values().sum();
    eprintln!("f1: {} tenants admitted, {total:.1}/s in all", got.len());

    assert_eq!(provider.refused(), 0, "the provider refused requests");
    let rates: Vec<f64> = tenants
        .iter()
        .map(|t| got.get(&t.name).copied().unwrap_or(0.0))
        .collect();
    let weights: Vec<f64> = placed.iter().map(|&(_, w)| w).collect();
    let ideal = water_fill(0.97 * RATE, &vec![asks; rates.len()], &weights);
    let mut wrong = Vec::new();
    for w in [1.0, 2.0] {
        let of = |xs: &[f64]| -> f64 {
            xs.iter()
                .zip(&weights)
                .filter(|(_, &x)| x == w)
                .map(|(r, _)| r)
                .sum()
        };
        let (got_w, ideal_w) = (of(&rates), of(&ideal));
        eprintln!("weight {w}: {got_w:.1}/s in all, water-filling {ideal_w:.1}/s");
        if (got_w - ideal_w).abs() > WITHIN * ideal_w {
            wrong.push(format!(
                "weight {w}: {got_w:.1}/s, water-filling {ideal_w:.1}/s"
            ));
        }
    }
    let per_weight: Vec<f64> = rates.iter().zip(&weights).map(|(r, w)| r / w).collect();
    let index = jain(&per_weight);
    eprintln!("Jain's index per unit of weight {index:.4}");
    assert!(index >= JAIN, "Jain's index per unit of weight {index:.4}");
    assert!(wrong.is_empty(), "{wrong:?}");
    assert!(
        total >= USED * RATE,
        "{:.1} % of the capacity used",
        100.0 * total / RATE
    );
}
