//! An operator's hands on one key: look at it ([`Runtime::inspect`]), list a rule's busiest keys
//! ([`Runtime::busiest`]) and forget one ([`Runtime::reset`]), by rule name and by the key as
//! the filter logs it.
//!
//! The filter never keeps a raw key: its `limited rule=… key=…` line prints the key's table
//! fingerprint ([`table::fingerprint_of`] of the keyed hash), so the logged value is exactly what
//! the table stores. The bucket is picked by the hash, whose lowest bit the fingerprint may have
//! set: a logged key lives in one of two buckets (`fp % buckets` or `(fp & !1) % buckets`), and
//! both are looked at. Every rule's keys carry the rule's tag ([`key::rule_tag`]), which is how a
//! scan of the shared buckets tells one rule's keys from the others'.
//!
//! Nothing here runs on a request's path: the host calls it when an operator asks (the native
//! build's admin endpoints, on Envoy's main thread). It reads each slot once and writes with
//! compare-and-swap, as [`crate::engine`] does, so the workers deciding requests meanwhile
//! never wait for it longer than one bucket's lock.

use super::request::{policy_carrying, Carrying};
use super::{Compiled, Runtime};
use crate::config::Carried;
use crate::key;
use crate::limiter::{Policy, State};
use crate::metrics::Counter;
use crate::store::{Store, StoreError, MAX_ATTEMPTS};
use crate::table::{self, Encoded, Slot, SlotKind};
use std::fmt;

/// A client key as the filter logs it (`key=%016x`): the table's fingerprint of its keyed hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoggedKey(pub u64);

impl LoggedKey {
    /// Reads a key as logged: 1 to 16 hex digits. `None` for anything else.
    pub fn parse(text: &str) -> Option<LoggedKey> {
        let ok = (1..=16).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| u64::from_str_radix(text, 16).ok().map(LoggedKey))
            .flatten()
    }
}

impl fmt::Display for LoggedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One key's state under one rule, as a request arriving now would find it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyState {
    /// The key.
    pub key: LoggedKey,
    /// Whether the table holds an entry for the key under this rule (if not, the other
    /// figures are those of a key never seen).
    pub tracked: bool,
    /// Requests (or units) the key's entry still remembers ([`State::weight`]); for an
    /// `in_flight` rule, the slots it holds.
    pub used: u64,
    /// Whole requests the key may still make now.
    pub remaining: u64,
    /// The rule's limit in force (an elastic rule's, scaled).
    pub limit: u64,
    /// Milliseconds until more quota is available than `remaining` (0: the quota is full).
    pub reset_ms: u64,
    /// If a request of cost 1 would be refused now, milliseconds until one would be admitted.
    pub retry_after_ms: Option<u64>,
    /// For an `in_flight` rule, the slots in use.
    pub in_flight: Option<u64>,
    /// For a global rule whose service refused the key, when that refusal ends (ms since the
    /// epoch).
    pub blocked_until_ms: Option<u64>,
}

/// Why an operator's request could not be answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OperatorError {
    /// No rule of the configuration has this name.
    UnknownRule(String),
    /// The key does not carry the rule's tag: it was logged for another rule.
    NotOfRule {
        /// The rule asked about.
        rule: String,
        /// The key.
        key: LoggedKey,
    },
    /// The store failed (for a reset: or kept changing under it).
    Store(StoreError),
}

impl fmt::Display for OperatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OperatorError::UnknownRule(rule) => write!(f, "no rule named {rule:?}"),
            OperatorError::NotOfRule { rule, key } => write!(
                f,
                "key {key} is not a key of rule {rule:?} (it does not carry the rule's tag: was it logged for another rule?)"
            ),
            OperatorError::Store(e) => write!(f, "the store failed: {e}"),
        }
    }
}

impl std::error::Error for OperatorError {}

impl From<StoreError> for OperatorError {
    fn from(e: StoreError) -> OperatorError {
        OperatorError::Store(e)
    }
}

/// A rule found by name: its index and what was compiled of it.
struct Found<'a> {
    index: usize,
    compiled: &'a Compiled,
}

