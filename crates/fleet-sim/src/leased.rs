//! A shared capacity leased for the whole fleet (`--share --lease`): the proxies claim the
//! capacity `C` in blocks from one rate limit service that counts it in fixed windows, and each
//! decides its requests with [`ratelimit_core::share::decide`] over the whole `C`, its tenants
//! sharing the part of it the proxy learned from the service's answers
//! ([`ratelimit_core::share::lease_answered`], applied inside `decide` from the record).
//!
//! A request `decide` admits must also be covered by quota the proxy holds; what it holds is
//! the core's own lease ([`ratelimit_core::limiter::lease::State`], as `Runtime` keeps it):
//! blocks of a power of two, doubled while claims come within a second, at most
//! [`Study::max_block`], no more than a quarter of what the service last said remained; a claim
//! ahead of need when what is held falls under half a block; a claim refused while some
//! remains made once more for a share of what remains; nothing held after a refusal with none
//! left until the window ends; what is held lapses at the window's end. A request the lease
//! refuses is given back to the share record ([`ratelimit_core::share::refund`]).
//!
//! Left out: the service answers at once (no round trip, no claim in flight while requests
//! come; a claim ahead of need is answered before the next request, where Envoy sends it at
//! its next tick), never fails and is one counter decided whole (no check-then-count race);
//! the proxies' clocks agree with it; each proxy is one worker (one record, one lease).

use crate::share::{Figures, Study};
use ratelimit_core::limiter::lease::{self, Grant, Peek, State};
use ratelimit_core::limiter::Windows;
use ratelimit_core::share::{self, Record};
use serde_json::{json, Value};
use std::fmt::Write as _;

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
}

impl Leases {
    /// `study`'s leases for `proxies` proxies, measured from `from_ms`.
    pub fn new(study: &Study, proxies: usize, from_ms: u64) -> Leases {
        Leases {
            service: Service::new(study.capacity, WINDOW_MS),
            limit: study.capacity,
            max_block: study.max_block(),
            held: vec![State::default(); proxies],
            from_ms,
            ran_out_window: None,
            cut_window: None,
            tally: LeaseFigures::default(),
        }
    }

