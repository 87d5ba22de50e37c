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
//! [`Response`]), carries out the decision and provides the store.

use crate::config::{
    self, Cost, Dialect, FailureMode, GlobalMode, HeaderStyle, KeyPart, MissingKey, PerRequest,
    Priced, Resolved, ResponseConfig, Rule,
};
use crate::dialect::{self, Classed};
use crate::engine::{self, Check, PerRule, RuleOutcome, ShareCheck};
use crate::global::{self, Answer, Question, Target};
use crate::headers::{self, Fields, Report};
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

/// What the pipeline reads of a response: a header field in [`Runtime::response_headers`], a
/// trailer in [`Runtime::response_trailers`].
pub trait Response {
    /// A field's value by lower-case name (its first line, if it has several).
    fn field(&mut self, name: &str) -> Option<&[u8]>;
    /// Gives `line` each line of a field, in order; a host that has them joined by commas
    /// already may give them as one. HTTP reads several lines of one name as one
    /// comma-separated list (RFC 9110 §5.3), and so does the pipeline where two values must
    /// not pass for one (the provider's fields): this may cost a host more than
    /// [`Response::field`].
    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8]));
    /// Takes a field out (every line of it): a provider's fields a shared rule strips.
    fn remove(&mut self, name: &str);
}

/// A field's value as HTTP reads it, copied: its lines joined by `, ` (`None`: no line).
fn combined(response: &mut impl Response, name: &str) -> Option<SmallVec<[u8; 64]>> {
    let mut value: Option<SmallVec<[u8; 64]>> = None;
    response.field_lines(name, &mut |line| match &mut value {
        None => value = Some(SmallVec::from_slice(line)),
        Some(v) => {
            v.extend_from_slice(b", ");
            v.extend_from_slice(line);
        }
    });
    value
}

