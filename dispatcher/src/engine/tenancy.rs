//! Tenancy: fair sharing of a model among the tenants that submit to it. The fair order
//! itself is the queue's ([`crate::queue`], virtual token counters); here is what
//! placement asks of it: how many jobs each active tenant runs, whether a tenant runs under
//! its fair share, the floor waiver for a tenant under its share, the room kept for a
//! lighter tenant, and the charge and settlement of each job's tokens.

use std::collections::BTreeMap;

use metronome_protocol::CompletionEvent;
use metronome_protocol::CompletionOutcome;
use metronome_scheduler::policy::choose;
use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::Forecast;
use metronome_scheduler::JobProfile;
use metronome_scheduler::JobRequest;
use metronome_scheduler::Ledger;
use metronome_scheduler::Tokens;
use metronome_scheduler::WorkerLoad;
use metronome_scheduler::WorkerView;

use crate::engine::Engine;
use crate::queue::tenant_of;
use crate::queue::Pos;
use crate::queue::QueuedJob;

/// The ledger a lighter tenant's job is judged on ([`Engine::floor_waiver`]), and what the
/// decision says of it.
pub(super) struct FloorWaiver {
    pub(super) ledger: Ledger,
    pub(super) note: String,
}

/// How a model's running jobs are shared among its active tenants, for a tenant under
/// its share ([`Engine::runs_under_fair_share`]).
pub(super) struct FairShare<'a> {
    /// The tenant's running jobs.
    pub(super) mine: usize,
    /// The active tenants' running jobs.
    pub(super) total: usize,
    /// An equal share of `total` among the active tenants.
    pub(super) share: f64,
    /// Running jobs per active tenant.
    pub(super) running: BTreeMap<&'a str, usize>,
}

/// The TTFT of a `prompt_tokens` prompt on a typical worker of the model with nothing else
/// to do, by the workers' fitted models (the lower median over `forecasts`); `None` when
/// there is no worker or nothing is known. What a light tenant gets alone is near it, for
/// its jobs spread over the model's workers. Bounded by the fastest worker's instead (at
/// a ratio of 1.25), a cluster with one fast GPU kept that GPU nearly empty for it (the
/// flood lost 24 % of its tokens in the policy lab's fairness drill on GPUs of speed 1,
/// 0.7, 0.7 and 0.5).
pub(super) fn typical_idle_ttft_ms(forecasts: &[Forecast], prompt_tokens: u32) -> Option<f64> {
    let p = f64::from(prompt_tokens);
    let mut idle: Vec<f64> = forecasts
        .iter()
        .map(|f| f.coefficients.ttft_base_ms + f.coefficients.prefill_per_token_ms * p)
        .collect();
    idle.sort_by(f64::total_cmp);
    idle.get(idle.len().saturating_sub(1) / 2)
        .copied()
        .filter(|&ms| ms > 0.0)
}

impl Engine {
    /// Forget the arrivals older than `[fairness] light_tenant_window_ms`: a tenant is
    /// active (its lighter jobs kept room for) only while it submits.
    pub(super) fn forget_old_arrivals(&mut self, now: u64) {
        let window = self.s.fairness.light_tenant_window_ms;
        if window > 0 {
            self.queues
                .forget_arrivals_before(now.saturating_sub(window));
        }
    }

    /// The model's running jobs (placed in this term or adopted) per tenant that submitted
    /// to it within `[fairness] light_tenant_window_ms`; `None` with fewer than two such
    /// tenants (or the window off), so single-tenant admission is untouched.
    pub(super) fn running_by_active_tenant(
        &self,
        model: &str,
        now: u64,
    ) -> Option<BTreeMap<&str, usize>> {
        let window = self.s.fairness.light_tenant_window_ms;
        if window == 0 {
            return None;
        }
        let active = self
            .queues
            .active_tenants(model, now.saturating_sub(window));
        if active.len() < 2 {
            return None;
        }
        let mut running: BTreeMap<&str, usize> = active.into_iter().map(|t| (t, 0)).collect();
        for (_, tenant) in self.running_jobs_of(model) {
            if let Some(n) = running.get_mut(tenant) {
                *n += 1;
            }
        }
        Some(running)
    }

