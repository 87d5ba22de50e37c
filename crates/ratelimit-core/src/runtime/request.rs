//! One request, from its headers to what the host does with it. **This is where a request is
//! decided**, the same way in every host ([`super::StreamState`] calls it at each step of a
//! stream).
//!
//! [`Runtime::start`] matches the rules, builds each client key and cost, and either decides at
//! once or returns the questions for the services of sync global rules; once they are answered,
//! [`Runtime::finish`] decides. A [`Decision`] says what the host must do: let the request go
//! on (and add fields to the response), hold it until a time, or send a local reply. An
//! admitted request leaves an [`Admitted`] for its response: [`Runtime::response_headers`]
//! writes its fields, and what its rules are owed once the response is known (usage charged
//! from the response, in-flight slots) is settled by [`Runtime::response_trailers`] and
//! [`Runtime::settle`] as the response passes. The host only reads attributes ([`Host`],
//! [`super::Response`]), carries out the decision and provides the store.

pub use super::reply::{failure_reply, Reply, MISSING_KEY_STATUS, UNPRICED_STATUS};
use super::reply::{missing_key_reply, reply, unpriced_reply};
use crate::config::{
    self, Cost, Dialect, FailureMode, GlobalMode, HeaderStyle, MissingKey, PerRequest, Priced,
    Resolved, Rule,
};
use crate::dialect::Classed;
use crate::engine::{self, Check, PerRule, RuleOutcome, ShareCheck};
use crate::global::{self, Answer, Question, Target};
use crate::headers::{self, Report};
use crate::key::{self, Attributes, Descriptor};
use crate::limiter::{Policy, Verdict};
use crate::metrics::{Counter, Gauge};
use crate::runtime::{Compiled, Runtime};
use crate::store::Store;
use crate::table;
use smallvec::SmallVec;
use std::fmt;
use std::sync::PoisonError;

/// The most requests one worker holds in delay mode; beyond it, delay rules only admit
/// requests whose turn is now (the others get the limited reply).
pub const MAX_HELD: usize = 4096;

/// The longest wait counted in `retry_after_seconds`, s.
const MAX_REPORTED_WAIT_S: u64 = 366 * 86_400;

/// What the pipeline needs from the host for one request, besides the store.
pub trait Host: Attributes {
    /// The wall clock, ms since the epoch.
    fn now_ms(&mut self) -> u64;
    /// How many requests this worker holds in delay mode right now.
    fn held(&self) -> usize;
    /// Writes a log line at `level`.
    fn log(&mut self, level: log::Level, line: fmt::Arguments<'_>);
    /// Whether a request body follows the headers (rules sized by it wait for it).
    fn body_follows(&self) -> bool {
        false
    }
    /// A field of the request's body that rules read (`body:` key parts, `match.body`), once
    /// read: `name` is `body.PATH` (`body.model`). The host hands it to the access log (the
    /// native build as dynamic metadata, the wasm build as filter state), for replay.
    fn body_field_read(&mut self, _name: &str, _value: &[u8]) {}
    /// Whether the request's attributes (headers, addresses) can still be read in its body's
    /// hooks: then the rules waiting for body fields read them once, when the body is in,
    /// instead of ahead in the headers' hook as well ([`Runtime::read_ahead`]).
    fn reads_attributes_later(&self) -> bool {
        false
    }
}

/// What to do once a request's headers are in.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // boxing the common variant would allocate per request
pub enum Start {
    /// Decided at once.
    Decided(Decision),
    /// Send each question to its rule's service ([`Runtime::global_of`]), record the answers with
    /// [`Pending::answer`], then call [`Runtime::finish`]; and first, if
    /// [`Pending::reads_body`], size the reservations from the request's body
    /// ([`Runtime::size`]).
    Ask(Pending),
}

/// What the host does with a request.
#[derive(Debug)]
pub enum Decision {
    /// Let it go on, keeping what its response needs (`None`: nothing).
    Continue(Option<Admitted>),
    /// Hold it until `until_ms` (delay mode), then let it go on and call
    /// [`Runtime::release`]; if its client goes away first, call [`Runtime::abandon`].
    Hold {
        /// When to let it go on, ms since the epoch.
        until_ms: u64,
        /// What its response needs.
        admitted: Option<Admitted>,
        /// What to count when it goes on or is abandoned.
        held: Held,
    },
    /// Refuse it with this local reply.
    Reply(Reply),
    /// Hold it in a shared rule's line: look again at [`super::Queued::next_look`] with
    /// [`Runtime::turn`]; if its client goes away first, call [`Runtime::leave_line`].
    Queue(super::Queued),
}

/// A request held by delay mode: the rules to count once its fate is known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// (rule index, whether that rule delayed it).
    pub(crate) rules: PerRule<(usize, bool)>,
}

/// Each applied rule's verdict: (rule index, verdict).
pub(super) type Verdicts = SmallVec<[(usize, Verdict); 2]>;

/// What an admitted request's response needs beside its verdicts (see [`Admitted`]).
#[derive(Default)]
pub(super) struct Left {
    /// The headers the services of sync global rules asked to add.
    pub(super) service: Vec<(String, String)>,
    /// What its rules are owed once the response is known.
    pub(super) owed: Vec<Debt>,
    /// The rules its response tells about.
    pub(super) watched: SmallVec<[usize; 1]>,
    /// Whether one of them needs the response's time.
    pub(super) timed: bool,
}

/// What an admitted request leaves for its response: the verdicts its rate-limit fields report
/// (written by [`Runtime::response_headers`]), the headers the services of sync global rules
/// asked to add, and what its rules are owed once the response is known. The host keeps it
/// until the stream ends and then hands it to [`Runtime::settle`].
#[derive(Debug)]
pub struct Admitted {
    /// (rule index, verdict); empty when the configuration sends no fields on allowed
    /// responses.
    pub(super) verdicts: Verdicts,
    pub(super) service: Vec<(String, String)>,
    /// Not settled yet.
    pub(super) owed: Vec<Debt>,
    /// Response body bytes so far.
    pub(super) body_bytes: u64,
    /// The scan of the response body for the usage it reports, once the headers said how to.
    pub(super) scan: Option<Box<BodyScan>>,
    /// The rules this response tells about: elastic rules (the backend's health) and shared
    /// rules (what the provider says of its limit).
    pub(super) watched: SmallVec<[usize; 1]>,
    /// Whether one of them judges latency or learns from the provider (the response's time is
    /// needed then).
    timed: bool,
    /// Whether the fields carry times of day (Anthropic's resets: the time is needed then).
    dated: bool,
    /// When the request was admitted, ms since the epoch (its response's latency is measured
    /// from here).
    pub(super) admitted_ms: u64,
}

