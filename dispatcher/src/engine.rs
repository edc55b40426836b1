//! The engine: the dispatcher's state machine. It owns the admission queues, the
//! reservation ledger and the registry snapshot, and turns inputs into decisions.
//!
//! Everything that changes scheduling state arrives as an [`Event`] (new job, worker
//! update, EWMA refresh, completion, cancellation, publish rollback) or as the periodic
//! [`Engine::tick`], each with the time it is applied at: the engine reads no clock and
//! does no I/O. What it decides comes back as [`Effect`]s (publish an outcome, acknowledge
//! a message), which the deciding loop ([`crate::deciding`]) performs; a test or the policy
//! lab drives the same engine in simulated time. Because one owner reads the state, picks
//! a worker and commits the reservation before it looks at the next job, N simultaneous
//! jobs on N idle workers land on N distinct workers: no job ever decides on a view that
//! misses an earlier pick. Publishing happens after the commit, pipelined
//! ([`crate::publish`]).
//!
//! Invariants:
//! - No decision is made while the lease is not fresh (self-fencing, [`crate::leader`]).
//! - A job is in at most one of: a queue, the ledger (assigned or adopted).
//! - A model's queue is dispatched strictly in order within each tenant: if the job the
//!   fair order picks cannot be placed, its tenant's later jobs wait, and the other
//!   tenants' jobs are offered the room (head-of-line blocking within one tenant of one
//!   model only); other models are dispatched independently.
//! - Jobs waiting are re-evaluated after every capacity change (completion, heartbeat,
//!   worker change, rollback) and on every tick.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::message::Acker;
use metronome_protocol::{
    Assignment, CompletionEvent, CompletionOutcome, Decision, ErrorCode, Job, Outcome,
    QueueSnapshot, WorkerStatus,
};
use metronome_scheduler::filter::{self, fits_when_empty};
use metronome_scheduler::policy::{choose, PolicyKind, PolicyState};
use metronome_scheduler::{least_harm, least_harm_within};
use metronome_scheduler::{
    DrainRate, EwmaSnapshot, FairnessConfig, FairnessSnapshot, Forecast, IdleTtft, JobProfile,
    JobRequest, Ledger, OutputLength, SchedulerConfig, Tokens, WorkerLoad, WorkerView,
};

pub use crate::event::{Event, Incoming};
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::metrics::HELD_FOR_LIGHTER_TENANT;
use crate::publish;
use crate::queue::{tenant_of, Pos, QueuedJob, Queues};
use crate::recent::RecentIds;
use crate::refusals::Refusals;
use crate::registry::{RedisSnapshot, WorkerUpdate};

/// What the engine asks of the outside world; the deciding loop ([`crate::deciding`])
/// performs them in order.
pub enum Effect {
    /// Publish an outcome ([`crate::publish`]).
    Publish(publish::Outcome),
    /// Acknowledge a message.
    Ack(Arc<Acker>),
    /// Extend the ack wait of waiting jobs' JOBS messages (`+WPI`).
    Progress(Vec<Arc<Acker>>),
}

/// Settings of one leadership term.
#[derive(Clone)]
pub struct EngineSettings {
    pub epoch: u64,
    pub dispatcher_id: String,
    pub policy: PolicyKind,
    pub policy_seed: u64,
    pub scheduler: SchedulerConfig,
    pub queue_bound_per_model: usize,
    pub max_attempts: u32,
    pub default_deadline_ms: u64,
    pub max_deadline_ms: u64,
    pub adopt_kv_tokens: u64,
    pub ack_wait_ms: u64,
    pub tick: Duration,
    pub decision_max_candidates: usize,
    pub decision_list_wrong_model: bool,
    /// A worker dead this long (no heartbeat) leaves the registry, and so the decisions.
    pub forget_dead_after_ms: u64,
    pub fairness: FairnessConfig,
}

impl EngineSettings {
    /// The settings of a term led at `epoch` under configuration `c`.
    pub fn from_config(c: &crate::Config, epoch: u64, dispatcher_id: String) -> EngineSettings {
        EngineSettings {
            epoch,
            dispatcher_id,
            policy: c.policy,
            policy_seed: c.policy_seed,
            scheduler: c.scheduler.clone(),
            queue_bound_per_model: c.queue_bound_per_model,
            max_attempts: c.max_attempts,
            default_deadline_ms: c.default_deadline_ms,
            max_deadline_ms: c.max_deadline_ms,
            adopt_kv_tokens: c.adopt_kv_tokens,
            ack_wait_ms: c.ack_wait_ms,
            tick: Duration::from_millis(c.tick_ms),
            decision_max_candidates: c.decision_max_candidates,
            decision_list_wrong_model: c.decision_list_wrong_model,
            // Long enough for the worker to come back from a restart as the same entry,
            // short enough that decisions stop listing a dead worker within a minute by
            // default.
            forget_dead_after_ms: c.scheduler.heartbeat_timeout_ms.saturating_mul(5),
            fairness: c.fairness,
        }
    }
}

/// How long a completion is remembered: heartbeats come every second, and one sent before
/// the completion may still list the job.
const FINISHED_WINDOW_MS: u64 = 60_000;
/// At most this many remembered completions (a minute at well over 20,000 jobs/s).
const FINISHED_MAX: usize = 2_000_000;
/// At most this many remembered cancellations: their ids are client-chosen.
const CANCELLED_MAX: usize = 100_000;
/// How long a refusal of a job this leader never held waits for the job's retry to come
/// back through JOBS (a takeover redelivers pending jobs at once) before its client is told.
const ORPHAN_REFUSAL_GRACE_MS: u64 = 5_000;

/// The key of a cancel of `job_id` naming `tenant` in [`Engine::cancelled`]: its subject.
fn cancel_key(tenant: Option<&str>, job_id: &str) -> String {
    metronome_protocol::names::cancel_subject(tenant, job_id)
}

/// A job this leader assigned and has not seen finish.
struct AssignedJob {
    job: Arc<Job>,
    attempt: u32,
    seq: u64,
    deadline_ms: u64,
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
        }
    }
}

/// The ledger a lighter tenant's job is judged on ([`Engine::floor_waiver`]), and what the
/// decision says of it.
struct FloorWaiver {
    ledger: Ledger,
    note: String,
}

/// How a model's running jobs are shared among its active tenants, for a tenant under
/// its share ([`Engine::runs_under_fair_share`]).
struct FairShare<'a> {
    /// The tenant's running jobs.
    mine: usize,
    /// The active tenants' running jobs.
    total: usize,
    /// An equal share of `total` among the active tenants.
    share: f64,
    /// Running jobs per active tenant.
    running: BTreeMap<&'a str, usize>,
}

/// A conditional delete of an overdue worker's key in flight.
struct Expiring {
    since_ms: u64,
    why: String,
}

