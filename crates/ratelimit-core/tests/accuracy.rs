//! Accuracy of every algorithm against a reference model written from its definition, on
//! random traces with a fake clock; and a Cloudflare-style comparison of the sliding window
//! counter with an exact sliding log.
//!
//! `cargo test --release --test accuracy -- --nocapture` prints the figures the README quotes.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::testkit::reference as model;
use ratelimit_core::testkit::Rng;

use ratelimit_core::limiter::{gcra, Policy, State, Windows};
use std::collections::HashMap;

/// Runs a trace of (time, cost) through a policy; returns the admitted flags.
fn run_policy(policy: &Policy, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut state: Option<State> = None;
    trace
        .iter()
        .map(|&(t, c)| {
            let (v, next) = policy.decide(state.as_ref(), t, c);
            if let Some(n) = next {
                state = Some(n);
            }
            v.allowed
        })
        .collect()
}

/// A random trace: mostly small steps, some bursts, some long pauses; costs 1–3.
fn trace(rng: &mut Rng, n: usize, window_ms: u64) -> Vec<(u64, u64)> {
    let mut t = 1_700_000_000_000 + rng.below(window_ms);
    (0..n)
        .map(|_| {
            t += match rng.below(10) {
                0..=3 => 0,
                4..=7 => rng.below(window_ms / 10 + 1),
                8 => rng.below(window_ms),
                _ => rng.below(3 * window_ms),
            };
            (t, 1 + rng.below(3))
        })
        .collect()
}

#[test]
fn every_algorithm_matches_its_reference_on_random_traces() {
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut checked = 0;
    for case in 0..300 {
        let limit = 1 + rng.below(20);
        let w = [1_000, 1_500, 7_000, 60_000][rng.below(4) as usize];
        let burst = 1 + rng.below(25);
        let t = trace(&mut rng, 200, w);
        let cases: [(&str, Policy, Vec<bool>); 4] = [
            (
                "sliding_window",
                Policy::SlidingWindow {
                    limit,
                    window_ms: w,
                },
                model::sliding_window(limit, w, &t),
            ),
            (
                "fixed_window",
                Policy::FixedWindow {
                    limit,
                    windows: Windows::every(w),
                },
                model::fixed_window(limit, w, &t),
            ),
            (
                "token_bucket",
                Policy::Gcra(gcra::Params {
                    limit,
                    window_ms: w,
                    burst,
                    max_delay_ms: None,
                }),
                model::token_bucket(limit, w, burst, &t),
            ),
            (
                "sliding_log",
                Policy::SlidingLog {
                    limit,
                    window_ms: w,
                },
                model::sliding_log(limit, w, &t),
            ),
        ];
        for (name, policy, expected) in cases {
            let got = run_policy(&policy, &t);
            if let Some(i) = got.iter().zip(&expected).position(|(a, b)| a != b) {
                panic!(
                    "case {case} {name} limit={limit} w={w} burst={burst}: request {i} {:?} got {} expected {}",
                    t[i], got[i], expected[i]
                );
            }
            checked += got.len();
        }
        // Delay mode: the same admissions and the same waits as the queue model.
        let max_delay = rng.below(3 * w);
        let policy = Policy::Gcra(gcra::Params {
            limit,
            window_ms: w,
            burst,
            max_delay_ms: Some(max_delay),
        });
        let expected = model::leaky_delay(limit, w, burst, max_delay, &t);
        let mut state: Option<State> = None;
        for (i, &(at, c)) in t.iter().enumerate() {
            let (v, next) = policy.decide(state.as_ref(), at, c);
            if next.is_some() {
                state = next;
            }
            assert_eq!(
                (v.allowed, v.delay_ms),
                expected[i],
                "case {case} leaky delay request {i}"
            );
        }
    }
    assert!(checked >= 4 * 300 * 200, "{checked}");
}

/// Retry-After is exact for every algorithm: a request at `now + retry_after` is admitted and
/// one a millisecond earlier is not (when no other request intervenes).
#[test]
fn retry_after_is_exact_for_every_algorithm() {
    let mut rng = Rng(42);
    let mut checked = 0;
    for _ in 0..2_000 {
        let limit = 1 + rng.below(10);
        let w = [1_000, 3_000, 60_000][rng.below(3) as usize];
        let burst = 1 + rng.below(10);
        let policies = [
            Policy::SlidingWindow {
                limit,
                window_ms: w,
            },
            Policy::FixedWindow {
                limit,
                windows: Windows::every(w),
            },
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: w,
                burst,
                max_delay_ms: None,
            }),
            Policy::SlidingLog {
                limit,
                window_ms: w,
            },
        ];
        let n = 1 + rng.below(30) as usize;
        let t = trace(&mut rng, n, w);
        for policy in policies {
            let mut state = None;
            for &(at, c) in &t {
                if let (_, Some(s)) = policy.decide(state.as_ref(), at, c) {
                    state = Some(s);
                }
            }
            let (now, cost) = (t.last().unwrap().0, 1);
            let (v, _) = policy.decide(state.as_ref(), now, cost);
            if v.allowed || v.retry_after_ms == u64::MAX {
                continue;
            }
            let r = v.retry_after_ms;
            assert!(
                policy.decide(state.as_ref(), now + r, cost).0.allowed,
                "{policy:?} {state:?} now={now} r={r}"
            );
            assert!(
                !policy.decide(state.as_ref(), now + r - 1, cost).0.allowed,
                "{policy:?} {state:?} now={now} r={r}"
            );
            checked += 1;
        }
    }
    assert!(checked > 1_000, "{checked}");
}

