//! One provider's capacity shared among tenants, in a real Envoy (two workers), in the build
//! under test, in front of a stand-in provider that enforces its own limit (200 requests a
//! second per organisation, a token bucket as OpenAI describes its own) and answers 429s past
//! it. Four shared rules run at once for SHARE_SECONDS (60 by default), each on its own path
//! and organisation:
//!
//! - `/p1`: one tenant at ten times its share, nine at half of theirs;
//! - `/p2`: five equal tenants, each asking for three times its share;
//! - `/p3`: weights 1, 2 and 4 (from a header), each asking for the whole capacity;
//! - `/p4`: an interactive band (three tenants, 30 % of the capacity in all) beside a batch band
//!   asking for three times the capacity.
//!
//! Everything is measured on the provider's side over the run's seconds 10 to the end, except
//! what the clients were refused by Envoy.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::provider::Provider;
use common::share::{cases_config, drive, four_cases, jain, Outcome, RATE, WARMUP_S};
use common::{bootstrap_with, metric, Envoy, Listener};
use std::collections::HashMap;
use std::sync::Arc;

/// What a case must use, requests a second, with `held` tenants held to their shares: the 97 %
/// the shares hand out (`target`), less one request a window for each held tenant (a tenant
/// whose requests come at a fixed period may miss its share's last request in every window:
/// it passes only if one comes in the window's last moments, and where the period falls in the
/// window is the same each time), less one for the measurement's edges. One held tenant (the
/// issue's case, `/p1`): 96 %, above the 95 % asked.
fn used_at_least(held: usize) -> f64 {
    0.97 * RATE - held as f64 - 1.0
}

#[test]
fn a_provider_capacity_is_shared_fairly_and_never_exceeded() {
    let run_s = common::env_number("SHARE_SECONDS", 60);
    let provider = Arc::new(Provider::start(RATE));
    let config = cases_config(r#""algorithm": "token_bucket", "burst": 180"#);
    let listener = Listener::to(provider.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(&config, &listener));

    let tenants = four_cases(RATE);
    let driven = drive(&[envoy.addr], &provider, &tenants, run_s, WARMUP_S);
    let out = Outcome::new(&provider, &tenants, driven, RATE);
    let seen = &out.seen;
    let admitted = |org: &str| out.admitted(org);
    let report = |org: &str, got: &HashMap<String, f64>| out.report(org, got);

    // Never over the provider's limit.
    assert_eq!(provider.refused(), 0, "the provider refused requests");

    // p1: every light tenant gets what it asks; the heavy one the rest; the capacity is used.
    let p1 = admitted("p1");
    report("p1", &p1);
    for i in 0..9 {
        let s = seen[&format!("light{i}")];
        assert!(
            s.ok as f64 >= 0.99 * s.sent as f64,
            "light{i}: {} of {} passed",
            s.ok,
            s.sent
        );
    }
    let p1_total: f64 = p1.values().sum();
    assert!(p1_total >= used_at_least(1), "p1 used {p1_total:.2}/s");

    // p2: equal tenants asking for more get equal shares.
    let p2 = admitted("p2");
    report("p2", &p2);
    let xs: Vec<f64> = p2.values().copied().collect();
    assert_eq!(xs.len(), 5);
    assert!(jain(&xs) >= 0.99, "Jain's index {:.4}", jain(&xs));
    let p2_total: f64 = xs.iter().sum();
    assert!(p2_total >= used_at_least(5), "p2 used {p2_total:.2}/s");

    // p3: weights 1:2:4 within 5 %.
    let p3 = admitted("p3");
    report("p3", &p3);
    let p3_total: f64 = p3.values().sum();
    assert!(p3_total >= used_at_least(3), "p3 used {p3_total:.2}/s");
    let unit = p3_total / 7.0;
    for (name, w) in [("w1", 1.0), ("w2", 2.0), ("w4", 4.0)] {
        let got = p3[name];
        assert!(
            (got - unit * w).abs() <= 0.05 * unit * w,
            "{name}: {got:.2}/s, expected {:.2}",
            unit * w
        );
    }

    // p4: the interactive band is never refused while batch absorbs the overload, and batch
    // keeps at least its reserve.
    let p4 = admitted("p4");
    report("p4", &p4);
    for i in 0..3 {
        let s = seen[&format!("interactive{i}")];
        assert_eq!(s.refused, 0, "interactive{i} refused: {s:?}");
    }
    let batch: f64 = (0..3).map(|i| p4[&format!("batch{i}")]).sum();
    assert!(batch >= 0.05 * 0.97 * RATE, "batch {batch:.2}/s");
    let p4_total: f64 = p4.values().sum();
    assert!(p4_total >= used_at_least(3), "p4 used {p4_total:.2}/s");

    // Operators see why: refusals for a share and for a band's budget, counted apart.
    for (rule, name) in [("p1", "share_refused"), ("p4", "band_refused")] {
        let n = envoy.wait_stat_until(&metric(Some(rule), name), |n| n > 0);
        assert!(n.is_some(), "{rule} {name}: {n:?}");
    }
    assert_eq!(
        envoy.stat(&metric(Some("p1"), "band_refused")),
        Some(0),
        "one band in p1"
    );
}
