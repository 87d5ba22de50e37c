//! Where per-key state lives: a versioned byte store with compare-and-swap.
//!
//! The semantics are those of proxy-wasm shared data in Envoy, quirks included, so that the
//! in-memory implementation used by native tests fails the same way Envoy would:
//! - every write gets a new CAS value;
//! - a write with CAS 0 is unconditional; any other CAS must equal the stored one...
//! - ...except when the key does not exist yet: then the CAS is ignored and the write succeeds.
//!   The table therefore creates keys with [`CREATE_CAS`], a value no live key carries, so the
//!   second of two racing creators gets a conflict instead of silently overwriting the first.
//!
//! Three implementations: proxy-wasm shared data (the wasm host's), [`ProcessStore`] (the native
//! host's: a process-global array of buckets, each behind its own lock) and [`MemoryStore`] (a map
//! with Envoy's exact semantics, for tests).

use crate::error::StoreFault;
use crate::table::{SlotKind, BUCKET_LEN};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The CAS the table passes when creating a key. Envoy's counter would need 4 billion writes
/// to hand out this value, so an existing key virtually never matches it.
pub const CREATE_CAS: u32 = u32::MAX;

/// Compare-and-swap attempts on one slot before the store is deemed unable to decide
/// ([`Store::replace`], and the engine's own loops).
pub const MAX_ATTEMPTS: u32 = 32;

/// How many buckets one caller holds at once without allocating ([`Held`]); the engine keeps
/// its working lists for a request's rules on the stack up to as many (a request with many
/// rules need not allocate them).
pub const HELD_INLINE: usize = 32;

/// Why a store operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Another writer changed the value since it was read.
    Conflict,
    /// The store itself failed.
    Unavailable(StoreFault),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Conflict => f.write_str("changed since it was read"),
            StoreError::Unavailable(why) => why.fmt(f),
        }
    }
}

impl std::error::Error for StoreError {}

/// A versioned byte store with compare-and-swap; slots are numbered.
pub trait Store {
    /// Calls `f` with the value of `slot` and its CAS (`None, None` when the slot was never
    /// written), without copying the value where the store can avoid it.
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, StoreError>;
    /// Writes `value` if the slot's CAS still equals `cas` (0: unconditionally).
    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError>;

