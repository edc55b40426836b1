//! Intake: the leader's durable pull consumer on JOBS, the completion events, and the
//! cancellation requests, each turned into engine events.
//!
//! On every takeover the durable consumer `dispatcher` is deleted and created again
//! (deliver all, explicit ack, long ack wait), so every job the previous leader left
//! unacknowledged is redelivered at once, in stream order. Parsing happens here, off the
//! deciding loop. A job's tenant is the one its subject names (`jobs.submit.<tenant>`, which
//! the server's permissions give only to that tenant's clients); a body naming another
//! tenant is refused (`tenant_mismatch`), a job on the version-1 `jobs.submit` too
//! (`unsupported_version`). Only on `jobs.retry`, which only dispatchers may publish, is the
//! body's tenant believed (it is the one bound at submission). A message that is not a
//! valid job never reaches the engine: it gets a rejected Decision on
//! `decisions.<subject's tenant>.<salvaged id>` (with the parse error as reason) or,
//! without a usable id, a record on `deadletter.jobs`; then it is acknowledged so it
//! never comes back.
//!
//! A job id is an idempotency key for as long as its decision is kept (DECISIONS'
//! `max_age`, a day by default): every job is checked against the DECISIONS stream before
//! it reaches the engine. The de-duplication windows of JOBS and WORK (120 s) are shorter
//! than JOBS' redelivery (300 s ack wait), and a client may submit an id again at any time
//! (after a lost PubAck, or under another msg-id), so neither window is enough: a lost ack,
//! a restart after two minutes or a late resubmission would otherwise run a job again.
//! When `decisions.<tenant>.<id>` holds a record (assigned, rejected or expired) of the same
//! or a later attempt, the job is answered with that record (see [`RejectContext::answer_of`]: the same
//! outcome, worker and attempt, `already_assigned` for an assignment), the message is
//! acknowledged once the answer is stored, and nothing is assigned. The lookup is a direct
//! get (nats-server 2.9), pipelined in stream order (64 in flight) off the deciding loop: it
//! adds no work to the engine, and a leader taking over with a backlog (what
//! `dispatch_bench` measures: its jobs are stored before the dispatcher leads) already
//! looked up every job this way. A lookup that fails lets the job through (the WORK
//! stream's msg-id still catches a recent duplicate).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use futures::StreamExt;
use metronome_protocol::names::{
    decision_subject, event_done_subject, is_subject_token, parse_cancel_subject, parse_refused_by,
    submit_subject_token, tenant_of_token, CONSUMER_DISPATCHER, CONSUMER_DISPATCHER_EVENTS,
    HEADER_ATTEMPT, HEADER_ORDER, HEADER_REFUSED_BY, STREAM_EVENTS, STREAM_JOBS,
    SUBJECT_CANCEL_ALL, SUBJECT_EVENTS_DONE_ALL, SUBJECT_JOBS_RETRY,
};
use metronome_protocol::{CompletionEvent, Decision, ErrorCode, Job, JobError, JobLimits, Outcome};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::{self, Event, Incoming};
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::DispatcherError;

/// What JOBS held when this term's consumer was created.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    /// The stream's last sequence: the messages up to it may have been seen by an
    /// earlier leader.
    pub takeover_seq: u64,
    /// Messages stored (JOBS keeps only unacknowledged ones: work-queue retention).
    pub messages: u64,
}

impl Backlog {
    /// Whether the message at `stream_seq`, delivered with `pending` more to come, is the
    /// last of the backlog or past it. The message at `takeover_seq` itself may be gone
    /// (acknowledged), so a later one, or none pending, also ends it.
    fn ends_with(&self, stream_seq: u64, pending: u64) -> bool {
        stream_seq >= self.takeover_seq || pending == 0
    }
}

