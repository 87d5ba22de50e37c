//! Elastic limits: a rule's limit follows the health of the backend it protects.
//!
//! The filter watches the responses to a rule's own traffic. A response is **bad** if it is a
//! 5xx, a 429 from upstream, or slower than the rule's latency target (measured from the
//! request's admission to its response headers). Every worker adds what it saw to one shared
//! [`Health`] per rule, a sliding window of two buckets (like the sliding window counter), and
//! once a second one of them moves the rule's factor, its limit in force divided by its base
//! limit, by this law:
//!
//! - the bad share over the window at or above `max_bad_share`: the factor drops to `floor` at
//!   once (the base limit, unless a lower floor is set);
//! - below half of it: the factor climbs toward `ceiling`, by `(ceiling − floor)` per `ramp`;
//! - in between, or with fewer than [`MIN_SAMPLES`] responses in the window: it holds.
//!
//! The band between half the threshold and the threshold is the hysteresis that keeps a steady
//! bad share near the threshold from flapping: once dropped, the factor climbs again only when
//! the backend is clearly healthy. Factors are in permille, so the arithmetic is exact integers.

use crate::limiter::codec::{Reader, Writer};

/// The factor of a limit at its base, permille.
pub const BASE: u32 = 1000;
/// Fewer responses than this in the window: not enough to judge, the factor holds.
pub const MIN_SAMPLES: u64 = 10;
/// How often the factor may move, ms (all workers together).
pub const STEP_MS: u64 = 1000;

/// An elastic rule's control parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// The highest factor, reached while the backend is healthy, permille (≥ 1000).
    pub ceiling: u32,
    /// The factor when the backend struggles, permille (≤ 1000).
    pub floor: u32,
    /// The bad share at which the backend struggles, permille (1–999).
    pub max_bad: u32,
    /// A response slower than this is bad; `None`: latency is not judged.
    pub latency_ms: Option<u32>,
    /// The window the bad share is measured over, ms.
    pub window_ms: u32,
    /// The time to climb from `floor` to `ceiling`, ms.
    pub ramp_ms: u32,
}

impl Params {
    /// Whether a response is bad for the backend's health: a 5xx, a 429 that the upstream sent
    /// (this filter's own refusals never reach here), or slower than the target.
    pub fn is_bad(&self, status: u16, latency_ms: u64) -> bool {
        status >= 500
            || status == 429
            || self
                .latency_ms
                .is_some_and(|target| latency_ms > u64::from(target))
    }
}

/// The length of each of the health's two buckets, ms: a window, like the sliding window
/// counter's.
fn bucket_ms(window_ms: u32) -> u64 {
    u64::from(window_ms).max(1)
}

/// The shared health of one rule: 40 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Health {
    /// The start of the bucket holding the latest responses, ms since the epoch.
    pub bucket_ms: u64,
    /// Responses and bad responses in that bucket.
    pub total: u32,
    /// See `total`.
    pub bad: u32,
    /// Responses and bad responses in the bucket before.
    pub prev_total: u32,
    /// See `prev_total`.
    pub prev_bad: u32,
    /// The factor in force, permille.
    pub factor: u32,
    /// When the factor last moved (or held), ms since the epoch.
    pub step_ms: u64,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            bucket_ms: 0,
            total: 0,
            bad: 0,
            prev_total: 0,
            prev_bad: 0,
            factor: BASE,
            step_ms: 0,
        }
    }
}

/// The encoded length of [`Health`].
pub const HEALTH_LEN: usize = 36;

impl Health {
    /// Fixed-width little-endian encoding.
    pub fn encode(&self) -> [u8; HEALTH_LEN] {
        Writer::new()
            .u64(self.bucket_ms)
            .u32(self.total)
            .u32(self.bad)
            .u32(self.prev_total)
            .u32(self.prev_bad)
            .u32(self.factor)
            .u64(self.step_ms)
            .finish()
    }

    /// Decodes [`Health::encode`]'s output; `None` for anything else.
    pub fn decode(bytes: &[u8]) -> Option<Health> {
        let mut r = Reader(bytes);
        let h = Health {
            bucket_ms: r.u64()?,
            total: r.u32()?,
            bad: r.u32()?,
            prev_total: r.u32()?,
            prev_bad: r.u32()?,
            factor: r.u32()?,
            step_ms: r.u64()?,
        };
        r.end().map(|()| h)
    }

    /// Moves the buckets to the one holding `now_ms` (buckets are a window long, aligned to the
    /// epoch, like the sliding window counter's).
    fn roll(&mut self, now_ms: u64, window_ms: u32) {
        let len = bucket_ms(window_ms);
        let now = now_ms.max(self.bucket_ms);
        let (this, then) = (now / len, self.bucket_ms / len);
        if this == then.saturating_add(1) {
            self.prev_total = self.total;
            self.prev_bad = self.bad;
        } else if this != then {
            self.prev_total = 0;
            self.prev_bad = 0;
        }
        if this != then {
            self.total = 0;
            self.bad = 0;
            self.bucket_ms = this * len;
        }
    }

    /// Adds what a worker saw since it last reported.
    pub fn add(&mut self, now_ms: u64, p: &Params, total: u64, bad: u64) {
        self.roll(now_ms, p.window_ms);
        let sat = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        self.total = self.total.saturating_add(sat(total));
        self.bad = self.bad.saturating_add(sat(bad));
    }

    /// The responses and bad responses in the window ending at `now_ms`, the older bucket
    /// weighed by how much of it is still inside (scaled by the bucket length).
    fn window(&self, now_ms: u64, window_ms: u32) -> (u64, u64) {
        let mut h = *self;
        h.roll(now_ms, window_ms);
        let len = bucket_ms(window_ms);
        let left = len - now_ms.max(h.bucket_ms) % len;
        let weigh = |cur: u32, prev: u32| u64::from(cur) * len + u64::from(prev) * left;
        (weigh(h.total, h.prev_total), weigh(h.bad, h.prev_bad))
    }

