//! Plugin configuration: the typed rules a request is decided by. [`Config::parse`] (in
//! [`parse`]) builds them from the plugin's JSON, validated once at configure time.
//!
//! This file holds the configuration and a rule as a whole, the operator route and the
//! answers' look (`response`). Each section of a rule has its types in a file of its own,
//! re-exported here and read by the file of the same name under `parse/`: `matching` (`match`,
//! `key`), `limit` (`rate_limit`, `in_flight`, the algorithm, the quota's unit), `global`,
//! `cost`, `price` (`cost.response.price`) and `share`; [`body`] holds the usage expressions
//! and presets. The configuration uses only the modules on the floors below its own
//! (`crates/ratelimit-core/floors.py`).

pub mod body;
mod cost;
mod global;
mod limit;
mod matching;
mod parse;
mod price;
mod share;

pub use cost::{parse_cost, parse_usage, BodyUsage, Charge, Cost, Input, Sized, Term, Usage};
pub use global::{Global, GlobalMode, DEFAULT_FLUSH_MS, DEFAULT_GLOBAL_TIMEOUT_MS};
pub use limit::{
    Algorithm, Carried, FromRequest, Kind, Limit, PerRequest, Quota, Resolved, Source, Unit,
    CONCURRENT_REQUESTS, CONTENT_BYTES, DEFAULT_HEALTH_WINDOW_S, DEFAULT_LEASE_S, DEFAULT_MAX_BAD,
    DEFAULT_MONEY_UNIT, DEFAULT_RAMP_S, DEFAULT_USAGE_UNIT, MAX_DELAY_MS,
};
pub use matching::{
    BodyCondition, BodyField, BodyMatch, HeaderCondition, HeaderMatch, KeyPart, Match, MissingKey,
    Prefixes, DEFAULT_PREFIXES,
};
pub use price::{ModelFrom, ModelPrice, Price, Priced, Rates, Tokens};
pub use share::{ShareConfig, DEFAULT_ACTIVE_S, DEFAULT_SATURATION, DEFAULT_TARGET};

use crate::elastic;
use crate::limiter::{gcra, Policy};
use std::fmt;

/// The default number of client keys tracked at once: about 1.4 MiB of Envoy memory when the
/// table is full in the wasm build (88 bytes per key of capacity at the peak of a 200,000-key
/// flood, Envoy's own buffers included), about 0.6 MiB allocated up front in the native one
/// (151-byte buckets with their lock and CAS: 41 bytes per key). See the book's
/// performance/evidence.md.
pub const DEFAULT_CAPACITY: u32 = 16_384;
/// The largest `capacity` accepted: about 80 to 90 MiB of Envoy memory if every slot fills
/// (wasm), 40 MiB up front (native).
pub const MAX_CAPACITY: u32 = 1 << 20;
/// The longest rule name accepted.
pub const MAX_NAME_LEN: usize = 64;

/// A validated plugin configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Rules in configuration order; every matching rule is applied to a request.
    pub rules: Vec<Rule>,
    /// How limited and allowed responses look.
    pub response: ResponseConfig,
    /// What to do when the store cannot decide.
    pub failure_mode: FailureMode,
    /// How many client keys are tracked at once.
    pub capacity: u32,
    /// The level of the line logged for each limited request.
    pub log_limited: LogLevel,
    /// The seed of every client-key hash, if configured (else each Envoy draws its own): the
    /// same seed on every replica logs the same key for a client, and lets
    /// `ratelimit-config explain` print it.
    pub key_seed: Option<crate::seed::Seed>,
    /// Every field a rule reads from response bodies ([`Usage::Body`]), one slot per term.
    pub usage_paths: crate::usage::Paths,
    /// Every field a rule reads from request bodies ([`Sized`], [`BodyField`]), one slot per
    /// rule's fields.
    pub request_paths: crate::usage::Paths,
    /// How many request body bytes are read for the fields of `body:` key parts and
    /// `match.body` (`max_body`).
    pub max_body: u32,
    /// Whether the body fields that rules read are handed to the access log
    /// (`log_body_fields`, default true): [`crate::runtime::Host::body_field_read`].
    pub log_body_fields: bool,
    /// The wasm build's operator route, if configured (`None`, the default: no route at all).
    /// The native build ignores it: its admin port serves the same calls.
    pub operator: Option<OperatorRoute>,
}

