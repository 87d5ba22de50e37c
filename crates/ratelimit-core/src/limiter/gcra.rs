//! The token bucket and the leaky bucket, as one generic cell rate algorithm (GCRA).
//!
//! A bucket of `burst` tokens refilled at `limit` tokens per `window` is the same admission rule
//! as a leaky-bucket meter of capacity `burst` draining at that rate: both keep one number, the
//! theoretical arrival time `tat` of the next unit of work. A request of cost `c` at `now` fits
//! when `max(tat, now) + c·T − now ≤ burst·T`, with `T = window / limit` the emission interval;
//! it then moves `tat` to `max(tat, now) + c·T`. Refill is lazy: no timers.
//!
//! Time is exact: `T` is rarely a whole number of milliseconds (60 000 ms / 7), so the
//! arithmetic runs in units of `1/limit` ms, where `T` is exactly `window` units, and `tat` is
//! stored as whole milliseconds plus a remainder in those units.
//!
//! The leaky bucket can also *delay* instead of reject (nginx `limit_req` without `nodelay`): an
//! admitted request is held until `max(tat, now)`, its turn, so requests leave at a constant
//! rate; one whose wait would exceed `max_delay_ms` (or overflow the bucket) is refused.

use super::codec::{Reader, Writer};
use super::Verdict;

/// The parameters of one rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Tokens refilled (units drained) per window.
    pub limit: u64,
    /// The window, ms.
    pub window_ms: u64,
    /// The bucket size, in requests.
    pub burst: u64,
    /// `Some(max)`: hold admitted requests until their turn, at most `max` ms.
    pub max_delay_ms: Option<u64>,
}

/// The stored state of one key: 20 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// Whole milliseconds of the theoretical arrival time.
    pub tat_ms: u64,
    /// Its remainder, in units of `1 / limit` ms.
    pub tat_frac: u32,
    /// The limit the remainder is expressed in.
    pub limit: u32,
    /// The window, ms (to weigh the entry for eviction).
    pub window_ms: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 20;

impl State {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        Writer::new()
            .u64(self.tat_ms)
            .u32(self.tat_frac)
            .u32(self.limit)
            .u32(self.window_ms)
            .finish()
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let s = State {
            tat_ms: r.u64()?,
            tat_frac: r.u32()?,
            limit: r.u32()?,
            window_ms: r.u32()?,
        };
        r.end().map(|()| s)
    }

    /// `tat` in units of `1 / limit` ms (rounded up if the state used another limit).
    fn scaled(&self, limit: u128) -> u128 {
        let frac = if u128::from(self.limit) == limit {
            u128::from(self.tat_frac)
        } else {
            (u128::from(self.tat_frac) * limit).div_ceil(u128::from(self.limit.max(1)))
        };
        u128::from(self.tat_ms) * limit + frac
    }

    fn from_scaled(tat: u128, limit: u128, window_ms: u64) -> State {
        let l = limit.max(1);
        State {
            tat_ms: u64::try_from(tat / l).unwrap_or(u64::MAX),
            tat_frac: u32::try_from(tat % l).unwrap_or(0),
            limit: u32::try_from(l).unwrap_or(u32::MAX),
            window_ms: u32::try_from(window_ms).unwrap_or(u32::MAX),
        }
    }

    /// Requests' worth of debt this entry still holds at `now_ms` (`None`: none, it is full).
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let l = u128::from(self.limit.max(1));
        let debt = self.scaled(l).saturating_sub(u128::from(now_ms) * l);
        let units = debt.div_ceil(u128::from(self.window_ms.max(1)));
        (units > 0).then(|| u64::try_from(units).unwrap_or(u64::MAX))
    }
}

/// Milliseconds for `scaled` units of `1 / l` ms, rounded up.
fn to_ms(scaled: u128, l: u128) -> u64 {
    u64::try_from(scaled.div_ceil(l)).unwrap_or(u64::MAX)
}

