//! The proxy-wasm host: Envoy's callbacks in, host calls out. It reads request attributes, keeps
//! keys in shared data, and carries out what each stream's [`StreamState`] says next; nothing is
//! decided here.
#![cfg(target_arch = "wasm32")]

mod abi;

use abi::{Level, Map};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use ratelimit_core::config::{Carried, Config};
use ratelimit_core::error::{ServiceError, StoreFault};
use ratelimit_core::key::{Attributes, Seed};
use ratelimit_core::metrics::{self, Counter, Gauge};
use ratelimit_core::rls;
use ratelimit_core::runtime::{self, Next, StreamState};
use ratelimit_core::runtime::{Background, Runtime};
use ratelimit_core::store::{Store, StoreError, CREATE_CAS};
use ratelimit_core::table::{self, SlotKind};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

static LOGGER: abi::HostLogger = abi::HostLogger;

proxy_wasm::main! {{
    // The SDK's own logger and panic hook unwrap host statuses; ours never panic.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace); // Envoy filters by its own `wasm` log level.
    std::panic::set_hook(Box::new(|info| {
        let _ = abi::log(Level::Critical, &format!("panic: {info}"));
    }));
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> {
        Box::new(Root { id, served: None, draining: Vec::new() })
    });
}}

/// Proxy-wasm shared data as a [`Store`]: slot `n` is the key `<prefix>b4/<n>` (buckets, named
/// by their layout: [`table::BUCKET_NAME`]) or `<prefix>l/<n>` (sliding logs).
struct SharedData {
    prefix: String,
    /// The key being built, reused so the hot path does not allocate.
    key: RefCell<String>,
    /// While a request's headers are decided ([`SharedData::one_hook`]): the last slot read
    /// and what it held, so that a slot read twice in the hook (a lease rule's peek, then its
    /// decision) costs one `get_shared_data`. Any write forgets it: a compare-and-swap with a
    /// CAS read here fails if another worker wrote since, and the retry reads afresh.
    last: RefCell<Option<LastRead>>,
    caching: Cell<bool>,
}

/// A slot's value and CAS as read from shared data.
struct LastRead {
    slot: u64,
    value: Option<Vec<u8>>,
    cas: Option<u32>,
}

/// Ends [`SharedData::one_hook`] when dropped.
struct OneHook<'a>(&'a SharedData);

impl Drop for OneHook<'_> {
    fn drop(&mut self) {
        self.0.caching.set(false);
        self.0.last.borrow_mut().take();
    }
}

impl SharedData {
    fn new(prefix: String) -> Self {
        SharedData {
            key: RefCell::new(String::with_capacity(prefix.len() + 24)),
            prefix,
            last: RefCell::new(None),
            caching: Cell::new(false),
        }
    }

    /// Remembers the last read until the guard is dropped (the end of one host callback).
    fn one_hook(&self) -> OneHook<'_> {
        self.caching.set(true);
        OneHook(self)
    }

    fn with_key<T>(&self, slot: u64, f: impl FnOnce(&str) -> T) -> T {
        let mut key = self.key.borrow_mut();
        key.clear();
        key.push_str(&self.prefix);
        // Health and share keys share the logs' names (`l/` past every log), as shared data
        // holds them.
        let (kind, n) = match SlotKind::of(slot) {
            SlotKind::Bucket => (table::BUCKET_NAME, slot),
            SlotKind::Log | SlotKind::Health | SlotKind::Share => {
                ("l/", slot - SlotKind::Log.first())
            }
        };
        key.push_str(kind);
        key.push_str(itoa::Buffer::new().format(n));
        f(&key)
    }
}

impl Store for SharedData {
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, StoreError> {
        // Taken out while `f` runs: nothing borrowed across it.
        let last = self.last.borrow_mut().take();
        let read = match last {
            Some(last) if last.slot == slot => last,
            _ => {
                let (value, cas) = self.with_key(slot, abi::get_shared).map_err(|s| {
                    StoreError::Unavailable(StoreFault::Host {
                        call: "get_shared_data",
                        status: s.0,
                    })
                })?;
                LastRead { slot, value, cas }
            }
        };
        let result = f(read.value.as_deref(), read.cas);
        if self.caching.get() {
            *self.last.borrow_mut() = Some(read);
        }
        Ok(result)
    }

