//! What a shared capacity stores: one [`Tenant`] entry per tenant (a table entry, 23 bytes) and
//! one [`Record`] per rule (the capacity's own state, and per band the sums the water level is
//! computed from). Both are fixed-width little-endian, so a store can update them in place.

use crate::limiter::codec::{put_u32_at, put_u64_at, u32_at, u64_at};
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
const _: () = assert!(FLEET_LEFT + 4 == HEADER_LEN);
/// Where the header's fields are: the first word (version, band count, held epoch), the
/// epoch, the last step, the capacity's tagged state, the learned limit and until when, blocked
/// until, the fleet's window end and part, granted, spent and left.
const EPOCH: usize = 4;
const STEP: usize = 8;
const TAGGED: usize = 16;
const LEARNED: usize = TAGGED + table::TAGGED_LEN;
const LEARNED_UNTIL: usize = LEARNED + 8;
const BLOCKED: usize = LEARNED + 16;
const FLEET_END: usize = LEARNED + 24;
const FLEET_GRANTED: usize = LEARNED + 32;
const FLEET_LEFT: usize = LEARNED + 36;
/// Where a band's `used` and `level` are in its part of the record.
const USED: usize = 0;
const LEVEL: usize = 64;
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

    /// A counter of the band's at byte `at` of its part of the record.
    fn counter_at(b: &[u8; BAND_LEN], at: usize) -> sliding_window::State {
        sliding_window::State {
            last_ms: u64_at(b, at),
            window_ms: u32_at(b, at + 8),
            current: u32_at(b, at + 12),
            previous: u32_at(b, at + 16),
        }
    }

    /// Writes a counter as [`BandSums::counter_at`] reads it.
    fn put_counter(b: &mut [u8; BAND_LEN], at: usize, c: &sliding_window::State) {
        put_u64_at(b, at, c.last_ms);
        put_u32_at(b, at + 8, c.window_ms);
        put_u32_at(b, at + 12, c.current);
        put_u32_at(b, at + 16, c.previous);
    }

    /// Writes the band's fields into its part of the record (fixed offsets: a few stores).
    fn write(&self, b: &mut [u8; BAND_LEN]) {
        BandSums::put_counter(b, USED, &self.used);
        BandSums::put_counter(b, 20, &self.used_held);
        put_u32_at(b, 40, self.weight_now);
        put_u32_at(b, 44, self.weight_carry);
        put_u32_at(b, 48, self.held_now);
        put_u32_at(b, 52, self.held_carry);
        put_u64_at(b, 56, self.starved);
        put_u64_at(b, LEVEL, self.level);
        put_u64_at(b, 72, self.budget);
    }

    /// Reads what [`BandSums::write`] wrote (every bit pattern is some band's sums).
    fn read(b: &[u8; BAND_LEN]) -> BandSums {
        BandSums {
            used: BandSums::counter_at(b, USED),
            used_held: BandSums::counter_at(b, 20),
            weight_now: u32_at(b, 40),
            weight_carry: u32_at(b, 44),
            held_now: u32_at(b, 48),
            held_carry: u32_at(b, 52),
            starved: u64_at(b, 56),
            level: u64_at(b, LEVEL),
            budget: u64_at(b, 72),
        }
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

impl Fleet {
    /// The fleet's fields of a record's header.
    fn read(head: &[u8; HEADER_LEN]) -> Fleet {
        let (end, spent) = (u64_at(head, FLEET_END), u32_at(head, FLEET_LEFT));
        Fleet {
            window_end_ms: end & 0xffff_ffff_ffff,
            granted: u32_at(head, FLEET_GRANTED),
            part_pm: (end >> 48) as u16,
            spent: spent >> 31 != 0,
            left: spent & FLEET_LEFT_MAX,
        }
    }
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

    /// Fixed-width encoding: version 1, bands 1, held epoch 2, epoch 4, step_ms 8, the capacity's
    /// tagged state (24, zero when none), the learned limit 8, until 8, blocked until 8, the
    /// fleet's window end 6 and part 2, granted 4, spent 1 bit and left 31 bits (80 in all); then each band.
    pub fn encode(&self) -> RecordBytes {
        let mut out = RecordBytes::new();
        self.encode_into(&mut out);
        out
    }

    /// [`Record::encode`] into `out` (its bytes replaced), without moving a buffer around.
    pub fn encode_into(&self, out: &mut RecordBytes) {
        out.resize(Record::len_for(self.bands.len()), 0);
        self.write_to(out);
    }

    /// [`Record::encode`] into a value a store holds (its bytes replaced, in place when it held
    /// a record of as many bands; no allocation once it has held a record).
    pub fn encode_into_vec(&self, out: &mut Vec<u8>) {
        out.resize(Record::len_for(self.bands.len()), 0);
        self.write_to(out);
    }

    /// The encoding, into `out` of [`Record::len_for`] this record's bands (fixed offsets).
    fn write_to(&self, out: &mut [u8]) {
        let (head, bands) = out.split_at_mut(HEADER_LEN.min(out.len()));
        let Some(head) = head.first_chunk_mut::<HEADER_LEN>() else {
            return;
        };
        put_u32_at(
            head,
            0,
            u32::from(RECORD_VERSION)
                | (self.bands.len() as u32) << 8
                | u32::from(self.held_epoch) << 16,
        );
        put_u32_at(head, EPOCH, self.epoch);
        put_u64_at(head, STEP, self.step_ms);
        put_capacity(head, self.capacity.as_ref());
        put_u64_at(head, LEARNED, self.learned_limit);
        put_u64_at(head, LEARNED_UNTIL, self.learned_until_ms);
        put_u64_at(head, BLOCKED, self.blocked_until_ms);
        let f = &self.fleet;
        put_u64_at(
            head,
            FLEET_END,
            f.window_end_ms & 0xffff_ffff_ffff | u64::from(f.part_pm) << 48,
        );
        put_u32_at(head, FLEET_GRANTED, f.granted);
        put_u32_at(
            head,
            FLEET_LEFT,
            u32::from(f.spent) << 31 | f.left.min(FLEET_LEFT_MAX),
        );
        for (band, out) in self.bands.iter().zip(bands.chunks_exact_mut(BAND_LEN)) {
            if let Some(out) = out.first_chunk_mut::<BAND_LEN>() {
                band.write(out);
            }
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
        let (head, bands) = bytes.split_first_chunk::<HEADER_LEN>()?;
        let n = usize::from(head[1]);
        if head[0] != RECORD_VERSION
            || !(1..=MAX_BANDS).contains(&n)
            || bytes.len() != Record::len_for(n)
        {
            return None;
        }
        let capacity = capacity_of(head)?;
        self.bands.clear();
        for band in bands.chunks_exact(BAND_LEN) {
            self.bands
                .push(BandSums::read(band.first_chunk::<BAND_LEN>()?));
        }
        self.epoch = u32_at(head, EPOCH);
        self.held_epoch = held_epoch(head);
        self.step_ms = u64_at(head, STEP);
        self.capacity = capacity;
        self.learned_limit = u64_at(head, LEARNED);
        self.learned_until_ms = u64_at(head, LEARNED_UNTIL);
        self.blocked_until_ms = u64_at(head, BLOCKED);
        self.fleet = Fleet::read(head);
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

/// The capacity's state in a record's header: `Some(None)` when nothing was counted yet (the
/// field all zero: tag 0 is no state's), `None` when the field does not decode.
fn capacity_of(head: &[u8; HEADER_LEN]) -> Option<Option<State>> {
    let tagged = head.get(TAGGED..LEARNED)?;
    match tagged.split_first() {
        // Checked whole only then: a state's tag is never 0.
        Some((0, rest)) => rest.iter().all(|&b| b == 0).then_some(None),
        _ => table::decode_state(tagged).ok().map(Some),
    }
}

/// Writes the capacity's state as [`capacity_of`] reads it.
fn put_capacity(head: &mut [u8; HEADER_LEN], state: Option<&State>) {
    if let Some(tagged) = head.get_mut(TAGGED..LEARNED) {
        tagged.fill(0);
        if let Some(state) = state {
            table::encode_state(state, tagged);
        }
    }
}

/// The held epoch, in the header's first word.
fn held_epoch(head: &[u8; HEADER_LEN]) -> u16 {
    (u32_at(head, 0) >> 16) as u16
}

/// A record read and written in its bytes (fixed offsets, nothing decoded but what is asked
/// for): what [`super::in_place`] needs of it.
pub struct RecordView<'a> {
    head: &'a mut [u8; HEADER_LEN],
    bands: &'a mut [u8],
}

impl<'a> RecordView<'a> {
    /// The record in `bytes` if it is one [`Record::encode`] wrote with `n` bands.
    pub fn of(bytes: &'a mut [u8], n: usize) -> Option<RecordView<'a>> {
        let (head, bands) = bytes.split_first_chunk_mut::<HEADER_LEN>()?;
        let ok = head[0] == RECORD_VERSION
            && usize::from(head[1]) == n
            && (1..=MAX_BANDS).contains(&n)
            && bands.len() == BAND_LEN * n;
        ok.then_some(RecordView { head, bands })
    }

    /// [`Record::epoch`].
    pub fn epoch(&self) -> u32 {
        u32_at(self.head, EPOCH)
    }

    /// [`Record::held_epoch`].
    pub fn held_epoch(&self) -> u16 {
        held_epoch(self.head)
    }

    /// [`Record::step_ms`].
    pub fn step_ms(&self) -> u64 {
        u64_at(self.head, STEP)
    }

    /// [`Record::learned_limit`].
    pub fn learned_limit(&self) -> u64 {
        u64_at(self.head, LEARNED)
    }

    /// [`Record::blocked_until_ms`].
    pub fn blocked_until_ms(&self) -> u64 {
        u64_at(self.head, BLOCKED)
    }

    /// [`Record::fleet`].
    pub fn fleet(&self) -> Fleet {
        Fleet::read(self.head)
    }

    /// [`Record::capacity`]; `None` if it does not decode (nor would the record).
    pub fn capacity(&self) -> Option<Option<State>> {
        capacity_of(self.head)
    }

    /// Sets [`Record::capacity`].
    pub fn set_capacity(&mut self, state: Option<&State>) {
        put_capacity(self.head, state);
    }

    /// [`Record::bands`].
    pub fn bands(&self) -> SmallVec<[BandSums; MAX_BANDS]> {
        self.bands
            .chunks_exact(BAND_LEN)
            .filter_map(|b| b.first_chunk::<BAND_LEN>().map(BandSums::read))
            .collect()
    }

    /// Band `band`'s [`BandSums::used`] and [`BandSums::level`] (the rest of its sums unread).
    pub fn used_and_level(&self, band: usize) -> Option<(sliding_window::State, u64)> {
        let at = band.saturating_mul(BAND_LEN);
        let b = self.bands.get(at..)?.first_chunk::<BAND_LEN>()?;
        Some((BandSums::counter_at(b, USED), u64_at(b, LEVEL)))
    }

    /// Sets [`BandSums::used`] of band `band`.
    pub fn set_used(&mut self, band: usize, used: &sliding_window::State) {
        let at = band.saturating_mul(BAND_LEN);
        if let Some(b) = self.bands.get_mut(at..).and_then(|b| b.first_chunk_mut()) {
            BandSums::put_counter(b, USED, used);
        }
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
        assert_eq!(Record::decode(&empty.encode()), Some(empty.clone()));
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        let mut other = bytes.clone();
        other[0] = 1;
        assert_eq!(Record::decode(&other), None, "another version");
        let mut five = bytes;
        five[1] = 5;
        assert_eq!(Record::decode(&five), None, "too many bands");
        let mut junk = empty.encode();
        junk[16 + 5] = 0xab;
        assert_eq!(
            Record::decode(&junk),
            None,
            "no state's tag, but not all zero"
        );
    }

    /// Every field set to its own value: the bytes are the format's (version 3, as written
    /// before the fixed-offset codec), field by field.
    #[test]
    fn a_record_is_written_at_the_formats_offsets() {
        let counter = |k: u64| sliding_window::State {
            last_ms: 0x0101_0101_0101_0101 * k,
            window_ms: 0x0202_0202 * k as u32,
            current: 0x0303_0303 * k as u32,
            previous: 0x0404_0404 * k as u32,
        };
        let mut r = Record::new(2);
        r.epoch = 0x1122_3344;
        r.held_epoch = 0x5566;
        r.step_ms = 0x0102_0304_0506_0708;
        r.capacity = Some(State::SlidingWindow(counter(9)));
        r.learned_limit = 0x1111;
        r.learned_until_ms = 0x2222;
        r.blocked_until_ms = 0x3333;
        r.fleet = Fleet {
            window_end_ms: 0x0000_a1a2_a3a4_a5a6,
            granted: 0xb1b2_b3b4,
            part_pm: 0xc1c2,
            spent: true,
            left: 0x0d1d_2d3d,
        };
        for (i, b) in r.bands.iter_mut().enumerate() {
            let k = i as u64 + 1;
            *b = BandSums {
                used: counter(k),
                used_held: counter(k + 2),
                weight_now: 0x10 * k as u32,
                weight_carry: 0x20 * k as u32,
                held_now: 0x30 * k as u32,
                held_carry: 0x40 * k as u32,
                starved: 0x50 * k,
                level: 0x60 * k,
                budget: 0x70 * k,
            };
        }
        let hex: String = r.encode().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, GOLDEN);
        assert_eq!(Record::decode(&r.encode()), Some(r));
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

    /// [`Record::encode`] of `a_record_is_written_at_the_formats_offsets`'s record, in hex.
    const GOLDEN: &str = concat!(
        "03026655443322110807060504030201010909090909090909121212121b1b1b",
        "1b24242424000000111100000000000022220000000000003333000000000000",
        "a6a5a4a3a2a1c2c1b4b3b2b13d2d1d8d01010101010101010202020203030303",
        "04040404030303030303030306060606090909090c0c0c0c1000000020000000",
        "3000000040000000500000000000000060000000000000007000000000000000",
        "0202020202020202040404040606060608080808040404040404040408080808",
        "0c0c0c0c1010101020000000400000006000000080000000a000000000000000",
        "c000000000000000e000000000000000",
    );
}
