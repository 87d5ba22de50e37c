//! What a shared capacity stores: one [`Tenant`] entry per tenant (a table entry, 23 bytes) and
//! one [`Record`] per rule (the capacity's own state, and per band the sums the water level is
//! computed from). Both are fixed-width little-endian, so a store can update them in place.

use crate::limiter::codec::{Reader, Writer};
pub use crate::limiter::tenant::{Tenant, KEEP_IDLE_MS, MAX_BANDS, TENANT_LEN};
use crate::limiter::{sliding_window, State};
use crate::table;
use smallvec::SmallVec;

/// The record's format version, its first byte.
pub const RECORD_VERSION: u8 = 3;
/// The longest record: four bands.
pub const MAX_RECORD_LEN: usize = HEADER_LEN + BAND_LEN * MAX_BANDS;
/// A record's bytes, on the stack (the longest fits).
pub type RecordBytes = SmallVec<[u8; 512]>;
const _: () = assert!(MAX_RECORD_LEN <= 512);
/// The record's header length.
const HEADER_LEN: usize = 80;
const _: () = assert!(16 + table::TAGGED_LEN + 24 + 16 == HEADER_LEN);
/// One band's length in the record.
const BAND_LEN: usize = 80;
/// The level a band has when nobody in it needs one: every tenant may use what it asks.
pub const NO_LEVEL: u64 = u64::MAX;

/// One band's sums in the record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BandSums {
    /// What the band's tenants used over the rule's window.
    pub used: sliding_window::State,
    /// The part of it used by tenants held to the level.
    pub used_held: sliding_window::State,
    /// Weights of the tenants counted this epoch.
    pub weight_now: u32,
    /// Weights of those counted last epoch and not yet this one.
    pub weight_carry: u32,
    /// Weights of the tenants held to the level, counted this held epoch (a second): a held
    /// tenant is counted again in each held epoch it is refused in, so one that stops asking
    /// leaves the sums within two seconds.
    pub held_now: u32,
    /// Weights of the held tenants counted last held epoch and not yet this one.
    pub held_carry: u32,
    /// Demand refused to tenants below the band's mean by the capacity or the band's budget:
    /// halved at each level step.
    pub starved: u64,
    /// The level: cost units per unit of weight over the window, × [`super::LEVEL_ONE`];
    /// [`NO_LEVEL`] when no tenant needs holding.
    pub level: u64,
    /// The band's budget at the last step (cost units per window, × [`super::LEVEL_ONE`]).
    pub budget: u64,
}

impl BandSums {
    /// The weight of the tenants active now (counted this epoch or the last).
    pub fn active_weight(&self) -> u64 {
        u64::from(self.weight_now) + u64::from(self.weight_carry)
    }

    /// The weight of the active tenants held to the level.
    pub fn held_weight(&self) -> u64 {
        u64::from(self.held_now) + u64::from(self.held_carry)
    }

    fn bytes(&self) -> [u8; BAND_LEN] {
        let a = self.used;
        let b = self.used_held;
        Writer::new()
            .u64(a.last_ms)
            .u32(a.window_ms)
            .u32(a.current)
            .u32(a.previous)
            .u64(b.last_ms)
            .u32(b.window_ms)
            .u32(b.current)
            .u32(b.previous)
            .u32(self.weight_now)
            .u32(self.weight_carry)
            .u32(self.held_now)
            .u32(self.held_carry)
            .u64(self.starved)
            .u64(self.level)
            .u64(self.budget)
            .finish()
    }

    fn decode(r: &mut Reader) -> Option<BandSums> {
        let counter = |r: &mut Reader| -> Option<sliding_window::State> {
            Some(sliding_window::State {
                last_ms: r.u64()?,
                window_ms: r.u32()?,
                current: r.u32()?,
                previous: r.u32()?,
            })
        };
        Some(BandSums {
            used: counter(r)?,
            used_held: counter(r)?,
            weight_now: r.u32()?,
            weight_carry: r.u32()?,
            held_now: r.u32()?,
            held_carry: r.u32()?,
            starved: r.u64()?,
            level: r.u64()?,
            budget: r.u64()?,
        })
    }
}

