//! Bands and waits fair across the fleet (`share.fleet: "fair"` with `bands` and `max_wait_ms`),
//! in the build under test: three Envoys leasing one capacity of 200 requests a second from the
//! rate limit service (the test service counting each descriptor by its own `hits_addend`, over
//! the limitador engine and Redis) in front of the stand-in provider enforcing it. An
//! interactive band of three tenants asking 20 a second each (one pinned to the first Envoy,
//! one to the second, one spread over the three) beside a batch band asking 300 a second: `b0`
//! spread, `b1` pinned to the third Envoy, `b2` (weight 2) sending 80 % of its requests to the
//! first. A refused request may wait up to a second for its turn; every request is its own
//! connection, so a waiting one holds nobody else up. For SHARE_SECONDS (30 by default),
//! measured from WARMUP_S into the traffic.
//!
//! Asserted: the provider refuses nothing; the interactive tenants are served (at least
//! INTERACTIVE_SERVED of their requests); the batch tenants share the rest of 97 % of the
//! capacity by weight (each within ±5 % of its water-filling share, Jain's index per unit of
//! weight ≥ 0.99); the capacity is used (≥ 95 %); requests wait, and none longer than
//! `max_wait_ms` (plus the look at the line every 10 ms and a loaded machine's scheduling).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::fair::{config_with, limits, Shares, To, USED};
use common::provider::Provider;
use common::share::{print_counters, RATE, WARMUP_S};
use common::waits::{drive_over, Seen};
use common::{
    bootstrap_with, free_port, metric, redis, rls_cluster, rls_server_each, Envoy, Listener,
};
use std::net::SocketAddr;
use std::sync::Arc;

const PROXIES: usize = 3;
const MAX_WAIT_MS: u64 = 1000;
/// What a request may be held past `max_wait_ms` by, as its client sees it: a look at the line
/// every 10 ms, the host's timer, the provider's answer, and a loaded two-core machine's
/// scheduling of some hundreds of client threads.
const SLACK_MS: u64 = 250;
/// The least part of its requests each interactive tenant gets through.
const INTERACTIVE_SERVED: f64 = 0.99;

