//! The goodput-versus-offered-load curve of one policy and its **capacity at SLO**: the
//! highest offered rate at which at least 90 % of requests meet the SLO (DistServe's
//! definition, "SLO attainment ≥ 90 %").
//!
//! Measured points are discrete, so the crossing is linearly interpolated between the two
//! points that bracket 90 %: the highest point at or above it and the next one below it.
//! When every point attains 90 %, the capacity is only known to be at least the highest
//! rate measured; when none does, below the lowest. Pure.

use serde::{Deserialize, Serialize};

/// Attainment that defines capacity at SLO.
pub const ATTAINMENT_TARGET: f64 = 0.9;

/// One measured point of a curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Offered rate, requests/s.
    pub rate_rps: f64,
    /// Share of requests meeting the SLO (failures are misses).
    pub attainment: f64,
}

/// Capacity at SLO, with how it was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "rate_rps", rename_all = "snake_case")]
pub enum SloCapacity {
    /// Interpolated between two measured points that bracket the target.
    Interpolated(f64),
    /// Every point met the target: at least the highest rate measured.
    AtLeast(f64),
    /// No point met the target: below the lowest rate measured.
    Below(f64),
}

impl SloCapacity {
    /// What the capacity is known to lie in, `(low, high)`: one rate when interpolated,
    /// `[r, ∞)` when every point attained the target, `[0, r)` when none did (open at `r`).
    pub fn interval(&self) -> (f64, f64) {
        match *self {
            SloCapacity::Interpolated(r) => (r, r),
            SloCapacity::AtLeast(r) => (r, f64::INFINITY),
            SloCapacity::Below(r) => (0.0, r),
        }
    }

    /// What `self / baseline` is known to be: a ratio of two capacities either of which may
    /// be only a bound (a baseline below its lowest point bounds the ratio from below; it
    /// does not make it `∞`).
    pub fn ratio_to(self, baseline: SloCapacity) -> CapacityRatio {
        let ((m_low, m_high), (b_low, b_high)) = (self.interval(), baseline.interval());
        CapacityRatio {
            low: m_low / b_high,
            low_open: matches!(baseline, SloCapacity::Below(_)),
            high: m_high / b_low,
            high_open: matches!(self, SloCapacity::Below(_)),
        }
    }

    /// For tables: `7.31`, `≥ 12.00`, `< 3.00`.
    pub fn display(&self) -> String {
        match *self {
            SloCapacity::Interpolated(r) => format!("{r:.2}"),
            SloCapacity::AtLeast(r) => format!("≥ {r:.2}"),
            SloCapacity::Below(r) => format!("< {r:.2}"),
        }
    }
}

/// The range a ratio of two capacities at SLO is known to lie in, `low ≤ m / b ≤ high`, an
/// end open where it comes from a "below the lowest point" bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityRatio {
    pub low: f64,
    pub low_open: bool,
    pub high: f64,
    pub high_open: bool,
}

impl CapacityRatio {
    /// Both capacities interpolated (or the same bound on both sides): one number.
    pub fn exact(&self) -> bool {
        (self.high - self.low).abs() < 1e-12
    }

    /// `Some(true)` when every ratio in the range reaches `want`, `Some(false)` when none
    /// does, `None` when the range straddles it.
    pub fn reaches(&self, want: f64) -> Option<bool> {
        if self.low.is_nan() || self.high.is_nan() {
            None
        } else if self.low >= want - 1e-9 {
            Some(true)
        } else if self.high < want - 1e-9 || (self.high_open && self.high <= want) {
            Some(false)
        } else {
            None
        }
    }

    /// For tables: `1.52`, `> 2.30`, `≤ 0.80`, or `–` when nothing bounds it.
    pub fn display(&self) -> String {
        if self.exact() && self.low.is_finite() {
            format!("{:.2}", self.low)
        } else if self.high.is_infinite() && self.low > 0.0 {
            format!("{} {:.2}", if self.low_open { ">" } else { "≥" }, self.low)
        } else if self.low == 0.0 && self.high.is_finite() {
            format!(
                "{} {:.2}",
                if self.high_open { "<" } else { "≤" },
                self.high
            )
        } else {
            "–".into()
        }
    }

    /// How far from `want`, from the end that decides (`≥ +1.00×`: at least that much).
    pub fn margin(&self, want: f64) -> String {
        let bound = if self.exact() { "" } else { "≥ " };
        match self.reaches(want) {
            Some(true) => format!("{bound}{:+.2}×", self.low - want),
            Some(false) if self.exact() => format!("{:+.2}×", self.high - want),
            Some(false) => format!("< {:+.2}×", self.high - want),
            None => "–".into(),
        }
    }
}

