//! Hostile input, generated: the config parser, the key builder and slot decoding take
//! arbitrary bytes without panicking and in bounded time. Deterministic seeds, so a failure
//! reproduces; `FUZZ_SCALE=10 cargo test --release --test fuzz -- --nocapture` runs ten times
//! as many cases and prints the counts and times.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

use ratelimit_core::testkit::Rng;

use ratelimit_core::config::{Config, KeyPart, Match, Prefixes};
use ratelimit_core::key::PlainRequest;
use ratelimit_core::key::Seed;
use ratelimit_core::key::{client_key, descriptor_entries, matches};
use ratelimit_core::limiter::{gcra, Policy};
use ratelimit_core::table::{Slot, LOG_SLOTS};
use std::time::{Duration, Instant};

fn scale() -> u64 {
    std::env::var("FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

/// Runs `cases` cases of `f`, asserting the slowest one stays under `limit`.
fn fuzz(name: &str, cases: u64, limit: Duration, mut f: impl FnMut(&mut Rng, u64)) {
    let mut rng = Rng(0x0dd_ba11 ^ name.len() as u64);
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    for i in 0..cases {
        let before = rng.0;
        let t = Instant::now();
        f(&mut rng, i);
        let mut took = t.elapsed();
        if took >= limit {
            // A slow case must be slow again on the same input: on a busy machine one run can
            // be preempted for longer than the limit.
            for _ in 0..2 {
                let t = Instant::now();
                f(&mut Rng(before), i);
                took = took.min(t.elapsed());
            }
        }
        slowest = slowest.max(took);
    }
    println!(
        "fuzz {name}: {cases} cases in {:.2?}, slowest {:.2?}",
        start.elapsed(),
        slowest
    );
    assert!(slowest < limit, "{name}: a case took {slowest:?}");
}

const VALID: &str = r#"{"rules": [
  {"name": "a", "match": {"path_prefix": "/api/", "methods": ["GET"],
   "headers": [{"name": "x-tier", "value": "free"}, {"name": "k", "present": true}]},
   "key": ["remote_address", "header:x-api-key", "query:u", "path", "method", "authority"],
   "rate_limit": {"requests_per_unit": 100, "unit": "minute"}, "shadow": true},
  {"name": "b", "algorithm": "leaky_bucket", "burst": 3, "on_limit": "delay", "max_delay_ms": 5,
   "cost": {"header": "x-cost"}, "rate_limit": {"requests_per_unit": 1, "unit": "second"}},
  {"name": "c", "algorithm": "sliding_log", "cost": 2, "rate_limit": {"requests_per_unit": 9, "unit": "day"}}],
 "response": {"status": 503, "headers": "ietf", "on_allowed": false},
 "failure_mode": "deny", "capacity": 7, "log_limited": "info"}"#;

