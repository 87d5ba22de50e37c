//! Every request of the log through the filter's own pipeline: one [`Runtime`] over a
//! [`MemoryStore`] per configuration replayed (the configuration as written, and each
//! what-if), the clock at each entry's start time, and what a response owes (usage charged
//! from it, in-flight slots) settled at the entry's end, in time order, from a queue.
//!
//! Counts come from the runtime's own metrics; the limited keys from the line the filter logs
//! for each limited request (`limited rule=… key=…`), which is why replay's copy of a
//! configuration always logs them.

use super::input::Entry;
use super::sketch::{Counted, Distinct, SpaceSaving, Timeline};
use ratelimit_core::config::{Config, Rule};
use ratelimit_core::key::{self, Attributes, PlainRequest, Seed};
use ratelimit_core::metrics::Counter;
use ratelimit_core::runtime::Runtime;
use ratelimit_core::runtime::{Admitted, Decision, Host, Queued, Response, Start, Turn};
use ratelimit_core::store::MemoryStore;
use ratelimit_core::table;
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::fmt::{self, Write as _};

/// The table seed of every replay: keys hash the same from one run to the next (a live
/// Envoy's seed is random, so its hashes differ from these).
pub const SEED: Seed = Seed([0x7265_706c_6179_0001, 0x7265_706c_6179_0002]);
/// Limited keys monitored per rule and configuration (the top of them are reported).
pub const TOP_CAPACITY: usize = 1024;
/// Keys monitored per rule within one second, to find the busiest key's rate.
pub const PEAK_CAPACITY: usize = 1024;
/// The longest raw key kept for the report, in characters.
const MAX_RAW_KEY: usize = 200;

/// What a rule's traffic looked like, whatever its limit.
#[derive(Debug)]
pub struct Traffic {
    /// Requests the rule applied to (it matched, and every key part was there).
    pub matched: u64,
    /// Their distinct keys.
    pub keys: Distinct,
    /// The busiest key in any one second.
    pub peak: Peak,
}

/// The most requests one key sent within one second (by start time).
#[derive(Debug)]
pub struct Peak {
    second: Option<u64>,
    this_second: SpaceSaving,
    /// The busiest key and its second (since the epoch), if any.
    pub busiest: Option<(Counted, u64)>,
    /// Whether every second's count was exact (at most [`PEAK_CAPACITY`] keys a second).
    pub exact: bool,
}

impl Peak {
    fn new() -> Peak {
        Peak {
            second: None,
            this_second: SpaceSaving::new(PEAK_CAPACITY),
            busiest: None,
            exact: true,
        }
    }

    /// Counts a request of `key` at `t_ms`. An entry older than the second being counted
    /// (beyond the reorder window) counts in that second.
    fn add(&mut self, t_ms: u64, key: u64, raw: impl FnOnce() -> Option<String>) {
        let s = t_ms / 1000;
        if self.second.is_none_or(|current| s > current) {
            self.close_second();
            self.second = Some(s);
        }
        self.this_second.add(key, 1, raw);
    }

    /// Closes the second being counted.
    fn close_second(&mut self) {
        if let (Some(s), Some(top)) = (self.second, self.this_second.heaviest()) {
            let best = self.busiest.as_ref().map_or(0, |(b, _)| b.guaranteed());
            if top.guaranteed() > best {
                self.busiest = Some((top.clone(), s));
            }
        }
        self.exact &= self.this_second.exact();
        self.this_second.clear();
    }
}

