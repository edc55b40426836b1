//! Recursive least squares with a Gaussian prior, exponential forgetting and a bounded
//! covariance: the online fit behind each worker's performance model.
//!
//! Algorithm (Ljung & Söderström, "Theory and Practice of Recursive Identification", 1983):
//! for a sample `(x, y)` with gain `k = P x / (λ + xᵀ P x)`, the coefficients move by
//! `k (y − xᵀ θ)` and the covariance becomes `(P − k xᵀ P) / λ`. Starting from
//! `θ = prior`, `P = diag(prior_sd²)` this is Bayesian linear regression with the prior as
//! the first "observation", so a coefficient no sample has excited yet stays at its prior
//! (e.g. the per-stream slope of a worker that has only ever run one job at a time) while
//! excited ones follow the data within a few dozen samples.
//!
//! Two guards keep the fit usable on a live system:
//! - *Bounded covariance.* Forgetting (λ < 1) inflates `P` in directions no sample excites,
//!   until one odd sample swings the coefficient wildly ("covariance wind-up"). Each
//!   diagonal entry is capped at its prior variance by a symmetric rescaling of its row and
//!   column, which keeps `P` positive semi-definite.
//! - *Clipped residuals.* Once the fit has seen `WARM_UP_SAMPLES` samples, a sample whose
//!   residual exceeds `OUTLIER_SCALES` times the running mean absolute residual plus a tenth
//!   of the prediction (a job stalled by a GC pause, a network hiccup) moves the fit only as
//!   far as that bound.
//!
//! Invariants: dimensions never change after construction; non-finite samples are ignored;
//! the state is plain data (serde), so it can be persisted and resumed exactly.

use serde::{Deserialize, Serialize};

/// Residuals beyond this many mean absolute residuals are clipped.
const OUTLIER_SCALES: f64 = 4.0;

/// Samples folded in before any residual is clipped. Until then the residual scale rests
/// on a handful of jobs, typically alike (a worker's first jobs are often a few short
/// prompts), and the first job unlike them is exactly the one the fit must learn from: a
/// worker's first long prompt, clipped as an outlier against the short ones' residuals,
/// left the prefill slope near 0 on a live GPU and admission sent it 38 jobs at once.
pub(crate) const WARM_UP_SAMPLES: u64 = 10;

/// The state of one regression.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rls {
    /// Current coefficients.
    pub theta: Vec<f64>,
    /// Covariance, row-major `n × n`.
    pub p: Vec<f64>,
    /// Prior variances: the cap of each diagonal entry of `p`.
    pub p_max: Vec<f64>,
    /// Running mean absolute residual (0 until the first sample).
    pub residual_scale: f64,
    /// Samples folded in.
    pub samples: u64,
    /// Variance of a sample's noise, in the squared unit of `y`: how much one sample may
    /// move the fit against the prior. 1 for fits persisted before it was a field.
    #[serde(default = "unit_noise")]
    pub noise_var: f64,
}

/// A linear bound on a fit's coefficients: `Σ weights[i] · θ[i] ≥ at_least`.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    pub weights: Vec<f64>,
    pub at_least: f64,
}

impl Bound {
    /// `θ[i] ≥ floor` in a fit of `n` coefficients.
    pub fn floor(n: usize, i: usize, floor: f64) -> Bound {
        let mut weights = vec![0.0; n];
        weights[i] = 1.0;
        Bound {
            weights,
            at_least: floor,
        }
    }

    /// `θ[hi] ≤ θ[lo]` in a fit of `n` coefficients.
    pub fn not_above(n: usize, hi: usize, lo: usize) -> Bound {
        let mut weights = vec![0.0; n];
        weights[lo] = 1.0;
        weights[hi] = -1.0;
        Bound {
            weights,
            at_least: 0.0,
        }
    }
}

fn unit_noise() -> f64 {
    1.0
}

