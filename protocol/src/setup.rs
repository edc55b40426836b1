//! Idempotent creation of every stream and KV bucket of the contract.
//!
//! Each component calls [`ensure_all`] at start, so they can start in any order. Creating
//! what already exists is a no-op; an existing stream is left as it is (an operator may
//! have tuned its limits).
//!
//! Replicas: on a NATS cluster every stream and bucket is created with
//! [`StreamSettings::replicas`] copies (3 on a three-node cluster), so losing the node that
//! leads a stream loses nothing and the other copies elect a new leader; on one server it
//! is 1. nats-server refuses a stream with more replicas than it has JetStream nodes, so a
//! setting that does not fit the cluster fails at start with the server's reason. An
//! existing stream with fewer copies than configured is reported (a warning naming it), not
//! changed: raising a stream's replicas copies its data to other nodes, an operator's
//! decision (docs/PROVISIONING.md).

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use crate::names::*;

/// Retention settings of the contract's streams and buckets.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// Storage of every stream (file in production, memory acceptable for tests).
    pub storage: stream::StorageType,
    /// Window in which a repeated `Nats-Msg-Id` is dropped as a duplicate.
    pub duplicate_window: Duration,
    /// How long decisions are kept for audit.
    pub decisions_max_age: Duration,
    /// How long final results are kept for late readers.
    pub results_max_age: Duration,
    /// How long completion events are kept.
    pub events_max_age: Duration,
    /// Most bytes RESULTS keeps (the oldest finals go first): any worker may store finals
    /// under its own id, as many as it likes, so the stream needs a bound besides its age.
    pub results_max_bytes: i64,
    /// Most bytes EVENTS keeps (the oldest events go first).
    pub events_max_bytes: i64,
    /// Most events EVENTS keeps per worker (`events.done.<worker_id>`, the oldest of that
    /// worker's go first): a worker flooding its own subject evicts only its own events.
    pub events_max_per_worker: i64,
    /// How long CACHE_DELTAS keeps a worker's cache changes: a new leader reads the
    /// latest snapshot and every delta after it, so this must exceed the agents'
    /// snapshot interval by a margin.
    pub cache_deltas_max_age: Duration,
    /// Most bytes CACHE_DELTAS keeps (the oldest go first).
    pub cache_deltas_max_bytes: i64,
    /// Most deltas CACHE_DELTAS keeps per worker: a worker flooding its own subject pushes
    /// out only its own.
    pub cache_deltas_max_per_worker: i64,
    /// Most bytes CACHE_SNAPSHOTS keeps (one snapshot per worker, each at most ~620 KB).
    pub cache_snapshots_max_bytes: i64,
    /// A worker whose heartbeat is older than this vanishes from the `workers` bucket.
    pub workers_max_age: Duration,
    /// Lifetime of the leader lease if it is not renewed.
    pub leader_ttl: Duration,
    /// A model's queue snapshot not rewritten for this long vanishes (a model no leader
    /// serves any more); a live leader rewrites each one every second.
    pub queues_max_age: Duration,
    /// Largest message accepted on `jobs.submit.<tenant>`; larger publishes are refused by the
    /// server with an error the publisher sees.
    pub max_job_bytes: i32,
    /// Copies of every stream and bucket this component creates: 1 on a single server,
    /// 3 on a three-node cluster ([`check_replicas`]).
    pub replicas: usize,
}

/// Most replicas JetStream allows a stream.
pub const MAX_REPLICAS: usize = 5;

