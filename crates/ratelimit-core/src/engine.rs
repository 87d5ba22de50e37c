//! Where the rules' state is checked and updated: every rule that applies to a request is
//! checked against its key's state in the store, and the request is counted only if all of
//! them allow it ([`crate::runtime`] decides the request with it).
//!
//! Check, then commit. First every rule's bucket is read and decided without writing (a
//! rejected request therefore costs reads only and consumes nothing). If all allow, each rule's
//! new state is written with compare-and-swap. If a write loses a race, that rule is read and
//! decided again; should it now refuse, the rules already committed for this request are
//! refunded. The guarantee: no rule ever admits more than its limit; a request refused by one
//! rule is not counted by the others, except for the instant between a commit and its refund,
//! when a concurrent request may see the count one higher and be refused (never over-admitted).

use crate::config::FailureMode;
use crate::error::StoreFault;
use crate::limiter::{lease, Policy, State, Trace, Verdict};
use crate::share;
use crate::store::{Store, StoreError, CREATE_CAS, HELD_INLINE, MAX_ATTEMPTS};
use crate::table::{self, Encoded, Placement, Slot, BUCKET_LEN};
use smallvec::SmallVec;

/// Per-rule lists of one request stay on the stack up to this many rules.
pub const INLINE_RULES: usize = 4;

/// A per-rule list of one request.
pub type PerRule<T> = SmallVec<[T; INLINE_RULES]>;

/// A rule that applies to the request, with where its key lives.
#[derive(Clone, Copy, Debug)]
pub struct Check {
    /// The store slot of the key: its first bucket ([`table::slots_of`]), or a sliding-log
    /// slot.
    pub slot: u64,
    /// The key's second bucket (a sliding log's: its slot again).
    pub alt: u64,
    /// The key's fingerprint within the slot.
    pub fingerprint: u64,
    /// The rule's algorithm and limit.
    pub policy: Policy,
    /// What this request costs under the rule.
    pub cost: u64,
    /// A shadow rule counts and reports but never refuses (not even by `failure_mode`).
    pub shadow: bool,
    /// Decide whether the key has room for `cost` (a reserve), but count nothing: what the
    /// request used is charged once its response is known ([`settle`]).
    pub charge_later: bool,
    /// An elastic rule's base policy, when the limit in force (`policy`) differs from it: an
    /// admitted request is reported as above the base if the base would have refused it.
    pub base: Option<Policy>,
}

/// How a check's capacity is shared among its tenants: kept beside the checks, by the check's
/// index ([`decide_shared`]), so that a check of a plain rule carries nothing of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareCheck {
    /// The store slot of the rule's record (a [`table::SlotKind::Share`]).
    pub record: u64,
    /// How the capacity is shared.
    pub share: share::Share,
    /// The tenant's weight and band for this request.
    pub asker: share::Asker,
    /// A fleet-fair shared rule (`share.fleet: "fair"`): where this Envoy keeps the fleet's
    /// shares, and the tenant's name there.
    pub fleet: Option<FleetAsk>,
}

/// A fleet-fair shared rule's part of a request ([`crate::share::fair_record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FleetAsk {
    /// The store slot of the rule's fair record.
    pub slot: u64,
    /// The tenant's name in the service's counters ([`crate::key::fleet_id`]).
    pub id: u64,
    /// Whether the request's ask is counted already (a waiter decided a last time at the end of
    /// its wait): only its allowance here decides it.
    pub counted: bool,
}

impl Check {
    /// Whether the base policy of an elastic rule would have refused a request its limit in
    /// force admits.
    fn above_base(&self, verdict: &Verdict, state: Option<&State>, now_ms: u64) -> bool {
        verdict.allowed
            && self
                .base
                .is_some_and(|b| !b.decide(state, now_ms, self.cost).0.allowed)
    }

    /// What a rule charged later reports: if it admits, the quota left now (nothing is
    /// counted yet), else its refusal.
    fn reported(&self, verdict: Verdict, state: Option<&State>, now_ms: u64) -> Verdict {
        if verdict.allowed {
            self.policy.decide(state, now_ms, 0).0
        } else {
            verdict
        }
    }

    /// The key's state in the slot, whichever table it lives in.
    fn current(&self, slot: &Slot) -> Option<State> {
        if self.policy.uses_log() {
            slot.find_log(self.fingerprint)
                .cloned()
                .map(State::SlidingLog)
        } else {
            slot.find(self.fingerprint).cloned()
        }
    }
}

/// What happened to one rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleOutcome {
    /// The rule's verdict; `None` when the store could not decide.
    pub verdict: Option<Verdict>,
    /// CAS conflicts met.
    pub retries: u32,
    /// Why the store could not decide, if it could not.
    pub failure: Option<Failure>,
    /// Whether committing this rule evicted another live key from its bucket.
    pub evicted: bool,
    /// Whether committing this rule used a table entry for the first time.
    pub filled: bool,
    /// Whether an elastic rule admitted the request above its base limit.
    pub above_base: bool,
    /// Why a shared rule refused the request, if it did.
    pub share_refused: Option<share::Reason>,
}

/// Why the store could not decide for a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Every CAS attempt lost a race.
    RetriesExhausted,
    /// The slot's bytes were not a bucket (they are reset).
    Corrupt,
    /// The key's sliding-log slot holds another live key.
    NoRoom,
    /// The store failed.
    Unavailable(StoreFault),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::RetriesExhausted => f.write_str("every compare-and-swap lost a race"),
            Failure::Corrupt => f.write_str("a bucket did not decode (reset)"),
            Failure::NoRoom => f.write_str("the key's log slot holds another live key"),
            Failure::Unavailable(why) => write!(f, "store unavailable: {why}"),
        }
    }
}

impl std::error::Error for Failure {}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        match e {
            StoreError::Conflict => Failure::RetriesExhausted,
            StoreError::Unavailable(why) => Failure::Unavailable(why),
        }
    }
}

/// The decision for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request goes through.
    pub allowed: bool,
    /// One entry per check, in order.
    pub rules: PerRule<RuleOutcome>,
}

