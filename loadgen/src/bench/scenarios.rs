//! The scenario runner behind `metronome-bench`: capacity search, trace and Poisson runs per
//! policy and load, the burst case, and the overhead runs against a zero-delay simulator.
//!
//! Fairness invariants: every policy runs on a fresh system with the same GPUs, speeds,
//! model-server settings and worker caps; at a given load every policy replays exactly the
//! same planned requests (same trace window, same Poisson seed); only `--policy` differs.
//! Runs are separated by waiting until every simulated GPU is idle, so one run's backlog
//! never leaks into the next.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::capacity::{completion_rate, keeps_up, CapacitySearch, KeepUp};
use super::report::{BurstRow, OverheadRow, RampStep, Report, RunRow};
use super::system::{rss_kib, System, SystemSpec};
use crate::{
    run_load, run_plan, write_outputs, LengthDist, LoadSpec, PlannedRequest, RunResult, Summary,
    Workload,
};

/// Policies compared, Metronome first, then the conventional balancers.
pub const POLICIES: [&str; 5] = [
    "metronome",
    "least_connections",
    "round_robin",
    "random",
    "power_of_two",
];

/// Model name every simulated GPU serves.
pub const MODEL: &str = "bench-model";

/// Speed factor that makes every simulated step round to zero duration (zero-delay mode):
/// the largest step (a full prefill budget over a full cache, ≈ 340 ms) divided by it is far
/// below a nanosecond.
pub const ZERO_DELAY_SPEED: &str = "1e15";

/// Everything a benchmark run is parameterised by.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub quick: bool,
    pub repo: PathBuf,
    pub out: PathBuf,
    pub report_path: PathBuf,
    pub trace: PathBuf,
    pub policies: Vec<String>,
    pub loads: Vec<f64>,
    pub speeds: Vec<String>,
    pub worker_max_concurrency: Option<u32>,
    /// Trace requests per load run (the first N of the trace).
    pub run_requests: usize,
    /// Requests per capacity-search step.
    pub ramp_requests: usize,
    pub ramp_initial_rps: f64,
    pub ramp_growth: f64,
    pub ramp_bisections: u32,
    pub ramp_max_steps: u32,
    pub poisson_prompt: LengthDist,
    pub poisson_output: LengthDist,
    pub poisson_load: f64,
    pub burst_rounds: usize,
    pub overhead_rates: Vec<f64>,
    pub overhead_run_s: f64,
    pub overhead_ramp_s: f64,
    pub dispatch_jobs: usize,
    pub skip_overhead: bool,
    /// Use these capacities (trace, Poisson; req/s) instead of measuring them.
    pub given_capacity: Option<(f64, f64)>,
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
            loads: vec![0.5, 0.7, 0.9],
            speeds: ["1", "1", "1", "0.5"].map(String::from).to_vec(),
            worker_max_concurrency: Some(32),
            run_requests: if quick { 40 } else { 150 },
            ramp_requests: if quick { 40 } else { 150 },
            ramp_initial_rps: 3.0,
            ramp_growth: 1.4,
            ramp_bisections: if quick { 1 } else { 2 },
            ramp_max_steps: if quick { 4 } else { 9 },
            poisson_prompt: LengthDist::LogNormal {
                mean: 800.0,
                sigma: 1.0,
                max: 7000,
            },
            poisson_output: LengthDist::LogNormal {
                mean: 120.0,
                sigma: 0.8,
                max: 1000,
            },
            poisson_load: 0.7,
            burst_rounds: if quick { 20 } else { 50 },
            overhead_rates: vec![100.0, 500.0],
            overhead_run_s: if quick { 4.0 } else { 15.0 },
            overhead_ramp_s: if quick { 3.0 } else { 10.0 },
            dispatch_jobs: if quick { 10_000 } else { 50_000 },
            skip_overhead: false,
            given_capacity: None,
            analysis: None,
            command: String::new(),
        }
    }
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

fn trace_spec(plan: &BenchPlan, base_url: String, rate: f64, n: usize) -> LoadSpec {
    LoadSpec {
        workload: Workload::Trace {
            path: plan.trace.clone(),
            time_scale: None,
            rate_rps: Some(rate),
            start_offset_s: 0.0,
        },
        limit: Some(n),
        ..base_spec(base_url)
    }
}

