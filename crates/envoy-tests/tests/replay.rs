//! Replay tells the truth: traffic through a real Envoy (two workers) with shadow rules and an
//! access log, then `ratelimit-config replay` on that log, must count what the filter counted.
//! Run against each build (`FILTER=wasm`, `FILTER=native`).
//!
//! Why they may differ, and by how much: the filter decides a request at its own clock, some
//! time after the request started; the log has the start time, truncated to the millisecond,
//! and the request's `%DURATION%`, also truncated. The decision falls between the start and
//! the end, so a request decided by the filter at `f` and logged at `l` with duration `d` has
//! `l <= f <= l + d + 2` ms. For a rule counting each request once in fixed windows (a fixed
//! window; a sliding window within one window, where the previous window is empty), the
//! limited count of a key's window is `max(0, n - limit)` whatever the order its requests are
//! decided in, so the races of two workers change nothing, and only a request whose interval
//! `(l, l + d + 2]` holds a window boundary may be counted in another window than replay
//! counts it in: each such request moves the total by at most one. The bound is the number of
//! those requests, computed from the log.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{bootstrap_with, scratch, AccessLog, Client, Envoy, Listener};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const CONFIG: &str = r#"{"shadow": true, "rules": [
    {"name": "burst", "key": ["remote_address"], "algorithm": "fixed_window",
     "rate_limit": {"requests_per_unit": 5, "unit": "second"}},
    {"name": "hourly", "key": ["remote_address"],
     "rate_limit": {"requests_per_unit": 40, "unit": "hour"}},
    {"name": "per-key", "match": {"path_prefix": "/api/"}, "key": ["header:x-api-key"],
     "algorithm": "fixed_window", "rate_limit": {"requests_per_unit": 8, "unit": "second"}}]}"#;

/// The JSON access-log format replay reads by default (the keys Istio's JSON log uses).
const JSON_FORMAT: &[(&str, &str)] = &[
    ("start_time", "%START_TIME%"),
    ("downstream_remote_address", "%DOWNSTREAM_REMOTE_ADDRESS%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%"),
    ("authority", "%REQ(:AUTHORITY)%"),
    ("duration", "%DURATION%"),
    ("x-api-key", "%REQ(X-API-KEY)%"),
];

/// Starts Envoy with `CONFIG`-like `config` and an access log at `log`; the log is flushed
/// every 100 ms instead of Envoy's default 10 s.
fn envoy_with_log(
    config: &str,
    log: &Path,
    json: &'static [(&'static str, &'static str)],
) -> Envoy {
    let listener = Listener {
        access_log: Some(AccessLog { path: log, json }),
        ..Listener::default()
    };
    Envoy::start_yaml_args(
        &bootstrap_with(config, &listener),
        &["--file-flush-interval-msec", "100"],
    )
}