impl Rls {
    /// A fit that knows only its prior: coefficients `prior`, standard deviations `sd`.
    pub fn new(prior: &[f64], sd: &[f64]) -> Rls {
        assert_eq!(
            prior.len(),
            sd.len(),
            "prior and sd must have one entry per feature"
        );
        let n = prior.len();
        let mut p = vec![0.0; n * n];
        let p_max: Vec<f64> = sd.iter().map(|s| (s * s).max(f64::MIN_POSITIVE)).collect();
        for i in 0..n {
            p[i * n + i] = p_max[i];
        }
        Rls {
            theta: prior.to_vec(),
            p,
            p_max,
            residual_scale: 0.0,
            samples: 0,
            noise_var: 1.0,
        }
    }

    /// The same fit for samples whose noise has standard deviation `sd` (in the unit of
    /// `y`): with the default of 1, a sample is trusted as if it were exact to a unit, and
    /// a handful of samples override any prior.
    pub fn with_noise_sd(mut self, sd: f64) -> Rls {
        if sd.is_finite() && sd > 0.0 {
            self.noise_var = sd * sd;
        }
        self
    }

    /// Number of features.
    pub fn len(&self) -> usize {
        self.theta.len()
    }

    pub fn is_empty(&self) -> bool {
        self.theta.is_empty()
    }

    /// True when the state has the shape of a fit with `n` features, finite numbers and a
    /// positive noise variance.
    pub fn is_well_formed(&self, n: usize) -> bool {
        self.theta.len() == n
            && self.p.len() == n * n
            && self.p_max.len() == n
            && self
                .theta
                .iter()
                .chain(&self.p)
                .chain(&self.p_max)
                .all(|v| v.is_finite())
            && self.residual_scale.is_finite()
            && self.noise_var.is_finite()
            && self.noise_var > 0.0
    }

    /// `xᵀ θ`.
    pub fn predict(&self, x: &[f64]) -> f64 {
        x.iter().zip(&self.theta).map(|(a, b)| a * b).sum()
    }

    /// Fold in one sample with forgetting factor `lambda` in (0, 1].
    pub fn update(&mut self, x: &[f64], y: f64, lambda: f64) {
        let n = self.len();
        if x.len() != n || !y.is_finite() || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let lambda = if lambda.is_finite() {
            lambda.clamp(0.5, 1.0)
        } else {
            1.0
        };
        let px = self.covariance_times(x);
        let denom = lambda * self.noise_var + x.iter().zip(&px).map(|(a, b)| a * b).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let predicted = self.predict(x);
        let mut error = y - predicted;
        if self.samples >= WARM_UP_SAMPLES {
            // A tenth of the prediction is never an outlier: while a noise-free fit
            // converges its residual scale shrinks towards 0, and samples from a region it
            // has not seen yet must still move it.
            let bound = OUTLIER_SCALES * self.residual_scale + 0.1 * predicted.abs();
            error = error.clamp(-bound, bound);
        }
        // Mean absolute residual over roughly the last 1 / (1 - 0.9) = 10 samples; the first
        // sample sets it.
        self.residual_scale = if self.samples == 0 {
            error.abs()
        } else {
            0.9 * self.residual_scale + 0.1 * error.abs()
        };
        let k: Vec<f64> = px.iter().map(|v| v / denom).collect();
        for (t, ki) in self.theta.iter_mut().zip(&k) {
            *t += ki * error;
        }
        // P ← (P − k (P x)ᵀ) / λ ; P is symmetric so xᵀ P = (P x)ᵀ.
        for (row, ki) in self.p.chunks_exact_mut(n).zip(&k) {
            for (pij, pxj) in row.iter_mut().zip(&px) {
                *pij = (*pij - ki * pxj) / lambda;
            }
        }
        self.bound_covariance();
        self.samples += 1;
    }

    /// Keep the coefficients within `bounds`: project the estimate onto what is physically
    /// possible, in the metric of the covariance (the constrained least-squares estimate
    /// closest to the data), not coefficient by coefficient.
    ///
    /// Why the metric matters: where two features rise and fall together (a worker's
    /// streams and their context), an update that pushes one coefficient below its floor
    /// pushes the other up to compensate. Clipping only the first keeps the second's rise,
    /// and sample after sample the fit ratchets away from its own data: on a live worker
    /// the context slope climbed from 0.2 to 8 ms per 1,000 tokens while the base step
    /// fell to its floor, and the fit predicted 40-60 ms for jobs that took 20 ms. The
    /// projection moves every coefficient the covariance ties to the one that broke its
    /// bound, so what the data determined stays and only the undetermined part moves.
    ///
    /// Several bounds are met by cyclic projection (a few passes, each exact for its own
    /// bound); should one still be broken after them, a last pass along the bounds' own
    /// normals settles it (to within rounding).
    pub fn constrain(&mut self, bounds: &[Bound]) {
        const PASSES: usize = 8;
        for _ in 0..PASSES {
            let mut moved = false;
            for b in bounds {
                moved |= self.project(b, true);
            }
            if !moved {
                return;
            }
        }
        for b in bounds {
            self.project(b, false);
        }
    }

