//! The Grafana dashboard and the Prometheus alert rules of `deploy/`, checked by a real
//! Prometheus: it runs from `deploy/prometheus/prometheus.yaml` (its relabelling included; the
//! target and the intervals replaced) and scrapes a real Envoy with the build under test every
//! second, while the test drives traffic that gives every panel something to show (allowed and
//! limited requests, a shadow rule, tokens charged, slots in flight, held requests, a failing
//! rate limit service, an elastic rule dropping to its floor, evicted keys, and global rules on a
//! live service: a lease claimed and refused, usage reported). Then every query of
//! the dashboard (panels and template variables) and every alert expression, read from the files
//! themselves, runs through Prometheus's HTTP API and must return the series the traffic made.
//! `promtool` checks both files.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::upstream::Upstream;
use common::{
    bootstrap_with, free_port, now_ms, redis, rls_cluster, rls_cluster_named, rls_server, Build,
    Client, Envoy, Listener,
};
use ratelimit_config::manifest::yaml_documents;
use ratelimit_core::metrics::{self, Counter, Gauge, ELASTIC_FACTOR};
use serde_json::{json, Value};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo(path: &str) -> PathBuf {
    common::root().join(path)
}

const DASHBOARD: &str = "deploy/grafana/wasm-ratelimit.json";
const ALERTS: &str = "deploy/prometheus/alerts.yaml";
const CONFIG: &str = "deploy/prometheus/prometheus.yaml";

/// `$PROMETHEUS`, else `prometheus` on the PATH (Debian's package; `make integration` and
/// `.ci/run` install it).
fn prometheus_bin() -> String {
    std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into())
}

fn promtool_bin() -> String {
    std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into())
}

