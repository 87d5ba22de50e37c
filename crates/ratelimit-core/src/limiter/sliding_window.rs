//! The sliding window counter.
//!
//! Per key, two fixed windows of length `W`, aligned to the epoch: the count of the current one
//! and of the previous one. At a request `elapsed` into the current window the usage estimate is
//! `previous × (W − elapsed) / W + current`; the request is allowed when the estimate plus its
//! cost stays within the limit, and only an allowed request is counted.
//!
//! All arithmetic is in integer milliseconds, scaled by `W` so nothing is rounded until the
//! remaining quota is reported (rounded down) and waits are reported (rounded up to the ms).
//! It fits `u64` (counts < 2^33, windows < 2^27 ms), which wasm runs natively, unlike `u128`;
//! saturating operations keep absurd inputs from wrapping.

use super::codec::{Reader, Writer};
use super::Verdict;

/// `saturating_mul` without a 128-bit multiplication (a library call in wasm32) when both
/// factors fit 32 bits, as they always do here but for absurd inputs.
trait SatMul {
    fn sat_mul(self, other: u64) -> u64;
}

impl SatMul for u64 {
    #[inline]
    fn sat_mul(self, other: u64) -> u64 {
        if (self | other) >> 32 == 0 {
            self * other
        } else {
            self.saturating_mul(other)
        }
    }
}

/// The stored state of one key: 20 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The latest (clamped) time this key was counted at, ms since the epoch. The clock is
    /// clamped to it, so a wall clock that jumps backwards never unlocks quota.
    pub last_ms: u64,
    /// The window length the state was written with (used to judge its age for eviction).
    pub window_ms: u32,
    /// Requests counted in the window holding `last_ms`.
    pub current: u32,
    /// Requests counted in the window before it.
    pub previous: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 20;

impl State {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        Writer::new()
            .u64(self.last_ms)
            .u32(self.window_ms)
            .u32(self.current)
            .u32(self.previous)
            .finish()
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let s = State {
            last_ms: r.u64()?,
            window_ms: r.u32()?,
            current: r.u32()?,
            previous: r.u32()?,
        };
        r.end().map(|()| s)
    }

    /// The counts as seen from `now_ms` in windows of `window_ms`: (current, previous, elapsed
    /// in the current window, clamped now).
    fn at(&self, now_ms: u64, window_ms: u64) -> Window {
        let w = window_ms.max(1);
        let now = now_ms.max(self.last_ms);
        let this = now / w;
        let last = self.last_ms / w;
        let (current, previous) = if this == last {
            (self.current, self.previous)
        } else if this == last.saturating_add(1) {
            (0, self.current)
        } else {
            (0, 0)
        };
        Window {
            w,
            now,
            elapsed: now % w,
            current: u64::from(current),
            previous: u64::from(previous),
        }
    }

    /// The usage estimate at `now_ms` in windows of `window_ms`, rounded up: the previous
    /// window's count weighted by the part of it still inside the sliding window, plus the
    /// current count.
    pub fn usage(&self, now_ms: u64, window_ms: u64) -> u64 {
        let win = self.at(now_ms, window_ms);
        win.scaled_usage().div_ceil(win.w)
    }

    /// [`State::usage`] × `one`, rounded down: the estimate in finer units.
    pub fn usage_in(&self, now_ms: u64, window_ms: u64, one: u64) -> u64 {
        let win = self.at(now_ms, window_ms);
        let scaled = u128::from(win.scaled_usage()) * u128::from(one) / u128::from(win.w);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    /// The counts as seen from `now_ms` in windows of `window_ms`: the window holding it so
    /// far, and the whole window before it (exact, where [`State::usage`] assumes that window's
    /// requests were spread evenly over it).
    pub fn counts(&self, now_ms: u64, window_ms: u64) -> (u64, u64) {
        let win = self.at(now_ms, window_ms);
        (win.current, win.previous)
    }

    /// How much this entry is still worth keeping at `now_ms`: `None` once it no longer affects
    /// any decision, else the requests it still remembers.
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let win = self.at(now_ms, u64::from(self.window_ms));
        let total = win.current + win.previous;
        (total > 0).then_some(total)
    }
}

