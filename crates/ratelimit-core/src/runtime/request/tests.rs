//! The request pipeline's unit tests, with a fake host.

use super::*;
use crate::config::ResponseConfig;
use crate::error::ServiceError;
use crate::key::Seed;
use crate::metrics::Counter;
use crate::rls::{Code, Response as RlsResponse};
use crate::store::MemoryStore;
use crate::testkit::{rls_answer, FakeHost, FakeResponse};

fn runtime(json: &str) -> Runtime<MemoryStore> {
    crate::testkit::runtime(json, Seed([1, 2]))
}

#[test]
fn a_missing_key_part_named_with_any_character_leaves_the_body_json() {
    // Found by the config fuzz target: a body path holding a NUL, a quote and a backslash.
    for dialect in ["default", "openai", "anthropic"] {
        let rt = runtime(&format!(
            r#"{{"rules": [{{"name": "k", "key": ["body:mo\u0000d\"e\\l"],
                "on_missing_key": "refuse",
                "rate_limit": {{"requests_per_unit": 5, "unit": "minute"}}}}],
                "response": {{"dialect": "{dialect}"}}}}"#
        ));
        let reply = match rt.start(&mut FakeHost::new("10.0.0.1", "/")) {
            Start::Decided(Decision::Reply(r)) => r,
            other => panic!("{dialect}: {:?}", matches!(other, Start::Ask(_))),
        };
        assert_eq!(reply.status, MISSING_KEY_STATUS);
        let v: serde_json::Value = serde_json::from_str(&reply.body)
            .unwrap_or_else(|e| panic!("{dialect}: {e}: {}", reply.body));
        assert!(v.to_string().contains(r#"(body:mo\u0000d\"e\\l)"#), "{v}");
    }
}

#[test]
fn a_shared_capacity_holds_a_heavy_tenant_to_its_share_and_reads_weights_and_bands() {
    let rt = runtime(
        r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "share": {"weight": {"from": "header:x-weight", "default": 1, "max": 4},
                      "bands": [{"name": "interactive"}, {"name": "batch", "min_share": 0.1}],
                      "band": {"from": "header:x-band", "default": "batch"}}}]}"#,
    );
    let ask = |tenant: &str, weight: &str, band: &str, now: u64| {
        let mut host = FakeHost::new("10.0.0.1", "/")
            .header("x-tenant", tenant)
            .header("x-weight", weight)
            .header("x-band", band);
        host.now = now;
        matches!(decided(&rt, &mut host), Decision::Continue(_))
    };
    let t0 = 1_800_000_000_000;
    // Alone, a tenant may use the whole capacity.
    let alone = (0..150)
        .filter(|&i| ask("heavy", "1", "batch", t0 + i))
        .count();
    assert_eq!(alone, 100);
    // A light tenant arriving then is starved; once the heavy one's first second has
    // slid out of the window, the heavy one is held to its share and the light one passes.
    assert!(!ask("light", "1", "batch", t0 + 200));
    // Its refusal says why, and its band and weight, after the limited line.
    let mut host = FakeHost::new("10.0.0.1", "/")
        .header("x-tenant", "light")
        .header("x-band", "batch");
    host.now = t0 + 201;
    assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
    let lines: Vec<&str> = host.logs.iter().map(|(_, l)| l.as_str()).collect();
    assert!(lines[0].starts_with("limited rule=provider "), "{lines:?}");
    assert!(
        lines[1].starts_with("shared rule=provider key=")
            && lines[1].ends_with(" reason=capacity band=batch weight=1"),
        "{lines:?}"
    );
    let mut light = 0;
    let mut heavy = 0;
    for ms in (1_000..3_000).step_by(10) {
        heavy += u32::from(ask("heavy", "1", "batch", t0 + ms));
        if ms % 100 == 0 && ms > 1_000 {
            light += u32::from(ask("light", "1", "batch", t0 + ms));
        }
    }
    assert_eq!(light, 19, "every light request passes");
    assert!(heavy <= 170, "the heavy one is held to its share: {heavy}");
    // The band and the weight are each request's: the record counts them.
    let record = || {
        let slot = table::SlotKind::Share.slot(rt.compiled[0].fingerprint % (1 << 31));
        let read = rt
            .store
            .read(slot, |b, _| b.and_then(crate::share::Record::decode));
        read.unwrap().unwrap()
    };
    assert_eq!(record().bands[1].active_weight(), 2);
    assert!(ask("vip", "4", "interactive", t0 + 3_000));
    // Admitted or not (the batch band uses its whole budget now that a higher band is
    // active), the request counts its tenant as active, by the weight and band it reads.
    ask("odd", "junk", "nonsense", t0 + 3_001);
    let record = record();
    assert_eq!(record.bands[0].active_weight(), 4, "the interactive band");
    // Refusals for a share are counted apart (and in `limited`).
    let counted = counts(&rt);
    let share_refused: u64 = counted
        .iter()
        .filter(|(_, c, _)| *c == Counter::ShareRefused)
        .map(|(_, _, n)| n)
        .sum();
    assert!(share_refused > 0, "{counted:?}");
    assert_eq!(
        record.bands[1].active_weight(),
        3,
        "junk weighs the default, in the default band"
    );
}

