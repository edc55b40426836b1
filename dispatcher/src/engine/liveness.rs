//! Worker liveness: the registry view the engine places on (heartbeats, EWMAs), which
//! workers are alive and take work, and how a silent worker is declared dead (a
//! conditional delete of its key through the bucket) and its jobs settled.
//!
//! Invariant: a worker is declared dead only once the watch shows this leader's
//! conditional delete; a heartbeat stored meanwhile keeps it.

use std::sync::atomic::Ordering::Relaxed;

use metronome_protocol::ErrorCode;
use metronome_protocol::WorkerStatus;
use metronome_scheduler::provisioning::{clamp_ewma, clamp_perf};
use metronome_scheduler::WorkerView;

use crate::engine::revoke;
use crate::engine::Engine;
use crate::engine::Outcome;
use crate::engine::RedisSnapshot;
use crate::engine::WorkerUpdate;

/// A conditional delete of an overdue worker's key in flight.
pub(super) struct Expiring {
    pub(super) since_ms: u64,
    pub(super) why: String,
}

impl Engine {
    pub(super) fn alive(&self, view: &WorkerView, now_ms: u64) -> bool {
        now_ms.saturating_sub(view.last_seen_ms) <= self.s.scheduler.heartbeat_timeout_ms
            && !self.dead.contains(&view.status.worker_id)
    }

    /// Whether a worker could take work now: alive, healthy, not draining.
    pub(super) fn takes_work(&self, view: &WorkerView, now_ms: u64) -> bool {
        self.alive(view, now_ms) && view.status.healthy && !view.status.draining
    }

    pub(super) fn on_worker(&mut self, update: WorkerUpdate) {
        let now = self.now_ms;
        self.per_model.clear();
        match update {
            WorkerUpdate::Put {
                mut status,
                seen_ms,
                revision,
                unvouched,
                tenants,
            } => {
                let id = status.worker_id.clone();
                self.drop_unvouched(&mut status, &unvouched);
                if tenants.is_empty() {
                    self.listed_tenants.remove(&id);
                } else {
                    self.listed_tenants.insert(id.clone(), tenants);
                }
                self.revisions.insert(id.clone(), revision);
                if self.expiring.remove(&id).is_some() {
                    tracing::info!(worker_id = %id, revision, "a heartbeat was stored before the worker could be declared dead: it stays");
                }
                self.drop_finished(&mut status);
                let rec = self.ledger.reconcile(
                    &id,
                    &status.in_flight,
                    self.s.adopt_kv_tokens,
                    self.s.scheduler.reservation_ttl_ms,
                    now,
                );
                if !rec.adopted.is_empty() || !rec.expired.is_empty() {
                    tracing::info!(worker_id = %id, adopted = ?rec.adopted, expired = ?rec.expired, "reconciled reservations with heartbeat");
                }
                if !rec.conflicting.is_empty() {
                    tracing::warn!(worker_id = %id, jobs = ?rec.conflicting, "worker runs jobs booked on another worker");
                }
                self.relay_cancels(&status.in_flight, now);
                let not_provisioned = self.check_provisioning(&status, now);
                let prior = &self.s.scheduler.perf_prior;
                status.perf = status
                    .perf
                    .map(|p| clamp_perf(p, prior, self.s.scheduler.perf_claim_floor));
                let ewma = self.ewmas.get(&id).copied();
                match self.index.get(&id) {
                    Some(&i) => {
                        if status.seq < self.workers[i].status.seq {
                            // Its agent restarted (its counter starts again): its model
                            // server's cache is not to be trusted.
                            self.prefix_index.forget_worker(&id);
                        }
                        let view = &mut self.workers[i];
                        view.status = *status;
                        view.last_seen_ms = seen_ms;
                        view.ewma = ewma;
                        view.not_provisioned = not_provisioned;
                    }
                    None => {
                        tracing::info!(worker_id = %id, model = %status.model, "worker joined");
                        self.index.insert(id.clone(), self.workers.len());
                        self.workers.push(WorkerView {
                            status: *status,
                            last_seen_ms: seen_ms,
                            ewma,
                            not_provisioned,
                        });
                    }
                }
                if now.saturating_sub(seen_ms) <= self.s.scheduler.heartbeat_timeout_ms
                    && self.dead.remove(&id)
                {
                    tracing::info!(worker_id = %id, "worker is back");
                }
            }
            WorkerUpdate::Gone { worker_id } => match self.expiring.remove(&worker_id) {
                // This leader's own conditional delete: the worker is dead, and stays listed
                // (rejected as stale) until it is forgotten or registers again.
                Some(expiring) => {
                    self.revisions.remove(&worker_id);
                    self.worker_died(&worker_id, &expiring.why);
                }
                // The worker withdrew (or an operator removed it).
                None => {
                    self.worker_died(&worker_id, "its key left the workers bucket");
                    self.forget_worker(&worker_id);
                }
            },
        }
        self.metrics
            .workers_known
            .store(self.workers.len() as u64, Relaxed);
        self.capacity_changed = true;
    }

