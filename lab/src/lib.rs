//! Metronome's policy lab: a whole cluster in simulated time, for comparing admission
//! policies exactly and in seconds instead of minutes.
//!
//! What runs is the real code, wired by function calls instead of NATS and Redis:
//! - the dispatcher's [`Engine`](metronome_dispatcher::engine::Engine), the same state
//!   machine the leader runs, fed the same events (jobs, heartbeats, EWMA snapshots,
//!   completions, ticks) and performing the same effects;
//! - per GPU, the simulator's [`Engine`](metronome_gpu_sim::engine::Engine) (continuous
//!   batching, chunked prefill, paged KV, recompute preemption) at the step times of its
//!   calibrated cost model;
//! - per GPU, the worker-agent's own job lifecycle
//!   ([`JobMachine`](metronome_worker_agent::lifecycle::JobMachine): what is taken, when
//!   it starts, what heartbeats say about the jobs, what a finished job measured), with
//!   the performance model's online fit ([`metronome_scheduler::perf::PerfModel`]), the
//!   EWMAs and output-length average the Redis script keeps, and heartbeats with the
//!   probes' latest readings.
//!
//! What it leaves out, on purpose: CPU contention, NATS and HTTP latencies beyond the fixed
//! hops of [`Latencies`], failures. It is a design tool, not the benchmark: published figures
//! come from `metronome-bench` on the real system. Because it is exact and fast, a change to
//! admission can be judged here on many seeds, workloads and GPU mixes before the real
//! system measures it; a result that holds only here is not a result.
//!
//! Invariants: the same inputs give the same outputs (no clock, no randomness outside the
//! planned requests); every planned request ends in exactly one record.

pub mod agent;
pub mod fairness;
pub mod gpu;
pub mod world;

pub use world::{
    cached_errors, prompt_token_ids, run, CachedCheck, CachedErrors, Cluster, LabConfig, LabRun,
    Latencies, MaxTokens, PrefixCache, StallCheck,
};