#[test]
fn a_shared_capacity_learns_the_provider_s_limit_and_strips_its_fields() {
    let rt = runtime(
        r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "algorithm": "token_bucket", "burst": 100,
            "share": {"learn": {"from": "openai", "unit": "second", "hold_s": 5,
                                "max_block_s": 2}}}]}"#,
    );
    let ask = |now: u64| admitted_at(&rt, "a", now);
    let t0 = 1_800_000_000_000;
    let mut a = ask(t0).unwrap();
    assert!(a.is_some(), "a shared rule's answer is watched");
    // The provider says 60 a second, 59 left: the fields are read, then taken out.
    let mut response = FakeResponse(vec![
        (":status".into(), b"200".to_vec()),
        ("x-ratelimit-limit-requests".into(), b"60".to_vec()),
        ("x-ratelimit-remaining-requests".into(), b"59".to_vec()),
        ("x-ratelimit-reset-requests".into(), b"1s".to_vec()),
        ("x-ratelimit-limit-tokens".into(), b"5000".to_vec()),
        ("content-type".into(), b"application/json".to_vec()),
    ]);
    respond(&rt, &mut a, &mut response, t0 + 1);
    let names: Vec<&str> = response.0.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [":status", "content-type"],
        "the account's fields are gone"
    );
    // Two seconds later: about 60 pass in a second, not about 100.
    let passed = (0..1000).filter(|i| ask(t0 + 2_000 + i).is_some()).count();
    // After the hold and the ramp, the configured capacity again.
    let configured = (0..1000).filter(|i| ask(t0 + 60_000 + i).is_some()).count();
    // (A lone tenant asking 1000 a second gets the bucket, then what refills, up to the
    // level: 97 % of a window's worth plus a burst.)
    assert!((60..=80).contains(&passed), "{passed}");
    assert!((100..=130).contains(&configured), "{configured}");
    // A provider refusal: counted, and everyone waits what it asked, at most max_block.
    let mut a = ask(t0 + 70_000).unwrap();
    let mut refusal = FakeResponse(vec![
        (":status".into(), b"429".to_vec()),
        ("retry-after".into(), b"30".to_vec()),
        ("x-ratelimit-remaining-requests".into(), b"-1".to_vec()),
    ]);
    respond(&rt, &mut a, &mut refusal, t0 + 70_001);
    assert!(ask(t0 + 71_000).is_none());
    assert!(
        ask(t0 + 72_001).is_some(),
        "blocked for two seconds, not thirty"
    );
    let counted = counts(&rt);
    let total = |c: Counter| -> u64 {
        counted
            .iter()
            .filter(|(_, k, _)| *k == c)
            .map(|(_, _, n)| n)
            .sum()
    };
    assert_eq!(total(Counter::ProviderLimited), 1);
    assert_eq!(
        total(Counter::ProviderFieldsInvalid),
        1,
        "a negative remaining"
    );
}

#[test]
fn a_provider_field_on_two_lines_is_two_values_whichever_comes_first() {
    let config = r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
        "rate_limit": {"requests_per_unit": 100, "unit": "second"},
        "algorithm": "token_bucket", "burst": 100,
        "share": {"learn": {"from": "openai", "unit": "second"}}}]}"#;
    let t0 = 1_800_000_000_000;
    for (first, second) in [("50", "80"), ("80", "50")] {
        let rt = runtime(config);
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
        host.now = t0;
        let Decision::Continue(mut a) = decided(&rt, &mut host) else {
            panic!("refused")
        };
        // HTTP reads the two lines as `50, 80`: no limit, the measure malformed as a whole.
        let mut response = FakeResponse(vec![
            (":status".into(), b"200".to_vec()),
            (
                "x-ratelimit-limit-requests".into(),
                first.as_bytes().to_vec(),
            ),
            ("x-ratelimit-remaining-requests".into(), b"40".to_vec()),
            ("x-ratelimit-reset-requests".into(), b"1s".to_vec()),
            (
                "x-ratelimit-limit-requests".into(),
                second.as_bytes().to_vec(),
            ),
        ]);
        respond(&rt, &mut a, &mut response, t0 + 1);
        let invalid: u64 = counts(&rt)
            .iter()
            .filter(|(_, c, _)| *c == Counter::ProviderFieldsInvalid)
            .map(|(_, _, n)| n)
            .sum();
        assert_eq!(invalid, 1, "{first}, {second}: counted invalid");
        let capacity: Vec<u64> = rt.share_gauges(t0 + 2).iter().map(|g| g.capacity).collect();
        assert_eq!(capacity, [100], "{first}, {second}: the capacity unchanged");
        let names: Vec<&str> = response.0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [":status"], "every line taken out");
    }
}

#[test]
fn a_retry_after_on_two_lines_is_no_wait() {
    let rt = runtime(
        r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "share": {"learn": {"from": "openai", "unit": "second", "max_block_s": 60}}}]}"#,
    );
    let ask = |now: u64| admitted_at(&rt, "a", now);
    let t0 = 1_800_000_000_000;
    let (mut a, mut b) = (ask(t0).unwrap(), ask(t0).unwrap());
    // `retry-after: 30, 1`: not a number of seconds. The refusal blocks for the wait of a
    // refusal that states none (a second), not for 30 s.
    let mut two_lines = FakeResponse(vec![
        (":status".into(), b"429".to_vec()),
        ("retry-after".into(), b"30".to_vec()),
        ("retry-after".into(), b"1".to_vec()),
    ]);
    respond(&rt, &mut a, &mut two_lines, t0 + 1);
    assert!(ask(t0 + 500).is_none(), "blocked");
    assert!(ask(t0 + 2_000).is_some(), "for a second, not 30");
    // The control: one line of 30 s blocks for 30 s.
    let mut one_line = FakeResponse(vec![
        (":status".into(), b"429".to_vec()),
        ("retry-after".into(), b"30".to_vec()),
    ]);
    respond(&rt, &mut b, &mut one_line, t0 + 2_001);
    assert!(ask(t0 + 25_000).is_none(), "one line of 30 s blocks");
}

/// A request of tenant `tenant` (`x-tenant`) at `now`: what it was admitted with, if it was.
fn admitted_at(rt: &Runtime<MemoryStore>, tenant: &str, now: u64) -> Option<Option<Admitted>> {
    let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", tenant);
    host.now = now;
    match decided(rt, &mut host) {
        Decision::Continue(a) => Some(a),
        _ => None,
    }
}

