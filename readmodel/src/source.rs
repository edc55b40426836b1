//! Reading the system over the documented NATS contract (and Redis for the EWMAs): the
//! only I/O of the read model. Every read is bounded: a direct get, a KV read, or a scan of a
//! stream that stops at the stream's end, at a message budget, or after a quiet timeout.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use serde::de::DeserializeOwned;

use metronome_protocol::names::{
    self, STREAM_DECISIONS, STREAM_EVENTS, STREAM_JOBS, STREAM_RESULTS,
};
use metronome_protocol::{
    redis_keys, CompletionEvent, Decision, FinalResult, QueueSnapshot, WorkerStatus,
};

use crate::error::ReadError;
use crate::status::{Leader, LeaseValue};
use crate::workers::Ewma;

/// How long one read may wait for the next message of a scan before giving up.
const QUIET: Duration = Duration::from_secs(5);

/// A connection to NATS and its JetStream context.
pub struct Nats {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
}

impl Nats {
    /// Connect to `url` with the credentials and TLS settings of `auth`.
    pub async fn connect(
        url: &str,
        auth: &metronome_runtime::nats::NatsAuth,
    ) -> Result<Nats, ReadError> {
        let options = auth.connect_options().map_err(|e| ReadError::Connect {
            url: url.to_string(),
            message: e.to_string(),
        })?;
        let client = options
            .name("metronome-cli")
            .connection_timeout(Duration::from_secs(5))
            .connect(metronome_runtime::nats::server_urls(url))
            .await
            .map_err(|e| ReadError::Connect {
                url: url.to_string(),
                message: e.to_string(),
            })?;
        let js = jetstream::new(client.clone());
        Ok(Nats { client, js })
    }

    async fn stream(&self, name: &str) -> Result<stream::Stream, ReadError> {
        self.js
            .get_stream(name)
            .await
            .map_err(|e| ReadError::Nats(format!("stream {name}: {e}")))
    }

    /// Every decision stored on `decisions.<tenant>.<job_id>`, oldest first (one per
    /// attempt that reached an outcome); empty for an unknown id.
    pub async fn decisions_of(&self, job_id: &str) -> Result<Vec<Decision>, ReadError> {
        let stream = self.stream(STREAM_DECISIONS).await?;
        // The job's subject, whatever its tenant: its first record, found with the filter
        // in the request body (a direct get names a literal subject in its own subject).
        let any = names::decision_subject_any_tenant(job_id);
        let subject = match stream
            .direct_get_next_for_subject(any.clone(), Some(1))
            .await
        {
            Ok(m) => m.subject.to_string(),
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(ReadError::Nats(format!("direct get {any}: {e}"))),
        };
        let last = match stream.direct_get_last_for_subject(subject.clone()).await {
            Ok(m) => m,
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(ReadError::Nats(format!("direct get {subject}: {e}"))),
        };
        // Walk the subject from the start: attempts are few, so this is a handful of gets.
        let mut out = Vec::new();
        let mut next = 1;
        while next < last.sequence {
            match stream
                .direct_get_next_for_subject(subject.clone(), Some(next))
                .await
            {
                Ok(m) if m.sequence < last.sequence => {
                    next = m.sequence + 1;
                    out.push(decode::<Decision>(&m.payload, &subject)?);
                }
                Ok(_) => break,
                Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => break,
                Err(e) => return Err(ReadError::Nats(format!("direct get {subject}: {e}"))),
            }
        }
        out.push(decode::<Decision>(&last.payload, &subject)?);
        Ok(out)
    }