    /// The value read (or remembered from the hook's last read) is the one `f` changes: no copy
    /// of it within the VM.
    fn update_value<T>(
        &self,
        slot: u64,
        attempts: u32,
        mut f: impl FnMut(&mut Vec<u8>, bool) -> (T, bool),
    ) -> Result<T, StoreError> {
        for _ in 0..attempts {
            let last = self.last.borrow_mut().take();
            let (value, cas) = match last {
                Some(last) if last.slot == slot => (last.value, last.cas),
                _ => self.with_key(slot, abi::get_shared).map_err(|s| {
                    StoreError::Unavailable(StoreFault::Host {
                        call: "get_shared_data",
                        status: s.0,
                    })
                })?,
            };
            let present = value.is_some();
            let mut value = value.unwrap_or_default();
            let (result, write) = f(&mut value, present);
            if !write {
                // Unchanged: still the value read, with its CAS.
                if self.caching.get() {
                    let value = present.then_some(value);
                    *self.last.borrow_mut() = Some(LastRead { slot, value, cas });
                }
                return Ok(result);
            }
            match self.write(slot, &value, cas.unwrap_or(CREATE_CAS)) {
                Ok(()) => return Ok(result),
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Conflict)
    }

    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.last.borrow_mut().take();
        match self.with_key(slot, |key| abi::set_shared(key, value, cas)) {
            Ok(()) => Ok(()),
            Err(abi::CAS_MISMATCH) => Err(StoreError::Conflict),
            Err(s) => Err(StoreError::Unavailable(StoreFault::Host {
                call: "set_shared_data",
                status: s.0,
            })),
        }
    }
}

/// A runtime, its background work on this VM, the ids of its metrics in Envoy and the
/// plugin's name.
struct Served {
    rt: Runtime<SharedData>,
    /// Borrowed only for a moment, never across a host call that may call back.
    background: RefCell<Background>,
    ids: MetricIds,
    plugin: String,
}

/// The Envoy ids of a runtime's metrics.
#[derive(Default)]
struct MetricIds {
    /// Per rule, per [`Counter::ALL`].
    counters: Vec<Vec<Option<u32>>>,
    /// Per [`Gauge::ALL`].
    gauges: Vec<Option<u32>>,
    /// Per rule: the elastic factor's gauge, for elastic rules.
    elastic: Vec<Option<u32>>,
    /// Per rule: a shared rule's gauges.
    share: Vec<Option<ShareIds>>,
    /// Per rule, for a shared rule that lets requests wait: per band, the counters of
    /// [`metrics::BandCounter::ALL`].
    share_waits: Vec<Option<Vec<[Option<u32>; 3]>>>,
}

/// A shared rule's gauges: its capacity's, and per band those of
/// [`metrics::SHARE_BAND_GAUGES`].
type ShareIds = (Option<u32>, Vec<[Option<u32>; 3]>);

impl MetricIds {
    fn define(plugin: &str, config: &Config) -> MetricIds {
        MetricIds {
            counters: config
                .rules
                .iter()
                .map(|rule| {
                    Counter::ALL
                        .iter()
                        .map(|c| {
                            abi::define_counter(&metrics::name(plugin, Some(&rule.name), c.name()))
                                .ok()
                        })
                        .collect()
                })
                .collect(),
            gauges: Gauge::ALL
                .iter()
                .map(|g| abi::define_gauge(&metrics::name(plugin, None, g.name())).ok())
                .collect(),
            elastic: config
                .rules
                .iter()
                .map(|rule| {
                    let name = metrics::name(plugin, Some(&rule.name), metrics::ELASTIC_FACTOR);
                    rule.elastic.and_then(|_| abi::define_gauge(&name).ok())
                })
                .collect(),
            share: config
                .rules
                .iter()
                .map(|rule| {
                    let sh = rule.share.as_ref()?;
                    let capacity = metrics::name(plugin, Some(&rule.name), metrics::SHARE_CAPACITY);
                    let bands = sh
                        .bands
                        .iter()
                        .map(|band| {
                            metrics::SHARE_BAND_GAUGES.map(|g| {
                                abi::define_gauge(&metrics::band_name(plugin, &rule.name, band, g))
                                    .ok()
                            })
                        })
                        .collect();
                    Some((abi::define_gauge(&capacity).ok(), bands))
                })
                .collect(),
            share_waits: config
                .rules
                .iter()
                .map(|rule| {
                    let sh = rule.share.as_ref().filter(|sh| sh.max_wait_ms > 0)?;
                    let bands = sh.bands.iter().map(|band| {
                        metrics::BandCounter::ALL.map(|c| {
                            abi::define_counter(&metrics::band_name(
                                plugin,
                                &rule.name,
                                band,
                                c.name(),
                            ))
                            .ok()
                        })
                    });
                    Some(bands.collect())
                })
                .collect(),
        }
    }

