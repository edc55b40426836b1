//! Prometheus metrics of one simulated GPU, under vLLM's names so that anything scraping a
//! real vLLM (the worker-agent's heartbeat) scrapes the simulator unchanged.
//!
//! Names follow vLLM's production metrics (docs.vllm.ai, "Production Metrics"): gauges
//! `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
//! (v1 name, 0..1) and `vllm:gpu_cache_usage_perc` (older name, same value); counters
//! `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:request_success_total`, and the prefix cache's `vllm:prefix_cache_queries_total`
//! and `vllm:prefix_cache_hits_total` (in tokens, vLLM v1's names); histograms `vllm:time_to_first_token_seconds`,
//! `vllm:time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds` (wall clock,
//! as vLLM measures them); `vllm:cache_config_info` with `block_size` and `num_gpu_blocks`
//! labels. Every series carries `model_name`. The simulator's own series (`metronome_sim_*`)
//! report its simulated clock, which is exact where wall-clock time is noisy.

use std::fmt::Write;

use crate::engine::EngineStats;

pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
pub const GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";
/// Counter family; the sample is `vllm:num_preemptions_total`.
pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions";
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens";
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens";
pub const REQUEST_SUCCESS: &str = "vllm:request_success";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "vllm:time_per_output_token_seconds";
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// Counter family (tokens); the sample is `vllm:prefix_cache_queries_total`.
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries";
/// Counter family (tokens); the sample is `vllm:prefix_cache_hits_total`.
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits";
/// Simulated GPU busy time (sum of step durations), in seconds.
pub const SIM_BUSY_SECONDS: &str = "metronome_sim_busy_seconds";
pub const SIM_STEPS: &str = "metronome_sim_steps";
/// Tokens prefilled again after preemptions.
pub const SIM_RECOMPUTED_TOKENS: &str = "metronome_sim_recomputed_tokens";
pub const SIM_SPEED_FACTOR: &str = "metronome_sim_speed_factor";
pub const SIM_KV_CAPACITY_TOKENS: &str = "metronome_sim_kv_capacity_tokens";

/// vLLM's TTFT buckets, in seconds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's time-per-output-token buckets, in seconds.
pub const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request latency buckets, in seconds.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram with fixed buckets (cumulative counts are computed on render).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}"
            );
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Request-level measurements kept beside the engine.
#[derive(Clone, Debug)]
pub struct RequestMetrics {
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub finished_length: u64,
    pub finished_stop: u64,
    pub aborted: u64,
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            finished_length: 0,
            finished_stop: 0,
            aborted: 0,
        }
    }
}

/// What `/metrics` renders for one GPU.
pub struct Snapshot<'a> {
    pub model: &'a str,
    pub speed: f64,
    pub prefix_caching: bool,
    pub engine: EngineStats,
    pub requests: &'a RequestMetrics,
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}"
    );
}

/// A counter family `name` with one sample `name_total`, as prometheus_client renders it.
fn counter(out: &mut String, name: &str, help: &str, labels: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name}_total{{{labels}}} {value}"
    );
}