/// What one configuration did with one rule's requests.
#[derive(Debug)]
pub struct Outcome {
    /// Admitted by the rule (and overall).
    pub allowed: u64,
    /// Refused by the rule (for a shadow rule: would have been).
    pub limited: u64,
    /// Held by delay mode, then admitted.
    pub delayed: u64,
    /// Refused by a shared rule, then waited in its line (admitted by a turn, or refused when
    /// the wait ended: then also in `limited`).
    pub waited: u64,
    /// Of those, refused when their wait ended.
    pub wait_timeouts: u64,
    /// Decided by `failure_mode: allow` / `deny` because the store could not decide.
    pub failed_open: u64,
    /// See `failed_open`.
    pub failed_closed: u64,
    /// Live keys forgotten to make room for new ones (the table's `capacity`).
    pub evictions: u64,
    /// Units charged after responses.
    pub usage_charged: u64,
    /// Responses that did not report their usage (charged the rule's default).
    pub usage_unreported: u64,
    /// Units of reservations given back (`true_up`).
    pub usage_refunded: u64,
    /// Units used beyond reservations (`true_up`).
    pub usage_exceeded: u64,
    /// Requests that lacked a part of the rule's key (`on_missing_key` then applied).
    pub key_missing: u64,
    /// Distinct keys limited.
    pub keys_limited: Distinct,
    /// The most limited keys.
    pub top: SpaceSaving,
}

impl Outcome {
    fn new() -> Outcome {
        Outcome {
            allowed: 0,
            limited: 0,
            delayed: 0,
            waited: 0,
            wait_timeouts: 0,
            failed_open: 0,
            failed_closed: 0,
            evictions: 0,
            usage_charged: 0,
            usage_unreported: 0,
            usage_refunded: 0,
            usage_exceeded: 0,
            key_missing: 0,
            keys_limited: Distinct::default(),
            top: SpaceSaving::new(TOP_CAPACITY),
        }
    }

    fn count(&mut self, counter: Counter, n: u64) {
        let field = match counter {
            Counter::Allowed => &mut self.allowed,
            Counter::Limited | Counter::ShadowLimited => &mut self.limited,
            Counter::Delayed => &mut self.delayed,
            Counter::FailedOpen => &mut self.failed_open,
            Counter::FailedClosed => &mut self.failed_closed,
            Counter::SlotEvictions => &mut self.evictions,
            Counter::UsageCharged => &mut self.usage_charged,
            Counter::UsageUnreported => &mut self.usage_unreported,
            Counter::UsageRefunded => &mut self.usage_refunded,
            Counter::UsageExceeded => &mut self.usage_exceeded,
            Counter::KeyMissing => &mut self.key_missing,
            // No store races offline, no service, no held request left behind; elastic rules
            // replay at their base limit (the log cannot say how the backend was doing as each
            // request was decided), waits are not reported, and no operator resets keys. A
            // limit read from the request replays with what the log recorded (its headers) and
            // the default otherwise. A log holds no request bodies: a model read from the body
            // is never seen (the default price, or the rule's refusal, applies).
            Counter::ModelUnpriced
            | Counter::StoreRetries
            | Counter::LimitDefaulted
            | Counter::LimitInvalid
            | Counter::LimitCapped
            | Counter::GlobalErrors
            | Counter::Abandoned
            | Counter::ElasticAllowed
            | Counter::RetryAfterSeconds
            | Counter::OperatorResets
            | Counter::LeaseClaims
            | Counter::LeaseGranted
            | Counter::LeaseRefused
            | Counter::LeaseLapsed
            | Counter::UsageReported
            | Counter::ReportsLost => return,
            // A shared rule replays as it decides (the log's order is its clock); its refusals
            // for a share or a band are in `limited` already.
            Counter::ShareRefused | Counter::BandRefused => return,
            // What a provider said is learned as live when the log kept its fields; the report
            // does not count it.
            Counter::ProviderLimited | Counter::ProviderSynced | Counter::ProviderFieldsInvalid => {
                return
            }
            // Waits replay on the log's clock: each waiter looks at its line as it would live.
            Counter::ShareQueued => &mut self.waited,
            Counter::ShareQueueTimeouts => &mut self.wait_timeouts,
            Counter::ShareQueueFull | Counter::ShareWaitedMs => return,
        };
        *field += n;
    }
}

/// A request between its decisions: waiting in a shared rule's line (`queued`), or decided
/// at `look_ms`.
struct Waiting {
    queued: Option<Queued>,
    look_ms: u64,
    duration_ms: u64,
    bytes_sent: u64,
    response: Vec<(String, Vec<u8>)>,
}

/// An admitted request that owes its rules something when it ends.
struct Owed {
    end_ms: u64,
    seq: u64,
    admitted: Admitted,
    bytes_sent: u64,
    response: Vec<(String, Vec<u8>)>,
}

