//! Which OpenAI endpoint of the model server runs a job: the one fact about the request
//! that the job, the prompt's prefix fingerprint and the worker all need.

use serde::{Deserialize, Serialize};

/// Which OpenAI endpoint of the model server runs the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completion,
}

impl Endpoint {
    /// Path of the endpoint on an OpenAI-compatible server.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        }
    }
}
