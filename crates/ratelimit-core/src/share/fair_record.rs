//! What one Envoy keeps of a fleet-fair shared capacity (`share.fleet: "fair"`, [`super::fair`]):
//! one record per rule in the store, shared by its workers: the view of the fleet it last read,
//! what it wrote to the fleet's band sums, what it expects to admit, and each tenant it serves
//! ([`Local`]: its asks by epoch, its demand here and in the fleet, its credit).
//!
//! A tenant is known by [`Tracked::id`], a hash of its key that every Envoy computes alike
//! ([`crate::key::fleet_id`]): the service counts it under that name, never the key itself.
//! At most [`MAX_TENANTS`] tenants are kept per Envoy and rule, in the order of their ids (a
//! request finds its tenant's entry by halving, reads and writes that entry alone). A new one
//! takes the place of one that has asked nothing for [`super::fair`]'s kept epochs; while every
//! place is taken by an active tenant, that of the highest id if the new one's is lower, so
//! that every Envoy seeing more active tenants than it keeps keeps the same ones (those of the
//! lowest ids), and a tenant spread over the fleet is kept on all its Envoys or on none. A
//! tenant not kept is not tracked (admitted under the rule's local shares and the lease, as a
//! lone Envoy's are).
//!
//! Fixed-width little-endian; a record that does not decode (another version, cut short) is
//! read as empty.

use super::fair::{self, BandCounts, BandView, Local, View};
use super::{Share, MAX_BANDS};

/// The record's format version, its first byte.
pub const VERSION: u8 = 4;
/// The weights of the band sums a report adds are whole multiples of this (thousandths of a
/// unit of weight, [`fair::ONE`] being a unit): a service's counter holds at most 4,294,967,295
/// (the protocol's `requests_per_unit`), 4,294 units of weight in millionths, 4.3 million in
/// thousandths.
pub const WEIGHT_UNIT: u64 = fair::ONE / 1000;
/// The most tenants one Envoy keeps of one rule.
pub const MAX_TENANTS: usize = 256;
/// The epochs of the asks a [`Local`] keeps.
const KEPT: usize = 4;
const NONE: u64 = u64::MAX;
const BAND_SUMS: usize = 4;
const HEADER_LEN: usize =
    2 + 8 + 8 + MAX_BANDS * 24 + 2 * (8 + MAX_BANDS * BAND_SUMS * 8) + 8 + 8 + 8 + 3 * 8 + 2;
const TENANT_LEN: usize = 8 + 2 + 1 + 8 + KEPT * 4 + 8 + 8 + 8 + 8;

/// One tenant this Envoy serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracked {
    /// Its name in the service's counters ([`crate::key::fleet_id`]).
    pub id: u64,
    /// Its weight at its last request.
    pub weight: u16,
    /// Its band at its last request.
    pub band: u8,
    /// What this Envoy keeps of it.
    pub local: Local,
}

/// One counter of a report: a tenant's asks or one of a band's sums, in one epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item {
    /// What tenant `id` asked over the fleet in `epoch`.
    Asked {
        /// The tenant.
        id: u64,
        /// The epoch.
        epoch: u64,
    },
    /// Sum `sum` (0 demand, 1 free, 2 held weight, 3 active weight: [`BandCounts`]'s fields)
    /// of band `band` in `epoch`.
    Band {
        /// The band.
        band: u8,
        /// Which sum.
        sum: u8,
        /// The epoch.
        epoch: u64,
    },
}

/// What one report writes and reads: each counter with what it adds (0: read only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The epoch the report was made in (it writes the one before, reads the one before that).
    pub epoch: u64,
    /// The counters, in the order they are sent.
    pub items: Vec<(Item, u64)>,
}

/// The record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FairRecord {
    /// The epoch of the last report made here (0: none).
    pub reported: u64,
    /// The fleet as last read.
    pub view: View,
    /// What this Envoy added to the band sums in its last two reports, and for which epochs
    /// (`u64::MAX`: none).
    pub wrote: [(u64, [BandCounts; MAX_BANDS]); 2],
    /// What this Envoy expects to admit a window, cost units × [`super::LEVEL_ONE`], as of its
    /// last answer (`None`: none yet).
    pub part: Option<u64>,
    /// What the whole fleet is expected to admit a window as of the view, cost units ×
    /// [`super::LEVEL_ONE`] ([`fair::View`]'s bands' use: what each asked, up to its budget;
    /// 0: no view yet).
    pub fleet_use: u64,
    /// The tenants it serves.
    pub tenants: Vec<Tracked>,
    /// This Envoy's own draw for rounding the weights it reports (the runtime's, set at the
    /// first report: [`crate::runtime::Runtime::with_fair_dither`]): see
    /// [`FairRecord::report`].
    pub dither: u64,
    /// What the tenants it does not keep (every place taken) asked here: the epoch of the
    /// first figure, and the figures of that epoch and the one before. They are shared locally
    /// but take quota all the same, so what this Envoy expects to admit counts them.
    pub untracked: (u64, [u64; 2]),
}

impl FairRecord {
    /// A record of nothing, for `bands` bands.
    pub fn new(bands: usize) -> FairRecord {
        FairRecord {
            reported: 0,
            view: View::new(bands),
            wrote: [(NONE, [BandCounts::default(); MAX_BANDS]); 2],
            part: None,
            fleet_use: 0,
            tenants: Vec::new(),
            dither: 0,
            untracked: (0, [0; 2]),
        }
    }

    /// The record in `bytes`, or a new one for `bands` bands if they do not hold one of as many
    /// (a configuration whose rule changed its bands starts its view afresh).
    pub fn decode_or_new(bytes: Option<&[u8]>, bands: usize) -> FairRecord {
        bytes
            .and_then(|b| decode(b, bands))
            .unwrap_or_else(|| FairRecord::new(bands))
    }

