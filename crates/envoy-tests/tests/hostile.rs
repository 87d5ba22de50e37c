//! Hostile requests against every key part and every body rule, in a real Envoy (two workers),
//! in the build under test: header values at Envoy's size limits, many and duplicate headers,
//! obs-text (invalid UTF-8) bytes, empty values; query strings of thousands of parameters with
//! the key parameter anywhere; odd but valid authorities, paths and methods; JSON bodies nested
//! 10,000 deep, with numbers no integer holds, invalid UTF-8 and bad escapes, sent a byte at a
//! time, larger than `max_body`, or cut short by the client.
//!
//! Why: every request a client can send reaches the key builder and the body scanner before
//! any limit. What they promise ([Failure and hostile input], [Key parts], [Keys and matches
//! from the request body], [Reservations]) is asserted here through Envoy, where the bytes
//! really come from its codec and its hosts: which counter each request is charged to (each
//! rule admits one request per key, so a second one is refused exactly when it shares the
//! first one's counter), what counts as a missing key (a 401 under `on_missing_key: refuse`,
//! counted in `key_missing`), which rules applied (`RateLimit-Policy`), what a reservation
//! reserved (`x-ratelimit-remaining`); and that Envoy lives through all of it, serving, with no
//! panic in its log (native: `panics` stays 0).
//!
//! Raw requests go out on their own sockets (obs-text bytes, chunked bodies, cut bodies),
//! written here: `common::Client` takes only text headers.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::llm::{LlmClient, LlmUpstream, Reply};
use common::{bootstrap_with, build, metric, Build, Envoy, Listener};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

// ---------------------------------------------------------------------------------------------
// A raw HTTP/1.1 client

/// A response read off a raw socket: its status and headers (names in lower case).
#[derive(Debug)]
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
}

/// Sends `method target` with `headers` (raw bytes, any octet) and no body on a fresh
/// connection that closes after the answer; reads the status and headers.
fn raw(addr: SocketAddr, method: &str, target: &str, headers: &[(&[u8], &[u8])]) -> Raw {
    let mut req = format!("{method} {target} HTTP/1.1\r\n").into_bytes();
    let mut host = false;
    for (k, v) in headers {
        host |= k.eq_ignore_ascii_case(b"host");
        req.extend_from_slice(k);
        req.extend_from_slice(b": ");
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    if !host {
        req.extend_from_slice(b"host: localhost\r\n");
    }
    req.extend_from_slice(b"connection: close\r\n\r\n");
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Envoy may answer (431) and close before it has read the whole request: a write error
    // then is not the test's failure, the answer is.
    let _ = s.write_all(&req);
    read_answer(&mut s, &format!("{method} {}", short(target)))
}

/// Reads an answer's status and headers, and its body by its content-length (Envoy holds a
/// closing connection open for a second, so the end of the stream is not waited for).
fn read_answer(s: &mut TcpStream, what: &str) -> Raw {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(at) = out.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => panic!("{what}: no answer: {:?}", String::from_utf8_lossy(&out)),
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&out[..end]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{what}: bad answer {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut have = out.len() - end - 4;
    while have < len {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => have += n,
        }
    }
    Raw { status, headers }
}

/// A GET of `target` with text headers.
fn get(addr: SocketAddr, target: &str, headers: &[(&str, &str)]) -> Raw {
    let h: Vec<(&[u8], &[u8])> = headers
        .iter()
        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
        .collect();
    raw(addr, "GET", target, &h)
}

/// The first 60 characters of a long text, for messages.
fn short(s: &str) -> String {
    s.chars().take(60).collect()
}

/// Envoy is alive, serving, and logged no panic; native: no panic caught.
fn assert_alive(envoy: &Envoy, serving: impl Fn() -> u16) {
    assert_eq!(serving(), 200, "Envoy still serves");
    let log = envoy.log();
    for bad in ["panic", "[critical]", "Caught ", "Backtrace ("] {
        assert!(!log.contains(bad), "Envoy's log shows {bad:?}:\n{log}");
    }
    if build() == Build::Native {
        assert_eq!(envoy.stat(&metric(None, "panics")), Some(0));
    }
}

/// Waits for a rule's counter to reach `want`.
fn counter(envoy: &Envoy, rule: &str, name: &str, want: u64) {
    assert_eq!(
        envoy.wait_stat(&metric(Some(rule), name), want),
        Some(want),
        "{rule} {name}"
    );
}

// ---------------------------------------------------------------------------------------------
// Headers, query, authority, path, method

/// One request per key an hour, for requests `on` selects; a missing key is refused (401).
fn once_per_key(name: &str, on: &str, key: &str) -> String {
    format!(
        r#"{{"name": "{name}", "match": {on}, "key": [{key}], "on_missing_key": "refuse",
            "rate_limit": {{"requests_per_unit": 1, "unit": "hour"}}}}"#
    )
}

