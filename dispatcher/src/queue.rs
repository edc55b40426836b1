//! Admission queues: one bounded queue per model, holding jobs that are read but not yet
//! assigned (their JOBS messages stay unacknowledged meanwhile).
//!
//! Within a model, jobs wait in *flows*, one per (tenant, priority class), each ordered by
//! JOBS stream sequence. Fairness chooses the flow, then the TTFT rule applies inside it:
//! [`Queues::next_to_try`] offers each flow's candidate (its oldest job that can still meet
//! its TTFT target, or its head when all of them are "late") to [`Vtc::pick`], which takes
//! the higher priority class (with the starvation guard), then the tenant with the lowest
//! fair-share counter, then a fresh candidate before a late one, then the earliest. The
//! engine charges the job to its tenant when it assigns it and settles the charge on
//! completion (see `metronome_scheduler::fairness` for the algorithm, Sheng et al.'s
//! Virtual Token Counter). Freshness does not come first: a tenant flooding with fresh
//! jobs would then starve one whose jobs had waited past their target, and a share that
//! holds only while one's jobs are young is no share.
//!
//! Invariants: each flow is ordered by sequence, so a job that comes back (failed publish,
//! refusal, rescue) goes back to its place, ahead of its tenant's later jobs; the bound
//! applies only to new arrivals (a returning job is never dropped), and a tenant holding
//! less than its share of the bound is still admitted past it, up to twice the bound, so
//! one tenant filling the queue cannot lock the others out; head-of-line blocking exists
//! only inside one tenant's jobs of one model, because each model is dispatched
//! independently and a tenant whose job cannot be placed is passed over for the rest of
//! the pass (the engine's `dispatch_model`).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use metronome_protocol::queues::{refuses_arrival, FlowCount, QueueSnapshot, MAX_FLOWS};
use metronome_protocol::{Job, Priority};
use metronome_scheduler::fairness::{Candidate, Vtc};
use metronome_scheduler::{Fairness, FairnessConfig, FairnessSnapshot, RecentArrivals, Tokens};

/// A job waiting for a worker.
pub struct QueuedJob {
    pub job: Arc<Job>,
    /// Dispatch attempt it will be assigned as (from 1).
    pub attempt: u32,
    /// The JOBS message, acknowledged once the job is assigned or rejected. `None` for a
    /// job whose JOBS message was already acknowledged (a retry after a refusal or rescue).
    pub acker: Option<Arc<Acker>>,
    /// JOBS stream sequence: the order key.
    pub seq: u64,
    /// When this dispatcher read it (Unix ms).
    pub enqueued_ms: u64,
    /// Absolute start deadline (Unix ms).
    pub deadline_ms: u64,
    /// Last time the JOBS message's ack wait was extended (Unix ms).
    pub progress_ms: u64,
}

/// The fair-share tenant of a job: jobs submitted without one share the empty name.
pub fn tenant_of(job: &Job) -> &str {
    job.tenant.as_deref().unwrap_or("")
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRefusal {
    Full { bound: usize },
}

/// Where a job waits in its model's queue. Valid until the queue next changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    flow: usize,
    idx: usize,
}

/// The jobs of one tenant in one class.
struct Flow {
    tenant: String,
    priority: Priority,
    jobs: VecDeque<QueuedJob>,
}

#[derive(Default)]
struct ModelQueue {
    flows: Vec<Flow>,
    len: usize,
    /// Each tenant's recent arrivals here (its last [`RECENT_PROMPTS`] prompt lengths),
    /// kept for [`Queues::lighter_tenant_prompt`], pruned by
    /// [`Queues::forget_arrivals_before`], and carried to the next leader as they are.
    arrivals: BTreeMap<String, RecentArrivals>,
}

/// How many of a tenant's latest prompts size the room kept for it (see
/// [`Queues::lighter_tenant_prompt`]).
pub const RECENT_PROMPTS: usize = 8;

impl ModelQueue {
    fn flow_mut(&mut self, tenant: &str, priority: Priority) -> &mut Flow {
        let i = match self
            .flows
            .iter()
            .position(|f| f.tenant == tenant && f.priority == priority)
        {
            Some(i) => i,
            None => {
                self.flows.push(Flow {
                    tenant: tenant.to_string(),
                    priority,
                    jobs: VecDeque::new(),
                });
                self.flows.len() - 1
            }
        };
        &mut self.flows[i]
    }

    fn held_by(&self, tenant: &str) -> usize {
        self.flows
            .iter()
            .filter(|f| f.tenant == tenant)
            .map(|f| f.jobs.len())
            .sum()
    }

    fn tenants(&self) -> HashSet<&str> {
        self.flows.iter().map(|f| f.tenant.as_str()).collect()
    }

    fn insert(&mut self, job: QueuedJob) {
        let tenant = tenant_of(&job.job);
        let arrivals = self.arrivals.entry(tenant.to_string()).or_default();
        arrivals.last_ms = arrivals.last_ms.max(job.enqueued_ms);
        if arrivals.prompts.len() == RECENT_PROMPTS {
            arrivals.prompts.remove(0);
        }
        arrivals.prompts.push(job.job.prompt_tokens);
        let flow = self.flow_mut(tenant, job.job.priority());
        insert_by_seq(&mut flow.jobs, job);
        self.len += 1;
    }

    fn remove_at(&mut self, pos: Pos) -> Option<QueuedJob> {
        let flow = self.flows.get_mut(pos.flow)?;
        let job = flow.jobs.remove(pos.idx)?;
        if flow.jobs.is_empty() {
            self.flows.swap_remove(pos.flow);
        }
        self.len -= 1;
        Some(job)
    }

