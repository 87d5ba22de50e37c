//! Where a key's update lands among its two buckets ([`crate::table`]'s two choices): the
//! bucket that holds it, else, for a new key, the one with fewer live keys. Owns the two ways
//! of getting there: under the store's hold (the native build's process table) and with
//! compare-and-swap (Envoy's shared data), where a new key placed in its second bucket is first
//! announced in its first. Uses the engine's [`update_entry`] for what happens in the bucket.

use super::{read, update_entry, Check, Failure, Read, Updated};
use crate::limiter::{Policy, State, Trace};
use crate::store::{Store, StoreError, CREATE_CAS, MAX_ATTEMPTS};
use crate::table::{self, BUCKET_LEN};

/// What [`super::update`] updates: the key's two bucket slots, its fingerprint, its rule's
/// policy (to seed a new key from its ghosts) and the time.
pub(super) type Key<'a> = ((u64, u64), u64, Option<&'a Policy>, u64);

/// What decides an update: the key's state in, the result and the state to write out (called
/// through a pointer: one copy of this module's code per result type, not per caller).
pub(super) type Decide<'f, T> = dyn FnMut(Option<&State>) -> (T, Option<State>) + 'f;

/// Whether an update's result changed the bucket's bytes (placed a state, or reset a corrupt
/// bucket).
fn written<T>(r: &Result<Updated<T>, Failure>) -> bool {
    matches!(r, Ok((_, Some(_))) | Err(Failure::Corrupt))
}

/// The update under the store's hold: the first bucket alone if it holds the key, else the
/// second alone if it does, else both, where the key is placed in the one with fewer live keys
/// (both are looked at again there: another request may have placed it meanwhile). `None` when
/// the store cannot hold buckets.
pub(super) fn update_held<T>(
    store: &impl Store,
    ((first, second), fingerprint, rule, now_ms): Key<'_>,
    f: &mut Decide<'_, T>,
) -> Option<Result<Updated<T>, Failure>> {
    // One bucket alone: an update there when the key is in it (or the bucket is corrupt, which
    // the update resets; or `only`: the key's only bucket, where a new key goes), else nothing.
    let alone = |slot: u64, only: bool, f: &mut Decide<'_, T>| {
        store.locked(slot, |bytes, present| {
            match table::lookup(present.then_some(&bytes[..]), fingerprint) {
                Ok(None) if !only => (None, false),
                looked => {
                    let r = update_entry(
                        bytes,
                        present,
                        (slot, fingerprint),
                        rule,
                        now_ms,
                        None,
                        Some(looked),
                        &mut *f,
                    );
                    let w = written(&r);
                    (Some(r), w)
                }
            }
        })
    };
    for (slot, only) in [(first, first == second), (second, false)] {
        match alone(slot, only, &mut *f)? {
            Err(e) => return Some(Err(e.into())),
            Ok(Some(r)) => return Some(r),
            Ok(None) if only => return None, // not reached: a lone bucket is both
            Ok(None) => {}
        }
    }
    // A new key: both held.
    store.locked_many(&[first, second], |held| {
        let (Some(a), Some(b)) = (held.index(first), held.index(second)) else {
            return Err(Failure::Unavailable(crate::error::StoreFault::NoSlot(
                first,
            )));
        };
        let mut look = |i: usize| {
            held.get(i).map(|(bytes, present, _)| {
                let bytes = present.then_some(&bytes[..]);
                (
                    table::lookup(bytes, fingerprint).map(|f| f.is_some()),
                    table::load(bytes, now_ms),
                    table::ghost_in(bytes, fingerprint, now_ms),
                    table::announced(bytes, fingerprint, now_ms),
                )
            })
        };
        let (Some((in_a, live_a, ghost_a, marked)), Some((in_b, live_b, ghost_b, _))) =
            (look(a), look(b))
        else {
            return Err(Failure::Unavailable(crate::error::StoreFault::NoSlot(
                first,
            )));
        };
        // The bucket to update: the one holding the key (or corrupt: reset there), else the
        // less loaded, the first on a tie; with the other's ghost. A key a request with
        // compare-and-swap (a sliding log among its rules) announced in its first bucket goes
        // to its second, where that request places it.
        let (i, slot, elsewhere) = match (in_a, in_b) {
            (Ok(true) | Err(_), _) => (a, first, None),
            (_, Ok(true) | Err(_)) => (b, second, None),
            _ if marked || live_b < live_a => (b, second, ghost_a),
            _ => (a, first, ghost_b),
        };
        let (bytes, present, _) = held
            .get(i)
            .ok_or(Failure::Unavailable(crate::error::StoreFault::NoSlot(slot)))?;
        let r = update_entry(
            bytes,
            present,
            (slot, fingerprint),
            rule,
            now_ms,
            elsewhere,
            None,
            f,
        );
        if written(&r) {
            held.wrote(i);
        }
        r
    })
}

