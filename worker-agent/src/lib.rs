//! metronome-worker-agent: one agent per GPU/model instance. It pulls its assignments from
//! its own durable consumer on `work.<worker_id>`, runs them on the local OpenAI-compatible
//! model server (vLLM, SGLang, TGI, llama.cpp or the bundled simulator), relays chunks and
//! results, publishes completion events, keeps the latency averages in Redis and heartbeats
//! the state the dispatcher scores on.
//!
//! Lifecycle: [`start`] connects, creates what is missing (streams, buckets, its consumer)
//! and spawns the loops; cancelling the shutdown token drains: draining is announced at
//! once, pulling stops, in-flight jobs finish (bounded by the drain timeout), a last
//! heartbeat is sent and the worker's key is deleted from the `workers` bucket. An operator
//! can drain (and undrain) a running agent without stopping it, on
//! `control.<worker_id>.drain` / `.undrain` (see `control.rs`).

pub mod agent;
pub mod assemble;
pub mod bound;
pub mod cache_report;
pub mod config;
mod control;
pub mod ewma_store;
pub mod gpu_probe;
mod heartbeat;
pub mod kv_events;
pub mod lifecycle;
pub mod load_tracker;
pub mod metrics;
pub mod metrics_scrape;
pub mod model_client;
pub mod perf_store;
mod probe;
mod probe_cache;
pub mod pull;
pub mod runner;
mod shared;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use metronome_protocol::setup::{ensure_for_worker, StreamSettings};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use agent::AgentError;
pub use config::{Config, ConfigError, FieldError, ServerKind};
pub use gpu_probe::{GpuProbe, NoGpu, NvmlProbe};
pub use metrics::AgentMetrics;
pub use model_client::{HttpModelClient, ModelClient, ModelError};

use heartbeat::Heartbeat;
use lifecycle::JobMachine;
use shared::{Parts, Shared};

/// The I/O the agent reaches through traits, so tests and other hosts can swap them.
#[derive(Clone)]
pub struct Dependencies {
    pub model: Arc<dyn ModelClient>,
    pub gpu: Arc<dyn GpuProbe>,
}

impl Dependencies {
    /// The real model server over HTTP, and NVML for `gpu_index` (no GPU probe for the
    /// simulator or when no index is configured: those figures would describe another
    /// device).
    pub fn from_config(config: &Config) -> Result<Self, AgentError> {
        let model = HttpModelClient::new(
            &config.model_server_url,
            &config.health_path,
            &config.metrics_path,
            config.model_server_ca_file.as_deref(),
        )?;
        let gpu: Arc<dyn GpuProbe> = match (config.gpu_index, config.model_server_kind) {
            (Some(index), kind) if kind != ServerKind::Simulator => Arc::new(NvmlProbe::new(index)),
            _ => Arc::new(NoGpu),
        };
        Ok(Dependencies {
            model: Arc::new(model),
            gpu,
        })
    }
}

/// A started agent.
pub struct RunningAgent {
    /// Where the agent's `/metrics` endpoint listens, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    /// The agent's counters (also served on `/metrics`).
    pub metrics: Arc<AgentMetrics>,
    handle: JoinHandle<Result<(), AgentError>>,
}

impl RunningAgent {
    /// Wait until the agent has drained and exited (after the shutdown token fired).
    pub async fn wait(self) -> Result<(), AgentError> {
        self.handle.await.unwrap_or_else(|e| {
            tracing::error!(error = %e, "worker-agent task panicked");
            Ok(())
        })
    }
}

/// Run the agent until `shutdown` fires and the drain is over.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), AgentError> {
    let deps = Dependencies::from_config(&config)?;
    start(config, deps, shutdown).await?.wait().await
}

