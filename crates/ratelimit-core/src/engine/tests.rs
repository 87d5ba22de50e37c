//! The engine's unit tests: every path of a decision, on both kinds of store.

use super::*;
use crate::store::MemoryStore;
use crate::testkit::Intercepted;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub(super) const MINUTE: u64 = 60_000;
const HOUR: u64 = 3_600_000;

pub(super) fn check(slot: u64, fp: u64, n: u64, window_ms: u64) -> Check {
    Check {
        slot,
        alt: slot,
        fingerprint: fp,
        policy: Policy::SlidingWindow {
            limit: n,
            window_ms,
        },
        cost: 1,
        shadow: false,
        charge_later: false,
        base: None,
    }
}

pub(super) fn stored(store: &impl Store, slot: u64, fp: u64) -> State {
    store
        .read(slot, |bytes, _| Slot::decode(slot, bytes))
        .unwrap()
        .unwrap()
        .find(fp)
        .cloned()
        .unwrap()
}

fn current(state: State) -> u32 {
    match state {
        State::SlidingWindow(s) => s.current,
        other => panic!("{other:?}"),
    }
}

/// A policy of each kind the one-bucket path decides, small enough to refuse often.
fn small_policies() -> [Policy; 3] {
    use crate::limiter::{gcra, Windows};
    [
        Policy::SlidingWindow {
            limit: 3,
            window_ms: 1_000,
        },
        Policy::FixedWindow {
            limit: 2,
            windows: Windows::every(500),
        },
        Policy::Gcra(gcra::Params {
            limit: 4,
            window_ms: 1_000,
            burst: 2,
            max_delay_ms: None,
        }),
    ]
}

/// A random request's check on one of three slots: one of `policies`, keys sharing buckets, a
/// cost of 1 or 2, shadow one time in 5, charged later one time in `later`.
fn random_check(next: &mut impl FnMut(u64) -> u64, policies: &[Policy], later: u64) -> Check {
    let slot = next(3);
    // Two buckets half the time (a bucket alone: as a table of one bucket).
    let alt = (slot + next(2) * (1 + next(2))) % 3;
    Check {
        slot,
        alt,
        fingerprint: 1 + 2 * next(7),
        policy: policies[next(policies.len() as u64) as usize],
        cost: 1 + next(2),
        shadow: next(5) == 0,
        charge_later: next(later) == 0,
        base: None,
    }
}

/// A slot as stored; `None`: corrupt (until a rule decides on it).
fn slot_of(s: &impl Store, slot: u64) -> Option<Slot> {
    s.read(slot, |b, _| Slot::decode(slot, b)).unwrap().ok()
}

/// The one-bucket path decides exactly as the general path: the same outcomes and the same
/// stored slots over random requests (keys sharing buckets, evictions, refusals, shadow
/// rules, a clock going back, corrupt slots), whether it updates a copy with CAS (shared
/// data) or the store's own bucket under its lock (the native build's process store).
#[test]
fn the_one_bucket_path_matches_the_general_path() {
    let mut rng = crate::testkit::Rng(0x9e37_79b9_7f4a_7c15u64);
    let mut next = move |n: u64| rng.below(n);
    let policies = small_policies();
    for mode in [FailureMode::Allow, FailureMode::Deny] {
        let (fast, general) = (MemoryStore::new(), MemoryStore::new());
        let held = crate::store::ProcessStore::new(3);
        let mut now = 10_000u64;
        for _ in 0..20_000 {
            now = (now + next(300)).saturating_sub(next(50));
            let check = random_check(&mut next, &policies, 4);
            if next(500) == 0 {
                for s in [&fast, &general] {
                    s.write(check.slot, b"garbage", 0).unwrap();
                }
                held.write(check.slot, &[b'g'; BUCKET_LEN], 0).unwrap();
            }
            let a = decide(&fast, &[check], now, mode);
            let b = decide_general(&general, &[check], now, mode);
            let c = decide(&held, &[check], now, mode);
            assert_eq!(a, b, "{check:?} at {now}");
            assert_eq!(a, c, "{check:?} at {now}");
            for slot in 0..3 {
                let kept = slot_of(&fast, slot).unwrap();
                assert_eq!(Some(&kept), slot_of(&general, slot).as_ref());
                assert_eq!(Some(&kept), slot_of(&held, slot).as_ref());
            }
        }
    }
}