impl Admitted {
    /// A rule's quota changed after a charge: the fields report it.
    pub(super) fn update_verdict(&mut self, rule: usize, v: Verdict) {
        if let Some(slot) = self.verdicts.iter_mut().find(|(r, _)| *r == rule) {
            slot.1 = v;
        }
    }

    /// Whether the response body's bytes are read (a rule's usage is in them), not only
    /// counted.
    pub fn scans_body(&self) -> bool {
        self.scan.as_ref().is_some_and(|s| s.reads())
    }

    /// Whether anything is still owed: the host must keep this until the stream ends.
    pub fn owes(&self) -> bool {
        !self.owed.is_empty()
    }

    /// Whether [`Runtime::response_headers`] needs the time (to charge, or to measure a
    /// response's latency); otherwise any value will do.
    pub fn needs_clock(&self) -> bool {
        !self.owed.is_empty() || self.timed || self.dated
    }
}

/// The scan of one response body for the usage it reports.
#[derive(Debug)]
pub(super) struct BodyScan {
    /// `None`: the body cannot be read (compressed): its usage is not reported.
    pub(super) scanner: Option<crate::usage::Scanner>,
}

impl BodyScan {
    /// Whether the body's bytes are read.
    pub(super) fn reads(&self) -> bool {
        self.scanner.is_some()
    }
}

/// What an admitted request owes one rule's key.
#[derive(Clone, Debug)]
pub(super) struct Debt {
    pub(super) rule: usize,
    pub(super) slot: u64,
    pub(super) alt: u64,
    pub(super) fingerprint: u64,
    /// The rule's algorithm with the limit the request was admitted under (a limit read from
    /// the request is the request's own; an elastic limit its base).
    pub(super) policy: Policy,
    pub(super) kind: DebtKind,
    /// The prices a rule charged in money charges it at.
    pub(super) priced: Priced,
    /// A global rule's usage goes to its service too (boxed: most rules are local).
    pub(super) report: Option<Box<ServiceReport>>,
    /// A shared rule's record (its slot) and how the capacity is shared: the usage goes to the
    /// capacity, the band and the tenant.
    pub(super) share: Option<(u64, crate::share::Share)>,
}

/// What a lease claim's answer did for the request that claimed ([`Runtime::promote`]).
pub(super) enum Claimed {
    /// Granted: the request took its cost from the block.
    Granted(Verdict),
    /// Refused by the service.
    Refused(Verdict),
}

/// How a global rule charged by its responses reports the usage to its service: in the next
/// flush, as async rules report their hits.
#[derive(Clone, Debug)]
pub(super) struct ServiceReport {
    pub(super) hash: u64,
    pub(super) entries: Descriptor,
    pub(super) target: Target,
    /// What the service was told already (a sync rule's reservation, its `hits_addend`).
    pub(super) told: u64,
    /// Whether the key is counted here too (async), or by the service alone (sync).
    pub(super) local: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DebtKind {
    /// The usage the response reports (the rule's [`config::Charge`] says where), nothing
    /// counted yet.
    Usage,
    /// The usage the response reports, against this reservation counted at admission.
    Reserved(u64),
    /// The in-flight slot taken at this time, ms.
    Slot(u64),
}

/// A request between the questions to the services and the decision.
#[derive(Clone, Debug, Default)]
pub struct Pending {
    pub(super) checks: PerRule<Check>,
    /// The checks of shared capacities, by index in `checks` (none for plain rules).
    pub(super) shares: Vec<engine::Shared>,
    pub(super) applied: PerRule<Applied>,
    pub(super) questions: Vec<Question>,
    pub(super) answers: Vec<Option<Answer>>,
    /// What each question's rule made of the request (as `applied` for the checks).
    pub(super) asked: Vec<Applied>,
    /// The lease checks of shared capacities that became claims (the question's index, the
    /// check): a request that waits its turn takes from the lease in the line.
    pub(super) lent: Vec<(usize, Check)>,
    /// The checks whose cost is sized from the request's body, not sized yet.
    pub(super) sized: SmallVec<[usize; 1]>,
    /// The rules that read fields of the request's body, waiting for them (rule indexes).
    pub(super) deferred: SmallVec<[usize; 1]>,
    /// The request's `content-length`, when a rule sizes by it.
    pub(super) content_length: Option<u64>,
    /// Decided after its answer began: it cannot be refused, and a rule charged by the
    /// response is owed its usage even if it would have refused it.
    pub(super) late: bool,
    /// Refused, it is refused at once (it waited in a shared rule's line already).
    pub(super) no_wait: bool,
    /// The shared rule whose line it waited in, its band there, and when it joined it (ms).
    pub(super) waited: Option<(usize, u8, u64)>,
}

impl Pending {
    /// How check `i`'s capacity is shared, if it is a shared capacity's.
    pub(super) fn share_of(&self, i: usize) -> Option<&ShareCheck> {
        self.shares
            .iter()
            .find(|(at, _)| *at == i)
            .map(|(_, sc)| sc)
    }

    /// Takes check `i` (and what its rule made of the request) out of the request's checks,
    /// keeping the shared capacities' indexes on their checks.
    pub(super) fn take_check(&mut self, i: usize) -> (Check, Applied) {
        self.shares.retain_mut(|(at, _)| {
            let kept = *at != i;
            *at -= usize::from(*at > i);
            kept
        });
        (self.checks.remove(i), self.applied.remove(i))
    }

    /// Whether every question is a shared capacity's claim that `answered(n)` accepts (or one
    /// asked again): a request refused with such questions may wait in the rule's line.
    pub(super) fn claims_only(&self, answered: impl Fn(usize) -> bool) -> bool {
        self.questions.iter().enumerate().all(|(n, q)| {
            q.retried
                || (q.claim.is_some()
                    && self.asked.get(n).is_some_and(|a| a.capacity)
                    && answered(n))
        })
    }

    /// Whether reservations wait to be sized from the request's body.
    pub fn reads_body(&self) -> bool {
        !self.sized.is_empty() || !self.deferred.is_empty()
    }

    /// Whether sync global rules ask their services.
    pub fn asks(&self) -> bool {
        !self.questions.is_empty()
    }

    /// The questions for the services of sync global rules, in order.
    pub fn questions(&self) -> &[Question] {
        &self.questions
    }

    /// Records the answer to question `i` (the first one counts).
    pub fn answer(&mut self, i: usize, answer: Answer) {
        if let Some(slot @ None) = self.answers.get_mut(i) {
            *slot = Some(answer);
        }
    }

    /// Whether every question has its answer.
    pub fn complete(&self) -> bool {
        self.answers.iter().all(Option::is_some)
    }

    /// Question `i`'s rule and message, taken to be sent (`None` past the last question).
    pub(super) fn take_question(&mut self, i: usize) -> Option<(usize, usize, Vec<u8>)> {
        let q = self.questions.get_mut(i)?;
        Some((i, q.rule, std::mem::take(&mut q.message)))
    }
}

/// Why a rule does not apply to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Skip {
    /// Its `match` does not hold.
    NoMatch,
    /// A part of its key is missing from the request.
    MissingPart,
}