    /// Whether what proxy `p` holds covers a request of cost 1 its `decide` admitted at
    /// `now_ms`, claiming from the service when it holds too little (or runs low); every
    /// answer is told to its share `record`. A refusal is counted (the caller gives the
    /// request back to the record).
    pub fn cover(&mut self, p: usize, record: &mut Record, now_ms: u64) -> bool {
        let Some(&s) = self.held.get(p) else {
            return false;
        };
        let cap = share::lease_block_cap(record.fleet.part_pm, self.limit, self.max_block);
        let (next, covered) = match State::peek(Some(&s), now_ms, 1, cap) {
            Peek::Covered { low } => {
                let windows = Windows::every(WINDOW_MS);
                let (_, taken) = lease::decide(Some(s), now_ms, self.limit, windows, 1);
                let taken = taken.unwrap_or(s);
                if low {
                    (self.claim(taken, record, now_ms, true).0, true)
                } else {
                    (taken, true)
                }
            }
            Peek::Refused => (s.at(now_ms), false),
            Peek::Claim => self.claim(s, record, now_ms, false),
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
    fn claim(&mut self, s: State, record: &mut Record, now_ms: u64, ahead: bool) -> (State, bool) {
        let cap = share::lease_block_cap(record.fleet.part_pm, self.limit, self.max_block);
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
            State::refused_claim(Some(&s), now_ms, a.end_ms, remaining, background)
        };
        let spent = !a.granted && a.remaining == 0;
        let granted = if a.granted { block } else { 0 };
        let before = record.fleet;
        share::lease_answered(
            record,
            (self.limit, WINDOW_MS),
            (granted, a.remaining, spent),
            (a.end_ms, now_ms),
        );
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

/// A study's run split statically and its run leased, each with its figures.
pub type Pair = ((Study, Figures), (Study, Figures));

fn leased(f: &Figures) -> LeaseFigures {
    f.lease.clone().unwrap_or_default()
}

fn fleet(s: &Study) -> String {
    if s.proxies == 1 {
        "1".into()
    } else {
        s.proxies.to_string()
    }
}

fn balancer(s: &Study) -> &'static str {
    if s.proxies == 1 {
        "—"
    } else {
        s.balancer.label()
    }
}

/// The lease's own columns: blocks, run out, cut on pace, lapsed, refused by the lease,
/// claims, parts, window peak.
fn lease_cells(s: &Study, f: &Figures) -> String {
    let l = leased(f);
    let c = s.capacity.max(1) as f64;
    let admitted: f64 = f.admitted.iter().sum::<f64>() * l.windows as f64;
    let lapsed = if l.granted > 0 {
        1.0 - admitted / l.granted as f64
    } else {
        0.0
    };
    let per_s = |n: u64| n as f64 / l.windows.max(1) as f64;
    let (sum, lo, hi) = l.parts();
    let blocks = (s.max_block() * s.proxies.max(1) as u64) as f64 / c;
    format!(
        "{blocks:.3} | {:.2} | {:.2} | {:.3} | {:.4} | {:.0} | {sum} ({lo}–{hi}) | {:.3}",
        l.ran_out_part(),
        l.cut_on_pace_part(),
        lapsed.max(0.0),
        per_s(l.refused) / c,
        per_s(l.claims),
        l.window_peak as f64 / c,
    )
}

/// The comparison's tables, one per mix: each row a static run and the leased run of the
/// same study (`runs`: pairs, in table order).
pub fn markdown(runs: &[Pair]) -> String {
    use crate::share::Mix;
    let mut out = String::new();
    for mix in Mix::ALL {
        let these: Vec<_> = runs.iter().filter(|((s, _), _)| s.mix == mix).collect();
        let Some(((first, _), (leased, _))) = these.first() else {
            continue;
        };
        let measured = format!(
            "seconds {}–{} measured",
            first.warmup_ms / 1000,
            first.duration_ms / 1000
        );
        let cap = match leased.split {
            crate::share::Split::Leased(cap) => cap.label(),
            crate::share::Split::Static => "?".into(),
        };
        let common = format!(
            "static: C/P a proxy (bucket 0.9 s of it), as `--share`; leased: every \
                      proxy decides over the whole C, each admission covered by quota claimed \
                      from one service of C per 1 s window in blocks of at most {cap}. \
                      P·block: the most the proxies' blocks together are, ÷ C; \
                      run out: the part of the windows in which the service refused a claim \
                      with nothing left; cut on pace: the part of the windows in which a proxy \
                      cut its part because the fleet's grants ran over 5 % ahead of an even \
                      pace, not on a refusal; lapsed: the part of the quota granted that was never \
                      used; lease ref.: requests the shares admitted that the lease refused, \
                      a second ÷ C; claims: calls to the service a second; parts: Σ of the \
                      proxies' learned parts at the end, ‰ (least–most; 0: never told); max \
                      window: the most admitted in one service window ÷ C (≤ 1 by \
                      construction)"
        );
        match mix {
            Mix::Backlogged => {
                let _ = writeln!(
                    out,
                    "**Backlogged, static vs leased**: every tenant asks 3× its share, weights \
                     from {{1, 2, 4}}; {measured}. {common}. used: admitted ÷ C; Jain of \
                     admitted ÷ weight; worst: the worst tenant's admitted ÷ its water-filling \
                     share\n"
                );
                out.push_str(
                    "| tenants | C /s | proxies | LB | used static | used leased | Jain static | Jain leased | worst static | worst leased | P·block | run out | cut on pace | lapsed | lease ref. | claims /s | parts ‰ | max window |\n\
                     |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
                );
                for ((s, a), (l, b)) in these {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.3} | {:.3} | {:.4} | {:.4} | {:.3} | {:.3} | {} |",
                        s.tenants,
                        s.capacity,
                        fleet(s),
                        balancer(s),
                        a.used(),
                        b.used(),
                        a.jain(),
                        b.jain(),
                        a.worst_of_ideal(),
                        b.worst_of_ideal(),
                        lease_cells(l, b),
                    );
                }
            }
            Mix::HeavyLights => {
                let _ = writeln!(
                    out,
                    "**One heavy tenant, the others light, static vs leased**: tenant 0 asks \
                     10× C/T, the others ½ C/T; {measured}. {common}. lights: the part of the \
                     light tenants given ≥ 99 % of their demand (the worst one's admitted ÷ \
                     demand); heavy: its admitted ÷ its water-filling share\n"
                );
                out.push_str(
                    "| tenants | C /s | proxies | LB | used static | used leased | lights static | lights leased | heavy static | heavy leased | P·block | run out | cut on pace | lapsed | lease ref. | claims /s | parts ‰ | max window |\n\
                     |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
                );
                for ((s, a), (l, b)) in these {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} ({:.3}) | {:.3} ({:.3}) | {:.3} | {:.3} | {} |",
                        s.tenants,
                        s.capacity,
                        fleet(s),
                        balancer(s),
                        a.used(),
                        b.used(),
                        a.lights_served(),
                        a.worst_light(),
                        b.lights_served(),
                        b.worst_light(),
                        a.heavy_of_ideal(),
                        b.heavy_of_ideal(),
                        lease_cells(l, b),
                    );
                }
            }
        }
        out.push('\n');
    }
    out
}

