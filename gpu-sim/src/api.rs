//! The HTTP face of one simulated GPU: vLLM's OpenAI-compatible routes.
//!
//! `POST /v1/chat/completions` and `POST /v1/completions` (streaming as SSE and not),
//! `POST /v1/embeddings` ([`crate::embedding`]), `GET /v1/models`, `GET /health`,
//! `GET /metrics`. Errors use OpenAI's body
//! (`{"error": {"message", "type", "param", "code"}}`): malformed JSON or a bad field 400,
//! unknown model 404, a request longer than `max_model_len` 400, shutting down 503.
//! Streams send one chunk per token (the first chat chunk also carries the assistant role,
//! so the first chunk is the first token), a finish chunk, the usage chunk when
//! `stream_options.include_usage` is set, then `data: [DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::choice::{Choice, ForcedTool, Plan};
use crate::embedding::{self, EmbeddingRequest};
use crate::engine::EngineError;
use crate::metrics;
use crate::openai::{
    self, ChatRequest, Common, CompletionRequest, Kind, Prompt, ResponseMeta, Usage,
};
use crate::scheduler::{Gpu, SeqEvent, Submission, SubmitError};

/// The router of one simulated GPU.
pub fn router(gpu: Arc<Gpu>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(not_found)
        .with_state(gpu)
}

/// An error rendered as OpenAI's error body.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Parse a JSON body; any failure (syntax or shape) is a 400 in OpenAI's error shape, and
/// is logged so an operator sees what was rejected.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        tracing::info!(error = %e, body_bytes = body.len(), "rejected malformed request body");
        ApiError::bad_request(format!("invalid request body: {e}"), None)
    })
}

async fn chat_completions(State(gpu): State<Arc<Gpu>>, body: Bytes) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(&body)?;
    let prompt = request.prompt();
    let tool = request
        .forced_tool()
        .map_err(|(message, field)| ApiError::bad_request(message, Some(field)))?;
    generate(gpu, Kind::Chat, request.common, prompt, tool).await
}

async fn completions(State(gpu): State<Arc<Gpu>>, body: Bytes) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    let prompt = request
        .prompt()
        .map_err(|m| ApiError::bad_request(m, Some("prompt")))?;
    generate(gpu, Kind::Completion, request.common, prompt, None).await
}

async fn generate(
    gpu: Arc<Gpu>,
    kind: Kind,
    common: Common,
    prompt: Prompt,
    tool: Option<ForcedTool>,
) -> Result<Response, ApiError> {
    let cfg = gpu.config();
    if common.model != cfg.model {
        return Err(ApiError::model_not_found(&common.model));
    }
    let invalid =
        |(message, field): (String, &'static str)| ApiError::bad_request(message, Some(field));
    let n = common.choices().map_err(invalid)?;
    let max_tokens = common
        .requested_max_tokens()
        .unwrap_or(cfg.default_max_tokens);
    if max_tokens == 0 {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1",
            Some("max_tokens"),
        ));
    }
    let requested = u64::from(prompt.tokens) + u64::from(max_tokens);
    if requested > u64::from(cfg.max_model_len) {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {requested} tokens ({} in the prompt, {max_tokens} in the completion).",
                cfg.max_model_len, prompt.tokens
            ),
            Some("max_tokens"),
        ));
    }
    let logprobs = common.logprobs_request(kind).map_err(invalid)?;
    let stop = common.stop_sequences().map_err(invalid)?;
    let plan = Plan {
        seed: cfg.seed,
        prompt_key: &prompt.key,
        max_tokens,
        eos_probability: cfg.eos_probability,
        ignore_eos: common.ignore_eos,
        stop: &stop,
        logprobs,
        tool: tool.as_ref(),
    };
    let choices: Vec<Choice> = (0..n).map(|i| plan.choice(i)).collect();
    let prompt_tokens = prompt.tokens;
    // One sequence per choice, queued together (vLLM runs `n` as `n` sequences).
    let mut submissions = Vec::with_capacity(choices.len());
    for c in &choices {
        submissions.push(
            gpu.submit_prompt(prompt.token_ids.clone(), c.tokens(), c.stopped_early())
                .map_err(submit_error)?,
        );
    }
    let meta = ResponseMeta::new(kind, &cfg.model);
    let output_tokens = choices
        .iter()
        .map(Choice::tokens)
        .fold(0, u32::saturating_add);
    tracing::debug!(model = %cfg.model, request_id = %meta.id, prompt_tokens, output_tokens, n, stream = common.stream, "request admitted to the queue");
    let usage = Usage::new(prompt_tokens, output_tokens);
    if common.stream {
        let stream = token_stream(submissions, choices, meta, usage, common.include_usage());
        Ok(Sse::new(stream).into_response())
    } else {
        collect(submissions, choices, meta, usage).await
    }
}

/// A request the GPU refused to queue, in OpenAI's error shape.
fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Closed => ApiError::unavailable(e.to_string()),
        SubmitError::Engine(e @ EngineError::TooLong { .. }) => {
            ApiError::bad_request(e.to_string(), Some("max_tokens"))
        }
        SubmitError::Engine(e) => ApiError::bad_request(e.to_string(), None),
    }
}