fn decided(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> Decision {
    match rt.start(host) {
        Start::Decided(d) => d,
        Start::Ask(p) => panic!("asked {:?}", p.questions()),
    }
}

fn counts(rt: &Runtime<MemoryStore>) -> Vec<(usize, Counter, u64)> {
    let mut out = Vec::new();
    rt.metrics().drain(|r, c, n| out.push((r, c, n)), |_, _| {});
    out
}

/// The fields the response gets, its headers being `response`.
fn respond(
    rt: &Runtime<MemoryStore>,
    a: &mut Option<Admitted>,
    response: &mut FakeResponse,
    now: u64,
) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    if let Some(a) = a {
        rt.response_headers(
            a,
            response,
            now,
            &mut String::new(),
            |k, v, append| out.push((k.to_string(), v.to_string(), append)),
            &mut |_, _| {},
        );
    }
    out
}

fn fields(rt: &Runtime<MemoryStore>, a: &Option<Admitted>) -> Vec<(String, String, bool)> {
    let mut a = a.as_ref().map(|a| Admitted {
        verdicts: a.verdicts.clone(),
        service: a.service.clone(),
        owed: Vec::new(),
        body_bytes: 0,
        scan: None,
        watched: SmallVec::new(),
        timed: false,
        dated: false,
        admitted_ms: 0,
    });
    respond(rt, &mut a, &mut FakeResponse::default(), 0)
}

const PER_CLIENT: &str = r#"{"rules": [{"name": "per-client", "key": ["remote_address"],
    "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}], "log_limited": "info"}"#;

/// Requests per minute and tokens per hour of one API key, answered in `dialect` only.
fn llm_runtime(dialect: &str) -> Runtime<MemoryStore> {
    runtime(&format!(
        r#"{{"rules": [
          {{"name": "rpm", "key": ["header:authorization"],
            "rate_limit": {{"requests_per_unit": 2, "unit": "minute"}}}},
          {{"name": "tpm", "key": ["header:authorization"],
            "rate_limit": {{"requests_per_unit": 1000, "unit": "hour"}},
            "cost": {{"response": "header:x-usage", "reserve": 100}}}}],
          "response": {{"headers": "none", "dialect": "{dialect}"}}}}"#
    ))
}

fn key_host() -> FakeHost {
    FakeHost::new("10.0.0.1", "/v1/chat/completions").header("authorization", "Bearer sk-1")
}

/// A dialect's fields, each replacing the backend's of its name.
fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String, bool)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string(), false))
        .collect()
}

#[test]
fn openai_dialect_on_allowed_answers_and_refusals() {
    let rt = llm_runtime("openai");
    let mut host = key_host();
    let Decision::Continue(mut a) = decided(&rt, &mut host) else {
        panic!("refused")
    };
    // The usage (300 tokens) is charged at the response's headers: the fields report it.
    let mut response = FakeResponse::with("x-usage", "300");
    assert_eq!(
        respond(&rt, &mut a, &mut response, 600_000),
        owned(&[
            ("x-ratelimit-limit-requests", "2"),
            ("x-ratelimit-limit-tokens", "1000"),
            ("x-ratelimit-remaining-requests", "1"),
            ("x-ratelimit-remaining-tokens", "700"),
            ("x-ratelimit-reset-requests", "2m0s"),
            ("x-ratelimit-reset-tokens", "50m12s"),
        ])
    );
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    host.now += 30_000;
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("admitted over the limit")
    };
    assert_eq!(
        r.headers().collect::<Vec<_>>(),
        [
            ("content-type", "application/json"),
            ("retry-after", "60"),
            ("x-ratelimit-limit-requests", "2"),
            ("x-ratelimit-limit-tokens", "1000"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-remaining-tokens", "700"),
            ("x-ratelimit-reset-requests", "1m0s"),
            ("x-ratelimit-reset-tokens", "49m42s"),
            ("retry-after-ms", "60000"),
        ]
    );
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"error": {
            "message": "Rate limit \"rpm\" of 2 requests per 60 s exceeded; retry in 60 s.",
            "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
    );
}

#[test]
fn anthropic_dialect_dates_its_resets() {
    let rt = llm_runtime("anthropic");
    let mut host = key_host();
    let Decision::Continue(mut a) = decided(&rt, &mut host) else {
        panic!("refused")
    };
    assert!(a.as_ref().is_some_and(Admitted::needs_clock));
    let mut response = FakeResponse::with("x-usage", "950");
    // 600 s after the epoch, at the response.
    assert_eq!(
        respond(&rt, &mut a, &mut response, 601_000),
        owned(&[
            ("anthropic-ratelimit-requests-limit", "2"),
            ("anthropic-ratelimit-requests-remaining", "1"),
            ("anthropic-ratelimit-requests-reset", "1970-01-01T00:12:01Z"),
            ("anthropic-ratelimit-tokens-limit", "1000"),
            ("anthropic-ratelimit-tokens-remaining", "50"),
            ("anthropic-ratelimit-tokens-reset", "1970-01-01T01:00:04Z"),
        ])
    );
    // 50 tokens left: a request reserving 100 is refused by the tokens rule.
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("admitted over the limit")
    };
    let headers: Vec<(&str, &str)> = r.headers().collect();
    assert_eq!(headers[0], ("content-type", "application/json"));
    assert!(headers.contains(&("anthropic-ratelimit-tokens-remaining", "50")));
    assert!(!headers.iter().any(|(k, _)| *k == "retry-after-ms"));
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.starts_with("Rate limit \"tpm\" of 1000 tokens per 3600 s exceeded; retry in "),
        "{message}"
    );
    // The default dialect with its fields off sends none on allowed answers.
    let quiet = runtime(
        r#"{"rules": [{"name": "rpm", "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}],
            "response": {"headers": "none"}}"#,
    );
    assert!(matches!(
        decided(&quiet, &mut key_host()),
        Decision::Continue(None)
    ));
}

