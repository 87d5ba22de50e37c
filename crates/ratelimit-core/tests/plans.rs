//! Limits read from the request (a customer's plan): keys with different limits share one table,
//! a key whose plan changes keeps its counter and is judged against the new limit, and missing,
//! bad and oversized values get the default or the cap, counted.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::config::Config;
use ratelimit_core::key::Seed;
use ratelimit_core::metrics::Counter;
use ratelimit_core::runtime::{Decision, Runtime, Start};
use ratelimit_core::store::MemoryStore;
use ratelimit_core::testkit::{FakeHost, FakeResponse, Meta};

fn runtime(json: &str) -> Runtime<MemoryStore> {
    let config = Config::parse(json.as_bytes()).unwrap();
    Runtime::new(config, Seed([1, 2]), MemoryStore::new())
}

const PER_CUSTOMER: &str = r#"{"rules": [{"name": "per-customer", "key": ["header:x-customer"],
    "rate_limit": {"requests_per_unit": {"from": "header:x-plan-rpm", "default": 2, "max": 5},
                   "unit": "minute"}}]}"#;

fn customer(name: &str, plan: Option<&str>) -> FakeHost {
    let host = FakeHost::new("10.0.0.1", "/").header("x-customer", name);
    match plan {
        Some(p) => host.header("x-plan-rpm", p),
        None => host,
    }
}

/// Whether the request is admitted, and the `X-RateLimit-Limit` its answer carries.
fn send(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> (bool, String) {
    let Start::Decided(d) = rt.start(host) else {
        panic!("asked a service")
    };
    let fields: Vec<(String, String)> = match d {
        Decision::Continue(Some(mut a)) => {
            let mut out = Vec::new();
            rt.response_headers(
                &mut a,
                &mut FakeResponse::default(),
                host.now,
                &mut String::new(),
                |k, v, _| out.push((k.to_string(), v.to_string())),
                &mut |_, _| {},
            );
            return (true, limit_of(&out));
        }
        Decision::Continue(None) => return (true, String::new()),
        Decision::Hold { .. } | Decision::Queue(_) => panic!("held"),
        Decision::Reply(r) => r
            .headers()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    (false, limit_of(&fields))
}

fn limit_of(fields: &[(String, String)]) -> String {
    fields
        .iter()
        .find(|(k, _)| k == "x-ratelimit-limit")
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// How many of `n` requests pass.
fn admitted(rt: &Runtime<MemoryStore>, host: &mut FakeHost, n: usize) -> usize {
    (0..n).filter(|_| send(rt, host).0).count()
}

fn counted(rt: &Runtime<MemoryStore>) -> Vec<(Counter, u64)> {
    let mut out = Vec::new();
    rt.metrics().drain(
        |_, c, n| {
            if matches!(
                c,
                Counter::LimitDefaulted | Counter::LimitInvalid | Counter::LimitCapped
            ) {
                out.push((c, n))
            }
        },
        |_, _| {},
    );
    out.sort_by_key(|(c, _)| c.name());
    out
}

#[test]
fn each_customer_gets_its_own_plan_in_one_table() {
    let rt = runtime(PER_CUSTOMER);
    let mut a = customer("a", Some("3"));
    let mut b = customer("b", Some("5"));
    assert_eq!(send(&rt, &mut a), (true, "3".into()));
    assert_eq!(send(&rt, &mut b), (true, "5".into()));
    assert_eq!(admitted(&rt, &mut a, 10), 2);
    assert_eq!(admitted(&rt, &mut b, 10), 4);
    // The refusal says the limit that applied.
    assert_eq!(send(&rt, &mut a), (false, "3".into()));
    assert_eq!(send(&rt, &mut b), (false, "5".into()));
    assert!(counted(&rt).is_empty(), "every value was taken");
}

#[test]
fn a_plan_that_changes_keeps_the_counter_and_applies_from_the_next_request() {
    let rt = runtime(PER_CUSTOMER);
    assert_eq!(admitted(&rt, &mut customer("a", Some("3")), 10), 3);
    // Upgraded mid-window: two more (5 in all), not five more.
    assert_eq!(admitted(&rt, &mut customer("a", Some("5")), 10), 2);
    // Downgraded: refused at once, with the new limit.
    assert_eq!(
        send(&rt, &mut customer("a", Some("1"))),
        (false, "1".into())
    );
    // The next window has the plan in force.
    let mut later = customer("a", Some("4"));
    later.now += 120_000;
    assert_eq!(admitted(&rt, &mut later, 10), 4);
}

#[test]
fn missing_bad_and_oversized_values_get_the_default_or_the_cap_counted() {
    let rt = runtime(PER_CUSTOMER);
    // No header, or an empty one: the default (2).
    assert_eq!(send(&rt, &mut customer("none", None)), (true, "2".into()));
    assert_eq!(
        send(&rt, &mut customer("empty", Some("  "))),
        (true, "2".into())
    );
    assert_eq!(
        counted(&rt),
        vec![(Counter::LimitDefaulted, 2)],
        "missing and empty are both missing"
    );
    // Not a whole number from 1: the default.
    for (i, bad) in ["abc", "1.5", "0", "-3", "3x", "0x10", "+4", "४"]
        .iter()
        .enumerate()
    {
        let mut host = customer(&format!("bad{i}"), Some(bad));
        assert_eq!(send(&rt, &mut host), (true, "2".into()), "{bad:?}");
    }
    assert_eq!(counted(&rt), vec![(Counter::LimitInvalid, 8)]);
    // Above the cap (5): the cap, however large.
    for (i, big) in ["6", "4294967295", "4294967296", "99999999999999999999999"]
        .iter()
        .enumerate()
    {
        let mut host = customer(&format!("big{i}"), Some(big));
        assert_eq!(send(&rt, &mut host), (true, "5".into()), "{big:?}");
    }
    assert_eq!(counted(&rt), vec![(Counter::LimitCapped, 4)]);
    // Whitespace around a number is not a reason to refuse it.
    assert_eq!(
        send(&rt, &mut customer("ws", Some(" 4 "))),
        (true, "4".into())
    );
    assert!(counted(&rt).is_empty());
}

#[test]
fn metadata_and_filter_state_carry_plans_too() {
    let rt = runtime(
        r#"{"rules": [
            {"name": "rpm", "key": ["header:x-customer"],
             "rate_limit": {"requests_per_unit": {"from": "metadata:envoy.filters.http.ext_authz:rpm", "default": 1, "max": 100}, "unit": "minute"}},
            {"name": "conc", "key": ["header:x-customer"],
             "in_flight": {"max": {"from": "filter_state:plan.concurrency", "default": 1, "max": 10}}}]}"#,
    );
    let ns = "envoy.filters.http.ext_authz";
    // A metadata number, and a metadata string of digits; the in-flight slots from filter state.
    let mut a = customer("a", None)
        .metadata(ns, "rpm", Meta::Number(3.0))
        .filter_state("plan.concurrency", "7");
    let mut b = customer("b", None).metadata(ns, "rpm", Meta::Text("4".into()));
    let mut c = customer("c", None).metadata(ns, "rpm", Meta::Number(2.5));
    let passed_a = admitted(&rt, &mut a, 10);
    let passed_b = admitted(&rt, &mut b, 10);
    let passed_c = admitted(&rt, &mut c, 10);
    assert_eq!((passed_a, passed_b, passed_c), (3, 1, 1));
    let counts = counted(&rt);
    // b carried no filter state: every one of its 10 requests defaulted the in-flight limit,
    // and c's too; c's 2.5 is not a whole number (10 requests). b's 1 slot refused 9.
    assert!(counts.contains(&(Counter::LimitInvalid, 10)), "{counts:?}");
    assert!(
        counts.contains(&(Counter::LimitDefaulted, 20)),
        "{counts:?}"
    );
    // An empty metadata string is absent, as an empty header is: the default, counted so.
    let mut d = customer("d", None).metadata(ns, "rpm", Meta::Text(" ".into()));
    assert_eq!(send(&rt, &mut d), (true, "1".into()));
    // One each for its two rules (it carries no filter state either), none invalid.
    assert_eq!(
        counted(&rt),
        vec![(Counter::LimitDefaulted, 1), (Counter::LimitDefaulted, 1)]
    );
}

#[test]
fn a_bucket_burst_follows_the_plan_unless_it_has_its_own() {
    let rt = runtime(
        r#"{"rules": [
            {"name": "follows", "key": ["header:x-customer"], "algorithm": "token_bucket",
             "rate_limit": {"requests_per_unit": {"from": "header:x-plan-rpm", "default": 2, "max": 50}, "unit": "hour"}},
            {"name": "own", "key": ["header:x-customer"], "algorithm": "token_bucket",
             "rate_limit": {"requests_per_unit": 100, "unit": "hour"},
             "burst": {"from": "header:x-plan-burst", "default": 1, "max": 50}}]}"#,
    );
    let mut a = customer("a", Some("6")).header("x-plan-burst", "40");
    // The first rule's bucket holds the plan's 6 (its burst is the limit), the second's 40.
    assert_eq!(admitted(&rt, &mut a, 20), 6);
    let mut b = customer("b", Some("50")).header("x-plan-burst", "3");
    assert_eq!(admitted(&rt, &mut b, 20), 3);
}