impl Outcome {
    /// How long to hold an admitted request (the longest delay any rule asks for).
    pub fn delay_ms(&self) -> u64 {
        self.rules
            .iter()
            .filter_map(|r| r.verdict.map(|v| v.delay_ms))
            .max()
            .unwrap_or(0)
    }
}

/// A bucket as read: its contents and the CAS to write it back with.
struct Read {
    slot: Slot,
    cas: u32,
}

fn read(store: &impl Store, slot: u64) -> Result<Read, Failure> {
    let (decoded, cas) = store
        .read(slot, |bytes, cas| {
            (Slot::decode(slot, bytes), cas.unwrap_or(CREATE_CAS))
        })
        .map_err(Failure::from)?;
    match decoded {
        Ok(s) => Ok(Read { slot: s, cas }),
        Err(_) => {
            // Reset the slot so the keys in it work again from the next request on.
            if let Ok(empty) = Slot::decode(slot, None) {
                let _ = store.write(slot, empty.encode().as_ref(), cas);
            }
            Err(Failure::Corrupt)
        }
    }
}

/// Per-rule working state of one decision.
struct Work {
    /// Where the key is (or goes), as last read, and the state to write for this request.
    pending: Option<(place::Located, State)>,
    /// The key's state before this request, to report if the request is refused.
    before: Option<State>,
    /// The slot the state for this request was written to, and the state, once committed (to
    /// refund it if needed).
    committed: Option<(u64, State)>,
}

/// A shared capacity's check: the index of its [`Check`] (the key is the tenant's, the check's
/// `policy` the capacity all tenants share, [`crate::share`]) and how the capacity is shared.
pub type Shared = (usize, ShareCheck);

/// Decides a request against every check, at `now_ms`, the checks `shares` names deciding
/// shared capacities ([`decide`] when it names none).
pub fn decide_shared(
    store: &impl Store,
    checks: &[Check],
    shares: &[Shared],
    now_ms: u64,
    failure_mode: FailureMode,
) -> Outcome {
    if shares.is_empty() {
        decide(store, checks, now_ms, failure_mode)
    } else {
        decide_shares(store, checks, shares, now_ms, failure_mode)
    }
}

/// Decides a request against every check, at `now_ms` (none of them a shared capacity's).
pub fn decide(
    store: &impl Store,
    checks: &[Check],
    now_ms: u64,
    failure_mode: FailureMode,
) -> Outcome {
    if let [check] = checks {
        if !check.policy.uses_log() {
            return decide_one(store, check, now_ms, failure_mode);
        }
    }
    if checks.iter().all(|c| !c.policy.uses_log()) {
        // Most keys live in their first bucket: those alone are held first, and a request
        // whose every key is there is decided with half the locks. Else every bucket of every
        // key is held.
        let firsts: SmallVec<[u64; HELD_INLINE]> = checks.iter().map(|c| c.slot).collect();
        let held = store.locked_many(&firsts, |held| {
            held::decide_held(held, checks, now_ms, failure_mode, held::Holding::Firsts)
        });
        if let Some(Some(outcome)) = held {
            return outcome;
        }
        if held.is_some() {
            let slots: SmallVec<[u64; HELD_INLINE]> =
                checks.iter().flat_map(|c| [c.slot, c.alt]).collect();
            let held = store.locked_many(&slots, |held| {
                held::decide_held(held, checks, now_ms, failure_mode, held::Holding::Both)
            });
            if let Some(Some(outcome)) = held {
                return outcome;
            }
        }
    }
    decide_general(store, checks, now_ms, failure_mode)
}

/// [`decide`] for a request with shared capacities among its rules: each shared rule first,
/// in order ([`decide_share`]), then, if they all admit it, the other rules together; if any
/// refuses, the shared rules that counted it are given it back.
fn decide_shares(
    store: &impl Store,
    checks: &[Check],
    shares: &[Shared],
    now_ms: u64,
    failure_mode: FailureMode,
) -> Outcome {
    let mut rules: PerRule<RuleOutcome> = PerRule::new();
    rules.resize_with(checks.len(), RuleOutcome::default);
    let mut counted: PerRule<(usize, &ShareCheck)> = SmallVec::new();
    let mut allowed = true;
    let is_shared = |i: usize| shares.iter().any(|(at, _)| *at == i);
    for (i, sc) in shares {
        let i = *i;
        let Some(check) = checks.get(i) else {
            continue;
        };
        let (out, admitted, tenant) = decide_share(store, check, sc, now_ms, failure_mode);
        if admitted && tenant.is_some() {
            counted.push((i, sc));
        }
        if let Some(r) = rules.get_mut(i) {
            *r = out;
        }
        if !admitted {
            allowed = false;
            break;
        }
    }
    if allowed && shares.len() < checks.len() {
        let (others, at): (PerRule<Check>, PerRule<usize>) = checks
            .iter()
            .enumerate()
            .filter(|(i, _)| !is_shared(*i))
            .map(|(i, c)| (*c, i))
            .unzip();
        if !others.is_empty() {
            let o = decide(store, &others, now_ms, failure_mode);
            for (r, i) in o.rules.into_iter().zip(at) {
                if let Some(slot) = rules.get_mut(i) {
                    *slot = r;
                }
            }
            allowed = o.allowed;
        }
    }
    if !allowed {
        for (i, sc) in counted {
            if let Some(check) = checks.get(i) {
                refund_share(store, check, sc, now_ms);
                fair_give_back(store, check, sc);
            }
        }
    }
    Outcome { allowed, rules }
}

/// Decides a request whose one check is a shared rule's ([`decide_shared`] with that check and
/// its share, without the list of outcomes): whether it is admitted, the rule's outcome, and
/// whether the shares counted it (to be given back with [`refund_one_share`] if another check
/// refuses it).
pub(crate) fn decide_one_share(
    store: &impl Store,
    check: &Check,
    sc: &ShareCheck,
    now_ms: u64,
    failure_mode: FailureMode,
) -> (bool, RuleOutcome, bool) {
    let (out, admitted, tenant) = decide_share(store, check, sc, now_ms, failure_mode);
    (admitted, out, tenant.is_some())
}

