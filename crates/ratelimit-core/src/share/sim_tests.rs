//! The shared capacity simulated on a virtual clock: tenants sending at fixed rates (with a
//! little jitter) against one shared rule, in front of a provider that enforces its own limit.
//! The figures the shared capacity promises, checked against water-filling from its definition
//! (`testkit::fair`).
#![allow(clippy::indexing_slicing)]

use super::*;
use crate::limiter::gcra;
use crate::testkit::fair::{jain, water_fill};

/// One tenant's traffic: `rate` requests per second, open loop, each costing 1 (requests).
#[derive(Clone, Copy)]
struct Client {
    weight: u16,
    band: u8,
    rate: f64,
}

/// A tenant of weight 1 in the first band, sending `rate` requests a second.
fn tenant(rate: f64) -> Client {
    Client {
        weight: 1,
        band: 0,
        rate,
    }
}

/// Tokens: what a tenant's requests cost on average (each ±20 %).
#[derive(Clone, Copy)]
struct Tokens {
    /// Units the provider allows per second.
    capacity: u64,
    /// The mean cost of each client's requests.
    costs: [u64; 10],
}

/// What each tenant got over the measured part of the run.
struct Outcome {
    offered: Vec<f64>,
    admitted: Vec<f64>,
    refused_by: Vec<[u64; 3]>,
    /// When each tenant was last refused, ms into the run.
    last_refused_ms: Vec<Option<f64>>,
    /// Requests the provider would have refused.
    provider_refused: u64,
    /// Requests (units) per second admitted in all.
    admitted_rate: f64,
    /// The capacity, per second.
    capacity: f64,
}

const C: u64 = 50; // requests per second the provider allows
const SECONDS: u64 = 60;
const WARMUP_S: u64 = 10;

/// The rule's capacity: a token bucket at the provider's rate with 90 % of its bucket.
fn capacity(units: u64) -> Policy {
    Policy::Gcra(gcra::Params {
        limit: units,
        window_ms: 1000,
        burst: units * 9 / 10,
        max_delay_ms: None,
    })
}

/// The provider: a token bucket of one window's worth, as OpenAI and Anthropic describe theirs.
fn provider(units: u64) -> Policy {
    Policy::Gcra(gcra::Params {
        limit: units,
        window_ms: 1000,
        burst: units,
        max_delay_ms: None,
    })
}

fn run(share: &Share, clients: &[Client], seed: u64) -> Outcome {
    run_costing(share, clients, seed, None)
}

/// Runs the clients for [`SECONDS`]; with `tokens`, each request costs about its client's
/// mean cost, and the outcome is in units per second.
fn run_costing(share: &Share, clients: &[Client], seed: u64, tokens: Option<Tokens>) -> Outcome {
    let units = tokens.map_or(C, |t| t.capacity);
    run_on(share, &capacity(units), clients, seed, tokens, WARMUP_S)
}

/// [`run_costing`] against the capacity `policy`, measured after `warmup_s` seconds.
fn run_on(
    share: &Share,
    policy: &Policy,
    clients: &[Client],
    seed: u64,
    tokens: Option<Tokens>,
    warmup_s: u64,
) -> Outcome {
    let units = tokens.map_or(C, |t| t.capacity);
    let n = clients.len();
    let start = 1_800_000_000_000u64;
    let mut record = Record::new(share.bands);
    let mut tenants: Vec<Option<Tenant>> = vec![None; n];
    let mut provider_state = None;
    let mut rng = seed.wrapping_mul(0x9e37_79b9).wrapping_add(1) | 1;
    let mut jitter = move || {
        // xorshift64: a deterministic ±20 % jitter on each interval.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        0.8 + 0.4 * (rng % 10_000) as f64 / 10_000.0
    };
    let mut next: Vec<f64> = clients.iter().map(|c| 1000.0 / c.rate * jitter()).collect();
    let mut out = Outcome {
        offered: vec![0.0; n],
        admitted: vec![0.0; n],
        refused_by: vec![[0; 3]; n],
        last_refused_ms: vec![None; n],
        provider_refused: 0,
        admitted_rate: 0.0,
        capacity: units as f64,
    };
    let end = (SECONDS * 1000) as f64;
    // The next arrival of any client (ties: the lower index first).
    while let Some((i, &at)) = next.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1)) {
        if at >= end {
            break;
        }
        let c = clients[i];
        next[i] = at + 1000.0 / c.rate * jitter();
        let now = start + at as u64;
        let cost = tokens.map_or(1, |t| (t.costs[i] as f64 * jitter()).round() as u64);
        let d = decide(
            share,
            policy,
            &mut record,
            tenants[i].as_ref(),
            Asker {
                weight: c.weight,
                band: c.band,
                again: false,
                wait_ms: 0,
            },
            now,
            cost,
        );
        tenants[i] = Some(d.tenant);
        // The record goes through its encoding, as it would through a store.
        record = Record::decode(&record.encode()).expect("the record decodes");
        let measured = at >= (warmup_s * 1000) as f64;
        if measured {
            out.offered[i] += cost as f64;
        }
        match d.refused {
            None => {
                let (v, next_state) = provider(units).decide(provider_state.as_ref(), now, cost);
                if v.allowed {
                    provider_state = next_state;
                } else {
                    out.provider_refused += 1;
                }
                if measured {
                    out.admitted[i] += cost as f64;
                }
            }
            Some(r) if measured => {
                out.refused_by[i][r as usize] += 1;
                out.last_refused_ms[i] = Some(at);
            }
            Some(_) => {}
        }
    }
    let measured_s = (SECONDS - warmup_s) as f64;
    for i in 0..n {
        out.offered[i] /= measured_s;
        out.admitted[i] /= measured_s;
    }
    out.admitted_rate = out.admitted.iter().sum();
    out
}

