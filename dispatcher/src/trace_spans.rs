//! The leader's part of a request's trace: a `queue wait` span (from the job's arrival at
//! this leader to its decision) and a `decision` span (the evaluation and commit, with the
//! winner and its predicted time to first token), both children of the gateway's request
//! span that the job carries. The Assignment then carries the decision span's context, so
//! the worker's run hangs below the decision that chose it.
//!
//! Written after the fact, from the decision record's own times (`decided_ms`,
//! `queue_wait_ms`, `decision_latency_us`), in the publishing shell: the engine that decides
//! reads no clock and knows nothing of tracing.

use std::time::{Duration, UNIX_EPOCH};

use metronome_protocol::trace::TraceParent;
use metronome_protocol::{Decision, Job};
use metronome_runtime::otel::{record_span, KeyValue};

/// Export the spans of `job`'s assignment to `worker_id` and return the `traceparent` the
/// Assignment carries: the decision span's, or the job's own when export is off (`None`
/// for a job without one).
pub fn assignment_spans(job: &Job, worker_id: &str, decision: &Decision) -> Option<TraceParent> {
    let parent = job.trace()?;
    let decided = UNIX_EPOCH + Duration::from_millis(decision.decided_ms);
    let arrived = decided - Duration::from_millis(decision.queue_wait_ms);
    let decided_by = decided + Duration::from_micros(decision.decision_latency_us);
    let common = || {
        vec![
            KeyValue::new("metronome.job_id", job.id.clone()),
            KeyValue::new("metronome.model", job.model.clone()),
            KeyValue::new("metronome.attempt", i64::from(decision.attempt)),
        ]
    };
    record_span("queue wait", &parent, arrived, decided, common());
    let mut attributes = common();
    attributes.extend([
        KeyValue::new("metronome.worker_id", worker_id.to_string()),
        KeyValue::new("metronome.policy", decision.policy.clone()),
        KeyValue::new("metronome.epoch", decision.epoch as i64),
        KeyValue::new("metronome.candidates", decision.candidates.len() as i64),
        KeyValue::new("metronome.rejected", decision.rejected.len() as i64),
    ]);
    if let Some(ttft) = predicted_ttft_ms(decision, worker_id) {
        attributes.push(KeyValue::new("metronome.predicted_ttft_ms", ttft));
    }
    Some(record_span("decision", &parent, decided, decided_by, attributes).unwrap_or(parent))
}

/// The winner's predicted time to first token, when the policy predicted one.
pub fn predicted_ttft_ms(decision: &Decision, worker_id: &str) -> Option<f64> {
    decision
        .candidate_on(worker_id)
        .and_then(|c| c.prediction)
        .map(|p| p.ttft_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::{arrival, body, engine, heartbeat, published, T0};
    use crate::engine::Outcome;

    /// The decision an engine makes for `job` with one idle worker `w1`.
    fn assigned(job: Job) -> (Job, String, Decision) {
        let mut e = engine(|_| {});
        let outcomes = published(
            &mut e,
            vec![heartbeat("w1", &[], 1, T0, |_| {}), arrival(job, 1, T0)],
            T0 + 5,
        );
        match outcomes.into_iter().next() {
            Some(Outcome::Assign {
                job,
                worker_id,
                decision,
                ..
            }) => ((*job.job).clone(), worker_id, *decision),
            _ => panic!("the job is assigned"),
        }
    }

    #[test]
    fn without_export_the_assignment_carries_the_jobs_own_trace() {
        let (job, worker, decision) = assigned(body("j1", "m", None, 10, 10, T0));
        assert_eq!(assignment_spans(&job, &worker, &decision), None);

        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut traced = body("j2", "m", None, 10, 10, T0);
        traced.traceparent = Some(tp.into());
        let (job, worker, decision) = assigned(traced);
        assert_eq!(
            assignment_spans(&job, &worker, &decision).map(|t| t.to_string()),
            Some(tp.to_string())
        );
        let ttft = predicted_ttft_ms(&decision, &worker).expect("the default policy predicts");
        assert!(ttft > 0.0, "{ttft}");
        assert_eq!(predicted_ttft_ms(&decision, "nobody"), None);
    }
}
