//! The bounded structures replay keeps its statistics in, so that its memory does not grow
//! with the log: the heaviest keys ([`SpaceSaving`]), a count of distinct keys ([`Distinct`],
//! exact up to [`EXACT_DISTINCT`] keys, then a HyperLogLog), and per-second counts over the
//! whole log ([`Timeline`], at most [`MAX_BUCKETS`] buckets that widen as the log goes on).
//!
//! Keys are the filter's 64-bit keyed SipHash of a client key: already uniform, so they index
//! hash tables and HyperLogLog registers as they are.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for keys that are already uniform 64-bit hashes: it passes them through.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; fold anything else in rather than lose it.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Pass = BuildHasherDefault<PassThrough>;

/// One key a [`SpaceSaving`] monitors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counted {
    /// The key's hash.
    pub key: u64,
    /// Its count: an overestimate by at most `error`.
    pub count: u64,
    /// How much of `count` may belong to keys this one replaced: the true count is in
    /// `count - error ..= count`.
    pub error: u64,
    /// The raw key, when the caller kept it.
    pub raw: Option<String>,
}

impl Counted {
    /// The count this key certainly has.
    pub fn guaranteed(&self) -> u64 {
        self.count - self.error
    }
}

/// The heaviest keys of a stream in `capacity` counters (Metwally et al.'s Space-Saving): a
/// new key takes the place of the lightest one and inherits its count as its error. Every key
/// heavier than `total / capacity` is monitored, and exact while the stream has at most
/// `capacity` distinct keys. The counters are a min-heap indexed by key: O(log capacity) per
/// update.
#[derive(Debug)]
pub struct SpaceSaving {
    capacity: usize,
    heap: Vec<Counted>,
    index: HashMap<u64, usize, Pass>,
    replaced: bool,
}

impl SpaceSaving {
    /// At most `capacity` (≥ 1) counters.
    pub fn new(capacity: usize) -> SpaceSaving {
        SpaceSaving {
            capacity: capacity.max(1),
            heap: Vec::new(),
            index: HashMap::default(),
            replaced: false,
        }
    }

    /// Counts `weight` for `key`; `raw` gives the raw key, asked only when the key gets a
    /// counter.
    pub fn add(&mut self, key: u64, weight: u64, raw: impl FnOnce() -> Option<String>) {
        if let Some(&i) = self.index.get(&key) {
            if let Some(c) = self.heap.get_mut(i) {
                c.count = c.count.saturating_add(weight);
            }
            self.sift_down(i);
            return;
        }
        if self.heap.len() < self.capacity {
            self.heap.push(Counted {
                key,
                count: weight,
                error: 0,
                raw: raw(),
            });
            let i = self.heap.len() - 1;
            self.index.insert(key, i);
            self.sift_up(i);
            return;
        }
        let Some(lightest) = self.heap.first_mut() else {
            return;
        };
        self.index.remove(&lightest.key);
        let floor = lightest.count;
        *lightest = Counted {
            key,
            count: floor.saturating_add(weight),
            error: floor,
            raw: raw(),
        };
        self.index.insert(key, 0);
        self.replaced = true;
        self.sift_down(0);
    }

    /// The `n` heaviest keys, heaviest first.
    pub fn top(&self, n: usize) -> Vec<Counted> {
        let mut all = self.heap.clone();
        all.sort_by(|a, b| b.count.cmp(&a.count).then(a.key.cmp(&b.key)));
        all.truncate(n);
        all
    }

    /// The key with the highest guaranteed count.
    pub fn heaviest(&self) -> Option<&Counted> {
        self.heap
            .iter()
            .max_by(|a, b| a.guaranteed().cmp(&b.guaranteed()).then(b.key.cmp(&a.key)))
    }

    /// Whether every count is exact (no key was ever replaced).
    pub fn exact(&self) -> bool {
        !self.replaced
    }

    /// Forgets every key (keeps the memory for reuse).
    pub fn clear(&mut self) {
        self.heap.clear();
        self.index.clear();
        self.replaced = false;
    }

    fn count_at(&self, i: usize) -> u64 {
        self.heap.get(i).map_or(u64::MAX, |c| c.count)
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        for i in [a, b] {
            if let Some(c) = self.heap.get(i) {
                self.index.insert(c.key, i);
            }
        }
    }

    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.count_at(i) >= self.count_at(parent) {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
    }

    fn sift_down(&mut self, mut i: usize) {
        loop {
            let mut lightest = i;
            for child in [2 * i + 1, 2 * i + 2] {
                if self.count_at(child) < self.count_at(lightest) {
                    lightest = child;
                }
            }
            if lightest == i {
                return;
            }
            self.swap(i, lightest);
            i = lightest;
        }
    }
}

/// Distinct keys counted exactly up to this many; beyond, estimated.
pub const EXACT_DISTINCT: usize = 16_384;
/// HyperLogLog precision: 2^14 one-byte registers (16 KiB), a standard error of 0.81 %.
const HLL_BITS: u32 = 14;
const HLL_REGISTERS: usize = 1 << HLL_BITS;

