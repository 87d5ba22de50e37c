//! The Envoy dynamic-module host: the same pipeline as the wasm build, at native speed.
//!
//! Envoy loads `libwasm_ratelimit.so` and hands each filter configuration the same JSON plugin
//! configuration; `filter_name` plays the part of the wasm plugin's name (metric labels, table
//! namespace). One [`FilterConfig`] serves every worker at once; keys live in one process-global
//! [`ProcessStore`] per `filter_name`, exact across workers and kept across reloads. Held
//! requests and periodic work (metrics, async flushes) are driven by one module thread
//! ([`timer`]) through Envoy's schedulers. All `unsafe` is in [`abi`].

mod abi;
mod timer;

use crate::config::{Config, FailureMode};
use crate::global::Target;
use crate::key::{Attributes, Seed};
use crate::metrics::{self, Counter, Gauge};
use crate::pipeline::{self, Admitted, Decision, Held, Pending, Reply, Start};
use crate::rls::{self, GrpcAnswer};
use crate::runtime::Runtime;
use crate::store::ProcessStore;
use abi::{ConfigHandle, ConfigScheduler, HeadersStatus, LogLevel, Stream};
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

/// Once, when Envoy loads the module: panics are logged through Envoy (and still caught).
fn program_init() {
    std::panic::set_hook(Box::new(|info| {
        abi::log(LogLevel::Critical, &format!("panic (caught): {info}"));
    }));
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace);
}

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
/// its counters. A new capacity gets a new table (the old one goes with the last configuration
/// using it).
fn table(name: &str, buckets: u32) -> (Seed, Arc<ProcessStore>) {
    type Table = (Seed, Arc<ProcessStore>);
    static TABLES: OnceLock<Mutex<HashMap<String, Table>>> = OnceLock::new();
    let mut tables = TABLES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match tables.get(name) {
        Some((seed, store)) if store.buckets() == buckets => (*seed, store.clone()),
        _ => {
            let entry = (Seed::random(), Arc::new(ProcessStore::new(buckets)));
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
        }
    }

    /// Makes every series appear at 0, as the wasm build's metrics do: Envoy creates a labelled
    /// metric the first time it is touched.
    fn touch(&self, h: &ConfigHandle, plugin: &str, rules: &[crate::config::Rule], capacity: u64) {
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
        if let Some(id) = self.elastic {
            for rule in rules.iter().filter(|r| r.elastic.is_some()) {
                h.set_gauge(
                    id,
                    &[plugin, &rule.name],
                    u64::from(crate::elastic::BASE / 10),
                );
            }
        }
    }
}

/// A configuration-level gRPC call in flight (async flush), main thread only.
struct Flushing {
    target: Target,
    answer: GrpcAnswer,
}

