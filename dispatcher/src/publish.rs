//! Publishing the outcome of decisions, pipelined after the in-memory commit.
//!
//! The deciding loop hands each committed outcome to one publisher task and moves on; the publisher writes messages in commit order (one buffered
//! write each, no round trip) and a spawned tail awaits each job's acknowledgements:
//!
//! - assigned: [`metronome_protocol::Assignment`] on `work.<worker>` (`Nats-Msg-Id` = job:attempt, epoch,
//!   model and `traceparent` headers, the last naming the decision's span,
//!   [`crate::trace_spans`]) → PubAck → acknowledge the JOBS message → Decision on
//!   `decisions.<job>` (`Nats-Msg-Id` = job:attempt).
//! - a failed Assignment publish (a NATS error, or a header that cannot be written) is
//!   reported back ([`Event::PublishFailed`]) so the engine rolls the reservation back and
//!   puts the job back at its place with the next attempt (or rejects it after
//!   `max_attempts`); nothing else happens.
//! - headers are built with [`metronome_protocol::headers::headers`], which reports a bad
//!   value instead of panicking: nothing taken from a message can stop this task.
//! - a PubAck flagged `duplicate` means an earlier leader already sent this attempt: the
//!   engine drops the reservation ([`Event::AlreadyAssigned`]); the JOBS message is still
//!   acknowledged and the Decision still published (its own msg-id drops it if the
//!   earlier leader's record exists).
//! - rejected/expired: Decision, then the `FinalResult` with the error on
//!   `results.<tenant>.<job>._dispatcher.final` (so a waiting client learns why), then the
//!   JOBS ack.
//!
//! - a dead worker's purge ([`Outcome::PurgeWork`]) removes only what was on its WORK
//!   subject when the purge was handled: the stream's last sequence is read, and the purge
//!   is bounded below it, before any later outcome is written. A worker that comes back is
//!   assigned new work only after that, so the purge can never delete it. What it removes
//!   is read first and handed to the engine ([`Event::PurgedAssignments`]): an Assignment
//!   an earlier leader wrote, which the worker never reported, is the only copy of its job.
//!
//! Back-pressure: outcomes not yet settled (written and acknowledged, or failed) are
//! counted (a guard per outcome leaves the count when whichever task settles it ends); the deciding loop waits in [`Publisher::ready`] while `capacity` are pending,
//! which stops it reading new events, and so the intake, when NATS is slower than the
//! decisions.
//!
//! Invariant: a JOBS message is acknowledged only after the outcome that settles it is
//! stored, so a crash in between leads to a redelivery (deduplicated), never to a loss.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, context::PublishAckFuture, kv};
use bytes::Bytes;
use metronome_protocol::headers::headers;
use metronome_protocol::names::{
    self, HEADER_EPOCH, HEADER_MODEL, HEADER_MSG_ID, HEADER_TRACEPARENT,
};
use metronome_protocol::{Assignment, Decision, ErrorCode, FinalResult, ResultError, Usage};
use metronome_runtime::retry::Pauses;
use tokio::sync::{mpsc, Notify};

use crate::engine::{Event, Outcome, WorkerUpdate};
use crate::metrics::Metrics;
use crate::queue::QueuedJob;

/// Outcomes handed over and not yet settled, with a wake-up for [`Publisher::ready`].
#[derive(Default)]
struct Pending {
    count: AtomicUsize,
    settled: Notify,
}

impl Pending {
    fn fetch_add(&self, n: usize, order: Ordering) -> usize {
        self.count.fetch_add(n, order)
    }

    fn fetch_sub(&self, n: usize, order: Ordering) -> usize {
        let before = self.count.fetch_sub(n, order);
        self.settled.notify_waiters();
        before
    }

    fn load(&self, order: Ordering) -> usize {
        self.count.load(order)
    }
}

/// One outcome handed over and not yet settled: dropped once it is (stored and
/// acknowledged, failed, or the task settling it gone), it leaves the count.
struct Unsettled(Arc<Pending>);

impl Drop for Unsettled {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Cheap handle the engine and intake send outcomes through.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Outcome>,
    in_flight: Arc<Pending>,
    capacity: usize,
}