#[test]
fn admits_the_limit_then_replies_with_every_field() {
    let rt = runtime(PER_CLIENT);
    let mut host = FakeHost::new("10.0.0.1", "/");
    let Decision::Continue(a) = decided(&rt, &mut host) else {
        panic!("refused")
    };
    // 1 of 2 used at 600 s (a window boundary): the whole quota is back once that request
    // has decayed out of the sliding window, 120 s on.
    assert_eq!(
        fields(&rt, &a),
        [
            ("ratelimit-policy", "\"per-client\";q=2;w=60", true),
            ("ratelimit", "\"per-client\";r=1;t=120", true),
            ("x-ratelimit-limit", "2", true),
            ("x-ratelimit-remaining", "1", true),
            ("x-ratelimit-reset", "120", true),
        ]
        .map(|(k, v, a)| (k.to_string(), v.to_string(), a))
    );
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("admitted over the limit")
    };
    assert_eq!(r.status, 429);
    let headers: Vec<(&str, &str)> = r.headers().collect();
    assert_eq!(headers[0], ("content-type", "application/problem+json"));
    assert_eq!(headers[1], ("retry-after", "90"));
    assert!(headers.contains(&("x-ratelimit-retry-after", "90")));
    assert!(headers.contains(&("ratelimit", "\"per-client\";r=0;t=90")));
    assert!(r.body.contains("\"violated-policies\":[\"per-client\"]"));
    assert_eq!(
        counts(&rt),
        [
            (0, Counter::Allowed, 2),
            (0, Counter::Limited, 1),
            (0, Counter::RetryAfterSeconds, 90)
        ]
    );
    // The limited line, at the configured level, with the key hashed.
    assert_eq!(host.logs.len(), 1);
    let (level, line) = &host.logs[0];
    assert_eq!(*level, log::Level::Info);
    assert!(line.starts_with("limited rule=per-client shadow=false key="));
    assert!(line.ends_with("cost=1 limit=2 window=60s remaining=0 retry_after_ms=90000"));
    assert!(!line.contains("10.0.0.1"));
    // Another client has its own counter; a request no rule applies to passes untouched.
    assert!(matches!(
        decided(&rt, &mut FakeHost::new("10.0.0.2", "/")),
        Decision::Continue(Some(_))
    ));
    let mut no_address = FakeHost::new("10.0.0.3", "/");
    no_address.req.source_address = None;
    assert!(matches!(
        decided(&rt, &mut no_address),
        Decision::Continue(None)
    ));
}

#[test]
fn response_settings_shape_the_fields() {
    let rt = runtime(
        r#"{"rules": [{"name": "a", "rate_limit": {"requests_per_unit": 1, "unit": "second"},
            "cost": {"header": "x-cost"}}],
            "response": {"status": 503, "headers": "ietf", "on_allowed": false}}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/");
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
    // A cost from the header: 5 never fits a limit of 1.
    let mut costly = FakeHost::new("10.0.0.1", "/").header("x-cost", "5");
    costly.now += 5_000;
    let Decision::Reply(r) = decided(&rt, &mut costly) else {
        panic!("admitted")
    };
    assert_eq!(r.status, 503);
    let names: Vec<&str> = r.headers().map(|(k, _)| k).collect();
    assert_eq!(
        names,
        [
            "content-type",
            "retry-after",
            "ratelimit-policy",
            "ratelimit"
        ]
    );
}

const DELAY: &str = r#"{"rules": [{"name": "d", "algorithm": "leaky_bucket", "burst": 3,
    "on_limit": "delay", "max_delay_ms": 5000,
    "rate_limit": {"requests_per_unit": 1, "unit": "second"}}]}"#;

#[test]
fn sliding_logs_are_tracked_apart_from_the_buckets() {
    // Each key of a sliding_log rule has a slot of its own, not an entry in a bucket: the
    // two gauges each stay within the capacity.
    let rt = runtime(
        r#"{"rules": [
            {"name": "window", "key": ["remote_address"],
             "rate_limit": {"requests_per_unit": 10, "unit": "minute"}},
            {"name": "log", "algorithm": "sliding_log", "key": ["remote_address"],
             "rate_limit": {"requests_per_unit": 10, "unit": "minute"}}]}"#,
    );
    for client in ["10.0.0.1", "10.0.0.2", "10.0.0.1"] {
        let mut host = FakeHost::new(client, "/");
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    }
    let mut gauges = Vec::new();
    rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
    assert_eq!(gauges, [(Gauge::TrackedKeys, 2), (Gauge::TrackedLogs, 2)]);
}

#[test]
fn delay_mode_holds_and_counts_each_fate() {
    let rt = runtime(DELAY);
    let mut host = FakeHost::new("10.0.0.1", "/");
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    let Decision::Hold { until_ms, held, .. } = decided(&rt, &mut host) else {
        panic!("not held")
    };
    assert_eq!(until_ms, host.now + 1_000);
    let Decision::Hold { held: held2, .. } = decided(&rt, &mut host) else {
        panic!("not held")
    };
    let mut gauges = Vec::new();
    rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
    assert_eq!(gauges, [(Gauge::TrackedKeys, 1), (Gauge::DelayQueue, 2)]);
    // Nothing is counted as admitted until the request goes on.
    rt.release(&held);
    rt.abandon(&held2);
    let mut gauges = Vec::new();
    let mut c = Vec::new();
    rt.metrics()
        .drain(|r, k, n| c.push((r, k, n)), |g, d| gauges.push((g, d)));
    assert_eq!(
        c,
        [
            (0, Counter::Allowed, 1),
            (0, Counter::Delayed, 1),
            (0, Counter::Abandoned, 1)
        ]
    );
    assert_eq!(gauges, [(Gauge::DelayQueue, -2)]);
    // A worker holding all it may: only a request whose turn is now passes.
    let mut full = FakeHost::new("10.0.0.1", "/");
    full.held = MAX_HELD;
    full.now += 10_000;
    assert!(matches!(decided(&rt, &mut full), Decision::Continue(_)));
    assert!(matches!(decided(&rt, &mut full), Decision::Reply(_)));
}

