//! What the filter counts, and where the counts wait for the host to publish them.
//!
//! A host call per increment costs about a microsecond in the wasm build, so requests add to
//! [`Metrics`] (plain atomics, shared by every thread that serves the runtime) and the host
//! publishes the sums and the gauges' movements on a timer, once a second. Both hosts define
//! the same names.

use crate::limiter::tenant::MAX_BANDS;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// How often the hosts publish the counts, ms.
pub const PUBLISH_PERIOD_MS: u32 = 1000;

/// Whether counts last published at `last_ms` are due again at `now_ms`, on a host whose timer
/// ticks every `tick_ms`. By the clock the filter reads, a tick can come a little before its
/// period is up (Envoy arms a timer from the time its event loop last cached, and the clock is
/// read in whole ms); a tick just short of the period would skip a whole tick, and a lone count
/// would wait up to two periods. So a tick up to half a tick early is on time: counts are
/// published at the tick that ends each period, within a period of being counted.
pub fn publish_due(last_ms: u64, now_ms: u64, tick_ms: u32) -> bool {
    let slack = u64::from(tick_ms.min(PUBLISH_PERIOD_MS) / 2);
    now_ms.saturating_add(slack) >= last_ms.saturating_add(u64::from(PUBLISH_PERIOD_MS))
}

/// The counters every rule has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Requests the rule admitted (and that were admitted overall).
    Allowed,
    /// Requests the rule refused.
    Limited,
    /// Requests let through because the store or the service could not decide.
    FailedOpen,
    /// Requests refused because the store or the service could not decide.
    FailedClosed,
    /// CAS conflicts met.
    StoreRetries,
    /// Live keys forgotten to make room for new ones.
    SlotEvictions,
    /// Requests admitted after being held (`on_limit: delay`).
    Delayed,
    /// Requests a shadow rule would have refused.
    ShadowLimited,
    /// Calls to the rule's rate limit service that failed.
    GlobalErrors,
    /// Requests held by delay mode, or waiting in a shared rule's line, whose client went away
    /// before their turn.
    Abandoned,
    /// Units charged after responses (a rule charged by its responses: tokens, bytes).
    UsageCharged,
    /// Responses that never reported their usage and were charged the rule's default.
    UsageUnreported,
    /// Units of reservations given back because the response used less (`true_up`).
    UsageRefunded,
    /// Units responses used beyond their reservations, charged afterwards (`true_up`).
    UsageExceeded,
    /// Requests an elastic rule admitted above its base limit.
    ElasticAllowed,
    /// The `Retry-After` seconds the rule told the clients it refused, summed: divided by
    /// `limited`, how long a refused client is told to wait on average.
    RetryAfterSeconds,
    /// Keys an operator reset ([`crate::runtime::Runtime::reset`]).
    OperatorResets,
    /// Requests that carried no number for a limit read from the request: the default applied.
    LimitDefaulted,
    /// Requests whose number for a limit read from the request was not a whole number from 1:
    /// the default applied.
    LimitInvalid,
    /// Requests whose number for a limit read from the request was above its cap: the cap
    /// applied.
    LimitCapped,
    /// Requests the rule matched that lacked a part of its key (what `on_missing_key` then did:
    /// skipped the rule, keyed them as one, or refused them).
    KeyMissing,
    /// Requests naming a model the rule has no price for, refused (`price.default: "refuse"`).
    ModelUnpriced,
    /// Claims of quota a lease rule sent to its service (by requests, and ahead of need).
    LeaseClaims,
    /// Quota a lease rule's service granted, in the rule's units.
    LeaseGranted,
    /// Claims a lease rule's service refused.
    LeaseRefused,
    /// Quota a lease rule held and never used: it lapsed when the service's window turned.
    LeaseLapsed,
    /// Units of usage a global rule reported to its service after the answers (charged by
    /// its responses).
    UsageReported,
    /// Units (hits, or usage) a global rule could not report to its service (the call failed,
    /// or too many keys waited): the service never counted them.
    ReportsLost,
    /// Requests a shared rule refused because their tenant had its share while the capacity
    /// was contended (also in `limited`).
    ShareRefused,
    /// Requests a shared rule refused because their band had its budget (higher bands used the
    /// rest; also in `limited`).
    BandRefused,
    /// Provider refusals (429s from the upstream) that reached clients through a shared rule
    /// that learns from the provider (`share.learn`): what the shared capacity exists to
    /// prevent.
    ProviderLimited,
    /// Units a shared rule counted because the provider said less remained than the capacity
    /// did (`share.learn`).
    ProviderSynced,
    /// Provider answers whose limit fields were malformed (ignored whole, `share.learn`).
    ProviderFieldsInvalid,
    /// Requests a shared rule refused that waited in its line for their turn
    /// (`share.max_wait_ms`).
    ShareQueued,
    /// Requests refused at once because the shared rule's line (or their tenant's part of it)
    /// was full.
    ShareQueueFull,
    /// Requests that waited in a shared rule's line until their wait ended, then were decided
    /// a last time (refused, unless room came just then).
    ShareQueueTimeouts,
    /// Milliseconds waited in a shared rule's line by the requests a turn admitted, summed.
    ShareWaitedMs,
}

