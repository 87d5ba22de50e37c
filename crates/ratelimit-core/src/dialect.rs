//! Answers in the dialect of an LLM API (`response.dialect`), so that its official SDKs read
//! them: OpenAI's and Anthropic's error bodies and rate-limit fields.
//!
//! Each rule's quota is of a [`Kind`] (requests, tokens, input or output tokens), taken from its
//! quota unit; the fields of a kind report the most restrictive rule of that kind among those
//! that applied (the one that refused, else the one with the least remaining, then the longest
//! wait), as the X-RateLimit fields do. A rule of another unit (bytes, requests in flight) has
//! no fields in these dialects: the APIs have none for it.
//!
//! - OpenAI: `x-ratelimit-limit|remaining|reset-requests|tokens`, the reset as a Go duration
//!   (`20ms`, `1.5s`, `6m0s`, `1h2m3s`), and `retry-after-ms` on a refusal; the body
//!   `{"error": {"message", "type": "requests"|"tokens", "param": null, "code":
//!   "rate_limit_exceeded"}}`.
//! - Anthropic: `anthropic-ratelimit-requests|tokens|input-tokens|output-tokens-limit|remaining|
//!   reset`, the reset as an RFC 3339 UTC time rounded up to the second; the body
//!   `{"type": "error", "error": {"type": "rate_limit_error", "message"}}`. The `tokens` fields
//!   report every rule counting tokens (input and output ones too), as Anthropic's do.

use crate::config::{Dialect, Kind};
use crate::headers::{self, push_u64, Report};
use crate::limiter::calendar::civil_from_days;
use crate::limiter::Verdict;

/// A rule's verdict with the kind of its quota.
pub type Classed = (Option<Kind>, Verdict);

/// The most restrictive verdict of the rules whose kind `of_kind` accepts.
fn tightest(rules: &[Classed], of_kind: impl Fn(Kind) -> bool) -> Option<Verdict> {
    rules
        .iter()
        .filter(|(k, _)| k.is_some_and(&of_kind))
        .map(|(_, v)| *v)
        .min_by_key(headers::restrictiveness)
}

/// The wait of a refusal, ms: the longest of the refusing rules' (at least 1; 1 s when no rule
/// refused, as `Retry-After` says then).
fn retry_after_ms(rules: &[Classed]) -> u64 {
    rules
        .iter()
        .filter(|(_, v)| !v.allowed)
        .map(|(_, v)| v.retry_after_ms)
        .max()
        .unwrap_or(1000)
        .max(1)
}

const OPENAI: [(Kind, [&str; 3]); 2] = [
    (
        Kind::Requests,
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
    ),
    (
        Kind::Tokens,
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
    ),
];

const ANTHROPIC: [(Kind, [&str; 3]); 4] = [
    (
        Kind::Requests,
        [
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ],
    ),
    (
        Kind::Tokens,
        [
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ],
    ),
    (
        Kind::InputTokens,
        [
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
        ],
    ),
    (
        Kind::OutputTokens,
        [
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
        ],
    ),
];

/// Whether a rule of kind `k` is reported by the fields of kind `fields`: the tokens fields
/// report every rule counting tokens.
fn reported_by(fields: Kind, k: Kind) -> bool {
    fields == k || fields == Kind::Tokens && k.counts_tokens()
}

