//! Plugin configuration: the typed rules a request is decided by. [`Config::parse`] (in
//! [`parse`]) builds them from the plugin's JSON, validated once at configure time.

pub mod body;
mod parse;

use crate::elastic;
use crate::limiter::{gcra, Policy, Windows};
use std::fmt;

/// The default number of client keys tracked at once: about 1.2 MiB of Envoy memory when the
/// table is full (70-80 bytes per key measured in the wasm build, Envoy's own overhead included). See the README.
pub const DEFAULT_CAPACITY: u32 = 16_384;
/// The largest `capacity` accepted: about 80 MiB of Envoy memory if every slot fills (wasm).
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

/// A rule's limit shared among its keys, the tenants (`share`): see [`crate::share`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareConfig {
    /// A tenant's weight when the request carries none (or `weight` is a number).
    pub weight: u16,
    /// Where each request's weight is read, if it is.
    pub weight_from: Option<FromRequest>,
    /// The bands' names, highest priority first.
    pub bands: Vec<String>,
    /// Where each request's band name is read (two bands or more).
    pub band_from: Option<Source>,
    /// The band of a request whose band is missing or names none (an index into `bands`).
    pub band_default: u8,
    /// How the capacity is shared.
    pub params: crate::share::Share,
    /// Whose answers hold the capacity to the provider's own (`share.learn`).
    pub learn: Option<crate::share::learn::Learn>,
    /// How long a refused request may wait in line for its turn, ms (0: refused at once).
    pub max_wait_ms: u64,
    /// The most requests waiting in the line (per worker in the wasm build, per process in
    /// the native one).
    pub max_queued: usize,
    /// The most requests of one tenant waiting in the line.
    pub max_queued_per_tenant: usize,
}

impl ShareConfig {
    /// The band a carried value names: its index, or the default's.
    pub fn band_of(&self, value: Option<Carried<'_>>) -> u8 {
        let Some(Carried::Text(t)) = value else {
            return self.band_default;
        };
        let t = t.trim_ascii();
        self.bands
            .iter()
            .position(|b| b.as_bytes() == t)
            .and_then(|i| u8::try_from(i).ok())
            .unwrap_or(self.band_default)
    }
}

/// Default `share.active_s`.
pub const DEFAULT_ACTIVE_S: u64 = 10;
/// Default `share.saturation`, permille.
pub const DEFAULT_SATURATION: u64 = 800;
/// Default `share.target`, permille.
pub const DEFAULT_TARGET: u64 = 970;

/// What a rule does with a request it matches but that lacks a part of its key
/// (`on_missing_key`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissingKey {
    /// The rule does not apply to it (`skip`, the default).
    #[default]
    Skip,
    /// Every such request shares one key: the missing part counts as one value of its own
    /// (`shared`).
    Shared,
    /// It is refused with a 401 (`refuse`): the key cannot be left out to go around the rule.
    Refuse,
}

impl MissingKey {
    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            MissingKey::Skip => "skip",
            MissingKey::Shared => "shared",
            MissingKey::Refuse => "refuse",
        }
    }
}

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

/// A rule's global backend: Envoy's rate limit service protocol over a gRPC cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Global {
    /// The Envoy cluster of the service (HTTP/2).
    pub cluster: String,
    /// The rate limit domain sent to the service.
    pub domain: String,
    /// Ask before deciding, or decide locally and report afterwards.
    pub mode: GlobalMode,
    /// How long to wait for the service, ms.
    pub timeout_ms: u32,
    /// Async mode: how often each worker reports its hits, ms; lease mode: how often claims
    /// ahead of need go out; both, and a sync rule charged by its responses: how often usage
    /// is reported.
    pub flush_ms: u32,
    /// Lease mode: the largest block claimed at once (by default a tenth of the limit).
    pub max_block: u64,
}

/// How a global rule uses its service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalMode {
    /// Each request waits for the service's answer.
    Sync,
    /// Local-first: decided at once from this proxy's view, hits reported in batches.
    Async,
    /// Quota claimed from the service in blocks ahead of need, admitted locally from what is
    /// held: never over the service's limit, at local speed.
    Lease,
}

impl GlobalMode {
    /// The name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            GlobalMode::Sync => "sync",
            GlobalMode::Async => "async",
            GlobalMode::Lease => "lease",
        }
    }

    /// Whether the service decides the rule's limit (the local algorithm is not used).
    pub fn service_decides(self) -> bool {
        matches!(self, GlobalMode::Sync | GlobalMode::Lease)
    }
}

