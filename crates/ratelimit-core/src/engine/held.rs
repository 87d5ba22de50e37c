//! A request's several rules decided with their buckets held at once (the native build's
//! process table, [`Store::locked_many`]: each key's first bucket, else both of every key's,
//! [`Holding`]): the same two phases as the engine's
//! compare-and-swap path, on the store's own bytes. Owns the choice of a key's bucket among
//! those held (the one that holds it, else the one of the smaller load, or where another
//! request announced it); uses the engine's outcomes and [`super::place`]'s rules.

use super::{refused_outcome, seeded_from, Check, Failure, Outcome, PerRule, RuleOutcome};
use crate::config::FailureMode;
use crate::error::StoreFault;
use crate::limiter::{State, Trace};
use crate::store::Held;
use crate::table::{self, Placement, Slot};
use smallvec::SmallVec;

/// A rule of [`decide_held`]: where its bucket is among those held, the key's state before the
/// request, the state to write with the bucket's write count when it was read and the key's
/// entry then, the state written.
#[derive(Default)]
struct HeldWork {
    bucket: Option<usize>,
    /// A new key going to its second bucket: its first bucket, that bucket's write count, and
    /// the key's ghost there ([`HeldAt::first`]).
    first: Option<(usize, u32, Option<Trace>)>,
    before: Option<State>,
    pending: Option<(State, u32, Option<usize>)>,
    committed: Option<State>,
}

/// Where [`held_lookup`] found a key among held buckets.
struct HeldAt {
    /// The bucket (its index among those held).
    bucket: usize,
    /// The key's entry there, if it has one.
    index: Option<usize>,
    /// The key's state: its own, or what its ghosts seed.
    state: Option<State>,
    /// The bucket's write count.
    writes: u32,
    /// A new key going to its second bucket: as [`HeldWork::first`]. Should its first bucket
    /// change before the key is written, it is looked up again in both (as a lost race to
    /// announce it does with compare-and-swap); should only its second, there alone.
    first: Option<(usize, u32, Option<Trace>)>,
}

/// Which buckets of its keys a request holds ([`decide_held`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Holding {
    /// Each key's first bucket alone: enough when every key is there (no key moves, and a
    /// new key is placed only with both its buckets held).
    Firsts,
    /// Both buckets of every key.
    Both,
}

