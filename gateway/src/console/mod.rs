//! The operator console at [`PATH`] (`/console`): workers with their load and EWMAs, the
//! per-model picture (the leader's admission queues from the `queues` bucket, stale ones
//! marked), a live decision feed and the explain view of any job, in the browser.
//!
//! Everything is read through the documented NATS contract with the read model the
//! `metronome` CLI prints (`metronome_readmodel`), so the console and `metronome status /
//! workers / explain` can never disagree. The page is three static files embedded in the binary
//! (`include_str!`, no build step); it loads snapshots from `/console/api/*` and then
//! follows `/console/api/events`, an SSE stream of decisions as they are made, the
//! workers and the queues every second, and the status every five.
//!
//! Invariants: the console shows ids, numbers and reasons, never a prompt or an output
//! (a job's final result is stripped of its response before it leaves the gateway); every
//! console route, the page included, passes [`require_operator`]; an event stream ends
//! when the gateway shuts down, so an open console never holds up a graceful stop.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{redis_keys, Decision, Outcome, Prediction};
use metronome_readmodel::source::Nats;
use metronome_readmodel::ReadError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::auth::OperatorRefusal;
use crate::error::ApiError;
use crate::AppState;

/// Where the console is served.
pub const PATH: &str = "/console";

const INDEX_HTML: &str = include_str!("static/index.html");
const CONSOLE_JS: &str = include_str!("static/console.js");
const CONSOLE_CSS: &str = include_str!("static/console.css");

/// Window of the decision rates and per-model counts, as `metronome status` defaults to.
const STATUS_WINDOW_S: u64 = 60;
/// Completion events searched for a job's own in the explain view.
const EXPLAIN_SCAN: usize = 100_000;
/// Most past decisions the feed starts with.
const MAX_FEED: u64 = 500;
/// How often the event stream sends the workers (status every fifth time: it reads a
/// minute of decisions).
const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);
const STATUS_EVERY_SNAPSHOTS: u64 = 5;

/// The console's routes, every one behind [`require_operator`].
pub fn router(state: AppState) -> Router<AppState> {
    Router::new()
        .route(PATH, get(index))
        .route("/console/", get(index))
        .route("/console/console.js", get(script))
        .route("/console/console.css", get(style))
        .route("/console/api/workers", get(workers))
        .route("/console/api/status", get(status))
        .route("/console/api/queues", get(queues))
        .route("/console/api/decisions", get(decisions))
        .route("/console/api/explain/{job_id}", get(explain))
        .route("/console/api/events", get(events))
        .route_layer(axum::middleware::from_fn_with_state(
            state,
            require_operator,
        ))
}

/// Lets a request through when [`crate::auth::Auth::operator`] does. A 401 asks the browser
/// for HTTP Basic credentials (the operator key as the password), which it then sends with
/// every request of the page, the event stream included.
pub async fn require_operator(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    match state.auth.operator(request.headers()) {
        Ok(_) => next.run(request).await,
        Err(OperatorRefusal::Auth(failure)) => {
            state.metrics.auth_failure(failure.reason());
            let mut response = failure.into_api_error().into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"metronome console\", charset=\"UTF-8\""),
            );
            response
        }
        Err(OperatorRefusal::NotOperator) => {
            state.metrics.auth_failure("not_operator");
            ApiError::not_operator().into_response()
        }
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn index() -> Html<&'static str> {
    Html(INDEX_HTML)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", CONSOLE_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", CONSOLE_CSS)
}

fn nats(state: &AppState) -> Nats {
    Nats {
        client: state.client.clone(),
        js: state.js.clone(),
    }
}

fn api_error(e: ReadError) -> ApiError {
    match e {
        ReadError::NotFound(m) => ApiError::not_found(m),
        ReadError::Usage(m) => ApiError::invalid_request(m),
        other => ApiError::nats_unavailable(other, 2),
    }
}

/// The workers as `metronome workers --json` shows them, with EWMAs when the gateway knows
/// Redis.
async fn worker_list(state: &AppState) -> Result<Value, ReadError> {
    let (views, warning) = metronome_readmodel::worker_views(
        &nats(state),
        state.config.worker_stale_after_ms,
        state.config.redis_url.as_deref(),
        &state.config.redis_tls,
        redis_keys::DEFAULT_PREFIX,
    )
    .await?;
    if let Some(w) = warning {
        tracing::debug!(warning = %w, "console: workers read with a warning");
    }
    Ok(serde_json::json!({ "now_ms": unix_ms(), "workers": views }))
}

async fn status_report(state: &AppState) -> Result<Value, ReadError> {
    let report = metronome_readmodel::status_report(
        &nats(state),
        STATUS_WINDOW_S,
        state.config.worker_stale_after_ms,
        unix_ms(),
    )
    .await?;
    serde_json::to_value(report).map_err(|e| ReadError::Usage(e.to_string()))
}

/// The leader's queue snapshots as `metronome status --json` shows them, each judged
/// fresh or stale now (against the newest epoch in the bucket: the status event carries
/// the leader's).
async fn queue_list(state: &AppState) -> Result<Value, ReadError> {
    let (snapshots, _unreadable) = nats(state).queues().await?;
    let now = unix_ms();
    let rows = metronome_readmodel::status::QueueRow::rows(snapshots, None, now);
    Ok(serde_json::json!({ "now_ms": now, "queues": rows }))
}

