//! The bounded table of client keys: a fixed number of buckets, each one store slot.
//!
//! Shared-data keys can never be deleted in Envoy, so key names must come from a fixed set: the
//! table has a fixed number of buckets ([`buckets_for`]: an eighth more entries than
//! `capacity`, in buckets of [`WAYS`]), and memory is fixed by `capacity` whatever keys clients
//! send. Each entry holds a key's full hash as a fingerprint and its algorithm's state.
//!
//! Two choices: a client key (already a keyed 64-bit hash) has two buckets ([`slots_of`]) and
//! lives in one of them. A new key goes to the one with fewer live
//! entries (the first on a tie), so buckets fill evenly and the table forgets no live key until
//! it is nearly full ([`tests::a_table_forgets_no_live_key_below_nine_tenths_full`]). A request
//! reads the first bucket, and the second only when the key is not in the first; one write
//! serves it. A key is never moved: it stays where it was placed until it is forgotten.
//!
//! A store that holds buckets for its caller (the native build's process table) places a new
//! key with both buckets held. Envoy's shared data writes one slot at a time with
//! compare-and-swap, so a new key placed in its second bucket is first announced in its first
//! (a [`Pending`] mark, written with compare-and-swap): any other request placing the same key
//! meanwhile either wrote the first bucket before the mark (and the mark's write fails, so the
//! key is found there on the next read) or finds the mark and reads the second bucket until the
//! key is there. A mark lapses after [`PENDING_MS`]; a worker that stalls longer than that
//! between the two writes is the one way a key could be placed twice (the copy in the first
//! bucket then wins, and what the other counted is lost).
//!
//! When a new key finds both its buckets full, the entry evicted from the chosen one is, in
//! this order: one whose state has expired, else the one remembering the fewest requests (so a
//! flood of new keys evicts its own kind first, and a heavy hitter being limited survives),
//! else the oldest.
//!
//! Forgotten is not forgiven: a live key evicted leaves a [`Ghost`] in its bucket (`table/ghost.rs`:
//! what it used, until when), and a key that comes back starts from it, not from a fresh
//! budget. Each entry keeps its rule's limit beside its state (a bucket's burst for GCRA), so
//! the table knows whether a key it forgets had reached it ("full"). The ghost is written in
//! the same write as the eviction, so no other request can see the key gone and its trace not
//! yet there.

use crate::limiter::{
    fixed_window, gcra, in_flight, lease, sliding_log, sliding_window, tenant, State, Trace,
};

mod ghost;

use ghost::{haunt, haunting, lay};
pub use ghost::{marks_of, rule_of, tag_of, weight_code, weight_of, Ghost};

/// Entries per bucket.
pub const WAYS: usize = 16;
/// Ghosts per bucket: traces of the live keys it forgot.
pub const GHOSTS: usize = 4;
/// Marks per bucket of keys being placed in their second bucket ([`Pending`]).
pub const PENDING: usize = 2;
/// How long a [`Pending`] mark holds, ms: far longer than a worker takes between its two
/// writes.
pub const PENDING_MS: u64 = 250;
/// Bucket format version, the first byte of every bucket. Version 4: buckets of 16, two
/// choices per key, merged ghosts that may list their keys (version 3, whose merged ghosts
/// were sets of marks, and versions 1 and 2, buckets of 4, under other store keys, are not
/// read).
pub const VERSION: u8 = 4;
/// The bytes of an empty bucket: what a bucket that is not one is reset to.
pub fn empty_bucket() -> [u8; BUCKET_LEN] {
    let mut bytes = [0u8; BUCKET_LEN];
    if let Some(v) = bytes.first_mut() {
        *v = VERSION;
    }
    bytes
}

