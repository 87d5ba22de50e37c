//! The algorithms: each a pure function of (state, now, limits, cost) → (verdict, new state).
//! [`Policy`] is a rule's algorithm with its numbers, [`State`] a key's stored state, [`Verdict`]
//! what one rule says of one request. Where state lives and how it is updated is
//! [`crate::engine`]'s business.

pub mod calendar;
pub(crate) mod codec;
pub mod fixed_window;
pub mod gcra;
pub mod in_flight;
pub mod lease;
pub mod sliding_log;
pub mod sliding_window;
pub mod tenant;
pub mod trace;

pub use calendar::Windows;
pub use trace::Trace;

/// `limit` scaled by `factor` permille, at least 1.
pub fn scale(limit: u64, factor: u32) -> u64 {
    (limit.saturating_mul(u64::from(factor)) / 1000).max(1)
}

/// One rule's decision for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether this rule admits the request.
    pub allowed: bool,
    /// The rule's limit (requests per window).
    pub limit: u64,
    /// The rule's window in seconds.
    pub window_s: u64,
    /// Whole requests left: after this one if allowed, else now.
    pub remaining: u64,
    /// Milliseconds until more quota is available than `remaining` (0: the quota is full).
    pub reset_ms: u64,
    /// If refused, milliseconds until a request like this one would be allowed.
    pub retry_after_ms: u64,
    /// If admitted in delay mode, milliseconds to hold the request before it goes on.
    pub delay_ms: u64,
}

/// A rule's algorithm with its parameters: everything needed to decide, nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The sliding window counter.
    SlidingWindow {
        /// Requests per window.
        limit: u64,
        /// Window, ms.
        window_ms: u64,
    },
    /// The fixed window counter.
    FixedWindow {
        /// Requests per window.
        limit: u64,
        /// Where its windows begin and end.
        windows: Windows,
    },
    /// Token bucket, or leaky bucket (with or without delay).
    Gcra(gcra::Params),
    /// The exact sliding log.
    SlidingLog {
        /// Requests per window.
        limit: u64,
        /// Window, ms.
        window_ms: u64,
    },
    /// Requests in flight.
    InFlight {
        /// Requests in flight at once.
        max: u64,
        /// How long a slot never given back stays taken (at least), ms.
        lease_ms: u64,
    },
    /// Quota leased from a rate limit service ([`lease`]): the service's limit, reported.
    Lease {
        /// The limit, as configured (the service's own decides).
        limit: u64,
        /// The rule's windows, as configured (for the fields; the service's reset decides).
        windows: Windows,
        /// The largest block claimed at once.
        max_block: u64,
        /// What a request may not take of what this proxy holds: kept for the tenants under
        /// their shares of a fleet-fair shared capacity, set per request
        /// ([`crate::share::fair::keeping`]); 0 as configured.
        kept: u64,
    },
}

/// A key's stored state, for whichever algorithm its rule uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// See [`sliding_window`].
    SlidingWindow(sliding_window::State),
    /// See [`fixed_window`].
    FixedWindow(fixed_window::State),
    /// See [`gcra`].
    Gcra(gcra::State),
    /// See [`sliding_log`].
    SlidingLog(sliding_log::State),
    /// See [`in_flight`].
    InFlight(in_flight::State),
    /// See [`lease`].
    Lease(lease::State),
    /// A tenant of a shared capacity (see [`tenant`]): what it used, and how it is counted
    /// among the active tenants. Its rule's own state is the capacity's, elsewhere.
    Tenant(tenant::Tenant),
    /// A global rule's service said the key is over its limit until this time (ms): every
    /// request is refused until then, whatever the local counts say; afterwards the key starts
    /// afresh.
    Blocked {
        /// When the block ends, ms since the epoch.
        until_ms: u64,
    },
}

