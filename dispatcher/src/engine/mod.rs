//! The engine: the dispatcher's state machine. It owns the admission queues, the
//! reservation ledger and the registry snapshot, and turns inputs into decisions.
//!
//! Everything that changes scheduling state arrives as an [`Event`] (new job, worker
//! update, EWMA refresh, completion, cancellation, publish rollback) or as the periodic
//! [`Engine::tick`], each with the time it is applied at: the engine does no I/O and reads
//! no clock (decisions are timed by a clock passed in, [`Engine::time_decisions`]; whether
//! the lease still allows deciding comes from the leader's fence). What it decides comes
//! back as [`Effect`]s (publish an outcome, acknowledge a message, persist the fair-share
//! counters, publish the queue snapshots), which the deciding loop ([`crate::deciding`])
//! performs; a test or the policy lab drives the same engine in simulated time. Because
//! one owner reads the state, picks a worker and commits the reservation before it looks
//! at the next job, N simultaneous jobs on N idle workers land on N distinct workers: no
//! job ever decides on a view that misses an earlier pick. Publishing happens after the
//! commit, pipelined ([`crate::publish`]).
//!
//! Where things are:
//! - [`event`] and [`effect`]: the inputs and the outputs.
//! - [`admission`]: whether an arriving job may wait at all; deadlines and early answers.
//! - [`placement`]: which waiting job goes to which worker, as steps: order, filter,
//!   predict, select, least harm, reserve. A placement rule lives there.
//! - [`tenancy`]: fair sharing among tenants: fair share, floor waiver, room kept for a
//!   lighter tenant, token charges.
//! - [`liveness`]: the registry view, and how a silent worker is declared dead.
//! - [`lifecycle`]: completion, refusal and retry, cancels, rescue.
//! - [`record`]: the decision records.
//! - [`snapshots`]: gauges, queue snapshots and fair-share counters handed out.
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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::message::Acker;
use metronome_protocol::QueueSnapshot;
use metronome_scheduler::policy::PolicyState;
use metronome_scheduler::{
    DrainRate, EwmaSnapshot, FairnessSnapshot, Ledger, OutputLength, PrefixIndex, ReportedCaches,
    WorkerView,
};

mod admission;
mod effect;
mod event;
mod lifecycle;
mod liveness;
mod placement;
mod record;
mod settings;
mod snapshots;
mod tenancy;
#[doc(hidden)]
pub mod testing;

pub use effect::{revoke, Effect, Outcome};
pub use event::{Event, Incoming, RedisSnapshot, WorkerUpdate};
pub use settings::EngineSettings;

use lifecycle::AssignedJob;
use liveness::Expiring;

use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::queue::Queues;
use crate::recent::RecentIds;
use crate::refusals::Refusals;
use crate::worker_claims::WorkerClaims;

/// A monotonic clock, passed in ([`Engine::time_decisions`]): it only times decisions,
/// and decides nothing.
pub type DecisionClock = fn() -> Instant;

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

/// The state owned by the deciding loop.
pub struct Engine {
    s: EngineSettings,
    queues: Queues,
    ledger: Ledger,
    /// What this leader believes each worker's prefix cache holds, from its own placements
    /// ([`PrefixIndex`]): a job's prediction on a worker charges only the prefill of what
    /// is not there. The leader's own state: a new leader starts with it empty. The
    /// fallback for workers that do not report their cache (`reported_caches`).
    prefix_index: PrefixIndex,
    /// What each reporting worker's model server says its prefix cache holds (its KV
    /// events, forwarded by its agent, [`ReportedCaches`]): used instead of the placement
    /// estimate wherever it is live. A new leader rebuilds it from the cache streams.
    reported_caches: ReportedCaches,
    workers: Vec<WorkerView>,
    index: HashMap<String, usize>,
    /// Workers of each model, when decisions leave other models' workers out: the scoring
    /// core then only looks at the model's own workers. Cleared on every worker change.
    per_model: HashMap<String, Vec<WorkerView>>,
    dead: HashSet<String>,
    /// Revision in the `workers` bucket of each worker's latest heartbeat.
    revisions: HashMap<String, u64>,
    /// Workers whose heartbeats are overdue and whose key the leader is deleting on the
    /// condition that no later heartbeat was stored ([`Outcome::ExpireWorker`]).
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
    /// Events about a job count only from the worker holding it.
    claims: WorkerClaims,
    /// When a heartbeat outside its worker's provisioning was last logged, per worker
    /// (at most once a minute each; every one is counted).
    unprovisioned_logged: HashMap<String, u64>,
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
    /// The fair-share counters last handed out to be persisted
    /// ([`Effect::PersistFairness`]); `None`: not persisted (engine tests, the policy lab).
    fairness_persisted: Option<FairnessSnapshot>,
    /// The queue snapshots last handed out to be published ([`Effect::PublishQueues`]),
    /// and how often at most (ms); `None`: not published.
    queues_published: Option<(Vec<QueueSnapshot>, u64)>,
    /// When the queue snapshots were last taken.
    queues_taken_ms: u64,
    /// The clock decisions are timed by ([`Engine::time_decisions`]).
    decision_clock: Option<DecisionClock>,
    /// Until when a new term decides nothing while it reads the jobs an earlier leader
    /// left waiting (`None`: reading done, or never asked).
    backlog_hold_until_ms: Option<u64>,
}

