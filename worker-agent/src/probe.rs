//! Probing the model server (health, Prometheus metrics) and the GPU (NVML), off the
//! heartbeat's path.
//!
//! A probe can take up to its timeout (a model server busy with a long prefill answers
//! `/metrics` late; NVML can stall), while the dispatcher declares a worker dead after a few
//! missed heartbeats. So probes run in their own loops, one per source so a slow one does not
//! hold back the others, and each stores its latest result in a [`ProbeCache`]; a heartbeat
//! sends whatever the cache holds at once. A probe that fails or times out stores its
//! "unavailable" result (`healthy = false`, no load figures, no GPU), never a made-up zero,
//! exactly as the heartbeat reported before.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::gpu_probe::GpuProbe;
use crate::metrics_scrape::{scrape, ServerLoad};
use crate::probe_cache::ProbeCache;
use crate::shared::Shared;

/// Longest a single probe may take before it counts as failed.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

async fn probe_health(shared: &Shared, cache: &ProbeCache) {
    let health = tokio::time::timeout(PROBE_TIMEOUT, shared.model.health()).await;
    cache.update(|p| p.healthy = matches!(health, Ok(Ok(()))));
}

async fn probe_metrics(shared: &Shared, cache: &ProbeCache) {
    let load = match tokio::time::timeout(PROBE_TIMEOUT, shared.model.metrics()).await {
        Ok(Ok(text)) => scrape(shared.config.model_server_kind, &text),
        _ => {
            shared.metrics.metrics_scrape_errors.inc();
            ServerLoad::default()
        }
    };
    // Read after the scrape: a job that ends while it is under way may or may not be in
    // the count, and is left in (a worker looks busy a moment longer, never idler).
    let ended = shared.machine(|m| m.ended_on_server());
    cache.update(|p| {
        p.load = load;
        p.ended_at_scrape = ended;
    });
}

async fn probe_gpu(gpu: &Arc<dyn GpuProbe>, cache: &ProbeCache) {
    let probe = gpu.clone();
    let sampled = tokio::time::timeout(
        PROBE_TIMEOUT,
        tokio::task::spawn_blocking(move || probe.sample()),
    )
    .await;
    let gpu = match sampled {
        Ok(Ok(stats)) => stats,
        _ => None,
    };
    cache.update(|p| p.gpu = gpu);
}

/// Probe everything once (bounded by the probe timeout), so the first heartbeat is accurate.
pub(crate) async fn probe_once(shared: &Shared, gpu: &Arc<dyn GpuProbe>, cache: &ProbeCache) {
    tokio::join!(
        probe_health(shared, cache),
        probe_metrics(shared, cache),
        probe_gpu(gpu, cache),
    );
}

/// Re-probe each source every heartbeat interval until `stop`, each in its own loop.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    gpu: Arc<dyn GpuProbe>,
    cache: Arc<ProbeCache>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let period = shared.config.heartbeat_interval();
        tokio::join!(
            repeat(period, &stop, || probe_health(&shared, &cache)),
            repeat(period, &stop, || probe_metrics(&shared, &cache)),
            repeat(period, &stop, || probe_gpu(&gpu, &cache)),
        );
    })
}

async fn repeat<F, Fut>(period: Duration, stop: &CancellationToken, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = probe() => {}
        }
    }
}
