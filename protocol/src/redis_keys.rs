//! Redis key names and hash fields of the per-worker EWMAs written by worker-agents and
//! read by the dispatcher.

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "metronome";

/// `<prefix>:ewma:<worker_id>`: hash of [`EWMA_FIELDS`].
pub fn ewma_key(prefix: &str, worker_id: &str) -> String {
    format!("{prefix}:ewma:{worker_id}")
}

/// `<prefix>:ewma:*`: scan pattern for every worker's EWMA hash.
pub fn ewma_pattern(prefix: &str) -> String {
    format!("{prefix}:ewma:*")
}

/// `<prefix>:outlen:<model>`: hash with the output-length EWMA of one model
/// (fields `tokens`, `samples`, `updated_ms`), used to predict a job's cost.
pub fn output_len_key(prefix: &str, model: &str) -> String {
    format!("{prefix}:outlen:{model}")
}

/// `<prefix>:perf:<worker_id>`: JSON of the worker's fitted performance model (the
/// recursive-least-squares state), so a restarted agent resumes where it stopped.
pub fn perf_key(prefix: &str, worker_id: &str) -> String {
    format!("{prefix}:perf:{worker_id}")
}

pub const FIELD_TTFT_MS: &str = "ttft_ms";
pub const FIELD_TPOT_MS: &str = "tpot_ms";
pub const FIELD_TOK_S: &str = "tok_s";
pub const FIELD_E2E_MS: &str = "e2e_ms";
pub const FIELD_SAMPLES: &str = "samples";
pub const FIELD_UPDATED_MS: &str = "updated_ms";
pub const FIELD_ALPHA: &str = "alpha";
pub const FIELD_TOKENS: &str = "tokens";

/// The EWMA fields, in the order the update script takes them.
pub const EWMA_FIELDS: [&str; 4] = [FIELD_TTFT_MS, FIELD_TPOT_MS, FIELD_TOK_S, FIELD_E2E_MS];