/// A bucket read into `copy`: whether the store holds one there, and the CAS to write it back
/// with. Bytes of another length are no bucket (`present`, version 0: corrupt).
fn read_into(
    store: &impl Store,
    slot: u64,
    copy: &mut [u8; BUCKET_LEN],
) -> Result<(bool, u32), Failure> {
    store
        .read(slot, |read, cas| {
            let present = match read {
                Some(b) if b.len() == BUCKET_LEN => {
                    copy.copy_from_slice(b);
                    true
                }
                other => {
                    *copy = [0; BUCKET_LEN];
                    !matches!(other, None | Some([]))
                }
            };
            (present, cas.unwrap_or(CREATE_CAS))
        })
        .map_err(Failure::from)
}

/// What one write with compare-and-swap did.
enum Wrote {
    Done,
    Lost,
}

fn write(store: &impl Store, slot: u64, bytes: &[u8], cas: u32) -> Result<Wrote, Failure> {
    match store.write(slot, bytes, cas) {
        Ok(()) => Ok(Wrote::Done),
        Err(StoreError::Conflict) => Ok(Wrote::Lost),
        Err(e) => Err(e.into()),
    }
}

/// The update with compare-and-swap, at most [`MAX_ATTEMPTS`] reads of the key's first bucket:
/// the first bucket if it holds the key, else the second if it does; else, unless another
/// request is placing the key in its second bucket (then read again), a new key: placed in the
/// first bucket, or announced there and placed in the second when that one has fewer live keys.
pub(super) fn update_cas<T>(
    store: &impl Store,
    key: Key<'_>,
    retries: &mut u32,
    f: &mut Decide<'_, T>,
) -> Result<Updated<T>, Failure> {
    let ((first, second), fingerprint, rule, now_ms) = key;
    let mut a = [0u8; BUCKET_LEN];
    let mut b = [0u8; BUCKET_LEN];
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            *retries += 1;
        }
        let (present_a, cas_a) = read_into(store, first, &mut a)?;
        let here = |bytes: &[u8; BUCKET_LEN], present: bool| {
            table::lookup(present.then_some(&bytes[..]), fingerprint)
        };
        let in_a = here(&a, present_a);
        if !matches!(in_a, Ok(None)) || first == second {
            // The key is here (or the bucket is corrupt, which the update resets), or this is
            // its only bucket.
            let at = (first, fingerprint, cas_a);
            match in_bucket(store, at, (&mut a, present_a), key, (None, Some(in_a)), f)? {
                Some(r) => return r,
                None => continue,
            }
        }
        let (present_b, cas_b) = read_into(store, second, &mut b)?;
        let in_b = here(&b, present_b);
        if !matches!(in_b, Ok(None)) {
            let at = (second, fingerprint, cas_b);
            match in_bucket(store, at, (&mut b, present_b), key, (None, Some(in_b)), f)? {
                Some(r) => return r,
                None => continue,
            }
        }
        let bytes_a = present_a.then_some(&a[..]);
        let bytes_b = present_b.then_some(&b[..]);
        if table::announced(bytes_a, fingerprint, now_ms) {
            continue; // being placed in its second bucket: read again
        }
        // A new key.
        let to_second = table::load(bytes_b, now_ms) < table::load(bytes_a, now_ms);
        let (ghost_a, ghost_b) = (
            table::ghost_in(bytes_a, fingerprint, now_ms),
            table::ghost_in(bytes_b, fingerprint, now_ms),
        );
        if to_second {
            let r = update_entry(
                &mut b,
                present_b,
                (second, fingerprint),
                rule,
                now_ms,
                ghost_a,
                Some(Ok(None)),
                &mut *f,
            );
            if !written(&r) {
                return r;
            }
            // Announced in the first bucket before it is placed in the second: a request
            // placing it in the first meanwhile makes this write lose its race.
            if !present_a {
                a = table::empty_bucket();
            }
            if table::announce(&mut a, fingerprint, now_ms) {
                match write(store, first, &a, cas_a)? {
                    Wrote::Done => {}
                    Wrote::Lost => continue,
                }
                let at = (second, fingerprint, ghost_a);
                let r = place_announced(store, at, rule, now_ms, retries, (b, cas_b), r, f);
                withdraw(store, first, fingerprint);
                return r;
            }
            // Both marks held by other keys: placed in the first bucket after all.
        }
        let at = (first, fingerprint, cas_a);
        match in_bucket(
            store,
            at,
            (&mut a, present_a),
            key,
            (ghost_b, Some(Ok(None))),
            f,
        )? {
            Some(r) => return r,
            None => continue,
        }
    }
    *retries += 1;
    Err(Failure::RetriesExhausted)
}

