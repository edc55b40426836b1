//! Reading the model server's load from its Prometheus text: requests running, requests
//! waiting, KV-cache occupancy and capacity.
//!
//! Metric names per server family (checked against the servers' documentation and real
//! exposition samples):
//! - vLLM (and the bundled simulator): `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (V1 engine) or the older
//!   `vllm:gpu_cache_usage_perc`, capacity from the labels `num_gpu_blocks` × `block_size`
//!   of `vllm:cache_config_info`.
//! - SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
//!   capacity `sglang:max_total_num_tokens` when exported.
//! - llama.cpp: `llamacpp:requests_processing`, `llamacpp:requests_deferred`, and
//!   `llamacpp:kv_cache_usage_ratio` on builds that export it.
//! - TGI: `tgi_batch_current_size`, `tgi_queue_size`; no KV metric.
//!
//! Invariants: a metric that is absent gives `None`, never zero, so the dispatcher can mark
//! the signal unavailable. A server with several engines or models exports one sample per
//! label set: counts are summed, capacities summed, occupancy takes the fullest engine (the
//! one that will refuse work first). Unparseable lines are skipped, never fatal.

use metronome_protocol::prometheus::{self, Sample};
use metronome_protocol::KvUsage;

use crate::config::ServerKind;

/// The server's load as the heartbeat reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerLoad {
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    pub kv: Option<KvUsage>,
}

struct Names {
    running: &'static [&'static str],
    waiting: &'static [&'static str],
    /// First name present wins (newer names first).
    kv_used: &'static [&'static str],
}

fn names(kind: ServerKind) -> Names {
    match kind {
        ServerKind::Vllm | ServerKind::Simulator => Names {
            running: &["vllm:num_requests_running"],
            waiting: &["vllm:num_requests_waiting"],
            kv_used: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        },
        ServerKind::Sglang => Names {
            running: &["sglang:num_running_reqs"],
            waiting: &["sglang:num_queue_reqs"],
            kv_used: &["sglang:token_usage"],
        },
        ServerKind::Llamacpp => Names {
            running: &["llamacpp:requests_processing"],
            waiting: &["llamacpp:requests_deferred"],
            kv_used: &["llamacpp:kv_cache_usage_ratio"],
        },
        ServerKind::Tgi => Names {
            running: &["tgi_batch_current_size"],
            waiting: &["tgi_queue_size"],
            kv_used: &[],
        },
    }
}

fn sum_of(samples: &[Sample], names: &[&str]) -> Option<f64> {
    names.iter().find_map(|name| {
        let mut found = false;
        let sum = samples
            .iter()
            .filter(|s| s.name == *name && s.value.is_finite())
            .inspect(|_| found = true)
            .map(|s| s.value)
            .sum::<f64>();
        found.then_some(sum)
    })
}

fn max_of(samples: &[Sample], names: &[&str]) -> Option<f64> {
    names.iter().find_map(|name| {
        samples
            .iter()
            .filter(|s| s.name == *name && s.value.is_finite())
            .map(|s| s.value)
            .reduce(f64::max)
    })
}

fn count(v: Option<f64>) -> Option<u32> {
    v.map(|v| v.max(0.0).round().min(u32::MAX as f64) as u32)
}

/// KV capacity in tokens, when the server tells it.
fn capacity_tokens(kind: ServerKind, samples: &[Sample]) -> Option<u64> {
    match kind {
        ServerKind::Vllm | ServerKind::Simulator => {
            // Labels hold numbers as strings, and "None" before the engine profiled memory.
            let per_engine: Vec<u64> = samples
                .iter()
                .filter(|s| s.name == "vllm:cache_config_info")
                .filter_map(|s| {
                    let blocks: u64 = s.label("num_gpu_blocks")?.parse().ok()?;
                    let size: u64 = s.label("block_size")?.parse().ok()?;
                    Some(blocks * size)
                })
                .collect();
            (!per_engine.is_empty()).then(|| per_engine.iter().sum())
        }
        ServerKind::Sglang => sum_of(samples, &["sglang:max_total_num_tokens"])
            .filter(|v| *v > 0.0)
            .map(|v| v as u64),
        ServerKind::Llamacpp | ServerKind::Tgi => None,
    }
}

