//! The leased model's moving parts (`--share --lease`): the rate limit service counting a
//! capacity in fixed windows, and each proxy's lease of it, driven as `Runtime` drives the
//! core's own lease state ([`ratelimit_core::limiter::lease::State`]), every answer told to the
//! proxy's share record ([`ratelimit_core::share::lease_answered`]). [`crate::leased`] runs and
//! reports them beside the static split.

use ratelimit_core::limiter::lease::{self, Grant, Peek, State};
use ratelimit_core::limiter::Windows;
use ratelimit_core::share::{self, Record};

/// The service's window, ms: the capacity is `C` a second.
pub const WINDOW_MS: u64 = 1000;

/// The rate limit service: one counter in fixed windows aligned on the clock (as
/// envoyproxy/ratelimit counts them), at most `limit` a window; each claim decided whole at
/// one instant, granted whole if it fits, else refused, saying what remains.
#[derive(Clone, Debug)]
pub struct Service {
    limit: u64,
    window_ms: u64,
    window: u64,
    count: u64,
}

/// The service's answer to one claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The block was granted (counted).
    pub granted: bool,
    /// What remains of the window's limit after the claim.
    pub remaining: u64,
    /// When the window ends, ms.
    pub end_ms: u64,
}

impl Service {
    /// A service of `limit` a window of `window_ms`.
    pub fn new(limit: u64, window_ms: u64) -> Service {
        Service {
            limit,
            window_ms: window_ms.max(1),
            window: u64::MAX,
            count: 0,
        }
    }

    /// A claim of `block` at `now_ms`.
    pub fn claim(&mut self, now_ms: u64, block: u64) -> Answer {
        let window = now_ms / self.window_ms;
        if window != self.window {
            self.window = window;
            self.count = 0;
        }
        let granted = self.count.saturating_add(block) <= self.limit;
        if granted {
            self.count += block;
        }
        Answer {
            granted,
            remaining: self.limit.saturating_sub(self.count),
            end_ms: window.saturating_add(1).saturating_mul(self.window_ms),
        }
    }
}

/// What the lease did over a run's measured part (its windows whole when the warm-up is a
/// whole number of seconds, as in every sweep: the measured part then starts on a window's
/// start).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeaseFigures {
    /// The service's windows measured.
    pub windows: u64,
    /// Windows in which the service refused a claim with nothing left (the fleet's quota ran
    /// out).
    pub ran_out: u64,
    /// Windows in which a proxy cut its part because the fleet's grants ran ahead of an even
    /// pace (past the window's middle, by over [`share::AHEAD_PM`]), not on a refusal.
    pub cut_on_pace: u64,
    /// Quota the service granted.
    pub granted: u64,
    /// Claims made (every call to the service).
    pub claims: u64,
    /// Requests `decide` admitted that the lease refused (given back to the share record).
    pub refused: u64,
    /// Each proxy's part of the capacity at the end, permille (0: never told).
    pub parts_pm: Vec<u16>,
    /// The most the fleet admitted in one of the service's windows, the whole run.
    pub window_peak: u64,
}

impl LeaseFigures {
    /// The part of the windows in which the fleet's quota ran out.
    pub fn ran_out_part(&self) -> f64 {
        self.ran_out as f64 / self.windows.max(1) as f64
    }

    /// The part of the windows in which a proxy cut its part on pace.
    pub fn cut_on_pace_part(&self) -> f64 {
        self.cut_on_pace as f64 / self.windows.max(1) as f64
    }

    /// The sum of the proxies' parts, and the least and most, permille.
    pub fn parts(&self) -> (u64, u16, u16) {
        let sum = self.parts_pm.iter().map(|&p| u64::from(p)).sum();
        let lo = self.parts_pm.iter().copied().min().unwrap_or(0);
        let hi = self.parts_pm.iter().copied().max().unwrap_or(0);
        (sum, lo, hi)
    }
}

/// The fleet's leases: the service, what each proxy holds of it, and the tally.
pub struct Leases {
    service: Service,
    limit: u64,
    max_block: u64,
    held: Vec<State>,
    /// Where the measured part starts, ms.
    from_ms: u64,
    /// The last window counted as run out, and as cut on pace.
    ran_out_window: Option<u64>,
    cut_window: Option<u64>,
    tally: LeaseFigures,
    /// Fair across the fleet ([`crate::fair`]): the share record is not told the service's
    /// answers (no part is learned), and the blocks are capped by the caller.
    fair: bool,
    /// Every claim made, the whole run.
    calls: u64,
}

impl Leases {
    /// What the service last told proxy `q` of its window (what remained, and when it ends),
    /// and when the claim it answered went.
    pub fn told(&self, q: usize) -> Option<(ratelimit_core::share::fair::Left, u64)> {
        let s = self.held.get(q)?;
        let left = ratelimit_core::share::fair::Left {
            units: u64::from(s.remaining),
            end_ms: s.expires_ms,
        };
        (s.claim_ms != 0).then_some((left, s.claim_ms))
    }

    /// The leases of a capacity of `capacity` a window claimed in blocks of at most
    /// `max_block`, for `proxies` proxies, measured from `from_ms`.
    pub fn new(capacity: u64, max_block: u64, proxies: usize, from_ms: u64) -> Leases {
        Leases {
            service: Service::new(capacity, WINDOW_MS),
            limit: capacity,
            max_block,
            held: vec![State::default(); proxies],
            from_ms,
            ran_out_window: None,
            cut_window: None,
            tally: LeaseFigures::default(),
            fair: false,
            calls: 0,
        }
    }

