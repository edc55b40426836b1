//! The deciding loop: one task owns the admission queues, the reservation ledger and the
//! registry snapshot, and turns events into decisions.
//!
//! Everything that changes scheduling state arrives as an [`Event`] on one channel (new
//! job, worker update, EWMA refresh, completion, cancellation, publish rollback) or from
//! the periodic tick. Because a single task reads the state, picks a worker and commits the
//! reservation before it looks at the next job, N simultaneous jobs on N idle workers land
//! on N distinct workers: no job ever decides on a view that misses an earlier pick.
//! Publishing happens after the commit, pipelined ([`crate::publish`]).
//!
//! Invariants:
//! - No decision is made while the lease is not fresh (self-fencing, [`crate::leader`]).
//! - A job is in at most one of: a queue, the ledger (assigned or adopted).
//! - A model's queue is dispatched strictly in order: if its head cannot be placed, the
//!   jobs behind it wait (head-of-line blocking within a model only); other models are
//!   dispatched independently.
//! - Jobs waiting are re-evaluated after every capacity change (completion, heartbeat,
//!   worker change, rollback) and on every tick.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Decision, ErrorCode, Job, Outcome, WorkerStatus,
};
use metronome_scheduler::least_harm;
use metronome_scheduler::policy::{choose, PolicyKind, PolicyState};
use metronome_scheduler::{
    EwmaSnapshot, JobProfile, JobRequest, Ledger, SchedulerConfig, WorkerView,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::publish::{self, Publisher};
use crate::queue::{QueuedJob, Queues};
use crate::registry::{RedisSnapshot, WorkerUpdate};

/// A job read from JOBS.
pub struct Incoming {
    pub job: Arc<Job>,
    pub acker: Arc<async_nats::jetstream::message::Acker>,
    pub seq: u64,
    pub received_ms: u64,
}

/// Everything that reaches the deciding loop.
pub enum Event {
    Job(Box<Incoming>),
    Worker(WorkerUpdate),
    Redis(RedisSnapshot),
    Completion(Box<CompletionEvent>),
    Cancel(String),
    /// The Assignment could not be published: roll back and requeue.
    PublishFailed {
        job: Box<QueuedJob>,
        worker_id: String,
    },
    /// JetStream said an earlier leader already sent this attempt.
    AlreadyAssigned {
        job_id: String,
        worker_id: String,
    },
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
    pub adopt_kv_tokens: u64,
    pub ack_wait_ms: u64,
    pub tick: Duration,
    pub decision_max_candidates: usize,
    pub decision_list_wrong_model: bool,
}

/// A job this leader assigned and has not seen finish.
struct AssignedJob {
    job: Arc<Job>,
    attempt: u32,
    seq: u64,
    deadline_ms: u64,
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
    /// Jobs whose completion event arrived, with when: a heartbeat sent before the event may
    /// still list them, and must neither re-adopt them nor count them as running.
    finished: HashMap<String, u64>,
    ewmas: HashMap<String, EwmaSnapshot>,
    output_len: HashMap<String, f64>,
    assigned: HashMap<String, AssignedJob>,
    policy_state: PolicyState,
    publisher: Publisher,
    metrics: Arc<Metrics>,
    fence: Arc<Fence>,
    capacity_changed: bool,
}

impl Engine {
    pub fn new(
        s: EngineSettings,
        publisher: Publisher,
        metrics: Arc<Metrics>,
        fence: Arc<Fence>,
    ) -> Engine {
        Engine {
            queues: Queues::new(s.queue_bound_per_model),
            ledger: Ledger::new(),
            workers: Vec::new(),
            index: HashMap::new(),
            per_model: HashMap::new(),
            dead: HashSet::new(),
            finished: HashMap::new(),
            ewmas: HashMap::new(),
            output_len: HashMap::new(),
            assigned: HashMap::new(),
            policy_state: PolicyState::new(s.policy_seed),
            publisher,
            metrics,
            fence,
            capacity_changed: false,
            s,
        }
    }

    /// Run until `token` is cancelled or the lease goes stale.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Event>, token: CancellationToken) {
        let mut tick = tokio::time::interval(self.s.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = token.cancelled() => break,
                event = rx.recv() => {
                    let Some(event) = event else { break };
                    self.handle(event);
                    // Drain what is already queued before re-evaluating, bounded so the
                    // tick still runs under sustained load.
                    for _ in 0..4096 {
                        match rx.try_recv() {
                            Ok(event) => self.handle(event),
                            Err(_) => break,
                        }
                    }
                }
                _ = tick.tick() => self.on_tick(),
            }
            if !self.fence.is_fresh() {
                tracing::error!(
                    epoch = self.s.epoch,
                    "lease is stale: no more decisions in this term"
                );
                token.cancel();
                break;
            }
            if self.capacity_changed {
                self.capacity_changed = false;
                self.dispatch_all();
            }
        }
        self.metrics.ledger_reservations.store(0, Relaxed);
    }

    /// Apply one event.
    pub fn handle(&mut self, event: Event) {
        match event {
            Event::Job(incoming) => self.on_job(*incoming),
            Event::Worker(update) => self.on_worker(update),
            Event::Redis(snapshot) => self.on_redis(snapshot),
            Event::Completion(event) => self.on_completion(*event),
            Event::Cancel(job_id) => self.on_cancel(&job_id),
            Event::PublishFailed { job, worker_id } => {
                if self.ledger.worker_of(&job.job.id) == Some(worker_id.as_str()) {
                    self.ledger.release(&job.job.id);
                }
                self.assigned.remove(job.job.id.as_str());
                self.publish_failed(*job, &worker_id);
            }
            Event::AlreadyAssigned { job_id, worker_id } => {
                if self.ledger.worker_of(&job_id) == Some(worker_id.as_str()) {
                    self.ledger.release(&job_id);
                }
                self.assigned.remove(&job_id);
                self.capacity_changed = true;
            }
        }
    }

    fn alive(&self, view: &WorkerView, now_ms: u64) -> bool {
        now_ms.saturating_sub(view.last_seen_ms) <= self.s.scheduler.heartbeat_timeout_ms
            && !self.dead.contains(&view.status.worker_id)
    }

    fn on_job(&mut self, inc: Incoming) {
        let now = metronome_protocol::time::unix_ms();
        let job_id = inc.job.id.clone();
        if let Some(worker) = self.ledger.worker_of(&job_id) {
            // Redelivered after a leader change, but a worker already holds it (adopted
            // from its heartbeat, or assigned earlier in this term): settle it without a
            // second assignment. The decision's msg-id drops it if one already exists.
            let worker = worker.to_string();
            tracing::info!(job_id = %job_id, worker_id = %worker, "redelivered job is already held by a worker");
            let attempt = self.assigned.get(&job_id).map_or(1, |a| a.attempt);
            let mut decision = self.decision(&inc.job, Outcome::Assigned, attempt, 0, 0, now);
            decision.worker_id = Some(worker.clone());
            decision.reason =
                Some("already held by the worker (adopted from its heartbeat)".into());
            decision.reason_code = Some("already_assigned".into());
            self.publisher.send(publish::Outcome::DecisionOnly {
                decision: Box::new(decision),
                acker: Some(inc.acker),
            });
            return;
        }
        if self.queues.contains(&job_id) {
            // A redelivery of a job already waiting here: the queued copy stands.
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
                1,
                Outcome::Rejected,
                "unknown_model",
                &reason,
                ErrorCode::UnknownModel,
                Some(inc.acker),
                now.saturating_sub(inc.received_ms),
            );
            return;
        }
        let deadline_ms = inc
            .job
            .deadline_ms
            .unwrap_or(inc.received_ms + self.s.default_deadline_ms);
        let model = inc.job.model.clone();
        let queued = QueuedJob {
            job: inc.job,
            attempt: 1,
            acker: Some(inc.acker),
            seq: inc.seq,
            enqueued_ms: inc.received_ms,
            deadline_ms,
            progress_ms: inc.received_ms,
        };
        match self.queues.push(queued) {
            // Every arrival gets a look: even behind waiting jobs it may be the first that
            // can still meet its TTFT target.
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

    fn on_worker(&mut self, update: WorkerUpdate) {
        let now = metronome_protocol::time::unix_ms();
        self.per_model.clear();
        match update {
            WorkerUpdate::Put {
                mut status,
                seen_ms,
            } => {
                let id = status.worker_id.clone();
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
            WorkerUpdate::Gone { worker_id } => {
                self.worker_died(&worker_id, "its key left the workers bucket");
                if let Some(i) = self.index.remove(&worker_id) {
                    self.workers.swap_remove(i);
                    if i < self.workers.len() {
                        let moved = self.workers[i].status.worker_id.clone();
                        self.index.insert(moved, i);
                    }
                }
                self.dead.remove(&worker_id);
            }
        }
        self.metrics
            .workers_known
            .store(self.workers.len() as u64, Relaxed);
        self.capacity_changed = true;
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

    /// Remove from a heartbeat the jobs whose completion this leader has already seen: the
    /// heartbeat was sent before they finished. Without this a burst right after another
    /// sees busy workers that are idle, and re-adopts finished jobs as leaked reservations.
    fn drop_finished(&mut self, status: &mut WorkerStatus) {
        let before = status.in_flight.len();
        status
            .in_flight
            .retain(|id| !self.finished.contains_key(id));
        let gone = (before - status.in_flight.len()) as u32;
        status.active = status.active.saturating_sub(gone);
    }

    fn on_completion(&mut self, event: CompletionEvent) {
        if event.outcome != CompletionOutcome::Refused {
            let now = metronome_protocol::time::unix_ms();
            // Heartbeats come every second; a minute covers any that were in flight.
            self.finished
                .retain(|_, at| now.saturating_sub(*at) < 60_000);
            self.finished.insert(event.job_id.clone(), now);
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
                self.retry(a, &format!("refused by {}", event.worker_id));
            }
            None if !self.queues.contains(&event.job_id)
                && self.ledger.worker_of(&event.job_id).is_none() =>
            {
                // Refused, but this leader never held the job's body (assigned by an
                // earlier leader): it cannot be assigned again, so its client is told.
                self.publisher.send(publish::Outcome::FinalError {
                    job_id: event.job_id.clone(),
                    worker_id: Some(event.worker_id.clone()),
                    error: ErrorCode::WorkerFailed,
                    message: format!(
                        "worker {} refused the job and it could not be assigned again",
                        event.worker_id
                    ),
                });
            }
            None => {}
        }
    }

    /// Queue a job again with the next attempt, or reject it when attempts are used up.
    fn retry(&mut self, a: AssignedJob, why: &str) {
        let now = metronome_protocol::time::unix_ms();
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
        self.queues.put_back(QueuedJob {
            job: a.job,
            attempt: a.attempt + 1,
            acker: None,
            seq: a.seq,
            enqueued_ms: now,
            deadline_ms: a.deadline_ms.max(now + self.s.default_deadline_ms),
            progress_ms: now,
        });
        self.capacity_changed = true;
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
            let now = metronome_protocol::time::unix_ms();
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

    fn on_cancel(&mut self, job_id: &str) {
        if let Some(job) = self.queues.remove(job_id) {
            let now = metronome_protocol::time::unix_ms();
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
        }
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
        if !reservations.is_empty() {
            // Before anything is assigned again: a worker that comes back must not find
            // (and run) the Assignments that are now going elsewhere.
            self.publisher.send(publish::Outcome::PurgeWork {
                worker_id: worker_id.to_string(),
            });
            // And a worker that was only silent stops what it still runs of them.
            self.publisher.send(publish::revoke(
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
                self.publisher.send(publish::Outcome::FinalError {
                    job_id: r.job_id.clone(),
                    worker_id: Some(worker_id.to_string()),
                    error: ErrorCode::WorkerLost,
                    message: format!("worker {worker_id} died while holding the job ({why})"),
                });
            } else if let Some(a) = assigned {
                self.metrics.rescued_jobs_total.fetch_add(1, Relaxed);
                self.retry(a, &format!("worker {worker_id} died before reporting it"));
            }
        }
        self.capacity_changed = true;
    }

    fn on_tick(&mut self) {
        let now = metronome_protocol::time::unix_ms();
        for job in self.queues.take_expired(now) {
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
        let due = self
            .queues
            .due_for_progress(now.saturating_sub(self.s.ack_wait_ms / 3), now);
        if !due.is_empty() {
            tokio::spawn(async move {
                for acker in due {
                    let _ = acker.ack_with(AckKind::Progress).await;
                }
            });
        }
        let stale: Vec<String> = self
            .workers
            .iter()
            .filter(|w| now.saturating_sub(w.last_seen_ms) > self.s.scheduler.heartbeat_timeout_ms)
            .filter(|w| !self.dead.contains(&w.status.worker_id))
            .map(|w| w.status.worker_id.clone())
            .collect();
        for id in stale {
            self.worker_died(&id, "heartbeat older than the timeout");
        }
        self.metrics
            .ledger_reservations
            .store(self.ledger.len() as u64, Relaxed);
        if let Ok(mut depths) = self.metrics.queue_depth.lock() {
            *depths = self.queues.depths();
        }
        // Time alone changes eligibility (reservation and heartbeat ages).
        self.capacity_changed = !self.queues.is_empty();
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
    /// FIFO and the first that cannot be placed holds the others back (head-of-line
    /// blocking within a model only).
    fn dispatch_model(&mut self, model: &str) {
        loop {
            if !self.fence.is_fresh() {
                return;
            }
            let now = metronome_protocol::time::unix_ms();
            let scheduler = &self.s.scheduler;
            let Some(pos) = self.queues.next_to_try(model, |j| {
                let ttft = scheduler.slo_for(model, j.job.slo.as_ref()).ttft_ms;
                Self::waited_ms(j, ttft, now) >= ttft
            }) else {
                return;
            };
            let front = self.queues.get(model, pos).expect("position exists");
            let started = Instant::now();
            let predicted = self
                .output_len
                .get(model)
                .copied()
                .unwrap_or(f64::from(front.job.max_tokens));
            let slo = scheduler.slo_for(model, front.job.slo.as_ref());
            let waited = Self::waited_ms(front, slo.ttft_ms, now);
            let request = JobRequest::from_job(&front.job, predicted, slo).waited(waited);
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
            let mut evaluation = choose(
                self.s.policy,
                &mut self.policy_state,
                &request,
                workers,
                &self.ledger,
                &self.s.scheduler,
                now,
            );
            let mut least_harm_note = None;
            if evaluation.winner.is_none() && self.s.policy == PolicyKind::Metronome {
                // No worker admits it without a predicted miss. Wait while waiting can
                // still pay off; at the last moment its predicted TTFT still fits its
                // budget (the next look may come a tick later), place it where it does
                // least harm.
                if let Some(remaining) = request.ttft_remaining_ms {
                    let fallback =
                        least_harm(&request, workers, &self.ledger, &self.s.scheduler, now);
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
            let Some(winner) = evaluation.winner.clone() else {
                return;
            };
            let job = self.queues.take(model, pos).expect("position exists");
            let profile = JobProfile {
                prompt_tokens: request.prompt_tokens,
                predicted_output: request.predicted_output(),
                min_tok_s: slo.min_tok_s,
            };
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
                .charge_stall(&winner, &job.job.id, evaluation.winner_stall_ms);
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
            decision.candidates = evaluation.candidates;
            decision.rejected = evaluation.rejected;
            let mut notes = Vec::new();
            if let Some(note) = least_harm_note {
                self.metrics
                    .least_harm_placements_total
                    .fetch_add(1, Relaxed);
                notes.push(note);
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
            self.publisher.send(publish::Outcome::Assign {
                job,
                worker_id: winner,
                epoch: self.s.epoch,
                decision: Box::new(decision),
            });
        }
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
            v: metronome_protocol::PROTOCOL_VERSION,
            job_id: job.id.clone(),
            model: Some(job.model.clone()),
            outcome,
            attempt,
            reason: None,
            reason_code: None,
            worker_id: None,
            cost: None,
            candidates: Vec::new(),
            rejected: Vec::new(),
            slo: None,
            policy: self.s.policy.as_str().to_string(),
            queue_wait_ms,
            decision_latency_us: latency_us,
            epoch: self.s.epoch,
            dispatcher_id: self.s.dispatcher_id.clone(),
            decided_ms: now,
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
        acker: Option<Arc<async_nats::jetstream::message::Acker>>,
        queue_wait_ms: u64,
    ) {
        let now = metronome_protocol::time::unix_ms();
        tracing::info!(job_id = %job.id, model = %job.model, reason_code = code, reason, "job not assigned");
        let mut decision = self.decision(job, outcome, attempt, queue_wait_ms, 0, now);
        decision.reason = Some(reason.to_string());
        decision.reason_code = Some(code.to_string());
        let slo = self.s.scheduler.slo_for(&job.model, job.slo.as_ref());
        let request = JobRequest::from_job(job, f64::from(job.max_tokens), slo);
        decision.cost = Some(request.cost_estimate());
        decision.slo = Some(slo);
        self.publisher.send(publish::Outcome::Reject {
            decision: Box::new(decision),
            error,
            message: reason.to_string(),
            acker,
        });
    }

    /// Adopt in-flight work from loaded heartbeats (takeover), before any job is read.
    pub fn load(&mut self, updates: Vec<WorkerUpdate>, redis: Option<RedisSnapshot>) {
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
