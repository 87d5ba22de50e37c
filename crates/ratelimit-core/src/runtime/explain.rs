//! Why each rule does or does not apply to one request, for `ratelimit-config explain`: the
//! same first step [`Runtime::start`] takes for every rule (`Runtime::applying`: the match,
//! the client key, the cost, the limit), with what it saw along the way. The filter never calls
//! it; nothing here is a second way to match, key, cost or limit a request.

use super::request::{Applying, Carrying, Host};
use super::Runtime;
use crate::config::{
    self, Carried, Cost, FromRequest, KeyPart, Limit, ModelFrom, Priced, Resolved, Rule,
    ShareConfig, Source,
};
use crate::key::{self, Attributes, Condition};
use crate::limiter::{calendar, Policy, Windows};
use crate::store::Store;
use std::fmt;
use std::net::IpAddr;

/// What one rule makes of the request.
#[derive(Clone, Debug, PartialEq)]
pub struct Explained<'r> {
    /// The rule.
    pub rule: &'r Rule,
    /// How it applies, or why it does not.
    pub outcome: Result<Applies<'r>, NotApplying<'r>>,
}

/// How a rule applies to the request.
#[derive(Clone, Debug, PartialEq)]
pub struct Applies<'r> {
    /// The keyed hash of the client key, under the runtime's seed (print it with
    /// [`key::logged`], as the filter logs it).
    pub hash: u64,
    /// The parts of the client key, in order.
    pub parts: Vec<Part<'r>>,
    /// What the request costs, and where that comes from.
    pub cost: CostFrom<'r>,
    /// The rule's algorithm with the limit in force for this request (before an elastic rule's
    /// scaling).
    pub policy: Policy,
    /// The numbers of the limit the request carried (`rules[].…{"from": …}`), if any.
    pub carried: Vec<Carry<'r>>,
    /// A shared rule's view of this request's tenant.
    pub share: Option<Shared<'r>>,
}

/// What a shared rule makes of the request's tenant.
#[derive(Clone, Debug, PartialEq)]
pub struct Shared<'r> {
    /// The tenant's weight for this request.
    pub weight: u16,
    /// Where the weight was read, and what became of it (`None`: a fixed weight).
    pub weight_from: Option<Carry<'r>>,
    /// The band's name.
    pub band: &'r str,
    /// Where the band was read, and what the request carried there (`None`: one band).
    pub band_from: Option<(&'r Source, Option<Value>)>,
    /// What the share levels hand out of the capacity per window: `target` × the limit (the
    /// band's budget, with bands, is at most this).
    pub handed_out: u64,
}

/// One part of a client key as the request gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part<'r> {
    /// The part.
    pub part: &'r KeyPart,
    /// Its value as a rate limit service is sent it: raw bytes, a client address as the
    /// network the key uses (`10.1.2.0/24`, `2001:db8:1:2::/64`, or the address itself).
    pub value: Vec<u8>,
    /// Something worth knowing about the value, if anything.
    pub note: Option<PartNote>,
}

/// Something worth knowing about a key part's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartNote {
    /// An IPv4 client seen through an IPv6 socket (`::ffff:a.b.c.d`): keyed as an IPv4 client.
    MappedIpv4,
    /// The client address is not an IP address: its text is the key.
    NotAnIp,
    /// Longer than [`key::MAX_KEY_PART`]: only its length and first bytes are hashed.
    Long,
    /// Missing, and keyed as the value every request without it shares
    /// (`on_missing_key: shared`).
    Shared,
}

impl fmt::Display for PartNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PartNote::MappedIpv4 => f.write_str("an IPv4 client seen over IPv6"),
            PartNote::NotAnIp => f.write_str("not an IP address: its text is the key"),
            PartNote::Long => write!(
                f,
                "longer than {} bytes: its length and first {} bytes are hashed",
                key::MAX_KEY_PART,
                key::MAX_KEY_PART
            ),
            PartNote::Shared => f.write_str(
                "missing: keyed as the one value every request without it shares (on_missing_key: shared)",
            ),
        }
    }
}

/// What a request costs under a rule that applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CostFrom<'r> {
    /// A fixed cost.
    Fixed(u64),
    /// The value of a request header; a missing or invalid value costs 1.
    Header {
        /// The header's name.
        name: &'r str,
        /// Its value, if the request has it.
        value: Option<Vec<u8>>,
        /// The cost.
        cost: u64,
    },
    /// A rule charged by its response: the reservation admission asks for.
    Reservation {
        /// The reservation (without a request body to size it, for a sized one).
        cost: u64,
        /// Whether the filter sizes it from the request's body (this is what a body that
        /// names no maximum reserves).
        sized: bool,
        /// For a rule charged in money: the prices the request's model takes.
        priced: Option<PricedAs>,
    },
}

