//! Fresh heartbeat: a worker silent for longer than `heartbeat_timeout_ms` may be dead, and
//! everything else its status says is stale. Ages use the dispatcher's clock
//! (`last_seen_ms`), never the worker's, so clock skew between hosts cannot matter; a
//! receipt time in the future counts as age 0.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct FreshHeartbeat;

impl Filter for FreshHeartbeat {
    fn code(&self) -> RejectionCode {
        RejectionCode::StaleHeartbeat
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.now_ms.saturating_sub(ctx.view.last_seen_ms) <= ctx.config.heartbeat_timeout_ms
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        if self.passes(ctx) {
            return Ok(());
        }
        let age = ctx.now_ms.saturating_sub(ctx.view.last_seen_ms);
        let limit = ctx.config.heartbeat_timeout_ms;
        Err(format!("last heartbeat {age} ms ago > timeout {limit} ms"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn rejects_only_past_the_timeout() {
        let j = job("m");
        let mut w = worker("w1");
        let timeout = crate::SchedulerConfig::default().heartbeat_timeout_ms;
        w.last_seen_ms = NOW - timeout;
        assert_eq!(check_default(&FreshHeartbeat, &j, &w), Ok(()));
        w.last_seen_ms = NOW - timeout - 1;
        assert_eq!(
            check_default(&FreshHeartbeat, &j, &w),
            Err(format!(
                "last heartbeat {} ms ago > timeout {timeout} ms",
                timeout + 1
            ))
        );
        w.last_seen_ms = NOW + 500;
        assert_eq!(check_default(&FreshHeartbeat, &j, &w), Ok(()));
    }
}