/// Default wait for a rate limit service, ms.
pub const DEFAULT_GLOBAL_TIMEOUT_MS: u64 = 20;
/// Default async flush interval, ms.
pub const DEFAULT_FLUSH_MS: u64 = 100;

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

/// What a request costs under a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cost {
    /// Always this much.
    Fixed(u32),
    /// The value of this request header (lower-case name), set by a trusted upstream filter; a
    /// missing or invalid value costs 1.
    Header(String),
    /// What the response says it used, charged once it is known: the request is admitted
    /// while the key's usage leaves room for `reserve` (at least 1).
    Response(Charge),
}

/// A cost known only from the response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// Where the usage comes from.
    pub usage: Usage,
    /// The reservation: room a key must have left to be admitted (at least 1 is always
    /// required); with [`Charge::sized`], what a request whose body names no maximum reserves.
    pub reserve: u32,
    /// The reservation sized from the request's body, if configured.
    pub sized: Option<Sized>,
    /// What a response that never reports its usage is charged (`None`: the reservation).
    pub default: Option<u32>,
    /// Whether the reservation is counted at admission and trued up once the usage is known
    /// (refunding what was not used, charging the excess); otherwise admission only checks
    /// that it fits and the usage is charged afterwards.
    pub true_up: bool,
}

impl Charge {
    /// What admission asks of the key's quota when the request's body does not size it.
    pub fn admission(&self) -> u64 {
        u64::from(self.reserve.max(1))
    }

    /// What a request that reserved `reserved` is charged when its response never reports its
    /// usage.
    pub fn unreported(&self, reserved: u64) -> u64 {
        match (self.default, self.true_up) {
            (Some(d), _) => u64::from(d),
            (None, true) => reserved,
            (None, false) => self.admission(),
        }
    }
}

/// A reservation sized from the request's body: the output maximum it names, plus an estimate
/// of its input, capped by the rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sized {
    /// The fields naming the output maximum (the last one found counts); `None` for a rule
    /// that reserves its input estimate alone.
    pub from: Option<Vec<Vec<String>>>,
    /// Their slot in [`Config::request_paths`].
    pub slot: usize,
    /// The estimate of the input added to it.
    pub input: Input,
    /// How many body bytes to read (and hold) while looking for the fields: the search stops
    /// with the piece that crosses it; a body that names none by then reserves
    /// [`Charge::reserve`].
    pub max_body: u32,
}

/// An estimate of a request's input, in the rule's units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// Always this much.
    Fixed(u32),
    /// The request body's bytes divided by this (its `content-length`, else the bytes seen).
    PerBytes(u32),
}

impl Sized {
    /// The output maximum a request's body named, `value` being what the body scan found in
    /// each slot: 0 for a reservation without one (`None`: not named, the body is still being
    /// read or never named it).
    pub fn maximum(&self, value: impl Fn(usize) -> Option<u64>) -> Option<u64> {
        match self.from {
            Some(_) => value(self.slot),
            None => Some(0),
        }
    }
}

impl Input {
    /// The estimate for a body of `bytes`.
    pub fn estimate(self, bytes: u64) -> u64 {
        match self {
            Input::Fixed(n) => u64::from(n),
            Input::PerBytes(d) => bytes / u64::from(d.max(1)),
        }
    }
}

/// Where a response's usage comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Usage {
    /// A response header of this (lower-case) name, or the trailer of that name if the
    /// headers do not carry it.
    Header(String),
    /// The response body's bytes, counted as they pass.
    BodyBytes,
    /// Numbers in the response body (a JSON document, or a stream of JSON events), summed.
    Body(BodyUsage),
    /// The tokens an LLM API's answer reports, priced by the model (`cost.response.price`).
    Price(Box<Price>),
}

/// A usage read from the response body: the sum of each term's weight times its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyUsage {
    /// The terms; a term whose fields never appear counts 0, and a body where none appears
    /// did not report its usage.
    pub terms: Vec<Term>,
}

/// One term of a [`BodyUsage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    /// What each unit of the value counts.
    pub weight: u32,
    /// The fields giving the value, each a path of keys from the document's root; the last one
    /// found in the body counts (streams repeat running totals).
    pub paths: Vec<Vec<String>>,
    /// Their slot in [`Config::usage_paths`].
    pub slot: usize,
}

