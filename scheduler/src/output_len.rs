//! How many tokens a job will write, predicted from the one size hint its request carries
//! (`max_tokens`) and from what the model's completed jobs wrote: a per-model online
//! regression `output ≈ a + b · max_tokens`, clamped to `[1, max_tokens]`.
//!
//! Why it matters: admission protects each running job's whole-decode rate, and how much
//! prefill stall a job can absorb grows with its length (a 600-token job shrugs off a stall
//! that pushes a 60-token job under its floor). A job predicted shorter than it is looks
//! fragile, and every GPU it runs on turns work away for it.
//!
//! Why a regression: how the output relates to `max_tokens` depends on the clients. Some
//! ask for about what they need (outputs close to `max_tokens`), some always ask for a large
//! cap (outputs unrelated to it), most are a mix. The fit learns which from the traffic:
//! `b → 1, a → 0` when outputs follow `max_tokens`, `b → 0, a →` the mean output when they
//! do not, in between for a mix. It starts at the model's mean output with `b = 0`
//! (nothing assumed about `max_tokens` until the data shows it), and forgets with
//! λ = [`FORGETTING`] (about the last 200 jobs), so a change of clients is re-learnt.
//! Recursive least squares ([`crate::perf::Rls`]) with its covariance cap and residual
//! clipping.
//!
//! Beside the expected length it keeps how completed jobs compared with their prediction
//! (the last [`RATIOS_KEPT`] ratios): [`OutputLength::predict_low`] is the prediction times
//! their [`LOW_QUANTILE`], the length a running job is protected at. Where `max_tokens`
//! says what a job writes the ratios are 1 and nothing changes; where it says nothing, a job
//! expected to write the mean may well be one of the short ones, and a short job has the
//! least room for the stalls of later admissions.
//!
//! Invariants: a prediction is finite and in `[1, max_tokens]` (at least 1 for
//! `max_tokens` 0), the low prediction at most the prediction; samples with a non-finite or
//! non-positive size are ignored.

use serde::{Deserialize, Serialize};

use crate::perf::Rls;

/// Forgetting factor: an effective memory of about 200 completed jobs.
pub const FORGETTING: f64 = 0.995;

/// The output-length model of one model's traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputLength {
    /// `[intercept (tokens), slope (tokens per 1,000 max_tokens)]`.
    fit: Rls,
    /// The last [`RATIOS_KEPT`] ratios of a completed job's length to its prediction.
    #[serde(default)]
    ratios: std::collections::VecDeque<f64>,
    /// Their [`LOW_QUANTILE`].
    #[serde(default = "one")]
    low_ratio: f64,
}

fn one() -> f64 {
    1.0
}

/// Ratios of actual to predicted length kept for [`OutputLength::low_ratio`].
pub const RATIOS_KEPT: usize = 200;
/// The quantile of those ratios a running job is protected at.
pub const LOW_QUANTILE: f64 = 0.25;

impl OutputLength {
    /// A model that knows only a prior mean output (e.g. the model's output-length EWMA).
    pub fn new(prior_mean_tokens: f64) -> OutputLength {
        let mean = if prior_mean_tokens.is_finite() && prior_mean_tokens > 0.0 {
            prior_mean_tokens
        } else {
            1.0
        };
        // Loose priors, worth about one job: the data replaces them at once.
        OutputLength {
            fit: Rls::new(&[mean, 0.0], &[mean.max(100.0) * 2.0, 1_000.0]),
            ratios: std::collections::VecDeque::new(),
            low_ratio: 1.0,
        }
    }

