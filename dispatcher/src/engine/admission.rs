//! Admission: whether an arriving job may wait for a worker at all (its model is served,
//! it fits some worker when empty, its deadline has not passed, its cancel did not
//! overtake it, its model's queue has room), and the early answer for waiting jobs whose
//! deadline the queue is predicted to miss.

use std::sync::atomic::Ordering::Relaxed;

use metronome_protocol::ErrorCode;
use metronome_protocol::Job;
use metronome_protocol::Outcome as DecisionOutcome;
use metronome_scheduler::filter::fits_when_empty;
use metronome_scheduler::JobRequest;
use metronome_scheduler::Tokens;

use crate::engine::lifecycle::cancel::cancel_key;
use crate::engine::Effect;
use crate::engine::Engine;
use crate::engine::Incoming;
use crate::engine::Outcome;
use crate::queue::QueuedJob;

impl Engine {
    /// A job read from JOBS: settled at once if a worker already holds it, refused if it
    /// cannot be admitted ([`Engine::refuse_on_arrival`]), else queued and given a look.
    pub(super) fn on_job(&mut self, inc: Incoming) {
        let Some(inc) = self.settle_if_held(inc) else {
            return;
        };
        let Some(inc) = self.refuse_on_arrival(inc) else {
            return;
        };
        self.enqueue(inc);
    }

    /// A redelivery of a job this leader already holds: one a worker holds (adopted from
    /// its heartbeat, or assigned earlier in this term) is settled without a second
    /// assignment (the decision's msg-id drops it if one already exists); one waiting here
    /// stands. `Some` (handed back) when the job is new here.
    fn settle_if_held(&mut self, inc: Incoming) -> Option<Incoming> {
        let job_id = inc.job.id.as_str();
        if let Some(worker) = self.ledger.worker_of(job_id) {
            let worker = worker.to_string();
            tracing::info!(job_id = %job_id, worker_id = %worker, "redelivered job is already held by a worker");
            let attempt = self.assigned.get(job_id).map_or(inc.attempt, |a| a.attempt);
            let now = self.now_ms;
            let mut decision =
                self.decision(&inc.job, DecisionOutcome::Assigned, attempt, 0, 0, now);
            decision.worker_id = Some(worker);
            decision.reason =
                Some("already held by the worker (adopted from its heartbeat)".into());
            decision.reason_code = Some("already_assigned".into());
            self.emit(Outcome::DecisionOnly {
                decision: Box::new(decision),
                acker: inc.acker,
            });
            return None;
        }
        // A redelivery of a job already waiting here: the queued copy stands.
        (!self.queues.contains(job_id)).then_some(inc)
    }

    /// Refuse a job that cannot wait for a worker: its cancel overtook it, no live worker
    /// serves its model, none could ever hold it, or its start deadline has passed.
    /// `Some` (handed back) when it may wait.
    fn refuse_on_arrival(&mut self, inc: Incoming) -> Option<Incoming> {
        let now = self.now_ms;
        let Some((attempt, outcome, code, reason, error)) = self.arrival_refusal(&inc, now) else {
            return Some(inc);
        };
        self.reject(
            &inc.job,
            attempt,
            outcome,
            code,
            &reason,
            error,
            inc.acker,
            now.saturating_sub(inc.received_ms),
        );
        None
    }

