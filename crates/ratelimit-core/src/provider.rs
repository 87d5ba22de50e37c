//! What an LLM provider says of its own limits in each answer, read strictly: OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (a reset as a Go duration, `6m0s`),
//! Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
//! remaining,reset}` (a reset as an RFC 3339 time), and a refusal's `retry-after-ms` /
//! `retry-after`.
//!
//! These fields come from the upstream, which may be any server: every value is checked whole,
//! and a measure with one malformed field (a sign, a space, a list of two values, a remaining
//! above its limit, a wait past a day) is [`Reading::Invalid`] as a whole, never half read. The
//! values are given as HTTP reads them: a field on two lines is the list of both. No parser
//! allocates.
//!
//! The building block of a capacity learned from the provider (a shared capacity is held to what
//! the provider says remains); the formats are the inverses of what [`crate::dialect`] writes.

use crate::limiter::calendar::days_from_civil;

/// The longest wait or reset read: a day. A provider's limits are per minute or per day; a
/// longer one is taken for garbage.
pub const MAX_WAIT_MS: u64 = 86_400_000;

/// Whose fields to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `x-ratelimit-*-requests`, `x-ratelimit-*-tokens`.
    OpenAi,
    /// `anthropic-ratelimit-*`.
    Anthropic,
}

/// What a provider counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    Requests,
    Tokens,
    /// Anthropic only.
    InputTokens,
    /// Anthropic only.
    OutputTokens,
}

/// One measure as the provider stated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Said {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    /// How long until the measure is whole again, from the answer's time.
    pub reset_in_ms: Option<u64>,
}

/// One measure of one answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// None of its fields.
    Absent,
    Said(Said),
    /// At least one field present but malformed, or a remaining above its limit.
    Invalid,
}