/// Recreate the durable JOBS consumer so unacknowledged jobs are redelivered now. Also
/// returns what the stream held just before: the backlog this term reads first.
pub async fn recreate_jobs_consumer(
    js: &jetstream::Context,
    ack_wait: Duration,
    max_ack_pending: i64,
) -> Result<(consumer::PullConsumer, Backlog), DispatcherError> {
    let mut stream = js
        .get_stream(STREAM_JOBS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("JOBS stream: {e}")))?;
    let state = &stream
        .info()
        .await
        .map_err(|e| DispatcherError::Nats(format!("JOBS stream info: {e}")))?
        .state;
    let backlog = Backlog {
        takeover_seq: state.last_sequence,
        messages: state.messages,
    };
    // Absent on the very first start: not an error.
    let _ = stream.delete_consumer(CONSUMER_DISPATCHER).await;
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(CONSUMER_DISPATCHER.into()),
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            max_ack_pending,
            max_deliver: -1,
            ..Default::default()
        })
        .await
        .map_err(|e| DispatcherError::Nats(format!("creating the JOBS consumer: {e}")))?;
    Ok((consumer, backlog))
}

/// How the intake recognises a job that has already been decided.
pub struct SeenBefore {
    /// The DECISIONS stream, for direct gets of `decisions.<tenant>.<job_id>`.
    pub decisions: jetstream::stream::Stream,
    /// What JOBS held before this term's consumer.
    pub backlog: Backlog,
}

/// Whether a JOBS message may have been seen by this or an earlier leader: delivered
/// before, or stored before this term's consumer existed (a recreated consumer starts
/// counting deliveries from one again). Otherwise a decided job is a client's repeat.
fn redelivered(delivered: i64, stream_seq: u64, takeover_seq: u64) -> bool {
    delivered > 1 || stream_seq <= takeover_seq
}