/// The prices a request's model takes under a rule charged in money.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PricedAs {
    /// The model comes with the answer.
    Answer,
    /// The request's body names this model (`None`: none), priced at these.
    Body(Option<Vec<u8>>, Priced),
    /// The request's body names this model (`None`: none), which has no price: the rule
    /// refuses the request with a 400.
    Unpriced(Option<Vec<u8>>),
}

impl CostFrom<'_> {
    /// The cost.
    pub fn value(&self) -> u64 {
        match self {
            CostFrom::Fixed(n)
            | CostFrom::Header { cost: n, .. }
            | CostFrom::Reservation { cost: n, .. } => *n,
        }
    }
}

/// Which number of a limit a request carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Number {
    /// `rate_limit.requests_per_unit`.
    RequestsPerUnit,
    /// `in_flight.max`.
    InFlightMax,
    /// `burst`.
    Burst,
    /// `share.weight`.
    Weight,
}

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Number::RequestsPerUnit => "requests_per_unit",
            Number::InFlightMax => "in_flight.max",
            Number::Burst => "burst",
            Number::Weight => "share.weight",
        })
    }
}

/// A number of a rule's limit read from the request, and what became of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Carry<'r> {
    /// Which number.
    pub number: Number,
    /// Where it is read.
    pub source: &'r Source,
    /// What the request carried there (`None`: nothing, or an empty value).
    pub value: Option<Value>,
    /// The number in force, and why.
    pub resolved: Resolved,
}

/// A value a request carried, owned.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Text (a header, a filter state object, a metadata string).
    Text(Vec<u8>),
    /// A metadata number.
    Number(f64),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Text(t) => write!(f, "\"{}\"", escaped(t)),
            Value::Number(n) => write!(f, "{n}"),
        }
    }
}

/// Why a rule does not apply to the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotApplying<'r> {
    /// A condition of its `match` does not hold.
    NoMatch {
        /// The first condition that does not hold.
        condition: Condition<'r>,
        /// What the request has where the condition looks (`None`: nothing).
        found: Option<Vec<u8>>,
    },
    /// A part of its key is missing.
    MissingPart {
        /// The first missing part.
        part: &'r KeyPart,
        /// Why it counts as missing.
        why: Absence,
        /// Whether the rule then refuses the request (`on_missing_key: refuse`; a shadow rule
        /// only logs).
        refused: bool,
    },
    /// The filter's first step skipped the rule, but a second look at the request found no
    /// condition or part to blame: a host whose attributes changed between reads.
    Unexplained,
}

/// Why a key part counts as missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Absence {
    /// The request does not have it.
    Absent,
    /// It is there but empty or whitespace-only (a query parameter: without a value), which
    /// counts as absent.
    Empty,
    /// An `Authorization` header is there, but not of the `Bearer` scheme.
    NotBearer,
    /// A body field: not in the request's JSON body (or not within `max_body` bytes of it, or
    /// not a string or a whole number, or the body is not JSON).
    NotInBody,
}

impl fmt::Display for Absence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Absence::Absent => "absent",
            Absence::Empty => "empty; empty values count as absent",
            Absence::NotBearer => "the authorization header is not a Bearer token",
            Absence::NotInBody => "not a string or a whole number in the request's JSON body",
        })
    }
}

impl fmt::Display for NotApplying<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotApplying::NoMatch { condition, found } => {
                write!(f, "{condition} does not hold for ")?;
                let what = match condition {
                    Condition::Path(_) | Condition::PathPrefix(_) => "path".to_string(),
                    Condition::Methods(_) => "method".to_string(),
                    Condition::Authority(_) => "authority".to_string(),
                    Condition::Header(h) => format!("header {}", h.name),
                    Condition::Body(b) => format!("body field {}", b.field.path.join(".")),
                };
                match found {
                    Some(v) => write!(f, "{what} \"{}\"", escaped(v)),
                    None => write!(f, "a request without {what}"),
                }
            }
            NotApplying::MissingPart { part, why, refused } => {
                write!(f, "key part {part} is missing ({why})")?;
                if *refused {
                    write!(
                        f,
                        "; on_missing_key: refuse, so the request is refused with a {}",
                        super::request::MISSING_KEY_STATUS
                    )?;
                }
                Ok(())
            }
            NotApplying::Unexplained => {
                f.write_str("skipped, but the request read differently a second time")
            }
        }
    }
}

/// `bytes` as text a terminal shows safely: UTF-8 with its control characters escaped, else
/// every byte outside printable ASCII as `\xNN`.
pub fn escaped(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s
            .chars()
            .map(|c| match c {
                '"' | '\\' => format!("\\{c}"),
                c if c.is_control() => c.escape_default().to_string(),
                c => c.to_string(),
            })
            .collect(),
        Err(_) => bytes.escape_ascii().to_string(),
    }
}

