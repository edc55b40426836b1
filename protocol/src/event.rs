//! Completion events on `events.done.<worker_id>`: they release reservations and feed
//! per-model output-length estimates.

use serde::{Deserialize, Serialize};

use crate::Job;

/// How a job ended on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompletionOutcome {
    /// Finished and its final result was published.
    Done,
    /// Failed after starting; a final error result was published.
    Failed,
    /// Cancelled by its client.
    Cancelled,
    /// Refused without running (stale epoch, draining): the dispatcher may assign it again.
    Refused,
}

/// One job finished (or refused) on one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionEvent {
    pub v: u32,
    pub job_id: String,
    pub worker_id: String,
    pub model: String,
    pub epoch: u64,
    pub attempt: u32,
    pub outcome: CompletionOutcome,
    /// Whether any token reached the client (a rescue must not duplicate output).
    pub streamed: bool,
    #[serde(default)]
    pub error: Option<String>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Measured time to first token, when a token came.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Measured mean time per output token after the first.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// End-to-end time on the worker.
    pub e2e_ms: f64,
    pub finished_ms: u64,
    /// A refusal's job, as its Assignment carried it: a leader that does not hold the
    /// body (an earlier leader assigned it) assigns it again from this copy instead of
    /// failing it. Believed only when the decision on record assigned this attempt of this
    /// job to this worker, for the same tenant and model; absent on every other outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<Box<Job>>,
}
