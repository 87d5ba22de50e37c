//! Global rules across several real Envoys sharing one rate limit service: a test-support RLS
//! server (tests/rls-server: the limitador engine over a real Redis) speaks Envoy's RLS gRPC
//! protocol. Sync mode holds the limit exactly; async mode within the documented bound; a lost
//! Redis or service follows failure_mode and recovers; a slow service never delays async rules.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{
    bootstrap, free_port, redis, rls_cluster, rls_server, rls_service, wasm_path, Client, Envoy,
    Proc,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The service with one limit for rule `rule`: `max` per `seconds` per client address.
fn rls(port: u16, redis_port: u16, rule: &str, max: u64, seconds: u64, delay_ms: u64) -> Proc {
    rls_limits(port, redis_port, &[(rule, max, seconds)], delay_ms)
}

/// The test service with one limit per `(rule, max, seconds)`, each per remote address.
fn rls_limits(port: u16, redis_port: u16, rules: &[(&str, u64, u64)], delay_ms: u64) -> Proc {
    rls_with(port, redis_port, rules, delay_ms, false)
}

/// [`rls_limits`], answering one call at a time if `serial` (limitador's Redis storage checks,
/// then counts, in two steps: concurrent calls near the limit can be counted past it).
fn rls_with(
    port: u16,
    redis_port: u16,
    rules: &[(&str, u64, u64)],
    delay_ms: u64,
    serial: bool,
) -> Proc {
    rls_server(port, redis_port, &limits(rules), delay_ms, serial)
}

/// Limitador's limits for `rules` (name, limit, seconds): one counter per client address each.
fn limits(rules: &[(&str, u64, u64)]) -> String {
    let limits: Vec<String> = rules
        .iter()
        .map(|(rule, max, seconds)| {
            format!(
                r#"{{"namespace": "edge", "name": "{rule}", "max_value": {max}, "seconds": {seconds},
                     "conditions": ["descriptors[0].rule == '{rule}'"],
                     "variables": ["descriptors[0].remote_address"]}}"#
            )
        })
        .collect();
    format!("[{}]", limits.join(","))
}

fn envoy(config: &str, rls_port: u16) -> Envoy {
    let yaml = format!(
        "{}  clusters:\n{}",
        bootstrap(config, &wasm_path()),
        rls_cluster(rls_port, "1s")
    );
    Envoy::start_yaml(&yaml)
}

fn rule_config(name: &str, limit: u64, unit: &str, global: &str, failure_mode: &str) -> String {
    format!(
        r#"{{"failure_mode": "{failure_mode}", "rules": [{{"name": "{name}", "key": ["remote_address"],
            "rate_limit": {{"requests_per_unit": {limit}, "unit": "{unit}"}},
            "global": {{"cluster": "ratelimit", "domain": "edge", {global}}}}}]}}"#
    )
}

