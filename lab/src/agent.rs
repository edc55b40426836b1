//! One worker-agent and its GPU in simulated time, driven by the real agent's job
//! lifecycle: the worker-agent's [`JobMachine`] decides what is taken, when it starts
//! (once a heartbeat listing it was stored: the agent's no-double-run rule, so the
//! hand-over costs a heartbeat put, as it does live), what a heartbeat says about the jobs
//! and what a finished job measured. This file only performs its effects on a simulated
//! GPU and in simulated time.
//!
//! - Its heartbeats carry the latest probe of the server's metrics (running, waiting, KV
//!   usage: sampled once per heartbeat interval, so up to an interval old), the pending
//!   prefill tokens and the fitted performance model's coefficients.
//! - Every completed job feeds the machine's load-tracker sample to the [`PerfModel`] and
//!   folds its timings into the worker's EWMAs the way the Redis script does.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metronome_gpu_sim::engine::{Emitted, SeqId};
use metronome_gpu_sim::SimGpuConfig;
use metronome_protocol::{Job, KvUsage, WorkerStatus, PROTOCOL_VERSION};
use metronome_scheduler::ewma;
use metronome_scheduler::perf::{PerfModel, PerfPrior};
use metronome_scheduler::EwmaSnapshot;
use metronome_worker_agent::lifecycle::{Assigned, Effect, Ending, JobMachine, Lease, Settings};

use crate::gpu::Gpu;

/// The lab's side of a held job: what the simulated GPU needs to run it.
#[derive(Debug, Clone)]
struct Sim {
    job: Arc<Job>,
    attempt: u32,
    /// Tokens it will write (its `max_tokens` or fewer: where the model stops).
    writes: u32,
    tokens: u32,
    /// Prefill time of the steps that produced its tokens after the first: how long its
    /// decode stood still for other jobs' prompts.
    stall_ms: f64,
}

/// What the agent tells the world about a finished job.
#[derive(Debug, Clone)]
pub struct Finished {
    pub job: Arc<Job>,
    pub attempt: u32,
    pub output_tokens: u32,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    /// From the agent taking the job to its end.
    pub e2e_ms: f64,
    pub stall_ms: f64,
}

/// An assignment the agent handed back to the dispatcher.
#[derive(Debug, Clone)]
pub struct Refused {
    pub job: Arc<Job>,
    pub attempt: u32,
    pub reason: String,
    pub carry_job: bool,
}

/// What the agent's probe last read from its server.
#[derive(Debug, Clone, Copy, Default)]
struct Probed {
    running: u32,
    waiting: u32,
    kv_used_frac: f64,
    /// The machine's count of jobs that ended on the server, at the probe.
    ended_at_scrape: u64,
}

/// An EWMA hash as the Redis script keeps it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Average {
    pub value: Option<f64>,
    pub updated_ms: Option<f64>,
    pub samples: u64,
}

impl Average {
    /// Fold one sample in at `now_ms`: the first sets it; later ones weigh more the longer
    /// the average went without one.
    pub fn fold(&mut self, sample: f64, alpha: f64, half_life_ms: f64, now_ms: f64) {
        let a = match self.updated_ms {
            None => 1.0,
            Some(t) => ewma::decayed_alpha(alpha, half_life_ms, now_ms - t),
        };
        self.value = Some(ewma::update(self.value, sample, a));
        self.updated_ms = Some(now_ms);
        self.samples += 1;
    }
}

/// One agent and its GPU.
pub struct Agent {
    pub worker_id: String,
    pub model: String,
    pub gpu_index: u32,
    pub gpu: Gpu,
    max_concurrency: u32,
    ewma_alpha: f64,
    ewma_half_life_ms: f64,
    /// The agent's job lifecycle, the worker-agent's own.
    machine: JobMachine,
    sims: HashMap<String, Sim>,
    by_seq: HashMap<SeqId, String>,
    next_seq_id: SeqId,
    perf: PerfModel,
    ewma: [Average; 4],
    heartbeat_seq: u64,
    probed: Probed,
    /// Simulated time zero as an `Instant`, for the machine's timestamps.
    origin: Instant,
    origin_unix_ms: u64,
}