const SYNC: &str = r#"{"rules": [
    {"name": "g", "key": ["remote_address"], "rate_limit": {"requests_per_unit": 10, "unit": "minute"},
     "global": {"cluster": "rls", "domain": "edge"}},
    {"name": "local", "rate_limit": {"requests_per_unit": 1, "unit": "minute"}}],
    "failure_mode": "deny"}"#;

fn ok(code: Code, remaining: u32) -> Answer {
    Ok(RlsResponse {
        headers: vec![("x-from-service".into(), "1".into())],
        ..rls_answer(code, remaining)
    })
}

#[test]
fn sync_rules_ask_first_and_local_rules_count_only_if_admitted() {
    let rt = runtime(SYNC);
    let mut host = FakeHost::new("10.0.0.1", "/");
    let Start::Ask(mut p) = rt.start(&mut host) else {
        panic!("did not ask")
    };
    let q = &p.questions()[0];
    assert_eq!(q.rule, 0);
    assert_eq!(rt.global_of(q.rule).unwrap().cluster, "rls");
    let entries = vec![
        ("rule".to_string(), b"g".to_vec()),
        ("remote_address".to_string(), b"10.0.0.1".to_vec()),
    ];
    assert_eq!(q.message, global::request("edge", &entries, 1));
    assert!(!p.complete());
    // The service refuses: the local rule counts nothing.
    p.answer(0, ok(Code::OverLimit, 0));
    p.answer(0, ok(Code::Ok, 9)); // a second answer is ignored
    assert!(p.complete());
    let Decision::Reply(r) = rt.finish(&mut host, &p) else {
        panic!("admitted")
    };
    let headers: Vec<(&str, &str)> = r.headers().collect();
    assert!(headers.contains(&("retry-after", "30")));
    assert!(headers.contains(&("x-from-service", "1")));
    assert!(headers.contains(&("ratelimit", "\"g\";r=0;t=30")));
    // Its log line names the client key's hash, as a local refusal's does.
    let (_, line) = host
        .logs
        .iter()
        .find(|(_, l)| l.starts_with("limited rule=g "))
        .unwrap();
    let key = line
        .split("key=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert_eq!(key.len(), 16);
    assert_ne!(key, "0000000000000000", "{line}");
    assert!(line.contains(" cost=1 "), "{line}");
    // Admitted by the service: the local rule decides, and counts.
    let Start::Ask(mut p) = rt.start(&mut host) else {
        panic!()
    };
    p.answer(0, ok(Code::Ok, 9));
    let Decision::Continue(a) = rt.finish(&mut host, &p) else {
        panic!("refused")
    };
    let f = fields(&rt, &a);
    assert_eq!(f[0], ("x-from-service".into(), "1".into(), false));
    assert!(f.contains(&(
        "ratelimit-policy".into(),
        "\"g\";q=10;w=60, \"local\";q=1;w=60".into(),
        true
    )));
    // The service fails and failure_mode is deny.
    let Start::Ask(mut p) = rt.start(&mut host) else {
        panic!()
    };
    p.answer(0, Err(ServiceError::Grpc(14)));
    assert!(matches!(rt.finish(&mut host, &p), Decision::Reply(_)));
    assert_eq!(
        counts(&rt),
        [
            (0, Counter::Allowed, 1),
            (0, Counter::Limited, 1),
            (0, Counter::FailedClosed, 1),
            (0, Counter::GlobalErrors, 1),
            (0, Counter::RetryAfterSeconds, 30),
            (1, Counter::Allowed, 1),
        ]
    );
    assert!(host.logs.iter().any(|(l, line)| *l == log::Level::Warn
        && line == "rule g could not be decided (gRPC status 14); failure_mode Deny applied"));
}

#[test]
fn async_rules_report_hits_and_a_refusal_blocks_the_key() {
    let rt = runtime(
        r#"{"rules": [{"name": "g", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "async", "flush_ms": 50}}]}"#,
    );
    assert_eq!(rt.flush_period(), Some(50));
    let mut host = FakeHost::new("10.0.0.1", "/").header("x-ignored", "1");
    for _ in 0..3 {
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    }
    let flushes = rt.flush();
    assert_eq!(flushes.len(), 1);
    let entries = vec![
        ("rule".to_string(), b"g".to_vec()),
        ("remote_address".to_string(), b"10.0.0.1".to_vec()),
    ];
    assert_eq!(flushes[0].message, global::request("edge", &entries, 3));
    assert!(rt.flush().is_empty());
    // The fleet is over the limit: this proxy blocks the key until the service's reset.
    rt.flushed(
        &flushes[0].target,
        flushes[0].hits,
        ok(Code::OverLimit, 0),
        host.now,
    );
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("not blocked")
    };
    assert!(r.headers().any(|h| h == ("retry-after", "30")));
    host.now += 30_000;
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    // Errors are counted, nothing else.
    rt.flushed(
        &flushes[0].target,
        flushes[0].hits,
        Err(ServiceError::Reset(1)),
        host.now,
    );
    assert!(counts(&rt).contains(&(0, Counter::GlobalErrors, 1)));
}

