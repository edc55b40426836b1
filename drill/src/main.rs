//! `metronome-drill`: fault drills against a real system under load; writes RELIABILITY.md
//! and exits non-zero when a drill lost or duplicated a job. Everything else lives in
//! `metronome_drill`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use metronome_drill::{render_report, run_drills, DrillPlan, Fault};
use tracing_subscriber::EnvFilter;

/// Fault drills: SIGKILL the leader (alone, and together with a second agent's SIGKILL
/// while a first one is SIGSTOPped), SIGKILL + restart a worker-agent, SIGSTOP an agent,
/// Redis down, nats-server restart, SIGKILL both dispatchers, SIGKILL a model server, a
/// rolling deploy of every process, a flood of hostile messages, a flood of chat requests
/// through the gateway, one worker's credentials in an attacker's hands — each under load on one `./dev up --keep-going`
/// system, every job accounted for by id — and SIGKILL the NATS node leading the JOBS
/// stream, on a second system with a 3-node NATS cluster (`--nats-cluster 3`, R3).
///
/// Builds nothing: build the binaries of the chosen profile first
/// (`cargo build --bins`, or `--release`). Needs nats-server and redis-server on PATH.
///
/// Examples:
///   metronome-drill                     # full: 30 s of load per drill, 10 s SIGSTOP and model-server outage, 30 s Redis outage
///   metronome-drill --short --report short.md     # CI size (under 2 minutes)
#[derive(Debug, Parser)]
#[command(name = "metronome-drill", version, verbatim_doc_comment)]
struct Cli {
    /// CI size: 8 s of load per drill, 3 s SIGSTOP, model-server, Redis and NATS-node outage.
    #[arg(long)]
    short: bool,
    /// Where to write the report [default: <repo>/RELIABILITY.md].
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Repository root (holds ./dev and target/<profile>) [default: where this was built from].
    #[arg(long, value_name = "DIR")]
    repo: Option<PathBuf>,
    /// Build profile whose binaries run.
    #[arg(long, default_value = "debug")]
    profile: String,
    /// Simulated GPUs.
    #[arg(long, default_value_t = 3)]
    gpus: usize,
    /// Jobs per second offered during each drill [default: 10 short, 20 full].
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of load per drill [default: 8 short, 30 full]: with `--rate`, how many jobs
    /// a drill sends (e.g. `--only kill-leader --rate 50 --load-secs 200`: 10,000 jobs).
    #[arg(long, value_name = "SECS")]
    load_secs: Option<u64>,
    /// Drills not to run, comma-separated (kill-leader, kill-leader-amid-faults,
    /// restart-agent, stop-agent,
    /// redis-down, restart-nats, kill-dispatchers, stop-model-server, rolling-deploy,
    /// hostile, gateway-flood, compromised-worker, kill-nats-leader).
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
    /// Run only these drills, comma-separated, in the usual order.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Hostile messages the `hostile` drill publishes [default: 5000 short, 100000 full].
    #[arg(long, value_name = "N")]
    hostile_messages: Option<usize>,
    /// Seed of the hostile messages (the same seed sends the same messages).
    #[arg(long, default_value_t = 9)]
    hostile_seed: u64,
    /// Most hostile messages per second [default: 1000 short, 1500 full].
    #[arg(long, value_name = "PER_S")]
    hostile_rate: Option<f64>,
    /// Requests the `gateway-flood` drill sends [default: 2000 short, 10000 full].
    #[arg(long, value_name = "N")]
    flood_requests: Option<usize>,
    /// How many of them are in flight at once [default: 2000].
    #[arg(long, value_name = "N", default_value_t = 2_000)]
    flood_concurrency: usize,
    /// kill-nats-leader: the killed node also leads the dispatchers' lease bucket (by
    /// default another node does, so the leader decides through the failover).
    #[arg(long)]
    nats_lease_on_killed_node: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let repo = cli.repo.unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the drill crate sits in the repository")
            .to_path_buf()
    });
    let (load, pause, redis_outage, rate) = if cli.short {
        (8, 3, 3, cli.rate.unwrap_or(10.0))
    } else {
        (30, 10, 30, cli.rate.unwrap_or(20.0))
    };
    let load = cli.load_secs.unwrap_or(load).max(1);
    let names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
    if let Some(unknown) = cli
        .skip
        .iter()
        .chain(&cli.only)
        .find(|s| !names.contains(&s.as_str()))
    {
        eprintln!(
            "metronome-drill: {unknown:?} is not a drill ({})",
            names.join(", ")
        );
        return ExitCode::from(2);
    }
    let faults: Vec<Fault> = Fault::ALL
        .into_iter()
        .filter(|f| !cli.skip.iter().any(|s| s == f.name()))
        .filter(|f| cli.only.is_empty() || cli.only.iter().any(|s| s == f.name()))
        .collect();
    let secs = Duration::from_secs;
    let command = std::env::args()
        .map(|a| a.rsplit('/').next().unwrap_or(&a).to_string())
        .collect::<Vec<_>>()
        .join(" ");
    let plan = DrillPlan {
        repo: repo.clone(),
        profile: cli.profile,
        gpus: cli.gpus.max(2),
        rate,
        load: secs(load),
        pause: secs(pause),
        redis_outage: secs(redis_outage),
        settle: Duration::from_secs(if cli.short { 30 } else { 90 }),
        faults,
        hostile_messages: cli
            .hostile_messages
            .unwrap_or(if cli.short { 5_000 } else { 100_000 }),
        hostile_seed: cli.hostile_seed,
        flood_requests: cli
            .flood_requests
            .unwrap_or(if cli.short { 2_000 } else { 10_000 }),
        flood_concurrency: cli.flood_concurrency.max(1),
        hostile_rate: cli
            .hostile_rate
            .unwrap_or(if cli.short { 1_000.0 } else { 1_500.0 }),
        lease_on_killed_node: cli.nats_lease_on_killed_node,
        state_dir: std::env::temp_dir().join(format!("metronome-drill-{}", std::process::id())),
        command,
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let reports = match rt.block_on(run_drills(&plan)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("metronome-drill: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let text = render_report(&plan, &reports);
    let path = cli.report.unwrap_or_else(|| repo.join("RELIABILITY.md"));
    if let Err(e) = std::fs::write(&path, &text) {
        eprintln!("metronome-drill: writing {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    print!("{text}");
    if reports.iter().all(|r| r.passed()) {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "metronome-drill: a drill lost or duplicated jobs (see {})",
            path.display()
        );
        ExitCode::FAILURE
    }
}
