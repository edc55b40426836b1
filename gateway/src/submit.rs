//! Submitting one job and following it to its outcome.
//!
//! Order matters: the gateway subscribes to `results.<tenant>.<id>.>` and
//! `decisions.<tenant>.<id>` *before* publishing the job on `jobs.submit.<tenant>` (the
//! tenant of the API key, which the dispatcher takes from the subject), on the same connection, so no chunk, final result
//! or decision can be published before the subscriptions exist. The job is published
//! through JetStream with `Nats-Msg-Id` = job id (a retried publish is de-duplicated) and
//! the `Metronome-Model` header; a failed or unacknowledged publish is a 503.
//!
//! Whose results are relayed: a result's subject names its publisher
//! (`results.<tenant>.<id>.<worker>.…`, which the servers let only that worker write, or
//! `…._dispatcher.final`, only dispatchers). The leader's are relayed as they come; a
//! worker's only once a decision on `decisions.<tenant>.<id>` (only dispatchers write
//! those) assigned the job to it, so a worker that does not hold the job cannot answer it.
//! A worker may stream before its decision reaches the gateway (the assignment is
//! published first), so results of a worker no decision has named yet are held, in
//! arrival order and bounded, and relayed when one does; if none arrives, the stored
//! decision is read once in a while ([`DECISION_LOOKUP`]) in case the live one was missed.
//! Held results still unnamed when the job ends are dropped and counted.
//!
//! Invariants: a job whose client goes away before its final result is cancelled on
//! `cancel.<tenant>.<id>` (the [`CancelGuard`] publishes when dropped while armed); a job
//! with a final result, or one the dispatcher refused, is never cancelled. Messages that
//! cannot be read are logged with their reason, counted, and skipped; they never fail the
//! request on their own. Waiting is bounded by the job's deadline plus the generation
//! allowance.

use std::collections::VecDeque;

use async_nats::{Client, Subscriber};
use bytes::Bytes;
use futures::StreamExt;
use metronome_protocol::names::{
    cancel_subject, decision_subject, parse_result_subject, results_subject_all, submit_subject,
    ResultKind, HEADER_MODEL, HEADER_MSG_ID, HEADER_TRACEPARENT, STREAM_DECISIONS,
};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{
    Decision, ErrorCode, FinalResult, Job, Outcome, PrefixFingerprint, ResultChunk, ResultError,
    PROTOCOL_VERSION,
};
use serde_json::json;
use tokio::time::Instant;

use crate::error::ApiError;

/// How long a refusal in a decision waits for the final result that the dispatcher
/// publishes right after it (the final result's error class is authoritative).
const REFUSAL_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long results of a worker no decision has named wait before the stored decision is
/// read (and again as long as they wait): the live decision normally comes first or
/// within milliseconds, so this only matters when the gateway missed it.
const DECISION_LOOKUP: std::time::Duration = std::time::Duration::from_secs(1);
/// At most this many results of workers no decision has named are held per job, and at
/// most `held_results_max_bytes` of them (the config's); beyond either they are dropped
/// (and counted): only a worker that does not hold the job sends that much before its
/// decision.
const MAX_HELD: usize = 4096;
use crate::openai::InferenceRequest;
use crate::AppState;

/// Whether JetStream refused the publish because JOBS is at its limits: a store refusal
/// (max messages, max bytes) or the server out of storage. The stream discards new
/// messages when full (`setup::ensure_all`), so the refusal comes at once and the jobs
/// already queued stay.
fn stream_full(error: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    std::error::Error::source(error)
        .and_then(|e| e.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|e| {
            [
                ErrorCode::STREAM_STORE_FAILED,
                ErrorCode::STORAGE_RESOURCES_EXCEEDED,
                ErrorCode::INSUFFICIENT_RESOURCES,
            ]
            .contains(&e.error_code())
        })
}

/// A new job id: a UUID v7 (time-ordered, so ids sort by submission), hyphenated, which
/// is a valid subject token.
pub fn new_job_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// The job for `request`, submitted for `tenant`.
pub fn build_job(
    id: &str,
    request: &InferenceRequest,
    tenant: &str,
    now_ms: u64,
    deadline_ms: u64,
) -> Job {
    Job {
        v: PROTOCOL_VERSION,
        id: id.to_string(),
        model: request.model.clone(),
        endpoint: request.endpoint,
        request: request.body.clone(),
        prompt_tokens: request.prompt_tokens,
        max_tokens: request.total_max_tokens(),
        submitted_ms: now_ms,
        deadline_ms: Some(deadline_ms),
        slo: None,
        tenant: Some(tenant.to_string()),
        priority: None,
        // The prompt's cached-prefix fingerprint, from the body as forwarded (a batched
        // completion has no single prefix and gets none).
        prefix: PrefixFingerprint::of_request(request.endpoint, &request.body),
        traceparent: None,
    }
}

