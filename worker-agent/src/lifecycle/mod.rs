//! The agent's job lifecycle as one state machine: what the agent does with each
//! assignment, from its delivery to the release of its slot, and what its heartbeats say
//! about the jobs it holds.
//!
//! Pure: no I/O, no clock, no tokio. Every event takes the time (`now`) and the results of
//! the I/O it depends on (the leader lease's verdict on a new epoch, the metrics scrape) as
//! arguments and returns the [`Effect`]s to perform, in order. The agent's shell
//! (`agent.rs`, `runner.rs`, `heartbeat.rs`) performs them on NATS and the model server;
//! the policy lab performs them in simulated time. So every no-double-run rule below has a
//! fast deterministic test here, and the lab runs the agent's own rules.
//!
//! A held job goes `Waiting` (taken, listed in heartbeats) → `Running` (a stored heartbeat
//! listed it: the model-server call starts) → `Over` (finished, refused or revoked; its
//! results being published) → released (its slot is free, the attempt is remembered).
//!
//! No job runs twice because of this agent:
//! - a redelivered assignment of a job the previous run reported fails as lost (whichever
//!   leader assigned it: checked before the epoch);
//! - one it does not hold otherwise (it restarted, or the delivery never reached a runner)
//!   is refused back to the dispatcher rather than run;
//! - only a refusal of a first delivery of a job not held carries the job (a leader that
//!   does not hold the body assigns it again from that copy, so the copy must be of a job
//!   no run of this agent started);
//! - the highest leader epoch seen only grows, and counts only once the leader lease
//!   vouches for it; a lower epoch comes from a deposed leader and is refused;
//! - a job starts only once a stored heartbeat lists it, and never if the agent was fenced
//!   ([`fence`]) between taking and reporting it;
//! - a job the leader revoked (it declared this worker dead and settled the job, or
//!   assigned again what its purge removed) stops without a result or an event, even when
//!   the revocation is read before the assignment;
//! - a second delivery of an attempt that already ended here is acknowledged, not run or
//!   refused (refusing would make the dispatcher run a finished job again).

mod effect;
mod event;
pub mod fence;
mod measure;

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use metronome_protocol::names::tenant_token;
use metronome_protocol::{CompletionOutcome, ErrorCode, ResultError, Revoke, RevokedJob};

use crate::load_tracker::{LoadTracker, Measured};

pub use effect::{Ack, Completion, Effect, HeartbeatContents, Notice, Pull, Refusal, Stop};
pub use event::{Assigned, Ending, Lease, Settings};
pub use fence::{Fence, FenceMove, FenceState};
pub use measure::{measure, Timing};

/// Revocations and ended attempts remembered for assignments read after them.
pub const RECENT_KEPT: usize = 4096;

/// Where a held job is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Taken, waiting for a stored heartbeat that lists it.
    Waiting,
    /// On the model server.
    Running {
        started: Instant,
        first_token: Option<Instant>,
        last_token: Option<Instant>,
        chunks: u64,
    },
    /// Its results are being published; the slot is freed on release.
    Over { started: bool },
}

/// A job the agent holds.
#[derive(Debug, Clone)]
struct Held {
    job_id: String,
    attempt: u32,
    tenant: Option<String>,
    prompt_tokens: u32,
    /// Of them, those its model server holds cached ([`Assigned::cached_tokens`]).
    cached_tokens: u32,
    /// When the agent took it: its measurements start here.
    taken: Instant,
    /// The take count when it was taken.
    generation: u64,
    /// Fenced episodes before it was taken.
    episodes: u64,
    phase: Phase,
    /// Why it is to stop, strongest reason first.
    stop: Option<Stop>,
    /// The leader settled it (revoked it, or declared this worker dead while it ran).
    settled: bool,
}

impl Held {
    fn started(&self) -> bool {
        matches!(
            self.phase,
            Phase::Running { .. } | Phase::Over { started: true }
        )
    }
}

