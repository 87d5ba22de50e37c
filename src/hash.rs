//! Keyed hashing of client keys.
//!
//! Client keys are attacker-controlled (header values, addresses), and they pick the slot of the
//! bounded table. An unkeyed hash would let a client aim many keys at one slot and evict a heavy
//! hitter on purpose, so the hash is SipHash-1-3 (the algorithm of Rust's `HashMap`) keyed with a
//! random seed that every worker of one Envoy shares through shared data. The raw key is never
//! stored: only the 64-bit hash is.

/// A 128-bit SipHash key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed(pub [u64; 2]);

impl Seed {
    /// Encodes the seed as 16 little-endian bytes (its shared-data form).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let (a, b) = out.split_at_mut(8);
        a.copy_from_slice(&self.0[0].to_le_bytes());
        b.copy_from_slice(&self.0[1].to_le_bytes());
        out
    }

    /// Decodes 16 little-endian bytes; anything else is `None`.
    pub fn from_bytes(bytes: &[u8]) -> Option<Seed> {
        let (a, b) = bytes.split_first_chunk::<8>()?;
        let b: &[u8; 8] = b.try_into().ok()?;
        Some(Seed([u64::from_le_bytes(*a), u64::from_le_bytes(*b)]))
    }

    /// A fresh random seed from the platform's randomness (WASI `random_get` inside Envoy),
    /// drawn through std's `RandomState` so no extra crate is needed.
    pub fn random() -> Seed {
        use std::hash::{BuildHasher, Hasher};
        let state = std::collections::hash_map::RandomState::new();
        let draw = |n: u64| {
            let mut h = state.build_hasher();
            h.write_u64(n);
            h.finish()
        };
        Seed([draw(1), draw(2)])
    }
}

/// Streaming SipHash-1-3 (one compression round per 8-byte block, three finalisation rounds).
#[derive(Clone, Debug)]
pub struct SipHasher13 {
    v: [u64; 4],
    tail: u64,
    ntail: usize,
    length: usize,
}

impl SipHasher13 {
    /// A hasher keyed with `seed`.
    pub fn new(seed: Seed) -> Self {
        let [k0, k1] = seed.0;
        SipHasher13 {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            tail: 0,
            ntail: 0,
            length: 0,
        }
    }

    #[inline]
    fn round(&mut self) {
        let [mut v0, mut v1, mut v2, mut v3] = self.v;
        v0 = v0.wrapping_add(v1);
        v1 = v1.rotate_left(13) ^ v0;
        v0 = v0.rotate_left(32);
        v2 = v2.wrapping_add(v3);
        v3 = v3.rotate_left(16) ^ v2;
        v0 = v0.wrapping_add(v3);
        v3 = v3.rotate_left(21) ^ v0;
        v2 = v2.wrapping_add(v1);
        v1 = v1.rotate_left(17) ^ v2;
        v2 = v2.rotate_left(32);
        self.v = [v0, v1, v2, v3];
    }

    #[inline]
    fn compress(&mut self, m: u64) {
        self.v[3] ^= m;
        self.round();
        self.v[0] ^= m;
    }

    /// Feeds bytes; the result depends only on the concatenation of everything written.
    pub fn write(&mut self, bytes: &[u8]) {
        self.length = self.length.wrapping_add(bytes.len());
        let mut rest = bytes;
        if self.ntail != 0 {
            let take = (8 - self.ntail).min(rest.len());
            let (head, tail) = rest.split_at(take);
            for (i, b) in head.iter().enumerate() {
                self.tail |= u64::from(*b) << (8 * (self.ntail + i));
            }
            self.ntail += take;
            rest = tail;
            if self.ntail < 8 {
                return;
            }
            let m = self.tail;
            self.compress(m);
            self.tail = 0;
            self.ntail = 0;
        }
        let mut blocks = rest.chunks_exact(8);
        for block in &mut blocks {
            let mut word = [0u8; 8];
            word.copy_from_slice(block);
            self.compress(u64::from_le_bytes(word));
        }
        for (i, b) in blocks.remainder().iter().enumerate() {
            self.tail |= u64::from(*b) << (8 * i);
        }
        self.ntail = blocks.remainder().len();
    }

    /// Feeds a `u64` as 8 little-endian bytes.
    pub fn write_u64(&mut self, n: u64) {
        self.write(&n.to_le_bytes());
    }

    /// Feeds a length-prefixed byte string, so that ("ab","c") and ("a","bc") differ.
    pub fn write_field(&mut self, bytes: &[u8]) {
        self.write_u64(bytes.len() as u64);
        self.write(bytes);
    }

    /// The 64-bit hash of everything written.
    pub fn finish(&self) -> u64 {
        let mut s = self.clone();
        let b = ((s.length as u64 & 0xff) << 56) | s.tail;
        s.compress(b);
        s.v[2] ^= 0xff;
        s.round();
        s.round();
        s.round();
        s.v[0] ^ s.v[1] ^ s.v[2] ^ s.v[3]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    /// std's `DefaultHasher::new()` is SipHash-1-3 with a zero key: our output must match it.
    #[test]
    fn matches_std_siphash13_with_zero_key() {
        let inputs: [&[u8]; 6] = [
            b"",
            b"a",
            b"abcdefg",
            b"abcdefgh",
            b"abcdefghi",
            &[0xff; 37],
        ];
        for input in inputs {
            let mut ours = SipHasher13::new(Seed([0, 0]));
            ours.write(input);
            let mut std = std::collections::hash_map::DefaultHasher::new();
            std.write(input);
            assert_eq!(ours.finish(), std.finish(), "input {input:?}");
        }
    }

    #[test]
    fn split_writes_equal_one_write() {
        let seed = Seed([7, 11]);
        let data: Vec<u8> = (0u8..=40).collect();
        let mut whole = SipHasher13::new(seed);
        whole.write(&data);
        for cut in 0..data.len() {
            let (a, b) = data.split_at(cut);
            let mut parts = SipHasher13::new(seed);
            parts.write(a);
            parts.write(b);
            assert_eq!(parts.finish(), whole.finish(), "cut at {cut}");
        }
    }

    #[test]
    fn seed_changes_hash_and_round_trips() {
        let mut a = SipHasher13::new(Seed([1, 2]));
        let mut b = SipHasher13::new(Seed([1, 3]));
        a.write(b"10.0.0.1");
        b.write(b"10.0.0.1");
        assert_ne!(a.finish(), b.finish());
        let s = Seed([0x0102_0304_0506_0708, u64::MAX]);
        assert_eq!(Seed::from_bytes(&s.to_bytes()), Some(s));
        assert_eq!(Seed::from_bytes(&[1, 2, 3]), None);
        assert_ne!(Seed::random(), Seed::random());
    }
}
