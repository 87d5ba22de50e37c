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

use crate::limiter::{
    fixed_window, gcra, in_flight, lease, sliding_log, sliding_window, tenant, State,
};

/// Entries per bucket.
pub const WAYS: usize = 4;
/// Bucket format version, the first byte of every bucket.
pub const VERSION: u8 = 1;
/// Log slot format version, the first byte of every sliding-log slot.
pub const LOG_VERSION: u8 = 1;
/// The longest compact state (sliding window and GCRA: 20 bytes), padded.
const STATE_LEN: usize = 23;
/// A compact state with its tag.
pub const TAGGED_LEN: usize = 1 + STATE_LEN;
/// Bytes per entry: fingerprint (8), algorithm tag (1), state.
pub const ENTRY_LEN: usize = 8 + 1 + STATE_LEN;
/// Bytes per bucket.
pub const BUCKET_LEN: usize = 1 + WAYS * ENTRY_LEN;
/// Store slots from here on hold sliding logs (one key each), below it buckets.
pub const LOG_SLOTS: u64 = 1 << 32;
/// Store slots from here on hold the shared health of elastic rules (one per rule), past every
/// sliding-log slot.
pub const HEALTH_SLOTS: u64 = 1 << 33;
/// Store slots from here on hold the records of shared capacities (one per rule), past every
/// health slot.
pub const SHARE_SLOTS: u64 = 3 << 32;

/// What a store slot holds, by the range its number falls in. Stores keep buckets (fixed size,
/// which a store may update in place) apart from the other values (read and written whole, with
/// compare-and-swap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// A bucket of [`WAYS`] keys of the algorithms with compact states (slots below
    /// [`LOG_SLOTS`]).
    Bucket,
    /// One key's sliding log ([`LOG_SLOTS`] up to [`HEALTH_SLOTS`]).
    Log,
    /// An elastic rule's shared health ([`HEALTH_SLOTS`] up to [`SHARE_SLOTS`]).
    Health,
    /// A shared capacity's record ([`SHARE_SLOTS`] on).
    Share,
}

impl SlotKind {
    /// The kind of store slot `slot`.
    pub fn of(slot: u64) -> SlotKind {
        match slot {
            SHARE_SLOTS.. => SlotKind::Share,
            HEALTH_SLOTS.. => SlotKind::Health,
            LOG_SLOTS.. => SlotKind::Log,
            _ => SlotKind::Bucket,
        }
    }

    /// The first store slot of this kind.
    pub fn first(self) -> u64 {
        match self {
            SlotKind::Bucket => 0,
            SlotKind::Log => LOG_SLOTS,
            SlotKind::Health => HEALTH_SLOTS,
            SlotKind::Share => SHARE_SLOTS,
        }
    }

    /// The `n`th store slot of this kind (`n` below the kind's range: 2³² slots each).
    pub fn slot(self, n: u64) -> u64 {
        self.first() + n % LOG_SLOTS
    }
}

const TAG_SLIDING_WINDOW: u8 = 1;
const TAG_FIXED_WINDOW: u8 = 2;
const TAG_GCRA: u8 = 3;
const TAG_BLOCKED: u8 = 4;
const TAG_IN_FLIGHT: u8 = 5;
const TAG_LEASE: u8 = 6;
const TAG_TENANT: u8 = 7;

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

/// The bytes of a slot were not a container of this version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrupt;

/// What putting a key into a slot did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The key was already there.
    Updated,
    /// The key took an entry never used before.
    Filled,
    /// The key took an expired entry.
    Inserted,
    /// The key took the place of another live key, which is forgotten.
    Evicted,
    /// No room: the slot holds another live key (sliding logs only).
    Full,
}

/// A slot's store value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoded {
    /// A bucket: always [`BUCKET_LEN`] bytes.
    Bucket([u8; BUCKET_LEN]),
    /// A sliding log.
    Log(Vec<u8>),
}

/// Nothing encoded yet (an empty log: no allocation), for a buffer to encode into.
impl Default for Encoded {
    fn default() -> Encoded {
        Encoded::Log(Vec::new())
    }
}

