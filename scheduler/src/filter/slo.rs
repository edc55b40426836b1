//! SLO floor (when `slo_min_tok_s` is set): admit only if the predicted per-request token
//! rate after admission stays above the floor, so a new job never drags every request on
//! the worker below the promised rate.
//!
//! Prediction: `rate(n) = single_stream_rate / (1 + batch_slowdown * (n - 1))` with `n` the
//! effective active count plus this job, and `single_stream_rate` the worker's decode rate
//! `1000 / tpot_ms` (or its tok/s EWMA when no TPOT was measured). The decode rate is what
//! the SLO promises (tokens per second *after* the first token); the tok/s EWMA also counts
//! the time to the first token, so for long prompts it would judge even an idle card too
//! slow. The EWMA was measured under the load of its day, so it tends to underestimate the
//! single-stream rate: the filter errs on the safe side.
//!
//! Two cases always pass. A worker with no EWMA samples cannot be judged (the latency and
//! job-cost terms say they are unavailable), otherwise a fresh worker could never earn its
//! first sample. An idle worker (`n = 1`) slows nobody down by taking the job and gives it
//! the best rate it has; refusing it would also starve it for good, since only completions
//! refresh an EWMA that a burst of interference pushed below the floor.

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
        let n = ctx.load.after_admission();
        if n <= 1 {
            return Ok(());
        }
        let Some(single) = ctx.view.ewma_with_samples().and_then(|e| {
            e.tpot_estimate_ms()
                .map(|tpot| 1000.0 / tpot)
                .or_else(|| e.rate_estimate_tok_s())
        }) else {
            return Ok(());
        };
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
        let mut config = SchedulerConfig {
            slo_min_tok_s: None,
            ..SchedulerConfig::default()
        };
        let mut w = worker("w1");
        w.ewma = Some(ewma(100.0, 1000.0)); // 1 tok/s
        w.status.active = 1; // an idle worker always passes; this one is not idle
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

    #[test]
    fn an_idle_worker_always_passes() {
        let config = SchedulerConfig {
            slo_min_tok_s: Some(30.0),
            ..SchedulerConfig::default()
        };
        let mut w = worker("w1");
        w.ewma = Some(ewma(100.0, 50.0)); // 20 tok/s, below the floor even alone
        w.status.active = 0;
        assert_eq!(
            check(&SloFloor, &job("m"), &w, &Ledger::new(), &config),
            Ok(())
        );
        w.status.active = 1;
        assert!(check(&SloFloor, &job("m"), &w, &Ledger::new(), &config).is_err());
    }

    #[test]
    fn judges_the_decode_rate_not_the_rate_including_the_first_token() {
        let config = SchedulerConfig {
            slo_min_tok_s: Some(30.0),
            batch_slowdown: 0.1,
            ..SchedulerConfig::default()
        };
        let mut w = worker("w1");
        // Long prompts: 13 tokens in 0.5 s including a 0.3 s TTFT is 26 tok/s overall,
        // but the decode runs at 60 tok/s.
        let mut e = ewma(300.0, 1000.0 / 60.0);
        e.tok_s = 26.0;
        w.ewma = Some(e);
        w.status.active = 1; // admission makes 2: 60 / 1.1 = 54.5
        assert_eq!(
            check(&SloFloor, &job("m"), &w, &Ledger::new(), &config),
            Ok(())
        );
    }
}
