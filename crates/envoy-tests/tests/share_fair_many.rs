//! Many tenants fair across the fleet (`share.fleet: "fair"`), in the build under test: three
//! Envoys, one rule of 200 requests a second in front of the stand-in provider, backlogged
//! tenants pinned PER_ENVOY to each Envoy (100 by default: more than the 64 an Envoy kept of a
//! rule before 2026-12-05, fewer than the 256 it keeps), each asking ASKS a second (2 by
//! default, three times the capacity in all); those of the third Envoy of weight 2.
//!
//! The checks, on the provider's side from the warm-up to the end of SHARE_SECONDS (40 by
//! default): no provider 429s; the capacity used; the tenants of weight 1 and of weight 2 each
//! within ±5 % of their water-filling shares in all (per tenant a share may be too few
//! requests to judge one tenant alone); Jain's index of the tenants' rates per unit of weight.
//!
//! Ignored: it fails, and is kept to reproduce what it found (2026-12-05, the native build of
//! 8b2694c, quiet, one run each unless said, `PER_ENVOY=… ASKS=… WORKERS=…` in the environment
//! of the test binary run with `--ignored`, as `repeat.py` runs it): three tenants an Envoy at
//! 60 a second (a share of 16 a second each) pass, 97.0 % used, each weight's tenants at their
//! water-filling shares exactly, 122 of 7,827 granted lapsed (held by an Envoy when the window
//! turned); six an Envoy at 30 a second (shares of 8.1 and 16.2), three runs: 88.3 %, 84.7 %
//! and one that passed (95.3 %), 354 to 891 lapsed (the build of 3516376, three runs: 90.2 to
//! 93.8 %; the wasm build of 8b2694c, one run: 94.0 %; with one worker an Envoy instead of two,
//! an older native build: 95.5 %, 389 lapsed against 1,042 with two); ten an Envoy at 20 a
//! second (shares of 4.85 and 9.7): 78.8 %, 1,217 of 7,800 lapsed; a hundred an Envoy at 2 a
//! second (shares of 0.49 and 0.97): 55.0 %, 3,413 lapsed, 49 service calls per 100 requests
//! (the build of 3516376, keeping 64 tenants: 62.3 %). The fleet model holds the same tenants
//! (3, 6, 10 an Envoy, weights by Envoy, 200 a second: 95.8 to 97.0 % used) and a thousand
//! tenants pinned 100 to each of ten proxies at 95 % of their shares (fleet-sim's
//! `a_thousand_tenants_pinned_are_all_kept_and_spread_the_same_ones_everywhere`): the Envoys
//! here let what they claimed lapse, more so with more tenants an Envoy (not for want of what
//! `share::fair::keeping` keeps: without it, ten an Envoy used 68.3 %). Where it goes: in one
//! more run of ten an Envoy (57.5 % used, 2,933 lapsed), the tenants of weight 1 (the first two
//! Envoys) got 82.6 a second for their water-filling 97.0, those of weight 2 (the third) 32.4
//! for 97.0: the Envoy whose part is the largest is refused by the service (`reason=capacity`:
//! 6,561 to 7,435 refusals a run with ten an Envoy, 894 with three) while the others let
//! their grants lapse. Each Envoy's counters in another run of ten an Envoy (70.9 % used;
//! weight 1 87.4 a second, weight 2 54.3): the first two admitted 1,783 and 1,849 requests,
//! were granted 2,585 and 3,076 and let 742 and 1,142 lapse; the third admitted 2,225, was
//! granted 2,229 and let 4 lapse: the two Envoys of tenants of weight 1 claimed more than their
//! tenants' allowances took. Which Envoys fall short varies from run to run: in a third run
//! (83.0 % used) weight 1 got 74.0 a second and weight 2 92.2, and every Envoy let some lapse
//! (313, 518, 430).

mod common;

use common::fair::{config, limits, To, USED};
use common::provider::Provider;
use common::share::{drive_to, jain, tenant, Outcome, RATE, WARMUP_S};
use common::{bootstrap_with, free_port, redis, rls_cluster, rls_server_each, Envoy, Listener};
use ratelimit_core::testkit::fair::water_fill;
use std::net::SocketAddr;
use std::sync::Arc;

const PROXIES: usize = 3;
const PER_ENVOY: usize = 100;
/// What each tenant asks, requests a second: 600 a second in all, three times the capacity.
const ASKS: f64 = 2.0;
/// How far each weight's tenants may be from their water-filling shares in all.
const WITHIN: f64 = 0.05;
/// Jain's index of the tenants' rates per unit of weight, at least: each tenant's rate is a
/// count of about 15 requests over the measure, so one request either side is ±7 %.
const JAIN: f64 = 0.97;

#[test]
#[ignore = "fails: several backlogged tenants an Envoy leave quota unused (see the file's opening)"]
fn hundreds_of_tenants_pinned_to_envoys_get_the_fleets_shares() {
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