impl<S: Store> Runtime<S> {
    /// What each rule makes of the request, in configuration order: the filter's own first
    /// step for each rule ([`Runtime::start`] takes it), with what it saw. Counts nothing and
    /// touches no counter: the request is not decided.
    pub fn explain(&self, host: &mut impl Host) -> Vec<Explained<'_>> {
        self.config
            .rules
            .iter()
            .zip(&self.compiled)
            .map(|(rule, compiled)| Explained {
                rule,
                outcome: match self.applying(rule, compiled, host) {
                    Ok(a) => Ok(applies(rule, a, host)),
                    Err(_) => Err(not_applying(rule, host)),
                },
            })
            .collect()
    }
}

/// What the filter's first step saw of a rule that applies.
fn applies<'r>(rule: &'r Rule, a: Applying, host: &mut impl Host) -> Applies<'r> {
    let mut values = Vec::with_capacity(rule.key.len());
    key::visit_parts(&rule.key, host, rule.shares_missing_key(), |_, value| {
        values.push(value.map(<[u8]>::to_vec));
    });
    let parts = rule
        .key
        .iter()
        .zip(values)
        .map(|(part, value)| {
            let note = match (part, &value) {
                (_, None) => Some(PartNote::Shared),
                (KeyPart::RemoteAddress(_), _) => host.client_address().and_then(address_note),
                (_, Some(v)) => (v.len() > key::MAX_KEY_PART).then_some(PartNote::Long),
            };
            let value = key::descriptor_value_of(part, value.as_deref());
            Part { part, value, note }
        })
        .collect();
    let cost = match &rule.cost {
        Cost::Fixed(_) => CostFrom::Fixed(a.cost),
        Cost::Header(name) => CostFrom::Header {
            name,
            value: host.header(name).map(<[u8]>::to_vec),
            cost: a.cost,
        },
        Cost::Response(c) => CostFrom::Reservation {
            cost: a.cost,
            sized: c.sized.is_some(),
            priced: rule.price().map(|p| match (&p.model, a.priced) {
                (ModelFrom::Answer(_), _) => PricedAs::Answer,
                (ModelFrom::Body(f), priced) => {
                    let model = host.body_field(f.slot).map(<[u8]>::to_vec);
                    match priced {
                        Some(priced) => PricedAs::Body(model, priced),
                        None => PricedAs::Unpriced(model),
                    }
                }
            }),
        },
    };
    Applies {
        hash: a.hash,
        parts,
        cost,
        policy: a.policy,
        carried: carried(rule, a.carried, host),
        share: rule.share.as_ref().map(|sh| shared(sh, &a.policy, host)),
    }
}

/// The tenant a shared rule sees in the request.
fn shared<'r>(sh: &'r ShareConfig, policy: &Policy, host: &mut impl Host) -> Shared<'r> {
    let owned = |v: Carried<'_>| match v {
        Carried::Text(t) => Value::Text(t.to_vec()),
        Carried::Number(n) => Value::Number(n),
    };
    let weight_from = sh.weight_from.as_ref().map(|from| {
        let carried = key::carried(&from.source, host);
        let resolved = from.resolve(carried);
        Carry {
            number: Number::Weight,
            source: &from.source,
            value: key::carried(&from.source, host).map(owned),
            resolved,
        }
    });
    let weight = weight_from.as_ref().map_or(sh.weight, |c| {
        u16::try_from(c.resolved.value()).unwrap_or(u16::MAX).max(1)
    });
    let band = match &sh.band_from {
        Some(source) => sh.band_of(key::carried(source, host)),
        None => sh.band_default,
    };
    let band_from = sh
        .band_from
        .as_ref()
        .map(|source| (source, key::carried(source, host).map(owned)));
    let limit = policy.limit_and_window().0;
    Shared {
        weight,
        weight_from,
        band: sh.bands.get(usize::from(band)).map_or("", String::as_str),
        band_from,
        handed_out: limit.saturating_mul(sh.params.target_pm) / 1000,
    }
}

/// What is worth knowing about a client address.
fn address_note(address: &str) -> Option<PartNote> {
    match address.parse::<IpAddr>() {
        Err(_) => Some(PartNote::NotAnIp),
        Ok(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some() => Some(PartNote::MappedIpv4),
        Ok(_) => None,
    }
}

/// The numbers of the limit the request carried, with the value read at each source.
fn carried<'r>(rule: &'r Rule, carrying: Carrying, host: &mut impl Host) -> Vec<Carry<'r>> {
    let limit = match rule.limit {
        Limit::Rate { .. } => Number::RequestsPerUnit,
        Limit::InFlight { .. } => Number::InFlightMax,
    };
    let pairs: [(Number, Option<&'r FromRequest>, Option<Resolved>); 2] = [
        (limit, rule.per_request.limit.as_ref(), carrying.limit),
        (
            Number::Burst,
            rule.per_request.burst.as_ref(),
            carrying.burst,
        ),
    ];
    pairs
        .into_iter()
        .filter_map(|(number, from, resolved)| {
            let (from, resolved) = (from?, resolved?);
            let value = key::carried(&from.source, host).map(|v| match v {
                Carried::Text(t) => Value::Text(t.to_vec()),
                Carried::Number(n) => Value::Number(n),
            });
            Some(Carry {
                number,
                source: &from.source,
                value,
                resolved,
            })
        })
        .collect()
}

