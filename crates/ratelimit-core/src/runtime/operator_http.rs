//! The operator's calls ([`super::operator`]) over HTTP, answered alike by both builds:
//!
//! - `key?rule=R&key=K` (GET): the key's state ([`Runtime::inspect`]);
//! - `top?rule=R&n=N` (GET): the rule's busiest keys ([`Runtime::busiest`]);
//! - `reset?rule=R&key=K` (POST): forgets the key ([`Runtime::reset`]).
//!
//! [`Runtime::answer`] turns a call into its status and JSON body; the native build serves it
//! on Envoy's admin port. The wasm build has no admin hooks, so it may serve it on a route in
//! the data path ([`Runtime::operator_route`]), configured by the top-level `operator` block:
//! only a call from an allowed network that carries the secret and the call's method is
//! answered; any other request, under the route's prefix or not, is left to the filter as any
//! request is, so a client that is not allowed learns nothing of the route.

use super::{once_a_second, Host, Runtime};
use crate::config::OperatorRoute;
use crate::key::strip_port;
use crate::runtime::{KeyState, LoggedKey, OperatorError};
use crate::store::Store;
use std::fmt::{self, Write as _};
use std::net::IpAddr;

/// The request header an operator's call carries the route's secret in.
pub const TOKEN_HEADER: &str = "x-ratelimit-operator-token";

/// The most keys `top` lists.
pub const MAX_TOP: usize = 1000;

/// One of the operator's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperatorCall {
    /// A key's state.
    Key,
    /// A rule's busiest keys.
    Top,
    /// Forget a key.
    Reset,
}

impl OperatorCall {
    /// The call named `name` (the last part of its path: `key`, `top`, `reset`).
    pub fn named(name: &str) -> Option<OperatorCall> {
        match name {
            "key" => Some(OperatorCall::Key),
            "top" => Some(OperatorCall::Top),
            "reset" => Some(OperatorCall::Reset),
            _ => None,
        }
    }

    /// The one method the call takes: `POST` for the call that changes state, else `GET`.
    pub fn method(self) -> &'static str {
        match self {
            OperatorCall::Reset => "POST",
            OperatorCall::Key | OperatorCall::Top => "GET",
        }
    }
}

/// A call's answer: an HTTP status and a JSON object (without a final newline).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperatorAnswer {
    /// 200, 400 (a bad or missing parameter), 404 (no such rule or key), 500 (the store
    /// failed).
    pub status: u16,
    /// The JSON object.
    pub body: String,
}

impl OperatorAnswer {
    /// An error's answer: `{"error": why}`.
    pub fn error(status: u16, why: &str) -> OperatorAnswer {
        OperatorAnswer {
            status,
            body: format!("{{\"error\":{}}}", json(why)),
        }
    }

    fn failed(e: &OperatorError) -> OperatorAnswer {
        let status = match e {
            OperatorError::UnknownRule(_) | OperatorError::NotOfRule { .. } => 404,
            OperatorError::Store(_) => 500,
        };
        OperatorAnswer::error(status, &e.to_string())
    }
}