    /// Remove a worker from the registry (it comes back as new with its next heartbeat).
    pub(super) fn forget_worker(&mut self, worker_id: &str) {
        if let Some(i) = self.index.remove(worker_id) {
            self.workers.swap_remove(i);
            if i < self.workers.len() {
                let moved = self.workers[i].status.worker_id.clone();
                self.index.insert(moved, i);
            }
        }
        self.dead.remove(worker_id);
        self.prefix_index.forget_worker(worker_id);
        self.reported_caches.forget_worker(worker_id);
        self.revisions.remove(worker_id);
        self.expiring.remove(worker_id);
        self.listed_tenants.remove(worker_id);
        self.per_model.clear();
    }

    pub(super) fn on_redis(&mut self, mut snapshot: RedisSnapshot) {
        self.per_model.clear();
        let (prior, floor) = (
            &self.s.scheduler.perf_prior,
            self.s.scheduler.perf_claim_floor,
        );
        for ewma in snapshot.ewmas.values_mut() {
            *ewma = clamp_ewma(*ewma, prior, floor);
        }
        for view in &mut self.workers {
            view.ewma = snapshot.ewmas.get(&view.status.worker_id).copied();
        }
        self.ewmas = snapshot.ewmas;
        self.output_len = snapshot.output_len;
        self.capacity_changed = true;
    }

    /// Why `status` claims more than its worker id was provisioned for (`None`: within it,
    /// or no provisioning record is configured). Every such heartbeat is counted; logged
    /// at most once a minute per worker.
    fn check_provisioning(&mut self, status: &WorkerStatus, now: u64) -> Option<String> {
        let provisioning = self.s.provisioning.as_ref()?;
        let reason = provisioning
            .check(status, self.s.scheduler.default_max_concurrency)
            .err()?;
        self.metrics
            .unprovisioned_heartbeats_total
            .fetch_add(1, Relaxed);
        let id = &status.worker_id;
        let logged = self.unprovisioned_logged.get(id);
        if logged.is_none_or(|at| now.saturating_sub(*at) >= crate::worker_claims::LOG_EVERY_MS) {
            self.unprovisioned_logged
                .retain(|_, at| now.saturating_sub(*at) < crate::worker_claims::LOG_EVERY_MS);
            self.unprovisioned_logged.insert(id.clone(), now);
            tracing::warn!(worker_id = %id, model = %status.model, max_concurrency = status.max_concurrency, reason, "heartbeat outside the worker's provisioning: it takes no new work (further ones from this worker are only counted for a minute)");
        }
        Some(reason)
    }

    /// Remove from a heartbeat the jobs it claims that no decision on record assigns to
    /// that worker (`registry::Vouching`), unless this leader booked them there itself: a
    /// worker that learned a job's id must not be able to claim it by listing it.
    pub(super) fn drop_unvouched(&mut self, status: &mut WorkerStatus, unvouched: &[String]) {
        if unvouched.is_empty() {
            return;
        }
        let id = status.worker_id.as_str();
        let (kept, refused): (Vec<String>, Vec<String>) = std::mem::take(&mut status.in_flight)
            .into_iter()
            .partition(|job| !unvouched.contains(job) || self.ledger.worker_of(job) == Some(id));
        status.in_flight = kept;
        if !refused.is_empty() {
            self.metrics
                .unvouched_claims_total
                .fetch_add(refused.len() as u64, Relaxed);
            tracing::warn!(worker_id = %id, jobs = ?refused, "heartbeat lists jobs no decision assigns to this worker: not adopted");
            status.active = status.active.saturating_sub(refused.len() as u32);
        }
    }

