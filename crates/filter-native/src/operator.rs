//! An operator's hands on one key, on Envoy's admin port: the module's bootstrap extension
//! registers three admin endpoints that reach each live configuration's [`Runtime`] by its
//! `filter_name`, through [`register`]'s process-global registry (weak references: a
//! configuration Envoy destroyed is gone from it).
//!
//! - `GET /ratelimit/key?plugin=P&rule=R&key=K`: the key's state ([`Runtime::inspect`]);
//! - `GET /ratelimit/top?plugin=P&rule=R&n=N`: the rule's busiest keys ([`Runtime::busiest`]);
//! - `POST /ratelimit/reset?plugin=P&rule=R&key=K`: forgets the key ([`Runtime::reset`]).
//!
//! `K` is the key as the filter logs it (`limited rule=… key=K`). Answers are JSON objects;
//! errors are `{"error": "…"}` with 400 (a bad or missing parameter), 404 (no such plugin, rule
//! or key) or 405 (a method the endpoint does not take). Everything runs on Envoy's main thread,
//! which only briefly holds each bucket's lock: the workers are never kept waiting longer.

use envoy_dm_abi::hooks::{Bootstrap, BootstrapHandle};
use ratelimit_core::runtime::{KeyState, LoggedKey, OperatorError, Runtime};
use ratelimit_core::store::ProcessStore;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

/// A configuration's runtime, as the filter holds it.
pub type Rt = Runtime<Arc<ProcessStore>>;

/// The live configurations' runtimes, by `filter_name`, newest last.
fn registry() -> &'static Mutex<HashMap<String, Vec<Weak<Rt>>>> {
    static RUNTIMES: OnceLock<Mutex<HashMap<String, Vec<Weak<Rt>>>>> = OnceLock::new();
    RUNTIMES.get_or_init(Mutex::default)
}

/// Makes a new configuration's runtime reachable by its `filter_name` (the one an operator
/// reaches is the newest still alive: during a reload, the new one).
pub fn register(plugin: &str, rt: &Arc<Rt>) {
    let mut all = registry().lock().unwrap_or_else(PoisonError::into_inner);
    all.retain(|_, v| {
        v.retain(|w| w.strong_count() > 0);
        !v.is_empty()
    });
    all.entry(plugin.to_string())
        .or_default()
        .push(Arc::downgrade(rt));
}

/// The newest live runtime of `plugin`.
fn runtime_of(plugin: &str) -> Option<Arc<Rt>> {
    let all = registry().lock().unwrap_or_else(PoisonError::into_inner);
    all.get(plugin)?.iter().rev().find_map(Weak::upgrade)
}

/// The plugins with a live configuration, sorted.
fn plugins() -> Vec<String> {
    let all = registry().lock().unwrap_or_else(PoisonError::into_inner);
    let mut names: Vec<String> = all
        .iter()
        .filter(|(_, v)| v.iter().any(|w| w.strong_count() > 0))
        .map(|(k, _)| k.clone())
        .collect();
    names.sort();
    names
}

/// The endpoints: (path, help, whether it changes state: Envoy then lets only `POST` through).
const ENDPOINTS: [(&str, &str, bool); 3] = [
    (
        "/ratelimit/key",
        "wasm-ratelimit: one key's state (plugin, rule, key as logged)",
        false,
    ),
    (
        "/ratelimit/top",
        "wasm-ratelimit: a rule's busiest keys (plugin, rule, n)",
        false,
    ),
    (
        "/ratelimit/reset",
        "wasm-ratelimit: forget one key (POST; plugin, rule, key as logged)",
        true,
    ),
];

/// The most keys `/ratelimit/top` lists.
const MAX_TOP: usize = 1000;

/// The bootstrap extension: no state of its own, the registry is the module's.
pub struct Operator;

impl Bootstrap for Operator {
    fn new(_name: &[u8], _config: &[u8]) -> Option<Operator> {
        Some(Operator)
    }