/// The Cloudflare experiment: well-behaved and abusive clients, every request counted (as
/// Cloudflare did, so both sides see the same history), and at each request the decision of the
/// sliding window counter's estimate compared with the exact count from a sliding log.
///
/// Both run with a limit no client reaches, so every request is stored; the decision under the
/// real limit `L` is read from the reported remaining quota: admitted iff `remaining ≥ L' − L`.
#[test]
fn sliding_window_counter_against_the_exact_log() {
    // Cloudflare-like: 98 % of clients at 5–60 % of the limit, 2 % abusive at 3–10×.
    let (allowed, limited) = experiment("typical", |rng, abusive| {
        if abusive {
            300 + rng.below(700)
        } else {
            5 + rng.below(56)
        }
    });
    assert!(
        allowed + limited < 0.1,
        "typical traffic: {allowed}% + {limited}%"
    );
    // Harsh: every well-behaved client hovers at 20–110 % of the limit.
    let (allowed, limited) = experiment("near the limit", |rng, abusive| {
        if abusive {
            300 + rng.below(700)
        } else {
            20 + rng.below(91)
        }
    });
    assert!(
        allowed + limited < 5.0,
        "near the limit: {allowed}% + {limited}%"
    );
}

/// Runs 2,000 clients for 10 minutes at a limit of 100 per minute; `rate(rng, abusive)` gives
/// a client's mean requests per minute. Returns the wrongly allowed and limited shares (%).
fn experiment(name: &str, rate: impl Fn(&mut Rng, bool) -> u64) -> (f64, f64) {
    let (limit, w) = (100u64, 60_000u64);
    let unreachable = 1_000_000_000u64;
    let minutes = 10;
    let mut rng = Rng(0xc10d_f1a2e);
    let mut requests: Vec<(u64, u32)> = Vec::new();
    for client in 0..2_000u32 {
        let abusive = rng.below(100) < 2;
        let per_minute = rate(&mut rng, abusive);
        let gap = w / per_minute; // mean gap, ms
        let mut t = 1_700_000_000_000 + rng.below(w);
        let end = t + minutes * w;
        while t < end {
            requests.push((t, client));
            t += 1 + rng.below(2 * gap);
        }
    }
    requests.sort_unstable();
    let counter = Policy::SlidingWindow {
        limit: unreachable,
        window_ms: w,
    };
    let exact = Policy::SlidingLog {
        limit: unreachable,
        window_ms: w,
    };
    let admitted = |remaining: u64| remaining >= unreachable - limit;
    let mut states: HashMap<u32, (Option<State>, Option<State>)> = HashMap::new();
    let (mut wrongly_allowed, mut wrongly_limited, mut limited) = (0u64, 0u64, 0u64);
    for &(t, client) in &requests {
        let (a, b) = states.entry(client).or_default();
        let (va, na) = counter.decide(a.as_ref(), t, 1);
        let (vb, nb) = exact.decide(b.as_ref(), t, 1);
        *a = na;
        *b = nb;
        let (by_counter, by_log) = (admitted(va.remaining), admitted(vb.remaining));
        limited += u64::from(!by_log);
        match (by_counter, by_log) {
            (true, false) => wrongly_allowed += 1,
            (false, true) => wrongly_limited += 1,
            _ => {}
        }
    }
    let n = requests.len() as f64;
    let pct = |x: u64| 100.0 * x as f64 / n;
    println!(
        "sliding window counter vs exact log, {name}: {} requests from 2,000 clients over \
         {minutes} min, {:.2}% over the limit by the exact count; wrongly allowed {:.4}%, \
         wrongly limited {:.4}%",
        requests.len(),
        pct(limited),
        pct(wrongly_allowed),
        pct(wrongly_limited)
    );
    assert!(requests.len() > 100_000);
    assert!(limited > 0);
    (pct(wrongly_allowed), pct(wrongly_limited))
}

/// A wall clock that jumps backwards never unlocks quota, for any algorithm: after a key is
/// refused at `t`, it is still refused at any earlier time, and no panic happens.
#[test]
fn a_clock_jumping_backwards_unlocks_nothing() {
    let w = 60_000;
    let policies = [
        Policy::SlidingWindow {
            limit: 5,
            window_ms: w,
        },
        Policy::FixedWindow {
            limit: 5,
            windows: Windows::every(w),
        },
        Policy::Gcra(gcra::Params {
            limit: 5,
            window_ms: w,
            burst: 5,
            max_delay_ms: None,
        }),
        Policy::Gcra(gcra::Params {
            limit: 5,
            window_ms: w,
            burst: 5,
            max_delay_ms: Some(60_000),
        }),
        Policy::SlidingLog {
            limit: 5,
            window_ms: w,
        },
    ];
    let t = 1_700_000_000_000u64;
    for policy in policies {
        let mut state = None;
        let mut admitted = 0;
        for i in 0..10 {
            let (v, next) = policy.decide(state.as_ref(), t + i, 1);
            if let Some(n) = next {
                state = Some(n);
                admitted += 1;
            }
            assert!(v.retry_after_ms > 0 || v.allowed);
        }
        assert_eq!(admitted, 5, "{policy:?}");
        for back in [1, 1_000, 59_999, 60_000, 3_600_000, t, u64::MAX / 2] {
            let at = t.saturating_sub(back);
            let (v, next) = policy.decide(state.as_ref(), at, 1);
            assert!(
                !v.allowed && next.is_none(),
                "{policy:?} unlocked at t−{back}"
            );
        }
    }
}