/// How many distinct keys a stream has: an exact set up to [`EXACT_DISTINCT`] keys, then a
/// HyperLogLog (Flajolet et al., with linear counting for small estimates) in 16 KiB.
#[derive(Debug)]
pub enum Distinct {
    /// Every key seen.
    Exact(HashSet<u64, Pass>),
    /// The registers of the estimate.
    Estimate(Box<[u8]>),
}

impl Default for Distinct {
    fn default() -> Self {
        Distinct::Exact(HashSet::default())
    }
}

impl Distinct {
    /// Counts `key`: a client-key hash, uniform below its top 16 bits (which carry its rule's
    /// tag, the same for every key of a rule: `ratelimit_core::key::rule_tag`).
    pub fn insert(&mut self, key: u64) {
        match self {
            Distinct::Exact(set) => {
                set.insert(key);
                if set.len() > EXACT_DISTINCT {
                    let mut registers = vec![0u8; HLL_REGISTERS].into_boxed_slice();
                    for k in set.iter() {
                        hll_insert(&mut registers, *k);
                    }
                    *self = Distinct::Estimate(registers);
                }
            }
            Distinct::Estimate(registers) => hll_insert(registers, key),
        }
    }

    /// The count (an estimate once [`Distinct::is_exact`] is false).
    pub fn count(&self) -> u64 {
        match self {
            Distinct::Exact(set) => set.len() as u64,
            Distinct::Estimate(registers) => hll_estimate(registers),
        }
    }

    /// Whether [`Distinct::count`] is exact.
    pub fn is_exact(&self) -> bool {
        matches!(self, Distinct::Exact(_))
    }
}

fn hll_insert(registers: &mut [u8], key: u64) {
    // The rule's tag tells keys of one rule nothing apart.
    let key = key << 16;
    let index = (key >> (64 - HLL_BITS)) as usize;
    // The rest of the bits, with a sentinel so the rank is at most 64 - HLL_BITS + 1.
    let rest = (key << HLL_BITS) | (1 << (HLL_BITS - 1));
    let rank = rest.leading_zeros() as u8 + 1;
    if let Some(r) = registers.get_mut(index) {
        *r = (*r).max(rank);
    }
}

fn hll_estimate(registers: &[u8]) -> u64 {
    let m = registers.len() as f64;
    let sum: f64 = registers.iter().map(|&r| (-f64::from(r)).exp2()).sum();
    let alpha = 0.7213 / (1.0 + 1.079 / m);
    let raw = alpha * m * m / sum;
    let zeros = registers.iter().filter(|&&r| r == 0).count();
    let estimate = if raw <= 2.5 * m && zeros > 0 {
        m * (m / zeros as f64).ln() // linear counting: exact enough for small counts
    } else {
        raw
    };
    estimate.round() as u64
}

/// The most buckets a [`Timeline`] keeps; when a log needs more, neighbours are merged and
/// each bucket covers twice as many seconds.
pub const MAX_BUCKETS: usize = 1024;

/// Counts per bucket of time for a fixed set of columns (e.g. allowed and limited of each
/// rule), from the first second seen. Buckets cover `width_s` seconds (1, 2, 4, …): at most
/// [`MAX_BUCKETS`] of them, whatever the log's length.
#[derive(Debug)]
pub struct Timeline {
    columns: usize,
    origin_s: Option<u64>,
    width_s: u64,
    counts: Vec<u64>,
}

impl Timeline {
    /// An empty timeline of `columns` counts per bucket.
    pub fn new(columns: usize) -> Timeline {
        Timeline {
            columns,
            origin_s: None,
            width_s: 1,
            counts: Vec::new(),
        }
    }

    /// Adds `n` to `column` at `t_ms` (a time before the first one counts in the first bucket).
    pub fn add(&mut self, t_ms: u64, column: usize, n: u64) {
        if n == 0 || column >= self.columns {
            return;
        }
        let s = t_ms / 1000;
        let origin = *self.origin_s.get_or_insert(s);
        let mut bucket = s.saturating_sub(origin) / self.width_s;
        while bucket >= MAX_BUCKETS as u64 {
            self.halve();
            bucket = s.saturating_sub(origin) / self.width_s;
        }
        let at = bucket as usize * self.columns + column;
        if at >= self.counts.len() {
            self.counts.resize((bucket as usize + 1) * self.columns, 0);
        }
        if let Some(c) = self.counts.get_mut(at) {
            *c = c.saturating_add(n);
        }
    }

    /// Merges each pair of neighbouring buckets into one twice as wide.
    fn halve(&mut self) {
        let columns = self.columns.max(1);
        let merged: Vec<u64> = self
            .counts
            .chunks(2 * columns)
            .flat_map(|pair| {
                let (a, b) = pair.split_at(columns.min(pair.len()));
                (0..columns).map(move |c| {
                    a.get(c)
                        .copied()
                        .unwrap_or(0)
                        .saturating_add(b.get(c).copied().unwrap_or(0))
                })
            })
            .collect();
        self.counts = merged;
        self.width_s *= 2;
    }

