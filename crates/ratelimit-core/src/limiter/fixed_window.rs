//! The fixed window counter: one count per window, laid out by [`Windows`]: of one length
//! aligned to the clock (seconds to days; weeks from Monday), or calendar months.
//!
//! Cheapest to reason about and what envoyproxy/ratelimit does, but a client can send the whole
//! limit at the end of one window and again at the start of the next: up to 2× the limit within
//! one window's length across a boundary. The sliding window counter exists to fix that.
//!
//! A window's identity is its start: a key's count belongs to the window holding the time it
//! was last counted at, and is the current window's if that time is at or after the current
//! window's start. The state records its window's bounds, so that the table can tell when an
//! entry stops counting without knowing its rule.

use super::calendar::Windows;
use super::codec::{Reader, Writer};
use super::Verdict;

/// The stored state of one key: 20 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The latest (clamped) time counted, ms since the epoch; its window holds `count`.
    pub last_ms: u64,
    /// The length of the window holding `last_ms`, ms.
    pub window_ms: u32,
    /// Requests counted in the window holding `last_ms`.
    pub count: u32,
    /// How long after `last_ms` that window ends, ms. 0 in a state stored before windows could
    /// be calendar ones (it reads as 16 bytes padded with zeros): that window ends at the next
    /// multiple of `window_ms`.
    pub to_end_ms: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 20;

impl State {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        Writer::new()
            .u64(self.last_ms)
            .u32(self.window_ms)
            .u32(self.count)
            .u32(self.to_end_ms)
            .finish()
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let s = State {
            last_ms: r.u64()?,
            window_ms: r.u32()?,
            count: r.u32()?,
            to_end_ms: r.u32()?,
        };
        r.end().map(|()| s)
    }

    /// The bounds of the window holding `last_ms`: start (inclusive), end (exclusive).
    pub fn window(&self) -> (u64, u64) {
        let w = u64::from(self.window_ms.max(1));
        let end = match self.to_end_ms {
            0 => (self.last_ms / w + 1).saturating_mul(w),
            n => self.last_ms.saturating_add(u64::from(n)),
        };
        (end.saturating_sub(w), end)
    }

    /// Requests this entry still remembers at `now_ms` (`None`: it no longer matters).
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        (now_ms.max(self.last_ms) < self.window().1 && self.count > 0)
            .then_some(u64::from(self.count))
    }
}

/// Decides one request of `cost` at `now_ms` for a limit of `limit` per window of `windows`.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    windows: Windows,
    cost: u64,
) -> (Verdict, Option<State>) {
    let (now, bounds, count) = at(state, now_ms, windows);
    let allowed = count.saturating_add(cost) <= limit;
    let used = if allowed { count + cost } else { count };
    let verdict = verdict(allowed, now, bounds, limit, used, cost);
    (verdict, allowed.then(|| stored(now, bounds, used)))
}

/// Counts `cost` whatever the limit says (a usage known only once the response is done): the
/// key may end over its limit, and stays refused until the window ends.
pub fn charge(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    windows: Windows,
    cost: u64,
) -> (Verdict, State) {
    let (now, bounds, count) = at(state, now_ms, windows);
    let used = count.saturating_add(cost).min(u64::from(u32::MAX));
    (
        verdict(true, now, bounds, limit, used, cost),
        stored(now, bounds, used),
    )
}

/// The clamped time, the bounds of the window holding it, and that window's count.
fn at(state: Option<State>, now_ms: u64, windows: Windows) -> (u64, (u64, u64), u64) {
    let s = state.unwrap_or_default();
    let now = now_ms.max(s.last_ms);
    let bounds = windows.bounds(now);
    let count = if s.last_ms >= bounds.0 {
        u64::from(s.count)
    } else {
        0
    };
    (now, bounds, count)
}

/// The state of `used` counted at `now` in the window `(start, end)` (also a forgotten key's
/// when it comes back, [`super::trace`]).
pub fn counted(now: u64, bounds: (u64, u64), used: u64) -> State {
    stored(now, bounds, used)
}

/// The state of `used` counted at `now` in the window `(start, end)`.
fn stored(now: u64, (start, end): (u64, u64), used: u64) -> State {
    State {
        last_ms: now,
        window_ms: u32::try_from(end.saturating_sub(start)).unwrap_or(u32::MAX),
        count: u32::try_from(used).unwrap_or(u32::MAX),
        to_end_ms: u32::try_from(end.saturating_sub(now)).unwrap_or(u32::MAX),
    }
}

