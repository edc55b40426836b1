//! Healthy: the worker-agent reports that its model server answers its health and metrics
//! endpoints. A worker whose server is down would only fail the job.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct Healthy;

impl Filter for Healthy {
    fn code(&self) -> RejectionCode {
        RejectionCode::Unhealthy
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.view.status.healthy
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        if self.passes(ctx) {
            Ok(())
        } else {
            Err("model server reported unhealthy by its agent".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn rejects_an_unhealthy_worker() {
        let mut w = worker("w1");
        assert_eq!(check_default(&Healthy, &job("m"), &w), Ok(()));
        w.status.healthy = false;
        assert!(check_default(&Healthy, &job("m"), &w).is_err());
    }
}
