//! The wasm build's operator route in a real Envoy (two workers): a customer at its limit is
//! inspected, reset through the route and passes at once, the reset logged and counted; a call
//! that is not allowed (from another source, without the token, with a wrong one, with a wrong
//! method, or with no `operator` block at all) gets exactly what an ordinary request to another
//! path gets, and resets nothing. The native build ignores the block (its admin port serves
//! these calls): it starts, says so in its log, and the route's path is an ordinary path.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{build, metric, Build, Client, Envoy, Response};
use std::net::SocketAddr;

const TOKEN: &str = "q8Vn3xT1pZ7rL0cW5mK9bY2hD6fJ4sAe";

/// Two rules: `per-client` (3 a minute per `x-api-key`), and `everyone` (per address, high
/// enough never to refuse), with no fields on allowed answers so that two allowed requests look
/// alike; and the operator block if `with_operator`.
fn config(with_operator: bool) -> String {
    let operator = match with_operator {
        true => format!(
            r#",
 "operator": {{"path_prefix": "/.ratelimit/", "allow_from": ["127.0.0.1/32", "::1/128"],
              "token": "{TOKEN}"}}"#
        ),
        false => String::new(),
    };
    format!(
        r#"{{"rules": [
   {{"name": "per-client", "key": ["header:x-api-key"],
    "rate_limit": {{"requests_per_unit": 3, "unit": "minute"}}}},
   {{"name": "everyone", "key": ["remote_address"],
    "rate_limit": {{"requests_per_unit": 100000, "unit": "minute"}}}}],
 "response": {{"on_allowed": false}},
 "log_limited": "info"{operator}}}"#
    )
}

fn alice(addr: SocketAddr) -> Response {
    Client::connect(addr)
        .unwrap()
        .send("GET", "/api", &[("x-api-key", "alice")])
        .unwrap()
}

/// A request from `source` (a fresh connection).
fn from(
    addr: SocketAddr,
    source: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Response {
    Client::connect_from(addr, source)
        .unwrap()
        .send(method, path, headers)
        .unwrap()
}

/// Asserts that `got` is what `ordinary` was: status, body and headers, except those that
/// differ between any two answers.
fn same_answer(what: &str, got: &Response, ordinary: &Response) {
    let headers = |r: &Response| {
        let mut h: Vec<(String, String)> = r
            .headers
            .iter()
            .filter(|(n, _)| n != "date" && n != "x-envoy-upstream-service-time")
            .cloned()
            .collect();
        h.sort();
        h
    };
    assert_eq!(got.status, ordinary.status, "{what}: status");
    assert_eq!(got.body_str(), ordinary.body_str(), "{what}: body");
    assert_eq!(headers(got), headers(ordinary), "{what}: headers");
}

/// The key the filter logged for alice's refused request.
fn logged_key(envoy: &Envoy) -> String {
    assert!(envoy.log_shows("limited rule=per-client shadow=false key="));
    let log = envoy.log();
    let at = log
        .find("limited rule=per-client shadow=false key=")
        .unwrap();
    log[at..]
        .split_whitespace()
        .find_map(|w| w.strip_prefix("key="))
        .unwrap()
        .to_string()
}

fn json(r: &Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body_str()))
}

