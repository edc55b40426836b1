//! Under the concurrency cap, reservations included: two generations on one GPU make both
//! unpredictably slow, so a worker takes at most `max_concurrency` requests (its own figure,
//! or `default_max_concurrency` when it reports 0). The count is
//! [`WorkerLoad::effective_active`](crate::WorkerLoad): reported work plus reservations the
//! worker has not listed yet, so a burst cannot overshoot the cap between heartbeats.
//!
//! *Warm-up allowance.* A worker whose performance fit has seen fewer than
//! [`WARM_UP_SAMPLES`] jobs holds at most [`WARM_UP_FIRST_JOBS`] more requests than the
//! jobs its fit has seen, so what admission trusts of it grows with the evidence. The fit
//! starts from an optimistic prior (a new worker must get work to be learnt), and a fit of
//! three jobs can still look far faster than the worker is: on a fresh live system one such
//! worker kept passing the rate and TTFT predictions while every learnt worker was refused
//! on its floors, and took 17 jobs in 1.6 s, whose streams fell to 3 tok/s while three GPUs
//! idled.
//!
//! *Live evidence counts too.* A job teaches the fit only when it completes, seconds after
//! it started; with the completed jobs alone, a fresh cluster held every GPU at two or three
//! requests for its first jobs' whole length and queued the rest (the policy lab's
//! `shared_prefix` at 70 % load, seed 8: waits of up to 7 s, 93.7 % within the SLO where least
//! connections kept 100 %). So the streams the worker is decoding *now*, each measured by
//! its agent past its first tokens ([`metronome_protocol::LiveDecode`]), count as evidence
//! when the slowest of them decodes at or above the model's rate floor: the worker runs
//! that many well, and may hold [`WARM_UP_FIRST_JOBS`] more. The allowance then grows as
//! fast as the worker shows it copes (like a slow start), and stops growing the moment a
//! stream falls under the floor.
//!
//! The allowance depends only on the worker (and its model's floor), so its refusal still
//! holds for every job of the model ([`super::refuses_every_job_of_the_model`]). A worker
//! that reports no fit (an agent that predates it) is held to its cap alone.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};
use crate::perf::rls::WARM_UP_SAMPLES;

/// Requests a worker may hold beyond the jobs its performance fit has seen, while the fit
/// is in its warm-up. Two: with one, a new worker's first job would run alone, and its fit
/// would see no job beside another (what teaches it the cost of a stream) until that job
/// ended.
pub const WARM_UP_FIRST_JOBS: u32 = 2;

pub struct UnderConcurrencyCap;

/// The most requests a worker may hold now, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ceiling {
    /// Its concurrency cap.
    Cap(u32),
    /// Its warm-up allowance: the fit has seen `samples` jobs, and `live` streams decode
    /// now at or above the floor.
    WarmUp {
        allowance: u32,
        samples: u64,
        live: u32,
    },
}

impl Ceiling {
    fn of(ctx: &FilterContext<'_>) -> Self {
        let cap = ctx.load.max_concurrency;
        match ctx.view.status.perf {
            Some(perf) if perf.samples < WARM_UP_SAMPLES => {
                let live = live_evidence(ctx);
                // samples < WARM_UP_SAMPLES, so it fits a u32.
                let allowance = WARM_UP_FIRST_JOBS.saturating_add((perf.samples as u32).max(live));
                if allowance < cap {
                    Ceiling::WarmUp {
                        allowance,
                        samples: perf.samples,
                        live,
                    }
                } else {
                    Ceiling::Cap(cap)
                }
            }
            _ => Ceiling::Cap(cap),
        }
    }

    fn limit(self) -> u32 {
        match self {
            Ceiling::Cap(n) => n,
            Ceiling::WarmUp { allowance, .. } => allowance,
        }
    }
}

/// Streams the worker's last heartbeat showed decoding, measured, the slowest at or above its
/// model's rate floor (0 when it showed none, or one below the floor).
fn live_evidence(ctx: &FilterContext<'_>) -> u32 {
    let status = &ctx.view.status;
    let floor = ctx.config.slo_for(&status.model, None).min_tok_s;
    status
        .decoding
        .filter(|d| d.measured > 0 && d.slowest_tok_s.is_finite() && d.slowest_tok_s >= floor)
        .map_or(0, |d| d.measured)
}