    fn jobs(&self) -> impl Iterator<Item = &QueuedJob> {
        self.flows.iter().flat_map(|f| f.jobs.iter())
    }
}

/// All admission queues, and the fair-share counters that order them.
pub struct Queues {
    by_model: BTreeMap<String, ModelQueue>,
    bound: usize,
    total: usize,
    /// Ids of every waiting job, so redelivery and cancellation checks are O(1).
    ids: HashSet<String>,
    fairness: Fairness,
}

impl Queues {
    pub fn new(bound_per_model: usize) -> Queues {
        Queues::with_fairness(bound_per_model, FairnessConfig::default())
    }

    pub fn with_fairness(bound_per_model: usize, config: FairnessConfig) -> Queues {
        Queues {
            by_model: BTreeMap::new(),
            bound: bound_per_model,
            total: 0,
            ids: HashSet::new(),
            fairness: Fairness::new(config),
        }
    }

    /// Queue a new arrival, refusing it when its model's queue is at the bound (unless its
    /// tenant holds less than its share of the bound: see the module's invariants).
    pub fn push(&mut self, job: QueuedJob) -> Result<(), (QueuedJob, QueueRefusal)> {
        let bound = self.bound;
        let q = self.by_model.entry(job.job.model.clone()).or_default();
        if q.len >= bound {
            let tenant = tenant_of(&job.job);
            let tenants = q.tenants();
            let sharing = tenants.len() + usize::from(!tenants.contains(tenant));
            if refuses_arrival(q.len, bound, q.held_by(tenant), sharing) {
                return Err((job, QueueRefusal::Full { bound }));
            }
        }
        self.put_back(job);
        Ok(())
    }

    /// Put a job back at its place (by sequence), whatever the bound.
    pub fn put_back(&mut self, job: QueuedJob) {
        let model = job.job.model.clone();
        self.fairness.model_mut(&model).arrive(tenant_of(&job.job));
        self.ids.insert(job.job.id.clone());
        self.by_model.entry(model).or_default().insert(job);
        self.total += 1;
    }