/// Whether a stored state belongs to a rule of `policy` (a global rule's block belongs to any;
/// a shared rule's keys are its tenants).
fn fits(policy: &Policy, shared: bool, state: &State) -> bool {
    if shared {
        return matches!(state, State::Tenant(_));
    }
    matches!(
        (policy, state),
        (_, State::Blocked { .. })
            | (Policy::SlidingWindow { .. }, State::SlidingWindow(_))
            | (Policy::FixedWindow { .. }, State::FixedWindow(_))
            | (Policy::Gcra(_), State::Gcra(_))
            | (Policy::SlidingLog { .. }, State::SlidingLog(_))
            | (Policy::InFlight { .. }, State::InFlight(_))
            | (Policy::Lease { .. }, State::Lease(_))
    )
}

impl<S: Store> Runtime<S> {
    /// Whether a found rule shares its limit among its keys (its entries are tenants).
    fn shared(&self, found: &Found<'_>) -> bool {
        self.config
            .rules
            .get(found.index)
            .is_some_and(|r| r.share.is_some())
    }
}

/// The key's entry in a decoded slot, of any algorithm.
fn entry_of(slot: &Slot, key: LoggedKey) -> Option<State> {
    match slot {
        Slot::Bucket(..) => slot.find(key.0).cloned(),
        Slot::Log(_) => slot.find_log(key.0).cloned().map(State::SlidingLog),
    }
}

impl<S: Store> Runtime<S> {
    /// The state of `key` (as logged) under rule `rule` at `now_ms`, without changing it.
    /// A key the table does not hold is reported with `tracked: false`.
    pub fn inspect(
        &self,
        rule: &str,
        key: LoggedKey,
        now_ms: u64,
    ) -> Result<KeyState, OperatorError> {
        self.inspect_plan(rule, key, now_ms, None)
    }

    /// [`Runtime::inspect`] for a customer whose requests carry `plan` for a limit read from
    /// the request (the table does not know a customer's plan: without one, the figures are the
    /// rule's default's). Resolved as a request's value is: capped, and a 0 is the default.
    pub fn inspect_plan(
        &self,
        rule: &str,
        key: LoggedKey,
        now_ms: u64,
        plan: Option<u32>,
    ) -> Result<KeyState, OperatorError> {
        let found = self.rule_named(rule)?;
        let mut state = None;
        for slot in self.slots_of(rule, found.compiled, key)? {
            let read = self
                .store
                .read(slot, |bytes, _| Slot::decode(slot, bytes))?;
            // A slot that no longer decodes holds nothing a request would use.
            if let Some(s) = read.ok().as_ref().and_then(|s| entry_of(s, key)) {
                state = Some(s);
                break;
            }
        }
        let shared = self.shared(&found);
        let state = state.filter(|s| fits(&found.compiled.policy, shared, s));
        Ok(self.figures(&found, key, state.as_ref(), now_ms, plan))
    }

    /// The `n` keys of rule `rule` whose entries remember the most usage at `now_ms`
    /// ([`State::weight`]; a key blocked by a global rule's service first), busiest first, each
    /// with its [`Runtime::inspect`] figures. Scans every bucket (or, for a `sliding_log` rule,
    /// every log slot) once.
    pub fn busiest(
        &self,
        rule: &str,
        n: usize,
        now_ms: u64,
    ) -> Result<Vec<KeyState>, OperatorError> {
        self.busiest_plan(rule, n, now_ms, None)
    }

