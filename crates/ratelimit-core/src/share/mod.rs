//! One capacity shared among the tenants active now: weighted max-min fair, work-conserving,
//! with priority bands.
//!
//! A shared rule has one capacity `C` (its limit, under its algorithm) and tenants (the values
//! of its `share.by` key), each with a weight and a band. A request of cost `c` from tenant `i`
//! is admitted when all three hold:
//!
//! - **capacity**: the rule's algorithm admits `c` on the one state all tenants share;
//! - **band** (two bands or more): the band's use stays within its budget, which serves the
//!   bands in priority order while keeping for each lower band what it uses of its reserved
//!   minimum;
//! - **share**: the tenant's own use over the window stays within `level × w_i`, or the whole
//!   capacity is still below the saturation point `θ·C` (nobody is held while there is room).
//!
//! **The level** is the band's water level, recomputed every [`STEP_MS`] by the first request
//! that finds it stale (no timer): with `B` the band's budget, `U_free` the use of the tenants
//! that get all they ask (lately: whole counts, see `recent`), `W_held` the weight of those
//! held to the level and `R` the demand refused to tenants below the band's mean (halved at
//! each step),
//! `level = max((B − U_free − R) / W_held, B / W_active)`. Its fixed point is the weighted max-min
//! allocation of `B` (water-filling: the tenants below the level are served whole, the others
//! share the rest by weight), and it never goes below the plain share `B·w_i / W_active`. It is
//! computed from measured state, not integrated, so it does not wind up. A tenant is *held*
//! once it is refused for its share (or for the capacity while above the band's mean use per
//! weight) and stays held until a second passes without such a refusal. The held weight is
//! counted by held epochs of [`HELD_MS`] (a held tenant counts again in each epoch it is refused
//! in), so a held tenant that stops asking leaves it within two epochs, not when it stops being
//! active.
//!
//! **Active tenants** are counted by epochs of the active interval: each band keeps the weights
//! counted in this epoch and in the one before; a tenant adds its weight at its first request in
//! an epoch (and takes it out of the carry), so the active weight is exactly that of the tenants
//! that asked in this epoch or the last one, with no timer and no list of tenants.
//!
//! Everything here is a pure function of the record, the tenant's entry, the request and the
//! time; where they are stored and how concurrent updates are kept apart is the engine's.

pub mod fair;
pub mod fair_record;
pub mod in_place;
pub mod learn;
pub mod queue;
pub mod state;

pub use state::{BandSums, Fleet, Record, Tenant, FLEET_LEFT_MAX, MAX_BANDS, NO_LEVEL};

use crate::limiter::{sliding_window, Policy, Verdict};

/// How often the levels are recomputed, ms.
pub const STEP_MS: u64 = 250;
/// The level's fixed point: cost units per weight unit, × this.
pub const LEVEL_ONE: u64 = 1024;
/// A held epoch: the held weights are counted by epochs this long (four level steps), and a
/// tenant is no longer held once it goes that long without being refused for its share.
pub const HELD_MS: u64 = 4 * STEP_MS;

/// A shared rule's sharing parameters (its capacity is the rule's own policy; its bands'
/// names are the configuration's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// How long a tenant counts as active after its last request (at least; at most twice).
    pub active_ms: u64,
    /// Below this part of the capacity (permille) nobody is held to the level.
    pub saturation_pm: u64,
    /// The part of the capacity (permille) the levels hand out; the rest is headroom for the
    /// tenants below their level.
    pub target_pm: u64,
    /// The number of bands (1 to [`MAX_BANDS`]), highest priority first.
    pub bands: usize,
    /// The part of the capacity (permille) each band keeps for itself when it uses it.
    pub min_share_pm: [u64; MAX_BANDS],
    /// How long a capacity learned from the provider takes to climb back to the configured
    /// one once it no longer holds, ms ([`learn`]).
    pub ramp_ms: u64,
}

/// Who asks: the tenant's weight (1 or more) and band (below [`Share::bands`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asker {
    /// Its weight.
    pub weight: u16,
    /// Its band.
    pub band: u8,
    /// Whether this is a request asking again (a turn in the shared rule's line): its refused
    /// demand is counted when its wait ends refused, not at each turn.
    pub again: bool,
    /// How long its request may wait in the rule's line for its turn, ms (0: it may not): a
    /// refusal it can wait out is not yet demand refused (a request served from the line a few
    /// milliseconds later would otherwise count twice, refused and used, and lower the level).
    /// It is counted when its wait ends refused; one the line then turns away (full) is not.
    pub wait_ms: u64,
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The capacity itself is used up.
    Capacity,
    /// The band's budget is used up (higher bands use the rest).
    Band,
    /// The tenant has its share while the capacity is contended.
    Share,
}

/// What [`decide`] says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The verdict: if refused, the refusing check's (the longest wait of those refusing).
    pub verdict: Verdict,
    /// Why it was refused (`None`: admitted).
    pub refused: Option<Reason>,
    /// The tenant's entry to store.
    pub tenant: Tenant,
    /// The tenant's share of the level now (cost units per window), `None` when it has none.
    pub share: Option<u64>,
}

