//! A configuration ready to serve, and everything that happens to the requests it serves.
//!
//! [`Runtime`] is the configuration with the rules compiled once (fingerprints, policies), the
//! store their keys live in, and the metrics not yet published; a host builds one per
//! configuration. **A request is decided in [`request`]** (rules matched, keys built, every rule
//! checked, the verdict written), and what each stream goes through, from its headers to its
//! last byte (asking the services, being held, settling what its response owes), is one state
//! machine, [`StreamState`], that tells the host what to do next. The hosts only read
//! attributes, carry out what they are told and keep the state. An operator looks at one key,
//! lists a rule's busiest keys and resets one through [`operator`], over HTTP through
//! [`operator_http`] (the native build's admin endpoints, the wasm build's operator route).
//! What a configuration does between requests (async flushes, elastic factors, metrics) is
//! another state machine, [`Background`], driven by the host's timer.

pub mod background;
mod charge;
pub mod explain;
mod fleet;
mod fleet_ids;
mod lease;
pub mod operator;
pub mod operator_http;
mod plain;
mod reply;
pub mod request;
mod response;
mod shared;
pub mod stream;
mod wait;

pub use background::{Background, Call, Work};
pub use explain::Explained;
pub use operator::{KeyState, LoggedKey, OperatorError};
pub use operator_http::{OperatorAnswer, OperatorCall};
pub use request::{failure_reply, Admitted, Decision, Held, Host, Pending, Reply, Start, MAX_HELD};
pub use response::Response;
pub use stream::{Next, StreamState};
pub use wait::{Queued, Turn, POLL_MS};

use crate::config::{Config, Rule};
use crate::elastic::{self, Health};
use crate::global::{self, Answer, Flush, Hits, Target};
use crate::key::{self, Seed};
use crate::limiter::Policy;
use crate::metrics::{Counter, Metrics};
use crate::rls;
use crate::store::{Store, MAX_ATTEMPTS};
use crate::table;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A rule with what is computed from it once.
#[derive(Debug)]
pub(crate) struct Compiled {
    /// Mixed into every key hash of the rule; stable across reloads while the rule's name, key
    /// parts and algorithm stay the same.
    pub fingerprint: u64,
    /// The algorithm and its numbers.
    pub policy: Policy,
    /// A lease rule's lease ([`crate::config::Rule::lease_policy`]): `policy` itself, except for
    /// a shared capacity leased across Envoys, whose tenants share it with `policy`.
    pub lease: Option<Policy>,
    /// A shared capacity leased across Envoys: the keyed hash of its lease, one key for all its
    /// tenants (the rule's key is the tenant's).
    pub capacity_key: Option<u64>,
    /// A shared capacity leased across Envoys: this proxy's part of it as the service's last
    /// answer here left it, permille (0: not known; the record holds the part, this copy sizes
    /// the blocks without reading it: [`crate::share::lease_block_cap`]).
    pub part_pm: std::sync::atomic::AtomicU32,
    /// A fleet-fair shared rule: what this Envoy expects to admit a window, cost units ×
    /// [`crate::share::LEVEL_ONE`], as its fair record's last answer left it (`u64::MAX`: not
    /// known; sizes the lease's blocks: [`crate::share::fair::block_cap`]).
    pub fair_part: AtomicU64,
    /// A fleet-fair shared rule: the epoch its fair record's view of the fleet describes
    /// (`u64::MAX`: none yet).
    pub fair_view: AtomicU64,
    /// A fleet-fair shared rule: when the service's window of this runtime's latest lease
    /// answer ends, ms (0: none yet): the blocks claimed near it shrink to what is left of it.
    pub fair_end: AtomicU64,
    /// A fleet-fair shared rule: what the fleet had left of that window as the same answer
    /// said, cost units (`u64::MAX`: not said): its last grants are kept for the tenants
    /// under their shares ([`crate::share::fair::keeping`]).
    pub fair_left: AtomicU64,
    /// A fleet-fair shared rule: this proxy's part of what the service's window is expected to
    /// leave unused, as the same answer said ([`crate::share::fair::spare`]), cost units ×
    /// [`crate::share::LEVEL_ONE`]: good until that window ends (`fair_end`).
    pub fair_spare: AtomicU64,
    /// A fleet-fair shared rule: the most any band of its fair record's view keeps for others
    /// a window ([`crate::share::fair::BandView::reserved`]): while what the fleet has left
    /// covers it, no request reads the record to ask whether its tenant must leave it.
    pub fair_reserved: AtomicU64,
    /// A fleet-fair shared rule: what the fleet is expected to admit a window, as its fair
    /// record's view says ([`crate::share::fair_record::FairRecord::fleet_use`]; 0: not known): blocks
    /// stay large while the window is expected to leave quota unused
    /// ([`crate::share::fair::spare`]).
    pub fair_use: AtomicU64,
    /// A fleet-fair shared rule: the largest block its lease claims, as worked out lately
    /// (`fair_cap_until`: until when it holds, ms; 0: to be worked out again, as after an
    /// answer that changes it).
    pub fair_cap: AtomicU64,
    pub fair_cap_until: AtomicU64,
    /// A fleet-fair shared rule: its last report rode on a claim the service refused whole,
    /// and goes again at the next tick, alone, without waiting for another claim to ride on.
    pub fair_again: std::sync::atomic::AtomicBool,
    /// A fleet-fair shared rule: its tenants' names by client key ([`fleet_ids`]).
    pub fleet_ids: Option<Box<fleet_ids::FleetIds>>,
    /// A lone shared rule leased from its service ([`shared`]): whether its shares refused the
    /// last request decided here on the short path (the next one looks at the lease before the
    /// shares decide, and takes from it after, instead of taking at once and giving back).
    pub share_refusing: std::sync::atomic::AtomicBool,
    /// An elastic rule's view of its backend's health.
    pub watch: Option<Watch>,
    /// What its response fields say whatever the request, written once.
    pub texts: crate::headers::Texts,
    /// What its quota counts, as the LLM APIs' fields name it (`None`: they have no field for
    /// it).
    pub kind: Option<crate::config::Kind>,
    /// Whether the rule reads fields of the request's body (it waits for the body).
    pub reads_body: bool,
}

