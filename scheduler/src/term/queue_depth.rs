//! Queue depth: requests waiting inside the model server. A queued request has not started
//! yet, so a new job there waits behind it; running work is counted by `active_requests`.
//! Always available (the agent reports 0 when the server exports no queue metric).

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct QueueDepth;

impl Term for QueueDepth {
    fn name(&self) -> TermName {
        TermName::QueueDepth
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        Some(f64::from(ctx.view.status.queued))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn is_the_reported_queue() {
        let mut w = worker("w1");
        w.status.queued = 7;
        assert_eq!(raw(&QueueDepth, &job("m"), &w, &Ledger::new()), Some(7.0));
    }
}
