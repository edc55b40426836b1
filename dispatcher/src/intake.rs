//! Intake: the leader's durable pull consumer on JOBS, the completion events, and the
//! cancellation requests, each turned into engine events.
//!
//! On every takeover the durable consumer `dispatcher` is deleted and created again
//! (deliver all, explicit ack, long ack wait), so every job the previous leader left
//! unacknowledged is redelivered at once, in stream order. Parsing happens here, off the
//! deciding loop. A message that is not a valid job never reaches the engine: it gets a
//! rejected Decision on `decisions.<salvaged id>` (with the parse error as reason) or,
//! without a usable id, a record on `deadletter.jobs`; then it is acknowledged so it
//! never comes back.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use futures::StreamExt;
use metronome_protocol::names::{
    CONSUMER_DISPATCHER, STREAM_EVENTS, STREAM_JOBS, SUBJECT_CANCEL_ALL, SUBJECT_EVENTS_DONE_ALL,
};
use metronome_protocol::{CompletionEvent, Decision, ErrorCode, Job, JobLimits, Outcome};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::{Event, Incoming};
use crate::metrics::Metrics;
use crate::publish::{self, Publisher};
use crate::DispatcherError;

/// Recreate the durable JOBS consumer so unacknowledged jobs are redelivered now.
pub async fn recreate_jobs_consumer(
    js: &jetstream::Context,
    ack_wait: Duration,
    max_ack_pending: i64,
) -> Result<consumer::PullConsumer, DispatcherError> {
    let stream = js
        .get_stream(STREAM_JOBS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("JOBS stream: {e}")))?;
    // Absent on the very first start: not an error.
    let _ = stream.delete_consumer(CONSUMER_DISPATCHER).await;
    stream
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
        .map_err(|e| DispatcherError::Nats(format!("creating the JOBS consumer: {e}")))
}

/// Read jobs until `token` is cancelled.
pub fn spawn_jobs(
    consumer: consumer::PullConsumer,
    limits: JobLimits,
    context: RejectContext,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) {
    tokio::spawn(async move {
        let mut messages = match consumer
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
        loop {
            let next = tokio::select! {
                _ = token.cancelled() => return,
                m = messages.next() => m,
            };
            let message = match next {
                Some(Ok(m)) => m,
                Some(Err(error)) => {
                    tracing::warn!(%error, "JOBS consumer error");
                    continue;
                }
                None => {
                    tracing::error!("JOBS consumer ended");
                    token.cancel();
                    return;
                }
            };
            let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
            let (msg, acker) = message.split();
            let acker = Arc::new(acker);
            match Job::parse(&msg.payload, &limits) {
                Ok(job) => {
                    let incoming = Incoming {
                        job: Arc::new(job),
                        acker,
                        seq,
                        received_ms: metronome_protocol::time::unix_ms(),
                    };
                    if tx.send(Event::Job(Box::new(incoming))).await.is_err() {
                        return;
                    }
                }
                Err(error) => context.reject_malformed(&msg.payload, &error, Some(acker), seq),
            }
        }
    });
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
    /// Reject a message that is not a valid job, with the parse error as reason.
    pub fn reject_malformed(
        &self,
        body: &[u8],
        error: &metronome_protocol::JobError,
        acker: Option<Arc<jetstream::message::Acker>>,
        seq: u64,
    ) {
        self.metrics.malformed_jobs_total.fetch_add(1, Relaxed);
        let salvaged = if body.len() <= 16 * 1024 * 1024 {
            Job::salvage_id(body)
        } else {
            None
        };
        tracing::warn!(stream_seq = seq, job_id = ?salvaged, code = error.code(), %error, "rejected a malformed job");
        match salvaged {
            Some(job_id) => {
                let model = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
                let decision = Decision {
                    v: metronome_protocol::PROTOCOL_VERSION,
                    job_id,
                    model,
                    outcome: Outcome::Rejected,
                    attempt: 1,
                    reason: Some(error.to_string()),
                    reason_code: Some(error.code().to_string()),
                    worker_id: None,
                    cost: None,
                    candidates: Vec::new(),
                    rejected: Vec::new(),
                    slo: None,
                    policy: self.policy.clone(),
                    queue_wait_ms: 0,
                    decision_latency_us: 0,
                    epoch: self.epoch,
                    dispatcher_id: self.dispatcher_id.clone(),
                    decided_ms: metronome_protocol::time::unix_ms(),
                };
                self.publisher.send(publish::Outcome::Reject {
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
                self.publisher.send(publish::Outcome::DeadLetter {
                    body: Bytes::from(record.to_string()),
                    acker,
                });
            }
        }
    }
}

/// Create the completion-event reader (before the registry is loaded, so no completion
/// that happens after the load is missed), then forward events until `token`.
pub async fn spawn_completions(
    js: &jetstream::Context,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> Result<(), DispatcherError> {
    let stream = js
        .get_stream(STREAM_EVENTS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS stream: {e}")))?;
    let ordered = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: SUBJECT_EVENTS_DONE_ALL.into(),
            deliver_policy: consumer::DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS consumer: {e}")))?;
    let mut messages = ordered
        .messages()
        .await
        .map_err(|e| DispatcherError::Nats(format!("EVENTS consumer: {e}")))?;
    tokio::spawn(async move {
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
            match serde_json::from_slice::<CompletionEvent>(&message.payload) {
                Ok(event) => {
                    if tx.send(Event::Completion(Box::new(event))).await.is_err() {
                        return;
                    }
                }
                Err(error) => {
                    tracing::warn!(subject = %message.subject, %error, "malformed completion event ignored")
                }
            }
        }
    });
    Ok(())
}

/// Forward `cancel.<job_id>` requests until `token`.
pub async fn spawn_cancels(
    client: &async_nats::Client,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> Result<(), DispatcherError> {
    let mut sub = client
        .subscribe(SUBJECT_CANCEL_ALL)
        .await
        .map_err(|e| DispatcherError::Nats(format!("subscribing to cancellations: {e}")))?;
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                _ = token.cancelled() => break,
                m = sub.next() => m,
            };
            let Some(message) = next else { break };
            if let Some(job_id) = message.subject.as_str().strip_prefix("cancel.") {
                if tx.send(Event::Cancel(job_id.to_string())).await.is_err() {
                    break;
                }
            }
        }
        let _ = sub.unsubscribe().await;
    });
    Ok(())
}
