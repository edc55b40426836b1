//! OpenTelemetry traces: the spans of a request exported over OTLP/HTTP (protobuf) to a
//! collector, so one request is one trace across the gateway, the leader and the worker,
//! and the model server's own spans (vLLM's read the `traceparent` the worker sends) join
//! it.
//!
//! Off by default: without [`ENV_ENDPOINT`] (or [`ENV_TRACES_ENDPOINT`]) nothing is built,
//! no span is handed to an exporter and the helpers below return at once. With it, the
//! `tracing` spans of Metronome's crates at `info` or above become OpenTelemetry spans
//! (`tracing-opentelemetry`), batched and posted by the SDK's batch processor, which also
//! reads the standard `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER` and `OTEL_EXPORTER_OTLP_*`
//! variables; the service name is the binary's name unless [`ENV_SERVICE_NAME`] says
//! otherwise.
//!
//! The exporter posts through the workspace's `reqwest` client, driven by a one-thread
//! runtime of its own: the batch processor exports from its own thread, outside the
//! binary's runtime, and must still be able to flush while the binary shuts its runtime
//! down.
//!
//! How a trace crosses a process boundary: the sender puts the `traceparent` of its span on
//! the message ([`traceparent_of`]); the receiver makes its span a child of it
//! ([`set_parent`]). Spans measured after the fact (the leader's queue wait and decision,
//! whose times the decision record holds) are written with their own start and end
//! ([`record_span`]).

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use metronome_protocol::trace::TraceParent;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _, TracerProvider as _,
};
use opentelemetry::Context;
/// An attribute of a span written with [`record_span`].
pub use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The collector's base URL (`http://localhost:4318`); `/v1/traces` is appended. Setting it
/// turns export on.
pub const ENV_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The full URL of the traces endpoint, used as it is; also turns export on.
pub const ENV_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The service name spans are exported under (default: the binary's name).
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";

/// How long one export may take before it is given up (the batch is dropped, not retried
/// forever: tracing never holds a request back).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The tracer of this process, once export is on.
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Whether spans are exported from this process.
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// Where spans go, from the environment (`lookup`): `None` when export is off.
pub fn endpoint(lookup: impl Fn(&str) -> Option<String>) -> Option<String> {
    [ENV_TRACES_ENDPOINT, ENV_ENDPOINT]
        .into_iter()
        .find_map(|var| lookup(var).filter(|v| !v.trim().is_empty()))
}

/// The exporter's provider: shut down (the last spans flushed) when dropped.
pub(crate) struct Export {
    provider: SdkTracerProvider,
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            eprintln!("OpenTelemetry: the last spans may be lost: {error}");
        }
    }
}

/// The layer that feeds the exporter, and the exporter's provider.
pub(crate) type Started<S> = (
    tracing_opentelemetry::OpenTelemetryLayer<S, SdkTracer>,
    Export,
);

/// Build the exporter and the layer that feeds it, when the environment turns export on.
pub(crate) fn start<S>(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<Started<S>>, String>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if endpoint(&lookup).is_none() {
        return Ok(None);
    }
    use opentelemetry_otlp::WithHttpConfig as _;
    let client = HttpClient::new()?;
    // The endpoint, protocol and headers are read from the standard variables by the
    // exporter itself, so they mean what every other OpenTelemetry SDK takes them to mean.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .build()
        .map_err(|e| format!("cannot build the OTLP exporter: {e}"))?;
    let service = lookup(ENV_SERVICE_NAME)
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(binary_name);
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    let tracer = provider.tracer("metronome");
    let _ = TRACER.set(tracer.clone());
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false);
    Ok(Some((layer, Export { provider })))
}

/// The running binary's file name (`metronome-gateway`), the default service name.
fn binary_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "metronome".to_string())
}

/// The OpenTelemetry context of a remote parent (the span a carried `traceparent` names).
fn remote(parent: &TraceParent) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(parent.trace_id_bytes()),
        SpanId::from_bytes(parent.parent_id_bytes()),
        TraceFlags::new(parent.flags()),
        true,
        TraceState::default(),
    ))
}

