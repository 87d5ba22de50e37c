//! What the client is told: rate-limit header fields and the body of a limited reply.
//!
//! IETF fields follow draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy` and
//! `RateLimit` are structured-field Lists whose items are the policy names as sf-strings, with
//! integer parameters `q` (quota), `w` (window, s), `r` (remaining) and `t` (seconds until more
//! quota is available), and the sf-string `qu` (quota unit) for a quota that does not count
//! requests. A quota without a window (requests in flight) has neither `w` nor `t`. Every
//! applied rule is reported there; the X-RateLimit fields report the most restrictive one, with
//! no `X-RateLimit-Reset` when that is a quota without a window. Rule
//! names are limited to `[A-Za-z0-9_.-]` and quota units to `[a-z0-9-]`, so they never need
//! escaping inside an sf-string or a JSON string.

use crate::config::{HeaderStyle, CONCURRENT_REQUESTS};
use crate::limiter::Verdict;
use smallvec::SmallVec;
use std::fmt::Write;

/// What one rule reports of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report<'a> {
    /// The rule's name.
    pub name: &'a str,
    /// Its quota unit (`qu`); `None` for requests.
    pub unit: Option<&'a str>,
    /// Its verdict.
    pub verdict: Verdict,
    /// The rule's texts written once ([`Texts`]), if there are.
    pub texts: Option<&'a Texts>,
}

/// What a rule's fields say whatever the request, written once per configuration (the same
/// text [`each_rate_limit_header`] would write each time): its `RateLimit-Policy` item and its
/// limit as text, for the limit and window it has unless scaled, and the start of its
/// `RateLimit` item.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Texts {
    /// The limit and window (s) `policy` and `limit_text` say.
    limit: u64,
    window_s: u64,
    /// `"name";q=LIMIT;w=WINDOW;qu="unit"`.
    policy: String,
    /// LIMIT.
    limit_text: String,
    /// `"name";r=`.
    rate: String,
}

impl Texts {
    /// The texts of a rule called `name`, counting `unit`, whose verdicts report `limit` per
    /// `window_s`.
    pub fn new(name: &str, unit: Option<&str>, limit: u64, window_s: u64) -> Texts {
        let verdict = Verdict {
            allowed: true,
            limit,
            window_s,
            remaining: 0,
            reset_ms: 0,
            retry_after_ms: 0,
            delay_ms: 0,
        };
        let r = Report {
            name,
            unit,
            verdict,
            texts: None,
        };
        let mut policy = String::new();
        policy_item(&mut policy, &r);
        let mut rate = String::new();
        rate_item_start(&mut rate, &r);
        let mut limit_text = String::new();
        push_u64(&mut limit_text, limit);
        Texts {
            limit,
            window_s,
            policy,
            limit_text,
            rate,
        }
    }

    /// The texts, if they say this verdict's limit and window.
    fn of<'t>(texts: Option<&'t Texts>, v: &Verdict) -> Option<&'t Texts> {
        texts.filter(|t| t.limit == v.limit && t.window_s == v.window_s)
    }
}

/// Appends a rule's `RateLimit-Policy` item.
fn policy_item(buf: &mut String, r: &Report) {
    if let Some(t) = Texts::of(r.texts, &r.verdict) {
        buf.push_str(&t.policy);
        return;
    }
    buf.push('"');
    buf.push_str(r.name);
    buf.push_str("\";q=");
    push_u64(buf, r.verdict.limit);
    if r.verdict.window_s > 0 {
        buf.push_str(";w=");
        push_u64(buf, r.verdict.window_s);
    }
    if let Some(unit) = r.unit {
        buf.push_str(";qu=\"");
        buf.push_str(unit);
        buf.push('"');
    }
}

/// Appends the start of a rule's `RateLimit` item, up to its remaining quota.
fn rate_item_start(buf: &mut String, r: &Report) {
    if let Some(t) = r.texts {
        buf.push_str(&t.rate);
        return;
    }
    buf.push('"');
    buf.push_str(r.name);
    buf.push_str("\";r=");
}