/// The three field names of `measure` in `api`'s answers (limit, remaining, reset); `None` for
/// a measure the API does not state.
pub fn field_names(api: Api, measure: Measure) -> Option<[&'static str; 3]> {
    Some(match (api, measure) {
        (Api::OpenAi, Measure::Requests) => [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
        (Api::OpenAi, Measure::Tokens) => [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        (Api::OpenAi, _) => return None,
        (Api::Anthropic, Measure::Requests) => [
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
        ],
        (Api::Anthropic, Measure::Tokens) => [
            "anthropic-ratelimit-tokens-limit",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
        ],
        (Api::Anthropic, Measure::InputTokens) => [
            "anthropic-ratelimit-input-tokens-limit",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
        ],
        (Api::Anthropic, Measure::OutputTokens) => [
            "anthropic-ratelimit-output-tokens-limit",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
        ],
    })
}

/// Reads `measure` from an answer received at `now_ms`, whose header values `header` gives.
pub fn read<'a>(
    api: Api,
    measure: Measure,
    now_ms: u64,
    mut header: impl FnMut(&str) -> Option<&'a [u8]>,
) -> Reading {
    let Some([limit, remaining, reset]) = field_names(api, measure) else {
        return Reading::Absent;
    };
    let (limit, remaining, reset) = (header(limit), header(remaining), header(reset));
    if limit.is_none() && remaining.is_none() && reset.is_none() {
        return Reading::Absent;
    }
    let reset_in_ms = |v: &[u8]| match api {
        Api::OpenAi => go_duration_ms(v),
        Api::Anthropic => rfc3339_ms(v).map(|at| at.saturating_sub(now_ms)),
    };
    let field = |v: Option<&[u8]>, parse: &dyn Fn(&[u8]) -> Option<u64>| match v {
        None => Ok(None),
        Some(v) => parse(v).map(Some).ok_or(()),
    };
    let said = (|| {
        Ok::<_, ()>(Said {
            limit: field(limit, &count)?,
            remaining: field(remaining, &count)?,
            reset_in_ms: field(reset, &|v| reset_in_ms(v).filter(|&ms| ms <= MAX_WAIT_MS))?,
        })
    })();
    match said {
        Ok(s) if matches!((s.limit, s.remaining), (Some(l), Some(r)) if r > l) => Reading::Invalid,
        Ok(s) => Reading::Said(s),
        Err(()) => Reading::Invalid,
    }
}

/// How long a refusal asks to wait, at `now_ms`: `retry-after-ms` (milliseconds, a fraction
/// rounded up) if it is valid, else `retry-after` (whole seconds, or an HTTP date); `None` when
/// neither is, or the wait is past [`MAX_WAIT_MS`].
pub fn retry_after_ms(
    retry_after_ms: Option<&[u8]>,
    retry_after: Option<&[u8]>,
    now_ms: u64,
) -> Option<u64> {
    let from_ms = retry_after_ms.and_then(decimal_ms);
    let from_s = || {
        let v = retry_after?;
        match count(v) {
            Some(s) => s.checked_mul(1000),
            None => http_date_ms(v).map(|at| at.saturating_sub(now_ms)),
        }
    };
    from_ms.or_else(from_s).filter(|&ms| ms <= MAX_WAIT_MS)
}

/// A count: 1 to 19 ASCII digits, nothing else.
pub fn count(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Milliseconds written in decimal, perhaps with a fraction (`20`, `1500.5`), rounded up.
fn decimal_ms(v: &[u8]) -> Option<u64> {
    let (int, frac) = match v.iter().position(|&b| b == b'.') {
        Some(at) => (v.get(..at)?, v.get(at + 1..)?),
        None => (v, &[][..]),
    };
    if int.len() > 12 || !frac.iter().all(u8::is_ascii_digit) || frac.len() > 19 {
        return None;
    }
    let whole = count(int)?;
    Some(whole + u64::from(frac.iter().any(|&d| d != b'0')))
}

/// A Go duration (`0`, `20ms`, `1.5s`, `6m0s`, `1h2m3.004s`; units `h`, `m`, `s`, `ms`, `us`,
/// `µs`, `μs`, `ns`; no sign) in milliseconds, rounded up; `None` past [`MAX_WAIT_MS`].
pub fn go_duration_ms(v: &[u8]) -> Option<u64> {
    if v == b"0" {
        return Some(0);
    }
    if v.is_empty() {
        return None;
    }
    let mut rest = v;
    let mut ns: u128 = 0;
    let mut parts = 0;
    while !rest.is_empty() {
        parts += 1;
        if parts > 8 {
            return None;
        }
        let int_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.split_first() {
            Some((b'.', after)) => {
                let n = after.iter().take_while(|b| b.is_ascii_digit()).count();
                after.split_at(n)
            }
            _ => (&[][..], after),
        };
        if (int.is_empty() && frac.is_empty()) || int.len() > 12 || frac.len() > 18 {
            return None;
        }
        let (unit, after) = unit_ns(after)?;
        let whole = int.iter().fold(0u128, |n, d| n * 10 + u128::from(d - b'0'));
        let scale = 10u128.pow(u32::try_from(frac.len()).ok()?);
        let part = frac
            .iter()
            .fold(0u128, |n, d| n * 10 + u128::from(d - b'0'));
        ns += whole * unit + (part * unit).div_ceil(scale);
        if ns > u128::from(MAX_WAIT_MS) * 1_000_000 {
            return None;
        }
        rest = after;
    }
    u64::try_from(ns.div_ceil(1_000_000)).ok()
}

/// A Go duration unit at the start of `v`, in nanoseconds, and what follows it.
fn unit_ns(v: &[u8]) -> Option<(u128, &[u8])> {
    const UNITS: [(&[u8], u128); 8] = [
        (b"ns", 1),
        (b"us", 1_000),
        ("µs".as_bytes(), 1_000),
        ("μs".as_bytes(), 1_000),
        (b"ms", 1_000_000),
        (b"s", 1_000_000_000),
        (b"m", 60_000_000_000),
        (b"h", 3_600_000_000_000),
    ];
    UNITS
        .iter()
        .find_map(|(name, ns)| v.strip_prefix(*name).map(|rest| (*ns, rest)))
}

/// Digits `v[at..at + n]` as a number.
fn digits(v: &[u8], at: usize, n: usize) -> Option<u64> {
    count(v.get(at..at + n)?)
}

/// An RFC 3339 time (`2026-11-26T04:40:53Z`, `…53.5+01:00`; `t` and `z` too; a leap second
/// read as :59) in milliseconds since the epoch, a fraction rounded up.
pub fn rfc3339_ms(v: &[u8]) -> Option<u64> {
    let sep = |at: usize, ok: &[u8]| v.get(at).is_some_and(|b| ok.contains(b));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (y, mo, d) = (digits(v, 0, 4)?, digits(v, 5, 2)?, digits(v, 8, 2)?);
    let (h, mi, s) = (digits(v, 11, 2)?, digits(v, 14, 2)?, digits(v, 17, 2)?);
    let mut rest = v.get(19..)?;
    let mut frac_ms = 0;
    if let Some(after) = rest.strip_prefix(b".") {
        let n = after.iter().take_while(|b| b.is_ascii_digit()).count();
        let (frac, after) = after.split_at(n);
        if frac.is_empty() || frac.len() > 18 {
            return None;
        }
        let first3 = frac
            .iter()
            .chain(std::iter::repeat(&b'0'))
            .take(3)
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        frac_ms = first3 + u64::from(frac.iter().skip(3).any(|&d| d != b'0'));
        rest = after;
    }
    let offset_min: i64 = match rest {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let oh = count(&[*h1, *h2])?;
            let om = count(&[*m1, *m2])?;
            if oh > 23 || om > 59 {
                return None;
            }
            let m = i64::try_from(oh * 60 + om).ok()?;
            if *sign == b'-' {
                -m
            } else {
                m
            }
        }
        _ => return None,
    };
    let days_in = match mo {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        _ => return None,
    };
    if y < 1970 || d == 0 || d > days_in || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(
        i64::try_from(y).ok()?,
        u32::try_from(mo).ok()?,
        u32::try_from(d).ok()?,
    );
    let secs =
        days * 86_400 + i64::try_from(h * 3600 + mi * 60 + s.min(59)).ok()? - offset_min * 60;
    let ms = u64::try_from(secs).ok()?.checked_mul(1000)?;
    ms.checked_add(frac_ms)
}

/// An HTTP date in the preferred format (RFC 9110's IMF-fixdate, `Sun, 06 Nov 1994 08:49:37
/// GMT`) in milliseconds since the epoch.
pub fn http_date_ms(v: &[u8]) -> Option<u64> {
    const MONTHS: [&[u8; 3]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    const DAYS: [&[u8; 3]; 7] = [b"Mon", b"Tue", b"Wed", b"Thu", b"Fri", b"Sat", b"Sun"];
    if v.len() != 29 || !v.ends_with(b" GMT") || v.get(3..5) != Some(b", ") {
        return None;
    }
    let sep = |at: usize, b: u8| v.get(at) == Some(&b);
    if !(sep(7, b' ') && sep(11, b' ') && sep(16, b' ') && sep(19, b':') && sep(22, b':')) {
        return None;
    }
    let month = MONTHS.iter().position(|m| v.get(8..11) == Some(&m[..]))? + 1;
    let text = format_rfc3339(digits(v, 12, 4)?, month, digits(v, 5, 2)?, v.get(17..25)?)?;
    let ms = rfc3339_ms(&text)?;
    // The day's name must be the date's (1970-01-01 was a Thursday).
    let weekday = (ms / 86_400_000 + 3) % 7;
    let named = DAYS.get(usize::try_from(weekday).ok()?)?;
    (v.get(..3) == Some(&named[..])).then_some(ms)
}

/// `YYYY-MM-DDTHH:MM:SSZ` from an HTTP date's parts (`clock`: `HH:MM:SS`), checked by
/// [`rfc3339_ms`] after.
fn format_rfc3339(y: u64, mo: usize, d: u64, clock: &[u8]) -> Option<[u8; 20]> {
    let mut out = *b"0000-00-00T00:00:00Z";
    let put = |out: &mut [u8; 20], at: usize, n: u64, width: usize| {
        let mut n = n;
        for i in (0..width).rev() {
            if let Some(b) = out.get_mut(at + i) {
                *b = b'0' + (n % 10) as u8;
            }
            n /= 10;
        }
    };
    put(&mut out, 0, y, 4);
    put(&mut out, 5, u64::try_from(mo).ok()?, 2);
    put(&mut out, 8, d, 2);
    out.get_mut(11..19)?.copy_from_slice(clock);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        for (text, ms) in [
            ("0", 0),
            ("0s", 0),
            ("20ms", 20),
            ("1s", 1000),
            ("1.5s", 1500),
            ("6m0s", 360_000),
            ("1h2m3.004s", 3_723_004),
            ("59.0001s", 59_001),
            ("1us", 1),
            ("1µs", 1),
            ("1μs", 1),
            ("999999ns", 1),
            (".5s", 500),
            ("1.s", 1000),
            ("24h", MAX_WAIT_MS),
        ] {
            assert_eq!(go_duration_ms(text.as_bytes()), Some(ms), "{text}");
        }
        for bad in [
            "",
            "s",
            "1",
            "-1s",
            "+1s",
            "1 s",
            " 1s",
            "1s ",
            "1x",
            "24h0.001s",
            "1e3s",
            ".s",
            "1s,2s",
            "1m1m1m1m1m1m1m1m1m",
            "9999999999999h",
        ] {
            assert_eq!(go_duration_ms(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn rfc3339_times() {
        let at = rfc3339_ms(b"2026-11-26T04:40:53Z").unwrap();
        assert_eq!(at, 1_795_668_053_000);
        assert_eq!(rfc3339_ms(b"2026-11-26t04:40:53z"), Some(at));
        assert_eq!(rfc3339_ms(b"2026-11-26T05:40:53+01:00"), Some(at));
        assert_eq!(rfc3339_ms(b"2026-11-26T03:10:53-01:30"), Some(at));
        assert_eq!(rfc3339_ms(b"2026-11-26T04:40:53.5Z"), Some(at + 500));
        assert_eq!(rfc3339_ms(b"2026-11-26T04:40:53.0001Z"), Some(at + 1));
        assert_eq!(
            rfc3339_ms(b"2016-12-31T23:59:60Z"),
            rfc3339_ms(b"2016-12-31T23:59:59Z")
        );
        assert!(rfc3339_ms(b"2024-02-29T00:00:00Z").is_some());
        for bad in [
            "2026-11-26T04:40:53",
            "2026-11-26 04:40:53Z",
            "2026-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-26T24:00:00Z",
            "2026-11-26T04:60:00Z",
            "2026-11-26T04:40:53.Z",
            "2026-11-26T04:40:53+1:00",
            "1969-12-31T23:59:59Z",
            "+2026-11-26T04:40:53Z",
            "2026-11-26T04:40:53ZZ",
            "",
        ] {
            assert_eq!(rfc3339_ms(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn waits_of_a_refusal() {
        let now = rfc3339_ms(b"1994-11-06T08:49:30Z").unwrap();
        assert_eq!(retry_after_ms(Some(b"1500.2"), Some(b"9"), now), Some(1501));
        assert_eq!(retry_after_ms(Some(b"20"), None, now), Some(20));
        assert_eq!(retry_after_ms(Some(b"-1"), Some(b"9"), now), Some(9000));
        assert_eq!(retry_after_ms(None, Some(b"9"), now), Some(9000));
        assert_eq!(
            retry_after_ms(None, Some(b"Sun, 06 Nov 1994 08:49:37 GMT"), now),
            Some(7000)
        );
        assert_eq!(
            retry_after_ms(None, Some(b"Sun, 06 Nov 1994 08:49:27 GMT"), now),
            Some(0)
        );
        for bad in [
            "",
            "1.5",
            "-3",
            "9 ",
            "86401",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 31 Nov 1994 08:49:37 GMT",
            "Sat, 06 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(
                retry_after_ms(None, Some(bad.as_bytes()), now),
                None,
                "{bad}"
            );
        }
        assert_eq!(retry_after_ms(None, None, now), None);
    }

    fn answer<'a>(fields: &'a [(&'a str, &'a str)]) -> impl FnMut(&str) -> Option<&'a [u8]> + 'a {
        move |name| {
            fields
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_bytes())
        }
    }

    #[test]
    fn measures_are_read_whole_or_not_at_all() {
        let openai = [
            ("x-ratelimit-limit-requests", "500"),
            ("x-ratelimit-remaining-requests", "499"),
            ("x-ratelimit-reset-requests", "120ms"),
            ("x-ratelimit-limit-tokens", "30000"),
            ("x-ratelimit-remaining-tokens", "29990"),
            ("x-ratelimit-reset-tokens", "20ms"),
        ];
        assert_eq!(
            read(Api::OpenAi, Measure::Tokens, 0, answer(&openai)),
            Reading::Said(Said {
                limit: Some(30_000),
                remaining: Some(29_990),
                reset_in_ms: Some(20)
            })
        );
        assert_eq!(
            read(Api::OpenAi, Measure::InputTokens, 0, answer(&openai)),
            Reading::Absent
        );
        assert_eq!(
            read(Api::Anthropic, Measure::Tokens, 0, answer(&openai)),
            Reading::Absent
        );
        let now = rfc3339_ms(b"2026-11-26T04:40:00Z").unwrap();
        let anthropic = [
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2026-11-26T04:40:53Z",
            ),
        ];
        assert_eq!(
            read(
                Api::Anthropic,
                Measure::InputTokens,
                now,
                answer(&anthropic)
            ),
            Reading::Said(Said {
                limit: Some(40_000),
                remaining: Some(39_000),
                reset_in_ms: Some(53_000)
            })
        );
        // A reset in the past is now.
        let later = now + 3_600_000;
        assert!(matches!(
            read(
                Api::Anthropic,
                Measure::InputTokens,
                later,
                answer(&anthropic)
            ),
            Reading::Said(Said {
                reset_in_ms: Some(0),
                ..
            })
        ));
        // One bad field spoils its measure, not the others.
        for (name, value) in [
            ("x-ratelimit-remaining-tokens", "-1"),
            ("x-ratelimit-remaining-tokens", "30001"),
            ("x-ratelimit-remaining-tokens", "1, 2"),
            ("x-ratelimit-limit-tokens", "1e9"),
            ("x-ratelimit-reset-tokens", "2026-11-26T04:40:53Z"),
            ("x-ratelimit-reset-tokens", "25h"),
        ] {
            let mut bad = openai.to_vec();
            bad.retain(|(n, _)| *n != name);
            bad.push((name, value));
            assert_eq!(
                read(Api::OpenAi, Measure::Tokens, 0, answer(&bad)),
                Reading::Invalid,
                "{name}: {value}"
            );
            assert!(matches!(
                read(Api::OpenAi, Measure::Requests, 0, answer(&bad)),
                Reading::Said(_)
            ));
        }
        // A measure stated in part is read in part.
        let part = [("x-ratelimit-remaining-requests", "0")];
        assert_eq!(
            read(Api::OpenAi, Measure::Requests, 0, answer(&part)),
            Reading::Said(Said {
                limit: None,
                remaining: Some(0),
                reset_in_ms: None
            })
        );
    }

    #[test]
    fn counts() {
        assert_eq!(count(b"0"), Some(0));
        assert_eq!(
            count(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in ["", "-1", "+1", "1.0", " 1", "10000000000000000000", "١"] {
            assert_eq!(count(bad.as_bytes()), None, "{bad}");
        }
    }
}