/// Make `span` a child of the span `parent` names (a `traceparent` that came with a request
/// or a message). Call it before the span is first entered. Does nothing when export is
/// off.
pub fn set_parent(span: &tracing::Span, parent: &TraceParent) {
    if enabled() {
        // Only fails when the span was already started or is filtered out: it then stays
        // in a trace of its own, which loses a link, not a request.
        let _ = span.set_parent(remote(parent));
    }
}

/// The `traceparent` to hand on from `span` (its own span id, so the receiver's spans
/// become its children); `fallback` when export is off or the span is not exported.
pub fn traceparent_of(span: &tracing::Span, fallback: &TraceParent) -> TraceParent {
    if !enabled() {
        return *fallback;
    }
    let context = span.context();
    let sc = context.span().span_context().clone();
    if !sc.is_valid() {
        return *fallback;
    }
    TraceParent::from_parts(
        sc.trace_id().to_bytes(),
        sc.span_id().to_bytes(),
        sc.trace_flags().to_u8(),
    )
    .unwrap_or(*fallback)
}

/// Export a finished span `name` measured after the fact, from `start` to `end`, a child
/// of `parent`; returns its context (to hand on), or `None` when export is off.
pub fn record_span(
    name: &'static str,
    parent: &TraceParent,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<KeyValue>,
) -> Option<TraceParent> {
    let tracer = TRACER.get()?;
    let mut span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(start)
        .with_attributes(attributes)
        .start_with_context(tracer, &remote(parent));
    let sc = span.span_context().clone();
    span.end_with_timestamp(end.max(start));
    TraceParent::from_parts(
        sc.trace_id().to_bytes(),
        sc.span_id().to_bytes(),
        sc.trace_flags().to_u8(),
    )
}

/// An OTLP HTTP client on the workspace's `reqwest`, with a runtime of its own (see the
/// module's notes).
#[derive(Debug)]
struct HttpClient {
    http: reqwest::Client,
    runtime: Option<tokio::runtime::Runtime>,
}

impl HttpClient {
    fn new() -> Result<HttpClient, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the OTLP exporter's runtime: {e}"))?;
        let http = reqwest::Client::builder()
            .timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot build the OTLP exporter's HTTP client: {e}"))?;
        Ok(HttpClient {
            http,
            runtime: Some(runtime),
        })
    }
}

impl Drop for HttpClient {
    fn drop(&mut self) {
        // Dropped by the exporter on whatever thread shuts it down, maybe inside another
        // runtime: never block there.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HttpClient {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<
        opentelemetry_http::Response<opentelemetry_http::Bytes>,
        opentelemetry_http::HttpError,
    > {
        let runtime = self
            .runtime
            .as_ref()
            .ok_or("the OTLP exporter's runtime is shut down")?;
        let (parts, body) = request.into_parts();
        let request = self
            .http
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body);
        // Sent from inside the exporter's runtime: `send` starts the request's time-out
        // timer, which needs a Tokio runtime, and the batch processor calls this from a
        // thread of its own that has none.
        let answer = runtime
            .spawn(async move {
                let response = request.send().await?;
                let status = response.status();
                let headers = response.headers().clone();
                let body = response.bytes().await?;
                Ok::<_, reqwest::Error>((status, headers, body))
            })
            .await??;
        let (status, headers, body) = answer;
        let mut response = opentelemetry_http::Response::new(body);
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_is_on_only_with_an_endpoint() {
        let none = |_: &str| None;
        assert_eq!(endpoint(none), None);
        let blank = |_: &str| Some(" ".to_string());
        assert_eq!(endpoint(blank), None);
        let base = |k: &str| (k == ENV_ENDPOINT).then(|| "http://c:4318".to_string());
        assert_eq!(endpoint(base).as_deref(), Some("http://c:4318"));
        let both = |k: &str| Some(format!("{k}-url"));
        assert_eq!(
            endpoint(both),
            Some(format!("{ENV_TRACES_ENDPOINT}-url")),
            "the traces endpoint wins, as the specification says"
        );
    }

    #[test]
    fn helpers_do_nothing_while_export_is_off() {
        // No test in this crate starts an exporter.
        let parent =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let span = tracing::info_span!("job");
        set_parent(&span, &parent);
        assert_eq!(traceparent_of(&span, &parent), parent);
        let now = SystemTime::now();
        assert_eq!(
            record_span("queue wait", &parent, now, now, Vec::new()),
            None
        );
    }
}
