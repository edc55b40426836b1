//! Under the concurrency cap, reservations included: two generations on one GPU make both
//! unpredictably slow, so a worker takes at most `max_concurrency` requests (its own figure,
//! or `default_max_concurrency` when it reports 0). The count is
//! [`WorkerLoad::effective_active`](crate::WorkerLoad): reported work plus reservations the
//! worker has not listed yet, so a burst cannot overshoot the cap between heartbeats.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct UnderConcurrencyCap;

impl Filter for UnderConcurrencyCap {
    fn code(&self) -> RejectionCode {
        RejectionCode::AtConcurrencyCap
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.load.effective_active < ctx.load.max_concurrency
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        if self.passes(ctx) {
            return Ok(());
        }
        let l = ctx.load;
        Err(format!(
            "at cap: {} active + {} reserved >= max {}",
            l.reported_active, l.unreported_reservations, l.max_concurrency
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};

    #[test]
    fn counts_unreported_reservations_once() {
        let config = SchedulerConfig::default();
        let j = job("m");
        let mut w = worker("w1");
        w.status.active = 3;
        w.status.in_flight = vec!["a".into(), "b".into(), "c".into()];
        let mut l = Ledger::new();
        for id in ["a", "b", "c"] {
            l.reserve("w1", id, 1, 0).unwrap();
        }
        // 3 reported (all of them reserved too): one slot left.
        assert_eq!(check(&UnderConcurrencyCap, &j, &w, &l, &config), Ok(()));
        l.reserve("w1", "d", 1, 0).unwrap();
        assert_eq!(
            check(&UnderConcurrencyCap, &j, &w, &l, &config),
            Err("at cap: 3 active + 1 reserved >= max 4".into())
        );
    }

    #[test]
    fn zero_reported_cap_uses_the_default() {
        let config = SchedulerConfig {
            default_max_concurrency: 2,
            ..SchedulerConfig::default()
        };
        let mut w = worker("w1");
        w.status.max_concurrency = 0;
        w.status.active = 2;
        assert_eq!(
            check(&UnderConcurrencyCap, &job("m"), &w, &Ledger::new(), &config),
            Err("at cap: 2 active + 0 reserved >= max 2".into())
        );
    }
}
