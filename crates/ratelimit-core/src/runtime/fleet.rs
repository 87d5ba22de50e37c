//! A fleet-fair shared capacity's reports (`share.fleet: "fair"`, [`crate::share::fair`]): once
//! in each of the capacity's windows, one Envoy's one call to the rule's rate limit service
//! writes what its tenants asked in the window before and its part of the band sums, and reads
//! the fleet's sums of the window before that; the answer becomes the rule's view of the fleet
//! in its fair record ([`crate::share::fair_record`]). The report rides on a claim ahead of need
//! of the rule's lease (one call, the claim's descriptor first: [`super::background`] splits the
//! answer): the first that goes in the window's first half, its first second at most
//! ([`REPORT_WAIT`]), or alone after it; at the window's first tick while the rule has no view
//! that saw the fleet ask anything.
//!
//! The counters are descriptors of the rule's domain: `("fair", rule), ("asked", tenant),
//! ("epoch", k)` and `("fair", rule), ("band", "b.s"), ("epoch", k)` (band `b`, sum `s`: 0
//! demand, 1 free, 2 held weight, 3 active weight), each with its own `hits_addend` (0 to read).
//! A counter's value is its limit less what remains (`current_limit.requests_per_unit −
//! limit_remaining`); a status without a limit says nothing.

use super::Runtime;
use crate::engine::update_fair_record;
use crate::global::{Answer, Claim};
use crate::limiter::lease;
use crate::rls::{self, Each};
use crate::share::fair::Left;
use crate::share::fair_record::{Item, Report};
use crate::store::Store;
use std::sync::atomic::Ordering;

/// A report to send: the rule and what it asks.
pub(crate) type Due = (usize, Report);

/// A window's report waits for a claim ahead of need of its rule's lease to ride on (one call
/// instead of two) until this fraction (1/2) of the window has passed, or [`REPORT_WAIT_MS`],
/// whichever is sooner, then goes alone. The counters it writes are read a window later at the
/// earliest ([`crate::share::fair::READ_LAG`]): still whole.
pub(crate) const REPORT_WAIT: u64 = 2;
/// The longest a report waits for a claim to ride on, ms: the view its answer brings is not
/// held back longer (a minute's window makes one report a minute: little to save).
pub(crate) const REPORT_WAIT_MS: u64 = 1_000;

/// Whether a report may ride on a claim of `block` of its rule's lease at `now_ms`, given what
/// the service's latest answer here said the fleet has left (`left`): while the window it spoke
/// of runs and less than [`lease::NEAR_SHARE`] blocks are left, the claim may be refused, and a
/// service that counts a call's descriptors all or none (or, envoyproxy/ratelimit, none of the
/// others while one is over its limit, answering them `OK` all the same) would lose the
/// report's counters. Once that window ended, or before any answer, a new one has begun.
fn rides(left: Option<Left>, block: u64, now_ms: u64) -> bool {
    left.is_none_or(|l| now_ms >= l.end_ms || l.units >= block.saturating_mul(lease::NEAR_SHARE))
}

impl<S: Store> Runtime<S> {
    /// The reports due at `now_ms`: one per fleet-fair rule whose window turned since its last
    /// report on this Envoy (the fair record says, whichever worker made it), and that either
    /// rides on one of `claims` (the claims ahead of need going at this tick, [`rides`]) or
    /// waited for one long enough ([`REPORT_WAIT`]).
    pub(crate) fn fair_reports(&self, now_ms: u64, claims: &[(Vec<u8>, Claim)]) -> Vec<Due> {
        let mut due = Vec::new();
        for (i, (rule, c)) in self.config.rules.iter().zip(&self.compiled).enumerate() {
            let Some(sh) = rule.share.as_ref().filter(|_| rule.global.is_some()) else {
                continue;
            };
            if !sh.fleet_fair {
                continue;
            }
            let window_ms = c.policy.limit_and_window().1.max(1);
            let epoch = now_ms / window_ms;
            let bands = sh.params.bands;
            let block = claims
                .iter()
                .find(|(_, claim)| claim.target.rule == i)
                .map(|(_, claim)| claim.block);
            // A report the service did not count goes again at once.
            let again = c.fair_again.swap(false, Ordering::Relaxed);
            let ready = again
                || block.is_some_and(|block| rides(c.fair_left(), block, now_ms))
                || now_ms % window_ms >= (window_ms / REPORT_WAIT).min(REPORT_WAIT_MS)
                // Without a view in force that saw the fleet ask anything, at once: its
                // answer may bring the first.
                || !self.fair_view_fresh(c, now_ms)
                || c.fair_use.load(Ordering::Relaxed) == 0;
            let made = update_fair_record(&self.store, c.fair_record(), bands, |r| {
                // Without a report of the window before, at once: what a tenant asked in this
                // window so far is not what it asks in one (this Envoy's part would be too
                // small, and with it the blocks).
                let go = ready || r.reported.saturating_add(1) < epoch;
                let due = go && r.reported < epoch;
                if r.dither == 0 {
                    r.dither = self.fair_dither;
                }
                let report = if go { r.report(bands, epoch) } else { None };
                ((report, Known::of(r)), due)
            });
            let Some((report, known)) = made else {
                continue;
            };
            // What this runtime knows of the record, as another worker's answer may have left
            // it (in the wasm build each worker has its own runtime).
            self.fair_known(i, known, now_ms);
            let Some(report) = report else {
                continue;
            };
            due.push((i, report));
        }
        due
    }

