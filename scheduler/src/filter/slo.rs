//! SLO rate floor: admit only where the job's own predicted decode rate, and the predicted
//! whole-decode rate of every job already running there, stay at or above their floors
//! ([`crate::forecast`] says how they are predicted). This is what keeps the token rate of
//! admitted streams steady: a worker takes more work exactly while its measured
//! performance model says every stream on it keeps its promised rate, whatever its speed,
//! model or batch limit.
//!
//! An idle worker always passes: it slows nobody down and gives the job the best rate the
//! worker has, and refusing it would leave a GPU idle while the job waits. A job that
//! writes no tokens (`max_tokens` 0: an embedding) has no rate of its own to keep; the
//! running jobs' floors still hold against its prefill.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct SloFloor;

/// The job's own half of [`SloFloor`]: its own predicted decode rate at or above its floor
/// (idle workers pass). Used alone when a job is placed where it does least harm
/// ([`crate::least_harm`]), which weighs the running jobs' shortfalls instead of refusing.
pub struct OwnRateFloor;

impl Filter for OwnRateFloor {
    fn code(&self) -> RejectionCode {
        RejectionCode::BelowSloFloor
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let f = ctx.forecast();
        let floor = ctx.job.slo.min_tok_s;
        let judged_tok_s = 1000.0 / f.judged_step_ms;
        if f.streams_before == 0 || judged_tok_s >= floor || ctx.job.max_tokens == 0 {
            return Ok(());
        }
        Err(format!(
            "below SLO: the job would decode at {judged_tok_s:.1} tok/s beside {} streams (step {:.1} ms, {:.1} ms of it the fit's recent error) < floor {floor} tok/s",
            f.streams_before,
            f.judged_step_ms,
            f.judged_step_ms - f.step_ms
        ))
    }
}