async fn queues(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    queue_list(&state).await.map(Json).map_err(api_error)
}

async fn workers(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    worker_list(&state).await.map(Json).map_err(api_error)
}

async fn status(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    status_report(&state).await.map(Json).map_err(api_error)
}

/// One line of the decision feed: what an operator scans for, without the candidates'
/// terms (the explain view has those).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FeedLine {
    pub job_id: String,
    pub model: Option<String>,
    pub outcome: Outcome,
    pub attempt: u32,
    pub worker_id: Option<String>,
    pub reason: Option<String>,
    pub reason_code: Option<String>,
    pub queue_wait_ms: u64,
    pub decided_ms: u64,
    pub candidates: usize,
    pub not_eligible: usize,
    /// The winner's prediction.
    pub predicted: Option<Prediction>,
}

impl From<&Decision> for FeedLine {
    fn from(d: &Decision) -> FeedLine {
        let winner = d
            .worker_id
            .as_deref()
            .and_then(|w| d.candidates.iter().find(|c| c.worker_id == w));
        FeedLine {
            job_id: d.job_id.clone(),
            model: d.model.clone(),
            outcome: d.outcome,
            attempt: d.attempt,
            worker_id: d.worker_id.clone(),
            reason: d.reason.clone(),
            reason_code: d.reason_code.clone(),
            queue_wait_ms: d.queue_wait_ms,
            decided_ms: d.decided_ms,
            candidates: d.candidates.len(),
            not_eligible: d.rejected.len(),
            predicted: winner.and_then(|c| c.prediction),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Last {
    n: Option<u64>,
}

async fn decisions(
    State(state): State<AppState>,
    Query(last): Query<Last>,
) -> Result<Json<Vec<FeedLine>>, ApiError> {
    let n = last.n.unwrap_or(50).min(MAX_FEED);
    let past = nats(&state).last_decisions(n).await.map_err(api_error)?;
    Ok(Json(past.iter().map(FeedLine::from).collect()))
}

/// The explain view's data: `metronome explain --json` plus the CLI's text, with the final
/// result's response (the model's output) removed.
async fn explain(
    State(state): State<AppState>,
    Path(job_id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let mut story = metronome_readmodel::story(&nats(&state), &job_id, EXPLAIN_SCAN)
        .await
        .map_err(api_error)?;
    without_output(&mut story);
    let mut body = metronome_readmodel::explain::to_json(&story);
    body["text"] = Value::String(story.render());
    Ok(Json(body))
}

/// Drop everything a job's records hold of its output: the console shows how a job was
/// placed and how it ran, never what it said.
pub fn without_output(story: &mut metronome_readmodel::explain::Story) {
    if let Some(result) = story.result.as_mut() {
        result.response = None;
    }
}

/// `/console/api/events`: decisions as they are made (`decision`), the workers and the
/// queues every second (`workers`, `queues`) and the status every five (`status`), until
/// the client leaves or the gateway shuts down.
async fn events(
    State(state): State<AppState>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let mut live = nats(&state).follow_decisions().await.map_err(api_error)?;
    let stop = state.console_stop.clone();
    let stream = async_stream::stream! {
        let mut tick = tokio::time::interval(SNAPSHOT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut ticks = 0u64;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {
                    match worker_list(&state).await {
                        Ok(v) => yield Ok(json_event("workers", &v)),
                        Err(e) => yield Ok(json_event("problem", &serde_json::json!({"message": e.to_string()}))),
                    }
                    if let Ok(v) = queue_list(&state).await {
                        yield Ok(json_event("queues", &v));
                    }
                    if ticks % STATUS_EVERY_SNAPSHOTS == 0 {
                        if let Ok(v) = status_report(&state).await {
                            yield Ok(json_event("status", &v));
                        }
                    }
                    ticks += 1;
                }
                msg = live.next() => match msg {
                    Some(m) => {
                        // A record this version cannot read is skipped, as the CLI does.
                        if let Ok(d) = serde_json::from_slice::<Decision>(&m.payload) {
                            yield Ok(json_event("decision", &FeedLine::from(&d)));
                        }
                    }
                    None => break,
                },
            }
        }
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

fn json_event<T: Serialize>(name: &str, value: &T) -> Event {
    Event::default()
        .event(name)
        .data(serde_json::to_string(value).unwrap_or_else(|_| "null".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_its_script_and_style_from_the_console_path() {
        assert!(INDEX_HTML.contains("src=\"/console/console.js\""));
        assert!(INDEX_HTML.contains("href=\"/console/console.css\""));
        // Every endpoint the script calls is one the router serves.
        for path in [
            "/console/api/workers",
            "/console/api/status",
            "/console/api/queues",
            "/console/api/decisions",
            "/console/api/explain/",
            "/console/api/events",
        ] {
            assert!(CONSOLE_JS.contains(path), "console.js never calls {path}");
        }
    }
}
