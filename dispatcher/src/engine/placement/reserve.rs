//! Reservation: the job leaves the queue and is booked on the chosen worker before the
//! next job is judged, then assigned.
//!
//! The reservation carries the job's KV demand and its protected profile (its floor is
//! judged against later admissions), the job's prefix blocks are recorded on the worker
//! ([`metronome_scheduler::PrefixIndex`]: the next job sharing them is predicted there
//! without their prefill), the stall its prefill imposes on the worker's
//! running jobs is charged to them, and its tenant is charged its predicted tokens (fair
//! share). A reservation the ledger refuses drops the job from the queue (logged): the
//! ledger never over-commits a worker. Publishing happens after the commit; a failed
//! publish rolls the reservation back ([`crate::engine::Event::PublishFailed`]).

use std::time::{Duration, Instant};

use metronome_scheduler::{Evaluation, JobProfile};

use super::order::waited_ms;
use super::Judged;
use crate::engine::lifecycle::AssignedJob;
use crate::engine::{Engine, Outcome};

/// Whether the chosen worker runs nothing else once the job is placed: an idle GPU is never
/// kept idle for someone else (on a GPU that takes one job at a time, the room kept would
/// be all of it).
pub(in crate::engine) fn bound_for_an_idle_worker(evaluation: &Evaluation) -> bool {
    evaluation
        .winner_score()
        .and_then(|c| c.prediction.as_ref())
        .is_some_and(|p| p.streams_after <= 1)
}

impl Engine {
    /// When the decision being made began, by the clock decisions are timed by (`None`
    /// without one).
    pub(in crate::engine) fn stopwatch(&self) -> Option<Instant> {
        self.decision_clock.map(|now| now())
    }

    /// Take the judged job from the queue, reserve it on `winner`, charge its stall and
    /// its tenant, and emit its Assignment with its decision record.
    pub(in crate::engine) fn reserve_and_assign(
        &mut self,
        model: &str,
        judged: Judged,
        winner: String,
        profile: JobProfile,
        started: Option<Instant>,
    ) {
        let now = self.now_ms;
        let job = self
            .queues
            .take(model, judged.pos)
            .expect("position exists");
        self.metrics
            .observe_queue_wait(model, "assigned", now.saturating_sub(job.enqueued_ms));
        self.drain
            .entry(model.to_string())
            .or_default()
            .on_placement(now, self.queues.len(model));
        let request = &judged.request;
        let kv_tokens = request.kv_tokens_on(&winner);
        if let Err(error) =
            self.ledger
                .reserve_profiled(&winner, &job.job.id, kv_tokens, profile, now)
        {
            tracing::error!(job_id = %job.job.id, %error, "reservation refused: job dropped from the queue");
            return;
        }
        if let Some(fingerprint) = &job.job.prefix {
            let capacity = self
                .index
                .get(&winner)
                .and_then(|&i| self.workers[i].status.kv)
                .and_then(|kv| kv.capacity_tokens);
            // Its blocks as the server will hold them: the prompt, then the output.
            let kv_held = u64::from(request.prompt_tokens) + request.predicted_output() as u64;
            self.prefix_index
                .place(&winner, capacity, &job.job.id, fingerprint, kv_held);
        }
        self.ledger
            .charge_stall(&winner, &job.job.id, judged.evaluation.winner_stall_ms, now);
        self.charge_fair(&job, request, now);
        let latency = match (started, self.decision_clock) {
            (Some(started), Some(now)) => now().saturating_duration_since(started),
            _ => Duration::ZERO,
        };
        self.metrics
            .observe_decision_latency(latency.as_nanos() as u64);
        if judged.least_harm_note.is_some() {
            self.metrics
                .least_harm_placements_total
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let waited = waited_ms(&job, judged.slo.ttft_ms, now);
        let other_models = self.workers.len() - self.model_workers(model).len();
        let decision = self.assignment_record(
            &job,
            judged,
            &winner,
            latency.as_micros() as u64,
            waited,
            other_models,
        );
        self.assigned.insert(
            job.job.id.clone(),
            AssignedJob {
                job: job.job.clone(),
                attempt: job.attempt,
                seq: job.seq,
                deadline_ms: job.deadline_ms,
                worker_id: Some(winner.clone()),
            },
        );
        self.emit(Outcome::Assign {
            job,
            worker_id: winner,
            epoch: self.s.epoch,
            decision: Box::new(decision),
        });
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::testing::{assigned, engine, heartbeat, job, step, T0};

    #[test]
    fn a_placed_job_is_booked_on_its_worker_before_the_next_is_judged() {
        let mut e = engine(|_| {});
        let hb = |id| heartbeat(id, &[], 1, T0, |_| {});
        let out = step(
            &mut e,
            vec![
                hb("w1"),
                hb("w2"),
                job("a", 100, 10, T0),
                job("b", 100, 10, T0),
            ],
            T0,
        );
        let placed = assigned(&out);
        assert_eq!(placed.len(), 2);
        assert_ne!(placed[0].1, placed[1].1);
        for (id, worker) in &placed {
            assert_eq!(e.ledger().worker_of(id), Some(worker.as_str()));
            assert!(e.assigned.contains_key(id));
        }
        assert_eq!(e.queues.len("m"), 0);
    }
}
