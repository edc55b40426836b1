//! Filtering: the workers a job is judged on, before any score.
//!
//! The scheduling core's filters ([`metronome_scheduler::filter`]: model, health,
//! heartbeat, draining, concurrency, KV headroom, TTFT and decode-rate floors) run inside
//! selection, per worker; this step chooses the pool they run over: the model's own
//! workers (or every worker, when decisions list the others as wrong-model rejections),
//! less the workers that refused the job while another can take it ([`Refusals`]). It
//! also holds the queue when every worker refuses every job of the model, without judging
//! each job.
//!
//! [`Refusals`]: crate::refusals::Refusals

use std::collections::HashMap;

use metronome_protocol::Rejection;
use metronome_scheduler::filter;
use metronome_scheduler::{JobRequest, WorkerView};

use crate::engine::Engine;

/// The workers a job of `model` is judged on: the model's own (`per_model`), or `workers`
/// when decisions list every worker (`all`). A free function over the fields, so a caller
/// can hold it beside a mutable borrow of another field (the policy's state).
pub(in crate::engine) fn pool<'a>(
    per_model: &'a HashMap<String, Vec<WorkerView>>,
    workers: &'a [WorkerView],
    all: bool,
    model: &str,
) -> &'a [WorkerView] {
    if all {
        workers
    } else {
        &per_model[model]
    }
}

/// `workers` less those in `narrowed` (the pool without the workers that refused the job,
/// when [`crate::refusals::Refusals::narrow`] found one).
pub(in crate::engine) fn narrowed_or<'a>(
    narrowed: &'a Option<(Vec<WorkerView>, Vec<Rejection>)>,
    workers: &'a [WorkerView],
) -> &'a [WorkerView] {
    narrowed.as_ref().map_or(workers, |(pool, _)| pool)
}

impl Engine {
    /// Keep the model's own workers apart (until the next worker change), when decisions
    /// leave other models' workers out: the scoring core then looks only at them.
    pub(in crate::engine) fn cache_model_workers(&mut self, model: &str) {
        if !self.s.decision_list_wrong_model && !self.per_model.contains_key(model) {
            let views = self
                .workers
                .iter()
                .filter(|w| w.status.model == model)
                .cloned()
                .collect();
            self.per_model.insert(model.to_string(), views);
        }
    }

    /// The pool of `model` ([`pool`]); [`Engine::cache_model_workers`] first.
    pub(in crate::engine) fn model_workers(&self, model: &str) -> &[WorkerView] {
        pool(
            &self.per_model,
            &self.workers,
            self.s.decision_list_wrong_model,
            model,
        )
    }

    /// The model's pool without the workers that refused `job_id`, with their
    /// rejections; `None` when no such worker or none else can take it.
    pub(in crate::engine) fn without_refusers(
        &self,
        model: &str,
        job_id: &str,
    ) -> Option<(Vec<WorkerView>, Vec<Rejection>)> {
        let now = self.now_ms;
        // The pool may list other models' workers (decision_list_wrong_model): only a
        // worker of the job's own model is "another worker that can take it".
        self.refusals
            .narrow(job_id, self.model_workers(model), |w| {
                w.status.model == model && self.takes_work(w, now)
            })
    }

    /// Whether every worker refuses `request` for a reason that refuses every job of the
    /// model (at its cap, stale, ...): then nothing can be placed, not even where it does
    /// least harm, and the jobs behind it would meet the same refusals. The queue is held
    /// as a full evaluation would hold it (the refusals counted), without one per job
    /// tried: under load most looks are these.
    pub(in crate::engine) fn refused_whatever_the_job(
        &self,
        model: &str,
        request: &JobRequest,
    ) -> bool {
        let Some(codes) = filter::refused_whatever_the_job(
            &filter::ADMISSION,
            request,
            self.model_workers(model),
            &self.ledger,
            &self.s.scheduler,
            self.now_ms,
        ) else {
            return false;
        };
        self.metrics.held_codes(model, &codes);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::{body, engine, heartbeat, step, T0};

    fn two_models() -> Engine {
        let mut e = engine(|c| c.decision_list_wrong_model = false);
        let other = heartbeat("x", &[], 1, T0, |s| s.model = "other".into());
        step(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {}), other], T0);
        e.cache_model_workers("m");
        e
    }

    #[test]
    fn a_job_is_judged_on_its_models_workers_only() {
        let e = two_models();
        let ids: Vec<&str> = e
            .model_workers("m")
            .iter()
            .map(|w| w.status.worker_id.as_str())
            .collect();
        assert_eq!(ids, ["w"]);
    }

    #[test]
    fn a_worker_that_refused_the_job_is_left_out_while_another_can_take_it() {
        let mut e = two_models();
        step(&mut e, vec![heartbeat("w2", &[], 1, T0, |_| {})], T0);
        e.cache_model_workers("m");
        e.refusals.record("a", "w", 1);
        let (pool, refused) = e.without_refusers("m", "a").expect("narrowed");
        assert_eq!(pool.len(), 1);
        assert_eq!(pool[0].status.worker_id, "w2");
        assert_eq!(refused.len(), 1);
        assert!(e.without_refusers("m", "b").is_none());
    }

    #[test]
    fn a_model_whose_every_worker_is_at_its_cap_holds_its_queue() {
        let mut e = engine(|_| {});
        // Its one place taken by a job it reports.
        let full = heartbeat("w", &["x"], 1, T0, |s| s.max_concurrency = 1);
        step(&mut e, vec![full], T0);
        e.cache_model_workers("m");
        let j = body("a", "m", None, 100, 10, T0);
        let (request, _) = e.request_of("m", &crate::engine::testing::queued(j, T0));
        assert!(e.refused_whatever_the_job("m", &request));
        let mut open = engine(|_| {});
        step(&mut open, vec![heartbeat("w", &[], 1, T0, |_| {})], T0);
        open.cache_model_workers("m");
        assert!(!open.refused_whatever_the_job("m", &request));
    }
}
