//! The engine's tests of keys blocked by a service's refusal.

use super::*;
use crate::store::MemoryStore;

#[test]
fn a_blocked_key_is_refused_until_the_block_ends() {
    let store = MemoryStore::new();
    let check = Check {
        slot: 3,
        alt: 3,
        fingerprint: 7,
        policy: Policy::SlidingWindow {
            limit: 100,
            window_ms: 60_000,
        },
        cost: 1,
        shadow: false,
        charge_later: false,
        base: None,
    };
    assert!(decide(&store, &[check], 1_000, FailureMode::Allow).allowed);
    let (mut slot, cas) = store
        .read(3, |bytes, cas| (Slot::decode(3, bytes).unwrap(), cas))
        .unwrap();
    slot.put(7, State::Blocked { until_ms: 5_000 }, 1_000);
    store
        .write(3, slot.encode().as_ref(), cas.unwrap())
        .unwrap();
    let o = decide(&store, &[check], 2_000, FailureMode::Allow);
    assert!(!o.allowed, "{o:?}");
    assert_eq!(o.rules[0].verdict.unwrap().retry_after_ms, 3_000);
    let o = decide(&store, &[check], 5_000, FailureMode::Allow);
    assert!(o.allowed);
    assert_eq!(
        o.rules[0].verdict.unwrap().remaining,
        99,
        "afresh after the block"
    );
}
