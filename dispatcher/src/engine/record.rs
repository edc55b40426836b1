//! The decision record: what each decision says (outcome, reason, cost, candidates) and
//! the rejections and refusals that carry one.

use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use metronome_protocol::ErrorCode;
use metronome_protocol::Job;
use metronome_protocol::Outcome as DecisionOutcome;
use metronome_protocol::{Affinity, AffinityOutcome, Decision};
use metronome_scheduler::JobRequest;

use crate::engine::placement::Judged;
use crate::engine::Engine;
use crate::engine::Outcome;
use crate::queue::tenant_of;
use crate::queue::QueuedJob;

impl Engine {
    pub(super) fn decision(
        &self,
        job: &Job,
        outcome: DecisionOutcome,
        attempt: u32,
        queue_wait_ms: u64,
        latency_us: u64,
        now: u64,
    ) -> Decision {
        Decision {
            v: metronome_protocol::DECISION_VERSION,
            job_id: job.id.clone(),
            model: Some(job.model.clone()),
            outcome,
            attempt,
            reason: None,
            reason_code: None,
            worker_id: None,
            cost: None,
            scoring: None,
            candidates: Vec::new(),
            rejected: Vec::new(),
            slo: None,
            policy: self.s.policy.as_str().to_string(),
            queue_wait_ms,
            retry_after_ms: None,
            affinity: None,
            decision_latency_us: latency_us,
            epoch: self.s.epoch,
            dispatcher_id: self.s.dispatcher_id.clone(),
            decided_ms: now,
            tenant: job.tenant.clone(),
            priority: Some(job.priority()),
            fair_counter: Some(self.queues.counter(&job.model, tenant_of(job))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn reject(
        &mut self,
        job: &Job,
        attempt: u32,
        outcome: DecisionOutcome,
        code: &str,
        reason: &str,
        error: ErrorCode,
        acker: Option<Arc<Acker>>,
        queue_wait_ms: u64,
    ) {
        self.refusals.forget(&job.id);
        self.refuse(
            job,
            attempt,
            outcome,
            code,
            reason,
            error,
            acker,
            queue_wait_ms,
            None,
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn refuse(
        &mut self,
        job: &Job,
        attempt: u32,
        outcome: DecisionOutcome,
        code: &str,
        reason: &str,
        error: ErrorCode,
        acker: Option<Arc<Acker>>,
        queue_wait_ms: u64,
        retry_after_ms: Option<u64>,
    ) {
        let now = self.now_ms;
        tracing::info!(job_id = %job.id, trace_id = job.trace().map(|t| t.trace_id()).as_deref(), model = %job.model, reason_code = code, reason, "job not assigned");
        self.metrics.tenant_rejected(tenant_of(job), code);
        let mut decision = self.decision(job, outcome, attempt, queue_wait_ms, 0, now);
        decision.retry_after_ms = retry_after_ms;
        decision.reason = Some(reason.to_string());
        decision.reason_code = Some(code.to_string());
        let slo = self.s.scheduler.slo_for(&job.model, job.slo.as_ref());
        let request = JobRequest::from_job(job, f64::from(job.max_tokens), slo);
        decision.cost = Some(request.cost_estimate());
        decision.slo = Some(slo);
        self.emit(Outcome::Reject {
            decision: Box::new(decision),
            error,
            message: reason.to_string(),
            acker,
        });
    }

    /// The decision record of an Assignment of `job` to `winner`: the judgement's cost,
    /// scoring, candidates (at most `decision_max_candidates`) and rejections, and notes
    /// on anything out of the ordinary (least harm, a floor waiver, a late job, a retry,
    /// workers of other models left out).
    pub(super) fn assignment_record(
        &self,
        job: &QueuedJob,
        judged: Judged,
        winner: &str,
        latency_us: u64,
        waited_ms: u64,
        other_models: usize,
    ) -> Decision {
        let now = self.now_ms;
        let mut decision = self.decision(
            &job.job,
            DecisionOutcome::Assigned,
            job.attempt,
            now.saturating_sub(job.enqueued_ms),
            latency_us,
            now,
        );
        let Judged {
            request,
            slo,
            evaluation,
            waiver,
            least_harm_note,
            ..
        } = judged;
        decision.worker_id = Some(winner.to_string());
        decision.slo = Some(slo);
        decision.cost = Some(evaluation.cost);
        decision.scoring = Some(evaluation.scoring);
        decision.candidates = evaluation.candidates;
        decision.rejected = evaluation.rejected;
        decision.affinity = evaluation.affinity;
        if let Some(a) = &decision.affinity {
            self.metrics.affinity_decided(&job.job.model, a);
        }
        let mut notes = Vec::new();
        notes.extend(decision.affinity.as_ref().and_then(affinity_overridden));
        notes.extend(least_harm_note);
        notes.extend(waiver.map(|w| w.note));
        if request.ttft_remaining_ms.is_none() {
            notes.push(format!(
                "late: waited {waited_ms} ms, past its {} ms TTFT target",
                slo.ttft_ms
            ));
        }
        if job.attempt > 1 {
            notes.push(format!("attempt {} (assigned again)", job.attempt));
        }
        if !self.s.decision_list_wrong_model && other_models > 0 {
            notes.push(format!(
                "{other_models} workers serving other models not listed"
            ));
        }
        let max = self.s.decision_max_candidates;
        if max > 0 && decision.candidates.len() > max {
            notes.push(format!(
                "{} more candidates not listed (decision_max_candidates = {max})",
                decision.candidates.len() - max
            ));
            decision.candidates.truncate(max);
        }
        if !notes.is_empty() {
            decision.reason = Some(notes.join("; "));
        }
        decision
    }
}

/// When the worker holding most of the job's prompt was not given the job: who, and why
/// (the decision's [`Affinity`] record in words).
fn affinity_overridden(affinity: &Affinity) -> Option<String> {
    (affinity.outcome == AffinityOutcome::Overridden).then(|| {
        format!(
            "prefix affinity overridden: {} holds {} cached prompt tokens, {} ({})",
            affinity.worker_id,
            affinity.cached_tokens,
            affinity.reason.as_deref().unwrap_or("no reason recorded"),
            affinity.reason_code.as_deref().unwrap_or("-"),
        )
    })
}