/// `POST /v1/embeddings`: every input prefilled on the GPU at once, each answered when its
/// prefill (and the one step that completes it) is done.
async fn embeddings(State(gpu): State<Arc<Gpu>>, body: Bytes) -> Result<Response, ApiError> {
    let request: EmbeddingRequest = parse(&body)?;
    let cfg = gpu.config();
    if request.model != cfg.model {
        return Err(ApiError::model_not_found(&request.model));
    }
    let invalid =
        |(message, field): embedding::Invalid| ApiError::bad_request(message, Some(field));
    let inputs = request.inputs().map_err(invalid)?;
    let encoding = request.encoding().map_err(invalid)?;
    let dimensions = request.dimensions().map_err(invalid)?;
    if let Some(long) = inputs
        .iter()
        .find(|i| i.token_ids.len() as u64 > u64::from(cfg.max_model_len))
    {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens in the input for embedding generation.",
                cfg.max_model_len,
                long.token_ids.len()
            ),
            Some("input"),
        ));
    }
    let prompt_tokens: u32 = inputs
        .iter()
        .map(|i| u32::try_from(i.token_ids.len()).unwrap_or(u32::MAX))
        .fold(0, u32::saturating_add);
    // Queued together, so a batch of inputs is prefilled together as vLLM would.
    let mut submissions = Vec::with_capacity(inputs.len());
    for input in &inputs {
        submissions.push(
            gpu.submit_prompt(input.token_ids.clone(), 1, false)
                .map_err(submit_error)?,
        );
    }
    tracing::debug!(model = %cfg.model, inputs = inputs.len(), prompt_tokens, "embedding admitted to the queue");
    for mut submission in submissions {
        loop {
            match submission.next().await {
                Some(SeqEvent::Token { finished: true, .. }) => break,
                Some(_) => {}
                None => {
                    return Err(ApiError::unavailable(
                        "the simulated GPU shut down before the request finished",
                    ))
                }
            }
        }
    }
    let vectors: Vec<Vec<f32>> = inputs
        .iter()
        .map(|i| embedding::vector(cfg.seed, &i.key, dimensions))
        .collect();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let id = format!("embd-{}", uuid::Uuid::new_v4().simple());
    Ok(Json(embedding::response(
        &id,
        created,
        &cfg.model,
        &vectors,
        encoding,
        prompt_tokens,
    ))
    .into_response())
}

fn token_stream(
    submissions: Vec<Submission>,
    choices: Vec<Choice>,
    meta: ResponseMeta,
    usage: Usage,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    // Each choice's events tagged with its index, interleaved as the GPU produces them.
    let events =
        futures::stream::select_all(submissions.into_iter().enumerate().map(|(i, submission)| {
            futures::stream::unfold(submission, |mut s| async move {
                s.next().await.map(|event| (event, s))
            })
            .map(move |event| (i, event))
            .boxed()
        }));
    async_stream::stream! {
        let mut events = events;
        let mut offsets = vec![0usize; choices.len()];
        let mut open = choices.len();
        while let Some((i, SeqEvent::Token { index, finished })) = events.next().await {
            let choice = &choices[i];
            let token = index as usize;
            yield Ok(data(&meta.token_chunk(i as u32, choice, token, offsets[i], include_usage)));
            offsets[i] += choice.pieces.get(token).map_or(0, |p| p.chars().count());
            if finished {
                yield Ok(data(&meta.finish_chunk(i as u32, choice, include_usage)));
                open -= 1;
                if open == 0 {
                    if include_usage {
                        yield Ok(data(&meta.usage_chunk(usage)));
                    }
                    yield Ok(Event::default().data("[DONE]"));
                    return;
                }
            }
        }
        // The GPU shut down mid-generation: say so instead of a silent truncation.
        let error = ApiError::unavailable("the simulated GPU shut down before the request finished");
        yield Ok(data(&error.body()));
    }
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

async fn collect(
    submissions: Vec<Submission>,
    choices: Vec<Choice>,
    meta: ResponseMeta,
    usage: Usage,
) -> Result<Response, ApiError> {
    for mut submission in submissions {
        loop {
            match submission.next().await {
                Some(SeqEvent::Token { finished: true, .. }) => break,
                Some(_) => {}
                None => {
                    return Err(ApiError::unavailable(
                        "the simulated GPU shut down before the request finished",
                    ))
                }
            }
        }
    }
    Ok(Json(meta.response(&choices, usage)).into_response())
}

async fn models(State(gpu): State<Arc<Gpu>>) -> Json<Value> {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    Json(openai::model_list(
        &gpu.config().model,
        created,
        gpu.config().max_model_len,
    ))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn prometheus(State(gpu): State<Arc<Gpu>>) -> Response {
    let cfg = gpu.config();
    let text = gpu.with_metrics(|engine, requests| {
        metrics::render(&metrics::Snapshot {
            model: &cfg.model,
            speed: cfg.speed,
            prefix_caching: cfg.enable_prefix_caching,
            engine,
            requests,
        })
    });
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// vLLM's `POST /reset_prefix_cache` (a development endpoint there): drops every cached
/// prefix, and publishes `AllBlocksCleared`. Refused while sequences hold blocks, as vLLM
/// refuses it.
async fn reset_prefix_cache(State(gpu): State<Arc<Gpu>>) -> Result<StatusCode, ApiError> {
    if gpu.reset_prefix_cache() {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError {
            status: StatusCode::CONFLICT,
            message: "the prefix cache cannot be reset while requests hold KV blocks".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        })
    }
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such route".into(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}
