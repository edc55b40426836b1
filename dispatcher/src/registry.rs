//! The worker registry's inputs: the `workers` KV bucket (latest heartbeat per worker)
//! and the per-worker EWMAs in Redis.
//!
//! The bucket is loaded whole before a leader decides anything (so "unknown model" is
//! never said just because the registry was still empty), then followed with a watch
//! that starts right after the loaded revision, so no update falls in between. A
//! heartbeat that does not parse, or whose worker id is not a subject token (work for it
//! would go to a subject no stream captures), is logged with its reason, counted and
//! skipped.
//!
//! A heartbeat is aged by when *this* leader received it, never by the worker's own
//! `sent_ms`: clocks differ between hosts, and a leader that takes over (or reconnects)
//! before the agents' next beat must not declare live workers dead. A loaded heartbeat
//! counts as received at load time; a worker that really died is declared dead one
//! heartbeat timeout later, and its key leaves the bucket at the bucket's max age.
//!
//! Redis is read only (worker-agents write the EWMAs). The refresher re-reads every
//! EWMA hash periodically; when Redis is down it keeps the last values, counts the error
//! and flips `redis_up` to 0, so dispatching carries on with what it knew.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::names::{is_subject_token, is_worker_id};
use metronome_protocol::redis_keys::{self, ewma_pattern};
use metronome_protocol::WorkerStatus;
use metronome_scheduler::EwmaSnapshot;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::{Event, RedisSnapshot, WorkerUpdate};
use crate::metrics::Metrics;
use crate::DispatcherError;

/// Everything in the bucket now, and the revision to watch from.
/// [`load_workers`], failing once `within` has passed (see `LOAD_WORKERS_WITHIN` in
/// `lib.rs`: a stalled listing must end the term, not hold the lease forever).
pub async fn load_workers_within(
    store: &kv::Store,
    metrics: &Metrics,
    within: std::time::Duration,
) -> Result<(Vec<WorkerUpdate>, u64), DispatcherError> {
    tokio::time::timeout(within, load_workers(store, metrics))
        .await
        .map_err(|_| {
            DispatcherError::Nats(format!(
                "listing the workers bucket took over {} s",
                within.as_secs()
            ))
        })?
}

pub async fn load_workers(
    store: &kv::Store,
    metrics: &Metrics,
) -> Result<(Vec<WorkerUpdate>, u64), DispatcherError> {
    let mut stream = store.stream.clone();
    let last = stream
        .info()
        .await
        .map_err(|e| DispatcherError::Nats(format!("workers bucket info: {e}")))?
        .state
        .last_sequence;
    // The keys from the stream's per-subject counts (one request, paged), not from a
    // key-listing consumer: that one can wait for good on nats-server 2.9 for messages
    // that expired meanwhile (nats-io/nats-server#3481), and the workers bucket expires
    // keys by design.
    let subjects: Vec<String> = stream
        .info_with_subjects(format!("{}>", store.prefix))
        .await
        .map_err(|e| DispatcherError::Nats(format!("listing workers: {e}")))?
        .filter_map(|s| async move { s.ok().map(|(subject, _)| subject) })
        .collect()
        .await;
    let now = metronome_protocol::time::unix_ms();
    let mut out = Vec::new();
    for subject in subjects {
        let Some(key) = subject.strip_prefix(&store.prefix).map(str::to_string) else {
            continue;
        };
        match store.entry(key.clone()).await {
            Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
                if let Some(status) = parse_status(&key, &entry.value, metrics) {
                    out.push(WorkerUpdate::Put {
                        status: Box::new(status),
                        seen_ms: now,
                        revision: entry.revision,
                        unvouched: Vec::new(),
                        tenants: HashMap::new(),
                    });
                }
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, worker_id = %key, "could not read worker entry"),
        }
    }
    Ok((out, last))
}

/// Follow the bucket from `from_revision`, sending each change to the engine.
pub fn spawn_watch(
    store: kv::Store,
    from_revision: u64,
    mut vouching: Vouching,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut watch = match store.watch_all_from_revision(from_revision.max(1)).await {
            Ok(w) => w,
            Err(error) => {
                tracing::error!(%error, "cannot watch the workers bucket");
                token.cancel();
                return;
            }
        };
        loop {
            let entry = tokio::select! {
                _ = token.cancelled() => return,
                e = watch.next() => e,
            };
            let Some(entry) = entry else {
                tracing::error!("workers watch ended");
                token.cancel();
                return;
            };
            let entry = match entry {
                Ok(e) => e,
                Err(error) => {
                    tracing::warn!(%error, "workers watch error");
                    continue;
                }
            };
            let update = match entry.operation {
                kv::Operation::Put => match parse_status(&entry.key, &entry.value, &metrics) {
                    Some(status) => WorkerUpdate::Put {
                        status: Box::new(status),
                        seen_ms: metronome_protocol::time::unix_ms(),
                        revision: entry.revision,
                        unvouched: Vec::new(),
                        tenants: HashMap::new(),
                    },
                    None => continue,
                },
                kv::Operation::Delete | kv::Operation::Purge => {
                    if !is_subject_token(&entry.key) {
                        continue;
                    }
                    vouching.forget(&entry.key);
                    WorkerUpdate::Gone {
                        worker_id: entry.key.clone(),
                    }
                }
            };
            let mut update = update;
            vouching.check(&mut update).await;
            if tx.send(Event::Worker(update)).await.is_err() {
                return;
            }
        }
    })
}