/// The verdict with `used` counted in the window `(start, end)` holding `now`.
fn verdict(
    allowed: bool,
    now: u64,
    (start, end): (u64, u64),
    limit: u64,
    used: u64,
    cost: u64,
) -> Verdict {
    let to_next = end.saturating_sub(now);
    Verdict {
        allowed,
        limit,
        window_s: end.saturating_sub(start) / 1000,
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

/// Takes back `cost` counted by a [`decide`] that stored `counted`, if the key's window is
/// still the one it was counted in.
pub fn refund(state: State, counted: &State, cost: u64) -> State {
    let (start, end) = state.window();
    let mut s = state;
    if (start..end).contains(&counted.last_ms) {
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
            let (v, s) = decide(state, t, limit, Windows::every(w), 1);
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

    use super::super::calendar::{days_from_civil, DAY_MS};

    /// ms since the epoch of `y-m-d` at `s` seconds past midnight UTC.
    fn day(y: i64, m: u32, d: u32, s: u64) -> u64 {
        days_from_civil(y, m, d) as u64 * DAY_MS + s * 1000
    }

    const MONTHS: Windows = Windows::Months { offset_min: 0 };

    #[test]
    fn a_monthly_budget_refuses_until_the_1st_and_then_starts_afresh() {
        // 2028 is a leap year: February has 29 days.
        let (v, s) = decide(None, day(2028, 2, 1, 0), 2, MONTHS, 2);
        assert_eq!(
            (v.allowed, v.window_s),
            (true, 29 * 86_400),
            "w is this month's length"
        );
        assert_eq!(v.reset_ms, 29 * DAY_MS, "from its first millisecond");
        // The last second of the leap day: refused for exactly the time to March 1st.
        let last = day(2028, 2, 29, 86_399) + 500;
        let (v, _) = decide(s, last, 2, MONTHS, 1);
        assert!(!v.allowed);
        assert_eq!((v.retry_after_ms, v.reset_ms, v.remaining), (500, 500, 0));
        assert_eq!(v.retry_after_ms.div_ceil(1000), 1, "told as 1 s");
        // Four days before the end of a 31-day month, in whole seconds.
        let (v, s) = decide(None, day(2027, 1, 27, 0), 1, MONTHS, 1);
        let (v2, _) = decide(s, day(2027, 1, 27, 3_600), 1, MONTHS, 1);
        assert_eq!(
            (v.window_s, v2.retry_after_ms),
            (31 * 86_400, (5 * 86_400 - 3_600) * 1000)
        );
        // At the 1st's first millisecond the count is the new month's.
        let (v, next) = decide(s, day(2027, 2, 1, 0), 1, MONTHS, 1);
        assert_eq!((v.allowed, v.window_s), (true, 28 * 86_400));
        let next = next.unwrap();
        assert_eq!(next.window(), (day(2027, 2, 1, 0), day(2027, 3, 1, 0)));
        // The table sees the entry stop counting at the month's end, without the rule.
        assert_eq!(next.weight(day(2027, 2, 28, 86_399)), Some(1));
        assert_eq!(next.weight(day(2027, 3, 1, 0)), None);
        // A reservation counted in January is not taken back from February's count.
        let january = s.unwrap();
        assert_eq!(refund(next, &january, 1).count, 1);
        assert_eq!(refund(next, &next, 1).count, 0);
        assert_eq!(State::decode(&next.encode()), Some(next));
    }

    #[test]
    fn dec_31_to_jan_1_and_a_utc_offset() {
        let (_, s) = decide(None, day(2026, 12, 31, 86_399), 1, MONTHS, 1);
        let (v, _) = decide(s, day(2026, 12, 31, 86_399) + 999, 1, MONTHS, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 1));
        assert!(decide(s, day(2027, 1, 1, 0), 1, MONTHS, 1).0.allowed);
        // At +02:00 the new month began two hours earlier, at 22:00 UTC on Dec 31st.
        let east = Windows::Months { offset_min: 120 };
        let (_, s) = decide(None, day(2026, 12, 31, 79_199), 1, east, 1);
        let (v, _) = decide(s, day(2026, 12, 31, 79_199), 1, east, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 1_000));
        assert!(decide(s, day(2026, 12, 31, 79_200), 1, east, 1).0.allowed);
    }

    #[test]
    fn a_state_stored_before_calendar_windows_reads_as_its_epoch_window() {
        // The 16 bytes of the old format, padded with zeros as the table pads every state.
        let mut old = [0u8; STATE_LEN];
        old[..8].copy_from_slice(&61_500u64.to_le_bytes());
        old[8..12].copy_from_slice(&60_000u32.to_le_bytes());
        old[12..16].copy_from_slice(&4u32.to_le_bytes());
        let s = State::decode(&old).unwrap();
        assert_eq!(s.window(), (60_000, 120_000));
        assert_eq!(s.weight(119_999), Some(4));
        assert_eq!(s.weight(120_000), None);
        let (v, _) = decide(Some(s), 70_000, 5, Windows::every(60_000), 1);
        assert_eq!((v.allowed, v.remaining), (true, 0));
    }
}
