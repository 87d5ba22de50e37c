//! A shared capacity leased for the whole fleet and fair across it (`--share --fair`): each
//! study run twice with the same seed, leased as [`crate::leased`] runs it (each proxy sharing
//! the part it learned among the tenants it sees) and fair across the fleet
//! ([`ratelimit_core::share::fair`], modelled by [`crate::fair_model`]: each admission also
//! within the tenant's allowance on its proxy, learned from the fleet's counters in the same
//! service), side by side.
//!
//! The fair runs share the leased runs' loop ([`crate::share::run_with`]): the same `decide`
//! per proxy over the whole `C`, the same lease (blocks of at most the configured cap until a
//! proxy knows its part, then [`ratelimit_core::share::fair::block_cap`]), the same service.
//! A service call is a lease claim or a report that did not ride on one.

use crate::share::{fleet_capacity, Balancer, BlockCap, Figures, Mix, Split, Study};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The studies of the comparison: every fleet size, balancer and mix, each proxy's fair part
/// of the capacity about `per_proxy` requests a second.
#[derive(Clone, Debug, PartialEq)]
pub struct FairSweep {
    /// Fleet sizes.
    pub proxies: Vec<usize>,
    /// Tenant counts.
    pub tenants: Vec<usize>,
    /// Load balancers.
    pub balancers: Vec<Balancer>,
    /// Demand mixes.
    pub mixes: Vec<Mix>,
    /// The capacity a proxy, requests a second: `C` is this × the fleet's size (at least
    /// [`fleet_capacity`]).
    pub per_proxy: u64,
    /// The leased runs' block cap (and the fair runs' until a proxy knows its part).
    pub cap: BlockCap,
    /// How long requests come, ms.
    pub duration_ms: u64,
    /// The start left out of the figures, ms.
    pub warmup_ms: u64,
    /// The seed of every run.
    pub seed: u64,
    /// Each study as the model runs it fair and as the runtime does (`--runtime`), instead of
    /// leased and fair.
    pub runtime: bool,
}

impl FairSweep {
    /// The comparison of the issue: 3 to 1,000 proxies, 10 tenants, pinned, spread and one
    /// proxy taking 80 %, both mixes, 400 requests a second a proxy; 30 s, the first 10 left
    /// out.
    pub fn standard() -> FairSweep {
        FairSweep {
            proxies: vec![3, 10, 100, 1000],
            tenants: vec![10],
            balancers: vec![Balancer::Sticky, Balancer::Random, Balancer::Hot],
            mixes: vec![Mix::HeavyLights, Mix::Backlogged],
            per_proxy: 400,
            cap: BlockCap::OfCapacity(40),
            duration_ms: 30_000,
            warmup_ms: 10_000,
            seed: 1,
            runtime: false,
        }
    }

    /// The small one (`--quick`): 3 and 10 proxies.
    pub fn quick() -> FairSweep {
        FairSweep {
            proxies: vec![3, 10],
            ..FairSweep::standard()
        }
    }

    /// Every study twice, leased then fair (with [`FairSweep::runtime`]: fair as the model
    /// runs it, then as the runtime does), in table order (by mix, tenants, proxies,
    /// balancer).
    pub fn studies(&self) -> Vec<(Study, Study)> {
        let mut out = Vec::new();
        for &mix in &self.mixes {
            for &tenants in &self.tenants {
                for &proxies in &self.proxies {
                    for &balancer in &self.balancers {
                        let capacity = (self.per_proxy * proxies as u64)
                            .max(fleet_capacity(tenants))
                            .div_ceil(300)
                            * 300;
                        let base = Study {
                            capacity,
                            duration_ms: self.duration_ms,
                            warmup_ms: self.warmup_ms.min(self.duration_ms / 2),
                            seed: self.seed,
                            ..Study::new(proxies, tenants, balancer, mix)
                        };
                        let (first, second) = if self.runtime {
                            (Split::Fair(self.cap), Split::Runtime(self.cap))
                        } else {
                            (Split::Leased(self.cap), Split::Fair(self.cap))
                        };
                        out.push((
                            Study {
                                split: first,
                                ..base.clone()
                            },
                            Study {
                                split: second,
                                ..base
                            },
                        ));
                    }
                }
            }
        }
        out
    }
}

/// Runs `study` as its split says: through the runtime ([`crate::fair_runtime`]) or the model
/// ([`crate::share::run`]).
pub fn run(study: &Study) -> Figures {
    match study.split {
        Split::Runtime(_) => crate::fair_runtime::run(study),
        _ => crate::share::run(study),
    }
}