/// Percent-encodes a query-string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// One series of an instant query's result.
#[derive(Debug, Clone)]
struct Series {
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Series {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// A running Prometheus, killed (and its storage removed) on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
    /// The time queries are evaluated at (seconds since the epoch); `None`: now.
    at: Cell<Option<f64>>,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Starts Prometheus from the shipped configuration, scraping `target` (Envoy's admin) and
    /// evaluating the shipped alert rules every second; waits (≤ 30 s) until it is ready.
    fn start(target: SocketAddr) -> Prometheus {
        let dir = std::env::temp_dir().join(format!(
            "wasm-ratelimit-prometheus-{}-{}",
            std::process::id(),
            now_ms()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let text = std::fs::read_to_string(repo(CONFIG)).unwrap();
        let mut config = yaml_documents(&text).unwrap().remove(0);
        config["global"]["scrape_interval"] = json!("1s");
        config["global"]["scrape_timeout"] = json!("1s");
        config["global"]["evaluation_interval"] = json!("1s");
        config["rule_files"] = json!([repo(ALERTS).display().to_string()]);
        let scrape = &mut config["scrape_configs"][0];
        assert_eq!(scrape["metrics_path"], "/stats/prometheus");
        // The README's relabelling, as written there.
        assert_eq!(
            scrape["metric_relabel_configs"],
            json!([{"source_labels": ["__name__"],
                    "regex": "envoy_dynamicmodulescustom_(wasm_ratelimit_.*)",
                    "target_label": "__name__"}])
        );
        scrape["static_configs"] = json!([{"targets": [target.to_string()]}]);
        // JSON is YAML: Prometheus reads it as it is.
        let path = dir.join("prometheus.yaml");
        std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(prometheus_bin())
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {}: {e} (apt-get install prometheus; make integration does)",
                    prometheus_bin()
                )
            });
        let mut p = Prometheus {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            dir,
            at: Cell::new(None),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if common::get(p.addr, "/-/ready").is_ok_and(|r| r.status == 200) {
                return p;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("prometheus exited ({status}):\n{}", p.log());
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready in 30 s:\n{}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// A GET on the HTTP API; the `data` of a successful answer.
    fn api(&self, path: &str) -> Value {
        let r = common::get(self.addr, path).unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let v: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("GET {path}: {e}: {}", r.body_str()));
        assert_eq!(v["status"], "success", "GET {path}: {v}");
        v["data"].clone()
    }

    /// An instant query (at [`Prometheus::at`]): its vector's series (a scalar is one
    /// unlabelled series).
    fn query(&self, promql: &str) -> Vec<Series> {
        let time = self
            .at
            .get()
            .map(|t| format!("&time={t:.3}"))
            .unwrap_or_default();
        let data = self.api(&format!("/api/v1/query?query={}{time}", encode(promql)));
        let value = |v: &Value| -> f64 {
            let s = v[1].as_str().unwrap();
            match s {
                "NaN" => f64::NAN,
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                _ => s.parse().unwrap(),
            }
        };
        match data["resultType"].as_str() {
            Some("vector") => data["result"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| Series {
                    labels: serde_json::from_value(s["metric"].clone()).unwrap(),
                    value: value(&s["value"]),
                })
                .collect(),
            Some("scalar") => vec![Series {
                labels: BTreeMap::new(),
                value: value(&data["result"]),
            }],
            other => panic!("{promql}: unexpected result type {other:?}"),
        }
    }

    /// The value of a query that must return one series, if it does.
    fn value(&self, promql: &str) -> Option<f64> {
        match self.query(promql).as_slice() {
            [one] => Some(one.value),
            _ => None,
        }
    }

    /// Waits (≤ 15 s) until `promql` returns one series whose value is `want`.
    fn wait_value(&self, promql: &str, want: f64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let got = self.value(promql);
            if got == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{promql}: {got:?}, expected {want}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The plugin configuration: one rule per thing the dashboard shows. The table holds 288 keys
/// (`capacity` 256), so a flood of new keys evicts live ones (the heavier keys of the other rules stay).
/// With a fixed `key_seed`: the sliding_log rule's keys u0, u1, u2 then take three distinct
/// slots of the 256 (under a random seed two of them shared one about one run in 85, and the
/// gauge showed 2).
const PLUGIN: &str = r#"{"capacity": 256, "failure_mode": "allow", "key_seed": "5eed0000000000000000000000000003", "rules": [
  {"name": "strict", "match": {"path_prefix": "/strict"}, "key": ["header:x-user"],
   "rate_limit": {"requests_per_unit": 5, "unit": "hour"}},
  {"name": "trial", "shadow": true, "match": {"path_prefix": "/strict"}, "key": ["header:x-user"],
   "rate_limit": {"requests_per_unit": 2, "unit": "hour"}},
  {"name": "tokens", "match": {"path_prefix": "/tokens"}, "key": ["header:x-user"],
   "rate_limit": {"requests_per_unit": 1000000, "unit": "hour"},
   "cost": {"response": "header:x-usage-tokens", "default": 50, "reserve": 100, "true_up": true}},
  {"name": "slots", "match": {"path_prefix": "/slow"}, "in_flight": {"max": 2}},
  {"name": "paced", "match": {"path_prefix": "/paced"}, "algorithm": "leaky_bucket", "burst": 5,
   "on_limit": "delay", "max_delay_ms": 1000, "rate_limit": {"requests_per_unit": 10, "unit": "second"}},
  {"name": "remote", "match": {"path_prefix": "/remote"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
   "global": {"cluster": "ratelimit", "domain": "edge", "mode": "sync", "timeout_ms": 200}},
  {"name": "elastic", "match": {"path_prefix": "/elastic"}, "algorithm": "fixed_window",
   "rate_limit": {"requests_per_unit": 100, "unit": "second"},
   "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.5, "window_s": 2, "ramp_s": 1}},
  {"name": "per-key", "match": {"path_prefix": "/flood"}, "key": ["header:x-key"],
   "rate_limit": {"requests_per_unit": 1000, "unit": "hour"}},
  {"name": "logged", "match": {"path_prefix": "/logged"}, "algorithm": "sliding_log",
   "key": ["header:x-user"], "rate_limit": {"requests_per_unit": 5, "unit": "hour"}},
  {"name": "leased", "match": {"path_prefix": "/leased"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 20, "unit": "minute"},
   "global": {"cluster": "live", "domain": "edge", "mode": "lease", "max_block": 4,
              "flush_ms": 20, "timeout_ms": 5000}},
  {"name": "lapsing", "match": {"path_prefix": "/lapsing"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 100, "unit": "second"},
   "global": {"cluster": "live", "domain": "edge", "mode": "lease", "flush_ms": 20,
              "timeout_ms": 5000}},
  {"name": "reported", "match": {"path_prefix": "/reported"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 1000000, "unit": "hour"},
   "cost": {"response": "header:x-usage-tokens", "default": 50},
   "global": {"cluster": "live", "domain": "edge", "mode": "async", "flush_ms": 20,
              "timeout_ms": 5000}},
  {"name": "lost", "match": {"path_prefix": "/lost"}, "key": ["remote_address"],
   "rate_limit": {"requests_per_unit": 1000, "unit": "minute"},
   "global": {"cluster": "ratelimit", "domain": "edge", "mode": "async", "flush_ms": 20,
              "timeout_ms": 200}}
]}"#;

const RULES: [&str; 13] = [
    "strict", "trial", "tokens", "slots", "paced", "remote", "elastic", "per-key", "logged",
    "leased", "lapsing", "reported", "lost",
];

/// The live service's limits (Limitador's, per client address): the lease rules' 20 a minute
/// and 100 a second, and room for every token the reporting rule reports.
const LIMITS: &str = r#"[
  {"namespace": "edge", "name": "leased", "max_value": 20, "seconds": 60,
   "conditions": ["descriptors[0].rule == 'leased'"], "variables": ["descriptors[0].remote_address"]},
  {"namespace": "edge", "name": "lapsing", "max_value": 100, "seconds": 1,
   "conditions": ["descriptors[0].rule == 'lapsing'"], "variables": ["descriptors[0].remote_address"]},
  {"namespace": "edge", "name": "reported", "max_value": 1000000, "seconds": 3600,
   "conditions": ["descriptors[0].rule == 'reported'"], "variables": ["descriptors[0].remote_address"]}
]"#;
/// The lease rule's limit, and the requests sent to it (past the limit: claims are refused).
const LEASED_LIMIT: u64 = 20;
const LEASED_SENT: u64 = 30;
/// What the second lease rule claims and lets lapse: a first block of 4, of which a request
/// takes 1; after the service's window of a second, the next request claims 4 again, and the 3
/// held lapse.
const LAPSING_GRANTED: u64 = 8;
const LAPSED: u64 = 3;
/// The lease rules, as the panels list them.
const LEASE_RULES: [&str; 2] = ["lapsing", "leased"];
/// Tokens the reporting rule's answers report; hits of the rule whose service is down.
const REPORTED: [&str; 3] = ["10", "20", "30"];
const LOST_HITS: u64 = 5;

/// The window the test substitutes for `$__rate_interval` and `$__range`: longer than the test,
/// so every rate covers all its traffic (and the zero every counter starts from).
const WINDOW_S: f64 = 300.0;
const FLOOD_KEYS: u64 = 2000;
/// The table a `capacity` of 256 makes: an eighth more entries, in whole buckets of 16 (18).
const CAPACITY: f64 = 288.0;
/// Keys of the sliding_log rule: each takes a slot of its own, not a bucket entry.
const LOGGED_KEYS: u64 = 3;

/// The bootstrap: the filter in front of a test upstream, a `ratelimit` cluster where nothing
/// listens (the service of the rules "remote" and "lost" is down), and a `live` one: the test
/// rate limit service on `rls_port`.
fn bootstrap(upstream: SocketAddr, rls_port: u16) -> String {
    let listener = Listener::to(upstream);
    bootstrap_with(PLUGIN, &listener)
        + &rls_cluster(free_port(), "0.25s")
        + &rls_cluster_named("live", rls_port, "1s")
}

/// What the traffic of [`drive`] counted, where the test knows it exactly.
struct Sent {
    strict_allowed: u64,
    strict_limited: u64,
    trial_allowed: u64,
    trial_shadow: u64,
    tokens_charged: u64,
    /// Requests the lease rule admitted (the rest it refused).
    leased_allowed: u64,
    tokens_reported: u64,
}

/// One request; the upstream answers with an empty body, so in one write (a body in a second
/// write would wait for Envoy's delayed ACK, 40 ms a request).
fn send(c: &mut Client, path: &str, headers: &[(&str, &str)]) -> common::Response {
    let mut all = vec![("x-body", "0")];
    all.extend_from_slice(headers);
    c.send("GET", path, &all).unwrap()
}

/// Sends the traffic, and checks what each request got.
fn drive(envoy: &Envoy) -> Sent {
    let addr = envoy.addr;
    // Three slow requests on an in-flight rule of 2: two hold a slot for 3 s (Prometheus sees
    // the gauge at 2), the third is refused.
    let slow: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(if i == 2 { 500 } else { 0 }));
                let mut c = Client::connect(addr).unwrap();
                send(&mut c, "/slow", &[("x-delay-ms", "3000")]).status
            })
        })
        .collect();

    // One heavy client far over "strict" (5 an hour) and one light one; "trial" (2 an hour,
    // shadow) would refuse more, and refuses nothing.
    let mut c = Client::connect(addr).unwrap();
    let mut statuses = BTreeMap::<u16, u64>::new();
    for (user, n) in [("heavy", 400), ("light", 3)] {
        for _ in 0..n {
            let r = send(&mut c, "/strict", &[("x-user", user)]);
            *statuses.entry(r.status).or_default() += 1;
        }
    }
    assert_eq!(statuses, BTreeMap::from([(200, 8), (429, 395)]));

    // Tokens charged from the response against a reservation of 100: 60 + 140 + 3 × 100, and
    // one response that never says (the default, 50): 40 + 50 refunded, 40 beyond.
    for usage in ["60", "140", "100", "100", "100"] {
        let r = send(&mut c, "/tokens", &[("x-user", "t"), ("x-usage", usage)]);
        assert_eq!(r.status, 200);
    }
    assert_eq!(send(&mut c, "/tokens", &[("x-user", "t")]).status, 200);

    // Five at once (connected beforehand) on a leaky bucket in delay mode: the first goes at
    // once, four are held.
    for r in common::at_once(addr, 5, |c| send(c, "/paced", &[])) {
        assert_eq!(r.status, 200);
    }

    // The global rule's service is down: failure_mode allow lets the request through.
    assert_eq!(send(&mut c, "/remote", &[]).status, 200);

    // The elastic rule (100 a second, between 50 and 200): a healthy backend lifts it to 200 %...
    let factor = common::metric(Some("elastic"), ELASTIC_FACTOR);
    for _ in 0..10 {
        for _ in 0..10 {
            assert_eq!(send(&mut c, "/elastic", &[]).status, 200);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(envoy.wait_stat(&factor, 200), Some(200), "never rose");
    // Every worker takes the new factor at its next tick (250 ms): wait until the one serving
    // this connection reports it.
    let deadline = Instant::now() + Duration::from_secs(3);
    while send(&mut c, "/elastic", &[]).header("x-ratelimit-limit") != Some("200") {
        assert!(
            Instant::now() < deadline,
            "the factor never reached this worker"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... so that 150 requests within one second all pass, 50 of them above the base limit...
    std::thread::sleep(Duration::from_millis(1000 - now_ms() % 1000 + 20));
    for _ in 0..150 {
        assert_eq!(send(&mut c, "/elastic", &[]).status, 200);
    }
    let above = envoy.wait_stat_until(&common::metric(Some("elastic"), "elastic_allowed"), |n| {
        n > 0
    });
    assert!(
        above > Some(0),
        "nothing admitted above the base: {above:?}"
    );
    // ... then a failing backend (503s) drops it to its floor, 50 %.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut bad = 0;
    while envoy.stat(&factor) != Some(50) {
        assert!(Instant::now() < deadline, "never dropped ({bad} sent)");
        for _ in 0..20 {
            send(&mut c, "/elastic", &[("x-status", "503")]);
            bad += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Traffic goes on at the floor (50 a second): some of it is refused now, once the worker
    // serving this connection has taken the floor (at its next tick).
    let deadline = Instant::now() + Duration::from_secs(3);
    while send(&mut c, "/elastic", &[("x-status", "503")]).status != 429 {
        assert!(Instant::now() < deadline, "nothing refused at the floor");
    }

    // A few keys of the sliding_log rule, in slots of their own.
    for i in 0..LOGGED_KEYS {
        let user = format!("u{i}");
        assert_eq!(send(&mut c, "/logged", &[("x-user", &user)]).status, 200);
    }

    // The lease rule (20 a minute on the live service, blocks of at most 4): its requests claim
    // blocks, and past the limit the service refuses a claim and the rest are refused here.
    // Sent before the flood, which then evicts none of these keys: a lease's entry weighs what
    // it holds, at least 1, and stays until the lease's end, after every flood key.
    let leased_allowed = (0..LEASED_SENT)
        .map(|_| send(&mut c, "/leased", &[]).status)
        .filter(|&s| {
            assert!(s == 200 || s == 429, "{s}");
            s == 200
        })
        .count() as u64;
    assert!(
        (1..=LEASED_LIMIT).contains(&leased_allowed),
        "{leased_allowed} admitted"
    );
    // A lease of a second: one request, then another once the service's window has turned.
    assert_eq!(send(&mut c, "/lapsing", &[]).status, 200);
    let turned = Instant::now() + Duration::from_millis(1100);
    // Meanwhile, usage reported to the live service after the answers, and hits of an async
    // rule whose service is down: its reports are lost.
    for usage in REPORTED {
        let r = send(&mut c, "/reported", &[("x-usage", usage)]);
        assert_eq!(r.status, 200);
    }
    for _ in 0..LOST_HITS {
        assert_eq!(send(&mut c, "/lost", &[]).status, 200);
    }
    std::thread::sleep(turned.saturating_duration_since(Instant::now()));
    assert_eq!(send(&mut c, "/lapsing", &[]).status, 200);

    // A flood of new keys through a 288-key table: live keys are evicted.
    for i in 0..FLOOD_KEYS {
        let key = format!("k{i}");
        assert_eq!(send(&mut c, "/flood", &[("x-key", &key)]).status, 200);
    }

    let slow: Vec<u16> = slow.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(slow, [200, 200, 429]);
    Sent {
        strict_allowed: 8,
        strict_limited: 395,
        trial_allowed: 4,
        trial_shadow: 399,
        tokens_charged: 550,
        leased_allowed,
        tokens_reported: REPORTED.iter().map(|u| u.parse::<u64>().unwrap()).sum(),
    }
}

/// The metric names the filter exports (src/metrics.rs), per rule and per plugin: a query of
/// anything else would draw nothing.
fn exported() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut per_rule: BTreeSet<String> = Counter::ALL.iter().map(|c| c.name().into()).collect();
    per_rule.insert(ELASTIC_FACTOR.into());
    let mut per_plugin: BTreeSet<String> = Gauge::ALL.iter().map(|g| g.name().into()).collect();
    per_plugin.insert("panics".into()); // native build only
    per_plugin.insert(metrics::CAPACITY.into());
    (per_rule, per_plugin)
}

/// Every `wasm_ratelimit_<name>` a query uses, with its selector (`{...}`, or "").
fn metrics_in(promql: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = promql;
    while let Some(at) = rest.find("wasm_ratelimit_") {
        let tail = &rest[at + "wasm_ratelimit_".len()..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].to_string();
        let after = &tail[end..];
        let selector = if after.starts_with('{') {
            after[..=after.find('}').unwrap()].to_string()
        } else {
            String::new()
        };
        out.push((name, selector));
        rest = after;
    }
    out
}

/// The dashboard's queries with Grafana's variables replaced: `$plugin`, `$rule`, and the
/// intervals.
fn substitute(expr: &str, rule: &str) -> String {
    let window = format!("{}s", WINDOW_S as u64);
    let mut q = expr.to_string();
    for (var, value) in [
        ("__rate_interval", window.as_str()),
        ("__range", window.as_str()),
        ("__interval", "15s"),
        ("plugin", "test"),
        ("rule", rule),
    ] {
        q = q.replace(&format!("${{{var}}}"), value);
        q = q.replace(&format!("${var}"), value);
    }
    assert!(!q.contains('$'), "a variable the test does not know: {q}");
    q
}

/// One query target of a panel.
struct Target {
    panel: String,
    ref_id: String,
    expr: String,
}

/// Every panel's targets, rows' nested panels included.
fn targets(panels: &Value, out: &mut Vec<Target>) {
    for p in panels.as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(Target {
                panel: p["title"].as_str().unwrap().to_string(),
                ref_id: t["refId"].as_str().unwrap().to_string(),
                expr: t["expr"].as_str().unwrap().to_string(),
            });
        }
        targets(&p["panels"], out);
    }
}

/// A rate over the window is exactly `count` over its length (an increase, `count`): every
/// counter was scraped at 0 within the window, and queries run at the time of the last scrape,
/// so Prometheus extrapolates nothing.
fn assert_rate(what: &str, got: f64, count: u64) {
    assert_close(what, got, count as f64 / WINDOW_S);
}

fn assert_close(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-9 * want.abs().max(1.0),
        "{what}: {got}, expected {want}"
    );
}

/// `(rule label, value)` of each series, sorted.
fn by_rule(series: &[Series]) -> BTreeMap<String, f64> {
    series
        .iter()
        .map(|s| (s.label("rule").unwrap_or("").to_string(), s.value))
        .collect()
}

#[test]
fn promtool_accepts_the_alert_rules_and_the_config() {
    let rules = rule_list().len();
    for (args, want) in [
        (
            vec!["check", "rules", ALERTS],
            format!("SUCCESS: {rules} rules found"),
        ),
        (
            vec!["check", "config", CONFIG],
            "is valid prometheus config file syntax".to_string(),
        ),
    ] {
        let out = Command::new(promtool_bin())
            .args(&args)
            .current_dir(common::root())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", promtool_bin()));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool {args:?}:\n{text}");
        assert!(text.contains(&want), "promtool {args:?}:\n{text}");
    }
}

