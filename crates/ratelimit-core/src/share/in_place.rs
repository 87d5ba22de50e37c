//! The request of a shared capacity that nobody contends, admitted in its record's bytes: what
//! [`super::decide`] does when it changes nothing of the record but the capacity's state and the
//! band's use, without decoding the whole record and encoding it again (80 bytes and 80 a band;
//! this reads the header's few fields and the bands' sums, and writes two fields). Any other
//! request (a level holding its tenant, a step, an epoch's turn, a tenant not yet counted in
//! this epoch, a refusal...) goes to [`super::decide`], which decides it from the whole record;
//! the tests compare the two.

use super::state::RecordView;
use super::{
    band_verdict, fleet_part, fleet_reserved, level_holds, Asker, Decision, Share, Tenant, HELD_MS,
    LEVEL_ONE, MAX_BANDS, NO_LEVEL, STEP_MS,
};
use crate::limiter::{sliding_window, Policy};

/// Decides in `bytes` (a record [`super::Record::encode`] wrote) a request of `cost` at
/// `now_ms` from `asker`, whose entry is `tenant`, when [`super::decide`] would admit it and
/// change nothing of the record but the capacity's state and the band's use: the record of the
/// share's bands, nothing learned from the provider and the provider not refusing, no level step
/// and no turn of the active or held epochs due, the tenant counted in this epoch with its
/// weight and band and not held to a share, no level holding it, and the capacity, the band's
/// budget and (leased) the fleet's window admitting it. Returns [`super::decide`]'s decision,
/// the bytes as it and [`super::Record::encode`] would leave them; `None`, the bytes untouched,
/// for any other request.
pub fn admit(
    share: &Share,
    capacity: &Policy,
    bytes: &mut [u8],
    tenant: Option<&Tenant>,
    asker: Asker,
    (now_ms, cost): (u64, u64),
) -> Option<Decision> {
    let n = share.bands.clamp(1, MAX_BANDS);
    let mut record = RecordView::of(bytes, n)?;
    let band = usize::from(asker.band).min(n - 1);
    let mut t = *tenant?;
    let epoch = u32::try_from(now_ms / share.active_ms.max(1)).ok()?;
    let quiet = record.learned_limit() == 0
        && now_ms >= record.blocked_until_ms()
        && record.epoch() == epoch
        && record.held_epoch() == (now_ms / HELD_MS) as u16
        && (record.step_ms()..record.step_ms().saturating_add(STEP_MS)).contains(&now_ms)
        && (t.weight, usize::from(t.band), t.epoch, t.held)
            == (asker.weight.max(1), band, epoch as u16, false);
    if !quiet {
        return None;
    }
    let (limit, window_ms) = capacity.limit_and_window();
    let window_ms = window_ms.max(1);
    if t.usage.window_ms == 0 {
        t.usage.window_ms = u32::try_from(window_ms).unwrap_or(u32::MAX);
    }
    let (used, level) = record.used_and_level(band)?;
    // One band and no level (the usual request): neither the other bands, nor this proxy's part
    // of a leased capacity, nor the fleet's window (which keeps nothing back from band 0's
    // tenants not held) has a say.
    let share_now = if n == 1 && level == NO_LEVEL {
        None
    } else {
        let all = record.bands();
        let at = (now_ms, window_ms);
        // Leased across Envoys: this proxy's part, and the fleet's window keeping nothing back.
        let fleet = record.fleet();
        let leased = fleet_part(&fleet, limit, window_ms, now_ms);
        let part = leased.unwrap_or(limit);
        if let Some(part) = leased {
            let kept = (limit, limit, part);
            if fleet_reserved(share, (&fleet, &all), (band, false), kept, at, cost).is_some() {
                return None;
            }
        }
        let v_band = band_verdict(share, capacity, (&all, band), part, at, cost);
        if v_band.is_some_and(|v| !v.allowed) {
            return None;
        }
        // A level left from a contended moment that holds nobody (the capacity below its
        // saturation point, or the tenant idle); one that holds the tenant: the share decides.
        match level {
            NO_LEVEL => None,
            _ if level_holds(share, (&all, &t), part, at, cost) => return None,
            level => Some(
                level
                    .saturating_mul(u64::from(t.weight))
                    .div_ceil(LEVEL_ONE),
            ),
        }
    };
    let (verdict, next) = capacity.decide(record.capacity()?.as_ref(), now_ms, cost);
    if !verdict.allowed {
        return None;
    }
    record.set_capacity(next.as_ref());
    record.set_used(band, &sliding_window::add(used, now_ms, window_ms, cost));
    t.usage = sliding_window::add(t.usage, now_ms, window_ms, cost);
    Some(Decision {
        verdict,
        refused: None,
        tenant: t,
        share: share_now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra;
    use crate::share::{decide, Record};
    use crate::testkit::Rng;

    /// Tenants of weights 1 to 3 in one band, two or three ask a capacity (a sliding window, a token
    /// bucket) at random costs and times, in turns of light and heavy demand, some asking again,
    /// while the provider's limit is learned, it refuses everyone, or the capacity is leased
    /// (this proxy's part set): each request decided here, if at all, as [`decide`] decides it
    /// from the decoded record, the bytes as it leaves the record, encoded; else untouched.
    #[test]
    fn a_request_admitted_in_place_is_decided_and_written_as_the_whole_record_decides_it() {
        let capacities = [
            Policy::SlidingWindow {
                limit: 600,
                window_ms: 1000,
            },
            Policy::Gcra(gcra::Params {
                limit: 400,
                window_ms: 1000,
                burst: 120,
                max_delay_ms: None,
            }),
        ];
        let (mut hits, mut banded, mut general_admitted, mut refused) = (0, 0, 0, 0);
        for (seed, capacity) in (1..=12u64).zip(capacities.iter().cycle()) {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let bands = 1 + (seed % 3) as usize;
            let share = Share::for_bands(&[0, 300, 200][..bands]);
            let mut bytes = Record::new(bands).encode().to_vec();
            let mut tenants: Vec<Option<Tenant>> = vec![None; 8];
            let mut now = 1_000_000u64 + rng.below(10_000);
            for i in 0..6_000u64 {
                // Heavy demand for a few seconds in every ten: levels, holds, refusals.
                let heavy = (i / 400) % 3 == 2;
                now += rng.below(if heavy { 2 } else { 20 });
                let mut record = Record::decode(&bytes).unwrap();
                match rng.below(400) {
                    0 => {
                        record.learned_limit = 300 + rng.below(400);
                        record.learned_until_ms = now + rng.below(3000);
                    }
                    1..=8 => record.learned_limit = 0,
                    9 => record.blocked_until_ms = now + rng.below(500),
                    10..=12 => {
                        record.fleet.part_pm = 200 + rng.below(800) as u16;
                        record.fleet.window_end_ms = now + rng.below(1000);
                        record.fleet.left = rng.below(1000) as u32;
                    }
                    _ => {}
                }
                bytes = record.encode().to_vec();
                // Two tenants of the eight rarely ask; a tenant's weight changes now and then.
                let who = match rng.below(100) {
                    0 => 6,
                    1 => 7,
                    n => (n % 6) as usize,
                };
                let weight = match rng.below(50) {
                    0 => 1 + rng.below(3) as u16,
                    _ => 1 + (who % 3) as u16,
                };
                let asker = Asker {
                    weight,
                    band: (who % bands) as u8,
                    again: rng.below(10) == 0,
                    wait_ms: 0,
                };
                let cost = 1 + rng.below(3);
                // Another worker's clock, a few ms behind.
                let now = now.saturating_sub(rng.below(4) / 3 * rng.below(30));
                let tenant = tenants[who];
                let mut whole = record.clone();
                let d = decide(
                    &share,
                    capacity,
                    &mut whole,
                    tenant.as_ref(),
                    asker,
                    now,
                    cost,
                );
                let written = whole.encode().to_vec();
                let mut here = bytes.clone();
                let at = (now, cost);
                match admit(&share, capacity, &mut here, tenant.as_ref(), asker, at) {
                    Some(fast) => {
                        assert_eq!(fast, d, "seed {seed}, request {i}");
                        assert_eq!(here, written, "seed {seed}, request {i}");
                        hits += 1;
                        banded += usize::from(bands > 1);
                    }
                    None => {
                        assert_eq!(here, bytes, "untouched: seed {seed}, request {i}");
                        if d.refused.is_none() {
                            general_admitted += 1;
                        } else {
                            refused += 1;
                        }
                    }
                }
                bytes = written;
                tenants[who] = Some(d.tenant);
            }
        }
        // Both ways taken often: the comparison means something.
        assert!(hits > 10_000, "{hits} admitted in place");
        assert!(banded > 5_000, "{banded} of them in two bands or three");
        assert!(
            general_admitted > 2_000,
            "{general_admitted} admitted by the whole record"
        );
        assert!(refused > 2_000, "{refused} refused");
        eprintln!(
            "{hits} admitted in place ({banded} in two or three bands), {general_admitted} by the whole record, {refused} refused"
        );
    }

    /// [`admit`] of a request, checked against [`decide`] when it decides it.
    fn compared(record: &Record, tenant: Tenant, share: &Share, at: (u64, u64)) -> bool {
        let capacity = Policy::SlidingWindow {
            limit: 100,
            window_ms: 1000,
        };
        let asker = Asker {
            weight: tenant.weight,
            band: 0,
            again: false,
            wait_ms: 0,
        };
        let mut bytes = record.encode().to_vec();
        let Some(d) = admit(share, &capacity, &mut bytes, Some(&tenant), asker, at) else {
            assert_eq!(bytes, record.encode().to_vec(), "untouched");
            return false;
        };
        let mut whole = record.clone();
        let (now, cost) = at;
        let expected = decide(
            share,
            &capacity,
            &mut whole,
            Some(&tenant),
            asker,
            now,
            cost,
        );
        assert_eq!((d, bytes), (expected, whole.encode().to_vec()));
        true
    }

    /// The cases the random comparison meets too seldom: a record of another band count than
    /// the share's (its configuration changed), a tenant's band out of the share's, a record
    /// counted in a later epoch than the request's clock, and a tenant that used nothing over
    /// the window asking while a level is set above the saturation point.
    #[test]
    fn the_edges_of_a_request_admitted_in_place() {
        let share = Share::for_bands(&[0]);
        let now = 1_000_500;
        let mut record = Record::new(1);
        record.epoch = (now / share.active_ms) as u32;
        record.held_epoch = (now / HELD_MS) as u16;
        record.step_ms = now - 10;
        let tenant = Tenant {
            weight: 1,
            epoch: record.epoch as u16,
            ..Tenant::default()
        };
        assert!(compared(&record, tenant, &share, (now, 1)), "quiet");
        assert!(
            !compared(&record, tenant, &Share::for_bands(&[0, 300]), (now, 1)),
            "bands"
        );
        let banded = Tenant { band: 1, ..tenant };
        assert!(
            !compared(&record, banded, &share, (now, 1)),
            "the tenant's band"
        );
        let mut ahead = record.clone();
        ahead.epoch += 1;
        let counted = Tenant {
            epoch: ahead.epoch as u16 - 1,
            ..tenant
        };
        assert!(
            !compared(&ahead, counted, &share, (now, 1)),
            "a later epoch"
        );
        // A level from a contended moment; 85 of 100 used (saturation at 80).
        let mut busy = record.clone();
        busy.bands[0].level = 10 * LEVEL_ONE;
        busy.bands[0].used = sliding_window::add(busy.bands[0].used, now - 5, 1000, 85);
        busy.capacity = Some(crate::limiter::State::SlidingWindow(busy.bands[0].used));
        assert!(
            compared(&busy, tenant, &share, (now, 1)),
            "idle: the level holds nobody"
        );
        let used = Tenant {
            usage: sliding_window::add(sliding_window::State::default(), now - 5, 1000, 3),
            ..tenant
        };
        assert!(
            !compared(&busy, used, &share, (now, 1)),
            "the share decides"
        );
        let mut calm = record.clone();
        calm.bands[0].level = busy.bands[0].level;
        assert!(
            compared(&calm, used, &share, (now, 1)),
            "below the saturation point"
        );
    }
}