    /// Where the job to try next waits in the model's queue. In each flow the candidate is
    /// the first job `late` says is not late, or else the flow's head; but a flow whose
    /// tenant has fewer jobs waiting than another tenant offers its head, late or not.
    /// Passing late jobs over is triage for a model short of capacity, and the tenant
    /// with the longest backlog is the one short of it; a lighter tenant's jobs are served
    /// in order, or its late job would wait behind every younger job of its own for as
    /// long as they keep coming (measured in the fairness drill: seconds, until the
    /// arrivals stopped). Among the candidates, [`Vtc::pick`] chooses. Flows of the tenants in `skip` are passed over
    /// (the engine holds one tenant's jobs back so a lighter tenant gets the room left;
    /// see `Engine::dispatch_model`). Stops at the first job of a flow that is not late,
    /// so long flows of fresh jobs cost one look each, not a scan.
    pub fn next_to_try(
        &self,
        model: &str,
        late: impl Fn(&QueuedJob) -> bool,
        skip: &[String],
    ) -> Option<Pos> {
        let q = self.by_model.get(model).filter(|q| q.len > 0)?;
        let empty = Vtc::default();
        let vtc = self.fairness.model(model).unwrap_or(&empty);
        let heaviest = vtc.most_waiting();
        let found: Vec<(Pos, Candidate<'_>)> = q
            .flows
            .iter()
            .enumerate()
            .filter(|(_, f)| !f.jobs.is_empty() && !skip.contains(&f.tenant))
            .map(|(flow, f)| {
                let (idx, fresh) = if vtc.waiting_jobs(&f.tenant) < heaviest {
                    (0, !late(&f.jobs[0]))
                } else {
                    let fresh = f.jobs.iter().position(|j| !late(j));
                    (fresh.unwrap_or(0), fresh.is_some())
                };
                let candidate = Candidate {
                    tenant: &f.tenant,
                    priority: f.priority,
                    fresh,
                    seq: f.jobs[idx].seq,
                };
                (Pos { flow, idx }, candidate)
            })
            .collect();
        let candidates: Vec<Candidate<'_>> = found.iter().map(|(_, c)| *c).collect();
        vtc.pick(&candidates, &self.fairness.config)
            .map(|i| found[i].0)
    }

    /// The order the model's waiting jobs would be served in if nothing else arrived and
    /// every job could be placed: [`Queues::next_to_try`]'s choice replayed on a copy of the
    /// fair-share state, each job charged `estimate` as it is taken, as the engine charges
    /// it. Freshness is left out: it only breaks ties, and who is late changes with the
    /// clock. This, not arrival order, is how far a job is from service: a light tenant's
    /// job that arrived behind a flood is served next, and must not be judged by the flood's
    /// length. Linear in waiting jobs times flows; nothing is changed.
    pub fn service_order(
        &self,
        model: &str,
        estimate: impl Fn(&QueuedJob) -> Tokens,
    ) -> Vec<&QueuedJob> {
        let Some(q) = self.by_model.get(model) else {
            return Vec::new();
        };
        let config = &self.fairness.config;
        let mut vtc = self.fairness.model(model).cloned().unwrap_or_default();
        let mut next = vec![0usize; q.flows.len()];
        let mut out = Vec::with_capacity(q.len);
        loop {
            let open: Vec<usize> = (0..q.flows.len())
                .filter(|&f| next[f] < q.flows[f].jobs.len())
                .collect();
            let candidates: Vec<Candidate<'_>> = open
                .iter()
                .map(|&f| Candidate {
                    tenant: &q.flows[f].tenant,
                    priority: q.flows[f].priority,
                    fresh: true,
                    seq: q.flows[f].jobs[next[f]].seq,
                })
                .collect();
            let Some(i) = vtc.pick(&candidates, config) else {
                break;
            };
            let flow = &q.flows[open[i]];
            let job = &flow.jobs[next[open[i]]];
            next[open[i]] += 1;
            vtc.charge(&flow.tenant, config.cost(estimate(job)));
            vtc.leave(&flow.tenant);
            let still_waiting = (0..q.flows.len())
                .filter(|&f| next[f] < q.flows[f].jobs.len())
                .map(|f| q.flows[f].priority);
            vtc.served(flow.priority, still_waiting.collect::<Vec<_>>());
            out.push(job);
        }
        out
    }

    /// Up to `n` positions after `pos` in its flow, in order: the younger jobs of the
    /// same tenant and class.
    pub fn following(&self, model: &str, pos: Pos, n: usize) -> Vec<Pos> {
        let Some(flow) = self.by_model.get(model).and_then(|q| q.flows.get(pos.flow)) else {
            return Vec::new();
        };
        (pos.idx + 1..flow.jobs.len())
            .take(n)
            .map(|idx| Pos {
                flow: pos.flow,
                idx,
            })
            .collect()
    }

    /// The job at `pos` in the model's queue.
    pub fn get(&self, model: &str, pos: Pos) -> Option<&QueuedJob> {
        self.by_model
            .get(model)?
            .flows
            .get(pos.flow)?
            .jobs
            .get(pos.idx)
    }

    /// Remove and return the job at `pos` to dispatch it: it stops waiting, and the
    /// starvation guard counts the classes it passed over.
    pub fn take(&mut self, model: &str, pos: Pos) -> Option<QueuedJob> {
        let q = self.by_model.get_mut(model)?;
        let job = q.remove_at(pos)?;
        let still_waiting: Vec<Priority> = q.flows.iter().map(|f| f.priority).collect();
        let vtc = self.fairness.model_mut(model);
        vtc.served(job.job.priority(), still_waiting);
        self.left(&job);
        Some(job)
    }

    fn left(&mut self, job: &QueuedJob) {
        self.total -= 1;
        self.ids.remove(&job.job.id);
        self.fairness
            .model_mut(&job.job.model)
            .leave(tenant_of(&job.job));
    }

    /// Charge a job being assigned its estimated tokens; returns its tenant's counter.
    pub fn charge(&mut self, job: &QueuedJob, estimate: Tokens) -> f64 {
        self.fairness
            .charge(&job.job.id, &job.job.model, tenant_of(&job.job), estimate)
    }

    /// Settle a job's charge with its measured tokens (see [`Fairness::settle`]).
    pub fn settle(&mut self, job_id: &str, actual: Tokens) -> Option<(String, String, f64)> {
        self.fairness.settle(job_id, actual)
    }

    /// The tenant's fair-share counter on `model`.
    pub fn counter(&self, model: &str, tenant: &str) -> f64 {
        self.fairness.counter(model, tenant)
    }

    /// Whether, besides `tenant`, a tenant with fewer jobs waiting for `model` (counting
    /// the job of `tenant` about to leave: `tenant` has `waiting - 1` after it) had a job
    /// queued since `since_ms`: a lighter tenant still active, for which a backlogged
    /// tenant should leave room.
    pub fn lighter_tenant_active(&self, model: &str, tenant: &str, since_ms: u64) -> bool {
        self.lighter_tenant_prompt(model, tenant, since_ms)
            .is_some()
    }

    /// The longest of the recent prompts (the last [`RECENT_PROMPTS`] of each) of the
    /// lighter tenants [`Queues::lighter_tenant_active`] counts, or `None` when there is
    /// none. The room a backlogged tenant leaves must fit the lighter tenant's next job,
    /// not one of its own: kept for a job like the flood's, it let a light tenant's longer
    /// prompt find no worker that would admit it (in the fairness drill, its jobs then
    /// waited for a running job to end, up to a second).
    pub fn lighter_tenant_prompt(&self, model: &str, tenant: &str, since_ms: u64) -> Option<u32> {
        let (Some(q), Some(vtc)) = (self.by_model.get(model), self.fairness.model(model)) else {
            return None;
        };
        let after = vtc.waiting_jobs(tenant).saturating_sub(1);
        q.arrivals
            .iter()
            .filter(|(t, a)| *t != tenant && a.last_ms >= since_ms && vtc.waiting_jobs(t) < after)
            .map(|(_, a)| a.prompts.iter().copied().max().unwrap_or(0))
            .max()
    }

    /// The longest of `tenant`'s recent prompts (its last [`RECENT_PROMPTS`]) to `model`, or
    /// `None` when it has no recent arrival there.
    pub fn longest_recent_prompt(&self, model: &str, tenant: &str) -> Option<u32> {
        self.by_model
            .get(model)?
            .arrivals
            .get(tenant)?
            .prompts
            .iter()
            .copied()
            .max()
    }

    /// Tenants that submitted to the model at or after `since_ms`.
    pub fn active_tenants(&self, model: &str, since_ms: u64) -> Vec<&str> {
        self.by_model.get(model).map_or_else(Vec::new, |q| {
            q.arrivals
                .iter()
                .filter(|(_, a)| a.last_ms >= since_ms)
                .map(|(t, _)| t.as_str())
                .collect()
        })
    }

    /// Forget tenants' arrivals older than `before_ms` (they no longer count as active).
    pub fn forget_arrivals_before(&mut self, before_ms: u64) {
        for q in self.by_model.values_mut() {
            q.arrivals.retain(|_, a| a.last_ms >= before_ms);
        }
        self.by_model
            .retain(|_, q| q.len > 0 || !q.arrivals.is_empty());
    }

    /// The fair-share state of one model, for inspection.
    pub fn fairness(&self, model: &str) -> Option<&Vtc> {
        self.fairness.model(model)
    }

    /// The counters to persist, with each model's tenants' recent arrivals.
    pub fn fairness_snapshot(&self) -> FairnessSnapshot {
        let mut snapshot = self.fairness.snapshot();
        snapshot.arrivals = self
            .by_model
            .iter()
            .filter(|(_, q)| !q.arrivals.is_empty())
            .map(|(model, q)| (model.clone(), q.arrivals.clone()))
            .collect();
        snapshot
    }

    /// Take over counters and recent arrivals persisted by an earlier leader. An arrival
    /// known here already stays when it is later; prompts are taken only for a tenant
    /// with none here (never more than [`RECENT_PROMPTS`]).
    pub fn restore_fairness(&mut self, saved: &FairnessSnapshot) {
        self.fairness.restore(saved);
        for (model, tenants) in &saved.arrivals {
            let q = self.by_model.entry(model.clone()).or_default();
            for (tenant, recent) in tenants {
                let a = q.arrivals.entry(tenant.clone()).or_default();
                a.last_ms = a.last_ms.max(recent.last_ms);
                if a.prompts.is_empty() {
                    let skip = recent.prompts.len().saturating_sub(RECENT_PROMPTS);
                    a.prompts.extend(recent.prompts.iter().skip(skip).copied());
                }
            }
        }
    }

    /// Every job waiting for `model`, in no particular order.
    pub fn waiting<'a>(&'a self, model: &str) -> impl Iterator<Item = &'a QueuedJob> + 'a {
        self.by_model.get(model).into_iter().flat_map(|q| q.jobs())
    }

