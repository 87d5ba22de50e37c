//! The calendar arithmetic of fixed windows (`limiter::calendar`) and Anthropic's RFC 3339
//! times against an independent date library (`chrono`): for arbitrary instants (to the year
//! 9999) and UTC offsets (±14:00), the same start and end for calendar months, local days and
//! weeks from Monday; the same civil dates for day numbers; the same time text. Beyond: no
//! panic for any u64 instant, and every window holds its instant, its first and last
//! millisecond.
//!
//! Input: the instant, the offset, a window length, a day number.

use crate::Bytes;
use chrono::{DateTime, Datelike, Days, FixedOffset, NaiveDate, Timelike};
use ratelimit_core::dialect::push_rfc3339;
use ratelimit_core::limiter::calendar::{
    civil_from_days, days_from_civil, offset_text, Windows, DAY_MS, MAX_OFFSET_MIN, WEEK_MS,
};

/// 10000-01-01T00:00:00Z, ms.
const YEAR_10000_MS: u64 = 253_402_300_800_000;
/// Days from 0001-01-01 (chrono's day 1 of the common era) to 1970-01-01.
const EPOCH_CE_DAYS: i64 = 719_163;

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let raw = input.u64();
    let offset_min = i32::from(input.u16() % (2 * MAX_OFFSET_MIN as u16 + 1)) - MAX_OFFSET_MIN;
    let len = match input.u8() % 4 {
        0 => DAY_MS,
        1 => WEEK_MS,
        2 => 3_600_000,
        _ => 1 + u64::from(input.u32()),
    };
    let z = i64::from(input.u32() as i32) * 97;

    // Any instant: no panic, and the windows hold it while the arithmetic can.
    for t in [raw, raw % YEAR_10000_MS, raw % 4_102_444_800_000] {
        for w in [
            Windows::Months { offset_min },
            Windows::aligned(len, offset_min),
            Windows::every(len),
        ] {
            let (start, end) = w.bounds(t);
            if t < YEAR_10000_MS {
                assert!(start <= t && t < end, "{w:?} at {t}: {start}..{end}");
                assert_eq!(w.bounds(start), (start, end), "{w:?} at {t}: its start");
                assert_eq!(w.bounds(end - 1), (start, end), "{w:?} at {t}: its end");
                assert_eq!(w.bounds(end).0, end, "{w:?} at {t}: the next one");
                assert!(end - start <= w.longest_ms(), "{w:?} at {t}");
            }
        }
        let mut text = String::new();
        push_rfc3339(&mut text, t);
        if t < YEAR_10000_MS - 1000 {
            assert_eq!(text, rfc3339(t), "{t}");
        }
    }

    // Against chrono, to the year 9999.
    let t = raw % YEAR_10000_MS;
    let offset = i64::from(offset_min) * 60_000;
    let local = DateTime::from_timestamp_millis(t as i64)
        .unwrap()
        .with_timezone(&FixedOffset::east_opt(offset_min * 60).unwrap())
        .date_naive();
    // A local date's midnight, as UTC ms (the code starts no window before the epoch).
    let utc = |d: NaiveDate| {
        let ms = d.and_hms_opt(0, 0, 0).unwrap().and_utc().timestamp_millis() - offset;
        u64::try_from(ms.max(0)).unwrap()
    };
    let first = local.with_day(1).unwrap();
    let next = first.checked_add_months(chrono::Months::new(1)).unwrap();
    let months = Windows::Months { offset_min }.bounds(t);
    assert_eq!(
        months,
        (utc(first), utc(next)),
        "month at {t} {offset_min:+}"
    );
    let day = Windows::aligned(DAY_MS, offset_min).bounds(t);
    let tomorrow = local.checked_add_days(Days::new(1)).unwrap();
    assert_eq!(
        day,
        (utc(local), utc(tomorrow)),
        "day at {t} {offset_min:+}"
    );
    let monday = local
        .checked_sub_days(Days::new(u64::from(local.weekday().num_days_from_monday())))
        .unwrap();
    let week = Windows::aligned(WEEK_MS, offset_min).bounds(t);
    let next_monday = monday.checked_add_days(Days::new(7)).unwrap();
    assert_eq!(
        week,
        (utc(monday), utc(next_monday)),
        "week at {t} {offset_min:+}"
    );

    // Day numbers and civil dates.
    let ce = i32::try_from(z + EPOCH_CE_DAYS).ok();
    if let Some(date) = ce.and_then(NaiveDate::from_num_days_from_ce_opt) {
        let (y, m, d) = civil_from_days(z);
        assert_eq!(
            (y, m, d),
            (i64::from(date.year()), date.month(), date.day()),
            "day {z}"
        );
        assert_eq!(days_from_civil(y, m, d), z);
    }
    let (y, m, d) = civil_from_days(z * 1000);
    assert_eq!(days_from_civil(y, m, d), z * 1000);

    // The offset as configured reads back.
    let text = offset_text(i64::from(offset_min));
    let sign = if text.starts_with('-') { -1 } else { 1 };
    let (h, mm) = text[1..].split_once(':').unwrap();
    assert_eq!(
        sign * (h.parse::<i32>().unwrap() * 60 + mm.parse::<i32>().unwrap()),
        offset_min
    );
}

/// chrono's RFC 3339 of `ms`, rounded up to the second.
fn rfc3339(ms: u64) -> String {
    let t = DateTime::from_timestamp(ms.div_ceil(1000) as i64, 0).unwrap();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        t.month(),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}
