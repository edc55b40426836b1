//! The OpenAI endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both also
//! streaming), `POST /v1/embeddings` (a job like the others, with no output) and
//! `GET /v1/models`.
//!
//! Per request: authenticate the API key (401), read and validate the body, refuse a model
//! the tenant may not use (403) or that no worker serves (404), charge the tenant's limits
//! (429), all before publishing anything; then build the job (tenant from the key, cost
//! from the prompt estimate and `max_tokens`, deadline from the configuration or the
//! `x-metronome-deadline-ms` header), submit it, then answer with its final result, or
//! stream its chunks from the first one on.
//!
//! Invariant: every response of these endpoints, error or not, carries
//! `x-metronome-job-id`, and `x-metronome-worker` once a worker is known (when
//! `expose_worker_header` is on), so any slow or failed request can be traced to its
//! decision on `decisions.<job_id>`; and `x-metronome-trace-id`, the W3C trace the request
//! belongs to (the client's `traceparent` when it sent a valid one, else a new trace), which
//! the job carries to the worker and the worker to the model server. With trace export on
//! (`metronome_runtime::otel`), the request is the `gateway request` span, a child of the
//! client's span, and the job carries that span's context. The span lasts until the
//! response is complete (a stream's last event, or the client leaving it) and records the
//! job's output tokens.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use metronome_protocol::perf::SloField;
use metronome_protocol::perf::MAX_SLO_TOK_S;
use metronome_protocol::time::unix_ms;
use metronome_protocol::trace::{TraceParent, TRACEPARENT_HEADER};
use metronome_protocol::{Endpoint, SloRequest};
use serde_json::{json, Value};
use tracing::Instrument;

use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::headers::{
    HEADER_DEADLINE_MS, HEADER_JOB_ID, HEADER_PRIORITY, HEADER_SLO_MIN_TOK_S, HEADER_SLO_TTFT_MS,
    HEADER_TRACE_ID, HEADER_WORKER,
};
use crate::openai::{parse_request, InferenceRequest, RequestPolicy};
use crate::relay::sse_response;
use crate::submit::{build_job, new_job_id, JobEvent, Submission};
use crate::AppState;

/// Values from this on in [`HEADER_DEADLINE_MS`] are absolute Unix milliseconds
/// (10^12 ms is September 2001; no budget is that long).
const ABSOLUTE_DEADLINE_FROM: u64 = 1_000_000_000_000;

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Response {
    handle(state, Endpoint::Chat, headers, body).await
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Response {
    handle(state, Endpoint::Completion, headers, body).await
}

pub async fn embeddings(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Response {
    handle(state, Endpoint::Embedding, headers, body).await
}

async fn handle(
    state: AppState,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Response {
    let job_id = new_job_id();
    let trace = TraceParent::continue_or_start(
        headers
            .get(TRACEPARENT_HEADER)
            .and_then(|v| v.to_str().ok()),
    );
    let span = tracing::info_span!(
        "job",
        otel.name = "gateway request",
        otel.kind = "server",
        job_id = %job_id,
        trace_id = %trace.trace_id(),
        endpoint = ?endpoint,
        model = tracing::field::Empty,
        tenant = tracing::field::Empty,
        key_id = tracing::field::Empty,
        worker_id = tracing::field::Empty,
        output_tokens = tracing::field::Empty,
    );
    // Exported, the request's span is a child of the client's; the job then carries the
    // request span's own context, so the leader's and the worker's spans hang below it.
    metronome_runtime::otel::set_parent(&span, &trace);
    let carried = metronome_runtime::otel::traceparent_of(&span, &trace);
    let mut worker = None;
    let result = serve(
        &state,
        endpoint,
        &headers,
        body,
        &job_id,
        &carried,
        &mut worker,
    )
    .instrument(span.clone())
    .await;
    if let Some(w) = &worker {
        span.record("worker_id", w.as_str());
    }
    let mut response = result.unwrap_or_else(|error| {
        tracing::debug!(%job_id, %error, "request failed");
        error.into_response()
    });
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&job_id) {
        h.insert(HEADER_JOB_ID, v);
    }
    if let Ok(v) = HeaderValue::from_str(&trace.trace_id()) {
        h.insert(HEADER_TRACE_ID, v);
    }
    if state.config.expose_worker_header {
        if let Some(v) = worker.and_then(|w| HeaderValue::from_str(&w).ok()) {
            h.insert(HEADER_WORKER, v);
        }
    }
    response
}

/// The job's deadline (Unix ms) from the request header, or the configured queue timeout.
fn deadline_ms(state: &AppState, headers: &HeaderMap, now_ms: u64) -> Result<u64, ApiError> {
    let max = state.config.max_queue_timeout_ms;
    let Some(value) = headers.get(HEADER_DEADLINE_MS) else {
        return Ok(now_ms + state.config.queue_timeout_ms);
    };
    let parsed = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            ApiError::invalid_field(
                HEADER_DEADLINE_MS,
                format!("`{HEADER_DEADLINE_MS}` must be a number of milliseconds"),
            )
        })?;
    let budget = if parsed >= ABSOLUTE_DEADLINE_FROM {
        parsed.saturating_sub(now_ms)
    } else {
        parsed
    };
    if budget == 0 {
        return Err(ApiError::invalid_field(
            HEADER_DEADLINE_MS,
            format!("`{HEADER_DEADLINE_MS}` is already in the past"),
        ));
    }
    Ok(now_ms + budget.min(max))
}