/// Decides a request of `cost` at `now_ms` from `asker`, whose entry is `tenant` (`None`: never
/// seen), against a capacity `capacity` shared as `share` says, updating `record` (written back
/// whether the request is admitted or not: a refused request still counts its tenant as active).
pub fn decide(
    share: &Share,
    capacity: &Policy,
    record: &mut Record,
    tenant: Option<&Tenant>,
    asker: Asker,
    now_ms: u64,
    cost: u64,
) -> Decision {
    if record.bands.len() != share.bands.clamp(1, MAX_BANDS) {
        *record = Record::new(share.bands);
    }
    // The capacity in force: lowered to what the provider said, if it said less.
    let configured = capacity.limit_and_window().0;
    let in_force = learn::policy_in_force(capacity, record, share, now_ms);
    let capacity = &in_force;
    let (limit, window_ms) = capacity.limit_and_window();
    let window_ms = window_ms.max(1);
    // Leased across Envoys, the levels share this proxy's part of it (its lease checks the
    // fleet's whole).
    let leased = fleet_limit(record, limit, window_ms, now_ms);
    let whole = limit;
    let limit = leased.unwrap_or(limit);
    let epoch = roll_to(share, record, now_ms);
    if now_ms >= record.step_ms.saturating_add(STEP_MS) || now_ms < record.step_ms {
        step(share, limit, window_ms, record, now_ms);
        if leased.is_some() {
            pressed(record, now_ms, window_ms);
        }
    }
    let band = usize::from(asker.band).min(record.bands.len().saturating_sub(1));
    let weight = asker.weight.max(1);
    let mut t = tenant.copied().unwrap_or_default();
    if t.usage.window_ms == 0 {
        t.usage.window_ms = u32::try_from(window_ms).unwrap_or(u32::MAX);
    }
    let tick = (now_ms / STEP_MS % 16) as u8;
    register(record, &mut t, weight, band as u8, epoch, tick);
    if leased.is_some() {
        if let Some(wait_ms) = fleet_reserved(
            share,
            (&record.fleet, &record.bands),
            (band, t.held),
            (configured, whole, limit),
            (now_ms, window_ms),
            cost,
        ) {
            // Below the band's level in a band of its own: the share's refusal.
            let reason = if band == 0 {
                Reason::Share
            } else {
                Reason::Band
            };
            return refused_before(capacity, (now_ms, cost, wait_ms), reason, t);
        }
    }

    let Some(sums) = record.bands.get(band).copied() else {
        return refused_before(capacity, (now_ms, cost, 0), Reason::Capacity, t);
    };

    // The capacity (refusing everyone while the provider asked to wait).
    let (mut v_capacity, next_capacity) = capacity.decide(record.capacity.as_ref(), now_ms, cost);
    if now_ms < record.blocked_until_ms {
        v_capacity.allowed = false;
        v_capacity.remaining = 0;
        v_capacity.retry_after_ms = v_capacity
            .retry_after_ms
            .max(record.blocked_until_ms - now_ms);
    }
    let v_band = band_verdict(
        share,
        capacity,
        (&record.bands, band),
        limit,
        (now_ms, window_ms),
        cost,
    );
    // The tenant's share of the level, unless there is room for everyone.
    let share_fixed =
        (sums.level != NO_LEVEL).then(|| sums.level.saturating_mul(u64::from(weight)));
    let share_now = share_fixed.map(|s| s.div_ceil(LEVEL_ONE));
    // Without a level (the capacity not contended) nobody is held to a share: what the
    // capacity's use and the tenant's would say is not needed.
    let v_share = share_fixed.and_then(|s| {
        let at = (now_ms, window_ms);
        level_holds(share, (&record.bands, &t), limit, at, cost)
            .then(|| under(&t.usage, now_ms, window_ms, s, cost))
    });
    // A held tenant not refused for its share for a second is no longer held (nor is anyone
    // once the band has no level).
    let tick = (now_ms / STEP_MS % 16) as u8;
    if t.held && (share_now.is_none() || tick.wrapping_sub(t.refused_tick) % 16 >= 4) {
        set_held(record, &mut t, false, tick);
    }

    let refusals = [
        (Reason::Capacity, Some(v_capacity)),
        (Reason::Band, v_band),
        (Reason::Share, v_share),
    ];
    let refused = refusals
        .iter()
        .filter_map(|&(r, v)| v.filter(|v| !v.allowed).map(|v| (r, v)))
        .max_by_key(|(_, v)| v.retry_after_ms);
    if let Some((reason, verdict)) = refused {
        let first = refusals
            .iter()
            .find(|(_, v)| v.is_some_and(|v| !v.allowed))
            .map_or(reason, |&(r, _)| r);
        // Asking for more than its share, or for capacity while above the band's mean use
        // per weight: the tenant is held to the level. Below the mean, its refused demand
        // lowers the level at the next step.
        let mine = t.usage.usage(now_ms, window_ms);
        let above_mean = u128::from(mine) * u128::from(sums.active_weight().max(1))
            >= u128::from(sums.used.usage(now_ms, window_ms)) * u128::from(weight);
        // Refused for a capacity that lower bands are using: its demand is the band's, to be
        // kept from them at the next step, whatever its own use.
        let lower_use = first == Reason::Capacity
            && record
                .bands
                .iter()
                .skip(band + 1)
                .any(|b| b.used.usage(now_ms, window_ms) > 0);
        if lower_use {
            if let Some(b) = record.bands.get_mut(band).filter(|_| !asker.again) {
                b.starved = b.starved.saturating_add(cost);
            }
        } else if first == Reason::Share || above_mean {
            set_held(record, &mut t, true, tick);
        } else if let Some(b) = record.bands.get_mut(band).filter(|_| {
            !asker.again && (asker.wait_ms == 0 || verdict.retry_after_ms > asker.wait_ms)
        }) {
            b.starved = b.starved.saturating_add(cost);
        }
        // Seen now all the same: its entry is kept while it may count as active.
        t.usage = sliding_window::add(t.usage, now_ms, window_ms, 0);
        return Decision {
            verdict,
            refused: Some(first),
            tenant: t,
            share: share_now,
        };
    }

    record.capacity = next_capacity;
    let window = window_ms;
    if let Some(b) = record.bands.get_mut(band) {
        b.used = sliding_window::add(b.used, now_ms, window, cost);
        if t.held {
            b.used_held = sliding_window::add(b.used_held, now_ms, window, cost);
        }
    }
    t.usage = sliding_window::add(t.usage, now_ms, window, cost);
    let mut verdict = v_capacity;
    if let Some(v) = v_share {
        verdict.remaining = verdict.remaining.min(v.remaining);
    }
    Decision {
        verdict,
        refused: None,
        tenant: t,
        share: share_now,
    }
}

/// Whether a band's level (where it has one) holds tenant `t` to its share for a request of
/// `cost`: the capacity (`limit`, this proxy's part of it if leased) past its saturation point
/// with the request, and the tenant not idle. A tenant that used nothing over the window may
/// always ask: a share under half a request a window (many tenants, a small capacity) would
/// otherwise never admit one above the saturation point. The capacity and the band still hold
/// the whole.
fn level_holds(
    share: &Share,
    (bands, t): (&[BandSums], &Tenant),
    limit: u64,
    (now_ms, window_ms): (u64, u64),
    cost: u64,
) -> bool {
    let used_all = bands
        .iter()
        .map(|b| b.used.usage(now_ms, window_ms))
        .fold(0, u64::saturating_add);
    let room = used_all.saturating_add(cost) <= permille(limit, share.saturation_pm);
    !room && t.usage.usage_in(now_ms, window_ms, LEVEL_ONE) != 0
}

/// The verdict of the budget of band `band` of `bands` (two bands or more; `None` with one): the
/// highest active band may use the headroom above the target.
fn band_verdict(
    share: &Share,
    capacity: &Policy,
    (bands, band): (&[BandSums], usize),
    limit: u64,
    (now_ms, window_ms): (u64, u64),
    cost: u64,
) -> Option<Verdict> {
    let sums = bands.get(band)?;
    if bands.len() < 2 {
        return None;
    }
    let highest = bands.iter().take(band).all(|b| b.active_weight() == 0);
    let headroom = if highest {
        limit.saturating_sub(permille(limit, share.target_pm))
    } else {
        0
    };
    // A capacity with no burst to spare (a sliding window, a leaky bucket) keeps what the
    // higher bands use now from this band at once, and room for one more request of
    // theirs: the step's budget reads their whole counts, a step apart, and a higher band's
    // burst in between would meet a capacity this band had filled. A token bucket's burst
    // absorbs it.
    let spare = matches!(capacity, Policy::Gcra(p) if p.burst > cost);
    let mut budget = sums.budget;
    if !spare && band > 0 {
        let above_now: u64 = bands
            .iter()
            .take(band)
            .map(|b| b.used.usage_in(now_ms, window_ms, LEVEL_ONE))
            .sum();
        if above_now > 0 {
            let target = permille(limit.saturating_mul(LEVEL_ONE), share.target_pm);
            let reserve = share
                .min_share_pm
                .get(band)
                .map_or(0, |&pm| permille(target, pm));
            let room = target
                .saturating_sub(above_now)
                .saturating_sub(cost.saturating_mul(LEVEL_ONE));
            budget = budget.min(room.max(reserve));
        }
    }
    let budget = budget.saturating_add(headroom.saturating_mul(LEVEL_ONE));
    Some(under(&sums.used, now_ms, window_ms, budget, cost))
}