/// Budgets of a week and of 31 days in the service: the refusal waits the service's own reset,
/// days away (it was once cut to a day), and `w` is the service's WEEK, or, for a length the
/// protocol has no unit for, the rule's own window: this calendar month. (Limitador counts a
/// limit's `seconds` from a key's first hit: it has no calendar months.)
#[test]
fn long_global_budgets_tell_the_services_reset_days_away() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let _rls = rls_limits(
        rls_port,
        redis_port,
        &[("week", 1, 604_800), ("month", 1, 31 * 86_400)],
        0,
    );
    let rule = |name: &str| {
        format!(
            r#"{{"name": "{name}", "match": {{"path_prefix": "/{name}"}}, "key": ["remote_address"],
                "rate_limit": {{"requests_per_unit": 1, "unit": "{name}"}},
                "global": {{"cluster": "ratelimit", "domain": "edge", "timeout_ms": 2000}}}}"#
        )
    };
    // failure_mode deny and a long timeout: a service slowed by a loaded machine cannot pass
    // for a refusal's absence.
    let config = format!(
        r#"{{"failure_mode": "deny", "rules": [{}, {}]}}"#,
        rule("week"),
        rule("month")
    );
    let envoy = envoy(&config, rls_port);
    let mut c = Client::connect(envoy.addr).unwrap();
    let month_w = || {
        let (start, end) = common::utc_month(common::now_ms() as i64 / 1000);
        end - start
    };
    for (path, seconds) in [("/week", 604_800), ("/month", 31 * 86_400)] {
        assert_eq!(c.get(path).unwrap().status, 200, "{path}");
        let before = month_w();
        let refused = c.get(path).unwrap();
        let after = month_w();
        assert_eq!(refused.status, 429, "{path}");
        let retry = refused.header_u64("retry-after").unwrap();
        assert!(
            (seconds - 3..=seconds).contains(&retry),
            "{path}: retry-after {retry}, the service's reset {seconds}"
        );
        let rate = refused.header("ratelimit").unwrap();
        assert!(rate.ends_with(&format!(";t={retry}")), "{path}: {rate}");
        let policy = refused.header("ratelimit-policy").unwrap();
        let w: Vec<String> = match path {
            "/week" => vec!["w=604800".into()],
            _ => vec![format!("w={before}"), format!("w={after}")],
        };
        assert!(
            w.iter().any(|w| policy.ends_with(w.as_str())),
            "{path}: {policy}"
        );
    }
}

#[test]
fn sync_mode_holds_the_limit_exactly_across_proxies() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let _rls = rls(rls_port, redis_port, "g", 10, 60, 0);
    let config = rule_config(
        "g",
        10,
        "minute",
        // Generous: a first call (new HTTP/2 connection, Redis) on a loaded machine must not
        // time out and fail open; timeouts have their own test.
        r#""mode": "sync", "timeout_ms": 2000"#,
        "allow",
    );
    let (a, b) = (envoy(&config, rls_port), envoy(&config, rls_port));
    let mut ca = Client::connect(a.addr).unwrap();
    let mut cb = Client::connect(b.addr).unwrap();
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..8 {
        for c in [&mut ca, &mut cb] {
            let r = c.get("/").unwrap();
            statuses.push(r.status);
            last = Some(r);
        }
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        10,
        "{statuses:?}"
    );
    assert!(statuses[10..].iter().all(|&s| s == 429), "{statuses:?}");
    let r = last.unwrap();
    // The limit and the reset come from the service's answer; its own headers pass through.
    assert_eq!(r.header("ratelimit-policy"), Some("\"g\";q=10;w=60"));
    assert_eq!(r.header_u64("x-ratelimit-remaining"), Some(0));
    assert!(r.header_u64("retry-after").unwrap() >= 1);
    assert_eq!(r.header("x-rls-server"), Some("limitador"));
    assert_eq!(
        a.wait_stat(&common::metric(Some("g"), "limited"), 3),
        Some(3)
    );
}

