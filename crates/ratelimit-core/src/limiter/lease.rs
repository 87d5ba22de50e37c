//! Quota leased from a rate limit service (`global.mode: "lease"`): what one proxy holds of a
//! key's fleet-wide limit, shared by every worker of the proxy.
//!
//! The proxy claims quota from the service in blocks (a `ShouldRateLimit` whose `hits_addend`
//! is the block); a block the service grants is added to what the key holds here, and requests
//! are admitted from it locally, at local speed. Every admission is covered by a grant, so the
//! fleet never admits more than the service's limit; quota held and unused when the service's
//! window turns lapses (under-admission, bounded by the blocks held).
//!
//! A grant lasts until the service's reset (`duration_until_reset`) counted from when the claim
//! was sent, never later than the service's own window end. Blocks follow the key's rate here:
//! a block is a power of two of requests (of what the request at hand costs: one, or its
//! tokens), doubled when the last claim was made within [`FAST_MS`] and halved when it was made
//! more than [`SLOW_MS`] before, and never above the rule's cap.
//!
//! A service that checks a counter and then counts in a second step (the limitador engine over
//! Redis) lets claims in flight together all pass its check and be counted past its limit: C
//! claims at once overshoot it by at most (C − 1) blocks in a window. Near the limit a block is
//! at most [`NEAR_SHARE`]⁻¹ of what the service last said remained (blocks shrink as the quota
//! runs out), which keeps the blocks that race small; over a service that checks and counts in
//! one step, the fleet never admits more than the limit.

use super::codec::Reader;
use super::{calendar::Windows, Verdict};

/// A block that ran low sooner than this after its claim doubles the next one, ms.
pub const FAST_MS: u64 = 1_000;
/// A block that lasted longer than this before running low halves the next one, ms.
pub const SLOW_MS: u64 = 8_000;
/// How long a refused request is told to wait when this proxy holds too little and the service
/// has not refused the key (a claim is due), ms.
pub const SHORT_WAIT_MS: u64 = 1_000;
/// A claim ahead of need still unanswered after this long is given up (its proxy or VM may be
/// gone): another may start, ms.
pub const STALE_CLAIM_MS: u64 = 10_000;
/// How long after the end of the service's window a proxy last heard of a refusal may still be
/// that window's (the end is estimated from when the claim was sent: early by the claim's round
/// trip) and is not held against the key, ms.
pub const TURN_MS: u64 = 100;
/// Near the limit a block is at most this fraction (1/4) of what the service last said
/// remained: concurrent claims of several proxies then overshoot a service that checks, then
/// counts, by little.
pub const NEAR_SHARE: u64 = 4;
/// A key's first block is 2^this (4) requests' worth, capped: a key seldom used claims a few
/// requests at once, not one per request.
pub const FIRST_SHIFT: u8 = 2;
/// The largest block exponent (2⁴⁰).
const MAX_SHIFT: u8 = 40;
/// The bound of what a key holds, either way (stored in 5 bytes).
const HELD_BOUND: i64 = (1 << 39) - 1;
/// The claim time's bits as stored (the 48th is [`State::asking`]).
const CLAIM_MS_MASK: u64 = (1 << 47) - 1;
/// A request's claim unanswered this long no longer counts as in flight: the requests after it
/// claim blocks again (its answer, or its error, comes within the rule's `timeout_ms`, 20 ms
/// by default; a rule may allow up to a minute).
pub const ASKING_STALE_MS: u64 = 1_000;

/// What one proxy holds of a key's quota: 22 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct State {
    /// Quota held and not used; below 0, usage charged beyond the grants (paid from the next).
    pub held: i64,
    /// When what is held lapses (the service's window ends no earlier), ms since the epoch.
    pub expires_ms: u64,
    /// When the last claim was sent, ms since the epoch (0: never).
    pub claim_ms: u64,
    /// A claim ahead of need is in flight (started at `claim_ms`).
    pub claiming: bool,
    /// A request's claim is in flight (started at `claim_ms`): a request that must claim
    /// meanwhile claims only its own cost.
    pub asking: bool,
    /// The service has no quota left until `expires_ms`: no claim before then.
    pub refused: bool,
    /// The next block is `2^shift`, capped.
    pub shift: u8,
    /// What the service said remained after its last answer.
    pub remaining: u32,
}

/// The encoded length of [`State`].
pub const STATE_LEN: usize = 22;

/// What a key's lease makes of a request, before anything is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peek {
    /// What is held covers the request; `low`: it runs low, a claim ahead of need is due.
    Covered {
        /// The held quota falls under half a block with this request.
        low: bool,
    },
    /// The service has no quota left for the key until the lease's end.
    Refused,
    /// Too little is held: the request must claim.
    Claim,
}

fn put_le(out: &mut [u8], at: &mut usize, v: u64, n: usize) {
    if let Some(dst) = out.get_mut(*at..*at + n) {
        for (i, b) in dst.iter_mut().enumerate() {
            *b = (v >> (8 * i)) as u8;
        }
    }
    *at += n;
}