    /// Reads `slot`, lets `f` decide on its value (`None`: never written) and writes the new
    /// value `f` leaves in `value`, with compare-and-swap; while another writer wins the race,
    /// reads and decides again, up to `attempts` times (then [`StoreError::Conflict`]). `f`
    /// returns its result and whether to write `value` (the caller's buffer, so that a bucket's
    /// bytes stay on its stack instead of moving through results), and sees each attempt, so it
    /// can count them. A slot created here is created with [`CREATE_CAS`]: of two racing
    /// creators, the second decides again on the first one's value.
    fn replace<B: AsRef<[u8]>, T>(
        &self,
        slot: u64,
        attempts: u32,
        value: &mut B,
        mut f: impl FnMut(Option<&[u8]>, &mut B) -> (T, bool),
    ) -> Result<T, StoreError> {
        for _ in 0..attempts {
            let ((result, write), cas) = self.read(slot, |bytes, cas| {
                (f(bytes, value), cas.unwrap_or(CREATE_CAS))
            })?;
            if !write {
                return Ok(result);
            }
            match self.write(slot, value.as_ref(), cas) {
                Ok(()) => return Ok(result),
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Conflict)
    }

    /// [`Store::replace`] of a value `f` changes where it lies: `f` gets the value (empty if
    /// the slot was never written) and whether it was written, and returns its result and
    /// whether it changed the value (it must not change it otherwise). The default copies what
    /// [`Store::read`] lends into a buffer of its own; a store that reads into a buffer it owns
    /// (Envoy's shared data) hands `f` that one, a copy fewer.
    fn update_value<T>(
        &self,
        slot: u64,
        attempts: u32,
        mut f: impl FnMut(&mut Vec<u8>, bool) -> (T, bool),
    ) -> Result<T, StoreError> {
        let mut value = Vec::new();
        self.replace(slot, attempts, &mut value, |bytes, value| {
            value.clear();
            value.extend_from_slice(bytes.unwrap_or_default());
            f(value, bytes.is_some())
        })
    }

    /// Runs `f` on the bucket in store slot `slot` (a [`SlotKind::Bucket`]) while
    /// this store holds it for the caller alone, if it can: `f` gets the bucket's bytes and
    /// whether the slot was ever written (if not, the bytes are all zero), and returns its
    /// result and whether it changed the bytes (it must not change them otherwise). `None` when
    /// the store cannot hold a slot so (Envoy's shared data): the caller reads, then writes with
    /// the CAS it read. One step instead of two, no copies, no lost races.
    fn locked<T>(
        &self,
        _slot: u64,
        _f: impl FnOnce(&mut [u8; BUCKET_LEN], bool) -> (T, bool),
    ) -> Option<Result<T, StoreError>> {
        None
    }

    /// Runs `f` on the value in store slot `slot` (not a [`SlotKind::Bucket`]) while this store
    /// holds it for the caller alone, if it can: `f` gets the value to change in place (empty
    /// if the slot was never written) and whether it was written, and returns its result and
    /// whether it changed the value. `None` when the store cannot hold a slot so (Envoy's shared
    /// data): the caller uses [`Store::replace`].
    fn locked_value<T>(
        &self,
        _slot: u64,
        _f: impl FnOnce(&mut Vec<u8>, bool) -> (T, bool),
    ) -> Option<Result<T, StoreError>> {
        None
    }

    /// Runs `f` while this store holds every bucket in `slots` (each a
    /// [`SlotKind::Bucket`]) for the caller alone, as [`Store::locked`] holds one, if
    /// it can; `None` otherwise (the caller reads and writes with compare-and-swap).
    fn locked_many<T>(&self, _slots: &[u64], _f: impl FnOnce(&mut Held<'_>) -> T) -> Option<T> {
        None
    }
}

/// Buckets of a process store held at once for one caller ([`Store::locked_many`]).
pub struct Held<'a> {
    /// (slot, the bucket, times written since held), by slot.
    buckets: smallvec::SmallVec<[(u64, MutexGuard<'a, Bucket>, u32); HELD_INLINE]>,
}

impl Held<'_> {
    /// Where the bucket in `slot` is among those held (`None`: not held, no such bucket).
    pub fn index(&self, slot: u64) -> Option<usize> {
        self.buckets.binary_search_by_key(&slot, |b| b.0).ok()
    }

    /// The bytes of held bucket `i` (all zero if it was never written), whether it holds a
    /// bucket, and how many times it was written since it was held.
    pub fn get(&mut self, i: usize) -> Option<(&mut [u8; BUCKET_LEN], bool, u32)> {
        let (_, bucket, writes) = self.buckets.get_mut(i)?;
        let present = bucket.cas != 0 || *writes > 0;
        Some((&mut bucket.bytes, present, *writes))
    }

    /// Held bucket `i` was written (its CAS moves on when it is released).
    pub fn wrote(&mut self, i: usize) {
        if let Some(b) = self.buckets.get_mut(i) {
            b.2 += 1;
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for (_, bucket, writes) in &mut self.buckets {
            if *writes > 0 {
                bucket.cas = next_cas(bucket.cas);
            }
        }
    }
}

/// A shared store is a store (the native host shares one table between configurations).
impl<T: Store> Store for std::sync::Arc<T> {
    fn read<R>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> R,
    ) -> Result<R, StoreError> {
        (**self).read(slot, f)
    }

    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        (**self).write(slot, value, cas)
    }

    fn locked<R>(
        &self,
        slot: u64,
        f: impl FnOnce(&mut [u8; BUCKET_LEN], bool) -> (R, bool),
    ) -> Option<Result<R, StoreError>> {
        (**self).locked(slot, f)
    }

    fn locked_value<R>(
        &self,
        slot: u64,
        f: impl FnOnce(&mut Vec<u8>, bool) -> (R, bool),
    ) -> Option<Result<R, StoreError>> {
        (**self).locked_value(slot, f)
    }

    fn update_value<R>(
        &self,
        slot: u64,
        attempts: u32,
        f: impl FnMut(&mut Vec<u8>, bool) -> (R, bool),
    ) -> Result<R, StoreError> {
        (**self).update_value(slot, attempts, f)
    }

    fn locked_many<R>(&self, slots: &[u64], f: impl FnOnce(&mut Held<'_>) -> R) -> Option<R> {
        (**self).locked_many(slots, f)
    }
}

/// Locks a mutex whatever happened to a thread that held it: every value here stays consistent
/// (a slot is written whole), and a panic is already handled where it happened.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The CAS after `cas`: never 0 (unconditional) nor [`CREATE_CAS`].
fn next_cas(cas: u32) -> u32 {
    match cas.wrapping_add(1) {
        0 | CREATE_CAS => 1,
        n => n,
    }
}

/// Whether a write with `cas` may replace a value whose CAS is `current` (`None`: never
/// written).
fn may_write(current: Option<u32>, cas: u32) -> bool {
    match current {
        None => true,
        Some(current) => cas == 0 || cas == current,
    }
}

/// Values and their CAS, by slot.
type Values = HashMap<u64, (Vec<u8>, u32), BuildSlotHasher>;

/// Hashes a slot number with one multiplication: slots are numbers the filter computes (a
/// client's keyed hash modulo the capacity, a rule's fingerprint), never a client's bytes, so
/// SipHash's protection buys nothing here and costs a hundred instructions a lookup.
#[derive(Clone, Copy, Default, Debug)]
struct BuildSlotHasher;

impl std::hash::BuildHasher for BuildSlotHasher {
    type Hasher = SlotHasher;
    fn build_hasher(&self) -> SlotHasher {
        SlotHasher(0)
    }
}

/// See [`BuildSlotHasher`].
#[derive(Default)]
struct SlotHasher(u64);

impl std::hash::Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits mix every bit of the slot.
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(32);
    }
}