    /// The accepted final result of a job, while RESULTS still keeps it
    /// (`metronome_protocol::stored::accepted_final`): the first stored of the leader's and
    /// that of `assigned`, the worker the job's latest assigned decision names.
    pub async fn final_result(
        &self,
        job_id: &str,
        assigned: Option<&str>,
    ) -> Result<Option<FinalResult>, ReadError> {
        let stream = self.stream(STREAM_RESULTS).await?;
        match metronome_protocol::stored::accepted_final(&stream, job_id, assigned).await {
            Ok(Some(m)) => decode(&m.payload, m.subject.as_str()).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(ReadError::Nats(format!("final result of {job_id}: {e}"))),
        }
    }

    /// Completion events of `job_id` on `events.done.<worker>` (every worker when `None`),
    /// stored since `since_ms`; reads at most `budget` events and stops early once `done`
    /// says the story is complete.
    pub async fn completions_of(
        &self,
        job_id: &str,
        worker: Option<&str>,
        since_ms: u64,
        budget: usize,
        done: impl Fn(&CompletionEvent) -> bool,
    ) -> Result<Vec<CompletionEvent>, ReadError> {
        let filter = match worker {
            Some(w) => names::event_done_subject(w),
            None => names::SUBJECT_EVENTS_DONE_ALL.to_string(),
        };
        let mut found = Vec::new();
        self.scan(
            STREAM_EVENTS,
            &filter,
            by_start_time(since_ms)?,
            budget,
            |payload| {
                // Events of other jobs are skipped without a full decode error.
                if let Ok(e) = serde_json::from_slice::<CompletionEvent>(payload) {
                    if e.job_id == job_id {
                        let stop = done(&e);
                        found.push(e);
                        return !stop;
                    }
                }
                true
            },
        )
        .await?;
        Ok(found)
    }

    /// Decisions stored since `since_ms` (at most `budget`), oldest first, decoded as `T`
    /// (a whole [`Decision`] or only the fields a view needs).
    pub async fn decisions_since<T: DeserializeOwned>(
        &self,
        since_ms: u64,
        budget: usize,
    ) -> Result<Vec<T>, ReadError> {
        let policy = by_start_time(since_ms)?;
        self.decisions_from(policy, budget).await
    }

    /// The last `window` decisions of the stream, oldest first.
    pub async fn last_decisions(&self, window: u64) -> Result<Vec<Decision>, ReadError> {
        let mut stream = self.stream(STREAM_DECISIONS).await?;
        let state = stream
            .info()
            .await
            .map_err(|e| ReadError::Nats(format!("stream {STREAM_DECISIONS}: {e}")))?
            .state
            .clone();
        if state.messages == 0 || window == 0 {
            return Ok(Vec::new());
        }
        let start = state
            .last_sequence
            .saturating_sub(window - 1)
            .max(state.first_sequence);
        self.decisions_from(
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            window as usize,
        )
        .await
    }

    async fn decisions_from<T: DeserializeOwned>(
        &self,
        policy: consumer::DeliverPolicy,
        budget: usize,
    ) -> Result<Vec<T>, ReadError> {
        let mut out = Vec::new();
        self.scan(
            STREAM_DECISIONS,
            names::SUBJECT_DECISIONS_ALL,
            policy,
            budget,
            |payload| {
                // A record this version cannot read is skipped, not fatal: the stream outlives
                // any one version of the CLI.
                if let Ok(d) = serde_json::from_slice::<T>(payload) {
                    out.push(d);
                }
                true
            },
        )
        .await?;
        Ok(out)
    }

