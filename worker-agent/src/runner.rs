//! Running one accepted assignment: call the model server, relay its chunks, publish the
//! final result, acknowledge WORK, publish the completion event, update the averages.
//!
//! Order matters and is the contract with the dispatcher:
//! 1. chunks on `results.<tenant>.<job>.chunk` (core NATS, `seq` 0, 1, 2… so a gap is visible),
//!    with `+WPI` progress acks on the WORK message while generating so it is not
//!    redelivered;
//! 2. the final result on `results.<tenant>.<job>.final` through JetStream (RESULTS keeps it for
//!    late readers), published before the WORK ack so an acknowledged job always has a
//!    final result;
//!    (the chunks, the final result and the completion event carry the run span's
//!    `traceparent` header, so one trace follows the request through them);
//! 3. the WORK ack; 4. the completion event on `events.done.<worker>` through JetStream
//!    (it releases the reservation); 5. the EWMA update and the performance model's
//!    update (both off the job's slot).
//!
//! What to publish, the chunks' numbers, the measurements and how a stopped job ends are
//! the job lifecycle's ([`crate::lifecycle`]): this file makes the model-server call,
//! tells the lifecycle each chunk and the call's end, and performs what it answers.
//! Measurements ([`crate::lifecycle::measure`]) run from the moment the agent took the
//! assignment. A job that fails before any chunk says `streamed: false`, so the dispatcher
//! knows no output reached the client. The token arrivals (one per chunk carrying text, as
//! the usage estimate counts them) feed the lifecycle's load tracker, whose sample of a
//! completed job updates the worker's performance model.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::StreamExt;
use metronome_protocol::names::{
    event_done_subject, result_chunk_subject, result_final_subject, work_msg_id, FIRST_ON_SUBJECT,
    HEADER_EXPECTED_LAST_SUBJECT_SEQ, HEADER_MODEL, HEADER_MSG_ID, HEADER_TRACEPARENT,
};
use metronome_protocol::time::unix_ms;
use metronome_protocol::trace::TraceParent;
use metronome_protocol::{
    Assignment, CompletionEvent, CompletionOutcome, ErrorCode, FinalResult, ResultChunk, Usage,
    PROTOCOL_VERSION,
};
use metronome_runtime::retry::Pauses;
use metronome_scheduler::perf::PerfSample;
use tracing::Instrument;

use crate::assemble::Assembler;
use crate::bound::bound_request;
use crate::ewma_store::JobSample;
use crate::lifecycle::{Ack, Effect, Ending};
use crate::model_client::RequestIds;
use crate::shared::{now, Mailbox, Shared};