/// An in-memory [`Store`] with Envoy's semantics, safe to share between threads.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    next_cas: u32,
    slots: Values,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many slots have been written.
    pub fn len(&self) -> usize {
        lock(&self.inner).slots.len()
    }

    /// Whether no slot has been written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Store for MemoryStore {
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, StoreError> {
        // A copy, so `f` runs without the lock and may use the store itself (as the hosts'
        // stores allow).
        let value = lock(&self.inner).slots.get(&slot).cloned();
        Ok(match value {
            Some((v, cas)) => f(Some(&v), Some(cas)),
            None => f(None, None),
        })
    }

    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut guard = lock(&self.inner);
        if !may_write(guard.slots.get(&slot).map(|(_, c)| *c), cas) {
            return Err(StoreError::Conflict);
        }
        guard.next_cas = next_cas(guard.next_cas);
        let next = guard.next_cas;
        guard.slots.insert(slot, (value.to_vec(), next));
        Ok(())
    }
}

/// One bucket of a [`ProcessStore`].
#[derive(Debug)]
struct Bucket {
    /// 0 until first written.
    cas: u32,
    bytes: [u8; BUCKET_LEN],
}

/// Sliding-log slots are spread over this many locks.
const LOG_SHARDS: usize = 64;

/// The native host's store: every bucket of the table allocated up front (`BUCKET_LEN` bytes,
/// a CAS and a lock each: 164 bytes per bucket of 4 keys on Linux, 41 per key), so memory
/// is fixed by the capacity; sliding logs, whose size varies, in a map under sharded locks (at
/// most one entry per log slot). Reads copy nothing: the caller decodes under the bucket's lock.
#[derive(Debug)]
pub struct ProcessStore {
    buckets: Box<[Mutex<Bucket>]>,
    logs: Box<[Mutex<Values>]>,
}

