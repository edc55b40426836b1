//! Persistence of the fair-share counters in the `fairness` KV bucket, so fairness
//! survives a leader failover: without it a new leader would start every tenant at zero,
//! and a tenant that had flooded would be treated as new.
//!
//! The leader's engine hands each changed snapshot to a watch channel; one writer task
//! puts the latest to [`FAIRNESS_KEY`], at most once per `min_interval` (a burst of
//! settlements costs one write), and only while the lease is fresh, so a fenced leader
//! cannot overwrite what its successor writes. A new leader loads the key before it reads
//! any job. Counters charged but not settled when a leader fails keep their estimate: the
//! completions reach a leader that never charged those jobs, which ignores them.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use metronome_protocol::names::FAIRNESS_KEY;
use metronome_scheduler::FairnessSnapshot;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::leader::Fence;
use crate::DispatcherError;

/// The counters an earlier leader saved, or `None` when there are none yet. Unreadable
/// contents are logged and ignored: fairness then starts afresh rather than not at all.
pub async fn load(store: &kv::Store) -> Result<Option<FairnessSnapshot>, DispatcherError> {
    let bytes = store
        .get(FAIRNESS_KEY)
        .await
        .map_err(|e| DispatcherError::Nats(format!("reading the fairness counters: {e}")))?;
    let Some(bytes) = bytes else {
        return Ok(None);
    };
    match serde_json::from_slice(&bytes) {
        Ok(snapshot) => Ok(Some(snapshot)),
        Err(error) => {
            tracing::warn!(%error, "ignoring unreadable fairness counters");
            Ok(None)
        }
    }
}

/// Write each new snapshot from `rx` until the engine drops its sender (the end of the
/// term), the last one included, so a graceful handover loses nothing. Between writes it
/// waits `min_interval`, cut short when `term` ends.
pub fn spawn_writer(
    store: kv::Store,
    mut rx: watch::Receiver<FairnessSnapshot>,
    min_interval: Duration,
    fence: Arc<Fence>,
    term: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if rx.changed().await.is_err() {
                return;
            }
            let bytes = match serde_json::to_vec(&*rx.borrow_and_update()) {
                Ok(b) => b,
                Err(error) => {
                    tracing::error!(%error, "cannot encode the fairness counters");
                    continue;
                }
            };
            if !fence.is_fresh() {
                continue;
            }
            if let Err(error) = store.put(FAIRNESS_KEY, bytes.into()).await {
                tracing::warn!(%error, "writing the fairness counters failed; retrying with the next change");
            }
            tokio::select! {
                _ = term.cancelled() => {}
                _ = tokio::time::sleep(min_interval) => {}
            }
        }
    })
}