impl SeenBefore {
    /// The latest stored decision of `job`, if any.
    async fn stored_decision(&self, job: &Job) -> Result<Option<Decision>, String> {
        match self
            .decisions
            .direct_get_last_for_subject(decision_subject(job.tenant.as_deref(), &job.id))
            .await
        {
            Ok(m) => serde_json::from_slice::<Decision>(&m.payload)
                .map(Some)
                .map_err(|e| format!("stored decision does not decode: {e}")),
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// One JOBS message, read and checked off the deciding loop.
enum Step {
    Job(Box<Incoming>),
    Malformed {
        payload: Bytes,
        error: metronome_protocol::JobError,
        /// The tenant the subject named, whose clients are told.
        tenant: Option<String>,
        acker: Arc<jetstream::message::Acker>,
        seq: u64,
    },
    AlreadyDecided {
        job_id: String,
        decision: Box<Decision>,
        acker: Arc<jetstream::message::Acker>,
        seq: u64,
        /// The same message again (not a client's repeat of the id).
        redelivered: bool,
    },
    Error(String),
}

/// One JOBS message read, and whether it ends the backlog ([`Backlog::ends_with`]).
async fn read_job(
    next: Result<jetstream::message::Message, consumer::pull::MessagesError>,
    limits: JobLimits,
    seen: Arc<SeenBefore>,
) -> (Step, bool) {
    let message = match next {
        Ok(m) => m,
        Err(error) => return (Step::Error(error.to_string()), false),
    };
    let (seq, delivered, pending) = message
        .info()
        .map(|i| (i.stream_sequence, i.delivered, i.pending))
        .unwrap_or((0, 1, 1));
    let ends_backlog = seen.backlog.ends_with(seq, pending);
    (
        check_job(message, seq, delivered, limits, &seen).await,
        ends_backlog,
    )
}

async fn check_job(
    message: jetstream::message::Message,
    seq: u64,
    delivered: i64,
    limits: JobLimits,
    seen: &SeenBefore,
) -> Step {
    let (msg, acker) = message.split();
    let acker = Arc::new(acker);
    // Retry headers are believed only on the subject only dispatchers may publish to.
    let headers = (msg.subject.as_str() == SUBJECT_JOBS_RETRY)
        .then_some(msg.headers.as_ref())
        .flatten();
    let (attempt, order) = retry_headers(headers, seq);
    let refused_by = headers
        .filter(|_| attempt > 1)
        .and_then(|h| h.get(HEADER_REFUSED_BY))
        .map(|v| parse_refused_by(v.as_str()))
        .unwrap_or_default();
    let parsed = Job::parse(&msg.payload, &limits);
    let job = match bind_tenant(msg.subject.as_str(), &msg.payload, parsed) {
        Ok(job) => job,
        Err((tenant, error)) => {
            return Step::Malformed {
                payload: msg.payload,
                error,
                tenant,
                acker,
                seq,
            }
        }
    };
    match seen.stored_decision(&job).await {
        // A decision of an earlier attempt does not settle a retry.
        Ok(Some(decision)) if decision.attempt >= attempt => {
            return Step::AlreadyDecided {
                job_id: job.id,
                decision: Box::new(decision),
                acker,
                seq,
                redelivered: redelivered(delivered, seq, seen.backlog.takeover_seq),
            }
        }
        Ok(_) => {}
        // Fail open: the WORK stream's msg-id still catches a recent duplicate.
        Err(error) => {
            tracing::warn!(job_id = %job.id, %error, "could not check for an earlier decision")
        }
    }
    Step::Job(Box::new(Incoming {
        job: Arc::new(job),
        acker: Some(acker),
        seq: order,
        received_ms: metronome_protocol::time::unix_ms(),
        attempt,
        refused_by,
    }))
}

/// The job of a JOBS message on `subject`, its tenant bound to the subject's (see the
/// module docs); refused, with the tenant whose clients are told why.
fn bind_tenant(
    subject: &str,
    payload: &[u8],
    parsed: Result<Job, JobError>,
) -> Result<Job, (Option<String>, JobError)> {
    if subject == SUBJECT_JOBS_RETRY {
        // A dispatcher wrote it: even unreadable (an older version's), its tenant is the
        // one bound at submission.
        return parsed.map_err(|e| (body_tenant(payload), e));
    }
    let Some(token) = submit_subject_token(subject) else {
        // The version-1 `jobs.submit` (or any other subject JOBS was given): no tenant.
        return Err((None, JobError::UnscopedSubject(subject.to_string())));
    };
    // A token that is no valid tenant name (only an admin could publish it): told to no
    // tenant's clients.
    let tenant = tenant_of_token(token)
        .filter(|t| metronome_protocol::check_tenant(t).is_ok())
        .map(str::to_string);
    parsed
        .and_then(|mut job| job.bind_submit_token(token).map(|()| job))
        .map_err(|e| (tenant, e))
}

/// The valid `tenant` of a body that is not a valid job, if it has one.
fn body_tenant(payload: &[u8]) -> Option<String> {
    let body = serde_json::from_slice::<serde_json::Value>(payload).ok()?;
    let tenant = body.get("tenant")?.as_str()?;
    metronome_protocol::check_tenant(tenant).ok()?;
    Some(tenant.to_string())
}

/// The attempt and queue place of a JOBS message: a client's submission is attempt 1 at
/// its own sequence; a retry the dispatcher put back on `jobs.retry` says both in headers
/// (the caller passes no headers for `jobs.submit.<tenant>`). Headers that do
/// not parse count as a client's submission (a client cannot skip attempts that way).
fn retry_headers(headers: Option<&async_nats::HeaderMap>, seq: u64) -> (u32, u64) {
    let read = |name: &str| -> Option<u64> {
        headers
            .and_then(|h| h.get(name))
            .and_then(|v| v.as_str().parse().ok())
    };
    match (read(HEADER_ATTEMPT), read(HEADER_ORDER)) {
        (Some(attempt), Some(order)) if attempt > 1 && attempt <= u64::from(u32::MAX) => {
            (attempt as u32, order.min(seq))
        }
        _ => (1, seq),
    }
}

/// Read jobs until `token` is cancelled.
pub fn spawn_jobs(
    consumer: consumer::PullConsumer,
    limits: JobLimits,
    context: RejectContext,
    seen: SeenBefore,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let seen = Arc::new(seen);
    tokio::spawn(async move {
        let messages = match consumer
            .stream()
            .max_messages_per_batch(2000)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
        {
            Ok(m) => m,
            Err(error) => {
                tracing::error!(%error, "cannot read the JOBS consumer");
                token.cancel();
                return;
            }
        };
        // The engine holds placements only when an earlier leader left jobs.
        let mut backlog_open = seen.backlog.messages > 0;
        // Lookups overlap, outcomes keep stream order.
        let mut steps = messages
            .map(|next| read_job(next, limits, seen.clone()))
            .buffered(64);
        loop {
            let next = tokio::select! {
                _ = token.cancelled() => return,
                s = steps.next() => s,
            };
            // Sent after the step's own job, so the engine has every backlog job first.
            let ends_backlog = backlog_open && next.as_ref().is_some_and(|(_, ends)| *ends);
            match next.map(|(step, _)| step) {
                Some(Step::Job(incoming)) => {
                    if tx.send(Event::Job(incoming)).await.is_err() {
                        return;
                    }
                }
                Some(Step::Malformed {
                    payload,
                    error,
                    tenant,
                    acker,
                    seq,
                }) => context.reject_malformed(&payload, &error, tenant, Some(acker), seq),
                Some(Step::AlreadyDecided {
                    job_id,
                    decision,
                    acker,
                    seq,
                    redelivered,
                }) => {
                    let counter = if redelivered {
                        &context.metrics.redelivered_already_decided_total
                    } else {
                        &context.metrics.repeated_job_ids_total
                    };
                    counter.fetch_add(1, Relaxed);
                    tracing::info!(
                        job_id,
                        stream_seq = seq,
                        redelivered,
                        outcome = ?decision.outcome,
                        attempt = decision.attempt,
                        epoch = decision.epoch,
                        "job id already has a decision: answered with it, not assigned again"
                    );
                    context.publisher.send(engine::Outcome::DecisionOnly {
                        decision: Box::new(context.answer_of(*decision)),
                        acker: Some(acker),
                    });
                }
                Some(Step::Error(error)) => tracing::warn!(%error, "JOBS consumer error"),
                None => {
                    tracing::error!("JOBS consumer ended");
                    token.cancel();
                    return;
                }
            }
            if ends_backlog {
                backlog_open = false;
                if tx.send(Event::BacklogRead).await.is_err() {
                    return;
                }
            }
        }
    })
}

/// What a rejection of a malformed message needs.
#[derive(Clone)]
pub struct RejectContext {
    pub publisher: Publisher,
    pub metrics: Arc<Metrics>,
    pub dispatcher_id: String,
    pub epoch: u64,
    pub policy: String,
}

impl RejectContext {
    /// The answer to a job whose id already has `stored` as its decision: the same outcome,
    /// attempt and worker (a client takes results from the worker its last decision
    /// names), with a reason saying the id was decided before; an assignment is
    /// `already_assigned`, a rejection keeps its code (the client's error class). Recorded
    /// by this leader, under the stored record's msg-id (`<job>:<attempt>`): while
    /// DECISIONS remembers that id only the live feed shows the answer.
    pub fn answer_of(&self, stored: Decision) -> Decision {
        answer_of(stored, self.epoch, &self.dispatcher_id)
    }

    /// Reject a message that is not a valid job, with the parse error as reason.
    pub fn reject_malformed(
        &self,
        body: &[u8],
        error: &metronome_protocol::JobError,
        tenant: Option<String>,
        acker: Option<Arc<jetstream::message::Acker>>,
        seq: u64,
    ) {
        self.metrics.malformed_jobs_total.fetch_add(1, Relaxed);
        let salvaged = if body.len() <= 16 * 1024 * 1024 {
            Job::salvage_id(body)
        } else {
            None
        };
        // `?`: the error echoes the client's bytes (serde quotes unknown variants), and a
        // CR/LF or NUL written raw would forge or break log lines.
        tracing::warn!(stream_seq = seq, job_id = ?salvaged, code = error.code(), error = ?error.to_string(), "rejected a malformed job");
        match salvaged {
            Some(job_id) => {
                let model = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
                let decision = Decision {
                    v: metronome_protocol::DECISION_VERSION,
                    job_id,
                    model,
                    outcome: Outcome::Rejected,
                    attempt: 1,
                    reason: Some(error.to_string()),
                    reason_code: Some(error.code().to_string()),
                    worker_id: None,
                    cost: None,
                    scoring: None,
                    candidates: Vec::new(),
                    rejected: Vec::new(),
                    slo: None,
                    policy: self.policy.clone(),
                    queue_wait_ms: 0,
                    retry_after_ms: None,
                    affinity: None,
                    decision_latency_us: 0,
                    epoch: self.epoch,
                    dispatcher_id: self.dispatcher_id.clone(),
                    decided_ms: metronome_protocol::time::unix_ms(),
                    tenant,
                    priority: None,
                    fair_counter: None,
                };
                self.publisher.send(engine::Outcome::Reject {
                    decision: Box::new(decision),
                    error: ErrorCode::InvalidJob,
                    message: error.to_string(),
                    acker,
                });
            }
            None => {
                let record = serde_json::json!({
                    "v": metronome_protocol::PROTOCOL_VERSION,
                    "stream_seq": seq,
                    "size_bytes": body.len(),
                    "reason_code": error.code(),
                    "reason": error.to_string(),
                    "dispatcher_id": self.dispatcher_id,
                    "body_prefix": String::from_utf8_lossy(&body[..body.len().min(256)]),
                });
                self.publisher.send(engine::Outcome::DeadLetter {
                    body: Bytes::from(record.to_string()),
                    acker,
                });
            }
        }
    }
}

/// See [`RejectContext::answer_of`].
fn answer_of(stored: Decision, epoch: u64, dispatcher_id: &str) -> Decision {
    const PREFIX: &str = "job id already decided";
    let mut d = stored;
    // An answer to an earlier repeat already says so.
    if !d.reason.as_deref().is_some_and(|r| r.starts_with(PREFIX)) {
        let what = match (d.outcome, d.worker_id.as_deref()) {
            (Outcome::Assigned, Some(w)) => format!("assigned to {w}"),
            (Outcome::Assigned, None) => "assigned".to_string(),
            (Outcome::Rejected, _) => "rejected".to_string(),
            (Outcome::Expired, _) => "expired".to_string(),
        };
        let attempt = d.attempt;
        d.reason = Some(match d.reason.take() {
            Some(why) => {
                format!("{PREFIX} ({what} at attempt {attempt}: {why}): not run again")
            }
            None => format!("{PREFIX} ({what} at attempt {attempt}): not run again"),
        });
    }
    if d.outcome == Outcome::Assigned {
        d.reason_code = Some("already_assigned".into());
    }
    d.epoch = epoch;
    d.dispatcher_id = dispatcher_id.to_string();
    d.decided_ms = metronome_protocol::time::unix_ms();
    d
}

/// Open the completion-event reader (before the registry is loaded, so no completion that
/// happens after the load is missed), then forward events until `token`.
///
/// The reader is a durable consumer shared by every leader: a completion or refusal
/// published while no leader runs (failover, redeploy) waits in it for the next one,
/// instead of being skipped by a reader that starts at "new". It is created with
/// `DeliverPolicy::New` the first time only (older history belongs to no running job), and
/// reused after. Each event is acknowledged once handled; a refusal once its retry is back
/// in JOBS, so a leader that dies in between leaves the refusal to its successor.
pub async fn spawn_completions(
    js: &jetstream::Context,
    tx: mpsc::Sender<Event>,
    metrics: Arc<Metrics>,
    token: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, DispatcherError> {
    let stream = js
        .get_stream(STREAM_EVENTS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS stream: {e}")))?;
    let durable = stream
        .get_or_create_consumer(
            CONSUMER_DISPATCHER_EVENTS,
            consumer::pull::Config {
                durable_name: Some(CONSUMER_DISPATCHER_EVENTS.into()),
                filter_subject: SUBJECT_EVENTS_DONE_ALL.into(),
                deliver_policy: consumer::DeliverPolicy::New,
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                max_deliver: -1,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS consumer: {e}")))?;
    let decisions = js
        .get_stream_no_info(metronome_protocol::names::STREAM_DECISIONS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("DECISIONS: {e}")))?;
    let mut messages = durable
        .stream()
        .max_messages_per_batch(1000)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS consumer: {e}")))?;
    Ok(tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = token.cancelled() => return,
                m = messages.next() => m,
            };
            let message = match next {
                Some(Ok(m)) => m,
                Some(Err(error)) => {
                    tracing::warn!(%error, "EVENTS consumer error");
                    continue;
                }
                None => {
                    tracing::error!("EVENTS consumer ended");
                    token.cancel();
                    return;
                }
            };
            let (message, acker) = message.split();
            let acker = Arc::new(acker);
            match serde_json::from_slice::<CompletionEvent>(&message.payload) {
                Ok(mut event) => match untrusted_event(&event, message.subject.as_str()) {
                    None => {
                        if event.job.is_some() {
                            vouch_refused_job(&decisions, &mut event, &metrics).await;
                        }
                        let event = Event::Completion {
                            event: Box::new(event),
                            acker: Some(acker),
                        };
                        if tx.send(event).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Some(reason) => {
                        metrics.ignored_worker_messages_total.fetch_add(1, Relaxed);
                        tracing::warn!(subject = %message.subject, reason, "completion event ignored");
                    }
                },
                Err(error) => {
                    metrics.ignored_worker_messages_total.fetch_add(1, Relaxed);
                    tracing::warn!(subject = %message.subject, error = ?error.to_string(), "malformed completion event ignored")
                }
            }
            // Ignored for good: not redelivered.
            let _ = acker.ack().await;
        }
    }))
}

/// Why a completion event cannot be trusted, if it cannot: its ids must be subject tokens
/// and its worker must be the one whose subject it came on.
fn untrusted_event(event: &CompletionEvent, subject: &str) -> Option<&'static str> {
    if !is_subject_token(&event.job_id) {
        return Some("job id is not a subject token");
    }
    if !is_subject_token(&event.worker_id) {
        return Some("worker id is not a subject token");
    }
    if subject != event_done_subject(&event.worker_id) {
        return Some("worker id differs from the subject's worker");
    }
    None
}

/// Keep a refusal's carried job only when the decision on record assigned this attempt
/// of this job to the refusing worker, for the tenant and model the copy names: a worker
/// can then hand back only a job it was given (whose output it controls anyway), never
/// submit one of its own under someone else's tenant. Anything else drops the copy (the
/// refusal itself still counts).
async fn vouch_refused_job(
    decisions: &jetstream::stream::Stream<()>,
    event: &mut CompletionEvent,
    metrics: &Metrics,
) {
    let Some(job) = event.job.take() else { return };
    let why_not = if event.outcome != metronome_protocol::CompletionOutcome::Refused {
        Some("only a refusal carries its job".to_string())
    } else if job.id != event.job_id || job.model != event.model {
        Some("the carried job is not the refused one".to_string())
    } else {
        match crate::registry::assigned_to(decisions, &event.job_id).await {
            Ok(Some(record))
                if record.worker_id == event.worker_id
                    && record.attempt == event.attempt
                    && record.tenant == job.tenant
                    && record.model.as_deref() == Some(job.model.as_str()) =>
            {
                None
            }
            Ok(Some(_)) => Some(
                "the decision on record assigns another worker, attempt, tenant or model".into(),
            ),
            Ok(None) => Some("no assignment of the job on record".into()),
            Err(error) => Some(format!("the decision on record could not be read: {error}")),
        }
    };
    match why_not {
        None => event.job = Some(job),
        Some(reason) => {
            metrics.unvouched_refusal_jobs_total.fetch_add(1, Relaxed);
            tracing::warn!(job_id = %event.job_id, worker_id = %event.worker_id, attempt = event.attempt, reason, "a refusal's carried job is not believed: dropped");
        }
    }
}

/// Forward `cancel.<tenant>.<job_id>` requests until `token`. The tenant travels with the
/// job id: the engine cancels a job only for its own tenant (a client may name any job id
/// under its tenant's subject).
pub async fn spawn_cancels(
    client: &async_nats::Client,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, DispatcherError> {
    let mut sub = client
        .subscribe(SUBJECT_CANCEL_ALL)
        .await
        .map_err(|e| DispatcherError::Nats(format!("subscribing to cancellations: {e}")))?;
    Ok(tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = token.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(message) = next else { break };
            let Some((tenant, job_id)) = parse_cancel_subject(message.subject.as_str()) else {
                continue;
            };
            let event = Event::Cancel {
                tenant: tenant_of_token(tenant).map(str::to_string),
                job_id: job_id.to_string(),
            };
            if tx.send(event).await.is_err() {
                break;
            }
        }
        let _ = sub.unsubscribe().await;
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::CompletionOutcome;

    fn event(job_id: &str, worker_id: &str) -> CompletionEvent {
        CompletionEvent {
            v: 1,
            job_id: job_id.into(),
            worker_id: worker_id.into(),
            model: "m".into(),
            epoch: 1,
            attempt: 1,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: 1,
            output_tokens: 1,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: 1.0,
            finished_ms: 1,
            job: None,
        }
    }

    #[test]
    fn the_subject_binds_the_tenant_and_refusals_go_to_the_subjects_tenant() {
        let body = |tenant: Option<&str>, v: u32| {
            let mut j = serde_json::json!({"v": v, "id": "j1", "model": "m", "endpoint": "chat",
                "request": {}, "prompt_tokens": 1, "max_tokens": 1, "submitted_ms": 1});
            if let Some(t) = tenant {
                j["tenant"] = t.into();
            }
            serde_json::to_vec(&j).unwrap()
        };
        let bind = |subject: &str, payload: Vec<u8>| {
            let parsed = Job::parse(&payload, &JobLimits::default());
            bind_tenant(subject, &payload, parsed)
        };
        let v = metronome_protocol::PROTOCOL_VERSION;
        let job = bind("jobs.submit.acme", body(None, v)).unwrap();
        assert_eq!(job.tenant.as_deref(), Some("acme"));
        assert_eq!(
            bind("jobs.submit._anon", body(None, v)).unwrap().tenant,
            None
        );
        // A retry keeps the tenant bound at submission.
        let job = bind(SUBJECT_JOBS_RETRY, body(Some("acme"), v)).unwrap();
        assert_eq!(job.tenant.as_deref(), Some("acme"));
        let refused = |subject: &str, payload| {
            let (tenant, error) = bind(subject, payload).unwrap_err();
            (tenant, error.code())
        };
        assert_eq!(
            refused("jobs.submit.acme", body(Some("other"), v)),
            (Some("acme".to_string()), "tenant_mismatch")
        );
        assert_eq!(
            refused("jobs.submit", body(Some("acme"), v)),
            (None, "unsupported_version"),
            "the version-1 subject: the body's tenant is not believed"
        );
        assert_eq!(
            refused("jobs.submit.acme", body(None, 1)),
            (Some("acme".to_string()), "unsupported_version")
        );
        assert_eq!(
            refused(SUBJECT_JOBS_RETRY, body(Some("acme"), 1)),
            (Some("acme".to_string()), "unsupported_version")
        );
    }

    #[test]
    fn completion_events_need_token_ids_and_their_own_subject() {
        assert_eq!(untrusted_event(&event("j1", "w1"), "events.done.w1"), None);
        assert!(untrusted_event(&event("j.1", "w1"), "events.done.w1").is_some());
        assert!(untrusted_event(&event("j1", "w.1"), "events.done.w").is_some());
        assert!(untrusted_event(&event("j1", "victim"), "events.done.w1").is_some());
    }

    #[test]
    fn a_repeated_id_is_answered_with_its_stored_outcome() {
        let stored = |outcome, worker: Option<&str>, code: Option<&str>, reason: Option<&str>| {
            let mut d: Decision = serde_json::from_value(serde_json::json!({
                "v": 3, "job_id": "j1", "outcome": outcome, "attempt": 2, "policy": "metronome",
                "queue_wait_ms": 0, "decision_latency_us": 1, "epoch": 1,
                "dispatcher_id": "then", "decided_ms": 1
            }))
            .unwrap();
            d.worker_id = worker.map(String::from);
            d.reason_code = code.map(String::from);
            d.reason = reason.map(String::from);
            d
        };
        let a = answer_of(stored("assigned", Some("w1"), None, None), 9, "now");
        assert_eq!(
            (a.outcome, a.attempt, a.worker_id.as_deref()),
            (Outcome::Assigned, 2, Some("w1"))
        );
        assert_eq!(a.reason_code.as_deref(), Some("already_assigned"));
        assert_eq!(
            a.reason.as_deref(),
            Some("job id already decided (assigned to w1 at attempt 2): not run again")
        );
        assert_eq!((a.epoch, a.dispatcher_id.as_str()), (9, "now"));
        // Answered again: the reason does not grow.
        assert_eq!(answer_of(a.clone(), 9, "now").reason, a.reason);
        let r = answer_of(
            stored("rejected", None, Some("queue_full"), Some("no room")),
            9,
            "now",
        );
        assert_eq!(r.outcome, Outcome::Rejected);
        assert_eq!(
            r.reason_code.as_deref(),
            Some("queue_full"),
            "its error class"
        );
        assert_eq!(
            r.reason.as_deref(),
            Some("job id already decided (rejected at attempt 2: no room): not run again")
        );
    }

    #[test]
    fn redelivered_or_pre_takeover_jobs_count_as_redelivered() {
        assert!(redelivered(2, 100, 10), "redelivered in this term");
        assert!(redelivered(1, 10, 10), "stored before the takeover");
        assert!(!redelivered(1, 11, 10), "new in this term, first delivery");
    }
}