/// Envoy's default `max_request_headers_kb`: the request line and headers, together.
const HEADERS_LIMIT: usize = 60 * 1024;

#[test]
fn header_and_query_bombs_are_keyed_as_documented() {
    let rules = [
        once_per_key("hdr", r#"{"path": "/hdr"}"#, r#""header:x-k""#),
        once_per_key("bearer", r#"{"path": "/bearer"}"#, r#""bearer""#),
        once_per_key(
            "first",
            r#"{"path": "/first"}"#,
            r#"{"first": ["header:x-k", "bearer"]}"#,
        ),
        once_per_key("query", r#"{"path": "/q"}"#, r#""query:k""#),
        once_per_key(
            "req",
            r#"{"headers": [{"name": "x-req", "present": true}]}"#,
            r#""method", "path", "authority""#,
        ),
    ];
    let envoy = Envoy::start(&format!(r#"{{"rules": [{}]}}"#, rules.join(",\n")));
    let addr = envoy.addr;
    let mut missing = std::collections::HashMap::<&str, u64>::new();
    // Sends one request and checks its status; counts the 401s per rule.
    let mut expect = |rule: &'static str, r: Raw, want: u16, what: &str| {
        assert_eq!(r.status, want, "{rule}: {what}: {:?}", r.headers);
        if want == 401 {
            *missing.entry(rule).or_default() += 1;
        }
    };
    let hdr = |v: &[u8]| raw(addr, "GET", "/hdr", &[(b"x-k", v)]);

    // --- A header value near Envoy's 60 KiB: keyed by its first 4 KiB and its length. ---
    let big = |head: u8, tail: u8, len: usize| {
        let mut v = vec![head; 4096];
        v.resize(len, tail);
        v
    };
    let n = 55_000;
    expect("hdr", hdr(&big(b'A', b'x', n)), 200, "a 55 KB value");
    expect("hdr", hdr(&big(b'A', b'x', n)), 429, "the same again");
    expect(
        "hdr",
        hdr(&big(b'A', b'y', n)),
        429,
        "same first 4 KiB and length: documented to share the counter",
    );
    expect("hdr", hdr(&big(b'A', b'x', n + 1)), 200, "one byte longer");
    expect(
        "hdr",
        hdr(&big(b'B', b'x', n)),
        200,
        "differs in the first 4 KiB",
    );
    // Past Envoy's limit: Envoy answers 431 itself.
    expect(
        "hdr",
        hdr(&big(b'C', b'x', HEADERS_LIMIT + 10)),
        431,
        "past 60 KiB",
    );

    // --- Many headers: 95 more than usual, the key last; past max_headers_count (100). ---
    let many = |count: usize, key: &str| {
        let names: Vec<String> = (0..count).map(|i| format!("x-pad-{i}")).collect();
        let mut h: Vec<(&[u8], &[u8])> = names.iter().map(|n| (n.as_bytes(), &b"v"[..])).collect();
        h.push((b"x-k", key.as_bytes()));
        raw(addr, "GET", "/hdr", &h)
    };
    expect("hdr", many(95, "many"), 200, "97 headers");
    expect("hdr", many(95, "many"), 429, "97 headers again");
    expect("hdr", many(120, "many-over"), 431, "122 headers");

    // --- Duplicate key headers. ---
    let dup = raw(
        addr,
        "GET",
        "/hdr",
        &[(b"x-k", b"dup-a"), (b"x-k", b"dup-b")],
    );
    expect("hdr", dup, 200, "x-k twice");
    // The docs are silent; both builds key the first value (Envoy's proxy-wasm host and the
    // dynamic module's header getter both give the first of the lines).
    expect("hdr", hdr(b"dup-a"), 429, "the first of the two alone");
    expect("hdr", hdr(b"dup-b"), 200, "the second of the two alone");

    // --- obs-text: the value's bytes as sent, invalid UTF-8 included. ---
    expect("hdr", hdr(b"\x80\xff\xfe obs"), 200, "obs-text");
    expect("hdr", hdr(b"\x80\xff\xfe obs"), 429, "the same obs-text");
    expect("hdr", hdr(b"\x80\xff\xfd obs"), 200, "other obs-text");
    expect("hdr", hdr(b"caf\xc3"), 200, "a cut UTF-8 sequence");

    // --- Empty and whitespace-only: missing. ---
    expect("hdr", hdr(b""), 401, "empty");
    expect("hdr", hdr(b"   "), 401, "spaces");
    expect("hdr", hdr(b" \t "), 401, "a tab");
    expect("hdr", get(addr, "/hdr", &[]), 401, "absent");

    // --- bearer: the token, scheme in any case, spaces around it dropped. ---
    let bearer = |v: &[u8]| raw(addr, "GET", "/bearer", &[(b"authorization", v)]);
    let token = "t".repeat(50_000);
    expect(
        "bearer",
        bearer(format!("Bearer {token}").as_bytes()),
        200,
        "50 KB token",
    );
    expect(
        "bearer",
        bearer(format!("bEaReR    {token}  ").as_bytes()),
        429,
        "the same token, another case and spaces",
    );
    expect("bearer", bearer(b"Bearer \xff\xfe"), 200, "obs-text token");
    expect("bearer", bearer(b"Bearer \xff\xfe"), 429, "the same again");
    for v in [
        &b"Bearer"[..],
        b"Bearer    ",
        b"Basic dXNlcjpwYXNz",
        b"",
        b"  ",
    ] {
        expect("bearer", bearer(v), 401, &String::from_utf8_lossy(v));
    }

    // --- first(header, bearer): only the value is keyed; a missing part falls through. ---
    let first = |h: &[(&[u8], &[u8])]| raw(addr, "GET", "/first", h);
    expect("first", first(&[]), 401, "neither");
    expect(
        "first",
        first(&[(b"x-k", b"  ")]),
        401,
        "x-k blank, no bearer",
    );
    expect("first", first(&[(b"x-k", b"shared-v")]), 200, "by x-k");
    expect(
        "first",
        first(&[(b"authorization", b"Bearer shared-v")]),
        429,
        "the same value by bearer",
    );
    let huge_bearer = format!("Bearer {}", "h".repeat(50_000));
    expect(
        "first",
        first(&[(b"x-k", b""), (b"authorization", huge_bearer.as_bytes())]),
        200,
        "x-k empty: the bearer token",
    );
    expect(
        "first",
        first(&[(b"authorization", huge_bearer.as_bytes())]),
        429,
        "the same token alone",
    );

    // --- Query bombs: thousands of parameters, the key anywhere. ---
    let params = |n: usize| -> String { (0..n).map(|i| format!("a{i}={i}&")).collect() };
    let pad = params(4000); // 4,000 parameters, about 40 KB
    assert!(pad.len() > 35_000 && pad.len() < HEADERS_LIMIT - 10_000);
    let q = |query: &str| get(addr, &format!("/q?{query}"), &[]);
    expect(
        "query",
        q(&format!("k=first-1&{pad}")),
        200,
        "first of 4,001",
    );
    expect("query", q("k=first-1"), 429, "the same value alone");
    expect("query", q(&format!("{pad}k=last-1")), 200, "last of 4,001");
    expect("query", q(&format!("{pad}k=last-1")), 429, "the same again");
    expect(
        "query",
        q(&format!("k=rep-1&{pad}k=rep-2")),
        200,
        "k twice, 4,000 apart",
    );
    expect("query", q("k=rep-1"), 429, "the first one is the key");
    expect("query", q("k=rep-2"), 200, "the second one was not");
    expect("query", q("k=%41%42"), 200, "percent-encoded");
    expect(
        "query",
        q("k=AB"),
        200,
        "its decoded form: raw values differ",
    );
    expect("query", q("k=%41%42"), 429, "the encoded one again");
    expect(
        "query",
        q("%6B=zz"),
        401,
        "the name percent-encoded is not k",
    );
    expect("query", q("k="), 401, "k=");
    expect("query", q("k"), 401, "k alone");
    expect(
        "query",
        q(&format!("{pad}k")),
        401,
        "k alone, last of 4,001",
    );
    expect(
        "query",
        q("k&k=later"),
        401,
        "the first k has no value: missing",
    );
    expect("query", q("a&k=after-a&b"), 200, "a and b without =");
    expect("query", q("k=after-a"), 429, "the same value");
    expect("query", get(addr, "/q", &[]), 401, "no query");
    let long_value = format!("k={}", "v".repeat(50_000));
    expect("query", q(&long_value), 200, "a 50 KB value");
    expect("query", q(&long_value), 429, "the same again");
    expect(
        "query",
        q(&format!("k={}", "v".repeat(HEADERS_LIMIT + 10))),
        431,
        "past 60 KiB",
    );

    // --- Authority, path and method with odd but valid values. ---
    let req = |method: &str, target: &str, host: &str| {
        raw(
            addr,
            method,
            target,
            &[(b"x-req", b"1"), (b"host", host.as_bytes())],
        )
    };
    expect(
        "req",
        req("GET", "/r", "EXAMPLE.com"),
        200,
        "upper-case host",
    );
    expect(
        "req",
        req("GET", "/r", "example.COM"),
        429,
        "the authority is lower-cased",
    );
    expect(
        "req",
        req("GET", "/r", "example.com:8080"),
        200,
        "with a port",
    );
    expect("req", req("GET", "/r", "[::1]:80"), 200, "an IPv6 literal");
    expect("req", req("GET", "/r", "[::1]:80"), 429, "the same again");
    let odd = "/r/%7Efoo;p=1/a:b@c!$&'()*+,=-._~%00%FF";
    expect("req", req("GET", odd, "h"), 200, "an odd path");
    expect("req", req("GET", odd, "h"), 429, "the same again");
    expect(
        "req",
        req("GET", &format!("{odd}?x=1"), "h"),
        429,
        "the query is not part of the path",
    );
    expect(
        "req",
        req("GET", "/r/~foo;p=1/a:b@c!$&'()*+,=-._~%00%FF", "h"),
        200,
        "%7E is not ~",
    );
    expect("req", req("PURGE", "/r", "h"), 200, "an extension method");
    expect("req", req("PURGE", "/r", "h"), 429, "the same again");
    expect("req", req("GET", "/r", "h"), 200, "GET is another method");
    let long_path = |c: char, len: usize| {
        let mut p = format!("/r/{}", "p".repeat(4093));
        p.extend(std::iter::repeat_n(c, len - p.len()));
        p
    };
    expect(
        "req",
        req("GET", &long_path('a', 50_000), "h"),
        200,
        "a 50 KB path",
    );
    expect(
        "req",
        req("GET", &long_path('b', 50_000), "h"),
        429,
        "the same first 4 KiB and length",
    );
    expect(
        "req",
        req("GET", &long_path('a', 50_001), "h"),
        200,
        "one byte longer",
    );

    assert_alive(&envoy, || hdr(b"alive-check").status);
    for (rule, n) in &missing {
        counter(&envoy, rule, "key_missing", *n);
    }
    counter(&envoy, "hdr", "failed_open", 0);
}

// ---------------------------------------------------------------------------------------------
// Request bodies

/// The body rules' `max_body` (top level and the reservation's).
const MAX_BODY: usize = 65_536;
/// The reservation rule's limit and default reservation.
const RES_LIMIT: u64 = 1000;
const RES_DEFAULT: u64 = 100;

const PATH: &str = "/v1/chat/completions";

#[test]
fn body_bombs_are_read_as_documented() {
    let config = format!(
        r#"{{"max_body": {MAX_BODY}, "rules": [
        {{"name": "bkey", "match": {{"headers": [{{"name": "x-bkey", "present": true}}]}},
         "key": ["body:model"], "on_missing_key": "refuse",
         "rate_limit": {{"requests_per_unit": 1, "unit": "hour"}}}},
        {{"name": "bmatch", "match": {{"headers": [{{"name": "x-bmatch", "present": true}}],
                                   "body": [{{"field": "model", "prefix": "gpt-4o"}}]}},
         "key": ["header:x-bmatch"],
         "rate_limit": {{"requests_per_unit": 1000, "unit": "hour"}}}},
        {{"name": "bres", "match": {{"headers": [{{"name": "x-bres", "present": true}}]}},
         "key": ["header:x-bres"],
         "rate_limit": {{"requests_per_unit": {RES_LIMIT}, "unit": "hour"}},
         "cost": {{"response": "openai", "true_up": true,
                  "reserve": {{"from": "openai", "default": {RES_DEFAULT}, "max_body": {MAX_BODY}}}}}}}]}}"#
    );
    let up = LlmUpstream::start();
    let listener = Listener::to(up.addr);
    let envoy = Envoy::start_yaml(&bootstrap_with(&config, &listener));
    let addr = envoy.addr;
    // One POST of `body` in `pieces` bytes each (`gap` apart), with `headers`.
    let send = |headers: &[(&str, &str)], body: &[u8], piece: usize| -> Reply {
        let pieces: Vec<&[u8]> = body.chunks(piece.max(1)).collect();
        let gap = Duration::from_millis(if pieces.len() > 1 { 1 } else { 0 });
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        LlmClient::connect(addr)
            .unwrap()
            .send_pieces("POST", PATH, &h, &pieces, gap, None)
            .unwrap()
    };
    // The same, chunked: every piece its own chunk.
    let send_chunked = |headers: &[(&str, &str)], body: &[u8], piece: usize| -> Reply {
        let mut framed: Vec<Vec<u8>> = body
            .chunks(piece)
            .map(|c| {
                let mut f = format!("{:x}\r\n", c.len()).into_bytes();
                f.extend_from_slice(c);
                f.extend_from_slice(b"\r\n");
                f
            })
            .collect();
        framed.push(b"0\r\n\r\n".to_vec());
        let pieces: Vec<&[u8]> = framed.iter().map(Vec::as_slice).collect();
        let mut h = vec![
            ("content-type", "application/json"),
            ("transfer-encoding", "chunked"),
        ];
        h.extend_from_slice(headers);
        LlmClient::connect(addr)
            .unwrap()
            .send_pieces("POST", PATH, &h, &pieces, Duration::from_millis(1), None)
            .unwrap()
    };
    let mut missing = 0u64;
    // body:model, one request per model: checks the status.
    let mut key = |body: &[u8], piece: usize, want: u16, what: &str| {
        let r = send(&[("x-bkey", "1")], body, piece);
        assert_eq!(
            r.status,
            want,
            "bkey: {what}: {}",
            String::from_utf8_lossy(&r.body)
        );
        if want == 401 {
            missing += 1;
            assert!(String::from_utf8_lossy(&r.body).contains("(body:model)"));
        }
        if want == 200 {
            let ex = up
                .wait_sent(r.seq().unwrap(), Duration::from_secs(10))
                .unwrap();
            assert_eq!(
                ex.request.body_len,
                body.len() as u64,
                "{what}: the body went whole"
            );
        }
    };
    // match.body: whether bmatch applied (it names itself in RateLimit-Policy).
    let matched = |body: &[u8], piece: usize| {
        let r = send(&[("x-bmatch", "m")], body, piece);
        assert_eq!(r.status, 200);
        r.header("ratelimit-policy")
            .is_some_and(|p| p.contains("\"bmatch\""))
    };
    // The reservation, on a key of its own (true_up: counted at admission).
    let mut n = 0;
    let mut reserved = |body: &[u8], piece: usize| {
        n += 1;
        let id = format!("res-{n}");
        let r = send(&[("x-bres", &id)], body, piece);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(body));
        RES_LIMIT
            - r.header("x-ratelimit-remaining")
                .unwrap()
                .parse::<u64>()
                .unwrap()
    };
    let model = |m: &str| format!(r#"{{"messages": [], "model": {m}}}"#).into_bytes();
    let max_tokens = |m: &str| format!(r#"{{"messages": [], "max_tokens": {m}}}"#).into_bytes();
    let open = |c: &str, n: usize| c.repeat(n);

    // --- Deep nesting: past 127 levels the document is invalid and ends there; what came
    // before it stays. ---
    key(open("[", 10_000).as_bytes(), 100_000, 401, "10,000 [");
    key(open("{", 10_000).as_bytes(), 100_000, 401, "10,000 {");
    let before = format!(r#"{{"model": "deep-before", "x": {}"#, open("[", 10_000));
    key(before.as_bytes(), 100_000, 200, "the model, then 10,000 [");
    key(before.as_bytes(), 100_000, 429, "the same again");
    let nested = |depth: usize, m: &str| {
        format!(
            r#"{{"x": {}{}, "model": "{m}"}}"#,
            open("[", depth),
            open("]", depth)
        )
    };
    for (depth, model, status, what) in [
        (100, "deep-100", 200, "after 100 levels"),
        (100, "deep-100", 429, "the same again"),
        (126, "deep-126", 200, "after 126 levels (127 with the root)"),
        (127, "deep-127", 401, "after 127 (128 with the root)"),
        (10_000, "deep-1e4", 401, "after 10,000 levels"),
    ] {
        key(nested(depth, model).as_bytes(), 100_000, status, what);
    }
    assert!(matches!(
        (
            matched(
                format!(r#"{{"model": "gpt-4o-deep", "x": {}"#, open("{", 10_000)).as_bytes(),
                100_000
            ),
            matched(nested(10_000, "gpt-4o-deep").as_bytes(), 100_000)
        ),
        (true, false)
    ));
    assert_eq!(
        reserved(
            format!(r#"{{"max_tokens": 7, "x": {}"#, open("[", 10_000)).as_bytes(),
            100_000
        ),
        7
    );
    assert_eq!(
        reserved(
            format!(r#"{{"x": {}"max_tokens": 7}}"#, open("[", 10_000)).as_bytes(),
            100_000
        ),
        RES_DEFAULT
    );

    // --- Numbers: a whole number keys as its digits; any other is absent. ---
    for bad in [
        "1e400",
        "99999999999999999999999",
        "18446744073709551616",
        "-1",
        "1.5",
        "1e3",
        "1000.0",
        "007",
        "-0",
    ] {
        key(&model(bad), 100_000, 401, bad);
    }
    key(&model("42"), 100_000, 200, "42");
    key(
        &model(r#""42""#),
        100_000,
        429,
        "the string \"42\": the same digits",
    );
    key(&model("18446744073709551615"), 100_000, 200, "u64::MAX");
    for bad in [
        "1e400",
        "99999999999999999999999",
        "-1",
        "1.5",
        "1e3",
        "1000.0",
        r#""50""#,
        "null",
        "[5]",
    ] {
        assert_eq!(
            reserved(&max_tokens(bad), 100_000),
            RES_DEFAULT,
            "max_tokens {bad}"
        );
    }
    assert_eq!(reserved(&max_tokens("50"), 100_000), 50);
    assert_eq!(
        reserved(&max_tokens("18446744073709551615"), 100_000),
        RES_LIMIT,
        "capped at the limit"
    );
    assert_eq!(
        reserved(&max_tokens("5000"), 100_000),
        RES_LIMIT,
        "capped at the limit"
    );

    // --- Invalid UTF-8 and bad escapes, in and around the field. ---
    key(
        b"{\"model\": \"u\xff\xfe\"}",
        100_000,
        200,
        "invalid UTF-8 in the value",
    );
    key(
        b"{\"model\": \"u\xff\xfe\"}",
        100_000,
        429,
        "the same bytes again",
    );
    key(
        b"{\"model\": \"u\xff\xfd\"}",
        100_000,
        200,
        "other invalid bytes",
    );
    key(
        b"{\"\xff\xfe\": \"\xc3\", \"model\": \"after-bad-utf8\"}",
        100_000,
        200,
        "after invalid UTF-8",
    );
    key(
        b"{\"model\": \"after-bad-utf8\"}",
        100_000,
        429,
        "the same model",
    );
    key(
        br#"{"x": "\q", "model": "after-bad-escape"}"#,
        100_000,
        200,
        "after a bad escape elsewhere",
    );
    key(
        br#"{"model": "after-bad-escape"}"#,
        100_000,
        429,
        "the same model",
    );
    for bad in [
        r#""bad\q""#,
        r#""bad\u12G4""#,
        r#""bad\ud800""#,
        r#""bad\udc00x""#,
        "\"bad\\\"",
    ] {
        key(&model(bad), 100_000, 401, bad);
    }
    key(
        &model(r#""gpt-4\u006f-esc""#),
        100_000,
        200,
        "an escaped model",
    );
    key(
        &model(r#""gpt-4o-esc""#),
        100_000,
        429,
        "the same model unescaped",
    );
    assert!(
        matched(b"{\"model\": \"gpt-4o\xff\xfe\"}", 100_000),
        "prefix before invalid bytes"
    );
    assert!(!matched(b"{\"model\": \"gpt-4\xff\"}", 100_000));
    assert!(
        matched(&model(r#""gpt\u002d4o""#), 100_000),
        "an escaped prefix"
    );
    assert!(
        !matched(&model(r#""gpt-4o\q""#), 100_000),
        "a bad escape: absent"
    );
    assert_eq!(
        reserved(b"{\"x\": \"\xff\\q\", \"max_tokens\": 12}", 100_000),
        12
    );
    assert_eq!(reserved(br#"{"max_tokens": 13, "x": "\q"}"#, 100_000), 13);

    // --- A key given twice: the last one, as the backend reads it. (A last one that is not a
    // string or a whole number leaves the earlier string in force, where the docs say absent:
    // reported, not asserted here.) ---
    key(
        br#"{"model": "twice-1", "model": "twice-2"}"#,
        100_000,
        200,
        "model twice",
    );
    key(
        &model(r#""twice-2""#),
        100_000,
        429,
        "the last one is the key",
    );
    key(
        &model(r#""twice-1""#),
        100_000,
        200,
        "the first one was not",
    );

    // --- A byte at a time, with a content-length or chunked (one chunk a byte). ---
    let tiny = br#"{"messages": [{"role": "user", "content": "\"model\": \"no\""}], "model": "gpt-4\u006f-tiny", "max_tokens": 21}"#;
    key(tiny, 1, 200, "a byte per write");
    key(tiny, 100_000, 429, "the same body in one piece");
    assert!(matched(tiny, 1));
    assert_eq!(reserved(tiny, 1), 21);
    let r = send_chunked(&[("x-bkey", "1")], tiny, 1);
    assert_eq!(r.status, 429, "chunked a byte a chunk: the same model");
    let r = send_chunked(&[("x-bres", "res-chunked")], tiny, 1);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("979"));
    let r = send_chunked(&[("x-bkey", "1")], &model(r#""chunked-3""#), 3);
    assert_eq!(r.status, 200);

    // --- Past max_body: a field after the bound counts as absent; the body goes whole. ---
    let pad = "p".repeat(MAX_BODY + 5000);
    let past = format!(r#"{{"pad": "{pad}", "model": "past", "max_tokens": 9}}"#);
    key(past.as_bytes(), 100_000, 401, "the model past max_body");
    key(past.as_bytes(), 1000, 401, "the same in 1,000-byte pieces");
    assert_eq!(reserved(past.as_bytes(), 1000), RES_DEFAULT);
    let within = format!(r#"{{"model": "within", "max_tokens": 9, "pad": "{pad}"}}"#);
    key(
        within.as_bytes(),
        1000,
        200,
        "the model before a body past max_body",
    );
    assert_eq!(reserved(within.as_bytes(), 1000), 9);
    let huge = format!(r#"{{"model": "huge", "pad": "{}"}}"#, "h".repeat(1 << 20));
    key(
        huge.as_bytes(),
        64 * 1024,
        200,
        "a 1 MiB body, the model first",
    );
    let r = send_chunked(&[("x-bkey", "1")], huge.as_bytes(), 4096);
    assert_eq!(r.status, 429, "the same 1 MiB body, chunked");

    // --- A body cut short: the client closes before its end. ---
    let cut = |headers: &str, body: &[u8], len: usize| {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        let head = format!(
            "POST {PATH} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{headers}content-length: {len}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        s.shutdown(Shutdown::Both).unwrap();
    };
    // Never read whole: never decided, so never counted.
    cut(
        "x-bkey: 1\r\n",
        br#"{"model": "cut", "messages": [{"role": "user", "conte"#,
        5000,
    );
    // The model read, the body not whole: not decided either (the rest could name it again).
    cut(
        "x-bkey: 1\r\n",
        br#"{"model": "cut-after", "messages": "#,
        5000,
    );
    std::thread::sleep(Duration::from_millis(200));
    key(&model(r#""cut""#), 100_000, 200, "the model of a cut body");
    key(
        &model(r#""cut-after""#),
        100_000,
        200,
        "the model of a body cut after it",
    );

    assert_alive(&envoy, || send(&[], b"{}", 100).status);
    counter(&envoy, "bkey", "key_missing", missing);
    counter(&envoy, "bkey", "failed_open", 0);
    counter(&envoy, "bres", "failed_open", 0);
}