impl Outcome {
    /// The rule used at least `part` of the capacity.
    fn assert_used(&self, part: f64) {
        assert!(
            self.admitted_rate >= part * self.capacity,
            "capacity used: {:.2} of {:.2}",
            self.admitted_rate,
            self.capacity
        );
    }

    /// Each of `tenants` got at least 99 % of what it offered.
    fn assert_served(&self, tenants: std::ops::Range<usize>, what: &str) {
        for i in tenants {
            assert!(
                self.admitted[i] >= 0.99 * self.offered[i],
                "{what} {i}: {:.2} of {:.2}",
                self.admitted[i],
                self.offered[i]
            );
        }
    }
}

fn report(name: &str, clients: &[Client], o: &Outcome) {
    eprintln!(
        "{name}: admitted {:.2}/s ({:.1} % of the capacity), provider refused {}",
        o.admitted_rate,
        100.0 * o.admitted_rate / o.capacity,
        o.provider_refused
    );
    for (i, c) in clients.iter().enumerate() {
        eprintln!(
            "  tenant {i}: weight {} band {} offered {:.2}/s admitted {:.2}/s refused {:?}",
            c.weight, c.band, o.offered[i], o.admitted[i], o.refused_by[i]
        );
    }
}

/// The water-filling allocation of the target part of the capacity for these clients' offered
/// rates (one band).
fn ideal(share: &Share, clients: &[Client], o: &Outcome) -> Vec<f64> {
    let weights: Vec<f64> = clients.iter().map(|c| f64::from(c.weight)).collect();
    water_fill(
        C as f64 * share.target_pm as f64 / 1000.0,
        &o.offered,
        &weights,
    )
}

