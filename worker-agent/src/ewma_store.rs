//! The per-worker latency and throughput averages in Redis, and the per-model output-length
//! average, updated by one atomic Lua script per finished job.
//!
//! Algorithm: an exponentially weighted moving average whose weight grows with the age of
//! the average. With `alpha` the configured weight of a new sample and `h` the half-life,
//! a sample arriving `dt` ms after the last update uses
//! `alpha_eff = 1 - (1 - alpha) * 0.5^(dt / h)`: back-to-back samples move the average by
//! `alpha`; after a long silence the old average has lost its relevance and the new sample
//! dominates. The first sample sets the average (`alpha_eff = 1`).
//!
//! Invariants: each average is a convex combination of the samples it has seen, so it stays
//! within their range; read-modify-write happens inside Redis in one script, so concurrent
//! agents or jobs never lose an update; `samples` counts updates and `updated_ms` records
//! the last one. A Redis outage is logged and counted, never fatal: the connection manager
//! reconnects and later updates land again.

use std::sync::Arc;
use std::time::Duration;

use metronome_protocol::redis_keys::{
    ewma_key, output_len_key, EWMA_FIELDS, FIELD_ALPHA, FIELD_SAMPLES, FIELD_TOKENS,
    FIELD_UPDATED_MS,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::metrics::AgentMetrics;

/// The update script. KEYS: the worker's EWMA hash, the model's output-length hash.
/// ARGV: now_ms, alpha, half_life_ms, then one value per `EWMA_FIELDS` entry and the
/// output token count ('' for "no sample of this field").
const UPDATE_SCRIPT: &str = r#"
local now = tonumber(ARGV[1])
local base = tonumber(ARGV[2])
local half = tonumber(ARGV[3])
local nfields = tonumber(ARGV[4])

local function alpha_eff(updated)
  if updated == nil then return 1 end
  local dt = now - updated
  if dt < 0 then dt = 0 end
  local a = 1 - (1 - base) * math.pow(0.5, dt / half)
  if a < base then a = base end
  if a > 1 then a = 1 end
  return a
end

-- Numbers handed to redis.call are truncated to integers: format floats as strings.
local function num(x) return string.format('%.17g', x) end

local function update(key, fields, values)
  local any = false
  for i = 1, #fields do
    if tonumber(values[i]) ~= nil then any = true end
  end
  if not any then return end
  local old = redis.call('HMGET', key, ARGV[5], ARGV[6], unpack(fields))
  local samples = tonumber(old[1]) or 0
  local a = alpha_eff(tonumber(old[2]))
  for i = 1, #fields do
    local x = tonumber(values[i])
    if x ~= nil then
      local prev = tonumber(old[i + 2])
      local v = x
      if prev ~= nil then v = prev + a * (x - prev) end
      redis.call('HSET', key, fields[i], num(v))
    end
  end
  redis.call('HSET', key, ARGV[5], samples + 1, ARGV[6], num(now), ARGV[7], num(a))
end

local fields, values = {}, {}
for i = 1, nfields do
  fields[i] = ARGV[7 + i]
  values[i] = ARGV[7 + nfields + i]
end
update(KEYS[1], fields, values)
update(KEYS[2], { ARGV[8 + 2 * nfields] }, { ARGV[9 + 2 * nfields] })
return 1
"#;

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
    script: Arc<redis::Script>,
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
            script: Arc::new(redis::Script::new(UPDATE_SCRIPT)),
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
        let mut inv = self.script.prepare_invoke();
        inv.key(ewma_key(&self.prefix, worker_id))
            .key(output_len_key(&self.prefix, model))
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
        let result = tokio::time::timeout(self.timeout, inv.invoke_async::<i64>(&mut conn)).await;
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
