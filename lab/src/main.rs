//! `metronome-lab`: goodput-versus-load points of dispatch policies in simulated time.
//!
//! The same workloads, clusters and load points as `metronome-bench` (loads are shares of
//! the same nominal capacity), each run on the real dispatcher engine in simulated time
//! (see the crate docs). A point takes well under a second, so a design change can be
//! judged on many seeds before the real system measures it.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use metronome_bench::curve::{capacity_at_slo, CurvePoint, ATTAINMENT_TARGET};
use metronome_bench::fairness::FairnessPlan;
use metronome_bench::scenarios::{cluster_speeds, nominal_for, BenchPlan, MODEL};
use metronome_dispatcher::Config as DispatcherConfig;
use metronome_gpu_sim::SimGpuConfig;
use metronome_lab::fairness::{run_fairness, TenantFigures};
use metronome_lab::{Cluster, LabConfig, LabRun, Latencies, MaxTokens};
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
    /// Workloads: `trace` (the shared trace), `chat` (Poisson chat mix), and the
    /// prefix-heavy `shared_prefix`, `multi_turn` and `agent` (metronome-bench's; their
    /// requests carry prefix fingerprints, the GPUs' prefix caches prefill only what they
    /// do not hold, and each point's line ends with its prefix-cache hit rate and TTFT p90).
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
    /// Write each point's per-request CSV under this folder
    /// (`<cluster>/<workload>/<policy>/<load %>-<seed>.csv`; with `--fairness`,
    /// `fairness/<cluster>/<phase>-<seed>.csv`), and beside it `…-predicted.csv`: per
    /// request, its assignment's prediction against what it got, the worker, the cached
    /// prompt tokens the decision counted there, the most any candidate held, and prefix
    /// affinity's verdict (`chosen` or `overridden:<code>`, `@worker:tokens`, its reason in
    /// words).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// How jobs set max_tokens: `exact` (the output length, as the load generator does),
    /// `scaled:F` (F times the output length) or `fixed:N` (N for every job).
    #[arg(long, default_value = "exact")]
    max_tokens: String,
    /// Print only the summary (attainment per load, capacity at SLO), not every point.
    #[arg(long)]
    summary_only: bool,
    /// Run the fairness drill instead (`metronome-bench --fairness`'s tenants, rates and
    /// arrivals; the first cluster; `--seeds` seed the arrivals, 11 is the drill's own):
    /// B's TTFT alone and beside A's flood.
    #[arg(long)]
    fairness: bool,
    /// The agents report their GPUs' prefix caches to the dispatcher (the KV events an
    /// agent with `kv_events_endpoint` forwards); without it the dispatcher estimates each
    /// cache from its own placements. Prefix-heavy workloads' lines then show how far the
    /// cached tokens each decision counted on were from what the GPU found.
    #[arg(long)]
    kv_events: bool,
}

/// One measured point.
struct Point {
    cluster: String,
    workload: String,
    load: f64,
    rate: f64,
    policy: String,
    good: usize,
    count: usize,
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
    let max_tokens = match args.max_tokens.split_once(':') {
        None if args.max_tokens == "exact" => MaxTokens::Exact,
        Some(("scaled", f)) => MaxTokens::Scaled(f.parse().context("--max-tokens scaled:F")?),
        Some(("fixed", n)) => MaxTokens::Fixed(n.parse().context("--max-tokens fixed:N")?),
        _ => bail!("--max-tokens: exact, scaled:F or fixed:N"),
    };
    if args.fairness {
        return fairness(&args, &plan, dispatcher, max_tokens);
    }
    let slo = Slo::default();
    let mut points: Vec<Point> = Vec::new();
    if !args.summary_only {
        println!(
        "{:<7} {:<6} {:>5} {:<18} {:>4} {:>7} {:>7} {:>7} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9}  holds",
        "cluster", "load", "seed", "policy", "n", "attain", "goodput", "ttft50", "ttft99", "tps_p1", "out_tps", "idle%", "errTTFT50", "errDec50"
        );
    }
    // As metronome-bench does: per cluster and policy one system, every workload at every
    // load in turn; each seed is a run of its own.
    for (k, &seed) in args.seeds.iter().enumerate() {
        for cluster in &args.clusters {
            let speeds = speeds_of(cluster)?;
            for policy in &args.policies {
                let kind: PolicyKind = policy
                    .parse()
                    .map_err(|e| anyhow::anyhow!("policy {policy:?}: {e}"))?;
                dispatcher.policy = kind;
                let mut config = lab_config(dispatcher.clone(), &speeds, max_tokens);
                config.cache_reports = args.kv_events;
                let mut system = Cluster::new(&config);
                for workload in &args.workloads {
                    let nominal = nominal_for(&plan, workload, &speeds)?;
                    for &load in &args.loads {
                        let rate = load * nominal.capacity_rps;
                        let mut spec = plan.spec(workload, "http://127.0.0.1/v1".into(), rate);
                        spec.seed = seed;
                        if let Workload::Trace { start_offset_s, .. } = &mut spec.workload {
                            *start_offset_s = k as f64 * plan.requests as f64 / rate;
                        }
                        let requests = plan_requests(&spec)
                            .with_context(|| format!("planning {workload} at {rate} req/s"))?;
                        let out = system.run(&requests);
                        if let Some(dir) = &args.csv {
                            let dir = dir
                                .join(cluster.replace([',', ' '], "_"))
                                .join(workload)
                                .join(policy);
                            std::fs::create_dir_all(&dir)?;
                            let file = dir.join(format!("{:.0}-{seed}.csv", load * 100.0));
                            metronome_loadgen::record::write_csv(&file, &out.records)
                                .map_err(|e| anyhow::anyhow!("{e}"))?;
                            let file =
                                dir.join(format!("{:.0}-{seed}-predicted.csv", load * 100.0));
                            std::fs::write(&file, predictions_csv(&out))?;
                        }
                        if !args.summary_only {
                            println!(
                                "{}",
                                point_line(cluster, workload, load, seed, policy, &out, slo)
                            );
                        }
                        points.push(Point {
                            cluster: cluster.clone(),
                            workload: workload.clone(),
                            load,
                            rate,
                            policy: policy.clone(),
                            good: out.records.iter().filter(|r| meets_slo(r, &slo)).count(),
                            count: out.records.len(),
                        });
                    }
                }
            }
        }
    }
    if points.is_empty() {
        bail!("nothing to run");
    }
    print_summary(&points, &args.policies, &args.loads);
    Ok(())
}