fn get_le(r: &mut Reader<'_>, n: usize) -> Option<u64> {
    let (bytes, rest) = (r.0.get(..n)?, r.0.get(n..)?);
    r.0 = rest;
    Some(
        bytes
            .iter()
            .enumerate()
            .fold(0, |v, (i, &b)| v | u64::from(b) << (8 * i)),
    )
}

impl State {
    /// Fixed-width little-endian encoding: held (5 bytes, two's complement), expiry and claim
    /// times (6 bytes each), flags and shift (1), the service's remaining (4).
    pub fn encode(&self) -> [u8; STATE_LEN] {
        let mut out = [0u8; STATE_LEN];
        let mut at = 0;
        let held = self.held.clamp(-HELD_BOUND, HELD_BOUND);
        put_le(&mut out, &mut at, held as u64 & 0xff_ffff_ffff, 5);
        put_le(&mut out, &mut at, self.expires_ms, 6);
        // The claim time's top bit (ms past 2^47, the year 6429) is the request's claim in
        // flight.
        let claim = self.claim_ms & CLAIM_MS_MASK | u64::from(self.asking) << 47;
        put_le(&mut out, &mut at, claim, 6);
        let flags = u64::from(self.shift.min(MAX_SHIFT))
            | u64::from(self.claiming) << 6
            | u64::from(self.refused) << 7;
        put_le(&mut out, &mut at, flags, 1);
        put_le(&mut out, &mut at, u64::from(self.remaining), 4);
        out
    }

