//! The Envoy dynamic-module host: the same core as the wasm build, at native speed. Each stream
//! is the core's [`StreamState`]; this crate reads attributes, carries out what it says next
//! and keeps the handles (schedulers, the held request's turn).
//!
//! Envoy loads `libwasm_ratelimit.so` and hands each filter configuration the same JSON plugin
//! configuration; `filter_name` plays the part of the wasm plugin's name (metric labels, table
//! namespace). One [`FilterConfig`] serves every worker at once; keys live in one process-global
//! [`ProcessStore`] per `filter_name`, exact across workers and kept across reloads; the
//! module's bootstrap extension ([`operator`]) lets an operator look at and reset one key
//! through Envoy's admin port. Held
//! requests and periodic work (metrics, async flushes) are driven by one module thread
//! ([`timer`]) through Envoy's schedulers. The hooks, and all the `unsafe`, are in
//! [`envoy_dm_abi`].

mod operator;
mod timer;

use envoy_dm_abi::hooks::{self, Chunks, HttpFilter, HttpFilterConfig};
use envoy_dm_abi::{
    self as abi, BodyStatus, BodyType, ConfigHandle, ConfigScheduler, HeadersStatus, LogLevel,
    Stream, TrailersStatus,
};
use ratelimit_core::config::{Carried, Config, FailureMode};
use ratelimit_core::error::ServiceError;
use ratelimit_core::key::{Attributes, Seed};
use ratelimit_core::metrics::{self, Counter, Gauge};
use ratelimit_core::rls;
use ratelimit_core::runtime::{self, Next, Reply, StreamState};
use ratelimit_core::runtime::{Background, Runtime};
use ratelimit_core::store::ProcessStore;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

/// The configuration-level event: publish metrics, flush async global rules.
const EVENT_TICK: u64 = 1;
/// The stream-level event: a held request's turn has come.
const EVENT_RELEASE: u64 = 1;
/// `response code details` of a limited reply, as Envoy's access log shows them.
const DETAILS: &str = "rate_limited";

/// Panics caught in hooks since the last publication (any configuration).
static PANICS: AtomicU64 = AtomicU64::new(0);

/// Counts a panic a hook caught; the configurations publish the count.
fn panicked() {
    PANICS.fetch_add(1, Ordering::Relaxed);
}

// The hooks would abort Envoy on a panic instead of catching it.
#[cfg(all(panic = "abort", not(target_arch = "wasm32")))]
compile_error!(
    "the dynamic module must be built with panic = \"unwind\": `make build-native` (cargo build --profile native -p filter-native)"
);

envoy_dm_abi::export_http_filter!(crate::FilterConfig);
envoy_dm_abi::export_bootstrap!(crate::operator::Operator);

/// A `log` backend writing through Envoy's `dynamic_modules` logger.
struct EnvoyLogger;
static LOGGER: EnvoyLogger = EnvoyLogger;

fn level(l: log::Level) -> LogLevel {
    match l {
        log::Level::Trace => LogLevel::Trace,
        log::Level::Debug => LogLevel::Debug,
        log::Level::Info => LogLevel::Info,
        log::Level::Warn => LogLevel::Warn,
        log::Level::Error => LogLevel::Error,
    }
}

