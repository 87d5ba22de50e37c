//! Test support, for this crate's tests and other crates' (feature `testkit`): a fake host and
//! response, a small deterministic RNG, the configuration fixtures, scratch folders. Nothing in a filter uses it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod fair;
pub mod reference;

use crate::config::{Carried, Config};
pub use crate::key::Meta;
use crate::key::{Attributes, PlainRequest, Seed};
use crate::rls::{Code, DescriptorStatus, Response as RlsResponse};
use crate::runtime::{Host, Response, Runtime};
use crate::store::{MemoryStore, Store, StoreError};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A host made of plain fields: a request, a clock, a count of held requests, a log.
pub struct FakeHost {
    /// The request.
    pub req: PlainRequest,
    /// The clock, ms.
    pub now: u64,
    /// Requests this worker holds.
    pub held: usize,
    /// Every log line.
    pub logs: Vec<(log::Level, String)>,
    /// A request body follows the headers.
    pub body_follows: bool,
    /// The body fields handed to the access log ([`Host::body_field_read`]).
    pub fields_read: Vec<(String, Vec<u8>)>,
    /// How many times the source address was read.
    pub address_reads: usize,
}

impl FakeHost {
    /// A GET of `path` from `addr` (port 5555), at 600,000 ms.
    pub fn new(addr: &str, path: &str) -> FakeHost {
        FakeHost {
            req: PlainRequest {
                source_address: Some(format!("{addr}:5555")),
                path: Some(path.into()),
                method: Some("GET".into()),
                authority: Some("example.com".into()),
                ..PlainRequest::default()
            },
            now: 600_000,
            held: 0,
            logs: Vec::new(),
            body_follows: false,
            fields_read: Vec::new(),
            address_reads: 0,
        }
    }

    /// With a key of dynamic metadata.
    pub fn metadata(mut self, namespace: &str, key: &str, value: Meta) -> FakeHost {
        self.req
            .metadata
            .push((namespace.into(), key.into(), value));
        self
    }

    /// With a filter state object.
    pub fn filter_state(mut self, key: &str, value: &str) -> FakeHost {
        self.req
            .filter_state
            .push((key.into(), value.as_bytes().to_vec()));
        self
    }

    /// With a request header.
    pub fn header(mut self, name: &str, value: &str) -> FakeHost {
        self.req
            .headers
            .push((name.into(), value.as_bytes().to_vec()));
        self
    }
}

impl Attributes for FakeHost {
    fn source_address(&mut self) -> Option<&str> {
        self.address_reads += 1;
        self.req.source_address()
    }
    fn path(&mut self) -> Option<&str> {
        self.req.path()
    }
    fn method(&mut self) -> Option<&str> {
        self.req.method()
    }
    fn authority(&mut self) -> Option<&str> {
        self.req.authority()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.req.header(name)
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<Carried<'_>> {
        self.req.metadata(namespace, key)
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.req.filter_state(key)
    }
    fn body_field(&mut self, slot: usize) -> Option<&[u8]> {
        self.req.body_field(slot)
    }
}

impl Host for FakeHost {
    fn now_ms(&mut self) -> u64 {
        self.now
    }
    fn held(&self) -> usize {
        self.held
    }
    fn log(&mut self, level: log::Level, line: fmt::Arguments<'_>) {
        self.logs.push((level, line.to_string()));
    }
    fn body_follows(&self) -> bool {
        self.body_follows
    }
    fn body_field_read(&mut self, name: &str, value: &[u8]) {
        self.fields_read.push((name.to_string(), value.to_vec()));
    }
}

/// A response's header fields or trailers, one entry a line (a name on several lines is several
/// entries).
#[derive(Default)]
pub struct FakeResponse(pub Vec<(String, Vec<u8>)>);

impl FakeResponse {
    /// One field.
    pub fn with(name: &str, value: &str) -> FakeResponse {
        FakeResponse(vec![(name.into(), value.as_bytes().to_vec())])
    }
}

impl Response for FakeResponse {
    fn field(&mut self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8])) {
        self.0
            .iter()
            .filter(|(n, _)| n == name)
            .for_each(|(_, v)| line(v));
    }

    fn remove(&mut self, name: &str) {
        self.0.retain(|(n, _)| n != name);
    }
}

