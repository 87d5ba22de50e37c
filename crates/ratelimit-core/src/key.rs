//! From a request to a rule's verdict inputs: does the rule match, and which client is this?
//!
//! The request is seen through [`Attributes`], which the proxy-wasm layer implements with host
//! calls (each attribute read at most once per request) and tests implement with a plain struct.

use crate::config::{
    BodyCondition, BodyMatch, Carried, HeaderCondition, HeaderMatch, KeyPart, Match, Prefixes,
    Source,
};
pub use crate::seed::Seed;
use siphasher::sip::SipHasher13;
use std::fmt;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Feeds a length-prefixed byte string, so that ("ab","c") and ("a","bc") differ.
fn write_field(h: &mut SipHasher13, bytes: &[u8]) {
    h.write_u64(bytes.len() as u64);
    h.write(bytes);
}

/// Read access to the request attributes rules look at.
pub trait Attributes {
    /// Envoy's `source.address` (`ip:port`, `[ipv6]:port`, or a pipe path).
    fn source_address(&mut self) -> Option<&str>;
    /// The `:path` pseudo-header, query string included.
    fn path(&mut self) -> Option<&str>;
    /// The `:method` pseudo-header.
    fn method(&mut self) -> Option<&str>;
    /// The `:authority` pseudo-header (`Host` in HTTP/1.1).
    fn authority(&mut self) -> Option<&str>;
    /// A request header's value by lower-case name; values may hold any bytes.
    fn header(&mut self, name: &str) -> Option<&[u8]>;
    /// A key of Envoy's dynamic metadata under `namespace` (`None`: absent, or a host that
    /// cannot read metadata).
    fn metadata(&mut self, _namespace: &str, _key: &str) -> Option<Carried<'_>> {
        None
    }
    /// A filter state object's value as text (`None`: absent, or a host that cannot read it).
    fn filter_state(&mut self, _key: &str) -> Option<&[u8]> {
        None
    }
    /// The value of the request body field in slot `slot` of the configuration's
    /// `request_paths` (`None`: absent, or the body is not read yet or at all).
    fn body_field(&mut self, _slot: usize) -> Option<&[u8]> {
        None
    }
    /// The client's address without its port: [`strip_port`] of
    /// [`Attributes::source_address`]. A host may keep it for the request's other rules.
    fn client_address(&mut self) -> Option<&str> {
        self.source_address().map(strip_port)
    }
}

/// The address part of `ip:port` / `[ip]:port`; other forms (pipes) are returned whole.
pub fn strip_port(address: &str) -> &str {
    if let Some(rest) = address.strip_prefix('[') {
        if let Some((ip, _port)) = rest.split_once(']') {
            return ip;
        }
        return address;
    }
    // Exactly one colon, followed by digits only: IPv4 with port. More colons would be a bare
    // IPv6 address. (One pass back over the port, one over the rest: this runs per request.)
    let bytes = address.as_bytes();
    match bytes.iter().rposition(|b| !b.is_ascii_digit()) {
        Some(colon) if bytes.get(colon) == Some(&b':') => match bytes.get(..colon) {
            Some(ip) if !ip.contains(&b':') => address.get(..colon).unwrap_or(address),
            _ => address,
        },
        _ => address,
    }
}

/// A client network in a key: `[4 or 6, prefix length, masked address bytes]`. It never starts
/// with a printable byte, so it cannot be mistaken for an address as text. The one exception is
/// an IPv4 client seen through an IPv6 socket and keyed per address: its address as text, the
/// key the same client has over IPv4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    bytes: [u8; 18],
    len: usize,
}

impl Network {
    /// The bytes a key is made of.
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or(&self.bytes)
    }

    /// Reads [`Network::as_bytes`] back; `None` for anything else (an address as text).
    fn from_bytes(bytes: &[u8]) -> Option<IpNetwork> {
        match bytes {
            [4, prefix, a, b, c, d] => Some((IpAddr::V4(Ipv4Addr::new(*a, *b, *c, *d)), *prefix)),
            [6, prefix, rest @ ..] => {
                let octets: [u8; 16] = rest.try_into().ok()?;
                Some((IpAddr::V6(Ipv6Addr::from(octets)), *prefix))
            }
            _ => None,
        }
    }
}

type IpNetwork = (IpAddr, u8);

/// Keeps the first `prefix` bits of `octets`.
fn mask(octets: &mut [u8], prefix: u8) {
    for (i, byte) in octets.iter_mut().enumerate() {
        let keep = usize::from(prefix).saturating_sub(i * 8).min(8);
        *byte &= !(0xffu8.checked_shr(keep as u32).unwrap_or(0));
    }
}

/// The network an address (without its port) is keyed by, or `None` when the address is its
/// own key: an IPv4 address keyed per address (as text, as keys have always been), or not an IP
/// address at all (a pipe). IPv4 clients seen through an IPv6 socket (`::ffff:a.b.c.d`) are
/// IPv4 clients.
pub fn network(address: &str, prefixes: Prefixes) -> Option<Network> {
    if prefixes.v4 >= 32 && !address.as_bytes().contains(&b':') {
        return None; // the common case, without parsing
    }
    let ip: IpAddr = address.parse().ok()?;
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let mut out = Network {
        bytes: [0; 18],
        len: 0,
    };
    if let (IpAddr::V4(v4), true) = (ip, prefixes.v4 >= 32) {
        // Seen through an IPv6 socket and keyed per address: the key a plain IPv4 client has,
        // its address as text (at most 15 bytes).
        let mut text = std::io::Cursor::new(&mut out.bytes[..]);
        std::io::Write::write_fmt(&mut text, format_args!("{v4}")).ok()?;
        out.len = usize::try_from(text.position()).ok()?;
        return Some(out);
    }
    let (version, prefix, octets): (u8, u8, &[u8]) = match &ip {
        IpAddr::V4(v4) => (4, prefixes.v4.min(32), &v4.octets()[..]),
        IpAddr::V6(v6) => (6, prefixes.v6.min(128), &v6.octets()[..]),
    };
    let (head, body) = out.bytes.split_at_mut(2);
    head.copy_from_slice(&[version, prefix]);
    let body = body.get_mut(..octets.len())?;
    body.copy_from_slice(octets);
    mask(body, prefix);
    out.len = 2 + octets.len();
    Some(out)
}