    /// The model's running jobs with their tenants: (job id, tenant).
    pub(super) fn running_jobs_of<'a>(
        &'a self,
        model: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a str)> {
        let placed = self
            .assigned
            .values()
            .filter(move |a| a.job.model == model)
            .map(|a| (a.job.id.as_str(), tenant_of(&a.job)));
        // The jobs this leader holds but did not place: adopted from an earlier leader's
        // term, counted while the ledger still books them on the worker that lists them.
        let adopted = self
            .listed_tenants
            .iter()
            .filter(move |(worker_id, _)| {
                self.index
                    .get(*worker_id)
                    .is_some_and(|&i| self.workers[i].status.model == model)
            })
            .flat_map(move |(worker_id, jobs)| {
                jobs.iter()
                    .filter(move |(job_id, _)| {
                        !self.assigned.contains_key(*job_id)
                            && self.ledger.worker_of(job_id) == Some(worker_id.as_str())
                    })
                    .map(|(job_id, tenant)| (job_id.as_str(), tenant.as_str()))
            });
        placed.chain(adopted)
    }

    /// When `tenant` runs fewer of the model's jobs than an equal share among the active
    /// tenants ([`Engine::running_by_active_tenant`]), and is not the tenant with the
    /// longest backlog: how the running jobs are shared.
    pub(super) fn runs_under_fair_share(
        &self,
        model: &str,
        tenant: &str,
        now: u64,
    ) -> Option<FairShare<'_>> {
        let vtc = self.queues.fairness(model)?;
        if vtc.waiting_jobs(tenant) >= vtc.most_waiting() {
            return None;
        }
        let running = self.running_by_active_tenant(model, now)?;
        let mine = *running.get(tenant)?;
        let total: usize = running.values().sum();
        let share = total as f64 / running.len() as f64;
        ((mine as f64) < share).then_some(FairShare {
            mine,
            total,
            share,
            running,
        })
    }

    /// The ledger a job of `tenant` is judged on when `tenant` runs under its fair share
    /// of the model ([`Engine::runs_under_fair_share`]): the floors of the running jobs of
    /// every tenant above its share are waived. `None` when `tenant` is not under its
    /// share or no tenant is above.
    ///
    /// Admission and least harm protect every running job's floor, so under a flood they
    /// protect the flood's excess jobs against the lighter tenant's next one: its long
    /// prompt, whose prefill would stall them, waited for the flood's jobs to end, seconds
    /// past its TTFT budget (the fairness lab, B's slowest jobs). A tenant running more
    /// than its share holds room that is the others' by right; its jobs still run, at
    /// the rate the lighter tenant's prefill leaves them.
    pub(super) fn floor_waiver(&self, model: &str, tenant: &str, now: u64) -> Option<FloorWaiver> {
        let FairShare {
            total,
            share,
            running,
            ..
        } = self.runs_under_fair_share(model, tenant, now)?;
        let over: BTreeMap<&str, usize> = running
            .into_iter()
            .filter(|&(_, n)| n as f64 > share)
            .collect();
        if over.is_empty() {
            return None;
        }
        let mut ledger = self.ledger.clone();
        for (job_id, owner) in self.running_jobs_of(model) {
            if over.contains_key(owner) {
                ledger.waive_floor(job_id);
            }
        }
        let names: Vec<String> = over.iter().map(|(t, n)| format!("{t} runs {n}")).collect();
        Some(FloorWaiver {
            ledger,
            note: format!(
                "judged without protecting the floors of the jobs of tenants above their fair share ({share:.1} of the model's {total} running jobs): {}",
                names.join(", ")
            ),
        })
    }

    /// The active tenants that run fewer of the model's jobs than `tenant`.
    pub(super) fn tenants_running_fewer(&self, model: &str, tenant: &str, now: u64) -> Vec<&str> {
        let Some(running) = self.running_by_active_tenant(model, now) else {
            return Vec::new();
        };
        let mine = running.get(tenant).copied().unwrap_or(0);
        running
            .into_iter()
            .filter(|&(t, n)| t != tenant && n < mine)
            .map(|(t, _)| t)
            .collect()
    }

    /// Whether the job at `pos`, about to go to `winner`, must wait instead so that the
    /// model keeps room for a lighter tenant. Three kinds of room, each kept only while a
    /// lighter tenant has submitted within `[fairness] light_tenant_window_ms`:
    ///
    /// - *A place in a batch*: when the job's tenant has more jobs waiting than that
    ///   tenant, it waits if no worker of the model could admit one more job like it, with
    ///   a prompt as long as that tenant's longest recent one, once it is placed. Under a
    ///   flood, admission fills every GPU to the edge of the SLO, so room opens only as a
    ///   job ends, and the light tenant's job, though first in the fair order, waited for
    ///   it (its TTFT went from ~0.2 s alone to ~1.3 s in the fairness drill). Keeping one
    ///   job's room costs the flooder that one job.
    /// - *A short prefill queue*: when the job's tenant runs more of the model's jobs than
    ///   that tenant, it waits if, once it is placed, every worker of the model would have
    ///   more than `[fairness] light_tenant_prefill_ms` of prefill queued. A model server
    ///   prefills in arrival order, so a light tenant's job placed behind the flood's
    ///   prefills waits for them on the GPU, where fair order no longer applies; held here
    ///   instead, the flood's jobs queue in the dispatcher, behind the light tenant's. This
    ///   is what the onset of a flood needs: its first jobs fill the GPUs' prefill queues
    ///   up to the TTFT budget before any of them has to wait.
    /// - *A first token soon*: in the same case, it also waits if, once it is placed, no
    ///   worker would give that tenant's next job (as long as its longest recent prompt) a
    ///   first token within `[fairness] light_tenant_ttft_ratio` times its TTFT on a
    ///   typical idle worker. Admission fills every GPU's batch up to the SLO, and a
    ///   prompt prefilled beside a full batch waits for the batch's decodes in every
    ///   chunk: in the fairness drill the light tenant's slowest jobs waited for nothing
    ///   in the dispatcher and were placed where their predicted TTFT was 660–800 ms.
    ///
    /// A single tenant, or tenants equally backlogged and running equally many jobs, keep
    /// nothing back, and a job bound for an idle GPU is never held (the caller checks).
    pub(super) fn room_kept_for_lighter_tenant(
        &self,
        model: &str,
        pos: Pos,
        request: &JobRequest,
        (winner, stall_ms, profile): (&str, f64, JobProfile),
        now: u64,
    ) -> bool {
        let fairness = &self.s.fairness;
        let window = fairness.light_tenant_window_ms;
        if window == 0 || self.s.policy != PolicyKind::Metronome {
            return false;
        }
        let Some(front) = self.queues.get(model, pos) else {
            return false;
        };
        let tenant = tenant_of(&front.job).to_string();
        let job_id = front.job.id.clone();
        let lighter_prompt =
            self.queues
                .lighter_tenant_prompt(model, &tenant, now.saturating_sub(window));
        let backlogged = lighter_prompt.is_some();
        let prefill_cap_ms = fairness.light_tenant_prefill_ms as f64;
        let ttft_ratio = fairness.light_tenant_ttft_ratio;
        let running_fewer = if fairness.light_tenant_prefill_ms > 0 || ttft_ratio > 0.0 {
            self.tenants_running_fewer(model, &tenant, now)
        } else {
            Vec::new()
        };
        let keep_first_token_soon = !running_fewer.is_empty();
        if !backlogged && !keep_first_token_soon {
            return false;
        }
        // The model as it would be with the job placed; then one more like it, fresh.
        let mut after = self.ledger.clone();
        if after
            .reserve_profiled(winner, &job_id, request.kv_tokens(), profile, now)
            .is_err()
        {
            return false;
        }
        after.charge_stall(winner, &job_id, stall_ms, now);
        // One more job like it, fresh, with a prompt as long as the lighter tenant's
        // longest recent one: the room is for that tenant's next job.
        let mut like_it = request.clone().waited(0);
        like_it.prompt_tokens = like_it.prompt_tokens.max(lighter_prompt.unwrap_or(0));
        let workers: &[WorkerView] = match self.per_model.get(model) {
            Some(w) if !self.s.decision_list_wrong_model => w,
            _ => &self.workers,
        };
        let scheduler = &self.s.scheduler;
        if keep_first_token_soon {
            // The next job of the tenants running fewer, on each worker of the model as it
            // would be: as long as their longest recent prompt, for a prompt prefilled
            // beside a full batch waits for the batch's decodes in every chunk it takes.
            let mut theirs = request.clone().waited(0);
            theirs.prompt_tokens = running_fewer
                .iter()
                .filter_map(|t| self.queues.longest_recent_prompt(model, t))
                .max()
                .unwrap_or(request.prompt_tokens);
            let forecasts: Vec<Forecast> = workers
                .iter()
                .filter(|w| w.status.model == model && self.alive(w, now))
                .map(|w| {
                    let load = WorkerLoad::at(w, &after, scheduler, now);
                    Forecast::of(&theirs, w, &load, &after, scheduler)
                })
                .collect();
            let least =
                |of: fn(&Forecast) -> f64| forecasts.iter().map(of).fold(f64::INFINITY, f64::min);
            let queued_prefill_ms =
                |f: &Forecast| f.coefficients.prefill_per_token_ms * f.pending_prefill_tokens;
            if fairness.light_tenant_prefill_ms > 0 && least(queued_prefill_ms) > prefill_cap_ms {
                return true;
            }
            if ttft_ratio > 0.0 {
                let idle = typical_idle_ttft_ms(&forecasts, theirs.prompt_tokens);
                if idle.is_some_and(|idle| least(|f| f.ttft_ms) > ttft_ratio * idle) {
                    return true;
                }
            }
        }
        if !backlogged {
            return false;
        }
        let mut scratch = self.policy_state.clone();
        choose(
            self.s.policy,
            &mut scratch,
            &like_it,
            workers,
            &after,
            scheduler,
            now,
        )
        .winner
        .is_none()
    }

    /// Charge a job being assigned to its tenant: prompt plus predicted output tokens.
    pub(super) fn charge_fair(&mut self, job: &QueuedJob, request: &JobRequest, now: u64) {
        let estimate = Tokens {
            prompt: f64::from(request.prompt_tokens),
            output: request.predicted_output(),
        };
        self.queues.charge(job, estimate);
        self.metrics
            .tenant_assigned(tenant_of(&job.job), now.saturating_sub(job.enqueued_ms));
    }

    /// Replace a finished job's estimated charge by its measured tokens (none for a
    /// refusal: it ran nothing, and is charged again when assigned again).
    pub(super) fn settle_fair(&mut self, event: &CompletionEvent) {
        let actual = match event.outcome {
            CompletionOutcome::Refused => Tokens {
                prompt: 0.0,
                output: 0.0,
            },
            _ => Tokens {
                prompt: f64::from(event.prompt_tokens),
                output: f64::from(event.output_tokens),
            },
        };
        if let Some((_, tenant, _)) = self.queues.settle(&event.job_id, actual) {
            self.metrics.tenant_tokens(
                &tenant,
                u64::from(event.prompt_tokens) + u64::from(event.output_tokens),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::testing::{assigned, engine, heartbeat, job_of, step, T0};
    use crate::engine::Engine;

    /// One worker that takes two jobs at once; tenant `a` sends four (two run, two wait),
    /// then `b` one (it waits).
    fn a_floods_b_waits() -> Engine {
        let mut e = engine(|_| {});
        let worker = heartbeat("w", &[], 1, T0, |s| s.max_concurrency = 2);
        let mut inputs = vec![worker];
        inputs.extend((0..4).map(|i| job_of(Some("a"), &format!("a{i}"), 100, 10, T0 + i)));
        inputs.push(job_of(Some("b"), "b0", 100, 10, T0 + 10));
        let out = step(&mut e, inputs, T0 + 10);
        assert_eq!(assigned(&out).len(), 2);
        e
    }

    #[test]
    fn with_one_tenant_nobody_is_counted_and_nothing_is_shared() {
        let mut e = engine(|_| {});
        let inputs = vec![
            heartbeat("w", &[], 1, T0, |_| {}),
            job_of(Some("a"), "a0", 100, 10, T0),
        ];
        step(&mut e, inputs, T0);
        assert!(e.running_by_active_tenant("m", T0).is_none());
        assert!(e.runs_under_fair_share("m", "a", T0).is_none());
    }

    #[test]
    fn a_tenant_running_nothing_behind_a_flood_is_under_its_share() {
        let e = a_floods_b_waits();
        let now = T0 + 10;
        let running = e
            .running_by_active_tenant("m", now)
            .expect("two tenants active");
        assert_eq!(running.get("a"), Some(&2));
        assert_eq!(running.get("b"), Some(&0));
        let share = e
            .runs_under_fair_share("m", "b", now)
            .expect("b is under its share");
        assert_eq!((share.mine, share.total), (0, 2));
        assert_eq!(share.share, 1.0);
        // The flooding tenant is over its share, and the most backlogged.
        assert!(e.runs_under_fair_share("m", "a", now).is_none());
        assert_eq!(e.tenants_running_fewer("m", "a", now), ["b"]);
    }

    #[test]
    fn the_floor_waiver_lifts_the_floors_of_the_tenant_over_its_share_only() {
        let e = a_floods_b_waits();
        let now = T0 + 10;
        let waiver = e.floor_waiver("m", "b", now).expect("a is over its share");
        assert!(waiver.note.contains("a runs 2"), "{}", waiver.note);
        assert!(e.floor_waiver("m", "a", now).is_none());
    }
}