/// Where the wasm build answers an operator's calls in the data path, and who may make them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperatorRoute {
    /// Paths under this prefix are the route's (starts and ends with `/`).
    pub path_prefix: String,
    /// The networks a call may come from (`source.address`), at least one.
    pub allow_from: Vec<Cidr>,
    /// The secret a call carries in `x-ratelimit-operator-token`.
    pub token: Secret,
}

/// An IP network, `address/prefix` with no host bits set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    /// The network's address.
    pub address: std::net::IpAddr,
    /// How many leading bits name the network.
    pub prefix: u8,
}

impl Cidr {
    /// Reads `a.b.c.d/n` or `ipv6/n`; the reason it is not one otherwise.
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let Some((address, prefix)) = text.split_once('/') else {
            return Err(format!("{text:?} is not a network (expected address/prefix, such as 10.0.0.0/8 or ::1/128)"));
        };
        let address: std::net::IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?} is not a network: {address:?} is not an IP address"))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= max && !prefix.starts_with('+'))
            .ok_or_else(|| format!("{text:?} is not a network: the prefix must be 0 to {max}"))?;
        let cidr = Cidr { address, prefix };
        if cidr.masked() != address {
            return Err(format!(
                "{text:?} has host bits set (did you mean {}/{prefix}?)",
                cidr.masked()
            ));
        }
        Ok(cidr)
    }

    /// The address with the host bits cleared.
    fn masked(&self) -> std::net::IpAddr {
        use std::net::IpAddr;
        match self.address {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        }
    }

    /// Whether `ip` is in the network. An IPv4 client seen on an IPv6 socket
    /// (`::ffff:a.b.c.d`) is an IPv4 client.
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        ip.is_ipv4() == self.address.is_ipv4()
            && Cidr {
                address: ip,
                prefix: self.prefix,
            }
            .masked()
                == self.address
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

/// A secret that never shows in a log or a debug print.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The fewest characters a secret has.
    pub const MIN_LEN: usize = 32;

    /// A secret from its text: at least [`Secret::MIN_LEN`] visible ASCII characters (what an
    /// HTTP header carries unchanged).
    pub fn new(text: &str) -> Option<Secret> {
        (text.len() >= Secret::MIN_LEN && text.bytes().all(|b| b.is_ascii_graphic()))
            .then(|| Secret(text.to_string()))
    }

    /// Whether `given` is the secret, in a time that depends only on the secret's length (not
    /// on where the first difference is).
    pub fn matches(&self, given: &[u8]) -> bool {
        let secret = self.0.as_bytes();
        let mut diff = u8::from(given.len() != secret.len());
        for (i, s) in secret.iter().enumerate() {
            diff |= given.get(i).copied().unwrap_or(0) ^ s;
        }
        std::hint::black_box(diff) == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// A log level for the filter's own lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    /// Not logged.
    Off,
    /// Envoy's `debug`.
    Debug,
    /// Envoy's `info`.
    Info,
    /// Envoy's `warning`.
    Warn,
}

impl LogLevel {
    /// The level lines are written at (`None`: not written).
    pub fn level(self) -> Option<log::Level> {
        match self {
            LogLevel::Off => None,
            LogLevel::Debug => Some(log::Level::Debug),
            LogLevel::Info => Some(log::Level::Info),
            LogLevel::Warn => Some(log::Level::Warn),
        }
    }
}

