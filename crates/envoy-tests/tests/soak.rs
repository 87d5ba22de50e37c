//! A soak under faults: one Envoy (two workers) with the build under test, driven at saturation
//! for `SOAK_SECONDS` (60 by default; the measured runs are 1800 per build) while the rate limit
//! service and its Redis are killed every 30 s and brought back on the same ports a few seconds
//! later (the service, Redis, then both, in turn).
//!
//! Traffic, each kind from its own client threads: key churn (a new key every request, beside
//! steady keys) on a local rule; streamed LLM answers (SSE, usage in the last event) charged to
//! a token rule, through the LLM test upstream; a `lease` global rule (a tenant at full speed,
//! one paced below its limit); an `async` global rule (paced); a `sync` probe in a second
//! plugin that fails open (the first fails closed).
//!
//! Every ~5 s the test samples Envoy's memory (tcmalloc's `allocated`, and the process's RSS)
//! and the filter's metrics, and prints one line per sample, then one line per fault. At the
//! end it asserts: Envoy alive and serving, no panic or crash in its log, memory flat, the lease
//! rule within its limit in every window of the service across the faults, the async rule
//! within the bound of docs/src/explanation/global-modes.md, every fault seen in the metrics,
//! and `failure_mode` followed during every outage.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::llm::{Api, LlmClient, LlmUpstream, Mode};
use common::{
    bootstrap_with, free_port, http_filter, metric, metric_of, now_ms, redis, rls_cluster,
    rls_server, wasm_path, Client, Envoy, Listener, Plugin, Proc, Response,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The lease rule: what the service grants a tenant per window, the window, the largest block.
/// The service's refusals carry no reset (limitador's over-limit answers have no counter
/// expiry), so a refused tenant waits for the rule's own window (a clock minute), and the hot
/// tenant gets a service window about once a minute; the paced one, every 10 s.
const LEASE_LIMIT: u64 = 200;
const LEASE_WINDOW_MS: u64 = 10_000;
const MAX_BLOCK: u64 = 8;
/// The async rule: the service's limit per second; the rule's own (local) limit per second is
/// four times that: this Envoy stands for one of four equally busy replicas, so the service,
/// not the local counter, is what holds the key (as in a fleet), and the local limit is what
/// holds it alone during an outage.
const ASYNC_LIMIT: u64 = 50;
const ASYNC_LOCAL: u64 = 4 * ASYNC_LIMIT;
const ASYNC_FLUSH_MS: u64 = 20;
/// The async client's pace, requests a second.
const ASYNC_RATE: u64 = 400;
/// The paced lease tenant's rate, requests a second (its limit is 20 a second).
const SLOW_RATE: u64 = 10;
/// Tokens each LLM answer reports (input + output).
const LLM_TOKENS: u64 = 20 + 30;
/// Steady churn-rule keys, and their limit per second.
const STEADY_KEYS: u64 = 4;
const CHURN_LIMIT: u64 = 5;
/// Faults: the first after this long, then every period; each outage lasts `DOWN`.
const FIRST_FAULT: Duration = Duration::from_secs(15);
const FAULT_PERIOD: Duration = Duration::from_secs(30);
const DOWN: Duration = Duration::from_secs(4);
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// The plugin that fails closed: the lease and async rules, the churn rule, the token rule.
fn test_config() -> String {
    format!(
        r#"{{"failure_mode": "deny", "rules": [
  {{"name": "lease", "match": {{"path": "/lease"}}, "key": ["header:x-tenant"],
    "rate_limit": {{"requests_per_unit": {LEASE_LIMIT}, "unit": "minute"}},
    "global": {{"cluster": "ratelimit", "domain": "edge", "mode": "lease",
                "max_block": {MAX_BLOCK}, "flush_ms": 20, "timeout_ms": 300}}}},
  {{"name": "async", "match": {{"path": "/async"}}, "key": ["header:x-tenant"],
    "algorithm": "fixed_window",
    "rate_limit": {{"requests_per_unit": {ASYNC_LOCAL}, "unit": "second"}},
    "global": {{"cluster": "ratelimit", "domain": "edge", "mode": "async",
                "flush_ms": {ASYNC_FLUSH_MS}, "timeout_ms": 200}}}},
  {{"name": "churn", "match": {{"path": "/churn"}}, "key": ["header:x-key"],
    "rate_limit": {{"requests_per_unit": {CHURN_LIMIT}, "unit": "second"}}}},
  {{"name": "tokens", "match": {{"path_prefix": "/v1/"}}, "key": ["header:x-api-key"],
    "rate_limit": {{"requests_per_unit": 1000000, "unit": "minute"}},
    "cost": {{"response": "openai", "true_up": true,
              "reserve": {{"from": "openai", "input": "bytes/4", "default": 200}}}}}}]}}"#
    )
}