impl log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        abi::log_enabled(level(metadata.level()))
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            abi::log(level(record.level()), &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// One table per `filter_name`, for the life of the process: a reload of the same filter keeps
/// its counters. A new capacity, or a configured `key_seed` other than the table's, gets a new
/// table (the old one goes with the last configuration using it).
fn table(name: &str, buckets: u32, configured: Option<Seed>) -> (Seed, Arc<ProcessStore>) {
    type Table = (Seed, Arc<ProcessStore>);
    static TABLES: OnceLock<Mutex<HashMap<String, Table>>> = OnceLock::new();
    let mut tables = TABLES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match tables.get(name) {
        Some((seed, store))
            if store.buckets() == buckets && configured.is_none_or(|c| c == *seed) =>
        {
            (*seed, store.clone())
        }
        _ => {
            let seed = configured.unwrap_or_else(Seed::random);
            let entry = (seed, Arc::new(ProcessStore::new(buckets)));
            tables.insert(name.to_string(), entry.clone());
            entry
        }
    }
}

/// The Envoy ids of a configuration's metrics: one labelled metric per counter and gauge,
/// `wasm_ratelimit.<counter>{plugin, rule}` and `wasm_ratelimit.<gauge>{plugin}`.
#[derive(Default)]
struct MetricIds {
    counters: Vec<Option<usize>>,
    gauges: Vec<Option<usize>>,
    panics: Option<usize>,
    /// `wasm_ratelimit.elastic_factor_percent{plugin, rule}`.
    elastic: Option<usize>,
    /// `wasm_ratelimit.capacity{plugin}`.
    capacity: Option<usize>,
    /// `wasm_ratelimit.share_capacity{plugin, rule}`.
    share_capacity: Option<usize>,
    /// `wasm_ratelimit.share_…{plugin, rule, band}` ([`metrics::SHARE_BAND_GAUGES`]).
    share_bands: [Option<usize>; 3],
    /// `wasm_ratelimit.share_band_…{plugin, rule, band}` ([`metrics::BandCounter`]).
    share_band_counters: [Option<usize>; 3],
}

impl MetricIds {
    fn define(h: &ConfigHandle) -> MetricIds {
        let name = |m: &str| format!("wasm_ratelimit.{m}");
        MetricIds {
            counters: Counter::ALL
                .iter()
                .map(|c| h.define_counter(&name(c.name()), &["plugin", "rule"]))
                .collect(),
            gauges: Gauge::ALL
                .iter()
                .map(|g| h.define_gauge(&name(g.name()), &["plugin"]))
                .collect(),
            panics: h.define_counter(&name("panics"), &["plugin"]),
            elastic: h.define_gauge(&name(metrics::ELASTIC_FACTOR), &["plugin", "rule"]),
            capacity: h.define_gauge(&name(metrics::CAPACITY), &["plugin"]),
            share_capacity: h.define_gauge(&name(metrics::SHARE_CAPACITY), &["plugin", "rule"]),
            share_bands: metrics::SHARE_BAND_GAUGES
                .map(|g| h.define_gauge(&name(g), &["plugin", "rule", "band"])),
            share_band_counters: metrics::BandCounter::ALL
                .map(|c| h.define_counter(&name(c.name()), &["plugin", "rule", "band"])),
        }
    }

    /// Makes every series appear at 0, as the wasm build's metrics do: Envoy creates a labelled
    /// metric the first time it is touched.
    fn touch(
        &self,
        h: &ConfigHandle,
        plugin: &str,
        rules: &[ratelimit_core::config::Rule],
        capacity: u64,
    ) {
        if let Some(id) = self.capacity {
            h.set_gauge(id, &[plugin], capacity);
        }
        for id in self.counters.iter().flatten() {
            for rule in rules {
                h.increment_counter(*id, &[plugin, &rule.name], 0);
            }
        }
        for id in self.gauges.iter().flatten() {
            h.gauge_add(*id, &[plugin], 0);
        }
        if let Some(id) = self.panics {
            h.increment_counter(id, &[plugin], 0);
        }
        for id in self.share_band_counters.iter().flatten() {
            for rule in rules {
                let Some(sh) = rule.share.as_ref().filter(|sh| sh.max_wait_ms > 0) else {
                    continue;
                };
                for band in &sh.bands {
                    h.increment_counter(*id, &[plugin, &rule.name, band], 0);
                }
            }
        }
        if let Some(id) = self.elastic {
            for rule in rules.iter().filter(|r| r.elastic.is_some()) {
                h.set_gauge(
                    id,
                    &[plugin, &rule.name],
                    u64::from(ratelimit_core::elastic::BASE / 10),
                );
            }
        }
    }
}

/// One filter configuration: shared by every worker.
pub struct FilterConfig {
    handle: ConfigHandle,
    plugin: String,
    /// Also reachable by the admin endpoints ([`operator`]), as long as this configuration lives.
    rt: Arc<operator::Rt>,
    ids: MetricIds,
    /// Drives [`FilterConfig::scheduled`]; stops when dropped.
    _ticker: Option<timer::Ticker>,
    /// The periodic work and its calls in flight (main thread).
    background: Mutex<Background>,
}

impl FilterConfig {
    /// Builds a configuration; `None` (logged) refuses it.
    fn new(handle: ConfigHandle, name: &[u8], json: &[u8]) -> Option<FilterConfig> {
        let plugin = match std::str::from_utf8(name) {
            Ok("") | Err(_) => "default".to_string(),
            Ok(n) => n.to_string(),
        };
        let config = match Config::parse(json) {
            Ok(c) => c,
            Err(e) => {
                log::error!("invalid configuration: {e}");
                return None;
            }
        };
        let buckets = ratelimit_core::table::buckets_for(config.capacity);
        let (seed, store) = table(&plugin, buckets, config.key_seed);
        let rt = Arc::new(Runtime::new(config, seed, store));
        operator::register(&plugin, &rt);
        log::info!(
            "configured {} rule(s), capacity {} keys",
            rt.rules().len(),
            rt.capacity()
        );
        if rt.config().operator.is_some() {
            log::info!(
                "the \"operator\" block is for the wasm build and is ignored here: the native build serves the operator's calls on Envoy's admin port (/ratelimit/key, /ratelimit/top, /ratelimit/reset)"
            );
        }
        let background = Background::new(&rt);
        let period = Duration::from_millis(u64::from(background.period_ms()));
        let ticker = handle
            .scheduler()
            .map(|s: ConfigScheduler| timer::Ticker::start(s, EVENT_TICK, period));
        let ids = MetricIds::define(&handle);
        ids.touch(&handle, &plugin, rt.rules(), rt.capacity() as u64);
        Some(FilterConfig {
            ids,
            handle,
            plugin,
            rt,
            _ticker: ticker,
            background: Mutex::new(background),
        })
    }

    /// The periodic event (main thread): publish the counters, flush async global rules.
    fn scheduled(&self, event: u64) {
        if event != EVENT_TICK {
            return;
        }
        let mut background = self.background();
        // The ticker's period never changes: requests are held by their own schedulers.
        let work = background.tick(&self.rt, now_ms(), None);
        for call in work.calls {
            let frame = rls::grpc_frame(&call.message);
            let id = self
                .handle
                .start_grpc(call.cluster, rls::PATH, &frame, call.timeout_ms)
                .ok();
            background.started(&self.rt, call, id);
        }
        drop(background);
        if work.elastic {
            let rules = self.rt.rules();
            for (rule, percent) in self.rt.elastic_factors() {
                if let (Some(id), Some(r)) = (self.ids.elastic, rules.get(rule)) {
                    self.handle.set_gauge(id, &[&self.plugin, &r.name], percent);
                }
            }
        }
        if work.metrics {
            self.publish_share();
            self.publish();
        }
    }

    /// Sets the shared rules' gauges from their records (main thread).
    fn publish_share(&self) {
        let rules = self.rt.rules();
        if rules.iter().all(|r| r.share.is_none()) {
            return;
        }
        for g in self.rt.share_gauges(now_ms()) {
            let Some(r) = rules.get(g.rule) else {
                continue;
            };
            if let Some(id) = self.ids.share_capacity {
                self.handle
                    .set_gauge(id, &[&self.plugin, &r.name], g.capacity);
            }
            for band in &g.bands {
                for (id, value) in self.ids.share_bands.iter().zip(band.values()) {
                    if let Some(id) = id {
                        self.handle
                            .set_gauge(*id, &[&self.plugin, &r.name, &band.band], value);
                    }
                }
            }
        }
    }

    /// Publishes the counters (main thread).
    fn publish(&self) {
        let rules = self.rt.rules();
        self.rt.metrics().drain(
            |rule, counter, n| {
                let (Some(Some(id)), Some(r)) =
                    (self.ids.counters.get(counter as usize), rules.get(rule))
                else {
                    return;
                };
                self.handle
                    .increment_counter(*id, &[&self.plugin, &r.name], n);
            },
            |gauge, delta| {
                if let Some(Some(id)) = self.ids.gauges.get(gauge as usize) {
                    self.handle.gauge_add(*id, &[&self.plugin], delta);
                }
            },
        );
        self.rt.metrics().drain_bands(|rule, band, counter, n| {
            let (Some(Some(id)), Some(r)) = (
                self.ids.share_band_counters.get(counter as usize),
                rules.get(rule),
            ) else {
                return;
            };
            let Some(band) = r
                .share
                .as_ref()
                .and_then(|sh| sh.bands.get(usize::from(band)))
            else {
                return;
            };
            self.handle
                .increment_counter(*id, &[&self.plugin, &r.name, band], n);
        });
        let panics = PANICS.swap(0, Ordering::Relaxed);
        if let (Some(id), true) = (self.ids.panics, panics > 0) {
            self.handle.increment_counter(id, &[&self.plugin], panics);
        }
    }

    /// The background work, locked (main thread).
    fn background(&self) -> std::sync::MutexGuard<'_, Background> {
        self.background
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The wall clock, ms since the epoch (Envoy's clock is the same).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| {
            (d.as_secs().saturating_mul(1000)).saturating_add(u64::from(d.subsec_millis()))
        })
}