impl BodyUsage {
    /// The usage a scan found; `None` if none of the fields appeared.
    pub fn total(&self, value: impl Fn(usize) -> Option<u64>) -> Option<u64> {
        let mut found = false;
        let mut total = 0u64;
        for t in &self.terms {
            if let Some(v) = value(t.slot) {
                found = true;
                total = total.saturating_add(v.saturating_mul(u64::from(t.weight)));
            }
        }
        found.then_some(total)
    }
}

/// A usage in money: the input, cached input, cache writes and output tokens an LLM API's
/// answer reports, each times its price for the answer's model, summed exactly in integers and
/// divided by [`Price::per`] (rounded up, once per answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    /// The API whose answers are read (`price.usage`).
    pub api: body::PriceApi,
    /// The fields read, each with the kind of tokens it counts (a kind may take several terms:
    /// Gemini's output is its candidates plus its thoughts).
    pub terms: Vec<(Tokens, Term)>,
    /// Where the model comes from.
    pub model: ModelFrom,
    /// How many tokens a price is for: 1, 1,000 or 1,000,000.
    pub per: u32,
    /// The price table, by model name: an exact name, or a prefix (a name ending in `*`).
    pub models: Vec<ModelPrice>,
    /// The price of a model not in the table; `None`: such a request is refused.
    pub default: Option<Rates>,
    /// The highest price of each kind, over the table and the default: what a reservation is
    /// priced at while the model is not known (it comes with the answer).
    pub dearest: Rates,
}

/// The kinds of tokens an answer is priced by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// The input; for OpenAI and Gemini the cached part included (it is taken off).
    Input,
    /// The input read from the prompt cache.
    Cached,
    /// The input written to the cache (Anthropic).
    CacheWrite,
    /// The output.
    Output,
}

/// Where a priced rule's model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFrom {
    /// A field of the request's body (`body:model`): known at admission.
    Body(BodyField),
    /// The answer's own `model` field (`response`), read with its usage.
    Answer(Term),
}

/// One row of a price table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPrice {
    /// The model's name, without the `*` of a prefix.
    pub name: String,
    /// Whether the name is a prefix (`gpt-4o*`); the longest matching prefix wins, and an
    /// exact name wins over any prefix.
    pub prefix: bool,
    /// Its prices.
    pub rates: Rates,
}

/// The prices of one model, in the rule's unit per [`Price::per`] tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rates {
    /// Input tokens not read from the cache.
    pub input: u32,
    /// Input tokens read from the cache (default: `input`).
    pub cached_input: u32,
    /// Input tokens written to the cache (Anthropic; default: `input`).
    pub cache_write: u32,
    /// Output tokens.
    pub output: u32,
}

/// Which prices a request is charged at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priced {
    /// The row at this index of [`Price::models`].
    Model(u16),
    /// The default price.
    Default,
    /// The answer names the model: known when its usage is (the dearest prices until then).
    Answer,
    /// No price for the model named: the dearest of each kind (a shadow rule's charge for
    /// what it would have refused).
    Dearest,
}

impl Rates {
    /// The price of `kind`.
    pub fn of(&self, kind: Tokens) -> u32 {
        match kind {
            Tokens::Input => self.input,
            Tokens::Cached => self.cached_input,
            Tokens::CacheWrite => self.cache_write,
            Tokens::Output => self.output,
        }
    }

    /// The highest of each price of `self` and `other`.
    pub fn max(self, other: Rates) -> Rates {
        Rates {
            input: self.input.max(other.input),
            cached_input: self.cached_input.max(other.cached_input),
            cache_write: self.cache_write.max(other.cache_write),
            output: self.output.max(other.output),
        }
    }
}

impl Price {
    /// The prices of the model named `model` (a string, as a body scan keeps it); `None` for
    /// a model neither in the table nor covered by a default (refused).
    pub fn lookup(&self, model: Option<&[u8]>) -> Option<Priced> {
        let Some(name) = model else {
            return self.default.map(|_| Priced::Default);
        };
        let mut best: Option<(usize, usize)> = None; // (index, length matched)
        for (i, row) in self.models.iter().enumerate() {
            let fits = if row.prefix {
                name.starts_with(row.name.as_bytes())
            } else {
                name == row.name.as_bytes()
            };
            // An exact name counts as longer than any prefix.
            let length = if row.prefix {
                row.name.len()
            } else {
                usize::MAX
            };
            if fits && best.is_none_or(|(_, l)| length > l) {
                best = Some((i, length));
            }
        }
        match best.and_then(|(i, _)| u16::try_from(i).ok()) {
            Some(i) => Some(Priced::Model(i)),
            None => self.default.map(|_| Priced::Default),
        }
    }

