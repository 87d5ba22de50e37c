//! The tests of a response's charge: usage read from answers, reservations and their true-up,
//! the request bodies rules wait for.

use crate::key::Seed;
use crate::metrics::Counter;
use crate::runtime::{Next, Runtime, StreamState};
use crate::store::{MemoryStore, Store};
use crate::testkit::{FakeHost, FakeResponse};

const STREAM: &str = include_str!("../../../tests/fixtures/llm/anthropic_stream.sse");

fn runtime(json: &str) -> Runtime<MemoryStore> {
    crate::testkit::runtime(json, Seed([3, 4]))
}

fn counted(rt: &Runtime<MemoryStore>, which: Counter) -> u64 {
    let mut n = 0;
    rt.metrics()
        .drain(|_, c, k| n += if c == which { k } else { 0 }, |_, _| {});
    n
}

fn host(key: &str) -> FakeHost {
    let mut h = FakeHost::new("10.0.0.1", "/v1/messages");
    h.req
        .headers
        .push(("x-api-key".into(), key.as_bytes().to_vec()));
    h
}

/// The key's remaining quota, probed with a request that reserves the rule's default and
/// is then trued up to nothing (or is refused, and says what is left).
fn remaining(rt: &Runtime<MemoryStore>, key: &str, reserve: u64) -> u64 {
    let mut st = StreamState::default();
    let parse = |k: &str, v: &str| {
        (k == "x-ratelimit-remaining")
            .then(|| v.parse::<u64>().ok())
            .flatten()
    };
    match st.request_headers(rt, &mut host(key)) {
        Next::Continue => {}
        Next::Reply(r) => return r.headers().find_map(|(k, v)| parse(k, v)).unwrap(),
        other => panic!("{other:?}"),
    }
    let mut left = None;
    let mut json = FakeResponse::with("content-type", "application/json");
    st.response_headers(
        rt,
        &mut json,
        || 600_000,
        &mut String::new(),
        |k, v, _| left = left.or(parse(k, v)),
        |_, _| {},
    );
    st.response_body(
        rt,
        0,
        Some(br#"{"usage":{"total_tokens":0,"input_tokens":0,"output_tokens":0}}"#),
        true,
        || 600_000,
        |_, _| {},
    );
    st.complete(rt, || 600_000, |_, _| {});
    left.unwrap() + reserve
}

/// Answers with `body` (of `content_type`) in pieces of `piece` bytes; what was reported.
fn answer(
    rt: &Runtime<MemoryStore>,
    st: &mut StreamState,
    headers: &[(&str, &str)],
    body: &[u8],
    piece: usize,
    end: bool,
) -> Vec<(String, u64)> {
    let mut reported = Vec::new();
    let mut response = FakeResponse(
        headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect(),
    );
    st.response_headers(
        rt,
        &mut response,
        || 600_000,
        &mut String::new(),
        |_, _, _| {},
        |_, _| {},
    );
    for chunk in body.chunks(piece.max(1)) {
        let bytes = st.scans_body().then_some(chunk);
        st.response_body(
            rt,
            chunk.len() as u64,
            bytes,
            false,
            || 600_000,
            |r, n| reported.push((r.to_string(), n)),
        );
    }
    if end {
        st.response_body(
            rt,
            0,
            None,
            true,
            || 600_000,
            |r, n| reported.push((r.to_string(), n)),
        );
    }
    st.complete(rt, || 600_000, |r, n| reported.push((r.to_string(), n)));
    reported
}

const ANTHROPIC: &str = r#"{"rules": [{"name": "tokens", "key": ["header:x-api-key"],
    "rate_limit": {"requests_per_unit": 10000, "unit": "hour"},
    "cost": {"response": "anthropic", "reserve": 100, "default": 7}}]}"#;

#[test]
fn a_streamed_answer_is_charged_what_its_events_report_at_its_last_event() {
    let rt = runtime(ANTHROPIC);
    let sse = [("content-type", "text/event-stream; charset=utf-8")];
    for piece in [1, 7, 64, STREAM.len()] {
        let mut st = StreamState::default();
        assert!(matches!(
            st.request_headers(&rt, &mut host("k")),
            Next::Continue
        ));
        assert!(st.counts_body());
        let got = answer(&rt, &mut st, &sse, STREAM.as_bytes(), piece, true);
        // message_start's input_tokens 472, message_delta's output_tokens 89.
        assert_eq!(got, [("tokens".to_string(), 472 + 89)], "pieces of {piece}");
    }
    assert_eq!(counted(&rt, Counter::UsageCharged), 4 * 561);
    assert_eq!(counted(&rt, Counter::UsageUnreported), 0);
}

