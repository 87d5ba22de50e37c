//! Every quota unit in a real Envoy (two workers), in the build under test: rules charged by
//! what the response reports (a header, a trailer, the body's bytes), rules on requests in
//! flight, and client keys by network. Requests go to a test upstream (tests/common/upstream.rs)
//! told by request headers what to answer.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::upstream::Upstream;
use common::{at_once, bootstrap_with, Client, Envoy, Listener};
use std::time::{Duration, Instant};

/// Envoy with `config` in front of a fresh upstream.
fn start(config: &str) -> (Envoy, Upstream) {
    let upstream = Upstream::start();
    let listener = Listener::to(upstream.addr);
    (
        Envoy::start_yaml(&bootstrap_with(config, &listener)),
        upstream,
    )
}

fn get(envoy: &Envoy, headers: &[(&str, &str)]) -> common::Response {
    Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", headers)
        .unwrap()
}

/// The `r` of a rule in a response's `RateLimit` field.
fn remaining(r: &common::Response, rule: &str) -> u64 {
    let field = r
        .header("ratelimit")
        .unwrap_or_else(|| panic!("no ratelimit: {r:?}"));
    field
        .split(", ")
        .find(|item| item.starts_with(&format!("\"{rule}\"")))
        .and_then(|item| item.split(";r=").nth(1))
        .and_then(|rest| rest.split(';').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no r for {rule} in {field}"))
}

/// A token rule of `limit` per day (a window the test never leaves), charged from the
/// response header or trailer `x-usage-tokens`.
fn tokens(limit: u32, reserve: u32) -> String {
    format!(
        r#"{{"rules": [{{"name": "llm", "key": ["header:x-api-key"],
            "rate_limit": {{"requests_per_unit": {limit}, "unit": "day"}},
            "cost": {{"response": "header:x-usage-tokens", "reserve": {reserve}, "default": 50}}}}]}}"#
    )
}

#[test]
fn a_token_rule_admits_until_the_charged_usage_crosses_the_limit() {
    let (envoy, _up) = start(&tokens(1000, 0));
    let key = ("x-api-key", "k1");
    // Each answer reports 300 tokens: charged at its headers, so its fields show what is left.
    let mut left = Vec::new();
    for _ in 0..4 {
        let r = get(&envoy, &[key, ("x-usage", "300")]);
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"llm\";q=1000;w=86400;qu=\"tokens\"")
        );
        left.push(remaining(&r, "llm"));
    }
    // 1,200 used: 200 over the limit (the request that crossed it was admitted at 900).
    assert_eq!(left, [700, 400, 100, 0]);
    let r = get(&envoy, &[key, ("x-usage", "300")]);
    assert_eq!(r.status, 429);
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("of 1000 tokens per 86400 s"));
    // Another key is untouched; the metrics say what was charged.
    assert_eq!(
        get(&envoy, &[("x-api-key", "k2"), ("x-usage", "1")]).status,
        200
    );
    let m = |c: &str, n| envoy.wait_stat(&common::metric(Some("llm"), c), n);
    assert_eq!(m("usage_charged", 1201), Some(1201));
    assert_eq!(m("allowed", 5), Some(5));
    assert_eq!(m("limited", 1), Some(1));
}