impl AsRef<[u8]> for Encoded {
    fn as_ref(&self) -> &[u8] {
        match self {
            Encoded::Bucket(b) => b,
            Encoded::Log(l) => l,
        }
    }
}

/// What one store slot holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Up to [`WAYS`] keys with compact state.
    Bucket([Option<(u64, State)>; WAYS]),
    /// One key's sliding log.
    Log(Option<(u64, sliding_log::State)>),
}

impl Slot {
    /// Decodes the bytes of store slot `slot`; a missing or empty slot is empty.
    pub fn decode(slot: u64, bytes: Option<&[u8]>) -> Result<Slot, Corrupt> {
        let log = SlotKind::of(slot) != SlotKind::Bucket;
        let bytes = match bytes {
            None | Some([]) if log => return Ok(Slot::Log(None)),
            None | Some([]) => return Ok(Slot::Bucket(Default::default())),
            Some(b) => b,
        };
        let (&version, rest) = bytes.split_first().ok_or(Corrupt)?;
        if log {
            if version != LOG_VERSION {
                return Err(Corrupt);
            }
            let (fp, state) = rest.split_first_chunk::<8>().ok_or(Corrupt)?;
            let state = sliding_log::State::decode(state).ok_or(Corrupt)?;
            return Ok(Slot::Log(Some((u64::from_le_bytes(*fp), state))));
        }
        if version != VERSION || rest.len() != WAYS * ENTRY_LEN {
            return Err(Corrupt);
        }
        let mut entries: [Option<(u64, State)>; WAYS] = Default::default();
        for (entry, raw) in entries.iter_mut().zip(rest.chunks_exact(ENTRY_LEN)) {
            let (fp, tagged) = raw.split_first_chunk::<8>().ok_or(Corrupt)?;
            let fp = u64::from_le_bytes(*fp);
            if fp == 0 {
                continue;
            }
            *entry = Some((fp, decode_state(tagged)?));
        }
        Ok(Slot::Bucket(entries))
    }

    /// Encodes the slot into its store value (a bucket on the stack, a log on the heap).
    pub fn encode(&self) -> Encoded {
        match self {
            Slot::Bucket(entries) => {
                let mut out = [0u8; BUCKET_LEN];
                if let Some((version, rest)) = out.split_first_mut() {
                    *version = VERSION;
                    for (entry, raw) in entries.iter().zip(rest.chunks_exact_mut(ENTRY_LEN)) {
                        if let Some((fp, state)) = entry {
                            encode_entry(*fp, state, raw);
                        }
                    }
                }
                Encoded::Bucket(out)
            }
            Slot::Log(entry) => {
                let mut out = Vec::with_capacity(32 + 4 * sliding_log::MAX_LIMIT as usize);
                if let Some((fp, state)) = entry {
                    out.push(LOG_VERSION);
                    out.extend_from_slice(&fp.to_le_bytes());
                    state.encode(&mut out);
                }
                Encoded::Log(out)
            }
        }
    }

    /// The state stored for a fingerprint, if any.
    pub fn find(&self, fp: u64) -> Option<&State> {
        match self {
            Slot::Bucket(entries) => entries
                .iter()
                .flatten()
                .find(|(f, _)| *f == fp)
                .map(|(_, s)| s),
            Slot::Log(_) => None,
        }
    }

    /// The sliding log stored for a fingerprint, if any.
    pub fn find_log(&self, fp: u64) -> Option<&sliding_log::State> {
        match self {
            Slot::Log(Some((f, state))) if *f == fp => Some(state),
            _ => None,
        }
    }

    /// Whether `fp` can be stored at `now_ms` without losing another live key's log.
    pub fn has_room(&self, fp: u64, now_ms: u64) -> bool {
        match self {
            Slot::Bucket(_) => true,
            Slot::Log(None) => true,
            Slot::Log(Some((f, state))) => *f == fp || state.weight(now_ms).is_none(),
        }
    }

