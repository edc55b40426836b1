//! The job as the scheduler sees it: its model and its size in tokens.
//!
//! The size drives two things: the KV tokens to reserve (`prompt + max_tokens`, the most the
//! job can ever occupy) and the predicted output length used for the job-cost term (the
//! per-model output-length EWMA, never more than `max_tokens`).

use metronome_protocol::decision::JobCostEstimate;
use metronome_protocol::Job;
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
}

impl JobRequest {
    /// Build from a wire job and a prediction of its output length (pass `max_tokens as
    /// f64` when no prediction exists: the worst case).
    pub fn from_job(job: &Job, predicted_output_tokens: f64) -> Self {
        JobRequest {
            job_id: job.id.clone(),
            model: job.model.clone(),
            prompt_tokens: job.prompt_tokens,
            max_tokens: job.max_tokens,
            predicted_output_tokens,
        }
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
        }
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
