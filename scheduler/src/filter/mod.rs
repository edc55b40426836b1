//! Filters: may this worker take this job at all?
//!
//! Each filter is a pure predicate over one worker (one file each). A failing filter gives
//! its [`RejectionCode`] and a reason with the numbers that decided it; the first failing
//! filter, in the order of [`ADMISSION`], is the worker's rejection.
//!
//! Two sets exist. [`ELIGIBILITY`] is what any balancer applies (within its provisioning,
//! fresh heartbeat, serves the model, healthy, not draining); [`ADMISSION`] adds Metronome's admission control
//! (concurrency ceiling including reservations, KV headroom, and the two SLO predictions:
//! the job's TTFT budget and the decode-rate floor of the job and of those it would join). Baseline policies use
//! only the first set so comparisons show what admission control buys.

use std::cell::OnceCell;

use metronome_protocol::{Rejection, RejectionCode};

use crate::forecast::Forecast;
use crate::{JobRequest, Ledger, SchedulerConfig, WorkerLoad, WorkerView};

mod concurrency;
mod draining;
mod healthy;
mod heartbeat;
mod kv_headroom;
mod model;
mod provisioned;
mod slo;
mod ttft;

pub use concurrency::UnderConcurrencyCap;
pub use draining::NotDraining;
pub use healthy::Healthy;
pub use heartbeat::FreshHeartbeat;
pub use kv_headroom::{fits_when_empty, KvHeadroom};
pub use model::ServesModel;
pub use provisioned::Provisioned;
pub use slo::{OwnRateFloor, SloFloor};
pub use ttft::TtftBudget;

/// Everything a filter may look at.
#[derive(Debug, Clone, Copy)]
pub struct FilterContext<'a> {
    pub job: &'a JobRequest,
    pub view: &'a WorkerView,
    pub load: &'a WorkerLoad,
    /// The reservations, which the forecast reads.
    pub ledger: &'a Ledger,
    /// What admitting the job here would do, computed the first time a filter asks
    /// ([`FilterContext::forecast`]); pass `&OnceCell::from(f)` to supply one.
    pub forecast: &'a OnceCell<Forecast>,
    pub config: &'a SchedulerConfig,
    pub now_ms: u64,
}

impl FilterContext<'_> {
    /// What admitting the job here would do. Computed on first use, not up front: the
    /// forecast walks every job running on the worker, and a worker refused by a filter
    /// that does not need it (at its cap, stale, draining: every worker of a saturated
    /// model) would pay for it on every look at a waiting job. The forecast is a pure
    /// function of the context, so when it is computed changes nothing it says.
    pub fn forecast(&self) -> &Forecast {
        self.forecast
            .get_or_init(|| Forecast::of(self.job, self.view, self.load, self.ledger, self.config))
    }
}

/// One eligibility rule.
pub trait Filter: Sync {
    /// The code a rejection by this filter carries.
    fn code(&self) -> RejectionCode;
    /// `Err(reason)` when the worker must not take the job; the reason quotes the numbers.
    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String>;
    /// `check(ctx).is_ok()`, without writing the reason: what a look at a held queue needs
    /// (the filters whose refusal holds for every job of the model answer it cheaply).
    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        self.check(ctx).is_ok()
    }
}

/// Filters every balancer applies.
pub static ELIGIBILITY: [&dyn Filter; 5] = [
    &Provisioned,
    &FreshHeartbeat,
    &ServesModel,
    &Healthy,
    &NotDraining,
];

/// Eligibility plus Metronome's admission control, in evaluation order.
pub static ADMISSION: [&dyn Filter; 9] = [
    &Provisioned,
    &FreshHeartbeat,
    &ServesModel,
    &Healthy,
    &NotDraining,
    &UnderConcurrencyCap,
    &KvHeadroom,
    &SloFloor,
    &TtftBudget,
];

/// Admission without the protection of running jobs: what a job may be placed through when
/// it is placed where it does least harm ([`crate::least_harm`]).
pub static LEAST_HARM: [&dyn Filter; 9] = [
    &Provisioned,
    &FreshHeartbeat,
    &ServesModel,
    &Healthy,
    &NotDraining,
    &UnderConcurrencyCap,
    &KvHeadroom,
    &OwnRateFloor,
    &TtftBudget,
];