/// Outcomes pending before the deciding loop stops taking new events.
pub const DEFAULT_CAPACITY: usize = 65_536;

impl Publisher {
    /// Start the publisher task; events (rollbacks) go back to the engine on `events`.
    /// The task's handle is for the term's supervisor ([`crate::supervise`]).
    pub fn start(
        js: jetstream::Context,
        client: async_nats::Client,
        workers: kv::Store,
        events: mpsc::Sender<Event>,
        metrics: Arc<Metrics>,
        capacity: usize,
    ) -> (Publisher, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let in_flight = Arc::new(Pending::default());
        let handle = tokio::spawn(publish_loop(
            rx,
            js,
            client,
            workers,
            events,
            metrics,
            in_flight.clone(),
        ));
        (
            Publisher {
                tx,
                in_flight,
                capacity: capacity.max(1),
            },
            handle,
        )
    }

    pub fn send(&self, outcome: Outcome) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(outcome).is_err() {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                "publisher stopped: outcome dropped (its JOBS message will be redelivered)"
            );
        }
    }

    /// Outcomes handed over and not yet settled.
    pub fn pending(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Wait until fewer than `capacity` outcomes are pending. The engine calls this before
    /// it takes the next event: the channel is unbounded only so that one event's outcomes
    /// (a dispatch pass may assign a whole queue) never block the deciding loop midway.
    pub async fn ready(&self) {
        loop {
            let settled = self.in_flight.settled.notified();
            if self.pending() < self.capacity {
                return;
            }
            settled.await;
        }
    }

    /// Wait (bounded) until every outcome sent so far has been published or failed.
    pub async fn drain(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.in_flight.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn publish_loop(
    mut rx: mpsc::UnboundedReceiver<Outcome>,
    js: jetstream::Context,
    client: async_nats::Client,
    workers: kv::Store,
    events: mpsc::Sender<Event>,
    metrics: Arc<Metrics>,
    in_flight: Arc<Pending>,
) {
    while let Some(outcome) = rx.recv().await {
        // Leaves the count when this outcome is settled, in whichever task settles it.
        let unsettled = Unsettled(in_flight.clone());
        match outcome {
            Outcome::Assign {
                job,
                worker_id,
                epoch,
                decision,
            } => {
                let assignment = AssignmentRef {
                    v: metronome_protocol::PROTOCOL_VERSION,
                    job: &job.job,
                    worker_id: &worker_id,
                    epoch,
                    attempt: job.attempt,
                    assigned_ms: decision.decided_ms,
                    cached_prefix: decision
                        .candidate_on(&worker_id)
                        .and_then(|c| c.cached_prefix),
                };
                let payload = Bytes::from(serde_json::to_vec(&assignment).unwrap_or_default());
                let msg_id = names::work_msg_id(&job.job.id, job.attempt);
                let epoch_text = epoch.to_string();
                let trace = crate::trace_spans::assignment_spans(&job.job, &worker_id, &decision);
                tracing::debug!(
                    job_id = %job.job.id,
                    trace_id = trace.map(|t| t.trace_id()).as_deref(),
                    worker_id,
                    attempt = job.attempt,
                    predicted_ttft_ms = crate::trace_spans::predicted_ttft_ms(&decision, &worker_id),
                    queue_wait_ms = decision.queue_wait_ms,
                    "job assigned"
                );
                let trace_text = trace.map(|t| t.to_string());
                // A header that cannot be written fails this publish like a NATS error
                // would (rolled back, counted as an attempt), never the publisher task.
                let (work, resend) = match headers(
                    [
                        (HEADER_MSG_ID, msg_id.as_str()),
                        (HEADER_EPOCH, epoch_text.as_str()),
                        (HEADER_MODEL, job.job.model.as_str()),
                    ]
                    .into_iter()
                    .chain(trace_text.as_deref().map(|tp| (HEADER_TRACEPARENT, tp))),
                ) {
                    Ok(h) => {
                        let msg = PublishMessage::build().payload(payload).headers(h);
                        let subject = names::work_subject(&worker_id);
                        let sent = js.send_publish(subject.clone(), msg.clone()).await;
                        (sent.map_err(|e| e.to_string()), Some((subject, msg)))
                    }
                    Err(e) => (Err(e.to_string()), None),
                };
                let decision_js = js.clone();
                let events = events.clone();
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    // Whether a failed publish may have been stored: only "no stream
                    // answered" says for sure that it was not.
                    let first = match work {
                        Ok(fut) => fut.await.map_err(|e| (may_be_stored(&e), e.to_string())),
                        Err(e) => Err((false, e)),
                    };
                    let acked = match (first, resend) {
                        (Ok(ack), _) => Ok(ack),
                        (Err((maybe, error)), Some((subject, msg))) => {
                            republish_through_election(&decision_js, subject, msg, error, maybe)
                                .await
                        }
                        (Err((_, error)), None) => Err(error),
                    };
                    let mut decision = decision;
                    match acked {
                        Err(error) => {
                            metrics
                                .publish_failures_total
                                .fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(job_id = %job.job.id, worker_id, %error, "assignment publish failed: rolling back");
                            let _ = events
                                .send(Event::PublishFailed {
                                    job: Box::new(job),
                                    worker_id,
                                })
                                .await;
                            drop(unsettled);
                            return;
                        }
                        Ok(ack) if ack.duplicate => {
                            metrics
                                .duplicate_assignments_total
                                .fetch_add(1, Ordering::Relaxed);
                            tracing::info!(job_id = %job.job.id, attempt = job.attempt, "attempt already sent by an earlier leader");
                            decision.reason = Some("this attempt was already assigned by an earlier leader; its WORK message stands".into());
                            decision.reason_code = Some("already_assigned".into());
                            decision.worker_id = None;
                            let _ = events
                                .send(Event::AlreadyAssigned {
                                    job_id: job.job.id.to_string(),
                                    worker_id,
                                })
                                .await;
                        }
                        Ok(_) => {}
                    }
                    // The decision is stored before the JOBS message is acknowledged: a leader
                    // killed in between leaves the job to be redelivered and recognised as
                    // decided, never a job that runs without a decision on record.
                    publish_decision(&decision_js, &decision).await;
                    if let Some(acker) = &job.acker {
                        if let Err(error) = acker.ack().await {
                            tracing::warn!(job_id = %job.job.id, %error, "acknowledging the JOBS message failed");
                        }
                    }
                    metrics
                        .decisions_assigned_total
                        .fetch_add(1, Ordering::Relaxed);
                    drop(unsettled);
                });
            }
            Outcome::Reject {
                decision,
                error,
                message,
                acker,
            } => {
                let d = publish_decision_start(&js, &decision).await;
                let f = publish_final_start(
                    &js,
                    decision.tenant.as_deref(),
                    &decision.job_id,
                    None,
                    error,
                    &message,
                )
                .await;
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    finish(d, "decision").await;
                    finish_final(f).await;
                    if let Some(acker) = acker {
                        let _ = acker.ack().await;
                    }
                    match decision.outcome {
                        metronome_protocol::Outcome::Expired => &metrics.decisions_expired_total,
                        _ => &metrics.decisions_rejected_total,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                    drop(unsettled);
                });
            }
            Outcome::DecisionOnly { decision, acker } => {
                let d = publish_decision_start(&js, &decision).await;
                tokio::spawn(async move {
                    finish(d, "decision").await;
                    if let Some(acker) = acker {
                        let _ = acker.ack().await;
                    }
                    drop(unsettled);
                });
            }
            Outcome::ExpireWorker {
                worker_id,
                revision,
            } => {
                let workers = workers.clone();
                let events = events.clone();
                tokio::spawn(async move {
                    expire_worker(&workers, &events, &worker_id, revision).await;
                    drop(unsettled);
                });
            }
            Outcome::PurgeWork { worker_id } => {
                // Inline, not spawned: no later outcome (a new Assignment to this worker once
                // it is back) is written before the bound is read and the purge is done.
                match purge_pending_work(&js, &worker_id).await {
                    Ok(purged) => {
                        tracing::info!(
                            worker_id,
                            purged = purged.removed,
                            below_seq = purged.below,
                            read = purged.assignments.len(),
                            "removed the dead worker's pending assignments"
                        );
                        // The engine hands back those it does not hold otherwise.
                        let event = Event::PurgedAssignments {
                            worker_id,
                            assignments: purged.assignments,
                        };
                        let _ = events.send(event).await;
                    }
                    Err(error) => {
                        tracing::warn!(worker_id, %error, "could not purge the dead worker's assignments")
                    }
                }
                drop(unsettled);
            }
            Outcome::Requeue {
                job,
                event,
                refused_by,
            } => {
                let started = requeue_start(&js, &job, &refused_by).await;
                let events = events.clone();
                tokio::spawn(async move {
                    let stored = match started {
                        Ok(fut) => fut.await.map(|_| ()).map_err(|e| e.to_string()),
                        Err(e) => Err(e),
                    };
                    match stored {
                        Ok(()) => {
                            tracing::info!(job_id = %job.job.id, attempt = job.attempt, "retry put back on jobs.retry");
                            if let Some(event) = event {
                                if let Err(error) = event.ack().await {
                                    tracing::warn!(job_id = %job.job.id, %error, "acknowledging the refusal failed");
                                }
                            }
                        }
                        Err(error) => {
                            tracing::warn!(job_id = %job.job.id, %error, "could not put the retry back on jobs.retry: it waits in memory");
                            let _ = events.send(Event::RequeueFailed { job }).await;
                        }
                    }
                    drop(unsettled);
                });
            }
            Outcome::RelayCancel {
                worker_id,
                tenant,
                job_id,
            } => {
                let body = metronome_protocol::RelayedCancel {
                    v: metronome_protocol::PROTOCOL_VERSION,
                    tenant: names::tenant_token(tenant.as_deref()).to_string(),
                    job_id: job_id.clone(),
                };
                let subject = names::control_subject(&worker_id, names::CONTROL_CANCEL);
                let body = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
                if let Err(error) = client.publish(subject, body).await {
                    tracing::warn!(job_id, %error, "relaying a cancel failed");
                }
                drop(unsettled);
            }
            Outcome::DeadLetter { body, acker } => {
                if let Err(error) = client.publish(names::SUBJECT_DEAD_LETTER, body).await {
                    tracing::warn!(%error, "dead-letter publish failed");
                }
                if let Some(acker) = acker {
                    let _ = acker.ack().await;
                }
                drop(unsettled);
            }
            Outcome::Revoke { worker_id, revoke } => {
                let subject = names::control_subject(&worker_id, names::CONTROL_REVOKE);
                let body = Bytes::from(serde_json::to_vec(&revoke).unwrap_or_default());
                if let Err(error) = client.publish(subject, body).await {
                    tracing::warn!(worker_id, %error, "could not revoke the dead worker's jobs");
                }
                drop(unsettled);
            }
            Outcome::FinalError {
                job_id,
                worker_id,
                error,
                message,
            } => {
                let js = js.clone();
                // Off the publishing loop: the tenant is looked up first.
                tokio::spawn(async move {
                    match tenant_of_decided(&js, &job_id).await {
                        Ok(tenant) => {
                            let f = publish_final_start(
                                &js,
                                tenant.as_deref(),
                                &job_id,
                                worker_id,
                                error,
                                &message,
                            )
                            .await;
                            finish_final(f).await;
                        }
                        Err(reason) => tracing::warn!(
                            job_id,
                            %reason,
                            "no final error result: the job's tenant is unknown"
                        ),
                    }
                    drop(unsettled);
                });
            }
        }
    }
}