/// A shared rule's record: the capacity's state (the rule's algorithm over all tenants), the
/// epoch the active sums refer to, when the level was last computed, and each band's sums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The epoch (now / the active interval) the bands' `weight_` sums refer to.
    pub epoch: u32,
    /// The held epoch (now / [`super::HELD_MS`], low 16 bits) the bands' `held_` sums refer to.
    pub held_epoch: u16,
    /// When the levels were last computed, ms.
    pub step_ms: u64,
    /// The capacity's state under the rule's algorithm (`None`: nothing counted yet).
    pub capacity: Option<State>,
    /// One per band, highest priority first (1 to [`MAX_BANDS`]).
    pub bands: SmallVec<[BandSums; MAX_BANDS]>,
    /// The capacity the provider stated, over the rule's window (0: none): see
    /// [`super::learn`].
    pub learned_limit: u64,
    /// Until when the learned limit holds before it climbs back, ms.
    pub learned_until_ms: u64,
    /// Until when the provider refused everyone, ms.
    pub blocked_until_ms: u64,
    /// A capacity leased across Envoys: this proxy's part of the fleet's grants.
    pub fleet: Fleet,
}

/// What one proxy got of a capacity leased across Envoys in the service's window: its part of
/// the fleet's grants is its part of the capacity ([`super::lease_part`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fleet {
    /// When the service's window of the grants counted here ends, ms (48 bits; 0: none).
    pub window_end_ms: u64,
    /// What the service granted this proxy in that window.
    pub granted: u32,
    /// This proxy's part of the fleet's capacity, permille (0: not known yet).
    pub part_pm: u16,
    /// The service refused a claim in that window (the fleet's quota ran out).
    pub spent: bool,
    /// What the service said the fleet had left of the capacity in that window, at its latest
    /// answer (at most [`FLEET_LEFT_MAX`]).
    pub left: u32,
}

/// The most [`Fleet::left`] holds (31 bits: it shares its field with `spent`).
pub const FLEET_LEFT_MAX: u32 = 0x7fff_ffff;

impl Record {
    /// A record with nothing counted, for `bands` bands.
    pub fn new(bands: usize) -> Record {
        Record {
            epoch: 0,
            held_epoch: 0,
            step_ms: 0,
            capacity: None,
            bands: smallvec::smallvec![
                BandSums {
                    level: NO_LEVEL,
                    ..BandSums::default()
                };
                bands.clamp(1, MAX_BANDS)
            ],
            learned_limit: 0,
            learned_until_ms: 0,
            blocked_until_ms: 0,
            fleet: Fleet::default(),
        }
    }

    /// The encoded length for `bands` bands.
    pub fn len_for(bands: usize) -> usize {
        HEADER_LEN + BAND_LEN * bands
    }

    /// Fixed-width encoding: version 1, bands 1, reserved 2, epoch 4, step_ms 8, the capacity's
    /// tagged state (24, zero when none), the learned limit 8, until 8, blocked until 8, the
    /// fleet's window end 6 and part 2, granted 4, spent 1 bit and left 31 bits (80 in all); then each band.
    pub fn encode(&self) -> RecordBytes {
        let mut out = RecordBytes::new();
        self.encode_into(&mut out);
        out
    }

    /// [`Record::encode`] into `out` (its bytes replaced), without moving a buffer around.
    pub fn encode_into(&self, out: &mut RecordBytes) {
        out.clear();
        self.write_to(|b| out.extend_from_slice(b));
    }

    /// [`Record::encode`] into a value a store holds (its bytes replaced; no allocation once it
    /// has held a record).
    pub fn encode_into_vec(&self, out: &mut Vec<u8>) {
        out.clear();
        self.write_to(|b| out.extend_from_slice(b));
    }