    /// Read `stream` from `policy` through an ordered consumer until its end, `budget`
    /// messages, or `each` returns false.
    async fn scan(
        &self,
        name: &str,
        filter: &str,
        policy: consumer::DeliverPolicy,
        budget: usize,
        mut each: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), ReadError> {
        let stream = self.stream(name).await?;
        let c = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: filter.to_string(),
                deliver_policy: policy,
                ..Default::default()
            })
            .await
            .map_err(|e| ReadError::Nats(format!("reading {name}: {e}")))?;
        if c.cached_info().num_pending == 0 || budget == 0 {
            return Ok(());
        }
        let mut messages = c
            .messages()
            .await
            .map_err(|e| ReadError::Nats(format!("reading {name}: {e}")))?;
        let mut read = 0;
        loop {
            let m = match tokio::time::timeout(QUIET, messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => return Err(ReadError::Nats(format!("reading {name}: {e}"))),
                Ok(None) | Err(_) => return Ok(()),
            };
            read += 1;
            let pending = m.info().map(|i| i.pending).unwrap_or(0);
            if !each(&m.payload) || pending == 0 || read >= budget {
                return Ok(());
            }
        }
    }

    /// Live decisions (core subscription on `decisions.>`, as an auditor would).
    pub async fn follow_decisions(&self) -> Result<async_nats::Subscriber, ReadError> {
        self.client
            .subscribe(names::SUBJECT_DECISIONS_ALL)
            .await
            .map_err(|e| {
                ReadError::Nats(format!("subscribe {}: {e}", names::SUBJECT_DECISIONS_ALL))
            })
    }

    /// Every heartbeat in the `workers` bucket with its age (server time of the write
    /// against `now_ms`). Entries that do not decode are skipped and counted.
    pub async fn workers(
        &self,
        now_ms: u64,
    ) -> Result<(Vec<(WorkerStatus, u64)>, usize), ReadError> {
        let kv = self
            .js
            .get_key_value(names::BUCKET_WORKERS)
            .await
            .map_err(|e| ReadError::Nats(format!("bucket {}: {e}", names::BUCKET_WORKERS)))?;
        let mut keys = kv
            .keys()
            .await
            .map_err(|e| ReadError::Nats(format!("bucket {}: {e}", names::BUCKET_WORKERS)))?;
        let mut out = Vec::new();
        let mut unreadable = 0;
        while let Some(key) = keys.next().await {
            let Ok(key) = key else { continue };
            let Ok(Some(entry)) = kv.entry(key).await else {
                continue;
            };
            if entry.value.is_empty() {
                continue;
            }
            match serde_json::from_slice::<WorkerStatus>(&entry.value) {
                Ok(s) => {
                    let stored_ms =
                        (entry.created.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
                    out.push((s, now_ms.saturating_sub(stored_ms)));
                }
                Err(_) => unreadable += 1,
            }
        }
        Ok((out, unreadable))
    }

    /// The leader's per-model queue snapshots in the `queues` bucket (none when the bucket
    /// does not exist yet). Entries that are not valid snapshots are skipped and counted.
    pub async fn queues(&self) -> Result<(Vec<QueueSnapshot>, usize), ReadError> {
        let Ok(kv) = self.js.get_key_value(names::BUCKET_QUEUES).await else {
            return Ok((Vec::new(), 0));
        };
        let mut keys = kv
            .keys()
            .await
            .map_err(|e| ReadError::Nats(format!("bucket {}: {e}", names::BUCKET_QUEUES)))?;
        let mut out = Vec::new();
        let mut unreadable = 0;
        while let Some(key) = keys.next().await {
            let Ok(key) = key else { continue };
            let Ok(Some(value)) = kv.get(key).await else {
                continue;
            };
            if value.is_empty() {
                continue;
            }
            match QueueSnapshot::parse(&value) {
                Ok(s) => out.push(s),
                Err(_) => unreadable += 1,
            }
        }
        Ok((out, unreadable))
    }

    /// The lease in the `leader` bucket, with the epoch from the newest decision.
    pub async fn leader(&self) -> Result<Option<Leader>, ReadError> {
        let kv = self
            .js
            .get_key_value(names::BUCKET_LEADER)
            .await
            .map_err(|e| ReadError::Nats(format!("bucket {}: {e}", names::BUCKET_LEADER)))?;
        let entry = match kv.entry(names::LEADER_KEY).await {
            Ok(Some(e)) if !e.value.is_empty() => e,
            Ok(_) => return Ok(None),
            Err(e) => {
                return Err(ReadError::Nats(format!(
                    "bucket {}: {e}",
                    names::BUCKET_LEADER
                )))
            }
        };
        let lease: LeaseValue = decode(&entry.value, "the leader lease")?;
        let epoch = self
            .newest_decision()
            .await?
            .filter(|d| d.dispatcher_id == lease.dispatcher_id)
            .map(|d| d.epoch);
        Ok(Some(Leader {
            holder: lease.dispatcher_id,
            acquired_ms: lease.acquired_ms,
            renewed_ms: lease.renewed_ms,
            lease_revision: entry.revision,
            epoch,
        }))
    }

    async fn newest_decision(&self) -> Result<Option<Decision>, ReadError> {
        let mut stream = self.stream(STREAM_DECISIONS).await?;
        let last = stream
            .info()
            .await
            .map_err(|e| ReadError::Nats(format!("stream {STREAM_DECISIONS}: {e}")))?
            .state
            .last_sequence;
        if last == 0 {
            return Ok(None);
        }
        match stream.direct_get(last).await {
            Ok(m) => Ok(serde_json::from_slice(&m.payload).ok()),
            Err(_) => Ok(None),
        }
    }

    /// Jobs in the JOBS stream: submitted and not yet decided, all models together.
    pub async fn jobs_waiting(&self) -> Result<Option<u64>, ReadError> {
        match self.js.get_stream(STREAM_JOBS).await {
            Ok(mut s) => Ok(s.info().await.ok().map(|i| i.state.messages)),
            Err(_) => Ok(None),
        }
    }
}