/// At most this many new claims of one heartbeat are checked (the rest at the next).
const MAX_CHECKS_PER_HEARTBEAT: usize = 1024;

/// Checks the jobs a heartbeat claims to run against the decisions on record, before the
/// engine sees the heartbeat (off the deciding loop: the job's last decision on
/// DECISIONS, read once per job id the first time a worker lists it).
///
/// A heartbeat's `in_flight` is the worker's own claim. The leader adopts what workers
/// report (so that a new leader knows what an earlier one assigned, and a redelivered job
/// gets `already_assigned` rather than a second run), so a worker that learned a job's id
/// could otherwise claim the job. A claim is believed only when the job's latest decision
/// is an assignment naming that worker, which only dispatchers write. A pair once vouched
/// for is remembered while the worker keeps listing it; a claim that fails is checked again
/// at the next heartbeat (the leader publishes a decision after its Assignment, so a worker
/// can list a job before its decision is stored; the engine keeps such a job, which it
/// booked itself, and adopts none of the others). The same decision names the job's
/// tenant, which the update carries for fair sharing.
pub struct Vouching {
    decisions: async_nats::jetstream::stream::Stream<()>,
    /// Per worker, the jobs vouched for and the tenant each one's decision names.
    vouched: HashMap<String, HashMap<String, Option<String>>>,
}

impl Vouching {
    pub fn new(decisions: async_nats::jetstream::stream::Stream<()>) -> Vouching {
        Vouching {
            decisions,
            vouched: HashMap::new(),
        }
    }

    /// Fill `update`'s `unvouched` with the claims no decision supports, and its `tenants`
    /// with the tenants of those it does.
    pub async fn check(&mut self, update: &mut WorkerUpdate) {
        let WorkerUpdate::Put {
            status,
            unvouched,
            tenants,
            ..
        } = update
        else {
            return;
        };
        let decisions = &self.decisions;
        let worker = status.worker_id.as_str();
        let known = self.vouched.entry(worker.to_string()).or_default();
        known.retain(|job, _| status.in_flight.contains(job));
        let mut fresh: Vec<&String> = status
            .in_flight
            .iter()
            .filter(|job| !known.contains_key(job.as_str()))
            .collect();
        // A heartbeat listing thousands of ids must not make the leader read thousands of
        // decisions at once: the rest wait for the next heartbeat, not adopted meanwhile.
        for job in fresh.split_off(fresh.len().min(MAX_CHECKS_PER_HEARTBEAT)) {
            unvouched.push(job.clone());
        }
        let checks = fresh.iter().map(|job| assigned_to(decisions, job));
        let answers = futures::future::join_all(checks).await;
        for (job, answer) in fresh.into_iter().zip(answers) {
            match answer {
                Ok(Some(assigned)) if assigned.worker_id == worker => {
                    known.insert(job.clone(), assigned.tenant);
                }
                Ok(_) => unvouched.push(job.clone()),
                Err(error) => {
                    tracing::warn!(worker_id = worker, job_id = %job, %error, "cannot read the decision of a job a heartbeat lists: not adopted now");
                    unvouched.push(job.clone());
                }
            }
        }
        tenants.extend(
            known
                .iter()
                .filter_map(|(job, tenant)| Some((job.clone(), tenant.clone()?))),
        );
    }

    /// A worker left: forget what was vouched for it.
    pub fn forget(&mut self, worker_id: &str) {
        self.vouched.remove(worker_id);
    }
}

/// Whom the latest decision of a job assigns it to, and for which tenant, model and attempt.
pub(crate) struct AssignedOnRecord {
    pub worker_id: String,
    pub tenant: Option<String>,
    pub model: Option<String>,
    pub attempt: u32,
}