/// One rate limit rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Unique name, `[A-Za-z0-9_.-]{1,64}`; used in headers, metrics and logs.
    pub name: String,
    /// Which requests the rule applies to.
    pub matcher: Match,
    /// The parts joined into the client key; empty means one counter for the whole rule.
    pub key: Vec<KeyPart>,
    /// What the rule limits, and how.
    pub limit: Limit,
    /// What one request costs.
    pub cost: Cost,
    /// What the quota counts, as the `qu` of `RateLimit-Policy`; `None` for requests.
    pub quota_unit: Option<String>,
    /// Count and report, but never refuse (a soft rollout).
    pub shadow: bool,
    /// A rate limit service shared by many Envoys, if the rule is global.
    pub global: Option<Global>,
    /// Let the limit follow the backend's health, if set.
    pub elastic: Option<elastic::Params>,
    /// The limit's numbers read from each request (a customer's plan), where configured.
    pub per_request: PerRequest,
    /// What a request the rule matches but whose key it lacks gets (`on_missing_key`).
    pub on_missing_key: MissingKey,
    /// The limit is one capacity shared among the rule's keys (`share`), if set.
    pub share: Option<ShareConfig>,
}

/// How many request body bytes a sized reservation holds by default while looking for its
/// fields.
pub const DEFAULT_BODY_HELD: u32 = 16 * 1024;
/// The most `max_body` may be (Envoy's default per-connection buffer limit is 1 MiB).
pub const MAX_BODY_HELD: u32 = 512 * 1024;

impl Config {
    /// The slot of the request body field at `path` (keys joined by `.`), if a rule reads it.
    pub fn body_slot(&self, path: &str) -> Option<usize> {
        let mut found = None;
        for rule in &self.rules {
            let mut each = |f: &BodyField| {
                if found.is_none() && f.path.join(".") == path {
                    found = Some(f.slot);
                }
            };
            rule.matcher.body.iter().for_each(|m| each(&m.field));
            rule.key.iter().for_each(|k| k.each_body_field(&mut each));
        }
        found
    }
}

impl Rule {
    /// Whether the rule reads fields of the request's body (a `body:` key part, or
    /// `match.body`): it is decided once they are read.
    pub fn reads_body_fields(&self) -> bool {
        !self.matcher.body.is_empty()
            || self.key.iter().any(KeyPart::reads_body)
            || self.price_field().is_some()
    }

    /// The request body field naming a priced rule's model (`price.model: "body:…"`).
    pub fn price_field(&self) -> Option<&BodyField> {
        match &self.charge()?.usage {
            Usage::Price(p) => match &p.model {
                ModelFrom::Body(f) => Some(f),
                ModelFrom::Answer(_) => None,
            },
            _ => None,
        }
    }

    /// The price table of a rule charged in money.
    pub fn price(&self) -> Option<&Price> {
        match &self.charge()?.usage {
            Usage::Price(p) => Some(p),
            _ => None,
        }
    }

    /// Whether a missing key part counts as one shared value (`on_missing_key: shared`).
    pub fn shares_missing_key(&self) -> bool {
        self.on_missing_key == MissingKey::Shared
    }

    /// A lease rule's lease: what this proxy holds of the service's limit (for a shared
    /// capacity, the capacity's; its tenants share it with the rule's local algorithm,
    /// [`Rule::policy`]). `None` for the other rules.
    pub fn lease_policy(&self) -> Option<Policy> {
        let g = self
            .global
            .as_ref()
            .filter(|g| g.mode == GlobalMode::Lease)?;
        match self.limit {
            Limit::Rate { quota, .. } => Some(Policy::Lease {
                limit: u64::from(quota.requests_per_unit),
                windows: quota.windows(),
                max_block: g.max_block,
                kept: 0,
            }),
            Limit::InFlight { .. } => None,
        }
    }

