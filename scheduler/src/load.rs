//! A worker's load as the scheduler counts it: what the worker reports plus what the
//! ledger has booked on it that the worker has not reported yet.
//!
//! Counting rule (the heart of the burst fix): a reservation listed in the heartbeat's
//! `in_flight` is already part of the worker's own count, so only reservations *not* listed
//! there are added. `max(reported, reserved)` would be wrong both ways: it forgets fresh
//! reservations on a busy worker (4 running + 1 just booked = 5, not 4) and it is not
//! needed for reported ones. The worker's own count is `max(active, in_flight.len())`:
//! `active` is the model server's running count, and a job the agent holds but has not yet
//! started (listed in `in_flight`, not yet in `active`) takes a slot all the same.
//!
//! KV follows the same rule: reported usage (`used_frac * capacity`) plus the KV tokens of
//! unreported reservations.

use crate::{Ledger, SchedulerConfig, StallOutlook, WorkerView};

/// Load of one worker at decision time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerLoad {
    /// Work the worker reports: `max(status.active, status.in_flight.len())`.
    pub reported_active: u32,
    /// Reservations the worker has not listed in `in_flight` yet.
    pub unreported_reservations: u32,
    /// KV tokens of those reservations.
    pub unreported_kv_tokens: u64,
    /// `reported_active + unreported_reservations`.
    pub effective_active: u32,
    /// The worker's cap, or the configured default when it reports 0.
    pub max_concurrency: u32,
    /// [`Ledger::stall_outlook`] at decision time (none where no time is known).
    pub stall_outlook: StallOutlook,
    /// [`Ledger::recent_placements`] at decision time (0 where no time is known).
    pub recent_placements: f64,
    /// Decision time (Unix ms; 0 where no time is known).
    pub now_ms: u64,
}

impl WorkerLoad {
    pub fn of(view: &WorkerView, ledger: &Ledger, config: &SchedulerConfig) -> Self {
        let s = &view.status;
        let listed = u32::try_from(s.in_flight.len()).unwrap_or(u32::MAX);
        let reported_active = s.active.max(listed);
        let (unreported_reservations, unreported_kv_tokens) =
            ledger.unreported(&s.worker_id, &s.in_flight);
        WorkerLoad {
            reported_active,
            unreported_reservations,
            unreported_kv_tokens,
            effective_active: reported_active.saturating_add(unreported_reservations),
            max_concurrency: config.max_concurrency(s.max_concurrency),
            stall_outlook: StallOutlook::default(),
            recent_placements: 0.0,
            now_ms: 0,
        }
    }

    /// [`WorkerLoad::of`] with the worker's stall outlook at `now_ms`.
    pub fn at(view: &WorkerView, ledger: &Ledger, config: &SchedulerConfig, now_ms: u64) -> Self {
        WorkerLoad {
            stall_outlook: ledger.stall_outlook(&view.status.worker_id, now_ms),
            recent_placements: ledger.recent_placements(&view.status.worker_id, now_ms),
            now_ms,
            ..Self::of(view, ledger, config)
        }
    }

    /// Requests running once this job is admitted.
    pub fn after_admission(&self) -> u32 {
        self.effective_active.saturating_add(1)
    }
}

/// The effective active count of a worker (reported work plus unreported reservations):
/// what the concurrency filter compares with the cap and the first tie-breaker.
pub fn effective_active(view: &WorkerView, ledger: &Ledger) -> u32 {
    WorkerLoad::of(view, ledger, &SchedulerConfig::default()).effective_active
}

/// KV tokens in use (reported) or booked (unreported reservations): the KV half of the
/// counting rule above. An unreadable
/// `used_frac` counts as full: better to refuse than to overfill.
pub(crate) fn kv_tokens_in_use(used_frac: f64, capacity: u64, unreported: u64) -> f64 {
    let frac = if used_frac.is_finite() {
        used_frac.clamp(0.0, 1.0)
    } else {
        1.0
    };
    frac * capacity as f64 + unreported as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::worker;

    #[test]
    fn reported_reservations_are_not_counted_twice() {
        let mut w = worker("w1");
        w.status.active = 4;
        w.status.in_flight = vec!["a".into(), "b".into(), "c".into(), "d".into()];
        let mut l = Ledger::new();
        for j in ["a", "b", "c", "d", "e"] {
            l.reserve("w1", j, 10, 0).unwrap();
        }
        let load = WorkerLoad::of(&w, &l, &SchedulerConfig::default());
        assert_eq!(load.reported_active, 4);
        assert_eq!(load.unreported_reservations, 1);
        assert_eq!(load.unreported_kv_tokens, 10);
        assert_eq!(load.effective_active, 5);
    }

    #[test]
    fn held_but_not_started_jobs_take_a_slot() {
        let mut w = worker("w1");
        w.status.active = 1;
        w.status.in_flight = vec!["a".into(), "b".into()];
        let load = WorkerLoad::of(&w, &Ledger::new(), &SchedulerConfig::default());
        assert_eq!(load.effective_active, 2);
    }

    #[test]
    fn zero_cap_uses_the_default() {
        let mut w = worker("w1");
        w.status.max_concurrency = 0;
        let c = SchedulerConfig::default();
        assert_eq!(
            WorkerLoad::of(&w, &Ledger::new(), &c).max_concurrency,
            c.default_max_concurrency
        );
    }
}
