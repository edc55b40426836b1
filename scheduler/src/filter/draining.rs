//! Not draining: a draining worker finishes what it runs and takes nothing new, so an
//! operator can take it out of service without failing requests.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct NotDraining;

impl Filter for NotDraining {
    fn code(&self) -> RejectionCode {
        RejectionCode::Draining
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        !ctx.view.status.draining
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        if self.passes(ctx) {
            return Ok(());
        }
        Err(format!(
            "draining: finishing {} active, taking no new work",
            ctx.load.reported_active
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn rejects_a_draining_worker() {
        let mut w = worker("w1");
        assert_eq!(check_default(&NotDraining, &job("m"), &w), Ok(()));
        w.status.draining = true;
        w.status.active = 2;
        assert_eq!(
            check_default(&NotDraining, &job("m"), &w),
            Err("draining: finishing 2 active, taking no new work".into())
        );
    }
}