/// Several rules decided with their buckets held (the native build's process store) decide
/// exactly as with copies and compare-and-swap: the same outcomes, retries included, and
/// the same stored slots over random requests of one to four rules (sharing buckets,
/// evicting one another, refused by some, shadow or charged later, corrupt buckets).
#[test]
fn held_buckets_decide_as_compare_and_swap() {
    use crate::store::ProcessStore;
    let mut rng = crate::testkit::Rng(0x2545_f491_4f6c_dd1du64);
    let mut next = move |n: u64| rng.below(n);
    let [sliding, fixed, gcra] = small_policies();
    let in_flight = Policy::InFlight {
        max: 2,
        lease_ms: 2_000,
    };
    let policies = [sliding, fixed, gcra, in_flight];
    // Requests: [refused, admitted, refused after a retry (undone), admitted after one].
    let mut seen = [0u32; 4];
    for mode in [FailureMode::Allow, FailureMode::Deny] {
        let (cas, held) = (MemoryStore::new(), ProcessStore::new(3));
        let mut now = 10_000u64;
        for _ in 0..20_000 {
            now = (now + next(300)).saturating_sub(next(50));
            let checks: Vec<Check> = (0..1 + next(4))
                .map(|_| random_check(&mut next, &policies, 6))
                .collect();
            if next(300) == 0 {
                let slot = next(3);
                cas.write(slot, b"garbage", 0).unwrap();
                held.write(slot, &[b'g'; BUCKET_LEN], 0).unwrap();
            }
            let a = decide_general(&cas, &checks, now, mode);
            let b = decide(&held, &checks, now, mode);
            assert_eq!(a, b, "{checks:?} at {now}");
            let retried = a.rules.iter().any(|r| r.retries > 0);
            seen[usize::from(retried) * 2 + usize::from(a.allowed)] += 1;
            for slot in 0..3 {
                assert_eq!(slot_of(&cas, slot), slot_of(&held, slot), "{checks:?}");
            }
        }
    }
    assert!(seen.iter().all(|&n| n > 20), "{seen:?}");
}

#[test]
fn a_request_refused_by_one_rule_is_not_counted_by_the_others() {
    let store = MemoryStore::new();
    let checks = [check(0, 3, 5, MINUTE), check(1, 5, 2, MINUTE)];
    let mut allowed = 0;
    for _ in 0..10 {
        allowed += decide(&store, &checks, 1_000, FailureMode::Allow).allowed as u32;
    }
    assert_eq!(allowed, 2);
    // Refused by rule 1, the request leaves rule 0 its 3 remaining, and says so.
    let o = decide(&store, &checks, 1_000, FailureMode::Allow);
    assert_eq!(o.rules[0].verdict.unwrap().remaining, 3);
    assert!(!o.rules[1].verdict.unwrap().allowed);
    // A rule whose key was never counted reports its whole quota, available now.
    let fresh = [check(2, 11, 7, MINUTE), checks[1]];
    let o = decide(&store, &fresh, 1_000, FailureMode::Allow);
    let v = o.rules[0].verdict.unwrap();
    assert_eq!(
        (o.allowed, v.allowed, v.remaining, v.reset_ms),
        (false, true, 7, 0)
    );
    // Rule 0 counted only the two admitted requests: 3 left for a request rule 1 skips.
    let only_first = [checks[0]];
    let o = decide(&store, &only_first, 1_000, FailureMode::Allow);
    assert_eq!(o.rules[0].verdict.unwrap().remaining, 2);
}

#[test]
fn two_rules_in_one_bucket_commit_both() {
    let store = MemoryStore::new();
    let checks = [check(0, 3, 5, MINUTE), check(0, 5, 5, MINUTE)];
    let o = decide(&store, &checks, 1_000, FailureMode::Allow);
    assert!(o.allowed);
    assert_eq!(
        o.rules[1].retries, 1,
        "the second write saw the first one's CAS"
    );
    assert_eq!(current(stored(&store, 0, 3)), 1);
    assert_eq!(current(stored(&store, 0, 5)), 1);
}

/// A [`MemoryStore`] whose reader gives up its CPU after every eighth read: another thread
/// reads the same version before the first writes, so compare-and-swap conflicts happen
/// however the scheduler runs the threads (on two busy cores they may otherwise run one
/// by one), and still seldom enough that a request's attempts are not all lost to them.
#[derive(Default)]
struct Yielding(MemoryStore, AtomicU32);

