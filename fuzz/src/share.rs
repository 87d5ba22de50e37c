//! A shared capacity (`ratelimit_core::share`) on arbitrary state and traffic: the record and
//! tenant codecs on arbitrary bytes (never a panic; what decodes encodes back to what decodes
//! the same), then a run of requests from eight tenants against a record that may start as any
//! bytes, with any weights, bands, costs and a clock that may jump back. Checked at every
//! request: no panic; an admitted request was one the capacity's own algorithm admits; the
//! record round-trips; each band's active (and held) weight is at most the weights counted since
//! the run began plus what the starting record held. Between requests, answers of a provider (any
//! numbers, refusals, waits) are folded in (`share::learn`): the capacity in force never rises
//! above the configured one.
//!
//! Input: a byte choosing the record's start, the share's parameters, the capacity's, then
//! requests of eight bytes each.

use crate::Bytes;
use ratelimit_core::limiter::{gcra, Policy};
use ratelimit_core::provider::{Api, Measure, Said};
use ratelimit_core::share::learn::{self, Answer, Learn};
use ratelimit_core::share::{self, Asker, Record, Share, Tenant, MAX_BANDS};

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let start = input.u8();
    let raw = input.bytes(255);
    // The codecs on arbitrary bytes.
    if let Some(r) = Record::decode(raw) {
        assert_eq!(Record::decode(&r.encode()), Some(r));
    }
    if let Some(t) = Tenant::decode(raw) {
        assert_eq!(Tenant::decode(&t.encode()), Some(t));
    }

    let bands = 1 + input.below(MAX_BANDS);
    let mut min_share_pm = [0u64; MAX_BANDS];
    let mut left = 1000u64;
    for m in min_share_pm.iter_mut().take(bands) {
        *m = u64::from(input.u16()) % (left + 1);
        left -= *m;
    }
    let share = Share {
        active_ms: 1 + u64::from(input.u16()) * 100,
        saturation_pm: 500 + u64::from(input.u16()) % 501,
        target_pm: 500 + u64::from(input.u16()) % 501,
        bands,
        min_share_pm,
        ramp_ms: u64::from(input.u16()) * 10,
    };
    let learn = Learn {
        api: Api::OpenAi,
        measure: Measure::Requests,
        window_ms: [1, 60, 3_600][input.below(3)] * 1000,
        hold_ms: 1 + u64::from(input.u16()) * 10,
        ramp_ms: share.ramp_ms,
        max_block_ms: 1 + u64::from(input.u16()) * 10,
        strip: true,
    };
    let limit = 1 + u64::from(input.u32()) % 1_000_000;
    // A rule's window is one of its units (the tenant's entry stores it whole to the second up
    // to 32,767 s and to the minute above, as every unit is).
    let window_ms = [1, 60, 3_600, 86_400, 604_800][input.below(5)] * 1000;
    let capacity = if input.bool() {
        Policy::SlidingWindow { limit, window_ms }
    } else {
        Policy::Gcra(gcra::Params {
            limit,
            window_ms,
            burst: 1 + u64::from(input.u32()) % (limit * 2),
            max_delay_ms: None,
        })
    };
    let mut record = match start % 3 {
        0 => Record::new(bands),
        _ => Record::decode(raw).unwrap_or_else(|| Record::new(bands)),
    };
    let active_at_start: Vec<u64> = record.bands.iter().map(|b| b.active_weight()).collect();
    let held_at_start: Vec<u64> = record.bands.iter().map(|b| b.held_weight()).collect();
    let mut tenants: [Option<Tenant>; 8] = [None; 8];
    let mut registered = [0u64; MAX_BANDS];
    let mut now = 1_700_000_000_000u64 + u64::from(input.u32());
    while !input.is_empty() {
        let who = input.below(8);
        let weight = input.u16();
        let band = input.u8();
        let step = input.u16();
        now = if step & 0x8000 != 0 {
            now.saturating_sub(u64::from(step & 0x7fff))
        } else {
            now.saturating_add(u64::from(step) * 7)
        };
        let cost = u64::from(input.u16()) % (limit + 2);
        if input.below(4) == 0 {
            // What a provider (any upstream) says: it may lower the capacity, never raise it.
            let number = |input: &mut Bytes| match input.below(3) {
                0 => None,
                1 => Some(u64::from(input.u32())),
                _ => Some(u64::from(input.u16()) << input.below(48)),
            };
            let said = Said {
                limit: number(&mut input),
                remaining: number(&mut input),
                reset_in_ms: number(&mut input),
            };
            let answer = Answer {
                said: input.bool().then_some(said),
                refused: input.bool(),
                retry_after_ms: number(&mut input),
            };
            let admitted = now.saturating_sub(u64::from(input.u16()));
            // Fair across a fleet, or this Envoy's alone.
            let fleet = input.bool();
            learn::fold(
                &learn,
                &share,
                &capacity,
                &mut record,
                &answer,
                (admitted, now),
                fleet,
            );
            let (configured, _) = capacity.limit_and_window();
            assert!(learn::limit_in_force(&record, configured, share.ramp_ms, now) <= configured);
            let in_force = learn::policy_in_force(&capacity, &record, &share, now);
            assert!(in_force.limit_and_window().0 <= configured);
            assert!(in_force.burst() <= capacity.burst());
        }
        let before = record.capacity.clone();
        let d = share::decide(
            &share,
            &capacity,
            &mut record,
            tenants[who].as_ref(),
            Asker {
                weight,
                band,
                again: false,
                // A line's wait, from the band byte's high bits (the band is clamped anyway).
                wait_ms: u64::from(band & 0xf0) * 16,
            },
            now,
            cost,
        );
        if d.refused.is_none() {
            // Nothing the capacity's own algorithm would refuse is admitted (a request of no
            // cost takes nothing: under a learned, lower limit a full bucket still admits it).
            assert!(
                cost == 0 || capacity.decide(before.as_ref(), now, cost).0.allowed,
                "{d:?}"
            );
            assert!(d.verdict.allowed);
        } else {
            assert!(!d.verdict.allowed);
        }
        let b = usize::from(d.tenant.band);
        assert!(b < bands, "band {b} of {bands}");
        registered[b] += u64::from(d.tenant.weight);
        tenants[who] = Some(d.tenant);
        assert_eq!(Tenant::decode(&d.tenant.encode()), Some(d.tenant));
        let again = Record::decode(&record.encode()).expect("the record decodes");
        assert_eq!(again, record);
        for (i, band) in record.bands.iter().enumerate() {
            let start = active_at_start.get(i).copied().unwrap_or(0);
            assert!(
                band.active_weight() <= registered[i] + start,
                "band {i}: {} > {} + {start}",
                band.active_weight(),
                registered[i]
            );
            // The held weight counts tenants that asked (by seconds, not by active intervals).
            let held = held_at_start.get(i).copied().unwrap_or(0);
            assert!(band.held_weight() <= registered[i] + held);
        }
    }
}
