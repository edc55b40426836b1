//! TTFT budget: admit only where the job's predicted time to first token fits in what is
//! left of its TTFT target after the time it already waited. A worker that would start it
//! too late is refused, so the job waits for one that can start it in time, which is what
//! spreads prefills instead of stacking them on one busy card.
//!
//! Two cases pass: an idle worker (nothing would start it sooner there than now) and a job
//! whose budget is already spent (`ttft_remaining_ms = None`): it can no longer meet its
//! TTFT anywhere, so holding it back only adds to its delay; the rate floor still protects
//! the jobs it would join.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct TtftBudget;

impl Filter for TtftBudget {
    fn code(&self) -> RejectionCode {
        RejectionCode::TtftOverBudget
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let Some(remaining) = ctx.job.ttft_remaining_ms else {
            return Ok(());
        };
        let f = ctx.forecast();
        if f.streams_before == 0 || f.ttft_ms <= remaining {
            return Ok(());
        }
        Err(format!(
            "TTFT over budget: predicted {:.0} ms ({:.0} prompt tokens ahead, {} streams) > {:.0} ms left of {} ms",
            f.ttft_ms, f.pending_prefill_tokens, f.streams_before, remaining, ctx.job.slo.ttft_ms
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};
    use metronome_protocol::PerfCoefficients;

    #[test]
    fn refuses_a_busy_worker_that_would_start_the_job_too_late() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.status.perf = Some(PerfCoefficients {
            step_base_ms: 20.0,
            step_per_stream_ms: 0.0,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.0,
            ttft_base_ms: 0.0,
            prefill_per_token_ms: 1.0,
            ttft_per_stream_ms: 0.0,
            step_error_ms: 0.0,
            samples: 9,
        });
        w.status.active = 1;
        w.status.prefill_pending_tokens = 1_850; // + 100 own = 1 950 ms
        let j = job("m");
        assert_eq!(check(&TtftBudget, &j, &w, &Ledger::new(), &config), Ok(()));
        let late = j.clone().waited(100); // 1 900 ms left
        let err = check(&TtftBudget, &late, &w, &Ledger::new(), &config).unwrap_err();
        assert!(
            err.starts_with("TTFT over budget: predicted 1950 ms"),
            "{err}"
        );
        // Budget spent: no longer judged.
        let spent = j.clone().waited(5_000);
        assert_eq!(
            check(&TtftBudget, &spent, &w, &Ledger::new(), &config),
            Ok(())
        );
        // Idle: always.
        w.status.active = 0;
        assert_eq!(
            check(&TtftBudget, &late, &w, &Ledger::new(), &config),
            Ok(())
        );
    }
}