    /// The prices `priced` stands for (`Priced::Answer`: the dearest, the model being unknown
    /// yet).
    pub fn rates(&self, priced: Priced) -> Rates {
        match priced {
            Priced::Model(i) => self
                .models
                .get(usize::from(i))
                .map_or(self.dearest, |m| m.rates),
            Priced::Default => self.default.unwrap_or(self.dearest),
            Priced::Answer | Priced::Dearest => self.dearest,
        }
    }

    /// The money for `tokens` of each kind at `rates`: exact in integers, divided by
    /// [`Price::per`] and rounded up (a charge is never below what the tokens cost).
    pub fn cost(&self, rates: Rates, tokens: impl Fn(Tokens) -> u64) -> u64 {
        let input = match self.api {
            // Their input counts the cached part, priced apart.
            body::PriceApi::OpenAi | body::PriceApi::Gemini => {
                tokens(Tokens::Input).saturating_sub(tokens(Tokens::Cached))
            }
            body::PriceApi::Anthropic => tokens(Tokens::Input),
        };
        let total: u128 = [
            (input, rates.input),
            (tokens(Tokens::Cached), rates.cached_input),
            (tokens(Tokens::CacheWrite), rates.cache_write),
            (tokens(Tokens::Output), rates.output),
        ]
        .iter()
        .map(|&(n, rate)| u128::from(n) * u128::from(rate))
        .sum();
        let per = u128::from(self.per.max(1));
        u64::try_from(total.div_ceil(per)).unwrap_or(u64::MAX)
    }

    /// The money an answer reported, a scan having found `value` in each slot, at `priced`
    /// (`Priced::Answer`: the model the scan found, by `text`); `None` if the answer reported
    /// none of the tokens.
    pub fn total<'t>(
        &self,
        priced: Priced,
        value: impl Fn(usize) -> Option<u64>,
        text: impl Fn(usize) -> Option<&'t [u8]>,
    ) -> Option<u64> {
        let mut found = false;
        let mut sums = [0u64; 4];
        for (kind, t) in &self.terms {
            if let Some(v) = value(t.slot) {
                found = true;
                if let Some(s) = sums.get_mut(kind_index(*kind)) {
                    *s = s.saturating_add(v.saturating_mul(u64::from(t.weight)));
                }
            }
        }
        if !found {
            return None;
        }
        let priced = match (&self.model, priced) {
            (ModelFrom::Answer(t), _) => {
                // A model from the answer always has a default (checked at load).
                self.lookup(text(t.slot)).unwrap_or(Priced::Dearest)
            }
            (ModelFrom::Body(_), p) => p,
        };
        let rates = self.rates(priced);
        Some(self.cost(rates, |k| sums.get(kind_index(k)).copied().unwrap_or(0)))
    }

    /// The reservation for a request naming `maximum` output tokens with an input estimated at
    /// `input` tokens, at `priced`.
    pub fn reservation(&self, priced: Priced, maximum: u64, input: u64) -> u64 {
        let rates = self.rates(priced);
        self.cost(rates, |k| match k {
            Tokens::Input => input,
            Tokens::Output => maximum,
            Tokens::Cached | Tokens::CacheWrite => 0,
        })
    }
}

fn kind_index(kind: Tokens) -> usize {
    match kind {
        Tokens::Input => 0,
        Tokens::Cached => 1,
        Tokens::CacheWrite => 2,
        Tokens::Output => 3,
    }
}

/// How many request body bytes a sized reservation holds by default while looking for its
/// fields.
pub const DEFAULT_BODY_HELD: u32 = 16 * 1024;
/// The most `max_body` may be (Envoy's default per-connection buffer limit is 1 MiB).
pub const MAX_BODY_HELD: u32 = 512 * 1024;

/// The longest `max_delay_ms` accepted.
pub const MAX_DELAY_MS: u64 = 60_000;

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

/// Parses a cost header's value: a decimal integer up to `u32::MAX`, else 1.
pub fn parse_cost(value: Option<&[u8]>) -> u64 {
    value
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map_or(1, u64::from)
}

/// Parses a usage a response reports: a decimal integer (whitespace around it is ignored);
/// anything else is `None` (not reported).
pub fn parse_usage(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

/// Conditions a request must all meet for a rule to apply. The default matches every request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// The path (without query) starts with this.
    pub path_prefix: Option<String>,
    /// The path (without query) equals this.
    pub path: Option<String>,
    /// The method is one of these (empty: any method).
    pub methods: Vec<String>,
    /// The authority (`:authority`/`Host`) equals this, compared case-insensitively; stored
    /// lower-case.
    pub authority: Option<String>,
    /// Header conditions.
    pub headers: Vec<HeaderMatch>,
    /// Conditions on fields of the request's JSON body.
    pub body: Vec<BodyMatch>,
}

