//! Ten thousand slow clients holding state in Envoy at once, in either build: what the filter
//! keeps per held stream is bounded, a normal client still gets exact decisions quickly, and
//! everything is given back when the slow clients go.
//!
//! Three kinds of held stream, mixed (`HELD_CLIENTS`, default 10,000):
//! - body: a request whose `body:` key part the filter must read: headers and the start of the
//!   body are sent, then the client stalls (the filter holds the request and Envoy its body);
//! - delay: a `leaky_bucket` rule with `on_limit: delay` (one key per client, 1 a minute, so
//!   after a first request the second waits its turn, 60 s away);
//! - reservation: a request admitted with a reservation `true_up` against the answer's
//!   `x-usage-tokens`, to an upstream that answers only when the test says so.
//!
//! The memory bound is built from two figures, stated before the run: Envoy's own cost of the
//! same held streams, measured in an Envoy whose filter only passes requests through (Envoy's
//! `buffer` filter holds the body and delay streams there, the same upstream holds the
//! reservation streams), and what the core keeps per held stream of each kind, measured here
//! by driving the core's `StreamState` (the state both hosts keep per stream) with a counting
//! allocator. The wasm build's own heap is V8's linear memory, which Envoy's allocator does not
//! see: `/memory`'s `allocated` then covers Envoy's side (its contexts, buffers, shared data),
//! and the process's RSS is reported beside it.
//!
//! The bound on requests held by delay (4,096 per worker, `MAX_HELD`) is checked on its own
//! with one worker: 100 requests past it are refused at once, not held.
#![allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::http::{read_request, read_response, Server};
use common::{metric, Envoy, Listener};
use ratelimit_core::config::Config;
use ratelimit_core::key::Seed;
use ratelimit_core::runtime::{Next, Runtime, StreamState, MAX_HELD};
use ratelimit_core::store::MemoryStore;
use ratelimit_core::testkit::FakeHost;
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counts the bytes this test process has allocated and not freed, to measure the core.
struct Counting;

static NET_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is passed on unchanged to the system allocator; the counter is a side
// effect only.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        NET_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        NET_BYTES.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        NET_BYTES.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: f64 = 1024.0 * 1024.0;
/// The normal client's limit.
const NORMAL_LIMIT: u32 = 20;
/// What a reservation reserves, and what its answer reports.
const RESERVE: u64 = 10;
const USED: u64 = 3;
/// The start of a held body: the `user` field the key needs is not in it.
const BODY_START: &str =
    r#"{"pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"#;
const BODY_LEN: usize = 1000;

/// The configuration under test: a rule for each kind of held stream and one for the normal
/// client, each applying to its own path, in the default table (16,384 keys). Keys go to
/// buckets of four by their hash: about 0.4 % of the 4,000 delay keys land in a full bucket and
/// evict another, whose ghost makes its second request wait its turn all the same (before
/// ghosts, two such second requests went through at once in one run).
fn config() -> String {
    format!(
        r#"{{"rules": [
  {{"name": "body", "match": {{"path_prefix": "/body"}}, "key": ["body:user"],
    "rate_limit": {{"requests_per_unit": 1000000, "unit": "hour"}}}},
  {{"name": "delay", "match": {{"path_prefix": "/delay"}}, "key": ["header:x-k"],
    "algorithm": "leaky_bucket", "on_limit": "delay", "max_delay_ms": 60000, "burst": 2,
    "rate_limit": {{"requests_per_unit": 1, "unit": "minute"}}}},
  {{"name": "llm", "match": {{"path_prefix": "/llm"}}, "key": ["header:x-tenant"],
    "rate_limit": {{"requests_per_unit": 100000000, "unit": "hour"}},
    "cost": {{"response": "header:x-usage-tokens", "reserve": {RESERVE}, "true_up": true}}}},
  {{"name": "normal", "match": {{"path_prefix": "/normal"}}, "key": ["header:x-n"],
    "rate_limit": {{"requests_per_unit": {NORMAL_LIMIT}, "unit": "hour"}}}}
]}}"#
    )
}

/// The pass-through configuration of the baseline: only the normal client's rule, which no
/// held stream matches.
fn passthrough() -> String {
    format!(
        r#"{{"rules": [{{"name": "normal", "match": {{"path_prefix": "/normal"}}, "key": ["header:x-n"],
    "rate_limit": {{"requests_per_unit": {NORMAL_LIMIT}, "unit": "hour"}}}}]}}"#
    )
}