impl Filter for SloFloor {
    fn code(&self) -> RejectionCode {
        RejectionCode::BelowSloFloor
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let f = ctx.forecast();
        OwnRateFloor.check(ctx)?;
        if let Some(v) = &f.worst_violation {
            return Err(format!(
                "below SLO: running job {} would fall to {:.1} tok/s < its floor {} tok/s (this prefill stalls it {:.0} ms, step {:.1} ms)",
                v.job_id, v.tok_s, v.min_tok_s, f.stall_ms, f.step_ms
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::JobProfile;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};
    use metronome_protocol::PerfCoefficients;

    fn perf(step_base_ms: f64) -> PerfCoefficients {
        PerfCoefficients {
            step_base_ms,
            step_per_stream_ms: 1.0,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.2,
            ttft_base_ms: 10.0,
            prefill_per_token_ms: 0.1,
            ttft_per_stream_ms: 0.0,
            step_error_ms: 0.0,
            samples: 50,
        }
    }

    fn profile(out: f64) -> JobProfile {
        JobProfile {
            prompt_tokens: 100,
            protected_output: out,
            min_tok_s: 30.0,
            ..Default::default()
        }
    }

    #[test]
    fn admits_while_every_stream_keeps_its_floor() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.status.max_concurrency = 256;
        w.status.perf = Some(perf(20.0));
        let mut l = Ledger::new();
        // Long jobs running: each new one adds 1 ms per step and a 20 ms stall.
        for i in 0..9 {
            l.reserve_profiled("w1", &format!("r{i}"), 200, profile(1_000.0), NOW)
                .unwrap();
        }
        // 10 streams after: step 29 ms = 34.5 tok/s, running ≈ 34.4 tok/s.
        assert_eq!(check(&SloFloor, &job("m"), &w, &l, &config), Ok(()));
        for i in 9..15 {
            l.reserve_profiled("w1", &format!("r{i}"), 200, profile(1_000.0), NOW)
                .unwrap();
        }
        // 16 streams after: step 35 ms = 28.6 tok/s.
        let err = check(&SloFloor, &job("m"), &w, &l, &config).unwrap_err();
        assert!(err.starts_with("below SLO:"), "{err}");
    }

    #[test]
    fn a_short_running_job_is_protected_from_a_long_prefill() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.status.perf = Some(perf(20.0));
        let mut l = Ledger::new();
        l.reserve_profiled("w1", "short", 200, profile(8.0), NOW)
            .unwrap();
        let mut j = job("m");
        j.prompt_tokens = 2_000; // 400 ms stall on an 8-token job
        let err = check(&SloFloor, &j, &w, &l, &config).unwrap_err();
        assert!(err.contains("running job short"), "{err}");
        j.prompt_tokens = 10; // 2 ms stall: fine
        assert_eq!(check(&SloFloor, &j, &w, &l, &config), Ok(()));
    }

    #[test]
    fn floors_are_judged_a_fit_error_slower_than_predicted() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        let mut l = Ledger::new();
        for i in 0..9 {
            l.reserve_profiled("w1", &format!("r{i}"), 200, profile(1_000.0), NOW)
                .unwrap();
        }
        // 10 streams after: step 29 ms, every stream at ≈ 34.4 tok/s.
        w.status.perf = Some(perf(20.0));
        assert_eq!(check(&SloFloor, &job("m"), &w, &l, &config), Ok(()));
        // A fit whose recent predictions were 3 ms a token off: judged at 32 ms, 31.2 tok/s.
        w.status.perf = Some(PerfCoefficients {
            step_error_ms: 3.0,
            ..perf(20.0)
        });
        assert_eq!(check(&SloFloor, &job("m"), &w, &l, &config), Ok(()));
        // 5 ms off: judged at 34 ms, 29.4 tok/s, under the floor though the prediction is
        // over it; the rejection says how much of the step is the error.
        w.status.perf = Some(PerfCoefficients {
            step_error_ms: 5.0,
            ..perf(20.0)
        });
        let err = check(&SloFloor, &job("m"), &w, &l, &config).unwrap_err();
        assert!(err.contains("5.0 ms of it the fit's recent error"), "{err}");
        // The same margin holds for the running jobs: a 5,000-token prefill stalls the one
        // running 100-token job for 1,000 ms, which leaves it at 32.3 tok/s at the 21 ms
        // step predicted (passes), and at 29.4 tok/s judged 3 ms slower (refused; the new
        // job itself would still decode at 41.7 tok/s).
        let mut one = Ledger::new();
        one.reserve_profiled("w1", "long", 200, profile(100.0), NOW)
            .unwrap();
        let mut j = job("m");
        j.prompt_tokens = 5_000;
        w.status.perf = Some(perf(20.0));
        assert_eq!(check(&SloFloor, &j, &w, &one, &config), Ok(()));
        w.status.perf = Some(PerfCoefficients {
            step_error_ms: 3.0,
            ..perf(20.0)
        });
        let err = check(&SloFloor, &j, &w, &one, &config).unwrap_err();
        assert!(err.contains("running job long"), "{err}");
    }

    #[test]
    fn an_idle_worker_always_passes_even_when_slow() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.status.perf = Some(perf(50.0)); // 20 tok/s alone
        assert_eq!(
            check(&SloFloor, &job("m"), &w, &Ledger::new(), &config),
            Ok(())
        );
        w.status.active = 1;
        let err = check(&SloFloor, &job("m"), &w, &Ledger::new(), &config).unwrap_err();
        assert!(err.contains("the job would decode at"), "{err}");
    }

    #[test]
    fn a_job_that_writes_nothing_has_no_floor_of_its_own_but_keeps_the_running_ones() {
        let config = SchedulerConfig::default();
        let mut w = worker("w1");
        w.status.perf = Some(perf(50.0)); // 20 tok/s alone: under the 30 tok/s floor
        w.status.active = 1;
        let mut embedding = job("m");
        embedding.max_tokens = 0;
        embedding.predicted_output_tokens = 0.0;
        assert_eq!(
            check(&SloFloor, &embedding, &w, &Ledger::new(), &config),
            Ok(())
        );
        // Its prefill still stalls a running job below that job's floor.
        w.status.perf = Some(perf(20.0));
        w.status.active = 0;
        let mut l = Ledger::new();
        l.reserve_profiled("w1", "short", 200, profile(8.0), NOW)
            .unwrap();
        embedding.prompt_tokens = 2_000;
        let err = check(&SloFloor, &embedding, &w, &l, &config).unwrap_err();
        assert!(err.contains("running job short"), "{err}");
    }
}
