//! The crate's integration tests, one module per file, built as one test binary: one
//! compile and one link instead of one per file (the suite's build time is mostly
//! linking and re-instantiating the same async stack per test binary).
//! `scripts/check-workspace.py` (run by `./dev test`) fails when a file here is not declared below.

mod creds;
mod ewma_restart;
mod full_chain;
mod http_errors;
mod json_logs;
mod permissions;
mod replay;
mod tls;
mod traces;
mod worker_loss;