thread_local! {
    /// The value of the response field being added, reused by every response of this worker.
    static FIELD_VALUE: RefCell<String> = const { RefCell::new(String::new()) };
    /// Requests held by delay mode on this worker.
    static HELD: Cell<usize> = const { Cell::new(0) };
    /// A response body piece being scanned, gathered from Envoy's slices (reused by every
    /// response of this worker): the scanner's fast path needs an event's line in one piece,
    /// and Envoy hands a piece over in slices of about 4 KB.
    static BODY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// The metadata keys limits are read from whose value was last a string, not a number, on
    /// this worker: (namespace, key, is a string).
    static METADATA_TEXT: RefCell<Vec<(String, String, bool)>> = const { RefCell::new(Vec::new()) };
}

/// The request as the pipeline sees it, for one hook. Each attribute is read from Envoy at most
/// once per hook (every rule keyed by client address asks for `source.address`).
struct NativeHost<'a, 'hook> {
    stream: &'a Stream<'hook>,
    /// A request body follows the headers.
    body_follows: bool,
    source: Option<Option<&'a str>>,
    client: Option<Option<&'a str>>,
    path: Option<Option<&'a str>>,
    method: Option<Option<&'a str>>,
    authority: Option<Option<&'a str>>,
}

impl<'a, 'hook> NativeHost<'a, 'hook> {
    fn new(stream: &'a Stream<'hook>) -> Self {
        NativeHost {
            stream,
            body_follows: false,
            source: None,
            client: None,
            path: None,
            method: None,
            authority: None,
        }
    }
}

