//! The sweep `make fleet` runs: every mode, flush interval and block size, for fleets of 3 to
//! 100 proxies, under each traffic pattern and service round trip; its tables (markdown) and
//! its figures (JSON). And the two runs that model measured Envoy tests, for the comparison.

use crate::fleet::{run, Error, Load, Mode, Outcome, Scenario};
use crate::traffic::Traffic;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A traffic pattern and the limit of each of its keys.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pattern {
    /// The keys requests are for.
    pub traffic: Traffic,
    /// Each key's limit per window.
    pub limit: u64,
}

/// A sweep: every combination of its lists.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    /// Fleet sizes.
    pub proxies: Vec<usize>,
    /// Service round trips, ms.
    pub latencies_ms: Vec<u64>,
    /// Traffic patterns.
    pub patterns: Vec<Pattern>,
    /// The fleet's request rate (Poisson), spread evenly over the proxies.
    pub fleet_per_s: f64,
    /// How long requests come, ms.
    pub duration_ms: u64,
    /// The window of every limit, s.
    pub window_s: u64,
    /// Async flush intervals, ms.
    pub async_flush_ms: Vec<u32>,
    /// Lease runs: (flush_ms, max_block as the limit divided by this: `None`, the default, a
    /// tenth of the limit).
    pub lease: Vec<(u32, Option<u64>)>,
    /// The seed of every run.
    pub seed: u64,
}

impl Sweep {
    /// The default sweep (`make fleet`): 200 requests a second to the fleet for two and a half
    /// minutes ([`Sweep::at_rate`]).
    pub fn standard() -> Sweep {
        Sweep::at_rate(200.0)
    }

    /// The default sweep at `fleet_per_s` requests a second to the fleet, limits a minute at
    /// half the demand: one hot key (at 200 requests a second, a limit of 6,000), 20 keys
    /// (300 each); and a Zipf(1.0) spread over 100 keys (300 each: 7 keys over their limit,
    /// the hottest 7.7 times).
    pub fn at_rate(fleet_per_s: f64) -> Sweep {
        let limit = |per_key_per_s: f64| ((per_key_per_s * 60.0 / 2.0).round() as u64).max(1);
        Sweep {
            proxies: vec![3, 10, 30, 100],
            latencies_ms: vec![1, 10],
            patterns: vec![
                Pattern {
                    traffic: Traffic::Hot,
                    limit: limit(fleet_per_s),
                },
                Pattern {
                    traffic: Traffic::Uniform { keys: 20 },
                    limit: limit(fleet_per_s / 20.0),
                },
                Pattern {
                    traffic: Traffic::Zipf { keys: 100, s: 1.0 },
                    limit: limit(fleet_per_s / 20.0),
                },
            ],
            fleet_per_s,
            duration_ms: 150_000,
            window_s: 60,
            async_flush_ms: vec![10, 50, 100, 500],
            lease: vec![
                (100, Some(100)),
                (100, None),
                (100, Some(1)),
                (10, None),
                (500, None),
            ],
            seed: 1,
        }
    }

    /// A small sweep for tests (`--quick`): 3 and 10 proxies, the hot key and Zipf, a minute and
    /// ten seconds.
    pub fn quick() -> Sweep {
        let standard = Sweep::standard();
        Sweep {
            proxies: vec![3, 10],
            patterns: standard
                .patterns
                .iter()
                .copied()
                .filter(|p| !matches!(p.traffic, Traffic::Uniform { .. }))
                .collect(),
            duration_ms: 70_000,
            async_flush_ms: vec![50],
            lease: vec![(100, Some(100)), (100, None)],
            ..standard
        }
    }

    /// The modes of a pattern of `limit`: local, sync, each async flush, each lease.
    pub fn modes(&self, limit: u64) -> Vec<Mode> {
        let mut modes = vec![Mode::Local, Mode::Sync];
        modes.extend(
            self.async_flush_ms
                .iter()
                .map(|&flush_ms| Mode::Async { flush_ms }),
        );
        modes.extend(self.lease.iter().map(|&(flush_ms, fraction)| Mode::Lease {
            flush_ms,
            max_block: fraction.map(|d| (limit / d.max(1)).max(1)),
        }));
        modes
    }

    /// Every scenario of the sweep, in table order.
    pub fn scenarios(&self) -> Vec<Scenario> {
        let mut out = Vec::new();
        for p in &self.patterns {
            for &latency_ms in &self.latencies_ms {
                for mode in self.modes(p.limit) {
                    for &proxies in &self.proxies {
                        out.push(Scenario {
                            proxies,
                            mode,
                            traffic: p.traffic,
                            load: Load::Poisson {
                                per_s: self.fleet_per_s,
                            },
                            limit: p.limit,
                            window_s: self.window_s,
                            latency_us: latency_ms * 1000,
                            duration_ms: self.duration_ms,
                            seed: self.seed,
                        });
                    }
                }
            }
        }
        out
    }
}

