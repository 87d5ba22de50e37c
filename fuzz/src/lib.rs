//! The fuzz targets' checks, one module per target (`fuzz_targets/NAME.rs` calls `NAME::run`),
//! so that the stable test `tests/targets.rs` can replay the seed corpora through the same code.
//!
//! Each `run` must never panic on any input: a panic is either a bug of the code under test (a
//! crash in Envoy's process for the native build) or an oracle disagreeing with it. The oracles:
//! - splits: a scan fed in pieces (the input picks where) finds what the scan of the whole does;
//! - `serde_json`: on input it accepts, the body scanners find the values it reads at the paths
//!   (walked in document order by [`reference`]);
//! - the algorithms' reference models (copied from `crates/ratelimit-core/tests/accuracy.rs`);
//! - `chrono` for the calendar arithmetic, the RFC 3339 times and HTTP dates;
//! - round trips (addresses and networks, CIDRs, logged keys, JSON strings, RLS requests) and
//!   the syntax of what is written to clients (header values, JSON bodies).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod algorithms;
pub mod body_scan;
pub mod calendar;
pub mod config;
pub mod keys;
pub mod manifest;
pub mod operator;
pub mod provider;
pub mod reference;
pub mod render;
pub mod rls;
pub mod share;
pub mod usage_scan;

/// The names of the targets, as in `Cargo.toml` and `fuzz/corpus/`.
pub const TARGETS: [&str; 12] = [
    "config",
    "manifest",
    "body_scan",
    "usage_scan",
    "rls",
    "keys",
    "operator",
    "render",
    "algorithms",
    "calendar",
    "provider",
    "share",
];

/// The target called `name`'s check.
pub fn target(name: &str) -> Option<fn(&[u8])> {
    Some(match name {
        "config" => config::run,
        "manifest" => manifest::run,
        "body_scan" => body_scan::run,
        "usage_scan" => usage_scan::run,
        "rls" => rls::run,
        "keys" => keys::run,
        "operator" => operator::run,
        "render" => render::run,
        "algorithms" => algorithms::run,
        "calendar" => calendar::run,
        "provider" => provider::run,
        "share" => share::run,
        _ => return None,
    })
}

/// Reads an input from the front: numbers and choices, then the rest. Past the end, zeros.
pub struct Bytes<'a>(pub &'a [u8]);

impl<'a> Bytes<'a> {
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }

    /// One of `n` choices (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n.max(1)
    }

    /// Up to `max` bytes, their count read first.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = usize::from(self.u8()) % (max + 1);
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }

    /// Up to `max` bytes as text (invalid UTF-8 replaced).
    pub fn text(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }

    /// What is left.
    pub fn rest(self) -> &'a [u8] {
        self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `body` cut into pieces at points drawn from `seed`: pieces of 0 to a few bytes, or larger,
/// as the seed says (empty pieces included, as hosts may hand them).
pub fn pieces(body: &[u8], seed: u32) -> Vec<&[u8]> {
    // The core's xorshift64*, seeded (odd) from the input.
    let mut rng = ratelimit_core::testkit::Rng(u64::from(seed) << 1 | 1);
    let longest = match seed & 3 {
        0 => 2,
        1 => 8,
        2 => 64,
        _ => 1024,
    };
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let n = (rng.below(longest + 1) as usize).min(rest.len());
        let (head, tail) = rest.split_at(n);
        out.push(head);
        rest = tail;
    }
    out
}

/// Whether `value` may be sent as a header value: visible ASCII and spaces only (no control
/// character, so no CR or LF), not starting or ending with a space.
pub fn header_value_ok(value: &str) -> bool {
    value.bytes().all(|b| (0x20..0x7f).contains(&b))
        && !value.starts_with(' ')
        && !value.ends_with(' ')
}

/// Whether `name` may be a header name: lower-case token characters.
pub fn header_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b))
}

/// Panics unless `body` is one JSON document.
pub fn assert_json(body: &str) -> serde_json::Value {
    match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => panic!("not JSON ({e}): {body}"),
    }
}
