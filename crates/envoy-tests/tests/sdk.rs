//! The official `openai` and `anthropic` Python SDKs (pinned in the Makefile, installed in the
//! project virtualenv) as the clients of Envoy running the filter, in the build under test, with
//! `response.dialect` set to their API's, in front of the LLM test upstream
//! (tests/common/llm.rs), JSON answers and streams:
//!
//! - an allowed call shows the dialect's rate-limit fields, each exact (`with_raw_response`);
//! - a refused call raises the SDK's `RateLimitError`, whose message is the filter's (which
//!   limit, and when to come back), for a requests limit and for a tokens limit;
//! - the SDK's own retry (`max_retries=1`) waits what the refusal's fields say, then succeeds;
//! - a refusal caused by a reservation still in flight says 1 s, and the SDK's retries pass
//!   once the reservation is trued up.
//!
//! Each call is one line to a `crates/envoy-tests/sdk/client.py --serve` process (at most 60 s,
//! the process killed past it), which imports each SDK once for all the calls it serves. A test
//! keeps its processes, and ends them when it ends; calls made at once each have their own.
//! The rules key on [`KEY_PART`], the API key as both SDKs send it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::llm::{Api, LlmClient, LlmUpstream, Mode};
use common::{bootstrap_with, root, Envoy, Listener};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The key part naming the client: the SDKs send `Authorization: Bearer KEY`, keyed by its token.
const KEY_PART: &str = "bearer";

/// Requests per minute of the requests rule: one every 6 s (a token bucket of one), so that a
/// refusal's wait is seconds long, unlike the SDKs' own backoff (0.5 s).
const PER_MINUTE: u64 = 10;
/// Tokens per hour of the tokens rule.
const TOKENS_PER_HOUR: u64 = 1000;

/// Envoy with the filter answering in `dialect` (usage read by the `preset` of the same API),
/// with the rate-limit fields of `headers`, before the LLM test upstream.
struct Rig {
    envoy: Envoy,
    _up: LlmUpstream,
    clients: Clients,
}

fn start(dialect: &str, headers: &str) -> Rig {
    let config = format!(
        r#"{{"rules": [
  {{"name": "per-key-tokens", "key": ["{KEY_PART}"],
    "rate_limit": {{"requests_per_unit": {TOKENS_PER_HOUR}, "unit": "hour"}},
    "cost": {{"response": "{dialect}"}}}},
  {{"name": "per-key-requests", "key": ["{KEY_PART}"], "algorithm": "token_bucket", "burst": 1,
    "rate_limit": {{"requests_per_unit": {PER_MINUTE}, "unit": "minute"}}}}],
 "response": {{"dialect": "{dialect}", "headers": "{headers}"}}}}"#
    );
    let up = LlmUpstream::start();
    let listener = Listener::to(up.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(&config, &listener));
    Rig {
        envoy,
        _up: up,
        clients: Clients::default(),
    }
}

/// Runs one step of the SDK client (see `sdk/client.py`) with its options `extra` (`--prime`:
/// first a plain call that must pass, so that the step's call comes right after it;
/// `--output-tokens N`; `--answer-header NAME=VALUE`): what the SDK saw.
fn call(rig: &Rig, sdk: &str, key: &str, mode: &str, step: &str, extra: &[&str]) -> Value {
    let extra: Vec<String> = extra.iter().map(|e| e.to_string()).collect();
    rig.clients.run(&rig.envoy, sdk, key, mode, step, &extra)
}

/// `client.py --serve` processes, each serving one call at a time, for one test: a call takes
/// one that is idle, or starts one if none is (so that calls made at once each have their own),
/// and gives it back once it has answered; one that raised or did not answer in time is not
/// given back. Dropped, it kills and reaps those idle: none outlives its test, and the test
/// binary's CPU time counts theirs.
#[derive(Default)]
struct Clients(Mutex<Vec<Client>>);

