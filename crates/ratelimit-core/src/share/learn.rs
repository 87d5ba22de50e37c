//! A shared capacity held to what the provider says of its own limit.
//!
//! A provider states its limit in each answer (OpenAI's `x-ratelimit-*`, Anthropic's
//! `anthropic-ratelimit-*`, read by [`crate::provider`]). Three things are folded into the
//! rule's record, each only ever **lowering** the capacity in force:
//!
//! - **the limit**: a stated limit below the configured one (scaled from the provider's window
//!   to the rule's) becomes the capacity in force for `hold` after it was last stated, then the
//!   capacity climbs back to the configured one over `ramp`. A stated limit at or above the
//!   configured one changes nothing: never above the configuration.
//! - **the remaining** (when the provider's window is the rule's): what the provider says
//!   remains, lower than what the capacity says remains by more than the answer's age can
//!   explain, is counted as used. An answer is older than the admissions since, so it can only
//!   report too much remaining: it never lowers anything wrongly.
//! - **a refusal** (a provider 429): the capacity refuses everyone until the provider's
//!   `retry-after` (at most `max_block`), and, when the capacity was at least half used, its
//!   limit in force drops to 90 % of what was used (the provider counts more than we do).
//!
//! A hostile or broken upstream can therefore cost throughput (a lying limit for `hold` after
//! the last lie, a block for `max_block`), never the cap.

use super::{Record, Share};
use crate::limiter::Policy;
use crate::provider::{Api, Measure, Said};

/// How a shared rule learns its capacity (`share.learn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Learn {
    /// Whose fields are read.
    pub api: Api,
    /// Which of the provider's measures is the rule's (its quota unit's).
    pub measure: Measure,
    /// The window of the provider's stated limits, ms (a minute for both APIs).
    pub window_ms: u64,
    /// How long a stated limit holds after it was last stated, ms.
    pub hold_ms: u64,
    /// How long the capacity then takes to climb back to the configured one, ms.
    pub ramp_ms: u64,
    /// The longest a provider's refusal blocks the capacity, ms.
    pub max_block_ms: u64,
    /// Whether the provider's fields are taken out of the response (they describe the whole
    /// account, every tenant's use).
    pub strip: bool,
}

/// One answer of the provider, as read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// The measure's fields (`None`: absent or invalid).
    pub said: Option<Said>,
    /// Whether the provider refused the request (a 429).
    pub refused: bool,
    /// How long a refusal asks to wait.
    pub retry_after_ms: Option<u64>,
}

/// What folding an answer in did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    /// Whether the record changed (and must be written).
    pub changed: bool,
    /// Units the provider counts and the capacity did not: now counted.
    pub synced: u64,
}

/// The capacity's limit in force at `now_ms`: the learned limit while it holds, then climbing
/// linearly to the configured `limit` over `ramp_ms`; never above `limit`.
pub fn limit_in_force(record: &Record, limit: u64, ramp_ms: u64, now_ms: u64) -> u64 {
    let learned = record.learned_limit;
    if learned == 0 || learned >= limit {
        return limit;
    }
    let until = record.learned_until_ms;
    if now_ms < until {
        return learned;
    }
    let t = now_ms - until;
    if t >= ramp_ms {
        return limit;
    }
    let climb = u128::from(limit - learned) * u128::from(t) / u128::from(ramp_ms.max(1));
    learned.saturating_add(u64::try_from(climb).unwrap_or(u64::MAX))
}

/// The capacity's policy in force: `capacity` with its limit (and a bucket's burst, in
/// proportion) lowered to [`limit_in_force`].
pub fn policy_in_force(capacity: &Policy, record: &Record, share: &Share, now_ms: u64) -> Policy {
    if record.learned_limit == 0 {
        return *capacity; // nothing learned: the usual request
    }
    let (limit, _) = capacity.limit_and_window();
    lowered(
        capacity,
        limit_in_force(record, limit, share.ramp_ms, now_ms),
    )
}

/// `capacity` with its limit (and a bucket's burst, in proportion) lowered to `in_force`, if
/// that is lower.
pub fn lowered(capacity: &Policy, in_force: u64) -> Policy {
    let (limit, _) = capacity.limit_and_window();
    if in_force >= limit {
        return *capacity;
    }
    let burst = capacity.burst().map_or(0, |b| {
        let scaled = u128::from(b) * u128::from(in_force) / u128::from(limit.max(1));
        u64::try_from(scaled).unwrap_or(u64::MAX).max(1)
    });
    capacity.with_limit(in_force.max(1), burst)
}