/// What a proxy's part of a leased capacity climbs by, permille of the capacity, in each
/// service window after one it held tenants to their shares in without the fleet's quota
/// running out.
pub const PART_STEP_PM: u16 = 20;
/// What a proxy's part is cut to, permille of itself, in a window the fleet's quota ran out in.
pub const PART_CUT_PM: u64 = 950;

/// How far ahead of an even pace (permille of the capacity) the fleet's grants may run before a
/// window counts as one the quota would run out in: grants run ahead of use by the blocks the
/// replicas hold.
pub const AHEAD_PM: u64 = 50;

/// A capacity of `limit` leased across Envoys (`window_ms` its window): the service answered a
/// claim of this proxy, granting `granted` (0: refused) in its window that ends at
/// `window_end_ms`. This proxy's part of the capacity, which its tenants share
/// ([`fleet_limit`]), is additive increase, multiplicative decrease over the service's windows,
/// the fleet's replicas converging on equal parts while each has more demand than its part
/// (and a replica with less leaving the rest to the others):
///
/// - a window in which the service refused a claim of this proxy (the fleet's quota ran out),
///   or told it, past the window's middle, that the fleet was granted more than the time
///   elapsed allows, by over [`AHEAD_PM`] (it will run out), cuts the part to
///   [`PART_CUT_PM`] of itself (the first such window sets it: that part of what the service
///   had granted this proxy of the capacity in that window);
/// - a window that ends without such a refusal, while this proxy held tenants to their shares
///   (it had more demand than its part), raises it by [`PART_STEP_PM`], at most the whole.
///
/// Answers are told apart by their window's end (a quarter of a window either way is the same
/// window), not by their order: a late answer of a window already gone is not counted.
/// Returns whether the record changed.
pub fn lease_answered(
    record: &mut Record,
    (limit, window_ms): (u64, u64),
    (granted, remaining, refused): (u64, u64, bool),
    (window_end_ms, now_ms): (u64, u64),
) -> bool {
    let pressed = record.bands.iter().any(|b| b.held_weight() > 0);
    let f = &mut record.fleet;
    let slack = window_ms / 4;
    if window_end_ms.saturating_add(slack) < f.window_end_ms {
        return false; // a window gone
    }
    if window_end_ms > f.window_end_ms.saturating_add(slack) {
        if f.part_pm > 0 && !f.spent && pressed {
            f.part_pm = f.part_pm.saturating_add(PART_STEP_PM).min(1000);
        }
        f.window_end_ms = window_end_ms & 0xffff_ffff_ffff;
        f.granted = 0;
        f.spent = false;
        f.left = FLEET_LEFT_MAX;
    }
    // What the fleet has left only falls within a window, whatever order the answers come in.
    f.left = f
        .left
        .min(u32::try_from(remaining).unwrap_or(FLEET_LEFT_MAX));
    f.granted = f
        .granted
        .saturating_add(u32::try_from(granted).unwrap_or(u32::MAX));
    // The fleet granted faster than the capacity lasts: past the window's middle, what the
    // service granted so far, at that pace, would run out before the window ends. Cut now
    // rather than once the quota is gone (when whoever asks is refused).
    let elapsed = window_ms.saturating_sub(window_end_ms.saturating_sub(now_ms));
    let fleet = limit.saturating_sub(remaining);
    let pace = u128::from(limit) * u128::from(elapsed) / u128::from(window_ms.max(1));
    let ahead = u128::from(limit * AHEAD_PM / 1000);
    let too_fast = elapsed * 2 >= window_ms && u128::from(fleet) > pace + ahead;
    if (refused || too_fast) && !f.spent {
        f.spent = true;
        let part = match f.part_pm {
            0 => u64::from(f.granted).saturating_mul(1000) / limit.max(1),
            p => u64::from(p),
        };
        let cut = part.saturating_mul(PART_CUT_PM) / 1000;
        f.part_pm = u16::try_from(cut.clamp(1, 1000)).unwrap_or(1000);
    }
    true
}

/// A leased capacity's blocks are at most this fraction (1/10) of this proxy's part: what the
/// fleet's replicas hold ahead of use (and lapses when a window ends) stays near a tenth of the
/// capacity in all, whatever their number.
pub const PART_BLOCKS: u64 = 10;

/// The largest block this proxy claims of a leased capacity of `limit`: a [`PART_BLOCKS`]th of
/// its part once it is known (`part_pm`, [`lease_answered`]), at least 1 and at most
/// `max_block` (the configured cap, in force until the part is known).
pub fn lease_block_cap(part_pm: u16, limit: u64, max_block: u64) -> u64 {
    if part_pm == 0 {
        return max_block;
    }
    let part = u128::from(limit) * u128::from(part_pm) / 1000;
    let cap = u64::try_from(part / u128::from(PART_BLOCKS)).unwrap_or(u64::MAX);
    cap.clamp(1, max_block.max(1))
}

/// The capacity in force in this proxy: [`learn::policy_in_force`], lowered to
/// [`fleet_limit`].
pub fn in_force_here(capacity: &Policy, record: &Record, share: &Share, now_ms: u64) -> Policy {
    let learned = learn::policy_in_force(capacity, record, share, now_ms);
    let (limit, window_ms) = learned.limit_and_window();
    match fleet_limit(record, limit, window_ms.max(1), now_ms) {
        Some(part) => learn::lowered(&learned, part),
        None => learned,
    }
}

/// The capacity this proxy shares among its tenants when `limit` is leased across Envoys: its
/// part ([`lease_answered`]) while it is recent (until a window after the last one the service
/// answered it in ends); `None` otherwise (this proxy alone), and for a capacity not leased.
pub fn fleet_limit(record: &Record, limit: u64, window_ms: u64, now_ms: u64) -> Option<u64> {
    fleet_part(&record.fleet, limit, window_ms, now_ms)
}

/// [`fleet_limit`] of a record's [`Fleet`].
fn fleet_part(f: &Fleet, limit: u64, window_ms: u64, now_ms: u64) -> Option<u64> {
    if f.part_pm == 0 || now_ms >= f.window_end_ms.saturating_add(window_ms) {
        return None;
    }
    let part = u128::from(limit) * u128::from(f.part_pm) / 1000;
    Some(u64::try_from(part).unwrap_or(limit).clamp(1, limit.max(1)))
}