/// [`decide_general`] with every bucket held ([`Store::locked_many`]): the same steps on the
/// store's own bytes, without copies, decoding the other entries of a bucket, or lost races.
/// What a lost race does there happens here exactly when it happens there without other
/// writers: a rule whose bucket an earlier rule of the request wrote since it was read is
/// decided again (and counted as a retry). `None` when only first buckets are held and a
/// key is not in its first (nothing was written): the caller holds both and decides again.
pub(super) fn decide_held(
    held: &mut Held<'_>,
    checks: &[Check],
    now_ms: u64,
    failure_mode: FailureMode,
    holding: Holding,
) -> Option<Outcome> {
    let mut rules: PerRule<RuleOutcome> = PerRule::new();
    rules.resize_with(checks.len(), RuleOutcome::default);
    // Grown in place, one rule at a time: a request's work is too large to be moved cheaply.
    let mut work: SmallVec<[HeldWork; 16]> = SmallVec::new();
    work.reserve_exact(checks.len());
    // Phase 1: decide every rule; nothing is written (but a corrupt bucket is reset).
    let mut refused = false;
    for (check, out) in checks.iter().zip(rules.iter_mut()) {
        work.push(HeldWork::default());
        let Some(w) = work.last_mut() else {
            continue; // just pushed
        };
        let looked = held_lookup(held, check, now_ms, holding);
        if holding == Holding::Firsts && !matches!(looked, Ok(HeldAt { index: Some(_), .. })) {
            return None; // not in its first bucket (held_lookup wrote nothing)
        }
        match looked {
            Ok(HeldAt {
                bucket,
                index,
                state,
                writes,
                first,
            }) => {
                w.bucket = Some(bucket);
                w.first = first;
                w.before = state;
                let (verdict, state) = check.policy.decide(w.before.as_ref(), now_ms, check.cost);
                refused |= !verdict.allowed && !check.shadow;
                out.above_base = check.above_base(&verdict, w.before.as_ref(), now_ms);
                if check.charge_later {
                    out.verdict = Some(check.reported(verdict, w.before.as_ref(), now_ms));
                } else {
                    out.verdict = Some(verdict);
                    w.pending = state.map(|s| (s, writes, index));
                }
            }
            Err(f) => {
                refused |= failure_mode == FailureMode::Deny && !check.shadow;
                out.failure = Some(f);
            }
        }
    }
    if refused {
        return Some(refused_outcome(
            rules,
            checks,
            work.iter().map(|w| w.before.as_ref()),
            now_ms,
        ));
    }
    // Phase 2: write each rule's state, deciding again a rule whose bucket changed meanwhile.
    for i in 0..checks.len() {
        let (Some(check), Some(out), Some(w)) = (checks.get(i), rules.get_mut(i), work.get_mut(i))
        else {
            continue;
        };
        let Some((mut state, writes, mut found)) = w.pending.take() else {
            continue; // the store failed for this rule and failure_mode is allow
        };
        let mut decided = true;
        let mut changed = |bucket: Option<usize>, writes: u32| {
            bucket
                .and_then(|b| held.get(b))
                .is_none_or(|(_, _, now)| now != writes)
        };
        let first_changed = w.first.is_some_and(|(a, n, _)| changed(Some(a), n));
        if first_changed || changed(w.bucket, writes) {
            out.retries += 1;
            let again = match (w.first, w.bucket) {
                (Some((_, _, ghost)), Some(b)) if !first_changed => {
                    held_lookup_in(held, b, check, now_ms, ghost)
                }
                _ => held_lookup(held, check, now_ms, holding),
            };
            match again {
                Ok(HeldAt {
                    bucket,
                    index,
                    state: again,
                    ..
                }) => {
                    w.bucket = Some(bucket);
                    let current = again.as_ref();
                    let (verdict, next) = check.policy.decide(current, now_ms, check.cost);
                    out.verdict = Some(verdict);
                    out.above_base = check.above_base(&verdict, current, now_ms);
                    match next {
                        Some(s) => {
                            state = s;
                            found = index;
                        }
                        None if check.shadow => decided = false, // count nothing
                        None => {
                            // Used up by this request's other rules: undo and refuse.
                            held_refund(held, checks, &work, holding);
                            let before = work.iter().map(|w| w.before.as_ref());
                            return Some(refused_outcome(rules, checks, before, now_ms));
                        }
                    }
                }
                Err(f) => {
                    out.failure = Some(f);
                    decided = false;
                }
            }
        }
        if decided {
            match held_place(held, w.bucket, check, found, &state, now_ms) {
                Ok(placement) => {
                    out.evicted = placement == Placement::Evicted;
                    out.filled = placement == Placement::Filled;
                    w.committed = Some(state);
                    // With compare-and-swap the key is announced in its first bucket, which
                    // that write changes: so it does here, for the rules after this one.
                    if let (Some((a, ..)), None) = (w.first, found) {
                        held.wrote(a);
                    }
                }
                Err(f) => out.failure = Some(f),
            }
        }
        let shadow_refused = check.shadow && out.verdict.is_some_and(|v| !v.allowed);
        if w.committed.is_none() && !shadow_refused {
            if out.failure.is_none() {
                out.failure = Some(Failure::RetriesExhausted);
            }
            out.verdict = None;
            if failure_mode == FailureMode::Deny && !check.shadow {
                held_refund(held, checks, &work, holding);
                let before = work.iter().map(|w| w.before.as_ref());
                return Some(refused_outcome(rules, checks, before, now_ms));
            }
        }
    }
    Some(Outcome {
        allowed: true,
        rules,
    })
}

/// The key's bucket among those held, of its two: the one that holds it, else (a new key) the
/// one with fewer live keys, the first on a tie. A bucket that is not one is reset (written)
/// and gives [`Failure::Corrupt`]. With first buckets alone held ([`Holding::Firsts`]): the
/// key found in its first, else [`StoreFault::NoSlot`] of its second, nothing written (a new
/// key and a corrupt bucket wait for [`Holding::Both`]).
#[inline(always)]
fn held_lookup(
    held: &mut Held<'_>,
    check: &Check,
    now_ms: u64,
    holding: Holding,
) -> Result<HeldAt, Failure> {
    let no_slot = || Failure::Unavailable(StoreFault::NoSlot(check.slot));
    let a = held.index(check.slot).ok_or_else(no_slot)?;
    // Its second bucket, held with [`Holding::Both`] (with [`Holding::Firsts`] a key is
    // looked for in its first bucket alone: one not there waits for both to be held).
    let second = match holding {
        Holding::Both => held.index(check.alt),
        Holding::Firsts => None,
    };
    let fp = check.fingerprint;
    // The key where it is: its first bucket, else its second.
    let mut at = Some(a);
    while let Some(i) = at {
        at = second.filter(|&b| i == a && b != a);
        let (bytes, present, writes) = held.get(i).ok_or_else(no_slot)?;
        match table::lookup(present.then_some(&bytes[..]), fp) {
            Ok(Some((index, state))) => {
                return Ok(HeldAt {
                    bucket: i,
                    index: Some(index),
                    state: Some(state),
                    writes,
                    first: None,
                })
            }
            Ok(None) => {}
            // Reset with every bucket held, so that no write comes before the retry.
            Err(table::Corrupt) if holding == Holding::Firsts => break,
            Err(table::Corrupt) => return held_lookup_in(held, i, check, now_ms, None),
        }
    }
    // A new key (placed with both its buckets held only): the bucket of the smaller load,
    // seeded from the other's ghost too.
    let b = second.ok_or(Failure::Unavailable(StoreFault::NoSlot(check.alt)))?;
    let mut look = |i: usize| {
        held.get(i).map(|(bytes, present, writes)| {
            let bytes = present.then_some(&bytes[..]);
            let load = table::load(bytes, now_ms);
            let marked = table::announced(bytes, fp, now_ms);
            (load, table::ghost_in(bytes, fp, now_ms), writes, marked)
        })
    };
    let ((load_a, ghost_a, writes_a, marked), (load_b, ghost_b, ..)) =
        (look(a).ok_or_else(no_slot)?, look(b).ok_or_else(no_slot)?);
    // A key announced in its first bucket (by a request with compare-and-swap) goes to its
    // second, as [`place::update_held`] places it.
    if a != b && (marked || load_b < load_a) {
        let mut at = held_lookup_in(held, b, check, now_ms, ghost_a)?;
        at.first = Some((a, writes_a, ghost_a));
        Ok(at)
    } else {
        held_lookup_in(held, a, check, now_ms, ghost_b)
    }
}

