//! Lease rules (`global.mode: "lease"`) on the request path and in the background: what a
//! request's lease check becomes when this proxy holds too little (a claim the request waits
//! for), a claim ahead of need when the key runs low (sent by [`super::Background`]), and what
//! the service's answers do to the key's lease ([`crate::limiter::lease`]).

use super::request::{Applied, Claimed, Debt, DebtKind, Pending, ServiceReport};
use super::Runtime;
use crate::config::GlobalMode;
use crate::engine::{self, Check};
use crate::error::ServiceError;
use crate::global::{self, Answer, Claim, Question, Target};
use crate::key::{Attributes, Descriptor};
use crate::limiter::lease::{self, Grant, Peek};
use crate::limiter::Policy;
use crate::metrics::Counter;
use crate::rls;
use crate::share;
use crate::store::Store;
use std::sync::PoisonError;

/// A request's lease claim refused at the turn of the service's window is made again at most
/// this many times ([`Runtime::reclaim`]).
pub const TURN_ASKS: usize = 3;

/// A fleet-fair rule's block cap, once worked out, is kept for this fraction (1/64) of its
/// window ([`Runtime::block_cap`]).
const CAP_SLICES: u64 = 64;

impl<S: Store> Runtime<S> {
    /// Before a request is decided: each lease check whose key holds too little here becomes
    /// a claim the request waits for, and a sync rule's check (one whose reservation waited
    /// for the body to be sized) becomes its question. A key running low gets a claim ahead of
    /// need. Returns whether there are questions to ask. `host` reads the request for the
    /// descriptors of those calls (only they build one); `now_ms`: the clock.
    pub fn promote(&self, p: &mut Pending, host: &mut impl Attributes, now_ms: u64) -> bool {
        let mut i = 0;
        while let (Some(check), Some(applied)) = (p.checks.get(i), p.applied.get_mut(i)) {
            let rule = applied.rule;
            let Some(g) = self.config.rules.get(rule).and_then(|r| r.global.as_ref()) else {
                i += 1;
                continue;
            };
            let claim = match (g.mode, &check.policy) {
                (GlobalMode::Sync, _) => None,
                (
                    GlobalMode::Lease,
                    Policy::Lease {
                        max_block, limit, ..
                    },
                ) => {
                    let target = Target::of(rule, check);
                    // Near the end of a fleet-fair rule's window: the fleet's rest is kept for
                    // the tenants under their shares.
                    let mut cap = self.block_cap(applied, *limit, *max_block, now_ms);
                    let keeping = applied
                        .capacity
                        .then(|| self.fair_keeping(&p.shares, rule, (check.cost, cap), now_ms))
                        .flatten();
                    if let Some(k) = keeping {
                        cap = cap.min(k.most).max(1);
                    }
                    let cost = (check.cost, keeping);
                    match self.lease_peek(target, cost, cap, now_ms, applied, host) {
                        Some(block) => Some(Claim {
                            target,
                            block,
                            sent_ms: now_ms,
                            last: false,
                        }),
                        None => {
                            if let (
                                Some(k),
                                Some(Check {
                                    policy: Policy::Lease { kept, .. },
                                    ..
                                }),
                            ) = (keeping, p.checks.get_mut(i))
                            {
                                *kept = k.kept;
                            }
                            i += 1;
                            continue;
                        }
                    }
                }
                _ => {
                    i += 1;
                    continue;
                }
            };
            let Some(entries) = self.describe(applied, host) else {
                // No descriptor: decided here (a claim started comes to nothing).
                if let Some(c) = &claim {
                    self.claim_lost(c, now_ms);
                }
                i += 1;
                continue;
            };
            let hits = claim.map_or(check.cost, |c| c.block);
            let message = global::request(&g.domain, entries, hits);
            let (check, applied) = p.take_check(i);
            if claim.is_some() {
                self.metrics.add(rule, Counter::LeaseClaims, 1);
                if applied.capacity {
                    p.lent.push((p.questions.len(), check));
                }
            }
            p.questions.push(Question {
                rule,
                hash: applied.hash,
                cost: if check.charge_later { 0 } else { check.cost },
                message,
                claim,
                retried: false,
            });
            p.answers.push(None);
            p.asked.push(applied);
        }
        !p.questions.is_empty()
    }