/// A small deterministic PRNG (xorshift64*), so generated tests reproduce.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Up to `max` random bytes.
    pub fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The folder of configuration fixtures: `bad/NAME.json` with `NAME.error`, `good/`, `manifests/`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The `.json` files of the fixtures' folder `dir`, sorted.
pub fn fixture_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(fixtures().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

/// A fresh, empty directory of this test process, named after `name`.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "wasm-ratelimit-test-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `cmd` to its end: its exit code (-1 when a signal ended it), stdout and stderr, as text.
pub fn output(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A runtime over an in-memory store, for the configuration `json` (which must parse) and keys
/// hashed with `seed`.
pub fn runtime(json: &str, seed: Seed) -> Runtime<MemoryStore> {
    let config = Config::parse(json.as_bytes()).unwrap();
    Runtime::new(config, seed, MemoryStore::new())
}

/// Every count `rt` keeps (its counters, then its gauges), drained, as text: two runtimes fed
/// alike compare by it.
pub fn counts(rt: &Runtime<MemoryStore>) -> Vec<String> {
    let (mut counters, mut gauges) = (Vec::new(), Vec::new());
    rt.metrics().drain(
        |rule, c, n| counters.push(format!("{rule} {} {n}", c.name())),
        |g, d| gauges.push(format!("{g:?} {d}")),
    );
    counters.extend(gauges);
    counters
}

/// A rate limit service's answer: `code`, and one status of 10 a minute with `remaining` left,
/// whole again in 30 s; no headers.
pub fn rls_answer(code: Code, remaining: u32) -> RlsResponse {
    RlsResponse {
        overall_code: code,
        statuses: vec![DescriptorStatus {
            code,
            requests_per_unit: Some(10),
            unit_seconds: Some(60),
            limit_remaining: remaining,
            reset_ms: Some(30_000),
        }],
        headers: Vec::new(),
    }
}

/// A rate limit service's counter of 100 a window of a second (`counter`: the window it counts
/// and what it counted there), checked then counted as limitador does: its answer to a call of
/// `hits` at `now_ms`, with what remains and the window's reset.
pub fn second_counter(counter: &mut (u64, u64), hits: u64, now_ms: u64) -> RlsResponse {
    window_counter(counter, hits, now_ms, (100, 1000))
}

/// [`second_counter`] of `limit` a window of `window_ms` (clock-aligned).
pub fn window_counter(
    counter: &mut (u64, u64),
    hits: u64,
    now_ms: u64,
    (limit, window_ms): (u64, u64),
) -> RlsResponse {
    if counter.0 != now_ms / window_ms {
        *counter = (now_ms / window_ms, 0);
    }
    let code = if counter.1 + hits <= limit {
        counter.1 += hits;
        Code::Ok
    } else {
        Code::OverLimit
    };
    RlsResponse {
        overall_code: code,
        statuses: vec![DescriptorStatus {
            code,
            requests_per_unit: Some(u32::try_from(limit).unwrap()),
            unit_seconds: Some(window_ms / 1000),
            limit_remaining: u32::try_from(limit - counter.1).unwrap(),
            reset_ms: Some(window_ms - now_ms % window_ms),
        }],
        headers: Vec::new(),
    }
}

/// A store for tests: `inner`, with `before` run just before each write (given `inner` and the
/// slot): another writer that wins a race, say. An error from `before` is the write's, and the
/// write does not happen.
pub struct Intercepted<S, F> {
    pub inner: S,
    before: F,
}

impl<S: Store, F: Fn(&S, u64) -> Result<(), StoreError>> Intercepted<S, F> {
    pub fn new(inner: S, before: F) -> Self {
        Intercepted { inner, before }
    }
}

impl<S: Store, F: Fn(&S, u64) -> Result<(), StoreError>> Store for Intercepted<S, F> {
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, StoreError> {
        self.inner.read(slot, f)
    }

    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        (self.before)(&self.inner, slot)?;
        self.inner.write(slot, value, cas)
    }
}