impl Counter {
    /// Every counter, in the order of the accumulators.
    pub const ALL: [Counter; 37] = [
        Counter::Allowed,
        Counter::Limited,
        Counter::FailedOpen,
        Counter::FailedClosed,
        Counter::StoreRetries,
        Counter::SlotEvictions,
        Counter::Delayed,
        Counter::ShadowLimited,
        Counter::GlobalErrors,
        Counter::Abandoned,
        Counter::UsageCharged,
        Counter::UsageUnreported,
        Counter::UsageRefunded,
        Counter::UsageExceeded,
        Counter::ElasticAllowed,
        Counter::RetryAfterSeconds,
        Counter::OperatorResets,
        Counter::LimitDefaulted,
        Counter::LimitInvalid,
        Counter::LimitCapped,
        Counter::KeyMissing,
        Counter::ModelUnpriced,
        Counter::LeaseClaims,
        Counter::LeaseGranted,
        Counter::LeaseRefused,
        Counter::LeaseLapsed,
        Counter::UsageReported,
        Counter::ReportsLost,
        Counter::ShareRefused,
        Counter::BandRefused,
        Counter::ProviderLimited,
        Counter::ProviderSynced,
        Counter::ProviderFieldsInvalid,
        Counter::ShareQueued,
        Counter::ShareQueueFull,
        Counter::ShareQueueTimeouts,
        Counter::ShareWaitedMs,
    ];

    /// The name in the metric names.
    pub fn name(self) -> &'static str {
        match self {
            Counter::Allowed => "allowed",
            Counter::Limited => "limited",
            Counter::FailedOpen => "failed_open",
            Counter::FailedClosed => "failed_closed",
            Counter::StoreRetries => "store_retries",
            Counter::SlotEvictions => "slot_evictions",
            Counter::Delayed => "delayed",
            Counter::ShadowLimited => "shadow_limited",
            Counter::GlobalErrors => "global_errors",
            Counter::Abandoned => "abandoned",
            Counter::UsageCharged => "usage_charged",
            Counter::UsageUnreported => "usage_unreported",
            Counter::UsageRefunded => "usage_refunded",
            Counter::UsageExceeded => "usage_exceeded",
            Counter::ElasticAllowed => "elastic_allowed",
            Counter::RetryAfterSeconds => "retry_after_seconds",
            Counter::OperatorResets => "operator_resets",
            Counter::LimitDefaulted => "limit_defaulted",
            Counter::LimitInvalid => "limit_invalid",
            Counter::LimitCapped => "limit_capped",
            Counter::KeyMissing => "key_missing",
            Counter::ModelUnpriced => "model_unpriced",
            Counter::LeaseClaims => "lease_claims",
            Counter::LeaseGranted => "lease_granted",
            Counter::LeaseRefused => "lease_refused",
            Counter::LeaseLapsed => "lease_lapsed",
            Counter::UsageReported => "usage_reported",
            Counter::ReportsLost => "reports_lost",
            Counter::ShareRefused => "share_refused",
            Counter::BandRefused => "band_refused",
            Counter::ProviderLimited => "provider_limited",
            Counter::ProviderSynced => "provider_synced",
            Counter::ProviderFieldsInvalid => "provider_fields_invalid",
            Counter::ShareQueued => "share_queued",
            Counter::ShareQueueFull => "share_queue_full",
            Counter::ShareQueueTimeouts => "share_queue_timeouts",
            Counter::ShareWaitedMs => "share_waited_ms",
        }
    }
}