/// A key part's value as a rate limit service sees it: a network as `a.b.c.0/24` or
/// `2001:db8:1:2::/64` (a whole address without `/n`), anything else as it is.
fn descriptor_value(value: &[u8]) -> Vec<u8> {
    match Network::from_bytes(value) {
        Some((ip @ IpAddr::V4(_), 32)) | Some((ip @ IpAddr::V6(_), 128)) => {
            ip.to_string().into_bytes()
        }
        Some((ip, prefix)) => format!("{ip}/{prefix}").into_bytes(),
        None => value.to_vec(),
    }
}

/// Splits `:path` into the path and the query string (without `?`).
pub fn split_path(full: &str) -> (&str, Option<&str>) {
    // A fragment should never reach a proxy, but if one does it is not part of the query.
    let full = full.split_once('#').map_or(full, |(p, _)| p);
    match full.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (full, None),
    }
}

/// The raw value of the first query parameter called `name` (`a` alone counts as `a=`).
pub fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

/// A value as rules see it: an empty (or whitespace-only) header or query value counts as
/// absent. Envoy strips the whitespace around header values, and the proxy-wasm host reports an
/// empty header as missing, so this is the one meaning both builds can give.
pub fn present(value: Option<&[u8]>) -> Option<&[u8]> {
    value.filter(|v| !v.trim_ascii().is_empty())
}

/// One condition of a rule's `match`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition<'m> {
    /// `path`: the path, without the query string, equals this.
    Path(&'m str),
    /// `path_prefix`: the path, without the query string, starts with this.
    PathPrefix(&'m str),
    /// `methods`: the method is one of these.
    Methods(&'m [String]),
    /// `authority`: the authority equals this, case-insensitively.
    Authority(&'m str),
    /// One of `headers`.
    Header(&'m HeaderMatch),
    /// One of `body`: a field of the request's JSON body.
    Body(&'m BodyMatch),
}

impl Condition<'_> {
    /// Whether the condition holds for the request.
    pub fn holds(&self, req: &mut impl Attributes) -> bool {
        match *self {
            Condition::Path(want) => req.path().is_some_and(|p| split_path(p).0 == want),
            Condition::PathPrefix(want) => req
                .path()
                .is_some_and(|p| split_path(p).0.starts_with(want)),
            Condition::Methods(want) => req.method().is_some_and(|m| want.iter().any(|x| x == m)),
            Condition::Authority(want) => req
                .authority()
                .is_some_and(|a| a.eq_ignore_ascii_case(want)),
            Condition::Header(h) => {
                let value = present(req.header(&h.name));
                match &h.condition {
                    HeaderCondition::Present(present) => value.is_some() == *present,
                    HeaderCondition::Equals(want) => value == Some(want.as_bytes()),
                }
            }
            Condition::Body(b) => req
                .body_field(b.field.slot)
                .is_some_and(|v| b.condition.holds(v)),
        }
    }
}

impl fmt::Display for Condition<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Condition::Path(p) => write!(f, "match.path {p:?}"),
            Condition::PathPrefix(p) => write!(f, "match.path_prefix {p:?}"),
            Condition::Methods(m) => write!(f, "match.methods [{}]", m.join(", ")),
            Condition::Authority(a) => write!(f, "match.authority {a:?}"),
            Condition::Header(h) => match &h.condition {
                HeaderCondition::Equals(v) => write!(f, "match.headers {} = {v:?}", h.name),
                HeaderCondition::Present(true) => write!(f, "match.headers {} present", h.name),
                HeaderCondition::Present(false) => write!(f, "match.headers {} absent", h.name),
            },
            Condition::Body(b) => {
                let field = b.field.path.join(".");
                match &b.condition {
                    BodyCondition::Equals(v) => write!(f, "match.body {field} = {v:?}"),
                    BodyCondition::Prefix(p) => write!(f, "match.body {field} starts with {p:?}"),
                    BodyCondition::OneOf(list) => {
                        write!(f, "match.body {field} one of [{}]", list.join(", "))
                    }
                }
            }
        }
    }
}

/// The conditions of `m`, in the order they are checked.
pub fn conditions(m: &Match) -> impl Iterator<Item = Condition<'_>> {
    let methods = (!m.methods.is_empty()).then_some(Condition::Methods(&m.methods));
    m.path
        .as_deref()
        .map(Condition::Path)
        .into_iter()
        .chain(m.path_prefix.as_deref().map(Condition::PathPrefix))
        .chain(methods)
        .chain(m.authority.as_deref().map(Condition::Authority))
        .chain(m.headers.iter().map(Condition::Header))
        .chain(m.body.iter().map(Condition::Body))
}