/// The client's SLO request from [`HEADER_SLO_TTFT_MS`] and [`HEADER_SLO_MIN_TOK_S`]. The
/// dispatcher applies it only where it is tighter than the model's SLO.
fn slo_request(headers: &HeaderMap) -> Result<Option<SloRequest>, ApiError> {
    fn parse<T: std::str::FromStr>(headers: &HeaderMap, name: &str) -> Result<Option<T>, ApiError> {
        let Some(value) = headers.get(name) else {
            return Ok(None);
        };
        value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<T>().ok())
            .map(Some)
            .ok_or_else(|| ApiError::invalid_field(name, format!("`{name}` must be a number")))
    }
    let ttft_ms: Option<u64> = parse(headers, HEADER_SLO_TTFT_MS)?;
    let min_tok_s: Option<f64> = parse(headers, HEADER_SLO_MIN_TOK_S)?;
    let slo = SloRequest { ttft_ms, min_tok_s };
    match slo.invalid_field() {
        Some(SloField::TtftMs) => Err(ApiError::invalid_field(
            HEADER_SLO_TTFT_MS,
            format!("`{HEADER_SLO_TTFT_MS}` must be at least 1"),
        )),
        Some(SloField::MinTokS) => Err(ApiError::invalid_field(
            HEADER_SLO_MIN_TOK_S,
            format!("`{HEADER_SLO_MIN_TOK_S}` must be in (0, {MAX_SLO_TOK_S}]"),
        )),
        None => Ok((ttft_ms.is_some() || min_tok_s.is_some()).then_some(slo)),
    }
}

