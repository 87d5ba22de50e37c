//! The local replies that refuse a request: the limited reply of its rules' verdicts, and those
//! for a request without its client key, naming a model with no price, or the filter failing.
//! It uses the response's fields and dialects ([`crate::headers`], [`crate::dialect`]) and the
//! configuration; the request's path ([`super::request`]) decides which reply.

use crate::config::{HeaderStyle, KeyPart, ResponseConfig, Rule};
use crate::dialect::{self, Classed};
use crate::headers::{self, Fields, Report};

/// A local reply refusing a request.
#[derive(Debug)]
pub struct Reply {
    /// The HTTP status.
    pub status: u16,
    content_type: &'static str,
    /// `None` for a refusal that waiting does not lift (a missing client key).
    retry_after: Option<String>,
    /// A `WWW-Authenticate` challenge, for a 401.
    challenge: Option<String>,
    fields: Fields,
    service: Vec<(String, String)>,
    /// The body: `application/problem+json`, or the error of the configured dialect's API
    /// (`application/json`).
    pub body: String,
}

impl Reply {
    /// The reply's header fields, in order.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> {
        let ours = [
            Some(("content-type", self.content_type)),
            self.retry_after.as_deref().map(|r| ("retry-after", r)),
            self.challenge.as_deref().map(|c| ("www-authenticate", c)),
        ];
        ours.into_iter()
            .flatten()
            .chain(self.fields.iter().map(|(k, v)| (k as &str, v)))
            .chain(self.service.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }
}

/// The limited reply for the verdicts `reported` (the same verdicts `classed`, with their
/// quotas' kinds) at `now_ms`.
pub(super) fn reply(
    response: &ResponseConfig,
    reported: &[Report],
    classed: &[Classed],
    now_ms: u64,
    service: Vec<(String, String)>,
) -> Reply {
    let retry_after = headers::retry_after_seconds(reported);
    let mut fields = headers::rate_limit_headers(response.headers, reported, true);
    dialect::each_field(
        response.dialect,
        classed,
        now_ms,
        true,
        &mut String::new(),
        |k, v| fields.push(k, v),
    );
    let refused = classed
        .iter()
        .find(|(_, v)| !v.allowed)
        .and_then(|(k, _)| *k);
    Reply {
        status: response.status,
        content_type: dialect::content_type(response.dialect),
        retry_after: Some(retry_after.to_string()),
        challenge: None,
        fields,
        service,
        body: dialect::body(
            response.dialect,
            response.status,
            reported,
            refused,
            retry_after,
        ),
    }
}

/// The status of a request refused for lacking its client key (`on_missing_key: refuse`).
pub const MISSING_KEY_STATUS: u16 = 401;

/// The reply for a request refused because it lacks `part` of `rule`'s key: a 401 without
/// `Retry-After` (waiting does not help), with a `Bearer` challenge when the key is a bearer
/// token.
pub(super) fn missing_key_reply(
    rule: &Rule,
    part: Option<&KeyPart>,
    response: &ResponseConfig,
) -> Reply {
    let bearer = |p: &KeyPart| match p {
        KeyPart::Bearer => true,
        KeyPart::First(parts) => parts.contains(&KeyPart::Bearer),
        _ => false,
    };
    let challenge = part
        .filter(|p| bearer(p))
        .map(|_| format!("Bearer realm=\"{}\"", rule.name));
    // The part as configured may hold any character (a body path): escaped for the JSON body.
    let what = part.map_or_else(String::new, |p| {
        let quoted = super::operator_http::json(&format!(" ({p})"));
        let inner = quoted.strip_prefix('"').and_then(|q| q.strip_suffix('"'));
        inner.unwrap_or_default().to_string()
    });
    let detail = format!(
        "Rule \\\"{}\\\" keys each client by a value the request does not carry{what}; send it.",
        rule.name
    );
    Reply {
        status: MISSING_KEY_STATUS,
        content_type: dialect::content_type(response.dialect),
        retry_after: None,
        challenge,
        fields: Fields::default(),
        service: Vec::new(),
        body: dialect::missing_key_body(response.dialect, &rule.name, &detail),
    }
}

/// The status of a request naming a model a rule has no price for.
pub const UNPRICED_STATUS: u16 = 400;

/// The reply for a request naming a model `rule` has no price for: a 400 without
/// `Retry-After` (waiting does not help).
pub(super) fn unpriced_reply(rule: &Rule, response: &ResponseConfig) -> Reply {
    let detail = format!(
        "Rule \\\"{}\\\" has no price for the model this request names; use a model it prices.",
        rule.name
    );
    Reply {
        status: UNPRICED_STATUS,
        content_type: dialect::content_type(response.dialect),
        retry_after: None,
        challenge: None,
        fields: Fields::default(),
        service: Vec::new(),
        body: dialect::unpriced_body(response.dialect, &rule.name, &detail),
    }
}

/// The reply for a request the filter failed on (a caught panic in the native host, with
/// `failure_mode: deny`): the limited status and a body, in the configured dialect, that says
/// so.
pub fn failure_reply(response: &ResponseConfig) -> Reply {
    let bare = ResponseConfig {
        headers: HeaderStyle::None,
        ..*response
    };
    reply(&bare, &[], &[], 0, Vec::new())
}