/// Takes back a request of `cost` that [`decide`] admitted at `counted_ms` (another rule of the
/// request refused it): from the capacity, the band's use and the tenant's. Its tenant stays
/// counted as active (it asked).
pub fn refund(
    capacity: &Policy,
    record: &mut Record,
    tenant: &mut Tenant,
    counted_ms: u64,
    now_ms: u64,
    cost: u64,
) {
    if let Some(back) = capacity.refund_at(record.capacity.as_ref(), counted_ms, now_ms, cost) {
        record.capacity = Some(back);
    }
    let back = |s: sliding_window::State| {
        let counted = sliding_window::State {
            last_ms: counted_ms,
            ..s
        };
        sliding_window::refund(s, &counted, cost)
    };
    if let Some(b) = record.bands.get_mut(usize::from(tenant.band)) {
        b.used = back(b.used);
        if tenant.held {
            b.used_held = back(b.used_held);
        }
    }
    tenant.usage = back(tenant.usage);
}

/// [`refund`]'s part in the tenant's own entry: its use over the window, less `cost` counted
/// at `counted_ms`.
pub fn refund_tenant(tenant: &mut Tenant, counted_ms: u64, cost: u64) {
    let counted = sliding_window::State {
        last_ms: counted_ms,
        ..tenant.usage
    };
    tenant.usage = sliding_window::refund(tenant.usage, &counted, cost);
}

/// [`charge`]'s part in the tenant's own entry: its use over the window, `cost` more.
pub fn charge_tenant(tenant: &mut Tenant, now_ms: u64, cost: u64) {
    let window_ms = u64::from(tenant.usage.window_ms).max(1);
    tenant.usage = sliding_window::add(tenant.usage, now_ms, window_ms, cost);
}

/// Counts `cost` more for a request [`decide`] admitted (its response used more than its
/// reservation): on the capacity whatever it says (the request went through), the band's use
/// and the tenant's.
pub fn charge(capacity: &Policy, record: &mut Record, tenant: &mut Tenant, now_ms: u64, cost: u64) {
    let (_, window_ms) = capacity.limit_and_window();
    let window_ms = window_ms.max(1);
    if let Some((_, next)) = capacity.charge(record.capacity.as_ref(), now_ms, cost) {
        record.capacity = Some(next);
    }
    if let Some(b) = record.bands.get_mut(usize::from(tenant.band)) {
        b.used = sliding_window::add(b.used, now_ms, window_ms, cost);
        if tenant.held {
            b.used_held = sliding_window::add(b.used_held, now_ms, window_ms, cost);
        }
    }
    tenant.usage = sliding_window::add(tenant.usage, now_ms, window_ms, cost);
}

/// A capacity leased across Envoys (`whole` in force of the `configured` one the service
/// counts, of which this proxy's part is `part`), for a request of `cost` in band `band` from a
/// tenant held to its share or not (`held`): when what the fleet has left of the service's
/// window (its latest answer, less what the capacity in force leaves out) no longer covers what the
/// bands above, and the tenants of its band that are not held, will use until that window ends,
/// the request waits for the next window (returns how long). The fleet's last grants of a
/// window then go to the higher bands and the tenants below their shares, as the shares do
/// within a proxy, not to whoever asks first.
///
/// What they will use is this proxy's use of them over the last window, scaled to the fleet's
/// (by the smaller of this proxy's part and its part of what the fleet was granted in the
/// window) and to the time left: exact when tenants spread over the replicas alike (the blocks
/// the replicas still hold, granted already, go to the same tenants first). A band still below
/// its reserved minimum (of this proxy's part) is never held here.
fn fleet_reserved(
    share: &Share,
    (f, bands): (&Fleet, &[BandSums]),
    (band, held): (usize, bool),
    (configured, whole, part): (u64, u64, u64),
    (now_ms, window_ms): (u64, u64),
    cost: u64,
) -> Option<u64> {
    // What the fleet may still use of the window: the service counts the configured capacity,
    // the provider said less.
    let left = u64::from(f.left).saturating_sub(configured.saturating_sub(whole));
    if (band == 0 && !held) || f.part_pm == 0 || now_ms >= f.window_end_ms {
        return None;
    }
    let mut above: u64 = bands
        .iter()
        .take(band)
        .map(|b| b.used.usage(now_ms, window_ms))
        .sum();
    let mine = bands.get(band)?;
    let used = mine.used.usage(now_ms, window_ms);
    if held {
        above += used.saturating_sub(mine.used_held.usage(now_ms, window_ms));
    }
    let kept = permille(
        permille(part, share.target_pm),
        share.min_share_pm.get(band).copied().unwrap_or(0),
    );
    if above == 0 || (band > 0 && used.saturating_add(cost) <= kept) {
        return None;
    }
    // This proxy's part of the fleet, permille.
    let fleet_granted = configured.saturating_sub(u64::from(f.left));
    let of_grants = u64::from(f.granted).saturating_mul(1000) / fleet_granted.max(1);
    let here_pm = u128::from(u64::from(f.part_pm).min(of_grants.max(1)));
    let rest = (f.window_end_ms - now_ms).min(window_ms);
    let need =
        u128::from(above) * 1000 * u128::from(rest) / (here_pm * u128::from(window_ms.max(1)));
    (u128::from(left) < need + u128::from(cost)).then_some(rest)
}

/// A refusal decided before the capacity is asked ([`fleet_reserved`]'s, for `reason`, until
/// the service's window ends; a record missing the request's band, never once resized, for the
/// capacity): the tenant is seen, nothing is counted.
fn refused_before(
    capacity: &Policy,
    (now_ms, cost, wait_ms): (u64, u64, u64),
    reason: Reason,
    mut t: Tenant,
) -> Decision {
    let (mut verdict, _) = capacity.decide(None, now_ms, cost);
    verdict.allowed = false;
    verdict.remaining = 0;
    verdict.retry_after_ms = verdict.retry_after_ms.max(wait_ms);
    let window_ms = u64::from(t.usage.window_ms).max(1);
    t.usage = sliding_window::add(t.usage, now_ms, window_ms, 0);
    Decision {
        verdict,
        refused: Some(reason),
        tenant: t,
        share: None,
    }
}

