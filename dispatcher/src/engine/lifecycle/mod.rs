//! A job's life after placement: completion, refusal and retry, a failed Assignment
//! publish; cancels ([`cancel`]) and rescue of jobs a worker or an earlier leader left
//! ([`rescue`]).
//!
//! Invariant: a job this leader assigned is in `assigned` until its completion (or its
//! worker's death) settles it; a retry goes back through JOBS (its own msg-id per
//! attempt), never straight into a queue, so a leader that dies leaves it to the next.

pub mod cancel;
pub mod rescue;

use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use metronome_protocol::CompletionEvent;
use metronome_protocol::CompletionOutcome;
use metronome_protocol::ErrorCode;
use metronome_protocol::Job;
use metronome_protocol::Outcome as DecisionOutcome;

use crate::engine::lifecycle::cancel::cancel_key;
use crate::engine::Engine;
use crate::engine::Outcome;
use crate::engine::CANCELLED_MAX;
use crate::queue::QueuedJob;
use crate::worker_claims::Holding;

/// A job this leader assigned and has not seen finish.
pub(super) struct AssignedJob {
    pub(in crate::engine) job: Arc<Job>,
    pub(in crate::engine) attempt: u32,
    pub(in crate::engine) seq: u64,
    pub(in crate::engine) deadline_ms: u64,
    /// The worker it was assigned to (`None`: not known here), the only one whose events
    /// about it count ([`crate::worker_claims`]).
    pub(in crate::engine) worker_id: Option<String>,
}

impl AssignedJob {
    /// A job an earlier leader assigned, known here only from a copy (a purged Assignment,
    /// a refusal). Its place in the queue is unknown: it was placed before anything now
    /// waiting, so it goes first; its deadline is set when it is retried.
    fn from_earlier_leader(job: Job, attempt: u32) -> AssignedJob {
        AssignedJob {
            job: Arc::new(job),
            attempt,
            seq: 0,
            deadline_ms: 0,
            worker_id: None,
        }
    }
}

impl Engine {
    pub(super) fn on_completion(&mut self, event: CompletionEvent, acker: Option<Arc<Acker>>) {
        // Acknowledged once handled, unless the job is retried: then once it is back in
        // JOBS (the publisher acknowledges it with the retry's PubAck).
        let mut acker = acker;
        self.completion(event, &mut acker);
        self.ack(acker);
    }

    pub(super) fn completion(
        &mut self,
        mut event: CompletionEvent,
        acker: &mut Option<Arc<Acker>>,
    ) {
        // Only the worker holding the job may speak for it (a stolen worker identity must
        // not end, re-run or skew another worker's job).
        let holding = Holding {
            booked_on: self.ledger.worker_of(&event.job_id),
            assigned_to: self
                .assigned
                .get(&event.job_id)
                .and_then(|a| a.worker_id.as_deref()),
        };
        if !self
            .claims
            .admit(&event, holding, self.now_ms, &self.metrics)
        {
            return;
        }
        if event.outcome == CompletionOutcome::Done {
            self.learn_output_length(&event);
        }
        if event.outcome != CompletionOutcome::Refused {
            let now = self.now_ms;
            self.finished.insert(&event.job_id, now);
            self.refusals.forget(&event.job_id);
            if let Some(a) = self.assigned.get(&event.job_id) {
                self.cancelled
                    .remove(&cancel_key(a.job.tenant.as_deref(), &event.job_id));
            }
            if let Some(&i) = self.index.get(&event.worker_id) {
                let mut patched = self.workers[i].status.clone();
                self.drop_finished(&mut patched);
                self.workers[i].status = patched;
                self.per_model.clear();
            }
        }
        if self.ledger.worker_of(&event.job_id) == Some(event.worker_id.as_str()) {
            self.ledger.release(&event.job_id);
            self.capacity_changed = true;
        }
        let ours = self
            .assigned
            .get(&event.job_id)
            .is_some_and(|a| a.attempt == event.attempt);
        if ours {
            self.settle_fair(&event);
        }
        if !ours && event.outcome != CompletionOutcome::Refused {
            return;
        }
        let assigned = if ours {
            self.assigned.remove(&event.job_id)
        } else {
            None
        };
        if event.outcome != CompletionOutcome::Refused {
            return;
        }
        match assigned {
            Some(a) => {
                tracing::info!(job_id = %event.job_id, worker_id = %event.worker_id, attempt = event.attempt, error = ?event.error, "worker refused the job: assigning it again");
                self.refusals
                    .record(&event.job_id, &event.worker_id, event.attempt);
                self.retry(a, &format!("refused by {}", event.worker_id), acker.take());
            }
            None if !self.queues.contains(&event.job_id)
                && self.ledger.worker_of(&event.job_id).is_none() =>
            {
                // Refused, and this leader does not hold the job's body (assigned by an
                // earlier leader).
                match event.job.take() {
                    // The refusal carries the job (the intake kept the copy only where the
                    // decision on record vouches for it): assigned again like a refusal of
                    // our own. A retry the earlier leader already put back has the same
                    // msg-id, so JOBS keeps one.
                    Some(job) if !self.queued_assigned_or_finished(&event.job_id) => {
                        tracing::info!(job_id = %event.job_id, worker_id = %event.worker_id, attempt = event.attempt, error = ?event.error, "worker refused a job an earlier leader assigned: assigning it again from the copy it carried");
                        self.refusals
                            .record(&event.job_id, &event.worker_id, event.attempt);
                        let retry = AssignedJob::from_earlier_leader(*job, event.attempt);
                        self.retry(
                            retry,
                            &format!("refused by {}", event.worker_id),
                            acker.take(),
                        );
                    }
                    // No copy: that leader may have put the retry back in JOBS before it
                    // died (the refusal is acknowledged only after that), and the retry then
                    // arrives within moments of the takeover: look again after a grace
                    // period, and tell the client only if the job has not come back by then.
                    _ => {
                        let now = self.now_ms;
                        self.orphan_refusals.push_back((
                            event.job_id.clone(),
                            event.worker_id.clone(),
                            now,
                        ));
                        // Bounded: over the bound the oldest is settled at once.
                        if self.orphan_refusals.len() > CANCELLED_MAX {
                            self.settle_orphan_refusals(now);
                        }
                    }
                }
            }
            None => {}
        }
    }