/// Whether a rejection with `code` refuses every job of the same model on that worker, at
/// the same time and against the same ledger: the filters that give it read only the
/// worker's status, its load (reported work and reservations), the clock and the job's
/// model, never the job's size, SLO or wait. When every worker refuses a job with such a
/// code, no other job of its model can be placed either, so the engine need not try the
/// jobs behind it (every worker of a model at its cap is the common case under load).
pub fn refuses_every_job_of_the_model(code: RejectionCode) -> bool {
    match code {
        RejectionCode::NotProvisioned
        | RejectionCode::StaleHeartbeat
        | RejectionCode::WrongModel
        | RejectionCode::Unhealthy
        | RejectionCode::Draining
        | RejectionCode::AtConcurrencyCap => true,
        RejectionCode::InsufficientKv
        | RejectionCode::BelowSloFloor
        | RejectionCode::TtftOverBudget
        // A worker that refused this very job: the engine's, not a filter's, and about
        // the job, not its model.
        | RejectionCode::RefusedJob => false,
    }
}

/// When every worker refuses `job` through a filter whose refusal holds for every job of
/// its model ([`refuses_every_job_of_the_model`]): each worker's rejection code, the one
/// [`crate::evaluate()`] with `filters` would give it, in the order of `workers`. `None`
/// when some worker passes those filters (the job must then be evaluated in full).
///
/// This is a look at a saturated model (every worker at its cap) without a forecast, a
/// reason written or a rejection listed per worker: the engine counts the codes as the
/// held queue's refusals and leaves the queue as it is, which is what a full evaluation
/// of the head would have led to.
pub fn refused_whatever_the_job(
    filters: &[&dyn Filter],
    job: &JobRequest,
    workers: &[WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
) -> Option<Vec<RejectionCode>> {
    let mut codes = Vec::with_capacity(workers.len());
    for view in workers {
        let load = WorkerLoad::of(view, ledger, config);
        let forecast = OnceCell::new();
        let ctx = FilterContext {
            job,
            view,
            load: &load,
            ledger,
            forecast: &forecast,
            config,
            now_ms,
        };
        let mut refused = None;
        for f in filters {
            if !refuses_every_job_of_the_model(f.code()) {
                // Only filters that depend on the job are left: it may pass them here.
                return None;
            }
            if !f.passes(&ctx) {
                refused = Some(f.code());
                break;
            }
        }
        codes.push(refused?);
    }
    Some(codes)
}

/// Run `filters` in order; the first failure becomes the rejection.
// The rejection is the decision's record of a refused worker, moved once into it: boxing it
// would add an allocation per refusal for nothing.
#[allow(clippy::result_large_err)]
pub fn apply(filters: &[&dyn Filter], ctx: &FilterContext<'_>) -> Result<(), Rejection> {
    for f in filters {
        if let Err(reason) = f.check(ctx) {
            let code = f.code();
            let predicted = matches!(
                code,
                RejectionCode::BelowSloFloor | RejectionCode::TtftOverBudget
            );
            return Err(Rejection {
                worker_id: ctx.view.status.worker_id.clone(),
                code,
                reason,
                prediction: predicted.then(|| ctx.forecast().prediction()),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn first_failing_filter_names_the_rejection() {
        let mut w = worker("w1");
        w.status.healthy = false;
        w.status.draining = true;
        let config = SchedulerConfig::default();
        let load = WorkerLoad::of(&w, &Ledger::new(), &config);
        let j = job("m");
        let ledger = Ledger::new();
        let forecast = OnceCell::new();
        let ctx = FilterContext {
            job: &j,
            view: &w,
            load: &load,
            ledger: &ledger,
            forecast: &forecast,
            config: &config,
            now_ms: NOW,
        };
        let r = apply(&ADMISSION, &ctx).unwrap_err();
        assert_eq!(r.code, RejectionCode::Unhealthy);
        assert_eq!(r.worker_id, "w1");
    }

    #[test]
    fn admission_codes_are_distinct_and_cover_every_code() {
        let mut codes: Vec<RejectionCode> = ADMISSION.iter().map(|f| f.code()).collect();
        codes.dedup();
        assert_eq!(codes.len(), 9);
        assert!(ELIGIBILITY.iter().all(|e| codes.contains(&e.code())));
    }
}