    /// Why `inc` cannot wait for a worker, if it cannot: the attempt its rejection is
    /// recorded as, the outcome, reason code, reason and error.
    fn arrival_refusal(
        &mut self,
        inc: &Incoming,
        now: u64,
    ) -> Option<(u32, DecisionOutcome, &'static str, String, ErrorCode)> {
        let job_id = inc.job.id.as_str();
        if self
            .cancelled
            .remove(&cancel_key(inc.job.tenant.as_deref(), job_id))
        {
            // Its cancel overtook it (the cancel is a core message, the job waits in JOBS).
            tracing::info!(job_id = %job_id, "cancelled before it reached the queue");
            let reason = "cancelled by its client before it was queued".to_string();
            let rejected = DecisionOutcome::Rejected;
            return Some((
                inc.attempt,
                rejected,
                "cancelled",
                reason,
                ErrorCode::Cancelled,
            ));
        }
        let served = self
            .workers
            .iter()
            .any(|w| w.status.model == inc.job.model && self.alive(w, now));
        if !served {
            let reason = format!("no worker serves model {:?}", inc.job.model);
            let rejected = DecisionOutcome::Rejected;
            return Some((
                inc.attempt,
                rejected,
                "unknown_model",
                reason,
                ErrorCode::UnknownModel,
            ));
        }
        if let Some(reason) = self.unplaceable(&inc.job, now) {
            let rejected = DecisionOutcome::Rejected;
            return Some((1, rejected, "unplaceable", reason, ErrorCode::InvalidJob));
        }
        let deadline = inc
            .job
            .deadline_ms
            .filter(|d| *d <= now && inc.attempt <= 1)?;
        // Its start deadline passed before it arrived (a client's clock, a job held back,
        // or a hostile one): starting it now would break the contract the deadline states,
        // so it is answered like one that expired in the queue. A retry keeps its chance:
        // the leader gave it to a worker in time.
        let reason = format!(
            "the job's start deadline had passed {} ms before it reached the dispatcher",
            now - deadline
        );
        let expired = DecisionOutcome::Expired;
        Some((
            inc.attempt,
            expired,
            "deadline_exceeded",
            reason,
            ErrorCode::DeadlineExceeded,
        ))
    }

    /// Queue an admitted job, with its start deadline (its own, or the default, at most
    /// `max_deadline_ms` after it was read) and the refusals a retry carries, and give its
    /// model's queue a look; a full queue refuses it.
    fn enqueue(&mut self, inc: Incoming) {
        let latest = inc.received_ms.saturating_add(self.s.max_deadline_ms);
        let deadline_ms = inc
            .job
            .deadline_ms
            .unwrap_or(inc.received_ms + self.s.default_deadline_ms)
            .min(latest);
        let model = inc.job.model.clone();
        // A retry's refusals, as the leader that put it back knew them (this term's own are
        // already here; recording one twice keeps one).
        for (worker, attempt) in &inc.refused_by {
            self.refusals.record(&inc.job.id, worker, *attempt);
        }
        let queued = QueuedJob {
            job: inc.job,
            attempt: inc.attempt.max(1),
            acker: inc.acker,
            seq: inc.seq,
            enqueued_ms: inc.received_ms,
            deadline_ms,
            progress_ms: inc.received_ms,
        };
        match self.queues.push(queued) {
            // Every arrival gets a look: even behind waiting jobs it may be the first that
            // can still meet its TTFT target.
            // A job that stays waiting with a deadline the queue cannot meet is answered by
            // the next tick's sweep, not here: one sorted pass per tick instead of one per
            // arrival.
            Ok(()) => self.dispatch_model(&model),
            Err((job, crate::queue::QueueRefusal::Full { bound })) => {
                let reason = format!("admission queue of model {model:?} is full ({bound} jobs)");
                self.reject(
                    &job.job,
                    job.attempt,
                    DecisionOutcome::Rejected,
                    "queue_full",
                    &reason,
                    ErrorCode::QueueFull,
                    job.acker,
                    0,
                );
            }
        }
    }

    /// Why no live worker of the job's model could ever hold it, even with nothing else
    /// running (its KV demand exceeds every worker's usable cache); `None` when one could,
    /// or when a worker does not report its KV capacity (then nobody can tell).
    pub(super) fn unplaceable(&self, job: &Job, now: u64) -> Option<String> {
        let slo = self.s.scheduler.slo_for(&job.model, job.slo.as_ref());
        let request = JobRequest::from_job(job, f64::from(job.max_tokens), slo);
        let mut largest = 0u64;
        let mut workers = 0usize;
        for w in self
            .workers
            .iter()
            .filter(|w| w.status.model == job.model && self.alive(w, now))
        {
            if fits_when_empty(w, &request, &self.s.scheduler) != Some(false) {
                return None;
            }
            workers += 1;
            let capacity = w.status.kv.and_then(|kv| kv.capacity_tokens).unwrap_or(0);
            largest = largest.max(capacity);
        }
        (workers > 0).then(|| {
            format!(
                "no worker of model {:?} can ever hold this job: it needs {} KV tokens (prompt + max_tokens), the largest KV cache of its {workers} live workers is {largest} tokens ({}% kept free); lower max_tokens or shorten the prompt",
                job.model,
                request.kv_tokens(),
                self.s.scheduler.kv_headroom_frac * 100.0
            )
        })
    }