impl Compiled {
    /// A fleet-fair rule's tenant of client key `hash`: its name in the service's counters
    /// ([`key::fleet_id`], remembered by [`fleet_ids`]); `None` for another rule, or a key part
    /// missing. Not inlined: the request path of every other rule stays as it was.
    #[inline(never)]
    pub fn fleet_id(
        &self,
        rule: &crate::config::Rule,
        hash: u64,
        host: &mut impl key::Attributes,
    ) -> Option<u64> {
        self.fleet_ids.as_ref()?.get_or(hash, || {
            key::fleet_id(&rule.name, &rule.key, rule.shares_missing_key(), host)
        })
    }

    /// A shared rule's record: its store slot ([`table::SlotKind::Share`]).
    pub fn share_record(&self) -> u64 {
        table::SlotKind::Share.slot(self.fingerprint % (1 << 31))
    }

    /// A fleet-fair shared rule: what the service's latest answer here said the fleet has left
    /// of its window, and when that ends (`None`: nothing said).
    pub fn fair_left(&self) -> Option<crate::share::fair::Left> {
        use std::sync::atomic::Ordering::Relaxed;
        let units = self.fair_left.load(Relaxed);
        (units != u64::MAX).then(|| crate::share::fair::Left {
            units,
            end_ms: self.fair_end.load(Relaxed),
        })
    }

    /// A fleet-fair shared rule's fair record ([`crate::share::fair_record`]): its store slot,
    /// in the upper half of the shared records' range.
    pub fn fair_record(&self) -> u64 {
        table::SlotKind::Share.slot(self.fingerprint % (1 << 31) + (1 << 31))
    }
}

