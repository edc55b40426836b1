//! Every metric of the gateway, in one place, registered with `prometheus-client` and
//! served in the OpenMetrics text format on `GET /metrics` (the crate escapes label values
//! and appends `_total` to counters, which are registered without it). Names carry their
//! unit (`_seconds`, `_total`).
//!
//! Invariants: request counts and durations are labelled by the matched route template
//! (`/v1/chat/completions`), never by the raw path, so label cardinality is bounded; a
//! streamed response is timed until its body ends or the client goes away (not until
//! its headers), and stays in flight until then.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use metronome_runtime::build_info;

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
pub const REORDER_OVERFLOWS_TOTAL: &str = "metronome_gateway_reorder_overflows_total";
pub const MALFORMED_MESSAGES_TOTAL: &str = "metronome_gateway_malformed_messages_total";
pub const UNATTRIBUTED_RESULTS_TOTAL: &str = "metronome_gateway_unattributed_results_total";
pub const AUTH_FAILURES_TOTAL: &str = "metronome_gateway_auth_failures_total";
pub const SHED_TOTAL: &str = "metronome_gateway_shed_total";
pub const TENANT_REQUESTS_TOTAL: &str = "metronome_gateway_tenant_requests_total";
pub const TENANT_REJECTIONS_TOTAL: &str = "metronome_gateway_tenant_rejections_total";
pub const TENANT_ADMITTED_TOKENS_TOTAL: &str = "metronome_gateway_tenant_admitted_tokens_total";

/// Content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the latency histograms, in seconds: from a cached error (ms) to a long
/// generation (minutes).
const BUCKETS_SECONDS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// A label set: label names are fixed in this module, values come from routes, tenants
/// and reasons (escaped by the encoder).
type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Clone, Copy)]
struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(BUCKETS_SECONDS)
    }
}

/// The gateway's metrics, registered once; `render` encodes them with `prometheus-client`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    durations: Family<Labels, Histogram, LatencyBuckets>,
    ttfb: Family<Labels, Histogram, LatencyBuckets>,
    malformed: Family<Labels, Counter>,
    auth_failures: Family<Labels, Counter>,
    shed: Family<Labels, Counter>,
    /// Per tenant; the tenants are the configured ones, so the label set is bounded.
    tenant_requests: Family<Labels, Counter>,
    tenant_rejections: Family<Labels, Counter>,
    tenant_tokens: Family<Labels, Counter>,
    in_flight: Gauge,
    nats_publish_errors: Counter,
    jobs_submitted: Counter,
    jobs_cancelled: Counter,
    stream_gaps: Counter,
    reorder_overflows: Counter,
    unattributed_results: Family<Labels, Counter>,
}

/// A counter's registered name: the text format appends `_total` itself.
fn counter_name(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            durations: Family::new_with_constructor(LatencyBuckets),
            ttfb: Family::new_with_constructor(LatencyBuckets),
            malformed: Family::default(),
            auth_failures: Family::default(),
            shed: Family::default(),
            tenant_requests: Family::default(),
            tenant_rejections: Family::default(),
            tenant_tokens: Family::default(),
            in_flight: Gauge::default(),
            nats_publish_errors: Counter::default(),
            jobs_submitted: Counter::default(),
            jobs_cancelled: Counter::default(),
            stream_gaps: Counter::default(),
            reorder_overflows: Counter::default(),
            unattributed_results: Family::default(),
        };
        // `register` ends each help text with a period itself.
        let r = &mut m.registry;
        r.register(
            build_info::INFO_NAME,
            build_info::HELP,
            Info::new(build_info::labels()),
        );
        r.register(
            counter_name(HTTP_REQUESTS_TOTAL),
            "HTTP requests answered, by route template and status",
            m.requests.clone(),
        );
        r.register(
            HTTP_REQUEST_DURATION_SECONDS,
            "Time from request to the end of the response body",
            m.durations.clone(),
        );
        r.register(
            HTTP_TIME_TO_FIRST_BYTE_SECONDS,
            "Time from request to the first body byte (first streamed event when streaming)",
            m.ttfb.clone(),
        );
        r.register(
            HTTP_REQUESTS_IN_FLIGHT,
            "HTTP requests being answered (streams until they end)",
            m.in_flight.clone(),
        );
        r.register(
            counter_name(NATS_PUBLISH_ERRORS_TOTAL),
            "Jobs that could not be published to JetStream",
            m.nats_publish_errors.clone(),
        );
        r.register(
            counter_name(JOBS_SUBMITTED_TOTAL),
            "Jobs acknowledged by JetStream",
            m.jobs_submitted.clone(),
        );
        r.register(
            counter_name(JOBS_CANCELLED_TOTAL),
            "Jobs cancelled because their client went away",
            m.jobs_cancelled.clone(),
        );
        r.register(
            counter_name(STREAM_GAPS_TOTAL),
            "Streamed chunks missing when the final result arrived",
            m.stream_gaps.clone(),
        );
        r.register(
            counter_name(REORDER_OVERFLOWS_TOTAL),
            "Streams ended with an error because the chunks that came ahead of a missing one held more than reorder_max_bytes",
            m.reorder_overflows.clone(),
        );
        r.register(
            counter_name(MALFORMED_MESSAGES_TOTAL),
            "NATS messages and KV entries ignored as malformed, by source",
            m.malformed.clone(),
        );
        r.register(
            counter_name(UNATTRIBUTED_RESULTS_TOTAL),
            "Result messages not relayed because no decision gave their job to the worker that published them (held until the job ended), or whose body named another worker than their subject, by reason",
            m.unattributed_results.clone(),
        );
        r.register(
            counter_name(SHED_TOTAL),
            "Requests answered 429 at once by the gateway, by reason: before their body was read, because it held its most (in_flight, in_flight_tenant, in_flight_body_bytes); before their job was published, because the leader's latest queue snapshot says the model's queue is full for the tenant (queue_full)",
            m.shed.clone(),
        );
        r.register(
            counter_name(AUTH_FAILURES_TOTAL),
            "Requests refused with 401 (or 403 at the console), by reason",
            m.auth_failures.clone(),
        );
        r.register(
            counter_name(TENANT_REQUESTS_TOTAL),
            "Authenticated chat and completion requests, by tenant",
            m.tenant_requests.clone(),
        );
        r.register(
            counter_name(TENANT_REJECTIONS_TOTAL),
            "Requests refused by their tenant's allowed models or limits, by tenant and reason",
            m.tenant_rejections.clone(),
        );
        r.register(
            counter_name(TENANT_ADMITTED_TOKENS_TOTAL),
            "Tokens (prompt estimate + max_tokens) charged at admission, by tenant",
            m.tenant_tokens.clone(),
        );
        m
    }
}

