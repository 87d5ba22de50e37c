//! Token limits under real thread contention, in the native build's process-wide store: with
//! reservations counted at admission and trued up, a key's usage never passes its limit when
//! every answer uses at most what it reserved; charged afterwards, it passes it by the answers
//! in flight. `cargo test -p ratelimit-core --test tokens -- --nocapture` prints the figures.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::config::Config;
use ratelimit_core::key::Seed;
use ratelimit_core::metrics::Counter;
use ratelimit_core::runtime::{Next, Runtime, StreamState};
use ratelimit_core::store::ProcessStore;
use ratelimit_core::testkit::{FakeHost, FakeResponse, Rng};
use std::sync::Arc;

const LIMIT: u64 = 10_000;
const THREADS: u64 = 8;
const MAX_TOKENS: u64 = 500;

fn runtime(cost: &str) -> Arc<Runtime<ProcessStore>> {
    let json = format!(
        r#"{{"rules": [{{"name": "tokens", "key": ["header:x-api-key"],
            "rate_limit": {{"requests_per_unit": {LIMIT}, "unit": "hour"}}, "cost": {cost}}}]}}"#
    );
    let config = Config::parse(json.as_bytes()).unwrap();
    let buckets = config.capacity / 4;
    Arc::new(Runtime::new(
        config,
        Seed([1, 2]),
        ProcessStore::new(buckets),
    ))
}

/// Each thread sends requests of one key, each reserving up to `MAX_TOKENS` from its body,
/// and answers with a usage at most that, other threads deciding in between. The tokens
/// charged for admitted requests, and how many were admitted.
fn run(rt: &Arc<Runtime<ProcessStore>>) -> (u64, u64) {
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let rt = rt.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9 + t);
                let (mut admitted, mut used) = (0, 0);
                for _ in 0..200 {
                    let mut host = FakeHost::new("10.0.0.1", "/v1/chat/completions");
                    host.req.headers.push(("x-api-key".into(), b"k".to_vec()));
                    host.body_follows = true;
                    let mut st = StreamState::default();
                    let mut next = st.request_headers(&*rt, &mut host);
                    if matches!(next, Next::Wait) {
                        let body = format!(r#"{{"max_tokens":{MAX_TOKENS},"messages":[]}}"#);
                        next = st.request_body(&*rt, &mut host, body.as_bytes(), true);
                    }
                    if !matches!(next, Next::Continue) {
                        continue;
                    }
                    admitted += 1;
                    std::thread::yield_now(); // others decide while this answer runs
                    let usage = 1 + rng.below(MAX_TOKENS);
                    let body = format!(r#"{{"usage":{{"total_tokens":{usage}}}}}"#);
                    let mut json = FakeResponse::with("content-type", "application/json");
                    st.response_headers(
                        &*rt,
                        &mut json,
                        || 600_000,
                        &mut String::new(),
                        |_, _, _| {},
                        |_, _| {},
                    );
                    st.response_body(&*rt, 0, Some(body.as_bytes()), true, || 600_000, |_, _| {});
                    st.complete(&*rt, || 600_000, |_, _| {});
                    used += usage;
                }
                (admitted, used)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .fold((0, 0), |(a, u), (a2, u2)| (a + a2, u + u2))
}

fn charged(rt: &Runtime<ProcessStore>) -> u64 {
    let mut n = 0;
    rt.metrics().drain(
        |_, c, k| n += if c == Counter::UsageCharged { k } else { 0 },
        |_, _| {},
    );
    n
}

#[test]
fn trued_up_reservations_never_let_a_key_pass_its_limit() {
    for _ in 0..5 {
        let rt = runtime(
            r#"{"response": "openai", "true_up": true,
                "reserve": {"from": "openai", "default": 500}}"#,
        );
        let (admitted, used) = run(&rt);
        eprintln!("true_up: {admitted} admitted, {used} tokens used of {LIMIT}");
        assert_eq!(charged(&rt), used);
        assert!(used <= LIMIT, "{used} > {LIMIT}");
        // Refused only when a reservation did not fit beside those in flight, which may
        // give back all but one token each.
        assert!(
            used > LIMIT - THREADS * MAX_TOKENS,
            "the limit is used up: {used}"
        );
    }
}

#[test]
fn charged_afterwards_a_key_passes_its_limit_by_the_answers_in_flight() {
    let mut worst = 0;
    for _ in 0..5 {
        let rt = runtime(r#"{"response": "openai", "reserve": 500}"#);
        let (admitted, used) = run(&rt);
        eprintln!("post-charge: {admitted} admitted, {used} tokens used of {LIMIT}");
        // At most limit − reserve + the answers in flight when it was crossed (one a thread).
        assert!(used <= LIMIT - 500 + THREADS * MAX_TOKENS, "{used}");
        worst = worst.max(used);
    }
    eprintln!("post-charge: at worst {worst} of {LIMIT}");
}