/// The plugin that fails open: a sync probe whose limit is never reached.
const OPEN_CONFIG: &str = r#"{"failure_mode": "allow", "rules": [
  {"name": "probe", "match": {"path": "/probe"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 1000000, "unit": "minute"},
   "global": {"cluster": "ratelimit", "domain": "edge", "mode": "sync", "timeout_ms": 500}}]}"#;

/// The service's limits (Limitador's terms): its windows start at a key's first hit.
fn limits() -> String {
    let limit = |name: &str, max: u64, seconds: u64, var: &str| {
        format!(
            r#"{{"namespace": "edge", "name": "{name}", "max_value": {max}, "seconds": {seconds},
                 "conditions": ["descriptors[0].rule == '{name}'"],
                 "variables": ["descriptors[0]{var}"]}}"#
        )
    };
    format!(
        "[{}, {}, {}]",
        limit(
            "lease",
            LEASE_LIMIT,
            LEASE_WINDOW_MS / 1000,
            "['header:x-tenant']"
        ),
        limit("async", ASYNC_LIMIT, 1, "['header:x-tenant']"),
        limit("probe", 1_000_000_000, 60, ".remote_address"),
    )
}

/// The bootstrap: both plugins in one chain; `/v1/` to the LLM upstream, the rest answered by
/// Envoy; the `ratelimit` cluster.
fn yaml(llm: SocketAddr, rls_port: u16) -> String {
    let listener = Listener::to(llm);
    let base = bootstrap_with(&test_config(), &listener);
    let open = http_filter(
        &Plugin {
            name: "open",
            root_id: "open",
            vm_id: Some("open"),
            failure_policy: None,
        },
        OPEN_CONFIG,
        &wasm_path(),
    );
    let router = "          - name: envoy.filters.http.router";
    let route = "              - match: {prefix: \"/\"}\n                route: {cluster: upstream, timeout: 60s}";
    assert!(base.contains(router) && base.contains(route), "{base}");
    let routes = "              - match: {prefix: \"/v1/\"}\n                route: {cluster: upstream, timeout: 60s}\n              - match: {prefix: \"/\"}\n                direct_response: {status: 200, body: {inline_string: \"ok\\n\"}}";
    let yaml = base
        .replacen(router, &format!("{open}{router}"), 1)
        .replacen(route, routes, 1);
    format!("{yaml}{}", rls_cluster(rls_port, "1s"))
}

/// The service and its store, restartable on the same ports.
struct Backend {
    redis_port: u16,
    rls_port: u16,
    redis: Option<Proc>,
    rls: Option<Proc>,
}

impl Backend {
    fn start() -> Backend {
        let mut b = Backend {
            redis_port: free_port(),
            rls_port: free_port(),
            redis: None,
            rls: None,
        };
        b.up(true, true);
        b
    }

    /// Starts what is down (Redis first).
    fn up(&mut self, redis_too: bool, rls_too: bool) {
        if redis_too && self.redis.is_none() {
            self.redis = Some(redis(self.redis_port));
        }
        if rls_too && self.rls.is_none() {
            self.rls = Some(rls_server(
                self.rls_port,
                self.redis_port,
                &limits(),
                0,
                true,
            ));
        }
    }
}

/// Envoy's process id, found by its log file on its command line (for its RSS).
fn envoy_pid(envoy: &Envoy) -> Option<u32> {
    let needle = envoy.log.display().to_string();
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmd)
            .contains(needle.as_str())
            .then_some(pid)
    })
}

/// A process's resident set, bytes (`None`: it is gone).
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// One response as a client saw it: when it was sent and received (ms since the epoch), its
/// status, and the `t` of its `ratelimit` field (s).
#[derive(Clone, Copy, Debug)]
struct Seen {
    sent: u64,
    recv: u64,
    ok: bool,
    t: Option<u64>,
}

/// The `t` parameter of the first item of a `ratelimit` field.
fn reset_of(r: &Response) -> Option<u64> {
    r.header("ratelimit")?
        .split(';')
        .find_map(|p| p.trim().strip_prefix("t="))?
        .split(',')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// What every client thread shares.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// Requests answered (any status), for the request rate of each sample.
    requests: AtomicU64,
    /// Transport errors (connection refused, reset, timed out, bad framing).
    errors: AtomicU64,
    churn_new: AtomicU64,
    churn_new_refused: AtomicU64,
    steady_admitted: AtomicU64,
    llm_answered: AtomicU64,
    llm_refused: AtomicU64,
    llm_broken: AtomicU64,
    hot: Mutex<Vec<Seen>>,
    hot_refused: AtomicU64,
    slow: Mutex<Vec<Seen>>,
    asyncs: Mutex<Vec<Seen>>,
    /// Probes: (sent, round trip ms, status, the service answered).
    probes: Mutex<Vec<(u64, u64, u16, bool)>>,
}