/// The update in one bucket's bytes (read from `slot` with `cas`), written back with
/// compare-and-swap if it changed them: its result, or `None` when the write lost its race.
fn in_bucket<T>(
    store: &impl Store,
    (slot, fingerprint, cas): (u64, u64, u32),
    (bytes, present): (&mut [u8; BUCKET_LEN], bool),
    (_, _, rule, now_ms): Key<'_>,
    (elsewhere, looked): (Option<Trace>, Option<super::Looked>),
    f: &mut Decide<'_, T>,
) -> Result<Option<Result<Updated<T>, Failure>>, Failure> {
    let r = update_entry(
        bytes,
        present,
        (slot, fingerprint),
        rule,
        now_ms,
        elsewhere,
        looked,
        f,
    );
    if !written(&r) {
        return Ok(Some(r));
    }
    Ok(match write(store, slot, &bytes[..], cas)? {
        Wrote::Done => Some(r),
        Wrote::Lost => None,
    })
}

/// Places a key announced in its first bucket in its second (`slot`), whose bytes (read with
/// `cas`) already hold the update `r`: while the write loses its race, reads that bucket again
/// and updates it there (the mark keeps any other request from placing the key elsewhere),
/// seeded from its first bucket's ghost (`elsewhere`) if it is still new there.
#[allow(clippy::too_many_arguments)]
fn place_announced<T>(
    store: &impl Store,
    (slot, fingerprint, elsewhere): (u64, u64, Option<Trace>),
    rule: Option<&Policy>,
    now_ms: u64,
    retries: &mut u32,
    (mut bytes, mut cas): ([u8; BUCKET_LEN], u32),
    mut r: Result<Updated<T>, Failure>,
    f: &mut Decide<'_, T>,
) -> Result<Updated<T>, Failure> {
    for _ in 0..MAX_ATTEMPTS {
        match write(store, slot, &bytes, cas)? {
            Wrote::Done => return r,
            Wrote::Lost => *retries += 1,
        }
        let (present, again) = read_into(store, slot, &mut bytes)?;
        cas = again;
        r = update_entry(
            &mut bytes,
            present,
            (slot, fingerprint),
            rule,
            now_ms,
            elsewhere,
            None,
            &mut *f,
        );
        if !written(&r) {
            return r;
        }
    }
    Err(Failure::RetriesExhausted)
}

/// Takes the mark a request left in a key's first bucket (`slot`) once the key is placed in its
/// second: a few attempts, else the mark lapses on its own after [`table::PENDING_MS`].
pub(super) fn withdraw(store: &impl Store, slot: u64, fingerprint: u64) {
    let mut copy = [0u8; BUCKET_LEN];
    let _ = store.replace(slot, 4, &mut copy, |bytes, copy| match bytes {
        Some(b) if b.len() == BUCKET_LEN => {
            copy.copy_from_slice(b);
            ((), table::withdraw(copy, fingerprint))
        }
        _ => ((), false),
    });
}