    pub fn len(&self, model: &str) -> usize {
        self.by_model.get(model).map_or(0, |q| q.len)
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Models with at least one waiting job, in name order.
    pub fn models(&self) -> Vec<String> {
        self.by_model
            .iter()
            .filter(|(_, q)| q.len > 0)
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// Remove a job by id (cancellation); linear in its queue, cancellations are rare.
    pub fn remove(&mut self, job_id: &str) -> Option<QueuedJob> {
        if !self.ids.contains(job_id) {
            return None;
        }
        let found = self.by_model.values_mut().find_map(|q| {
            let pos = q.flows.iter().enumerate().find_map(|(flow, f)| {
                f.jobs
                    .iter()
                    .position(|j| j.job.id == job_id)
                    .map(|idx| Pos { flow, idx })
            })?;
            q.remove_at(pos)
        })?;
        self.left(&found);
        Some(found)
    }

    /// The tenant ([`tenant_of`]) of the waiting job with this id: a cancel must name it.
    /// Linear in the queues, like [`Queues::remove`].
    pub fn tenant_of_waiting(&self, job_id: &str) -> Option<&str> {
        if !self.ids.contains(job_id) {
            return None;
        }
        self.by_model.values().find_map(|q| {
            q.flows
                .iter()
                .flat_map(|f| f.jobs.iter())
                .find(|j| j.job.id == job_id)
                .map(|j| tenant_of(&j.job))
        })
    }

    /// True when a job with this id is waiting.
    pub fn contains(&self, job_id: &str) -> bool {
        self.ids.contains(job_id)
    }

    /// Remove and return every job whose deadline is before `now_ms`.
    pub fn take_expired(&mut self, now_ms: u64) -> Vec<QueuedJob> {
        let mut out = Vec::new();
        for q in self.by_model.values_mut() {
            if q.jobs().all(|j| j.deadline_ms >= now_ms) {
                continue;
            }
            for f in &mut q.flows {
                let (keep, gone): (VecDeque<_>, VecDeque<_>) =
                    f.jobs.drain(..).partition(|j| j.deadline_ms >= now_ms);
                f.jobs = keep;
                q.len -= gone.len();
                out.extend(gone);
            }
            q.flows.retain(|f| !f.jobs.is_empty());
        }
        for j in &out {
            self.left(j);
        }
        out
    }

    /// Jobs whose ack wait should be extended (last extension before `older_than_ms`);
    /// marks them as extended at `now_ms`.
    pub fn due_for_progress(&mut self, older_than_ms: u64, now_ms: u64) -> Vec<Arc<Acker>> {
        let mut out = Vec::new();
        for q in self.by_model.values_mut() {
            for f in &mut q.flows {
                for j in f.jobs.iter_mut() {
                    if j.progress_ms < older_than_ms {
                        if let Some(a) = &j.acker {
                            out.push(a.clone());
                        }
                        j.progress_ms = now_ms;
                    }
                }
            }
        }
        out
    }

    /// What waits for `model` at `now_ms`, as the `queues` bucket publishes it (epoch and
    /// dispatcher id left for the caller). Linear in the model's waiting jobs: taken at a
    /// bounded rate, never per arrival.
    pub fn snapshot(&self, model: &str, now_ms: u64) -> QueueSnapshot {
        let mut by_priority: BTreeMap<Priority, u32> = BTreeMap::new();
        let mut flows: Vec<FlowCount> = Vec::new();
        let mut oldest: Option<u64> = None;
        let mut waiting = 0u32;
        for f in self.by_model.get(model).into_iter().flat_map(|q| &q.flows) {
            let n = u32::try_from(f.jobs.len()).unwrap_or(u32::MAX);
            if n == 0 {
                continue;
            }
            waiting = waiting.saturating_add(n);
            *by_priority.entry(f.priority).or_default() += n;
            flows.push(FlowCount {
                tenant: f.tenant.clone(),
                priority: f.priority,
                waiting: n,
            });
            // A returning job keeps its place but not its read time: look at every job.
            let first = f.jobs.iter().map(|j| j.enqueued_ms).min();
            oldest = match (oldest, first) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        flows.sort_by(|a, b| {
            b.waiting
                .cmp(&a.waiting)
                .then_with(|| a.priority.cmp(&b.priority))
                .then_with(|| a.tenant.cmp(&b.tenant))
        });
        let not_listed = flows.len().saturating_sub(MAX_FLOWS);
        flows.truncate(MAX_FLOWS);
        QueueSnapshot {
            v: metronome_protocol::PROTOCOL_VERSION,
            model: model.to_string(),
            waiting,
            oldest_enqueued_ms: oldest,
            oldest_wait_ms: 0,
            by_priority,
            flows,
            flows_not_listed: u32::try_from(not_listed).unwrap_or(u32::MAX),
            bound: Some(u32::try_from(self.bound).unwrap_or(u32::MAX)),
            epoch: 0,
            dispatcher_id: String::new(),
            written_ms: 0,
        }
        .stamped(now_ms)
    }

    /// Models that ever had a job in this term, emptied queues included.
    pub fn known_models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(String::as_str)
    }

    /// Depth per model, for the metrics, written into `out` in place: a model already there
    /// is updated without copying its name, so the engine can refresh its gauge after every
    /// step.
    pub fn write_depths(&self, out: &mut BTreeMap<String, usize>) {
        out.retain(|m, _| self.by_model.contains_key(m));
        for (m, q) in &self.by_model {
            match out.get_mut(m) {
                Some(n) => *n = q.len,
                None => {
                    out.insert(m.clone(), q.len);
                }
            }
        }
    }
}

fn insert_by_seq(q: &mut VecDeque<QueuedJob>, job: QueuedJob) {
    if q.back().is_none_or(|b| b.seq <= job.seq) {
        q.push_back(job);
    } else {
        let pos = q.partition_point(|j| j.seq <= job.seq);
        q.insert(pos, job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn job(id: &str, model: &str, seq: u64) -> QueuedJob {
        job_for(id, model, seq, None, None)
    }

    fn job_for(
        id: &str,
        model: &str,
        seq: u64,
        tenant: Option<&str>,
        priority: Option<Priority>,
    ) -> QueuedJob {
        QueuedJob {
            job: Arc::new(Job {
                v: 1,
                id: id.into(),
                model: model.into(),
                endpoint: metronome_protocol::Endpoint::Chat,
                request: json!({}),
                prompt_tokens: 1,
                max_tokens: 1,
                submitted_ms: 0,
                deadline_ms: None,
                slo: None,
                tenant: tenant.map(str::to_string),
                priority,
                prefix: None,
                traceparent: None,
            }),
            attempt: 1,
            acker: None,
            seq,
            enqueued_ms: 0,
            deadline_ms: seq * 10,
            progress_ms: 0,
        }
    }

    const EST: Tokens = Tokens {
        prompt: 100.0,
        output: 100.0,
    };

    /// Dispatch every job in the order the queue offers them, charging each, and return
    /// their ids.
    fn drain(q: &mut Queues, model: &str, late: impl Fn(&QueuedJob) -> bool) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(pos) = q.next_to_try(model, &late, &[]) {
            let j = q.take(model, pos).unwrap();
            q.charge(&j, EST);
            out.push(j.job.id.clone());
        }
        out
    }

    #[test]
    fn fifo_per_model_with_a_bound_for_new_arrivals_only() {
        let mut q = Queues::new(2);
        q.push(job("a", "m1", 1)).ok().unwrap();
        q.push(job("b", "m1", 2)).ok().unwrap();
        assert!(q.push(job("c", "m1", 3)).is_err());
        q.push(job("x", "m2", 4)).ok().unwrap();
        let pos = q.next_to_try("m1", |_| false, &[]).unwrap();
        let a = q.take("m1", pos).unwrap();
        assert_eq!(a.job.id, "a");
        q.push(job("c", "m1", 3)).ok().unwrap();
        // A returning job goes back to its place even past the bound.
        q.put_back(a);
        assert_eq!(q.len("m1"), 3);
        assert_eq!(drain(&mut q, "m1", |_| false), ["a", "b", "c"]);
        assert_eq!(q.total(), 1);
    }

    #[test]
    fn a_tenant_under_its_share_is_admitted_past_a_full_bound() {
        let mut q = Queues::new(4);
        for i in 0..4 {
            q.push(job_for(&format!("a{i}"), "m", i, Some("a"), None))
                .ok()
                .unwrap();
        }
        assert!(q.push(job_for("a4", "m", 4, Some("a"), None)).is_err());
        // b holds nothing of the full queue: its share is half the bound.
        q.push(job_for("b0", "m", 5, Some("b"), None)).ok().unwrap();
        q.push(job_for("b1", "m", 6, Some("b"), None)).ok().unwrap();
        assert!(q.push(job_for("b2", "m", 7, Some("b"), None)).is_err());
        assert_eq!(q.len("m"), 6);
    }

    #[test]
    fn tries_the_first_fresh_job_else_the_head() {
        let mut q = Queues::new(10);
        for (i, id) in ["late-a", "late-b", "fresh-c", "fresh-d"]
            .iter()
            .enumerate()
        {
            q.push(job(id, "m", i as u64 + 1)).ok().unwrap();
        }
        let late = |j: &QueuedJob| j.job.id.starts_with("late");
        let pos = q.next_to_try("m", late, &[]).unwrap();
        assert_eq!(q.get("m", pos).unwrap().job.id, "fresh-c");
        let head = q.next_to_try("m", |_| true, &[]).unwrap();
        assert_eq!(q.get("m", head).unwrap().job.id, "late-a");
        assert_eq!(q.take("m", pos).unwrap().job.id, "fresh-c");
        assert_eq!(q.total(), 3);
        assert!(!q.contains("fresh-c"));
        assert_eq!(q.next_to_try("other", late, &[]), None);
        assert_eq!(drain(&mut q, "m", late), ["fresh-d", "late-a", "late-b"]);
    }

    #[test]
    fn a_lighter_tenant_is_served_in_order_while_the_heaviest_passes_late_jobs_over() {
        let mut q = Queues::new(100);
        for (i, id) in ["a-late", "a-fresh", "a-fresh2"].iter().enumerate() {
            q.push(job_for(id, "m", i as u64, Some("a"), None))
                .ok()
                .unwrap();
        }
        for (i, id) in ["b-late", "b-fresh"].iter().enumerate() {
            q.push(job_for(id, "m", 10 + i as u64, Some("b"), None))
                .ok()
                .unwrap();
        }
        let late = |j: &QueuedJob| j.job.id.ends_with("late");
        // b (2 waiting) is lighter than a (3): its late head goes first, then in order;
        // a, the heaviest, passes its late job over while it has fresh ones.
        let only = |q: &Queues, tenant: &str| {
            let other = if tenant == "a" { "b" } else { "a" };
            let pos = q.next_to_try("m", late, &[other.to_string()]).unwrap();
            q.get("m", pos).unwrap().job.id.clone()
        };
        assert_eq!(only(&q, "b"), "b-late");
        assert_eq!(only(&q, "a"), "a-fresh");
        // Alone (one tenant), the late-job triage applies as before.
        let mut q = Queues::new(100);
        for (i, id) in ["late", "fresh"].iter().enumerate() {
            q.push(job(id, "m", i as u64)).ok().unwrap();
        }
        assert_eq!(drain(&mut q, "m", late), ["fresh", "late"]);
    }

    #[test]
    fn a_lighter_tenant_counts_while_it_submitted_recently_and_waits_less() {
        let mut q = Queues::new(100);
        let at = |id: &str, seq, tenant, ms| {
            let mut j = job_for(id, "m", seq, Some(tenant), None);
            j.enqueued_ms = ms;
            j
        };
        for i in 0..3 {
            q.push(at(&format!("a{i}"), i, "a", 1_000)).ok().unwrap();
        }
        // Alone, a keeps nothing back for anyone.
        assert!(!q.lighter_tenant_active("m", "a", 0));
        q.push(at("b0", 10, "b", 5_000)).ok().unwrap();
        // b holds 1, a would hold 2 after its job leaves: b is lighter, and recent.
        assert!(q.lighter_tenant_active("m", "a", 4_000));
        // b's arrival is older than the window: not active any more.
        assert!(!q.lighter_tenant_active("m", "a", 6_000));
        // From b's side a is not lighter.
        assert!(!q.lighter_tenant_active("m", "b", 0));
        // b's job is served; b still counts while its last arrival is within the window.
        let pos = q.next_to_try("m", |j| j.job.id != "b0", &[]);
        let b0 = q.take("m", pos.unwrap()).unwrap();
        assert_eq!(b0.job.id, "b0");
        assert!(q.lighter_tenant_active("m", "a", 4_000));
        // Holding a's jobs back, the queue offers only the others'.
        q.push(at("b1", 11, "b", 5_000)).ok().unwrap();
        let pos = q.next_to_try("m", |_| false, &["a".to_string()]).unwrap();
        assert_eq!(q.get("m", pos).unwrap().job.id, "b1");
        q.take("m", pos);
        assert_eq!(q.next_to_try("m", |_| false, &["a".to_string()]), None);
        // Forgotten arrivals no longer count; the queue itself is untouched.
        q.forget_arrivals_before(6_000);
        assert!(!q.lighter_tenant_active("m", "a", 0));
        assert_eq!(q.len("m"), 3);
        // Equal backlogs keep nothing back either.
        let mut q = Queues::new(100);
        for (i, t) in ["a", "b", "a", "b"].iter().enumerate() {
            q.push(at(&format!("{t}{i}"), i as u64, t, 1_000))
                .ok()
                .unwrap();
        }
        assert!(!q.lighter_tenant_active("m", "a", 0));
        assert!(!q.lighter_tenant_active("other", "a", 0));
    }

    #[test]
    fn the_room_kept_for_a_lighter_tenant_fits_its_longest_recent_prompt() {
        let mut q = Queues::new(100);
        let at = |id: &str, seq, tenant, prompt: u32| {
            let mut j = job_for(id, "m", seq, Some(tenant), None);
            Arc::make_mut(&mut j.job).prompt_tokens = prompt;
            j.enqueued_ms = 1_000 + seq;
            j
        };
        for i in 0..5 {
            q.push(at(&format!("a{i}"), i, "a", 100)).ok().unwrap();
        }
        assert_eq!(q.lighter_tenant_prompt("m", "a", 0), None, "alone");
        // b's prompts, served as they come: 3,000 tokens first, then eight short ones.
        let prompts = [3_000, 200, 900, 300, 400, 500, 600, 700, 800];
        for (i, &p) in prompts.iter().enumerate() {
            let seq = 10 + i as u64;
            q.push(at(&format!("b{i}"), seq, "b", p)).ok().unwrap();
            // While b's longest recent prompt is in its last eight, it sizes the room.
            let longest = prompts[i.saturating_sub(RECENT_PROMPTS - 1)..=i]
                .iter()
                .copied()
                .max();
            assert_eq!(q.lighter_tenant_prompt("m", "a", 0), longest, "after b{i}");
            let pos = q.next_to_try("m", |_| false, &["a".to_string()]).unwrap();
            assert_eq!(q.take("m", pos).unwrap().job.id, format!("b{i}"));
        }
        assert_eq!(q.lighter_tenant_prompt("m", "a", 0), Some(900));
        // From b's side nobody is lighter; an old arrival no longer counts.
        assert_eq!(q.lighter_tenant_prompt("m", "b", 0), None);
        assert_eq!(q.lighter_tenant_prompt("m", "a", 2_000), None);
        // Forgotten with its arrival: b's next job starts a new record.
        q.forget_arrivals_before(1_019);
        q.push(at("b9", 30, "b", 50)).ok().unwrap();
        assert_eq!(q.lighter_tenant_prompt("m", "a", 0), Some(50));
    }

    #[test]
    fn recent_arrivals_survive_a_failover_with_the_counters() {
        let at = |id: &str, seq, tenant, prompt: u32, ms| {
            let mut j = job_for(id, "m", seq, Some(tenant), None);
            Arc::make_mut(&mut j.job).prompt_tokens = prompt;
            j.enqueued_ms = ms;
            j
        };
        let mut old = Queues::new(100);
        for (i, p) in [700, 2_000, 300].into_iter().enumerate() {
            old.push(at(&format!("b{i}"), i as u64, "b", p, 1_000 + i as u64))
                .ok()
                .unwrap();
            let pos = old.next_to_try("m", |_| false, &[]).unwrap();
            old.take("m", pos);
        }
        let saved: FairnessSnapshot =
            serde_json::from_str(&serde_json::to_string(&old.fairness_snapshot()).unwrap())
                .unwrap();
        // The new leader has read only the flood's backlog: b is lighter and recent, and
        // the room kept for it fits its longest recent prompt.
        let mut new = Queues::new(100);
        for i in 0..3 {
            new.push(at(&format!("a{i}"), 10 + i, "a", 100, 1_500))
                .ok()
                .unwrap();
        }
        assert_eq!(
            new.lighter_tenant_prompt("m", "a", 1_000),
            None,
            "b unknown"
        );
        new.restore_fairness(&saved);
        assert_eq!(new.lighter_tenant_prompt("m", "a", 1_000), Some(2_000));
        assert_eq!(new.active_tenants("m", 1_000), ["a", "b"]);
        // Older than the window, the saved arrivals count for nothing.
        let mut late = Queues::new(100);
        late.restore_fairness(&saved);
        late.forget_arrivals_before(1_100);
        assert!(late.active_tenants("m", 0).is_empty());
        // A later arrival known here is kept; the saved one does not move it back.
        new.push(at("b3", 20, "b", 50, 1_600)).ok().unwrap();
        new.restore_fairness(&saved);
        assert_eq!(new.active_tenants("m", 1_550), ["b"]);
        // A snapshot written before arrivals were saved still loads.
        let bare: FairnessSnapshot = serde_json::from_str(r#"{"v":1,"models":{}}"#).unwrap();
        assert!(bare.arrivals.is_empty());
    }

    #[test]
    fn a_flooding_tenant_waits_behind_a_light_one() {
        let mut q = Queues::new(100);
        // a floods first: ten jobs before b's two.
        for i in 0..10 {
            q.push(job_for(&format!("a{i}"), "m", i, Some("a"), None))
                .ok()
                .unwrap();
        }
        q.push(job_for("b0", "m", 20, Some("b"), None))
            .ok()
            .unwrap();
        q.push(job_for("b1", "m", 21, Some("b"), None))
            .ok()
            .unwrap();
        let order = drain(&mut q, "m", |_| false);
        // b was lifted to a's counter on arrival (0 then); on that tie the shorter backlog
        // goes first, then they alternate until b has nothing left; a gets the rest
        // (work-conserving).
        assert_eq!(&order[..4], ["b0", "a0", "b1", "a1"]);
        assert_eq!(order.len(), 12);
        assert_eq!(q.counter("m", "a"), 10.0 * 300.0);
        assert_eq!(q.counter("m", "b"), 2.0 * 300.0);
    }

    #[test]
    fn depths_are_written_in_place_and_follow_the_queue() {
        let mut q = Queues::new(10);
        let mut depths = BTreeMap::from([("gone".to_string(), 3)]);
        q.push(job("a", "m", 1)).ok().unwrap();
        q.push(job("b", "m", 2)).ok().unwrap();
        q.write_depths(&mut depths);
        assert_eq!(depths, BTreeMap::from([("m".to_string(), 2)]));
        q.take("m", q.next_to_try("m", |_| false, &[]).unwrap());
        q.write_depths(&mut depths);
        assert_eq!(depths, BTreeMap::from([("m".to_string(), 1)]));
    }

    #[test]
    fn the_service_order_is_the_order_the_queue_would_dispatch_in() {
        let mut q = Queues::with_fairness(
            1000,
            FairnessConfig {
                aging_dispatches: 2,
                ..FairnessConfig::default()
            },
        );
        // A flood, then a light tenant's jobs behind it, and some batch work.
        for i in 0..50 {
            q.push(job_for(&format!("a{i}"), "m", i, Some("a"), None))
                .ok()
                .unwrap();
        }
        for i in 0..3 {
            q.push(job_for(&format!("b{i}"), "m", 100 + i, Some("b"), None))
                .ok()
                .unwrap();
            q.push(job_for(
                &format!("z{i}"),
                "m",
                200 + i,
                Some("z"),
                Some(Priority::Batch),
            ))
            .ok()
            .unwrap();
        }
        let order: Vec<String> = q
            .service_order("m", |_| EST)
            .iter()
            .map(|j| j.job.id.clone())
            .collect();
        assert_eq!(order.len(), q.total(), "every waiting job, once");
        // b, behind 50 of a's jobs in arrival order, is served first (lifted to a's
        // counter, with the shorter backlog), and all of b within the first rounds.
        assert_eq!(order[0], "b0", "{order:?}");
        assert!(
            order.iter().position(|id| id == "b2").unwrap() < 9,
            "{order:?}"
        );
        // Replaying changed nothing, and the queue really dispatches in that order.
        assert_eq!(q.counter("m", "a"), 0.0);
        assert_eq!(drain(&mut q, "m", |_| false), order);
    }

    #[test]
    fn a_returning_job_keeps_its_place_within_its_tenant() {
        let mut q = Queues::new(100);
        for i in 0..3 {
            q.push(job_for(&format!("a{i}"), "m", i, Some("a"), None))
                .ok()
                .unwrap();
        }
        let pos = q.next_to_try("m", |_| false, &[]).unwrap();
        let a0 = q.take("m", pos).unwrap();
        q.charge(&a0, EST);
        // Refused by its worker: back at its place, and its charge is refunded.
        q.settle(
            "a0",
            Tokens {
                prompt: 0.0,
                output: 0.0,
            },
        );
        q.put_back(a0);
        assert_eq!(q.counter("m", "a"), 0.0);
        assert_eq!(drain(&mut q, "m", |_| false), ["a0", "a1", "a2"]);
    }

    #[test]
    fn interactive_first_with_batch_served_by_the_aging_guard() {
        let mut q = Queues::with_fairness(
            100,
            FairnessConfig {
                aging_dispatches: 2,
                ..FairnessConfig::default()
            },
        );
        for i in 0..3 {
            q.push(job_for(
                &format!("bat{i}"),
                "m",
                i,
                Some("t"),
                Some(Priority::Batch),
            ))
            .ok()
            .unwrap();
        }
        for i in 0..6 {
            q.push(job_for(&format!("int{i}"), "m", 10 + i, Some("t"), None))
                .ok()
                .unwrap();
        }
        assert_eq!(
            drain(&mut q, "m", |_| false),
            ["int0", "int1", "bat0", "int2", "int3", "bat1", "int4", "int5", "bat2"]
        );
    }

    #[test]
    fn a_snapshot_counts_classes_and_tenants_and_finds_the_oldest_job() {
        let mut q = Queues::new(10);
        let mut a = job_for("a", "m", 2, Some("acme"), None);
        a.enqueued_ms = 1_000;
        let mut b = job_for("b", "m", 3, Some("acme"), None);
        b.enqueued_ms = 1_200;
        // Back at its place (lowest sequence) with a later read time.
        let mut r = job_for("r", "m", 1, Some("beta"), Some(Priority::Batch));
        r.enqueued_ms = 1_500;
        for j in [a, b, r] {
            q.push(j).ok().unwrap();
        }
        let s = q.snapshot("m", 2_000);
        assert_eq!(s.waiting, 3);
        assert_eq!(s.oldest_enqueued_ms, Some(1_000));
        assert_eq!(s.oldest_wait_ms, 1_000);
        assert_eq!(s.by_priority[&Priority::Interactive], 2);
        assert_eq!(s.by_priority[&Priority::Batch], 1);
        assert_eq!(s.flows[0].tenant, "acme");
        assert_eq!(s.flows[0].waiting, 2);
        assert_eq!(s.bound, Some(10));
        assert_eq!(s.validate(), Ok(()));
        // Emptied, the model is still known and reads as an empty queue.
        drain(&mut q, "m", |_| false);
        let empty = q.snapshot("m", 3_000);
        assert_eq!((empty.waiting, empty.oldest_enqueued_ms), (0, None));
        assert_eq!(q.known_models().collect::<Vec<_>>(), ["m"]);
        assert_eq!(q.snapshot("never", 3_000).waiting, 0);
    }

    #[test]
    fn the_snapshot_refuses_what_the_queue_refuses() {
        let mut q = Queues::new(4);
        for i in 0..4 {
            q.push(job_for(&format!("a{i}"), "m", i, Some("acme"), None))
                .ok()
                .unwrap();
        }
        let s = q.snapshot("m", 1_000);
        for (tenant, id) in [(Some("acme"), "a9"), (Some("beta"), "b1"), (None, "n1")] {
            let told = s.refuses(tenant.unwrap_or(""));
            let refused = q.push(job_for(id, "m", 9, tenant, None)).is_err();
            assert_eq!(told, Some(refused), "{tenant:?}");
            if !refused {
                q.remove(id);
            }
        }
        assert_eq!(s.refuses("acme"), Some(true));
        assert_eq!(s.refuses("beta"), Some(false));
    }

    #[test]
    fn removes_cancelled_and_expired_jobs_and_they_stop_waiting() {
        let mut q = Queues::new(10);
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            q.push(job_for(id, "m", i as u64 + 1, Some(id), None))
                .ok()
                .unwrap();
        }
        assert_eq!(q.remove("b").unwrap().job.id, "b");
        assert!(q.remove("b").is_none());
        let expired = q.take_expired(15);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].job.id, "a");
        assert_eq!(q.total(), 1);
        let vtc = q.fairness("m").unwrap();
        assert!(!vtc.is_waiting("a") && !vtc.is_waiting("b") && vtc.is_waiting("c"));
        assert_eq!(drain(&mut q, "m", |_| false), ["c"]);
        assert!(q.is_empty());
    }
}
