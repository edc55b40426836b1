//! The scenario runner behind `metronome-bench`: goodput-versus-offered-load curves per
//! policy, workload and cluster, the burst case, and the overhead runs against a zero-delay
//! simulator.
//!
//! Method: for each workload (the trace's first N requests; a chat-like Poisson mix) and
//! cluster (4 equal GPUs; 4 mixed), the offered loads are fixed multiples of the cluster's
//! **nominal capacity** ([`super::nominal`]), computed from the simulator's calibration and
//! the planned requests alone, so every policy is offered the same absolute rates and no
//! policy's behaviour sets the load levels. Each point records SLO attainment, goodput,
//! throughput, TTFT and tok/s figures, idle GPU-seconds while jobs waited
//! ([`super::idle`], sampled every ~100 ms) and, for Metronome, the prediction error of
//! its decisions ([`super::prediction`]).
//!
//! Fairness invariants: every policy runs on a fresh system per cluster with the same GPUs,
//! speeds, model-server settings and `./dev up` defaults (no dispatcher TOML appended; the
//! worker cap only when `--worker-max-concurrency` asks, and then the report says so); at
//! a given point every policy replays exactly the same planned requests (same trace window,
//! same Poisson seed); only `--policy` differs. Runs are separated by waiting until every
//! simulated GPU is idle, so one run's backlog never leaks into the next.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::capacity::{completion_rate, keeps_up, CapacitySearch, KeepUp};
use super::curve::goodput_rate;
use super::idle::{idle_stats, samples_csv, IdleStats};
use super::nominal::{nominal_capacity, CostModel, Nominal};
use super::prediction::{predicted, predictions_csv, Predicted, PredictedJob, PredictionErrors};
use super::report::{
    cluster_title, sections, workload_title, BurstRow, NominalRow, OverheadRow, PlotRef, RampStep,
    Report, RunDefaults, RunRow, METRONOME,
};
use metronome_loadgen::plots::{goodput_curves, CurveSeries};
use metronome_loadgen::system::{rss_kib, ClusterSample, System, SystemSpec, EXTRA_TOML_ENV};
use metronome_loadgen::{
    plan_requests, run_load, run_plan, write_outputs, LengthDist, LoadSpec, PlannedRequest,
    RequestRecord, RunResult, Slo, Summary, Workload,
};

/// Policies compared, Metronome first, then the conventional balancers, then the
/// prefix-affinity router (`prefix_affinity`, see `metronome_scheduler::policy`).
pub const POLICIES: [&str; 6] = [
    "metronome",
    "least_connections",
    "round_robin",
    "random",
    "power_of_two",
    "prefix_affinity",
];

/// Workloads: the shared trace, a chat-like Poisson mix, and the prefix-heavy ones: shared
/// system prompts, multi-turn conversations and an agent loop ([`metronome_loadgen::prefixes`]).
pub const WORKLOADS: [&str; 5] = ["trace", "chat", "shared_prefix", "multi_turn", "agent"];

/// The prefix-heavy workloads among [`WORKLOADS`]: their figures include the simulated
/// GPUs' prefix-cache hit rate.
pub const PREFIX_WORKLOADS: [&str; 3] = ["shared_prefix", "multi_turn", "agent"];

/// Folder under the results whose `section.md` (the prefix-heavy workloads' figures, kept
/// by hand from their runs' commands) the report includes, before the fairness section.
pub const PREFIX_SECTION_DIR: &str = "prefix";

/// Seed of the prefix-heavy workloads.
pub const PREFIX_SEED: u64 = 7;

/// `shared_prefix`: 16 groups × 20 users, a 2,000-token system prompt per group (32,000
/// tokens of prefixes: most of one GPU's 40,000-token cache, an eighth of the cluster's),
/// a short question of its own, replies like the chat workload's.
pub fn shared_prefix_workload(rate_rps: f64) -> Workload {
    Workload::SharedPrefix {
        rate_rps,
        groups: 16,
        users_per_group: 20,
        prefix_tokens: 2000,
        question_tokens: LengthDist::LogNormal {
            mean: 100.0,
            sigma: 0.6,
            max: 1000,
        },
        output_tokens: LengthDist::LogNormal {
            mean: 200.0,
            sigma: 0.6,
            max: 1500,
        },
    }
}

/// `multi_turn`: conversations of 2-8 turns behind a shared 500-token system prompt, user
/// messages of ~150 tokens, replies of ~200, 3 s mean think time (short, so that a
/// conversation of ~50 s fits a run of a few hundred requests several times over).
pub fn multi_turn_workload(rate_rps: f64) -> Workload {
    Workload::MultiTurn {
        rate_rps,
        turns: LengthDist::Uniform { lo: 2, hi: 8 },
        system_tokens: 500,
        user_tokens: LengthDist::LogNormal {
            mean: 150.0,
            sigma: 0.6,
            max: 1500,
        },
        output_tokens: LengthDist::LogNormal {
            mean: 200.0,
            sigma: 0.6,
            max: 1500,
        },
        think_s: 3.0,
    }
}

/// `agent`: loops of 4-12 steps behind a 1,500-token system prompt of tool definitions;
/// each step a tool result of ~400 tokens and a short tool call of ~60, 0.5 s between a
/// call and its result.
pub fn agent_workload(rate_rps: f64) -> Workload {
    Workload::MultiTurn {
        rate_rps,
        turns: LengthDist::Uniform { lo: 4, hi: 12 },
        system_tokens: 1500,
        user_tokens: LengthDist::LogNormal {
            mean: 400.0,
            sigma: 0.8,
            max: 4000,
        },
        output_tokens: LengthDist::LogNormal {
            mean: 60.0,
            sigma: 0.5,
            max: 500,
        },
        think_s: 0.5,
    }
}

