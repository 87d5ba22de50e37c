//! Billing periods in a real Envoy: a `month` fixed window refuses until the end of the
//! calendar month, and a `week` with a UTC offset until its Monday's midnight there, with
//! every field exact. Envoy's clock cannot be moved, so the expected values come from today's
//! date, computed by GNU `date` (not by the filter's calendar), within two seconds.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{date, now_ms, utc_month as month_of, Client, Envoy};

const CONFIG: &str = r#"{"rules": [
  {"name": "monthly", "match": {"path_prefix": "/month"}, "algorithm": "fixed_window",
   "rate_limit": {"requests_per_unit": 1, "unit": "month"}},
  {"name": "weekly-east", "match": {"path_prefix": "/week"}, "algorithm": "fixed_window",
   "rate_limit": {"requests_per_unit": 1, "unit": "week", "utc_offset": "+05:30"}}
]}"#;

/// The end of the week (Monday 00:00 at `offset` s east of UTC) holding `t`, s since the epoch.
fn week_end(t: i64, offset: i64) -> i64 {
    let local = t + offset;
    // ISO weekday of the local date: 1 is Monday.
    let weekday = date(&["-u", "-d", &format!("@{local}"), "+%u"]);
    let monday = local.div_euclid(86_400) - (weekday - 1);
    (monday + 7) * 86_400 - offset
}

/// A parameter of the item of a structured field list, e.g. `t` of `"monthly";r=0;t=5`.
fn param(field: &str, name: &str) -> i64 {
    field
        .split(';')
        .find_map(|p| p.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {field}"))
        .parse()
        .unwrap()
}

/// Whether `got` seconds is the time from a moment between `before` and `after` (ms) to
/// `end` (s), rounded up, within a second either way.
fn to_end(got: i64, end: i64, (before, after): (u64, u64)) -> bool {
    let most = end - before as i64 / 1000;
    let least = end - after.div_ceil(1000) as i64;
    (least - 1..=most + 1).contains(&got)
}

#[test]
fn a_monthly_budget_refuses_to_the_end_of_the_month_with_exact_fields() {
    let envoy = Envoy::start(CONFIG);
    let mut c = Client::connect(envoy.addr).unwrap();
    let before = now_ms();
    let (start, end) = month_of(before as i64 / 1000);
    if end * 1000 - (before as i64) < 10_000 {
        // Seconds from the month's end: the next month would answer.
        std::thread::sleep(std::time::Duration::from_secs(12));
    }
    let before = now_ms();
    let (start, end) = if before as i64 / 1000 >= end {
        month_of(before as i64 / 1000)
    } else {
        (start, end)
    };
    let w = end - start;
    assert!([28, 29, 30, 31].map(|d| d * 86_400).contains(&w), "{w}");

    let ok = c.get("/month").unwrap();
    let refused = c.get("/month").unwrap();
    let after = now_ms();
    let span = (before, after);
    assert_eq!(ok.status, 200);
    assert_eq!(refused.status, 429);
    let policy = format!("\"monthly\";q=1;w={w}");
    for r in [&ok, &refused] {
        assert_eq!(r.header("ratelimit-policy"), Some(policy.as_str()));
        let rate = r.header("ratelimit").unwrap();
        assert!(rate.starts_with("\"monthly\";r=0;t="), "{rate}");
        assert!(
            to_end(param(rate, "t"), end, span),
            "t in {rate}, end {end}"
        );
        let reset = r.header_u64("x-ratelimit-reset").unwrap() as i64;
        assert!(
            to_end(reset, end, span),
            "x-ratelimit-reset {reset}, end {end}"
        );
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"));
    }
    let retry = refused.header_u64("retry-after").unwrap() as i64;
    assert!(to_end(retry, end, span), "retry-after {retry}, end {end}");
    assert_eq!(
        refused.header_u64("x-ratelimit-retry-after"),
        Some(retry as u64)
    );
    assert_eq!(param(refused.header("ratelimit").unwrap(), "t"), retry);
    let body = refused.body_str();
    assert!(
        body.contains(&format!("\"retry-after\":{retry}}}")),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "of 1 requests per {w} s exceeded; retry in {retry} s."
        )),
        "{body}"
    );
}

#[test]
fn a_week_at_a_utc_offset_ends_at_its_monday_midnight_there() {
    let envoy = Envoy::start(CONFIG);
    let mut c = Client::connect(envoy.addr).unwrap();
    let offset = 5 * 3_600 + 30 * 60;
    let mut before = now_ms();
    if week_end(before as i64 / 1000, offset) * 1000 - (before as i64) < 10_000 {
        std::thread::sleep(std::time::Duration::from_secs(12));
        before = now_ms();
    }
    let end = week_end(before as i64 / 1000, offset);
    assert_eq!(c.get("/week").unwrap().status, 200);
    let refused = c.get("/week").unwrap();
    let span = (before, now_ms());
    assert_eq!(refused.status, 429);
    assert_eq!(
        refused.header("ratelimit-policy"),
        Some("\"weekly-east\";q=1;w=604800")
    );
    let retry = refused.header_u64("retry-after").unwrap() as i64;
    assert!(to_end(retry, end, span), "retry-after {retry}, end {end}");
    // Not the epoch's weeks (Thursday to Thursday), nor UTC's Mondays.
    assert!(retry <= 604_800);
    let utc_monday = week_end(span.0 as i64 / 1000, 0);
    assert!(!to_end(retry, utc_monday, span), "UTC's Monday");
}