#[test]
fn bands_and_waits_hold_across_three_envoys() {
    let run_s = common::env_number("SHARE_SECONDS", 30);
    let rule = "w1";
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    // One call at a time: the engine's own race would grant past the limit.
    let _rls = rls_server_each(rls_port, redis_port, &limits(&[rule]), true);
    let provider = Arc::new(Provider::start(RATE));
    let share = format!(
        r#", "bands": [{{"name": "interactive", "min_share": 0.2}},
                       {{"name": "batch", "min_share": 0.05}}],
            "band": {{"from": "header:x-band", "default": "batch"}},
            "max_wait_ms": {MAX_WAIT_MS}, "max_queued": 1024, "max_queued_per_tenant": 256"#
    );
    let yaml = format!(
        "{}{}",
        bootstrap_with(
            &config_with(&[(rule, &share)], false, "allow"),
            &Listener::to(provider.addr)
        ),
        rls_cluster(rls_port, "1s")
    );
    let proxies: Vec<Envoy> = (0..PROXIES).map(|_| Envoy::start_yaml(&yaml)).collect();
    let addrs: Vec<SocketAddr> = proxies.iter().map(|p| p.addr).collect();
    // (name, band, weight, requests a second, where its requests go)
    let tenants: [(&str, &str, f64, f64, To); 6] = [
        ("i0", "interactive", 1.0, 0.1 * RATE, To::Pinned(0)),
        ("i1", "interactive", 1.0, 0.1 * RATE, To::Pinned(1)),
        ("i2", "interactive", 1.0, 0.1 * RATE, To::Even),
        ("b0", "batch", 1.0, 0.5 * RATE, To::Even),
        ("b1", "batch", 1.0, 0.5 * RATE, To::Pinned(2)),
        ("b2", "batch", 2.0, 0.5 * RATE, To::Skewed),
    ];
    let (from_s, to_s) = provider.window(WARMUP_S as f64, run_s);
    let path = "/w1/x";
    let driven: Vec<_> = tenants
        .iter()
        .map(|(name, band, weight, rate, to)| {
            let extra = format!("x-band: {band}\r\nx-weight: {weight}\r\n");
            drive_over(
                &to.addrs(&addrs),
                path,
                &provider,
                name,
                &extra,
                *rate,
                run_s,
                None,
            )
        })
        .collect();
    let seen: Vec<Vec<Seen>> = driven.into_iter().map(|t| t.join().unwrap()).collect();
    print_counters(&proxies, &[rule]);
    let ended_s = provider.elapsed_s() as u64 + 1;
    let by_provider: u64 = provider
        .tally(rule, from_s, ended_s)
        .values()
        .map(|t| t.1)
        .sum();
    eprintln!(
        "the provider refused {} in all, {by_provider} after the warm-up",
        provider.refused()
    );
    let measured_s = (to_s - from_s) as f64;
    let tally = provider.tally(rule, from_s, to_s);
    let rates: Vec<f64> = tenants
        .iter()
        .map(|t| tally.get(t.0).map_or(0.0, |c| c.0 as f64) / measured_s)
        .collect();
    eprintln!("admitted a second, over {measured_s} s: {rates:.1?}");
    for s in from_s..to_s {
        let t = provider.tally(rule, s, s + 1);
        let row: Vec<u64> = tenants
            .iter()
            .map(|x| t.get(x.0).map_or(0, |c| c.0))
            .collect();
        eprintln!("  second {s}: {row:?}, {} in all", row.iter().sum::<u64>());
    }
    // Each tenant's answers once measured: sent, admitted, admitted after waiting, the longest
    // an answer took.
    let measured: Vec<Vec<&Seen>> = seen
        .iter()
        .map(|s| {
            s.iter()
                .filter(|x| (from_s as f64..to_s as f64).contains(&x.at_s))
                .collect()
        })
        .collect();
    for (t, m) in tenants.iter().zip(&measured) {
        let ok = m.iter().filter(|s| s.status == 200).count();
        let waited = m.iter().filter(|s| s.status == 200 && s.ms > 20).count();
        let longest = m.iter().map(|s| s.ms).max().unwrap_or(0);
        eprintln!(
            "{}: {ok} of {} admitted, {waited} after waiting, the longest answer {longest} ms",
            t.0,
            m.len()
        );
    }
    // How often each band's requests joined a line, over the fleet.
    for band in ["interactive", "batch"] {
        let name = match common::build() {
            common::Build::Wasm => {
                metric(Some(rule), &format!("band=.={band};.;share_band_queued"))
            }
            common::Build::Native => {
                format!("{}.band.{band}", metric(Some(rule), "share_band_queued"))
            }
        };
        let queued: u64 = proxies.iter().map(|p| p.stat(&name).unwrap_or(0)).sum();
        eprintln!("{band}: queued {queued} times in all");
    }
    assert_eq!(
        by_provider, 0,
        "the provider refused requests after the warm-up"
    );
    let other: Vec<&&Seen> = measured
        .iter()
        .flatten()
        .filter(|s| s.status != 200 && s.status != 429)
        .collect();
    assert!(
        other.is_empty(),
        "answers other than 200 and 429: {other:?}"
    );
    // Interactive first: served whatever batch asks.
    for (t, m) in tenants.iter().zip(&measured).take(3) {
        let ok = m.iter().filter(|s| s.status == 200).count();
        assert!(
            ok as f64 >= INTERACTIVE_SERVED * m.len() as f64,
            "{}: {ok} of {} admitted",
            t.0,
            m.len()
        );
    }
    // Batch shares what interactive leaves of 97 % of the capacity, by weight.
    let batch = &tenants[3..];
    let interactive: f64 = rates[..3].iter().sum();
    let names: Vec<&str> = batch.iter().map(|t| t.0).collect();
    let demands: Vec<f64> = batch.iter().map(|t| t.3).collect();
    let weights: Vec<f64> = batch.iter().map(|t| t.2).collect();
    // The batch band's capacity as the checks take it: what 97 % of C leaves after
    // interactive, over the 97 % the checks apply.
    let left = (0.97 * RATE - interactive) / 0.97;
    let shares = Shares::check(rule, &names, &rates[3..], &demands, &weights, left);
    eprintln!("batch: water-filling {:.1?}", shares.ideal);
    assert!(shares.wrong.is_empty(), "{:#?}", shares.wrong);
    let used: f64 = rates.iter().sum::<f64>() / RATE;
    assert!(used >= USED, "{:.1} % of the capacity used", 100.0 * used);
    // Waits: requests waited, none past max_wait_ms.
    let waited = measured
        .iter()
        .flatten()
        .filter(|s| s.status == 200 && s.ms > 20)
        .count();
    assert!(waited > 100, "requests admitted after waiting: {waited}");
    let late: Vec<&&Seen> = measured
        .iter()
        .flatten()
        .filter(|s| s.ms > MAX_WAIT_MS + SLACK_MS)
        .collect();
    assert!(late.is_empty(), "held past max_wait_ms: {late:?}");
}