/// The fairness drill on the first cluster, once per seed.
fn fairness(
    args: &Args,
    plan: &BenchPlan,
    dispatcher: DispatcherConfig,
    max_tokens: MaxTokens,
) -> anyhow::Result<()> {
    let cluster = args.clusters.first().context("no cluster")?;
    let speeds = speeds_of(cluster)?;
    let drill = FairnessPlan::new(plan.repo.clone());
    let nominal = nominal_for(plan, "chat", &speeds)?;
    let config = lab_config(dispatcher, &speeds, max_tokens);
    println!(
        "{:<6} {:<14} {:>5} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "seed", "phase/tenant", "sent", "ok", "ttft50", "ttft99", "wait50", "wait99", "out_tps"
    );
    for &seed in &args.seeds {
        let run = run_fairness(&config, &drill, nominal.capacity_rps, seed);
        let line = |name: &str, f: &TenantFigures| {
            println!(
                "{:<6} {:<14} {:>5} {:>5} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0}",
                seed,
                name,
                f.sent,
                f.ok,
                f.ttft_p50_ms,
                f.ttft_p99_ms,
                f.wait_p50_ms,
                f.wait_p99_ms,
                f.output_tok_s
            )
        };
        if let Some(dir) = &args.csv {
            let dir = dir.join("fairness").join(cluster.replace([',', ' '], "_"));
            std::fs::create_dir_all(&dir)?;
            for (phase, out) in [("alone", &run.alone_run), ("flood", &run.flood_run)] {
                metronome_loadgen::record::write_csv(
                    &dir.join(format!("{phase}-{seed}.csv")),
                    &out.records,
                )
                .map_err(|e| anyhow::anyhow!("{e}"))?;
                std::fs::write(
                    dir.join(format!("{phase}-{seed}-predicted.csv")),
                    predictions_csv(out),
                )?;
            }
        }
        line("alone/steady", &run.alone);
        line("flood/steady", &run.steady);
        line("flood/flood", &run.flood);
        println!(
            "{:<6} B's TTFT p99 beside the flood: {:.2}x alone (target <= 1.5); idle while a job waited {:.2} %",
            seed,
            run.p99_ratio(),
            100.0 * run.flood_idle_share
        );
    }
    Ok(())
}

fn speeds_of(cluster: &str) -> anyhow::Result<Vec<f64>> {
    match cluster_speeds(cluster) {
        Some(s) => Ok(s),
        None => cluster
            .split(',')
            .map(|s| s.trim().parse::<f64>())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("cluster {cluster:?}: a name or speeds")),
    }
}