/// Appends the decimal digits of `n`. `core::fmt` is several times slower than `itoa` inside
/// Envoy's V8, and every allowed response formats five numbers.
pub fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// The problem type of the IETF draft for a request over quota.
pub const PROBLEM_TYPE: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Whole seconds, rounded up, so a client never comes back before the time it was given.
pub fn ceil_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The `Retry-After` value in seconds for a refused request: the latest retry time of the rules
/// that refused it, at least 1.
pub fn retry_after_seconds<'a>(rules: impl IntoIterator<Item = &'a Report<'a>>) -> u64 {
    retry_after_of(rules.into_iter().map(|r| r.verdict))
}

/// [`retry_after_seconds`] of these verdicts.
fn retry_after_of(verdicts: impl Iterator<Item = Verdict>) -> u64 {
    verdicts
        .filter(|v| !v.allowed)
        .map(|v| ceil_seconds(v.retry_after_ms))
        .max()
        .unwrap_or(1)
        .max(1)
}

/// The rule the X-RateLimit fields report: a refusing rule first, else the one with the least
/// remaining quota, then the longest wait.
pub fn most_restrictive<'a>(rules: impl Iterator<Item = Report<'a>>) -> Option<Report<'a>> {
    rules.min_by_key(|r| restrictiveness(&r.verdict))
}

/// Orders verdicts from the most restrictive: a refusal first, then the least remaining quota,
/// then the longest wait.
pub fn restrictiveness(v: &Verdict) -> (bool, u64, u64) {
    (v.allowed, v.remaining, u64::MAX - v.reset_ms)
}

