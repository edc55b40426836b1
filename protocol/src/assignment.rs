//! The Assignment: what the leader publishes on `work.<worker_id>`.

use serde::{Deserialize, Serialize};

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
}