/// What a rule makes of a request it applies to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Applying {
    /// The keyed hash of the client key.
    pub(crate) hash: u64,
    /// What the request costs (a reservation for a rule charged by its response).
    pub(crate) cost: u64,
    /// The rule's algorithm with the limit in force for this request (before elastic scaling).
    pub(crate) policy: Policy,
    /// The numbers of the limit the request carried.
    pub(crate) carried: Carrying,
    /// Whether a part of the key was missing, keyed as the rule's shared value
    /// (`on_missing_key: shared`).
    pub(crate) keyless: bool,
    /// The prices of a rule charged in money (`Priced::Default` for any other); `None`: the
    /// model named has no price, and the rule refuses it.
    pub(crate) priced: Option<Priced>,
}

/// The numbers of a rule's limit one request carried, and what became of each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Carrying {
    /// The limit (`requests_per_unit` or `in_flight.max`), if read from the request.
    pub limit: Option<Resolved>,
    /// The burst, if read from the request.
    pub burst: Option<Resolved>,
}

impl Carrying {
    /// Counts a default or a cap applied to rule `rule`.
    fn count(&self, metrics: &crate::metrics::Metrics, rule: usize) {
        for r in [self.limit, self.burst].into_iter().flatten() {
            let counter = match r {
                Resolved::Taken(_) => continue,
                Resolved::Missing(_) => Counter::LimitDefaulted,
                Resolved::Invalid(_) => Counter::LimitInvalid,
                Resolved::Capped(_) => Counter::LimitCapped,
            };
            metrics.add(rule, counter, 1);
        }
    }
}

/// `policy` with the numbers of its limit that the request carries (`per_request`).
fn carried_policy(
    per_request: &PerRequest,
    policy: Policy,
    host: &mut impl Attributes,
) -> (Policy, Carrying) {
    let mut resolve = |f: &config::FromRequest| f.resolve(key::carried(&f.source, host));
    let carrying = Carrying {
        limit: per_request.limit.as_ref().map(&mut resolve),
        burst: per_request.burst.as_ref().map(&mut resolve),
    };
    (policy_carrying(per_request, policy, carrying), carrying)
}

/// `policy` with the numbers `carrying` says are in force.
pub(crate) fn policy_carrying(
    per_request: &PerRequest,
    policy: Policy,
    carrying: Carrying,
) -> Policy {
    let limit = carrying
        .limit
        .map_or(policy.limit_and_window().0, |r| u64::from(r.value()));
    let burst = match (carrying.burst, per_request.burst_is_limit) {
        (Some(b), _) => u64::from(b.value()),
        (None, true) => limit,
        (None, false) => policy.burst().unwrap_or(limit),
    };
    policy.with_limit(limit, burst)
}

/// A rule that applies to the request, besides its [`Check`].
#[derive(Clone, Debug)]
pub(super) struct Applied {
    pub(super) rule: usize,
    /// The keyed hash of the client key.
    pub(super) hash: u64,
    /// A global rule's descriptor for its service: built with a sync rule's question, else
    /// the first time a call needs it ([`Runtime::describe`]; `None` until then).
    pub(super) descriptor: Option<Descriptor>,
    /// The prices a rule charged in money charges the request at.
    pub(super) priced: Priced,
    /// The lease of a shared capacity leased across Envoys (the rule's second check, keyed
    /// on the rule alone: `hash` is [`super::Compiled::capacity_key`]), not the tenant's.
    pub(super) capacity: bool,
}

impl<S: Store> Runtime<S> {
    /// `a`'s descriptor, built from the request the first time one of its rule's calls needs
    /// it: most requests of an async or lease rule make none (`None`: the rule is not global,
    /// or the request lacks a key part its descriptor needs).
    pub(super) fn describe<'a>(
        &self,
        a: &'a mut Applied,
        host: &mut impl Attributes,
    ) -> Option<&'a Descriptor> {
        if a.descriptor.is_none() {
            a.descriptor = self.described(a, host);
        }
        a.descriptor.as_ref()
    }

    /// `a`'s descriptor: a copy of the one built, else built now.
    pub(super) fn described(&self, a: &Applied, host: &mut impl Attributes) -> Option<Descriptor> {
        if let Some(d) = &a.descriptor {
            return Some(d.clone());
        }
        let rule = self.config.rules.get(a.rule)?;
        rule.global.as_ref()?;
        // A shared capacity's lease is one for all tenants: the rule's name alone.
        let parts = if a.capacity { &[][..] } else { &rule.key[..] };
        key::descriptor_entries(&rule.name, parts, rule.shares_missing_key(), host)
    }

    /// Builds the descriptors the rest of the request may need while `host` can still read
    /// the request: before it waits for its body or for its calls (a host may not show the
    /// request's attributes then). A lease rule's is built when it claims
    /// ([`Runtime::promote`]), which is always before.
    pub(super) fn describe_all(&self, p: &mut Pending, host: &mut impl Attributes) {
        for a in p.applied.iter_mut().chain(p.asked.iter_mut()) {
            let lease = self
                .config
                .rules
                .get(a.rule)
                .and_then(|r| r.global.as_ref())
                .is_none_or(|g| g.mode == GlobalMode::Lease);
            if !lease {
                self.describe(a, host);
            }
        }
    }
}

