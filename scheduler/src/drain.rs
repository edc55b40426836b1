//! How fast a model's admission queue drains, and so how long a job at a given place in it
//! will wait.
//!
//! The rate is learnt from the dispatcher's own placements, not from a model of the GPUs:
//! while jobs keep waiting, the interval between two placements is the time the model's
//! workers took to make room for one more job, whatever made that room (a finished
//! request, a stall that ended, a KV block freed). Intervals are averaged over the last
//! couple of dozen placements; an interval that began while nothing waited measures the
//! arrivals, not the service, and is not counted.
//!
//! The predicted wait of a job with `ahead` jobs served before it is `(ahead + 1)` mean
//! intervals, and never less than the time already spent since the last placement when
//! something is waiting (a queue that has not moved for 10 s does not drain in 50 ms).
//! It is used to answer a job at once, with a `Retry-After`, when its deadline cannot be
//! met, instead of holding the client until the deadline passes.
//!
//! Invariants: no prediction before [`MIN_INTERVALS`] saturated intervals were seen; the
//! prediction grows with `ahead`; time is an argument.

/// Saturated intervals needed before the drain rate is trusted.
pub const MIN_INTERVALS: u32 = 8;

/// Weight of a new interval in the running mean (about the last 20 placements).
const ALPHA: f64 = 0.05;

/// The drain rate of one model's queue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrainRate {
    mean_interval_ms: f64,
    intervals: u32,
    /// When the previous placement was made, if jobs still waited after it.
    saturated_since_ms: Option<u64>,
}

impl DrainRate {
    /// Record a placement at `now_ms`; `still_waiting` is how many of the model's jobs wait
    /// after it.
    pub fn on_placement(&mut self, now_ms: u64, still_waiting: usize) {
        if let Some(prev) = self.saturated_since_ms {
            let interval = now_ms.saturating_sub(prev) as f64;
            self.mean_interval_ms = if self.intervals == 0 {
                interval
            } else {
                self.mean_interval_ms + ALPHA * (interval - self.mean_interval_ms)
            };
            self.intervals = self.intervals.saturating_add(1);
        }
        self.saturated_since_ms = (still_waiting > 0).then_some(now_ms);
    }

    /// Nothing of this model waits any more: the next interval would measure arrivals.
    pub fn on_empty(&mut self) {
        self.saturated_since_ms = None;
    }

    /// Mean time between placements while jobs wait, once enough were seen.
    pub fn mean_interval_ms(&self) -> Option<f64> {
        (self.intervals >= MIN_INTERVALS).then_some(self.mean_interval_ms)
    }

    /// Predicted wait of a job with `ahead` jobs to be placed before it, at `now_ms`.
    pub fn predicted_wait_ms(&self, ahead: usize, now_ms: u64) -> Option<f64> {
        let mean = self.mean_interval_ms()?;
        let drain = (ahead as f64 + 1.0) * mean;
        let stuck = self
            .saturated_since_ms
            .map_or(0.0, |since| now_ms.saturating_sub(since) as f64);
        Some(drain.max(stuck))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saturated(every_ms: u64, n: u64) -> DrainRate {
        let mut d = DrainRate::default();
        for i in 0..=n {
            d.on_placement(1_000 + i * every_ms, 5);
        }
        d
    }

    #[test]
    fn no_prediction_before_enough_saturated_placements() {
        let d = saturated(100, u64::from(MIN_INTERVALS) - 1);
        assert_eq!(d.predicted_wait_ms(3, 10_000), None);
        let d = saturated(100, u64::from(MIN_INTERVALS));
        assert!(d.predicted_wait_ms(3, 1_000 + 800).is_some());
    }

    #[test]
    fn predicts_the_queue_ahead_at_the_learnt_rate() {
        let d = saturated(250, 40);
        let now = 1_000 + 40 * 250;
        assert_eq!(d.mean_interval_ms(), Some(250.0));
        assert_eq!(d.predicted_wait_ms(0, now), Some(250.0));
        assert_eq!(d.predicted_wait_ms(9, now), Some(2_500.0));
    }

    #[test]
    fn intervals_that_began_with_an_empty_queue_do_not_count() {
        let mut d = saturated(100, 20);
        // The queue empties; the next placement comes after a long quiet spell.
        d.on_placement(1_000 + 21 * 100, 0);
        d.on_placement(60_000, 3);
        assert_eq!(d.mean_interval_ms(), Some(100.0));
        d.on_empty();
        d.on_placement(90_000, 3);
        assert_eq!(d.mean_interval_ms(), Some(100.0));
    }

    #[test]
    fn a_queue_that_stopped_moving_predicts_at_least_the_time_it_has_stood() {
        let d = saturated(100, 20);
        let last = 1_000 + 20 * 100;
        assert_eq!(d.predicted_wait_ms(0, last + 5_000), Some(5_000.0));
    }

    #[test]
    fn the_mean_follows_a_slower_drain() {
        let mut d = saturated(100, 20);
        let mut t = 1_000 + 20 * 100;
        for _ in 0..60 {
            t += 400;
            d.on_placement(t, 5);
        }
        let mean = d.mean_interval_ms().unwrap();
        assert!(mean > 350.0 && mean <= 400.0, "{mean}");
    }
}
