//! Where a fixed window begins and ends: windows of one length laid end to end (seconds to
//! weeks, weeks from Monday), or calendar months, at a fixed offset from UTC.
//!
//! Pure integer arithmetic on milliseconds since the Unix epoch, with the proleptic Gregorian
//! calendar of Howard Hinnant's `days_from_civil` / `civil_from_days` (no time zone database,
//! no dependency: it runs the same in wasm32 and natively). A window's identity is its start:
//! two times are in the same window when their bounds are the same.

/// A day, ms.
pub const DAY_MS: u64 = 86_400_000;
/// A week, ms.
pub const WEEK_MS: u64 = 7 * DAY_MS;
/// The longest calendar month (31 days), ms.
pub const LONGEST_MONTH_MS: u64 = 31 * DAY_MS;
/// 1970-01-01 was a Thursday: weeks begin on Mondays, 4 days after multiples of a week.
const MONDAY_MS: u64 = 4 * DAY_MS;
/// The most a UTC offset may be, minutes (±14:00: the widest offset in use, Kiribati's).
pub const MAX_OFFSET_MIN: i32 = 14 * 60;

/// How a fixed window's windows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Windows {
    /// Windows of `len_ms` end to end, each starting `phase_ms` (less than `len_ms`) after a
    /// multiple of `len_ms` since the epoch.
    Every {
        /// The windows' length, ms.
        len_ms: u64,
        /// Where they start, past each multiple of `len_ms`, ms.
        phase_ms: u64,
    },
    /// Calendar months: each starts at 00:00 on the 1st, `offset_min` minutes ahead of UTC.
    Months {
        /// The UTC offset, minutes (`+02:00` is 120).
        offset_min: i32,
    },
}

impl Windows {
    /// Windows of `len_ms` aligned to the epoch (UTC midnight for days).
    pub const fn every(len_ms: u64) -> Windows {
        Windows::Every {
            len_ms,
            phase_ms: 0,
        }
    }

    /// Windows of `len_ms` starting at local midnight (and, for a week, on Monday) at
    /// `offset_min` minutes ahead of UTC.
    pub fn aligned(len_ms: u64, offset_min: i32) -> Windows {
        let len = len_ms.max(1);
        let base = if len == WEEK_MS { MONDAY_MS } else { 0 };
        // Local midnight is `offset` before UTC midnight: the phase is `base - offset` modulo
        // the length, kept in u64 (an offset is at most 14 hours).
        let offset = u64::from(offset_min.unsigned_abs()) * 60_000 % len;
        let phase = match offset_min < 0 {
            true => (base % len + offset) % len,
            false => (base % len + len - offset) % len,
        };
        Windows::Every {
            len_ms: len,
            phase_ms: phase,
        }
    }

    /// The window holding `t_ms`: its start (inclusive) and end (exclusive), ms since the epoch.
    pub fn bounds(self, t_ms: u64) -> (u64, u64) {
        match self {
            Windows::Every { len_ms, phase_ms } => {
                let len = len_ms.max(1);
                let phase = phase_ms % len;
                if t_ms < phase {
                    // Before the first whole window (only in 1970).
                    return (0, phase);
                }
                let start = t_ms - (t_ms - phase) % len;
                (start, start.saturating_add(len))
            }
            Windows::Months { offset_min } => month_bounds(t_ms, offset_min),
        }
    }

    /// The longest window there is: the length itself, or a 31-day month.
    pub fn longest_ms(self) -> u64 {
        match self {
            Windows::Every { len_ms, .. } => len_ms.max(1),
            Windows::Months { .. } => LONGEST_MONTH_MS,
        }
    }
}

/// An offset of `minutes` from UTC as configured: `+02:00`, `-05:30`.
pub fn offset_text(minutes: i64) -> String {
    let sign = if minutes < 0 { '-' } else { '+' };
    let m = minutes.unsigned_abs();
    format!("{sign}{:02}:{:02}", m / 60, m % 60)
}

/// The calendar month holding `t_ms` at `offset_min` from UTC, as UTC bounds.
fn month_bounds(t_ms: u64, offset_min: i32) -> (u64, u64) {
    let offset = i64::from(offset_min) * 60_000;
    let day = i64::try_from(DAY_MS).unwrap_or(i64::MAX);
    let local = i64::try_from(t_ms)
        .unwrap_or(i64::MAX)
        .saturating_add(offset);
    let (y, m, _) = civil_from_days(local.div_euclid(day));
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    let utc =
        |days: i64| u64::try_from(days.saturating_mul(day).saturating_sub(offset)).unwrap_or(0);
    (
        utc(days_from_civil(y, m, 1)),
        utc(days_from_civil(ny, nm, 1)),
    )
}

/// Days since 1970-01-01 of the civil date `y`-`m`-`d` (month 1–12, day 1–31).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let (m, d) = (i64::from(m), i64::from(d));
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400; // [0, 399]
    let mp = if m > 2 { m - 3 } else { m + 9 }; // March is 0
    let doy = (153 * mp + 2) / 5 + d - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