impl Clients {
    /// Runs one step of the SDK client against `envoy` with more arguments `extra`, in a
    /// `client.py --serve` process (at most 60 s, the process killed past it): what the SDK
    /// saw.
    fn run(
        &self,
        envoy: &Envoy,
        sdk: &str,
        key: &str,
        mode: &str,
        step: &str,
        extra: &[String],
    ) -> Value {
        let base = format!("http://{}", envoy.addr);
        let mut args = vec![sdk, &base, key, mode, step];
        args.extend(extra.iter().map(String::as_str));
        let idle = self.0.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut client = idle.unwrap_or_else(Client::start);
        writeln!(client.stdin, "{}", json!(args))
            .and_then(|()| client.stdin.flush())
            .unwrap_or_else(|e| panic!("{sdk} {mode} {step}: cannot write to client.py: {e}"));
        let line = match client.lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                drop(client);
                panic!("{sdk} {mode} {step}: no answer in 60 s");
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = client.child.kill();
                let status = client.child.wait();
                panic!("{sdk} {mode} {step}: client.py ended without an answer: {status:?}");
            }
        };
        let mut answer: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{sdk} {mode} {step}: {e}: {line}"));
        if let Some(exception) = answer["exception"].as_str() {
            panic!("{sdk} {mode} {step}: client.py raised:\n{exception}");
        }
        let out = answer["out"].take();
        assert!(out.is_object(), "{sdk} {mode} {step}: {line}");
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(client);
        out
    }
}

/// One `client.py --serve` process: its stdin, and the lines of its stdout as they come. It is
/// killed and reaped when dropped (and ends by itself at the end of its stdin, should the test
/// binary end first).
struct Client {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Client {
    fn start() -> Client {
        let mut child = Command::new(common::python())
            .arg(root().join("crates/envoy-tests/sdk/client.py"))
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e} (make test installs the SDKs)",
                    common::python().display()
                )
            });
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Client {
            child,
            stdin,
            lines,
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn header<'a>(headers: &'a Value, name: &str) -> &'a str {
    headers[name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name} in {headers}"))
}

fn number(headers: &Value, name: &str) -> u64 {
    header(headers, name)
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {headers}"))
}

/// The headers whose names start with `prefix`, sorted.
fn names(headers: &Value, prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = headers
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with(prefix))
        .cloned()
        .collect();
    out.sort();
    out
}

/// Parses OpenAI's duration (Go's format as the filter writes it: `0s`, `20ms`, `1.5s`,
/// `6m0s`, `1h2m3.004s`) into ms; `None` if it is not one.
fn duration_ms(text: &str) -> Option<u64> {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok().filter(|&n| (1..1000).contains(&n));
    }
    let mut rest = text.strip_suffix('s')?;
    let mut total = 0u64;
    if let Some((h, r)) = rest.split_once('h') {
        total += h.parse::<u64>().ok()? * 3_600_000;
        rest = r;
    }
    if let Some((m, r)) = rest.split_once('m') {
        total += m.parse::<u64>().ok()? * 60_000;
        rest = r;
    }
    let (s, frac) = rest.split_once('.').unwrap_or((rest, ""));
    total += s.parse::<u64>().ok()? * 1000;
    if !frac.is_empty() {
        if frac.len() > 3 || frac.ends_with('0') {
            return None;
        }
        total += format!("{frac:0<3}").parse::<u64>().ok()?;
    }
    Some(total)
}

/// Parses an RFC 3339 UTC time as the filter writes it (`2026-11-26T04:40:53Z`) into ms since
/// the epoch.
fn rfc3339_ms(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    if b.len() != 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[19] != b'Z' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| text.get(r)?.parse::<u64>().ok();
    let (y, mo, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (h, mi, s) = (n(11..13)?, n(14..16)?, n(17..19)?);
    // Days from the civil date (Howard Hinnant's days_from_civil), another way than the
    // filter's.
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400) + h * 3600 + mi * 60 + s) * 1000)
}