impl Metrics {
    pub fn request_finished(&self, route: &str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("route", route.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
    }

    pub fn observe_duration(&self, route: &str, seconds: f64) {
        self.durations
            .get_or_create(&vec![("route", route.to_string())])
            .observe(seconds);
    }

    pub fn observe_ttfb(&self, route: &str, seconds: f64) {
        self.ttfb
            .get_or_create(&vec![("route", route.to_string())])
            .observe(seconds);
    }

    pub fn nats_publish_error(&self) {
        self.nats_publish_errors.inc();
    }

    pub fn job_submitted(&self) {
        self.jobs_submitted.inc();
    }

    pub fn job_cancelled(&self) {
        self.jobs_cancelled.inc();
    }

    /// A stream ended because its out-of-order chunks outgrew their bound.
    pub fn reorder_overflow(&self) {
        self.reorder_overflows.inc();
    }

    pub fn stream_gap(&self, missing: u64) {
        self.stream_gaps.inc_by(missing);
    }

    /// A NATS message or KV entry that could not be read, by where it came from.
    pub fn malformed_message(&self, source: &'static str) {
        self.malformed
            .get_or_create(&vec![("source", source.to_string())])
            .inc();
    }

    /// Result messages not relayed: `not_assigned` (their publisher never held the job
    /// per its decisions), `body_mismatch` (the body named another worker than the
    /// subject).
    pub fn unattributed_results(&self, reason: &'static str, n: u64) {
        self.unattributed_results
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc_by(n);
    }

    /// A request answered 429 at once by a bound of [`crate::in_flight`], or on a full
    /// queue's snapshot ([`crate::queue_view`]).
    pub fn shed(&self, reason: &'static str) {
        self.shed
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// A request refused with 401, by reason (`missing`, `malformed`, `invalid`, `revoked`),
    /// or at the console with 403 (`not_operator`).
    pub fn auth_failure(&self, reason: &'static str) {
        self.auth_failures
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// An authenticated chat or completion request (the model list is not counted).
    pub fn tenant_request(&self, tenant: &str) {
        self.tenant_requests
            .get_or_create(&vec![("tenant", tenant.to_string())])
            .inc();
    }

    /// A request refused for its tenant (`model_not_allowed`, `requests_per_second`,
    /// `tokens_per_minute`, `request_too_large`).
    pub fn tenant_rejection(&self, tenant: &str, reason: &'static str) {
        self.tenant_rejections
            .get_or_create(&vec![
                ("tenant", tenant.to_string()),
                ("reason", reason.to_string()),
            ])
            .inc();
    }

    /// Tokens (prompt estimate + `max_tokens`) charged to a tenant at admission.
    pub fn tenant_tokens_admitted(&self, tenant: &str, tokens: u64) {
        self.tenant_tokens
            .get_or_create(&vec![("tenant", tenant.to_string())])
            .inc_by(tokens);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
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
        metrics.in_flight.inc();
        RequestTimer {
            metrics,
            route,
            start: Instant::now(),
        }
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
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
        assert!(
            text.contains(&format!(
                "metronome_build_info{{version=\"{}\",commit=\"{}\"}} 1",
                metronome_runtime::build_info::VERSION,
                metronome_runtime::build_info::git_commit()
            )),
            "{text}"
        );
        assert!(text.contains(
            "metronome_gateway_http_requests_total{route=\"/v1/models\",status=\"200\"} 2"
        ));
        assert!(text.contains(
            "metronome_gateway_http_request_duration_seconds_bucket{le=\"0.025\",route=\"/v1/models\"} 1"
        ));
        assert!(text.contains(
            "metronome_gateway_http_request_duration_seconds_bucket{le=\"0.01\",route=\"/v1/models\"} 0"
        ));
        assert!(text.contains("metronome_gateway_nats_publish_errors_total 1"));
        assert!(text.contains("metronome_gateway_http_requests_in_flight 0"));
        assert!(text.ends_with("# EOF\n"), "{text}");
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
    }
}