/// Connect, set up and spawn the agent; returns once it is pulling work.
pub async fn start(
    config: Config,
    deps: Dependencies,
    shutdown: CancellationToken,
) -> Result<RunningAgent, AgentError> {
    let options = config
        .nats_auth
        .connect_options()
        .map_err(AgentError::NatsAuth)?;
    let client = options
        .name(format!("metronome-worker-agent {}", config.worker_id))
        .connect(metronome_runtime::nats::server_urls(&config.nats_url))
        .await
        .map_err(|source| AgentError::Connect {
            url: config.nats_url.clone(),
            source,
        })?;
    let js = jetstream::new(client.clone());
    let settings = StreamSettings {
        replicas: config.stream_replicas,
        ..StreamSettings::default()
    };
    let buckets = ensure_for_worker(&js, &settings).await?;
    agent::ensure_consumer(&js, &config).await?;
    let puller = pull::Puller::new(js.clone(), &config.worker_id)
        .await
        .map_err(|source| AgentError::SubscribeControl {
            subject: "the inbox of the WORK consumer's pull requests".into(),
            source,
        })?;
    let control_sub = control::subscribe(&client, &config.worker_id).await?;
    let metrics = Arc::new(AgentMetrics::default());
    let ewma = ewma_store::EwmaStore::with_client(
        config
            .redis_tls
            .client(&config.redis_url)
            .map_err(ewma_store::EwmaError::from)?,
        &config.redis_prefix,
        config.ewma_alpha,
        config.ewma_half_life_ms,
        metrics.clone(),
    )?;
    let perf_store = perf_store::PerfStore::new(
        ewma.connection(),
        &config.redis_prefix,
        &config.worker_id,
        metrics.clone(),
    );
    // Loaded before the first heartbeat, which already carries the resumed coefficients.
    let perf = perf_store.load(&config.perf_prior()).await;

    let metrics_listener = match config.metrics_port {
        Some(port) => {
            let addr = format!("{}:{port}", config.metrics_bind);
            let l = tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|source| AgentError::MetricsBind { addr, source })?;
            Some(l)
        }
        None => None,
    };
    let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());

    tracing::info!(
        worker_id = %config.worker_id,
        model = %config.model,
        model_server = %config.model_server_url,
        kind = %config.model_server_kind,
        max_concurrency = config.max_concurrency,
        gpu = %deps.gpu.describe(),
        metrics_addr = ?metrics_addr,
        "worker-agent started"
    );

    // The last heartbeat of a previous run of this worker still in the bucket: its sequence
    // continues (a reader that drops out-of-order heartbeats must not drop those of a
    // restarted agent), and the jobs it reported may have started and streamed.
    let previous = match buckets.workers.get(&config.worker_id).await {
        Ok(Some(bytes)) => serde_json::from_slice::<metronome_protocol::WorkerStatus>(&bytes).ok(),
        _ => None,
    };
    let last_seq = previous.as_ref().map_or(0, |s| s.seq);
    let reported_before_restart = previous
        .map(|s| s.in_flight.into_iter().collect())
        .unwrap_or_default();
    let machine = JobMachine::new(
        lifecycle::Settings {
            worker_id: config.worker_id.clone(),
            max_concurrency: config.max_concurrency,
            fence_after: config.fence_after(),
            reported_before_restart,
        },
        shared::now(),
    );
    let shared = Arc::new(Shared::new(
        Parts {
            config,
            client: client.clone(),
            js,
            model: deps.model,
            ewma: Some(ewma),
            metrics: metrics.clone(),
            perf,
            leader: buckets.leader.clone(),
            probes: Arc::new(probe_cache::ProbeCache::default()),
        },
        machine,
    ));

    let metrics_stop = CancellationToken::new();
    if let Some(listener) = metrics_listener {
        let worker_id = shared.config.worker_id.clone();
        let m = metrics.clone();
        let probes = shared.probes.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = m.clone();
                let w = worker_id.clone();
                let gpu = probes.latest().gpu;
                async move {
                    (
                        [(axum::http::header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
                        m.render(&w, gpu),
                    )
                }
            }),
        );
        let stop = metrics_stop.clone();
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
            {
                tracing::warn!(error = %e, "metrics endpoint stopped");
            }
        });
    }

    let probes = shared.probes.clone();
    probe::probe_once(&shared, &deps.gpu, &probes).await;
    let probe_stop = CancellationToken::new();
    let probe_task = probe::spawn(shared.clone(), deps.gpu, probes.clone(), probe_stop.clone());
    let mut hb = Heartbeat {
        shared: shared.clone(),
        bucket: buckets.workers,
        probes,
        seq: last_seq,
        generation: 0,
        revision: None,
        confirmed_seq: last_seq,
    };
    // The first heartbeat goes out before any work is pulled, so the dispatcher sees the
    // worker as soon as it can run something.
    hb.beat().await;
    let hb_stop = CancellationToken::new();
    let hb_task = {
        let stop = hb_stop.clone();
        tokio::spawn(async move {
            hb.run(stop).await;
            hb
        })
    };
    let intake_stop = CancellationToken::new();
    let intake_task = tokio::spawn(agent::intake(shared.clone(), puller, intake_stop.clone()));
    let control_closing = CancellationToken::new();
    let control_stop = CancellationToken::new();
    let control_task = tokio::spawn(control::serve(
        shared.clone(),
        control_sub,
        control_closing.clone(),
        control_stop.clone(),
    ));
    // The model server's prefix cache, told to the leader (when configured).
    let cache_stop = CancellationToken::new();
    let cache_task = shared
        .config
        .cache_report()
        .map(|s| cache_report::spawn(shared.js.clone(), s, cache_stop.clone()));
    let perf_stop = CancellationToken::new();
    let perf_task = tokio::spawn(perf_store::persist(
        shared.clone(),
        perf_store.clone(),
        perf_stop.clone(),
    ));

    let handle = tokio::spawn(async move {
        shutdown.cancelled().await;
        // No operator `undrain` may re-open the agent once it is on its way out (the loop
        // still applies the leader's relayed cancels and revocations while jobs finish).
        control_closing.cancel();
        tracing::info!(in_flight = shared.running(), "shutdown requested: draining");
        shared.set_draining(true);
        shared.heartbeat_now.notify_one();
        intake_stop.cancel();
        bounded("the intake", intake_task).await;

        drain(&shared).await;
        // Every job has been folded in: save the final state for the next run.
        perf_stop.cancel();
        bounded("the performance-model saver", perf_task).await;
        bounded(
            "saving the performance model",
            perf_store::save_latest(&shared, &perf_store),
        )
        .await;

        hb_stop.cancel();
        if let Some(Ok(mut hb)) = bounded("the heartbeat loop", hb_task).await {
            bounded("the last heartbeat", hb.beat()).await;
            bounded("withdrawing from the workers bucket", hb.withdraw()).await;
        }
        probe_stop.cancel();
        bounded("the probes", probe_task).await;
        cache_stop.cancel();
        if let Some(task) = cache_task {
            bounded("the cache reports", task).await;
        }
        control_stop.cancel();
        bounded("the control loop", control_task).await;
        metrics_stop.cancel();
        if let Some(Err(e)) = bounded("flushing NATS", client.flush()).await {
            tracing::warn!(error = %e, "flushing NATS at exit failed");
        }
        tracing::info!("worker-agent stopped");
        Ok(())
    });

    Ok(RunningAgent {
        metrics_addr,
        metrics,
        handle,
    })
}

