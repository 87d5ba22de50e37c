//! The seed of every client-key hash (its own module: the configuration names one, and the
//! keys are hashed under it).

use siphasher::sip::SipHasher13;
use std::hash::Hasher;

/// The 128-bit SipHash key of every client-key hash.
///
/// Client keys are attacker-controlled (header values, addresses), and they pick the slot of the
/// bounded table. An unkeyed hash would let a client aim many keys at one slot and evict a heavy
/// hitter on purpose, so keys are hashed with SipHash-1-3 (the algorithm of Rust's `HashMap`)
/// under a random seed that every worker of one Envoy shares. Only the 64-bit hash is stored,
/// never the raw key.
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

    /// Reads 32 hexadecimal digits (as [`Seed::to_hex`] writes them); anything else is `None`.
    pub fn parse_hex(s: &str) -> Option<Seed> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let half = |h: &str| u64::from_str_radix(h, 16).ok();
        Some(Seed([half(s.get(..16)?)?, half(s.get(16..)?)?]))
    }

    /// The seed as 32 hexadecimal digits.
    pub fn to_hex(self) -> String {
        format!("{:016x}{:016x}", self.0[0], self.0[1])
    }

    /// A fresh random seed from the platform's randomness (WASI `random_get` inside Envoy's V8,
    /// the OS elsewhere), drawn through std's `RandomState` so no extra crate is needed.
    pub fn random() -> Seed {
        use std::hash::BuildHasher;
        let state = std::collections::hash_map::RandomState::new();
        let draw = |n: u64| {
            let mut h = state.build_hasher();
            h.write_u64(n);
            h.finish()
        };
        Seed([draw(1), draw(2)])
    }

    pub(crate) fn hasher(self) -> SipHasher13 {
        SipHasher13::new_with_keys(self.0[0], self.0[1])
    }
}