/// A field of the request's JSON body, read as the body passes (`body:PATH`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BodyField {
    /// The keys from the document's root (`metadata.user_id`: two).
    pub path: Vec<String>,
    /// Its slot in [`Config::request_paths`] (assigned once the rules are read).
    pub slot: usize,
}

impl fmt::Display for BodyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "body:{}", self.path.join("."))
    }
}

/// A condition on one field of the request's JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyMatch {
    /// The field.
    pub field: BodyField,
    /// What its value (a string, or a whole number as digits) must satisfy.
    pub condition: BodyCondition,
}

/// What a body field's value must satisfy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyCondition {
    /// Equals this.
    Equals(String),
    /// Equals one of these.
    OneOf(Vec<String>),
    /// Starts with this.
    Prefix(String),
}

impl BodyCondition {
    /// Whether `value` satisfies it.
    pub fn holds(&self, value: &[u8]) -> bool {
        match self {
            BodyCondition::Equals(want) => value == want.as_bytes(),
            BodyCondition::OneOf(list) => list.iter().any(|w| value == w.as_bytes()),
            BodyCondition::Prefix(p) => value.starts_with(p.as_bytes()),
        }
    }
}

/// A condition on one request header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderMatch {
    /// Lower-case header name.
    pub name: String,
    /// What the header must satisfy.
    pub condition: HeaderCondition,
}

/// What a matched header must satisfy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderCondition {
    /// The header's value equals this exactly.
    Equals(String),
    /// The header is present (`true`) or absent (`false`).
    Present(bool),
}

/// How a client address is aggregated into a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefixes {
    /// Clients of one IPv4 network of this prefix length share a key (32: each address).
    pub v4: u8,
    /// Clients of one IPv6 network of this prefix length share a key.
    pub v6: u8,
}

/// IPv4 clients are keyed per address, IPv6 clients per /64 (what one subscriber usually
/// holds: keying per address would let a client walk around its limit).
pub const DEFAULT_PREFIXES: Prefixes = Prefixes { v4: 32, v6: 64 };

/// One part of a client key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// The downstream address without the port (Envoy's `source.address`), aggregated to a
    /// network prefix.
    RemoteAddress(Prefixes),
    /// A request header's value (lower-case name).
    Header(String),
    /// A query parameter's raw (not percent-decoded) value.
    Query(String),
    /// The path without the query string.
    Path,
    /// The request method.
    Method,
    /// The authority, lower-cased.
    Authority,
    /// The token of an `Authorization: Bearer TOKEN` header, without its scheme (what the
    /// OpenAI and Anthropic SDKs send their API key in). Any other scheme counts as absent.
    Bearer,
    /// The first of these parts the request has (two or more, none of them `first`): the same
    /// client whichever of them it sent its key in, since only the value is keyed.
    First(Vec<KeyPart>),
    /// A field of the request's JSON body (a string, or a whole number as digits).
    Body(BodyField),
}

impl KeyPart {
    /// Whether the part reads a field of the request's body.
    pub fn reads_body(&self) -> bool {
        let mut any = false;
        self.each_body_field(&mut |_| any = true);
        any
    }

    /// Calls `f` with each body field the part reads.
    pub fn each_body_field(&self, f: &mut dyn FnMut(&BodyField)) {
        match self {
            KeyPart::Body(field) => f(field),
            KeyPart::First(parts) => parts.iter().for_each(|p| p.each_body_field(f)),
            _ => {}
        }
    }