    /// [`Runtime::busiest`] with each key's figures under `plan` (see
    /// [`Runtime::inspect_plan`]); the order is by usage, whatever the plan.
    pub fn busiest_plan(
        &self,
        rule: &str,
        n: usize,
        now_ms: u64,
        plan: Option<u32>,
    ) -> Result<Vec<KeyState>, OperatorError> {
        let found = self.rule_named(rule)?;
        let policy = found.compiled.policy;
        let shared = self.shared(&found);
        let tag = key::rule_tag(found.compiled.fingerprint);
        let slots = if policy.uses_log() {
            let logs = u64::from(self.config.capacity.max(1));
            SlotKind::Log.slot(0)..SlotKind::Log.slot(logs)
        } else {
            0..u64::from(self.buckets)
        };
        // (weight, key, state), kept to the best `n` every so often so memory stays small.
        let mut best: Vec<(u64, LoggedKey, State)> = Vec::new();
        let keep = |best: &mut Vec<(u64, LoggedKey, State)>| {
            best.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            best.truncate(n);
        };
        for slot in slots {
            let read = self
                .store
                .read(slot, |bytes, _| Slot::decode(slot, bytes))?;
            let entries: Vec<(u64, State)> = match read {
                Ok(Slot::Bucket(entries, ..)) => entries.into_iter().flatten().collect(),
                Ok(Slot::Log(entry)) => entry
                    .into_iter()
                    .map(|(fp, log)| (fp, State::SlidingLog(log)))
                    .collect(),
                Err(table::Corrupt) => continue,
            };
            for (fp, state) in entries {
                if fp & key::TAG_MASK != tag || !fits(&policy, shared, &state) {
                    continue;
                }
                if let Some(weight) = state.weight(now_ms) {
                    best.push((weight, LoggedKey(fp), state));
                }
            }
            if best.len() > n.saturating_mul(2).saturating_add(64) {
                keep(&mut best);
            }
        }
        keep(&mut best);
        Ok(best
            .iter()
            .map(|(_, key, state)| self.figures(&found, *key, Some(state), now_ms, plan))
            .collect())
    }

    /// Forgets `key` (as logged) under rule `rule`: its entry leaves its bucket (or its log
    /// slot), so its next request starts afresh. Returns whether there was anything to forget.
    /// A reset is counted (`operator_resets`) and logged at info through `log`, naming `who`
    /// asked (e.g. `admin 127.0.0.1`).
    pub fn reset(
        &self,
        rule: &str,
        key: LoggedKey,
        now_ms: u64,
        who: &str,
        log: impl FnOnce(log::Level, fmt::Arguments<'_>),
    ) -> Result<bool, OperatorError> {
        let found = self.rule_named(rule)?;
        let mut forgot = false;
        for slot in self.slots_of(rule, found.compiled, key)? {
            forgot |= self.forget(slot, key)?;
        }
        if forgot {
            self.metrics.add(found.index, Counter::OperatorResets, 1);
            log(
                log::Level::Info,
                format_args!("operator reset rule={rule} key={key} by {who} at {now_ms}"),
            );
        }
        Ok(forgot)
    }

    /// The rule named `rule`.
    fn rule_named(&self, rule: &str) -> Result<Found<'_>, OperatorError> {
        self.config
            .rules
            .iter()
            .zip(&self.compiled)
            .enumerate()
            .find(|(_, (r, _))| r.name == rule)
            .map(|(index, (_, compiled))| Found { index, compiled })
            .ok_or_else(|| OperatorError::UnknownRule(rule.to_string()))
    }

    /// The slots a logged key of a rule may live in: those its hash picks if the hash was odd,
    /// and those if it was even (a bucket key's two buckets each; the same slots, often). An
    /// error if the key does not carry the rule's tag.
    fn slots_of(
        &self,
        rule: &str,
        compiled: &Compiled,
        key: LoggedKey,
    ) -> Result<impl Iterator<Item = u64>, OperatorError> {
        if key.0 & key::TAG_MASK != key::rule_tag(compiled.fingerprint) {
            return Err(OperatorError::NotOfRule {
                rule: rule.to_string(),
                key,
            });
        }
        let logs = compiled.policy.uses_log();
        let capacity = u64::from(self.config.capacity.max(1));
        let buckets = self.buckets;
        let slots = move |hash: u64| {
            if logs {
                let log = SlotKind::Log.slot(hash % capacity);
                [log, log]
            } else {
                let (first, second) = table::slots_of(hash, buckets);
                [first, second]
            }
        };
        let mut all: Vec<u64> = slots(key.0).into_iter().chain(slots(key.0 & !1)).collect();
        all.sort_unstable();
        all.dedup();
        Ok(all.into_iter())
    }

