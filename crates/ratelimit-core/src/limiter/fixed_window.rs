//! The fixed window counter: one count per window of length `unit`, aligned to the epoch.
//!
//! Cheapest to reason about and what envoyproxy/ratelimit does, but a client can send the whole
//! limit at the end of one window and again at the start of the next: up to 2× the limit within
//! one window's length across a boundary. The sliding window counter exists to fix that.

use super::codec::{Reader, Writer};
use super::Verdict;

/// The stored state of one key: 16 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The latest (clamped) time counted, ms since the epoch; its window holds `count`.
    pub last_ms: u64,
    /// The window length the state was written with.
    pub window_ms: u32,
    /// Requests counted in the window holding `last_ms`.
    pub count: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 16;

impl State {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        Writer::new()
            .u64(self.last_ms)
            .u32(self.window_ms)
            .u32(self.count)
            .finish()
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let s = State {
            last_ms: r.u64()?,
            window_ms: r.u32()?,
            count: r.u32()?,
        };
        r.end().map(|()| s)
    }

    /// Requests this entry still remembers at `now_ms` (`None`: it no longer matters).
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let w = u64::from(self.window_ms.max(1));
        (now_ms.max(self.last_ms) / w == self.last_ms / w && self.count > 0)
            .then_some(u64::from(self.count))
    }
}

/// Decides one request of `cost` at `now_ms` for a limit of `limit` per `window_ms`.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    window_ms: u64,
    cost: u64,
) -> (Verdict, Option<State>) {
    let w = window_ms.max(1);
    let (now, count) = at(state, now_ms, w);
    let allowed = count.saturating_add(cost) <= limit;
    let used = if allowed { count + cost } else { count };
    let verdict = verdict(allowed, now, w, limit, used, cost);
    let next = allowed.then(|| State {
        last_ms: now,
        window_ms: u32::try_from(w).unwrap_or(u32::MAX),
        count: u32::try_from(used).unwrap_or(u32::MAX),
    });
    (verdict, next)
}

/// Counts `cost` whatever the limit says (a usage known only once the response is done): the
/// key may end over its limit, and stays refused until the window ends.
pub fn charge(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    window_ms: u64,
    cost: u64,
) -> (Verdict, State) {
    let w = window_ms.max(1);
    let (now, count) = at(state, now_ms, w);
    let used = count.saturating_add(cost).min(u64::from(u32::MAX));
    let state = State {
        last_ms: now,
        window_ms: u32::try_from(w).unwrap_or(u32::MAX),
        count: u32::try_from(used).unwrap_or(u32::MAX),
    };
    (verdict(true, now, w, limit, used, cost), state)
}

/// The clamped time and the count of the window holding it.
fn at(state: Option<State>, now_ms: u64, w: u64) -> (u64, u64) {
    let s = state.unwrap_or_default();
    let now = now_ms.max(s.last_ms);
    let count = if now / w == s.last_ms / w {
        u64::from(s.count)
    } else {
        0
    };
    (now, count)
}

/// The verdict with `used` counted in the window holding `now`.
fn verdict(allowed: bool, now: u64, w: u64, limit: u64, used: u64, cost: u64) -> Verdict {
    let to_next = w - now % w;
    Verdict {
        allowed,
        limit,
        window_s: w / 1000,
        remaining: limit.saturating_sub(used),
        reset_ms: if used == 0 { 0 } else { to_next },
        retry_after_ms: if allowed {
            0
        } else if cost > limit {
            u64::MAX
        } else {
            to_next
        },
        delay_ms: 0,
    }
}

/// Takes back `cost` counted by a [`decide`] that stored `counted`.
pub fn refund(state: State, counted: &State, cost: u64) -> State {
    let w = u64::from(counted.window_ms.max(1));
    let mut s = state;
    if s.last_ms / w == counted.last_ms / w {
        s.count = s
            .count
            .saturating_sub(u32::try_from(cost).unwrap_or(u32::MAX));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_aligned_window_and_shows_the_edge_burst() {
        let (limit, w) = (3, 1_000);
        let mut state = None;
        let mut admitted = Vec::new();
        // 4 requests at the end of window 0, 4 at the start of window 1.
        for t in [990, 991, 992, 993, 1_000, 1_001, 1_002, 1_003] {
            let (v, s) = decide(state, t, limit, w, 1);
            if let Some(s) = s {
                state = Some(s);
            }
            if v.allowed {
                admitted.push(t);
            } else {
                assert_eq!(v.retry_after_ms, 1_000 - t % 1_000);
            }
        }
        // 6 admitted within 13 ms: the documented weakness.
        assert_eq!(admitted, [990, 991, 992, 1_000, 1_001, 1_002]);
        let s = state.unwrap();
        assert_eq!(State::decode(&s.encode()), Some(s));
        assert_eq!(s.weight(1_500), Some(3));
        assert_eq!(s.weight(2_000), None);
        assert_eq!(refund(s, &s, 1).count, 2);
    }
}