/// Why the filter's first step skipped `rule`: its first failing condition, else its first
/// missing key part.
fn not_applying<'r>(rule: &'r Rule, host: &mut impl Host) -> NotApplying<'r> {
    if let Some(condition) = key::failing(&rule.matcher, host) {
        let found = found(condition, host);
        return NotApplying::NoMatch { condition, found };
    }
    match key::missing_part(&rule.key, host) {
        Some(part) => NotApplying::MissingPart {
            part,
            why: absence(part, host),
            refused: rule.on_missing_key == config::MissingKey::Refuse && !rule.shadow,
        },
        None => NotApplying::Unexplained,
    }
}

/// What the request has where `condition` looks.
fn found(condition: Condition<'_>, host: &mut impl Attributes) -> Option<Vec<u8>> {
    let bytes = |s: &str| s.as_bytes().to_vec();
    match condition {
        Condition::Path(_) | Condition::PathPrefix(_) => {
            host.path().map(|p| bytes(key::split_path(p).0))
        }
        Condition::Methods(_) => host.method().map(bytes),
        Condition::Authority(_) => host.authority().map(bytes),
        Condition::Header(h) => host.header(&h.name).map(<[u8]>::to_vec),
        Condition::Body(b) => host.body_field(b.field.slot).map(<[u8]>::to_vec),
    }
}

/// Whether a missing key part is absent from the request or there but empty.
fn absence(part: &KeyPart, host: &mut impl Attributes) -> Absence {
    let there = match part {
        KeyPart::Header(name) => host.header(name).is_some(),
        KeyPart::Query(name) => host
            .path()
            .and_then(|p| key::split_path(p).1)
            .is_some_and(|q| key::query_param(q, name).is_some()),
        // Empty, or a Bearer scheme without a token; else another scheme.
        KeyPart::Bearer => match host.header("authorization").map(<[u8]>::trim_ascii) {
            None => false,
            Some(v) if v.is_empty() || v.eq_ignore_ascii_case(b"bearer") => true,
            Some(_) => return Absence::NotBearer,
        },
        // Whichever of its parts is there (empty, or not a bearer token) tells most.
        KeyPart::First(parts) => {
            return parts
                .iter()
                .map(|p| absence(p, host))
                .find(|a| *a != Absence::Absent)
                .unwrap_or(Absence::Absent)
        }
        KeyPart::Body(_) => return Absence::NotInBody,
        KeyPart::RemoteAddress(_) | KeyPart::Path | KeyPart::Method | KeyPart::Authority => false,
    };
    if there {
        Absence::Empty
    } else {
        Absence::Absent
    }
}

/// The limit in force as a sentence: `100 per minute`, `10 per second, burst 20`, `5 in
/// flight`, `1000 per month at UTC+02:00`.
pub fn limit_text(policy: &Policy) -> String {
    match policy {
        Policy::InFlight { max, .. } => format!("{max} in flight"),
        p => {
            let (limit, window) = (p.limit_and_window().0, window_text(p));
            match p.burst() {
                Some(b) => format!("{limit} per {window}, burst {b}"),
                None => format!("{limit} per {window}"),
            }
        }
    }
}

/// A policy's window by its unit's name (`minute`, `month`), with the UTC offset of a fixed
/// window's if it has one (`day at UTC+05:30`), or in seconds; empty for requests in flight.
pub fn window_text(policy: &Policy) -> String {
    match *policy {
        Policy::FixedWindow { windows, .. } => windows_name(windows),
        Policy::InFlight { .. } => String::new(),
        p => window_name(p.limit_and_window().1),
    }
}

/// A window by its unit's name (`minute`), or in seconds.
fn window_name(ms: u64) -> String {
    config::Unit::ALL
        .into_iter()
        .find(|u| *u != config::Unit::Month && u.seconds() * 1000 == ms)
        .map_or_else(|| format!("{} s", ms / 1000), |u| u.name().to_string())
}