/// Folds one answer to a request the rule admitted at `admitted_ms` into `record`, at `now_ms`.
/// `fleet`: the capacity is shared fair across a fleet of Envoys (`share.fleet: "fair"`), its
/// level computed alike by every Envoy from the capacity in force: what this one used is its
/// part of what the provider counted, so neither a refusal nor the remaining says what to
/// lower here (only the stated limit does then).
pub fn fold(
    learn: &Learn,
    share: &Share,
    capacity: &Policy,
    record: &mut Record,
    answer: &Answer,
    (admitted_ms, now_ms): (u64, u64),
    fleet: bool,
) -> Folded {
    let mut out = Folded::default();
    let (limit, window_ms) = capacity.limit_and_window();
    let window_ms = window_ms.max(1);
    if let Some(stated) = answer.said.and_then(|s| s.limit) {
        // The provider's limit over the rule's window.
        let scaled =
            u128::from(stated) * u128::from(window_ms) / u128::from(learn.window_ms.max(1));
        let scaled = u64::try_from(scaled).unwrap_or(u64::MAX).max(1);
        if scaled < limit {
            let until = now_ms.saturating_add(learn.hold_ms);
            // While a lower limit holds (one a refusal set), a higher stated one waits for it to
            // end (it is neither taken nor extends the hold).
            let holding = record.learned_limit > 0 && now_ms < record.learned_until_ms;
            let higher = holding && scaled > record.learned_limit;
            // Held again at most once a second: the usual answer writes nothing.
            let stale = record.learned_limit != scaled
                || until >= record.learned_until_ms.saturating_add(1000);
            if !higher && stale {
                record.learned_limit = scaled;
                record.learned_until_ms = until;
                out.changed = true;
            }
        }
    }
    let policy = policy_in_force(capacity, record, share, now_ms);
    let in_force = policy.limit_and_window().0;
    let remaining = answer.said.and_then(|s| s.remaining);
    // Fair across a fleet, this Envoy's capacity counts its own admissions only, and the
    // lease holds the fleet to the limit in force: the account's remaining, charged here, would
    // make this Envoy refuse whoever asks once the fleet's count neared the limit.
    if let Some(said) = remaining.filter(|_| learn.window_ms == window_ms && !fleet) {
        let ours = policy
            .decide(record.capacity.as_ref(), now_ms, 0)
            .0
            .remaining;
        // What the capacity refilled since the provider counted, and a unit of rounding.
        let age = now_ms.saturating_sub(admitted_ms);
        let slack = u128::from(in_force) * u128::from(age) / u128::from(window_ms) + 1;
        let slack = u64::try_from(slack).unwrap_or(u64::MAX);
        let excess = ours.saturating_sub(said.saturating_add(slack));
        if excess > 0 {
            if let Some((_, next)) = policy.charge(record.capacity.as_ref(), now_ms, excess) {
                record.capacity = Some(next);
                out.synced = excess;
                out.changed = true;
            }
        }
    }
    if answer.refused {
        let wait = answer
            .retry_after_ms
            .or_else(|| {
                let s = answer.said?;
                (s.remaining == Some(0)).then_some(s.reset_in_ms).flatten()
            })
            .unwrap_or(1000)
            .clamp(1, learn.max_block_ms.max(1));
        let until = now_ms.saturating_add(wait);
        if until > record.blocked_until_ms {
            record.blocked_until_ms = until;
            out.changed = true;
        }
        // Refused while at least half the capacity was used: the provider counts more than
        // this capacity does; hold it to 90 % of what it used. (Not fair across a fleet: each
        // Envoy would hold the fleet's level to 90 % of its own part, and the levels differ.)
        let used: u64 = record
            .bands
            .iter()
            .map(|b| b.used.usage(now_ms, window_ms))
            .sum();
        if !fleet && used.saturating_mul(2) >= in_force {
            let lower = (used.saturating_mul(9) / 10).max(1);
            if lower < in_force {
                record.learned_limit = lower;
                record.learned_until_ms = now_ms.saturating_add(learn.hold_ms);
                out.changed = true;
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::limiter::gcra;
    use crate::share::{decide, Asker, Decision, Reason, Tenant};

    fn share() -> Share {
        Share {
            ramp_ms: 30_000,
            ..Share::for_bands(&[0])
        }
    }

    fn learn(window_ms: u64) -> Learn {
        Learn {
            api: Api::OpenAi,
            measure: Measure::Requests,
            window_ms,
            hold_ms: 60_000,
            ramp_ms: 30_000,
            max_block_ms: 5_000,
            strip: true,
        }
    }

    fn bucket(limit: u64, burst: u64) -> Policy {
        Policy::Gcra(gcra::Params {
            limit,
            burst,
            window_ms: 1000,
            max_delay_ms: None,
        })
    }

    fn said(limit: Option<u64>, remaining: Option<u64>) -> Answer {
        Answer {
            said: Some(Said {
                limit,
                remaining,
                reset_in_ms: None,
            }),
            ..Answer::default()
        }
    }

    /// [`fold`] of the provider's `answer` under `learn(w)` and [`share`] into `r`, for a request
    /// admitted at `at`.
    fn told(w: u64, cap: &Policy, r: &mut Record, answer: &Answer, at: u64, now: u64) -> Folded {
        fold(&learn(w), &share(), cap, r, answer, (at, now), false)
    }

    /// One request (a cost of 1) of a tenant of weight 1 in the first band, `tenant` its state.
    fn ask(capacity: &Policy, record: &mut Record, tenant: Option<&Tenant>, now: u64) -> Decision {
        let asker = Asker {
            weight: 1,
            band: 0,
            again: false,
            wait_ms: 0,
        };
        decide(&share(), capacity, record, tenant, asker, now, 1)
    }

    /// Requests admitted over `seconds` of one tenant asking `rate` a second, evenly.
    fn admitted(
        capacity: &Policy,
        record: &mut Record,
        start_ms: u64,
        seconds: u64,
        rate: u64,
    ) -> u64 {
        let mut t = None;
        let mut n = 0;
        for i in 0..seconds * rate {
            let now = start_ms + i * 1000 / rate;
            let d = ask(capacity, record, t.as_ref(), now);
            t = Some(d.tenant);
            n += u64::from(d.verdict.allowed);
        }
        n
    }

    #[test]
    fn a_stated_limit_below_the_configured_one_holds_then_climbs_back() {
        let cap = bucket(200, 180);
        let mut r = Record::new(1);
        let now = 1_000_000;
        // The provider says 7200 a minute: 120 a second.
        let f = told(60_000, &cap, &mut r, &said(Some(7200), None), now, now);
        assert!(f.changed);
        assert_eq!((r.learned_limit, r.learned_until_ms), (120, now + 60_000));
        assert_eq!(limit_in_force(&r, 200, 30_000, now + 59_999), 120);
        assert_eq!(
            limit_in_force(&r, 200, 30_000, now + 75_000),
            160,
            "half way up"
        );
        assert_eq!(limit_in_force(&r, 200, 30_000, now + 90_000), 200);
        // Stated again within the second: nothing to write.
        let again = told(
            60_000,
            &cap,
            &mut r,
            &said(Some(7200), None),
            now,
            now + 500,
        );
        assert!(!again.changed);
        // The burst follows the limit.
        match policy_in_force(&cap, &r, &share(), now) {
            Policy::Gcra(p) => assert_eq!((p.limit, p.burst), (120, 108)),
            p => panic!("{p:?}"),
        }
        // Admissions over 20 s: 120 a second, not 200.
        let n = admitted(&cap, &mut r, now, 20, 300);
        assert!((2_380..=2_420).contains(&n), "{n}");
    }

    #[test]
    fn a_stated_limit_never_raises_the_capacity() {
        let cap = bucket(200, 180);
        let mut r = Record::new(1);
        let f = told(1000, &cap, &mut r, &said(Some(10_000), None), 0, 0);
        assert!(!f.changed);
        assert_eq!(r.learned_limit, 0);
        assert_eq!(policy_in_force(&cap, &r, &share(), 0), cap);
        // A huge or zero limit: above, or clamped to one.
        let f = told(1000, &cap, &mut r, &said(Some(u64::MAX), None), 0, 0);
        assert!(!f.changed);
        told(1000, &cap, &mut r, &said(Some(0), None), 0, 0);
        assert_eq!(
            limit_in_force(&r, 200, 30_000, 0),
            1,
            "a limit of 0 holds one a window"
        );
    }

    #[test]
    fn a_lower_remaining_is_counted_but_an_answer_s_age_is_forgiven() {
        let cap = bucket(200, 180);
        let mut r = Record::new(1);
        let now = 5_000_000;
        // Nothing used: 180 remain here. The provider says 100 remain, 2 ms after admission.
        let f = told(1000, &cap, &mut r, &said(None, Some(100)), now - 2, now);
        // 180 - (100 + 200·2/1000 + 1) = 79.
        assert_eq!(f.synced, 79);
        let left = cap.decide(r.capacity.as_ref(), now, 0).0.remaining;
        assert_eq!(left, 101);
        // An answer a second old saying less: forgiven within what refilled since.
        let mut r2 = Record::new(1);
        let f = told(1000, &cap, &mut r2, &said(None, Some(0)), now - 1000, now);
        assert_eq!(f.synced, 0, "{f:?}");
        // The provider's window is not the rule's: its remaining is another quantity.
        let mut r3 = Record::new(1);
        let f = told(60_000, &cap, &mut r3, &said(None, Some(0)), now, now);
        assert_eq!(f.synced, 0);
    }

    #[test]
    fn a_provider_refusal_blocks_for_its_wait_at_most_max_block() {
        let cap = bucket(200, 180);
        let mut r = Record::new(1);
        let now = 9_000_000;
        let refused = Answer {
            refused: true,
            retry_after_ms: Some(2_000),
            ..Answer::default()
        };
        let f = told(1000, &cap, &mut r, &refused, now, now);
        assert!(f.changed);
        assert_eq!(r.blocked_until_ms, now + 2_000);
        assert_eq!(
            r.learned_limit, 0,
            "nothing used: the limit is not the cause"
        );
        let d = ask(&cap, &mut r, None, now + 500);
        assert!(!d.verdict.allowed);
        assert_eq!(d.refused, Some(Reason::Capacity));
        assert_eq!(d.verdict.retry_after_ms, 1_500);
        // An hour asked: max_block.
        let long = Answer {
            refused: true,
            retry_after_ms: Some(3_600_000),
            ..Answer::default()
        };
        told(1000, &cap, &mut r, &long, now, now);
        assert_eq!(r.blocked_until_ms, now + 5_000);
        let d = ask(&cap, &mut r, None, now + 5_000);
        assert!(d.verdict.allowed, "the block ends");
    }

    #[test]
    fn a_refusal_at_high_use_lowers_the_limit_to_what_was_used() {
        let cap = bucket(200, 180);
        let mut r = Record::new(1);
        let now = 20_000_000;
        let n = admitted(&cap, &mut r, now - 1000, 1, 180);
        assert_eq!(n, 180);
        let refused = Answer {
            refused: true,
            ..Answer::default()
        };
        told(1000, &cap, &mut r, &refused, now, now);
        assert_eq!(r.blocked_until_ms, now + 1000, "no wait said: a second");
        assert_eq!(r.learned_limit, 162, "90 % of the 180 used");
        // The next answers state a higher limit: the lower one holds its time, then the stated
        // one is taken.
        told(1000, &cap, &mut r, &said(Some(190), None), now, now + 10);
        assert_eq!((r.learned_limit, r.learned_until_ms), (162, now + 60_000));
        let later = now + 60_000;
        told(1000, &cap, &mut r, &said(Some(190), None), later, later);
        assert_eq!(r.learned_limit, 190);
        // Fair across a fleet, what this Envoy used is its part of what the provider counted:
        // the refusal blocks as before and lowers nothing, and a remaining is not charged.
        let mut r = Record::new(1);
        admitted(&cap, &mut r, now - 1000, 1, 180);
        let f = fold(
            &learn(1000),
            &share(),
            &cap,
            &mut r,
            &refused,
            (now, now),
            true,
        );
        assert!(f.changed);
        assert_eq!((r.blocked_until_ms, r.learned_limit), (now + 1000, 0));
        let low = said(Some(200), Some(3));
        let f = fold(&learn(1000), &share(), &cap, &mut r, &low, (now, now), true);
        assert_eq!((f.synced, r.learned_limit), (0, 0));
    }

    #[test]
    fn the_record_keeps_what_was_learned() {
        let mut r = Record::new(2);
        r.learned_limit = 120;
        r.learned_until_ms = 77;
        r.blocked_until_ms = 99;
        assert_eq!(Record::decode(&r.encode()), Some(r));
    }
}
