//! Every algorithm against its reference model, on arbitrary traces: the same decisions at every
//! request (and, for the delaying leaky bucket, the same waits), and a refusal's `retry_after`
//! exact (a request then is admitted, one a millisecond earlier is not). The reference models
//! are those of `crates/ratelimit-core/tests/accuracy.rs`, copied (a test file's functions are
//! not importable): written from each algorithm's definition, independent of the code under
//! test.
//!
//! Input: the algorithm, limit, window, burst and delay, then the trace: for each request a
//! gap and a cost.

use crate::Bytes;
use ratelimit_core::limiter::{gcra, Policy, State, Windows};
use std::collections::HashMap;

/// Windows a rule may have: seconds to a day.
const WINDOWS: [u64; 8] = [
    1_000, 1_500, 7_000, 60_000, 90_000, 3_600_000, 7_200_000, 86_400_000,
];

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let which = input.u8() % 5;
    let limit = 1 + u64::from(input.u16() % 1000);
    let w = match input.u8() % 3 {
        0 => WINDOWS[input.below(WINDOWS.len())],
        _ => 1000 * (1 + u64::from(input.u32() % 86_400)),
    };
    let burst = 1 + u64::from(input.u16() % 1000);
    let max_delay = u64::from(input.u32()) % (3 * w + 1);
    let mut t = 1_700_000_000_000 + u64::from(input.u32()) % w;
    let mut trace = Vec::new();
    while !input.is_empty() && trace.len() < 400 {
        let kind = input.u8();
        let gap = match kind % 6 {
            0 | 1 => 0,
            2 => u64::from(input.u8()),
            3 => u64::from(input.u32()) % (w / 10 + 1),
            4 => u64::from(input.u32()) % (w + 1),
            _ => u64::from(input.u32()) % (3 * w + 1),
        };
        t += gap;
        let cost = match (kind >> 3) % 4 {
            0..=2 => 1 + u64::from(kind >> 5) % 3,
            _ => 1 + u64::from(input.u16()) % (limit.max(burst) + 2),
        };
        trace.push((t, cost));
    }
    if trace.is_empty() {
        return;
    }

    let (policy, expected): (Policy, Vec<(bool, u64)>) = match which {
        0 => (
            Policy::SlidingWindow {
                limit,
                window_ms: w,
            },
            plain(reference_sliding_window(limit, w, &trace)),
        ),
        1 => (
            Policy::FixedWindow {
                limit,
                windows: Windows::every(w),
            },
            plain(reference_fixed_window(limit, w, &trace)),
        ),
        2 => (
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: w,
                burst,
                max_delay_ms: None,
            }),
            plain(reference_token_bucket(limit, w, burst, &trace)),
        ),
        3 => (
            Policy::SlidingLog {
                limit,
                window_ms: w,
            },
            plain(reference_sliding_log(limit, w, &trace)),
        ),
        _ => (
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: w,
                burst,
                max_delay_ms: Some(max_delay),
            }),
            reference_leaky_delay(limit, w, burst, max_delay, &trace),
        ),
    };
    let delays = which == 4;
    let mut state: Option<State> = None;
    for (i, (&(at, c), want)) in trace.iter().zip(&expected).enumerate() {
        let (v, next) = policy.decide(state.as_ref(), at, c);
        if let Some(n) = next {
            state = Some(n);
        }
        let got = (v.allowed, if delays { v.delay_ms } else { 0 });
        assert_eq!(got, *want, "{policy:?} request {i} at {at} cost {c}");
    }

    // Retry-After is exact (when no request intervenes), as `accuracy.rs` checks it: for the
    // algorithms that refuse rather than delay.
    if delays {
        return;
    }
    let (now, cost) = (trace[trace.len() - 1].0, 1);
    let (v, _) = policy.decide(state.as_ref(), now, cost);
    if let (false, Some(_)) = (v.allowed, now.checked_add(v.retry_after_ms)) {
        let r = v.retry_after_ms;
        assert!(r > 0, "{policy:?} refused with no wait");
        assert!(
            policy.decide(state.as_ref(), now + r, cost).0.allowed,
            "{policy:?} {state:?} now={now} r={r}: refused at now + r"
        );
        assert!(
            !policy.decide(state.as_ref(), now + r - 1, cost).0.allowed,
            "{policy:?} {state:?} now={now} r={r}: admitted before now + r"
        );
    }
}

fn plain(admitted: Vec<bool>) -> Vec<(bool, u64)> {
    admitted.into_iter().map(|a| (a, 0)).collect()
}

/// Reference: the sliding window counter from its definition, counts kept per window index.
fn reference_sliding_window(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let (i, e) = (t / w, t % w);
            let prev = i
                .checked_sub(1)
                .and_then(|p| counts.get(&p))
                .copied()
                .unwrap_or(0);
            let cur = counts.get(&i).copied().unwrap_or(0);
            // prev × (1 − e/w) + cur + c ≤ limit, multiplied through by w.
            let ok = prev * (w - e) + (cur + c) * w <= limit * w;
            if ok {
                *counts.entry(i).or_default() += c;
            }
            ok
        })
        .collect()
}

/// Reference: fixed windows.
fn reference_fixed_window(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut counts: HashMap<u64, u64> = HashMap::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let n = counts.entry(t / w).or_default();
            let ok = *n + c <= limit;
            if ok {
                *n += c;
            }
            ok
        })
        .collect()
}

/// Reference: a token bucket holding tokens, refilled continuously. Tokens are counted in
/// units of 1/w so that `limit` tokens per `w` ms is exactly `limit` units per ms.
fn reference_token_bucket(limit: u64, w: u64, burst: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let full = burst * w;
    let (mut tokens, mut last) = (full, 0u64);
    trace
        .iter()
        .map(|&(t, c)| {
            if last > 0 {
                tokens = (tokens + (t - last) * limit).min(full);
            }
            last = t;
            let ok = tokens >= c * w;
            if ok {
                tokens -= c * w;
            }
            ok
        })
        .collect()
}

/// Reference: nginx-style delaying leaky bucket: requests leave one emission interval apart;
/// one is admitted if its departure is at most `max_delay` away and the queue fits `burst`.
fn reference_leaky_delay(
    limit: u64,
    w: u64,
    burst: u64,
    max_delay: u64,
    trace: &[(u64, u64)],
) -> Vec<(bool, u64)> {
    // Times in units of 1/limit ms: one request occupies w units.
    let mut next_free = 0u128;
    trace
        .iter()
        .map(|&(t, c)| {
            let now = u128::from(t) * u128::from(limit);
            let depart = next_free.max(now);
            let wait = depart - now;
            let ok = wait <= u128::from(max_delay) * u128::from(limit)
                && depart + u128::from(c * w) - now <= u128::from(burst * w);
            if ok {
                next_free = depart + u128::from(c * w);
            }
            let wait_ms = wait.div_ceil(u128::from(limit)) as u64;
            (ok, if ok { wait_ms } else { 0 })
        })
        .collect()
}

/// Reference: every admitted request's time and cost, counted over the last window.
fn reference_sliding_log(limit: u64, w: u64, trace: &[(u64, u64)]) -> Vec<bool> {
    let mut log: Vec<(u64, u64)> = Vec::new();
    trace
        .iter()
        .map(|&(t, c)| {
            let used: u64 = log
                .iter()
                .filter(|(at, _)| at + w > t)
                .map(|(_, c)| c)
                .sum();
            let ok = used + c <= limit;
            if ok {
                log.push((t, c));
            }
            ok
        })
        .collect()
}
