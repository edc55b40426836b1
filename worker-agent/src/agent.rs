//! The agent's intake: its durable pull consumer on `work.<worker_id>`, the checks an
//! assignment must pass before it runs, and client cancellations.
//!
//! Invariants:
//! - The agent pulls at most `max_concurrency - running` messages at a time, so work it
//!   cannot start yet stays in JetStream, where the dispatcher can rescue it.
//! - The highest leader epoch seen only grows; an assignment with a lower epoch comes from a
//!   deposed leader and is refused (`refused` event, WORK acked: the dispatcher decides
//!   again). While draining every new assignment is refused the same way.
//! - A message that is not an assignment never stops the loop: it is logged with its
//!   reason, counted, copied to the dead-letter subject and terminated (never redelivered).
//! - Every other rule (epochs, redeliveries, revocations, the fence, when a job starts)
//!   is the job lifecycle's ([`crate::lifecycle`]): this file asks it about each delivery
//!   and performs what it answers. A held job's task ([`hold`]) owns the WORK message and
//!   performs the effects the lifecycle emits for the job later (start, refuse, terminate).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::pull::{Pulled, Puller, ANSWER_GRACE, PULL_EXPIRES};
use async_nats::jetstream::{self, consumer, kv, AckKind};
use metronome_protocol::names::{
    event_done_subject, result_final_subject, work_consumer, work_msg_id, work_subject,
    HEADER_MSG_ID, LEADER_KEY, STREAM_WORK, SUBJECT_DEAD_LETTER,
};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{
    lease_vouches_for, Assignment, CompletionEvent, CompletionOutcome, ErrorCode, FinalResult,
    JobLimits, ResultError, Usage, PROTOCOL_VERSION,
};
use metronome_runtime::retry::Pauses;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::lifecycle::{Ack, Assigned, Effect, Lease, Pull, Refusal};
use crate::runner::{publish_js, run_job, FINAL_ONCE};
use crate::shared::{now, Mailbox, Shared, Slot};

/// Errors that stop the agent (everything else is logged and survived).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("connecting to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error("NATS credentials: {0}")]
    NatsAuth(metronome_runtime::nats::NatsAuthError),
    #[error("setting up streams and buckets: {0}")]
    Setup(#[from] metronome_protocol::setup::SetupError),
    #[error("opening stream {stream}: {source}")]
    Stream {
        stream: &'static str,
        source: jetstream::context::GetStreamError,
    },
    #[error("creating the durable consumer {name}: {source}")]
    Consumer {
        name: String,
        source: jetstream::stream::ConsumerError,
    },
    #[error("subscribing to {subject}: {source}")]
    SubscribeControl {
        subject: String,
        source: async_nats::SubscribeError,
    },
    #[error("EWMA store: {0}")]
    Ewma(#[from] crate::ewma_store::EwmaError),
    #[error("model server client: {0}")]
    Model(#[from] crate::model_client::ModelError),
    #[error("binding the metrics endpoint on {addr}: {source}")]
    MetricsBind {
        addr: String,
        source: std::io::Error,
    },
}

impl AgentError {
    /// Whether starting again later may work (servers coming up) rather than needing a fix.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, AgentError::MetricsBind { .. } | AgentError::Model(_))
    }
}

/// Create (or find) the agent's durable consumer.
pub async fn ensure_consumer(
    js: &jetstream::Context,
    config: &Config,
) -> Result<consumer::Consumer<consumer::pull::Config>, AgentError> {
    let stream = js
        .get_stream(STREAM_WORK)
        .await
        .map_err(|source| AgentError::Stream {
            stream: STREAM_WORK,
            source,
        })?;
    let name = work_consumer(&config.worker_id);
    stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: work_subject(&config.worker_id),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait(),
                description: Some(format!("worker-agent {}", config.worker_id)),
                ..Default::default()
            },
        )
        .await
        .map_err(|source| AgentError::Consumer { name, source })
}

