//! Every metric of the gateway, in one place, rendered in Prometheus' text format on
//! `GET /metrics`. Names carry their unit (`_seconds`, `_total`).
//!
//! Invariants: request counts and durations are labelled by the matched route template
//! (`/v1/chat/completions`), never by the raw path, so label cardinality is bounded; a
//! streamed response is timed until its body ends or the client goes away (not until
//! its headers), and stays in flight until then.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use crate::AppState;

pub const HTTP_REQUESTS_TOTAL: &str = "metronome_gateway_http_requests_total";
pub const HTTP_REQUEST_DURATION_SECONDS: &str = "metronome_gateway_http_request_duration_seconds";
pub const HTTP_TIME_TO_FIRST_BYTE_SECONDS: &str =
    "metronome_gateway_http_time_to_first_byte_seconds";
pub const HTTP_REQUESTS_IN_FLIGHT: &str = "metronome_gateway_http_requests_in_flight";
pub const NATS_PUBLISH_ERRORS_TOTAL: &str = "metronome_gateway_nats_publish_errors_total";
pub const JOBS_SUBMITTED_TOTAL: &str = "metronome_gateway_jobs_submitted_total";
pub const JOBS_CANCELLED_TOTAL: &str = "metronome_gateway_jobs_cancelled_total";
pub const STREAM_GAPS_TOTAL: &str = "metronome_gateway_stream_gaps_total";
pub const MALFORMED_MESSAGES_TOTAL: &str = "metronome_gateway_malformed_messages_total";
pub const AUTH_FAILURES_TOTAL: &str = "metronome_gateway_auth_failures_total";
pub const TENANT_REQUESTS_TOTAL: &str = "metronome_gateway_tenant_requests_total";
pub const TENANT_REJECTIONS_TOTAL: &str = "metronome_gateway_tenant_rejections_total";
pub const TENANT_ADMITTED_TOKENS_TOTAL: &str = "metronome_gateway_tenant_admitted_tokens_total";

/// A Prometheus label value: backslash, double quote and line feed escaped, as the text
/// format requires (tenant names are validated tokens, but the exposition must stay
/// parseable whatever a label holds).
pub fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Upper bounds of the latency histograms, in seconds: from a cached error (ms) to a long
/// generation (minutes).
const BUCKETS_SECONDS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

