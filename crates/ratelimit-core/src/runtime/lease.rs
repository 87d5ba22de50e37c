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
                    let (next, block) = s.start_claim(now_ms, (cap, short), false);
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
        let cap = self.block_cap(applied, limit, max_block, now_ms);
        let shares = std::slice::from_ref(share);
        if share.1.fleet.is_some()
            && self
                .fair_keeping(shares, applied.rule, (check.cost, cap), now_ms)
                .is_some()
        {
            return None;
        }
        let looked = self.update_lease(target, now_ms, |state| {
            let Peek::Covered { low } = lease::State::peek(state, now_ms, check.cost, cap) else {
                return (None, None);
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
            let (next, block) = s.start_claim(now_ms, (cap, check.cost), true);
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
            // grant of the next came meanwhile): what was taken lapsed with its window.
            let same = state.copied().filter(|s| s.expires_ms == expires_ms);
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
        let Some(c) = self.compiled.get(applied.rule).filter(|_| applied.capacity) else {
            return max_block;
        };
        if self.fleet_fair(applied.rule) && self.fair_view_fresh(c, now_ms) {
            let part = c.fair_part.load(std::sync::atomic::Ordering::Relaxed);
            let window_ms = c.policy.limit_and_window().1.max(1);
            // The service's window, as its latest answer here said; else the rule's own.
            let told = c.fair_end.load(std::sync::atomic::Ordering::Relaxed);
            let end = if told > now_ms && told - now_ms <= window_ms {
                told
            } else {
                (now_ms / window_ms + 1).saturating_mul(window_ms)
            };
            // Until it expects a few requests a window (a first window, or a quiet one), the
            // configured cap: not a claim per request for a window.
            let few = share::LEVEL_ONE.saturating_mul(share::fair::BLOCKS_PER_PART);
            let part = (part != u64::MAX && part >= few).then_some(part);
            return share::fair::block_cap(part, (now_ms, end, window_ms), max_block);
        }
        let part = c.part_pm.load(std::sync::atomic::Ordering::Relaxed);
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
            let turn = remaining < need && {
                let asked = p.questions.iter().filter(|x| x.rule == q.rule).count();
                asked <= TURN_ASKS && self.at_turn(claim.target, now_ms)
            };
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
                    last: !turn,
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
                c.fair_left
                    .store(left, std::sync::atomic::Ordering::Relaxed);
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
                    background,
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
mod tests {
    use crate::config::Config;
    use crate::key::Seed;
    use crate::metrics::{Counter, Gauge};
    use crate::rls::{self, Code, DescriptorStatus};
    use crate::runtime::{Background, Next, Runtime, StreamState};
    use crate::store::{MemoryStore, Store};
    use crate::testkit::FakeHost;

    const LEASE: &str = r#"{"rules": [{"name": "g", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
        "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10}}]}"#;

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        crate::testkit::runtime(json, Seed([3, 4]))
    }

    fn answer(code: Code, remaining: u32) -> rls::Response {
        rls::Response {
            overall_code: code,
            statuses: vec![DescriptorStatus {
                code,
                requests_per_unit: Some(100),
                unit_seconds: Some(60),
                limit_remaining: remaining,
                reset_ms: Some(30_000),
            }],
            headers: Vec::new(),
        }
    }

    fn claims(rt: &Runtime<MemoryStore>) -> u64 {
        let mut n = 0;
        rt.metrics().drain(
            |_, c, k| {
                if c == Counter::LeaseClaims {
                    n += k;
                }
            },
            |_, _| {},
        );
        n
    }

    /// One request at `now`, each claim it makes answered by `answer`: the last claim's
    /// block, if it claimed, and whether it was admitted.
    fn request(
        rt: &Runtime<MemoryStore>,
        now: u64,
        answer: impl Fn(u64) -> rls::Response,
    ) -> (Option<u64>, bool) {
        let mut h = FakeHost::new("10.0.0.1", "/");
        request_from(rt, &mut h, now, answer)
    }

    /// [`request`] from `h`.
    fn request_from(
        rt: &Runtime<MemoryStore>,
        h: &mut FakeHost,
        now: u64,
        answer: impl Fn(u64) -> rls::Response,
    ) -> (Option<u64>, bool) {
        h.now = now;
        let mut st = StreamState::default();
        let mut next = st.request_headers(rt, h);
        let mut claimed = None;
        for id in 1.. {
            match next {
                Next::Continue => return (claimed, true),
                Next::Reply(_) => return (claimed, false),
                Next::Call { message, .. } => {
                    let hits = rls::decode_request(&message).unwrap().hits;
                    claimed = Some(hits);
                    assert!(matches!(st.started(rt, h, Ok(id)), Next::Wait));
                    next = st.call_answer(rt, h, id, Ok(answer(hits)));
                }
                other => panic!("{other:?}"),
            }
        }
        unreachable!()
    }

    /// What [`leased_waits`] saw: admitted by second (all tenants), each tenant's rate over
    /// seconds 3 to 10, requests that joined the line, admitted from it, the longest wait, and
    /// refusals that named no rule, or, the share's, said something remained.
    struct Waited {
        by_second: Vec<u64>,
        rates: Vec<f64>,
        queued: u64,
        from_line: u64,
        longest: u64,
        unnamed: u64,
    }

    /// A leased shared capacity (100 a second, counted by the service in windows of a second)
    /// with `share.max_wait_ms` `max_wait_ms`, on a virtual clock, the service answering at
    /// once: four tenants at 50 a second, twice their share, and a light one at 8.
    fn leased_waits(max_wait_ms: u64) -> Waited {
        let rt = runtime(&format!(
            r#"{{"rules": [{{"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {{"requests_per_unit": 100, "unit": "second"}},
            "global": {{"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                       "max_block": 8}},
            "share": {{"max_wait_ms": {max_wait_ms}, "max_queued": 256,
                       "max_queued_per_tenant": 64}}}}]}}"#
        ));
        let mut bg = Background::new(&rt);
        let t0: u64 = 1_800_000_000_000;
        // The service: one counter, 100 a window of a second.
        let service = std::cell::RefCell::new((0u64, 0u64));
        let grant = |hits: u64, now: u64| {
            crate::testkit::second_counter(&mut service.borrow_mut(), hits, now)
        };
        let tenants: [(&str, f64); 5] = [
            ("equal0", 50.0),
            ("equal1", 50.0),
            ("equal2", 50.0),
            ("equal3", 50.0),
            ("light", 8.0),
        ];
        let run_ms: u64 = 12_000;
        let mut next_at: Vec<f64> = (0..5).map(|i| f64::from(i) * 3.7).collect();
        // Waiting streams: (stream, its host, when it looks again, tenant, joined).
        let mut waiting: Vec<(StreamState, FakeHost, u64, usize, u64)> = Vec::new();
        let mut per_s = vec![[0u64; 5]; (run_ms / 1000 + 2) as usize];
        let (mut queued, mut from_line, mut longest, mut unnamed) = (0u64, 0u64, 0u64, 0u64);
        let mut call_id = 0u64;
        for ms in 0..run_ms + 1_200 {
            let now = t0 + ms;
            let second = (ms / 1000) as usize;
            for (i, (name, rate)) in tenants.iter().enumerate() {
                while ms < run_ms && next_at[i] <= ms as f64 {
                    next_at[i] += 1000.0 / rate;
                    let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", name);
                    h.now = now;
                    let mut st = StreamState::default();
                    let mut next = st.request_headers(&rt, &mut h);
                    loop {
                        next = match next {
                            Next::Call { message, .. } => {
                                let hits = rls::decode_request(&message).unwrap().hits;
                                call_id += 1;
                                assert!(matches!(st.started(&rt, &mut h, Ok(call_id)), Next::Wait));
                                st.call_answer(&rt, &mut h, call_id, Ok(grant(hits, now)))
                            }
                            Next::Continue => {
                                per_s[second][i] += 1;
                                break;
                            }
                            Next::Hold { until_ms } => {
                                queued += 1;
                                waiting.push((st, h, until_ms, i, now));
                                break;
                            }
                            Next::Reply(r) => {
                                assert_eq!(r.status, 429);
                                break;
                            }
                            other => panic!("{other:?}"),
                        };
                    }
                }
            }
            let mut k = 0;
            while k < waiting.len() {
                let (st, _, until, i, joined) = &mut waiting[k];
                if *until > now {
                    k += 1;
                    continue;
                }
                match st.wake(&rt, now) {
                    Next::Hold { until_ms } => {
                        *until = until_ms;
                        k += 1;
                        continue;
                    }
                    Next::Continue => {
                        per_s[second][*i] += 1;
                        from_line += 1;
                        longest = longest.max(now - *joined);
                    }
                    Next::Reply(r) => {
                        assert_eq!(r.status, 429);
                        longest = longest.max(now - *joined);
                        // Refused by the lease or the share, a 429 names the rule; refused
                        // by the share alone (one policy in its fields), it says nothing
                        // remains.
                        let field = |name: &str| {
                            r.headers()
                                .find(|(k, _)| *k == name)
                                .map(|(_, v)| v.to_string())
                        };
                        let by_share = field("ratelimit").is_some_and(|f| !f.contains(", "));
                        let left = field("x-ratelimit-remaining");
                        unnamed += u64::from(
                            !r.body.contains(r#""violated-policies":["p"]"#)
                                || (by_share && left.as_deref() != Some("0")),
                        );
                    }
                    other => panic!("{other:?}"),
                }
                waiting.swap_remove(k);
            }
            let work = bg.tick(&rt, now, None);
            for call in work.calls {
                let hits = rls::decode_request(&call.message).unwrap().hits;
                call_id += 1;
                bg.started(&rt, call, Some(call_id));
                bg.answered(&rt, call_id, Ok(grant(hits, now)), now);
            }
        }
        let measured = &per_s[3..11];
        let rate = |i: usize| measured.iter().map(|s| s[i]).sum::<u64>() as f64 / 8.0;
        Waited {
            by_second: per_s.iter().map(|s| s.iter().sum()).collect(),
            rates: (0..5).map(rate).collect(),
            queued,
            from_line,
            longest,
            unnamed,
        }
    }

    /// A leased shared capacity's refused requests wait their turn (`max_wait_ms`): requests
    /// whose claims were granted and whose shares refused them join the line, and turns take
    /// from the lease (claiming ahead of need when it runs dry). Every admission is covered
    /// (at most the service's 100 a window), the light tenant is served whole, the equal ones
    /// alike, no request waits past `max_wait_ms`, and the capacity is used as much as when
    /// every refusal comes at once.
    #[test]
    fn a_leased_shared_capacity_lets_refused_requests_wait_their_turn() {
        let at_once = leased_waits(0);
        let w = leased_waits(1_000);
        let used = |w: &Waited| w.rates.iter().sum::<f64>();
        println!(
            "leased, refused at once: {:.2}/s used, {:?}; waiting: {:.2}/s used, {:?}, \
             {} queued, {} admitted from the line, longest wait {} ms, by second {:?}",
            used(&at_once),
            at_once.rates,
            used(&w),
            w.rates,
            w.queued,
            w.from_line,
            w.longest,
            w.by_second
        );
        assert_eq!((at_once.queued, at_once.from_line), (0, 0));
        assert!(w.by_second.iter().all(|&n| n <= 100), "{:?}", w.by_second);
        assert!(w.from_line > 500, "{} admitted from the line", w.from_line);
        assert!(w.longest <= 1_010, "waited {} ms", w.longest);
        // A wait that ends refused by the lease says so (171 of them named no rule before the
        // lease's refusal was reported), and the share's refusal says nothing remains (282
        // said 1 before a share that is no whole number of requests reported 0).
        assert_eq!(w.unnamed, 0, "429s after a wait naming no rule or not at 0");
        assert!(used(&w) >= used(&at_once) - 3.0, "{:.2}/s", used(&w));
        assert_eq!(w.rates[4], 8.0, "the light tenant");
        let equal = &w.rates[..4];
        let (least, most) = equal
            .iter()
            .fold((f64::MAX, 0.0f64), |(l, m), &r| (l.min(r), m.max(r)));
        assert!(most - least <= 1.0, "equal tenants {equal:?}");
    }

    /// The fleet's quota spent (the service refuses the claim): a request of a leased shared
    /// rule that lets requests wait waits for the next window; one that another rule, which
    /// refuses at once, also matched is refused at once (that rule is not decided before the
    /// wait, so the wait could end in a refusal it would have given now).
    #[test]
    fn a_request_the_spent_quota_refuses_waits_only_where_every_rule_waits() {
        let shared = r#"{"name": "p", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10},
            "share": {"max_wait_ms": 1000}}"#;
        let plain = r#"{"name": "ip", "key": ["remote_address"],
            "rate_limit": {"requests_per_unit": 1000, "unit": "minute"}}"#;
        let spent = |now: u64| rls::Response {
            overall_code: Code::OverLimit,
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit,
                requests_per_unit: Some(100),
                unit_seconds: Some(1),
                limit_remaining: 0,
                reset_ms: Some(1000 - now % 1000),
            }],
            headers: Vec::new(),
        };
        for (rules, waits) in [
            (format!("[{shared}]"), true),
            (format!("[{shared}, {plain}]"), false),
        ] {
            let rt = runtime(&format!(r#"{{"rules": {rules}}}"#));
            let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
            h.now = 1_800_000_000_400;
            let mut st = StreamState::default();
            let Next::Call { .. } = st.request_headers(&rt, &mut h) else {
                panic!("no claim")
            };
            assert!(matches!(st.started(&rt, &mut h, Ok(1)), Next::Wait));
            let answer = spent(h.now);
            let next = st.call_answer(&rt, &mut h, 1, Ok(answer));
            match (waits, next) {
                (true, Next::Hold { .. }) => {}
                (false, Next::Reply(r)) => assert_eq!(r.status, 429),
                (_, other) => panic!("{rules}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_granted_block_admits_locally_and_a_low_key_claims_ahead() {
        let rt = runtime(LEASE);
        let mut bg = Background::new(&rt);
        // The first request claims a block and takes its cost from it.
        let (hits, ok) = request(&rt, 1_000, |_| answer(Code::Ok, 90));
        let first = hits.expect("a claim");
        assert!(ok && first >= 1, "{first}");
        // The rest of the block is admitted with no call.
        for t in 1..first {
            let (hits, ok) = request(&rt, 1_000 + t, |_| panic!("claimed"));
            assert_eq!((hits, ok), (None, true));
        }
        assert_eq!(claims(&rt), 1);
        // Running low queued a claim ahead of need: the next tick sends it.
        let work = bg.tick(&rt, 2_000, None);
        assert_eq!(work.calls.len(), 1, "a claim ahead");
        let call = work.calls.into_iter().next().unwrap();
        let block = rls::decode_request(&call.message).unwrap().hits;
        assert!(block >= 2, "the block grows with the rate: {block}");
        bg.started(&rt, call, Some(9));
        assert!(bg.answered(&rt, 9, Ok(answer(Code::Ok, 80)), 2_010));
        for t in 0..block {
            let (hits, ok) = request(&rt, 2_100 + t, |_| panic!("claimed"));
            assert_eq!((hits, ok), (None, true), "request {t} of the block");
        }
    }

    #[test]
    fn only_a_claim_builds_a_descriptor() {
        // The key is read once per request; a claim reads it again for its descriptor (now or
        // ahead of need); a request admitted from what is held builds none.
        let rt = runtime(LEASE);
        let reads = |now, answered: bool| {
            let mut h = FakeHost::new("10.0.0.1", "/");
            let (hits, ok) = request_from(&rt, &mut h, now, |_| answer(Code::Ok, 90));
            assert!(ok && hits.is_some() == answered);
            h.address_reads
        };
        assert_eq!(reads(1_000, true), 2, "claims");
        let held = (1..4).map(|t| reads(1_000 + t, false)).collect::<Vec<_>>();
        assert!(held.contains(&1), "admitted from the block: {held:?}");
        assert!(held.contains(&2), "ran low, claims ahead: {held:?}");
        let mut bg = Background::new(&rt);
        let work = bg.tick(&rt, 2_000, None);
        let call = work.calls.first().expect("a claim ahead");
        let entries = rls::decode_request(&call.message).unwrap().descriptors;
        assert_eq!(
            entries,
            [vec![
                ("rule".to_string(), b"g".to_vec()),
                ("remote_address".to_string(), b"10.0.0.1".to_vec())
            ]]
        );
    }

    #[test]
    fn a_lease_takes_an_entry_of_the_table_like_any_key() {
        // The first claim writes the key's lease: the tracked keys count it.
        let rt = runtime(LEASE);
        let (hits, ok) = request(&rt, 1_000, |_| answer(Code::Ok, 90));
        assert!(hits.is_some() && ok);
        let mut gauges = Vec::new();
        rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
        assert_eq!(gauges, [(Gauge::TrackedKeys, 1)]);
    }

    /// A claim refused at the turn of the service's window (this proxy's estimate of its end
    /// is early by a round trip, and the service still counts the old, spent window) is made
    /// again, and the request admitted from the next window's grant, not refused for the old
    /// one; at most [`super::TURN_ASKS`] times. Away from the turn a refusal stands.
    #[test]
    fn a_claim_refused_at_the_windows_turn_is_made_again() {
        // A grant whose window ends, as estimated here, at 31,000 (a reset of 30 s).
        let granted_then = |rt: &Runtime<MemoryStore>| {
            assert_eq!(
                request(rt, 1_000, |_| answer(Code::Ok, 96)),
                (Some(4), true)
            );
        };
        // The service refuses the first `n` claims (nothing left), then grants.
        let refusing = |n: u64| {
            let calls = std::cell::Cell::new(0u64);
            move |_hits: u64| {
                calls.set(calls.get() + 1);
                match calls.get() <= n {
                    true => answer(Code::OverLimit, 0),
                    false => answer(Code::Ok, 96),
                }
            }
        };
        // 20 ms after the estimated end: refused once, then granted; admitted.
        let rt = runtime(LEASE);
        granted_then(&rt);
        claims(&rt);
        assert!(request(&rt, 31_020, refusing(1)).1);
        assert_eq!(claims(&rt), 2);
        // Refused three times, then granted: still admitted (three asks again).
        let rt = runtime(LEASE);
        granted_then(&rt);
        claims(&rt);
        assert!(request(&rt, 31_020, refusing(3)).1);
        assert_eq!(claims(&rt), 4);
        // Refused every time: asked four times in all, then refused.
        let rt = runtime(LEASE);
        granted_then(&rt);
        claims(&rt);
        assert!(!request(&rt, 31_020, refusing(u64::MAX)).1);
        assert_eq!(claims(&rt), 4);
        // Past the turn (the window it knew ended 200 ms ago): the refusal stands, one claim.
        let rt = runtime(LEASE);
        granted_then(&rt);
        claims(&rt);
        assert!(!request(&rt, 31_200, refusing(1)).1);
        assert_eq!(claims(&rt), 1);
        // Within the window it knows (the fleet's quota spent early), what is held spent
        // first: the same.
        let rt = runtime(LEASE);
        granted_then(&rt);
        for _ in 0..3 {
            assert_eq!(request(&rt, 19_990, refusing(u64::MAX)), (None, true));
        }
        claims(&rt);
        assert!(!request(&rt, 20_000, refusing(1)).1);
        assert_eq!(claims(&rt), 1);
    }

    #[test]
    fn quota_held_when_the_window_turns_lapses_at_the_next_claim() {
        // A block of 4, one used; the service's window (30 s) turns; the next request claims
        // afresh, and the 3 held lapse.
        let rt = runtime(LEASE);
        assert_eq!(
            request(&rt, 1_000, |_| answer(Code::Ok, 96)),
            (Some(4), true)
        );
        let (hits, ok) = request(&rt, 40_000, |_| answer(Code::Ok, 96));
        assert!(hits.is_some() && ok);
        let mut counts = Vec::new();
        rt.metrics().drain(|_, c, n| counts.push((c, n)), |_, _| {});
        assert!(counts.contains(&(Counter::LeaseLapsed, 3)), "{counts:?}");
    }

    #[test]
    fn a_grant_whose_window_ends_now_is_not_held_into_the_next() {
        // The service grants a block with under a millisecond of its window left (a reset of
        // 0): its window turns at once, so nothing of the block may be held past now. Before,
        // a reset of 0 read as none and the block was held to the end of the rule's
        // clock-aligned window, admitted in the service's next window beside that window's
        // own grants (fleet-sim's runtime runs found up to 2.3 % over the capacity there).
        let rt = runtime(LEASE);
        let (hits, ok) = request(&rt, 1_000, |_| {
            let mut a = answer(Code::Ok, 96);
            a.statuses[0].reset_ms = Some(0);
            a
        });
        assert_eq!((hits, ok), (Some(4), true));
        // A millisecond later: the 3 left of the block lapsed, a claim is made again.
        let (hits, ok) = request(&rt, 1_001, |_| answer(Code::Ok, 92));
        assert!(hits.is_some() && ok, "{hits:?}");
    }

    #[test]
    fn a_refused_claim_of_a_block_claims_what_remains_then_refuses_locally() {
        let rt = runtime(LEASE);
        let (hits, ok) = request(&rt, 1_000, |hits| {
            if hits > 1 {
                answer(Code::OverLimit, 1)
            } else {
                answer(Code::Ok, 0)
            }
        });
        assert_eq!((hits, ok), (Some(1), true), "claimed what remained");
        // None left: refused by the service once, then locally until its reset.
        let (hits, ok) = request(&rt, 1_100, |_| answer(Code::OverLimit, 0));
        assert!(hits.is_some() && !ok);
        let (hits, ok) = request(&rt, 1_200, |_| panic!("claimed"));
        assert_eq!((hits, ok), (None, false));
        // After the service's reset, a claim again.
        let (hits, ok) = request(&rt, 1_100 + 30_000, |_| answer(Code::Ok, 50));
        assert!(hits.is_some() && ok);
    }

    #[test]
    fn no_request_waits_past_its_timeout_in_all() {
        // timeout_ms 20 (the default): the first claim's answer comes after 15 ms; the claim
        // of what remains gets the 5 ms left; after 20 ms, the refusal stands.
        for (answered_at, again) in [(15u64, Some(5u32)), (20, None)] {
            let rt =
                runtime(&LEASE.replace(r#""flush_ms": 10"#, r#""flush_ms": 10, "max_block": 8"#));
            let mut h = FakeHost::new("10.0.0.1", "/");
            h.now = 1_000;
            let mut st = StreamState::default();
            let Next::Call { timeout_ms, .. } = st.request_headers(&rt, &mut h) else {
                panic!("no claim")
            };
            assert_eq!(timeout_ms, 20);
            st.started(&rt, &mut h, Ok(1));
            h.now += answered_at;
            let next = st.call_answer(&rt, &mut h, 1, Ok(answer(Code::OverLimit, 2)));
            match (next, again) {
                (Next::Call { timeout_ms, .. }, Some(left)) => assert_eq!(timeout_ms, left),
                (Next::Reply(r), None) => assert_eq!(r.status, 429),
                (other, _) => panic!("{other:?} after {answered_at} ms"),
            }
        }
    }

    const SHARED: &str = r#"{"rules": [{"name": "p", "key": ["header:x-tenant"],
        "rate_limit": {"requests_per_unit": 100, "unit": "second"},
        "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                   "max_block": 8},
        "share": {}}]}"#;

    /// The shared rule's record as stored.
    fn record(rt: &Runtime<MemoryStore>) -> crate::share::Record {
        let slot = rt.compiled[0].share_record();
        rt.store
            .read(slot, |b, _| b.and_then(crate::share::Record::decode))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn a_shared_capacity_leases_one_quota_for_all_its_tenants() {
        let rt = runtime(SHARED);
        let tenant = |name: &str| FakeHost::new("10.0.0.1", "/").header("x-tenant", name);
        // The first request claims for the capacity: the descriptor names the rule alone.
        let mut h = tenant("a");
        h.now = 1_000;
        let mut st = StreamState::default();
        let Next::Call { message, .. } = st.request_headers(&rt, &mut h) else {
            panic!("no claim")
        };
        let asked = rls::decode_request(&message).unwrap();
        assert_eq!(
            asked.descriptors,
            [vec![("rule".to_string(), b"p".to_vec())]]
        );
        let block = asked.hits;
        st.started(&rt, &mut h, Ok(1));
        let next = st.call_answer(&rt, &mut h, 1, Ok(answer(Code::Ok, 90)));
        assert!(matches!(next, Next::Continue), "{next:?}");
        // Another tenant is admitted from the same block, with no call.
        for t in 1..block.min(3) {
            let (hits, ok) = request_from(&rt, &mut tenant("b"), 1_000 + t, |_| panic!("claimed"));
            assert_eq!((hits, ok), (None, true), "request {t}");
        }
        let mut counts = Vec::new();
        rt.metrics().drain(|_, c, n| counts.push((c, n)), |_, _| {});
        let allowed: u64 = counts
            .iter()
            .filter(|(c, _)| *c == Counter::Allowed)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(
            allowed,
            block.min(3),
            "each request counted once: {counts:?}"
        );
    }

    #[test]
    fn a_claim_before_a_shared_rule_leaves_its_share_to_it() {
        // A lease rule's claim takes its check out of the request's (it becomes a question):
        // the shared rule after it still decides its tenant against the record.
        let rt = runtime(
            r#"{"rules": [{"name": "g", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
                "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10}},
              {"name": "p", "key": ["header:x-tenant"],
                "rate_limit": {"requests_per_unit": 100, "unit": "second"},
                "global": {"cluster": "rls", "domain": "edge", "mode": "lease", "flush_ms": 10,
                           "max_block": 8},
                "share": {}}]}"#,
        );
        let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
        h.now = 1_000;
        let mut st = StreamState::default();
        let mut next = st.request_headers(&rt, &mut h);
        let (mut calls, mut waiting) = (0, Vec::new());
        loop {
            next = match next {
                Next::Call { .. } => {
                    calls += 1;
                    waiting.push(calls);
                    st.started(&rt, &mut h, Ok(calls))
                }
                Next::Wait => {
                    let id = waiting.remove(0);
                    st.call_answer(&rt, &mut h, id, Ok(answer(Code::Ok, 90)))
                }
                Next::Continue => break,
                other => panic!("{other:?}"),
            };
        }
        assert_eq!(calls, 2, "both rules claim");
        let slot = rt.compiled[1].share_record();
        let r = rt
            .store
            .read(slot, |b, _| b.and_then(crate::share::Record::decode))
            .unwrap()
            .expect("the shared rule's record");
        assert_eq!(
            r.bands[0].used.current, 1,
            "the tenant's request counted once"
        );
    }

    #[test]
    fn the_fleets_quota_running_out_sets_this_proxys_part() {
        let rt = runtime(SHARED);
        let mut h = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
        let ours = std::cell::Cell::new(0u64);
        let granted = |hits: u64| {
            ours.set(ours.get() + hits);
            answer(Code::Ok, 50)
        };
        for t in 0..12 {
            let (_, ok) = request_from(&rt, &mut h, 1_000 + t, granted);
            assert!(ok, "request {t}");
        }
        let r = record(&rt);
        assert_eq!(
            r.fleet.part_pm, 0,
            "not known while the fleet's quota lasts"
        );
        assert_eq!(r.fleet.granted, u32::try_from(ours.get()).unwrap());
        assert_eq!(r.fleet.window_end_ms, 1_000 + 30_000, "the service's reset");
        assert_eq!(crate::share::fleet_limit(&r, 100, 1_000, 2_000), None);
        // The service refuses: this proxy's part is cut from what it was granted of the 100.
        let mut refused = 0;
        for t in 12..40 {
            let (_, ok) = request_from(&rt, &mut h, 1_000 + t, |_| answer(Code::OverLimit, 0));
            refused += u64::from(!ok);
        }
        assert!(refused >= 1, "the fleet's quota is spent");
        let r = record(&rt);
        let part = ours.get() * 10 * crate::share::PART_CUT_PM / 1000;
        assert_eq!(u64::from(r.fleet.part_pm), part, "{:?}", r.fleet);
        assert!(r.fleet.spent);
        // Its tenants share that part; a window after the last answer's, this proxy alone.
        assert_eq!(
            crate::share::fleet_limit(&r, 100, 1_000, 2_000),
            Some(part / 10)
        );
        assert_eq!(crate::share::fleet_limit(&r, 100, 1_000, 32_000), None);
        // A refused request logged why: the capacity.
        let shared: Vec<_> = h
            .logs
            .iter()
            .filter(|(_, l)| l.starts_with("shared rule=p"))
            .collect();
        assert!(
            shared.iter().all(|(_, l)| l.contains("reason=capacity")) && !shared.is_empty(),
            "{shared:?}"
        );
    }

    #[test]
    fn a_configuration_update_keeps_what_is_held() {
        let store = std::sync::Arc::new(MemoryStore::new());
        let parse = |json: &str| Config::parse(json.as_bytes()).unwrap();
        let old = Runtime::new(parse(LEASE), Seed([3, 4]), store.clone());
        let mut h = FakeHost::new("10.0.0.1", "/");
        h.now = 1_000;
        let mut st = StreamState::default();
        let Next::Call { message, .. } = st.request_headers(&old, &mut h) else {
            panic!("no claim")
        };
        let block = rls::decode_request(&message).unwrap().hits;
        st.started(&old, &mut h, Ok(1));
        st.call_answer(&old, &mut h, 1, Ok(answer(Code::Ok, 90)));
        // The new configuration (other blocks, another timeout) admits from the same lease.
        let new = Runtime::new(
            parse(&LEASE.replace(
                r#""flush_ms": 10"#,
                r#""flush_ms": 50, "max_block": 2, "timeout_ms": 80"#,
            )),
            Seed([3, 4]),
            store,
        );
        for _ in 1..block {
            let mut st = StreamState::default();
            assert!(matches!(st.request_headers(&new, &mut h), Next::Continue));
        }
    }
}