/// Capacity at SLO of a curve (any order of points); `None` without points.
pub fn capacity_at_slo(points: &[CurvePoint], target: f64) -> Option<SloCapacity> {
    let mut pts: Vec<CurvePoint> = points
        .iter()
        .copied()
        .filter(|p| p.rate_rps.is_finite() && p.attainment.is_finite())
        .collect();
    pts.sort_by(|a, b| a.rate_rps.total_cmp(&b.rate_rps));
    let last = pts.last()?;
    let Some(i) = pts.iter().rposition(|p| p.attainment >= target) else {
        return Some(SloCapacity::Below(pts[0].rate_rps));
    };
    if i + 1 == pts.len() {
        return Some(SloCapacity::AtLeast(last.rate_rps));
    }
    let (a, b) = (pts[i], pts[i + 1]);
    let drop = a.attainment - b.attainment;
    let t = if drop > 0.0 {
        (a.attainment - target) / drop
    } else {
        0.0
    };
    Some(SloCapacity::Interpolated(
        a.rate_rps + t * (b.rate_rps - a.rate_rps),
    ))
}

/// Goodput rate: requests meeting the SLO per second of *offered* time (`count / rate`, the
/// time the arrivals took as planned), so every policy at one load has the same
/// denominator and a slow drain does not dilute or inflate it.
pub fn goodput_rate(good: usize, count: usize, rate_rps: f64) -> f64 {
    if count == 0 {
        0.0
    } else {
        good as f64 / count as f64 * rate_rps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(v: &[(f64, f64)]) -> Vec<CurvePoint> {
        v.iter()
            .map(|&(rate_rps, attainment)| CurvePoint {
                rate_rps,
                attainment,
            })
            .collect()
    }

    fn interpolated(c: Option<SloCapacity>) -> f64 {
        match c {
            Some(SloCapacity::Interpolated(r)) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn interpolates_between_the_bracketing_points() {
        let c = capacity_at_slo(
            &pts(&[(2.0, 1.0), (4.0, 0.95), (6.0, 0.85), (8.0, 0.5)]),
            0.9,
        );
        // 0.95 → 0.85 over 4 → 6: 0.9 is half way.
        assert!((interpolated(c) - 5.0).abs() < 1e-9, "{c:?}");
        assert_eq!(c.unwrap().display(), "5.00");
    }

    #[test]
    fn order_of_points_does_not_matter() {
        let a = capacity_at_slo(
            &pts(&[(6.0, 0.85), (2.0, 1.0), (8.0, 0.5), (4.0, 0.95)]),
            0.9,
        );
        let b = capacity_at_slo(
            &pts(&[(2.0, 1.0), (4.0, 0.95), (6.0, 0.85), (8.0, 0.5)]),
            0.9,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn exactly_on_target_is_that_rate() {
        let c = capacity_at_slo(&pts(&[(2.0, 0.9), (4.0, 0.5)]), 0.9);
        assert_eq!(c, Some(SloCapacity::Interpolated(2.0)));
    }

    #[test]
    fn the_highest_attaining_point_counts_even_after_a_dip() {
        // A noisy dip at 4 then back above at 6: the highest point ≥ 90 % is 6.
        let c = capacity_at_slo(
            &pts(&[(2.0, 0.95), (4.0, 0.88), (6.0, 0.92), (8.0, 0.72)]),
            0.9,
        );
        assert!((interpolated(c) - 6.2).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn bounds_when_not_bracketed() {
        assert_eq!(
            capacity_at_slo(&pts(&[(2.0, 0.99), (4.0, 0.91)]), 0.9),
            Some(SloCapacity::AtLeast(4.0))
        );
        let below = capacity_at_slo(&pts(&[(2.0, 0.5), (4.0, 0.1)]), 0.9).unwrap();
        assert_eq!(below, SloCapacity::Below(2.0));
        assert_eq!(below.display(), "< 2.00");
        assert_eq!(SloCapacity::AtLeast(4.0).display(), "≥ 4.00");
        assert_eq!(below.interval(), (0.0, 2.0));
        assert_eq!(SloCapacity::AtLeast(4.0).interval(), (4.0, f64::INFINITY));
        assert_eq!(SloCapacity::Interpolated(3.0).interval(), (3.0, 3.0));
        assert_eq!(capacity_at_slo(&[], 0.9), None);
    }

    #[test]
    fn goodput_rate_uses_the_offered_time() {
        assert!((goodput_rate(90, 100, 10.0) - 9.0).abs() < 1e-12);
        assert_eq!(goodput_rate(0, 0, 10.0), 0.0);
    }
}
