//! `metronome-bench`: the one-command predictability benchmark. Parses flags, builds the
//! [`BenchPlan`], runs it and writes `BENCHMARKS.md`; everything else lives in
//! `metronome_bench`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_bench::failover_cache::{run_failover_cache, FailoverCachePlan};
use metronome_bench::fairness::{run_fairness, FairnessPlan};
use metronome_bench::merge::Twice;
use metronome_bench::{render_merged, run_bench, BenchPlan, CLUSTERS, POLICIES, WORKLOADS};
use metronome_loadgen::LengthDist;

/// Goodput versus offered load: Metronome against conventional balancers on simulated GPUs.
///
/// Builds nothing: run `cargo build --release --bins` (and, for the dispatcher figure,
/// `cargo build --release -p metronome-dispatcher --example dispatch_bench`) first. Needs
/// nats-server and redis-server on PATH. For each cluster (4 equal GPUs; 4 mixed, one at
/// half speed) and policy it starts a fresh `./dev up` with its defaults and offers each
/// workload (the shared trace; a chat-like Poisson mix; shared system prompts, multi-turn
/// conversations and an agent loop, whose prompts repeat earlier ones) at 30-150 % of the
/// cluster's nominal capacity (the same absolute rates for every policy), then runs the
/// burst case; then the overhead runs with a zero-delay simulator. Writes BENCHMARKS.md
/// and bench-results/ (per-run CSV, JSON, SVG plots; goodput curves; report.json). See
/// docs/BENCHMARKING.md.
///
/// Examples:
///   metronome-bench                              # full scale (hours on 2 cores)
///   metronome-bench --quick                      # 60 requests per point
///   metronome-bench --quick --policies metronome,least_connections --workloads chat \
///     --clusters equal --loads 0.5,1.5 --skip-overhead --out quick --report quick/B.md
///   metronome-bench --policies metronome,least_connections,prefix_affinity \
///     --workloads shared_prefix --clusters equal --loads 0.7 --burst-rounds 0 \
///     --skip-overhead --out runs/shared --report runs/shared/B.md
///                                     # the prefix-heavy comparison of
///                                     # bench-results/prefix/README.md
///   metronome-bench --fairness        # only the tenant-fairness drill: writes the report's
///                                     # "## Fairness" section, exits 1 when a target is missed
///   metronome-bench --failover-cache  # only the prefix-cache hit rate across a leader
///                                     # failover (multi_turn), against a run without one
///   metronome-bench --render bench-results/report.json,light/report.json
///                                     # no run: the report again from saved runs, the
///                                     # second one's load points joining the first's curves
///   metronome-bench --render bench-results/report.json,again/report.json --remeasured
///                                     # the same; a point both runs measured shows the
///                                     # second run's figures
#[derive(Debug, Parser)]
#[command(name = "metronome-bench", version, verbatim_doc_comment)]
struct Cli {
    /// Reduced scale: 60 requests per point, 20 burst rounds, shorter overhead runs.
    #[arg(long)]
    quick: bool,
    /// Folder for per-run results (CSV, summary.json, SVG plots) [default: <repo>/bench-results].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Where to write the report [default: <repo>/BENCHMARKS.md].
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Trace CSV [default: <repo>/../shared/traces/azure_llm_2023_code.csv].
    #[arg(long, value_name = "PATH")]
    trace: Option<PathBuf>,
    /// Repository root (holds ./dev and target/release) [default: where this was built from].
    #[arg(long, value_name = "DIR")]
    repo: Option<PathBuf>,
    /// Policies to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = POLICIES.map(String::from))]
    policies: Vec<String>,
    /// Workloads, comma-separated: trace, chat, and the prefix-heavy shared_prefix (groups
    /// sharing a long system prompt), multi_turn (conversations re-sending their history)
    /// and agent (a growing tool transcript); see docs/BENCHMARKING.md.
    #[arg(long, value_delimiter = ',', default_values_t = WORKLOADS.map(String::from))]
    workloads: Vec<String>,
    /// Clusters, comma-separated: equal (speeds 1,1,1,1), mixed (1,1,1,0.5).
    #[arg(long, value_delimiter = ',', default_values_t = CLUSTERS.map(String::from))]
    clusters: Vec<String>,
    /// Offered loads as shares of nominal capacity, comma-separated
    /// [default: 0.3,0.5,0.7,0.9,1.1,1.3,1.5].
    #[arg(long, value_delimiter = ',')]
    loads: Vec<f64>,
    /// Requests per load point [default: 60 quick, 300 full].
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Burst rounds per policy and cluster; 0 skips the burst case [default: 20 quick, 50 full].
    #[arg(long, value_name = "N")]
    burst_rounds: Option<usize>,
    /// Experiments only: WORKER_MAX_CONCURRENCY for every worker-agent. Unset, `./dev up`'s
    /// default applies; set, the report says the figures are not from the defaults.
    #[arg(long, value_name = "N")]
    worker_max_concurrency: Option<u32>,
    /// Chat workload prompt lengths [default: lognormal:mean=1000,sigma=0.6,max=8000].
    #[arg(long, value_name = "DIST")]
    chat_prompt: Option<LengthDist>,
    /// Chat workload output lengths [default: lognormal:mean=200,sigma=0.6,max=1500].
    #[arg(long, value_name = "DIST")]
    chat_output: Option<LengthDist>,
    /// Skip the zero-delay overhead runs and the dispatcher benchmark.
    #[arg(long)]
    skip_overhead: bool,
    /// Markdown file whose text becomes the report's analysis section (else a factual
    /// summary of targets met and missed is generated).
    #[arg(long, value_name = "FILE")]
    analysis: Option<PathBuf>,
    /// Run only the fairness drill: tenant B steady, tenant A flooding at 10× its share,
    /// through the gateway with one API key each, then a leader SIGKILL; replaces the
    /// report's "## Fairness" section (outputs under <out>/fairness).
    #[arg(long)]
    fairness: bool,
    /// Run only the failover cache check: WORKLOAD (a prefix-heavy one) at 70 % of nominal
    /// capacity on 4 equal GPUs, the leader SIGKILLed after a warm-up and a 30 s steady
    /// window, against a control run without the kill; prints the prefix-cache hit rate of
    /// the steady window and of the 30 s after the kill. Writes no report.
    #[arg(
        long,
        value_name = "WORKLOAD",
        num_args = 0..=1,
        default_missing_value = "multi_turn",
        conflicts_with_all = ["fairness", "render"]
    )]
    failover_cache: Option<String>,
    /// Fairness drill and failover cache check: the build profile whose binaries `./dev up`
    /// runs (the main benchmark always runs release binaries).
    #[arg(long, value_name = "PROFILE", default_value = "release", value_parser = ["release", "debug"])]
    profile: String,
    /// Run nothing: write the report from saved report.json files, the first the base, the
    /// load points of the others merged into its curves (copy their folders under --out
    /// first). A point measured twice (see --remeasured), or other nominal rates, is
    /// refused.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "REPORT_JSON",
        conflicts_with = "fairness"
    )]
    render: Vec<PathBuf>,
    /// With --render: a point that a later report measured again (a newer build) replaces
    /// the earlier one, and the later report's note in the report names what it replaced.
    #[arg(long, requires = "render")]
    remeasured: bool,
    /// Fairness drill: seconds of load per phase [default: 60].
    #[arg(long, value_name = "S", requires = "fairness")]
    phase_seconds: Option<f64>,
    /// Fairness drill: simulated GPUs [default: 4].
    #[arg(long, value_name = "N", requires = "fairness")]
    gpus: Option<usize>,
}

