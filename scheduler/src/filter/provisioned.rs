//! Within its provisioning: a worker whose heartbeat claims another model than its id was
//! provisioned for, or a concurrency cap above its provisioned ceiling, takes no new work
//! ([`crate::provisioning`]). The caller checks each heartbeat once, when it arrives, and
//! puts the reason in the view ([`WorkerView::not_provisioned`](crate::WorkerView)); the
//! filter only reads it. First among the filters, so a decision says why an impostor was
//! left out rather than that it serves another model or is at its cap.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct Provisioned;

impl Filter for Provisioned {
    fn code(&self) -> RejectionCode {
        RejectionCode::NotProvisioned
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.view.not_provisioned.is_none()
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        match &ctx.view.not_provisioned {
            None => Ok(()),
            Some(reason) => Err(format!("not provisioned: {reason}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn a_worker_outside_its_provisioning_is_refused_with_the_reason() {
        let mut w = worker("w1");
        assert_eq!(check_default(&Provisioned, &job("m"), &w), Ok(()));
        w.not_provisioned = Some("provisioned for model 'q', its heartbeat claims 'm'".into());
        assert_eq!(
            check_default(&Provisioned, &job("m"), &w),
            Err("not provisioned: provisioned for model 'q', its heartbeat claims 'm'".into())
        );
        assert!(crate::filter::refuses_every_job_of_the_model(
            Provisioned.code()
        ));
    }
}
