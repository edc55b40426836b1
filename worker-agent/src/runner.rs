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
//! 3. the WORK ack; 4. the completion event on `events.done.<worker>` through JetStream
//!    (it releases the reservation); 5. the EWMA update and the performance model's
//!    update (both off the job's slot).
//!
//! Measurements: TTFT from the moment the agent took the assignment to the first chunk
//! carrying text; TPOT the mean gap between text arrivals after the first, per output
//! token; tokens/s the output tokens over the time from start to the last token; e2e from
//! start to the final result. A job that fails before any token says `streamed: false`, so
//! the dispatcher knows no output reached the client. The same token arrivals feed the
//! agent's [`LoadTracker`](crate::load_tracker::LoadTracker) (one token per chunk carrying
//! text, as the usage estimate counts them), whose sample of a completed job updates the
//! worker's performance model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::StreamExt;
use metronome_protocol::names::{
    event_done_subject, result_chunk_subject, result_final_subject, work_msg_id, FIRST_ON_SUBJECT,
    HEADER_EXPECTED_LAST_SUBJECT_SEQ, HEADER_MODEL, HEADER_MSG_ID,
};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{
    Assignment, CompletionEvent, CompletionOutcome, ErrorCode, FinalResult, ResultChunk,
    ResultError, Usage, PROTOCOL_VERSION,
};
use metronome_scheduler::perf::PerfSample;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::assemble::Assembler;
use crate::bound::bound_request;
use crate::ewma_store::JobSample;
use crate::load_tracker::Measured;
use crate::shared::Shared;

/// How a running job ended, before it is published.
#[derive(Debug)]
enum Ending {
    Done,
    Failed(ErrorCode, String),
    Cancelled,
    /// The leader declared this worker dead and settled the job without it: no result and
    /// no event, which would compete with the job's other run or its lost-worker error.
    Revoked,
}

/// Timing of the token arrivals of one job.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub start: Instant,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
}

/// The measurements of a job from its timing and output token count.
pub fn measure(t: &Timing, output_tokens: u32, end: Instant) -> JobSample {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft_ms = t.first_token.map(|f| ms(f - t.start));
    let tpot_ms = match (t.first_token, t.last_token) {
        (Some(f), Some(l)) if output_tokens > 1 => Some(ms(l - f) / f64::from(output_tokens - 1)),
        _ => None,
    };
    let tok_s = t.last_token.and_then(|l| {
        let secs = (l - t.start).as_secs_f64();
        (secs > 0.0 && output_tokens > 0).then(|| f64::from(output_tokens) / secs)
    });
    JobSample {
        ttft_ms,
        tpot_ms,
        tok_s,
        e2e_ms: Some(ms(end - t.start)),
        output_tokens: Some(output_tokens),
    }
}