/// The dialect's rate-limit fields for the applied rules `rules`, at `now_ms` (Anthropic's
/// reset times), each value written into `buf` (cleared first) and handed to `emit` with its
/// name; `limited` adds what a refusal says besides `Retry-After` (OpenAI's `retry-after-ms`).
/// OpenAI's fields come in the order its API sends them: the limits, the remaining, the resets.
pub fn each_field(
    dialect: Dialect,
    rules: &[Classed],
    now_ms: u64,
    limited: bool,
    buf: &mut String,
    mut emit: impl FnMut(&'static str, &str),
) {
    match dialect {
        Dialect::Default => {}
        Dialect::OpenAi => {
            let found = OPENAI.map(|(k, names)| (tightest(rules, |r| reported_by(k, r)), names));
            let mut d = itoa::Buffer::new();
            for (v, [limit, _, _]) in &found {
                if let Some(v) = v {
                    emit(limit, d.format(v.limit));
                }
            }
            for (v, [_, remaining, _]) in &found {
                if let Some(v) = v {
                    emit(remaining, d.format(v.remaining));
                }
            }
            for (v, [_, _, reset]) in &found {
                if let Some(v) = v {
                    buf.clear();
                    push_duration(buf, v.reset_ms);
                    emit(reset, buf);
                }
            }
            if limited {
                emit("retry-after-ms", d.format(retry_after_ms(rules)));
            }
        }
        Dialect::Anthropic => {
            let mut d = itoa::Buffer::new();
            for (k, [limit, remaining, reset]) in ANTHROPIC {
                let Some(v) = tightest(rules, |r| reported_by(k, r)) else {
                    continue;
                };
                emit(limit, d.format(v.limit));
                emit(remaining, d.format(v.remaining));
                buf.clear();
                push_rfc3339(buf, now_ms.saturating_add(v.reset_ms));
                emit(reset, buf);
            }
        }
    }
}

/// The content type of a limited reply's body.
pub fn content_type(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Default => "application/problem+json",
        Dialect::OpenAi | Dialect::Anthropic => "application/json",
    }
}

/// The body of a limited reply to the verdicts `reported`, the first rule that refused it being
/// of kind `refused` (OpenAI's `type`: `tokens` for any kind of tokens, else `requests`); its
/// message names that rule and the wait.
pub fn body(
    dialect: Dialect,
    status: u16,
    reported: &[Report],
    refused: Option<Kind>,
    retry_after_s: u64,
) -> String {
    let message = || headers::message(reported, retry_after_s).replace('"', "\\\"");
    match dialect {
        Dialect::Default => headers::problem_body(status, reported, retry_after_s),
        Dialect::OpenAi => {
            let kind = match refused {
                Some(k) if k.counts_tokens() => "tokens",
                _ => "requests",
            };
            format!(
                "{{\"error\":{{\"message\":\"{}\",\"type\":\"{kind}\",\"param\":null,\
                 \"code\":\"rate_limit_exceeded\"}}}}",
                message()
            )
        }
        Dialect::Anthropic => format!(
            "{{\"type\":\"error\",\"error\":{{\"type\":\"rate_limit_error\",\"message\":\"{}\"}}}}",
            message()
        ),
    }
}

/// The body of a 401 for a request without a rule's client key (`on_missing_key: refuse`), in
/// `dialect`: the error each API sends for a request without an API key, which the SDKs raise
/// as their authentication error. `detail` is JSON-escaped already.
pub fn missing_key_body(dialect: Dialect, rule: &str, detail: &str) -> String {
    match dialect {
        Dialect::Default => format!(
            "{{\"title\":\"Missing client key\",\"status\":401,\"detail\":\"{detail}\",\
             \"violated-policies\":[\"{rule}\"]}}"
        ),
        Dialect::OpenAi => format!(
            "{{\"error\":{{\"message\":\"{detail}\",\"type\":\"invalid_request_error\",\
             \"param\":null,\"code\":\"missing_api_key\"}}}}"
        ),
        Dialect::Anthropic => format!(
            "{{\"type\":\"error\",\"error\":{{\"type\":\"authentication_error\",\
             \"message\":\"{detail}\"}}}}"
        ),
    }
}