/// Why `replicas` is not a usable replica count, or `None`: JetStream keeps 1 to 5 copies
/// of a stream. An even count is refused as well: it survives no more lost nodes than the
/// odd count below it (a majority of 2 is 2, of 4 is 3) while writing one more copy.
pub fn check_replicas(replicas: usize) -> Option<String> {
    if replicas == 0 || replicas > MAX_REPLICAS {
        Some(format!(
            "{replicas} is not a replica count: JetStream keeps 1 to {MAX_REPLICAS} copies"
        ))
    } else if replicas % 2 == 0 {
        Some(format!(
            "{replicas} replicas survive no more lost nodes than {}: use 1, 3 or 5",
            replicas - 1
        ))
    } else {
        None
    }
}

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            decisions_max_age: Duration::from_secs(24 * 3600),
            results_max_age: Duration::from_secs(600),
            events_max_age: Duration::from_secs(3600),
            // Finals of ~4 kB at 100 jobs/s for the 10 minutes they are kept: 240 MB.
            results_max_bytes: 512 * 1024 * 1024,
            events_max_bytes: 256 * 1024 * 1024,
            // Far more than a worker finishes while a leader is away; consumed events stay
            // until their max age, so a busy worker reaches it and drops only those.
            events_max_per_worker: 100_000,
            // Six snapshot intervals of the agents' default (10 s).
            cache_deltas_max_age: Duration::from_secs(60),
            cache_deltas_max_bytes: 256 * 1024 * 1024,
            // A minute of deltas at 10 a second, with room for bursts.
            cache_deltas_max_per_worker: 10_000,
            cache_snapshots_max_bytes: 1024 * 1024 * 1024,
            workers_max_age: Duration::from_secs(15),
            // The dispatcher's default `lease_ttl_ms`: a bucket created by another
            // component needs no alignment.
            leader_ttl: Duration::from_millis(2_500),
            queues_max_age: Duration::from_secs(600),
            max_job_bytes: 8 * 1024 * 1024,
            replicas: 1,
        }
    }
}

/// Errors from setting up the streams.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("creating stream {name}: {source}")]
    Stream {
        name: &'static str,
        source: jetstream::context::CreateStreamError,
    },
    #[error("creating KV bucket {name}: {source}")]
    Bucket {
        name: &'static str,
        source: jetstream::context::CreateKeyValueError,
    },
    #[error("opening KV bucket {name}: {source}")]
    OpenBucket {
        name: &'static str,
        source: jetstream::context::KeyValueError,
    },
    #[error("adding this version's subjects to stream {name}: {reason}")]
    Upgrade { name: &'static str, reason: String },
}

/// The KV buckets of the contract, opened.
#[derive(Clone)]
pub struct Buckets {
    pub workers: kv::Store,
    pub leader: kv::Store,
    pub fairness: kv::Store,
    pub queues: kv::Store,
}

/// Create (or find) every stream and bucket.
pub async fn ensure_all(
    js: &jetstream::Context,
    s: &StreamSettings,
) -> Result<Buckets, SetupError> {
    for config in stream_configs(s) {
        let name = static_name(&config.name);
        ensure_stream(js, name, config).await?;
    }
    let workers = ensure_bucket(js, BUCKET_WORKERS, s.workers_max_age, s).await?;
    let leader = ensure_bucket(js, BUCKET_LEADER, s.leader_ttl, s).await?;
    // Counters are kept until overwritten: a failover may come at any time.
    let fairness = ensure_bucket(js, BUCKET_FAIRNESS, Duration::ZERO, s).await?;
    let queues = ensure_bucket(js, BUCKET_QUEUES, s.queues_max_age, s).await?;
    // Keys are kept until revoked or deleted. Not fatal when it cannot be made: a gateway
    // may not create streams (`permissions`), and one started before any dispatcher of a
    // version that creates this bucket serves its configuration file's keys alone until
    // the bucket appears (its key watch keeps opening it).
    if let Err(error) = ensure_bucket(js, BUCKET_API_KEYS, Duration::ZERO, s).await {
        tracing::warn!(%error, "the api_keys bucket is missing and could not be created: API keys from the configuration file only, until a dispatcher creates it");
    }
    if s.replicas > 1 {
        for (name, have) in under_replicated(js, s.replicas).await {
            tracing::warn!(
                stream = name,
                replicas = have,
                configured = s.replicas,
                "an existing stream keeps fewer copies than configured: losing its node loses it (raise its replicas, docs/PROVISIONING.md)"
            );
        }
    }
    Ok(Buckets {
        workers,
        leader,
        fairness,
        queues,
    })
}

/// The buckets a worker-agent uses.
#[derive(Clone)]
pub struct WorkerBuckets {
    pub workers: kv::Store,
    pub leader: kv::Store,
}