    /// Sets the shared rules' gauges from their records.
    fn publish_share(&self, rt: &Runtime<SharedData>, now: u64) {
        if self.share.iter().all(Option::is_none) {
            return;
        }
        for g in rt.share_gauges(now) {
            let Some(Some((capacity, bands))) = self.share.get(g.rule) else {
                continue;
            };
            if let Some(id) = capacity {
                let _ = abi::gauge_set(*id, g.capacity);
            }
            for (ids, band) in bands.iter().zip(&g.bands) {
                for (id, value) in ids.iter().zip(band.values()) {
                    if let Some(id) = id {
                        let _ = abi::gauge_set(*id, value);
                    }
                }
            }
        }
    }

    /// Sets the elastic rules' factor gauges.
    fn publish_elastic(&self, rt: &Runtime<SharedData>) {
        for (rule, percent) in rt.elastic_factors() {
            if let Some(Some(id)) = self.elastic.get(rule) {
                let _ = abi::gauge_set(*id, percent);
            }
        }
    }

    /// Publishes what the runtime counted since the last call.
    fn publish(&self, rt: &Runtime<SharedData>) {
        rt.metrics().drain(
            |rule, counter, n| {
                let id = self
                    .counters
                    .get(rule)
                    .and_then(|c| c.get(counter as usize));
                if let Some(Some(id)) = id {
                    let _ = abi::increment(*id, n);
                }
            },
            |gauge, delta| self.gauge(gauge, delta),
        );
        rt.metrics().drain_bands(|rule, band, counter, n| {
            let id = self
                .share_waits
                .get(rule)
                .and_then(Option::as_ref)
                .and_then(|bands| bands.get(usize::from(band)))
                .and_then(|ids| ids.get(counter as usize));
            if let Some(Some(id)) = id {
                let _ = abi::increment(*id, n);
            }
        });
    }

    fn gauge(&self, gauge: Gauge, delta: i64) {
        if let Some(Some(id)) = self.gauges.get(gauge as usize) {
            let _ = abi::gauge_add(*id, delta);
        }
    }
}

fn property_string(path: &[u8]) -> Option<String> {
    abi::property(path)
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
}

/// Reads the table's hash seed from shared data, creating it if this is the first VM.
fn shared_seed(key: &str) -> Result<Seed, String> {
    for _ in 0..ratelimit_core::store::MAX_ATTEMPTS {
        let (bytes, _) =
            abi::get_shared(key).map_err(|s| format!("reading the seed: status {}", s.0))?;
        if let Some(seed) = bytes.as_deref().and_then(Seed::from_bytes) {
            return Ok(seed);
        }
        let fresh = Seed::random();
        // CREATE_CAS: if another VM created the seed meanwhile, this write is refused and the
        // loop reads theirs.
        match abi::set_shared(key, &fresh.to_bytes(), CREATE_CAS) {
            Ok(()) => return Ok(fresh),
            Err(abi::CAS_MISMATCH) => continue,
            Err(s) => return Err(format!("writing the seed: status {}", s.0)),
        }
    }
    Err("could not agree on a seed with the other VMs".into())
}