/// The first condition of `m` that does not hold for the request, leaving out those on its
/// body (not read yet): if one fails, the rule cannot apply whatever the body says.
pub fn failing_before_body<'m>(m: &'m Match, req: &mut impl Attributes) -> Option<Condition<'m>> {
    conditions(m).find(|c| !matches!(c, Condition::Body(_)) && !c.holds(req))
}

/// The first condition of `m` that does not hold for the request (`None`: `m` matches).
pub fn failing<'m>(m: &'m Match, req: &mut impl Attributes) -> Option<Condition<'m>> {
    conditions(m).find(|c| !c.holds(req))
}

/// Whether every condition of `m` holds for the request: [`failing`] finds none.
pub fn matches(m: &Match, req: &mut impl Attributes) -> bool {
    failing(m, req).is_none()
}

/// A client-key hash as the filter's `limited rule=… key=…` line prints it: the table's
/// fingerprint of it ([`crate::table::fingerprint_of`]), the value an operator passes to the
/// endpoints; the one formatting of a key that an operator sees.
pub fn logged(hash: u64) -> impl fmt::Display {
    Logged(crate::table::fingerprint_of(hash))
}

/// See [`logged`].
struct Logged(u64);

impl fmt::Display for Logged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The most bytes of one key part that are hashed (with the part's full length): longer values
/// sharing their first 4 KiB share a counter. Bounds the hashing work a client can cause.
pub const MAX_KEY_PART: usize = 4096;

/// Feeds one key part: its full length, then at most [`MAX_KEY_PART`] bytes of it.
fn write_part(h: &mut SipHasher13, value: &[u8]) {
    h.write_u64(value.len() as u64);
    h.write(value.get(..MAX_KEY_PART).unwrap_or(value));
}

/// The fingerprint of one rule, mixed into every key hash so rules never share a counter.
/// Rules keep their fingerprint (and so their counters) across config reloads as long as their
/// name, key parts and algorithm stay the same; limits may change.
pub fn rule_fingerprint(seed: Seed, name: &str, key: &[KeyPart], algorithm: &str) -> u64 {
    let mut h = seed.hasher();
    write_field(&mut h, name.as_bytes());
    write_field(&mut h, algorithm.as_bytes());
    for part in key {
        write_field(&mut h, part.to_string().as_bytes());
    }
    h.finish()
}

/// The token of an `Authorization` value of the `Bearer` scheme (any case), without the
/// scheme and the spaces around it; `None` for any other scheme or an empty token.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let scheme = value.get(..6)?;
    let rest = value.get(6..)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.first()?.is_ascii_whitespace() {
        return None;
    }
    present(Some(rest.trim_ascii()))
}

/// Calls `f` with one key part's value and returns `true`, or returns `false` when the
/// request lacks it. The authority is lower-cased. (Generic, so that a plain part's value
/// goes straight to the hasher; a `first` part goes through [`first_value`], whose callback
/// is a trait object, as it calls this again for each of its parts.)
fn part_value<F: FnMut(&[u8]) + ?Sized>(
    part: &KeyPart,
    req: &mut impl Attributes,
    f: &mut F,
) -> bool {
    let value = match part {
        KeyPart::RemoteAddress(prefixes) => {
            let Some(address) = req.client_address() else {
                return false;
            };
            match network(address, *prefixes) {
                Some(net) => f(net.as_bytes()),
                None => f(address.as_bytes()),
            }
            return true;
        }
        KeyPart::Header(name) => present(req.header(name)),
        KeyPart::Bearer => req.header("authorization").and_then(bearer_token),
        KeyPart::Body(field) => present(req.body_field(field.slot)),
        KeyPart::Query(name) => req
            .path()
            .and_then(|p| split_path(p).1)
            .and_then(|q| present(query_param(q, name).map(str::as_bytes))),
        KeyPart::Path => req.path().map(|p| split_path(p).0.as_bytes()),
        KeyPart::Method => req.method().map(str::as_bytes),
        KeyPart::Authority => {
            let Some(a) = req.authority() else {
                return false;
            };
            if a.bytes().any(|b| b.is_ascii_uppercase()) {
                f(a.to_ascii_lowercase().as_bytes());
            } else {
                f(a.as_bytes());
            }
            return true;
        }
        KeyPart::First(parts) => return first_value(parts, req, &mut |v: &[u8]| f(v)),
    };
    match value {
        Some(v) => {
            f(v);
            true
        }
        None => false,
    }
}

/// [`part_value`] of a `first` part: the first of `parts` the request has.
fn first_value(parts: &[KeyPart], req: &mut impl Attributes, f: &mut dyn FnMut(&[u8])) -> bool {
    if !parts.iter().any(|p| matches!(p, KeyPart::RemoteAddress(_))) {
        return parts.iter().any(|p| part_value(p, req, f));
    }
    // A text beside a network: a text that could read as a network's bytes (or as an
    // escaped text) gets a 0 byte before it, so that no header or body value shares a
    // network's counter or is sent to a rate limit service as one.
    parts.iter().any(|p| match p {
        KeyPart::RemoteAddress(_) => part_value(p, req, f),
        _ => part_value(p, req, &mut |v: &[u8]| match v.first() {
            Some(0 | 4 | 6) => f(&[&[0u8][..], v].concat()),
            _ => f(v),
        }),
    })
}