    /// The encoded record.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(HEADER_LEN + TENANT_LEN * self.tenants.len());
        out.push(VERSION);
        out.push(self.view.bands.len().clamp(1, MAX_BANDS) as u8);
        let mut put = |v: u64| out.extend_from_slice(&v.to_le_bytes());
        put(self.reported);
        put(self.view.epoch.unwrap_or(NONE));
        for i in 0..MAX_BANDS {
            let b = self.view.bands.get(i).copied().unwrap_or(BandView {
                level: super::NO_LEVEL,
                budget: 0,
                reserved: 0,
            });
            put(b.level);
            put(b.budget);
            put(b.reserved);
        }
        for (epoch, sums) in &self.wrote {
            put(*epoch);
            for s in sums {
                put(s.demand);
                put(s.free);
                put(s.held_weight);
                put(s.active_weight);
            }
        }
        put(self.part.unwrap_or(NONE));
        put(self.fleet_use);
        put(self.dither);
        put(self.untracked.0);
        put(self.untracked.1[0]);
        put(self.untracked.1[1]);
        let n = self.tenants.len().min(MAX_TENANTS) as u16;
        out.extend_from_slice(&n.to_le_bytes());
        let mut sorted = std::borrow::Cow::Borrowed(&self.tenants[..]);
        if !sorted.is_sorted_by_key(|t| t.id) {
            sorted.to_mut().sort_unstable_by_key(|t| t.id);
        }
        for t in sorted.iter().take(MAX_TENANTS) {
            out.extend_from_slice(&tracked_bytes(t));
        }
    }

    /// The tenant `id`'s place, taking one for it if it has none: a free one, else one whose
    /// tenant is no longer active in epoch `epoch`, else the highest id's if `id` is lower
    /// (`None`: every place is an active tenant's of a lower id).
    fn place(&mut self, id: u64, epoch: u64) -> Option<usize> {
        let at = match self.tenants.binary_search_by_key(&id, |t| t.id) {
            Ok(i) => return Some(i),
            Err(at) => at,
        };
        let fresh = Tracked {
            id,
            weight: 1,
            band: 0,
            local: Local::default(),
        };
        // The tenants stay in the order of their ids (a request finds its tenant's entry in
        // the encoded record by halving).
        if self.tenants.len() >= MAX_TENANTS {
            // An idle tenant's place; else, while every place is an active tenant's, the
            // place of the one of the highest id, if it is above this one's: every Envoy that
            // sees more tenants than it keeps keeps those of the lowest ids, so that a tenant
            // spread over the fleet is kept on all its Envoys or on none.
            let gone = match self.tenants.iter().position(|t| !t.local.active(epoch)) {
                Some(i) => i,
                None if at < self.tenants.len() => self.tenants.len() - 1,
                None => return None,
            };
            self.tenants.remove(gone);
            let at = if gone < at { at - 1 } else { at };
            self.tenants.insert(at, fresh);
            return Some(at);
        }
        self.tenants.insert(at, fresh);
        Some(at)
    }

    /// A request of `cost` at `now_ms` (windows of `window_ms`) from tenant `id` of `weight` in
    /// `band`: counted as the tenant's demand if `asks` (not a waiting request's turn), and, if
    /// the rule's local shares `admitted` it, taken from the tenant's allowance here. `Ok`: the
    /// allowance covers it (or no fleet level holds the tenant, or it is not tracked); `Err`:
    /// how long until it would, ms.
    pub fn request(
        &mut self,
        (id, weight, band): (u64, u16, u8),
        (now_ms, window_ms): (u64, u64),
        cost: u64,
        (asks, admitted): (bool, bool),
    ) -> Result<(), u64> {
        let window_ms = window_ms.max(1);
        let epoch = now_ms / window_ms;
        let level = self.view.level(band, epoch);
        // A place only for a request that asks: a tenant kept is active in the epoch it was
        // placed in (a waiting request's turn, its ask counted when it came, does not place
        // its tenant).
        let place = if asks {
            self.place(id, epoch)
        } else {
            self.tenants.binary_search_by_key(&id, |t| t.id).ok()
        };
        let Some(i) = place else {
            if asks {
                self.untracked_ask(epoch, cost);
            }
            return Ok(());
        };
        let Some(t) = self.tenants.get_mut(i) else {
            return Ok(());
        };
        serve(
            t,
            level,
            (weight, band),
            (now_ms, window_ms),
            cost,
            (asks, admitted),
        )
    }

    /// Counts an ask of `cost` in `epoch` from a tenant this Envoy does not keep.
    fn untracked_ask(&mut self, epoch: u64, cost: u64) {
        let (at, n) = &mut self.untracked;
        if epoch > *at {
            *n = if epoch == at.saturating_add(1) {
                [0, n[0]]
            } else {
                [0; 2]
            };
            *at = epoch;
        }
        // An ask of the epoch before (a worker's clock a little behind another's at the
        // turn) counts there; an older one is left out.
        let slot = match at.checked_sub(epoch) {
            Some(0) => n.get_mut(0),
            Some(1) => n.get_mut(1),
            _ => None,
        };
        if let Some(x) = slot {
            *x = x.saturating_add(cost);
        }
    }

    /// What the tenants this Envoy does not keep asked in `epoch` (0 when not kept).
    fn untracked_in(&self, epoch: u64) -> u64 {
        let (at, n) = self.untracked;
        match at.checked_sub(epoch) {
            Some(0) => n[0],
            Some(1) => n[1],
            _ => 0,
        }
    }

    /// [`FairRecord::request`] on the encoded record `bytes` (of `bands` bands), in place, for
    /// a tenant the record keeps: only the view and that tenant's entry are read, and only the
    /// entry is written. `None` when `bytes` is not such a record or does not keep the tenant
    /// ([`FairRecord::request`] on the whole record then).
    pub fn request_in_place(
        bytes: &mut [u8],
        bands: usize,
        (id, weight, band): (u64, u16, u8),
        (now_ms, window_ms): (u64, u64),
        cost: u64,
        how: (bool, bool),
    ) -> Option<Result<(), u64>> {
        let window_ms = window_ms.max(1);
        let level = head_level(bytes, bands, band, now_ms / window_ms)?;
        let served = in_entry(bytes, id, |t| {
            serve(t, level, (weight, band), (now_ms, window_ms), cost, how)
        })?;
        match served {
            Ok(r) => Some(r),
            Err(n) => (n == MAX_TENANTS)
                .then(|| untracked_in_place(bytes, (id, now_ms / window_ms), cost, how.0))
                .flatten(),
        }
    }

    /// What the encoded record `bytes` (of `bands` bands) says of a request at `now_ms`
    /// (windows of `window_ms`) from tenant `id` of `weight` in `band`, for
    /// [`fair::keeping`]: its band's view, what this Envoy's tenants under their shares and
    /// those of the bands above ask here a window (× [`super::LEVEL_ONE`], [`fair::expected`]),
    /// and whether the tenant is held to its share (one it does not keep is not). Nothing is
    /// written; `None` when `bytes` is not such a record.
    pub fn kept_for(
        bytes: &[u8],
        bands: usize,
        (id, weight, band): (u64, u16, u8),
        (now_ms, window_ms): (u64, u64),
    ) -> Option<(BandView, u64, bool)> {
        let (_, view, _) = decode_head(bytes, bands)?;
        let epoch = now_ms / window_ms.max(1);
        let last = epoch.saturating_sub(1);
        let b = view.band(band, epoch);
        let mut here = 0u64;
        let mut held = false;
        for raw in bytes.get(HEADER_LEN..)?.chunks_exact(TENANT_LEN) {
            let Some(t) = decode_tracked(raw) else {
                continue;
            };
            let level = view.level(t.band, epoch);
            let t_held =
                t.band == band && fair::held(level, t.weight, &t.local, t.local.asked_in(last));
            if t.id == id {
                held = fair::held(b.level, weight, &t.local, t.local.asked_in(last));
            }
            if t.band < band || (t.band == band && !t_held) {
                here = here.saturating_add(fair::expected(level, t.weight, &t.local, epoch));
            }
        }
        Some((b, here, held))
    }

    /// [`FairRecord::give_back`] on the encoded record `bytes` (of `bands` bands), in place:
    /// only that tenant's entry is read and written. `Some(true)`: given back; `Some(false)`:
    /// nothing to give back (a full record does not keep the tenant); `None` when `bytes` is
    /// not such a record, or may keep the tenant out of the order of ids (one of an earlier
    /// version): [`FairRecord::give_back`] on the whole record then.
    pub fn give_back_in_place(
        bytes: &mut [u8],
        bands: usize,
        id: u64,
        cost: u64,
        window_ms: u64,
    ) -> Option<bool> {
        of_this_version(bytes, bands)?;
        match in_entry(bytes, id, |t| t.local.give_back(cost, window_ms))? {
            Ok(()) => Some(true),
            // An earlier version kept at most 64, in no order.
            Err(n) => (n == MAX_TENANTS).then_some(false),
        }
    }

    /// Gives back to tenant `id`'s allowance a request of `cost` it covered (another check
    /// refused the request).
    pub fn give_back(&mut self, id: u64, cost: u64, window_ms: u64) {
        if let Some(t) = self.tenants.iter_mut().find(|t| t.id == id) {
            t.local.give_back(cost, window_ms);
        }
    }

    /// The report due in epoch `epoch` (`None`: one was made in it already,
    /// or no tenant asked lately): what the tenants asked here in the epoch before and this
    /// Envoy's part of the band sums of that epoch, written; the same counters of the epoch
    /// before that, read. Marks the epoch reported.
    pub fn report(&mut self, bands: usize, epoch: u64) -> Option<Report> {
        if self.reported >= epoch || epoch < fair::READ_LAG {
            return None;
        }
        self.reported = epoch;
        self.tenants.retain(|t| t.local.active(epoch));
        if self.tenants.is_empty() {
            return None;
        }
        let bands = bands.clamp(1, MAX_BANDS);
        let last = epoch - 1;
        let read = epoch - fair::READ_LAG;
        let mut sums = [BandCounts::default(); MAX_BANDS];
        let mut items = Vec::with_capacity(2 * self.tenants.len() + 8 * bands);
        for t in &self.tenants {
            let level = self.view.level(t.band, epoch);
            if let Some(c) = fair::contribution(level, t.weight, &t.local, last) {
                if let Some(s) = sums.get_mut(usize::from(t.band)) {
                    *s = s.plus(c);
                }
                items.push((
                    Item::Asked {
                        id: t.id,
                        epoch: last,
                    },
                    t.local.asked_in(last),
                ));
            }
        }
        // What is sent, and so what is written: weights rounded to the unit the service counts,
        // up with the odds of the remainder (down otherwise), by a draw of this Envoy's own.
        // Rounded to the nearest, a tenant spread over many replicas, each holding a small
        // fraction of its weight, vanished from the sums (1,000 proxies, each under half a
        // unit: the level rose by a quarter) or counted half again (300, each over half);
        // rounded at random, each replica's error is unbiased and the replicas' errors do not
        // add up.
        // One draw a band for both weights, so that the held weight stays within the active.
        let mut draw = self.dither ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let round = |w: u64, d: u64| {
            let up = d % WEIGHT_UNIT < w % WEIGHT_UNIT;
            (w / WEIGHT_UNIT + u64::from(up)) * WEIGHT_UNIT
        };
        for s in sums.iter_mut() {
            draw = mix(draw);
            s.held_weight = round(s.held_weight, draw);
            s.active_weight = round(s.active_weight, draw);
        }
        for (b, s) in sums.iter().enumerate().take(bands) {
            for (sum, v) in [s.demand, s.free, s.held_weight, s.active_weight]
                .into_iter()
                .enumerate()
            {
                let item = Item::Band {
                    band: b as u8,
                    sum: sum as u8,
                    epoch: last,
                };
                items.push((item, v));
            }
        }
        // Made again in the same epoch (the first one was not counted): the same window's
        // sums, in place.
        if self.wrote[1].0 == last {
            self.wrote[1] = (last, sums);
        } else {
            self.wrote = [self.wrote[1], (last, sums)];
        }
        for t in &self.tenants {
            items.push((
                Item::Asked {
                    id: t.id,
                    epoch: read,
                },
                0,
            ));
        }
        for b in 0..bands {
            for sum in 0..BAND_SUMS {
                let item = Item::Band {
                    band: b as u8,
                    sum: sum as u8,
                    epoch: read,
                };
                items.push((item, 0));
            }
        }
        Some(Report { epoch, items })
    }

    /// The report made in `epoch` was not counted (the service refused the claim it rode on,
    /// whole): it is due again. Returns whether the record changed.
    pub fn unreported(&mut self, epoch: u64) -> bool {
        let undo = self.reported == epoch && epoch > 0;
        if undo {
            self.reported = epoch - 1;
        }
        undo
    }

    /// The service's answer to `report`: each item's counter as it stands after the call
    /// (`values`, in the items' order; `None` where the answer says nothing of it). The band
    /// sums read, if whole and believable ([`fair::believable`]), become the view; each
    /// tenant's fleet demand read is folded in ([`Local::told`]); what this Envoy expects to
    /// admit is computed anew. `limit`: the capacity a window.
    pub fn answered(&mut self, share: &Share, limit: u64, report: &Report, values: &[Option<u64>]) {
        let bands = share.bands.clamp(1, MAX_BANDS);
        let read = report.epoch.saturating_sub(fair::READ_LAG);
        let mut counts = [BandCounts::default(); MAX_BANDS];
        let mut whole = [0usize; MAX_BANDS];
        for ((item, hits), value) in report.items.iter().zip(values) {
            if *hits != 0 {
                continue;
            }
            match (item, value) {
                (Item::Asked { id, epoch }, Some(v)) if *epoch == read => {
                    if let Some(t) = self.tenants.iter_mut().find(|t| t.id == *id) {
                        t.local.told(read, *v);
                    }
                }
                (Item::Band { band, sum, epoch }, Some(v)) if *epoch == read => {
                    let b = usize::from(*band);
                    if let Some(c) = counts.get_mut(b) {
                        match sum {
                            0 => c.demand = *v,
                            1 => c.free = *v,
                            2 => c.held_weight = *v,
                            _ => c.active_weight = *v,
                        }
                        if let Some(w) = whole.get_mut(b) {
                            *w += 1;
                        }
                    }
                }
                _ => {}
            }
        }
        let complete = whole.iter().take(bands).all(|&n| n == BAND_SUMS);
        let own = self.wrote.iter().find(|(e, _)| *e == read).map(|(_, s)| *s);
        let believed = own.is_none_or(|own| {
            own.iter()
                .zip(&counts)
                .take(bands)
                .all(|(o, r)| fair::believable(r, o))
        });
        let newer = self.view.epoch.is_none_or(|e| e < read);
        if complete && believed && newer {
            let counts = counts.get(..bands).unwrap_or(&[]);
            self.view = fair::view(share, limit, share.target_pm, read, counts);
            self.fleet_use = fair::fleet_use(&self.view, counts);
        }
        let epoch = report.epoch;
        let untracked = self
            .untracked_in(epoch.saturating_sub(1))
            .max(self.untracked_in(epoch))
            .saturating_mul(super::LEVEL_ONE);
        let part = self.tenants.iter().fold(untracked, |acc, t| {
            let level = self.view.level(t.band, epoch);
            acc.saturating_add(fair::expected(level, t.weight, &t.local, epoch))
        });
        self.part = Some(part);
    }
}