/// Publishes a cancellation for its job when dropped while armed.
pub struct CancelGuard {
    client: Client,
    /// The job's tenant (the API key's): the cancel names it, and the dispatcher and the
    /// agent act only on a cancel naming the job's own tenant.
    tenant: Option<String>,
    job_id: String,
    state: AppState,
    armed: bool,
}

impl CancelGuard {
    /// The job reached its end: nothing to cancel.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(job_id = %self.job_id, "cannot cancel the job: no runtime");
            return;
        };
        let client = self.client.clone();
        let job_id = std::mem::take(&mut self.job_id);
        let subject = cancel_subject(self.tenant.as_deref(), &job_id);
        self.state.metrics.job_cancelled();
        runtime.spawn(async move {
            let payload = json!({
                "v": PROTOCOL_VERSION,
                "job_id": job_id,
                "reason": "client_disconnected",
                "sent_ms": unix_ms(),
            });
            let payload = Bytes::from(payload.to_string());
            match client.publish(subject, payload).await {
                Ok(()) => {
                    let _ = client.flush().await;
                    tracing::info!(%job_id, "client went away; job cancelled");
                }
                Err(error) => tracing::warn!(%job_id, %error, "cannot publish the cancellation"),
            }
        });
    }
}

/// Something that happened to a submitted job.
#[derive(Debug)]
pub enum JobEvent {
    /// The dispatcher assigned it to this worker.
    Assigned(String),
    /// A streamed chunk.
    Chunk(ResultChunk),
    /// The final result (success or failure).
    Final(FinalResult),
}

/// A submitted job being followed.
pub struct Submission {
    pub job_id: String,
    /// Worker that runs the job, once a decision named it (the latest attempt's).
    pub worker_id: Option<String>,
    /// The attempt of the decision that named [`Submission::worker_id`].
    assigned_attempt: u32,
    tenant: Option<String>,
    results: Subscriber,
    decisions: Subscriber,
    /// Results of workers no decision has named (yet), with their publisher and their
    /// message's size, in arrival order.
    held: VecDeque<(String, JobEvent, usize)>,
    /// Bytes of the messages in `held`.
    held_bytes: usize,
    /// When to read the stored decision for the held results.
    lookup_at: Option<Instant>,
    cancel: CancelGuard,
    /// Events read ahead (while waiting for the worker before the response headers).
    replay: VecDeque<JobEvent>,
    give_up_at: Instant,
    /// A refusal read from the decision, returned if no final result follows it within
    /// [`REFUSAL_GRACE`].
    refused: Option<(ApiError, Instant)>,
    started: Instant,
    state: AppState,
}