/// Every rule of alerts.yaml.
fn rule_list() -> Vec<Value> {
    let text = std::fs::read_to_string(repo(ALERTS)).unwrap();
    let doc = yaml_documents(&text).unwrap().remove(0);
    doc["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .collect()
}

#[test]
fn every_dashboard_query_and_alert_works_in_a_real_prometheus() {
    let started = Instant::now();
    let upstream = Upstream::start();
    let (redis_port, rls_port) = (free_port(), free_port());
    let _redis = redis(redis_port);
    // One call at a time, so that the service never grants past the limit.
    let _rls = rls_server(rls_port, redis_port, LIMITS, 0, true);
    let envoy = Envoy::start_yaml(&bootstrap(upstream.addr, rls_port));
    let prom = Prometheus::start(envoy.admin);
    // Prometheus has scraped every series at 0 before the traffic (through the relabelling, in
    // the native build), so every rate below counts all of it.
    for rule in RULES {
        prom.wait_value(
            &format!(r#"wasm_ratelimit_allowed{{plugin="test",rule="{rule}"}}"#),
            0.0,
        );
    }
    let sent = drive(&envoy);
    let at =
        |name: &str, rule: &str| format!(r#"wasm_ratelimit_{name}{{plugin="test",rule="{rule}"}}"#);
    // Until Prometheus has scraped what the filter published.
    prom.wait_value(&at("limited", "strict"), sent.strict_limited as f64);
    prom.wait_value(&at("allowed", "strict"), sent.strict_allowed as f64);
    prom.wait_value(&at("shadow_limited", "trial"), sent.trial_shadow as f64);
    prom.wait_value(&at("allowed", "trial"), sent.trial_allowed as f64);
    prom.wait_value(&at("usage_charged", "tokens"), sent.tokens_charged as f64);
    prom.wait_value(&at("usage_unreported", "tokens"), 1.0);
    prom.wait_value(&at("usage_refunded", "tokens"), 90.0);
    prom.wait_value(&at("usage_exceeded", "tokens"), 40.0);
    prom.wait_value(&at("delayed", "paced"), 4.0);
    prom.wait_value(&at("failed_open", "remote"), 1.0);
    prom.wait_value(&at("global_errors", "remote"), 1.0);
    prom.wait_value(&at("limited", "slots"), 1.0);
    prom.wait_value(&at("allowed", "per-key"), FLOOD_KEYS as f64);
    prom.wait_value(&at("allowed", "leased"), sent.leased_allowed as f64);
    prom.wait_value(
        &at("limited", "leased"),
        (LEASED_SENT - sent.leased_allowed) as f64,
    );
    prom.wait_value(
        &at("usage_reported", "reported"),
        sent.tokens_reported as f64,
    );
    prom.wait_value(&at("reports_lost", "lost"), LOST_HITS as f64);
    prom.wait_value(&at("lease_lapsed", "lapsing"), LAPSED as f64);
    prom.wait_value(&at("lease_granted", "lapsing"), LAPSING_GRANTED as f64);
    prom.wait_value(&at(ELASTIC_FACTOR, "elastic"), 50.0);
    prom.wait_value(r#"wasm_ratelimit_in_flight{plugin="test"}"#, 0.0);
    prom.wait_value(r#"wasm_ratelimit_tracked_keys{plugin="test"}"#, CAPACITY);
    prom.wait_value(
        r#"wasm_ratelimit_tracked_logs{plugin="test"}"#,
        LOGGED_KEYS as f64,
    );
    // From now on, queries run at the time of the last scrape.
    let last = prom
        .value(r#"timestamp(wasm_ratelimit_allowed{plugin="test",rule="strict"})"#)
        .unwrap();
    prom.at.set(Some(last));
    // The gauges moved while Prometheus watched.
    let seen = |q: &str| prom.value(&format!(r#"max_over_time({q}{{plugin="test"}}[5m])"#));
    assert_eq!(seen("wasm_ratelimit_in_flight"), Some(2.0));
    assert_eq!(
        prom.value(&format!(
            "max_over_time({}[5m])",
            at(ELASTIC_FACTOR, "elastic")
        )),
        Some(200.0)
    );
    // The counts the shares below are checked against, as Prometheus holds them.
    let total = |name: &str| {
        prom.value(&format!(r#"sum(wasm_ratelimit_{name}{{plugin="test"}})"#))
            .unwrap()
    };
    let (all_allowed, all_limited) = (total("allowed"), total("limited"));
    let elastic_allowed = prom.value(&at("elastic_allowed", "elastic")).unwrap();
    let evicted = prom.value(&at("slot_evictions", "per-key")).unwrap();
    assert!(elastic_allowed > 0.0 && evicted > 0.0);
    // Only the flood evicts: the other rules' keys are heavier than its own.
    assert_eq!(
        total("slot_evictions"),
        evicted,
        "only the flood's keys are evicted"
    );
    // The first lease, as Prometheus holds it: the service granted at most its limit, and at
    // least what was admitted (the rest is held); it refused a claim; blocks of at most 4. No
    // window of the service turned: nothing lapsed.
    let lease = |name: &str| prom.value(&at(name, "leased")).unwrap();
    let (claims, granted, refused) = (
        lease("lease_claims"),
        lease("lease_granted"),
        lease("lease_refused"),
    );
    assert!(
        (sent.leased_allowed as f64..=LEASED_LIMIT as f64).contains(&granted),
        "granted {granted}"
    );
    assert!(refused >= 1.0, "refused {refused}");
    assert!(
        claims >= refused + (granted / 4.0).ceil(),
        "{claims} claims"
    );
    assert_eq!(lease("lease_lapsed"), 0.0);
    // Every call of the reporting rule was answered; every one of the other rule's failed.
    assert_eq!(prom.value(&at("reports_lost", "reported")), Some(0.0));
    let lost_errors = prom.value(&at("global_errors", "lost")).unwrap();
    assert!(lost_errors >= 1.0, "{lost_errors}");
    let native = common::build() == Build::Native;
    let panics = prom.value(r#"wasm_ratelimit_panics{plugin="test"}"#);
    assert_eq!(panics, native.then_some(0.0), "panics: native build only");

    // --- The dashboard ---
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo(DASHBOARD)).unwrap()).unwrap();
    let vars = dashboard["templating"]["list"].as_array().unwrap();
    let ds = vars.iter().find(|v| v["name"] == "datasource").unwrap();
    assert_eq!(
        (&ds["type"], &ds["query"]),
        (&json!("datasource"), &json!("prometheus"))
    );
    // The template variables: label_values(<selector>, <label>), which Grafana asks of
    // /api/v1/label/<label>/values (or /api/v1/series).
    let mut var_values = BTreeMap::new();
    for v in vars.iter().filter(|v| v["type"] == "query") {
        let name = v["name"].as_str().unwrap();
        let def = v["definition"].as_str().unwrap();
        assert_eq!(v["query"]["query"].as_str(), Some(def), "{name}");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{name}");
        let inner = def
            .strip_prefix("label_values(")
            .and_then(|d| d.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{name}: {def}"));
        let (selector, label) = inner.rsplit_once(',').unwrap();
        let selector = substitute(selector.trim(), ".*");
        let data = prom.api(&format!(
            "/api/v1/label/{}/values?match%5B%5D={}",
            label.trim(),
            encode(&selector)
        ));
        let values: BTreeSet<String> = serde_json::from_value(data).unwrap();
        var_values.insert(name.to_string(), values);
    }
    assert_eq!(
        var_values,
        BTreeMap::from([
            ("plugin".to_string(), BTreeSet::from(["test".to_string()])),
            (
                "rule".to_string(),
                RULES.iter().map(|r| r.to_string()).collect()
            ),
        ])
    );

    let mut all = Vec::new();
    targets(&dashboard["panels"], &mut all);
    assert!(all.len() >= 20, "{} queries", all.len());
    let (per_rule, per_plugin) = exported();
    let mut checked = BTreeSet::new();
    for t in &all {
        let what = format!("panel {:?} ({})", t.panel, t.ref_id);
        // Only metrics the filter exports, always filtered by the variables.
        let used = metrics_in(&t.expr);
        assert!(!used.is_empty(), "{what}: no wasm_ratelimit metric");
        for (name, selector) in &used {
            let rule_metric = per_rule.contains(name);
            assert!(
                rule_metric || per_plugin.contains(name),
                "{what}: wasm_ratelimit_{name} is not a metric the filter exports"
            );
            assert!(
                selector.contains(r#"plugin=~"$plugin""#),
                "{what}: {selector}"
            );
            assert_eq!(
                selector.contains(r#"rule=~"$rule""#),
                rule_metric,
                "{what}: {selector}"
            );
        }
        let only_panics = used.iter().all(|(n, _)| n == "panics");
        // Every rule; then one rule, which must filter.
        let series = prom.query(&substitute(&t.expr, ".*"));
        if only_panics && !native {
            assert!(series.is_empty(), "{what}: {series:?}");
        } else {
            assert!(!series.is_empty(), "{what}: no series:\n{}", t.expr);
        }
        for s in &series {
            assert!(
                s.label("plugin").is_none_or(|p| p == "test"),
                "{what}: {s:?}"
            );
            assert!(
                s.label("rule").is_none_or(|r| RULES.contains(&r)),
                "{what}: {s:?}"
            );
            assert!(
                s.value.is_nan() || (s.value.is_finite() && s.value >= 0.0),
                "{what}: {s:?}"
            );
        }
        for s in prom.query(&substitute(&t.expr, "strict")) {
            assert!(
                s.label("rule").is_none_or(|r| r == "strict"),
                "{what}: {s:?}"
            );
        }
        // What each panel must show for this traffic.
        let rules = by_rule(&series);
        let one = || {
            assert_eq!(series.len(), 1, "{what}: {series:?}");
            series[0].value
        };
        let key = (t.panel.as_str(), t.ref_id.as_str());
        let known = match key {
            ("Limited share", "A") => {
                assert_close(&what, one(), all_limited / (all_allowed + all_limited));
                true
            }
            ("Refusals /s", "A") => {
                assert_rate(&what, one(), all_limited as u64);
                true
            }
            ("Shadow rules would refuse /s", "A") => {
                assert_rate(&what, one(), sent.trial_shadow);
                true
            }
            ("Undecided requests (range)", "A") => {
                // An increase over the window: the one request the dead service could not
                // decide.
                assert_rate(&what, one() / WINDOW_S, 1);
                true
            }
            ("Panics (range, native build)", "A") | ("Panics (native build)", "A") => {
                if native {
                    assert_eq!(one(), 0.0, "{what}");
                }
                true
            }
            ("Tracked keys (busiest Envoy)", "A") | ("Tracked keys vs live keys evicted", "A") => {
                assert_eq!(one(), CAPACITY, "{what}");
                true
            }
            ("Allowed and limited per rule", "A") => {
                assert_eq!(rules.len(), RULES.len(), "{what}: {rules:?}");
                assert_rate(&what, rules["strict"], sent.strict_allowed);
                assert_rate(&what, rules["trial"], sent.trial_allowed);
                assert_rate(&what, rules["per-key"], FLOOD_KEYS);
                assert_rate(&what, rules["paced"], 5);
                true
            }
            ("Allowed and limited per rule", "B") => {
                assert_rate(&what, rules["strict"], sent.strict_limited);
                assert_rate(&what, rules["slots"], 1);
                assert_eq!((rules["trial"], rules["per-key"]), (0.0, 0.0), "{what}");
                true
            }
            ("Limited share per rule", "A") => {
                let want =
                    sent.strict_limited as f64 / (sent.strict_allowed + sent.strict_limited) as f64;
                assert_close(&what, rules["strict"], want);
                assert_eq!((rules["trial"], rules["per-key"]), (0.0, 0.0), "{what}");
                let slots = rules["slots"];
                assert_close(&what, slots, 1.0 / 3.0);
                true
            }
            ("Shadow rules: requests they would refuse", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["trial"], "{what}");
                assert_rate(&what, rules["trial"], sent.trial_shadow);
                true
            }
            ("Shadow rules: share they would refuse", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["trial"], "{what}");
                let want =
                    sent.trial_shadow as f64 / (sent.trial_shadow + sent.trial_allowed) as f64;
                assert_close(&what, rules["trial"], want);
                true
            }
            ("Requests held now (delay mode)", "A") | ("In-flight slots held", "A") => {
                assert_eq!(one(), 0.0, "{what}: nothing held once the traffic is over");
                true
            }
            ("Delayed and abandoned /s", "A") => {
                assert_rate(&what, rules["paced"], 4);
                true
            }
            ("Delayed and abandoned /s", "B") => {
                assert!(rules.values().all(|&v| v == 0.0), "{what}: {rules:?}");
                true
            }
            ("Tracked keys vs live keys evicted", "B") => {
                assert_rate(&what, rules["per-key"], evicted as u64);
                assert!(
                    rules.iter().all(|(r, &v)| r == "per-key" || v == 0.0),
                    "{what}: {rules:?}"
                );
                true
            }
            ("Undecided requests and service errors /s", "A") => {
                assert_rate(&what, rules["remote"], 1);
                assert!(
                    rules.iter().all(|(r, &v)| r == "remote" || v == 0.0),
                    "{what}: {rules:?}"
                );
                true
            }
            ("Undecided requests and service errors /s", "C") => {
                assert_rate(&what, rules["remote"], 1);
                assert_rate(&what, rules["lost"], lost_errors as u64);
                assert!(
                    rules
                        .iter()
                        .all(|(r, &v)| r == "remote" || r == "lost" || v == 0.0),
                    "{what}: {rules:?}"
                );
                true
            }
            ("Undecided requests and service errors /s", "B") => {
                assert!(rules.values().all(|&v| v == 0.0), "{what}: {rules:?}");
                true
            }
            ("Usage charged, refunded and beyond reservations /s", "A") => {
                assert_eq!(
                    rules.keys().collect::<Vec<_>>(),
                    ["reported", "tokens"],
                    "{what}"
                );
                assert_rate(&what, rules["tokens"], sent.tokens_charged);
                assert_rate(&what, rules["reported"], sent.tokens_reported);
                true
            }
            ("Usage charged, refunded and beyond reservations /s", "B") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["tokens"], "{what}");
                assert_rate(&what, rules["tokens"], 90);
                true
            }
            ("Usage charged, refunded and beyond reservations /s", "C") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["tokens"], "{what}");
                assert_rate(&what, rules["tokens"], 40);
                true
            }
            ("Responses that never reported usage /s", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["tokens"], "{what}");
                assert_rate(&what, rules["tokens"], 1);
                true
            }
            ("Elastic limit in force", "A") => {
                assert_eq!(
                    rules,
                    BTreeMap::from([("elastic".to_string(), 50.0)]),
                    "{what}"
                );
                true
            }
            ("Wait told to refused clients (average)", "A") => {
                // The strict rule (5 an hour, a sliding window) told its refused clients to wait
                // until the hour's 5 requests weigh less than 4 in the next hour: the rest of
                // this hour and a fifth of the next, up to 4,320 s early in an hour; rules that
                // refused nothing have no average (0 / 0).
                let waited: Vec<&String> = rules
                    .iter()
                    .filter(|(_, v)| !v.is_nan())
                    .map(|(r, _)| r)
                    .collect();
                assert_eq!(
                    waited,
                    ["elastic", "leased", "slots", "strict"],
                    "{what}: {rules:?}"
                );
                assert_eq!(rules["elastic"], 1.0, "{what}: a window of a second");
                // Until the service's window of a minute ends, or a second for a claim.
                assert!((1.0..=60.0).contains(&rules["leased"]), "{what}: {rules:?}");
                assert!(
                    (720.0..=4320.0).contains(&rules["strict"]),
                    "{what}: {rules:?}"
                );
                assert_eq!(rules["slots"], 1.0, "{what}: an in-flight refusal says 1 s");
                true
            }
            ("Table fill", "A") => {
                // Full, not over: the sliding log's keys are not in the buckets.
                assert_eq!(one(), 1.0, "{what}: the flood filled the table");
                true
            }
            ("Table fill", "B") => {
                assert_close(&what, one(), LOGGED_KEYS as f64 / CAPACITY);
                true
            }
            ("Store conflicts (CAS retries) /s", "A") => {
                assert_eq!(rules.len(), RULES.len(), "{what}: {rules:?}");
                true
            }
            ("Admitted above the base limit /s", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["elastic"], "{what}");
                assert_rate(&what, rules["elastic"], elastic_allowed as u64);
                true
            }
            // Lease rules only, the others not drawn.
            ("Lease claims and refusals /s", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                assert_rate(&what, rules["leased"], claims as u64);
                assert_rate(&what, rules["lapsing"], 2);
                true
            }
            ("Lease claims and refusals /s", "B") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                assert_rate(&what, rules["leased"], refused as u64);
                assert_eq!(rules["lapsing"], 0.0, "{what}");
                true
            }
            ("Quota granted and lapsed /s", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                assert_rate(&what, rules["leased"], granted as u64);
                assert_rate(&what, rules["lapsing"], LAPSING_GRANTED);
                true
            }
            ("Quota granted and lapsed /s", "B") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                assert_eq!(rules["leased"], 0.0, "{what}");
                assert_rate(&what, rules["lapsing"], LAPSED);
                true
            }
            ("Lapsed share of quota granted", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                assert_eq!(rules["leased"], 0.0, "{what}");
                assert_close(
                    &what,
                    rules["lapsing"],
                    LAPSED as f64 / LAPSING_GRANTED as f64,
                );
                true
            }
            ("Service calls per 100 admitted requests (lease rules)", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), LEASE_RULES, "{what}");
                let want = 100.0 * claims / sent.leased_allowed as f64;
                assert_close(&what, rules["leased"], want);
                assert_close(&what, rules["lapsing"], 100.0);
                true
            }
            ("Usage reported and reports lost /s", "A") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["reported"], "{what}");
                assert_rate(&what, rules["reported"], sent.tokens_reported);
                true
            }
            ("Usage reported and reports lost /s", "B") => {
                assert_eq!(rules.keys().collect::<Vec<_>>(), ["lost"], "{what}");
                assert_rate(&what, rules["lost"], LOST_HITS);
                true
            }
            _ => false,
        };
        if known {
            checked.insert(key);
        } else {
            eprintln!("{what}: generic checks only ({} series)", series.len());
        }
    }
    // Every panel query the checks above name is still on the dashboard.
    assert_eq!(checked.len(), 39, "panel queries checked: {checked:?}");

    // --- The alerts ---
    let rules = rule_list();
    // What each alert's expression returns for this traffic: the (plugin, rule) it names.
    let strict_share =
        sent.strict_limited as f64 / (sent.strict_allowed + sent.strict_limited) as f64;
    let expected: BTreeMap<&str, Vec<&str>> = BTreeMap::from([
        // 395 of 403 refused, 1.3 requests/s.
        ("WasmRateLimitLimitedShareHigh", vec!["strict"]),
        // The last day is these few seconds: no jump against it.
        ("WasmRateLimitLimitedShareJump", vec![]),
        ("WasmRateLimitFailedOpen", vec!["remote"]),
        ("WasmRateLimitFailedClosed", vec![]),
        ("WasmRateLimitGlobalErrors", vec!["lost", "remote"]),
        ("WasmRateLimitReportsLost", vec!["lost"]),
        ("WasmRateLimitLiveKeysEvicted", vec!["per-key"]),
        ("WasmRateLimitPanics", vec![]),
        ("WasmRateLimitElasticLimitDown", vec!["elastic"]),
    ]);
    let names: BTreeSet<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        expected.keys().copied().collect(),
        "every alert needs its expected result here"
    );
    let book = std::fs::read_to_string(common::root().join("docs/book.toml")).unwrap();
    let repo = book
        .lines()
        .find_map(|l| l.strip_prefix("git-repository-url = "))
        .expect("book.toml: git-repository-url")
        .trim_matches('"');
    let runbook = format!(
        "{{{{ with $externalLabels.wasm_ratelimit_book }}}}{{{{ . }}}}/reference/metrics-and-logs.html\
         {{{{ else }}}}{repo}/blob/main/docs/src/reference/metrics-and-logs.md{{{{ end }}}}#alerts"
    );
    for r in &rules {
        let name = r["alert"].as_str().unwrap();
        let what = format!("alert {name}");
        assert!(r["for"].is_string(), "{what}: no for");
        assert!(
            ["critical", "warning", "info"]
                .contains(&r["labels"]["severity"].as_str().unwrap_or("")),
            "{what}: severity"
        );
        for a in ["summary", "description"] {
            let text = r["annotations"][a].as_str().unwrap_or("");
            assert!(
                text.contains("$labels.plugin"),
                "{what}: {a} names no plugin"
            );
        }
        // The runbook is the book's section of alerts (built from docs/src), which names each
        // one: absolute, under the book's base URL the operator sets (an external label), else
        // the page on the repository (book.toml's git-repository-url).
        assert_eq!(
            r["annotations"]["runbook_url"].as_str(),
            Some(runbook.as_str()),
            "{what}: runbook_url"
        );
        let page =
            std::fs::read_to_string(common::root().join("docs/src/reference/metrics-and-logs.md"))
                .unwrap();
        assert!(
            page.contains("\n## Alerts\n"),
            "the page has no Alerts section"
        );
        assert!(page.contains(name), "{what} is not on the alerts page");
        let expr = r["expr"].as_str().unwrap();
        for (metric, _) in metrics_in(expr) {
            assert!(
                per_rule.contains(&metric) || per_plugin.contains(&metric),
                "{what}: wasm_ratelimit_{metric} is not a metric the filter exports"
            );
        }
        let series = prom.query(expr);
        let mut got: Vec<&str> = series
            .iter()
            .map(|s| {
                assert_eq!(s.label("plugin"), Some("test"), "{what}: {s:?}");
                s.label("rule").unwrap_or("")
            })
            .collect();
        got.sort_unstable();
        assert_eq!(got, expected[name], "{what}: {series:?}");
        let value = by_rule(&series);
        match name {
            "WasmRateLimitLimitedShareHigh" => assert_close(&what, value["strict"], strict_share),
            "WasmRateLimitElasticLimitDown" => assert_eq!(value["elastic"], 50.0, "{what}"),
            "WasmRateLimitFailedOpen" => assert_rate(&what, value["remote"] / WINDOW_S, 1),
            "WasmRateLimitGlobalErrors" => {
                assert_rate(&what, value["remote"] / WINDOW_S, 1);
                assert_rate(&what, value["lost"] / WINDOW_S, lost_errors as u64);
            }
            "WasmRateLimitReportsLost" => assert_rate(&what, value["lost"] / WINDOW_S, LOST_HITS),
            _ => {}
        }
    }
    // Prometheus itself loaded every rule, evaluates each without error, and holds the alerts
    // above as pending (their `for` has not passed yet) or firing.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let groups = prom.api("/api/v1/rules");
        let loaded: Vec<&Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        assert_eq!(loaded.len(), rules.len(), "{groups}");
        for r in &loaded {
            assert_eq!(r["health"], "ok", "{r}");
        }
        let active: BTreeSet<(String, String)> = prom.api("/api/v1/alerts")["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["state"] == "pending" || a["state"] == "firing")
            .map(|a| {
                let l = &a["labels"];
                (
                    l["alertname"].as_str().unwrap().to_string(),
                    l["rule"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        let want: BTreeSet<(String, String)> = expected
            .iter()
            .flat_map(|(a, rules)| rules.iter().map(|r| (a.to_string(), r.to_string())))
            .collect();
        if active == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "active alerts {active:?}, expected {want:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "prometheus: {} dashboard queries and {} alerts checked in {:.1} s; the lease: {} \
         admitted, {claims} claims ({refused} refused), {granted} granted",
        all.len(),
        rules.len(),
        started.elapsed().as_secs_f64(),
        sent.leased_allowed
    );
}
