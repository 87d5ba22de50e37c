//! The bounded table of client keys: a fixed number of buckets, each one store slot.
//!
//! Shared-data keys can never be deleted in Envoy, so key names must come from a fixed set: the
//! table has `capacity / WAYS` buckets, and a client key (already a keyed 64-bit hash) picks
//! its bucket by `hash % buckets`. A bucket holds up to [`WAYS`] entries, each the full hash as
//! a fingerprint plus the algorithm state. Memory is therefore fixed by `capacity`, whatever keys
//! clients send, and one shared-data read and one CAS write serve a request per rule.
//!
//! When a new key lands in a full bucket, the entry evicted is, in this order: one whose state
//! has expired, else the one remembering the fewest requests (so a flood of new keys evicts its
//! own kind first, and a heavy hitter being limited survives), else the oldest.

use crate::limiter::sliding_window::{State, STATE_LEN};

/// Entries per bucket.
pub const WAYS: usize = 4;
/// Bucket format version, the first byte of every bucket.
pub const VERSION: u8 = 1;
/// Algorithm tag of a sliding window entry.
const TAG_SLIDING_WINDOW: u8 = 1;
/// Bytes per entry: fingerprint (8), algorithm tag (1), state.
pub const ENTRY_LEN: usize = 8 + 1 + STATE_LEN;
/// Bytes per bucket.
pub const BUCKET_LEN: usize = 1 + WAYS * ENTRY_LEN;

/// The number of buckets for a configured capacity (rounded up).
pub fn buckets_for(capacity: u32) -> u32 {
    capacity.div_ceil(WAYS as u32).max(1)
}

/// The bucket a key hash belongs to.
pub fn bucket_of(key_hash: u64, buckets: u32) -> u32 {
    u32::try_from(key_hash % u64::from(buckets.max(1))).unwrap_or(0)
}

/// The fingerprint stored for a key hash; never 0, which marks an empty entry.
pub fn fingerprint_of(key_hash: u64) -> u64 {
    key_hash | 1
}

/// One decoded bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    entries: [(u64, State); WAYS],
}

/// The bytes of a slot were not a bucket of this version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrupt;

/// What putting a key into a bucket did to the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The key was already there.
    Updated,
    /// The key took an empty or expired entry.
    Inserted,
    /// The key took the place of another live key, which is forgotten.
    Evicted,
}

impl Bucket {
    /// Decodes a slot's bytes; a missing or empty slot is an empty bucket.
    pub fn decode(bytes: Option<&[u8]>) -> Result<Bucket, Corrupt> {
        let bytes = match bytes {
            None | Some([]) => return Ok(Bucket::default()),
            Some(b) => b,
        };
        let (&version, rest) = bytes.split_first().ok_or(Corrupt)?;
        if version != VERSION || rest.len() != WAYS * ENTRY_LEN {
            return Err(Corrupt);
        }
        let mut bucket = Bucket::default();
        for (slot, raw) in bucket.entries.iter_mut().zip(rest.chunks_exact(ENTRY_LEN)) {
            let (fp, rest) = raw.split_first_chunk::<8>().ok_or(Corrupt)?;
            let (&tag, state) = rest.split_first().ok_or(Corrupt)?;
            let fp = u64::from_le_bytes(*fp);
            if fp == 0 {
                continue;
            }
            if tag != TAG_SLIDING_WINDOW {
                return Err(Corrupt);
            }
            *slot = (fp, State::decode(state).ok_or(Corrupt)?);
        }
        Ok(bucket)
    }

    /// Encodes the bucket into its fixed-width slot value.
    pub fn encode(&self) -> [u8; BUCKET_LEN] {
        let mut out = [0u8; BUCKET_LEN];
        if let Some((version, rest)) = out.split_first_mut() {
            *version = VERSION;
            for ((fp, state), raw) in self.entries.iter().zip(rest.chunks_exact_mut(ENTRY_LEN)) {
                if *fp == 0 {
                    continue;
                }
                let (f, rest) = raw.split_at_mut(8);
                f.copy_from_slice(&fp.to_le_bytes());
                if let Some((tag, s)) = rest.split_first_mut() {
                    *tag = TAG_SLIDING_WINDOW;
                    s.copy_from_slice(&state.encode());
                }
            }
        }
        out
    }

    /// The state stored for a fingerprint, if any.
    pub fn find(&self, fp: u64) -> Option<State> {
        self.entries
            .iter()
            .find(|(f, _)| *f == fp)
            .map(|(_, state)| *state)
    }

    /// Stores `state` for `fp`, evicting by the module's policy if the bucket is full.
    pub fn put(&mut self, fp: u64, state: State, now_ms: u64) -> Placement {
        if let Some(e) = self.entries.iter_mut().find(|(f, _)| *f == fp) {
            e.1 = state;
            return Placement::Updated;
        }
        // Rank: empty or expired first (weight 0), then fewest remembered requests, then oldest.
        let rank = |(f, s): &(u64, State)| {
            if *f == 0 {
                (0, 0)
            } else {
                (s.weight(now_ms).unwrap_or(0), s.last_ms)
            }
        };
        let Some(victim) = self.entries.iter_mut().min_by_key(|e| rank(e)) else {
            return Placement::Inserted;
        };
        let placement = if rank(victim).0 == 0 {
            Placement::Inserted
        } else {
            Placement::Evicted
        };
        *victim = (fp, state);
        placement
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(last_ms: u64, current: u32) -> State {
        State {
            last_ms,
            window_ms: 60_000,
            current,
            previous: 0,
        }
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let mut b = Bucket::default();
        b.put(11, st(5, 3), 5);
        b.put(13, st(6, 1), 6);
        let bytes = b.encode();
        assert_eq!(bytes.len(), BUCKET_LEN);
        assert_eq!(Bucket::decode(Some(&bytes)), Ok(b.clone()));
        assert_eq!(b.find(13), Some(st(6, 1)));
        assert_eq!(b.find(15), None);
        assert_eq!(Bucket::decode(None), Ok(Bucket::default()));
        assert_eq!(Bucket::decode(Some(&[])), Ok(Bucket::default()));
        assert_eq!(Bucket::decode(Some(&bytes[..50])), Err(Corrupt));
        let mut wrong_version = bytes;
        wrong_version[0] = 9;
        assert_eq!(Bucket::decode(Some(&wrong_version)), Err(Corrupt));
        let mut wrong_tag = bytes;
        wrong_tag[1 + 8] = 77;
        assert_eq!(Bucket::decode(Some(&wrong_tag)), Err(Corrupt));
    }

    #[test]
    fn eviction_spares_heavy_hitters() {
        let now = 10_000;
        let mut b = Bucket::default();
        assert_eq!(b.put(3, st(now, 100), now), Placement::Inserted); // the heavy hitter
        for fp in [5, 7, 9] {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Inserted);
        }
        // A flood of new keys only ever evicts light entries.
        for fp in (11..200).step_by(2) {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Evicted);
            assert_eq!(b.find(3), Some(st(now, 100)));
        }
        // Expired entries go first, without counting as an eviction.
        let later = now + 200_000;
        assert_eq!(b.put(501, st(later, 1), later), Placement::Inserted);
        assert_ne!(b.put(3, st(later, 2), later), Placement::Evicted);
    }

    #[test]
    fn bucket_math() {
        assert_eq!(buckets_for(16_384), 4_096);
        assert_eq!(buckets_for(1), 1);
        assert_eq!(buckets_for(5), 2);
        assert!(bucket_of(u64::MAX, 7) < 7);
        assert_eq!(fingerprint_of(2), 3);
    }
}