/// The gauges of a plugin (all its rules together).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gauge {
    /// Entries of the table's buckets in use (keys tracked; an expired entry counts until it
    /// is reused): at most the table's capacity.
    TrackedKeys,
    /// Sliding-log slots in use (their own `capacity` slots, besides the buckets; an expired
    /// log counts until its slot is reused).
    TrackedLogs,
    /// Requests held by delay mode right now.
    DelayQueue,
    /// In-flight slots held right now (requests admitted by `in_flight` rules, not yet done).
    InFlight,
}

impl Gauge {
    /// Every gauge, in the order of the accumulators.
    pub const ALL: [Gauge; 4] = [
        Gauge::TrackedKeys,
        Gauge::TrackedLogs,
        Gauge::DelayQueue,
        Gauge::InFlight,
    ];

    /// The name in the metric names.
    pub fn name(self) -> &'static str {
        match self {
            Gauge::TrackedKeys => "tracked_keys",
            Gauge::TrackedLogs => "tracked_logs",
            Gauge::DelayQueue => "delay_queue",
            Gauge::InFlight => "in_flight",
        }
    }
}

/// The per-rule gauge of an elastic rule: its limit in force as a percentage of its base.
pub const ELASTIC_FACTOR: &str = "elastic_factor_percent";
/// The per-plugin gauge of the table's capacity, in keys (set, not moved).
pub const CAPACITY: &str = "capacity";
/// A shared rule's gauge: its capacity in force (learned from the provider, or configured), in
/// the rule's units per window.
pub const SHARE_CAPACITY: &str = "share_capacity";
/// Per shared rule and band, the gauges [`crate::runtime::BandGauges`] sets, by name.
pub const SHARE_BAND_GAUGES: [&str; 3] = [
    "share_active_weight",
    "share_used_permille",
    "share_level_permille",
];

/// The counters of each band of a shared rule that lets requests wait (`share.max_wait_ms`),
/// beside the rule's own (`share_queued`, `share_waited_ms`, `share_queue_timeouts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BandCounter {
    /// The band's requests that joined the rule's line.
    Queued,
    /// Milliseconds the band's requests admitted after waiting waited, summed.
    WaitedMs,
    /// The band's requests refused at the end of their wait.
    Timeouts,
}

impl BandCounter {
    /// Every band counter, in publishing order.
    pub const ALL: [BandCounter; 3] = [
        BandCounter::Queued,
        BandCounter::WaitedMs,
        BandCounter::Timeouts,
    ];

    /// The metric's name.
    pub fn name(self) -> &'static str {
        match self {
            BandCounter::Queued => "share_band_queued",
            BandCounter::WaitedMs => "share_band_waited_ms",
            BandCounter::Timeouts => "share_band_queue_timeouts",
        }
    }
}

/// A shared rule's per-band metric's full name: [`name`] with the band as a third tag,
/// `wasm_ratelimit.plugin=.=<plugin>;.;rule=.=<rule>;.;band=.=<band>;.;<metric>` (a `band`
/// stats tag makes it a label).
pub fn band_name(plugin: &str, rule: &str, band: &str, metric: &str) -> String {
    name(plugin, Some(rule), &format!("band=.={band};.;{metric}"))
}