impl Filter for UnderConcurrencyCap {
    fn code(&self) -> RejectionCode {
        RejectionCode::AtConcurrencyCap
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.load.effective_active < Ceiling::of(ctx).limit()
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let l = ctx.load;
        let ceiling = Ceiling::of(ctx);
        if l.effective_active < ceiling.limit() {
            return Ok(());
        }
        match ceiling {
            Ceiling::Cap(max) => Err(format!(
                "at cap: {} active + {} reserved >= max {max}",
                l.reported_active, l.unreported_reservations
            )),
            Ceiling::WarmUp {
                allowance,
                samples,
                live,
            } => Err(format!(
                "warming up: {} active + {} reserved >= {allowance} allowed while its \
                 performance fit has seen {samples} of {WARM_UP_SAMPLES} jobs and {live} \
                 streams decode at its floor or above (cap {})",
                l.reported_active, l.unreported_reservations, l.max_concurrency
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};

    #[test]
    fn counts_unreported_reservations_once() {
        let config = SchedulerConfig::default();
        let j = job("m");
        let mut w = worker("w1");
        w.status.active = 3;
        w.status.in_flight = vec!["a".into(), "b".into(), "c".into()];
        let mut l = Ledger::new();
        for id in ["a", "b", "c"] {
            l.reserve("w1", id, 1, 0).unwrap();
        }
        // 3 reported (all of them reserved too): one slot left.
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
        l.reserve("w1", "d", 1, 0).unwrap();
        assert_eq!(
            check(&UnderConcurrencyCap, &j, &w, &l, &config),
            Err("at cap: 3 active + 1 reserved >= max 4".into())
        );
    }

    #[test]
    fn zero_reported_cap_uses_the_default() {
        let config = SchedulerConfig {
            default_max_concurrency: 2,
            ..SchedulerConfig::default()
        };
        let mut w = worker("w1");
        w.status.max_concurrency = 0;
        w.status.active = 2;
        assert_eq!(
            check(&UnderConcurrencyCap, &job("m"), &w, &Ledger::new(), &config),
            Err("at cap: 2 active + 0 reserved >= max 2".into())
        );
    }

    /// `w` with a performance fit that has seen `samples` jobs (the prior's coefficients:
    /// the allowance reads only the count).
    fn fitted(mut w: crate::WorkerView, samples: u64) -> crate::WorkerView {
        w.status.perf = Some(metronome_protocol::PerfCoefficients {
            samples,
            ..SchedulerConfig::default().perf_prior.coefficients()
        });
        w
    }

    /// A worker holding `n` reported jobs.
    fn holding(mut w: crate::WorkerView, n: usize) -> crate::WorkerView {
        w.status.in_flight = (0..n).map(|i| format!("r{i}")).collect();
        w.status.active = n as u32;
        w
    }

    #[test]
    fn a_young_fit_holds_two_more_jobs_than_it_has_seen() {
        let config = SchedulerConfig::default();
        let j = job("m");
        let mut big = worker("w1");
        big.status.max_concurrency = 64;
        let l = Ledger::new();
        // Three jobs seen: five allowed.
        let w = fitted(holding(big.clone(), 4), 3);
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
        let w = fitted(holding(big.clone(), 5), 3);
        assert_eq!(
            check(&UnderConcurrencyCap, &j, &w, &l, &config),
            Err(
                "warming up: 5 active + 0 reserved >= 5 allowed while its performance fit \
                 has seen 3 of 10 jobs and 0 streams decode at its floor or above (cap 64)"
                    .into()
            )
        );
        // A fresh fit: two, reservations counted like reported jobs.
        let w = fitted(big.clone(), 0);
        let mut booked = Ledger::new();
        booked.reserve("w1", "a", 1, 0).unwrap();
        assert_eq!(
            check(&UnderConcurrencyCap, &j, &w, &booked, &config),
            Ok(())
        );
        booked.reserve("w1", "b", 1, 0).unwrap();
        assert!(check(&UnderConcurrencyCap, &j, &w, &booked, &config)
            .unwrap_err()
            .starts_with("warming up: 0 active + 2 reserved >= 2 allowed"));
        // Out of its warm-up, the cap alone.
        let w = fitted(holding(big.clone(), 40), WARM_UP_SAMPLES);
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
        // No fit reported: the cap alone.
        let w = holding(big, 40);
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
    }

    /// `w` showing `measured` of its `streams` decoding, the slowest at `tok_s`.
    fn decoding(
        mut w: crate::WorkerView,
        streams: u32,
        measured: u32,
        tok_s: f64,
    ) -> crate::WorkerView {
        w.status.decoding = Some(metronome_protocol::LiveDecode {
            streams,
            measured,
            slowest_tok_s: tok_s,
        });
        w
    }

    #[test]
    fn streams_decoding_at_the_floor_count_as_evidence() {
        let config = SchedulerConfig::default();
        let floor = config.slo_for("m", None).min_tok_s;
        let j = job("m");
        let mut big = worker("w1");
        big.status.max_concurrency = 64;
        let l = Ledger::new();
        // One job seen, six streams running, five of them measured at the floor: seven
        // allowed (two more than the five shown to decode well).
        let young = fitted(big.clone(), 1);
        let w = decoding(holding(young.clone(), 6), 6, 5, floor);
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
        let w = decoding(holding(young.clone(), 7), 7, 5, floor);
        assert!(check(&UnderConcurrencyCap, &j, &w, &l, &config)
            .unwrap_err()
            .starts_with("warming up: 7 active + 0 reserved >= 7 allowed"));
        // The slowest stream under the floor: the completed jobs alone (1 + 2 = 3).
        let w = decoding(holding(young.clone(), 3), 6, 5, floor - 1.0);
        assert_eq!(
            check(&UnderConcurrencyCap, &j, &w, &l, &config),
            Err(
                "warming up: 3 active + 0 reserved >= 3 allowed while its performance fit \
                 has seen 1 of 10 jobs and 0 streams decode at its floor or above (cap 64)"
                    .into()
            )
        );
        // Nothing measured yet: likewise.
        let w = decoding(holding(young, 3), 3, 0, 0.0);
        assert!(check(&UnderConcurrencyCap, &j, &w, &l, &config).is_err());
        // More completed jobs than live evidence: the larger counts.
        let w = decoding(holding(fitted(big, 6), 7), 7, 2, floor + 10.0);
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
    }

    #[test]
    fn a_cap_below_the_allowance_is_the_reason_given() {
        let config = SchedulerConfig::default();
        // Cap 4, eight jobs seen (allowance 10): the cap refuses.
        let w = fitted(holding(worker("w1"), 4), 8);
        assert_eq!(
            check(&UnderConcurrencyCap, &job("m"), &w, &Ledger::new(), &config),
            Err("at cap: 4 active + 0 reserved >= max 4".into())
        );
    }

    #[test]
    fn the_warm_up_refusal_holds_for_every_job_of_the_model() {
        assert!(crate::filter::refuses_every_job_of_the_model(
            UnderConcurrencyCap.code()
        ));
    }
}
