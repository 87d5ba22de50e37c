//! Where a request is decided: every matching rule is checked against its key's state in the
//! store, and the request is counted only if all of them allow it.
//!
//! Check, then commit. First every rule's bucket is read and decided without writing (a
//! rejected request therefore costs reads only and consumes nothing). If all allow, each rule's
//! new state is written with compare-and-swap. If a write loses a race, that rule is read and
//! decided again; should it now refuse, the rules already committed for this request are
//! refunded. The guarantee: no rule ever admits more than its limit; a request refused by one
//! rule is not counted by the others, except for the instant between a commit and its refund,
//! when a concurrent request may see the count one higher and be refused (never over-admitted).

pub mod sliding_window;

use crate::config::{FailureMode, Quota};
use crate::store::{Store, StoreError, CREATE_CAS};
use crate::table::{Bucket, Placement};
use sliding_window::State;

/// CAS attempts for one rule before the store is deemed unable to decide.
pub const MAX_ATTEMPTS: u32 = 32;

/// One rule's decision for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether this rule admits the request.
    pub allowed: bool,
    /// The rule's limit (requests per window).
    pub limit: u64,
    /// The rule's window in seconds.
    pub window_s: u64,
    /// Whole requests left: after this one if allowed, else now.
    pub remaining: u64,
    /// Milliseconds until more quota is available than `remaining` (0: the quota is full).
    pub reset_ms: u64,
    /// If refused, milliseconds until a request like this one would be allowed.
    pub retry_after_ms: u64,
}

/// A rule that applies to the request, with where its key lives.
#[derive(Clone, Copy, Debug)]
pub struct Check {
    /// The store slot of the key's bucket.
    pub slot: u32,
    /// The key's fingerprint within the bucket.
    pub fingerprint: u64,
    /// The rule's limit.
    pub quota: Quota,
}

/// What happened to one rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleOutcome {
    /// The rule's verdict; `None` when the store could not decide.
    pub verdict: Option<Verdict>,
    /// CAS conflicts met.
    pub retries: u32,
    /// Why the store could not decide, if it could not.
    pub failure: Option<Failure>,
    /// Whether committing this rule evicted another live key from its bucket.
    pub evicted: bool,
}

/// Why the store could not decide for a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Every CAS attempt lost a race.
    RetriesExhausted,
    /// The slot's bytes were not a bucket (they are reset).
    Corrupt,
    /// A host call failed.
    Unavailable(String),
}

/// The decision for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request goes through.
    pub allowed: bool,
    /// One entry per check, in order.
    pub rules: Vec<RuleOutcome>,
}

/// A bucket as read: its contents and the CAS to write it back with.
struct Read {
    bucket: Bucket,
    cas: u32,
}

fn read(store: &impl Store, slot: u32) -> Result<Read, Failure> {
    let (bytes, cas) = store
        .get(slot)
        .map_err(|e| Failure::Unavailable(format!("{e:?}")))?;
    let cas = cas.unwrap_or(CREATE_CAS);
    match Bucket::decode(bytes.as_deref()) {
        Ok(bucket) => Ok(Read { bucket, cas }),
        Err(_) => {
            // Reset the slot so the keys in it work again from the next request on.
            let _ = store.set(slot, &Bucket::default().encode(), cas);
            Err(Failure::Corrupt)
        }
    }
}

/// Per-rule working state of one decision.
struct Work {
    /// The bucket as last read, and the state to write for this request.
    pending: Option<(Read, State)>,
    /// The key's state before this request, to report if the request is refused.
    before: Option<State>,
    /// The state written for this request, once committed (to refund it if needed).
    committed: Option<State>,
}