async fn serve(
    state: &AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<OpenAiJson<Value>, ApiError>,
    job_id: &str,
    trace: &TraceParent,
    worker: &mut Option<String>,
) -> Result<Response, ApiError> {
    let caller = crate::auth::authenticate(&state.auth, &state.metrics, headers)?;
    state.metrics.tenant_request(&caller.tenant_name);
    let span = tracing::Span::current();
    span.record("tenant", caller.tenant_name.as_str());
    if let Some(key_id) = &caller.key_id {
        span.record("key_id", key_id.as_str());
    }
    let OpenAiJson(body) = body?;
    let policy = RequestPolicy {
        default_max_tokens: state.config.default_max_tokens,
        max_tokens_limit: state.config.max_tokens_limit,
        inject_default_max_tokens: state.config.inject_default_max_tokens,
    };
    let request: InferenceRequest = parse_request(endpoint, body, &policy)?;
    tracing::Span::current().record("model", request.model.as_str());
    // 403 before 404: a tenant learns nothing about models outside its list.
    crate::auth::check_model(&state.auth, &state.metrics, &caller, &request.model)?;
    let now_ms = unix_ms();
    if !state.registry.serves(&request.model, now_ms) {
        return Err(ApiError::unknown_model(&request.model));
    }
    // The leader's queue of the model is known full for this tenant: shed now, before
    // the job costs a publish and a decision (the leader's own rule on its latest snapshot).
    let queue_tenant =
        metronome_protocol::names::tenant_of_token(&caller.tenant_name).unwrap_or("");
    if let Some(full) = state.queues.refusing(&request.model, queue_tenant, now_ms) {
        state.metrics.shed("queue_full");
        return Err(ApiError::queue_known_full(
            &request.model,
            full.waiting,
            state.config.retry_after_secs,
        ));
    }
    let deadline = deadline_ms(state, headers, now_ms)?;
    let slo = slo_request(headers)?;
    let asked = headers
        .get(HEADER_PRIORITY)
        .map(|v| v.to_str().unwrap_or("?"));
    let priority = crate::auth::priority(&state.metrics, &caller, asked)?;
    // Charged last, once the request is known to be acceptable, so a refused request
    // costs the tenant nothing.
    let tokens = u64::from(request.prompt_tokens) + u64::from(request.total_max_tokens());
    crate::auth::charge(&state.auth, &state.metrics, &caller, tokens)?;
    let mut job = build_job(job_id, &request, &caller.tenant_name, now_ms, deadline);
    job.slo = slo;
    job.priority = Some(priority);
    job.traceparent = Some(trace.to_string());
    let mut submission = Submission::submit(state, &job).await?;
    tracing::debug!(
        prompt_tokens = job.prompt_tokens,
        max_tokens = job.max_tokens,
        stream = request.stream,
        "job submitted"
    );
    if request.stream {
        // Headers go out with the first chunk: by then the worker is known (for
        // `x-metronome-worker`), and every failure before the first token (queue full, no
        // capacity, worker failure) is still a plain HTTP status rather than an error
        // event inside a 200 stream. Waiting costs the client nothing: no byte could
        // have been sent earlier.
        loop {
            let event = submission.next_event().await.inspect_err(|_| {
                worker.clone_from(&submission.worker_id);
            })?;
            *worker = submission.worker_id.clone();
            match event {
                JobEvent::Assigned(_) => {}
                JobEvent::Chunk(_) => {
                    submission.replay(event);
                    break;
                }
                JobEvent::Final(result) => {
                    if let Some(error) = &result.error {
                        submission.finished();
                        return Err(ApiError::from_result_error(
                            error,
                            state.config.retry_after_secs,
                        ));
                    }
                    submission.replay(JobEvent::Final(result));
                    break;
                }
            }
        }
        // The request's span goes with the stream: the request ends when the stream does.
        return Ok(sse_response(
            submission,
            endpoint,
            request.model,
            request.include_usage,
            tracing::Span::current(),
        ));
    }
    loop {
        let event = submission.next_event().await;
        worker.clone_from(&submission.worker_id);
        match event? {
            JobEvent::Assigned(_) | JobEvent::Chunk(_) => {}
            JobEvent::Final(result) => {
                submission.finished();
                tracing::Span::current().record("output_tokens", result.usage.completion_tokens);
                if let Some(error) = &result.error {
                    return Err(ApiError::from_result_error(
                        error,
                        state.config.retry_after_secs,
                    ));
                }
                return match result.response {
                    Some(response) => Ok(Json(response).into_response()),
                    None => Err(ApiError::bad_upstream(
                        "the worker finished the job without a response",
                    )),
                };
            }
        }
    }
}

fn model_object(id: &str, created_s: u64, workers: usize) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": created_s,
        "owned_by": "metronome",
        "metronome": { "workers": workers },
    })
}

/// `GET /v1/models`: every model a live worker serves that the caller's tenant may use.
pub async fn list_models(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let caller = crate::auth::authenticate(&state.auth, &state.metrics, &headers)?;
    let data: Vec<Value> = state
        .registry
        .models(unix_ms())
        .iter()
        .filter(|m| state.auth.allows_model(&caller, &m.id))
        .map(|m| model_object(&m.id, m.created_s, m.workers))
        .collect();
    Ok(Json(json!({ "object": "list", "data": data })))
}

/// `GET /v1/models/{model}`: 404 for a model the tenant may not use, as for one not served.
pub async fn get_model(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let caller = crate::auth::authenticate(&state.auth, &state.metrics, &headers)?;
    state
        .registry
        .models(unix_ms())
        .iter()
        .find(|m| m.id == model && state.auth.allows_model(&caller, &m.id))
        .map(|m| Json(model_object(&m.id, m.created_s, m.workers)))
        .ok_or_else(|| ApiError::unknown_model(&model))
}