/// Stops the client threads when the test ends, however it ends.
struct StopOnDrop(Arc<Shared>);
impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::SeqCst);
    }
}

/// The connection in `c`, opened by `connect` if there is none; None when it cannot be opened
/// (an error counted, after a pause).
fn connected<'a, C>(
    c: &'a mut Option<C>,
    connect: impl FnOnce() -> std::io::Result<C>,
    shared: &Shared,
) -> Option<&'a mut C> {
    if c.is_none() {
        match connect() {
            Ok(conn) => *c = Some(conn),
            Err(_) => {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
                return None;
            }
        }
    }
    c.as_mut()
}

/// Runs `f` on a kept-alive connection until told to stop, reconnecting after an error.
/// `f` returns the pause before its next request.
fn client_loop(
    addr: SocketAddr,
    shared: Arc<Shared>,
    mut f: impl FnMut(&mut Client, &Shared) -> std::io::Result<Duration> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut c: Option<Client> = None;
        while !shared.stop.load(Ordering::Relaxed) {
            let Some(conn) = connected(&mut c, || Client::connect(addr), &shared) else {
                continue;
            };
            match f(conn, &shared) {
                Ok(pause) => {
                    shared.requests.fetch_add(1, Ordering::Relaxed);
                    if !pause.is_zero() {
                        std::thread::sleep(pause);
                    }
                }
                Err(_) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    c = None;
                }
            }
        }
    })
}

/// A pacer: the pause before the next of `rate` requests a second from `start` (a late client
/// skips the slots it missed rather than catching up in a burst).
struct Pace {
    start: Instant,
    rate: u64,
    slot: u64,
}

impl Pace {
    fn new(rate: u64) -> Pace {
        Pace {
            start: Instant::now(),
            rate,
            slot: 0,
        }
    }

    fn next(&mut self) -> Duration {
        let now_slot = self.start.elapsed().as_micros() as u64 * self.rate / 1_000_000;
        self.slot = (self.slot + 1).max(now_slot);
        let due = self.start + Duration::from_micros(self.slot * 1_000_000 / self.rate);
        due.saturating_duration_since(Instant::now())
    }
}

fn seen(sent: u64, r: &Response) -> Seen {
    Seen {
        sent,
        recv: now_ms(),
        ok: r.status == 200,
        t: reset_of(r),
    }
}

