//! Ordering: which waiting job of a model is tried next, and which younger jobs of its
//! flow lookahead may try in its place.
//!
//! The queue keeps the fair order (virtual token counters per tenant, FIFO within a
//! tenant, [`crate::queue::Queues::next_to_try`]); this step adds the TTFT rule: a job
//! that has waited so long that even an idle worker would give it its first token past its
//! target ("late") goes only when no job that can still meet its target waits.

use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::IdleTtft;

use crate::engine::Engine;
use crate::queue::{Pos, QueuedJob};

/// How long a queued job has waited since its client submitted it. The client's
/// `submitted_ms` is trusted only within [read − TTFT target, read]: a skewed clock can
/// neither hand a job extra budget nor spend it all.
pub(in crate::engine) fn waited_ms(job: &QueuedJob, ttft_ms: u64, now_ms: u64) -> u64 {
    let since = job
        .job
        .submitted_ms
        .clamp(job.enqueued_ms.saturating_sub(ttft_ms), job.enqueued_ms);
    now_ms.saturating_sub(since)
}

/// Whether a job that has waited `waited_ms` misses a `ttft_target_ms` target wherever it
/// goes: even the fastest idle worker's prefill (`idle_ttft_ms`) takes it past the target.
pub(in crate::engine) fn is_late(waited_ms: u64, idle_ttft_ms: f64, ttft_target_ms: u64) -> bool {
    waited_ms as f64 + idle_ttft_ms >= ttft_target_ms as f64
}

impl Engine {
    /// What the model's live workers would take to prefill a prompt with nothing else to
    /// do: the lateness of each waiting job is judged against it.
    pub(in crate::engine) fn idle_prefill(&self, model: &str) -> IdleTtft {
        let now = self.now_ms;
        IdleTtft::of(
            self.workers
                .iter()
                .filter(|w| w.status.model == model && self.alive(w, now)),
        )
    }

    /// Whether `job` is late ([`is_late`]) at this time.
    pub(in crate::engine) fn late(&self, model: &str, prefill: &IdleTtft, job: &QueuedJob) -> bool {
        let ttft = self
            .s
            .scheduler
            .slo_for(model, job.job.slo.as_ref())
            .ttft_ms;
        let waited = waited_ms(job, ttft, self.now_ms);
        is_late(waited, prefill.ttft_ms(job.job.prompt_tokens), ttft)
    }

    /// The job to try next: the fair order's, the jobs that can still meet their TTFT
    /// target first, none of the `held_back` tenants'.
    pub(in crate::engine) fn next_to_try(
        &self,
        model: &str,
        prefill: &IdleTtft,
        held_back: &[String],
    ) -> Option<Pos> {
        self.queues
            .next_to_try(model, |j| self.late(model, prefill, j), held_back)
    }

    /// The jobs tried for one placement: the one fairness and the TTFT rule chose, then,
    /// in case no worker can take it now, up to `lookahead` younger jobs of its flow (one
    /// of which a worker may take without a predicted miss).
    pub(in crate::engine) fn tries(&self, model: &str, pos: Pos) -> Vec<Pos> {
        let mut tries = vec![pos];
        if self.s.policy == PolicyKind::Metronome && self.s.scheduler.lookahead > 0 {
            tries.extend(
                self.queues
                    .following(model, pos, self.s.scheduler.lookahead),
            );
        }
        tries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::{body, engine, heartbeat, job, queued, step, T0};

    #[test]
    fn a_job_is_late_once_its_wait_and_an_idle_prefill_reach_its_target() {
        assert!(!is_late(800, 199.0, 1_000));
        assert!(is_late(800, 200.0, 1_000));
        assert!(is_late(1_200, 0.0, 1_000));
    }

    #[test]
    fn a_clients_submission_time_counts_only_within_the_ttft_target() {
        let mut early = body("a", "m", None, 100, 10, 0);
        // Submitted long before the dispatcher read it: at most the target is counted.
        early.submitted_ms = 0;
        assert_eq!(waited_ms(&queued(early, 10_000), 1_000, 10_500), 1_500);
        // Submitted "after" it was read (a clock ahead): counted from the read.
        let mut ahead = body("b", "m", None, 100, 10, 0);
        ahead.submitted_ms = 20_000;
        assert_eq!(waited_ms(&queued(ahead, 10_000), 1_000, 10_500), 500);
    }

    #[test]
    fn lookahead_tries_the_younger_jobs_of_the_same_flow() {
        let mut e = engine(|c| c.scheduler.lookahead = 2);
        // Judged here, not by the engine's own pass.
        e.read_backlog_first(u64::MAX);
        let worker = heartbeat("w1", &[], 1, T0, |_| {});
        let jobs = ["a", "b", "c", "d"].map(|id| job(id, 100, 10, T0));
        step(&mut e, std::iter::once(worker).chain(jobs).collect(), T0);
        let pos = e
            .next_to_try("m", &IdleTtft::of([]), &[])
            .expect("jobs wait");
        let ids: Vec<&str> = e
            .tries("m", pos)
            .into_iter()
            .map(|p| e.queues.get("m", p).expect("waiting").job.id.as_str())
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn a_late_job_is_tried_only_when_no_job_that_can_meet_its_target_waits() {
        let mut e = engine(|_| {});
        e.read_backlog_first(u64::MAX);
        let full = heartbeat("w1", &[], 1, T0, |_| {});
        // `old` was submitted 10 s before it was read (counted up to its TTFT target),
        // `fresh` just now: `old` is late, so `fresh` goes first.
        let mut old = body("old", "m", None, 100, 10, T0 - 10_000);
        old.submitted_ms = T0 - 10_000;
        let inputs = vec![
            full,
            crate::engine::Event::Job(Box::new(crate::engine::Incoming {
                job: std::sync::Arc::new(old),
                acker: None,
                seq: 1,
                received_ms: T0,
                attempt: 1,
                refused_by: Vec::new(),
            })),
            job("fresh", 100, 10, T0 + 1),
        ];
        step(&mut e, inputs, T0 + 1);
        let prefill = e.idle_prefill("m");
        let pos = e.next_to_try("m", &prefill, &[]).expect("jobs wait");
        assert_eq!(e.queues.get("m", pos).expect("waiting").job.id, "fresh");
    }
}