/// Run `assignment` to its end: the model-server call, its chunks and what the lifecycle
/// says to publish when it ends. `mailbox` brings the lifecycle's stops (a client's cancel,
/// a revocation, the leader declaring this worker dead, the drain timeout).
pub(crate) async fn run_job(
    shared: Arc<Shared>,
    assignment: Assignment,
    msg: jetstream::Message,
    mut mailbox: Mailbox,
) {
    let job_id = assignment.job.id.clone();
    // Both ids on the span, so every line about the job (JSON logs list span fields) can be
    // found by job and by worker when the agents' logs are collected together.
    let span = tracing::info_span!(
        "job",
        otel.name = "worker run",
        job_id = %job_id,
        worker_id = %assignment.worker_id,
        attempt = assignment.attempt,
        epoch = assignment.epoch,
        trace_id = tracing::field::Empty,
    );
    // The run is a child of the decision that chose this worker (the Assignment's
    // `traceparent` header), else of the request (the job's own); its context goes on the
    // final result and the completion event.
    let parent = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(HEADER_TRACEPARENT))
        .and_then(|v| TraceParent::parse(v.as_str()))
        .or_else(|| assignment.job.trace());
    let run_trace = parent.map(|parent| {
        // The request's trace id beside the job id, as the gateway's lines carry it.
        span.record("trace_id", parent.trace_id().as_str());
        metronome_runtime::otel::set_parent(&span, &parent);
        metronome_runtime::otel::traceparent_of(&span, &parent)
    });
    let run_traceparent = run_trace.map(|t| t.to_string());
    async move {
        let run_traceparent = run_traceparent.as_deref();
        let job = &assignment.job;
        let cfg = &shared.config;
        tracing::info!(endpoint = ?job.endpoint, max_tokens = job.max_tokens, "job started");
        // The job's size, not its body, bounds the output (what was reserved for it); an
        // embedding has no output to bound. Built, not forwarded: OpenAI's fields of the
        // endpoint and the configured extras, the job's model.
        let built = crate::request_fields::build(
            job.endpoint,
            &job.model,
            &job.request,
            &shared.request_extras,
        );
        if !built.dropped.is_empty() {
            tracing::debug!(dropped = ?built.dropped, "request fields left out");
        }
        let bounded = if job.endpoint.generates() {
            bound_request(built.body, job.max_tokens)
        } else {
            Ok(built.body)
        };
        // The model server's call, as a span of its own: its `traceparent` goes to the
        // server, so the server's spans (vLLM's) hang below it. It ends when the stream is
        // dropped.
        let call_span = tracing::info_span!(
            "model server call",
            otel.kind = "client",
            endpoint = ?job.endpoint,
        );
        let call_trace = run_trace
            .map(|run| metronome_runtime::otel::traceparent_of(&call_span, &run).to_string());
        let (mut chunks, refused_body) = match bounded {
            Ok(request) => {
                let ids = RequestIds {
                    request_id: &job.id,
                    traceparent: call_trace.as_deref(),
                };
                (shared.model.stream_completion(job.endpoint, request, ids), None)
            }
            Err(e) => {
                let none: crate::model_client::ChunkStream = Box::pin(futures::stream::empty());
                (none, Some(e.to_string()))
            }
        };
        let mut asm = Assembler::new(job.endpoint);
        let chunk_subject = result_chunk_subject(job.tenant.as_deref(), &job.id, &cfg.worker_id);
        // The chunks' headers, built once for the run: its `traceparent` (none without a
        // trace, or where it cannot be a header).
        let chunk_headers = run_traceparent.and_then(|tp| {
            metronome_protocol::headers::headers([(HEADER_TRACEPARENT, tp)])
                .inspect_err(|e| tracing::warn!(error = %e, "chunks go without a traceparent"))
                .ok()
        });
        let mut progress = tokio::time::interval_at(
            tokio::time::Instant::now() + cfg.progress_ack_interval(),
            cfg.progress_ack_interval(),
        );
        let deadline = tokio::time::sleep(cfg.request_timeout());
        tokio::pin!(deadline);

        let ending = if let Some(why) = refused_body {
            Ending::Failed(ErrorCode::InvalidJob, why)
        } else { loop {
            tokio::select! {
                biased;
                effect = mailbox.recv() => match effect {
                    Some(Effect::Stop { why, .. }) => {
                        tracing::info!(?why, "stopping the job");
                        break Ending::Stopped;
                    }
                    Some(other) => tracing::debug!(effect = ?other, "ignored while running"),
                    None => break Ending::Stopped,
                },
                _ = &mut deadline => break Ending::Failed(
                    ErrorCode::WorkerFailed,
                    format!("the model server did not finish within {} ms", cfg.request_timeout_ms),
                ),
                _ = progress.tick() => {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        tracing::warn!(error = %e, "progress ack failed");
                    }
                }
                next = chunks.next() => match next {
                    None => break Ending::Done,
                    Some(Err(e)) => {
                        let streamed = shared.machine(|m| m.chunks_sent(&job.id)) > 0;
                        tracing::warn!(error = %e, streamed, "model server failed");
                        if e.server_lost() {
                            shared.model_server_lost();
                        }
                        break Ending::Failed(ErrorCode::WorkerFailed, e.to_string());
                    }
                    Some(Ok(data)) => {
                        let text = asm.push(&data);
                        let effects = shared.machine(|m| m.chunk(&job.id, text, now()));
                        let mut data = Some(data);
                        // An embedding's answer goes out once, in the final result.
                        let relayed = job.endpoint.generates();
                        for effect in effects.into_iter().filter(|_| relayed) {
                            let (Effect::PublishChunk { seq, .. }, Some(data)) = (effect, data.take()) else { continue };
                            publish_chunk(&shared, &chunk_subject, chunk_headers.as_ref(), &assignment, seq, data).await;
                        }
                    }
                },
            }
        } };
        // Dropping the stream closes the HTTP connection: the server stops generating.
        drop(chunks);
        drop(call_span);
        let usage: Usage = asm.usage(job.prompt_tokens);
        let effects = shared.machine(|m| {
            m.finish(&job.id, ending, usage.prompt_tokens, usage.completion_tokens, now())
        });
        let mut outcome = None;
        let mut chunks_sent = 0;
        for effect in effects {
            match effect {
                Effect::PublishFinal { error, chunks, ttft_ms, e2e_ms, .. } => {
                    let chunks = if job.endpoint.generates() { chunks } else { 0 };
                    chunks_sent = chunks;
                    let final_result = FinalResult {
                        v: PROTOCOL_VERSION,
                        job_id: job.id.clone(),
                        worker_id: Some(cfg.worker_id.clone()),
                        response: error.is_none().then(|| asm.finish(&job.id, &job.model, usage)),
                        error,
                        usage,
                        chunks,
                        ttft_ms,
                        e2e_ms,
                    };
                    // One final result per job and publisher in RESULTS (stored only on an
                    // empty subject): if the leader already declared this job lost (this
                    // agent was silent too long), its error was stored first and readers
                    // accept that one.
                    publish_js(&shared, result_final_subject(job.tenant.as_deref(), &job.id, &cfg.worker_id), FINAL_ONCE, &job.model, run_traceparent, &final_result).await;
                }
                Effect::Ack { ack: Ack::Done, .. } => {
                    if let Err(e) = msg.double_ack().await {
                        // The final result is out; a redelivery would be refused as a
                        // duplicate by the dispatcher's bookkeeping, so this is logged
                        // rather than retried forever.
                        tracing::warn!(error = %e, "acknowledging the WORK message failed");
                    }
                }
                Effect::Ack { ack: Ack::Term, .. } => {
                    // Revoked: the leader settled the job without this run; a result or
                    // an event would compete with the job's other run or its lost-worker
                    // error.
                    if let Err(e) = msg.ack_with(AckKind::Term).await {
                        tracing::warn!(error = %e, "terminating the revoked WORK message failed");
                    }
                }
                Effect::PublishCompletion { event: c, .. } => {
                    outcome = Some(c.outcome);
                    let event = CompletionEvent {
                        v: PROTOCOL_VERSION,
                        job_id: job.id.clone(),
                        worker_id: cfg.worker_id.clone(),
                        model: job.model.clone(),
                        epoch: assignment.epoch,
                        attempt: assignment.attempt,
                        outcome: c.outcome,
                        streamed: c.streamed,
                        error: c.error,
                        prompt_tokens: usage.prompt_tokens,
                        output_tokens: usage.completion_tokens,
                        ttft_ms: c.ttft_ms,
                        tpot_ms: c.tpot_ms,
                        e2e_ms: c.e2e_ms,
                        finished_ms: unix_ms(),
                        job: None,
                    };
                    let msg_id = work_msg_id(&job.id, assignment.attempt);
                    publish_js(&shared, event_done_subject(&cfg.worker_id), (HEADER_MSG_ID, &msg_id), &job.model, run_traceparent, &event).await;
                    shared.metrics.job_finished(c.outcome);
                    shared.metrics.output_tokens.add(u64::from(usage.completion_tokens));
                    shared.metrics.prompt_tokens.add(u64::from(usage.prompt_tokens));
                    if let Some(t) = c.ttft_ms {
                        shared.metrics.observe_ttft_ms(t);
                    }
                }
                Effect::Learn { done, mut sample, perf, .. } => {
                    // An embedding writes nothing: it says nothing of the model's output length.
                    if !job.endpoint.generates() {
                        sample.output_tokens = None;
                    }
                    learn(&shared, &job.model, outcome, chunks_sent, usage, done, sample, perf);
                }
                other => shared.perform(other),
            }
        }
    }
    .instrument(span)
    .await
}