fn lab_config(dispatcher: DispatcherConfig, speeds: &[f64], max_tokens: MaxTokens) -> LabConfig {
    LabConfig {
        dispatcher,
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
        max_tokens,
        tenants: Vec::new(),
        queue_timeout_ms: None,
        cache_reports: false,
    }
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
    let mut holds: Vec<String> = out.holds.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let charged: f64 = out.stalls.iter().map(|c| c.charged_ms).sum();
    let actual: f64 = out.stalls.iter().map(|c| c.actual_ms).sum();
    if actual > 0.0 {
        holds.push(format!("stall charged/actual {:.2}", charged / actual));
    }
    if let Some(cache) = out.prefix_cache {
        holds.push(format!(
            "prefix-hits {} ttft90 {}",
            cache
                .hit_rate()
                .map_or("-".to_string(), |h| format!("{:.1}%", h * 100.0)),
            ms(s.ttft_ms.p90)
        ));
        // How far the cached tokens each decision counted on were from the GPU's hits.
        if let Some(e) = metronome_lab::cached_errors(&out.cached) {
            holds.push(format!(
                "cached-err({}) p50 {} tok ({:.1}%) p90 {} tok ({:.1}%) exact {:.0}% under {:.0}% over {:.0}% n={}",
                e.source,
                e.p50_tokens,
                e.p50_share * 100.0,
                e.p90_tokens,
                e.p90_share * 100.0,
                e.exact * 100.0,
                e.under * 100.0,
                e.over * 100.0,
                e.jobs
            ));
        }
    }
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

/// Per request: what its assignment predicted beside what the client measured.
fn predictions_csv(out: &LabRun) -> String {
    let mut csv = String::from(
        "id,prompt_tokens,max_tokens,queue_wait_ms,predicted_ttft_ms,ttft_ms,predicted_tok_s,step_tok_s,tokens_per_s,streams_after,worker,cached_tokens,most_cached_tokens,affinity\n",
    );
    let num = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    for (r, p) in out.records.iter().zip(&out.predicted) {
        let Some(p) = p else {
            continue;
        };
        csv.push_str(&format!(
            "{},{},{},{:.1},{:.1},{},{:.3},{},{},{},{},{},{},{}\n",
            r.id,
            r.prompt_tokens,
            r.max_tokens,
            p.queue_wait_ms,
            p.prediction.ttft_ms,
            num(r.ttft_ms),
            p.prediction.decode_tok_s,
            num(p.prediction.step_tok_s),
            num(r.tokens_per_s),
            p.prediction.streams_after,
            p.worker_id,
            p.cached_tokens,
            p.most_cached_tokens,
            p.affinity
        ));
    }
    csv
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

/// Per cluster and workload: each policy's attainment at each load (pooled over seeds)
/// and its capacity at SLO, with the ratio to least connections'.
fn print_summary(points: &[Point], policies: &[String], loads: &[f64]) {
    let mut keys: Vec<(String, String)> = Vec::new();
    for p in points {
        let k = (p.cluster.clone(), p.workload.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    println!();
    let header: Vec<String> = loads
        .iter()
        .map(|l| format!("{:>7.0}%", l * 100.0))
        .collect();
    println!(
        "{:<20} {:<18}{}  capacity@SLO (x LC)",
        "cluster/workload",
        "policy",
        header.join("")
    );
    for (cluster, workload) in keys {
        let mut lc_capacity = None;
        let mut rows = Vec::new();
        for policy in policies {
            let mut cells = Vec::new();
            let mut curve = Vec::new();
            for &load in loads {
                let (good, count, rate) = points
                    .iter()
                    .filter(|p| {
                        p.cluster == cluster
                            && p.workload == workload
                            && p.policy == *policy
                            && p.load == load
                    })
                    .fold((0, 0, 0.0), |(g, c, _), p| {
                        (g + p.good, c + p.count, p.rate)
                    });
                if count == 0 {
                    cells.push(format!("{:>8}", "-"));
                    continue;
                }
                let attainment = good as f64 / count as f64;
                cells.push(format!("{:>7.1}%", attainment * 100.0));
                curve.push(CurvePoint {
                    rate_rps: rate,
                    attainment,
                });
            }
            let capacity = capacity_at_slo(&curve, ATTAINMENT_TARGET);
            if policy == "least_connections" {
                lc_capacity = capacity;
            }
            rows.push((policy.clone(), cells, capacity));
        }
        for (policy, cells, capacity) in rows {
            // Either capacity may be only a bound, so the ratio may be one too (`> 1.29x`).
            let ratio = match (capacity, lc_capacity) {
                _ if policy == "least_connections" => String::new(),
                (Some(c), Some(lc)) => match c.ratio_to(lc).display().as_str() {
                    "–" => " (–)".into(),
                    r => format!(" ({r}x)"),
                },
                _ => String::new(),
            };
            println!(
                "{:<20} {:<18}{}  {}{}",
                format!("{cluster}/{workload}"),
                policy,
                cells.join(""),
                capacity.map_or("-".into(), |c| c.display()),
                ratio
            );
        }
    }
}
