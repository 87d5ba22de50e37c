//! One shared capacity fair across a fleet of replicas, learned through the rate limit service the
//! fleet already leases its quota from: no server of our own.
//!
//! **What stays as it is.** Every admission is still covered by quota leased from the service
//! ([`crate::limiter::lease`]): what the fleet admits in one of the service's windows never exceeds
//! the capacity `C` (plus, over an engine that checks a counter and counts it in two steps, the
//! blocks of the claims in flight together, as the lease says). The shares below only decide
//! *which* tenants the leased quota goes to; they never add quota. A replica whose fleet figures
//! are missing or stale admits as a lone replica does, under the lease.
//!
//! **Epochs.** Time is cut in epochs of the capacity's window `W` (the service's window: one second
//! in the simulation, a minute for a provider's per-minute account), numbered `k = now / W`. The
//! service keeps counters keyed by epoch (the epoch's number is a descriptor entry, so each epoch
//! has its own counter; the service's own unit for them must outlast two epochs: an hour, counters
//! far above what is ever added).
//!
//! **What a replica writes and reads: one call an epoch at most.** Once in epoch `k` (riding on the
//! first claim ahead of need of the lease that goes in the epoch's first half, its first
//! second at most, the claim's descriptor first, or alone after it), a replica sends, per descriptor (`hits_addend`
//! set per descriptor):
//!
//! - for each tenant it saw in epoch `k − 1`: `(rule, "asked", tenant, k − 1)` adding what the
//!   tenant asked here in `k − 1` (requests or cost units, admitted or not);
//! - for each band: `(rule, "band", b, sum, k − 1)` for the four sums of [`BandCounts`], adding
//!   this replica's part of them ([`contribution`]);
//! - the same descriptors for epoch `k − 2` with `hits_addend` 0, to read them. Every replica
//!   that served a request in `k − 1` wrote `k − 2` then, so these are whole: the fleet's
//!   demand of each tenant this replica serves, and each band's sums. A counter's value is
//!   read as the configured limit less `limit_remaining`.
//!
//! That is one call per replica and epoch at most, whatever the number of tenants (its
//! descriptors grow with the tenants it serves, each a counter the service updates), none when it
//! rides on a claim; the lease's claims come on top. The calls per request therefore fall as each
//! replica serves more requests a window: `fleet-sim --share --fair` measures them. A report that
//! rode on a claim the service refused whole (a service that counts a call's descriptors all or
//! none: every status then carries the refusal) was not counted, and goes again at the next
//! tick; one whose counters each answer `OK` was counted (a service that counts each descriptor
//! by itself).
//!
//! **The engines.** This needs a `hits_addend` per descriptor (the descriptor's own `hits_addend`,
//! which overrides the request's) and a `limit_remaining` per descriptor in the answer.
//! envoyproxy/ratelimit has both: a descriptor's `hits_addend` set to 0 checks without counting
//! (the request's, when 0 or absent, counts 1), and each status carries `current_limit` and
//! `limit_remaining` (0 once a counter is over its limit, hence the counters' limits far above any
//! sum). Limitador's Envoy server reads only the request's `hits_addend` (0 counts 1), counts all
//! of a request's descriptors or none of them, and answers without statuses (what remains only in
//! its `X-RateLimit-Remaining` header, for the most restrictive counter, when started with
//! rate-limit headers): over it a counter is read by a call of its own that adds 1, and the one
//! call an epoch does not hold.
//!
//! **The fleet's share and a replica's allowance.** From epoch `k − 2`'s band sums every replica
//! computes the same level per band ([`view`]): one step of water-filling (Newton's on `Σ min(D_i,
//! λ·w_i) = B`), `λ = (B − D_free) / W_held`, never below the plain share `B / W_active`, where `B`
//! is the band's budget (`target_pm` of `C`, the rest headroom for the tenants under their shares;
//! bands served in priority order, each lower band keeping what it uses of its reserved minimum),
//! `D_free` the demand of the tenants whose fleet demand was under the level, `W_held` the weight
//! of those at or above it. The sum being concave in the level, each step lands at or under the
//! fixed point, and from there climbs to it in as many steps as tenants cross the level (a step an
//! epoch). Tenant `i`'s fleet share is `λ·w_i` a window; this replica's allowance for it is that
//! times this replica's fraction of the tenant's fleet demand (smoothed over epochs, [`Local`]), so
//! the allowances of one tenant over the replicas add up to its fleet share however its requests
//! are spread: all on one replica, evenly, or skewed. The allowance accrues here as a credit
//! ([`Local::take`]); a request is admitted while the credit covers at least half of it, and only
//! then asks the lease for quota.
//!
//! **Freshness.** The level and the fractions used in epoch `k` describe epoch `k − 2`: one to two
//! windows old. Between answers a replica decides locally from its last view; a view more than
//! [`MAX_STALE`] epochs old (the service slow or down) is dropped and the replica admits as a lone
//! one does, under its lease. A counter read as less than this replica itself added to it (the
//! service's counter expired, or the read went elsewhere) is not believed ([`believable`],
//! [`Local::told`]).
//!
//! **Bounds.** The fleet: at most `C` a window, by the lease, whatever the shares say (a replica's
//! blocks follow what it expects to admit, [`block_cap`], so that little of what is granted
//! lapses). A tenant: with demand steady over three epochs, its allowances add up to `λ·w_i` within
//! the smoothing's error, and over any stretch of time `L` a replica admits of it at most its
//! allowance for `L`, plus the credit it may keep ([`CREDIT_PARTS`]: a quarter of a window's
//! allowance, or one request) and half a request. A replica's asks are counted whether admitted or
//! not: a client that retries a refusal at once inflates its demand, not its share (its share is
//! capped by its weight).

use super::{band_budget, permille, Share, LEVEL_ONE, MAX_BANDS, NO_LEVEL};
use smallvec::SmallVec;