/// Header fields whose values share one buffer, the first six listed in place: one allocation
/// per reply for the IETF and X-RateLimit fields (a dialect's may add more).
#[derive(Clone, Debug, Default)]
pub struct Fields {
    buf: String,
    fields: SmallVec<[(&'static str, usize, usize); 6]>,
}

impl Fields {
    /// Adds a field.
    pub(crate) fn push(&mut self, name: &'static str, value: &str) {
        let start = self.buf.len();
        self.buf.push_str(value);
        self.fields.push((name, start, self.buf.len()));
    }

    /// The fields, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.fields
            .iter()
            .map(|(name, start, end)| (*name, self.buf.get(*start..*end).unwrap_or("")))
    }

    /// Whether there are no fields.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }
}

/// The rate-limit header fields for a response, collected (for a local reply). `limited` adds
/// `X-RateLimit-Retry-After`; `Retry-After` itself is added by the caller of a limited reply
/// whatever the style.
pub fn rate_limit_headers(style: HeaderStyle, rules: &[Report], limited: bool) -> Fields {
    let mut out = Fields {
        buf: String::with_capacity(64 * rules.len() + 48),
        ..Fields::default()
    };
    let mut value = String::new();
    each_rate_limit_header(
        style,
        rules.iter().copied(),
        limited,
        &mut value,
        |name, v| out.push(name, v),
    );
    out
}

/// The rate-limit header fields one at a time: each value is written into `buf` (cleared
/// first) and handed to `emit` with its name. With a `buf` reused for every response this
/// allocates nothing; and it is straight-line code, which matters in wasm, where the request
/// path's code is cold in the CPU's caches at every request.
pub fn each_rate_limit_header<'a>(
    style: HeaderStyle,
    rules: impl Iterator<Item = Report<'a>> + Clone,
    limited: bool,
    buf: &mut String,
    emit: impl FnMut(&'static str, &str),
) {
    let verdicts: SmallVec<[(usize, Verdict); 4]> = rules
        .clone()
        .enumerate()
        .map(|(i, r)| (i, r.verdict))
        .collect();
    let reports: SmallVec<[Report<'a>; 4]> = rules.collect();
    each_field(
        style,
        &verdicts,
        |i| reports.get(i).map(|r| (r.name, r.unit, r.texts)),
        limited,
        buf,
        emit,
    );
}

/// What a rule's fields say of it besides its verdict: its name, quota unit and texts.
pub type Described<'a> = (&'a str, Option<&'a str>, Option<&'a Texts>);

/// [`each_rate_limit_header`] for `(rule, verdict)` pairs, each rule described by
/// `describe` (a rule it does not describe is left out), without making a [`Report`] of every
/// verdict for every field.
pub fn each_field<'a>(
    style: HeaderStyle,
    verdicts: &[(usize, Verdict)],
    describe: impl Fn(usize) -> Option<Described<'a>>,
    limited: bool,
    buf: &mut String,
    mut emit: impl FnMut(&'static str, &str),
) {
    let report = |&(i, verdict): &(usize, Verdict)| {
        describe(i).map(|(name, unit, texts)| Report {
            name,
            unit,
            verdict,
            texts,
        })
    };
    if verdicts.iter().all(|v| describe(v.0).is_none()) {
        return;
    }
    if style.ietf() {
        buf.clear();
        for (i, r) in verdicts.iter().filter_map(report).enumerate() {
            if i > 0 {
                buf.push_str(", ");
            }
            policy_item(buf, &r);
        }
        emit("ratelimit-policy", buf);
        buf.clear();
        for (i, r) in verdicts.iter().filter_map(report).enumerate() {
            if i > 0 {
                buf.push_str(", ");
            }
            rate_item_start(buf, &r);
            push_u64(buf, r.verdict.remaining);
            if r.verdict.window_s > 0 {
                buf.push_str(";t=");
                push_u64(buf, ceil_seconds(r.verdict.reset_ms));
            }
        }
        emit("ratelimit", buf);
    }
    if style.x_ratelimit() {
        // The most restrictive verdict, compared without its rule (first of equals).
        let chosen = verdicts
            .iter()
            .filter(|(i, _)| describe(*i).is_some())
            .min_by_key(|(_, v)| restrictiveness(v));
        if let Some(r) = chosen.and_then(report) {
            let v = &r.verdict;
            let mut d = itoa::Buffer::new();
            match Texts::of(r.texts, v) {
                Some(t) => emit("x-ratelimit-limit", &t.limit_text),
                None => emit("x-ratelimit-limit", d.format(v.limit)),
            }
            emit("x-ratelimit-remaining", d.format(v.remaining));
            // Requests in flight have no window, so no reset time (their IETF item has no `t`):
            // a 0 or 1 here would tell a client when quota comes back, which no one knows.
            if v.window_s > 0 {
                emit("x-ratelimit-reset", d.format(ceil_seconds(v.reset_ms)));
            }
            if limited {
                let retry = retry_after_of(
                    verdicts
                        .iter()
                        .filter(|(i, _)| describe(*i).is_some())
                        .map(|(_, v)| *v),
                );
                emit("x-ratelimit-retry-after", d.format(retry));
            }
        }
    }
}

/// What a limited reply tells a person: the first rule that refused it (its name, quota and
/// window) and the wait; every dialect's body carries it. Rule names and quota units hold no
/// character JSON must escape but `"`.
pub fn message(rules: &[Report], retry_after_s: u64) -> String {
    match rules.iter().find(|r| !r.verdict.allowed) {
        Some(r) => {
            let (name, v) = (r.name, &r.verdict);
            match r.unit {
                Some(CONCURRENT_REQUESTS) => format!(
                    "Rate limit \"{name}\" of {} requests in flight exceeded; retry in {retry_after_s} s.",
                    v.limit
                ),
                unit => format!(
                    "Rate limit \"{name}\" of {} {} per {} s exceeded; retry in {retry_after_s} s.",
                    v.limit,
                    unit.unwrap_or("requests"),
                    v.window_s
                ),
            }
        }
        None => format!("The rate limiter could not decide; retry in {retry_after_s} s."),
    }
}

/// The `application/problem+json` body of a limited reply.
pub fn problem_body(status: u16, rules: &[Report], retry_after_s: u64) -> String {
    let mut names = String::new();
    for (i, r) in rules.iter().filter(|r| !r.verdict.allowed).enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let _ = write!(names, "{sep}\"{}\"", r.name);
    }
    let detail = message(rules, retry_after_s).replace('"', "\\\"");
    format!(
        "{{\"type\":\"{PROBLEM_TYPE}\",\"title\":\"Quota Exceeded\",\"status\":{status},\
         \"detail\":\"{detail}\",\"violated-policies\":[{names}],\"retry-after\":{retry_after_s}}}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, verdict: Verdict) -> Report<'_> {
        Report {
            name,
            unit: None,
            verdict,
            texts: None,
        }
    }

