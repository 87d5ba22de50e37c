//! Which requests a rule applies to ([`Match`]: path, method, authority, headers, fields of the
//! body), which client each one is (the [`KeyPart`]s of its key), and what a request that lacks
//! a part of its key gets ([`MissingKey`]).
//!
//! Uses nothing else of the crate.

use std::fmt;

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
    /// Its slot in [`Config::request_paths`](super::Config::request_paths) (assigned once the rules are read).
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