/// Render the Prometheus text exposition.
pub fn render(s: &Snapshot<'_>) -> String {
    let labels = format!("model_name=\"{}\"", escape(s.model));
    let e = &s.engine;
    let mut out = String::with_capacity(8 * 1024);
    gauge(
        &mut out,
        NUM_REQUESTS_RUNNING,
        "Number of requests in model execution batches.",
        &labels,
        e.running,
    );
    gauge(
        &mut out,
        NUM_REQUESTS_WAITING,
        "Number of requests waiting to be processed.",
        &labels,
        e.waiting,
    );
    gauge(
        &mut out,
        KV_CACHE_USAGE_PERC,
        "KV-cache usage. 1 means 100 percent usage.",
        &labels,
        e.kv_usage(),
    );
    gauge(
        &mut out,
        GPU_CACHE_USAGE_PERC,
        "GPU KV-cache usage. 1 means 100 percent usage.",
        &labels,
        e.kv_usage(),
    );
    counter(
        &mut out,
        NUM_PREEMPTIONS,
        "Cumulative number of preemption from the engine.",
        &labels,
        e.preemptions_total,
    );
    counter(
        &mut out,
        PROMPT_TOKENS,
        "Number of prefill tokens processed.",
        &labels,
        e.prompt_tokens_total,
    );
    counter(
        &mut out,
        GENERATION_TOKENS,
        "Number of generation tokens processed.",
        &labels,
        e.generation_tokens_total,
    );
    counter(
        &mut out,
        PREFIX_CACHE_QUERIES,
        "Prefix cache queries, in terms of number of queried tokens.",
        &labels,
        e.prefix_cache_queries_total,
    );
    counter(
        &mut out,
        PREFIX_CACHE_HITS,
        "Prefix cache hits, in terms of number of cached tokens.",
        &labels,
        e.prefix_cache_hits_total,
    );
    let r = s.requests;
    let _ = writeln!(
        out,
        "# HELP {REQUEST_SUCCESS} Count of successfully processed requests.\n# TYPE {REQUEST_SUCCESS} counter\n\
         {REQUEST_SUCCESS}_total{{finished_reason=\"length\",{labels}}} {}\n\
         {REQUEST_SUCCESS}_total{{finished_reason=\"stop\",{labels}}} {}\n\
         {REQUEST_SUCCESS}_total{{finished_reason=\"abort\",{labels}}} {}",
        r.finished_length, r.finished_stop, r.aborted
    );
    r.ttft.render(
        &mut out,
        TIME_TO_FIRST_TOKEN_SECONDS,
        "Histogram of time to first token in seconds.",
        &labels,
    );
    r.tpot.render(
        &mut out,
        TIME_PER_OUTPUT_TOKEN_SECONDS,
        "Histogram of time per output token in seconds.",
        &labels,
    );
    r.e2e.render(
        &mut out,
        E2E_REQUEST_LATENCY_SECONDS,
        "Histogram of end to end request latency in seconds.",
        &labels,
    );
    let _ = writeln!(
        out,
        "# HELP {CACHE_CONFIG_INFO} Information of the LLMEngine CacheConfig\n# TYPE {CACHE_CONFIG_INFO} gauge\n\
         {CACHE_CONFIG_INFO}{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",{labels},num_gpu_blocks=\"{}\"}} 1.0",
        e.block_size,
        if s.prefix_caching { "True" } else { "False" },
        e.num_blocks
    );
    counter(
        &mut out,
        SIM_BUSY_SECONDS,
        "Simulated GPU busy time: sum of step durations, in seconds.",
        &labels,
        e.busy_seconds_total,
    );
    counter(
        &mut out,
        SIM_STEPS,
        "Engine steps that computed at least one token.",
        &labels,
        e.steps_total,
    );
    counter(
        &mut out,
        SIM_RECOMPUTED_TOKENS,
        "Tokens prefilled again after a preemption.",
        &labels,
        e.recomputed_tokens_total,
    );
    gauge(
        &mut out,
        SIM_SPEED_FACTOR,
        "Speed factor of the simulated GPU (1 = calibrated card).",
        &labels,
        s.speed,
    );
    gauge(
        &mut out,
        SIM_KV_CAPACITY_TOKENS,
        "KV cache capacity in tokens (num_gpu_blocks * block_size).",
        &labels,
        u64::from(e.num_blocks) * u64::from(e.block_size),
    );
    out.push_str(&metronome_runtime::build_info::exposition());
    out
}

#[cfg(test)]
mod tests {
    use metronome_protocol::prometheus;

    use super::*;

    #[test]
    fn renders_vllm_names_with_model_label() {
        let mut requests = RequestMetrics::default();
        requests.ttft.observe(0.03);
        let text = render(&Snapshot {
            model: "llama-3.1-8b",
            speed: 1.0,
            prefix_caching: true,
            engine: EngineStats {
                running: 3,
                waiting: 2,
                used_blocks: 25,
                num_blocks: 100,
                block_size: 16,
                preemptions_total: 4,
                prefix_cache_queries_total: 100,
                prefix_cache_hits_total: 64,
                ..EngineStats::default()
            },
            requests: &requests,
        });
        assert!(
            text.contains(&format!(
                "metronome_build_info{{version=\"{}\",commit=\"{}\"}} 1",
                metronome_runtime::build_info::VERSION,
                metronome_runtime::build_info::git_commit()
            )),
            "{text}"
        );
        let m = [("model_name", "llama-3.1-8b")];
        assert_eq!(
            prometheus::value(&text, "vllm:num_requests_running", &m),
            Some(3.0)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:num_requests_waiting", &m),
            Some(2.0)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:kv_cache_usage_perc", &m),
            Some(0.25)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:gpu_cache_usage_perc", &m),
            Some(0.25)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:num_preemptions_total", &m),
            Some(4.0)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:prefix_cache_queries_total", &m),
            Some(100.0)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:prefix_cache_hits_total", &m),
            Some(64.0)
        );
        assert_eq!(
            prometheus::value(
                &text,
                "vllm:cache_config_info",
                &[("num_gpu_blocks", "100"), ("block_size", "16")]
            ),
            Some(1.0)
        );
        assert_eq!(
            prometheus::value(
                &text,
                "vllm:time_to_first_token_seconds_bucket",
                &[("le", "0.04")]
            ),
            Some(1.0)
        );
        assert_eq!(
            prometheus::value(
                &text,
                "vllm:time_to_first_token_seconds_bucket",
                &[("le", "0.02")]
            ),
            Some(0.0)
        );
        assert_eq!(
            prometheus::value(&text, "vllm:time_to_first_token_seconds_count", &m),
            Some(1.0)
        );
    }
}
