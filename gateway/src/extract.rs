//! The JSON body extractor whose rejection is an [`ApiError`], so a body that is too large,
//! unreadable or not JSON gets OpenAI's error shape like every other failure (axum's
//! stock `Json` would answer in plain text, and insist on a `Content-Type` that many
//! `curl` users do not send).
//!
//! Invariant: the size limit is axum's `DefaultBodyLimit` (set from the configuration in
//! [`crate::app`]); this extractor only turns its rejection into a 413 in OpenAI's shape.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::AppState;

/// A JSON request body, rejected with an OpenAI-shaped error.
#[derive(Debug, Clone)]
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(state.config.body_limit_bytes)
            } else {
                ApiError::invalid_request(format!(
                    "cannot read the request body: {}",
                    rejection.body_text()
                ))
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(OpenAiJson)
            .map_err(ApiError::malformed_json)
    }
}
