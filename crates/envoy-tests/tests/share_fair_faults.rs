//! Faults under a capacity shared fairly across the fleet (`share.fleet: "fair"`), in the build
//! under test: three Envoys leasing one rule of 200 requests a second from the test service
//! (counting each descriptor by its own `hits_addend`, over the limitador engine and Redis) in
//! front of the stand-in provider, which admits 200 a second and answers a 429 past it. The
//! tenants of `share_fair.rs`'s `/f1`, each pinned to a slot: `solo` on the first Envoy, `b1`
//! and `b2` on the second, `c1` (weight 2) and `light` (10 a second) on the third; the others
//! ask 120 a second each. Then, in turn:
//!
//! 1. the third Envoy is killed (SIGKILL: no goodbye, its held quota left to lapse) and its
//!    tenants move to the first, as a load balancer sends them to a live replica;
//! 2. a new Envoy is started and the third slot's tenants move to it;
//! 3. the service is killed for [`OUTAGE_S`] seconds and started again on the same port (the
//!    counts stay in Redis).
//!
//! The checks, on the provider's side, by whole seconds: from [`SETTLE_S`] after each fault
//! ([`SETTLE_ADDED_S`] after a replica is added) for [`MEASURE_S`], every backlogged tenant
//! within ±5 % of its water-filling share of 97 % of the capacity and the light tenant served;
//! the provider refuses nothing but while the service is down under `failure_mode: "allow"`,
//! and then no more than the stated bound, (N − 1) × C a second (each Envoy admits at most what
//! its own shares let through, at most C); under `"deny"` it refuses nothing at all. Each mode
//! runs as its own fleet.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod common;

use common::fair::{config, limits, Shares};
use common::provider::Provider;
use common::share::{paced, tenant, Tenant, RATE};
use common::{bootstrap_with, free_port, redis, rls_cluster, rls_server_each, Client, Envoy};
use common::{metric, Listener, Proc};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PROXIES: usize = 3;
const RULE: &str = "f1";
/// Seconds of traffic before the first fault, the first measured from half of it.
const STEADY_S: f64 = 14.0;
/// Seconds after a fault (or the service's return) before the shares are measured again.
const SETTLE_S: f64 = 5.0;
/// Seconds after a new Envoy joins before the shares are measured again: for its first windows
/// the fleet's quota runs out before some windows end (its view of the fleet forming, it claims
/// by its local shares), and whoever asks then is refused, its tenants under their shares too.
/// Measured with [`SETTLE_S`] (three runs per build, one beside two CPU hogs): the light tenant
/// on it lost up to 5 of 60 requests, 7 to 9 seconds after it joined; nothing 10 seconds after.
const SETTLE_ADDED_S: f64 = 10.0;
/// Seconds measured after each fault.
const MEASURE_S: f64 = 7.0;
/// Seconds the service is down.
const OUTAGE_S: f64 = 4.0;
/// The least part of its requests the light tenant gets through, as `share_fair.rs` holds.
const LIGHT_SERVED: f64 = 0.95;

/// The tenants, each with its slot (0, 1, 2: which Envoy it sends to) and its weight.
fn tenants() -> Vec<(Tenant, usize, f64)> {
    let w = |n: &'static str| [("x-weight", n)];
    vec![
        (tenant("/f1/x", "solo", 120.0, &w("1")), 0, 1.0),
        (tenant("/f1/x", "b1", 120.0, &w("1")), 1, 1.0),
        (tenant("/f1/x", "b2", 120.0, &w("1")), 1, 1.0),
        (tenant("/f1/x", "c1", 120.0, &w("2")), 2, 2.0),
        (tenant("/f1/x", "light", 10.0, &w("1")), 2, 1.0),
    ]
}

/// Where each slot's tenants send now.
type Slots = Arc<Mutex<Vec<SocketAddr>>>;

/// Each tenant on its own thread, paced at its rate until `stop` (at most `run`), to the Envoy
/// its slot names at each request (a new connection when that changed or the last one broke; a
/// request whose Envoy is gone is tried once more on a new connection, then dropped).
fn drive(
    slots: &Slots,
    tenants: &[(Tenant, usize, f64)],
    run: Duration,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    tenants
        .iter()
        .cloned()
        .map(|(t, slot, _)| {
            let (slots, stop) = (slots.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut conn: Option<(SocketAddr, Client)> = None;
                let mut headers: Vec<(&str, &str)> = vec![("x-tenant", &t.name)];
                headers.extend(t.headers.iter().map(|(k, v)| (*k, v.as_str())));
                paced(t.rate, run, |_| {
                    for _ in 0..2 {
                        let addr = slots.lock().unwrap()[slot];
                        if conn.as_ref().map(|c| c.0) != Some(addr) {
                            conn = Client::connect(addr).ok().map(|c| (addr, c));
                        }
                        let Some((_, c)) = conn.as_mut() else {
                            continue;
                        };
                        if c.send("GET", t.path, &headers).is_ok() {
                            break;
                        }
                        conn = None;
                    }
                    !stop.load(Ordering::Relaxed)
                });
            })
        })
        .collect()
}