    /// Stores `state` for `fp`, evicting by the module's policy if a bucket is full.
    pub fn put(&mut self, fp: u64, state: State, now_ms: u64) -> Placement {
        match (self, state) {
            (Slot::Log(entry), State::SlidingLog(log)) => {
                let placement = match entry {
                    None => Placement::Filled,
                    Some((f, _)) if *f == fp => Placement::Updated,
                    Some((_, old)) if old.weight(now_ms).is_none() => Placement::Inserted,
                    Some(_) => return Placement::Full,
                };
                *entry = Some((fp, log));
                placement
            }
            (Slot::Log(_), _) | (Slot::Bucket(_), State::SlidingLog(_)) => Placement::Full,
            (Slot::Bucket(entries), state) => {
                if let Some(e) = entries.iter_mut().flatten().find(|(f, _)| *f == fp) {
                    e.1 = state;
                    return Placement::Updated;
                }
                // Rank: empty or expired first (weight 0), then fewest remembered requests, then
                // oldest.
                let rank = |e: &Option<(u64, State)>| match e {
                    None => (0, 0),
                    Some((_, s)) => (s.weight(now_ms).unwrap_or(0), s.last_ms()),
                };
                let Some(victim) = entries.iter_mut().min_by_key(|e| rank(e)) else {
                    return Placement::Full;
                };
                let placement = match (&victim, rank(victim).0) {
                    (None, _) => Placement::Filled,
                    (Some(_), 0) => Placement::Inserted,
                    (Some(_), _) => Placement::Evicted,
                };
                *victim = Some((fp, state));
                placement
            }
        }
    }
}

/// Decodes an entry's tag and state (the bytes after its fingerprint): also how other records
/// keep an algorithm's compact state ([`encode_state`]).
pub fn decode_state(tagged: &[u8]) -> Result<State, Corrupt> {
    let (&tag, state) = tagged.split_first().ok_or(Corrupt)?;
    let state = match tag {
        TAG_SLIDING_WINDOW => state
            .get(..sliding_window::STATE_LEN)
            .and_then(sliding_window::State::decode)
            .map(State::SlidingWindow),
        TAG_FIXED_WINDOW => state
            .get(..fixed_window::STATE_LEN)
            .and_then(fixed_window::State::decode)
            .map(State::FixedWindow),
        TAG_GCRA => state
            .get(..gcra::STATE_LEN)
            .and_then(gcra::State::decode)
            .map(State::Gcra),
        TAG_BLOCKED => state.first_chunk::<8>().map(|b| State::Blocked {
            until_ms: u64::from_le_bytes(*b),
        }),
        TAG_IN_FLIGHT => state
            .get(..in_flight::STATE_LEN)
            .and_then(in_flight::State::decode)
            .map(State::InFlight),
        TAG_LEASE => state
            .get(..lease::STATE_LEN)
            .and_then(lease::State::decode)
            .map(State::Lease),
        TAG_TENANT => state
            .get(..tenant::TENANT_LEN)
            .and_then(tenant::Tenant::decode)
            .map(State::Tenant),
        _ => None,
    };
    state.ok_or(Corrupt)
}

/// Looks a key up in a bucket's bytes without decoding the other entries: its entry's index
/// and state, or `None` if the bucket does not hold it. The whole bucket is checked as
/// [`Slot::decode`] checks it (version, length, every entry's tag), so a bucket this accepts is
/// one `decode` accepts. Missing or empty bytes are an empty bucket.
pub fn lookup(bytes: Option<&[u8]>, fp: u64) -> Result<Option<(usize, State)>, Corrupt> {
    let bytes = match bytes {
        None | Some([]) => return Ok(None),
        Some(b) => b,
    };
    let (&version, rest) = bytes.split_first().ok_or(Corrupt)?;
    if version != VERSION || rest.len() != WAYS * ENTRY_LEN {
        return Err(Corrupt);
    }
    let mut found = None;
    for (i, raw) in rest.chunks_exact(ENTRY_LEN).enumerate() {
        let (f, tagged) = raw.split_first_chunk::<8>().ok_or(Corrupt)?;
        let f = u64::from_le_bytes(*f);
        if f == 0 {
            continue;
        }
        if f == fp && found.is_none() {
            found = Some((i, decode_state(tagged)?));
        } else if !matches!(tagged.first(), Some(&(TAG_SLIDING_WINDOW..=TAG_TENANT))) {
            return Err(Corrupt);
        }
    }
    Ok(found)
}