/// Decides a request of `cost` against every check, at `now_ms`.
pub fn decide(
    store: &impl Store,
    checks: &[Check],
    now_ms: u64,
    cost: u32,
    failure_mode: FailureMode,
) -> Outcome {
    let mut rules: Vec<RuleOutcome> = vec![RuleOutcome::default(); checks.len()];
    let mut work: Vec<Work> = Vec::with_capacity(checks.len());
    // Phase 1: read and decide every rule; nothing is written.
    let mut refused = false;
    for (check, out) in checks.iter().zip(rules.iter_mut()) {
        let mut w = Work {
            pending: None,
            before: None,
            committed: None,
        };
        match read(store, check.slot) {
            Ok(r) => {
                w.before = r.bucket.find(check.fingerprint);
                let (verdict, state) = sliding_window::decide(w.before, now_ms, &check.quota, cost);
                refused |= !verdict.allowed;
                out.verdict = Some(verdict);
                w.pending = state.map(|s| (r, s));
            }
            Err(f) => {
                refused |= failure_mode == FailureMode::Deny;
                out.failure = Some(f);
            }
        }
        work.push(w);
    }
    if refused {
        return refused_outcome(rules, checks, &work, now_ms);
    }
    // Phase 2: commit each rule with CAS, re-deciding a rule whose bucket changed meanwhile.
    for i in 0..checks.len() {
        let (Some(check), Some(out), Some(w)) = (checks.get(i), rules.get_mut(i), work.get_mut(i))
        else {
            continue;
        };
        let Some((mut r, mut state)) = w.pending.take() else {
            continue; // the store failed for this rule and failure_mode is allow
        };
        for _ in 0..MAX_ATTEMPTS {
            let placement = r.bucket.put(check.fingerprint, state, now_ms);
            match store.set(check.slot, &r.bucket.encode(), r.cas) {
                Ok(()) => {
                    out.evicted = placement == Placement::Evicted;
                    w.committed = Some(state);
                    break;
                }
                Err(StoreError::Conflict) => out.retries += 1,
                Err(StoreError::Unavailable(e)) => {
                    out.failure = Some(Failure::Unavailable(e));
                    break;
                }
            }
            match read(store, check.slot) {
                Ok(again) => r = again,
                Err(f) => {
                    out.failure = Some(f);
                    break;
                }
            }
            let found = r.bucket.find(check.fingerprint);
            let (verdict, next) = sliding_window::decide(found, now_ms, &check.quota, cost);
            out.verdict = Some(verdict);
            match next {
                Some(s) => state = s,
                None => {
                    // Lost the race to requests that used up the quota: undo and refuse.
                    refund(store, checks, &work, cost);
                    return refused_outcome(rules, checks, &work, now_ms);
                }
            }
        }
        if w.committed.is_none() {
            if out.failure.is_none() {
                out.failure = Some(Failure::RetriesExhausted);
            }
            out.verdict = None;
            if failure_mode == FailureMode::Deny {
                refund(store, checks, &work, cost);
                return refused_outcome(rules, checks, &work, now_ms);
            }
        }
    }
    Outcome {
        allowed: true,
        rules,
    }
}

/// A refused request: rules that would have admitted it report the quota as it is without
/// this request, which consumed nothing.
fn refused_outcome(
    mut rules: Vec<RuleOutcome>,
    checks: &[Check],
    work: &[Work],
    now_ms: u64,
) -> Outcome {
    for ((out, check), w) in rules.iter_mut().zip(checks).zip(work) {
        if let Some(v) = out.verdict.as_mut().filter(|v| v.allowed) {
            *v = sliding_window::decide(w.before, now_ms, &check.quota, 0).0;
        }
    }
    Outcome {
        allowed: false,
        rules,
    }
}