/// The body of a 400 for a request naming a model a rule has no price for
/// (`price.default: "refuse"`), in `dialect`: the error each API sends for a request it cannot
/// serve, which the SDKs raise as their bad-request error. `detail` is JSON-escaped already.
pub fn unpriced_body(dialect: Dialect, rule: &str, detail: &str) -> String {
    match dialect {
        Dialect::Default => format!(
            "{{\"title\":\"Unpriced model\",\"status\":400,\"detail\":\"{detail}\",\
             \"violated-policies\":[\"{rule}\"]}}"
        ),
        Dialect::OpenAi => format!(
            "{{\"error\":{{\"message\":\"{detail}\",\"type\":\"invalid_request_error\",\
             \"param\":\"model\",\"code\":\"model_not_found\"}}}}"
        ),
        Dialect::Anthropic => format!(
            "{{\"type\":\"error\",\"error\":{{\"type\":\"invalid_request_error\",\
             \"message\":\"{detail}\"}}}}"
        ),
    }
}

/// Appends `ms` as OpenAI writes a wait (Go's duration format, to the millisecond): `0s`,
/// `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3.004s`.
pub fn push_duration(buf: &mut String, ms: u64) {
    if ms == 0 {
        buf.push_str("0s");
        return;
    }
    if ms < 1000 {
        push_u64(buf, ms);
        buf.push_str("ms");
        return;
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    if h > 0 {
        push_u64(buf, h);
        buf.push('h');
    }
    if h > 0 || m > 0 {
        push_u64(buf, m);
        buf.push('m');
    }
    push_u64(buf, s);
    if frac > 0 {
        // Three digits, without the trailing zeros: .5, .25, .125.
        let digits = [frac / 100, frac / 10 % 10, frac % 10];
        let len = if frac % 100 == 0 {
            1
        } else if frac % 10 == 0 {
            2
        } else {
            3
        };
        buf.push('.');
        for d in digits.iter().take(len) {
            push_u64(buf, *d);
        }
    }
    buf.push('s');
}

/// Appends the UTC time `ms` (since the epoch) in RFC 3339, `2026-11-26T04:40:53Z`, rounded up
/// to the second (a client told to come back then is never early).
pub fn push_rfc3339(buf: &mut String, ms: u64) {
    let secs = headers::ceil_seconds(ms);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, d) = civil_from_days(i64::try_from(days).unwrap_or(i64::MAX));
    push_padded(buf, u64::try_from(y).unwrap_or(0), 4);
    buf.push('-');
    push_padded(buf, u64::from(mo), 2);
    buf.push('-');
    push_padded(buf, u64::from(d), 2);
    buf.push('T');
    push_padded(buf, rem / 3600, 2);
    buf.push(':');
    push_padded(buf, rem / 60 % 60, 2);
    buf.push(':');
    push_padded(buf, rem % 60, 2);
    buf.push('Z');
}

