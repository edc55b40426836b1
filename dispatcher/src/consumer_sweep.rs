//! The leader's sweep of push consumers that deliver anywhere but an inbox
//! ([`metronome_protocol::setup::sweep_push_consumers`] says why): every
//! [`SWEEP_EVERY`] while it leads, each one deleted is logged with its stream, name and
//! deliver subject, and counted (`metronome_dispatcher_swept_push_consumers_total`).
//! What it leaves: such a consumer delivers until the next sweep.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How often the leader sweeps.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Sweep until `term` is cancelled.
pub fn spawn(
    js: jetstream::Context,
    metrics: Arc<Metrics>,
    term: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        loop {
            tokio::select! {
                _ = term.cancelled() => return,
                _ = tick.tick() => {}
            }
            match metronome_protocol::setup::sweep_push_consumers(&js).await {
                Ok(swept) => {
                    for s in swept {
                        metrics.swept_push_consumers_total.fetch_add(1, Relaxed);
                        tracing::warn!(stream = %s.stream, consumer = ?s.consumer, deliver_subject = ?s.deliver_subject, "deleted a push consumer delivering beyond an inbox");
                    }
                }
                Err(error) => tracing::debug!(%error, "push consumer sweep"),
            }
        }
    })
}
