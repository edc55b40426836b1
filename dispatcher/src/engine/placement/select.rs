//! Scoring and selection: where the configured policy would place a job, over the job
//! fair order picked and, when no worker can take it now, the younger jobs of its flow
//! that lookahead tries in its place.
//!
//! Scoring and selection themselves are the scheduling core's
//! ([`metronome_scheduler::policy::choose`]: filter, score each term, normalise, pick;
//! no side effects): this step gives them the pool ([`super::filter`]), the request
//! ([`super::predict`]) and the ledger the job is judged on (the fair-share floor waiver's
//! when its tenant runs under its share, [`crate::engine::tenancy`]).

use metronome_scheduler::policy::{choose, PolicyKind};
use metronome_scheduler::{Evaluation, IdleTtft, JobRequest};

use super::filter::{narrowed_or, pool};
use super::Judged;
use crate::engine::tenancy::FloorWaiver;
use crate::engine::Engine;
use crate::queue::{tenant_of, Pos};

impl Engine {
    /// Judge the job at `pos` and, while no worker takes it, its lookahead jobs that are
    /// not late; the first with a winner is placed, else the head's judgement stands.
    /// `None` when every worker refuses every job of the model (the queue holds).
    pub(in crate::engine) fn judge(
        &mut self,
        model: &str,
        pos: Pos,
        prefill: &IdleTtft,
    ) -> Option<Judged> {
        // The jobs tried are all of one flow, so of one tenant: if it runs under its fair
        // share, they are judged without the floors of the jobs of the tenants above
        // theirs (see `FloorWaiver`). Made for the head, past the hold check, so a look
        // that refuses every job copies no ledger.
        let mut waiver = None;
        let mut head = None;
        for (k, at) in self.tries(model, pos).into_iter().enumerate() {
            let job = self.queues.get(model, at).expect("position exists");
            if k > 0 && self.late(model, prefill, job) {
                continue;
            }
            let (request, slo) = self.request_of(model, job);
            let job_id = job.job.id.clone();
            if k == 0 && self.s.policy == PolicyKind::Metronome {
                if self.refused_whatever_the_job(model, &request) {
                    return None;
                }
                waiver = self.floor_waiver(model, tenant_of(&job.job), self.now_ms);
            }
            let evaluation = self.select(model, &job_id, &request, waiver.as_ref());
            if evaluation.winner.is_some() {
                return Some(Judged {
                    pos: at,
                    request,
                    slo,
                    evaluation,
                    waiver,
                    least_harm_note: None,
                });
            }
            if k == 0 {
                head = Some((request, slo, evaluation));
            }
        }
        let (request, slo, evaluation) = head.expect("the head was evaluated");
        Some(Judged {
            pos,
            request,
            slo,
            evaluation,
            waiver,
            least_harm_note: None,
        })
    }

    /// Where the policy places `request` among the model's workers, leaving out those
    /// that refused the job while another can take it (listed among the rejected), on the
    /// ledger of `waiver` when there is one.
    pub(in crate::engine) fn select(
        &mut self,
        model: &str,
        job_id: &str,
        request: &JobRequest,
        waiver: Option<&FloorWaiver>,
    ) -> Evaluation {
        let narrowed = self.without_refusers(model, job_id);
        let workers = pool(
            &self.per_model,
            &self.workers,
            self.s.decision_list_wrong_model,
            model,
        );
        let mut evaluation = choose(
            self.s.policy,
            &mut self.policy_state,
            request,
            narrowed_or(&narrowed, workers),
            waiver.map_or(&self.ledger, |w| &w.ledger),
            &self.s.scheduler,
            self.now_ms,
        );
        if let Some((_, refused)) = narrowed {
            evaluation.rejected.extend(refused);
        }
        evaluation
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::testing::{body, engine, heartbeat, job, queued, step, T0};

    #[test]
    fn the_policy_picks_a_worker_that_admits_the_job() {
        let mut e = engine(|_| {});
        step(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {})], T0);
        e.cache_model_workers("m");
        let (request, _) = e.request_of("m", &queued(body("a", "m", None, 100, 10, T0), T0));
        let evaluation = e.select("m", "a", &request, None);
        assert_eq!(evaluation.winner.as_deref(), Some("w"));
        assert!(evaluation.rejected.is_empty());
    }

    #[test]
    fn a_worker_that_refused_the_job_is_listed_among_the_rejected() {
        let mut e = engine(|_| {});
        let hb = |id| heartbeat(id, &[], 1, T0, |_| {});
        step(&mut e, vec![hb("w1"), hb("w2")], T0);
        e.cache_model_workers("m");
        e.refusals.record("a", "w1", 1);
        let (request, _) = e.request_of("m", &queued(body("a", "m", None, 100, 10, T0), T0));
        let evaluation = e.select("m", "a", &request, None);
        assert_eq!(evaluation.winner.as_deref(), Some("w2"));
        assert_eq!(evaluation.rejected.len(), 1);
        assert_eq!(evaluation.rejected[0].worker_id, "w1");
    }

    #[test]
    fn lookahead_places_a_younger_job_that_fits_when_the_head_does_not() {
        let mut e = engine(|c| c.scheduler.lookahead = 4);
        // A 40k-token cache: the head needs more than is free beside a running job.
        let busy = heartbeat("w", &[], 1, T0, |s| {
            s.kv = Some(metronome_protocol::KvUsage {
                used_frac: 0.0,
                capacity_tokens: Some(10_000),
            })
        });
        step(&mut e, vec![busy, job("run", 4_000, 2_000, T0)], T0);
        // Judged here, not by the engine's own pass.
        e.read_backlog_first(u64::MAX);
        let younger = vec![
            job("big", 4_000, 4_000, T0 + 1),
            job("small", 100, 10, T0 + 2),
        ];
        step(&mut e, younger, T0 + 2);
        e.cache_model_workers("m");
        let prefill = e.idle_prefill("m");
        let pos = e.next_to_try("m", &prefill, &[]).expect("jobs wait");
        let judged = e.judge("m", pos, &prefill).expect("not held");
        let placed = e.queues.get("m", judged.pos).expect("waiting");
        assert_eq!(placed.job.id, "small");
        assert!(judged.evaluation.winner.is_some());
    }
}
