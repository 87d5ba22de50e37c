//! Fair across the fleet (`share.fleet: "fair"`) in real Envoys: the service (the test one,
//! counting each descriptor by its own `hits_addend` as envoyproxy/ratelimit does, over the
//! limitador engine and Redis), the stand-in provider, N Envoys in front of it with one rule of
//! [`RATE`] a second per path, tenants sending to the Envoys each as it is placed; and the
//! checks, on the provider's side from [`WARMUP_S`] into the traffic to its end: no provider
//! 429s, every backlogged tenant within ±5 % of its water-filling share of 97 % of the capacity
//! (Jain's index per unit of weight ≥ 0.99), tenants under their shares served, the capacity
//! used.
use super::provider::Provider;
use super::share::{drive_to, jain, Outcome, Tenant, RATE, WARMUP_S};
use super::{bootstrap_with, free_port, redis, rls_cluster, rls_server_each, Envoy, Listener};
use ratelimit_core::testkit::fair::water_fill;
use std::net::SocketAddr;
use std::sync::Arc;

/// The least part of the capacity used (97 % is handed out: `share.target`), as runs measured
/// it (docs/src/performance/evidence.md, shared capacity).
pub const USED: f64 = 0.95;

/// The service's limits: per rule, the capacity leased (`RATE` a second) and the fair
/// counters (each tenant's asks and each band's sums, by epoch: an hour's counters, far above
/// any sum).
pub fn limits(rules: &[&str]) -> String {
    let mut all = Vec::new();
    for &rule in rules {
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

/// Each rule of `rules` at [`RATE`] a second, leased and fair across the fleet; `learn`: each
/// also holds its capacity to what the provider's answers say (`share.learn`, OpenAI's fields
/// of a second); `failure_mode` what a request gets when the service cannot decide.
pub fn config(rules: &[&str], learn: bool, failure_mode: &str) -> String {
    let rules: Vec<(&str, &str)> = rules.iter().map(|r| (*r, "")).collect();
    config_with(&rules, learn, failure_mode)
}

/// [`config`], each rule (name, more members of its `share` object, after a comma: bands,
/// `max_wait_ms`).
pub fn config_with(rules: &[(&str, &str)], learn: bool, failure_mode: &str) -> String {
    let learn = if learn {
        r#", "learn": {"from": "openai", "unit": "second"}"#
    } else {
        ""
    };
    let rules: Vec<String> = rules
        .iter()
        .map(|(name, more)| {
            format!(
                r#"{{"name": "{name}", "match": {{"path_prefix": "/{name}/"}},
                    "key": ["header:x-tenant"],
                    "rate_limit": {{"requests_per_unit": {RATE}, "unit": "second"}},
                    "global": {{"cluster": "ratelimit", "domain": "provider", "mode": "lease",
                                "timeout_ms": 200, "flush_ms": 20}},
                    "share": {{"fleet": "fair",
                               "weight": {{"from": "header:x-weight", "default": 1, "max": 10}}{learn}{more}}}}}"#
            )
        })
        .collect();
    format!(
        r#"{{"failure_mode": "{failure_mode}", "rules": [{}]}}"#,
        rules.join(", ")
    )
}

/// Where a tenant's requests go: all to one Envoy, spread evenly, or 80 % to the first.
#[derive(Clone, Copy)]
pub enum To {
    Pinned(usize),
    Even,
    Skewed,
}

