//! Pure descriptive statistics over samples: percentiles, mean, coefficient of variation.
//!
//! Percentiles use the **nearest-rank** definition: for `n` samples sorted ascending and
//! `p` in (0, 100], the p-th percentile is the sample at 1-based rank `ceil(p / 100 * n)`
//! (rank clamped to `1..=n`). It always returns an observed value (no interpolation), so a
//! reported p99 is a latency some request really had, and it is exactly reproducible.
//!
//! The coefficient of variation is the **population** standard deviation divided by the
//! mean (`sqrt(sum((x - mean)^2) / n) / mean`); it is undefined (None) for an empty set or
//! a zero mean. Non-finite samples (NaN, ±inf) are ignored everywhere.

/// Samples with non-finite values removed, sorted ascending.
pub fn sorted_finite(samples: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Nearest-rank percentile of already sorted samples; `None` when empty.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    let rank = rank.clamp(1, n);
    Some(sorted[rank - 1])
}

/// Nearest-rank percentile of unsorted samples; `None` when there is no finite sample.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    percentile_sorted(&sorted_finite(samples), p)
}

/// Arithmetic mean of the finite samples.
pub fn mean(samples: &[f64]) -> Option<f64> {
    let v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    Some(v.iter().sum::<f64>() / v.len() as f64)
}

/// Population standard deviation of the finite samples.
pub fn stddev(samples: &[f64]) -> Option<f64> {
    let m = mean(samples)?;
    let v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64;
    Some(var.sqrt())
}

/// Coefficient of variation: population stddev / mean.
pub fn coefficient_of_variation(samples: &[f64]) -> Option<f64> {
    let m = mean(samples)?;
    if m == 0.0 {
        return None;
    }
    Some(stddev(samples)? / m)
}

/// Empirical CDF points `(value, fraction of samples <= value)` of sorted samples, for plots.
pub fn ecdf(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len() as f64;
    sorted
        .iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_on_one_to_hundred() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 99.9), Some(100.0));
        assert_eq!(percentile(&v, 1.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
    }

    #[test]
    fn nearest_rank_small_sets_return_observed_values() {
        // n = 4: p50 -> rank 2, p90 -> rank ceil(3.6) = 4, p1 -> rank 1.
        let v = [40.0, 10.0, 30.0, 20.0];
        assert_eq!(percentile(&v, 50.0), Some(20.0));
        assert_eq!(percentile(&v, 90.0), Some(40.0));
        assert_eq!(percentile(&v, 1.0), Some(10.0));
        assert_eq!(percentile(&[7.0], 99.9), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn non_finite_samples_are_ignored() {
        let v = [f64::NAN, 1.0, f64::INFINITY, 3.0];
        assert_eq!(percentile(&v, 100.0), Some(3.0));
        assert_eq!(mean(&v), Some(2.0));
        assert_eq!(percentile(&[f64::NAN], 50.0), None);
    }

    #[test]
    fn mean_stddev_cv() {
        let v = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        assert_eq!(mean(&v), Some(5.0));
        assert_eq!(stddev(&v), Some(2.0));
        assert_eq!(coefficient_of_variation(&v), Some(0.4));
        assert_eq!(coefficient_of_variation(&[3.0, 3.0, 3.0]), Some(0.0));
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), None);
        assert_eq!(coefficient_of_variation(&[]), None);
    }

    #[test]
    fn percentiles_are_monotonic_in_p() {
        let v: Vec<f64> = (0..997).map(|i| ((i * 7919) % 1000) as f64).collect();
        let s = sorted_finite(&v);
        let mut last = f64::MIN;
        for p in [1.0, 5.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0] {
            let x = percentile_sorted(&s, p).unwrap();
            assert!(x >= last);
            last = x;
        }
    }

    #[test]
    fn ecdf_ends_at_one() {
        let s = sorted_finite(&[3.0, 1.0, 2.0]);
        let c = ecdf(&s);
        assert_eq!(c, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }
}
