//! Builders for the engine's tests, the unit tests beside each stage and the crate's
//! integration tests alike: an engine on the default configuration, a worker's heartbeat,
//! a job, a completion, a step of simulated time and what it published. No server, no
//! clock. Public only for the tests (hidden from the documentation).

use std::sync::Arc;

use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Decision, Endpoint, ErrorCode, Job, KvUsage,
    PerfCoefficients, WorkerStatus, PROTOCOL_VERSION,
};

use crate::config::Config;
use crate::engine::{Effect, Engine, EngineSettings, Event, Incoming, Outcome, WorkerUpdate};
use crate::metrics::Metrics;
use crate::queue::QueuedJob;

/// The time the tests start at (Unix ms).
pub const T0: u64 = 1_800_000_000_000;

/// An engine on the default configuration, `configure`d, at `T0`.
pub fn engine(configure: impl FnOnce(&mut Config)) -> Engine {
    let mut config = Config::default();
    configure(&mut config);
    let mut e = Engine::new(
        EngineSettings::from_config(&config, 7, "test".into()),
        Metrics::new(),
        None,
    );
    e.dispatch_if_changed(T0);
    e
}

/// The status of an idle-but-for-`in_flight` worker `id` of `model` taking at most `cap`
/// jobs at once: a 40k-token cache, a fitted model of a GPU that decodes at 50 tok/s alone
/// and prefills 10,000 tokens/s.
pub fn status(
    id: &str,
    model: &str,
    cap: u32,
    in_flight: &[String],
    seq: u64,
    at: u64,
) -> WorkerStatus {
    WorkerStatus {
        v: PROTOCOL_VERSION,
        worker_id: id.into(),
        model: model.into(),
        node: None,
        gpu_index: None,
        healthy: true,
        draining: false,
        max_concurrency: cap,
        active: in_flight.len() as u32,
        queued: 0,
        in_flight: in_flight.to_vec(),
        kv: Some(KvUsage {
            used_frac: 0.0,
            capacity_tokens: Some(40_000),
        }),
        gpu: None,
        prefill_pending_tokens: 0,
        perf: Some(PerfCoefficients {
            step_base_ms: 20.0,
            step_per_stream_ms: 0.2,
            step_per_ktok_ms: 0.1,
            stall_per_prefill_token_ms: 0.1,
            ttft_base_ms: 20.0,
            prefill_per_token_ms: 0.1,
            ttft_per_stream_ms: 1.0,
            step_error_ms: 0.0,
            samples: 100,
        }),
        decoding: None,
        max_epoch: 0,
        seq,
        sent_ms: at,
    }
}

/// `status` stored in the workers bucket (revision `seq`) and seen at `at`.
pub fn put(status: WorkerStatus, seq: u64, at: u64) -> Event {
    Event::Worker(WorkerUpdate::Put {
        status: Box::new(status),
        seen_ms: at,
        revision: seq,
        unvouched: Vec::new(),
        tenants: Default::default(),
    })
}

/// The heartbeat of worker `id` of `model` running `in_flight`, taking at most `cap` jobs
/// at once ([`status`]).
pub fn heartbeat_of(
    id: &str,
    model: &str,
    cap: u32,
    in_flight: &[String],
    seq: u64,
    at: u64,
) -> Event {
    put(status(id, model, cap, in_flight, seq, at), seq, at)
}

/// The heartbeat of worker `id` of model `m` listing `in_flight` (256 jobs at most at
/// once); `edit` changes the rest.
pub fn heartbeat(
    id: &str,
    in_flight: &[&str],
    seq: u64,
    at: u64,
    edit: impl FnOnce(&mut WorkerStatus),
) -> Event {
    let in_flight: Vec<String> = in_flight.iter().map(|s| s.to_string()).collect();
    let mut s = status(id, "m", 256, &in_flight, seq, at);
    edit(&mut s);
    put(s, seq, at)
}

/// A job's body.
pub fn body(
    id: &str,
    model: &str,
    tenant: Option<&str>,
    prompt: u32,
    max_tokens: u32,
    at: u64,
) -> Job {
    Job {
        v: PROTOCOL_VERSION,
        id: id.into(),
        model: model.into(),
        endpoint: Endpoint::Completion,
        request: serde_json::Value::Null,
        prompt_tokens: prompt,
        max_tokens,
        submitted_ms: at,
        deadline_ms: None,
        slo: None,
        tenant: tenant.map(str::to_string),
        priority: None,
        prefix: None,
        traceparent: None,
    }
}

/// `job` read from JOBS at `at`, in stream position `seq` (first attempt).
pub fn arrival(job: Job, seq: u64, at: u64) -> Event {
    Event::Job(Box::new(Incoming {
        job: Arc::new(job),
        acker: None,
        seq,
        received_ms: at,
        attempt: 1,
        refused_by: Vec::new(),
    }))
}

