//! Job cost: the predicted service time of *this* job on *this* worker, in ms.
//!
//! `(ttft_ms + predicted_output_tokens * tpot_ms) * (1 + batch_slowdown * active)`
//!
//! The bracket is the job's time on the worker running alone (first token, then one step
//! per output token); the factor is the batching slowdown at `active + 1` concurrent
//! requests, the same model the SLO filter uses. This is what lets a long generation prefer
//! a fast idle card while a short completion may still go to a busier one. Requests differ
//! in cost by orders of magnitude, which connection counting cannot see. Unavailable until
//! the worker has EWMA samples.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct JobCost;

/// Predicted service time in ms of a job with `predicted_output_tokens` on a worker with
/// these averages and `active` requests already running.
pub fn predicted_service_ms(
    ttft_ms: f64,
    tpot_ms: f64,
    predicted_output_tokens: f64,
    batch_slowdown: f64,
    active: u32,
) -> f64 {
    (ttft_ms + predicted_output_tokens * tpot_ms) * (1.0 + batch_slowdown * f64::from(active))
}

impl Term for JobCost {
    fn name(&self) -> TermName {
        TermName::JobCost
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        let e = ctx.view.ewma_with_samples()?;
        let tpot = e.tpot_estimate_ms()?;
        let ttft = if e.ttft_ms.is_finite() && e.ttft_ms >= 0.0 {
            e.ttft_ms
        } else {
            0.0
        };
        let cost = predicted_service_ms(
            ttft,
            tpot,
            ctx.job.predicted_output(),
            ctx.config.batch_slowdown,
            ctx.load.effective_active,
        );
        cost.is_finite().then_some(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn scales_the_single_stream_time_by_load() {
        let j = job("m"); // 50 predicted output tokens
        let mut w = worker("w1");
        assert_eq!(raw(&JobCost, &j, &w, &Ledger::new()), None);
        w.ewma = Some(ewma(100.0, 20.0));
        assert_eq!(raw(&JobCost, &j, &w, &Ledger::new()), Some(1_100.0));
        let mut l = Ledger::new();
        l.reserve("w1", "x", 1, 0).unwrap();
        l.reserve("w1", "y", 1, 0).unwrap();
        // default batch_slowdown 0.1, two running: x 1.2
        let got = raw(&JobCost, &j, &w, &l).unwrap();
        assert!((got - 1_320.0).abs() < 1e-9, "{got}");
    }

    #[test]
    fn prediction_is_capped_by_max_tokens() {
        let mut j = job("m");
        j.predicted_output_tokens = 1e9;
        let mut w = worker("w1");
        w.ewma = Some(ewma(0.0, 10.0));
        assert_eq!(raw(&JobCost, &j, &w, &Ledger::new()), Some(1_000.0));
    }

    #[test]
    fn falls_back_to_the_token_rate() {
        let mut w = worker("w1");
        let mut e = ewma(100.0, 0.0);
        e.tok_s = 50.0; // 20 ms per token
        w.ewma = Some(e);
        assert_eq!(raw(&JobCost, &job("m"), &w, &Ledger::new()), Some(1_100.0));
    }
}