/// A key's counts seen from one instant.
struct Window {
    w: u64,
    now: u64,
    elapsed: u64,
    current: u64,
    previous: u64,
}

impl Window {
    /// The usage estimate scaled by `w`.
    fn scaled_usage(&self) -> u64 {
        self.previous
            .sat_mul(self.w - self.elapsed)
            .saturating_add(self.current.sat_mul(self.w))
    }

    /// Whole requests left within `limit`, rounded down.
    fn remaining(&self, limit: u64) -> u64 {
        let cap = limit.sat_mul(self.w);
        cap.saturating_sub(self.scaled_usage()) / self.w
    }

    /// Milliseconds until a request of `cost` would be allowed if nothing else is counted;
    /// `None` if it never would (cost above the limit).
    fn wait_ms(&self, limit: u64, cost: u64) -> Option<u64> {
        let (w, e) = (self.w, self.elapsed);
        let (cur, prev) = (self.current, self.previous);
        if cost > limit {
            return None;
        }
        let wait = if cur.saturating_add(cost) <= limit {
            // Still in this window, once enough of `previous` has decayed: we need
            // prev × (w − e') ≤ (limit − cur − cost) × w.
            match limit
                .saturating_sub(cur)
                .saturating_sub(cost)
                .sat_mul(w)
                .checked_div(prev)
            {
                None => 0,
                Some(k) if k >= w - e => 0,
                Some(k) => w - k - e,
            }
        } else {
            // In the next window `current` becomes the decaying previous count.
            let to_next = w - e;
            match (limit - cost).sat_mul(w).checked_div(cur) {
                None => to_next,
                Some(k) if k >= w => to_next,
                Some(k) => to_next.saturating_add(w - k),
            }
        };
        Some(wait)
    }
}

/// Decides one request of `cost` for a key in `state` (`None`: never seen) at `now_ms`, for
/// `limit` requests per `window_ms`. Returns the verdict and, if allowed, the state to store.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    window_ms: u64,
    cost: u64,
) -> (Verdict, Option<State>) {
    let win = state.unwrap_or_default().at(now_ms, window_ms);
    let allowed = win.scaled_usage().saturating_add(cost.sat_mul(win.w)) <= limit.sat_mul(win.w);
    if !allowed {
        let remaining = win.remaining(limit);
        let verdict = Verdict {
            allowed: false,
            limit,
            window_s: win.w / 1000,
            remaining,
            reset_ms: win.wait_ms(limit, remaining + 1).unwrap_or(0),
            retry_after_ms: win.wait_ms(limit, cost).unwrap_or(u64::MAX),
            delay_ms: 0,
        };
        return (verdict, None);
    }
    let (verdict, counted) = count(win, limit, cost);
    (verdict, Some(counted))
}

/// Counts `cost` whatever the limit says (a usage known only once the response is done): the
/// key may end over its limit, and stays refused until its usage decays below it.
pub fn charge(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    window_ms: u64,
    cost: u64,
) -> (Verdict, State) {
    count(state.unwrap_or_default().at(now_ms, window_ms), limit, cost)
}

/// [`charge`] without the verdict: the state with `cost` counted at `now_ms` (a counter no
/// limit applies to).
pub fn add(state: State, now_ms: u64, window_ms: u64, cost: u64) -> State {
    let win = state.at(now_ms, window_ms);
    State {
        last_ms: win.now,
        window_ms: u32::try_from(win.w).unwrap_or(u32::MAX),
        current: u32::try_from(win.current.saturating_add(cost)).unwrap_or(u32::MAX),
        previous: u32::try_from(win.previous).unwrap_or(u32::MAX),
    }
}