/// A job of model `m` (and `tenant`), read at `at` (its stream position is `at`).
pub fn job_of(tenant: Option<&str>, id: &str, prompt: u32, max_tokens: u32, at: u64) -> Event {
    arrival(body(id, "m", tenant, prompt, max_tokens, at), at, at)
}

/// A job of model `m` without a tenant, read at `at`.
pub fn job(id: &str, prompt: u32, max_tokens: u32, at: u64) -> Event {
    job_of(None, id, prompt, max_tokens, at)
}

/// A job of `model` of 10 prompt and 10 output tokens, read at `at`.
pub fn small_job(id: &str, model: &str, at: u64) -> Event {
    arrival(body(id, model, None, 10, 10, at), at, at)
}

/// A job waiting since `enqueued_ms`, submitted then.
pub fn queued(job: Job, enqueued_ms: u64) -> QueuedJob {
    QueuedJob {
        job: Arc::new(job),
        attempt: 1,
        acker: None,
        seq: enqueued_ms,
        enqueued_ms,
        deadline_ms: enqueued_ms + 60_000,
        progress_ms: enqueued_ms,
    }
}

/// `worker` ended attempt 1 of `id` with `outcome` at `at`, after `output_tokens`.
pub fn completion(
    id: &str,
    worker: &str,
    model: &str,
    prompt: u32,
    output_tokens: u32,
    outcome: CompletionOutcome,
    at: u64,
) -> Event {
    Event::Completion {
        event: Box::new(CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: id.into(),
            worker_id: worker.into(),
            model: model.into(),
            epoch: 7,
            attempt: 1,
            outcome,
            streamed: outcome == CompletionOutcome::Done,
            error: None,
            prompt_tokens: prompt,
            output_tokens,
            ttft_ms: Some(30.0),
            tpot_ms: Some(20.0),
            e2e_ms: 1_000.0,
            finished_ms: at,
            job: None,
        }),
        acker: None,
    }
}

/// `worker` finished `id` (attempt 1) with `output_tokens`.
pub fn done(
    id: &str,
    worker: &str,
    model: &str,
    prompt: u32,
    output_tokens: u32,
    at: u64,
) -> Event {
    completion(
        id,
        worker,
        model,
        prompt,
        output_tokens,
        CompletionOutcome::Done,
        at,
    )
}

/// Apply `inputs` at `at`, let the engine look at its queues, and return what it did.
pub fn step(e: &mut Engine, inputs: Vec<Event>, at: u64) -> Vec<Effect> {
    for i in inputs {
        e.handle(i, at);
    }
    e.dispatch_if_changed(at);
    e.take_effects()
}

/// [`step`], keeping only what the engine published.
pub fn published(e: &mut Engine, inputs: Vec<Event>, at: u64) -> Vec<Outcome> {
    step(e, inputs, at)
        .into_iter()
        .filter_map(|f| match f {
            Effect::Publish(o) => Some(o),
            _ => None,
        })
        .collect()
}

/// An effect or an outcome: what the readers below take.
pub trait AsOutcome {
    /// The outcome it publishes, if it publishes one.
    fn outcome(&self) -> Option<&Outcome>;
}

impl AsOutcome for Outcome {
    fn outcome(&self) -> Option<&Outcome> {
        Some(self)
    }
}

impl AsOutcome for Effect {
    fn outcome(&self) -> Option<&Outcome> {
        match self {
            Effect::Publish(o) => Some(o),
            _ => None,
        }
    }
}

/// The (job, worker) of each Assignment, in the order they were made.
pub fn assigned<T: AsOutcome>(items: &[T]) -> Vec<(String, String)> {
    items
        .iter()
        .filter_map(|i| match i.outcome()? {
            Outcome::Assign { job, worker_id, .. } => Some((job.job.id.clone(), worker_id.clone())),
            _ => None,
        })
        .collect()
}

/// The decision of each Assignment.
pub fn assignment_decisions<T: AsOutcome>(items: &[T]) -> Vec<&Decision> {
    items
        .iter()
        .filter_map(|i| match i.outcome()? {
            Outcome::Assign { decision, .. } => Some(decision.as_ref()),
            _ => None,
        })
        .collect()
}

/// Each rejected (or expired) job: its decision and the error its client is told.
pub fn rejected<T: AsOutcome>(items: &[T]) -> Vec<(&Decision, ErrorCode)> {
    items
        .iter()
        .filter_map(|i| match i.outcome()? {
            Outcome::Reject {
                decision, error, ..
            } => Some((decision.as_ref(), *error)),
            _ => None,
        })
        .collect()
}
