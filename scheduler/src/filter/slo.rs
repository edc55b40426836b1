//! SLO floor (when `slo_min_tok_s` is set): admit only if the predicted per-request token
//! rate after admission stays above the floor, so a new job never drags every request on
//! the worker below the promised rate.
//!
//! Prediction: `rate(n) = single_stream_rate / (1 + batch_slowdown * (n - 1))` with `n` the
//! effective active count plus this job, and `single_stream_rate` the worker's tok/s EWMA
//! (or `1000 / tpot_ms`). The EWMA was measured under the load of its day, so it tends to
//! underestimate the single-stream rate: the filter errs on the safe side. A worker with no
//! EWMA samples cannot be judged and passes (the latency and job-cost terms say they are
//! unavailable), otherwise a fresh worker could never earn its first sample.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct SloFloor;

/// Predicted per-request tokens/s with `n` requests running.
pub fn predicted_rate(single_stream_tok_s: f64, batch_slowdown: f64, n: u32) -> f64 {
    let extra = f64::from(n.saturating_sub(1));
    single_stream_tok_s / (1.0 + batch_slowdown * extra)
}

impl Filter for SloFloor {
    fn code(&self) -> RejectionCode {
        RejectionCode::BelowSloFloor
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let Some(floor) = ctx.config.slo_min_tok_s else {
            return Ok(());
        };
        let Some(single) = ctx
            .view
            .ewma_with_samples()
            .and_then(|e| e.rate_estimate_tok_s())
        else {
            return Ok(());
        };
        let n = ctx.load.after_admission();
        let rate = predicted_rate(single, ctx.config.batch_slowdown, n);
        if rate < floor {
            Err(format!(
                "below SLO: predicted {rate:.1} tok/s per request at {n} concurrent (single-stream {single:.1}, slowdown {}) < floor {floor} tok/s",
                ctx.config.batch_slowdown
            ))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};

    #[test]
    fn predicted_rate_follows_the_batching_model() {
        assert_eq!(predicted_rate(100.0, 0.25, 1), 100.0);
        assert_eq!(predicted_rate(100.0, 0.25, 5), 50.0);
        assert_eq!(predicted_rate(100.0, 0.0, 9), 100.0);
    }

    #[test]
    fn rejects_when_admission_would_drop_below_the_floor() {
        let config = SchedulerConfig {
            batch_slowdown: 0.25,
            slo_min_tok_s: Some(50.0),
            ..SchedulerConfig::default()
        };
        let j = job("m");
        let mut w = worker("w1");
        w.ewma = Some(ewma(100.0, 10.0)); // 100 tok/s single stream
        w.status.active = 3; // admission makes 4: 100 / 1.75 = 57.1
        assert_eq!(check(&SloFloor, &j, &w, &Ledger::new(), &config), Ok(()));
        w.status.active = 4; // admission makes 5: 100 / 2 = 50, not below
        assert_eq!(check(&SloFloor, &j, &w, &Ledger::new(), &config), Ok(()));
        let mut l = Ledger::new();
        l.reserve("w1", "x", 1, 0).unwrap(); // 6: 100 / 2.25 = 44.4
        assert_eq!(
            check(&SloFloor, &j, &w, &l, &config),
            Err("below SLO: predicted 44.4 tok/s per request at 6 concurrent (single-stream 100.0, slowdown 0.25) < floor 50 tok/s".into())
        );
    }

    #[test]
    fn passes_when_disabled_or_unknown() {
        let mut config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.ewma = Some(ewma(100.0, 1000.0)); // 1 tok/s
        assert_eq!(
            check(&SloFloor, &job("m"), &w, &Ledger::new(), &config),
            Ok(())
        );
        config.slo_min_tok_s = Some(10.0);
        assert!(check(&SloFloor, &job("m"), &w, &Ledger::new(), &config).is_err());
        w.ewma = None;
        assert_eq!(
            check(&SloFloor, &job("m"), &w, &Ledger::new(), &config),
            Ok(())
        );
    }
}
