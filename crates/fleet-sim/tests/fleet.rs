//! The fleet model's small sweep (`Sweep::quick`: 3 and 10 proxies, one hot key and Zipf keys,
//! round trips of 1 and 10 ms) holds what each mode promises, and the modelled Envoy runs come
//! out near what Envoy measured.
#![allow(clippy::expect_used)]

use fleet_sim::sweep::{self, Row, Sweep};
use fleet_sim::{Mode, Traffic};

fn quick() -> Vec<Row> {
    let sweep = Sweep::quick();
    sweep::run_all(&sweep.scenarios(), 2).expect("the quick sweep runs")
}

/// The fleet's request rate on its busiest key, per second.
fn hottest_per_s(r: &Row) -> f64 {
    let share = r.scenario.traffic.shares().first().copied().unwrap_or(1.0);
    Sweep::quick().fleet_per_s * share
}

#[test]
fn each_mode_holds_its_promise_across_the_quick_sweep() {
    let rows = quick();
    assert!(!rows.is_empty());
    for r in &rows {
        let (s, o) = (&r.scenario, &r.outcome);
        let what = format!(
            "{} {} proxies {}: {o:?}",
            s.mode.describe(s.limit),
            s.proxies,
            s.traffic.label()
        );
        assert!(o.offered > 1000, "{what}");
        match s.mode {
            Mode::Local => {
                // Each proxy alone admits its own limit: the fleet admits over it.
                assert!(o.accuracy.over > 0, "{what}");
                assert_eq!(o.calls, 0, "{what}");
            }
            Mode::Sync => {
                assert_eq!((o.accuracy.over, o.accuracy.under), (0, 0), "{what}");
                assert_eq!(o.calls, o.offered, "{what}");
                assert_eq!(o.p99_wait_us, s.latency_us, "{what}");
            }
            Mode::Async { flush_ms } => {
                // The README's bound (the key's fleet rate × (2 × flush + round trip)), plus
                // one request per proxy: a proxy is blocked by the answer to a flush, and
                // flushes only once it has admitted a request after the fleet crossed the
                // limit. With room for the Poisson arrivals' spread (3 standard deviations).
                let m = hottest_per_s(r) * (2.0 * f64::from(flush_ms) + s.latency_us as f64 / 1e3)
                    / 1e3;
                let bound = m + 3.0 * m.sqrt() + s.proxies as f64;
                assert!(
                    o.accuracy.worst_over as f64 <= bound,
                    "{what}: bound {bound:.1}"
                );
                assert_eq!(o.waited, 0, "{what}");
            }
            Mode::Lease { .. } => {
                assert_eq!(o.accuracy.over, 0, "lease never over-admits: {what}");
                if s.traffic == Traffic::Hot {
                    // A hot key is admitted from blocks: a few claims per 100 admitted.
                    assert!(o.calls * 100 <= o.admitted * 5, "{what}");
                    // What lapses at the window's turn is a few blocks of the fleet.
                    assert!(o.under_pct() < 2.0, "{what}");
                }
            }
        }
    }
}

#[test]
fn the_modelled_envoy_runs_come_near_what_envoy_measured() {
    let comparisons = sweep::comparisons();
    // Three seeds of each (`make fleet` runs ten), to keep the test short in a debug build.
    let scenarios: Vec<_> = comparisons
        .iter()
        .flat_map(|c| {
            (1..=3).map(|seed| fleet_sim::Scenario {
                seed,
                ..c.scenario.clone()
            })
        })
        .collect();
    let rows = sweep::run_all(&scenarios, 2).expect("the comparisons run");
    for r in &rows {
        let o = &r.outcome;
        match r.scenario.mode {
            // Envoy: 300 of 300 admitted, 8.7 (native) and 10.7 (wasm) claims per 100 (blocks
            // shrink near the limit: a quarter of what the service said remained).
            Mode::Lease { .. } => {
                assert_eq!(o.admitted, 300, "{o:?}");
                let per_100 = o.calls as f64 * 100.0 / o.admitted as f64;
                assert!((5.0..=15.0).contains(&per_100), "{per_100}: {o:?}");
            }
            // Envoy: 106 admitted of a limit of 100, within the bound of 10.
            _ => assert!((100..=110).contains(&o.admitted), "{o:?}"),
        }
    }
}