    /// Decodes [`State::encode`]'s output; `None` for the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<State> {
        let mut r = Reader(bytes);
        let raw = get_le(&mut r, 5)?;
        // Sign-extend the 40-bit two's complement.
        let held = ((raw << 24) as i64) >> 24;
        let expires_ms = get_le(&mut r, 6)?;
        let claim = get_le(&mut r, 6)?;
        let flags = get_le(&mut r, 1)?;
        let remaining = u32::try_from(get_le(&mut r, 4)?).ok()?;
        r.end()?;
        Some(State {
            held,
            expires_ms,
            claim_ms: claim & CLAIM_MS_MASK,
            claiming: flags & 0x40 != 0,
            asking: claim >> 47 != 0,
            refused: flags & 0x80 != 0,
            shift: (flags & 0x3f) as u8,
            remaining,
        })
    }

    /// The state as it stands at `now_ms`: past its expiry, nothing is held (a debt is kept: it
    /// is usage the service never counted) and the service's refusal is over.
    pub fn at(mut self, now_ms: u64) -> State {
        if now_ms >= self.expires_ms {
            self.held = self.held.min(0);
            self.refused = false;
        }
        self
    }

    /// Quota held at `now_ms` that lapses if not used (what is held, if it has expired).
    pub fn lapsing(&self, now_ms: u64) -> u64 {
        if now_ms >= self.expires_ms {
            u64::try_from(self.held).unwrap_or(0)
        } else {
            0
        }
    }

    /// Requests this entry still remembers at `now_ms` (`None`: it no longer matters): what it
    /// holds while it holds it, a refusal while it lasts, a debt or a claim in flight.
    pub fn weight(&self, now_ms: u64) -> Option<u64> {
        let s = self.at(now_ms);
        if s.held > 0 || s.refused {
            return Some(u64::try_from(s.held).unwrap_or(0).max(1));
        }
        (s.held < 0 || s.claiming).then_some(1)
    }

    /// The block the next claim asks for: `2^shift` requests of `unit` (what the request at
    /// hand costs), at most `cap` (at least 1).
    pub fn block(&self, cap: u64, unit: u64) -> u64 {
        unit.max(1)
            .saturating_mul(1u64 << self.shift.min(MAX_SHIFT))
            .min(cap)
            .max(1)
    }

    /// The block to claim next at `now_ms`: [`State::block`], and while the service's window
    /// lasts no more than [`near_limit`] of what it said remained (others only take from it
    /// meanwhile).
    pub fn claim_block(&self, cap: u64, unit: u64, now_ms: u64) -> u64 {
        let b = self.block(cap, unit);
        if now_ms < self.expires_ms && self.remaining > 0 {
            b.min(near_limit(u64::from(self.remaining), unit))
        } else {
            b
        }
    }

    /// A claim ahead of need is in flight at `now_ms` (one that went unanswered for
    /// [`STALE_CLAIM_MS`] no longer counts: its proxy or VM may be gone).
    fn in_flight(&self, now_ms: u64) -> bool {
        self.claiming && now_ms < self.claim_ms.saturating_add(STALE_CLAIM_MS)
    }

    /// What the lease makes of a request of `cost` at `now_ms`, blocks at most `cap`.
    pub fn peek(state: Option<&State>, now_ms: u64, cost: u64, cap: u64) -> Peek {
        let s = state.copied().unwrap_or_default().at(now_ms);
        let half = i64::try_from(s.block(cap, cost) / 2).unwrap_or(i64::MAX);
        let cost = i64::try_from(cost).unwrap_or(i64::MAX);
        if s.held >= cost {
            let after = s.held - cost;
            return Peek::Covered {
                low: after < half.max(1) && !s.refused && !s.in_flight(now_ms),
            };
        }
        if s.refused {
            return Peek::Refused;
        }
        Peek::Claim
    }

    /// A claim ahead of need for requests waiting their turn on this lease, at `now_ms`, of
    /// requests of `cost`, blocks at most `cap`: due when what is held does not cover one of
    /// them or runs low, the service has not refused the key until the lease's end, and no
    /// claim ahead of need is in flight. The new state and the block to claim.
    pub fn wake(state: Option<&State>, now_ms: u64, cost: u64, cap: u64) -> Option<(State, u64)> {
        let s = state.copied().unwrap_or_default().at(now_ms);
        let due = match State::peek(state, now_ms, cost, cap) {
            Peek::Claim => !s.in_flight(now_ms),
            Peek::Covered { low } => low,
            Peek::Refused => false,
        };
        due.then(|| s.start_claim(now_ms, (cap, cost), true))
    }

    /// A claim starts at `now_ms` (`ahead`: ahead of need, in the background; else by a
    /// request that waits for it), blocks at most `cap` of requests costing `unit`: the block
    /// follows how soon the last one was claimed. A key's first block is [`FIRST_SHIFT`]'s.
    /// Returns the new state and the block to claim.
    pub fn start_claim(self, now_ms: u64, (cap, unit): (u64, u64), ahead: bool) -> (State, u64) {
        self.claim(now_ms, (cap, unit), (ahead, false))
    }

    /// [`State::start_claim`] by a request; `held_back`: while another request's claim is on
    /// its way, its block for the requests after it, this one asks for its own cost alone and
    /// the blocks do not grow for it. Held back, a fleet-fair rule's Envoy claims no more than
    /// its part: else every request that came during a round trip claimed a block, each twice
    /// the one before (within [`FAST_MS`]), and with answers 20 ms away three replicas claimed
    /// a window's whole quota in its first 100 ms and let a fifth of it lapse. Not held back,
    /// a key at full speed claims a few blocks a round trip, in fewer calls (envoy-tests'
    /// global.rs lease test: 11 claims per 100 admitted, 14 to 15 held back).
    pub fn start_request_claim(
        self,
        now_ms: u64,
        (cap, unit): (u64, u64),
        held_back: bool,
    ) -> (State, u64) {
        self.claim(now_ms, (cap, unit), (false, held_back))
    }

    fn claim(
        self,
        now_ms: u64,
        (cap, unit): (u64, u64),
        (ahead, held_back): (bool, bool),
    ) -> (State, u64) {
        let mut s = self;
        // Only a request is held back (`start_request_claim`), never a claim ahead of need.
        if held_back && s.asking && now_ms < s.claim_ms.saturating_add(ASKING_STALE_MS) {
            return (s, unit.clamp(1, cap.max(1)));
        }
        let since = now_ms.saturating_sub(s.claim_ms);
        if s.claim_ms == 0 {
            s.shift = FIRST_SHIFT;
        } else if since < FAST_MS && s.block(cap, unit) < cap {
            s.shift = (s.shift + 1).min(MAX_SHIFT);
        } else if since > SLOW_MS {
            s.shift = s.shift.saturating_sub(1);
        }
        s.claiming |= ahead;
        s.asking |= !ahead;
        s.claim_ms = now_ms;
        (s, s.claim_block(cap, unit, now_ms))
    }

    /// The service granted `block` (of which `taken` goes at once to the request that claimed
    /// it) in a window ending at `expires_ms`, leaving `remaining`: the new state (quota held
    /// past its expiry is replaced: it lapsed).
    pub fn granted(state: Option<&State>, now_ms: u64, grant: Grant, background: bool) -> State {
        let old = state.copied().unwrap_or_default();
        let mut s = old.at(now_ms);
        // A request's claim answered (whichever it was): the next request that must claim
        // claims a block.
        s.asking = false;
        if grant.expires_ms <= now_ms {
            // The grant's window turned before its answer came (a reset of 0, or shorter than
            // the round trip): its block lapses at once, and what is held of a newer window
            // stays as it is (taking the earlier end would drop it).
            if background {
                s.claiming = false;
            }
            return s;
        }
        // Each grant's end is a lower bound of its window's (from when the claim was sent,
        // the service's reset rounded down): two of one window (ends within [`TURN_MS`] of
        // each other: windows are a second at least) lapse at the later bound, the closer
        // one. Quota of two windows lapses at the earlier end: none outlives its window.
        s.expires_ms = if now_ms < old.expires_ms && same_window(old.expires_ms, grant.expires_ms) {
            old.expires_ms.max(grant.expires_ms)
        } else if old.held > 0 && now_ms < old.expires_ms {
            old.expires_ms.min(grant.expires_ms)
        } else {
            grant.expires_ms
        };
        let add = i64::try_from(grant.block.saturating_sub(grant.taken)).unwrap_or(HELD_BOUND);
        s.held = s.held.saturating_add(add).min(HELD_BOUND);
        s.refused = false;
        s.remaining = grant.remaining;
        if background {
            s.claiming = false;
        }
        s
    }

    /// Whether `now_ms` is at the turn of the service's window: the end of the window this
    /// proxy last heard of (an estimate, early by a claim's round trip) passed less than
    /// [`TURN_MS`] ago, and a refusal may still be the old window's.
    pub fn at_turn(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_ms && now_ms < self.expires_ms.saturating_add(TURN_MS)
    }

    /// The service refused a claim: none left (`remaining` 0) until `until_ms`, or less than
    /// the block (a claim of what remains is due). `last_ask`: the claim was a request's last
    /// ask (after a refusal at the turn, asked again: `runtime::TURN_ASKS`).
    pub fn refused_claim(
        state: Option<&State>,
        now_ms: u64,
        until_ms: u64,
        remaining: u32,
        (background, last_ask): (bool, bool),
    ) -> State {
        let old = state.copied().unwrap_or_default();
        let mut s = old.at(now_ms);
        s.asking = false;
        if remaining == 0 && until_ms <= now_ms {
            // The refused window turned before the answer came: nothing is refused now, and
            // what is held of a newer window stays as it is.
            if background {
                s.claiming = false;
            }
            return s;
        }
        if remaining == 0 {
            s.refused = true;
            // At a window's turn, a refusal may be the old window's (its counter full) and come
            // with a reset of most of the next one (limitador over Redis does): that would
            // refuse this proxy a whole window the service has quota for. So within the window
            // this proxy last heard of (a grant's or a refusal's), a refusal lasts until that
            // window's end at most; within [`TURN_MS`] after it (that end is an estimate, early
            // by the claim's round trip) a refusal is not held against the key: the next
            // request claims again. Unless a request asked again and was refused each time, a
            // round trip apart: the service's new window is spent, and the refusal stands.
            if now_ms < old.expires_ms {
                s.expires_ms = old.expires_ms.min(until_ms);
            } else if old.at_turn(now_ms) && !last_ask {
                s.refused = false;
            } else {
                s.expires_ms = until_ms;
            }
        }
        s.remaining = remaining;
        if background {
            s.claiming = false;
        }
        s
    }

    /// `cost` taken from what is held goes back to it (a request refused by another rule).
    pub fn give_back(self, cost: u64) -> State {
        State {
            held: self
                .held
                .saturating_add(i64::try_from(cost).unwrap_or(HELD_BOUND))
                .min(HELD_BOUND),
            ..self
        }
    }

    /// A claim came to nothing (no answer): another may start.
    pub fn claim_failed(self) -> State {
        State {
            claiming: false,
            asking: false,
            ..self
        }
    }
}

