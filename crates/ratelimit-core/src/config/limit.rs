//! What a rule limits (`rate_limit`, `in_flight`): a quota per unit of time under an algorithm,
//! or requests in flight; the unit a quota counts and its [`Kind`] (as the LLM APIs name their
//! limits); the numbers a request carries in place of the configured ones (`{"from": …}`); the
//! defaults of `elastic`.
//!
//! Uses the configuration's [`Rule`](super::Rule) and, below the configuration, the limiter's
//! windows.

use super::Rule;
use crate::limiter::Windows;
use std::fmt;

/// What a rule limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// A quota per unit of time, enforced by an algorithm (`rate_limit`).
    Rate {
        /// How much per unit of time one key may use.
        quota: Quota,
        /// How the quota is enforced.
        algorithm: Algorithm,
    },
    /// Requests in flight at once (`in_flight`).
    InFlight {
        /// At most this many.
        max: u32,
        /// A slot never given back is freed between one and two leases after it was taken, ms.
        lease_ms: u32,
    },
}

impl Limit {
    /// The algorithm's name (part of the rule's identity across reloads).
    pub fn algorithm_name(&self) -> &'static str {
        match self {
            Limit::Rate { algorithm, .. } => algorithm.name(),
            Limit::InFlight { .. } => "in_flight",
        }
    }

    /// [`Limit::capacity`] with the numbers read from requests at their caps.
    pub fn capacity_with(&self, per_request: &PerRequest) -> u32 {
        let cap = |f: &Option<FromRequest>| f.as_ref().map(|f| f.max);
        match self {
            Limit::Rate {
                algorithm: Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. },
                ..
            } => match (&per_request.burst, per_request.burst_is_limit) {
                (Some(b), _) => Some(b.max),
                (None, true) => cap(&per_request.limit),
                (None, false) => None,
            }
            .unwrap_or(self.capacity()),
            _ => cap(&per_request.limit).unwrap_or(self.capacity()),
        }
    }

    /// The most one request can ever be admitted for: a fixed cost or a reserve above it can
    /// never pass.
    pub fn capacity(&self) -> u32 {
        match *self {
            Limit::Rate {
                algorithm: Algorithm::TokenBucket { burst } | Algorithm::LeakyBucket { burst, .. },
                ..
            } => burst,
            Limit::Rate { quota, .. } => quota.requests_per_unit,
            Limit::InFlight { max, .. } => max,
        }
    }
}

/// A limit: `requests_per_unit` requests per `unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// Requests allowed per window (≥ 1).
    pub requests_per_unit: u32,
    /// The window.
    pub unit: Unit,
    /// The UTC offset of a fixed window's days, weeks and months, minutes (`+02:00` is 120):
    /// they begin at that offset's midnight. 0 for every other algorithm.
    pub utc_offset_min: i32,
}

impl Quota {
    /// The window length in milliseconds; for a month, the longest (31 days): a month's
    /// windows are the calendar's ([`Quota::windows`]).
    pub fn window_ms(&self) -> u64 {
        self.unit.seconds() * 1000
    }

    /// The windows of a fixed window over this quota: the unit's length aligned to the epoch
    /// (seconds to hours), to midnight at the offset (days), to Monday's midnight (weeks), or
    /// calendar months.
    pub fn windows(&self) -> Windows {
        match self.unit {
            Unit::Month => Windows::Months {
                offset_min: self.utc_offset_min,
            },
            _ => Windows::aligned(self.window_ms(), self.utc_offset_min),
        }
    }
}

/// The time unit of a quota, as in envoyproxy/ratelimit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// One second.
    Second,
    /// 60 seconds.
    Minute,
    /// 3600 seconds.
    Hour,
    /// 86400 seconds.
    Day,
    /// 7 days; a fixed window's weeks begin on Monday.
    Week,
    /// A calendar month, 28 to 31 days: fixed windows only.
    Month,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 6] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
    ];

    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
        }
    }

    /// The unit's length in seconds; for a month, the longest (31 days).
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 31 * 86_400,
        }
    }
}

/// The algorithm of a rule, with its own parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Sliding window counter (the default).
    SlidingWindow,
    /// Fixed window counter.
    FixedWindow,
    /// Token bucket of `burst` tokens refilled at the quota's rate.
    TokenBucket {
        /// Bucket size.
        burst: u32,
    },
    /// Leaky bucket of capacity `burst` draining at the quota's rate.
    LeakyBucket {
        /// Bucket capacity.
        burst: u32,
        /// `Some(max)`: hold requests until their turn, at most `max` ms (`on_limit: delay`).
        max_delay_ms: Option<u32>,
    },
    /// Exact sliding window log.
    SlidingLog,
}

impl Algorithm {
    /// The name used in the configuration.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::TokenBucket { .. } => "token_bucket",
            Algorithm::LeakyBucket { .. } => "leaky_bucket",
            Algorithm::SlidingLog => "sliding_log",
        }
    }
}

/// The longest `max_delay_ms` accepted.
pub const MAX_DELAY_MS: u64 = 60_000;

/// The quota unit of a rule charged by its responses' body bytes (the draft's registry).
pub const CONTENT_BYTES: &str = "content-bytes";

/// The quota unit of an `in_flight` rule (the draft's registry).
pub const CONCURRENT_REQUESTS: &str = "concurrent-requests";

