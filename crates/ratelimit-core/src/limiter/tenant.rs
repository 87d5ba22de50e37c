//! The state of one tenant of a shared capacity (`crate::share`): a table entry like the
//! algorithms' states (23 bytes, tag 7), keeping what the tenant used over the rule's window and
//! how it was last counted among the active tenants.

use super::codec::{Reader, Writer};
use super::sliding_window;

/// The encoded length of a [`Tenant`]: exactly a table entry's state.
pub const TENANT_LEN: usize = 23;
/// How long the entry of a tenant that remembers no usage is kept after its last request: twice
/// the longest active interval, so it is never forgotten while it counts as active.
pub const KEEP_IDLE_MS: u64 = 2 * 3_600_000;
/// The tenant is held to its band's level (it asked for more than it).
const FLAG_HELD: u8 = 1 << 2;
/// The most bands a shared rule may have: a tenant's band takes two bits of its flags.
pub const MAX_BANDS: usize = 4;
const BAND_MASK: u8 = 0b11;
const _: () = assert!(BAND_MASK as usize == MAX_BANDS - 1);
/// Bits 3 to 6: the step (mod 16) the tenant was last refused for its share in.
const TICK_SHIFT: u8 = 3;
const TICK_MASK: u8 = 0b1111;

/// One tenant of a shared rule: what it used over the rule's window, and when and how it was
/// last counted among the active tenants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tenant {
    /// Its usage, a sliding window counter over the rule's window (cost units).
    pub usage: sliding_window::State,
    /// The low 16 bits of the epoch it was last counted in.
    pub epoch: u16,
    /// The weight it was counted with (0: never counted).
    pub weight: u16,
    /// The band it was counted in.
    pub band: u8,
    /// Whether it is held to its band's level (counted in the band's held weight).
    pub held: bool,
    /// The level step (ms / `share::STEP_MS`, mod 16) it was last refused for its share in.
    pub refused_tick: u8,
}

impl Tenant {
    /// Fixed-width encoding: usage (last_ms 8, current 4, previous 4, window 2), epoch 2,
    /// weight 2, band and flags 1.
    pub fn encode(&self) -> [u8; TENANT_LEN] {
        let mut out = [0u8; TENANT_LEN];
        let u = &self.usage;
        let head: [u8; 16] = Writer::new()
            .u64(u.last_ms)
            .u32(u.current)
            .u32(u.previous)
            .finish();
        let window = window_code(u.window_ms);
        let flags = (self.band & BAND_MASK)
            | if self.held { FLAG_HELD } else { 0 }
            | (self.refused_tick & TICK_MASK) << TICK_SHIFT;
        let tail = [
            window[0],
            window[1],
            self.epoch.to_le_bytes()[0],
            self.epoch.to_le_bytes()[1],
            self.weight.to_le_bytes()[0],
            self.weight.to_le_bytes()[1],
            flags,
        ];
        let (a, b) = out.split_at_mut(16);
        a.copy_from_slice(&head);
        b.copy_from_slice(&tail);
        out
    }

    /// Decodes [`Tenant::encode`]'s output; `None` for the wrong length or unknown flags.
    pub fn decode(bytes: &[u8]) -> Option<Tenant> {
        let bytes: &[u8; TENANT_LEN] = bytes.try_into().ok()?;
        let (head, tail) = bytes.split_first_chunk::<16>()?;
        let mut r = Reader(head);
        let (last_ms, current, previous) = (r.u64()?, r.u32()?, r.u32()?);
        let &[w0, w1, e0, e1, g0, g1, flags] = tail else {
            return None;
        };
        if flags & 0x80 != 0 {
            return None;
        }
        Some(Tenant {
            usage: sliding_window::State {
                last_ms,
                window_ms: window_ms_of([w0, w1]),
                current,
                previous,
            },
            epoch: u16::from_le_bytes([e0, e1]),
            weight: u16::from_le_bytes([g0, g1]),
            band: flags & BAND_MASK,
            held: flags & FLAG_HELD != 0,
            refused_tick: flags >> TICK_SHIFT & TICK_MASK,
        })
    }

    /// What the entry is worth keeping at `now_ms`: the usage it still remembers, or 1 while
    /// it may still count as active (a tenant refused all along remembers no usage, yet its
    /// entry is what keeps it from being counted again); `None` afterwards.
    pub fn weight_at(&self, now_ms: u64) -> Option<u64> {
        self.usage
            .weight(now_ms)
            .or_else(|| (now_ms < self.usage.last_ms.saturating_add(KEEP_IDLE_MS)).then_some(1))
    }
}

/// A window in two bytes: seconds up to 32,767, else minutes (high bit set), up to ~22 days.
fn window_code(window_ms: u32) -> [u8; 2] {
    let s = window_ms / 1000;
    let code = if s < 0x8000 {
        s as u16
    } else {
        0x8000 | (s / 60).min(0x7fff) as u16
    };
    code.to_le_bytes()
}

fn window_ms_of(code: [u8; 2]) -> u32 {
    let c = u32::from(u16::from_le_bytes(code));
    if c & 0x8000 == 0 {
        c * 1000
    } else {
        (c & 0x7fff) * 60_000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_round_trips_in_a_table_entrys_state() {
        let t = Tenant {
            usage: sliding_window::State {
                last_ms: 1_764_000_000_123,
                window_ms: 60_000,
                current: 4_000_000_000,
                previous: 7,
            },
            epoch: 0xbeef,
            weight: 65_535,
            band: 3,
            held: true,
            refused_tick: 11,
        };
        assert_eq!(Tenant::decode(&t.encode()), Some(t));
        // Windows of a week and a day keep their length (minutes past 32,767 s).
        for window_ms in [1_000, 60_000, 3_600_000, 86_400_000, 604_800_000] {
            let t = Tenant {
                usage: sliding_window::State {
                    window_ms,
                    ..t.usage
                },
                ..t
            };
            assert_eq!(Tenant::decode(&t.encode()), Some(t), "{window_ms}");
        }
        let mut bad = t.encode();
        bad[22] |= 0x80;
        assert_eq!(Tenant::decode(&bad), None, "unknown flags");
        assert_eq!(Tenant::decode(&t.encode()[..22]), None);
    }
}
