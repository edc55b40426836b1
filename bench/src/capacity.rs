//! Capacity search: the highest arrival rate whose completions keep up with its arrivals.
//!
//! A rate *keeps up* ([`keeps_up`]) when at least 99 % of its requests succeed and the
//! completion rate is at least 90 % of the offered rate, where the completion rate is
//! `ok / (duration_s - e2e_p50_s)`: the run's window (first send to last completion) less
//! one typical latency, so a short run is not penalised for the fixed delay of its last
//! request, while a growing backlog (overload) still stretches the window.
//!
//! The search ([`CapacitySearch`]) is a pure state machine: grow the rate geometrically
//! until one fails (or shrink it until one passes), then bisect geometrically between the
//! highest passing and the lowest failing rate a fixed number of times. Invariant: the
//! reported capacity is always a rate that was measured and passed.

use metronome_loadgen::Summary;

/// Thresholds of [`keeps_up`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeepUp {
    /// Least share of requests that succeed.
    pub min_ok_share: f64,
    /// Least completion rate as a share of the offered rate.
    pub min_completion_ratio: f64,
}

impl Default for KeepUp {
    fn default() -> Self {
        KeepUp {
            min_ok_share: 0.99,
            min_completion_ratio: 0.9,
        }
    }
}

/// Completions per second over the run window less one median latency (see module docs).
pub fn completion_rate(s: &Summary) -> f64 {
    let typical_s = s.e2e_ms.p50.unwrap_or(0.0) / 1000.0;
    let window = (s.duration_s - typical_s).max(s.duration_s * 0.5);
    if window > 0.0 {
        s.ok as f64 / window
    } else {
        0.0
    }
}

/// Whether a run's completions kept up with its arrivals.
pub fn keeps_up(s: &Summary, t: KeepUp) -> bool {
    if s.count == 0 || s.offered_rate_rps <= 0.0 {
        return false;
    }
    let ok_share = s.ok as f64 / s.count as f64;
    ok_share >= t.min_ok_share && completion_rate(s) >= t.min_completion_ratio * s.offered_rate_rps
}

/// Geometric ramp then bisection (see module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct CapacitySearch {
    growth: f64,
    bisections_left: u32,
    steps_left: u32,
    next: Option<f64>,
    /// Highest passing rate.
    pass: Option<f64>,
    /// Lowest failing rate.
    fail: Option<f64>,
    /// Every measured rate and its verdict, in order.
    pub history: Vec<(f64, bool)>,
}

impl CapacitySearch {
    /// Starts at `initial_rps`, multiplying or dividing by `growth` (> 1) while the
    /// bracket is open, then `bisections` geometric bisections; at most `max_steps` runs.
    pub fn new(initial_rps: f64, growth: f64, bisections: u32, max_steps: u32) -> Self {
        CapacitySearch {
            growth: growth.max(1.01),
            bisections_left: bisections,
            steps_left: max_steps,
            next: Some(initial_rps),
            pass: None,
            fail: None,
            history: Vec::new(),
        }
    }

    /// The next rate to measure, or `None` when the search is over.
    pub fn next_rate(&self) -> Option<f64> {
        if self.steps_left == 0 {
            None
        } else {
            self.next
        }
    }

    /// Records the verdict of the rate returned by [`Self::next_rate`].
    pub fn record(&mut self, rate: f64, passed: bool) {
        self.history.push((rate, passed));
        self.steps_left = self.steps_left.saturating_sub(1);
        if passed {
            self.pass = Some(self.pass.map_or(rate, |p: f64| p.max(rate)));
        } else {
            self.fail = Some(self.fail.map_or(rate, |f: f64| f.min(rate)));
        }
        self.next = match (self.pass, self.fail) {
            (Some(_), None) => Some(rate * self.growth),
            (None, Some(_)) => Some(rate / self.growth),
            (Some(p), Some(f)) if self.bisections_left > 0 && f > p => {
                self.bisections_left -= 1;
                Some((p * f).sqrt())
            }
            _ => None,
        };
    }

    /// The highest rate that kept up, if any did.
    pub fn capacity(&self) -> Option<f64> {
        self.pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_loadgen::summary::Dist;

    fn summary(count: usize, ok: usize, offered: f64, duration: f64, p50_ms: f64) -> Summary {
        Summary {
            count,
            ok,
            offered_rate_rps: offered,
            duration_s: duration,
            e2e_ms: Dist {
                p50: Some(p50_ms),
                ..Dist::default()
            },
            ..Summary::default()
        }
    }

    #[test]
    fn a_run_that_drains_within_one_latency_keeps_up() {
        // 100 requests over 10 s, last completion 1 s after the last send, p50 e2e 1 s.
        assert!(keeps_up(
            &summary(100, 100, 10.0, 11.0, 1000.0),
            KeepUp::default()
        ));
    }

    #[test]
    fn a_growing_backlog_does_not_keep_up() {
        // Offered 10/s for 10 s but the last completion came at 20 s.
        assert!(!keeps_up(
            &summary(100, 100, 10.0, 20.0, 1000.0),
            KeepUp::default()
        ));
    }

    #[test]
    fn errors_fail_the_rate() {
        assert!(!keeps_up(
            &summary(100, 95, 10.0, 11.0, 1000.0),
            KeepUp::default()
        ));
        assert!(!keeps_up(&summary(0, 0, 0.0, 0.0, 0.0), KeepUp::default()));
    }

    /// Runs the search against a system whose true capacity is `true_cap`.
    fn search(true_cap: f64, initial: f64) -> CapacitySearch {
        let mut s = CapacitySearch::new(initial, 1.5, 3, 20);
        while let Some(r) = s.next_rate() {
            s.record(r, r <= true_cap);
        }
        s
    }

    #[test]
    fn ramps_up_then_bisects_below_the_true_capacity() {
        let s = search(10.0, 2.0);
        let cap = s.capacity().unwrap();
        assert!(cap <= 10.0 && cap > 10.0 / 1.5, "{cap} {:?}", s.history);
        // 2, 3, 4.5, 6.75, 10.125 (fail), then 3 bisections.
        assert_eq!(s.history.len(), 8);
        assert!(s.history.iter().filter(|(_, p)| *p).all(|(r, _)| *r <= cap));
    }

    #[test]
    fn ramps_down_when_the_first_rate_fails() {
        let s = search(1.0, 5.0);
        let cap = s.capacity().unwrap();
        assert!(cap <= 1.0 && cap > 1.0 / 1.5, "{cap} {:?}", s.history);
    }

    #[test]
    fn the_step_budget_bounds_the_search() {
        let mut s = CapacitySearch::new(1.0, 2.0, 5, 3);
        let mut n = 0;
        while let Some(r) = s.next_rate() {
            s.record(r, true);
            n += 1;
        }
        assert_eq!(n, 3);
        assert_eq!(s.capacity(), Some(4.0));
    }

    #[test]
    fn nothing_passes_means_no_capacity() {
        let mut s = CapacitySearch::new(1.0, 2.0, 2, 4);
        while let Some(r) = s.next_rate() {
            s.record(r, false);
        }
        assert_eq!(s.capacity(), None);
    }
}
