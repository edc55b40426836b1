//! One trace per request: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the gateway, the leader
//! and the worker export their spans of one request under the client's trace id, each a
//! child of the span before it, and the messages between them carry `traceparent`. A
//! streamed request's span lasts until its stream ends.
//!
//! The collector is an OTLP/HTTP receiver in the test process: it decodes what the
//! exporters post with the protocol's own protobuf messages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use futures::StreamExt as _;
use metronome_e2e::{chat_body, Cluster, ClusterSpec};
use metronome_protocol::names::{
    event_done_subject, result_chunk_subject, result_final_subject, HEADER_TRACEPARENT,
    STREAM_EVENTS, STREAM_RESULTS,
};
use metronome_protocol::trace::TraceParent;
use metronome_testkit::wait_for;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;

const MODEL: &str = "e2e-model";
const CLIENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const STREAMING_CLIENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One exported span, as the collector received it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    start_ns: u64,
    end_ns: u64,
    attributes: HashMap<String, String>,
}

type Spans = Arc<Mutex<Vec<Received>>>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

/// `POST /v1/traces`: decode the protobuf export request and keep its spans.
async fn receive(State(spans): State<Spans>, body: Bytes) -> axum::http::StatusCode {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return axum::http::StatusCode::BAD_REQUEST;
    };
    let mut kept = spans.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .map(|a| text(a.value.as_ref()))
            .unwrap_or_default();
        for span in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
            kept.push(Received {
                service: service.clone(),
                name: span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
                start_ns: span.start_time_unix_nano,
                end_ns: span.end_time_unix_nano,
                attributes: span
                    .attributes
                    .iter()
                    .map(|a| (a.key.clone(), text(a.value.as_ref())))
                    .collect(),
            });
        }
    }
    axum::http::StatusCode::OK
}

/// A collector on a free port: its base URL and what it received.
async fn collector() -> (String, Spans) {
    let spans = Spans::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

/// The one span named `name` from `service`.
fn one<'a>(spans: &'a [Received], service: &str, name: &str) -> &'a Received {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one {name:?} span from {service}: {spans:#?}"
    );
    found[0]
}

/// The spans of one request (the trace `client` started), once every process's spans of it
/// have arrived.
async fn spans_of(spans: &Spans, client: &TraceParent) -> Vec<Received> {
    let names = [
        ("metronome-gateway", "gateway request"),
        ("metronome-dispatcher", "queue wait"),
        ("metronome-dispatcher", "decision"),
        ("metronome-worker-agent", "worker run"),
        ("metronome-worker-agent", "model server call"),
    ];
    wait_for(
        "the request's spans from the gateway, the leader and the worker",
        Duration::from_secs(30),
        || {
            let got: Vec<Received> = spans
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.trace_id == client.trace_id())
                .cloned()
                .collect();
            let complete = names.iter().all(|(service, name)| {
                got.iter().any(|s| &s.service == service && &s.name == name)
            });
            async move { complete.then_some(got) }
        },
    )
    .await
}