/// The state owned by the deciding loop.
pub struct Engine {
    s: EngineSettings,
    queues: Queues,
    ledger: Ledger,
    workers: Vec<WorkerView>,
    index: HashMap<String, usize>,
    /// Workers of each model, when decisions leave other models' workers out: the scoring
    /// core then only looks at the model's own workers. Cleared on every worker change.
    per_model: HashMap<String, Vec<WorkerView>>,
    dead: HashSet<String>,
    /// Revision in the `workers` bucket of each worker's latest heartbeat.
    revisions: HashMap<String, u64>,
    /// Workers whose heartbeats are overdue and whose key the leader is deleting on the
    /// condition that no later heartbeat was stored ([`publish::Outcome::ExpireWorker`]).
    /// The worker is declared dead only when the watch shows the delete: a worker that
    /// stored a heartbeat meanwhile (it was only slow, or stopped and resumed) stays, and
    /// its agent, whose next conditional put fails after such a delete, knows that
    /// everything it held was given away.
    expiring: HashMap<String, Expiring>,
    /// Jobs whose completion event arrived: a heartbeat sent before the event may still
    /// list them, and must neither re-adopt them nor count them as running.
    finished: RecentIds,
    /// Cancellations this leader could not apply at once: the job was still in the intake
    /// (or not submitted yet), or assigned but not yet reported by its worker. Kept for one
    /// JOBS ack wait, the longest a job can take to reach the engine. Keyed by
    /// [`cancel_key`] (tenant and job): a cancel applies only to a job of the tenant it
    /// names, so one naming another tenant's job never matches it (nor displaces a real
    /// cancel of that job).
    cancelled: RecentIds,
    /// Cancellations already relayed to the worker that reported the job (by
    /// [`cancel_key`]): not relayed again.
    relayed: RecentIds,
    /// Refusals of jobs whose body this leader does not hold, oldest first, with when:
    /// settled on the tick after [`ORPHAN_REFUSAL_GRACE_MS`].
    orphan_refusals: VecDeque<(String, String, u64)>,
    /// The jobs each dead worker held when it was declared dead, settled then (retried from
    /// the body this leader holds, or answered `worker_lost`): its purge's Assignments of
    /// them are not rescued a second time.
    settled_at_death: HashMap<String, HashSet<String>>,
    /// Workers that refused each job retried here: left out of its next placements while
    /// another worker can take it ([`Refusals`]).
    refusals: Refusals,
    ewmas: HashMap<String, EwmaSnapshot>,
    /// Each model's output-length EWMA (from Redis): the prior of its output model.
    output_len: HashMap<String, f64>,
    /// Each model's output length given `max_tokens`, fitted from this term's completions
    /// ([`OutputLength`]).
    output_models: HashMap<String, OutputLength>,
    assigned: HashMap<String, AssignedJob>,
    /// Per worker, the tenant of each job its latest heartbeat lists, as the job's decision
    /// on record names it ([`WorkerUpdate::Put`]'s `tenants`). Jobs an earlier leader
    /// placed are not in `assigned`; without their tenants a new leader would count every
    /// tenant's running jobs from zero, and for the first seconds of its term could not
    /// tell a flooding tenant from a light one.
    listed_tenants: HashMap<String, HashMap<String, String>>,
    /// How fast each model's queue drains while jobs wait: the predicted wait behind an
    /// unmeetable deadline's early answer.
    drain: HashMap<String, DrainRate>,
    policy_state: PolicyState,
    metrics: Arc<Metrics>,
    /// The lease's freshness: no decision once it is stale. `None` runs unfenced (engine
    /// tests, the policy lab), where no lease exists.
    fence: Option<Arc<Fence>>,
    capacity_changed: bool,
    /// The time of the input being applied (Unix ms): the engine reads no clock.
    now_ms: u64,
    /// What the applied inputs asked the outside world to do, in order.
    effects: Vec<Effect>,
    /// Where changed fair-share counters go to be persisted ([`crate::fairness_store`]).
    fairness_out: Option<tokio::sync::watch::Sender<FairnessSnapshot>>,
    /// Where the queue snapshots go to be published ([`crate::queue_store`]), how often at
    /// most, and when they were last taken.
    queues_out: Option<(tokio::sync::watch::Sender<Vec<QueueSnapshot>>, u64)>,
    queues_taken_ms: u64,
    /// Until when a new term decides nothing while it reads the jobs an earlier leader
    /// left waiting (`None`: reading done, or never asked).
    backlog_hold_until_ms: Option<u64>,
}

impl Engine {
    pub fn new(s: EngineSettings, metrics: Arc<Metrics>, fence: Option<Arc<Fence>>) -> Engine {
        Engine {
            queues: Queues::with_fairness(s.queue_bound_per_model, s.fairness),
            ledger: Ledger::new(),
            workers: Vec::new(),
            index: HashMap::new(),
            per_model: HashMap::new(),
            dead: HashSet::new(),
            revisions: HashMap::new(),
            expiring: HashMap::new(),
            finished: RecentIds::new(FINISHED_WINDOW_MS, FINISHED_MAX),
            cancelled: RecentIds::new(s.ack_wait_ms, CANCELLED_MAX),
            relayed: RecentIds::new(s.ack_wait_ms, CANCELLED_MAX),
            orphan_refusals: VecDeque::new(),
            settled_at_death: HashMap::new(),
            refusals: Refusals::default(),
            ewmas: HashMap::new(),
            output_len: HashMap::new(),
            output_models: HashMap::new(),
            assigned: HashMap::new(),
            listed_tenants: HashMap::new(),
            drain: HashMap::new(),
            policy_state: PolicyState::new(s.policy_seed),
            metrics,
            fence,
            capacity_changed: false,
            now_ms: 0,
            effects: Vec::new(),
            fairness_out: None,
            queues_out: None,
            queues_taken_ms: 0,
            backlog_hold_until_ms: None,
            s,
        }
    }

    /// Decide nothing until [`Event::BacklogRead`] says every job stored before this term
    /// has been read, or until `until_ms`. A leader taking over reads the JOBS backlog in
    /// stream order, and the flooding tenant's oldest jobs come first: placing as soon as
    /// the first ones arrive gave the free room to them before the fair queue had even
    /// seen the other tenants' waiting jobs (in the fairness drill, the lighter tenant's
    /// TTFT p99 after a takeover was 7.9 times its alone figure, the first 23 placements
    /// all the flood's). Reading the backlog takes milliseconds to a few hundred; the
    /// bound keeps a slow read from holding the term.
    pub fn read_backlog_first(&mut self, until_ms: u64) {
        self.backlog_hold_until_ms = Some(until_ms);
    }

    /// Whether placements wait for the backlog (see [`Engine::read_backlog_first`]).
    fn reading_backlog(&self) -> bool {
        self.backlog_hold_until_ms.is_some()
    }

    fn end_backlog_hold(&mut self, read: bool) {
        if self.backlog_hold_until_ms.take().is_some() {
            if read {
                tracing::info!(queued = self.queues.total(), "backlog read: deciding");
            } else {
                tracing::warn!(
                    queued = self.queues.total(),
                    "the backlog was not read in time: deciding without the rest of it"
                );
            }
            self.capacity_changed = true;
        }
    }

    /// The effects of the inputs applied since the last call, in the order they arose:
    /// publish each outcome, acknowledge each message.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// The reservations, read-only (what tests and the policy lab inspect).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// True while the lease allows deciding (always, unfenced).
    pub fn is_fresh(&self) -> bool {
        self.fence.as_ref().is_none_or(|f| f.is_fresh())
    }

    /// Look at the waiting jobs again when something changed what workers can take, and
    /// bring the queue-depth gauge up to date. Called after every batch of inputs.
    pub fn dispatch_if_changed(&mut self, now_ms: u64) {
        self.advance(now_ms);
        if self
            .backlog_hold_until_ms
            .is_some_and(|until| self.now_ms >= until)
        {
            self.end_backlog_hold(false);
        }
        if self.capacity_changed {
            self.capacity_changed = false;
            self.dispatch_all();
        }
        // The depth gauge follows the queue, not the tick: whoever compares it with a
        // GPU's idleness must not count a job that already left the queue as waiting.
        self.publish_depths();
    }

    /// The term ends: hand over the last fair-share counters.
    pub fn finish(&mut self) {
        self.persist_fairness();
        self.metrics.ledger_reservations.store(0, Relaxed);
    }

    /// Time only moves forward, even if the caller's clock steps back.
    fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    fn emit(&mut self, outcome: publish::Outcome) {
        self.effects.push(Effect::Publish(outcome));
    }

    /// Acknowledge a message (an EVENTS message once handled).
    fn ack(&mut self, acker: Option<Arc<Acker>>) {
        if let Some(acker) = acker {
            self.effects.push(Effect::Ack(acker));
        }
    }