#[test]
fn a_stream_cut_short_or_compressed_or_silent_is_charged_the_default() {
    let rt = runtime(ANTHROPIC);
    let sse = [("content-type", "text/event-stream")];
    // Cut short before its last event: however much it said, the default.
    let cut = STREAM.find("event: message_stop").unwrap();
    let mut st = StreamState::default();
    st.request_headers(&rt, &mut host("k"));
    assert_eq!(
        answer(&rt, &mut st, &sse, &STREAM.as_bytes()[..cut], 50, false),
        [("tokens".into(), 7)]
    );
    // Cut after it (a client that hangs up at the last event, before the body's end reaches
    // the proxy): what it reported, charged as the last event passed.
    for piece in [1, 50, STREAM.len()] {
        let mut st = StreamState::default();
        st.request_headers(&rt, &mut host("k"));
        assert_eq!(
            answer(&rt, &mut st, &sse, STREAM.as_bytes(), piece, false),
            [("tokens".into(), 472 + 89)],
            "pieces of {piece}"
        );
    }
    // Compressed: not read at all.
    let mut st = StreamState::default();
    st.request_headers(&rt, &mut host("k"));
    let gz = [
        ("content-type", "text/event-stream"),
        ("content-encoding", "gzip"),
    ];
    let mut response = FakeResponse(
        gz.iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect(),
    );
    st.response_headers(
        &rt,
        &mut response,
        || 600_000,
        &mut String::new(),
        |_, _, _| {},
        |_, _| {},
    );
    assert!(st.counts_body() && !st.scans_body());
    let mut got = Vec::new();
    st.response_body(
        &rt,
        10,
        None,
        true,
        || 600_000,
        |r, n| got.push((r.to_string(), n)),
    );
    assert_eq!(got, [("tokens".to_string(), 7)]);
    // A JSON error answer with no usage.
    let mut st = StreamState::default();
    st.request_headers(&rt, &mut host("k"));
    let json = [("content-type", "application/json")];
    let body = br#"{"type":"error","error":{"type":"overloaded_error"}}"#;
    assert_eq!(
        answer(&rt, &mut st, &json, body, 5, true),
        [("tokens".into(), 7)]
    );
    assert_eq!(counted(&rt, Counter::UsageUnreported), 3);
}

const TRUE_UP: &str = r#"{"rules": [{"name": "tokens", "key": ["header:x-api-key"],
    "rate_limit": {"requests_per_unit": 1000, "unit": "hour"},
    "cost": {"response": "json:usage.total_tokens", "true_up": true,
             "reserve": {"from": "openai", "input": "bytes/4", "default": 300, "max_body": 64}}}]}"#;

fn openai(total: u64) -> String {
    format!(
        r#"{{"id":"x","choices":[],"usage":{{"prompt_tokens":1,"completion_tokens":2,"total_tokens":{total}}}}}"#
    )
}

/// Sends `body` in pieces of `piece`; the decision and the piece it came at.
fn request(
    rt: &Runtime<MemoryStore>,
    st: &mut StreamState,
    h: &mut FakeHost,
    body: &[u8],
    piece: usize,
) -> (Next, usize) {
    h.body_follows = !body.is_empty();
    let next = st.request_headers(rt, h);
    if !matches!(next, Next::Wait) {
        return (next, 0);
    }
    assert!(st.reads_request_body() && st.stops_request());
    let chunks: Vec<&[u8]> = body.chunks(piece).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let next = st.request_body(rt, h, chunk, i + 1 == chunks.len());
        if !matches!(next, Next::Wait) {
            return (next, i + 1);
        }
    }
    panic!("never decided");
}

#[test]
fn a_reservation_sized_by_the_request_is_counted_then_trued_up() {
    let rt = runtime(TRUE_UP);
    let json = [("content-type", "application/json")];
    // 48 bytes: reserves max_tokens 200 + 48/4.
    let body = br#"{"max_tokens":200,"messages":[{"content":"hi"}]}"#;
    assert_eq!(body.len(), 48);
    let mut h = host("a");
    let mut st = StreamState::default();
    let (next, at) = request(&rt, &mut st, &mut h, body, 8);
    assert!(matches!(next, Next::Continue));
    assert_eq!(at, 6, "without a content-length, decided at the body's end");
    assert_eq!(
        remaining(&rt, "a", 300),
        1000 - 212,
        "the reservation counts at admission"
    );
    answer(&rt, &mut st, &json, openai(150).as_bytes(), 9, true);
    assert_eq!(
        remaining(&rt, "a", 300),
        1000 - 150,
        "trued up to what was used"
    );
    // And the two probes gave back their whole reservations.
    assert_eq!(counted(&rt, Counter::UsageRefunded), 62 + 2 * 300);
    // With a content-length, decided as soon as the field is read.
    let mut h = host("b");
    h.req
        .headers
        .push(("content-length".into(), b"48".to_vec()));
    let mut st = StreamState::default();
    let (_, at) = request(&rt, &mut st, &mut h, body, 8);
    assert_eq!(at, 3, "max_tokens ends in the third piece");
    // Used more than reserved: the excess is charged.
    answer(&rt, &mut st, &json, openai(500).as_bytes(), 1000, true);
    assert_eq!(remaining(&rt, "b", 300), 500);
    assert_eq!(counted(&rt, Counter::UsageExceeded), 500 - 212);
    // No maximum, or none within max_body (64 bytes), or no body: the default, 300.
    for (key, body) in [
        ("c", br#"{"messages":[]}"#.to_vec()),
        (
            "d",
            format!(r#"{{"messages":["{}"],"max_tokens":1}}"#, "x".repeat(80)).into_bytes(),
        ),
        ("e", Vec::new()),
    ] {
        let mut st = StreamState::default();
        let (next, _) = request(&rt, &mut st, &mut host(key), &body, 10);
        assert!(matches!(next, Next::Continue));
        assert_eq!(remaining(&rt, key, 300), 700, "{key}");
        st.complete(&rt, || 600_000, |_, _| {});
    }
}

const PER_MODEL: &str = r#"{"max_body": 256, "rules": [
    {"name": "per-model", "key": [{"first": ["header:x-api-key", "bearer"]}, "body:model"],
     "on_missing_key": "refuse", "rate_limit": {"requests_per_unit": 2, "unit": "hour"}},
    {"name": "gpt-4o", "match": {"body": [{"field": "model", "prefix": "gpt-4o"}]},
     "key": ["header:x-api-key"], "rate_limit": {"requests_per_unit": 3, "unit": "hour"}},
    {"name": "by-user", "match": {"path_prefix": "/v1/", "body": [{"field": "metadata.user_id", "one_of": ["u1", "u2"]}]},
     "key": ["body:metadata.user_id"], "rate_limit": {"requests_per_unit": 1, "unit": "hour"}},
    {"name": "headers-only", "key": ["header:x-api-key"], "rate_limit": {"requests_per_unit": 100, "unit": "hour"}}]}"#;