    /// Answer at once the model's waiting jobs whose deadline falls before the queue is
    /// predicted to reach them (429 with `Retry-After`), instead of holding their clients
    /// until the deadline passes. Jobs are counted in queue order; the prediction is the
    /// model's measured drain rate ([`DrainRate`]), so nothing is answered before the queue
    /// has been seen draining. Runs on every tick.
    pub(super) fn answer_unmeetable(&mut self, model: &str, now: u64) {
        let Some(drain) = self
            .drain
            .get(model)
            .filter(|d| d.mean_interval_ms().is_some())
        else {
            return;
        };
        // Counted in the order fair sharing will serve them, not in arrival order: a light
        // tenant's job behind a flood is served next and must not be refused for the
        // flood's length. Later arrivals of lighter tenants can still go ahead, so a
        // flooding tenant's wait is underestimated, never a light tenant's overstated.
        let waiting: Vec<(u64, &str)> = self
            .queues
            .service_order(model, |j| Tokens {
                prompt: f64::from(j.job.prompt_tokens),
                output: self.predicted_output(&j.job),
            })
            .into_iter()
            .map(|j| (j.deadline_ms, j.job.id.as_str()))
            .collect();
        let mut doomed: Vec<(String, f64)> = Vec::new();
        for (pos, &(deadline_ms, id)) in waiting.iter().enumerate() {
            // Jobs answered here leave the queue: they are not ahead of anyone.
            let Some(wait) = drain.predicted_wait_ms(pos - doomed.len(), now) else {
                break;
            };
            if now as f64 + wait > deadline_ms as f64 {
                doomed.push((id.to_string(), wait));
            }
        }
        for (id, wait) in doomed {
            let Some(job) = self.queues.remove(&id) else {
                continue;
            };
            self.metrics
                .observe_queue_wait(model, "rejected", now.saturating_sub(job.enqueued_ms));
            let left = job.deadline_ms.saturating_sub(now);
            let reason = format!(
                "deadline cannot be met: {wait:.0} ms predicted before a worker of model {model:?} is free for it, {left} ms left before its deadline"
            );
            self.metrics.deadline_unmeetable_total.fetch_add(1, Relaxed);
            self.refuse(
                &job.job,
                job.attempt,
                DecisionOutcome::Rejected,
                "deadline_unmeetable",
                &reason,
                ErrorCode::QueueFull,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
                Some(wait.ceil() as u64),
            );
        }
    }

    /// Answer the waiting jobs whose start deadline has passed.
    pub(super) fn expire_overdue_jobs(&mut self, now: u64) {
        for job in self.queues.take_expired(now) {
            self.metrics.observe_queue_wait(
                &job.job.model,
                "expired",
                now.saturating_sub(job.enqueued_ms),
            );
            let reason = format!(
                "no eligible worker before the deadline ({} ms in the queue)",
                now.saturating_sub(job.enqueued_ms)
            );
            self.reject(
                &job.job,
                job.attempt,
                DecisionOutcome::Expired,
                "deadline_exceeded",
                &reason,
                ErrorCode::DeadlineExceeded,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
            );
        }
    }

    /// Extend the ack wait of the JOBS messages of jobs waiting a third of it since the
    /// last extension, so JetStream does not redeliver a job still waiting here.
    pub(super) fn extend_ack_waits(&mut self, now: u64) {
        let due = self
            .queues
            .due_for_progress(now.saturating_sub(self.s.ack_wait_ms / 3), now);
        if !due.is_empty() {
            self.effects.push(Effect::Progress(due));
        }
    }
}
