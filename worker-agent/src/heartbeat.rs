//! The heartbeat: every interval (and at once when draining starts) the agent builds its
//! [`WorkerStatus`] and puts it in the `workers` KV bucket under its id, and publishes it on
//! `workers.<id>.heartbeat`.
//!
//! Invariants: `seq` strictly increases per worker id (a restarted agent continues from
//! the seq of its previous heartbeat still in the bucket), so readers can drop reordered
//! heartbeats; `in_flight` lists exactly the jobs the agent holds; a signal the agent could
//! not read (no metrics, no NVML) is `None`, never a made-up zero. `active`/`queued` come
//! from the server's own metrics when it exports them (they include requests the agent did
//! not send), else from the agent's count; `active` less the agent's jobs that ended since
//! the scrape (up to a probe interval old), which would otherwise keep an idle GPU busy in
//! the dispatcher's eyes until the next scrape. `healthy` means the model server answered its
//! health endpoint within the probe timeout, and no job lost the server since (a job that
//! cannot reach it, or whose stream breaks, reports the worker unhealthy at once).
//!
//! The heartbeat never waits for a probe: the probes run in their own loops
//! ([`crate::probe`]) and a heartbeat sends the latest results they stored, so a model server
//! slow to answer `/metrics` (or a stalled NVML) cannot delay heartbeats past the
//! dispatcher's death timeout.
//!
//! Each stored heartbeat lowers the agent's fence ([`crate::fence`]); a put that fails or
//! hangs past `fence_after_ms` does not, so an agent whose heartbeats the dispatcher cannot
//! see stops taking work before (or as) the dispatcher gives it away.
//!
//! After the first, every heartbeat is a conditional put: stored only if the key still holds
//! this agent's previous heartbeat. The leader declares a silent worker dead by deleting the
//! key on the same condition, so of "the agent reports job J" and "the leader gives J away"
//! exactly one is stored. When the agent's put is the one refused, the leader has settled
//! everything the agent held (retried or failed to its clients): the agent drops it all
//! ([`JobMachine::given_away`](crate::lifecycle::JobMachine::given_away)) and registers
//! again with a plain put.
//!
//! What a heartbeat says about the jobs, and what a stored one lets start, is the job
//! lifecycle's ([`crate::lifecycle`]).

use std::sync::Arc;

