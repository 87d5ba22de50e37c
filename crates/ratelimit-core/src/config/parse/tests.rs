//! The configuration reader's unit tests: a whole configuration read with its defaults, the
//! leaky bucket that refuses read as the token bucket, networks, every error reported at once,
//! and no panic whatever the bytes. Each bad configuration and its exact message is a fixture
//! (`tests/config_fixtures.rs`).

use super::*;

#[test]
fn issue_example_parses_with_defaults() {
    let c = Config::parse(
        br#"{"rules":[{"name":"per-client",
            "match":{"path_prefix":"/api/","methods":["GET","POST"],
                     "headers":[{"name":"X-Tier","value":"free"},{"name":"x-api-key","present":true}]},
            "key":["remote_address","header:X-Api-Key"],
            "rate_limit":{"requests_per_unit":100,"unit":"minute"}}]}"#,
    )
    .unwrap();
    assert_eq!(c.capacity, DEFAULT_CAPACITY);
    assert_eq!(c.failure_mode, FailureMode::Allow);
    assert_eq!(c.response, ResponseConfig::default());
    let r = &c.rules[0];
    assert_eq!(r.name, "per-client");
    assert_eq!(
        r.key,
        vec![
            KeyPart::RemoteAddress(DEFAULT_PREFIXES),
            KeyPart::Header("x-api-key".into())
        ]
    );
    assert_eq!(r.matcher.headers[0].name, "x-tier");
    assert!(matches!(r.limit, Limit::Rate { quota, .. } if quota.window_ms() == 60_000));
}

/// A rejecting leaky bucket is the token bucket's admission rule (both are one GCRA, which
/// tests/accuracy.rs checks against a token-bucket reference).
#[test]
fn rejecting_leaky_bucket_is_the_token_bucket_policy() {
    let rule = |algorithm: &str| {
        let json = format!(
            r#"{{"rules": [{{"name": "a", "algorithm": "{algorithm}", "burst": 7,
                "rate_limit": {{"requests_per_unit": 3, "unit": "second"}}}}]}}"#
        );
        Config::parse(json.as_bytes()).unwrap().rules[0].policy()
    };
    assert_eq!(rule("leaky_bucket"), rule("token_bucket"));
}

#[test]
fn networks_hold_their_addresses() {
    let net = |s: &str| Cidr::parse(s).unwrap();
    let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
    assert!(net("0.0.0.0/0").contains(ip("203.0.113.9")));
    assert!(!net("0.0.0.0/0").contains(ip("2001:db8::1")));
    assert!(net("10.20.0.0/16").contains(ip("10.20.255.1")));
    assert!(!net("10.20.0.0/16").contains(ip("10.21.0.1")));
    assert!(net("10.20.0.0/16").contains(ip("::ffff:10.20.0.1")));
    assert!(net("fd00::/8").contains(ip("fd12:3456::1")));
    assert!(!net("fd00::/8").contains(ip("fe80::1")));
    assert!(net("::1/128").contains(ip("::1")));
    assert!(!net("::1/128").contains(ip("::2")));
    assert_eq!(net("::/0").to_string(), "::/0");
    for bad in [
        "10.0.0.0",
        "10.0.0.0/33",
        "10.0.0.0/+8",
        "10.0.0.1/8",
        "::1/0",
        "x/8",
    ] {
        assert!(Cidr::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn all_errors_are_reported_together() {
    let err = Config::parse(
        br#"{"rules":[{"name":"a","rate_limit":{"requests_per_unit":0,"unit":"fortnight"}}],"capacity":0}"#,
    )
    .unwrap_err();
    assert_eq!(err.0.len(), 3, "{err}");
    assert_eq!(
        err.to_string(),
        "rules[0].rate_limit.requests_per_unit: expected an integer from 1 to 4294967295, found number 0; \
         rules[0].rate_limit.unit: unknown unit \"fortnight\" (expected second, minute, hour, day, week, month); \
         capacity: expected an integer from 1 to 1048576, found number 0"
    );
}

#[test]
fn arbitrary_bytes_never_panic() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for len in 0..400usize {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let alphabet = b"{}[]\":,0123 aeflnrstu\\-";
                alphabet[(seed % alphabet.len() as u64) as usize]
            })
            .collect();
        let _ = Config::parse(&bytes);
    }
}
