//! One worker-agent and its GPU in simulated time: what the real agent measures and
//! reports, computed by the real agent's code where it is pure.
//!
//! - Jobs it accepts are held and listed in heartbeats; a job starts on the GPU only once a
//!   heartbeat listing it was stored (the agent's no-double-run rule), so the hand-over
//!   costs a heartbeat put, as it does live.
//! - Its heartbeats carry the latest probe of the server's metrics (running, waiting, KV
//!   usage: sampled once per heartbeat interval, so up to an interval old), the pending
//!   prefill tokens and the fitted performance model's coefficients.
//! - Every completed job feeds the [`LoadTracker`] sample to the [`PerfModel`] and folds
//!   its timings into the worker's EWMAs the way the Redis script does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metronome_gpu_sim::engine::{Emitted, SeqId};
use metronome_gpu_sim::SimGpuConfig;
use metronome_protocol::{Job, KvUsage, WorkerStatus, PROTOCOL_VERSION};
use metronome_scheduler::ewma;
use metronome_scheduler::perf::{PerfModel, PerfPrior};
use metronome_scheduler::EwmaSnapshot;
use metronome_worker_agent::load_tracker::{LoadTracker, Measured};
use metronome_worker_agent::runner::{measure, Timing};

use crate::gpu::Gpu;

/// A job the agent holds.
#[derive(Debug, Clone)]
pub struct Held {
    pub job: Arc<Job>,
    pub attempt: u32,
    /// Tokens it will write (its `max_tokens` or fewer: where the model stops).
    writes: u32,
    /// Accept counter value when it was taken: a heartbeat built after it reports it.
    generation: u64,
    seq_id: Option<SeqId>,
    pub started_ms: Option<f64>,
    pub first_token_ms: Option<f64>,
    pub last_token_ms: Option<f64>,
    pub tokens: u32,
    /// Prefill time of the steps that produced its tokens after the first: how long its
    /// decode stood still for other jobs' prompts.
    pub stall_ms: f64,
}

/// What the agent tells the world about a finished job.
#[derive(Debug, Clone)]
pub struct Finished {
    pub job: Arc<Job>,
    pub attempt: u32,
    pub started_ms: f64,
    pub first_token_ms: f64,
    pub last_token_ms: f64,
    pub output_tokens: u32,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub stall_ms: f64,
}

/// What the agent's probe last read from its server.
#[derive(Debug, Clone, Copy, Default)]
struct Probed {
    running: u32,
    waiting: u32,
    kv_used_frac: f64,
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
    /// Held jobs in the order they were accepted (heartbeats list them so).
    order: Vec<String>,
    held: HashMap<String, Held>,
    by_seq: HashMap<SeqId, String>,
    next_seq_id: SeqId,
    tracker: LoadTracker,
    perf: PerfModel,
    ewma: [Average; 4],
    heartbeat_seq: u64,
    pub max_epoch: u64,
    accepted_generation: u64,
    probed: Probed,
    /// Simulated time zero as an `Instant`, for the tracker's timestamps.
    origin: Instant,
    origin_unix_ms: u64,
}

impl Agent {
    pub fn new(
        worker_id: String,
        gpu_index: u32,
        gpu: &SimGpuConfig,
        agent: &metronome_worker_agent::Config,
        prior: &PerfPrior,
        origin: Instant,
        origin_unix_ms: u64,
    ) -> Agent {
        Agent {
            worker_id,
            model: gpu.model.clone(),
            gpu_index,
            gpu: Gpu::new(gpu),
            max_concurrency: agent.max_concurrency,
            ewma_alpha: agent.ewma_alpha,
            ewma_half_life_ms: agent.ewma_half_life_ms as f64,
            order: Vec::new(),
            held: HashMap::new(),
            by_seq: HashMap::new(),
            next_seq_id: 0,
            tracker: LoadTracker::new(),
            perf: PerfModel::new(prior),
            ewma: [Average::default(); 4],
            heartbeat_seq: 0,
            max_epoch: 0,
            accepted_generation: 0,
            probed: Probed::default(),
            origin,
            origin_unix_ms,
        }
    }

    fn instant(&self, ms: f64) -> Instant {
        self.origin + Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }

    /// An assignment arrived. Returns whether it was taken (a duplicate is not).
    pub fn accept(&mut self, job: Arc<Job>, attempt: u32, epoch: u64, writes: u32) -> bool {
        if self.held.contains_key(&job.id) {
            return false;
        }
        self.max_epoch = self.max_epoch.max(epoch);
        self.accepted_generation += 1;
        self.order.push(job.id.clone());
        self.held.insert(
            job.id.clone(),
            Held {
                job,
                attempt,
                writes: writes.max(1),
                generation: self.accepted_generation,
                seq_id: None,
                started_ms: None,
                first_token_ms: None,
                last_token_ms: None,
                tokens: 0,
                stall_ms: 0.0,
            },
        );
        true
    }