/// What a claim asks of `remaining` (what the service last said remained), for requests
/// costing `unit`: a [`NEAR_SHARE`]⁻¹ share, at least one request's worth while that much
/// remains.
pub fn near_limit(remaining: u64, unit: u64) -> u64 {
    (remaining / NEAR_SHARE).max(unit.max(1).min(remaining))
}

/// Whether two estimates of a window's end, each a lower bound, are of the same window.
pub fn same_window(a: u64, b: u64) -> bool {
    a.abs_diff(b) < TURN_MS
}

/// A block the service granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The block granted.
    pub block: u64,
    /// What the request that claimed it takes at once.
    pub taken: u64,
    /// When the service's window ends at the earliest, ms since the epoch.
    pub expires_ms: u64,
    /// What the service said remained.
    pub remaining: u32,
}

/// The verdict for a request of `cost` at `now_ms` under a lease, with the new state if it is
/// admitted. The quota reported is what this proxy holds plus what the service last said
/// remained.
pub fn decide(
    state: Option<State>,
    now_ms: u64,
    limit: u64,
    windows: Windows,
    cost: u64,
) -> (Verdict, Option<State>) {
    decide_keeping(state, now_ms, (limit, windows), cost, 0)
}

/// [`decide`], the request taking nothing of the last `kept` units held (kept for others until
/// the service's window ends: a request they alone would cover waits for it to end).
pub fn decide_keeping(
    state: Option<State>,
    now_ms: u64,
    (limit, windows): (u64, Windows),
    cost: u64,
    kept: u64,
) -> (Verdict, Option<State>) {
    let s = state.unwrap_or_default().at(now_ms);
    let (start, end) = windows.bounds(now_ms);
    let to_end = s.expires_ms.saturating_sub(now_ms);
    let icost = i64::try_from(cost).unwrap_or(i64::MAX);
    let left = |held: i64| u64::try_from(held).unwrap_or(0) + u64::from(s.remaining);
    let mut v = Verdict {
        allowed: true,
        limit,
        window_s: (end - start) / 1000,
        remaining: left(s.held),
        reset_ms: to_end,
        retry_after_ms: 0,
        delay_ms: 0,
    };
    let ikept = i64::try_from(kept).unwrap_or(i64::MAX);
    if s.held.saturating_sub(ikept) >= icost {
        let next = State {
            held: s.held - icost,
            ..s
        };
        v.remaining = left(next.held);
        return (v, (cost > 0).then_some(next));
    }
    v.allowed = false;
    v.retry_after_ms = if s.refused || (kept > 0 && s.held >= icost) {
        to_end.max(1)
    } else {
        SHORT_WAIT_MS
    };
    (v, None)
}

