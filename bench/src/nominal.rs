//! Nominal capacity of a cluster for a workload: what the GPUs could serve at the SLO's
//! rate floor with perfect packing and no queueing. It sets the offered loads, the same
//! absolute rates for every policy, so no policy's own behaviour decides the load levels.
//!
//! Derived analytically from the simulator's calibrated cost model (`metronome_gpu_sim`'s
//! `SimGpuConfig::default()`):
//!
//! - `step_ms(b) = base_step_ms (1 + alpha (b - 1)) + kv_read_ms_per_token · b · (P + O/2)`,
//!   the decode step of a batch of `b` streams whose context averages the mean prompt `P`
//!   plus half the mean output `O`;
//! - `b*` = the largest batch (≤ `max_num_seqs`, with `b · (P + O)` tokens fitting the KV
//!   cache) whose per-stream rate `1000 / step_ms(b)` stays at or above the SLO floor;
//! - `t_req` = the mean over the workload's planned requests of
//!   `(prompt · prefill_ms_per_token + output · step_ms(b*) / b*) / 1000` seconds of one
//!   full-speed GPU: its prefill alone, its decode steps shared with `b* - 1` others;
//! - capacity = `Σ_gpu speed / t_req` requests/s (a GPU of speed 0.5 does every step in
//!   twice the time).
//!
//! It is an upper bound no dispatcher reaches (prefill stalls, arrival bursts and
//! imperfect packing all cost), which is why loads go to 150 % of it: the curves show where
//! each policy falls off. Pure: no I/O.

use serde::{Deserialize, Serialize};

use metronome_loadgen::PlannedRequest;

/// The simulator's cost parameters that capacity depends on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    pub base_step_ms: f64,
    pub alpha: f64,
    pub prefill_ms_per_token: f64,
    pub kv_read_ms_per_token: f64,
    pub kv_capacity_tokens: u32,
    pub max_num_seqs: u32,
}

impl CostModel {
    /// The simulator's defaults (the calibration documented in `gpu-sim/README.md`).
    pub fn simulator_defaults() -> CostModel {
        let c = metronome_gpu_sim::SimGpuConfig::default();
        CostModel {
            base_step_ms: c.base_step_ms,
            alpha: c.alpha,
            prefill_ms_per_token: c.prefill_ms_per_token,
            kv_read_ms_per_token: c.kv_read_ms_per_token,
            kv_capacity_tokens: c.kv_capacity_tokens,
            max_num_seqs: c.max_num_seqs,
        }
    }

    /// Decode step time (ms, full speed) of `b` streams with mean context `ctx` tokens.
    pub fn step_ms(&self, b: u32, ctx: f64) -> f64 {
        let b = f64::from(b.max(1));
        self.base_step_ms * (1.0 + self.alpha * (b - 1.0)) + self.kv_read_ms_per_token * b * ctx
    }
}

/// The nominal capacity of one workload on one cluster, with the figures behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Nominal {
    pub mean_prompt: f64,
    pub mean_output: f64,
    /// The batch each GPU runs at (see module docs).
    pub batch: u32,
    /// Decode step at that batch, ms at speed 1.
    pub step_ms: f64,
    /// Mean GPU-seconds (speed 1) per request.
    pub t_req_s: f64,
    /// Sum of the GPUs' speed factors.
    pub speed_sum: f64,
    /// Requests/s.
    pub capacity_rps: f64,
}

/// The largest batch that keeps the SLO's per-stream rate and fits the KV cache (at least 1:
/// an idle GPU always runs one request, however slowly).
pub fn slo_batch(cost: &CostModel, mean_prompt: f64, mean_output: f64, slo_tok_s: f64) -> u32 {
    let ctx = mean_prompt + mean_output / 2.0;
    let need = (mean_prompt + mean_output).max(1.0);
    let mut best = 1;
    for b in 1..=cost.max_num_seqs.max(1) {
        let fits = f64::from(b) * need <= f64::from(cost.kv_capacity_tokens);
        let fast = 1000.0 / cost.step_ms(b, ctx) >= slo_tok_s;
        if !(fits && fast) {
            break;
        }
        best = b;
    }
    best
}