impl ProcessStore {
    /// A store of `buckets` buckets (slots `0..buckets`), and values of the other
    /// [`SlotKind`]s.
    pub fn new(buckets: u32) -> ProcessStore {
        ProcessStore {
            buckets: (0..buckets)
                .map(|_| {
                    Mutex::new(Bucket {
                        cas: 0,
                        bytes: [0; BUCKET_LEN],
                    })
                })
                .collect(),
            logs: (0..LOG_SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// The number of buckets.
    pub fn buckets(&self) -> u32 {
        u32::try_from(self.buckets.len()).unwrap_or(u32::MAX)
    }

    fn bucket(&self, slot: u64) -> Option<&Mutex<Bucket>> {
        self.buckets.get(usize::try_from(slot).ok()?)
    }

    fn log_shard(&self, slot: u64) -> Result<&Mutex<Values>, StoreError> {
        self.logs
            .get((slot % LOG_SHARDS as u64) as usize)
            .ok_or(StoreError::Unavailable(StoreFault::NoSlot(slot)))
    }
}

impl Store for ProcessStore {
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, StoreError> {
        if SlotKind::of(slot) != SlotKind::Bucket {
            let shard = lock(self.log_shard(slot)?);
            return Ok(match shard.get(&slot) {
                Some((v, cas)) => f(Some(v), Some(*cas)),
                None => f(None, None),
            });
        }
        let bucket = self
            .bucket(slot)
            .ok_or(StoreError::Unavailable(StoreFault::NoSlot(slot)))?;
        let b = lock(bucket);
        Ok(if b.cas == 0 {
            f(None, None)
        } else {
            f(Some(&b.bytes), Some(b.cas))
        })
    }

    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        if SlotKind::of(slot) != SlotKind::Bucket {
            let mut shard = lock(self.log_shard(slot)?);
            let current = shard.get(&slot).map(|(_, c)| *c);
            if !may_write(current, cas) {
                return Err(StoreError::Conflict);
            }
            let next = next_cas(current.unwrap_or(0));
            match shard.get_mut(&slot) {
                // Rewritten in place: a record of fixed size costs no allocation.
                Some((v, cas)) if v.len() == value.len() => {
                    v.copy_from_slice(value);
                    *cas = next;
                }
                _ => {
                    shard.insert(slot, (value.to_vec(), next));
                }
            }
            return Ok(());
        }
        let bucket = self
            .bucket(slot)
            .ok_or(StoreError::Unavailable(StoreFault::NoSlot(slot)))?;
        let mut b = lock(bucket);
        let current = (b.cas != 0).then_some(b.cas);
        if !may_write(current, cas) {
            return Err(StoreError::Conflict);
        }
        if value.len() != BUCKET_LEN {
            return Err(StoreError::Unavailable(StoreFault::BadLength(value.len())));
        }
        b.bytes.copy_from_slice(value);
        b.cas = next_cas(b.cas);
        Ok(())
    }

    fn locked<T>(
        &self,
        slot: u64,
        f: impl FnOnce(&mut [u8; BUCKET_LEN], bool) -> (T, bool),
    ) -> Option<Result<T, StoreError>> {
        if SlotKind::of(slot) != SlotKind::Bucket {
            return None;
        }
        let Some(bucket) = self.bucket(slot) else {
            return Some(Err(StoreError::Unavailable(StoreFault::NoSlot(slot))));
        };
        let mut b = lock(bucket);
        let present = b.cas != 0;
        let (result, written) = f(&mut b.bytes, present);
        if written {
            b.cas = next_cas(b.cas);
        }
        Some(Ok(result))
    }

    fn locked_value<T>(
        &self,
        slot: u64,
        f: impl FnOnce(&mut Vec<u8>, bool) -> (T, bool),
    ) -> Option<Result<T, StoreError>> {
        if SlotKind::of(slot) == SlotKind::Bucket {
            return None;
        }
        let mut shard = match self.log_shard(slot) {
            Ok(shard) => lock(shard),
            Err(e) => return Some(Err(e)),
        };
        // One lookup: a value held is changed where it lies; a new one is inserted only if
        // written.
        if let Some((value, cas)) = shard.get_mut(&slot) {
            let (result, written) = f(value, true);
            if written {
                *cas = next_cas(*cas);
            }
            return Some(Ok(result));
        }
        let mut value = Vec::new();
        let (result, written) = f(&mut value, false);
        if written {
            shard.insert(slot, (value, next_cas(0)));
        }
        Some(Ok(result))
    }

    /// The buckets are locked in the order of their slots, each once: whoever holds several
    /// holds them in that order, and whoever holds one waits for no other, so no two callers
    /// can wait for each other.
    fn locked_many<T>(&self, slots: &[u64], f: impl FnOnce(&mut Held<'_>) -> T) -> Option<T> {
        let mut sorted: smallvec::SmallVec<[u64; HELD_INLINE]> = slots.iter().copied().collect();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.iter().any(|&s| SlotKind::of(s) != SlotKind::Bucket) {
            return None;
        }
        let mut held = Held {
            buckets: smallvec::SmallVec::with_capacity(sorted.len()),
        };
        for slot in sorted {
            if let Some(bucket) = self.bucket(slot) {
                held.buckets.push((slot, lock(bucket), 0));
            }
        }
        Some(f(&mut held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(s: &impl Store, slot: u64) -> (Option<Vec<u8>>, Option<u32>) {
        s.read(slot, |v, cas| (v.map(<[u8]>::to_vec), cas)).unwrap()
    }

    /// What every store must do: Envoy's shared-data semantics, quirks included.
    fn behaves_like_envoy_shared_data(s: &impl Store, slot: u64, a: &[u8], b: &[u8]) {
        assert_eq!(get(s, slot), (None, None));
        // The CAS is ignored for a key that does not exist yet...
        s.write(slot, a, 12345).unwrap();
        let (v, cas) = get(s, slot);
        assert_eq!(v.as_deref(), Some(a));
        let cas = cas.unwrap();
        // ...and checked once it does.
        assert_eq!(s.write(slot, b, CREATE_CAS), Err(StoreError::Conflict));
        assert_eq!(s.write(slot, b, cas + 1), Err(StoreError::Conflict));
        s.write(slot, b, cas).unwrap();
        assert_eq!(s.write(slot, a, cas), Err(StoreError::Conflict));
        s.write(slot, a, 0).unwrap();
        assert_eq!(get(s, slot).0.as_deref(), Some(a));
    }

    #[test]
    fn a_process_store_holds_a_value_in_place() {
        let s = ProcessStore::new(1);
        let slot = SlotKind::Share.slot(3);
        // Absent, and not written: still absent.
        let r = s.locked_value(slot, |v, present| {
            assert!(v.is_empty() && !present);
            ((), false)
        });
        assert!(matches!(r, Some(Ok(()))));
        assert_eq!(get(&s, slot), (None, None));
        // Written in place, then seen by a read with a CAS, then changed in place again.
        s.locked_value(slot, |v, _| {
            v.extend_from_slice(b"abc");
            ((), true)
        });
        let (value, cas) = get(&s, slot);
        assert_eq!(value.as_deref(), Some(&b"abc"[..]));
        s.locked_value(slot, |v, present| {
            assert!(present && v == b"abc");
            v[0] = b'x';
            ((), true)
        });
        let (value, cas2) = get(&s, slot);
        assert_eq!(value.as_deref(), Some(&b"xbc"[..]));
        assert_ne!(cas, cas2, "a write in place moves the CAS");
        assert!(
            s.write(slot, b"old", cas.unwrap()).is_err(),
            "a stale CAS loses"
        );
        // Buckets are held another way.
        assert!(s.locked_value(0, |_, _| ((), false)).is_none());
    }

    #[test]
    fn memory_store() {
        let s = MemoryStore::new();
        behaves_like_envoy_shared_data(&s, 1, b"a", b"b");
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn process_store() {
        let s = ProcessStore::new(4);
        let (a, b) = ([1u8; BUCKET_LEN], [2u8; BUCKET_LEN]);
        behaves_like_envoy_shared_data(&s, 3, &a, &b);
        behaves_like_envoy_shared_data(&s, SlotKind::Log.slot(9), b"log", b"longer log");
        // Out of range, or the wrong size: errors, never a panic.
        assert!(matches!(s.write(4, &a, 0), Err(StoreError::Unavailable(_))));
        assert!(s.read(100, |_, _| ()).is_err());
        assert!(matches!(
            s.write(0, b"short", 0),
            Err(StoreError::Unavailable(_))
        ));
        assert_eq!(s.buckets(), 4);
    }

    /// A one-byte counter in slot `slot`, incremented through [`Store::replace`].
    fn increment(s: &impl Store, slot: u64) -> Result<u8, StoreError> {
        increment_within(s, slot, MAX_ATTEMPTS)
    }

    fn increment_within(s: &impl Store, slot: u64, attempts: u32) -> Result<u8, StoreError> {
        s.replace(slot, attempts, &mut [0], |bytes, value| {
            let n = bytes.and_then(|b| b.first()).copied().unwrap_or(0) + 1;
            *value = [n];
            (n, true)
        })
    }

    #[test]
    fn replace_decides_again_until_its_write_wins() {
        // Another writer wins the next `wins` races: it increments the slot between each of
        // our reads and our write.
        let wins = std::cell::Cell::new(0);
        let s = crate::testkit::Intercepted::new(MemoryStore::new(), |inner, slot| {
            if wins.get() > 0 {
                wins.set(wins.get() - 1);
                increment(inner, slot)?;
            }
            Ok(())
        });
        assert_eq!(increment(&s, 1), Ok(1));
        // The other writer wins once: the second attempt builds on its value.
        wins.set(1);
        let mut seen = Vec::new();
        let got = s.replace(1, MAX_ATTEMPTS, &mut [0], |bytes, value| {
            let n = bytes.and_then(|b| b.first()).copied().unwrap_or(0);
            seen.push(n);
            *value = [n + 1];
            (n + 1, true)
        });
        assert_eq!(got, Ok(3));
        assert_eq!(seen, [1, 2]);
        // Nothing to write: nothing written, whatever the buffer holds.
        assert_eq!(s.replace(1, 1, &mut [9], |_, _| (7, false)), Ok(7));
        assert_eq!(get(&s, 1).0, Some(vec![3]));
        // A writer that keeps winning exhausts the attempts.
        wins.set(5);
        assert_eq!(increment_within(&s, 1, 3), Err(StoreError::Conflict));
        assert_eq!(get(&s, 1).0, Some(vec![6]));
        // A slot created by two racing writers: the second is refused, then builds on the
        // first (the CAS of creation is [`CREATE_CAS`], not 0).
        wins.set(1);
        assert_eq!(increment(&s, 2), Ok(2));
    }

    #[test]
    fn replace_counts_exactly_under_contention() {
        let s = std::sync::Arc::new(ProcessStore::new(4));
        let slot = SlotKind::Log.slot(2); // a log slot: read, then written with CAS
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        s.replace(slot, u32::MAX, &mut [0; 4], |bytes, value| {
                            let n = bytes
                                .and_then(|b| b.try_into().ok())
                                .map_or(0, u32::from_le_bytes);
                            *value = (n + 1).to_le_bytes();
                            ((), true)
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(get(&*s, slot).0, Some(2000u32.to_le_bytes().to_vec()));
    }

    #[test]
    fn cas_values_skip_the_reserved_ones() {
        assert_eq!(next_cas(0), 1);
        assert_eq!(next_cas(CREATE_CAS - 1), 1);
        assert_eq!(next_cas(7), 8);
    }
}