impl State {
    /// Requests this entry still remembers at `now_ms`; `None` once it affects no decision.
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        match self {
            State::SlidingWindow(s) => s.weight(now_ms),
            State::FixedWindow(s) => s.weight(now_ms),
            State::Gcra(s) => s.weight(now_ms),
            State::SlidingLog(s) => s.weight(now_ms),
            State::InFlight(s) => s.weight(now_ms),
            State::Lease(s) => s.weight(now_ms),
            State::Tenant(t) => t.weight_at(now_ms),
            // A blocked key is kept over any other: it is what the whole fleet decided.
            State::Blocked { until_ms } => (now_ms < *until_ms).then_some(u64::from(u32::MAX)),
        }
    }

    /// The latest time the entry refers to (to evict the oldest first among equals).
    pub fn last_ms(&self) -> u64 {
        match self {
            State::SlidingWindow(s) => s.last_ms,
            State::FixedWindow(s) => s.last_ms,
            State::Gcra(s) => s.tat_ms,
            State::SlidingLog(s) => s.times.last().copied().unwrap_or(0),
            State::InFlight(s) => s.gen_ms,
            State::Lease(s) => s.expires_ms,
            State::Tenant(t) => t.usage.last_ms,
            State::Blocked { until_ms } => *until_ms,
        }
    }
}

impl Policy {
    /// The limit and the window (ms) of the policy; for calendar months, the longest (31 days):
    /// [`Policy::window_at`] has the window of a given time.
    pub fn limit_and_window(&self) -> (u64, u64) {
        match *self {
            Policy::SlidingWindow { limit, window_ms }
            | Policy::SlidingLog { limit, window_ms } => (limit, window_ms),
            Policy::FixedWindow { limit, windows } | Policy::Lease { limit, windows, .. } => {
                (limit, windows.longest_ms())
            }
            Policy::Gcra(p) => (p.limit, p.window_ms),
            Policy::InFlight { max, .. } => (max, 0),
        }
    }

    /// The window holding `now_ms` (start, end), ms since the epoch: a fixed window's own (a
    /// calendar month's, a week from Monday), else one of the policy's length aligned to the
    /// epoch; `None` for a policy without a window (requests in flight).
    pub fn window_at(&self, now_ms: u64) -> Option<(u64, u64)> {
        match *self {
            Policy::FixedWindow { windows, .. } | Policy::Lease { windows, .. } => {
                Some(windows.bounds(now_ms))
            }
            Policy::InFlight { .. } => None,
            p => Some(Windows::every(p.limit_and_window().1).bounds(now_ms)),
        }
    }

    /// The policy with its limit (and burst) scaled by `factor` permille: an elastic rule's
    /// limit in force.
    pub fn scaled(&self, factor: u32) -> Policy {
        let scale = |n: u64| scale(n, factor);
        match *self {
            Policy::SlidingWindow { limit, window_ms } => Policy::SlidingWindow {
                limit: scale(limit),
                window_ms,
            },
            Policy::FixedWindow { limit, windows } => Policy::FixedWindow {
                limit: scale(limit),
                windows,
            },
            Policy::SlidingLog { limit, window_ms } => Policy::SlidingLog {
                limit: scale(limit),
                window_ms,
            },
            Policy::Gcra(p) => Policy::Gcra(gcra::Params {
                limit: scale(p.limit),
                burst: scale(p.burst),
                ..p
            }),
            Policy::InFlight { max, lease_ms } => Policy::InFlight {
                max: scale(max),
                lease_ms,
            },
            p @ Policy::Lease { .. } => p, // the service's limit is not scaled here
        }
    }

    /// The policy with the limit (requests per window, or in flight) `limit` and, for a
    /// bucket, the burst `burst`: the numbers a request carried.
    pub fn with_limit(&self, limit: u64, burst: u64) -> Policy {
        match *self {
            Policy::SlidingWindow { window_ms, .. } => Policy::SlidingWindow { limit, window_ms },
            Policy::FixedWindow { windows, .. } => Policy::FixedWindow { limit, windows },
            Policy::SlidingLog { window_ms, .. } => Policy::SlidingLog { limit, window_ms },
            Policy::Gcra(p) => Policy::Gcra(gcra::Params { limit, burst, ..p }),
            Policy::InFlight { lease_ms, .. } => Policy::InFlight {
                max: limit,
                lease_ms,
            },
            Policy::Lease {
                windows,
                max_block,
                kept,
                ..
            } => Policy::Lease {
                limit,
                windows,
                max_block,
                kept,
            },
        }
    }