impl Agent {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        worker_id: String,
        gpu_index: u32,
        gpu: &SimGpuConfig,
        agent: &metronome_worker_agent::Config,
        prior: &PerfPrior,
        origin: Instant,
        origin_unix_ms: u64,
        kv_events: bool,
    ) -> Agent {
        let machine = JobMachine::new(
            Settings {
                worker_id: worker_id.clone(),
                max_concurrency: agent.max_concurrency,
                fence_after: agent.fence_after(),
                reported_before_restart: HashSet::new(),
            },
            origin,
        );
        Agent {
            worker_id,
            model: gpu.model.clone(),
            gpu_index,
            gpu: Gpu::new(gpu, kv_events),
            max_concurrency: agent.max_concurrency,
            ewma_alpha: agent.ewma_alpha,
            ewma_half_life_ms: agent.ewma_half_life_ms as f64,
            machine,
            sims: HashMap::new(),
            by_seq: HashMap::new(),
            next_seq_id: 0,
            perf: PerfModel::new(prior),
            ewma: [Average::default(); 4],
            heartbeat_seq: 0,
            probed: Probed::default(),
            origin,
            origin_unix_ms,
        }
    }

    /// The jobs the GPU admitted since the last call, each with its prompt tokens found
    /// in the prefix cache (call before [`Agent::step_done`], which forgets finished
    /// sequences).
    pub fn take_prefix_hits(&mut self) -> Vec<(String, u32)> {
        self.gpu
            .take_prefix_hits()
            .into_iter()
            .filter_map(|(seq, tokens)| self.by_seq.get(&seq).map(|j| (j.clone(), tokens)))
            .collect()
    }

    fn instant(&self, ms: f64) -> Instant {
        self.origin + Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }

    /// An assignment arrived at `now_ms`. Returns whether the agent asks for a heartbeat
    /// (it took the job), and the refusal if it handed the job back.
    pub fn accept(
        &mut self,
        job: Arc<Job>,
        attempt: u32,
        epoch: u64,
        cached_tokens: u32,
        writes: u32,
        now_ms: f64,
    ) -> (bool, Option<Refused>) {
        let assigned = Assigned {
            job_id: job.id.clone(),
            attempt,
            epoch,
            worker_id: self.worker_id.clone(),
            tenant: job.tenant.clone(),
            prompt_tokens: job.prompt_tokens,
            cached_tokens,
            delivered: 1,
        };
        // The lab's one leader holds the lease of every epoch it assigns with.
        let lease = if self.machine.needs_lease(epoch) {
            Lease::Vouches
        } else {
            Lease::NotRead
        };
        let at = self.instant(now_ms);
        let mut beat = false;
        let mut refused = None;
        for effect in self.machine.assigned(&assigned, lease, at) {
            match effect {
                Effect::Hold { job_id } => {
                    self.sims.insert(
                        job_id,
                        Sim {
                            job: job.clone(),
                            attempt,
                            writes: writes.max(1),
                            tokens: 0,
                            stall_ms: 0.0,
                        },
                    );
                }
                Effect::Heartbeat => beat = true,
                Effect::Refuse {
                    reason, carry_job, ..
                } => {
                    refused = Some(Refused {
                        job: job.clone(),
                        attempt,
                        reason,
                        carry_job,
                    })
                }
                // No WORK stream, no previous run, no revocation in the lab.
                _ => {}
            }
        }
        (beat, refused)
    }

    /// Read the server's metrics (the probe loop).
    pub fn probe(&mut self) {
        let s = self.gpu.stats();
        self.probed = Probed {
            running: s.running,
            waiting: s.waiting,
            kv_used_frac: s.kv_usage(),
            ended_at_scrape: self.machine.ended_on_server(),
        };
    }

    /// Build a heartbeat at `now_ms`; with it, the take count it covers.
    pub fn heartbeat(&mut self, now_ms: f64) -> (WorkerStatus, u64) {
        self.heartbeat_seq += 1;
        let jobs = self
            .machine
            .heartbeat(Some(self.probed.running), self.probed.ended_at_scrape);
        let status = WorkerStatus {
            v: PROTOCOL_VERSION,
            worker_id: self.worker_id.clone(),
            model: self.model.clone(),
            node: None,
            gpu_index: Some(self.gpu_index),
            healthy: true,
            draining: jobs.draining,
            max_concurrency: self.max_concurrency,
            active: jobs.active,
            queued: self.probed.waiting,
            in_flight: jobs.in_flight,
            kv: Some(KvUsage {
                used_frac: self.probed.kv_used_frac,
                capacity_tokens: Some(self.gpu.capacity_tokens()),
            }),
            gpu: None,
            prefill_pending_tokens: jobs.prefill_pending_tokens,
            perf: Some(self.perf.coefficients()),
            decoding: self.machine.live_decode(self.instant(now_ms)),
            max_epoch: jobs.max_epoch,
            seq: self.heartbeat_seq,
            sent_ms: self.origin_unix_ms + now_ms as u64,
        };
        (status, jobs.generation)
    }

    /// A heartbeat covering take count `generation` was stored at `now_ms`: the jobs it
    /// reported start on the GPU (or are refused, had the agent been fenced). Returns when
    /// the GPU's next step ends, if it starts one, and the refusals.
    pub fn start_reported(&mut self, generation: u64, now_ms: f64) -> (Option<f64>, Vec<Refused>) {
        let at = self.instant(now_ms);
        let mut refused = Vec::new();
        for effect in self.machine.reported(generation, at) {
            match effect {
                Effect::Start { job_id } => {
                    let sim = self.sims.get(&job_id).expect("started jobs are held");
                    let seq_id = self.next_seq_id;
                    self.next_seq_id += 1;
                    self.by_seq.insert(seq_id, job_id.clone());
                    // A job with a prefix fingerprint carries its prompt's token ids (the
                    // world's prefix-heavy workloads): the GPU's prefix cache reuses what it
                    // holds of them and prefills the rest. Others are anonymous prompts.
                    let added = match prompt_ids(&sim.job) {
                        Some(ids) => self.gpu.add_prompt(seq_id, ids, sim.writes),
                        None => self.gpu.add(seq_id, sim.job.prompt_tokens, sim.writes),
                    };
                    debug_assert!(added, "the dispatcher placed a job its GPU cannot hold");
                }
                Effect::Refuse {
                    job_id,
                    reason,
                    carry_job,
                    ..
                } => {
                    self.machine.release(&job_id, at);
                    if let Some(sim) = self.sims.remove(&job_id) {
                        refused.push(Refused {
                            job: sim.job,
                            attempt: sim.attempt,
                            reason,
                            carry_job,
                        });
                    }
                }
                _ => {}
            }
        }
        (self.gpu.kick(now_ms), refused)
    }

    /// The GPU's step ended at `now_ms`: relay its tokens. Returns the jobs that finished,
    /// the tokens that were first tokens (job ids) and when the next step ends.
    pub fn step_done(&mut self, now_ms: f64) -> (Vec<Finished>, Vec<String>, Option<f64>) {
        let at = self.instant(now_ms);
        let (tokens, step_stall_ms): (Vec<Emitted>, f64) = self.gpu.finish_step();
        let mut finished = Vec::new();
        let mut first = Vec::new();
        for t in tokens {
            let Some(id) = self.by_seq.get(&t.id).cloned() else {
                continue;
            };
            let Some(sim) = self.sims.get_mut(&id) else {
                continue;
            };
            let first_chunk = self
                .machine
                .chunk(&id, true, at)
                .iter()
                .any(|e| matches!(e, Effect::PublishChunk { seq: 0, .. }));
            if first_chunk {
                first.push(id.clone());
            } else {
                sim.stall_ms += step_stall_ms;
            }
            sim.tokens += 1;
            if t.finished {
                finished.push(self.finish(&id, t.id, now_ms));
            }
        }
        (finished, first, self.gpu.kick(now_ms))
    }

    fn finish(&mut self, id: &str, seq_id: SeqId, now_ms: f64) -> Finished {
        let sim = self.sims.remove(id).expect("finished job is held");
        self.by_seq.remove(&seq_id);
        let at = self.instant(now_ms);
        let effects = self
            .machine
            .finish(id, Ending::Done, sim.job.prompt_tokens, sim.tokens, at);
        self.machine.release(id, at);
        let mut event = None;
        for effect in effects {
            match effect {
                Effect::Learn { sample, perf, .. } => {
                    if let Some(perf_sample) = perf {
                        self.perf.observe(&perf_sample);
                    }
                    self.fold_ewmas(
                        [sample.ttft_ms, sample.tpot_ms, sample.tok_s, sample.e2e_ms],
                        now_ms,
                    );
                }
                Effect::PublishCompletion { event: e, .. } => event = Some(e),
                _ => {}
            }
        }
        let event = event.expect("a job that ran to its end is published");
        Finished {
            job: sim.job,
            attempt: sim.attempt,
            output_tokens: sim.tokens,
            ttft_ms: event.ttft_ms,
            tpot_ms: event.tpot_ms,
            e2e_ms: event.e2e_ms,
            stall_ms: sim.stall_ms,
        }
    }

    /// One script call updates every field with the hash's one update time.
    fn fold_ewmas(&mut self, values: [Option<f64>; 4], now_ms: f64) {
        let (alpha, half) = (self.ewma_alpha, self.ewma_half_life_ms);
        let a = match self.ewma[0].updated_ms {
            None => 1.0,
            Some(t) => ewma::decayed_alpha(alpha, half, now_ms - t),
        };
        for (avg, v) in self.ewma.iter_mut().zip(values) {
            if let Some(v) = v {
                avg.value = Some(ewma::update(avg.value, v, a));
            }
            avg.updated_ms = Some(now_ms);
            avg.samples += 1;
        }
    }

    /// The worker's EWMAs as the dispatcher reads them from Redis.
    pub fn ewma_snapshot(&self) -> Option<EwmaSnapshot> {
        let [ttft, tpot, tok_s, e2e] = self.ewma;
        (ttft.samples > 0).then(|| EwmaSnapshot {
            ttft_ms: ttft.value.unwrap_or(0.0),
            tpot_ms: tpot.value.unwrap_or(0.0),
            tok_s: tok_s.value.unwrap_or(0.0),
            e2e_ms: e2e.value.unwrap_or(0.0),
            samples: ttft.samples,
            updated_ms: self.origin_unix_ms + ttft.updated_ms.unwrap_or(0.0) as u64,
        })
    }

    /// EWMA settings, for the model's output-length average.
    pub fn ewma_settings(&self) -> (f64, f64) {
        (self.ewma_alpha, self.ewma_half_life_ms)
    }

    /// Jobs held (taken, started or streaming).
    pub fn held(&self) -> usize {
        self.machine.held()
    }

    /// The highest leader epoch the agent has seen.
    pub fn max_epoch(&self) -> u64 {
        self.machine.max_epoch()
    }
}

/// The token ids a job's request gives as a completion prompt, when the job carries a
/// prefix fingerprint (the world puts them there, as a gateway would forward them).
fn prompt_ids(job: &Job) -> Option<Vec<u32>> {
    job.prefix.as_ref()?;
    metronome_protocol::prefix::request_token_ids(
        metronome_protocol::Endpoint::Completion,
        &job.request,
    )
    .ok()
}
