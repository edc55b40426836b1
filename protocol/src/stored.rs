//! Reading the stored record of a job's final result (RESULTS), the one rule every late
//! reader follows (`metronome explain`, the drills, the tests).
//!
//! RESULTS keeps at most one final result per job and publisher: each publisher writes its
//! own subject, `results.<tenant>.<job_id>.<publisher>.final`, with
//! [`HEADER_EXPECTED_LAST_SUBJECT_SEQ`] = [`FIRST_ON_SUBJECT`], and only that publisher may
//! write it. A job may therefore have several stored finals: the leader's (`_dispatcher`:
//! a rejection, a job lost with its worker), its worker's, and whatever a compromised
//! worker stored under its own name. The accepted one is the **first stored** (lowest
//! sequence) of those whose publisher may answer the job: `_dispatcher`, and the worker
//! that the job's latest assigned decision names. So a forgery never counts and cannot
//! keep the real one out, and a worker that finishes a job the leader already declared
//! lost (it was only silent) leaves a second stored final that readers do not accept: the
//! leader's came first. That is the rule the one-final-per-job msg id enforced before,
//! without a key that any publisher could take first.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{self, DirectGetErrorKind};

use crate::names::{result_final_subject_any_tenant_from, DISPATCHER_PUBLISHER};

/// The accepted stored final result of `job_id` (see the module), given the worker its
/// latest assigned decision names (`None`: no decision assigned it; only the leader's
/// final counts). `Ok(None)` when none is stored (or no longer kept).
pub async fn accepted_final(
    stream: &stream::Stream,
    job_id: &str,
    assigned: Option<&str>,
) -> Result<Option<StreamMessage>, stream::DirectGetError> {
    let mut best: Option<StreamMessage> = None;
    for publisher in [Some(DISPATCHER_PUBLISHER), assigned].into_iter().flatten() {
        let subject = result_final_subject_any_tenant_from(job_id, publisher);
        match stream.direct_get_next_for_subject(subject, Some(1)).await {
            Ok(m) => {
                if best.as_ref().is_none_or(|b| m.sequence < b.sequence) {
                    best = Some(m);
                }
            }
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(best)
}