/// A metric's full name, with the plugin and the rule as tags Envoy can extract:
/// `wasm_ratelimit.plugin=.=<plugin>;.;rule=.=<rule>;.;<counter>` for a rule's metric,
/// `wasm_ratelimit.plugin=.=<plugin>;.;<gauge>` for a plugin's. With the `stats_tags` of the
/// README in Envoy's bootstrap (Istio: `extraStatTags: [plugin, rule]`), Prometheus sees
/// `wasm_ratelimit_<counter>{plugin="…",rule="…"}`. The encoding is Istio's own; `;` and `=`
/// in a plugin name, and a trailing `.` (which Envoy drops from a tag value), would break it:
/// they become `_` (rule names cannot hold them).
pub fn name(plugin: &str, rule: Option<&str>, metric: &str) -> String {
    let mut plugin: String = plugin
        .chars()
        .map(|c| if c == ';' || c == '=' { '_' } else { c })
        .collect();
    if plugin.ends_with('.') {
        plugin.pop();
        plugin.push('_');
    }
    match rule {
        Some(rule) => format!("wasm_ratelimit.plugin=.={plugin};.;rule=.={rule};.;{metric}"),
        None => format!("wasm_ratelimit.plugin=.={plugin};.;{metric}"),
    }
}

/// Unpublished counts: per rule counters, and per plugin gauge movements.
#[derive(Debug)]
pub struct Metrics {
    counters: Box<[AtomicU64]>,
    /// Per rule, per band, per [`BandCounter::ALL`].
    band_counters: Box<[AtomicU64]>,
    gauges: [AtomicI64; Gauge::ALL.len()],
}

/// The band counters one rule has.
const PER_RULE_BANDS: usize = MAX_BANDS * BandCounter::ALL.len();