/// Counts `cost` in `win`: the verdict and the state to store.
fn count(win: Window, limit: u64, cost: u64) -> (Verdict, State) {
    let after = Window {
        current: win.current.saturating_add(cost),
        ..win
    };
    let remaining = after.remaining(limit);
    let reset_ms = if remaining >= limit {
        0
    } else {
        after.wait_ms(limit, remaining + 1).unwrap_or(0)
    };
    let new_state = State {
        last_ms: after.now,
        window_ms: u32::try_from(after.w).unwrap_or(u32::MAX),
        current: u32::try_from(after.current).unwrap_or(u32::MAX),
        previous: u32::try_from(after.previous).unwrap_or(u32::MAX),
    };
    let verdict = Verdict {
        allowed: true,
        limit,
        window_s: after.w / 1000,
        remaining,
        reset_ms,
        retry_after_ms: 0,
        delay_ms: 0,
    };
    (verdict, new_state)
}

/// Takes back `cost` counted by a [`decide`] that stored `counted` (used when a later rule of
/// the same request refused it).
pub fn refund(state: State, counted: &State, cost: u64) -> State {
    let cost = u32::try_from(cost).unwrap_or(u32::MAX);
    let w = u64::from(counted.window_ms.max(1));
    let (then, now) = (counted.last_ms / w, state.last_ms / w);
    let mut s = state;
    if now == then {
        s.current = s.current.saturating_sub(cost);
    } else if now == then + 1 {
        s.previous = s.previous.saturating_sub(cost);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limit: requests per window (ms).
    struct Quota(u64, u64);

    const MIN: Quota = Quota(10, 60_000);

    fn decide(state: Option<State>, now_ms: u64, q: &Quota, cost: u64) -> (Verdict, Option<State>) {
        super::decide(state, now_ms, q.0, q.1, cost)
    }

    /// Runs requests at the given times; returns the verdicts and the final state.
    fn run(
        quota: &Quota,
        times: &[u64],
        mut state: Option<State>,
    ) -> (Vec<Verdict>, Option<State>) {
        let mut out = Vec::new();
        for &t in times {
            let (v, s) = decide(state, t, quota, 1);
            if let Some(s) = s {
                state = Some(s);
            }
            out.push(v);
        }
        (out, state)
    }

    #[test]
    fn admits_exactly_the_limit_within_a_window() {
        let t0 = 600_000; // a window boundary
        let times: Vec<u64> = (0..15).map(|i| t0 + i * 100).collect();
        let (v, s) = run(&MIN, &times, None);
        let allowed = v.iter().filter(|v| v.allowed).count();
        assert_eq!(allowed, 10);
        assert!(v[..10].iter().all(|v| v.allowed));
        assert_eq!(v[0].remaining, 9);
        assert_eq!(v[9].remaining, 0);
        // The 11th at t0+1000 waits for the next window (59 s away), where the 10 counted
        // requests still weigh fully, and then until they decay to 9: 6 s more.
        assert_eq!(v[10].retry_after_ms, 65_000);
        assert_eq!(v[10].reset_ms, 65_000);
        assert_eq!(s.unwrap().current, 10, "rejected requests consume nothing");
    }

    #[test]
    fn previous_window_is_weighted_by_what_is_left_of_it() {
        // 10 requests late in window 0; then at 25% into window 1 the estimate is
        // 10 × 0.75 = 7.5, so 2 more fit (7.5 + 2 = 9.5) and the third does not.
        let (_, s) = run(&MIN, &[59_000; 10], None);
        let t = 60_000 + 15_000;
        let (v, s2) = run(&MIN, &[t, t, t], s);
        assert_eq!(
            v.iter().map(|v| v.allowed).collect::<Vec<_>>(),
            [true, true, false]
        );
        // Remaining after the 1st: 10 − 8.5 = 1.5 → 1; after the 2nd: 0.5 → 0.
        assert_eq!((v[0].remaining, v[1].remaining), (1, 0));
        // The third needs 10·(60−e)/60 + 2 + 1 ≤ 10 → e ≥ 18 s: 3 s from now.
        assert_eq!(v[2].retry_after_ms, 3_000);
        let s2 = s2.unwrap();
        assert_eq!((s2.current, s2.previous), (2, 10));
    }

    #[test]
    fn window_boundary_and_expiry() {
        let (_, s) = run(&MIN, &[59_999; 10], None);
        // 1 ms later the previous window still weighs fully: 10 × (59999/60000) > 9.
        let (v, _) = run(&MIN, &[60_000], s);
        assert!(!v[0].allowed);
        assert_eq!(v[0].retry_after_ms, 6_000);
        // Two windows later everything is forgotten.
        let (v, s3) = run(&MIN, &[120_000], s);
        assert!(v[0].allowed);
        assert_eq!(s3.unwrap().previous, 0);
        assert_eq!(v[0].remaining, 9);
    }

    #[test]
    fn retry_after_is_exact() {
        // Whatever the state, a request at now + retry_after is allowed and one ms earlier is not.
        let mut seed = 12345u64;
        let mut rnd = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let quota = Quota(7, 1_000);
        let mut checked = 0;
        for _ in 0..3000 {
            let mut state = None;
            let mut t = 1_000_000 + rnd(1000);
            for _ in 0..rnd(20) {
                t += rnd(300);
                if rnd(6) == 0 {
                    // A usage charged after the response: may push the key over its limit.
                    state = Some(charge(state, t, quota.0, quota.1, rnd(20)).1);
                } else if let (_, Some(s)) = decide(state, t, &quota, 1) {
                    state = Some(s);
                }
            }
            let (v, _) = decide(state, t, &quota, 1);
            if v.allowed {
                continue;
            }
            checked += 1;
            let r = v.retry_after_ms;
            assert!(
                decide(state, t + r, &quota, 1).0.allowed,
                "{state:?} t={t} r={r}"
            );
            assert!(
                !decide(state, t + r - 1, &quota, 1).0.allowed,
                "{state:?} t={t} r={r}"
            );
            assert_eq!(v.reset_ms, r, "t is the time until more quota when r=0");
        }
        assert!(checked > 100);
    }

    #[test]
    fn clock_going_backwards_unlocks_nothing() {
        let t = 7_230_000;
        let (_, s) = run(&MIN, &[t; 10], None);
        // The clock jumps back an hour: the key still sees its last time, so still limited.
        let (v, s2) = run(&MIN, &[t - 3_600_000], s);
        assert!(!v[0].allowed);
        assert_eq!(s2, s);
    }

    #[test]
    fn refund_undoes_a_count() {
        let (_, s) = run(&MIN, &[1_000; 3], None);
        let s = s.unwrap();
        let (_, counted) = decide(Some(s), 2_000, &MIN, 1);
        let counted = counted.unwrap();
        assert_eq!(refund(counted, &counted, 1).current, 3);
        // The window rolled before the refund: the count is in `previous` now.
        let (_, later) = decide(Some(counted), 61_000, &MIN, 1);
        let later = later.unwrap();
        let back = refund(later, &counted, 1);
        assert_eq!((back.current, back.previous), (1, 3));
        assert_eq!(State::decode(&s.encode()), Some(s));
        assert_eq!(State::decode(&[0; 3]), None);
    }

    #[test]
    fn weight_ages_out() {
        let (_, s) = run(&MIN, &[1_000; 4], None);
        let s = s.unwrap();
        assert_eq!(s.weight(2_000), Some(4));
        assert_eq!(s.weight(61_000), Some(4));
        assert_eq!(s.weight(120_000), None);
        assert_eq!(State::default().weight(0), None);
    }
}
