//! A small `strftime` for the `strftime_now` function transformers gives chat templates
//! (templates print dates such as `26 Jul 2024`); the clock is UTC.

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC calendar time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-based day of the year.
    yday: u32,
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Calendar date of a count of days since 1970-01-01 (Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

impl Civil {
    fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let leap_shift = u32::from(month > 2 && is_leap(year));
        Self {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            // 1970-01-01 was a Thursday.
            weekday: (days + 3).rem_euclid(7) as u32,
            yday: cumulative[month as usize - 1] + day + leap_shift,
        }
    }
}

/// Formats the UTC time `unix_secs` with the common `strftime` codes (`%Y %y %m %d %-d %e
/// %H %I %M %S %p %b %B %a %A %j %%`); an unknown code is copied as it is.
pub(crate) fn format_unix(unix_secs: i64, fmt: &str) -> String {
    let t = Civil::from_unix(unix_secs);
    let month = MONTHS[t.month as usize - 1];
    let weekday = WEEKDAYS[t.weekday as usize];
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let two = |n: u32| {
            if no_pad {
                n.to_string()
            } else {
                format!("{n:02}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            Some('m') => out.push_str(&two(t.month)),
            Some('d') => out.push_str(&two(t.day)),
            Some('e') => out.push_str(&format!("{:>2}", t.day)),
            Some('H') => out.push_str(&two(t.hour)),
            Some('I') => out.push_str(&two(hour12)),
            Some('M') => out.push_str(&two(t.minute)),
            Some('S') => out.push_str(&two(t.second)),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('j') => out.push_str(&if no_pad {
                t.yday.to_string()
            } else {
                format!("{:03}", t.yday)
            }),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::format_unix;

    #[test]
    fn known_dates() {
        // 2024-07-26 23:05:09 UTC (`date -u -d @1722035109`): a Friday, day 208 of a leap year.
        let t = 1_722_035_109;
        assert_eq!(format_unix(t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format_unix(t, "%A %B %-d, %y %H:%M:%S %I%p %j %%"),
            "Friday July 26, 24 23:05:09 11PM 208 %"
        );
        // The epoch itself, and a day before it.
        assert_eq!(format_unix(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(format_unix(-86_400, "%Y-%m-%d %a %j"), "1969-12-31 Wed 365");
        // 2000 is a leap year: 29 Feb exists and 1 Mar is day 61.
        assert_eq!(format_unix(951_868_800, "%Y-%m-%d %j"), "2000-03-01 061");
    }
}
