//! The proxy-wasm layer: Envoy's callbacks in, host calls out. No decisions are made here; see
//! [`crate::limiter::decide`].

mod global;
mod host;

use crate::config::{self, Config, Cost, FailureMode, GlobalMode, HeaderStyle};
use crate::hash::Seed;
use crate::headers;
use crate::key::{self, Attributes};
use crate::limiter::{self, Check, Policy, Verdict};
use crate::rls;
use crate::store::{Store, StoreError, CREATE_CAS};
use crate::table;
use host::{Level, Map};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

static LOGGER: host::HostLogger = host::HostLogger;

proxy_wasm::main! {{
    // The SDK's own logger and panic hook unwrap host statuses; ours never panic.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace);
    std::panic::set_hook(Box::new(|info| {
        let _ = host::log(Level::Critical, &format!("panic: {info}"));
    }));
    let _ = LogLevel::Trace; // Envoy filters by its own `wasm` log level.
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> {
        Box::new(Root { id, runtime: None, last_publish: Cell::new(0) })
    });
}}

/// Proxy-wasm shared data as a [`Store`]: slot `n` is the key `<prefix><n>`.
struct SharedData {
    prefix: String,
    /// The key being built, reused so the hot path does not allocate or use `core::fmt`.
    key: std::cell::RefCell<String>,
}

impl SharedData {
    fn new(prefix: String) -> Self {
        SharedData {
            key: std::cell::RefCell::new(String::with_capacity(prefix.len() + 10)),
            prefix,
        }
    }

    /// Buckets are `<prefix>b/<n>`, sliding-log slots `<prefix>l/<n>`.
    fn with_key<T>(&self, slot: u64, f: impl FnOnce(&str) -> T) -> T {
        let mut key = self.key.borrow_mut();
        key.clear();
        key.push_str(&self.prefix);
        if slot >= table::LOG_SLOTS {
            key.push_str("l/");
            headers::push_u64(&mut key, slot - table::LOG_SLOTS);
        } else {
            key.push_str("b/");
            headers::push_u64(&mut key, slot);
        }
        f(&key)
    }
}

impl Store for SharedData {
    fn get(&self, slot: u64) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        self.with_key(slot, host::get_shared)
            .map_err(|s| StoreError::Unavailable(format!("get_shared_data status {}", s.0)))
    }

    fn set(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        match self.with_key(slot, |key| host::set_shared(key, value, cas)) {
            Ok(()) => Ok(()),
            Err(host::CAS_MISMATCH) => Err(StoreError::Conflict),
            Err(s) => Err(StoreError::Unavailable(format!(
                "set_shared_data status {}",
                s.0
            ))),
        }
    }
}

/// The counters of one rule, in the order of [`COUNTERS`].
#[derive(Clone, Copy)]
enum Counter {
    Allowed,
    Limited,
    FailedOpen,
    FailedClosed,
    StoreRetries,
    SlotEvictions,
    Delayed,
    ShadowLimited,
    GlobalErrors,
}

/// How often each worker publishes its counters.
const METRICS_PERIOD_MS: u32 = 1000;

/// Counter names, as they appear in the metric names.
const COUNTERS: [&str; 9] = [
    "allowed",
    "limited",
    "failed_open",
    "failed_closed",
    "store_retries",
    "slot_evictions",
    "delayed",
    "shadow_limited",
    "global_errors",
];

/// One rule's counters. A host call per increment costs ~1 µs, so requests add to `pending`
/// and the root context publishes the sums on its tick, once a second per worker.
#[derive(Default)]
struct RuleMetrics {
    ids: [Option<u32>; 9],
    pending: [Cell<u64>; 9],
}

impl RuleMetrics {
    fn add(&self, counter: Counter, n: u64) {
        if let Some(c) = self.pending.get(counter as usize) {
            c.set(c.get().saturating_add(n));
        }
    }

    fn publish(&self) {
        for (id, pending) in self.ids.iter().zip(&self.pending) {
            let n = pending.take();
            if let (Some(id), true) = (id, n > 0) {
                let _ = host::increment(*id, n);
            }
        }
    }
}