    /// The encoding, piece by piece.
    fn write_to(&self, mut push: impl FnMut(&[u8])) {
        let mut head = [0u8; HEADER_LEN];
        let fields: [u8; 16] = Writer::new()
            .u32(
                u32::from(RECORD_VERSION)
                    | (self.bands.len() as u32) << 8
                    | u32::from(self.held_epoch) << 16,
            )
            .u32(self.epoch)
            .u64(self.step_ms)
            .finish();
        let (first, rest) = head.split_at_mut(16);
        first.copy_from_slice(&fields);
        let (tagged, learned) = rest.split_at_mut(table::TAGGED_LEN);
        if let Some(state) = &self.capacity {
            table::encode_state(state, tagged);
        }
        let fields: [u8; 40] = Writer::new()
            .u64(self.learned_limit)
            .u64(self.learned_until_ms)
            .u64(self.blocked_until_ms)
            .u64(self.fleet.window_end_ms & 0xffff_ffff_ffff | u64::from(self.fleet.part_pm) << 48)
            .u32(self.fleet.granted)
            .u32(u32::from(self.fleet.spent) << 31 | self.fleet.left.min(FLEET_LEFT_MAX))
            .finish();
        learned.copy_from_slice(&fields);
        push(&head);
        for band in &self.bands {
            push(&band.bytes());
        }
    }

    /// Decodes [`Record::encode`]'s output; `None` for another version, a band count out of
    /// range, the wrong length or a state that does not decode.
    pub fn decode(bytes: &[u8]) -> Option<Record> {
        let mut record = Record::empty();
        record.decode_from(bytes).then_some(record)
    }

    /// A record of no band, to [`Record::decode_from`] into (not itself a valid record).
    pub fn empty() -> Record {
        Record {
            epoch: 0,
            held_epoch: 0,
            step_ms: 0,
            capacity: None,
            bands: SmallVec::new(),
            learned_limit: 0,
            learned_until_ms: 0,
            blocked_until_ms: 0,
            fleet: Fleet::default(),
        }
    }

    /// [`Record::decode`] into this record, in place (no record moves through the stack):
    /// whether the bytes decoded; if not, the record is left as some valid record.
    pub fn decode_from(&mut self, bytes: &[u8]) -> bool {
        self.try_decode_from(bytes).is_some()
    }

    fn try_decode_from(&mut self, bytes: &[u8]) -> Option<()> {
        let (&version, rest) = bytes.split_first()?;
        let (&bands, _) = rest.split_first()?;
        let n = usize::from(bands);
        if version != RECORD_VERSION || !(1..=MAX_BANDS).contains(&n) {
            return None;
        }
        if bytes.len() != Record::len_for(n) {
            return None;
        }
        let held_epoch = u16::from_le_bytes([*bytes.get(2)?, *bytes.get(3)?]);
        let mut r = Reader(bytes.get(4..16)?);
        let (epoch, step_ms) = (r.u32()?, r.u64()?);
        let tagged = bytes.get(16..16 + table::TAGGED_LEN)?;
        let capacity = if tagged.iter().all(|&b| b == 0) {
            None
        } else {
            Some(table::decode_state(tagged).ok()?)
        };
        let mut r = Reader(bytes.get(16 + table::TAGGED_LEN..HEADER_LEN)?);
        let (learned_limit, learned_until_ms, blocked_until_ms) = (r.u64()?, r.u64()?, r.u64()?);
        let (end, granted, spent) = (r.u64()?, r.u32()?, r.u32()?);
        let fleet = Fleet {
            window_end_ms: end & 0xffff_ffff_ffff,
            granted,
            part_pm: (end >> 48) as u16,
            spent: spent >> 31 != 0,
            left: spent & FLEET_LEFT_MAX,
        };
        let mut r = Reader(bytes.get(HEADER_LEN..)?);
        self.bands.clear();
        for _ in 0..n {
            let band = BandSums::decode(&mut r);
            self.bands.push(band.unwrap_or_default());
            band?;
        }
        r.end()?;
        self.epoch = epoch;
        self.held_epoch = held_epoch;
        self.step_ms = step_ms;
        self.capacity = capacity;
        self.learned_limit = learned_limit;
        self.learned_until_ms = learned_until_ms;
        self.blocked_until_ms = blocked_until_ms;
        self.fleet = fleet;
        Some(())
    }