impl PartialEq for Owed {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Owed {}
impl PartialOrd for Owed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Owed {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.end_ms, self.seq).cmp(&(other.end_ms, other.seq))
    }
}

/// The response fields an entry logged.
struct Logged<'a>(&'a [(String, Vec<u8>)]);

impl Response for Logged<'_> {
    fn field(&mut self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    fn field_lines(&mut self, name: &str, line: &mut dyn FnMut(&[u8])) {
        self.0
            .iter()
            .filter(|(n, _)| n == name)
            .for_each(|(_, v)| line(v));
    }

    /// A replay sends no response on: nothing to take out.
    fn remove(&mut self, _name: &str) {}
}

/// The pipeline's host for one logged request: its attributes, its start time as the clock,
/// and the limited lines it logs.
struct ReplayHost<'a> {
    request: &'a mut PlainRequest,
    now_ms: u64,
    rules: &'a HashMap<String, usize>,
    line: &'a mut String,
    limited: &'a mut Vec<(usize, u64)>,
}

impl Attributes for ReplayHost<'_> {
    fn source_address(&mut self) -> Option<&str> {
        self.request.source_address()
    }
    fn path(&mut self) -> Option<&str> {
        self.request.path()
    }
    fn method(&mut self) -> Option<&str> {
        self.request.method()
    }
    fn authority(&mut self) -> Option<&str> {
        self.request.authority()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.request.header(name)
    }
    fn body_field(&mut self, slot: usize) -> Option<&[u8]> {
        self.request.body_field(slot)
    }
}

impl Host for ReplayHost<'_> {
    fn now_ms(&mut self) -> u64 {
        self.now_ms
    }
    fn held(&self) -> usize {
        0 // no worker holds anything offline: see the README on delay mode
    }
    fn log(&mut self, _level: log::Level, line: fmt::Arguments<'_>) {
        self.line.clear();
        if self.line.write_fmt(line).is_err() {
            return;
        }
        if let Some(hit) = limited_line(self.line, self.rules) {
            self.limited.push(hit);
        }
    }
}

/// The rule and key of the filter's `limited rule=NAME shadow=… key=HEX …` line.
pub fn limited_line(line: &str, rules: &HashMap<String, usize>) -> Option<(usize, u64)> {
    let rest = line.strip_prefix("limited rule=")?;
    let (name, rest) = rest.split_once(' ')?;
    let hex = rest.split(' ').find_map(|w| w.strip_prefix("key="))?;
    Some((*rules.get(name)?, u64::from_str_radix(hex, 16).ok()?))
}

/// A rule's key as it was in the request: `remote_address=10.0.0.1 header:x-api-key=k1`.
pub fn raw_key(rule: &Rule, request: &mut PlainRequest) -> Option<String> {
    let entries =
        key::descriptor_entries(&rule.name, &rule.key, rule.shares_missing_key(), request)?;
    let mut out = String::new();
    for (part, value) in entries.iter().skip(1) {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(part);
        out.push('=');
        out.push_str(&String::from_utf8_lossy(value));
    }
    if out.chars().count() > MAX_RAW_KEY {
        out = out.chars().take(MAX_RAW_KEY).chain("…".chars()).collect();
    }
    Some(out)
}

/// One configuration replayed.
pub struct Variant {
    /// `configured`, or the what-if (`per-ip=50`).
    pub name: String,
    /// The rule the what-if changes.
    pub changes: Option<usize>,
    rt: Runtime<MemoryStore>,
    rule_index: HashMap<String, usize>,
    /// Boxed: the heap moves its items often, and an admitted request is large.
    owed: BinaryHeap<Reverse<Box<Owed>>>,
    /// Requests waiting in a shared rule's line, with when each looks at it next.
    waiting: Vec<Waiting>,
    seq: u64,
    line: String,
    limited: Vec<(usize, u64)>,
    fields: String,
    /// Per rule, in configuration order.
    pub outcomes: Vec<Outcome>,
}