/// How many epochs back a replica reads the fleet's counters: those of `k − 2`, whole.
pub const READ_LAG: u64 = 2;
/// A view describing an epoch more than this many epochs before now is not used.
pub const MAX_STALE: u64 = 4;
/// The smoothing of a tenant's demand over epochs: each new epoch counts for 1 / this.
pub const SMOOTH: u64 = 4;
/// The fixed point of the smoothed demands.
const SCALE: u64 = 16;
/// A replica's part of a tenant's demand that moves by more than 1 / this in one epoch is
/// taken as it is, not smoothed ([`Local::told`]): a tenant whose requests moved to a new
/// replica got its share there over about nine windows smoothed (`share_fair_faults.rs`, the
/// others above theirs meanwhile), two unsmoothed. A balancer's noise moves a part by less.
pub const JUMP_PARTS: u64 = 4;
/// A replica claims its leased quota in blocks of at most 1 / this of its part, and of what it
/// expects to admit until the service's window ends: it then holds less than that (it claims
/// again once under half a block), and little is left unused when the window turns. Measured
/// on six Envoys (`share_fair_six.rs`, native, three runs each): 4 and the whole of what it
/// expects until the window ends let the Envoys hold about 2.5 % of the capacity at the
/// turn, the fleet's quota ran out in some windows and a light tenant got 95-98 % of its
/// requests; 2 and half, 99.7-100 %, for about 15 % more claims. The halving stops at
/// [`FLOOR_PARTS`].
pub const BLOCKS_PER_PART: u64 = 2;
/// A replica's blocks are at least 1 / this of its part (and one unit): near the window's end
/// the halving would otherwise claim for one request at a time, a call per request. At most
/// this much more of the part lapses a window. On the fleet model's three proxies (C 1,200 a
/// second, blocks at most `C/10`): 10 % fewer calls (2.00 → 1.80 per 100 requests beside a
/// heavy tenant), the lapsed quota 0.4-0.7 % → 0.7-1.05 % of what was granted, use and shares
/// unchanged. At 1/32 the model saved 16 % of the calls, but in `share_fair.rs` (each Envoy's
/// part about 67 a second, so a floor of 2) none measurable, while its lapsed quota rose about
/// 30 %: at 1/64 a part under 128 a window keeps blocks of one.
pub const FLOOR_PARTS: u64 = 64;
/// A replica's blocks may be larger than the halving toward the window's end allows while the
/// fleet's window is expected to end with quota unused ([`spare`]): what the service says is
/// left, less this many times what the fleet is expected to admit in the rest of the window.
pub const SPARE_MARGIN: u64 = 2;
/// The fixed point of a replica's fraction of a tenant's demand and of the weights in the band
/// sums: millionths (a tenant spread over a thousand replicas has a thousandth on each).
pub const ONE: u64 = 1_000_000;
/// The credit of a tenant's allowance on a replica keeps at most 1 / this of a window's
/// allowance (or one request's, if more): a window then admits at most its allowance and this
/// part again, so the fleet's allowances do not spend the lease's quota early in a window.
pub const CREDIT_PARTS: u64 = 4;
/// How many epochs of a tenant's asks a replica keeps.
const KEPT: usize = 4;

/// One band's sums over the fleet for one epoch, in cost units a window and weights × [`ONE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BandCounts {
    /// What the band's tenants asked.
    pub demand: u64,
    /// What the tenants whose fleet demand was under the level asked.
    pub free: u64,
    /// The weight (× [`ONE`]) of the tenants at or above the level.
    pub held_weight: u64,
    /// The weight (× [`ONE`]) of the tenants that asked.
    pub active_weight: u64,
}

impl BandCounts {
    /// These sums and `other`'s (what the service's counters do with two replicas' adds).
    pub fn plus(self, other: BandCounts) -> BandCounts {
        BandCounts {
            demand: self.demand.saturating_add(other.demand),
            free: self.free.saturating_add(other.free),
            held_weight: self.held_weight.saturating_add(other.held_weight),
            active_weight: self.active_weight.saturating_add(other.active_weight),
        }
    }
}

/// Whether band sums read for an epoch (`read`) can be the fleet's: none below what this
/// replica itself added to them (`own`). A counter that expired (the service's unit turned
/// between the write and the read) or was never written reads as less, and is not used: the
/// replica keeps its view.
pub fn believable(read: &BandCounts, own: &BandCounts) -> bool {
    read.demand >= own.demand
        && read.free >= own.free
        && read.held_weight >= own.held_weight
        && read.active_weight >= own.active_weight
}

/// One band's level and budget in a [`View`], × [`LEVEL_ONE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BandView {
    /// Cost units per unit of weight a window; [`NO_LEVEL`]: nobody is held.
    pub level: u64,
    /// The band's budget a window.
    pub budget: u64,
    /// What the fleet's last grants of a window are kept for, a window: what the bands above
    /// use and what this band's tenants under the level ask ([`keeping`]).
    pub reserved: u64,
}

/// What a replica knows of the fleet: each band's level, computed from the fleet's counters of
/// one epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// The epoch the counters describe (`None`: never read).
    pub epoch: Option<u64>,
    /// One per band, highest priority first.
    pub bands: SmallVec<[BandView; MAX_BANDS]>,
}

impl View {
    /// A view of nothing: no level in any band.
    pub fn new(bands: usize) -> View {
        View {
            epoch: None,
            bands: smallvec::smallvec![
                BandView {
                    level: NO_LEVEL,
                    budget: 0,
                    reserved: 0,
                };
                bands.clamp(1, MAX_BANDS)
            ],
        }
    }

    /// Whether the view is recent enough to use in epoch `now_epoch`.
    pub fn fresh(&self, now_epoch: u64) -> bool {
        View::fresh_epoch(self.epoch, now_epoch)
    }

    /// Whether a view of epoch `epoch` (`None`: never read) is recent enough to use in epoch
    /// `now_epoch`.
    pub fn fresh_epoch(epoch: Option<u64>, now_epoch: u64) -> bool {
        epoch.is_some_and(|e| now_epoch.saturating_sub(e) <= MAX_STALE)
    }

    /// Band `band`'s level in epoch `now_epoch`: [`NO_LEVEL`] when the view is stale.
    pub fn level(&self, band: u8, now_epoch: u64) -> u64 {
        self.band(band, now_epoch).level
    }

    /// The most any band keeps for others a window ([`BandView::reserved`]).
    pub fn most_reserved(&self) -> u64 {
        self.bands.iter().map(|b| b.reserved).max().unwrap_or(0)
    }

    /// Band `band` in epoch `now_epoch`: no level and nothing reserved when the view is stale.
    pub fn band(&self, band: u8, now_epoch: u64) -> BandView {
        let none = BandView {
            level: NO_LEVEL,
            budget: 0,
            reserved: 0,
        };
        if !self.fresh(now_epoch) {
            return none;
        }
        self.bands.get(usize::from(band)).copied().unwrap_or(none)
    }
}

/// `a` × `b` / `c` (0 when `c` is 0), saturating.
fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    if c == 0 {
        return 0;
    }
    // A product that fits divides in one instruction; the 128-bit division is a call.
    match a.checked_mul(b) {
        Some(p) => p / c,
        None => u64::try_from(u128::from(a) * u128::from(b) / u128::from(c)).unwrap_or(u64::MAX),
    }
}