/// A request held by delay mode on this worker, with its stream's state (its context gets it
/// back at its next hook: the root cannot reach a context).
struct Waiting {
    context: u32,
    until_ms: u64,
    state: StreamState,
    served: Rc<Served>,
}

thread_local! {
    /// The value of the response field being added, reused by every response of this worker.
    static FIELD_VALUE: RefCell<String> = const { RefCell::new(String::new()) };
    /// Requests held by delay mode on this worker.
    static WAITING: RefCell<Vec<Waiting>> = const { RefCell::new(Vec::new()) };
    /// Released requests' states, until their contexts take them back.
    static RELEASED: RefCell<Vec<(u32, StreamState)>> = const { RefCell::new(Vec::new()) };
}

/// Takes a stream's state back from the waiting or released lists.
/// Whether the stream of `context` waits for its turn (on this worker's waiting list).
fn waiting(context: u32) -> bool {
    WAITING.with(|w| w.borrow().iter().any(|x| x.context == context))
}

fn take_back(context: u32) -> Option<StreamState> {
    let waiting = WAITING.with(|w| {
        let mut w = w.borrow_mut();
        let i = w.iter().position(|x| x.context == context)?;
        Some(w.swap_remove(i).state)
    });
    waiting.or_else(|| {
        RELEASED.with(|r| {
            let mut r = r.borrow_mut();
            let i = r.iter().position(|(c, _)| *c == context)?;
            Some(r.swap_remove(i).1)
        })
    })
}

/// The root context of one VM (one per worker thread, plus the main thread's).
struct Root {
    id: u32,
    served: Option<Rc<Served>>,
    /// Earlier configurations with background calls still in flight: their answers are theirs.
    draining: Vec<Rc<Served>>,
}