impl<'a> NativeHost<'a, '_> {
    /// `source.address`, lent by Envoy for the hook.
    fn source(&mut self) -> Option<&'a str> {
        let s = self.stream;
        *self
            .source
            .get_or_insert_with(|| abi::text(s.source_address()?))
    }
}

impl Attributes for NativeHost<'_, '_> {
    fn source_address(&mut self) -> Option<&str> {
        self.source()
    }
    fn path(&mut self) -> Option<&str> {
        let s = self.stream;
        *self.path.get_or_insert_with(|| abi::text(s.path()?))
    }
    fn method(&mut self) -> Option<&str> {
        let s = self.stream;
        *self.method.get_or_insert_with(|| abi::text(s.method()?))
    }
    fn authority(&mut self) -> Option<&str> {
        let s = self.stream;
        *self
            .authority
            .get_or_insert_with(|| abi::text(s.authority()?))
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.stream.request_header(name)
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<Carried<'_>> {
        // Envoy reads a number and a string by separate calls, and logs an error when the
        // value is of the other type: ask first for the type this key last had on this worker.
        let string_first = METADATA_TEXT.with(|m| {
            m.borrow()
                .iter()
                .find(|(n, k, _)| n == namespace && k == key)
                .is_some_and(|(_, _, text)| *text)
        });
        let s = self.stream;
        let number = || s.metadata_number(namespace, key).map(Carried::Number);
        let text = || s.metadata_string(namespace, key).map(Carried::Text);
        let found = if string_first {
            text().or_else(number)
        } else {
            number().or_else(text)
        };
        if let Some(v) = &found {
            let is_text = matches!(v, Carried::Text(_));
            if is_text != string_first {
                METADATA_TEXT.with(|m| {
                    let mut m = m.borrow_mut();
                    let full = m.len() >= 64; // a handful of configured sources: a short list
                    match m.iter_mut().find(|(n, k, _)| n == namespace && k == key) {
                        Some(entry) => entry.2 = is_text,
                        None if !full => m.push((namespace.to_string(), key.to_string(), is_text)),
                        None => {}
                    }
                });
            }
        }
        found
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.stream.filter_state(key)
    }
    fn client_address(&mut self) -> Option<&str> {
        if self.client.is_none() {
            self.client = Some(self.source().map(ratelimit_core::key::strip_port));
        }
        self.client.flatten()
    }
}

