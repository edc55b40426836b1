//! The leader's admission queues as this gateway last read them, from a watch on the
//! `queues` KV bucket (one [`QueueSnapshot`] per model), so a request the leader would
//! refuse `queue_full` is answered 429 at once, before its job is published, instead of
//! after a JetStream round trip and the leader's decision (under a flood, every refused
//! job costs the stream, the leader and a held request otherwise).
//!
//! Invariants: a request is shed only on a snapshot that says so
//! ([`QueueSnapshot::refuses`], the leader's own rule, tenant shares included) and that is
//! fresh: stored within [`QUEUE_STALE_AFTER_MS`] by the NATS server's clock (the leader
//! rewrites every model's snapshot at least every second, so an older one means no leader
//! writes). A snapshot without a bound (a leader that predates it), one whose answer hangs
//! on flows it does not list, or one that cannot be read sheds nothing: the leader decides
//! as before. Shedding is therefore never stricter than the leader except for the time a
//! snapshot lags its queue (at most the leader's `queue_snapshot_ms`); a drained queue's
//! snapshot is rewritten on the change, and requests are taken again once it is read.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::queues::{QueueSnapshot, QUEUE_STALE_AFTER_MS};
use metronome_runtime::retry::Pauses;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// One model's latest snapshot and when the server stored it (Unix ms).
#[derive(Debug, Clone)]
struct Seen {
    snapshot: QueueSnapshot,
    stored_ms: u64,
}

/// The latest snapshot per model.
#[derive(Debug, Clone, Default)]
pub struct QueueView {
    models: Arc<RwLock<HashMap<String, Seen>>>,
}

impl QueueView {
    /// The snapshot by which the leader's queue of `model`, fresh at `now_ms`, refuses a
    /// new job of `tenant` (`""`: none); `None` when it does not or nobody can tell.
    pub fn refusing(&self, model: &str, tenant: &str, now_ms: u64) -> Option<QueueSnapshot> {
        let models = self.models.read().unwrap_or_else(|p| p.into_inner());
        let seen = models.get(model)?;
        let fresh = now_ms.saturating_sub(seen.stored_ms) <= QUEUE_STALE_AFTER_MS;
        (fresh && seen.snapshot.refuses(tenant) == Some(true)).then(|| seen.snapshot.clone())
    }

    /// Apply one stored snapshot (`None`: the key was deleted or is unreadable).
    fn apply(&self, key: &str, snapshot: Option<QueueSnapshot>, stored_ms: u64) {
        let mut models = self.models.write().unwrap_or_else(|p| p.into_inner());
        match snapshot {
            Some(snapshot) => {
                models.insert(
                    snapshot.model.clone(),
                    Seen {
                        snapshot,
                        stored_ms,
                    },
                );
            }
            None => {
                models.retain(|model, _| metronome_protocol::names::queue_key(model) != key);
            }
        }
    }

    fn apply_entry(&self, entry: &kv::Entry, metrics: &Metrics) {
        let stored_ms =
            u64::try_from(entry.created.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        let snapshot = match entry.operation {
            kv::Operation::Put => match QueueSnapshot::parse(&entry.value) {
                Ok(s) if metronome_protocol::names::queue_key(&s.model) == entry.key => Some(s),
                Ok(_) | Err(_) => {
                    metrics.malformed_message("queues_bucket");
                    tracing::warn!(
                        key = %entry.key,
                        revision = entry.revision,
                        "ignoring an unreadable queue snapshot (no shedding on it)"
                    );
                    None
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => None,
        };
        self.apply(&entry.key, snapshot, stored_ms);
    }

    /// Follow the `queues` bucket until `shutdown`, re-watching after errors (replaying
    /// the bucket's current values).
    pub fn spawn_watcher(
        &self,
        store: kv::Store,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let view = self.clone();
        tokio::spawn(async move {
            let mut pauses = Pauses::new(Duration::from_millis(500), Duration::from_secs(5));
            loop {
                match store.watch_with_history(">").await {
                    Ok(mut watch) => loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            item = watch.next() => match item {
                                Some(Ok(entry)) => {
                                    pauses.reset();
                                    view.apply_entry(&entry, &metrics);
                                }
                                Some(Err(error)) => {
                                    tracing::warn!(%error, "queues bucket watch failed; watching again");
                                    break;
                                }
                                None => {
                                    tracing::warn!("queues bucket watch ended; watching again");
                                    break;
                                }
                            }
                        }
                    },
                    Err(error) => {
                        tracing::warn!(%error, "cannot watch the queues bucket; retrying");
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pauses.next_pause()) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::queues::FlowCount;
    use metronome_protocol::Priority;

    fn full(model: &str, waiting: u32, bound: Option<u32>) -> QueueSnapshot {
        QueueSnapshot {
            v: 1,
            model: model.into(),
            waiting,
            oldest_enqueued_ms: (waiting > 0).then_some(1),
            oldest_wait_ms: 0,
            by_priority: Default::default(),
            flows: vec![FlowCount {
                tenant: "acme".into(),
                priority: Priority::Interactive,
                waiting,
            }],
            flows_not_listed: 0,
            bound,
            epoch: 1,
            dispatcher_id: "d".into(),
            written_ms: 1_000,
        }
    }

    #[test]
    fn sheds_only_on_a_fresh_snapshot_that_refuses() {
        let view = QueueView::default();
        let key = metronome_protocol::names::queue_key("m");
        view.apply(&key, Some(full("m", 4, Some(4))), 1_000);
        assert!(view.refusing("m", "acme", 1_000).is_some());
        // Another tenant's share of the bound is still free.
        assert!(view.refusing("m", "globex", 1_000).is_none());
        assert!(view.refusing("other", "acme", 1_000).is_none());
        // Stale: no leader writes.
        assert!(view
            .refusing("m", "acme", 1_001 + QUEUE_STALE_AFTER_MS)
            .is_none());
        // Drained.
        view.apply(&key, Some(full("m", 1, Some(4))), 2_000);
        assert!(view.refusing("m", "acme", 2_000).is_none());
        // An older leader's snapshot has no bound: nothing is shed.
        view.apply(&key, Some(full("m", 9, None)), 3_000);
        assert!(view.refusing("m", "acme", 3_000).is_none());
        view.apply(&key, Some(full("m", 4, Some(4))), 4_000);
        view.apply(&key, None, 4_100);
        assert!(view.refusing("m", "acme", 4_100).is_none());
    }
}