/// See [`Outcome::ExpireWorker`].
async fn expire_worker(
    store: &kv::Store,
    events: &mpsc::Sender<Event>,
    worker_id: &str,
    revision: u64,
) {
    let Err(error) = store
        .delete_expect_revision(worker_id, Some(revision))
        .await
    else {
        return;
    };
    // Refused: either a newer heartbeat was stored (the watch brings it), or the key is no
    // longer there at all.
    match store.entry(worker_id).await {
        Ok(Some(entry)) if entry.revision > revision => tracing::info!(
            worker_id,
            revision = entry.revision,
            "the worker's key changed (a newer heartbeat) before it could be declared dead"
        ),
        Ok(Some(_)) => {
            tracing::warn!(worker_id, %error, "could not delete the silent worker's key; tried again after the timeout")
        }
        Ok(None) => {
            let gone = WorkerUpdate::Gone {
                worker_id: worker_id.to_string(),
            };
            let _ = events.send(Event::Worker(gone)).await;
        }
        Err(read) => {
            tracing::warn!(worker_id, %error, %read, "could not delete the silent worker's key; tried again after the timeout")
        }
    }
}

/// Purge `work.<worker_id>` below the WORK stream's next sequence as of now: everything
/// published to the worker so far, nothing published after. Returns (purged, bound).
/// What a dead worker's purge removed.
#[derive(Debug)]
pub struct PurgedWork {
    /// Messages removed from the worker's WORK subject.
    pub removed: u64,
    /// Every message below this stream sequence was looked at.
    pub below: u64,
    /// The Assignments among them (a message that is none is removed all the same).
    pub assignments: Vec<Assignment>,
}