/// Where a host that names its store's values (Envoy's shared data) keeps this layout's
/// buckets: under a name of their own, so that buckets of another layout (a plugin upgraded in
/// place, whose old VMs still serve) are never read as these.
pub const BUCKET_NAME: &str = "b4/";
/// Log slot format version, the first byte of every sliding-log slot.
pub const LOG_VERSION: u8 = 1;
/// The longest compact state (sliding window and GCRA: 20 bytes), padded.
const STATE_LEN: usize = 23;
/// A compact state with its tag.
pub const TAGGED_LEN: usize = 1 + STATE_LEN;
/// Bytes per entry: fingerprint (8), algorithm tag (1), state.
pub const ENTRY_LEN: usize = 8 + 1 + STATE_LEN;
/// Bytes per ghost: tag (4), flags (1: merged, full, blocked, of one rule, and in bits 4-5
/// a merged ghost's list of 2 or 3 keys), weight (2, [`weight_code`]; a merged ghost of one
/// rule: the rule's tag), until (4, whole seconds since the epoch, rounded up; 0: no ghost).
pub const GHOST_LEN: usize = 11;
/// Bytes per pending mark: tag (4), until (4, the low 32 bits of ms since the epoch).
pub const PENDING_LEN: usize = 8;
/// Bytes per bucket.
pub const BUCKET_LEN: usize = 1 + WAYS * ENTRY_LEN + GHOSTS * GHOST_LEN + PENDING * PENDING_LEN;
/// Where an entry keeps its rule's limit ([`limit_code`], 2 bytes; 0: not known): after its
/// fingerprint, tag and a state of at most 20 bytes (every state a ghost can stand for).
const LIMIT_AT: usize = 8 + 1 + 20;
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