/// Takes back what a refused request had counted. Best effort: a refund that keeps losing
/// races is dropped, leaving the key counted once too often (conservative, never over-admits).
fn refund(store: &impl Store, checks: &[Check], work: &[Work], cost: u32) {
    for (check, w) in checks.iter().zip(work) {
        let Some(counted) = &w.committed else {
            continue;
        };
        for _ in 0..MAX_ATTEMPTS {
            let Ok(mut r) = read(store, check.slot) else {
                break;
            };
            let Some(current) = r.bucket.find(check.fingerprint) else {
                break;
            };
            let back = sliding_window::refund(current, counted, cost);
            r.bucket.put(check.fingerprint, back, back.last_ms);
            if store.set(check.slot, &r.bucket.encode(), r.cas).is_ok() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;
    use crate::store::MemoryStore;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    fn check(slot: u32, fp: u64, n: u32, unit: Unit) -> Check {
        Check {
            slot,
            fingerprint: fp,
            quota: Quota {
                requests_per_unit: n,
                unit,
            },
        }
    }

    #[test]
    fn a_request_refused_by_one_rule_is_not_counted_by_the_others() {
        let store = MemoryStore::new();
        let checks = [check(0, 3, 5, Unit::Minute), check(1, 5, 2, Unit::Minute)];
        let mut allowed = 0;
        for _ in 0..10 {
            allowed += decide(&store, &checks, 1_000, 1, FailureMode::Allow).allowed as u32;
        }
        assert_eq!(allowed, 2);
        // Refused by rule 1, the request leaves rule 0 its 3 remaining, and says so.
        let o = decide(&store, &checks, 1_000, 1, FailureMode::Allow);
        assert_eq!(o.rules[0].verdict.unwrap().remaining, 3);
        assert!(!o.rules[1].verdict.unwrap().allowed);
        // A rule whose key was never counted reports its whole quota, available now.
        let fresh = [check(2, 11, 7, Unit::Minute), checks[1]];
        let o = decide(&store, &fresh, 1_000, 1, FailureMode::Allow);
        let v = o.rules[0].verdict.unwrap();
        assert_eq!(
            (o.allowed, v.allowed, v.remaining, v.reset_ms),
            (false, true, 7, 0)
        );
        // Rule 0 counted only the two admitted requests: 3 left for a request rule 1 skips.
        let only_first = [checks[0]];
        let o = decide(&store, &only_first, 1_000, 1, FailureMode::Allow);
        assert_eq!(o.rules[0].verdict.unwrap().remaining, 2);
    }

    #[test]
    fn two_rules_in_one_bucket_commit_both() {
        let store = MemoryStore::new();
        let checks = [check(0, 3, 5, Unit::Minute), check(0, 5, 5, Unit::Minute)];
        let o = decide(&store, &checks, 1_000, 1, FailureMode::Allow);
        assert!(o.allowed);
        assert_eq!(
            o.rules[1].retries, 1,
            "the second write saw the first one's CAS"
        );
        let (bytes, _) = store.get(0).unwrap();
        let bucket = Bucket::decode(bytes.as_deref()).unwrap();
        assert_eq!(bucket.find(3).unwrap().current, 1);
        assert_eq!(bucket.find(5).unwrap().current, 1);
    }

    /// Many threads, one key: the admitted count equals the limit exactly, and CAS conflicts
    /// (including racing creations of the slot) really happened. The threads do nothing but
    /// hammer one slot, far harsher than Envoy workers that spend ~20 µs per request elsewhere,
    /// so a few requests may exhaust their attempts; with failure_mode deny they are refused,
    /// and the count must still come out exact.
    #[test]
    fn exact_under_thread_contention() {
        let (mut total_retries, mut total_failures) = (0, 0);
        for round in 0..20 {
            let store = Arc::new(MemoryStore::new());
            let limit = 1_000;
            let checks = [check(7, 9, limit, Unit::Hour)];
            let admitted = Arc::new(AtomicU32::new(0));
            let retries = Arc::new(AtomicU32::new(0));
            let failures = Arc::new(AtomicU32::new(0));
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let (store, admitted, retries, failures) = (
                        store.clone(),
                        admitted.clone(),
                        retries.clone(),
                        failures.clone(),
                    );
                    std::thread::spawn(move || {
                        for _ in 0..600 {
                            let o = decide(&*store, &checks, 5_000, 1, FailureMode::Deny);
                            admitted.fetch_add(o.allowed as u32, Ordering::Relaxed);
                            retries.fetch_add(o.rules[0].retries, Ordering::Relaxed);
                            failures
                                .fetch_add(o.rules[0].failure.is_some() as u32, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(admitted.load(Ordering::Relaxed), limit, "round {round}");
            let (bytes, _) = store.get(7).unwrap();
            let state = Bucket::decode(bytes.as_deref()).unwrap().find(9).unwrap();
            assert_eq!(state.current, limit);
            total_retries += retries.load(Ordering::Relaxed);
            total_failures += failures.load(Ordering::Relaxed);
        }
        assert!(total_retries > 0, "no CAS conflict happened");
        // 20 rounds × 2400 requests; exhausting 32 attempts must stay rare.
        assert!(
            total_failures < 480,
            "{total_failures} requests exhausted their attempts"
        );
    }

    /// A store where another worker uses up slot 1's quota just before our write to it.
    struct Racing {
        inner: MemoryStore,
        raced: std::sync::atomic::AtomicBool,
    }
    impl Store for Racing {
        fn get(&self, slot: u32) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.inner.get(slot)
        }
        fn set(&self, slot: u32, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if slot == 1 && !self.raced.swap(true, Ordering::Relaxed) {
                let other = [check(1, 5, 2, Unit::Minute)];
                for _ in 0..2 {
                    assert!(decide(&self.inner, &other, 1_000, 1, FailureMode::Deny).allowed);
                }
            }
            self.inner.set(slot, value, cas)
        }
    }

    #[test]
    fn losing_a_race_refunds_the_rules_already_committed() {
        let store = Racing {
            inner: MemoryStore::new(),
            raced: Default::default(),
        };
        let checks = [check(0, 3, 5, Unit::Minute), check(1, 5, 2, Unit::Minute)];
        let o = decide(&store, &checks, 1_000, 1, FailureMode::Deny);
        assert!(!o.allowed);
        assert_eq!(o.rules[1].retries, 1);
        assert!(!o.rules[1].verdict.unwrap().allowed);
        // Rule 0 had been committed, then refunded: its key counts nothing.
        let (bytes, _) = store.inner.get(0).unwrap();
        let state = Bucket::decode(bytes.as_deref()).unwrap().find(3).unwrap();
        assert_eq!(state.current, 0);
        assert_eq!(o.rules[0].verdict.unwrap().remaining, 5);
    }

    /// A store whose writes always conflict: failure_mode decides.
    struct Busy(MemoryStore);
    impl Store for Busy {
        fn get(&self, slot: u32) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.0.get(slot)
        }
        fn set(&self, _: u32, _: &[u8], _: u32) -> Result<(), StoreError> {
            Err(StoreError::Conflict)
        }
    }

    #[test]
    fn failure_mode_applies_when_the_store_cannot_decide() {
        let store = Busy(MemoryStore::new());
        let checks = [check(0, 3, 5, Unit::Minute)];
        let open = decide(&store, &checks, 0, 1, FailureMode::Allow);
        assert!(open.allowed);
        assert_eq!(open.rules[0].failure, Some(Failure::RetriesExhausted));
        assert_eq!(open.rules[0].retries, MAX_ATTEMPTS);
        let closed = decide(&store, &checks, 0, 1, FailureMode::Deny);
        assert!(!closed.allowed);
        // Corrupt bytes: failure mode for this request, and the slot is reset for the next.
        let mem = MemoryStore::new();
        mem.set(0, b"garbage", 0).unwrap();
        let o = decide(&mem, &checks, 0, 1, FailureMode::Deny);
        assert_eq!(
            (o.allowed, o.rules[0].failure.clone()),
            (false, Some(Failure::Corrupt))
        );
        assert!(decide(&mem, &checks, 0, 1, FailureMode::Deny).allowed);
    }
}