/// The fleet's view from its band sums of epoch `epoch` (`counts`, one per band, highest
/// priority first) for a capacity of `limit` a window of which `target_pm` permille is handed
/// out: each band's budget (served in priority order; each band keeps against higher ones
/// what it asks of its reserved minimum, `share.min_share_pm`) and one water-filling step of
/// its level. Every replica reading the same counters computes the same view.
pub fn view(share: &Share, limit: u64, target_pm: u64, epoch: u64, counts: &[BandCounts]) -> View {
    let n = share.bands.clamp(1, MAX_BANDS);
    let mut out = View::new(n);
    out.epoch = Some(epoch);
    let target = permille(limit.saturating_mul(LEVEL_ONE), target_pm);
    let reserve = |i: usize| {
        share
            .min_share_pm
            .get(i)
            .map_or(0, |&pm| permille(target, pm))
    };
    let asked = |i: usize| {
        counts
            .get(i)
            .map_or(0, |c| c.demand.saturating_mul(LEVEL_ONE))
    };
    let mut used_above = 0u64;
    for i in 0..n {
        let kept_below: u64 = (i + 1..n).map(|c| asked(c).min(reserve(c))).sum();
        let budget = band_budget(n, target, used_above, kept_below, reserve(i));
        let c = counts.get(i).copied().unwrap_or_default();
        // Kept for others: what the bands above use, and what this band's tenants under the
        // level asked, if the epoch held some at it (else nobody was under a level: its free
        // demand is all its demand, which says nothing of who will be held).
        let free = match c.held_weight {
            0 => 0,
            _ => c.free.saturating_mul(LEVEL_ONE).min(budget),
        };
        let reserved = used_above.saturating_add(free);
        used_above = used_above.saturating_add(asked(i).min(budget));
        let plain = mul_div(budget, ONE, c.active_weight);
        let level = if c.held_weight > 0 {
            let free = c.free.saturating_mul(LEVEL_ONE);
            mul_div(budget.saturating_sub(free), ONE, c.held_weight).max(plain)
        } else if asked(i) > budget && c.active_weight > 0 {
            plain
        } else {
            NO_LEVEL
        };
        if let Some(b) = out.bands.get_mut(i) {
            *b = BandView {
                level,
                budget,
                reserved,
            };
        }
    }
    out
}

/// What the fleet is expected to admit a window under `view`, computed from the band sums
/// `counts` of its epoch: what each band asked, up to its budget, cost units × [`LEVEL_ONE`].
pub fn fleet_use(view: &View, counts: &[BandCounts]) -> u64 {
    view.bands
        .iter()
        .zip(counts)
        .map(|(b, c)| c.demand.saturating_mul(LEVEL_ONE).min(b.budget))
        .fold(0, u64::saturating_add)
}

/// This replica's part of the quota the fleet's window is expected to leave unused at its end
/// (none lapses at anyone's cost there), cost units × [`LEVEL_ONE`]. The service said at
/// `said_ms` that `left` of the window's `capacity` (cost units) was left; from then until
/// the window ends the fleet is expected to admit, [`SPARE_MARGIN`] times over, what it admits
/// a window: the more of `fleet_use` (the view's) and of what it took of the window until
/// then, at that pace (which counts the tenants no replica reports too). The rest goes unused,
/// and this replica's part of it is its `part`'s share of the fleet's use. 0 when the window
/// ended at `now_ms`.
pub fn spare(
    (left, said_ms): (Left, u64),
    (capacity, fleet_use, part): (u64, u64, u64),
    (now_ms, window_ms): (u64, u64),
) -> u64 {
    if now_ms >= left.end_ms {
        return 0;
    }
    let window_ms = window_ms.max(1);
    let rest = left.end_ms.saturating_sub(said_ms).min(window_ms);
    let taken = capacity
        .saturating_sub(left.units)
        .saturating_mul(LEVEL_ONE);
    let pace = mul_div(taken, window_ms, (window_ms - rest).max(1));
    let expected = fleet_use.max(pace).max(1);
    let needed = mul_div(expected.saturating_mul(SPARE_MARGIN), rest, window_ms);
    let unused = left.units.saturating_mul(LEVEL_ONE).saturating_sub(needed);
    mul_div(unused, part, expected)
}

/// What one replica keeps of one tenant for the fleet's shares: what it asked here in the last
/// epochs, and its demand here and in the whole fleet, smoothed over the epochs read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Local {
    /// The epoch of `asked[0]`.
    pub epoch: u64,
    /// What the tenant asked here in epoch `epoch − j`, for `j` in 0..4.
    pub asked: [u32; KEPT],
    /// Its demand here a window, smoothed, × 16 (0: never read).
    pub mine: u64,
    /// Its demand in the fleet a window, smoothed, × 16 (0: never read).
    pub fleet: u64,
    /// What this replica may still admit of it under its allowance, cost units ×
    /// [`LEVEL_ONE`] × the window's ms (so that the allowance accrues exactly, ms by ms; below
    /// 0: up to half a request overdrawn), as of `credit_ms`.
    pub credit: i64,
    /// When `credit` was last brought up to date, ms.
    pub credit_ms: u64,
}

impl Local {
    /// Moves the kept epochs to `epoch` (never back).
    fn roll(&mut self, epoch: u64) {
        if epoch <= self.epoch {
            return;
        }
        let by = usize::try_from(epoch - self.epoch)
            .unwrap_or(KEPT)
            .min(KEPT);
        self.asked.rotate_right(by);
        for a in self.asked.iter_mut().take(by) {
            *a = 0;
        }
        self.epoch = epoch;
    }

    /// The tenant asks `cost` here in epoch `epoch` (counted whether admitted or not).
    pub fn ask(&mut self, epoch: u64, cost: u64) {
        self.roll(epoch);
        if let Some(a) = self.asked.first_mut() {
            *a = a.saturating_add(u32::try_from(cost).unwrap_or(u32::MAX));
        }
    }

    /// What it asked here in epoch `epoch` (0 when not kept).
    pub fn asked_in(&self, epoch: u64) -> u64 {
        self.epoch
            .checked_sub(epoch)
            .and_then(|j| usize::try_from(j).ok())
            .and_then(|j| self.asked.get(j))
            .map_or(0, |&a| u64::from(a))
    }

    /// Whether it asked here in any kept epoch as of `epoch`.
    pub fn active(&self, epoch: u64) -> bool {
        (epoch.saturating_sub(KEPT as u64 - 1)..=epoch).any(|e| self.asked_in(e) > 0)
    }