#[test]
fn one_heavy_tenant_and_nine_light_ones() {
    // One tenant at ten times its share, nine at half of theirs.
    let share = Share::for_bands(&[0]);
    let plain = C as f64 / 10.0;
    let mut clients = vec![tenant(10.0 * plain)];
    clients.extend((0..9).map(|_| tenant(plain / 2.0)));
    for seed in [1, 2, 3] {
        let o = run(&share, &clients, seed);
        report("heavy and lights", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        o.assert_served(1..10, "light tenant");
        o.assert_used(0.95);
        let lights: f64 = o.admitted[1..].iter().sum();
        assert!(
            o.admitted[0] >= 0.95 * (0.97 * C as f64 - lights),
            "the heavy one gets the rest"
        );
    }
}

#[test]
fn equal_tenants_all_asking_for_more_get_equal_shares() {
    let share = Share::for_bands(&[0]);
    let clients = vec![tenant(3.0 * C as f64 / 5.0); 5];
    for seed in [4, 5, 6] {
        let o = run(&share, &clients, seed);
        report("five equal", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        let j = jain(&o.admitted);
        assert!(j >= 0.99, "Jain {j:.4}");
        o.assert_used(0.95);
    }
}

#[test]
fn weights_one_two_four_get_shares_one_two_four() {
    let share = Share::for_bands(&[0]);
    let clients: Vec<Client> = [1, 2, 4]
        .iter()
        .map(|&weight| Client {
            weight,
            band: 0,
            rate: C as f64,
        })
        .collect();
    for seed in [7, 8, 9] {
        let o = run(&share, &clients, seed);
        report("1:2:4", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        let unit = o.admitted_rate / 7.0;
        for (i, c) in clients.iter().enumerate() {
            let expected = unit * f64::from(c.weight);
            assert!(
                (o.admitted[i] - expected).abs() <= 0.05 * expected,
                "weight {}: {:.2}/s, expected {expected:.2}",
                c.weight,
                o.admitted[i]
            );
        }
    }
}

#[test]
fn tenants_between_the_plain_share_and_the_level_get_all_they_ask() {
    // Max-min, not the plain share: with equal weights, 20 % and 34 % of the capacity are both
    // served whole (34 % is above a third of the target: the plain share would cap it at 95 % of
    // its demand), and the heavy tenant gets the rest.
    let share = Share::for_bands(&[0]);
    let clients = vec![
        tenant(0.2 * C as f64),
        tenant(0.34 * C as f64),
        tenant(2.0 * C as f64),
    ];
    for seed in [10, 11, 12] {
        let o = run(&share, &clients, seed);
        report("max-min", &clients, &o);
        let want = ideal(&share, &clients, &o);
        assert_eq!(o.provider_refused, 0);
        o.assert_served(0..2, "tenant");
        assert!(
            (o.admitted[2] - want[2]).abs() <= 0.05 * want[2],
            "heavy {:.2}, ideal {:.2}",
            o.admitted[2],
            want[2]
        );
    }
}

/// Three interactive tenants asking 30 % of the capacity in all, and three batch ones asking
/// all of it each.
fn interactive_and_batch() -> Vec<Client> {
    let client = |band: u8, rate: f64| Client {
        weight: 1,
        band,
        rate,
    };
    let mut clients = vec![client(0, 0.1 * C as f64); 3];
    clients.extend(vec![client(1, C as f64); 3]);
    clients
}

#[test]
fn the_interactive_band_is_served_while_batch_absorbs_the_overload() {
    let share = Share::for_bands(&[200, 50]);
    let clients = interactive_and_batch();
    for seed in [13, 14, 15] {
        let o = run(&share, &clients, seed);
        report("bands", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        for i in 0..3 {
            assert_eq!(o.refused_by[i], [0, 0, 0], "interactive tenant {i} refused");
        }
        o.assert_used(0.95);
        let batch: Vec<f64> = o.admitted[3..].to_vec();
        assert!(jain(&batch) >= 0.99, "{batch:?}");
    }
}

#[test]
fn the_interactive_band_is_served_from_the_first_request_with_every_algorithm() {
    // As above, measured from the first request, with each algorithm a shared rule may use.
    // Batch, alone at first, fills the capacity before interactive asks; a token bucket's burst
    // serves interactive's first requests all the same, a sliding window has nothing to spare
    // until the first window's use slides out: interactive is refused for the capacity only
    // then, never after the first 1.1 windows. (A leaky bucket refuses any request ahead of its
    // pace, whatever its band: no band is promised anything there.)
    let share = Share::for_bands(&[200, 50]);
    let clients = interactive_and_batch();
    let sliding = Policy::SlidingWindow {
        limit: C,
        window_ms: 1000,
    };
    for (name, policy, first_window) in [
        ("token bucket", capacity(C), false),
        ("sliding window", sliding, true),
    ] {
        for seed in [13, 14, 15] {
            let o = run_on(&share, &policy, &clients, seed, None, 0);
            report(name, &clients, &o);
            assert_eq!(o.provider_refused, 0);
            for i in 0..3 {
                let last = o.last_refused_ms[i];
                match first_window {
                    false => assert_eq!(last, None, "{name}: interactive {i} refused"),
                    true => assert!(
                        last.is_none_or(|ms| ms < 1100.0),
                        "{name}: interactive {i} refused at {last:?} ms"
                    ),
                }
            }
            o.assert_used(0.93);
        }
    }
}

#[test]
fn a_reserved_minimum_holds_while_the_higher_band_overloads() {
    let share = Share::for_bands(&[0, 200]);
    let clients = vec![
        tenant(2.0 * C as f64),
        Client {
            weight: 1,
            band: 1,
            rate: C as f64,
        },
    ];
    for seed in [16, 17, 18] {
        let o = run(&share, &clients, seed);
        report("reserve", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        let reserve = 0.2 * 0.97 * C as f64;
        assert!(
            o.admitted[1] >= 0.95 * reserve,
            "batch {:.2}",
            o.admitted[1]
        );
        o.assert_used(0.95);
    }
}

#[test]
fn tokens_of_varied_costs_are_shared_like_requests() {
    // The first case in tokens: 20,000 a second; the heavy tenant's requests cost about 1,000
    // (ten times its share at 20 a second), the light ones' about 250 to 700 (half their share).
    let share = Share::for_bands(&[0]);
    let units = 20_000u64;
    let plain = units as f64 / 10.0;
    let mut costs = [1000; 10];
    let mut clients = vec![tenant(10.0 * plain / 1000.0)];
    for (i, cost) in costs.iter_mut().enumerate().skip(1) {
        *cost = 250 + 50 * i as u64;
        clients.push(tenant(plain / 2.0 / *cost as f64));
    }
    let tokens = Tokens {
        capacity: units,
        costs,
    };
    for seed in [19, 20, 21] {
        let o = run_costing(&share, &clients, seed, Some(tokens));
        report("tokens", &clients, &o);
        assert_eq!(o.provider_refused, 0);
        o.assert_served(1..10, "light tenant");
        o.assert_used(0.95);
    }
}
