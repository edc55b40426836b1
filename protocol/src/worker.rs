//! Worker status: the heartbeat a worker-agent publishes every second, kept as the latest
//! value in the `workers` KV bucket. It carries every signal the dispatcher scores on.

use serde::{Deserialize, Serialize};

/// KV-cache occupancy scraped from the model server's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvUsage {
    /// Fraction in use, 0..=1 (`vllm:kv_cache_usage_perc`, `sglang:token_usage`).
    pub used_frac: f64,
    /// Capacity in tokens when the server tells it (vLLM: `num_gpu_blocks * block_size`).
    #[serde(default)]
    pub capacity_tokens: Option<u64>,
}

/// GPU figures from NVML.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuStats {
    /// Utilisation, 0..=1.
    pub util_frac: f64,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
}

/// How the streams a worker decodes now are doing, measured by its agent from the tokens it
/// relays: live evidence of the batch the worker runs well, before any of those jobs has
/// completed and taught its performance fit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LiveDecode {
    /// Streams decoding now (past their first token, not finished).
    pub streams: u32,
    /// Of them, those that have written enough tokens since their first to be measured.
    pub measured: u32,
    /// The slowest measured stream's rate: its tokens after the first over the time since
    /// it, tokens per second (0 when none is measured).
    pub slowest_tok_s: f64,
}

/// Latest state of one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub v: u32,
    /// Subject-safe id, e.g. `node1-gpu0`.
    pub worker_id: String,
    /// Model the worker's server has loaded.
    pub model: String,
    /// Host name, for operators.
    #[serde(default)]
    pub node: Option<String>,
    /// GPU index on the host, when known.
    #[serde(default)]
    pub gpu_index: Option<u32>,
    /// The model server answers its health and metrics endpoints.
    pub healthy: bool,
    /// Draining: finishes in-flight work, takes nothing new.
    pub draining: bool,
    /// Most concurrent requests the worker accepts.
    pub max_concurrency: u32,
    /// Requests running in the model server (its own count when it exports one).
    pub active: u32,
    /// Requests waiting in the model server.
    pub queued: u32,
    /// Job ids the agent holds (assigned, started or streaming). A new leader adopts them;
    /// reservations for jobs not listed here expire.
    #[serde(default)]
    pub in_flight: Vec<String>,
    /// `None` when the server exports no KV metric.
    #[serde(default)]
    pub kv: Option<KvUsage>,
    /// `None` when NVML is not available on the host.
    #[serde(default)]
    pub gpu: Option<GpuStats>,
    /// Prompt tokens of held jobs that have not produced their first token yet: prefill
    /// work queued ahead of the next admission.
    #[serde(default)]
    pub prefill_pending_tokens: u64,
    /// The worker's fitted performance model; `None` from an agent that fits none.
    #[serde(default)]
    pub perf: Option<crate::PerfCoefficients>,
    /// The streams decoding now and the slowest one's rate ([`LiveDecode`]); `None` from
    /// an agent that predates it or while nothing decodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoding: Option<LiveDecode>,
    /// Highest leader epoch the agent has accepted work from (0: none yet, or an older
    /// agent). A new leader's epoch starts above every worker's, so an agent never refuses
    /// it as stale, even after the `leader` bucket was rebuilt and its revisions restarted.
    #[serde(default)]
    pub max_epoch: u64,
    /// Monotonic per-agent counter, to ignore heartbeats that arrive out of order.
    pub seq: u64,
    /// When the heartbeat was sent (Unix ms).
    pub sent_ms: u64,
}
