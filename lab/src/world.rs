//! The simulated cluster: a discrete-event loop over clients, the dispatcher's engine, the
//! agents and their GPUs, in simulated milliseconds.
//!
//! Each message between components takes one of the fixed hops of [`Latencies`]; each
//! periodic activity runs at its configured period (dispatcher tick and EWMA refresh,
//! agent heartbeats and probes), the agents' phases spread over the period as independent
//! processes' would be. Events at the same instant run in the order they were scheduled,
//! so a run is exactly reproducible.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use metronome_dispatcher::engine::{
    Effect, Engine, EngineSettings, Event, Incoming, Outcome, RedisSnapshot, WorkerUpdate,
};
use metronome_dispatcher::Metrics;
use metronome_gpu_sim::SimGpuConfig;
use metronome_loadgen::prefixes::message_text;
use metronome_loadgen::{ErrorKind, Message, PlannedRequest, RequestRecord};
use metronome_protocol::prefix::{chat_token_ids, PrefixFingerprint, DEFAULT_BLOCK_SIZE};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Endpoint, ErrorCode, Job, Prediction, WorkerStatus,
    PROTOCOL_VERSION,
};

use metronome_gpu_sim::block_pool::KvEvent;
use metronome_protocol::cache_state::{
    CacheUpdate, CacheUpdateKind, CACHE_UPDATE_VERSION, MAX_SNAPSHOT_BLOCKS,
};
use metronome_protocol::{CachedPrefix, PrefixSource};
use metronome_worker_agent::kv_events::{BlockIndex, EventBatch, KvCacheEvent};

use crate::agent::{Agent, Average, Finished, Refused};

/// One-way times of the hops between components, ms. Loopback NATS round trips are well
/// under a millisecond on an idle machine; these round up, so the lab errs on the slow side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latencies {
    /// Client → gateway → JOBS → dispatcher.
    pub submit_ms: f64,
    /// Dispatcher → WORK → agent.
    pub assign_ms: f64,
    /// A heartbeat put, until stored.
    pub store_ms: f64,
    /// A stored heartbeat, until the dispatcher's watch delivers it.
    pub watch_ms: f64,
    /// A token at the agent, until the client has it.
    pub relay_ms: f64,
    /// The last token, until the dispatcher has the completion event (final result, WORK
    /// ack and the event are three JetStream publishes).
    pub complete_ms: f64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            submit_ms: 2.0,
            assign_ms: 1.0,
            store_ms: 1.0,
            watch_ms: 1.0,
            relay_ms: 1.0,
            complete_ms: 3.0,
        }
    }
}

/// Everything a run is parameterised by.
#[derive(Debug, Clone)]
pub struct LabConfig {
    /// The dispatcher's configuration (its defaults are `./dev up`'s).
    pub dispatcher: metronome_dispatcher::Config,
    /// The worker-agents' configuration (the same for every agent).
    pub agent: metronome_worker_agent::Config,
    /// One simulated GPU per worker.
    pub gpus: Vec<SimGpuConfig>,
    pub latencies: Latencies,
    /// How often GPU idleness is sampled while jobs wait, ms (the bench samples every 100).
    pub sample_ms: f64,
    /// Simulated time before the first request, for every agent to register.
    pub warmup_ms: f64,
    /// What each job asks for as `max_tokens`, against the length it will write.
    pub max_tokens: MaxTokens,
    /// Tenant names by the planned requests' tenant index (empty: jobs carry no tenant).
    pub tenants: Vec<String>,
    /// Each job's deadline after its submission, ms, as the gateway sets it from its
    /// `queue_timeout_ms` (None: no deadline in the job; the dispatcher's default applies).
    pub queue_timeout_ms: Option<u64>,
    /// Whether the agents report their GPUs' prefix caches to the dispatcher (the KV
    /// events a `kv_events_endpoint` makes an agent follow: deltas every
    /// `cache_delta_interval_ms`, snapshots every `cache_snapshot_interval_ms` of the
    /// agent's configuration). Without it the dispatcher estimates the caches from its
    /// placements.
    pub cache_reports: bool,
}

/// How clients set `max_tokens`. The load generator asks for exactly the length a request
/// will write; many clients ask for a cap instead, which tells the dispatcher less.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxTokens {
    /// `max_tokens` is the output length.
    Exact,
    /// `max_tokens` is the output length times this factor (≥ 1), rounded up.
    Scaled(f64),
    /// Every job asks for this many (or its output length, if longer).
    Fixed(u32),
}

impl MaxTokens {
    pub fn of(self, output_tokens: u32) -> u32 {
        match self {
            MaxTokens::Exact => output_tokens,
            MaxTokens::Scaled(f) => {
                ((f64::from(output_tokens) * f.max(1.0)).ceil() as u32).max(output_tokens)
            }
            MaxTokens::Fixed(n) => n.max(output_tokens),
        }
    }
}