/// The agent's job lifecycle (see the module doc).
#[derive(Debug)]
pub struct JobMachine {
    worker_id: String,
    max_concurrency: u32,
    /// In the order taken.
    held: Vec<Held>,
    max_epoch: u64,
    /// Jobs taken so far.
    generation: u64,
    /// Highest take count a stored heartbeat covered.
    reported: u64,
    fence: Fence,
    revoked: VecDeque<RevokedJob>,
    ended: VecDeque<(String, u32)>,
    reported_before_restart: HashSet<String>,
    draining: bool,
    /// Jobs that ended after starting on the model server.
    ended_on_server: u64,
    /// What the model server runs for this agent (the performance model's features).
    tracker: LoadTracker,
}

impl JobMachine {
    pub fn new(settings: Settings, now: Instant) -> Self {
        JobMachine {
            worker_id: settings.worker_id,
            max_concurrency: settings.max_concurrency,
            held: Vec::new(),
            max_epoch: 0,
            generation: 0,
            reported: 0,
            fence: Fence::new(settings.fence_after, now),
            revoked: VecDeque::new(),
            ended: VecDeque::new(),
            reported_before_restart: settings.reported_before_restart,
            draining: false,
            ended_on_server: 0,
            tracker: LoadTracker::new(),
        }
    }

    // ---- events ----

    /// Whether an assignment of `epoch` needs the leader lease's verdict ([`Lease`]).
    pub fn needs_lease(&self, epoch: u64) -> bool {
        epoch > self.max_epoch
    }

    /// An assignment was delivered; `lease` is the lease's verdict when
    /// [`Self::needs_lease`] asked for it.
    pub fn assigned(&mut self, a: &Assigned, lease: Lease, now: Instant) -> Vec<Effect> {
        let job_id = a.job_id.clone();
        let held = self.holds(&job_id);
        let refuse = |why: Refusal, reason: String| {
            vec![Effect::Refuse {
                job_id: job_id.clone(),
                why,
                reason,
                carry_job: a.delivered == 1 && !held,
            }]
        };
        if a.worker_id != self.worker_id {
            return refuse(
                Refusal::OtherWorker,
                "assignment names another worker".into(),
            );
        }
        if a.delivered > 1 && self.reported_before_restart.contains(&job_id) && !held {
            // Checked before the epoch: a deposed leader's Assignment of a job the previous
            // run reported must not come back as a refusal either, since a refusal may be
            // assigned again and would run the job a second time.
            let message = format!(
                "worker {} restarted while holding the job; it is not run again so no output is duplicated",
                self.worker_id
            );
            return vec![Effect::FailLost { job_id, message }];
        }
        if a.epoch > self.max_epoch {
            match lease {
                Lease::Vouches => {}
                Lease::Refuses(reason) => return refuse(Refusal::Unvouched, reason),
                Lease::NotRead => {
                    let reason = format!(
                        "epoch {} is above every epoch seen and the leader lease was not read",
                        a.epoch
                    );
                    return refuse(Refusal::Unvouched, reason);
                }
            }
        }
        self.max_epoch = self.max_epoch.max(a.epoch);
        if a.epoch < self.max_epoch {
            let reason = format!(
                "stale epoch {} (highest seen {}): assigned by a deposed leader",
                a.epoch, self.max_epoch
            );
            return refuse(Refusal::StaleEpoch, reason);
        }
        if self.draining {
            return refuse(Refusal::Draining, "worker is draining".into());
        }
        if held {
            return vec![Effect::Notice {
                job_id,
                notice: Notice::DuplicateIgnored,
            }];
        }
        if self.was_revoked(&job_id, a.attempt) {
            // The leader gave this attempt away before the agent read it.
            return vec![
                Effect::Notice {
                    job_id: job_id.clone(),
                    notice: Notice::Revoked,
                },
                Effect::Ack {
                    job_id,
                    ack: Ack::Term,
                },
            ];
        }
        if self
            .ended
            .iter()
            .any(|(id, n)| *id == job_id && *n == a.attempt)
        {
            return vec![
                Effect::Notice {
                    job_id: job_id.clone(),
                    notice: Notice::AlreadyEnded,
                },
                Effect::Ack {
                    job_id,
                    ack: Ack::Done,
                },
            ];
        }
        if a.delivered > 1 {
            // Delivered before, not held and never reported: an earlier run of this agent
            // took it but never started it before a restart, or the delivery was lost on
            // the way. Running it now could still run it twice (the dispatcher may have
            // moved it); the dispatcher decides again.
            let reason = format!(
                "redelivered assignment (delivery {}) that worker {} does not hold: it restarted or never started it",
                a.delivered, self.worker_id
            );
            return refuse(Refusal::NotHeldRedelivery, reason);
        }
        self.generation += 1;
        // Taken while fenced (read from a pull made before the fence rose, or on waking
        // from a stop): it counts as taken before the episode, so it is refused, not
        // started, when the next heartbeat reports it.
        let mut effects = Vec::new();
        let state = self.check_fence(now, &mut effects);
        self.held.push(Held {
            job_id: job_id.clone(),
            attempt: a.attempt,
            tenant: a.tenant.clone(),
            prompt_tokens: a.prompt_tokens,
            cached_tokens: a.cached_tokens.min(a.prompt_tokens),
            taken: now,
            generation: self.generation,
            episodes: state.episodes - u64::from(state.fenced),
            phase: Phase::Waiting,
            stop: None,
            settled: false,
        });
        effects.push(Effect::Hold { job_id });
        // A job does not produce a token before a stored heartbeat lists it: otherwise a
        // crash right after its first tokens would have it run twice. One heartbeat covers
        // every job taken before it, so under load many jobs share one put.
        effects.push(Effect::Heartbeat);
        effects
    }