/// A rule ready to serve: its fingerprint, policy and metrics.
struct CompiledRule {
    fingerprint: u64,
    policy: Policy,
    metrics: RuleMetrics,
}

/// Everything a request needs, built once per configuration.
struct Runtime {
    config: Config,
    rules: Vec<CompiledRule>,
    seed: Seed,
    buckets: u32,
    store: SharedData,
    /// Gauge of requests held by delay mode, all workers together.
    delay_queue: Option<u32>,
    /// Gauge of table entries in use (keys tracked, expired ones included until reused).
    tracked_keys: Option<u32>,
    /// The tick period when no request is held: metrics, and async global flushes.
    base_tick_ms: u32,
    /// The shortest flush interval of the async global rules, if there are any.
    flush_ms: Option<u32>,
    /// When async global rules last flushed (ms).
    last_flush: Cell<u64>,
}

/// The metric name prefix; the README documents the names.
fn metric_name(plugin: &str, rule: &str, counter: &str) -> String {
    format!("wasm_ratelimit.{plugin}.{rule}.{counter}")
}

fn property_string(path: &[&str]) -> Option<String> {
    host::property(path)
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
}

/// Reads the table's hash seed from shared data, creating it if this is the first VM.
fn shared_seed(key: &str) -> Result<Seed, String> {
    for _ in 0..limiter::MAX_ATTEMPTS {
        let (bytes, _) =
            host::get_shared(key).map_err(|s| format!("reading the seed: status {}", s.0))?;
        if let Some(seed) = bytes.as_deref().and_then(Seed::from_bytes) {
            return Ok(seed);
        }
        let fresh = Seed::random();
        // CREATE_CAS: if another VM created the seed meanwhile, this write is refused and the
        // loop reads theirs.
        match host::set_shared(key, &fresh.to_bytes(), CREATE_CAS) {
            Ok(()) => return Ok(fresh),
            Err(host::CAS_MISMATCH) => continue,
            Err(s) => return Err(format!("writing the seed: status {}", s.0)),
        }
    }
    Err("could not agree on a seed with the other VMs".into())
}

/// The root context of one VM (one per worker thread, plus the main thread's).
struct Root {
    id: u32,
    runtime: Option<Rc<Runtime>>,
    /// When the counters were last published (ms).
    last_publish: Cell<u64>,
}

/// The most requests one worker holds in delay mode; beyond it, delay rules only admit
/// requests whose turn is now (the others get the limited reply).
const MAX_WAITING: usize = 4096;
/// The tick period while requests are held: they are released within about this much of
/// their turn.
const RELEASE_PERIOD_MS: u32 = 1;

thread_local! {
    /// Requests held by delay mode on this worker: (context id, release time ms, gauge id).
    static WAITING: RefCell<Vec<(u32, u64, Option<u32>)>> = const { RefCell::new(Vec::new()) };
}

/// Forgets a held request (released, or its client went away); true if it was held.
fn unhold(context_id: u32) -> bool {
    let removed = WAITING.with(|w| {
        let mut w = w.borrow_mut();
        w.iter()
            .position(|(id, _, _)| *id == context_id)
            .map(|i| w.swap_remove(i))
    });
    if let Some((_, _, Some(gauge))) = removed {
        let _ = host::gauge_add(gauge, -1);
    }
    removed.is_some()
}

