//! What clients are told, for arbitrary verdicts of rules with any name and quota unit the
//! configuration accepts (`[A-Za-z0-9_.-]{1,64}`, `[a-z0-9-]+`): every rate-limit header field
//! (IETF, X-RateLimit, OpenAI's and Anthropic's) has a lower-case token name and a value of
//! visible ASCII (no CR, no LF); the IETF fields are structured-field lists of the rules' names;
//! every limited reply's body is JSON; OpenAI's durations read back to the milliseconds they
//! were written from (`1h2m3.004s`).
//!
//! Input: the rules (name, unit, verdict), then the clock.

use crate::{assert_json, header_name_ok, header_value_ok, Bytes};
use ratelimit_core::config::{Dialect, HeaderStyle, Kind, CONCURRENT_REQUESTS};
use ratelimit_core::dialect;
use ratelimit_core::headers::{self, Report, Texts};
use ratelimit_core::limiter::Verdict;

const NAME: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-";
const UNIT: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-";
const UNITS: [&str; 6] = [
    "tokens",
    "input-tokens",
    "output-tokens",
    "requests",
    CONCURRENT_REQUESTS,
    "bytes",
];

fn word(input: &mut Bytes, alphabet: &[u8], max: usize) -> String {
    let n = 1 + input.below(max);
    (0..n)
        .map(|_| char::from(alphabet[input.below(alphabet.len())]))
        .collect()
}

/// A number, often a small or an extreme one.
fn number(input: &mut Bytes) -> u64 {
    match input.u8() % 4 {
        0 => u64::from(input.u8()),
        1 => u64::from(input.u32()),
        2 => u64::MAX - u64::from(input.u8()),
        _ => input.u64(),
    }
}

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let n = 1 + input.below(4);
    let mut rules = Vec::new();
    for _ in 0..n {
        let name = word(&mut input, NAME, 64);
        let unit = match input.u8() % 4 {
            0 => None,
            1 => Some(word(&mut input, UNIT, 24)),
            _ => Some(UNITS[input.below(UNITS.len())].to_string()),
        };
        let verdict = Verdict {
            allowed: input.bool(),
            limit: number(&mut input),
            window_s: number(&mut input),
            remaining: number(&mut input),
            reset_ms: number(&mut input),
            retry_after_ms: number(&mut input),
            delay_ms: number(&mut input),
        };
        let texts = input.bool().then(|| {
            let (limit, window) = (number(&mut input), number(&mut input));
            Texts::new(&name, unit.as_deref(), limit, window)
        });
        rules.push((name, unit, verdict, texts));
    }
    let now_ms = number(&mut input);
    let limited = input.bool();
    let status = 400 + input.u16() % 200;
    let reports: Vec<Report> = rules
        .iter()
        .map(|(name, unit, verdict, texts)| Report {
            name,
            unit: unit.as_deref(),
            verdict: *verdict,
            texts: texts.as_ref(),
        })
        .collect();

    let mut buf = String::new();
    for style in [
        HeaderStyle::Ietf,
        HeaderStyle::XRateLimit,
        HeaderStyle::Both,
        HeaderStyle::None,
    ] {
        headers::each_rate_limit_header(
            style,
            reports.iter().copied(),
            limited,
            &mut buf,
            |k, v| {
                field(k, v);
                if k.starts_with("ratelimit") {
                    sf_list(v, &reports);
                }
            },
        );
        let fields = headers::rate_limit_headers(style, &reports, limited);
        for (k, v) in fields.iter() {
            field(k, v);
        }
    }
    let classed: Vec<dialect::Classed> = rules
        .iter()
        .map(|(_, unit, v, _)| (Kind::of_unit(unit.as_deref()), *v))
        .collect();
    let retry_s = headers::retry_after_seconds(&reports);
    assert!(retry_s >= 1);
    for d in [Dialect::Default, Dialect::OpenAi, Dialect::Anthropic] {
        dialect::each_field(d, &classed, now_ms, limited, &mut buf, field);
        let refused = classed
            .iter()
            .find(|(_, v)| !v.allowed)
            .and_then(|(k, _)| *k);
        assert_json(&dialect::body(d, status, &reports, refused, retry_s));
    }
    assert_json(&headers::problem_body(status, &reports, retry_s));

    // OpenAI's durations.
    for (_, _, v, _) in &rules {
        for ms in [v.reset_ms, v.retry_after_ms, v.limit % 100_000_000] {
            buf.clear();
            dialect::push_duration(&mut buf, ms);
            assert_eq!(go_duration_ms(&buf), Some(ms), "{buf}");
        }
    }
}

fn field(name: &str, value: &str) {
    assert!(header_name_ok(name), "header name {name:?}");
    assert!(header_value_ok(value), "{name}: {value:?}");
}

/// An IETF field's value: a list of `"name";key=value` items, one per rule, in order.
fn sf_list(value: &str, reports: &[Report]) {
    let items: Vec<&str> = value.split(", ").collect();
    assert_eq!(items.len(), reports.len(), "{value}");
    for (item, r) in items.iter().zip(reports) {
        let mut params = item.split(';');
        assert_eq!(
            params.next(),
            Some(format!("\"{}\"", r.name).as_str()),
            "{value}"
        );
        for p in params {
            let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("{value}"));
            assert!(["q", "w", "r", "t", "qu"].contains(&k), "{value}");
            let ok = match k {
                "qu" => v.len() > 2 && v.starts_with('"') && v.ends_with('"'),
                _ => !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()),
            };
            assert!(ok, "{value}");
        }
    }
}

/// Go's duration format read back, to the millisecond: `0s`, `20ms`, `1h2m3.004s`.
fn go_duration_ms(text: &str) -> Option<u64> {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok().filter(|n: &u64| (1..1000).contains(n));
    }
    let mut rest = text.strip_suffix('s')?;
    let mut total: u64 = 0;
    if let Some((h, r)) = rest.split_once('h') {
        total = h.parse::<u64>().ok()?.checked_mul(3_600_000)?;
        rest = r;
    }
    if let Some((m, r)) = rest.split_once('m') {
        total = total.checked_add(m.parse::<u64>().ok()?.checked_mul(60_000)?)?;
        rest = r;
    }
    let (s, frac) = rest.split_once('.').unwrap_or((rest, ""));
    total = total.checked_add(s.parse::<u64>().ok()?.checked_mul(1000)?)?;
    if !frac.is_empty() {
        if frac.len() > 3 || frac.ends_with('0') {
            return None;
        }
        total += format!("{frac:0<3}").parse::<u64>().ok()?;
    }
    Some(total)
}
