//! Metronome's dispatcher: the single leader that admits, scores, reserves and assigns
//! every job published on `jobs.submit`, and records each decision.
//!
//! [`run`] (or [`start`], which also hands back the metrics address) runs one instance:
//! it stands by until it holds the lease ([`leader`]), then runs a *term*: it rebuilds its
//! state (workers bucket, Redis EWMAs, in-flight jobs from heartbeats), recreates the JOBS
//! consumer so unacknowledged jobs come back in order ([`intake`]), and decides in one
//! loop ([`engine`]) until shutdown or until the lease is lost, when it stands by again. If
//! an internal task of the term dies ([`supervise`]), the term ends too and the leader
//! steps down, rather than hold the lease while deciding nothing.
//! A term never carries state into the next: everything is rebuilt from NATS and Redis.

pub mod cache_feed;
pub mod config;
pub mod consumer_sweep;
pub mod deciding;
pub mod engine;
pub mod epoch_history;
pub mod fairness_store;
pub mod intake;
pub mod leader;
pub mod metrics;
pub mod publish;
pub mod queue;
pub mod queue_store;
pub mod recent;
pub mod refusals;
pub mod registry;
pub mod supervise;
pub mod tenant_limits;
pub mod trace_spans;
pub mod worker_claims;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use metronome_protocol::setup::{ensure_all, Buckets, StreamSettings};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use config::{Config, ConfigError, FieldError};
pub use metrics::Metrics;

/// Why the dispatcher stopped.
#[derive(Debug, thiserror::Error)]
pub enum DispatcherError {
    #[error("invalid configuration: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Config(Vec<FieldError>),
    #[error("connecting to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("NATS: {0}")]
    Nats(String),
    #[error("Redis: {0}")]
    Redis(String),
    #[error("creating streams and buckets: {0}")]
    Setup(#[from] metronome_protocol::setup::SetupError),
    #[error("metrics endpoint: {0}")]
    Metrics(std::io::Error),
    #[error("an internal task of the term died: {0}")]
    TaskDied(String),
}

impl DispatcherError {
    /// True for failures that may pass by themselves (a server still starting).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            DispatcherError::Connect { .. } | DispatcherError::Nats(_) | DispatcherError::Redis(_)
        )
    }
}

/// A started dispatcher.
pub struct Running {
    /// Address of `/metrics`, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    pub dispatcher_id: String,
    task: tokio::task::JoinHandle<Result<(), DispatcherError>>,
}

impl Running {
    /// Wait until the dispatcher stops (after `shutdown` is cancelled).
    pub async fn join(self) -> Result<(), DispatcherError> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(DispatcherError::Nats(format!(
                "dispatcher task failed: {e}"
            ))),
        }
    }
}

/// Run one dispatcher until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DispatcherError> {
    start(config, shutdown).await?.join().await
}

