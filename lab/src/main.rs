//! `metronome-lab`: goodput-versus-load points of dispatch policies in simulated time.
//!
//! The same workloads, clusters and load points as `metronome-bench` (loads are shares of
//! the same nominal capacity), each run on the real dispatcher engine in simulated time
//! (see the crate docs). A point takes well under a second, so a design change can be
//! judged on many seeds before the real system measures it.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use metronome_dispatcher::Config as DispatcherConfig;
use metronome_gpu_sim::SimGpuConfig;
use metronome_lab::{run, LabConfig, LabRun, Latencies};
use metronome_loadgen::bench::scenarios::{cluster_speeds, nominal_for, BenchPlan, MODEL};
use metronome_loadgen::{meets_slo, plan_requests, summarize, Slo, Workload};
use metronome_scheduler::policy::PolicyKind;

#[derive(Parser, Debug)]
#[command(
    name = "metronome-lab",
    about = "Goodput of dispatch policies in simulated time: the real dispatcher engine, agent fitting and simulated GPUs",
    long_about = "Runs the bench's workloads, clusters and load points on the real dispatcher engine, \
worker-agent fitting and the GPU simulator's engine in simulated time, and prints one line per \
point: SLO attainment, goodput, TTFT, tok/s, idle GPU time while jobs waited, what held the \
queue and the prediction error. A design tool: published figures come from metronome-bench."
)]
struct Args {
    /// Policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "metronome,least_connections"
    )]
    policies: Vec<String>,
    /// Workloads: `trace` (the shared trace), `chat` (Poisson chat mix).
    #[arg(long, value_delimiter = ',', default_value = "chat,trace")]
    workloads: Vec<String>,
    /// Clusters: `equal` (1,1,1,1), `mixed` (1,1,1,0.5), or speeds such as `1,0.7,0.7`.
    #[arg(long, value_delimiter = ';', default_value = "equal;mixed")]
    clusters: Vec<String>,
    /// Offered loads as shares of nominal capacity.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.3,0.5,0.7,0.9,1.1,1.3,1.5"
    )]
    loads: Vec<f64>,
    /// Requests per point.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Seeds of the chat workload (one run per seed); for the trace, each seed after the
    /// first moves the trace window on by `--requests` requests' worth of time.
    #[arg(long, value_delimiter = ',', default_value = "7")]
    seeds: Vec<u64>,
    /// Chat prompt lengths (`fixed:N`, `uniform:A,B`, `lognormal:mean=M,sigma=S[,max=X]`).
    #[arg(long)]
    chat_prompt: Option<String>,
    /// Chat output lengths.
    #[arg(long)]
    chat_output: Option<String>,
    /// The trace file (default: ../shared/traces/azure_llm_2023_code.csv from the repo).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Dispatcher TOML appended to the defaults (experiments only).
    #[arg(long)]
    dispatcher_toml: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let repo = std::env::current_dir()?;
    let mut plan = BenchPlan::new(false, repo);
    plan.requests = args.requests;
    if let Some(t) = &args.trace {
        plan.trace = t.clone();
    }
    if let Some(d) = &args.chat_prompt {
        plan.chat_prompt = d
            .parse()
            .map_err(|e| anyhow::anyhow!("--chat-prompt: {e}"))?;
    }
    if let Some(d) = &args.chat_output {
        plan.chat_output = d
            .parse()
            .map_err(|e| anyhow::anyhow!("--chat-output: {e}"))?;
    }
    let mut dispatcher = match &args.dispatcher_toml {
        Some(t) => DispatcherConfig::from_toml(t, "--dispatcher-toml")
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        None => DispatcherConfig::default(),
    };
    let slo = Slo::default();
    println!(
        "{:<7} {:<6} {:>5} {:<18} {:>4} {:>7} {:>7} {:>7} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9}  holds",
        "cluster", "load", "seed", "policy", "n", "attain", "goodput", "ttft50", "ttft99", "tps_p1", "out_tps", "idle%", "errTTFT50", "errDec50"
    );
    let mut totals: Vec<(String, f64, usize)> = Vec::new();
    for cluster in &args.clusters {
        let speeds = match cluster_speeds(cluster) {
            Some(s) => s,
            None => cluster
                .split(',')
                .map(|s| s.trim().parse::<f64>())
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("cluster {cluster:?}: a name or speeds"))?,
        };
        for workload in &args.workloads {
            let nominal = nominal_for(&plan, workload, &speeds)?;
            for &load in &args.loads {
                let rate = load * nominal.capacity_rps;
                for (k, &seed) in args.seeds.iter().enumerate() {
                    let mut spec = plan.spec(workload, "http://127.0.0.1/v1".into(), rate);
                    spec.seed = seed;
                    if let Workload::Trace { start_offset_s, .. } = &mut spec.workload {
                        *start_offset_s = k as f64 * plan.requests as f64 / rate;
                    }
                    let requests = plan_requests(&spec)
                        .with_context(|| format!("planning {workload} at {rate} req/s"))?;
                    for policy in &args.policies {
                        let kind: PolicyKind = policy
                            .parse()
                            .map_err(|e| anyhow::anyhow!("policy {policy:?}: {e}"))?;
                        dispatcher.policy = kind;
                        let config = LabConfig {
                            dispatcher: dispatcher.clone(),
                            agent: metronome_worker_agent::Config::default(),
                            gpus: speeds
                                .iter()
                                .map(|&speed| SimGpuConfig {
                                    speed,
                                    ..SimGpuConfig::new(MODEL)
                                })
                                .collect(),
                            latencies: Latencies::default(),
                            sample_ms: 100.0,
                            warmup_ms: 3_000.0,
                        };
                        let out = run(&config, &requests);
                        let line = point_line(cluster, workload, load, seed, policy, &out, slo);
                        println!("{line}");
                        let good = out.records.iter().filter(|r| meets_slo(r, &slo)).count();
                        match totals.iter_mut().find(|(p, _, _)| p == policy) {
                            Some(t) => {
                                t.1 += good as f64;
                                t.2 += out.records.len();
                            }
                            None => totals.push((policy.clone(), good as f64, out.records.len())),
                        }
                    }
                }
            }
        }
    }
    if totals.is_empty() {
        bail!("nothing to run");
    }
    for (policy, good, n) in totals {
        println!(
            "overall {policy}: {:.1} % of {n} requests met the SLO",
            100.0 * good / n as f64
        );
    }
    Ok(())
}

