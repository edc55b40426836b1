//! Self-fencing: an agent whose heartbeats are not being stored stops taking work.
//!
//! The dispatcher declares a worker dead when its heartbeats stop arriving and assigns the
//! jobs it never saw reported to other workers. An agent cut off from the `workers` bucket
//! (KV puts failing or hanging) but still able to pull would then run those jobs a second
//! time. So the agent keeps its own view of the same clock: once no heartbeat has been
//! stored for `fence_after` it is *fenced* — the intake pulls nothing and no accepted job
//! starts — until a heartbeat is stored again.
//!
//! Invariants:
//! - The fence is judged from the agent's monotonic clock and the time of the last stored
//!   heartbeat only; it needs nobody to observe the outage while it happens: a store that
//!   ends a gap longer than `fence_after` counts the gap as a fenced episode.
//! - `episodes` only grows. A job accepted in one episode count and reported in another
//!   lived through a gap in which the dispatcher may have given it away, so it must not
//!   start (the caller refuses it back instead).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::metrics::AgentMetrics;

/// Whether the agent may take and start work, and how many fenced episodes it has had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FenceState {
    pub fenced: bool,
    pub episodes: u64,
}

#[derive(Debug)]
struct Inner {
    last_stored: Instant,
    fenced: bool,
    episodes: u64,
}

/// The agent's self-fence (see the module doc).
#[derive(Debug)]
pub(crate) struct Fence {
    after: Duration,
    metrics: Arc<AgentMetrics>,
    inner: Mutex<Inner>,
    /// Bumped on every stored heartbeat, so a fenced intake wakes when one succeeds.
    stored: watch::Sender<u64>,
}

impl Fence {
    /// A fence whose clock starts now (the agent has just stored its first heartbeat or is
    /// about to).
    pub fn new(after: Duration, now: Instant, metrics: Arc<AgentMetrics>) -> Self {
        Fence {
            after,
            metrics,
            inner: Mutex::new(Inner {
                last_stored: now,
                fenced: false,
                episodes: 0,
            }),
            stored: watch::channel(0).0,
        }
    }

    /// The state at `now`, raising the fence when the last stored heartbeat is too old.
    pub fn check(&self, now: Instant) -> FenceState {
        let mut inner = self.inner.lock().expect("fence lock");
        self.overdue(&mut inner, now);
        FenceState {
            fenced: inner.fenced,
            episodes: inner.episodes,
        }
    }

    /// A heartbeat was stored at `now`: lower the fence. Returns the state after it, whose
    /// `episodes` counts the gap that just ended if it was longer than `fence_after`.
    pub fn stored(&self, now: Instant) -> FenceState {
        let state = {
            let mut inner = self.inner.lock().expect("fence lock");
            self.overdue(&mut inner, now);
            if inner.fenced {
                tracing::info!(
                    silent_ms = now.saturating_duration_since(inner.last_stored).as_millis() as u64,
                    "heartbeat stored again: fence lowered"
                );
            }
            inner.fenced = false;
            self.metrics.fenced.set(0);
            inner.last_stored = inner.last_stored.max(now);
            FenceState {
                fenced: false,
                episodes: inner.episodes,
            }
        };
        self.stored.send_modify(|n| *n += 1);
        state
    }

    /// The leader declared this worker dead (a conditional heartbeat put was refused):
    /// raise the fence now, as a gap would, until the next heartbeat is stored.
    pub fn given_away(&self) {
        let mut inner = self.inner.lock().expect("fence lock");
        if !inner.fenced {
            inner.fenced = true;
            inner.episodes += 1;
            self.metrics.fenced.set(1);
            self.metrics.fence_episodes.inc();
        }
    }

    /// Wait until the fence is down at the time of a check (a heartbeat is stored).
    pub async fn wait_lowered(&self) {
        let mut rx = self.stored.subscribe();
        loop {
            if !self.check(Instant::now()).fenced {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn overdue(&self, inner: &mut Inner, now: Instant) {
        if !inner.fenced && now.saturating_duration_since(inner.last_stored) > self.after {
            inner.fenced = true;
            inner.episodes += 1;
            self.metrics.fenced.set(1);
            self.metrics.fence_episodes.inc();
            tracing::warn!(
                fence_after_ms = self.after.as_millis() as u64,
                "no heartbeat stored for longer than the fence timeout: fenced (no new work)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(3_000);

    #[test]
    fn stays_open_while_heartbeats_are_stored_in_time() {
        let t0 = Instant::now();
        let f = Fence::new(AFTER, t0, Arc::default());
        for s in 1..10 {
            let now = t0 + Duration::from_millis(1_000 * s);
            assert!(!f.check(now).fenced);
            assert_eq!(f.stored(now).episodes, 0);
        }
    }

    #[test]
    fn raises_after_the_timeout_and_lowers_on_the_next_store() {
        let t0 = Instant::now();
        let f = Fence::new(AFTER, t0, Arc::default());
        assert!(
            !f.check(t0 + AFTER).fenced,
            "exactly the timeout is still open"
        );
        let late = t0 + AFTER + Duration::from_millis(1);
        assert_eq!(
            f.check(late),
            FenceState {
                fenced: true,
                episodes: 1
            }
        );
        assert_eq!(f.check(late + AFTER).episodes, 1, "one outage, one episode");
        let back = f.stored(late + AFTER);
        assert_eq!(
            back,
            FenceState {
                fenced: false,
                episodes: 1
            }
        );
        assert!(!f.check(late + AFTER + Duration::from_millis(10)).fenced);
    }

    #[test]
    fn a_gap_nobody_observed_still_counts() {
        let t0 = Instant::now();
        let f = Fence::new(AFTER, t0, Arc::default());
        // No check during the outage: the store that ends it still records the episode,
        // so a job accepted before it is not started.
        assert_eq!(f.stored(t0 + AFTER * 2).episodes, 1);
        assert_eq!(f.stored(t0 + AFTER * 2 + AFTER).episodes, 1);
    }

    #[tokio::test]
    async fn a_fenced_waiter_wakes_when_a_heartbeat_is_stored() {
        let t0 = Instant::now() - AFTER * 2;
        let f = Arc::new(Fence::new(AFTER, t0, Arc::default()));
        assert!(f.check(Instant::now()).fenced);
        let waiter = tokio::spawn({
            let f = f.clone();
            async move { f.wait_lowered().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        f.stored(Instant::now());
        waiter.await.unwrap();
    }

    #[test]
    fn given_away_counts_an_episode_until_the_next_store() {
        let t0 = Instant::now();
        let f = Fence::new(AFTER, t0, Arc::default());
        f.given_away();
        assert_eq!(
            f.check(t0),
            FenceState {
                fenced: true,
                episodes: 1
            },
            "a job accepted before this is refused when reported"
        );
        f.given_away();
        assert_eq!(f.check(t0).episodes, 1, "one declaration, one episode");
        assert_eq!(
            f.stored(t0 + Duration::from_millis(5)),
            FenceState {
                fenced: false,
                episodes: 1
            }
        );
    }
}
