//! The line a shared rule's refused requests may wait in, for their turn, instead of being
//! refused.
//!
//! A waiter holds no quota: it is only a place in line. When its turn comes, the caller decides
//! its request again against the shared state; admitted, it leaves the line; refused again, it
//! keeps its place.
//!
//! **Order.** Bands strictly by priority (band 0 first), except that the bands the caller marks
//! as below their reserve go before the others (in priority order among themselves). Within a
//! band, tenants take turns by deficit round robin: at its turn a tenant is credited
//! `weight × quantum` cost units and is served while its next waiter's cost fits its credit;
//! credit is spent only on admission, and a tenant whose last waiter leaves drops out of the
//! turns and loses its credit. Within a tenant, first come, first served. A tenant is a
//! (tenant hash, band) pair: a tenant whose band changed has one line per band.
//!
//! **Bounds.** At most `max_queued` waiters in all and `max_queued_per_tenant` per tenant hash
//! (all bands together); a push past either is refused. Storage grows to those bounds and is
//! then reused (tenants that come and go take freed slots), so once warm the queue allocates
//! nothing.
//!
//! The queue is one plain value: a host keeps one per shared rule per worker (wasm) or per
//! process (native); how it is shared, locked and woken by a timer is the host's concern.
//! Nothing here reads a clock: times are the caller's, in ms.

use super::MAX_BANDS;
use std::collections::VecDeque;

/// One request waiting for its turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiter<T> {
    /// The caller's handle of the request (a stream id, say); unique among the waiters.
    pub handle: T,
    /// Its tenant (the caller's hash of the tenant's key).
    pub tenant: u64,
    /// Its tenant's band (0 to 3, 0 first; higher values count as 3).
    pub band: u8,
    /// Its tenant's weight (0 counts as 1).
    pub weight: u16,
    /// What the request costs, in the queue's cost units.
    pub cost: u64,
    /// When it stops waiting (and is refused), ms.
    pub deadline_ms: u64,
    /// When it joined the line, ms.
    pub enqueued_ms: u64,
}

/// Why a waiter could not join the line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// The line holds `max_queued` waiters.
    Queue,
    /// Its tenant already has `max_queued_per_tenant` waiters.
    Tenant,
}

/// What a turn made of the waiter offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Admitted: it leaves the line, its tenant's credit charged its cost.
    Admitted,
    /// Refused for what the whole band shares (the capacity, the band's budget): it keeps its
    /// place and the band's pass ends (the next would meet the same refusal).
    Refused,
    /// Refused for its own tenant's share: it keeps its place, its tenant's turn ends and the
    /// band's pass goes on with the next tenant.
    Skipped,
}

/// The line of a shared rule: waiters in bands, tenants taking turns in each band.
#[derive(Clone, Debug)]
pub struct ShareQueue<T> {
    /// Credit a tenant of weight 1 gets at each turn, cost units (1 or more).
    quantum: u64,
    max_queued: usize,
    max_per_tenant: usize,
    /// Waiters in all.
    len: usize,
    bands: [Band; MAX_BANDS],
    /// Tenants' lines, by slot; an empty line is a free slot (listed in `free`).
    lines: Vec<Line<T>>,
    free: Vec<usize>,
}

/// One band: the slots of its tenants with waiters, the one whose turn it is first.
#[derive(Clone, Debug, Default)]
struct Band {
    ring: VecDeque<usize>,
    len: usize,
}

/// One tenant's line in one band.
#[derive(Clone, Debug)]
struct Line<T> {
    tenant: u64,
    band: usize,
    /// Credit left, cost units.
    deficit: u64,
    /// Whether it was credited for its current turn (it is first in its band's ring).
    turn: bool,
    waiters: VecDeque<Waiter<T>>,
}