/// A request of `cost` from tenant `t`, of `weight` in `band` now, under the view's `level` for
/// its band: [`FairRecord::request`]'s work once the tenant is found.
fn serve(
    t: &mut Tracked,
    level: u64,
    (weight, band): (u16, u8),
    (now_ms, window_ms): (u64, u64),
    cost: u64,
    (asks, admitted): (bool, bool),
) -> Result<(), u64> {
    let epoch = now_ms / window_ms.max(1);
    t.weight = weight.max(1);
    t.band = band;
    if asks {
        t.local.ask(epoch, cost);
    }
    if !admitted {
        return Ok(());
    }
    let allowance = fair::allowance(level, t.weight, &t.local);
    if t.local.take(allowance, now_ms, window_ms, cost) {
        return Ok(());
    }
    // What is missing of half the request, at the allowance's pace.
    let per_ms = allowance.unwrap_or(0).max(1);
    let need = i128::from(cost.saturating_mul(super::LEVEL_ONE)) * i128::from(window_ms) / 2;
    let short = u64::try_from(need - i128::from(t.local.credit)).unwrap_or(0);
    Err((short / per_ms).clamp(1, window_ms))
}

/// Tenant `id`'s entry in the encoded record `bytes`, changed where it lies by `f`: `Ok` with
/// `f`'s result; `Err(n)`: the record keeps `n` tenants, not this one; `None` when `bytes` do
/// not end in a record's tenants.
fn in_entry<R>(
    bytes: &mut [u8],
    id: u64,
    f: impl FnOnce(&mut Tracked) -> R,
) -> Option<Result<R, usize>> {
    let n = usize::from(u16::from_le_bytes(
        *bytes.get(HEADER_LEN - 2..)?.first_chunk::<2>()?,
    ));
    if n > MAX_TENANTS || bytes.len() != HEADER_LEN + n * TENANT_LEN {
        return None;
    }
    let Some(i) = find(bytes.get(HEADER_LEN..)?, n, id) else {
        return Some(Err(n));
    };
    let slot = bytes
        .get_mut(HEADER_LEN + i * TENANT_LEN..)?
        .get_mut(..TENANT_LEN)?;
    let mut t = decode_tracked(slot)?;
    let r = f(&mut t);
    slot.copy_from_slice(&tracked_bytes(&t));
    Some(Ok(r))
}

