//! The state the agent's tasks share ([`Shared`]): the intake ([`crate::agent`]), the
//! runners ([`crate::runner`]), the heartbeat, the control subscriptions and the probes
//! all read it, and none of them imports another for it.
//!
//! Every decision about a job is the [`JobMachine`]'s; `Shared` holds it behind one lock
//! together with the mailbox of each held job's task, and routes the machine's effects:
//! those about a held job to its task (which owns the WORK message and performs them),
//! the others (fence, notices, heartbeat requests) to the metrics, the log and the
//! heartbeat loop. A held job's task holds its [`Slot`], dropped when the task ends,
//! however it ends (a panic too): a job never stays listed in heartbeats, nor keeps a
//! slot, after its task is gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_nats::jetstream::{self, kv};
use tokio::sync::{mpsc, watch, Notify};

use crate::config::Config;
use crate::ewma_store::EwmaStore;
use crate::lifecycle::{Effect, FenceMove, JobMachine, Notice};
use crate::metrics::AgentMetrics;
use crate::model_client::ModelClient;

/// The effects about one held job, delivered to its task.
pub(crate) type Mailbox = mpsc::UnboundedReceiver<Effect>;

/// The machine and the held jobs' mailboxes, under one lock: an effect the machine emits
/// for a job always finds the job's mailbox.
struct Jobs {
    machine: JobMachine,
    mailboxes: HashMap<String, mpsc::UnboundedSender<Effect>>,
}

/// State shared by the intake, the runners and the heartbeat.
pub(crate) struct Shared {
    pub config: Config,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub model: Arc<dyn ModelClient>,
    /// Request fields allowed besides OpenAI's (`Config::request_extras`, read once).
    pub request_extras: Vec<String>,
    pub ewma: Option<EwmaStore>,
    pub metrics: Arc<AgentMetrics>,
    /// This worker's performance model, fitted from its completed jobs.
    pub perf: Mutex<metronome_scheduler::perf::PerfModel>,
    /// The performance model changed: the persister saves it.
    pub perf_changed: Notify,
    /// The `leader` bucket: a new, higher epoch is checked against the lease.
    pub leader: kv::Store,
    /// A slot was freed: the intake may pull again.
    pub slot_freed: Notify,
    /// Something the dispatcher should learn at once happened (a job taken, draining).
    pub heartbeat_now: Notify,
    /// Bumped on every stored heartbeat: a fenced intake waits for it.
    pub stored: watch::Sender<u64>,
    /// Latest probe results (model server health, load, GPU), which the heartbeat sends.
    pub probes: Arc<crate::probe_cache::ProbeCache>,
    jobs: Mutex<Jobs>,
}

/// The time the machine is given: tokio's clock, so a paused test clock is the machine's.
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// What [`Shared`] is built from, besides its job machine.
pub(crate) struct Parts {
    pub config: Config,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub model: Arc<dyn ModelClient>,
    pub ewma: Option<EwmaStore>,
    pub metrics: Arc<AgentMetrics>,
    pub perf: metronome_scheduler::perf::PerfModel,
    pub leader: kv::Store,
    pub probes: Arc<crate::probe_cache::ProbeCache>,
}

impl Shared {
    pub fn new(parts: Parts, machine: JobMachine) -> Shared {
        Shared {
            request_extras: parts.config.request_extras(),
            config: parts.config,
            client: parts.client,
            js: parts.js,
            model: parts.model,
            ewma: parts.ewma,
            metrics: parts.metrics,
            perf: Mutex::new(parts.perf),
            perf_changed: Notify::new(),
            leader: parts.leader,
            slot_freed: Notify::new(),
            heartbeat_now: Notify::new(),
            stored: watch::channel(0).0,
            probes: parts.probes,
            jobs: Mutex::new(Jobs {
                machine,
                mailboxes: HashMap::new(),
            }),
        }
    }

    /// Read or query the machine.
    pub fn machine<R>(&self, f: impl FnOnce(&mut JobMachine) -> R) -> R {
        f(&mut self.jobs.lock().expect("jobs lock").machine)
    }

    /// An assignment's event: its effects go back to the caller, who holds the delivery.
    /// When the machine takes the job, its mailbox is opened in the same step, so an
    /// effect emitted for it right after (a heartbeat stored at once) finds it.
    pub fn assign(
        &self,
        f: impl FnOnce(&mut JobMachine) -> Vec<Effect>,
    ) -> (Vec<Effect>, Option<Mailbox>) {
        let mut jobs = self.jobs.lock().expect("jobs lock");
        let effects = f(&mut jobs.machine);
        let mut mailbox = None;
        for e in &effects {
            if let Effect::Hold { job_id } = e {
                let (tx, rx) = mpsc::unbounded_channel();
                jobs.mailboxes.insert(job_id.clone(), tx);
                mailbox = Some(rx);
            }
        }
        self.metrics.running_jobs.set(jobs.machine.held() as u64);
        (effects, mailbox)
    }

