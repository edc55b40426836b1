//! Pauses between retries: exponential, each with a random share of itself added
//! (backon's jitter), so processes that failed together (every agent when NATS restarts,
//! every publish during a stream leader election) do not retry together.
//!
//! The callers keep their own loops, because they wait on a cancellation token beside the
//! pause or retry within a time window; [`Pauses`] only says how long the next pause is.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Pauses from `first`, doubling up to `max`, each lengthened by a random fraction of
/// itself (so at most twice `max`), without end; [`Pauses::reset`] starts again from
/// `first` after a success.
#[derive(Debug)]
pub struct Pauses {
    builder: ExponentialBuilder,
    backoff: ExponentialBackoff,
}

impl Pauses {
    pub fn new(first: Duration, max: Duration) -> Pauses {
        let builder = ExponentialBuilder::new()
            .with_min_delay(first)
            .with_max_delay(max)
            .with_jitter()
            .without_max_times();
        Pauses {
            backoff: builder.build(),
            builder,
        }
    }

    /// The next pause.
    pub fn next_pause(&mut self) -> Duration {
        self.backoff
            .next()
            .expect("a backoff without a maximum of attempts never ends")
    }

    /// Back to the first pause (after a success).
    pub fn reset(&mut self) {
        self.backoff = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_maximum_with_at_most_their_own_length_added() {
        let first = Duration::from_millis(100);
        let max = Duration::from_secs(2);
        let mut p = Pauses::new(first, max);
        let mut base = first;
        for _ in 0..12 {
            let pause = p.next_pause();
            assert!(pause >= base && pause <= base * 2, "{pause:?} for {base:?}");
            base = (base * 2).min(max);
        }
        p.reset();
        let again = p.next_pause();
        assert!(again >= first && again <= first * 2, "{again:?}");
    }

    #[test]
    fn pauses_are_jittered() {
        let mut p = Pauses::new(Duration::from_millis(100), Duration::from_millis(100));
        let seen: std::collections::BTreeSet<Duration> = (0..20).map(|_| p.next_pause()).collect();
        assert!(seen.len() > 1, "every pause was {seen:?}");
    }
}