/// Calls `f` with each key part's value, in order, `None` for a part the request lacks when
/// `shared` (a rule whose `on_missing_key` is `shared`); otherwise `None` as soon as a part is
/// missing (the rule then does not apply). The authority is lower-cased.
pub fn visit_parts(
    parts: &[KeyPart],
    req: &mut impl Attributes,
    shared: bool,
    mut f: impl FnMut(&KeyPart, Option<&[u8]>),
) -> Option<()> {
    for part in parts {
        if !part_value(part, req, &mut |v| f(part, Some(v))) {
            if !shared {
                return None;
            }
            f(part, None);
        }
    }
    Some(())
}

/// The bits of a client-key hash that carry its rule's tag ([`rule_tag`]): the top 16.
pub const TAG_MASK: u64 = 0xffff << TAG_SHIFT;
/// Where the rule's tag starts in a client-key hash.
const TAG_SHIFT: u32 = 48;

/// The tag every client-key hash of a rule carries in its top 16 bits: the top 16 bits of the
/// rule's fingerprint ([`rule_fingerprint`]). The table's entries of all rules share its buckets;
/// the tag is what tells an operator's scan which entries are one rule's keys. Two rules of a
/// configuration share a tag with odds of 1 in 65,536 per pair; a scan of either then also
/// lists the other's keys that have the same algorithm's state (nothing else goes wrong: a key
/// is still looked up by its whole hash).
pub fn rule_tag(rule_fingerprint: u64) -> u64 {
    rule_fingerprint & TAG_MASK
}

/// The 64-bit hash of the client key of a rule for this request, or `None` when a key part is
/// missing from the request (the rule then does not apply). The raw key is never kept.
///
/// The top 16 bits are the rule's tag ([`rule_tag`]), the other 48 the keyed SipHash of the
/// rule and the key's parts (47 of them in the table's fingerprint,
/// [`crate::table::fingerprint_of`]): two keys of one rule collide with odds of 1 in 2^47 per
/// pair.
///
/// `shared` (a rule whose `on_missing_key` is `shared`): a missing part counts as one value of
/// its own, which no value a request carries can equal.
pub fn client_key(
    seed: Seed,
    rule_fingerprint: u64,
    parts: &[KeyPart],
    shared: bool,
    req: &mut impl Attributes,
) -> Option<u64> {
    let mut h = seed.hasher();
    h.write_u64(rule_fingerprint);
    visit_parts(parts, req, shared, |_, value| match value {
        Some(value) => write_part(&mut h, value),
        None => h.write_u64(MISSING_PART),
    })?;
    Some(rule_tag(rule_fingerprint) | h.finish() >> (64 - TAG_SHIFT))
}

/// The seed of [`fleet_id`]: the same in every Envoy, and public.
const FLEET_SEED: Seed = Seed([0x6661_6972_2d66_6c65, 0x6574_2d74_656e_616e]);

/// A tenant's name in a rate limit service's counters for a fleet-fair shared rule
/// ([`crate::share::fair_record`]): a hash of the rule's name and the key's parts that every
/// Envoy computes alike (its seed is fixed, unlike [`client_key`]'s), so that the tenant's
/// counters add up over the fleet without its key (an API key, say) leaving the Envoy. `None`
/// when a key part is missing (as [`client_key`]). Being public, the seed lets a client craft
/// a key whose name another tenant's has: both then count as one tenant's demand in the fleet.
pub fn fleet_id(
    rule: &str,
    parts: &[KeyPart],
    shared: bool,
    req: &mut impl Attributes,
) -> Option<u64> {
    let mut h = FLEET_SEED.hasher();
    write_field(&mut h, rule.as_bytes());
    visit_parts(parts, req, shared, |_, value| match value {
        Some(value) => write_part(&mut h, value),
        None => h.write_u64(MISSING_PART),
    })?;
    Some(h.finish())
}

/// What a missing part of a `shared` key hashes as: a length no value has.
const MISSING_PART: u64 = u64::MAX;

/// What a rate limit service is sent for a missing part of a `shared` key.
pub const MISSING_VALUE: &str = "(missing)";

/// The first key part missing from the request, if any (the reason a rule does not apply).
pub fn missing_part<'p>(parts: &'p [KeyPart], req: &mut impl Attributes) -> Option<&'p KeyPart> {
    parts
        .iter()
        .find(|&part| !part_value(part, req, &mut |_| {}))
}

/// The value a request carries at `source`, as the host reads it.
pub fn carried<'a>(source: &Source, req: &'a mut impl Attributes) -> Option<Carried<'a>> {
    match source {
        Source::Header(name) => present(req.header(name)).map(Carried::Text),
        // An empty (or blank) string is absent, as an empty header is.
        Source::Metadata { namespace, key } => req
            .metadata(namespace, key)
            .filter(|c| !matches!(c, Carried::Text(t) if t.trim_ascii().is_empty())),
        Source::FilterState(key) => present(req.filter_state(key)).map(Carried::Text),
    }
}

/// A key part's value (`None`: missing, under `on_missing_key: shared`) as a rate limit service
/// is sent it: a network as `a.b.c.0/24`, a missing part as [`MISSING_VALUE`].
pub fn descriptor_value_of(part: &KeyPart, value: Option<&[u8]>) -> Vec<u8> {
    match (part, value) {
        (_, None) => MISSING_VALUE.as_bytes().to_vec(),
        (KeyPart::RemoteAddress(_), Some(value)) => descriptor_value(value),
        (KeyPart::First(parts), Some(value))
            if parts.iter().any(|p| matches!(p, KeyPart::RemoteAddress(_))) =>
        {
            match value {
                // A text escaped beside a network (see `part_value`): sent as it came.
                [0, text @ ..] => text.to_vec(),
                _ => descriptor_value(value),
            }
        }
        (_, Some(value)) => value.to_vec(),
    }
}