/// Service calls per 100 requests over the measured part: lease claims, and reports that did
/// not ride on one.
pub fn calls_per_100(f: &Figures) -> f64 {
    let claims = f.lease.as_ref().map_or(0, |l| l.claims);
    let reports = f
        .fair
        .as_ref()
        .map_or(0, |x| x.reports.saturating_sub(x.piggybacked));
    100.0 * (claims + reports) as f64 / f.requests.max(1) as f64
}

/// How a study's blocks are capped, as the tables name it (`C/40`).
fn blocks_of(s: &Study) -> String {
    match s.split {
        Split::Leased(c) | Split::Fair(c) | Split::Runtime(c) => c.label(),
        Split::Static => "–".into(),
    }
}

/// The most admitted in one service window ÷ C.
fn max_window(s: &Study, f: &Figures) -> f64 {
    f.lease.as_ref().map_or(0.0, |l| l.window_peak as f64) / s.capacity.max(1) as f64
}

/// A study's run leased and its run fair, each with its figures.
pub type Pair = ((Study, Figures), (Study, Figures));

/// The comparison's tables, one per mix.
pub fn markdown(runs: &[Pair]) -> String {
    let mut out = String::new();
    for mix in [Mix::HeavyLights, Mix::Backlogged] {
        let these: Vec<&Pair> = runs.iter().filter(|((s, _), _)| s.mix == mix).collect();
        let Some(((first, _), _)) = these.first() else {
            continue;
        };
        // Leased against fair, or the fair model against the runtime (`--runtime`).
        let (x, y, what) = if matches!(first.split, Split::Fair(_)) {
            (
                "model",
                "runtime",
                "fair across the fleet, the model vs the filter's runtime",
            )
        } else {
            ("leased", "fair", "leased vs fair across the fleet")
        };
        let _ = writeln!(
            out,
            "**{}, {what}** (seed {}; seconds {}–{} measured; C = {} \
             a second a proxy, at least 20 a tenant; blocks at most {}). used: \
             admitted ÷ C; {}; calls: service calls (claims, and reports not riding on one) \
             per 100 requests; max window: the most admitted in one service window ÷ C\n",
            match mix {
                Mix::HeavyLights => "One heavy tenant (10× C/T), the others light (½ C/T)",
                Mix::Backlogged => "Backlogged (3× its share each, weights from {1, 2, 4})",
            },
            first.seed,
            first.warmup_ms / 1000,
            first.duration_ms / 1000,
            first.capacity / first.proxies.max(1) as u64,
            blocks_of(first),
            match mix {
                Mix::HeavyLights => {
                    "lights: the part of the light tenants given ≥ 99 % of their demand (the \
                     worst one's admitted ÷ demand); heavy: its admitted ÷ its water-filling share"
                }
                Mix::Backlogged => {
                    "Jain: of admitted ÷ weight; worst: the worst tenant's admitted ÷ its \
                     water-filling share"
                }
            },
        );
        let (a, b) = match mix {
            Mix::HeavyLights => ("lights", "heavy"),
            Mix::Backlogged => ("Jain", "worst"),
        };
        let _ = writeln!(
            out,
            "| tenants | proxies | LB | C /s | used {x} | used {y} | {a} {x} | {a} {y} | \
             {b} {x} | {b} {y} | calls {x} | calls {y} | max window {x} | max window {y} |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for ((s, l), (_, f)) in these {
            let (a_l, a_f, b_l, b_f) = match mix {
                Mix::HeavyLights => (
                    format!("{:.3} ({:.3})", l.lights_served(), l.worst_light()),
                    format!("{:.3} ({:.3})", f.lights_served(), f.worst_light()),
                    format!("{:.3}", l.heavy_of_ideal()),
                    format!("{:.3}", f.heavy_of_ideal()),
                ),
                Mix::Backlogged => (
                    format!("{:.4}", l.jain()),
                    format!("{:.4}", f.jain()),
                    format!("{:.3}", l.worst_of_ideal()),
                    format!("{:.3}", f.worst_of_ideal()),
                ),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.3} | {:.3} | {a_l} | {a_f} | {b_l} | {b_f} | {:.2} | {:.2} | {:.3} | {:.3} |",
                s.tenants,
                s.proxies,
                s.balancer.label(),
                s.capacity,
                l.used(),
                f.used(),
                calls_per_100(l),
                calls_per_100(f),
                max_window(s, l),
                max_window(s, f),
            );
        }
        out.push('\n');
    }
    out
}