/// Takes every limit field of `api` out of a response: they describe the whole account (every
/// tenant's use), not the client's share.
fn strip_provider_fields(api: crate::provider::Api, response: &mut impl Response) {
    use crate::provider::{field_names, Measure};
    let measures = [
        Measure::Requests,
        Measure::Tokens,
        Measure::InputTokens,
        Measure::OutputTokens,
    ];
    for names in measures.iter().filter_map(|&m| field_names(api, m)) {
        for name in names {
            response.remove(name);
        }
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
type Verdicts = SmallVec<[(usize, Verdict); 2]>;

/// What an admitted request leaves for its response: the verdicts its rate-limit fields report
/// (written by [`Runtime::response_headers`]), the headers the services of sync global rules
/// asked to add, and what its rules are owed once the response is known. The host keeps it
/// until the stream ends and then hands it to [`Runtime::settle`].
#[derive(Debug)]
pub struct Admitted {
    /// (rule index, verdict); empty when the configuration sends no fields on allowed
    /// responses.
    verdicts: Verdicts,
    service: Vec<(String, String)>,
    /// Not settled yet.
    pub(super) owed: Vec<Debt>,
    /// Response body bytes so far.
    pub(super) body_bytes: u64,
    /// The scan of the response body for the usage it reports, once the headers said how to.
    pub(super) scan: Option<Box<BodyScan>>,
    /// The rules this response tells about: elastic rules (the backend's health) and shared
    /// rules (what the provider says of its limit).
    watched: SmallVec<[usize; 1]>,
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

/// A local reply refusing a request.
#[derive(Debug)]
pub struct Reply {
    /// The HTTP status.
    pub status: u16,
    content_type: &'static str,
    /// `None` for a refusal that waiting does not lift (a missing client key).
    retry_after: Option<String>,
    /// A `WWW-Authenticate` challenge, for a 401.
    challenge: Option<String>,
    fields: Fields,
    service: Vec<(String, String)>,
    /// The body: `application/problem+json`, or the error of the configured dialect's API
    /// (`application/json`).
    pub body: String,
}

impl Reply {
    /// The reply's header fields, in order.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> {
        let ours = [
            Some(("content-type", self.content_type)),
            self.retry_after.as_deref().map(|r| ("retry-after", r)),
            self.challenge.as_deref().map(|c| ("www-authenticate", c)),
        ];
        ours.into_iter()
            .flatten()
            .chain(self.fields.iter().map(|(k, v)| (k as &str, v)))
            .chain(self.service.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }
}

/// A request between the questions to the services and the decision.
#[derive(Clone, Debug, Default)]
pub struct Pending {
    pub(super) checks: PerRule<Check>,
    pub(super) applied: PerRule<Applied>,
    pub(super) questions: Vec<Question>,
    pub(super) answers: Vec<Option<Answer>>,
    /// What each question's rule made of the request (as `applied` for the checks).
    pub(super) asked: Vec<Applied>,
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
        let slot = if compiled.policy.uses_log() {
            table::SlotKind::Log.slot(hash % u64::from(self.config.capacity.max(1)))
        } else {
            u64::from(table::bucket_of(hash, self.buckets))
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
        let share = rule.share.as_ref().map(|sh| ShareCheck {
            record: compiled.share_record(),
            share: sh.params,
            asker: asker(sh, host),
        });
        let check = Check {
            slot,
            fingerprint: table::fingerprint_of(hash),
            policy,
            cost,
            shadow: rule.shadow,
            charge_later: rule.charge().is_some_and(|c| !c.true_up),
            base,
            share,
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
            p.checks.push(Check {
                slot: u64::from(table::bucket_of(key, self.buckets)),
                fingerprint: table::fingerprint_of(key),
                policy: lease,
                share: None,
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
            self.take(p, i, (rule, compiled), host, full, true)?;
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
        let outcome = match decided {
            Some(o) => Some(o),
            None => (!refused && !p.checks.is_empty())
                .then(|| engine::decide(&self.store, &p.checks, now, self.config.failure_mode)),
        };
        let allowed = !refused && outcome.as_ref().is_none_or(|o| o.allowed);
        if !allowed && !refused && !p.late && !p.no_wait && p.questions.is_empty() {
            if let Some(q) = outcome
                .as_ref()
                .and_then(|o| self.may_wait(p, o, host, now))
            {
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
            for ((a, out), check) in p.applied.iter().zip(&outcome.rules).zip(&p.checks) {
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
                    if let (Some(reason), Some(sc)) = (out.share_refused, &check.share) {
                        self.shared_refusal(host, a.rule, a.hash, reason, sc.asker);
                    }
                    if a.capacity {
                        self.capacity_refusal(host, p, a.rule);
                    }
                    if p.late && rule.charge().is_some() {
                        owed.push(Debt {
                            rule: a.rule,
                            slot: check.slot,
                            fingerprint: check.fingerprint,
                            policy: check.base.unwrap_or(check.policy),
                            kind: DebtKind::Usage, // nothing was counted
                            priced: a.priced,
                            report: self.service_report(a, check, 0, host),
                            share: check.share.as_ref().map(|sc| (sc.record, sc.share)),
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
                            fingerprint: check.fingerprint,
                            policy: check.base.unwrap_or(check.policy),
                            kind,
                            priced: a.priced,
                            report: self.service_report(a, check, 0, host),
                            share: check.share.as_ref().map(|sc| (sc.record, sc.share)),
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
                        let target = Target {
                            rule: a.rule,
                            slot: check.slot,
                            fingerprint: check.fingerprint,
                        };
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
                if !a.capacity {
                    reported.push((a.rule, v));
                }
            }
        }
        for &n in &asked_ok {
            let (Some(q), Some(a)) = (p.questions.get(n), p.asked.get(n)) else {
                continue;
            };
            if !allowed {
                if let Some(claim) = &q.claim {
                    self.give_back_claim(claim, q.cost, now);
                }
            } else if let Some(debt) = self.asked_debt(q, a) {
                if let DebtKind::Reserved(cost) = debt.kind {
                    self.hold_reservation(&debt, cost);
                }
                owed.push(debt);
            }
        }
        let response = self.config.response;
        if !allowed {
            let named = self.named(&reported);
            let classed = self.classed(&reported);
            return Decision::Reply(reply(&response, &named, &classed, now, service));
        }
        let fields = response.on_allowed
            && (response.headers != HeaderStyle::None || response.dialect != Dialect::Default);
        let verdicts = if fields { reported } else { SmallVec::new() };
        let dated = fields && response.dialect == Dialect::Anthropic;
        let admitted = (!verdicts.is_empty()
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
        });
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
        for ((a, out), check) in p.applied.iter().zip(&o.rules).zip(&p.checks) {
            let refused = out.verdict.is_some_and(|v| !v.allowed) && !check.shadow;
            if out.failure.is_some() || (refused && !self.lines.has(a.rule)) {
                return None;
            }
            if refused && first.is_none() {
                first = Some((a.rule, check, out.verdict?.retry_after_ms));
            }
        }
        let (rule, check, wait) = first?;
        let q = self.join_line(p, rule, check, wait, host, now)?;
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
    fn classed(&self, verdicts: &[(usize, Verdict)]) -> PerRule<Classed> {
        verdicts
            .iter()
            .filter_map(|&(i, verdict)| Some((self.compiled.get(i)?.kind, verdict)))
            .collect()
    }

    /// The response's headers are in: charges the rules whose usage they report, then hands
    /// every field to add to `emit(name, value, append)`, the values written into `buf` (keep
    /// one per thread: nothing is allocated then). A rule charged here reports its quota after
    /// the charge; one charged later (body, trailers) reports the quota as it was at admission.
    /// The rate-limit fields are added, not replaced, as Envoy's own local rate limit filter
    /// does (an upstream's own fields stay beside them; replacing costs a search of the
    /// response's headers per field); the services' headers and a dialect's fields replace.
    pub fn response_headers(
        &self,
        a: &mut Admitted,
        response: &mut impl Response,
        now_ms: u64,
        buf: &mut String,
        mut emit: impl FnMut(&str, &str, bool),
        report: &mut impl FnMut(&str, u64),
    ) {
        if !a.owed.is_empty() {
            self.charge_reported(a, response, now_ms, report);
            self.start_scan(a, response);
        }
        if !a.watched.is_empty() {
            self.observe(a, response, now_ms);
        }
        for (k, v) in &a.service {
            emit(k, v, false);
        }
        let describe = |i: usize| {
            let r = self.config.rules.get(i)?;
            Some((
                r.name.as_str(),
                r.quota_unit.as_deref(),
                self.compiled.get(i).map(|c| &c.texts),
            ))
        };
        let style = self.config.response.headers;
        headers::each_field(style, &a.verdicts, describe, false, buf, |k, v| {
            emit(k, v, true)
        });
        // A dialect's fields replace the backend's of the same name (a real API's own limits):
        // its SDK reads one value of each, and two would read as none.
        let dialect = self.config.response.dialect;
        if dialect != Dialect::Default && !a.verdicts.is_empty() {
            let classed = self.classed(&a.verdicts);
            dialect::each_field(dialect, &classed, now_ms, false, buf, |k, v| {
                emit(k, v, false)
            });
        }
    }

    /// Tells each elastic rule the request matched how its backend answered, and each shared
    /// rule what the provider said.
    fn observe(&self, a: &mut Admitted, response: &mut impl Response, now_ms: u64) {
        let status = response
            .field(":status")
            .and_then(|s| std::str::from_utf8(s).ok()?.parse::<u16>().ok())
            .unwrap_or(0);
        let latency = now_ms.saturating_sub(a.admitted_ms);
        // Every rule reads the provider's fields before any are taken out.
        let mut strip: SmallVec<[crate::provider::Api; 1]> = SmallVec::new();
        for rule in std::mem::take(&mut a.watched) {
            let Some(c) = self.compiled.get(rule) else {
                continue;
            };
            if let Some(w) = &c.watch {
                w.observe(status, latency);
            } else if let Some(sh) = self.config.rules.get(rule).and_then(|r| r.share.as_ref()) {
                self.learn(rule, sh, response, status, a.admitted_ms, now_ms);
                if let Some(l) = sh.learn.filter(|l| l.strip && !strip.contains(&l.api)) {
                    strip.push(l.api);
                }
            }
        }
        for api in strip {
            strip_provider_fields(api, response);
        }
    }

    /// A shared rule with `share.learn` had a request admitted and answered: a provider
    /// refusal is counted, and what the provider said of its limit is folded into the rule's
    /// record ([`crate::share::learn`]); [`Runtime::observe`] takes the fields out afterwards
    /// (`strip`).
    fn learn(
        &self,
        rule: usize,
        sh: &crate::config::ShareConfig,
        response: &mut impl Response,
        status: u16,
        admitted_ms: u64,
        now_ms: u64,
    ) {
        use crate::provider::{self, Reading};
        use crate::share::learn;
        let refused = status == 429;
        if refused {
            self.metrics.add(rule, Counter::ProviderLimited, 1);
        }
        let Some(l) = sh.learn else {
            return;
        };
        let Some(names) = provider::field_names(l.api, l.measure) else {
            return;
        };
        // The three fields, whole: a field on two lines is two values, malformed as one on a
        // line `5, 6`, not its first line taken for the limit.
        let mut values: [Option<SmallVec<[u8; 64]>>; 3] = [None, None, None];
        for (slot, name) in values.iter_mut().zip(names) {
            *slot = combined(response, name);
        }
        let reading = provider::read(l.api, l.measure, now_ms, |name| {
            let i = names.iter().position(|n| *n == name)?;
            values.get(i)?.as_deref()
        });
        let said = match reading {
            Reading::Said(s) => Some(s),
            Reading::Absent => None,
            Reading::Invalid => {
                self.metrics.add(rule, Counter::ProviderFieldsInvalid, 1);
                None
            }
        };
        let retry_after_ms = if refused {
            let ms = combined(response, "retry-after-ms");
            let s = combined(response, "retry-after");
            provider::retry_after_ms(ms.as_deref(), s.as_deref(), now_ms)
        } else {
            None
        };
        let answer = learn::Answer {
            said,
            refused,
            retry_after_ms,
        };
        if said.is_none() && !refused {
            return;
        }
        let Some((policy, slot)) = self
            .compiled
            .get(rule)
            .map(|c| (c.policy, c.share_record()))
        else {
            return;
        };
        let folded = engine::update_share_record(&self.store, slot, None, |record| {
            let f = learn::fold(
                &l,
                &sh.params,
                &policy,
                record,
                &answer,
                admitted_ms,
                now_ms,
            );
            (f, f.changed)
        });
        if let Some(f) = folded {
            self.metrics.add(rule, Counter::ProviderSynced, f.synced);
        }
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
    fn refusal(
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
        let tenant = p
            .applied
            .iter()
            .zip(&p.checks)
            .find_map(|(a, c)| c.share.filter(|_| a.rule == rule).map(|sc| (a.hash, sc)));
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

/// The limited reply for the verdicts `reported` (the same verdicts `classed`, with their
/// quotas' kinds) at `now_ms`.
fn reply(
    response: &ResponseConfig,
    reported: &[Report],
    classed: &[Classed],
    now_ms: u64,
    service: Vec<(String, String)>,
) -> Reply {
    let retry_after = headers::retry_after_seconds(reported);
    let mut fields = headers::rate_limit_headers(response.headers, reported, true);
    dialect::each_field(
        response.dialect,
        classed,
        now_ms,
        true,
        &mut String::new(),
        |k, v| fields.push(k, v),
    );
    let refused = classed
        .iter()
        .find(|(_, v)| !v.allowed)
        .and_then(|(k, _)| *k);
    Reply {
        status: response.status,
        content_type: dialect::content_type(response.dialect),
        retry_after: Some(retry_after.to_string()),
        challenge: None,
        fields,
        service,
        body: dialect::body(
            response.dialect,
            response.status,
            reported,
            refused,
            retry_after,
        ),
    }
}

/// A shared rule's tenant as this request says: its weight (1 to 65535) and band, each read
/// where the rule says, else the rule's defaults.
fn asker(sh: &config::ShareConfig, host: &mut impl Host) -> crate::share::Asker {
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
    }
}

/// The status of a request refused for lacking its client key (`on_missing_key: refuse`).
pub const MISSING_KEY_STATUS: u16 = 401;

/// The reply for a request refused because it lacks `part` of `rule`'s key: a 401 without
/// `Retry-After` (waiting does not help), with a `Bearer` challenge when the key is a bearer
/// token.
fn missing_key_reply(rule: &Rule, part: Option<&KeyPart>, response: &ResponseConfig) -> Reply {
    let bearer = |p: &KeyPart| match p {
        KeyPart::Bearer => true,
        KeyPart::First(parts) => parts.contains(&KeyPart::Bearer),
        _ => false,
    };
    let challenge = part
        .filter(|p| bearer(p))
        .map(|_| format!("Bearer realm=\"{}\"", rule.name));
    // The part as configured may hold any character (a body path): escaped for the JSON body.
    let what = part.map_or_else(String::new, |p| {
        let quoted = super::operator_http::json(&format!(" ({p})"));
        let inner = quoted.strip_prefix('"').and_then(|q| q.strip_suffix('"'));
        inner.unwrap_or_default().to_string()
    });
    let detail = format!(
        "Rule \\\"{}\\\" keys each client by a value the request does not carry{what}; send it.",
        rule.name
    );
    Reply {
        status: MISSING_KEY_STATUS,
        content_type: dialect::content_type(response.dialect),
        retry_after: None,
        challenge,
        fields: Fields::default(),
        service: Vec::new(),
        body: dialect::missing_key_body(response.dialect, &rule.name, &detail),
    }
}

/// The status of a request naming a model a rule has no price for.
pub const UNPRICED_STATUS: u16 = 400;

/// The reply for a request naming a model `rule` has no price for: a 400 without
/// `Retry-After` (waiting does not help).
fn unpriced_reply(rule: &Rule, response: &ResponseConfig) -> Reply {
    let detail = format!(
        "Rule \\\"{}\\\" has no price for the model this request names; use a model it prices.",
        rule.name
    );
    Reply {
        status: UNPRICED_STATUS,
        content_type: dialect::content_type(response.dialect),
        retry_after: None,
        challenge: None,
        fields: Fields::default(),
        service: Vec::new(),
        body: dialect::unpriced_body(response.dialect, &rule.name, &detail),
    }
}

/// The reply for a request the filter failed on (a caught panic in the native host, with
/// `failure_mode: deny`): the limited status and a body, in the configured dialect, that says
/// so.
pub fn failure_reply(response: &ResponseConfig) -> Reply {
    let bare = ResponseConfig {
        headers: HeaderStyle::None,
        ..*response
    };
    reply(&bare, &[], &[], 0, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::error::ServiceError;
    use crate::key::Seed;
    use crate::metrics::Counter;
    use crate::rls::{Code, DescriptorStatus, Response as RlsResponse};
    use crate::store::MemoryStore;
    use crate::testkit::{FakeHost, FakeResponse};

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        let config = Config::parse(json.as_bytes()).unwrap();
        Runtime::new(config, Seed([1, 2]), MemoryStore::new())
    }

    #[test]
    fn a_missing_key_part_named_with_any_character_leaves_the_body_json() {
        // Found by the config fuzz target: a body path holding a NUL, a quote and a backslash.
        for dialect in ["default", "openai", "anthropic"] {
            let rt = runtime(&format!(
                r#"{{"rules": [{{"name": "k", "key": ["body:mo\u0000d\"e\\l"],
                    "on_missing_key": "refuse",
                    "rate_limit": {{"requests_per_unit": 5, "unit": "minute"}}}}],
                    "response": {{"dialect": "{dialect}"}}}}"#
            ));
            let reply = match rt.start(&mut FakeHost::new("10.0.0.1", "/")) {
                Start::Decided(Decision::Reply(r)) => r,
                other => panic!("{dialect}: {:?}", matches!(other, Start::Ask(_))),
            };
            assert_eq!(reply.status, MISSING_KEY_STATUS);
            let v: serde_json::Value = serde_json::from_str(&reply.body)
                .unwrap_or_else(|e| panic!("{dialect}: {e}: {}", reply.body));
            assert!(v.to_string().contains(r#"(body:mo\u0000d\"e\\l)"#), "{v}");
        }
    }

    #[test]
    fn a_shared_capacity_holds_a_heavy_tenant_to_its_share_and_reads_weights_and_bands() {
        let rt = runtime(
            r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
                "rate_limit": {"requests_per_unit": 100, "unit": "second"},
                "share": {"weight": {"from": "header:x-weight", "default": 1, "max": 4},
                          "bands": [{"name": "interactive"}, {"name": "batch", "min_share": 0.1}],
                          "band": {"from": "header:x-band", "default": "batch"}}}]}"#,
        );
        let ask = |tenant: &str, weight: &str, band: &str, now: u64| {
            let mut host = FakeHost::new("10.0.0.1", "/")
                .header("x-tenant", tenant)
                .header("x-weight", weight)
                .header("x-band", band);
            host.now = now;
            matches!(decided(&rt, &mut host), Decision::Continue(_))
        };
        let t0 = 1_800_000_000_000;
        // Alone, a tenant may use the whole capacity.
        let alone = (0..150)
            .filter(|&i| ask("heavy", "1", "batch", t0 + i))
            .count();
        assert_eq!(alone, 100);
        // A light tenant arriving then is starved; once the heavy one's first second has
        // slid out of the window, the heavy one is held to its share and the light one passes.
        assert!(!ask("light", "1", "batch", t0 + 200));
        // Its refusal says why, and its band and weight, after the limited line.
        let mut host = FakeHost::new("10.0.0.1", "/")
            .header("x-tenant", "light")
            .header("x-band", "batch");
        host.now = t0 + 201;
        assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
        let lines: Vec<&str> = host.logs.iter().map(|(_, l)| l.as_str()).collect();
        assert!(lines[0].starts_with("limited rule=provider "), "{lines:?}");
        assert!(
            lines[1].starts_with("shared rule=provider key=")
                && lines[1].ends_with(" reason=capacity band=batch weight=1"),
            "{lines:?}"
        );
        let mut light = 0;
        let mut heavy = 0;
        for ms in (1_000..3_000).step_by(10) {
            heavy += u32::from(ask("heavy", "1", "batch", t0 + ms));
            if ms % 100 == 0 && ms > 1_000 {
                light += u32::from(ask("light", "1", "batch", t0 + ms));
            }
        }
        assert_eq!(light, 19, "every light request passes");
        assert!(heavy <= 170, "the heavy one is held to its share: {heavy}");
        // The band and the weight are each request's: the record counts them.
        let record = || {
            let slot = table::SlotKind::Share.slot(rt.compiled[0].fingerprint % (1 << 31));
            let read = rt
                .store
                .read(slot, |b, _| b.and_then(crate::share::Record::decode));
            read.unwrap().unwrap()
        };
        assert_eq!(record().bands[1].active_weight(), 2);
        assert!(ask("vip", "4", "interactive", t0 + 3_000));
        // Admitted or not (the batch band uses its whole budget now that a higher band is
        // active), the request counts its tenant as active, by the weight and band it reads.
        ask("odd", "junk", "nonsense", t0 + 3_001);
        let record = record();
        assert_eq!(record.bands[0].active_weight(), 4, "the interactive band");
        // Refusals for a share are counted apart (and in `limited`).
        let counted = counts(&rt);
        let share_refused: u64 = counted
            .iter()
            .filter(|(_, c, _)| *c == Counter::ShareRefused)
            .map(|(_, _, n)| n)
            .sum();
        assert!(share_refused > 0, "{counted:?}");
        assert_eq!(
            record.bands[1].active_weight(),
            3,
            "junk weighs the default, in the default band"
        );
    }

    #[test]
    fn a_shared_capacity_learns_the_provider_s_limit_and_strips_its_fields() {
        let rt = runtime(
            r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
                "rate_limit": {"requests_per_unit": 100, "unit": "second"},
                "algorithm": "token_bucket", "burst": 100,
                "share": {"learn": {"from": "openai", "unit": "second", "hold_s": 5,
                                    "max_block_s": 2}}}]}"#,
        );
        let ask = |now: u64| admitted_at(&rt, "a", now);
        let t0 = 1_800_000_000_000;
        let mut a = ask(t0).unwrap();
        assert!(a.is_some(), "a shared rule's answer is watched");
        // The provider says 60 a second, 59 left: the fields are read, then taken out.
        let mut response = FakeResponse(vec![
            (":status".into(), b"200".to_vec()),
            ("x-ratelimit-limit-requests".into(), b"60".to_vec()),
            ("x-ratelimit-remaining-requests".into(), b"59".to_vec()),
            ("x-ratelimit-reset-requests".into(), b"1s".to_vec()),
            ("x-ratelimit-limit-tokens".into(), b"5000".to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
        ]);
        respond(&rt, &mut a, &mut response, t0 + 1);
        let names: Vec<&str> = response.0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [":status", "content-type"],
            "the account's fields are gone"
        );
        // Two seconds later: about 60 pass in a second, not about 100.
        let passed = (0..1000).filter(|i| ask(t0 + 2_000 + i).is_some()).count();
        // After the hold and the ramp, the configured capacity again.
        let configured = (0..1000).filter(|i| ask(t0 + 60_000 + i).is_some()).count();
        // (A lone tenant asking 1000 a second gets the bucket, then what refills, up to the
        // level: 97 % of a window's worth plus a burst.)
        assert!((60..=80).contains(&passed), "{passed}");
        assert!((100..=130).contains(&configured), "{configured}");
        // A provider refusal: counted, and everyone waits what it asked, at most max_block.
        let mut a = ask(t0 + 70_000).unwrap();
        let mut refusal = FakeResponse(vec![
            (":status".into(), b"429".to_vec()),
            ("retry-after".into(), b"30".to_vec()),
            ("x-ratelimit-remaining-requests".into(), b"-1".to_vec()),
        ]);
        respond(&rt, &mut a, &mut refusal, t0 + 70_001);
        assert!(ask(t0 + 71_000).is_none());
        assert!(
            ask(t0 + 72_001).is_some(),
            "blocked for two seconds, not thirty"
        );
        let counted = counts(&rt);
        let total = |c: Counter| -> u64 {
            counted
                .iter()
                .filter(|(_, k, _)| *k == c)
                .map(|(_, _, n)| n)
                .sum()
        };
        assert_eq!(total(Counter::ProviderLimited), 1);
        assert_eq!(
            total(Counter::ProviderFieldsInvalid),
            1,
            "a negative remaining"
        );
    }

    #[test]
    fn a_provider_field_on_two_lines_is_two_values_whichever_comes_first() {
        let config = r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
            "rate_limit": {"requests_per_unit": 100, "unit": "second"},
            "algorithm": "token_bucket", "burst": 100,
            "share": {"learn": {"from": "openai", "unit": "second"}}}]}"#;
        let t0 = 1_800_000_000_000;
        for (first, second) in [("50", "80"), ("80", "50")] {
            let rt = runtime(config);
            let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", "a");
            host.now = t0;
            let Decision::Continue(mut a) = decided(&rt, &mut host) else {
                panic!("refused")
            };
            // HTTP reads the two lines as `50, 80`: no limit, the measure malformed as a whole.
            let mut response = FakeResponse(vec![
                (":status".into(), b"200".to_vec()),
                (
                    "x-ratelimit-limit-requests".into(),
                    first.as_bytes().to_vec(),
                ),
                ("x-ratelimit-remaining-requests".into(), b"40".to_vec()),
                ("x-ratelimit-reset-requests".into(), b"1s".to_vec()),
                (
                    "x-ratelimit-limit-requests".into(),
                    second.as_bytes().to_vec(),
                ),
            ]);
            respond(&rt, &mut a, &mut response, t0 + 1);
            let invalid: u64 = counts(&rt)
                .iter()
                .filter(|(_, c, _)| *c == Counter::ProviderFieldsInvalid)
                .map(|(_, _, n)| n)
                .sum();
            assert_eq!(invalid, 1, "{first}, {second}: counted invalid");
            let capacity: Vec<u64> = rt.share_gauges(t0 + 2).iter().map(|g| g.capacity).collect();
            assert_eq!(capacity, [100], "{first}, {second}: the capacity unchanged");
            let names: Vec<&str> = response.0.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, [":status"], "every line taken out");
        }
    }

    #[test]
    fn a_retry_after_on_two_lines_is_no_wait() {
        let rt = runtime(
            r#"{"rules": [{"name": "provider", "key": ["header:x-tenant"],
                "rate_limit": {"requests_per_unit": 100, "unit": "second"},
                "share": {"learn": {"from": "openai", "unit": "second", "max_block_s": 60}}}]}"#,
        );
        let ask = |now: u64| admitted_at(&rt, "a", now);
        let t0 = 1_800_000_000_000;
        let (mut a, mut b) = (ask(t0).unwrap(), ask(t0).unwrap());
        // `retry-after: 30, 1`: not a number of seconds. The refusal blocks for the wait of a
        // refusal that states none (a second), not for 30 s.
        let mut two_lines = FakeResponse(vec![
            (":status".into(), b"429".to_vec()),
            ("retry-after".into(), b"30".to_vec()),
            ("retry-after".into(), b"1".to_vec()),
        ]);
        respond(&rt, &mut a, &mut two_lines, t0 + 1);
        assert!(ask(t0 + 500).is_none(), "blocked");
        assert!(ask(t0 + 2_000).is_some(), "for a second, not 30");
        // The control: one line of 30 s blocks for 30 s.
        let mut one_line = FakeResponse(vec![
            (":status".into(), b"429".to_vec()),
            ("retry-after".into(), b"30".to_vec()),
        ]);
        respond(&rt, &mut b, &mut one_line, t0 + 2_001);
        assert!(ask(t0 + 25_000).is_none(), "one line of 30 s blocks");
    }

    /// A request of tenant `tenant` (`x-tenant`) at `now`: what it was admitted with, if it was.
    fn admitted_at(rt: &Runtime<MemoryStore>, tenant: &str, now: u64) -> Option<Option<Admitted>> {
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", tenant);
        host.now = now;
        match decided(rt, &mut host) {
            Decision::Continue(a) => Some(a),
            _ => None,
        }
    }

    fn decided(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> Decision {
        match rt.start(host) {
            Start::Decided(d) => d,
            Start::Ask(p) => panic!("asked {:?}", p.questions()),
        }
    }

    fn counts(rt: &Runtime<MemoryStore>) -> Vec<(usize, Counter, u64)> {
        let mut out = Vec::new();
        rt.metrics().drain(|r, c, n| out.push((r, c, n)), |_, _| {});
        out
    }

    /// The fields the response gets, its headers being `response`.
    fn respond(
        rt: &Runtime<MemoryStore>,
        a: &mut Option<Admitted>,
        response: &mut FakeResponse,
        now: u64,
    ) -> Vec<(String, String, bool)> {
        let mut out = Vec::new();
        if let Some(a) = a {
            rt.response_headers(
                a,
                response,
                now,
                &mut String::new(),
                |k, v, append| out.push((k.to_string(), v.to_string(), append)),
                &mut |_, _| {},
            );
        }
        out
    }

    fn fields(rt: &Runtime<MemoryStore>, a: &Option<Admitted>) -> Vec<(String, String, bool)> {
        let mut a = a.as_ref().map(|a| Admitted {
            verdicts: a.verdicts.clone(),
            service: a.service.clone(),
            owed: Vec::new(),
            body_bytes: 0,
            scan: None,
            watched: SmallVec::new(),
            timed: false,
            dated: false,
            admitted_ms: 0,
        });
        respond(rt, &mut a, &mut FakeResponse::default(), 0)
    }

    const PER_CLIENT: &str = r#"{"rules": [{"name": "per-client", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}], "log_limited": "info"}"#;

    /// Requests per minute and tokens per hour of one API key, answered in `dialect` only.
    fn llm_runtime(dialect: &str) -> Runtime<MemoryStore> {
        runtime(&format!(
            r#"{{"rules": [
              {{"name": "rpm", "key": ["header:authorization"],
                "rate_limit": {{"requests_per_unit": 2, "unit": "minute"}}}},
              {{"name": "tpm", "key": ["header:authorization"],
                "rate_limit": {{"requests_per_unit": 1000, "unit": "hour"}},
                "cost": {{"response": "header:x-usage", "reserve": 100}}}}],
              "response": {{"headers": "none", "dialect": "{dialect}"}}}}"#
        ))
    }

    fn key_host() -> FakeHost {
        FakeHost::new("10.0.0.1", "/v1/chat/completions").header("authorization", "Bearer sk-1")
    }

    /// A dialect's fields, each replacing the backend's of its name.
    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String, bool)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string(), false))
            .collect()
    }

    #[test]
    fn openai_dialect_on_allowed_answers_and_refusals() {
        let rt = llm_runtime("openai");
        let mut host = key_host();
        let Decision::Continue(mut a) = decided(&rt, &mut host) else {
            panic!("refused")
        };
        // The usage (300 tokens) is charged at the response's headers: the fields report it.
        let mut response = FakeResponse::with("x-usage", "300");
        assert_eq!(
            respond(&rt, &mut a, &mut response, 600_000),
            owned(&[
                ("x-ratelimit-limit-requests", "2"),
                ("x-ratelimit-limit-tokens", "1000"),
                ("x-ratelimit-remaining-requests", "1"),
                ("x-ratelimit-remaining-tokens", "700"),
                ("x-ratelimit-reset-requests", "2m0s"),
                ("x-ratelimit-reset-tokens", "50m12s"),
            ])
        );
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        host.now += 30_000;
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("admitted over the limit")
        };
        assert_eq!(
            r.headers().collect::<Vec<_>>(),
            [
                ("content-type", "application/json"),
                ("retry-after", "60"),
                ("x-ratelimit-limit-requests", "2"),
                ("x-ratelimit-limit-tokens", "1000"),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-remaining-tokens", "700"),
                ("x-ratelimit-reset-requests", "1m0s"),
                ("x-ratelimit-reset-tokens", "49m42s"),
                ("retry-after-ms", "60000"),
            ]
        );
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {
                "message": "Rate limit \"rpm\" of 2 requests per 60 s exceeded; retry in 60 s.",
                "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
        );
    }

    #[test]
    fn anthropic_dialect_dates_its_resets() {
        let rt = llm_runtime("anthropic");
        let mut host = key_host();
        let Decision::Continue(mut a) = decided(&rt, &mut host) else {
            panic!("refused")
        };
        assert!(a.as_ref().is_some_and(Admitted::needs_clock));
        let mut response = FakeResponse::with("x-usage", "950");
        // 600 s after the epoch, at the response.
        assert_eq!(
            respond(&rt, &mut a, &mut response, 601_000),
            owned(&[
                ("anthropic-ratelimit-requests-limit", "2"),
                ("anthropic-ratelimit-requests-remaining", "1"),
                ("anthropic-ratelimit-requests-reset", "1970-01-01T00:12:01Z"),
                ("anthropic-ratelimit-tokens-limit", "1000"),
                ("anthropic-ratelimit-tokens-remaining", "50"),
                ("anthropic-ratelimit-tokens-reset", "1970-01-01T01:00:04Z"),
            ])
        );
        // 50 tokens left: a request reserving 100 is refused by the tokens rule.
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("admitted over the limit")
        };
        let headers: Vec<(&str, &str)> = r.headers().collect();
        assert_eq!(headers[0], ("content-type", "application/json"));
        assert!(headers.contains(&("anthropic-ratelimit-tokens-remaining", "50")));
        assert!(!headers.iter().any(|(k, _)| *k == "retry-after-ms"));
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        let message = body["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.starts_with("Rate limit \"tpm\" of 1000 tokens per 3600 s exceeded; retry in "),
            "{message}"
        );
        // The default dialect with its fields off sends none on allowed answers.
        let quiet = runtime(
            r#"{"rules": [{"name": "rpm", "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}],
                "response": {"headers": "none"}}"#,
        );
        assert!(matches!(
            decided(&quiet, &mut key_host()),
            Decision::Continue(None)
        ));
    }

    #[test]
    fn admits_the_limit_then_replies_with_every_field() {
        let rt = runtime(PER_CLIENT);
        let mut host = FakeHost::new("10.0.0.1", "/");
        let Decision::Continue(a) = decided(&rt, &mut host) else {
            panic!("refused")
        };
        // 1 of 2 used at 600 s (a window boundary): the whole quota is back once that request
        // has decayed out of the sliding window, 120 s on.
        assert_eq!(
            fields(&rt, &a),
            [
                ("ratelimit-policy", "\"per-client\";q=2;w=60", true),
                ("ratelimit", "\"per-client\";r=1;t=120", true),
                ("x-ratelimit-limit", "2", true),
                ("x-ratelimit-remaining", "1", true),
                ("x-ratelimit-reset", "120", true),
            ]
            .map(|(k, v, a)| (k.to_string(), v.to_string(), a))
        );
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("admitted over the limit")
        };
        assert_eq!(r.status, 429);
        let headers: Vec<(&str, &str)> = r.headers().collect();
        assert_eq!(headers[0], ("content-type", "application/problem+json"));
        assert_eq!(headers[1], ("retry-after", "90"));
        assert!(headers.contains(&("x-ratelimit-retry-after", "90")));
        assert!(headers.contains(&("ratelimit", "\"per-client\";r=0;t=90")));
        assert!(r.body.contains("\"violated-policies\":[\"per-client\"]"));
        assert_eq!(
            counts(&rt),
            [
                (0, Counter::Allowed, 2),
                (0, Counter::Limited, 1),
                (0, Counter::RetryAfterSeconds, 90)
            ]
        );
        // The limited line, at the configured level, with the key hashed.
        assert_eq!(host.logs.len(), 1);
        let (level, line) = &host.logs[0];
        assert_eq!(*level, log::Level::Info);
        assert!(line.starts_with("limited rule=per-client shadow=false key="));
        assert!(line.ends_with("cost=1 limit=2 window=60s remaining=0 retry_after_ms=90000"));
        assert!(!line.contains("10.0.0.1"));
        // Another client has its own counter; a request no rule applies to passes untouched.
        assert!(matches!(
            decided(&rt, &mut FakeHost::new("10.0.0.2", "/")),
            Decision::Continue(Some(_))
        ));
        let mut no_address = FakeHost::new("10.0.0.3", "/");
        no_address.req.source_address = None;
        assert!(matches!(
            decided(&rt, &mut no_address),
            Decision::Continue(None)
        ));
    }

    #[test]
    fn response_settings_shape_the_fields() {
        let rt = runtime(
            r#"{"rules": [{"name": "a", "rate_limit": {"requests_per_unit": 1, "unit": "second"},
                "cost": {"header": "x-cost"}}],
                "response": {"status": 503, "headers": "ietf", "on_allowed": false}}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/");
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
        // A cost from the header: 5 never fits a limit of 1.
        let mut costly = FakeHost::new("10.0.0.1", "/").header("x-cost", "5");
        costly.now += 5_000;
        let Decision::Reply(r) = decided(&rt, &mut costly) else {
            panic!("admitted")
        };
        assert_eq!(r.status, 503);
        let names: Vec<&str> = r.headers().map(|(k, _)| k).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "retry-after",
                "ratelimit-policy",
                "ratelimit"
            ]
        );
    }

    const DELAY: &str = r#"{"rules": [{"name": "d", "algorithm": "leaky_bucket", "burst": 3,
        "on_limit": "delay", "max_delay_ms": 5000,
        "rate_limit": {"requests_per_unit": 1, "unit": "second"}}]}"#;

    #[test]
    fn sliding_logs_are_tracked_apart_from_the_buckets() {
        // Each key of a sliding_log rule has a slot of its own, not an entry in a bucket: the
        // two gauges each stay within the capacity.
        let rt = runtime(
            r#"{"rules": [
                {"name": "window", "key": ["remote_address"],
                 "rate_limit": {"requests_per_unit": 10, "unit": "minute"}},
                {"name": "log", "algorithm": "sliding_log", "key": ["remote_address"],
                 "rate_limit": {"requests_per_unit": 10, "unit": "minute"}}]}"#,
        );
        for client in ["10.0.0.1", "10.0.0.2", "10.0.0.1"] {
            let mut host = FakeHost::new(client, "/");
            assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        }
        let mut gauges = Vec::new();
        rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
        assert_eq!(gauges, [(Gauge::TrackedKeys, 2), (Gauge::TrackedLogs, 2)]);
    }

    #[test]
    fn delay_mode_holds_and_counts_each_fate() {
        let rt = runtime(DELAY);
        let mut host = FakeHost::new("10.0.0.1", "/");
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        let Decision::Hold { until_ms, held, .. } = decided(&rt, &mut host) else {
            panic!("not held")
        };
        assert_eq!(until_ms, host.now + 1_000);
        let Decision::Hold { held: held2, .. } = decided(&rt, &mut host) else {
            panic!("not held")
        };
        let mut gauges = Vec::new();
        rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
        assert_eq!(gauges, [(Gauge::TrackedKeys, 1), (Gauge::DelayQueue, 2)]);
        // Nothing is counted as admitted until the request goes on.
        rt.release(&held);
        rt.abandon(&held2);
        let mut gauges = Vec::new();
        let mut c = Vec::new();
        rt.metrics()
            .drain(|r, k, n| c.push((r, k, n)), |g, d| gauges.push((g, d)));
        assert_eq!(
            c,
            [
                (0, Counter::Allowed, 1),
                (0, Counter::Delayed, 1),
                (0, Counter::Abandoned, 1)
            ]
        );
        assert_eq!(gauges, [(Gauge::DelayQueue, -2)]);
        // A worker holding all it may: only a request whose turn is now passes.
        let mut full = FakeHost::new("10.0.0.1", "/");
        full.held = MAX_HELD;
        full.now += 10_000;
        assert!(matches!(decided(&rt, &mut full), Decision::Continue(_)));
        assert!(matches!(decided(&rt, &mut full), Decision::Reply(_)));
    }

    const SYNC: &str = r#"{"rules": [
        {"name": "g", "key": ["remote_address"], "rate_limit": {"requests_per_unit": 10, "unit": "minute"},
         "global": {"cluster": "rls", "domain": "edge"}},
        {"name": "local", "rate_limit": {"requests_per_unit": 1, "unit": "minute"}}],
        "failure_mode": "deny"}"#;

    fn ok(code: Code, remaining: u32) -> Answer {
        Ok(RlsResponse {
            overall_code: code,
            statuses: vec![DescriptorStatus {
                code,
                requests_per_unit: Some(10),
                unit_seconds: Some(60),
                limit_remaining: remaining,
                reset_ms: Some(30_000),
            }],
            headers: vec![("x-from-service".into(), "1".into())],
        })
    }

    #[test]
    fn sync_rules_ask_first_and_local_rules_count_only_if_admitted() {
        let rt = runtime(SYNC);
        let mut host = FakeHost::new("10.0.0.1", "/");
        let Start::Ask(mut p) = rt.start(&mut host) else {
            panic!("did not ask")
        };
        let q = &p.questions()[0];
        assert_eq!(q.rule, 0);
        assert_eq!(rt.global_of(q.rule).unwrap().cluster, "rls");
        let entries = vec![
            ("rule".to_string(), b"g".to_vec()),
            ("remote_address".to_string(), b"10.0.0.1".to_vec()),
        ];
        assert_eq!(q.message, global::request("edge", &entries, 1));
        assert!(!p.complete());
        // The service refuses: the local rule counts nothing.
        p.answer(0, ok(Code::OverLimit, 0));
        p.answer(0, ok(Code::Ok, 9)); // a second answer is ignored
        assert!(p.complete());
        let Decision::Reply(r) = rt.finish(&mut host, &p) else {
            panic!("admitted")
        };
        let headers: Vec<(&str, &str)> = r.headers().collect();
        assert!(headers.contains(&("retry-after", "30")));
        assert!(headers.contains(&("x-from-service", "1")));
        assert!(headers.contains(&("ratelimit", "\"g\";r=0;t=30")));
        // Its log line names the client key's hash, as a local refusal's does.
        let (_, line) = host
            .logs
            .iter()
            .find(|(_, l)| l.starts_with("limited rule=g "))
            .unwrap();
        let key = line
            .split("key=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap();
        assert_eq!(key.len(), 16);
        assert_ne!(key, "0000000000000000", "{line}");
        assert!(line.contains(" cost=1 "), "{line}");
        // Admitted by the service: the local rule decides, and counts.
        let Start::Ask(mut p) = rt.start(&mut host) else {
            panic!()
        };
        p.answer(0, ok(Code::Ok, 9));
        let Decision::Continue(a) = rt.finish(&mut host, &p) else {
            panic!("refused")
        };
        let f = fields(&rt, &a);
        assert_eq!(f[0], ("x-from-service".into(), "1".into(), false));
        assert!(f.contains(&(
            "ratelimit-policy".into(),
            "\"g\";q=10;w=60, \"local\";q=1;w=60".into(),
            true
        )));
        // The service fails and failure_mode is deny.
        let Start::Ask(mut p) = rt.start(&mut host) else {
            panic!()
        };
        p.answer(0, Err(ServiceError::Grpc(14)));
        assert!(matches!(rt.finish(&mut host, &p), Decision::Reply(_)));
        assert_eq!(
            counts(&rt),
            [
                (0, Counter::Allowed, 1),
                (0, Counter::Limited, 1),
                (0, Counter::FailedClosed, 1),
                (0, Counter::GlobalErrors, 1),
                (0, Counter::RetryAfterSeconds, 30),
                (1, Counter::Allowed, 1),
            ]
        );
        assert!(host.logs.iter().any(|(l, line)| *l == log::Level::Warn
            && line == "rule g could not be decided (gRPC status 14); failure_mode Deny applied"));
    }

    #[test]
    fn async_rules_report_hits_and_a_refusal_blocks_the_key() {
        let rt = runtime(
            r#"{"rules": [{"name": "g", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
                "global": {"cluster": "rls", "domain": "edge", "mode": "async", "flush_ms": 50}}]}"#,
        );
        assert_eq!(rt.flush_period(), Some(50));
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-ignored", "1");
        for _ in 0..3 {
            assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        }
        let flushes = rt.flush();
        assert_eq!(flushes.len(), 1);
        let entries = vec![
            ("rule".to_string(), b"g".to_vec()),
            ("remote_address".to_string(), b"10.0.0.1".to_vec()),
        ];
        assert_eq!(flushes[0].message, global::request("edge", &entries, 3));
        assert!(rt.flush().is_empty());
        // The fleet is over the limit: this proxy blocks the key until the service's reset.
        rt.flushed(
            &flushes[0].target,
            flushes[0].hits,
            ok(Code::OverLimit, 0),
            host.now,
        );
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("not blocked")
        };
        assert!(r.headers().any(|h| h == ("retry-after", "30")));
        host.now += 30_000;
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        // Errors are counted, nothing else.
        rt.flushed(
            &flushes[0].target,
            flushes[0].hits,
            Err(ServiceError::Reset(1)),
            host.now,
        );
        assert!(counts(&rt).contains(&(0, Counter::GlobalErrors, 1)));
    }

    #[test]
    fn hits_of_keys_past_what_a_flush_holds_are_counted_lost() {
        let rt = runtime(
            r#"{"rules": [{"name": "g", "key": ["header:x-k"],
                "rate_limit": {"requests_per_unit": 100, "unit": "minute"},
                "global": {"cluster": "rls", "domain": "edge", "mode": "async"}}]}"#,
        );
        for k in 0..=global::MAX_ASYNC_KEYS {
            let mut host = FakeHost::new("10.0.0.1", "/").header("x-k", &k.to_string());
            assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        }
        assert!(counts(&rt).contains(&(0, Counter::ReportsLost, 1)));
        assert_eq!(rt.flush().len(), global::MAX_ASYNC_KEYS);
    }

    #[test]
    fn shadow_rules_never_refuse() {
        let rt = runtime(
            r#"{"shadow": true, "rules": [{"name": "s", "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/");
        for _ in 0..3 {
            assert!(matches!(
                decided(&rt, &mut host),
                Decision::Continue(Some(_))
            ));
        }
        assert_eq!(
            counts(&rt),
            [(0, Counter::Allowed, 1), (0, Counter::ShadowLimited, 2)]
        );
    }

    const API_KEY: &str = r#"{"rules": [{"name": "per-key",
        "key": [{"first": ["header:x-api-key", "bearer", "query:key"]}],
        "on_missing_key": "MODE",
        "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}], "log_limited": "info"}"#;

    fn api_key(mode: &str) -> Runtime<MemoryStore> {
        runtime(&API_KEY.replace("MODE", mode))
    }

    #[test]
    fn a_key_counts_the_same_whichever_way_it_is_sent() {
        let rt = api_key("skip");
        let ways = [
            FakeHost::new("10.0.0.1", "/").header("x-api-key", "sk-1"),
            FakeHost::new("10.0.0.2", "/").header("authorization", "Bearer sk-1"),
            FakeHost::new("10.0.0.3", "/v1?key=sk-1"),
        ];
        let mut limited = 0;
        for mut host in ways {
            match decided(&rt, &mut host) {
                Decision::Reply(r) => {
                    assert_eq!(r.status, 429);
                    limited += 1;
                }
                Decision::Continue(_) => {}
                Decision::Hold { .. } | Decision::Queue(_) => panic!("held"),
            }
        }
        // One key of 2 a minute, sent three ways: the third is refused.
        assert_eq!(limited, 1);
        // x-api-key wins over a bearer token sent beside it; another scheme is no key.
        let mut both = FakeHost::new("10.0.0.4", "/")
            .header("x-api-key", "sk-2")
            .header("authorization", "Bearer sk-1");
        assert!(matches!(decided(&rt, &mut both), Decision::Continue(_)));
        let mut basic = FakeHost::new("10.0.0.4", "/").header("authorization", "Basic c2stMQ==");
        assert!(matches!(decided(&rt, &mut basic), Decision::Continue(None)));
        assert_eq!(
            counts(&rt),
            [
                (0, Counter::Allowed, 3),
                (0, Counter::Limited, 1),
                (0, Counter::RetryAfterSeconds, 90),
                (0, Counter::KeyMissing, 1),
            ]
        );
    }

    #[test]
    fn a_request_without_its_key_is_skipped_shared_or_refused() {
        // skip: the rule does not apply (counted in key_missing).
        let rt = api_key("skip");
        for _ in 0..5 {
            let mut host = FakeHost::new("10.0.0.1", "/");
            assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
        }
        assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 5)]);

        // shared: every keyless request shares one key, apart from every real key.
        let rt = api_key("shared");
        let mut outcomes = Vec::new();
        for addr in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
            let mut host = FakeHost::new(addr, "/");
            outcomes.push(matches!(decided(&rt, &mut host), Decision::Continue(_)));
        }
        assert_eq!(outcomes, [true, true, false]);
        let mut keyed = FakeHost::new("10.0.0.1", "/").header("authorization", "bearer sk-9");
        assert!(matches!(
            decided(&rt, &mut keyed),
            Decision::Continue(Some(_))
        ));
        // A value that reads like the shared one's descriptor is a key of its own.
        let mut lookalike = FakeHost::new("10.0.0.1", "/").header("x-api-key", key::MISSING_VALUE);
        assert!(matches!(
            decided(&rt, &mut lookalike),
            Decision::Continue(Some(_))
        ));
        assert!(counts(&rt).contains(&(0, Counter::KeyMissing, 3)));

        // refuse: a 401 that waiting does not lift, with a Bearer challenge.
        let rt = api_key("refuse");
        let mut host = FakeHost::new("10.0.0.1", "/").header("authorization", "Basic eA==");
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("a request without its key went on")
        };
        assert_eq!(r.status, 401);
        let headers: Vec<(&str, &str)> = r.headers().collect();
        assert_eq!(
            headers,
            [
                ("content-type", "application/problem+json"),
                ("www-authenticate", "Bearer realm=\"per-key\""),
            ]
        );
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["status"], 401);
        assert_eq!(body["violated-policies"][0], "per-key");
        assert!(body["detail"]
            .as_str()
            .unwrap()
            .contains("first(header:x-api-key, bearer, query:key)"));
        assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 1)]);
        assert_eq!(
            host.logs,
            [(
                log::Level::Info,
                "refused rule=per-key shadow=false missing_key=first(header:x-api-key, bearer, query:key)".to_string()
            )]
        );
        // A request with its key is limited as usual.
        let mut keyed = FakeHost::new("10.0.0.1", "/").header("x-api-key", "sk-1");
        assert!(matches!(
            decided(&rt, &mut keyed),
            Decision::Continue(Some(_))
        ));

        // A shadow rule only logs; a key that is not a bearer token gets no challenge.
        let rt = runtime(
            r#"{"shadow": true, "rules": [{"name": "s", "key": ["header:x-api-key"], "on_missing_key": "refuse",
                "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/");
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(None)));
        assert_eq!(counts(&rt), [(0, Counter::KeyMissing, 1)]);
        let rt = runtime(
            r#"{"rules": [{"name": "s", "key": ["header:x-api-key"], "on_missing_key": "refuse",
                "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
        );
        let Decision::Reply(r) = decided(&rt, &mut FakeHost::new("10.0.0.1", "/")) else {
            panic!("a request without its key went on")
        };
        assert_eq!(r.headers().count(), 1);
    }

    #[test]
    fn the_failure_reply_says_the_filter_could_not_decide() {
        let r = failure_reply(&ResponseConfig::default());
        assert_eq!(r.status, 429);
        assert!(r.body.contains("could not decide"));
        assert_eq!(r.headers().count(), 2);
        // In a dialect: its body, and OpenAI's retry-after-ms.
        let openai = ResponseConfig {
            status: 503,
            dialect: Dialect::OpenAi,
            ..ResponseConfig::default()
        };
        let r = failure_reply(&openai);
        assert_eq!(r.status, 503);
        assert_eq!(
            r.headers().collect::<Vec<_>>(),
            [
                ("content-type", "application/json"),
                ("retry-after", "1"),
                ("retry-after-ms", "1000")
            ]
        );
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            body["error"]["message"],
            "The rate limiter could not decide; retry in 1 s."
        );
    }

    const TOKENS: &str = r#"{"rules": [{"name": "llm", "key": ["header:x-api-key"],
        "rate_limit": {"requests_per_unit": 10000, "unit": "minute"},
        "cost": {"response": "header:x-usage-tokens", "reserve": 4000, "default": 500}}]}"#;

    fn admitted(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> Option<Admitted> {
        match decided(rt, host) {
            Decision::Continue(a) => a,
            other => panic!("not admitted: {other:?}"),
        }
    }

    #[test]
    fn usage_is_charged_when_the_response_reports_it() {
        let rt = runtime(TOKENS);
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-api-key", "k");
        let now = host.now;
        // Admitted while 4,000 tokens fit; nothing is counted yet.
        let mut a = admitted(&rt, &mut host);
        let mut b = admitted(&rt, &mut host);
        // The upstream says the first used 5,000: charged at its headers, and its fields
        // report the quota after the charge.
        let f = respond(
            &rt,
            &mut a,
            &mut FakeResponse::with("x-usage-tokens", "5000"),
            now,
        );
        assert!(f.contains(&(
            "ratelimit-policy".into(),
            "\"llm\";q=10000;w=60;qu=\"tokens\"".into(),
            true
        )));
        assert!(
            f.contains(&("x-ratelimit-remaining".into(), "5000".into(), true)),
            "{f:?}"
        );
        assert!(!a.as_ref().unwrap().owes());
        // The second reports nothing in its headers but in its trailers: 3,000.
        let f = respond(&rt, &mut b, &mut FakeResponse::default(), now);
        assert!(
            f.contains(&("x-ratelimit-remaining".into(), "10000".into(), true)),
            "{f:?}"
        );
        let mut b = b.unwrap();
        assert!(b.owes());
        rt.response_trailers(
            &mut b,
            &mut FakeResponse::with("x-usage-tokens", " 3000 "),
            now,
            &mut |_, _| {},
        );
        assert!(!b.owes());
        rt.settle(b, now, &mut |_, _| {});
        // 8,000 used: 2,000 left, less than the reserve: refused, with the exact wait (the
        // usage must decay to 6,000).
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("admitted without room for the reserve")
        };
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            body["detail"],
            "Rate limit \"llm\" of 10000 tokens per 60 s exceeded; retry in 75 s."
        );
        // Another key is not affected; a response that never says is charged the default.
        let mut other = FakeHost::new("10.0.0.1", "/").header("x-api-key", "other");
        let c = admitted(&rt, &mut other).unwrap();
        rt.settle(c, now, &mut |_, _| {});
        let counted = counts(&rt);
        assert!(
            counted.contains(&(0, Counter::UsageCharged, 8_500)),
            "{counted:?}"
        );
        assert!(counted.contains(&(0, Counter::UsageUnreported, 1)));
        assert!(counted.contains(&(0, Counter::Allowed, 3)));
        assert!(counted.contains(&(0, Counter::Limited, 1)));
        let f = fields(&rt, &admitted(&rt, &mut other));
        assert!(
            f.contains(&("x-ratelimit-remaining".into(), "9500".into(), true)),
            "{f:?}"
        );
    }

    #[test]
    fn a_key_over_its_limit_stays_refused_until_its_usage_decays() {
        let rt = runtime(
            r#"{"rules": [{"name": "llm", "algorithm": "token_bucket", "burst": 1000,
                "rate_limit": {"requests_per_unit": 1000, "unit": "second"},
                "cost": {"response": "header:x-usage-tokens"}}]}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/");
        let now = host.now;
        let mut a = admitted(&rt, &mut host);
        respond(
            &rt,
            &mut a,
            &mut FakeResponse::with("x-usage-tokens", "3000"),
            now,
        );
        // 2,000 over: refused for 2 s (and one token's worth), then admitted again.
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("admitted over the limit")
        };
        assert!(r.headers().any(|h| h == ("retry-after", "3")), "{r:?}");
        host.now = now + 2_000;
        assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
        host.now = now + 2_001;
        assert!(matches!(decided(&rt, &mut host), Decision::Continue(_)));
    }

    #[test]
    fn body_bytes_are_counted_as_they_pass_and_charged_at_the_end() {
        let rt = runtime(
            r#"{"rules": [{"name": "dl", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 1000, "unit": "day"},
                "cost": {"response": "body_bytes"}}]}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/");
        let now = host.now;
        let mut a = admitted(&rt, &mut host);
        let f = respond(&rt, &mut a, &mut FakeResponse::default(), now);
        assert!(f.contains(&(
            "ratelimit-policy".into(),
            "\"dl\";q=1000;w=86400;qu=\"content-bytes\"".into(),
            true
        )));
        let mut a = a.unwrap();
        for chunk in [400, 300, 200] {
            rt.response_body(&mut a, chunk, None, false, || now, &mut |_, _| {});
        }
        rt.settle(a, now, &mut |_, _| {});
        let f = fields(&rt, &admitted(&rt, &mut host));
        assert!(
            f.contains(&("x-ratelimit-remaining".into(), "100".into(), true)),
            "{f:?}"
        );
        assert!(counts(&rt).contains(&(0, Counter::UsageCharged, 900)));
    }

    #[test]
    fn in_flight_slots_are_taken_and_given_back() {
        let rt = runtime(
            r#"{"rules": [{"name": "tenant", "key": ["header:x-tenant"],
                "in_flight": {"max": 2}}]}"#,
        );
        let mut host = FakeHost::new("10.0.0.1", "/").header("x-tenant", "t");
        let now = host.now;
        let a = admitted(&rt, &mut host).unwrap();
        let b = admitted(&rt, &mut host).unwrap();
        assert!(a.owes() && b.owes());
        let Decision::Reply(r) = decided(&rt, &mut host) else {
            panic!("a third in flight")
        };
        let headers: Vec<(&str, &str)> = r.headers().collect();
        assert!(headers.contains(&("retry-after", "1")));
        assert!(headers.contains(&(
            "ratelimit-policy",
            "\"tenant\";q=2;qu=\"concurrent-requests\""
        )));
        assert!(headers.contains(&("ratelimit", "\"tenant\";r=0")));
        let mut gauges = Vec::new();
        rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
        assert!(gauges.contains(&(Gauge::InFlight, 2)));
        // One ends: a slot is free again, at once.
        rt.settle(a, now + 5, &mut |_, _| {});
        let c = admitted(&rt, &mut host).unwrap();
        assert!(matches!(decided(&rt, &mut host), Decision::Reply(_)));
        rt.settle(b, now + 6, &mut |_, _| {});
        rt.settle(c, now + 7, &mut |_, _| {});
        let mut gauges = Vec::new();
        rt.metrics().drain(|_, _, _| {}, |g, d| gauges.push((g, d)));
        assert!(gauges.contains(&(Gauge::InFlight, -2)), "{gauges:?}");
        for _ in 0..2 {
            assert!(admitted(&rt, &mut host).is_some());
        }
    }

    #[test]
    fn a_request_refused_by_another_rule_takes_no_slot() {
        let rt = runtime(
            r#"{"rules": [
                {"name": "flight", "in_flight": {"max": 5}},
                {"name": "rate", "match": {"path": "/limited"},
                 "rate_limit": {"requests_per_unit": 1, "unit": "hour"}}]}"#,
        );
        let mut limited = FakeHost::new("10.0.0.1", "/limited");
        let a = admitted(&rt, &mut limited).unwrap();
        for _ in 0..10 {
            assert!(matches!(decided(&rt, &mut limited), Decision::Reply(_)));
        }
        rt.settle(a, limited.now, &mut |_, _| {});
        // All five slots are free: the refused requests took none.
        let mut other = FakeHost::new("10.0.0.1", "/other");
        let held: Vec<Admitted> = (0..5).filter_map(|_| admitted(&rt, &mut other)).collect();
        assert_eq!(held.len(), 5);
        assert!(matches!(decided(&rt, &mut other), Decision::Reply(_)));
    }

    #[test]
    fn an_elastic_limit_follows_the_backends_health() {
        let rt = runtime(
            r#"{"rules": [{"name": "e", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 10, "unit": "hour"},
                "elastic": {"ceiling": 2.0, "floor": 0.5, "max_bad_share": 0.1,
                            "latency_ms": 500, "window_s": 10, "ramp_s": 5}}]}"#,
        );
        assert_eq!(rt.tick_period(), Some(crate::runtime::ELASTIC_TICK_MS));
        let mut host = FakeHost::new("10.0.0.1", "/");
        // A healthy backend: 10 quick 200s a second (the requests of other keys, here on a
        // separate rule-less path would do as well: only responses to the rule count).
        let answer = |rt: &Runtime<MemoryStore>, host: &mut FakeHost, status: &str| {
            let mut a = match decided(rt, host) {
                Decision::Continue(a) => a,
                other => return Err(Box::new(other)),
            };
            respond(
                rt,
                &mut a,
                &mut FakeResponse::with(":status", status),
                host.now + 20,
            );
            Ok(())
        };
        let mut factors = Vec::new();
        for second in 0..6 {
            for _ in 0..10 {
                // Each second's requests come from a fresh client key, so the base limit
                // never refuses them.
                host.req.source_address = Some(format!("10.1.{second}.{}:1", factors.len()));
                answer(&rt, &mut host, "200").unwrap();
            }
            host.now += 1_000;
            rt.tick(host.now);
            factors.extend(rt.elastic_factors().map(|(_, pct)| pct));
        }
        // 20 % of the span (0.5× → 2×) a second, from the base: 130 %, 160 %, ... 200 %.
        assert_eq!(factors, [130, 160, 190, 200, 200, 200]);
        // One client may now make 20 requests an hour, 10 of them above the base.
        host.req.source_address = Some("10.9.9.9:1".into());
        for i in 0..20 {
            assert!(answer(&rt, &mut host, "200").is_ok(), "request {i}");
        }
        let Err(refused) = answer(&rt, &mut host, "200") else {
            panic!("admitted over the ceiling")
        };
        let Decision::Reply(r) = *refused else {
            panic!("{refused:?}")
        };
        assert!(
            r.headers().any(|h| h == ("x-ratelimit-limit", "20")),
            "{r:?}"
        );
        assert!(counts(&rt).contains(&(0, Counter::ElasticAllowed, 10)));
        // The backend fails: within a tick of a second of 503s, the limit drops to the floor.
        for i in 0..10 {
            host.req.source_address = Some(format!("10.2.0.{i}:1"));
            answer(&rt, &mut host, "503").unwrap();
        }
        host.now += 1_000;
        assert!(rt.tick(host.now), "a tick reads the shared health");
        assert!(!rt.tick(host.now + 100), "at most once per 250 ms");
        assert_eq!(rt.elastic_factors().collect::<Vec<_>>(), [(0, 50)]);
        // Slow answers count as bad too.
        assert!(rt.compiled[0]
            .watch
            .as_ref()
            .unwrap()
            .params
            .is_bad(200, 501));
    }
}