/// The rules `next` names in its fields (allowed) or its reply (refused), and the status.
fn verdict(rt: &Runtime<MemoryStore>, st: &mut StreamState, next: Next) -> (u16, String) {
    match next {
        Next::Reply(r) => {
            let policy = r
                .headers()
                .find(|(k, _)| *k == "ratelimit-policy")
                .map_or(String::new(), |(_, v)| v.to_string());
            (r.status, policy)
        }
        Next::Continue => {
            let mut policy = String::new();
            let mut response = FakeResponse::with("content-type", "application/json");
            st.response_headers(
                rt,
                &mut response,
                || 600_000,
                &mut String::new(),
                |k, v, _| {
                    if k == "ratelimit-policy" {
                        policy = v.to_string();
                    }
                },
                |_, _| {},
            );
            st.complete(rt, || 600_000, |_, _| {});
            (200, policy)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn rules_keyed_on_or_matching_body_fields_are_decided_once_the_body_is_read() {
    let names = |policy: &str| -> Vec<String> {
        policy
            .split(", ")
            .filter(|p| !p.is_empty())
            .map(|p| p.split(';').next().unwrap().trim_matches('"').to_string())
            .collect()
    };
    for piece in [1, 5, 64, 1000] {
        let rt = runtime(PER_MODEL);
        let send = |body: &str, key: &str| {
            let mut h = host(key);
            h.req.path = Some("/v1/chat/completions".into());
            let mut st = StreamState::default();
            let (next, _) = request(&rt, &mut st, &mut h, body.as_bytes(), piece);
            let (status, policy) = verdict(&rt, &mut st, next);
            (status, names(&policy))
        };
        let mini = r#"{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}"#;
        // Every rule applies: the model's prefix matches, the key has a model.
        let (status, rules) = send(mini, "a");
        assert_eq!(status, 200, "pieces of {piece}");
        assert_eq!(
            rules,
            ["headers-only", "per-model", "gpt-4o"],
            "pieces of {piece}"
        );
        assert_eq!(send(mini, "a").0, 200);
        // Per model: a third gpt-4o-mini request is refused, another model is not.
        let (status, rules) = send(mini, "a");
        assert_eq!(
            (status, rules.contains(&"per-model".to_string())),
            (429, true)
        );
        let other = r#"{"model": "o3", "messages": []}"#;
        let (status, rules) = send(other, "a");
        assert_eq!(status, 200);
        assert_eq!(rules, ["headers-only", "per-model"], "o3 is not a gpt-4o");
        // One model however its name is escaped: \u006f is "o".
        let escaped = r#"{"messages": [], "model": "gpt-4\u006f-mini"}"#;
        assert_eq!(send(escaped, "a").0, 429, "pieces of {piece}");
        // A model given twice counts as the last one (as the backend reads it).
        let twice = r#"{"model": "o3", "messages": [], "model": "gpt-4o-mini"}"#;
        assert_eq!(send(twice, "a").0, 429);
        // No model (not JSON, missing, not a string, or past max_body): refused with a 401,
        // the per-model key's choice.
        let padded = format!(r#"{{"messages": ["{}"], "model": "o3"}}"#, "x".repeat(300));
        for body in [
            "model=o3",
            r#"{"messages": []}"#,
            r#"{"model": ["o3"]}"#,
            padded.as_str(),
        ] {
            let (status, _) = send(body, "b");
            assert_eq!(status, 401, "{body} in pieces of {piece}");
        }
        // A field nested in an object, and a match on it with a value not listed.
        let user = |u: &str| format!(r#"{{"model": "o3", "metadata": {{"user_id": "{u}"}}}}"#);
        let (status, rules) = send(&user("u1"), "c");
        assert_eq!(
            (status, rules),
            (
                200,
                vec![
                    "headers-only".to_string(),
                    "per-model".into(),
                    "by-user".into()
                ]
            )
        );
        assert_eq!(
            send(&user("u1"), "d").0,
            429,
            "by-user keys the user, not the API key"
        );
        assert_eq!(send(&user("u3"), "d").1, ["headers-only", "per-model"]);
    }
}

#[test]
fn a_lease_rule_keyed_on_a_body_field_claims_with_that_field() {
    // The descriptor is built while the body's fields can be read: the claim names the
    // model (before, the request was refused without a call, r=0).
    let rt = runtime(
        r#"{"max_body": 256, "rules": [{"name": "per-model", "key": ["body:model"],
            "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
            "global": {"cluster": "rls", "domain": "llm", "mode": "lease"}}]}"#,
    );
    let mut h = host("a");
    h.req.path = Some("/v1/chat/completions".into());
    let mut st = StreamState::default();
    let body = br#"{"model": "gpt-4o-mini", "messages": []}"#;
    let (next, _) = request(&rt, &mut st, &mut h, body, 7);
    let Next::Call { message, .. } = next else {
        panic!("no claim: {next:?}")
    };
    let asked = crate::rls::decode_request(&message).unwrap();
    assert_eq!(
        asked.descriptors,
        [vec![
            ("rule".to_string(), b"per-model".to_vec()),
            ("body:model".to_string(), b"gpt-4o-mini".to_vec())
        ]]
    );
}

#[test]
fn a_request_answered_before_its_body_was_read_is_not_keyed_on_its_body() {
    let rt = runtime(PER_MODEL);
    let mut h = host("a");
    h.req.path = Some("/v1/chat/completions".into());
    h.body_follows = true;
    let mut st = StreamState::default();
    assert!(matches!(st.request_headers(&rt, &mut h), Next::Wait));
    assert!(matches!(
        st.request_body(&rt, &mut h, br#"{"model": "gpt-4o", "#, false),
        Next::Wait
    ));
    // The answer comes first (the wasm build): decided without the body rules.
    let (status, policy) = verdict(&rt, &mut st, Next::Continue);
    assert_eq!(
        (status, policy.as_str()),
        (200, "\"headers-only\";q=100;w=3600")
    );
    assert_eq!(counted(&rt, Counter::KeyMissing), 0);
}

#[test]
fn the_body_fields_rules_read_go_to_the_access_log_once_each() {
    let rt = runtime(PER_MODEL);
    let mut h = host("a");
    h.req.path = Some("/v1/chat/completions".into());
    let mut st = StreamState::default();
    let body = br#"{"model": "gpt-4o", "metadata": {"user_id": "u\u0031"}, "stream": true}"#;
    let (next, _) = request(&rt, &mut st, &mut h, body, 7);
    assert!(matches!(next, Next::Continue));
    // model is read by two rules, reported once; the user id unescaped.
    assert_eq!(
        h.fields_read,
        [
            ("body.model".to_string(), b"gpt-4o".to_vec()),
            ("body.metadata.user_id".to_string(), b"u1".to_vec())
        ]
    );
    // A field the body does not have is not reported.
    let mut h = host("a");
    h.req.path = Some("/v1/chat/completions".into());
    let mut st = StreamState::default();
    request(&rt, &mut st, &mut h, br#"{"model": "o3"}"#, 100);
    assert_eq!(h.fields_read, [("body.model".to_string(), b"o3".to_vec())]);
    // `log_body_fields: false`: keyed the same, nothing handed to the access log.
    let rt = runtime(&PER_MODEL.replacen('{', r#"{"log_body_fields": false, "#, 1));
    let mut h = host("a");
    h.req.path = Some("/v1/chat/completions".into());
    let mut st = StreamState::default();
    let (next, _) = request(&rt, &mut st, &mut h, body, 7);
    assert!(matches!(next, Next::Continue));
    assert!(h.fields_read.is_empty(), "{:?}", h.fields_read);
}

#[test]
fn a_request_without_a_body_or_failing_another_condition_does_not_wait() {
    let rt = runtime(PER_MODEL);
    // No body: its fields are absent, decided on the headers.
    let mut st = StreamState::default();
    let mut h = host("a");
    let (next, at) = request(&rt, &mut st, &mut h, b"", 1);
    assert_eq!(at, 0);
    assert_eq!(verdict(&rt, &mut st, next).0, 401);
    // A config whose body rules all fail on the headers never reads the body.
    let rt = runtime(
        r#"{"rules": [{"name": "m", "match": {"path_prefix": "/v1/", "body": [{"field": "model", "equals": "x"}]},
            "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
    );
    let mut h = host("a");
    h.req.path = Some("/other".into());
    h.body_follows = true;
    let mut st = StreamState::default();
    assert!(matches!(st.request_headers(&rt, &mut h), Next::Continue));
    assert!(!st.reads_request_body());
}

/// An input rule reserves the input estimate alone, an output rule the output maximum
/// alone; each is trued up to its own part of the usage.
#[test]
fn an_input_rule_reserves_the_input_and_an_output_rule_the_output_maximum() {
    let rule = |response: &str, reserve: &str| {
        runtime(&format!(
            r#"{{"rules": [{{"name": "tokens", "key": ["header:x-api-key"],
                "rate_limit": {{"requests_per_unit": 1000, "unit": "hour"}},
                "cost": {{"response": "{response}", "true_up": true, "reserve": {reserve}}}}}]}}"#
        ))
    };
    let input = rule("anthropic-input", r#"{"input": "bytes/4", "default": 300}"#);
    let output = rule(
        "anthropic-output",
        r#"{"from": "anthropic", "default": 300}"#,
    );
    let json = [("content-type", "application/json")];
    // 48 bytes naming max_tokens 200; the answer used 30 input tokens (and 500 read from
    // the cache, which neither counts) and 150 output tokens.
    let body = br#"{"max_tokens":200,"messages":[{"content":"hi"}]}"#;
    let usage =
        br#"{"usage":{"input_tokens":30,"cache_read_input_tokens":500,"output_tokens":150}}"#;
    // (runtime, reserved, the piece it was decided at, charged)
    for (rt, reserved, decided_at, used) in [(&input, 12, 1, 30), (&output, 200, 3, 150)] {
        let mut h = host("a");
        h.req
            .headers
            .push(("content-length".into(), b"48".to_vec()));
        let mut st = StreamState::default();
        let (next, at) = request(rt, &mut st, &mut h, body, 8);
        assert!(matches!(next, Next::Continue));
        assert_eq!(at, decided_at, "the input needs only the length");
        assert_eq!(remaining(rt, "a", 300), 1000 - reserved);
        answer(rt, &mut st, &json, usage, 1000, true);
        assert_eq!(remaining(rt, "a", 300), 1000 - used);
    }
}

#[test]
fn an_answer_before_the_body_was_read_decides_the_request_without_refusing_it() {
    let rt = runtime(TRUE_UP);
    let json = [("content-type", "application/json")];
    // The answer's headers come while the body is being read (a backend that answers on
    // the headers alone, in the wasm build): decided with the default reservation, 300.
    let late = |key: &str, used: u64| {
        let mut h = host(key);
        h.body_follows = true;
        let mut st = StreamState::default();
        assert!(matches!(st.request_headers(&rt, &mut h), Next::Wait));
        assert!(matches!(
            st.request_body(&rt, &mut h, br#"{"messages":"#, false),
            Next::Wait
        ));
        let mut fields = Vec::new();
        let mut response = FakeResponse::with("content-type", "application/json");
        st.response_headers(
            &rt,
            &mut response,
            || 600_000,
            &mut String::new(),
            |k, v, _| fields.push((k.to_string(), v.to_string())),
            |_, _| {},
        );
        assert!(!st.reads_request_body() && !st.stops_request());
        let reported = answer(&rt, &mut st, &json, openai(used).as_bytes(), 1000, true);
        (fields, reported)
    };
    let (fields, reported) = late("a", 800);
    assert!(
        fields.contains(&("x-ratelimit-remaining".into(), "700".into())),
        "{fields:?}"
    );
    assert_eq!(reported, [("tokens".to_string(), 800)]);
    // 200 left: a request whose default reservation does not fit any more still goes on
    // (its answer has begun) and is charged, counted as what the rule would have refused.
    let (_, reported) = late("a", 400);
    assert_eq!(reported, [("tokens".to_string(), 400)]);
    let mut all = Vec::new();
    rt.metrics().drain(|_, c, n| all.push((c, n)), |_, _| {});
    let sum = |which| {
        all.iter()
            .filter(|(c, _)| *c == which)
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    assert_eq!(sum(Counter::ShadowLimited), 1);
    assert_eq!(sum(Counter::Limited), 0);
    assert_eq!(sum(Counter::UsageCharged), 1200);
}

#[test]
fn a_reservation_that_does_not_fit_is_refused_and_capped_by_the_limit() {
    let rt = runtime(TRUE_UP);
    let mut st = StreamState::default();
    let big = br#"{"max_tokens":5000}"#;
    let (next, _) = request(&rt, &mut st, &mut host("a"), big, 100);
    assert!(
        matches!(next, Next::Continue),
        "capped at the limit: it fits an empty key"
    );
    assert_eq!(remaining(&rt, "a", 300), 0);
    let mut second = StreamState::default();
    let (next, _) = request(
        &rt,
        &mut second,
        &mut host("a"),
        br#"{"max_tokens":10}"#,
        100,
    );
    let Next::Reply(reply) = next else {
        panic!("{next:?}")
    };
    assert_eq!(reply.status, 429);
    // The first used 100: 900 back, and the next fits.
    answer(
        &rt,
        &mut st,
        &[("content-type", "application/json")],
        openai(100).as_bytes(),
        7,
        true,
    );
    assert_eq!(remaining(&rt, "a", 300), 900);
}

/// The `retry-after` of a request refused now on `key` (reserving the default, 300).
fn refused_wait(rt: &Runtime<MemoryStore>, key: &str) -> Option<String> {
    let mut st = StreamState::default();
    match st.request_headers(rt, &mut host(key)) {
        Next::Reply(r) => r
            .headers()
            .find(|(k, _)| *k == "retry-after")
            .map(|(_, v)| v.to_string()),
        _ => {
            st.complete(rt, || 600_000, |_, _| {});
            None
        }
    }
}

#[test]
fn a_refusal_caused_by_reservations_in_flight_is_told_a_short_wait() {
    let rt = runtime(TRUE_UP);
    let json = [("content-type", "application/json")];
    // Three requests reserve 300 each of the hour's 1,000 (no body: the default).
    let mut held: Vec<StreamState> = (0..3)
        .map(|_| {
            let mut st = StreamState::default();
            assert!(matches!(
                st.request_headers(&rt, &mut host("a")),
                Next::Continue
            ));
            st
        })
        .collect();
    // 100 left: the fourth is refused, but the reservations would leave room once given
    // back. They settle when their answers end: come back in a second, not when the
    // hour's window makes room (about an hour, with 900 counted).
    assert_eq!(refused_wait(&rt, "a").as_deref(), Some("1"));
    // One answer used 250 of its 300: 150 left, still short of 300, with 600 reserved.
    let mut first = held.remove(0);
    answer(&rt, &mut first, &json, openai(250).as_bytes(), 100, true);
    assert_eq!(refused_wait(&rt, "a").as_deref(), Some("1"));
    // The other two used all they reserved: nothing is in flight any more, and the
    // refusal is the window's.
    for mut st in held {
        answer(&rt, &mut st, &json, openai(300).as_bytes(), 100, true);
    }
    let wait: u64 = refused_wait(&rt, "a").unwrap().parse().unwrap();
    assert!(wait > 60, "the window's wait: {wait}");
    assert!(rt.reserved.lock().unwrap().is_empty());
    // Reservations on another key do not shorten this key's wait.
    let mut b: Vec<StreamState> = (0..3)
        .map(|_| {
            let mut st = StreamState::default();
            assert!(matches!(
                st.request_headers(&rt, &mut host("b")),
                Next::Continue
            ));
            st
        })
        .collect();
    let wait: u64 = refused_wait(&rt, "a").unwrap().parse().unwrap();
    assert!(wait > 60, "{wait}");
    for st in &mut b {
        st.complete(&rt, || 600_000, |_, _| {});
    }
    assert!(
        rt.reserved.lock().unwrap().is_empty(),
        "settled with the default"
    );
}

/// A monthly money budget per key of 100,000 micro-dollars ($0.10), priced by the request
/// body's model at micro-dollars per million tokens.
fn money(default: &str) -> String {
    format!(
        r#"{{"rules": [{{"name": "usd", "key": ["header:x-api-key"],
        "rate_limit": {{"requests_per_unit": 100000, "unit": "month"}}, "algorithm": "fixed_window",
        "cost": {{"response": {{"price": {{"usage": "openai", "model": "body:model", "models": {{
            "gpt-4o": {{"input": 2500000, "cached_input": 1250000, "output": 10000000}},
            "gpt-4o-mini": {{"input": 150000, "cached_input": 75000, "output": 600000}}}},
            "default": {default}}}}},
          "true_up": true, "reserve": {{"from": "openai", "input": "bytes/4", "default": 1000}}}}}}]}}"#
    )
}