#[derive(Debug, Clone, Default)]
struct Histogram {
    counts: [u64; BUCKETS_SECONDS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, count) in BUCKETS_SECONDS.iter().zip(self.counts.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (bound, count) in BUCKETS_SECONDS.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// The gateway's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    durations: Mutex<BTreeMap<String, Histogram>>,
    ttfb: Mutex<BTreeMap<String, Histogram>>,
    malformed: Mutex<BTreeMap<&'static str, u64>>,
    auth_failures: Mutex<BTreeMap<&'static str, u64>>,
    /// Per tenant; the tenants are the configured ones, so the label set is bounded.
    tenant_requests: Mutex<BTreeMap<String, u64>>,
    tenant_rejections: Mutex<BTreeMap<(String, &'static str), u64>>,
    tenant_tokens: Mutex<BTreeMap<String, u64>>,
    in_flight: AtomicI64,
    nats_publish_errors: AtomicU64,
    jobs_submitted: AtomicU64,
    jobs_cancelled: AtomicU64,
    stream_gaps: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn request_finished(&self, route: &str, status: u16) {
        *lock(&self.requests)
            .entry((route.to_string(), status))
            .or_default() += 1;
    }

    pub fn observe_duration(&self, route: &str, seconds: f64) {
        lock(&self.durations)
            .entry(route.to_string())
            .or_default()
            .observe(seconds);
    }

    pub fn observe_ttfb(&self, route: &str, seconds: f64) {
        lock(&self.ttfb)
            .entry(route.to_string())
            .or_default()
            .observe(seconds);
    }

    pub fn nats_publish_error(&self) {
        self.nats_publish_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn job_submitted(&self) {
        self.jobs_submitted.fetch_add(1, Ordering::Relaxed);
    }

    pub fn job_cancelled(&self) {
        self.jobs_cancelled.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_gap(&self, missing: u64) {
        self.stream_gaps.fetch_add(missing, Ordering::Relaxed);
    }

    /// A NATS message or KV entry that could not be read, by where it came from.
    pub fn malformed_message(&self, source: &'static str) {
        *lock(&self.malformed).entry(source).or_default() += 1;
    }

    /// A request refused with 401, by reason (`missing`, `malformed`, `invalid`, `revoked`).
    pub fn auth_failure(&self, reason: &'static str) {
        *lock(&self.auth_failures).entry(reason).or_default() += 1;
    }

    /// An authenticated chat or completion request (the model list is not counted).
    pub fn tenant_request(&self, tenant: &str) {
        *lock(&self.tenant_requests)
            .entry(tenant.to_string())
            .or_default() += 1;
    }

    /// A request refused for its tenant (`model_not_allowed`, `requests_per_second`,
    /// `tokens_per_minute`, `request_too_large`).
    pub fn tenant_rejection(&self, tenant: &str, reason: &'static str) {
        *lock(&self.tenant_rejections)
            .entry((tenant.to_string(), reason))
            .or_default() += 1;
    }

    /// Tokens (prompt estimate + `max_tokens`) charged to a tenant at admission.
    pub fn tenant_tokens_admitted(&self, tenant: &str, tokens: u64) {
        *lock(&self.tenant_tokens)
            .entry(tenant.to_string())
            .or_default() += tokens;
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP {HTTP_REQUESTS_TOTAL} HTTP requests answered, by route template and status."
        );
        let _ = writeln!(out, "# TYPE {HTTP_REQUESTS_TOTAL} counter");
        for ((route, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "{HTTP_REQUESTS_TOTAL}{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(out, "# HELP {HTTP_REQUEST_DURATION_SECONDS} Time from request to the end of the response body.");
        let _ = writeln!(out, "# TYPE {HTTP_REQUEST_DURATION_SECONDS} histogram");
        for (route, h) in lock(&self.durations).iter() {
            h.render(
                &mut out,
                HTTP_REQUEST_DURATION_SECONDS,
                &format!("route=\"{route}\""),
            );
        }
        let _ = writeln!(out, "# HELP {HTTP_TIME_TO_FIRST_BYTE_SECONDS} Time from request to the first body byte (first streamed event when streaming).");
        let _ = writeln!(out, "# TYPE {HTTP_TIME_TO_FIRST_BYTE_SECONDS} histogram");
        for (route, h) in lock(&self.ttfb).iter() {
            h.render(
                &mut out,
                HTTP_TIME_TO_FIRST_BYTE_SECONDS,
                &format!("route=\"{route}\""),
            );
        }
        let gauges_and_counters: [(&str, &str, &str, i64); 5] = [
            (
                HTTP_REQUESTS_IN_FLIGHT,
                "gauge",
                "HTTP requests being answered (streams until they end).",
                self.in_flight.load(Ordering::Relaxed),
            ),
            (
                NATS_PUBLISH_ERRORS_TOTAL,
                "counter",
                "Jobs that could not be published to JetStream.",
                self.nats_publish_errors.load(Ordering::Relaxed) as i64,
            ),
            (
                JOBS_SUBMITTED_TOTAL,
                "counter",
                "Jobs acknowledged by JetStream.",
                self.jobs_submitted.load(Ordering::Relaxed) as i64,
            ),
            (
                JOBS_CANCELLED_TOTAL,
                "counter",
                "Jobs cancelled because their client went away.",
                self.jobs_cancelled.load(Ordering::Relaxed) as i64,
            ),
            (
                STREAM_GAPS_TOTAL,
                "counter",
                "Streamed chunks missing when the final result arrived.",
                self.stream_gaps.load(Ordering::Relaxed) as i64,
            ),
        ];
        for (name, kind, help, value) in gauges_and_counters {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {value}");
        }
        let _ = writeln!(out, "# HELP {MALFORMED_MESSAGES_TOTAL} NATS messages and KV entries ignored as malformed, by source.");
        let _ = writeln!(out, "# TYPE {MALFORMED_MESSAGES_TOTAL} counter");
        for (source, n) in lock(&self.malformed).iter() {
            let _ = writeln!(out, "{MALFORMED_MESSAGES_TOTAL}{{source=\"{source}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP {AUTH_FAILURES_TOTAL} Requests refused with 401, by reason."
        );
        let _ = writeln!(out, "# TYPE {AUTH_FAILURES_TOTAL} counter");
        for (reason, n) in lock(&self.auth_failures).iter() {
            let _ = writeln!(out, "{AUTH_FAILURES_TOTAL}{{reason=\"{reason}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP {TENANT_REQUESTS_TOTAL} Authenticated chat and completion requests, by tenant."
        );
        let _ = writeln!(out, "# TYPE {TENANT_REQUESTS_TOTAL} counter");
        for (tenant, n) in lock(&self.tenant_requests).iter() {
            let tenant = escape_label(tenant);
            let _ = writeln!(out, "{TENANT_REQUESTS_TOTAL}{{tenant=\"{tenant}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP {TENANT_REJECTIONS_TOTAL} Requests refused by their tenant's allowed models or limits, by tenant and reason."
        );
        let _ = writeln!(out, "# TYPE {TENANT_REJECTIONS_TOTAL} counter");
        for ((tenant, reason), n) in lock(&self.tenant_rejections).iter() {
            let tenant = escape_label(tenant);
            let _ = writeln!(
                out,
                "{TENANT_REJECTIONS_TOTAL}{{tenant=\"{tenant}\",reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP {TENANT_ADMITTED_TOKENS_TOTAL} Tokens (prompt estimate + max_tokens) charged at admission, by tenant."
        );
        let _ = writeln!(out, "# TYPE {TENANT_ADMITTED_TOKENS_TOTAL} counter");
        for (tenant, n) in lock(&self.tenant_tokens).iter() {
            let tenant = escape_label(tenant);
            let _ = writeln!(
                out,
                "{TENANT_ADMITTED_TOKENS_TOTAL}{{tenant=\"{tenant}\"}} {n}"
            );
        }
        out
    }
}

/// Ends one request's measurement when dropped: after the body for a stream, at once
/// otherwise. Dropping covers a client that leaves in the middle of a stream.
struct RequestTimer {
    metrics: Arc<Metrics>,
    route: String,
    start: Instant,
}

impl RequestTimer {
    fn start(metrics: Arc<Metrics>, route: String) -> Self {
        metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        RequestTimer {
            metrics,
            route,
            start: Instant::now(),
        }
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics
            .observe_duration(&self.route, self.start.elapsed().as_secs_f64());
    }
}

/// Middleware measuring every routed request.
pub async fn track(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    request: Request,
    next: Next,
) -> Response {
    let route = matched
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let metrics = state.metrics.clone();
    let timer = RequestTimer::start(metrics.clone(), route.clone());
    let response = next.run(request).await;
    metrics.request_finished(&route, response.status().as_u16());
    let streaming = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streaming {
        metrics.observe_ttfb(&route, timer.start.elapsed().as_secs_f64());
        return response;
    }
    let (parts, body) = response.into_parts();
    let mut data = body.into_data_stream();
    let timed = async_stream::stream! {
        let timer = timer;
        let mut first = true;
        while let Some(item) = data.next().await {
            if first {
                first = false;
                timer.metrics.observe_ttfb(&timer.route, timer.start.elapsed().as_secs_f64());
            }
            yield item;
        }
    };
    Response::from_parts(parts, Body::from_stream(timed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms_with_units() {
        let m = Metrics::default();
        m.request_finished("/v1/models", 200);
        m.request_finished("/v1/models", 200);
        m.observe_duration("/v1/models", 0.02);
        m.nats_publish_error();
        let text = m.render();
        assert!(text.contains(
            "metronome_gateway_http_requests_total{route=\"/v1/models\",status=\"200\"} 2"
        ));
        assert!(text.contains(
            "metronome_gateway_http_request_duration_seconds_bucket{route=\"/v1/models\",le=\"0.025\"} 1"
        ));
        assert!(text.contains(
            "metronome_gateway_http_request_duration_seconds_bucket{route=\"/v1/models\",le=\"0.01\"} 0"
        ));
        assert!(text.contains("metronome_gateway_nats_publish_errors_total 1"));
        assert!(text.contains("metronome_gateway_http_requests_in_flight 0"));
    }

    #[test]
    fn tenant_counters_have_escaped_labels() {
        let m = Metrics::default();
        m.tenant_request("acme");
        m.tenant_request("acme");
        m.tenant_rejection("acme", "tokens_per_minute");
        m.tenant_tokens_admitted("acme", 120);
        m.auth_failure("invalid");
        m.tenant_request("we\"ird\\na\nme");
        let text = m.render();
        assert!(text.contains("metronome_gateway_tenant_requests_total{tenant=\"acme\"} 2"));
        assert!(text.contains(
            "metronome_gateway_tenant_rejections_total{tenant=\"acme\",reason=\"tokens_per_minute\"} 1"
        ));
        assert!(
            text.contains("metronome_gateway_tenant_admitted_tokens_total{tenant=\"acme\"} 120")
        );
        assert!(text.contains("metronome_gateway_auth_failures_total{reason=\"invalid\"} 1"));
        assert!(text.contains(
            "metronome_gateway_tenant_requests_total{tenant=\"we\\\"ird\\\\na\\nme\"} 1"
        ));
        assert_eq!(escape_label("plain"), "plain");
    }
}