/// `DeliverPolicy::ByStartTime` from Unix ms, built through the policy's own serde form so
/// the CLI needs no date-time crate of its own.
fn by_start_time(since_ms: u64) -> Result<consumer::DeliverPolicy, ReadError> {
    let rfc3339 = crate::fmt::utc(since_ms).replace(' ', "T");
    serde_json::from_value(serde_json::json!({
        "deliver_policy": "by_start_time",
        "opt_start_time": rfc3339,
    }))
    .map_err(|e| ReadError::Nats(format!("start time {rfc3339}: {e}")))
}

fn decode<T: DeserializeOwned>(payload: &[u8], what: &str) -> Result<T, ReadError> {
    serde_json::from_slice(payload).map_err(|e| ReadError::Decode {
        what: what.to_string(),
        message: e.to_string(),
    })
}

/// The EWMAs of each worker from Redis (`<prefix>:ewma:<worker_id>`); a worker without
/// samples is absent from the map.
pub async fn ewmas(
    redis_url: &str,
    tls: &metronome_runtime::redis::RedisTls,
    prefix: &str,
    workers: &[String],
) -> Result<HashMap<String, Ewma>, ReadError> {
    let client = tls
        .client(redis_url)
        .map_err(|e| ReadError::Redis(e.to_string()))?;
    let read = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        let mut out = HashMap::new();
        for w in workers {
            let h: HashMap<String, String> = redis::cmd("HGETALL")
                .arg(redis_keys::ewma_key(prefix, w))
                .query_async(&mut conn)
                .await?;
            if h.is_empty() {
                continue;
            }
            let f = |k: &str| h.get(k).and_then(|v| v.parse::<f64>().ok());
            out.insert(
                w.clone(),
                Ewma {
                    ttft_ms: f(redis_keys::FIELD_TTFT_MS),
                    tpot_ms: f(redis_keys::FIELD_TPOT_MS),
                    tok_s: f(redis_keys::FIELD_TOK_S),
                    samples: f(redis_keys::FIELD_SAMPLES).map(|v| v as u64),
                },
            );
        }
        Ok::<_, redis::RedisError>(out)
    };
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(ReadError::Redis(e.to_string())),
        Err(_) => Err(ReadError::Redis(format!(
            "{redis_url}: no answer within 5 s"
        ))),
    }
}
