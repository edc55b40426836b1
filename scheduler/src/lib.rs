//! Metronome's scheduling core: which worker runs a job, and why.
//!
//! One decision is the cycle **filter → score → normalise → select**, followed by the
//! caller's **reserve**:
//!
//! 1. *Filter* ([`filter`]): every worker is checked against the eligibility filters
//!    (fresh heartbeat, serves the model, healthy, not draining) and the admission filters
//!    (under its concurrency ceiling, enough KV headroom, and the SLO predictions of
//!    [`forecast`]: the job's TTFT within its budget, the decode rate of the job and of
//!    every job already running there above their floors). The predictions come from
//!    each worker's own performance model ([`perf`]), learned online by its agent. The first filter a worker
//!    fails becomes its [`Rejection`](metronome_protocol::Rejection), with a reason in
//!    numbers.
//! 2. *Score* ([`term`]): each eligible worker gets a raw value for each of the seven terms
//!    of [`TermName::ALL`](metronome_protocol::TermName::ALL), in its own unit, or `None`
//!    when the signal is unavailable.
//! 3. *Normalise* ([`mod@evaluate`]): each term is min-max scaled across the candidates of this
//!    decision to [0, 1] (lower is better; throughput is inverted); an unavailable term gets
//!    the neutral value described in [`mod@evaluate`].
//! 4. *Select*: the lowest weighted total wins; ties break by effective active count, then
//!    by worker id.
//! 5. *Reserve* ([`Ledger`]): the caller books the winner in the ledger before it evaluates
//!    the next job. Reservations count as active work and as used KV in every later
//!    decision, which is what spreads a burst of simultaneous jobs over idle workers
//!    instead of piling them on the first one.
//!
//! Invariants:
//! - The core is pure and deterministic: no I/O, no clock, no randomness inside. Time
//!   (`now_ms`) and seeds are arguments, so any decision can be replayed from its inputs.
//! - [`evaluate()`] has no side effects; only [`Ledger`] methods change state.
//! - The result does not depend on the order of the workers slice (worker ids are assumed
//!   unique).
//! - The winner passes every filter; reserving only winners never takes a worker past its
//!   concurrency cap.
//! - A job is reserved on at most one worker; releasing is idempotent.

pub mod affinity;
pub mod block_hasher;
pub mod config;
pub mod drain;
pub mod evaluate;
pub mod ewma;
pub mod fairness;
pub mod filter;
pub mod forecast;
pub mod job;
pub mod least_harm;
pub mod ledger;
pub mod load;
pub mod output_len;
pub mod perf;
pub mod policy;
pub mod prefix_index;
pub mod provisioning;
pub mod rate_limit;
pub mod reported_cache;
pub mod term;
#[cfg(test)]
pub(crate) mod testutil;
pub mod view;

pub use config::{ConfigError, SchedulerConfig, Weights};
pub use drain::DrainRate;
pub use evaluate::{evaluate, rescore, Evaluation};
pub use fairness::{Fairness, FairnessConfig, FairnessSnapshot, RecentArrivals, Tokens};
pub use forecast::{Forecast, IdleTtft};
pub use job::{JobRequest, PrefixLookup};
pub use least_harm::{least_harm, least_harm_within};
pub use ledger::{JobProfile, Ledger, LedgerError, Reconciliation, Reservation, StallOutlook};
pub use load::WorkerLoad;
pub use output_len::OutputLength;
pub use policy::{choose, PolicyKind, PolicyState};
pub use prefix_index::{Cached, PrefixIndex};
pub use provisioning::{ProvisionedWorker, Provisioning};
pub use reported_cache::ReportedCaches;
pub use view::{EwmaSnapshot, WorkerView};

/// The job-size record of a decision, re-exported for callers of [`Evaluation`].
pub use metronome_protocol::decision::JobCostEstimate;