impl Variant {
    /// Replays `config` (already prepared for replay: see [`super::prepare`]).
    pub fn new(name: String, changes: Option<usize>, config: Config) -> Variant {
        let rule_index = config
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), i))
            .collect();
        let outcomes = config.rules.iter().map(|_| Outcome::new()).collect();
        Variant {
            name,
            changes,
            rt: Runtime::new(config, SEED, MemoryStore::new()),
            rule_index,
            owed: BinaryHeap::new(),
            waiting: Vec::new(),
            seq: 0,
            line: String::new(),
            limited: Vec::new(),
            fields: String::new(),
            outcomes,
        }
    }

    /// The configuration replayed.
    pub fn config(&self) -> &Config {
        self.rt.config()
    }

    /// Decides one request at its start time, after settling what ended before it. Counts
    /// go to `timeline` columns `column(rule)` (allowed) and `column(rule) + 1` (limited).
    fn decide(
        &mut self,
        e: &mut Entry,
        timeline: &mut Timeline,
        column: impl Fn(usize) -> usize,
        raw_keys: bool,
    ) {
        self.turns_until(e.start_ms);
        self.settle_until(e.start_ms);
        let mut host = ReplayHost {
            request: &mut e.request,
            now_ms: e.start_ms,
            rules: &self.rule_index,
            line: &mut self.line,
            limited: &mut self.limited,
        };
        let decision = match self.rt.start(&mut host) {
            Start::Decided(d) => d,
            // Replay's copy of a configuration has no global rule: never asks, but a request
            // that did would be decided as if no service answered.
            Start::Ask(p) => self.rt.finish(&mut host, &p),
        };
        let w = Waiting {
            queued: None,
            look_ms: e.start_ms,
            duration_ms: e.end_ms().saturating_sub(e.start_ms),
            bytes_sent: e.bytes_sent.unwrap_or(0),
            response: e.response.clone(),
        };
        self.concluded(decision, w);
        let outcomes = &mut self.outcomes;
        let t = e.start_ms;
        self.rt.metrics().drain(
            |rule, counter, n| {
                if let Some(o) = outcomes.get_mut(rule) {
                    o.count(counter, n);
                }
                match counter {
                    Counter::Allowed => timeline.add(t, column(rule), n),
                    Counter::Limited | Counter::ShadowLimited => {
                        timeline.add(t, column(rule) + 1, n)
                    }
                    _ => {}
                }
            },
            |_, _| {},
        );
        for (rule, key) in self.limited.drain(..) {
            let (Some(o), Some(r)) = (self.outcomes.get_mut(rule), self.rt.rules().get(rule))
            else {
                continue;
            };
            o.keys_limited.insert(key);
            o.top.add(key, 1, || {
                raw_keys.then(|| raw_key(r, &mut e.request)).flatten()
            });
        }
    }

    /// Settles, in order, every request that ended at or before `t_ms`.
    /// What became of a request decided at `w.look_ms`: one admitted owes its rules until it
    /// ends (its logged duration after it went on), one sent to a shared rule's line waits.
    fn concluded(&mut self, decision: Decision, mut w: Waiting) {
        let admitted = match decision {
            Decision::Continue(a) => a,
            Decision::Hold { admitted, held, .. } => {
                self.rt.release(&held);
                admitted
            }
            Decision::Reply(_) => None,
            Decision::Queue(q) => {
                w.look_ms = q.first_look();
                w.queued = Some(q);
                self.waiting.push(w);
                return;
            }
        };
        if let Some(a) = admitted.filter(Admitted::owes) {
            self.seq += 1;
            self.owed.push(Reverse(Box::new(Owed {
                end_ms: w.look_ms.saturating_add(w.duration_ms),
                seq: self.seq,
                admitted: a,
                bytes_sent: w.bytes_sent,
                response: w.response,
            })));
        }
    }

    /// Lets every waiting request look at its line, in time order, until `t_ms`.
    fn turns_until(&mut self, t_ms: u64) {
        loop {
            let next = self
                .waiting
                .iter()
                .enumerate()
                .filter(|(_, w)| w.look_ms <= t_ms)
                .min_by_key(|(_, w)| w.look_ms)
                .map(|(i, _)| i);
            let Some(i) = next else {
                return;
            };
            let mut w = self.waiting.swap_remove(i);
            let Some(q) = w.queued else {
                continue;
            };
            self.settle_until(w.look_ms);
            match self.rt.turn(&q, w.look_ms) {
                Turn::Wait(next) => {
                    w.look_ms = next.max(w.look_ms.saturating_add(1));
                    self.waiting.push(w);
                }
                Turn::Decided(d) => self.concluded(d, w),
            }
        }
    }

    fn settle_until(&mut self, t_ms: u64) {
        while self.owed.peek().is_some_and(|Reverse(o)| o.end_ms <= t_ms) {
            let Some(Reverse(o)) = self.owed.pop() else {
                break;
            };
            let o = *o;
            let mut a = o.admitted;
            if !o.response.is_empty() {
                let mut logged = Logged(&o.response);
                self.rt.response_headers(
                    &mut a,
                    &mut logged,
                    o.end_ms,
                    &mut self.fields,
                    |_, _, _| {},
                    &mut |_, _| {},
                );
                let logged = |rule: &str| {
                    let name = format!("usage:{rule}");
                    let (_, v) = o.response.iter().find(|(k, _)| *k == name)?;
                    // A number as JSON writes it ("1234", or "1234.0" from a float field).
                    let v = std::str::from_utf8(v).ok()?.trim();
                    v.parse::<u64>().ok().or_else(|| {
                        let f = v
                            .parse::<f64>()
                            .ok()
                            .filter(|f| f.is_finite() && *f >= 0.0)?;
                        Some(f as u64)
                    })
                };
                self.rt
                    .charge_known(&mut a, logged, o.end_ms, &mut |_, _| {});
            }
            self.rt.response_body(
                &mut a,
                o.bytes_sent,
                None,
                true,
                || o.end_ms,
                &mut |_, _| {},
            );
            self.rt.settle(a, o.end_ms, &mut |_, _| {});
            let outcomes = &mut self.outcomes;
            self.rt.metrics().drain(
                |rule, counter, n| {
                    if let Some(o) = outcomes.get_mut(rule) {
                        o.count(counter, n);
                    }
                },
                |_, _| {},
            );
        }
    }
}