/// Pull and dispatch assignments until `stop` fires; then refuse what is still delivered
/// and return. Running jobs are left to finish (the caller drains them). Pull requests are
/// answered on one inbox ([`crate::pull`]).
pub(crate) async fn intake(shared: Arc<Shared>, mut puller: Puller, stop: CancellationToken) {
    // After a failed pull: 100 ms doubling to 2 s, jittered; back to 100 ms on a message.
    let mut pauses = Pauses::new(Duration::from_millis(100), Duration::from_secs(2));
    while !stop.is_cancelled() {
        // Subscribed before the check, so a heartbeat stored in between still wakes it.
        let mut stored = shared.stored.subscribe();
        let (pull, effects) = shared.machine(|m| m.pull(now()));
        effects.into_iter().for_each(|e| shared.perform(e));
        let free = match pull {
            Pull::Free(n) => n,
            Pull::Fenced => {
                tracing::warn!("fenced: not pulling until a heartbeat is stored");
                tokio::select! {
                    _ = stored.changed() => {}
                    _ = stop.cancelled() => break,
                }
                tracing::info!("heartbeats stored again: pulling");
                continue;
            }
            Pull::Full => {
                tokio::select! {
                    _ = shared.slot_freed.notified() => {}
                    _ = stop.cancelled() => break,
                }
                continue;
            }
        };
        if let Err(e) = puller.request(free, PULL_EXPIRES).await {
            tracing::warn!(error = %e, "pull request failed; retrying");
            tokio::select! {
                _ = tokio::time::sleep(pauses.next_pause()) => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        // Messages already requested are read to the end even after `stop`: they are
        // refused (draining), so none waits for its ack timeout. The short expiry bounds
        // how long a stop waits for the open request.
        let deadline = tokio::time::Instant::now() + PULL_EXPIRES + ANSWER_GRACE;
        let mut received = 0;
        while received < free {
            match puller.next(deadline).await {
                Pulled::Message(msg) => {
                    received += 1;
                    pauses.reset();
                    accept(&shared, *msg).await;
                }
                Pulled::Ended => break,
                Pulled::Unanswered => {
                    shared.metrics.pulls_unanswered.inc();
                    tracing::info!("a pull request got no answer by its expiry: pulling again");
                    break;
                }
                Pulled::Refused(why) => {
                    tracing::warn!(%why, "the server ended a pull request with an error; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(pauses.next_pause()) => {}
                        _ = stop.cancelled() => {}
                    }
                    break;
                }
                Pulled::Closed => {
                    tracing::warn!("the WORK inbox subscription ended: no more assignments");
                    return;
                }
            }
        }
    }
    tracing::info!("intake stopped: no new assignments will be pulled");
}

/// Check one delivered message and start it, or refuse or reject it.
async fn accept(shared: &Arc<Shared>, msg: jetstream::Message) {
    let start = Instant::now();
    let assignment: Assignment = match serde_json::from_slice(&msg.payload) {
        Ok(a) => a,
        Err(e) => return reject_malformed(shared, &msg, &e.to_string()).await,
    };
    if let Err(e) = assignment.job.validate(&JobLimits::default()) {
        // The job id is known: tell its client rather than leave it waiting.
        tracing::warn!(job_id = %assignment.job.id, error = ?e.to_string(), "assignment carries an invalid job; terminated");
        shared.metrics.malformed_assignments.inc();
        if metronome_protocol::names::is_subject_token(&assignment.job.id) {
            finish_without_running(
                shared,
                &assignment,
                CompletionOutcome::Failed,
                Some((ErrorCode::InvalidJob, e.to_string())),
                &e.to_string(),
                false,
                false,
            )
            .await;
        }
        if let Err(e) = msg.ack_with(AckKind::Term).await {
            tracing::warn!(error = %e, "terminating the WORK message failed");
        }
        return;
    }
    let job_id = assignment.job.id.clone();
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let assigned = Assigned {
        job_id: job_id.clone(),
        attempt: assignment.attempt,
        epoch: assignment.epoch,
        worker_id: assignment.worker_id.clone(),
        tenant: assignment.job.tenant.clone(),
        prompt_tokens: assignment.job.prompt_tokens,
        cached_tokens: assignment.cached_prefix.map_or(0, |c| c.tokens),
        delivered: u64::try_from(delivered).unwrap_or(1),
    };
    // One message must not raise the bar for the real leader: a new epoch counts only when
    // the lease vouches for it (`metronome_protocol::lease`).
    let lease = if shared.machine(|m| m.needs_lease(assignment.epoch)) {
        match lease_vouches(shared, assignment.epoch).await {
            Ok(()) => Lease::Vouches,
            Err(reason) => Lease::Refuses(reason),
        }
    } else {
        Lease::NotRead
    };
    let (effects, mailbox) = shared.assign(|m| m.assigned(&assigned, lease, now()));
    if let Some(mailbox) = mailbox {
        // Taken: its task waits for the lifecycle to start it.
        for effect in effects {
            if !matches!(effect, Effect::Hold { .. }) {
                shared.perform(effect);
            }
        }
        let slot = Slot::new(shared.clone(), job_id);
        tokio::spawn(hold(shared.clone(), assignment, msg, mailbox, slot, start));
        return;
    }
    let a = &assignment;
    for effect in effects {
        match effect {
            Effect::Refuse {
                why,
                reason,
                carry_job,
                ..
            } => {
                count_refusal(shared, why);
                tracing::warn!(%job_id, attempt = a.attempt, epoch = a.epoch, delivered, ?why, %reason, "assignment refused");
                refuse(shared, &msg, a, &reason, carry_job).await;
            }
            Effect::FailLost { message, .. } => {
                shared.metrics.redelivery_refusals.inc();
                tracing::warn!(%job_id, attempt = a.attempt, delivered, "redelivered assignment a previous run of this agent had started: failed as lost");
                fail_as_lost(shared, &msg, a, &message).await;
            }
            Effect::Ack { ack, .. } => acknowledge(&msg, &job_id, ack).await,
            other => shared.perform(other),
        }
    }
}

/// Count a refusal under its reason's metric.
fn count_refusal(shared: &Shared, why: Refusal) {
    let m = &shared.metrics;
    match why {
        Refusal::StaleEpoch => m.stale_epoch_refusals.inc(),
        Refusal::Unvouched => m.unvouched_epoch_refusals.inc(),
        Refusal::NotHeldRedelivery => m.redelivery_refusals.inc(),
        Refusal::OtherWorker | Refusal::Draining | Refusal::Fenced | Refusal::ShuttingDown => {}
    }
}

/// Acknowledge a WORK message as the lifecycle says.
async fn acknowledge(msg: &jetstream::Message, job_id: &str, ack: Ack) {
    let result = match ack {
        Ack::Done => msg.double_ack().await,
        Ack::Term => msg.ack_with(AckKind::Term).await,
    };
    if let Err(e) = result {
        tracing::warn!(%job_id, ?ack, error = %e, "acknowledging a WORK message failed");
    }
}

/// The task of a held job: it waits for the lifecycle to start the job (a stored heartbeat
/// listed it), refuse it (fenced meanwhile, or shutting down) or terminate it (revoked),
/// and does so. Its `slot` is released when it ends, however it ends.
async fn hold(
    shared: Arc<Shared>,
    assignment: Assignment,
    msg: jetstream::Message,
    mut mailbox: Mailbox,
    slot: Slot,
    taken: Instant,
) {
    let job_id = assignment.job.id.clone();
    while let Some(effect) = mailbox.recv().await {
        match effect {
            Effect::Start { .. } => {
                shared.metrics.report_wait.observe(taken.elapsed());
                run_job(shared.clone(), assignment, msg, mailbox).await;
                break;
            }
            Effect::Refuse { why, reason, .. } => {
                tracing::warn!(%job_id, ?why, "held job refused before it started: {reason}");
                refuse(&shared, &msg, &assignment, &reason, false).await;
                break;
            }
            Effect::Ack { ack, .. } => {
                acknowledge(&msg, &job_id, ack).await;
                break;
            }
            other => tracing::debug!(%job_id, effect = ?other, "ignored while waiting to start"),
        }
    }
    drop(slot);
}

/// Ok when the leader lease vouches for `epoch` (above every epoch this agent has seen);
/// otherwise why not. An unreadable lease vouches for nothing: refusing is safe (the
/// dispatcher decides again), believing could make the agent refuse the real leader.
async fn lease_vouches(shared: &Shared, epoch: u64) -> Result<(), String> {
    match shared.leader.entry(LEADER_KEY).await {
        Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
            if lease_vouches_for(epoch, entry.revision, &entry.value) {
                Ok(())
            } else {
                Err(format!(
                    "epoch {epoch} is above the leading term's (leader lease at revision {}): not assigned by the leader",
                    entry.revision
                ))
            }
        }
        Ok(_) => Err(format!(
            "epoch {epoch} is above every epoch seen and no dispatcher holds the leader lease"
        )),
        Err(e) => Err(format!(
            "could not read the leader lease to check epoch {epoch}: {e}"
        )),
    }
}

/// A redelivery of a job the previous run of this agent reported: it may have started and
/// streamed, so running it anywhere again could duplicate output its client already has.
/// It fails with the lost-worker error, as a dead worker's reported jobs do.
async fn fail_as_lost(shared: &Shared, msg: &jetstream::Message, a: &Assignment, message: &str) {
    finish_without_running(
        shared,
        a,
        CompletionOutcome::Failed,
        Some((ErrorCode::WorkerLost, message.to_string())),
        message,
        true,
        false,
    )
    .await;
    acknowledge(msg, &a.job.id, Ack::Done).await;
}

/// Refuse without running: the dispatcher will decide again. The refusal carries the job
/// only when the lifecycle says no run of this agent can have started it (`carry_job`):
/// a leader that does not hold the body assigns it again from that copy, and a job that
/// may have streamed must not run twice.
async fn refuse(
    shared: &Shared,
    msg: &jetstream::Message,
    a: &Assignment,
    reason: &str,
    carry_job: bool,
) {
    finish_without_running(
        shared,
        a,
        CompletionOutcome::Refused,
        None,
        reason,
        false,
        carry_job,
    )
    .await;
    acknowledge(msg, &a.job.id, Ack::Done).await;
}

/// Publish the event (and for a failure, the final result) of a job that never ran.
async fn finish_without_running(
    shared: &Shared,
    a: &Assignment,
    outcome: CompletionOutcome,
    final_error: Option<(ErrorCode, String)>,
    reason: &str,
    streamed: bool,
    carry_job: bool,
) {
    let msg_id = work_msg_id(&a.job.id, a.attempt);
    if let Some((code, message)) = final_error {
        let result = FinalResult {
            v: PROTOCOL_VERSION,
            job_id: a.job.id.clone(),
            worker_id: Some(shared.config.worker_id.clone()),
            response: None,
            error: Some(ResultError { code, message }),
            usage: Usage::default(),
            chunks: 0,
            ttft_ms: None,
            e2e_ms: None,
        };
        publish_js(
            shared,
            result_final_subject(a.job.tenant.as_deref(), &a.job.id, &shared.config.worker_id),
            FINAL_ONCE,
            &a.job.model,
            a.job.traceparent.as_deref(),
            &result,
        )
        .await;
    }
    let mut event = CompletionEvent {
        v: PROTOCOL_VERSION,
        job_id: a.job.id.clone(),
        worker_id: shared.config.worker_id.clone(),
        model: a.job.model.clone(),
        epoch: a.epoch,
        attempt: a.attempt,
        outcome,
        streamed,
        error: Some(reason.to_string()),
        prompt_tokens: a.job.prompt_tokens,
        output_tokens: 0,
        ttft_ms: None,
        tpot_ms: None,
        e2e_ms: 0.0,
        finished_ms: unix_ms(),
        // A refusal carries the job back: a leader that took over from the one that
        // assigned it holds no body, and would otherwise have to fail a job that never ran.
        job: (carry_job && outcome == CompletionOutcome::Refused).then(|| Box::new(a.job.clone())),
    };
    if event.job.is_some() && !fits_one_message(shared, &event) {
        // The Assignment fitted, but with the event's own fields the copy would not: the
        // refusal goes without it (the dispatcher then fails the job if it holds no body).
        tracing::warn!(job_id = %a.job.id, "refusal too large to carry its job: sent without it");
        event.job = None;
    }
    // A refusal must reach the dispatcher even if it repeats, so it gets its own
    // de-duplication id per outcome.
    let event_id = format!("{msg_id}:{outcome:?}");
    publish_js(
        shared,
        event_done_subject(&shared.config.worker_id),
        (HEADER_MSG_ID, &event_id),
        &a.job.model,
        a.job.traceparent.as_deref(),
        &event,
    )
    .await;
    shared.metrics.job_finished(outcome);
}

/// Whether `event` fits in one message of the NATS server this agent is connected to.
fn fits_one_message(shared: &Shared, event: &CompletionEvent) -> bool {
    serde_json::to_vec(event).is_ok_and(|body| body.len() < shared.client.server_info().max_payload)
}

/// Log, count, dead-letter and terminate a message that is not an assignment.
async fn reject_malformed(shared: &Shared, msg: &jetstream::Message, reason: &str) {
    shared.metrics.malformed_assignments.inc();
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(0);
    tracing::warn!(
        subject = %msg.subject,
        bytes = msg.payload.len(),
        delivered,
        reason,
        "malformed message on the WORK subject: terminated"
    );
    let preview: String = String::from_utf8_lossy(&msg.payload)
        .chars()
        .take(1024)
        .collect();
    let letter = json!({
        "v": PROTOCOL_VERSION,
        "source": msg.subject.to_string(),
        "worker_id": shared.config.worker_id,
        "reason": reason,
        "payload": preview,
        "at_ms": unix_ms(),
    });
    if let Err(e) = shared
        .client
        .publish(SUBJECT_DEAD_LETTER, letter.to_string().into())
        .await
    {
        tracing::warn!(error = %e, "publishing to the dead-letter subject failed");
    }
    if let Err(e) = msg.ack_with(AckKind::Term).await {
        tracing::warn!(error = %e, "terminating a malformed WORK message failed");
    }
}