/// Publish one chunk on core NATS (a lost chunk shows as a gap in `seq`), with the run's
/// headers when it has any.
async fn publish_chunk(
    shared: &Shared,
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    assignment: &Assignment,
    seq: u64,
    data: serde_json::Value,
) {
    let chunk = ResultChunk {
        v: PROTOCOL_VERSION,
        job_id: assignment.job.id.clone(),
        seq,
        worker_id: shared.config.worker_id.clone(),
        attempt: Some(assignment.attempt),
        data,
    };
    match serde_json::to_vec(&chunk) {
        Ok(body) => {
            let sent = match headers {
                Some(h) => {
                    shared
                        .client
                        .publish_with_headers(subject.to_string(), h.clone(), body.into())
                        .await
                }
                None => {
                    shared
                        .client
                        .publish(subject.to_string(), body.into())
                        .await
                }
            };
            if let Err(e) = sent {
                shared.metrics.nats_publish_errors.inc();
                tracing::warn!(error = %e, seq, "publishing a chunk failed");
            }
        }
        Err(e) => tracing::warn!(error = %e, seq, "encoding a chunk failed"),
    }
}

/// What the worker's averages learn from a job that ran: the performance model its sample,
/// the EWMAs (in Redis, off the job's slot) a completed job's timings.
#[allow(clippy::too_many_arguments)]
fn learn(
    shared: &Shared,
    model: &str,
    outcome: Option<CompletionOutcome>,
    chunks: u64,
    usage: Usage,
    done: bool,
    sample: JobSample,
    perf: Option<PerfSample>,
) {
    // What the performance model learns from this job, beside its timings: why a job was
    // slow (the streams it shared the GPU with, their context, the prompts prefilled
    // during its decode) and, replayed, how a worker's fit got where it is.
    let features = perf.as_ref();
    tracing::info!(
        outcome = ?outcome,
        chunks,
        prompt_tokens = usage.prompt_tokens,
        output_tokens = usage.completion_tokens,
        ttft_ms = sample.ttft_ms,
        tpot_ms = sample.tpot_ms,
        e2e_ms = sample.e2e_ms,
        streams_at_start = features.map(|f| f.streams_at_start),
        prefill_ahead_tokens = features.map(|f| f.prefill_ahead_tokens),
        mean_decode_streams = features.map(|f| f.mean_decode_streams),
        mean_context_tokens = features.map(|f| f.mean_context_tokens),
        stall_prefill_tokens = features.map(|f| f.stall_prefill_tokens),
        "job finished"
    );
    // Only complete runs are representative of the worker's speed.
    if let Some(s) = perf {
        shared.perf.lock().expect("perf lock").observe(&s);
        shared.metrics.perf_samples.inc();
        shared.perf_changed.notify_one();
    }
    if done {
        if let Some(store) = shared.ewma.clone() {
            let (worker, model) = (shared.config.worker_id.clone(), model.to_string());
            tokio::spawn(async move {
                if let Err(e) = store.record(&worker, &model, &sample, unix_ms()).await {
                    tracing::warn!(error = %e, worker_id = %worker, "EWMA update failed; later updates will retry");
                }
            });
        }
    }
}