    /// A lease's view of a request of `cost`: `Some(block)` to claim now, `None` when what is
    /// held decides (covered, or refused by the service). A key running low gets a claim ahead
    /// of need, sent at the next tick (its descriptor built for it). Near the end of a
    /// fleet-fair rule's window (`keeping`), what the request may not take of what is held
    /// counts as its own need, and it claims only if what it may claim covers what is missing.
    fn lease_peek(
        &self,
        target: Target,
        (cost, keeping): (u64, Option<share::fair::Keeping>),
        cap: u64,
        now_ms: u64,
        applied: &mut Applied,
        host: &mut impl Attributes,
    ) -> Option<u64> {
        let kept = keeping.map_or(0, |k| k.kept);
        let need = cost.saturating_add(kept);
        let rule = applied.rule;
        let peeked = self.update_lease(target, now_ms, |state| {
            match lease::State::peek(state, now_ms, need, cap) {
                Peek::Covered { low: true } => {
                    let s = state.copied().unwrap_or_default().at(now_ms);
                    let (next, block) = s.start_claim(now_ms, (cap, cost), true);
                    ((Peek::Covered { low: true }, block), Some(next))
                }
                Peek::Claim => {
                    let s = state.copied().unwrap_or_default().at(now_ms);
                    // Kept for others: a block of what is missing, if it may claim that much.
                    let short = match keeping {
                        None => cost,
                        Some(k) => {
                            let short = need.saturating_sub(u64::try_from(s.held).unwrap_or(0));
                            if short > k.most {
                                return ((Peek::Refused, 0), None);
                            }
                            short
                        }
                    };
                    // A fleet-fair rule's Envoy claims no more than its part: a request's
                    // claim on its way holds the others back.
                    let held_back = self.fleet_fair(rule);
                    let (next, block) = s.start_request_claim(now_ms, (cap, short), held_back);
                    ((Peek::Claim, block.max(short)), Some(next))
                }
                peek => ((peek, 0), None),
            }
        });
        match peeked {
            Some((Peek::Covered { low: true }, block)) => {
                self.start_ahead(target, block, applied, host, now_ms);
                None
            }
            Some((Peek::Claim, block)) => Some(block),
            // Refused, covered, or a store that cannot tell: the lease check decides.
            _ => None,
        }
    }

    /// A lone shared rule's lease on the short path ([`super::shared`]): looks at what this
    /// proxy holds for a request of `check`'s cost, as [`Runtime::promote`] does (a claim
    /// ahead of need started where it runs low), and takes the cost at once in the same update
    /// if `take` and plenty is held (not low, the service not refusing the key: a request the
    /// shares then refuse gives it back, and another worker meanwhile must not find too little).
    /// Whether it took the cost, and when the quota it took from lapses (only what is still
    /// that window's may be given back); `None` when what is held does not cover the request
    /// (it must claim, or the service refused the key), when a fleet-fair rule's bands keep
    /// some of it for others near the window's end (`share`: the request's shared check), or
    /// when the store cannot tell: nothing written but a corrupt bucket reset, the general path
    /// decides.
    pub(super) fn take_leased(
        &self,
        (check, share): (&Check, &engine::Shared),
        applied: &mut Applied,
        host: &mut impl Attributes,
        (now_ms, take): (u64, bool),
    ) -> Option<(bool, u64)> {
        let Policy::Lease {
            limit, max_block, ..
        } = check.policy
        else {
            return None;
        };
        let target = Target::of(applied.rule, check);
        // The block cap is worked out only where it decides: every cap is at most `max_block`,
        // and neither what the bands keep nor a lease running low can hold under a larger one
        // where they do not under it.
        let most = max_block.max(1);
        let cap = std::cell::Cell::new(None);
        let cap_of = || {
            let c = cap
                .get()
                .unwrap_or_else(|| self.block_cap(applied, limit, max_block, now_ms));
            cap.set(Some(c));
            c
        };
        let shares = std::slice::from_ref(share);
        let keeps = |block| {
            self.fair_keeping(shares, applied.rule, (check.cost, block), now_ms)
                .is_some()
        };
        if share.1.fleet.is_some() && keeps(most) && keeps(cap_of()) {
            return None;
        }
        let looked = self.update_lease(target, now_ms, |state| {
            let peek = |cap| lease::State::peek(state, now_ms, check.cost, cap);
            let low = match peek(most) {
                Peek::Covered { low: false } => false,
                Peek::Covered { low: true } => match peek(cap_of()) {
                    Peek::Covered { low } => low,
                    _ => return (None, None),
                },
                _ => return (None, None),
            };
            let s = state.copied().unwrap_or_default().at(now_ms);
            if take && !low && !s.refused {
                return match lease::take(state, now_ms, check.cost) {
                    Some(next) => (Some((true, s.expires_ms, None)), next),
                    None => (None, None),
                };
            }
            if !low {
                return (Some((false, s.expires_ms, None)), None);
            }
            let (next, block) = s.start_claim(now_ms, (cap_of(), check.cost), true);
            (Some((false, s.expires_ms, Some(block))), Some(next))
        });
        let (took, expires_ms, ahead) = looked.flatten()?;
        if let Some(block) = ahead {
            self.start_ahead(target, block, applied, host, now_ms);
        }
        Some((took, expires_ms))
    }

