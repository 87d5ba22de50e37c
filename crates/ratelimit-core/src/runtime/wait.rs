//! Shared rules' lines: a request a shared capacity refused may wait, up to the rule's
//! `share.max_wait_ms`, for its turn instead of being refused ([`crate::share::queue`]: bands
//! first, tenants in turn by weight, first come first served within a tenant).
//!
//! A waiter holds no quota: its request's checks wait in the line, and a turn decides them
//! again against the shared state (nothing is counted until one admits it). Each waiting
//! stream wakes every [`POLL_MS`] at most (its host holds it as it holds a delayed request)
//! and runs a dispatch round for the whole line: the waiters whose turn it is are decided, and
//! those admitted keep their decision until their own stream wakes and takes it. A waiter
//! whose deadline passes is decided a last time and, refused, answered with the exact wait.
//! A client that hangs up leaves the line; nothing was counted for it.
//!
//! The line is the runtime's: one per worker in the wasm build (each worker's VM has its own
//! runtime), one per process in the native build. Turns are exact within a line; across the
//! wasm build's workers, every turn still passes the shared capacity's checks, so the shares
//! hold; only the order among waiters of different workers is first come, first served.

use super::request::{Decision, Host, Pending};
use super::stream::Late;
use super::Runtime;
use crate::engine;
use crate::metrics::{BandCounter, Counter};
use crate::share::queue::{Offer, ShareQueue, Waiter};
use crate::share::MAX_BANDS;
use crate::store::Store;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The longest a waiting stream sleeps before it looks at the line again, ms.
pub const POLL_MS: u64 = 10;

/// A request waiting in a shared rule's line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    rule: usize,
    ticket: u64,
    /// When it stops waiting, ms.
    deadline_ms: u64,
    /// When its stream first looks at the line, ms.
    first_look_ms: u64,
}

impl Queued {
    /// When its stream first looks at the line (when its wait may be over, at the latest
    /// [`POLL_MS`] after it joined), ms.
    pub fn first_look(&self) -> u64 {
        self.first_look_ms
    }

    /// When its stream should look again at the line, from `now_ms`.
    pub fn next_look(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(POLL_MS).min(self.deadline_ms)
    }
}

/// What a waiting stream finds when it looks at the line.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // returned, never stored: boxing would allocate a turn
pub enum Turn {
    /// Its request is decided (admitted by a turn, or refused at its deadline).
    Decided(Decision),
    /// Still waiting: look again at this time.
    Wait(u64),
}

/// A waiter's request asking a last time, at the end of its wait: refused now, its demand is
/// refused demand (its first ask and its turns did not count it).
fn last_ask(mut p: Pending) -> Pending {
    for (_, sc) in p.shares.iter_mut() {
        sc.asker.again = false;
        sc.asker.wait_ms = 0;
        // A fleet-fair rule counted its demand at its first ask: not again, but its allowance
        // here still decides it.
        if let Some(f) = sc.fleet.as_mut() {
            f.counted = true;
        }
    }
    p
}

/// One shared rule's line.
#[derive(Debug)]
struct Line {
    queue: ShareQueue<u64>,
    /// Each waiter's request, by ticket.
    waiting: Vec<(u64, Pending)>,
    /// Decisions made for waiters whose streams have not taken them yet.
    decided: Vec<(u64, Decision)>,
    next_ticket: u64,
    /// When the last dispatch round ran, ms: one round a millisecond gives every turn that is
    /// due (the waiters that look in the same millisecond find its decisions), where a round per
    /// look made the line's cost grow with the square of its length.
    round_ms: Option<u64>,
}

/// The lines of a configuration's shared rules that let requests wait (by rule index).
#[derive(Debug, Default)]
pub(crate) struct Lines {
    lines: Vec<Option<Mutex<Line>>>,
}

impl Lines {
    /// A line for each shared rule with a `max_wait_ms`.
    pub fn new(rules: &[crate::config::Rule]) -> Lines {
        let lines = rules
            .iter()
            .map(|r| {
                let sh = r.share.as_ref().filter(|s| s.max_wait_ms > 0)?;
                Some(Mutex::new(Line {
                    queue: ShareQueue::new(sh.max_queued, sh.max_queued_per_tenant, 1),
                    waiting: Vec::new(),
                    decided: Vec::new(),
                    next_ticket: 0,
                    round_ms: None,
                }))
            })
            .collect();
        Lines { lines }
    }