/// Whole requests left with `debt` in a bucket of `cap` (units of `1/l` ms, `w` per request),
/// and the units until one more request's worth is back (the debt falls to
/// `cap − (remaining + 1)·w`).
fn left(debt: u128, cap: u128, w: u128) -> (u128, u128) {
    let remaining = cap.saturating_sub(debt) / w;
    (
        remaining,
        debt.saturating_sub(cap.saturating_sub((remaining + 1) * w)),
    )
}

/// Decides one request of `cost` at `now_ms`.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    p: &Params,
    cost: u64,
) -> (Verdict, Option<State>) {
    let l = u128::from(p.limit.max(1));
    let w = u128::from(p.window_ms.max(1)); // T, in units of 1/l ms
    let cap = u128::from(p.burst) * w;
    let now = u128::from(now_ms) * l;
    let tat = state.map_or(0, |s| s.scaled(l));
    let start = tat.max(now);
    let new_tat = start + u128::from(cost) * w;
    let delay = start - now;
    let max_delay = p.max_delay_ms.map(|ms| u128::from(ms) * l);
    let fits = new_tat - now <= cap;
    let allowed = fits && max_delay.is_none_or(|m| delay <= m);
    let after = if allowed { new_tat } else { start };
    let debt = after - now;
    let (remaining, reset) = left(debt, cap, w);
    let retry = if allowed {
        0
    } else if u128::from(cost) > u128::from(p.burst) {
        u128::MAX
    } else {
        // Wait until the request fits the bucket, and (delay mode) its turn is near enough.
        let for_bucket = new_tat.saturating_sub(cap).saturating_sub(now);
        let for_turn = max_delay.map_or(0, |m| tat.saturating_sub(m).saturating_sub(now));
        for_bucket.max(for_turn)
    };
    let verdict = Verdict {
        allowed,
        limit: p.limit,
        window_s: p.window_ms / 1000,
        remaining: u64::try_from(remaining).unwrap_or(u64::MAX),
        reset_ms: if debt == 0 { 0 } else { to_ms(reset, l) },
        retry_after_ms: if retry == u128::MAX {
            u64::MAX
        } else {
            to_ms(retry, l)
        },
        delay_ms: if allowed && max_delay.is_some() {
            to_ms(delay, l)
        } else {
            0
        },
    };
    (
        verdict,
        allowed.then(|| State::from_scaled(new_tat, l, p.window_ms)),
    )
}

/// Counts `cost` whatever the bucket holds (a usage known only once the response is done): the
/// arrival time moves `cost·T` past now or its current value, so the key may go into debt
/// beyond its burst and stays refused until the debt drains below it.
pub fn charge(state: Option<State>, now_ms: u64, p: &Params, cost: u64) -> (Verdict, State) {
    let l = u128::from(p.limit.max(1));
    let w = u128::from(p.window_ms.max(1));
    let cap = u128::from(p.burst) * w;
    let now = u128::from(now_ms) * l;
    let tat = state.map_or(0, |s| s.scaled(l)).max(now) + u128::from(cost) * w;
    let debt = tat - now;
    let (remaining, reset) = left(debt, cap, w);
    let verdict = Verdict {
        allowed: true,
        limit: p.limit,
        window_s: p.window_ms / 1000,
        remaining: u64::try_from(remaining).unwrap_or(u64::MAX),
        reset_ms: to_ms(reset, l),
        retry_after_ms: 0,
        delay_ms: 0,
    };
    (verdict, State::from_scaled(tat, l, p.window_ms))
}

/// The state of a key that owes `weight` requests at `now_ms`, or until `until_ms` if that is
/// sooner (a forgotten key's when it comes back, [`super::trace`]): its arrival time is the
/// earlier of `now + weight·T` and `until_ms`.
pub fn owing(now_ms: u64, p: &Params, weight: u64, until_ms: u64) -> State {
    let l = u128::from(p.limit.max(1));
    let w = u128::from(p.window_ms.max(1));
    let by_weight = u128::from(now_ms) * l + u128::from(weight) * w;
    let tat = by_weight.min(u128::from(until_ms) * l);
    State::from_scaled(tat, l, p.window_ms)
}