    /// Remove from a heartbeat the jobs whose completion this leader has already seen: the
    /// heartbeat was sent before they finished. Without this a burst right after another
    /// sees busy workers that are idle, and re-adopts finished jobs as leaked reservations.
    pub(super) fn drop_finished(&mut self, status: &mut WorkerStatus) {
        let before = status.in_flight.len();
        status.in_flight.retain(|id| !self.finished.contains(id));
        let gone = (before - status.in_flight.len()) as u32;
        status.active = status.active.saturating_sub(gone);
    }

    /// Declare a silent worker dead through the bucket: delete its key unless a heartbeat
    /// later than the last one this leader saw was stored. The death itself
    /// ([`Self::worker_died`]) follows when the watch shows the delete. The worker is not
    /// eligible meanwhile (its heartbeat is too old).
    pub(super) fn expire_worker(&mut self, worker_id: &str, why: &str, now: u64) {
        let Some(&revision) = self.revisions.get(worker_id) else {
            // Never seen through the bucket (a registry loaded without revisions cannot
            // happen; this is the safe fallback): declare it dead directly.
            self.worker_died(worker_id, why);
            return;
        };
        tracing::info!(
            worker_id,
            revision,
            why,
            "declaring the worker dead: deleting its key unless it stored a newer heartbeat"
        );
        self.expiring.insert(
            worker_id.to_string(),
            Expiring {
                since_ms: now,
                why: why.to_string(),
            },
        );
        self.emit(Outcome::ExpireWorker {
            worker_id: worker_id.to_string(),
            revision,
        });
    }

    /// A worker is gone: release its reservations; jobs it never reported are assigned
    /// again, jobs it had reported fail with `WorkerLost` (they may have streamed output).
    pub(super) fn worker_died(&mut self, worker_id: &str, why: &str) {
        if !self.dead.insert(worker_id.to_string()) {
            return;
        }
        self.metrics.workers_lost_total.fetch_add(1, Relaxed);
        // Its model server's cache died with it, or will be cleared when it comes back.
        self.prefix_index.forget_worker(worker_id);
        let reservations = self.ledger.release_worker(worker_id);
        tracing::warn!(
            worker_id,
            why,
            reservations = reservations.len(),
            "worker is dead"
        );
        // Before anything is assigned again: a worker that comes back must not find (and
        // run) the Assignments that are now going elsewhere. Also when this leader knows
        // of no job there: an earlier leader may have assigned jobs the worker never
        // reported, and the purge hands those back ([`Engine::rescue_purged`]).
        self.settled_at_death.insert(
            worker_id.to_string(),
            reservations.iter().map(|r| r.job_id.clone()).collect(),
        );
        self.emit(Outcome::PurgeWork {
            worker_id: worker_id.to_string(),
        });
        if !reservations.is_empty() {
            // And a worker that was only silent stops what it still runs of them.
            self.emit(revoke(
                worker_id,
                self.s.epoch,
                reservations.iter().map(|r| {
                    (
                        r.job_id.clone(),
                        self.assigned.get(&r.job_id).map(|a| a.attempt),
                    )
                }),
                why,
            ));
        }
        for r in reservations {
            let assigned = self.assigned.remove(&r.job_id);
            if r.is_confirmed() {
                self.emit(Outcome::FinalError {
                    job_id: r.job_id.clone(),
                    worker_id: Some(worker_id.to_string()),
                    error: ErrorCode::WorkerLost,
                    message: format!("worker {worker_id} died while holding the job ({why})"),
                });
            } else if let Some(a) = assigned {
                self.metrics.rescued_jobs_total.fetch_add(1, Relaxed);
                self.retry(
                    a,
                    &format!("worker {worker_id} died before reporting it"),
                    None,
                );
            }
        }
        self.capacity_changed = true;
    }