/// Whether a request of `cost` fits a counter's `limit` (× [`LEVEL_ONE`]) now: it is admitted
/// while at least half of it fits, so a share is overshot by at most half a request whatever
/// its requests cost. (It may fall short by up to one: a window's last request passes only as
/// the window before slides out, which a tenant sending at a fixed period may never hit.) If
/// not, the verdict says when it will.
fn under(
    counter: &sliding_window::State,
    now_ms: u64,
    window_ms: u64,
    limit: u64,
    cost: u64,
) -> Verdict {
    let used = counter.usage_in(now_ms, window_ms, LEVEL_ONE);
    let half = cost.saturating_mul(LEVEL_ONE) / 2;
    // Admitted while at least half of the request fits: u + cost / 2 ≤ limit, the wait of a
    // request of `cost` against a limit half a request higher.
    let (mut v, _) = sliding_window::decide(
        Some(*counter),
        now_ms,
        limit.saturating_add(half) / LEVEL_ONE,
        window_ms,
        cost,
    );
    let whole = limit.div_ceil(LEVEL_ONE);
    v.allowed = used.saturating_add(half) <= limit;
    v.limit = whole;
    v.remaining = whole.saturating_sub(used.div_ceil(LEVEL_ONE));
    if v.allowed {
        v.retry_after_ms = 0;
    } else {
        v.retry_after_ms = v.retry_after_ms.max(1);
        // A share that is no whole number of requests reads as the next whole one: refused,
        // nothing is left of it, whatever that rounding leaves.
        v.remaining = 0;
    }
    v
}

/// A band's budget of `target` (bands served in priority order): what the `above` bands use
/// and the `below` bands keep of their reserved minimums left out, never under its own
/// `reserve`; the whole target when there is one band.
pub(super) fn band_budget(bands: usize, target: u64, above: u64, below: u64, reserve: u64) -> u64 {
    if bands == 1 {
        return target;
    }
    target
        .saturating_sub(above)
        .saturating_sub(below)
        .max(reserve)
}

/// `n` × `pm` / 1000.
pub(super) fn permille(n: u64, pm: u64) -> u64 {
    (u128::from(n) * u128::from(pm) / 1000)
        .try_into()
        .unwrap_or(u64::MAX)
}

/// Counts the tenant among this epoch's active tenants once: at its first request of the epoch
/// its weight goes into the band's sum for this epoch (and out of the carry, if it was counted
/// in the last one); a weight or band that changed within the epoch moves.
fn register(record: &mut Record, t: &mut Tenant, weight: u16, band: u8, epoch: u32, tick: u8) {
    let e16 = epoch as u16;
    let counted = t.weight != 0;
    if counted && t.epoch == e16 {
        if (t.weight, t.band) != (weight, band) {
            adjust(record, t, Slot::Now, -1);
            // A held tenant's held weight moves with it, in the held sum it is in.
            let slot = held_slot(t, tick);
            move_held(record, t, slot, -1);
            t.weight = weight;
            t.band = band;
            move_held(record, t, slot, 1);
            adjust(record, t, Slot::Now, 1);
        }
        return;
    }
    if counted && t.epoch == epoch.wrapping_sub(1) as u16 {
        adjust(record, t, Slot::Carry, -1);
    } else {
        // Idle for more than an epoch: it starts afresh, not held (its held weight left the
        // held sums long ago).
        t.held = false;
    }
    t.epoch = e16;
    t.weight = weight;
    t.band = band;
    adjust(record, t, Slot::Now, 1);
}

/// Moves the record's active and held sums to the epochs of `now_ms`; returns the active
/// epoch to count in. A clock behind the record's (another worker's clock, or one set back)
/// counts in the record's epoch: the active sums never mix two.
fn roll_to(share: &Share, record: &mut Record, now_ms: u64) -> u32 {
    let epoch = u32::try_from(now_ms / share.active_ms.max(1)).unwrap_or(u32::MAX);
    record.roll(epoch);
    record.roll_held((now_ms / HELD_MS) as u16);
    record.epoch.max(epoch)
}

/// Makes the record's active and held sums count a tenant as `after` instead of `before`, at
/// `now_ms`. Two decisions of one tenant can race where the record and the tenant's entry are
/// two compare-and-swap values (the wasm build's shared data): both read the same entry and
/// both count their change of it in the record, but the entry keeps one decision's counting.
/// The decision whose entry write lost calls this with the entry it found there (`before`, the
/// other's) and the one it had decided from (`after`): the other's change is taken back, its
/// own stands, and the tenant is counted once (where it was counted twice, the held weight
/// lowered every tenant's level, leaving capacity idle).
/// Returns whether the sums changed.
pub fn recount(
    share: &Share,
    record: &mut Record,
    before: &Tenant,
    after: &Tenant,
    now_ms: u64,
) -> bool {
    let epoch = roll_to(share, record, now_ms);
    let tick = (now_ms / STEP_MS % 16) as u8;
    let active_slot = |t: &Tenant| match t.weight {
        0 => None,
        _ if t.epoch == epoch as u16 => Some(Slot::Now),
        _ if t.epoch == epoch.wrapping_sub(1) as u16 => Some(Slot::Carry),
        _ => None,
    };
    let counted = |t: &Tenant| {
        let (active, held) = (active_slot(t), held_slot(t, tick));
        (active.is_some() || held.is_some()).then_some((t.weight, t.band, active, held))
    };
    if counted(before) == counted(after) {
        return false;
    }
    for (t, sign) in [(before, -1), (after, 1)] {
        if let Some(slot) = active_slot(t) {
            adjust(record, t, slot, sign);
        }
        move_held(record, t, held_slot(t, tick), sign);
    }
    true
}

/// Holds the tenant to the level at step `tick` (it was refused for its share then: it is
/// counted in this held epoch's held weight, once), or frees it (its weight leaves the held
/// sum it is in, if any). A tenant's held epoch is its last refusal's: `refused_tick / 4`.
fn set_held(record: &mut Record, t: &mut Tenant, held: bool, tick: u8) {
    let slot = held_slot(t, tick);
    if held {
        if !matches!(slot, Some(Slot::Now)) {
            move_held(record, t, slot, -1);
            move_held(record, t, Some(Slot::Now), 1);
        }
        t.held = true;
        t.refused_tick = tick;
    } else if t.held {
        move_held(record, t, slot, -1);
        t.held = false;
    }
}

/// The held sum a held tenant's weight is in at step `tick`: this held epoch's, the last one's,
/// or none (it was last refused earlier, or it is not held).
fn held_slot(t: &Tenant, tick: u8) -> Option<Slot> {
    let (now, last) = (tick / 4 % 4, t.refused_tick / 4 % 4);
    match t.held {
        false => None,
        true if last == now => Some(Slot::Now),
        true if last == (now + 3) % 4 => Some(Slot::Carry),
        true => None,
    }
}

/// Adds (`sign` 1) or takes out (-1) the tenant's weight in its band's held sum `slot`.
fn move_held(record: &mut Record, t: &Tenant, slot: Option<Slot>, sign: i8) {
    let w = u32::from(t.weight);
    let Some(b) = record.bands.get_mut(usize::from(t.band)) else {
        return;
    };
    let sum = match slot {
        Some(Slot::Now) => &mut b.held_now,
        Some(Slot::Carry) => &mut b.held_carry,
        None => return,
    };
    *sum = if sign > 0 {
        sum.saturating_add(w)
    } else {
        sum.saturating_sub(w)
    };
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Now,
    Carry,
}