    fn server_initialized(&self, envoy: &BootstrapHandle) {
        for (path, help, mutates) in ENDPOINTS {
            if !envoy.register_admin(path, help, mutates) {
                log::warn!("could not register the admin endpoint {path}");
            }
        }
    }

    fn admin(&self, method: &[u8], path: &[u8], _body: &[u8]) -> (u32, String) {
        let (status, body) = answer(method, path, crate::now_ms());
        (status, body + "\n")
    }

    fn panicked() {
        crate::panicked();
    }
}

/// An admin request's answer: status and JSON body.
fn answer(method: &[u8], path: &[u8], now_ms: u64) -> (u32, String) {
    let path = String::from_utf8_lossy(path);
    let (endpoint, query) = path.split_once('?').unwrap_or((&path, ""));
    let params = Params::parse(query);
    let want = if endpoint == "/ratelimit/reset" {
        "POST"
    } else {
        "GET"
    };
    if method != want.as_bytes() {
        return error(405, &format!("{endpoint} takes {want} only"));
    }
    let (plugin, rule) = match (params.get("plugin"), params.get("rule")) {
        (Some(p), Some(r)) => (p, r),
        _ => {
            return error(
                400,
                "plugin= (the filter's filter_name) and rule= are required",
            )
        }
    };
    let Some(rt) = runtime_of(plugin) else {
        return error(
            404,
            &format!(
                "no live configuration of plugin {} (live: {})",
                json(plugin),
                plugins().join(", ")
            ),
        );
    };
    let head = format!("\"plugin\":{},\"rule\":{}", json(plugin), json(rule));
    if endpoint == "/ratelimit/top" {
        let n = match params.get("n").map(str::parse::<usize>) {
            None => 10,
            Some(Ok(n)) if (1..=MAX_TOP).contains(&n) => n,
            Some(_) => return error(400, &format!("n= must be 1 to {MAX_TOP}")),
        };
        return match rt.busiest(rule, n, now_ms) {
            Ok(keys) => {
                let keys: Vec<String> = keys.iter().map(figures).collect();
                (200, format!("{{{head},\"keys\":[{}]}}", keys.join(",")))
            }
            Err(e) => failed(&e),
        };
    }
    let Some(key) = params.get("key").and_then(LoggedKey::parse) else {
        return error(
            400,
            "key= is required: the key as the filter logs it (16 hex digits)",
        );
    };
    match endpoint {
        "/ratelimit/key" => match rt.inspect(rule, key, now_ms) {
            // Not tracked: a clear 404, with what a request would find.
            Ok(s) => (if s.tracked { 200 } else { 404 }, figures(&s)),
            Err(e) => failed(&e),
        },
        "/ratelimit/reset" => {
            let log = |level, line: std::fmt::Arguments<'_>| {
                envoy_dm_abi::log(crate::level(level), &line.to_string());
            };
            match rt.reset(rule, key, now_ms, "envoy admin", log) {
                Ok(true) => (200, format!("{{{head},\"key\":\"{key}\",\"reset\":true}}")),
                Ok(false) => (
                    404,
                    format!(
                        "{{{head},\"key\":\"{key}\",\"reset\":false,\"error\":\"the rule tracks no such key: nothing to forget\"}}"
                    ),
                ),
                Err(e) => failed(&e),
            }
        }
        _ => error(404, &format!("no endpoint {endpoint}")),
    }
}

/// An operator error's answer.
fn failed(e: &OperatorError) -> (u32, String) {
    let status = match e {
        OperatorError::UnknownRule(_) | OperatorError::NotOfRule { .. } => 404,
        OperatorError::Store(_) => 500,
    };
    error(status, &e.to_string())
}

fn error(status: u32, why: &str) -> (u32, String) {
    (status, format!("{{\"error\":{}}}", json(why)))
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
fn json(s: &str) -> String {
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
struct Params(HashMap<String, String>);

impl Params {
    fn parse(query: &str) -> Params {
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

    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
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