/// What one phase of the run measured: whole provider seconds `from..to`.
struct Phase {
    name: &'static str,
    from: u64,
    to: u64,
}

impl Phase {
    /// The whole provider seconds within `a..b` seconds of the provider's clock.
    fn new(name: &'static str, a: f64, b: f64) -> Phase {
        Phase {
            name,
            from: a.ceil() as u64,
            to: b.floor() as u64,
        }
    }

    fn seconds(&self) -> f64 {
        self.to.saturating_sub(self.from) as f64
    }
}

/// What is wrong over `phase` (nothing: the provider refused nothing and every tenant got its
/// fair share): the backlogged tenants as [`Shares::check`] holds them, the light one at least
/// [`LIGHT_SERVED`] of what it asked.
fn fair_over(provider: &Provider, phase: &Phase, mode: &str) -> Vec<String> {
    let case = tenants();
    let tally = provider.tally(RULE, phase.from, phase.to);
    let secs = phase.seconds().max(1.0);
    let rates: Vec<f64> = case
        .iter()
        .map(|(t, _, _)| tally.get(&t.name).map_or(0.0, |n| n.0 as f64 / secs))
        .collect();
    let refused: u64 = tally.values().map(|n| n.1).sum();
    let names: Vec<&str> = case.iter().map(|(t, _, _)| t.name.as_str()).collect();
    let demands: Vec<f64> = case.iter().map(|(t, _, _)| t.rate).collect();
    let weights: Vec<f64> = case.iter().map(|(_, _, w)| *w).collect();
    let label = format!("{mode} {}", phase.name);
    let shares = Shares::check(&label, &names, &rates, &demands, &weights, RATE);
    let used: f64 = rates.iter().sum::<f64>() / RATE;
    eprintln!(
        "{label} (seconds {}..{}): admitted {rates:.1?}, water-filling {:.1?}, \
         {:.1} % used, provider refused {refused}",
        phase.from,
        phase.to,
        shares.ideal,
        100.0 * used
    );
    let mut wrong = shares.wrong;
    if refused > 0 {
        wrong.push(format!("{label}: the provider refused {refused}"));
    }
    for &i in &shares.under {
        let (got, asked) = (rates[i] * secs, demands[i] * secs);
        if got < LIGHT_SERVED * asked - 1.0 {
            wrong.push(format!(
                "{label} {}: {got:.0} of {asked:.0} passed",
                names[i]
            ));
        }
    }
    wrong
}

/// Sleeps until `at` seconds of the provider's clock.
fn until(provider: &Provider, at: f64) {
    let now = provider.elapsed_s();
    if at > now {
        std::thread::sleep(Duration::from_secs_f64(at - now));
    }
}