#[test]
fn config_parser_takes_any_bytes() {
    assert!(Config::parse(VALID.as_bytes()).is_ok());
    let tokens: [&[u8]; 16] = [
        b"{",
        b"}",
        b"[",
        b"]",
        b"\"",
        b":",
        b",",
        b"null",
        b"true",
        b"-1",
        b"1e309",
        b"\"rules\"",
        b"\"name\"",
        b"\\u0000",
        b"\xff",
        b"18446744073709551616",
    ];
    fuzz(
        "config (mutated valid config)",
        40_000 * scale(),
        Duration::from_millis(50),
        |rng, _| {
            let mut doc = VALID.as_bytes().to_vec();
            for _ in 0..1 + rng.below(6) {
                if doc.is_empty() {
                    break;
                }
                let at = rng.below(doc.len() as u64) as usize;
                match rng.below(4) {
                    0 => {
                        doc.remove(at);
                    }
                    1 => doc.insert(at, rng.next() as u8),
                    2 => {
                        let t = tokens[rng.below(tokens.len() as u64) as usize];
                        doc.splice(at..at, t.iter().copied());
                    }
                    _ => doc.truncate(at),
                }
            }
            let _ = Config::parse(&doc);
        },
    );
    fuzz(
        "config (random bytes)",
        40_000 * scale(),
        Duration::from_millis(50),
        |rng, _| {
            let _ = Config::parse(&rng.bytes(300));
        },
    );
    // Deep nesting and huge documents are refused or parsed, never a crash.
    let deep = "[".repeat(100_000);
    assert!(Config::parse(deep.as_bytes()).is_err());
    let many = format!(
        r#"{{"rules": [{}]}}"#,
        (0..20_000)
            .map(|i| format!(
                r#"{{"name": "r{i}", "rate_limit": {{"requests_per_unit": 1, "unit": "second"}}}}"#
            ))
            .collect::<Vec<_>>()
            .join(",")
    );
    let t = Instant::now();
    assert_eq!(Config::parse(many.as_bytes()).unwrap().rules.len(), 20_000);
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn key_builder_takes_any_header_bytes() {
    let seed = Seed([1, 2]);
    let parts = [
        KeyPart::RemoteAddress(Prefixes { v4: 23, v6: 57 }),
        KeyPart::Header("x-api-key".into()),
        KeyPart::Query("u".into()),
        KeyPart::Path,
        KeyPart::Method,
        KeyPart::Authority,
    ];
    let config = Config::parse(VALID.as_bytes()).unwrap();
    let matcher: &Match = &config.rules[0].matcher;
    // Huge values are made once (generating 1 MiB takes longer than using it, in debug builds):
    // each huge case changes a few bytes of them.
    let mut gen = Rng(0x5eed);
    let big_header: Vec<u8> = (0..1 << 20).map(|_| gen.next() as u8).collect();
    let big_authority = String::from_utf8_lossy(&gen.bytes(100_000)).into_owned();
    fuzz(
        "key builder",
        100_000 * scale(),
        Duration::from_millis(50),
        |rng, _| {
            let text = |rng: &mut Rng, max| String::from_utf8_lossy(&rng.bytes(max)).into_owned();
            let huge = rng.below(50) == 0;
            // Addresses: random text, or IPv4 / IPv6 (with or without a port), some malformed.
            let address = match rng.below(4) {
                0 => text(rng, 60),
                1 => format!(
                    "{}.{}.{}.{}:{}",
                    rng.below(300),
                    rng.below(256),
                    rng.below(256),
                    rng.below(256),
                    rng.below(70_000)
                ),
                2 => format!(
                    "[{:x}:{:x}::{:x}]:{}",
                    rng.below(1 << 17),
                    rng.below(1 << 16),
                    rng.below(1 << 16),
                    rng.below(9)
                ),
                _ => format!(
                    "::ffff:{}.{}.{}.{}",
                    rng.below(256),
                    rng.below(256),
                    rng.below(256),
                    rng.below(256)
                ),
            };
            let (authority, key) = if huge {
                let mut key = big_header.clone();
                for _ in 0..4 {
                    let at = rng.below(key.len() as u64) as usize;
                    key[at] = rng.next() as u8;
                }
                (big_authority.clone(), key)
            } else {
                (text(rng, 40), rng.bytes(64))
            };
            let mut req = PlainRequest {
                source_address: Some(address),
                path: Some(format!("/{}?u={}", text(rng, 50), text(rng, 20))),
                method: Some(text(rng, 8)),
                authority: Some(authority),
                headers: vec![
                    ("x-api-key".into(), key),
                    ("x-tier".into(), rng.bytes(6)),
                    ("k".into(), rng.bytes(3)),
                ],
            };
            if rng.below(4) == 0 {
                req.headers.clear();
            }
            let _ = matches(matcher, &mut req);
            let _ = client_key(seed, 7, &parts, &mut req);
            if !huge {
                // A descriptor copies its values whole: for 1 MiB ones, only a copy's time.
                let _ = descriptor_entries("r", &parts, &mut req);
            }
        },
    );
}

#[test]
fn slot_decoding_takes_any_bytes() {
    let policies = [
        Policy::SlidingWindow {
            limit: 5,
            window_ms: 1_000,
        },
        Policy::FixedWindow {
            limit: 5,
            window_ms: 60_000,
        },
        Policy::Gcra(gcra::Params {
            limit: 7,
            window_ms: 1_000,
            burst: 3,
            max_delay_ms: Some(10),
        }),
        Policy::SlidingLog {
            limit: 5,
            window_ms: 1_000,
        },
    ];
    // Real slots to mutate: one bucket and one log, each filled by real decisions.
    let mut seeds: Vec<(u64, Vec<u8>)> = Vec::new();
    for (slot, policy) in [(0u64, policies[2]), (LOG_SLOTS, policies[3])] {
        let mut s = Slot::decode(slot, None).unwrap();
        let (_, state) = policy.decide(None, 1_000, 1);
        s.put(3, state.unwrap(), 1_000);
        seeds.push((slot, s.encode().as_ref().to_vec()));
    }
    fuzz(
        "slot decoding",
        200_000 * scale(),
        Duration::from_millis(50),
        |rng, i| {
            let (slot, mut bytes) = if i % 2 == 0 {
                let (slot, b) = &seeds[rng.below(2) as usize];
                (*slot, b.clone())
            } else {
                ([0, LOG_SLOTS][rng.below(2) as usize], rng.bytes(200))
            };
            for _ in 0..rng.below(4) {
                if !bytes.is_empty() {
                    let at = rng.below(bytes.len() as u64) as usize;
                    bytes[at] = rng.next() as u8;
                }
            }
            if let Ok(decoded) = Slot::decode(slot, Some(&bytes)) {
                // Whatever decoded, deciding on it at any time must not panic either.
                let now = rng.next() >> rng.below(64);
                for p in &policies {
                    let state = decoded.find(3).cloned().or_else(|| {
                        decoded
                            .find_log(3)
                            .cloned()
                            .map(ratelimit_core::limiter::State::SlidingLog)
                    });
                    let _ = p.decide(state.as_ref(), now, 1 + rng.below(3));
                }
                let _ = decoded.encode();
            }
        },
    );
}