    /// An event about held jobs: each effect about a job goes to its task, the others are
    /// performed here. Returns how many went to jobs' tasks.
    pub fn dispatch(&self, f: impl FnOnce(&mut JobMachine) -> Vec<Effect>) -> usize {
        let mut general = Vec::new();
        let mut routed = 0;
        {
            let mut jobs = self.jobs.lock().expect("jobs lock");
            for effect in f(&mut jobs.machine) {
                let job_id = match &effect {
                    Effect::Start { job_id }
                    | Effect::Stop { job_id, .. }
                    | Effect::Refuse { job_id, .. }
                    | Effect::Ack { job_id, .. } => job_id.clone(),
                    _ => {
                        general.push(effect);
                        continue;
                    }
                };
                match jobs.mailboxes.get(&job_id) {
                    Some(tx) if tx.send(effect).is_ok() => routed += 1,
                    _ => {
                        tracing::warn!(%job_id, "an effect for a job whose task has ended dropped")
                    }
                }
            }
        }
        for effect in general {
            self.perform(effect);
        }
        routed
    }

    /// Perform an effect that concerns no single delivery: the fence's gauge, notices,
    /// a heartbeat request.
    pub fn perform(&self, effect: Effect) {
        let m = &self.metrics;
        match effect {
            Effect::Heartbeat => self.heartbeat_now.notify_one(),
            Effect::Fence(FenceMove::RaisedOverdue) => {
                m.fenced.set(1);
                m.fence_episodes.inc();
                tracing::warn!(
                    fence_after_ms = self.config.fence_after_ms,
                    "no heartbeat stored for longer than the fence timeout: fenced (no new work)"
                );
            }
            Effect::Fence(FenceMove::RaisedGivenAway) => {
                m.fenced.set(1);
                m.fence_episodes.inc();
            }
            Effect::Fence(FenceMove::Lowered { silent }) => {
                m.fenced.set(0);
                tracing::info!(
                    silent_ms = silent.as_millis() as u64,
                    "heartbeat stored again: fence lowered"
                );
            }
            Effect::Notice { job_id, notice } => match notice {
                Notice::Revoked => {
                    m.revoked_jobs.inc();
                    tracing::warn!(%job_id, "revoked by the leader: stopped without a result");
                }
                Notice::DuplicateIgnored => {
                    // The running copy acknowledges it.
                    tracing::info!(%job_id, "redelivery of a running job ignored");
                }
                Notice::AlreadyEnded => {
                    tracing::info!(%job_id, "redelivery of an attempt that already ended: acknowledged");
                }
                Notice::CancelOfAnotherTenant => {
                    m.cancels_of_another_tenant.inc();
                    tracing::warn!(%job_id, "ignoring a cancel that names another tenant than the job's");
                }
                Notice::CancelNotHeld => tracing::debug!(%job_id, "cancel of a job not held here"),
                Notice::StaleRevocation => {
                    tracing::warn!("revocation from a deposed leader ignored")
                }
            },
            other => tracing::error!(effect = ?other, "a job's effect reached no job"),
        }
    }

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

    /// Jobs held (taken, running or being published).
    pub fn running(&self) -> usize {
        self.machine(|m| m.held())
    }

    /// The jobs this worker holds for the leader (what a heartbeat lists).
    pub fn in_flight_ids(&self) -> Vec<String> {
        self.machine(|m| m.in_flight_ids())
    }

    pub fn draining(&self) -> bool {
        self.machine(|m| m.draining())
    }

    /// Start or stop draining; whether it was draining.
    pub fn set_draining(&self, draining: bool) -> bool {
        let was = self.machine(|m| m.set_draining(draining));
        self.metrics.draining.set(u64::from(draining));
        was
    }

    pub fn perf_coefficients(&self) -> metronome_protocol::PerfCoefficients {
        self.perf.lock().expect("perf lock").coefficients()
    }

    fn release(&self, job_id: &str) {
        let left = {
            let mut jobs = self.jobs.lock().expect("jobs lock");
            jobs.machine.release(job_id, now());
            jobs.mailboxes.remove(job_id);
            jobs.machine.held()
        };
        self.metrics.running_jobs.set(left as u64);
        self.slot_freed.notify_one();
    }
}

/// A held job's slot: dropped when the job's task ends, it releases the job (the machine
/// remembers the attempt as ended) and frees the slot.
pub(crate) struct Slot {
    shared: Arc<Shared>,
    job_id: String,
}

impl Slot {
    /// The slot of a job the machine has just taken.
    pub fn new(shared: Arc<Shared>, job_id: String) -> Slot {
        Slot { shared, job_id }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.shared.release(&self.job_id);
    }
}
