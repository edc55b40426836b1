//! Self-fencing, as a clock without a clock: an agent whose heartbeats are not being
//! stored stops taking work.
//!
//! The dispatcher declares a worker dead when its heartbeats stop arriving and assigns the
//! jobs it never saw reported to other workers. An agent cut off from the `workers` bucket
//! (KV puts failing or hanging) but still able to pull would then run those jobs a second
//! time. So the agent keeps its own view of the same clock: once no heartbeat has been
//! stored for `fence_after` it is *fenced* (the intake pulls nothing and no held job
//! starts) until a heartbeat is stored again.
//!
//! Invariants:
//! - The fence is judged from the time passed in and the time of the last stored heartbeat
//!   only; it needs nobody to observe the outage while it happens: a store that ends a gap
//!   longer than `fence_after` counts the gap as a fenced episode.
//! - `episodes` only grows. A job taken in one episode count and reported in another lived
//!   through a gap in which the dispatcher may have given it away, so it must not start
//!   (the caller refuses it back instead).

use std::time::{Duration, Instant};

/// Whether the agent may take and start work, and how many fenced episodes it has had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceState {
    pub fenced: bool,
    pub episodes: u64,
}

/// How the fence moved in one call, for the shell's gauge and log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceMove {
    /// Raised: no heartbeat stored for longer than `fence_after`.
    RaisedOverdue,
    /// Raised: the leader declared this worker dead.
    RaisedGivenAway,
    /// Lowered by a stored heartbeat after `silent` without one.
    Lowered { silent: Duration },
}

/// The agent's self-fence (see the module doc).
#[derive(Debug, Clone)]
pub struct Fence {
    after: Duration,
    last_stored: Instant,
    fenced: bool,
    episodes: u64,
}

impl Fence {
    /// A fence whose clock starts at `now` (the agent has just stored its first heartbeat
    /// or is about to).
    pub fn new(after: Duration, now: Instant) -> Self {
        Fence {
            after,
            last_stored: now,
            fenced: false,
            episodes: 0,
        }
    }

    pub fn after(&self) -> Duration {
        self.after
    }

    /// The state at `now`, raising the fence when the last stored heartbeat is too old.
    pub fn check(&mut self, now: Instant) -> (FenceState, Option<FenceMove>) {
        let moved = self.overdue(now);
        (self.state(), moved)
    }

    /// A heartbeat was stored at `now`: lower the fence. The state after it counts the gap
    /// that just ended if it was longer than `fence_after`.
    pub fn stored(&mut self, now: Instant) -> (FenceState, Option<FenceMove>) {
        let raised = self.overdue(now);
        let moved = self.fenced.then(|| FenceMove::Lowered {
            silent: now.saturating_duration_since(self.last_stored),
        });
        self.fenced = false;
        self.last_stored = self.last_stored.max(now);
        // A gap nobody observed is raised and lowered in the same call: only the lowering
        // is worth telling (the episode is counted either way).
        (self.state(), moved.or(raised))
    }

    /// The leader declared this worker dead (a conditional heartbeat put was refused):
    /// raise the fence now, as a gap would, until the next heartbeat is stored.
    pub fn given_away(&mut self) -> Option<FenceMove> {
        if self.fenced {
            return None;
        }
        self.fenced = true;
        self.episodes += 1;
        Some(FenceMove::RaisedGivenAway)
    }

    fn state(&self) -> FenceState {
        FenceState {
            fenced: self.fenced,
            episodes: self.episodes,
        }
    }

    fn overdue(&mut self, now: Instant) -> Option<FenceMove> {
        if self.fenced || now.saturating_duration_since(self.last_stored) <= self.after {
            return None;
        }
        self.fenced = true;
        self.episodes += 1;
        Some(FenceMove::RaisedOverdue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(3_000);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn stays_open_while_heartbeats_are_stored_in_time() {
        let t0 = Instant::now();
        let mut f = Fence::new(AFTER, t0);
        for s in 1..10 {
            let now = t0 + ms(1_000 * s);
            assert!(!f.check(now).0.fenced);
            assert_eq!(
                f.stored(now),
                (
                    FenceState {
                        fenced: false,
                        episodes: 0
                    },
                    None
                )
            );
        }
    }

    #[test]
    fn raises_after_the_timeout_and_lowers_on_the_next_store() {
        let t0 = Instant::now();
        let mut f = Fence::new(AFTER, t0);
        assert!(
            !f.check(t0 + AFTER).0.fenced,
            "exactly the timeout is still open"
        );
        let late = t0 + AFTER + ms(1);
        assert_eq!(
            f.check(late),
            (
                FenceState {
                    fenced: true,
                    episodes: 1
                },
                Some(FenceMove::RaisedOverdue)
            )
        );
        assert_eq!(
            f.check(late + AFTER),
            (
                FenceState {
                    fenced: true,
                    episodes: 1
                },
                None
            )
        );
        let back = f.stored(late + AFTER);
        assert_eq!(
            back.0,
            FenceState {
                fenced: false,
                episodes: 1
            }
        );
        assert_eq!(
            back.1,
            Some(FenceMove::Lowered {
                silent: AFTER * 2 + ms(1)
            })
        );
        assert!(!f.check(late + AFTER + ms(10)).0.fenced);
    }

    #[test]
    fn a_gap_nobody_observed_still_counts() {
        let t0 = Instant::now();
        let mut f = Fence::new(AFTER, t0);
        // No check during the outage: the store that ends it still records the episode,
        // so a job taken before it is not started.
        assert_eq!(f.stored(t0 + AFTER * 2).0.episodes, 1);
        assert_eq!(f.stored(t0 + AFTER * 2 + AFTER).0.episodes, 1);
    }

    #[test]
    fn given_away_counts_an_episode_until_the_next_store() {
        let t0 = Instant::now();
        let mut f = Fence::new(AFTER, t0);
        assert_eq!(f.given_away(), Some(FenceMove::RaisedGivenAway));
        assert_eq!(
            f.check(t0).0,
            FenceState {
                fenced: true,
                episodes: 1
            }
        );
        assert_eq!(f.given_away(), None, "one declaration, one episode");
        assert_eq!(
            f.stored(t0 + ms(5)).0,
            FenceState {
                fenced: false,
                episodes: 1
            }
        );
    }
}
