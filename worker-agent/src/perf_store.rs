//! The worker's performance model in Redis: loaded when the agent starts, written after
//! the jobs that update it, so a restarted agent keeps what its worker has learnt.
//!
//! The value under `perf_key(prefix, worker_id)` is the JSON of
//! [`metronome_scheduler::perf::PerfModel`]. One writer task per agent saves the model as
//! it is at the moment of writing, after each change it is told of: writes never land out
//! of order, updates that arrive while one is in flight are folded into the next, and the
//! job's slot never waits on Redis (as with the EWMA update). A Redis outage is logged and
//! counted (`metronome_worker_redis_errors_total`), never fatal: the next change writes
//! the latest state. A missing, unreadable or malformed value at start is replaced by the
//! configured prior (when Redis is unreachable at start the first write replaces the stored
//! model with the one relearnt from the prior).

use std::sync::Arc;
use std::time::Duration;

use metronome_protocol::redis_keys::perf_key;
use metronome_scheduler::perf::{PerfModel, PerfPrior};
use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

use crate::metrics::AgentMetrics;
use crate::shared::Shared;

/// Why a read or write of the model did not land.
#[derive(Debug, thiserror::Error)]
pub enum PerfStoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("encoding the model: {0}")]
    Encode(#[from] serde_json::Error),
}

impl PerfStoreError {
    /// A Redis failure may end; an encoding failure will not.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, PerfStoreError::Encode(_))
    }
}

/// Reader and writer of one worker's model.
#[derive(Clone)]
pub struct PerfStore {
    conn: ConnectionManager,
    key: String,
    timeout: Duration,
    metrics: Arc<AgentMetrics>,
}

impl PerfStore {
    /// Use `conn` (the EWMA store's connection) for `worker_id`'s key under `prefix`.
    pub fn new(
        conn: ConnectionManager,
        prefix: &str,
        worker_id: &str,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        PerfStore {
            conn,
            key: perf_key(prefix, worker_id),
            timeout: Duration::from_secs(3),
            metrics,
        }
    }

    /// The stored JSON, if any.
    pub async fn load_raw(&self) -> Result<Option<String>, PerfStoreError> {
        let mut conn = self.conn.clone();
        let got = tokio::time::timeout(self.timeout, conn.get::<_, Option<String>>(&self.key));
        self.counted(got.await)
    }

    /// The stored model resumed against `prior`, or the prior when there is none, it
    /// cannot be read or it is malformed (each logged).
    pub async fn load(&self, prior: &PerfPrior) -> PerfModel {
        match self.load_raw().await {
            Ok(Some(raw)) => resume_from(&raw, prior, &self.key),
            Ok(None) => {
                tracing::info!(key = %self.key, "no stored performance model: starting from the prior");
                PerfModel::new(prior)
            }
            Err(e) => {
                tracing::warn!(error = %e, key = %self.key, "reading the performance model failed: starting from the prior");
                PerfModel::new(prior)
            }
        }
    }

    /// Write `model`.
    pub async fn save(&self, model: &PerfModel) -> Result<(), PerfStoreError> {
        let body = serde_json::to_string(model)?;
        let mut conn = self.conn.clone();
        let set = tokio::time::timeout(self.timeout, conn.set::<_, _, ()>(&self.key, body));
        self.counted(set.await)
    }

    fn counted<T>(
        &self,
        r: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, PerfStoreError> {
        let r = match r {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => PerfStoreError::Redis(e),
            Err(_) => PerfStoreError::Timeout(self.timeout),
        };
        self.metrics.redis_errors.inc();
        Err(r)
    }
}

/// The model in `raw` resumed against `prior`; the prior when `raw` is not a model of this
/// version's shape.
pub fn resume_from(raw: &str, prior: &PerfPrior, key: &str) -> PerfModel {
    match serde_json::from_str::<PerfModel>(raw) {
        Ok(stored) => {
            let samples = stored.samples();
            let model = PerfModel::resume(Some(stored), prior);
            if samples > 0 && model.samples() == 0 {
                tracing::warn!(%key, "the stored performance model has another shape: starting from the prior");
            } else {
                tracing::info!(%key, samples, "performance model resumed");
            }
            model
        }
        Err(e) => {
            tracing::warn!(%key, error = %e, "the stored performance model is malformed: starting from the prior");
            PerfModel::new(prior)
        }
    }
}

/// Save the model after each change signalled on `shared.perf_changed`, until `stop`.
pub(crate) async fn persist(shared: Arc<Shared>, store: PerfStore, stop: CancellationToken) {
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = shared.perf_changed.notified() => {}
        }
        save_latest(&shared, &store).await;
    }
}

/// Save the model as it is now; a failure is logged (and counted by the store).
pub(crate) async fn save_latest(shared: &Shared, store: &PerfStore) {
    let model = shared.perf.lock().expect("perf lock").clone();
    if let Err(e) = store.save(&model).await {
        tracing::warn!(error = %e, key = %store.key, "saving the performance model failed; the next update retries");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_scheduler::perf::PerfSample;

    #[test]
    fn a_stored_model_resumes_and_garbage_gives_the_prior() {
        let prior = PerfPrior::default();
        let mut m = PerfModel::new(&prior);
        m.observe(&PerfSample {
            prompt_tokens: 100,
            output_tokens: 10,
            ttft_ms: Some(40.0),
            tpot_ms: Some(18.0),
            mean_decode_streams: 1.0,
            ..PerfSample::default()
        });
        let raw = serde_json::to_string(&m).unwrap();
        // serde_json's default float parsing may move the last bit: compare to 1e-12.
        let (got, want) = (
            resume_from(&raw, &prior, "k").coefficients(),
            m.coefficients(),
        );
        assert_eq!(got.samples, 1);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(close(got.step_base_ms, want.step_base_ms), "{got:?}");
        assert!(
            close(got.prefill_per_token_ms, want.prefill_per_token_ms),
            "{got:?}"
        );
        assert_eq!(resume_from("not json", &prior, "k"), PerfModel::new(&prior));
        assert_eq!(
            resume_from("{\"decode\": 3}", &prior, "k"),
            PerfModel::new(&prior)
        );
    }
}