    fn v(allowed: bool, limit: u64, remaining: u64, reset_ms: u64, retry: u64) -> Verdict {
        Verdict {
            allowed,
            limit,
            window_s: 60,
            remaining,
            reset_ms,
            retry_after_ms: retry,
            delay_ms: 0,
        }
    }

    #[test]
    fn ietf_and_x_fields_for_two_rules() {
        let rules = [
            r("per-client", v(true, 100, 42, 16_200, 0)),
            r("global", v(true, 1000, 7, 3_000, 0)),
        ];
        let h = rate_limit_headers(HeaderStyle::Both, &rules, false);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![
                (
                    "ratelimit-policy",
                    "\"per-client\";q=100;w=60, \"global\";q=1000;w=60"
                ),
                ("ratelimit", "\"per-client\";r=42;t=17, \"global\";r=7;t=3"),
                ("x-ratelimit-limit", "1000"),
                ("x-ratelimit-remaining", "7"),
                ("x-ratelimit-reset", "3"),
            ]
        );
        assert!(rate_limit_headers(HeaderStyle::None, &rules, false).is_empty());
        let ietf = rate_limit_headers(HeaderStyle::Ietf, &rules, false);
        assert_eq!(ietf.iter().count(), 2);
    }

    /// Texts written once give the fields written each time: when they say the verdict's limit
    /// and window, and when they do not (a scaled limit, another window: written each time).
    #[test]
    fn texts_written_once_say_the_same() {
        let flight = Verdict {
            window_s: 0,
            ..v(true, 10, 3, 0, 0)
        };
        let verdicts = [
            ("a", None, v(true, 100, 42, 16_200, 0)),
            ("b.c", Some("tokens"), v(false, 7, 0, 3_000, 3_000)),
            ("d", Some(CONCURRENT_REQUESTS), flight),
        ];
        let texts: Vec<Vec<Texts>> = verdicts
            .iter()
            .map(|(name, unit, v)| {
                vec![
                    Texts::new(name, *unit, v.limit, v.window_s),
                    Texts::new(name, *unit, v.limit + 1, v.window_s),
                    Texts::new(name, *unit, v.limit, v.window_s + 60),
                ]
            })
            .collect();
        for which in 0..3 {
            for n in 1..=verdicts.len() {
                let plain: Vec<Report> = verdicts[..n]
                    .iter()
                    .map(|(name, unit, v)| Report {
                        unit: *unit,
                        ..r(name, *v)
                    })
                    .collect();
                let with: Vec<Report> = plain
                    .iter()
                    .zip(&texts)
                    .map(|(r, t)| Report {
                        texts: Some(&t[which]),
                        ..*r
                    })
                    .collect();
                for style in [
                    HeaderStyle::Ietf,
                    HeaderStyle::XRateLimit,
                    HeaderStyle::Both,
                ] {
                    for limited in [false, true] {
                        let a = rate_limit_headers(style, &plain, limited);
                        let b = rate_limit_headers(style, &with, limited);
                        assert_eq!(
                            a.iter().collect::<Vec<_>>(),
                            b.iter().collect::<Vec<_>>(),
                            "{which} {n} {style:?} {limited}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn digits() {
        for n in [0, 7, 10, 99, 1234567890, u64::MAX] {
            let mut s = String::from("x");
            push_u64(&mut s, n);
            assert_eq!(s, format!("x{n}"));
        }
    }

    #[test]
    fn limited_reply() {
        let rules = [
            r("a", v(true, 100, 0, 1_000, 0)),
            r("b", v(false, 5, 0, 41_001, 41_001)),
        ];
        assert_eq!(retry_after_seconds(&rules), 42);
        let h = rate_limit_headers(HeaderStyle::XRateLimit, &rules, true);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![
                ("x-ratelimit-limit", "5"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "42"),
                ("x-ratelimit-retry-after", "42"),
            ]
        );
        let body = problem_body(429, &rules, 42);
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["type"], PROBLEM_TYPE);
        assert_eq!(json["status"], 429);
        assert_eq!(json["violated-policies"], serde_json::json!(["b"]));
        assert_eq!(json["retry-after"], 42);
        assert_eq!(
            json["detail"],
            "Rate limit \"b\" of 5 requests per 60 s exceeded; retry in 42 s."
        );
        // Never less than a second, even when the wait is shorter.
        assert_eq!(retry_after_seconds(&[r("c", v(false, 1, 0, 1, 1))]), 1);
    }

    #[test]
    fn quota_units_and_requests_in_flight() {
        let tokens = Report {
            unit: Some("tokens"),
            ..r("llm", v(true, 10_000, 6_000, 30_000, 0))
        };
        let flight = Report {
            unit: Some(CONCURRENT_REQUESTS),
            verdict: Verdict {
                window_s: 0,
                ..v(true, 10, 3, 0, 0)
            },
            name: "tenant",
            texts: None,
        };
        let h = rate_limit_headers(HeaderStyle::Ietf, &[tokens, flight], false);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![
                (
                    "ratelimit-policy",
                    "\"llm\";q=10000;w=60;qu=\"tokens\", \"tenant\";q=10;qu=\"concurrent-requests\""
                ),
                ("ratelimit", "\"llm\";r=6000;t=30, \"tenant\";r=3"),
            ]
        );
        // The in-flight rule is the tightest: its limit and remaining slots, no reset time.
        let h = rate_limit_headers(HeaderStyle::XRateLimit, &[tokens, flight], false);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![("x-ratelimit-limit", "10"), ("x-ratelimit-remaining", "3")]
        );
        let refused = Report {
            verdict: Verdict {
                allowed: false,
                remaining: 0,
                reset_ms: 1_000,
                retry_after_ms: 1_000,
                ..flight.verdict
            },
            ..flight
        };
        let h = rate_limit_headers(HeaderStyle::XRateLimit, &[tokens, refused], true);
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![
                ("x-ratelimit-limit", "10"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-retry-after", "1"),
            ]
        );
        // A rule with a window is the tightest: its reset time, as before.
        let h = rate_limit_headers(
            HeaderStyle::XRateLimit,
            &[
                tokens,
                Report {
                    verdict: Verdict {
                        limit: 10_000,
                        remaining: 7_000,
                        ..flight.verdict
                    },
                    ..flight
                },
            ],
            false,
        );
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![
                ("x-ratelimit-limit", "10000"),
                ("x-ratelimit-remaining", "6000"),
                ("x-ratelimit-reset", "30"),
            ]
        );
        let body: serde_json::Value =
            serde_json::from_str(&problem_body(429, &[refused], 1)).unwrap();
        assert_eq!(
            body["detail"],
            "Rate limit \"tenant\" of 10 requests in flight exceeded; retry in 1 s."
        );
        let body: serde_json::Value = serde_json::from_str(&problem_body(
            429,
            &[Report {
                verdict: v(false, 10_000, 0, 5_000, 5_000),
                ..tokens
            }],
            5,
        ))
        .unwrap();
        assert_eq!(
            body["detail"],
            "Rate limit \"llm\" of 10000 tokens per 60 s exceeded; retry in 5 s."
        );
    }
}
