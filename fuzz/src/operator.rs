//! The operator's calls (the admin endpoints of the native build, the operator route of the
//! wasm build) on arbitrary query strings, paths, methods, sources and tokens: every answer is a
//! JSON object with one of the statuses documented, the route answers only an allowed call, and
//! the pieces round-trip (a logged key, a JSON string, percent-decoding).
//!
//! Input: a byte choosing the call and the host's fields, the clock, then the fields.

use crate::{assert_json, Bytes};
use ratelimit_core::config::Config;
use ratelimit_core::key::Seed;
use ratelimit_core::runtime::operator::LoggedKey;
use ratelimit_core::runtime::operator_http::{self, OperatorCall, Params, TOKEN_HEADER};
use ratelimit_core::runtime::Runtime;
use ratelimit_core::store::MemoryStore;
use ratelimit_core::testkit::FakeHost;
use std::sync::OnceLock;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

const CONFIG: &str = r#"{
  "rules": [
    {"name": "per-client", "key": ["header:x-api-key"],
     "rate_limit": {"requests_per_unit": 2, "unit": "minute"}},
    {"name": "per-customer", "key": ["header:x-api-key"],
     "rate_limit": {"requests_per_unit": {"from": "header:x-plan-rpm", "default": 3, "max": 100000},
                    "unit": "minute"}},
    {"name": "log", "key": ["remote_address"], "algorithm": "sliding_log",
     "rate_limit": {"requests_per_unit": 5, "unit": "second"}},
    {"name": "bucket", "key": ["header:x-api-key"], "algorithm": "token_bucket",
     "rate_limit": {"requests_per_unit": 1, "unit": "second"}, "burst": 2},
    {"name": "flight", "key": ["header:x-api-key"], "in_flight": {"max": 1}}
  ],
  "operator": {"path_prefix": "/.ratelimit/", "allow_from": ["127.0.0.1/32", "::1/128", "10.20.0.0/16"],
               "token": "0123456789abcdef0123456789abcdef"}
}"#;

fn config() -> &'static Config {
    static CONFIG_ONCE: OnceLock<Config> = OnceLock::new();
    CONFIG_ONCE.get_or_init(|| Config::parse(CONFIG.as_bytes()).expect("the operator config"))
}

/// A runtime with a few keys counted.
fn runtime(now: u64) -> Runtime<MemoryStore> {
    let rt = Runtime::new(config().clone(), Seed([1, 2]), MemoryStore::new());
    for key in ["alice", "bob", "carol"] {
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-api-key", key);
        host.now = now;
        for _ in 0..3 {
            let _ = rt.start(&mut host);
        }
    }
    rt
}

const CALLS: [OperatorCall; 3] = [OperatorCall::Key, OperatorCall::Top, OperatorCall::Reset];

fn check(answer: &operator_http::OperatorAnswer) {
    assert!([200, 400, 404, 500].contains(&answer.status), "{answer:?}");
    assert!(assert_json(&answer.body).is_object(), "{answer:?}");
}

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let choice = input.u8();
    let now = 600_000 + u64::from(input.u32());
    let query = input.text(256);
    let name = input.text(16);

    // The pieces.
    let params = Params::parse(&query);
    for p in ["rule", "key", "n", "limit", ""] {
        let _ = params.get(p);
    }
    for text in [query.as_str(), name.as_str()] {
        if let Some(k) = LoggedKey::parse(text) {
            assert!(text.len() <= 16 && text.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(LoggedKey::parse(&k.to_string()), Some(k));
            assert_eq!(u64::from_str_radix(text, 16).ok(), Some(k.0));
        }
        let quoted = operator_http::json(text);
        assert_eq!(
            serde_json::from_str::<String>(&quoted).ok().as_deref(),
            Some(text)
        );
    }

    // A call with the input's query, on a runtime with keys counted.
    let rt = runtime(now);
    let call = CALLS[usize::from(choice) % 3];
    check(&rt.answer(call, "plugin\"\n", &query, now, "fuzz", |_, _| {}));
    // And with a key the runtime logged (found with top), the input choosing the rest.
    let top = rt.answer(
        OperatorCall::Top,
        "p",
        "rule=per-client&n=1000",
        now,
        "",
        |_, _| {},
    );
    check(&top);
    let listed = assert_json(&top.body);
    if let Some(key) = listed["keys"][0]["key"].as_str() {
        let q = format!("rule=per-client&key={key}&{query}");
        check(&rt.answer(call, "p", &q, now, "", |_, _| {}));
    }

    // The route: answers only an allowed call, always with JSON.
    let method = ["GET", "POST", "PUT", ""][usize::from(choice >> 2) % 4];
    let source = match (choice >> 4) & 3 {
        0 => "127.0.0.1:1234".to_string(),
        1 => "[::1]:80".to_string(),
        2 => "10.20.3.4:5".to_string(),
        _ => name.clone(),
    };
    let path = format!("/.ratelimit/{name}?{query}");
    let mut host = FakeHost::new("127.0.0.1", &path);
    host.req.source_address = Some(source);
    host.req.method = Some(method.into());
    host.now = now;
    if choice & 64 != 0 {
        host = host.header(TOKEN_HEADER, TOKEN);
    } else if choice & 128 != 0 {
        host = host.header(TOKEN_HEADER, &name);
    }
    if let Some(answer) = rt.operator_route(&mut host, "plugin") {
        check(&answer);
        let called = name.split_once('?').map_or(name.as_str(), |(n, _)| n);
        let call = OperatorCall::named(called).expect("an answer to no call");
        assert_eq!(call.method(), method);
    }
}