/// The civil date (year, month 1–12, day 1–31) of `z` days since 1970-01-01.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097; // [0, 146096]
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March is 0
    let d = doy - (153 * mp + 2) / 5 + 1; // [1, 31]
    let m = if mp < 10 { mp + 3 } else { mp - 9 }; // [1, 12]
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ms since the epoch of `y-m-d hh:mm:ss` UTC.
    fn at(y: i64, m: u32, d: u32, hh: u64, mm: u64, ss: u64) -> u64 {
        days_from_civil(y, m, d) as u64 * DAY_MS + ((hh * 60 + mm) * 60 + ss) * 1000
    }

    const MONTHS: Windows = Windows::Months { offset_min: 0 };

    #[test]
    fn civil_dates_round_trip_and_know_the_epoch() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        for z in -800_000..800_000 {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn months_end_where_the_calendar_says() {
        // Jan 31 → Feb 1.
        assert_eq!(
            MONTHS.bounds(at(2027, 1, 31, 23, 59, 59)),
            (at(2027, 1, 1, 0, 0, 0), at(2027, 2, 1, 0, 0, 0))
        );
        // February of a common year, of a leap year, of a century (not leap) and of 2000 (leap).
        for (y, days) in [(2027, 28), (2028, 29), (2100, 28), (2000, 29)] {
            let (start, end) = MONTHS.bounds(at(y, 2, 10, 12, 0, 0));
            assert_eq!(
                (start, end),
                (at(y, 2, 1, 0, 0, 0), at(y, 3, 1, 0, 0, 0)),
                "{y}"
            );
            assert_eq!(end - start, days * DAY_MS, "{y}");
        }
        // The leap day is February's.
        assert_eq!(
            MONTHS.bounds(at(2028, 2, 29, 23, 59, 59)).1,
            at(2028, 3, 1, 0, 0, 0)
        );
        // Dec 31 → Jan 1 of the next year.
        assert_eq!(
            MONTHS.bounds(at(2026, 12, 31, 23, 59, 59)),
            (at(2026, 12, 1, 0, 0, 0), at(2027, 1, 1, 0, 0, 0))
        );
    }

    #[test]
    fn a_window_holds_its_first_millisecond_and_not_its_end() {
        let (start, end) = MONTHS.bounds(at(2027, 3, 15, 0, 0, 0));
        assert_eq!(MONTHS.bounds(start), (start, end), "first millisecond");
        assert_eq!(MONTHS.bounds(end - 1), (start, end), "last millisecond");
        assert_eq!(MONTHS.bounds(end - 1000).1, end, "last second");
        assert_eq!(MONTHS.bounds(end).0, end, "the end is the next one's start");
        assert_eq!(
            MONTHS.bounds(start - 1).1,
            start,
            "the previous one ends at the start"
        );
    }

    #[test]
    fn an_offset_moves_the_boundary_across_a_utc_day() {
        // +02:00: the month begins at 22:00 UTC on the last day of the previous one.
        let east = Windows::Months { offset_min: 120 };
        assert_eq!(
            east.bounds(at(2027, 2, 28, 21, 59, 59)),
            (at(2027, 1, 31, 22, 0, 0), at(2027, 2, 28, 22, 0, 0))
        );
        assert_eq!(
            east.bounds(at(2027, 2, 28, 22, 0, 0)).0,
            at(2027, 2, 28, 22, 0, 0)
        );
        // -05:00: it begins at 05:00 UTC on the 1st; 04:59 UTC is still the old month.
        let west = Windows::Months { offset_min: -300 };
        assert_eq!(
            west.bounds(at(2028, 3, 1, 4, 59, 0)).1,
            at(2028, 3, 1, 5, 0, 0)
        );
        assert_eq!(
            west.bounds(at(2028, 3, 1, 5, 0, 0)),
            (at(2028, 3, 1, 5, 0, 0), at(2028, 4, 1, 5, 0, 0))
        );
        // A day at +05:30 starts at 18:30 UTC the day before.
        let day = Windows::aligned(DAY_MS, 330);
        assert_eq!(
            day.bounds(at(2027, 6, 1, 18, 29, 0)),
            (at(2027, 5, 31, 18, 30, 0), at(2027, 6, 1, 18, 30, 0))
        );
    }

    #[test]
    fn weeks_begin_on_monday() {
        // 2026-11-23 is a Monday, 2026-11-26 a Thursday.
        let utc = Windows::aligned(WEEK_MS, 0);
        assert_eq!(
            utc.bounds(at(2026, 11, 26, 4, 0, 0)),
            (at(2026, 11, 23, 0, 0, 0), at(2026, 11, 30, 0, 0, 0))
        );
        assert_eq!(
            utc.bounds(at(2026, 11, 29, 23, 59, 59)).1,
            at(2026, 11, 30, 0, 0, 0)
        );
        // Across a year's end: Monday 2029-12-31 to Monday 2030-01-07.
        assert_eq!(
            utc.bounds(at(2030, 1, 1, 0, 0, 0)).0,
            at(2029, 12, 31, 0, 0, 0)
        );
        // At +02:00 a week begins on Sunday at 22:00 UTC.
        let east = Windows::aligned(WEEK_MS, 120);
        assert_eq!(
            east.bounds(at(2026, 11, 29, 22, 0, 0)).0,
            at(2026, 11, 29, 22, 0, 0)
        );
        assert_eq!(
            east.bounds(at(2026, 11, 29, 21, 59, 59)).1,
            at(2026, 11, 29, 22, 0, 0)
        );
        // Days without an offset are the epoch's: the windows fixed_window always had.
        assert_eq!(Windows::aligned(DAY_MS, 0), Windows::every(DAY_MS));
    }
}