/// One filter configuration: shared by every worker.
pub struct FilterConfig {
    handle: ConfigHandle,
    plugin: String,
    rt: Runtime<Arc<ProcessStore>>,
    ids: MetricIds,
    /// Drives [`FilterConfig::scheduled`]; stops when dropped.
    _ticker: Option<timer::Ticker>,
    /// The period of the ticker, ms.
    tick_ms: u32,
    /// Async flushes in flight, by stream id (main thread).
    flushes: Mutex<HashMap<u64, Flushing>>,
    last_flush: AtomicU64,
    last_publish: AtomicU64,
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
        let (seed, store) = table(&plugin, crate::table::buckets_for(config.capacity));
        let rt = Runtime::new(config, seed, store);
        log::info!(
            "configured {} rule(s), capacity {} keys",
            rt.rules().len(),
            rt.capacity()
        );
        let tick_ms = [rt.flush_period(), rt.tick_period()]
            .into_iter()
            .flatten()
            .fold(metrics::PUBLISH_PERIOD_MS, u32::min);
        let ticker = handle.scheduler().map(|s: ConfigScheduler| {
            timer::Ticker::start(s, EVENT_TICK, Duration::from_millis(u64::from(tick_ms)))
        });
        let ids = MetricIds::define(&handle);
        ids.touch(&handle, &plugin, rt.rules(), rt.capacity() as u64);
        Some(FilterConfig {
            ids,
            handle,
            plugin,
            rt,
            _ticker: ticker,
            tick_ms,
            flushes: Mutex::default(),
            last_flush: AtomicU64::new(0),
            last_publish: AtomicU64::new(0),
        })
    }

    /// The periodic event (main thread): publish the counters, flush async global rules.
    fn scheduled(&self, event: u64) {
        if event != EVENT_TICK {
            return;
        }
        let now = now_ms();
        if let Some(period) = self.rt.flush_period() {
            if now >= due(&self.last_flush, u64::from(period)) {
                self.last_flush.store(now, Ordering::Relaxed);
                self.flush();
            }
        }
        if self.rt.tick_period().is_some() && self.rt.tick(now) {
            let rules = self.rt.rules();
            for (rule, percent) in self.rt.elastic_factors() {
                if let (Some(id), Some(r)) = (self.ids.elastic, rules.get(rule)) {
                    self.handle.set_gauge(id, &[&self.plugin, &r.name], percent);
                }
            }
        }
        if metrics::publish_due(self.last_publish.load(Ordering::Relaxed), now, self.tick_ms) {
            self.last_publish.store(now, Ordering::Relaxed);
            self.publish();
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
        let panics = PANICS.swap(0, Ordering::Relaxed);
        if let (Some(id), true) = (self.ids.panics, panics > 0) {
            self.handle.increment_counter(id, &[&self.plugin], panics);
        }
    }

    /// Reports async global rules' hits, one gRPC call per key (main thread).
    fn flush(&self) {
        let mut flushes = self.flushes.lock().unwrap_or_else(PoisonError::into_inner);
        for flush in self.rt.flush() {
            let Some(g) = self.rt.global_of(flush.target.rule) else {
                continue;
            };
            let frame = rls::grpc_frame(&flush.message);
            match self
                .handle
                .start_grpc(&g.cluster, rls::PATH, &frame, g.timeout_ms)
            {
                Ok(id) => {
                    flushes.insert(
                        id,
                        Flushing {
                            target: flush.target,
                            answer: GrpcAnswer::default(),
                        },
                    );
                }
                Err(_) => self.rt.global_error(flush.target.rule),
            }
        }
    }

    fn grpc_headers<'a>(&self, id: u64, fields: impl Iterator<Item = (&'a [u8], &'a [u8])>) {
        let mut flushes = self.flushes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = flushes.get_mut(&id) {
            f.answer.headers(fields);
        }
    }

    fn grpc_data<'a>(&self, id: u64, chunks: impl Iterator<Item = &'a [u8]>) {
        let mut flushes = self.flushes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = flushes.get_mut(&id) {
            chunks.for_each(|c| f.answer.data(c));
        }
    }

    /// A flush's answer (or its reset) is in.
    fn grpc_done(&self, id: u64, reset: Option<u32>) {
        let done = self
            .flushes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        if let Some(f) = done {
            let answer = match reset {
                Some(reason) => Err(format!("stream reset (reason {reason})")),
                None => f.answer.finish(),
            };
            self.rt.flushed(&f.target, answer, now_ms());
        }
    }
}

/// When a periodic job whose last run is in `last` is next due.
fn due(last: &AtomicU64, period_ms: u64) -> u64 {
    last.load(Ordering::Relaxed).saturating_add(period_ms)
}

/// The wall clock, ms since the epoch (Envoy's clock is the same).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