/// Takes back `cost` counted by a [`decide`] (the arrival time moves back by `cost·T`).
pub fn refund(state: State, cost: u64) -> State {
    let l = u128::from(state.limit.max(1));
    let back = u128::from(cost) * u128::from(state.window_ms.max(1));
    State::from_scaled(
        state.scaled(l).saturating_sub(back),
        l,
        u64::from(state.window_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(limit: u64, window_ms: u64, burst: u64) -> Params {
        Params {
            limit,
            window_ms,
            burst,
            max_delay_ms: None,
        }
    }

    fn run(p: &Params, times: &[u64]) -> Vec<Verdict> {
        let mut state = None;
        times
            .iter()
            .map(|&t| {
                let (v, s) = decide(state, t, p, 1);
                state = s.or(state);
                v
            })
            .collect()
    }

    #[test]
    fn burst_then_refill() {
        // 2 per second, bucket of 5: a burst of 5, then one every 500 ms.
        let p = bucket(2, 1_000, 5);
        let v = run(&p, &[0, 0, 0, 0, 0, 0, 499, 500, 999, 1_000]);
        let allowed: Vec<bool> = v.iter().map(|v| v.allowed).collect();
        assert_eq!(
            allowed,
            [true, true, true, true, true, false, false, true, false, true]
        );
        assert_eq!(v[0].remaining, 4);
        assert_eq!(v[4].remaining, 0);
        assert_eq!(v[5].retry_after_ms, 500);
        assert_eq!(v[6].retry_after_ms, 1);
        assert_eq!(v[4].reset_ms, 500);
    }

    #[test]
    fn exact_with_fractional_intervals() {
        // 3 per second, bucket of 3: T = 333.33… ms. With T rounded to whole milliseconds
        // (334) the request at exactly 1000 ms would be refused; it must not be.
        let p = bucket(3, 1_000, 3);
        let v = run(&p, &[0, 0, 0, 0, 333, 334, 667, 1_000]);
        let allowed: Vec<bool> = v.iter().map(|v| v.allowed).collect();
        assert_eq!(allowed, [true, true, true, false, false, true, true, true]);
        assert_eq!(v[3].retry_after_ms, 334, "333.33 ms, rounded up");
        assert_eq!(v[4].retry_after_ms, 1);
    }

    #[test]
    fn delay_mode_spaces_requests_at_the_drain_rate() {
        // 10 per second (T = 100 ms), queue of 5, at most 350 ms of waiting.
        let p = Params {
            max_delay_ms: Some(350),
            ..bucket(10, 1_000, 5)
        };
        let v = run(&p, &[0, 0, 0, 0, 0, 0]);
        let delays: Vec<Option<u64>> = v.iter().map(|v| v.allowed.then_some(v.delay_ms)).collect();
        assert_eq!(
            delays,
            [Some(0), Some(100), Some(200), Some(300), None, None]
        );
        // The 5th would wait 400 ms > 350: it may retry once its turn is 350 ms away.
        assert_eq!(v[4].retry_after_ms, 50);
    }

    #[test]
    fn state_round_trips_weighs_and_refunds() {
        let p = bucket(7, 60_000, 7);
        let (_, s) = decide(None, 1_000, &p, 3);
        let s = s.unwrap();
        assert_eq!(State::decode(&s.encode()), Some(s));
        assert_eq!(s.weight(1_000), Some(3));
        assert_eq!(s.weight(1_000 + 60_000), None);
        assert_eq!(refund(s, 3).weight(1_000), None);
        // A changed limit reinterprets the stored time, rounding against the client.
        let (v, _) = decide(Some(s), 1_000, &bucket(14, 60_000, 14), 1);
        assert_eq!(v.remaining, 7);
        // Cost above the burst can never be admitted.
        let (v, _) = decide(None, 0, &p, 8);
        assert_eq!((v.allowed, v.retry_after_ms), (false, u64::MAX));
    }
}