/// Overwrites entry `i` of a bucket's bytes with `fp` and `state`, as [`Slot::encode`] writes
/// it; false (nothing written) if there is no entry `i` or `state` is a sliding log.
pub fn store_entry(bytes: &mut [u8; BUCKET_LEN], i: usize, fp: u64, state: &State) -> bool {
    if matches!(state, State::SlidingLog(_)) {
        return false;
    }
    let start = 1 + i * ENTRY_LEN;
    let Some(raw) = bytes.get_mut(start..start + ENTRY_LEN) else {
        return false;
    };
    raw.fill(0);
    encode_entry(fp, state, raw);
    true
}

fn encode_entry(fp: u64, state: &State, raw: &mut [u8]) {
    let (f, rest) = raw.split_at_mut(8);
    f.copy_from_slice(&fp.to_le_bytes());
    encode_state(state, rest);
}

/// Writes a compact state, its tag first, at the start of `out` (at least `TAGGED_LEN` bytes;
/// a sliding log, which has no compact state, writes nothing).
pub fn encode_state(state: &State, out: &mut [u8]) {
    let Some((tag, out)) = out.split_first_mut() else {
        return;
    };
    let (t, bytes): (u8, &[u8]) = match state {
        State::SlidingWindow(s) => (TAG_SLIDING_WINDOW, &s.encode()),
        State::FixedWindow(s) => (TAG_FIXED_WINDOW, &s.encode()),
        State::Gcra(s) => (TAG_GCRA, &s.encode()),
        State::Blocked { until_ms } => (TAG_BLOCKED, &until_ms.to_le_bytes()),
        State::InFlight(s) => (TAG_IN_FLIGHT, &s.encode()),
        State::Lease(s) => (TAG_LEASE, &s.encode()),
        State::Tenant(t) => (TAG_TENANT, &t.encode()),
        State::SlidingLog(_) => return,
    };
    *tag = t;
    if let Some(dst) = out.get_mut(..bytes.len()) {
        dst.copy_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_slot_kind_has_its_own_range() {
        for kind in [SlotKind::Bucket, SlotKind::Log, SlotKind::Health] {
            for n in [0, 1, 12_345, u64::from(u32::MAX), u64::MAX] {
                assert_eq!(SlotKind::of(kind.slot(n)), kind, "{kind:?} {n}");
            }
        }
        assert_eq!(SlotKind::of(LOG_SLOTS - 1), SlotKind::Bucket);
        assert_eq!(SlotKind::of(LOG_SLOTS), SlotKind::Log);
        assert_eq!(SlotKind::of(HEALTH_SLOTS - 1), SlotKind::Log);
        assert_eq!(SlotKind::of(HEALTH_SLOTS), SlotKind::Health);
        assert_eq!(SlotKind::Log.slot(7), LOG_SLOTS + 7);
    }

    fn st(last_ms: u64, current: u32) -> State {
        State::SlidingWindow(sliding_window::State {
            last_ms,
            window_ms: 60_000,
            current,
            previous: 0,
        })
    }

    fn bucket() -> Slot {
        Slot::Bucket(Default::default())
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let mut b = bucket();
        b.put(11, st(5, 3), 5);
        b.put(13, st(6, 1), 6);
        let g = State::Gcra(gcra::State {
            tat_ms: 9,
            tat_frac: 2,
            limit: 3,
            window_ms: 1000,
        });
        b.put(15, g.clone(), 6);
        let f = State::FixedWindow(fixed_window::State {
            last_ms: 7,
            window_ms: 1000,
            count: 2,
            to_end_ms: 993,
        });
        b.put(17, f, 7);
        let mut b2 = b.clone();
        assert_eq!(
            b2.put(13, State::Blocked { until_ms: 99 }, 8),
            Placement::Updated
        );
        assert_eq!(Slot::decode(0, Some(b2.encode().as_ref())), Ok(b2.clone()));
        let bytes = b.encode().as_ref().to_vec();
        assert_eq!(bytes.len(), BUCKET_LEN);
        assert_eq!(Slot::decode(0, Some(&bytes)), Ok(b.clone()));
        assert_eq!(b.find(13), Some(&st(6, 1)));
        assert_eq!(b.find(15), Some(&g));
        assert_eq!(b.find(19), None);
        assert_eq!(Slot::decode(0, None), Ok(bucket()));
        assert_eq!(Slot::decode(0, Some(&[])), Ok(bucket()));
        assert_eq!(Slot::decode(0, Some(&bytes[..50])), Err(Corrupt));
        let mut wrong_version = bytes.clone();
        wrong_version[0] = 9;
        assert_eq!(Slot::decode(0, Some(&wrong_version)), Err(Corrupt));
        let mut wrong_tag = bytes.clone();
        wrong_tag[1 + 8] = 77;
        assert_eq!(Slot::decode(0, Some(&wrong_tag)), Err(Corrupt));
    }

    #[test]
    fn log_slots_hold_one_live_key() {
        let log = |times: Vec<u64>| {
            State::SlidingLog(sliding_log::State {
                window_ms: 1_000,
                times,
            })
        };
        let mut s = Slot::decode(SlotKind::Log.slot(3), None).unwrap();
        assert_eq!(s.put(5, log(vec![10, 20]), 20), Placement::Filled);
        assert!(!s.has_room(7, 500));
        assert_eq!(s.put(7, log(vec![30]), 30), Placement::Full);
        assert_eq!(s.put(5, log(vec![10, 20, 30]), 30), Placement::Updated);
        let bytes = s.encode().as_ref().to_vec();
        assert_eq!(Slot::decode(LOG_SLOTS, Some(&bytes)), Ok(s.clone()));
        assert_eq!(s.find_log(5).map(|l| l.times.len()), Some(3));
        // Once the old log has expired, another key may take the slot.
        assert!(s.has_room(7, 2_000));
        assert_eq!(s.put(7, log(vec![2_000]), 2_000), Placement::Inserted);
        assert_eq!(Slot::decode(LOG_SLOTS, Some(&bytes[..10])), Err(Corrupt));
    }

    #[test]
    fn eviction_spares_heavy_hitters() {
        let now = 10_000;
        let mut b = bucket();
        assert_eq!(b.put(3, st(now, 100), now), Placement::Filled); // the heavy hitter
        for fp in [5, 7, 9] {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Filled);
        }
        // A flood of new keys only ever evicts light entries.
        for fp in (11..200).step_by(2) {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Evicted);
            assert_eq!(b.find(3), Some(&st(now, 100)));
        }
        // Expired entries go first, without counting as an eviction.
        let later = now + 200_000;
        assert_eq!(b.put(501, st(later, 1), later), Placement::Inserted);
        assert_ne!(b.put(3, st(later, 2), later), Placement::Evicted);
    }

    /// Keys share buckets of [`WAYS`] by their hash, so a table forgets some live keys before
    /// it is full: the figures the reference gives for `capacity`.
    #[test]
    fn a_table_forgets_a_few_keys_before_it_is_full() {
        let buckets = buckets_for(16_384);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        for (keys, low, high) in [(4_096, 0.2, 0.7), (8_192, 3.0, 4.5), (16_384, 18.0, 21.0)] {
            let mut table: Vec<Slot> = (0..buckets).map(|_| bucket()).collect();
            let mut evicted = 0;
            for _ in 0..keys {
                // xorshift64: keys as the keyed hash spreads them.
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let b = &mut table[bucket_of(rng, buckets) as usize];
                evicted += u32::from(b.put(fingerprint_of(rng), st(5, 1), 5) == Placement::Evicted);
            }
            let pct = 100.0 * f64::from(evicted) / f64::from(keys);
            assert!(
                (low..=high).contains(&pct),
                "{keys} keys: {pct:.2} % forgotten"
            );
        }
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
