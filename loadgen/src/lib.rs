//! Metronome's load generator: an OpenAI-API client that measures *predictability* —
//! per-request TTFT, time per output token, tokens/s and end-to-end latency, their tails
//! and spread, and goodput at an SLO — against any OpenAI-compatible endpoint (Metronome's
//! gateway, another router, or a model server directly).
//!
//! A run is: a [`LoadSpec`] → an arrival plan ([`plan_requests`]: trace replay or seeded
//! Poisson) → open-loop sending with streaming measurement ([`run_load`]) → one
//! [`RequestRecord`] per planned request → [`summarize`] → [`write_outputs`].
//!
//! Library entry points for a scenario runner: [`run_load`] / [`run_load_until`] /
//! [`run_plan`], [`summarize`], [`write_outputs`], [`load_trace`] and [`trace_stats`]
//! (a trace's mean rate and length statistics, to scale it to a fraction of capacity).
//!
//! [`system`] starts and probes a whole Metronome system under test (`./dev up`), and
//! [`process`] signals its processes: the benchmark (`bench/`) and the fault drills
//! (`drill/`) are built on both.

pub mod client;
pub mod dist;
pub mod error;
pub mod output;
pub mod plan;
pub mod plots;
pub mod prefixes;
pub mod process;
pub mod prompt;
pub mod record;
pub mod request;
pub mod runner;
pub mod spec;
pub mod stats;
pub mod summary;
pub mod system;
pub mod trace;

pub use dist::LengthDist;
pub use error::{FieldError, LoadError, TraceError};
pub use output::{write_outputs, OutputFiles};
pub use plan::{plan_requests, poisson_plan, trace_plan, TraceScaling};
pub use prefixes::MultiTurn;
pub use prompt::FIELD_PROMPT_TOKENS;
pub use record::{ErrorKind, RequestRecord};
pub use request::{Message, MessageKind, PlannedRequest, Role};
pub use runner::{run, run_load, run_load_until, run_plan, RunResult};
pub use spec::{Endpoint, LoadSpec, Slo, TenantLoad, Workload};
pub use summary::{meets_slo, summarize, Dist, Summary, WorkerSummary};
pub use trace::{load_trace, parse_trace, trace_stats, LengthStats, TraceRequest, TraceStats};

/// The crate's configuration type, under the name every Metronome component uses.
pub type Config = LoadSpec;