    /// Move `θ` onto `bound` when it is outside: along `P a` (in the covariance's metric)
    /// when `in_metric` and `P` has any variance along `a`, else along `a`. True when
    /// it moved.
    fn project(&mut self, bound: &Bound, in_metric: bool) -> bool {
        let n = self.len();
        let a = &bound.weights;
        if a.len() != n {
            return false;
        }
        let value: f64 = a.iter().zip(&self.theta).map(|(w, t)| w * t).sum();
        // Rounding leaves a projected estimate a hair outside its bound; that is on it.
        let tolerance = 1e-9 * (1.0 + bound.at_least.abs());
        if value.is_nan() || value >= bound.at_least - tolerance {
            return false;
        }
        let gap = bound.at_least - value;
        let pa = self.covariance_times(a);
        let apa: f64 = a.iter().zip(&pa).map(|(w, v)| w * v).sum();
        let (direction, norm) = if in_metric && apa.is_finite() && apa > f64::MIN_POSITIVE {
            (pa, apa)
        } else {
            (a.clone(), a.iter().map(|w| w * w).sum())
        };
        if !(norm.is_finite() && norm > 0.0) {
            return false;
        }
        for (t, d) in self.theta.iter_mut().zip(&direction) {
            *t += d * gap / norm;
        }
        true
    }

    /// `P v`.
    fn covariance_times(&self, v: &[f64]) -> Vec<f64> {
        let n = self.len();
        (0..n)
            .map(|i| (0..n).map(|j| self.p[i * n + j] * v[j]).sum())
            .collect()
    }

