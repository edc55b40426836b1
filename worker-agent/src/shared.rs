//! The state the agent's tasks share ([`Shared`]): the intake ([`crate::agent`]), the
//! runners ([`crate::runner`]), the heartbeat, the control subscriptions and the probes
//! all read it, and none of them imports another for it.
//!
//! A held job leaves `in_flight` through its [`InFlight`] guard, taken when the intake
//! accepts the job and dropped when the job's task ends, however it ends (a panic too):
//! a job never stays listed in heartbeats, nor keeps a slot, after its task is gone.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_nats::jetstream::{self, kv};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::ewma_store::EwmaStore;
use crate::load_tracker::LoadTracker;
use crate::metrics::AgentMetrics;
use crate::model_client::ModelClient;

/// A job the agent holds.
pub(crate) struct Held {
    /// Fired by its client's `cancel.<tenant>.<job_id>`.
    pub cancel: CancellationToken,
    /// The job's tenant: a cancel naming another tenant is not the job's client's.
    pub tenant: Option<String>,
    /// Fired when the leader revokes this attempt (`control.<worker_id>.revoke`).
    pub revoke: CancellationToken,
    /// Fired when the leader declared this worker dead while the job ran: it ends with
    /// `worker_lost`, as the leader has told its client.
    pub lost: CancellationToken,
    /// Set once the job is reported and starting (before that, the fence refuses it).
    pub started: std::sync::atomic::AtomicBool,
    pub attempt: u32,
    /// The job's prompt estimate: prefill ahead of the jobs placed here after it, from the
    /// moment the agent takes it, though the model server sees it only once started.
    pub prompt_tokens: u32,
}

impl Held {
    /// Whether the job still waits to start here: taken, neither started nor settled by
    /// the leader (revoked or lost jobs will not start).
    fn waits_to_start(&self) -> bool {
        !self.started.load(Ordering::SeqCst)
            && !self.revoke.is_cancelled()
            && !self.lost.is_cancelled()
    }
}

/// Prompt tokens of the held jobs that wait to start ([`Held::waits_to_start`]).
fn unstarted_prompt_tokens(in_flight: &BTreeMap<String, Held>) -> u64 {
    in_flight
        .values()
        .filter(|h| h.waits_to_start())
        .map(|h| u64::from(h.prompt_tokens))
        .sum()
}

/// State shared by the intake, the runners and the heartbeat.
pub(crate) struct Shared {
    pub config: Config,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub model: Arc<dyn ModelClient>,
    pub ewma: Option<EwmaStore>,
    pub metrics: Arc<AgentMetrics>,
    /// What the model server is running for this agent (the performance model's features).
    pub load: Mutex<LoadTracker>,
    /// This worker's performance model, fitted from its completed jobs.
    pub perf: Mutex<metronome_scheduler::perf::PerfModel>,
    /// The performance model changed: the persister saves it.
    pub perf_changed: Notify,
    pub in_flight: Mutex<BTreeMap<String, Held>>,
    pub max_epoch: AtomicU64,
    /// The `leader` bucket: a new, higher epoch is checked against the lease.
    pub leader: kv::Store,
    pub draining: AtomicBool,
    /// A slot was freed: the intake may pull again.
    pub slot_freed: Notify,
    /// Something the dispatcher should learn at once happened (draining started).
    pub heartbeat_now: Notify,
    /// Fired when the drain timeout passes: running jobs end with an error.
    pub abort: CancellationToken,
    /// Bumped (under the `in_flight` lock) each time a job is accepted.
    pub accepted_generation: AtomicU64,
    /// Jobs that ended after being started on the model server: the heartbeat takes those
    /// that ended since the last metrics scrape off the server's running count.
    pub ended_on_server: AtomicU64,
    /// Highest `accepted_generation` a successfully stored heartbeat has covered.
    pub reported_generation: tokio::sync::watch::Sender<u64>,
    /// Raised while heartbeats are not being stored: nothing is pulled or started.
    pub fence: crate::fence::Fence,
    /// Jobs the last stored heartbeat of this worker's previous run listed: that run may
    /// have started them and streamed part of their output.
    pub reported_before_restart: std::collections::HashSet<String>,
    /// Recent revocations, so an assignment delivered before its revocation but read after
    /// it (a stopped agent reads both on waking) is not started either. Bounded.
    pub revoked: Mutex<std::collections::VecDeque<metronome_protocol::RevokedJob>>,
    /// Recently ended attempts `(job id, attempt)`: a redelivery of one (its WORK ack was
    /// lost, e.g. in a NATS restart) is acknowledged, not refused, since refusing would make
    /// the dispatcher run a finished job again. Bounded.
    pub ended: Mutex<std::collections::VecDeque<(String, u32)>>,
    /// Latest probe results (model server health, load, GPU), which the heartbeat sends.
    pub probes: Arc<crate::probe::ProbeCache>,
}

