//! Errors: [`ApiError`], the one HTTP error type, rendered as OpenAI's error body
//! `{"error": {"message", "type", "param", "code"}}`, and [`GatewayError`], why the
//! gateway could not start or serve.
//!
//! Invariant: every failed HTTP request, whichever layer refused it (body extractor,
//! validation, registry, NATS, the dispatcher's or the worker's verdict), leaves through
//! `ApiError::into_response`, so clients only ever see one error shape.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use metronome_protocol::{ErrorCode, ResultError};
use serde_json::{json, Value};

/// An HTTP error in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, …).
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Machine-readable code (`model_not_found`, `queue_full`, …).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_secs: None,
        }
    }

    pub(crate) fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    /// 400: the body is not JSON.
    pub fn malformed_json(detail: impl std::fmt::Display) -> Self {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("the request body is not valid JSON: {detail}"),
        )
        .with_code("malformed_json")
    }

    /// 400: the request as a whole is wrong (e.g. not a JSON object).
    pub fn invalid_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            .with_code("invalid_request")
    }

    /// 400: a field is missing or has the wrong type or range.
    pub fn invalid_field(param: &str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            .with_param(param)
            .with_code("invalid_value")
    }

    /// 404: no live worker serves the model.
    pub fn unknown_model(model: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{model}` does not exist or no worker serves it now; GET /v1/models lists the served models"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 401: no API key, a malformed `Authorization` header, or a key that is unknown or
    /// revoked. The message never repeats the key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .with_code("invalid_api_key")
    }

    /// 403: a valid key that does not open the operator console.
    pub fn not_operator() -> Self {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "this API key is not an operator key: the console needs a key created with `keys create --operator`",
        )
        .with_code("operator_required")
    }

    /// 404 for something the request names that does not exist (a job id in the console).
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
            .with_code("not_found")
    }

    /// 403: the key's tenant may not use this model.
    pub fn model_not_allowed(model: &str) -> Self {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("this API key may not use the model `{model}`; GET /v1/models lists the models it may use"),
        )
        .with_param("model")
        .with_code("model_not_allowed")
    }

    /// 403: the request asked for a priority class above what its key allows.
    pub fn priority_not_allowed(
        asked: metronome_protocol::Priority,
        allowed: metronome_protocol::Priority,
    ) -> Self {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("this API key may not ask for priority `{asked}`; the highest it may use is `{allowed}`"),
        )
        .with_param(crate::headers::HEADER_PRIORITY)
        .with_code("priority_not_allowed")
    }

    /// 429: over the tenant's requests per second or tokens per minute. `Retry-After` is
    /// when enough budget is back, absent when the request can never fit.
    pub fn rate_limited(refusal: &crate::limits::Refusal) -> Self {
        use crate::limits::Refusal;
        let message = match refusal {
            Refusal::Requests { .. } => {
                "rate limit reached for requests per second; retry after the time in Retry-After".to_string()
            }
            Refusal::Tokens { needed, .. } => format!(
                "rate limit reached for tokens per minute (this request needs {needed} tokens: prompt estimate + max_tokens); retry after the time in Retry-After"
            ),
            Refusal::TooLarge {
                needed,
                tokens_per_minute,
            } => format!(
                "this request needs {needed} tokens (prompt estimate + max_tokens), more than the limit of {tokens_per_minute} tokens per minute; lower max_tokens"
            ),
        };
        let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .with_code("rate_limit_exceeded");
        if let Refusal::TooLarge { .. } = refusal {
            e = e.with_param("max_tokens");
        }
        e.retry_after_secs = refusal.retry_after_secs();
        e
    }

    /// 404 for paths that do not exist.
    pub fn no_route(path: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route for {path}"),
        )
        .with_code("unknown_url")
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this path",
        )
        .with_code("method_not_allowed")
    }

    /// 413: the body is over the configured limit.
    pub fn payload_too_large(limit_bytes: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than the limit of {limit_bytes} bytes"),
        )
        .with_code("payload_too_large")
    }

    /// 413: the job is larger than NATS accepts in one message.
    pub fn job_too_large(max_payload_bytes: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request is larger than the job queue accepts ({max_payload_bytes} bytes per message)"),
        )
        .with_code("payload_too_large")
    }

    /// 429: the leader's admission queue of the model is full for this tenant, as its
    /// latest snapshot says (`crate::queue_view`); nothing was queued.
    pub fn queue_known_full(model: &str, waiting: u32, retry_after_secs: u64) -> Self {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the admission queue of model {model:?} is full ({waiting} jobs waiting); retry after the time in Retry-After"),
        )
        .with_code("queue_full")
        .with_retry_after(retry_after_secs)
    }

    /// 503: the JOBS stream is at its limits and refused the job; nothing was queued.
    pub fn jobs_stream_full(detail: impl std::fmt::Display, retry_after_secs: u64) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("the job queue is full ({detail}); retry after the time in Retry-After"),
        )
        .with_code("jobs_stream_full")
        .with_retry_after(retry_after_secs)
    }

    /// 503: NATS is not reachable, or did not acknowledge the job.
    pub fn nats_unavailable(detail: impl std::fmt::Display, retry_after_secs: u64) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("the job queue is unavailable: {detail}"),
        )
        .with_code("nats_unavailable")
        .with_retry_after(retry_after_secs)
    }

    /// 504: no final result within the deadline plus the generation allowance.
    pub fn gateway_timeout(waited_ms: u64) -> Self {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!("no result for the job after {waited_ms} ms"),
        )
        .with_code("job_timeout")
    }

    /// 502: the result stream was inconsistent (e.g. a final result with no response).
    pub fn bad_upstream(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", message).with_code("worker_failed")
    }

    /// 500: a bug in the gateway (e.g. a response that cannot be encoded).
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with_code("internal_error")
    }

    /// The HTTP error for a failed job, from the error class of its final result (or of
    /// the dispatcher's decision).
    pub fn from_result_error(error: &ResultError, retry_after_secs: u64) -> Self {
        let message = error.message.clone();
        match error.code {
            ErrorCode::InvalidJob => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
                    .with_code("invalid_job")
            }
            ErrorCode::UnknownModel => {
                ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
                    .with_param("model")
                    .with_code("model_not_found")
            }
            ErrorCode::QueueFull => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code("queue_full")
                    .with_retry_after(retry_after_secs)
            }
            ErrorCode::DeadlineExceeded => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
            .with_code("no_capacity")
            .with_retry_after(retry_after_secs),
            ErrorCode::Cancelled => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
            .with_code("cancelled"),
            ErrorCode::WorkerFailed => {
                ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", message)
                    .with_code("worker_failed")
            }
            ErrorCode::WorkerLost => {
                ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", message)
                    .with_code("worker_lost")
            }
        }
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"metronome\""),
            );
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of an oversized body is never read, so the server drops the
            // connection after answering; saying so keeps pooled clients from reusing it.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// Why the gateway could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid configuration: {0:?}")]
    Config(Vec<crate::config::FieldError>),
    #[error("connecting to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error("NATS credentials: {0}")]
    NatsAuth(metronome_runtime::nats::NatsAuthError),
    #[error("creating the JetStream streams and buckets: {0}")]
    Setup(#[from] metronome_protocol::setup::SetupError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsConfigError),
    #[error("serving HTTP: {0}")]
    Serve(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let body = ApiError::unknown_model("m").body();
        let e = &body["error"];
        assert!(e["message"].as_str().unwrap().contains("`m`"));
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], "model");
        assert_eq!(e["code"], "model_not_found");
        let body = ApiError::malformed_json("eof").body();
        assert!(body["error"]["param"].is_null());
    }

    #[test]
    fn result_errors_map_to_their_statuses() {
        let cases = [
            (ErrorCode::InvalidJob, 400),
            (ErrorCode::UnknownModel, 404),
            (ErrorCode::QueueFull, 429),
            (ErrorCode::DeadlineExceeded, 503),
            (ErrorCode::WorkerFailed, 502),
            (ErrorCode::WorkerLost, 502),
        ];
        for (code, status) in cases {
            let e = ApiError::from_result_error(
                &ResultError {
                    code,
                    message: "x".into(),
                },
                3,
            );
            assert_eq!(e.status.as_u16(), status, "{code:?}");
        }
    }

    #[test]
    fn retry_after_is_a_header() {
        let r = ApiError::nats_unavailable("down", 7).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "7");
    }
}