use async_nats::jetstream::kv;
use metronome_protocol::names::heartbeat_subject;
use metronome_protocol::time::unix_ms;
use metronome_protocol::{WorkerStatus, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;

use crate::probe_cache::{ProbeCache, Probed};
use crate::shared::{now, Shared};

/// What became of a heartbeat put.
enum Stored {
    /// Stored at this revision.
    Yes(u64),
    /// Refused: the key no longer holds this run's previous heartbeat; the leader deleted it.
    GivenAway,
}

/// Builds and sends heartbeats.
pub(crate) struct Heartbeat {
    pub shared: Arc<Shared>,
    pub bucket: kv::Store,
    /// Latest probe results, kept fresh by [`crate::probe::spawn`].
    pub probes: Arc<ProbeCache>,
    pub seq: u64,
    /// `accepted_generation` covered by the status being built.
    pub generation: u64,
    /// Revision of this agent's last stored heartbeat; `None` until the first is stored in
    /// this run (or after the leader deleted the key), when a plain put registers it.
    pub revision: Option<u64>,
    /// `seq` of that heartbeat.
    pub confirmed_seq: u64,
}

impl Heartbeat {
    /// Build the status from the latest probe results and the agent's own state.
    pub async fn build(&mut self) -> WorkerStatus {
        let shared = &self.shared;
        let cfg = &shared.config;
        let Probed {
            healthy,
            load,
            gpu,
            ended_at_scrape,
        } = self.probes.latest();
        // One read of the lifecycle: every job taken up to `generation` is listed.
        let (jobs, decoding) = shared.machine(|m| {
            (
                m.heartbeat(load.running, ended_at_scrape),
                m.live_decode(now()),
            )
        });
        self.generation = jobs.generation;
        self.seq += 1;
        WorkerStatus {
            v: PROTOCOL_VERSION,
            worker_id: cfg.worker_id.clone(),
            model: cfg.model.clone(),
            node: cfg.node.clone(),
            gpu_index: cfg.gpu_index,
            healthy,
            draining: jobs.draining,
            max_concurrency: cfg.max_concurrency,
            active: jobs.active,
            queued: load.waiting.unwrap_or(0),
            in_flight: jobs.in_flight,
            kv: load.kv,
            gpu,
            prefill_pending_tokens: jobs.prefill_pending_tokens,
            perf: Some(shared.perf_coefficients()),
            decoding,
            seq: self.seq,
            sent_ms: unix_ms(),
            max_epoch: jobs.max_epoch,
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
        let storing = tokio::time::Instant::now();
        let stored =
            tokio::time::timeout(shared.config.fence_after(), self.store(body.clone())).await;
        shared.metrics.heartbeat_store.observe(storing.elapsed());
        let put = match stored {
            Ok(Ok(Stored::Yes(revision))) => {
                self.revision = Some(revision);
                self.confirmed_seq = status.seq;
                Ok(())
            }
            Ok(Ok(Stored::GivenAway)) => {
                self.revision = None;
                let dropped = shared.dispatch(|m| m.given_away());
                tracing::warn!(
                    seq = status.seq,
                    dropped,
                    "the leader declared this worker dead (its key was deleted): dropped every job held, registering again"
                );
                shared.heartbeat_now.notify_one();
                Err("declared dead by the leader".to_string())
            }
            Ok(Err(e)) => Err(e),
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
                // The jobs this heartbeat listed start (or are refused, had the agent been
                // fenced since it took them); a fenced intake pulls again.
                let generation = self.generation;
                shared.dispatch(|m| m.reported(generation, now()));
                shared.stored.send_modify(|n| *n += 1);
                Some(status)
            }
            Err(error) => {
                shared.metrics.heartbeat_errors.inc();
                let (fence, effects) = shared.machine(|m| {
                    let mut effects = m.heartbeat_failed(now());
                    let (state, more) = m.fence(now());
                    effects.extend(more);
                    (state, effects)
                });
                effects.into_iter().for_each(|e| shared.perform(e));
                let fenced = fence.fenced;
                tracing::warn!(%error, seq = status.seq, fenced, "heartbeat not stored");
                None
            }
        }
    }

    /// Store `body` under this worker's key: a plain put when no heartbeat of this run is
    /// stored yet, else a put conditional on the previous one still being there.
    async fn store(&self, body: bytes::Bytes) -> Result<Stored, String> {
        let key = &self.shared.config.worker_id;
        let Some(revision) = self.revision else {
            return self
                .bucket
                .put(key, body)
                .await
                .map(Stored::Yes)
                .map_err(|e| e.to_string());
        };
        match self.bucket.update(key, body.clone(), revision).await {
            Ok(r) => Ok(Stored::Yes(r)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // Our own earlier put may have been stored after it timed out here: then
                // the key holds a heartbeat of this run (seq above the last confirmed one).
                match self.bucket.entry(key).await {
                    Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
                        let own =
                            serde_json::from_slice::<WorkerStatus>(&entry.value).is_ok_and(|s| {
                                s.worker_id == *key
                                    && s.seq < self.seq
                                    && s.seq > self.confirmed_seq
                            });
                        if own {
                            self.bucket
                                .update(key, body, entry.revision)
                                .await
                                .map(Stored::Yes)
                                .map_err(|e| e.to_string())
                        } else {
                            Ok(Stored::GivenAway)
                        }
                    }
                    Ok(_) => Ok(Stored::GivenAway),
                    Err(e) => Err(format!("reading the key back after a refused put: {e}")),
                }
            }
            Err(e) => Err(e.to_string()),
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