impl<S: Store> Runtime<S> {
    /// Matches the rules, builds each applying rule's key and cost, and decides, unless sync
    /// global rules must ask their services first.
    pub fn start(&self, host: &mut impl Host) -> Start {
        if let Some(i) = self.plain {
            if let Some(decision) = self.start_plain(i, host) {
                return Start::Decided(decision);
            }
        }
        if let Some(i) = self.shared {
            if let Some(decision) = self.start_shared(i, host) {
                return Start::Decided(decision);
            }
        }
        let mut p = Pending::default();
        // One allocation for many rules, not one per doubling (nothing for a few).
        let n = self.config.rules.len();
        if n > engine::INLINE_RULES {
            p.checks.reserve_exact(n);
            p.applied.reserve_exact(n);
        }
        let full = host.held() >= MAX_HELD;
        let body_follows = host.body_follows();
        for (i, (rule, compiled)) in self.config.rules.iter().zip(&self.compiled).enumerate() {
            if body_follows && compiled.reads_body {
                // Decided once the body's fields are read, if nothing else rules it out.
                if key::failing_before_body(&rule.matcher, host).is_none() {
                    p.deferred.push(i);
                }
                continue;
            }
            if let Err(reply) = self.take(&mut p, i, (rule, compiled), host, full, body_follows) {
                return Start::Decided(Decision::Reply(*reply));
            }
        }
        if p.checks.is_empty() && p.questions.is_empty() && p.deferred.is_empty() {
            return Start::Decided(Decision::Continue(None));
        }
        if p.reads_body() {
            // Only a reservation sized by the body estimates from its length.
            if !p.sized.is_empty() {
                p.content_length = host
                    .header("content-length")
                    .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse().ok());
            }
        } else if p.questions.is_empty() && !self.promotes {
            return Start::Decided(self.finish(host, &p));
        }
        Start::Ask(p)
    }

    /// Rule `i`'s first step for the request ([`Runtime::applying`]): adds its check (or its
    /// question, for a sync global rule) to `p`; `Err` is the reply refusing a request without
    /// the rule's key (`on_missing_key: refuse`).
    fn take(
        &self,
        p: &mut Pending,
        i: usize,
        (rule, compiled): (&Rule, &Compiled),
        host: &mut impl Host,
        full: bool,
        body_follows: bool,
    ) -> Result<(), Box<Reply>> {
        let Applying {
            hash,
            cost,
            policy,
            carried,
            keyless,
            priced,
        } = match self.applying(rule, compiled, host) {
            Ok(a) => a,
            Err(Skip::NoMatch) => return Ok(()),
            Err(Skip::MissingPart) => {
                return match self.missing_key(host, i, rule) {
                    Some(reply) => Err(Box::new(reply)),
                    None => Ok(()),
                };
            }
        };
        if keyless {
            self.metrics.add(i, Counter::KeyMissing, 1);
        }
        let priced = match priced {
            Some(p) => p,
            None => match self.unpriced(host, i, rule) {
                Some(reply) => return Err(Box::new(reply)),
                None => Priced::Dearest, // a shadow rule counts it at the dearest prices
            },
        };
        carried.count(&self.metrics, i);
        // A sync rule asks now (one whose reservation is sized from the body, once sized:
        // [`Runtime::promote`]); async and lease rules decide here, and build their
        // descriptor only when a call needs it ([`Runtime::describe`]).
        let asks = rule.global.as_ref().filter(|g| {
            g.mode == GlobalMode::Sync
                && !(body_follows && rule.charge().is_some_and(|c| c.sized.is_some()))
        });
        if let Some(g) = asks {
            let mut applied = Applied {
                rule: i,
                hash,
                descriptor: None,
                priced,
                capacity: false,
            };
            if let Some(entries) = self.describe(&mut applied, host) {
                p.questions.push(Question {
                    rule: i,
                    hash,
                    cost,
                    message: global::request(&g.domain, entries, cost),
                    claim: None,
                    retried: false,
                });
                p.answers.push(None);
                p.asked.push(applied);
                return Ok(());
            }
        }
        let (slot, alt) = if compiled.policy.uses_log() {
            let log = table::SlotKind::Log.slot(hash % u64::from(self.config.capacity.max(1)));
            (log, log)
        } else {
            table::slots_of(hash, self.buckets)
        };
        let mut policy = policy;
        let mut base = None;
        if let Some(w) = &compiled.watch {
            let factor = w.factor.load(std::sync::atomic::Ordering::Relaxed);
            if factor != crate::elastic::BASE {
                base = Some(policy);
                policy = policy.scaled(factor);
            }
        }
        if let (Policy::Gcra(gp), true) = (&mut policy, full) {
            if gp.max_delay_ms.is_some() {
                gp.max_delay_ms = Some(0); // the worker holds all it may: no more holding
            }
        }
        let sized = body_follows && rule.charge().is_some_and(|c| c.sized.is_some());
        if sized {
            p.sized.push(p.checks.len());
        }
        if let Some(sh) = &rule.share {
            // Fleet-fair: the tenant's name in the service's counters, from its key's parts.
            let fleet = sh
                .fleet_fair
                .then(|| compiled.fleet_id(rule, hash, host))
                .flatten()
                .map(|id| crate::engine::FleetAsk {
                    slot: compiled.fair_record(),
                    id,
                    counted: false,
                });
            let sc = ShareCheck {
                record: compiled.share_record(),
                share: sh.params,
                asker: asker(sh, host),
                fleet,
            };
            p.shares.push((p.checks.len(), sc));
        }
        let check = Check {
            slot,
            alt,
            fingerprint: table::fingerprint_of(hash),
            policy,
            cost,
            shadow: rule.shadow,
            charge_later: rule.charge().is_some_and(|c| !c.true_up),
            base,
        };
        p.checks.push(check);
        p.applied.push(Applied {
            rule: i,
            hash,
            descriptor: None,
            priced,
            capacity: false,
        });
        // A shared capacity leased across Envoys: its lease is a second check, after the
        // shares (decided once they admit the request; claimed from the service when this
        // proxy holds too little, [`Runtime::promote`]).
        if let (Some(lease), Some(key)) = (compiled.lease, compiled.capacity_key) {
            if sized {
                p.sized.push(p.checks.len());
            }
            let (slot, alt) = table::slots_of(key, self.buckets);
            p.checks.push(Check {
                slot,
                alt,
                fingerprint: table::fingerprint_of(key),
                policy: lease,
                base: None,
                ..check
            });
            p.applied.push(Applied {
                rule: i,
                hash: key,
                descriptor: None,
                priced,
                capacity: true,
            });
        }
        Ok(())
    }

    /// Reads now every attribute the rules waiting for body fields will read once the body
    /// is in (their conditions, key parts, limits and costs): a host that keeps what it read
    /// can answer them then, even where the request's headers are gone by then (proxy-wasm
    /// lets a filter read them only in the headers' hook, once the headers go on).
    pub(super) fn read_ahead(&self, p: &Pending, host: &mut impl Host) {
        for &i in &p.deferred {
            let Some(rule) = self.config.rules.get(i) else {
                continue;
            };
            for c in key::conditions(&rule.matcher) {
                c.holds(host);
            }
            key::visit_parts(&rule.key, host, true, |_, _| {});
            for from in [&rule.per_request.limit, &rule.per_request.burst]
                .into_iter()
                .flatten()
            {
                key::carried(&from.source, host);
            }
            if let Cost::Header(name) = &rule.cost {
                host.header(name);
            }
            if let Some(sh) = &rule.share {
                let weight = sh.weight_from.as_ref().map(|f| &f.source);
                for source in weight.into_iter().chain(sh.band_from.as_ref()) {
                    key::carried(source, host);
                }
            }
        }
    }

    /// The request's body fields are read: the rules that waited for them take their first
    /// step, seeing them ([`Runtime::take`]).
    pub(super) fn take_deferred(
        &self,
        p: &mut Pending,
        host: &mut impl Host,
    ) -> Result<(), Box<Reply>> {
        let full = host.held() >= MAX_HELD;
        for i in std::mem::take(&mut p.deferred) {
            let (Some(rule), Some(compiled)) = (self.config.rules.get(i), self.compiled.get(i))
            else {
                continue;
            };
            let taken = p.applied.len();
            self.take(p, i, (rule, compiled), host, full, true)?;
            // A global rule keyed on the body's fields builds its descriptor now, while they
            // can be read: a lease's claim, an async rule's report come after.
            if rule.global.is_some() {
                for a in p.applied.iter_mut().skip(taken) {
                    self.describe(a, host);
                }
            }
        }
        Ok(())
    }

    /// How `rule` sees the request: whether it applies, and if so the client key, the cost and
    /// the limit (with the numbers the request carries). The first step of [`Runtime::start`]
    /// for each rule.
    pub(crate) fn applying(
        &self,
        rule: &Rule,
        compiled: &Compiled,
        host: &mut impl Host,
    ) -> Result<Applying, Skip> {
        if !key::matches(&rule.matcher, host) {
            return Err(Skip::NoMatch);
        }
        let shared = rule.shares_missing_key();
        let hash = key::client_key(self.seed, compiled.fingerprint, &rule.key, shared, host)
            .ok_or(Skip::MissingPart)?;
        // A second look only for a rule that keys a missing part: is it this request's?
        let keyless = shared && key::missing_part(&rule.key, host).is_some();
        let cost = match &rule.cost {
            Cost::Fixed(n) => u64::from(*n),
            Cost::Header(name) => config::parse_cost(host.header(name)),
            Cost::Response(charge) => charge.admission(),
        };
        let (policy, carried) = if rule.per_request.any() {
            carried_policy(&rule.per_request, compiled.policy, host)
        } else {
            (compiled.policy, Carrying::default())
        };
        let priced = match rule.price() {
            Some(price) => match &price.model {
                config::ModelFrom::Body(field) => price.lookup(host.body_field(field.slot)),
                config::ModelFrom::Answer(_) => Some(Priced::Answer),
            },
            None => Some(Priced::Default),
        };
        Ok(Applying {
            hash,
            cost,
            policy,
            carried,
            keyless,
            priced,
        })
    }

    /// Decides once every service has answered (a missing answer is an error): the services'
    /// verdicts first, then the local rules, counted only if the services admit the request.
    pub fn finish(&self, host: &mut impl Host, p: &Pending) -> Decision {
        // A failing clock reads as 0, which the algorithms clamp to each key's last time.
        let now = host.now_ms();
        self.finish_at(host, p, now)
    }

    /// [`Runtime::finish`] at `now` (ms), the clock as read for the request's hook.
    pub(super) fn finish_at(&self, host: &mut impl Host, p: &Pending, now: u64) -> Decision {
        self.finish_with(host, p, now, None)
    }

    /// [`Runtime::finish_at`], with the local rules' outcome if they were decided already (a
    /// turn in a shared rule's line).
    pub(super) fn finish_with(
        &self,
        host: &mut impl Host,
        p: &Pending,
        now: u64,
        decided: Option<engine::Outcome>,
    ) -> Decision {
        // The verdicts, kept whole for the response's fields (no copy).
        let mut reported: Verdicts = SmallVec::new();
        let n = p.checks.len() + p.questions.len();
        if n > reported.inline_size() {
            reported.reserve_exact(n);
        }
        let mut service = Vec::new();
        let mut refused = false;
        let mut held = Held::default();
        // Questions whose rules admitted the request (their debts are made once it is).
        let mut asked_ok: SmallVec<[usize; 2]> = SmallVec::new();
        // Claims of shared capacities that let requests wait, which the service refused: the
        // question, where its verdict goes among the reported ones, the verdict.
        let mut spent: SmallVec<[(usize, usize, Verdict); 1]> = SmallVec::new();
        for (n, (q, answer)) in p.questions.iter().zip(&p.answers).enumerate() {
            let (Some(rule), Some(compiled)) =
                (self.config.rules.get(q.rule), self.compiled.get(q.rule))
            else {
                continue;
            };
            if q.retried {
                continue;
            }
            if let Some(claim) = &q.claim {
                // A shared capacity's lease: its rule's shares report and count the request.
                let capacity = p.asked.get(n).is_some_and(|a| a.capacity);
                match self.claimed(q, claim, answer.as_ref(), now) {
                    Ok(Claimed::Granted(v)) => {
                        asked_ok.push(n);
                        if !capacity {
                            held.rules.push((q.rule, false));
                            reported.push((q.rule, v));
                        }
                    }
                    Ok(Claimed::Refused(v))
                        if capacity && !rule.shadow && self.lines.has(q.rule) =>
                    {
                        // The fleet's quota is spent: the request may wait for the next
                        // window in the rule's line; refused below if it does not (its
                        // verdict where it would have been).
                        spent.push((n, reported.len(), v));
                    }
                    Ok(Claimed::Refused(v)) => {
                        refused |= !rule.shadow;
                        self.refusal(host, q.rule, q.hash, &v, q.cost, rule.shadow);
                        if capacity {
                            self.capacity_refusal(host, p, q.rule);
                        }
                        reported.push((q.rule, v));
                    }
                    Err(e) => {
                        self.metrics.add(q.rule, Counter::GlobalErrors, 1);
                        self.failed(host, q.rule, now, &e);
                        refused |= self.config.failure_mode == FailureMode::Deny && !rule.shadow;
                    }
                }
                continue;
            }
            match global::verdict(answer.as_ref(), &compiled.policy, now) {
                Ok((v, headers)) => {
                    service.extend(headers);
                    if v.allowed {
                        held.rules.push((q.rule, false));
                        asked_ok.push(n);
                    } else {
                        refused |= !rule.shadow;
                        self.refusal(host, q.rule, q.hash, &v, q.cost, rule.shadow);
                    }
                    reported.push((q.rule, v));
                }
                Err(e) => {
                    self.metrics.add(q.rule, Counter::GlobalErrors, 1);
                    self.failed(host, q.rule, now, &e);
                    refused |= self.config.failure_mode == FailureMode::Deny && !rule.shadow;
                }
            }
        }
        if decided.is_none() && (refused || !spent.is_empty()) {
            // Decided (or waiting) before its shares are: its fleet-fair asks count now.
            engine::fair_count_asks(&self.store, &p.checks, &p.shares, now);
        }
        if !spent.is_empty() {
            // Every other question granted (or asked again), and every rule it matched lets
            // requests wait (none would refuse it at once here): it waits for the next window.
            let waits = !refused
                && !p.late
                && !p.no_wait
                && p.applied.iter().all(|a| self.lines.has(a.rule))
                && p.claims_only(|n| asked_ok.contains(&n) || spent.iter().any(|(m, ..)| *m == n));
            if let Some(q) = waits
                .then(|| self.wait_for_quota(p, &spent, host, now))
                .flatten()
            {
                self.give_back_claims(p, &asked_ok, now);
                return Decision::Queue(q);
            }
            for (k, (n, at, v)) in spent.into_iter().enumerate() {
                let Some(q) = p.questions.get(n) else {
                    continue;
                };
                refused = true;
                self.refusal(host, q.rule, q.hash, &v, q.cost, false);
                self.capacity_refusal(host, p, q.rule);
                reported.insert((at + k).min(reported.len()), (q.rule, v));
            }
        }
        let outcome = match decided {
            Some(o) => Some(o),
            None => (!refused && !p.checks.is_empty()).then(|| {
                engine::decide_shared(
                    &self.store,
                    &p.checks,
                    &p.shares,
                    now,
                    self.config.failure_mode,
                )
            }),
        };
        let allowed = !refused && outcome.as_ref().is_none_or(|o| o.allowed);
        // A shared capacity's lease granted a claim and the shares refused: it may wait, its
        // lease checked again at each turn (what its claim took goes back to the lease).
        if !allowed && !refused && !p.late && !p.no_wait && p.claims_only(|n| asked_ok.contains(&n))
        {
            if let Some(q) = outcome
                .as_ref()
                .and_then(|o| self.may_wait(p, o, host, now))
            {
                self.give_back_claims(p, &asked_ok, now);
                return Decision::Queue(q);
            }
        }
        if let (true, Some((rule, band, since))) = (allowed, p.waited) {
            let waited = now.saturating_sub(since);
            self.metrics.add(rule, Counter::ShareWaitedMs, waited);
            self.metrics
                .add_band(rule, band, crate::metrics::BandCounter::WaitedMs, waited);
        }
        // Held by delay mode: the rules are counted when it goes on; else counted now.
        let delay = match &outcome {
            Some(o) if allowed => o.delay_ms(),
            _ => 0,
        };
        let mut owed = Vec::new();
        let mut watched = SmallVec::new();
        let mut timed = false;
        if let Some(outcome) = &outcome {
            let checked = p.applied.iter().zip(&outcome.rules).zip(&p.checks);
            for (ci, ((a, out), check)) in checked.enumerate() {
                let Some(rule) = self.config.rules.get(a.rule) else {
                    continue;
                };
                if let Some(failure) = self.store_work(a.rule, out) {
                    self.failed(host, a.rule, now, failure);
                }
                let Some(mut v) = out.verdict else {
                    continue;
                };
                if !v.allowed {
                    v = self.wait_for_reservations(a.rule, check, v);
                    self.refusal(host, a.rule, a.hash, &v, check.cost, check.shadow);
                    if let (Some(reason), Some(sc)) = (out.share_refused, p.share_of(ci)) {
                        self.shared_refusal(host, a.rule, a.hash, reason, sc.asker);
                    }
                    if a.capacity {
                        self.capacity_refusal(host, p, a.rule);
                    }
                    if p.late && rule.charge().is_some() {
                        owed.push(Debt {
                            rule: a.rule,
                            slot: check.slot,
                            alt: check.alt,
                            fingerprint: check.fingerprint,
                            policy: check.base.unwrap_or(check.policy),
                            kind: DebtKind::Usage, // nothing was counted
                            priced: a.priced,
                            report: self.service_report(a, check, 0, host),
                            share: p.share_of(ci).map(|sc| (sc.record, sc.share)),
                        });
                    }
                } else if allowed {
                    // A shared capacity's lease (`a.capacity`) only takes what the request
                    // costs, settled with the response: its rule's share check counts, watches
                    // and reports the request.
                    if !a.capacity {
                        if delay > 0 {
                            held.rules.push((a.rule, v.delay_ms > 0));
                        } else {
                            self.metrics.add(a.rule, Counter::Allowed, 1);
                        }
                        if let Some(w) = self.compiled.get(a.rule).and_then(|c| c.watch.as_ref()) {
                            watched.push(a.rule);
                            timed |= w.params.latency_ms.is_some();
                            self.metrics.add(
                                a.rule,
                                Counter::ElasticAllowed,
                                u64::from(out.above_base),
                            );
                        } else if rule.share.as_ref().is_some_and(|sh| sh.learn.is_some()) {
                            // What the provider says of its limit (and its refusals) is read.
                            watched.push(a.rule);
                            timed = true;
                        }
                    }
                    let kind = match (check.policy, rule.charge()) {
                        (Policy::InFlight { .. }, _) => Some(DebtKind::Slot(now)),
                        (_, Some(c)) if c.true_up => Some(DebtKind::Reserved(check.cost)),
                        (_, Some(_)) => Some(DebtKind::Usage),
                        _ => None,
                    };
                    if let Some(kind) = kind {
                        let debt = Debt {
                            rule: a.rule,
                            slot: check.slot,
                            alt: check.alt,
                            fingerprint: check.fingerprint,
                            policy: check.base.unwrap_or(check.policy),
                            kind,
                            priced: a.priced,
                            report: self.service_report(a, check, 0, host),
                            share: p.share_of(ci).map(|sc| (sc.record, sc.share)),
                        };
                        match kind {
                            DebtKind::Slot(_) => self.metrics.gauge(Gauge::InFlight, 1),
                            DebtKind::Reserved(cost) => self.hold_reservation(&debt, cost),
                            DebtKind::Usage => {}
                        }
                        owed.push(debt);
                    }
                    // A rule charged by its responses reports its usage once known.
                    let reports = rule
                        .global
                        .as_ref()
                        .is_some_and(|g| g.mode == GlobalMode::Async && rule.charge().is_none());
                    if reports {
                        let target = Target::of(a.rule, check);
                        // The descriptor is built for the first hits of a key in a flush only.
                        let queued = self
                            .hits
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .count(a.hash, || self.described(a, host), target, check.cost);
                        if !queued {
                            // Too many keys wait for this flush: the service never sees these.
                            self.metrics.add(a.rule, Counter::ReportsLost, check.cost);
                        }
                    }
                }
                // A shared capacity's lease reports only its refusals (its share check the
                // rest).
                if !a.capacity || !v.allowed {
                    reported.push((a.rule, v));
                }
            }
        }
        if !allowed {
            self.give_back_claims(p, &asked_ok, now);
        }
        for &n in asked_ok.iter().filter(|_| allowed) {
            let (Some(q), Some(a)) = (p.questions.get(n), p.asked.get(n)) else {
                continue;
            };
            if let Some(debt) = self.asked_debt(q, a) {
                if let DebtKind::Reserved(cost) = debt.kind {
                    self.hold_reservation(&debt, cost);
                }
                owed.push(debt);
            }
        }
        let left = Left {
            service,
            owed,
            watched,
            timed,
        };
        let admitted = match self.concluded(allowed, reported, left, now) {
            Decision::Continue(admitted) => admitted,
            refused => return refused,
        };
        if delay > 0 {
            self.metrics.gauge(Gauge::DelayQueue, 1);
            let until_ms = now.saturating_add(delay);
            let mut admitted = admitted;
            if let Some(a) = admitted.as_mut() {
                a.admitted_ms = until_ms; // the backend's latency starts when the request goes on
            }
            return Decision::Hold {
                until_ms,
                admitted,
                held,
            };
        }
        self.release_counts(&held);
        Decision::Continue(admitted)
    }

    /// The reply refusing a request its rules refused (`allowed` false), or the request let
    /// go on with what its response needs (`None`: nothing): the fields of the `reported`
    /// verdicts, and what is `left` for it. (No delay: the caller holds a delayed request.)
    #[inline]
    pub(super) fn concluded(
        &self,
        allowed: bool,
        reported: Verdicts,
        left: Left,
        now: u64,
    ) -> Decision {
        let response = self.config.response;
        if !allowed {
            let named = self.named(&reported);
            let classed = self.classed(&reported);
            return Decision::Reply(reply(&response, &named, &classed, now, left.service));
        }
        let fields = response.on_allowed
            && (response.headers != HeaderStyle::None || response.dialect != Dialect::Default);
        let verdicts = if fields { reported } else { SmallVec::new() };
        let dated = fields && response.dialect == Dialect::Anthropic;
        let Left {
            service,
            owed,
            watched,
            timed,
        } = left;
        Decision::Continue(
            (!verdicts.is_empty()
                || !service.is_empty()
                || !owed.is_empty()
                || !watched.is_empty())
            .then_some(Admitted {
                verdicts,
                service,
                owed,
                body_bytes: 0,
                scan: None,
                watched,
                timed,
                dated,
                admitted_ms: now,
            }),
        )
    }

    /// A request whose shared capacities' claims the service refused (`spent`: the fleet's
    /// quota is spent until the window's end) joins the first one's line, if each wait it was
    /// told fits its rule's `max_wait_ms` and the line has room.
    fn wait_for_quota(
        &self,
        p: &Pending,
        spent: &[(usize, usize, Verdict)],
        host: &mut impl Host,
        now: u64,
    ) -> Option<super::Queued> {
        let fits = |(n, _, v): &(usize, usize, Verdict)| {
            let rule = p
                .questions
                .get(*n)
                .and_then(|q| self.config.rules.get(q.rule));
            rule.and_then(|r| r.share.as_ref())
                .is_some_and(|sh| v.retry_after_ms <= sh.max_wait_ms)
        };
        if !spent.iter().all(fits) {
            return None;
        }
        let (n, _, v) = spent.first()?;
        let rule = p.questions.get(*n)?.rule;
        // Any check of the rule: the line finds its share check.
        let ci =
            (0..p.applied.len()).find(|&i| p.applied.get(i).is_some_and(|a| a.rule == rule))?;
        self.join_line(p, rule, ci, v.retry_after_ms, host, now)
    }

    /// A request refused gives back what its granted claims (`asked_ok`) took of their leases.
    fn give_back_claims(&self, p: &Pending, asked_ok: &[usize], now: u64) {
        for q in asked_ok.iter().filter_map(|&n| p.questions.get(n)) {
            if let Some(claim) = &q.claim {
                self.give_back_claim(claim, q.cost, now);
            }
        }
    }

    /// A request refused only by shared rules that let requests wait joins the first one's
    /// line, if the wait it was told fits and the line has room. Nothing it was refused for
    /// is counted yet (its rules count it once a turn admits it or its wait ends).
    fn may_wait(
        &self,
        p: &Pending,
        o: &engine::Outcome,
        host: &mut impl Host,
        now: u64,
    ) -> Option<super::Queued> {
        let mut first = None;
        let checked = p.applied.iter().zip(&o.rules).zip(&p.checks);
        for (ci, ((a, out), check)) in checked.enumerate() {
            let refused = out.verdict.is_some_and(|v| !v.allowed) && !check.shadow;
            if out.failure.is_some() || (refused && !self.lines.has(a.rule)) {
                return None;
            }
            if refused && first.is_none() {
                first = Some((a.rule, ci, out.verdict?.retry_after_ms));
            }
        }
        let (rule, ci, wait) = first?;
        let q = self.join_line(p, rule, ci, wait, host, now)?;
        for (a, out) in p.applied.iter().zip(&o.rules) {
            self.metrics
                .add(a.rule, Counter::StoreRetries, u64::from(out.retries));
        }
        Some(q)
    }

    /// Counts what the store did for a rule; returns why it could not decide, if it could not.
    pub(super) fn store_work<'o>(
        &self,
        rule: usize,
        out: &'o RuleOutcome,
    ) -> Option<&'o engine::Failure> {
        self.metrics
            .add(rule, Counter::StoreRetries, u64::from(out.retries));
        self.metrics
            .add(rule, Counter::SlotEvictions, u64::from(out.evicted));
        match out.share_refused {
            Some(crate::share::Reason::Share) => self.metrics.add(rule, Counter::ShareRefused, 1),
            Some(crate::share::Reason::Band) => self.metrics.add(rule, Counter::BandRefused, 1),
            _ => {}
        }
        if out.filled {
            // A sliding log has a slot of its own, not an entry in a bucket.
            let log = self.compiled.get(rule).is_some_and(|c| c.policy.uses_log());
            let gauge = if log {
                Gauge::TrackedLogs
            } else {
                Gauge::TrackedKeys
            };
            self.metrics.gauge(gauge, 1);
        }
        out.failure.as_ref()
    }

    /// A held request went on: every rule it matched admitted it.
    pub fn release(&self, held: &Held) {
        for &(rule, delayed) in &held.rules {
            self.metrics.add(rule, Counter::Allowed, 1);
            self.metrics.add(rule, Counter::Delayed, u64::from(delayed));
        }
        self.metrics.gauge(Gauge::DelayQueue, -1);
    }

    /// A held request's client went away before its turn: it never went on (its turn stays
    /// taken).
    pub fn abandon(&self, held: &Held) {
        for &(rule, _) in &held.rules {
            self.metrics.add(rule, Counter::Abandoned, 1);
        }
        self.metrics.gauge(Gauge::DelayQueue, -1);
    }

    /// A rule's verdict with its name, quota unit and texts.
    fn report(&self, rule: usize, verdict: Verdict) -> Option<Report<'_>> {
        let r = self.config.rules.get(rule)?;
        Some(Report {
            name: &r.name,
            unit: r.quota_unit.as_deref(),
            verdict,
            texts: self.compiled.get(rule).map(|c| &c.texts),
        })
    }

    /// The verdicts with their rules' names and quota units.
    fn named<'a>(&'a self, verdicts: &[(usize, Verdict)]) -> PerRule<Report<'a>> {
        verdicts
            .iter()
            .filter_map(|&(i, verdict)| self.report(i, verdict))
            .collect()
    }

    /// The verdicts with the kinds of their rules' quotas, as [`Runtime::named`] lists them.
    pub(super) fn classed(&self, verdicts: &[(usize, Verdict)]) -> PerRule<Classed> {
        verdicts
            .iter()
            .filter_map(|&(i, verdict)| Some((self.compiled.get(i)?.kind, verdict)))
            .collect()
    }

    /// Counts a request that went on at once.
    fn release_counts(&self, held: &Held) {
        for &(rule, _) in &held.rules {
            self.metrics.add(rule, Counter::Allowed, 1);
        }
    }

    /// Counts a request a rule refused (or, `shadow`, would have: a shadow rule, or a request
    /// that can no longer be refused) and logs its line. The key appears only as its keyed
    /// hash, the fingerprint the table stores it by (what an operator passes to
    /// [`Runtime::inspect`] and [`Runtime::reset`]): the raw value may be an API key.
    pub(super) fn refusal(
        &self,
        host: &mut impl Host,
        rule: usize,
        hash: u64,
        v: &Verdict,
        cost: u64,
        shadow: bool,
    ) {
        let Some(r) = self.config.rules.get(rule) else {
            return;
        };
        if shadow {
            self.metrics.add(rule, Counter::ShadowLimited, 1);
        } else {
            self.metrics.add(rule, Counter::Limited, 1);
            // At most a year: a request that can never pass is told an absurd wait.
            let wait = headers::ceil_seconds(v.retry_after_ms).min(MAX_REPORTED_WAIT_S);
            self.metrics.add(rule, Counter::RetryAfterSeconds, wait);
        }
        let Some(level) = self.config.log_limited.level() else {
            return;
        };
        host.log(
            level,
            format_args!(
                "limited rule={} shadow={} key={} cost={cost} limit={} window={}s remaining={} retry_after_ms={}",
                r.name, shadow, key::logged(hash), v.limit, v.window_s, v.remaining, v.retry_after_ms
            ),
        );
    }

    /// A shared capacity's lease refused a request (the fleet's quota is spent, or this proxy
    /// holds too little of it): the `shared` line, for the capacity, with the asking tenant
    /// (its share's check in `p`).
    fn capacity_refusal(&self, host: &mut impl Host, p: &Pending, rule: usize) {
        let tenant = p.shares.iter().find_map(|(ci, sc)| {
            let a = p.applied.get(*ci).filter(|a| a.rule == rule)?;
            Some((a.hash, sc))
        });
        if let Some((hash, sc)) = tenant {
            self.shared_refusal(host, rule, hash, crate::share::Reason::Capacity, sc.asker);
        }
    }

    /// A shared rule refused a request: a second line says why and the tenant's band and weight
    /// (`log_limited`'s level; the tenant is the `key` of the `limited` line before it).
    fn shared_refusal(
        &self,
        host: &mut impl Host,
        rule: usize,
        hash: u64,
        reason: crate::share::Reason,
        asker: crate::share::Asker,
    ) {
        let (Some(level), Some(r)) = (self.config.log_limited.level(), self.config.rules.get(rule))
        else {
            return;
        };
        let band = r
            .share
            .as_ref()
            .and_then(|sh| sh.bands.get(usize::from(asker.band)))
            .map_or("", String::as_str);
        let reason = match reason {
            crate::share::Reason::Capacity => "capacity",
            crate::share::Reason::Band => "band",
            crate::share::Reason::Share => "share",
        };
        host.log(
            level,
            format_args!(
                "shared rule={} key={} reason={reason} band={band} weight={}",
                r.name,
                key::logged(hash),
                asker.weight
            ),
        );
    }

    /// A request rule `i` matches lacks a part of its key: counts it, and under
    /// `on_missing_key: refuse` logs it (as `log_limited` says) and returns the reply that
    /// refuses it (a shadow rule only logs).
    fn missing_key(&self, host: &mut impl Host, i: usize, rule: &Rule) -> Option<Reply> {
        self.metrics.add(i, Counter::KeyMissing, 1);
        if rule.on_missing_key != MissingKey::Refuse {
            return None;
        }
        let part = key::missing_part(&rule.key, host);
        if let Some(level) = self.config.log_limited.level() {
            let none = String::new();
            let part_name = part.map_or(none, ToString::to_string);
            host.log(
                level,
                format_args!(
                    "refused rule={} shadow={} missing_key={part_name}",
                    rule.name, rule.shadow
                ),
            );
        }
        (!rule.shadow).then(|| missing_key_reply(rule, part, &self.config.response))
    }

    /// A request naming a model rule `rule` has no price for (`price.default: "refuse"`):
    /// counts it, logs it (as `log_limited` says) and returns the reply refusing it (a shadow
    /// rule only counts and logs).
    fn unpriced(&self, host: &mut impl Host, i: usize, rule: &Rule) -> Option<Reply> {
        self.metrics.add(i, Counter::ModelUnpriced, 1);
        if let Some(level) = self.config.log_limited.level() {
            host.log(
                level,
                format_args!(
                    "refused rule={} shadow={} unpriced_model",
                    rule.name, rule.shadow
                ),
            );
        }
        (!rule.shadow).then(|| unpriced_reply(rule, &self.config.response))
    }

    /// Counts, and logs (at most once a second), a rule the store or the service could not
    /// decide.
    pub(super) fn failed(
        &self,
        host: &mut impl Host,
        rule: usize,
        now: u64,
        why: &dyn fmt::Display,
    ) {
        let mode = self.config.failure_mode;
        let counter = match mode {
            FailureMode::Allow => Counter::FailedOpen,
            FailureMode::Deny => Counter::FailedClosed,
        };
        self.metrics.add(rule, counter, 1);
        if !self.may_log_failure(now) {
            return;
        }
        let name = self.config.rules.get(rule).map_or("", |r| r.name.as_str());
        host.log(
            log::Level::Warn,
            format_args!("rule {name} could not be decided ({why}); failure_mode {mode:?} applied"),
        );
    }
}

/// A shared rule's tenant as this request says: its weight (1 to 65535) and band, each read
/// where the rule says, else the rule's defaults.
pub(super) fn asker(sh: &config::ShareConfig, host: &mut impl Host) -> crate::share::Asker {
    let weight = match &sh.weight_from {
        Some(from) => {
            let n = from.resolve(key::carried(&from.source, host)).value();
            u16::try_from(n).unwrap_or(u16::MAX).max(1)
        }
        None => sh.weight.max(1),
    };
    let band = match &sh.band_from {
        Some(source) => sh.band_of(key::carried(source, host)),
        None => sh.band_default,
    };
    crate::share::Asker {
        weight,
        band,
        again: false,
        wait_ms: sh.max_wait_ms,
    }
}

#[cfg(test)]
mod tests;
