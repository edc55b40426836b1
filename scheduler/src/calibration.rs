//! Rate calibration: how far a worker's decode-rate forecasts have been from what its jobs
//! then did, learnt online from the dispatcher's own record.
//!
//! The performance model predicts a step time; the forecast of a job's whole-decode rate
//! adds assumptions on top of it that no fit can check: the batch stays at its size after
//! admission for the job's whole life, the job writes the model's mean output, every stall
//! charged to it lands. Whether those assumptions err high or low depends on the workload
//! and the server (how fast jobs leave, how prefills are chunked), so no constant corrects
//! them. Each job's *last* forecast (made at its own admission, then again at every later
//! admission on its worker) is compared with the rate it then measured, and the worker's
//! factor is the geometric mean of `actual / forecast` over its recent jobs. Admission
//! multiplies its forecasts by the factor before comparing them with a floor, so a worker
//! whose forecasts have been pessimistic takes the streams it has shown it can serve, and
//! one whose forecasts have been optimistic takes fewer.
//!
//! Invariants:
//! - The factor is 1 for a worker with no evidence and approaches the data as evidence
//!   grows ([`PRIOR_JOBS`] jobs' worth of weight on "no correction").
//! - It stays within [[`MIN_FACTOR`], [`MAX_FACTOR`]]: a broken clock or a stuck job can
//!   move it, but never make a worker look free or unusable.
//! - Samples that say nothing about decode (non-finite, non-positive) are ignored.

use std::collections::HashMap;

/// Evidence, in jobs, that the neutral factor 1 is worth against the data.
pub const PRIOR_JOBS: f64 = 5.0;
/// Memory of the running mean once it is full: about the last 50 jobs on the worker, so a
/// change of workload is followed within a minute or two of traffic.
pub const MEMORY_JOBS: f64 = 50.0;
/// Bounds of the factor.
pub const MIN_FACTOR: f64 = 0.5;
pub const MAX_FACTOR: f64 = 2.0;

/// Outputs shorter than this teach nothing: their rate is a handful of intervals, noise
/// more than a measurement.
pub const MIN_OUTPUT_TOKENS: u32 = 8;

/// A completed job's whole-decode rate, tokens/s, from its output length and its mean time
/// per output token after the first; `None` when it says too little.
pub fn measured_tok_s(output_tokens: u32, tpot_ms: Option<f64>) -> Option<f64> {
    let tpot = tpot_ms.filter(|t| t.is_finite() && *t > 0.0)?;
    (output_tokens >= MIN_OUTPUT_TOKENS).then(|| 1000.0 / tpot)
}

/// One worker's running mean of `ln(actual / forecast)`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LogRatio {
    mean: f64,
    /// Jobs seen, saturating at [`MEMORY_JOBS`] (then the mean is an EWMA).
    weight: f64,
}

/// Per-worker decode-rate calibration.
#[derive(Debug, Clone, Default)]
pub struct RateCalibration {
    workers: HashMap<String, LogRatio>,
}

impl RateCalibration {
    pub fn new() -> Self {
        Self::default()
    }

    /// A job on `worker_id` forecast at `forecast_tok_s` decoded at `actual_tok_s`.
    pub fn observe(&mut self, worker_id: &str, forecast_tok_s: f64, actual_tok_s: f64) {
        let usable = |v: f64| v.is_finite() && v > 0.0;
        if !usable(forecast_tok_s) || !usable(actual_tok_s) {
            return;
        }
        let x = (actual_tok_s / forecast_tok_s).ln();
        let r = self.workers.entry(worker_id.to_owned()).or_default();
        r.weight = (r.weight + 1.0).min(MEMORY_JOBS);
        r.mean += (x - r.mean) / r.weight;
    }

    /// The factor to multiply `worker_id`'s decode-rate forecasts by (1 without evidence).
    pub fn factor(&self, worker_id: &str) -> f64 {
        self.workers.get(worker_id).map_or(1.0, |r| {
            let shrunk = r.mean * r.weight / (r.weight + PRIOR_JOBS);
            shrunk.exp().clamp(MIN_FACTOR, MAX_FACTOR)
        })
    }

    /// Jobs the worker's factor rests on (at most [`MEMORY_JOBS`]).
    pub fn evidence(&self, worker_id: &str) -> f64 {
        self.workers.get(worker_id).map_or(0.0, |r| r.weight)
    }

    /// Forget a worker (it left the registry).
    pub fn forget(&mut self, worker_id: &str) {
        self.workers.remove(worker_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_real_decode_is_measured() {
        assert_eq!(measured_tok_s(100, Some(25.0)), Some(40.0));
        assert_eq!(measured_tok_s(MIN_OUTPUT_TOKENS - 1, Some(25.0)), None);
        assert_eq!(measured_tok_s(100, None), None);
        assert_eq!(measured_tok_s(100, Some(0.0)), None);
        assert_eq!(measured_tok_s(100, Some(f64::NAN)), None);
    }

    #[test]
    fn no_evidence_means_no_correction() {
        let c = RateCalibration::new();
        assert_eq!(c.factor("w"), 1.0);
        assert_eq!(c.evidence("w"), 0.0);
    }

    #[test]
    fn a_pessimistic_forecast_is_loosened_by_what_the_jobs_showed() {
        let mut c = RateCalibration::new();
        for _ in 0..200 {
            c.observe("w", 30.0, 39.0);
        }
        // 50 jobs of memory against 5 of prior: ln(1.3) · 50/55.
        let expected = (1.3f64.ln() * 50.0 / 55.0).exp();
        assert!((c.factor("w") - expected).abs() < 1e-9, "{}", c.factor("w"));
        assert_eq!(c.factor("other"), 1.0, "workers learn apart");
    }

    #[test]
    fn an_optimistic_forecast_is_tightened() {
        let mut c = RateCalibration::new();
        for _ in 0..100 {
            c.observe("w", 40.0, 30.0);
        }
        assert!(c.factor("w") < 0.8, "{}", c.factor("w"));
    }

    #[test]
    fn few_jobs_move_it_little_and_recent_jobs_count_most() {
        let mut c = RateCalibration::new();
        c.observe("w", 30.0, 60.0);
        let one = c.factor("w");
        assert!(
            one > 1.0 && one < 1.2,
            "one job of 2x moves it by ln2/6: {one}"
        );
        for _ in 0..50 {
            c.observe("w", 30.0, 60.0);
        }
        for _ in 0..300 {
            c.observe("w", 30.0, 30.0);
        }
        assert!(
            (c.factor("w") - 1.0).abs() < 0.01,
            "old evidence fades: {}",
            c.factor("w")
        );
    }

    #[test]
    fn the_factor_is_bounded_and_junk_is_ignored() {
        let mut c = RateCalibration::new();
        for _ in 0..100 {
            c.observe("w", 1.0, 1_000.0);
        }
        assert_eq!(c.factor("w"), MAX_FACTOR);
        let mut c = RateCalibration::new();
        for bad in [f64::NAN, f64::INFINITY, 0.0, -3.0] {
            c.observe("w", bad, 30.0);
            c.observe("w", 30.0, bad);
        }
        assert_eq!(c.evidence("w"), 0.0);
        c.observe("w", 30.0, 30.0);
        c.forget("w");
        assert_eq!(c.evidence("w"), 0.0);
    }
}