    /// Cap each diagonal entry at its prior variance, rescaling its row and column so the
    /// matrix stays symmetric and positive semi-definite (`D P D` with `D` diagonal).
    fn bound_covariance(&mut self) {
        let n = self.len();
        for i in 0..n {
            let d = self.p[i * n + i];
            if !(d.is_finite() && d > 0.0) {
                // Numerical breakdown: restart this direction from the prior.
                for j in 0..n {
                    self.p[i * n + j] = 0.0;
                    self.p[j * n + i] = 0.0;
                }
                self.p[i * n + i] = self.p_max[i];
                continue;
            }
            if d > self.p_max[i] {
                let s = (self.p_max[i] / d).sqrt();
                for j in 0..n {
                    self.p[i * n + j] *= s;
                    self.p[j * n + i] *= s;
                }
            }
        }
        // Symmetrise away rounding drift.
        for i in 0..n {
            for j in (i + 1)..n {
                let m = 0.5 * (self.p[i * n + j] + self.p[j * n + i]);
                self.p[i * n + j] = m;
                self.p[j * n + i] = m;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_linear_law_from_noise_free_samples() {
        // y = 3 + 2 a − 0.5 b, prior far off.
        let mut f = Rls::new(&[0.0, 0.0, 0.0], &[10.0, 10.0, 10.0]);
        let mut seed = 7u64;
        for _ in 0..200 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = (seed >> 33) as f64 / (1u64 << 31) as f64 * 10.0;
            let b = (seed >> 13 & 0xffff) as f64 / 65536.0 * 5.0;
            f.update(&[1.0, a, b], 3.0 + 2.0 * a - 0.5 * b, 0.98);
        }
        for (got, want) in f.theta.iter().zip([3.0, 2.0, -0.5]) {
            assert!((got - want).abs() < 1e-3, "{:?}", f.theta);
        }
        assert_eq!(f.samples, 200);
    }

    #[test]
    fn an_unexcited_coefficient_stays_at_its_prior() {
        // The second feature is always 0: nothing can be learnt about it.
        let mut f = Rls::new(&[10.0, 0.7], &[5.0, 1.0]);
        for _ in 0..500 {
            f.update(&[1.0, 0.0], 20.0, 0.95);
        }
        assert!((f.theta[0] - 20.0).abs() < 1e-6);
        assert!((f.theta[1] - 0.7).abs() < 1e-12);
        // Wind-up guard: its variance never exceeds the prior's.
        assert!(f.p[3] <= 1.0 + 1e-12, "{:?}", f.p);
    }

    #[test]
    fn the_data_replaces_the_prior_within_a_few_dozen_samples() {
        let mut f = Rls::new(&[50.0], &[20.0]);
        for _ in 0..30 {
            f.update(&[1.0], 17.0, 0.98);
        }
        assert!((f.theta[0] - 17.0).abs() < 0.5, "{}", f.theta[0]);
    }

    #[test]
    fn an_outlier_moves_the_fit_only_so_far() {
        let mut f = Rls::new(&[0.0], &[100.0]);
        for i in 0..50 {
            f.update(&[1.0], 20.0 + if i % 2 == 0 { 1.0 } else { -1.0 }, 0.98);
        }
        let before = f.theta[0];
        f.update(&[1.0], 10_000.0, 0.98);
        assert!(f.theta[0] - before < 1.0, "{before} -> {}", f.theta[0]);
    }

    #[test]
    fn a_bound_moves_what_the_covariance_ties_to_the_coefficient_that_broke_it() {
        // Two features seen only together (x = [1, a, a]): their sum is known, their split
        // is not, and their errors are anticorrelated.
        let mut f = Rls::new(&[10.0, 0.0, 0.0], &[10.0, 1.0, 1.0]);
        for i in 0..200 {
            let a = 1.0 + (i % 5) as f64;
            f.update(&[1.0, a, a], 10.0 + 2.0 * a, 1.0);
        }
        let sum = f.theta[1] + f.theta[2];
        assert!((sum - 2.0).abs() < 0.01, "{:?}", f.theta);
        // Push the first below 0 along the undetermined direction.
        f.theta[1] -= 3.0;
        f.theta[2] += 3.0;
        let floors: Vec<Bound> = (0..3).map(|i| Bound::floor(3, i, 0.0)).collect();
        f.constrain(&floors);
        assert!(f.theta.iter().all(|t| *t >= 0.0), "{:?}", f.theta);
        // Clipping only θ[1] would leave the sum at 5; the projection keeps what the data
        // determined.
        let sum = f.theta[1] + f.theta[2];
        assert!((sum - 2.0).abs() < 0.05, "{:?}", f.theta);
        assert!((f.theta[0] - 10.0).abs() < 0.05, "{:?}", f.theta);
    }

    #[test]
    fn several_bounds_hold_together_and_a_fit_within_them_does_not_move() {
        let mut f = Rls::new(&[4.6, 13.7, -0.3], &[1.0, 1.0, 1.0]);
        let bounds = [
            Bound::floor(3, 0, 0.1),
            Bound::floor(3, 1, 0.0),
            Bound::floor(3, 2, 0.0),
            Bound::not_above(3, 1, 0),
        ];
        f.constrain(&bounds);
        // With an identity covariance the metric is the plain one: the pair meets halfway.
        for (got, want) in f.theta.iter().zip([9.15, 9.15, 0.0]) {
            assert!((got - want).abs() < 1e-9, "{:?}", f.theta);
        }
        let within = vec![9.0, 2.0, 0.3];
        f.theta = within.clone();
        f.constrain(&bounds);
        assert_eq!(f.theta, within);
    }

    #[test]
    fn non_finite_or_misshapen_samples_are_ignored() {
        let mut f = Rls::new(&[1.0, 2.0], &[1.0, 1.0]);
        let before = f.clone();
        f.update(&[1.0, f64::NAN], 3.0, 0.98);
        f.update(&[1.0], 3.0, 0.98);
        f.update(&[1.0, 1.0], f64::INFINITY, 0.98);
        assert_eq!(f, before);
        assert!(f.is_well_formed(2));
        assert!(!f.is_well_formed(3));
    }
}