    /// This replica's fraction of the tenant's fleet demand, × [`ONE`] (all of it until the
    /// fleet's demand is read).
    pub fn fraction(&self) -> u64 {
        if self.fleet == 0 {
            return ONE;
        }
        mul_div(self.mine, ONE, self.fleet).min(ONE)
    }

    /// Its fleet demand a window as last read (smoothed), or what it asked here lately when
    /// never read.
    pub fn fleet_demand(&self) -> u64 {
        if self.fleet == 0 {
            return self.asked_in(self.epoch.saturating_sub(1));
        }
        self.fleet / SCALE
    }

    /// The service said the tenant's fleet counter of epoch `epoch` holds `fleet`: folds it and
    /// what this replica added to it into the smoothed demands. A count below what this
    /// replica added itself (an expired or missing counter) is not believed; nothing is
    /// folded for an epoch in which it asked nothing here and the fleet nothing, nor before
    /// its first ask here (a tenant new to this replica, asking elsewhere: its part here
    /// would read as none, and its allowance here as nothing for a window). A part that moved
    /// by more than a [`JUMP_PARTS`]th of the tenant's demand since the last epoch read (its
    /// requests sent to another replica: one added, one killed, a client reconnected) restarts
    /// both averages at this epoch, so the shares follow the move two epochs late, not over the
    /// smoothing's many.
    pub fn told(&mut self, epoch: u64, fleet: u64) {
        let mine = self.asked_in(epoch);
        if fleet < mine || fleet == 0 || (mine == 0 && self.mine == 0) {
            return;
        }
        if self.fleet != 0 {
            let now = mul_div(mine, ONE, fleet).min(ONE);
            if now.abs_diff(self.fraction()) > ONE / JUMP_PARTS {
                self.mine = mine.saturating_mul(SCALE);
                self.fleet = fleet.saturating_mul(SCALE).max(1);
                return;
            }
        }
        let fold = |avg: u64, x: u64| {
            let x = x.saturating_mul(SCALE);
            if avg == 0 {
                x
            } else {
                avg - avg / SMOOTH + x / SMOOTH
            }
        };
        self.mine = fold(self.mine, mine);
        self.fleet = fold(self.fleet, fleet).max(1);
    }
}

/// This replica's part of band `band`'s sums for epoch `epoch` (the one before now), for a
/// tenant of weight `weight` kept as `local`, under the level `level` of this replica's view:
/// its asks there; its weight × this replica's fraction of its demand, held or free as its
/// fleet demand is at the level or under it. `None` when it asked nothing here in `epoch`.
pub fn contribution(level: u64, weight: u16, local: &Local, epoch: u64) -> Option<BandCounts> {
    let asked = local.asked_in(epoch);
    if asked == 0 {
        return None;
    }
    let w = u64::from(weight.max(1)).saturating_mul(local.fraction());
    let held = held(level, weight, local, asked);
    Some(BandCounts {
        demand: asked,
        free: if held { 0 } else { asked },
        held_weight: if held { w } else { 0 },
        active_weight: w,
    })
}

/// Whether a tenant of weight `weight` kept as `local`, which asked `asked` here in the last
/// epoch, is held to its share under the level `level`: its fleet demand a window at the level
/// or above.
pub fn held(level: u64, weight: u16, local: &Local, asked: u64) -> bool {
    let demand = local.fleet_demand().max(asked).saturating_mul(LEVEL_ONE);
    level != NO_LEVEL && demand >= level.saturating_mul(u64::from(weight.max(1)))
}

/// What the service's latest answer here said the fleet has left of the capacity's window
/// (less what a learned capacity leaves out), and when that window ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Left {
    /// Cost units.
    pub units: u64,
    /// When the window ends, ms.
    pub end_ms: u64,
}

/// What a request may take of the fleet's quota near the end of the service's window, while
/// what is left there no longer covers what is kept for others ([`keeping`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keeping {
    /// What the request may not take of what this replica holds, cost units: kept for the
    /// tenants under their shares here (0 for a request of one of them).
    pub kept: u64,
    /// The most this replica may claim of the service's rest for it, cost units: what is left
    /// past what the other replicas' tenants under their shares need.
    pub most: u64,
}

/// What a request of `cost` at `now_ms` (windows of `window_ms`) may take of the fleet's quota,
/// claiming blocks of at most `block`, from a tenant held to its share or not (`held`), in a
/// band whose view is `band`, on a replica whose own tenants under their shares (and those of
/// the bands above) ask `here` a window (× [`LEVEL_ONE`]), when the service's latest answer
/// here said the fleet has `left`: `None` while `left` covers what the band keeps for others
/// until the window ends ([`BandView::reserved`], at an even pace), the request and a block.
///
/// Past that, the fleet's last grants of a window go to the tenants under their shares, not to
/// whoever asks first: this replica claims no more than what is left past what the other
/// replicas' need ([`Keeping::most`]; a block, not only a request, would take it), and once
/// what is left no longer covers the request past what the band keeps, a held tenant takes
/// nothing of what its own need ([`Keeping::kept`]). A held tenant still spends the rest of
/// what this replica holds, so that what was granted does not lapse.
pub fn keeping(
    (band, here, held): (&BandView, u64, bool),
    left: Left,
    (now_ms, window_ms): (u64, u64),
    (cost, block): (u64, u64),
) -> Option<Keeping> {
    if now_ms >= left.end_ms || band.reserved == 0 {
        return None;
    }
    let window_ms = window_ms.max(1);
    let rest = (left.end_ms - now_ms).min(window_ms);
    let fleet = mul_div(band.reserved, rest, window_ms);
    let mine = mul_div(here.min(band.reserved), rest, window_ms);
    let have = left.units.saturating_mul(LEVEL_ONE);
    let asks = |units: u64| fleet.saturating_add(units.saturating_mul(LEVEL_ONE));
    if have >= asks(cost.saturating_add(block)) {
        return None;
    }
    let others = fleet - mine;
    let most = have.saturating_sub(others) / LEVEL_ONE;
    Some(if held && have < asks(cost) {
        Keeping {
            kept: mine.div_ceil(LEVEL_ONE),
            most,
        }
    } else {
        Keeping {
            kept: 0,
            most: most.max(cost),
        }
    })
}

/// This replica's allowance for a tenant of weight `weight` kept as `local`, under the level
/// `level` of its view: its fleet share `level × weight` times this replica's fraction of its
/// demand, cost units a window × [`LEVEL_ONE`]; `None` without a level (nobody held).
pub fn allowance(level: u64, weight: u16, local: &Local) -> Option<u64> {
    (level != NO_LEVEL).then(|| {
        let share = level.saturating_mul(u64::from(weight.max(1)));
        mul_div(share, local.fraction(), ONE)
    })
}