/// Read the load of a server of `kind` from its exposition text.
pub fn scrape(kind: ServerKind, text: &str) -> ServerLoad {
    let samples = prometheus::parse(text);
    let n = names(kind);
    let kv = max_of(&samples, n.kv_used).map(|used| KvUsage {
        used_frac: used.clamp(0.0, 1.0),
        capacity_tokens: capacity_tokens(kind, &samples),
    });
    ServerLoad {
        running: count(sum_of(&samples, n.running)),
        waiting: count(sum_of(&samples, n.waiting)),
        kv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shaped like a vLLM 0.10 (V1 engine) `/metrics` page.
    const VLLM_V1: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4172
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27258",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.93
"#;

    /// Shaped like a vLLM 0.6 (V0 engine) page: the older KV name.
    const VLLM_V0: &str = r#"# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="facebook/opt-125m"} 1.0
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="facebook/opt-125m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="facebook/opt-125m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="facebook/opt-125m"} 0.05
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_cpu_blocks="7281",num_gpu_blocks="None",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
"#;

    /// Shaped like SGLang's documented `/metrics` output.
    const SGLANG: &str = r#"# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 17.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 471258.0
"#;

    #[test]
    fn vllm_v1_names() {
        let load = scrape(ServerKind::Vllm, VLLM_V1);
        assert_eq!(load.running, Some(3));
        assert_eq!(load.waiting, Some(2));
        let kv = load.kv.unwrap();
        assert!((kv.used_frac - 0.4172).abs() < 1e-9);
        assert_eq!(kv.capacity_tokens, Some(27258 * 16));
    }

    #[test]
    fn vllm_v0_names_and_unknown_capacity() {
        let load = scrape(ServerKind::Vllm, VLLM_V0);
        assert_eq!(load.running, Some(1));
        assert_eq!(load.waiting, Some(0));
        let kv = load.kv.unwrap();
        assert!((kv.used_frac - 0.05).abs() < 1e-9);
        assert_eq!(
            kv.capacity_tokens, None,
            "num_gpu_blocks=\"None\" is no capacity"
        );
    }

    #[test]
    fn sglang_names() {
        let load = scrape(ServerKind::Sglang, SGLANG);
        assert_eq!(load.running, Some(17));
        assert_eq!(load.waiting, Some(4));
        let kv = load.kv.unwrap();
        assert!((kv.used_frac - 0.28).abs() < 1e-9);
        assert_eq!(kv.capacity_tokens, Some(471_258));
    }

    #[test]
    fn several_engines_sum_counts_and_take_the_fullest_cache() {
        let text = r#"vllm:num_requests_running{engine="0"} 2
vllm:num_requests_running{engine="1"} 5
vllm:kv_cache_usage_perc{engine="0"} 0.25
vllm:kv_cache_usage_perc{engine="1"} 0.75
vllm:cache_config_info{engine="0",block_size="16",num_gpu_blocks="100"} 1
vllm:cache_config_info{engine="1",block_size="16",num_gpu_blocks="100"} 1
"#;
        let load = scrape(ServerKind::Simulator, text);
        assert_eq!(load.running, Some(7));
        assert_eq!(load.waiting, None, "absent is unknown, not zero");
        assert_eq!(load.kv.unwrap().used_frac, 0.75);
        assert_eq!(load.kv.unwrap().capacity_tokens, Some(3200));
    }

    #[test]
    fn a_server_without_metrics_reports_nothing() {
        assert_eq!(scrape(ServerKind::Vllm, ""), ServerLoad::default());
        assert_eq!(scrape(ServerKind::Sglang, VLLM_V1), ServerLoad::default());
        let tgi = scrape(
            ServerKind::Tgi,
            "tgi_batch_current_size 4\ntgi_queue_size 7\n",
        );
        assert_eq!((tgi.running, tgi.waiting, tgi.kv), (Some(4), Some(7), None));
    }
}
