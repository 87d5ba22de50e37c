//! Token limits read from LLM answers, in a real Envoy (two workers), in the build under test:
//! usage read from the response body of each API (JSON and event streams, however they are cut),
//! reservations sized from the request body and trued up, refusals of reservations that do not
//! fit, over-admission under concurrent clients, unreported usage, a 100 MB stream, and a held
//! request's body. Requests go to the LLM test upstream (tests/common/llm.rs); every request
//! carries an `x-test-id` found again in a JSON access log, which shows the usage each rule
//! charged (native: dynamic metadata; wasm: filter state).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::llm::{self, Api, LlmClient, LlmUpstream, Mode, Reply};
use common::{bootstrap_with, build, AccessLog, Build, Envoy, Listener};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Envoy with the filter in front of an LLM upstream, logging every request as JSON.
struct Rig {
    envoy: Envoy,
    up: LlmUpstream,
    log: PathBuf,
}

/// The access log's command for the usage a rule charged, in the build under test.
fn usage_format(rule: &str) -> String {
    match build() {
        Build::Native => format!("%DYNAMIC_METADATA(wasm_ratelimit:{rule})%"),
        Build::Wasm => format!("%FILTER_STATE(wasm.wasm_ratelimit.{rule}:PLAIN)%"),
    }
}

