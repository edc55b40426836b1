//! The crate's integration tests, one module per file, built as one test binary: one
//! compile and one link instead of one per file (the suite's build time is mostly
//! linking and re-instantiating the same async stack per test binary).
//! `scripts/check-workspace.py` (run by `./dev test`) fails when a file here is not declared below.

mod admission;
mod adoption;
mod burst;
mod cancel_tenant;
mod cli;
mod common;
mod decisions;
mod durable;
mod engine;
mod engine_admission;
mod engine_fairness;
mod engine_prefix;
mod epoch;
mod failure_paths;
mod fairness;
mod hostile;
mod log_lines;
mod processes;
mod provisioning;
mod queues;
mod retry_subject;
mod tenant_limits;
mod tenant_subject;
mod unmeetable;
mod worker_claims;