    /// Queue a job again with the next attempt, or reject it when attempts are used up.
    /// Its JOBS message was acknowledged when it was assigned, so the retry is put back on
    /// `jobs.submit` (own msg-id per attempt, its attempt and original place in headers)
    /// rather than kept in memory: a leader that dies now leaves it to the next one.
    /// `event` (the refusal that caused it) is acknowledged once the retry is stored.
    pub(super) fn retry(&mut self, a: AssignedJob, why: &str, mut event: Option<Arc<Acker>>) {
        let now = self.now_ms;
        let cancelled = self
            .cancelled
            .remove(&cancel_key(a.job.tenant.as_deref(), &a.job.id));
        if cancelled || a.attempt >= self.s.max_attempts {
            // Settled here: nothing to wait for before acknowledging the event.
            self.ack(event.take());
        }
        if cancelled {
            // Cancelled while its assignment was on the way: not assigned again.
            self.reject(
                &a.job,
                a.attempt,
                DecisionOutcome::Rejected,
                "cancelled",
                &format!("cancelled by its client before it started ({why})"),
                ErrorCode::Cancelled,
                None,
                0,
            );
            return;
        }
        if a.attempt >= self.s.max_attempts {
            let reason = format!("gave up after {} attempts (last: {why})", a.attempt);
            self.reject(
                &a.job,
                a.attempt + 1,
                DecisionOutcome::Rejected,
                "max_attempts",
                &reason,
                ErrorCode::WorkerFailed,
                None,
                0,
            );
            return;
        }
        let refused_by = self.refusals.of(&a.job.id);
        self.emit(Outcome::Requeue {
            refused_by,
            job: Box::new(QueuedJob {
                job: a.job,
                attempt: a.attempt + 1,
                acker: None,
                seq: a.seq,
                enqueued_ms: now,
                deadline_ms: a.deadline_ms.max(now + self.s.default_deadline_ms),
                progress_ms: now,
            }),
            event,
        });
    }

    /// A failed Assignment publish is an attempt: the job goes back to its place with the
    /// next attempt (and so a new WORK msg-id), and `max_attempts` ends a job that can never
    /// be published (e.g. to a subject no stream captures) instead of cycling forever.
    pub(super) fn publish_failed(&mut self, mut job: QueuedJob, worker_id: &str) {
        if job.attempt >= self.s.max_attempts {
            let reason = format!(
                "gave up after {} attempts (last: publishing the assignment to {worker_id} failed)",
                job.attempt
            );
            let now = self.now_ms;
            self.reject(
                &job.job,
                job.attempt + 1,
                DecisionOutcome::Rejected,
                "max_attempts",
                &reason,
                ErrorCode::WorkerFailed,
                job.acker.take(),
                now.saturating_sub(job.enqueued_ms),
            );
            return;
        }
        job.attempt += 1;
        self.queues.put_back(job);
        self.capacity_changed = true;
    }

    /// Whether this leader holds `job_id` other than as a booking on a worker: waiting in
    /// a queue, assigned by it (it holds the body), or finished.
    pub(super) fn queued_assigned_or_finished(&self, job_id: &str) -> bool {
        self.queues.contains(job_id)
            || self.assigned.contains_key(job_id)
            || self.finished.contains(job_id)
    }
}