    /// The same leases for a fleet fair across its replicas ([`crate::fair`]): blocks capped
    /// by the caller, nothing told to the share records.
    pub fn fair(capacity: u64, max_block: u64, proxies: usize, from_ms: u64) -> Leases {
        Leases {
            fair: true,
            ..Leases::new(capacity, max_block, proxies, from_ms)
        }
    }

    /// Every claim made so far, the whole run.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Whether what proxy `p` holds covers a request of cost 1 its `decide` admitted at
    /// `now_ms`, claiming from the service when it holds too little (or runs low); every
    /// answer is told to its share `record`. A refusal is counted (the caller gives the
    /// request back to the record).
    pub fn cover(&mut self, p: usize, record: &mut Record, now_ms: u64) -> bool {
        self.cover_capped(p, record, now_ms, None)
    }

    /// [`Leases::cover`] with blocks of at most `cap` (`None`: as the share record's part
    /// says).
    pub fn cover_capped(
        &mut self,
        p: usize,
        record: &mut Record,
        now_ms: u64,
        cap: Option<u64>,
    ) -> bool {
        let Some(&s) = self.held.get(p) else {
            return false;
        };
        let cap = cap.unwrap_or_else(|| {
            share::lease_block_cap(record.fleet.part_pm, self.limit, self.max_block)
        });
        let (next, covered) = match State::peek(Some(&s), now_ms, 1, cap) {
            Peek::Covered { low } => {
                let windows = Windows::every(WINDOW_MS);
                let (_, taken) = lease::decide(Some(s), now_ms, self.limit, windows, 1);
                let taken = taken.unwrap_or(s);
                if low {
                    (self.claim(taken, record, now_ms, true, cap).0, true)
                } else {
                    (taken, true)
                }
            }
            Peek::Refused => (s.at(now_ms), false),
            Peek::Claim => self.claim(s, record, now_ms, false, cap),
        };
        if let Some(h) = self.held.get_mut(p) {
            *h = next;
        }
        if !covered && now_ms >= self.from_ms {
            self.tally.refused += 1;
        }
        covered
    }

    /// A claim from lease `s` at `now_ms`: `ahead` of need (nothing taken of the grant), or
    /// for the request at hand (one taken; refused while some remains, made once more for a
    /// share of what remains, as `Runtime::reclaim` does). The lease after it, and whether the
    /// request got its one.
    fn claim(
        &mut self,
        s: State,
        record: &mut Record,
        now_ms: u64,
        ahead: bool,
        cap: u64,
    ) -> (State, bool) {
        let (s, block) = s.at(now_ms).start_claim(now_ms, (cap, 1), ahead);
        let (s, granted) = self.ask(s, record, now_ms, block.max(1), ahead);
        if granted || ahead || s.refused || s.remaining == 0 {
            return (s, granted);
        }
        let block = lease::near_limit(u64::from(s.remaining), 1);
        self.ask(s, record, now_ms, block, false)
    }

    /// One call to the service for `block`; its answer written into the lease `s` and told to
    /// the share `record`.
    fn ask(
        &mut self,
        s: State,
        record: &mut Record,
        now_ms: u64,
        block: u64,
        background: bool,
    ) -> (State, bool) {
        let a = self.service.claim(now_ms, block);
        self.calls += 1;
        let remaining = u32::try_from(a.remaining).unwrap_or(u32::MAX);
        let next = if a.granted {
            let grant = Grant {
                block,
                taken: u64::from(!background),
                expires_ms: a.end_ms,
                remaining,
            };
            State::granted(Some(&s), now_ms, grant, background)
        } else {
            State::refused_claim(Some(&s), now_ms, a.end_ms, remaining, (background, false))
        };
        let spent = !a.granted && a.remaining == 0;
        let granted = if a.granted { block } else { 0 };
        let before = record.fleet;
        if !self.fair {
            share::lease_answered(
                record,
                (self.limit, WINDOW_MS),
                (granted, a.remaining, spent),
                (a.end_ms, now_ms),
            );
        }
        let f = record.fleet;
        let cut = f.spent && (!before.spent || before.window_end_ms != f.window_end_ms);
        if now_ms >= self.from_ms {
            self.tally.claims += 1;
            self.tally.granted += granted;
            let window = Some(now_ms / WINDOW_MS);
            if spent && self.ran_out_window != window {
                self.ran_out_window = window;
                self.tally.ran_out += 1;
            }
            if cut && !spent && self.cut_window != window {
                self.cut_window = window;
                self.tally.cut_on_pace += 1;
            }
        }
        (next, a.granted)
    }

    /// The figures, with the fleet's records (their parts), its admissions by millisecond
    /// (from a window's start), and the measured part's length.
    pub fn figures(self, records: &[&Record], per_ms: &[u32], measured_ms: u64) -> LeaseFigures {
        let window = usize::try_from(WINDOW_MS).unwrap_or(1);
        LeaseFigures {
            windows: measured_ms / WINDOW_MS,
            parts_pm: records.iter().map(|r| r.fleet.part_pm).collect(),
            window_peak: per_ms
                .chunks(window)
                .map(|w| w.iter().map(|&n| u64::from(n)).sum())
                .max()
                .unwrap_or(0),
            ..self.tally
        }
    }
}
