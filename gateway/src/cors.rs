//! CORS for the OpenAI endpoints, so a browser page of an allowed origin can call them
//! (`cors_allowed_origins`). Off unless origins are configured. Preflights are answered for
//! the methods and request headers the endpoints read, and the response headers a client
//! needs to follow a request up (job id, worker, trace id, `Retry-After`) are exposed.
//! Credentials mode stays off: the API key travels in `Authorization`, which a page sends
//! explicitly, never as a cookie.

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::headers::{
    HEADER_DEADLINE_MS, HEADER_JOB_ID, HEADER_PRIORITY, HEADER_SLO_MIN_TOK_S, HEADER_SLO_TTFT_MS,
    HEADER_TRACE_ID, HEADER_WORKER,
};

/// How long a browser may cache a preflight's answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// The CORS layer for `origins` (validated by the configuration); `None` when empty.
pub fn layer(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow_origin = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    let name = HeaderName::from_static;
    Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                name(metronome_protocol::trace::TRACEPARENT_HEADER),
                name(HEADER_DEADLINE_MS),
                name(HEADER_PRIORITY),
                name(HEADER_SLO_TTFT_MS),
                name(HEADER_SLO_MIN_TOK_S),
            ])
            .expose_headers([
                name(HEADER_JOB_ID),
                name(HEADER_WORKER),
                name(HEADER_TRACE_ID),
                header::RETRY_AFTER,
            ])
            .max_age(PREFLIGHT_MAX_AGE),
    )
}