/// A leased run's figures as JSON: [`crate::share::row_json`]'s, with the lease's.
pub fn row_json(s: &Study, f: &Figures) -> Value {
    let mut v = crate::share::row_json(s, f);
    let l = leased(f);
    let (sum, lo, hi) = l.parts();
    if let Value::Object(m) = &mut v {
        let extra = json!({
            "split": "leased",
            "max_block": s.max_block(),
            "cut_on_pace_windows": l.cut_on_pace,
            "windows": l.windows,
            "ran_out_windows": l.ran_out,
            "granted": l.granted,
            "claims": l.claims,
            "lease_refused": l.refused,
            "parts_pm_sum": sum,
            "parts_pm_min": lo,
            "parts_pm_max": hi,
            "window_peak": l.window_peak,
        });
        if let Value::Object(e) = extra {
            m.extend(e);
        }
    }
    v
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::share::{run, Balancer, BlockCap, Mix, Split};

    #[test]
    fn the_service_grants_whole_blocks_within_its_window_and_turns_with_it() {
        let mut s = Service::new(10, 1000);
        let a = s.claim(5_300, 6);
        assert_eq!((a.granted, a.remaining, a.end_ms), (true, 4, 6_000));
        let b = s.claim(5_900, 5);
        assert_eq!(
            (b.granted, b.remaining),
            (false, 4),
            "does not fit: refused"
        );
        assert!(s.claim(5_999, 4).granted);
        let c = s.claim(5_999, 1);
        assert_eq!((c.granted, c.remaining), (false, 0));
        let d = s.claim(6_000, 10);
        assert_eq!((d.granted, d.remaining, d.end_ms), (true, 0, 7_000));
    }

    fn leased(proxies: usize, tenants: usize, balancer: Balancer, mix: Mix) -> Study {
        Study {
            duration_ms: 12_000,
            warmup_ms: 2_000,
            split: Split::Leased(BlockCap::OfCapacity(40)),
            ..Study::new(proxies, tenants, balancer, mix)
        }
    }

    #[test]
    fn a_leased_fleet_never_admits_more_than_the_capacity_in_a_window() {
        let small_blocks = Split::Leased(BlockCap::PerProxy(40));
        for (s, runs_out) in [
            // Backlogged, blocks small enough for the fleet to use all of C: the quota runs out
            // in most windows, while what was held lapses at each window's end.
            (
                Study {
                    split: small_blocks,
                    ..leased(10, 10, Balancer::Random, Mix::Backlogged)
                },
                true,
            ),
            (
                Study {
                    split: small_blocks,
                    ..leased(10, 10, Balancer::Sticky, Mix::Backlogged)
                },
                true,
            ),
            (leased(10, 100, Balancer::Random, Mix::Backlogged), false),
            (leased(30, 10, Balancer::Sticky, Mix::HeavyLights), false),
            (leased(3, 100, Balancer::Skewed, Mix::HeavyLights), false),
        ] {
            let f = run(&s);
            let l = f.lease.clone().unwrap_or_default();
            for (k, w) in f.per_ms.chunks(WINDOW_MS as usize).enumerate() {
                let n: u64 = w.iter().map(|&n| u64::from(n)).sum();
                assert!(n <= s.capacity, "{s:?}: window {k} admitted {n}");
            }
            assert!(l.window_peak <= s.capacity && l.windows == 10);
            assert!(!runs_out || l.ran_out >= 5, "{s:?}: {l:?}");
            // What was admitted was granted (the measured part starts on a window's start).
            let admitted: f64 = f.admitted.iter().sum::<f64>() * l.windows as f64;
            assert!(admitted.round() as u64 <= l.granted, "{s:?}");
            assert!(f.used() > 0.5, "{s:?}: used {}", f.used());
            assert_eq!(l.parts_pm.len(), s.proxies);
        }
    }

    #[test]
    fn backlogged_tenants_run_the_fleets_quota_out_and_the_proxies_learn_parts() {
        let f = run(&leased(10, 100, Balancer::Random, Mix::Backlogged));
        let l = f.lease.clone().unwrap_or_default();
        assert!(l.ran_out > 0 || l.refused > 0, "{l:?}");
        let (sum, lo, _) = l.parts();
        assert!(lo > 0, "every proxy was told its part: {l:?}");
        assert!(
            (500..=2000).contains(&sum),
            "parts sum to about the whole: {l:?}"
        );
    }
}
