//! The Assignment: what the leader publishes on `work.<worker_id>`.

use serde::{Deserialize, Serialize};

use crate::decision::CachedPrefix;
use crate::job::Job;

/// One dispatch attempt of a job to one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub v: u32,
    /// The job, unchanged.
    pub job: Job,
    /// Worker chosen for it.
    pub worker_id: String,
    /// Epoch of the leader that decided. A worker refuses an epoch lower than the highest
    /// it has seen: that assignment came from a deposed leader.
    pub epoch: u64,
    /// Dispatch attempt, from 1. A rescue after a worker death makes a new attempt.
    pub attempt: u32,
    /// When the decision was made (Unix ms).
    pub assigned_ms: u64,
    /// What the deciding leader counted this worker as holding of the job's prompt (the
    /// decision's figure for it: from its model server's KV events, or the leader's own
    /// placements). The agent charges the job's prefill as the rest when it fits the
    /// worker's performance model, so a worker serving cached prompts is not learnt as a
    /// faster prefiller than it is. Absent for a job without a prefix fingerprint, and in
    /// assignments of older leaders (then the whole prompt counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_prefix: Option<CachedPrefix>,
}