    /// The body fields the part reads, to give them their slots.
    pub(crate) fn body_fields_mut(&mut self) -> Vec<&mut BodyField> {
        match self {
            KeyPart::Body(field) => vec![field],
            KeyPart::First(parts) => parts
                .iter_mut()
                .flat_map(KeyPart::body_fields_mut)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Whether two parts read the same attribute (a key takes each at most once).
    pub fn same_part(&self, other: &KeyPart) -> bool {
        match (self, other) {
            (KeyPart::RemoteAddress(_), KeyPart::RemoteAddress(_)) => true,
            (KeyPart::First(parts), x) | (x, KeyPart::First(parts)) => {
                parts.iter().any(|p| p.same_part(x))
            }
            (KeyPart::Bearer, KeyPart::Header(h)) | (KeyPart::Header(h), KeyPart::Bearer) => {
                h == "authorization"
            }
            (a, b) => a == b,
        }
    }

    /// The entry key of this part in a rate limit service descriptor (`remote_address` for
    /// every prefix: the value carries the network).
    pub fn descriptor_key(&self) -> String {
        match self {
            KeyPart::RemoteAddress(_) => "remote_address".into(),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::RemoteAddress(p) if *p == DEFAULT_PREFIXES => f.write_str("remote_address"),
            KeyPart::RemoteAddress(p) => {
                write!(f, "remote_address(ipv4 /{}, ipv6 /{})", p.v4, p.v6)
            }
            KeyPart::Header(name) => write!(f, "header:{name}"),
            KeyPart::Query(name) => write!(f, "query:{name}"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::Method => f.write_str("method"),
            KeyPart::Authority => f.write_str("authority"),
            KeyPart::Bearer => f.write_str("bearer"),
            KeyPart::Body(field) => write!(f, "{field}"),
            KeyPart::First(parts) => {
                f.write_str("first(")?;
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{p}")?;
                }
                f.write_str(")")
            }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod price_tests {
    use super::*;

    fn price(per: &str, default: &str) -> Price {
        let json = format!(
            r#"{{"rules": [{{"name": "usd", "rate_limit": {{"requests_per_unit": 1000000, "unit": "day"}},
            "cost": {{"response": {{"price": {{"usage": "anthropic", "model": "body:model", "per": "{per}",
              "models": {{"claude-*": {{"input": 1, "output": 5}}, "claude-opus-*": {{"input": 15, "output": 75}},
                         "claude-opus-4": {{"input": 20, "output": 80, "cached_input": 2, "cache_write": 25}}}},
              "default": {default}}}}}}}}}]}}"#
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        config.rules[0].price().unwrap().clone()
    }

    #[test]
    fn an_exact_name_beats_the_longest_prefix_which_beats_a_shorter_one() {
        let p = price("token", r#""refuse""#);
        let rates = |m: &str| p.lookup(Some(m.as_bytes())).map(|x| p.rates(x).input);
        assert_eq!(rates("claude-opus-4"), Some(20));
        assert_eq!(rates("claude-opus-4-1"), Some(15));
        assert_eq!(rates("claude-haiku"), Some(1));
        assert_eq!(rates("claude-"), Some(1));
        assert_eq!(rates("claude"), None, "refused");
        assert_eq!(p.lookup(None), None, "no model: refused too");
        // Unset cached and cache-write prices are the input's.
        let haiku = p.rates(p.lookup(Some(b"claude-haiku")).unwrap());
        assert_eq!((haiku.cached_input, haiku.cache_write), (1, 1));
        // The dearest of each kind, for a reservation before the model is known.
        assert_eq!(
            p.dearest,
            Rates {
                input: 20,
                cached_input: 15,
                cache_write: 25,
                output: 80
            }
        );
    }

    #[test]
    fn a_cost_is_exact_per_token_and_rounded_up_once_per_larger_unit() {
        let tokens = |k| match k {
            Tokens::Input => 3,
            Tokens::Cached => 1000,
            Tokens::CacheWrite => 10,
            Tokens::Output => 7,
        };
        let opus4 = Rates {
            input: 20,
            cached_input: 2,
            cache_write: 25,
            output: 80,
        };
        // Anthropic's input excludes the cache: every kind counts in full.
        assert_eq!(
            price("token", "{\"input\": 1, \"output\": 1}").cost(opus4, tokens),
            60 + 2000 + 250 + 560
        );
        assert_eq!(price("1K tokens", "\"refuse\"").cost(opus4, tokens), 3);
        assert_eq!(price("1M tokens", "\"refuse\"").cost(opus4, tokens), 1);
        assert_eq!(price("1M tokens", "\"refuse\"").cost(opus4, |_| 0), 0);
        // No overflow: the most of every kind at the highest price.
        let max = Rates {
            input: u32::MAX,
            cached_input: u32::MAX,
            cache_write: u32::MAX,
            output: u32::MAX,
        };
        assert_eq!(
            price("token", "\"refuse\"").cost(max, |_| u64::MAX),
            u64::MAX
        );
        // A reservation: the output maximum and the input estimate.
        let p = price("token", "\"refuse\"");
        let opus = p.lookup(Some(b"claude-opus-4")).unwrap();
        assert_eq!(p.reservation(opus, 100, 40), 100 * 80 + 40 * 20);
    }
}