    /// Apply one event at `now_ms`. Its effects wait in [`Engine::take_effects`];
    /// waiting jobs are looked at again by [`Engine::dispatch_if_changed`], so a burst of
    /// events is applied before the queues are re-evaluated once.
    pub fn handle(&mut self, event: Event, now_ms: u64) {
        self.advance(now_ms);
        match event {
            Event::Job(incoming) => self.on_job(*incoming),
            Event::Worker(update) => self.on_worker(update),
            Event::Redis(snapshot) => self.on_redis(snapshot),
            Event::Completion { event, acker } => self.on_completion(*event, acker),
            Event::RequeueFailed { job } => {
                self.queues.put_back(*job);
                self.capacity_changed = true;
            }
            Event::Cancel { tenant, job_id } => self.on_cancel(tenant.as_deref(), &job_id),
            Event::BacklogRead => self.end_backlog_hold(true),
            Event::PublishFailed { job, worker_id } => {
                if self.ledger.worker_of(&job.job.id) == Some(worker_id.as_str()) {
                    self.ledger.release(&job.job.id);
                }
                self.assigned.remove(job.job.id.as_str());
                self.publish_failed(*job, &worker_id);
            }
            Event::PurgedAssignments {
                worker_id,
                assignments,
            } => self.rescue_purged(&worker_id, assignments),
            Event::AlreadyAssigned { job_id, worker_id } => {
                // The earlier leader's Assignment of this attempt stands, on a worker we do
                // not know yet (its heartbeat will report it). The body stays in
                // `assigned`: if that worker refuses the job, it is retried from here.
                if self.ledger.worker_of(&job_id) == Some(worker_id.as_str()) {
                    self.ledger.release(&job_id);
                }
                self.capacity_changed = true;
            }
        }
    }

    /// Expected output tokens of `job`: its model's output model when it has seen a
    /// completion, else the model's output-length EWMA, else `max_tokens` (nothing known,
    /// so the worst case).
    fn predicted_output(&self, job: &Job) -> f64 {
        match self.output_models.get(&job.model) {
            Some(m) if m.samples() > 0 => m.predict(job.max_tokens),
            _ => self
                .output_len
                .get(&job.model)
                .copied()
                .filter(|p| p.is_finite())
                .map_or(f64::from(job.max_tokens), |p| {
                    p.clamp(0.0, f64::from(job.max_tokens))
                }),
        }
    }

    /// Fit the model's output length from a completed job this leader assigned (its
    /// `max_tokens` is in the body it holds).
    fn learn_output_length(&mut self, event: &CompletionEvent) {
        let Some(a) = self.assigned.get(&event.job_id) else {
            return;
        };
        let (model, max_tokens) = (a.job.model.clone(), a.job.max_tokens);
        let prior = self.output_len.get(&model).copied().unwrap_or(f64::NAN);
        self.output_models
            .entry(model)
            .or_insert_with(|| OutputLength::new(prior))
            .observe(max_tokens, event.output_tokens);
    }

    fn alive(&self, view: &WorkerView, now_ms: u64) -> bool {
        now_ms.saturating_sub(view.last_seen_ms) <= self.s.scheduler.heartbeat_timeout_ms
            && !self.dead.contains(&view.status.worker_id)
    }

    /// Whether a worker could take work now: alive, healthy, not draining.
    fn takes_work(&self, view: &WorkerView, now_ms: u64) -> bool {
        self.alive(view, now_ms) && view.status.healthy && !view.status.draining
    }

    fn on_job(&mut self, inc: Incoming) {
        let now = self.now_ms;
        let job_id = inc.job.id.clone();
        if let Some(worker) = self.ledger.worker_of(&job_id) {
            // Redelivered after a leader change, but a worker already holds it (adopted
            // from its heartbeat, or assigned earlier in this term): settle it without a
            // second assignment. The decision's msg-id drops it if one already exists.
            let worker = worker.to_string();
            tracing::info!(job_id = %job_id, worker_id = %worker, "redelivered job is already held by a worker");
            let attempt = self
                .assigned
                .get(&job_id)
                .map_or(inc.attempt, |a| a.attempt);
            let mut decision = self.decision(&inc.job, Outcome::Assigned, attempt, 0, 0, now);
            decision.worker_id = Some(worker.clone());
            decision.reason =
                Some("already held by the worker (adopted from its heartbeat)".into());
            decision.reason_code = Some("already_assigned".into());
            self.emit(publish::Outcome::DecisionOnly {
                decision: Box::new(decision),
                acker: inc.acker,
            });
            return;
        }
        if self.queues.contains(&job_id) {
            // A redelivery of a job already waiting here: the queued copy stands.
            return;
        }
        if self
            .cancelled
            .remove(&cancel_key(inc.job.tenant.as_deref(), &job_id))
        {
            // Its cancel overtook it (the cancel is a core message, the job waits in JOBS).
            tracing::info!(job_id = %job_id, "cancelled before it reached the queue");
            self.reject(
                &inc.job,
                inc.attempt,
                Outcome::Rejected,
                "cancelled",
                "cancelled by its client before it was queued",
                ErrorCode::Cancelled,
                inc.acker,
                now.saturating_sub(inc.received_ms),
            );
            return;
        }
        let served = self
            .workers
            .iter()
            .any(|w| w.status.model == inc.job.model && self.alive(w, now));
        if !served {
            let reason = format!("no worker serves model {:?}", inc.job.model);
            self.reject(
                &inc.job,
                inc.attempt,
                Outcome::Rejected,
                "unknown_model",
                &reason,
                ErrorCode::UnknownModel,
                inc.acker,
                now.saturating_sub(inc.received_ms),
            );
            return;
        }
        if let Some(reason) = self.unplaceable(&inc.job, now) {
            self.reject(
                &inc.job,
                1,
                Outcome::Rejected,
                "unplaceable",
                &reason,
                ErrorCode::InvalidJob,
                inc.acker,
                now.saturating_sub(inc.received_ms),
            );
            return;
        }
        if let Some(deadline) = inc
            .job
            .deadline_ms
            .filter(|d| *d <= now && inc.attempt <= 1)
        {
            // Its start deadline passed before it arrived (a client's clock, a job held
            // back, or a hostile one): starting it now would break the contract the
            // deadline states, so it is answered like one that expired in the queue. A
            // retry keeps its chance: the leader gave it to a worker in time.
            let reason = format!(
                "the job's start deadline had passed {} ms before it reached the dispatcher",
                now - deadline
            );
            self.reject(
                &inc.job,
                inc.attempt,
                Outcome::Expired,
                "deadline_exceeded",
                &reason,
                ErrorCode::DeadlineExceeded,
                inc.acker,
                now.saturating_sub(inc.received_ms),
            );
            return;
        }
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
            self.refusals.record(&job_id, worker, *attempt);
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
                    Outcome::Rejected,
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
    fn unplaceable(&self, job: &Job, now: u64) -> Option<String> {
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
    fn answer_unmeetable(&mut self, model: &str, now: u64) {
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
                Outcome::Rejected,
                "deadline_unmeetable",
                &reason,
                ErrorCode::QueueFull,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
                Some(wait.ceil() as u64),
            );
        }
    }