/// Connect, create the contract's streams and buckets, start the metrics endpoint and
/// the leadership loop in the background.
pub async fn start(
    config: Config,
    shutdown: CancellationToken,
) -> Result<Running, DispatcherError> {
    config.validate().map_err(DispatcherError::Config)?;
    let provisioning = config
        .provisioning()
        .map_err(|e| DispatcherError::Config(vec![e]))?
        .map(Arc::new);
    match &provisioning {
        Some(p) => tracing::info!(
            workers = p.workers.len(),
            "heartbeats are checked against the provisioning record: a worker claiming another model, a higher cap or no record takes no work"
        ),
        None => tracing::warn!(
            "no provisioning_file: every worker's heartbeat is believed (its model and max_concurrency)"
        ),
    }
    let dispatcher_id = config.effective_id();
    let options = config
        .nats_auth
        .connect_options()
        .map_err(|e| DispatcherError::Connect {
            url: config.nats_url.clone(),
            message: e.to_string(),
        })?;
    let client = options
        .name(dispatcher_id.clone())
        .connect(metronome_runtime::nats::server_urls(&config.nats_url))
        .await
        .map_err(|e| DispatcherError::Connect {
            url: config.nats_url.clone(),
            message: e.to_string(),
        })?;
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(5))
        .max_ack_inflight(20_000)
        .backpressure_on_inflight(true)
        .build(client.clone());
    let settings = StreamSettings {
        storage: match config.storage {
            config::Storage::File => jetstream::stream::StorageType::File,
            config::Storage::Memory => jetstream::stream::StorageType::Memory,
        },
        leader_ttl: Duration::from_millis(config.lease_ttl_ms),
        replicas: config.stream_replicas,
        results_max_bytes: config.results_max_bytes,
        events_max_bytes: config.events_max_bytes,
        events_max_per_worker: config.events_max_per_worker,
        ..StreamSettings::default()
    };
    let buckets = ensure_all(&js, &settings).await?;
    if metronome_protocol::setup::upgrade_jobs_stream(&js).await? {
        tracing::info!(
            "brought the JOBS stream (created by an older version) to this contract: jobs.submit.*, jobs.retry, discard new"
        );
    }
    if metronome_protocol::setup::upgrade_results_stream(&js).await? {
        tracing::info!(
            "brought the RESULTS stream (created by an older protocol version) to this contract: results.*.*.*.final"
        );
    }
    for stream in metronome_protocol::setup::apply_stream_limits(&js, &settings).await? {
        tracing::info!(
            stream,
            results_max_bytes = config.results_max_bytes,
            events_max_bytes = config.events_max_bytes,
            events_max_per_worker = config.events_max_per_worker,
            "bounded a stream in bytes (and EVENTS per worker) as configured"
        );
    }
    if let Some(old) = metronome_protocol::setup::align_leader_ttl(&js, settings.leader_ttl).await?
    {
        tracing::warn!(
            old_ms = old.as_millis() as u64,
            lease_ttl_ms = config.lease_ttl_ms,
            "the leader bucket's TTL was not this dispatcher's lease TTL: changed (dispatchers with different lease_ttl_ms would keep changing it)"
        );
    }
    let metrics = Metrics::new();
    let metrics_addr = match &config.metrics_addr {
        Some(addr) => Some(
            metrics::serve(addr, metrics.clone(), shutdown.clone())
                .await
                .map_err(DispatcherError::Metrics)?,
        ),
        None => None,
    };
    tracing::info!(dispatcher_id, nats = %config.nats_url, policy = %config.policy, ?metrics_addr, "dispatcher started");
    let ctx = Ctx {
        config,
        provisioning,
        dispatcher_id: dispatcher_id.clone(),
        client,
        js,
        buckets,
        metrics: metrics.clone(),
    };
    let task = tokio::spawn(lead_loop(ctx, shutdown));
    Ok(Running {
        metrics_addr,
        metrics,
        dispatcher_id,
        task,
    })
}

struct Ctx {
    config: Config,
    /// The provisioning record, read at start (`Config::provisioning_file`).
    provisioning: Option<Arc<metronome_scheduler::Provisioning>>,
    dispatcher_id: String,
    client: async_nats::Client,
    js: jetstream::Context,
    buckets: Buckets,
    metrics: Arc<Metrics>,
}

async fn lead_loop(ctx: Ctx, shutdown: CancellationToken) -> Result<(), DispatcherError> {
    let timing = leader::LeaseTiming {
        renew: Duration::from_millis(ctx.config.lease_renew_ms),
        fence_after: Duration::from_millis(ctx.config.fence_after_ms),
        standby_poll: Duration::from_millis(ctx.config.standby_poll_ms),
    };
    loop {
        let Some(lead) =
            leader::acquire(&ctx.buckets.leader, &ctx.dispatcher_id, timing, &shutdown).await
        else {
            break;
        };
        ctx.metrics.epoch.store(lead.epoch, Relaxed);
        ctx.metrics.is_leader.store(1, Relaxed);
        let term = CancellationToken::new();
        {
            let (term, lost, shutdown) = (term.clone(), lead.lost.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = lost.cancelled() => {}
                    _ = shutdown.cancelled() => {}
                    _ = term.cancelled() => {}
                }
                term.cancel();
            });
        }
        let term_run = run_term(
            &ctx,
            lead.epoch,
            lead.fence.clone(),
            &lead.record,
            term.clone(),
        );
        if let Err(error) = term_run.await {
            tracing::error!(%error, epoch = lead.epoch, "leadership term failed; standing by");
        }
        term.cancel();
        ctx.metrics.is_leader.store(0, Relaxed);
        ctx.metrics.epoch.store(0, Relaxed);
        if shutdown.is_cancelled() {
            lead.resign(&ctx.buckets.leader).await;
            break;
        }
        // Lost or failed: let the lease go so another instance (or this one) can lead.
        lead.resign(&ctx.buckets.leader).await;
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(timing.standby_poll) => {}
        }
    }
    tracing::info!(dispatcher_id = %ctx.dispatcher_id, "dispatcher stopped");
    Ok(())
}

