//! The per-worker latency and throughput averages in Redis, and the per-model output-length
//! average, updated by one call of the Redis function the leading dispatcher loads
//! (`redis_keys::EWMA_LIBRARY`) per finished job: an agent may run no Lua of its own.
//!
//! Algorithm: an exponentially weighted moving average whose weight grows with the age of
//! the average. With `alpha` the configured weight of a new sample and `h` the half-life,
//! a sample arriving `dt` ms after the last update uses
//! `alpha_eff = 1 - (1 - alpha) * 0.5^(dt / h)`: back-to-back samples move the average by
//! `alpha`; after a long silence the old average has lost its relevance and the new sample
//! dominates. The first sample sets the average (`alpha_eff = 1`).
//!
//! Invariants: each average is a convex combination of the samples it has seen, so it stays
//! within their range; read-modify-write happens inside Redis in one function call, so concurrent
//! agents or jobs never lose an update; `samples` counts updates and `updated_ms` records
//! the last one. A Redis outage is logged and counted, never fatal: the connection manager
//! reconnects and later updates land again.

use std::sync::Arc;
use std::time::Duration;

use metronome_protocol::redis_keys::{
    ewma_key, output_len_key, EWMA_FIELDS, EWMA_UPDATE_FUNCTION, FIELD_ALPHA, FIELD_SAMPLES,
    FIELD_TOKENS, FIELD_UPDATED_MS,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::metrics::AgentMetrics;

/// The measurements of one finished job.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct JobSample {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub tok_s: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Output tokens, for the model's output-length average.
    pub output_tokens: Option<u32>,
}

/// Why an update did not land.
#[derive(Debug, thiserror::Error)]
pub enum EwmaError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The URL and TLS settings could not make a client (a TLS file missing or wrong).
    #[error("{0}")]
    Client(#[from] metronome_runtime::redis::RedisClientError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

impl EwmaError {
    /// Every failure here is an outage that may end.
    pub fn is_retryable(&self) -> bool {
        true
    }
}

/// Writer of the EWMAs of one worker.
#[derive(Clone)]
pub struct EwmaStore {
    conn: ConnectionManager,
    prefix: String,
    alpha: f64,
    half_life_ms: u64,
    timeout: Duration,
    metrics: Arc<AgentMetrics>,
}

impl EwmaStore {
    /// Prepare the store. Does not connect: the first update does, so an agent starts even
    /// while Redis is down.
    pub fn new(
        redis_url: &str,
        prefix: &str,
        alpha: f64,
        half_life_ms: u64,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, EwmaError> {
        let client = redis::Client::open(redis_url)?;
        Self::with_client(client, prefix, alpha, half_life_ms, metrics)
    }

    /// [`EwmaStore::new`] on a client already made (with TLS settings, by
    /// [`metronome_runtime::redis::RedisTls::client`]).
    pub fn with_client(
        client: redis::Client,
        prefix: &str,
        alpha: f64,
        half_life_ms: u64,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, EwmaError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(EwmaStore {
            conn,
            prefix: prefix.to_string(),
            alpha,
            half_life_ms,
            timeout: Duration::from_secs(3),
            metrics,
        })
    }

    /// The store's Redis connection (it reconnects by itself), for the agent's other keys.
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Fold one job's measurements into the averages of `worker_id` and `model`.
    pub async fn record(
        &self,
        worker_id: &str,
        model: &str,
        sample: &JobSample,
        now_ms: u64,
    ) -> Result<(), EwmaError> {
        let opt = |v: Option<f64>| {
            v.filter(|x| x.is_finite())
                .map(|x| x.to_string())
                .unwrap_or_default()
        };
        let mut inv = redis::cmd("FCALL");
        inv.arg(EWMA_UPDATE_FUNCTION)
            .arg(2)
            .arg(ewma_key(&self.prefix, worker_id))
            .arg(output_len_key(&self.prefix, model, worker_id))
            .arg(now_ms)
            .arg(self.alpha)
            .arg(self.half_life_ms.max(1))
            .arg(EWMA_FIELDS.len())
            .arg(FIELD_SAMPLES)
            .arg(FIELD_UPDATED_MS)
            .arg(FIELD_ALPHA);
        for f in EWMA_FIELDS {
            inv.arg(f);
        }
        for v in [sample.ttft_ms, sample.tpot_ms, sample.tok_s, sample.e2e_ms] {
            inv.arg(opt(v));
        }
        inv.arg(FIELD_TOKENS).arg(
            sample
                .output_tokens
                .map(|t| t.to_string())
                .unwrap_or_default(),
        );
        let mut conn = self.conn.clone();
        let result = tokio::time::timeout(self.timeout, inv.query_async::<i64>(&mut conn)).await;
        match result {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                self.metrics.redis_errors.inc();
                Err(e.into())
            }
            Err(_) => {
                self.metrics.redis_errors.inc();
                Err(EwmaError::Timeout(self.timeout))
            }
        }
    }
}
