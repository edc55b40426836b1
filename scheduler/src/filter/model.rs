//! Serves the model: capacity is bound to the model a worker has loaded (loading another
//! takes minutes), so a job only goes where its model already runs. Names compare exactly.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};

pub struct ServesModel;

impl Filter for ServesModel {
    fn code(&self) -> RejectionCode {
        RejectionCode::WrongModel
    }

    fn passes(&self, ctx: &FilterContext<'_>) -> bool {
        ctx.view.status.model == ctx.job.model
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        if self.passes(ctx) {
            Ok(())
        } else {
            // Display, not Debug: escaping every character of two names is most of the
            // cost of a rejection, and model names are plain text.
            Err(format!(
                "serves model '{}', job needs '{}'",
                ctx.view.status.model, ctx.job.model
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn accepts_only_the_same_model() {
        let w = worker("w1");
        assert_eq!(check_default(&ServesModel, &job("m"), &w), Ok(()));
        assert_eq!(
            check_default(&ServesModel, &job("llama-3.1-8b"), &w),
            Err("serves model 'm', job needs 'llama-3.1-8b'".into())
        );
    }
}
