//! The live worker registry: which models are served right now, from a watch on the
//! `workers` KV bucket (latest heartbeat per worker).
//!
//! Invariants: a worker counts while its latest heartbeat entry is younger than
//! `stale_after`; the bucket's max-age removes silent workers without a notification to
//! watchers, so freshness is judged here from the entry's creation time, not from the
//! absence of a delete. A delete or purge removes the worker at once. A malformed entry is
//! logged with its reason and counted, never fatal. The watch is re-established after any
//! error (e.g. a NATS outage), replaying the bucket's current values.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::WorkerStatus;
use metronome_runtime::retry::Pauses;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// What the gateway keeps of one worker.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    model: String,
    /// When the heartbeat entry was written (Unix ms, NATS server clock).
    updated_ms: u64,
}

/// One model of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub id: String,
    /// Live workers serving it.
    pub workers: usize,
    /// Earliest registration among them (Unix s), for OpenAI's `created`.
    pub created_s: u64,
}

/// Shared view of the live workers.
#[derive(Debug, Clone)]
pub struct Registry {
    workers: Arc<RwLock<HashMap<String, Seen>>>,
    stale_after_ms: u64,
}

impl Registry {
    pub fn new(stale_after: Duration) -> Self {
        Registry {
            workers: Arc::default(),
            stale_after_ms: stale_after.as_millis() as u64,
        }
    }

    /// Record the latest heartbeat of `worker_id` (`None`: the worker left).
    pub fn apply(&self, worker_id: &str, status: Option<&WorkerStatus>, updated_ms: u64) {
        let mut workers = self.workers.write().unwrap_or_else(|p| p.into_inner());
        match status {
            Some(s) => {
                workers.insert(
                    worker_id.to_string(),
                    Seen {
                        model: s.model.clone(),
                        updated_ms,
                    },
                );
            }
            None => {
                workers.remove(worker_id);
            }
        }
    }

    fn is_fresh(&self, seen: &Seen, now_ms: u64) -> bool {
        now_ms.saturating_sub(seen.updated_ms) <= self.stale_after_ms
    }

    /// Whether at least one live worker serves `model`.
    pub fn serves(&self, model: &str, now_ms: u64) -> bool {
        let workers = self.workers.read().unwrap_or_else(|p| p.into_inner());
        workers
            .values()
            .any(|s| s.model == model && self.is_fresh(s, now_ms))
    }

    /// Every served model with its live worker count, sorted by name.
    pub fn models(&self, now_ms: u64) -> Vec<ModelInfo> {
        let workers = self.workers.read().unwrap_or_else(|p| p.into_inner());
        let mut by_model: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
        for seen in workers.values().filter(|s| self.is_fresh(s, now_ms)) {
            let e = by_model.entry(&seen.model).or_insert((0, u64::MAX));
            e.0 += 1;
            e.1 = e.1.min(seen.updated_ms / 1000);
        }
        by_model
            .into_iter()
            .map(|(id, (workers, created_s))| ModelInfo {
                id: id.to_string(),
                workers,
                created_s,
            })
            .collect()
    }

