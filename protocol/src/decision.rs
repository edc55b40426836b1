//! The Decision: one audit record per job outcome on `decisions.<job_id>`, with every
//! number that led to it, so "why was this request slow?" has an answer.

use serde::{Deserialize, Serialize};

/// What happened to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Sent to `worker_id`.
    Assigned,
    /// Refused: malformed, unknown model, queue full, cancelled.
    Rejected,
    /// Waited past its deadline without an eligible worker.
    Expired,
}

/// The seven score terms. Lower contributions are better for every term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TermName {
    /// Requests running on the worker, including reservations.
    ActiveRequests,
    /// Requests waiting inside the model server.
    QueueDepth,
    /// Time-to-first-token EWMA.
    LatencyEwma,
    /// Predicted service time of this job on this worker.
    JobCost,
    /// Per-request tokens/s EWMA (inverted: faster is lower).
    ThroughputEwma,
    /// KV-cache occupancy after admitting this job.
    KvPressure,
    /// GPU utilisation.
    GpuUtilisation,
}

impl TermName {
    /// Every term, in the order decisions list them.
    pub const ALL: [TermName; 7] = [
        TermName::ActiveRequests,
        TermName::QueueDepth,
        TermName::LatencyEwma,
        TermName::JobCost,
        TermName::ThroughputEwma,
        TermName::KvPressure,
        TermName::GpuUtilisation,
    ];

    /// snake_case name, as in JSON and in configuration keys.
    pub fn as_str(self) -> &'static str {
        match self {
            TermName::ActiveRequests => "active_requests",
            TermName::QueueDepth => "queue_depth",
            TermName::LatencyEwma => "latency_ewma",
            TermName::JobCost => "job_cost",
            TermName::ThroughputEwma => "throughput_ewma",
            TermName::KvPressure => "kv_pressure",
            TermName::GpuUtilisation => "gpu_utilisation",
        }
    }
}

/// One score term of one candidate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TermScore {
    pub term: TermName,
    /// The measured value in its own unit (`None` when the signal is unavailable).
    pub raw: Option<f64>,
    /// The value mapped to [0, 1] across the candidates of this decision.
    pub normalised: f64,
    /// Configured weight.
    pub weight: f64,
    /// `normalised * weight`: this term's share of the total.
    pub contribution: f64,
    /// False when the worker did not report the signal (no NVML, no metrics, no samples
    /// yet). An unavailable term contributes a neutral value and says so.
    pub available: bool,
}

/// One eligible worker and its score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    pub worker_id: String,
    /// Sum of contributions. Lowest wins.
    pub total: f64,
    /// All seven terms, in [`TermName::ALL`] order.
    pub terms: Vec<TermScore>,
    /// What the dispatcher predicted for the job on this worker.
    #[serde(default)]
    pub prediction: Option<crate::Prediction>,
}

/// Why a worker was not eligible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionCode {
    Unhealthy,
    StaleHeartbeat,
    WrongModel,
    Draining,
    AtConcurrencyCap,
    InsufficientKv,
    /// The job's own predicted decode rate, or that of a job already running there, would
    /// fall below its SLO floor.
    BelowSloFloor,
    /// The job's predicted time to first token would exceed what is left of its TTFT target.
    TtftOverBudget,
}

impl RejectionCode {
    /// The code as it is serialised (snake case), for metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionCode::Unhealthy => "unhealthy",
            RejectionCode::StaleHeartbeat => "stale_heartbeat",
            RejectionCode::WrongModel => "wrong_model",
            RejectionCode::Draining => "draining",
            RejectionCode::AtConcurrencyCap => "at_concurrency_cap",
            RejectionCode::InsufficientKv => "insufficient_kv",
            RejectionCode::BelowSloFloor => "below_slo_floor",
            RejectionCode::TtftOverBudget => "ttft_over_budget",
        }
    }
}

/// A worker that was filtered out, with the reason in words and numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejection {
    pub worker_id: String,
    pub code: RejectionCode,
    pub reason: String,
    /// The prediction that decided an SLO rejection.
    #[serde(default)]
    pub prediction: Option<crate::Prediction>,
}

/// The job's size as the dispatcher saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobCostEstimate {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Output tokens expected: the model's output length given `max_tokens`, learned from
    /// its completed jobs (the output-length EWMA until one completed), at most max_tokens.
    pub predicted_output_tokens: f64,
    /// KV tokens reserved for the job.
    pub kv_tokens: u64,
}

/// One audit record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub v: u32,
    pub job_id: String,
    /// `None` only when the message was too malformed to name one.
    pub model: Option<String>,
    pub outcome: Outcome,
    /// Dispatch attempt this record belongs to.
    pub attempt: u32,
    /// Why the job was rejected or expired, or a note on an assignment (e.g. a rescue).
    #[serde(default)]
    pub reason: Option<String>,
    /// Machine-readable form of `reason` (`queue_full`, `unknown_model`, `malformed_job`…).
    #[serde(default)]
    pub reason_code: Option<String>,
    /// The winner, when assigned.
    #[serde(default)]
    pub worker_id: Option<String>,
    #[serde(default)]
    pub cost: Option<JobCostEstimate>,
    /// Every eligible worker with its terms, best first.
    #[serde(default)]
    pub candidates: Vec<CandidateScore>,
    /// Every ineligible worker with its reason.
    #[serde(default)]
    pub rejected: Vec<Rejection>,
    /// The SLO the job was held to (its model's, tightened by the job's own request).
    #[serde(default)]
    pub slo: Option<crate::Slo>,
    /// For a job answered at once because its deadline could not be met: when capacity is
    /// predicted to be free for it (the gateway's `Retry-After`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Scheduling policy that decided (`metronome`, `least_connections`…).
    pub policy: String,
    /// Time the job spent in the admission queue.
    pub queue_wait_ms: u64,
    /// Time to evaluate and commit this decision, in microseconds.
    pub decision_latency_us: u64,
    /// Leader epoch.
    pub epoch: u64,
    /// Which dispatcher instance decided.
    pub dispatcher_id: String,
    pub decided_ms: u64,
    /// The job's tenant (`None` for a job submitted without one).
    #[serde(default)]
    pub tenant: Option<String>,
    /// The job's priority class.
    #[serde(default)]
    pub priority: Option<crate::Priority>,
    /// The tenant's fair-share service counter for this model when the decision was made
    /// (weighted tokens, after this job's charge when it was assigned): the tenant with the
    /// lowest counter among those waiting is served next.
    #[serde(default)]
    pub fair_counter: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::RejectionCode;

    #[test]
    fn a_rejection_code_label_is_its_serialised_name() {
        for code in [
            RejectionCode::Unhealthy,
            RejectionCode::StaleHeartbeat,
            RejectionCode::WrongModel,
            RejectionCode::Draining,
            RejectionCode::AtConcurrencyCap,
            RejectionCode::InsufficientKv,
            RejectionCode::BelowSloFloor,
            RejectionCode::TtftOverBudget,
        ] {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json.trim_matches('"'), code.as_str());
        }
    }
}
