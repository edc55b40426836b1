//! The job as the scheduler sees it: its model and its size in tokens.
//!
//! The size drives two things: the KV tokens to reserve (`prompt + max_tokens`, the most the
//! job can ever occupy) and the predicted output length used for the job-cost term (the
//! per-model output-length EWMA, never more than `max_tokens`).

use metronome_protocol::decision::JobCostEstimate;
use metronome_protocol::{Job, Slo};
use serde::{Deserialize, Serialize};

/// One job to place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    pub job_id: String,
    pub model: String,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Output tokens expected; capped at `max_tokens` wherever it is used.
    pub predicted_output_tokens: f64,
    /// The SLO the job is held to.
    pub slo: Slo,
    /// What is left of its TTFT target after the time it already waited, ms; `None` once
    /// that budget is spent (the job can no longer meet its TTFT anywhere, so only the
    /// jobs it would join are protected).
    pub ttft_remaining_ms: Option<f64>,
}

impl JobRequest {
    /// Build from a wire job and a prediction of its output length (pass `max_tokens as
    /// f64` when no prediction exists: the worst case), held to `slo` with its whole TTFT
    /// budget left (see [`JobRequest::waited`]).
    pub fn from_job(job: &Job, predicted_output_tokens: f64, slo: Slo) -> Self {
        JobRequest {
            job_id: job.id.clone(),
            model: job.model.clone(),
            prompt_tokens: job.prompt_tokens,
            max_tokens: job.max_tokens,
            predicted_output_tokens,
            slo,
            ttft_remaining_ms: Some(slo.ttft_ms as f64),
        }
    }

    /// The same job after waiting `waited_ms` since submission: its TTFT budget shrinks,
    /// and is gone (`None`) once the wait alone reaches the target.
    pub fn waited(mut self, waited_ms: u64) -> Self {
        self.ttft_remaining_ms =
            (waited_ms < self.slo.ttft_ms).then(|| (self.slo.ttft_ms - waited_ms) as f64);
        self
    }

    /// KV-cache tokens the job can occupy at its largest: prompt plus every output token.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_tokens)
    }

    /// Predicted output tokens in `[0, max_tokens]`. A non-finite prediction means "no
    /// idea", so it takes the worst case, `max_tokens`.
    pub fn predicted_output(&self) -> f64 {
        let max = f64::from(self.max_tokens);
        let p = self.predicted_output_tokens;
        if p.is_finite() {
            p.clamp(0.0, max)
        } else {
            max
        }
    }

    /// The size record that goes into the decision.
    pub fn cost_estimate(&self) -> JobCostEstimate {
        JobCostEstimate {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            predicted_output_tokens: self.predicted_output(),
            kv_tokens: self.kv_tokens(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(pred: f64) -> JobRequest {
        JobRequest {
            job_id: "j".into(),
            model: "m".into(),
            prompt_tokens: 100,
            max_tokens: 50,
            predicted_output_tokens: pred,
            slo: Slo {
                ttft_ms: 2_000,
                min_tok_s: 30.0,
            },
            ttft_remaining_ms: Some(2_000.0),
        }
    }

    #[test]
    fn waiting_spends_the_ttft_budget() {
        let j = job(1.0);
        assert_eq!(j.clone().waited(500).ttft_remaining_ms, Some(1_500.0));
        assert_eq!(j.clone().waited(2_000).ttft_remaining_ms, None);
        assert_eq!(j.waited(u64::MAX).ttft_remaining_ms, None);
    }

    #[test]
    fn prediction_is_capped_at_max_tokens() {
        let c = job(80.0).cost_estimate();
        assert_eq!(c.predicted_output_tokens, 50.0);
        assert_eq!(c.kv_tokens, 150);
        assert_eq!(job(20.5).predicted_output(), 20.5);
        assert_eq!(job(-3.0).predicted_output(), 0.0);
        assert_eq!(job(f64::NAN).predicted_output(), 50.0);
    }

    #[test]
    fn kv_tokens_do_not_overflow() {
        let mut j = job(1.0);
        j.prompt_tokens = u32::MAX;
        j.max_tokens = u32::MAX;
        assert_eq!(j.kv_tokens(), 2 * u64::from(u32::MAX));
    }
}