/// Most pending Assignments one purge reads; the rest stay for a later purge.
const PURGE_READ_MAX: usize = 100_000;

/// Remove what is on `worker_id`'s WORK subject now, reading it first: an Assignment that
/// an earlier leader wrote and the worker never reported is the only copy of its job. The
/// purge is bounded below the stream's last sequence when it starts (nothing written
/// after, such as new work for the worker once it is back, is touched) and below the last
/// message read (nothing is removed unread).
pub async fn purge_pending_work(
    js: &jetstream::Context,
    worker_id: &str,
) -> Result<PurgedWork, String> {
    let mut stream = js
        .get_stream(names::STREAM_WORK)
        .await
        .map_err(|e| e.to_string())?;
    let (first, last) = {
        let info = stream.info().await.map_err(|e| e.to_string())?;
        (info.state.first_sequence, info.state.last_sequence)
    };
    let mut below = last + 1;
    let subject = names::work_subject(worker_id);
    let mut assignments = Vec::new();
    let mut next = first.max(1);
    while next < below {
        if assignments.len() >= PURGE_READ_MAX {
            below = next;
            break;
        }
        let message = stream
            .raw_message_builder()
            .sequence(next)
            .next_by_subject(subject.clone())
            .send()
            .await;
        let message = match message {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => break,
            Err(e) => return Err(format!("reading the worker's pending assignments: {e}")),
        };
        if message.sequence >= below {
            break;
        }
        next = message.sequence + 1;
        match serde_json::from_slice::<Assignment>(&message.payload) {
            Ok(a) => assignments.push(a),
            Err(e) => {
                tracing::warn!(worker_id, seq = message.sequence, error = %e, "a message on the worker's WORK subject is no Assignment: removed")
            }
        }
    }
    let purged = stream
        .purge()
        .filter(subject)
        .sequence(below)
        .await
        .map_err(|e| e.to_string())?;
    Ok(PurgedWork {
        removed: purged.purged,
        below,
        assignments,
    })
}