/// Create (or find) what a worker-agent uses: the WORK stream it pulls from, the EVENTS
/// stream it reports to, the cache streams it forwards its model server's prefix cache
/// to, and the `workers` and `leader` buckets. Not JOBS, DECISIONS or
/// RESULTS: their info, asked with a subjects filter, lists every tenant's job ids, which
/// a worker identity may not read (`permissions`).
pub async fn ensure_for_worker(
    js: &jetstream::Context,
    s: &StreamSettings,
) -> Result<WorkerBuckets, SetupError> {
    for config in stream_configs(s) {
        let name = static_name(&config.name);
        if matches!(
            name,
            STREAM_WORK | STREAM_EVENTS | STREAM_CACHE_DELTAS | STREAM_CACHE_SNAPSHOTS
        ) {
            ensure_stream(js, name, config).await?;
        }
    }
    Ok(WorkerBuckets {
        workers: ensure_bucket(js, BUCKET_WORKERS, s.workers_max_age, s).await?,
        leader: ensure_bucket(js, BUCKET_LEADER, s.leader_ttl, s).await?,
    })
}

/// The contract's streams, as `s` configures them.
fn stream_configs(s: &StreamSettings) -> [stream::Config; 7] {
    [
        stream::Config {
            name: STREAM_JOBS.into(),
            subjects: JOBS_SUBJECTS.iter().map(|s| s.to_string()).collect(),
            retention: stream::RetentionPolicy::WorkQueue,
            storage: s.storage,
            num_replicas: s.replicas,
            duplicate_window: s.duplicate_window,
            max_message_size: s.max_job_bytes,
            // At its limits (an operator's max_msgs/max_bytes, the server's storage) a work
            // queue refuses new messages, and the publisher sees it; the default (discard
            // old) would delete the oldest queued jobs without a word.
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_WORK.into(),
            subjects: vec![SUBJECT_WORK_ALL.into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: s.storage,
            num_replicas: s.replicas,
            duplicate_window: s.duplicate_window,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_DECISIONS.into(),
            subjects: vec![SUBJECT_DECISIONS_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            storage: s.storage,
            num_replicas: s.replicas,
            max_age: s.decisions_max_age,
            duplicate_window: s.duplicate_window,
            allow_direct: true,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_RESULTS.into(),
            subjects: vec![SUBJECT_RESULTS_FINAL_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            storage: s.storage,
            num_replicas: s.replicas,
            max_age: s.results_max_age,
            // Discard old (the default): a flood of finals shortens how long the others
            // are kept for late readers; it never refuses a real worker's final.
            max_bytes: s.results_max_bytes,
            allow_direct: true,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_EVENTS.into(),
            subjects: vec![SUBJECT_EVENTS_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            storage: s.storage,
            num_replicas: s.replicas,
            max_age: s.events_max_age,
            // Discard old: the leader reads events as they come, so what a flood pushes
            // out is, unless the leader lags by the whole bound, already read.
            max_bytes: s.events_max_bytes,
            max_messages_per_subject: s.events_max_per_worker,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_CACHE_DELTAS.into(),
            subjects: vec![SUBJECT_CACHE_DELTAS_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            storage: s.storage,
            num_replicas: s.replicas,
            max_age: s.cache_deltas_max_age,
            // Discard old: a delta is worth less than the next; a gap is closed by the
            // next snapshot.
            max_bytes: s.cache_deltas_max_bytes,
            max_messages_per_subject: s.cache_deltas_max_per_worker,
            max_message_size: CACHE_MAX_MESSAGE_BYTES,
            ..Default::default()
        },
        stream::Config {
            name: STREAM_CACHE_SNAPSHOTS.into(),
            subjects: vec![SUBJECT_CACHE_SNAPSHOTS_ALL.into()],
            retention: stream::RetentionPolicy::Limits,
            storage: s.storage,
            num_replicas: s.replicas,
            // Only the latest snapshot of each worker counts.
            max_messages_per_subject: 1,
            max_bytes: s.cache_snapshots_max_bytes,
            max_message_size: CACHE_MAX_MESSAGE_BYTES,
            ..Default::default()
        },
    ]
}

/// Largest message the cache streams accept (a full snapshot is about 620 KB).
pub const CACHE_MAX_MESSAGE_BYTES: i32 = 1024 * 1024;

/// Every stream of the contract, the buckets' included (`KV_<bucket>`).
pub const ALL_STREAMS: [&str; 12] = [
    STREAM_JOBS,
    STREAM_WORK,
    STREAM_DECISIONS,
    STREAM_RESULTS,
    STREAM_EVENTS,
    STREAM_CACHE_DELTAS,
    STREAM_CACHE_SNAPSHOTS,
    "KV_workers",
    "KV_leader",
    "KV_fairness",
    "KV_queues",
    "KV_api_keys",
];

/// The contract's streams (and bucket streams) that exist with fewer than `replicas`
/// copies, with the copies each keeps. A stream that cannot be read is left out: the
/// setup that precedes this has already reported it.
pub async fn under_replicated(
    js: &jetstream::Context,
    replicas: usize,
) -> Vec<(&'static str, usize)> {
    let mut out = Vec::new();
    for name in ALL_STREAMS {
        if let Ok(mut stream) = js.get_stream(name).await {
            if let Ok(info) = stream.info().await {
                if info.config.num_replicas < replicas {
                    out.push((name, info.config.num_replicas));
                }
            }
        }
    }
    out
}

/// Subjects of the JOBS stream: every tenant's submissions, retries, and the version-1
/// submission subject (kept so that an old publisher's job is rejected with a reason).
pub const JOBS_SUBJECTS: [&str; 3] = [
    SUBJECT_JOBS_SUBMIT_ALL,
    SUBJECT_JOBS_RETRY,
    SUBJECT_JOBS_SUBMIT_V1,
];

/// Bring a JOBS stream created by an older version, which `ensure_all` leaves as it finds
/// it, to this contract: the subjects a newer contract gave it (`jobs.retry`,
/// `jobs.submit.*`), and `discard: new` (a full queue refuses new jobs instead of deleting
/// the oldest). Run by the dispatcher (the only role allowed to update JOBS) before it
/// leads: until then its retries would find no stream. Returns whether the stream was
/// updated.
pub async fn upgrade_jobs_stream(js: &jetstream::Context) -> Result<bool, SetupError> {
    let changed = amend_stream(js, STREAM_JOBS, |config| {
        let missing: Vec<String> = JOBS_SUBJECTS
            .into_iter()
            .filter(|w| !config.subjects.iter().any(|s| s == w))
            .map(String::from)
            .collect();
        config.subjects.extend(missing);
        config.discard = stream::DiscardPolicy::New;
    })
    .await?;
    Ok(changed.is_some())
}

/// Bring a RESULTS stream created by an older version (version 1: `results.*.final`, by
/// job id alone; version 2: `results.*.*.final`, no publisher) to this contract
/// (`results.*.*.*.final`: tenant, job, publisher). Nobody publishes on the old subjects any
/// more, so they are replaced, not kept. Run by the dispatcher (the only role allowed to
/// update RESULTS) before it leads: until then the workers' final results find no stream.
/// Returns whether the stream was updated.
pub async fn upgrade_results_stream(js: &jetstream::Context) -> Result<bool, SetupError> {
    let changed = amend_stream(js, STREAM_RESULTS, |config| {
        config
            .subjects
            .retain(|s| s != SUBJECT_RESULTS_FINAL_ALL_V1 && s != SUBJECT_RESULTS_FINAL_ALL_V2);
        if !config
            .subjects
            .iter()
            .any(|s| s == SUBJECT_RESULTS_FINAL_ALL)
        {
            config.subjects.push(SUBJECT_RESULTS_FINAL_ALL.into());
        }
    })
    .await?;
    Ok(changed.is_some())
}

/// Give RESULTS and EVENTS the byte and per-worker bounds of `s` (streams made by an
/// earlier version have none; a dispatcher's configuration may change them). Run by
/// dispatchers, the only role allowed to update these streams, at start. Returns the
/// streams it changed.
pub async fn apply_stream_limits(
    js: &jetstream::Context,
    s: &StreamSettings,
) -> Result<Vec<&'static str>, SetupError> {
    let mut changed = Vec::new();
    if amend_stream(js, STREAM_RESULTS, |config| {
        config.max_bytes = s.results_max_bytes;
    })
    .await?
    .is_some()
    {
        changed.push(STREAM_RESULTS);
    }
    if amend_stream(js, STREAM_EVENTS, |config| {
        config.max_bytes = s.events_max_bytes;
        config.max_messages_per_subject = s.events_max_per_worker;
    })
    .await?
    .is_some()
    {
        changed.push(STREAM_EVENTS);
    }
    Ok(changed)
}

/// Make the `leader` bucket's TTL the lease TTL a dispatcher is configured with. The bucket
/// keeps the TTL of whoever created it first (any component may, with the default), and a
/// TTL longer than the dispatcher's lease timing delays every failover, a shorter one lets a
/// standby take the lease from a healthy leader. Run by dispatchers (only they may update
/// it). Returns the TTL that was replaced, if any.
pub async fn align_leader_ttl(
    js: &jetstream::Context,
    ttl: Duration,
) -> Result<Option<Duration>, SetupError> {
    let old = amend_stream(js, STREAM_KV_LEADER, |config| {
        config.max_age = ttl;
        // A bucket's duplicate window is its max age when that is under two minutes, and
        // the server refuses a window longer than the max age: a shorter TTL takes both.
        config.duplicate_window = config.duplicate_window.min(ttl);
    })
    .await?;
    Ok(old.map(|old| old.max_age))
}

/// The stream behind the `leader` bucket (`KV_<bucket>`).
const STREAM_KV_LEADER: &str = "KV_leader";

/// Apply `change` to stream `name`'s configuration and update the stream if that changed
/// anything. Returns the configuration it replaced, if any.
async fn amend_stream(
    js: &jetstream::Context,
    name: &'static str,
    change: impl FnOnce(&mut stream::Config),
) -> Result<Option<stream::Config>, SetupError> {
    let upgrade = |e: String| SetupError::Upgrade { name, reason: e };
    let mut stream = js
        .get_stream(name)
        .await
        .map_err(|e| upgrade(e.to_string()))?;
    let old = stream
        .info()
        .await
        .map_err(|e| upgrade(e.to_string()))?
        .config
        .clone();
    let mut config = old.clone();
    change(&mut config);
    if config == old {
        return Ok(None);
    }
    js.update_stream(config)
        .await
        .map_err(|e| upgrade(e.to_string()))?;
    Ok(Some(old))
}

/// Create a stream unless it exists. Components start together, so two may race to create
/// the same stream; the loser's error (e.g. "subjects overlap") means the winner made it,
/// which a second lookup confirms.
async fn ensure_stream(
    js: &jetstream::Context,
    name: &'static str,
    config: stream::Config,
) -> Result<(), SetupError> {
    let mut attempt = 0;
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(_) => return Ok(()),
            Err(source) => {
                if js.get_stream(name).await.is_ok() {
                    return Ok(());
                }
                attempt += 1;
                if attempt >= 5 {
                    return Err(SetupError::Stream { name, source });
                }
                tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
            }
        }
    }
}

async fn ensure_bucket(
    js: &jetstream::Context,
    name: &'static str,
    max_age: Duration,
    s: &StreamSettings,
) -> Result<kv::Store, SetupError> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    let (storage, replicas) = (s.storage, s.replicas);
    match js
        .create_key_value(kv::Config {
            bucket: name.into(),
            history: 1,
            max_age,
            storage,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
    {
        Ok(store) => Ok(store),
        Err(source) => {
            // Another component may have created it between our lookup and our create.
            if let Ok(store) = js.get_key_value(name).await {
                return Ok(store);
            }
            // async-nats' `create_key_value` first reads the account info, whose reply from
            // nats-server 2.9 lacks fields the client requires; create the bucket's stream
            // directly with the same settings the client would use.
            create_bucket_stream(js, name, max_age, storage, replicas)
                .await
                .map_err(|_| SetupError::Bucket { name, source })
        }
    }
}

/// Create the stream backing KV bucket `name` (history 1, `replicas` copies) as async-nats
/// would, without the account-info request that fails against nats-server 2.9, then open
/// the bucket.
pub async fn create_bucket_stream(
    js: &jetstream::Context,
    name: &'static str,
    max_age: Duration,
    storage: stream::StorageType,
    replicas: usize,
) -> Result<kv::Store, jetstream::context::KeyValueError> {
    let config = stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        num_replicas: replicas,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    };
    if let Err(e) = js.get_or_create_stream(config).await {
        tracing::warn!(bucket = name, error = %e, "creating the bucket stream failed");
    }
    js.get_key_value(name).await
}

fn static_name(name: &str) -> &'static str {
    [
        STREAM_JOBS,
        STREAM_WORK,
        STREAM_DECISIONS,
        STREAM_RESULTS,
        STREAM_EVENTS,
        STREAM_CACHE_DELTAS,
        STREAM_CACHE_SNAPSHOTS,
    ]
    .into_iter()
    .find(|n| *n == name)
    .unwrap_or("?")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_buckets_stream_is_named_as_kv_names_it() {
        assert_eq!(STREAM_KV_LEADER, format!("KV_{BUCKET_LEADER}"));
    }

    #[test]
    fn every_bucket_stream_is_listed_as_kv_names_it() {
        for bucket in [
            BUCKET_WORKERS,
            BUCKET_LEADER,
            BUCKET_FAIRNESS,
            BUCKET_QUEUES,
            BUCKET_API_KEYS,
        ] {
            assert!(
                ALL_STREAMS.contains(&format!("KV_{bucket}").as_str()),
                "{bucket}"
            );
        }
    }

    #[test]
    fn replicas_are_an_odd_count_jetstream_keeps() {
        for ok in [1, 3, 5] {
            assert_eq!(check_replicas(ok), None, "{ok}");
        }
        for bad in [0, 2, 4, 6, 7] {
            assert!(check_replicas(bad).is_some(), "{bad}");
        }
        assert_eq!(StreamSettings::default().replicas, 1);
    }
}

/// A push consumer [`sweep_push_consumers`] deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweptConsumer {
    pub stream: String,
    pub consumer: String,
    pub deliver_subject: String,
}