    fn line(&self, rule: usize) -> Option<MutexGuard<'_, Line>> {
        let m = self.lines.get(rule)?.as_ref()?;
        Some(m.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Whether rule `rule` lets refused requests wait.
    pub fn has(&self, rule: usize) -> bool {
        self.lines.get(rule).is_some_and(Option::is_some)
    }
}

impl<S: Store> Runtime<S> {
    /// A request the shared rule `rule` refused, with a wait of `retry_after_ms`, joins its
    /// line if it may: the rule lets requests wait that long, and the line (and its tenant's
    /// part of it) has room. Its checks wait in the line.
    pub(super) fn join_line(
        &self,
        p: &Pending,
        rule: usize,
        ci: usize,
        retry_after_ms: u64,
        host: &mut impl Host,
        now: u64,
    ) -> Option<Queued> {
        let sh = self.config.rules.get(rule)?.share.as_ref()?;
        // Refused by its shared capacity's lease: the rule's share check says whose it is.
        let ci = match p.share_of(ci) {
            Some(_) => ci,
            None => (0..p.applied.len()).find(|&i| {
                p.applied.get(i).is_some_and(|a| a.rule == rule) && p.share_of(i).is_some()
            })?,
        };
        let check = p.checks.get(ci)?;
        let asker = p.share_of(ci)?.asker;
        if retry_after_ms > sh.max_wait_ms {
            return None; // it could not pass within the wait
        }
        let mut line = self.lines.line(rule)?;
        line.next_ticket += 1;
        let ticket = line.next_ticket;
        let deadline_ms = now.saturating_add(sh.max_wait_ms);
        let waiter = Waiter {
            handle: ticket,
            tenant: check.fingerprint,
            band: asker.band.min((MAX_BANDS - 1) as u8),
            weight: asker.weight,
            cost: check.cost,
            deadline_ms,
            enqueued_ms: now,
        };
        if line.queue.push(waiter).is_err() {
            self.metrics.add(rule, Counter::ShareQueueFull, 1);
            return None;
        }
        let mut waiting = p.clone();
        waiting.no_wait = true;
        // Its shared capacities' leases that claimed for it: checked again at each turn, as
        // when what this proxy held covered it (its claims' grants went to the leases).
        for (n, check) in std::mem::take(&mut waiting.lent) {
            if let Some(a) = waiting.asked.get(n) {
                let a = a.clone();
                waiting.checks.push(check);
                waiting.applied.push(a);
            }
        }
        waiting.questions.clear();
        waiting.answers.clear();
        waiting.asked.clear();
        // Its turn has no request to read: what the services' reports need is read now.
        self.describe_all(&mut waiting, host);
        for (_, sc) in waiting.shares.iter_mut() {
            sc.asker.again = true;
        }
        waiting.waited = Some((rule, waiter.band, now));
        line.waiting.push((ticket, waiting));
        self.metrics.add(rule, Counter::ShareQueued, 1);
        self.metrics
            .add_band(rule, waiter.band, BandCounter::Queued, 1);
        Some(Queued {
            rule,
            ticket,
            deadline_ms,
            first_look_ms: now
                .saturating_add(retry_after_ms.clamp(1, POLL_MS))
                .min(deadline_ms),
        })
    }

    /// A waiting stream looks at its line at `now`: a dispatch round gives the turns that are
    /// due (each decided again), the waiters past their deadline are decided a last time, and
    /// this stream's decision, if there is one, is its own.
    pub fn turn(&self, q: &Queued, now: u64) -> Turn {
        let Some(mut line) = self.lines.line(q.rule) else {
            return Turn::Wait(now); // never: a queued request's rule has a line
        };
        let line = &mut *line;
        if line.round_ms != Some(now) {
            line.round_ms = Some(now);
            self.round(line, q.rule, now);
        }
        let decided = &mut line.decided;
        match decided.iter().position(|(t, _)| *t == q.ticket) {
            Some(i) => Turn::Decided(decided.swap_remove(i).1),
            None if line.waiting.iter().any(|(t, _)| *t == q.ticket) => {
                Turn::Wait(q.next_look(now))
            }
            // Neither waiting nor decided (never): refused as it stands.
            None => Turn::Decided(super::request::Decision::Reply(super::failure_reply(
                &self.config.response,
            ))),
        }
    }