/// A check's key located for a decision with compare-and-swap ([`super::decide_general`]):
/// the bucket that holds it, or where a new key goes.
pub(super) struct Located {
    /// The slot of the bucket (or log) to write.
    pub at: u64,
    /// Its contents as read, and the CAS to write them back with.
    pub read: Read,
    /// A new key going to its second bucket: its first bucket as read, to announce it there
    /// first.
    pub first: Option<Read>,
    /// The ghost of the key in its other bucket, if it is new here.
    pub elsewhere: Option<Trace>,
}

impl Located {
    /// The key's state before the request: its own, or what its ghosts seed.
    pub fn before(&self, check: &Check, now_ms: u64) -> Option<State> {
        check.current(&self.read.slot).or_else(|| {
            let here = self.read.slot.ghost(check.fingerprint, now_ms);
            super::seeded(&check.policy, here, self.elsewhere, now_ms)
        })
    }
}

/// Reads where `check`'s key is: its first bucket, then its second if the first does not hold
/// it (a sliding log: its slot). A key another request is placing in its second bucket is read
/// again, up to [`MAX_ATTEMPTS`] times (`retries` counts them).
pub(super) fn locate(
    store: &impl Store,
    check: &Check,
    now_ms: u64,
    retries: &mut u32,
) -> Result<Located, Failure> {
    let fp = check.fingerprint;
    let here = |read: Read, at: u64| Located {
        at,
        read,
        first: None,
        elsewhere: None,
    };
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            *retries += 1;
        }
        let a = read(store, check.slot)?;
        if check.policy.uses_log() || check.alt == check.slot || a.slot.find(fp).is_some() {
            return Ok(here(a, check.slot));
        }
        let b = read(store, check.alt)?;
        if b.slot.find(fp).is_some() {
            return Ok(here(b, check.alt));
        }
        if a.slot.announced(fp, now_ms) {
            continue;
        }
        let (ghost_a, ghost_b) = (a.slot.ghost(fp, now_ms), b.slot.ghost(fp, now_ms));
        return Ok(if b.slot.load(now_ms) < a.slot.load(now_ms) {
            Located {
                at: check.alt,
                read: b,
                first: Some(a),
                elsewhere: ghost_a,
            }
        } else {
            Located {
                at: check.slot,
                read: a,
                first: None,
                elsewhere: ghost_b,
            }
        });
    }
    Err(Failure::RetriesExhausted)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check, MINUTE};
    use super::super::{decide, Check};
    use crate::config::FailureMode;
    use crate::store::{MemoryStore, ProcessStore, Store};
    use crate::table::{self, Slot};
    use crate::testkit::Intercepted;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    const A: u64 = 0;
    const B: u64 = 1;

    /// A key of limit `n` a minute in buckets `A` and `B`.
    fn key(fp: u64, n: u64) -> Check {
        Check {
            alt: B,
            ..check(A, fp, n, MINUTE)
        }
    }

    /// Which of the two buckets hold `fp`.
    fn holders(store: &impl Store, fp: u64) -> Vec<u64> {
        [A, B]
            .into_iter()
            .filter(|&s| {
                store
                    .read(s, |bytes, _| Slot::decode(s, bytes))
                    .unwrap()
                    .is_ok_and(|slot| slot.find(fp).is_some())
            })
            .collect()
    }

    /// Fills bucket `A` with `n` live keys of their own (their second bucket another one).
    fn load_first(store: &impl Store, n: u64, now: u64) {
        for i in 0..n {
            let c = Check {
                alt: 2,
                ..check(A, 1_001 + 2 * i, 10, MINUTE)
            };
            assert!(decide(store, &[c], now, FailureMode::Deny).allowed);
        }
    }

    fn goes_to_the_less_loaded_bucket(store: &impl Store) {
        let now = 1_000_000;
        load_first(store, 3, now);
        let k = key(7, 3);
        for _ in 0..3 {
            assert!(decide(store, &[k], now, FailureMode::Deny).allowed);
        }
        assert!(!decide(store, &[k], now, FailureMode::Deny).allowed);
        assert_eq!(holders(store, 7), [B], "placed once, in the emptier bucket");
        // Its first bucket keeps no mark: another key is not kept waiting.
        let first = store.read(A, |b, _| b.map(<[u8]>::to_vec)).unwrap();
        assert!(!table::announced(first.as_deref(), 7, now));
        // Two rules at once (the general path), one of them this key's.
        let other = Check {
            slot: 2,
            alt: 3,
            ..check(2, 9, 3, MINUTE)
        };
        assert!(!decide(store, &[other, k], now, FailureMode::Deny).allowed);
        let fresh = key(11, 3);
        assert!(decide(store, &[other, fresh], now, FailureMode::Deny).allowed);
        assert_eq!(holders(store, 11), [B]);
    }

    #[test]
    fn a_new_key_goes_to_the_bucket_with_fewer_live_keys() {
        goes_to_the_less_loaded_bucket(&MemoryStore::new());
        goes_to_the_less_loaded_bucket(&ProcessStore::new(4));
    }

    /// With compare-and-swap, a key is placed in its second bucket after a mark in its first:
    /// another request for the key between the mark and the placement waits for it (and gives
    /// up, failing open here, rather than place the key a second time); another request that
    /// places the key first makes the mark's write lose its race, and the key is then found.
    #[test]
    fn a_key_being_placed_in_its_second_bucket_is_placed_once() {
        let now = 1_000_000;
        for scenario in ["between the mark and the placement", "before the mark"] {
            let armed = AtomicBool::new(false);
            let seen = AtomicU64::new(0);
            let store = Intercepted::new(MemoryStore::new(), |inner: &MemoryStore, slot| {
                let before_mark = scenario == "before the mark" && slot == A;
                let before_placement = scenario != "before the mark" && slot == B;
                if (before_mark || before_placement) && armed.swap(false, Ordering::SeqCst) {
                    let o = decide(inner, &[key(7, 3)], now, FailureMode::Allow);
                    seen.store(
                        u64::from(o.allowed) | u64::from(o.rules[0].failure.is_some()) << 1,
                        Ordering::SeqCst,
                    );
                }
                Ok(())
            });
            load_first(&store.inner, 3, now);
            armed.store(true, Ordering::SeqCst);
            assert!(decide(&store, &[key(7, 3)], now, FailureMode::Deny).allowed);
            let (allowed, failed) = {
                let s = seen.load(Ordering::SeqCst);
                (s & 1 == 1, s & 2 == 2)
            };
            assert!(allowed, "{scenario}");
            // Waiting for the mark, it gave up; else it placed the key, counted once.
            assert_eq!(failed, scenario != "before the mark", "{scenario}");
            assert_eq!(holders(&store.inner, 7), [B], "{scenario}: placed once");
            let counted = if failed { 1 } else { 2 };
            for _ in counted..3 {
                assert!(decide(&store, &[key(7, 3)], now, FailureMode::Deny).allowed);
            }
            assert!(
                !decide(&store, &[key(7, 3)], now, FailureMode::Deny).allowed,
                "{scenario}: every request counted in one place"
            );
        }
    }

    /// In the native build's store, a request whose rules include a sliding log takes the
    /// compare-and-swap path and announces a new key in its first bucket before it writes the
    /// second; a request that holds the buckets meanwhile (one rule, or several) places the key
    /// in its second bucket too, never in the first, whatever the loads say.
    #[test]
    fn a_held_request_places_an_announced_key_where_it_was_announced() {
        let now = 1_000_000;
        for rules in [1, 2] {
            let store = ProcessStore::new(4);
            let k = key(7, 3);
            // Equal loads, so without the mark the key would go to its first bucket.
            let marked = store
                .locked(A, |bytes, _| {
                    *bytes = table::empty_bucket();
                    (table::announce(bytes, 7, now), true)
                })
                .unwrap()
                .unwrap();
            assert!(marked);
            let other = Check {
                slot: 2,
                alt: 3,
                ..check(2, 9, 3, MINUTE)
            };
            let checks: &[Check] = if rules == 1 { &[k] } else { &[other, k] };
            assert!(decide(&store, checks, now, FailureMode::Deny).allowed);
            assert_eq!(holders(&store, 7), [B], "{rules} rule(s)");
        }
    }

    /// A mark holds for its time, and one left behind (its request gone) does not hold again
    /// when the low 32 bits of the clock come round, but for at most its time every 49.7 days.
    #[test]
    fn a_mark_left_behind_stays_lapsed() {
        let now = 1_000_000u64;
        let mut bytes = table::empty_bucket();
        assert!(table::announce(&mut bytes, 7, now));
        let marked = |at: u64| table::announced(Some(&bytes), 7, at);
        assert!(marked(now) && marked(now + table::PENDING_MS - 1));
        for later in [table::PENDING_MS, 1 << 31, (1 << 32) - 1_000, 3 << 31] {
            assert!(!marked(now + later), "{later} ms later");
        }
    }

    /// What a request costs in a key's first bucket and in its second, in the native build's
    /// store: run each under callgrind (`valgrind --tool=callgrind <test binary> --ignored
    /// --exact engine::place::tests::probe_first`, then `probe_second`) and compare the counts:
    /// the difference over `PROBES` is what a key in its second bucket pays per request.
    const PROBES: u64 = 100_000;

    fn probe(second: bool) {
        let store = ProcessStore::new(4);
        let now = 1_000_000;
        if second {
            load_first(&store, 3, now);
        }
        let k = key(7, u64::MAX);
        for _ in 0..PROBES {
            assert!(decide(&store, &[k], now, FailureMode::Deny).allowed);
        }
        assert_eq!(holders(&store, 7), [if second { B } else { A }]);
    }

    #[test]
    #[ignore]
    fn probe_first() {
        probe(false);
    }

    #[test]
    #[ignore]
    fn probe_second() {
        probe(true);
    }

    /// Threads deciding the same new keys at once, on both kinds of store: each key admitted
    /// exactly its limit, and held in one bucket only.
    #[test]
    fn keys_placed_by_racing_threads_are_counted_once() {
        fn race(store: Arc<impl Store + Send + Sync + 'static>) {
            let now = 1_000_000;
            let admitted: Arc<Vec<AtomicU64>> =
                Arc::new((0..24).map(|_| AtomicU64::new(0)).collect());
            let threads: Vec<_> = (0..4u64)
                .map(|t| {
                    let (store, admitted) = (store.clone(), admitted.clone());
                    std::thread::spawn(move || {
                        for round in 0..40u64 {
                            for k in 0..24u64 {
                                let k = (k + t * 7 + round) % 24;
                                let (a, b) = (k % 3, (k / 3 + 1 + k % 3) % 3);
                                let c = Check {
                                    slot: a,
                                    alt: if a == b { (a + 1) % 3 } else { b },
                                    ..check(a, 101 + 2 * k, 50, MINUTE)
                                };
                                if decide(&*store, &[c], now, FailureMode::Deny).allowed {
                                    admitted[k as usize].fetch_add(1, Ordering::SeqCst);
                                }
                            }
                        }
                    })
                })
                .collect();
            threads.into_iter().for_each(|t| t.join().unwrap());
            for (k, n) in admitted.iter().enumerate() {
                assert_eq!(n.load(Ordering::SeqCst), 50, "key {k}");
                let fp = 101 + 2 * k as u64;
                let held = (0..3)
                    .filter(|&s| {
                        store
                            .read(s, |bytes, _| Slot::decode(s, bytes))
                            .unwrap()
                            .is_ok_and(|slot| slot.find(fp).is_some())
                    })
                    .count();
                assert_eq!(held, 1, "key {k}");
            }
        }
        race(Arc::new(MemoryStore::new()));
        race(Arc::new(ProcessStore::new(3)));
    }
}