    /// A request found `target`'s lease running low and started a claim ahead of need of
    /// `block` in it: the claim is queued with its descriptor (built now from the request,
    /// which `applied` keeps for its rule's other calls).
    fn start_ahead(
        &self,
        target: Target,
        block: u64,
        applied: &mut Applied,
        host: &mut impl Attributes,
        now_ms: u64,
    ) {
        let claim = Claim {
            target,
            block,
            sent_ms: now_ms,
            last: false,
        };
        let hash = applied.hash;
        let entries = self.describe(applied, host);
        self.claim_ahead(hash, entries, claim, now_ms);
    }

    /// Gives a request's cost back to the lease [`Runtime::take_leased`] took it from (the
    /// shares refused the request), if the quota it took from (lapsing at `expires_ms`) is
    /// still what the lease holds.
    pub(super) fn give_back_leased(
        &self,
        check: &Check,
        rule: usize,
        (now_ms, expires_ms): (u64, u64),
    ) {
        let target = Target::of(rule, check);
        self.update_lease(target, now_ms, |state| {
            // Not into a later window's quota (the window it was taken from turned, and a
            // grant of the next came meanwhile): what was taken lapsed with its window. Its
            // end may have moved by a closer estimate of the same window's meanwhile.
            let same = state
                .copied()
                .filter(|s| lease::same_window(s.expires_ms, expires_ms));
            ((), lease::refund(same, now_ms, check.cost))
        });
    }

    /// A shared capacity's lease refused a waiting request's turn (`check`, as its rule made
    /// it: `applied`): a claim ahead of need, if one is due ([`lease::State::wake`]), so that
    /// the line's next turns find quota without a new request to claim it.
    pub(super) fn wake_lease(&self, check: &Check, applied: &Applied, now_ms: u64) {
        let Policy::Lease {
            max_block, limit, ..
        } = check.policy
        else {
            return;
        };
        let target = Target::of(applied.rule, check);
        let cap = self.block_cap(applied, limit, max_block, now_ms);
        let block = self.update_lease(target, now_ms, |state| {
            match lease::State::wake(state, now_ms, check.cost, cap) {
                Some((next, block)) => (Some(block), Some(next)),
                None => (None, None),
            }
        });
        let Some(block) = block.flatten() else {
            return;
        };
        let claim = Claim {
            target,
            block,
            sent_ms: now_ms,
            last: false,
        };
        self.claim_ahead(applied.hash, applied.descriptor.as_ref(), claim, now_ms);
    }

    /// How much less than the configured capacity a fleet-fair shared rule's fleet may take of
    /// a window at `now_ms`: what its provider said less (`share.learn`, read from the rule's
    /// record; every Envoy reads the same account's answers, so all cut alike); 0 for any other
    /// rule, and while nothing lower is learned. (Shared locally, each Envoy holds its own part
    /// to what it learned instead: a cut here would refuse whoever asks once the fleet's quota
    /// is spent, light tenants included.)
    fn learned_cut(&self, rule: usize, now_ms: u64) -> u64 {
        let (Some(c), Some(sh)) = (
            self.compiled.get(rule).filter(|c| c.capacity_key.is_some()),
            self.config.rules.get(rule).and_then(|r| r.share.as_ref()),
        ) else {
            return 0;
        };
        if !sh.fleet_fair {
            return 0;
        }
        let configured = c.policy.limit_and_window().0;
        self.limit_in_force(c, sh, now_ms)
            .map_or(0, |l| configured.saturating_sub(l))
    }