impl runtime::Host for NativeHost<'_, '_> {
    fn now_ms(&mut self) -> u64 {
        now_ms()
    }

    fn held(&self) -> usize {
        HELD.with(Cell::get)
    }

    fn log(&mut self, level: log::Level, line: std::fmt::Arguments<'_>) {
        log::log!(level, "{line}");
    }

    fn body_follows(&self) -> bool {
        self.body_follows
    }

    fn body_field_read(&mut self, name: &str, value: &[u8]) {
        // Most values (a model's name) are ASCII, which is UTF-8: a cheaper check than
        // `from_utf8`'s for a short value.
        if self
            .stream
            .set_metadata_ascii(METADATA_NAMESPACE, name, value)
        {
            return;
        }
        self.stream
            .set_metadata_string(METADATA_NAMESPACE, name, &String::from_utf8_lossy(value));
    }

    // Envoy answers for a request's headers and addresses in its body's hooks too.
    fn reads_attributes_later(&self) -> bool {
        true
    }
}

/// The largest gathered body piece a worker keeps its buffer for.
const MAX_BODY_KEPT: usize = 256 * 1024;

/// The dynamic metadata namespace the usage of each rule is reported in, for access logs:
/// `%DYNAMIC_METADATA(wasm_ratelimit:RULE)%`.
const METADATA_NAMESPACE: &str = "wasm_ratelimit";

/// Hands rules' usage to the access log, as dynamic metadata of the stream.
fn reporter<'a>(s: &'a Stream<'_>) -> impl FnMut(&str, u64) + 'a {
    move |rule, usage| s.set_metadata_number(METADATA_NAMESPACE, rule, usage as f64)
}

/// One HTTP stream: its state (the core's state machine) and its turn when held.
#[derive(Default)]
pub struct Filter {
    /// Never borrowed across a call into Envoy that may call this filter back (starting a
    /// call, a local reply, continuing the request).
    state: RefCell<StreamState>,
    /// A held request's turn; dropping it cancels the release.
    turn: RefCell<Option<timer::Release>>,
    /// Test builds: panic when the stream ends (`x-test-panic: end`).
    #[cfg(feature = "panic-trigger")]
    panic_at_end: Cell<bool>,
}

impl Filter {
    fn with<T>(&self, f: impl FnOnce(&mut StreamState) -> T) -> T {
        f(&mut self.state.borrow_mut())
    }