/// The kinds of held stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Body,
    Delay,
    Reservation,
}

/// Bytes the core keeps per held stream of `kind` (the `StreamState` itself and what it owns),
/// measured over 1,000 streams driven as Envoy drives them, with this process's allocator.
fn core_bytes(kind: Kind) -> u64 {
    const N: usize = 1000;
    let rt = Runtime::new(
        Config::parse(config().as_bytes()).unwrap(),
        Seed([1, 2]),
        MemoryStore::new(),
    );
    let host = |path: &str, i: usize| {
        let mut h = match kind {
            Kind::Body => FakeHost::new("10.0.0.1", path)
                .header("content-type", "application/json")
                .header("content-length", &BODY_LEN.to_string()),
            Kind::Delay => FakeHost::new("10.0.0.1", path).header("x-k", &format!("k{i}")),
            Kind::Reservation => FakeHost::new("10.0.0.1", path)
                .header("x-tenant", &format!("t{}", i % 10))
                .header("content-length", "7"),
        };
        h.body_follows = kind != Kind::Delay;
        if kind != Kind::Delay {
            h.req.method = Some("POST".into());
        }
        h
    };
    let mut states: Vec<StreamState> = Vec::with_capacity(N);
    let before = NET_BYTES.load(Ordering::SeqCst);
    for i in 0..N {
        let mut st = StreamState::default();
        match kind {
            Kind::Body => {
                let mut h = host("/body", i);
                assert!(matches!(st.request_headers(&rt, &mut h), Next::Wait));
                let next = st.request_body(&rt, &mut h, BODY_START.as_bytes(), false);
                assert!(matches!(next, Next::Wait), "{next:?}");
            }
            Kind::Delay => {
                let mut h = host("/delay", i);
                let mut first = StreamState::default();
                assert!(matches!(first.request_headers(&rt, &mut h), Next::Continue));
                let next = st.request_headers(&rt, &mut h);
                assert!(matches!(next, Next::Hold { .. }), "{next:?}");
            }
            Kind::Reservation => {
                let mut h = host("/llm", i);
                let next = st.request_headers(&rt, &mut h);
                let next = match next {
                    Next::Wait => st.request_body(&rt, &mut h, br#"{"q":1}"#, true),
                    other => other,
                };
                assert!(matches!(next, Next::Continue), "{next:?}");
            }
        }
        states.push(st);
    }
    let heap = NET_BYTES.load(Ordering::SeqCst) - before;
    drop(states);
    (heap.max(0) as u64).div_ceil(N as u64) + std::mem::size_of::<StreamState>() as u64
}

/// The soft limit on open files of this process (Envoy inherits it).
fn nofile() -> usize {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
}

/// Envoy's resident set (kB), found by its log path on its command line.
fn rss_kb(envoy: &Envoy) -> Option<u64> {
    let needle = envoy.log.display().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok());
        }
    }
    None
}

/// An upstream that accepts connections and answers nothing until [`Hold::answer_all`].
struct Hold {
    addr: SocketAddr,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    _server: Server,
}

impl Hold {
    fn start() -> Hold {
        // A deep accept queue: Envoy opens thousands of connections at once.
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&local.into()).unwrap();
        socket.listen(16384).unwrap();
        let listener: TcpListener = socket.into();
        let conns = Arc::new(Mutex::new(Vec::new()));
        let c = conns.clone();
        let server = Server::accept(listener, move |conn| c.lock().unwrap().push(conn));
        Hold {
            addr: server.addr,
            conns,
            _server: server,
        }
    }

    fn held(&self) -> usize {
        self.conns.lock().unwrap().len()
    }

    /// Answers every request held (`x-usage-tokens: USED`, then closes): how many.
    fn answer_all(&self) -> usize {
        let conns = std::mem::take(&mut *self.conns.lock().unwrap());
        let n = conns.len();
        let per = n.div_ceil(4).max(1);
        let mut conns = conns;
        let mut workers = Vec::new();
        while !conns.is_empty() {
            let part: Vec<TcpStream> = conns.drain(..per.min(conns.len())).collect();
            workers.push(std::thread::spawn(move || {
                for mut c in part {
                    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    if read_request(&mut BufReader::new(&mut c)).is_some() {
                        let _ = c.write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: 3\r\nx-usage-tokens: {USED}\r\n\
                                 connection: close\r\n\r\nok\n"
                            )
                            .as_bytes(),
                        );
                    }
                }
            }));
        }
        workers.into_iter().for_each(|w| w.join().unwrap());
        n
    }
}