impl Engine {
    pub fn new(s: EngineSettings, metrics: Arc<Metrics>, fence: Option<Arc<Fence>>) -> Engine {
        Engine {
            queues: Queues::with_fairness(s.queue_bound_per_model, s.fairness),
            ledger: Ledger::new(),
            prefix_index: PrefixIndex::default(),
            reported_caches: ReportedCaches::default(),
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
            claims: WorkerClaims::default(),
            unprovisioned_logged: HashMap::new(),
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
            fairness_persisted: None,
            queues_published: None,
            decision_clock: None,
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

    /// The estimate of each worker's prefix cache, read-only (what tests inspect).
    pub fn prefix_index(&self) -> &PrefixIndex {
        &self.prefix_index
    }

    /// What the reporting workers' model servers say their caches hold, read-only.
    pub fn reported_caches(&self) -> &ReportedCaches {
        &self.reported_caches
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

    fn emit(&mut self, outcome: Outcome) {
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
                // Not on `worker_id`: on the worker the earlier leader chose.
                if let Some(a) = self.assigned.get_mut(&job_id) {
                    a.worker_id = None;
                }
                self.capacity_changed = true;
            }
            Event::Cache(update) => self.on_cache_update(&update),
        }
    }

    /// A worker's cache report. Waiting jobs are not judged again for it: reports come
    /// several times a second per worker, and the next capacity change or tick looks at
    /// them with what it says.
    fn on_cache_update(&mut self, update: &metronome_protocol::CacheUpdate) {
        use metronome_scheduler::reported_cache::Applied;
        let m = &self.metrics;
        match self.reported_caches.apply(update, self.now_ms) {
            Applied::OlderRun | Applied::Covered => {
                m.cache_updates_ignored_total.fetch_add(1, Relaxed);
            }
            Applied::DeltaAfterGap => {
                m.cache_updates_total.fetch_add(1, Relaxed);
                m.cache_update_gaps_total.fetch_add(1, Relaxed);
            }
            Applied::Snapshot | Applied::Delta => {
                m.cache_updates_total.fetch_add(1, Relaxed);
            }
        }
    }

    /// The periodic tick at `now_ms`: expiries, early answers, progress acks, dead
    /// workers, snapshots.
    pub fn tick(&mut self, now_ms: u64) {
        self.advance(now_ms);
        let now = self.now_ms;
        self.expire_overdue_jobs(now);
        for model in self.queues.models() {
            self.answer_unmeetable(&model, now);
        }
        self.forget_old_arrivals(now);
        self.extend_ack_waits(now);
        self.expire_silent_workers(now);
        self.settle_orphan_refusals(now);
        self.forget_long_dead_workers(now);
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

    /// Hand out queue snapshots to be published ([`Effect::PublishQueues`]), at most every
    /// `min_interval_ms`; the first at once, so the writer starts from this leader's view.
    /// Called at takeover, after [`Engine::load`].
    pub fn queue_snapshots(&mut self, min_interval_ms: u64, now_ms: u64) {
        self.advance(now_ms);
        self.queues_published = Some((Vec::new(), min_interval_ms));
        self.queues_taken_ms = 0;
        self.publish_queues(self.now_ms);
    }

    /// Start from the counters an earlier leader persisted, and hand out changed counters
    /// to be persisted ([`Effect::PersistFairness`]). Called at takeover, before any job is
    /// read.
    pub fn fairness(&mut self, saved: Option<FairnessSnapshot>) {
        if let Some(saved) = saved {
            tracing::info!(
                models = saved.models.len(),
                "fair-share counters loaded from the previous leader"
            );
            self.queues.restore_fairness(&saved);
        }
        self.fairness_persisted = Some(FairnessSnapshot::default());
    }

    /// Time each decision by `clock` (its record's `decision_latency_us`, the
    /// decision-latency histogram). Without a clock (engine tests, the policy lab)
    /// latencies are 0, and every output is a function of the inputs alone.
    pub fn time_decisions(&mut self, clock: DecisionClock) {
        self.decision_clock = Some(clock);
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