    /// A dispatch round of rule `rule`'s line at `now`: the waiters whose turn it is are decided
    /// again, and those past their deadline a last time.
    fn round(&self, line: &mut Line, rule: usize, now: u64) {
        let (queue, waiting, decided) = (&mut line.queue, &mut line.waiting, &mut line.decided);
        queue.dispatch_offers([false; MAX_BANDS], |w| {
            let Some(i) = waiting.iter().position(|(t, _)| *t == w.handle) else {
                return Offer::Admitted; // its request is gone: let the line forget it
            };
            let Some((_, p)) = waiting.get(i) else {
                return Offer::Admitted;
            };
            match self.try_turn(p, rule, now) {
                Ok(d) => {
                    let (ticket, _) = waiting.swap_remove(i);
                    decided.push((ticket, d));
                    Offer::Admitted
                }
                Err(offer) => offer,
            }
        });
        queue.expire(now, |w| {
            if let Some(i) = waiting.iter().position(|(t, _)| *t == w.handle) {
                let (ticket, p) = waiting.swap_remove(i);
                self.metrics.add(rule, Counter::ShareQueueTimeouts, 1);
                self.metrics
                    .add_band(rule, w.band, BandCounter::Timeouts, 1);
                let d = self.finish_at(&mut Late { now }, &last_ask(p), now);
                decided.push((ticket, d));
            }
        });
    }

    /// One turn of a request waiting in rule `rule`'s line: decided again. Refused (nothing
    /// counted), for what the band shares ([`Offer::Refused`]; the rule's lease too) or for
    /// something of its own ([`Offer::Skipped`]: the next tenant may pass).
    fn try_turn(&self, p: &Pending, rule: usize, now: u64) -> Result<Decision, Offer> {
        let outcome = engine::decide_shared(
            &self.store,
            &p.checks,
            &p.shares,
            now,
            self.config.failure_mode,
        );
        if !outcome.allowed {
            // Refused for what every waiter of the band meets (the shared capacity, the band's
            // budget): the band's turns end. For anything of its own (its tenant's share,
            // another rule keyed on it): the next tenant's turn.
            let mut band_wide = false;
            for ((a, out), check) in p.applied.iter().zip(&outcome.rules).zip(&p.checks) {
                self.metrics
                    .add(a.rule, Counter::StoreRetries, u64::from(out.retries));
                let refused = out.verdict.is_some_and(|v| !v.allowed) && !check.shadow;
                let shared = matches!(
                    out.share_refused,
                    Some(crate::share::Reason::Capacity | crate::share::Reason::Band)
                );
                // A shared capacity's lease holds too little here: a claim ahead of need
                // brings more; the line's own rule's lease is met by every waiter.
                if refused && a.capacity {
                    self.wake_lease(check, a, now);
                }
                band_wide |= refused && (shared || (a.capacity && a.rule == rule));
            }
            return Err(match band_wide {
                true => Offer::Refused,
                false => Offer::Skipped,
            });
        }
        Ok(self.finish_with(&mut Late { now }, p, now, Some(outcome)))
    }

    /// A waiting stream whose host cannot hold it any longer: it leaves the line and is decided
    /// at once, at `now`, without waiting (admitted if there is room, else refused).
    pub fn decide_now(&self, q: &Queued, now: u64) -> Decision {
        let Some(mut line) = self.lines.line(q.rule) else {
            return Decision::Reply(super::failure_reply(&self.config.response));
        };
        line.queue.remove(q.ticket);
        if let Some(i) = line.decided.iter().position(|(t, _)| *t == q.ticket) {
            return line.decided.swap_remove(i).1;
        }
        let Some(i) = line.waiting.iter().position(|(t, _)| *t == q.ticket) else {
            return Decision::Reply(super::failure_reply(&self.config.response));
        };
        let (_, p) = line.waiting.swap_remove(i);
        drop(line);
        self.finish_at(&mut Late { now }, &last_ask(p), now)
    }

    /// A waiting stream ended (its client left): it leaves the line, and a decision made for it
    /// and never taken is settled (its request was admitted but never went on).
    pub fn leave_line(&self, q: &Queued, now: u64, report: &mut impl FnMut(&str, u64)) {
        let Some(mut line) = self.lines.line(q.rule) else {
            return;
        };
        line.queue.remove(q.ticket);
        line.waiting.retain(|(t, _)| *t != q.ticket);
        let taken = line
            .decided
            .iter()
            .position(|(t, _)| *t == q.ticket)
            .map(|i| line.decided.swap_remove(i).1);
        drop(line);
        match taken {
            Some(Decision::Continue(a)) => {
                self.metrics.add(q.rule, Counter::Abandoned, 1);
                if let Some(a) = a {
                    self.settle(a, now, report);
                }
            }
            // Held by delay mode after its turn: abandoning the hold counts its rules.
            Some(Decision::Hold { admitted, held, .. }) => {
                self.abandon(&held);
                if let Some(a) = admitted {
                    self.settle(a, now, report);
                }
            }
            _ => self.metrics.add(q.rule, Counter::Abandoned, 1),
        }
    }
}