    /// A heartbeat built with [`Self::heartbeat`] at `generation` was stored at `now`:
    /// the fence is lowered, and the held jobs it covers start, unless the agent was fenced
    /// since they were taken (then the dispatcher may have given them away: refused).
    pub fn reported(&mut self, generation: u64, now: Instant) -> Vec<Effect> {
        let mut effects = Vec::new();
        let (state, moved) = self.fence.stored(now);
        effects.extend(moved.map(Effect::Fence));
        self.reported = self.reported.max(generation);
        for h in &mut self.held {
            if h.phase != Phase::Waiting || h.settled || h.generation > self.reported {
                continue;
            }
            if h.episodes != state.episodes {
                h.phase = Phase::Over { started: false };
                effects.push(Effect::Refuse {
                    job_id: h.job_id.clone(),
                    why: Refusal::Fenced,
                    reason: "the worker's heartbeats were not stored before the job was reported; it may have been given to another worker".into(),
                    carry_job: false,
                });
                continue;
            }
            h.phase = Phase::Running {
                started: now,
                first_token: None,
                last_token: None,
                chunks: 0,
            };
            self.tracker
                .started(&h.job_id, h.prompt_tokens, h.cached_tokens, now);
            effects.push(Effect::Start {
                job_id: h.job_id.clone(),
            });
            // Cancelled by its client while waiting: it stops as soon as it starts.
            if let Some(why) = h.stop {
                effects.push(Effect::Stop {
                    job_id: h.job_id.clone(),
                    why,
                });
            }
        }
        effects
    }