    /// The first second (since the epoch), if anything was counted.
    pub fn origin_s(&self) -> Option<u64> {
        self.origin_s
    }

    /// Seconds per bucket.
    pub fn width_s(&self) -> u64 {
        self.width_s
    }

    /// How many buckets there are.
    pub fn len(&self) -> usize {
        self.counts.len() / self.columns.max(1)
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// One column's counts, bucket by bucket.
    pub fn column(&self, column: usize) -> Vec<u64> {
        self.counts
            .chunks(self.columns.max(1))
            .map(|b| b.get(column).copied().unwrap_or(0))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: uniform hashes for the tests.
    fn mix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    #[test]
    fn space_saving_is_exact_within_its_capacity() {
        let mut s = SpaceSaving::new(8);
        for (key, n) in [(1, 5), (2, 3), (3, 9), (1, 2)] {
            for _ in 0..n {
                s.add(key, 1, || Some(format!("k{key}")));
            }
        }
        assert!(s.exact());
        let top = s.top(2);
        assert_eq!(
            top,
            vec![
                Counted {
                    key: 3,
                    count: 9,
                    error: 0,
                    raw: Some("k3".into())
                },
                Counted {
                    key: 1,
                    count: 7,
                    error: 0,
                    raw: Some("k1".into())
                },
            ]
        );
        assert_eq!(s.heaviest().map(|c| c.key), Some(3));
        s.clear();
        assert!(s.top(5).is_empty());
    }

    #[test]
    fn space_saving_keeps_the_heavy_hitters_of_a_long_tail_with_bounded_error() {
        // 100 heavy keys (2,000 each) among 200,000 keys seen once, in 256 counters: every
        // key above total / 256 = 1,562 is guaranteed a counter.
        let mut s = SpaceSaving::new(256);
        let mut total = 0u64;
        for i in 0..200_000u64 {
            s.add(mix(i) | 1 << 63, 1, || None);
            s.add(i % 100, 1, || None);
            total += 2;
        }
        assert!(!s.exact());
        let top = s.top(100);
        let mut keys: Vec<u64> = top.iter().map(|c| c.key).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            (0..100).collect::<Vec<_>>(),
            "every heavy key is on top"
        );
        for c in &top {
            // Space-Saving: the true count (2,000) lies in count - error ..= count, and the
            // error is at most total / capacity.
            assert!(c.guaranteed() <= 2000 && 2000 <= c.count, "{c:?}");
            assert!(c.error <= total / 256, "{c:?}");
        }
        assert!(s.heap.len() == 256 && s.index.len() == 256);
    }

    #[test]
    fn distinct_is_exact_then_estimated_within_a_few_percent() {
        let mut d = Distinct::default();
        for i in 0..1000 {
            d.insert(mix(i));
            d.insert(mix(i)); // repeats do not count
        }
        assert!(d.is_exact());
        assert_eq!(d.count(), 1000);
        for n in [20_000u64, 100_000, 1_000_000] {
            let mut d = Distinct::default();
            for i in 0..n {
                // One rule's keys: its tag on top.
                d.insert(0xabcd << 48 | mix(i) >> 16);
            }
            assert!(!d.is_exact());
            let err = (d.count() as f64 - n as f64).abs() / n as f64;
            // 0.81 % standard error: 3 % is beyond four standard deviations.
            assert!(err < 0.03, "{n}: estimated {} ({err})", d.count());
        }
    }

    #[test]
    fn a_timeline_widens_its_buckets_instead_of_growing() {
        let mut t = Timeline::new(2);
        let t0 = 1_700_000_000_000u64;
        t.add(t0, 0, 1);
        t.add(t0 + 999, 1, 2);
        t.add(t0 + 3_500, 0, 4);
        t.add(t0 - 5_000, 0, 1); // before the first second: first bucket
        assert_eq!(t.width_s(), 1);
        assert_eq!(t.column(0), [2, 0, 0, 4]);
        assert_eq!(t.column(1), [2, 0, 0, 0]);
        // One bucket per second for 3,000 s needs 2,048 buckets of 2 s... then 4 s.
        for s in 0..3_000u64 {
            t.add(t0 + s * 1000, 1, 1);
        }
        assert_eq!(t.width_s(), 4);
        assert!(t.len() <= MAX_BUCKETS);
        assert_eq!(t.column(0).iter().sum::<u64>(), 6);
        assert_eq!(t.column(1).iter().sum::<u64>(), 3_002);
        assert_eq!(t.column(1).first(), Some(&6)); // seconds 0..4: 2 + 4 ones
        assert_eq!(t.origin_s(), Some(t0 / 1000));
    }
}
