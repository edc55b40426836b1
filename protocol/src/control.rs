//! Operator control of one worker-agent over core NATS request/reply:
//! `control.<worker_id>.drain` stops the agent taking new work (it finishes what it runs),
//! `control.<worker_id>.undrain` lets it take work again. The request body is empty; the
//! agent answers every request with its [`ControlReply`], so polling with either request
//! shows when a drained worker's running jobs have finished.
//!
//! `control.<worker_id>.revoke` is the leader's, sent (without a reply) when it declares
//! the worker dead: the body lists the jobs it has settled without the worker (assigned
//! again elsewhere, or failed to their clients as lost), which a worker that was only
//! silent must stop, without publishing a result or an event, so none runs twice.
//!
//! `control.<worker_id>.cancel` is the leader's too: a client's cancel of a job the worker
//! holds ([`RelayedCancel`], no reply). Workers do not hear clients' `cancel.*.*`.

use serde::{Deserialize, Serialize};

/// The agent's answer to a control request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlReply {
    pub v: u32,
    pub worker_id: String,
    /// Draining after this request: no new work is taken; the heartbeat says so at once.
    pub draining: bool,
    /// Jobs the agent still holds (assigned, started or streaming).
    pub running: u32,
    /// Their ids.
    #[serde(default)]
    pub in_flight: Vec<String>,
    /// Set when the request was not understood (an unknown action) or not applied (the
    /// agent is shutting down and cannot undrain).
    #[serde(default)]
    pub error: Option<String>,
}

/// A client's `cancel.<tenant>.<job_id>`, relayed by the leader to the worker holding the
/// job on `control.<worker_id>.cancel` (no reply is expected).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayedCancel {
    pub v: u32,
    /// The tenant token the client's cancel named (`_anon`: no tenant); the agent acts only
    /// when it is the job's.
    pub tenant: String,
    pub job_id: String,
}

/// The leader revokes jobs it has settled without their worker (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revoke {
    pub v: u32,
    /// The leader's epoch when it revoked them.
    pub epoch: u64,
    pub jobs: Vec<RevokedJob>,
    /// Why, for the agent's log.
    #[serde(default)]
    pub reason: String,
}

/// One revoked job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedJob {
    pub job_id: String,
    /// The attempt revoked; a later attempt of the same job (assigned again to the same
    /// worker once it is back) is not. `None` when the leader never knew the attempt (a
    /// job adopted from a heartbeat): every attempt the worker holds.
    #[serde(default)]
    pub attempt: Option<u32>,
}

impl RevokedJob {
    /// Whether this revocation covers attempt `attempt` of job `job_id`.
    pub fn covers(&self, job_id: &str, attempt: u32) -> bool {
        self.job_id == job_id && self.attempt.is_none_or(|a| attempt <= a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revocation_covers_its_attempt_and_earlier_ones_only() {
        let r = RevokedJob {
            job_id: "j".into(),
            attempt: Some(2),
        };
        assert!(r.covers("j", 1) && r.covers("j", 2));
        assert!(
            !r.covers("j", 3),
            "a later attempt was assigned after the revocation"
        );
        assert!(!r.covers("k", 1));
        let any = RevokedJob {
            job_id: "j".into(),
            attempt: None,
        };
        assert!(any.covers("j", 7));
    }
}