/// Where tenant `id`'s entry is among the `n` entries of `entries` (in the order of their ids),
/// found by halving; `None`: not there (or the entries are out of order: a record of an
/// earlier version, which [`decode`] puts in order).
fn find(entries: &[u8], n: usize, id: u64) -> Option<usize> {
    let id_at = |i: usize| {
        entries
            .get(i * TENANT_LEN..)
            .and_then(|e| e.first_chunk::<8>())
            .map(|b| u64::from_le_bytes(*b))
    };
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match id_at(mid)?.cmp(&id) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return Some(mid),
        }
    }
    None
}

/// A request in `epoch` from tenant `id`, which the encoded record `bytes` (every place taken)
/// does not keep, when no place can be its: every place was an active tenant's already in this
/// epoch (its untracked asks are of this epoch: [`FairRecord::place`] found no place in it,
/// and no tenant stops being active within an epoch) and `id` is above every kept one's. Its
/// ask counted where [`FairRecord::request`] counts it, in place; `None` otherwise
/// ([`FairRecord::request`] on the whole record).
fn untracked_in_place(
    bytes: &mut [u8],
    (id, epoch): (u64, u64),
    cost: u64,
    asks: bool,
) -> Option<Result<(), u64>> {
    // The untracked figures end the header, before the tenants' count: the epoch, then its
    // figure.
    let at = HEADER_LEN - 2 - 3 * 8;
    let since = u64::from_le_bytes(*bytes.get(at..)?.first_chunk::<8>()?);
    let last = bytes.len().checked_sub(TENANT_LEN)?;
    let highest = u64::from_le_bytes(*bytes.get(last..)?.first_chunk::<8>()?);
    if since != epoch || epoch == 0 || id < highest {
        return None;
    }
    if asks {
        let figure = bytes.get_mut(at + 8..)?.first_chunk_mut::<8>()?;
        let n = u64::from_le_bytes(*figure).saturating_add(cost);
        *figure = n.to_le_bytes();
    }
    Some(Ok(()))
}

/// A tenant's entry, as the record keeps it.
fn tracked_bytes(t: &Tracked) -> [u8; TENANT_LEN] {
    let mut out = [0u8; TENANT_LEN];
    let mut at = 0;
    let mut put = |b: &[u8]| {
        if let Some(dst) = out.get_mut(at..at + b.len()) {
            dst.copy_from_slice(b);
        }
        at += b.len();
    };
    let l = &t.local;
    put(&t.id.to_le_bytes());
    put(&t.weight.to_le_bytes());
    put(&[t.band]);
    put(&l.epoch.to_le_bytes());
    for a in l.asked {
        put(&a.to_le_bytes());
    }
    put(&l.mine.to_le_bytes());
    put(&l.fleet.to_le_bytes());
    put(&l.credit.to_le_bytes());
    put(&l.credit_ms.to_le_bytes());
    out
}

/// A tenant's entry from [`tracked_bytes`]'s.
fn decode_tracked(raw: &[u8]) -> Option<Tracked> {
    let mut at = 0usize;
    let mut take = |len: usize| -> Option<&[u8]> {
        let s = raw.get(at..at + len)?;
        at += len;
        Some(s)
    };
    let u64_of = |s: &[u8]| s.try_into().ok().map(u64::from_le_bytes);
    let id = u64_of(take(8)?)?;
    let weight = u16::from_le_bytes(take(2)?.try_into().ok()?);
    let band = *take(1)?.first()?;
    let mut local = Local {
        epoch: u64_of(take(8)?)?,
        ..Local::default()
    };
    for a in local.asked.iter_mut() {
        *a = u32::from_le_bytes(take(4)?.try_into().ok()?);
    }
    local.mine = u64_of(take(8)?)?;
    local.fleet = u64_of(take(8)?)?;
    local.credit = i64::from_le_bytes(take(8)?.try_into().ok()?);
    local.credit_ms = u64_of(take(8)?)?;
    Some(Tracked {
        id,
        weight,
        band,
        local,
    })
}