fn start_clients(addr: SocketAddr, shared: &Arc<Shared>) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    // Key churn: two threads at full speed, a new key each request, every fourth request one
    // of the steady keys instead.
    for thread in 0..2u64 {
        let mut n = 0u64;
        threads.push(client_loop(addr, shared.clone(), move |c, s| {
            n += 1;
            let steady = n.is_multiple_of(4);
            let key = if steady {
                format!("steady-{}", (n / 4) % STEADY_KEYS)
            } else {
                format!("churn-{thread}-{n}")
            };
            let r = c.send("GET", "/churn", &[("x-key", &key)])?;
            match (steady, r.status) {
                (true, 200) => {
                    s.steady_admitted.fetch_add(1, Ordering::Relaxed);
                }
                (true, _) => {}
                (false, status) => {
                    s.churn_new.fetch_add(1, Ordering::Relaxed);
                    if status != 200 {
                        s.churn_new_refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok(Duration::ZERO)
        }));
    }
    // The lease rule: tenant "hot" at full speed (over its limit in every window).
    threads.push(client_loop(addr, shared.clone(), |c, s| {
        let sent = now_ms();
        let r = c.send("GET", "/lease", &[("x-tenant", "hot")])?;
        if r.status == 200 {
            s.hot.lock().unwrap().push(seen(sent, &r));
        } else {
            s.hot_refused.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Duration::ZERO)
    }));
    // Tenant "slow", paced below its limit: it claims every second or so, outages included.
    let mut pace = Pace::new(SLOW_RATE);
    threads.push(client_loop(addr, shared.clone(), move |c, s| {
        let sent = now_ms();
        let r = c.send("GET", "/lease", &[("x-tenant", "slow")])?;
        s.slow.lock().unwrap().push(seen(sent, &r));
        Ok(pace.next())
    }));
    // The async rule, paced.
    let mut pace = Pace::new(ASYNC_RATE);
    threads.push(client_loop(addr, shared.clone(), move |c, s| {
        let sent = now_ms();
        let r = c.send("GET", "/async", &[("x-tenant", "a")])?;
        s.asyncs.lock().unwrap().push(seen(sent, &r));
        Ok(pace.next())
    }));
    // The fail-open sync probe, ten a second: it also measures the service's round trip.
    threads.push(client_loop(addr, shared.clone(), |c, s| {
        let sent = now_ms();
        let t = Instant::now();
        let r = c.get("/probe")?;
        let trip = t.elapsed().as_millis() as u64;
        let answered = r.header("x-rls-server") == Some("limitador");
        s.probes
            .lock()
            .unwrap()
            .push((sent, trip, r.status, answered));
        Ok(Duration::from_millis(100))
    }));
    // LLM streams: two threads, a new API key each stream (the token rule's keys churn too).
    for thread in 0..2u64 {
        let shared = shared.clone();
        threads.push(std::thread::spawn(move || {
            let body = Api::Chat.request_body(Mode::Sse, true, 100);
            let path = Api::Chat.path(Mode::Sse);
            let mut c: Option<LlmClient> = None;
            let mut n = 0u64;
            while !shared.stop.load(Ordering::Relaxed) {
                let Some(conn) = connected(&mut c, || LlmClient::connect(addr), &shared) else {
                    continue;
                };
                n += 1;
                let key = format!("llm-{thread}-{n}");
                let headers = [
                    ("x-api-key", key.as_str()),
                    ("content-type", "application/json"),
                    ("x-test-input-tokens", "20"),
                    ("x-test-output-tokens", "30"),
                    ("x-test-events", "5"),
                    ("x-test-delay-ms", "5"),
                ];
                match conn.post(&path, &headers, body.as_bytes()) {
                    Ok(r) if r.status == 200 && r.complete => {
                        let usage = r
                            .events()
                            .iter()
                            .any(|e| e.data.contains("\"total_tokens\":50"));
                        let counter = if usage {
                            &shared.llm_answered
                        } else {
                            &shared.llm_broken
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        shared.requests.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) if r.status == 200 => {
                        shared.llm_broken.fetch_add(1, Ordering::Relaxed);
                        c = None;
                    }
                    Ok(_) => {
                        shared.llm_refused.fetch_add(1, Ordering::Relaxed);
                        c = None;
                    }
                    Err(_) => {
                        shared.errors.fetch_add(1, Ordering::Relaxed);
                        c = None;
                    }
                }
            }
        }));
    }
    threads
}

/// The filter's metrics the test follows.
#[derive(Clone, Copy, Debug, Default)]
struct Metrics {
    async_errors: u64,
    lease_errors: u64,
    probe_errors: u64,
    failed_open: u64,
    failed_closed: u64,
    reports_lost: u64,
    lease_granted: u64,
    tracked_keys: u64,
}

fn metrics(envoy: &Envoy) -> Metrics {
    let s = |name: String| envoy.stat(&name).unwrap_or(0);
    Metrics {
        async_errors: s(metric(Some("async"), "global_errors")),
        lease_errors: s(metric(Some("lease"), "global_errors")),
        probe_errors: s(metric_of("open", Some("probe"), "global_errors")),
        failed_open: s(metric_of("open", Some("probe"), "failed_open")),
        failed_closed: s(metric(Some("lease"), "failed_closed")),
        reports_lost: s(metric(Some("async"), "reports_lost")),
        lease_granted: s(metric(Some("lease"), "lease_granted")),
        tracked_keys: s(metric(None, "tracked_keys")),
    }
}

/// One fault: what went down, when (ms since the epoch), and the metrics around it.
#[derive(Debug)]
struct Fault {
    what: &'static str,
    redis: bool,
    down: u64,
    back: u64,
    /// When the probe was answered by the service again.
    recovered: u64,
    /// The service was restarted to get over its Redis's restart.
    kicked: bool,
    before: Metrics,
    after: Metrics,
}

/// One sample of Envoy's state.
struct Sample {
    secs: u64,
    allocated: u64,
    rss: u64,
    metrics: Metrics,
    requests: u64,
    faults: usize,
}

const MIB: f64 = 1024.0 * 1024.0;

fn print_sample(s: &Sample, rate: u64) {
    let m = &s.metrics;
    eprintln!(
        "soak sample t={:>5}s alloc={:>7.1}MiB rss={:>7.1}MiB keys={:>6} req/s={:>5} \
         global_errors(async/lease/probe)={}/{}/{} failed_open={} failed_closed={} \
         reports_lost={} granted={} faults={}",
        s.secs,
        s.allocated as f64 / MIB,
        s.rss as f64 / MIB,
        m.tracked_keys,
        rate,
        m.async_errors,
        m.lease_errors,
        m.probe_errors,
        m.failed_open,
        m.failed_closed,
        m.reports_lost,
        m.lease_granted,
        s.faults
    );
}

/// The lease rule's admissions of one tenant, grouped by the window of the service that
/// granted them: an admitted response's `t` is when the quota it came from lapses (the
/// service's reset counted from the claim, never past its window's end), so `recv + t` names
/// the window (to a second; windows are 10 s apart). Without a store restart in it, a window
/// admits at most the limit (the service answers one call at a time: it checks and counts in
/// one step). A store restart at `r` loses the counters: the window it cut admits at most the
/// limit before `r`; after `r`, what the proxy held then (≤ 1.5 blocks, the documented bound;
/// 2 here) and the first new window (whose grants may be merged into the old lease, which
/// lapses at the earlier end) admit at most the limit plus what was held.
fn check_lease(tenant: &str, admitted: &[Seen], restarts: &[u64]) -> (usize, u64) {
    let mut adm: Vec<(u64, u64)> = admitted
        .iter()
        .map(|s| {
            (
                s.recv,
                s.recv
                    + 1000
                        * s.t
                            .unwrap_or_else(|| panic!("an admitted lease response without t")),
            )
        })
        .collect();
    adm.sort_by_key(|&(_, e)| e);
    let mut groups: Vec<Vec<(u64, u64)>> = Vec::new();
    for a in adm {
        match groups.last_mut() {
            Some(g) if a.1 < g[0].1 + 3_000 => g.push(a),
            _ => groups.push(vec![a]),
        }
    }
    let first_t = |g: &[(u64, u64)]| g.iter().map(|a| a.0).min().unwrap();
    for g in groups.iter().filter(|_| tenant == "hot") {
        eprintln!(
            "soak lease {tenant} window ending ~{}: {} admitted from {}",
            g[0].1,
            g.len(),
            first_t(g)
        );
    }
    let mut combined = vec![false; groups.len()];
    let mut worst = 0u64;
    for &r in restarts {
        let Some(i) = groups
            .iter()
            .position(|g| first_t(g) < r && g.iter().any(|a| a.0 >= r))
        else {
            continue;
        };
        let before = groups[i].iter().filter(|a| a.0 < r).count() as u64;
        let after = groups[i].len() as u64 - before;
        let next = groups.iter().position(|g| first_t(g) >= r).map_or(0, |j| {
            combined[j] = true;
            groups[j].len() as u64
        });
        combined[i] = true;
        assert!(
            before <= LEASE_LIMIT,
            "lease {tenant}: {before} admitted in a window before the store restarted at {r}"
        );
        assert!(
            after + next <= LEASE_LIMIT + 2 * MAX_BLOCK,
            "lease {tenant}: {after} + {next} admitted after the store restarted at {r}"
        );
        worst = worst.max(before);
    }
    for (g, c) in groups.iter().zip(&combined) {
        let n = g.len() as u64;
        worst = worst.max(n);
        assert!(
            *c || n <= LEASE_LIMIT,
            "lease {tenant}: {n} admitted in the service window ending ~{} (limit {LEASE_LIMIT})",
            g[0].1
        );
    }
    (groups.len(), worst)
}

#[test]
fn soak_under_faults() {
    let seconds: u64 = common::env_number("SOAK_SECONDS", 60);
    let duration = Duration::from_secs(seconds);
    let up = LlmUpstream::start();
    up.keep_bodies(0);
    let mut backend = Backend::start();
    let envoy = Envoy::start_yaml(&yaml(up.addr, backend.rls_port));
    let pid = envoy_pid(&envoy).expect("envoy's process");
    let shared = Arc::new(Shared::default());
    let _stop = StopOnDrop(shared.clone());
    let start = Instant::now();
    let threads = start_clients(envoy.addr, &shared);

    let mut samples: Vec<Sample> = Vec::new();
    let mut faults: Vec<Fault> = Vec::new();
    let mut next_sample = SAMPLE_EVERY;
    let mut next_fault = FIRST_FAULT;
    // The last fault ends well before the run does, so its recovery is seen.
    while start.elapsed() < duration {
        if start.elapsed() >= next_fault && next_fault + DOWN + Duration::from_secs(8) < duration {
            let (what, redis_down, rls_down) = match faults.len() % 3 {
                0 => ("service", false, true),
                1 => ("redis", true, false),
                _ => ("both", true, true),
            };
            let before = metrics(&envoy);
            let down = now_ms();
            if rls_down {
                backend.rls.take();
            }
            if redis_down {
                backend.redis.take();
            }
            std::thread::sleep(DOWN);
            let back = now_ms();
            backend.up(redis_down, rls_down);
            // Recovered: the probe is answered by the service again (≤ 30 s: a restarted
            // service is reached again after Envoy's reconnection backoff, which grows with the
            // failures before; 9.9 s was seen). The test service
            // does not get over a Redis gone for more than a second or so (its Redis client
            // stays broken: an rls-server matter, not the filter's): if it has not recovered 5 s
            // after its Redis came back, it is restarted too (`kicked` in the table).
            let deadline = Instant::now() + Duration::from_secs(30);
            let kick_at = Instant::now() + Duration::from_secs(5);
            let mut kicked = false;
            let recovered = loop {
                let seen = shared
                    .probes
                    .lock()
                    .unwrap()
                    .iter()
                    .rev()
                    .take_while(|p| p.0 >= back)
                    .find(|p| p.3)
                    .map(|p| p.0);
                if let Some(t) = seen {
                    break t;
                }
                if !rls_down && !kicked && Instant::now() > kick_at {
                    backend.rls.take();
                    backend.up(false, true);
                    kicked = true;
                }
                if Instant::now() >= deadline {
                    let log = envoy.log();
                    let tail: Vec<&str> = log.lines().rev().take(60).collect();
                    let probes: Vec<_> = shared
                        .probes
                        .lock()
                        .unwrap()
                        .iter()
                        .rev()
                        .take(20)
                        .copied()
                        .collect();
                    panic!(
                        "fault {}: the service never answered again; the last probes (sent, trip, \
                         status, answered) {probes:?}; the end of Envoy's log:\n{}",
                        faults.len(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            // Counters are published once a second.
            std::thread::sleep(Duration::from_millis(2_100));
            faults.push(Fault {
                what,
                redis: redis_down,
                down,
                back,
                recovered,
                kicked,
                before,
                after: metrics(&envoy),
            });
            next_fault += FAULT_PERIOD;
        }
        if start.elapsed() >= next_sample {
            let requests = shared.requests.load(Ordering::Relaxed);
            let s = Sample {
                secs: start.elapsed().as_secs(),
                allocated: envoy.memory_allocated(),
                rss: rss(pid).expect("envoy is gone"),
                metrics: metrics(&envoy),
                requests,
                faults: faults.len(),
            };
            let rate = match samples.last() {
                Some(p) => (requests - p.requests) / (s.secs - p.secs).max(1),
                None => requests / s.secs.max(1),
            };
            print_sample(&s, rate);
            samples.push(s);
            next_sample += SAMPLE_EVERY;
            if next_sample <= start.elapsed() {
                next_sample = start.elapsed() + SAMPLE_EVERY;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    shared.stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }

    // Envoy alive and still serving, its log clean.
    assert!(rss(pid).is_some(), "envoy exited");
    let mut c = Client::connect(envoy.addr).unwrap();
    let r = c.send("GET", "/churn", &[("x-key", "last")]).unwrap();
    assert_eq!(r.status, 200, "envoy no longer serves");
    let llm = LlmClient::connect(envoy.addr)
        .unwrap()
        .post(
            &Api::Chat.path(Mode::Sse),
            &[
                ("x-api-key", "last"),
                ("content-type", "application/json"),
                ("x-test-input-tokens", "20"),
                ("x-test-output-tokens", "30"),
            ],
            Api::Chat.request_body(Mode::Sse, true, 100).as_bytes(),
        )
        .unwrap();
    assert!(llm.status == 200 && llm.complete, "{}", llm.status);
    let log = envoy.log();
    for needle in [
        "panicked",
        "Caught ",
        "[critical]",
        "Backtrace (",
        "wasm trap",
    ] {
        let line = log.lines().find(|l| l.contains(needle));
        assert!(line.is_none(), "envoy's log: {line:?}");
    }

    // The fault table.
    let probes = shared.probes.lock().unwrap().clone();
    let slow = shared.slow.lock().unwrap().clone();
    let asyncs = shared.asyncs.lock().unwrap().clone();
    let t0 = now_ms() - start.elapsed().as_millis() as u64;
    for (i, f) in faults.iter().enumerate() {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        let slow_in: Vec<&Seen> = slow
            .iter()
            .filter(|s| s.sent >= f.down && s.recv < f.back)
            .collect();
        let async_in = asyncs
            .iter()
            .filter(|s| s.ok && s.sent >= f.down + 1_000 && s.recv < f.back)
            .count();
        eprintln!(
            "soak fault {i:>3} {:<7} at {:>5}s down {:>4} ms recovered +{:>5} ms{}: \
             global_errors(async/lease/probe) +{}/+{}/+{} failed_open +{} failed_closed +{} \
             reports_lost +{}; slow tenant {} admitted / {} refused; async {} admitted",
            f.what,
            (f.down - t0) / 1000,
            f.back - f.down,
            d(f.back, f.recovered),
            if f.kicked { " (service kicked)" } else { "" },
            d(f.before.async_errors, f.after.async_errors),
            d(f.before.lease_errors, f.after.lease_errors),
            d(f.before.probe_errors, f.after.probe_errors),
            d(f.before.failed_open, f.after.failed_open),
            d(f.before.failed_closed, f.after.failed_closed),
            d(f.before.reports_lost, f.after.reports_lost),
            slow_in.iter().filter(|s| s.ok).count(),
            slow_in.iter().filter(|s| !s.ok).count(),
            async_in,
        );
    }
    let errors = shared.errors.load(Ordering::Relaxed);
    eprintln!(
        "soak totals: {} requests, {errors} transport errors; churn {} new keys ({} refused), \
         {} steady admitted; llm {} answered, {} refused, {} broken; lease hot {} admitted / {} \
         refused, slow {} of {}; async {} of {}",
        shared.requests.load(Ordering::Relaxed),
        shared.churn_new.load(Ordering::Relaxed),
        shared.churn_new_refused.load(Ordering::Relaxed),
        shared.steady_admitted.load(Ordering::Relaxed),
        shared.llm_answered.load(Ordering::Relaxed),
        shared.llm_refused.load(Ordering::Relaxed),
        shared.llm_broken.load(Ordering::Relaxed),
        shared.hot.lock().unwrap().len(),
        shared.hot_refused.load(Ordering::Relaxed),
        slow.iter().filter(|s| s.ok).count(),
        slow.len(),
        asyncs.iter().filter(|s| s.ok).count(),
        asyncs.len(),
    );
    assert!(!faults.is_empty(), "no fault in {seconds} s");

    // Every fault seen in the metrics, and failure_mode followed during every outage.
    for (i, f) in faults.iter().enumerate() {
        let (b, a) = (&f.before, &f.after);
        assert!(
            a.async_errors > b.async_errors,
            "fault {i} ({}): async",
            f.what
        );
        assert!(
            a.probe_errors > b.probe_errors,
            "fault {i} ({}): probe",
            f.what
        );
        assert!(
            a.failed_open > b.failed_open,
            "fault {i} ({}): failed_open",
            f.what
        );
        assert!(
            a.failed_closed > b.failed_closed && a.lease_errors > b.lease_errors,
            "fault {i} ({}): lease failed_closed / global_errors",
            f.what
        );
        assert!(
            a.reports_lost > b.reports_lost,
            "fault {i} ({}): reports_lost",
            f.what
        );
        // The probe fails open: answered 200 (without the service) all through the outage.
        let during: Vec<_> = probes
            .iter()
            .filter(|p| p.0 >= f.down + 500 && p.0 + p.1 < f.back)
            .collect();
        assert!(!during.is_empty(), "fault {i}: no probe during the outage");
        assert!(
            during.iter().all(|p| p.2 == 200 && !p.3),
            "fault {i}: probes during the outage {during:?}"
        );
        // The lease tenant below its limit fails closed once what it held is spent: refused,
        // and admitted no more than it can have held (1.5 blocks documented; 2 here).
        let slow_in: Vec<&Seen> = slow
            .iter()
            .filter(|s| s.sent >= f.down && s.recv < f.back)
            .collect();
        let admitted = slow_in.iter().filter(|s| s.ok).count() as u64;
        assert!(
            admitted <= 2 * MAX_BLOCK,
            "fault {i}: the slow tenant was admitted {admitted} times without a service"
        );
        assert!(
            slow_in.iter().any(|s| !s.ok),
            "fault {i}: the slow tenant was never refused (fail closed)"
        );
        // Async never waits for nor fails with the service: it admits up to its local limit.
        let secs = (f.back - f.down - 1_000) as f64 / 1000.0;
        let async_in = asyncs
            .iter()
            .filter(|s| s.ok && s.sent >= f.down + 1_000 && s.recv < f.back)
            .count() as f64;
        assert!(
            async_in >= secs * ASYNC_LOCAL as f64 / 2.0,
            "fault {i}: async admitted {async_in} in {secs} s without a service"
        );
    }

    // No transport error: Envoy never dropped a connection nor stalled a client for 10 s.
    assert_eq!(errors, 0, "transport errors");
    // New keys are always admitted; steady keys within their limit (the churn never evicts
    // them: a lost counter would admit them afresh).
    assert_eq!(shared.churn_new_refused.load(Ordering::Relaxed), 0);
    assert!(shared.churn_new.load(Ordering::Relaxed) > 0);
    let steady = shared.steady_admitted.load(Ordering::Relaxed);
    let evicted = envoy.stat(&metric(Some("churn"), "slot_evictions"));
    assert!(
        steady <= STEADY_KEYS * CHURN_LIMIT * (seconds + 2),
        "{steady} steady admissions in {seconds} s (the churn rule's slot_evictions: {evicted:?})"
    );
    // Every streamed answer charged its usage, exactly.
    let answered = shared.llm_answered.load(Ordering::Relaxed) + 1; // and the last one
    assert!(answered > 10, "{answered} LLM answers");
    assert_eq!(shared.llm_broken.load(Ordering::Relaxed), 0);
    assert_eq!(shared.llm_refused.load(Ordering::Relaxed), 0);
    let name = metric(Some("tokens"), "usage_charged");
    let charged = envoy.wait_stat(&name, answered * LLM_TOKENS);
    eprintln!("soak tokens: {charged:?} charged for {answered} answers");
    assert_eq!(charged, Some(answered * LLM_TOKENS), "tokens charged");

    // The lease rule within its limit in every window of the service.
    let restarts: Vec<u64> = faults.iter().filter(|f| f.redis).map(|f| f.down).collect();
    let hot = shared.hot.lock().unwrap().clone();
    let (windows, worst) = check_lease("hot", &hot, &restarts);
    let slow_ok: Vec<Seen> = slow.iter().copied().filter(|s| s.ok).collect();
    check_lease("slow", &slow_ok, &restarts);
    eprintln!(
        "soak lease: {windows} windows of the hot tenant, at most {worst} admitted (limit {LEASE_LIMIT})"
    );
    assert!(
        windows as u64 >= (seconds / 120).max(1),
        "{windows} windows"
    );
    assert!(
        worst >= LEASE_LIMIT / 2,
        "the hot tenant never used its limit"
    );

    // The async rule. Its local limit holds in every second, faults or not.
    let mut per_second = std::collections::HashMap::<u64, u64>::new();
    for s in asyncs
        .iter()
        .filter(|s| s.ok && s.sent / 1000 == s.recv / 1000)
    {
        *per_second.entry(s.sent / 1000).or_default() += 1;
    }
    let most = per_second.values().max().copied().unwrap_or(0);
    assert!(most <= ASYNC_LOCAL, "async: {most} admitted in one second");
    // The service's window: admissions come in bursts, one per window of the service (a key
    // over the service's limit is blocked until the window's end). Away from the faults, each
    // burst admits at most the limit plus the rate × (2 × flush + a round trip) plus one: the
    // bound of global-modes.md, with the round trip the p99 of the probes' (at least 10 ms).
    let near_fault = |t: u64| {
        faults
            .iter()
            .any(|f| t + 2_000 >= f.down && t <= f.recovered + 2_000)
    };
    let mut trips: Vec<u64> = probes
        .iter()
        .filter(|p| p.3 && !near_fault(p.0))
        .map(|p| p.1)
        .collect();
    trips.sort_unstable();
    let trip_ms = trips
        .get(trips.len() * 99 / 100)
        .copied()
        .unwrap_or(0)
        .max(10);
    let bound = ASYNC_LIMIT + ASYNC_RATE * (2 * ASYNC_FLUSH_MS + trip_ms) / 1000 + 1;
    let mut bursts: Vec<Vec<u64>> = Vec::new();
    let mut last = 0u64;
    for s in asyncs.iter().filter(|s| s.ok) {
        match bursts.last_mut() {
            Some(b) if s.sent < last + 300 => b.push(s.sent),
            _ => bursts.push(vec![s.sent]),
        }
        last = s.recv;
    }
    let clean: Vec<&Vec<u64>> = bursts
        .iter()
        .filter(|b| !near_fault(b[0]) && !near_fault(*b.last().unwrap()))
        .collect();
    let largest = clean.iter().map(|b| b.len() as u64).max().unwrap_or(0);
    eprintln!(
        "soak async: {} bursts away from faults, at most {largest} admitted (service limit \
         {ASYNC_LIMIT}, bound {bound} with a round trip of {trip_ms} ms; local limit {ASYNC_LOCAL})",
        clean.len()
    );
    assert!(
        largest <= bound,
        "async: {largest} admitted in one window, bound {bound}"
    );
    assert!(
        bound < ASYNC_LOCAL,
        "round trip {trip_ms} ms: the bound is not worth testing"
    );
    assert!(
        clean.len() as u64 >= seconds / 4,
        "{} clean windows: the service hardly ever blocked the key",
        clean.len()
    );

    // Memory flat: the largest of the last third of the samples (after a warm-up of 10 s) is
    // at most the largest of the first third plus 8 MiB and 5 % (allocated), or plus 24 MiB and
    // 10 % (RSS, which holds what the allocators keep and V8's heaps).
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.secs >= 10).collect();
    assert!(warm.len() >= 6, "{} samples", warm.len());
    let third = warm.len() / 3;
    let max = |xs: &[&Sample], f: fn(&Sample) -> u64| xs.iter().map(|s| f(s)).max().unwrap();
    let (first, last) = (&warm[..third], &warm[warm.len() - third..]);
    for (what, f, fixed, pct) in [
        (
            "allocated",
            (|s: &Sample| s.allocated) as fn(&Sample) -> u64,
            8.0,
            5,
        ),
        ("rss", |s: &Sample| s.rss, 24.0, 10),
    ] {
        let (a, b) = (max(first, f), max(last, f));
        let allowed = a + (fixed * MIB) as u64 + a * pct / 100;
        eprintln!(
            "soak memory {what}: first third max {:.1} MiB, last third max {:.1} MiB, allowed {:.1} MiB",
            a as f64 / MIB,
            b as f64 / MIB,
            allowed as f64 / MIB
        );
        assert!(b <= allowed, "{what} grew: {a} → {b}");
    }
    drop(backend);
}