impl Submission {
    /// Subscribe to the job's subjects, then publish it.
    pub async fn submit(state: &AppState, job: &Job) -> Result<Submission, ApiError> {
        let retry = state.config.retry_after_secs;
        let client = state.client.clone();
        if client.connection_state() != async_nats::connection::State::Connected {
            state.metrics.nats_publish_error();
            return Err(ApiError::nats_unavailable("not connected to NATS", retry));
        }
        let subscribe = |subject: String| {
            let client = client.clone();
            async move {
                client.subscribe(subject).await.map_err(|error| {
                    state.metrics.nats_publish_error();
                    ApiError::nats_unavailable(format!("cannot subscribe: {error}"), retry)
                })
            }
        };
        let tenant = job.tenant.as_deref();
        let results = subscribe(results_subject_all(tenant, &job.id)).await?;
        let decisions = subscribe(decision_subject(tenant, &job.id)).await?;
        let payload = serde_json::to_vec(job)
            .map_err(|e| ApiError::internal(format!("cannot encode the job: {e}")))?;
        let headers = metronome_protocol::headers::headers(
            [
                (HEADER_MSG_ID, job.id.as_str()),
                (HEADER_MODEL, job.model.as_str()),
            ]
            .into_iter()
            .chain(
                job.traceparent
                    .as_deref()
                    .map(|tp| (HEADER_TRACEPARENT, tp)),
            ),
        )
        .map_err(|e| ApiError::invalid_field("model", e.to_string()))?;
        let publish = async {
            state
                .js
                .publish_with_headers(submit_subject(tenant), headers, payload.into())
                .await?
                .await
        };
        match tokio::time::timeout(state.config.publish_timeout(), publish).await {
            Ok(Ok(ack)) => {
                state.metrics.job_submitted();
                tracing::debug!(job_id = %job.id, stream_seq = ack.sequence, duplicate = ack.duplicate, "job submitted");
            }
            Ok(Err(error)) => {
                state.metrics.nats_publish_error();
                tracing::warn!(job_id = %job.id, kind = ?error.kind(), %error, "publishing the job failed");
                return Err(match error.kind() {
                    async_nats::jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                        ApiError::job_too_large(state.client.server_info().max_payload)
                    }
                    _ if stream_full(&error) => ApiError::jobs_stream_full(&error, retry),
                    _ => ApiError::nats_unavailable(
                        format!("publishing the job failed: {error}"),
                        retry,
                    ),
                });
            }
            Err(_) => {
                state.metrics.nats_publish_error();
                tracing::warn!(job_id = %job.id, "JetStream did not acknowledge the job in time");
                return Err(ApiError::nats_unavailable(
                    "JetStream did not acknowledge the job in time",
                    retry,
                ));
            }
        }
        let now_ms = unix_ms();
        let until_deadline = job.deadline_ms.unwrap_or(now_ms).saturating_sub(now_ms);
        let started = Instant::now();
        Ok(Submission {
            job_id: job.id.clone(),
            worker_id: None,
            assigned_attempt: 0,
            tenant: job.tenant.clone(),
            results,
            decisions,
            held: VecDeque::new(),
            held_bytes: 0,
            lookup_at: None,
            cancel: CancelGuard {
                client,
                tenant: job.tenant.clone(),
                job_id: job.id.clone(),
                state: state.clone(),
                armed: true,
            },
            replay: VecDeque::new(),
            give_up_at: started
                + std::time::Duration::from_millis(until_deadline)
                + state.config.max_generation(),
            refused: None,
            started,
            state: state.clone(),
        })
    }

    /// The job ended (final result or refusal): leaving now cancels nothing.
    pub fn finished(&mut self) {
        self.cancel.disarm();
    }

    /// Chunks were missing when the final result arrived.
    /// The stream's out-of-order chunks outgrew `reorder_max_bytes` (the stream ends).
    pub fn reorder_overflow(&self) {
        self.state.metrics.reorder_overflow();
    }

    /// The bound on the bytes of chunks held ahead of a missing one.
    pub fn reorder_max_bytes(&self) -> usize {
        self.state.config.reorder_max_bytes
    }

    pub fn stream_gap(&self, missing: u64) {
        self.state.metrics.stream_gap(missing);
        tracing::warn!(job_id = %self.job_id, missing, "streamed chunks missing at the final result");
    }

    /// Put an event back, to be returned first by [`Submission::next_event`] (before held
    /// results released by a decision, which follow it in their order).
    pub fn replay(&mut self, event: JobEvent) {
        self.replay.push_front(event);
    }

    /// The next event of the job. A refusal by the dispatcher, a lost connection or the
    /// time limit end the job with the error to return. A refusal read from a decision
    /// waits up to [`REFUSAL_GRACE`] for the final result the dispatcher publishes after
    /// it, whose error class wins; without one the decision's reason code decides.
    pub async fn next_event(&mut self) -> Result<JobEvent, ApiError> {
        if let Some(event) = self.replay.pop_front() {
            return Ok(event);
        }
        loop {
            let wake_at = match &self.refused {
                Some((_, at)) => (*at).min(self.give_up_at),
                None => self.give_up_at,
            };
            let lookup_at = self.lookup_at.unwrap_or(self.give_up_at);
            tokio::select! {
                message = self.results.next() => {
                    let Some(message) = message else {
                        return Err(self.lost_subscription());
                    };
                    let Some((publisher, event)) = self.read_result(&message) else {
                        continue;
                    };
                    if publisher.is_none() || publisher == self.worker_id {
                        return Ok(event);
                    }
                    self.hold(publisher.unwrap_or_default(), event, message.payload.len());
                }
                message = self.decisions.next() => {
                    let Some(message) = message else {
                        return Err(self.lost_subscription());
                    };
                    let decision = match serde_json::from_slice::<Decision>(&message.payload) {
                        Ok(d) => d,
                        Err(error) => {
                            self.state.metrics.malformed_message("decisions");
                            tracing::warn!(job_id = %self.job_id, %error, "ignoring a malformed decision");
                            continue;
                        }
                    };
                    if let Some(event) = self.on_decision(decision) {
                        return Ok(event);
                    }
                    if let Some(event) = self.replay.pop_front() {
                        return Ok(event);
                    }
                }
                _ = tokio::time::sleep_until(lookup_at), if self.lookup_at.is_some() => {
                    let stored = self.stored_decision().await;
                    // Again later while results still wait (the decision may not be stored
                    // yet); a decision that releases them all stops it.
                    self.lookup_at = Some(Instant::now() + DECISION_LOOKUP);
                    // Only an assignment: a refusal comes live, with the leader's final
                    // result, and applying it again would restart its grace.
                    if let Some(decision) = stored.filter(|d| d.outcome == Outcome::Assigned) {
                        if let Some(event) = self.on_decision(decision) {
                            return Ok(event);
                        }
                        if let Some(event) = self.replay.pop_front() {
                            return Ok(event);
                        }
                    }
                }
                _ = tokio::time::sleep_until(wake_at) => {
                    if let Some((error, _)) = self.refused.take() {
                        return Err(error);
                    }
                    // The guard stays armed: the abandoned job is cancelled.
                    tracing::warn!(job_id = %self.job_id, "no final result in time");
                    return Err(ApiError::gateway_timeout(self.started.elapsed().as_millis() as u64));
                }
            }
        }
    }

    /// Hold a result of `publisher`, which no decision has given the job (yet).
    fn hold(&mut self, publisher: String, event: JobEvent, bytes: usize) {
        if self.held.len() >= MAX_HELD
            || self.held_bytes.saturating_add(bytes) > self.state.config.held_results_max_bytes
        {
            self.state.metrics.unattributed_results("not_assigned", 1);
            return;
        }
        tracing::debug!(job_id = %self.job_id, %publisher, "holding a result until a decision names its worker");
        self.held.push_back((publisher, event, bytes));
        self.held_bytes += bytes;
        self.lookup_at
            .get_or_insert_with(|| Instant::now() + DECISION_LOOKUP);
    }

    /// Apply a decision: an assignment (of this attempt or a later one) makes its worker
    /// the one whose results are relayed, and releases that worker's held results into the
    /// replay queue; a refusal is remembered ([`REFUSAL_GRACE`]). Returns the event to
    /// report, if any.
    fn on_decision(&mut self, decision: Decision) -> Option<JobEvent> {
        if decision.job_id != self.job_id {
            return None;
        }
        match self.read_decision(&decision)? {
            Ok(worker) => {
                if decision.attempt < self.assigned_attempt {
                    // An earlier attempt's record, read late: the later one stands.
                    return None;
                }
                let known = self.worker_id.as_deref() == Some(worker.as_str())
                    && decision.attempt == self.assigned_attempt;
                self.assigned_attempt = decision.attempt;
                self.worker_id = Some(worker.clone());
                let (released, rest): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(publisher, _, _)| *publisher == worker);
                self.held = rest;
                self.held_bytes = self.held.iter().map(|(_, _, bytes)| bytes).sum();
                self.replay.extend(released.into_iter().map(|(_, e, _)| e));
                if self.held.is_empty() {
                    self.lookup_at = None;
                }
                (!known).then_some(JobEvent::Assigned(worker))
            }
            Err(error) => {
                // The job is over for the dispatcher: nothing left to cancel.
                self.finished();
                self.refused = Some((error, Instant::now() + REFUSAL_GRACE));
                None
            }
        }
    }

    /// The job's latest stored decision, for held results whose live decision may have been
    /// missed.
    async fn stored_decision(&self) -> Option<Decision> {
        let subject = decision_subject(self.tenant.as_deref(), &self.job_id);
        let stream = self
            .state
            .js
            .get_stream_no_info(STREAM_DECISIONS)
            .await
            .ok()?;
        let message = stream.direct_get_last_for_subject(subject).await.ok()?;
        serde_json::from_slice(&message.payload).ok()
    }

    fn lost_subscription(&self) -> ApiError {
        ApiError::nats_unavailable(
            "the NATS connection closed while waiting for the result",
            self.state.config.retry_after_secs,
        )
    }

    /// A result message and its publisher: `None` for the leader (relayed as it comes),
    /// else the worker its subject names. `None` for a message that cannot be read or whose
    /// body names another worker than its subject (counted).
    fn read_result(&self, message: &async_nats::Message) -> Option<(Option<String>, JobEvent)> {
        let subject = message.subject.as_str();
        let Some(parts) = parse_result_subject(subject).filter(|p| p.job_id == self.job_id) else {
            self.state.metrics.malformed_message("results");
            tracing::warn!(job_id = %self.job_id, %subject, "ignoring a result on an unexpected subject");
            return None;
        };
        let parsed = match parts.kind {
            ResultKind::Chunk => {
                serde_json::from_slice::<ResultChunk>(&message.payload).map(JobEvent::Chunk)
            }
            ResultKind::Final => {
                serde_json::from_slice::<FinalResult>(&message.payload).map(JobEvent::Final)
            }
        };
        let event = match parsed {
            Ok(event) => event,
            Err(error) => {
                self.state.metrics.malformed_message("results");
                tracing::warn!(job_id = %self.job_id, %subject, %error, "ignoring a malformed result message");
                return None;
            }
        };
        if parts.from_dispatcher() {
            return Some((None, event));
        }
        // The subject is the server's word for who wrote it; the body must agree, since the
        // relay tells runs apart by the body's worker.
        let claimed = match &event {
            JobEvent::Chunk(c) => Some(c.worker_id.as_str()),
            JobEvent::Final(f) => f.worker_id.as_deref(),
            JobEvent::Assigned(_) => None,
        };
        if claimed != Some(parts.publisher) {
            self.state.metrics.unattributed_results("body_mismatch", 1);
            tracing::warn!(job_id = %self.job_id, %subject, claimed = ?claimed, "ignoring a result whose body names another worker than its subject");
            return None;
        }
        Some((Some(parts.publisher.to_string()), event))
    }

    /// `Some(Ok(worker))` for an assignment, `Some(Err)` for a refusal, `None` for
    /// anything to skip (an assignment that names no worker: an earlier leader's stands).
    fn read_decision(&self, decision: &Decision) -> Option<Result<String, ApiError>> {
        match decision.outcome {
            Outcome::Assigned => decision.worker_id.clone().map(Ok),
            Outcome::Rejected | Outcome::Expired => {
                let error = refusal(decision);
                tracing::info!(job_id = %self.job_id, code = ?error.code, reason = %error.message, "dispatcher refused the job");
                Some(Err(refusal_response(
                    decision,
                    &error,
                    self.state.config.retry_after_secs,
                )))
            }
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let publishers: std::collections::BTreeSet<&str> =
            self.held.iter().map(|(p, _, _)| p.as_str()).collect();
        self.state
            .metrics
            .unattributed_results("not_assigned", self.held.len() as u64);
        tracing::warn!(job_id = %self.job_id, held = self.held.len(), ?publishers, assigned = ?self.worker_id, "dropped results of workers no decision gave the job to");
    }
}

