//! The how-to's "Tokens instead of requests" variation in a real Envoy (two workers), in the
//! build under test: a shared rule charging each request its tokens from the OpenAI answer,
//! reserved when it arrives and trued up when the answer ends, in front of the stand-in
//! provider enforcing a limit of tokens a second (OpenAI's `x-ratelimit-*-tokens` fields, a 429
//! for a request whose tokens do not fit). Three tenants of weights 1, 2 and 4, the heavier
//! with the larger requests, each ask twice their share for SHARE_TOKENS_SECONDS (30 by
//! default); each request reserves its `max_completion_tokens` and a token per 4 bytes of
//! body, and its answer reports less, a usage that varies from request to request.
//!
//! Measured on the provider's side (the tokens of what it admitted, per tenant) over the run's
//! second 5 to its end, whole seconds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::llm::LlmClient;
use common::provider::Provider;
use common::share::{or_reconnect, paced, Seen};
use common::{bootstrap_with, metric, Envoy, Listener};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The provider's limit, tokens a second (a bucket of one second's worth), and the rule's
/// capacity.
const TOKENS: f64 = 28_000.0;
/// What each request's answer reports as its input: under the reservation's estimate of it (a
/// token per 4 bytes of its ~110-byte body), so that a request never uses more than it reserved.
const INPUT: u64 = 20;
/// The tenants: weight, and the least and most output tokens of their answers (a request names
/// the most as its `max_completion_tokens`; what it uses varies between the two). The heavier
/// the tenant, the larger its requests: shared by requests rather than tokens, the weights
/// would not hold. Each share is 50 to 70 requests a second, so that a request either side of
/// a share in a window (a share is enforced on whole requests) is 2 % of it at most.
const TENANTS: [(u64, u64, u64); 3] = [(1, 40, 80), (2, 80, 160), (4, 150, 250)];
const WARMUP_S: f64 = 5.0;

/// The `k`th request's output tokens, `lo` to `hi`, spread evenly.
fn output(k: u64, lo: u64, hi: u64) -> u64 {
    lo + (k * 37) % (hi - lo + 1)
}

/// A request body naming `max` output tokens.
fn body(max: u64) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"Say hello"}}],"max_completion_tokens":{max}}}"#
    )
}