/// Adds (`sign` 1) or takes out (-1) the tenant's weight in its band's active sums.
fn adjust(record: &mut Record, t: &Tenant, slot: Slot, sign: i8) {
    let w = u32::from(t.weight);
    let Some(b) = record.bands.get_mut(usize::from(t.band)) else {
        return;
    };
    let all = match slot {
        Slot::Now => &mut b.weight_now,
        Slot::Carry => &mut b.weight_carry,
    };
    *all = if sign > 0 {
        all.saturating_add(w)
    } else {
        all.saturating_sub(w)
    };
}

/// Recomputes the bands' budgets and levels from the record, highest band first. Everything is
/// in cost units × [`LEVEL_ONE`], so small capacities are not rounded away.
pub fn step(share: &Share, limit: u64, window_ms: u64, record: &mut Record, now_ms: u64) {
    record.step_ms = now_ms;
    let target = permille(limit.saturating_mul(LEVEL_ONE), share.target_pm);
    let mut used = [0u64; MAX_BANDS];
    let none = sliding_window::State::default();
    for (u, b) in used.iter_mut().zip(&record.bands) {
        *u = recent(&b.used, &none, now_ms, window_ms);
    }
    let reserve = |i: usize| {
        share
            .min_share_pm
            .get(i)
            .map_or(0, |&pm| permille(target, pm))
    };
    // What each band uses or asks for within its reserve: kept for it against higher bands.
    let mut kept = [0u64; MAX_BANDS];
    for (i, (k, b)) in kept.iter_mut().zip(&record.bands).enumerate() {
        let asks = used
            .get(i)
            .copied()
            .unwrap_or(0)
            .saturating_add(b.starved.saturating_mul(LEVEL_ONE));
        *k = asks.min(reserve(i));
    }
    // What each band used or was refused for lately: higher bands' refused demand is kept
    // from lower bands as their use is (a band refused for a capacity lower bands filled would
    // otherwise grow back into it by the headroom alone, a window at a time).
    let mut asked = used;
    for (a, b) in asked.iter_mut().zip(&record.bands) {
        *a = a.saturating_add(b.starved.saturating_mul(LEVEL_ONE));
    }
    let n = record.bands.len();
    for i in 0..n {
        let above = asked.iter().take(i).copied().fold(0, u64::saturating_add);
        let below = kept
            .iter()
            .take(n)
            .skip(i + 1)
            .copied()
            .fold(0, u64::saturating_add);
        let budget = band_budget(n, target, above, below, reserve(i));
        let Some(b) = record.bands.get_mut(i) else {
            continue;
        };
        b.budget = budget;
        let active = b.active_weight();
        let held = b.held_weight();
        let free = recent(&b.used, &b.used_held, now_ms, window_ms);
        let plain = budget / active.max(1);
        let left = budget
            .saturating_sub(free)
            .saturating_sub(b.starved.saturating_mul(LEVEL_ONE));
        b.level = match left.checked_div(held) {
            Some(level) => level.max(plain),
            None if b.starved == 0 => NO_LEVEL,
            None => plain,
        };
        b.starved /= 2;
    }
}

/// What `counter` counted lately, less what `part` (a part of it) did, in cost units ×
/// [`LEVEL_ONE`] a window: the last whole window's count, or this window's so far where it is
/// more (use growing); the sliding window's estimate while there is no last window. Whole
/// counts, not the estimate, which is off by up to a burst whenever requests come in bursts: the
/// steps, a fixed time apart, can read it at the same point of a periodic traffic's cycle each
/// time, and its error then does not average out (a level held that much too low or high).
fn recent(
    counter: &sliding_window::State,
    part: &sliding_window::State,
    now_ms: u64,
    window_ms: u64,
) -> u64 {
    let (now, last) = counter.counts(now_ms, window_ms);
    if last == 0 {
        let estimate = |c: &sliding_window::State| c.usage_in(now_ms, window_ms, LEVEL_ONE);
        return estimate(counter).saturating_sub(estimate(part));
    }
    let (part_now, part_last) = part.counts(now_ms, window_ms);
    let last = last.saturating_sub(part_last);
    let now = now.saturating_sub(part_now);
    last.max(now).saturating_mul(LEVEL_ONE)
}

/// A capacity leased across Envoys, after a [`step`]: a band using its budget of this proxy's
/// part gets a level (the plain share, which the next steps refine) even before anyone is
/// refused here, so that its tenants above it are held before the fleet's quota runs out (the
/// lease's refusals, the fleet's, are not this proxy's share decisions to see).
fn pressed(record: &mut Record, now_ms: u64, window_ms: u64) {
    for b in &mut record.bands {
        let used = b.used.usage_in(now_ms, window_ms, LEVEL_ONE);
        if b.level == NO_LEVEL && b.budget > 0 && used >= b.budget {
            b.level = b.budget / b.active_weight().max(1);
        }
    }
}

#[cfg(test)]
impl Share {
    /// A share for tests: tenants active for 10 s, saturation at 80 %, 97 % handed out, no
    /// ramp; a band for each minimum share of `min_share_pm` (permille), in order.
    pub(crate) fn for_bands(min_share_pm: &[u64]) -> Share {
        let mut pm = [0; MAX_BANDS];
        pm[..min_share_pm.len()].copy_from_slice(min_share_pm);
        Share {
            active_ms: 10_000,
            saturation_pm: 800,
            target_pm: 970,
            bands: min_share_pm.len(),
            min_share_pm: pm,
            ramp_ms: 0,
        }
    }
}

