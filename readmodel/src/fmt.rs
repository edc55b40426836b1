//! Small text helpers shared by every view: UTC timestamps without a date crate, durations
//! in the unit a person reads fastest, optional numbers as "n/a", and a plain-text table.
//!
//! Invariant: nothing here reads a clock; callers pass `now_ms`, so every view renders the
//! same text for the same inputs.

/// `2026-12-01 03:56:16.123Z` for a Unix time in milliseconds (proleptic Gregorian, UTC).
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        ms % 1000
    )
}

/// `03:56:16.123` (UTC time of day), for one-line-per-decision views.
pub fn utc_time(ms: u64) -> String {
    utc(ms)[11..].trim_end_matches('Z').to_string()
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// A duration in ms: `850 ms`, `12.3 s`, `4m05s`.
pub fn ms(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    if v < 10.0 {
        format!("{v:.1} ms")
    } else if v < 10_000.0 {
        format!("{v:.0} ms")
    } else if v < 120_000.0 {
        format!("{:.1} s", v / 1000.0)
    } else {
        let s = (v / 1000.0).round() as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// How long ago `then_ms` was at `now_ms` (`0.4 s ago`); a timestamp in the future (clock
/// skew between hosts) reads `just now`.
pub fn age(now_ms: u64, then_ms: u64) -> String {
    if then_ms > now_ms {
        return "just now".into();
    }
    let d = (now_ms - then_ms) as f64;
    format!("{} ago", ms(d))
}

/// Token rate from a time per output token: `1000 / tpot_ms`.
pub fn tok_s_from_tpot(tpot_ms: f64) -> Option<f64> {
    (tpot_ms.is_finite() && tpot_ms > 0.0).then(|| 1000.0 / tpot_ms)
}

/// `45.2 tok/s`, or `n/a`.
pub fn tok_s(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.1} tok/s"),
        _ => "n/a".into(),
    }
}

/// A fraction as a percentage, or `n/a`.
pub fn pct(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{:.0}%", v * 100.0),
        _ => "n/a".into(),
    }
}

/// A plain-text table: one header row, columns separated by two spaces, padded to the
/// widest cell (counted in characters, so `µ` and `≤` do not break alignment).
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table, every line prefixed by `indent` and ended by a newline; trailing spaces
    /// are trimmed.
    pub fn render(&self, indent: &str) -> String {
        let cols = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.header.len()])
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; cols];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::from(indent);
            for (i, cell) in row.iter().enumerate() {
                line.push_str(cell);
                if i + 1 < row.len() {
                    let pad = widths[i] - cell.chars().count() + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000Z");
        // 2024-02-29 (a leap day) 12:34:56.789 UTC.
        assert_eq!(utc(1_709_210_096_789), "2024-02-29 12:34:56.789Z");
        assert_eq!(utc(1_764_417_600_000), "2025-11-29 12:00:00.000Z");
        assert_eq!(utc_time(1_709_210_096_789), "12:34:56.789");
    }

    #[test]
    fn durations_pick_a_readable_unit() {
        assert_eq!(ms(3.25), "3.2 ms");
        assert_eq!(ms(850.0), "850 ms");
        assert_eq!(ms(12_340.0), "12.3 s");
        assert_eq!(ms(245_000.0), "4m05s");
        assert_eq!(ms(f64::NAN), "n/a");
        assert_eq!(age(10_000, 9_600), "400 ms ago");
        assert_eq!(age(10_000, 10_500), "just now");
    }

    #[test]
    fn rates_and_fractions() {
        assert_eq!(tok_s_from_tpot(20.0), Some(50.0));
        assert_eq!(tok_s_from_tpot(0.0), None);
        assert_eq!(tok_s(Some(45.21)), "45.2 tok/s");
        assert_eq!(tok_s(None), "n/a");
        assert_eq!(pct(Some(0.423)), "42%");
        assert_eq!(pct(None), "n/a");
    }

    #[test]
    fn table_aligns_columns_and_trims() {
        let mut t = Table::new(["a", "long header", "c"]);
        t.row(["xyz", "1", ""]);
        t.row(["µ", "22", "z"]);
        assert_eq!(
            t.render("  "),
            "  a    long header  c\n  xyz  1\n  µ    22           z\n"
        );
    }
}
