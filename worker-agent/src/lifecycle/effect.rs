//! What comes out of the job lifecycle: the [`Effect`]s the shell performs, in order, and
//! the answers to its queries.

use metronome_protocol::{CompletionOutcome, ResultError};
use metronome_scheduler::perf::PerfSample;

use super::fence::FenceMove;
use crate::ewma_store::JobSample;

#[cfg(doc)]
use super::JobMachine;

/// Why an assignment is handed back to the dispatcher without running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    OtherWorker,
    /// A new epoch the leader lease does not vouch for.
    Unvouched,
    /// From a deposed leader.
    StaleEpoch,
    Draining,
    /// Delivered before, neither held nor reported.
    NotHeldRedelivery,
    /// Fenced between taking and reporting it.
    Fenced,
    /// The drain timeout passed before it was reported.
    ShuttingDown,
}

/// Why a running job is stopped before its model-server call ends, strongest first: a
/// job stopped for two reasons ends for the stronger one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stop {
    /// The leader settled the attempt elsewhere: no result, no event.
    Revoked,
    /// The leader declared this worker dead while it ran: `worker_lost`.
    Lost,
    /// Its client cancelled it.
    Cancelled,
    /// The drain timeout passed.
    Aborted,
}

/// How the WORK message is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ack {
    /// Acknowledged (and confirmed): done with, never redelivered.
    Done,
    /// Terminated: never redelivered, no result.
    Term,
}

/// Events the shell counts or logs; they change nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// A job was revoked by the leader (running, waiting or not yet taken).
    Revoked,
    /// A redelivery of a job this agent runs: the running copy acknowledges it.
    DuplicateIgnored,
    /// A redelivery of an attempt that already ended here.
    AlreadyEnded,
    /// A cancel naming another tenant than the held job's: ignored.
    CancelOfAnotherTenant,
    /// A cancel of a job not held here.
    CancelNotHeld,
    /// A revocation from a leader older than the highest epoch seen: ignored.
    StaleRevocation,
}

/// The completion event of a job that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub outcome: CompletionOutcome,
    /// Whether any chunk was published: a job that streamed is never run again.
    pub streamed: bool,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
}

/// What the shell performs.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Taken: hold it (listed in heartbeats) until a stored heartbeat lists it.
    Hold {
        job_id: String,
    },
    /// Send a heartbeat now.
    Heartbeat,
    /// Publish a `refused` completion event (with the job's copy when `carry_job`) and
    /// acknowledge the WORK message.
    Refuse {
        job_id: String,
        why: Refusal,
        reason: String,
        carry_job: bool,
    },
    /// The job may have streamed in a previous run: publish the final `worker_lost` error
    /// and a failed event (`streamed`), acknowledge the WORK message.
    FailLost {
        job_id: String,
        message: String,
    },
    /// Acknowledge the WORK message.
    Ack {
        job_id: String,
        ack: Ack,
    },
    /// Start the model-server call.
    Start {
        job_id: String,
    },
    /// Stop the model-server call.
    Stop {
        job_id: String,
        why: Stop,
    },
    /// Publish the chunk just received, with this sequence number.
    PublishChunk {
        job_id: String,
        seq: u64,
    },
    /// Publish the final result (before the WORK ack: an acknowledged job has one).
    PublishFinal {
        job_id: String,
        error: Option<ResultError>,
        chunks: u64,
        ttft_ms: Option<f64>,
        e2e_ms: Option<f64>,
    },
    /// Publish the completion event (it releases the reservation).
    PublishCompletion {
        job_id: String,
        event: Completion,
    },
    /// A job's measurements: the EWMAs learn from a completed one (`done`), the
    /// performance model from its sample.
    Learn {
        job_id: String,
        done: bool,
        sample: JobSample,
        perf: Option<PerfSample>,
    },
    /// The fence moved.
    Fence(FenceMove),
    Notice {
        job_id: String,
        notice: Notice,
    },
}

/// Whether the intake may pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pull {
    /// Fenced: nothing until a heartbeat is stored.
    Fenced,
    /// Every slot is held.
    Full,
    /// This many slots are free.
    Free(usize),
}

/// What a heartbeat says about the jobs.
#[derive(Debug, Clone, PartialEq)]
pub struct HeartbeatContents {
    /// Every job taken up to this count is listed: once stored, they may start
    /// ([`JobMachine::reported`]).
    pub generation: u64,
    /// The jobs held for the leader, in the order they were taken (revoked or lost ones,
    /// still stopping, are no longer the leader's).
    pub in_flight: Vec<String>,
    /// Requests running on the model server: its scraped count less this agent's jobs
    /// that ended since the scrape, else the jobs held.
    pub active: u32,
    pub draining: bool,
    /// Prompt tokens not yet prefilled: on the model server and held waiting to start.
    pub prefill_pending_tokens: u64,
    pub max_epoch: u64,
}
