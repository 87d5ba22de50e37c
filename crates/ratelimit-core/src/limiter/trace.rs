//! What a forgotten key still owed, and the state a key starts from when it comes back.
//!
//! The table forgets keys to keep its memory bounded. A key forgotten while it still counts
//! leaves a [`Trace`]: the requests it remembered and until when they count. A key that comes
//! back starts from [`Policy::seeded`], a state of its own algorithm holding at least what the
//! trace says until at least when it says it: never a fresh budget. A trace may stand for several
//! keys (the table merges traces when it has no room for more), so it is read in the requests of
//! whatever rule the returning key has; that is what makes it conservative, and what an innocent
//! key that happens to share it pays.

use super::{fixed_window, gcra, in_flight, sliding_window, Policy, State};

/// What a forgotten entry still held at the time it was forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The requests it remembered (a GCRA key's debt in requests, an in-flight key's slots).
    pub weight: u64,
    /// When they stop counting, ms since the epoch.
    pub until_ms: u64,
    /// The fleet had refused the key until `until_ms` ([`State::Blocked`]).
    pub blocked: bool,
}

impl Trace {
    /// The trace that holds both: each figure's larger value (what stands for two keys).
    pub fn max(self, other: Trace) -> Trace {
        Trace {
            weight: self.weight.max(other.weight),
            until_ms: self.until_ms.max(other.until_ms),
            blocked: self.blocked || other.blocked,
        }
    }
}

/// The end of the window after the one holding `at_ms`, for windows of `window_ms` aligned to
/// the epoch: when a count made at `at_ms` stops counting in a sliding window.
fn end_of_next(at_ms: u64, window_ms: u64) -> u64 {
    let w = window_ms.max(1);
    (at_ms / w).saturating_add(2).saturating_mul(w)
}

impl State {
    /// What this entry still holds at `now_ms`, were it forgotten now; `None` when it holds
    /// nothing a limit needs: it no longer counts, or it is a lease (quota the service counts)
    /// or a tenant's use (the shared capacity counts it), or a sliding log (never forgotten).
    pub fn trace(&self, now_ms: u64) -> Option<Trace> {
        let traced = |weight: u64, until_ms: u64| Trace {
            weight,
            until_ms,
            blocked: false,
        };
        match self {
            State::SlidingWindow(s) => {
                let until = end_of_next(s.last_ms, u64::from(s.window_ms));
                s.weight(now_ms).map(|w| traced(w, until))
            }
            State::FixedWindow(s) => s.weight(now_ms).map(|w| traced(w, s.window().1)),
            State::Gcra(s) => {
                let until = s.tat_ms.saturating_add(u64::from(s.tat_frac > 0));
                s.weight(now_ms).map(|w| traced(w, until))
            }
            State::InFlight(s) => {
                let until = end_of_next(s.gen_ms, u64::from(s.lease_ms));
                s.weight(now_ms).map(|w| traced(w, until))
            }
            State::Blocked { until_ms } => (now_ms < *until_ms).then_some(Trace {
                weight: u64::MAX,
                until_ms: *until_ms,
                blocked: true,
            }),
            State::SlidingLog(_) | State::Lease(_) | State::Tenant(_) => None,
        }
    }
}

impl Policy {
    /// The most a key of this policy holds before it is refused, in the units of
    /// [`State::weight`]: the limit (a bucket's burst for GCRA, the slots for requests in
    /// flight).
    pub fn most(&self) -> u64 {
        match *self {
            Policy::SlidingWindow { limit, .. }
            | Policy::SlidingLog { limit, .. }
            | Policy::FixedWindow { limit, .. }
            | Policy::Lease { limit, .. } => limit,
            Policy::Gcra(p) => p.burst,
            Policy::InFlight { max, .. } => max,
        }
    }