#[test]
fn async_mode_holds_the_limit_within_the_documented_bound() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let (limit, flush_ms) = (100u64, 20u64);
    // "p": a sync rule on /probe with a limit never reached, to measure the service's round
    // trip (through Envoy, the service and Redis, as a flush goes) while the load runs.
    let _rls = rls_limits(
        rls_port,
        redis_port,
        &[("g", limit, 60), ("p", 1_000_000, 60)],
        0,
    );
    let config = format!(
        r#"{{"rules": [
            {{"name": "g", "key": ["remote_address"], "match": {{"path": "/"}},
              "rate_limit": {{"requests_per_unit": {limit}, "unit": "minute"}},
              "global": {{"cluster": "ratelimit", "domain": "edge", "mode": "async",
                          "flush_ms": {flush_ms}, "timeout_ms": 200}}}},
            {{"name": "p", "key": ["remote_address"], "match": {{"path": "/probe"}},
              "rate_limit": {{"requests_per_unit": 1000000, "unit": "minute"}},
              "global": {{"cluster": "ratelimit", "domain": "edge", "mode": "sync",
                          "timeout_ms": 2000}}}}]}}"#
    );
    let proxies = [envoy(&config, rls_port), envoy(&config, rls_port)];
    // Each proxy is offered at most 100 requests a second for 3 s (a late client skips the
    // slots it missed rather than catching up in a burst): 600 offered; each proxy alone would
    // admit its local limit (100), so 200 in all without the service.
    let admitted = Arc::new(AtomicU32::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rate = 100u64;
    let start = Instant::now();
    let threads: Vec<_> = proxies
        .iter()
        .map(|p| {
            let (addr, admitted) = (p.addr, admitted.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(addr).unwrap();
                let mut latencies = Vec::new();
                let mut slot = 0u64;
                while slot < 3 * rate {
                    let due = start + Duration::from_millis(slot * 1000 / rate);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let t = Instant::now();
                    if c.get("/").unwrap().status == 200 {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    latencies.push(t.elapsed());
                    let now_slot = start.elapsed().as_millis() as u64 * rate / 1000;
                    slot = (slot + 1).max(now_slot);
                }
                latencies
            })
        })
        .collect();
    let probe = {
        let (addr, done) = (proxies[0].addr, done.clone());
        std::thread::spawn(move || {
            let mut c = Client::connect(addr).unwrap();
            let mut trips = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                assert_eq!(c.get("/probe").unwrap().status, 200);
                trips.push(t.elapsed());
                std::thread::sleep(Duration::from_millis(50));
            }
            trips
        })
    };
    let mut latencies: Vec<Duration> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    done.store(true, Ordering::Relaxed);
    let mut trips = probe.join().unwrap();
    latencies.sort();
    trips.sort();
    let admitted = u64::from(admitted.load(Ordering::Relaxed));
    // The documented bound: every proxy may go on admitting for up to two flush intervals plus
    // a round trip after the fleet crosses the limit: replicas × rate × (2 × flush + round
    // trip), with the round trip as measured (p99 of the probes, at least 10 ms).
    let trip_ms = (trips[trips.len() * 99 / 100].as_millis() as u64).max(10);
    let bound = 2 * rate * (2 * flush_ms + trip_ms) / 1000;
    eprintln!(
        "async: {admitted} admitted by 2 proxies for a global limit of {limit} (over by {}, bound {bound} \
         with a round trip of {trip_ms} ms); p99 latency {:?}",
        admitted.saturating_sub(limit),
        latencies[latencies.len() * 99 / 100]
    );
    assert!(
        admitted >= limit,
        "{admitted}: the service's count must not block early"
    );
    assert!(
        admitted <= limit + bound,
        "{admitted} admitted, bound {}",
        limit + bound
    );
    // The bound is worth testing only while it is well under what the proxies admit alone.
    assert!(
        bound < limit / 2,
        "round trip {trip_ms} ms: too slow to test"
    );
    // Once blocked, every proxy refuses at once.
    for p in &proxies {
        assert_eq!(
            Client::connect(p.addr).unwrap().get("/").unwrap().status,
            429
        );
    }
}

