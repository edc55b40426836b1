//! Builders for the engine's unit tests: an engine on the default configuration, a
//! worker's heartbeat, a job, and the outcomes of a step.

use std::sync::Arc;

use metronome_protocol::{
    Endpoint, Job, KvUsage, PerfCoefficients, WorkerStatus, PROTOCOL_VERSION,
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

/// A heartbeat of an idle worker of model `m` listing `in_flight`: a 40k-token cache, a
/// fitted model of a GPU that decodes at 50 tok/s alone and prefills 10,000 tokens/s;
/// `edit` changes the rest.
pub fn heartbeat(
    id: &str,
    in_flight: &[&str],
    seq: u64,
    at: u64,
    edit: impl FnOnce(&mut WorkerStatus),
) -> Event {
    let mut status = WorkerStatus {
        v: PROTOCOL_VERSION,
        worker_id: id.into(),
        model: "m".into(),
        node: None,
        gpu_index: None,
        healthy: true,
        draining: false,
        max_concurrency: 256,
        active: in_flight.len() as u32,
        queued: 0,
        in_flight: in_flight.iter().map(|s| s.to_string()).collect(),
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
        max_epoch: 0,
        seq,
        sent_ms: at,
    };
    edit(&mut status);
    Event::Worker(WorkerUpdate::Put {
        status: Box::new(status),
        seen_ms: at,
        revision: seq,
        unvouched: Vec::new(),
        tenants: Default::default(),
    })
}

/// A job of model `m` (and `tenant`), read at `at`.
pub fn job_of(tenant: Option<&str>, id: &str, prompt: u32, max_tokens: u32, at: u64) -> Event {
    Event::Job(Box::new(Incoming {
        job: Arc::new(body(tenant, id, prompt, max_tokens, at)),
        acker: None,
        seq: at,
        received_ms: at,
        attempt: 1,
        refused_by: Vec::new(),
    }))
}

/// A job of model `m` without a tenant, read at `at`.
pub fn job(id: &str, prompt: u32, max_tokens: u32, at: u64) -> Event {
    job_of(None, id, prompt, max_tokens, at)
}

/// A job's body.
pub fn body(tenant: Option<&str>, id: &str, prompt: u32, max_tokens: u32, at: u64) -> Job {
    Job {
        v: PROTOCOL_VERSION,
        id: id.into(),
        model: "m".into(),
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

/// Apply `inputs` at `at`, let the engine look at its queues, and return what it
/// published.
pub fn step(e: &mut Engine, inputs: Vec<Event>, at: u64) -> Vec<Outcome> {
    for i in inputs {
        e.handle(i, at);
    }
    e.dispatch_if_changed(at);
    e.take_effects()
        .into_iter()
        .filter_map(|f| match f {
            Effect::Publish(o) => Some(o),
            _ => None,
        })
        .collect()
}

/// The (job, worker) of each Assignment among `outcomes`.
pub fn assigned(outcomes: &[Outcome]) -> Vec<(String, String)> {
    outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Assign { job, worker_id, .. } => Some((job.job.id.clone(), worker_id.clone())),
            _ => None,
        })
        .collect()
}