impl Store for Yielding {
    fn read<T>(
        &self,
        slot: u64,
        f: impl FnOnce(Option<&[u8]>, Option<u32>) -> T,
    ) -> Result<T, crate::store::StoreError> {
        let read = self.0.read(slot, f);
        if self.1.fetch_add(1, Ordering::Relaxed) % 8 == 0 {
            std::thread::yield_now();
        }
        read
    }
    fn write(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), crate::store::StoreError> {
        self.0.write(slot, value, cas)
    }
}

/// Many threads, one key, started together: the admitted count equals the limit exactly,
/// and CAS conflicts (including racing creations of the slot) really happened. The threads
/// do nothing but hammer one slot, far harsher than Envoy workers that spend ~20 µs per
/// request elsewhere, so a few requests may exhaust their attempts; with failure_mode deny
/// they are refused, and the count must still come out exact.
#[test]
fn exact_under_thread_contention() {
    let (mut total_retries, mut total_failures) = (0, 0);
    for round in 0..20 {
        let store = Arc::new(Yielding::default());
        let start = Arc::new(std::sync::Barrier::new(4));
        let limit = 1_000;
        let checks = [check(7, 9, limit, HOUR)];
        let admitted = Arc::new(AtomicU32::new(0));
        let retries = Arc::new(AtomicU32::new(0));
        let failures = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (store, admitted, retries, failures, start) = (
                    store.clone(),
                    admitted.clone(),
                    retries.clone(),
                    failures.clone(),
                    start.clone(),
                );
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..600 {
                        let o = decide(&*store, &checks, 5_000, FailureMode::Deny);
                        admitted.fetch_add(o.allowed as u32, Ordering::Relaxed);
                        retries.fetch_add(o.rules[0].retries, Ordering::Relaxed);
                        failures.fetch_add(o.rules[0].failure.is_some() as u32, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            u64::from(admitted.load(Ordering::Relaxed)),
            limit,
            "round {round}"
        );
        assert_eq!(current(stored(&*store, 7, 9)), limit as u32);
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

#[test]
fn shadow_rules_count_and_report_but_never_refuse() {
    let store = MemoryStore::new();
    let shadow = Check {
        shadow: true,
        ..check(0, 3, 2, MINUTE)
    };
    let checks = [shadow, check(1, 5, 4, MINUTE)];
    let outcomes: Vec<Outcome> = (0..5)
        .map(|_| decide(&store, &checks, 1_000, FailureMode::Deny))
        .collect();
    let allowed: Vec<bool> = outcomes.iter().map(|o| o.allowed).collect();
    // The enforced rule (4) decides; the shadow rule (2) would have refused from the 3rd.
    assert_eq!(allowed, [true, true, true, true, false]);
    let shadow_refused: Vec<bool> = outcomes
        .iter()
        .map(|o| !o.rules[0].verdict.unwrap().allowed)
        .collect();
    assert_eq!(shadow_refused, [false, false, true, true, true]);
    // It counted only what it would have admitted.
    assert_eq!(current(stored(&store, 0, 3)), 2);
    // A failing store never makes a shadow rule refuse, even with failure_mode deny.
    let busy = busy();
    let o = decide(&busy, &[shadow], 0, FailureMode::Deny);
    assert!(o.allowed);
    assert_eq!(o.rules[0].failure, Some(Failure::RetriesExhausted));
}

#[test]
fn losing_a_race_refunds_the_rules_already_committed() {
    // Another worker uses up slot 1's quota just before our write to it.
    let raced = std::sync::atomic::AtomicBool::new(false);
    let store = Intercepted::new(MemoryStore::new(), |inner, slot| {
        if slot == 1 && !raced.swap(true, Ordering::Relaxed) {
            let other = [check(1, 5, 2, MINUTE)];
            for _ in 0..2 {
                assert!(decide(inner, &other, 1_000, FailureMode::Deny).allowed);
            }
        }
        Ok(())
    });
    let checks = [check(0, 3, 5, MINUTE), check(1, 5, 2, MINUTE)];
    let o = decide(&store, &checks, 1_000, FailureMode::Deny);
    assert!(!o.allowed);
    assert_eq!(o.rules[1].retries, 1);
    assert!(!o.rules[1].verdict.unwrap().allowed);
    // Rule 0 had been committed, then refunded: its key counts nothing.
    assert_eq!(current(stored(&store.inner, 0, 3)), 0);
    assert_eq!(o.rules[0].verdict.unwrap().remaining, 5);
}

/// A store whose writes always conflict: failure_mode decides.
fn busy() -> impl Store {
    Intercepted::new(MemoryStore::new(), |_, _| Err(StoreError::Conflict))
}

#[test]
fn failure_mode_applies_when_the_store_cannot_decide() {
    let store = busy();
    let checks = [check(0, 3, 5, MINUTE)];
    let open = decide(&store, &checks, 0, FailureMode::Allow);
    assert!(open.allowed);
    assert_eq!(open.rules[0].failure, Some(Failure::RetriesExhausted));
    assert_eq!(open.rules[0].retries, MAX_ATTEMPTS);
    let closed = decide(&store, &checks, 0, FailureMode::Deny);
    assert!(!closed.allowed);
    // Corrupt bytes: failure mode for this request, and the slot is reset for the next.
    let mem = MemoryStore::new();
    mem.write(0, b"garbage", 0).unwrap();
    let o = decide(&mem, &checks, 0, FailureMode::Deny);
    assert_eq!(
        (o.allowed, o.rules[0].failure.clone()),
        (false, Some(Failure::Corrupt))
    );
    assert!(decide(&mem, &checks, 0, FailureMode::Deny).allowed);
}
#[test]
fn charged_later_counts_nothing_until_settled() {
    charged_later_in(&MemoryStore::new());
    charged_later_in(&crate::store::ProcessStore::new(1));
}

fn charged_later_in(store: &impl Store) {
    let later = Check {
        cost: 4, // the reserve
        charge_later: true,
        ..check(0, 3, 10, MINUTE)
    };
    for _ in 0..5 {
        let o = decide(store, &[later], 1_000, FailureMode::Deny);
        assert!(o.allowed);
        assert_eq!(o.rules[0].verdict.unwrap().remaining, 10, "nothing counted");
    }
    assert!(
        store.read(0, |b, _| b.is_none()).unwrap(),
        "nothing written"
    );
    // Charged 8: 2 left, less than the reserve of 4.
    let out = settle(store, (0, 0), 3, &later.policy, Owed::Charge(8), 1_000);
    assert_eq!(out.verdict.unwrap().remaining, 2);
    assert!(out.filled);
    let o = decide(store, &[later], 1_000, FailureMode::Deny);
    assert!(!o.allowed);
    assert_eq!(o.rules[0].verdict.unwrap().remaining, 2);
    // Over the limit: charged whatever it says.
    let out = settle(store, (0, 0), 3, &later.policy, Owed::Charge(30), 1_000);
    assert_eq!(out.verdict.unwrap().remaining, 0);
    assert_eq!(current(stored(store, 0, 3)), 38);
}

#[test]
fn in_flight_slots_come_back_through_settle() {
    in_flight_in(&MemoryStore::new());
    in_flight_in(&crate::store::ProcessStore::new(2));
}

fn in_flight_in(store: &impl Store) {
    let flight = Check {
        policy: Policy::InFlight {
            max: 2,
            lease_ms: MINUTE,
        },
        ..check(0, 3, 0, 0)
    };
    let take = |now| decide(store, &[flight], now, FailureMode::Deny).allowed;
    assert!(take(1_000) && take(1_001) && !take(1_002));
    let back = settle(
        store,
        (0, 0),
        3,
        &flight.policy,
        Owed::GiveBack { taken_ms: 1_000 },
        1_500,
    );
    assert_eq!((back.verdict, back.failure), (None, None));
    assert!(take(1_600) && !take(1_601));
    // A key the table forgot: nothing to give back, nothing written.
    let other = settle(
        store,
        (1, 1),
        9,
        &flight.policy,
        Owed::GiveBack { taken_ms: 1_000 },
        2_000,
    );
    assert_eq!(other, RuleOutcome::default());
    assert!(store.read(1, |b, _| b.is_none()).unwrap());
    // A refused request of two rules gives its slot back (the refund path).
    let both = [flight, check(1, 5, 0, MINUTE)];
    let store2 = MemoryStore::new();
    for _ in 0..3 {
        assert!(!decide(&store2, &both, 1_000, FailureMode::Deny).allowed);
    }
    assert!(decide(&store2, &[flight], 1_000, FailureMode::Deny).allowed);
    assert!(decide(&store2, &[flight], 1_000, FailureMode::Deny).allowed);
}