    /// Declare dead ([`Engine::expire_worker`]) the workers whose heartbeat is older than
    /// the timeout.
    pub(super) fn expire_silent_workers(&mut self, now: u64) {
        let timeout = self.s.scheduler.heartbeat_timeout_ms;
        let stale: Vec<String> = self
            .workers
            .iter()
            .filter(|w| now.saturating_sub(w.last_seen_ms) > timeout)
            .filter(|w| !self.dead.contains(&w.status.worker_id))
            // One conditional delete per timeout: an unanswered one (NATS unreachable) is
            // tried again, an answered one shows up on the watch.
            .filter(|w| {
                self.expiring
                    .get(&w.status.worker_id)
                    .is_none_or(|e| now.saturating_sub(e.since_ms) > timeout)
            })
            .map(|w| w.status.worker_id.clone())
            .collect();
        for id in stale {
            self.expire_worker(&id, "heartbeat older than the timeout", now);
        }
    }

    /// Drop the workers dead for longer than `forget_dead_after_ms`. The workers bucket's
    /// max age removes a dead worker's key without a delete marker the watch would see, so
    /// a dead worker is dropped here, or every later decision would list it and the
    /// registry would only grow.
    pub(super) fn forget_long_dead_workers(&mut self, now: u64) {
        let forgotten: Vec<String> = self
            .workers
            .iter()
            .filter(|w| self.dead.contains(&w.status.worker_id))
            .filter(|w| now.saturating_sub(w.last_seen_ms) > self.s.forget_dead_after_ms)
            .map(|w| w.status.worker_id.clone())
            .collect();
        for id in forgotten {
            tracing::info!(worker_id = %id, "dead worker left the registry");
            self.forget_worker(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;

    use metronome_scheduler::{ProvisionedWorker, Provisioning};

    use crate::engine::testing::*;
    use crate::worker_claims::LOG_EVERY_MS;

    fn provisioned() -> Arc<Provisioning> {
        let w = |model: &str| ProvisionedWorker {
            model: model.into(),
            max_concurrency: Some(8),
        };
        Arc::new(Provisioning {
            v: 1,
            workers: [("w1".to_string(), w("m")), ("w2".to_string(), w("q"))]
                .into_iter()
                .collect(),
        })
    }

    #[test]
    fn every_heartbeat_outside_the_provisioning_is_counted_and_logged_once_a_minute() {
        let mut e = engine(|_| {});
        e.s.provisioning = Some(provisioned());
        // w2 is provisioned for model q and claims m, at times 0, 1 s and a minute on.
        for (seq, at) in [(1, T0), (2, T0 + 1_000), (3, T0 + LOG_EVERY_MS)] {
            step(&mut e, vec![heartbeat("w2", &[], seq, at, |_| {})], at);
        }
        assert_eq!(e.metrics.unprovisioned_heartbeats_total.load(Relaxed), 3);
        assert_eq!(e.unprovisioned_logged.get("w2"), Some(&(T0 + LOG_EVERY_MS)));
        let view = &e.workers[e.index["w2"]];
        assert_eq!(
            view.not_provisioned.as_deref(),
            Some("provisioned for model 'q', its heartbeat claims 'm'")
        );
        // Within its provisioning: eligible again, nothing counted.
        step(
            &mut e,
            vec![heartbeat("w1", &[], 1, T0 + LOG_EVERY_MS, |s| {
                s.max_concurrency = 8
            })],
            T0 + LOG_EVERY_MS,
        );
        assert_eq!(e.workers[e.index["w1"]].not_provisioned, None);
        assert_eq!(e.metrics.unprovisioned_heartbeats_total.load(Relaxed), 3);
    }

    #[test]
    fn without_a_record_heartbeats_are_believed_but_speed_is_still_bounded() {
        let mut e = engine(|_| {});
        step(
            &mut e,
            vec![heartbeat("stranger", &[], 1, T0, |s| {
                s.max_concurrency = 100_000;
                if let Some(p) = s.perf.as_mut() {
                    p.step_base_ms = 0.0;
                }
            })],
            T0,
        );
        let view = &e.workers[e.index["stranger"]];
        assert_eq!(view.not_provisioned, None);
        assert_eq!(view.status.perf.map(|p| p.step_base_ms), Some(1.0));
        assert_eq!(e.metrics.unprovisioned_heartbeats_total.load(Relaxed), 0);
    }
}