/// An OpenAI answer: `input` tokens of which `cached` from the cache, `output` out.
fn priced_answer(input: u64, cached: u64, output: u64) -> String {
    format!(
        r#"{{"model":"gpt-4o-2024-08-06","usage":{{"prompt_tokens":{input},"completion_tokens":{output},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
    )
}

/// Sends a chat request for `model` (its body in pieces of `piece`) and answers it with
/// `answer`: the status, and the money reported.
fn priced(
    rt: &Runtime<MemoryStore>,
    key: &str,
    body: &str,
    piece: usize,
    answer_with: (&str, &[u8]),
) -> (u16, Vec<(String, u64)>) {
    let mut st = StreamState::default();
    let (next, _) = request(rt, &mut st, &mut host(key), body.as_bytes(), piece);
    match next {
        Next::Continue => {}
        Next::Reply(r) => return (r.status, Vec::new()),
        other => panic!("{other:?}"),
    }
    let headers = [("content-type", answer_with.0)];
    (
        200,
        answer(rt, &mut st, &headers, answer_with.1, piece, true),
    )
}

#[test]
fn money_is_charged_at_the_price_of_the_model_the_request_names() {
    const JSON: &str = "application/json";
    let rt = runtime(&money(r#"{"input": 10000000, "output": 30000000}"#));
    let usage = priced_answer(1000, 400, 50);
    for piece in [1, 9, 4096] {
        let key = format!("k{piece}");
        let send = |body: &str| priced(&rt, &key, body, piece, (JSON, usage.as_bytes()));
        // gpt-4o: 600 uncached × $2.50 + 400 cached × $1.25 + 50 out × $10 per 1M tokens.
        let gpt4o = r#"{"model": "gpt-4o", "messages": []}"#;
        assert_eq!(send(gpt4o), (200, vec![("usd".into(), 1500 + 500 + 500)]));
        // The same tokens on gpt-4o-mini: 90 + 30 + 30 micro-dollars.
        let mini = r#"{"model": "gpt-4o-mini", "messages": []}"#;
        assert_eq!(send(mini), (200, vec![("usd".into(), 150)]));
        // A model given twice is the last one, as the backend reads it.
        let twice = r#"{"model": "gpt-4o-mini", "messages": [], "model": "gpt-4o"}"#;
        assert_eq!(send(twice).1, [("usd".into(), 2500)]);
        // A model not in the table, or none: the default price.
        assert_eq!(
            send(r#"{"model": "o3"}"#).1,
            [("usd".into(), 6000 + 4000 + 1500)]
        );
        assert_eq!(send(r#"{"messages": []}"#).1, [("usd".into(), 11_500)]);
        // A stream (its last chunk: 27 in, 14 out) on gpt-4o-mini: 12.45, rounded up.
        let stream = include_bytes!("../../../tests/fixtures/llm/openai_chat_stream.sse");
        let got = priced(&rt, &key, mini, piece, ("text/event-stream", stream));
        assert_eq!(got.1, [("usd".into(), 13)]);
        assert_eq!(
            remaining(&rt, &key, 1000),
            100_000 - 2500 - 150 - 2500 - 11_500 - 11_500 - 13,
            "pieces of {piece}"
        );
    }
    // Spent: a key charged past its budget by a long answer is refused until the month
    // ends.
    let huge = priced_answer(40_000, 0, 0);
    let gpt4o = r#"{"model": "gpt-4o", "messages": []}"#;
    let got = priced(&rt, "big", gpt4o, 64, (JSON, huge.as_bytes()));
    assert_eq!(got.1, [("usd".into(), 100_000)]);
    let got = priced(&rt, "big", gpt4o, 64, (JSON, usage.as_bytes()));
    assert_eq!(got.0, 429);
    assert_eq!(counted(&rt, Counter::ModelUnpriced), 0);
}

#[test]
fn a_reservation_is_priced_by_the_model_and_an_unpriced_model_refused() {
    let rt = runtime(&money(r#""refuse""#));
    // 36 bytes: 9 input tokens estimated, 200 out at most.
    let body = r#"{"model":"gpt-4o","max_tokens": 200}"#;
    assert_eq!(body.len(), 36);
    let mut h = host("a");
    h.req
        .headers
        .push(("content-length".into(), b"36".to_vec()));
    let mut st = StreamState::default();
    let (next, _) = request(&rt, &mut st, &mut h, body.as_bytes(), 5);
    assert!(matches!(next, Next::Continue));
    // Probed with a request whose body names no model: refused, so read its figures
    // from the reply's fields.
    let mut probe = StreamState::default();
    let Next::Reply(r) = probe.request_headers(&rt, &mut host("a")) else {
        panic!("a request naming no model is refused");
    };
    assert_eq!(r.status, 400);
    assert!(r.body.contains("no price for the model"), "{}", r.body);
    assert!(r.headers().all(|(k, _)| k != "retry-after"));
    // Reserved: 200 × $10 + 9 × $2.50 per 1M tokens = 2,022.5, rounded up; trued up to
    // 1,000 in and 20 out: 2,500 + 200.
    let json = [("content-type", "application/json")];
    let got = answer(
        &rt,
        &mut st,
        &json,
        priced_answer(1000, 0, 20).as_bytes(),
        7,
        true,
    );
    assert_eq!(got, [("usd".into(), 2700)]);
    // (Each count drains the counters: the probe's refusal is counted here.)
    assert_eq!(counted(&rt, Counter::ModelUnpriced), 1);
    // An unknown model is refused in the dialect of the configuration, and counted.
    let mut st = StreamState::default();
    let (next, _) = request(&rt, &mut st, &mut host("a"), br#"{"model":"gpt-9"}"#, 4);
    assert!(matches!(next, Next::Reply(ref r) if r.status == 400));
    assert_eq!(counted(&rt, Counter::ModelUnpriced), 1);
    // The reservation, trued up: 2,700 − 2,023 charged beyond it.
    let mut st = StreamState::default();
    request(&rt, &mut st, &mut h, body.as_bytes(), 36);
    answer(
        &rt,
        &mut st,
        &json,
        priced_answer(1000, 0, 20).as_bytes(),
        99,
        true,
    );
    assert_eq!(counted(&rt, Counter::UsageExceeded), 2700 - 2023);
}

#[test]
fn a_model_from_the_answer_reserves_at_the_dearest_price_and_a_shadow_rule_never_refuses() {
    // The model comes with the answer: the reservation of 10 output tokens is priced at
    // the dearest output price (the default's $30), then trued up at the answer's model.
    let rt = runtime(
        r#"{"rules": [{"name": "usd", "key": ["header:x-api-key"],
        "rate_limit": {"requests_per_unit": 100000, "unit": "day"},
        "cost": {"response": {"price": {"usage": "openai", "model": "response", "models": {
            "gpt-4o*": {"input": 2500000, "output": 10000000}},
            "default": {"input": 10000000, "output": 30000000}}},
          "true_up": true, "reserve": {"from": "openai", "default": 1000}}},
        {"name": "shadow-usd", "shadow": true, "key": ["header:x-api-key"],
        "rate_limit": {"requests_per_unit": 100000, "unit": "day"},
        "cost": {"response": {"price": {"usage": "openai", "model": "body:model", "models": {
            "gpt-4o": {"input": 2500000, "output": 10000000}}, "default": "refuse"}},
          "true_up": true, "reserve": {"from": "openai", "default": 1000}}}]}"#,
    );
    let json = [("content-type", "application/json")];
    // o3 has no price in shadow-usd: logged and counted, not refused.
    let mut st = StreamState::default();
    let body = br#"{"model": "o3", "max_tokens": 10}"#;
    let (next, _) = request(&rt, &mut st, &mut host("a"), body, 4);
    assert!(matches!(next, Next::Continue), "{next:?}");
    assert_eq!(counted(&rt, Counter::ModelUnpriced), 1);
    // The answer names gpt-4o-2024-08-06 (a gpt-4o*): 1,000 in, 20 out at its prices; and
    // shadow-usd, which had no price for o3, charges its dearest, the same.
    let answer_body = priced_answer(1000, 0, 20);
    let got = answer(&rt, &mut st, &json, answer_body.as_bytes(), 5, true);
    assert_eq!(got, [("usd".into(), 2700), ("shadow-usd".into(), 2700)]);
    // usd reserved 10 × $30 = 300 µ$, and was charged 2,400 beyond it; shadow-usd
    // reserved at its dearest too (gpt-4o's $10: 100 µ$), 2,600 beyond.
    assert_eq!(counted(&rt, Counter::UsageExceeded), 2400 + 2600);
}

#[test]
fn a_shared_rule_charged_by_its_answers_trues_up_the_capacity_and_the_tenant() {
    // 10,000 tokens a minute shared by API key, each request reserving 1,000.
    let rt = runtime(
        r#"{"rules": [{"name": "tpm", "key": ["header:x-api-key"], "quota_unit": "tokens",
            "rate_limit": {"requests_per_unit": 10000, "unit": "minute"},
            "cost": {"response": "openai", "reserve": 1000, "true_up": true},
            "share": {}}]}"#,
    );
    let usage = |n: u64| format!(r#"{{"usage":{{"total_tokens":{n}}}}}"#);
    let ask = |key: &str| {
        let mut st = StreamState::default();
        let next = st.request_headers(&rt, &mut host(key));
        (st, matches!(next, Next::Continue))
    };
    // Four requests of alice's, each answered 100 tokens: 400 counted, not 4,000.
    for _ in 0..4 {
        let (mut st, ok) = ask("alice");
        assert!(ok);
        let json = [("content-type", "application/json")];
        answer(&rt, &mut st, &json, usage(100).as_bytes(), 1024, true);
    }
    assert_eq!(counted(&rt, Counter::UsageRefunded), 3_600);
    // Nine more reservations of 1,000 fit in what is left (10,000 − 400); a tenth does not.
    let held: Vec<_> = (0..9).map(|_| ask("bob")).collect();
    assert!(held.iter().all(|(_, ok)| *ok));
    assert!(!ask("carol").1, "the capacity is held by reservations");
    // bob's answers used 2,000 each: 9,000 more are counted, the capacity far over; the
    // tenant's own use too.
    let json = [("content-type", "application/json")];
    for (mut st, _) in held {
        answer(&rt, &mut st, &json, usage(2_000).as_bytes(), 1024, true);
    }
    assert_eq!(counted(&rt, Counter::UsageExceeded), 9_000);
    assert!(!ask("carol").1);
    let record = {
        let slot = crate::table::SlotKind::Share.slot(rt.compiled[0].fingerprint % (1 << 31));
        rt.store
            .read(slot, |b, _| b.and_then(crate::share::Record::decode))
            .unwrap()
            .unwrap()
    };
    let used = record.bands[0].used.usage(600_000, 60_000);
    assert_eq!(used, 400 + 18_000, "the band counts what was used");
}