/// The wire form of [`Assignment`], serialised from borrowed parts so the job (and its
/// request body) is not cloned on the hot path. Same fields, same order.
#[derive(serde::Serialize)]
struct AssignmentRef<'a> {
    v: u32,
    job: &'a metronome_protocol::Job,
    worker_id: &'a str,
    epoch: u64,
    attempt: u32,
    assigned_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_prefix: Option<metronome_protocol::CachedPrefix>,
}

type Started = Result<PublishAckFuture, String>;

/// The decision's JSON, written into a buffer sized for it up front: at 64 candidates a
/// record is ~20 kB, and growing a vector to that by doubling copies it several times over.
fn encode_decision(decision: &Decision) -> Bytes {
    let estimate = 1024 + 384 * decision.candidates.len() + 192 * decision.rejected.len();
    let mut buf = Vec::with_capacity(estimate);
    match serde_json::to_writer(&mut buf, decision) {
        Ok(()) => Bytes::from(buf),
        Err(_) => Bytes::new(),
    }
}

async fn publish_decision_start(js: &jetstream::Context, decision: &Decision) -> Started {
    let payload = encode_decision(decision);
    let msg_id = names::decision_msg_id(&decision.job_id, decision.attempt);
    let mut pairs = vec![(HEADER_MSG_ID, msg_id.as_str())];
    if let Some(model) = &decision.model {
        pairs.push((HEADER_MODEL, model.as_str()));
    }
    let h = match headers(pairs) {
        Ok(h) => h,
        Err(error) => {
            // The decision matters more than its model header (the body carries the model).
            tracing::warn!(job_id = %decision.job_id, %error, "decision published without its model header");
            headers([(HEADER_MSG_ID, msg_id.as_str())]).map_err(|e| e.to_string())?
        }
    };
    let msg = PublishMessage::build().payload(payload).headers(h);
    let subject = names::decision_subject(decision.tenant.as_deref(), &decision.job_id);
    js.send_publish(subject, msg)
        .await
        .map_err(|e| e.to_string())
}

