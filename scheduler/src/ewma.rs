//! Exponentially weighted moving averages over irregularly spaced samples.
//!
//! Samples (one per completed request) arrive at uneven intervals. The weight of a new
//! sample depends on the time `dt` since the previous one:
//!
//! `alpha_eff = 1 - (1 - base_alpha) * 0.5 ^ (dt / half_life)`
//!
//! Back-to-back samples (`dt = 0`) move the average by exactly `base_alpha`, so a busy
//! worker's average follows its recent requests; after a silence the old value has lost
//! half of its remaining weight per `half_life`, so a worker idle for a long time is judged
//! mostly on its next sample rather than on stale history. The first sample sets the
//! average. This is the formula the worker-agent's Redis script applies (it writes the
//! averages the dispatcher reads; a test there checks both agree).
//!
//! Invariants: `decayed_alpha` is in `[base_alpha, 1]` (clamped to [0, 1]); [`update`]
//! returns a value within `[min(prev, sample), max(prev, sample)]`, so an average never
//! leaves the range of the samples it has seen.

/// Effective alpha for a sample arriving `dt_ms` after the previous one.
///
/// A negative or NaN `dt_ms` counts as 0. A non-positive or non-finite `half_life_ms`
/// disables time decay and returns `base_alpha` (clamped to [0, 1]).
pub fn decayed_alpha(base_alpha: f64, half_life_ms: f64, dt_ms: f64) -> f64 {
    let base = if base_alpha.is_finite() {
        base_alpha.clamp(0.0, 1.0)
    } else {
        0.0
    };
    if !half_life_ms.is_finite() || half_life_ms <= 0.0 {
        return base;
    }
    let dt = if dt_ms.is_nan() { 0.0 } else { dt_ms.max(0.0) };
    if dt.is_infinite() {
        return 1.0;
    }
    let kept = (1.0 - base) * 0.5f64.powf(dt / half_life_ms);
    (1.0 - kept).clamp(base, 1.0)
}

/// Fold `sample` into `prev` with weight `alpha` (clamped to [0, 1]).
///
/// No previous value: the sample itself. A non-finite sample is ignored (the previous value
/// is kept) so one bad measurement cannot poison the average.
pub fn update(prev: Option<f64>, sample: f64, alpha: f64) -> f64 {
    let prev = match prev {
        Some(p) if p.is_finite() => p,
        _ => return sample,
    };
    if !sample.is_finite() {
        return prev;
    }
    let alpha = if alpha.is_finite() {
        alpha.clamp(0.0, 1.0)
    } else {
        1.0
    };
    let next = prev + alpha * (sample - prev);
    // Rounding can step one ulp outside the interval; the invariant is exact.
    next.clamp(prev.min(sample), prev.max(sample))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_to_back_samples_move_by_base_alpha() {
        assert!((decayed_alpha(0.2, 1000.0, 0.0) - 0.2).abs() < 1e-12);
        assert!((decayed_alpha(0.2, 1000.0, -5.0) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn each_half_life_halves_the_old_weight() {
        // kept = 0.8 * 0.5 after one half-life, 0.8 * 0.25 after two.
        assert!((decayed_alpha(0.2, 1000.0, 1000.0) - 0.6).abs() < 1e-12);
        assert!((decayed_alpha(0.2, 1000.0, 2000.0) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn edge_cases_stay_in_unit_interval() {
        assert_eq!(decayed_alpha(0.5, 0.0, 10.0), 0.5);
        assert_eq!(decayed_alpha(0.5, 1000.0, f64::INFINITY), 1.0);
        assert_eq!(decayed_alpha(1.0, 1000.0, 1.0), 1.0);
        assert_eq!(decayed_alpha(1.5, f64::NAN, 1.0), 1.0);
        assert_eq!(decayed_alpha(0.0, 1000.0, 0.0), 0.0);
        assert!(decayed_alpha(0.0, 1000.0, 1000.0) > 0.0);
    }

    #[test]
    fn update_moves_toward_the_sample() {
        assert_eq!(update(None, 7.0, 0.1), 7.0);
        assert_eq!(update(Some(10.0), 20.0, 0.5), 15.0);
        assert_eq!(update(Some(10.0), 20.0, 0.0), 10.0);
        assert_eq!(update(Some(10.0), 20.0, 1.0), 20.0);
        assert_eq!(update(Some(10.0), f64::NAN, 0.5), 10.0);
        assert_eq!(update(Some(10.0), 20.0, 7.0), 20.0);
    }
}