    /// Does what the stream's state says next. `in_headers`: called from the request-headers
    /// hook, where going on is returning `Continue`; from a later event it is resuming.
    fn carry_out(
        &self,
        c: &FilterConfig,
        s: &Stream,
        mut next: Next,
        in_headers: bool,
    ) -> HeadersStatus {
        loop {
            next = match next {
                Next::Call {
                    rule,
                    message,
                    timeout_ms,
                } => {
                    let started = match c.rt.global_of(rule) {
                        Some(g) => s
                            .start_grpc(
                                &g.cluster,
                                rls::PATH,
                                &rls::grpc_frame(&message),
                                timeout_ms,
                            )
                            .map_err(|code| ServiceError::NotSent {
                                cluster: g.cluster.clone(),
                                status: format!("{code:?}"),
                            }),
                        None => Err(ServiceError::NotGlobal),
                    };
                    self.with(|st| st.started(&c.rt, &mut NativeHost::new(s), started))
                }
                Next::Hold { until_ms } => match s.scheduler() {
                    Some(scheduler) => {
                        let wait = Duration::from_millis(until_ms.saturating_sub(now_ms()));
                        *self.turn.borrow_mut() =
                            Some(timer::Release::at(scheduler, EVENT_RELEASE, wait));
                        HELD.with(|h| h.set(h.get() + 1));
                        return HeadersStatus::StopIteration;
                    }
                    // No way to come back later: let it go now (a request waiting in a
                    // shared rule's line is decided at once: admitted or refused).
                    None => self.with(|st| st.wake_now(&c.rt, now_ms())),
                },
                Next::Continue => {
                    if !in_headers {
                        s.continue_decoding();
                    }
                    return HeadersStatus::Continue;
                }
                Next::Wait => return HeadersStatus::StopIteration,
                Next::Reply(r) => {
                    reply(s, &r);
                    return HeadersStatus::StopIteration;
                }
            };
        }
    }