/// How long an Assignment whose WORK publish failed is sent again while the WORK stream
/// has no leader: on a NATS cluster, the node leading it lost, the other copies elect one
/// within JetStream's election timeout (4 to 9 s in current servers; 5 to 7 s measured on
/// 2.9 by the drill `kill-nats-leader`), and a second round can follow.
const ELECTION_WINDOW: Duration = Duration::from_secs(20);

/// After the first publish of an Assignment failed with `error`: while the WORK stream
/// exists but does not answer (no leader), send it again with its message id (the
/// stream keeps one copy of a repeat) until it is stored or [`ELECTION_WINDOW`] is over,
/// after pauses from 100 ms doubling to 1 s, jittered.
/// A stream that answers that it does not exist fails the attempt at once, as before.
/// Without this, every job decided during an election spent its attempts in milliseconds
/// and failed (`max_attempts`: 47 of 127 jobs in one run of the drill). A repeat the
/// stream reports as a duplicate is this attempt's own earlier publish, stored although
/// its answer was lost (`maybe_stored`: an earlier try failed in a way that does not rule
/// that out), so it counts as stored; after tries that no stream answered, a duplicate is
/// an earlier leader's Assignment of the same attempt, as on a first publish.
async fn republish_through_election(
    js: &jetstream::Context,
    subject: String,
    msg: PublishMessage,
    error: String,
    mut maybe_stored: bool,
) -> Result<jetstream::publish::PublishAck, String> {
    let started = tokio::time::Instant::now();
    let mut last = error;
    let mut pauses = Pauses::new(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        match js.get_stream(names::STREAM_WORK).await {
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                return Err(last);
            }
            _ => {}
        }
        if started.elapsed() >= ELECTION_WINDOW {
            return Err(last);
        }
        tokio::time::sleep(pauses.next_pause()).await;
        tracing::info!(%subject, error = %last, "WORK did not store an assignment; sending it again");
        let sent = match js.send_publish(subject.clone(), msg.clone()).await {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(mut ack) => {
                if maybe_stored {
                    ack.duplicate = false;
                }
                return Ok(ack);
            }
            Err(e) => {
                maybe_stored |= may_be_stored(&e);
                last = e.to_string();
            }
        }
    }
}

/// Whether a publish that failed with `e` may still have been stored: anything but "no
/// stream answered" (no responders: no stream, or a stream without a leader).
fn may_be_stored(e: &jetstream::context::PublishError) -> bool {
    !matches!(
        e.kind(),
        jetstream::context::PublishErrorKind::StreamNotFound
    )
}

async fn publish_decision(js: &jetstream::Context, decision: &Decision) {
    let started = publish_decision_start(js, decision).await;
    finish(started, "decision").await;
}