/// Gives back what [`decide_one_share`] counted of a request another check refused, as
/// [`decide_shared`] does.
pub(crate) fn refund_one_share(store: &impl Store, check: &Check, sc: &ShareCheck, now_ms: u64) {
    refund_share(store, check, sc, now_ms);
    fair_give_back(store, check, sc);
}

/// Decides one shared rule: the tenant's entry is updated under the store's hold of its
/// bucket (or with compare-and-swap), and within that step the rule's record with
/// compare-and-swap ([`share::decide`]). Should the bucket's write lose a race after the record
/// was written, the decision stands and only the tenant's part is applied again to the entry as
/// it now is. Returns the rule's outcome, whether it admits the request, and the tenant's entry
/// as written when it counted it.
fn decide_share(
    store: &impl Store,
    check: &Check,
    sc: &ShareCheck,
    now_ms: u64,
    failure_mode: FailureMode,
) -> (RuleOutcome, bool, Option<share::Tenant>) {
    let mut out = RuleOutcome::default();
    let fails_closed = failure_mode == FailureMode::Deny && !check.shadow;
    let mut decided: Option<share::Decision> = None;
    let mut record_failure = None;
    let mut record_retries = 0;
    // The tenant's entry the decision was made from, and the one found at the last lost race.
    let mut read = share::Tenant::default();
    let mut raced: Option<share::Tenant> = None;
    let updated = update(
        store,
        (check.slot, check.alt),
        check.fingerprint,
        None,
        now_ms,
        &mut out.retries,
        |state| {
            let tenant = match state {
                Some(State::Tenant(t)) => Some(*t),
                _ => None,
            };
            if let Some(d) = &decided {
                // The record holds this decision already: the tenant's part, on its entry now.
                raced = Some(tenant.unwrap_or_default());
                return (
                    (),
                    Some(State::Tenant(reapply(d, tenant, now_ms, check.cost))),
                );
            }
            read = tenant.unwrap_or_default();
            let mut record = share::Record::empty();
            let decide_on = |record: &mut share::Record, bytes: Option<&[u8]>| {
                if !bytes.is_some_and(|b| record.decode_from(b)) {
                    *record = share::Record::new(sc.share.bands);
                }
                share::decide(
                    &sc.share,
                    &check.policy,
                    record,
                    tenant.as_ref(),
                    sc.asker,
                    now_ms,
                    check.cost,
                )
            };
            // Nobody contends the capacity: admitted in the record's bytes.
            let admit = |bytes: &mut [u8]| {
                let at = (now_ms, check.cost);
                share::in_place::admit(
                    &sc.share,
                    &check.policy,
                    bytes,
                    tenant.as_ref(),
                    sc.asker,
                    at,
                )
            };
            // Held by the store (the native build's process table): in place, no race to lose.
            let held = store.locked_value(sc.record, |value, present| {
                if let Some(d) = present.then(|| admit(value)).flatten() {
                    return (d, true);
                }
                let d = decide_on(&mut record, present.then_some(&value[..]));
                record.encode_into_vec(value);
                (d, true)
            });
            let written = match held {
                Some(written) => written,
                None => {
                    let mut value = share::state::RecordBytes::new();
                    let mut attempts = 0u32;
                    let replaced =
                        store.replace(sc.record, MAX_ATTEMPTS, &mut value, |bytes, value| {
                            attempts += 1;
                            if let Some(bytes) = bytes {
                                value.clear();
                                value.extend_from_slice(bytes);
                                if let Some(d) = admit(value) {
                                    return (d, true);
                                }
                            }
                            let d = decide_on(&mut record, bytes);
                            record.encode_into(value);
                            (d, true)
                        });
                    record_retries += attempts.saturating_sub(1);
                    replaced
                }
            };
            match written {
                Ok(d) => {
                    let t = d.tenant;
                    decided = Some(d);
                    ((), Some(State::Tenant(t)))
                }
                Err(e) => {
                    record_failure = Some(Failure::from(e));
                    ((), None)
                }
            }
        },
    );
    out.retries += record_retries;
    let failure = record_failure.or(updated.as_ref().err().cloned());
    if let Some(failure) = failure {
        out.failure = Some(failure);
        return (out, !fails_closed, None);
    }
    if let Ok((_, placement)) = updated {
        out.evicted = placement == Some(Placement::Evicted);
        out.filled = placement == Some(Placement::Filled);
    }
    let Some(d) = decided else {
        return (out, !fails_closed, None);
    };
    // Another decision of the tenant wrote its entry between this one's read and write: both
    // counted the tenant in the record; the entry now counts as this one decided.
    if let Some(found) = raced.filter(|found| *found != read) {
        let bands = Some(sc.share.bands);
        update_share_record(store, sc.record, bands, |r| {
            ((), share::recount(&sc.share, r, &found, &read, now_ms))
        });
    }
    out.verdict = Some(d.verdict);
    out.share_refused = d.refused;
    let mut admitted = d.refused.is_none();
    if let Some(f) = &sc.fleet {
        // Within the fleet's share too: the tenant's allowance on this Envoy.
        let (_, window_ms) = check.policy.limit_and_window();
        let asks = !sc.asker.again && !f.counted;
        let fits = fair_ask(
            store,
            f,
            sc,
            (now_ms, window_ms),
            check.cost,
            (asks, admitted),
        );
        if let (Err(wait_ms), true) = (fits, admitted) {
            refund_share(store, check, sc, now_ms);
            admitted = false;
            out.share_refused = Some(share::Reason::Share);
            out.verdict = Some(Verdict {
                allowed: false,
                remaining: 0,
                retry_after_ms: wait_ms,
                delay_ms: 0,
                ..d.verdict
            });
        }
    }
    (out, admitted || check.shadow, admitted.then_some(d.tenant))
}