/// How long one step of the shutdown may wait: a step that waits on NATS or Redis while
/// they are unreachable (a flush waits for a reconnection that may never come) is given up,
/// so SIGTERM always ends the agent.
const SHUTDOWN_STEP: Duration = Duration::from_secs(3);

/// `fut` within [`SHUTDOWN_STEP`]; `None` (and a warning naming `what`) past it.
async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> Option<T> {
    match tokio::time::timeout(SHUTDOWN_STEP, fut).await {
        Ok(v) => Some(v),
        Err(_) => {
            tracing::warn!(
                step = what,
                "shutdown step gave up after {} s (NATS or Redis unreachable?)",
                SHUTDOWN_STEP.as_secs()
            );
            None
        }
    }
}

/// Wait for in-flight jobs to finish; past the drain timeout, end them with an error and
/// give them a short grace to publish it.
async fn drain(shared: &Shared) {
    let deadline = tokio::time::Instant::now() + shared.config.drain_timeout();
    let mut aborted = false;
    loop {
        let running = shared.running();
        if running == 0 {
            return;
        }
        tokio::select! {
            _ = shared.slot_freed.notified() => {}
            // Polling too, in case a release happened between `running()` and `notified()`.
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tokio::time::sleep_until(deadline), if !aborted => {
                tracing::warn!(running, "drain timeout: ending the remaining jobs with an error");
                shared.dispatch(|m| m.abort());
                aborted = true;
            }
        }
        if aborted && tokio::time::Instant::now() > deadline + Duration::from_secs(10) {
            tracing::error!(
                running = shared.running(),
                "jobs did not end after the drain timeout"
            );
            return;
        }
    }
}