    /// The `RateLimitRequest` of `report`, rule `rule`'s, alone.
    pub(crate) fn report_message(&self, rule: usize, report: &Report) -> Vec<u8> {
        let Some(g) = self.global_of(rule) else {
            return Vec::new();
        };
        let mut message = rls::encode_request_each(&g.domain, &[]);
        self.ride(&mut message, rule, report);
        message
    }

    /// `report`'s counters, rule `rule`'s, appended to `claim`, the message of a claim of the
    /// rule's lease (same domain): one call instead of two. The claim's block counts by the
    /// request's `hits_addend`, each counter by its own ([`rls::append_each`]). Appended to a
    /// request with no descriptor, the report alone ([`Runtime::report_message`]).
    pub(crate) fn ride(&self, claim: &mut Vec<u8>, rule: usize, report: &Report) {
        if let Some(r) = self.config.rules.get(rule) {
            append_report(claim, &r.name, report);
        }
    }

    /// The service did not count `report`, rule `rule`'s (it rode on a claim the service
    /// refused whole): the window is to be reported again, at the next tick.
    pub(crate) fn fair_unreported(&self, rule: usize, report: &Report) {
        let (Some(c), Some(sh)) = (
            self.compiled.get(rule),
            self.config.rules.get(rule).and_then(|r| r.share.as_ref()),
        ) else {
            return;
        };
        update_fair_record(&self.store, c.fair_record(), sh.params.bands, |r| {
            ((), r.unreported(report.epoch))
        });
        c.fair_again.store(true, Ordering::Relaxed);
    }

    /// The service's answer to `report`, rule `rule`'s: written into its fair record.
    pub(crate) fn fair_answered(&self, rule: usize, report: &Report, answer: &Answer) {
        let (Some(r), Some(c)) = (self.config.rules.get(rule), self.compiled.get(rule)) else {
            return;
        };
        let Some(sh) = r.share.as_ref() else {
            return;
        };
        let Ok(answer) = answer else {
            return; // the view ages; a stale one is dropped (share::fair::MAX_STALE)
        };
        // One status per descriptor, in order, or none is believed (a service answering one
        // per counter it matched would shift them); a counter with nothing remaining is
        // saturated, its value unknown.
        let whole = answer.statuses.len() == report.items.len();
        let values: Vec<Option<u64>> = report
            .items
            .iter()
            .enumerate()
            .map(|(i, (item, _))| {
                let s = answer.statuses.get(i).filter(|_| whole)?;
                let limit = u64::from(s.requests_per_unit?);
                let value = limit.checked_sub(u64::from(s.limit_remaining))?;
                (s.limit_remaining > 0).then(|| from_wire(item, value))
            })
            .collect();
        let (limit, window_ms) = c.policy.limit_and_window();
        let now_ms = report.epoch.saturating_mul(window_ms.max(1));
        // The fleet's level shares the capacity in force: the configured one, or less where
        // the provider said less (`share.learn`: every replica reads the same account's
        // answers, so every replica lowers it alike).
        let limit = self.limit_in_force(c, sh, now_ms).unwrap_or(limit);
        let read = update_fair_record(&self.store, c.fair_record(), sh.params.bands, |f| {
            f.answered(&sh.params, limit, report, &values);
            (Known::of(f), true)
        });
        let Some(known) = read else {
            return;
        };
        self.fair_known(rule, known, now_ms);
    }

    /// A shared rule's capacity in force at `now_ms` as its record says (lowered to what the
    /// provider said, `share.learn`); `None` for a rule that learns nothing, or a store that
    /// cannot say.
    pub(super) fn limit_in_force(
        &self,
        c: &super::Compiled,
        sh: &crate::config::ShareConfig,
        now_ms: u64,
    ) -> Option<u64> {
        sh.learn?;
        crate::engine::update_share_record(&self.store, c.share_record(), None, |r| {
            let in_force = crate::share::learn::policy_in_force(&c.policy, r, &sh.params, now_ms);
            (in_force.limit_and_window().0, false)
        })
    }

