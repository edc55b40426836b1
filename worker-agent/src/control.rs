//! Operator control over core NATS request/reply on `control.<worker_id>.<action>`
//! (`drain`, `undrain`; see `metronome_protocol::control`), and the leader's `revoke`
//! of jobs it settled after declaring this worker dead.
//!
//! Draining here is the same state a shutdown enters, without the exit: the next heartbeat
//! (sent at once) says `draining`, so the dispatcher stops choosing this worker, and an
//! assignment that still arrives is refused back to the dispatcher. Running jobs finish.
//! Every request is answered with the agent's state, so an operator can poll until
//! `running` reaches 0.
//!
//! Invariant: a shutdown fires `closing` before it starts draining, and from then on
//! `drain` and `undrain` are refused, so an `undrain` can never re-open an agent that is
//! on its way out. The loop keeps serving the leader's `cancel` and `revoke` until `stop`
//! (after the drain): a client's cancel must still stop a job while it finishes.

use std::sync::Arc;

use futures::StreamExt;
use metronome_protocol::names::{
    control_subject_all, CONTROL_CANCEL, CONTROL_DRAIN, CONTROL_REVOKE, CONTROL_UNDRAIN,
};
use metronome_protocol::{ControlReply, RelayedCancel, Revoke, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;

use crate::agent::AgentError;
use crate::shared::Shared;

/// Subscribe to this worker's control subjects.
pub(crate) async fn subscribe(
    client: &async_nats::Client,
    worker_id: &str,
) -> Result<async_nats::Subscriber, AgentError> {
    let subject = control_subject_all(worker_id);
    client
        .subscribe(subject.clone())
        .await
        .map_err(|source| AgentError::SubscribeControl { subject, source })
}

/// Apply control requests and answer them, until `stop`; operators' ones only until
/// `closing`.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    mut sub: async_nats::Subscriber,
    closing: CancellationToken,
    stop: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => break },
            _ = stop.cancelled() => break,
        };
        let action = msg.subject.rsplit('.').next().unwrap_or_default();
        let error = if action == CONTROL_REVOKE {
            revoke(&shared, &msg.payload)
        } else if action == CONTROL_CANCEL {
            cancel(&shared, &msg.payload)
        } else if closing.is_cancelled() {
            Some("shutting down: draining".to_string())
        } else {
            let error = apply(&shared, action);
            if closing.is_cancelled() {
                // The shutdown began while this applied: it drains whatever this said.
                shared.set_draining(true);
            }
            error
        };
        let Some(reply) = msg.reply else { continue };
        let body = ControlReply {
            v: PROTOCOL_VERSION,
            worker_id: shared.config.worker_id.clone(),
            draining: shared.draining(),
            running: shared.running() as u32,
            in_flight: shared.in_flight_ids(),
            error,
        };
        let payload = serde_json::to_vec(&body).unwrap_or_default();
        if let Err(e) = shared.client.publish(reply, payload.into()).await {
            tracing::warn!(error = %e, "answering a control request failed");
        }
    }
}

/// Stop the jobs a leader revoked; an error text for a body that is not a [`Revoke`].
fn revoke(shared: &Shared, body: &[u8]) -> Option<String> {
    match serde_json::from_slice::<Revoke>(body) {
        Ok(r) => {
            let held = shared.dispatch(|m| m.revoke(&r));
            tracing::info!(
                listed = r.jobs.len(),
                held,
                epoch = r.epoch,
                "revocation from the leader applied"
            );
            None
        }
        Err(e) => {
            tracing::warn!(error = ?e.to_string(), "malformed revocation ignored");
            Some(format!("not a revocation: {e}"))
        }
    }
}

/// A client's cancel the leader relayed; an error text for a body that is not a
/// [`RelayedCancel`].
fn cancel(shared: &Shared, body: &[u8]) -> Option<String> {
    match serde_json::from_slice::<RelayedCancel>(body) {
        Ok(c) => {
            if shared.dispatch(|m| m.cancel(&c.tenant, &c.job_id)) > 0 {
                tracing::info!(job_id = %c.job_id, "cancellation requested: stopping generation");
            }
            None
        }
        Err(e) => {
            tracing::warn!(error = ?e.to_string(), "malformed relayed cancel ignored");
            Some(format!("not a relayed cancel: {e}"))
        }
    }
}

/// Set the draining flag for `action`; an error text for an action this agent does not know.
fn apply(shared: &Shared, action: &str) -> Option<String> {
    let draining = match action {
        CONTROL_DRAIN => true,
        CONTROL_UNDRAIN => false,
        other => {
            tracing::warn!(action = other, "unknown control action ignored");
            return Some(format!(
                "unknown action {other:?}: use {CONTROL_DRAIN} or {CONTROL_UNDRAIN}"
            ));
        }
    };
    let was = shared.set_draining(draining);
    if was != draining {
        tracing::info!(
            draining,
            running = shared.running(),
            "operator {action} request applied"
        );
        // The dispatcher must learn at once, not at the next heartbeat tick.
        shared.heartbeat_now.notify_one();
    }
    None
}