impl Local {
    /// Whether a request of `cost` at `now_ms` fits the tenant's allowance here (`allowance`
    /// a window of `window_ms`, [`allowance`]; `None`: no limit), taking it from the credit if
    /// so. The allowance accrues continuously and the credit keeps at most a
    /// [`CREDIT_PARTS`]th of a window's worth (or one request's, if more): a replica whose
    /// allowance is a fraction of a request a window admits one every so many windows, as its
    /// share says, and a request is admitted while at least half of it is covered.
    pub fn take(&mut self, allowance: Option<u64>, now_ms: u64, window_ms: u64, cost: u64) -> bool {
        let w = i128::from(window_ms.max(1));
        let need = i128::from(cost.saturating_mul(LEVEL_ONE)) * w;
        let Some(allowance) = allowance else {
            // No level: a full credit once one forms.
            self.credit = i64::MAX;
            self.credit_ms = now_ms;
            return true;
        };
        let cap = i128::from((allowance / CREDIT_PARTS).max(LEVEL_ONE)) * w;
        let accrued = i128::from(allowance) * i128::from(now_ms.saturating_sub(self.credit_ms));
        let credit = (i128::from(self.credit) + accrued).min(cap);
        self.credit_ms = self.credit_ms.max(now_ms);
        let fits = credit * 2 >= need;
        let left = if fits { credit - need } else { credit };
        self.credit = i64::try_from(left).unwrap_or(if left < 0 { i64::MIN } else { i64::MAX });
        fits
    }

    /// Gives back a request of `cost` [`Local::take`] admitted (the lease refused it), in a
    /// window of `window_ms`.
    pub fn give_back(&mut self, cost: u64, window_ms: u64) {
        let back = u128::from(cost.saturating_mul(LEVEL_ONE)) * u128::from(window_ms.max(1));
        self.credit = self
            .credit
            .saturating_add(i64::try_from(back).unwrap_or(i64::MAX));
    }
}

/// What this replica expects to admit of a tenant a window, cost units × [`LEVEL_ONE`]: its
/// allowance, no more than what it asked here in the last whole epoch (`epoch − 1`); all of
/// that without a level.
pub fn expected(level: u64, weight: u16, local: &Local, epoch: u64) -> u64 {
    let asked = local
        .asked_in(epoch.saturating_sub(1))
        .max(local.asked_in(epoch))
        .saturating_mul(LEVEL_ONE);
    allowance(level, weight, local).map_or(asked, |a| a.min(asked))
}

