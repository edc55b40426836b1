//! Placing a job where it does least harm, when no worker can admit it without predicting a
//! running job below its floor and waiting any longer would spend its TTFT budget.
//!
//! Waiting then costs the job its SLO for certain, while placing it costs the running jobs
//! only what the forecast predicts, and the forecast is an upper bound on that harm (it
//! charges every running job the largest batch for the rest of its life and its whole stall
//! history). So the job is placed, through every filter except the protection of running
//! jobs ([`filter::LEAST_HARM`]), on the worker where the fewest running jobs are predicted
//! below their floor, then the smallest total shortfall, then the best score, but never
//! where more than [`MAX_TRADED_MISSES`] would be: trading two predicted misses for one
//! saved job is a loss even when the forecast is pessimistic.
//!
//! When to do it is the caller's call (the engine does it at the last moment the job's
//! predicted TTFT still fits its budget); this module only chooses.

use crate::evaluate::{rank, Evaluation};
use crate::{filter, JobRequest, Ledger, SchedulerConfig, WorkerView};

/// Most running jobs a least-harm placement may predict below their floor.
pub const MAX_TRADED_MISSES: u32 = 1;

/// The least-harm placement of `job`, with every candidate scored; `winner` is `None` when
/// every candidate would predict more than [`MAX_TRADED_MISSES`] misses.
pub fn least_harm(
    job: &JobRequest,
    workers: &[WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
) -> Evaluation {
    least_harm_within(
        job,
        workers,
        ledger,
        config,
        now_ms,
        MAX_TRADED_MISSES,
        f64::INFINITY,
    )
}

/// [`least_harm`] with another bound on the running jobs predicted below their floor, among
/// the workers that would also give the job its first token within `max_ttft_ms`
/// (predicted; infinite for no bound): the second serves a job that some worker admits,
/// but only where its first token comes late, when a few predicted misses elsewhere would
/// start it sooner.
pub fn least_harm_within(
    job: &JobRequest,
    workers: &[WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
    max_misses: u32,
    max_ttft_ms: f64,
) -> Evaluation {
    let ranked = rank(&filter::LEAST_HARM, job, workers, ledger, config, now_ms);
    // Best score first, so the stable minimum below breaks harm ties by score.
    let pick = ranked
        .order
        .iter()
        .map(|&i| i as usize)
        .filter(|&i| {
            let f = &ranked.candidates[i].forecast;
            f.violations <= max_misses && f.ttft_ms <= max_ttft_ms
        })
        .min_by(|&a, &b| {
            let (fa, fb) = (
                &ranked.candidates[a].forecast,
                &ranked.candidates[b].forecast,
            );
            fa.violations
                .cmp(&fb.violations)
                .then(fa.shortfall_tok_s.total_cmp(&fb.shortfall_tok_s))
        });
    let mut candidates = Vec::with_capacity(ranked.candidates.len());
    if let Some(p) = pick {
        candidates.push(ranked.candidates[p].to_score());
    }
    candidates.extend(
        ranked
            .order
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| Some(i) != pick)
            .map(|i| ranked.candidates[i].to_score()),
    );
    Evaluation {
        winner: pick.map(|p| ranked.candidates[p].worker_id().to_owned()),
        candidates,
        scoring: crate::evaluate::scoring(config),
        rejected: ranked.rejected,
        cost: job.cost_estimate(),
        winner_stall_ms: pick.map_or(0.0, |p| ranked.candidates[p].forecast.stall_ms),
        affinity: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evaluate;
    use crate::ledger::JobProfile;
    use crate::testutil::*;
    use metronome_protocol::PerfCoefficients;

    fn perf() -> PerfCoefficients {
        PerfCoefficients {
            step_base_ms: 20.0,
            step_per_stream_ms: 0.0,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.2,
            ttft_base_ms: 10.0,
            prefill_per_token_ms: 0.1,
            ttft_per_stream_ms: 0.0,
            step_error_ms: 0.0,
            samples: 50,
        }
    }

    /// A worker running `short` jobs of 8 tokens (slack 107 ms each) beside nothing else.
    fn busy(id: &str, short: usize, ledger: &mut Ledger) -> WorkerView {
        let mut w = worker(id);
        w.status.perf = Some(perf());
        w.status.max_concurrency = 64;
        for k in 0..short {
            let p = JobProfile {
                prompt_tokens: 10,
                protected_output: 8.0,
                min_tok_s: 30.0,
                ..Default::default()
            };
            ledger
                .reserve_profiled(id, &format!("{id}-{k}"), 20, p, NOW)
                .unwrap();
        }
        w
    }

    #[test]
    fn picks_the_worker_with_the_fewest_predicted_misses_and_never_more_than_one() {
        let mut l = Ledger::new();
        let workers = [
            busy("a", 2, &mut l),
            busy("b", 1, &mut l),
            busy("c", 3, &mut l),
        ];
        let mut j = job("m");
        j.prompt_tokens = 2_000; // a 400 ms stall: every short job would miss
        assert_eq!(
            evaluate(&j, &workers, &l, &SchedulerConfig::default(), NOW).winner,
            None
        );
        let e = least_harm(&j, &workers, &l, &SchedulerConfig::default(), NOW);
        assert_eq!(e.winner.as_deref(), Some("b"));
        assert_eq!(e.candidates[0].worker_id, "b");
        assert_eq!(e.candidates.len(), 3);
        assert!(e.winner_stall_ms > 0.0);
        let workers = [
            busy("a", 2, &mut Ledger::new()),
            busy("c", 3, &mut Ledger::new()),
        ];
        let mut l = Ledger::new();
        let workers: Vec<WorkerView> = workers
            .iter()
            .map(|w| {
                busy(
                    w.worker_id(),
                    if w.worker_id() == "a" { 2 } else { 3 },
                    &mut l,
                )
            })
            .collect();
        assert_eq!(
            least_harm(&j, &workers, &l, &SchedulerConfig::default(), NOW).winner,
            None
        );
    }

    #[test]
    fn within_a_ttft_ceiling_only_workers_that_start_the_job_by_then_are_picked() {
        let mut l = Ledger::new();
        // Equal harm on both (one short job each would miss); `a` has 300 ms of prefill
        // queued, so the 2,000-token job starts at 10 + 0.1 * (2,000 + 3,000 + 10) = 511 ms
        // there and at 211 ms on `b` (the running job's 10-token prompt counts as queued).
        let mut a = busy("a", 1, &mut l);
        a.status.prefill_pending_tokens = 3_000;
        let workers = [a, busy("b", 1, &mut l)];
        let mut j = job("m");
        j.prompt_tokens = 2_000;
        let c = SchedulerConfig::default();
        let ttft = |e: &Evaluation| {
            e.winner_score()
                .and_then(|s| s.prediction)
                .map(|p| p.ttft_ms)
        };
        let any = least_harm_within(&j, &workers, &l, &c, NOW, 4, f64::INFINITY);
        assert!(any.winner.is_some());
        let soon = least_harm_within(&j, &workers, &l, &c, NOW, 4, 300.0);
        assert_eq!(soon.winner.as_deref(), Some("b"));
        assert!(
            ttft(&soon).is_some_and(|t| (t - 211.0).abs() < 1e-6),
            "{:?}",
            ttft(&soon)
        );
        let late = least_harm_within(&j, &workers, &l, &c, NOW, 4, 100.0);
        assert_eq!(late.winner, None, "no worker starts it within 100 ms");
        assert_eq!(late.candidates.len(), 2, "every candidate is still scored");
    }

    #[test]
    fn still_refuses_a_worker_that_would_start_the_job_too_late_or_too_slowly() {
        let mut l = Ledger::new();
        let mut w = busy("a", 1, &mut l);
        w.status.prefill_pending_tokens = 50_000; // 5 s of prefill ahead
        let e = least_harm(&job("m"), &[w], &l, &SchedulerConfig::default(), NOW);
        assert_eq!(e.winner, None);
        assert_eq!(
            e.rejected[0].code,
            metronome_protocol::RejectionCode::TtftOverBudget
        );
    }
}
