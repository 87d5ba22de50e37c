//! An operator's hands on one key, in a real Envoy (native build only: the admin endpoints come
//! from the module's bootstrap extension; the wasm build has none, and these tests pass over it).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Build, Client, Envoy};
use std::net::SocketAddr;

/// The module's bootstrap extension, which registers the admin endpoints.
const OPERATOR: &str = r#"
bootstrap_extensions:
- name: envoy.bootstrap.dynamic_modules
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.bootstrap.dynamic_modules.v3.DynamicModuleBootstrapExtension
    dynamic_module_config: {name: wasm_ratelimit}
    extension_name: operator
"#;

/// A customer keyed on its API key, 3 a minute; and a rule of other keys.
const CUSTOMER: &str = r#"{"rules": [
    {"name": "customer", "key": ["header:x-api-key"],
     "rate_limit": {"requests_per_unit": 3, "unit": "minute"}},
    {"name": "per-ip", "key": ["remote_address"],
     "rate_limit": {"requests_per_unit": 1000, "unit": "minute"}}],
    "log_limited": "info"}"#;

/// Envoy with the filter (plugin `test`) and the operator's endpoints; `None` for the wasm
/// build, which has no admin endpoints.
fn start() -> Option<Envoy> {
    if common::build() != Build::Native {
        eprintln!("skipped: the admin endpoints are the native build's");
        return None;
    }
    let yaml = format!(
        "{}{OPERATOR}",
        common::bootstrap_with(CUSTOMER, &common::Listener::default())
    );
    Some(Envoy::start_yaml(&yaml))
}

/// A request with an API key: its status.
fn call(c: &mut Client, key: &str) -> u16 {
    c.send("GET", "/", &[("x-api-key", key)]).unwrap().status
}

/// An admin request: status and body.
fn admin(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let r = Client::connect(addr)
        .unwrap()
        .send(method, path, &[])
        .unwrap();
    (r.status, r.body_str().to_string())
}

/// The key of the last `limited rule=customer` line.
fn logged_key(envoy: &Envoy) -> String {
    assert!(envoy.log_shows("limited rule=customer shadow=false key="));
    let log = envoy.log();
    let line = log
        .lines()
        .rfind(|l| l.contains("limited rule=customer "))
        .unwrap();
    let key = line.split("key=").nth(1).unwrap();
    key[..16].to_string()
}

/// A JSON number field of a flat object.
fn field<'a>(body: &'a str, name: &str) -> &'a str {
    let at = body
        .find(&format!("\"{name}\":"))
        .unwrap_or_else(|| panic!("{name} in {body}"));
    let rest = &body[at + name.len() + 3..];
    &rest[..rest.find([',', '}']).unwrap()]
}

#[test]
fn a_limited_key_is_inspected_reset_and_passes_at_once() {
    let Some(envoy) = start() else { return };
    let mut c = Client::connect(envoy.addr).unwrap();
    for _ in 0..3 {
        assert_eq!(call(&mut c, "acme"), 200);
    }
    assert_eq!(call(&mut c, "acme"), 429);
    let key = logged_key(&envoy);
    let q = format!("plugin=test&rule=customer&key={key}");

    let (status, body) = admin(envoy.admin, "GET", &format!("/ratelimit/key?{q}"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(field(&body, "key"), format!("\"{key}\""));
    assert_eq!(field(&body, "tracked"), "true");
    assert_eq!(field(&body, "used"), "3");
    assert_eq!(field(&body, "remaining"), "0");
    assert_eq!(field(&body, "limit"), "3");
    let retry: u64 = field(&body, "retry_after_ms").parse().unwrap();
    assert!(retry > 0 && retry <= 120_000, "{body}");

    // GET cannot reset.
    let (status, _) = admin(envoy.admin, "GET", &format!("/ratelimit/reset?{q}"));
    assert_eq!(status, 405);
    assert_eq!(call(&mut c, "acme"), 429, "still limited");

    let (status, body) = admin(envoy.admin, "POST", &format!("/ratelimit/reset?{q}"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(field(&body, "reset"), "true");
    assert_eq!(call(&mut c, "acme"), 200, "passes at once");
    assert!(envoy.log_shows(&format!(
        "operator reset rule=customer key={key} by envoy admin"
    )));
    assert_eq!(
        envoy.wait_stat(&common::metric(Some("customer"), "operator_resets"), 1),
        Some(1)
    );
    // Another customer was never limited: untouched.
    assert_eq!(call(&mut c, "other"), 200);
}

#[test]
fn busiest_keys_come_first_and_mistakes_are_clear() {
    let Some(envoy) = start() else { return };
    let mut c = Client::connect(envoy.addr).unwrap();
    for _ in 0..4 {
        call(&mut c, "busy");
    }
    call(&mut c, "quiet");
    let busy = logged_key(&envoy);

    let (status, body) = admin(
        envoy.admin,
        "GET",
        "/ratelimit/top?plugin=test&rule=customer&n=5",
    );
    assert_eq!(status, 200, "{body}");
    let keys: Vec<&str> = body.split("\"key\":\"").skip(1).map(|k| &k[..16]).collect();
    assert_eq!(keys.len(), 2, "{body}");
    assert_eq!(keys[0], busy, "{body}");
    assert_eq!(field(&body, "used"), "3", "the busy key first: {body}");

    for (method, path, want, says) in [
        (
            "GET",
            "/ratelimit/top?plugin=test&rule=nope".to_string(),
            404,
            "no rule named",
        ),
        (
            "GET",
            "/ratelimit/key?plugin=nope&rule=customer&key=1".to_string(),
            404,
            "no live configuration",
        ),
        (
            "GET",
            format!(
                "/ratelimit/key?plugin=test&rule=customer&key={}",
                "0".repeat(16)
            ),
            404,
            "not a key of rule",
        ),
        (
            "GET",
            "/ratelimit/key?plugin=test&rule=customer&key=xyz".to_string(),
            400,
            "key= is required",
        ),
        (
            "GET",
            format!("/ratelimit/key?plugin=test&rule=per-ip&key={busy}"),
            404,
            "not a key of rule",
        ),
        (
            "POST",
            "/ratelimit/top?plugin=test&rule=customer".to_string(),
            405,
            "takes GET only",
        ),
    ] {
        let (status, body) = admin(envoy.admin, method, &path);
        assert_eq!(status, want, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }
    // A key of the rule it no longer tracks (reset): 404, with what a request would find.
    let q = format!("plugin=test&rule=customer&key={busy}");
    assert_eq!(
        admin(envoy.admin, "POST", &format!("/ratelimit/reset?{q}")).0,
        200
    );
    let (status, body) = admin(envoy.admin, "GET", &format!("/ratelimit/key?{q}"));
    assert_eq!(status, 404, "{body}");
    assert_eq!(field(&body, "tracked"), "false");
    assert_eq!(field(&body, "remaining"), "3");
    let (status, body) = admin(envoy.admin, "POST", &format!("/ratelimit/reset?{q}"));
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("nothing to forget"), "{body}");
}