/// The quota unit of a rule charged by a response header, unless configured otherwise.
pub const DEFAULT_USAGE_UNIT: &str = "tokens";

/// The default quota unit of a rule charged in money (`price`): micro-dollars, prices being
/// micro-dollars per `per` tokens.
pub const DEFAULT_MONEY_UNIT: &str = "usd-micros";

/// What a rule's quota counts, as the LLM APIs name their limits: the kind of fields a dialect
/// answers with, and of the limit a provider states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Requests.
    Requests,
    /// Tokens, input and output together.
    Tokens,
    /// Input tokens.
    InputTokens,
    /// Output tokens.
    OutputTokens,
}

impl Kind {
    /// The kind of a rule's quota, by its quota unit.
    pub fn of(rule: &Rule) -> Option<Kind> {
        Kind::of_unit(rule.quota_unit.as_deref())
    }

    /// The kind of a quota counting `unit` (`None`: requests): requests (no unit, or
    /// `requests`), `tokens`, `input-tokens`, `output-tokens`; `None` for any other unit.
    pub fn of_unit(unit: Option<&str>) -> Option<Kind> {
        match unit {
            None | Some("requests") => Some(Kind::Requests),
            Some("tokens") => Some(Kind::Tokens),
            Some("input-tokens") => Some(Kind::InputTokens),
            Some("output-tokens") => Some(Kind::OutputTokens),
            Some(_) => None,
        }
    }

    /// Whether the quota counts tokens (of any kind).
    pub fn counts_tokens(self) -> bool {
        !matches!(self, Kind::Requests)
    }
}

/// The default lease of an in-flight slot, s.
pub const DEFAULT_LEASE_S: u64 = 300;

/// The numbers of a rule's limit that each request carries (`{"from": …}` in place of a
/// number): a customer's plan, set by the authentication step in front of the filter. The
/// configured numbers in [`Limit`] are then the defaults, for a request that carries none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PerRequest {
    /// `rate_limit.requests_per_unit`, or `in_flight.max`.
    pub limit: Option<FromRequest>,
    /// A bucket's `burst`.
    pub burst: Option<FromRequest>,
    /// A bucket whose `burst` is not configured: its burst is the limit in force.
    pub burst_is_limit: bool,
}

impl PerRequest {
    /// Whether any number is read from the request.
    pub fn any(&self) -> bool {
        self.limit.is_some() || self.burst.is_some()
    }
}

/// One number of a limit read from the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FromRequest {
    /// Where the number is.
    pub source: Source,
    /// What a request that carries none, or a value that is not a whole number from 1, gets.
    pub default: u32,
    /// The most a request may get: a larger value is cut to it.
    pub max: u32,
}

/// Where a number of a request's limit is read: attributes a trusted filter before this one set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A request header (lower-case name).
    Header(String),
    /// A key of Envoy's dynamic metadata under a filter's namespace (a number, or a string of
    /// digits).
    Metadata {
        /// The namespace, e.g. `envoy.filters.http.ext_authz`.
        namespace: String,
        /// The key within it (not a path: the value is the key's own).
        key: String,
    },
    /// A filter state object, as a string of digits.
    FilterState(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Header(name) => write!(f, "header:{name}"),
            Source::Metadata { namespace, key } => write!(f, "metadata:{namespace}:{key}"),
            Source::FilterState(key) => write!(f, "filter_state:{key}"),
        }
    }
}

/// What became of a number read from a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// The request's own value.
    Taken(u32),
    /// The request carried none: the default.
    Missing(u32),
    /// Not a whole number from 1 to 4294967295: the default.
    Invalid(u32),
    /// Above the cap: the cap.
    Capped(u32),
}

impl Resolved {
    /// The number in force.
    pub fn value(self) -> u32 {
        match self {
            Resolved::Taken(n)
            | Resolved::Missing(n)
            | Resolved::Invalid(n)
            | Resolved::Capped(n) => n,
        }
    }
}

/// A value a number of a request's limit was read as.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Carried<'a> {
    /// Text (a header, a filter state object, a metadata string).
    Text(&'a [u8]),
    /// A number (a metadata number).
    Number(f64),
}

impl FromRequest {
    /// The number in force for a request that carried `value`.
    pub fn resolve(&self, value: Option<Carried<'_>>) -> Resolved {
        let n: Option<u64> = match value {
            None => return Resolved::Missing(self.default),
            Some(Carried::Text(t)) => {
                let t = std::str::from_utf8(t).map_or("", str::trim);
                // Only digits: then a parse can only fail by being too large for any cap.
                (!t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| t.parse::<u64>().unwrap_or(u64::MAX))
            }
            // `as` saturates: a huge number stays above any cap.
            Some(Carried::Number(x)) => {
                (x.is_finite() && x.fract() == 0.0 && x >= 0.0).then_some(x as u64)
            }
        };
        match n.map(u32::try_from) {
            Some(Ok(0)) | None => Resolved::Invalid(self.default),
            Some(Ok(n)) if n <= self.max => Resolved::Taken(n),
            Some(_) => Resolved::Capped(self.max),
        }
    }
}

/// Default `elastic.max_bad_share`, permille.
pub const DEFAULT_MAX_BAD: u32 = 100;

/// Default `elastic.window_s`.
pub const DEFAULT_HEALTH_WINDOW_S: u64 = 10;

/// Default `elastic.ramp_s`.
pub const DEFAULT_RAMP_S: u64 = 30;