#[test]
fn a_lost_store_or_service_follows_failure_mode_and_recovers() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let mut redis_proc = Some(redis(redis_port));
    let mut rls_proc = Some(rls(rls_port, redis_port, "g", 3, 60, 0));
    let open = envoy(
        &rule_config("g", 3, "minute", r#""timeout_ms": 500"#, "allow"),
        rls_port,
    );
    let closed = envoy(
        &rule_config("g", 3, "minute", r#""timeout_ms": 500"#, "deny"),
        rls_port,
    );
    let status = |e: &Envoy| Client::connect(e.addr).unwrap().get("/").unwrap().status;
    assert_eq!(status(&open), 200);

    // Redis goes away: the service answers UNAVAILABLE.
    redis_proc.take();
    assert_eq!(status(&open), 200, "fail open");
    assert_eq!(status(&closed), 429, "fail closed");
    assert!(open.wait_stat(&common::metric(Some("g"), "failed_open"), 1) >= Some(1));
    assert!(open.wait_stat(&common::metric(Some("g"), "global_errors"), 1) >= Some(1));

    // Redis is back (empty): the limit holds again (3 per minute).
    let _redis = redis(redis_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut statuses = Vec::new();
    while Instant::now() < deadline {
        statuses.push(status(&open));
        if statuses.ends_with(&[429]) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        statuses.ends_with(&[429]),
        "never limited again: {statuses:?}"
    );

    // The service itself goes away: the gRPC call fails.
    rls_proc.take();
    assert_eq!(status(&open), 200, "fail open");
    assert_eq!(status(&closed), 429, "fail closed");
    // Back: answers come from the service again (this address is over its limit by now, so
    // they are refusals, but the service's own header shows who decided).
    let _rls = rls(rls_port, redis_port, "g", 3, 60, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = Client::connect(closed.addr).unwrap().get("/").unwrap();
        if r.header("x-rls-server") == Some("limitador") {
            assert_eq!(r.status, 429);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the service came back but the filter did not use it"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_slow_service_never_delays_async_requests() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let _rls = rls(rls_port, redis_port, "g", 1000, 60, 1000); // every answer takes 1 s
    let config = r#"{"rules": [
            {"name": "g", "key": ["remote_address"], "match": {"path": "/async"},
              "rate_limit": {"requests_per_unit": 1000, "unit": "minute"},
              "global": {"cluster": "ratelimit", "domain": "edge", "mode": "async", "flush_ms": 50}},
            {"name": "g2", "key": ["remote_address"], "match": {"path": "/sync"},
              "rate_limit": {"requests_per_unit": 1000, "unit": "minute"},
              "global": {"cluster": "ratelimit", "domain": "edge", "mode": "sync", "timeout_ms": 100}}]}"#;
    let e = envoy(config, rls_port);
    let mut c = Client::connect(e.addr).unwrap();
    let mut slowest = Duration::ZERO;
    for _ in 0..50 {
        let t = Instant::now();
        assert_eq!(c.get("/async").unwrap().status, 200);
        slowest = slowest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Half the service's answer time: a request that waited for it cannot be this fast, and a
    // loaded machine has room.
    assert!(
        slowest < Duration::from_millis(500),
        "an async request took {slowest:?}"
    );
    // A sync request waits up to its timeout, then failure_mode (allow) lets it through.
    let t = Instant::now();
    assert_eq!(c.get("/sync").unwrap().status, 200);
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(90), "{waited:?}");
    assert!(waited < Duration::from_millis(600), "{waited:?}"); // not the 1 s answer
    assert_eq!(
        e.wait_stat(&common::metric(Some("g2"), "failed_open"), 1),
        Some(1)
    );
}

/// Runs `clients` clients on each proxy, each sending `path` back to back for `secs`; the
/// requests each proxy admitted.
fn hammer(proxies: &[Envoy], clients: usize, path: &'static str, secs: u64) -> Vec<u64> {
    let start = Instant::now();
    let threads: Vec<Vec<_>> = proxies
        .iter()
        .map(|p| {
            (0..clients)
                .map(|_| {
                    let addr = p.addr;
                    std::thread::spawn(move || {
                        let mut c = Client::connect(addr).unwrap();
                        let mut admitted = 0u64;
                        while start.elapsed() < Duration::from_secs(secs) {
                            if c.get(path).unwrap().status == 200 {
                                admitted += 1;
                            }
                        }
                        admitted
                    })
                })
                .collect()
        })
        .collect();
    threads
        .into_iter()
        .map(|ts| ts.into_iter().map(|t| t.join().unwrap()).sum())
        .collect()
}

/// The sum of a rule's counter over the proxies, once every proxy has published it.
fn fleet_stat(proxies: &[Envoy], rule: &str, name: &str) -> u64 {
    std::thread::sleep(Duration::from_millis(1_500)); // a publication period, and a margin
    proxies
        .iter()
        .map(|p| p.stat(&common::metric(Some(rule), name)).unwrap_or(0))
        .sum()
}

/// Lease mode: three proxies of two workers each, six clients at full speed on one key: the
/// fleet admits the limit and never more, from quota claimed in blocks (a few claims per
/// hundred requests), while each proxy alone would admit the whole limit.
#[test]
fn lease_mode_never_admits_over_the_limit_across_three_proxies() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let limit = 300u64;
    // One call at a time: the engine's own race would grant past the limit (see rls_with).
    let _rls = rls_with(rls_port, redis_port, &[("g", limit, 60)], 0, true);
    let proxies = lease_fleet(limit, rls_port);
    let admitted = hammer(&proxies, 2, "/", 3);
    let total: u64 = admitted.iter().sum();
    let claims = fleet_stat(&proxies, "g", "lease_claims");
    let errors = fleet_stat(&proxies, "g", "global_errors");
    let lapsed = fleet_stat(&proxies, "g", "lease_granted") - total;
    eprintln!(
        "lease: {total} admitted by 3 proxies ({admitted:?}) for a global limit of {limit}; \
         {claims} claims ({:.1} per 100 admitted); {lapsed} granted and unused; {errors} errors",
        claims as f64 * 100.0 / total as f64
    );
    assert!(total <= limit, "{total} admitted: over the limit");
    // Unused grants are what proxies held when the load stopped: at most a block each (a tenth
    // of the limit by default).
    assert!(total >= limit - 3 * limit / 10, "{total} admitted");
    assert!(
        claims * 100 <= total * 15,
        "{claims} claims for {total} admitted"
    );
    // Once the fleet's quota is spent, every proxy refuses at once, from what it holds.
    for p in &proxies {
        assert_eq!(
            Client::connect(p.addr).unwrap().get("/").unwrap().status,
            429
        );
    }
}

/// Which service answers, and how: the limitador engine over Redis one call at a time
/// (`serial`) or concurrently (it checks a counter, then counts, in two Redis calls), or over
/// its in-memory storage (an atomic read, then an atomic add), concurrently.
#[derive(Clone, Copy, Debug)]
enum Engine {
    RedisSerial,
    Redis,
    Memory,
}

/// The test service on `rls_port` with one limit `g` of `limit` a minute per client address,
/// on `engine`; the processes it needs (stopped when dropped).
fn service(engine: Engine, rls_port: u16, limit: u64) -> Vec<Proc> {
    let rules = [("g", limit, 60)];
    match engine {
        Engine::RedisSerial | Engine::Redis => {
            let redis_port = free_port();
            let store = redis(redis_port);
            let serial = matches!(engine, Engine::RedisSerial);
            let rls = rls_with(rls_port, redis_port, &rules, 0, serial);
            vec![store, rls]
        }
        Engine::Memory => vec![rls_service(rls_port, "memory", &limits(&rules), 0, false)],
    }
}

/// What each engine does at the limit under concurrent calls, in sync mode (every request one
/// call of 1): three proxies, four clients each at full speed on one key, limit 200. Answering
/// one call at a time, the engine admits the limit exactly; answering concurrently, it checks
/// then counts, and calls in flight together may all pass the check: at most one fewer than
/// the calls in flight at once (12) beyond the limit. The figures go to the service table
/// (docs/src/explanation/global-modes.md).
#[test]
fn each_engine_at_the_limit_under_concurrent_calls() {
    let limit = 200u64;
    let clients = 4;
    for engine in [Engine::RedisSerial, Engine::Redis, Engine::Memory] {
        let rls_port = free_port();
        let _service = service(engine, rls_port, limit);
        let config = rule_config(
            "g",
            limit,
            "minute",
            r#""mode": "sync", "timeout_ms": 2000"#,
            "deny",
        );
        let proxies: Vec<Envoy> = (0..3).map(|_| envoy(&config, rls_port)).collect();
        let total: u64 = hammer(&proxies, clients, "/", 2).iter().sum();
        eprintln!("sync over {engine:?}: {total} admitted for a limit of {limit}");
        match engine {
            Engine::RedisSerial => assert_eq!(total, limit, "{engine:?}"),
            _ => assert!(
                (limit..limit + 3 * clients as u64).contains(&total),
                "{engine:?}: {total} admitted"
            ),
        }
    }
}

/// Three Envoys of one lease rule "g" of `limit` a minute over the service on `rls_port`
/// (refusing when it cannot answer).
fn lease_fleet(limit: u64, rls_port: u16) -> Vec<Envoy> {
    let config = rule_config(
        "g",
        limit,
        "minute",
        r#""mode": "lease", "flush_ms": 20, "timeout_ms": 1000"#,
        "deny",
    );
    (0..3).map(|_| envoy(&config, rls_port)).collect()
}

/// Lease mode over a service that checks, then counts (the engine over Redis answering
/// concurrently): three proxies, two clients each at full speed on one key, limit 1,000 (blocks
/// of at most 100). Concurrent claims may all pass the service's check: C claims at once
/// overshoot by at most (C − 1) blocks; blocks that shrink near the limit (a quarter of what the
/// service last said remained) keep the blocks that race small (the bound in
/// docs/src/explanation/global-modes.md).
#[test]
fn lease_over_a_racing_service_stays_within_its_bound() {
    let limit = 1_000u64;
    let rls_port = free_port();
    let _service = service(Engine::Redis, rls_port, limit);
    let proxies = lease_fleet(limit, rls_port);
    let admitted = hammer(&proxies, 2, "/", 3);
    let total: u64 = admitted.iter().sum();
    let claims = fleet_stat(&proxies, "g", "lease_claims");
    eprintln!(
        "lease over a racing service: {total} admitted by 3 proxies ({admitted:?}) for a \
         global limit of {limit}; {claims} claims"
    );
    assert!(total <= limit + RACING_BOUND, "{total} admitted");
}

/// Lease's excess over a racing service in the test above, (C − 1) blocks: C = 9 claims in
/// flight at once (each proxy's claim ahead of need and one per client), blocks of at most 100.
const RACING_BOUND: u64 = 8 * 100;

/// A rule charged by its answers (here the body's bytes: 3 per answer, 5 reserved and trued
/// up) in each global mode, three proxies sharing a budget of 300: lease admits 100 answers
/// and never more; async reports the usage, so the fleet stops near 100 instead of the 300 it
/// would admit with each proxy alone; sync asks with the reservation as `hits_addend` and the
/// protocol cannot give back its unused part: 60.
#[test]
fn usage_charged_rules_hold_a_fleet_budget_in_every_mode() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let budget = 300u64;
    let _rls = rls_with(
        rls_port,
        redis_port,
        &[
            ("lease", budget, 60),
            ("async", budget, 60),
            ("sync", budget, 60),
        ],
        0,
        true,
    );
    let run = |mode: &str, extra: &str, rate_limited: bool| {
        let config = format!(
            r#"{{"rules": [{{"name": "{mode}", "key": ["remote_address"],
                "rate_limit": {{"requests_per_unit": {budget}, "unit": "minute"}},
                "cost": {{"response": "body_bytes", "true_up": true, "reserve": 5}},
                "global": {{"cluster": "ratelimit", "domain": "edge", "mode": "{mode}",
                            "timeout_ms": 1000{extra}}}}}]}}"#
        );
        let proxies: Vec<Envoy> = (0..3).map(|_| envoy(&config, rls_port)).collect();
        let admitted: u64 = if rate_limited {
            // Async: 20 requests a second per proxy, so that the async bound is small.
            let start = Instant::now();
            let threads: Vec<_> = proxies
                .iter()
                .map(|p| {
                    let addr = p.addr;
                    std::thread::spawn(move || {
                        let mut c = Client::connect(addr).unwrap();
                        let mut n = 0;
                        for i in 0..120u64 {
                            let due = start + Duration::from_millis(i * 50);
                            if let Some(w) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(w);
                            }
                            n += u64::from(c.get("/").unwrap().status == 200);
                        }
                        n
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        } else {
            hammer(&proxies, 2, "/", 3).iter().sum()
        };
        let charged = fleet_stat(&proxies, mode, "usage_charged");
        eprintln!("{mode}: {admitted} answers admitted, {charged} units charged, budget {budget}");
        (admitted, charged)
    };
    let (admitted, charged) = run("lease", r#", "flush_ms": 20"#, false);
    assert!(admitted * 3 <= budget, "lease: {admitted} answers of 3");
    assert!(admitted >= 80, "lease: {admitted}");
    assert_eq!(charged, admitted * 3);
    let (admitted, _) = run("async", r#", "flush_ms": 20"#, true);
    // Alone, each proxy would admit 100: 300 in all. Reported, the fleet stops near 100 (the
    // async bound: 3 proxies × 20 requests/s × (2 flushes + a round trip) ≈ 5 more).
    assert!(
        (95..=120).contains(&admitted),
        "async: {admitted} answers of 3 units for {budget}"
    );
    let (admitted, _) = run("sync", "", false);
    assert_eq!(admitted, budget / 5, "sync counts each reservation whole");
}

/// Lease mode's faults, one key (client address) each, blocks of at most 4, limit 20:
/// - the service down: what a proxy holds is still admitted, then `failure_mode` decides, at
///   once (no request waits for a service that refuses connections);
/// - the service slow: a request that must claim waits `timeout_ms`, no longer;
/// - a proxy gone with a block: the fleet loses that block (under-admission), never more;
/// - the store restarted: a key the service refused stays refused until the service's reset
///   (no claim before then); other keys claim afresh from counters starting over.
#[test]
fn lease_faults_are_bounded_and_follow_failure_mode() {
    let (redis_port, rls_port) = (free_port(), free_port());
    let mut redis_proc = Some(redis(redis_port));
    let limit = 20u64;
    let mut rls_proc = Some(rls_with(rls_port, redis_port, &[("g", limit, 60)], 0, true));
    let config = |failure_mode: &str| {
        rule_config(
            "g",
            limit,
            "minute",
            r#""mode": "lease", "max_block": 4, "flush_ms": 20, "timeout_ms": 300"#,
            failure_mode,
        )
    };
    let (open, closed) = (
        envoy(&config("allow"), rls_port),
        envoy(&config("deny"), rls_port),
    );
    let status = |e: &Envoy, from: &str| {
        Client::connect_from(e.addr, from)
            .unwrap()
            .get("/")
            .unwrap()
            .status
    };

    // A proxy gone with its block: 127.0.0.3 claims 4 on one proxy, which then stops; the
    // other admits the 16 left, and no more.
    {
        let gone = envoy(&config("deny"), rls_port);
        assert_eq!(status(&gone, "127.0.0.3"), 200);
        assert_eq!(
            gone.wait_stat(&common::metric(Some("g"), "lease_granted"), 4),
            Some(4)
        );
    }
    let admitted = (0..30)
        .filter(|_| status(&closed, "127.0.0.3") == 200)
        .count();
    assert_eq!(
        admitted as u64,
        limit - 4,
        "the block the gone proxy held is lost"
    );

    // The store restarted (counters lost): 127.0.0.3, refused by the service, stays refused
    // until the service's reset; a key never refused claims afresh.
    redis_proc.take();
    redis_proc = Some(redis(redis_port));
    // The service reconnects to its store; until then claims fail (and this proxy denies).
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(&closed, "127.0.0.4") != 200 {
        assert!(Instant::now() < deadline, "the service never came back");
        std::thread::sleep(Duration::from_millis(100));
    }
    // With the counters gone a claim would be granted: refused, it made none.
    assert_eq!(status(&closed, "127.0.0.3"), 429);

    // The service down: 127.0.0.5 holds 3 of its first block on each proxy; those are
    // admitted, then failure_mode decides, at once.
    for p in [&open, &closed] {
        assert_eq!(status(p, "127.0.0.5"), 200);
    }
    std::thread::sleep(Duration::from_millis(100)); // claims ahead, if any, answered
    rls_proc.take();
    for p in [&open, &closed] {
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(status(p, "127.0.0.5"));
        }
        assert_eq!(statuses, [200, 200, 200], "held quota outlives the service");
    }
    let t = Instant::now();
    assert_eq!(status(&open, "127.0.0.5"), 200, "fail open");
    assert_eq!(status(&closed, "127.0.0.5"), 429, "fail closed");
    assert!(
        t.elapsed() < Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    assert!(open.wait_stat(&common::metric(Some("g"), "failed_open"), 1) >= Some(1));
    assert!(closed.wait_stat(&common::metric(Some("g"), "failed_closed"), 1) >= Some(1));

    // The service slow (every answer 5 s): a request that must claim waits its timeout.
    let _slow = rls_with(rls_port, redis_port, &[("g", limit, 60)], 5_000, true);
    let t = Instant::now();
    assert_eq!(
        status(&open, "127.0.0.6"),
        200,
        "fail open after the timeout"
    );
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(280) && waited < Duration::from_millis(2_500),
        "{waited:?}"
    );
    drop(redis_proc);
}

/// A token budget per API key in lease mode, three proxies in front of one LLM API streaming
/// its answers (OpenAI chat, `stream_options.include_usage`: the usage in the last event),
/// each request reserving its `max_completion_tokens` and a token per 4 bytes of its body,
/// trued up to the 50 tokens each answer reports: the fleet charges exactly what the answers
/// used, and never more than the budget.
#[test]
fn streamed_llm_answers_hold_a_token_budget_across_three_proxies() {
    use common::llm::{Api, LlmClient, LlmUpstream, Mode};
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    let budget = 2_000u64;
    let limits = format!(
        r#"[{{"namespace": "llm", "name": "tokens", "max_value": {budget}, "seconds": 60,
             "conditions": ["descriptors[0].rule == 'tokens'"],
             "variables": ["descriptors[0]['header:x-api-key']"]}}]"#
    );
    let _rls = rls_server(rls_port, redis_port, &limits, 0, true);
    let config = format!(
        r#"{{"rules": [{{"name": "tokens", "key": ["header:x-api-key"],
            "rate_limit": {{"requests_per_unit": {budget}, "unit": "minute"}},
            "cost": {{"response": "openai", "true_up": true,
                      "reserve": {{"from": "openai", "input": "bytes/4", "default": 200}}}},
            "global": {{"cluster": "ratelimit", "domain": "llm", "mode": "lease",
                        "flush_ms": 20, "timeout_ms": 1000}}}}]}}"#
    );
    let up = LlmUpstream::start();
    let listener = common::Listener {
        upstream: Some(up.addr),
        ..common::Listener::default()
    };
    let yaml = format!(
        "{}{}",
        common::bootstrap_with(&config, &listener),
        rls_cluster(rls_port, "1s")
    );
    let proxies: Vec<Envoy> = (0..3).map(|_| Envoy::start_yaml(&yaml)).collect();
    let body = Api::Chat.request_body(Mode::Sse, true, 100);
    let start = Instant::now();
    let threads: Vec<_> = proxies
        .iter()
        .flat_map(|p| [p.addr, p.addr])
        .map(|addr| {
            let body = body.clone();
            std::thread::spawn(move || {
                let mut c = LlmClient::connect(addr).unwrap();
                let mut answered = 0u64;
                while start.elapsed() < Duration::from_secs(3) {
                    let headers = [
                        ("x-api-key", "k1"),
                        ("content-type", "application/json"),
                        ("x-test-input-tokens", "20"),
                        ("x-test-output-tokens", "30"),
                    ];
                    // A refusal closes the connection (its body was not read): a new one.
                    match c.post("/v1/chat/completions", &headers, body.as_bytes()) {
                        Ok(r) if r.status == 200 => answered += 1,
                        _ => c = LlmClient::connect(addr).unwrap(),
                    }
                }
                answered
            })
        })
        .collect();
    let answered: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let charged = fleet_stat(&proxies, "tokens", "usage_charged");
    eprintln!(
        "lease, streamed answers: {answered} answered of 50 tokens, {charged} charged, budget {budget}"
    );
    assert_eq!(charged, answered * 50, "each answer charged what it used");
    assert!(
        charged <= budget,
        "{charged} tokens charged for a budget of {budget}"
    );
    // Each request reserves 140 tokens: what the proxies hold when the budget runs low lapses.
    assert!(answered >= 30, "{answered} answered");
}