impl To {
    /// The Envoys its requests go to in turn.
    pub fn addrs(self, all: &[SocketAddr]) -> Vec<SocketAddr> {
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

/// `proxies` Envoys, each rule of `rules` (a path `/<rule>/`) fair across them, and
/// `tenants` (each with where it sends and its weight) for SHARE_SECONDS (40 by default); panics
/// unless every check holds, tenants under their shares getting at least `light_served` of
/// their requests through.
pub fn fair_fleet(proxies: usize, rules: &[&str], pinned: &[(Tenant, To, f64)], light_served: f64) {
    fair_fleet_of(proxies, rules, pinned, light_served, None);
}

/// [`fair_fleet`] in front of a provider that admits `account` requests a second (each
/// organisation: each rule's path) and says so in its answers, where each rule is configured
/// to [`RATE`]: the rules learn it (`share.learn`) and the checks hold against it, the provider
/// refusing nothing from [`WARMUP_S`] into the traffic. `None`: the provider admits [`RATE`],
/// nothing learned.
pub fn fair_fleet_of(
    proxies: usize,
    rules: &[&str],
    pinned: &[(Tenant, To, f64)],
    light_served: f64,
    account: Option<f64>,
) {
    let run_s = super::env_number("SHARE_SECONDS", 40);
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    // One call at a time: the engine's own race would grant past the limit.
    let _rls = rls_server_each(rls_port, redis_port, &limits(rules), true);
    let capacity = account.unwrap_or(RATE);
    let provider = Arc::new(Provider::start(capacity));
    let listener = Listener::to(provider.addr);
    let yaml = format!(
        "{}{}",
        bootstrap_with(&config(rules, account.is_some(), "allow"), &listener),
        rls_cluster(rls_port, "1s")
    );
    let proxies: Vec<Envoy> = (0..proxies).map(|_| Envoy::start_yaml(&yaml)).collect();
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    let clients: Vec<Tenant> = pinned.iter().map(|(t, _, _)| t.clone()).collect();
    let driven = drive_to(
        |n| pinned[n].1.addrs(&addrs),
        &provider,
        &clients,
        run_s,
        WARMUP_S,
    );
    let from_s = driven.from_s;
    let out = Outcome::new(&provider, &clients, driven, capacity);
    super::share::print_counters(&proxies, rules);
    if account.is_none() {
        assert_eq!(provider.refused(), 0, "the provider refused requests");
    } else {
        // Before the first answers each Envoy knows only the configured capacity, and the
        // fleet's view of a window is read two windows later: refusals then are expected.
        eprintln!("the provider refused {} in all", provider.refused());
        let to = provider.elapsed_s() as u64 + 1;
        for &rule in rules {
            let refused: u64 = provider.tally(rule, from_s, to).values().map(|t| t.1).sum();
            assert_eq!(
                refused, 0,
                "{rule}: the provider refused requests after the warm-up"
            );
        }
    }
    for &rule in rules {
        let got = out.admitted(rule);
        out.report(rule, &got);
        let case: Vec<&(Tenant, To, f64)> = pinned
            .iter()
            .filter(|(t, _, _)| t.path.starts_with(&format!("/{rule}/")))
            .collect();
        let rates: Vec<f64> = case
            .iter()
            .map(|(t, _, _)| got.get(&t.name).copied().unwrap_or(0.0))
            .collect();
        let names: Vec<&str> = case.iter().map(|(t, _, _)| t.name.as_str()).collect();
        let demands: Vec<f64> = case.iter().map(|(t, _, _)| t.rate).collect();
        let weights: Vec<f64> = case.iter().map(|(_, _, w)| *w).collect();
        let shares = Shares::check(rule, &names, &rates, &demands, &weights, capacity);
        eprintln!(
            "{rule}: admitted {rates:.1?}, water-filling {:.1?}",
            shares.ideal
        );
        assert!(shares.wrong.is_empty(), "{:#?}", shares.wrong);
        // Tenants under their shares get nearly all they ask: the lease's refusals, when the
        // fleet's quota of a window runs out, fall on whoever asks then.
        for &i in &shares.under {
            let t = &case[i].0;
            let s = out.seen[&t.name];
            assert!(
                s.ok as f64 >= light_served * s.sent as f64,
                "{}: {} of {} passed",
                t.name,
                s.ok,
                s.sent
            );
        }
        let used: f64 = rates.iter().sum::<f64>() / capacity;
        assert!(
            used >= USED,
            "{rule}: {:.1} % of the capacity used",
            100.0 * used
        );
    }
}

/// One case's shares checked: each tenant's water-filling share of 97 % of the capacity, the
/// tenants under theirs (for the caller's own check of them: what each asked, seen as it
/// sees it), and what is wrong with the backlogged ones.
pub struct Shares {
    pub ideal: Vec<f64>,
    pub under: Vec<usize>,
    pub wrong: Vec<String>,
}

impl Shares {
    /// Tenants `names` of weights `weights` asking `demands` and admitted `rates` (a second) in
    /// front of `capacity` a second: every backlogged tenant (asking more than its share)
    /// within ±5 % of its share, Jain's index of their rates per unit of weight ≥ 0.99; each
    /// fault named after `label`.
    pub fn check(
        label: &str,
        names: &[&str],
        rates: &[f64],
        demands: &[f64],
        weights: &[f64],
        capacity: f64,
    ) -> Shares {
        let ideal = water_fill(0.97 * capacity, demands, weights);
        let (held, under): (Vec<usize>, Vec<usize>) =
            (0..names.len()).partition(|&i| demands[i] > ideal[i] + 1.0);
        let mut wrong = Vec::new();
        let per_weight: Vec<f64> = held.iter().map(|&i| rates[i] / weights[i]).collect();
        if jain(&per_weight) < 0.99 {
            wrong.push(format!(
                "{label}: Jain's index {:.4} of {per_weight:.2?}",
                jain(&per_weight)
            ));
        }
        for &i in &held {
            if (rates[i] - ideal[i]).abs() > 0.05 * ideal[i] {
                wrong.push(format!(
                    "{label} {}: {:.1}/s for {:.1}/s",
                    names[i], rates[i], ideal[i]
                ));
            }
        }
        Shares {
            ideal,
            under,
            wrong,
        }
    }
}