    /// Read the server's metrics (the probe loop).
    pub fn probe(&mut self) {
        let s = self.gpu.stats();
        self.probed = Probed {
            running: s.running,
            waiting: s.waiting,
            kv_used_frac: s.kv_usage(),
        };
    }

    /// Build a heartbeat at `now_ms`; with it, the accept generation it covers.
    pub fn heartbeat(&mut self, now_ms: f64) -> (WorkerStatus, u64) {
        self.heartbeat_seq += 1;
        let status = WorkerStatus {
            v: PROTOCOL_VERSION,
            worker_id: self.worker_id.clone(),
            model: self.model.clone(),
            node: None,
            gpu_index: Some(self.gpu_index),
            healthy: true,
            draining: false,
            max_concurrency: self.max_concurrency,
            active: self.probed.running,
            queued: self.probed.waiting,
            in_flight: self.order.clone(),
            kv: Some(KvUsage {
                used_frac: self.probed.kv_used_frac,
                capacity_tokens: Some(self.gpu.capacity_tokens()),
            }),
            gpu: None,
            // As the agent reports it: the prompts on the server and those held, not started.
            prefill_pending_tokens: self.tracker.pending_prefill_tokens()
                + self
                    .held
                    .values()
                    .filter(|h| h.started_ms.is_none())
                    .map(|h| u64::from(h.job.prompt_tokens))
                    .sum::<u64>(),
            perf: Some(self.perf.coefficients()),
            max_epoch: self.max_epoch,
            seq: self.heartbeat_seq,
            sent_ms: self.origin_unix_ms + now_ms as u64,
        };
        (status, self.accepted_generation)
    }

    /// Start every held job a stored heartbeat covered (accepted at or before
    /// `generation`) and not started yet. Returns when the GPU's next step ends, if it
    /// starts one.
    pub fn start_reported(&mut self, generation: u64, now_ms: f64) -> Option<f64> {
        let at = self.instant(now_ms);
        for id in &self.order {
            let h = self.held.get_mut(id).expect("ordered ids are held");
            if h.started_ms.is_some() || h.generation > generation {
                continue;
            }
            let seq_id = self.next_seq_id;
            self.next_seq_id += 1;
            h.seq_id = Some(seq_id);
            h.started_ms = Some(now_ms);
            self.by_seq.insert(seq_id, id.clone());
            self.tracker.started(id, h.job.prompt_tokens, at);
            let added = self.gpu.add(seq_id, h.job.prompt_tokens, h.writes);
            debug_assert!(added, "the dispatcher placed a job its GPU cannot hold");
        }
        self.gpu.kick(now_ms)
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
            let Some(h) = self.held.get_mut(&id) else {
                continue;
            };
            if h.first_token_ms.is_none() {
                h.first_token_ms = Some(now_ms);
                self.tracker.first_token(&id, at);
                first.push(id.clone());
            } else {
                h.stall_ms += step_stall_ms;
            }
            h.last_token_ms = Some(now_ms);
            h.tokens += 1;
            self.tracker.tokens(&id, 1, at);
            if t.finished {
                finished.push(self.finish(&id, now_ms));
            }
        }
        (finished, first, self.gpu.kick(now_ms))
    }

    fn finish(&mut self, id: &str, now_ms: f64) -> Finished {
        let h = self.held.remove(id).expect("finished job is held");
        self.order.retain(|o| o != id);
        if let Some(s) = h.seq_id {
            self.by_seq.remove(&s);
        }
        let started = h.started_ms.unwrap_or(now_ms);
        let timing = Timing {
            start: self.instant(started),
            first_token: h.first_token_ms.map(|t| self.instant(t)),
            last_token: h.last_token_ms.map(|t| self.instant(t)),
        };
        let end = self.instant(now_ms);
        let sample = measure(&timing, h.tokens, end);
        let measured = Measured {
            prompt_tokens: h.job.prompt_tokens,
            output_tokens: h.tokens,
            ttft_ms: sample.ttft_ms,
            tpot_ms: sample.tpot_ms,
        };
        if let Some(perf_sample) = self.tracker.finished(id, &measured, end) {
            self.perf.observe(&perf_sample);
        }
        let values = [sample.ttft_ms, sample.tpot_ms, sample.tok_s, sample.e2e_ms];
        let (alpha, half) = (self.ewma_alpha, self.ewma_half_life_ms);
        // One script call updates every field with the hash's one update time.
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
        Finished {
            job: h.job,
            attempt: h.attempt,
            started_ms: started,
            first_token_ms: h.first_token_ms.unwrap_or(now_ms),
            last_token_ms: h.last_token_ms.unwrap_or(now_ms),
            output_tokens: h.tokens,
            ttft_ms: sample.ttft_ms,
            tpot_ms: sample.tpot_ms,
            stall_ms: h.stall_ms,
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

    /// Jobs held (accepted, started or streaming).
    pub fn held(&self) -> usize {
        self.held.len()
    }
}