impl<S: Store> Runtime<S> {
    /// Answers `call` (its method already checked) with the parameters of `query` (raw,
    /// percent-encoded). `plugin` is named in the answers; `who` and `log` go to
    /// [`Runtime::reset`].
    pub fn answer(
        &self,
        call: OperatorCall,
        plugin: &str,
        query: &str,
        now_ms: u64,
        who: &str,
        log: impl FnOnce(log::Level, fmt::Arguments<'_>),
    ) -> OperatorAnswer {
        let params = Params::parse(query);
        let Some(rule) = params.get("rule") else {
            return OperatorAnswer::error(400, "rule= is required");
        };
        // A customer's plan, for a rule whose limit each request carries.
        let plan = match params.get("limit").map(str::parse::<u32>) {
            None => None,
            Some(Ok(n)) if n >= 1 => {
                let reads = self
                    .config
                    .rules
                    .iter()
                    .find(|r| r.name == rule)
                    .is_some_and(|r| r.per_request.limit.is_some());
                if !reads {
                    return OperatorAnswer::error(
                        400,
                        "limit= is for a rule whose limit is read from the request (a customer's plan)",
                    );
                }
                Some(n)
            }
            Some(_) => {
                return OperatorAnswer::error(
                    400,
                    "limit= must be a whole number from 1 (the customer's plan)",
                )
            }
        };
        let head = format!("\"plugin\":{},\"rule\":{}", json(plugin), json(rule));
        if call == OperatorCall::Top {
            let n = match params.get("n").map(str::parse::<usize>) {
                None => 10,
                Some(Ok(n)) if (1..=MAX_TOP).contains(&n) => n,
                Some(_) => {
                    return OperatorAnswer::error(400, &format!("n= must be 1 to {MAX_TOP}"))
                }
            };
            return match self.busiest_plan(rule, n, now_ms, plan) {
                Ok(keys) => {
                    let keys: Vec<String> = keys.iter().map(figures).collect();
                    OperatorAnswer {
                        status: 200,
                        body: format!("{{{head},\"keys\":[{}]}}", keys.join(",")),
                    }
                }
                Err(e) => OperatorAnswer::failed(&e),
            };
        }
        let Some(key) = params.get("key").and_then(LoggedKey::parse) else {
            return OperatorAnswer::error(
                400,
                "key= is required: the key as the filter logs it (16 hex digits)",
            );
        };
        match call {
            OperatorCall::Key => match self.inspect_plan(rule, key, now_ms, plan) {
                // Not tracked: a clear 404, with what a request would find.
                Ok(s) => OperatorAnswer {
                    status: if s.tracked { 200 } else { 404 },
                    body: figures(&s),
                },
                Err(e) => OperatorAnswer::failed(&e),
            },
            OperatorCall::Reset | OperatorCall::Top => match self.reset(rule, key, now_ms, who, log) {
                Ok(true) => OperatorAnswer {
                    status: 200,
                    body: format!("{{{head},\"key\":\"{key}\",\"reset\":true}}"),
                },
                Ok(false) => OperatorAnswer {
                    status: 404,
                    body: format!(
                        "{{{head},\"key\":\"{key}\",\"reset\":false,\"error\":\"the rule tracks no such key: nothing to forget\"}}"
                    ),
                },
                Err(e) => OperatorAnswer::failed(&e),
            },
        }
    }

    /// The wasm build's operator route: the answer if the request is an allowed call, `None`
    /// for every other request, which the filter then decides as any other (no trace of the
    /// route in what the client gets). A request outside the route's prefix costs one
    /// comparison; without an `operator` block, nothing.
    ///
    /// Allowed: the path is the prefix followed by a call's name, the method is the call's,
    /// `source.address` is in `allow_from`, and [`TOKEN_HEADER`] is the secret (compared in
    /// constant time). A refused call under the prefix is logged at info, at most once a second.
    /// A reset is logged and counted by [`Runtime::reset`], naming the caller's address.
    pub fn operator_route(&self, host: &mut impl Host, plugin: &str) -> Option<OperatorAnswer> {
        let route = self.config.operator.as_ref()?;
        let rest = host.path()?.strip_prefix(route.path_prefix.as_str())?;
        let rest = rest.to_string();
        self.operator_call(route, host, plugin, &rest)
    }

    /// A request under the route's prefix (`rest`: the path after it, with the query).
    #[cold]
    fn operator_call(
        &self,
        route: &OperatorRoute,
        host: &mut impl Host,
        plugin: &str,
        rest: &str,
    ) -> Option<OperatorAnswer> {
        let (name, query) = rest.split_once('?').unwrap_or((rest, ""));
        let method = host.method().unwrap_or_default().to_string();
        let source = host.source_address().unwrap_or_default().to_string();
        // Compared whatever else is wrong, so the time taken tells nothing either.
        let secret = route
            .token
            .matches(host.header(TOKEN_HEADER).unwrap_or_default());
        let from = strip_port(&source)
            .parse::<IpAddr>()
            .is_ok_and(|ip| route.allow_from.iter().any(|net| net.contains(ip)));
        let call = OperatorCall::named(name);
        let refused = match call {
            None => Some("no such call"),
            Some(c) if c.method() != method => Some("wrong method"),
            Some(_) if !from => Some("source not in allow_from"),
            Some(_) if !secret => Some("missing or wrong token"),
            Some(_) => None,
        };
        let now_ms = host.now_ms();
        if let Some(why) = refused {
            if once_a_second(&self.last_refusal_log, now_ms) {
                host.log(
                    log::Level::Info,
                    format_args!(
                        "operator route: refused {} {}{} from {source}: {why} (at most one such line a second)",
                        Visible(&method),
                        route.path_prefix,
                        Visible(name)
                    ),
                );
            }
            return None;
        }
        let who = format!("operator route from {source}");
        Some(
            self.answer(call?, plugin, query, now_ms, &who, |level, line| {
                host.log(level, line)
            }),
        )
    }
}

/// Text from a request, for a log line: anything but visible ASCII shows as `?`.
struct Visible<'a>(&'a str);

