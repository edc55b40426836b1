//! `metronome-bench`: the one-command predictability benchmark. Parses flags, builds the
//! [`BenchPlan`], runs it and writes `BENCHMARKS.md`; everything else lives in
//! `metronome_loadgen::bench`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_loadgen::bench::{run_bench, BenchPlan, POLICIES};
use metronome_loadgen::LengthDist;
use tracing_subscriber::EnvFilter;

/// Compares Metronome with conventional balancers on 4 simulated GPUs (one at half speed).
///
/// Builds nothing: run `cargo build --release --bins` (and, for the dispatcher figure,
/// `cargo build --release -p metronome-dispatcher --example dispatch_bench`) first. Needs
/// nats-server and redis-server on PATH. Starts a fresh `./dev up` per policy, measures
/// capacity, replays the trace at 50/70/90 % of it per policy, a Poisson run at 70 %, the
/// burst case, and the overhead runs with a zero-delay simulator; writes BENCHMARKS.md and
/// bench-results/ (CSV, JSON, SVG plots per run). See docs/BENCHMARKING.md.
///
/// Examples:
///   metronome-bench --quick                      # a few minutes, reduced scale
///   metronome-bench                              # full scale (about 1.5 hours on 2 cores)
///   metronome-bench --quick --policies metronome,least_connections --skip-overhead
#[derive(Debug, Parser)]
#[command(name = "metronome-bench", version, verbatim_doc_comment)]
struct Cli {
    /// Reduced scale: fewer requests per run, fewer burst rounds, shorter overhead runs.
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
    /// Loads as fractions of the measured capacity, comma-separated [default: 0.5,0.7,0.9].
    #[arg(long, value_delimiter = ',')]
    loads: Vec<f64>,
    /// Requests per load run (the first N of the trace) [default: 40 quick, 150 full].
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Burst rounds per policy [default: 20 quick, 50 full].
    #[arg(long, value_name = "N")]
    burst_rounds: Option<usize>,
    /// WORKER_MAX_CONCURRENCY for every worker-agent: high, so the baselines hand every job
    /// to the model server at once as conventional balancers do [default: 32].
    #[arg(long, value_name = "N", default_value_t = 32)]
    worker_max_concurrency: u32,
    /// Poisson prompt length distribution [default: lognormal:mean=800,sigma=1,max=7000].
    #[arg(long, value_name = "DIST")]
    poisson_prompt: Option<LengthDist>,
    /// Poisson output length distribution [default: lognormal:mean=120,sigma=0.8,max=1000].
    #[arg(long, value_name = "DIST")]
    poisson_output: Option<LengthDist>,
    /// Skip the capacity search and use these capacities: TRACE,POISSON in req/s (for
    /// quick comparisons while tuning; the report says they were given).
    #[arg(long, value_delimiter = ',', value_name = "TRACE,POISSON")]
    capacity: Vec<f64>,
    /// Skip the zero-delay overhead runs and the dispatcher benchmark.
    #[arg(long)]
    skip_overhead: bool,
    /// Markdown file whose text becomes the report's analysis section (else a factual
    /// summary of targets met and missed is generated).
    #[arg(long, value_name = "FILE")]
    analysis: Option<PathBuf>,
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
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
    plan.policies = cli.policies;
    if !cli.loads.is_empty() {
        plan.loads = cli.loads;
    }
    if let Some(n) = cli.requests {
        plan.run_requests = n;
    }
    if let Some(n) = cli.burst_rounds {
        plan.burst_rounds = n;
    }
    plan.worker_max_concurrency = Some(cli.worker_max_concurrency);
    if let Some(d) = cli.poisson_prompt {
        plan.poisson_prompt = d;
    }
    if let Some(d) = cli.poisson_output {
        plan.poisson_output = d;
    }
    plan.skip_overhead = cli.skip_overhead;
    match cli.capacity[..] {
        [] => {}
        [t, p] if t > 0.0 && p > 0.0 => plan.given_capacity = Some((t, p)),
        _ => {
            eprintln!("error: --capacity wants two rates > 0: TRACE,POISSON");
            return ExitCode::from(2);
        }
    }
    plan.analysis = cli.analysis;
    plan.command = format!(
        "cargo build --release --bins && cargo build --release -p metronome-dispatcher --example dispatch_bench\ncargo run --release -p metronome-loadgen --bin metronome-bench --{}{}",
        if argv.is_empty() { "" } else { " " },
        argv.join(" ")
    );
    for (what, path) in [("trace", &plan.trace), ("./dev", &repo.join("dev"))] {
        if !path.exists() {
            eprintln!("error: {what} not found at {}", path.display());
            return ExitCode::from(2);
        }
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // SIGINT/SIGTERM: dropping the future drops every running System, whose Drop sends
    // SIGTERM to its ./dev up.
    let result = rt.block_on(async {
        tokio::select! {
            r = run_bench(&plan) => r.map(|_| ()),
            _ = shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
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