/// How long a new term may take to list the workers bucket. A key-listing consumer on
/// nats-server 2.9 can stall for good (nats-io/nats-server#3481; seen once here: a leader
/// silent after taking the lease, renewing it, so no standby took over). The listing no
/// longer uses one (`registry::load_workers`); this bound stays as the backstop: past it
/// the term fails, the lease is let go and leadership is tried again.
const LOAD_WORKERS_WITHIN: Duration = Duration::from_secs(10);
/// The most a takeover waits for the workers' stored cache reports (a few MB at most).
const CACHE_BACKLOG_WITHIN: Duration = Duration::from_secs(2);

/// One leadership term: rebuild, then decide until `term` is cancelled.
async fn run_term(
    ctx: &Ctx,
    epoch: u64,
    fence: Arc<leader::Fence>,
    record: &leader::EpochRecord,
    term: CancellationToken,
) -> Result<(), DispatcherError> {
    let c = &ctx.config;
    let (tx, rx) = mpsc::channel(65_536);
    let tasks = supervise::TermTasks::new(term.clone(), ctx.metrics.clone());
    let (publisher, publisher_task) = publish::Publisher::start(
        ctx.js.clone(),
        ctx.client.clone(),
        ctx.buckets.workers.clone(),
        tx.clone(),
        ctx.metrics.clone(),
        publish::DEFAULT_CAPACITY,
    );
    tasks.watch("publisher", publisher_task);
    // Completions first, so none that happens after the workers are loaded is missed.
    tasks.watch(
        "completions",
        intake::spawn_completions(&ctx.js, tx.clone(), ctx.metrics.clone(), term.clone()).await?,
    );
    tasks.watch(
        "cancellations",
        intake::spawn_cancels(&ctx.client, tx.clone(), term.clone()).await?,
    );
    let (mut workers, last_revision) =
        registry::load_workers_within(&ctx.buckets.workers, &ctx.metrics, LOAD_WORKERS_WITHIN)
            .await?;
    // The jobs the heartbeats claim, checked against the decisions on record before the
    // engine adopts any (registry::Vouching).
    let decisions = ctx
        .js
        .get_stream_no_info(metronome_protocol::names::STREAM_DECISIONS)
        .await
        .map_err(|e| DispatcherError::Nats(format!("DECISIONS: {e}")))?;
    let mut vouching = registry::Vouching::new(decisions);
    for update in &mut workers {
        vouching.check(update).await;
    }
    let workers_max_epoch = workers
        .iter()
        .filter_map(|u| match u {
            engine::WorkerUpdate::Put { status, .. } => Some(status.max_epoch),
            engine::WorkerUpdate::Gone { .. } => None,
        })
        .max()
        .unwrap_or(0);
    // Lifted above the epochs on record only, never above a worker's claim.
    let recorded_epoch = epoch_history::highest_on_record(&ctx.js)
        .await
        .map_err(DispatcherError::Nats)?;
    if workers_max_epoch > recorded_epoch.max(epoch) {
        ctx.metrics
            .epoch_claims_above_record_total
            .fetch_add(1, Relaxed);
        tracing::warn!(
            workers_max_epoch,
            recorded_epoch,
            "a heartbeat claims an epoch above every epoch on record: not believed"
        );
    }
    let lease_revision = epoch;
    let epoch = leader::term_epoch(lease_revision, recorded_epoch);
    if epoch != lease_revision {
        tracing::warn!(
            epoch,
            recorded_epoch,
            "the lease revision is not above the latest epoch on record (the leader bucket was rebuilt?): leading with a higher epoch"
        );
        ctx.metrics.epoch.store(epoch, Relaxed);
    }
    // Before any assignment: agents believe an epoch they have not seen only when the
    // lease vouches for it.
    record.set(epoch);
    let mut reader = registry::EwmaReader::new(&c.redis_url, &c.redis_tls, &c.redis_prefix)?;
    let redis = registry::refresh_once(&mut reader, &ctx.metrics).await;
    let mut settings = engine::EngineSettings::from_config(c, epoch, ctx.dispatcher_id.clone());
    settings.provisioning = ctx.provisioning.clone();
    let saved_fairness = fairness_store::load(&ctx.buckets.fairness).await?;
    let (fairness_tx, fairness_rx) = tokio::sync::watch::channel(Default::default());
    // Not watched like the other tasks: it ends when the deciding loop does (its sender
    // dropped), after writing the last counters, and the term waits for that below.
    let fairness_writer = fairness_store::spawn_writer(
        ctx.buckets.fairness.clone(),
        fairness_rx,
        Duration::from_millis(c.fairness_persist_ms),
        fence.clone(),
        term.clone(),
    );
    let tick = settings.tick;
    let mut engine = engine::Engine::new(settings, ctx.metrics.clone(), Some(fence.clone()));
    engine.time_decisions(std::time::Instant::now);
    engine.fairness(saved_fairness);
    engine.load(workers, redis, metronome_protocol::time::unix_ms());
    // The workers' prefix caches as their model servers' events say: the latest snapshot
    // of each and the deltas after it, applied before the first decision of the term.
    let mut cache_feed = cache_feed::CacheFeed::open(&ctx.js)
        .await
        .map_err(DispatcherError::Nats)?;
    let reports = cache_feed.backlog(CACHE_BACKLOG_WITHIN, &ctx.metrics).await;
    let now = metronome_protocol::time::unix_ms();
    let read = reports.len();
    for update in reports {
        engine.handle(engine::Event::Cache(Box::new(update)), now);
    }
    tracing::info!(
        reports = read,
        workers = engine.reported_caches().workers(),
        "workers' prefix caches rebuilt from their reports"
    );
    tasks.watch(
        "cache reports",
        cache_feed.spawn(
            ctx.js.clone(),
            tx.clone(),
            ctx.metrics.clone(),
            term.clone(),
        ),
    );
    let (queues_tx, queues_rx) = tokio::sync::watch::channel(Vec::new());
    engine.queue_snapshots(c.queue_snapshot_ms, metronome_protocol::time::unix_ms());
    // Like the fairness writer, it ends with the deciding loop (its sender dropped) or the
    // term.
    let _consumer_sweep = consumer_sweep::spawn(ctx.js.clone(), ctx.metrics.clone(), term.clone());
    let _queue_writer = queue_store::spawn_writer(
        ctx.buckets.queues.clone(),
        queues_rx,
        fence.clone(),
        term.clone(),
    );
    tasks.watch(
        "workers watch",
        registry::spawn_watch(
            ctx.buckets.workers.clone(),
            last_revision + 1,
            vouching,
            ctx.metrics.clone(),
            tx.clone(),
            term.clone(),
        ),
    );
    tasks.watch(
        "EWMA refresher",
        registry::spawn_ewma_refresher(
            reader,
            Duration::from_millis(c.ewma_refresh_ms),
            ctx.metrics.clone(),
            tx.clone(),
            term.clone(),
        ),
    );
    let (consumer, backlog) = intake::recreate_jobs_consumer(
        &ctx.js,
        Duration::from_millis(c.ack_wait_ms),
        c.max_ack_pending,
    )
    .await?;
    // Nothing left by an earlier leader: nothing to read first.
    if c.backlog_read_wait_ms > 0 && backlog.messages > 0 {
        engine.read_backlog_first(
            metronome_protocol::time::unix_ms().saturating_add(c.backlog_read_wait_ms),
        );
    }
    let reject = intake::RejectContext {
        publisher: publisher.clone(),
        metrics: ctx.metrics.clone(),
        dispatcher_id: ctx.dispatcher_id.clone(),
        epoch,
        policy: c.policy.as_str().to_string(),
    };
    let seen_before = intake::SeenBefore {
        decisions: ctx
            .js
            .get_stream(metronome_protocol::names::STREAM_DECISIONS)
            .await
            .map_err(|e| DispatcherError::Nats(format!("DECISIONS stream: {e}")))?,
        backlog,
    };
    tasks.watch(
        "JOBS intake",
        intake::spawn_jobs(
            consumer,
            c.job_limits,
            tenant_limits::TenantLimits::new(c.tenant_limits.clone(), c.default_tenant_limits),
            reject,
            seen_before,
            tx,
            term.clone(),
        ),
    );
    tracing::info!(epoch, dispatcher_id = %ctx.dispatcher_id, "leading: deciding");
    let writers = deciding::Writers {
        fairness: fairness_tx,
        queues: queues_tx,
    };
    deciding::run(engine, publisher.clone(), writers, tick, rx, term).await;
    if tokio::time::timeout(Duration::from_secs(2), fairness_writer)
        .await
        .is_err()
    {
        tracing::warn!("the last fairness counters were not written in time");
    }
    publisher.drain(Duration::from_secs(3)).await;
    match tasks.failure() {
        Some(why) => Err(DispatcherError::TaskDied(why)),
        None => Ok(()),
    }
}