    /// The bad share over the window, permille; `None` with too few responses to judge.
    pub fn bad_share(&self, now_ms: u64, window_ms: u32) -> Option<u32> {
        let (total, bad) = self.window(now_ms, window_ms);
        let len = bucket_ms(window_ms);
        if total < MIN_SAMPLES * len {
            return None;
        }
        u32::try_from(bad * 1000 / total).ok()
    }

    /// Moves the factor by the control law if a step is due at `now_ms`; returns whether a
    /// step was taken (the caller stores the health back).
    pub fn step(&mut self, now_ms: u64, p: &Params) -> bool {
        if now_ms < self.step_ms.saturating_add(STEP_MS) {
            return false;
        }
        let elapsed = if self.step_ms == 0 {
            STEP_MS
        } else {
            (now_ms - self.step_ms).min(u64::from(p.ramp_ms))
        };
        self.step_ms = now_ms;
        let factor = self.factor.clamp(p.floor, p.ceiling);
        self.factor = match self.bad_share(now_ms, p.window_ms) {
            Some(share) if share >= p.max_bad => p.floor,
            Some(share) if share * 2 < p.max_bad => {
                let span = u64::from(p.ceiling - p.floor);
                let climb = span * elapsed / u64::from(p.ramp_ms.max(1));
                let up = u64::from(factor) + climb.max(1);
                u32::try_from(up).unwrap_or(u32::MAX).min(p.ceiling)
            }
            _ => factor,
        };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Params = Params {
        ceiling: 2000,
        floor: 1000,
        max_bad: 100,
        latency_ms: Some(300),
        window_ms: 10_000,
        ramp_ms: 10_000,
    };

    /// Feeds `per_s` responses a second, `bad_pm` permille of them bad, for `seconds`, stepping
    /// every second as the workers would; returns the factor after each second.
    fn run(h: &mut Health, t: &mut u64, seconds: u64, per_s: u64, bad_pm: u64) -> Vec<u32> {
        let mut out = Vec::new();
        let mut owed = 0; // bad responses carried over, so the share is exact on average
        for _ in 0..seconds {
            owed += per_s * bad_pm;
            let bad = owed / 1000;
            owed %= 1000;
            for i in 0..10u64 {
                // Ten reports a second, as ten flushes from workers.
                let share = |n: u64| n / 10 + u64::from(i < n % 10);
                h.add(*t + i * 100, &P, share(per_s), share(bad));
            }
            *t += 1000;
            h.step(*t, &P);
            out.push(h.factor);
        }
        out
    }

    #[test]
    fn healthy_climbs_to_the_ceiling_then_a_failure_drops_to_the_floor() {
        let mut h = Health::default();
        let mut t = 1_000_000;
        let f = run(&mut h, &mut t, 14, 100, 0);
        // Not enough responses in the first second's window? 100 are: it climbs 10 % a second.
        assert_eq!(f[..3], [1100, 1200, 1300]);
        assert_eq!(*f.last().unwrap(), 2000, "{f:?}");
        // The backend fails completely: the share crosses 10 % within the second.
        let f = run(&mut h, &mut t, 3, 100, 1000);
        assert_eq!(f, [1000, 1000, 1000]);
        // Healed: the window (10 s) must forget the failure (share under 5 %) before it
        // climbs: about a window later (a true 10 s window would take 9.5 s).
        let f = run(&mut h, &mut t, 30, 100, 0);
        let first_up = f.iter().position(|&x| x > 1000).unwrap();
        assert!((9..=13).contains(&first_up), "{f:?}");
        assert_eq!(*f.last().unwrap(), 2000);
    }

    #[test]
    fn a_steady_share_near_the_threshold_does_not_flap() {
        for bad_pm in [60, 90, 100, 110, 140] {
            let mut h = Health::default();
            let mut t = 5_000_000;
            run(&mut h, &mut t, 15, 200, 0); // at the ceiling
            let f = run(&mut h, &mut t, 60, 200, bad_pm);
            // Once down, it never goes back up while the share stays in the band or above.
            let down = f.iter().position(|&x| x == 1000);
            if let Some(d) = down {
                assert!(f[d..].iter().all(|&x| x == 1000), "{bad_pm}: {f:?}");
            }
            if bad_pm >= 100 {
                assert!(down.is_some(), "{bad_pm}: never dropped: {f:?}");
            }
            let rises = f.windows(2).filter(|w| w[1] > w[0]).count();
            assert_eq!(rises, 0, "{bad_pm}: {f:?}");
        }
    }

    #[test]
    fn too_few_responses_hold_and_the_floor_and_latency_apply() {
        let p = Params { floor: 500, ..P };
        let mut h = Health::default();
        h.add(1_000, &p, 5, 5);
        assert!(h.step(2_000, &p));
        assert_eq!(h.factor, 1000, "5 responses: not judged");
        assert!(!h.step(2_500, &p), "one step a second");
        h.add(2_600, &p, 50, 50);
        assert!(h.step(3_000, &p));
        assert_eq!(h.factor, 500, "down to the floor");
        assert!(P.is_bad(503, 0) && P.is_bad(429, 0) && P.is_bad(200, 301));
        assert!(!P.is_bad(200, 300) && !P.is_bad(404, 0));
        let no_latency = Params {
            latency_ms: None,
            ..P
        };
        assert!(!no_latency.is_bad(200, 60_000));
        assert_eq!(Health::decode(&h.encode()), Some(h));
        assert_eq!(Health::decode(&[1, 2]), None);
    }
}
