//! Placement: which waiting job goes to which worker, and when a job waits instead.
//!
//! One pass per model, one job at a time, each step a function of its own:
//!
//! 1. [`order`]: the next job to try (fair order, FIFO within a tenant, jobs that can
//!    still meet their TTFT target first) and the younger jobs of its flow that lookahead
//!    may try instead.
//! 2. [`filter`]: the workers a job is judged on (the model's own, less those that refused
//!    it), and the refusal that holds the whole queue without judging each job.
//! 3. [`predict`]: what the job will cost: the request with its predicted output and the
//!    TTFT budget left, and the profile it is protected with once running.
//! 4. [`select`]: scoring and selection by the configured policy (the scheduling core's
//!    filter → score → select), over the job and its lookahead.
//! 5. [`least_harm`]: when no worker admits the job without a predicted miss, whether it
//!    is placed where it does least harm anyway.
//! 6. Tenancy ([`crate::engine::tenancy`]): whether the job waits to keep room for a lighter
//!    tenant.
//! 7. [`reserve`]: the reservation, the fair-share charge and the Assignment with its
//!    decision record.
//!
//! What each worker holds of a job's prompt in its prefix cache enters at prediction
//! ([`predict`]); reservation records the placed job's blocks on its worker.
//!
//! Invariant: one job's reservation is committed before the next job is judged, so N
//! simultaneous jobs on N idle workers land on N distinct workers.

pub mod filter;
pub mod least_harm;
pub mod order;
pub mod predict;
pub mod reserve;
pub mod select;

use metronome_protocol::Slo;
use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::{Evaluation, JobRequest};

use crate::engine::tenancy::FloorWaiver;
use crate::engine::Engine;
use crate::metrics::HELD_FOR_LIGHTER_TENANT;
use crate::queue::{tenant_of, Pos};

/// A job judged for placement: where it waits, what it asks, and where the policy would
/// place it (or why nowhere).
pub(in crate::engine) struct Judged {
    /// Its place in the model's queue (the job fair order picked, or a lookahead job).
    pub pos: Pos,
    pub request: JobRequest,
    pub slo: Slo,
    pub evaluation: Evaluation,
    /// The fair-share floor waiver it was judged under ([`Engine::floor_waiver`]).
    pub waiver: Option<FloorWaiver>,
    /// Why it goes where it does least harm, when it does ([`least_harm`]).
    pub least_harm_note: Option<String>,
}

impl Engine {
    pub(super) fn dispatch_all(&mut self) {
        // Jobs that ended, however they ended, leave their blocks cached, unreferenced.
        let ledger = &self.ledger;
        self.prefix_index
            .settle(|job, worker| ledger.worker_of(job) == Some(worker));
        for model in self.queues.models() {
            self.dispatch_model(&model);
        }
    }

    /// Place the model's jobs until the next one cannot be placed. The oldest job that can
    /// still meet its TTFT target goes first; jobs already past it ("late": they will miss
    /// their TTFT wherever they go) only when no such job waits, so in overload capacity
    /// goes to the jobs it can still serve well. Among the jobs that can, the order is
    /// the fair order, FIFO within a tenant, and the first that cannot be placed holds
    /// back its own tenant's later jobs, not the other tenants' (head-of-line blocking
    /// within one tenant of one model only).
    pub(super) fn dispatch_model(&mut self, model: &str) {
        if self.reading_backlog() {
            return;
        }
        // Tenants whose next job was held to keep room for a lighter tenant: the rest of
        // this pass offers the room to the others' jobs, whatever the counters say.
        let mut held_back: Vec<String> = Vec::new();
        loop {
            if !self.is_fresh() {
                return;
            }
            let prefill = self.idle_prefill(model);
            let Some(pos) = self.next_to_try(model, &prefill, &held_back) else {
                // Only jobs held back for a lighter tenant left: the queue is not empty.
                if held_back.is_empty() {
                    if let Some(d) = self.drain.get_mut(model) {
                        d.on_empty();
                    }
                }
                return;
            };
            let started = self.stopwatch();
            self.cache_model_workers(model);
            let Some(mut judged) = self.judge(model, pos, &prefill) else {
                // Every worker refuses every job of the model: the queue holds.
                return;
            };
            self.consider_least_harm(model, &mut judged);
            let tenant = |e: &Engine, pos| {
                let front = e.queues.get(model, pos).expect("position exists");
                tenant_of(&front.job).to_string()
            };
            let Some(winner) = judged.evaluation.winner.clone() else {
                self.metrics.held(model, &judged.evaluation.rejected);
                if self.s.policy != PolicyKind::Metronome {
                    return;
                }
                // Its tenant's jobs wait; the others' are offered what is free. The
                // fair order picked this tenant, but it cannot use the room there is, and
                // holding every tenant behind it left a lighter tenant's jobs waiting
                // seconds behind a flood's job that fitted nowhere (the fairness lab, on
                // GPUs of speeds 1, 0.7, 0.7, 0.5). With one tenant this ends the pass.
                held_back.push(tenant(self, judged.pos));
                continue;
            };
            let profile = self.protected_profile(model, &judged);
            // An idle GPU is never kept idle for someone else: on a GPU that takes one job
            // at a time, the room kept would be all of it.
            if judged.least_harm_note.is_none()
                && !reserve::bound_for_an_idle_worker(&judged.evaluation)
                && self.room_kept_for_lighter_tenant(
                    model,
                    judged.pos,
                    &judged.request,
                    (&winner, judged.evaluation.winner_stall_ms, profile),
                    self.now_ms,
                )
            {
                self.metrics.held_for(model, HELD_FOR_LIGHTER_TENANT);
                held_back.push(tenant(self, judged.pos));
                continue;
            }
            self.reserve_and_assign(model, judged, winner, profile, started);
        }
    }
}