#[test]
fn the_parsers_of_this_test() {
    assert_eq!(duration_ms("0s"), Some(0));
    assert_eq!(duration_ms("20ms"), Some(20));
    assert_eq!(duration_ms("5.25s"), Some(5250));
    assert_eq!(duration_ms("6m0s"), Some(360_000));
    assert_eq!(duration_ms("1h2m3.004s"), Some(3_723_004));
    assert_eq!(duration_ms("5.250s"), None);
    assert_eq!(duration_ms("5"), None);
    assert_eq!(rfc3339_ms("1970-01-01T00:00:01Z"), Some(1000));
    assert_eq!(rfc3339_ms("2000-03-01T00:00:00Z"), Some(951_868_800_000));
    assert_eq!(rfc3339_ms("2000-03-01 00:00:00Z"), None);
}

/// The filter's message for a refusal by `rule` of `limit` `unit` per `window` s, with a wait
/// of `retry` s.
fn message(rule: &str, limit: u64, unit: &str, window: u64, retry: u64) -> String {
    format!("Rate limit \"{rule}\" of {limit} {unit} per {window} s exceeded; retry in {retry} s.")
}

/// What an allowed call, a refused one and a retried one show, for one SDK and mode, each on
/// a fresh key: the requests rule refuses a call that comes within 6 s of the one before, so
/// the refused and the retried calls each come right after a first one in the same process
/// (however long Python took to start).
struct Seen {
    allowed: Value,
    refused: Value,
    retried: Value,
}

fn requests_then_retry(rig: &Rig, sdk: &str, mode: &str) -> Seen {
    let key = |step: &str| format!("sk-{sdk}-{mode}-{step}");
    // The upstream answers with its own remaining requests, as a real API does: the
    // dialect's field replaces it.
    let own = match sdk {
        "openai" => "x-ratelimit-remaining-requests=9999",
        _ => "anthropic-ratelimit-requests-remaining=9999",
    };
    let allowed = call(
        rig,
        sdk,
        &key("allowed"),
        mode,
        "allowed",
        &["--answer-header", own],
    );
    assert_eq!(allowed["status"], 200, "{allowed}");
    assert!(!allowed["text"].as_str().unwrap().is_empty(), "{allowed}");
    let refused = call(rig, sdk, &key("refused"), mode, "refused", &["--prime"]);
    let retried = call(rig, sdk, &key("retried"), mode, "retried", &["--prime"]);
    Seen {
        allowed,
        refused,
        retried,
    }
}

/// The SDK's retry waited the wait `wait_ms` its first answer (a refusal) said, then passed.
fn assert_retried_after(retried: &Value, wait_ms: impl Fn(&Value) -> u64) {
    let attempts = retried["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{retried}");
    assert_eq!(attempts[0]["status"], 429, "{retried}");
    assert_eq!(attempts[1]["status"], 200, "{retried}");
    assert_eq!(retried["status"], 200, "{retried}");
    let wanted = wait_ms(&attempts[0]["headers"]) as f64 / 1000.0;
    assert!(wanted >= 1.0, "{retried}");
    let waited = attempts[1]["sent"].as_f64().unwrap() - attempts[0]["answered"].as_f64().unwrap();
    assert!(
        waited >= wanted - 0.01 && waited < wanted + 0.5,
        "waited {waited:.3} s where the answer said {wanted:.3} s: {retried}"
    );
    eprintln!("the SDK waited {waited:.3} s; the refusal said {wanted:.3} s");
}

