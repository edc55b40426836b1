//! One measured request (`RequestRecord`) and the per-request CSV.
//!
//! Definitions (all times measured on the client with a monotonic clock, from just before
//! the request is written to the connection):
//! - **TTFT**: until the first streamed chunk carrying non-empty generated text.
//! - **e2e**: until `[DONE]` arrives, or until the connection closes when a server sends no
//!   `[DONE]`.
//! - **output tokens**: `usage.completion_tokens` of the final usage chunk when the server
//!   sends one (`stream_options.include_usage`), else the number of text-bearing chunks.
//! - **TPOT** (time per output token): `(e2e - ttft) / (output_tokens - 1)`; needs >= 2 tokens.
//! - **tokens/s** (per-request decode rate): `output_tokens / (e2e - ttft)`, i.e. the rate at
//!   which this request's tokens arrived after its first one; needs `e2e > ttft`. It is what
//!   the SLO's tokens/s floor is compared against.
//!
//! A failed request has `ok = false`, an [`ErrorKind`], and whatever was measured before it
//! failed; it counts in `errors` and never as good in goodput.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::LoadError;

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The server answered with a non-2xx status.
    Http,
    /// No connection could be made (refused, unreachable, DNS).
    Connect,
    /// The request timed out or was cut off at the end of the drain period.
    Timeout,
    /// The stream broke, carried an error event, or ended without `[DONE]` or any chunk.
    Stream,
    /// Not sent: `max_in_flight` requests were outstanding at its arrival time.
    Dropped,
    /// The run was cancelled (Ctrl-C) while it was outstanding.
    Cancelled,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Http => "http",
            ErrorKind::Connect => "connect",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Stream => "stream",
            ErrorKind::Dropped => "dropped",
            ErrorKind::Cancelled => "cancelled",
        }
    }
}

/// The measurements of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RequestRecord {
    pub id: u64,
    /// Planned send time, seconds after the run's start.
    pub scheduled_s: f64,
    /// Actual send time, seconds after the run's start (the scheduler's lateness is
    /// `sent_s - scheduled_s`).
    pub sent_s: f64,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub ok: bool,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    pub error_kind: Option<ErrorKind>,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub output_tokens: u32,
    pub tokens_per_s: Option<f64>,
    /// True when `output_tokens` came from the server's usage report.
    pub usage_reported: bool,
    /// Text-bearing chunks received.
    pub chunks: u32,
    /// `x-metronome-job-id` response header, to look the request up in Metronome's decisions.
    pub job_id: Option<String>,
    /// `x-metronome-worker` response header.
    pub worker: Option<String>,
    /// The spec's tenant that sent it, when the spec has tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl RequestRecord {
    /// Fills TPOT and tokens/s from TTFT, e2e and the output token count.
    pub fn derive_rates(&mut self) {
        self.tpot_ms = None;
        self.tokens_per_s = None;
        if let (Some(ttft), Some(e2e)) = (self.ttft_ms, self.e2e_ms) {
            let decode_ms = e2e - ttft;
            if self.output_tokens >= 2 {
                self.tpot_ms = Some(decode_ms / f64::from(self.output_tokens - 1));
            }
            if decode_ms > 0.0 && self.output_tokens >= 1 {
                self.tokens_per_s = Some(f64::from(self.output_tokens) / (decode_ms / 1000.0));
            }
        }
    }
}

/// Column names of `requests.csv`, in order.
pub const CSV_HEADER: &str = "id,scheduled_s,sent_s,prompt_tokens,max_tokens,ok,status,error_kind,error,ttft_ms,tpot_ms,e2e_ms,output_tokens,tokens_per_s,usage_reported,chunks,job_id,worker,tenant";

/// Renders records as CSV (RFC 4180 quoting for free-text fields).
pub fn records_csv(records: &[RequestRecord]) -> String {
    let mut out = String::with_capacity(128 * (records.len() + 1));
    out.push_str(CSV_HEADER);
    out.push('\n');
    let num = |x: Option<f64>| x.map(|v| format!("{v:.3}")).unwrap_or_default();
    for r in records {
        let _ = writeln!(
            out,
            "{},{:.6},{:.6},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.id,
            r.scheduled_s,
            r.sent_s,
            r.prompt_tokens,
            r.max_tokens,
            r.ok,
            r.status.map(|s| s.to_string()).unwrap_or_default(),
            r.error_kind.map(ErrorKind::as_str).unwrap_or_default(),
            csv_field(r.error.as_deref().unwrap_or("")),
            num(r.ttft_ms),
            num(r.tpot_ms),
            num(r.e2e_ms),
            r.output_tokens,
            num(r.tokens_per_s),
            r.usage_reported,
            r.chunks,
            csv_field(r.job_id.as_deref().unwrap_or("")),
            csv_field(r.worker.as_deref().unwrap_or("")),
            csv_field(r.tenant.as_deref().unwrap_or("")),
        );
    }
    out
}

/// Writes `records_csv` to `path`.
pub fn write_csv(path: &Path, records: &[RequestRecord]) -> Result<(), LoadError> {
    let werr = |source| LoadError::Write {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::create(path).map_err(werr)?;
    f.write_all(records_csv(records).as_bytes()).map_err(werr)
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_follow_the_documented_definitions() {
        let mut r = RequestRecord {
            ttft_ms: Some(100.0),
            e2e_ms: Some(1100.0),
            output_tokens: 51,
            ..Default::default()
        };
        r.derive_rates();
        assert_eq!(r.tpot_ms, Some(20.0));
        assert_eq!(r.tokens_per_s, Some(51.0));
        let mut one = RequestRecord {
            ttft_ms: Some(100.0),
            e2e_ms: Some(100.0),
            output_tokens: 1,
            ..Default::default()
        };
        one.derive_rates();
        assert_eq!(one.tpot_ms, None);
        assert_eq!(one.tokens_per_s, None);
    }

    #[test]
    fn csv_quotes_free_text() {
        let r = RequestRecord {
            id: 3,
            error_kind: Some(ErrorKind::Http),
            error: Some("bad \"x\", y".into()),
            status: Some(503),
            ..Default::default()
        };
        let csv = records_csv(&[r]);
        let mut lines = csv.lines();
        assert_eq!(lines.next(), Some(CSV_HEADER));
        let row = lines.next().unwrap();
        assert!(row.starts_with("3,"));
        assert!(row.contains(",503,http,\"bad \"\"x\"\", y\","), "{row}");
        assert_eq!(CSV_HEADER.split(',').count(), 19);
    }
}