/// A response's status.
fn status(c: &mut TcpStream) -> u16 {
    read_response(&mut BufReader::new(c)).unwrap().status
}

/// Whether body streams are routed to the upstream: in the wasm build a request read for its
/// body has its headers go on (only its body is held: proxy-wasm cannot stop the headers and
/// still see the body, as docs/src/how-to/body-fields.md says), so a route Envoy answers itself
/// would answer it at its headers, before any decision.
fn body_upstream() -> bool {
    common::build() == common::Build::Wasm
}

/// The bootstrap: the filter configured by `plugin_config`; `/llm` (and `/body` when
/// [`body_upstream`]) routed to `upstream` (no circuit breaker in the way), the rest answered
/// by Envoy; `buffer`: Envoy's buffer filter after the filter (the baseline, where it holds what
/// the filter would; not on `/body` routed upstream, where the upstream holds it).
fn yaml(plugin_config: &str, upstream: SocketAddr, buffer: bool) -> String {
    let listener = Listener::to(upstream);
    let yaml = common::bootstrap_with(plugin_config, &listener);
    let mut routes = String::new();
    if body_upstream() {
        routes.push_str(
            "              - match: {prefix: \"/body\"}
                route: {cluster: upstream, timeout: 120s}\n",
        );
        if buffer {
            routes.push_str(
                "                typed_per_filter_config:
                  envoy.filters.http.buffer:
                    \"@type\": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute
                    disabled: true\n",
            );
        }
    }
    routes.push_str(
        "              - match: {prefix: \"/llm\"}
                route: {cluster: upstream, timeout: 120s}
              - match: {prefix: \"/\"}
                direct_response: {status: 200, body: {inline_string: \"ok\\n\"}}\n",
    );
    let old = "              - match: {prefix: \"/\"}\n                route: {cluster: upstream, timeout: 60s}\n";
    assert!(yaml.contains(old));
    let mut yaml = yaml.replace(old, &routes).replace(
        "    connect_timeout: 1s\n",
        "    connect_timeout: 10s\n    circuit_breakers: {thresholds: [{max_connections: 1000000, \
         max_pending_requests: 1000000, max_requests: 1000000}]}\n",
    );
    if buffer {
        let router = "          - name: envoy.filters.http.router\n";
        yaml = yaml.replace(
            router,
            &format!(
                "          - name: envoy.filters.http.buffer
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 1048576
{router}"
            ),
        );
    }
    yaml
}

/// Opens `n` connections on 4 threads, `open(i)` making the i-th.
fn open_all(n: usize, open: impl Fn(usize) -> TcpStream + Send + Sync + 'static) -> Vec<TcpStream> {
    let open = Arc::new(open);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let open = open.clone();
            std::thread::spawn(move || (t..n).step_by(4).map(|i| open(i)).collect::<Vec<_>>())
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let c = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    c.set_nodelay(true).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c
}

/// A body stream: headers and the start of a body the key's field is not in, then nothing.
fn open_body(addr: SocketAddr) -> TcpStream {
    let mut c = connect(addr);
    let req = format!(
        "POST /body HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {BODY_LEN}\r\n\r\n{BODY_START}"
    );
    c.write_all(req.as_bytes()).unwrap();
    c
}

/// A delay stream of key `i`: a first request (admitted at once), then a second that waits its
/// turn. `baseline`: a request the buffer filter holds instead (its body never comes).
fn open_delay(addr: SocketAddr, i: usize, baseline: bool) -> TcpStream {
    let mut c = connect(addr);
    if baseline {
        let req = "POST /delay HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n";
        c.write_all(req.as_bytes()).unwrap();
        return c;
    }
    let req = format!("GET /delay HTTP/1.1\r\nhost: x\r\nx-k: k{i}\r\n\r\n");
    c.write_all(req.as_bytes()).unwrap();
    assert_eq!(status(&mut c), 200, "the first request of key k{i}");
    c.write_all(req.as_bytes()).unwrap();
    c
}

/// A reservation stream: a whole request, admitted, then waiting for the upstream.
fn open_reservation(addr: SocketAddr, i: usize) -> TcpStream {
    let mut c = connect(addr);
    let req = format!(
        "POST /llm HTTP/1.1\r\nhost: x\r\nx-tenant: t{}\r\ncontent-type: application/json\r\n\
         content-length: 7\r\n\r\n{{\"q\":1}}",
        i % 10
    );
    c.write_all(req.as_bytes()).unwrap();
    c
}

/// Whether a response (or a close) already came on `c`.
fn answered(c: &TcpStream) -> bool {
    c.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let r = !matches!(c.peek(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock);
    c.set_nonblocking(false).unwrap();
    r
}

/// Waits (≤ 30 s) until an Envoy stat is `n`.
fn wait_stat(envoy: &Envoy, name: &str, n: u64) {
    envoy.expect_stat(name, Duration::from_secs(30), |v| v == n);
}

/// The held streams of one run.
struct Held {
    body: Vec<TcpStream>,
    delay: Vec<TcpStream>,
    reservation: Vec<TcpStream>,
}

/// How many clients, of each kind: (body, delay, reservation). Delay stays below 4,096 so that
/// no worker can reach its bound whatever the balance.
fn mix() -> (usize, usize, usize) {
    let wanted: usize = common::env_number("HELD_CLIENTS", 10_000);
    let limit = nofile();
    // Per client: its socket here; a reservation (and a body stream, in the wasm build) also
    // the upstream's (Envoy holds as many, plus their upstream side).
    let n = wanted.min(limit.saturating_sub(1000) * 10 / 16);
    eprintln!("RLIMIT_NOFILE soft limit {limit}: {n} held clients (asked {wanted})");
    let delay = (n * 2 / 5).min(4000);
    let reservation = n * 3 / 10;
    (n - delay - reservation, delay, reservation)
}

/// Opens every held stream and waits until Envoy holds them all.
fn hold_all(envoy: &Envoy, upstream: &Hold, baseline: bool) -> Held {
    let (nb, nd, nr) = mix();
    let addr = envoy.addr;
    let started = Instant::now();
    let held = Held {
        body: open_all(nb, move |_| open_body(addr)),
        delay: open_all(nd, move |i| open_delay(addr, i, baseline)),
        reservation: open_all(nr, move |i| open_reservation(addr, i)),
    };
    let all = (nb + nd + nr) as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while envoy.stat("http.test.downstream_rq_active") != Some(all) {
        if Instant::now() > deadline {
            let mut what = String::new();
            for (kind, conns) in [
                ("body", &held.body),
                ("delay", &held.delay),
                ("reservation", &held.reservation),
            ] {
                let mut early: Vec<&TcpStream> = conns.iter().filter(|c| answered(c)).collect();
                let first = early.first_mut().map(|c| {
                    let mut b = [0u8; 300];
                    let n = c.read(&mut b).unwrap_or(0);
                    String::from_utf8_lossy(&b[..n]).into_owned()
                });
                what.push_str(&format!("{kind}: {} answered, {first:?}\n", early.len()));
            }
            panic!(
                "{:?} of {all} requests active:\n{what}{}",
                envoy.stat("http.test.downstream_rq_active"),
                envoy.log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let upstream_held = nr + if body_upstream() { nb } else { 0 };
    while upstream.held() < upstream_held {
        assert!(
            Instant::now() < deadline,
            "upstream holds {}",
            upstream.held()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "{} streams held ({nb} body, {nd} delay, {nr} reservation) in {:?}",
        nb + nd + nr,
        started.elapsed()
    );
    held
}

/// Envoy's allocated bytes once they settle (two readings 1 s apart within 1%).
fn settled_memory(envoy: &Envoy) -> u64 {
    let mut last = envoy.memory_allocated();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_secs(1));
        let now = envoy.memory_allocated();
        if now.abs_diff(last) * 100 <= last {
            return now;
        }
        last = now;
    }
    last
}

#[test]
fn ten_thousand_slow_clients_hold_bounded_memory_and_normal_clients_get_exact_decisions() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (nb, nd, nr) = mix();
    let n = nb + nd + nr;
    let core = [
        core_bytes(Kind::Body),
        core_bytes(Kind::Delay),
        core_bytes(Kind::Reservation),
    ];
    eprintln!(
        "core state per held stream (StreamState {} B inline): body {} B, delay {} B, \
         reservation {} B",
        std::mem::size_of::<StreamState>(),
        core[0],
        core[1],
        core[2]
    );

    // Baseline: Envoy's own cost of the same streams, the filter passing them through.
    let base_delta = {
        let upstream = Hold::start();
        let envoy = Envoy::start_yaml(&yaml(&passthrough(), upstream.addr, true));
        let m0 = settled_memory(&envoy);
        let held = hold_all(&envoy, &upstream, true);
        let m1 = settled_memory(&envoy);
        eprintln!(
            "baseline (pass-through filter, buffer filter holding): {:.1} MiB idle, {:.1} MiB \
             with {n} held: {:.0} B per stream; RSS {:?} kB",
            m0 as f64 / MIB,
            m1 as f64 / MIB,
            (m1 - m0) as f64 / n as f64,
            rss_kb(&envoy)
        );
        drop(held.body);
        drop(held.delay);
        upstream.answer_all();
        drop(held.reservation);
        m1.saturating_sub(m0)
    };

    // The bound: Envoy's cost of the streams, what the core keeps for each, and per stream the
    // host's share the baseline does not have: 512 B in the native build (a held request's
    // release timer); 8 KiB in the wasm build, whose Envoy side of a paused, filtered stream
    // measured ~5 KB more than a passed-through one (proxy-wasm's copies; the filter's own
    // state is in V8's linear memory, outside this figure). A fixed 4 MiB for the allocator's
    // and stats' noise, and 512 B per key the rules create (the wasm build keeps each in
    // Envoy's shared data).
    let host = match common::build() {
        common::Build::Native => 512,
        common::Build::Wasm => 8192,
    };
    let keys = (nd + 10 + 1) as u64;
    let filter_share = nb as u64 * core[0] + nd as u64 * core[1] + nr as u64 * core[2];
    let bound = base_delta + filter_share + n as u64 * host + 4 * 1024 * 1024 + keys * 512;
    eprintln!(
        "bound: baseline {:.1} MiB + core {:.1} MiB + host {host} B/stream + 4 MiB + 512 B/key \
         = {:.1} MiB",
        base_delta as f64 / MIB,
        filter_share as f64 / MIB,
        bound as f64 / MIB
    );

    let upstream = Hold::start();
    let envoy = Envoy::start_yaml(&yaml(&config(), upstream.addr, false));
    let m0 = settled_memory(&envoy);
    let rss0 = rss_kb(&envoy);
    let mut held = hold_all(&envoy, &upstream, false);
    let gauge = metric(None, "delay_queue");
    assert_eq!(envoy.wait_stat(&gauge, nd as u64), Some(nd as u64));
    let m1 = settled_memory(&envoy);
    let rss1 = rss_kb(&envoy);
    // Nobody held was answered: each is held by the filter (body, delay) or by the upstream.
    let evicted = envoy.stat(&metric(Some("delay"), "slot_evictions"));
    for (kind, conns) in [("body", &mut held.body), ("delay", &mut held.delay)] {
        let early = conns.iter().filter(|c| answered(c)).count();
        assert_eq!(
            early, 0,
            "{early} {kind} streams answered while held (delay keys evicted: {evicted:?})"
        );
    }
    let delta = m1.saturating_sub(m0);
    eprintln!(
        "{:?} build: {:.1} MiB idle, {:.1} MiB with {n} held: {:.1} MiB more ({:.0} B per \
         stream; bound {:.1} MiB); RSS {rss0:?} → {rss1:?} kB",
        common::build(),
        m0 as f64 / MIB,
        m1 as f64 / MIB,
        delta as f64 / MIB,
        delta as f64 / n as f64,
        bound as f64 / MIB
    );
    assert!(delta <= bound, "{delta} B over the bound {bound} B");
    assert!(
        delta >= base_delta / 2,
        "{delta} B: the streams are not all held"
    );

    // Meanwhile, a normal client: its 20th request passes, its 21st is refused, each quickly.
    let mut normal = common::Client::connect(envoy.addr).unwrap();
    let mut slowest = Duration::ZERO;
    for i in 1..=NORMAL_LIMIT + 1 {
        let t = Instant::now();
        let r = normal.send("GET", "/normal", &[("x-n", "me")]).unwrap();
        slowest = slowest.max(t.elapsed());
        let want = if i <= NORMAL_LIMIT { 200 } else { 429 };
        assert_eq!(r.status, want, "request {i} of the normal client");
    }
    eprintln!("normal client: {NORMAL_LIMIT} admitted then 429, slowest answer {slowest:?}");
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    drop(normal);

    // The slow clients go: body and delay clients hang up, the upstream answers the rest.
    drop(std::mem::take(&mut held.body));
    drop(std::mem::take(&mut held.delay));
    let upstream_held = nr + if body_upstream() { nb } else { 0 };
    assert_eq!(upstream.answer_all(), upstream_held);
    for c in &mut held.reservation {
        assert_eq!(status(c), 200);
    }
    drop(std::mem::take(&mut held.reservation));
    wait_stat(&envoy, "http.test.downstream_rq_active", 0);
    wait_stat(&envoy, "http.test.downstream_cx_active", 0);
    // Each held request abandoned, each reservation trued up to its usage.
    let abandoned = metric(Some("delay"), "abandoned");
    assert_eq!(envoy.wait_stat(&abandoned, nd as u64), Some(nd as u64));
    assert_eq!(envoy.wait_stat(&gauge, 0), Some(0));
    let refunded = metric(Some("llm"), "usage_refunded");
    let want = nr as u64 * (RESERVE - USED);
    assert_eq!(envoy.wait_stat(&refunded, want), Some(want));
    let m2 = settled_memory(&envoy);
    let slack = 4 * 1024 * 1024 + keys * 512;
    eprintln!(
        "after the slow clients went: {:.1} MiB ({:+.1} MiB from idle, slack {:.1} MiB); RSS \
         {:?} kB",
        m2 as f64 / MIB,
        (m2 as f64 - m0 as f64) / MIB,
        slack as f64 / MIB,
        rss_kb(&envoy)
    );
    assert!(m2 <= m0 + slack, "{m2} B after, {m0} B before: a leak");
}

/// At most `MAX_HELD` (4,096) requests wait per worker: with one worker, 100 more delay
/// requests are refused at once (429) instead of held; the held ones stay held.
/// The two tests of this file, one at a time: each holds thousands of sockets in this process
/// (clients, and the held upstream's side), and together they would pass its open-file limit.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn at_most_4096_requests_wait_per_worker() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const MORE: usize = 100;
    let upstream = Hold::start();
    let envoy = Envoy::start_yaml_workers(&yaml(&config(), upstream.addr, false), 1);
    let addr = envoy.addr;
    let n = MAX_HELD + MORE;
    // The first MAX_HELD in order, then the rest: which ones are refused is known.
    let first = open_all(MAX_HELD, move |i| open_delay(addr, i, false));
    let gauge = metric(None, "delay_queue");
    assert_eq!(
        envoy.wait_stat(&gauge, MAX_HELD as u64),
        Some(MAX_HELD as u64)
    );
    let mut rest = open_all(MORE, move |i| open_delay(addr, MAX_HELD + i, false));
    for c in &mut rest {
        assert_eq!(status(c), 429, "a request past the bound");
    }
    std::thread::sleep(Duration::from_secs(1));
    let early = first.iter().filter(|c| answered(c)).count();
    assert_eq!(early, 0, "{early} held requests were answered");
    let counts = |name: &str| envoy.stat(&metric(Some("delay"), name));
    assert_eq!(
        envoy.stat(&gauge),
        Some(MAX_HELD as u64),
        "limited {:?}, abandoned {:?}, delayed {:?}",
        counts("limited"),
        counts("abandoned"),
        counts("delayed")
    );
    let limited = metric(Some("delay"), "limited");
    assert_eq!(envoy.wait_stat(&limited, MORE as u64), Some(MORE as u64));
    eprintln!("{n} delay requests on one worker: {MAX_HELD} held, {MORE} refused at once");
    drop(first);
    let abandoned = metric(Some("delay"), "abandoned");
    assert_eq!(
        envoy.wait_stat(&abandoned, MAX_HELD as u64),
        Some(MAX_HELD as u64)
    );
}
