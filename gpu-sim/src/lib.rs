//! metronome-gpu-sim: simulated GPUs for Metronome's demo, tests and benchmarks.
//!
//! Each simulated GPU is an OpenAI-compatible model server that behaves like vLLM serving
//! one model on one GPU: continuous batching with chunked prefill, decode step time growing
//! with batch size and context, prefill stalling decode, a paged KV cache with recompute
//! preemption when it runs out, a speed factor, and vLLM-named Prometheus metrics.
//! One process hosts several GPUs, each on its own port with its own engine task.
//!
//! In-process use (tests of other crates):
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use metronome_gpu_sim::{spawn_gpu, SimGpuConfig};
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let addr = spawn_gpu(SimGpuConfig { base_step_ms: 1.0, ..SimGpuConfig::new("llama-3.1-8b") }, shutdown.clone()).await?;
//! // POST http://{addr}/v1/chat/completions ...
//! shutdown.cancel();
//! # Ok(()) }
//! ```

pub mod api;
pub mod block_pool;
pub mod choice;
pub mod config;
pub mod cost;
pub mod embedding;
pub mod engine;
pub mod kv_publisher;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod response_kind;
pub mod scheduler;
pub mod text;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::{ConfigError, FieldError, SimConfig, SimGpuConfig, DEFAULT_MODEL};
pub use engine::EngineStats;
pub use kv_publisher::KvEventEndpoints;

/// The component's configuration under the name every Metronome binary uses.
pub type Config = SimConfig;

/// Errors of the simulator as a whole.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr} for model {model}: {source}")]
    Bind {
        addr: SocketAddr,
        model: String,
        #[source]
        source: io::Error,
    },
}

/// A running simulated GPU.
pub struct SimGpu {
    addr: SocketAddr,
    gpu: Arc<scheduler::Gpu>,
    kv_events: Option<KvEventEndpoints>,
    tasks: Vec<JoinHandle<()>>,
}

impl SimGpu {
    /// Validate `config`, bind its port (0 picks a free one) and start its server and
    /// engine task; both stop when `shutdown` is cancelled.
    pub async fn spawn(config: SimGpuConfig, shutdown: CancellationToken) -> io::Result<SimGpu> {
        let errors = config.validate_at("gpu");
        if !errors.is_empty() {
            let message = errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, message));
        }
        let listener = tokio::net::TcpListener::bind((config.host, config.port)).await?;
        let addr = listener.local_addr()?;
        let (kv_sender, kv_events) = match &config.kv_events_endpoint {
            Some(endpoint) => {
                let (sender, endpoints) = kv_publisher::start(
                    endpoint,
                    config.kv_events_replay_endpoint.as_deref(),
                    &config.kv_events_topic,
                    shutdown.clone(),
                )
                .await
                .map_err(io::Error::other)?;
                tracing::info!(model = %config.model, publish = %endpoints.publish, replay = ?endpoints.replay, "publishing KV cache events");
                (Some(sender), Some(endpoints))
            }
            None => (None, None),
        };
        let gpu = scheduler::Gpu::with_kv_events(config, kv_sender);
        let cfg = gpu.config();
        tracing::info!(
            model = %cfg.model, %addr, speed = cfg.speed, kv_capacity_tokens = u64::from(cfg.num_blocks()) * u64::from(cfg.block_size),
            base_step_ms = cfg.base_step_ms, "simulated GPU listening"
        );
        let engine_task = tokio::spawn(Arc::clone(&gpu).drive(shutdown.clone()));
        let app = api::router(Arc::clone(&gpu));
        let server_shutdown = shutdown.clone();
        let server_task = tokio::spawn(async move {
            // Without TCP_NODELAY one-token SSE writes wait for the client's delayed ACK
            // (~40 ms), which would show up as latency no real GPU has.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let server = axum::serve(listener, app)
                .with_graceful_shutdown(server_shutdown.cancelled_owned());
            if let Err(e) = server.await {
                tracing::error!(error = %e, %addr, "simulated GPU server failed");
            }
        });
        Ok(SimGpu {
            addr,
            gpu,
            kv_events,
            tasks: vec![engine_task, server_task],
        })
    }

    /// The bound address (the real port when configured with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port`, the base of the OpenAI API (`/v1/...`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn config(&self) -> &SimGpuConfig {
        self.gpu.config()
    }

    /// Where the KV cache events are published (ports resolved), when configured.
    pub fn kv_event_endpoints(&self) -> Option<&KvEventEndpoints> {
        self.kv_events.as_ref()
    }

    /// Prompt tokens of `token_ids` that a request would find in the prefix cache now.
    pub fn cached_prefix_tokens(&self, token_ids: &[u32]) -> u32 {
        self.gpu.cached_prefix_tokens(token_ids)
    }

    /// The engine's counters and gauges right now.
    pub fn stats(&self) -> EngineStats {
        self.gpu.stats()
    }

    /// Wait until the server and engine task stopped (after `shutdown` was cancelled).
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Start one simulated GPU and return its bound address.
pub async fn spawn_gpu(
    config: SimGpuConfig,
    shutdown: CancellationToken,
) -> io::Result<SocketAddr> {
    SimGpu::spawn(config, shutdown).await.map(|g| g.addr())
}

/// Validate `config` and start every GPU it lists, returning them in order.
pub async fn spawn_all(
    config: &SimConfig,
    shutdown: CancellationToken,
) -> Result<Vec<SimGpu>, SimError> {
    config.validate().map_err(ConfigError::Invalid)?;
    let mut gpus = Vec::new();
    for gpu in config.effective_gpus() {
        let addr = SocketAddr::new(gpu.host, gpu.port);
        let model = gpu.model.clone();
        let spawned = SimGpu::spawn(gpu, shutdown.clone())
            .await
            .map_err(|source| SimError::Bind {
                addr,
                model,
                source,
            })?;
        gpus.push(spawned);
    }
    Ok(gpus)
}

/// Start every GPU of `config` and return their bound addresses, in order.
pub async fn serve(
    config: SimConfig,
    shutdown: CancellationToken,
) -> Result<Vec<SocketAddr>, SimError> {
    Ok(spawn_all(&config, shutdown)
        .await?
        .iter()
        .map(SimGpu::addr)
        .collect())
}

/// Run every GPU of `config` until `shutdown` is cancelled, then wait for them to stop.
pub async fn run(config: SimConfig, shutdown: CancellationToken) -> Result<(), SimError> {
    let gpus = match spawn_all(&config, shutdown.clone()).await {
        Ok(gpus) => gpus,
        Err(e) => {
            // Stop the GPUs that did start before the failing one.
            shutdown.cancel();
            return Err(e);
        }
    };
    shutdown.cancelled().await;
    for gpu in gpus {
        gpu.join().await;
    }
    Ok(())
}
