//! The parsers of what a provider says of its limits (`ratelimit_core::provider`) on arbitrary
//! bytes: never a panic; every value read is within its bounds; what the dialects write reads
//! back (Go durations, RFC 3339 times); counts agree with `str::parse`; RFC 3339 times and HTTP
//! dates agree with `chrono` wherever the parser accepts them.
//!
//! Input: a byte choosing the check, eight bytes of a number, the rest as a field value.

use crate::Bytes;
use ratelimit_core::dialect::{push_duration, push_rfc3339};
use ratelimit_core::provider::{
    count, go_duration_ms, http_date_ms, read, retry_after_ms, rfc3339_ms, Api, Measure, Reading,
    MAX_WAIT_MS,
};

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let choice = input.u8();
    let n = input.u64();
    let value = input.rest();

    // Whatever the value, each parser answers within its bounds.
    if let Some(ms) = go_duration_ms(value) {
        assert!(ms <= MAX_WAIT_MS);
    }
    if let Some(c) = count(value) {
        assert_eq!(
            std::str::from_utf8(value).unwrap().parse::<u64>().unwrap(),
            c
        );
    } else if let Ok(s) = std::str::from_utf8(value) {
        assert!(s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 19);
    }
    if let Some(ms) = rfc3339_ms(value) {
        // chrono reads the same instant (a leap second as chrono reads it: :59 plus 1 s).
        let text = std::str::from_utf8(value).unwrap();
        let theirs = chrono::DateTime::parse_from_rfc3339(text).unwrap();
        let theirs_ms = theirs.timestamp() as u64 * 1000
            + u64::from(theirs.timestamp_subsec_nanos() % 1_000_000_000).div_ceil(1_000_000);
        let leap = theirs.timestamp_subsec_nanos() >= 1_000_000_000;
        // Ours rounds a fraction up to the millisecond from all its digits, chrono reads nine.
        if !leap {
            assert!(
                ms == theirs_ms || ms == theirs_ms + 1,
                "{text}: {ms} {theirs_ms}"
            );
        }
    }
    if let Some(ms) = http_date_ms(value) {
        let text = std::str::from_utf8(value).unwrap();
        let theirs = chrono::DateTime::parse_from_rfc2822(text).unwrap();
        assert_eq!(ms, theirs.timestamp() as u64 * 1000, "{text}");
    }
    if let Some(ms) = retry_after_ms(Some(value), Some(value), n) {
        assert!(ms <= MAX_WAIT_MS);
    }

    // What the dialects write reads back.
    let ms = n % (MAX_WAIT_MS + 1);
    let mut s = String::new();
    push_duration(&mut s, ms);
    assert_eq!(go_duration_ms(s.as_bytes()), Some(ms), "{s}");
    let at = n % 253_402_300_800_000; // up to the year 9999
    let mut s = String::new();
    push_rfc3339(&mut s, at);
    assert_eq!(
        rfc3339_ms(s.as_bytes()),
        Some(at.div_ceil(1000) * 1000),
        "{s}"
    );

    // A measure from fields the input fills: read whole or not at all.
    let api = if choice & 1 == 0 {
        Api::OpenAi
    } else {
        Api::Anthropic
    };
    let measure = [
        Measure::Requests,
        Measure::Tokens,
        Measure::InputTokens,
        Measure::OutputTokens,
    ][usize::from(choice >> 1) % 4];
    let parts: Vec<&[u8]> = value.splitn(3, |&b| b == b'\n').collect();
    let field = |i: usize| parts.get(i).copied().filter(|p| !p.is_empty());
    let names = ratelimit_core::provider::field_names(api, measure);
    let reading = read(api, measure, n, |name| {
        let i = names?.iter().position(|f| *f == name)?;
        field(i)
    });
    match reading {
        Reading::Said(s) => {
            if let (Some(l), Some(r)) = (s.limit, s.remaining) {
                assert!(r <= l);
            }
            assert!(s.reset_in_ms.is_none_or(|ms| ms <= MAX_WAIT_MS));
            assert!(s.limit.is_some() || s.remaining.is_some() || s.reset_in_ms.is_some());
        }
        Reading::Absent => assert!(names.is_none() || (0..3).all(|i| field(i).is_none())),
        Reading::Invalid => assert!(names.is_some()),
    }
}