    /// Decides the request (or asks the services first, or reads its body first).
    fn request_headers(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> HeadersStatus {
        #[cfg(feature = "panic-trigger")]
        match s.request_header("x-test-panic") {
            Some(b"end") => self.panic_at_end.set(true),
            #[allow(clippy::panic)]
            Some(_) => panic!("x-test-panic"),
            None => {}
        }
        let mut host = NativeHost::new(s);
        host.body_follows = !end_of_stream;
        let next = self.with(|st| st.request_headers(&c.rt, &mut host));
        self.carry_out(c, s, next, true)
    }

    /// A piece of the request body: read while reservations are sized from it, held while the
    /// request waits (for the services, its turn or its body), passed on otherwise.
    fn request_body(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> BodyStatus {
        let next = self.with(|st| {
            if !st.reads_request_body() {
                return None;
            }
            let mut host = NativeHost::new(s);
            let mut next = Next::Wait;
            s.body(BodyType::ReceivedRequestBody, |chunk, _| {
                if matches!(next, Next::Wait) {
                    next = st.request_body(&c.rt, &mut host, chunk, false);
                }
            });
            if matches!(next, Next::Wait) && end_of_stream {
                next = st.request_body(&c.rt, &mut host, &[], true);
            }
            Some(next)
        });
        match self.go_on(c, s, next) {
            HeadersStatus::Continue => BodyStatus::Continue,
            HeadersStatus::StopIteration => BodyStatus::StopIterationAndBuffer,
        }
    }

    /// After a piece of the request's body (or its trailers): carries out what reading it
    /// decided (`Some`), or holds it while the request waits (for the services, its turn or
    /// its body: going on from a body hook would let it go).
    fn go_on(&self, c: &FilterConfig, s: &Stream, next: Option<Next>) -> HeadersStatus {
        match next {
            Some(next) => self.carry_out(c, s, next, true),
            None if self.with(|st| st.stops_request()) => HeadersStatus::StopIteration,
            None => HeadersStatus::Continue,
        }
    }

    /// A panic in `request_headers` was caught: `failure_mode` decides.
    fn failed(c: &FilterConfig, s: &Stream) -> HeadersStatus {
        match c.rt.config().failure_mode {
            FailureMode::Allow => HeadersStatus::Continue,
            FailureMode::Deny => {
                reply(s, &runtime::failure_reply(&c.rt.config().response));
                HeadersStatus::StopIteration
            }
        }
    }

    /// A call this stream started ended (complete, or reset).
    fn call_done(&self, c: &FilterConfig, s: &Stream, id: u64, reset: Option<u32>) {
        let next = self.with(|st| st.call_done(&c.rt, &mut NativeHost::new(s), id, reset));
        self.carry_out(c, s, next, false);
    }

    /// A held request's turn has come.
    fn scheduled(&self, c: &FilterConfig, s: &Stream, event: u64) {
        if event != EVENT_RELEASE || self.turn.borrow_mut().take().is_none() {
            return;
        }
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
        let next = self.with(|st| st.wake(&c.rt, now_ms()));
        self.carry_out(c, s, next, false);
    }

    /// Adds the rate-limit fields to an admitted request's response (charging first the
    /// usage its headers report).
    fn response_headers(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> HeadersStatus {
        FIELD_VALUE.with(|buf| {
            if let Ok(mut buf) = buf.try_borrow_mut() {
                let mut fields = Fields {
                    stream: s,
                    trailers: false,
                };
                self.with(|st| {
                    st.response_headers(
                        &c.rt,
                        &mut fields,
                        now_ms,
                        &mut buf,
                        |name, value, append| s.response_header(name, value, append),
                        reporter(s),
                    );
                    if end_of_stream {
                        // No body follows (HEAD, 204): the body hook is not called.
                        st.response_body(&c.rt, 0, None, true, now_ms, reporter(s));
                    }
                });
            }
        });
        HeadersStatus::Continue
    }

    /// The stream ends, however it ends: a request still held was abandoned by its client (its
    /// turn is cancelled), and what its rules are still owed is settled.
    fn complete(&self, c: &FilterConfig, s: &Stream) {
        #[cfg(feature = "panic-trigger")]
        if self.panic_at_end.get() {
            #[allow(clippy::panic)]
            {
                panic!("x-test-panic: end");
            }
        }
        if self.with(|st| st.complete(&c.rt, now_ms, reporter(s))) {
            drop(self.turn.borrow_mut().take()); // the turn will not be posted
            HELD.with(|h| h.set(h.get().saturating_sub(1)));
        }
    }
}

/// Sends a local reply.
fn reply(s: &Stream, reply: &Reply) {
    // No borrow of the state is held: Envoy calls back into this filter before returning.
    s.send_response(
        reply.status,
        reply.headers(),
        reply.body.as_bytes(),
        DETAILS,
    );
}

/// A response's header fields or trailers, as the pipeline reads them.
struct Fields<'a, 'hook> {
    stream: &'a Stream<'hook>,
    trailers: bool,
}

impl runtime::Response for Fields<'_, '_> {
    fn field(&mut self, name: &str) -> Option<&[u8]> {
        if self.trailers {
            self.stream.response_trailer(name)
        } else {
            self.stream.response_header_value(name)
        }
    }

    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8])) {
        if self.trailers {
            self.stream.response_trailer_lines(name, line);
        } else {
            self.stream.response_header_lines(name, line);
        }
    }

    fn remove(&mut self, name: &str) {
        if !self.trailers {
            self.stream.remove_response_header(name);
        }
    }
}

impl HttpFilterConfig for FilterConfig {
    type Filter = Filter;

    /// Panics are logged through Envoy (and still caught).
    fn program_init() -> bool {
        std::panic::set_hook(Box::new(|info| {
            abi::log(LogLevel::Critical, &format!("panic (caught): {info}"));
        }));
        let _ = log::set_logger(&LOGGER);
        log::set_max_level(log::LevelFilter::Trace);
        true
    }

    fn panicked() {
        panicked();
    }

    fn new(handle: ConfigHandle, name: &[u8], config: &[u8]) -> Option<Self> {
        FilterConfig::new(handle, name, config)
    }

    fn new_filter(&self) -> Filter {
        Filter::default()
    }

