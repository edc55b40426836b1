//! Each worker's performance model, learned online from its own completed jobs: how its
//! decode step grows with the running batch and its context, how long a prefill takes per
//! prompt token, and how long an admitted prefill stalls the streams already running.
//!
//! The worker-agent fits it ([`PerfModel::observe`] after every job) and persists it in
//! Redis beside its EWMAs; the coefficients travel in every heartbeat; the dispatcher
//! predicts with them ([`crate::forecast`]). The fitting is plain recursive least squares
//! ([`rls`]) over signals any OpenAI-compatible server lets the agent measure: nothing here
//! knows which model server, GPU or simulator produced the samples.

pub mod model;
pub mod rls;

pub use model::{PerfModel, PerfPrior, PerfSample, PriorError};
pub use rls::Rls;
