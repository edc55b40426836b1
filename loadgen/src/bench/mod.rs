//! The scenario runner behind the `metronome-bench` binary: starts whole Metronome systems
//! with `./dev up`, measures capacity, compares the dispatch policies on the same trace and
//! load, runs the burst case and the overhead runs, and writes `BENCHMARKS.md`.
//!
//! Split by concept: [`capacity`] (when a rate keeps up, the search for the highest one),
//! [`report`] (rows, target ratios, Markdown), [`system`] (one system under test and its
//! probes), [`machine`] (machine facts, factual analysis), [`scenarios`] (the order of
//! runs and the fairness rules). The first two and the parsing helpers are pure and
//! unit-tested; the rest is exercised by running the benchmark.

pub mod capacity;
pub mod machine;
pub mod report;
pub mod scenarios;
pub mod system;

pub use scenarios::{run_bench, BenchPlan, POLICIES};