    /// A bucket's burst (`None` for the other algorithms).
    pub fn burst(&self) -> Option<u64> {
        match self {
            Policy::Gcra(p) => Some(p.burst),
            _ => None,
        }
    }

    /// Whether keys of this policy live in the sliding-log slots rather than in buckets.
    pub fn uses_log(&self) -> bool {
        matches!(self, Policy::SlidingLog { .. })
    }

    /// Decides a request of `cost` at `now_ms` for a key in `state`. A state of another
    /// algorithm (a hash collision) is treated as no state.
    pub fn decide(
        &self,
        state: Option<&State>,
        now_ms: u64,
        cost: u64,
    ) -> (Verdict, Option<State>) {
        if let Some(State::Blocked { until_ms }) = state {
            if now_ms < *until_ms {
                let limit = self.limit_and_window().0;
                let window_s = self
                    .window_at(now_ms)
                    .map_or(0, |(start, end)| (end - start) / 1000);
                let wait = until_ms - now_ms;
                let verdict = Verdict {
                    allowed: false,
                    limit,
                    window_s,
                    remaining: 0,
                    reset_ms: wait,
                    retry_after_ms: wait,
                    delay_ms: 0,
                };
                return (verdict, None);
            }
            return self.decide(None, now_ms, cost);
        }
        match *self {
            Policy::SlidingWindow { limit, window_ms } => {
                let s = match state {
                    Some(State::SlidingWindow(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = sliding_window::decide(s, now_ms, limit, window_ms, cost);
                (v, n.map(State::SlidingWindow))
            }
            Policy::FixedWindow { limit, windows } => {
                let s = match state {
                    Some(State::FixedWindow(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = fixed_window::decide(s, now_ms, limit, windows, cost);
                (v, n.map(State::FixedWindow))
            }
            Policy::Gcra(params) => {
                let s = match state {
                    Some(State::Gcra(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = gcra::decide(s, now_ms, &params, cost);
                (v, n.map(State::Gcra))
            }
            Policy::SlidingLog { limit, window_ms } => {
                let s = match state {
                    Some(State::SlidingLog(s)) => Some(s),
                    _ => None,
                };
                let (v, n) = sliding_log::decide(s, now_ms, limit, window_ms, cost);
                (v, n.map(State::SlidingLog))
            }
            Policy::InFlight { max, lease_ms } => {
                let s = match state {
                    Some(State::InFlight(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = in_flight::decide(s, now_ms, max, lease_ms, cost);
                (v, n.map(State::InFlight))
            }
            Policy::Lease {
                limit,
                windows,
                kept,
                ..
            } => {
                let s = match state {
                    Some(State::Lease(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = lease::decide_keeping(s, now_ms, (limit, windows), cost, kept);
                (v, n.map(State::Lease))
            }
        }
    }

    /// Counts `cost` for a key whatever its limit says: a usage known only once the response
    /// is done. The verdict reports the quota left after it. `None` for the policies that
    /// cannot be charged afterwards (the configuration refuses them).
    pub fn charge(
        &self,
        state: Option<&State>,
        now_ms: u64,
        cost: u64,
    ) -> Option<(Verdict, State)> {
        let fresh = matches!(state, Some(State::Blocked { until_ms }) if now_ms >= *until_ms);
        let state = if fresh { None } else { state };
        match (*self, state) {
            (_, Some(State::Blocked { .. })) => {
                // The fleet refused the key until a time: what it used still counts afterwards.
                Some((self.decide(state, now_ms, cost).0, state?.clone()))
            }
            (Policy::SlidingWindow { limit, window_ms }, s) => {
                let s = match s {
                    Some(State::SlidingWindow(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = sliding_window::charge(s, now_ms, limit, window_ms, cost);
                Some((v, State::SlidingWindow(n)))
            }
            (Policy::FixedWindow { limit, windows }, s) => {
                let s = match s {
                    Some(State::FixedWindow(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = fixed_window::charge(s, now_ms, limit, windows, cost);
                Some((v, State::FixedWindow(n)))
            }
            (Policy::Gcra(params), s) => {
                let s = match s {
                    Some(State::Gcra(s)) => Some(*s),
                    _ => None,
                };
                let (v, n) = gcra::charge(s, now_ms, &params, cost);
                Some((v, State::Gcra(n)))
            }
            (Policy::Lease { .. }, s) => {
                let s = match s {
                    Some(State::Lease(s)) => Some(*s),
                    _ => None,
                };
                let next = lease::charge(s, now_ms, cost);
                Some((
                    self.decide(Some(&State::Lease(next)), now_ms, 0).0,
                    State::Lease(next),
                ))
            }
            (Policy::SlidingLog { .. } | Policy::InFlight { .. }, _) => None,
        }
    }

    /// Gives back the in-flight slot taken at `taken_ms`; `None` if the key holds none (it was
    /// forgotten, or this is not an in-flight policy).
    pub fn give_back(&self, state: Option<&State>, taken_ms: u64, now_ms: u64) -> Option<State> {
        match state {
            Some(State::InFlight(s)) if matches!(self, Policy::InFlight { .. }) => {
                Some(State::InFlight(in_flight::give_back(*s, taken_ms, now_ms)))
            }
            _ => None,
        }
    }

    /// Takes back `cost` counted at `counted_ms` (the unused part of a reservation) from the
    /// key's state: what still counts of it, in the windows or the bucket, is given back.
    /// `None` if there is nothing to change (the key was forgotten, or the policy counts no
    /// reservations). A lease gets it back unless it lapsed before `now_ms`.
    pub fn refund_at(
        &self,
        state: Option<&State>,
        counted_ms: u64,
        now_ms: u64,
        cost: u64,
    ) -> Option<State> {
        match (self, state?) {
            (Policy::Lease { .. }, State::Lease(s)) => {
                lease::refund(Some(*s), now_ms, cost).map(State::Lease)
            }
            (Policy::SlidingWindow { .. }, State::SlidingWindow(s)) => {
                let counted = sliding_window::State {
                    last_ms: counted_ms,
                    ..*s
                };
                Some(State::SlidingWindow(sliding_window::refund(
                    *s, &counted, cost,
                )))
            }
            (Policy::FixedWindow { .. }, State::FixedWindow(s)) => {
                let counted = fixed_window::State {
                    last_ms: counted_ms,
                    ..*s
                };
                Some(State::FixedWindow(fixed_window::refund(*s, &counted, cost)))
            }
            (Policy::Gcra(_), State::Gcra(s)) => Some(State::Gcra(gcra::refund(*s, cost))),
            _ => None,
        }
    }

    /// Takes back `cost` that a [`Policy::decide`] counted by storing `counted`, from the key's
    /// `current` state.
    pub fn refund(&self, current: State, counted: &State, cost: u64) -> State {
        match (current, counted) {
            (State::SlidingWindow(s), State::SlidingWindow(c)) => {
                State::SlidingWindow(sliding_window::refund(s, c, cost))
            }
            (State::FixedWindow(s), State::FixedWindow(c)) => {
                State::FixedWindow(fixed_window::refund(s, c, cost))
            }
            (State::Gcra(s), State::Gcra(_)) => State::Gcra(gcra::refund(s, cost)),
            (State::SlidingLog(s), State::SlidingLog(c)) => {
                let at = c.times.last().copied().unwrap_or(0);
                State::SlidingLog(sliding_log::refund(s, at, cost))
            }
            (State::InFlight(s), State::InFlight(c)) => {
                State::InFlight(in_flight::give_back(s, c.gen_ms, s.gen_ms))
            }
            (State::Lease(s), State::Lease(_)) => State::Lease(s.give_back(cost)),
            (other, _) => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_elastic_limit_in_force_is_rounded_down_and_at_least_one() {
        assert_eq!(scale(3, 1500), 4, "4.5");
        assert_eq!(scale(100, 1999), 199, "199.9");
        assert_eq!(scale(5, 10), 1, "0.05, at least 1");
        let gcra = |limit, burst| {
            Policy::Gcra(gcra::Params {
                limit,
                window_ms: 1000,
                burst,
                max_delay_ms: None,
            })
        };
        assert_eq!(gcra(3, 7).scaled(1500), gcra(4, 10), "the burst too");
        let in_flight = |max| Policy::InFlight {
            max,
            lease_ms: 1000,
        };
        assert_eq!(in_flight(3).scaled(500), in_flight(1), "1.5");
    }
}