/// A response header as text.
/// A chat request sent within the client's trace `parent`: answered 200, under its trace id.
async fn chat_in_trace(cluster: &Cluster, parent: &TraceParent, stream: bool) -> reqwest::Response {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .header("traceparent", parent.to_string())
        .json(&chat_body(MODEL, 4, stream))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    assert_eq!(
        resp.headers()["x-metronome-trace-id"],
        parent.trace_id().as_str()
    );
    resp
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()[name].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_the_gateway_the_leader_and_the_worker() {
    let (url, spans) = collector().await;
    let mut spec = ClusterSpec::uniform(1, MODEL);
    spec.env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), url),
        // Export every 100 ms rather than every 5 s.
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
    ];
    let cluster = Cluster::start(spec).await;
    let client = TraceParent::parse(CLIENT).unwrap();

    let resp = chat_in_trace(&cluster, &client, false).await;
    let job_id = header(&resp, "x-metronome-job-id");
    let worker = header(&resp, "x-metronome-worker");

    let trace = spans_of(&spans, &client).await;

    let request = one(&trace, "metronome-gateway", "gateway request");
    assert_eq!(
        request.parent,
        client.parent_id(),
        "the client's span is the parent"
    );
    assert_eq!(request.attributes["job_id"], job_id);
    let wait = one(&trace, "metronome-dispatcher", "queue wait");
    let decision = one(&trace, "metronome-dispatcher", "decision");
    assert_eq!(wait.parent, request.span_id);
    assert_eq!(decision.parent, request.span_id);
    assert_eq!(decision.attributes["metronome.worker_id"], worker);
    assert_eq!(decision.attributes["metronome.job_id"], job_id);
    let ttft: f64 = decision.attributes["metronome.predicted_ttft_ms"]
        .parse()
        .expect("the decision carries the winner's predicted TTFT");
    assert!(ttft > 0.0, "{ttft}");
    let run = one(&trace, "metronome-worker-agent", "worker run");
    assert_eq!(
        run.parent, decision.span_id,
        "the run hangs below its decision"
    );
    assert_eq!(run.attributes["job_id"], job_id);
    let call = one(&trace, "metronome-worker-agent", "model server call");
    assert_eq!(call.parent, run.span_id);

    // The final result and the completion event carry the run's context in their headers.
    let js = cluster.jetstream().await;
    for (stream, subject) in [
        // Served without a key: the gateway's anonymous tenant.
        (
            STREAM_RESULTS,
            result_final_subject(Some("anonymous"), &job_id, &worker),
        ),
        (STREAM_EVENTS, event_done_subject(&worker)),
    ] {
        let msg = js
            .get_stream(stream)
            .await
            .unwrap()
            .get_last_raw_message_by_subject(&subject)
            .await
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
        let carried = msg
            .headers
            .get(HEADER_TRACEPARENT)
            .and_then(|v| TraceParent::parse(v.as_str()))
            .unwrap_or_else(|| panic!("{subject} carries a traceparent: {:?}", msg.headers));
        assert_eq!(carried.trace_id(), client.trace_id(), "{subject}");
        assert_eq!(carried.parent_id(), run.span_id, "{subject}");
    }

    // Streamed: the chunks carry the run's context too, and the request's span lasts until
    // the stream ends.
    let streaming = TraceParent::parse(STREAMING_CLIENT).unwrap();
    let nats = cluster.nats_client().await;
    let mut chunks = nats
        .subscribe(result_chunk_subject(Some("anonymous"), "*", "*"))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    let resp = chat_in_trace(&cluster, &streaming, true).await;
    let job_id = header(&resp, "x-metronome-job-id");
    let body = resp.text().await.unwrap();
    // The closing chunk's usage (the request asks for it).
    let output_tokens = body
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())
        .unwrap_or_else(|| panic!("a usage chunk in the stream: {body}"));

    let trace = spans_of(&spans, &streaming).await;
    let request = one(&trace, "metronome-gateway", "gateway request");
    assert_eq!(request.attributes["job_id"], job_id);
    let run = one(&trace, "metronome-worker-agent", "worker run");
    let call = one(&trace, "metronome-worker-agent", "model server call");
    // The worker publishes the final result after its model-server call ends, and the
    // stream ends after the final result: a span that ended with the first chunk ends
    // before the call does.
    assert!(
        request.end_ns >= call.end_ns,
        "the request's span ends with its stream ({} ns after its start), not before the model \
         server call ends ({} ns after it)",
        request.end_ns - request.start_ns,
        call.end_ns.saturating_sub(request.start_ns),
    );
    assert_eq!(
        request.attributes.get("output_tokens").map(String::as_str),
        Some(output_tokens.to_string().as_str()),
        "the request's span records the tokens the stream delivered: {request:#?}"
    );

    let mut carried = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(1), chunks.next()).await {
        if !msg.subject.contains(job_id.as_str()) {
            continue;
        }
        let tp = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(HEADER_TRACEPARENT))
            .and_then(|v| TraceParent::parse(v.as_str()))
            .unwrap_or_else(|| panic!("{} carries a traceparent: {:?}", msg.subject, msg.headers));
        carried.push(tp);
    }
    assert!(!carried.is_empty(), "the stream's chunks were seen");
    for tp in carried {
        assert_eq!(tp.trace_id(), streaming.trace_id());
        assert_eq!(tp.parent_id(), run.span_id, "a chunk names the run's span");
    }
}