/// A whole replay: the traffic of each rule, and what each configuration did with it.
pub struct Replay {
    /// The configuration as written (for names and descriptions).
    pub config: Config,
    fingerprints: Vec<u64>,
    /// Per rule.
    pub traffic: Vec<Traffic>,
    /// The configuration as written first, then each what-if.
    pub variants: Vec<Variant>,
    /// Allowed and limited per rule and variant over time: see [`Replay::column`].
    pub timeline: Timeline,
    /// Requests replayed.
    pub requests: u64,
    /// The earliest and latest start times.
    pub span_ms: Option<(u64, u64)>,
    raw_keys: bool,
}

impl Replay {
    /// A replay of `variants` (prepared for replay, the first being the configuration as
    /// written, `config`); `raw_keys` keeps the raw values of the keys it reports.
    pub fn new(config: Config, variants: Vec<Variant>, raw_keys: bool) -> Replay {
        let fingerprints = config
            .rules
            .iter()
            .map(|r| key::rule_fingerprint(SEED, &r.name, &r.key, r.limit.algorithm_name()))
            .collect();
        let traffic = config
            .rules
            .iter()
            .map(|_| Traffic {
                matched: 0,
                keys: Distinct::default(),
                peak: Peak::new(),
            })
            .collect();
        let columns = config.rules.len() * variants.len() * 2;
        Replay {
            config,
            fingerprints,
            traffic,
            variants,
            timeline: Timeline::new(columns),
            requests: 0,
            span_ms: None,
            raw_keys,
        }
    }

    /// The timeline column of a rule's allowed requests under a variant (limited: the next).
    pub fn column(&self, rule: usize, variant: usize) -> usize {
        column(self.variants.len(), rule, variant)
    }