/// Nominal capacity of `speeds` for `requests` (see module docs). `None` without requests.
pub fn nominal_capacity(
    cost: &CostModel,
    requests: &[PlannedRequest],
    speeds: &[f64],
    slo_tok_s: f64,
) -> Option<Nominal> {
    if requests.is_empty() {
        return None;
    }
    let n = requests.len() as f64;
    let mean_prompt = requests
        .iter()
        .map(|r| f64::from(r.prompt_tokens))
        .sum::<f64>()
        / n;
    let mean_output = requests
        .iter()
        .map(|r| f64::from(r.output_tokens))
        .sum::<f64>()
        / n;
    let batch = slo_batch(cost, mean_prompt, mean_output, slo_tok_s);
    let step_ms = cost.step_ms(batch, mean_prompt + mean_output / 2.0);
    let t_req_s = requests
        .iter()
        .map(|r| {
            (f64::from(r.prompt_tokens) * cost.prefill_ms_per_token
                + f64::from(r.output_tokens) * step_ms / f64::from(batch))
                / 1000.0
        })
        .sum::<f64>()
        / n;
    let speed_sum: f64 = speeds.iter().sum();
    (t_req_s > 0.0).then(|| Nominal {
        mean_prompt,
        mean_output,
        batch,
        step_ms,
        t_req_s,
        speed_sum,
        capacity_rps: speed_sum / t_req_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(p: u32, o: u32) -> PlannedRequest {
        PlannedRequest {
            id: 0,
            at_s: 0.0,
            prompt_tokens: p,
            output_tokens: o,
            tenant: None,
            messages: Vec::new(),
        }
    }

    fn cost() -> CostModel {
        CostModel {
            base_step_ms: 16.7,
            alpha: 0.01,
            prefill_ms_per_token: 0.16,
            kv_read_ms_per_token: 0.00013,
            kv_capacity_tokens: 40_000,
            max_num_seqs: 256,
        }
    }

    #[test]
    fn uses_the_simulator_calibration() {
        assert_eq!(CostModel::simulator_defaults(), cost());
    }

    #[test]
    fn step_time_grows_with_batch_and_context() {
        let c = cost();
        assert!((c.step_ms(1, 0.0) - 16.7).abs() < 1e-12);
        assert!((c.step_ms(11, 0.0) - 16.7 * 1.1).abs() < 1e-12);
        assert!((c.step_ms(2, 1000.0) - (16.7 * 1.01 + 0.00013 * 2.0 * 1000.0)).abs() < 1e-12);
    }

    #[test]
    fn chat_batch_is_bounded_by_the_kv_cache() {
        // 1,200 tokens per stream: 33 fit in 40,000; the rate floor alone would allow ~54.
        assert_eq!(slo_batch(&cost(), 1000.0, 200.0, 30.0), 33);
        let mut big = cost();
        big.kv_capacity_tokens = 1_000_000;
        let b = slo_batch(&big, 1000.0, 200.0, 30.0);
        assert!(1000.0 / big.step_ms(b, 1100.0) >= 30.0);
        assert!(1000.0 / big.step_ms(b + 1, 1100.0) < 30.0, "{b}");
    }

    #[test]
    fn batch_respects_max_num_seqs_and_is_at_least_one() {
        let mut c = cost();
        c.max_num_seqs = 8;
        assert_eq!(slo_batch(&c, 10.0, 10.0, 30.0), 8);
        // A floor no batch meets still leaves one stream per GPU.
        assert_eq!(slo_batch(&cost(), 100.0, 100.0, 1000.0), 1);
    }

    #[test]
    fn capacity_is_speed_sum_over_mean_request_time() {
        let c = cost();
        let reqs = [req(1000, 200), req(1000, 200)];
        let equal = nominal_capacity(&c, &reqs, &[1.0; 4], 30.0).unwrap();
        assert_eq!(equal.batch, 33);
        let step = c.step_ms(33, 1100.0);
        let t = (1000.0 * 0.16 + 200.0 * step / 33.0) / 1000.0;
        assert!((equal.t_req_s - t).abs() < 1e-12);
        assert!((equal.capacity_rps - 4.0 / t).abs() < 1e-9);
        // ≈ 0.32 s per request: about 3.1 req/s per full-speed GPU.
        assert!((equal.capacity_rps - 12.4).abs() < 0.2, "{equal:?}");
        let mixed = nominal_capacity(&c, &reqs, &[1.0, 1.0, 1.0, 0.5], 30.0).unwrap();
        assert!((mixed.capacity_rps / equal.capacity_rps - 3.5 / 4.0).abs() < 1e-12);
        assert!(nominal_capacity(&c, &[], &[1.0], 30.0).is_none());
    }

    #[test]
    fn request_time_is_the_mean_over_requests() {
        let c = cost();
        // Same means, different spread: the per-request sum is linear, so t_req is equal.
        let a = nominal_capacity(&c, &[req(500, 100), req(1500, 300)], &[1.0], 30.0).unwrap();
        let b = nominal_capacity(&c, &[req(1000, 200), req(1000, 200)], &[1.0], 30.0).unwrap();
        assert!((a.t_req_s - b.t_req_s).abs() < 1e-12);
    }
}