/// Clusters: 4 equal GPUs and 4 of mixed speed.
pub const CLUSTERS: [&str; 2] = ["equal", "mixed"];

/// Speed factors of a named cluster.
pub fn cluster_speeds(name: &str) -> Option<Vec<f64>> {
    match name {
        "equal" => Some(vec![1.0, 1.0, 1.0, 1.0]),
        "mixed" => Some(vec![1.0, 1.0, 1.0, 0.5]),
        _ => None,
    }
}

/// Default offered loads, as shares of nominal capacity: light load to clear overload.
pub const LOADS: [f64; 7] = [0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5];

/// Model name every simulated GPU serves.
pub const MODEL: &str = "bench-model";

/// Seed of the chat workload (arrivals and lengths).
pub const CHAT_SEED: u64 = 7;

/// Speed factor that makes every simulated step round to zero duration (zero-delay mode):
/// the largest step (a full prefill budget over a full cache, ≈ 340 ms) divided by it is far
/// below a nanosecond.
pub const ZERO_DELAY_SPEED: &str = "1e15";

/// Period of the idle-check samples.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// Everything a benchmark run is parameterised by.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub quick: bool,
    pub repo: PathBuf,
    pub out: PathBuf,
    pub report_path: PathBuf,
    pub trace: PathBuf,
    pub policies: Vec<String>,
    pub workloads: Vec<String>,
    pub clusters: Vec<String>,
    /// Offered loads as shares of nominal capacity.
    pub loads: Vec<f64>,
    /// Requests per load point.
    pub requests: usize,
    pub chat_prompt: LengthDist,
    pub chat_output: LengthDist,
    /// `WORKER_MAX_CONCURRENCY` override (experiments; `None` = `./dev up`'s default).
    pub worker_max_concurrency: Option<u32>,
    pub burst_rounds: usize,
    pub overhead_rates: Vec<f64>,
    pub overhead_run_s: f64,
    pub overhead_ramp_s: f64,
    pub dispatch_jobs: usize,
    pub skip_overhead: bool,
    pub analysis: Option<PathBuf>,
    pub command: String,
}

impl BenchPlan {
    /// The quick (`--quick`) or full scale.
    pub fn new(quick: bool, repo: PathBuf) -> BenchPlan {
        BenchPlan {
            quick,
            out: repo.join("bench-results"),
            report_path: repo.join("BENCHMARKS.md"),
            trace: repo.join("../shared/traces/azure_llm_2023_code.csv"),
            repo,
            policies: POLICIES.iter().map(|s| s.to_string()).collect(),
            workloads: WORKLOADS.iter().map(|s| s.to_string()).collect(),
            clusters: CLUSTERS.iter().map(|s| s.to_string()).collect(),
            loads: LOADS.to_vec(),
            requests: if quick { 60 } else { 300 },
            chat_prompt: LengthDist::LogNormal {
                mean: 1000.0,
                sigma: 0.6,
                max: 8000,
            },
            chat_output: LengthDist::LogNormal {
                mean: 200.0,
                sigma: 0.6,
                max: 1500,
            },
            worker_max_concurrency: None,
            burst_rounds: if quick { 20 } else { 50 },
            overhead_rates: vec![100.0, 500.0],
            overhead_run_s: if quick { 4.0 } else { 15.0 },
            overhead_ramp_s: if quick { 3.0 } else { 10.0 },
            dispatch_jobs: if quick { 10_000 } else { 50_000 },
            skip_overhead: false,
            analysis: None,
            command: String::new(),
        }
    }

    /// The load spec of one workload at one mean rate.
    pub fn spec(&self, workload: &str, base_url: String, rate: f64) -> LoadSpec {
        let base = base_spec(base_url);
        match workload {
            "trace" => LoadSpec {
                workload: Workload::Trace {
                    path: self.trace.clone(),
                    time_scale: None,
                    rate_rps: Some(rate),
                    start_offset_s: 0.0,
                },
                limit: Some(self.requests),
                ..base
            },
            "shared_prefix" | "multi_turn" | "agent" => LoadSpec {
                workload: match workload {
                    "shared_prefix" => shared_prefix_workload(rate),
                    "multi_turn" => multi_turn_workload(rate),
                    _ => agent_workload(rate),
                },
                limit: Some(self.requests),
                seed: PREFIX_SEED,
                ..base
            },
            _ => LoadSpec {
                workload: Workload::Poisson {
                    rate_rps: rate,
                    prompt_tokens: self.chat_prompt,
                    output_tokens: self.chat_output,
                },
                limit: Some(self.requests),
                seed: CHAT_SEED,
                ..base
            },
        }
    }
}

/// Nominal capacity of a workload on a cluster: the planned requests' lengths do not depend
/// on the rate (the trace window is fixed; Poisson lengths have their own random streams).
pub fn nominal_for(plan: &BenchPlan, workload: &str, speeds: &[f64]) -> anyhow::Result<Nominal> {
    let requests = plan_requests(&plan.spec(workload, "http://127.0.0.1/v1".into(), 1.0))
        .with_context(|| format!("planning the {workload} workload"))?;
    nominal_capacity(
        &CostModel::simulator_defaults(),
        &requests,
        speeds,
        Slo::default().tok_s,
    )
    .with_context(|| format!("the {workload} workload has no requests"))
}

fn progress(start: Instant, msg: impl AsRef<str>) {
    eprintln!(
        "[bench {:>6.0}s] {}",
        start.elapsed().as_secs_f64(),
        msg.as_ref()
    );
}