/// How long a JetStream publish is retried. A stream of a NATS cluster whose leader was
/// lost answers nothing ("no stream found", at once) until its other copies have elected a
/// new one: JetStream's election timeout is several seconds (4 to 9 in current servers;
/// 5 to 7 s measured by the drill `kill-nats-leader` on 2.9), and a second round can
/// follow. Counting tries instead gave up after about a second, and a refusal or final
/// result given up is a lost job (the WORK message is acknowledged after it).
const PUBLISH_RETRY_WINDOW: Duration = Duration::from_secs(20);

/// Publish `value` through JetStream and wait for the stream's ack, retrying for
/// [`PUBLISH_RETRY_WINDOW`] (a lost final result or event leaves a client or a reservation
/// waiting). The message id makes a retry of a publish that was stored harmless.
/// The de-duplication of a final result: stored only while its subject
/// (`results.<tenant>.<job_id>.<this worker>.final`) is empty. Not a `Nats-Msg-Id`: ids are
/// de-duplicated stream-wide, so another publisher could take the id first
/// (`names::HEADER_EXPECTED_LAST_SUBJECT_SEQ`).
pub(crate) const FINAL_ONCE: (&str, &str) = (HEADER_EXPECTED_LAST_SUBJECT_SEQ, FIRST_ON_SUBJECT);

