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
//! - A job is in `in_flight` from the moment it is accepted until its event is published;
//!   heartbeats list exactly these ids.
//! - No job runs twice because of this agent:
//!   - a redelivered assignment of a job the previous run reported fails as lost
//!     (whichever leader assigned it: checked before the epoch);
//!   - one it does not hold otherwise (it restarted, or the delivery never reached a
//!     runner) is refused back to the dispatcher rather than run;
//!   - only a refusal of a first delivery carries the job (a leader that does not hold
//!     the body assigns it again from that copy, so the copy must be of a job no run of
//!     this agent started);
//!   - a job starts only once a stored heartbeat lists it, and never if the agent was
//!     fenced (see [`crate::fence`]) between taking and reporting it;
//!   - a job the leader revoked (it declared this worker dead and settled the job, or
//!     assigned again what its purge removed) stops without a result or an event.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::pull::{Pulled, Puller, ANSWER_GRACE, PULL_EXPIRES};
use async_nats::jetstream::{self, consumer, kv, AckKind};
use metronome_protocol::names::{
    event_done_subject, result_final_subject, tenant_token, work_consumer, work_msg_id,
    work_subject, HEADER_MSG_ID, LEADER_KEY, STREAM_WORK, SUBJECT_DEAD_LETTER,
};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{
    lease_vouches_for, Assignment, CompletionEvent, CompletionOutcome, ErrorCode, FinalResult,
    JobLimits, ResultError, Usage, PROTOCOL_VERSION,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::runner::{publish_js, run_job, FINAL_ONCE};
use crate::shared::{Held, InFlight, Shared};

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
    let max = shared.config.max_concurrency as usize;
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        if shared.fence.check(tokio::time::Instant::now()).fenced {
            tracing::warn!("fenced: not pulling until a heartbeat is stored");
            tokio::select! {
                _ = shared.fence.wait_lowered() => {}
                _ = stop.cancelled() => break,
            }
            tracing::info!("heartbeats stored again: pulling");
            continue;
        }
        let free = max.saturating_sub(shared.running());
        if free == 0 {
            tokio::select! {
                _ = shared.slot_freed.notified() => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        if let Err(e) = puller.request(free, PULL_EXPIRES).await {
            tracing::warn!(error = %e, "pull request failed; retrying");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.cancelled() => break,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
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
                    backoff = Duration::from_millis(100);
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
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.cancelled() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
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
    if assignment.worker_id != shared.config.worker_id {
        tracing::warn!(%job_id, assigned_to = %assignment.worker_id, "assignment names another worker; refused");
        return refuse(shared, &msg, &assignment, "assignment names another worker").await;
    }
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    if delivered > 1 && shared.reported_before_restart.contains(&job_id) && !shared.holds(&job_id) {
        // Checked before the epoch: a deposed leader's Assignment of a job the previous
        // run reported must not come back as a refusal either, since a refusal may be
        // assigned again and would run the job a second time.
        return fail_as_lost(shared, &msg, &assignment, delivered).await;
    }
    let known = shared.max_epoch.load(Ordering::SeqCst);
    if assignment.epoch > known {
        // One message must not raise the bar for the real leader: a new epoch counts only
        // when the lease vouches for it (`metronome_protocol::lease`).
        if let Err(reason) = lease_vouches(shared, assignment.epoch).await {
            shared.metrics.unvouched_epoch_refusals.inc();
            tracing::warn!(%job_id, epoch = assignment.epoch, highest_epoch = known, reason, "assignment epoch not vouched for by the leader lease: refused");
            return refuse(shared, &msg, &assignment, &reason).await;
        }
    }
    let seen = shared
        .max_epoch
        .fetch_max(assignment.epoch, Ordering::SeqCst);
    if assignment.epoch < seen {
        shared.metrics.stale_epoch_refusals.inc();
        tracing::warn!(%job_id, epoch = assignment.epoch, highest_epoch = seen, "stale epoch: assignment from a deposed leader refused");
        let reason = format!(
            "stale epoch {} (highest seen {seen}): assigned by a deposed leader",
            assignment.epoch
        );
        return refuse(shared, &msg, &assignment, &reason).await;
    }
    if shared.draining.load(Ordering::SeqCst) {
        tracing::info!(%job_id, "draining: assignment refused");
        return refuse(shared, &msg, &assignment, "worker is draining").await;
    }
    let cancel = CancellationToken::new();
    let revoke = CancellationToken::new();
    let lost = CancellationToken::new();
    let revoked = shared.was_revoked(&job_id, assignment.attempt);
    let ended = shared
        .ended
        .lock()
        .expect("ended lock")
        .iter()
        .any(|(id, a)| *id == job_id && *a == assignment.attempt);
    let taken = {
        let mut map = shared.in_flight.lock().expect("in_flight lock");
        if map.contains_key(&job_id) {
            Taken::AlreadyHeld
        } else if revoked {
            Taken::Revoked
        } else if ended {
            Taken::AlreadyEnded
        } else if delivered > 1 {
            Taken::NotHeldRedelivery
        } else {
            map.insert(
                job_id.clone(),
                Held {
                    cancel: cancel.clone(),
                    tenant: assignment.job.tenant.clone(),
                    revoke: revoke.clone(),
                    lost: lost.clone(),
                    started: std::sync::atomic::AtomicBool::new(false),
                    attempt: assignment.attempt,
                    prompt_tokens: assignment.job.prompt_tokens,
                },
            );
            shared.metrics.running_jobs.set(map.len() as u64);
            Taken::Accepted
        }
    };
    match taken {
        Taken::Accepted => {}
        Taken::Revoked => {
            // The leader gave this attempt away before the agent read it.
            shared.metrics.revoked_jobs.inc();
            tracing::warn!(%job_id, attempt = assignment.attempt, "assignment already revoked by the leader: not started");
            if let Err(e) = msg.ack_with(AckKind::Term).await {
                tracing::warn!(%job_id, error = %e, "terminating a revoked WORK message failed");
            }
            return;
        }
        Taken::AlreadyEnded => {
            tracing::info!(%job_id, attempt = assignment.attempt, delivered, "redelivery of an attempt that already ended: acknowledged");
            if let Err(e) = msg.double_ack().await {
                tracing::warn!(%job_id, error = %e, "acknowledging an ended redelivery failed");
            }
            return;
        }
        Taken::AlreadyHeld => {
            // A redelivery of a job this agent is already running: the running copy acks it.
            tracing::info!(%job_id, "redelivery of a running job ignored");
            return;
        }
        Taken::NotHeldRedelivery => {
            // Delivered before, not held and never reported: an earlier run of this agent
            // took it but never started it before a restart, or the delivery was lost on
            // the way. Running it now could still run it twice (the dispatcher may have
            // moved it); the dispatcher decides again.
            shared.metrics.redelivery_refusals.inc();
            tracing::warn!(%job_id, attempt = assignment.attempt, delivered, "redelivered assignment this agent does not hold: refused");
            let reason = format!(
                "redelivered assignment (delivery {delivered}) that worker {} does not hold: it restarted or never started it",
                shared.config.worker_id
            );
            return refuse(shared, &msg, &assignment, &reason).await;
        }
    }
    // Leaves `in_flight` when the task below ends, however it ends.
    let slot = InFlight::new(shared.clone(), job_id.clone(), assignment.attempt);
    let generation = shared.accepted_generation.fetch_add(1, Ordering::SeqCst) + 1;
    // Taken while fenced (read from a pull made before the fence rose, or on waking from a
    // stop): it counts as taken before the episode, so it is refused, not started, when
    // the next heartbeat reports it.
    let fence = shared.fence.check(tokio::time::Instant::now());
    let episodes = fence.episodes - u64::from(fence.fenced);
    let shared = shared.clone();
    tokio::spawn(async move {
        match wait_until_reported(&shared, generation, episodes, &revoke).await {
            Reported::Start => {
                shared.metrics.report_wait.observe(start.elapsed());
                if let Some(held) = shared
                    .in_flight
                    .lock()
                    .expect("in_flight lock")
                    .get(&job_id)
                {
                    held.started.store(true, Ordering::SeqCst);
                }
                run_job(shared.clone(), assignment, msg, cancel, revoke, lost, start).await
            }
            Reported::Fenced => {
                tracing::warn!(%job_id, "the agent was fenced before the job was reported: refused");
                let reason = "the worker's heartbeats were not stored before the job was reported; it may have been given to another worker";
                refuse(&shared, &msg, &assignment, reason).await;
            }
            Reported::Revoked => {
                shared.metrics.revoked_jobs.inc();
                if let Err(e) = msg.ack_with(AckKind::Term).await {
                    tracing::warn!(%job_id, error = %e, "terminating a revoked WORK message failed");
                }
            }
            Reported::Aborted => {
                tracing::warn!(%job_id, "shutting down before the job was reported: refused");
                refuse(
                    &shared,
                    &msg,
                    &assignment,
                    "the worker-agent shut down before starting the job",
                )
                .await;
            }
        }
        drop(slot);
    });
}

/// What the intake did with a delivered assignment.
enum Taken {
    Accepted,
    Revoked,
    AlreadyEnded,
    AlreadyHeld,
    NotHeldRedelivery,
}

/// What became of a job waiting for the heartbeat that reports it.
#[derive(Debug, PartialEq, Eq)]
enum Reported {
    /// A stored heartbeat lists it and the agent was not fenced meanwhile: run it.
    Start,
    /// The agent was fenced between taking and reporting it: refuse it.
    Fenced,
    /// The leader revoked it.
    Revoked,
    /// The drain timeout passed first.
    Aborted,
}

/// Start a job only once a stored heartbeat lists it. The dispatcher re-dispatches the
/// jobs of a dead worker that it never saw reported, so a job must not produce a token
/// before it is reported: otherwise a crash right after the first tokens would run it
/// twice and duplicate its output. There is no time limit: a job never starts unreported
/// (heartbeats that keep failing fence the agent, and the job is refused once they are
/// stored again). One heartbeat covers every job accepted before it, so under load many
/// jobs share one put.
async fn wait_until_reported(
    shared: &Shared,
    generation: u64,
    episodes_at_accept: u64,
    revoke: &CancellationToken,
) -> Reported {
    let mut reported = shared.reported_generation.subscribe();
    shared.heartbeat_now.notify_one();
    tokio::select! {
        r = reported.wait_for(|g| *g >= generation) => {
            if r.is_err() {
                return Reported::Aborted;
            }
        }
        _ = revoke.cancelled() => return Reported::Revoked,
        _ = shared.abort.cancelled() => return Reported::Aborted,
    }
    // The heartbeat loop records the store in the fence before it publishes the
    // generation, so a gap that ended with this very store is already counted.
    if shared.fence.check(tokio::time::Instant::now()).episodes != episodes_at_accept {
        return Reported::Fenced;
    }
    Reported::Start
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
async fn fail_as_lost(shared: &Shared, msg: &jetstream::Message, a: &Assignment, delivered: i64) {
    let job_id = &a.job.id;
    shared.metrics.redelivery_refusals.inc();
    tracing::warn!(%job_id, attempt = a.attempt, delivered, "redelivered assignment a previous run of this agent had started: failed as lost");
    let message = format!(
        "worker {} restarted while holding the job; it is not run again so no output is duplicated",
        shared.config.worker_id
    );
    finish_without_running(
        shared,
        a,
        CompletionOutcome::Failed,
        Some((ErrorCode::WorkerLost, message.clone())),
        &message,
        true,
        false,
    )
    .await;
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(%job_id, error = %e, "acknowledging a lost redelivery failed");
    }
}

/// Refuse without running: the dispatcher will decide again. The refusal carries the job
/// only when no run of this agent can have started it (its first delivery, not held): a
/// leader that does not hold the body assigns it again from that copy, and a job that may
/// have streamed must not run twice.
async fn refuse(shared: &Shared, msg: &jetstream::Message, a: &Assignment, reason: &str) {
    let first_delivery = msg.info().is_ok_and(|i| i.delivered == 1);
    let carry_job = first_delivery && !shared.holds(&a.job.id);
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
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(job_id = %a.job.id, error = %e, "acknowledging a refused assignment failed");
    }
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

/// A client's cancel of `job_id` naming tenant token `tenant`, relayed by the leader on
/// `control.<worker_id>.cancel` (workers hear no `cancel.*.*`): stop the job if this agent
/// holds it. A client may publish only under its own tenant but may name any job id, so a
/// cancel naming another tenant than the held job's is ignored (and counted).
pub(crate) fn cancel_held(shared: &Shared, tenant: &str, job_id: &str) {
    let held = shared
        .in_flight
        .lock()
        .expect("in_flight lock")
        .get(job_id)
        .map(|h| (h.cancel.clone(), h.tenant.clone()));
    let Some((cancel, job_tenant)) = held else {
        tracing::debug!(%job_id, "cancel of a job not held here");
        return;
    };
    if tenant_token(job_tenant.as_deref()) != tenant {
        shared.metrics.cancels_of_another_tenant.inc();
        tracing::warn!(%job_id, cancel_tenant = tenant, job_tenant = tenant_token(job_tenant.as_deref()), "ignoring a cancel that names another tenant than the job's");
        return;
    }
    tracing::info!(%job_id, "cancellation requested: stopping generation");
    cancel.cancel();
}