/// What the winner's candidate predicted for a job, with the job's queue wait.
#[derive(Debug, Clone, PartialEq)]
pub struct Predicted {
    pub queue_wait_ms: f64,
    pub prediction: Prediction,
    /// The worker the job was assigned to.
    pub worker_id: String,
    /// Prompt tokens the decision believed the winner held.
    pub cached_tokens: u32,
    /// The most prompt tokens any candidate held.
    pub most_cached_tokens: u32,
    /// Prefix affinity's verdict: `chosen`, or `overridden:<reason code>`, then the
    /// worker it concerned and its cached tokens (empty: no worker held more than the
    /// score's choice).
    pub affinity: String,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct LabRun {
    /// One per planned request, in plan order, as the load generator would record it.
    pub records: Vec<RequestRecord>,
    /// Per planned request, the prediction its (last) assignment carried.
    pub predicted: Vec<Option<Predicted>>,
    /// GPU-ms a GPU had nothing running or waiting while a job of its model was queued.
    pub idle_ms: f64,
    /// GPU-ms sampled (GPUs × sampled time).
    pub sampled_ms: f64,
    /// Refusals by rejection code while a model's head waited ([`Metrics::holds`]).
    pub holds: BTreeMap<String, u64>,
    /// Requests each worker ran.
    pub per_worker: BTreeMap<String, u64>,
    /// Per completed job: the prefill stall admission charged it against the stall it
    /// stood still for.
    pub stalls: Vec<StallCheck>,
    /// The GPUs' prefix cache during the point, when its requests carried prefixes
    /// (prefix-heavy workloads): tokens looked up and tokens found cached (vLLM's
    /// `prefix_cache_queries` and `prefix_cache_hits`).
    pub prefix_cache: Option<PrefixCache>,
    /// Per job with a prefix fingerprint admitted on a GPU: its predicted against its
    /// actual cached tokens.
    pub cached: Vec<CachedCheck>,
}

/// Prefix-cache counters of a point, summed over the GPUs, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCache {
    pub queries: u64,
    pub hits: u64,
}

impl PrefixCache {
    /// Hits over queries; `None` without queries.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.queries > 0).then(|| self.hits as f64 / self.queries as f64)
    }
}

/// The cached prompt tokens the winner was believed to hold for a job, against what its
/// GPU found cached when it admitted the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedCheck {
    /// The decision's figure for the winner (`None`: the job's assignment carried none).
    pub predicted: Option<CachedPrefix>,
    /// Prompt tokens the GPU's prefix cache held at admission.
    pub actual: u32,
    pub prompt_tokens: u32,
}

impl CachedCheck {
    /// `|predicted − actual|` in tokens (a missing prediction counts as 0 predicted).
    pub fn error_tokens(&self) -> u32 {
        self.predicted.map_or(0, |p| p.tokens).abs_diff(self.actual)
    }
}

/// The cached-token errors of a point, over the jobs checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedErrors {
    pub jobs: usize,
    /// Absolute error in tokens, median and 90th percentile.
    pub p50_tokens: u32,
    pub p90_tokens: u32,
    /// Absolute error as a share of the prompt, median and 90th percentile.
    pub p50_share: f64,
    pub p90_share: f64,
    /// Shares of jobs predicted exactly, below their hit, above it.
    pub exact: f64,
    pub under: f64,
    pub over: f64,
    /// The source most jobs' figure came from.
    pub source: &'static str,
}

/// The cached-token errors of a point (`None` without checked jobs).
pub fn cached_errors(checks: &[CachedCheck]) -> Option<CachedErrors> {
    if checks.is_empty() {
        return None;
    }
    let n = checks.len();
    let mut tokens: Vec<u32> = checks.iter().map(CachedCheck::error_tokens).collect();
    tokens.sort_unstable();
    let mut shares: Vec<f64> = checks
        .iter()
        .map(|c| f64::from(c.error_tokens()) / f64::from(c.prompt_tokens.max(1)))
        .collect();
    shares.sort_by(f64::total_cmp);
    let at = |q: f64| ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    let share =
        |f: &dyn Fn(&CachedCheck) -> bool| checks.iter().filter(|c| f(c)).count() as f64 / n as f64;
    let predicted = |c: &CachedCheck| c.predicted.map_or(0, |p| p.tokens);
    let events = share(&|c| {
        c.predicted
            .is_some_and(|p| p.source == PrefixSource::Events)
    });
    Some(CachedErrors {
        jobs: n,
        p50_tokens: tokens[at(0.5)],
        p90_tokens: tokens[at(0.9)],
        p50_share: shares[at(0.5)],
        p90_share: shares[at(0.9)],
        exact: share(&|c| predicted(c) == c.actual),
        under: share(&|c| predicted(c) < c.actual),
        over: share(&|c| predicted(c) > c.actual),
        source: if events > 0.5 { "events" } else { "placements" },
    })
}

/// What admission control believed a running job would be stalled, against what it was.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StallCheck {
    /// Stall charged to it in the ledger by admissions after it, ms.
    pub charged_ms: f64,
    /// Time its decode stood still for prefills, ms.
    pub actual_ms: f64,
    pub protected_output: f64,
    pub output_tokens: u32,
}

/// Rejection codes whose holds are reported.
const HOLD_CODES: [&str; 6] = [
    "below_slo_floor",
    "ttft_over_budget",
    "insufficient_kv",
    "at_concurrency_cap",
    "room_for_lighter_tenant",
    "stale_heartbeat",
];