#[test]
fn a_reserve_keeps_room_for_the_next_answer() {
    let (envoy, _up) = start(&tokens(1000, 400));
    let key = ("x-api-key", "k1");
    let statuses: Vec<u16> = (0..5)
        .map(|_| get(&envoy, &[key, ("x-usage", "300")]).status)
        .collect();
    // Admitted while 400 more fit: at 0, 300 and 600 used; not at 900.
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

#[test]
fn usage_in_trailers_and_unreported_usage_are_charged() {
    let (envoy, _up) = start(&tokens(1000, 0));
    let key = ("x-api-key", "k1");
    // A streamed answer reports its usage in a trailer: charged when the trailers pass (the
    // fields went out with the headers, before it was known).
    let r = get(
        &envoy,
        &[key, ("x-usage-trailer", "250"), ("x-body", "5000")],
    );
    assert_eq!((r.status, r.body.len()), (200, 5000));
    assert_eq!(remaining(&r, "llm"), 1000);
    // An answer that never says is charged the default (50).
    let r = get(&envoy, &[key]);
    assert_eq!(remaining(&r, "llm"), 750);
    let r = get(&envoy, &[key, ("x-usage", "0")]);
    assert_eq!(remaining(&r, "llm"), 700);
    let m = |c: &str, n| envoy.wait_stat(&common::metric(Some("llm"), c), n);
    assert_eq!(m("usage_charged", 300), Some(300));
    assert_eq!(m("usage_unreported", 1), Some(1));
}

#[test]
fn a_key_over_its_limit_is_refused_until_its_usage_decays() {
    // 100 tokens a second (one every 10 ms), a bucket of 100: an answer of 150 leaves the key
    // 50 in debt, refused until a token is back, 510 ms later.
    let (envoy, _up) = start(
        r#"{"rules": [{"name": "llm", "algorithm": "token_bucket", "burst": 100,
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "cost": {"response": "header:x-usage-tokens"}}]}"#,
    );
    // Taken before the request: the charge comes later, so the time measured from here to the
    // key's return is never shorter than the 510 ms owed, however slow the machine.
    let charged = Instant::now();
    assert_eq!(get(&envoy, &[("x-usage", "150")]).status, 200);
    let r = get(&envoy, &[("x-usage", "1")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    let back = loop {
        let r = get(&envoy, &[("x-usage", "1")]);
        if r.status == 200 {
            break charged.elapsed();
        }
        assert!(charged.elapsed() < Duration::from_secs(3), "still refused");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        back >= Duration::from_millis(500) && back < Duration::from_millis(1500),
        "admitted again after {back:?}"
    );
}

#[test]
fn body_bytes_are_counted_exactly() {
    let (envoy, _up) = start(
        r#"{"rules": [{"name": "dl", "rate_limit": {"requests_per_unit": 100000, "unit": "day"},
            "cost": {"response": "body_bytes"}}]}"#,
    );
    let r = get(&envoy, &[("x-body", "1234")]);
    assert_eq!(r.body.len(), 1234);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"dl\";q=100000;w=86400;qu=\"content-bytes\"")
    );
    let r = get(&envoy, &[("x-body", "5000"), ("x-chunked", "1")]);
    assert_eq!(r.body.len(), 5000);
    // What the two bodies weighed: 6,234 bytes.
    let r = get(&envoy, &[("x-body", "1")]);
    assert_eq!(remaining(&r, "dl"), 100_000 - 6_234);
    // A body cut short by the upstream is charged what passed.
    let cut = Client::connect(envoy.addr).unwrap().send(
        "GET",
        "/",
        &[("x-body", "8000"), ("x-reset-after", "700")],
    );
    assert!(cut.is_err(), "the client saw the reset");
    let stat = common::metric(Some("dl"), "usage_charged");
    let charged = envoy.wait_stat_until(&stat, |v| v > 6_235).unwrap();
    assert!(
        (6_236..=6_235 + 700).contains(&charged),
        "charged {charged} in all"
    );
}

/// An in-flight rule of 8 per tenant.
const IN_FLIGHT: &str = r#"{"rules": [{"name": "tenant", "key": ["header:x-tenant"],
    "in_flight": {"max": 8}}]}"#;

/// `n` requests at once, each held `delay_ms` by the upstream: their responses.
fn wave_responses(envoy: &Envoy, n: usize, delay_ms: &str) -> Vec<common::Response> {
    let delay = delay_ms.to_string();
    at_once(envoy.addr, n, move |c| {
        c.send("GET", "/", &[("x-tenant", "t"), ("x-delay-ms", &delay)])
            .unwrap()
    })
}

/// `n` requests at once, each held `delay_ms` by the upstream: their statuses.
fn wave(envoy: &Envoy, n: usize, delay_ms: &str) -> Vec<u16> {
    let responses = wave_responses(envoy, n, delay_ms);
    responses.iter().map(|r| r.status).collect()
}

/// Waits (≤ 2 s) until a wave of 8 gets every slot: the slots given back were all freed.
fn until_all_slots_free(envoy: &Envoy) {
    let t = Instant::now();
    loop {
        let statuses = wave(envoy, 8, "1");
        if statuses.iter().all(|s| *s == 200) {
            return;
        }
        assert!(t.elapsed() < Duration::from_millis(2000), "{statuses:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_in_flight_cap_holds_under_64_concurrent_slow_requests() {
    let (envoy, up) = start(IN_FLIGHT);
    let responses = wave_responses(&envoy, 64, "2500");
    let statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 8, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 56);
    // A refusal: no slot left, and no reset time (requests in flight have none); the wait is
    // a hint of a second.
    let refused = responses.iter().find(|r| r.status == 429).unwrap();
    let x = |name| refused.header(name);
    assert_eq!(
        [
            x("x-ratelimit-limit"),
            x("x-ratelimit-remaining"),
            x("x-ratelimit-reset")
        ],
        [Some("8"), Some("0"), None]
    );
    assert_eq!(x("x-ratelimit-retry-after"), Some("1"));
    assert_eq!(x("ratelimit"), Some("\"tenant\";r=0"));
    assert_eq!(up.most_in_flight(), 8);
    // Every slot came back: the next wave gets all eight again.
    let again = wave(&envoy, 12, "1500");
    assert_eq!(again.iter().filter(|s| **s == 200).count(), 8, "{again:?}");
    let r = get(&envoy, &[("x-tenant", "t")]);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"tenant\";q=8;qu=\"concurrent-requests\"")
    );
    assert_eq!(remaining(&r, "tenant"), 7);
    let x = |name| r.header(name);
    assert_eq!(
        [
            x("x-ratelimit-limit"),
            x("x-ratelimit-remaining"),
            x("x-ratelimit-reset")
        ],
        [Some("8"), Some("7"), None]
    );
    let gauge = common::metric(None, "in_flight");
    assert_eq!(envoy.wait_stat(&gauge, 0), Some(0));
}