/// What one worker (or process) knows of an elastic rule: the factor in force, and the
/// responses seen since it last reported them to the shared [`Health`].
#[derive(Debug)]
pub(crate) struct Watch {
    pub params: elastic::Params,
    /// The store slot of the rule's health.
    slot: u64,
    /// The factor in force, permille.
    pub factor: AtomicU32,
    total: AtomicU64,
    bad: AtomicU64,
}

impl Watch {
    /// Records one response to the rule's traffic.
    pub fn observe(&self, status: u16, latency_ms: u64) {
        self.total.fetch_add(1, Ordering::Relaxed);
        if self.params.is_bad(status, latency_ms) {
            self.bad.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A shared rule's gauges ([`Runtime::share_gauges`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareGauges {
    /// The rule's index.
    pub rule: usize,
    /// `share_capacity`: the capacity in force, in the rule's units per window.
    pub capacity: u64,
    /// Per band, in the configuration's order.
    pub bands: Vec<BandGauges>,
}

/// One band's gauges, in the order of [`crate::metrics::SHARE_BAND_GAUGES`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BandGauges {
    /// The band's name.
    pub band: String,
    /// `share_active_weight`: the weight of its active tenants.
    pub active_weight: u64,
    /// `share_used_permille`: its use over the window, permille of the capacity in force.
    pub used_permille: u64,
    /// `share_level_permille`: the share of a tenant of weight 1, permille of the capacity in
    /// force (1000 while nobody is held to a level).
    pub level_permille: u64,
}

impl BandGauges {
    /// The values, in the order of [`crate::metrics::SHARE_BAND_GAUGES`].
    pub fn values(&self) -> [u64; 3] {
        [self.active_weight, self.used_permille, self.level_permille]
    }
}

/// How often the host must call [`Runtime::tick`] while a rule is elastic, ms: responses are
/// reported to the shared health this often.
pub const ELASTIC_TICK_MS: u32 = 250;

/// Everything a request needs, built once per configuration.
#[derive(Debug)]
pub struct Runtime<S> {
    pub(crate) config: Config,
    pub(crate) compiled: Vec<Compiled>,
    pub(crate) seed: Seed,
    pub(crate) buckets: u32,
    pub(crate) store: S,
    pub(crate) metrics: Metrics,
    /// Hits of async global rules since the last flush.
    pub(crate) hits: Mutex<Hits>,
    /// Claims ahead of need of lease rules, sent at the next tick.
    pub(crate) ahead: Mutex<global::Ahead>,
    /// Whether a request's checks may turn into questions ([`Runtime::promote`]): lease rules,
    /// or sync rules whose reservations are sized from the body.
    pub(crate) promotes: bool,
    /// The configuration's one rule, when it is plain ([`plain::plain_rule`]): its requests
    /// take the short path.
    plain: Option<usize>,
    /// The configuration's one rule, when it is a capacity shared here
    /// ([`shared::shared_rule`]): its requests the shares admit take the short path.
    shared: Option<usize>,
    /// When a failure was last logged (ms), to log at most one a second.
    pub(crate) last_failure_log: AtomicU64,
    /// When a refused call of the operator route was last logged (ms), to log at most one a
    /// second.
    pub(crate) last_refusal_log: AtomicU64,
    /// When [`Runtime::tick`] last reported to the shared health (ms).
    last_tick: AtomicU64,
    /// What the requests this runtime admitted hold reserved (counted at admission, to be
    /// trued up), not settled yet, per (rule, slot, fingerprint): a refusal they alone cause
    /// is told a short wait ([`charge`]). An entry leaves when its last reservation is settled;
    /// one whose stream were never settled would stay (its key's refusals told 1 s): both
    /// hosts settle each stream when it ends ([`StreamState::complete`]), however it ends.
    pub(crate) reserved: Mutex<HashMap<(usize, u64, u64), u64>>,
    /// This Envoy's draw for rounding what its fleet-fair rules report (random; a host or a
    /// simulation may fix it: [`Runtime::with_fair_dither`]).
    pub(crate) fair_dither: u64,
    /// The lines of the shared rules that let refused requests wait.
    pub(crate) lines: wait::Lines,
    /// The name each request body field that rules read is handed to the access log under
    /// (`body.PATH`), by its slot in the configuration's `request_paths`: built once, not for
    /// every request.
    pub(crate) logged_fields: Vec<String>,
}

/// [`Runtime::logged_fields`]: the access-log name of each body field that rules' keys and
/// matches read, by slot (empty for a slot only costs and reservations read).
fn logged_fields(config: &Config) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for rule in &config.rules {
        let mut name = |f: &crate::config::BodyField| {
            if names.len() <= f.slot {
                names.resize(f.slot + 1, String::new());
            }
            if let Some(n) = names.get_mut(f.slot) {
                if n.is_empty() {
                    *n = format!("body.{}", f.path.join("."));
                }
            }
        };
        rule.matcher.body.iter().for_each(|m| name(&m.field));
        rule.key.iter().for_each(|k| k.each_body_field(&mut name));
    }
    names
}

