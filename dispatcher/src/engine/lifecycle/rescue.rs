//! Rescue of jobs nobody else will settle: Assignments an earlier leader wrote to a worker
//! now dead (the purge hands them back), and refusals of jobs this leader never held.

use std::sync::atomic::Ordering::Relaxed;

use metronome_protocol::Assignment;
use metronome_protocol::ErrorCode;

use crate::engine::lifecycle::AssignedJob;
use crate::engine::revoke;
use crate::engine::Engine;
use crate::engine::Outcome;
use crate::engine::CANCELLED_MAX;
use crate::engine::ORPHAN_REFUSAL_GRACE_MS;

impl Engine {
    /// The Assignments a dead worker's purge removed from WORK. Those of jobs settled when
    /// the worker was declared dead, or held here in any other way (queued, assigned,
    /// booked, finished), need nothing. The rest were assigned by an earlier leader and
    /// never reported by the worker: their Assignment was the only copy of the job, so
    /// they go back through JOBS with the next attempt, as a rescue of this leader's own.
    pub(in crate::engine) fn rescue_purged(
        &mut self,
        worker_id: &str,
        assignments: Vec<Assignment>,
    ) {
        let settled = self.settled_at_death.remove(worker_id).unwrap_or_default();
        let rescued: Vec<Assignment> = assignments
            .into_iter()
            .filter(|a| {
                let id = a.job.id.as_str();
                let held = settled.contains(id)
                    || self.ledger.worker_of(id).is_some()
                    || self.queued_assigned_or_finished(id);
                !held && a.worker_id == worker_id
            })
            .collect();
        if !rescued.is_empty() {
            // The purge removes a message from the stream, not a copy already delivered:
            // a worker that was only silent (stopped, partitioned) may hold one unread and
            // would run it beside the retry. Revoked, it is not started (the agent checks
            // revocations when it takes an assignment and before it starts one).
            self.emit(revoke(
                worker_id,
                self.s.epoch,
                rescued.iter().map(|a| (a.job.id.clone(), Some(a.attempt))),
                "its unreported Assignment was purged and is assigned again",
            ));
        }
        for a in rescued {
            let id = a.job.id.as_str();
            tracing::warn!(job_id = %id, worker_id, attempt = a.attempt, "a dead worker's purged assignment from an earlier leader: assigning it again");
            self.metrics.rescued_jobs_total.fetch_add(1, Relaxed);
            self.refusals.record(id, worker_id, a.attempt);
            let retry = AssignedJob::from_earlier_leader(a.job, a.attempt);
            self.retry(
                retry,
                &format!("worker {worker_id} died before reporting it"),
                None,
            );
        }
        self.capacity_changed = true;
    }

    /// Tell the clients of refused jobs that did not come back in time: nobody holds their
    /// body, so they cannot be assigned again.
    pub(in crate::engine) fn settle_orphan_refusals(&mut self, now: u64) {
        while let Some((_, _, at)) = self.orphan_refusals.front() {
            let over_bound = self.orphan_refusals.len() > CANCELLED_MAX;
            if !over_bound && now.saturating_sub(*at) < ORPHAN_REFUSAL_GRACE_MS {
                break;
            }
            let Some((job_id, worker_id, _)) = self.orphan_refusals.pop_front() else {
                break;
            };
            // A heartbeat of the refusing worker sent before its refusal may have booked
            // the job on it again (adopted): that is no sign of life unless the worker's
            // latest heartbeat still lists the job (it holds another attempt).
            let held_by = self.ledger.worker_of(&job_id).map(str::to_string);
            let refuser_still_lists = self
                .index
                .get(&worker_id)
                .is_some_and(|&i| self.workers[i].status.in_flight.contains(&job_id));
            let held = match held_by.as_deref() {
                Some(w) if w == worker_id => refuser_still_lists,
                Some(_) => true,
                None => false,
            };
            if held || self.queued_assigned_or_finished(&job_id) {
                continue;
            }
            if held_by.is_some() {
                self.ledger.release(&job_id);
                self.capacity_changed = true;
            }
            tracing::warn!(
                job_id,
                worker_id,
                "refused job never came back: its client is told"
            );
            self.emit(Outcome::FinalError {
                job_id,
                worker_id: Some(worker_id.clone()),
                error: ErrorCode::WorkerFailed,
                message: format!(
                    "worker {worker_id} refused the job and it could not be assigned again"
                ),
            });
        }
    }
}