    /// Fold in one completed job.
    pub fn observe(&mut self, max_tokens: u32, output_tokens: u32) {
        if max_tokens == 0 || output_tokens == 0 {
            return;
        }
        let before = self.predict(max_tokens);
        if self.fit.samples > 0 {
            if self.ratios.len() == RATIOS_KEPT {
                self.ratios.pop_front();
            }
            self.ratios.push_back(f64::from(output_tokens) / before);
            let mut sorted: Vec<f64> = self.ratios.iter().copied().collect();
            sorted.sort_by(f64::total_cmp);
            let i = ((sorted.len() - 1) as f64 * LOW_QUANTILE).round() as usize;
            self.low_ratio = sorted[i].min(1.0);
        }
        self.fit
            .update(&features(max_tokens), f64::from(output_tokens), FORGETTING);
    }

    /// Expected output of a job asking for `max_tokens`.
    pub fn predict(&self, max_tokens: u32) -> f64 {
        let max = f64::from(max_tokens.max(1));
        let p = self.fit.predict(&features(max_tokens));
        if p.is_finite() {
            p.clamp(1.0, max)
        } else {
            max
        }
    }

    /// A length the job is unlikely to fall short of: the prediction times the low quantile
    /// of how completed jobs compared with theirs (at most the prediction).
    pub fn predict_low(&self, max_tokens: u32) -> f64 {
        (self.predict(max_tokens) * self.low_ratio).max(1.0)
    }

    /// Completed jobs folded in.
    pub fn samples(&self) -> u64 {
        self.fit.samples
    }
}

fn features(max_tokens: u32) -> [f64; 2] {
    [1.0, f64::from(max_tokens) / 1000.0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_that_outputs_follow_max_tokens() {
        let mut m = OutputLength::new(200.0);
        assert!(
            (m.predict(600) - 200.0).abs() < 1e-9,
            "the prior is the mean"
        );
        for i in 0..60u32 {
            let n = 50 + (i * 37) % 700;
            m.observe(n, n);
        }
        for n in [60, 200, 600] {
            let p = m.predict(n);
            assert!((p - f64::from(n)).abs() < 0.05 * f64::from(n), "{n}: {p}");
        }
    }

    #[test]
    fn learns_the_mean_when_max_tokens_says_nothing() {
        let mut m = OutputLength::new(500.0);
        // Clients ask for 256, 1024 or 4096 whatever they write; outputs average 150.
        let caps = [256u32, 1024, 4096];
        let outs = [100u32, 150, 200];
        for i in 0..300 {
            m.observe(caps[i % 3], outs[(i / 3) % 3]);
        }
        for cap in caps {
            let p = m.predict(cap);
            assert!((p - 150.0).abs() < 15.0, "{cap}: {p}");
        }
    }

    #[test]
    fn the_low_prediction_follows_how_far_short_jobs_fell() {
        let mut m = OutputLength::new(200.0);
        assert_eq!(
            m.predict_low(2048),
            m.predict(2048),
            "nothing seen: no margin"
        );
        // max_tokens says nothing; outputs spread from 50 to 350.
        for i in 0..200u32 {
            m.observe(2048, 50 + (i * 37) % 301);
        }
        let (mean, low) = (m.predict(2048), m.predict_low(2048));
        assert!((mean - 200.0).abs() < 25.0, "{mean}");
        // A quarter of the outputs are under ~125 tokens.
        assert!((low - 125.0).abs() < 25.0, "{low}");
        // Outputs that follow max_tokens exactly leave no margin.
        let mut exact = OutputLength::new(200.0);
        for i in 0..200u32 {
            let n = 50 + (i * 37) % 700;
            exact.observe(n, n);
        }
        assert!(exact.predict_low(300) > 0.95 * exact.predict(300));
    }

    #[test]
    fn predictions_stay_within_one_and_max_tokens() {
        let mut m = OutputLength::new(f64::NAN);
        for _ in 0..20 {
            m.observe(4_000, 4_000);
        }
        assert!(m.predict(10) <= 10.0);
        assert!(m.predict(0) >= 1.0 && m.predict(0) <= 1.0);
        m.observe(0, 10);
        m.observe(10, 0);
        assert_eq!(m.samples(), 20, "empty sizes are ignored");
    }
}