#[test]
fn the_openai_sdk_reads_openai_answers() {
    let rig = start("openai", "both");
    for mode in ["json", "stream"] {
        let seen = requests_then_retry(&rig, "openai", mode);
        // Allowed: both kinds' fields. The requests rule is empty (a bucket of one) until its
        // next token, in at most 6 s; the tokens rule has not been charged yet when the
        // answer's headers leave (its usage is in the body), and is whole.
        let h = &seen.allowed["headers"];
        assert_eq!(
            names(h, "x-ratelimit-"),
            [
                "x-ratelimit-limit",
                "x-ratelimit-limit-requests",
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset",
                "x-ratelimit-reset-requests",
                "x-ratelimit-reset-tokens",
            ],
            "{h}"
        );
        assert_eq!(number(h, "x-ratelimit-limit-requests"), PER_MINUTE);
        // One value: the filter's replaced the upstream's 9999.
        assert_eq!(header(h, "x-ratelimit-remaining-requests"), "0");
        let reset = duration_ms(header(h, "x-ratelimit-reset-requests")).unwrap();
        assert!((5_000..=6_000).contains(&reset), "{h}");
        assert_eq!(number(h, "x-ratelimit-limit-tokens"), TOKENS_PER_HOUR);
        assert_eq!(number(h, "x-ratelimit-remaining-tokens"), TOKENS_PER_HOUR);
        assert_eq!(header(h, "x-ratelimit-reset-tokens"), "0s");
        assert!(h.get("retry-after-ms").is_none(), "{h}");
        // The IETF fields too: `headers` is "both".
        assert!(h.get("ratelimit-policy").is_some(), "{h}");

        // Refused by the requests rule: openai.RateLimitError with the filter's message.
        let e = &seen.refused["error"];
        assert_eq!(e["class"], "RateLimitError", "{}", seen.refused);
        assert_eq!(e["rate_limit_error"], true);
        assert_eq!(e["status"], 429);
        let h = &e["headers"];
        assert_eq!(header(h, "content-type"), "application/json");
        let retry_ms = number(h, "retry-after-ms");
        let retry = number(h, "retry-after");
        assert_eq!(retry, retry_ms.div_ceil(1000), "{h}");
        assert!((1_000..=6_000).contains(&retry_ms), "{h}");
        assert_eq!(
            duration_ms(header(h, "x-ratelimit-reset-requests")),
            Some(retry_ms),
            "{h}"
        );
        assert_eq!(number(h, "x-ratelimit-remaining-requests"), 0);
        let text = message("per-key-requests", PER_MINUTE, "requests", 60, retry);
        assert_eq!(e["message"], format!("Error code: 429 - {text}"));
        assert_eq!(e["str"], format!("Error code: 429 - {text}"));
        assert_eq!(
            e["body"],
            json!({"message": text, "type": "requests", "param": null,
                   "code": "rate_limit_exceeded"})
        );

        // The SDK's retry waits retry-after-ms, then passes.
        assert_retried_after(&seen.retried, |h| number(h, "retry-after-ms"));

        // Tokens: a call that used 2,012 tokens empties the hour's 1,000; the next is refused
        // by the tokens rule, whose message it shows (type "tokens").
        let e = &refused_for_tokens(&rig, "openai", mode);
        let h = &e["headers"];
        assert_eq!(number(h, "x-ratelimit-limit-tokens"), TOKENS_PER_HOUR);
        assert_eq!(number(h, "x-ratelimit-remaining-tokens"), 0);
        let retry = number(h, "retry-after");
        assert!(retry > 120, "{h}"); // over the SDK's 2 minutes: it would not retry
        let text = message("per-key-tokens", TOKENS_PER_HOUR, "tokens", 3600, retry);
        assert_eq!(e["message"], format!("Error code: 429 - {text}"));
        assert_eq!(e["body"]["type"], "tokens");
        assert_eq!(e["body"]["code"], "rate_limit_exceeded");
    }
}

/// A call of key `sk-SDK-MODE-tokens` that uses 2,012 tokens empties the hour's 1,000; the next
/// is refused by the tokens rule: the SDK's error.
fn refused_for_tokens(rig: &Rig, sdk: &str, mode: &str) -> Value {
    let key = format!("sk-{sdk}-{mode}-tokens");
    let big = call(
        rig,
        sdk,
        &key,
        mode,
        "allowed",
        &["--output-tokens", "2000"],
    );
    assert_eq!(big["status"], 200, "{big}");
    let refused = call(rig, sdk, &key, mode, "refused", &[]);
    assert_eq!(refused["error"]["class"], "RateLimitError", "{refused}");
    refused["error"].clone()
}

