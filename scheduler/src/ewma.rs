//! Exponentially weighted moving averages over irregularly spaced samples.
//!
//! Samples (one per completed request) arrive at uneven intervals, so a fixed alpha would
//! make a busy worker's average forget faster than an idle one's. The effective weight of a
//! sample therefore depends on the time `dt` since the previous one:
//!
//! `alpha_eff = 1 - (1 - base_alpha) ^ (dt / half_life)`
//!
//! This is the standard exponential form `1 - exp(-dt / tau)` with
//! `tau = -half_life / ln(1 - base_alpha)`: the old value keeps weight `(1 - base_alpha)`
//! per `half_life` of elapsed time, whatever the number of samples in between, so two
//! updates `dt1` and `dt2` apart decay the old value exactly as one update `dt1 + dt2`
//! apart would. With `base_alpha = 0.5`, `half_life` is a true half-life. The same form is
//! used by linkerd's and tower's peak-EWMA load estimators.
//!
//! Invariants: `decayed_alpha` is in [0, 1]; [`update`] returns a value within
//! `[min(prev, sample), max(prev, sample)]`, so an average never leaves the range of the
//! samples it has seen.

/// Effective alpha for a sample arriving `dt_ms` after the previous one.
///
/// `dt_ms <= 0` (two samples in the same millisecond) gives 0: no time has passed, so the
/// old value has not decayed. A non-positive or non-finite `half_life_ms` disables time
/// decay and returns `base_alpha` (clamped to [0, 1]).
pub fn decayed_alpha(base_alpha: f64, half_life_ms: f64, dt_ms: f64) -> f64 {
    let base = if base_alpha.is_finite() {
        base_alpha.clamp(0.0, 1.0)
    } else {
        0.0
    };
    if !half_life_ms.is_finite() || half_life_ms <= 0.0 {
        return base;
    }
    if dt_ms.is_nan() || dt_ms <= 0.0 {
        return 0.0;
    }
    if dt_ms.is_infinite() || base >= 1.0 {
        return if base > 0.0 { 1.0 } else { 0.0 };
    }
    let keep = (1.0 - base).powf(dt_ms / half_life_ms);
    (1.0 - keep).clamp(0.0, 1.0)
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
    fn half_life_with_base_half_halves_the_old_weight() {
        assert!((decayed_alpha(0.5, 1000.0, 1000.0) - 0.5).abs() < 1e-12);
        assert!((decayed_alpha(0.5, 1000.0, 2000.0) - 0.75).abs() < 1e-12);
        assert!((decayed_alpha(0.2, 1000.0, 1000.0) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn two_short_steps_equal_one_long_step() {
        let (a, h) = (0.3, 500.0);
        let keep_two = (1.0 - decayed_alpha(a, h, 120.0)) * (1.0 - decayed_alpha(a, h, 380.0));
        let keep_one = 1.0 - decayed_alpha(a, h, 500.0);
        assert!((keep_two - keep_one).abs() < 1e-12);
    }

    #[test]
    fn edge_cases_stay_in_unit_interval() {
        assert_eq!(decayed_alpha(0.5, 1000.0, 0.0), 0.0);
        assert_eq!(decayed_alpha(0.5, 1000.0, -5.0), 0.0);
        assert_eq!(decayed_alpha(0.5, 0.0, 10.0), 0.5);
        assert_eq!(decayed_alpha(0.5, 1000.0, f64::INFINITY), 1.0);
        assert_eq!(decayed_alpha(1.0, 1000.0, 1.0), 1.0);
        assert_eq!(decayed_alpha(1.5, f64::NAN, 1.0), 1.0);
        assert_eq!(decayed_alpha(0.0, 1000.0, 1.0), 0.0);
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
