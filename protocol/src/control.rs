//! Operator control of one worker-agent over core NATS request/reply:
//! `control.<worker_id>.drain` stops the agent taking new work (it finishes what it runs),
//! `control.<worker_id>.undrain` lets it take work again. The request body is empty; the
//! agent answers every request with its [`ControlReply`], so polling with either request
//! shows when a drained worker's running jobs have finished.

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