#[test]
fn a_reservation_is_trued_up_against_the_plan_it_was_admitted_under() {
    let rt = runtime(
        r#"{"rules": [{"name": "tokens", "key": ["header:x-customer"], "algorithm": "token_bucket",
            "rate_limit": {"requests_per_unit": {"from": "header:x-plan-tph", "default": 100, "max": 100000}, "unit": "hour"},
            "cost": {"response": "header:x-usage", "reserve": 50, "true_up": true}}]}"#,
    );
    let mut host = customer("a", None).header("x-plan-tph", "1000");
    let Start::Decided(Decision::Continue(Some(mut a))) = rt.start(&mut host) else {
        panic!("not admitted")
    };
    let mut out = Vec::new();
    rt.response_headers(
        &mut a,
        &mut FakeResponse::with("x-usage", "300"),
        host.now,
        &mut String::new(),
        |k, v, _| out.push((k.to_string(), v.to_string())),
        &mut |_, _| {},
    );
    rt.settle(a, host.now, &mut |_, _| {});
    // 300 used of the plan's 1,000 (250 beyond the reservation, charged afterwards): judged
    // against the plan's bucket, not the default's 100.
    let (ok, limit) = send(&rt, &mut host);
    assert!(ok);
    assert_eq!(limit, "1000");
    let mut probe = customer("a", None).header("x-plan-tph", "1000");
    let Start::Decided(Decision::Continue(Some(mut a))) = rt.start(&mut probe) else {
        panic!("not admitted")
    };
    let mut out = Vec::new();
    rt.response_headers(
        &mut a,
        &mut FakeResponse::default(),
        probe.now,
        &mut String::new(),
        |k, v, _| out.push((k.to_string(), v.to_string())),
        &mut |_, _| {},
    );
    let remaining: u64 = out
        .iter()
        .find(|(k, _)| k == "x-ratelimit-remaining")
        .map(|(_, v)| v.parse().unwrap())
        .unwrap();
    // 300 + 50 (the second request's reservation) + 50 (this one's) counted.
    assert_eq!(remaining, 1000 - 300 - 50 - 50);
}
