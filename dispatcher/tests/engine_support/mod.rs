//! Builders for the pure engine tests: an engine in simulated time, workers' heartbeats,
//! jobs, completions, and what the engine decided. No server, no clock.

#![allow(dead_code)]

use std::sync::Arc;

use metronome_dispatcher::engine::{
    Effect, Engine, EngineSettings, Event, Incoming, Outcome, WorkerUpdate,
};
use metronome_dispatcher::{Config, Metrics};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Decision, Endpoint, ErrorCode, Job, KvUsage,
    PerfCoefficients, WorkerStatus, PROTOCOL_VERSION,
};

pub const T0: u64 = 1_800_000_000_000;

pub fn engine(configure: impl FnOnce(&mut Config)) -> Engine {
    let mut config = Config::default();
    configure(&mut config);
    Engine::new(
        EngineSettings::from_config(&config, 7, "test".into()),
        Metrics::new(),
        None,
    )
}

/// A heartbeat of worker `id` of `model` running `in_flight`, taking at most `cap` jobs at
/// once: a 40k-token cache, a fitted model of a GPU that decodes at 50 tok/s alone.
pub fn heartbeat(
    id: &str,
    model: &str,
    cap: u32,
    in_flight: &[String],
    seq: u64,
    at: u64,
) -> Event {
    let status = WorkerStatus {
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
        max_epoch: 0,
        seq,
        sent_ms: at,
    };
    Event::Worker(WorkerUpdate::Put {
        status: Box::new(status),
        seen_ms: at,
        revision: seq,
        unvouched: Vec::new(),
        tenants: Default::default(),
    })
}

/// A job body.
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

/// `job` read from JOBS at `at`, in stream position `seq`.
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

/// A job of `model` read at `at` (its stream position is `at`).
pub fn job(id: &str, model: &str, at: u64) -> Event {
    arrival(body(id, model, None, 10, 10, at), at, at)
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
    Event::Completion {
        event: Box::new(CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: id.into(),
            worker_id: worker.into(),
            model: model.into(),
            epoch: 7,
            attempt: 1,
            outcome: CompletionOutcome::Done,
            streamed: true,
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

/// Apply `inputs` at `at`, let the engine look at its queues, and return what it did.
pub fn step(e: &mut Engine, inputs: Vec<Event>, at: u64) -> Vec<Effect> {
    for i in inputs {
        e.handle(i, at);
    }
    e.dispatch_if_changed(at);
    e.take_effects()
}

/// The (job, worker) of each Assignment, in the order they were made.
pub fn assigned(effects: &[Effect]) -> Vec<(String, String)> {
    effects
        .iter()
        .filter_map(|f| match f {
            Effect::Publish(Outcome::Assign { job, worker_id, .. }) => {
                Some((job.job.id.clone(), worker_id.clone()))
            }
            _ => None,
        })
        .collect()
}

/// The decision of each Assignment.
pub fn assignment_decisions(effects: &[Effect]) -> Vec<&Decision> {
    effects
        .iter()
        .filter_map(|f| match f {
            Effect::Publish(Outcome::Assign { decision, .. }) => Some(decision.as_ref()),
            _ => None,
        })
        .collect()
}

/// Each rejected (or expired) job: its decision and the error its client is told.
pub fn rejected(effects: &[Effect]) -> Vec<(&Decision, ErrorCode)> {
    effects
        .iter()
        .filter_map(|f| match f {
            Effect::Publish(Outcome::Reject {
                decision, error, ..
            }) => Some((decision.as_ref(), *error)),
            _ => None,
        })
        .collect()
}
