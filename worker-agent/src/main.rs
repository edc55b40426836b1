//! `metronome-worker-agent`: parse the command line, load and check the configuration,
//! start tracing, run the agent until SIGINT/SIGTERM, then drain.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_worker_agent::{run, Config};

/// Runs the jobs the Metronome dispatcher assigns to one GPU/model instance.
///
/// Configuration comes from `--config FILE` (TOML), then the environment: NATS_URL,
/// REDIS_URL, METRONOME_WORKER_ID, METRONOME_WORKER_MODEL,
/// METRONOME_WORKER_MODEL_SERVER_URL, METRONOME_WORKER_MAX_CONCURRENCY,
/// METRONOME_WORKER_METRICS_PORT, then the flags below. SIGTERM or Ctrl-C drains: the
/// agent stops taking work, finishes what runs, and leaves the worker registry.
#[derive(Debug, Parser)]
#[command(name = "metronome-worker-agent", version)]
struct Cli {
    /// TOML configuration file (every key is optional; see `--check-config` output).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration, print the effective values and exit (2 on errors).
    #[arg(long)]
    check_config: bool,
    /// Worker id, a subject-safe token such as `node1-gpu0`.
    #[arg(long)]
    worker_id: Option<String>,
    /// Model name the model server has loaded.
    #[arg(long)]
    model: Option<String>,
    /// Base URL of the model server, e.g. http://127.0.0.1:8001.
    #[arg(long)]
    model_server_url: Option<String>,
    /// vllm | sglang | simulator | llamacpp | tgi.
    #[arg(long)]
    model_server_kind: Option<String>,
    /// GPU index on this host (NVML device).
    #[arg(long)]
    gpu_index: Option<u32>,
    /// Most jobs run at once.
    #[arg(long)]
    max_concurrency: Option<u32>,
    /// Port of the agent's own /metrics endpoint (0 = any free port).
    #[arg(long)]
    metrics_port: Option<u16>,
}

fn load(cli: &Cli) -> Result<Config, String> {
    let mut config = match &cli.config {
        Some(path) => Config::from_file(path).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    config
        .apply_env(|k| std::env::var(k).ok())
        .map_err(|e| e.to_string())?;
    if let Some(v) = &cli.worker_id {
        config.worker_id = v.clone();
    }
    if let Some(v) = &cli.model {
        config.model = v.clone();
    }
    if let Some(v) = &cli.model_server_url {
        config.model_server_url = v.clone();
    }
    if let Some(v) = &cli.model_server_kind {
        config.model_server_kind = toml::Value::String(v.clone()).try_into().map_err(|_| {
            format!("--model-server-kind {v:?}: expected vllm, sglang, simulator, llamacpp or tgi")
        })?;
    }
    if let Some(v) = cli.gpu_index {
        config.gpu_index = Some(v);
    }
    if let Some(v) = cli.max_concurrency {
        config.max_concurrency = v;
    }
    if let Some(v) = cli.metrics_port {
        config.metrics_port = Some(v);
    }
    Ok(config)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(errors) = config.validate() {
        return metronome_runtime::report_invalid_config("", &errors);
    }
    if cli.check_config {
        // A closed pipe (`| head`) is not an error worth a panic.
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), "{}", config.to_toml());
        return ExitCode::SUCCESS;
    }

    metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shutdown =
            metronome_runtime::shutdown_on_signals(|| tracing::info!("signal received: draining"));
        match run(config, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, retryable = e.is_retryable(), "worker-agent failed");
                ExitCode::FAILURE
            }
        }
    })
}
