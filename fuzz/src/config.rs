//! The plugin configuration (`Config::parse`) on arbitrary bytes: never a panic; an error
//! prints; and a configuration it accepts keeps the promises the rest of the code relies on
//! (rule names `[A-Za-z0-9_.-]{1,64}`, quota units `[a-z0-9-]+`), compiles into a runtime, and
//! answers a few requests with header fields of visible ASCII and JSON bodies.

use crate::{assert_json, header_name_ok, header_value_ok};
use ratelimit_core::config::{Config, MAX_NAME_LEN};
use ratelimit_core::key::Seed;
use ratelimit_core::runtime::request::{Decision, Start};
use ratelimit_core::runtime::Runtime;
use ratelimit_core::store::MemoryStore;
use ratelimit_core::testkit::{FakeHost, FakeResponse};

pub fn run(data: &[u8]) {
    match Config::parse(data) {
        Ok(config) => accepted(config),
        Err(e) => {
            let text = e.to_string();
            assert!(!text.is_empty());
        }
    }
}

/// What every configuration that parses must give.
pub fn accepted(config: Config) {
    for rule in &config.rules {
        let name_ok = rule
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        assert!(
            name_ok && !rule.name.is_empty() && rule.name.len() <= MAX_NAME_LEN,
            "{:?}",
            rule.name
        );
        if let Some(unit) = &rule.quota_unit {
            let unit_ok = unit
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            assert!(unit_ok && !unit.is_empty(), "{unit:?}");
        }
        let _ = rule.policy().limit_and_window();
    }
    let rt = Runtime::new(config, Seed([3, 4]), MemoryStore::new());
    let mut buf = String::new();
    for i in 0..4u64 {
        let mut host = FakeHost::new("10.0.0.1", "/v1/chat/completions?key=a&user=u")
            .header("x-api-key", "k")
            .header("authorization", "Bearer sk-1")
            .header("x-tenant", "t")
            .header("content-type", "application/json");
        host.now = 1_764_000_000_000 + i * 10;
        match rt.start(&mut host) {
            Start::Decided(Decision::Reply(reply)) => {
                for (k, v) in reply.headers() {
                    assert!(header_name_ok(k), "{k:?}");
                    assert!(header_value_ok(v), "{k}: {v:?}");
                }
                assert!((400..600).contains(&reply.status));
                if !reply.body.is_empty() {
                    assert_json(&reply.body);
                }
            }
            Start::Decided(Decision::Continue(Some(mut admitted))) => {
                rt.response_headers(
                    &mut admitted,
                    &mut FakeResponse(vec![("x-usage".into(), b"7".to_vec())]),
                    host.now,
                    &mut buf,
                    |k, v, _| {
                        assert!(header_name_ok(k), "{k:?}");
                        assert!(header_value_ok(v), "{k}: {v:?}");
                    },
                    &mut |_, _| {},
                );
            }
            _ => {}
        }
    }
}
