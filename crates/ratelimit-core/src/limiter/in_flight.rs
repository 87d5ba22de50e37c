//! Requests in flight: a slot is taken when a request is admitted and given back when its
//! stream ends, however it ends.
//!
//! A give-back can be lost (a wasm VM that crashes forgets its streams; a worker that is killed
//! never reports), and a lost one must not hold capacity forever. So every slot is a **lease**:
//! slots are counted per generation of `lease` milliseconds (aligned to the epoch), and a key
//! remembers two generations, the current one and the one before. A slot taken in generation
//! `g` counts until generation `g + 2` begins: a slot never given back is freed between `lease`
//! and `2 × lease` after it was taken. The price: a request still running two generations
//! after it began (at least `lease` after) no longer counts, so the lease must exceed the
//! longest request.

use super::codec::{Reader, Writer};
use super::Verdict;

/// What a refused request is told to wait: a slot frees when some request ends, which no
/// one can foresee, so this is a hint, not a promise.
pub const RETRY_HINT_MS: u64 = 1_000;

/// The stored state of one key: 20 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// The start of the generation `current` belongs to, ms since the epoch. The clock is
    /// clamped to it, so a wall clock that jumps backwards frees nothing.
    pub gen_ms: u64,
    /// The lease the state was written with, ms.
    pub lease_ms: u32,
    /// Slots taken in the current generation and not given back.
    pub current: u32,
    /// Slots taken in the generation before and not given back.
    pub previous: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 20;

impl State {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; STATE_LEN] {
        Writer::new()
            .u64(self.gen_ms)
            .u32(self.lease_ms)
            .u32(self.current)
            .u32(self.previous)
            .finish()
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let s = State {
            gen_ms: r.u64()?,
            lease_ms: r.u32()?,
            current: r.u32()?,
            previous: r.u32()?,
        };
        r.end().map(|()| s)
    }

    /// The state moved to the generation holding `now_ms` (clamped to the stored one), with
    /// `lease_ms` (a changed lease restarts the count from the slots still held).
    fn at(&self, now_ms: u64, lease_ms: u64) -> State {
        let lease = lease_ms.max(1);
        let now = now_ms.max(self.gen_ms);
        let this = now / lease;
        let then = self.gen_ms / u64::from(self.lease_ms.max(1));
        let (current, previous) = if u64::from(self.lease_ms) != lease {
            // Another lease: keep every slot in the current generation (conservative).
            (self.current.saturating_add(self.previous), 0)
        } else if this == then {
            (self.current, self.previous)
        } else if this == then.saturating_add(1) {
            (0, self.current)
        } else {
            (0, 0)
        };
        State {
            gen_ms: this * lease,
            lease_ms: u32::try_from(lease).unwrap_or(u32::MAX),
            current,
            previous,
        }
    }

    /// Slots this entry still holds at `now_ms` (`None`: none, it may be forgotten).
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let s = self.at(now_ms, u64::from(self.lease_ms));
        let n = u64::from(s.current) + u64::from(s.previous);
        (n > 0).then_some(n)
    }
}

/// Decides a request at `now_ms` for at most `max` in flight with slots leased for
/// `lease_ms`: admitted if a slot is free, which it then takes.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    max: u64,
    lease_ms: u64,
    cost: u64,
) -> (Verdict, Option<State>) {
    let s = state.unwrap_or_default().at(now_ms, lease_ms);
    let held = u64::from(s.current) + u64::from(s.previous);
    let allowed = held.saturating_add(cost) <= max;
    let used = if allowed { held + cost } else { held };
    let remaining = max.saturating_sub(used);
    let verdict = Verdict {
        allowed,
        limit: max,
        window_s: 0, // no window: the fields leave out `w` and `t`
        remaining,
        reset_ms: if remaining == 0 { RETRY_HINT_MS } else { 0 },
        retry_after_ms: if allowed { 0 } else { RETRY_HINT_MS },
        delay_ms: 0,
    };
    let next = allowed.then(|| State {
        current: s
            .current
            .saturating_add(u32::try_from(cost).unwrap_or(u32::MAX)),
        ..s
    });
    (verdict, next)
}

