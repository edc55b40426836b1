//! What goes into the job lifecycle: its settings and the inputs of its events that are
//! more than a job id and the time.

use std::collections::HashSet;
use std::time::Duration;

use metronome_protocol::ErrorCode;

#[cfg(doc)]
use super::JobMachine;

/// What the machine is built with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub worker_id: String,
    pub max_concurrency: u32,
    /// No heartbeat stored for longer than this: fenced.
    pub fence_after: Duration,
    /// Jobs the last stored heartbeat of this worker's previous run listed: that run may
    /// have started them and streamed part of their output.
    pub reported_before_restart: HashSet<String>,
}

/// A delivered assignment, as far as its lifecycle is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assigned {
    pub job_id: String,
    pub attempt: u32,
    pub epoch: u64,
    /// The worker the assignment names.
    pub worker_id: String,
    pub tenant: Option<String>,
    /// The job's prompt estimate: prefill ahead of the jobs placed here after it, from the
    /// moment the agent takes it, though the model server sees it only once started.
    pub prompt_tokens: u32,
    /// Of those, the tokens the deciding leader counted this worker's prefix cache as
    /// holding (`Assignment::cached_prefix`; 0 when it named none): the model server skips
    /// their prefill.
    pub cached_tokens: u32,
    /// How many times JetStream delivered the message (1: the first delivery).
    pub delivered: u64,
}

/// What the leader lease says of an epoch above every epoch seen
/// ([`JobMachine::needs_lease`]): one message must not raise the bar for the real leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lease {
    /// Not read (the epoch is not new).
    NotRead,
    /// The lease vouches for it.
    Vouches,
    /// It does not, or could not be read: why.
    Refuses(String),
}

/// How the model-server call of a running job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The stream ended normally.
    Done,
    /// The call failed (server error, time-out, a body it cannot send).
    Failed(ErrorCode, String),
    /// It was stopped by a [`Effect::Stop`]; the machine knows why.
    Stopped,
}