    /// Apply one entry of the bucket's watch.
    fn apply_entry(&self, entry: &kv::Entry, metrics: &Metrics) {
        let updated_ms =
            u64::try_from(entry.created.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        match entry.operation {
            kv::Operation::Put => match serde_json::from_slice::<WorkerStatus>(&entry.value) {
                Ok(status) => match untrusted(&entry.key, &status) {
                    None => self.apply(&entry.key, Some(&status), updated_ms),
                    Some(reason) => {
                        metrics.malformed_message("workers_bucket");
                        tracing::warn!(
                            revision = entry.revision,
                            reason,
                            "ignoring a worker status in the workers bucket"
                        );
                    }
                },
                Err(error) => {
                    metrics.malformed_message("workers_bucket");
                    tracing::warn!(
                        worker_id = %entry.key,
                        revision = entry.revision,
                        %error,
                        "ignoring a malformed worker status in the workers bucket"
                    );
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => {
                self.apply(&entry.key, None, updated_ms)
            }
        }
    }

    /// Follow the `workers` bucket until `shutdown`, re-watching after errors.
    pub fn spawn_watcher(
        &self,
        store: kv::Store,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let registry = self.clone();
        tokio::spawn(async move {
            // Between watches: 500 ms doubling to 5 s, jittered (every gateway lost the
            // same server); back to 500 ms once a watch delivers.
            let mut pauses = Pauses::new(Duration::from_millis(500), Duration::from_secs(5));
            loop {
                match store.watch_with_history(">").await {
                    Ok(mut watch) => loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            item = watch.next() => match item {
                                Some(Ok(entry)) => {
                                    pauses.reset();
                                    registry.apply_entry(&entry, &metrics)
                                }
                                Some(Err(error)) => {
                                    tracing::warn!(%error, "workers bucket watch failed; watching again");
                                    break;
                                }
                                None => {
                                    tracing::warn!("workers bucket watch ended; watching again");
                                    break;
                                }
                            }
                        }
                    },
                    Err(error) => {
                        tracing::warn!(%error, "cannot watch the workers bucket; retrying");
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

/// Why a stored heartbeat cannot be trusted, if it cannot (the same rules as the
/// dispatcher's: a subject-token id matching its key, a printable model name).
fn untrusted(key: &str, status: &WorkerStatus) -> Option<&'static str> {
    if !metronome_protocol::names::is_subject_token(&status.worker_id) {
        return Some("worker id is not a subject token");
    }
    if status.worker_id != key {
        return Some("stored under another worker's key");
    }
    if metronome_protocol::check_model_name(&status.model).is_err() {
        return Some("model name is empty, too long or has control characters");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(worker: &str, model: &str) -> WorkerStatus {
        WorkerStatus {
            v: 1,
            worker_id: worker.into(),
            model: model.into(),
            node: None,
            gpu_index: None,
            healthy: true,
            draining: false,
            max_concurrency: 4,
            active: 0,
            queued: 0,
            in_flight: vec![],
            kv: None,
            gpu: None,
            prefill_pending_tokens: 0,
            perf: None,
            decoding: None,
            seq: 1,
            sent_ms: 0,
            max_epoch: 0,
        }
    }

    #[test]
    fn models_are_distinct_and_counted() {
        let r = Registry::new(Duration::from_secs(10));
        r.apply("w0", Some(&status("w0", "a")), 5_000);
        r.apply("w1", Some(&status("w1", "a")), 6_000);
        r.apply("w2", Some(&status("w2", "b.v1")), 6_000);
        let models = r.models(7_000);
        assert_eq!(models.len(), 2);
        assert_eq!(
            (
                models[0].id.as_str(),
                models[0].workers,
                models[0].created_s
            ),
            ("a", 2, 5)
        );
        assert_eq!((models[1].id.as_str(), models[1].workers), ("b.v1", 1));
        assert!(r.serves("b.v1", 7_000));
        assert!(!r.serves("c", 7_000));
    }

    #[test]
    fn stale_and_deleted_workers_stop_counting() {
        let r = Registry::new(Duration::from_secs(10));
        r.apply("w0", Some(&status("w0", "a")), 1_000);
        assert!(r.serves("a", 11_000));
        assert!(!r.serves("a", 11_001));
        r.apply("w0", Some(&status("w0", "a")), 11_000);
        assert!(r.serves("a", 12_000));
        r.apply("w0", None, 12_000);
        assert!(!r.serves("a", 12_000));
        assert!(r.models(12_000).is_empty());
    }

    #[test]
    fn a_worker_that_changes_model_moves() {
        let r = Registry::new(Duration::from_secs(10));
        r.apply("w0", Some(&status("w0", "a")), 1_000);
        r.apply("w0", Some(&status("w0", "b")), 2_000);
        assert!(!r.serves("a", 2_000));
        assert!(r.serves("b", 2_000));
    }

    #[test]
    fn untrusted_heartbeats_are_recognised() {
        assert_eq!(untrusted("n1-gpu0", &status("n1-gpu0", "org/model")), None);
        assert!(untrusted("bad.id", &status("bad.id", "m")).is_some());
        assert!(untrusted("n1-gpu0", &status("n1-gpu1", "m")).is_some());
        assert!(untrusted("n1-gpu0", &status("n1-gpu0", "a\r\nb")).is_some());
    }
}