/// A fleet-fair shared rule's request at its fair record ([`share::fair_record::FairRecord::
/// request`]): counted as the tenant's demand if it `asks`, and taken from its allowance here
/// if the local shares `admitted` it. A store that cannot say lets it through (the lease still
/// bounds the fleet).
fn fair_ask(
    store: &impl Store,
    f: &FleetAsk,
    sc: &ShareCheck,
    at: (u64, u64),
    cost: u64,
    how: (bool, bool),
) -> Result<(), u64> {
    use share::fair_record::FairRecord;
    let who = (f.id, sc.asker.weight, sc.asker.band);
    let bands = sc.share.bands;
    update_fair_bytes(store, f.slot, |value, present| {
        // A tenant the record keeps: its entry changed in place, the rest neither decoded nor
        // encoded; else the whole record.
        let in_place = present
            .then(|| FairRecord::request_in_place(value, bands, who, at, cost, how))
            .flatten();
        if let Some(fits) = in_place {
            return (fits, true);
        }
        let mut r = FairRecord::decode_or_new(present.then_some(&value[..]), bands);
        let fits = r.request(who, at, cost, how);
        r.encode_into(value);
        (fits, true)
    })
    .unwrap_or(Ok(()))
}

/// Counts a request's asks in the fair records of its fleet-fair shared rules (`shares`, of
/// `checks`) where no decision of its shares will: a claim of its lease the service refused, or
/// could not answer, decides it before them. A request's ask counts once, admitted or not (a
/// turn in a line, or a last decision, does not count it again).
pub fn fair_count_asks(store: &impl Store, checks: &[Check], shares: &[Shared], now_ms: u64) {
    for (i, sc) in shares {
        let (Some(f), Some(check)) = (&sc.fleet, checks.get(*i)) else {
            continue;
        };
        if sc.asker.again || f.counted {
            continue;
        }
        let (_, window_ms) = check.policy.limit_and_window();
        // Counted only (nothing admitted): its allowance is not asked.
        let _ = fair_ask(store, f, sc, (now_ms, window_ms), check.cost, (true, false));
    }
}

/// What a fleet-fair shared rule's tenant asking `cost` at `at` (now, the window), in blocks of
/// at most `block`, may take of the fleet's quota when the service said it has `left`
/// ([`share::fair::keeping`], from the rule's fair record). `None`: nothing is kept, or a store
/// that cannot say.
pub fn fair_keeping(
    store: &impl Store,
    sc: &ShareCheck,
    at: (u64, u64),
    (cost, block): (u64, u64),
    left: share::fair::Left,
) -> Option<share::fair::Keeping> {
    use share::fair_record::FairRecord;
    let f = sc.fleet.as_ref()?;
    let who = (f.id, sc.asker.weight, sc.asker.band);
    let bands = sc.share.bands;
    let read = update_fair_bytes(store, f.slot, |value, present| {
        let read = present
            .then(|| FairRecord::kept_for(value, bands, who, at))
            .flatten();
        (read, false)
    })
    .flatten()?;
    let (band, here, held) = read;
    share::fair::keeping((&band, here, held), left, at, (cost, block))
}

/// Gives a fleet-fair shared rule's tenant back, in its allowance here, a request its
/// allowance covered and another check refused.
fn fair_give_back(store: &impl Store, check: &Check, sc: &ShareCheck) {
    let Some(f) = &sc.fleet else {
        return;
    };
    use share::fair_record::FairRecord;
    let (_, window_ms) = check.policy.limit_and_window();
    let bands = sc.share.bands;
    update_fair_bytes(store, f.slot, |value, present| {
        // The tenant's entry changed in place; else the whole record.
        let in_place = present
            .then(|| FairRecord::give_back_in_place(value, bands, f.id, check.cost, window_ms))
            .flatten();
        if let Some(written) = in_place {
            return ((), written);
        }
        let mut r = FairRecord::decode_or_new(present.then_some(&value[..]), bands);
        r.give_back(f.id, check.cost, window_ms);
        r.encode_into(value);
        ((), true)
    });
}

/// Changes a fleet-fair shared rule's fair record at `slot` (for `bands` bands) with `f`, which
/// says whether to write it. `f`'s result (`None`: the store failed).
pub fn update_fair_record<T>(
    store: &impl Store,
    slot: u64,
    bands: usize,
    mut f: impl FnMut(&mut share::fair_record::FairRecord) -> (T, bool),
) -> Option<T> {
    use share::fair_record::FairRecord;
    update_fair_bytes(store, slot, |value, present| {
        let mut r = FairRecord::decode_or_new(present.then_some(&value[..]), bands);
        let (out, write) = f(&mut r);
        if write {
            r.encode_into(value);
        }
        (out, write)
    })
}

/// Changes the encoded fair record at `slot` with `f` (given its bytes and whether the store
/// held any; it says whether to write them): held by the store in place where it can (the
/// native build's), else read, changed and written with compare-and-swap. `f`'s result
/// (`None`: the store failed).
fn update_fair_bytes<T>(
    store: &impl Store,
    slot: u64,
    mut f: impl FnMut(&mut Vec<u8>, bool) -> (T, bool),
) -> Option<T> {
    if let Some(held) = store.locked_value(slot, &mut f) {
        return held.ok();
    }
    store.update_value(slot, MAX_ATTEMPTS, f).ok()
}

/// The tenant's part of a decision the record already holds, applied to its entry as it is now
/// (another request of the tenant wrote it meanwhile): counted as active as decided, and the
/// request's cost added if it was admitted.
fn reapply(
    d: &share::Decision,
    now: Option<share::Tenant>,
    now_ms: u64,
    cost: u64,
) -> share::Tenant {
    let Some(mut t) = now else {
        return d.tenant;
    };
    t.epoch = d.tenant.epoch;
    t.weight = d.tenant.weight;
    t.band = d.tenant.band;
    t.held = d.tenant.held;
    t.refused_tick = d.tenant.refused_tick;
    if d.refused.is_none() {
        let window = u64::from(d.tenant.usage.window_ms);
        t.usage = crate::limiter::sliding_window::add(t.usage, now_ms, window, cost);
    }
    t
}

