//! The engine's inputs: what reaches the deciding loop from the tasks that feed it
//! (intake, registry watch, EWMA refresher, completions, cache reports, publisher
//! rollbacks). Those tasks
//! depend on the engine for these types; the engine depends on none of them.

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use metronome_protocol::{Assignment, CacheUpdate, CompletionEvent, Job, WorkerStatus};
use metronome_scheduler::EwmaSnapshot;

use crate::queue::QueuedJob;

/// A job read from JOBS.
pub struct Incoming {
    pub job: Arc<Job>,
    /// The JOBS message, acknowledged once the job is assigned or rejected; `None` where
    /// no JetStream message stands behind the job (the policy lab, engine tests).
    pub acker: Option<Arc<Acker>>,
    /// Its place in its model's queue: the JOBS sequence of the client's submission (a
    /// retry put back on `jobs.submit` carries the original one).
    pub seq: u64,
    pub received_ms: u64,
    /// The attempt it will be assigned as: 1, or a retry's `Metronome-Attempt`.
    pub attempt: u32,
    /// Workers that refused it on earlier attempts, and which attempt (a retry's
    /// `Metronome-Refused-By`; empty for a client's submission).
    pub refused_by: Vec<(String, u32)>,
}

/// Everything that reaches the deciding loop.
pub enum Event {
    Job(Box<Incoming>),
    Worker(WorkerUpdate),
    Redis(RedisSnapshot),
    /// A completion event; a refusal carries its EVENTS acknowledgement, given once the job
    /// is back in JOBS (so the refusal is seen again if this leader dies first).
    Completion {
        event: Box<CompletionEvent>,
        acker: Option<Arc<Acker>>,
    },
    /// A retry could not be put back on `jobs.submit`: keep it in memory instead.
    RequeueFailed {
        job: Box<QueuedJob>,
    },
    /// `cancel.<tenant>.<job_id>`: applied only to a job of that tenant.
    Cancel {
        tenant: Option<String>,
        job_id: String,
    },
    /// The Assignment could not be published: roll back and requeue.
    PublishFailed {
        job: Box<QueuedJob>,
        worker_id: String,
    },
    /// Every JOBS message stored before this term's consumer was created has been read
    /// (see [`crate::engine::Engine::read_backlog_first`]).
    BacklogRead,
    /// A dead worker's purge removed these Assignments from its WORK subject (stored
    /// there before the purge, not yet acknowledged by the worker).
    PurgedAssignments {
        worker_id: String,
        assignments: Vec<Assignment>,
    },
    /// JetStream said an earlier leader already sent this attempt.
    AlreadyAssigned {
        job_id: String,
        worker_id: String,
    },
    /// A worker's prefix cache, as its model server's KV events say (a delta or a
    /// snapshot from `kvcache.<worker_id>.*`, its subject checked against its body).
    Cache(Box<CacheUpdate>),
}

/// One change of the `workers` bucket.
#[derive(Debug, Clone)]
pub enum WorkerUpdate {
    /// A heartbeat, with when the dispatcher saw it (Unix ms) and its revision in the
    /// bucket (the leader declares a worker dead only if no later heartbeat was stored).
    Put {
        status: Box<WorkerStatus>,
        seen_ms: u64,
        revision: u64,
        /// Ids of its `in_flight` for which [`crate::registry::Vouching`] found no decision on record that
        /// assigns the job to this worker: the engine adopts none of them (it keeps those it
        /// booked there itself, whose decision may not be stored yet).
        unvouched: Vec<String>,
        /// The tenant the decision on record names for each vouched job that has one
        /// (job id → tenant). A leader counts each tenant's running jobs for fair sharing;
        /// a new leader learns here whose jobs an earlier leader placed, from the record
        /// only dispatchers write, not from the worker's word.
        tenants: HashMap<String, String>,
    },
    /// The key was deleted or purged: the worker left.
    Gone { worker_id: String },
}

/// What one Redis read found.
#[derive(Debug, Clone, Default)]
pub struct RedisSnapshot {
    /// Per worker id.
    pub ewmas: HashMap<String, EwmaSnapshot>,
    /// Output-length EWMA per model (tokens).
    pub output_len: HashMap<String, f64>,
}
