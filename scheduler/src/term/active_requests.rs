//! Active requests, reservations included: requests running on the worker plus jobs booked
//! on it that it has not reported yet ([`WorkerLoad::effective_active`](crate::WorkerLoad)).
//! Counting reservations here is what spreads a burst of simultaneous jobs over idle
//! workers. Always available.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct ActiveRequests;

impl Term for ActiveRequests {
    fn name(&self) -> TermName {
        TermName::ActiveRequests
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        Some(f64::from(ctx.load.effective_active))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn counts_reported_work_and_unreported_reservations() {
        let mut w = worker("w1");
        w.status.active = 2;
        w.status.in_flight = vec!["a".into()];
        let mut l = Ledger::new();
        l.reserve("w1", "a", 1, 0).unwrap();
        l.reserve("w1", "b", 1, 0).unwrap();
        assert_eq!(raw(&ActiveRequests, &job("m"), &w, &l), Some(3.0));
    }
}