/// The largest block this replica claims of the lease, for what it expects to admit a window
/// (`part`, cost units × [`LEVEL_ONE`], the sum of [`expected`] over its tenants): a
/// [`BLOCKS_PER_PART`]th of it, and of what it expects to admit until the window ends at
/// `window_end_ms` (held quota lapses then) unless its [`spare`] (`spare`) covers more, at
/// least a [`FLOOR_PARTS`]th of it (and 1) and at most `max_block`; `max_block` until it has
/// reported once (`part` `None`).
pub fn block_cap(
    (part, spare): (Option<u64>, u64),
    (now_ms, window_end_ms, window_ms): (u64, u64, u64),
    max_block: u64,
) -> u64 {
    let Some(part) = part else {
        return max_block.max(1);
    };
    let left = window_end_ms.saturating_sub(now_ms).min(window_ms);
    let by_part = part / BLOCKS_PER_PART;
    let by_time = mul_div(part, left, BLOCKS_PER_PART.saturating_mul(window_ms.max(1))).max(spare);
    let max_block = max_block.max(1);
    let floor = (part / FLOOR_PARTS / LEVEL_ONE).clamp(1, max_block);
    (by_part.min(by_time) / LEVEL_ONE).clamp(floor, max_block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::fair::water_fill;

    /// A fleet of replicas on the fair shares, epoch by epoch, with a counter store that sums
    /// what they add (the service): `asks[r][i]` is what tenant `i` asks of replica `r` each
    /// epoch; `weights[i]`, `bands[i]` its weight and band.
    struct Fleet {
        share: Share,
        limit: u64,
        weights: Vec<u16>,
        bands: Vec<u8>,
        views: Vec<View>,
        locals: Vec<Vec<Local>>,
        /// The service's counters: per epoch, each tenant's asks and each band's sums.
        asked: std::collections::HashMap<u64, Vec<u64>>,
        sums: std::collections::HashMap<u64, Vec<BandCounts>>,
    }

    impl Fleet {
        fn new(share: Share, limit: u64, weights: &[u16], bands: &[u8], replicas: usize) -> Fleet {
            Fleet {
                share,
                limit,
                weights: weights.to_vec(),
                bands: bands.to_vec(),
                views: vec![View::new(share.bands); replicas],
                locals: vec![vec![Local::default(); weights.len()]; replicas],
                asked: Default::default(),
                sums: Default::default(),
            }
        }

        /// Epoch `k`: each replica reports `k − 1` and reads `k − 2` (if `answered`), then
        /// its tenants ask `asks[r][i]`.
        fn epoch(&mut self, k: u64, asks: &[Vec<u64>], answered: bool) {
            let n = self.weights.len();
            for r in 0..self.views.len() {
                if !answered {
                    continue;
                }
                let mut band_sums = vec![BandCounts::default(); self.share.bands];
                for i in 0..n {
                    let level = self.views[r].level(self.bands[i], k);
                    let l = &self.locals[r][i];
                    if let Some(c) = contribution(level, self.weights[i], l, k - 1) {
                        let b = usize::from(self.bands[i]);
                        band_sums[b] = band_sums[b].plus(c);
                        self.asked.entry(k - 1).or_insert_with(|| vec![0; n])[i] +=
                            l.asked_in(k - 1);
                    }
                }
                let store = self
                    .sums
                    .entry(k - 1)
                    .or_insert_with(|| vec![BandCounts::default(); self.share.bands]);
                for (s, c) in store.iter_mut().zip(band_sums) {
                    *s = s.plus(c);
                }
                if let Some(sums) = self.sums.get(&(k - READ_LAG)) {
                    self.views[r] = view(&self.share, self.limit, 1000, k - READ_LAG, sums);
                }
                if let Some(asked) = self.asked.get(&(k - READ_LAG)) {
                    for (l, &a) in self.locals[r].iter_mut().zip(asked) {
                        l.told(k - READ_LAG, a);
                    }
                }
            }
            for (r, row) in asks.iter().enumerate() {
                for (i, &a) in row.iter().enumerate() {
                    if a > 0 {
                        self.locals[r][i].ask(k, a);
                    }
                }
            }
        }

        /// Each tenant's allowances over the replicas, cost units a window (∞ without a
        /// level).
        fn shares(&self, k: u64) -> Vec<f64> {
            (0..self.weights.len())
                .map(|i| {
                    (0..self.views.len())
                        .filter(|&r| self.locals[r][i].active(k))
                        .map(|r| {
                            let level = self.views[r].level(self.bands[i], k);
                            allowance(level, self.weights[i], &self.locals[r][i])
                                .map_or(f64::INFINITY, |a| a as f64 / LEVEL_ONE as f64)
                        })
                        .sum()
                })
                .collect()
        }

        fn run(&mut self, epochs: u64, asks: &[Vec<u64>]) -> Vec<f64> {
            for k in 100..100 + epochs {
                self.epoch(k, asks, true);
            }
            self.shares(100 + epochs)
        }
    }

    fn one_band() -> Share {
        Share::for_bands(&[0])
    }

    /// Demands `d` of tenants spread over `replicas` by `spread(i, r)` (each row sums to 1).
    fn asks(d: &[u64], replicas: usize, spread: impl Fn(usize, usize) -> f64) -> Vec<Vec<u64>> {
        (0..replicas)
            .map(|r| {
                d.iter()
                    .enumerate()
                    .map(|(i, &x)| (x as f64 * spread(i, r)).round() as u64)
                    .collect()
            })
            .collect()
    }

    fn close(got: &[f64], want: &[f64], tolerance: f64) -> bool {
        got.iter()
            .zip(want)
            .all(|(g, w)| (g - w).abs() <= tolerance * w.max(1.0))
    }

    #[test]
    fn backlogged_tenants_get_their_weights_shares_wherever_they_are() {
        // 1:2:4 backlogged on one replica, then pinned one per replica: shares 100, 200, 400.
        let (w, d) = ([1, 2, 4], [1_000, 1_000, 1_000]);
        let want = water_fill(700.0, &[1e3, 1e3, 1e3], &[1.0, 2.0, 4.0]);
        let mut one = Fleet::new(one_band(), 700, &w, &[0; 3], 1);
        let got = one.run(12, &asks(&d, 1, |_, _| 1.0));
        assert!(close(&got, &want, 0.01), "{got:?} vs {want:?}");
        let mut pinned = Fleet::new(one_band(), 700, &w, &[0; 3], 3);
        let got = pinned.run(12, &asks(&d, 3, |i, r| f64::from(u8::from(i == r))));
        assert!(close(&got, &want, 0.01), "pinned: {got:?} vs {want:?}");
        // A lone tenant on a busy replica gets its fleet share, not the replica's part.
        let mut lone = Fleet::new(one_band(), 700, &w, &[0; 3], 2);
        let got = lone.run(
            12,
            &asks(&d, 2, |i, r| f64::from(u8::from((i == 2) == (r == 1)))),
        );
        assert!(close(&got, &want, 0.01), "lone: {got:?} vs {want:?}");
    }

    #[test]
    fn a_heavy_tenant_spread_or_skewed_leaves_the_lights_their_demand() {
        // One heavy (1,000 a window) and nine lights (50 each) for 1,000: lights 50, heavy 550.
        let mut d = vec![1_000];
        d.extend([50; 9]);
        for (name, replicas, spread) in [
            (
                "spread",
                10,
                Box::new(|_: usize, _: usize| 0.1) as Box<dyn Fn(usize, usize) -> f64>,
            ),
            (
                "skewed",
                5,
                Box::new(|_: usize, r: usize| if r == 0 { 0.8 } else { 0.05 }),
            ),
            (
                "pinned",
                10,
                Box::new(|i: usize, r: usize| f64::from(u8::from(i == r))),
            ),
        ] {
            let mut f = Fleet::new(one_band(), 1000, &[1; 10], &[0; 10], replicas);
            let a = asks(&d, replicas, spread);
            let total: Vec<f64> = (0..10)
                .map(|i| a.iter().map(|row| row[i] as f64).sum())
                .collect();
            let want = water_fill(1000.0, &total, &[1.0; 10]);
            let got = f.run(15, &a);
            assert!(
                close(&got[..1], &want[..1], 0.02),
                "{name}: {got:?} vs {want:?}"
            );
            // The lights are free: their allowances cover their demand.
            assert!(
                got[1..].iter().zip(&total[1..]).all(|(g, t)| g >= t),
                "{name}: {got:?}"
            );
            // The heavy one's allowances on each replica follow its requests there.
            if name == "skewed" {
                let a = |r: usize| allowance(f.views[r].level(0, 115), 1, &f.locals[r][0]).unwrap();
                let ratio = a(0) as f64 / a(1) as f64;
                assert!((ratio - 16.0).abs() < 0.5, "{ratio}");
            }
        }
    }

    #[test]
    fn bands_are_served_in_order_and_the_lower_keeps_its_minimum() {
        // Interactive (band 0) asks 600, batch (band 1, minimum 20 %) asks 1,000 of 1,000.
        let share = Share::for_bands(&[0, 200]);
        let mut f = Fleet::new(share, 1000, &[1, 1], &[0, 1], 2);
        let got = f.run(12, &asks(&[600, 1_000], 2, |_, _| 0.5));
        assert!(got[0].is_infinite(), "interactive is not held: {got:?}");
        assert!((got[1] - 400.0).abs() < 5.0, "batch gets the rest: {got:?}");
        // Interactive asks it all: batch keeps its minimum, interactive gets the rest.
        let mut f = Fleet::new(share, 1000, &[1, 1], &[0, 1], 2);
        let got = f.run(12, &asks(&[2_000, 1_000], 2, |_, _| 0.5));
        assert!(
            (got[0] - 800.0).abs() < 5.0 && (got[1] - 200.0).abs() < 5.0,
            "{got:?}"
        );
    }

    #[test]
    fn the_level_converges_from_below_a_step_an_epoch() {
        // Water-filling's steps: the plain share (100), then the level, from below, exact.
        let share = one_band();
        let free = |d: u64| BandCounts {
            demand: d,
            free: d,
            held_weight: 0,
            active_weight: ONE,
        };
        let held = |d: u64| BandCounts {
            demand: d,
            free: 0,
            held_weight: ONE,
            active_weight: ONE,
        };
        let all = [1_000, 20, 30, 200, 900];
        let plain = view(
            &share,
            1000,
            1000,
            7,
            &[all
                .iter()
                .map(|&d| free(d))
                .fold(BandCounts::default(), BandCounts::plus)],
        );
        let l0 = plain.bands[0].level / LEVEL_ONE;
        assert_eq!(l0, 200, "the plain share");
        // Classified at 200: 20 and 30 free, three held: (1000 − 50) / 3 = 316; then 200 is
        // free too: (1000 − 250) / 2 = 375, the fixed point.
        let at = |l: u64| {
            all.iter()
                .map(|&d| if d >= l { held(d) } else { free(d) })
                .fold(BandCounts::default(), BandCounts::plus)
        };
        let step =
            |l: u64, k: u64| view(&share, 1000, 1000, k, &[at(l)]).bands[0].level / LEVEL_ONE;
        let l1 = step(l0, 8);
        assert_eq!(l1, 316);
        let l2 = step(l1, 9);
        assert_eq!(l2, 375);
        assert_eq!(step(l2, 10), 375, "the fixed point");
        let want = water_fill(1000.0, &all.map(|d| d as f64), &[1.0; 5]);
        assert!((want[0] - 375.0).abs() < 1e-9);
        // Under the capacity: no level.
        let under = view(&share, 1000, 1000, 9, &[free(900)]);
        assert_eq!(under.bands[0].level, NO_LEVEL);
    }

    #[test]
    fn a_stale_view_or_an_unbelievable_count_is_not_used() {
        let share = one_band();
        let v = view(
            &share,
            100,
            1000,
            50,
            &[BandCounts {
                demand: 500,
                free: 0,
                held_weight: 2 * ONE,
                active_weight: 2 * ONE,
            }],
        );
        assert_eq!(v.level(0, 50 + MAX_STALE), 50 * LEVEL_ONE);
        assert_eq!(v.level(0, 51 + MAX_STALE), NO_LEVEL, "too old: no gate");
        assert_eq!(View::new(1).level(0, 3), NO_LEVEL, "never read");
        // A replica that added 30 to a counter read as 10 does not believe it.
        let mut l = Local::default();
        l.ask(10, 30);
        l.ask(11, 5);
        l.told(10, 10);
        assert_eq!((l.mine, l.fleet, l.fraction()), (0, 0, ONE));
        l.told(10, 120);
        assert_eq!(l.fraction(), ONE / 4);
        assert_eq!(l.fleet_demand(), 120);
        // Smoothed: a next epoch of 50 of 120 moves it a quarter of the way.
        l.ask(12, 50);
        l.told(12, 120);
        assert_eq!(
            l.fraction(),
            (30 * 16 * 3 / 4 + 50 * 16 / 4) * ONE / (120 * 16 * 3 / 4 + 120 * 16 / 4)
        );
        // A jump of more than a quarter (all its requests here now: moved) is taken at once.
        l.ask(13, 60);
        l.told(13, 60);
        assert_eq!(l.fraction(), ONE);
        // And so is its leaving.
        l.told(14, 80);
        assert_eq!((l.fraction(), l.fleet_demand()), (0, 80));
        // Kept for four epochs only.
        assert_eq!((l.asked_in(10), l.asked_in(9)), (30, 0));
        l.ask(14, 1);
        assert_eq!(l.asked_in(10), 0);
        assert!(l.active(14) && !l.active(20));
        // Band sums below this replica's own adds: an expired counter.
        let own = BandCounts {
            demand: 30,
            free: 0,
            held_weight: 500,
            active_weight: 500,
        };
        assert!(believable(&own.plus(own), &own));
        assert!(!believable(&BandCounts::default(), &own));
        // Without the fleet's answers the replicas admit as lone ones (no level).
        let mut f = Fleet::new(share, 100, &[1, 1], &[0, 0], 2);
        for k in 100..110 {
            f.epoch(k, &asks(&[500, 500], 2, |_, _| 0.5), k < 105);
        }
        assert!(
            f.shares(110).iter().all(|s| s.is_infinite()),
            "{:?}",
            f.shares(110)
        );
    }

    #[test]
    fn the_fleets_rest_is_kept_for_the_tenants_under_their_shares() {
        let one = LEVEL_ONE;
        // The band keeps 10 a window for others; 4 of them ask on this replica. Halfway
        // through the window: 5 kept in the fleet, 2 of them here.
        let band = BandView {
            level: 20 * one,
            budget: 90 * one,
            reserved: 10 * one,
        };
        let at = (500, 1_000);
        let left = |units| Left {
            units,
            end_ms: 1_000,
        };
        let keep = |held, units, cost| keeping((&band, 4 * one, held), left(units), at, (cost, 1));
        // What is left covers what is kept, the request and a block: nothing kept.
        assert_eq!(keep(true, 7, 1), None);
        assert_eq!(keep(true, 20, 1), None);
        // A block would take what the others need: it is cut to what they leave.
        let claims = |units, block| keeping((&band, 4 * one, true), left(units), at, (1, block));
        assert_eq!(claims(20, 16), Some(Keeping { kept: 0, most: 17 }));
        assert_eq!(claims(6, 1), Some(Keeping { kept: 0, most: 3 }));
        // Under it: a held tenant leaves this replica's 2, and it claims only what the other
        // replicas' 3 leave; a tenant under its share may always claim its request.
        assert_eq!(keep(true, 5, 1), Some(Keeping { kept: 2, most: 2 }));
        assert_eq!(keep(false, 5, 1), Some(Keeping { kept: 0, most: 2 }));
        assert_eq!(keep(true, 2, 1), Some(Keeping { kept: 2, most: 0 }));
        assert_eq!(keep(false, 2, 3), Some(Keeping { kept: 0, most: 3 }));
        // A window ended, or nothing kept: nothing.
        assert_eq!(
            keeping((&band, 0, true), left(2), (1_000, 1_000), (1, 1)),
            None
        );
        let none = BandView {
            reserved: 0,
            ..band
        };
        assert_eq!(keeping((&none, 0, true), left(0), at, (1, 1)), None);
        // The view keeps what the bands above use and what this band's free tenants ask, once
        // some tenant of it was held; with nobody held, nothing of its own.
        let share = one_band();
        let counts = |held_weight| BandCounts {
            demand: 120,
            free: 10,
            held_weight,
            active_weight: 3 * ONE,
        };
        let v = view(&share, 100, 970, 7, &[counts(2 * ONE)]);
        assert_eq!(v.bands[0].reserved, 10 * one);
        let v = view(&share, 100, 970, 7, &[counts(0)]);
        assert_eq!(v.bands[0].reserved, 0);
    }

    #[test]
    fn the_gate_admits_the_allowance_over_time_and_the_blocks_shrink_to_the_window_end() {
        // An allowance of 10.5 a window (of 1 s): a full credit first (a quarter of a window's,
        // within half a request), then 10.5 a second.
        let mut l = Local::default();
        let a = Some(10 * LEVEL_ONE + LEVEL_ONE / 2);
        let admitted = |l: &mut Local, from: u64, to: u64| {
            (from..to).filter(|&t| l.take(a, t, 1_000, 1)).count()
        };
        let at_once = (0..10).filter(|_| l.take(a, 5_000, 1_000, 1)).count();
        assert_eq!(at_once, 3, "2.625, within half");
        assert_eq!(
            admitted(&mut l, 5_001, 15_001),
            105,
            "then the allowance, exactly"
        );
        // A lease's refusal gives the request back.
        let before = l.credit;
        assert!(l.take(a, 20_000, 1_000, 1));
        l.give_back(1, 1_000);
        assert!(l.credit > before);
        // A third of a request a window: one every three windows, not one in each.
        let mut thin = Local::default();
        let third = Some(LEVEL_ONE / 3);
        let n = (0..30_000u64)
            .step_by(100)
            .filter(|&t| thin.take(third, 1_000_000 + t, 1_000, 1))
            .count();
        assert!((10..=11).contains(&n), "{n}");
        // No level: no limit.
        assert!((0..100).all(|t| thin.take(None, 2_000_000 + t, 1_000, 1)));
        let part = 800 * LEVEL_ONE;
        assert_eq!(
            block_cap((Some(part), 0), (10_000, 11_000, 1_000), 1_000),
            800 / BLOCKS_PER_PART
        );
        assert_eq!(
            block_cap((Some(part), 0), (10_900, 11_000, 1_000), 1_000),
            80 / BLOCKS_PER_PART,
            "what is left to use"
        );
        assert_eq!(
            block_cap((Some(part), 0), (10_999, 11_000, 1_000), 1_000),
            800 / FLOOR_PARTS,
            "the floor"
        );
        let small = 100 * LEVEL_ONE;
        assert_eq!(
            block_cap((Some(small), 0), (10_999, 11_000, 1_000), 1_000),
            1
        );
        assert_eq!(
            block_cap((Some(part), 0), (10_999, 11_000, 1_000), 5),
            5,
            "capped"
        );
        assert_eq!(
            block_cap((Some(part), 0), (10_000, 11_000, 1_000), 40),
            40,
            "the configured cap"
        );
        assert_eq!(
            block_cap((None, 0), (10_000, 11_000, 1_000), 40),
            40,
            "never reported"
        );
        assert_eq!(
            block_cap((Some(0), 0), (10_000, 11_000, 1_000), 40),
            1,
            "expects nothing"
        );
        // Quota the window will leave unused lets the blocks stay at half the part to its end.
        assert_eq!(
            block_cap(
                (Some(part), 300 * LEVEL_ONE),
                (10_900, 11_000, 1_000),
                1_000
            ),
            300
        );
        assert_eq!(
            block_cap(
                (Some(part), 900 * LEVEL_ONE),
                (10_999, 11_000, 1_000),
                1_000
            ),
            800 / BLOCKS_PER_PART
        );
    }

    #[test]
    fn mul_div_is_exact_whether_the_product_fits_or_not() {
        assert_eq!(mul_div(6, 7, 4), 10);
        assert_eq!(mul_div(u64::MAX, 6, 3), u64::MAX, "saturates");
        assert_eq!(mul_div(u64::MAX / 2, 4, 8), u64::MAX / 4);
        assert_eq!(mul_div(1 << 40, 1 << 40, 1 << 30), 1 << 50);
        assert_eq!(mul_div(5, 5, 0), 0);
    }

    /// A replica's spare is its part of what the window is expected to leave unused: what is
    /// left less twice the fleet's expected use in the rest of the window.
    #[test]
    fn a_replica_spares_its_part_of_what_the_window_leaves_unused() {
        let left = |units| Left {
            units,
            end_ms: 11_000,
        };
        // A capacity of 12,000; the fleet uses 4,000 a window, this replica 400 of it. Said at
        // 10,500, half a window before the end, 10,000 left: 2,000 taken in half a window is
        // the view's pace; 4,000 expected (twice 2,000) to the end, so 6,000 go unused, 600
        // this replica's.
        let uses = (12_000, 4_000 * LEVEL_ONE, 400 * LEVEL_ONE);
        let now = (10_600, 1_000);
        assert_eq!(spare((left(10_000), 10_500), uses, now), 600 * LEVEL_ONE);
        // What was said earlier sets more aside: said at 10,200, 8/10 of a window's use twice
        // (6,400); and 2,000 taken in 2/10 of a window is a pace of 10,000 a window: more
        // than the view's, and nothing goes unused.
        assert_eq!(spare((left(10_000), 10_200), uses, now), 0);
        // A view that says less than the pace (the tenants not reported take quota too):
        // 400 taken in 2/10 of a window is 2,000 a window, 3,200 set aside (twice 2,000 ×
        // 8/10), and of the 8,400 unused this replica's 400 of 2,000 spare 1,680.
        let at_pace = (12_000, 400 * LEVEL_ONE, 400 * LEVEL_ONE);
        assert_eq!(
            spare((left(11_600), 10_200), at_pace, now),
            1_680 * LEVEL_ONE
        );
        // No view: the pace alone.
        let no_view = (12_000, 0, 400 * LEVEL_ONE);
        assert_eq!(spare((left(10_000), 10_500), no_view, now), 600 * LEVEL_ONE);
        // Nothing left over, or the window ended: nothing.
        assert_eq!(spare((left(4_000), 10_500), uses, now), 0);
        assert_eq!(spare((left(10_000), 10_500), uses, (11_000, 1_000)), 0);
        // The fleet's use from the band sums: each band's demand up to its budget.
        let share = one_band();
        let counts = [BandCounts {
            demand: 300,
            free: 0,
            held_weight: 0,
            active_weight: 3 * ONE,
        }];
        let v = view(&share, 1_000, 1000, 7, &counts);
        assert_eq!(fleet_use(&v, &counts), 300 * LEVEL_ONE);
        let over = [BandCounts {
            demand: 3_000,
            ..counts[0]
        }];
        let v = view(&share, 1_000, 1000, 7, &over);
        assert_eq!(fleet_use(&v, &over), 1_000 * LEVEL_ONE);
    }
}
