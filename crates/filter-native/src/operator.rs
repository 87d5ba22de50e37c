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
use ratelimit_core::runtime::operator_http::{json, Params};
use ratelimit_core::runtime::{OperatorAnswer, OperatorCall, Runtime};
use ratelimit_core::store::ProcessStore;
use std::collections::HashMap;
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

/// An admin request's answer: status and JSON body, the same JSON the wasm build's operator
/// route answers ([`Runtime::answer`]); this adds the plugin lookup and the method check.
fn answer(method: &[u8], path: &[u8], now_ms: u64) -> (u32, String) {
    let path = String::from_utf8_lossy(path);
    let (endpoint, query) = path.split_once('?').unwrap_or((&path, ""));
    let Some(call) = endpoint
        .strip_prefix("/ratelimit/")
        .and_then(OperatorCall::named)
    else {
        return error(404, &format!("no endpoint {endpoint}"));
    };
    let want = call.method();
    if method != want.as_bytes() {
        return error(405, &format!("{endpoint} takes {want} only"));
    }
    let Some(plugin) = Params::parse(query).get("plugin").map(str::to_string) else {
        return error(
            400,
            "plugin= (the filter's filter_name) and rule= are required",
        );
    };
    let Some(rt) = runtime_of(&plugin) else {
        return error(
            404,
            &format!(
                "no live configuration of plugin {} (live: {})",
                json(&plugin),
                plugins().join(", ")
            ),
        );
    };
    let log = |level, line: std::fmt::Arguments<'_>| {
        envoy_dm_abi::log(crate::level(level), &line.to_string());
    };
    let a = rt.answer(call, &plugin, query, now_ms, "envoy admin", log);
    (u32::from(a.status), a.body)
}

fn error(status: u16, why: &str) -> (u32, String) {
    let a = OperatorAnswer::error(status, why);
    (u32::from(a.status), a.body)
}