/// Simulated Unix time of simulated time zero.
const ORIGIN_UNIX_MS: u64 = 1_800_000_000_000;

enum Ev {
    Arrive(usize),
    ToEngine(Box<Event>),
    Tick,
    EwmaRefresh,
    Assign {
        gpu: usize,
        job: Arc<Job>,
        attempt: u32,
        epoch: u64,
        /// The prompt tokens the decision counted the GPU as holding
        /// (`Assignment::cached_prefix`).
        cached_tokens: u32,
    },
    Heartbeat(usize),
    PeriodicHeartbeat(usize),
    Stored {
        gpu: usize,
        generation: u64,
        status: Box<WorkerStatus>,
    },
    Probe(usize),
    StepEnd(usize),
    Sample,
    /// An agent publishes the changes to its GPU's prefix cache.
    CacheDeltas(usize),
    /// An agent publishes its GPU's whole prefix cache.
    CacheSnapshot(usize),
}

/// An agent's report of its GPU's prefix cache, as `metronome_worker_agent::cache_report`
/// keeps it: the block index its KV events build, and the sequence of its deltas.
struct CacheReporter {
    index: BlockIndex,
    batches: u64,
    seq: u64,
}

/// The simulator's KV event as the agent decodes it from vLLM's wire format.
fn as_received(event: KvEvent) -> KvCacheEvent {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium: None,
        },
        KvEvent::BlockRemoved { block_hashes } => KvCacheEvent::BlockRemoved {
            block_hashes,
            medium: None,
        },
        KvEvent::AllBlocksCleared => KvCacheEvent::AllBlocksCleared,
    }
}

struct Scheduled {
    at: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    // Reversed: the heap pops the earliest, then the first scheduled.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// A client's view of one request.
#[derive(Debug, Clone, Default)]
struct Client {
    first_ms: Option<f64>,
    last_ms: Option<f64>,
    tokens: u32,
    done: bool,
    error: Option<(u16, String)>,
    worker: Option<String>,
}

/// Heartbeat state of one agent: at most one put in flight, one more asked for meanwhile.
#[derive(Debug, Clone, Copy, Default)]
struct Beat {
    in_flight: bool,
    again: bool,
}

struct World {
    now: f64,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    engine: Engine,
    metrics: Arc<Metrics>,
    agents: Vec<Agent>,
    beats: Vec<Beat>,
    index: HashMap<String, usize>,
    lat: Latencies,
    tick_ms: f64,
    ewma_refresh_ms: f64,
    heartbeat_ms: f64,
    sample_ms: f64,
    revision: u64,
    plan: Vec<PlannedRequest>,
    jobs: HashMap<String, usize>,
    clients: Vec<Client>,
    predicted: Vec<Option<Predicted>>,
    output_len: HashMap<String, Average>,
    idle_ms: f64,
    sampled_ms: f64,
    stalls: Vec<StallCheck>,
    outstanding: usize,
    warmup_ms: f64,
    max_tokens: MaxTokens,
    model: String,
    /// Points run so far (job ids carry it, so no two points share one).
    points: usize,
    /// When the current point's arrivals start.
    point_start_ms: f64,
    /// Hold counters at the start of the current point.
    holds_before: BTreeMap<String, u64>,
    tenants: Vec<String>,
    queue_timeout_ms: Option<u64>,
    /// The GPUs' prefix-cache counters at the start of the current point.
    prefix_before: PrefixCache,
    /// Per agent, its cache report, when the agents report (`LabConfig::cache_reports`).
    reporters: Option<Vec<CacheReporter>>,
    cache_delta_ms: f64,
    cache_snapshot_ms: f64,
    /// Per planned request, the cached tokens its (last) assignment's winner was believed
    /// to hold, and whether its admission was checked already.
    cached_predicted: Vec<(Option<CachedPrefix>, bool)>,
    cached: Vec<CachedCheck>,
}

/// A simulated cluster that keeps its state from one run to the next, as a system that
/// `metronome-bench` starts once per cluster and policy does: the fitted models, the
/// averages and the dispatcher's term carry over.
pub struct Cluster {
    world: World,
}

impl Cluster {
    pub fn new(config: &LabConfig) -> Cluster {
        Cluster {
            world: World::new(config),
        }
    }