impl<S: Store> Runtime<S> {
    /// Compiles `config` with the table's `seed` over `store`.
    pub fn new(config: Config, seed: Seed, store: S) -> Runtime<S> {
        let compiled: Vec<Compiled> = config
            .rules
            .iter()
            .map(|rule| {
                let fingerprint =
                    key::rule_fingerprint(seed, &rule.name, &rule.key, rule.limit.algorithm_name());
                let policy = rule.policy();
                let (limit, window_ms) = policy.limit_and_window();
                let lease = rule.lease_policy();
                let capacity_key = (lease.is_some() && rule.share.is_some())
                    .then(|| key::rule_fingerprint(seed, &rule.name, &[], "capacity"));
                Compiled {
                    fingerprint,
                    policy,
                    lease,
                    capacity_key,
                    part_pm: AtomicU32::new(0),
                    fair_part: AtomicU64::new(u64::MAX),
                    fair_view: AtomicU64::new(u64::MAX),
                    fair_end: AtomicU64::new(0),
                    fair_left: AtomicU64::new(u64::MAX),
                    fair_spare: AtomicU64::new(0),
                    fair_reserved: AtomicU64::new(0),
                    fair_use: AtomicU64::new(0),
                    fair_again: std::sync::atomic::AtomicBool::new(false),
                    fair_cap: AtomicU64::new(0),
                    fair_cap_until: AtomicU64::new(0),
                    fleet_ids: rule
                        .share
                        .as_ref()
                        .filter(|s| s.fleet_fair)
                        .map(|_| Box::new(fleet_ids::FleetIds::new())),
                    share_refusing: std::sync::atomic::AtomicBool::new(false),
                    kind: crate::config::Kind::of(rule),
                    reads_body: rule.reads_body_fields(),
                    texts: crate::headers::Texts::new(
                        &rule.name,
                        rule.quota_unit.as_deref(),
                        limit,
                        window_ms / 1000,
                    ),
                    watch: rule.elastic.map(|params| Watch {
                        params,
                        slot: table::SlotKind::Health.slot(fingerprint % (1 << 31)),
                        factor: AtomicU32::new(elastic::BASE),
                        total: AtomicU64::new(0),
                        bad: AtomicU64::new(0),
                    }),
                }
            })
            .collect();
        let promotes = config.rules.iter().any(|r| {
            r.global.as_ref().is_some_and(|g| {
                g.mode == crate::config::GlobalMode::Lease
                    || r.charge().is_some_and(|c| c.sized.is_some())
            })
        });
        let logged_fields = logged_fields(&config);
        let plain = plain::plain_rule(&config, &compiled);
        let shared = shared::shared_rule(&config, &compiled);
        let lines = wait::Lines::new(&config.rules);
        Runtime {
            logged_fields,
            metrics: Metrics::new(config.rules.len()),
            buckets: table::buckets_for(config.capacity),
            compiled,
            config,
            seed,
            store,
            hits: Mutex::default(),
            ahead: Mutex::default(),
            promotes,
            plain,
            shared,
            last_failure_log: AtomicU64::new(0),
            last_refusal_log: AtomicU64::new(0),
            last_tick: AtomicU64::new(0),
            reserved: Mutex::default(),
            lines,
            fair_dither: Seed::random().0[0] | 1,
        }
    }

