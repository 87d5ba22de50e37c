//! Elastic limits in a real Envoy (two workers), in the build under test: a rule's limit climbs
//! to its ceiling while the upstream answers well, falls to its floor when the upstream fails
//! or slows down, recovers when it heals, and does not flap under a steady error rate near the
//! threshold. The test upstream (tests/common/upstream.rs) fails or slows down on command, while
//! background clients keep traffic flowing (each request from a new user, so the base limit
//! never refuses them).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::upstream::Upstream;
use common::{bootstrap_with, Client, Envoy, Listener};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Up to 2× while healthy, 0.5× when 10 % of the answers are bad (5xx, upstream 429, slower
/// than 200 ms) over a 4 s window; 2 s to climb from floor to ceiling.
const CONFIG: &str = r#"{"rules": [{"name": "e", "key": ["header:x-user"],
    "rate_limit": {"requests_per_unit": 10, "unit": "minute"},
    "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.1, "latency_ms": 200,
                "window_s": 4, "ramp_s": 2}}]}"#;

/// Clients sending requests from fresh users until dropped.
struct Traffic {
    stop: Arc<AtomicBool>,
}

impl Traffic {
    fn start(addr: SocketAddr) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicU64::new(0));
        for _ in 0..4 {
            let (stop, next) = (stop.clone(), next.clone());
            std::thread::spawn(move || {
                let mut client = None;
                while !stop.load(Ordering::Relaxed) {
                    let user = format!("u{}", next.fetch_add(1, Ordering::Relaxed));
                    let c = match client.as_mut() {
                        Some(c) => c,
                        None => match Client::connect(addr) {
                            Ok(c) => client.insert(c),
                            Err(_) => break, // Envoy is gone: the test is over
                        },
                    };
                    if c.send("GET", "/", &[("x-user", &user)]).is_err() {
                        client = None;
                    }
                    std::thread::sleep(Duration::from_millis(15));
                }
            });
        }
        Traffic { stop }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The rule's limit in force, percent of its base.
fn factor(envoy: &Envoy) -> u64 {
    envoy
        .stat(&common::metric(Some("e"), "elastic_factor_percent"))
        .unwrap_or(0)
}

/// Waits (≤ `within`) until the factor satisfies `done`; returns how long it took and every
/// value seen on the way (sampled every 100 ms).
fn until(envoy: &Envoy, within: Duration, done: impl Fn(u64) -> bool) -> (Duration, Vec<u64>) {
    let t = Instant::now();
    let mut seen = Vec::new();
    loop {
        let f = factor(envoy);
        seen.push(f);
        if done(f) {
            return (t.elapsed(), seen);
        }
        assert!(t.elapsed() < within, "not reached in {within:?}: {seen:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Samples the factor for `d`.
fn watch(envoy: &Envoy, d: Duration) -> Vec<u64> {
    let t = Instant::now();
    let mut seen = Vec::new();
    while t.elapsed() < d {
        seen.push(factor(envoy));
        std::thread::sleep(Duration::from_millis(100));
    }
    seen
}

/// Every worker takes the factor at its own next report (every 250 ms), so the gauge (set by
/// whichever worker reported last) may lead the worker serving `c` by one report: waits
/// (≤ 3 s) until a request from a fresh user on `c` reports `limit`; returns how long it took.
fn until_in_force(c: &mut Client, limit: &str) -> Duration {
    static USER: AtomicU64 = AtomicU64::new(0);
    let t = Instant::now();
    loop {
        let user = format!("probe{}", USER.fetch_add(1, Ordering::Relaxed));
        let r = c.send("GET", "/", &[("x-user", &user)]).unwrap();
        let seen = r.header("x-ratelimit-limit").map(str::to_owned);
        if seen.as_deref() == Some(limit) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "limit {seen:?} still in force on this worker, {limit} wanted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_limit_follows_the_upstreams_health() {
    let upstream = Upstream::start();
    let listener = Listener::to(upstream.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(CONFIG, &listener));
    let _traffic = Traffic::start(envoy.addr);

    // Healthy: the limit climbs to 2× the base.
    let (climb, seen) = until(&envoy, Duration::from_secs(10), |f| f == 200);
    eprintln!("healthy: at the ceiling after {climb:?} ({seen:?})");
    // One client may now make 20 requests a minute, 10 of them above the base limit, and the
    // fields report the limit in force.
    let mut c = Client::connect(envoy.addr).unwrap();
    let lag = until_in_force(&mut c, "20");
    eprintln!("ceiling in force on this worker {lag:?} after the gauge");
    let solo: Vec<u16> = (0..22)
        .map(|_| c.send("GET", "/", &[("x-user", "solo")]).unwrap().status)
        .collect();
    assert_eq!(solo.iter().filter(|s| **s == 200).count(), 20, "{solo:?}");
    let r = c.send("GET", "/", &[("x-user", "solo2")]).unwrap();
    assert_eq!(r.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(r.header("ratelimit-policy"), Some("\"e\";q=20;w=60"));
    let stat = common::metric(Some("e"), "elastic_allowed");
    assert!(envoy.wait_stat_until(&stat, |n| n >= 10) >= Some(10));

    // The upstream fails every answer: down to the floor, 0.5×.
    upstream.set_failing(1000);
    let (react, seen) = until(&envoy, Duration::from_secs(6), |f| f == 50);
    eprintln!("failing: at the floor after {react:?} ({seen:?})");
    // It drops at once, no ramp down: nothing seen between the ceiling and the floor. The
    // nominal reaction is under 1.6 s (a report, a step, a sample); 4 s is room for a loaded
    // machine.
    assert!(seen.iter().all(|&f| f == 200 || f == 50), "{seen:?}");
    assert!(react < Duration::from_secs(4), "reacted in {react:?}");
    let lag = until_in_force(&mut c, "5");
    eprintln!("floor in force on this worker {lag:?} after the gauge");

    // Healed: back up once the failures have left the window, then up to the ceiling.
    upstream.set_failing(0);
    // (the failures leave a 4 s window between 4 and 8 s after they stopped)
    let (first, seen) = until(&envoy, Duration::from_secs(15), |f| f > 50);
    let (full, _) = until(&envoy, Duration::from_secs(10), |f| f == 200);
    eprintln!("healed: rising after {first:?}, at the ceiling {full:?} later ({seen:?})");
    assert!(
        first >= Duration::from_millis(2500),
        "rose too soon: {first:?}"
    );

    // A steady 12 % of failures, just over the threshold: down once, and it stays down.
    upstream.set_failing(120);
    let seen = watch(&envoy, Duration::from_secs(10));
    eprintln!("12 % failing: {seen:?}");
    assert_eq!(seen.last(), Some(&50), "{seen:?}");
    let rises = seen.windows(2).filter(|w| w[1] > w[0]).count();
    assert_eq!(rises, 0, "flapped: {seen:?}");
    // 7 %, inside the hysteresis band: it holds at the floor, no flapping.
    upstream.set_failing(70);
    let seen = watch(&envoy, Duration::from_secs(6));
    eprintln!("7 % failing: {seen:?}");
    assert!(seen.iter().all(|&f| f == 50), "{seen:?}");

    // Healthy again, then slow (300 ms against a target of 200 ms): slow answers are bad too.
    upstream.set_failing(0);
    until(&envoy, Duration::from_secs(20), |f| f == 200);
    upstream.set_delay_ms(300);
    let (react, seen) = until(&envoy, Duration::from_secs(15), |f| f == 50);
    eprintln!("slow: at the floor after {react:?} ({seen:?})");
}
