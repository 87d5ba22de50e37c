//! The engine's tests of shared capacities: across threads, refunds, and two workers deciding one tenant at once.

use super::tests::{check, stored, MINUTE};
use super::*;
use crate::store::{MemoryStore, StoreError};
use crate::testkit::Intercepted;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// A shared capacity's check for `tenant`, and how it is shared.
type SharedCheck = (Check, Option<ShareCheck>);

fn shared(slot: u64, tenant: u64, limit: u64, weight: u16) -> SharedCheck {
    let sc = ShareCheck {
        record: table::SlotKind::Share.slot(1),
        share: share::Share::for_bands(&[0]),
        asker: share::Asker {
            weight,
            band: 0,
            again: false,
            wait_ms: 0,
        },
        fleet: None,
    };
    (check(slot, tenant, limit, MINUTE), Some(sc))
}

/// [`decide_shared`] on checks each with its share, if it has one.
fn decide(store: &impl Store, checks: &[SharedCheck], now_ms: u64, mode: FailureMode) -> Outcome {
    let plain: Vec<Check> = checks.iter().map(|(c, _)| *c).collect();
    let shares: Vec<Shared> = (checks.iter().enumerate())
        .filter_map(|(i, (_, sc))| sc.map(|sc| (i, sc)))
        .collect();
    decide_shared(store, &plain, &shares, now_ms, mode)
}

fn record(store: &impl Store) -> share::Record {
    store
        .read(table::SlotKind::Share.slot(1), |bytes, _| {
            bytes.and_then(share::Record::decode)
        })
        .unwrap()
        .unwrap()
}

#[test]
fn a_shared_capacity_admits_its_limit_across_tenants_and_threads() {
    // Eight threads, sixteen tenants (two per bucket), one capacity of 500: exactly 500
    // admitted, every tenant counted once among the active, in both kinds of store.
    fn run(store: Arc<impl Store + Send + Sync + 'static>) {
        let admitted = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (store, admitted) = (store.clone(), admitted.clone());
                std::thread::spawn(move || {
                    for i in 0..200u64 {
                        let tenant = (t * 2 + i % 2) + 1;
                        let c = shared(tenant % 8, tenant, 500, 1 + (tenant % 3) as u16);
                        let o = decide(&*store, &[c], 1_000_000 + i, FailureMode::Deny);
                        if o.allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(admitted.load(Ordering::Relaxed), 500);
        let r = record(&*store);
        let weights: u64 = (1..=16u64).map(|t| 1 + t % 3).sum();
        assert_eq!(r.bands[0].active_weight(), weights);
        assert_eq!(r.bands[0].used.current, 500);
        let tenants: u32 = (1..=16u64)
            .map(|t| match stored(&*store, t % 8, t) {
                State::Tenant(t) => t.usage.current,
                other => panic!("{other:?}"),
            })
            .sum();
        assert_eq!(
            tenants, 500,
            "each tenant's usage adds up to the capacity's"
        );
    }
    run(Arc::new(MemoryStore::new()));
    run(Arc::new(crate::store::ProcessStore::new(8)));
}

/// A compare-and-swap store (as Envoy's shared data) in which another worker decides a
/// request of `racer` (at `racer_ms`) just before the next write of `racer`'s bucket: it
/// read the tenant's entry as this request did, and wins the race to write it.
fn racing(
    racer: &Mutex<Option<(SharedCheck, u64)>>,
) -> Intercepted<MemoryStore, impl Fn(&MemoryStore, u64) -> Result<(), StoreError> + '_> {
    Intercepted::new(MemoryStore::new(), move |inner, slot| {
        let racer = {
            let mut r = racer.lock().unwrap();
            match r.as_ref() {
                Some(((c, _), _)) if c.slot == slot => r.take(),
                _ => None,
            }
        };
        if let Some((check, at_ms)) = racer {
            decide(inner, &[check], at_ms, FailureMode::Deny);
        }
        Ok(())
    })
}

#[test]
fn two_workers_deciding_one_tenant_at_once_count_it_once() {
    // Active: the tenant's first request of an epoch on two workers at once.
    let racer = Mutex::new(Some((shared(3, 9, 100, 2), 1_000)));
    let store = racing(&racer);
    assert!(decide(&store, &[shared(3, 9, 100, 2)], 1_000, FailureMode::Deny).allowed);
    assert!(racer.lock().unwrap().is_none(), "the race was run");
    let r = record(&store.inner);
    assert_eq!(r.bands[0].active_weight(), 2, "weight 2, counted once");
    assert_eq!(r.bands[0].used.current, 2, "both requests count");
    match stored(&store.inner, 3, 9) {
        State::Tenant(t) => assert_eq!(t.usage.current, 2),
        other => panic!("{other:?}"),
    }

    // Held: two tenants of weight 1 over a capacity of 10, both held to their shares; in
    // the next held epoch tenant 9 is refused on two workers at once: its weight moves to
    // that epoch's held sum once, and tenant 7's stays in the last one's.
    let racer = Mutex::new(None);
    let store = racing(&racer);
    let mut now = 2_000_000;
    for i in 0..40 {
        decide(&store, &[shared(3, 9, 10, 1)], now, FailureMode::Deny);
        decide(&store, &[shared(4, 7, 10, 1)], now, FailureMode::Deny);
        now += 1 + i % 2;
    }
    let b = record(&store.inner).bands[0];
    assert_eq!((b.held_now, b.held_carry), (2, 0), "both held");
    now += share::HELD_MS;
    *racer.lock().unwrap() = Some((shared(3, 9, 10, 1), now));
    assert!(!decide(&store, &[shared(3, 9, 10, 1)], now, FailureMode::Deny).allowed);
    assert!(racer.lock().unwrap().is_none(), "the race was run");
    let b = record(&store.inner).bands[0];
    assert_eq!(
        (b.held_now, b.held_carry),
        (1, 1),
        "tenant 9 now, tenant 7 before"
    );
}

#[test]
fn a_request_another_rule_refuses_is_given_back_to_the_shared_capacity() {
    let store = MemoryStore::new();
    let strict = (check(5, 77, 2, MINUTE), None);
    let mut admitted = 0;
    for i in 0..5 {
        let o = decide(
            &store,
            &[shared(3, 9, 100, 1), strict],
            1_000 + i,
            FailureMode::Deny,
        );
        admitted += u32::from(o.allowed);
        assert!(o.rules[0].verdict.is_some() && o.rules.len() == 2);
    }
    assert_eq!(admitted, 2);
    assert_eq!(
        record(&store).bands[0].used.current,
        2,
        "the three refused were given back"
    );
    match stored(&store, 3, 9) {
        State::Tenant(t) => assert_eq!(t.usage.current, 2),
        other => panic!("{other:?}"),
    }
}