    /// Takes what the fair record says into `c`'s copies; once the view is in force, the
    /// part this proxy learned while it had none is dropped from the rule's record.
    fn fair_known(&self, rule: usize, known: Known, now_ms: u64) {
        let Known {
            view,
            part,
            reserved,
            fleet_use,
        } = known;
        let (Some(c), Some(sh)) = (
            self.compiled.get(rule),
            self.config.rules.get(rule).and_then(|r| r.share.as_ref()),
        ) else {
            return;
        };
        let was_fresh = self.fair_view_fresh(c, now_ms);
        let part = part.unwrap_or(u64::MAX);
        let view = view.unwrap_or(u64::MAX);
        let was_part = c.fair_part.swap(part, Ordering::Relaxed);
        let was_view = c.fair_view.swap(view, Ordering::Relaxed);
        if (was_part, was_view) != (part, view) {
            // The blocks follow them: the cap kept is to be worked out again.
            c.fair_cap_until.store(0, Ordering::Relaxed);
        }
        c.fair_reserved.store(reserved, Ordering::Relaxed);
        c.fair_use.store(fleet_use, Ordering::Relaxed);
        if !was_fresh && self.fair_view_fresh(c, now_ms) {
            // The fleet's view is in force: the part this proxy learned while it had none
            // (sharing locally, as a rule of `share.fleet: "local"`) no longer bounds it.
            let bands = Some(sh.params.bands);
            crate::engine::update_share_record(&self.store, c.share_record(), bands, |r| {
                let had = r.fleet != crate::share::Fleet::default();
                r.fleet = crate::share::Fleet::default();
                ((), had)
            });
            c.part_pm.store(0, Ordering::Relaxed);
        }
    }

    /// Whether a fleet-fair rule's view of the fleet is recent enough to use at `now_ms`
    /// ([`crate::share::fair::View::fresh`]): while it is not (the service never answered its
    /// counters, or not lately), the rule shares its Envoy's part locally, as a rule of
    /// `share.fleet: "local"` does.
    pub(super) fn fair_view_fresh(&self, c: &super::Compiled, now_ms: u64) -> bool {
        let view = c.fair_view.load(Ordering::Relaxed);
        let window_ms = c.policy.limit_and_window().1.max(1);
        view != u64::MAX
            && (now_ms / window_ms).saturating_sub(view) <= crate::share::fair::MAX_STALE
    }
}

/// What a runtime copies of its fair record ([`super::Compiled`]'s `fair_*` fields).
struct Known {
    /// The epoch of the record's view.
    view: Option<u64>,
    /// What this Envoy expects to admit a window.
    part: Option<u64>,
    /// The most any band keeps for others.
    reserved: u64,
    /// What the fleet is expected to admit a window.
    fleet_use: u64,
}

impl Known {
    fn of(r: &crate::share::fair_record::FairRecord) -> Known {
        Known {
            view: r.view.epoch,
            part: r.part,
            reserved: r.view.most_reserved(),
            fleet_use: r.fleet_use,
        }
    }
}

/// `report`'s counters, rule `rule`'s, appended to the `RateLimitRequest` `message`.
fn append_report(message: &mut Vec<u8>, rule: &str, report: &Report) {
    let texts: Vec<(&'static str, String, String)> = report
        .items
        .iter()
        .map(|(item, _)| match item {
            Item::Asked { id, epoch } => ("asked", hex16(*id), decimal(*epoch)),
            Item::Band { band, sum, epoch } => {
                let mut v = decimal(u64::from(*band));
                v.push('.');
                crate::headers::push_u64(&mut v, u64::from(*sum));
                ("band", v, decimal(*epoch))
            }
        })
        .collect();
    let entries: Vec<[(&str, &[u8]); 3]> = texts
        .iter()
        .map(|(kind, value, epoch)| {
            [
                ("fair", rule.as_bytes()),
                (*kind, value.as_bytes()),
                ("epoch", epoch.as_bytes()),
            ]
        })
        .collect();
    let each: Vec<Each<'_>> = entries
        .iter()
        .zip(&report.items)
        .map(|(e, (item, hits))| Each {
            entries: e,
            hits: to_wire(item, *hits),
        })
        .collect();
    rls::append_each(message, &each);
}

/// `n` in decimal.
fn decimal(n: u64) -> String {
    let mut s = String::with_capacity(20);
    crate::headers::push_u64(&mut s, n);
    s
}

/// `n` as 16 lower-case hexadecimal digits.
fn hex16(n: u64) -> String {
    (0..16)
        .rev()
        .map(|i| {
            let d = (n >> (i * 4)) & 0xf;
            char::from_digit(d as u32, 16).unwrap_or('0')
        })
        .collect()
}

/// The weights of the band sums are kept in millionths ([`crate::share::fair::ONE`]) and sent in
/// thousandths ([`fair_record::WEIGHT_UNIT`]; the record rounds what it adds to them).
const WIRE: u64 = crate::share::fair_record::WEIGHT_UNIT;

/// Whether `item` counts weights (sums 2 and 3 of a band).
fn weighs(item: &Item) -> bool {
    matches!(item, Item::Band { sum: 2 | 3, .. })
}

/// What `item`'s counter is sent for `hits`.
fn to_wire(item: &Item, hits: u64) -> u64 {
    if weighs(item) {
        hits / WIRE
    } else {
        hits
    }
}

/// What `item`'s counter, read as `value`, holds in the record's units.
fn from_wire(item: &Item, value: u64) -> u64 {
    if weighs(item) {
        value.saturating_mul(WIRE)
    } else {
        value
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests;