    /// Moves the active sums to `epoch`: what was counted in the epoch before becomes the
    /// carry, older sums are dropped. Never moves back.
    pub fn roll(&mut self, epoch: u32) {
        if epoch <= self.epoch {
            return;
        }
        let next = epoch == self.epoch.saturating_add(1);
        for b in &mut self.bands {
            b.weight_carry = if next { b.weight_now } else { 0 };
            b.weight_now = 0;
        }
        self.epoch = epoch;
    }

    /// Moves the held sums to held epoch `epoch` (low 16 bits, so it wraps), as
    /// [`Record::roll`] does the active ones. An epoch a few behind the record's (another
    /// worker's clock) moves nothing; one further away in either direction starts afresh.
    pub fn roll_held(&mut self, epoch: u16) {
        let ahead = epoch.wrapping_sub(self.held_epoch);
        let empty = self.bands.iter().all(|b| b.held_weight() == 0);
        if ahead == 0 || (ahead >= u16::MAX - 15 && !empty) {
            return;
        }
        for b in &mut self.bands {
            b.held_carry = if ahead == 1 { b.held_now } else { 0 };
            b.held_now = 0;
        }
        self.held_epoch = epoch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra;

    #[test]
    fn a_record_round_trips_and_refuses_what_it_did_not_write() {
        let mut r = Record::new(3);
        r.epoch = 12_345;
        r.held_epoch = 0xfedc;
        r.step_ms = 1_764_000_000_250;
        r.capacity = Some(State::Gcra(gcra::State {
            tat_ms: 1_764_000_000_900,
            tat_frac: 3,
            limit: 50,
            window_ms: 1000,
        }));
        r.bands[1].weight_now = 7;
        r.bands[1].held_carry = 2;
        r.bands[2].starved = 99;
        r.bands[2].used.current = 5;
        r.bands[0].budget = 1234;
        r.fleet = Fleet {
            window_end_ms: 1_764_000_001_000,
            granted: 77,
            part_pm: 333,
            spent: true,
            left: 12_345,
        };
        let bytes = r.encode();
        assert_eq!(bytes.len(), 80 + 3 * 80);
        assert_eq!(Record::decode(&bytes), Some(r.clone()));
        let empty = Record::new(1);
        assert_eq!(Record::decode(&empty.encode()), Some(empty));
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        let mut other = bytes.clone();
        other[0] = 1;
        assert_eq!(Record::decode(&other), None, "another version");
        let mut five = bytes;
        five[1] = 5;
        assert_eq!(Record::decode(&five), None, "too many bands");
    }

    #[test]
    fn rolling_carries_one_epoch_and_forgets_older_ones() {
        let mut r = Record::new(2);
        r.epoch = 10;
        r.bands[0].weight_now = 5;
        r.bands[0].held_now = 2;
        r.bands[1].weight_now = 3;
        r.bands[1].weight_carry = 9;
        r.roll(10);
        assert_eq!(r.bands[0].active_weight(), 5, "same epoch: nothing moves");
        r.roll(11);
        assert_eq!((r.bands[0].weight_now, r.bands[0].weight_carry), (0, 5));
        assert_eq!(
            (r.bands[0].held_now, r.bands[0].held_carry),
            (2, 0),
            "held sums roll by their own epochs"
        );
        r.held_epoch = u16::MAX;
        r.roll_held(0);
        assert_eq!(
            (r.bands[0].held_now, r.bands[0].held_carry),
            (0, 2),
            "wrapped"
        );
        r.roll_held(u16::MAX);
        assert_eq!(r.held_epoch, 0, "never back a little");
        r.roll_held(2);
        assert_eq!(r.bands[0].held_weight(), 0);
        assert_eq!(r.bands[1].active_weight(), 3, "the older carry is gone");
        r.roll(9);
        assert_eq!(r.epoch, 11, "never back");
        r.roll(13);
        assert_eq!(r.bands[0].active_weight() + r.bands[1].active_weight(), 0);
    }
}
