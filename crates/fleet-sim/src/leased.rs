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

use crate::lease_model::LeaseFigures;
use crate::share::{Figures, Study};
use serde_json::{json, Value};
use std::fmt::Write as _;

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
            crate::share::Split::Leased(cap)
            | crate::share::Split::Fair(cap)
            | crate::share::Split::Runtime(cap) => cap.label(),
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
    use crate::lease_model::{Service, WINDOW_MS};
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