impl Root {
    fn build(&self, size: usize) -> Result<Runtime, String> {
        let bytes = host::plugin_configuration(size)
            .map_err(|s| {
                format!(
                    "config: could not read the plugin configuration (status {})",
                    s.0
                )
            })?
            .unwrap_or_default();
        let config = Config::parse(&bytes).map_err(|e| e.to_string())?;
        // Istio sets no vm_id, so every plugin on a proxy shares one shared-data namespace:
        // keys carry the plugin's root id.
        let root_id = property_string(&["plugin_root_id"]).unwrap_or_default();
        let plugin = property_string(&["plugin_name"])
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into());
        let prefix = format!("wasm-ratelimit/{root_id}/");
        let seed = shared_seed(&format!("{prefix}seed"))?;
        let rules = config
            .rules
            .iter()
            .map(|rule| {
                let mut metrics = RuleMetrics::default();
                for (id, counter) in metrics.ids.iter_mut().zip(COUNTERS) {
                    *id = host::define_counter(&metric_name(&plugin, &rule.name, counter)).ok();
                }
                CompiledRule {
                    fingerprint: key::rule_fingerprint(
                        seed,
                        &rule.name,
                        &rule.key,
                        rule.algorithm.name(),
                    ),
                    policy: rule.policy(),
                    metrics,
                }
            })
            .collect();
        let gauge =
            |name: &str| host::define_gauge(&format!("wasm_ratelimit.{plugin}.{name}")).ok();
        let flush_ms = global::flush_period(&config.rules);
        Ok(Runtime {
            base_tick_ms: flush_ms.map_or(METRICS_PERIOD_MS, |f| f.min(METRICS_PERIOD_MS)),
            flush_ms,
            last_flush: Cell::new(0),
            delay_queue: gauge("delay_queue"),
            tracked_keys: gauge("tracked_keys"),
            buckets: table::buckets_for(config.capacity),
            config,
            rules,
            seed,
            store: SharedData::new(prefix),
        })
    }
}

impl Root {
    fn publish_metrics(&self) {
        if let Some(rt) = &self.runtime {
            for rule in &rt.rules {
                rule.metrics.publish();
            }
        }
    }
}