impl Root {
    fn build(&self, size: usize) -> Result<(Runtime<SharedData>, String), String> {
        let bytes = abi::plugin_configuration(size)
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
        let root_id = property_string(b"plugin_root_id\0").unwrap_or_default();
        let plugin = property_string(b"plugin_name\0")
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into());
        let prefix = format!("wasm-ratelimit/{root_id}/");
        let seed = match config.key_seed {
            Some(seed) => seed,
            None => shared_seed(&format!("{prefix}seed"))?,
        };
        Ok((Runtime::new(config, seed, SharedData::new(prefix)), plugin))
    }

    fn publish_metrics(&self) {
        if let Some(s) = &self.served {
            s.ids.publish(&s.rt);
        }
    }

    /// Lets held requests whose turn has come go on.
    fn release_due(&self, now: u64) {
        // Only the streams that are due move (a tick comes every millisecond while requests
        // are held, most of them with nothing due).
        let due: Vec<Waiting> = WAITING.with(|w| {
            let mut w = w.borrow_mut();
            let mut due = Vec::new();
            let mut i = 0;
            while let Some(x) = w.get(i) {
                if x.until_ms <= now {
                    due.push(w.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            due
        });
        for mut w in due {
            // A stream whose client went away is refused here (BadArgument).
            if abi::set_effective_context(w.context).is_err() {
                w.state.complete(&w.served.rt, now_ms, report_usage);
                continue;
            }
            match w.state.wake(&w.served.rt, now) {
                // Still waiting in a shared rule's line: held again.
                Next::Hold { until_ms } => {
                    w.until_ms = until_ms;
                    WAITING.with(|list| list.borrow_mut().push(w));
                    continue;
                }
                Next::Reply(reply) => {
                    let headers: Vec<(&str, &str)> = reply.headers().collect();
                    let sent =
                        abi::send_local_response(reply.status, &headers, reply.body.as_bytes());
                    if sent.is_err() {
                        let _ = abi::resume_request();
                    }
                }
                _ => {
                    let _ = abi::resume_request();
                }
            }
            RELEASED.with(|r| r.borrow_mut().push((w.context, w.state)));
        }
        let _ = abi::set_effective_context(self.id);
    }

    /// Does the background work of a tick at `now`.
    fn background(served: &Served, now: u64) {
        let rt = &served.rt;
        let next_release = WAITING.with(|w| w.borrow().iter().map(|x| x.until_ms).min());
        let mut background = served.background.borrow_mut();
        let work = background.tick(rt, now, next_release);
        if let Some(period) = work.period_ms {
            let _ = abi::set_tick_period(period);
        }
        for call in work.calls {
            let token = abi::grpc_call(
                call.cluster,
                rls::SERVICE,
                rls::METHOD,
                &call.message,
                call.timeout_ms,
            );
            background.started(rt, call, token.ok().map(u64::from));
        }
        drop(background);
        if work.elastic {
            served.ids.publish_elastic(rt);
        }
        if work.metrics {
            served.ids.publish_share(rt, now);
            served.ids.publish(rt);
        }
    }
}

impl Context for Root {
    /// Answers to async global flushes.
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let id = u64::from(token);
        let owner = self
            .served
            .iter()
            .chain(&self.draining)
            .find(|s| s.background.borrow().awaits(id));
        if let Some(served) = owner {
            let answer = read_answer(status, size);
            served
                .background
                .borrow_mut()
                .answered(&served.rt, id, answer, now_ms());
        }
        self.draining
            .retain(|s| s.background.borrow().in_flight() > 0);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        self.publish_metrics();
        match self.build(size) {
            Ok((runtime, plugin)) => {
                log::info!(
                    "configured {} rule(s), capacity {} keys",
                    runtime.rules().len(),
                    runtime.capacity()
                );
                let background = Background::new(&runtime);
                let tick = background.period_ms();
                let ids = MetricIds::define(&plugin, runtime.config());
                ids.publish_elastic(&runtime);
                if let Ok(id) = abi::define_gauge(&metrics::name(&plugin, None, metrics::CAPACITY))
                {
                    let _ = abi::gauge_set(id, runtime.capacity() as u64);
                }
                let previous = self.served.replace(Rc::new(Served {
                    rt: runtime,
                    background: RefCell::new(background),
                    ids,
                    plugin,
                }));
                if let Some(previous) = previous {
                    if previous.background.borrow().in_flight() > 0 {
                        self.draining.push(previous);
                    }
                }
                if let Err(s) = abi::set_tick_period(tick) {
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
        let now = now_ms();
        self.release_due(now);
        if let Some(served) = &self.served {
            Root::background(served, now);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            id: context_id,
            served: self.served.clone(),
            state: StreamState::default(),
            away: false,
            request_read: 0,
            reading: None,
            #[cfg(feature = "panic-trigger")]
            panic_at_end: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Reads the answer being delivered to `on_grpc_call_response`.
fn read_answer(status: u32, size: usize) -> Result<rls::Response, ServiceError> {
    if status != 0 {
        // Also how a timeout arrives (DEADLINE_EXCEEDED) and an unreachable service.
        return Err(ServiceError::Grpc(abi::grpc_status().unwrap_or(status)));
    }
    let body = abi::grpc_response(size)
        .map_err(|s| ServiceError::NotRead(s.0))?
        .unwrap_or_default();
    rls::decode_response(&body).map_err(|_| ServiceError::Undecodable)
}

/// The request as the pipeline sees it: attributes read from the host, each at most once.
#[derive(Default)]
struct WasmHost {
    source: Option<Option<String>>,
    path: Option<Option<String>>,
    method: Option<Option<String>>,
    authority: Option<Option<String>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    /// Properties read (metadata, filter state), by encoded path.
    properties: Vec<(String, Option<Vec<u8>>)>,
    /// A request body follows the headers.
    body_follows: bool,
}

impl WasmHost {
    /// A property by its encoded path (each part followed by a NUL), read at most once.
    fn property(&mut self, encoded: String) -> Option<&[u8]> {
        let i = match self.properties.iter().position(|(p, _)| *p == encoded) {
            Some(i) => i,
            None => {
                let value = abi::property(encoded.as_bytes()).ok().flatten();
                self.properties.push((encoded, value));
                self.properties.len() - 1
            }
        };
        self.properties.get(i).and_then(|(_, v)| v.as_deref())
    }
}

/// A metadata value as proxy-wasm gives it: a string as its bytes, a number as 8 bytes of a
/// little-endian f64. A string of digits (what a limit is) is never read as a number: the 8
/// bytes of a whole number from 1 are not all ASCII digits.
fn metadata_value(bytes: &[u8]) -> Carried<'_> {
    let digits = bytes
        .iter()
        .all(|b| b.is_ascii_digit() || b.is_ascii_whitespace());
    match <[u8; 8]>::try_from(bytes) {
        Ok(number) if !digits => Carried::Number(f64::from_le_bytes(number)),
        _ => Carried::Text(bytes),
    }
}

fn request_header_string(name: &str) -> Option<String> {
    abi::header(Map::RequestHeaders, name)
        .ok()
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

impl Attributes for WasmHost {
    fn source_address(&mut self) -> Option<&str> {
        self.source
            .get_or_insert_with(|| property_string(b"source\0address\0"))
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
                let value = abi::header(Map::RequestHeaders, name).ok().flatten();
                self.headers.push((name.to_string(), value));
                self.headers.len() - 1
            }
        };
        self.headers.get(i).and_then(|(_, v)| v.as_deref())
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<Carried<'_>> {
        let path = format!("metadata\0filter_metadata\0{namespace}\0{key}\0");
        self.property(path).map(metadata_value)
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.property(format!("filter_state\0{key}\0"))
    }
}

impl runtime::Host for WasmHost {
    fn now_ms(&mut self) -> u64 {
        abi::now_ms().unwrap_or(0)
    }

    fn held(&self) -> usize {
        WAITING.with(|w| w.borrow().len())
    }

    fn log(&mut self, level: log::Level, line: std::fmt::Arguments<'_>) {
        log::log!(level, "{line}");
    }

    fn body_follows(&self) -> bool {
        self.body_follows
    }

    fn body_field_read(&mut self, name: &str, value: &[u8]) {
        let _ = abi::set_property(&format!("wasm_ratelimit.{name}"), value);
    }
}

/// Hands a rule's usage to the access log: the filter state `wasm.wasm_ratelimit.RULE`.
fn report_usage(rule: &str, usage: u64) {
    let mut key = String::with_capacity(15 + rule.len());
    key.push_str("wasm_ratelimit.");
    key.push_str(rule);
    let _ = abi::set_property(&key, itoa::Buffer::new().format(usage).as_bytes());
}

fn now_ms() -> u64 {
    abi::now_ms().unwrap_or(0)
}

/// One HTTP stream.
struct Request {
    id: u32,
    served: Option<Rc<Served>>,
    state: StreamState,
    /// The state is on the waiting or released list (held by delay mode).
    away: bool,
    /// Request body bytes read so far (Envoy holds the body while the filter reads it).
    request_read: usize,
    /// What the headers' hook read of the request, kept while its body is read: the rules
    /// waiting for body fields read the headers then, and proxy-wasm no longer shows them.
    reading: Option<Box<WasmHost>>,
    /// Test builds: panic when the stream ends (`x-test-panic: end`).
    #[cfg(feature = "panic-trigger")]
    panic_at_end: bool,
}

impl Request {
    /// The stream's state, taken back first if it was held.
    fn state(&mut self) -> &mut StreamState {
        if self.away {
            if let Some(st) = take_back(self.id) {
                self.state = st;
                self.away = false;
            }
        }
        &mut self.state
    }

    /// The stream ended, however it ended: a request still held was abandoned by its client,
    /// and what its rules are still owed is settled (once: a second call finds nothing).
    fn end(&mut self) {
        #[cfg(feature = "panic-trigger")]
        if self.panic_at_end {
            #[allow(clippy::panic)]
            {
                panic!("x-test-panic: end");
            }
        }
        if let Some(served) = self.served.clone() {
            self.state().complete(&served.rt, now_ms, report_usage);
        }
    }

    /// The request's body has `body_size` bytes so far (`end`: all of it): read while
    /// reservations are sized from it, held while the request waits (for the services, its
    /// turn or its body: going on from a body hook would let it go), passed on otherwise.
    fn request_data(&mut self, body_size: usize, end: bool) -> Action {
        let Some(served) = self.served.clone() else {
            return Action::Continue;
        };
        if self.away && waiting(self.id) {
            return Action::Pause; // held for its turn: its body waits with it
        }
        let state = self.state();
        if !state.reads_request_body() {
            return match state.stops_request() {
                true => Action::Pause,
                false => Action::Continue,
            };
        }
        // While the filter pauses, Envoy keeps the body: `body_size` is all of it so far.
        let start = self.request_read.min(body_size);
        let piece = match body_size > start {
            true => abi::body(abi::Body::Request, start, body_size - start)
                .ok()
                .flatten()
                .unwrap_or_default(),
            false => Vec::new(),
        };
        self.request_read = body_size;
        let mut host = self.reading.take().unwrap_or_default();
        let next = self.state.request_body(&served.rt, &mut *host, &piece, end);
        if self.state.reads_request_body() {
            self.reading = Some(host);
        }
        self.carry_out(&served, next, true)
    }

    /// Does what the stream's state says next. `in_headers`: from the request-headers hook,
    /// where going on is returning `Continue`; from a later event it is resuming.
    fn carry_out(&mut self, served: &Rc<Served>, mut next: Next, in_headers: bool) -> Action {
        let rt = &served.rt;
        loop {
            next = match next {
                Next::Call {
                    rule,
                    message,
                    timeout_ms,
                } => {
                    let started = match rt.global_of(rule) {
                        Some(g) => abi::grpc_call(
                            &g.cluster,
                            rls::SERVICE,
                            rls::METHOD,
                            &message,
                            timeout_ms,
                        )
                        .map(u64::from)
                        .map_err(|s| ServiceError::NotSent {
                            cluster: g.cluster.clone(),
                            status: s.0.to_string(),
                        }),
                        None => Err(ServiceError::NotGlobal),
                    };
                    self.state.started(rt, &mut WasmHost::default(), started)
                }
                Next::Hold { until_ms } => {
                    let state = std::mem::take(&mut self.state);
                    WAITING.with(|w| {
                        w.borrow_mut().push(Waiting {
                            context: self.id,
                            until_ms,
                            state,
                            served: served.clone(),
                        })
                    });
                    self.away = true;
                    if let Some(period) = served.background.borrow_mut().hold(until_ms, now_ms()) {
                        let _ = abi::set_tick_period(period);
                    }
                    return Action::Pause;
                }
                Next::Continue => {
                    if !in_headers {
                        let _ = abi::resume_request();
                    }
                    return Action::Continue;
                }
                Next::Wait => return Action::Pause,
                Next::Reply(reply) => {
                    let headers: Vec<(&str, &str)> = reply.headers().collect();
                    return match abi::send_local_response(
                        reply.status,
                        &headers,
                        reply.body.as_bytes(),
                    ) {
                        Ok(()) => Action::Pause,
                        Err(s) => {
                            log::warn!("could not send the limited reply (status {})", s.0);
                            if !in_headers {
                                let _ = abi::resume_request();
                            }
                            Action::Continue
                        }
                    };
                }
            };
        }
    }
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        // Settled at `on_log` already, unless Envoy logged nothing: then here.
        self.end();
        true
    }

    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let Some(served) = self.served.clone() else {
            return;
        };
        let answer = read_answer(status, size);
        let next = self.state.call_answer(
            &served.rt,
            &mut WasmHost::default(),
            u64::from(token),
            answer,
        );
        self.carry_out(&served, next, false);
    }
}

impl HttpContext for Request {
    fn on_log(&mut self) {
        // Before the access log (on_done comes after it): what is settled here is logged.
        self.end();
    }

    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Test builds only: a way to kill the VM on purpose and watch what Envoy does.
        #[cfg(feature = "panic-trigger")]
        match abi::header(Map::RequestHeaders, "x-test-panic")
            .ok()
            .flatten()
            .as_deref()
        {
            Some(b"end") => self.panic_at_end = true, // when the stream ends, before settling
            #[allow(clippy::panic)]
            Some(_) => panic!("x-test-panic"),
            None => {}
        }
        let Some(served) = self.served.clone() else {
            return Action::Continue;
        };
        let mut host = WasmHost {
            body_follows: !end_of_stream,
            ..WasmHost::default()
        };
        // An allowed operator call is answered here: neither limited nor counted.
        if let Some(answer) = served.rt.operator_route(&mut host, &served.plugin) {
            return operator_reply(&answer);
        }
        let next = {
            let _once = served.rt.store().one_hook();
            self.state.request_headers(&served.rt, &mut host)
        };
        if self.state.reads_request_body() {
            // proxy-wasm cannot stop the headers and still see the body (a paused request's
            // body is held from the filter too): the headers go on, the body is held until
            // the request is decided.
            self.reading = Some(Box::new(host));
            return Action::Continue;
        }
        self.carry_out(&served, next, true)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.request_data(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // The body ended: nothing more to read.
        self.request_data(self.request_read, true)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(served) = self.served.clone() else {
            return Action::Continue;
        };
        let state = self.state();
        FIELD_VALUE.with(|buf| {
            let Ok(mut buf) = buf.try_borrow_mut() else {
                return;
            };
            let mut fields = HostFields::of(Map::ResponseHeaders);
            state.response_headers(
                &served.rt,
                &mut fields,
                || abi::now_ms().unwrap_or(0),
                &mut buf,
                |name, value, append| {
                    let _ = if append {
                        abi::add_header(Map::ResponseHeaders, name, value)
                    } else {
                        abi::replace_header(Map::ResponseHeaders, name, value)
                    };
                },
                report_usage,
            );
        });
        if end_of_stream {
            // No body follows (HEAD, 204): the body hook is not called.
            state.response_body(&served.rt, 0, None, true, now_ms, report_usage);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Called with each chunk as it passes (this filter never buffers the body).
        let Some(served) = self.served.clone() else {
            return Action::Continue;
        };
        let state = self.state();
        if !state.counts_body() {
            return Action::Continue;
        }
        let bytes = match state.scans_body() {
            true => abi::body(abi::Body::Response, 0, body_size).ok().flatten(),
            false => None,
        };
        state.response_body(
            &served.rt,
            body_size as u64,
            bytes.as_deref(),
            end_of_stream,
            now_ms,
            report_usage,
        );
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if let Some(served) = self.served.clone() {
            let mut fields = HostFields::of(Map::ResponseTrailers);
            self.state()
                .response_trailers(&served.rt, &mut fields, now_ms, report_usage);
        }
        Action::Continue
    }
}

/// Sends an operator call's answer.
fn operator_reply(answer: &runtime::OperatorAnswer) -> Action {
    let headers = [
        ("content-type", "application/json"),
        ("cache-control", "no-store"),
    ];
    let mut body = String::with_capacity(answer.body.len() + 1);
    body.push_str(&answer.body);
    body.push('\n');
    match abi::send_local_response(answer.status, &headers, body.as_bytes()) {
        Ok(()) => Action::Pause,
        Err(s) => {
            log::warn!(
                "could not send the operator route's answer (status {})",
                s.0
            );
            Action::Continue
        }
    }
}

/// A response's header fields or trailers, read from the host one at a time; the provider's
/// fields, read whole, from every line of the map, fetched once.
struct HostFields {
    map: Map,
    value: Option<Vec<u8>>,
    /// The map's lines ([`abi::header_map`]), from the first field read whole until a field is
    /// taken out: proxy-wasm gives a field's first line only, or every line of the map (one
    /// call, measured cheaper than the three field reads it replaces).
    lines: Option<Vec<u8>>,
}

impl HostFields {
    fn of(map: Map) -> HostFields {
        HostFields {
            map,
            value: None,
            lines: None,
        }
    }
}

impl runtime::Response for HostFields {
    fn field(&mut self, name: &str) -> Option<&[u8]> {
        self.value = abi::header(self.map, name).ok().flatten();
        self.value.as_deref()
    }

    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8])) {
        let map = self.map;
        let lines = self
            .lines
            .get_or_insert_with(|| abi::header_map(map).ok().flatten().unwrap_or_default());
        abi::header_pairs(lines)
            .filter(|(n, _)| *n == name.as_bytes())
            .for_each(|(_, v)| line(v));
    }

    fn remove(&mut self, name: &str) {
        self.lines = None;
        let _ = abi::remove_header(self.map, name);
    }
}