/// Gives a shared rule back a request it counted at `now_ms`: the record, then the tenant.
fn refund_share(store: &impl Store, check: &Check, sc: &ShareCheck, now_ms: u64) {
    let mut retries = 0;
    let cost = check.cost;
    let _ = after_share(
        store,
        (check.slot, check.alt),
        check.fingerprint,
        sc.record,
        now_ms,
        &mut retries,
        |r, t| {
            let Some(t) = t else {
                return false; // forgotten meanwhile: nothing to give back
            };
            let in_force = share::in_force_here(&check.policy, r, &sc.share, now_ms);
            share::refund(&in_force, r, &mut t.clone(), now_ms, now_ms, cost);
            true
        },
        |t| share::refund_tenant(t, now_ms, cost),
    );
}

/// Changes a shared rule's record and its tenant's entry after a request was decided: the
/// record once (`on_record`, given the tenant's entry as first read; it says whether to write),
/// then the entry (`on_tenant`, on the entry as read at each attempt: a lost race on the
/// tenant's bucket applies it again to the entry as it then is, never the record twice).
#[allow(clippy::too_many_arguments)]
fn after_share(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    record: u64,
    now_ms: u64,
    retries: &mut u32,
    mut on_record: impl FnMut(&mut share::Record, Option<&share::Tenant>) -> bool,
    on_tenant: impl Fn(&mut share::Tenant),
) -> Result<Updated<()>, Failure> {
    let mut record_done = false;
    update(store, slots, fingerprint, None, now_ms, retries, |state| {
        let tenant = match state {
            Some(State::Tenant(t)) => Some(*t),
            _ => None,
        };
        if !record_done {
            record_done = true;
            let mut value = share::state::RecordBytes::new();
            let _ = store.replace(record, MAX_ATTEMPTS, &mut value, |bytes, value| {
                let Some(mut r) = bytes.and_then(share::Record::decode) else {
                    return ((), false);
                };
                let write = on_record(&mut r, tenant.as_ref());
                if write {
                    r.encode_into(value);
                }
                ((), write)
            });
        }
        match tenant {
            Some(mut t) => {
                on_tenant(&mut t);
                ((), Some(State::Tenant(t)))
            }
            None => ((), None),
        }
    })
}

/// Folds what a provider or a service said into a shared rule's record (in `record`'s slot):
/// `fold` changes the record and says whether to write it. With no record yet, one of `bands`
/// bands is started if `bands` is given; else `None` (nothing was admitted). `None` too when
/// the store could not be written.
pub fn update_share_record<T>(
    store: &impl Store,
    record: u64,
    bands: Option<usize>,
    mut fold: impl FnMut(&mut share::Record) -> (T, bool),
) -> Option<T> {
    let mut value = share::state::RecordBytes::new();
    store
        .replace(record, MAX_ATTEMPTS, &mut value, |bytes, value| {
            let decoded = bytes.and_then(share::Record::decode);
            let Some(mut r) = decoded.or_else(|| bands.map(share::Record::new)) else {
                return (None, false);
            };
            let (out, write) = fold(&mut r);
            if write {
                r.encode_into(value);
            }
            (Some(out), write)
        })
        .ok()
        .flatten()
}

/// [`decide`] for the commonest request: one rule, whose key lives in a bucket. The same
/// outcome for less work, which every request pays: the key's entry is found and rewritten in
/// the bucket's bytes, without decoding or re-encoding the other entries (the whole bucket is
/// still checked, see [`table::lookup`]), and none of the per-rule bookkeeping (with one rule
/// there is nothing to refund). A key new to its bucket takes [`Slot::put`]'s path. A store
/// that can hold the slot for the update ([`Store::locked`]) is updated in place, in one step.
fn decide_one(
    store: &impl Store,
    check: &Check,
    now_ms: u64,
    failure_mode: FailureMode,
) -> Outcome {
    let (allowed, out) = decide_single(store, check, now_ms, failure_mode);
    Outcome {
        allowed,
        rules: smallvec::smallvec![out],
    }
}

/// Decides a request against one check (not a sliding log's): whether it is admitted, and the
/// check's outcome ([`decide`] with one check, without the list of outcomes).
pub(crate) fn decide_single(
    store: &impl Store,
    check: &Check,
    now_ms: u64,
    failure_mode: FailureMode,
) -> (bool, RuleOutcome) {
    let mut out = RuleOutcome::default();
    let fails_closed = failure_mode == FailureMode::Deny && !check.shadow;
    let done = |out: RuleOutcome, allowed: bool| (allowed, out);
    // Decides on the key's state as read (again after each lost race); says whether the
    // request is admitted, and the state to write, if any.
    let mut verdict = None;
    let mut above_base = false;
    let decide = |state: Option<&State>| {
        let (v, next) = check.policy.decide(state, now_ms, check.cost);
        above_base = check.above_base(&v, state, now_ms);
        if check.charge_later {
            verdict = Some(check.reported(v, state, now_ms));
            return (v.allowed || check.shadow, None);
        }
        verdict = Some(v);
        if !v.allowed && !check.shadow {
            return (false, None); // refused: nothing is written
        }
        // `None`: a shadow rule that would refuse: nothing to count.
        (true, next)
    };
    let updated = update(
        store,
        (check.slot, check.alt),
        check.fingerprint,
        Some(&check.policy),
        now_ms,
        &mut out.retries,
        decide,
    );
    match updated {
        Ok((allowed, placement)) => {
            out.verdict = verdict;
            out.above_base = above_base;
            out.evicted = placement == Some(Placement::Evicted);
            out.filled = placement == Some(Placement::Filled);
            done(out, allowed)
        }
        Err(failure) => {
            out.above_base = above_base;
            out.failure = Some(failure);
            done(out, !fails_closed)
        }
    }
}

/// A key looked up in a bucket's bytes ([`table::lookup`]), for [`update_entry`] when its
/// caller looked already.
type Looked = Result<Option<(usize, State)>, table::Corrupt>;

