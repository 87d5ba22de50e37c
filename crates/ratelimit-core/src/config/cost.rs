//! What a request costs under a rule (`cost`): a fixed amount, a request header's value, or what
//! its response reports ([`Charge`]: the usage read from a header, the body's bytes or fields of
//! the body, and the reservation admitted against it, sized from the request's body where
//! configured); and how a cost header and a reported usage are read. A cost in money is a
//! [`Price`] (`price.rs`).
//!
//! Uses the configuration's own types only.

use super::Price;

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
    /// Their slot in [`Config::request_paths`](super::Config::request_paths).
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
    /// Their slot in [`Config::usage_paths`](super::Config::usage_paths).
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