    fn scheduled(&self, event: u64) {
        FilterConfig::scheduled(self, event);
    }

    fn call_headers(&self, id: u64, fields: hooks::Fields<'_, '_>) {
        self.background().answer_headers(id, fields);
    }

    fn call_data(&self, id: u64, chunks: Chunks<'_, '_>) {
        let mut background = self.background();
        chunks.for_each(|c| background.answer_data(id, c));
    }

    fn call_done(&self, id: u64, reset: Option<u32>) {
        self.background().finished(&self.rt, id, reset, now_ms());
    }
}

impl HttpFilter for Filter {
    type Config = FilterConfig;

    fn request_headers(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> HeadersStatus {
        Filter::request_headers(self, c, s, end_of_stream)
    }

    fn request_body(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> BodyStatus {
        Filter::request_body(self, c, s, end_of_stream)
    }

    fn request_trailers(&self, c: &FilterConfig, s: &Stream) -> TrailersStatus {
        // The body ended: a request still reading it is decided now; a waiting one stays.
        let next = self.with(|st| {
            st.reads_request_body()
                .then(|| st.request_body(&c.rt, &mut NativeHost::new(s), &[], true))
        });
        match self.go_on(c, s, next) {
            HeadersStatus::Continue => TrailersStatus::Continue,
            HeadersStatus::StopIteration => TrailersStatus::StopIteration,
        }
    }

    fn request_headers_failed(c: &FilterConfig, s: &Stream) -> HeadersStatus {
        Filter::failed(c, s)
    }

    fn response_headers(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) -> HeadersStatus {
        Filter::response_headers(self, c, s, end_of_stream)
    }

    fn response_body(&self, c: &FilterConfig, s: &Stream, end_of_stream: bool) {
        self.with(|st| {
            if !st.counts_body() {
                return;
            }
            if st.scans_body() {
                BODY.with(|body| {
                    let Ok(mut body) = body.try_borrow_mut() else {
                        return;
                    };
                    body.clear();
                    let mut fed = false;
                    s.body(BodyType::ReceivedResponseBody, |slice, slices| {
                        if slices == 1 {
                            let len = slice.len() as u64;
                            st.response_body(
                                &c.rt,
                                len,
                                Some(slice),
                                end_of_stream,
                                now_ms,
                                reporter(s),
                            );
                            fed = true;
                        } else {
                            body.extend_from_slice(slice);
                        }
                    });
                    if !fed {
                        let len = body.len() as u64;
                        st.response_body(
                            &c.rt,
                            len,
                            Some(&body),
                            end_of_stream,
                            now_ms,
                            reporter(s),
                        );
                    }
                    if body.capacity() > MAX_BODY_KEPT {
                        *body = Vec::new(); // an unusually large piece: not kept
                    }
                });
            } else {
                let len = s.received_response_body() as u64;
                st.response_body(&c.rt, len, None, end_of_stream, now_ms, reporter(s));
            }
        });
    }

    fn response_trailers(&self, c: &FilterConfig, s: &Stream) {
        let mut fields = Fields {
            stream: s,
            trailers: true,
        };
        self.with(|st| st.response_trailers(&c.rt, &mut fields, now_ms, reporter(s)));
    }

    fn scheduled(&self, c: &FilterConfig, s: &Stream, event: u64) {
        Filter::scheduled(self, c, s, event);
    }

    fn call_headers(&self, _c: &FilterConfig, id: u64, fields: hooks::Fields<'_, '_>) {
        self.with(|st| st.call_headers(id, fields));
    }

    fn call_data(&self, _c: &FilterConfig, id: u64, chunks: Chunks<'_, '_>) {
        self.with(|st| chunks.for_each(|c| st.call_data(id, c)));
    }

    fn call_done(&self, c: &FilterConfig, s: &Stream, id: u64, reset: Option<u32>) {
        Filter::call_done(self, c, s, id, reset);
    }

    fn complete(&self, c: &FilterConfig, s: &Stream) {
        Filter::complete(self, c, s);
    }
}