fn invalid(msg: String) -> ExitCode {
    eprintln!("error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cli = Cli::parse();
    let _tracing = metronome_runtime::init_tracing_at(metronome_runtime::LogOutput::Stderr, "warn");
    let repo = cli
        .repo
        .clone()
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")));
    let repo = match repo.canonicalize() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: repository {}: {e}", repo.display());
            return ExitCode::from(2);
        }
    };
    if cli.fairness {
        return fairness(&cli, repo, &argv);
    }
    if let Some(workload) = &cli.failover_cache {
        let mut plan = FailoverCachePlan::new(repo);
        plan.workload = workload.clone();
        plan.profile = cli.profile.clone();
        return match run_until_signal(run_failover_cache(&plan)) {
            Ok(result) => {
                print!("{}", result.render(&plan));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let mut plan = BenchPlan::new(cli.quick, repo.clone());
    if let Some(o) = cli.out {
        plan.out = o;
    }
    if let Some(r) = cli.report {
        plan.report_path = r;
    }
    if let Some(t) = cli.trace {
        plan.trace = t;
    }
    plan.trace = plan.trace.canonicalize().unwrap_or(plan.trace);
    if !cli.render.is_empty() {
        plan.analysis = cli.analysis;
        let twice = if cli.remeasured {
            Twice::LaterReplaces
        } else {
            Twice::Refuse
        };
        return match render_merged(&plan, &cli.render, twice) {
            Ok(report) => {
                eprintln!(
                    "wrote {} from {} load points",
                    plan.report_path.display(),
                    report.runs.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    for p in &cli.policies {
        if !POLICIES.contains(&p.as_str()) {
            return invalid(format!(
                "unknown policy {p:?} (one of {})",
                POLICIES.join(", ")
            ));
        }
    }
    for w in &cli.workloads {
        if !WORKLOADS.contains(&w.as_str()) {
            return invalid(format!(
                "unknown workload {w:?} (one of {})",
                WORKLOADS.join(", ")
            ));
        }
    }
    for c in &cli.clusters {
        if !CLUSTERS.contains(&c.as_str()) {
            return invalid(format!("unknown cluster {c:?} (equal, mixed)"));
        }
    }
    if cli.loads.iter().any(|l| !l.is_finite() || *l <= 0.0) {
        return invalid("--loads wants shares of nominal capacity > 0, e.g. 0.3,0.9,1.5".into());
    }
    if cli.requests == Some(0) {
        return invalid("--requests wants at least 1".into());
    }
    plan.policies = cli.policies;
    plan.workloads = cli.workloads;
    plan.clusters = cli.clusters;
    if !cli.loads.is_empty() {
        plan.loads = cli.loads;
    }
    if let Some(n) = cli.requests {
        plan.requests = n;
    }
    if let Some(n) = cli.burst_rounds {
        plan.burst_rounds = n;
    }
    plan.worker_max_concurrency = cli.worker_max_concurrency;
    if let Some(d) = cli.chat_prompt {
        plan.chat_prompt = d;
    }
    if let Some(d) = cli.chat_output {
        plan.chat_output = d;
    }
    plan.skip_overhead = cli.skip_overhead;
    plan.analysis = cli.analysis;
    plan.command = format!(
        "cargo build --release --bins && cargo build --release -p metronome-dispatcher --example dispatch_bench\ncargo run --release -p metronome-bench --{}{}",
        if argv.is_empty() { "" } else { " " },
        argv.join(" ")
    );
    for (what, path) in [("trace", &plan.trace), ("./dev", &repo.join("dev"))] {
        if !path.exists() {
            eprintln!("error: {what} not found at {}", path.display());
            return ExitCode::from(2);
        }
    }
    let result = run_until_signal(async { run_bench(&plan).await.map(|_| ()) });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn fairness(cli: &Cli, repo: PathBuf, argv: &[String]) -> ExitCode {
    let mut plan = FairnessPlan::new(repo);
    if let Some(o) = &cli.out {
        plan.out = o.join("fairness");
    }
    if let Some(r) = &cli.report {
        plan.report_path = r.clone();
    }
    if let Some(s) = cli.phase_seconds {
        if !(s.is_finite() && s >= 5.0) {
            return invalid("--phase-seconds wants at least 5".into());
        }
        plan.phase_s = s;
    }
    if let Some(g) = cli.gpus {
        if !(1..=64).contains(&g) {
            return invalid("--gpus wants 1..64".into());
        }
        plan.gpus = g;
    }
    plan.profile = cli.profile.clone();
    if let Some(d) = cli.chat_prompt {
        plan.prompt = d;
    }
    if let Some(d) = cli.chat_output {
        plan.output = d;
    }
    plan.command = format!(
        "cargo build --release --bins && cargo run --release -p metronome-bench -- {}",
        argv.join(" ")
    );
    let result = run_until_signal(run_fairness(&plan));
    match result {
        Ok(verdicts) if verdicts.iter().all(|v| v.3) => ExitCode::SUCCESS,
        Ok(verdicts) => {
            for (what, figure, bound, _) in verdicts.iter().filter(|v| !v.3) {
                eprintln!("missed: {what}: {figure} (target {bound})");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `work` on a new runtime until it ends or SIGINT/SIGTERM arrives. On a signal the
/// future is dropped, and with it every running System, whose Drop sends SIGTERM to its
/// `./dev up`.
fn run_until_signal<T>(
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        tokio::select! {
            r = work => r,
            _ = shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
        }
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