#[test]
fn hits_of_keys_past_what_a_flush_holds_are_counted_lost() {
    let rt = runtime(
        r#"{"rules": [{"name": "g", "key": ["header:x-k"],
            "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "async"}}]}"#,
    );
    for k in 0..=global::MAX_ASYNC_KEYS {
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-k", &k.to_string());
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    }
    assert!(counts(&rt).contains(&(0, Counter::ReportsLost, 1)));
    assert_eq!(rt.flush().len(), global::MAX_ASYNC_KEYS);
}

#[test]
fn shadow_rules_never_refuse() {
    let rt = runtime(
        r#"{"shadow": true, "rules": [{"name": "s", "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/");
    for _ in 0..3 {
        assert!(matches!(
            decided(&rt, &mut host),
            Decision::Continue(Some(_))
        ));
    }
    assert_eq!(
        counts(&rt),
        [(0, Counter::Allowed, 1), (0, Counter::ShadowLimited, 2)]
    );
}

const API_KEY: &str = r#"{"rules": [{"name": "per-key",
    "key": [{"first": ["header:x-api-key", "bearer", "query:key"]}],
    "on_missing_key": "MODE",
    "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}], "log_limited": "info"}"#;

fn api_key(mode: &str) -> Runtime<MemoryStore> {
    runtime(&API_KEY.replace("MODE", mode))
}

#[test]
fn a_key_counts_the_same_whichever_way_it_is_sent() {
    let rt = api_key("skip");
    let ways = [
        FakeHost::new("10.0.0.1", "/").header("x-api-key", "sk-1"),
        FakeHost::new("10.0.0.2", "/").header("authorization", "Bearer sk-1"),
        FakeHost::new("10.0.0.3", "/v1?key=sk-1"),
    ];
    let mut limited = 0;
    for mut host in ways {
        match decided(&rt, &mut host) {
            Decision::Reply(r) => {
                assert_eq!(r.status, 429);
                limited += 1;
            }
            Decision::Continue(_) => {}
            Decision::Hold { .. } | Decision::Queue(_) => panic!("held"),
        }
    }
    // One key of 2 a minute, sent three ways: the third is refused.
    assert_eq!(limited, 1);
    // x-api-key wins over a bearer token sent beside it; another scheme is no key.
    let mut both = FakeHost::new("10.0.0.4", "/")
        .header("x-api-key", "sk-2")
        .header("authorization", "Bearer sk-1");
    assert!(matches!(decided(&rt, &mut both), Decision::Continue(_)));
    let mut basic = FakeHost::new("10.0.0.4", "/").header("authorization", "Basic c2stMQ==");
    assert!(matches!(decided(&rt, &mut basic), Decision::Continue(None)));
    assert_eq!(
        counts(&rt),
        [
            (0, Counter::Allowed, 3),
            (0, Counter::Limited, 1),
            (0, Counter::RetryAfterSeconds, 90),
            (0, Counter::KeyMissing, 1),
        ]
    );
}

#[test]
fn a_request_without_its_key_is_skipped_shared_or_refused() {
    // skip: the rule does not apply (counted in key_missing).
    let rt = api_key("skip");
    for _ in 0..5 {
        let mut host = FakeHost::new("10.0.0.1", "/");
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
    }
    assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 5)]);

    // shared: every keyless request shares one key, apart from every real key.
    let rt = api_key("shared");
    let mut outcomes = Vec::new();
    for addr in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
        let mut host = FakeHost::new(addr, "/");
        outcomes.push(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    }
    assert_eq!(outcomes, [true, true, false]);
    let mut keyed = FakeHost::new("10.0.0.1", "/").header("authorization", "bearer sk-9");
    assert!(matches!(
        decided(&rt, &mut keyed),
        Decision::Continue(Some(_))
    ));
    // A value that reads like the shared one's descriptor is a key of its own.
    let mut lookalike = FakeHost::new("10.0.0.1", "/").header("x-api-key", key::MISSING_VALUE);
    assert!(matches!(
        decided(&rt, &mut lookalike),
        Decision::Continue(Some(_))
    ));
    assert!(counts(&rt).contains(&(0, Counter::KeyMissing, 3)));

    // refuse: a 401 that waiting does not lift, with a Bearer challenge.
    let rt = api_key("refuse");
    let mut host = FakeHost::new("10.0.0.1", "/").header("authorization", "Basic eA==");
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("a request without its key went on")
    };
    assert_eq!(r.status, 401);
    let headers: Vec<(&str, &str)> = r.headers().collect();
    assert_eq!(
        headers,
        [
            ("content-type", "application/problem+json"),
            ("www-authenticate", "Bearer realm=\"per-key\""),
        ]
    );
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["status"], 401);
    assert_eq!(body["violated-policies"][0], "per-key");
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("first(header:x-api-key, bearer, query:key)"));
    assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 1)]);
    assert_eq!(
        host.logs,
        [(
            log::Level::Info,
            "refused rule=per-key shadow=false missing_key=first(header:x-api-key, bearer, query:key)".to_string()
        )]
    );
    // A request with its key is limited as usual.
    let mut keyed = FakeHost::new("10.0.0.1", "/").header("x-api-key", "sk-1");
    assert!(matches!(
        decided(&rt, &mut keyed),
        Decision::Continue(Some(_))
    ));

    // A shadow rule only logs; a key that is not a bearer token gets no challenge.
    let rt = runtime(
        r#"{"shadow": true, "rules": [{"name": "s", "key": ["header:x-api-key"], "on_missing_key": "refuse",
            "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/");
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
    assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 1)]);
    let rt = runtime(
        r#"{"rules": [{"name": "s", "key": ["header:x-api-key"], "on_missing_key": "refuse",
            "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
    );
    let Decision::Reply(r) = decided(&rt, &mut FakeHost::new("10.0.0.1", "/")) else {
        panic!("a request without its key went on")
    };
    assert_eq!(r.headers().count(), 1);
}