impl Context for Root {
    /// Answers to async global flushes.
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        if let Some(rt) = &self.runtime {
            global::on_flush_answer(rt, token, status, size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        self.publish_metrics();
        match self.build(size) {
            Ok(runtime) => {
                log::info!(
                    "configured {} rule(s), capacity {} keys",
                    runtime.config.rules.len(),
                    runtime.buckets as usize * table::WAYS
                );
                let tick = runtime.base_tick_ms;
                self.runtime = Some(Rc::new(runtime));
                if let Err(s) = host::set_tick_period(tick) {
                    log::warn!(
                        "no tick timer (status {}): metrics will not be published",
                        s.0
                    );
                }
                true
            }
            Err(e) => {
                log::error!("invalid configuration: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let now = host::now_ms().unwrap_or(0);
        let due: Vec<u32> = WAITING.with(|w| {
            w.borrow()
                .iter()
                .filter(|(_, at, _)| *at <= now)
                .map(|(id, _, _)| *id)
                .collect()
        });
        for id in due {
            unhold(id);
            // A stream whose client went away is refused here (BadArgument): nothing to do.
            if host::set_effective_context(id).is_ok() {
                let _ = host::resume_request();
            }
        }
        let _ = host::set_effective_context(self.id);
        let Some(rt) = self.runtime.clone() else {
            return;
        };
        if WAITING.with(|w| w.borrow().is_empty()) {
            let _ = host::set_tick_period(rt.base_tick_ms);
        }
        if let Some(period) = rt.flush_ms {
            if now >= rt.last_flush.get().saturating_add(u64::from(period)) {
                rt.last_flush.set(now);
                global::flush(&rt);
            }
        }
        if now
            >= self
                .last_publish
                .get()
                .saturating_add(u64::from(METRICS_PERIOD_MS))
        {
            self.last_publish.set(now);
            self.publish_metrics();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            id: context_id,
            runtime: self.runtime.clone(),
            pending: None,
            extra_headers: Vec::new(),
            response_headers: None,
            local_reply: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Request attributes read from the host, each at most once per request.
#[derive(Default)]
struct HostAttributes {
    source: Option<Option<String>>,
    path: Option<Option<String>>,
    method: Option<Option<String>>,
    authority: Option<Option<String>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

fn request_header_string(name: &str) -> Option<String> {
    host::header(Map::RequestHeaders, name)
        .ok()
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

impl Attributes for HostAttributes {
    fn source_address(&mut self) -> Option<&str> {
        self.source
            .get_or_insert_with(|| property_string(&["source", "address"]))
            .as_deref()
    }
    fn path(&mut self) -> Option<&str> {
        self.path
            .get_or_insert_with(|| request_header_string(":path"))
            .as_deref()
    }
    fn method(&mut self) -> Option<&str> {
        self.method
            .get_or_insert_with(|| request_header_string(":method"))
            .as_deref()
    }
    fn authority(&mut self) -> Option<&str> {
        self.authority
            .get_or_insert_with(|| request_header_string(":authority"))
            .as_deref()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        let i = match self.headers.iter().position(|(n, _)| n == name) {
            Some(i) => i,
            None => {
                let value = host::header(Map::RequestHeaders, name).ok().flatten();
                self.headers.push((name.to_string(), value));
                self.headers.len() - 1
            }
        };
        self.headers.get(i).and_then(|(_, v)| v.as_deref())
    }
}

/// Counts a request a rule refused (or, in shadow mode, would have) and logs its line.
fn refusal(rt: &Runtime, rule: &config::Rule, m: &RuleMetrics, hash: u64, v: &Verdict, cost: u64) {
    let counter = if rule.shadow {
        Counter::ShadowLimited
    } else {
        Counter::Limited
    };
    m.add(counter, 1);
    log_limited(rt.config.log_limited, rule, hash, v, cost);
}

/// Logs one structured line for a request a rule refused (or would have, in shadow mode). The
/// key appears only as a fingerprint: the raw value may be an API key.
fn log_limited(level: config::LogLevel, rule: &config::Rule, hash: u64, v: &Verdict, cost: u64) {
    let level = match level {
        config::LogLevel::Off => return,
        config::LogLevel::Debug => log::Level::Debug,
        config::LogLevel::Info => log::Level::Info,
        config::LogLevel::Warn => log::Level::Warn,
    };
    log::log!(
        level,
        "limited rule={} shadow={} key={:016x} cost={} limit={} window={}s remaining={} retry_after_ms={}",
        rule.name,
        rule.shadow,
        hash,
        cost,
        v.limit,
        v.window_s,
        v.remaining,
        v.retry_after_ms
    );
}

thread_local! {
    /// When this worker last logged a store failure (ms), to keep failures from flooding logs.
    static LAST_FAILURE_LOG: Cell<u64> = const { Cell::new(0) };
}

/// One HTTP stream.
struct Request {
    id: u32,
    runtime: Option<Rc<Runtime>>,
    /// Waiting for the services of sync global rules.
    pending: Option<Pending>,
    /// Headers the services asked to add to the response.
    extra_headers: Vec<(String, String)>,
    /// Headers to add to the upstream's response.
    response_headers: Option<headers::Fields>,
    /// Whether this filter sent a local reply (which passes through our response hook too).
    local_reply: bool,
}

/// A sync global rule's question to its service, and the answer once it came.
struct SyncCall {
    token: u32,
    rule: usize,
    answer: Option<Result<rls::Response, String>>,
}

/// A request between the questions to the services and the decision.
struct Pending {
    checks: Vec<Check>,
    /// For each check: the rule's index, the key's hash, and (async global rules) the
    /// descriptor to report the hits with.
    applied: Vec<(usize, u64, Option<key::Descriptor>)>,
    calls: Vec<SyncCall>,
}

/// What to do with the request once decided.
enum Next {
    Continue,
    Hold,
    Replied,
}

impl Request {
    /// Matches the rules, builds the keys, and either decides at once or asks the services of
    /// sync global rules first.
    fn limit(&mut self, rt: &Runtime) -> Action {
        let mut attrs = HostAttributes::default();
        let mut p = Pending {
            checks: Vec::new(),
            applied: Vec::new(),
            calls: Vec::new(),
        };
        for (i, (rule, compiled)) in rt.config.rules.iter().zip(&rt.rules).enumerate() {
            if !key::matches(&rule.matcher, &mut attrs) {
                continue;
            }
            let Some(hash) = key::client_key(rt.seed, compiled.fingerprint, &rule.key, &mut attrs)
            else {
                continue;
            };
            let cost = match &rule.cost {
                Cost::Fixed(n) => u64::from(*n),
                Cost::Header(name) => config::parse_cost(attrs.header(name)),
            };
            let descriptor = match &rule.global {
                Some(_) => key::descriptor_entries(&rule.name, &rule.key, &mut attrs),
                None => None,
            };
            if let (Some(g), Some(entries)) = (&rule.global, &descriptor) {
                if g.mode == GlobalMode::Sync {
                    let answer = global::ask(g, entries, cost)
                        .map(|token| (token, None))
                        .unwrap_or_else(|e| (0, Some(Err(e))));
                    p.calls.push(SyncCall {
                        token: answer.0,
                        rule: i,
                        answer: answer.1,
                    });
                    continue;
                }
            }
            let slot = if compiled.policy.uses_log() {
                table::LOG_SLOTS + hash % u64::from(rt.config.capacity.max(1))
            } else {
                u64::from(table::bucket_of(hash, rt.buckets))
            };
            let mut policy = compiled.policy;
            if let Policy::Gcra(gp) = &mut policy {
                if gp.max_delay_ms.is_some() && WAITING.with(|w| w.borrow().len()) >= MAX_WAITING {
                    gp.max_delay_ms = Some(0); // the waiting list is full: no more holding
                }
            }
            p.checks.push(Check {
                slot,
                fingerprint: table::fingerprint_of(hash),
                policy,
                cost,
                shadow: rule.shadow,
            });
            p.applied.push((i, hash, descriptor));
        }
        if p.checks.is_empty() && p.calls.is_empty() {
            return Action::Continue;
        }
        if p.calls.iter().any(|c| c.answer.is_none()) {
            self.pending = Some(p);
            return Action::Pause; // on_grpc_call_response goes on
        }
        match self.decide(rt, p) {
            Next::Continue => Action::Continue,
            Next::Hold | Next::Replied => Action::Pause,
        }
    }

    /// Decides once every service has answered: the services' verdicts first, then the local
    /// rules (counted only if the services admit the request).
    fn decide(&mut self, rt: &Runtime, p: Pending) -> Next {
        // A failing clock reads as 0, which the algorithm clamps to each key's last time.
        let now = host::now_ms().unwrap_or(0);
        let mut reported: Vec<(&str, Verdict)> = Vec::new();
        let mut refused = false;
        for call in &p.calls {
            let (Some(rule), Some(compiled)) =
                (rt.config.rules.get(call.rule), rt.rules.get(call.rule))
            else {
                continue;
            };
            let m = &compiled.metrics;
            match global::verdict(call.answer.as_ref(), &compiled.policy) {
                Ok((v, headers)) => {
                    self.extra_headers.extend(headers);
                    if v.allowed {
                        m.add(Counter::Allowed, 1);
                    } else {
                        refused |= !rule.shadow;
                        refusal(rt, rule, m, 0, &v, 1);
                    }
                    reported.push((rule.name.as_str(), v));
                }
                Err(e) => {
                    m.add(Counter::GlobalErrors, 1);
                    self.failed(rt, rule, m, now, &e);
                    refused |= rt.config.failure_mode == FailureMode::Deny && !rule.shadow;
                }
            }
        }
        let outcome = if refused || p.checks.is_empty() {
            None
        } else {
            Some(limiter::decide(
                &rt.store,
                &p.checks,
                now,
                rt.config.failure_mode,
            ))
        };
        let allowed = !refused && outcome.as_ref().is_none_or(|o| o.allowed);
        if let Some(outcome) = &outcome {
            for (((i, hash, descriptor), out), check) in
                p.applied.iter().zip(&outcome.rules).zip(&p.checks)
            {
                let (Some(rule), Some(compiled)) = (rt.config.rules.get(*i), rt.rules.get(*i))
                else {
                    continue;
                };
                let m = &compiled.metrics;
                m.add(Counter::StoreRetries, u64::from(out.retries));
                m.add(Counter::SlotEvictions, u64::from(out.evicted));
                if let (true, Some(gauge)) = (out.filled, rt.tracked_keys) {
                    let _ = host::gauge_add(gauge, 1);
                }
                if let Some(failure) = &out.failure {
                    self.failed(rt, rule, m, now, &format!("{failure:?}"));
                }
                if let Some(v) = out.verdict {
                    if !v.allowed {
                        refusal(rt, rule, m, *hash, &v, check.cost);
                    } else if allowed {
                        m.add(Counter::Allowed, 1);
                        m.add(Counter::Delayed, u64::from(v.delay_ms > 0));
                        if let (Some(g), Some(entries)) = (&rule.global, descriptor) {
                            global::count(*hash, compiled.fingerprint, g, entries, check);
                        }
                    }
                    reported.push((rule.name.as_str(), v));
                }
            }
        }

        let response = rt.config.response;
        if allowed {
            if response.on_allowed && response.headers != HeaderStyle::None {
                self.response_headers = Some(headers::rate_limit_headers(
                    response.headers,
                    &reported,
                    false,
                ));
            }
            let delay = outcome.as_ref().map_or(0, limiter::Outcome::delay_ms);
            if delay > 0 {
                WAITING.with(|w| {
                    w.borrow_mut()
                        .push((self.id, now.saturating_add(delay), rt.delay_queue))
                });
                if let Some(gauge) = rt.delay_queue {
                    let _ = host::gauge_add(gauge, 1);
                }
                let _ = host::set_tick_period(RELEASE_PERIOD_MS);
                return Next::Hold;
            }
            return Next::Continue;
        }
        let retry_after = headers::retry_after_seconds(&reported);
        let retry_after_s = retry_after.to_string();
        let body = headers::problem_body(response.status, &reported, retry_after);
        let fields = headers::rate_limit_headers(response.headers, &reported, true);
        let mut all: Vec<(&str, &str)> = Vec::with_capacity(8 + self.extra_headers.len());
        all.push(("content-type", "application/problem+json"));
        all.push(("retry-after", &retry_after_s));
        for (k, v) in fields.iter() {
            all.push((k, v));
        }
        for (k, v) in &self.extra_headers {
            all.push((k, v));
        }
        match host::send_local_response(response.status, &all, body.as_bytes()) {
            Ok(()) => {
                self.local_reply = true;
                Next::Replied
            }
            Err(s) => {
                log::warn!("could not send the limited reply (status {})", s.0);
                Next::Continue
            }
        }
    }

    /// Counts and logs (at most once a second per worker) a rule the store or the service
    /// could not decide.
    fn failed(&self, rt: &Runtime, rule: &config::Rule, m: &RuleMetrics, now: u64, why: &str) {
        match rt.config.failure_mode {
            FailureMode::Allow => m.add(Counter::FailedOpen, 1),
            FailureMode::Deny => m.add(Counter::FailedClosed, 1),
        }
        let last = LAST_FAILURE_LOG.with(Cell::get);
        if now >= last.saturating_add(1000) {
            LAST_FAILURE_LOG.with(|c| c.set(now));
            log::warn!(
                "rule {} could not be decided ({why}); failure_mode {:?} applied",
                rule.name,
                rt.config.failure_mode
            );
        }
    }
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        unhold(self.id); // the client went away while its request was held
        true
    }

    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let Some(p) = self.pending.as_mut() else {
            return;
        };
        if let Some(call) = p
            .calls
            .iter_mut()
            .find(|c| c.token == token && c.answer.is_none())
        {
            call.answer = Some(global::read_answer(status, size));
        }
        if p.calls.iter().any(|c| c.answer.is_none()) {
            return;
        }
        let (Some(p), Some(rt)) = (self.pending.take(), self.runtime.clone()) else {
            return;
        };
        if let Next::Continue = self.decide(&rt, p) {
            let _ = host::resume_request();
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // Test builds only: a way to kill the VM on purpose and watch what Envoy does.
        #[cfg(feature = "panic-trigger")]
        if host::header(Map::RequestHeaders, "x-test-panic")
            .ok()
            .flatten()
            .is_some()
        {
            #[allow(clippy::panic)]
            {
                panic!("x-test-panic");
            }
        }
        match self.runtime.clone() {
            Some(rt) => self.limit(&rt),
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.local_reply {
            return Action::Continue; // our own reply already carries the headers
        }
        for (name, value) in std::mem::take(&mut self.extra_headers) {
            let _ = host::replace_header(Map::ResponseHeaders, &name, &value);
        }
        let Some(fields) = self.response_headers.take() else {
            return Action::Continue;
        };
        for (name, value) in fields.iter() {
            // The IETF fields are lists: an upstream's own policies stay beside ours.
            let _ = if name.starts_with("ratelimit") {
                host::add_header(Map::ResponseHeaders, name, value)
            } else {
                host::replace_header(Map::ResponseHeaders, name, value)
            };
        }
        Action::Continue
    }
}