/// Run `assignment` to its end. `cancel` fires when a client cancels the job.
pub(crate) async fn run_job(
    shared: Arc<Shared>,
    assignment: Assignment,
    msg: jetstream::Message,
    cancel: CancellationToken,
    revoke: CancellationToken,
    lost: CancellationToken,
    start: Instant,
) {
    let job_id = assignment.job.id.clone();
    // Both ids on the span, so every line about the job (JSON logs list span fields) can be
    // found by job and by worker when the agents' logs are collected together.
    let span = tracing::info_span!(
        "job",
        job_id = %job_id,
        worker_id = %assignment.worker_id,
        attempt = assignment.attempt,
        epoch = assignment.epoch
    );
    async move {
        let job = &assignment.job;
        let cfg = &shared.config;
        tracing::info!(endpoint = ?job.endpoint, max_tokens = job.max_tokens, "job started");
        let tracked = Tracking::start(shared.clone(), &job.id, job.prompt_tokens);
        // The job's size, not its body, bounds the output (what was reserved for it).
        let (mut chunks, refused_body) = match bound_request(job.request.clone(), job.max_tokens) {
            Ok(request) => (shared.model.stream_completion(job.endpoint, request), None),
            Err(e) => {
                let none: crate::model_client::ChunkStream = Box::pin(futures::stream::empty());
                (none, Some(e.to_string()))
            }
        };
        let mut asm = Assembler::new(job.endpoint);
        let mut timing = Timing { start, first_token: None, last_token: None };
        let mut seq: u64 = 0;
        let chunk_subject = result_chunk_subject(job.tenant.as_deref(), &job.id, &cfg.worker_id);
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
                _ = revoke.cancelled() => break Ending::Revoked,
                _ = lost.cancelled() => break Ending::Failed(
                    ErrorCode::WorkerLost,
                    "the leader declared this worker dead while it ran the job (its heartbeats stopped arriving)".into(),
                ),
                _ = cancel.cancelled() => break Ending::Cancelled,
                _ = shared.abort.cancelled() => break Ending::Failed(
                    ErrorCode::WorkerFailed,
                    "the worker-agent shut down before the job finished".into(),
                ),
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
                        tracing::warn!(error = %e, streamed = seq > 0, "model server failed");
                        if e.server_lost() {
                            shared.model_server_lost();
                        }
                        break Ending::Failed(ErrorCode::WorkerFailed, e.to_string());
                    }
                    Some(Ok(data)) => {
                        let now = Instant::now();
                        if asm.push(&data) {
                            let mut load = shared.load.lock().expect("load lock");
                            if timing.first_token.is_none() {
                                timing.first_token = Some(now);
                                load.first_token(&job.id, now);
                            }
                            timing.last_token = Some(now);
                            load.tokens(&job.id, 1, now);
                        }
                        let chunk = ResultChunk {
                            v: PROTOCOL_VERSION,
                            job_id: job.id.clone(),
                            seq,
                            worker_id: cfg.worker_id.clone(),
                            attempt: Some(assignment.attempt),
                            data,
                        };
                        match serde_json::to_vec(&chunk) {
                            Ok(body) => {
                                if let Err(e) = shared.client.publish(chunk_subject.clone(), body.into()).await {
                                    shared.metrics.nats_publish_errors.inc();
                                    tracing::warn!(error = %e, seq, "publishing a chunk failed");
                                }
                            }
                            Err(e) => tracing::warn!(error = %e, seq, "encoding a chunk failed"),
                        }
                        seq += 1;
                    }
                },
            }
        } };
        // Dropping the stream closes the HTTP connection: the server stops generating.
        drop(chunks);
        let end = Instant::now();
        let streamed = seq > 0;
        let usage: Usage = asm.usage(job.prompt_tokens);
        let sample = measure(&timing, usage.completion_tokens, end);
        let measured = matches!(ending, Ending::Done).then(|| Measured {
            prompt_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            ttft_ms: sample.ttft_ms,
            tpot_ms: sample.tpot_ms,
        });
        let perf_sample = tracked.end(measured.as_ref(), end);

        if matches!(ending, Ending::Revoked) {
            shared.metrics.revoked_jobs.inc();
            tracing::warn!(chunks = seq, "job revoked by the leader: stopped without a result");
            if let Err(e) = msg.ack_with(AckKind::Term).await {
                tracing::warn!(error = %e, "terminating the revoked WORK message failed");
            }
            return;
        }
        let (outcome, error) = match &ending {
            Ending::Done => (CompletionOutcome::Done, None),
            Ending::Cancelled => (
                CompletionOutcome::Cancelled,
                Some(ResultError { code: ErrorCode::Cancelled, message: "cancelled by the client".into() }),
            ),
            Ending::Failed(code, message) => (
                CompletionOutcome::Failed,
                Some(ResultError { code: *code, message: message.clone() }),
            ),
            Ending::Revoked => unreachable!("returned above"),
        };
        let final_result = FinalResult {
            v: PROTOCOL_VERSION,
            job_id: job.id.clone(),
            worker_id: Some(cfg.worker_id.clone()),
            response: matches!(ending, Ending::Done).then(|| asm.finish(&job.id, &job.model, usage)),
            error: error.clone(),
            usage,
            chunks: seq,
            ttft_ms: sample.ttft_ms,
            e2e_ms: sample.e2e_ms,
        };
        // One final result per job and publisher in RESULTS (stored only on an empty
        // subject): if the leader already declared this job lost (this agent was silent
        // too long), its error was stored first and readers accept that one.
        publish_js(&shared, result_final_subject(job.tenant.as_deref(), &job.id, &cfg.worker_id), FINAL_ONCE, &job.model, &final_result).await;
        let msg_id = work_msg_id(&job.id, assignment.attempt);

        if let Err(e) = msg.double_ack().await {
            // The final result is out; a redelivery would be refused as a duplicate by the
            // dispatcher's bookkeeping, so this is logged rather than retried forever.
            tracing::warn!(error = %e, "acknowledging the WORK message failed");
        }

        let event = CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: job.id.clone(),
            worker_id: cfg.worker_id.clone(),
            model: job.model.clone(),
            epoch: assignment.epoch,
            attempt: assignment.attempt,
            outcome,
            streamed,
            error: error.map(|e| e.message),
            prompt_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            ttft_ms: sample.ttft_ms,
            tpot_ms: sample.tpot_ms,
            e2e_ms: sample.e2e_ms.unwrap_or_default(),
            finished_ms: unix_ms(),
            job: None,
        };
        publish_js(&shared, event_done_subject(&cfg.worker_id), (HEADER_MSG_ID, &msg_id), &job.model, &event).await;

        shared.metrics.job_finished(outcome);
        shared.metrics.output_tokens.add(u64::from(usage.completion_tokens));
        shared.metrics.prompt_tokens.add(u64::from(usage.prompt_tokens));
        if let Some(t) = sample.ttft_ms {
            shared.metrics.observe_ttft_ms(t);
        }
        // What the performance model learns from this job, beside its timings: why a job
        // was slow (the streams it shared the GPU with, their context, the prompts
        // prefilled during its decode) and, replayed, how a worker's fit got where it is.
        let features = perf_sample.as_ref();
        tracing::info!(
            outcome = ?outcome,
            chunks = seq,
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
        if let Some(s) = perf_sample {
            shared.perf.lock().expect("perf lock").observe(&s);
            shared.metrics.perf_samples.inc();
            shared.perf_changed.notify_one();
        }
        if matches!(ending, Ending::Done) {
            if let Some(store) = shared.ewma.clone() {
                let (worker, model) = (cfg.worker_id.clone(), job.model.clone());
                tokio::spawn(async move {
                    if let Err(e) = store.record(&worker, &model, &sample, unix_ms()).await {
                        tracing::warn!(error = %e, worker_id = %worker, "EWMA update failed; later updates will retry");
                    }
                });
            }
        }
    }
    .instrument(span)
    .await
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
/// [`FINAL_ONCE`]), retrying for [`PUBLISH_RETRY_WINDOW`]. A final result whose subject
/// already holds one (a retry after a lost acknowledgement) counts as published.
pub(crate) async fn publish_js<T: serde::Serialize>(
    shared: &Shared,
    subject: String,
    dedup: (&str, &str),
    model: &str,
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
    let headers = match metronome_protocol::headers::headers([dedup, (HEADER_MODEL, model)]) {
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
                let pause = Duration::from_millis(100 * u64::from(attempt.min(10)));
                tokio::time::sleep(pause).await;
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

/// A running job's place in the load tracker (streams decoding, prefill pending), which
/// heartbeats report: it leaves through [`Tracking::end`], or, when the job's task ends
/// any other way (a panic, the task dropped), when the guard is dropped.
struct Tracking {
    shared: Arc<Shared>,
    job_id: String,
    open: bool,
}

impl Tracking {
    fn start(shared: Arc<Shared>, job_id: &str, prompt_tokens: u32) -> Tracking {
        shared
            .load
            .lock()
            .expect("load lock")
            .started(job_id, prompt_tokens, Instant::now());
        Tracking {
            shared,
            job_id: job_id.to_string(),
            open: true,
        }
    }

    /// The job ended at `end`; with `measured` (it completed) its performance sample.
    fn end(mut self, measured: Option<&Measured>, end: Instant) -> Option<PerfSample> {
        self.open = false;
        let mut load = self.shared.load.lock().expect("load lock");
        match measured {
            Some(m) => load.finished(&self.job_id, m, end),
            None => {
                load.remove(&self.job_id, end);
                None
            }
        }
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        if self.open {
            let mut load = self.shared.load.lock().unwrap_or_else(|p| p.into_inner());
            load.remove(&self.job_id, Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurements_from_token_arrivals() {
        let start = Instant::now();
        let t = Timing {
            start,
            first_token: Some(start + Duration::from_millis(100)),
            last_token: Some(start + Duration::from_millis(500)),
        };
        let s = measure(&t, 5, start + Duration::from_millis(600));
        assert!((s.ttft_ms.unwrap() - 100.0).abs() < 1e-6);
        assert!(
            (s.tpot_ms.unwrap() - 100.0).abs() < 1e-6,
            "400 ms over 4 gaps"
        );
        assert!((s.tok_s.unwrap() - 10.0).abs() < 1e-6, "5 tokens in 0.5 s");
        assert!((s.e2e_ms.unwrap() - 600.0).abs() < 1e-6);
    }

    #[test]
    fn no_token_means_no_latency_sample() {
        let start = Instant::now();
        let t = Timing {
            start,
            first_token: None,
            last_token: None,
        };
        let s = measure(&t, 0, start + Duration::from_millis(10));
        assert_eq!((s.ttft_ms, s.tpot_ms, s.tok_s), (None, None, None));
        let t1 = Timing {
            start,
            first_token: Some(start),
            last_token: Some(start),
        };
        assert_eq!(measure(&t1, 1, start).tpot_ms, None, "one token has no gap");
    }
}