impl Metrics {
    /// Accumulators for `rules` rules.
    pub fn new(rules: usize) -> Metrics {
        Metrics {
            counters: (0..rules * Counter::ALL.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
            band_counters: (0..rules * PER_RULE_BANDS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            gauges: Default::default(),
        }
    }

    /// Adds `n` to a rule's counter.
    pub fn add(&self, rule: usize, counter: Counter, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(c) = self
            .counters
            .get(rule * Counter::ALL.len() + counter as usize)
        {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Adds `n` to a shared rule's band's counter.
    pub fn add_band(&self, rule: usize, band: u8, counter: BandCounter, n: u64) {
        let band = usize::from(band);
        if n == 0 || band >= MAX_BANDS {
            return;
        }
        let i = rule * PER_RULE_BANDS + band * BandCounter::ALL.len() + counter as usize;
        if let Some(c) = self.band_counters.get(i) {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Takes every unpublished band count: `counter(rule, band, counter, n)` for each non-zero
    /// one.
    pub fn drain_bands(&self, mut counter: impl FnMut(usize, u8, BandCounter, u64)) {
        for (i, c) in self.band_counters.iter().enumerate() {
            let n = c.swap(0, Ordering::Relaxed);
            if n == 0 {
                continue;
            }
            let (rule, within) = (i / PER_RULE_BANDS, i % PER_RULE_BANDS);
            let band = u8::try_from(within / BandCounter::ALL.len()).unwrap_or(u8::MAX);
            if let Some(&which) = BandCounter::ALL.get(within % BandCounter::ALL.len()) {
                counter(rule, band, which, n);
            }
        }
    }

    /// Moves a gauge by `delta`.
    pub fn gauge(&self, gauge: Gauge, delta: i64) {
        if let Some(g) = self.gauges.get(gauge as usize) {
            g.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Takes every unpublished count: `counter(rule, counter, n)` for each non-zero counter,
    /// `gauge(gauge, delta)` for each gauge that moved.
    pub fn drain(
        &self,
        mut counter: impl FnMut(usize, Counter, u64),
        mut gauge: impl FnMut(Gauge, i64),
    ) {
        for (i, c) in self.counters.iter().enumerate() {
            let n = c.swap(0, Ordering::Relaxed);
            let which = Counter::ALL.get(i % Counter::ALL.len());
            if let (true, Some(&which)) = (n > 0, which) {
                counter(i / Counter::ALL.len(), which, n);
            }
        }
        for (g, which) in self.gauges.iter().zip(Gauge::ALL) {
            let delta = g.swap(0, Ordering::Relaxed);
            if delta != 0 {
                gauge(which, delta);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn band_counters_are_kept_apart_and_drained_once() {
        let m = Metrics::new(2);
        m.add_band(1, 2, BandCounter::WaitedMs, 30);
        m.add_band(1, 2, BandCounter::WaitedMs, 12);
        m.add_band(0, 0, BandCounter::Queued, 1);
        m.add_band(1, 3, BandCounter::Timeouts, 1);
        m.add_band(1, 4, BandCounter::Timeouts, 1); // no such band: dropped
        let mut seen = Vec::new();
        m.drain_bands(|r, b, c, n| seen.push((r, b, c, n)));
        assert_eq!(
            seen,
            [
                (0, 0, BandCounter::Queued, 1),
                (1, 2, BandCounter::WaitedMs, 42),
                (1, 3, BandCounter::Timeouts, 1)
            ]
        );
        m.drain_bands(|_, _, _, _| panic!("drained already"));
    }

    #[test]
    fn a_tick_a_little_early_still_publishes() {
        // Ticks of a second, published at 10,000: the next tick is due whether it comes a
        // hair early or late; one half a period early is not.
        assert!(publish_due(10_000, 10_999, 1000));
        assert!(publish_due(10_000, 11_001, 1000));
        assert!(!publish_due(10_000, 10_400, 1000));
        // Ticks of 100 ms (async global rules): the tick that ends the period publishes, not
        // the one before it.
        assert!(!publish_due(10_000, 10_940, 100));
        assert!(publish_due(10_000, 10_999, 100));
        // Ticks of 1 ms (requests held): no slack to speak of.
        assert!(!publish_due(10_000, 10_999, 1));
        assert!(publish_due(10_000, 11_000, 1));
        // Never published: due at once.
        assert!(publish_due(0, 10_000, 1000));
    }

    #[test]
    fn drain_takes_what_was_added_once() {
        let m = Metrics::new(2);
        m.add(1, Counter::Limited, 3);
        m.add(1, Counter::Limited, 2);
        m.add(0, Counter::Abandoned, 1);
        m.add(5, Counter::Allowed, 1); // no such rule: ignored
        m.gauge(Gauge::DelayQueue, 2);
        m.gauge(Gauge::DelayQueue, -1);
        let mut seen = Vec::new();
        let mut gauges = Vec::new();
        m.drain(|r, c, n| seen.push((r, c, n)), |g, d| gauges.push((g, d)));
        assert_eq!(seen, [(0, Counter::Abandoned, 1), (1, Counter::Limited, 5)]);
        assert_eq!(gauges, [(Gauge::DelayQueue, 1)]);
        m.drain(
            |_, _, _| panic!("drained twice"),
            |_, _| panic!("drained twice"),
        );
        assert_eq!(
            name("demo", Some("per-client"), Counter::Allowed.name()),
            "wasm_ratelimit.plugin=.=demo;.;rule=.=per-client;.;allowed"
        );
        assert_eq!(
            name("istio-system.gw", None, Gauge::TrackedKeys.name()),
            "wasm_ratelimit.plugin=.=istio-system.gw;.;tracked_keys"
        );
        assert_eq!(
            name("a;b=c.", None, "x"),
            "wasm_ratelimit.plugin=.=a_b_c_;.;x"
        );
    }
}