/// A scenario and what it measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The run.
    pub scenario: Scenario,
    /// Its figures.
    pub outcome: Outcome,
}

/// Runs `scenarios` on `threads` threads; the rows in the scenarios' order.
pub fn run_all(scenarios: &[Scenario], threads: usize) -> Result<Vec<Row>, Error> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Outcome, Error>>>> =
        Mutex::new(scenarios.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(s) = scenarios.get(i) else {
                    return;
                };
                let outcome = run(s);
                let mut r = results
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(slot) = r.get_mut(i) {
                    *slot = Some(outcome);
                }
            });
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    scenarios
        .iter()
        .zip(results)
        .map(|(s, r)| {
            let outcome = r.unwrap_or_else(|| Err(Error("not run".into())))?;
            Ok(Row {
                scenario: s.clone(),
                outcome,
            })
        })
        .collect()
}

/// One cell of the tables: over-admission, under-admission (% of what an exact limiter
/// admits) and service calls per 100 requests.
fn cell(o: &Outcome) -> String {
    format!(
        "{} / {} / {}",
        pct(o.over_pct()),
        pct(o.under_pct()),
        figure(o.calls_per_100())
    )
}

fn pct(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x < 0.005 {
        "<0.01".into()
    } else {
        figure(x)
    }
}

/// A figure with up to 3 significant digits, at most 2 decimals.
fn figure(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// The sweep's tables: one per traffic pattern and round trip, a row per mode, a column per
/// fleet size, and the p99 of the wait added to requests.
pub fn markdown(sweep: &Sweep, rows: &[Row]) -> String {
    let mut out = String::new();
    for p in &sweep.patterns {
        for &latency_ms in &sweep.latencies_ms {
            let _ = writeln!(
                out,
                "**{}**, limit {} a {} per key, round trip {latency_ms} ms: over % / under % / calls per 100 requests\n",
                describe(&p.traffic),
                ratelimit_config::replay::report::thousands(p.limit),
                unit(sweep.window_s)
            );
            let sizes: Vec<String> = sweep
                .proxies
                .iter()
                .map(|n| format!("{n} proxies"))
                .collect();
            let _ = writeln!(out, "| mode | {} | p99 wait, ms |", sizes.join(" | "));
            let _ = writeln!(out, "|---|{}---|", "---|".repeat(sweep.proxies.len()));
            for mode in sweep.modes(p.limit) {
                let these: Vec<&Row> = sweep
                    .proxies
                    .iter()
                    .filter_map(|&n| {
                        rows.iter().find(|r| {
                            r.scenario.traffic == p.traffic
                                && r.scenario.mode == mode
                                && r.scenario.proxies == n
                                && r.scenario.latency_us == latency_ms * 1000
                        })
                    })
                    .collect();
                let cells: Vec<String> = these.iter().map(|r| cell(&r.outcome)).collect();
                let waits: Vec<String> = these
                    .iter()
                    .map(|r| format!("{}", r.outcome.p99_wait_us as f64 / 1000.0))
                    .collect();
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    mode.describe(p.limit),
                    cells.join(" | "),
                    waits.join(", ")
                );
            }
            out.push('\n');
        }
    }
    out
}

fn describe(t: &Traffic) -> String {
    match *t {
        Traffic::Hot => "One hot key".into(),
        Traffic::Uniform { keys } => format!("Uniform over {keys} keys"),
        Traffic::Zipf { keys, s } => format!("Zipf({s:.1}) over {keys} keys"),
    }
}

fn unit(window_s: u64) -> &'static str {
    match window_s {
        1 => "second",
        60 => "minute",
        3_600 => "hour",
        _ => "day",
    }
}

/// A run's figures as JSON.
pub fn row_json(r: &Row) -> Value {
    let (s, o) = (&r.scenario, &r.outcome);
    let (flush_ms, max_block) = match s.mode {
        Mode::Async { flush_ms } => (Some(flush_ms), None),
        Mode::Lease {
            flush_ms,
            max_block,
        } => (
            Some(flush_ms),
            Some(max_block.unwrap_or((s.limit / 10).max(1))),
        ),
        _ => (None, None),
    };
    let mode = match s.mode {
        Mode::Local => "local",
        Mode::Sync => "sync",
        Mode::Async { .. } => "async",
        Mode::Lease { .. } => "lease",
    };
    json!({
        "proxies": s.proxies,
        "mode": mode,
        "flush_ms": flush_ms,
        "max_block": max_block,
        "traffic": s.traffic.label(),
        "limit": s.limit,
        "window_s": s.window_s,
        "round_trip_ms": s.latency_us as f64 / 1000.0,
        "duration_ms": s.duration_ms,
        "seed": s.seed,
        "offered": o.offered,
        "admitted": o.admitted,
        "calls": o.calls,
        "calls_per_100": o.calls_per_100(),
        "windows": o.accuracy.windows,
        "exact": o.accuracy.exact,
        "over": o.accuracy.over,
        "under": o.accuracy.under,
        "worst_window_over": o.accuracy.worst_over,
        "over_pct": o.over_pct(),
        "under_pct": o.under_pct(),
        "waited": o.waited,
        "p99_wait_ms": o.p99_wait_us as f64 / 1000.0,
        "max_wait_ms": o.max_wait_us as f64 / 1000.0,
    })
}