impl fmt::Display for Visible<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0.bytes() {
            f.write_char(if b.is_ascii_graphic() {
                char::from(b)
            } else {
                '?'
            })?;
        }
        Ok(())
    }
}

/// A key's figures as a JSON object.
fn figures(s: &KeyState) -> String {
    let opt = |v: Option<u64>| v.map_or("null".to_string(), |n| n.to_string());
    format!(
        "{{\"key\":\"{}\",\"tracked\":{},\"used\":{},\"remaining\":{},\"limit\":{},\"reset_ms\":{},\"retry_after_ms\":{},\"in_flight\":{},\"blocked_until_ms\":{}}}",
        s.key,
        s.tracked,
        s.used,
        s.remaining,
        s.limit,
        s.reset_ms,
        opt(s.retry_after_ms),
        opt(s.in_flight),
        opt(s.blocked_until_ms)
    )
}

/// A JSON string.
pub fn json(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A query's parameters, percent-decoded (the last of a repeated name wins).
pub struct Params(Vec<(String, String)>);

impl Params {
    /// Reads a raw query string (without `?`).
    pub fn parse(query: &str) -> Params {
        Params(
            query
                .split('&')
                .filter_map(|pair| {
                    let (k, v) = pair.split_once('=')?;
                    Some((decode(k), decode(v)))
                })
                .collect(),
        )
    }

    /// A parameter's decoded value.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `%XX` decoded (and `+` as a space); a malformed escape stays as it is.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let hex = b
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (c, hex) {
            (b'%', Some(x)) => {
                out.push(x);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::key::Seed;
    use crate::metrics::Counter;
    use crate::runtime::{Decision, Start};
    use crate::store::MemoryStore;
    use crate::testkit::FakeHost;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn runtime(operator: &str) -> Runtime<MemoryStore> {
        let json = format!(
            r#"{{"rules": [{{"name": "per-client", "key": ["header:x-api-key"],
                 "rate_limit": {{"requests_per_unit": 2, "unit": "minute"}}}}]{operator}}}"#
        );
        Runtime::new(
            Config::parse(json.as_bytes()).unwrap(),
            Seed([1, 2]),
            MemoryStore::new(),
        )
    }

    fn routed() -> Runtime<MemoryStore> {
        runtime(&format!(
            r#", "operator": {{"path_prefix": "/.ratelimit/", "allow_from": ["127.0.0.1/32", "::1/128"], "token": "{TOKEN}"}}"#
        ))
    }

    /// A call from `addr` with the right token.
    fn call(method: &str, addr: &str, path: &str) -> FakeHost {
        let mut h = FakeHost::new(addr, path).header(TOKEN_HEADER, TOKEN);
        h.req.method = Some(method.into());
        h
    }

    /// The key the filter logs for `x-api-key: alice`, after limiting her.
    fn limit_alice(rt: &Runtime<MemoryStore>) -> String {
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-api-key", "alice");
        for _ in 0..3 {
            host.logs.clear();
            let _ = rt.start(&mut host);
        }
        let line = &host.logs.first().unwrap().1;
        line.split(' ')
            .find_map(|w| w.strip_prefix("key="))
            .unwrap()
            .to_string()
    }

    fn alice_admitted(rt: &Runtime<MemoryStore>) -> bool {
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-api-key", "alice");
        match rt.start(&mut host) {
            Start::Decided(Decision::Reply(_)) => false,
            Start::Decided(_) => true,
            Start::Ask(_) => panic!("asked a service"),
        }
    }

    #[test]
    fn an_allowed_call_inspects_and_resets_a_key() {
        let rt = routed();
        let key = limit_alice(&rt);
        let mut host = call(
            "GET",
            "127.0.0.1",
            &format!("/.ratelimit/key?rule=per-client&key={key}"),
        );
        let a = rt.operator_route(&mut host, "rl").unwrap();
        assert_eq!(a.status, 200);
        assert!(
            a.body.starts_with(&format!(
                "{{\"key\":\"{key}\",\"tracked\":true,\"used\":2,\"remaining\":0,\"limit\":2,"
            )),
            "{}",
            a.body
        );

        let mut host = call(
            "POST",
            "[::1]",
            &format!("/.ratelimit/reset?rule=per-client&key={key}"),
        );
        let a = rt.operator_route(&mut host, "rl").unwrap();
        assert_eq!(
            a,
            OperatorAnswer {
                status: 200,
                body: format!(
                    "{{\"plugin\":\"rl\",\"rule\":\"per-client\",\"key\":\"{key}\",\"reset\":true}}"
                )
            }
        );
        let (level, line) = host.logs.first().unwrap();
        assert_eq!(*level, log::Level::Info);
        assert!(
            line.starts_with(&format!(
                "operator reset rule=per-client key={key} by operator route from [::1]:5555"
            )),
            "{line}"
        );
        let mut resets = 0;
        rt.metrics().drain(
            |_, c, n| resets += if c == Counter::OperatorResets { n } else { 0 },
            |_, _| {},
        );
        assert_eq!(resets, 1);
        assert!(alice_admitted(&rt));

        let mut host = call("GET", "127.0.0.1", "/.ratelimit/top?rule=per-client&n=5");
        let a = rt.operator_route(&mut host, "rl").unwrap();
        assert_eq!(a.status, 200);
        assert!(
            a.body
                .starts_with("{\"plugin\":\"rl\",\"rule\":\"per-client\",\"keys\":[{\"key\":"),
            "{}",
            a.body
        );
    }

    #[test]
    fn bad_parameters_of_an_allowed_call_are_answered() {
        let rt = routed();
        let answer = |path: &str| {
            rt.operator_route(&mut call("GET", "127.0.0.1", path), "rl")
                .unwrap()
        };
        assert_eq!(
            answer("/.ratelimit/key?key=1"),
            OperatorAnswer::error(400, "rule= is required")
        );
        assert_eq!(answer("/.ratelimit/key?rule=per-client").status, 400);
        assert_eq!(answer("/.ratelimit/top?rule=per-client&n=0").status, 400);
        assert_eq!(answer("/.ratelimit/top?rule=nope").status, 404);
        let untracked = answer("/.ratelimit/key?rule=per-client&key=1");
        assert_eq!(untracked.status, 404, "{}", untracked.body);
    }

    #[test]
    fn a_call_that_is_not_allowed_is_left_to_the_filter() {
        let rt = routed();
        let key = limit_alice(&rt);
        let reset = format!("/.ratelimit/reset?rule=per-client&key={key}");
        let token = |value: Option<&str>| {
            let mut h = call("POST", "127.0.0.1", &reset);
            h.req.headers.clear();
            match value {
                Some(v) => h.header(TOKEN_HEADER, v),
                None => h,
            }
        };
        let cases = [
            ("another source", call("POST", "127.0.0.2", &reset)),
            ("IPv6 source", call("POST", "[::2]", &reset)),
            ("wrong method", call("GET", "127.0.0.1", &reset)),
            (
                "no such call",
                call("POST", "127.0.0.1", "/.ratelimit/resets"),
            ),
            ("no token", token(None)),
            ("wrong token", token(Some(&TOKEN.replace('0', "1")))),
            ("short token", token(Some(&TOKEN[..31]))),
            ("longer token", token(Some(&format!("{TOKEN}x")))),
        ];
        for (what, mut host) in cases {
            assert_eq!(rt.operator_route(&mut host, "rl"), None, "{what}");
        }
        assert!(!alice_admitted(&rt), "the key was not reset");
        // An IPv4 client on an IPv6 socket is an IPv4 client.
        let mut mapped = call(
            "GET",
            "[::ffff:127.0.0.1]",
            "/.ratelimit/top?rule=per-client",
        );
        assert_eq!(rt.operator_route(&mut mapped, "rl").unwrap().status, 200);
    }

    #[test]
    fn refusals_are_logged_at_most_once_a_second_without_the_token() {
        let rt = routed();
        let mut first = call("POST", "127.0.0.2", "/.ratelimit/reset?rule=a&key=1");
        assert_eq!(rt.operator_route(&mut first, "rl"), None);
        assert_eq!(
            first.logs,
            vec![(
                log::Level::Info,
                "operator route: refused POST /.ratelimit/reset from 127.0.0.2:5555: source not in allow_from (at most one such line a second)".to_string()
            )]
        );
        let mut again = call("POST", "127.0.0.2", "/.ratelimit/reset?rule=a&key=1");
        again.now += 999;
        assert_eq!(rt.operator_route(&mut again, "rl"), None);
        assert!(again.logs.is_empty());
        let mut later = call("POST", "127.0.0.1", "/.ratelimit/reset?rule=a&key=1");
        later.req.headers.clear();
        later.now += 1000;
        assert_eq!(rt.operator_route(&mut later, "rl"), None);
        assert!(later.logs[0]
            .1
            .ends_with("missing or wrong token (at most one such line a second)"));
    }

    #[test]
    fn without_the_block_or_outside_the_prefix_nothing_is_read() {
        let rt = runtime("");
        let mut host = call("GET", "127.0.0.1", "/.ratelimit/top?rule=per-client");
        assert_eq!(rt.operator_route(&mut host, "rl"), None);
        assert!(host.logs.is_empty());
        let rt = routed();
        for path in ["/", "/.ratelimit", "/x/.ratelimit/top?rule=per-client"] {
            let mut host = call("GET", "127.0.0.1", path);
            assert_eq!(rt.operator_route(&mut host, "rl"), None, "{path}");
            assert!(host.logs.is_empty(), "{path}");
        }
    }

    #[test]
    fn the_secret_is_compared_whole() {
        let secret = crate::config::Secret::new(TOKEN).unwrap();
        assert!(secret.matches(TOKEN.as_bytes()));
        assert!(!secret.matches(b""));
        assert!(!secret.matches(&TOKEN.as_bytes()[..31]));
        assert!(!secret.matches(format!("{TOKEN}\0").as_bytes()));
        assert!(!secret.matches(TOKEN.to_uppercase().as_bytes()));
        assert_eq!(format!("{secret:?}"), "Secret(…)");
    }

    #[test]
    fn queries_are_percent_decoded() {
        let p = Params::parse("rule=a%2Db&key=%zz&x=1+2&rule2");
        assert_eq!(p.get("rule"), Some("a-b"));
        assert_eq!(p.get("key"), Some("%zz"));
        assert_eq!(p.get("x"), Some("1 2"));
        assert_eq!(p.get("rule2"), None);
        assert_eq!(json("a\"\\\n"), "\"a\\\"\\\\\\u000a\"");
    }
}