    /// A heartbeat was not stored (failed or hung): the fence may rise.
    pub fn heartbeat_failed(&mut self, now: Instant) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.check_fence(now, &mut effects);
        effects
    }

    /// The leader deleted this worker's heartbeat key: it declared the worker dead and has
    /// settled every job the worker held (retried the ones it never saw reported, failed
    /// the others to their clients with `worker_lost`). Running jobs stop and end with
    /// `worker_lost` (the same final result: RESULTS keeps one per job); the fence rises as
    /// after a gap, so a job taken but not started is refused once reported, not started.
    pub fn given_away(&mut self) -> Vec<Effect> {
        let mut effects: Vec<Effect> = self
            .fence
            .given_away()
            .map(Effect::Fence)
            .into_iter()
            .collect();
        for h in &mut self.held {
            if !h.started() || h.stop == Some(Stop::Lost) {
                continue;
            }
            h.settled = true;
            if matches!(h.phase, Phase::Running { .. }) {
                h.stop = Some(h.stop.map_or(Stop::Lost, |s| s.min(Stop::Lost)));
                effects.push(Effect::Stop {
                    job_id: h.job_id.clone(),
                    why: Stop::Lost,
                });
            }
        }
        effects
    }

    /// The leader revoked the attempts `revoke` lists: the held ones stop without a
    /// result or an event; the others are remembered, so their assignments, should they be
    /// read later, are not started either.
    pub fn revoke(&mut self, revoke: &Revoke) -> Vec<Effect> {
        if revoke.epoch < self.max_epoch {
            return vec![Effect::Notice {
                job_id: String::new(),
                notice: Notice::StaleRevocation,
            }];
        }
        for r in &revoke.jobs {
            if self.revoked.len() >= RECENT_KEPT {
                self.revoked.pop_front();
            }
            self.revoked.push_back(r.clone());
        }
        let mut effects = Vec::new();
        for r in &revoke.jobs {
            let Some(h) = self
                .held
                .iter_mut()
                .find(|h| h.job_id == r.job_id && r.covers(&h.job_id, h.attempt))
            else {
                continue;
            };
            h.settled = true;
            match h.phase {
                Phase::Waiting => {
                    h.phase = Phase::Over { started: false };
                    effects.push(Effect::Notice {
                        job_id: h.job_id.clone(),
                        notice: Notice::Revoked,
                    });
                    effects.push(Effect::Ack {
                        job_id: h.job_id.clone(),
                        ack: Ack::Term,
                    });
                }
                Phase::Running { .. } => {
                    h.stop = Some(Stop::Revoked);
                    effects.push(Effect::Stop {
                        job_id: h.job_id.clone(),
                        why: Stop::Revoked,
                    });
                }
                Phase::Over { .. } => {}
            }
        }
        effects
    }

    /// A client's cancel of `job_id` under tenant token `tenant` (relayed by the leader).
    /// A client may publish only under its own tenant but may name any job id, so a cancel
    /// naming another tenant than the held job's is ignored.
    pub fn cancel(&mut self, tenant: &str, job_id: &str) -> Vec<Effect> {
        let notice = |notice| {
            vec![Effect::Notice {
                job_id: job_id.to_string(),
                notice,
            }]
        };
        let Some(h) = self.held.iter_mut().find(|h| h.job_id == job_id) else {
            return notice(Notice::CancelNotHeld);
        };
        if tenant_token(h.tenant.as_deref()) != tenant {
            return notice(Notice::CancelOfAnotherTenant);
        }
        let why = h.stop.map_or(Stop::Cancelled, |s| s.min(Stop::Cancelled));
        h.stop = Some(why);
        match h.phase {
            Phase::Running { .. } => vec![Effect::Stop {
                job_id: job_id.to_string(),
                why,
            }],
            // Stopped as soon as it starts (see `reported`).
            Phase::Waiting | Phase::Over { .. } => Vec::new(),
        }
    }

    /// The drain timeout passed: jobs waiting to start are refused, running ones stop.
    pub fn abort(&mut self) -> Vec<Effect> {
        let mut effects = Vec::new();
        for h in &mut self.held {
            match h.phase {
                Phase::Waiting if !h.settled => {
                    h.phase = Phase::Over { started: false };
                    effects.push(Effect::Refuse {
                        job_id: h.job_id.clone(),
                        why: Refusal::ShuttingDown,
                        reason: "the worker-agent shut down before starting the job".into(),
                        carry_job: false,
                    });
                }
                Phase::Running { .. } => {
                    let why = h.stop.map_or(Stop::Aborted, |s| s.min(Stop::Aborted));
                    h.stop = Some(why);
                    effects.push(Effect::Stop {
                        job_id: h.job_id.clone(),
                        why,
                    });
                }
                _ => {}
            }
        }
        effects
    }

    /// A chunk of a running job arrived from the model server at `now`; `text` when it
    /// carries output text (one token, as the usage estimate counts them).
    pub fn chunk(&mut self, job_id: &str, text: bool, now: Instant) -> Vec<Effect> {
        let Some(h) = self.held.iter_mut().find(|h| h.job_id == job_id) else {
            return Vec::new();
        };
        let Phase::Running {
            first_token,
            last_token,
            chunks,
            ..
        } = &mut h.phase
        else {
            return Vec::new();
        };
        if text {
            if first_token.is_none() {
                *first_token = Some(now);
                self.tracker.first_token(job_id, now);
            }
            *last_token = Some(now);
            self.tracker.tokens(job_id, 1, now);
        }
        let seq = *chunks;
        *chunks += 1;
        vec![Effect::PublishChunk {
            job_id: job_id.to_string(),
            seq,
        }]
    }

    /// The model-server call of `job_id` ended at `now` (`ending`), with the usage the
    /// shell counted: what to publish, in order (final result, WORK ack, completion
    /// event), and what the averages learn. A revoked job ends without a result or event.
    pub fn finish(
        &mut self,
        job_id: &str,
        ending: Ending,
        prompt_tokens: u32,
        output_tokens: u32,
        now: Instant,
    ) -> Vec<Effect> {
        let Some(h) = self.held.iter_mut().find(|h| h.job_id == job_id) else {
            return Vec::new();
        };
        let Phase::Running {
            first_token,
            last_token,
            chunks,
            ..
        } = h.phase
        else {
            return Vec::new();
        };
        h.phase = Phase::Over { started: true };
        let job_id = job_id.to_string();
        let revoked = ending == Ending::Stopped && h.stop == Some(Stop::Revoked);
        let (outcome, error) = match ending {
            Ending::Done => (CompletionOutcome::Done, None),
            Ending::Failed(code, message) => (CompletionOutcome::Failed, Some((code, message))),
            Ending::Stopped => match h.stop.unwrap_or(Stop::Aborted) {
                Stop::Revoked => (CompletionOutcome::Failed, None),
                Stop::Lost => (
                    CompletionOutcome::Failed,
                    Some((
                        ErrorCode::WorkerLost,
                        "the leader declared this worker dead while it ran the job (its heartbeats stopped arriving)".into(),
                    )),
                ),
                Stop::Cancelled => (
                    CompletionOutcome::Cancelled,
                    Some((ErrorCode::Cancelled, "cancelled by the client".into())),
                ),
                Stop::Aborted => (
                    CompletionOutcome::Failed,
                    Some((
                        ErrorCode::WorkerFailed,
                        "the worker-agent shut down before the job finished".into(),
                    )),
                ),
            },
        };
        let timing = Timing {
            start: h.taken,
            first_token,
            last_token,
        };
        let sample = measure(&timing, output_tokens, now);
        let done = outcome == CompletionOutcome::Done;
        let perf = if done {
            let measured = Measured {
                prompt_tokens,
                output_tokens,
                ttft_ms: sample.ttft_ms,
                tpot_ms: sample.tpot_ms,
            };
            self.tracker.finished(&job_id, &measured, now)
        } else {
            self.tracker.remove(&job_id, now);
            None
        };
        if revoked {
            return vec![
                Effect::Notice {
                    job_id: job_id.clone(),
                    notice: Notice::Revoked,
                },
                Effect::Ack {
                    job_id,
                    ack: Ack::Term,
                },
            ];
        }
        let error = error.map(|(code, message)| ResultError { code, message });
        vec![
            Effect::PublishFinal {
                job_id: job_id.clone(),
                error: error.clone(),
                chunks,
                ttft_ms: sample.ttft_ms,
                e2e_ms: sample.e2e_ms,
            },
            Effect::Ack {
                job_id: job_id.clone(),
                ack: Ack::Done,
            },
            Effect::PublishCompletion {
                job_id: job_id.clone(),
                event: Completion {
                    outcome,
                    streamed: chunks > 0,
                    error: error.map(|e| e.message),
                    ttft_ms: sample.ttft_ms,
                    tpot_ms: sample.tpot_ms,
                    e2e_ms: sample.e2e_ms.unwrap_or_default(),
                },
            },
            Effect::Learn {
                job_id,
                done,
                sample,
                perf,
            },
        ]
    }

    /// The job's task ended (however it ended, a panic too): its slot is free and its
    /// attempt is remembered as ended. Whether it was held.
    pub fn release(&mut self, job_id: &str, now: Instant) -> bool {
        let Some(i) = self.held.iter().position(|h| h.job_id == job_id) else {
            return false;
        };
        let h = self.held.remove(i);
        if self.ended.len() >= RECENT_KEPT {
            self.ended.pop_front();
        }
        self.ended.push_back((h.job_id.clone(), h.attempt));
        if h.started() {
            self.ended_on_server += 1;
        }
        if matches!(h.phase, Phase::Running { .. }) {
            // Ended without `finish` (its task panicked or was dropped).
            self.tracker.remove(&h.job_id, now);
        }
        true
    }

    /// Start or stop draining: new assignments are refused. Whether it was draining.
    pub fn set_draining(&mut self, draining: bool) -> bool {
        std::mem::replace(&mut self.draining, draining)
    }

    // ---- queries ----

    /// Whether the intake may pull at `now`, and how much.
    pub fn pull(&mut self, now: Instant) -> (Pull, Vec<Effect>) {
        let mut effects = Vec::new();
        if self.check_fence(now, &mut effects).fenced {
            return (Pull::Fenced, effects);
        }
        let free = (self.max_concurrency as usize).saturating_sub(self.held.len());
        let pull = if free == 0 {
            Pull::Full
        } else {
            Pull::Free(free)
        };
        (pull, effects)
    }

    /// What the next heartbeat says about the jobs. `scraped_running` is the model
    /// server's running count at its last scrape, `ended_at_scrape` the value of
    /// [`Self::ended_on_server`] then: the jobs that ended since were counted running.
    pub fn heartbeat(
        &self,
        scraped_running: Option<u32>,
        ended_at_scrape: u64,
    ) -> HeartbeatContents {
        let in_flight: Vec<String> = self
            .held
            .iter()
            .filter(|h| !h.settled)
            .map(|h| h.job_id.clone())
            .collect();
        let ended_since = self.ended_on_server.saturating_sub(ended_at_scrape);
        let active = scraped_running
            .map(|r| r.saturating_sub(u32::try_from(ended_since).unwrap_or(u32::MAX)))
            .unwrap_or(in_flight.len() as u32);
        HeartbeatContents {
            generation: self.generation,
            in_flight,
            active,
            draining: self.draining,
            prefill_pending_tokens: self.prefill_pending_tokens(),
            max_epoch: self.max_epoch,
        }
    }

    /// How the streams on the model server decode at `now` ([`LoadTracker::live_decode`]).
    pub fn live_decode(&self, now: Instant) -> Option<metronome_protocol::LiveDecode> {
        self.tracker.live_decode(now)
    }

    /// Prompt tokens not yet prefilled (less those cached): those on the model server
    /// (the tracker's) and those of held jobs waiting to start. The second matter because
    /// the heartbeat that reports a job lists it before it starts, and the dispatcher then
    /// takes the pending prefill reported for the worker as covering it.
    pub fn prefill_pending_tokens(&self) -> u64 {
        let waiting: u64 = self
            .held
            .iter()
            .filter(|h| h.phase == Phase::Waiting && !h.settled)
            .map(|h| u64::from(h.prompt_tokens - h.cached_tokens))
            .sum();
        self.tracker.pending_prefill_tokens() + waiting
    }

    /// Whether this run of the agent holds `job_id` (taken, running or being published).
    pub fn holds(&self, job_id: &str) -> bool {
        self.held.iter().any(|h| h.job_id == job_id)
    }

    /// Jobs held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The ids a heartbeat lists ([`HeartbeatContents::in_flight`]).
    pub fn in_flight_ids(&self) -> Vec<String> {
        self.heartbeat(None, 0).in_flight
    }

    pub fn draining(&self) -> bool {
        self.draining
    }

    pub fn max_epoch(&self) -> u64 {
        self.max_epoch
    }

    /// Chunks published so far for `job_id` (0 when it is not running).
    pub fn chunks_sent(&self, job_id: &str) -> u64 {
        match self
            .held
            .iter()
            .find(|h| h.job_id == job_id)
            .map(|h| h.phase)
        {
            Some(Phase::Running { chunks, .. }) => chunks,
            _ => 0,
        }
    }

    /// Jobs that ended after starting on the model server, so far.
    pub fn ended_on_server(&self) -> u64 {
        self.ended_on_server
    }

    /// The fence at `now` (it may rise).
    pub fn fence(&mut self, now: Instant) -> (FenceState, Vec<Effect>) {
        let mut effects = Vec::new();
        let state = self.check_fence(now, &mut effects);
        (state, effects)
    }

    fn check_fence(&mut self, now: Instant, effects: &mut Vec<Effect>) -> FenceState {
        let (state, moved) = self.fence.check(now);
        effects.extend(moved.map(Effect::Fence));
        state
    }

    fn was_revoked(&self, job_id: &str, attempt: u32) -> bool {
        self.revoked.iter().any(|r| r.covers(job_id, attempt))
    }
}

#[cfg(test)]
mod tests;