    /// Removes `key`'s entry from store slot `slot`, with compare-and-swap; whether there was
    /// one.
    fn forget(&self, slot: u64, key: LoggedKey) -> Result<bool, OperatorError> {
        let mut value = Encoded::default();
        let forgot = self
            .store
            .replace(slot, MAX_ATTEMPTS, &mut value, |bytes, value| {
                // Never written, or holding nothing a request would use: nothing to forget.
                let Ok(mut decoded) = Slot::decode(slot, bytes) else {
                    return (false, false);
                };
                let removed = match &mut decoded {
                    Slot::Bucket(entries, _, ghosts, _) => {
                        // Its counter, and its own trace if the table had forgotten it (a
                        // merged trace stands for other keys too, and stays).
                        let entry = entries
                            .iter_mut()
                            .find(|e| e.as_ref().is_some_and(|(fp, _)| *fp == key.0))
                            .map(Option::take)
                            .is_some();
                        let ghost = ghosts
                            .iter_mut()
                            .find(|g| !g.merged && g.live(0) && g.tag == table::tag_of(key.0))
                            .map(|g| *g = table::Ghost::default())
                            .is_some();
                        entry || ghost
                    }
                    Slot::Log(entry) => entry.take_if(|(fp, _)| *fp == key.0).is_some(),
                };
                if removed {
                    *value = decoded.encode();
                }
                (removed, removed)
            });
        Ok(forgot?)
    }

    /// A key's figures under a rule, from its state (`None`: not tracked), with the limit in
    /// force.
    fn figures(
        &self,
        found: &Found<'_>,
        key: LoggedKey,
        state: Option<&State>,
        now_ms: u64,
        plan: Option<u32>,
    ) -> KeyState {
        let compiled = found.compiled;
        let mut policy = compiled.policy;
        let per_request = self.config.rules.get(found.index).map(|r| &r.per_request);
        if let (Some(plan), Some(pr)) = (plan, per_request) {
            let carrying = Carrying {
                limit: pr
                    .limit
                    .as_ref()
                    .map(|f| f.resolve(Some(Carried::Number(f64::from(plan))))),
                burst: None,
            };
            policy = policy_carrying(pr, policy, carrying);
        }
        let factor = compiled
            .watch
            .as_ref()
            .map(|w| w.factor.load(std::sync::atomic::Ordering::Relaxed));
        let policy = match factor {
            Some(f) if f != crate::elastic::BASE => policy.scaled(f),
            _ => policy,
        };
        // A shared rule's tenant: its use over the window against the whole capacity (what it
        // may still use alone; its share while the capacity is contended is the level's).
        let tenant = match state {
            Some(State::Tenant(t)) => {
                let (limit, window_ms) = policy.limit_and_window();
                let usage = State::SlidingWindow(t.usage);
                Some((Policy::SlidingWindow { limit, window_ms }, usage))
            }
            _ => None,
        };
        let (policy, state) = match &tenant {
            Some((p, s)) => (*p, Some(s)),
            None => (policy, state),
        };
        let (now, _) = policy.decide(state, now_ms, 0);
        let (next, _) = policy.decide(state, now_ms, 1);
        let blocked_until_ms = match state {
            Some(State::Blocked { until_ms }) if now_ms < *until_ms => Some(*until_ms),
            _ => None,
        };
        let used = match state {
            Some(State::Blocked { .. }) | None => 0,
            Some(s) => s.weight(now_ms).unwrap_or(0),
        };
        KeyState {
            key,
            tracked: state.is_some(),
            used,
            remaining: now.remaining,
            limit: now.limit,
            reset_ms: now.reset_ms,
            retry_after_ms: (!next.allowed).then_some(next.retry_after_ms),
            in_flight: matches!(policy, Policy::InFlight { .. }).then_some(used),
            blocked_until_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Seed;
    use crate::runtime::{Decision, OperatorCall, Start};
    use crate::store::MemoryStore;
    use crate::testkit::FakeHost;

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        crate::testkit::runtime(json, Seed([1, 2]))
    }

    fn api(key: &str) -> FakeHost {
        FakeHost::new("10.0.0.1", "/").header("x-api-key", key)
    }

    /// Decides one request; its limited line, if it was refused: (key, remaining, retry).
    fn request(rt: &Runtime<MemoryStore>, host: &mut FakeHost) -> Option<(LoggedKey, u64, u64)> {
        host.logs.clear();
        let d = match rt.start(host) {
            Start::Decided(d) => d,
            Start::Ask(_) => panic!("asked a service"),
        };
        if !matches!(d, Decision::Reply(_)) {
            return None;
        }
        let (_, line) = host.logs.first().expect("a limited line");
        let field = |name: &str| {
            line.split(' ')
                .find_map(|w| w.strip_prefix(name))
                .unwrap()
                .to_string()
        };
        Some((
            LoggedKey::parse(&field("key=")).unwrap(),
            field("remaining=").parse().unwrap(),
            field("retry_after_ms=").parse().unwrap(),
        ))
    }

    /// The key of `host`'s request under rule `i`, as the filter would log it.
    fn logged(rt: &Runtime<MemoryStore>, i: usize, host: &mut FakeHost) -> LoggedKey {
        let rule = &rt.config.rules[i];
        let hash =
            key::client_key(rt.seed, rt.compiled[i].fingerprint, &rule.key, false, host).unwrap();
        LoggedKey(table::fingerprint_of(hash))
    }

    fn resets(rt: &Runtime<MemoryStore>) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        rt.metrics().drain(
            |r, c, n| {
                if c == Counter::OperatorResets {
                    out.push((r, n))
                }
            },
            |_, _| {},
        );
        out
    }