    /// The largest block a lease check of `applied`'s rule claims at `now_ms` (`limit`,
    /// `max_block` its policy's): a shared capacity's blocks follow this proxy's part of it,
    /// a fleet-fair one's what it expects to admit ([`share::fair::block_cap`]).
    fn block_cap(&self, applied: &Applied, limit: u64, max_block: u64, now_ms: u64) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(c) = self.compiled.get(applied.rule).filter(|_| applied.capacity) else {
            return max_block;
        };
        let fleet_fair = self.fleet_fair(applied.rule);
        // A fleet-fair rule's cap, as worked out lately: good until `fair_cap_until`.
        if fleet_fair && now_ms < c.fair_cap_until.load(Relaxed) {
            return c.fair_cap.load(Relaxed);
        }
        if fleet_fair && self.fair_view_fresh(c, now_ms) {
            let part = c.fair_part.load(Relaxed);
            let window_ms = c.policy.limit_and_window().1.max(1);
            // The service's window, as its latest answer here said; else the rule's own.
            let told = c.fair_end.load(Relaxed);
            let end = if told > now_ms && told - now_ms <= window_ms {
                told
            } else {
                (now_ms / window_ms + 1).saturating_mul(window_ms)
            };
            // Until it expects a few requests a window (a first window, or a quiet one), the
            // configured cap: not a claim per request for a window.
            let few = share::LEVEL_ONE.saturating_mul(share::fair::BLOCKS_PER_PART);
            let part = (part != u64::MAX && part >= few).then_some(part);
            // While the fleet's window is expected to leave quota unused, what lapses of a
            // larger block is nobody's loss (worked out at the latest answer, for its window).
            let spare = match now_ms < told {
                true => c.fair_spare.load(Relaxed),
                false => 0,
            };
            let cap = share::fair::block_cap((part, spare), (now_ms, end, window_ms), max_block);
            // Kept for a 64th of the window (it shrinks by a 128th of the part meanwhile),
            // never past the rule's window nor past the service's window the spare is of.
            let slice = (window_ms / CAP_SLICES).max(1);
            let mut until = (now_ms / slice + 1)
                .saturating_mul(slice)
                .min((now_ms / window_ms + 1).saturating_mul(window_ms));
            if now_ms < told {
                until = until.min(told);
            }
            c.fair_cap.store(cap, Relaxed);
            c.fair_cap_until.store(until, Relaxed);
            return cap;
        }
        let part = c.part_pm.load(Relaxed);
        share::lease_block_cap(u16::try_from(part).unwrap_or(1000), limit, max_block)
    }

    /// What a request of `cost` at `now_ms`, claiming blocks of at most `block`, may take of a
    /// fleet-fair rule's leased quota (`shares`: the request's shared checks) near the end of
    /// the service's window
    /// ([`share::fair::keeping`]): `None` while what the service's latest answer here said the
    /// fleet has left covers what the rule's bands keep for others (read from a copy, without
    /// the rule's record), or for any other rule.
    fn fair_keeping(
        &self,
        shares: &[engine::Shared],
        rule: usize,
        (cost, block): (u64, u64),
        now_ms: u64,
    ) -> Option<share::fair::Keeping> {
        let c = self.compiled.get(rule)?;
        let left = c.fair_left()?;
        let window_ms = c.policy.limit_and_window().1.max(1);
        // The most any band keeps: no band needs the record read while what is left covers it.
        let most = share::fair::BandView {
            level: share::NO_LEVEL,
            budget: 0,
            reserved: c.fair_reserved.load(std::sync::atomic::Ordering::Relaxed),
        };
        share::fair::keeping((&most, 0, false), left, (now_ms, window_ms), (cost, block))?;
        let slot = c.fair_record();
        let (_, sc) = shares
            .iter()
            .find(|(_, sc)| sc.fleet.is_some_and(|f| f.slot == slot))?;
        engine::fair_keeping(&self.store, sc, (now_ms, window_ms), (cost, block), left)
    }

    /// Whether `rule` is a shared capacity fair across the fleet (`share.fleet: "fair"`).
    pub(super) fn fleet_fair(&self, rule: usize) -> bool {
        self.config
            .rules
            .get(rule)
            .and_then(|r| r.share.as_ref())
            .is_some_and(|s| s.fleet_fair)
    }

    /// Queues `claim`, started in its key's lease, to be sent ahead of need at the next tick
    /// with its descriptor `entries`; one that cannot be sent (no descriptor, too many queued)
    /// is taken back from the lease.
    fn claim_ahead(&self, hash: u64, entries: Option<&Descriptor>, claim: Claim, now_ms: u64) {
        let queued = entries.is_some_and(|entries| {
            self.ahead
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .add(hash, entries, claim)
        });
        if !queued {
            self.claim_lost(&claim, now_ms);
        }
    }

    /// After every question is answered: a lease claim the service refused while saying that
    /// enough remains for the request is made again for a share of what remains
    /// ([`lease::near_limit`], at least the request's cost; once). A claim refused at the turn
    /// of the service's window (this proxy's estimate of the end of the window it last heard
    /// of passed less than [`lease::TURN_MS`] ago: the estimate is early by a claim's round
    /// trip, and the service may still count the old, spent window) is made again as it was,
    /// up to [`TURN_ASKS`] times, instead of refusing the request for the old window. Only
    /// while the rule's `timeout_ms` since the first call at `since_ms` is not spent: the
    /// refusal stands otherwise. Returns whether there are questions to ask again.
    pub fn reclaim(&self, p: &mut Pending, since_ms: u64, now_ms: u64) -> bool {
        let mut again = false;
        for i in 0..p.questions.len() {
            let (Some(q), Some(Some(Ok(answer))), Some(applied)) =
                (p.questions.get(i), p.answers.get(i), p.asked.get(i))
            else {
                continue;
            };
            let Some(claim) = q.claim.filter(|c| !c.last && !q.retried) else {
                continue;
            };
            let remaining = u64::from(answer.statuses.first().map_or(0, |s| s.limit_remaining));
            let need = q.cost.max(1);
            if answer.overall_code != rls::Code::OverLimit {
                continue;
            }
            let asked = p.questions.iter().filter(|x| x.rule == q.rule).count();
            let turn = remaining < need && asked <= TURN_ASKS && self.at_turn(claim.target, now_ms);
            if remaining < need && !turn {
                continue;
            }
            let (Some(g), Some(entries)) = (
                self.config
                    .rules
                    .get(q.rule)
                    .and_then(|r| r.global.as_ref()),
                applied.descriptor.as_ref(),
            ) else {
                continue;
            };
            if now_ms.saturating_sub(since_ms) >= u64::from(g.timeout_ms) {
                continue;
            }
            // At the turn, the same block again (and it may be made again); else a share of
            // what remains, the last.
            let block = match turn {
                true => claim.block,
                false => lease::near_limit(remaining, need),
            };
            let again_q = Question {
                rule: q.rule,
                hash: q.hash,
                cost: q.cost,
                message: global::request(&g.domain, entries, block),
                claim: Some(Claim {
                    block,
                    sent_ms: now_ms,
                    last: !turn || asked == TURN_ASKS,
                    ..claim
                }),
                retried: false,
            };
            let applied: Applied = applied.clone();
            let rule = q.rule;
            if let Some(old) = p.questions.get_mut(i) {
                old.retried = true; // answered again by the new question
            }
            self.metrics.add(rule, Counter::LeaseClaims, 1);
            p.questions.push(again_q);
            p.answers.push(None);
            p.asked.push(applied);
            again = true;
        }
        again
    }

    /// Whether `now_ms` is at the turn of the service's window for the lease at `target`
    /// ([`lease::State::at_turn`]).
    fn at_turn(&self, target: Target, now_ms: u64) -> bool {
        self.update_lease(target, now_ms, |state| {
            (state.is_some_and(|s| s.at_turn(now_ms)), None)
        })
        .unwrap_or(false)
    }

    /// What the answer to a request's lease claim does: the grant goes to the key's lease,
    /// less the request's own cost.
    pub(super) fn claimed(
        &self,
        q: &Question,
        claim: &Claim,
        answer: Option<&Answer>,
        now_ms: u64,
    ) -> Result<Claimed, ServiceError> {
        let policy = self
            .compiled
            .get(q.rule)
            .and_then(|c| c.lease)
            .ok_or(ServiceError::NotGlobal)?;
        let answer = match answer {
            Some(Ok(a)) => a,
            Some(Err(e)) => return Err(e.clone()),
            None => return Err(ServiceError::NoAnswer),
        };
        // The question's cost is what the request takes of a grant (0 for a rule charged
        // only once its answer tells: Runtime::promote).
        let s = self.answer_lease(claim, answer, q.cost, now_ms, false)?;
        let (limit, windows) = match policy {
            Policy::Lease { limit, windows, .. } => (limit, windows),
            _ => return Err(ServiceError::NotGlobal),
        };
        let (mut v, _) = lease::decide(Some(s), now_ms, limit, windows, 0);
        if answer.overall_code == rls::Code::Ok {
            return Ok(Claimed::Granted(v));
        }
        v.allowed = false;
        v.retry_after_ms = match s.refused {
            true => s.expires_ms.saturating_sub(now_ms).max(1),
            false => lease::SHORT_WAIT_MS,
        };
        Ok(Claimed::Refused(v))
    }

    /// Writes what the service answered to `claim` into the key's lease (`taken`: what the
    /// claiming request takes at once of a grant); counts it. The lease after it.
    fn answer_lease(
        &self,
        claim: &Claim,
        answer: &rls::Response,
        taken: u64,
        now_ms: u64,
        background: bool,
    ) -> Result<lease::State, ServiceError> {
        let t = claim.target;
        let policy = self
            .compiled
            .get(t.rule)
            .and_then(|c| c.lease)
            .ok_or(ServiceError::NotGlobal)?;
        let expires_ms = global::lease_expiry(answer, &policy, claim.sent_ms);
        let remaining = answer.statuses.first().map_or(0, |s| s.limit_remaining);
        // What the fleet may still take of the window: the service counts the configured
        // capacity, and the provider may have said less (`share.learn`).
        let (remaining_here, over) = match self.learned_cut(t.rule, now_ms) {
            0 => (remaining, 0),
            cut => {
                let left = u64::from(remaining);
                let here = u32::try_from(left.saturating_sub(cut)).unwrap_or(u32::MAX);
                (here, cut.saturating_sub(left))
            }
        };
        let granted = match answer.overall_code {
            rls::Code::Ok => true,
            rls::Code::OverLimit => false,
            rls::Code::Unknown => return Err(ServiceError::Unknown),
        };
        if self.fleet_fair(t.rule) {
            // What the fleet has left, for the tenants under their shares: only when said (an
            // answer without statuses says nothing of it).
            let left = answer
                .statuses
                .first()
                .map_or(u64::MAX, |_| u64::from(remaining_here));
            if let Some(c) = self.compiled.get(t.rule) {
                use std::sync::atomic::Ordering::Relaxed;
                c.fair_left.store(left, Relaxed);
                // This proxy's part of what the window is expected to leave unused, as of the
                // claim's sending.
                let part = c.fair_part.load(Relaxed);
                let (capacity, window_ms) = policy.limit_and_window();
                let told = share::fair::Left {
                    units: left,
                    end_ms: expires_ms,
                };
                let spare = match left != u64::MAX && part != u64::MAX {
                    true => share::fair::spare(
                        (told, claim.sent_ms),
                        (capacity, c.fair_use.load(Relaxed), part),
                        (now_ms, window_ms),
                    ),
                    false => 0,
                };
                c.fair_spare.store(spare, Relaxed);
                c.fair_cap_until.store(0, Relaxed);
            }
        }
        let updated = self.update_lease(t, now_ms, |state| {
            if granted {
                // Granted past what the fleet may take: that much of the block is not used,
                // and nothing more is claimed until the window ends.
                let unused = over.min(claim.block.saturating_sub(taken));
                let grant = Grant {
                    block: claim.block - unused,
                    taken,
                    expires_ms,
                    remaining: remaining_here,
                };
                let mut s = lease::State::granted(state, now_ms, grant, background);
                s.refused |= remaining_here == 0 && remaining > 0 && now_ms < expires_ms;
                (s, Some(s))
            } else {
                let s = lease::State::refused_claim(
                    state,
                    now_ms,
                    expires_ms,
                    remaining_here,
                    (background, claim.last),
                );
                (s, Some(s))
            }
        });
        let Some(s) = updated else {
            return Err(ServiceError::NoAnswer);
        };
        if granted {
            self.metrics.add(t.rule, Counter::LeaseGranted, claim.block);
        } else {
            self.metrics.add(t.rule, Counter::LeaseRefused, 1);
        }
        // Spent: refused with nothing left (a refusal of a block larger than what remains
        // is followed by a claim of what remains).
        let answer = (
            if granted { claim.block } else { 0 },
            u64::from(remaining),
            !granted && remaining == 0,
        );
        self.capacity_answered(t.rule, answer, (expires_ms, now_ms));
        Ok(s)
    }

    /// The service answered a shared capacity's claim (granting a block, or refusing): this
    /// proxy's part of the capacity, which its tenants share ([`share::lease_answered`]).
    fn capacity_answered(&self, rule: usize, answer: (u64, u64, bool), at: (u64, u64)) {
        let (Some(c), Some(sh)) = (
            self.compiled.get(rule).filter(|c| c.capacity_key.is_some()),
            self.config.rules.get(rule).and_then(|r| r.share.as_ref()),
        ) else {
            return;
        };
        let Some((limit, window_ms)) = c.lease.map(|l| l.limit_and_window()) else {
            return;
        };
        if sh.fleet_fair {
            c.fair_end.store(at.0, std::sync::atomic::Ordering::Relaxed);
            c.fair_cap_until
                .store(0, std::sync::atomic::Ordering::Relaxed);
            if self.fair_view_fresh(c, at.1) {
                return; // each tenant's share is the fleet's: no part of this proxy's to learn
            }
        }
        let bands = Some(sh.params.bands);
        let part = engine::update_share_record(&self.store, c.share_record(), bands, |record| {
            let changed = share::lease_answered(record, (limit, window_ms), answer, at);
            (record.fleet.part_pm, changed)
        });
        if let Some(part) = part {
            c.part_pm
                .store(u32::from(part), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A request refused by another rule gives back what it took of a lease's grant.
    pub(super) fn give_back_claim(&self, claim: &Claim, taken: u64, now_ms: u64) {
        if taken == 0 {
            return;
        }
        self.update_lease(claim.target, now_ms, |state| {
            ((), lease::refund(state.copied(), now_ms, taken))
        });
    }

    /// The claims ahead of need to send now.
    pub(crate) fn claims_ahead(&self, now_ms: u64) -> Vec<(Vec<u8>, Claim)> {
        let claims = self
            .ahead
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(&self.config.rules, now_ms);
        for (_, c) in &claims {
            self.metrics.add(c.target.rule, Counter::LeaseClaims, 1);
        }
        claims
    }

    /// The answer to a claim ahead of need: a grant is added to the key's lease; after a
    /// refusal saying some remains, the next claim asks no more than what remains.
    pub(crate) fn ahead_answered(&self, claim: &Claim, answer: Answer, now_ms: u64) {
        let answer = match answer {
            Ok(a) => a,
            Err(_) => {
                self.metrics
                    .add(claim.target.rule, Counter::GlobalErrors, 1);
                self.claim_lost(claim, now_ms);
                return;
            }
        };
        match self.answer_lease(claim, &answer, 0, now_ms, true) {
            Ok(_) => {}
            Err(_) => {
                self.metrics
                    .add(claim.target.rule, Counter::GlobalErrors, 1);
                self.claim_lost(claim, now_ms);
            }
        }
    }

    /// [`engine::update_lease`] on `target`'s lease, counted for its rule: the store's work, as
    /// a request's decision counts it (a key's lease is first written here, when it first
    /// claims), and the quota held past its expiry that the new lease no longer holds (lapsed:
    /// whichever update comes first after the service's window turned drops it). `None` when
    /// the store could not update the lease.
    fn update_lease<T>(
        &self,
        target: Target,
        now_ms: u64,
        mut f: impl FnMut(Option<&lease::State>) -> (T, Option<lease::State>),
    ) -> Option<T> {
        let mut lapsed = 0;
        let (result, out) = engine::update_lease(
            &self.store,
            (target.slot, target.alt),
            target.fingerprint,
            now_ms,
            |state| {
                let (result, next) = f(state);
                // Of the attempt that was written (the last).
                lapsed = match (state, &next) {
                    (Some(old), Some(new)) => {
                        old.lapsing(now_ms).saturating_sub(new.lapsing(now_ms))
                    }
                    _ => 0,
                };
                (result, next)
            },
        );
        self.store_work(target.rule, &out);
        if result.is_some() {
            self.metrics.add(target.rule, Counter::LeaseLapsed, lapsed);
        }
        result
    }

    /// A claim ahead of need came to nothing: another may start.
    pub(crate) fn claim_lost(&self, claim: &Claim, now_ms: u64) {
        self.update_lease(claim.target, now_ms, |state| {
            ((), state.map(|s| s.claim_failed()))
        });
    }
}

impl<S: Store> Runtime<S> {
    /// How a global rule charged by its responses reports its usage to its service (`None`
    /// for the other rules, and for a lease rule: its usage settles on its lease). `told`: what
    /// the service counted already.
    pub(super) fn service_report(
        &self,
        a: &Applied,
        check: &Check,
        told: u64,
        host: &mut impl Attributes,
    ) -> Option<Box<ServiceReport>> {
        let rule = self.config.rules.get(a.rule)?;
        let g = rule.global.as_ref()?;
        rule.charge()?;
        if g.mode == GlobalMode::Lease {
            return None;
        }
        Some(Box::new(ServiceReport {
            hash: a.hash,
            entries: self.described(a, host)?,
            target: Target {
                rule: a.rule,
                slot: check.slot,
                alt: check.alt,
                fingerprint: check.fingerprint,
            },
            told,
            local: g.mode == GlobalMode::Async,
        }))
    }

    /// What a request admitted by a service's answer owes its rule, if it is charged by its
    /// responses: a lease rule's usage settles on its lease; a sync rule's usage beyond what
    /// the question counted goes to the service in the next flush.
    pub(super) fn asked_debt(&self, q: &Question, a: &Applied) -> Option<Debt> {
        let rule = self.config.rules.get(q.rule)?;
        let charge = rule.charge()?;
        let compiled = self.compiled.get(q.rule)?;
        let policy = compiled.lease.unwrap_or(compiled.policy);
        let kind = match charge.true_up {
            true => DebtKind::Reserved(q.cost),
            false => DebtKind::Usage,
        };
        let (slot, alt, fingerprint, report) = match &q.claim {
            Some(claim) => (
                claim.target.slot,
                claim.target.alt,
                claim.target.fingerprint,
                None,
            ),
            None => (
                0,
                0,
                0,
                Some(Box::new(ServiceReport {
                    hash: a.hash,
                    entries: a.descriptor.clone()?,
                    target: Target {
                        rule: q.rule,
                        slot: 0,
                        alt: 0,
                        fingerprint: 0,
                    },
                    told: q.cost,
                    local: false,
                })),
            ),
        };
        Some(Debt {
            rule: q.rule,
            slot,
            alt,
            fingerprint,
            policy,
            kind,
            priced: a.priced,
            report,
            share: None,
        })
    }

    /// Queues `used` (less what the service counted already) for the next flush of `report`'s
    /// rule.
    pub(super) fn report_usage(&self, report: &ServiceReport, used: u64) {
        let units = used.saturating_sub(report.told);
        if units == 0 {
            return;
        }
        let queued = self
            .hits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .count(
                report.hash,
                || Some(report.entries.clone()),
                report.target,
                units,
            );
        let counter = match queued {
            true => Counter::UsageReported,
            false => Counter::ReportsLost,
        };
        self.metrics.add(report.target.rule, counter, units);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests;
