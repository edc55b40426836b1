//! Results: streamed chunks on `results.<job_id>.chunk` (core NATS) and the one final
//! result on `results.<job_id>.final` (kept in the RESULTS stream).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One streamed delta, as the model server produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultChunk {
    pub v: u32,
    pub job_id: String,
    /// 0, 1, 2… per job: a client can detect a gap.
    pub seq: u64,
    pub worker_id: String,
    /// The dispatch attempt that produced it: chunks of two runs of one job (a job run
    /// again on the same worker) are told apart by it. `None` from older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// The OpenAI streaming chunk object (`chat.completion.chunk` or `text_completion`).
    pub data: Value,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

/// Machine-readable failure classes; the gateway maps each to an HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The job message was invalid (HTTP 400).
    InvalidJob,
    /// No worker serves the model (HTTP 404).
    UnknownModel,
    /// The model's admission queue is full (HTTP 429).
    QueueFull,
    /// No capacity before the deadline (HTTP 503 with Retry-After).
    DeadlineExceeded,
    /// Cancelled by the client.
    Cancelled,
    /// The worker or model server failed (HTTP 502).
    WorkerFailed,
    /// The worker died after streaming tokens; the job is not retried to avoid
    /// duplicating output (HTTP 502).
    WorkerLost,
}

/// Error part of a final result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultError {
    pub code: ErrorCode,
    pub message: String,
}

/// The final result of a job: either the full OpenAI response or an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalResult {
    pub v: u32,
    pub job_id: String,
    /// Worker that ran it; `None` when the dispatcher rejected it.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// The assembled non-streaming OpenAI response (`chat.completion` / `text_completion`).
    #[serde(default)]
    pub response: Option<Value>,
    #[serde(default)]
    pub error: Option<ResultError>,
    #[serde(default)]
    pub usage: Usage,
    /// Number of chunks published before this final result.
    #[serde(default)]
    pub chunks: u64,
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    #[serde(default)]
    pub e2e_ms: Option<f64>,
}