/// Starts Envoy with `config`, its access log showing the usage of each of `rules` as
/// `u_RULE` (flushed every 50 ms).
fn start(config: &str, rules: &[&str]) -> Rig {
    let up = LlmUpstream::start();
    let log = common::scratch("tokens").join("access.log");
    let mut fields: Vec<(String, String)> = [
        ("id", "%REQ(X-TEST-ID)%"),
        ("seq", "%RESP(X-LLM-SEQ)%"),
        ("code", "%RESPONSE_CODE%"),
        ("flags", "%RESPONSE_FLAGS%"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for r in rules {
        fields.push((format!("u_{r}"), usage_format(r)));
    }
    let json: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let listener = Listener {
        upstream: Some(up.addr),
        access_log: Some(AccessLog {
            path: &log,
            json: &json,
        }),
        ..Listener::default()
    };
    let envoy = Envoy::start_yaml_args(
        &bootstrap_with(config, &listener),
        &["--file-flush-interval-msec", "50"],
    );
    Rig { envoy, up, log }
}

/// A request id unique in the test run.
fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// A number in the access log: the native build logs metadata as a JSON number, the wasm
/// build filter state as a string.
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| n.as_f64().map(|f| f as u64)),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

impl Rig {
    /// The access log line of request `id`, waiting for it (≤ 10 s): once it is written the
    /// stream is over and its usage settled.
    fn line(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let found = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["id"].as_str() == Some(id));
            if let Some(v) = found {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "no access log line for {id} in:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The usage of `rule` the access log shows for request `id`.
    fn logged_usage(&self, id: &str, rule: &str) -> Option<u64> {
        as_u64(&self.line(id)[format!("u_{rule}")])
    }

    /// Waits (≤ 10 s) for a rule's counter to reach `expected`; its last value.
    fn counter(&self, rule: &str, name: &str, expected: u64) -> Option<u64> {
        self.envoy
            .wait_stat(&common::metric(Some(rule), name), expected)
    }

    /// POSTs `body` to `path` on a fresh connection, with `id` as `x-test-id`.
    fn post(&self, path: &str, id: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut h = vec![("x-test-id", id)];
        h.extend_from_slice(headers);
        LlmClient::connect(self.envoy.addr)
            .unwrap()
            .post(path, &h, body)
            .unwrap()
    }

    /// Checks that the client got what the upstream sent, byte for byte.
    fn assert_intact(&self, reply: &Reply, what: &str) {
        let seq = reply
            .seq()
            .unwrap_or_else(|| panic!("{what}: no x-llm-seq"));
        let sent = self
            .up
            .wait_sent(seq, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{what}: exchange {seq} never sent"))
            .sent
            .unwrap();
        assert!(sent.complete, "{what}: the upstream did not finish");
        assert!(reply.complete, "{what}: the client's body was cut short");
        assert_eq!(
            (reply.len, reply.hash),
            (sent.bytes, sent.hash),
            "{what}: the client did not get the upstream's body"
        );
    }
}

/// Request header fields.
type Headers<'a> = &'a [(&'a str, &'a str)];

fn remaining(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no x-ratelimit-remaining: {:?}", r.headers))
}

/// A rule of `limit` tokens a day per `x-api-key`, applied to requests whose `x-rule` names it.
fn rule(name: &str, limit: u64, cost: &str) -> String {
    format!(
        r#"{{"name": "{name}", "key": ["header:x-api-key"],
          "match": {{"headers": [{{"name": "x-rule", "value": "{name}"}}]}},
          "rate_limit": {{"requests_per_unit": {limit}, "unit": "day"}}, "cost": {cost}}}"#
    )
}

fn rules(rules: &[String]) -> String {
    format!(r#"{{"rules": [{}]}}"#, rules.join(",\n"))
}

// ---------------------------------------------------------------------------------------------
// 1. Exact charges

const DAY_LIMIT: u64 = 1_000_000;

/// One answer of the exact-charge test.
struct Case {
    api: Api,
    mode: Mode,
    rule: &'static str,
    /// Transport and shape headers (split, CRLF, multi-line data).
    extra: &'static [(&'static str, &'static str)],
}

/// A [`Case`].
fn case(
    api: Api,
    mode: Mode,
    rule: &'static str,
    extra: &'static [(&'static str, &'static str)],
) -> Case {
    Case {
        api,
        mode,
        rule,
        extra,
    }
}

/// What `rule` charges for an answer of `i` input and `o` output tokens.
fn expected(rule: &str, i: u64, o: u64) -> u64 {
    match rule {
        "chat_weighted" => i + 3 * o,
        "claude_weighted" => i + 2 * o,
        _ => i + o,
    }
}

#[test]
fn each_api_is_charged_exactly_what_its_answer_reports() {
    // Post-charge rules (nothing counted at admission): each preset, and two weighted sums.
    let cost = |response: &str| format!(r#"{{"response": "{response}", "default": 999}}"#);
    let rig = start(
        &rules(&[
            rule("openai", DAY_LIMIT, &cost("openai")),
            rule("anthropic", DAY_LIMIT, &cost("anthropic")),
            rule("gemini", DAY_LIMIT, &cost("gemini")),
            rule(
                "chat_weighted",
                DAY_LIMIT,
                &cost("json:usage.prompt_tokens + 3*json:usage.completion_tokens"),
            ),
            rule(
                "claude_weighted",
                DAY_LIMIT,
                &cost("json:message.usage.input_tokens + 2*json:usage.output_tokens"),
            ),
        ]),
        &[
            "openai",
            "anthropic",
            "gemini",
            "chat_weighted",
            "claude_weighted",
        ],
    );
    let every: &[(&str, &str)] = &[("x-test-split", "every")];
    let crlf_random: &[(&str, &str)] = &[("x-test-crlf", "1"), ("x-test-split", "random:3")];
    let random: &[(&str, &str)] = &[("x-test-split", "random:11")];
    let crlf_every: &[(&str, &str)] = &[("x-test-crlf", "1"), ("x-test-split", "every")];
    let multiline: &[(&str, &str)] = &[("x-test-multiline", "1"), ("x-test-split", "random:7")];
    let cases = [
        case(Api::Chat, Mode::Json, "openai", &[]),
        case(Api::Chat, Mode::Json, "openai", every),
        case(Api::Chat, Mode::Sse, "openai", &[]),
        case(Api::Chat, Mode::Sse, "openai", every),
        case(Api::Chat, Mode::Sse, "openai", crlf_random),
        case(Api::Responses, Mode::Sse, "openai", &[]),
        case(Api::Responses, Mode::Sse, "openai", random),
        case(Api::Responses, Mode::Json, "openai", &[]),
        case(Api::Messages, Mode::Json, "anthropic", &[]),
        case(Api::Messages, Mode::Json, "anthropic", random),
        case(Api::Messages, Mode::Sse, "anthropic", &[]),
        case(Api::Messages, Mode::Sse, "anthropic", crlf_every),
        case(Api::Gemini, Mode::Json, "gemini", &[]),
        case(Api::Gemini, Mode::Json, "gemini", every),
        case(Api::Gemini, Mode::Sse, "gemini", &[]),
        case(Api::Gemini, Mode::Sse, "gemini", crlf_random),
        case(Api::Chat, Mode::Json, "chat_weighted", &[]),
        case(Api::Chat, Mode::Sse, "chat_weighted", multiline),
        case(Api::Messages, Mode::Sse, "claude_weighted", random),
    ];
    let mut charged: std::collections::BTreeMap<&str, u64> = Default::default();
    for (k, case) in cases.iter().enumerate() {
        let k = k as u64;
        let (i, o) = (100 + 7 * k, 20 + 13 * k);
        let (is, os) = (i.to_string(), o.to_string());
        let key = format!("exact-{k}");
        let what = format!(
            "case {k}: {:?} {:?} {} {:?}",
            case.api, case.mode, case.rule, case.extra
        );
        let mut headers = vec![
            ("x-rule", case.rule),
            ("x-api-key", key.as_str()),
            ("x-test-input-tokens", is.as_str()),
            ("x-test-output-tokens", os.as_str()),
        ];
        headers.extend_from_slice(case.extra);
        let body = case.api.request_body(case.mode, true, 1000);
        let path = case.api.path(case.mode);
        let used = expected(case.rule, i, o);
        // The first answer: its fields went out before its usage was known.
        let id = new_id("exact");
        let r = rig.post(&path, &id, &headers, body.as_bytes());
        assert_eq!(r.status, 200, "{what}");
        assert_eq!(remaining(&r), DAY_LIMIT, "{what}");
        rig.assert_intact(&r, &what);
        assert_eq!(rig.logged_usage(&id, case.rule), Some(used), "{what}");
        // The next request of the key is admitted with what is left.
        let id = new_id("exact");
        let r = rig.post(&path, &id, &headers, body.as_bytes());
        assert_eq!(remaining(&r), DAY_LIMIT - used, "{what}");
        rig.assert_intact(&r, &what);
        assert_eq!(rig.logged_usage(&id, case.rule), Some(used), "{what}");
        *charged.entry(case.rule).or_default() += 2 * used;
    }
    for (rule, total) in charged {
        assert_eq!(
            rig.counter(rule, "usage_charged", total),
            Some(total),
            "{rule}"
        );
        assert_eq!(rig.counter(rule, "usage_unreported", 0), Some(0), "{rule}");
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Reservations trued up

const SIZED_LIMIT: u64 = 100_000;
const SIZED_DEFAULT: u64 = 500;

/// A chat request body naming no maximum (`max` None) or `max_tokens`, with `pad` bytes of
/// message text before the maximum.
fn chat_body(max: Option<u64>, pad: usize) -> Vec<u8> {
    let text = "a".repeat(pad);
    let max = max
        .map(|m| format!(r#","max_tokens":{m}"#))
        .unwrap_or_default();
    format!(r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"{text}"}}]{max}}}"#)
        .into_bytes()
}

#[test]
fn reservations_sized_from_the_request_are_trued_up() {
    let rig = start(
        &rules(&[rule(
            "sized",
            SIZED_LIMIT,
            &format!(
                r#"{{"response": "openai", "true_up": true,
                    "reserve": {{"from": "openai", "input": "bytes/4", "default": {SIZED_DEFAULT},
                                 "max_body": 4096}}}}"#
            ),
        )]),
        &["sized"],
    );
    let path = Api::Chat.path(Mode::Json);
    let (mut refunded, mut exceeded, mut charged) = (0u64, 0u64, 0u64);
    // One request of `key`: its body, answered with `i` + `o` tokens; checks the reservation
    // (`reserved`: what the key has counted before it) and the usage logged; returns the
    // usage. `pieces`: where to cut the body (sent 150 ms apart).
    let mut ask =
        |key: &str, body: &[u8], cut: Option<usize>, i: u64, o: u64, reserved: u64, before: u64| {
            let id = new_id("sized");
            let (is, os) = (i.to_string(), o.to_string());
            let headers = [
                ("x-test-id", id.as_str()),
                ("x-rule", "sized"),
                ("x-api-key", key),
                ("x-test-input-tokens", is.as_str()),
                ("x-test-output-tokens", os.as_str()),
            ];
            let pieces: Vec<&[u8]> = match cut {
                Some(c) => vec![&body[..c], &body[c..]],
                None => vec![body],
            };
            let r = LlmClient::connect(rig.envoy.addr)
                .unwrap()
                .send_pieces(
                    "POST",
                    &path,
                    &headers,
                    &pieces,
                    Duration::from_millis(150),
                    None,
                )
                .unwrap();
            let what = format!("{key} ({} body bytes, reserves {reserved})", body.len());
            assert_eq!(
                r.status,
                200,
                "{what}: {}",
                String::from_utf8_lossy(&r.body)
            );
            // Counted at admission: the key's usage so far and this reservation.
            assert_eq!(remaining(&r), SIZED_LIMIT - before - reserved, "{what}");
            rig.assert_intact(&r, &what);
            // The upstream got the request body whole.
            let e = rig.up.exchange(r.seq().unwrap()).unwrap();
            assert_eq!(
                (e.request.body_len, e.request.body_hash),
                (body.len() as u64, llm::hash(body)),
                "{what}"
            );
            let used = i + o;
            assert_eq!(rig.logged_usage(&id, "sized"), Some(used), "{what}");
            if used < reserved {
                refunded += reserved - used;
            } else {
                exceeded += used - reserved;
            }
            charged += used;
            used
        };
    // max_tokens M and a body of B bytes reserve M + B/4; the answer used 100: 100 stays
    // counted.
    let body = chat_body(Some(1000), 400);
    let b = body.len() as u64;
    let used = ask("a", &body, None, 40, 60, 1000 + b / 4, 0);
    let body2 = chat_body(Some(2000), 1000);
    let used2 = ask(
        "a",
        &body2,
        None,
        30,
        70,
        2000 + body2.len() as u64 / 4,
        used,
    );
    // What stays counted for the key is what its answers used.
    let body3 = chat_body(Some(10), 0);
    let b3 = body3.len() as u64;
    ask("a", &body3, None, 1, 1, 10 + b3 / 4, used + used2);
    // A maximum above the limit reserves the limit (on a key that has all of it).
    ask(
        "cap",
        &chat_body(Some(10 * SIZED_LIMIT), 0),
        None,
        1,
        2,
        SIZED_LIMIT,
        0,
    );
    // An answer above its reservation: the excess is charged (usage_exceeded).
    let small = 10 + b3 / 4;
    let over = ask("b", &body3, None, 40, 500, small, 0);
    assert!(over > small);
    // No maximum named: the default reservation.
    let body4 = chat_body(None, 100);
    ask("b", &body4, None, 5, 5, SIZED_DEFAULT, over);
    // The maximum comes after max_body (4,096) bytes, in a second piece: the default; the
    // upstream still gets every byte.
    let late = chat_body(Some(3000), 6000);
    ask("c", &late, Some(5000), 50, 50, SIZED_DEFAULT, 0);
    assert_eq!(
        rig.counter("sized", "usage_charged", charged),
        Some(charged)
    );
    assert_eq!(
        rig.counter("sized", "usage_refunded", refunded),
        Some(refunded)
    );
    assert_eq!(
        rig.counter("sized", "usage_exceeded", exceeded),
        Some(exceeded)
    );
    assert_eq!(rig.counter("sized", "usage_unreported", 0), Some(0));
}

// ---------------------------------------------------------------------------------------------
// 3. A reservation that does not fit

#[test]
fn a_reservation_that_does_not_fit_is_refused_with_the_exact_wait() {
    // A token bucket of 1,000 refilled at 1 a second; reservations are max_tokens exactly.
    let rig = start(
        &rules(&[
            r#"{"name": "tb", "key": ["header:x-api-key"], "algorithm": "token_bucket", "burst": 1000,
               "rate_limit": {"requests_per_unit": 1, "unit": "second"},
               "cost": {"response": "openai", "true_up": true,
                        "reserve": {"from": "openai", "input": 0, "default": 100}}}"#
                .to_string(),
        ]),
        &["tb"],
    );
    let path = Api::Chat.path(Mode::Sse);
    // A slow stream (5 events 300 ms apart, about 2.4 s) holds 800.
    let slow_id = new_id("slow");
    let sent = Instant::now();
    let slow = {
        let (addr, id, path) = (rig.envoy.addr, slow_id.clone(), path.clone());
        std::thread::spawn(move || {
            LlmClient::connect(addr)
                .unwrap()
                .post(
                    &path,
                    &[
                        ("x-test-id", &id),
                        ("x-api-key", "k"),
                        ("x-test-delay-ms", "300"),
                    ],
                    Api::Chat.request_body(Mode::Sse, true, 800).as_bytes(),
                )
                .unwrap()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.up.received() < 1 {
        assert!(Instant::now() < deadline, "the slow request never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    // 200 left; 500 more need 300 tokens back: 300 s at 1 a second (less the few ms since,
    // rounded up to whole seconds) if the slow request used its whole reservation. But it is
    // still in flight, and would leave room once trued up: the refusal is the reservation's,
    // told 1 s. In the wasm build only the worker that admitted the slow request knows of it:
    // on the other one, the window's wait.
    let refused_id = new_id("refused");
    let body = Api::Chat.request_body(Mode::Sse, true, 500);
    let r = rig.post(&path, &refused_id, &[("x-api-key", "k")], body.as_bytes());
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    // The bucket refilled k whole tokens since the slow request took its 800 (k is 0 unless
    // this machine took over a second to get here), so k more are left and the window's wait is
    // k seconds shorter.
    let waited = sent.elapsed().as_secs();
    let k = remaining(&r).checked_sub(200).expect("at least 200 left");
    assert!(k <= waited, "{k} tokens back after {waited} s");
    let window = (300 - k).to_string();
    let retry = r.header("retry-after").unwrap_or_default();
    match build() {
        Build::Native => assert_eq!(retry, "1"),
        Build::Wasm => assert!(retry == "1" || retry == window, "{retry}"),
    }
    // Another key is not touched.
    let other = new_id("other");
    let r = rig.post(&path, &other, &[("x-api-key", "k2")], body.as_bytes());
    assert_eq!(r.status, 200);
    assert_eq!(remaining(&r), 500);
    let s = slow.join().unwrap();
    assert_eq!(s.status, 200);
    rig.assert_intact(&s, "the slow stream");
    assert_eq!(
        rig.logged_usage(&slow_id, "tb"),
        Some(llm::DEFAULT_INPUT_TOKENS + llm::DEFAULT_OUTPUT_TOKENS)
    );
    // The refused request never reached the upstream whole (the wasm build sent its headers
    // before reading the body; that upstream request was reset).
    let line = rig.line(&refused_id);
    assert_eq!(as_u64(&line["code"]), Some(429), "{line}");
    std::thread::sleep(Duration::from_millis(200));
    let exchanges = rig.up.exchanges();
    assert!(
        exchanges
            .iter()
            .all(|e| e.header("x-test-id") != Some(refused_id.as_str())),
        "the refused request reached the upstream"
    );
    assert_eq!(exchanges.len(), 2, "{exchanges:?}");
    // The slow stream trued up (800 reserved, 46 used): the same request fits now.
    let again = new_id("again");
    let r = rig.post(&path, &again, &[("x-api-key", "k")], body.as_bytes());
    assert_eq!(r.status, 200);
    rig.line(&again);
    let used = llm::DEFAULT_INPUT_TOKENS + llm::DEFAULT_OUTPUT_TOKENS;
    let refunded = (800 - used) + 2 * (500 - used);
    assert_eq!(
        rig.counter("tb", "usage_refunded", refunded),
        Some(refunded)
    );
    assert_eq!(rig.counter("tb", "usage_charged", 3 * used), Some(3 * used));
    // Nothing in flight now: a reservation that does not fit is told the exact wait for the
    // tokens it lacks, 1 a second.
    let big = Api::Chat.request_body(Mode::Sse, true, 990);
    let r = rig.post(&path, &new_id("big"), &[("x-api-key", "k")], big.as_bytes());
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let lacking = 990 - remaining(&r);
    assert_eq!(r.header("retry-after"), Some(lacking.to_string().as_str()));
    assert!(lacking > 1, "{lacking}");
}

// ---------------------------------------------------------------------------------------------
// 4. Over-admission under concurrent clients

const CLIENTS: usize = 32;
const ROUNDS: usize = 6;
const OVER_LIMIT: u64 = 10_000;
/// Every answer: 50 input and 150 output tokens.
const ANSWER: u64 = 200;
/// The post-charge rule's fixed reserve.
const POST_RESERVE: u64 = 200;
/// The true-up rule's reservation: the requests' max_tokens (input estimated 0).
const MAX_TOKENS: u64 = 250;

/// `CLIENTS` clients at once, each sending `ROUNDS` chat streams (one at a time, each answer
/// about 100 ms) under rule `rule`: (admitted, refused).
fn storm(rig: &Rig, rule: &'static str) -> (u64, u64) {
    let go = Arc::new(Barrier::new(CLIENTS));
    let addr = rig.envoy.addr;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let go = go.clone();
            std::thread::spawn(move || {
                let body = Api::Chat.request_body(Mode::Sse, true, MAX_TOKENS);
                let path = Api::Chat.path(Mode::Sse);
                let mut c = Some(LlmClient::connect(addr).unwrap());
                go.wait();
                let (mut ok, mut refused) = (0, 0);
                for _ in 0..ROUNDS {
                    // A refusal at the headers closes the connection (the body was not read).
                    let mut conn = c
                        .take()
                        .unwrap_or_else(|| LlmClient::connect(addr).unwrap());
                    let r = conn
                        .post(
                            &path,
                            &[
                                ("x-rule", rule),
                                ("x-api-key", rule),
                                ("x-test-input-tokens", "50"),
                                ("x-test-output-tokens", "150"),
                                ("x-test-events", "1"),
                                ("x-test-delay-ms", "30"),
                            ],
                            body.as_bytes(),
                        )
                        .unwrap();
                    if r.header("connection") != Some("close") {
                        c = Some(conn);
                    }
                    match r.status {
                        200 => ok += 1,
                        429 => refused += 1,
                        s => panic!("status {s}"),
                    }
                }
                (ok, refused)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
}

#[test]
fn over_admission_under_32_clients_stays_within_its_bounds() {
    let rig = start(
        &rules(&[
            rule(
                "post",
                OVER_LIMIT,
                &format!(r#"{{"response": "openai", "reserve": {POST_RESERVE}}}"#),
            ),
            rule(
                "trued",
                OVER_LIMIT,
                r#"{"response": "openai", "true_up": true,
                    "reserve": {"from": "openai", "input": 0, "default": 250}}"#,
            ),
        ]),
        &["post", "trued"],
    );
    let n = CLIENTS as u64;
    // Post-charge: admitted while the charged usage u has u + reserve <= limit. The last
    // request admitted saw u <= limit - reserve; what is charged after it is the usage of the
    // requests in flight then, itself included: at most one per client.
    let (admitted, refused) = storm(&rig, "post");
    let charged = rig
        .counter("post", "usage_charged", admitted * ANSWER)
        .unwrap();
    let bound = OVER_LIMIT - POST_RESERVE + n * ANSWER;
    eprintln!(
        "over-admission, post-charge (reserve {POST_RESERVE}, no true_up), {CLIENTS} clients x \
         {ROUNDS}, {ANSWER} tokens per answer, limit {OVER_LIMIT}: {admitted} admitted, \
         {refused} refused, {charged} tokens charged ({} over the limit; bound limit - reserve + \
         {CLIENTS} x {ANSWER} = {bound})",
        charged.saturating_sub(OVER_LIMIT)
    );
    assert_eq!(charged, admitted * ANSWER);
    assert_eq!(admitted + refused, n * ROUNDS as u64);
    assert!(charged <= bound, "{charged} > {bound}");
    // Some request was refused, so the usage crossed limit - reserve.
    assert!(charged > OVER_LIMIT - POST_RESERVE, "{charged}");
    // True-up: each admission counts max_tokens (>= the answer) at once, so what is counted
    // never exceeds the limit, and the usage charged (never more than reserved) neither. At
    // the last refusal more than limit - reservation was counted, of which the (at most 31)
    // requests in flight gave back at most reservation - answer each.
    let (admitted, refused) = storm(&rig, "trued");
    let charged = rig
        .counter("trued", "usage_charged", admitted * ANSWER)
        .unwrap();
    let refunded = rig
        .envoy
        .stat(&common::metric(Some("trued"), "usage_refunded"));
    let floor = OVER_LIMIT - MAX_TOKENS - (n - 1) * (MAX_TOKENS - ANSWER);
    eprintln!(
        "over-admission, true_up (reservation = max_tokens {MAX_TOKENS}), {CLIENTS} clients x \
         {ROUNDS}, {ANSWER} tokens per answer, limit {OVER_LIMIT}: {admitted} admitted, \
         {refused} refused, {charged} tokens charged (bound: <= {OVER_LIMIT}; > {floor}); \
         refunded {refunded:?}"
    );
    assert_eq!(charged, admitted * ANSWER);
    assert_eq!(admitted + refused, n * ROUNDS as u64);
    assert!(charged <= OVER_LIMIT, "{charged} > {OVER_LIMIT}");
    assert!(charged > floor, "{charged} <= {floor}");
    let r = rig.counter("trued", "usage_refunded", admitted * (MAX_TOKENS - ANSWER));
    assert_eq!(r, Some(admitted * (MAX_TOKENS - ANSWER)));
}

// ---------------------------------------------------------------------------------------------
// 5. Usage never reported

#[test]
fn an_answer_that_never_reports_its_usage_is_charged_the_default() {
    let rig = start(
        &rules(&[
            rule(
                "post",
                DAY_LIMIT,
                r#"{"response": "openai", "default": 777}"#,
            ),
            rule(
                "trued",
                DAY_LIMIT,
                r#"{"response": "openai", "true_up": true, "reserve": 300}"#,
            ),
        ]),
        &["post", "trued"],
    );
    let sse = Api::Chat.path(Mode::Sse);
    let json = Api::Chat.path(Mode::Json);
    let sse_body = Api::Chat.request_body(Mode::Sse, true, 100);
    let sse_no_usage = Api::Chat.request_body(Mode::Sse, false, 100);
    let json_body = Api::Chat.request_body(Mode::Json, false, 100);
    let reset: &[(&str, &str)] = &[("x-test-reset-after", "300")];
    let no_usage: &[(&str, &str)] = &[("x-test-no-usage", "1")];
    let gzip: &[(&str, &str)] = &[("x-test-encoding", "gzip")];
    let cases: [(&str, &str, Headers, &str); 5] = [
        ("reset midway", &sse, reset, &sse_body),
        ("JSON without usage", &json, no_usage, &json_body),
        ("stream without include_usage", &sse, &[], &sse_no_usage),
        ("gzip JSON", &json, gzip, &json_body),
        ("gzip stream", &sse, gzip, &sse_body),
    ];
    for (k, (what, path, extra, body)) in cases.iter().enumerate() {
        let id = new_id("unreported");
        let key = format!("u-{k}");
        let mut headers = vec![("x-rule", "post"), ("x-api-key", key.as_str())];
        headers.extend_from_slice(extra);
        let r = rig.post(path, &id, &headers, body.as_bytes());
        assert_eq!(r.status, 200, "{what}");
        if *what == "reset midway" {
            assert!(!r.complete, "{what}: the client saw a complete body");
            let line = rig.line(&id);
            assert!(
                line["flags"].as_str().unwrap_or("").contains("UPE"),
                "{line}"
            );
        } else {
            rig.assert_intact(&r, what);
        }
        assert_eq!(rig.logged_usage(&id, "post"), Some(777), "{what}");
        // The next request of the key sees the default counted.
        let next = new_id("unreported");
        headers.truncate(2);
        let r = rig.post(&json, &next, &headers, json_body.as_bytes());
        assert_eq!(remaining(&r), DAY_LIMIT - 777, "{what}");
        rig.line(&next);
    }
    let used = llm::DEFAULT_INPUT_TOKENS + llm::DEFAULT_OUTPUT_TOKENS;
    assert_eq!(rig.counter("post", "usage_unreported", 5), Some(5));
    assert_eq!(
        rig.counter("post", "usage_charged", 5 * (777 + used)),
        Some(5 * (777 + used))
    );
    // A trued-up reservation whose answer never reports keeps the reservation (no default).
    let id = new_id("unreported");
    let headers = [
        ("x-rule", "trued"),
        ("x-api-key", "t"),
        ("x-test-reset-after", "300"),
    ];
    let r = rig.post(&sse, &id, &headers, sse_body.as_bytes());
    assert_eq!(remaining(&r), DAY_LIMIT - 300);
    assert!(!r.complete);
    assert_eq!(rig.logged_usage(&id, "trued"), Some(300));
    let next = new_id("unreported");
    let r = rig.post(&json, &next, &headers[..2], json_body.as_bytes());
    assert_eq!(remaining(&r), DAY_LIMIT - 600);
    rig.line(&next);
    assert_eq!(rig.counter("trued", "usage_unreported", 1), Some(1));
    assert_eq!(
        rig.counter("trued", "usage_charged", 300 + used),
        Some(300 + used)
    );
    assert_eq!(
        rig.counter("trued", "usage_refunded", 300 - used),
        Some(300 - used)
    );
}

/// OpenAI's SDK closes a stream at `data: [DONE]`: a client that hangs up there, while the
/// upstream's end is still on its way (held a second here), is charged what the stream
/// reported (charged as the last event passed), not the default of an answer cut short.
#[test]
fn a_client_that_hangs_up_at_the_last_event_is_charged_what_the_stream_reported() {
    use std::io::{Read, Write};
    let rig = start(
        &rules(&[rule(
            "post",
            DAY_LIMIT,
            r#"{"response": "openai", "default": 777}"#,
        )]),
        &["post"],
    );
    let body = Api::Chat.request_body(Mode::Sse, true, 100);
    let id = new_id("hangup");
    let mut s = std::net::TcpStream::connect(rig.envoy.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "POST {} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\nx-test-id: {id}\r\n\
         x-rule: post\r\nx-api-key: h\r\nx-test-events: 1\r\nx-test-delay-ms: 1000\r\n\
         x-test-input-tokens: 11\r\nx-test-output-tokens: 22\r\ncontent-length: {}\r\n\r\n{body}",
        Api::Chat.path(Mode::Sse),
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(12).any(|w| w == b"data: [DONE]") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before [DONE]");
        got.extend_from_slice(&buf[..n]);
    }
    // Hang up at [DONE], as the SDK does, before the body's end (a second later).
    drop(s);
    assert_eq!(rig.logged_usage(&id, "post"), Some(33));
    let json = Api::Chat.request_body(Mode::Json, false, 100);
    let r = rig.post(
        &Api::Chat.path(Mode::Json),
        &new_id("hangup"),
        &[("x-rule", "post"), ("x-api-key", "h")],
        json.as_bytes(),
    );
    assert_eq!(remaining(&r), DAY_LIMIT - 33);
    assert_eq!(
        rig.envoy
            .stat(&common::metric(Some("post"), "usage_unreported")),
        Some(0)
    );
}

// ---------------------------------------------------------------------------------------------
// 6. A 100 MB stream

#[test]
fn a_100_mb_stream_is_charged_exactly_in_bounded_memory() {
    let rig = start(
        &rules(&[rule("big", 4_000_000_000, r#"{"response": "openai"}"#)]),
        &["big"],
    );
    let path = Api::Chat.path(Mode::Sse);
    let body = Api::Chat.request_body(Mode::Sse, true, 100);
    // Warm up (both workers' first streams), then the baseline.
    for _ in 0..4 {
        let id = new_id("warm");
        let r = rig.post(
            &path,
            &id,
            &[("x-rule", "big"), ("x-api-key", "w")],
            body.as_bytes(),
        );
        assert_eq!(r.status, 200);
        rig.line(&id);
    }
    std::thread::sleep(Duration::from_millis(200));
    let base = rig.envoy.memory_allocated();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (done, admin) = (done.clone(), rig.envoy.admin);
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !done.load(Ordering::Relaxed) {
                if let Ok(r) = common::get(admin, "/memory") {
                    let v: Value = serde_json::from_slice(&r.body).unwrap();
                    let now: u64 = v["allocated"].as_str().unwrap().parse().unwrap();
                    peak = peak.max(now);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };
    let id = new_id("big");
    let t = Instant::now();
    let mut sink = |_: &[u8]| {};
    let r = LlmClient::connect(rig.envoy.addr)
        .unwrap()
        .send(
            "POST",
            &path,
            &[
                ("x-test-id", &id),
                ("x-rule", "big"),
                ("x-api-key", "k"),
                ("x-test-events", "1600"),
                ("x-test-pad", "65536"),
                ("x-test-input-tokens", "1234"),
                ("x-test-output-tokens", "5678"),
            ],
            body.as_bytes(),
            Some(&mut sink),
        )
        .unwrap();
    let took = t.elapsed();
    done.store(true, Ordering::Relaxed);
    let peak = sampler.join().unwrap();
    assert_eq!(r.status, 200);
    assert!(r.len > 100_000_000, "{} bytes", r.len);
    rig.assert_intact(&r, "the 100 MB stream");
    assert_eq!(rig.logged_usage(&id, "big"), Some(1234 + 5678));
    let grew = peak.saturating_sub(base);
    eprintln!(
        "100 MB stream ({} bytes, {:?}): Envoy allocated {base} bytes before, at most {peak} \
         during (+{grew})",
        r.len, took
    );
    assert!(grew < 8 << 20, "Envoy grew by {grew} bytes");
    let total = 4 * (llm::DEFAULT_INPUT_TOKENS + llm::DEFAULT_OUTPUT_TOKENS) + 1234 + 5678;
    assert_eq!(rig.counter("big", "usage_charged", total), Some(total));
}

// ---------------------------------------------------------------------------------------------
// 7. A waiting request keeps its body

#[test]
fn a_held_request_keeps_its_body_until_its_turn() {
    // One request a second per key, held up to 5 s; and a sized token rule on some requests.
    let rig = start(
        &rules(&[
            r#"{"name": "held", "key": ["header:x-api-key"], "algorithm": "leaky_bucket",
                "burst": 10, "on_limit": "delay", "max_delay_ms": 5000,
                "rate_limit": {"requests_per_unit": 60, "unit": "minute"}}"#
                .to_string(),
            rule(
                "sized",
                DAY_LIMIT,
                r#"{"response": "openai", "true_up": true,
                    "reserve": {"from": "openai", "input": "bytes/4", "default": 100}}"#,
            ),
        ]),
        &["sized"],
    );
    let path = Api::Chat.path(Mode::Json);
    let body = chat_body(Some(100), 3000);
    // (key, x-rule, where the body is cut): delay alone (held at the headers); delay and a
    // reservation sized from the body (held once the body is read), the body in two pieces or
    // in one.
    let variants = [
        ("plain", "none", Some(1000)),
        ("with-sized", "sized", Some(1000)),
        ("with-sized-whole", "sized", None),
    ];
    for (key, rule, cut) in variants {
        let headers = [("x-api-key", key), ("x-rule", rule)];
        // The key's first request goes at once.
        let first = new_id("held");
        let r = rig.post(&path, &first, &headers, &body);
        assert_eq!(r.status, 200);
        let before = rig.up.received();
        // The second waits its turn (about a second).
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (addr, path, body) = (rig.envoy.addr, path.clone(), body.clone());
            let id = new_id("held");
            std::thread::spawn(move || {
                let t = Instant::now();
                let h = [("x-test-id", id.as_str()), headers[0], headers[1]];
                let pieces: Vec<&[u8]> = match cut {
                    Some(c) => vec![&body[..c], &body[c..]],
                    None => vec![&body],
                };
                let r = LlmClient::connect(addr).unwrap().send_pieces(
                    "POST",
                    &path,
                    &h,
                    &pieces,
                    Duration::from_millis(100),
                    None,
                );
                let _ = tx.send((r, t.elapsed()));
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(
            rig.up.received(),
            before,
            "{key}: the upstream got the held request's body before its turn"
        );
        let (r, took) = rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
            panic!("{key}: the held request was never released (no answer 5.5 s after it was sent, its turn ~1 s)")
        });
        let r = r.unwrap();
        assert_eq!(r.status, 200, "{key}");
        assert!(
            took >= Duration::from_millis(800),
            "{key}: answered after {took:?}"
        );
        let e = rig.up.exchange(r.seq().unwrap()).unwrap();
        assert_eq!(
            (e.request.body_len, e.request.body_hash),
            (body.len() as u64, llm::hash(&body)),
            "{key}: the body changed on the way"
        );
        rig.assert_intact(&r, key);
    }
    assert_eq!(
        rig.envoy
            .wait_stat(&common::metric(Some("held"), "delayed"), 3),
        Some(3)
    );
}

// 8. A backend that answers before it has read the request's body

/// Envoy's `direct_response` answers on a request's headers alone. The native build decides
/// before the headers go on, as always. The wasm build lets them go on before reading the
/// body, so the answer comes first: the request is decided then, with what was read (here, no
/// maximum yet: the default reservation), counted and charged, and never refused (a refusal it
/// would have made counts in `shadow_limited`).
#[test]
fn a_backend_that_answers_before_reading_the_body() {
    let config = r#"{"rules": [{"name": "late", "key": ["header:x-api-key"],
        "rate_limit": {"requests_per_unit": 1000, "unit": "day"},
        "cost": {"response": "openai", "true_up": true, "default": 100,
                 "reserve": {"from": "openai", "default": 950}}}]}"#;
    let envoy = Envoy::start(config);
    let send = |max: u64| {
        let body = format!(r#"{{"max_tokens": {max}, "messages": []}}"#);
        let (head, tail) = body.as_bytes().split_at(5);
        LlmClient::connect(envoy.addr)
            .unwrap()
            .send_pieces(
                "POST",
                "/v1/chat/completions",
                &[("x-api-key", "k"), ("content-type", "application/json")],
                &[head, tail],
                Duration::from_millis(300),
                None,
            )
            .unwrap()
    };
    let stat = |name: &str, want: u64| envoy.wait_stat(&common::metric(Some("late"), name), want);
    let first = send(50);
    assert_eq!(first.status, 200);
    let second = send(950);
    match build() {
        Build::Native => {
            // Read whole first: reserved 50, charged the default 100 (no usage in "ok").
            assert_eq!(remaining(&first), 950);
            assert_eq!(second.status, 429, "950 does not fit in the 900 left");
            assert_eq!(stat("usage_charged", 100), Some(100));
            assert_eq!(stat("limited", 1), Some(1));
        }
        Build::Wasm => {
            // Decided at the answer: the default reservation, 950, then trued up to 100.
            assert_eq!(remaining(&first), 50);
            assert_eq!(
                second.status, 200,
                "its answer had begun: it cannot be refused"
            );
            assert_eq!(stat("shadow_limited", 1), Some(1));
            assert_eq!(stat("usage_charged", 200), Some(200));
            assert_eq!(
                envoy.stat(&common::metric(Some("late"), "limited")),
                Some(0)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Keys and matches from the request's body

/// Per-model limits read the model from the request's JSON body, however the body comes (one
/// piece, or a few bytes at a time); the API key however it is sent; a body without a model
/// refused as the rule says; the allowed bodies reach the upstream unchanged.
#[test]
fn per_model_limits_read_the_model_from_the_request_body() {
    let config = r#"{"rules": [
        {"name": "per-model", "match": {"path": "/v1/chat/completions"},
         "key": [{"first": ["header:x-api-key", "bearer"]}, "body:model"], "on_missing_key": "refuse",
         "rate_limit": {"requests_per_unit": 2, "unit": "hour"}},
        {"name": "gpt-4o", "match": {"body": [{"field": "model", "prefix": "gpt-4o"}]},
         "key": [{"first": ["header:x-api-key", "bearer"]}],
         "rate_limit": {"requests_per_unit": 3, "unit": "hour"}}]}"#;
    // The access log shows the model the filter read (the native build from dynamic metadata,
    // the wasm build from filter state), for replay.
    let rig = start(config, &["body.model"]);
    let body = |model: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": "a \"model\": \"x\" {}"}}], "model": {model}, "max_tokens": 5}}"#,
            "pad ".repeat(50)
        )
    };
    let send = |model: &str, key: (&str, &str), piece: usize| {
        let body = body(model);
        let id = new_id("model");
        let pieces: Vec<&[u8]> = body.as_bytes().chunks(piece).collect();
        let reply = LlmClient::connect(rig.envoy.addr)
            .unwrap()
            .send_pieces(
                "POST",
                "/v1/chat/completions",
                &[
                    key,
                    ("content-type", "application/json"),
                    ("x-test-id", &id),
                ],
                &pieces,
                Duration::from_millis(if piece < 50 { 2 } else { 0 }),
                None,
            )
            .unwrap();
        if reply.status == 200 {
            let ex = rig
                .up
                .wait_sent(reply.seq().unwrap(), Duration::from_secs(10))
                .unwrap();
            assert_eq!(
                ex.request.body,
                body.as_bytes(),
                "the upstream got the body unchanged"
            );
        }
        // A model given as a string is logged unescaped, whatever the request's fate.
        let logged = rig.line(&id)["u_body.model"].clone();
        match serde_json::from_str::<Value>(model) {
            Ok(Value::String(m)) => assert_eq!(logged, Value::String(m), "{model}"),
            _ => assert_eq!(logged, Value::Null, "{model}"),
        }
        reply
    };
    let policies = |r: &Reply| r.header("ratelimit-policy").unwrap_or("").to_string();
    let a = ("x-api-key", "sk-a");
    let a_bearer = ("authorization", "Bearer sk-a");
    // gpt-4o-mini, in one piece then a few bytes at a time, the key sent two ways: both rules
    // apply; the third request of the model is refused by per-model.
    let r = send(r#""gpt-4o-mini""#, a, 10_000);
    assert_eq!(r.status, 200);
    assert_eq!(
        policies(&r),
        "\"per-model\";q=2;w=3600, \"gpt-4o\";q=3;w=3600"
    );
    assert_eq!(send(r#""gpt-4o-mini""#, a_bearer, 7).status, 200);
    let r = send(r#""gpt-4\u006f-mini""#, a, 3);
    assert_eq!(r.status, 429, "one model however it is escaped");
    assert!(
        String::from_utf8_lossy(&r.body).contains("per-model"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    // Another model has its own per-model budget, and o3 is not a gpt-4o.
    let r = send(r#""o3""#, a_bearer, 5);
    assert_eq!(
        (r.status, policies(&r).as_str()),
        (200, "\"per-model\";q=2;w=3600")
    );
    // gpt-4o (the family's third): admitted; the family's fourth is refused by gpt-4o.
    assert_eq!(send(r#""gpt-4o""#, a, 11).status, 200);
    let r = send(r#""gpt-4o-2024-08-06""#, a, 10_000);
    assert_eq!(r.status, 429);
    assert!(
        String::from_utf8_lossy(&r.body).contains("\"gpt-4o\""),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    // No model, or not a string: a 401 from per-model, whatever the pieces.
    for (model, piece) in [("null", 4), ("[\"o3\"]", 10_000), ("42.5", 1)] {
        let r = send(model, a, piece);
        assert_eq!(r.status, 401, "model {model}");
        // The missing part is the model, not the bearer token: no challenge.
        assert_eq!(r.header("www-authenticate"), None);
        assert!(String::from_utf8_lossy(&r.body).contains("(body:model)"));
    }
    assert_eq!(rig.counter("per-model", "key_missing", 3), Some(3));
    assert_eq!(rig.counter("per-model", "limited", 1), Some(1));
    assert_eq!(rig.counter("gpt-4o", "limited", 1), Some(1));
}

// ---------------------------------------------------------------------------------------------
// Money

/// A monthly money budget per team across two models priced differently (micro-dollars per
/// million tokens): each answer, JSON or stream, is charged its exact price by the model the
/// request's body names; a model the table lacks is refused with a 400; once the budget is
/// spent the team is refused.
#[test]
fn a_money_budget_charges_each_model_its_price_and_refuses_when_spent() {
    let config = r#"{"rules": [{"name": "usd", "key": ["header:x-team"],
        "rate_limit": {"requests_per_unit": 10000, "unit": "month"}, "algorithm": "fixed_window",
        "cost": {"response": {"price": {"usage": "openai", "model": "body:model", "models": {
            "gpt-4o": {"input": 2500000, "cached_input": 1250000, "output": 10000000},
            "gpt-4o-mini": {"input": 150000, "cached_input": 75000, "output": 600000}},
            "default": "refuse"}},
          "true_up": true, "reserve": {"from": "openai", "default": 100}}}]}"#;
    let rig = start(config, &["usd"]);
    let send = |model: &str, stream: bool, input: u64, output: u64, split: &str| {
        let id = new_id("usd");
        let body = format!(
            r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 10, "stream": {stream}, "stream_options": {{"include_usage": true}}}}"#
        );
        let (i, o) = (input.to_string(), output.to_string());
        let headers = [
            ("x-team", "t1"),
            ("content-type", "application/json"),
            ("x-test-input-tokens", i.as_str()),
            ("x-test-output-tokens", o.as_str()),
            ("x-test-split", split),
        ];
        let reply = rig.post("/v1/chat/completions", &id, &headers, body.as_bytes());
        (id, reply)
    };
    // gpt-4o, JSON: 1,000 in × $2.50 + 200 out × $10 per 1M tokens = 4,500 µ$.
    let (id, r) = send("gpt-4o", false, 1000, 200, "random:5");
    assert_eq!(r.status, 200);
    rig.assert_intact(&r, "gpt-4o");
    let policy = r.header("ratelimit-policy").unwrap_or_default().to_string();
    assert!(policy.contains(r#"qu="usd-micros""#), "{policy}");
    assert_eq!(rig.logged_usage(&id, "usd"), Some(4500));
    // gpt-4o-mini, streamed a byte at a time: 150 + 120 µ$; twice.
    for _ in 0..2 {
        let (id, r) = send("gpt-4o-mini", true, 1000, 200, "every");
        assert_eq!(r.status, 200);
        rig.assert_intact(&r, "gpt-4o-mini");
        assert_eq!(rig.logged_usage(&id, "usd"), Some(270));
    }
    // A model without a price: refused before it reaches the backend, charged nothing.
    let (_, r) = send("o3", false, 1000, 200, "random:5");
    assert_eq!(r.status, 400);
    assert!(
        String::from_utf8_lossy(&r.body).contains("no price for the model"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(rig.counter("usd", "model_unpriced", 1), Some(1));
    // 4,960 µ$ left: gpt-4o reserves 10 out × $10 = 100 µ$ and is admitted; it uses 1,000 in
    // and 300 out, 5,500 µ$, and the budget is spent (10,540 of 10,000).
    let (id, r) = send("gpt-4o", false, 1000, 300, "random:5");
    assert_eq!(r.status, 200);
    assert_eq!(rig.logged_usage(&id, "usd"), Some(5500));
    assert_eq!(rig.counter("usd", "usage_charged", 10_540), Some(10_540));
    // Spent: even the cheap model is refused, and told nothing is left.
    let (_, r) = send("gpt-4o-mini", false, 10, 10, "random:5");
    assert_eq!(r.status, 429);
    assert_eq!(remaining(&r), 0);
    assert!(String::from_utf8_lossy(&r.body).contains("usd"));
}