/// Whole seconds for a `Retry-After` from the dispatcher's predicted wait: rounded up, at
/// least 1 (a client told "retry after 0 s" retries at once into the same queue).
pub fn retry_after_secs(retry_after_ms: u64) -> u64 {
    retry_after_ms.div_ceil(1_000).max(1)
}

/// The HTTP answer to a refused or expired job: its error class's status and body, with a
/// `Retry-After` from the dispatcher's predicted wait when it gave one. A job refused
/// because its deadline cannot be met is told so (`code: "deadline_unmeetable"`), not
/// "queue full": the queue had room, the wait did not fit the job's deadline.
pub fn refusal_response(
    decision: &Decision,
    error: &ResultError,
    default_retry_secs: u64,
) -> ApiError {
    let retry = decision
        .retry_after_ms
        .map_or(default_retry_secs, retry_after_secs);
    let response = ApiError::from_result_error(error, retry);
    match decision.reason_code.as_deref() {
        Some("deadline_unmeetable") => response.with_code("deadline_unmeetable"),
        _ => response,
    }
}

/// The error class of a refused or expired job, from its decision.
pub fn refusal(decision: &Decision) -> ResultError {
    let code = match (decision.outcome, decision.reason_code.as_deref()) {
        (Outcome::Expired, _) => ErrorCode::DeadlineExceeded,
        (_, Some("queue_full" | "deadline_unmeetable")) => ErrorCode::QueueFull,
        (_, Some("unknown_model")) => ErrorCode::UnknownModel,
        (_, Some("cancelled")) => ErrorCode::Cancelled,
        (_, Some("max_attempts")) => ErrorCode::WorkerFailed,
        (_, Some("deadline_exceeded" | "expired" | "no_capacity")) => ErrorCode::DeadlineExceeded,
        (
            _,
            Some(
                "malformed_job"
                | "job_too_large"
                | "unsupported_version"
                | "bad_job_id"
                | "empty_model"
                | "zero_max_tokens"
                | "too_many_tokens"
                | "request_not_object"
                | "model_control_char"
                | "model_too_long"
                | "bad_slo"
                | "bad_tenant"
                | "bad_traceparent"
                | "unplaceable",
            ),
        ) => ErrorCode::InvalidJob,
        // A refusal the gateway does not know: no capacity is the safe reading (retryable).
        _ => ErrorCode::DeadlineExceeded,
    };
    let message = decision
        .reason
        .clone()
        .unwrap_or_else(|| format!("the dispatcher refused the job ({:?})", decision.outcome));
    ResultError { code, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use metronome_protocol::names::is_subject_token;

    fn decision(outcome: Outcome, code: Option<&str>) -> Decision {
        Decision {
            v: 1,
            job_id: "j".into(),
            model: Some("m".into()),
            outcome,
            attempt: 1,
            reason: Some("why".into()),
            reason_code: code.map(String::from),
            worker_id: None,
            cost: None,
            scoring: None,
            candidates: vec![],
            rejected: vec![],
            slo: None,
            policy: "metronome".into(),
            queue_wait_ms: 0,
            retry_after_ms: None,
            affinity: None,
            decision_latency_us: 0,
            epoch: 1,
            dispatcher_id: "d".into(),
            decided_ms: 0,
            tenant: None,
            priority: None,
            fair_counter: None,
        }
    }

    #[test]
    fn an_unmeetable_deadline_is_answered_429_deadline_unmeetable_with_the_predicted_wait() {
        let mut d = decision(Outcome::Rejected, Some("deadline_unmeetable"));
        d.retry_after_ms = Some(2_500);
        let answer = refusal_response(&d, &refusal(&d), 7);
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(answer.code, Some("deadline_unmeetable"));
        assert_eq!(answer.retry_after_secs, Some(3));

        let full = decision(Outcome::Rejected, Some("queue_full"));
        let answer = refusal_response(&full, &refusal(&full), 7);
        assert_eq!(answer.code, Some("queue_full"));
        assert_eq!(
            answer.retry_after_secs,
            Some(7),
            "no prediction: the configured default"
        );
    }

    #[test]
    fn job_ids_are_subject_tokens_and_time_ordered() {
        let a = new_job_id();
        let b = new_job_id();
        assert!(is_subject_token(&a) && is_subject_token(&b));
        assert!(a < b);
    }

    #[test]
    fn refusals_map_to_error_classes() {
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("queue_full"))).code,
            ErrorCode::QueueFull
        );
        assert_eq!(
            refusal(&decision(Outcome::Expired, None)).code,
            ErrorCode::DeadlineExceeded
        );
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("unknown_model"))).code,
            ErrorCode::UnknownModel
        );
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("malformed_job"))).code,
            ErrorCode::InvalidJob
        );
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("something_new"))).code,
            ErrorCode::DeadlineExceeded
        );
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("max_attempts"))).code,
            ErrorCode::WorkerFailed
        );
        assert_eq!(refusal(&decision(Outcome::Rejected, None)).message, "why");
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("deadline_unmeetable"))).code,
            ErrorCode::QueueFull,
            "an unmeetable deadline is a 429: the client may retry later"
        );
        assert_eq!(
            refusal(&decision(Outcome::Rejected, Some("unplaceable"))).code,
            ErrorCode::InvalidJob,
            "a job no worker can ever hold is the client's to change"
        );
    }

    #[test]
    fn retry_after_rounds_the_predicted_wait_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000), 1);
        assert_eq!(retry_after_secs(1_001), 2);
        assert_eq!(retry_after_secs(42_500), 43);
    }
}
