//! A fleet-fair rule's tenant names by client key: [`crate::key::fleet_id`] reads the key's
//! parts from the request and hashes them a second time (the client key's seed is this Envoy's
//! secret, the fleet id's is public); a tenant that comes again finds its name here by the
//! client key already computed.
//!
//! A fixed table of [`SLOTS`] entries indexed by the client key, each the key, the name and a
//! check of both: the last tenant of a slot is remembered, and an entry read while another
//! worker writes it (the native build shares one runtime between workers) fails its check and
//! is worked out again. It only saves work: whatever it holds, a request's name is its key's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Entries in one rule's table (24 bytes each).
pub const SLOTS: usize = 1024;
/// Mixed into each entry's check, so that an empty entry (all zero) is no entry.
const CHECK: u64 = 0x9e37_79b9_7f4a_7c15;

/// One fleet-fair rule's table.
pub struct FleetIds {
    slots: Box<[[AtomicU64; 3]]>,
}

impl FleetIds {
    /// An empty table.
    pub fn new() -> FleetIds {
        FleetIds {
            slots: (0..SLOTS).map(|_| Default::default()).collect(),
        }
    }

    /// The fleet id of client key `hash`: the one remembered, else `make`'s (then
    /// remembered).
    pub fn get_or(&self, hash: u64, make: impl FnOnce() -> Option<u64>) -> Option<u64> {
        let slot = self.slots.get(hash as usize % SLOTS)?;
        let [key, id, check] = slot;
        let (k, i, c) = (key.load(Relaxed), id.load(Relaxed), check.load(Relaxed));
        if k == hash && c == check_of(k, i) {
            return Some(i);
        }
        let made = make()?;
        key.store(hash, Relaxed);
        id.store(made, Relaxed);
        check.store(check_of(hash, made), Relaxed);
        Some(made)
    }
}

impl Default for FleetIds {
    fn default() -> FleetIds {
        FleetIds::new()
    }
}

impl std::fmt::Debug for FleetIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetIds").finish_non_exhaustive()
    }
}

fn check_of(key: u64, id: u64) -> u64 {
    key ^ id.rotate_left(29) ^ CHECK
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_key_seen_again_finds_its_id_without_working_it_out() {
        let t = FleetIds::new();
        let made = std::cell::Cell::new(0);
        let make = |id| {
            made.set(made.get() + 1);
            Some(id)
        };
        assert_eq!(t.get_or(7, || make(70)), Some(70));
        assert_eq!(t.get_or(7, || make(99)), Some(70), "remembered");
        assert_eq!(made.get(), 1);
        // Another key in the same slot takes it; the first is worked out again.
        let other = 7 + SLOTS as u64;
        assert_eq!(t.get_or(other, || make(71)), Some(71));
        assert_eq!(t.get_or(7, || make(70)), Some(70));
        assert_eq!(made.get(), 3);
        // A key that has none (a part missing) is not remembered.
        assert_eq!(t.get_or(8, || None), None);
        assert_eq!(t.get_or(8, || make(80)), Some(80));
        // An empty slot is no entry, even for key 0.
        assert_eq!(FleetIds::new().get_or(0, || make(5)), Some(5));
    }

    #[test]
    fn an_entry_torn_by_a_write_is_no_entry() {
        let t = FleetIds::new();
        assert_eq!(t.get_or(3, || Some(30)), Some(30));
        // Another worker wrote the key and the id of its tenant but not yet the check.
        let slot = &t.slots[3];
        slot[1].store(31, Relaxed);
        assert_eq!(t.get_or(3, || Some(30)), Some(30), "worked out again");
        slot[0].store(3 + SLOTS as u64, Relaxed);
        assert_eq!(t.get_or(3, || Some(30)), Some(30));
    }
}