    /// Run the planned requests (all for the first GPU's model), once the cluster is idle.
    pub fn run(&mut self, plan: &[PlannedRequest]) -> LabRun {
        let w = &mut self.world;
        w.settle_idle();
        w.begin(plan);
        w.run();
        w.end()
    }
}

/// Run the planned requests on a fresh cluster.
pub fn run(config: &LabConfig, plan: &[PlannedRequest]) -> LabRun {
    Cluster::new(config).run(plan)
}

impl World {
    fn new(config: &LabConfig) -> World {
        let origin = Instant::now();
        let prior = config.agent.perf_prior.unwrap_or_default();
        let agents: Vec<Agent> = config
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                Agent::new(
                    format!("lab-gpu{i}"),
                    i as u32,
                    g,
                    &config.agent,
                    &prior,
                    origin,
                    ORIGIN_UNIX_MS,
                    config.cache_reports,
                )
            })
            .collect();
        let reporters = config.cache_reports.then(|| {
            agents
                .iter()
                .map(|_| CacheReporter {
                    index: BlockIndex::new(DEFAULT_BLOCK_SIZE, MAX_SNAPSHOT_BLOCKS).recording(),
                    batches: 0,
                    seq: 0,
                })
                .collect()
        });
        let metrics = Metrics::new();
        let settings = EngineSettings::from_config(&config.dispatcher, 1, "lab".into());
        let engine = Engine::new(settings, metrics.clone(), None);
        let model = config
            .gpus
            .first()
            .map(|g| g.model.clone())
            .unwrap_or_default();
        let mut w = World {
            now: 0.0,
            seq: 0,
            queue: BinaryHeap::new(),
            engine,
            metrics,
            beats: vec![Beat::default(); agents.len()],
            index: agents
                .iter()
                .enumerate()
                .map(|(i, a)| (a.worker_id.clone(), i))
                .collect(),
            agents,
            lat: config.latencies,
            tick_ms: config.dispatcher.tick_ms as f64,
            ewma_refresh_ms: config.dispatcher.ewma_refresh_ms as f64,
            heartbeat_ms: config.agent.heartbeat_interval_ms as f64,
            sample_ms: config.sample_ms,
            revision: 0,
            plan: Vec::new(),
            jobs: HashMap::new(),
            clients: Vec::new(),
            predicted: Vec::new(),
            output_len: HashMap::new(),
            idle_ms: 0.0,
            sampled_ms: 0.0,
            stalls: Vec::new(),
            outstanding: 0,
            warmup_ms: config.warmup_ms,
            max_tokens: config.max_tokens,
            model,
            points: 0,
            point_start_ms: 0.0,
            holds_before: BTreeMap::new(),
            prefix_before: PrefixCache::default(),
            tenants: config.tenants.clone(),
            queue_timeout_ms: config.queue_timeout_ms,
            reporters,
            cache_delta_ms: config.agent.cache_delta_interval_ms as f64,
            cache_snapshot_ms: config.agent.cache_snapshot_interval_ms as f64,
            cached_predicted: Vec::new(),
            cached: Vec::new(),
        };
        w.start();
        w
    }

    fn tenant_of(&self, r: &PlannedRequest) -> Option<String> {
        r.tenant.and_then(|t| self.tenants.get(t).cloned())
    }

    /// The queue's holds by rejection code, and the prefix-affinity decisions by outcome
    /// (`affinity_chosen`, `affinity_<reason it was overridden>`).
    fn holds(&self) -> BTreeMap<String, u64> {
        let holds = HOLD_CODES
            .iter()
            .map(|code| (code.to_string(), self.metrics.holds(&self.model, code)));
        let affinity = self
            .metrics
            .affinity(&self.model)
            .into_iter()
            .map(|(k, n)| (format!("affinity_{k}"), n));
        holds.chain(affinity).collect()
    }

    /// Let time pass until no job is held anywhere and the queue is empty (the bench waits
    /// for idle GPUs between points), and at least the warm-up on the first point.
    fn settle_idle(&mut self) {
        let ready_at = if self.points == 0 {
            self.warmup_ms
        } else {
            0.0
        };
        loop {
            let idle = self
                .agents
                .iter()
                .all(|a| a.held() == 0 && !a.gpu.has_work())
                && self.engine.ledger().is_empty();
            let next = self.queue.peek().map_or(f64::INFINITY, |s| s.at);
            if idle && next > ready_at {
                break;
            }
            let Some(s) = self.queue.pop() else {
                break;
            };
            self.now = s.at;
            self.apply(s.ev);
        }
        self.now = self.now.max(ready_at);
    }

    /// Start a point: its arrivals from now on.
    fn begin(&mut self, plan: &[PlannedRequest]) {
        self.points += 1;
        self.point_start_ms = self.now + 1.0;
        self.plan = plan.to_vec();
        self.jobs.clear();
        self.clients = vec![Client::default(); plan.len()];
        self.predicted = vec![None; plan.len()];
        self.idle_ms = 0.0;
        self.sampled_ms = 0.0;
        self.stalls.clear();
        self.outstanding = plan.len();
        self.holds_before = self.holds();
        self.prefix_before = self.prefix_cache();
        self.cached_predicted = vec![(None, false); plan.len()];
        self.cached.clear();
        for (i, r) in plan.iter().enumerate() {
            let at = self.point_start_ms + r.at_s * 1000.0;
            self.at(at, Ev::Arrive(i));
        }
    }

    fn at(&mut self, at: f64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn unix(&self, ms: f64) -> u64 {
        ORIGIN_UNIX_MS + ms as u64
    }

    fn start(&mut self) {
        for i in 0..self.agents.len() {
            // Independent processes: each agent's loops at its own phase.
            let phase = (i as f64 * 0.37).fract() * self.heartbeat_ms;
            self.at(phase * 0.5, Ev::Probe(i));
            self.at(phase * 0.5 + 1.0, Ev::PeriodicHeartbeat(i));
            if self.reporters.is_some() {
                // A new run's first message is its snapshot.
                self.at(phase * 0.5 + 2.0, Ev::CacheSnapshot(i));
                self.at(phase * 0.5 + 2.0 + self.cache_delta_ms, Ev::CacheDeltas(i));
            }
        }
        self.at(0.0, Ev::Tick);
        self.at(self.ewma_refresh_ms * 0.5, Ev::EwmaRefresh);
        self.at(0.0, Ev::Sample);
    }

    fn run(&mut self) {
        // A backlog drains at the cluster's pace; give up long after the last arrival
        // (every unanswered request then counts as timed out).
        let last_arrival = self.plan.last().map_or(0.0, |r| r.at_s * 1000.0);
        let give_up = self.point_start_ms + last_arrival + 30.0 * 60_000.0;
        while self.outstanding > 0 {
            match self.queue.peek() {
                Some(s) if s.at <= give_up => {}
                _ => break,
            }
            let s = self.queue.pop().expect("peeked");
            self.now = s.at;
            self.apply(s.ev);
        }
    }

    fn apply(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Arrive(i) => {
                let r = &self.plan[i];
                let id = format!("lab-{}-{i}", self.points);
                self.jobs.insert(id.clone(), i);
                // A prefix-heavy workload's chat, as token ids: the agent hands them to its
                // GPU's prefix cache, and the job carries their fingerprint as the gateway
                // attaches it. Each point's texts start with its own nonce, so one point
                // never finds another's prefixes cached (the load generator's per-run nonce).
                let (request, prefix) = if r.messages.is_empty() {
                    (serde_json::Value::Null, None)
                } else {
                    let ids = prompt_token_ids(&r.messages, self.points as u64);
                    let fingerprint = PrefixFingerprint::of_tokens(&ids, DEFAULT_BLOCK_SIZE);
                    (serde_json::json!({ "prompt": ids }), Some(fingerprint))
                };
                let job = Job {
                    v: PROTOCOL_VERSION,
                    id,
                    model: self.model.clone(),
                    endpoint: Endpoint::Completion,
                    request,
                    prompt_tokens: r.prompt_tokens,
                    max_tokens: self.max_tokens.of(r.output_tokens),
                    submitted_ms: self.unix(now),
                    deadline_ms: self.queue_timeout_ms.map(|t| self.unix(now) + t),
                    slo: None,
                    tenant: self.tenant_of(r),
                    priority: None,
                    prefix,
                    traceparent: None,
                };
                let arrive = now + self.lat.submit_ms;
                let incoming = Incoming {
                    job: Arc::new(job),
                    acker: None,
                    seq: (self.points as u64) << 32 | (i as u64 + 1),
                    received_ms: self.unix(arrive),
                    attempt: 1,
                    refused_by: Vec::new(),
                };
                self.at(
                    arrive,
                    Ev::ToEngine(Box::new(Event::Job(Box::new(incoming)))),
                );
            }
            Ev::ToEngine(event) => {
                self.engine.handle(*event, self.unix(now));
                self.settle();
            }
            Ev::Tick => {
                self.engine.tick(self.unix(now));
                self.settle();
                self.at(now + self.tick_ms, Ev::Tick);
            }
            Ev::EwmaRefresh => {
                let snapshot = RedisSnapshot {
                    ewmas: self
                        .agents
                        .iter()
                        .filter_map(|a| a.ewma_snapshot().map(|e| (a.worker_id.clone(), e)))
                        .collect(),
                    output_len: self
                        .output_len
                        .iter()
                        .filter_map(|(m, a)| a.value.map(|v| (m.clone(), v)))
                        .collect(),
                };
                self.engine.handle(Event::Redis(snapshot), self.unix(now));
                self.settle();
                self.at(now + self.ewma_refresh_ms, Ev::EwmaRefresh);
            }
            Ev::Assign {
                gpu,
                job,
                attempt,
                epoch,
                cached_tokens,
            } => {
                let writes = self
                    .jobs
                    .get(&job.id)
                    .map_or(job.max_tokens, |&i| self.plan[i].output_tokens);
                let (beat, refused) =
                    self.agents[gpu].accept(job, attempt, epoch, cached_tokens, writes, now);
                if beat {
                    self.beat_now(gpu);
                }
                if let Some(r) = refused {
                    self.refused(gpu, r);
                }
            }
            Ev::PeriodicHeartbeat(gpu) => {
                if !self.beats[gpu].in_flight {
                    self.beat_now(gpu);
                }
                self.at(now + self.heartbeat_ms, Ev::PeriodicHeartbeat(gpu));
            }
            Ev::Heartbeat(gpu) => {
                let (status, generation) = self.agents[gpu].heartbeat(now);
                self.at(
                    now + self.lat.store_ms,
                    Ev::Stored {
                        gpu,
                        generation,
                        status: Box::new(status),
                    },
                );
            }
            Ev::Stored {
                gpu,
                generation,
                status,
            } => {
                self.revision += 1;
                let seen = now + self.lat.watch_ms;
                let update = WorkerUpdate::Put {
                    status,
                    seen_ms: self.unix(seen),
                    revision: self.revision,
                    unvouched: Vec::new(),
                    tenants: Default::default(),
                };
                self.at(seen, Ev::ToEngine(Box::new(Event::Worker(update))));
                let (end, refused) = self.agents[gpu].start_reported(generation, now);
                if let Some(end) = end {
                    self.at(end, Ev::StepEnd(gpu));
                }
                for r in refused {
                    self.refused(gpu, r);
                }
                let beat = &mut self.beats[gpu];
                beat.in_flight = false;
                if std::mem::take(&mut beat.again) {
                    self.beat_now(gpu);
                }
            }
            Ev::Probe(gpu) => {
                self.agents[gpu].probe();
                self.at(now + self.heartbeat_ms, Ev::Probe(gpu));
            }
            Ev::StepEnd(gpu) => {
                for (job, actual) in self.agents[gpu].take_prefix_hits() {
                    let Some(&i) = self.jobs.get(&job) else {
                        continue;
                    };
                    let (predicted, checked) = &mut self.cached_predicted[i];
                    if !std::mem::replace(checked, true) {
                        self.cached.push(CachedCheck {
                            predicted: *predicted,
                            actual,
                            prompt_tokens: self.plan[i].prompt_tokens,
                        });
                    }
                }
                if let Some(reporters) = self.reporters.as_mut() {
                    let events = self.agents[gpu].gpu.take_kv_events();
                    if !events.is_empty() {
                        let r = &mut reporters[gpu];
                        let batch = EventBatch {
                            ts: 0.0,
                            events: events.into_iter().map(as_received).collect(),
                            data_parallel_rank: None,
                        };
                        r.index.apply(r.batches, &batch);
                        r.batches += 1;
                    }
                }
                let (finished, first, next) = self.agents[gpu].step_done(now);
                let relay = now + self.lat.relay_ms;
                for id in first {
                    if let Some(&i) = self.jobs.get(&id) {
                        self.clients[i].first_ms.get_or_insert(relay);
                    }
                }
                for f in finished {
                    self.finished(gpu, f);
                }
                if let Some(end) = next {
                    self.at(end, Ev::StepEnd(gpu));
                }
            }
            Ev::Sample => {
                let waiting = self
                    .metrics
                    .queue_depth
                    .lock()
                    .map(|d| d.get(&self.model).copied().unwrap_or(0))
                    .unwrap_or(0);
                let running = self.outstanding > 0;
                for a in self.agents.iter().filter(|_| running) {
                    self.sampled_ms += self.sample_ms;
                    if waiting > 0 && a.held() == 0 && !a.gpu.has_work() {
                        self.idle_ms += self.sample_ms;
                    }
                }
                self.at(now + self.sample_ms, Ev::Sample);
            }
            Ev::CacheDeltas(gpu) => {
                if let Some(update) = self.cache_report(gpu, CacheUpdateKind::Delta) {
                    self.at(
                        now + self.lat.complete_ms,
                        Ev::ToEngine(Box::new(Event::Cache(Box::new(update)))),
                    );
                }
                self.at(now + self.cache_delta_ms, Ev::CacheDeltas(gpu));
            }
            Ev::CacheSnapshot(gpu) => {
                for kind in [CacheUpdateKind::Delta, CacheUpdateKind::Snapshot] {
                    if let Some(update) = self.cache_report(gpu, kind) {
                        self.at(
                            now + self.lat.complete_ms,
                            Ev::ToEngine(Box::new(Event::Cache(Box::new(update)))),
                        );
                    }
                }
                self.at(now + self.cache_snapshot_ms, Ev::CacheSnapshot(gpu));
            }
        }
    }

    /// Agent `gpu`'s next cache report of `kind`: its changes since the last delta
    /// (`None` when nothing changed), or its whole index.
    fn cache_report(&mut self, gpu: usize, kind: CacheUpdateKind) -> Option<CacheUpdate> {
        let worker_id = self.agents[gpu].worker_id.clone();
        let r = &mut self.reporters.as_mut()?[gpu];
        let mut update = CacheUpdate {
            v: CACHE_UPDATE_VERSION,
            worker_id,
            run: ORIGIN_UNIX_MS,
            seq: r.seq,
            kind,
            block_size: DEFAULT_BLOCK_SIZE,
            cleared: false,
            stored: Vec::new(),
            removed: Vec::new(),
            truncated: false,
            sent_ms: ORIGIN_UNIX_MS + self.now as u64,
        };
        match kind {
            CacheUpdateKind::Delta => {
                let changes = r.index.take_changes();
                if changes.is_empty() {
                    return None;
                }
                r.seq += 1;
                update.seq = r.seq;
                update.cleared = changes.cleared;
                update.stored = changes.stored;
                update.removed = changes.removed;
            }
            CacheUpdateKind::Snapshot => {
                (update.stored, update.truncated) = r.index.newest(MAX_SNAPSHOT_BLOCKS);
            }
        }
        Some(update)
    }

    /// Ask agent `gpu` for a heartbeat now (coalesced with one already being stored).
    fn beat_now(&mut self, gpu: usize) {
        let beat = &mut self.beats[gpu];
        if beat.in_flight {
            beat.again = true;
            return;
        }
        beat.in_flight = true;
        self.at(self.now, Ev::Heartbeat(gpu));
    }

    fn finished(&mut self, gpu: usize, f: Finished) {
        let now = self.now;
        let (alpha, half) = self.agents[gpu].ewma_settings();
        self.output_len
            .entry(f.job.model.clone())
            .or_default()
            .fold(f64::from(f.output_tokens), alpha, half, now);
        if let Some(&i) = self.jobs.get(&f.job.id) {
            let c = &mut self.clients[i];
            if !c.done {
                c.done = true;
                c.last_ms = Some(now + self.lat.relay_ms);
                c.tokens = f.output_tokens;
                c.worker = Some(self.agents[gpu].worker_id.clone());
                self.outstanding -= 1;
            }
        }
        let event = CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: f.job.id.clone(),
            worker_id: self.agents[gpu].worker_id.clone(),
            model: f.job.model.clone(),
            epoch: self.agents[gpu].max_epoch(),
            attempt: f.attempt,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: f.job.prompt_tokens,
            output_tokens: f.output_tokens,
            ttft_ms: f.ttft_ms,
            tpot_ms: f.tpot_ms,
            e2e_ms: f.e2e_ms,
            finished_ms: self.unix(now),
            job: None,
        };
        if let Some(r) = self.engine.ledger().get(&f.job.id) {
            self.stalls.push(StallCheck {
                charged_ms: r.stall_ms,
                actual_ms: f.stall_ms,
                protected_output: r.profile.map_or(0.0, |p| p.protected_output),
                output_tokens: f.output_tokens,
            });
        }
        self.at(
            now + self.lat.complete_ms,
            Ev::ToEngine(Box::new(Event::Completion {
                event: Box::new(event),
                acker: None,
            })),
        );
    }

    /// Agent `gpu` handed a job back without running it: its refusal reaches the engine as
    /// a completion event does.
    fn refused(&mut self, gpu: usize, r: Refused) {
        let now = self.now;
        let agent = &self.agents[gpu];
        let event = CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: r.job.id.clone(),
            worker_id: agent.worker_id.clone(),
            model: r.job.model.clone(),
            epoch: agent.max_epoch(),
            attempt: r.attempt,
            outcome: CompletionOutcome::Refused,
            streamed: false,
            error: Some(r.reason),
            prompt_tokens: r.job.prompt_tokens,
            output_tokens: 0,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: 0.0,
            finished_ms: self.unix(now),
            job: r.carry_job.then(|| Box::new((*r.job).clone())),
        };
        self.at(
            now + self.lat.complete_ms,
            Ev::ToEngine(Box::new(Event::Completion {
                event: Box::new(event),
                acker: None,
            })),
        );
    }

    /// Let the engine look at its queues again and carry out what it decided.
    fn settle(&mut self) {
        self.engine.dispatch_if_changed(self.unix(self.now));
        for effect in self.engine.take_effects() {
            let Effect::Publish(outcome) = effect else {
                continue;
            };
            self.publish(outcome);
        }
    }

    fn publish(&mut self, outcome: Outcome) {
        let now = self.now;
        match outcome {
            Outcome::Assign {
                job,
                worker_id,
                epoch,
                decision,
            } => {
                let Some(&gpu) = self.index.get(&worker_id) else {
                    return;
                };
                let winner = decision.candidate_on(&worker_id);
                if let Some(&i) = self.jobs.get(&job.job.id) {
                    self.cached_predicted[i].0 = winner.and_then(|c| c.cached_prefix);
                    let prediction = winner.and_then(|c| c.prediction);
                    let cached = |c: &metronome_protocol::CandidateScore| {
                        c.cached_prefix.map_or(0, |p| p.tokens)
                    };
                    let affinity = decision.affinity.as_ref().map_or(String::new(), |a| {
                        let verdict = match &a.reason_code {
                            None => "chosen".to_string(),
                            Some(code) => format!("overridden:{code}"),
                        };
                        // Its reason in words, kept to one CSV field.
                        let reason = a.reason.as_deref().map_or(String::new(), |r| {
                            format!(" ({})", r.replace([',', '\n'], ";"))
                        });
                        format!("{verdict}@{}:{}{reason}", a.worker_id, a.cached_tokens)
                    });
                    self.predicted[i] = prediction.map(|p| Predicted {
                        queue_wait_ms: decision.queue_wait_ms as f64,
                        prediction: p,
                        worker_id: worker_id.clone(),
                        cached_tokens: winner.map_or(0, cached),
                        most_cached_tokens: decision
                            .candidates
                            .iter()
                            .map(cached)
                            .max()
                            .unwrap_or(0),
                        affinity,
                    });
                }
                self.at(
                    now + self.lat.assign_ms,
                    Ev::Assign {
                        gpu,
                        job: job.job.clone(),
                        attempt: job.attempt,
                        epoch,
                        cached_tokens: winner.and_then(|c| c.cached_prefix).map_or(0, |p| p.tokens),
                    },
                );
            }
            Outcome::Reject {
                decision,
                error,
                message,
                ..
            } => self.fail(&decision.job_id, status_of(error), message),
            Outcome::FinalError {
                job_id,
                error,
                message,
                ..
            } => self.fail(&job_id, status_of(error), message),
            Outcome::Requeue {
                job, refused_by, ..
            } => {
                // Back through `jobs.retry` and the intake, in its original place.
                let arrive = now + self.lat.submit_ms;
                let incoming = Incoming {
                    job: job.job.clone(),
                    acker: None,
                    seq: job.seq,
                    received_ms: self.unix(arrive),
                    attempt: job.attempt,
                    refused_by,
                };
                self.at(
                    arrive,
                    Ev::ToEngine(Box::new(Event::Job(Box::new(incoming)))),
                );
            }
            Outcome::DecisionOnly { .. }
            | Outcome::PurgeWork { .. }
            | Outcome::ExpireWorker { .. }
            | Outcome::DeadLetter { .. }
            | Outcome::RelayCancel { .. }
            | Outcome::Revoke { .. } => {}
        }
    }

    fn fail(&mut self, job_id: &str, status: u16, message: String) {
        let Some(&i) = self.jobs.get(job_id) else {
            return;
        };
        let c = &mut self.clients[i];
        if !c.done {
            c.done = true;
            c.error = Some((status, message));
            self.outstanding -= 1;
        }
    }

    /// The GPUs' prefix-cache counters now, summed.
    fn prefix_cache(&self) -> PrefixCache {
        self.agents
            .iter()
            .map(|a| a.gpu.stats())
            .fold(PrefixCache::default(), |acc, s| PrefixCache {
                queries: acc.queries + s.prefix_cache_queries_total,
                hits: acc.hits + s.prefix_cache_hits_total,
            })
    }

    fn end(&mut self) -> LabRun {
        let mut per_worker = BTreeMap::new();
        let records = self
            .plan
            .iter()
            .zip(&self.clients)
            .map(|(r, c)| {
                let sent = self.point_start_ms + r.at_s * 1000.0;
                let ok = c.done && c.error.is_none();
                if let (true, Some(w)) = (ok, &c.worker) {
                    *per_worker.entry(w.clone()).or_insert(0) += 1;
                }
                let mut rec = RequestRecord {
                    id: r.id,
                    scheduled_s: r.at_s,
                    sent_s: r.at_s,
                    prompt_tokens: r.prompt_tokens,
                    max_tokens: r.output_tokens,
                    ok,
                    status: match (&c.error, ok) {
                        (Some((s, _)), _) => Some(*s),
                        (None, true) => Some(200),
                        (None, false) => None,
                    },
                    error_kind: if ok {
                        None
                    } else if c.error.is_some() {
                        Some(ErrorKind::Http)
                    } else {
                        Some(ErrorKind::Timeout)
                    },
                    error: c.error.as_ref().map(|(_, m)| m.clone()),
                    ttft_ms: c.first_ms.map(|t| t - sent),
                    tpot_ms: None,
                    e2e_ms: c.last_ms.map(|t| t - sent),
                    output_tokens: c.tokens,
                    tokens_per_s: None,
                    usage_reported: ok,
                    chunks: c.tokens,
                    job_id: Some(format!("lab-{}-{}", self.points, r.id)),
                    worker: c.worker.clone(),
                    tenant: self.tenant_of(r),
                };
                rec.derive_rates();
                rec
            })
            .collect();
        let holds = self
            .holds()
            .into_iter()
            .map(|(k, n)| {
                let before = self.holds_before.get(&k).copied().unwrap_or(0);
                (k, n - before)
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        LabRun {
            records,
            predicted: std::mem::take(&mut self.predicted),
            idle_ms: self.idle_ms,
            sampled_ms: self.sampled_ms,
            holds,
            per_worker,
            stalls: std::mem::take(&mut self.stalls),
            prefix_cache: self.plan.iter().any(|r| !r.messages.is_empty()).then(|| {
                let now = self.prefix_cache();
                PrefixCache {
                    queries: now.queries - self.prefix_before.queries,
                    hits: now.hits - self.prefix_before.hits,
                }
            }),
            cached: std::mem::take(&mut self.cached),
        }
    }
}

/// The token ids of a planned chat as the gateway and the simulator tokenise it
/// ([`metronome_protocol::prefix::chat_token_ids`]), its texts starting with `nonce`.
pub fn prompt_token_ids(messages: &[Message], nonce: u64) -> Vec<u32> {
    let texts: Vec<(&str, String)> = messages
        .iter()
        .map(|m| (m.role.as_str(), message_text(m, Some(nonce))))
        .collect();
    chat_token_ids(texts.iter().map(|(role, text)| (*role, text.as_str())))
}

/// The HTTP status the gateway answers a job's error with.
fn status_of(error: ErrorCode) -> u16 {
    match error {
        ErrorCode::QueueFull => 429,
        ErrorCode::DeadlineExceeded => 504,
        ErrorCode::InvalidJob | ErrorCode::UnknownModel => 400,
        _ => 503,
    }
}