fn point_line(
    cluster: &str,
    workload: &str,
    load: f64,
    seed: u64,
    policy: &str,
    out: &LabRun,
    slo: Slo,
) -> String {
    let s = summarize(&out.records, slo);
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let errors = prediction_errors(out);
    let holds: Vec<String> = out.holds.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "{:<7} {:<6} {:>5} {:<18} {:>4} {:>6.1}% {:>7.2} {:>7} {:>8} {:>6.1} {:>7.0} {:>5.2}% {:>9} {:>9}  {}",
        cluster,
        format!("{workload}{:.0}", load * 100.0),
        seed,
        policy,
        s.count,
        100.0 * s.goodput_share,
        s.goodput_rps,
        ms(s.ttft_ms.p50),
        ms(s.ttft_ms.p99),
        s.tokens_per_s.p1.unwrap_or(0.0),
        s.output_tokens_per_s,
        100.0 * out.idle_ms / out.sampled_ms.max(1.0),
        errors.0.map_or("-".into(), |e| format!("{:.1}%", e * 100.0)),
        errors.1.map_or("-".into(), |e| format!("{:.1}%", e * 100.0)),
        holds.join(" ")
    )
}

/// p50 of |predicted − actual| / actual for TTFT (queue wait included) and decode rate.
fn prediction_errors(out: &LabRun) -> (Option<f64>, Option<f64>) {
    let mut ttft = Vec::new();
    let mut decode = Vec::new();
    for (r, p) in out.records.iter().zip(&out.predicted) {
        let (Some(p), true) = (p, r.ok) else {
            continue;
        };
        if let Some(actual) = r.ttft_ms.filter(|a| *a > 0.0) {
            ttft.push((p.queue_wait_ms + p.prediction.ttft_ms - actual).abs() / actual);
        }
        if let Some(actual) = r.tokens_per_s.filter(|a| *a > 0.0) {
            decode.push((p.prediction.decode_tok_s - actual).abs() / actual);
        }
    }
    (median(&mut ttft), median(&mut decode))
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[(v.len() - 1) / 2])
}
