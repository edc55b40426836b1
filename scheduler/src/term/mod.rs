//! Score terms: how good is this eligible worker for this job?
//!
//! Each term (one file each) turns one candidate into a raw value in its own unit, or
//! `None` when the signal is unavailable for that worker (no EWMA samples yet, no KV
//! metric, no NVML). Raw values are compared only within one decision: [`crate::evaluate()`]
//! min-max normalises them across the candidates, so units never mix. Lower is better for
//! every term except those whose [`Term::higher_is_better`] is true (throughput), which
//! are inverted during normalisation.
//!
//! [`ALL`] lists the terms in [`TermName::ALL`] order; a test keeps the two in step.

use metronome_protocol::TermName;

use crate::forecast::Forecast;
use crate::{JobRequest, SchedulerConfig, WorkerLoad, WorkerView};

mod active_requests;
mod gpu_utilisation;
mod job_cost;
mod kv_pressure;
mod latency_ewma;
mod queue_depth;
mod throughput_ewma;

pub use active_requests::ActiveRequests;
pub use gpu_utilisation::GpuUtilisation;
pub use job_cost::JobCost;
pub use kv_pressure::KvPressure;
pub use latency_ewma::LatencyEwma;
pub use queue_depth::QueueDepth;
pub use throughput_ewma::ThroughputEwma;

/// Everything a term may look at.
#[derive(Debug, Clone, Copy)]
pub struct TermContext<'a> {
    pub job: &'a JobRequest,
    pub view: &'a WorkerView,
    pub load: &'a WorkerLoad,
    /// What admitting the job here would do.
    pub forecast: &'a Forecast,
    pub config: &'a SchedulerConfig,
}

/// One score term.
pub trait Term: Sync {
    fn name(&self) -> TermName;
    /// The raw value in the term's unit; `None` when the worker lacks the signal.
    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64>;
    /// True when a larger raw value is better (the term is inverted when normalised).
    fn higher_is_better(&self) -> bool {
        false
    }
}

/// The seven terms, in [`TermName::ALL`] order.
pub static ALL: [&dyn Term; 7] = [
    &ActiveRequests,
    &QueueDepth,
    &LatencyEwma,
    &JobCost,
    &ThroughputEwma,
    &KvPressure,
    &GpuUtilisation,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_are_in_protocol_order() {
        let names: Vec<TermName> = ALL.iter().map(|t| t.name()).collect();
        assert_eq!(names, TermName::ALL);
    }
}