/// SplitMix64's step: the next of a sequence of well-spread 64-bit draws.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The head of an encoded record of `bands` bands: its `reported`, its view, and the bytes
/// after them (`None`: not such a record).
fn decode_head(bytes: &[u8], bands: usize) -> Option<(u64, View, &[u8])> {
    let (&version, rest) = bytes.split_first()?;
    let (&stored_bands, mut rest) = rest.split_first()?;
    if version != VERSION || usize::from(stored_bands) != bands.clamp(1, MAX_BANDS) {
        return None;
    }
    let mut u64_ = || -> Option<u64> {
        let (b, r) = rest.split_first_chunk::<8>()?;
        rest = r;
        Some(u64::from_le_bytes(*b))
    };
    let reported = u64_()?;
    let epoch = u64_()?;
    let mut view = View::new(bands);
    view.epoch = (epoch != NONE).then_some(epoch);
    for i in 0..MAX_BANDS {
        let level = u64_()?;
        let budget = u64_()?;
        let reserved = u64_()?;
        if let Some(b) = view.bands.get_mut(i) {
            *b = BandView {
                level,
                budget,
                reserved,
            };
        }
    }
    Some((reported, view, rest))
}

/// `Some` when `bytes` begin as a record of this version and of `bands` bands does.
fn of_this_version(bytes: &[u8], bands: usize) -> Option<()> {
    let (&version, rest) = bytes.split_first()?;
    let &stored_bands = rest.first()?;
    (version == VERSION && usize::from(stored_bands) == bands.clamp(1, MAX_BANDS)).then_some(())
}

/// Band `band`'s level in epoch `now_epoch` as the view of the encoded record `bytes` (of
/// `bands` bands) says ([`View::level`]), read where it lies instead of decoding the view
/// whole (each request of the rule reads it); `None` when `bytes` is not such a record.
fn head_level(bytes: &[u8], bands: usize, band: u8, now_epoch: u64) -> Option<u64> {
    let (&version, rest) = bytes.split_first()?;
    let (&stored_bands, rest) = rest.split_first()?;
    let bands = bands.clamp(1, MAX_BANDS);
    if version != VERSION || usize::from(stored_bands) != bands {
        return None;
    }
    let u64_at = |at: usize| {
        let b = rest.get(at..)?.first_chunk::<8>()?;
        Some(u64::from_le_bytes(*b))
    };
    // After `reported`: the view's epoch, then each band's level, budget and reserved.
    let epoch = u64_at(8)?;
    let fresh = View::fresh_epoch((epoch != NONE).then_some(epoch), now_epoch);
    let b = usize::from(band);
    if !fresh || b >= bands {
        return Some(super::NO_LEVEL);
    }
    u64_at(16 + b * 24)
}

