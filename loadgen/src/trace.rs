//! Trace files: parsing `TIMESTAMP,ContextTokens,GeneratedTokens` CSVs (the Azure LLM
//! inference trace format) into arrival offsets and token counts, and their statistics.
//!
//! Invariants of a parsed trace: requests are in non-decreasing `offset_s` order, the first
//! request is at offset 0, and every request asks for at least one output token (a
//! `GeneratedTokens` of 0 is raised to 1: a streaming request must produce something to
//! measure). Parsing is pure and every malformed line is reported with its 1-based line
//! number. A header line is recognised (case-insensitively) and skipped.
//!
//! Timestamps are either `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, up to 9 fractional
//! digits, as in the Azure traces) or plain seconds as a decimal number.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::TraceError;
use crate::stats;

/// One request of a trace, relative to the trace's first request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Seconds since the first request of the trace.
    pub offset_s: f64,
    /// Prompt length in tokens (`ContextTokens`).
    pub prompt_tokens: u32,
    /// Output length in tokens (`GeneratedTokens`, at least 1).
    pub output_tokens: u32,
}

/// Distribution summary of a token-length column.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct LengthStats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// What a scenario runner needs to scale a trace to a fraction of a cluster's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct TraceStats {
    pub requests: usize,
    /// Seconds between the first and the last request.
    pub span_s: f64,
    /// Mean arrival rate in requests/s: `(requests - 1) / span_s` (the number of
    /// inter-arrival gaps over their total length); 0 when fewer than two requests.
    pub mean_rate_rps: f64,
    pub prompt_tokens: LengthStats,
    pub output_tokens: LengthStats,
    /// Mean output tokens requested per second of trace: `mean_rate_rps * output mean`.
    pub output_tokens_per_s: f64,
}

/// Reads and parses a trace file.
pub fn load_trace(path: impl AsRef<Path>) -> Result<Vec<TraceRequest>, TraceError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text)
}

/// Parses trace text (see the module docs for the format).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut rows: Vec<(i128, u32, u32)> = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if rows.is_empty() && is_header(line) {
            continue;
        }
        let bad = |reason: String| TraceError::Line {
            line: line_no,
            reason,
            content: truncate(line, 80),
        };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != 3 {
            return Err(bad(format!("expected 3 fields, found {}", fields.len())));
        }
        let ts = parse_timestamp_ns(fields[0]).map_err(|e| bad(format!("TIMESTAMP: {e}")))?;
        let ctx: u32 = fields[1]
            .parse()
            .map_err(|_| bad(format!("ContextTokens: not a count: {:?}", fields[1])))?;
        let gen: u32 = fields[2]
            .parse()
            .map_err(|_| bad(format!("GeneratedTokens: not a count: {:?}", fields[2])))?;
        rows.push((ts, ctx, gen));
    }
    if rows.is_empty() {
        return Err(TraceError::Empty);
    }
    // Stable sort: out-of-order lines keep their relative order among equal timestamps.
    rows.sort_by_key(|r| r.0);
    let t0 = rows[0].0;
    Ok(rows
        .into_iter()
        .map(|(ts, ctx, gen)| TraceRequest {
            offset_s: (ts - t0) as f64 / 1e9,
            prompt_tokens: ctx,
            output_tokens: gen.max(1),
        })
        .collect())
}

/// Statistics of a parsed trace (pure).
pub fn trace_stats(trace: &[TraceRequest]) -> TraceStats {
    if trace.is_empty() {
        return TraceStats::default();
    }
    let span_s = trace.last().map(|r| r.offset_s).unwrap_or(0.0) - trace[0].offset_s;
    let mean_rate_rps = if trace.len() > 1 && span_s > 0.0 {
        (trace.len() - 1) as f64 / span_s
    } else {
        0.0
    };
    let prompt: Vec<f64> = trace.iter().map(|r| f64::from(r.prompt_tokens)).collect();
    let output: Vec<f64> = trace.iter().map(|r| f64::from(r.output_tokens)).collect();
    let output_stats = length_stats(&output);
    TraceStats {
        requests: trace.len(),
        span_s,
        mean_rate_rps,
        prompt_tokens: length_stats(&prompt),
        output_tokens: output_stats,
        output_tokens_per_s: mean_rate_rps * output_stats.mean,
    }
}

fn length_stats(v: &[f64]) -> LengthStats {
    let s = stats::sorted_finite(v);
    LengthStats {
        mean: stats::mean(&s).unwrap_or(0.0),
        p50: stats::percentile_sorted(&s, 50.0).unwrap_or(0.0),
        p90: stats::percentile_sorted(&s, 90.0).unwrap_or(0.0),
        p99: stats::percentile_sorted(&s, 99.0).unwrap_or(0.0),
        max: s.last().copied().unwrap_or(0.0),
    }
}