/// Gives back a slot taken at `taken_ms` (a time within the generation it was taken in). A
/// slot whose lease has run out is already free: nothing changes.
pub fn give_back(state: State, taken_ms: u64, now_ms: u64) -> State {
    let lease = u64::from(state.lease_ms.max(1));
    let mut s = state.at(now_ms, lease);
    let (taken, this) = (taken_ms / lease, s.gen_ms / lease);
    if taken == this {
        s.current = s.current.saturating_sub(1);
    } else if taken.saturating_add(1) == this {
        s.previous = s.previous.saturating_sub(1);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: u64 = 10_000;

    fn take(state: Option<State>, now: u64, max: u64) -> (Verdict, Option<State>) {
        decide(state, now, max, LEASE, 1)
    }

    #[test]
    fn holds_at_most_max_and_gives_back() {
        let t = 1_000_000;
        let (v1, s) = take(None, t, 2);
        let (v2, s) = take(s, t + 1, 2);
        let (v3, s3) = take(s, t + 2, 2);
        assert!(v1.allowed && v2.allowed && !v3.allowed);
        assert_eq!((v1.remaining, v2.remaining, v3.remaining), (1, 0, 0));
        assert_eq!(v3.retry_after_ms, RETRY_HINT_MS);
        assert_eq!(v1.window_s, 0);
        assert!(s3.is_none(), "a refused request takes nothing");
        let s = s.unwrap();
        // One request ends: its slot is free at once.
        let back = give_back(s, t, t + 5);
        assert_eq!(back.weight(t + 5), Some(1));
        assert!(take(Some(back), t + 6, 2).0.allowed);
        assert_eq!(State::decode(&s.encode()), Some(s));
    }

    #[test]
    fn a_lost_give_back_expires_between_one_and_two_leases() {
        for start in [1_000_000, 1_000_001, 1_009_999] {
            let (_, s) = take(None, start, 1);
            let s = s.unwrap();
            // Still held a full lease after being taken...
            assert!(!take(Some(s), start + LEASE - 1, 1).0.allowed, "{start}");
            // ...and free two leases after.
            assert!(take(Some(s), start + 2 * LEASE, 1).0.allowed, "{start}");
            // In between, free exactly from the start of generation g + 2.
            let free_at = (start / LEASE + 2) * LEASE;
            assert!(!take(Some(s), free_at - 1, 1).0.allowed);
            assert!(take(Some(s), free_at, 1).0.allowed);
            assert_eq!(s.weight(free_at), None);
        }
    }

    #[test]
    fn a_give_back_finds_its_generation() {
        let t = 1_000_000; // the start of a generation
        let (_, s) = take(None, t + 9_000, 3);
        let (_, s) = take(s, t + LEASE + 1, 3); // next generation
        let s = s.unwrap();
        assert_eq!((s.current, s.previous), (1, 1));
        // The first request ends (taken in the previous generation).
        let s1 = give_back(s, t + 9_000, t + LEASE + 2);
        assert_eq!((s1.current, s1.previous), (1, 0));
        // A give-back after the lease ran out changes nothing, and never goes below zero.
        let late = give_back(s1, t + 9_000, t + 3 * LEASE);
        assert_eq!(late.weight(t + 3 * LEASE), None);
        let twice = give_back(
            give_back(s1, t + LEASE + 1, t + LEASE + 3),
            t + LEASE + 1,
            t + LEASE + 4,
        );
        assert_eq!((twice.current, twice.previous), (0, 0));
    }

    #[test]
    fn clock_going_backwards_frees_nothing() {
        let t = 5_000_000;
        let (_, s) = take(None, t, 1);
        assert!(!take(s, t - 3_600_000, 1).0.allowed);
    }
}