fn base_spec(base_url: String) -> LoadSpec {
    LoadSpec {
        base_url,
        model: MODEL.into(),
        max_in_flight: 2048,
        request_timeout_s: 180.0,
        drain_timeout_s: 120.0,
        progress_interval_s: 10.0,
        ..LoadSpec::default()
    }
}

/// Peak RSS per process, sampled every 250 ms until the returned token is cancelled.
fn sample_rss(pids: Vec<(String, u32)>) -> (CancellationToken, Arc<Mutex<BTreeMap<String, u64>>>) {
    let stop = CancellationToken::new();
    let peaks = Arc::new(Mutex::new(BTreeMap::new()));
    let (s, p) = (stop.clone(), peaks.clone());
    tokio::spawn(async move {
        loop {
            for (name, pid) in &pids {
                if let Some(kib) = rss_kib(*pid) {
                    let mut m = p.lock().unwrap_or_else(|e| e.into_inner());
                    let e = m.entry(name.clone()).or_insert(0);
                    *e = (*e).max(kib);
                }
            }
            tokio::select! {
                () = s.cancelled() => break,
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    });
    (stop, peaks)
}

fn peaks_vec(p: &Arc<Mutex<BTreeMap<String, u64>>>) -> Vec<(String, u64)> {
    p.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// What one measured load point produced.
struct Measured {
    result: RunResult,
    preemptions: f64,
    /// The simulated GPUs' prefix-cache hits over queries (tokens) during the run.
    prefix_hit_rate: Option<f64>,
    idle: IdleStats,
    /// Refusals of queued jobs during the run, per reason (see
    /// [`System::dispatcher_holds`]).
    holds: BTreeMap<String, f64>,
}

/// Runs one load spec on a system: waits for idle GPUs, samples the cluster every ~100 ms
/// while it runs (idle check), scrapes preemptions around it, writes the outputs.
async fn measured_run(sys: &System, spec: LoadSpec, dir: &Path) -> anyhow::Result<Measured> {
    sys.wait_idle(Duration::from_secs(600)).await?;
    let before = sys.sim_metric_sum("vllm:num_preemptions_total").await?;
    let prefix_before = prefix_counters(sys).await?;
    let holds_before = sys.dispatcher_holds().await;
    let stop = CancellationToken::new();
    let sampler = sys.sample_until(&stop, Instant::now(), SAMPLE_INTERVAL, None);
    let run = async {
        let r = run_load(spec, true).await;
        stop.cancel();
        r
    };
    let (samples, result) = tokio::join!(sampler, run);
    let result = result?;
    sys.wait_idle(Duration::from_secs(600)).await.ok();
    let after = sys.sim_metric_sum("vllm:num_preemptions_total").await?;
    let prefix_after = prefix_counters(sys).await?;
    let queries = prefix_after.0 - prefix_before.0;
    let prefix_hit_rate = (queries > 0.0).then(|| (prefix_after.1 - prefix_before.1) / queries);
    let mut holds = sys.dispatcher_holds().await;
    for (reason, n) in &holds_before {
        if let Some(h) = holds.get_mut(reason) {
            *h -= n;
        }
    }
    holds.retain(|_, n| *n > 0.0);
    write_outputs(dir, &result).with_context(|| format!("writing {}", dir.display()))?;
    write_samples(dir, &samples)?;
    write_agent_metrics(dir, sys).await?;
    Ok(Measured {
        result,
        preemptions: after - before,
        prefix_hit_rate,
        idle: idle_stats(&samples),
        holds,
    })
}

/// The simulated GPUs' prefix-cache counters summed: (queries, hits), in tokens.
async fn prefix_counters(sys: &System) -> anyhow::Result<(f64, f64)> {
    Ok((
        sys.sim_metric_sum("vllm:prefix_cache_queries_total")
            .await?,
        sys.sim_metric_sum("vllm:prefix_cache_hits_total").await?,
    ))
}

/// Write a run's cluster samples as `cluster_samples.csv` in `dir` (see
/// [`super::idle::samples_csv`]).
pub(super) fn write_samples(dir: &Path, samples: &[ClusterSample]) -> anyhow::Result<()> {
    let path = dir.join("cluster_samples.csv");
    std::fs::write(&path, samples_csv(samples))
        .with_context(|| format!("writing {}", path.display()))
}

/// Write every worker-agent's `/metrics` text at the end of a run as `agent_metrics.txt`
/// in `dir` (the agents' counters and histograms since the system started).
pub(super) async fn write_agent_metrics(dir: &Path, sys: &System) -> anyhow::Result<()> {
    let path = dir.join("agent_metrics.txt");
    std::fs::write(&path, sys.agent_metrics_text().await)
        .with_context(|| format!("writing {}", path.display()))
}

/// Decisions read after a run (successful jobs with a job id) and the prediction errors;
/// the errors are `None` when no decision carried a prediction. Each job's prediction
/// beside its measurement goes to `predictions.csv` in `dir` (when any carried one).
async fn prediction_errors(
    sys: &System,
    result: &RunResult,
    dir: &Path,
) -> anyhow::Result<(usize, Option<PredictionErrors>)> {
    let found: Vec<(Option<Predicted>, &RequestRecord)> =
        futures::stream::iter(result.records.iter().filter(|r| r.ok))
            .map(|r| async move {
                let d = sys.decision_json(r.job_id.as_deref()?).await?;
                Some((predicted(&d), r))
            })
            .buffer_unordered(16)
            .filter_map(|x| async move { x })
            .collect()
            .await;
    let jobs: Vec<PredictedJob> = found
        .iter()
        .filter_map(|(p, r)| {
            Some(PredictedJob {
                id: r.id,
                job_id: r.job_id.clone()?,
                worker: r.worker.clone(),
                predicted: (*p)?,
                ttft_ms: r.ttft_ms,
                tokens_per_s: r.tokens_per_s,
            })
        })
        .collect();
    if jobs.is_empty() {
        return Ok((found.len(), None));
    }
    let path = dir.join("predictions.csv");
    std::fs::write(&path, predictions_csv(&jobs))
        .with_context(|| format!("writing {}", path.display()))?;
    let pairs: Vec<_> = jobs
        .iter()
        .map(|j| (j.predicted, j.ttft_ms, j.tokens_per_s))
        .collect();
    Ok((found.len(), Some(PredictionErrors::of(&pairs))))
}

fn system_spec(plan: &BenchPlan, policy: &str, speeds: Vec<String>, tag: &str) -> SystemSpec {
    SystemSpec {
        repo: plan.repo.clone(),
        gpus: speeds.len(),
        model: MODEL.into(),
        speeds,
        policy: policy.into(),
        state_dir: std::env::temp_dir()
            .join(format!("metronome-bench-{}-{tag}", std::process::id())),
        sim_args: Vec::new(),
        worker_max_concurrency: plan.worker_max_concurrency,
        profile: "release".into(),
        keep_going: false,
        gateway_extra_toml: None,
        nats_cluster: 1,
        first_gateway_port: None,
    }
}

fn speeds_str(speeds: &[f64]) -> Vec<String> {
    speeds.iter().map(|s| format!("{s}")).collect()
}

fn write_json(plan: &BenchPlan, report: &Report) -> anyhow::Result<()> {
    std::fs::write(
        plan.out.join("report.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    Ok(())
}

fn setup_lines(plan: &BenchPlan) -> Vec<String> {
    let mut v = vec![
        format!(
            "Clusters: {}; every GPU a simulated Llama-3.1-8B on a 24 GB card with the simulator's defaults (≈60 tok/s single stream, 40k-token KV cache, chunked prefill 2048, recompute preemption), one model (`{MODEL}`).",
            plan.clusters
                .iter()
                .map(|c| format!("`{c}` = {}", cluster_title(c)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        match plan.worker_max_concurrency {
            None => "Every component as `./dev up` configures it by default: no dispatcher settings appended, worker-agent cap not overridden (`WORKER_MAX_CONCURRENCY` unset). A fresh system per policy and cluster; GPUs idle before every run.".into(),
            Some(c) => format!(
                "**Not the defaults:** worker-agent `max_concurrency` overridden to {c} (`--worker-max-concurrency`, sets `WORKER_MAX_CONCURRENCY`); everything else as `./dev up` configures it. A fresh system per policy and cluster; GPUs idle before every run."
            ),
        },
        format!(
            "Offered loads: {} × nominal capacity, the same absolute rates for every policy; {} requests per point.",
            plan.loads
                .iter()
                .map(|l| format!("{l}"))
                .collect::<Vec<_>>()
                .join(", "),
            plan.requests
        ),
    ];
    if plan.workloads.iter().any(|w| w == "trace") {
        v.push(format!(
            "Workload `trace`: `{}` (the shared Azure LLM inference trace 2023, code), the first {} requests, inter-arrival gaps rescaled to the target mean rate (shape and burstiness kept).",
            plan.trace.file_name().map_or_else(|| plan.trace.display().to_string(), |f| f.to_string_lossy().into_owned()),
            plan.requests
        ));
    }
    if plan.workloads.iter().any(|w| w == "chat") {
        v.push(format!(
            "Workload `chat`: Poisson arrivals, prompt `{}`, output `{}`, seed {CHAT_SEED}.",
            plan.chat_prompt, plan.chat_output
        ));
    }
    if plan.workloads.iter().any(|w| w == "shared_prefix") {
        v.push("Workload `shared_prefix`: 16 groups × 20 users (320 requests, the first of a seeded random order), each request its group's 2,000-token system prompt and a question of its own (`lognormal:mean=100,sigma=0.6,max=1000`), output `lognormal:mean=200,sigma=0.6,max=1500`, Poisson arrivals, seed 7. Synthetic (after SGLang's generated-shared-prefix data set).".into());
    }
    if plan.workloads.iter().any(|w| w == "multi_turn") {
        v.push("Workload `multi_turn`: conversations of `uniform:2,8` turns behind a shared 500-token system prompt, each turn re-sending the whole history and a new user message (`lognormal:mean=150,sigma=0.6,max=1500`), replies `lognormal:mean=200,sigma=0.6,max=1500`; conversations start at Poisson arrivals (rate = the load's request rate / mean turns), the next turn follows the reply time at 30 tok/s plus an exponential think time of mean 3 s (open loop), seed 7. Synthetic: no public conversation data set is bundled. The first and last conversations ramp the request rate up and down, so over a run of a few hundred requests the offered rate stays below the planned one, which the goodput figure (attainment × planned rate) still uses.".into());
    }
    if plan.workloads.iter().any(|w| w == "agent") {
        v.push("Workload `agent`: loops of `uniform:4,12` steps behind a 1,500-token system prompt, each step re-sending the transcript with a new tool result (`lognormal:mean=400,sigma=0.8,max=4000`) and asking for a tool call (`lognormal:mean=60,sigma=0.5,max=500`), 0.5 s mean between steps, seed 7. Synthetic.".into());
    }
    if plan
        .workloads
        .iter()
        .any(|w| PREFIX_WORKLOADS.contains(&w.as_str()))
    {
        v.push("Nominal capacity counts every prompt's full prefill, as for the other workloads: with a prefix cache the GPUs can serve more.".into());
    }
    v.push("SLO: TTFT ≤ 2 s and ≥ 30 tok/s per request; failed requests count as misses.".into());
    v
}

/// One burst round: N simultaneous requests; whether they landed on N distinct workers
/// (`None` when a request failed or carried no worker header), and the workers, sorted.
async fn burst_round(sys: &System, n: usize) -> anyhow::Result<(Option<bool>, String)> {
    sys.wait_idle(Duration::from_secs(60)).await?;
    sys.wait_workers_idle(Duration::from_secs(30)).await?;
    let plan: Vec<PlannedRequest> = (0..n as u64)
        .map(|id| PlannedRequest {
            id,
            at_s: 0.0,
            prompt_tokens: 512,
            output_tokens: 32,
            tenant: None,
            messages: Vec::new(),
        })
        .collect();
    let r = run_plan(
        base_spec(sys.base_url()),
        plan,
        false,
        CancellationToken::new(),
    )
    .await?;
    let workers: Option<Vec<String>> = r
        .records
        .iter()
        .map(|rec| rec.ok.then(|| rec.worker.clone()).flatten())
        .collect();
    let mut seen: Vec<String> = r
        .records
        .iter()
        .map(|rec| rec.worker.clone().unwrap_or_else(|| "?".into()))
        .collect();
    seen.sort();
    let verdict = workers.map(|mut w| {
        w.sort();
        w.dedup();
        w.len() == n
    });
    Ok((verdict, seen.join(" ")))
}

/// Runs every scenario of the plan and returns the report (also written to disk).
pub async fn run_bench(plan: &BenchPlan) -> anyhow::Result<Report> {
    let start = Instant::now();
    std::fs::create_dir_all(&plan.out)?;
    let mut report = Report {
        title_scale: if plan.quick {
            "quick scale".into()
        } else {
            "full scale".into()
        },
        command: plan.command.clone(),
        date_utc: super::machine::date_utc(),
        machine: super::machine::describe(&plan.repo),
        setup: setup_lines(plan),
        workloads: plan.workloads.clone(),
        clusters: plan.clusters.clone(),
        ..Report::default()
    };
    if std::env::var_os(EXTRA_TOML_ENV).is_some() {
        report.notes.push(format!(
            "`{EXTRA_TOML_ENV}` was set in the environment and was removed from every system this run started: the figures are from the defaults."
        ));
    }

    // 1. Nominal capacity per workload and cluster (pure arithmetic, no system).
    let mut nominal: BTreeMap<(String, String), f64> = BTreeMap::new();
    for c in &plan.clusters {
        let speeds = cluster_speeds(c).with_context(|| format!("unknown cluster {c}"))?;
        for w in &plan.workloads {
            let n = nominal_for(plan, w, &speeds)?;
            progress(
                start,
                format!(
                    "nominal capacity of {w} on {c}: {:.2} req/s (batch {} at {:.1} ms/step, {:.3} GPU-s per request)",
                    n.capacity_rps, n.batch, n.step_ms, n.t_req_s
                ),
            );
            nominal.insert((w.clone(), c.clone()), n.capacity_rps);
            report.nominal.push(NominalRow {
                workload: w.clone(),
                cluster: c.clone(),
                speeds: speeds.clone(),
                nominal: n,
            });
        }
    }

    // 2. Per cluster and policy, one fresh system: every workload at every load, then the
    //    burst case.
    let mut rss_done = false;
    let total = plan.clusters.len() * plan.policies.len() * plan.workloads.len() * plan.loads.len();
    let mut done = 0usize;
    for c in &plan.clusters {
        let speeds = cluster_speeds(c).unwrap_or_default();
        for policy in &plan.policies {
            progress(
                start,
                format!("{c}: starting the system with policy {policy}"),
            );
            let mut sys = System::up(&system_spec(
                plan,
                policy,
                speeds_str(&speeds),
                &format!("{c}-{policy}"),
            ))
            .await?;
            if sys.dispatcher_metrics.is_empty() {
                report.notes.push(format!(
                    "{c}/{policy}: no dispatcher metrics_addr in the state dir's configs: idle check without queue depth (always 0)."
                ));
            }
            for w in &plan.workloads {
                let cap = nominal[&(w.clone(), c.clone())];
                for &frac in &plan.loads {
                    let rate = cap * frac;
                    let load = format!("{:.0}", frac * 100.0);
                    done += 1;
                    progress(
                        start,
                        format!("[{done}/{total}] {c}/{w}/{policy} at {load} % = {rate:.2} req/s"),
                    );
                    let rss = (!rss_done && policy == METRONOME && frac >= 0.7 - 1e-9)
                        .then(|| sample_rss(sys.pids()));
                    let dir = run_dir(&plan.out, c, w, policy, frac);
                    let m = measured_run(&sys, plan.spec(w, sys.base_url(), rate), &dir).await?;
                    if let Some((stop, peaks)) = rss {
                        stop.cancel();
                        rss_done = true;
                        report.rss_kib = peaks_vec(&peaks);
                        report.rss_under = format!(
                            "policy metronome, {} on {}, {load} % = {rate:.2} req/s",
                            workload_title(w),
                            cluster_title(c)
                        );
                    }
                    let (decisions_read, prediction) = if policy == METRONOME {
                        prediction_errors(&sys, &m.result, &dir).await?
                    } else {
                        (0, None)
                    };
                    let s = &m.result.summary;
                    let goodput_rps = goodput_rate(s.good, s.count, rate);
                    progress(
                        start,
                        format!(
                            "{c}/{w}/{policy} at {load} %: SLO attainment {:.1} %, goodput {goodput_rps:.2} req/s, TTFT p50 {:.0} ms p90 {:.0} ms p99 {:.0} ms, tok/s p1 {:.1} CV {:.2}, prefix-cache hit rate {}, idle {:.1} GPU-s ({:.2} %, {} samples, max queue {:.0}), {} errors{}{}",
                            s.goodput_share * 100.0,
                            s.ttft_ms.p50.unwrap_or(0.0),
                            s.ttft_ms.p90.unwrap_or(0.0),
                            s.ttft_ms.p99.unwrap_or(0.0),
                            s.tokens_per_s.p1.unwrap_or(0.0),
                            s.tokens_per_s.cv.unwrap_or(0.0),
                            m.prefix_hit_rate.map_or("–".to_string(), |h| format!("{:.1} %", h * 100.0)),
                            m.idle.idle_gpu_s,
                            m.idle.share * 100.0,
                            m.idle.samples,
                            m.idle.max_queued,
                            s.errors,
                            match (&prediction, policy == METRONOME) {
                                (Some(p), _) => format!(
                                    ", {decisions_read} decisions read, prediction error p50 TTFT {:.0} % decode {:.0} %",
                                    p.ttft.p50.unwrap_or(f64::NAN) * 100.0,
                                    p.decode.p50.unwrap_or(f64::NAN) * 100.0
                                ),
                                (None, true) => format!(
                                    ", {decisions_read} decisions read, none with a prediction"
                                ),
                                (None, false) => String::new(),
                            },
                            if m.holds.is_empty() {
                                String::new()
                            } else {
                                format!(
                                    ", holds {}",
                                    m.holds
                                        .iter()
                                        .map(|(r, n)| format!("{r} {n:.0}"))
                                        .collect::<Vec<_>>()
                                        .join(" ")
                                )
                            }
                        ),
                    );
                    report.runs.push(RunRow {
                        policy: policy.clone(),
                        workload: w.clone(),
                        cluster: c.clone(),
                        load_frac: frac,
                        rate_rps: rate,
                        goodput_rps,
                        summary: m.result.summary,
                        preemptions: m.preemptions,
                        prefix_hit_rate: m.prefix_hit_rate,
                        idle: m.idle,
                        prediction,
                        decisions_read,
                        dir: rel(&plan.report_path, &dir),
                    });
                    write_json(plan, &report)?;
                }
            }

            if plan.burst_rounds > 0 {
                let mut row = BurstRow {
                    cluster: c.clone(),
                    policy: policy.clone(),
                    rounds: plan.burst_rounds,
                    distinct_rounds: 0,
                    failed_rounds: 0,
                    examples: Vec::new(),
                };
                for _ in 0..plan.burst_rounds {
                    let (verdict, workers) = burst_round(&sys, speeds.len()).await?;
                    match verdict {
                        Some(true) => row.distinct_rounds += 1,
                        Some(false) => row.examples.push(workers),
                        None => row.failed_rounds += 1,
                    }
                }
                progress(
                    start,
                    format!(
                        "{c}/{policy}: burst: {} of {} rounds one job per GPU",
                        row.distinct_rounds, row.rounds
                    ),
                );
                report.burst.push(row);
            }
            sys.stop().await;
        }
    }

    // 3. Overhead with a zero-delay simulator.
    if !plan.skip_overhead {
        overhead(plan, start, &mut report).await?;
    }

    // 4. Curves, report.
    write_curves(&plan.out, &plan.report_path, &mut report)?;
    finish_report(plan, &mut report)?;
    progress(
        start,
        format!(
            "wrote {} and {}",
            plan.report_path.display(),
            plan.out.display()
        ),
    );
    Ok(report)
}

/// One goodput SVG per workload × cluster under `out`, listed in the report's plots.
fn write_curves(out: &Path, report_path: &Path, report: &mut Report) -> anyhow::Result<()> {
    report.plots.clear();
    for (w, c) in sections(report) {
        let series: Vec<CurveSeries> = report
            .policies()
            .into_iter()
            .map(|p| CurveSeries {
                points: report
                    .rows(&w, &c, Some(&p))
                    .iter()
                    .map(|r| (r.load_frac, r.summary.goodput_share, r.goodput_rps))
                    .collect(),
                name: p,
            })
            .collect();
        let path = out.join(&c).join(&w).join("goodput.svg");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let title = format!(
            "{} on {}: goodput vs offered load (nominal capacity {:.2} req/s)",
            workload_title(&w),
            cluster_title(&c),
            report.nominal_of(&w, &c).map_or(0.0, |n| n.capacity_rps)
        );
        goodput_curves(&path, &title, &series)?;
        report.plots.push(PlotRef {
            workload: w,
            cluster: c,
            path: rel(report_path, &path),
        });
    }
    Ok(())
}

/// The analysis (the plan's file, else generated), then `report.json` and the report.
fn finish_report(plan: &BenchPlan, report: &mut Report) -> anyhow::Result<()> {
    if let Some(path) = &plan.analysis {
        report.analysis =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    } else {
        report.analysis = super::machine::auto_analysis(report);
    }
    let full = BenchPlan::new(false, plan.repo.clone());
    report.reproduce = super::report::reproduce_command(
        report,
        &RunDefaults {
            policies: &POLICIES,
            workloads: &WORKLOADS,
            clusters: &CLUSTERS,
            loads: &full.loads,
            requests: full.requests,
            burst_rounds: full.burst_rounds,
        },
    );
    write_json(plan, report)?;
    if let Some(dir) = plan.report_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Hand-written sections saved beside the results: the prefix-heavy workloads' figures,
    // then the fairness drill's section as its last run saved it.
    let extra: Vec<String> = [PREFIX_SECTION_DIR, "fairness"]
        .iter()
        .filter_map(|dir| {
            std::fs::read_to_string(plan.out.join(dir).join(super::report::SECTION_FILE)).ok()
        })
        .map(|s| s.trim_end().to_string())
        .collect();
    let extra = (!extra.is_empty()).then(|| extra.join("\n\n"));
    std::fs::write(
        &plan.report_path,
        super::report::render(report, extra.as_deref()),
    )?;
    Ok(())
}

/// Where a load point's CSV, summary and plots are under `out`.
fn run_dir(out: &Path, cluster: &str, workload: &str, policy: &str, load_frac: f64) -> PathBuf {
    out.join(cluster)
        .join(workload)
        .join(policy)
        .join(format!("{:.0}", load_frac * 100.0))
}

/// `--render`: the report from saved `report.json` files, the first the base and the
/// others' load points merged into it ([`super::merge`]), without starting a system. Each
/// point's folder must already be under the plan's `out` (copy a separate run's folders
/// there first), so every link in the report holds; the curves are drawn again from all
/// points. `twice` says what a point measured twice does.
pub fn render_merged(
    plan: &BenchPlan,
    inputs: &[PathBuf],
    twice: super::merge::Twice,
) -> anyhow::Result<Report> {
    let read = |path: &PathBuf| -> anyhow::Result<Report> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let (first, rest) = inputs
        .split_first()
        .context("--render wants at least one report.json")?;
    let base = read(first)?;
    let extras = rest
        .iter()
        .map(|p| Ok((p.display().to_string(), read(p)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut report = super::merge::merge_reports(base, extras, twice)?;
    for r in &mut report.runs {
        let dir = run_dir(&plan.out, &r.cluster, &r.workload, &r.policy, r.load_frac);
        if !dir.is_dir() {
            anyhow::bail!(
                "{} is missing: copy that run's folder under {} first",
                dir.display(),
                plan.out.display()
            );
        }
        r.dir = rel(&plan.report_path, &dir);
    }
    write_curves(&plan.out, &plan.report_path, &mut report)?;
    finish_report(plan, &mut report)?;
    Ok(report)
}

fn rel(report: &Path, dir: &Path) -> String {
    let base = report.parent().unwrap_or(Path::new("."));
    dir.strip_prefix(base).unwrap_or(dir).display().to_string()
}

fn ramp_step(rate: f64, s: &Summary, kept_up: bool) -> RampStep {
    RampStep {
        rate_rps: rate,
        kept_up,
        completion_rps: completion_rate(s),
        ok: s.ok,
        count: s.count,
    }
}

/// A capacity search with `make(rate)` building each step's spec (overhead runs only).
async fn search(
    sys: &System,
    start: Instant,
    label: &str,
    mut s: CapacitySearch,
    keep: KeepUp,
    make: impl Fn(f64) -> LoadSpec,
) -> anyhow::Result<(Option<f64>, Vec<RampStep>)> {
    let mut steps = Vec::new();
    while let Some(rate) = s.next_rate() {
        sys.wait_idle(Duration::from_secs(300)).await?;
        progress(start, format!("capacity ({label}): trying {rate:.2} req/s"));
        let result = run_load(make(rate), false).await?;
        let ok = keeps_up(&result.summary, keep);
        progress(
            start,
            format!(
                "capacity ({label}): {rate:.2} req/s -> completions {:.2} req/s, {} / {} ok: {}",
                completion_rate(&result.summary),
                result.summary.ok,
                result.summary.count,
                if ok { "kept up" } else { "did not keep up" }
            ),
        );
        steps.push(ramp_step(rate, &result.summary, ok));
        s.record(rate, ok);
    }
    Ok((s.capacity(), steps))
}

fn tiny_spec(base_url: String, rate: f64, secs: f64) -> LoadSpec {
    LoadSpec {
        workload: Workload::Poisson {
            rate_rps: rate,
            prompt_tokens: LengthDist::Fixed(16),
            output_tokens: LengthDist::Fixed(2),
        },
        limit: Some(((rate * secs).ceil() as usize).max(1)),
        request_timeout_s: 30.0,
        drain_timeout_s: 30.0,
        seed: 11,
        ..base_spec(base_url)
    }
}

async fn overhead(plan: &BenchPlan, start: Instant, report: &mut Report) -> anyhow::Result<()> {
    let speeds = vec![ZERO_DELAY_SPEED.to_string(); 4];
    progress(start, "starting the zero-delay system (policy metronome)");
    let mut sys = System::up(&system_spec(plan, "metronome", speeds, "overhead")).await?;
    let direct_url = format!("{}/v1", sys.sim_urls[0]);
    // Warm up connections and the JIT-free but cache-cold paths.
    run_load(tiny_spec(sys.base_url(), 50.0, 1.0), false).await?;
    for &rate in &plan.overhead_rates {
        progress(
            start,
            format!("overhead: {rate:.0} req/s directly to the simulator"),
        );
        let direct = run_load(
            tiny_spec(direct_url.clone(), rate, plan.overhead_run_s),
            false,
        )
        .await?;
        progress(
            start,
            format!("overhead: {rate:.0} req/s through Metronome"),
        );
        let rss = ((rate - 500.0).abs() < 1e-9).then(|| sample_rss(sys.pids()));
        let gateway = run_load(tiny_spec(sys.base_url(), rate, plan.overhead_run_s), false).await?;
        if let Some((stop, peaks)) = rss {
            stop.cancel();
            report.rss_overhead_kib = peaks_vec(&peaks);
        }
        progress(
            start,
            format!(
                "overhead at {rate:.0} req/s: e2e p50 {:.2} -> {:.2} ms, p99 {:.2} -> {:.2} ms",
                direct.summary.e2e_ms.p50.unwrap_or(0.0),
                gateway.summary.e2e_ms.p50.unwrap_or(0.0),
                direct.summary.e2e_ms.p99.unwrap_or(0.0),
                gateway.summary.e2e_ms.p99.unwrap_or(0.0)
            ),
        );
        report.overhead.push(OverheadRow {
            rate_rps: rate,
            direct: direct.summary,
            gateway: gateway.summary,
        });
    }
    let url = sys.base_url();
    let (max, ramp) = search(
        &sys,
        start,
        "zero-delay",
        CapacitySearch::new(
            250.0,
            2.0,
            if plan.quick { 1 } else { 2 },
            if plan.quick { 5 } else { 7 },
        ),
        KeepUp::default(),
        |r| tiny_spec(url.clone(), r, plan.overhead_ramp_s),
    )
    .await?;
    report.max_sustained_rps = max;
    report.ramp_overhead = ramp;
    sys.stop().await;

    let bench = plan.repo.join("target/release/examples/dispatch_bench");
    if bench.exists() {
        progress(
            start,
            "dispatcher decisions/s with 64 workers (dispatch_bench)",
        );
        let out = tokio::time::timeout(
            Duration::from_secs(300),
            tokio::process::Command::new(&bench)
                .args(["--workers", "64", "--jobs", &plan.dispatch_jobs.to_string()])
                .env("RUST_LOG", "warn")
                .output(),
        )
        .await;
        match out {
            Ok(Ok(o)) => {
                let text = String::from_utf8_lossy(&o.stdout);
                report.dispatch_bench = text
                    .lines()
                    .find(|l| l.contains("decisions/s"))
                    .map(|l| format!("`{}`", l.trim()));
                if report.dispatch_bench.is_none() {
                    report.notes.push(format!(
                        "dispatch_bench printed no figure (exit {}): {}",
                        o.status,
                        String::from_utf8_lossy(&o.stderr)
                            .lines()
                            .last()
                            .unwrap_or("")
                    ));
                }
            }
            Ok(Err(e)) => report
                .notes
                .push(format!("dispatch_bench did not start: {e}")),
            Err(_) => report.notes.push("dispatch_bench ran past 300 s".into()),
        }
    } else {
        report.notes.push(
            "dispatcher decisions/s not measured: build it with `cargo build --release -p metronome-dispatcher --example dispatch_bench`".into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> BenchPlan {
        BenchPlan::new(false, PathBuf::from("/nonexistent"))
    }

    #[test]
    fn chat_lengths_do_not_depend_on_the_rate() {
        let p = plan();
        let lengths = |rate: f64| -> Vec<(u32, u32)> {
            plan_requests(&p.spec("chat", "http://127.0.0.1/v1".into(), rate))
                .unwrap()
                .iter()
                .map(|r| (r.prompt_tokens, r.output_tokens))
                .collect()
        };
        assert_eq!(lengths(1.0), lengths(17.3));
        assert_eq!(lengths(1.0).len(), 300);
    }

    #[test]
    fn prefix_workloads_plan_the_same_requests_at_every_rate() {
        let p = plan();
        for w in PREFIX_WORKLOADS {
            assert!(WORKLOADS.contains(&w));
            let requests = |rate: f64| {
                let mut v: Vec<(u32, u32, usize)> =
                    plan_requests(&p.spec(w, "http://127.0.0.1/v1".into(), rate))
                        .unwrap()
                        .iter()
                        .map(|r| (r.prompt_tokens, r.output_tokens, r.messages.len()))
                        .collect();
                v.sort();
                v
            };
            let a = requests(1.0);
            assert_eq!(a, requests(17.3), "{w}");
            assert_eq!(a.len(), 300, "{w}");
            assert!(a.iter().all(|r| r.2 >= 2), "{w}: every prompt is a chat");
        }
    }

    #[test]
    fn chat_nominal_capacity_is_about_three_requests_per_full_speed_gpu() {
        let p = plan();
        let equal = nominal_for(&p, "chat", &cluster_speeds("equal").unwrap()).unwrap();
        let mixed = nominal_for(&p, "chat", &cluster_speeds("mixed").unwrap()).unwrap();
        assert!((10.0..15.0).contains(&equal.capacity_rps), "{equal:?}");
        assert!((mixed.capacity_rps / equal.capacity_rps - 3.5 / 4.0).abs() < 1e-9);
        assert!((900.0..1200.0).contains(&equal.mean_prompt), "{equal:?}");
    }

    #[test]
    fn defaults_follow_the_method() {
        let full = plan();
        assert_eq!(full.loads, LOADS.to_vec());
        assert!(
            full.loads.len() >= 6 && full.loads[0] <= 0.3 && *full.loads.last().unwrap() >= 1.5
        );
        assert_eq!(full.requests, 300);
        assert_eq!(full.worker_max_concurrency, None);
        assert_eq!(BenchPlan::new(true, PathBuf::new()).requests, 60);
        assert_eq!(cluster_speeds("mixed"), Some(vec![1.0, 1.0, 1.0, 0.5]));
        assert_eq!(cluster_speeds("other"), None);
    }
}