impl Shared {
    /// A job could not reach the model server, or lost it mid-stream: report the worker
    /// unhealthy at once, so the dispatcher stops sending it work now rather than after the
    /// next health probe (each job sent meanwhile would fail the same way). The health
    /// probe reports it healthy again once the server answers.
    pub fn model_server_lost(&self) {
        if self.probes.mark_unhealthy() {
            tracing::warn!(
                "the model server does not answer: reporting this worker unhealthy until it does"
            );
            self.heartbeat_now.notify_one();
        }
    }

    /// Whether this run of the agent holds `job_id` (taken, running or waiting to start).
    pub fn holds(&self, job_id: &str) -> bool {
        self.in_flight
            .lock()
            .expect("in_flight lock")
            .contains_key(job_id)
    }

    pub fn running(&self) -> usize {
        self.in_flight.lock().expect("in_flight lock").len()
    }

    /// The jobs this worker holds for the leader: revoked or lost ones, still stopping, are
    /// no longer its (the leader settled them), so a heartbeat does not list them.
    pub fn in_flight_ids(&self) -> Vec<String> {
        self.in_flight
            .lock()
            .expect("in_flight lock")
            .iter()
            .filter(|(_, held)| !held.revoke.is_cancelled() && !held.lost.is_cancelled())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The leader deleted this worker's heartbeat key: it declared the worker dead and has
    /// settled every job the worker held (retried the ones it never saw reported, failed
    /// the others to their clients with `worker_lost`). Running jobs stop and end with
    /// `worker_lost` (the same final result: RESULTS keeps one per job); the fence rises as
    /// after a gap, so a job taken but not started is refused once reported, not started.
    /// Returns how many running jobs were stopped.
    pub fn given_away(&self) -> usize {
        self.fence.given_away();
        let map = self.in_flight.lock().expect("in_flight lock");
        let mut n = 0;
        for (job_id, held) in map.iter() {
            if held.started.load(Ordering::SeqCst) && !held.lost.is_cancelled() {
                tracing::warn!(%job_id, attempt = held.attempt, "the leader declared this worker dead while the job ran: stopping it as lost");
                held.lost.cancel();
                n += 1;
            }
        }
        n
    }

    /// Prompt tokens of held jobs that have not produced their first token: those on the
    /// model server (the load tracker's) and those waiting to start. The second matter
    /// because the heartbeat that reports a job lists it as held before it starts, and the
    /// dispatcher then takes the pending prefill reported for the worker as covering it.
    pub fn prefill_pending_tokens(&self) -> u64 {
        // `started` is set before the tracker hears of the job: counted once, or (for an
        // instant) not at all, never twice. The locks are taken one after the other.
        let waiting = unstarted_prompt_tokens(&self.in_flight.lock().expect("in_flight lock"));
        let on_server = self
            .load
            .lock()
            .expect("load lock")
            .pending_prefill_tokens();
        on_server + waiting
    }

    pub fn perf_coefficients(&self) -> metronome_protocol::PerfCoefficients {
        self.perf.lock().expect("perf lock").coefficients()
    }

    /// Stop the held jobs `revoke` covers; returns how many were held.
    pub fn revoke(&self, revoke: &metronome_protocol::Revoke) -> usize {
        let highest = self.max_epoch.load(Ordering::SeqCst);
        if revoke.epoch < highest {
            tracing::warn!(
                epoch = revoke.epoch,
                highest_epoch = highest,
                "revocation from a deposed leader ignored"
            );
            return 0;
        }
        {
            let mut recent = self.revoked.lock().expect("revoked lock");
            for r in &revoke.jobs {
                if recent.len() >= RECENT_KEPT {
                    recent.pop_front();
                }
                recent.push_back(r.clone());
            }
        }
        let map = self.in_flight.lock().expect("in_flight lock");
        let mut n = 0;
        for r in &revoke.jobs {
            if let Some(held) = map
                .get(&r.job_id)
                .filter(|h| r.covers(&r.job_id, h.attempt))
            {
                tracing::warn!(job_id = %r.job_id, attempt = held.attempt, epoch = revoke.epoch, reason = %revoke.reason, "revoked by the leader: stopping without a result");
                held.revoke.cancel();
                n += 1;
            }
        }
        n
    }

    /// Remember that this attempt ended here (ran, was refused or revoked).
    pub fn remember_ended(&self, job_id: &str, attempt: u32) {
        let mut ended = self.ended.lock().expect("ended lock");
        if ended.len() >= RECENT_KEPT {
            ended.pop_front();
        }
        ended.push_back((job_id.to_string(), attempt));
    }

    /// Whether a revocation already received covers this attempt.
    pub fn was_revoked(&self, job_id: &str, attempt: u32) -> bool {
        self.revoked
            .lock()
            .expect("revoked lock")
            .iter()
            .any(|r| r.covers(job_id, attempt))
    }

    fn release(&self, job_id: &str) {
        let left = {
            let mut map = self.in_flight.lock().expect("in_flight lock");
            if map
                .remove(job_id)
                .is_some_and(|h| h.started.load(Ordering::SeqCst))
            {
                self.ended_on_server.fetch_add(1, Ordering::SeqCst);
            }
            map.len()
        };
        self.metrics.running_jobs.set(left as u64);
        self.slot_freed.notify_one();
    }
}

/// Revocations and ended attempts remembered for assignments read after them.
pub(crate) const RECENT_KEPT: usize = 4096;

/// A held job's place in [`Shared::in_flight`]: dropped when the job's task ends, it
/// remembers the attempt as ended and frees the slot.
pub(crate) struct InFlight {
    shared: Arc<Shared>,
    job_id: String,
    attempt: u32,
}

impl InFlight {
    /// The guard of a job the intake has just put in `in_flight`.
    pub fn new(shared: Arc<Shared>, job_id: String, attempt: u32) -> InFlight {
        InFlight {
            shared,
            job_id,
            attempt,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.remember_ended(&self.job_id, self.attempt);
        self.shared.release(&self.job_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(prompt_tokens: u32) -> Held {
        Held {
            cancel: CancellationToken::new(),
            tenant: None,
            revoke: CancellationToken::new(),
            lost: CancellationToken::new(),
            started: AtomicBool::new(false),
            attempt: 1,
            prompt_tokens,
        }
    }

    #[test]
    fn only_the_held_jobs_that_will_still_start_count_as_waiting_prefill() {
        let mut map = BTreeMap::new();
        map.insert("waiting".to_string(), held(100));
        let started = held(200);
        started.started.store(true, Ordering::SeqCst);
        map.insert("started".to_string(), started);
        let revoked = held(400);
        revoked.revoke.cancel();
        map.insert("revoked".to_string(), revoked);
        let lost = held(800);
        lost.lost.cancel();
        map.insert("lost".to_string(), lost);
        map.insert("also waiting".to_string(), held(1_600));
        assert_eq!(unstarted_prompt_tokens(&map), 1_700);
    }
}
