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
//! Measured on the provider's side from second 10 to the end.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::provider::Provider;
use common::share::{drive_to, jain, tenant, Outcome, Tenant, RATE, WARMUP_S};
use common::Listener;
use common::{bootstrap_with, free_port, redis, rls_cluster, rls_server_each, Envoy};
use ratelimit_core::testkit::fair::water_fill;
use std::net::SocketAddr;
use std::sync::Arc;

const PROXIES: usize = 3;
/// The least part of its requests a tenant under its share gets through, and the least part of
/// the capacity used (97 % is handed out: `share.target`), as runs measured them
/// (docs/src/performance/evidence.md, shared capacity).
const LIGHT_SERVED: f64 = 0.97;
const USED: f64 = 0.95;
const RULES: [&str; 3] = ["f1", "f2", "f3"];

/// The service's limits: per rule, the capacity leased (`RATE` a second) and the fair
/// counters (each tenant's asks and each band's sums, by epoch: an hour's counters, far above
/// any sum).
fn limits() -> String {
    let mut all = Vec::new();
    for rule in RULES {
        all.push(format!(
            r#"{{"namespace": "provider", "name": "{rule}", "max_value": {RATE}, "seconds": 1,
                 "conditions": ["descriptors[0].rule == '{rule}'"], "variables": []}}"#
        ));
        for kind in ["asked", "band"] {
            all.push(format!(
                r#"{{"namespace": "provider", "name": "{rule}-{kind}", "max_value": 4294967295,
                     "seconds": 3600, "conditions": ["descriptors[0].fair == '{rule}'"],
                     "variables": ["descriptors[0].{kind}", "descriptors[0].epoch"]}}"#
            ));
        }
    }
    format!("[{}]", all.join(", "))
}

fn config() -> String {
    let rules: Vec<String> = RULES
        .iter()
        .map(|name| {
            format!(
                r#"{{"name": "{name}", "match": {{"path_prefix": "/{name}/"}},
                    "key": ["header:x-tenant"],
                    "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
                    "global": {{"cluster": "ratelimit", "domain": "provider", "mode": "lease",
                                "timeout_ms": 200, "flush_ms": 20}},
                    "share": {{"fleet": "fair",
                               "weight": {{"from": "header:x-weight", "default": 1, "max": 10}}}}}}"#
            )
        })
        .collect();
    format!(r#"{{"rules": [{}]}}"#, rules.join(", "))
}

/// Where a tenant's requests go: all to one Envoy, spread evenly, or 80 % to the first.
#[derive(Clone, Copy)]
enum To {
    Pinned(usize),
    Even,
    Skewed,
}

impl To {
    /// The Envoys its requests go to in turn.
    fn addrs(self, all: &[SocketAddr]) -> Vec<SocketAddr> {
        match self {
            To::Pinned(i) => vec![all[i]],
            To::Even => all.to_vec(),
            // Eight in ten to the first, one to each other.
            To::Skewed => (0..10usize)
                .map(|k| all[k.saturating_sub(7).min(all.len() - 1)])
                .collect(),
        }
    }
}

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
    let run_s = common::env_number("SHARE_SECONDS", 40);
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    // One call at a time: the engine's own race would grant past the limit.
    let _rls = rls_server_each(rls_port, redis_port, &limits(), true);
    let provider = Arc::new(Provider::start(RATE));
    let listener = Listener::to(provider.addr);
    let yaml = format!(
        "{}{}",
        bootstrap_with(&config(), &listener),
        rls_cluster(rls_port, "1s")
    );
    let proxies: Vec<Envoy> = (0..PROXIES).map(|_| Envoy::start_yaml(&yaml)).collect();
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let pinned = tenants();
    let clients: Vec<Tenant> = pinned.iter().map(|(t, _, _)| t.clone()).collect();
    let seen = drive_to(
        |n| pinned[n].1.addrs(&addrs),
        &provider,
        &clients,
        run_s,
        WARMUP_S,
    );
    let out = Outcome::new(&provider, &clients, seen, WARMUP_S, RATE);
    common::share::print_counters(&proxies, &RULES);
    assert_eq!(provider.refused(), 0, "the provider refused requests");
    let target = 0.97 * RATE;
    for rule in RULES {
        let got = out.admitted(rule);
        out.report(rule, &got);
        let case: Vec<&(Tenant, To, f64)> = pinned
            .iter()
            .filter(|(t, _, _)| t.path.starts_with(&format!("/{rule}/")))
            .collect();
        let demands: Vec<f64> = case.iter().map(|(t, _, _)| t.rate).collect();
        let weights: Vec<f64> = case.iter().map(|(_, _, w)| *w).collect();
        let ideal = water_fill(target, &demands, &weights);
        let rates: Vec<f64> = case
            .iter()
            .map(|(t, _, _)| got.get(&t.name).copied().unwrap_or(0.0))
            .collect();
        eprintln!("{rule}: admitted {rates:.1?}, water-filling {ideal:.1?}");
        // Backlogged tenants: Jain's index of their rates per unit of weight, each within
        // ±5 % of its water-filling share.
        let held: Vec<usize> = (0..case.len())
            .filter(|&i| demands[i] > ideal[i] + 1.0)
            .collect();
        let per_weight: Vec<f64> = held.iter().map(|&i| rates[i] / weights[i]).collect();
        assert!(
            jain(&per_weight) >= 0.99,
            "{rule}: Jain's index {:.4} of {per_weight:.2?}",
            jain(&per_weight)
        );
        for &i in &held {
            let off = (rates[i] - ideal[i]).abs() / ideal[i];
            assert!(
                off <= 0.05,
                "{rule} {}: {:.1}/s for {:.1}/s",
                case[i].0.name,
                rates[i],
                ideal[i]
            );
        }
        // Tenants under their shares get nearly all they ask: the lease's refusals, when the
        // fleet's quota of a window runs out, fall on whoever asks then.
        for (i, (t, _, _)) in case.iter().enumerate() {
            if held.contains(&i) {
                continue;
            }
            let s = out.seen[&t.name];
            assert!(
                s.ok as f64 >= LIGHT_SERVED * s.sent as f64,
                "{}: {} of {} passed",
                t.name,
                s.ok,
                s.sent
            );
        }
        let used: f64 = rates.iter().sum::<f64>() / RATE;
        assert!(
            used >= USED,
            "{rule}: {:.1} % of the capacity used",
            100.0 * used
        );
    }
}