/// Delete every push consumer of the contract's streams (KV buckets included) whose
/// deliver subject is not an inbox (`_INBOX.…`).
///
/// Why: nats-server delivers a push consumer's messages on the `deliver_subject` its
/// creator names in the request body, without checking the creator's publish permissions,
/// and a stream whose subjects match stores them (probed on nats-server 2.9.10: a worker's
/// consumer of its own WORK subject delivering on `jobs.submit.<tenant>` submitted jobs as
/// that tenant; the auditor's consumer of DECISIONS delivered decisions on another worker's
/// `work.<id>`). Every role that may create a consumer needs one only with an inbox
/// delivery (an ordered consumer) or none (a pull consumer), so anything else is an attack;
/// an inbox is only heard by its own user. The leader runs this periodically: a consumer
/// lives until the next sweep.
pub async fn sweep_push_consumers(
    js: &jetstream::Context,
) -> Result<Vec<SweptConsumer>, async_nats::Error> {
    use futures::StreamExt;
    let mut swept = Vec::new();
    let streams = [
        STREAM_JOBS.to_string(),
        STREAM_WORK.to_string(),
        STREAM_DECISIONS.to_string(),
        STREAM_RESULTS.to_string(),
        STREAM_EVENTS.to_string(),
        format!("KV_{BUCKET_WORKERS}"),
        format!("KV_{BUCKET_LEADER}"),
        format!("KV_{BUCKET_FAIRNESS}"),
        format!("KV_{BUCKET_QUEUES}"),
    ];
    for name in streams {
        // A stream that does not exist (yet) has no consumers.
        let Ok(stream) = js.get_stream(&name).await else {
            continue;
        };
        let mut consumers = stream.consumers();
        while let Some(info) = consumers.next().await {
            let info = info?;
            let Some(subject) = info.config.deliver_subject.as_deref() else {
                continue;
            };
            if subject.starts_with("_INBOX.") {
                continue;
            }
            stream.delete_consumer(&info.name).await?;
            swept.push(SweptConsumer {
                stream: name.clone(),
                consumer: info.name.clone(),
                deliver_subject: subject.to_string(),
            });
        }
    }
    Ok(swept)
}
