//! The heartbeat: every interval (and at once when draining starts) the agent builds its
//! [`WorkerStatus`] and puts it in the `workers` KV bucket under its id, and publishes it on
//! `workers.<id>.heartbeat`.
//!
//! Invariants: `seq` strictly increases per worker id (a restarted agent continues from
//! the seq of its previous heartbeat still in the bucket), so readers can drop reordered
//! heartbeats; `in_flight` lists exactly the jobs the agent holds; a signal the agent could
//! not read (no metrics, no NVML) is `None`, never a made-up zero. `active`/`queued` come
//! from the server's own metrics when it exports them (they include requests the agent did
//! not send), else from the agent's count. `healthy` means the model server answered its
//! health endpoint within the probe timeout.
//!
//! The heartbeat never waits for a probe: the probes run in their own loops
//! ([`crate::probe`]) and a heartbeat sends the latest results they stored, so a model server
//! slow to answer `/metrics` (or a stalled NVML) cannot delay heartbeats past the
//! dispatcher's death timeout.
//!
//! Each stored heartbeat lowers the agent's fence ([`crate::fence`]); a put that fails or
//! hangs past `fence_after_ms` does not, so an agent whose heartbeats the dispatcher cannot
//! see stops taking work before (or as) the dispatcher gives it away.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_nats::jetstream::kv;
use metronome_protocol::names::heartbeat_subject;
use metronome_protocol::time::unix_ms;
use metronome_protocol::{WorkerStatus, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;

use crate::agent::Shared;
use crate::probe::{ProbeCache, Probed};

/// Builds and sends heartbeats.
pub(crate) struct Heartbeat {
    pub shared: Arc<Shared>,
    pub bucket: kv::Store,
    /// Latest probe results, kept fresh by [`crate::probe::spawn`].
    pub probes: Arc<ProbeCache>,
    pub seq: u64,
    /// `accepted_generation` covered by the status being built.
    pub generation: u64,
}

impl Heartbeat {
    /// Build the status from the latest probe results and the agent's own state.
    pub async fn build(&mut self) -> WorkerStatus {
        let shared = &self.shared;
        let cfg = &shared.config;
        let Probed { healthy, load, gpu } = self.probes.latest();
        // Read before the job list: every job accepted up to this generation is in it.
        self.generation = shared.accepted_generation.load(Ordering::SeqCst);
        let in_flight = shared.in_flight_ids();
        let own = in_flight.len() as u32;
        self.seq += 1;
        WorkerStatus {
            v: PROTOCOL_VERSION,
            worker_id: cfg.worker_id.clone(),
            model: cfg.model.clone(),
            node: cfg.node.clone(),
            gpu_index: cfg.gpu_index,
            healthy,
            draining: shared.draining.load(Ordering::SeqCst),
            max_concurrency: cfg.max_concurrency,
            active: load.running.unwrap_or(own),
            queued: load.waiting.unwrap_or(0),
            in_flight,
            kv: load.kv,
            gpu,
            prefill_pending_tokens: shared.prefill_pending_tokens(),
            perf: Some(shared.perf_coefficients()),
            seq: self.seq,
            sent_ms: unix_ms(),
        }
    }

    /// Build and send one heartbeat. Failures are logged and counted: the next one retries.
    pub async fn beat(&mut self) -> Option<WorkerStatus> {
        let status = self.build().await;
        let body = match serde_json::to_vec(&status) {
            Ok(b) => bytes::Bytes::from(b),
            Err(e) => {
                tracing::error!(error = %e, "encoding the heartbeat failed");
                return None;
            }
        };
        let shared = &self.shared;
        // A put that hangs is as good as a failed one for the dispatcher, and must not
        // hold the loop past the fence timeout.
        let put = match tokio::time::timeout(
            shared.config.fence_after(),
            self.bucket.put(&shared.config.worker_id, body.clone()),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {} ms",
                shared.config.fence_after_ms
            )),
        };
        if let Err(e) = shared
            .client
            .publish(heartbeat_subject(&shared.config.worker_id), body)
            .await
        {
            // The bucket is what the dispatcher trusts; the core copy is a convenience.
            tracing::warn!(error = %e, seq = status.seq, "publishing the heartbeat failed");
        }
        match put {
            Ok(()) => {
                shared.metrics.heartbeats.inc();
                // The fence first: a job waiting for this report checks it next.
                shared.fence.stored(tokio::time::Instant::now());
                let generation = self.generation;
                shared
                    .reported_generation
                    .send_modify(|g| *g = (*g).max(generation));
                Some(status)
            }
            Err(error) => {
                shared.metrics.heartbeat_errors.inc();
                let fenced = shared.fence.check(tokio::time::Instant::now()).fenced;
                tracing::warn!(%error, seq = status.seq, fenced, "heartbeat not stored");
                None
            }
        }
    }

    /// Beat every interval, and at once when asked, until `stop`.
    pub async fn run(&mut self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.shared.config.heartbeat_interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
                _ = self.shared.heartbeat_now.notified() => {}
            }
            self.beat().await;
        }
    }

    /// Remove this worker from the bucket: it no longer takes work.
    pub async fn withdraw(&self) {
        if let Err(e) = self.bucket.delete(&self.shared.config.worker_id).await {
            tracing::warn!(error = %e, "removing the worker from the workers bucket failed");
        }
    }
}