#[test]
fn the_anthropic_sdk_reads_anthropic_answers() {
    let rig = start("anthropic", "none");
    for mode in ["json", "stream"] {
        let before = common::now_ms();
        let seen = requests_then_retry(&rig, "anthropic", mode);
        let h = &seen.allowed["headers"];
        // Only the dialect's fields (`headers` is "none"), for the kinds that apply.
        assert_eq!(
            names(h, "anthropic-ratelimit-"),
            [
                "anthropic-ratelimit-requests-limit",
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-reset",
            ],
            "{h}"
        );
        assert!(
            names(h, "x-ratelimit").is_empty() && h.get("ratelimit").is_none(),
            "{h}"
        );
        assert_eq!(number(h, "anthropic-ratelimit-requests-limit"), PER_MINUTE);
        // One value: the filter's replaced the upstream's 9999.
        assert_eq!(header(h, "anthropic-ratelimit-requests-remaining"), "0");
        let reset = rfc3339_ms(header(h, "anthropic-ratelimit-requests-reset")).unwrap();
        let after = common::now_ms();
        // The next token comes 6 s after the call, rounded up to the second.
        assert!(
            reset >= before + 5_000 && reset <= after + 7_000,
            "{reset} not within {before}..{after} + 6 s: {h}"
        );
        assert_eq!(
            number(h, "anthropic-ratelimit-tokens-limit"),
            TOKENS_PER_HOUR
        );
        assert_eq!(
            number(h, "anthropic-ratelimit-tokens-remaining"),
            TOKENS_PER_HOUR
        );
        let full = rfc3339_ms(header(h, "anthropic-ratelimit-tokens-reset")).unwrap();
        assert!(full >= before && full <= after + 1_000, "{h}");

        let e = &seen.refused["error"];
        assert_eq!(e["class"], "RateLimitError", "{}", seen.refused);
        assert_eq!(e["rate_limit_error"], true);
        assert_eq!(e["status"], 429);
        let h = &e["headers"];
        assert_eq!(header(h, "content-type"), "application/json");
        assert!(h.get("retry-after-ms").is_none(), "{h}");
        let retry = number(h, "retry-after");
        assert!((1..=6).contains(&retry), "{h}");
        assert_eq!(number(h, "anthropic-ratelimit-requests-remaining"), 0);
        let text = message("per-key-requests", PER_MINUTE, "requests", 60, retry);
        assert_eq!(
            e["body"],
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": text}})
        );
        // The SDK's text shows the body, message included.
        assert!(e["str"].as_str().unwrap().contains(&text), "{e}");

        // Anthropic's SDK waits retry-after, in whole seconds.
        assert_retried_after(&seen.retried, |h| number(h, "retry-after") * 1000);

        let e = &refused_for_tokens(&rig, "anthropic", mode);
        let h = &e["headers"];
        assert_eq!(number(h, "anthropic-ratelimit-tokens-remaining"), 0);
        let retry = number(h, "retry-after");
        let text = message("per-key-tokens", TOKENS_PER_HOUR, "tokens", 3600, retry);
        assert_eq!(e["body"]["error"]["message"], text);
        assert_eq!(e["body"]["error"]["type"], "rate_limit_error");
    }
}