    fn on_worker(&mut self, update: WorkerUpdate) {
        let now = self.now_ms;
        self.per_model.clear();
        match update {
            WorkerUpdate::Put {
                mut status,
                seen_ms,
                revision,
                unvouched,
                tenants,
            } => {
                let id = status.worker_id.clone();
                self.drop_unvouched(&mut status, &unvouched);
                if tenants.is_empty() {
                    self.listed_tenants.remove(&id);
                } else {
                    self.listed_tenants.insert(id.clone(), tenants);
                }
                self.revisions.insert(id.clone(), revision);
                if self.expiring.remove(&id).is_some() {
                    tracing::info!(worker_id = %id, revision, "a heartbeat was stored before the worker could be declared dead: it stays");
                }
                self.drop_finished(&mut status);
                let rec = self.ledger.reconcile(
                    &id,
                    &status.in_flight,
                    self.s.adopt_kv_tokens,
                    self.s.scheduler.reservation_ttl_ms,
                    now,
                );
                if !rec.adopted.is_empty() || !rec.expired.is_empty() {
                    tracing::info!(worker_id = %id, adopted = ?rec.adopted, expired = ?rec.expired, "reconciled reservations with heartbeat");
                }
                if !rec.conflicting.is_empty() {
                    tracing::warn!(worker_id = %id, jobs = ?rec.conflicting, "worker runs jobs booked on another worker");
                }
                self.relay_cancels(&status.in_flight, now);
                let ewma = self.ewmas.get(&id).copied();
                match self.index.get(&id) {
                    Some(&i) => {
                        let view = &mut self.workers[i];
                        view.status = *status;
                        view.last_seen_ms = seen_ms;
                        view.ewma = ewma;
                    }
                    None => {
                        tracing::info!(worker_id = %id, model = %status.model, "worker joined");
                        self.index.insert(id.clone(), self.workers.len());
                        self.workers.push(WorkerView {
                            status: *status,
                            last_seen_ms: seen_ms,
                            ewma,
                        });
                    }
                }
                if now.saturating_sub(seen_ms) <= self.s.scheduler.heartbeat_timeout_ms
                    && self.dead.remove(&id)
                {
                    tracing::info!(worker_id = %id, "worker is back");
                }
            }
            WorkerUpdate::Gone { worker_id } => match self.expiring.remove(&worker_id) {
                // This leader's own conditional delete: the worker is dead, and stays listed
                // (rejected as stale) until it is forgotten or registers again.
                Some(expiring) => {
                    self.revisions.remove(&worker_id);
                    self.worker_died(&worker_id, &expiring.why);
                }
                // The worker withdrew (or an operator removed it).
                None => {
                    self.worker_died(&worker_id, "its key left the workers bucket");
                    self.forget_worker(&worker_id);
                }
            },
        }
        self.metrics
            .workers_known
            .store(self.workers.len() as u64, Relaxed);
        self.capacity_changed = true;
    }