async fn publish_final_start(
    js: &jetstream::Context,
    tenant: Option<&str>,
    job_id: &str,
    worker_id: Option<String>,
    code: ErrorCode,
    message: &str,
) -> Started {
    let result = FinalResult {
        v: metronome_protocol::PROTOCOL_VERSION,
        job_id: job_id.to_string(),
        worker_id,
        response: None,
        error: Some(ResultError {
            code,
            message: message.to_string(),
        }),
        usage: Usage::default(),
        chunks: 0,
        ttft_ms: None,
        e2e_ms: None,
    };
    let payload = Bytes::from(serde_json::to_vec(&result).unwrap_or_default());
    // Stored only while `results.<tenant>.<job>._dispatcher.final` is empty: one final of
    // the leader's per job, keyed by a subject only dispatchers may write (a msg id could be
    // taken first by any publisher, names::HEADER_EXPECTED_LAST_SUBJECT_SEQ).
    let h = headers([(
        names::HEADER_EXPECTED_LAST_SUBJECT_SEQ,
        names::FIRST_ON_SUBJECT,
    )])
    .map_err(|e| e.to_string())?;
    let msg = PublishMessage::build().payload(payload).headers(h);
    js.send_publish(names::dispatcher_final_subject(tenant, job_id), msg)
        .await
        .map_err(|e| e.to_string())
}

/// The tenant of a job whose body this leader does not hold (a refused job that never came
/// back, a job lost with its worker), from the subject of its latest decision: a job
/// reaches a worker only after its assigned decision is stored.
async fn tenant_of_decided(
    js: &jetstream::Context,
    job_id: &str,
) -> Result<Option<String>, String> {
    let stream = js
        .get_stream_no_info(names::STREAM_DECISIONS)
        .await
        .map_err(|e| e.to_string())?;
    let record = stream
        .get_last_raw_message_by_subject(&names::decision_subject_any_tenant(job_id))
        .await
        .map_err(|e| format!("its decision: {e}"))?;
    let token = names::subject_tenant_token(&record.subject)
        .ok_or_else(|| format!("decision stored on {}", record.subject))?;
    Ok(names::tenant_of_token(token).map(str::to_string))
}

async fn requeue_start(
    js: &jetstream::Context,
    job: &QueuedJob,
    refused_by: &[(String, u32)],
) -> Started {
    let payload = Bytes::from(serde_json::to_vec(&*job.job).map_err(|e| e.to_string())?);
    let msg_id = names::retry_msg_id(&job.job.id, job.attempt);
    let attempt = job.attempt.to_string();
    let order = job.seq.to_string();
    let refused = names::refused_by_header(refused_by);
    let h = headers([
        (HEADER_MSG_ID, msg_id.as_str()),
        (names::HEADER_ATTEMPT, attempt.as_str()),
        (names::HEADER_ORDER, order.as_str()),
        (names::HEADER_REFUSED_BY, refused.as_str()),
    ])
    .map_err(|e| e.to_string())?;
    let msg = PublishMessage::build().payload(payload).headers(h);
    js.send_publish(names::SUBJECT_JOBS_RETRY, msg)
        .await
        .map_err(|e| e.to_string())
}

/// [`finish`] for a final result: one already stored on its subject (another leader
/// declared the same job lost first) is what this one wanted.
async fn finish_final(started: Started) {
    let outcome = match started {
        Ok(fut) => match fut.await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Ok(()),
            Err(e) => Err(e.to_string()),
        },
        Err(e) => Err(e),
    };
    if let Err(error) = outcome {
        tracing::warn!(%error, what = "final result", "publish failed");
    }
}

async fn finish(started: Started, what: &str) {
    let outcome = match started {
        Ok(fut) => fut.await.map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    if let Err(error) = outcome {
        tracing::warn!(%error, what, "publish failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count of unsettled outcomes drops when the task settling one ends, however it
    /// ends: a task that dies no longer holds back the deciding loop for good.
    #[tokio::test]
    async fn an_outcome_leaves_the_count_when_its_task_ends_even_by_a_panic() {
        let pending = Arc::new(Pending::default());
        pending.fetch_add(2, Ordering::AcqRel);
        drop(Unsettled(pending.clone()));
        assert_eq!(pending.load(Ordering::Acquire), 1);
        let unsettled = Unsettled(pending.clone());
        let died = tokio::spawn(async move {
            let _unsettled = unsettled;
            panic!("the task settling the outcome died");
        })
        .await;
        assert!(died.is_err());
        assert_eq!(pending.load(Ordering::Acquire), 0);
    }
}