/// A rate limit service descriptor: (entry key, raw value) pairs.
pub type Descriptor = Vec<(String, Vec<u8>)>;

/// The entries of a rate limit service descriptor for a rule: `("rule", name)`, then each key
/// part as `(part, raw value)` (e.g. `("remote_address", "10.0.0.1")`,
/// `("header:x-api-key", …)`). `None` when a key part is missing, unless `shared`: a missing
/// part is then sent as [`MISSING_VALUE`].
pub fn descriptor_entries(
    rule: &str,
    parts: &[KeyPart],
    shared: bool,
    req: &mut impl Attributes,
) -> Option<Descriptor> {
    let mut entries = vec![("rule".to_string(), rule.as_bytes().to_vec())];
    visit_parts(parts, req, shared, |part, value| {
        let value = descriptor_value_of(part, value);
        entries.push((part.descriptor_key(), value))
    })?;
    Some(entries)
}

/// A request made of plain fields: one read from an access log (replay), or made up (tests).
#[derive(Clone, Debug, Default)]
pub struct PlainRequest {
    /// `source.address`.
    pub source_address: Option<String>,
    /// `:path`.
    pub path: Option<String>,
    /// `:method`.
    pub method: Option<String>,
    /// `:authority`.
    pub authority: Option<String>,
    /// Lower-case header names and values.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Dynamic metadata: (namespace, key, value).
    pub metadata: Vec<(String, String, Meta)>,
    /// Filter state objects: (key, value).
    pub filter_state: Vec<(String, Vec<u8>)>,
    /// Request body fields: (slot in the configuration's `request_paths`, value).
    pub body: Vec<(usize, Vec<u8>)>,
}

/// A dynamic metadata value of a [`PlainRequest`].
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    /// A number.
    Number(f64),
    /// A string.
    Text(String),
}