#[test]
fn the_failure_reply_says_the_filter_could_not_decide() {
    let r = failure_reply(&ResponseConfig::default());
    assert_eq!(r.status, 429);
    assert!(r.body.contains("could not decide"));
    assert_eq!(r.headers().count(), 2);
    // In a dialect: its body, and OpenAI's retry-after-ms.
    let openai = ResponseConfig {
        status: 503,
        dialect: Dialect::OpenAi,
        ..ResponseConfig::default()
    };
    let r = failure_reply(&openai);
    assert_eq!(r.status, 503);
    assert_eq!(
        r.headers().collect::<Vec<_>>(),
        [
            ("content-type", "application/json"),
            ("retry-after", "1"),
            ("retry-after-ms", "1000")
        ]
    );
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        body["error"]["message"],
        "The rate limiter could not decide; retry in 1 s."
    );
}

const TOKENS: &str = r#"{"rules": [{"name": "llm", "key": ["header:x-api-key"],
    "rate_limit": {"requests_per_unit": 10000, "unit": "minute"},
    "cost": {"response": "header:x-usage-tokens", "reserve": 4000, "default": 500}}]}"#;

fn admitted(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> Option<Admitted> {
    match decided(rt, host) {
        Decision::Continue(a) => a,
        other => panic!("not admitted: {other:?}"),
    }
}

#[test]
fn usage_is_charged_when_the_response_reports_it() {
    let rt = runtime(TOKENS);
    let mut host = FakeHost::new("10.0.0.1", "/").header("x-api-key", "k");
    let now = host.now;
    // Admitted while 4,000 tokens fit; nothing is counted yet.
    let mut a = admitted(&rt, &mut host);
    let mut b = admitted(&rt, &mut host);
    // The upstream says the first used 5,000: charged at its headers, and its fields
    // report the quota after the charge.
    let f = respond(
        &rt,
        &mut a,
        &mut FakeResponse::with("x-usage-tokens", "5000"),
        now,
    );
    assert!(f.contains(&(
        "ratelimit-policy".into(),
        "\"llm\";q=10000;w=60;qu=\"tokens\"".into(),
        true
    )));
    assert!(
        f.contains(&("x-ratelimit-remaining".into(), "5000".into(), true)),
        "{f:?}"
    );
    assert!(!a.as_ref().unwrap().owes());
    // The second reports nothing in its headers but in its trailers: 3,000.
    let f = respond(&rt, &mut b, &mut FakeResponse::default(), now);
    assert!(
        f.contains(&("x-ratelimit-remaining".into(), "10000".into(), true)),
        "{f:?}"
    );
    let mut b = b.unwrap();
    assert!(b.owes());
    rt.response_trailers(
        &mut b,
        &mut FakeResponse::with("x-usage-tokens", " 3000 "),
        now,
        &mut |_, _| {},
    );
    assert!(!b.owes());
    rt.settle(b, now, &mut |_, _| {});
    // 8,000 used: 2,000 left, less than the reserve: refused, with the exact wait (the
    // usage must decay to 6,000).
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("admitted without room for the reserve")
    };
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        body["detail"],
        "Rate limit \"llm\" of 10000 tokens per 60 s exceeded; retry in 75 s."
    );
    // Another key is not affected; a response that never says is charged the default.
    let mut other = FakeHost::new("10.0.0.1", "/").header("x-api-key", "other");
    let c = admitted(&rt, &mut other).unwrap();
    rt.settle(c, now, &mut |_, _| {});
    let counted = counts(&rt);
    assert!(
        counted.contains(&(0, Counter::UsageCharged, 8_500)),
        "{counted:?}"
    );
    assert!(counted.contains(&(0, Counter::UsageUnreported, 1)));
    assert!(counted.contains(&(0, Counter::Allowed, 3)));
    assert!(counted.contains(&(0, Counter::Limited, 1)));
    let f = fields(&rt, &admitted(&rt, &mut other));
    assert!(
        f.contains(&("x-ratelimit-remaining".into(), "9500".into(), true)),
        "{f:?}"
    );
}

#[test]
fn a_key_over_its_limit_stays_refused_until_its_usage_decays() {
    let rt = runtime(
        r#"{"rules": [{"name": "llm", "algorithm": "token_bucket", "burst": 1000,
            "rate_limit": {"requests_per_unit": 1000, "unit": "second"},
            "cost": {"response": "header:x-usage-tokens"}}]}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/");
    let now = host.now;
    let mut a = admitted(&rt, &mut host);
    respond(
        &rt,
        &mut a,
        &mut FakeResponse::with("x-usage-tokens", "3000"),
        now,
    );
    // 2,000 over: refused for 2 s (and one token's worth), then admitted again.
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("admitted over the limit")
    };
    assert!(r.headers().any(|h| h == ("retry-after", "3")), "{r:?}");
    host.now = now + 2_000;
    assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
    host.now = now + 2_001;
    assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
}

#[test]
fn body_bytes_are_counted_as_they_pass_and_charged_at_the_end() {
    let rt = runtime(
        r#"{"rules": [{"name": "dl", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 1000, "unit": "day"},
            "cost": {"response": "body_bytes"}}]}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/");
    let now = host.now;
    let mut a = admitted(&rt, &mut host);
    let f = respond(&rt, &mut a, &mut FakeResponse::default(), now);
    assert!(f.contains(&(
        "ratelimit-policy".into(),
        "\"dl\";q=1000;w=86400;qu=\"content-bytes\"".into(),
        true
    )));
    let mut a = a.unwrap();
    for chunk in [400, 300, 200] {
        rt.response_body(&mut a, chunk, None, false, || now, &mut |_, _| {});
    }
    rt.settle(a, now, &mut |_, _| {});
    let f = fields(&rt, &admitted(&rt, &mut host));
    assert!(
        f.contains(&("x-ratelimit-remaining".into(), "100".into(), true)),
        "{f:?}"
    );
    assert!(counts(&rt).contains(&(0, Counter::UsageCharged, 900)));
}