/// A run modelling a measured Envoy test, and what the test measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// What is modelled.
    pub name: &'static str,
    /// What the Envoy test measured.
    pub measured: &'static str,
    /// The model's run.
    pub scenario: Scenario,
}

/// The measured 3-proxy runs, modelled: `global.rs`'s lease test (3 proxies of 2 workers, two
/// clients each at full speed, one key, 300 a minute, flush 20 ms, for 3 s) at a few request
/// times and round trips, and its async test (2 proxies offered 100 requests a second each,
/// flush 20 ms, 100 a minute, for 3 s).
pub fn comparisons() -> Vec<Comparison> {
    let lease = |think_us: u64, latency_us: u64| Comparison {
        name: "lease, 3 proxies at full speed",
        measured: "300 admitted, 21 claims (7.0 per 100 admitted) native; 24 (8.0) wasm",
        scenario: Scenario {
            proxies: 3,
            mode: Mode::Lease {
                flush_ms: 20,
                max_block: None,
            },
            traffic: Traffic::Hot,
            load: Load::Closed {
                clients: 2,
                think_us,
            },
            limit: 300,
            window_s: 60,
            latency_us,
            duration_ms: 3_000,
            seed: 1,
        },
    };
    let run_async = |latency_us: u64| Comparison {
        name: "async, 2 proxies at 100 requests/s each",
        measured: "106 admitted (6 over)",
        scenario: Scenario {
            proxies: 2,
            mode: Mode::Async { flush_ms: 20 },
            traffic: Traffic::Hot,
            load: Load::Paced { per_s_each: 100.0 },
            limit: 100,
            window_s: 60,
            latency_us,
            duration_ms: 3_000,
            seed: 1,
        },
    };
    vec![
        lease(200, 1_000),
        lease(500, 1_000),
        lease(500, 3_000),
        lease(2_000, 1_000),
        run_async(1_000),
        run_async(3_000),
        run_async(10_000),
    ]
}

/// How many seeds each comparison runs with (1 to this).
pub const COMPARISON_SEEDS: u64 = 10;

/// Each comparison's scenario under every seed, in order.
pub fn comparison_runs(comparisons: &[Comparison]) -> Vec<Scenario> {
    comparisons
        .iter()
        .flat_map(|c| {
            (1..=COMPARISON_SEEDS).map(|seed| Scenario {
                seed,
                ..c.scenario.clone()
            })
        })
        .collect()
}

/// "median (min–max)" of `values`, each with `decimals`.
fn spread(values: &mut [f64], decimals: usize) -> String {
    values.sort_by(f64::total_cmp);
    let (Some(lo), Some(hi)) = (values.first(), values.last()) else {
        return String::new();
    };
    let mid = values.get(values.len() / 2).copied().unwrap_or(*lo);
    format!("{mid:.decimals$} ({lo:.decimals$}–{hi:.decimals$})")
}

/// The comparisons' table: what each model run gives (median, and the range over
/// [`COMPARISON_SEEDS`] seeds) beside what Envoy measured.
pub fn comparison_markdown(runs: &[(Comparison, Vec<Outcome>)]) -> String {
    let mut out = String::from(
        "| setup | model: request time, round trip | model: admitted | model: calls | model: calls per 100 admitted | Envoy measured |\n|---|---|---|---|---|---|\n",
    );
    for (c, outcomes) in runs {
        let think = match c.scenario.load {
            Load::Closed { think_us, .. } => format!("{} ms", think_us as f64 / 1000.0),
            Load::Paced { per_s_each } => format!("every {} ms", 1000.0 / per_s_each),
            Load::Poisson { per_s } => format!("Poisson {per_s}/s"),
        };
        let mut admitted: Vec<f64> = outcomes.iter().map(|o| o.admitted as f64).collect();
        let mut calls: Vec<f64> = outcomes.iter().map(|o| o.calls as f64).collect();
        let mut per_100: Vec<f64> = outcomes
            .iter()
            .map(|o| o.calls as f64 * 100.0 / o.admitted.max(1) as f64)
            .collect();
        let _ = writeln!(
            out,
            "| {} | {think}, {} ms | {} | {} | {} | {} |",
            c.name,
            c.scenario.latency_us as f64 / 1000.0,
            spread(&mut admitted, 0),
            spread(&mut calls, 0),
            spread(&mut per_100, 1),
            c.measured
        );
    }
    out
}