    const CUSTOMER: &str = r#"{"rules": [{"name": "customer", "key": ["header:x-api-key"],
        "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}], "log_limited": "info"}"#;

    #[test]
    fn a_customers_figures_follow_the_plan_its_requests_carry() {
        let rt = runtime(
            r#"{"rules": [{"name": "plan", "key": ["header:x-api-key"],
                "rate_limit": {"requests_per_unit": {"from": "header:x-plan", "default": 2, "max": 10},
                               "unit": "minute"}}]}"#,
        );
        let mut host = api("k1").header("x-plan", "5");
        for _ in 0..3 {
            assert_eq!(request(&rt, &mut host), None);
        }
        let key = logged(&rt, 0, &mut host);
        let now = host.now;
        // Without the plan, the default's figures: over it.
        let default = rt.inspect("plan", key, now).unwrap();
        assert_eq!((default.used, default.limit, default.remaining), (3, 2, 0));
        // Under the customer's plan: 2 of 5 left; a plan above the cap is the cap's.
        let plan = rt.inspect_plan("plan", key, now, Some(5)).unwrap();
        assert_eq!((plan.used, plan.limit, plan.remaining), (3, 5, 2));
        let capped = rt.inspect_plan("plan", key, now, Some(50)).unwrap();
        assert_eq!((capped.limit, capped.remaining), (10, 7));
        let top = rt.busiest_plan("plan", 1, now, Some(5)).unwrap();
        assert_eq!(top.first().map(|k| (k.key, k.remaining)), Some((key, 2)));
        // Over HTTP: limit= names the plan, and only where the rule reads one.
        let query = format!("rule=plan&key={key}&limit=5");
        let a = rt.answer(OperatorCall::Key, "p", &query, now, "t", |_, _| {});
        assert_eq!(a.status, 200);
        assert!(a.body.contains("\"limit\":5,"), "{}", a.body);
        let bad = rt.answer(
            OperatorCall::Key,
            "p",
            &format!("rule=plan&key={key}&limit=x"),
            now,
            "t",
            |_, _| {},
        );
        assert_eq!(bad.status, 400);
        let fixed = runtime(CUSTOMER);
        let no = fixed.answer(
            OperatorCall::Key,
            "p",
            &format!("rule=customer&key={key}&limit=5"),
            now,
            "t",
            |_, _| {},
        );
        assert_eq!(no.status, 400, "{}", no.body);
    }

    #[test]
    fn a_key_at_its_limit_is_reset_and_passes_at_once() {
        let rt = runtime(CUSTOMER);
        let mut host = api("k1");
        let now = host.now;
        assert_eq!(request(&rt, &mut host), None);
        assert_eq!(request(&rt, &mut host), None);
        let (key, _, _) = request(&rt, &mut host).expect("limited");
        // The logged key is the stored fingerprint.
        assert_eq!(key, logged(&rt, 0, &mut host));
        let s = rt.inspect("customer", key, now).unwrap();
        assert!(s.tracked);
        assert_eq!((s.used, s.remaining, s.limit), (2, 0, 2));
        assert!(s.retry_after_ms.is_some());
        let mut lines = Vec::new();
        let forgot = rt.reset("customer", key, now, "admin 127.0.0.1", |level, line| {
            lines.push((level, line.to_string()))
        });
        assert_eq!(forgot, Ok(true));
        assert_eq!(
            lines,
            [(
                log::Level::Info,
                format!("operator reset rule=customer key={key} by admin 127.0.0.1 at {now}")
            )]
        );
        assert_eq!(resets(&rt), [(0, 1)]);
        let s = rt.inspect("customer", key, now).unwrap();
        assert!(!s.tracked);
        assert_eq!((s.used, s.remaining, s.retry_after_ms), (0, 2, None));
        assert_eq!(request(&rt, &mut host), None, "passes at once");
        // Nothing to forget: not counted, not logged.
        let other = logged(&rt, 0, &mut api("k2"));
        assert_eq!(
            rt.reset("customer", other, now, "x", |_, _| panic!()),
            Ok(false)
        );
        assert_eq!(resets(&rt), []);
    }

    /// A key the table forgot at its limit stays refused (its ghost); a reset takes the ghost
    /// too, and it passes at once.
    #[test]
    fn a_forgotten_key_at_its_limit_is_reset_with_its_ghost() {
        // One bucket of 16: a seventeenth key at its limit pushes the oldest one out.
        let json = r#"{"capacity": 4, "rules": [{"name": "customer", "key": ["header:x-api-key"],
            "rate_limit": {"requests_per_unit": 2, "unit": "minute"}}]}"#;
        let rt = runtime(json);
        let mut first = api("k0");
        let key = logged(&rt, 0, &mut first);
        for k in 0..=crate::table::WAYS {
            let mut host = api(&format!("k{k}"));
            assert_eq!(request(&rt, &mut host), None);
            assert_eq!(request(&rt, &mut host), None);
        }
        assert!(!rt.inspect("customer", key, first.now).unwrap().tracked);
        assert!(
            request(&rt, &mut first).is_some(),
            "forgotten, not forgiven"
        );
        assert_eq!(
            rt.reset("customer", key, first.now, "x", |_, _| {}),
            Ok(true)
        );
        assert_eq!(request(&rt, &mut first), None, "passes once reset");
    }

    /// Fills a key of the one rule of `json` until it is refused, checking that inspect
    /// foretells each request's figures; returns what inspect says once it is refused.
    fn fill(json: &str, expect_limit: u64) -> KeyState {
        let rt = runtime(json);
        let mut host = api("k1");
        let now = host.now;
        let key = logged(&rt, 0, &mut host);
        let fresh = rt.inspect("r", key, now).unwrap();
        assert!(!fresh.tracked);
        assert_eq!((fresh.used, fresh.limit), (0, expect_limit));
        for n in 1..=expect_limit {
            let before = rt.inspect("r", key, now).unwrap();
            assert_eq!(before.retry_after_ms, None, "request {n} passes");
            assert_eq!(request(&rt, &mut host), None);
            let after = rt.inspect("r", key, now).unwrap();
            assert!(after.tracked);
            assert_eq!(after.used, n);
            assert_eq!(after.remaining, expect_limit - n);
        }
        let full = rt.inspect("r", key, now).unwrap();
        let (logged_key, remaining, retry) = request(&rt, &mut host).expect("refused");
        assert_eq!(logged_key, key);
        assert_eq!(full.remaining, remaining);
        assert_eq!(
            full.retry_after_ms,
            Some(retry),
            "what the refused request is told"
        );
        full
    }

    fn rule(algorithm: &str) -> String {
        format!(
            r#"{{"rules": [{{"name": "r", "key": ["header:x-api-key"], {algorithm}
            "rate_limit": {{"requests_per_unit": 3, "unit": "minute"}}}}], "log_limited": "info"}}"#
        )
    }

    #[test]
    fn inspect_foretells_each_algorithm() {
        let s = fill(&rule(""), 3);
        assert_eq!((s.used, s.in_flight), (3, None));
        let s = fill(&rule(r#""algorithm": "fixed_window","#), 3);
        // The window ends a minute after 600 s: the quota is back then.
        assert_eq!(
            (s.used, s.reset_ms, s.retry_after_ms),
            (3, 60_000, Some(60_000))
        );
        let s = fill(&rule(r#""algorithm": "token_bucket", "burst": 3,"#), 3);
        assert_eq!(s.retry_after_ms, Some(20_000), "one token every 20 s");
        let s = fill(&rule(r#""algorithm": "leaky_bucket", "burst": 3,"#), 3);
        assert_eq!(s.retry_after_ms, Some(20_000));
        let s = fill(&rule(r#""algorithm": "sliding_log","#), 3);
        assert_eq!(s.retry_after_ms, Some(60_000));
        let s = fill(
            r#"{"rules": [{"name": "r", "key": ["header:x-api-key"], "in_flight": {"max": 2}}],
            "log_limited": "info"}"#,
            2,
        );
        assert_eq!((s.used, s.in_flight, s.remaining), (2, Some(2), 0));
    }

    #[test]
    fn a_sliding_log_key_is_reset_in_its_log_slot() {
        let rt = runtime(&rule(r#""algorithm": "sliding_log","#));
        let mut host = api("k1");
        let now = host.now;
        for _ in 0..3 {
            assert_eq!(request(&rt, &mut host), None);
        }
        let (key, _, _) = request(&rt, &mut host).expect("refused");
        assert_eq!(rt.busiest("r", 5, now).unwrap()[0].key, key);
        assert_eq!(rt.reset("r", key, now, "t", |_, _| {}), Ok(true));
        assert_eq!(request(&rt, &mut host), None);
    }

    #[test]
    fn busiest_lists_the_rules_keys_only_busiest_first() {
        let rt = runtime(
            r#"{"rules": [
                {"name": "a", "key": ["header:x-api-key"],
                 "rate_limit": {"requests_per_unit": 100, "unit": "minute"}},
                {"name": "b", "key": ["header:x-api-key"], "algorithm": "fixed_window",
                 "rate_limit": {"requests_per_unit": 100, "unit": "minute"}},
                {"name": "c", "key": ["remote_address"],
                 "rate_limit": {"requests_per_unit": 100, "unit": "minute"}}]}"#,
        );
        let now = api("x").now;
        for (k, n) in [("k1", 5), ("k2", 1), ("k3", 3), ("k4", 2)] {
            for _ in 0..n {
                assert_eq!(request(&rt, &mut api(k)), None);
            }
        }
        let key = |i, k| logged(&rt, i, &mut api(k));
        let top = rt.busiest("a", 3, now).unwrap();
        let keys: Vec<_> = top.iter().map(|s| (s.key, s.used)).collect();
        assert_eq!(
            keys,
            [(key(0, "k1"), 5), (key(0, "k3"), 3), (key(0, "k4"), 2)]
        );
        assert_eq!(top[0], rt.inspect("a", key(0, "k1"), now).unwrap());
        let all = rt.busiest("b", 10, now).unwrap();
        assert_eq!(all.len(), 4, "b's keys, none of a's");
        assert!(all
            .iter()
            .all(|s| s.key.0 & key::TAG_MASK == key::rule_tag(rt.compiled[1].fingerprint)));
        assert_eq!(all[0].key, key(1, "k1"));
        let c = rt.busiest("c", 10, now).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].used, 11);
        // Nothing remembered once the windows have passed.
        assert_eq!(rt.busiest("a", 3, now + 200_000).unwrap(), []);
    }

    #[test]
    fn a_shared_rules_keys_are_its_tenants_busiest_first() {
        let rt = runtime(
            r#"{"rules": [{"name": "s", "key": ["header:x-api-key"],
                 "rate_limit": {"requests_per_unit": 100, "unit": "minute"}, "share": {}}]}"#,
        );
        let now = api("x").now;
        for (k, n) in [("t1", 2), ("t2", 7), ("t3", 4)] {
            for _ in 0..n {
                assert_eq!(request(&rt, &mut api(k)), None);
            }
        }
        let key = |k| logged(&rt, 0, &mut api(k));
        let top = rt.busiest("s", 2, now).unwrap();
        let seen: Vec<_> = top.iter().map(|s| (s.key, s.used, s.remaining)).collect();
        assert_eq!(seen, [(key("t2"), 7, 93), (key("t3"), 4, 96)]);
        let one = rt.inspect("s", key("t1"), now).unwrap();
        assert_eq!((one.tracked, one.used, one.limit), (true, 2, 100));
    }

    #[test]
    fn unknown_rules_and_keys_of_other_rules_are_errors() {
        let rt = runtime(CUSTOMER);
        let mut host = api("k1");
        let now = host.now;
        let key = logged(&rt, 0, &mut host);
        assert_eq!(
            rt.inspect("nope", key, now),
            Err(OperatorError::UnknownRule("nope".into()))
        );
        assert_eq!(
            rt.busiest("nope", 1, now),
            Err(OperatorError::UnknownRule("nope".into()))
        );
        assert_eq!(
            rt.reset("nope", key, now, "t", |_, _| {}),
            Err(OperatorError::UnknownRule("nope".into()))
        );
        // The same hash under another tag is no key of this rule.
        let foreign = LoggedKey(key.0 ^ (1 << 60));
        let err = rt.inspect("customer", foreign, now).unwrap_err();
        assert_eq!(
            err,
            OperatorError::NotOfRule {
                rule: "customer".into(),
                key: foreign
            }
        );
        assert!(err.to_string().contains("not a key of rule \"customer\""));
        // A key of the rule never seen is untracked, and there is nothing to reset.
        assert!(!rt.inspect("customer", key, now).unwrap().tracked);
        assert_eq!(rt.reset("customer", key, now, "t", |_, _| {}), Ok(false));
        assert_eq!(LoggedKey::parse("00000000000000ff"), Some(LoggedKey(255)));
        assert_eq!(LoggedKey::parse("FF"), Some(LoggedKey(255)));
        for bad in ["", "0x1", "g", "+1", "00000000000000000"] {
            assert_eq!(LoggedKey::parse(bad), None, "{bad}");
        }
        assert_eq!(LoggedKey(255).to_string(), "00000000000000ff");
    }

    #[test]
    fn a_logged_key_is_found_whichever_bucket_its_hash_picked() {
        // A logged key is the hash with its low bit set: the operator looks in the buckets of
        // both hashes it may have been.
        let rt = runtime(
            r#"{"capacity": 64, "rules": [{"name": "r", "key": ["header:x-api-key"],
                "rate_limit": {"requests_per_unit": 1, "unit": "minute"}}], "log_limited": "info"}"#,
        );
        let hash_of = |k: &str| {
            key::client_key(
                rt.seed,
                rt.compiled[0].fingerprint,
                &rt.config.rules[0].key,
                false,
                &mut api(k),
            )
            .unwrap()
        };
        let names: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
        let even = names.iter().find(|k| hash_of(k) % 2 == 0).unwrap();
        let odd = names.iter().find(|k| hash_of(k) % 2 == 1).unwrap();
        for k in [even, odd] {
            let mut host = api(k);
            let now = host.now;
            assert_eq!(request(&rt, &mut host), None);
            let (key, _, _) = request(&rt, &mut host).expect("refused");
            let h = hash_of(k);
            assert_eq!(key.0, h | 1);
            assert!(rt.inspect("r", key, now).unwrap().tracked, "{k}");
            assert_eq!(rt.reset("r", key, now, "t", |_, _| {}), Ok(true));
            assert_eq!(request(&rt, &mut host), None);
        }
        // Rarely, an even hash and its fingerprint have different buckets (the hash sits just
        // below a bucket's edge): the operator's slots are both's.
        let n = u64::from(rt.buckets);
        let tag = key::rule_tag(rt.compiled[0].fingerprint);
        let hash = (1..n)
            .map(|k| tag | ((k << 32).div_ceil(n) - 1))
            .find(|h| h % 2 == 0)
            .unwrap();
        let (a, b) = (
            table::slots_of(hash, rt.buckets),
            table::slots_of(hash | 1, rt.buckets),
        );
        assert_ne!(a.0, b.0);
        let slots: Vec<u64> = rt
            .slots_of("r", &rt.compiled[0], LoggedKey(hash | 1))
            .unwrap()
            .collect();
        for s in [a.0, a.1, b.0, b.1] {
            assert!(slots.contains(&s), "{s} in {slots:?}");
        }
    }
}