fn is_header(line: &str) -> bool {
    let first = line.split(',').next().unwrap_or("").trim();
    first.eq_ignore_ascii_case("timestamp")
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// Nanoseconds since the Unix epoch (date form) or since zero (plain seconds form).
fn parse_timestamp_ns(s: &str) -> Result<i128, String> {
    if s.is_empty() {
        return Err("empty".into());
    }
    if !s.contains('-') || s.starts_with('-') {
        // Plain seconds.
        let secs: f64 = s
            .parse()
            .map_err(|_| format!("not a date-time or seconds: {s:?}"))?;
        if !secs.is_finite() || secs < 0.0 {
            return Err(format!("seconds must be finite and >= 0: {s:?}"));
        }
        return Ok((secs * 1e9).round() as i128);
    }
    let (date, time) = s
        .split_once([' ', 'T'])
        .ok_or_else(|| format!("expected 'YYYY-MM-DD HH:MM:SS[.f]': {s:?}"))?;
    let d: Vec<&str> = date.split('-').collect();
    if d.len() != 3 {
        return Err(format!("bad date {date:?}"));
    }
    let year: i64 = d[0].parse().map_err(|_| format!("bad year {:?}", d[0]))?;
    let month: u32 = d[1].parse().map_err(|_| format!("bad month {:?}", d[1]))?;
    let day: u32 = d[2].parse().map_err(|_| format!("bad day {:?}", d[2]))?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return Err(format!("date out of range {date:?}"));
    }
    let time = time.trim_end_matches('Z');
    let t: Vec<&str> = time.split(':').collect();
    if t.len() != 3 {
        return Err(format!("bad time {time:?}"));
    }
    let hour: i64 = t[0].parse().map_err(|_| format!("bad hour {:?}", t[0]))?;
    let minute: i64 = t[1].parse().map_err(|_| format!("bad minute {:?}", t[1]))?;
    let (sec_s, frac_s) = t[2].split_once('.').unwrap_or((t[2], ""));
    let sec: i64 = sec_s.parse().map_err(|_| format!("bad second {sec_s:?}"))?;
    if hour > 23 || minute > 59 || sec > 60 {
        return Err(format!("time out of range {time:?}"));
    }
    if frac_s.len() > 9 || !frac_s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("bad fraction {frac_s:?} (at most 9 digits)"));
    }
    let frac_ns: i64 = if frac_s.is_empty() {
        0
    } else {
        format!("{frac_s:0<9}")
            .parse()
            .map_err(|_| "bad fraction")?
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + sec;
    Ok(i128::from(secs) * 1_000_000_000 + i128::from(frac_ns))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0781490,110,27
2023-11-16 18:17:04.1206440,7433,0
";

    #[test]
    fn parses_azure_format() {
        let t = parse_trace(SAMPLE).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t[0].offset_s, 0.0);
        assert!((t[1].offset_s - 0.052).abs() < 1e-9);
        assert!((t[3].offset_s - 0.140_684).abs() < 1e-9);
        assert_eq!(t[0].prompt_tokens, 4808);
        assert_eq!(t[2].output_tokens, 27);
        // Zero generated tokens is raised to one.
        assert_eq!(t[3].output_tokens, 1);
    }

    #[test]
    fn days_cross_midnight_and_months() {
        let t = parse_trace("2023-12-31 23:59:59.5,1,1\n2024-01-01 00:00:00.5,1,1\n").unwrap();
        assert!((t[1].offset_s - 1.0).abs() < 1e-9);
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn plain_seconds_and_unsorted_lines() {
        let t = parse_trace("# synthetic\n2.5,10,5\n0.5,20,6\n1.0,30,7\n").unwrap();
        let offsets: Vec<f64> = t.iter().map(|r| r.offset_s).collect();
        assert_eq!(offsets, vec![0.0, 0.5, 2.0]);
        assert_eq!(t[0].prompt_tokens, 20);
    }

    #[test]
    fn malformed_lines_report_their_line_number() {
        let cases = [
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,1,1\n2023-11-16 18:17:04.0,abc,1\n", 3, "ContextTokens"),
            ("2023-11-16 18:17:03.9,1,1\n\n2023-11-16 18:17:04.0,1\n", 3, "expected 3 fields"),
            ("2023-11-16 18:17:03.9,1,1\n2023-13-16 18:17:04.0,1,1\n", 2, "TIMESTAMP"),
            ("2023-11-16 25:17:03.9,1,1\n", 1, "TIMESTAMP"),
            ("2023-11-16 18:17:03.9,1,-4\n", 1, "GeneratedTokens"),
            ("yesterday,1,1\n", 1, "TIMESTAMP"),
        ];
        for (text, line, what) in cases {
            match parse_trace(text) {
                Err(TraceError::Line {
                    line: l, reason, ..
                }) => {
                    assert_eq!(l, line, "{text:?}");
                    assert!(reason.contains(what), "{reason} should mention {what}");
                }
                other => panic!("expected a line error for {text:?}, got {other:?}"),
            }
        }
        let msg = parse_trace("1,1,x\n").unwrap_err().to_string();
        assert!(msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn empty_trace_is_an_error() {
        assert!(matches!(
            parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\n"),
            Err(TraceError::Empty)
        ));
    }

    #[test]
    fn stats_give_mean_rate_and_lengths() {
        let t = parse_trace("0,100,10\n1,200,20\n2,300,30\n4,400,40\n").unwrap();
        let s = trace_stats(&t);
        assert_eq!(s.requests, 4);
        assert_eq!(s.span_s, 4.0);
        assert_eq!(s.mean_rate_rps, 0.75);
        assert_eq!(s.prompt_tokens.mean, 250.0);
        assert_eq!(s.output_tokens.p50, 20.0);
        assert_eq!(s.output_tokens.max, 40.0);
        assert_eq!(s.output_tokens_per_s, 0.75 * 25.0);
    }

    #[test]
    fn azure_trace_excerpt_parses() {
        // The first 200 requests of the Azure LLM inference trace (code, 2023).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/azure_code_head200.csv"
        );
        let t = load_trace(path).unwrap();
        assert_eq!(t.len(), 200);
        assert!(t.windows(2).all(|w| w[0].offset_s <= w[1].offset_s));
        assert_eq!(t[0].prompt_tokens, 4808);
        let s = trace_stats(&t);
        assert!(s.mean_rate_rps > 0.0 && s.span_s > 0.0);
        assert!(s.prompt_tokens.p50 <= s.prompt_tokens.p99);
    }
}