/// Publish on JetStream with one de-duplication header (`(HEADER_MSG_ID, id)`, or
/// [`FINAL_ONCE`]), retrying for [`PUBLISH_RETRY_WINDOW`] (pauses from 100 ms doubling to
/// 1 s, jittered, so the agents that lost the same stream leader do not retry in step). A final result whose subject
/// already holds one (a retry after a lost acknowledgement) counts as published.
pub(crate) async fn publish_js<T: serde::Serialize>(
    shared: &Shared,
    subject: String,
    dedup: (&str, &str),
    model: &str,
    traceparent: Option<&str>,
    value: &T,
) -> bool {
    let body: Bytes = match serde_json::to_vec(value) {
        Ok(b) => b.into(),
        Err(e) => {
            tracing::error!(error = %e, %subject, "encoding failed");
            return false;
        }
    };
    // The model comes from the assignment: a value that cannot be a header (CR/LF) must
    // not panic the job's task, and the message still matters more than that header (the
    // body carries the model too), so it goes without it.
    let trace = traceparent.map(|tp| (HEADER_TRACEPARENT, tp));
    let headers = match metronome_protocol::headers::headers(
        [dedup, (HEADER_MODEL, model)].into_iter().chain(trace),
    ) {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(error = %e, %subject, "publishing without the model header");
            match metronome_protocol::headers::headers([dedup]) {
                Ok(h) => h,
                Err(e) => {
                    shared.metrics.nats_publish_errors.inc();
                    tracing::error!(error = %e, %subject, "cannot build the message headers");
                    return false;
                }
            }
        }
    };
    let started = tokio::time::Instant::now();
    let mut pauses = Pauses::new(Duration::from_millis(100), Duration::from_secs(1));
    for attempt in 1u32.. {
        let result = match shared
            .js
            .publish_with_headers(subject.clone(), headers.clone(), body.clone())
            .await
        {
            Ok(ack) => match ack.await {
                Ok(_) => Ok(()),
                Err(e)
                    if e.kind() == PublishErrorKind::WrongLastSequence && dedup == FINAL_ONCE =>
                {
                    tracing::debug!(%subject, "final result already stored");
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => return true,
            Err(e) => {
                shared.metrics.nats_publish_errors.inc();
                tracing::warn!(error = %e, %subject, attempt, "JetStream publish failed");
                if started.elapsed() >= PUBLISH_RETRY_WINDOW {
                    break;
                }
                tokio::time::sleep(pauses.next_pause()).await;
            }
        }
    }
    tracing::error!(
        %subject,
        window_s = PUBLISH_RETRY_WINDOW.as_secs(),
        "giving up publishing"
    );
    false
}