#[test]
fn slots_come_back_when_the_client_leaves_or_the_upstream_resets() {
    let (envoy, up) = start(IN_FLIGHT);
    // Eight clients send slow requests and hang up before the answer.
    let mut gone = Vec::new();
    for _ in 0..8 {
        let mut s = std::net::TcpStream::connect(envoy.addr).unwrap();
        std::io::Write::write_all(
            &mut s,
            b"GET / HTTP/1.1\r\nhost: x\r\nx-tenant: t\r\nx-delay-ms: 3000\r\n\r\n",
        )
        .unwrap();
        gone.push(s);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.in_flight() < 8 {
        assert!(Instant::now() < deadline, "the requests never arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(get(&envoy, &[("x-tenant", "t")]).status, 429, "all taken");
    drop(gone);
    // Their streams are reset at once: every slot is free long before the upstream answers.
    until_all_slots_free(&envoy);
    // Eight answers reset by the upstream mid-body: their slots come back too.
    for _ in 0..8 {
        let r = Client::connect(envoy.addr).unwrap().send(
            "GET",
            "/",
            &[
                ("x-tenant", "t"),
                ("x-body", "5000"),
                ("x-reset-after", "10"),
            ],
        );
        assert!(r.is_err());
    }
    until_all_slots_free(&envoy);
}

#[test]
fn clients_are_keyed_by_network() {
    let upstream = Upstream::start();
    let listener = Listener {
        upstream: Some(upstream.addr),
        client_ip_header: Some("x-client-ip"),
        ..Listener::default()
    };
    let config = r#"{"rules": [
        {"name": "v4", "key": [{"remote_address": {"ipv4_prefix": 24}}],
         "match": {"path": "/v4"}, "rate_limit": {"requests_per_unit": 2, "unit": "hour"}},
        {"name": "v6", "key": ["remote_address"],
         "match": {"path": "/v6"}, "rate_limit": {"requests_per_unit": 2, "unit": "hour"}}]}"#;
    let envoy = Envoy::start_yaml(&bootstrap_with(config, &listener));
    let from = |path: &str, ip: &str| {
        Client::connect(envoy.addr)
            .unwrap()
            .send("GET", path, &[("x-client-ip", ip)])
            .unwrap()
            .status
    };
    // One /24: two addresses share the quota of 2.
    assert_eq!(from("/v4", "10.1.2.3"), 200);
    assert_eq!(from("/v4", "10.1.2.250"), 200);
    assert_eq!(from("/v4", "10.1.2.9"), 429);
    // Another /24 has its own.
    assert_eq!(from("/v4", "10.1.3.3"), 200);
    // IPv6: one /64 by default, whatever the interface identifier.
    assert_eq!(from("/v6", "2001:db8:1:2::1"), 200);
    assert_eq!(from("/v6", "2001:db8:1:2:ffff:ffff:ffff:fffe"), 200);
    assert_eq!(from("/v6", "2001:db8:1:2:abcd::7"), 429);
    assert_eq!(from("/v6", "2001:db8:1:3::1"), 200);
    // IPv4 is keyed per address by default.
    assert_eq!(from("/v6", "192.0.2.1"), 200);
    assert_eq!(from("/v6", "192.0.2.1"), 200);
    assert_eq!(from("/v6", "192.0.2.1"), 429);
    assert_eq!(from("/v6", "192.0.2.2"), 200);
    // The same IPv4 client seen through an IPv6 socket is the same client.
    assert_eq!(from("/v6", "::ffff:192.0.2.2"), 200);
    assert_eq!(from("/v6", "::ffff:192.0.2.2"), 429);
    assert_eq!(from("/v6", "192.0.2.2"), 429);
}

/// Over-admission of a rule charged afterwards: 32 clients at once, each answer 100 tokens
/// after 100 ms, against 2,000 tokens a day. Requests are admitted while the key's usage is
/// under the limit, so the overshoot is at most what the requests in flight when it was
/// crossed report: here 32 × 100 − 1.
#[test]
fn over_admission_is_bounded_by_the_requests_in_flight() {
    let (envoy, _up) = start(&tokens(2000, 0));
    let admitted: usize = at_once(envoy.addr, 32, |c| {
        let mut admitted = 0;
        for _ in 0..10 {
            let r = c
                .send(
                    "GET",
                    "/",
                    &[
                        ("x-api-key", "k"),
                        ("x-usage", "100"),
                        ("x-delay-ms", "100"),
                    ],
                )
                .unwrap();
            admitted += usize::from(r.status == 200);
        }
        admitted
    })
    .into_iter()
    .sum();
    let charged = admitted * 100;
    println!(
        "over-admission: {admitted} admitted of 320, {charged} tokens charged against 2000 \
         ({} over; bound 32 x 100 - 1 = 3199)",
        charged.saturating_sub(2000)
    );
    assert!(charged >= 2000, "the limit was never reached: {charged}");
    assert!(charged - 2000 <= 3199, "over by {}", charged - 2000);
}
