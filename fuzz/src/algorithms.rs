//! Every algorithm against its reference model, on arbitrary traces: the same decisions at every
//! request (and, for the delaying leaky bucket, the same waits), and a refusal's `retry_after`
//! exact (a request then is admitted, one a millisecond earlier is not). The reference models
//! are the core's (`ratelimit_core::testkit::reference`, which `tests/accuracy.rs` uses too):
//! written from each algorithm's definition, independent of the code under test.
//!
//! Input: the algorithm, limit, window, burst and delay, then the trace: for each request a
//! gap and a cost.

use crate::Bytes;
use ratelimit_core::limiter::{gcra, Policy, State, Windows};
use ratelimit_core::testkit::reference as model;

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
            plain(model::sliding_window(limit, w, &trace)),
        ),
        1 => (
            Policy::FixedWindow {
                limit,
                windows: Windows::every(w),
            },
            plain(model::fixed_window(limit, w, &trace)),
        ),
        2 => (
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: w,
                burst,
                max_delay_ms: None,
            }),
            plain(model::token_bucket(limit, w, burst, &trace)),
        ),
        3 => (
            Policy::SlidingLog {
                limit,
                window_ms: w,
            },
            plain(model::sliding_log(limit, w, &trace)),
        ),
        _ => (
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: w,
                burst,
                max_delay_ms: Some(max_delay),
            }),
            model::leaky_delay(limit, w, burst, max_delay, &trace),
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