    /// Replays one request.
    pub fn request(&mut self, mut e: Entry) {
        self.requests += 1;
        for (path, value) in std::mem::take(&mut e.body) {
            if let Some(slot) = self.config.body_slot(&path) {
                e.request.body.push((slot, value));
            }
        }
        let t = e.start_ms;
        self.span_ms = Some(self.span_ms.map_or((t, t), |(a, b)| (a.min(t), b.max(t))));
        for ((rule, fp), traffic) in self
            .config
            .rules
            .iter()
            .zip(&self.fingerprints)
            .zip(&mut self.traffic)
        {
            if !key::matches(&rule.matcher, &mut e.request) {
                continue;
            }
            let Some(hash) = key::client_key(
                SEED,
                *fp,
                &rule.key,
                rule.shares_missing_key(),
                &mut e.request,
            ) else {
                continue;
            };
            traffic.matched += 1;
            traffic.keys.insert(hash);
            let raw_keys = self.raw_keys;
            // The key as the filter logs it, so the report's keys are the ones an operator
            // looks up.
            traffic.peak.add(t, table::fingerprint_of(hash), || {
                raw_keys.then(|| raw_key(rule, &mut e.request)).flatten()
            });
        }
        let n = self.variants.len();
        for (v, variant) in self.variants.iter_mut().enumerate() {
            variant.decide(
                &mut e,
                &mut self.timeline,
                |r| column(n, r, v),
                self.raw_keys,
            );
        }
    }

    /// Settles every request still owing (the log is over) and closes the last second.
    pub fn finish(&mut self) {
        let n = self.variants.len();
        let last = self.span_ms.map_or(0, |(_, b)| b);
        for (i, v) in self.variants.iter_mut().enumerate() {
            v.turns_until(u64::MAX);
            v.settle_until(u64::MAX);
            // What the last turns counted (requests still waiting when the log ended), at the
            // log's last second.
            let outcomes = &mut v.outcomes;
            let timeline = &mut self.timeline;
            v.rt.metrics().drain(
                |rule, counter, k| {
                    if let Some(o) = outcomes.get_mut(rule) {
                        o.count(counter, k);
                    }
                    match counter {
                        Counter::Allowed => timeline.add(last, column(n, rule, i), k),
                        Counter::Limited | Counter::ShadowLimited => {
                            timeline.add(last, column(n, rule, i) + 1, k)
                        }
                        _ => {}
                    }
                },
                |_, _| {},
            );
        }
        for t in &mut self.traffic {
            t.peak.close_second();
        }
    }
}