fn poisson_spec(plan: &BenchPlan, base_url: String, rate: f64, n: usize) -> LoadSpec {
    LoadSpec {
        workload: Workload::Poisson {
            rate_rps: rate,
            prompt_tokens: plan.poisson_prompt,
            output_tokens: plan.poisson_output,
        },
        limit: Some(n),
        seed: 7,
        ..base_spec(base_url)
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

/// Runs one load spec on a system: waits for idle GPUs, scrapes preemptions around it,
/// writes the outputs. Returns the result and the preemptions it caused.
async fn measured_run(
    sys: &System,
    spec: LoadSpec,
    dir: &Path,
) -> anyhow::Result<(RunResult, f64)> {
    sys.wait_idle(Duration::from_secs(180)).await?;
    let before = sys.sim_metric_sum("vllm:num_preemptions_total").await?;
    let result = run_load(spec, true).await?;
    sys.wait_idle(Duration::from_secs(180)).await.ok();
    let after = sys.sim_metric_sum("vllm:num_preemptions_total").await?;
    write_outputs(dir, &result).with_context(|| format!("writing {}", dir.display()))?;
    Ok((result, after - before))
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

/// A capacity search with `make(rate)` building each step's spec.
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
    }
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
        ..Report::default()
    };
    let gpus = plan.speeds.len();
    report.setup = vec![
        format!(
            "{gpus} simulated GPUs (speeds {}), one model (`{MODEL}`), simulator defaults (Llama-3.1-8B on a 24 GB card: ≈60 tok/s single stream, 40k-token KV cache, chunked prefill 2048, recompute preemption).",
            plan.speeds.join(", ")
        ),
        format!(
            "Worker-agent `max_concurrency` {} (`WORKER_MAX_CONCURRENCY`); everything else as `./dev up` configures it. A fresh system per policy; GPUs idle before every run.",
            plan.worker_max_concurrency
                .map_or("8 (./dev up default)".to_string(), |c| c.to_string())
        ),
        format!(
            "Trace: `{}` — the first {} requests, inter-arrival gaps rescaled to the target mean rate (same requests for every policy and load).",
            plan.trace.display(),
            plan.run_requests
        ),
        format!(
            "Poisson: {} requests at {:.0} % of the Poisson capacity, prompt `{}`, output `{}`, seed 7.",
            plan.run_requests,
            plan.poisson_load * 100.0,
            plan.poisson_prompt,
            plan.poisson_output
        ),
        "SLO for goodput: TTFT ≤ 2 s and ≥ 30 tok/s per request; failed requests count as misses.".into(),
    ];

    // 1. Capacity, with policy metronome.
    let (cap_trace, cap_poisson) = match plan.given_capacity {
        Some((t, p)) => {
            report.notes.push(format!(
                "Capacities given on the command line (--capacity {t},{p}), not measured in this run."
            ));
            report.capacity_trace_rps = Some(t);
            report.capacity_poisson_rps = Some(p);
            (t, p)
        }
        None => measure_capacity(plan, start, &mut report).await?,
    };
    progress(
        start,
        format!("capacity: trace {cap_trace:.2} req/s, poisson {cap_poisson:.2} req/s"),
    );

    // 2. Every policy: trace at each load, Poisson at one load, burst.
    for policy in &plan.policies {
        progress(start, format!("starting the system with policy {policy}"));
        let mut sys = System::up(&system_spec(plan, policy, plan.speeds.clone(), policy)).await?;
        for &frac in &plan.loads {
            let rate = cap_trace * frac;
            let name = format!("trace-{:.0}", frac * 100.0);
            progress(start, format!("{policy}: {name} at {rate:.2} req/s"));
            let rss = (policy == "metronome" && (frac - 0.7).abs() < 1e-9)
                .then(|| sample_rss(sys.pids()));
            let dir = plan.out.join(policy).join(&name);
            let (res, pre) = measured_run(
                &sys,
                trace_spec(plan, sys.base_url(), rate, plan.run_requests),
                &dir,
            )
            .await?;
            if let Some((stop, peaks)) = rss {
                stop.cancel();
                report.rss_kib = peaks_vec(&peaks);
                report.rss_under = format!("policy metronome, trace at 70 % = {rate:.2} req/s");
            }
            progress(
                start,
                format!(
                    "{policy}: {name}: goodput {:.1} %, tok/s p1 {:.1} CV {:.2}, e2e p99 {:.0} ms, {} errors, {pre} preemptions",
                    res.summary.goodput_share * 100.0,
                    res.summary.tokens_per_s.p1.unwrap_or(0.0),
                    res.summary.tokens_per_s.cv.unwrap_or(0.0),
                    res.summary.e2e_ms.p99.unwrap_or(0.0),
                    res.summary.errors
                ),
            );
            report.runs.push(RunRow {
                policy: policy.clone(),
                workload: "trace".into(),
                load_frac: frac,
                rate_rps: rate,
                summary: res.summary,
                preemptions: pre,
                dir: rel(&plan.report_path, &dir),
            });
        }
        let rate = cap_poisson * plan.poisson_load;
        let name = format!("poisson-{:.0}", plan.poisson_load * 100.0);
        progress(start, format!("{policy}: {name} at {rate:.2} req/s"));
        let dir = plan.out.join(policy).join(&name);
        let (res, pre) = measured_run(
            &sys,
            poisson_spec(plan, sys.base_url(), rate, plan.run_requests),
            &dir,
        )
        .await?;
        progress(
            start,
            format!(
                "{policy}: {name}: goodput {:.1} %, tok/s p1 {:.1} CV {:.2}, e2e p99 {:.0} ms, {} errors",
                res.summary.goodput_share * 100.0,
                res.summary.tokens_per_s.p1.unwrap_or(0.0),
                res.summary.tokens_per_s.cv.unwrap_or(0.0),
                res.summary.e2e_ms.p99.unwrap_or(0.0),
                res.summary.errors
            ),
        );
        report.runs.push(RunRow {
            policy: policy.clone(),
            workload: "poisson".into(),
            load_frac: plan.poisson_load,
            rate_rps: rate,
            summary: res.summary,
            preemptions: pre,
            dir: rel(&plan.report_path, &dir),
        });

        let mut row = BurstRow {
            policy: policy.clone(),
            rounds: plan.burst_rounds,
            distinct_rounds: 0,
            failed_rounds: 0,
            examples: Vec::new(),
        };
        for _ in 0..plan.burst_rounds {
            let (verdict, workers) = burst_round(&sys, gpus).await?;
            match verdict {
                Some(true) => row.distinct_rounds += 1,
                Some(false) => row.examples.push(workers),
                None => row.failed_rounds += 1,
            }
        }
        progress(
            start,
            format!(
                "{policy}: burst: {} of {} rounds one job per GPU",
                row.distinct_rounds, row.rounds
            ),
        );
        report.burst.push(row);
        sys.stop().await;
    }

    // 3. Overhead with a zero-delay simulator.
    if !plan.skip_overhead {
        overhead(plan, start, &mut report).await?;
    }

    if let Some(path) = &plan.analysis {
        report.analysis =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    } else {
        report.analysis = super::machine::auto_analysis(&report);
    }
    std::fs::write(
        plan.out.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(&plan.report_path, super::report::render(&report))?;
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

async fn measure_capacity(
    plan: &BenchPlan,
    start: Instant,
    report: &mut Report,
) -> anyhow::Result<(f64, f64)> {
    progress(start, "starting the capacity system (policy metronome)");
    let mut sys = System::up(&system_spec(
        plan,
        "metronome",
        plan.speeds.clone(),
        "capacity",
    ))
    .await?;
    let keep = KeepUp::default();
    let new_search = || {
        CapacitySearch::new(
            plan.ramp_initial_rps,
            plan.ramp_growth,
            plan.ramp_bisections,
            plan.ramp_max_steps,
        )
    };
    let url = sys.base_url();
    let (cap_trace, ramp) = search(&sys, start, "trace", new_search(), keep, |r| {
        trace_spec(plan, url.clone(), r, plan.ramp_requests)
    })
    .await?;
    report.ramp_trace = ramp;
    report.capacity_trace_rps = cap_trace;
    let (cap_poisson, ramp) = search(&sys, start, "poisson", new_search(), keep, |r| {
        poisson_spec(plan, url.clone(), r, plan.ramp_requests)
    })
    .await?;
    report.ramp_poisson = ramp;
    report.capacity_poisson_rps = cap_poisson;
    sys.stop().await;
    let cap_trace =
        cap_trace.context("no trace rate kept up: the system is broken or overloaded")?;
    Ok((cap_trace, cap_poisson.unwrap_or(cap_trace)))
}

fn rel(report: &Path, dir: &Path) -> String {
    let base = report.parent().unwrap_or(Path::new("."));
    dir.strip_prefix(base).unwrap_or(dir).display().to_string()
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
    let speeds = vec![ZERO_DELAY_SPEED.to_string(); plan.speeds.len()];
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