thread_local! {
    /// The value of the response field being added, reused by every response of this worker.
    static FIELD_VALUE: RefCell<String> = const { RefCell::new(String::new()) };
    /// Requests held by delay mode on this worker.
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// The request as the pipeline sees it, for one hook.
struct NativeHost<'a, 'hook> {
    stream: &'a Stream<'hook>,
}

fn text(bytes: Option<&[u8]>) -> Option<&str> {
    std::str::from_utf8(bytes?).ok()
}

impl Attributes for NativeHost<'_, '_> {
    fn source_address(&mut self) -> Option<&str> {
        text(self.stream.source_address())
    }
    fn path(&mut self) -> Option<&str> {
        text(self.stream.path())
    }
    fn method(&mut self) -> Option<&str> {
        text(self.stream.method())
    }
    fn authority(&mut self) -> Option<&str> {
        text(self.stream.authority())
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.stream.request_header(name)
    }
}

impl pipeline::Host for NativeHost<'_, '_> {
    fn now_ms(&mut self) -> u64 {
        now_ms()
    }

    fn held(&self) -> usize {
        HELD.with(Cell::get)
    }

    fn log(&mut self, level: log::Level, line: std::fmt::Arguments<'_>) {
        log::log!(level, "{line}");
    }
}

/// A request waiting for the services of sync global rules.
struct Asking {
    pending: Pending,
    /// (stream id, question index, the answer so far).
    calls: Vec<(u64, usize, GrpcAnswer)>,
}

/// A request held by delay mode.
struct Holding {
    held: Held,
    /// Cancels the release if the client goes first.
    release: timer::Release,
}

/// What a stream remembers between hooks.
#[derive(Default)]
struct State {
    /// What the response needs: fields to add, usage to charge, slots to give back.
    admitted: Option<Admitted>,
    /// Test builds: panic when the stream ends (`x-test-panic: end`).
    #[cfg(feature = "panic-trigger")]
    panic_at_end: bool,
    /// Boxed: only sync global rules ask, and the stream object stays small.
    asking: Option<Box<Asking>>,
    holding: Option<Holding>,
}

/// One HTTP stream.
pub struct Filter {
    config: &'static FilterConfig,
    state: RefCell<State>,
}

impl Filter {
    fn new(config: &'static FilterConfig) -> Filter {
        Filter {
            config,
            state: RefCell::default(),
        }
    }

    /// Decides the request (or asks the services first).
    fn request_headers(&self, s: &Stream) -> HeadersStatus {
        #[cfg(feature = "panic-trigger")]
        match s.request_header("x-test-panic") {
            Some(b"end") => self.state.borrow_mut().panic_at_end = true,
            #[allow(clippy::panic)]
            Some(_) => panic!("x-test-panic"),
            None => {}
        }
        let rt = &self.config.rt;
        match rt.start(&mut NativeHost { stream: s }) {
            Start::Decided(decision) => self.carry_out(s, decision),
            Start::Ask(pending) => self.ask(s, pending),
        }
    }

    /// A panic in `request_headers` was caught: `failure_mode` decides.
    fn failed(&self, s: &Stream) -> HeadersStatus {
        match self.config.rt.config().failure_mode {
            FailureMode::Allow => HeadersStatus::Continue,
            FailureMode::Deny => {
                self.reply(
                    s,
                    &pipeline::failure_reply(self.config.rt.config().response.status),
                );
                HeadersStatus::StopIteration
            }
        }
    }

    /// Sends the questions of sync global rules; a question that cannot be sent is answered
    /// with its error at once.
    fn ask(&self, s: &Stream, mut pending: Pending) -> HeadersStatus {
        let rt = &self.config.rt;
        let mut calls = Vec::new();
        let mut failed = Vec::new();
        for (i, q) in pending.questions().iter().enumerate() {
            let Some(g) = rt.global_of(q.rule) else {
                continue;
            };
            let frame = rls::grpc_frame(&q.message);
            match s.start_grpc(&g.cluster, rls::PATH, &frame, g.timeout_ms) {
                Ok(id) => calls.push((id, i, GrpcAnswer::default())),
                Err(code) => {
                    failed.push((i, format!("cannot call cluster {:?} ({code:?})", g.cluster)))
                }
            }
        }
        for (i, e) in failed {
            pending.answer(i, Err(e));
        }
        if pending.complete() {
            let decision = rt.finish(&mut NativeHost { stream: s }, pending);
            return self.carry_out(s, decision);
        }
        self.state.borrow_mut().asking = Some(Box::new(Asking { pending, calls }));
        HeadersStatus::StopIteration
    }

    fn grpc_headers<'a>(&self, id: u64, fields: impl Iterator<Item = (&'a [u8], &'a [u8])>) {
        if let Some(a) = self.state.borrow_mut().asking.as_mut() {
            if let Some((_, _, answer)) = a.calls.iter_mut().find(|(c, _, _)| *c == id) {
                answer.headers(fields);
            }
        }
    }

    fn grpc_data<'a>(&self, id: u64, chunks: impl Iterator<Item = &'a [u8]>) {
        if let Some(a) = self.state.borrow_mut().asking.as_mut() {
            if let Some((_, _, answer)) = a.calls.iter_mut().find(|(c, _, _)| *c == id) {
                chunks.for_each(|c| answer.data(c));
            }
        }
    }

    /// A call is complete (or reset): once every question has its answer, decide.
    fn grpc_done(&self, s: &Stream, id: u64, reset: Option<u32>) {
        let pending = {
            let mut state = self.state.borrow_mut();
            let Some(a) = state.asking.as_mut() else {
                return;
            };
            let Some(pos) = a.calls.iter().position(|(c, _, _)| *c == id) else {
                return;
            };
            let (_, i, answer) = a.calls.swap_remove(pos);
            let result = match reset {
                Some(reason) => Err(format!("stream reset (reason {reason})")),
                None => answer.finish(),
            };
            a.pending.answer(i, result);
            if !a.pending.complete() {
                return;
            }
            match state.asking.take() {
                Some(a) => a.pending,
                None => return,
            }
        };
        let decision = self
            .config
            .rt
            .finish(&mut NativeHost { stream: s }, pending);
        if self.carry_out(s, decision) == HeadersStatus::Continue {
            s.continue_decoding();
        }
    }

    /// Does what the pipeline decided.
    fn carry_out(&self, s: &Stream, decision: Decision) -> HeadersStatus {
        let config = self.config;
        match decision {
            Decision::Continue(admitted) => {
                self.state.borrow_mut().admitted = admitted;
                HeadersStatus::Continue
            }
            Decision::Hold {
                until_ms,
                admitted,
                held,
            } => {
                let Some(scheduler) = s.scheduler() else {
                    // No way to come back later: let it go now.
                    config.rt.release(&held);
                    self.state.borrow_mut().admitted = admitted;
                    return HeadersStatus::Continue;
                };
                let wait = Duration::from_millis(until_ms.saturating_sub(now_ms()));
                let release = timer::Release::at(scheduler, EVENT_RELEASE, wait);
                HELD.with(|h| h.set(h.get() + 1));
                let mut state = self.state.borrow_mut();
                state.admitted = admitted;
                state.holding = Some(Holding { held, release });
                HeadersStatus::StopIteration
            }
            Decision::Reply(reply) => {
                self.reply(s, &reply);
                HeadersStatus::StopIteration
            }
        }
    }

    fn reply(&self, s: &Stream, reply: &Reply) {
        // No borrow of the state is held: Envoy calls back into this filter before returning.
        s.send_response(
            reply.status,
            reply.headers(),
            reply.body.as_bytes(),
            DETAILS,
        );
    }

    /// A held request's turn has come.
    fn scheduled(&self, s: &Stream, event: u64) {
        if event != EVENT_RELEASE {
            return;
        }
        let Some(h) = self.state.borrow_mut().holding.take() else {
            return;
        };
        HELD.with(|c| c.set(c.get().saturating_sub(1)));
        self.config.rt.release(&h.held);
        s.continue_decoding();
    }

    /// Adds the rate-limit fields to an admitted request's response (charging first the
    /// usage its headers report).
    fn response_headers(&self, s: &Stream) -> HeadersStatus {
        let mut state = self.state.borrow_mut();
        let Some(admitted) = state.admitted.as_mut() else {
            return HeadersStatus::Continue;
        };
        FIELD_VALUE.with(|buf| {
            if let Ok(mut buf) = buf.try_borrow_mut() {
                let mut fields = Fields {
                    stream: s,
                    trailers: false,
                };
                // The clock only when a charge or a latency needs it.
                let now = if admitted.needs_clock() { now_ms() } else { 0 };
                self.config.rt.response_headers(
                    admitted,
                    &mut fields,
                    now,
                    &mut buf,
                    |name, value, append| s.response_header(name, value, append),
                );
            }
        });
        if !admitted.owes() {
            state.admitted = None;
        }
        HeadersStatus::Continue
    }

    /// A piece of the response body passes.
    fn response_body(&self, s: &Stream) {
        if let Some(admitted) = self.state.borrow_mut().admitted.as_mut() {
            admitted.body(s.received_response_body() as u64);
        }
    }

    /// The response trailers: the usage they report is charged.
    fn response_trailers(&self, s: &Stream) {
        if let Some(admitted) = self.state.borrow_mut().admitted.as_mut() {
            let mut fields = Fields {
                stream: s,
                trailers: true,
            };
            self.config
                .rt
                .response_trailers(admitted, &mut fields, now_ms());
        }
    }

    /// The stream ends, however it ends: a request still held was abandoned by its client, and
    /// what its rules are still owed is settled.
    fn complete(&self) {
        let (holding, admitted) = {
            let mut state = self.state.borrow_mut();
            #[cfg(feature = "panic-trigger")]
            if state.panic_at_end {
                #[allow(clippy::panic)]
                {
                    panic!("x-test-panic: end");
                }
            }
            (state.holding.take(), state.admitted.take())
        };
        if let Some(h) = holding {
            drop(h.release); // the turn will not be posted
            HELD.with(|c| c.set(c.get().saturating_sub(1)));
            self.config.rt.abandon(&h.held);
        }
        if let Some(admitted) = admitted {
            self.config.rt.settle(admitted, now_ms());
        }
    }
}

/// A response's header fields or trailers, as the pipeline reads them.
struct Fields<'a, 'hook> {
    stream: &'a Stream<'hook>,
    trailers: bool,
}

impl pipeline::Response for Fields<'_, '_> {
    fn field(&mut self, name: &str) -> Option<&[u8]> {
        if self.trailers {
            self.stream.response_trailer(name)
        } else {
            self.stream.response_header_value(name)
        }
    }
}