fn column(variants: usize, rule: usize, variant: usize) -> usize {
    (rule * variants + variant) * 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::input::Entry;

    fn config(json: &str) -> Config {
        let mut c = Config::parse(json.as_bytes()).unwrap();
        crate::replay::prepare(&mut c);
        c
    }

    fn entry(t: u64, addr: &str) -> Entry {
        Entry {
            start_ms: t,
            request: PlainRequest {
                source_address: Some(format!("{addr}:4000")),
                path: Some("/api/x".into()),
                method: Some("GET".into()),
                authority: Some("example.com".into()),
                ..PlainRequest::default()
            },
            ..Entry::default()
        }
    }

    fn replay(json: &str, what_if: Option<&str>) -> Replay {
        let base = config(json);
        let mut variants = vec![Variant::new("configured".into(), None, base.clone())];
        if let Some(w) = what_if {
            variants.push(Variant::new("what-if".into(), Some(0), config(w)));
        }
        Replay::new(base, variants, true)
    }

    const PER_IP: &str = r#"{"rules": [{"name": "per-ip", "key": ["remote_address"],
        "rate_limit": {"requests_per_unit": 3, "unit": "second"}, "algorithm": "fixed_window"}]}"#;

    #[test]
    fn counts_keys_and_limited_lines_are_the_filters() {
        let mut r = replay(
            PER_IP,
            Some(
                r#"{"rules": [{"name": "per-ip", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 5, "unit": "second"}, "algorithm": "fixed_window"}]}"#,
            ),
        );
        let t0 = 1_800_000_000_000;
        // 10.0.0.1 sends 8 in one second, 10.0.0.2 sends 2, then 10.0.0.1 one more a second
        // later.
        for i in 0..8 {
            r.request(entry(t0 + i * 10, "10.0.0.1"));
        }
        for i in 0..2 {
            r.request(entry(t0 + 500 + i, "10.0.0.2"));
        }
        r.request(entry(t0 + 1500, "10.0.0.1"));
        r.finish();
        let t = &r.traffic[0];
        assert_eq!(t.matched, 11);
        assert_eq!(t.keys.count(), 2);
        let (busiest, second) = t.peak.busiest.clone().unwrap();
        assert_eq!((busiest.count, second), (8, t0 / 1000));
        assert_eq!(busiest.raw.as_deref(), Some("remote_address=10.0.0.1"));
        let base = &r.variants[0].outcomes[0];
        assert_eq!((base.allowed, base.limited), (6, 5));
        assert_eq!(base.keys_limited.count(), 1);
        let top = base.top.top(5);
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].count, 5);
        // The key is the filter's own hash of the client key.
        let mut req = entry(0, "10.0.0.1").request;
        let fp = key::rule_fingerprint(SEED, "per-ip", &r.config.rules[0].key, "fixed_window");
        assert_eq!(
            Some(top[0].key),
            key::client_key(SEED, fp, &r.config.rules[0].key, false, &mut req)
                .map(table::fingerprint_of)
        );
        let what_if = &r.variants[1].outcomes[0];
        assert_eq!((what_if.allowed, what_if.limited), (8, 3));
        // The timeline: per second, allowed and limited of each configuration.
        let col = r.column(0, 1);
        assert_eq!(r.timeline.column(col), [7, 1]);
        assert_eq!(r.timeline.column(col + 1), [3, 0]);
    }

    #[test]
    fn body_fields_the_filter_logged_key_and_match_as_live() {
        let mut r = replay(
            r#"{"rules": [{"name": "per-model", "key": ["remote_address", "body:model"],
                "match": {"body": [{"field": "model", "prefix": "gpt-"}]},
                "rate_limit": {"requests_per_unit": 2, "unit": "hour"}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        // Three of gpt-4o, two of gpt-4o-mini, one of o3 (not matched), one without a model.
        for (i, model) in [
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4o",
            "o3",
            "gpt-4o-mini",
            "gpt-4o",
        ]
        .iter()
        .map(Some)
        .chain([None])
        .enumerate()
        {
            let mut e = entry(t0 + i as u64, "10.0.0.1");
            if let Some(m) = model {
                e.body.push(("model".into(), m.as_bytes().to_vec()));
            }
            r.request(e);
        }
        r.finish();
        let t = &r.traffic[0];
        assert_eq!((t.matched, t.keys.count()), (5, 2));
        let o = &r.variants[0].outcomes[0];
        // gpt-4o's third is refused; the one without a model does not match.
        assert_eq!((o.allowed, o.limited), (4, 1));
    }

    #[test]
    fn in_flight_slots_are_given_back_when_each_request_ends() {
        let mut r = replay(
            r#"{"rules": [{"name": "flight", "key": ["remote_address"], "in_flight": {"max": 2}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        // Three long requests at once: the third finds both slots taken; once the first has
        // ended (t0 + 100), a fourth gets its slot.
        for i in 0..3 {
            let mut e = entry(t0 + i, "10.0.0.1");
            e.duration_ms = Some(100);
            r.request(e);
        }
        r.request(entry(t0 + 99, "10.0.0.1"));
        r.request(entry(t0 + 100, "10.0.0.1"));
        r.finish();
        let o = &r.variants[0].outcomes[0];
        assert_eq!((o.allowed, o.limited), (3, 2));
    }

    #[test]
    fn usage_is_charged_from_the_logged_response() {
        let mut r = replay(
            r#"{"rules": [{"name": "tokens", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 1000, "unit": "hour"},
                "cost": {"response": "header:x-usage-tokens", "default": 50}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        for (i, usage) in [Some("600"), None, Some("300"), Some("10")]
            .iter()
            .enumerate()
        {
            let mut e = entry(t0 + i as u64 * 1000, "10.0.0.1");
            e.duration_ms = Some(10);
            if let Some(u) = usage {
                e.response
                    .push(("x-usage-tokens".into(), u.as_bytes().to_vec()));
            }
            r.request(e);
        }
        r.finish();
        let o = &r.variants[0].outcomes[0];
        // 600 + 50 (unreported: the default) + 300 = 950: the fourth still fits (1 token
        // left is enough to be admitted), and is charged its 10.
        assert_eq!((o.allowed, o.limited), (4, 0));
        assert_eq!(o.usage_charged, 960);
        assert_eq!(o.usage_unreported, 1);
    }

    #[test]
    fn a_body_usage_comes_from_what_the_filter_logged_and_is_trued_up() {
        let mut r = replay(
            r#"{"rules": [{"name": "tokens", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 1000, "unit": "hour"},
                "cost": {"response": "openai", "true_up": true,
                         "reserve": {"from": "openai", "default": 400}}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        // Three answers of 300 tokens, logged; one that logged nothing keeps its reservation.
        for (i, usage) in [Some("300"), Some("300.0"), None, Some("300")]
            .iter()
            .enumerate()
        {
            let mut e = entry(t0 + i as u64 * 1000, "10.0.0.1");
            e.duration_ms = Some(10);
            if let Some(u) = usage {
                e.response
                    .push(("usage:tokens".into(), u.as_bytes().to_vec()));
            }
            r.request(e);
        }
        r.finish();
        let o = &r.variants[0].outcomes[0];
        // Each reserves the default, 400 (a log has no request body): 300 + 300 + 400 = 1,000
        // once trued up, so the fourth does not fit.
        assert_eq!((o.allowed, o.limited), (3, 1));
        assert_eq!(o.usage_charged, 1000);
        assert_eq!((o.usage_unreported, o.usage_refunded), (1, 200));
    }

    #[test]
    fn body_bytes_come_from_bytes_sent() {
        let mut r = replay(
            r#"{"rules": [{"name": "dl", "key": ["remote_address"],
                "rate_limit": {"requests_per_unit": 1000, "unit": "day"},
                "cost": {"response": "body_bytes"}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        for i in 0..3 {
            let mut e = entry(t0 + i * 1000, "10.0.0.1");
            e.bytes_sent = Some(600);
            r.request(e);
        }
        r.finish();
        let o = &r.variants[0].outcomes[0];
        assert_eq!((o.allowed, o.limited, o.usage_charged), (2, 1, 1200));
    }

    #[test]
    fn global_rules_are_decided_by_their_local_rule_and_delays_are_counted() {
        let mut r = replay(
            r#"{"rules": [
                {"name": "g", "key": ["remote_address"], "rate_limit": {"requests_per_unit": 2, "unit": "minute"},
                 "global": {"cluster": "rls", "domain": "edge"}},
                {"name": "smooth", "algorithm": "leaky_bucket", "burst": 5, "on_limit": "delay",
                 "max_delay_ms": 1000, "rate_limit": {"requests_per_unit": 10, "unit": "second"}}]}"#,
            None,
        );
        let t0 = 1_800_000_000_000;
        for i in 0..4 {
            r.request(entry(t0 + i, "10.0.0.1"));
        }
        r.finish();
        let g = &r.variants[0].outcomes[0];
        assert_eq!((g.allowed, g.limited), (2, 2));
        let smooth = &r.variants[0].outcomes[1];
        assert_eq!(smooth.allowed, 2);
        assert_eq!(smooth.delayed, 1, "the second is held 100 ms for its turn");
    }

    #[test]
    fn limited_lines_are_read_back() {
        let rules: HashMap<String, usize> = [("a.b-c".to_string(), 3)].into();
        assert_eq!(
            limited_line(
                "limited rule=a.b-c shadow=true key=00000000000000ff cost=1 limit=5 window=60s remaining=0 retry_after_ms=1",
                &rules
            ),
            Some((3, 255))
        );
        assert_eq!(
            limited_line("limited rule=zz shadow=false key=01", &rules),
            None
        );
        assert_eq!(
            limited_line("rule a.b-c could not be decided", &rules),
            None
        );
    }
}