/// The number of buckets for a configured capacity: an eighth more entries than `capacity`,
/// rounded up to whole buckets (two choices fill buckets evenly, and the eighth keeps every live
/// key until the table holds nine tenths of `capacity`).
pub fn buckets_for(capacity: u32) -> u32 {
    let entries = u64::from(capacity) + u64::from(capacity).div_ceil(8);
    u32::try_from(entries.div_ceil(WAYS as u64))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// A key hash's first bucket.
pub fn bucket_of(key_hash: u64, buckets: u32) -> u32 {
    u32::try_from(slots_of(key_hash, buckets).0).unwrap_or(0)
}

/// Both buckets of a key hash, as store slots: its first, scaled from the hash's low 32 bits,
/// and its second, scaled from the high half of the hash multiplied by an odd constant (so that
/// it depends on every bit below, and keys sharing a first bucket spread over the others);
/// never the first unless there is one bucket. Multiplications and shifts, not a division: every
/// request computes both.
#[inline]
pub fn slots_of(key_hash: u64, buckets: u32) -> (u64, u64) {
    let n = u64::from(buckets.max(1));
    let first = ((key_hash & 0xffff_ffff) * n) >> 32;
    let mixed = key_hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
    let mut second = (mixed * n) >> 32;
    if second == first {
        second = if second + 1 < n { second + 1 } else { 0 };
    }
    (first, second)
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

/// A slot's store value. A bucket is encoded on the stack for a request: boxing it to make the
/// enum smaller would cost an allocation each time.
#[allow(clippy::large_enum_variant)]
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

/// What one store slot holds. A bucket is decoded on the stack for a request: boxing it to
/// make the enum smaller would cost an allocation each time.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Up to [`WAYS`] keys with compact state, each key's limit ([`limit_code`], 0: not
    /// known), the ghosts of keys it forgot, and the marks of keys being placed in their
    /// second bucket.
    Bucket(
        [Option<(u64, State)>; WAYS],
        [u16; WAYS],
        [Ghost; GHOSTS],
        [Pending; PENDING],
    ),
    /// One key's sliding log.
    Log(Option<(u64, sliding_log::State)>),
}

impl Slot {
    /// Decodes the bytes of store slot `slot`; a missing or empty slot is empty.
    pub fn decode(slot: u64, bytes: Option<&[u8]>) -> Result<Slot, Corrupt> {
        let log = SlotKind::of(slot) != SlotKind::Bucket;
        let bytes = match bytes {
            None | Some([]) if log => return Ok(Slot::Log(None)),
            None | Some([]) => {
                return Ok(Slot::Bucket(
                    Default::default(),
                    [0; WAYS],
                    Default::default(),
                    Default::default(),
                ))
            }
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
        let (raw_entries, raw_ghosts, raw_pending) = split_bucket(version, rest)?;
        let mut entries: [Option<(u64, State)>; WAYS] = Default::default();
        let mut limits = [0u16; WAYS];
        for ((entry, limit), raw) in entries
            .iter_mut()
            .zip(limits.iter_mut())
            .zip(raw_entries.chunks_exact(ENTRY_LEN))
        {
            let (fp, tagged) = raw.split_first_chunk::<8>().ok_or(Corrupt)?;
            let fp = u64::from_le_bytes(*fp);
            if fp == 0 {
                continue;
            }
            let state = decode_state(tagged)?;
            *limit = limit_in(raw, &state);
            *entry = Some((fp, state));
        }
        let mut ghosts = [Ghost::default(); GHOSTS];
        for (ghost, raw) in ghosts.iter_mut().zip(raw_ghosts.chunks_exact(GHOST_LEN)) {
            *ghost = Ghost::decode(raw);
        }
        let mut pending = [Pending::default(); PENDING];
        for (p, raw) in pending
            .iter_mut()
            .zip(raw_pending.chunks_exact(PENDING_LEN))
        {
            *p = Pending::decode(raw);
        }
        Ok(Slot::Bucket(entries, limits, ghosts, pending))
    }

    /// Encodes the slot into its store value (a bucket on the stack, a log on the heap).
    pub fn encode(&self) -> Encoded {
        match self {
            Slot::Bucket(entries, limits, ghosts, pending) => {
                let mut out = [0u8; BUCKET_LEN];
                if let Some((version, rest)) = out.split_first_mut() {
                    *version = VERSION;
                    let (raw_entries, rest) = rest.split_at_mut(WAYS * ENTRY_LEN);
                    let (raw_ghosts, raw_pending) = rest.split_at_mut(GHOSTS * GHOST_LEN);
                    for (p, raw) in pending
                        .iter()
                        .zip(raw_pending.chunks_exact_mut(PENDING_LEN))
                    {
                        p.encode(raw);
                    }
                    let raw_entries = raw_entries.chunks_exact_mut(ENTRY_LEN);
                    for ((entry, limit), raw) in entries.iter().zip(limits).zip(raw_entries) {
                        if let Some((fp, state)) = entry {
                            encode_entry(*fp, state, *limit, raw);
                        }
                    }
                    for (ghost, raw) in ghosts.iter().zip(raw_ghosts.chunks_exact_mut(GHOST_LEN)) {
                        ghost.encode(raw);
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
            Slot::Bucket(entries, ..) => entries
                .iter()
                .flatten()
                .find(|(f, _)| *f == fp)
                .map(|(_, s)| s),
            Slot::Log(_) => None,
        }
    }

    /// What the bucket's ghosts hold for a fingerprint it does not hold at `now_ms` (the larger
    /// of each figure, if several stand for it), if any.
    pub fn ghost(&self, fp: u64, now_ms: u64) -> Option<Trace> {
        match self {
            Slot::Bucket(_, _, ghosts, _) => haunting(ghosts.iter().copied(), fp, now_ms),
            Slot::Log(_) => None,
        }
    }

    /// The bucket's [`Load`] at `now_ms` (a log's: none).
    pub fn load(&self, now_ms: u64) -> Load {
        match self {
            Slot::Bucket(entries, ..) => {
                load_of(entries.iter().flatten().map(|(_, s)| s.weight(now_ms)))
            }
            Slot::Log(_) => (0, 0),
        }
    }

    /// Whether the bucket holds a live mark for `fp` at `now_ms` ([`announced`]).
    pub fn announced(&self, fp: u64, now_ms: u64) -> bool {
        match self {
            Slot::Bucket(.., marks) => Pending::holds(marks, fp, now_ms),
            Slot::Log(_) => false,
        }
    }

    /// Marks `fp` as being placed in its second bucket ([`announce`]); false when both marks
    /// hold for other keys (or this is a log).
    pub fn announce(&mut self, fp: u64, now_ms: u64) -> bool {
        match self {
            Slot::Bucket(.., marks) => Pending::place(marks, fp, now_ms),
            Slot::Log(_) => false,
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
            Slot::Bucket(..) => true,
            Slot::Log(None) => true,
            Slot::Log(Some((f, state))) => *f == fp || state.weight(now_ms).is_none(),
        }
    }

    /// Stores `state` for `fp`, evicting by the module's policy if a bucket is full; the key's
    /// limit, if it had one, is kept.
    pub fn put(&mut self, fp: u64, state: State, now_ms: u64) -> Placement {
        self.put_limited(fp, state, 0, now_ms)
    }

    /// [`Slot::put`] with the key's limit ([`limit_code`]; 0: keep the one it had, if any).
    pub fn put_limited(&mut self, fp: u64, state: State, limit: u16, now_ms: u64) -> Placement {
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
            (Slot::Log(_), _) | (Slot::Bucket(..), State::SlidingLog(_)) => Placement::Full,
            (Slot::Bucket(entries, limits, ghosts, _), state) => {
                let found = entries
                    .iter()
                    .position(|e| e.as_ref().is_some_and(|(f, _)| *f == fp));
                if let Some(i) = found {
                    if let (Some(e), Some(l)) = (entries.get_mut(i), limits.get_mut(i)) {
                        *e = Some((fp, state));
                        if limit != 0 {
                            *l = limit;
                        }
                    }
                    return Placement::Updated;
                }
                lay(ghosts, fp, &state, now_ms);
                // Rank: empty or expired first (weight 0), then fewest remembered requests, then
                // oldest.
                let rank = |e: &Option<(u64, State)>| match e {
                    None => (0, 0),
                    Some((_, s)) => (s.weight(now_ms).unwrap_or(0), s.last_ms()),
                };
                let Some((victim, victim_limit)) = entries
                    .iter_mut()
                    .zip(limits.iter_mut())
                    .min_by_key(|(e, _)| rank(e))
                else {
                    return Placement::Full;
                };
                let placement = match (&victim, rank(victim).0) {
                    (None, _) => Placement::Filled,
                    (Some(_), 0) => Placement::Inserted,
                    (Some(_), _) => Placement::Evicted,
                };
                if let Some((gone, s)) = victim.as_ref() {
                    if let Some(trace) = s.trace(now_ms) {
                        let ghost = Ghost::of(*gone, &trace, *victim_limit);
                        haunt(ghosts, ghost, now_ms);
                    }
                }
                *victim = Some((fp, state));
                *victim_limit = limit;
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
/// and state, or `None` if the bucket does not hold it. The bucket's version and length are
/// checked, and the key's own entry; the other entries only by [`Slot::decode`], when a key is
/// placed (a bucket that then fails to decode is reset). Missing or empty bytes are an empty
/// bucket.
pub fn lookup(bytes: Option<&[u8]>, fp: u64) -> Result<Option<(usize, State)>, Corrupt> {
    let bytes = match bytes {
        None | Some([]) => return Ok(None),
        Some(b) => b,
    };
    let (&version, rest) = bytes.split_first().ok_or(Corrupt)?;
    let (entries, _, _) = split_bucket(version, rest)?;
    if fp == 0 {
        return Ok(None); // the mark of an empty entry; no key's
    }
    for (i, raw) in entries.chunks_exact(ENTRY_LEN).enumerate() {
        if let Some((f, tagged)) = raw.split_first_chunk::<8>() {
            // An empty entry's fingerprint is 0, which no key has.
            if u64::from_le_bytes(*f) == fp {
                return Ok(Some((i, decode_state(tagged)?)));
            }
        }
    }
    Ok(None)
}

/// What the ghosts in a bucket's bytes hold for a fingerprint at `now_ms` ([`Slot::ghost`]);
/// `None` for bytes that are no bucket (as [`lookup`] checks them).
pub fn ghost_in(bytes: Option<&[u8]>, fp: u64, now_ms: u64) -> Option<Trace> {
    let (&version, rest) = bytes?.split_first()?;
    let (_, ghosts, _) = split_bucket(version, rest).ok()?;
    haunting(
        ghosts.chunks_exact(GHOST_LEN).map(Ghost::decode),
        fp,
        now_ms,
    )
}

/// A bucket's parts: its entries, its ghosts and its pending marks.
type Parts<'a> = (&'a [u8], &'a [u8], &'a [u8]);

/// A bucket's bytes after its version: its entries, its ghosts and its pending marks.
fn split_bucket(version: u8, rest: &[u8]) -> Result<Parts<'_>, Corrupt> {
    if version != VERSION || rest.len() != BUCKET_LEN - 1 {
        return Err(Corrupt);
    }
    let (entries, rest) = rest.split_at(WAYS * ENTRY_LEN);
    let (ghosts, pending) = rest.split_at(GHOSTS * GHOST_LEN);
    Ok((entries, ghosts, pending))
}

/// A mark in a key's first bucket: the key is being placed in its second bucket, until
/// `until` (see the module's documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// The key's mark ([`pending_tag`]).
    pub tag: u32,
    /// When the mark lapses: the low 32 bits of ms since the epoch (0: no mark).
    pub until: u32,
}

impl Pending {
    /// Whether the mark holds at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        // The low 32 bits wrap every 49 days: the time left, as a distance that is at most
        // PENDING_MS for a live mark (a mark left behind never comes back to life).
        let left = u64::from(self.until.wrapping_sub(now_ms as u32));
        self.until != 0 && left > 0 && left <= PENDING_MS
    }

    fn encode(&self, out: &mut [u8]) {
        let [t0, t1, t2, t3] = self.tag.to_le_bytes();
        let [u0, u1, u2, u3] = self.until.to_le_bytes();
        if let Some(dst) = out.get_mut(..PENDING_LEN) {
            dst.copy_from_slice(&[t0, t1, t2, t3, u0, u1, u2, u3]);
        }
    }

    /// Never fails: any 8 bytes are some mark.
    fn decode(raw: &[u8]) -> Pending {
        let b = |i: usize| raw.get(i).copied().unwrap_or(0);
        Pending {
            tag: u32::from_le_bytes([b(0), b(1), b(2), b(3)]),
            until: u32::from_le_bytes([b(4), b(5), b(6), b(7)]),
        }
    }

    /// Whether `marks` hold a live mark for the key `fp` at `now_ms`.
    fn holds(marks: &[Pending], fp: u64, now_ms: u64) -> bool {
        let tag = pending_tag(fp);
        marks.iter().any(|p| p.tag == tag && p.live(now_ms))
    }

    /// Marks the key `fp` in `marks` until [`PENDING_MS`] from `now_ms`: in a place whose mark
    /// has lapsed (or the key's own); false, nothing changed, when every mark holds for
    /// another key.
    fn place(marks: &mut [Pending], fp: u64, now_ms: u64) -> bool {
        let tag = pending_tag(fp);
        let until = match (now_ms.wrapping_add(PENDING_MS)) as u32 {
            0 => 1,
            u => u,
        };
        match marks.iter_mut().find(|p| p.tag == tag || !p.live(now_ms)) {
            Some(p) => {
                *p = Pending { tag, until };
                true
            }
            None => false,
        }
    }

    /// Takes the key `fp`'s mark out of `marks`; false when there is none.
    fn take(marks: &mut [Pending], fp: u64) -> bool {
        let tag = pending_tag(fp);
        match marks.iter_mut().find(|p| p.until != 0 && p.tag == tag) {
            Some(p) => {
                *p = Pending::default();
                true
            }
            None => false,
        }
    }
}

/// Where a bucket's bytes keep their marks (after the version, the entries and the ghosts).
const MARKS_AT: usize = BUCKET_LEN - PENDING * PENDING_LEN;

/// The marks in a bucket's bytes; none for bytes that are no bucket of this version.
fn marks_in(bytes: Option<&[u8]>) -> [Pending; PENDING] {
    let mut marks = [Pending::default(); PENDING];
    if let Some(raw) = bytes
        .filter(|b| b.len() == BUCKET_LEN && b.first() == Some(&VERSION))
        .and_then(|b| b.get(MARKS_AT..))
    {
        for (p, raw) in marks.iter_mut().zip(raw.chunks_exact(PENDING_LEN)) {
            *p = Pending::decode(raw);
        }
    }
    marks
}

/// `change` on the marks in a bucket's bytes, written back when it says it changed them.
fn with_marks(
    bytes: &mut [u8; BUCKET_LEN],
    change: impl FnOnce(&mut [Pending; PENDING]) -> bool,
) -> bool {
    let mut marks = marks_in(Some(&bytes[..]));
    if bytes.first() != Some(&VERSION) || !change(&mut marks) {
        return false;
    }
    if let Some(raw) = bytes.get_mut(MARKS_AT..) {
        for (p, raw) in marks.iter().zip(raw.chunks_exact_mut(PENDING_LEN)) {
            p.encode(raw);
        }
    }
    true
}

/// The 32 bits of a fingerprint a pending mark keeps: both halves folded, so that two keys
/// share one about once in 2³² pairs.
pub fn pending_tag(fp: u64) -> u32 {
    (fp ^ (fp >> 32)) as u32
}

/// Whether a bucket's bytes hold a live mark for the key `fp` at `now_ms`: the key is being
/// placed in its second bucket by another request.
pub fn announced(bytes: Option<&[u8]>, fp: u64, now_ms: u64) -> bool {
    Pending::holds(&marks_in(bytes), fp, now_ms)
}

/// Marks in a bucket's bytes that the key `fp` is being placed in its second bucket, until
/// [`PENDING_MS`] from `now_ms` ([`Slot::announce`]). False, nothing written, when both marks
/// hold for other keys (or the bytes are no bucket).
pub fn announce(bytes: &mut [u8; BUCKET_LEN], fp: u64, now_ms: u64) -> bool {
    with_marks(bytes, |marks| Pending::place(marks, fp, now_ms))
}

/// Takes the mark of the key `fp` out of a bucket's bytes, once it is placed in its second
/// bucket; false (nothing written) when the bytes hold none (or are no bucket).
pub fn withdraw(bytes: &mut [u8; BUCKET_LEN], fp: u64) -> bool {
    with_marks(bytes, |marks| Pending::take(marks, fp))
}

/// How full a bucket is, for a new key choosing between its two: its live keys (a key whose
/// state no longer counts is room), then what the key it would forget weighs (0 while it has
/// room). A new key goes to the bucket of the smaller load: the emptier one, or, both full, the
/// one whose lightest key is lighter.
pub type Load = (usize, u64);

/// The load of a bucket whose entries' weights are `weights` (`None`: expired).
fn load_of(weights: impl Iterator<Item = Option<u64>>) -> Load {
    let (mut live, mut lightest) = (0usize, u64::MAX);
    for w in weights.flatten() {
        live += 1;
        lightest = lightest.min(w);
    }
    (live, if live < WAYS { 0 } else { lightest })
}

/// A bucket's [`Load`] at `now_ms` from its bytes; `None` for bytes that are no bucket.
/// Missing or empty bytes are an empty bucket.
pub fn load(bytes: Option<&[u8]>, now_ms: u64) -> Option<Load> {
    let bytes = match bytes {
        None | Some([]) => return Some((0, 0)),
        Some(b) => b,
    };
    let (&version, rest) = bytes.split_first()?;
    let (entries, _, _) = split_bucket(version, rest).ok()?;
    let mut states = [None; WAYS];
    for (w, raw) in states.iter_mut().zip(entries.chunks_exact(ENTRY_LEN)) {
        let (f, tagged) = raw.split_first_chunk::<8>()?;
        if u64::from_le_bytes(*f) != 0 {
            *w = decode_state(tagged).ok()?.weight(now_ms);
        }
    }
    Some(load_of(states.into_iter()))
}

/// Overwrites entry `i` of a bucket's bytes with `fp` and `state`, as [`Slot::encode`] writes
/// it, with the key's limit (0: keep the one the entry had); false (nothing written) if there is
/// no entry `i` or `state` is a sliding log.
pub fn store_entry(
    bytes: &mut [u8; BUCKET_LEN],
    i: usize,
    fp: u64,
    state: &State,
    limit: u16,
) -> bool {
    if matches!(state, State::SlidingLog(_)) {
        return false;
    }
    let start = 1 + i * ENTRY_LEN;
    let Some(raw) = bytes.get_mut(start..start + ENTRY_LEN) else {
        return false;
    };
    let limit = match (limit, raw.get(LIMIT_AT..LIMIT_AT + 2)) {
        (0, Some(&[a, b])) => u16::from_le_bytes([a, b]),
        (l, _) => l,
    };
    raw.fill(0);
    encode_entry(fp, state, limit, raw);
    true
}

fn encode_entry(fp: u64, state: &State, limit: u16, raw: &mut [u8]) {
    let (f, rest) = raw.split_at_mut(8);
    f.copy_from_slice(&fp.to_le_bytes());
    encode_state(state, rest);
    if traced(state) {
        if let Some(dst) = raw.get_mut(LIMIT_AT..LIMIT_AT + 2) {
            dst.copy_from_slice(&limit.to_le_bytes());
        }
    }
}

/// Whether a state leaves a ghost when forgotten, and has room for its key's limit beside it.
fn traced(state: &State) -> bool {
    matches!(
        state,
        State::SlidingWindow(_) | State::FixedWindow(_) | State::Gcra(_) | State::InFlight(_)
    )
}

/// The limit kept in an entry's bytes (0 for a state that keeps none).
fn limit_in(raw: &[u8], state: &State) -> u16 {
    match raw.get(LIMIT_AT..LIMIT_AT + 2) {
        Some(&[a, b]) if traced(state) => u16::from_le_bytes([a, b]),
        _ => 0,
    }
}

/// A limit in 16 bits, rounded down (a key whose weight reaches the code's value has reached
/// its limit); 0 stays 0 (no limit known), and any limit above 0 codes as at least 1.
#[inline]
pub fn limit_code(limit: u64) -> u16 {
    if limit < 0x800 {
        return u16::try_from(limit).unwrap_or(0); // exact
    }
    let up = weight_code(limit);
    if weight_of(up) > limit {
        up.saturating_sub(1).max(u16::from(limit > 0))
    } else {
        up
    }
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
    use crate::limiter::Policy;

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
        Slot::Bucket(
            Default::default(),
            [0; WAYS],
            Default::default(),
            Default::default(),
        )
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
        for fp in (0..WAYS as u64 - 1).map(|i| 5 + 2 * i) {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Filled);
        }
        // A flood of new keys only ever evicts light entries.
        for fp in (101..400).step_by(2) {
            assert_eq!(b.put(fp, st(now, 1), now), Placement::Evicted);
            assert_eq!(b.find(3), Some(&st(now, 100)));
        }
        // Expired entries go first, without counting as an eviction.
        let later = now + 200_000;
        assert_eq!(b.put(501, st(later, 1), later), Placement::Inserted);
        assert_ne!(b.put(3, st(later, 2), later), Placement::Evicted);
    }

    /// Places `keys` new keys, each in the less loaded of its two buckets (as the engine
    /// does), in a table for `capacity`; how many were placed before the first live key was
    /// evicted, and how many live keys were evicted in all.
    fn fill(capacity: u32, keys: u32, seed: u64) -> (u32, u32) {
        let buckets = buckets_for(capacity);
        let mut table: Vec<Slot> = (0..buckets).map(|_| bucket()).collect();
        let mut rng = crate::testkit::Rng(seed);
        let (mut first, mut evicted) = (keys, 0);
        for n in 0..keys {
            let hash = rng.next();
            let (a, b) = slots_of(hash, buckets);
            let live = |s: &Slot| load(Some(s.encode().as_ref()), 5).unwrap();
            let at = if live(&table[b as usize]) < live(&table[a as usize]) {
                b
            } else {
                a
            };
            let placed = table[at as usize].put(fingerprint_of(hash), st(5, 1), 5);
            if placed == Placement::Evicted {
                first = first.min(n);
                evicted += 1;
            }
        }
        (first, evicted)
    }

    /// Two choices of buckets of [`WAYS`] and an eighth more entries than `capacity`: no live
    /// key is forgotten until the table holds nine tenths of `capacity` (the first eviction,
    /// over many seeds), and few after (the reference's figures for `capacity`).
    #[test]
    fn a_table_forgets_no_live_key_below_nine_tenths_full() {
        for capacity in [64u32, 1_024, 16_384] {
            let mut firsts = Vec::new();
            for seed in 1..=20u64 {
                let (first, _) = fill(capacity, capacity, seed * 0x9e37_79b9);
                firsts.push(f64::from(first) / f64::from(capacity));
            }
            firsts.sort_by(f64::total_cmp);
            eprintln!(
                "capacity {capacity}: first eviction at {:.1} % (min), {:.1} % (median) full",
                100.0 * firsts[0],
                100.0 * firsts[firsts.len() / 2]
            );
            // A table of 64 has 5 buckets: its fill is lumpier.
            let floor = if capacity < 1_000 { 0.75 } else { 0.9 };
            assert!(firsts[0] >= floor, "capacity {capacity}: {firsts:?}");
        }
        // Full, and twice over: the share of keys forgotten.
        for (keys, high) in [(16_384u32, 1.0), (32_768, 51.0)] {
            let (_, evicted) = fill(16_384, keys, 7);
            let pct = 100.0 * f64::from(evicted) / f64::from(keys);
            eprintln!("{keys} keys in a table of 16,384: {pct:.2} % forgotten");
            assert!(pct <= high, "{keys} keys: {pct:.2} % forgotten");
        }
    }

    fn sw_full(last_ms: u64) -> State {
        st(last_ms, 5)
    }

    /// The key forgotten leaves its trace; one-off keys' traces are dropped, lightest first,
    /// while none is full; once one is, none is dropped and merged ghosts refuse their keys.
    #[test]
    fn evicted_keys_leave_ghosts_that_light_floods_drop_and_full_ones_keep() {
        let now = 10_000;
        let limit = limit_code(5);
        let mut b = bucket();
        let first: Vec<u64> = (0..WAYS as u64).map(|i| 3 + 2 * i).collect();
        for &fp in &first {
            b.put_limited(fp << 32 | 1, sw_full(now), limit, now);
        }
        // As many more keys at their limit push the first ones out: every trace is kept.
        for fp in (0..WAYS as u64).map(|i| 3 + 2 * (WAYS as u64 + i)) {
            b.put_limited(fp << 32 | 1, sw_full(now + 1), limit, now + 1);
        }
        for &fp in &first {
            let t = b.ghost(fp << 32 | 1, now + 2).expect("a trace");
            assert!(t.weight >= 5, "{fp}: {t:?}");
        }
        assert!(b.find(3 << 32 | 1).is_none());
        // One-off keys in a bucket of light traces: the lightest traces go, nobody is refused.
        let mut light = bucket();
        for fp in 1..=40u64 {
            light.put_limited(fp << 32 | 1, st(now, 1), limit, now);
            if let Slot::Bucket(_, _, ghosts, _) = &light {
                assert!(ghosts.iter().all(|g| !g.merged && !g.full), "{ghosts:?}");
            }
        }
        assert!(light.ghost(41 << 32 | 1, now).is_none_or(|t| t.weight <= 1));
        // A key that comes back takes its own ghost back once its state holds what it did.
        let mut back = bucket();
        let last = 3 + 2 * WAYS as u64;
        for fp in (0..=WAYS as u64).map(|i| 3 + 2 * i) {
            back.put_limited(fp << 32 | 1, st(now, 2), limit, now);
        }
        let t = back.ghost(3 << 32 | 1, now).expect("3 was forgotten");
        back.put_limited(last << 32 | 1, st(now, 1), limit, now); // keeps its entry
        let seeded = Policy::SlidingWindow {
            limit: 5,
            window_ms: 60_000,
        }
        .seeded(&t, now)
        .unwrap();
        assert_eq!(
            back.put_limited(3 << 32 | 1, seeded, limit, now),
            Placement::Evicted
        );
        assert!(back.ghost(3 << 32 | 1, now).is_none_or(|g| g.weight >= 2));
    }

    #[test]
    fn pending_marks_hold_for_their_time_and_make_room_after() {
        let mut bytes = [0u8; BUCKET_LEN];
        bytes[0] = VERSION;
        let (k1, k2, k3) = (
            0x0001_0002_0000_0001u64,
            0x0001_0003_0000_0001,
            0x0001_0004_0000_0001,
        );
        let now = (1u64 << 32) - 100; // the low 32 bits wrap while the marks hold
        assert!(announce(&mut bytes, k1, now));
        assert!(announce(&mut bytes, k2, now + 1));
        assert!(!announce(&mut bytes, k3, now + 2), "both marks hold");
        assert!(
            announce(&mut bytes, k1, now + 3),
            "a key renews its own mark"
        );
        assert!(announced(Some(&bytes), k1, now + PENDING_MS));
        assert!(!announced(Some(&bytes), k3, now));
        assert!(!announced(Some(&bytes), k2, now + 1 + PENDING_MS), "lapsed");
        assert!(announce(&mut bytes, k3, now + 1 + PENDING_MS));
        // Marks survive a decode and an encode (another key's write through the decoded bucket).
        let mut s = Slot::decode(0, Some(&bytes)).unwrap();
        s.put(99, st(now, 1), now);
        assert!(announced(
            Some(s.encode().as_ref()),
            k3,
            now + 2 + PENDING_MS
        ));
        assert_eq!(load(Some(s.encode().as_ref()), now), Some((1, 0)));
        assert_eq!(load(None, now), Some((0, 0)));
        assert_eq!(load(Some(&bytes[..40]), now), None);
        // Full: the lightest key's weight.
        let mut full = bucket();
        for i in 0..WAYS as u64 {
            full.put(101 + 2 * i, st(now, 3 + u32::try_from(i).unwrap()), now);
        }
        assert_eq!(full.load(now), (WAYS, 3));
        assert_eq!(load(Some(full.encode().as_ref()), now), Some((WAYS, 3)));
    }

    #[test]
    fn bucket_math() {
        assert_eq!(BUCKET_NAME, format!("b{VERSION}/"));
        assert_eq!(buckets_for(16_384), 1_152);
        assert_eq!(buckets_for(64), 5);
        assert_eq!(buckets_for(1), 1);
        assert_eq!(buckets_for(15), 2);
        assert!(bucket_of(u64::MAX, 7) < 7);
        let mut rng = crate::testkit::Rng(3);
        for buckets in [1u32, 2, 5, 1_152] {
            for _ in 0..1_000 {
                let hash = rng.next();
                let (a, b) = slots_of(hash, buckets);
                assert_eq!(a, u64::from(bucket_of(hash, buckets)));
                assert!(a < u64::from(buckets) && b < u64::from(buckets));
                assert!(a != b || buckets == 1);
            }
        }
        assert_eq!(fingerprint_of(2), 3);
    }
}