    /// The runtime with `dither` as its draw for rounding the weights its fleet-fair rules
    /// report ([`crate::share::fair_record::FairRecord::report`]), instead of a random one:
    /// for reproducible simulations. Envoys with equal draws round alike, and their errors
    /// add up.
    pub fn with_fair_dither(mut self, dither: u64) -> Runtime<S> {
        self.fair_dither = dither | 1;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The rules, in configuration order (metric `rule` indices refer to this order).
    pub fn rules(&self) -> &[Rule] {
        &self.config.rules
    }

    /// Where the keys' state lives.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The counts waiting to be published.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// How many keys the table tracks at once (an eighth more than the capacity, in whole
    /// buckets: [`table::buckets_for`]).
    pub fn capacity(&self) -> usize {
        self.buckets as usize * table::WAYS
    }

    /// The table's bucket count.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// How often the host must call [`Runtime::flush`] (ms), if any rule reports to its service
    /// asynchronously.
    pub fn flush_period(&self) -> Option<u32> {
        global::flush_period(&self.config.rules)
    }

    /// How often the host must call [`Runtime::tick`] (ms), if any rule is elastic.
    pub fn tick_period(&self) -> Option<u32> {
        self.compiled
            .iter()
            .any(|c| c.watch.is_some())
            .then_some(ELASTIC_TICK_MS)
    }

    /// Reports the responses this runtime saw to each elastic rule's shared health, moves the
    /// factor if a step is due, and takes the factor in force for the requests to come; at most
    /// once per [`ELASTIC_TICK_MS`], however often it is called. Returns whether it did (only
    /// then is the factor worth publishing: another runtime may have moved it meanwhile).
    pub fn tick(&self, now_ms: u64) -> bool {
        let last = self.last_tick.load(Ordering::Relaxed);
        if now_ms < last.saturating_add(u64::from(ELASTIC_TICK_MS))
            || self
                .last_tick
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        for w in self.compiled.iter().filter_map(|c| c.watch.as_ref()) {
            let total = w.total.swap(0, Ordering::Relaxed);
            let bad = w.bad.swap(0, Ordering::Relaxed);
            // A store that keeps failing leaves the factor as it was until a later tick.
            let mut value = [0; elastic::HEALTH_LEN];
            let stepped = self
                .store
                .replace(w.slot, MAX_ATTEMPTS, &mut value, |bytes, value| {
                    let mut h = bytes.and_then(Health::decode).unwrap_or_default();
                    h.add(now_ms, &w.params, total, bad);
                    h.step(now_ms, &w.params);
                    *value = h.encode();
                    (h.factor, true)
                });
            if let Ok(factor) = stepped {
                w.factor.store(factor, Ordering::Relaxed);
            }
        }
        true
    }

    /// Each elastic rule's limit in force, as a percentage of its base: `(rule, percent)`.
    pub fn elastic_factors(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.compiled.iter().enumerate().filter_map(|(i, c)| {
            let w = c.watch.as_ref()?;
            Some((i, u64::from(w.factor.load(Ordering::Relaxed)) / 10))
        })
    }

    /// What each shared rule's record says now, for its gauges: per rule its capacity in force,
    /// and per band its active weight, its use (permille of the capacity in force) and its
    /// level (the share of a tenant of weight 1, permille of the capacity in force; 1000 while
    /// no tenant is held to a level). One store read per shared rule.
    pub fn share_gauges(&self, now_ms: u64) -> Vec<ShareGauges> {
        let mut out = Vec::new();
        for (i, (rule, c)) in self.config.rules.iter().zip(&self.compiled).enumerate() {
            let Some(sh) = &rule.share else {
                continue;
            };
            let slot = c.share_record();
            let mut record = self
                .store
                .read(slot, |b, _| b.and_then(crate::share::Record::decode))
                .ok()
                .flatten()
                .unwrap_or_else(|| crate::share::Record::new(sh.params.bands));
            // As a request now would find it: the sums of tenants gone quiet rolled out, and no
            // level once none was computed for a second.
            let active_ms = sh.params.active_ms.max(1);
            record.roll(u32::try_from(now_ms / active_ms).unwrap_or(u32::MAX));
            record.roll_held((now_ms / crate::share::HELD_MS) as u16);
            let stale = now_ms.saturating_sub(record.step_ms) > crate::share::HELD_MS;
            let in_force = crate::share::in_force_here(&c.policy, &record, &sh.params, now_ms);
            let (capacity, window_ms) = in_force.limit_and_window();
            let permille = |x: u64| {
                let p = u128::from(x) * 1000 / u128::from(capacity.max(1));
                u64::try_from(p).unwrap_or(u64::MAX)
            };
            let bands = record
                .bands
                .iter()
                .zip(&sh.bands)
                .map(|(b, name)| BandGauges {
                    band: name.clone(),
                    active_weight: b.active_weight(),
                    used_permille: permille(b.used.usage(now_ms, window_ms.max(1))),
                    level_permille: if stale || b.level == crate::share::NO_LEVEL {
                        1000
                    } else {
                        permille(b.level / crate::share::LEVEL_ONE).min(1000)
                    },
                })
                .collect();
            out.push(ShareGauges {
                rule: i,
                capacity,
                bands,
            });
        }
        out
    }

    /// The reports of async global rules' hits since the last flush, to send to each rule's
    /// service ([`Runtime::global_of`]); their answers go to [`Runtime::flushed`].
    pub fn flush(&self) -> Vec<Flush> {
        self.hits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(&self.config.rules)
    }

    /// A flush's answer: counts an error, or blocks the key if the service says it is over its
    /// limit (shadow rules never block).
    pub fn flushed(&self, target: &Target, hits: u64, answer: Answer, now_ms: u64) {
        let (Some(rule), Some(compiled)) = (
            self.config.rules.get(target.rule),
            self.compiled.get(target.rule),
        ) else {
            return;
        };
        let answer = match answer {
            Ok(a) => a,
            Err(_) => {
                self.metrics.add(target.rule, Counter::GlobalErrors, 1);
                self.metrics.add(target.rule, Counter::ReportsLost, hits);
                return;
            }
        };
        if answer.overall_code != rls::Code::OverLimit || rule.shadow {
            return;
        }
        let wait = global::block_ms(&answer, &compiled.policy, now_ms);
        global::block(&self.store, target, now_ms, now_ms.saturating_add(wait));
    }

    /// Whether a request's checks may turn into questions to the services (lease rules, or sync
    /// rules whose reservations are sized from the body).
    pub fn promotes(&self) -> bool {
        self.promotes
    }

    /// The service of a global rule, by the rule's index.
    pub fn global_of(&self, rule: usize) -> Option<&crate::config::Global> {
        self.config.rules.get(rule)?.global.as_ref()
    }

    /// Counts a failed call to a rule's service (one that could not even be sent).
    pub fn global_error(&self, rule: usize) {
        self.metrics.add(rule, Counter::GlobalErrors, 1);
    }

    /// Whether a failure may be logged now (at most one line a second).
    pub(crate) fn may_log_failure(&self, now_ms: u64) -> bool {
        once_a_second(&self.last_failure_log, now_ms)
    }
}

/// Whether a second has passed since `last` (ms), which then becomes `now_ms`.
pub(crate) fn once_a_second(last: &AtomicU64, now_ms: u64) -> bool {
    let then = last.load(Ordering::Relaxed);
    now_ms >= then.saturating_add(1000)
        && last
            .compare_exchange(then, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}