    /// Tell the clients of refused jobs that did not come back in time: nobody holds their
    /// body, so they cannot be assigned again.
    fn settle_orphan_refusals(&mut self, now: u64) {
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
            self.emit(publish::Outcome::FinalError {
                job_id,
                worker_id: Some(worker_id.clone()),
                error: ErrorCode::WorkerFailed,
                message: format!(
                    "worker {worker_id} refused the job and it could not be assigned again"
                ),
            });
        }
    }

    /// Remove a worker from the registry (it comes back as new with its next heartbeat).
    fn forget_worker(&mut self, worker_id: &str) {
        if let Some(i) = self.index.remove(worker_id) {
            self.workers.swap_remove(i);
            if i < self.workers.len() {
                let moved = self.workers[i].status.worker_id.clone();
                self.index.insert(moved, i);
            }
        }
        self.dead.remove(worker_id);
        self.revisions.remove(worker_id);
        self.expiring.remove(worker_id);
        self.listed_tenants.remove(worker_id);
        self.per_model.clear();
    }

    fn on_redis(&mut self, snapshot: RedisSnapshot) {
        self.per_model.clear();
        for view in &mut self.workers {
            view.ewma = snapshot.ewmas.get(&view.status.worker_id).copied();
        }
        self.ewmas = snapshot.ewmas;
        self.output_len = snapshot.output_len;
        self.capacity_changed = true;
    }

    /// Remove from a heartbeat the jobs it claims that no decision on record assigns to
    /// that worker (`registry::Vouching`), unless this leader booked them there itself: a
    /// worker that learned a job's id must not be able to claim it by listing it.
    fn drop_unvouched(&mut self, status: &mut WorkerStatus, unvouched: &[String]) {
        if unvouched.is_empty() {
            return;
        }
        let id = status.worker_id.as_str();
        let (kept, refused): (Vec<String>, Vec<String>) = std::mem::take(&mut status.in_flight)
            .into_iter()
            .partition(|job| !unvouched.contains(job) || self.ledger.worker_of(job) == Some(id));
        status.in_flight = kept;
        if !refused.is_empty() {
            self.metrics
                .unvouched_claims_total
                .fetch_add(refused.len() as u64, Relaxed);
            tracing::warn!(worker_id = %id, jobs = ?refused, "heartbeat lists jobs no decision assigns to this worker: not adopted");
            status.active = status.active.saturating_sub(refused.len() as u32);
        }
    }

    /// Remove from a heartbeat the jobs whose completion this leader has already seen: the
    /// heartbeat was sent before they finished. Without this a burst right after another
    /// sees busy workers that are idle, and re-adopts finished jobs as leaked reservations.
    fn drop_finished(&mut self, status: &mut WorkerStatus) {
        let before = status.in_flight.len();
        status.in_flight.retain(|id| !self.finished.contains(id));
        let gone = (before - status.in_flight.len()) as u32;
        status.active = status.active.saturating_sub(gone);
    }

    fn on_completion(&mut self, event: CompletionEvent, acker: Option<Arc<Acker>>) {
        // Acknowledged once handled, unless the job is retried: then once it is back in
        // JOBS (the publisher acknowledges it with the retry's PubAck).
        let mut acker = acker;
        self.completion(event, &mut acker);
        self.ack(acker);
    }

    fn completion(&mut self, mut event: CompletionEvent, acker: &mut Option<Arc<Acker>>) {
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
    fn retry(&mut self, a: AssignedJob, why: &str, mut event: Option<Arc<Acker>>) {
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
                Outcome::Rejected,
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
                Outcome::Rejected,
                "max_attempts",
                &reason,
                ErrorCode::WorkerFailed,
                None,
                0,
            );
            return;
        }
        let refused_by = self.refusals.of(&a.job.id);
        self.emit(publish::Outcome::Requeue {
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
    fn publish_failed(&mut self, mut job: QueuedJob, worker_id: &str) {
        if job.attempt >= self.s.max_attempts {
            let reason = format!(
                "gave up after {} attempts (last: publishing the assignment to {worker_id} failed)",
                job.attempt
            );
            let now = self.now_ms;
            self.reject(
                &job.job,
                job.attempt + 1,
                Outcome::Rejected,
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

    /// A client's `cancel.<tenant>.<job_id>`. Its permissions let it name only its own
    /// tenant, but any job id: a cancel of a job this leader holds for another tenant is
    /// ignored and counted, and a remembered one matches only a job of its tenant.
    fn on_cancel(&mut self, tenant: Option<&str>, job_id: &str) {
        let key = cancel_key(tenant, job_id);
        if self.relayed.contains(&key) {
            // Our own relay coming back.
            return;
        }
        let holder = self
            .queues
            .tenant_of_waiting(job_id)
            .or_else(|| self.assigned.get(job_id).map(|a| tenant_of(&a.job)));
        if let Some(holder) = holder {
            if holder != tenant.unwrap_or("") {
                self.metrics
                    .cancels_of_another_tenant_total
                    .fetch_add(1, Relaxed);
                tracing::warn!(
                    job_id,
                    cancel_tenant = tenant.unwrap_or(""),
                    job_tenant = holder,
                    "ignoring a cancel that names another tenant than the job's"
                );
                return;
            }
        }
        if let Some(job) = self.queues.remove(job_id) {
            let now = self.now_ms;
            tracing::info!(job_id, "cancelled while queued");
            self.reject(
                &job.job,
                job.attempt,
                Outcome::Rejected,
                "cancelled",
                "cancelled by its client while queued",
                ErrorCode::Cancelled,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
            );
            return;
        }
        if self.finished.contains(job_id) {
            return;
        }
        if let Some(worker) = self.ledger.worker_of(job_id) {
            // Held by a worker (assigned here, or adopted from its heartbeat): relayed to
            // that worker alone, which hears no other cancels. Remembered too, for the
            // relay once its worker reports it (the cancel may overtake the Assignment).
            tracing::info!(
                job_id,
                worker_id = worker,
                "relaying a cancel to the worker holding the job"
            );
            self.emit(publish::Outcome::RelayCancel {
                worker_id: worker.to_string(),
                tenant: tenant.map(str::to_string),
                job_id: job_id.to_string(),
            });
        }
        // Not here yet (still in the intake), or assigned and not yet reported by its
        // worker (the Assignment may reach the worker after the client's cancel did):
        // remembered, applied when the job arrives, is refused or rescued, or relayed once
        // its worker reports it.
        tracing::info!(job_id, "cancel for a job not queued here: remembered");
        self.cancelled.insert(&key, self.now_ms);
    }

    /// Relay remembered cancels of jobs a worker now reports holding: the client's cancel
    /// may have reached the worker before the Assignment did. Only jobs this leader assigned
    /// (it knows their tenant, which the cancel must name); the agent checks it again.
    fn relay_cancels(&mut self, in_flight: &[String], now: u64) {
        if self.cancelled.is_empty() {
            return;
        }
        for job_id in in_flight {
            let Some(a) = self.assigned.get(job_id) else {
                continue;
            };
            let tenant = a.job.tenant.clone();
            let key = cancel_key(tenant.as_deref(), job_id);
            let Some(worker_id) = self.ledger.worker_of(job_id).map(str::to_string) else {
                continue;
            };
            if self.cancelled.remove(&key) {
                tracing::info!(job_id = %job_id, "relaying a cancel to the worker that reports the job");
                self.relayed.insert(&key, now);
                self.emit(publish::Outcome::RelayCancel {
                    worker_id,
                    tenant,
                    job_id: job_id.clone(),
                });
            }
        }
    }

    /// Declare a silent worker dead through the bucket: delete its key unless a heartbeat
    /// later than the last one this leader saw was stored. The death itself
    /// ([`Self::worker_died`]) follows when the watch shows the delete. The worker is not
    /// eligible meanwhile (its heartbeat is too old).
    fn expire_worker(&mut self, worker_id: &str, why: &str, now: u64) {
        let Some(&revision) = self.revisions.get(worker_id) else {
            // Never seen through the bucket (a registry loaded without revisions cannot
            // happen; this is the safe fallback): declare it dead directly.
            self.worker_died(worker_id, why);
            return;
        };
        tracing::info!(
            worker_id,
            revision,
            why,
            "declaring the worker dead: deleting its key unless it stored a newer heartbeat"
        );
        self.expiring.insert(
            worker_id.to_string(),
            Expiring {
                since_ms: now,
                why: why.to_string(),
            },
        );
        self.emit(publish::Outcome::ExpireWorker {
            worker_id: worker_id.to_string(),
            revision,
        });
    }

    /// A worker is gone: release its reservations; jobs it never reported are assigned
    /// again, jobs it had reported fail with `WorkerLost` (they may have streamed output).
    fn worker_died(&mut self, worker_id: &str, why: &str) {
        if !self.dead.insert(worker_id.to_string()) {
            return;
        }
        self.metrics.workers_lost_total.fetch_add(1, Relaxed);
        let reservations = self.ledger.release_worker(worker_id);
        tracing::warn!(
            worker_id,
            why,
            reservations = reservations.len(),
            "worker is dead"
        );
        // Before anything is assigned again: a worker that comes back must not find (and
        // run) the Assignments that are now going elsewhere. Also when this leader knows
        // of no job there: an earlier leader may have assigned jobs the worker never
        // reported, and the purge hands those back ([`Engine::rescue_purged`]).
        self.settled_at_death.insert(
            worker_id.to_string(),
            reservations.iter().map(|r| r.job_id.clone()).collect(),
        );
        self.emit(publish::Outcome::PurgeWork {
            worker_id: worker_id.to_string(),
        });
        if !reservations.is_empty() {
            // And a worker that was only silent stops what it still runs of them.
            self.emit(publish::revoke(
                worker_id,
                self.s.epoch,
                reservations.iter().map(|r| {
                    (
                        r.job_id.clone(),
                        self.assigned.get(&r.job_id).map(|a| a.attempt),
                    )
                }),
                why,
            ));
        }
        for r in reservations {
            let assigned = self.assigned.remove(&r.job_id);
            if r.is_confirmed() {
                self.emit(publish::Outcome::FinalError {
                    job_id: r.job_id.clone(),
                    worker_id: Some(worker_id.to_string()),
                    error: ErrorCode::WorkerLost,
                    message: format!("worker {worker_id} died while holding the job ({why})"),
                });
            } else if let Some(a) = assigned {
                self.metrics.rescued_jobs_total.fetch_add(1, Relaxed);
                self.retry(
                    a,
                    &format!("worker {worker_id} died before reporting it"),
                    None,
                );
            }
        }
        self.capacity_changed = true;
    }

    /// Whether this leader holds `job_id` other than as a booking on a worker: waiting in
    /// a queue, assigned by it (it holds the body), or finished.
    fn queued_assigned_or_finished(&self, job_id: &str) -> bool {
        self.queues.contains(job_id)
            || self.assigned.contains_key(job_id)
            || self.finished.contains(job_id)
    }

    /// The Assignments a dead worker's purge removed from WORK. Those of jobs settled when
    /// the worker was declared dead, or held here in any other way (queued, assigned,
    /// booked, finished), need nothing. The rest were assigned by an earlier leader and
    /// never reported by the worker: their Assignment was the only copy of the job, so
    /// they go back through JOBS with the next attempt, as a rescue of this leader's own.
    fn rescue_purged(&mut self, worker_id: &str, assignments: Vec<Assignment>) {
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
            self.emit(publish::revoke(
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

    /// The periodic tick at `now_ms`: expiries, early answers, progress acks, dead
    /// workers, snapshots.
    pub fn tick(&mut self, now_ms: u64) {
        self.advance(now_ms);
        let now = self.now_ms;
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
                Outcome::Expired,
                "deadline_exceeded",
                &reason,
                ErrorCode::DeadlineExceeded,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
            );
        }
        for model in self.queues.models() {
            self.answer_unmeetable(&model, now);
        }
        let window = self.s.fairness.light_tenant_window_ms;
        if window > 0 {
            self.queues
                .forget_arrivals_before(now.saturating_sub(window));
        }
        let due = self
            .queues
            .due_for_progress(now.saturating_sub(self.s.ack_wait_ms / 3), now);
        if !due.is_empty() {
            self.effects.push(Effect::Progress(due));
        }
        let timeout = self.s.scheduler.heartbeat_timeout_ms;
        let stale: Vec<String> = self
            .workers
            .iter()
            .filter(|w| now.saturating_sub(w.last_seen_ms) > timeout)
            .filter(|w| !self.dead.contains(&w.status.worker_id))
            // One conditional delete per timeout: an unanswered one (NATS unreachable) is
            // tried again, an answered one shows up on the watch.
            .filter(|w| {
                self.expiring
                    .get(&w.status.worker_id)
                    .is_none_or(|e| now.saturating_sub(e.since_ms) > timeout)
            })
            .map(|w| w.status.worker_id.clone())
            .collect();
        for id in stale {
            self.expire_worker(&id, "heartbeat older than the timeout", now);
        }
        self.settle_orphan_refusals(now);
        // The workers bucket's max age removes a dead worker's key without a delete marker
        // the watch would see, so a dead worker is dropped here, or every later decision
        // would list it and the registry would only grow.
        let forgotten: Vec<String> = self
            .workers
            .iter()
            .filter(|w| self.dead.contains(&w.status.worker_id))
            .filter(|w| now.saturating_sub(w.last_seen_ms) > self.s.forget_dead_after_ms)
            .map(|w| w.status.worker_id.clone())
            .collect();
        for id in forgotten {
            tracing::info!(worker_id = %id, "dead worker left the registry");
            self.forget_worker(&id);
        }
        self.metrics
            .workers_known
            .store(self.workers.len() as u64, Relaxed);
        self.metrics
            .ledger_reservations
            .store(self.ledger.len() as u64, Relaxed);
        self.publish_depths();
        self.publish_queues(now);
        self.persist_fairness();
        // Time alone changes eligibility (reservation and heartbeat ages).
        self.capacity_changed = !self.queues.is_empty();
    }

    fn publish_depths(&self) {
        if let Ok(mut depths) = self.metrics.queue_depth.lock() {
            self.queues.write_depths(&mut depths);
        }
    }

    fn dispatch_all(&mut self) {
        for model in self.queues.models() {
            self.dispatch_model(&model);
        }
    }

    /// How long a queued job has waited since its client submitted it. The client's
    /// `submitted_ms` is trusted only within [read − TTFT target, read]: a skewed clock
    /// can neither hand a job extra budget nor spend it all.
    fn waited_ms(job: &QueuedJob, ttft_ms: u64, now_ms: u64) -> u64 {
        let since = job
            .job
            .submitted_ms
            .clamp(job.enqueued_ms.saturating_sub(ttft_ms), job.enqueued_ms);
        now_ms.saturating_sub(since)
    }

    /// Place the model's jobs until the next one cannot be placed. The oldest job that can
    /// still meet its TTFT target goes first; jobs already past it ("late": they will miss
    /// their TTFT wherever they go) only when no such job waits, so in overload capacity
    /// goes to the jobs it can still serve well. Among the jobs that can, the order is
    /// the fair order, FIFO within a tenant, and the first that cannot be placed holds
    /// back its own tenant's later jobs, not the other tenants' (head-of-line blocking
    /// within one tenant of one model only).
    fn dispatch_model(&mut self, model: &str) {
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
            let now = self.now_ms;
            let scheduler = &self.s.scheduler;
            let prefill = IdleTtft::of(
                self.workers
                    .iter()
                    .filter(|w| w.status.model == model && self.alive(w, now)),
            );
            let late = |j: &QueuedJob| {
                let ttft = scheduler.slo_for(model, j.job.slo.as_ref()).ttft_ms;
                let waited = Self::waited_ms(j, ttft, now) as f64;
                waited + prefill.ttft_ms(j.job.prompt_tokens) >= ttft as f64
            };
            let Some(pos) = self.queues.next_to_try(model, late, &held_back) else {
                // Only jobs held back for a lighter tenant left: the queue is not empty.
                if held_back.is_empty() {
                    if let Some(d) = self.drain.get_mut(model) {
                        d.on_empty();
                    }
                }
                return;
            };
            let started = Instant::now();
            let all_workers = self.s.decision_list_wrong_model;
            if !all_workers && !self.per_model.contains_key(model) {
                let views = self
                    .workers
                    .iter()
                    .filter(|w| w.status.model == model)
                    .cloned()
                    .collect();
                self.per_model.insert(model.to_string(), views);
            }
            let workers: &[WorkerView] = if all_workers {
                &self.workers
            } else {
                &self.per_model[model]
            };
            let other_models = self.workers.len() - workers.len();
            // The job to place: the one fairness and the TTFT rule chose, or, when no
            // worker can take it now, a younger job of its flow that one can take
            // without a predicted miss (see `lookahead`).
            let mut tries = vec![pos];
            if self.s.policy == PolicyKind::Metronome && self.s.scheduler.lookahead > 0 {
                tries.extend(
                    self.queues
                        .following(model, pos, self.s.scheduler.lookahead),
                );
            }
            let mut waiver = None;
            let mut chosen = None;
            let mut head_evaluation = None;
            for (k, &at) in tries.iter().enumerate() {
                let job = self.queues.get(model, at).expect("position exists");
                if k > 0 && late(job) {
                    continue;
                }
                let predicted = self.predicted_output(&job.job);
                let slo = scheduler.slo_for(model, job.job.slo.as_ref());
                let waited = Self::waited_ms(job, slo.ttft_ms, now);
                let request = JobRequest::from_job(&job.job, predicted, slo).waited(waited);
                if k == 0 && self.s.policy == PolicyKind::Metronome {
                    // Every worker refuses the head for a reason that refuses every job of
                    // the model (at its cap, stale, ...): nothing can be placed, not even
                    // where it does least harm, and the jobs behind it would meet the same
                    // refusals. The queue is held as a full evaluation would hold it,
                    // without one per job tried: under load most looks are these.
                    if let Some(codes) = filter::refused_whatever_the_job(
                        &filter::ADMISSION,
                        &request,
                        workers,
                        &self.ledger,
                        &self.s.scheduler,
                        now,
                    ) {
                        self.metrics.held_codes(model, &codes);
                        return;
                    }
                    // The jobs tried are all of one flow, so of one tenant: if it runs
                    // under its fair share, they are judged without the floors of the jobs
                    // of the tenants above theirs (see `FloorWaiver`). Made here, past the
                    // check above, so a look that refuses every job copies no ledger.
                    waiver = self.floor_waiver(model, tenant_of(&job.job), now);
                }
                let narrowed = self
                    .refusals
                    .narrow(&job.job.id, workers, |w| self.takes_work(w, now));
                let mut evaluation = choose(
                    self.s.policy,
                    &mut self.policy_state,
                    &request,
                    narrowed.as_ref().map_or(workers, |(pool, _)| pool),
                    waiver.as_ref().map_or(&self.ledger, |w| &w.ledger),
                    &self.s.scheduler,
                    now,
                );
                if let Some((_, refused)) = narrowed {
                    evaluation.rejected.extend(refused);
                }
                if evaluation.winner.is_some() {
                    chosen = Some((at, request, slo, evaluation));
                    break;
                }
                if k == 0 {
                    head_evaluation = Some((request, slo, evaluation));
                }
            }
            let (pos, request, slo, mut evaluation) = match chosen {
                Some(c) => c,
                None => {
                    let (r, s, e) = head_evaluation.expect("the head was evaluated");
                    (pos, r, s, e)
                }
            };
            let front = self.queues.get(model, pos).expect("position exists");
            let waited = Self::waited_ms(front, slo.ttft_ms, now);
            // Least harm, too, leaves out the workers that refused the job.
            let front_pool = self
                .refusals
                .narrow(&front.job.id, workers, |w| self.takes_work(w, now));
            let harm_pool = front_pool.as_ref().map_or(workers, |(pool, _)| pool);
            let mut least_harm_note = None;
            let alone = self.queues.len(model) == 1;
            // A job of a tenant under its fair share trades up to
            // `light_tenant_traded_misses` predicted misses, most likely on the tenant that
            // holds more than its share, in two cases:
            // - No worker admits it, and others wait too, so the model is short of
            //   capacity, but short because another tenant holds more than its own.
            //   Waiting for room would hand the lighter tenant's latency to the flood (room
            //   opens only as the flood's jobs end).
            // - It is admitted, but only where its first token comes late, while another
            //   worker would start it at least `light_tenant_ttft_ratio` times sooner. In
            //   the fairness drill, at a flood's onset, the light tenant's job was admitted
            //   only where its predicted TTFT was 1.2 s; the worker that refused it would
            //   have started it in 0.17 s, taking one running job to 28.7 tok/s against a
            //   30 tok/s floor.
            let ratio = self.s.fairness.light_tenant_ttft_ratio;
            let admitted_ttft = evaluation
                .winner_score()
                .and_then(|c| c.prediction)
                .map(|p| p.ttft_ms);
            let ttft_ceiling = match (&evaluation.winner, admitted_ttft) {
                (None, _) if !alone => Some(f64::INFINITY),
                (Some(_), Some(late)) if ratio > 0.0 => Some(late / ratio),
                _ => None,
            };
            let under_share = match ttft_ceiling {
                Some(c) if self.s.policy == PolicyKind::Metronome => self
                    .runs_under_fair_share(model, tenant_of(&front.job), now)
                    .map(|u| (c, (u.mine, u.total, u.share))),
                _ => None,
            };
            if let Some((ceiling, (mine, total, share))) = under_share {
                let traded = least_harm_within(
                    &request,
                    harm_pool,
                    waiver.as_ref().map_or(&self.ledger, |w| &w.ledger),
                    &self.s.scheduler,
                    now,
                    self.s.fairness.light_tenant_traded_misses,
                    ceiling,
                );
                let share_note = format!(
                    "its tenant runs {mine} of the model's {total} jobs, under its fair share ({share:.1})"
                );
                if traded.winner.is_some() {
                    least_harm_note = Some(match admitted_ttft {
                        None => format!(
                            "placed where it does least harm: no worker admitted it without a predicted miss, and {share_note}"
                        ),
                        Some(late) => {
                            let ttft = traded
                                .winner_score()
                                .and_then(|c| c.prediction)
                                .map_or(0.0, |p| p.ttft_ms);
                            format!(
                                "placed where its first token comes sooner, at a predicted miss: the workers that admitted it would start it in {late:.0} ms, this one in {ttft:.0} ms, and {share_note}"
                            )
                        }
                    });
                    evaluation = traded;
                }
            }
            if evaluation.winner.is_none() && self.s.policy == PolicyKind::Metronome && alone {
                // No worker admits it without a predicted miss. Wait while waiting can
                // still pay off; at the last moment its predicted TTFT still fits its
                // budget (the next look may come a tick later), place it where it does
                // least harm. Only when it waits alone: with others waiting, the model is
                // short of capacity, and trading a running job's SLO for this one's only
                // moves the miss while taking the room the next job needs.
                if let Some(remaining) = request.ttft_remaining_ms {
                    let fallback =
                        least_harm(&request, harm_pool, &self.ledger, &self.s.scheduler, now);
                    let ttft = fallback
                        .winner_score()
                        .and_then(|c| c.prediction)
                        .map(|p| p.ttft_ms);
                    let margin = 2.0 * self.s.tick.as_secs_f64() * 1000.0;
                    if let Some(ttft) = ttft.filter(|t| remaining - t <= margin) {
                        least_harm_note = Some(format!(
                            "placed where it does least harm: no worker admitted it without a predicted miss, and {remaining:.0} ms were left of its TTFT budget (predicted TTFT {ttft:.0} ms)"
                        ));
                        evaluation = fallback;
                    }
                }
            }
            if let (Some(_), Some((_, refused))) = (&least_harm_note, front_pool) {
                evaluation.rejected.extend(refused);
            }
            let Some(winner) = evaluation.winner.clone() else {
                self.metrics.held(model, &evaluation.rejected);
                if self.s.policy != PolicyKind::Metronome {
                    return;
                }
                // Its tenant's jobs wait; the others' are offered what is free. The
                // fair order picked this tenant, but it cannot use the room there is, and
                // holding every tenant behind it left a lighter tenant's jobs waiting
                // seconds behind a flood's job that fitted nowhere (the fairness lab, on
                // GPUs of speeds 1, 0.7, 0.7, 0.5). With one tenant this ends the pass.
                held_back.push(tenant_of(&front.job).to_string());
                continue;
            };
            let decoding_from_ms = evaluation
                .winner_score()
                .and_then(|c| c.prediction)
                .map_or(0, |p| now.saturating_add(p.ttft_ms.max(0.0) as u64));
            // Running, it is protected as if it were short: at a length it is unlikely to
            // fall short of, since a job that ends sooner than expected has less time to
            // absorb the stalls later admissions charge it.
            let protect = self
                .output_models
                .get(model)
                .filter(|m| m.samples() > 0)
                .map_or(request.predicted_output(), |m| {
                    m.predict_low(request.max_tokens)
                        .min(request.predicted_output())
                });
            let profile = JobProfile {
                prompt_tokens: request.prompt_tokens,
                protected_output: protect,
                min_tok_s: slo.min_tok_s,
                max_tokens: request.max_tokens,
                decoding_from_ms,
            };
            // An idle GPU is never kept idle for someone else: on a GPU that takes one job
            // at a time, the room kept would be all of it.
            let winner_idle = evaluation
                .winner_score()
                .and_then(|c| c.prediction.as_ref())
                .is_some_and(|p| p.streams_after <= 1);
            if least_harm_note.is_none()
                && !winner_idle
                && self.room_kept_for_lighter_tenant(
                    model,
                    pos,
                    &request,
                    (&winner, evaluation.winner_stall_ms, profile),
                    now,
                )
            {
                self.metrics.held_for(model, HELD_FOR_LIGHTER_TENANT);
                held_back.push(tenant_of(&front.job).to_string());
                continue;
            }
            let job = self.queues.take(model, pos).expect("position exists");
            self.metrics
                .observe_queue_wait(model, "assigned", now.saturating_sub(job.enqueued_ms));
            self.drain
                .entry(model.to_string())
                .or_default()
                .on_placement(now, self.queues.len(model));
            if let Err(error) = self.ledger.reserve_profiled(
                &winner,
                &job.job.id,
                request.kv_tokens(),
                profile,
                now,
            ) {
                tracing::error!(job_id = %job.job.id, %error, "reservation refused: job dropped from the queue");
                continue;
            }
            self.ledger
                .charge_stall(&winner, &job.job.id, evaluation.winner_stall_ms, now);
            self.charge_fair(&job, &request, now);
            let latency = started.elapsed();
            self.metrics
                .observe_decision_latency(latency.as_nanos() as u64);
            let mut decision = self.decision(
                &job.job,
                Outcome::Assigned,
                job.attempt,
                now.saturating_sub(job.enqueued_ms),
                latency.as_micros() as u64,
                now,
            );
            decision.worker_id = Some(winner.clone());
            decision.slo = Some(slo);
            decision.cost = Some(evaluation.cost);
            decision.scoring = Some(evaluation.scoring);
            decision.candidates = evaluation.candidates;
            decision.rejected = evaluation.rejected;
            let mut notes = Vec::new();
            if let Some(note) = least_harm_note {
                self.metrics
                    .least_harm_placements_total
                    .fetch_add(1, Relaxed);
                notes.push(note);
            }
            if let Some(w) = waiver {
                notes.push(w.note);
            }
            if request.ttft_remaining_ms.is_none() {
                notes.push(format!(
                    "late: waited {waited} ms, past its {} ms TTFT target",
                    slo.ttft_ms
                ));
            }
            if job.attempt > 1 {
                notes.push(format!("attempt {} (assigned again)", job.attempt));
            }
            if !all_workers && other_models > 0 {
                notes.push(format!(
                    "{other_models} workers serving other models not listed"
                ));
            }
            let max = self.s.decision_max_candidates;
            if max > 0 && decision.candidates.len() > max {
                notes.push(format!(
                    "{} more candidates not listed (decision_max_candidates = {max})",
                    decision.candidates.len() - max
                ));
                decision.candidates.truncate(max);
            }
            if !notes.is_empty() {
                decision.reason = Some(notes.join("; "));
            }
            self.assigned.insert(
                job.job.id.clone(),
                AssignedJob {
                    job: job.job.clone(),
                    attempt: job.attempt,
                    seq: job.seq,
                    deadline_ms: job.deadline_ms,
                },
            );
            self.emit(publish::Outcome::Assign {
                job,
                worker_id: winner,
                epoch: self.s.epoch,
                decision: Box::new(decision),
            });
        }
    }

    /// The model's running jobs (placed in this term or adopted) per tenant that submitted
    /// to it within `[fairness] light_tenant_window_ms`; `None` with fewer than two such
    /// tenants (or the window off), so single-tenant admission is untouched.
    fn running_by_active_tenant(&self, model: &str, now: u64) -> Option<BTreeMap<&str, usize>> {
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
    fn running_jobs_of<'a>(&'a self, model: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> {
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
    fn runs_under_fair_share(&self, model: &str, tenant: &str, now: u64) -> Option<FairShare<'_>> {
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
    fn floor_waiver(&self, model: &str, tenant: &str, now: u64) -> Option<FloorWaiver> {
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
    fn tenants_running_fewer(&self, model: &str, tenant: &str, now: u64) -> Vec<&str> {
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
    fn room_kept_for_lighter_tenant(
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

    fn decision(
        &self,
        job: &Job,
        outcome: Outcome,
        attempt: u32,
        queue_wait_ms: u64,
        latency_us: u64,
        now: u64,
    ) -> Decision {
        Decision {
            v: metronome_protocol::DECISION_VERSION,
            job_id: job.id.clone(),
            model: Some(job.model.clone()),
            outcome,
            attempt,
            reason: None,
            reason_code: None,
            worker_id: None,
            cost: None,
            scoring: None,
            candidates: Vec::new(),
            rejected: Vec::new(),
            slo: None,
            policy: self.s.policy.as_str().to_string(),
            queue_wait_ms,
            retry_after_ms: None,
            decision_latency_us: latency_us,
            epoch: self.s.epoch,
            dispatcher_id: self.s.dispatcher_id.clone(),
            decided_ms: now,
            tenant: job.tenant.clone(),
            priority: Some(job.priority()),
            fair_counter: Some(self.queues.counter(&job.model, tenant_of(job))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reject(
        &mut self,
        job: &Job,
        attempt: u32,
        outcome: Outcome,
        code: &str,
        reason: &str,
        error: ErrorCode,
        acker: Option<Arc<Acker>>,
        queue_wait_ms: u64,
    ) {
        self.refusals.forget(&job.id);
        self.refuse(
            job,
            attempt,
            outcome,
            code,
            reason,
            error,
            acker,
            queue_wait_ms,
            None,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn refuse(
        &mut self,
        job: &Job,
        attempt: u32,
        outcome: Outcome,
        code: &str,
        reason: &str,
        error: ErrorCode,
        acker: Option<Arc<Acker>>,
        queue_wait_ms: u64,
        retry_after_ms: Option<u64>,
    ) {
        let now = self.now_ms;
        tracing::info!(job_id = %job.id, model = %job.model, reason_code = code, reason, "job not assigned");
        self.metrics.tenant_rejected(tenant_of(job), code);
        let mut decision = self.decision(job, outcome, attempt, queue_wait_ms, 0, now);
        decision.retry_after_ms = retry_after_ms;
        decision.reason = Some(reason.to_string());
        decision.reason_code = Some(code.to_string());
        let slo = self.s.scheduler.slo_for(&job.model, job.slo.as_ref());
        let request = JobRequest::from_job(job, f64::from(job.max_tokens), slo);
        decision.cost = Some(request.cost_estimate());
        decision.slo = Some(slo);
        self.emit(publish::Outcome::Reject {
            decision: Box::new(decision),
            error,
            message: reason.to_string(),
            acker,
        });
    }

    /// Charge a job being assigned to its tenant: prompt plus predicted output tokens.
    fn charge_fair(&mut self, job: &QueuedJob, request: &JobRequest, now: u64) {
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
    fn settle_fair(&mut self, event: &CompletionEvent) {
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

    /// Hand the counters to the writer when they changed (on the tick, and once more when
    /// the term ends).
    fn persist_fairness(&mut self) {
        if let Some(out) = &self.fairness_out {
            let snapshot = self.queues.fairness_snapshot();
            out.send_if_modified(|current| {
                let changed = *current != snapshot;
                if changed {
                    *current = snapshot;
                }
                changed
            });
        }
    }

    /// Hand a snapshot of every known model's queue (those of live workers' models and
    /// those that held jobs this term, emptied ones included) to the writer when one
    /// changed, at most every `min_interval_ms`; the per-model oldest-wait gauges follow.
    fn publish_queues(&mut self, now: u64) {
        let Some(min_interval_ms) = self.queues_out.as_ref().map(|(_, ms)| *ms) else {
            return;
        };
        if self.queues_taken_ms != 0 && now < self.queues_taken_ms + min_interval_ms {
            return;
        }
        self.queues_taken_ms = now;
        let mut models: std::collections::BTreeSet<&str> = self.queues.known_models().collect();
        models.extend(self.workers.iter().map(|w| w.status.model.as_str()));
        let snapshots: Vec<QueueSnapshot> = models
            .into_iter()
            .map(|m| {
                let mut s = self.queues.snapshot(m, now);
                s.epoch = self.s.epoch;
                s.dispatcher_id.clone_from(&self.s.dispatcher_id);
                s
            })
            .collect();
        if let Ok(mut waits) = self.metrics.queue_oldest_wait_ms.lock() {
            *waits = snapshots
                .iter()
                .map(|s| (s.model.clone(), s.oldest_wait_ms))
                .collect();
        }
        let Some((out, _)) = &self.queues_out else {
            return;
        };
        out.send_if_modified(|current| {
            let changed = current.len() != snapshots.len()
                || current
                    .iter()
                    .zip(&snapshots)
                    .any(|(a, b)| !a.same_queue(b));
            if changed {
                *current = snapshots;
            }
            changed
        });
    }

    /// Publish queue snapshots to `out`, at most every `min_interval_ms`; sends the first
    /// at once, so the writer starts from this leader's view. Called at takeover, after
    /// [`Engine::load`].
    pub fn queue_snapshots(
        &mut self,
        out: tokio::sync::watch::Sender<Vec<QueueSnapshot>>,
        min_interval_ms: u64,
        now_ms: u64,
    ) {
        self.advance(now_ms);
        self.queues_out = Some((out, min_interval_ms));
        self.queues_taken_ms = 0;
        self.publish_queues(self.now_ms);
    }

    /// Start from the counters an earlier leader persisted, and persist changes to `out`.
    /// Called at takeover, before any job is read.
    pub fn fairness(
        &mut self,
        saved: Option<FairnessSnapshot>,
        out: tokio::sync::watch::Sender<FairnessSnapshot>,
    ) {
        if let Some(saved) = saved {
            tracing::info!(
                models = saved.models.len(),
                "fair-share counters loaded from the previous leader"
            );
            self.queues.restore_fairness(&saved);
        }
        self.fairness_out = Some(out);
    }

    /// Adopt in-flight work from loaded heartbeats (takeover), before any job is read.
    pub fn load(&mut self, updates: Vec<WorkerUpdate>, redis: Option<RedisSnapshot>, now_ms: u64) {
        self.advance(now_ms);
        if let Some(snapshot) = redis {
            self.ewmas = snapshot.ewmas;
            self.output_len = snapshot.output_len;
        }
        for u in updates {
            self.on_worker(u);
        }
        tracing::info!(
            workers = self.workers.len(),
            adopted = self.ledger.len(),
            "state rebuilt"
        );
    }
}

/// The TTFT of a `prompt_tokens` prompt on a typical worker of the model with nothing else
/// to do, by the workers' fitted models (the lower median over `forecasts`); `None` when
/// there is no worker or nothing is known. What a light tenant gets alone is near it, for
/// its jobs spread over the model's workers. Bounded by the fastest worker's instead (at
/// a ratio of 1.25), a cluster with one fast GPU kept that GPU nearly empty for it (the
/// flood lost 24 % of its tokens in the policy lab's fairness drill on GPUs of speed 1,
/// 0.7, 0.7 and 0.5).
fn typical_idle_ttft_ms(forecasts: &[Forecast], prompt_tokens: u32) -> Option<f64> {
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