/// A key whose quota is held by a reservation still in flight: a request refused for it is told
/// to come back in 1 s, not when the hour's window would make room, and the SDK's retries, a
/// second apart, pass once the reservation is trued up. One worker: in the wasm build each
/// worker sees only the reservations of the requests it admitted.
#[test]
fn a_refusal_by_a_reservation_in_flight_is_retried_in_seconds() {
    let config = format!(
        r#"{{"rules": [
  {{"name": "per-key-tokens", "key": ["{KEY_PART}"],
    "rate_limit": {{"requests_per_unit": {TOKENS_PER_HOUR}, "unit": "hour"}},
    "cost": {{"response": "openai", "true_up": true,
              "reserve": {{"from": "openai", "default": 100}}}}}}],
 "response": {{"dialect": "openai"}}}}"#
    );
    let up = LlmUpstream::start();
    let listener = Listener::to(up.addr);
    let envoy = Envoy::start_yaml_workers(&bootstrap_with(&config, &listener), 1);
    let key = "sk-openai-reserved";
    let clients = Clients::default();
    // The SDK's process starts first and waits, its client made, for the word to call: a
    // loaded machine takes seconds to start Python and import the SDK.
    let go = common::scratch("reserved").join("go");
    let ready = go.with_extension("ready");
    let args = [
        "--max-retries".to_string(),
        "10".to_string(),
        "--after".to_string(),
        go.display().to_string(),
    ];
    let (retried, slow) = std::thread::scope(|scope| {
        let sdk = scope.spawn(|| clients.run(&envoy, "openai", key, "json", "retried", &args));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready.exists() {
            assert!(Instant::now() < deadline, "the SDK never started");
            std::thread::sleep(Duration::from_millis(20));
        }
        // A stream that reserves 950 of the 1,000 tokens (its max_completion_tokens) and lasts
        // 4 s (8 events 500 ms apart); it uses 46.
        let addr = envoy.addr;
        let auth = format!("Bearer {key}");
        let slow = scope.spawn(move || {
            let body = Api::Chat.request_body(Mode::Sse, true, 950);
            LlmClient::connect(addr)
                .unwrap()
                .post(
                    &Api::Chat.path(Mode::Sse),
                    &[
                        ("authorization", &auth),
                        ("x-test-events", "8"),
                        ("x-test-delay-ms", "500"),
                    ],
                    body.as_bytes(),
                )
                .unwrap()
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.received() == 0 {
            assert!(
                Instant::now() < deadline,
                "the slow stream never reached the upstream"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The SDK's call reserves its max_tokens, 64: 50 are left.
        std::fs::write(&go, b"").unwrap();
        (sdk.join().unwrap(), slow.join().unwrap())
    });
    assert_eq!(slow.status, 200);
    assert_eq!(retried["status"], 200, "{retried}");
    let attempts = retried["attempts"].as_array().unwrap();
    let (last, refused) = attempts.split_last().unwrap();
    assert_eq!(last["status"], 200, "{retried}");
    assert!(!refused.is_empty(), "never refused: {retried}");
    for (i, a) in refused.iter().enumerate() {
        assert_eq!(a["status"], 429, "{retried}");
        let h = &a["headers"];
        assert_eq!(header(h, "retry-after"), "1", "{h}");
        assert_eq!(header(h, "retry-after-ms"), "1000", "{h}");
        assert_eq!(number(h, "x-ratelimit-remaining-tokens"), 50, "{h}");
        let waited = attempts[i + 1]["sent"].as_f64().unwrap() - a["answered"].as_f64().unwrap();
        assert!(
            (0.99..1.5).contains(&waited),
            "waited {waited:.3} s: {retried}"
        );
    }
    eprintln!(
        "refused {} times while the reservation was in flight, then passed",
        refused.len()
    );
}

/// A model a `refuse` price table does not list: the openai SDK raises `BadRequestError` (a 400,
/// not retried) carrying the filter's message, and the filter counts `model_unpriced`.
#[test]
fn a_model_without_a_price_is_the_openai_sdks_bad_request() {
    let config = r#"{"rules": [
  {"name": "team-usd", "key": ["bearer"],
   "rate_limit": {"requests_per_unit": 50000000, "unit": "hour"},
   "cost": {"response": {"price": {"usage": "openai", "model": "body:model", "per": "1M tokens",
     "models": {"gpt-4o-mini": {"input": 150000, "output": 600000}}, "default": "refuse"}}}}],
 "response": {"dialect": "openai"}}"#;
    let up = LlmUpstream::start();
    let listener = Listener::to(up.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(config, &listener));
    let clients = Clients::default();
    let priced = clients.run(&envoy, "openai", "sk-priced", "json", "refused", &[]);
    assert_eq!(priced["error"], Value::Null, "{priced}");
    let extra = ["--model".to_string(), "gpt-9-unlisted".to_string()];
    let out = clients.run(&envoy, "openai", "sk-priced", "json", "refused", &extra);
    let e = &out["error"];
    assert_eq!(e["class"], "BadRequestError", "{out}");
    assert_eq!(e["status"], 400, "{out}");
    assert_eq!(
        e["body"]["message"],
        "Rule \"team-usd\" has no price for the model this request names; use a model it prices.",
        "{out}"
    );
    assert_eq!(e["body"]["code"], "model_not_found", "{out}");
    assert!(e["headers"].get("retry-after").is_none(), "{out}");
    // Refused before the backend: only the priced call reached it.
    assert_eq!(up.received(), 1);
    assert_eq!(out["attempts"].as_array().map(Vec::len), Some(1), "{out}");
    let unpriced = envoy.wait_stat(&common::metric(Some("team-usd"), "model_unpriced"), 1);
    assert_eq!(unpriced, Some(1));
}

/// Envoy running `examples/NAME/envoy.yaml` as shipped (on free ports, its stand-in backend
/// included), as examples.rs runs it.
/// The guards keep the example's rate limit service running, if it has one.
fn start_example(name: &str) -> (Envoy, Vec<common::Proc>) {
    let (yaml, services) = common::example(&root().join("examples").join(name));
    (Envoy::start_yaml(&common::for_build(&yaml)), services)
}

/// The shipped LLM examples, with each API's official SDK as the client: the SDK's calls use up
/// the key's budget and are then refused with its `RateLimitError` carrying the filter's
/// message; the same key sent as `x-api-key` (curl's way) is the same budget; a client without
/// a key gets the SDK's `AuthenticationError`.
#[test]
fn the_shipped_llm_examples_limit_the_official_sdks() {
    let clients = Clients::default();
    // (example, SDK, rule, budget, what its stand-in's JSON answer and stream use, the field
    // of the tokens left).
    for (example, sdk, rule, budget, used, remaining_field) in [
        (
            "openai-tokens",
            "openai",
            "openai-tokens",
            2000,
            [("json", 79), ("stream", 41)],
            "x-ratelimit-remaining-tokens",
        ),
        (
            "anthropic-tokens",
            "anthropic",
            "claude-budget",
            5000,
            [("json", 166), ("stream", 917)],
            "anthropic-ratelimit-tokens-remaining",
        ),
    ] {
        let (envoy, _services) = start_example(example);
        // The SDK accepts gzip, and its stand-in API compresses for a client that does, as the
        // real one does: the example has the backend answer in identity and compresses for
        // the client after the filter has read the usage. Each call of a mode reserves the
        // same; the second call's answer shows the first one charged exactly its usage.
        for (mode, used) in used {
            let key = format!("sk-gz-{mode}");
            let stream = ["--header".to_string(), "x-demo-stream=1".to_string()];
            let extra: &[String] = if mode == "stream" { &stream } else { &[] };
            let first = clients.run(&envoy, sdk, &key, mode, "allowed", extra);
            let second = clients.run(&envoy, sdk, &key, mode, "allowed", extra);
            for out in [&first, &second] {
                assert_eq!(out["status"], 200, "{out}");
                assert_eq!(header(&out["headers"], "content-encoding"), "gzip", "{out}");
                assert!(!out["text"].as_str().unwrap().is_empty(), "{out}");
            }
            assert_eq!(
                number(&first["headers"], remaining_field)
                    - number(&second["headers"], remaining_field),
                used,
                "{example} {mode}: the first answer charged its usage, read through gzip"
            );
        }
        let out = clients.run(&envoy, sdk, "sk-sdk", "json", "exhaust", &[]);
        let passed = out["passed"].as_u64().unwrap();
        assert!(passed >= 2, "{example}: {out}");
        let e = &out["error"];
        assert_eq!(e["status"], 429, "{example}: {out}");
        assert_eq!(e["rate_limit_error"], true, "{example}: {out}");
        let message = e["message"].as_str().unwrap();
        let wanted =
            format!("Rate limit \"{rule}\" of {budget} tokens per 3600 s exceeded; retry in ");
        assert!(message.contains(&wanted), "{example}: {message}");
        let wait: u64 = header(&e["headers"], "retry-after").parse().unwrap();
        assert!(
            message.contains(&format!("retry in {wait} s.")),
            "{message}"
        );
        // The same key as curl sends it: the same budget, refused too.
        let body = match sdk {
            "openai" => r#"{"model": "gpt-4o-mini", "max_tokens": 64, "messages": []}"#,
            _ => r#"{"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": []}"#,
        };
        let path = match sdk {
            "openai" => "/v1/chat/completions",
            _ => "/v1/messages",
        };
        let curl = |key: &str| {
            LlmClient::connect(envoy.addr)
                .unwrap()
                .post(
                    path,
                    &[("x-api-key", key), ("content-type", "application/json")],
                    body.as_bytes(),
                )
                .unwrap()
                .status
        };
        assert_eq!(curl("sk-sdk"), 429, "{example}");
        assert_eq!(curl("sk-other"), 200, "{example}");
    }
    // The gateway example: the SDK's third gpt-4o-mini call in a minute is its model's third,
    // refused by the per-model rule, with OpenAI's fields and a wait the SDK can use (what is
    // left of the rate limit service's minute, which began at the first call).
    let (envoy, _services) = start_example("llm-gateway");
    let out = clients.run(&envoy, "openai", "alice", "json", "exhaust", &[]);
    assert_eq!(out["passed"], 2, "{out}");
    let e = &out["error"];
    assert_eq!(
        (e["status"].as_u64(), e["rate_limit_error"].as_bool()),
        (Some(429), Some(true))
    );
    assert_eq!(e["body"]["type"], "requests", "{out}");
    assert_eq!(header(&e["headers"], "x-ratelimit-remaining-requests"), "0");
    let wait: u64 = header(&e["headers"], "retry-after").parse().unwrap();
    assert!((50..=60).contains(&wait), "{out}");
    let message = e["message"].as_str().unwrap();
    let wanted = format!(
        "Rate limit \"requests-per-key-and-model\" of 2 requests per 60 s exceeded; retry in {wait} s."
    );
    assert!(message.contains(&wanted), "{message}");
    // Credentials of another scheme (no key the rule reads: the SDKs will not send an empty
    // one): the SDK's authentication error in its API's shape, not retried, with the filter's
    // message.
    for (example, sdk, rule, error_type) in [
        (
            "openai-tokens",
            "openai",
            "openai-tokens",
            "invalid_request_error",
        ),
        (
            "anthropic-tokens",
            "anthropic",
            "claude-budget",
            "authentication_error",
        ),
    ] {
        let (envoy, _services) = start_example(example);
        let extra = ["--authorization".to_string(), "Basic c2stc2Rr".to_string()];
        let out = clients.run(&envoy, sdk, "sk-sdk", "json", "refused", &extra);
        let e = &out["error"];
        assert_eq!(e["status"], 401, "{out}");
        assert_eq!(e["authentication_error"], true, "{out}");
        let body_type = match sdk {
            "openai" => &e["body"]["type"],
            _ => &e["body"]["error"]["type"],
        };
        assert_eq!(body_type, error_type, "{out}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("Rule \"{rule}\" keys each client")),
            "{out}"
        );
        assert_eq!(
            out["attempts"].as_array().unwrap().len(),
            1,
            "not retried: {out}"
        );
    }
}