/// Waits (≤ 20 s) until the access log holds `n` lines.
fn wait_for_lines(log: &Path, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().count() >= n || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn replay(args: &[&str]) -> (i32, String, String) {
    common::output(Command::new(common::cli()).arg("replay").args(args))
}

/// How many logged requests of a rule may be decided in another window by the filter than by
/// replay (see the top of this file): those whose interval `(l, l + d + 2]` crosses a window
/// boundary. A sliding window is exact only while its previous window is empty: if the log
/// reaches into a second window, every request from there on is counted too.
fn bound(
    entries: &[Value],
    applies: impl Fn(&Value) -> bool,
    window_ms: u64,
    sliding: bool,
) -> u64 {
    let mut n = 0;
    let mut first_window = None;
    for e in entries.iter().filter(|e| applies(e)) {
        let l =
            ratelimit_config::replay::input::parse_time(e["start_time"].as_str().unwrap()).unwrap();
        let d = e["duration"].as_u64().unwrap();
        let window = l / window_ms;
        let first = *first_window.get_or_insert(window);
        if window != (l + d + 2) / window_ms || (sliding && window != first) {
            n += 1;
        }
    }
    n
}

#[test]
fn replay_counts_what_the_filter_counted_in_shadow_mode() {
    let dir = scratch("shadow");
    let log = dir.join("access.log");
    let envoy = envoy_with_log(CONFIG, &log, JSON_FORMAT);
    // Four clients (each its own address, so each its own connection and perhaps worker) at
    // different paces for 3 s; two API keys, each shared by two clients on either worker.
    let addr = envoy.addr;
    let clients: Vec<_> = [(2, 20u64), (3, 35), (4, 50), (5, 80)]
        .into_iter()
        .map(|(host, gap)| {
            std::thread::spawn(move || {
                let mut c = Client::connect_from(addr, &format!("127.0.0.{host}")).unwrap();
                let key = format!("key-{}", host % 2);
                let end = Instant::now() + Duration::from_secs(3);
                let mut sent = 0;
                while Instant::now() < end {
                    let path = if sent % 3 == 0 { "/" } else { "/api/items" };
                    let r = c.send("GET", path, &[("x-api-key", &key)]).unwrap();
                    assert_eq!(r.status, 200, "shadow rules never refuse");
                    sent += 1;
                    std::thread::sleep(Duration::from_millis(gap));
                }
                sent
            })
        })
        .collect();
    let sent: usize = clients.into_iter().map(|t| t.join().unwrap()).sum();
    let text = wait_for_lines(&log, sent);
    let entries: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(entries.len(), sent, "every request logged once");

    let config = dir.join("config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let (code, out, err) = replay(&[config.to_str().unwrap(), log.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["requests"], sent as u64);
    assert_eq!(report["logs"][0]["bad_lines"], 0);
    assert_eq!(
        report["notes"],
        serde_json::json!([]),
        "every field was in the log"
    );

    let api = |e: &Value| e["path"].as_str().unwrap().starts_with("/api/");
    let bounds = [
        ("burst", bound(&entries, |_| true, 1000, false)),
        ("hourly", bound(&entries, |_| true, 3_600_000, true)),
        ("per-key", bound(&entries, api, 1000, false)),
    ];
    for (i, (rule, bound)) in bounds.into_iter().enumerate() {
        let r = &report["rules"][i];
        assert_eq!(r["name"], rule);
        let replayed = r["results"][0]["limited"].as_u64().unwrap();
        let matched = r["matched"].as_u64().unwrap();
        // Every worker publishes its counts once a second: read them once they add up to what
        // the rule matched (each only grows, so a sum of `matched` means both are complete).
        let stat = |name: &str| envoy.stat(&common::metric(Some(rule), name)).unwrap_or(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (filter, allowed) = loop {
            let (filter, allowed) = (stat("shadow_limited"), stat("allowed"));
            if filter + allowed == matched || Instant::now() > deadline {
                break (filter, allowed);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        eprintln!(
            "{:?} {rule}: {sent} requests, {matched} matched; filter shadow_limited {filter}, \
             replay limited {replayed}, bound {bound}",
            common::build()
        );
        // What the filter decided, it decided for every request the rule matched.
        assert_eq!(allowed + filter, matched, "{rule}");
        assert!(filter > 0, "{rule}: the traffic goes over the limit");
        assert!(
            filter.abs_diff(replayed) <= bound,
            "{rule}: filter {filter}, replay {replayed}, bound {bound}"
        );
    }
}

#[test]
fn envoys_default_text_log_is_read_as_envoy_writes_it() {
    let dir = scratch("text");
    let log = dir.join("access.log");
    let config = r#"{"rules": [{"name": "per-client", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 1, "unit": "hour"}, "shadow": true},
        {"name": "posts", "match": {"methods": ["POST"], "path_prefix": "/p"},
        "rate_limit": {"requests_per_unit": 1, "unit": "hour"}, "shadow": true}]}"#;
    let envoy = envoy_with_log(config, &log, &[]);
    let mut c = Client::connect(envoy.addr).unwrap();
    let mut sent = 0;
    for (i, (method, path)) in [
        ("GET", "/a?x=1"),
        ("POST", "/p"),
        ("POST", "/p/2"),
        ("GET", "/"),
    ]
    .iter()
    .enumerate()
    {
        // Clients behind a proxy (X-Forwarded-For), a user agent with quotes in it.
        let xff = if i % 2 == 0 {
            "203.0.113.9"
        } else {
            "203.0.113.9, 10.0.0.1"
        };
        let r = c
            .send(
                method,
                path,
                &[
                    ("x-forwarded-for", xff),
                    ("user-agent", "a \"quoted\" agent"),
                ],
            )
            .unwrap();
        assert_eq!(r.status, 200);
        sent += 1;
    }
    let text = wait_for_lines(&log, sent);
    assert!(text.starts_with('['), "the default text format: {text}");
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, config).unwrap();
    let (code, out, err) = replay(&[
        cfg.to_str().unwrap(),
        log.to_str().unwrap(),
        "--json",
        "--field",
        "remote_address=%REQ(X-FORWARDED-FOR)%",
        "--raw-keys",
    ]);
    assert_eq!(code, 0, "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["requests"], sent, "{out}");
    assert_eq!(report["logs"][0]["bad_lines"], 0, "{out}");
    // Envoy takes the last address of X-Forwarded-For (no trusted hops), and so does replay:
    // two clients, each over its limit once.
    let per_client = &report["rules"][0];
    assert_eq!(per_client["matched"], 4);
    assert_eq!(per_client["results"][0]["limited"], 2);
    let mut raw: Vec<&str> = per_client["results"][0]["top_limited"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["raw"].as_str().unwrap())
        .collect();
    raw.sort_unstable();
    assert_eq!(
        raw,
        ["remote_address=10.0.0.1", "remote_address=203.0.113.9"]
    );
    assert_eq!(report["rules"][1]["matched"], 2);
    assert_eq!(report["rules"][1]["results"][0]["limited"], 1);
    // What the filter counted.
    for (rule, n) in [("per-client", 2), ("posts", 1)] {
        assert_eq!(
            envoy.wait_stat(&common::metric(Some(rule), "shadow_limited"), n),
            Some(n)
        );
    }
}