/// [`decide`]'s admission without its verdict: `Some` when what is held at `now_ms` covers
/// `cost`, with the state to write (`None`: the request costs nothing, nothing changes);
/// `None` when it does not.
pub fn take(state: Option<&State>, now_ms: u64, cost: u64) -> Option<Option<State>> {
    let s = state.copied().unwrap_or_default().at(now_ms);
    let icost = i64::try_from(cost).unwrap_or(i64::MAX);
    (s.held >= icost).then(|| {
        (cost > 0).then_some(State {
            held: s.held - icost,
            ..s
        })
    })
}

/// Charges `cost` used beyond what was taken: from what is held, into a debt if need be.
pub fn charge(state: Option<State>, now_ms: u64, cost: u64) -> State {
    let mut s = state.unwrap_or_default().at(now_ms);
    s.held = s
        .held
        .saturating_sub(i64::try_from(cost).unwrap_or(HELD_BOUND))
        .max(-HELD_BOUND);
    s
}

/// Gives `cost` back to what is held, unless it has lapsed meanwhile (`None`: nothing to change).
pub fn refund(state: Option<State>, now_ms: u64, cost: u64) -> Option<State> {
    let s = state?;
    (now_ms < s.expires_ms).then(|| s.give_back(cost))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MINUTE: Windows = Windows::every(60_000);

    fn grant(block: u64, taken: u64, expires_ms: u64) -> Grant {
        Grant {
            block,
            taken,
            expires_ms,
            remaining: 100,
        }
    }

    #[test]
    fn taking_admits_and_writes_what_deciding_does() {
        let mut n = 0;
        for held in [-3i64, 0, 1, 2, 5] {
            for expires_ms in [500, 2_000] {
                for cost in [0u64, 1, 2, 3] {
                    let s = State {
                        held,
                        expires_ms,
                        remaining: 7,
                        ..State::default()
                    };
                    let (v, next) = decide(Some(s), 1_000, 100, MINUTE, cost);
                    let taken = take(Some(&s), 1_000, cost);
                    assert_eq!(taken.is_some(), v.allowed, "{s:?} {cost}");
                    assert_eq!(taken.flatten(), next, "{s:?} {cost}");
                    n += u32::from(v.allowed && next.is_some());
                }
            }
        }
        assert!(n > 5);
    }

    #[test]
    fn states_round_trip_with_debts_and_flags() {
        let s = State {
            held: -12_345,
            expires_ms: 1_790_000_000_123,
            claim_ms: 1_790_000_000_001,
            claiming: true,
            asking: true,
            refused: true,
            shift: 17,
            remaining: 4_000_000_000,
        };
        assert_eq!(State::decode(&s.encode()), Some(s));
        let quiet = State { asking: false, ..s };
        assert_eq!(State::decode(&quiet.encode()), Some(quiet));
        let big = State {
            held: 1 << 45,
            ..State::default()
        };
        assert_eq!(State::decode(&big.encode()).unwrap().held, HELD_BOUND);
        assert_eq!(State::decode(&[0; 21]), None);
    }

    #[test]
    fn a_request_held_back_while_another_requests_claim_is_on_its_way_claims_its_own_cost() {
        // The first request's claim: a block (growing, within a second of the last claim).
        let (s, first) = State {
            shift: 3,
            claim_ms: 900,
            ..State::default()
        }
        .start_request_claim(1_200, (64, 1), true);
        assert_eq!((first, s.asking, s.shift), (16, true, 4));
        // Two more requests before its answer: their own cost each, the blocks not grown.
        let (t, second) = s.start_request_claim(1_201, (64, 3), true);
        let (t, third) = t.start_request_claim(1_202, (64, 1), true);
        assert_eq!((second, third, t.shift, t.claim_ms), (3, 1, 4, 1_200));
        // Not held back (a rule not fair across the fleet): a block, twice the last.
        assert_eq!(s.start_request_claim(1_201, (64, 1), false).1, 32);
        let s = t;
        // Answered: the next claims a block again, growing.
        let s = State::granted(Some(&s), 1_210, grant(16, 1, 2_000), false);
        assert!(!s.asking);
        let s = State {
            held: 0,
            remaining: 0,
            ..s
        };
        assert_eq!(s.start_request_claim(1_220, (64, 1), true).1, 32);
        // A claim ahead of need is not held back by a request's claim on its way.
        let (s, _) = State::default().start_claim(5_000, (64, 1), false);
        assert_eq!(s.start_claim(5_001, (64, 1), true).1, 8);
        // A request's claim unanswered for a second no longer counts; a refusal or a claim
        // that came to nothing answers it too.
        let (s, _) = State::default().start_claim(7_000, (64, 1), false);
        assert_eq!(s.start_request_claim(7_999, (64, 1), true).1, 1);
        assert!(s.start_request_claim(8_000, (64, 1), true).1 > 1);
        assert!(!s.claim_failed().asking);
        assert!(!State::refused_claim(Some(&s), 7_010, 8_000, 0, (false, false)).asking);
    }

    #[test]
    fn admits_from_what_is_held_and_never_beyond() {
        let s = State::granted(None, 1_000, grant(10, 1, 60_000), false);
        assert_eq!(s.held, 9);
        let mut state = Some(s);
        let mut admitted = 1;
        for t in 0..20 {
            let (v, next) = decide(state, 2_000 + t, 100, MINUTE, 1);
            if v.allowed {
                admitted += 1;
                state = next;
            } else {
                assert_eq!(
                    v.retry_after_ms, SHORT_WAIT_MS,
                    "not refused by the service"
                );
            }
        }
        assert_eq!(admitted, 10, "the block, and no more");
        // Past the lease's end what was held lapses.
        let s = State::granted(None, 1_000, grant(10, 0, 60_000), false);
        assert_eq!(s.lapsing(60_000), 10);
        assert!(!decide(Some(s), 60_000, 100, MINUTE, 1).0.allowed);
    }

    #[test]
    fn what_is_kept_for_others_is_not_taken_and_the_refusal_waits_for_the_window_end() {
        let s = State::granted(None, 1_000, grant(10, 0, 60_000), false);
        let keeping = |cost, kept| decide_keeping(Some(s), 2_000, (100, MINUTE), cost, kept);
        let (v, next) = keeping(4, 6);
        assert!(v.allowed);
        assert_eq!(next.unwrap().held, 6);
        let (v, next) = keeping(5, 6);
        assert!(!v.allowed && next.is_none());
        assert_eq!(v.retry_after_ms, 58_000, "until the service's window ends");
        // Held too little whatever is kept: a claim is due, as without keeping.
        let (v, _) = keeping(11, 6);
        assert_eq!(v.retry_after_ms, SHORT_WAIT_MS);
        assert_eq!(keeping(5, 0), decide(Some(s), 2_000, 100, MINUTE, 5));
    }

    #[test]
    fn an_answer_whose_window_turned_leaves_a_newer_lease_alone() {
        // A block of a newer window held until 2,000; a grant and a refusal of the window
        // before, answered late (their windows ended at 999, before the answers came).
        let newer = State::granted(None, 1_000, grant(10, 0, 2_000), false);
        let late = State::granted(Some(&newer), 1_001, grant(10, 0, 999), false);
        assert_eq!((late.held, late.expires_ms), (10, 2_000));
        let refused = State::refused_claim(Some(&newer), 1_001, 999, 0, (false, false));
        assert_eq!((refused.held, refused.expires_ms), (10, 2_000));
        assert!(!refused.refused);
        // With nothing newer held, the late grant's block lapses at once.
        let alone = State::granted(None, 1_001, grant(10, 1, 1_001), false);
        assert_eq!(alone.at(1_001).held, 0);
    }

    #[test]
    fn two_grants_lapse_at_the_earlier_end() {
        let s = State::granted(None, 1_000, grant(10, 0, 60_000), false);
        let s = State::granted(Some(&s), 2_000, grant(10, 0, 61_000), false);
        assert_eq!((s.held, s.expires_ms), (20, 60_000));
        // A grant after the old one lapsed: the new window's end, the old quota gone.
        assert_eq!(s.lapsing(60_500), 20);
        let s = State::granted(Some(&s), 60_500, grant(4, 1, 120_000), false);
        assert_eq!((s.held, s.expires_ms, s.lapsing(60_500)), (3, 120_000, 0));
    }

    #[test]
    fn grants_of_one_window_lapse_at_the_closest_estimate_of_its_end() {
        // Each end is the claim's send time plus the service's reset rounded down: early by
        // up to the rounding. Ends within TURN_MS of each other are one window's: the later.
        let s = State::granted(None, 1_000, grant(10, 0, 60_000), false);
        let s = State::granted(Some(&s), 2_000, grant(10, 0, 60_002), false);
        assert_eq!((s.held, s.expires_ms), (20, 60_002));
        let s = State::granted(Some(&s), 3_000, grant(10, 0, 60_001), false);
        assert_eq!((s.held, s.expires_ms), (30, 60_002));
        // So too when nothing is held any more (the last block was used up).
        let spent = State { held: 0, ..s };
        let s = State::granted(Some(&spent), 4_000, grant(10, 0, 59_999), false);
        assert_eq!((s.held, s.expires_ms), (10, 60_002));
        // Ends TURN_MS apart are two windows': the earlier, as before.
        let s = State::granted(Some(&s), 5_000, grant(10, 0, 60_002 + TURN_MS), false);
        assert_eq!((s.held, s.expires_ms), (20, 60_002));
        // Past its estimated end the old window is not kept on.
        let s = State::granted(Some(&s), 60_002, grant(10, 0, 60_050), false);
        assert_eq!((s.held, s.expires_ms), (10, 60_050));
    }

    #[test]
    fn a_refusal_lasts_until_the_services_reset() {
        let s = State::refused_claim(None, 1_000, 30_000, 0, (true, false));
        assert_eq!(State::peek(Some(&s), 2_000, 1, 64), Peek::Refused);
        let (v, _) = decide(Some(s), 2_000, 100, MINUTE, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 28_000));
        assert_eq!(State::peek(Some(&s), 30_000, 1, 64), Peek::Claim);
        // Some left: no refusal, a claim of what remains is due.
        let s = State::refused_claim(None, 1_000, 30_000, 3, (true, false));
        assert_eq!(State::peek(Some(&s), 2_000, 1, 64), Peek::Claim);
        // A refusal at the very end of the last grant's window, saying a whole window more
        // (the old counter full, the new window's length): refused until that window's end
        // only, not through the next one.
        let used = State {
            held: 0,
            ..State::granted(None, 9_000, grant(5, 5, 10_000), true)
        };
        let s = State::refused_claim(Some(&used), 9_997, 10_950, 0, (true, false));
        assert_eq!((s.refused, s.expires_ms), (true, 10_000));
        assert_eq!(State::peek(Some(&s), 9_999, 1, 64), Peek::Refused);
        assert_eq!(State::peek(Some(&s), 10_000, 1, 64), Peek::Claim);
        // Just after it (and after a refusal until it), refusals are not held against the key.
        let s = State::refused_claim(Some(&used), 10_001, 10_950, 0, (true, false));
        assert_eq!((s.refused, s.expires_ms), (false, 10_000));
        assert_eq!(State::peek(Some(&s), 10_002, 1, 64), Peek::Claim);
        let refused = State::refused_claim(Some(&used), 9_990, 10_950, 0, (true, false));
        let s = State::refused_claim(Some(&refused), 10_003, 10_950, 0, (true, false));
        assert_eq!(State::peek(Some(&s), 10_004, 1, 64), Peek::Claim);
        // A request's last ask refused there: the service's new window is spent, the reset
        // stands.
        let s = State::refused_claim(Some(&used), 10_004, 10_950, 0, (false, true));
        assert_eq!((s.refused, s.expires_ms), (true, 10_950));
        assert_eq!(State::peek(Some(&s), 10_005, 1, 64), Peek::Refused);
        // Long after it, the service's reset stands.
        let s = State::refused_claim(Some(&used), 10_000 + TURN_MS, 10_950, 0, (true, false));
        assert_eq!(s.expires_ms, 10_950);
    }

    #[test]
    fn blocks_follow_the_rate_within_the_cap() {
        let mut s = State::default();
        let (next, block) = s.start_claim(10_000, (64, 1), true);
        assert_eq!((block, next.claiming), (4, true));
        assert_eq!(
            s.start_claim(10_000, (2, 1), false),
            (
                State {
                    claim_ms: 10_000,
                    shift: 2,
                    asking: true,
                    ..s
                },
                2
            )
        );
        s = State::granted(Some(&next), 10_010, grant(4, 0, 60_000), true);
        assert!(!s.claiming);
        // Far from the limit, and ran low fast: doubling up to the cap.
        s.remaining = 10_000;
        let mut t = 10_100;
        let mut blocks = Vec::new();
        for _ in 0..9 {
            let (n, b) = s.start_claim(t, (64, 1), true);
            blocks.push(b);
            s = n.claim_failed();
            t += 100;
        }
        assert_eq!(blocks, [8, 16, 32, 64, 64, 64, 64, 64, 64]);
        // Slow: halving.
        let (_, b) = s.start_claim(t + 9_000, (64, 1), true);
        assert_eq!(b, 32);
        // Blocks count requests of what the request at hand costs: 4 of 1,000 tokens first.
        let (_, b) = State::default().start_claim(10_000, (1_000_000, 1_000), false);
        assert_eq!(b, 4_000);
        // The 4 granted are held; taking 3 runs low: a claim ahead is due.
        assert_eq!(State::peek(Some(&s), t, 3, 64), Peek::Covered { low: true });
        assert_eq!(State::peek(Some(&s), t, 5, 64), Peek::Claim);
    }

    #[test]
    fn usage_beyond_the_grants_is_a_debt_paid_from_the_next() {
        let s = State::granted(None, 1_000, grant(10, 0, 60_000), false);
        let s = charge(Some(s), 2_000, 15);
        assert_eq!(s.held, -5);
        assert_eq!(State::peek(Some(&s), 2_000, 1, 64), Peek::Claim);
        let s = State::granted(Some(&s), 2_100, grant(8, 1, 60_000), false);
        assert_eq!(s.held, 2);
        assert_eq!(refund(Some(s), 3_000, 4).unwrap().held, 6);
        assert_eq!(
            refund(Some(s), 60_000, 4),
            None,
            "lapsed: nothing to give back"
        );
    }

    #[test]
    fn blocks_shrink_near_the_limit() {
        // A quarter of what the service said remained, at least a request's worth.
        assert_eq!(near_limit(400, 1), 100);
        assert_eq!(near_limit(7, 1), 1);
        assert_eq!(near_limit(7, 5), 5);
        assert_eq!(near_limit(3, 5), 3);
        let mut s = State::granted(None, 1_000, grant(64, 0, 60_000), false);
        s.shift = 6;
        s.remaining = 1_000;
        assert_eq!(
            s.claim_block(64, 1, 2_000),
            64,
            "far from the limit: the block"
        );
        s.remaining = 100;
        assert_eq!(s.claim_block(64, 1, 2_000), 25);
        s.remaining = 2;
        assert_eq!(s.claim_block(64, 1, 2_000), 1);
        assert_eq!(s.claim_block(64, 1, 60_000), 64, "a new window: unknown");
    }

    /// A fleet of `proxies` proxies, each with `clients` clients sending requests of 1 at
    /// full speed, over a service with `limit` that checks, then counts: a call is checked
    /// (count + hits ≤ limit) when it arrives and counted `lag` steps later, so calls arriving
    /// within `lag` steps of each other all pass the check. Each step, one client (a seeded
    /// pseudo-random pick) sends a request; a claim's answer comes back `lag + 1` steps after it
    /// was sent. Returns what the fleet admitted, and the largest claim.
    fn racing(proxies: usize, clients: usize, limit: u64, cap: u64, lag: usize) -> (u64, u64) {
        struct Call {
            proxy: usize,
            hits: u64,
            ok: bool,
            remaining: u64,
            due: usize,
            counted: bool,
        }
        let mut states = vec![State::default(); proxies];
        let mut count = 0u64;
        let mut calls: Vec<Call> = Vec::new();
        let mut waiting = vec![false; proxies * clients];
        let (mut admitted, mut largest) = (0u64, 0u64);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000usize {
            let now = 1_000 + step as u64;
            // The service counts what it checked `lag` steps ago; answers arrive after it.
            for c in calls.iter_mut().filter(|c| c.ok && !c.counted) {
                if step + 1 >= c.due {
                    count += c.hits;
                    c.counted = true;
                }
            }
            let (due, later): (Vec<Call>, Vec<Call>) = calls.drain(..).partition(|c| step >= c.due);
            calls = later;
            for c in due {
                let s = Some(&states[c.proxy]);
                let remaining = u32::try_from(c.remaining).unwrap_or(u32::MAX);
                states[c.proxy] = if c.ok {
                    let g = Grant {
                        block: c.hits,
                        taken: 1,
                        expires_ms: 60_000_000,
                        remaining,
                    };
                    admitted += 1;
                    State::granted(s, now, g, false)
                } else {
                    State::refused_claim(s, now, 60_000_000, remaining, (false, false))
                };
                for w in waiting.iter_mut().skip(c.proxy * clients).take(clients) {
                    if *w {
                        *w = false;
                        break;
                    }
                }
            }
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let client = (seed % (proxies * clients) as u64) as usize;
            if waiting[client] {
                continue;
            }
            let p = client / clients;
            let s = states[p];
            match State::peek(Some(&s), now, 1, cap) {
                Peek::Covered { .. } => {
                    let (v, next) = decide(Some(s), now, limit, MINUTE, 1);
                    assert!(v.allowed);
                    states[p] = next.unwrap();
                    admitted += 1;
                }
                Peek::Refused => {}
                Peek::Claim => {
                    let (next, hits) = s.at(now).start_claim(now, (cap, 1), false);
                    states[p] = next;
                    largest = largest.max(hits);
                    let ok = count + hits <= limit;
                    let remaining = limit.saturating_sub(count + if ok { hits } else { 0 });
                    waiting[client] = true;
                    calls.push(Call {
                        proxy: p,
                        hits,
                        ok,
                        remaining,
                        due: step + lag + 1,
                        counted: false,
                    });
                }
            }
        }
        (admitted, largest)
    }

    #[test]
    fn over_a_service_that_checks_then_counts_the_excess_is_bounded() {
        // Three proxies of two clients (the Envoy test's fleet), and ten of four; the service's
        // check and count a few steps apart. Over the limit by at most (C − 1) blocks, C the
        // claims in flight at once (here one per client).
        for (proxies, clients, lag) in [(3, 2, 3), (3, 2, 10), (10, 4, 5), (10, 4, 40)] {
            let (limit, cap) = (1_000, 100);
            let (admitted, largest) = racing(proxies, clients, limit, cap, lag);
            let bound = (proxies * clients - 1) as u64 * largest;
            assert!(
                admitted <= limit + bound,
                "{proxies}×{clients}, lag {lag}: {admitted} admitted, bound {bound}"
            );
            // Blocks shrink near the limit: far less than a block per proxy over.
            assert!(
                admitted <= limit + cap / 4 * proxies as u64,
                "{proxies}×{clients}, lag {lag}: {admitted} admitted"
            );
            assert!(admitted >= limit * 9 / 10, "{admitted} admitted");
        }
    }
}
