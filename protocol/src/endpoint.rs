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
    /// `POST /v1/embeddings`: a prefill and no decode; the job's `max_tokens` is 0.
    Embedding,
}

impl Endpoint {
    /// Path of the endpoint on an OpenAI-compatible server.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
            Endpoint::Embedding => "/v1/embeddings",
        }
    }

    /// Whether the endpoint generates tokens (and streams them). An embedding is answered
    /// in one piece once its prompt is prefilled: it has no output tokens, no decode rate
    /// and no stream.
    pub fn generates(self) -> bool {
        !matches!(self, Endpoint::Embedding)
    }

    /// The request field holding the prompt: `messages`, `prompt` or `input`.
    pub fn prompt_field(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
            Endpoint::Embedding => "input",
        }
    }
}