#[test]
fn a_token_capacity_charged_from_the_answers_is_shared_by_weight() {
    let run_s = common::env_number("SHARE_TOKENS_SECONDS", 30);
    let provider = Arc::new(Provider::builder(100_000.0).tokens("t1", TOKENS).start());
    // The how-to's rule (a second instead of a minute), weights from a header.
    let config = format!(
        r#"{{"rules": [{{"name": "t1", "match": {{"path_prefix": "/t1/"}},
            "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": {TOKENS}, "unit": "second"}},
            "algorithm": "token_bucket", "burst": {burst},
            "cost": {{"response": "openai", "true_up": true,
                      "reserve": {{"from": "openai", "input": "bytes/4", "default": 1000}}}},
            "share": {{"weight": {{"from": "header:x-weight", "default": 1, "max": 10}}}}}}]}}"#,
        burst = (TOKENS * 0.9) as u64
    );
    let listener = Listener::to(provider.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(&config, &listener));
    let weights: u64 = TENANTS.iter().map(|t| t.0).sum();

    let (from, end) = provider.window(WARMUP_S, run_s);
    let threads: Vec<_> = TENANTS
        .iter()
        .map(|&(w, lo, hi)| {
            let mean = INPUT as f64 + (lo + hi) as f64 / 2.0;
            let share = 0.97 * TOKENS * w as f64 / weights as f64;
            // Twice its share, in requests a second.
            let rate = 2.0 * share / mean;
            let body = body(hi);
            eprintln!(
                "w{w}: requests of {mean:.0} tokens on average, reserving {}; share {:.0} \
                 tokens/s ({:.1} requests/s); asks {rate:.1} requests/s",
                hi + body.len() as u64 / 4,
                share,
                share / mean
            );
            let (provider, addr) = (provider.clone(), envoy.addr);
            std::thread::spawn(move || {
                let name = format!("w{w}");
                let weight = w.to_string();
                let mut seen = Seen::default();
                let mut client = LlmClient::connect(addr).unwrap();
                let run = Duration::from_secs(run_s);
                let start = Instant::now();
                paced(rate, run, |k| {
                    // Over at `run_s` whether or not every request went.
                    if start.elapsed() >= run {
                        return false;
                    }
                    let measured = provider.measures((from, end));
                    let (input, out) = (INPUT.to_string(), output(k, lo, hi).to_string());
                    let headers = [
                        ("x-tenant", name.as_str()),
                        ("x-weight", weight.as_str()),
                        ("content-type", "application/json"),
                        ("x-test-input-tokens", input.as_str()),
                        ("x-test-output-tokens", out.as_str()),
                    ];
                    let path = "/t1/v1/chat/completions";
                    let reply = or_reconnect(
                        &mut client,
                        || LlmClient::connect(addr).unwrap(),
                        |c| c.post(path, &headers, body.as_bytes()),
                    );
                    // A refusal before the body was read closes the connection.
                    if reply.header("connection") == Some("close") {
                        client = LlmClient::connect(addr).unwrap();
                    }
                    if measured {
                        // The provider's refusal names its token limit, Envoy's does not.
                        let by_provider =
                            String::from_utf8_lossy(&reply.body).contains("on tokens per second");
                        seen.count(reply.status, by_provider);
                    }
                    true
                });
                (name, seen)
            })
        })
        .collect();
    let seen: HashMap<String, Seen> = threads.into_iter().map(|t| t.join().unwrap()).collect();

    // Every figure first, then the assertions.
    let measured_s = (end - from) as f64;
    let used: HashMap<String, f64> = provider
        .tokens("t1", from, end)
        .into_iter()
        .map(|(t, n)| (t, n as f64 / measured_s))
        .collect();
    let total: f64 = used.values().sum();
    let (admitted, refused) = provider.total("t1");
    eprintln!("measured seconds: {measured_s}");
    eprintln!(
        "t1: the provider admitted {admitted} requests and refused {refused} over the run; \
         {total:.0} tokens/s used of {TOKENS} ({:.1} % of the capacity)",
        100.0 * total / TOKENS
    );
    let unit = total / weights as f64;
    let mut off = Vec::new();
    for (w, _, _) in TENANTS {
        let name = format!("w{w}");
        let got = used.get(&name).copied().unwrap_or(0.0);
        let expected = unit * w as f64;
        let deviation = got / expected - 1.0;
        eprintln!(
            "t1 {name}: {got:.0} tokens/s, weighted share {expected:.0} ({:+.2} %); client {:?}",
            100.0 * deviation,
            seen.get(&name)
        );
        off.push((name, got, expected, deviation));
    }
    for name in ["limited", "share_refused", "provider_limited"] {
        eprintln!("t1 {name}: {:?}", envoy.stat(&metric(Some("t1"), name)));
    }

    // Never over the provider's token limit: not one 429 from it, warm-up included.
    assert_eq!(
        refused,
        0,
        "the provider refused {refused} of {}",
        admitted + refused
    );
    for (name, s) in &seen {
        assert_eq!((s.by_provider, s.other), (0, 0), "{name}: {s:?}");
        assert!(
            s.refused > 0,
            "{name} was never refused: it asked for less than its share"
        );
    }
    // The capacity is used: the shares hand out 97 % of it. (Charged the reservations
    // without their true-up, the tenants would have used about 80 % of it.)
    assert!(
        total >= 0.90 * TOKENS,
        "{total:.0} tokens/s used of {TOKENS}"
    );
    // Each tenant's tokens within 5 % of its weighted share of what was used.
    for (name, got, expected, deviation) in off {
        assert!(
            deviation.abs() <= 0.05,
            "{name}: {got:.0} tokens/s, expected {expected:.0} ({:+.2} %)",
            100.0 * deviation
        );
    }

    // The stand-in enforces its limit: asked directly for more tokens than a second's worth,
    // it refuses as OpenAI does; a small request passes, with its token fields.
    let mut direct = LlmClient::connect(provider.addr).unwrap();
    let path = "/t1/v1/chat/completions";
    let ask = |direct: &mut LlmClient, out: &str| {
        let headers = [("x-tenant", "probe"), ("x-test-output-tokens", out)];
        direct.post(path, &headers, body(100).as_bytes()).unwrap()
    };
    let big = ask(&mut direct, "100000");
    assert_eq!(big.status, 429, "{big:?}");
    assert!(
        String::from_utf8_lossy(&big.body).contains("rate_limit_exceeded"),
        "{big:?}"
    );
    std::thread::sleep(Duration::from_millis(100));
    let small = ask(&mut direct, "10");
    assert_eq!(small.status, 200, "{small:?}");
    assert_eq!(small.header("x-ratelimit-limit-tokens"), Some("28000"));
    assert!(small.header("x-ratelimit-remaining-tokens").is_some());
    assert!(small.header("x-ratelimit-reset-tokens").is_some());
}
