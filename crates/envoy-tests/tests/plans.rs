//! Limits read from the request (a customer's plan) in a real Envoy (two workers), in the build
//! under test: from a request header, from dynamic metadata set by Envoy's header-to-metadata
//! filter (a number and a string), and from filter state set by Envoy's set-filter-state filter;
//! a plan that changes mid-window; missing, bad and oversized values, counted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::upstream::Upstream;
use common::{at_once, bootstrap_with, metric, Client, Envoy, Listener};

/// Filters Envoy runs before this one: they turn request headers into what an auth step would
/// leave (dynamic metadata in namespace `plan`, filter state `plan.concurrency`).
const BEFORE: &str = r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-plan-md-number
                on_header_present: {metadata_namespace: plan, key: rpm, type: NUMBER}
                remove: true
              - header: x-plan-md-string
                on_header_present: {metadata_namespace: plan, key: rpm_text, type: STRING}
                remove: true
          - name: envoy.filters.http.set_filter_state
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config
              on_request_headers:
              - object_key: plan.concurrency
                factory_key: envoy.string
                skip_if_empty: true
                format_string:
                  text_format_source:
                    inline_string: "%REQ(x-plan-conc)%"
"#;

/// Envoy with `config`, the filters of [`BEFORE`] ahead of it, in front of an upstream.
fn start(config: &str) -> (Envoy, Upstream) {
    let upstream = Upstream::start();
    let listener = Listener::to(upstream.addr);
    let yaml = bootstrap_with(config, &listener).replacen(
        "          http_filters:\n",
        &format!("          http_filters:\n{BEFORE}"),
        1,
    );
    (Envoy::start_yaml(&yaml), upstream)
}

fn send(envoy: &Envoy, headers: &[(&str, &str)]) -> common::Response {
    Client::connect(envoy.addr)
        .unwrap()
        .send("GET", "/", headers)
        .unwrap()
}

/// How many of `n` requests pass, and the `X-RateLimit-Limit` of the last answer.
fn burst(envoy: &Envoy, n: usize, headers: &[(&str, &str)]) -> (usize, String) {
    let mut c = Client::connect(envoy.addr).unwrap();
    let mut passed = 0;
    let mut limit = String::new();
    for _ in 0..n {
        let r = c.send("GET", "/", headers).unwrap();
        passed += usize::from(r.status == 200);
        limit = r
            .header("x-ratelimit-limit")
            .unwrap_or_default()
            .to_string();
    }
    (passed, limit)
}

const FROM_HEADER: &str = r#"{"rules": [{"name": "rpm", "key": ["header:x-customer"],
    "algorithm": "fixed_window",
    "rate_limit": {"requests_per_unit": {"from": "header:x-plan-rpm", "default": 2, "max": 5},
                   "unit": "hour"}}]}"#;

#[test]
fn each_customer_is_held_to_the_plan_its_header_carries() {
    let (envoy, _up) = start(FROM_HEADER);
    assert_eq!(
        burst(&envoy, 8, &[("x-customer", "a"), ("x-plan-rpm", "3")]),
        (3, "3".into())
    );
    assert_eq!(
        burst(&envoy, 8, &[("x-customer", "b"), ("x-plan-rpm", "5")]),
        (5, "5".into())
    );
    // The refusal carries the limit that applied, in every field.
    let r = send(&envoy, &[("x-customer", "a"), ("x-plan-rpm", "3")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"rpm\";q=3;w=3600"));
    assert!(
        r.body_str().contains("of 3 requests per 3600 s"),
        "{}",
        r.body_str()
    );
}

#[test]
fn a_plan_upgraded_or_downgraded_mid_window_keeps_the_count() {
    let (envoy, _up) = start(FROM_HEADER);
    let a = |plan| [("x-customer", "a"), ("x-plan-rpm", plan)];
    assert_eq!(burst(&envoy, 3, &a("3")).0, 3);
    // Upgraded: two more, to five in all.
    assert_eq!(burst(&envoy, 8, &a("5")), (2, "5".into()));
    // Downgraded below what it used: refused at once.
    assert_eq!(send(&envoy, &a("1")).status, 429);
}

#[test]
fn missing_bad_and_oversized_plans_get_the_default_or_the_cap_and_are_counted() {
    let (envoy, _up) = start(FROM_HEADER);
    assert_eq!(burst(&envoy, 4, &[("x-customer", "none")]), (2, "2".into()));
    assert_eq!(
        burst(&envoy, 4, &[("x-customer", "bad"), ("x-plan-rpm", "lots")]),
        (2, "2".into())
    );
    assert_eq!(
        burst(&envoy, 4, &[("x-customer", "neg"), ("x-plan-rpm", "-4")]),
        (2, "2".into())
    );
    assert_eq!(
        burst(
            &envoy,
            8,
            &[("x-customer", "big"), ("x-plan-rpm", "99999999999")]
        ),
        (5, "5".into())
    );
    assert_eq!(
        envoy.wait_stat(&metric(Some("rpm"), "limit_defaulted"), 4),
        Some(4)
    );
    assert_eq!(
        envoy.wait_stat(&metric(Some("rpm"), "limit_invalid"), 8),
        Some(8)
    );
    assert_eq!(
        envoy.wait_stat(&metric(Some("rpm"), "limit_capped"), 8),
        Some(8)
    );
}

#[test]
fn plans_come_from_dynamic_metadata_and_filter_state() {
    let (envoy, _up) = start(
        r#"{"rules": [
            {"name": "md-number", "key": ["header:x-customer"], "algorithm": "fixed_window",
             "match": {"headers": [{"name": "x-rule", "value": "number"}]},
             "rate_limit": {"requests_per_unit": {"from": "metadata:plan:rpm", "default": 1, "max": 100}, "unit": "hour"}},
            {"name": "md-string", "key": ["header:x-customer"], "algorithm": "fixed_window",
             "match": {"headers": [{"name": "x-rule", "value": "string"}]},
             "rate_limit": {"requests_per_unit": {"from": "metadata:plan:rpm_text", "default": 1, "max": 100}, "unit": "hour"}},
            {"name": "conc", "key": ["header:x-customer"],
             "match": {"headers": [{"name": "x-rule", "value": "conc"}]},
             "in_flight": {"max": {"from": "filter_state:plan.concurrency", "default": 1, "max": 10}}}]}"#,
    );
    let number = [
        ("x-customer", "a"),
        ("x-rule", "number"),
        ("x-plan-md-number", "4"),
    ];
    assert_eq!(burst(&envoy, 8, &number), (4, "4".into()));
    let string = [
        ("x-customer", "b"),
        ("x-rule", "string"),
        ("x-plan-md-string", "3"),
    ];
    assert_eq!(burst(&envoy, 8, &string), (3, "3".into()));
    // Without the metadata: the default.
    assert_eq!(
        burst(&envoy, 4, &[("x-customer", "c"), ("x-rule", "number")]),
        (1, "1".into())
    );
    // Six slow requests at once: filter state allows 4 in flight, the default 1.
    let wave = |conc: Option<&'static str>, customer: &'static str| {
        let statuses = at_once(envoy.addr, 6, move |c| {
            let mut h = vec![
                ("x-customer", customer),
                ("x-rule", "conc"),
                ("x-delay-ms", "1500"),
            ];
            if let Some(n) = conc {
                h.push(("x-plan-conc", n));
            }
            c.send("GET", "/", &h).unwrap().status
        });
        statuses.iter().filter(|s| **s == 200).count()
    };
    assert_eq!(wave(Some("4"), "d"), 4);
    assert_eq!(wave(None, "e"), 1);
}