/// What [`update_entry`] did: `f`'s result, and where the key's new state went (`None`: not
/// written).
type Updated<T> = (T, Option<Placement>);

/// Updates one key in a bucket's bytes (`present`: the store holds the bucket; else they are
/// all zero): `f` gets the key's state (`None`: the bucket does not hold it) and returns its
/// result and the key's new state, if any, which is written into the bytes: in place, rewriting
/// only the key's entry, when it had one, else through the decoded bucket, which finds it a
/// place by the table's eviction policy. Bytes that are not a bucket are made an empty one (to
/// be written back, so that the keys in it work again from the next request on) and give
/// [`Failure::Corrupt`]. The bytes change only when the result says something was placed, or
/// is `Corrupt`. `looked`: the key looked up in these bytes already, if it was.
#[allow(clippy::too_many_arguments)]
fn update_entry<T>(
    bytes: &mut [u8; BUCKET_LEN],
    present: bool,
    (slot, fingerprint): (u64, u64),
    rule: Option<&Policy>,
    now_ms: u64,
    elsewhere: Option<Trace>,
    looked: Option<Looked>,
    f: &mut place::Decide<'_, T>,
) -> Result<Updated<T>, Failure> {
    let looked =
        looked.unwrap_or_else(|| table::lookup(present.then_some(&bytes[..]), fingerprint));
    let found = match looked {
        Ok(found) => found,
        Err(table::Corrupt) => {
            *bytes = table::empty_bucket();
            return Err(Failure::Corrupt);
        }
    };
    let seeded;
    let state = match &found {
        Some((_, s)) => Some(s),
        None => {
            seeded = rule
                .and_then(|p| seeded_from(p, &bytes[..], present, fingerprint, now_ms, elsewhere));
            seeded.as_ref()
        }
    };
    let (result, next) = f(state);
    let Some(next) = next else {
        return Ok((result, None));
    };
    let limit = rule.map_or(0, |p| table::limit_code(p.most()));
    if let Some((i, _)) = found {
        if table::store_entry(bytes, i, fingerprint, &next, limit) {
            return Ok((result, Some(Placement::Updated)));
        }
    }
    // An entry `lookup` did not read may not decode: the bucket is reset, as a corrupt one.
    let Ok(mut decoded) = Slot::decode(slot, present.then_some(&bytes[..])) else {
        *bytes = table::empty_bucket();
        return Err(Failure::Corrupt);
    };
    let placement = decoded.put_limited(fingerprint, next, limit, now_ms);
    match decoded.encode() {
        table::Encoded::Bucket(encoded) => *bytes = encoded,
        table::Encoded::Log(_) => return Err(Failure::Unavailable(StoreFault::Undecodable)),
    }
    Ok((result, Some(placement)))
}

/// The state a key its bucket's bytes do not hold starts from under `policy` at `now_ms`: from
/// its ghost's trace, if the bucket has one for it ([`table::Ghost`]), or its other bucket
/// (`elsewhere`), the larger of each figure if both do.
fn seeded_from(
    policy: &Policy,
    bytes: &[u8],
    present: bool,
    fingerprint: u64,
    now_ms: u64,
    elsewhere: Option<Trace>,
) -> Option<State> {
    let here = table::ghost_in(present.then_some(bytes), fingerprint, now_ms);
    seeded(policy, here, elsewhere, now_ms)
}

/// The state a new key starts from under `policy` at `now_ms`: what its ghosts in its two
/// buckets hold, the larger of each figure if both have one.
fn seeded(
    policy: &Policy,
    here: Option<Trace>,
    elsewhere: Option<Trace>,
    now_ms: u64,
) -> Option<State> {
    let trace = here.into_iter().chain(elsewhere).reduce(Trace::max)?;
    policy.seeded(&trace, now_ms)
}

/// [`update_entry`] on the key's bucket, of its two (`slots`, [`table::slots_of`]): the one
/// that holds it, else, for a new key, the one with fewer live keys. Under the store's hold
/// where it can ([`Store::locked`]; a new key with both buckets held); else on copies read and
/// written back with compare-and-swap, reading and running `f` again while another writer wins
/// the race, a new key placed in its second bucket announced in its first
/// ([`table::announce`]). `retries` counts the races lost.
fn update<T>(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    rule: Option<&Policy>,
    now_ms: u64,
    retries: &mut u32,
    mut f: impl FnMut(Option<&State>) -> (T, Option<State>),
) -> Result<Updated<T>, Failure> {
    let key = (slots, fingerprint, rule, now_ms);
    if let Some(r) = place::update_held(store, key, &mut f) {
        return r;
    }
    place::update_cas(store, key, retries, &mut f)
}

/// Writes `state` for a key in its bucket (of its two, `slots`: the one that holds it, else
/// the one with fewer live keys), whatever the key held; where it went, or why it could not.
pub fn put(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    now_ms: u64,
    state: State,
) -> Result<Option<Placement>, Failure> {
    let mut retries = 0;
    update(
        store,
        slots,
        fingerprint,
        None,
        now_ms,
        &mut retries,
        |_| ((), Some(state.clone())),
    )
    .map(|(_, placement)| placement)
}

/// Updates one key's lease ([`crate::limiter::lease`]) in its bucket: `f` gets the lease
/// (`None`: none yet) and returns its result and the new lease (`None`: unchanged). The result
/// (`None` when the store could not update the lease), and what the store did (conflicts met,
/// an entry filled or a live key evicted for a new lease), for the rule's counts.
pub(crate) fn update_lease<T>(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    now_ms: u64,
    mut f: impl FnMut(Option<&lease::State>) -> (T, Option<lease::State>),
) -> (Option<T>, RuleOutcome) {
    let mut out = RuleOutcome::default();
    let updated = update(
        store,
        slots,
        fingerprint,
        None,
        now_ms,
        &mut out.retries,
        |state| {
            let lease = match state {
                Some(State::Lease(s)) => Some(s),
                _ => None,
            };
            let (result, next) = f(lease);
            (result, next.map(State::Lease))
        },
    );
    match updated {
        Ok((result, placement)) => {
            out.evicted = placement == Some(Placement::Evicted);
            out.filled = placement == Some(Placement::Filled);
            (Some(result), out)
        }
        Err(failure) => {
            out.failure = Some(failure);
            (None, out)
        }
    }
}