/// One fleet under `failure_mode`, through the three faults.
fn faults(failure_mode: &str) {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let limits = limits(&[RULE]);
    let start_rls = || -> Proc { rls_server_each(rls_port, redis_port, &limits, true) };
    let mut rls = Some(start_rls());
    let provider = Provider::start(RATE);
    let listener = Listener::to(provider.addr);
    let yaml = format!(
        "{}{}",
        bootstrap_with(&config(&[RULE], false, failure_mode), &listener),
        rls_cluster(rls_port, "1s")
    );
    let mut envoys: Vec<Option<Envoy>> = (0..PROXIES)
        .map(|_| Some(Envoy::start_yaml(&yaml)))
        .collect();
    let slots: Slots = Arc::new(Mutex::new(
        envoys.iter().flatten().map(|e| e.addr).collect(),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let t0 = provider.elapsed_s();
    let senders = drive(&slots, &tenants(), Duration::from_secs(120), &stop);
    let mut phases = vec![Phase::new("steady", t0 + STEADY_S / 2.0, t0 + STEADY_S)];

    // Each fault: its phase measured from `settle` seconds after it for MEASURE_S; the next
    // fault once that is over.
    let mut measure = |name: &'static str, settle: f64| -> f64 {
        let at = provider.elapsed_s();
        eprintln!("{failure_mode}: {name} at {at:.1} s");
        phases.push(Phase::new(name, at + settle, at + settle + MEASURE_S));
        at + settle + MEASURE_S
    };

    // 1. The third Envoy killed; its tenants on the first.
    until(&provider, t0 + STEADY_S);
    let first = slots.lock().unwrap()[0];
    slots.lock().unwrap()[2] = first;
    drop(envoys[2].take());
    let next = measure("killed", SETTLE_S);

    // 2. A new Envoy; the third slot's tenants on it once it listens.
    until(&provider, next);
    let added = Envoy::start_yaml(&yaml);
    slots.lock().unwrap()[2] = added.addr;
    envoys[2] = Some(added);
    let next = measure("added", SETTLE_ADDED_S);

    // 3. The service down for OUTAGE_S, then back on the same port.
    until(&provider, next);
    let down = provider.elapsed_s();
    drop(rls.take());
    until(&provider, down + OUTAGE_S);
    rls = Some(start_rls());
    let back = provider.elapsed_s();
    eprintln!("{failure_mode}: the service down from {down:.1} s to {back:.1} s");
    let outage = Phase::new("outage", down, back + SETTLE_S + 1.0);
    phases.push(Phase::new(
        "back",
        back + SETTLE_S + 1.0,
        back + SETTLE_S + 1.0 + MEASURE_S,
    ));
    until(&provider, back + SETTLE_S + 1.0 + MEASURE_S + 1.0);
    let counter = |name: &str| -> u64 {
        envoys
            .iter()
            .flatten()
            .map(|e| e.stat(&metric(Some(RULE), name)).unwrap_or(0))
            .sum()
    };
    let (failed_open, failed_closed) = (counter("failed_open"), counter("failed_closed"));
    eprintln!(
        "{failure_mode}: failed_open {failed_open}, failed_closed {failed_closed}, \
         lease_claims {}, lease_lapsed {}, provider refused {} in all; {:.0} s",
        counter("lease_claims"),
        counter("lease_lapsed"),
        provider.refused(),
        started.elapsed().as_secs_f64()
    );
    stop.store(true, Ordering::Relaxed);
    for s in senders {
        s.join().unwrap();
    }
    drop(rls);

    // Each tenant's admissions by the second, for the record.
    let names: Vec<String> = tenants().iter().map(|(t, _, _)| t.name.clone()).collect();
    for s in phases[0].from..outage.to + 12 {
        let t = provider.tally(RULE, s, s + 1);
        let row: Vec<u64> = names.iter().map(|n| t.get(n).map_or(0, |x| x.0)).collect();
        let refused: u64 = t.values().map(|x| x.1).sum();
        eprintln!("{failure_mode} second {s}: {names:?} {row:?}, provider refused {refused}");
    }
    let wrong: Vec<String> = phases
        .iter()
        .flat_map(|phase| fair_over(&provider, phase, failure_mode))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    // While the service is down (and until the fleet's view forms again): `deny` refuses what
    // no quota held covers, so the provider refuses nothing; `allow` lets it through, each
    // Envoy at most what its own shares let through (C), so the provider refuses at most
    // (N - 1) × C a second.
    let mut refused_by_second = Vec::new();
    for s in outage.from..outage.to {
        let t = provider.tally(RULE, s, s + 1);
        refused_by_second.push(t.values().map(|n| n.1).sum::<u64>());
    }
    eprintln!(
        "{failure_mode} outage (seconds {}..{}): provider refused {refused_by_second:?} a second",
        outage.from, outage.to
    );
    if failure_mode == "deny" {
        assert!(
            failed_closed > 0,
            "deny: no request was refused for want of the service"
        );
        assert_eq!(
            refused_by_second.iter().sum::<u64>(),
            0,
            "deny: the provider refused requests"
        );
    } else {
        assert!(
            failed_open > 0,
            "allow: no request was let through for want of the service"
        );
        let bound = (PROXIES as f64 - 1.0) * RATE;
        for (s, r) in (outage.from..).zip(&refused_by_second) {
            assert!(
                *r as f64 <= bound,
                "allow: the provider refused {r} in second {s}, over {bound}"
            );
        }
    }
}

#[test]
fn under_deny_a_killed_replica_a_new_one_and_the_service_down_keep_the_account_and_the_shares() {
    faults("deny");
}

#[test]
fn under_allow_the_account_is_exceeded_only_while_the_service_is_down_and_within_its_bound() {
    faults("allow");
}
