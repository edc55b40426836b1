//! What the scheduler knows about one worker at decision time: its latest heartbeat, when
//! that heartbeat arrived, and its latency EWMAs.
//!
//! The caller assembles these from the `workers` KV bucket and Redis; the core only reads
//! them. An EWMA with zero samples carries no information and is treated as unavailable.

use metronome_protocol::WorkerStatus;
use serde::{Deserialize, Serialize};

/// The worker's latency and throughput EWMAs (the Redis `ewma` hash).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EwmaSnapshot {
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Time per output token after the first, ms.
    pub tpot_ms: f64,
    /// Per-request output tokens per second.
    pub tok_s: f64,
    /// End-to-end request time, ms.
    pub e2e_ms: f64,
    /// Completed requests folded into the averages.
    pub samples: u64,
    /// When the averages were last updated (Unix ms).
    pub updated_ms: u64,
}

impl EwmaSnapshot {
    /// True when at least one sample has been folded in.
    pub fn has_samples(&self) -> bool {
        self.samples > 0
    }

    /// Time per output token in ms: the `tpot_ms` EWMA, or `1000 / tok_s` when only the
    /// rate is known. `None` when neither is a positive finite number.
    pub fn tpot_estimate_ms(&self) -> Option<f64> {
        if !self.has_samples() {
            return None;
        }
        if self.tpot_ms.is_finite() && self.tpot_ms > 0.0 {
            Some(self.tpot_ms)
        } else if self.tok_s.is_finite() && self.tok_s > 0.0 {
            Some(1000.0 / self.tok_s)
        } else {
            None
        }
    }

    /// Per-request tokens/s: the `tok_s` EWMA, or `1000 / tpot_ms` when only the step time
    /// is known.
    pub fn rate_estimate_tok_s(&self) -> Option<f64> {
        if !self.has_samples() {
            return None;
        }
        if self.tok_s.is_finite() && self.tok_s > 0.0 {
            Some(self.tok_s)
        } else if self.tpot_ms.is_finite() && self.tpot_ms > 0.0 {
            Some(1000.0 / self.tpot_ms)
        } else {
            None
        }
    }
}

/// One worker as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerView {
    /// Latest heartbeat.
    pub status: WorkerStatus,
    /// When the dispatcher received that heartbeat (Unix ms, the dispatcher's clock, so the
    /// freshness check never depends on the worker's clock).
    pub last_seen_ms: u64,
    /// `None` until the worker has completed a request.
    pub ewma: Option<EwmaSnapshot>,
    /// Why the latest heartbeat claims more than the worker was provisioned for
    /// ([`crate::provisioning`]); `None`: within its provisioning, or none is checked.
    #[serde(default)]
    pub not_provisioned: Option<String>,
}

impl WorkerView {
    /// The EWMA snapshot when it has at least one sample.
    pub fn ewma_with_samples(&self) -> Option<&EwmaSnapshot> {
        self.ewma.as_ref().filter(|e| e.has_samples())
    }

    pub fn worker_id(&self) -> &str {
        &self.status.worker_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_fall_back_to_each_other() {
        let e = EwmaSnapshot {
            tok_s: 50.0,
            samples: 1,
            ..Default::default()
        };
        assert_eq!(e.tpot_estimate_ms(), Some(20.0));
        assert_eq!(e.rate_estimate_tok_s(), Some(50.0));
        let e = EwmaSnapshot {
            tpot_ms: 25.0,
            samples: 1,
            ..Default::default()
        };
        assert_eq!(e.rate_estimate_tok_s(), Some(40.0));
        let e = EwmaSnapshot {
            tpot_ms: 25.0,
            samples: 0,
            ..Default::default()
        };
        assert_eq!(e.rate_estimate_tok_s(), None);
        let e = EwmaSnapshot {
            tpot_ms: f64::NAN,
            samples: 3,
            ..Default::default()
        };
        assert_eq!(e.tpot_estimate_ms(), None);
    }
}
