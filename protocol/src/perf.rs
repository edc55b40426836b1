//! The per-worker performance model on the wire: the coefficients a worker-agent has fitted
//! from its own measurements (sent in every heartbeat), the SLO a job is held to, and the
//! predictions a decision records for every candidate.
//!
//! The model is linear in signals every OpenAI-compatible server lets an agent measure:
//!
//! - decode step (time per output token of one stream) with `s` streams decoding over
//!   `c` context tokens: `step_base_ms + step_per_stream_ms * (s - 1) + step_per_ktok_ms * c / 1000`;
//! - stall of every decoding stream while `p` prompt tokens are prefilled beside it:
//!   `stall_per_prefill_token_ms * p`;
//! - time to first token of a job with `p` prompt tokens behind `q` prompt tokens still
//!   waiting for their prefill, with `s` streams running:
//!   `ttft_base_ms + prefill_per_token_ms * (p + q) + ttft_per_stream_ms * s`.
//!
//! The fitting (recursive least squares) lives in `metronome-scheduler`'s `perf` module.

use serde::{Deserialize, Serialize};

/// Fitted coefficients of one worker's performance model, all in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PerfCoefficients {
    /// Decode step time of a single stream with an empty context.
    pub step_base_ms: f64,
    /// Extra decode step time per additional decoding stream.
    pub step_per_stream_ms: f64,
    /// Extra decode step time per 1,000 tokens of context held by the decoding streams.
    pub step_per_ktok_ms: f64,
    /// Time every decoding stream loses per prompt token prefilled beside it.
    pub stall_per_prefill_token_ms: f64,
    /// Time to first token of a one-token prompt on an idle worker.
    pub ttft_base_ms: f64,
    /// Time to first token per prompt token (its own and those waiting ahead of it).
    pub prefill_per_token_ms: f64,
    /// Extra time to first token per stream already running.
    pub ttft_per_stream_ms: f64,
    /// How far the decode fit's recent predictions of a job's time per output token were
    /// off, ms (their mean absolute error over about the last ten jobs; 0 for the prior,
    /// within the fit's first ten jobs and from agents that predate it). Admission judges a
    /// rate floor at the step plus this much, so a stream is not let down to its floor by a
    /// prediction known to be that uncertain.
    #[serde(default)]
    pub step_error_ms: f64,
    /// Completed jobs the coefficients were fitted on (0: the configured prior).
    pub samples: u64,
}

/// The service level a job is held to: both parts must hold for the job to count as
/// served well.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Longest acceptable time from submission to the first token, ms.
    pub ttft_ms: u64,
    /// Lowest acceptable decode rate (output tokens per second after the first token).
    pub min_tok_s: f64,
}

/// A client's request to hold its job to a tighter SLO than its model's (per field; a
/// looser value than the model's is ignored).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct SloRequest {
    #[serde(default)]
    pub ttft_ms: Option<u64>,
    #[serde(default)]
    pub min_tok_s: Option<f64>,
}

/// Highest decode-rate floor a job may ask for: far above any GPU's single-stream rate, so
/// only nonsense is refused.
pub const MAX_SLO_TOK_S: f64 = 10_000.0;

/// Which field of an [`SloRequest`] is out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloField {
    /// `ttft_ms` is 0.
    TtftMs,
    /// `min_tok_s` is not a number in (0, [`MAX_SLO_TOK_S`]].
    MinTokS,
}

impl SloRequest {
    /// The first field out of range, if any: the one rule the dispatcher (for jobs from
    /// NATS) and the gateway (for its headers) both apply.
    pub fn invalid_field(&self) -> Option<SloField> {
        if self.ttft_ms == Some(0) {
            return Some(SloField::TtftMs);
        }
        match self.min_tok_s {
            Some(r) if !(r.is_finite() && r > 0.0 && r <= MAX_SLO_TOK_S) => Some(SloField::MinTokS),
            _ => None,
        }
    }
}

/// What the dispatcher predicted for a job on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Time to first token once assigned (excluding the time already waited in the queue).
    pub ttft_ms: f64,
    /// The job's own decode rate, tokens/s, averaged over its whole decode: the rate at the
    /// batch it joins, less the stall the prefills of later admissions most likely charge it
    /// (the median count of the worker's admissions during its decode, at their recent rate,
    /// times their recent mean stall).
    /// What its measured tokens/s is compared with.
    pub decode_tok_s: f64,
    /// The rate at the batch it joins, before any later stall: what the admission filter
    /// compares with the job's floor (later admissions are held to every running job's
    /// floor on their own). Absent in decisions of older dispatchers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_tok_s: Option<f64>,
    /// Lowest predicted decode rate over the jobs already running on the worker once this
    /// one is admitted (their whole-life average); `None` when nothing runs there.
    pub worst_running_tok_s: Option<f64>,
    /// Streams running there once the job is admitted.
    pub streams_after: u32,
    /// Samples behind the worker's model (0: predicted from the prior alone).
    pub model_samples: u64,
    /// Time the job's prefill takes from each stream already running there, ms (its
    /// uncached prompt tokens at the worker's stall per prefill token). Absent in decisions
    /// of older dispatchers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_ms: Option<f64>,
}

impl Prediction {
    /// What placing the job here costs in prefill, ms: its own time to first token plus
    /// the stall its prefill imposes on every stream already running there. The measure
    /// prefix affinity compares workers on ([`stall_ms`](Self::stall_ms) absent: `None`).
    pub fn prefill_cost_ms(&self) -> Option<f64> {
        let running = f64::from(self.streams_after.saturating_sub(1));
        let cost = self.ttft_ms + running * self.stall_ms?;
        cost.is_finite().then_some(cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_cost_counts_the_stall_on_the_streams_already_running() {
        let p = Prediction {
            ttft_ms: 300.0,
            decode_tok_s: 40.0,
            step_tok_s: Some(45.0),
            worst_running_tok_s: Some(38.0),
            streams_after: 4,
            model_samples: 10,
            stall_ms: Some(25.0),
        };
        // Three streams were running before it: 300 + 3 × 25.
        assert_eq!(p.prefill_cost_ms(), Some(375.0));
        let alone = Prediction {
            streams_after: 1,
            ..p
        };
        assert_eq!(alone.prefill_cost_ms(), Some(300.0));
        let older = Prediction {
            stall_ms: None,
            ..p
        };
        assert_eq!(older.prefill_cost_ms(), None);
        let json = serde_json::to_value(older).unwrap();
        assert!(json.get("stall_ms").is_none(), "absent, not null: {json}");
        let back: Prediction = serde_json::from_value(json).unwrap();
        assert_eq!(back, older);
    }

    #[test]
    fn an_slo_request_names_its_first_field_out_of_range() {
        let ok = SloRequest {
            ttft_ms: Some(1),
            min_tok_s: Some(10_000.0),
        };
        assert_eq!(ok.invalid_field(), None);
        assert_eq!(SloRequest::default().invalid_field(), None);
        let zero = SloRequest {
            ttft_ms: Some(0),
            min_tok_s: Some(f64::NAN),
        };
        assert_eq!(zero.invalid_field(), Some(SloField::TtftMs));
        for r in [0.0, -1.0, 10_000.5, f64::NAN, f64::INFINITY] {
            let bad = SloRequest {
                ttft_ms: None,
                min_tok_s: Some(r),
            };
            assert_eq!(bad.invalid_field(), Some(SloField::MinTokS), "{r}");
        }
    }
}