/// [`decide`] for any number of checks of any kind.
fn decide_general(
    store: &impl Store,
    checks: &[Check],
    now_ms: u64,
    failure_mode: FailureMode,
) -> Outcome {
    let mut rules: PerRule<RuleOutcome> = smallvec::smallvec![RuleOutcome::default(); checks.len()];
    let mut work: PerRule<Work> = PerRule::with_capacity(checks.len());
    // Phase 1: read and decide every rule; nothing is written.
    let mut refused = false;
    for (check, out) in checks.iter().zip(rules.iter_mut()) {
        let mut w = Work {
            pending: None,
            before: None,
            committed: None,
        };
        match place::locate(store, check, now_ms, &mut out.retries) {
            Ok(r) if !r.read.slot.has_room(check.fingerprint, now_ms) => {
                refused |= failure_mode == FailureMode::Deny && !check.shadow;
                out.failure = Some(Failure::NoRoom);
            }
            Ok(r) => {
                w.before = r.before(check, now_ms);
                let (verdict, state) = check.policy.decide(w.before.as_ref(), now_ms, check.cost);
                refused |= !verdict.allowed && !check.shadow;
                out.above_base = check.above_base(&verdict, w.before.as_ref(), now_ms);
                if check.charge_later {
                    out.verdict = Some(check.reported(verdict, w.before.as_ref(), now_ms));
                } else {
                    out.verdict = Some(verdict);
                    w.pending = state.map(|s| (r, s));
                }
            }
            Err(f) => {
                refused |= failure_mode == FailureMode::Deny && !check.shadow;
                out.failure = Some(f);
            }
        }
        work.push(w);
    }
    if refused {
        return refused_outcome(
            rules,
            checks,
            work.iter().map(|w| w.before.as_ref()),
            now_ms,
        );
    }
    // Phase 2: commit each rule with CAS, re-deciding a rule whose bucket changed meanwhile.
    for i in 0..checks.len() {
        let (Some(check), Some(out), Some(w)) = (checks.get(i), rules.get_mut(i), work.get_mut(i))
        else {
            continue;
        };
        let Some((mut r, mut state)) = w.pending.take() else {
            continue; // the store failed for this rule and failure_mode is allow
        };
        // Set once this request's mark holds the key's first bucket: the key is placed in its
        // second, read again there alone after a lost race.
        let mut announced = false;
        for _ in 0..MAX_ATTEMPTS {
            // Whether to write now (not after a lost race to announce the key).
            let mut place = true;
            if let Some(mut first) = r.first.take() {
                if first.slot.announce(check.fingerprint, now_ms) {
                    match store.write(check.slot, first.slot.encode().as_ref(), first.cas) {
                        Ok(()) => announced = true,
                        Err(StoreError::Conflict) => {
                            out.retries += 1;
                            place = false;
                        }
                        Err(StoreError::Unavailable(e)) => {
                            out.failure = Some(Failure::Unavailable(e));
                            break;
                        }
                    }
                } else {
                    // No room for a mark: the first bucket after all.
                    r.at = check.slot;
                    r.read = first;
                }
            }
            if place {
                let limit = table::limit_code(check.policy.most());
                let placement =
                    r.read
                        .slot
                        .put_limited(check.fingerprint, state.clone(), limit, now_ms);
                if placement == Placement::Full {
                    out.failure = Some(Failure::NoRoom);
                    break;
                }
                match store.write(r.at, r.read.slot.encode().as_ref(), r.read.cas) {
                    Ok(()) => {
                        out.evicted = placement == Placement::Evicted;
                        out.filled = placement == Placement::Filled;
                        w.committed = Some((r.at, state));
                        if announced {
                            place::withdraw(store, check.slot, check.fingerprint);
                        }
                        break;
                    }
                    Err(StoreError::Conflict) => out.retries += 1,
                    Err(StoreError::Unavailable(e)) => {
                        out.failure = Some(Failure::Unavailable(e));
                        break;
                    }
                }
            }
            let again = if announced {
                read(store, r.at).map(|read| place::Located { read, ..r })
            } else {
                place::locate(store, check, now_ms, &mut out.retries)
            };
            match again {
                Ok(again) => r = again,
                Err(f) => {
                    out.failure = Some(f);
                    break;
                }
            }
            let before = r.before(check, now_ms);
            let (verdict, next) = check.policy.decide(before.as_ref(), now_ms, check.cost);
            out.verdict = Some(verdict);
            out.above_base = check.above_base(&verdict, before.as_ref(), now_ms);
            match next {
                Some(s) => state = s,
                None if check.shadow => break, // it would have refused: count nothing
                None => {
                    // Lost the race to requests that used up the quota: undo and refuse.
                    if announced {
                        place::withdraw(store, check.slot, check.fingerprint);
                    }
                    refund(store, checks, &work);
                    return refused_outcome(
                        rules,
                        checks,
                        work.iter().map(|w| w.before.as_ref()),
                        now_ms,
                    );
                }
            }
        }
        if announced && w.committed.is_none() {
            place::withdraw(store, check.slot, check.fingerprint);
        }
        let shadow_refused = check.shadow && out.verdict.is_some_and(|v| !v.allowed);
        if w.committed.is_none() && !shadow_refused {
            if out.failure.is_none() {
                out.failure = Some(Failure::RetriesExhausted);
            }
            out.verdict = None;
            if failure_mode == FailureMode::Deny && !check.shadow {
                refund(store, checks, &work);
                return refused_outcome(
                    rules,
                    checks,
                    work.iter().map(|w| w.before.as_ref()),
                    now_ms,
                );
            }
        }
    }
    Outcome {
        allowed: true,
        rules,
    }
}

