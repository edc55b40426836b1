//! Step cost: how long one engine step takes on the simulated GPU.
//!
//! A step of a continuous-batching engine is one forward pass over every scheduled token.
//! Its time has three parts, each mapping to a real effect (the calibration is explained in
//! `gpu-sim/README.md`):
//!
//! - `base_step_ms`: reading the model weights once. Decode at small batch is memory-bound,
//!   so this is the floor of every step (≈ 16 GB of bf16 weights over ≈ 1 TB/s).
//! - `alpha`: each additional decoding sequence adds `alpha * base_step_ms` of compute
//!   (its share of the linear layers), so time per output token rises with batch size.
//! - `prefill_ms_per_token`: prompt tokens are compute-bound; a prefill in the step stalls
//!   every decoding sequence of that step for its whole cost.
//! - `kv_read_ms_per_token`: attention reads every cached token of every scheduled
//!   sequence, so long contexts make every step slower.
//!
//! Invariants: an empty step costs nothing; the cost is monotone in each input; `speed`
//! divides the whole step (0.5 = a GPU half as fast), and is always > 0.

use std::time::Duration;

/// The knobs of the step-time model, already validated (`speed > 0`, all others `>= 0`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    pub base_step_ms: f64,
    pub alpha: f64,
    pub prefill_ms_per_token: f64,
    pub kv_read_ms_per_token: f64,
    pub speed: f64,
}

/// What one step computed: the inputs of the cost model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences that each decoded one token.
    pub decode_seqs: u32,
    /// Prompt (or recomputed) tokens prefilled in this step, over all sequences.
    pub prefill_tokens: u32,
    /// Tokens of KV cache attended to by the scheduled sequences.
    pub kv_tokens_read: u64,
}

impl StepShape {
    pub fn is_empty(&self) -> bool {
        self.decode_seqs == 0 && self.prefill_tokens == 0
    }
}

impl StepCost {
    /// Simulated duration of a step in milliseconds.
    pub fn step_ms(&self, shape: StepShape) -> f64 {
        if shape.is_empty() {
            return 0.0;
        }
        let extra_decoders = f64::from(shape.decode_seqs.saturating_sub(1));
        let weights_and_decode = self.base_step_ms * (1.0 + self.alpha * extra_decoders);
        let prefill = self.prefill_ms_per_token * f64::from(shape.prefill_tokens);
        let attention = self.kv_read_ms_per_token * shape.kv_tokens_read as f64;
        (weights_and_decode + prefill + attention) / self.speed
    }

    /// Simulated duration of a step.
    pub fn step_duration(&self, shape: StepShape) -> Duration {
        Duration::from_secs_f64(self.step_ms(shape).max(0.0) / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> StepCost {
        StepCost {
            base_step_ms: 10.0,
            alpha: 0.1,
            prefill_ms_per_token: 0.5,
            kv_read_ms_per_token: 0.01,
            speed: 1.0,
        }
    }

    fn decode(n: u32) -> StepShape {
        StepShape {
            decode_seqs: n,
            ..StepShape::default()
        }
    }

    #[test]
    fn empty_step_costs_nothing() {
        assert_eq!(cost().step_ms(StepShape::default()), 0.0);
    }

    #[test]
    fn single_decode_costs_the_base_step() {
        assert!((cost().step_ms(decode(1)) - 10.0).abs() < 1e-9);
    }

    #[test]
    fn decode_time_grows_linearly_with_batch() {
        // 10 * (1 + 0.1 * 9) = 19
        assert!((cost().step_ms(decode(10)) - 19.0).abs() < 1e-9);
    }

    #[test]
    fn prefill_and_attention_add_to_the_step() {
        let shape = StepShape {
            decode_seqs: 1,
            prefill_tokens: 100,
            kv_tokens_read: 1000,
        };
        // 10 + 50 + 10
        assert!((cost().step_ms(shape) - 70.0).abs() < 1e-9);
    }

    #[test]
    fn half_speed_doubles_the_step() {
        let slow = StepCost {
            speed: 0.5,
            ..cost()
        };
        let shape = StepShape {
            decode_seqs: 3,
            prefill_tokens: 7,
            kv_tokens_read: 99,
        };
        assert!((slow.step_ms(shape) - 2.0 * cost().step_ms(shape)).abs() < 1e-9);
    }

    #[test]
    fn zero_delay_mode_costs_nothing() {
        let zero = StepCost {
            base_step_ms: 0.0,
            alpha: 0.0,
            prefill_ms_per_token: 0.0,
            kv_read_ms_per_token: 0.0,
            speed: 1.0,
        };
        let shape = StepShape {
            decode_seqs: 64,
            prefill_tokens: 4096,
            kv_tokens_read: 40_000,
        };
        assert_eq!(zero.step_duration(shape), Duration::ZERO);
    }
}