/// A pair's figures as JSON.
pub fn row_json(((s, l), (t, f)): &Pair) -> Value {
    let one = |s: &Study, f: &Figures| {
        let mut v = crate::leased::row_json(s, f);
        if let Value::Object(m) = &mut v {
            m.insert("calls_per_100".into(), json!(calls_per_100(f)));
            if let Some(x) = &f.fair {
                let split = match s.split {
                    Split::Runtime(_) => "runtime",
                    _ => "fair",
                };
                m.insert("split".into(), json!(split));
                m.insert("fair_reports".into(), json!(x.reports));
                m.insert("fair_piggybacked".into(), json!(x.piggybacked));
                m.insert("fair_descriptors".into(), json!(x.descriptors));
                m.insert("fair_refused".into(), json!(x.refused));
            }
        }
        v
    };
    match s.split {
        Split::Fair(_) => json!({ "model": one(s, l), "runtime": one(t, f) }),
        _ => json!({ "leased": one(s, l), "fair": one(t, f) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease_model::WINDOW_MS;

    fn sweep(proxies: Vec<usize>, balancers: Vec<Balancer>, seconds: u64) -> FairSweep {
        FairSweep {
            proxies,
            balancers,
            duration_ms: seconds * 1000,
            warmup_ms: 8_000,
            ..FairSweep::standard()
        }
    }

    /// The targets, held by a fair run: the capacity used ≥ 95 % and never more than
    /// `C` in a service window; backlogged tenants' Jain per unit of weight ≥ 0.99; every light
    /// tenant ≥ 99 % of its demand; ≤ 2 service calls per 100 requests.
    fn meets_the_targets(s: &Study, f: &Figures) {
        meets_the_shares(s, f);
        let calls = calls_per_100(f);
        assert!(calls <= 2.0, "{s:?}: {calls} calls per 100 requests");
    }

    /// [`meets_the_targets`] but the calls. The model's service windows are clock-aligned;
    /// the runtime's service starts them at their first hit, as limitador does, and says the
    /// most admitted in one ([`LeaseFigures::window_peak`](crate::lease_model::LeaseFigures)).
    fn meets_the_shares(s: &Study, f: &Figures) {
        assert!(f.used() >= 0.95, "{s:?}: used {}", f.used());
        if matches!(s.split, Split::Runtime(_)) {
            let peak = f.lease.as_ref().map_or(u64::MAX, |l| l.window_peak);
            assert!(peak <= s.capacity, "{s:?}: {peak} in one service window");
        } else {
            for (k, w) in f.per_ms.chunks(WINDOW_MS as usize).enumerate() {
                let n: u64 = w.iter().map(|&n| u64::from(n)).sum();
                assert!(n <= s.capacity, "{s:?}: window {k} admitted {n}");
            }
        }
        match s.mix {
            Mix::Backlogged => assert!(f.jain() >= 0.99, "{s:?}: Jain {}", f.jain()),
            Mix::HeavyLights => assert!(
                f.lights_served() >= 1.0,
                "{s:?}: lights {} (worst {})",
                f.lights_served(),
                f.worst_light()
            ),
        }
    }

    #[test]
    fn fair_across_the_fleet_pinned_spread_or_hot_meets_the_targets() {
        let all = vec![Balancer::Sticky, Balancer::Random, Balancer::Hot];
        for (leased, fair) in sweep(vec![3, 10], all, 20).studies() {
            let f = run(&fair);
            meets_the_targets(&fair, &f);
            // Pinned backlogged tenants: the leased fleet shares within each replica only.
            if fair.mix == Mix::Backlogged
                && fair.balancer == Balancer::Sticky
                && fair.proxies == 10
            {
                let l = run(&leased);
                assert!(
                    l.jain() < 0.9 && f.jain() > 0.999,
                    "{} vs {}",
                    l.jain(),
                    f.jain()
                );
            }
        }
    }

    #[test]
    fn a_hundred_proxies_fair_keep_the_lights_whole_and_use_the_capacity() {
        let two = vec![Balancer::Sticky, Balancer::Random];
        let s = FairSweep {
            mixes: vec![Mix::HeavyLights],
            ..sweep(vec![100], two, 14)
        };
        for (leased, fair) in s.studies() {
            let f = run(&fair);
            meets_the_targets(&fair, &f);
            let l = run(&leased);
            assert!(f.used() > l.used() || l.lights_served() < 1.0, "{fair:?}");
        }
    }

    /// The filter's own runtime fair across the fleet (every proxy a `Runtime`, a service
    /// counting as limitador does), on 3 and 10 proxies, pinned, spread and hot, both mixes:
    /// the shares and the capacity as the targets say; the calls ≤ 2 per 100 from 10 proxies.
    /// On 3, blocks of at most `C/40` bound them from below: a proxy admitting 390 a second
    /// claims at least 13 times a second, beside a heavy tenant (a third of the requests
    /// refused) 2.2 calls per 100 requests at the least; 3.3-3.4 measured, the blocks also
    /// shrinking with what a proxy expects until the window ends. With blocks of at most a
    /// tenth of the capacity (the configuration's default `max_block`), the target: 0.77-1.89
    /// (the figures on BENCHMARKS.md's fleet model).
    #[test]
    fn the_runtime_fair_across_the_fleet_meets_the_targets() {
        let all = vec![Balancer::Sticky, Balancer::Random, Balancer::Hot];
        let s = FairSweep {
            runtime: true,
            warmup_ms: 10_000,
            ..sweep(vec![3, 10], all, 30)
        };
        for (_, fair) in s.studies() {
            let f = run(&fair);
            if fair.proxies >= 10 {
                meets_the_targets(&fair, &f);
            } else {
                meets_the_shares(&fair, &f);
                assert!(calls_per_100(&f) <= 4.0, "{fair:?}: {}", calls_per_100(&f));
            }
        }
        // Blocks of at most a tenth of the capacity (the configuration's default `max_block`):
        // on three proxies, the shares, and at most 2 calls per 100 requests.
        let tenth = FairSweep {
            cap: BlockCap::OfCapacity(10),
            proxies: vec![3],
            ..s
        };
        for (_, fair) in tenth.studies() {
            let f = run(&fair);
            meets_the_shares(&fair, &f);
            assert!(calls_per_100(&f) <= 2.0, "{fair:?}: {}", calls_per_100(&f));
        }
    }

    /// A thousand tenants over 100 proxies beside a heavy one, spread at random: the demand
    /// is half the capacity, so each window ends with quota unused, and the blocks stay large
    /// to its end instead of halving (`share::fair::spare`), and each window's report rides
    /// on a claim ahead of need (`runtime::fleet`'s `REPORT_WAIT`): at most 2.3 calls per 100
    /// requests (2.10 with both, 2.07 while a proxy kept 64 of the tenants, 2.56 with the
    /// report alone at the window's first tick, 3.37 with neither), every tenant served.
    #[test]
    fn a_window_that_leaves_quota_unused_keeps_the_blocks_large() {
        let s = FairSweep {
            tenants: vec![1000],
            mixes: vec![Mix::HeavyLights],
            runtime: true,
            warmup_ms: 10_000,
            ..sweep(vec![100], vec![Balancer::Random], 20)
        };
        for (_, fair) in s.studies() {
            let f = run(&fair);
            assert!(f.lights_served() >= 1.0, "{}", f.worst_light());
            assert!((0.5..0.52).contains(&f.used()), "{}", f.used());
            let calls = calls_per_100(&f);
            assert!(calls <= 2.3, "{calls} calls per 100 requests");
        }
    }

    /// The same on 100 proxies, pinned and spread, beside a heavy tenant: every target.
    #[test]
    fn the_runtime_fair_across_a_hundred_proxies_meets_the_targets() {
        let two = vec![Balancer::Sticky, Balancer::Random];
        let s = FairSweep {
            mixes: vec![Mix::HeavyLights],
            runtime: true,
            ..sweep(vec![100], two, 14)
        };
        for (_, fair) in s.studies() {
            meets_the_targets(&fair, &run(&fair));
        }
    }

    /// A thousand backlogged tenants, 100 pinned to each of 10 proxies (more than the 64 an
    /// Envoy kept of a rule before): every one kept, the fleet's shares (Jain's index 0.9409
    /// and the worst tenant 0.703 of its share when 36 of each proxy's were shared locally;
    /// 1.0000 and 0.953, the model's, now). Spread at random over the 10 (each proxy sees all
    /// 1,000, keeps the 256 of the lowest ids, the same on every proxy): Jain ≥ 0.99 and
    /// ≤ 1 call per 100 requests (keeping whichever came first, 0.9950 and 5.4).
    #[test]
    fn a_thousand_tenants_pinned_are_all_kept_and_spread_the_same_ones_everywhere() {
        let s = FairSweep {
            tenants: vec![1000],
            mixes: vec![Mix::Backlogged],
            runtime: true,
            warmup_ms: 10_000,
            ..sweep(vec![10], vec![Balancer::Sticky, Balancer::Random], 30)
        };
        for (_, fair) in s.studies() {
            let f = run(&fair);
            meets_the_shares(&fair, &f);
            let calls = calls_per_100(&f);
            assert!(calls <= 1.0, "{fair:?}: {calls} calls per 100 requests");
            if fair.balancer == Balancer::Sticky {
                assert!(f.jain() >= 0.999, "{fair:?}: Jain {}", f.jain());
                let worst = f.worst_of_ideal();
                assert!(worst >= 0.95, "{fair:?}: the worst {worst}");
            }
        }
    }
}