    /// The algorithm and its numbers, as the limiter needs them.
    pub fn policy(&self) -> Policy {
        let (quota, algorithm) = match self.limit {
            Limit::Rate { quota, algorithm } => (quota, algorithm),
            Limit::InFlight { max, lease_ms } => {
                return Policy::InFlight {
                    max: u64::from(max),
                    lease_ms: u64::from(lease_ms),
                }
            }
        };
        let limit = u64::from(quota.requests_per_unit);
        let window_ms = quota.window_ms();
        if let (Some(lease), None) = (self.lease_policy(), &self.share) {
            return lease;
        }
        match algorithm {
            Algorithm::SlidingWindow => Policy::SlidingWindow { limit, window_ms },
            Algorithm::FixedWindow => Policy::FixedWindow {
                limit,
                windows: quota.windows(),
            },
            Algorithm::SlidingLog => Policy::SlidingLog { limit, window_ms },
            Algorithm::TokenBucket { burst } => Policy::Gcra(gcra::Params {
                limit,
                window_ms,
                burst: u64::from(burst),
                max_delay_ms: None,
            }),
            Algorithm::LeakyBucket {
                burst,
                max_delay_ms,
            } => Policy::Gcra(gcra::Params {
                limit,
                window_ms,
                burst: u64::from(burst),
                max_delay_ms: max_delay_ms.map(u64::from),
            }),
        }
    }

    /// The charge taken from the response, if the rule's cost comes from it.
    pub fn charge(&self) -> Option<&Charge> {
        match &self.cost {
            Cost::Response(c) => Some(c),
            _ => None,
        }
    }
}

/// How limited (and optionally allowed) responses are decorated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseConfig {
    /// Status of the local reply for a limited request (400–599).
    pub status: u16,
    /// Which rate-limit header fields to send.
    pub headers: HeaderStyle,
    /// Whether allowed responses carry the headers too.
    pub on_allowed: bool,
    /// Whose API the answers speak: the limited reply's body and the fields added beside
    /// [`ResponseConfig::headers`].
    pub dialect: Dialect,
}

impl Default for ResponseConfig {
    fn default() -> Self {
        ResponseConfig {
            status: 429,
            headers: HeaderStyle::Both,
            on_allowed: true,
            dialect: Dialect::Default,
        }
    }
}

/// Which rate-limit header fields to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    Ietf,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset` (and `-Retry-After` when limited).
    XRateLimit,
    /// Both of the above.
    Both,
    /// None (a limited reply still carries `Retry-After`).
    None,
}

impl HeaderStyle {
    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            HeaderStyle::Ietf => "ietf",
            HeaderStyle::XRateLimit => "x-ratelimit",
            HeaderStyle::Both => "both",
            HeaderStyle::None => "none",
        }
    }

    /// Whether the IETF fields are sent.
    pub fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
    /// Whether the X-RateLimit fields are sent.
    pub fn x_ratelimit(self) -> bool {
        matches!(self, HeaderStyle::XRateLimit | HeaderStyle::Both)
    }
}

/// Whose API the answers speak, so that its official SDKs read them: the limited reply's body,
/// and the rate-limit fields added beside those of [`HeaderStyle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// An `application/problem+json` body (the IETF draft's `quota-exceeded`), no other fields.
    Default,
    /// OpenAI's error body and its `x-ratelimit-*-requests|tokens` fields, `retry-after-ms`.
    OpenAi,
    /// Anthropic's error body and its `anthropic-ratelimit-*` fields.
    Anthropic,
}

impl Dialect {
    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Default => "default",
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
        }
    }
}

/// What to do when the store cannot decide (CAS retries exhausted, shared data failing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureMode {
    /// Let the request through (fail open).
    Allow,
    /// Reject the request with the configured status (fail closed).
    Deny,
}

/// One configuration error: the field it is about and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The field path, e.g. `rules[0].rate_limit.unit`; `config` for the document as a whole.
    pub path: String,
    /// What is wrong, in words a user can act on.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// Every error found in one configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