#[cfg(test)]
mod sim_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A record whose refused demand is as large as it can be (a foreign or corrupt one): the
    /// step's sums saturate, they do not wrap.
    #[test]
    fn a_step_over_saturated_refused_demand_does_not_wrap() {
        let share = Share::for_bands(&[0, 0, 0]);
        let mut r = Record::new(3);
        r.bands[0].starved = u64::MAX;
        r.bands[1].starved = u64::MAX;
        step(&share, 1000, 1000, &mut r, 1_000_000);
        assert_eq!(r.step_ms, 1_000_000);
    }

    #[test]
    fn a_leased_part_climbs_while_held_and_is_cut_when_the_fleet_runs_out() {
        let cut = |pm: u16| u16::try_from(u64::from(pm) * PART_CUT_PM / 1000).unwrap();
        let mut r = Record::new(1);
        let lw = (1_000, 1_000); // 1,000 a second
                                 // Granted 300 of the window, then refused: the part is cut from 300 ‰.
        assert!(lease_answered(
            &mut r,
            lw,
            (300, 500, false),
            (10_000, 9_100)
        ));
        assert!(lease_answered(&mut r, lw, (0, 0, true), (10_010, 9_200)));
        let first = cut(300);
        assert_eq!((r.fleet.part_pm, r.fleet.spent), (first, true));
        // A second refusal in the window cuts nothing more.
        lease_answered(&mut r, lw, (0, 0, true), (9_990, 9_300));
        assert_eq!(r.fleet.part_pm, first);
        // A window after a spent one: no climb.
        lease_answered(&mut r, lw, (10, 990, false), (11_000, 10_100));
        assert_eq!((r.fleet.part_pm, r.fleet.spent), (first, false));
        // A window ends unspent while nobody was held: no climb either.
        lease_answered(&mut r, lw, (10, 990, false), (12_000, 11_100));
        assert_eq!(r.fleet.part_pm, first);
        // Held tenants (more demand than the part), an unspent window: it climbs.
        r.bands[0].held_now = 1;
        lease_answered(&mut r, lw, (10, 990, false), (13_000, 12_100));
        assert_eq!(r.fleet.part_pm, first + PART_STEP_PM);
        // A late answer of a window gone counts nothing.
        let before = r.fleet;
        assert!(!lease_answered(&mut r, lw, (50, 0, true), (12_000, 12_200)));
        assert_eq!(r.fleet, before);
        // The fleet runs out again: cut.
        lease_answered(&mut r, lw, (0, 0, true), (13_050, 12_300));
        assert_eq!(r.fleet.part_pm, cut(first + PART_STEP_PM));
        // Climbs at most to the whole.
        r.fleet.part_pm = 995;
        lease_answered(&mut r, lw, (1, 999, false), (14_000, 13_100));
        lease_answered(&mut r, lw, (1, 999, false), (15_000, 14_100));
        assert_eq!(r.fleet.part_pm, 1000);
        assert_eq!(fleet_limit(&r, 1_000, 1_000, 15_500), Some(1_000));
        // Past the window's middle, the fleet granted more than the time elapsed allows (650
        // of 1,000 at 0.55 of the window, over 50 ahead): cut before the quota runs out.
        lease_answered(&mut r, lw, (5, 600, false), (16_000, 15_550));
        assert_eq!(
            (r.fleet.part_pm, r.fleet.spent),
            (1000, false),
            "50 ahead: not yet"
        );
        lease_answered(&mut r, lw, (5, 350, false), (16_000, 15_550));
        assert_eq!((r.fleet.part_pm, r.fleet.spent), (cut(1000), true));
        // Blocks: a tenth of the part, within 1 and the configured cap.
        assert_eq!(lease_block_cap(0, 1_000, 100), 100, "no part yet");
        assert_eq!(lease_block_cap(400, 1_000, 100), 40);
        assert_eq!(lease_block_cap(400, 1_000, 8), 8);
        assert_eq!(lease_block_cap(5, 1_000, 100), 1);
        // Before the middle it is not told (grants come in blocks): no cut.
        lease_answered(&mut r, lw, (5, 100, false), (17_000, 16_300));
        assert_eq!((r.fleet.part_pm, r.fleet.spent), (cut(1000), false));
    }

    #[test]
    fn a_leased_capacity_keeps_the_fleets_last_grants_for_the_higher_bands() {
        // Two bands, batch reserving 10 %; this proxy's part a third of 100 a second.
        let s = Share::for_bands(&[0, 100]); // interactive, batch
        let mut r = Record::new(2);
        let lw = (100, 1_000);
        lease_answered(&mut r, lw, (10, 60, false), (10_000, 9_000));
        r.fleet.part_pm = 333;
        let (mut i, mut b) = (None, None);
        // Interactive used 10 of this proxy's last window: 30 for the fleet's, 15 in the half
        // window left at 9,500.
        for k in 0..10 {
            assert_eq!(ask(&s, &mut r, &mut i, 1, 0, 9_000 + k * 40).refused, None);
        }
        for k in 0..4 {
            assert_eq!(ask(&s, &mut r, &mut b, 1, 1, 9_400 + k).refused, None);
        }
        // The fleet has 60 left: batch asks on.
        assert_eq!(ask(&s, &mut r, &mut b, 1, 1, 9_500).refused, None);
        // The service says 15 are left: batch waits for the next window, interactive does not.
        lease_answered(&mut r, lw, (5, 15, false), (10_000, 9_500));
        assert_eq!(r.fleet.left, 15);
        let d = ask(&s, &mut r, &mut b, 1, 1, 9_500);
        assert_eq!(d.refused, Some(Reason::Band));
        assert_eq!(d.verdict.retry_after_ms, 500);
        assert_eq!(ask(&s, &mut r, &mut i, 1, 0, 9_510).refused, None);
        // A late answer saying more is left changes nothing; 16 left at 9,600 (14 needed) does.
        lease_answered(&mut r, lw, (5, 40, false), (10_000, 9_520));
        assert_eq!(r.fleet.left, 15);
        lease_answered(&mut r, lw, (0, 16, false), (10_000, 9_600));
        assert_eq!(r.fleet.left, 15, "still the least said in the window");
        let d = ask(&s, &mut r, &mut b, 1, 1, 9_900);
        assert_eq!(d.refused, None, "a tenth of a window left: 4 needed");
        // The next window: what is left is the service's again.
        lease_answered(&mut r, lw, (10, 90, false), (11_000, 10_000));
        assert_eq!(r.fleet.left, 90);
        // A batch band within its reserved minimum is never held here.
        let mut r2 = Record::new(2);
        lease_answered(&mut r2, lw, (10, 0, false), (10_000, 9_000));
        r2.fleet.part_pm = 1000;
        let (mut i2, mut b2) = (None, None);
        ask(&s, &mut r2, &mut i2, 1, 0, 9_000);
        assert_eq!(ask(&s, &mut r2, &mut b2, 1, 1, 9_001).refused, None);
        // Nor is anyone when the capacity is not leased.
        let mut r3 = Record::new(2);
        let (mut i3, mut b3) = (None, None);
        ask(&s, &mut r3, &mut i3, 1, 0, 9_000);
        for k in 0..20 {
            assert_eq!(ask(&s, &mut r3, &mut b3, 1, 1, 9_001 + k).refused, None);
        }
    }

    #[test]
    fn a_leased_capacity_keeps_the_fleets_last_grants_for_the_tenants_below_their_shares() {
        let s = Share::for_bands(&[0]);
        let mut r = Record::new(1);
        let lw = (100, 1_000);
        lease_answered(&mut r, lw, (10, 60, false), (10_000, 9_000));
        r.fleet.part_pm = 500;
        let (mut light, mut heavy) = (None, None);
        for k in 0..5 {
            assert_eq!(
                ask(&s, &mut r, &mut light, 1, 0, 9_000 + k * 50).refused,
                None
            );
        }
        // The heavy tenant is held to its share.
        let mut refused = None;
        for k in 0..120 {
            refused = refused.or(ask(&s, &mut r, &mut heavy, 1, 0, 9_000 + k * 4).refused);
        }
        assert_eq!(refused, Some(Reason::Share));
        assert!(heavy.is_some_and(|t| t.held));
        // 5 left for the fleet at 9,500: the light tenant's 5 over the window, doubled for the
        // fleet, halved for the time left (5 needed, and the request): the held one waits.
        lease_answered(&mut r, lw, (1, 5, false), (10_000, 9_500));
        let d = ask(&s, &mut r, &mut heavy, 1, 0, 9_500);
        assert_eq!(
            (d.refused, d.verdict.retry_after_ms),
            (Some(Reason::Share), 500)
        );
        assert_eq!(ask(&s, &mut r, &mut light, 1, 0, 9_501).refused, None);
    }

    const CAPACITY: Policy = Policy::SlidingWindow {
        limit: 100,
        window_ms: 1000,
    };

    fn ask(
        s: &Share,
        r: &mut Record,
        t: &mut Option<Tenant>,
        weight: u16,
        band: u8,
        now: u64,
    ) -> Decision {
        let d = decide(
            s,
            &CAPACITY,
            r,
            t.as_ref(),
            Asker {
                weight,
                band,
                again: false,
                wait_ms: 0,
            },
            now,
            1,
        );
        *t = Some(d.tenant);
        d
    }

    #[test]
    fn a_tenant_is_counted_once_per_epoch_and_leaves_two_epochs_later() {
        let s = Share::for_bands(&[0]);
        let mut r = Record::new(1);
        let (mut a, mut b) = (None, None);
        let t0 = 1_000_000;
        ask(&s, &mut r, &mut a, 3, 0, t0);
        ask(&s, &mut r, &mut a, 3, 0, t0 + 10);
        ask(&s, &mut r, &mut b, 5, 0, t0 + 20);
        assert_eq!(r.bands[0].active_weight(), 8);
        // The next epoch: both still count (carried); a's request moves it to this epoch.
        ask(&s, &mut r, &mut a, 3, 0, t0 + 10_000);
        assert_eq!((r.bands[0].weight_now, r.bands[0].weight_carry), (3, 5));
        // Two epochs on, b (silent) is gone; a changes its weight within the epoch.
        ask(&s, &mut r, &mut a, 3, 0, t0 + 20_000);
        ask(&s, &mut r, &mut a, 7, 0, t0 + 20_001);
        assert_eq!(r.bands[0].active_weight(), 7);
        // Back after a long silence: counted afresh, once.
        ask(&s, &mut r, &mut b, 5, 0, t0 + 90_000);
        ask(&s, &mut r, &mut b, 5, 0, t0 + 90_001);
        assert_eq!(r.bands[0].active_weight(), 5);
    }

    #[test]
    fn the_active_weight_is_exactly_that_of_the_tenants_seen_this_epoch_or_the_last() {
        // Random tenants, weights, bands and silences against a reference: the latest weight
        // of every tenant whose latest request fell in this epoch or the one before.
        let s = Share::for_bands(&[0, 0]);
        let mut r = Record::new(2);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut tenants: Vec<Option<Tenant>> = vec![None; 30];
        let mut last: Vec<Option<(u64, u16, u8)>> = vec![None; 30];
        let mut now = 3_000_000_000u64;
        for _ in 0..20_000 {
            now += next(400);
            let i = next(30) as usize;
            let weight = 1 + next(5) as u16;
            let band = next(2) as u8;
            ask(&s, &mut r, &mut tenants[i], weight, band, now);
            last[i] = Some((now / s.active_ms, weight, band));
            let epoch = now / s.active_ms;
            for b in 0..2u8 {
                let want: u64 = last
                    .iter()
                    .flatten()
                    .filter(|&&(e, _, band)| band == b && e + 1 >= epoch)
                    .map(|&(_, w, _)| u64::from(w))
                    .sum();
                assert_eq!(
                    r.bands[usize::from(b)].active_weight(),
                    want,
                    "band {b} at {now}"
                );
            }
        }
    }

    #[test]
    fn a_refund_takes_back_what_was_counted() {
        let s = Share::for_bands(&[0]);
        let mut r = Record::new(1);
        let mut a = None;
        let t0 = 9_000_000;
        for i in 0..10 {
            ask(&s, &mut r, &mut a, 1, 0, t0 + i);
        }
        let before = (r.clone(), a);
        let d = ask(&s, &mut r, &mut a, 1, 0, t0 + 10);
        assert_eq!(d.refused, None);
        let mut t = d.tenant;
        refund(&CAPACITY, &mut r, &mut t, t0 + 10, t0 + 11, 1);
        assert_eq!(t.usage.current, before.1.unwrap().usage.current);
        assert_eq!(r.bands[0].used.current, before.0.bands[0].used.current);
        assert_eq!(
            r.capacity,
            before.0.capacity.map(|s| match s {
                crate::limiter::State::SlidingWindow(w) =>
                    crate::limiter::State::SlidingWindow(crate::limiter::sliding_window::State {
                        last_ms: t0 + 10,
                        ..w
                    }),
                other => other,
            })
        );
    }

    #[test]
    fn alone_a_tenant_may_use_the_whole_capacity() {
        let s = Share::for_bands(&[0]);
        let mut r = Record::new(1);
        let mut a = None;
        let admitted = (0..150)
            .filter(|i| {
                ask(&s, &mut r, &mut a, 1, 0, 5_000_000 + i)
                    .refused
                    .is_none()
            })
            .count();
        assert_eq!(admitted, 100, "the capacity, no less");
    }

    #[test]
    fn a_tenant_over_its_share_is_refused_with_the_time_its_share_frees() {
        let s = Share::for_bands(&[0]);
        let mut r = Record::new(1);
        let (mut heavy, mut light) = (None, None);
        let t0 = 7_000_000;
        // The heavy tenant takes what it can; the light one comes, is starved, and the level
        // forms at the next step.
        for i in 0..100 {
            ask(&s, &mut r, &mut heavy, 1, 0, t0 + i);
        }
        let d = ask(&s, &mut r, &mut light, 1, 0, t0 + 100);
        assert_eq!(d.refused, Some(Reason::Capacity));
        let later = t0 + 1000 + STEP_MS;
        let d = ask(&s, &mut r, &mut heavy, 1, 0, later);
        assert!(d.share.is_some(), "a level once the capacity was contended");
        // Past the saturation point the heavy one is held to its share (the target, 97, less
        // what the light one uses), refused for it with the time its share frees; the light
        // one, far below its share, passes.
        let mut share_refusals = 0;
        for i in 0..300 {
            let d = ask(&s, &mut r, &mut heavy, 1, 0, later + 1 + i);
            if d.refused == Some(Reason::Share) {
                share_refusals += 1;
                assert!(d.verdict.retry_after_ms > 0 && d.verdict.retry_after_ms <= 1000);
                assert_eq!(d.verdict.limit, d.share.unwrap_or(0));
            }
        }
        assert!(share_refusals > 0);
        let d = ask(&s, &mut r, &mut light, 1, 0, later + 301);
        assert_eq!(d.refused, None, "{d:?}");
        assert!(d.share.is_some_and(|s| s >= 48), "{d:?}");
    }
}