/// The key in held bucket `i` alone: its entry there, if it has one, and its state (else what
/// its ghosts seed, this bucket's and `elsewhere`).
fn held_lookup_in(
    held: &mut Held<'_>,
    i: usize,
    check: &Check,
    now_ms: u64,
    elsewhere: Option<Trace>,
) -> Result<HeldAt, Failure> {
    let (bytes, present, writes) = held
        .get(i)
        .ok_or(Failure::Unavailable(StoreFault::NoSlot(check.slot)))?;
    let at = |index, state| HeldAt {
        bucket: i,
        index,
        state,
        writes,
        first: None,
    };
    match table::lookup(present.then_some(&bytes[..]), check.fingerprint) {
        Ok(Some((index, state))) => Ok(at(Some(index), Some(state))),
        Ok(None) => {
            let seeded = seeded_from(
                &check.policy,
                &bytes[..],
                present,
                check.fingerprint,
                now_ms,
                elsewhere,
            );
            Ok(at(None, seeded))
        }
        Err(table::Corrupt) => {
            *bytes = table::empty_bucket();
            held.wrote(i);
            Err(Failure::Corrupt)
        }
    }
}

/// Writes a key's state into its held bucket: in place at its entry `found` when it has one,
/// else where the table's eviction policy puts it.
fn held_place(
    held: &mut Held<'_>,
    bucket: Option<usize>,
    check: &Check,
    found: Option<usize>,
    state: &State,
    now_ms: u64,
) -> Result<Placement, Failure> {
    let (slot, fingerprint) = (check.slot, check.fingerprint);
    let limit = table::limit_code(check.policy.most());
    let (b, (bytes, present, _)) = bucket
        .and_then(|i| Some((i, held.get(i)?)))
        .ok_or(Failure::Unavailable(StoreFault::NoSlot(slot)))?;
    let placement = match found {
        Some(i) if table::store_entry(bytes, i, fingerprint, state, limit) => Placement::Updated,
        _ => {
            let Ok(mut decoded) = Slot::decode(slot, present.then_some(&bytes[..])) else {
                // An entry the lookup did not read does not decode: reset, as a corrupt one.
                *bytes = table::empty_bucket();
                held.wrote(b);
                return Err(Failure::Corrupt);
            };
            let placement = decoded.put_limited(fingerprint, state.clone(), limit, now_ms);
            match decoded.encode() {
                table::Encoded::Bucket(encoded) => *bytes = encoded,
                table::Encoded::Log(_) => {
                    return Err(Failure::Unavailable(StoreFault::Undecodable))
                }
            }
            placement
        }
    };
    held.wrote(b);
    Ok(placement)
}

/// [`refund`] in held buckets.
fn held_refund(held: &mut Held<'_>, checks: &[Check], work: &[HeldWork], holding: Holding) {
    for (check, w) in checks.iter().zip(work) {
        let Some(counted) = &w.committed else {
            continue;
        };
        let Ok(HeldAt {
            bucket,
            index: Some(i),
            state: Some(current),
            ..
        }) = held_lookup(held, check, 0, holding)
        else {
            continue;
        };
        let back = check.policy.refund(current, counted, check.cost);
        let at = back.last_ms();
        let _ = held_place(held, Some(bucket), check, Some(i), &back, at);
    }
}