impl Attributes for PlainRequest {
    fn source_address(&mut self) -> Option<&str> {
        self.source_address.as_deref()
    }
    fn path(&mut self) -> Option<&str> {
        self.path.as_deref()
    }
    fn method(&mut self) -> Option<&str> {
        self.method.as_deref()
    }
    fn authority(&mut self) -> Option<&str> {
        self.authority.as_deref()
    }
    fn header(&mut self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
    fn metadata(&mut self, namespace: &str, key: &str) -> Option<Carried<'_>> {
        self.metadata
            .iter()
            .find(|(n, k, _)| n == namespace && k == key)
            .map(|(_, _, v)| match v {
                Meta::Number(x) => Carried::Number(*x),
                Meta::Text(t) => Carried::Text(t.as_bytes()),
            })
    }
    fn filter_state(&mut self, key: &str) -> Option<&[u8]> {
        self.filter_state
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }
    fn body_field(&mut self, slot: usize) -> Option<&[u8]> {
        self.body
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, v)| v.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HeaderMatch, DEFAULT_PREFIXES};

    impl PlainRequest {
        fn header_value(mut self, name: &str, value: &str) -> PlainRequest {
            self.headers.push((name.into(), value.as_bytes().to_vec()));
            self
        }
    }

    fn req(addr: &str, path: &str) -> PlainRequest {
        PlainRequest {
            source_address: Some(addr.into()),
            path: Some(path.into()),
            method: Some("GET".into()),
            authority: Some("Example.COM".into()),
            headers: vec![("x-api-key".into(), b"k1".to_vec())],
            ..PlainRequest::default()
        }
    }

    #[test]
    fn a_seed_reads_back_from_its_hex() {
        let seed = Seed([0x0011_2233_4455_6677, 0x8899_aabb_ccdd_eeff]);
        assert_eq!(seed.to_hex(), "00112233445566778899aabbccddeeff");
        assert_eq!(Seed::parse_hex(&seed.to_hex()), Some(seed));
        assert_eq!(
            Seed::parse_hex("00112233445566778899AABBCCDDEEFF"),
            Some(seed)
        );
        for bad in [
            "",
            "0011",
            "00112233445566778899aabbccddeefg",
            "+0112233445566778899aabbccddeeff",
            "00112233445566778899aabbccddeeff0",
        ] {
            assert_eq!(Seed::parse_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_bearer_token_is_the_value_without_its_scheme() {
        for (value, token) in [
            ("Bearer sk-1", Some("sk-1")),
            ("bearer   sk-1 ", Some("sk-1")),
            ("BEARER\tsk-1", Some("sk-1")),
            ("Bearer", None),
            ("Bearer   ", None),
            ("Bearersk-1", None),
            ("Basic c2stMQ==", None),
            ("sk-1", None),
            ("", None),
        ] {
            assert_eq!(
                bearer_token(value.as_bytes()),
                token.map(str::as_bytes),
                "{value:?}"
            );
        }
    }

    #[test]
    fn first_keys_the_value_whichever_part_carries_it() {
        let first = vec![KeyPart::First(vec![
            KeyPart::Header("x-api-key".into()),
            KeyPart::Bearer,
        ])];
        let seed = Seed([3, 4]);
        let key = |r: &mut PlainRequest| client_key(seed, 9, &first, false, r);
        let mut by_header = req("10.0.0.1:1", "/");
        let mut by_bearer = PlainRequest {
            headers: vec![("authorization".into(), b"Bearer k1".to_vec())],
            ..req("10.0.0.2:1", "/")
        };
        assert_eq!(key(&mut by_header), key(&mut by_bearer));
        assert!(key(&mut by_header).is_some());
        // The header is first: a bearer token beside it does not change the key.
        by_bearer.headers.push(("x-api-key".into(), b"k2".to_vec()));
        assert_ne!(key(&mut by_header), key(&mut by_bearer));
        // Neither: missing, unless shared; the shared value is no value's.
        let mut neither = PlainRequest {
            headers: Vec::new(),
            ..req("10.0.0.3:1", "/")
        };
        assert_eq!(key(&mut neither), None);
        assert_eq!(missing_part(&first, &mut neither), first.first());
        let shared = client_key(seed, 9, &first, true, &mut neither);
        assert!(shared.is_some());
        let with_key = |v: &str| PlainRequest {
            headers: vec![("x-api-key".into(), v.as_bytes().to_vec())],
            ..req("10.0.0.3:1", "/")
        };
        for v in ["(missing)", "k1", "-"] {
            assert_ne!(
                client_key(seed, 9, &first, true, &mut with_key(v)),
                shared,
                "{v:?}"
            );
        }
        // An empty value is no value: it shares the missing key.
        assert_eq!(
            client_key(seed, 9, &first, true, &mut with_key(" ")),
            shared
        );
        assert_eq!(
            descriptor_entries("r", &first, true, &mut neither).unwrap()[1],
            (
                "first(header:x-api-key, bearer)".to_string(),
                MISSING_VALUE.as_bytes().to_vec()
            )
        );
        // A first part with the client address sends it as a network.
        let net = vec![KeyPart::First(vec![
            KeyPart::Header("x-user".into()),
            KeyPart::RemoteAddress(Prefixes { v4: 24, v6: 64 }),
        ])];
        assert_eq!(
            descriptor_entries("r", &net, false, &mut req("10.1.2.3:1", "/")).unwrap()[1].1,
            b"10.1.2.0/24".to_vec()
        );
        // A value made of a network's bytes neither shares that network's counter nor is sent
        // as a network; nor does its escaped form share another value's (found by the keys fuzz
        // target).
        let from_network = client_key(seed, 9, &net, false, &mut req("10.1.2.3:1", "/"));
        let user = |v: &[u8]| PlainRequest {
            headers: vec![("x-user".into(), v.to_vec())],
            ..req("10.9.9.9:1", "/")
        };
        let forged = [4u8, 24, 10, 1, 2, 0];
        let key_of = |v: &[u8]| client_key(seed, 9, &net, false, &mut user(v));
        assert_ne!(key_of(&forged), from_network);
        assert_ne!(key_of(&[0, 4, 24, 10, 1, 2, 0]), key_of(&forged));
        assert_ne!(key_of(&[0]), key_of(&[0, 0]));
        for v in [&forged[..], &[0, 4, 1][..], &[6, 64][..], b"plain"] {
            assert_eq!(
                descriptor_entries("r", &net, false, &mut user(v)).unwrap()[1].1,
                v.to_vec()
            );
        }
    }

    #[test]
    fn strips_ports() {
        assert_eq!(strip_port("127.0.0.1:42122"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:8080"), "::1");
        assert_eq!(strip_port("::1"), "::1");
        assert_eq!(strip_port("/tmp/sock"), "/tmp/sock");
        assert_eq!(strip_port("[broken"), "[broken");
    }

    /// The byte scan gives what splitting at the last colon gave, for every string of up to six
    /// characters over the ones that matter.
    #[test]
    fn strip_port_is_the_split_at_the_last_colon() {
        fn reference(address: &str) -> &str {
            if let Some(rest) = address.strip_prefix('[') {
                return rest.split_once(']').map_or(address, |(ip, _)| ip);
            }
            match address.rsplit_once(':') {
                Some((ip, port))
                    if !ip.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    ip
                }
                _ => address,
            }
        }
        let alphabet = ['1', '0', ':', '.', 'a', '[', ']', '/', 'é'];
        let mut words = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = words
                .iter()
                .filter(|w| w.chars().count() == words.last().map_or(0, |l| l.chars().count()))
                .flat_map(|w| alphabet.iter().map(move |c| format!("{w}{c}")))
                .collect();
            words.extend(longer);
        }
        assert!(words.len() > 500_000);
        for w in &words {
            assert_eq!(strip_port(w), reference(w), "{w:?}");
        }
    }

    #[test]
    fn query_params() {
        assert_eq!(query_param("a=1&b=2&a=3", "a"), Some("1"));
        assert_eq!(query_param("flag&b=2", "flag"), Some(""));
        assert_eq!(query_param("ab=1", "a"), None);
        assert_eq!(split_path("/x?y=1#frag"), ("/x", Some("y=1")));
        assert_eq!(split_path("/x"), ("/x", None));
    }

    #[test]
    fn matching() {
        let mut m = Match {
            path_prefix: Some("/api/".into()),
            methods: vec!["GET".into(), "POST".into()],
            authority: Some("example.com".into()),
            headers: vec![
                HeaderMatch {
                    name: "x-api-key".into(),
                    condition: HeaderCondition::Present(true),
                },
                HeaderMatch {
                    name: "x-debug".into(),
                    condition: HeaderCondition::Present(false),
                },
            ],
            ..Match::default()
        };
        assert!(matches(&m, &mut req("1.2.3.4:1", "/api/v1?q=/x")));
        assert!(!matches(&m, &mut req("1.2.3.4:1", "/apix")));
        // The query is not part of the path.
        assert!(!matches(&m, &mut req("1.2.3.4:1", "/other?/api/")));
        let mut r = req("1.2.3.4:1", "/api/");
        r.method = Some("DELETE".into());
        assert!(!matches(&m, &mut r));
        let mut r = req("1.2.3.4:1", "/api/");
        r.headers.push(("x-debug".into(), b"1".to_vec()));
        assert!(!matches(&m, &mut r));
        m.headers = vec![HeaderMatch {
            name: "x-api-key".into(),
            condition: HeaderCondition::Equals("k2".into()),
        }];
        assert!(!matches(&m, &mut req("1.2.3.4:1", "/api/")));
        m.path_prefix = None;
        m.path = Some("/login".into());
        m.headers.clear();
        assert!(matches(&m, &mut req("1.2.3.4:1", "/login?next=/")));
        assert!(!matches(&m, &mut req("1.2.3.4:1", "/login/x")));
        assert!(matches(&Match::default(), &mut PlainRequest::default()));
    }

    #[test]
    fn keys_separate_clients_and_rules() {
        let seed = Seed([3, 4]);
        let parts = [
            KeyPart::RemoteAddress(DEFAULT_PREFIXES),
            KeyPart::Header("x-api-key".into()),
        ];
        let fp = rule_fingerprint(seed, "r", &parts, "sliding_window");
        let k = |r: &mut PlainRequest| client_key(seed, fp, &parts, false, r);
        // Same address, other port: same client.
        assert_eq!(
            k(&mut req("10.0.0.1:1", "/")),
            k(&mut req("10.0.0.1:2", "/a"))
        );
        assert_ne!(
            k(&mut req("10.0.0.1:1", "/")),
            k(&mut req("10.0.0.2:1", "/"))
        );
        let mut other_key = req("10.0.0.1:1", "/");
        other_key.headers[0].1 = b"k2".to_vec();
        assert_ne!(k(&mut req("10.0.0.1:1", "/")), k(&mut other_key));
        // A missing part: the rule does not apply.
        let mut no_key = req("10.0.0.1:1", "/");
        no_key.headers.clear();
        assert_eq!(k(&mut no_key), None);
        // Another algorithm, or another rule with the same parts, never shares a counter.
        assert_ne!(rule_fingerprint(seed, "r", &parts, "token_bucket"), fp);
        let fp2 = rule_fingerprint(seed, "r2", &parts, "sliding_window");
        assert_ne!(
            client_key(seed, fp2, &parts, false, &mut req("10.0.0.1:1", "/")),
            k(&mut req("10.0.0.1:1", "/"))
        );
        // The descriptor carries the raw values, in order.
        let entries = descriptor_entries("r", &parts, false, &mut req("10.0.0.1:9", "/")).unwrap();
        assert_eq!(
            entries,
            [
                ("rule".to_string(), b"r".to_vec()),
                ("remote_address".to_string(), b"10.0.0.1".to_vec()),
                ("header:x-api-key".to_string(), b"k1".to_vec()),
            ]
        );
        assert_eq!(
            descriptor_entries("r", &parts, false, &mut no_key.clone()),
            None
        );
        // Huge values: hashed up to 4 KiB plus their length.
        let mut huge = req("10.0.0.1:1", "/");
        huge.headers[0].1 = vec![b'a'; 1 << 20];
        let mut huge2 = huge.clone();
        huge2.headers[0].1[MAX_KEY_PART] = b'b';
        assert_eq!(k(&mut huge), k(&mut huge2), "past the cap");
        huge2.headers[0].1[MAX_KEY_PART - 1] = b'b';
        assert_ne!(k(&mut huge), k(&mut huge2), "within the cap");
        huge2.headers[0].1.push(b'a');
        assert_ne!(k(&mut huge), k(&mut huge2), "the length counts");
        // Non-UTF-8 header bytes are fine.
        let mut binary = req("10.0.0.1:1", "/");
        binary.headers[0].1 = vec![0xff, 0x00, 0x80];
        assert!(k(&mut binary).is_some());
    }

    #[test]
    fn seeds_change_hashes_and_round_trip() {
        let parts = [KeyPart::RemoteAddress(DEFAULT_PREFIXES)];
        let r = &mut req("10.0.0.1:1", "/");
        assert_ne!(
            client_key(Seed([1, 2]), 0, &parts, false, r),
            client_key(Seed([1, 3]), 0, &parts, false, r)
        );
        let s = Seed([0x0102_0304_0506_0708, u64::MAX]);
        assert_eq!(Seed::from_bytes(&s.to_bytes()), Some(s));
        assert_eq!(Seed::from_bytes(&[1, 2, 3]), None);
        assert_ne!(Seed::random(), Seed::random());
        // SipHash-1-3 as std's `DefaultHasher` (a zero key) computes it.
        let mut ours = Seed([0, 0]).hasher();
        let mut std = std::collections::hash_map::DefaultHasher::new();
        ours.write(b"10.0.0.1");
        std.write(b"10.0.0.1");
        assert_eq!(ours.finish(), std.finish());
    }

    #[test]
    fn empty_values_count_as_absent() {
        let m = |condition| Match {
            headers: vec![HeaderMatch {
                name: "x-k".into(),
                condition,
            }],
            ..Match::default()
        };
        let parts = [KeyPart::Header("x-k".into())];
        for value in ["", "  ", "\t"] {
            let mut r = req("1.1.1.1:1", "/").header_value("x-k", value);
            assert!(!matches(&m(HeaderCondition::Present(true)), &mut r));
            assert!(matches(&m(HeaderCondition::Present(false)), &mut r));
            assert_eq!(
                client_key(Seed([1, 1]), 0, &parts, false, &mut r),
                None,
                "{value:?}"
            );
        }
        let mut r = req("1.1.1.1:1", "/").header_value("x-k", "v");
        assert!(matches(&m(HeaderCondition::Present(true)), &mut r));
        let q = [KeyPart::Query("k".into())];
        for path in ["/?k", "/?k=", "/?a=1&k=&b=2"] {
            assert_eq!(
                client_key(Seed([1, 1]), 0, &q, false, &mut req("1.1.1.1:1", path)),
                None,
                "{path}"
            );
        }
        assert!(client_key(Seed([1, 1]), 0, &q, false, &mut req("1.1.1.1:1", "/?k=v")).is_some());
    }

    #[test]
    fn key_parts_read_the_right_attribute() {
        let seed = Seed([5, 6]);
        let one = |part: KeyPart, r: &mut PlainRequest| {
            let parts = [part];
            client_key(seed, 0, &parts, false, r)
        };
        let a = &mut req("1.1.1.1:1", "/p?user=alice&x=1");
        let b = &mut req("1.1.1.1:1", "/p?user=bob&x=1");
        assert_ne!(
            one(KeyPart::Query("user".into()), a),
            one(KeyPart::Query("user".into()), b)
        );
        assert_eq!(one(KeyPart::Path, a), one(KeyPart::Path, b));
        assert_eq!(one(KeyPart::Query("nope".into()), a), None);
        let mut upper = req("1.1.1.1:1", "/");
        upper.authority = Some("EXAMPLE.com".into());
        assert_eq!(
            one(KeyPart::Authority, &mut upper),
            one(KeyPart::Authority, a)
        );
        let mut post = req("1.1.1.1:1", "/");
        post.method = Some("POST".into());
        assert_ne!(one(KeyPart::Method, &mut post), one(KeyPart::Method, a));
    }

    #[test]
    fn clients_are_keyed_by_network() {
        let seed = Seed([7, 8]);
        let key = |prefixes: Prefixes, addr: &str| {
            let parts = [KeyPart::RemoteAddress(prefixes)];
            client_key(seed, 1, &parts, false, &mut req(addr, "/"))
        };
        let d = DEFAULT_PREFIXES;
        // IPv4 per address by default, IPv6 per /64.
        assert_ne!(key(d, "10.1.2.3:1"), key(d, "10.1.2.4:1"));
        assert_eq!(
            key(d, "[2001:db8:1:2::1]:1"),
            key(d, "[2001:db8:1:2:ffff::9]:7")
        );
        assert_ne!(key(d, "[2001:db8:1:2::1]:1"), key(d, "[2001:db8:1:3::1]:1"));
        // /24 and /48.
        let wide = Prefixes { v4: 24, v6: 48 };
        assert_eq!(key(wide, "10.1.2.3:1"), key(wide, "10.1.2.250:9"));
        assert_ne!(key(wide, "10.1.2.3:1"), key(wide, "10.1.3.3:1"));
        assert_eq!(
            key(wide, "[2001:db8:1:2::1]:1"),
            key(wide, "[2001:db8:1:ff::1]:1")
        );
        assert_ne!(
            key(wide, "[2001:db8:1::1]:1"),
            key(wide, "[2001:db8:2::1]:1")
        );
        // Odd prefixes mask inside a byte.
        let odd = Prefixes { v4: 23, v6: 127 };
        assert_eq!(key(odd, "10.1.2.3:1"), key(odd, "10.1.3.3:1"));
        assert_ne!(key(odd, "10.1.2.3:1"), key(odd, "10.1.4.3:1"));
        assert_eq!(key(odd, "[::2]:1"), key(odd, "[::3]:1"));
        assert_ne!(key(odd, "[::3]:1"), key(odd, "[::4]:1"));
        // An IPv4 client on an IPv6 socket is an IPv4 client, per network and per address.
        assert_eq!(key(wide, "[::ffff:10.1.2.3]:1"), key(wide, "10.1.2.9:1"));
        assert_eq!(key(d, "[::ffff:10.1.2.3]:1"), key(d, "10.1.2.3:9"));
        assert_eq!(
            key(d, "::ffff:255.255.255.255"),
            key(d, "255.255.255.255:1")
        );
        assert_ne!(key(d, "[::ffff:10.1.2.3]:1"), key(d, "10.1.2.4:9"));
        // Not an IP address: the text is the key.
        assert!(key(wide, "/tmp/envoy.sock").is_some());
        // What a rate limit service is sent.
        let sent = |prefixes: Prefixes, addr: &str| {
            let parts = [KeyPart::RemoteAddress(prefixes)];
            let e = descriptor_entries("r", &parts, false, &mut req(addr, "/")).unwrap();
            (e[1].0.clone(), String::from_utf8(e[1].1.clone()).unwrap())
        };
        assert_eq!(
            sent(d, "10.1.2.3:1"),
            ("remote_address".into(), "10.1.2.3".into())
        );
        assert_eq!(sent(wide, "10.1.2.3:1").1, "10.1.2.0/24");
        assert_eq!(sent(d, "[2001:db8:1:2:3::1]:1").1, "2001:db8:1:2::/64");
        assert_eq!(
            sent(Prefixes { v4: 32, v6: 128 }, "[2001:db8::1]:1").1,
            "2001:db8::1"
        );
        assert_eq!(sent(d, "[::ffff:10.0.0.7]:5").1, "10.0.0.7");
    }
}