impl<T: Copy + Eq> ShareQueue<T> {
    /// An empty line of at most `max_queued` waiters, `max_queued_per_tenant` per tenant; a
    /// tenant of weight `w` is credited `w × quantum` cost units at each turn (`quantum` is
    /// typically the rule's usual request cost; 0 counts as 1).
    pub fn new(max_queued: usize, max_queued_per_tenant: usize, quantum: u64) -> Self {
        Self {
            quantum: quantum.max(1),
            max_queued,
            max_per_tenant: max_queued_per_tenant,
            len: 0,
            bands: Default::default(),
            lines: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Waiters in line.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waiters in `band`.
    pub fn len_of_band(&self, band: u8) -> usize {
        self.bands.get(usize::from(band)).map_or(0, |b| b.len)
    }

    /// The earliest deadline in line (when to wake for [`ShareQueue::expire`]).
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.active()
            .flat_map(|l| l.waiters.iter())
            .map(|w| w.deadline_ms)
            .min()
    }

    /// When the longest waiting waiter of `band` joined the line (the earliest of its tenants'
    /// first waiters).
    pub fn oldest_enqueued_ms(&self, band: u8) -> Option<u64> {
        let b = self.bands.get(usize::from(band))?;
        b.ring
            .iter()
            .filter_map(|&i| self.lines.get(i)?.waiters.front())
            .map(|w| w.enqueued_ms)
            .min()
    }

    /// Puts `w` at the end of its tenant's line (its band clamped to 3, its weight to 1 or
    /// more), unless the line is full (checked first) or its tenant has all the places it may.
    pub fn push(&mut self, mut w: Waiter<T>) -> Result<(), Full> {
        if self.len >= self.max_queued {
            return Err(Full::Queue);
        }
        w.band = w.band.min((MAX_BANDS - 1) as u8);
        w.weight = w.weight.max(1);
        let band = usize::from(w.band);
        let mut mine = 0;
        let mut found = None;
        for (i, l) in self.lines.iter().enumerate() {
            if l.tenant == w.tenant && !l.waiters.is_empty() {
                mine += l.waiters.len();
                if l.band == band {
                    found = Some(i);
                }
            }
        }
        if mine >= self.max_per_tenant {
            return Err(Full::Tenant);
        }
        let Some(b) = self.bands.get_mut(band) else {
            return Err(Full::Queue);
        };
        let slot = match found {
            Some(i) => i,
            None => {
                // A freed slot if there is one (its storage reused), else a new one.
                let i = self.free.pop().unwrap_or(self.lines.len());
                match self.lines.get_mut(i) {
                    Some(l) => {
                        l.tenant = w.tenant;
                        l.band = band;
                        l.deficit = 0;
                        l.turn = false;
                    }
                    None => self.lines.push(Line {
                        tenant: w.tenant,
                        band,
                        deficit: 0,
                        turn: false,
                        waiters: VecDeque::new(),
                    }),
                }
                b.ring.push_back(i);
                i
            }
        };
        if let Some(l) = self.lines.get_mut(slot) {
            l.waiters.push_back(w);
            b.len += 1;
            self.len += 1;
        }
        Ok(())
    }

    /// Takes the waiter `handle` out of line (its client left), wherever it is; `None` if it
    /// is not in line. A tenant left with no waiter drops out of the turns.
    pub fn remove(&mut self, handle: T) -> Option<Waiter<T>> {
        let (slot, at) = self.lines.iter().enumerate().find_map(|(i, l)| {
            let at = l.waiters.iter().position(|w| w.handle == handle)?;
            Some((i, at))
        })?;
        let l = self.lines.get_mut(slot)?;
        let w = l.waiters.remove(at)?;
        let band = l.band;
        self.gone(slot, band, 1);
        Some(w)
    }

    /// Takes out of line every waiter whose deadline is `now_ms` or earlier, handing each to
    /// `out` (in no particular order); returns how many.
    pub fn expire(&mut self, now_ms: u64, mut out: impl FnMut(Waiter<T>)) -> usize {
        let mut all = 0;
        for slot in 0..self.lines.len() {
            let Some(l) = self.lines.get_mut(slot) else {
                continue;
            };
            let before = l.waiters.len();
            l.waiters.retain(|w| {
                let keep = w.deadline_ms > now_ms;
                if !keep {
                    out(*w);
                }
                keep
            });
            let n = before - l.waiters.len();
            if n > 0 {
                let band = l.band;
                self.gone(slot, band, n);
                all += n;
            }
        }
        all
    }

    /// Runs one dispatch round: offers the waiters whose turn it is to `try_admit`, band by
    /// band (the bands marked in `below_reserve` first, then the others, each in priority
    /// order), and returns how many were admitted.
    ///
    /// `try_admit` decides the request again and returns whether it was admitted: if so the
    /// waiter leaves the line and its tenant's credit is charged its cost; if not, it keeps its
    /// place (it is the band's first candidate at the next round) and the band's pass ends
    /// (the next would meet the same refusal), the round going on with the next band. A band's
    /// pass also ends when the band is empty.
    pub fn dispatch(
        &mut self,
        below_reserve: [bool; MAX_BANDS],
        mut try_admit: impl FnMut(&Waiter<T>) -> bool,
    ) -> usize {
        self.dispatch_offers(below_reserve, |w| match try_admit(w) {
            true => Offer::Admitted,
            false => Offer::Refused,
        })
    }

    /// [`ShareQueue::dispatch`], where `offer` may also skip a waiter refused for its own
    /// tenant's share ([`Offer::Skipped`]): its tenant's turn ends and the band's pass goes
    /// on (each tenant is skipped at most once a pass).
    pub fn dispatch_offers(
        &mut self,
        below_reserve: [bool; MAX_BANDS],
        mut offer: impl FnMut(&Waiter<T>) -> Offer,
    ) -> usize {
        let mut admitted = 0;
        for first in [true, false] {
            for (band, &below) in below_reserve.iter().enumerate() {
                if below == first {
                    admitted += self.pass(band, &mut offer);
                }
            }
        }
        admitted
    }

    /// One band's pass of a dispatch round.
    fn pass(&mut self, band: usize, try_admit: &mut impl FnMut(&Waiter<T>) -> Offer) -> usize {
        let mut admitted = 0;
        // Tenants whose turn ended with nothing to offer since the last offer.
        let mut passed = 0;
        // Tenants (slots) skipped for their share in this pass: met again, the pass ends.
        let mut skipped: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
        loop {
            let Some(b) = self.bands.get_mut(band) else {
                return admitted;
            };
            let Some(&slot) = b.ring.front() else {
                return admitted;
            };
            let ring_len = b.ring.len();
            let Some(l) = self.lines.get_mut(slot) else {
                b.ring.pop_front();
                continue;
            };
            let Some(&head) = l.waiters.front() else {
                // Never: an empty line is not in the ring.
                b.ring.pop_front();
                continue;
            };
            if skipped.contains(&slot) {
                return admitted;
            }
            if !l.turn {
                l.turn = true;
                l.deficit = l.deficit.saturating_add(l.credit(self.quantum));
            }
            if head.cost > l.deficit {
                // Its turn ends; its credit waits for its next turn.
                l.turn = false;
                b.ring.rotate_left(1);
                passed += 1;
                if passed >= ring_len {
                    self.skip_empty_rounds(band);
                    passed = 0;
                }
                continue;
            }
            passed = 0;
            match try_admit(&head) {
                Offer::Admitted => {}
                Offer::Refused => return admitted,
                Offer::Skipped => {
                    // Its turn ends (its credit waits for its next one); the pass ends when
                    // it meets a tenant it skipped.
                    l.turn = false;
                    b.ring.rotate_left(1);
                    skipped.push(slot);
                    continue;
                }
            }
            l.waiters.pop_front();
            l.deficit -= head.cost;
            admitted += 1;
            self.gone(slot, band, 1);
        }
    }

    /// After a whole round of a band's turns with nothing to offer (every tenant's next waiter
    /// costs more than its credit), credits every tenant the rounds that would pass the same
    /// way, so that the next round offers someone: the same order as turning round and round,
    /// in one step.
    fn skip_empty_rounds(&mut self, band: usize) {
        let Some(b) = self.bands.get(band) else {
            return;
        };
        let rounds = b
            .ring
            .iter()
            .filter_map(|&i| {
                let l = self.lines.get(i)?;
                let cost = l.waiters.front()?.cost;
                Some(
                    cost.saturating_sub(l.deficit)
                        .div_ceil(l.credit(self.quantum)),
                )
            })
            .min()
            .unwrap_or(1)
            .saturating_sub(1);
        if rounds == 0 {
            return;
        }
        for &i in &b.ring {
            if let Some(l) = self.lines.get_mut(i) {
                let more = l.credit(self.quantum).saturating_mul(rounds);
                l.deficit = l.deficit.saturating_add(more);
            }
        }
    }

    /// Counts `n` waiters out of `slot`'s line in `band`; a line left empty leaves its band's
    /// ring, loses its credit and frees its slot.
    fn gone(&mut self, slot: usize, band: usize, n: usize) {
        self.len = self.len.saturating_sub(n);
        let Some(b) = self.bands.get_mut(band) else {
            return;
        };
        b.len = b.len.saturating_sub(n);
        let Some(l) = self.lines.get_mut(slot) else {
            return;
        };
        if !l.waiters.is_empty() {
            return;
        }
        l.deficit = 0;
        l.turn = false;
        if let Some(at) = b.ring.iter().position(|&i| i == slot) {
            b.ring.remove(at);
        }
        self.free.push(slot);
    }

    /// The lines with waiters.
    fn active(&self) -> impl Iterator<Item = &Line<T>> {
        self.lines.iter().filter(|l| !l.waiters.is_empty())
    }
}

impl<T> Line<T> {
    /// What a turn credits it: its first waiter's weight × the quantum (1 or more).
    fn credit(&self, quantum: u64) -> u64 {
        let weight = self.waiters.front().map_or(1, |w| w.weight.max(1));
        quantum.max(1).saturating_mul(u64::from(weight))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;

    const ALL: [bool; MAX_BANDS] = [false; MAX_BANDS];

    #[test]
    fn a_tenant_refused_for_its_share_lets_the_next_tenant_go() {
        let mut q: ShareQueue<u32> = ShareQueue::new(16, 4, 1);
        for (h, tenant) in [(1, 7), (2, 7), (3, 8), (4, 9)] {
            let w = Waiter {
                handle: h,
                tenant,
                band: 0,
                weight: 1,
                cost: 1,
                deadline_ms: 1000,
                enqueued_ms: 0,
            };
            q.push(w).unwrap();
        }
        // Tenant 7 is over its share: skipped; 8 and 9 are admitted in the same pass.
        let mut offered = Vec::new();
        let n = q.dispatch_offers(ALL, |w| {
            offered.push(w.handle);
            if w.tenant == 7 {
                Offer::Skipped
            } else {
                Offer::Admitted
            }
        });
        assert_eq!((n, offered), (2, vec![1, 3, 4]));
        // Everyone left is skipped: the pass ends, nobody lost.
        let n = q.dispatch_offers(ALL, |_| Offer::Skipped);
        assert_eq!((n, q.len()), (0, 2));
        // Then 7's turn again, in order.
        let mut order = Vec::new();
        q.dispatch(ALL, |w| {
            order.push(w.handle);
            true
        });
        assert_eq!(order, [1, 2]);
    }

    fn waiter(handle: u32, tenant: u64, band: u8, weight: u16, cost: u64) -> Waiter<u32> {
        Waiter {
            handle,
            tenant,
            band,
            weight,
            cost,
            deadline_ms: 1_000_000,
            enqueued_ms: u64::from(handle),
        }
    }

    /// Dispatches one round admitting everyone; the admitted waiters in order.
    fn drain(q: &mut ShareQueue<u32>, below: [bool; MAX_BANDS]) -> Vec<Waiter<u32>> {
        let mut out = Vec::new();
        q.dispatch(below, |w| {
            out.push(*w);
            true
        });
        out
    }

    /// Dispatches one round admitting the first `n` candidates only.
    fn admit_first(q: &mut ShareQueue<u32>, n: usize) -> Vec<Waiter<u32>> {
        let mut out = Vec::new();
        q.dispatch(ALL, |w| {
            if out.len() < n {
                out.push(*w);
                true
            } else {
                false
            }
        });
        out
    }

    #[test]
    fn a_tenants_waiters_go_first_come_first_served() {
        let mut q = ShareQueue::new(256, 8, 1);
        for h in 0..5 {
            q.push(waiter(h, 7, 0, 1, 1 + u64::from(h % 3))).unwrap();
        }
        let order: Vec<u32> = drain(&mut q, ALL).iter().map(|w| w.handle).collect();
        assert_eq!(order, [0, 1, 2, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn equal_tenants_of_a_band_take_turns() {
        let mut q = ShareQueue::new(256, 8, 1);
        let mut h = 0;
        for tenant in [10, 20, 30] {
            for _ in 0..4 {
                q.push(waiter(h, tenant, 2, 1, 1)).unwrap();
                h += 1;
            }
        }
        let order: Vec<u64> = drain(&mut q, ALL).iter().map(|w| w.tenant).collect();
        assert_eq!(order, [10, 20, 30].repeat(4));
    }

    #[test]
    fn weights_one_two_four_are_served_one_two_four() {
        let mut q = ShareQueue::new(256, 64, 1);
        let tenants = [(1u64, 1u16), (2, 2), (3, 4)];
        let mut h = 0;
        for &(t, w) in &tenants {
            for _ in 0..8 {
                q.push(waiter(h, t, 0, w, 1)).unwrap();
                h += 1;
            }
        }
        let mut served = [0i64; 3];
        for total in 1..=7000i64 {
            let got = admit_first(&mut q, 1);
            assert_eq!(got.len(), 1);
            let i = (got[0].tenant - 1) as usize;
            served[i] += 1;
            // Kept busy: every tenant always has waiters.
            q.push(waiter(h, got[0].tenant, 0, got[0].weight, 1))
                .unwrap();
            h += 1;
            for (k, &(_, w)) in tenants.iter().enumerate() {
                let fair = total * i64::from(w) / 7;
                assert!(
                    (served[k] - fair).abs() <= i64::from(w),
                    "after {total}: {served:?}"
                );
            }
        }
        assert_eq!(served, [1000, 2000, 4000]);
    }

    #[test]
    fn costs_are_counted_in_the_turns() {
        // Equal weights: one tenant sends cost-4 requests, the other cost-1; each gets the same
        // cost served.
        let mut q = ShareQueue::new(256, 64, 2);
        let mut h = 0;
        for _ in 0..8 {
            q.push(waiter(h, 1, 1, 1, 4)).unwrap();
            q.push(waiter(h + 1, 2, 1, 1, 1)).unwrap();
            h += 2;
        }
        let mut cost = [0i64; 2];
        for _ in 0..5000 {
            let got = admit_first(&mut q, 1);
            let w = got[0];
            cost[(w.tenant - 1) as usize] += w.cost as i64;
            q.push(waiter(h, w.tenant, 1, 1, w.cost)).unwrap();
            h += 1;
            // Within one turn's credit plus one request.
            assert!((cost[0] - cost[1]).abs() <= 2 + 4, "{cost:?}");
        }
        assert_eq!(cost, [4000, 4000]);
    }

    #[test]
    fn higher_bands_go_first_unless_one_is_below_its_reserve() {
        let mut q = ShareQueue::new(256, 8, 1);
        for (h, band) in (0..).zip([3u8, 1, 0, 2, 1, 0, 3, 2]) {
            q.push(waiter(h, 100 + u64::from(band), band, 1, 1))
                .unwrap();
        }
        let bands: Vec<u8> = drain(&mut q.clone(), ALL).iter().map(|w| w.band).collect();
        assert_eq!(bands, [0, 0, 1, 1, 2, 2, 3, 3]);
        let bands: Vec<u8> = drain(&mut q, [false, false, true, false])
            .iter()
            .map(|w| w.band)
            .collect();
        assert_eq!(bands, [2, 2, 0, 0, 1, 1, 3, 3]);
    }

    #[test]
    fn a_refused_waiter_keeps_its_place_and_ends_its_bands_pass() {
        let mut q = ShareQueue::new(256, 8, 1);
        q.push(waiter(1, 10, 0, 1, 1)).unwrap();
        q.push(waiter(2, 20, 0, 1, 1)).unwrap();
        q.push(waiter(3, 10, 0, 1, 1)).unwrap();
        q.push(waiter(4, 30, 1, 1, 1)).unwrap();
        q.push(waiter(5, 30, 1, 1, 1)).unwrap();
        let mut offered = Vec::new();
        let n = q.dispatch(ALL, |w| {
            offered.push(w.handle);
            w.band == 1
        });
        // Band 0's pass ends at its first refusal; band 1 is dispatched all the same.
        assert_eq!(offered, [1, 4, 5]);
        assert_eq!(n, 2);
        assert_eq!((q.len(), q.len_of_band(0), q.len_of_band(1)), (3, 3, 0));
        // The refused one is first again, and its credit was not spent.
        let mut offered = Vec::new();
        q.dispatch(ALL, |w| {
            offered.push(w.handle);
            true
        });
        assert_eq!(offered, [1, 2, 3]);
        assert!(q.is_empty());
    }

    #[test]
    fn refusing_many_times_earns_no_credit() {
        // Tenant 10 is refused ten rounds; then it does not get ten turns' worth at once.
        let mut q = ShareQueue::new(256, 16, 1);
        for h in 0..8 {
            q.push(waiter(h, 10, 0, 1, 1)).unwrap();
            q.push(waiter(100 + h, 20, 0, 1, 1)).unwrap();
        }
        for _ in 0..10 {
            assert_eq!(q.dispatch(ALL, |_| false), 0);
        }
        let tenants: Vec<u64> = drain(&mut q, ALL).iter().map(|w| w.tenant).collect();
        assert_eq!(&tenants[..4], [10, 20, 10, 20]);
    }

    #[test]
    fn pushes_past_the_bounds_are_refused_until_there_is_room() {
        let mut q = ShareQueue::new(5, 2, 1);
        q.push(waiter(1, 1, 0, 1, 1)).unwrap();
        q.push(waiter(2, 1, 3, 1, 1)).unwrap();
        // Per tenant, over all its bands.
        assert_eq!(q.push(waiter(3, 1, 0, 1, 1)), Err(Full::Tenant));
        q.push(waiter(4, 2, 0, 1, 1)).unwrap();
        q.push(waiter(5, 3, 0, 1, 1)).unwrap();
        q.push(waiter(6, 4, 0, 1, 1)).unwrap();
        assert_eq!(q.push(waiter(7, 5, 0, 1, 1)), Err(Full::Queue));
        assert_eq!(q.push(waiter(8, 1, 0, 1, 1)), Err(Full::Queue));
        assert_eq!(q.len(), 5);
        assert_eq!(q.remove(2).map(|w| w.handle), Some(2));
        q.push(waiter(9, 1, 0, 1, 1)).unwrap();
        assert_eq!(q.push(waiter(10, 1, 0, 1, 1)), Err(Full::Queue));
        q.remove(4).unwrap();
        assert_eq!(q.push(waiter(11, 1, 0, 1, 1)), Err(Full::Tenant));
        q.push(waiter(12, 5, 0, 1, 1)).unwrap();
        assert_eq!(q.len(), 5);
    }

    #[test]
    fn remove_takes_a_waiter_out_wherever_it_is() {
        let mut q = ShareQueue::new(256, 8, 1);
        for h in 1..=3 {
            q.push(waiter(h, 10, 0, 1, 1)).unwrap();
        }
        q.push(waiter(4, 20, 0, 1, 1)).unwrap();
        q.push(waiter(5, 30, 0, 1, 1)).unwrap();
        // A middle waiter.
        assert_eq!(q.remove(2), Some(waiter(2, 10, 0, 1, 1)));
        // The last waiter of a tenant: it leaves the turns.
        assert_eq!(q.remove(4).map(|w| w.tenant), Some(20));
        assert_eq!(q.bands[0].ring.len(), 2);
        // Unknown, or already gone.
        assert_eq!(q.remove(99), None);
        assert_eq!(q.remove(4), None);
        assert_eq!((q.len(), q.len_of_band(0)), (3, 3));
        let order: Vec<u32> = drain(&mut q, ALL).iter().map(|w| w.handle).collect();
        assert_eq!(order, [1, 5, 3]);
    }

    #[test]
    fn removing_the_tenant_whose_turn_it_is_passes_the_turn_on() {
        let mut q = ShareQueue::new(256, 8, 1);
        q.push(waiter(1, 10, 0, 1, 1)).unwrap();
        q.push(waiter(2, 20, 0, 1, 1)).unwrap();
        // 10 is refused: its turn goes on.
        q.dispatch(ALL, |_| false);
        assert_eq!(q.remove(1).map(|w| w.handle), Some(1));
        assert_eq!(admit_first(&mut q, 1)[0].handle, 2);
        assert!(q.is_empty());
        // Its slot is reused, fresh.
        q.push(waiter(3, 30, 0, 1, 1)).unwrap();
        assert_eq!(q.lines.len(), 2);
        assert_eq!(q.lines.iter().map(|l| l.deficit).sum::<u64>(), 0);
    }

    #[test]
    fn expire_takes_out_exactly_the_waiters_past_their_deadline() {
        let mut q = ShareQueue::new(256, 8, 1);
        assert_eq!(q.next_deadline_ms(), None);
        let deadlines = [500, 300, 900, 300, 700, 100];
        for (h, &d) in deadlines.iter().enumerate() {
            let mut w = waiter(h as u32, h as u64 % 3, (h % 4) as u8, 1, 1);
            w.deadline_ms = d;
            q.push(w).unwrap();
        }
        assert_eq!(q.next_deadline_ms(), Some(100));
        let mut out = Vec::new();
        assert_eq!(q.expire(99, |w| out.push(w.handle)), 0);
        assert_eq!(q.expire(300, |w| out.push(w.handle)), 3);
        out.sort_unstable();
        assert_eq!(out, [1, 3, 5]);
        assert_eq!(q.len(), 3);
        assert_eq!(q.next_deadline_ms(), Some(500));
        let left: Vec<u32> = drain(&mut q, ALL).iter().map(|w| w.handle).collect();
        assert_eq!(left, [0, 4, 2]);
        assert_eq!(q.next_deadline_ms(), None);
    }

    #[test]
    fn the_oldest_waiter_of_a_band_is_known() {
        let mut q = ShareQueue::new(256, 8, 1);
        assert_eq!(q.oldest_enqueued_ms(1), None);
        q.push(waiter(30, 1, 1, 1, 1)).unwrap();
        q.push(waiter(20, 2, 1, 1, 1)).unwrap();
        q.push(waiter(40, 2, 1, 1, 1)).unwrap();
        q.push(waiter(10, 3, 0, 1, 1)).unwrap();
        assert_eq!(q.oldest_enqueued_ms(1), Some(20));
        assert_eq!(q.oldest_enqueued_ms(0), Some(10));
        q.remove(20).unwrap();
        assert_eq!(q.oldest_enqueued_ms(1), Some(30));
        assert_eq!(q.oldest_enqueued_ms(9), None);
    }

    #[test]
    fn a_costly_waiter_is_reached_in_one_round() {
        // Quantum 1, a cost of a billion: the turns are skipped ahead, not run one by one.
        let mut q = ShareQueue::new(256, 8, 1);
        q.push(waiter(1, 1, 0, 1, 1_000_000_000)).unwrap();
        q.push(waiter(2, 2, 0, 3, 2_000_000_000)).unwrap();
        let order: Vec<u32> = drain(&mut q, ALL).iter().map(|w| w.handle).collect();
        assert_eq!(order, [2, 1]);
        q.push(waiter(3, 1, 0, 1, u64::MAX)).unwrap();
        assert_eq!(drain(&mut q, ALL).len(), 1);
    }

    /// A tiny deterministic PRNG (xorshift64).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn random_operations_agree_with_a_plain_list() {
        const MAX: usize = 40;
        const PER: usize = 5;
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut q: ShareQueue<u32> = ShareQueue::new(MAX, PER, 2);
        // The reference: the waiters in line, in push order.
        let mut model: Vec<Waiter<u32>> = Vec::new();
        let mut next_handle = 0u32;
        let mut now = 1_000u64;
        // Per band, the waiter refused at the last round (it must be offered first next).
        let mut refused: [Option<u32>; MAX_BANDS] = [None; MAX_BANDS];
        let mut dispatched = 0usize;
        // How often each case came up: queue full, tenant full, a refused waiter offered again.
        let mut seen = [0usize; 3];
        for step in 0..60_000 {
            now += rng.below(4);
            // Busy phases, pushed more than dispatched, fill the line up.
            let busy = (step / 2000) % 2 == 1;
            let op = match rng.below(10) {
                op if busy && op >= 5 && rng.below(2) == 0 => 0,
                op => op,
            };
            match op {
                0..=4 => {
                    let tenant = rng.below(12);
                    let w = Waiter {
                        handle: next_handle,
                        tenant,
                        band: (tenant % 4) as u8,
                        weight: 1 + rng.below(4) as u16,
                        cost: 1 + rng.below(6),
                        deadline_ms: now + rng.below(400),
                        enqueued_ms: now,
                    };
                    next_handle += 1;
                    let mine = model.iter().filter(|m| m.tenant == tenant).count();
                    let want = if model.len() >= MAX {
                        Err(Full::Queue)
                    } else if mine >= PER {
                        Err(Full::Tenant)
                    } else {
                        Ok(())
                    };
                    assert_eq!(q.push(w), want, "step {step}");
                    match want {
                        Err(Full::Queue) => seen[0] += 1,
                        Err(Full::Tenant) => seen[1] += 1,
                        Ok(()) => {}
                    }
                    if want.is_ok() {
                        model.push(w);
                    }
                }
                5 => {
                    // Mostly a waiter in line, sometimes one gone or never seen.
                    let handle = if !model.is_empty() && rng.below(4) != 0 {
                        model[rng.below(model.len() as u64) as usize].handle
                    } else {
                        rng.below(u64::from(next_handle) + 5) as u32
                    };
                    let want = model.iter().position(|m| m.handle == handle);
                    let got = q.remove(handle);
                    assert_eq!(got, want.map(|i| model.remove(i)), "step {step}");
                    for r in &mut refused {
                        if *r == Some(handle) {
                            *r = None;
                        }
                    }
                }
                6 => {
                    let mut out = Vec::new();
                    let n = q.expire(now, |w| out.push(w));
                    assert_eq!(n, out.len());
                    let mut want: Vec<Waiter<u32>> = model
                        .iter()
                        .filter(|m| m.deadline_ms <= now)
                        .copied()
                        .collect();
                    model.retain(|m| m.deadline_ms > now);
                    out.sort_unstable_by_key(|w| w.handle);
                    want.sort_unstable_by_key(|w| w.handle);
                    assert_eq!(out, want, "step {step}");
                    for r in &mut refused {
                        if r.is_some_and(|h| want.iter().any(|w| w.handle == h)) {
                            *r = None;
                        }
                    }
                }
                _ => {
                    let below: [bool; MAX_BANDS] = std::array::from_fn(|_| rng.below(4) == 0);
                    let order: Vec<usize> = (0..MAX_BANDS)
                        .filter(|&b| below[b])
                        .chain((0..MAX_BANDS).filter(|&b| !below[b]))
                        .collect();
                    let mut offered: Vec<(Waiter<u32>, bool)> = Vec::new();
                    let admit_pm = rng.below(1000);
                    let mut seed = Rng(rng.below(u64::MAX) | 1);
                    let model_before = model.clone();
                    let n = q.dispatch(below, |w| {
                        let yes = seed.below(1000) < admit_pm;
                        offered.push((*w, yes));
                        // Every candidate is the first of its tenant still in line.
                        let first = model.iter().find(|m| m.tenant == w.tenant).copied();
                        assert_eq!(first, Some(*w), "step {step}");
                        if yes {
                            let i = model.iter().position(|m| m.handle == w.handle).unwrap();
                            model.remove(i);
                        }
                        yes
                    });
                    assert_eq!(n, offered.iter().filter(|(_, y)| *y).count());
                    dispatched += n;
                    // The bands in order; a refusal ends its band's pass; a refused waiter is
                    // its band's first candidate at the next round.
                    let mut pos = 0;
                    for &b in &order {
                        let these: Vec<_> = offered
                            .iter()
                            .skip(pos)
                            .take_while(|(w, _)| usize::from(w.band) == b)
                            .copied()
                            .collect();
                        pos += these.len();
                        if let Some(h) = refused[b] {
                            assert_eq!(these.first().map(|(w, _)| w.handle), Some(h));
                            seen[2] += 1;
                        }
                        refused[b] = None;
                        match these.last() {
                            Some(&(w, false)) => refused[b] = Some(w.handle),
                            // A pass that admitted all it was offered emptied its band.
                            _ => assert!(
                                model.iter().all(|m| usize::from(m.band) != b),
                                "step {step} band {b}"
                            ),
                        }
                        assert!(these[..these.len().saturating_sub(1)]
                            .iter()
                            .all(|&(_, y)| y));
                        // Nobody admitted that was not in line.
                        for (w, _) in &these {
                            assert!(model_before.contains(w));
                        }
                    }
                    assert_eq!(pos, offered.len(), "step {step}: {offered:?}");
                }
            }
            assert_eq!(q.len(), model.len(), "step {step}");
            for b in 0..MAX_BANDS as u8 {
                let here: Vec<_> = model.iter().filter(|m| m.band == b).collect();
                assert_eq!(q.len_of_band(b), here.len());
                assert_eq!(
                    q.oldest_enqueued_ms(b),
                    here.iter().map(|m| m.enqueued_ms).min()
                );
            }
            assert_eq!(
                q.next_deadline_ms(),
                model.iter().map(|m| m.deadline_ms).min()
            );
            assert!(q.lines.len() <= MAX, "bounded storage");
        }
        assert!(dispatched > 5_000, "{dispatched}");
        assert!(seen.iter().all(|&n| n > 100), "{seen:?}");
        // Nothing lost, nothing twice: the rest comes out, each once.
        let mut rest = drain(&mut q, ALL);
        rest.sort_unstable_by_key(|w| w.handle);
        model.sort_unstable_by_key(|w| w.handle);
        assert_eq!(rest, model);
        assert!(q.is_empty());
    }
}
