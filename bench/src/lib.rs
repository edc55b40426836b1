//! The scenario runner behind the `metronome-bench` binary: starts whole Metronome systems
//! with `./dev up`, offers every policy the same loads (multiples of the cluster's nominal
//! capacity) on two workloads and two clusters, records goodput-versus-offered-load curves,
//! capacity at SLO, idle GPU-seconds and prediction errors, runs the burst case and the
//! overhead runs, and writes `BENCHMARKS.md`.
//!
//! Split by concept: [`nominal`] (nominal capacity from the simulator's calibration),
//! [`curve`] (capacity at SLO from a curve, goodput rate), [`idle`] (idle GPU-seconds from
//! samples), [`prediction`] (prediction error from decisions), [`report`] (rows, targets,
//! Markdown), [`capacity`] (the keep-up search the overhead runs use), [`machine`]
//! (machine facts, factual analysis),
//! [`scenarios`] (the order of runs and the fairness rules), [`merge`] (one report from
//! several runs' load points, `--render`).
//! [`fairness`] is the tenant-fairness drill (`--fairness`): two tenants' API keys, one
//! flooding, and a leader killed mid-run; [`failover_cache`] the prefix-cache hit rate
//! across a leader failover (`--failover-cache`). All but these two and [`scenarios`] are
//! pure and unit-tested (of these, their arithmetic and rendering); the rest is exercised by
//! running the benchmark. The system under test (started with
//! `./dev up`, probed, stopped) is [`metronome_loadgen::system`], which the drills share.

pub mod capacity;
pub mod curve;
pub mod failover_cache;
pub mod fairness;
pub mod idle;
pub mod machine;
pub mod merge;
pub mod nominal;
pub mod prediction;
pub mod report;
pub mod scenarios;

pub use scenarios::{render_merged, run_bench, BenchPlan, CLUSTERS, LOADS, POLICIES, WORKLOADS};
