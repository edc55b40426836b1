//! Publication of the admission queues in the `queues` KV bucket (one key per model, see
//! `metronome_protocol::queues`), so operators' tools see what waits without asking the
//! leader.
//!
//! The engine takes a snapshot of its queues on its tick, at most every
//! `queue_snapshot_ms`, and hands it to a watch channel when a queue changed (never per
//! arrival). One writer task puts each changed model's snapshot, and every model's once per
//! [`QUEUE_REFRESH_MS`] even when nothing changed, so a reader can tell a live leader's
//! quiet queue from a dead leader's last word (stale after `QUEUE_STALE_AFTER_MS`). It
//! writes only while the lease is fresh. At the start of a term it deletes the keys of
//! models the new leader neither serves nor queues: they were an earlier leader's.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::names::queue_key;
use metronome_protocol::queues::QUEUE_REFRESH_MS;
use metronome_protocol::time::unix_ms;
use metronome_protocol::QueueSnapshot;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::leader::Fence;

/// Write the snapshots from `rx` until the engine drops its sender or `term` ends.
pub fn spawn_writer(
    store: kv::Store,
    mut rx: watch::Receiver<Vec<QueueSnapshot>>,
    fence: Arc<Fence>,
    term: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut inherited = existing_keys(&store).await;
        // Per key: what was last written and when.
        let mut written: BTreeMap<String, (QueueSnapshot, u64)> = BTreeMap::new();
        let refresh = Duration::from_millis(QUEUE_REFRESH_MS);
        loop {
            let current = rx.borrow_and_update().clone();
            if fence.is_fresh() {
                let now = unix_ms();
                for snapshot in current {
                    let key = queue_key(&snapshot.model);
                    inherited.remove(&key);
                    let due = match written.get(&key) {
                        Some((last, at)) => {
                            !last.same_queue(&snapshot)
                                || now.saturating_sub(*at) >= QUEUE_REFRESH_MS
                        }
                        None => true,
                    };
                    if !due {
                        continue;
                    }
                    let snapshot = snapshot.stamped(now);
                    let Ok(bytes) = serde_json::to_vec(&snapshot) else {
                        continue;
                    };
                    match store.put(key.as_str(), bytes.into()).await {
                        Ok(_) => {
                            written.insert(key, (snapshot, now));
                        }
                        Err(error) => {
                            tracing::warn!(%error, model = %snapshot.model, "writing a queue snapshot failed; retrying with the next one");
                        }
                    }
                }
                for key in std::mem::take(&mut inherited) {
                    if let Err(error) = store.delete(key.as_str()).await {
                        tracing::warn!(%error, key, "deleting an earlier leader's queue snapshot failed");
                    }
                }
            }
            tokio::select! {
                _ = term.cancelled() => return,
                changed = rx.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(refresh) => {}
            }
        }
    })
}

/// Keys in the bucket now (an earlier leader's snapshots); none when it cannot be read.
async fn existing_keys(store: &kv::Store) -> HashSet<String> {
    match store.keys().await {
        Ok(keys) => keys.filter_map(|k| async { k.ok() }).collect().await,
        Err(error) => {
            tracing::warn!(%error, "listing the queue snapshots failed");
            HashSet::new()
        }
    }
}