/// The latest decision of `job_id`, when it is an assignment (`None`: no decision, or
/// another outcome).
pub(crate) async fn assigned_to(
    decisions: &async_nats::jetstream::stream::Stream<()>,
    job_id: &str,
) -> Result<Option<AssignedOnRecord>, String> {
    #[derive(serde::Deserialize)]
    struct Named {
        outcome: metronome_protocol::Outcome,
        #[serde(default)]
        worker_id: Option<String>,
        #[serde(default)]
        tenant: Option<String>,
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        attempt: u32,
    }
    if !is_subject_token(job_id) {
        return Ok(None);
    }
    let subject = metronome_protocol::names::decision_subject_any_tenant(job_id);
    match decisions.get_last_raw_message_by_subject(&subject).await {
        Ok(m) => Ok(serde_json::from_slice::<Named>(&m.payload)
            .ok()
            .filter(|d| d.outcome == metronome_protocol::Outcome::Assigned)
            .and_then(|d| {
                Some(AssignedOnRecord {
                    worker_id: d.worker_id?,
                    tenant: d.tenant,
                    model: d.model,
                    attempt: d.attempt,
                })
            })),
        Err(e)
            if e.kind()
                == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
        {
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The heartbeat stored under `key`, when it can be trusted; otherwise log why, count it,
/// and ignore it.
fn parse_status(key: &str, value: &[u8], metrics: &Metrics) -> Option<WorkerStatus> {
    let reason = match serde_json::from_slice::<WorkerStatus>(value) {
        Ok(status) if !is_worker_id(&status.worker_id) => {
            "worker id is not a subject token (letters, digits, '-' and '_', at most 128) or is the dispatcher's publisher token"
                .to_string()
        }
        Ok(status) if metronome_protocol::check_model_name(&status.model).is_err() => {
            "model name is empty, too long or has control characters".to_string()
        }
        Ok(status) if status.worker_id != key => {
            format!("stored under another worker's key ({:?})", status.worker_id)
        }
        Ok(status) => return Some(status),
        Err(error) => format!("malformed: {error}"),
    };
    metrics.ignored_worker_messages_total.fetch_add(1, Relaxed);
    let key: String = key.chars().take(160).collect();
    tracing::warn!(key, reason, "heartbeat in the workers bucket ignored");
    None
}

/// Reads the EWMA hashes; reconnects lazily after a failure.
pub struct EwmaReader {
    client: redis::Client,
    conn: Option<redis::aio::MultiplexedConnection>,
    prefix: String,
}

impl EwmaReader {
    pub fn new(
        url: &str,
        tls: &metronome_runtime::redis::RedisTls,
        prefix: &str,
    ) -> Result<EwmaReader, DispatcherError> {
        let client = tls
            .client(url)
            .map_err(|e| DispatcherError::Redis(e.to_string()))?;
        Ok(EwmaReader {
            client,
            conn: None,
            prefix: prefix.to_string(),
        })
    }

    /// Read every EWMA hash. On error the connection is dropped and rebuilt next time.
    pub async fn read(&mut self) -> Result<RedisSnapshot, redis::RedisError> {
        let result = self.read_inner().await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    async fn read_inner(&mut self) -> Result<RedisSnapshot, redis::RedisError> {
        if self.conn.is_none() {
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(500)))
                .set_response_timeout(Some(Duration::from_millis(1000)));
            let mut conn = self
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            load_ewma_function(&mut conn).await;
            self.conn = Some(conn);
        }
        let conn = self.conn.as_mut().expect("connected above");
        let mut snapshot = RedisSnapshot::default();
        let ewma_prefix = redis_keys::ewma_key(&self.prefix, "");
        let mut output_lengths = Vec::new();
        for (pattern, is_ewma) in [
            (ewma_pattern(&self.prefix), true),
            (redis_keys::output_len_pattern(&self.prefix), false),
        ] {
            let keys = scan(conn, &pattern).await?;
            if keys.is_empty() {
                continue;
            }
            let mut pipe = redis::pipe();
            for k in &keys {
                pipe.hgetall(k);
            }
            let hashes: Vec<HashMap<String, String>> = pipe.query_async(conn).await?;
            for (key, hash) in keys.iter().zip(hashes) {
                if is_ewma {
                    let id = key[ewma_prefix.len()..].to_string();
                    snapshot.ewmas.insert(id, ewma_from_hash(&hash));
                } else if let (Some((model, _)), Some(tokens)) = (
                    redis_keys::output_len_of_key(&self.prefix, key),
                    field(&hash, redis_keys::FIELD_TOKENS),
                ) {
                    output_lengths.push((model.to_string(), tokens));
                }
            }
        }
        snapshot.output_len = median_per_model(output_lengths);
        Ok(snapshot)
    }
}

/// Each model's output length: the median of its workers' own averages (the mean of the
/// two middle ones for an even count). Each worker writes only its own, so a minority of
/// a model's workers cannot move the value outside the range of the others'; one shared
/// average, written by every worker, was set by whichever wrote last.
fn median_per_model(values: Vec<(String, f64)>) -> HashMap<String, f64> {
    let mut by_model: HashMap<String, Vec<f64>> = HashMap::new();
    for (model, tokens) in values {
        if tokens.is_finite() && tokens >= 0.0 {
            by_model.entry(model).or_default().push(tokens);
        }
    }
    by_model
        .into_iter()
        .map(|(model, mut v)| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            let median = if n % 2 == 1 {
                v[n / 2]
            } else {
                (v[n / 2 - 1] + v[n / 2]) / 2.0
            };
            (model, median)
        })
        .collect()
}

/// Load the EWMA update function worker-agents call (`redis_keys::EWMA_LIBRARY`), on every
/// new connection: a Redis restarted without its data has lost it, and the connection to it
/// is new. Workers may run no Lua of their own, so until a leader has loaded it their
/// updates fail (counted by each agent). A failure here is logged, never fatal: reading
/// the EWMAs goes on.
async fn load_ewma_function(conn: &mut redis::aio::MultiplexedConnection) {
    let loaded = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(redis_keys::EWMA_LIBRARY)
        .query_async::<String>(conn)
        .await;
    match loaded {
        Ok(_) => tracing::debug!("loaded the EWMA update function"),
        Err(error) => tracing::warn!(
            %error,
            "cannot load the EWMA update function (needs Redis 7 and the dispatcher's `+function|load`): workers cannot update their EWMAs"
        ),
    }
}

async fn scan(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Result<Vec<String>, redis::RedisError> {
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

fn field(hash: &HashMap<String, String>, name: &str) -> Option<f64> {
    hash.get(name)
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite())
}

/// A hash with missing or unparsable fields gives zeros there; zero samples means the
/// scheduler treats the EWMA as unavailable.
pub fn ewma_from_hash(hash: &HashMap<String, String>) -> EwmaSnapshot {
    EwmaSnapshot {
        ttft_ms: field(hash, redis_keys::FIELD_TTFT_MS).unwrap_or(0.0),
        tpot_ms: field(hash, redis_keys::FIELD_TPOT_MS).unwrap_or(0.0),
        tok_s: field(hash, redis_keys::FIELD_TOK_S).unwrap_or(0.0),
        e2e_ms: field(hash, redis_keys::FIELD_E2E_MS).unwrap_or(0.0),
        samples: field(hash, redis_keys::FIELD_SAMPLES)
            .map(|v| v.max(0.0) as u64)
            .unwrap_or(0),
        updated_ms: field(hash, redis_keys::FIELD_UPDATED_MS)
            .map(|v| v.max(0.0) as u64)
            .unwrap_or(0),
    }
}

/// Read once (bounded in time), recording the outcome in the metrics.
pub async fn refresh_once(reader: &mut EwmaReader, metrics: &Metrics) -> Option<RedisSnapshot> {
    match tokio::time::timeout(Duration::from_secs(2), reader.read()).await {
        Ok(Ok(snapshot)) => {
            if metrics.redis_up.swap(1, Relaxed) == 0 {
                tracing::info!(workers = snapshot.ewmas.len(), "reading EWMAs from Redis");
            }
            Some(snapshot)
        }
        outcome => {
            metrics.redis_errors_total.fetch_add(1, Relaxed);
            if metrics.redis_up.swap(0, Relaxed) == 1 {
                let error = match outcome {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_string(),
                };
                tracing::warn!(%error, "Redis unavailable: keeping the last EWMAs");
            }
            None
        }
    }
}

/// Refresh the EWMAs every `period` until `token` is cancelled.
pub fn spawn_ewma_refresher(
    mut reader: EwmaReader,
    period: Duration,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Event>,
    token: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = interval.tick() => {}
            }
            if let Some(snapshot) = refresh_once(&mut reader, &metrics).await {
                if tx.send(Event::Redis(snapshot)).await.is_err() {
                    return;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_models_output_length_is_the_median_of_its_workers() {
        let v = |m: &str, t: f64| (m.to_string(), t);
        let merged = median_per_model(vec![
            v("m", 100.0),
            v("m", 120.0),
            // One worker claims its model's jobs are a million tokens long.
            v("m", 1e6),
            v("q", 10.0),
            v("q", 30.0),
            v("q", f64::NAN),
        ]);
        assert_eq!(merged["m"], 120.0);
        assert_eq!(merged["q"], 20.0);
    }

    #[test]
    fn ewma_hash_is_read_tolerantly() {
        let hash: HashMap<String, String> = [
            ("ttft_ms", "120.5"),
            ("tok_s", "40"),
            ("samples", "7"),
            ("tpot_ms", "garbage"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let e = ewma_from_hash(&hash);
        assert_eq!(e.ttft_ms, 120.5);
        assert_eq!(e.tok_s, 40.0);
        assert_eq!(e.samples, 7);
        assert_eq!(e.tpot_ms, 0.0);
    }
}