/// Appends `n` with leading zeros to `width` digits.
fn push_padded(buf: &mut String, n: u64, width: usize) {
    let mut d = itoa::Buffer::new();
    let s = d.format(n);
    for _ in s.len()..width {
        buf.push('0');
    }
    buf.push_str(s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CONCURRENT_REQUESTS;
    use crate::provider;

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

    fn fields(
        dialect: Dialect,
        rules: &[Classed],
        now: u64,
        limited: bool,
    ) -> Vec<(String, String)> {
        let mut out = Vec::new();
        each_field(dialect, rules, now, limited, &mut String::new(), |k, v| {
            out.push((k.to_string(), v.to_string()))
        });
        out
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn kinds_follow_the_quota_unit() {
        assert_eq!(Kind::of_unit(None), Some(Kind::Requests));
        assert_eq!(Kind::of_unit(Some("requests")), Some(Kind::Requests));
        assert_eq!(Kind::of_unit(Some("tokens")), Some(Kind::Tokens));
        assert_eq!(Kind::of_unit(Some("input-tokens")), Some(Kind::InputTokens));
        assert_eq!(
            Kind::of_unit(Some("output-tokens")),
            Some(Kind::OutputTokens)
        );
        assert_eq!(Kind::of_unit(Some("content-bytes")), None);
        assert_eq!(Kind::of_unit(Some(CONCURRENT_REQUESTS)), None);
        assert_eq!(Kind::of_unit(Some("credits")), None);
        let config = crate::config::Config::parse(
            br#"{"rules": [
              {"name": "rpm", "rate_limit": {"requests_per_unit": 2, "unit": "minute"}},
              {"name": "weighted", "rate_limit": {"requests_per_unit": 2, "unit": "minute"},
               "cost": {"header": "x-cost"}},
              {"name": "tpm", "rate_limit": {"requests_per_unit": 2, "unit": "minute"},
               "cost": {"response": "openai"}},
              {"name": "in", "rate_limit": {"requests_per_unit": 2, "unit": "minute"},
               "cost": {"response": "json:usage.input_tokens"}, "quota_unit": "input-tokens"},
              {"name": "bytes", "rate_limit": {"requests_per_unit": 2, "unit": "minute"},
               "cost": {"response": "body_bytes"}},
              {"name": "flight", "in_flight": {"max": 2}}]}"#,
        )
        .unwrap();
        let kinds: Vec<Option<Kind>> = config.rules.iter().map(Kind::of).collect();
        assert_eq!(
            kinds,
            [
                Some(Kind::Requests),
                Some(Kind::Requests),
                Some(Kind::Tokens),
                Some(Kind::InputTokens),
                None,
                None
            ]
        );
    }

    #[test]
    fn durations_as_openai_writes_them() {
        for (ms, text) in [
            (0, "0s"),
            (1, "1ms"),
            (20, "20ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (1250, "1.25s"),
            (1001, "1.001s"),
            (17_230, "17.23s"),
            (59_999, "59.999s"),
            (60_000, "1m0s"),
            (360_000, "6m0s"),
            (61_500, "1m1.5s"),
            (3_600_000, "1h0m0s"),
            (3_723_004, "1h2m3.004s"),
            (86_400_000, "24h0m0s"),
        ] {
            let mut s = String::new();
            push_duration(&mut s, ms);
            assert_eq!(s, text, "{ms}");
        }
        // What it writes, a provider's reader reads back.
        for ms in [
            0,
            1,
            20,
            999,
            1000,
            1500,
            59_999,
            360_000,
            3_723_004,
            provider::MAX_WAIT_MS,
        ] {
            let mut s = String::new();
            push_duration(&mut s, ms);
            assert_eq!(provider::go_duration_ms(s.as_bytes()), Some(ms), "{s}");
        }
    }

    #[test]
    fn rfc3339_times() {
        for (ms, text) in [
            (0, "1970-01-01T00:00:00Z"),
            (1, "1970-01-01T00:00:01Z"), // rounded up
            (1000, "1970-01-01T00:00:01Z"),
            (951_782_400_000, "2000-02-29T00:00:00Z"), // a leap day
            (951_868_799_000, "2000-02-29T23:59:59Z"),
            (951_868_800_000, "2000-03-01T00:00:00Z"),
            (1_709_251_199_500, "2024-03-01T00:00:00Z"),
            (1_798_761_599_000, "2026-12-31T23:59:59Z"),
            (1_798_761_600_000, "2027-01-01T00:00:00Z"),
            (4_107_542_400_000, "2100-03-01T00:00:00Z"), // 2100 is no leap year
        ] {
            let mut s = String::new();
            push_rfc3339(&mut s, ms);
            assert_eq!(s, text, "{ms}");
        }
        // What it writes, a provider's reader reads back (it rounds up to the second).
        for ms in [0, 1_000, 1_795_668_053_000, 4_102_444_800_000] {
            let mut s = String::new();
            push_rfc3339(&mut s, ms);
            assert_eq!(provider::rfc3339_ms(s.as_bytes()), Some(ms), "{s}");
        }
        // Every day for 1,000 years against a second calendar: days counted from the year's
        // lengths.
        let mut day = 0u64;
        for y in 1970u64..2970 {
            let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
            let lengths = [
                31,
                if leap { 29 } else { 28 },
                31,
                30,
                31,
                30,
                31,
                31,
                30,
                31,
                30,
                31,
            ];
            for (m, len) in lengths.iter().enumerate() {
                for d in 1..=*len {
                    assert_eq!(civil_from_days(day as i64), (y as i64, m as u32 + 1, d));
                    day += 1;
                }
            }
        }
    }

    #[test]
    fn openai_fields_report_the_tightest_rule_of_each_kind() {
        let rules = [
            (Some(Kind::Requests), v(true, 60, 59, 1_000, 0)),
            (Some(Kind::Requests), v(true, 10, 3, 6_000, 0)),
            (Some(Kind::Tokens), v(true, 100_000, 99_000, 360_000, 0)),
            (Some(Kind::InputTokens), v(true, 50_000, 40_000, 20, 0)),
            (None, v(true, 5, 0, 0, 0)), // requests in flight: not reported
        ];
        assert_eq!(
            fields(Dialect::OpenAi, &rules, 0, false),
            pairs(&[
                ("x-ratelimit-limit-requests", "10"),
                ("x-ratelimit-limit-tokens", "50000"),
                ("x-ratelimit-remaining-requests", "3"),
                ("x-ratelimit-remaining-tokens", "40000"),
                ("x-ratelimit-reset-requests", "6s"),
                ("x-ratelimit-reset-tokens", "20ms"),
            ])
        );
        // Only the kinds that apply; a refusal adds retry-after-ms (the longest refusal's).
        let refused = [
            (Some(Kind::Tokens), v(false, 2_000, 0, 62_500, 62_500)),
            (None, v(false, 5, 0, 1_000, 1_000)),
        ];
        assert_eq!(
            fields(Dialect::OpenAi, &refused, 0, true),
            pairs(&[
                ("x-ratelimit-limit-tokens", "2000"),
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "1m2.5s"),
                ("retry-after-ms", "62500"),
            ])
        );
        // A refused rule is the one reported, even with more remaining than another.
        let mixed = [
            (Some(Kind::Requests), v(true, 10, 0, 5_000, 0)),
            (Some(Kind::Requests), v(false, 100, 1, 2_000, 2_000)),
        ];
        assert_eq!(
            fields(Dialect::OpenAi, &mixed, 0, true),
            pairs(&[
                ("x-ratelimit-limit-requests", "100"),
                ("x-ratelimit-remaining-requests", "1"),
                ("x-ratelimit-reset-requests", "2s"),
                ("retry-after-ms", "2000"),
            ])
        );
        assert!(fields(Dialect::Default, &rules, 0, true).is_empty());
    }

    #[test]
    fn anthropic_fields_per_kind_with_reset_times() {
        let now = 1_798_761_590_000; // 2026-12-31T23:59:50Z
        let rules = [
            (Some(Kind::Requests), v(true, 50, 49, 1_200, 0)),
            (Some(Kind::InputTokens), v(true, 40_000, 30_000, 10_000, 0)),
            (
                Some(Kind::OutputTokens),
                v(false, 8_000, 100, 60_000, 60_000),
            ),
        ];
        assert_eq!(
            fields(Dialect::Anthropic, &rules, now, true),
            pairs(&[
                ("anthropic-ratelimit-requests-limit", "50"),
                ("anthropic-ratelimit-requests-remaining", "49"),
                ("anthropic-ratelimit-requests-reset", "2026-12-31T23:59:52Z"),
                // The tightest token rule of any kind: the refusing output one.
                ("anthropic-ratelimit-tokens-limit", "8000"),
                ("anthropic-ratelimit-tokens-remaining", "100"),
                ("anthropic-ratelimit-tokens-reset", "2027-01-01T00:00:50Z"),
                ("anthropic-ratelimit-input-tokens-limit", "40000"),
                ("anthropic-ratelimit-input-tokens-remaining", "30000"),
                (
                    "anthropic-ratelimit-input-tokens-reset",
                    "2027-01-01T00:00:00Z"
                ),
                ("anthropic-ratelimit-output-tokens-limit", "8000"),
                ("anthropic-ratelimit-output-tokens-remaining", "100"),
                (
                    "anthropic-ratelimit-output-tokens-reset",
                    "2027-01-01T00:00:50Z"
                ),
            ])
        );
        let tokens = [(Some(Kind::Tokens), v(true, 1_000, 900, 0, 0))];
        assert_eq!(
            fields(Dialect::Anthropic, &tokens, 1_500, false),
            pairs(&[
                ("anthropic-ratelimit-tokens-limit", "1000"),
                ("anthropic-ratelimit-tokens-remaining", "900"),
                ("anthropic-ratelimit-tokens-reset", "1970-01-01T00:00:02Z"),
            ])
        );
    }

    fn report<'a>(name: &'a str, unit: Option<&'a str>, verdict: Verdict) -> Report<'a> {
        Report {
            name,
            unit,
            verdict,
            texts: None,
        }
    }

    #[test]
    fn bodies_name_the_limit_and_the_wait() {
        let tpm = report("tpm", Some("tokens"), v(false, 2_000, 0, 41_001, 41_001));
        let reported = [report("rpm", None, v(true, 10, 4, 0, 0)), tpm];
        let refused = Some(Kind::Tokens);
        let message = "Rate limit \"tpm\" of 2000 tokens per 60 s exceeded; retry in 42 s.";
        let openai: serde_json::Value =
            serde_json::from_str(&body(Dialect::OpenAi, 429, &reported, refused, 42)).unwrap();
        assert_eq!(
            openai,
            serde_json::json!({"error": {"message": message, "type": "tokens", "param": null,
                                         "code": "rate_limit_exceeded"}})
        );
        let anthropic: serde_json::Value =
            serde_json::from_str(&body(Dialect::Anthropic, 429, &reported, refused, 42)).unwrap();
        assert_eq!(
            anthropic,
            serde_json::json!({"type": "error",
                               "error": {"type": "rate_limit_error", "message": message}})
        );
        // A requests rule, or one with no kind (requests in flight): "requests".
        let rpm = report("rpm", None, v(false, 10, 0, 5_000, 5_000));
        let flight = report(
            "flight",
            Some(CONCURRENT_REQUESTS),
            Verdict {
                window_s: 0,
                ..v(false, 3, 0, 1_000, 1_000)
            },
        );
        for (r, kind) in [(rpm, Some(Kind::Requests)), (flight, None)] {
            let b = body(Dialect::OpenAi, 429, &[r], kind, 5);
            let json: serde_json::Value = serde_json::from_str(&b).unwrap();
            assert_eq!(json["error"]["type"], "requests", "{b}");
        }
        let flight_body: serde_json::Value =
            serde_json::from_str(&body(Dialect::Anthropic, 429, &[flight], None, 1)).unwrap();
        assert_eq!(
            flight_body["error"]["message"],
            "Rate limit \"flight\" of 3 requests in flight exceeded; retry in 1 s."
        );
        // The default dialect: the problem body, as before.
        assert_eq!(
            body(Dialect::Default, 429, &reported, refused, 42),
            headers::problem_body(429, &reported, 42)
        );
        assert_eq!(content_type(Dialect::Default), "application/problem+json");
        assert_eq!(content_type(Dialect::OpenAi), "application/json");
        assert_eq!(content_type(Dialect::Anthropic), "application/json");
        // No rule refused (the filter could not decide): a message that says so.
        let none: serde_json::Value =
            serde_json::from_str(&body(Dialect::OpenAi, 429, &[], None, 1)).unwrap();
        assert_eq!(
            none["error"]["message"],
            "The rate limiter could not decide; retry in 1 s."
        );
        assert_eq!(none["error"]["type"], "requests");
    }
}