#[test]
fn in_flight_slots_are_taken_and_given_back() {
    let rt = runtime(
        r#"{"rules": [{"name": "tenant", "key": ["header:x-tenant"],
            "in_flight": {"max": 2}}]}"#,
    );
    let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", "t");
    let now = host.now;
    let a = admitted(&rt, &mut host).unwrap();
    let b = admitted(&rt, &mut host).unwrap();
    assert!(a.owes() && b.owes());
    let Decision::Reply(r) = decided(&rt, &mut host) else {
        panic!("a third in flight")
    };
    let headers: Vec<(&str, &str)> = r.headers().collect();
    assert!(headers.contains(&("retry-after", "1")));
    assert!(headers.contains(&(
        "ratelimit-policy",
        "\"tenant\";q=2;qu=\"concurrent-requests\""
    )));
    assert!(headers.contains(&("ratelimit", "\"tenant\";r=0")));
    let mut gauges = Vec::new();
    rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
    assert!(gauges.contains(&(Gauge::InFlight, 2)));
    // One ends: a slot is free again, at once.
    rt.settle(a, now + 5, &mut |_, _| {});
    let c = admitted(&rt, &mut host).unwrap();
    assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
    rt.settle(b, now + 6, &mut |_, _| {});
    rt.settle(c, now + 7, &mut |_, _| {});
    let mut gauges = Vec::new();
    rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
    assert!(gauges.contains(&(Gauge::InFlight, -2)), "{gauges:?}");
    for _ in 0..2 {
        assert!(admitted(&rt, &mut host).is_some());
    }
}

#[test]
fn a_request_refused_by_another_rule_takes_no_slot() {
    let rt = runtime(
        r#"{"rules": [
            {"name": "flight", "in_flight": {"max": 5}},
            {"name": "rate", "match": {"path": "/limited"},
             "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
    );
    let mut limited = FakeHost::new("10.0.0.1", "/limited");
    let a = admitted(&rt, &mut limited).unwrap();
    for _ in 0..10 {
        assert!(matches!(decided(&rt, &mut limited), Decision::Reply(_)));
    }
    rt.settle(a, limited.now, &mut |_, _| {});
    // All five slots are free: the refused requests took none.
    let mut other = FakeHost::new("10.0.0.1", "/other");
    let held: Vec<Admitted> = (0..5).filter_map(|_| admitted(&rt, &mut other)).collect();
    assert_eq!(held.len(), 5);
    assert!(matches!(decided(&rt, &mut other), Decision::Reply(_)));
}

#[test]
fn an_elastic_limit_follows_the_backends_health() {
    let rt = runtime(
        r#"{"rules": [{"name": "e", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 10, "unit": "hour"},
            "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.1,
                        "latency_ms": 500, "window_s": 10, "ramp_s": 5}}]}"#,
    );
    assert_eq!(rt.tick_period(), Some(crate::runtime::ELASTIC_TICK_MS));
    let mut host = FakeHost::new("10.0.0.1", "/");
    // A healthy backend: 10 quick 200s a second (the requests of other keys, here on a
    // separate rule-less path would do as well: only responses to the rule count).
    let answer = |rt: &Runtime<MemoryStore>, host: &mut FakeHost, status: &str| {
        let mut a = match decided(rt, host) {
            Decision::Continue(a) => a,
            other => return Err(Box::new(other)),
        };
        respond(
            rt,
            &mut a,
            &mut FakeResponse::with(":status", status),
            host.now + 20,
        );
        Ok(())
    };
    let mut factors = Vec::new();
    for second in 0..6 {
        for _ in 0..10 {
            // Each second's requests come from a fresh client key, so the base limit
            // never refuses them.
            host.req.source_address = Some(format!("10.1.{second}.{}:1", factors.len()));
            answer(&rt, &mut host, "200").unwrap();
        }
        host.now += 1_000;
        rt.tick(host.now);
        factors.extend(rt.elastic_factors().map(|(_, pct)| pct));
    }
    // 20 % of the span (0.5× → 2×) a second, from the base: 130 %, 160 %, ... 200 %.
    assert_eq!(factors, [130, 160, 190, 200, 200, 200]);
    // One client may now make 20 requests an hour, 10 of them above the base.
    host.req.source_address = Some("10.9.9.9:1".into());
    for i in 0..20 {
        assert!(answer(&rt, &mut host, "200").is_ok(), "request {i}");
    }
    let Err(refused) = answer(&rt, &mut host, "200") else {
        panic!("admitted over the ceiling")
    };
    let Decision::Reply(r) = *refused else {
        panic!("{refused:?}")
    };
    assert!(
        r.headers().any(|h| h == ("x-ratelimit-limit", "20")),
        "{r:?}"
    );
    assert!(counts(&rt).contains(&(0, Counter::ElasticAllowed, 10)));
    // The backend fails: within a tick of a second of 503s, the limit drops to the floor.
    for i in 0..10 {
        host.req.source_address = Some(format!("10.2.0.{i}:1"));
        answer(&rt, &mut host, "503").unwrap();
    }
    host.now += 1_000;
    assert!(rt.tick(host.now), "a tick reads the shared health");
    assert!(!rt.tick(host.now + 100), "at most once per 250 ms");
    assert_eq!(rt.elastic_factors().collect::<Vec<_>>(), [(0, 50)]);
    // Slow answers count as bad too.
    assert!(rt.compiled[0]
        .watch
        .as_ref()
        .unwrap()
        .params
        .is_bad(200, 501));
}
