//! The engine's outputs: what it asks of the outside world, in the order it decided it.
//! The deciding loop ([`crate::deciding`]) performs them (outcomes go to the publisher,
//! acknowledgements to JetStream, snapshots to their writers); the policy lab and the
//! engine tests read them instead.

use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use bytes::Bytes;
use metronome_protocol::{Decision, ErrorCode, QueueSnapshot};
use metronome_scheduler::FairnessSnapshot;

use crate::queue::QueuedJob;

/// What the engine asks of the outside world; the deciding loop ([`crate::deciding`])
/// performs them in order.
pub enum Effect {
    /// Publish an outcome ([`crate::publish`]).
    Publish(Outcome),
    /// Acknowledge a message.
    Ack(Arc<Acker>),
    /// Extend the ack wait of waiting jobs' JOBS messages (`+WPI`).
    Progress(Vec<Arc<Acker>>),
    /// Persist the fair-share counters, changed since the last ones handed out
    /// ([`crate::fairness_store`]), so the next leader starts from them.
    PersistFairness(FairnessSnapshot),
    /// Publish the queue snapshots, changed since the last ones handed out
    /// ([`crate::queue_store`]).
    PublishQueues(Vec<QueueSnapshot>),
}

/// One committed outcome.
pub enum Outcome {
    Assign {
        job: QueuedJob,
        worker_id: String,
        epoch: u64,
        decision: Box<Decision>,
    },
    Reject {
        decision: Box<Decision>,
        error: ErrorCode,
        message: String,
        acker: Option<Arc<Acker>>,
    },
    /// A decision that settles a job without a new message to anyone else (a redelivered
    /// job a worker already holds); the JOBS message is acknowledged after it.
    DecisionOnly {
        decision: Box<Decision>,
        acker: Option<Arc<Acker>>,
    },
    /// Remove every Assignment still waiting on a dead worker's subject: its unreported
    /// jobs are being assigned elsewhere, so a worker that comes back must not run them too.
    PurgeWork { worker_id: String },
    /// Declare a silent worker dead: delete its key in the `workers` bucket on the condition
    /// that its last stored heartbeat is still `revision`. The watch then shows the delete
    /// and the engine settles the worker's jobs. A heartbeat stored meanwhile makes the delete
    /// fail (the worker stays); a key already gone (the bucket's max age) is reported to the
    /// engine as [`super::WorkerUpdate::Gone`], since no delete will ever appear on the watch.
    ExpireWorker { worker_id: String, revision: u64 },
    /// A message that could not be attributed to a job id.
    DeadLetter {
        body: Bytes,
        acker: Option<Arc<Acker>>,
    },
    /// Put a job to retry back on `jobs.retry` (its JOBS message was acknowledged when it
    /// was assigned): `Nats-Msg-Id` = [`metronome_protocol::names::retry_msg_id`], with its attempt and original
    /// place in headers. After the PubAck, `event` (the refusal that caused the retry) is
    /// acknowledged; if the publish fails the job goes back to the engine
    /// ([`super::Event::RequeueFailed`]) and waits in memory, as it would have before.
    Requeue {
        job: Box<QueuedJob>,
        event: Option<Arc<Acker>>,
        /// The job's refusals so far (worker, attempt), carried in a header.
        refused_by: Vec<(String, u32)>,
    },
    /// Relay a client's cancel to the worker holding the job, on its own
    /// `control.<worker_id>.cancel` (workers hear no `cancel.*.*`). `tenant` is the one the
    /// client's cancel named (the agent acts only if it is the job's).
    RelayCancel {
        worker_id: String,
        tenant: Option<String>,
        job_id: String,
    },
    /// Tell a worker declared dead to stop the jobs this leader settled without it (core
    /// NATS `control.<worker_id>.revoke`): a worker that was only silent must not keep
    /// running a job that now runs elsewhere or was failed to its client.
    Revoke {
        worker_id: String,
        revoke: metronome_protocol::Revoke,
    },
    /// A final error result only (a job lost with its worker).
    FinalError {
        job_id: String,
        worker_id: Option<String>,
        error: ErrorCode,
        message: String,
    },
}

/// The revocation of `jobs` (id, attempt when known) held by a worker declared dead.
pub fn revoke(
    worker_id: &str,
    epoch: u64,
    jobs: impl Iterator<Item = (String, Option<u32>)>,
    why: &str,
) -> Outcome {
    Outcome::Revoke {
        worker_id: worker_id.to_string(),
        revoke: metronome_protocol::Revoke {
            v: metronome_protocol::PROTOCOL_VERSION,
            epoch,
            jobs: jobs
                .map(|(job_id, attempt)| metronome_protocol::RevokedJob { job_id, attempt })
                .collect(),
            reason: format!("worker {worker_id} declared dead: {why}"),
        },
    }
}