    /// The state a key of this policy starts from at `now_ms` when the table holds `trace` for
    /// it: `trace.weight` requests counted now (a GCRA key owes them, or the time left until
    /// `until_ms` if that is less), which count for at least as long as the trace. `None` when
    /// the trace no longer counts, or the policy keeps nothing a trace could stand for (a
    /// lease, a sliding log).
    pub fn seeded(&self, trace: &Trace, now_ms: u64) -> Option<State> {
        if now_ms >= trace.until_ms {
            return None;
        }
        if trace.blocked {
            return Some(State::Blocked {
                until_ms: trace.until_ms,
            });
        }
        let weight = u32::try_from(trace.weight).unwrap_or(u32::MAX);
        match *self {
            Policy::SlidingWindow { window_ms, .. } => {
                Some(State::SlidingWindow(sliding_window::State {
                    last_ms: now_ms,
                    window_ms: u32::try_from(window_ms).unwrap_or(u32::MAX),
                    current: weight,
                    previous: 0,
                }))
            }
            Policy::FixedWindow { windows, .. } => Some(State::FixedWindow(fixed_window::counted(
                now_ms,
                windows.bounds(now_ms),
                trace.weight,
            ))),
            Policy::Gcra(p) => Some(State::Gcra(gcra::owing(
                now_ms,
                &p,
                trace.weight,
                trace.until_ms,
            ))),
            Policy::InFlight { lease_ms, .. } => {
                let lease = lease_ms.max(1);
                Some(State::InFlight(in_flight::State {
                    gen_ms: now_ms / lease * lease,
                    lease_ms: u32::try_from(lease).unwrap_or(u32::MAX),
                    current: weight,
                    previous: 0,
                }))
            }
            Policy::SlidingLog { .. } | Policy::Lease { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Windows;

    const MIN: u64 = 60_000;

    fn policies() -> Vec<Policy> {
        vec![
            Policy::SlidingWindow {
                limit: 5,
                window_ms: MIN,
            },
            Policy::FixedWindow {
                limit: 5,
                windows: Windows::every(MIN),
            },
            Policy::Gcra(gcra::Params {
                limit: 5,
                window_ms: MIN,
                burst: 5,
                max_delay_ms: None,
            }),
            Policy::InFlight {
                max: 5,
                lease_ms: MIN,
            },
        ]
    }

    /// A key used up and forgotten, then back at any later time, is refused whenever the key
    /// it was would have been, and admitted again no later than a fresh key's trace says.
    #[test]
    fn a_key_that_comes_back_is_never_admitted_where_it_would_have_been_refused() {
        for policy in policies() {
            let start = 10 * MIN + 1_234;
            let mut state = None;
            for i in 0..5 {
                let (v, next) = policy.decide(state.as_ref(), start + i * 100, 1);
                assert!(v.allowed, "{policy:?}");
                state = next;
            }
            let kept = state.clone().unwrap();
            let forgot_at = start + 1_000;
            let trace = kept.trace(forgot_at).unwrap();
            for later in (forgot_at..forgot_at + 3 * MIN).step_by(997) {
                let remembered = policy.decide(Some(&kept), later, 1).0.allowed;
                let seeded = policy.seeded(&trace, later);
                let back = policy.decide(seeded.as_ref(), later, 1).0.allowed;
                assert!(
                    !back || remembered,
                    "{policy:?} at +{}: admitted after forgetting",
                    later - forgot_at
                );
            }
            // The trace ends: a key back after it starts afresh.
            assert_eq!(policy.seeded(&trace, trace.until_ms), None);
        }
    }

    #[test]
    fn a_block_comes_back_as_a_block_and_leases_leave_nothing() {
        let blocked = State::Blocked { until_ms: 5_000 };
        let trace = blocked.trace(1_000).unwrap();
        for policy in policies() {
            assert_eq!(policy.seeded(&trace, 2_000), Some(blocked.clone()));
        }
        assert_eq!(blocked.trace(5_000), None);
    }

    #[test]
    fn traces_merge_to_the_larger_of_each_figure() {
        let a = Trace {
            weight: 3,
            until_ms: 9,
            blocked: false,
        };
        let b = Trace {
            weight: 1,
            until_ms: 20,
            blocked: true,
        };
        assert_eq!(
            a.max(b),
            Trace {
                weight: 3,
                until_ms: 20,
                blocked: true
            }
        );
    }
}
