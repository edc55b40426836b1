//! Job cost: the predicted time this job costs the system on this worker, in ms.
//!
//! `ttft + predicted_output × step + running × stall`, all from the worker's performance
//! model ([`crate::forecast`]): the job's own time on the worker (first token, then one
//! step per expected output token at the batch it joins), plus the time its prefill takes
//! from every stream already running there. Requests differ in cost by orders of magnitude,
//! which connection counting cannot see; this term lets a long generation prefer a fast
//! idle card while a short completion may still join a busier one. Always available: a
//! worker without a fitted model is predicted with the configured prior.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct JobCost;

impl Term for JobCost {
    fn name(&self) -> TermName {
        TermName::JobCost
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        let f = ctx.forecast;
        let cost = f.service_ms(ctx.job) + f64::from(f.streams_before) * f.stall_ms;
        cost.is_finite().then_some(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;
    use metronome_protocol::PerfCoefficients;

    fn perf() -> PerfCoefficients {
        PerfCoefficients {
            step_base_ms: 20.0,
            step_per_stream_ms: 2.0,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.5,
            ttft_base_ms: 0.0,
            prefill_per_token_ms: 1.0,
            ttft_per_stream_ms: 0.0,
            step_error_ms: 0.0,
            samples: 3,
        }
    }

    #[test]
    fn counts_own_time_and_the_stall_inflicted_on_running_streams() {
        let j = job("m"); // 100 prompt tokens, 50 predicted output
        let mut w = worker("w1");
        w.status.perf = Some(perf());
        w.status.kv = None;
        // Idle: 100 ms to first token, 50 × 20 ms.
        assert_eq!(raw(&JobCost, &j, &w, &Ledger::new()), Some(1_100.0));
        let mut l = Ledger::new();
        l.reserve("w1", "x", 1, 0).unwrap();
        l.reserve("w1", "y", 1, 0).unwrap();
        // Two running (unreported, no profile: nothing pending to prefill): step 24 ms,
        // ttft 100, stall 50 ms on each of the two.
        let got = raw(&JobCost, &j, &w, &l).unwrap();
        assert!(
            (got - (100.0 + 50.0 * 24.0 + 2.0 * 50.0)).abs() < 1e-9,
            "{got}"
        );
    }

    #[test]
    fn prediction_is_capped_by_max_tokens() {
        let mut j = job("m");
        j.predicted_output_tokens = 1e9;
        let mut w = worker("w1");
        w.status.perf = Some(perf());
        w.status.kv = None;
        assert_eq!(
            raw(&JobCost, &j, &w, &Ledger::new()),
            Some(100.0 + 100.0 * 20.0)
        );
    }
}