#[test]
fn a_customer_at_its_limit_is_inspected_reset_and_passes_at_once() {
    let envoy = Envoy::start(&config(true));
    if build() == Build::Native {
        assert!(envoy.log_shows("the \"operator\" block is for the wasm build and is ignored here"));
        let call = from(
            envoy.addr,
            "127.0.0.1",
            "GET",
            "/.ratelimit/top?rule=per-client",
            &[("x-ratelimit-operator-token", TOKEN)],
        );
        let ordinary = from(envoy.addr, "127.0.0.1", "GET", "/top?rule=per-client", &[]);
        same_answer("native: the route's path", &call, &ordinary);
        eprintln!("native build: the operator block is ignored (the admin port serves the calls)");
        return;
    }
    for _ in 0..3 {
        assert_eq!(alice(envoy.addr).status, 200);
    }
    assert_eq!(alice(envoy.addr).status, 429);
    let key = logged_key(&envoy);
    let token = [("x-ratelimit-operator-token", TOKEN)];

    let inspect = |source: &str| {
        from(
            envoy.addr,
            source,
            "GET",
            &format!("/.ratelimit/key?rule=per-client&key={key}"),
            &token,
        )
    };
    let state = inspect("127.0.0.1");
    assert_eq!(state.status, 200, "{}", state.body_str());
    assert_eq!(state.header("content-type"), Some("application/json"));
    let s = json(&state);
    assert_eq!(s["key"], key.as_str());
    assert_eq!(s["tracked"], true);
    assert_eq!(s["used"], 3);
    assert_eq!(s["remaining"], 0);
    assert_eq!(s["limit"], 3);
    let retry = s["retry_after_ms"].as_u64().unwrap();
    // A sliding window counter weighs the window before: requests that straddled a window
    // boundary free up over up to two windows.
    assert!((1..=120_000).contains(&retry), "{retry}");
    assert!(s["reset_ms"].as_u64().unwrap() <= 120_000);

    let top = from(
        envoy.addr,
        "127.0.0.1",
        "GET",
        "/.ratelimit/top?rule=per-client&n=5",
        &token,
    );
    assert_eq!(top.status, 200, "{}", top.body_str());
    let t = json(&top);
    assert_eq!(t["plugin"], "test");
    assert_eq!(t["keys"][0]["key"], key.as_str());

    // Not allowed: each gets what an ordinary request to another path gets, and resets nothing.
    let reset = format!("/.ratelimit/reset?rule=per-client&key={key}");
    let ordinary = |source: &str, method: &str| from(envoy.addr, source, method, "/reset", &[]);
    let wrong = [(
        "x-ratelimit-operator-token",
        "q8Vn3xT1pZ7rL0cW5mK9bY2hD6fJ4sAf",
    )];
    let refused = [
        ("from another source", "127.0.0.2", "POST", &token[..]),
        ("without the token", "127.0.0.1", "POST", &[][..]),
        ("with a wrong token", "127.0.0.1", "POST", &wrong[..]),
        ("with a wrong method", "127.0.0.1", "PUT", &token[..]),
    ];
    for (what, source, method, headers) in refused {
        let got = from(envoy.addr, source, method, &reset, headers);
        same_answer(what, &got, &ordinary(source, method));
        assert_eq!(got.body_str(), "ok\n", "{what}");
    }
    assert!(envoy.log_shows("operator route: refused POST /.ratelimit/reset from 127.0.0.2:"));
    assert_eq!(alice(envoy.addr).status, 429, "the key was not reset");
    // The refused calls were requests like any other: the rules counted them (alice's 3, the 4
    // refused calls and the 4 ordinary requests at least).
    assert!(envoy
        .wait_stat_until(&metric(Some("everyone"), "allowed"), |n| n >= 11)
        .is_some_and(|n| n >= 11));

    let done = from(envoy.addr, "127.0.0.1", "POST", &reset, &token);
    assert_eq!(done.status, 200, "{}", done.body_str());
    assert_eq!(
        done.body_str(),
        format!(
            "{{\"plugin\":\"test\",\"rule\":\"per-client\",\"key\":\"{key}\",\"reset\":true}}\n"
        )
    );
    assert_eq!(alice(envoy.addr).status, 200, "passes at once");
    assert!(envoy.log_shows(&format!(
        "operator reset rule=per-client key={key} by operator route from 127.0.0.1:"
    )));
    assert_eq!(
        envoy.wait_stat(&metric(Some("per-client"), "operator_resets"), 1),
        Some(1)
    );
    // Alice's one request since the reset is all the key holds, whichever worker serves this.
    let after = json(&inspect("127.0.0.1"));
    assert_eq!(after["used"], 1);
    assert_eq!(after["remaining"], 2);
}

#[test]
fn without_the_block_the_route_is_an_ordinary_path() {
    let envoy = Envoy::start(&config(false));
    for _ in 0..4 {
        alice(envoy.addr);
    }
    assert_eq!(alice(envoy.addr).status, 429);
    let key = logged_key(&envoy);
    let token = [("x-ratelimit-operator-token", TOKEN)];
    for (method, call) in [
        ("GET", format!("/.ratelimit/key?rule=per-client&key={key}")),
        (
            "POST",
            format!("/.ratelimit/reset?rule=per-client&key={key}"),
        ),
    ] {
        let got = from(envoy.addr, "127.0.0.1", method, &call, &token);
        let ordinary = from(envoy.addr, "127.0.0.1", method, "/other", &token);
        same_answer(&call, &got, &ordinary);
        assert_eq!(got.body_str(), "ok\n");
    }
    assert_eq!(alice(envoy.addr).status, 429, "the key was not reset");
}

/// `allow_from` checks `source.address`, the client address as the connection manager derives
/// it: with Envoy's default (`use_remote_address: false`) that is the last address of
/// `X-Forwarded-For`, which a client writes itself; with `use_remote_address: true` it is the
/// peer. The secret is what keeps such a client out; the README says so.
#[test]
fn the_source_check_sees_the_connection_managers_client_address() {
    if build() == Build::Native {
        eprintln!("native build: no operator route (the admin port serves the calls)");
        return;
    }
    let call = |envoy: &Envoy| {
        from(
            envoy.addr,
            "127.0.0.2",
            "GET",
            "/.ratelimit/top?rule=per-client",
            &[
                ("x-ratelimit-operator-token", TOKEN),
                ("x-forwarded-for", "127.0.0.1"),
            ],
        )
    };
    let trusting = Envoy::start(&config(true));
    assert_eq!(
        call(&trusting).status,
        200,
        "X-Forwarded-For trusted by default"
    );
    let yaml = common::bootstrap(&config(true), &common::wasm_path()).replace(
        "stat_prefix: test",
        "stat_prefix: test\n          use_remote_address: true",
    );
    let peer = Envoy::start_yaml(&yaml);
    let got = call(&peer);
    assert_eq!(
        got.body_str(),
        "ok\n",
        "the peer, 127.0.0.2, is not allowed"
    );
}