fn decode(bytes: &[u8], bands: usize) -> Option<FairRecord> {
    let (reported, view, mut rest) = decode_head(bytes, bands)?;
    let mut u64_ = || -> Option<u64> {
        let (b, r) = rest.split_first_chunk::<8>()?;
        rest = r;
        Some(u64::from_le_bytes(*b))
    };
    let mut r = FairRecord::new(bands);
    r.reported = reported;
    r.view = view;
    for w in r.wrote.iter_mut() {
        w.0 = u64_()?;
        for s in w.1.iter_mut() {
            *s = BandCounts {
                demand: u64_()?,
                free: u64_()?,
                held_weight: u64_()?,
                active_weight: u64_()?,
            };
        }
    }
    let part = u64_()?;
    r.part = (part != NONE).then_some(part);
    r.fleet_use = u64_()?;
    r.dither = u64_()?;
    r.untracked = (u64_()?, [u64_()?, u64_()?]);
    let (n, mut rest) = rest.split_first_chunk::<2>()?;
    let n = usize::from(u16::from_le_bytes(*n));
    if n > MAX_TENANTS || rest.len() != n * TENANT_LEN {
        return None;
    }
    for _ in 0..n {
        let (raw, more) = rest.split_at_checked(TENANT_LEN)?;
        rest = more;
        r.tenants.push(decode_tracked(raw)?);
    }
    // Written by a version that kept them in the order they came.
    if !r.tenants.is_sorted_by_key(|t| t.id) {
        r.tenants.sort_unstable_by_key(|t| t.id);
    }
    Some(r)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::share::{LEVEL_ONE, NO_LEVEL};

    fn share() -> Share {
        Share {
            active_ms: 10_000,
            saturation_pm: 800,
            target_pm: 1000,
            bands: 1,
            min_share_pm: [0; MAX_BANDS],
            ramp_ms: 0,
        }
    }

    /// The level a request reads where it lies in the encoded record is the one the decoded
    /// view says: each band, fresh and stale, a band past the rule's, no view yet; and a
    /// record of another format or number of bands is none.
    #[test]
    fn a_bands_level_read_in_place_is_the_views() {
        for bands in [1usize, 3, MAX_BANDS] {
            let mut r = FairRecord::new(bands);
            let mut bytes = Vec::new();
            r.encode_into(&mut bytes);
            assert_eq!(head_level(&bytes, bands, 0, 100), Some(NO_LEVEL), "no view");
            r.view.epoch = Some(100);
            for (i, b) in r.view.bands.iter_mut().enumerate() {
                b.level = 1_000 + i as u64;
                b.budget = 7;
                b.reserved = 9;
            }
            bytes.clear();
            r.encode_into(&mut bytes);
            let (_, view, _) = decode_head(&bytes, bands).unwrap();
            for band in 0..=MAX_BANDS as u8 {
                for now in [100, 102, 100 + fair::MAX_STALE, 101 + fair::MAX_STALE] {
                    assert_eq!(
                        head_level(&bytes, bands, band, now),
                        Some(view.level(band, now)),
                        "{bands} bands, band {band}, epoch {now}"
                    );
                }
            }
            assert_eq!(head_level(&bytes, bands, 0, 100), Some(1_000));
            if bands < MAX_BANDS {
                assert_eq!(head_level(&bytes, bands + 1, 0, 100), None);
                assert!(decode_head(&bytes, bands + 1).is_none());
            }
            bytes[0] ^= 0xff;
            assert_eq!(head_level(&bytes, bands, 0, 100), None);
        }
    }

    /// A report not counted is made again in its epoch: the same counters, and what this Envoy
    /// wrote before that epoch's window still known (a believable read checks against it).
    #[test]
    fn a_report_not_counted_is_made_again_the_same() {
        let mut r = FairRecord::new(1);
        r.request((7, 1, 0), (8_500, 1_000), 1, (true, true))
            .unwrap();
        let eight = r.report(1, 9).unwrap();
        r.request((7, 1, 0), (9_500, 1_000), 1, (true, true))
            .unwrap();
        let first = r.report(1, 10).unwrap();
        let wrote = r.wrote;
        assert_eq!((wrote[0].0, wrote[1].0), (8, 9));
        assert!(r.report(1, 10).is_none(), "made once");
        assert!(!r.unreported(9), "not the epoch made");
        assert!(r.unreported(10));
        assert_eq!(r.reported, 9);
        let again = r.report(1, 10).unwrap();
        assert_eq!(again, first);
        assert_eq!(r.wrote, wrote);
        assert_ne!(eight, first);
    }

    /// What `replicas` Envoys each add to the band's active weight for one tenant of weight 1
    /// asking 1 a window on each (its fleet demand `replicas`), in thousandths of a unit.
    fn spread_weight(replicas: u64) -> u64 {
        (0..replicas)
            .map(|i| {
                let mut r = FairRecord::new(1);
                r.dither = mix(i) | 1;
                r.request((7, 1, 0), (9_500, 1_000), 1, (true, true))
                    .unwrap();
                r.tenants[0].local.told(9, replicas);
                let report = r.report(1, 10).unwrap();
                report
                    .items
                    .iter()
                    .find(|(i, _)| {
                        matches!(
                            i,
                            Item::Band {
                                sum: 3,
                                epoch: 9,
                                ..
                            }
                        )
                    })
                    .unwrap()
                    .1
                    / WEIGHT_UNIT
            })
            .sum()
    }

    #[test]
    fn a_weight_spread_thin_over_many_envoys_adds_up_to_itself() {
        // A tenant of weight 1 seen by 5,000 Envoys (each holding 0.2 thousandths of its
        // weight) or 1,430 (0.7): rounded to the nearest thousandth, each Envoy's part was 0
        // (the tenant gone from the fleet's sums) or 1 (counted 1.43 times); rounded at random
        // by each Envoy's own draw, the parts add up to 1 within a few hundredths (the bound is over 5 standard deviations).
        for replicas in [5_000, 1_430] {
            let sum = spread_weight(replicas);
            assert!(
                (850..=1_150).contains(&sum),
                "{replicas} Envoys: {sum} thousandths"
            );
        }
    }

    #[test]
    fn what_untracked_tenants_ask_counts_in_what_the_envoy_expects_to_admit() {
        // Every place taken: a 65th tenant is shared locally, but its 30 requests a window
        // take quota too; before, the blocks followed the kept tenants alone (1,000 tenants
        // spread over 100 proxies: 28 service calls per 100 requests).
        let part = |extra: u64| {
            let mut r = FairRecord::new(1);
            for id in 1..=MAX_TENANTS as u64 {
                r.request((id, 1, 0), (9_100, 1_000), 1, (true, true))
                    .unwrap();
            }
            for _ in 0..extra {
                r.request((1_000, 1, 0), (9_200, 1_000), 1, (true, true))
                    .unwrap();
            }
            assert_eq!(r.tenants.len(), MAX_TENANTS);
            let report = r.report(1, 10).unwrap();
            r.answered(&share(), 100, &report, &vec![None; report.items.len()]);
            r.part.unwrap()
        };
        assert_eq!(part(30) - part(0), 30 * LEVEL_ONE);
        // Asks of the epoch before, after the turn, count there; older ones are left out.
        let mut r = FairRecord::new(1);
        r.untracked_ask(10, 5);
        r.untracked_ask(9, 2);
        r.untracked_ask(7, 100);
        assert_eq!((r.untracked_in(10), r.untracked_in(9)), (5, 2));
        r.untracked_ask(11, 1);
        assert_eq!(
            (r.untracked_in(11), r.untracked_in(10), r.untracked_in(9)),
            (1, 5, 0)
        );
    }

    #[test]
    fn a_record_round_trips_and_refuses_what_it_did_not_write() {
        let mut r = FairRecord::new(2);
        r.reported = 7;
        r.part = Some(12);
        r.dither = 99;
        r.untracked = (6, [5, 4]);
        r.view.epoch = Some(5);
        for i in 0..3u64 {
            r.request((i + 1, 2, 1), (7_100 + i, 1_000), 3, (true, true))
                .unwrap();
        }
        r.wrote[1] = (
            6,
            [BandCounts {
                demand: 1,
                free: 2,
                held_weight: 3,
                active_weight: 4,
            }; MAX_BANDS],
        );
        let mut bytes = Vec::new();
        r.encode_into(&mut bytes);
        assert_eq!(bytes.len(), HEADER_LEN + 3 * TENANT_LEN);
        // The sizes docs/src/explanation/shared-capacity.md states.
        assert_eq!((HEADER_LEN, TENANT_LEN), (436, 67));
        assert_eq!(FairRecord::decode_or_new(Some(&bytes), 2), r);
        // Cut short, another version, or nothing: a new record.
        let fresh = FairRecord::new(2);
        assert_eq!(FairRecord::decode_or_new(Some(&bytes[..40]), 2), fresh);
        assert_eq!(
            FairRecord::decode_or_new(Some(&bytes), 3),
            FairRecord::new(3),
            "another number of bands"
        );
        bytes[0] = 9;
        assert_eq!(FairRecord::decode_or_new(Some(&bytes), 2), fresh);
        assert_eq!(FairRecord::decode_or_new(None, 2), fresh);
    }

    #[test]
    fn a_request_in_place_is_the_whole_records_request() {
        // Three tenants in two bands under a view holding band 1 to a level: a run of
        // requests (asking, waiting turns, refused by another check) done on the whole record
        // and in place on its bytes leave the same bytes and the same verdicts.
        let mut r = FairRecord::new(2);
        r.view.epoch = Some(8);
        r.view.bands[1].level = 3 * LEVEL_ONE;
        for id in 1..=3u64 {
            r.request((id, 1, 1), (9_000, 1_000), 1, (true, true))
                .unwrap();
        }
        let mut bytes = Vec::new();
        r.encode_into(&mut bytes);
        for k in 0..400u64 {
            let who = (1 + k % 3, 1 + (k % 2) as u16, (k % 5 != 0) as u8);
            let at = (9_000 + 7 * k, 1_000);
            let how = (k % 7 != 0, k % 3 != 1);
            let whole = r.request(who, at, 1 + k % 2, how);
            let in_place = FairRecord::request_in_place(&mut bytes, 2, who, at, 1 + k % 2, how);
            assert_eq!(in_place, Some(whole), "request {k}");
            let mut again = Vec::new();
            r.encode_into(&mut again);
            assert_eq!(bytes, again, "request {k}");
        }
        // A tenant it does not keep, another band count, or bytes cut short: not in place.
        assert_eq!(
            FairRecord::request_in_place(
                &mut bytes,
                2,
                (9, 1, 0),
                (12_000, 1_000),
                1,
                (true, true)
            ),
            None
        );
        assert_eq!(
            FairRecord::request_in_place(
                &mut bytes,
                3,
                (1, 1, 0),
                (12_000, 1_000),
                1,
                (true, true)
            ),
            None
        );
        let mut short = bytes[..bytes.len() - 1].to_vec();
        assert_eq!(
            FairRecord::request_in_place(
                &mut short,
                2,
                (1, 1, 0),
                (12_000, 1_000),
                1,
                (true, true)
            ),
            None
        );
    }

    #[test]
    fn a_full_records_requests_in_place_are_the_whole_records_requests() {
        // Every place taken by tenants that came in no order of their ids, then tenants beyond
        // them, some of higher ids (not kept) and some of lower ones (each takes the place of
        // the highest kept), over three epochs: each request done on the whole record and,
        // where it can be, in place on its bytes (else on the whole record, as
        // `engine::fair_ask` does) leaves the same bytes and the same verdicts. In place: every
        // request of a kept tenant, and of one not kept and of an id above every kept one once
        // one was counted so in the epoch.
        let mut r = FairRecord::new(1);
        r.view.epoch = Some(8);
        r.view.bands[0].level = 3 * LEVEL_ONE;
        let mut rng = crate::testkit::Rng(7);
        let ids: Vec<u64> = (0..MAX_TENANTS)
            .map(|_| 1_000 + (rng.next() >> 2))
            .collect();
        for &id in &ids {
            r.request((id, 1, 0), (9_000, 1_000), 1, (true, true))
                .unwrap();
        }
        assert_eq!(r.tenants.len(), MAX_TENANTS);
        let mut bytes = Vec::new();
        r.encode_into(&mut bytes);
        let (mut kept_in_place, mut other_in_place, mut placed) = (0, 0, 0);
        let mut counted_in = 0;
        for k in 0..3_000u64 {
            let now = 9_000 + k;
            let id = match k % 8 {
                0 | 1 => u64::MAX - rng.below(50),
                2 => rng.below(40),
                _ => ids[rng.below(MAX_TENANTS as u64) as usize],
            };
            let who = (id, 1 + (k % 2) as u16, 0);
            let how = (k % 7 != 0, k % 3 != 1);
            let kept = r.tenants.iter().any(|t| t.id == id);
            let highest = r.tenants.last().map_or(0, |t| t.id);
            let whole = r.request(who, (now, 1_000), 1, how);
            match FairRecord::request_in_place(&mut bytes, 1, who, (now, 1_000), 1, how) {
                Some(v) => {
                    assert_eq!(v, whole, "request {k}");
                    if kept {
                        kept_in_place += 1;
                    } else {
                        // Not kept, and no place for it.
                        assert!(id > highest && counted_in == now / 1_000, "request {k}");
                        assert!(r.tenants.iter().all(|t| t.id != id), "request {k}");
                        other_in_place += 1;
                    }
                }
                None => {
                    assert!(!kept, "a kept tenant's request {k} not in place");
                    if r.tenants.iter().any(|t| t.id == id) {
                        placed += 1;
                    } else if how.0 {
                        counted_in = now / 1_000;
                    }
                    r.encode_into(&mut bytes);
                }
            }
            let mut again = Vec::new();
            r.encode_into(&mut again);
            assert_eq!(bytes, again, "request {k}");
        }
        // 1,941 and 1,004 of 3,000 (the rest: 40 placed, 15 each the first not kept in its
        // epoch).
        assert!(kept_in_place > 1_900, "{kept_in_place}");
        assert!(other_in_place > 900, "{other_in_place}");
        // Each of the 40 low ids took a place once, and kept it (none went idle).
        assert_eq!(placed, 40);
        assert_eq!(r.tenants.iter().filter(|t| t.id < 40).count(), 40);
        assert_eq!(r.tenants.len(), MAX_TENANTS);
    }

    #[test]
    fn a_give_back_in_place_is_the_whole_records() {
        // A full record under a level: a kept tenant's request given back in place leaves the
        // bytes the whole record's give-back leaves; one it does not keep changes nothing; in
        // a record with places free, a tenant not found may be one an earlier version kept out
        // of order: the whole record decides.
        let mut r = FairRecord::new(1);
        r.view.epoch = Some(8);
        r.view.bands[0].level = 2 * LEVEL_ONE;
        for id in 0..MAX_TENANTS as u64 {
            for k in 0..3 {
                let _ = r.request((id * 7, 1, 0), (9_000 + k, 1_000), 1, (true, true));
            }
        }
        let mut bytes = Vec::new();
        r.encode_into(&mut bytes);
        for id in [0u64, 7 * 100, 7 * (MAX_TENANTS as u64 - 1)] {
            r.give_back(id, 1, 1_000);
            let prev = bytes.clone();
            let done = FairRecord::give_back_in_place(&mut bytes, 1, id, 1, 1_000);
            assert_eq!(done, Some(true), "tenant {id}");
            assert_ne!(bytes, prev, "tenant {id}: its credit back");
            let mut again = Vec::new();
            r.encode_into(&mut again);
            assert_eq!(bytes, again, "tenant {id}");
        }
        let before = bytes.clone();
        assert_eq!(
            FairRecord::give_back_in_place(&mut bytes, 1, 5, 1, 1_000),
            Some(false)
        );
        assert_eq!(bytes, before);
        assert_eq!(
            FairRecord::give_back_in_place(&mut bytes, 2, 7, 1, 1_000),
            None,
            "bands"
        );
        let mut few = FairRecord::new(1);
        let _ = few.request((3, 1, 0), (9_000, 1_000), 1, (true, true));
        let mut bytes = Vec::new();
        few.encode_into(&mut bytes);
        assert_eq!(
            FairRecord::give_back_in_place(&mut bytes, 1, 4, 1, 1_000),
            None
        );
        assert_eq!(
            FairRecord::give_back_in_place(&mut bytes, 1, 3, 1, 1_000),
            Some(true)
        );
    }

    #[test]
    fn a_record_of_tenants_in_no_order_is_read_in_order() {
        // A record of the version before, whose tenants are in the order they came: read, it is
        // in the order of their ids, and written so, every tenant is found in place.
        let mut r = FairRecord::new(1);
        for id in [30u64, 10, 20] {
            r.request((id, 1, 0), (9_000, 1_000), 1, (true, true))
                .unwrap();
        }
        let mut bytes = Vec::new();
        r.encode_into(&mut bytes);
        // The first and the last entries swapped: 30, 20, 10.
        let mut unsorted = bytes.clone();
        let entries = &mut unsorted[HEADER_LEN..];
        entries[..TENANT_LEN].copy_from_slice(&bytes[HEADER_LEN + 2 * TENANT_LEN..]);
        entries[2 * TENANT_LEN..].copy_from_slice(&bytes[HEADER_LEN..HEADER_LEN + TENANT_LEN]);
        assert_ne!(unsorted, bytes);
        let read = FairRecord::decode_or_new(Some(&unsorted), 1);
        let ids: Vec<u64> = read.tenants.iter().map(|t| t.id).collect();
        assert_eq!(ids, [10, 20, 30]);
        let mut written = Vec::new();
        read.encode_into(&mut written);
        assert_eq!(written, bytes);
        for id in [10, 20, 30] {
            let who = (id, 1, 0);
            let got =
                FairRecord::request_in_place(&mut written, 1, who, (9_100, 1_000), 1, (true, true));
            assert_eq!(got, Some(Ok(())), "tenant {id}");
        }
    }

    #[test]
    fn a_full_record_gives_an_idle_tenants_place_and_tracks_no_more_active_ones() {
        let mut r = FairRecord::new(1);
        for id in 0..MAX_TENANTS as u64 {
            r.request((id, 1, 0), (10_000, 1_000), 1, (true, true))
                .unwrap();
        }
        // All active: a new tenant is not tracked (admitted).
        assert!(r
            .request((999, 1, 0), (11_000, 1_000), 1, (true, true))
            .is_ok());
        assert!(r.tenants.iter().all(|t| t.id != 999));
        // Tenant 0 goes on asking; the others fall idle: the new one takes an idle one's place.
        for e in 11..16 {
            r.request((0, 1, 0), (e * 1_000, 1_000), 1, (true, true))
                .unwrap();
        }
        r.request((999, 1, 0), (16_000, 1_000), 1, (true, true))
            .unwrap();
        assert!(r.tenants.iter().any(|t| t.id == 999));
        assert!(r.tenants.iter().any(|t| t.id == 0));
        assert_eq!(r.tenants.len(), MAX_TENANTS);
    }

    /// The values a service summing every report would answer for `report`.
    fn serve(
        counters: &mut std::collections::HashMap<String, u64>,
        report: &Report,
    ) -> Vec<Option<u64>> {
        report
            .items
            .iter()
            .map(|(item, hits)| {
                let c = counters.entry(format!("{item:?}")).or_insert(0);
                *c += hits;
                Some(*c)
            })
            .collect()
    }

    #[test]
    fn two_envoys_converge_on_the_fleets_weighted_shares_of_pinned_tenants() {
        // Capacity 100 a window; tenant 1 (weight 1) alone on Envoy A, tenants 2 and 3 (weight
        // 1 and 2) on Envoy B, each asking 100 a window: the fleet's shares are 25, 25 and 50,
        // however the tenants are placed.
        let share = share();
        let mut a = FairRecord::new(1);
        let mut b = FairRecord::new(1);
        let mut counters = std::collections::HashMap::new();
        let mut admitted = [0u64; 4];
        for epoch in 1..30u64 {
            for (r, _) in [(&mut a, 0), (&mut b, 1)] {
                if let Some(report) = r.report(1, epoch) {
                    let values = serve(&mut counters, &report);
                    r.answered(&share, 100, &report, &values);
                }
            }
            for ms in (0..1_000).step_by(10) {
                let now = epoch * 1_000 + ms;
                let ask = |r: &mut FairRecord, who: (u64, u16, u8)| {
                    r.request(who, (now, 1_000), 1, (true, true)).is_ok()
                };
                if epoch >= 20 {
                    admitted[1] += u64::from(ask(&mut a, (1, 1, 0)));
                    admitted[2] += u64::from(ask(&mut b, (2, 1, 0)));
                    admitted[3] += u64::from(ask(&mut b, (3, 2, 0)));
                } else {
                    ask(&mut a, (1, 1, 0));
                    ask(&mut b, (2, 1, 0));
                    ask(&mut b, (3, 2, 0));
                }
            }
        }
        // Ten windows measured.
        let per = |i: usize| admitted[i] as f64 / 10.0;
        assert!((per(1) - 25.0).abs() <= 1.5, "tenant 1: {}", per(1));
        assert!((per(2) - 25.0).abs() <= 1.5, "tenant 2: {}", per(2));
        assert!((per(3) - 50.0).abs() <= 2.5, "tenant 3: {}", per(3));
        assert_eq!(a.view, b.view, "both Envoys read the same fleet");
        let level = a.view.level(0, 29);
        assert!(level != NO_LEVEL);
        assert!(
            (level as f64 / LEVEL_ONE as f64 - 25.0).abs() < 1.0,
            "{level}"
        );
    }

    #[test]
    fn a_tenant_new_to_an_envoy_is_not_refused_there_while_its_demand_here_is_unread() {
        // Tenant 1 asks 20 a window on Envoy A, and from window 12 on Envoy B too; tenant 2
        // asks 100 on A: the fleet holds tenant 2 at the level, 60 a window.
        let share = share();
        let mut a = FairRecord::new(1);
        let mut b = FairRecord::new(1);
        let mut counters = std::collections::HashMap::new();
        let (mut on_b, mut asked_b) = (0u64, 0u64);
        for epoch in 2..16u64 {
            for r in [&mut a, &mut b] {
                if let Some(report) = r.report(1, epoch) {
                    let values = serve(&mut counters, &report);
                    r.answered(&share, 100, &report, &values);
                }
            }
            for ms in (0..1_000).step_by(10) {
                let now = epoch * 1_000 + ms;
                let _ = a.request((2, 1, 0), (now, 1_000), 1, (true, true));
                if ms % 25 == 0 {
                    let _ = a.request((1, 1, 0), (now, 1_000), 1, (true, true));
                    if epoch >= 12 {
                        let ok = b.request((1, 1, 0), (now, 1_000), 1, (true, true)).is_ok();
                        if epoch <= 13 {
                            on_b += u64::from(ok);
                            asked_b += 1;
                        }
                    }
                }
            }
        }
        // Its first two windows on B (its asks there not yet read): admitted there, not
        // refused for a part of its demand read as none.
        assert_eq!(on_b, asked_b, "{on_b} of {asked_b} on B");
    }

    #[test]
    fn a_service_that_says_nothing_leaves_the_envoy_on_its_own() {
        let share = share();
        let mut r = FairRecord::new(1);
        for epoch in 2..10u64 {
            if let Some(report) = r.report(1, epoch) {
                let nothing = vec![None; report.items.len()];
                r.answered(&share, 100, &report, &nothing);
            }
            for ms in (0..1_000).step_by(5) {
                let now = epoch * 1_000 + ms;
                assert!(r.request((1, 1, 0), (now, 1_000), 1, (true, true)).is_ok());
            }
        }
        assert_eq!(r.view.epoch, None);
        // One report an epoch.
        assert!(r.report(1, 9).is_none());
        assert!(r.report(1, 10).is_some());
    }
}