/// A fixed window's windows by name, with their UTC offset if they have one: `month`,
/// `day at UTC+05:30`. An offset is shown as the one nearest UTC that lays the windows where
/// they are (a day at +14:00 is a day at -10:00).
fn windows_name(windows: Windows) -> String {
    let (name, offset_ms) = match windows {
        Windows::Months { offset_min } => ("month".to_string(), i64::from(offset_min) * 60_000),
        Windows::Every { len_ms, phase_ms } => {
            let Windows::Every { phase_ms: utc, .. } = Windows::aligned(len_ms, 0) else {
                return window_name(len_ms);
            };
            // A window begins `phase` past each multiple of its length; UTC's begins `utc` past.
            let len = i64::try_from(len_ms.max(1)).unwrap_or(i64::MAX);
            let shift = (i64::try_from(utc).unwrap_or(0) - i64::try_from(phase_ms).unwrap_or(0))
                .rem_euclid(len);
            let nearest = if shift > len / 2 { shift - len } else { shift };
            (window_name(len_ms), nearest)
        }
    };
    match offset_ms / 60_000 {
        0 => name,
        m => format!("{name} at UTC{}", calendar::offset_text(m)),
    }
}

/// What became of a carried number, as words.
pub fn resolved_text(r: Resolved) -> String {
    match r {
        Resolved::Taken(_) => "taken".to_string(),
        Resolved::Missing(n) => format!("missing: the default {n}"),
        Resolved::Invalid(n) => format!("invalid: the default {n}"),
        Resolved::Capped(n) => format!("above the cap: the cap {n}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use crate::config::Config;
    use crate::key::Seed;
    use crate::runtime::{Decision, Start};
    use crate::store::MemoryStore;
    use crate::testkit::{FakeHost, Meta};

    fn runtime(json: &str) -> Runtime<MemoryStore> {
        crate::testkit::runtime(json, Seed([1, 2]))
    }

    /// The one rule of `json` explained for `host`.
    fn one(json: &str, host: &mut FakeHost) -> String {
        let rt = runtime(json);
        let e = rt.explain(host);
        assert_eq!(e.len(), 1);
        match &e[0].outcome {
            Ok(a) => {
                let parts: Vec<String> = a
                    .parts
                    .iter()
                    .map(|p| {
                        let note = p.note.map(|n| format!(" ({n})")).unwrap_or_default();
                        format!("{}={}{note}", p.part.descriptor_key(), escaped(&p.value))
                    })
                    .collect();
                format!("applies [{}]", parts.join(", "))
            }
            Err(why) => why.to_string(),
        }
    }

    fn keyed(part: &str) -> String {
        format!(
            r#"{{"rules": [{{"name": "r", "key": [{part}],
                "rate_limit": {{"requests_per_unit": 5, "unit": "minute"}}}}]}}"#
        )
    }

    #[test]
    fn missing_key_parts_say_why() {
        let header = keyed(r#""header:x-api-key""#);
        assert_eq!(
            one(&header, &mut FakeHost::new("10.0.0.1", "/")),
            "key part header:x-api-key is missing (absent)"
        );
        for empty in ["", "  ", "\t"] {
            assert_eq!(
                one(
                    &header,
                    &mut FakeHost::new("10.0.0.1", "/").header("x-api-key", empty)
                ),
                "key part header:x-api-key is missing (empty; empty values count as absent)",
                "{empty:?}"
            );
        }
        assert_eq!(
            one(
                &header,
                &mut FakeHost::new("10.0.0.1", "/").header("x-api-key", "k\u{1}é")
            ),
            "applies [header:x-api-key=k\\u{1}é]"
        );
        let query = keyed(r#""query:user""#);
        for path in ["/?user", "/?user=", "/?a=1&user=&b=2"] {
            assert_eq!(
                one(&query, &mut FakeHost::new("10.0.0.1", path)),
                "key part query:user is missing (empty; empty values count as absent)",
                "{path}"
            );
        }
        for path in ["/", "/?users=1", "/?a=1"] {
            assert_eq!(
                one(&query, &mut FakeHost::new("10.0.0.1", path)),
                "key part query:user is missing (absent)",
                "{path}"
            );
        }
        assert_eq!(
            one(&query, &mut FakeHost::new("10.0.0.1", "/?user=al%20ice")),
            "applies [query:user=al%20ice]"
        );
        let mut no_address = FakeHost::new("10.0.0.1", "/");
        no_address.req.source_address = None;
        assert_eq!(
            one(&keyed(r#""remote_address""#), &mut no_address),
            "key part remote_address is missing (absent)"
        );
        let mut no_authority = FakeHost::new("10.0.0.1", "/");
        no_authority.req.authority = None;
        assert_eq!(
            one(&keyed(r#""authority""#), &mut no_authority),
            "key part authority is missing (absent)"
        );
        // Binary values are shown escaped.
        let mut binary = FakeHost::new("10.0.0.1", "/");
        binary
            .req
            .headers
            .push(("x-api-key".into(), vec![b'a', 0xff, 0x00]));
        assert_eq!(
            one(&header, &mut binary),
            "applies [header:x-api-key=a\\xff\\x00]"
        );
    }

    #[test]
    fn clients_are_shown_as_the_network_their_key_uses() {
        let per_address = keyed(r#""remote_address""#);
        let host = |addr: &str| {
            let mut h = FakeHost::new("0.0.0.0", "/");
            h.req.source_address = Some(addr.into());
            h
        };
        assert_eq!(
            one(&per_address, &mut host("10.0.0.7:5555")),
            "applies [remote_address=10.0.0.7]"
        );
        assert_eq!(
            one(&per_address, &mut host("[2001:db8:1:2:3::1]:5555")),
            "applies [remote_address=2001:db8:1:2::/64]"
        );
        assert_eq!(
            one(&per_address, &mut host("2001:db8::9")),
            "applies [remote_address=2001:db8::/64]"
        );
        assert_eq!(
            one(&per_address, &mut host("[::ffff:10.0.0.7]:5555")),
            "applies [remote_address=10.0.0.7 (an IPv4 client seen over IPv6)]"
        );
        assert_eq!(
            one(&per_address, &mut host("not-an-ip:80")),
            "applies [remote_address=not-an-ip (not an IP address: its text is the key)]"
        );
        assert_eq!(
            one(&per_address, &mut host("10.0.0.300:1")),
            "applies [remote_address=10.0.0.300 (not an IP address: its text is the key)]"
        );
        let wide = keyed(r#"{"remote_address": {"ipv4_prefix": 24, "ipv6_prefix": 48}}"#);
        assert_eq!(
            one(&wide, &mut host("10.1.2.3:1")),
            "applies [remote_address=10.1.2.0/24]"
        );
        assert_eq!(
            one(&wide, &mut host("[2001:db8:1:2::1]:1")),
            "applies [remote_address=2001:db8:1::/48]"
        );
        assert_eq!(
            one(&wide, &mut host("[::ffff:10.1.2.3]:1")),
            "applies [remote_address=10.1.2.0/24 (an IPv4 client seen over IPv6)]"
        );
        let exact = keyed(r#"{"remote_address": {"ipv6_prefix": 128}}"#);
        assert_eq!(
            one(&exact, &mut host("[2001:db8::1]:1")),
            "applies [remote_address=2001:db8::1]"
        );
    }

    #[test]
    fn every_failing_match_condition_is_named() {
        let matching = |m: &str| {
            format!(
                r#"{{"rules": [{{"name": "r", "match": {m},
                    "rate_limit": {{"requests_per_unit": 5, "unit": "minute"}}}}]}}"#
            )
        };
        let get = |path: &str| FakeHost::new("10.0.0.1", path);
        let cases: [(&str, FakeHost, &str); 9] = [
            (
                r#"{"path": "/login"}"#,
                get("/login/x?a=1"),
                r#"match.path "/login" does not hold for path "/login/x""#,
            ),
            (
                r#"{"path_prefix": "/api/"}"#,
                get("/health?/api/"),
                r#"match.path_prefix "/api/" does not hold for path "/health""#,
            ),
            (
                r#"{"methods": ["POST", "PUT"]}"#,
                get("/"),
                r#"match.methods [POST, PUT] does not hold for method "GET""#,
            ),
            (
                r#"{"authority": "api.example.com"}"#,
                get("/"),
                r#"match.authority "api.example.com" does not hold for authority "example.com""#,
            ),
            (
                r#"{"headers": [{"name": "x-tier", "value": "free"}]}"#,
                get("/").header("x-tier", "pro"),
                r#"match.headers x-tier = "free" does not hold for header x-tier "pro""#,
            ),
            (
                r#"{"headers": [{"name": "x-tier", "value": "free"}]}"#,
                get("/"),
                r#"match.headers x-tier = "free" does not hold for a request without header x-tier"#,
            ),
            (
                r#"{"headers": [{"name": "x-api-key", "present": true}]}"#,
                get("/").header("x-api-key", " "),
                r#"match.headers x-api-key present does not hold for header x-api-key " ""#,
            ),
            (
                r#"{"headers": [{"name": "x-a", "present": true}, {"name": "x-debug", "present": false}]}"#,
                get("/").header("x-a", "1").header("x-debug", "1"),
                r#"match.headers x-debug absent does not hold for header x-debug "1""#,
            ),
            (
                r#"{"path_prefix": "/", "methods": ["GET"], "authority": "EXAMPLE.com"}"#,
                get("/"),
                "applies []",
            ),
        ];
        for (m, mut host, want) in cases {
            assert_eq!(one(&matching(m), &mut host), want, "{m}");
        }
        let mut no_path = get("/");
        no_path.req.path = None;
        assert_eq!(
            one(&matching(r#"{"path_prefix": "/"}"#), &mut no_path),
            r#"match.path_prefix "/" does not hold for a request without path"#
        );
    }

    #[test]
    fn failing_and_matches_agree() {
        let config = Config::parse(
            br#"{"rules": [{"name": "r", "match": {"path_prefix": "/a", "methods": ["GET"],
                "authority": "x.io", "headers": [{"name": "h", "value": "v"},
                {"name": "g", "present": false}]},
                "rate_limit": {"requests_per_unit": 5, "unit": "minute"}}]}"#,
        )
        .unwrap();
        let m = &config.rules[0].matcher;
        for path in ["/a", "/b"] {
            for method in ["GET", "PUT"] {
                for authority in ["x.io", "X.IO", "y.io"] {
                    for h in [None, Some(""), Some("v"), Some("w")] {
                        for g in [None, Some(""), Some("1")] {
                            let mut host = FakeHost::new("1.1.1.1", path);
                            host.req.method = Some(method.into());
                            host.req.authority = Some(authority.into());
                            if let Some(h) = h {
                                host = host.header("h", h);
                            }
                            if let Some(g) = g {
                                host = host.header("g", g);
                            }
                            let all = key::conditions(m).all(|c| c.holds(&mut host));
                            assert_eq!(key::matches(m, &mut host), all);
                            assert_eq!(key::failing(m, &mut host).is_none(), all);
                        }
                    }
                }
            }
        }
    }

    /// The rule's one applying explanation.
    fn applying<'r>(rt: &'r Runtime<MemoryStore>, host: &mut FakeHost) -> Applies<'r> {
        match rt.explain(host).remove(0).outcome {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn limits_read_from_the_request_say_where_and_what_became_of_them() {
        let rt = runtime(
            r#"{"rules": [{"name": "plan", "key": ["header:x-key"], "algorithm": "token_bucket",
                "rate_limit": {"requests_per_unit":
                    {"from": "metadata:envoy.filters.http.ext_authz:rpm", "default": 10, "max": 1000},
                    "unit": "minute"},
                "burst": {"from": "filter_state:plan.burst", "default": 20, "max": 50}}]}"#,
        );
        let host = || FakeHost::new("10.0.0.1", "/").header("x-key", "k");
        let ns = "envoy.filters.http.ext_authz";
        let shown = |a: &Applies<'_>| {
            a.carried
                .iter()
                .map(|c| {
                    let value = c.value.as_ref().map_or("none".into(), Value::to_string);
                    format!(
                        "{} from {} = {value}: {}",
                        c.number,
                        c.source,
                        resolved_text(c.resolved)
                    )
                })
                .collect::<Vec<_>>()
        };
        let a = applying(&rt, &mut host());
        assert_eq!(limit_text(&a.policy), "10 per minute, burst 20");
        assert_eq!(
            shown(&a),
            [
                "requests_per_unit from metadata:envoy.filters.http.ext_authz:rpm = none: missing: the default 10",
                "burst from filter_state:plan.burst = none: missing: the default 20",
            ]
        );
        let mut h = host()
            .metadata(ns, "rpm", Meta::Number(600.0))
            .filter_state("plan.burst", "30");
        let a = applying(&rt, &mut h);
        assert_eq!(limit_text(&a.policy), "600 per minute, burst 30");
        assert_eq!(
            shown(&a),
            [
                "requests_per_unit from metadata:envoy.filters.http.ext_authz:rpm = 600: taken",
                "burst from filter_state:plan.burst = \"30\": taken",
            ]
        );
        let mut h = host()
            .metadata(ns, "rpm", Meta::Text("lots".into()))
            .filter_state("plan.burst", "99");
        let a = applying(&rt, &mut h);
        assert_eq!(limit_text(&a.policy), "10 per minute, burst 50");
        assert_eq!(
            shown(&a),
            [
                "requests_per_unit from metadata:envoy.filters.http.ext_authz:rpm = \"lots\": invalid: the default 10",
                "burst from filter_state:plan.burst = \"99\": above the cap: the cap 50",
            ]
        );
        let mut h = host().metadata(ns, "rpm", Meta::Number(2.5e9));
        assert_eq!(
            shown(&applying(&rt, &mut h))[0],
            "requests_per_unit from metadata:envoy.filters.http.ext_authz:rpm = 2500000000: above the cap: the cap 1000"
        );

        let rt = runtime(
            r#"{"rules": [{"name": "tenant", "key": ["header:x-tenant"],
                "in_flight": {"max": {"from": "header:x-plan-max", "default": 2, "max": 8}}}]}"#,
        );
        let mut h = FakeHost::new("10.0.0.1", "/")
            .header("x-tenant", "t")
            .header("x-plan-max", "0");
        let a = applying(&rt, &mut h);
        assert_eq!(limit_text(&a.policy), "2 in flight");
        assert_eq!(
            shown(&a),
            ["in_flight.max from header:x-plan-max = \"0\": invalid: the default 2"]
        );
        let mut h = FakeHost::new("10.0.0.1", "/")
            .header("x-tenant", "t")
            .header("x-plan-max", " ");
        assert_eq!(
            shown(&applying(&rt, &mut h)),
            ["in_flight.max from header:x-plan-max = none: missing: the default 2"]
        );
    }

    #[test]
    fn costs_say_where_they_come_from() {
        let rt = runtime(
            r#"{"rules": [
                {"name": "fixed", "cost": 3, "rate_limit": {"requests_per_unit": 5, "unit": "second"}},
                {"name": "weighted", "cost": {"header": "x-cost"},
                 "rate_limit": {"requests_per_unit": 50, "unit": "second"}},
                {"name": "tokens", "cost": {"response": "header:x-tokens", "reserve": 40},
                 "rate_limit": {"requests_per_unit": 1000, "unit": "hour"}},
                {"name": "sized", "cost": {"response": "openai",
                   "reserve": {"from": "openai", "default": 64}},
                 "rate_limit": {"requests_per_unit": 1000, "unit": "hour"}}]}"#,
        );
        let costs = |host: &mut FakeHost| {
            rt.explain(host)
                .into_iter()
                .map(|e| e.outcome.unwrap().cost)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            costs(&mut FakeHost::new("10.0.0.1", "/").header("x-cost", "7")),
            [
                CostFrom::Fixed(3),
                CostFrom::Header {
                    name: "x-cost",
                    value: Some(b"7".to_vec()),
                    cost: 7
                },
                CostFrom::Reservation {
                    cost: 40,
                    sized: false,
                    priced: None
                },
                CostFrom::Reservation {
                    cost: 64,
                    sized: true,
                    priced: None
                },
            ]
        );
        let c = costs(&mut FakeHost::new("10.0.0.1", "/"));
        assert_eq!(
            c[1],
            CostFrom::Header {
                name: "x-cost",
                value: None,
                cost: 1
            }
        );
        let c = costs(&mut FakeHost::new("10.0.0.1", "/").header("x-cost", "lots"));
        assert_eq!(c[1].value(), 1);
    }

    /// The hash explain reports is the key the filter logs when it limits the request.
    #[test]
    fn the_key_is_the_one_the_filter_logs() {
        let rt = runtime(
            r#"{"rules": [{"name": "per-client", "key": ["remote_address", "header:x-api-key"],
                "rate_limit": {"requests_per_unit": 1, "unit": "minute"}}], "log_limited": "info"}"#,
        );
        let mut host = FakeHost::new("2001:db8::7", "/").header("x-api-key", "abc");
        host.req.source_address = Some("[2001:db8::7]:5555".into());
        let explained = applying(&rt, &mut host);
        for _ in 0..2 {
            let Start::Decided(_) = rt.start(&mut host) else {
                panic!("asked")
            };
        }
        let line = &host.logs[0].1;
        assert!(
            line.contains(&format!(" key={} ", key::logged(explained.hash))),
            "{line}"
        );
        // Explaining counts nothing.
        let rt = runtime(
            r#"{"rules": [{"name": "r", "rate_limit": {"requests_per_unit": 1, "unit": "minute"}}]}"#,
        );
        for _ in 0..3 {
            rt.explain(&mut host);
        }
        assert!(matches!(
            rt.start(&mut host),
            Start::Decided(Decision::Continue(_))
        ));
    }

    #[test]
    fn calendar_windows_are_named_with_their_offset() {
        let rules = Config::parse(
            br#"{"rules": [
                {"name": "m", "algorithm": "fixed_window",
                 "rate_limit": {"requests_per_unit": 9, "unit": "month", "utc_offset": "+02:00"}},
                {"name": "w", "algorithm": "fixed_window",
                 "rate_limit": {"requests_per_unit": 9, "unit": "week", "utc_offset": "-05:30"}},
                {"name": "d", "algorithm": "fixed_window",
                 "rate_limit": {"requests_per_unit": 9, "unit": "day", "utc_offset": "+14:00"}},
                {"name": "s", "rate_limit": {"requests_per_unit": 9, "unit": "week"}}]}"#,
        )
        .unwrap()
        .rules;
        let texts: Vec<String> = rules.iter().map(|r| limit_text(&r.policy())).collect();
        assert_eq!(
            texts,
            [
                "9 per month at UTC+02:00",
                "9 per week at UTC-05:30",
                // The same windows as +14:00: a day at UTC-10:00.
                "9 per day at UTC-10:00",
                "9 per week",
            ]
        );
    }
}
