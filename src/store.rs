//! Where per-key state lives: a versioned byte store with compare-and-swap.
//!
//! The semantics are those of proxy-wasm shared data in Envoy, quirks included, so that the
//! in-memory implementation used by native tests fails the same way Envoy would:
//! - every write gets a new CAS value from one global counter;
//! - a write with CAS 0 is unconditional; any other CAS must equal the stored one...
//! - ...except when the key does not exist yet: then the CAS is ignored and the write succeeds.
//!   The table therefore creates keys with [`CREATE_CAS`], a value no live key carries, so the
//!   second of two racing creators gets a conflict instead of silently overwriting the first.

use std::collections::HashMap;
use std::sync::Mutex;

/// The CAS the table passes when creating a key. Envoy's counter would need 4 billion writes
/// to hand out this value, so an existing key virtually never matches it.
pub const CREATE_CAS: u32 = u32::MAX;

/// Why a store operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Another writer changed the value since it was read.
    Conflict,
    /// The store itself failed (a host call returned an unexpected status).
    Unavailable(String),
}

/// A versioned byte store with compare-and-swap; slots are numbered.
pub trait Store {
    /// The value of `slot` and its CAS; `(None, None)` when the slot was never written.
    fn get(&self, slot: u64) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Writes `value` if the slot's CAS still equals `cas` (0: unconditionally).
    fn set(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

/// An in-memory [`Store`] with Envoy's semantics, safe to share between threads.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    next_cas: u32,
    slots: HashMap<u64, (Vec<u8>, u32)>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many slots have been written.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.slots.len()).unwrap_or(0)
    }

    /// Whether no slot has been written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Store for MemoryStore {
    fn get(&self, slot: u64) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        let guard = self
            .inner
            .lock()
            .map_err(|_| StoreError::Unavailable("poisoned".into()))?;
        Ok(match guard.slots.get(&slot) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set(&self, slot: u64, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| StoreError::Unavailable("poisoned".into()))?;
        if let Some((_, current)) = guard.slots.get(&slot) {
            if cas != 0 && cas != *current {
                return Err(StoreError::Conflict);
            }
        }
        guard.next_cas = guard.next_cas.wrapping_add(1).max(1);
        let next = guard.next_cas;
        guard.slots.insert(slot, (value.to_vec(), next));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_envoy_shared_data() {
        let s = MemoryStore::new();
        assert_eq!(s.get(1).unwrap(), (None, None));
        // The CAS is ignored for a key that does not exist yet...
        s.set(1, b"a", 12345).unwrap();
        let (v, cas) = s.get(1).unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        let cas = cas.unwrap();
        // ...and checked once it does.
        assert_eq!(s.set(1, b"b", CREATE_CAS), Err(StoreError::Conflict));
        assert_eq!(s.set(1, b"b", cas + 1), Err(StoreError::Conflict));
        s.set(1, b"b", cas).unwrap();
        assert_eq!(s.set(1, b"c", cas), Err(StoreError::Conflict));
        s.set(1, b"c", 0).unwrap();
        assert_eq!(s.len(), 1);
    }
}