/// What an admitted request owes a rule once its response is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owed {
    /// The usage the response reported (or the default, if it never did).
    Charge(u64),
    /// The in-flight slot taken at this time.
    GiveBack {
        /// When the slot was taken, ms since the epoch.
        taken_ms: u64,
    },
    /// The unused part of a reservation counted at admission.
    Refund {
        /// How much to give back.
        cost: u64,
        /// When the reservation was counted, ms since the epoch.
        counted_ms: u64,
    },
}

/// Settles what a request owes one rule's key in `slot` at `now_ms`: charges its usage, or
/// gives its in-flight slot back. The outcome's verdict is the key's quota after a charge (for
/// the response's fields); a give-back reports none. A key that was forgotten meanwhile is
/// charged afresh; a slot whose key was forgotten is already free.
pub fn settle(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    policy: &Policy,
    owed: Owed,
    now_ms: u64,
) -> RuleOutcome {
    let mut out = RuleOutcome::default();
    let mut verdict = None;
    let settled = update(
        store,
        slots,
        fingerprint,
        Some(policy),
        now_ms,
        &mut out.retries,
        |state| {
            let next = match owed {
                Owed::Charge(cost) => policy.charge(state, now_ms, cost).map(|(v, s)| {
                    verdict = Some(v);
                    s
                }),
                Owed::GiveBack { taken_ms } => policy.give_back(state, taken_ms, now_ms),
                Owed::Refund { cost, counted_ms } => policy
                    .refund_at(state, counted_ms, now_ms, cost)
                    .inspect(|s| {
                        verdict = Some(policy.decide(Some(s), now_ms, 0).0);
                    }),
            };
            ((), next) // `None`: nothing to change
        },
    );
    settled_outcome(out, settled, verdict)
}

/// [`settle`] for a shared rule: what the response owes goes to the tenant's entry (at
/// `slot`/`fingerprint`) and to the rule's record (`record`): the capacity (under the capacity
/// in force, learned or configured), the band's use and the tenant's. A charge is counted
/// whatever the capacity says (the request went through); a refund gives back what the
/// reservation counted at `counted_ms`.
#[allow(clippy::too_many_arguments)]
pub fn settle_share(
    store: &impl Store,
    slots: (u64, u64),
    fingerprint: u64,
    record: u64,
    share: &share::Share,
    policy: &Policy,
    owed: Owed,
    now_ms: u64,
) -> RuleOutcome {
    let mut out = RuleOutcome::default();
    let mut verdict = None;
    let settled = after_share(
        store,
        slots,
        fingerprint,
        record,
        now_ms,
        &mut out.retries,
        |r, t| {
            let in_force = share::in_force_here(policy, r, share, now_ms);
            match (owed, t) {
                // A charge counts on the capacity even if the tenant's entry is gone.
                (Owed::Charge(cost), t) => {
                    let mut t = t.copied().unwrap_or_default();
                    share::charge(&in_force, r, &mut t, now_ms, cost);
                }
                (Owed::Refund { cost, counted_ms }, Some(t)) => {
                    share::refund(&in_force, r, &mut t.clone(), counted_ms, now_ms, cost);
                }
                _ => return false,
            }
            verdict = Some(in_force.decide(r.capacity.as_ref(), now_ms, 0).0);
            true
        },
        |t| match owed {
            Owed::Charge(cost) => share::charge_tenant(t, now_ms, cost),
            Owed::Refund { cost, counted_ms } => share::refund_tenant(t, counted_ms, cost),
            Owed::GiveBack { .. } => {}
        },
    );
    settled_outcome(out, settled, verdict)
}

/// A settle's outcome: the verdict it computed and where its entry went, or why it failed.
fn settled_outcome(
    mut out: RuleOutcome,
    settled: Result<Updated<()>, Failure>,
    verdict: Option<Verdict>,
) -> RuleOutcome {
    match settled {
        Ok(((), placement)) => {
            out.verdict = verdict;
            out.evicted = placement == Some(Placement::Evicted);
            out.filled = placement == Some(Placement::Filled);
        }
        Err(failure) => out.failure = Some(failure),
    }
    out
}

/// A refused request: rules that would have admitted it report the quota as it is without
/// this request, which consumed nothing.
fn refused_outcome<'w>(
    mut rules: PerRule<RuleOutcome>,
    checks: &[Check],
    before: impl Iterator<Item = Option<&'w State>>,
    now_ms: u64,
) -> Outcome {
    for ((out, check), before) in rules.iter_mut().zip(checks).zip(before) {
        if let Some(v) = out.verdict.as_mut().filter(|v| v.allowed) {
            *v = check.policy.decide(before, now_ms, 0).0;
        }
    }
    Outcome {
        allowed: false,
        rules,
    }
}

/// Takes back what a refused request had counted. Best effort: a refund that keeps losing
/// races is dropped, leaving the key counted once too often (conservative, never over-admits).
fn refund(store: &impl Store, checks: &[Check], work: &[Work]) {
    for (check, w) in checks.iter().zip(work) {
        let Some((at, counted)) = &w.committed else {
            continue;
        };
        let mut value = Encoded::default();
        let _ = store.replace(*at, MAX_ATTEMPTS, &mut value, |bytes, value| {
            let mut slot = match Slot::decode(*at, bytes) {
                Ok(slot) => slot,
                // Made empty, so that the keys in it work again from the next request on.
                Err(_) => match Slot::decode(*at, None) {
                    Ok(empty) => {
                        *value = empty.encode();
                        return ((), true);
                    }
                    Err(_) => return ((), false),
                },
            };
            let Some(current) = check.current(&slot) else {
                return ((), false); // forgotten meanwhile: nothing to give back
            };
            let back = check.policy.refund(current, counted, check.cost);
            let at = back.last_ms();
            slot.put(check.fingerprint, back, at);
            *value = slot.encode();
            ((), true)
        });
    }
}

mod held;
mod place;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod blocked_tests;

#[cfg(test)]
mod share_tests;

#[cfg(test)]
mod forget_tests;
