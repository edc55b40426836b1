//! `metronome-worker-agent`: parse the command line, load and check the configuration,
//! start tracing, run the agent until SIGINT/SIGTERM, then drain.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_runtime::config::{apply_overrides, file_or_default, Override};
use metronome_worker_agent::{run, Config};

/// Runs the jobs the Metronome dispatcher assigns to one GPU/model instance.
///
/// Configuration comes from `--config FILE` (TOML), then the flags below or their
/// environment variables. SIGTERM or Ctrl-C drains: the agent stops taking work, finishes
/// what runs, and leaves the worker registry.
#[derive(Debug, Parser)]
#[command(name = "metronome-worker-agent", version)]
struct Cli {
    /// TOML configuration file (every key is optional; see `--check-config` output).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration, print the effective values and exit (2 on errors).
    #[arg(long)]
    check_config: bool,
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", value_name = "URL")]
    nats_url: Option<String>,
    /// Redis URL for the EWMAs and the performance-model state.
    #[arg(long, env = "REDIS_URL", value_name = "URL")]
    redis_url: Option<String>,
    /// Worker id, a subject-safe token such as `node1-gpu0`.
    #[arg(long, env = "METRONOME_WORKER_ID")]
    worker_id: Option<String>,
    /// Model name the model server has loaded.
    #[arg(long, env = "METRONOME_WORKER_MODEL")]
    model: Option<String>,
    /// Base URL of the model server, e.g. http://127.0.0.1:8001.
    #[arg(long, env = "METRONOME_WORKER_MODEL_SERVER_URL")]
    model_server_url: Option<String>,
    /// vllm | sglang | simulator | llamacpp | tgi.
    #[arg(long)]
    model_server_kind: Option<String>,
    /// GPU index on this host (NVML device).
    #[arg(long)]
    gpu_index: Option<u32>,
    /// Most jobs run at once.
    #[arg(long, env = "METRONOME_WORKER_MAX_CONCURRENCY")]
    max_concurrency: Option<u32>,
    /// Port of the agent's own /metrics endpoint (0 = any free port).
    #[arg(long, env = "METRONOME_WORKER_METRICS_PORT")]
    metrics_port: Option<u16>,
}

impl Cli {
    /// The flags given (or read from their environment variables), each as an override of
    /// its configuration key.
    fn overrides(&self) -> Vec<Override> {
        let flags: [(&str, &str, Option<String>); 9] = [
            ("--nats-url", "nats_url", self.nats_url.clone()),
            ("--redis-url", "redis_url", self.redis_url.clone()),
            ("--worker-id", "worker_id", self.worker_id.clone()),
            ("--model", "model", self.model.clone()),
            (
                "--model-server-url",
                "model_server_url",
                self.model_server_url.clone(),
            ),
            (
                "--model-server-kind",
                "model_server_kind",
                self.model_server_kind.clone(),
            ),
            (
                "--gpu-index",
                "gpu_index",
                self.gpu_index.map(|v| v.to_string()),
            ),
            (
                "--max-concurrency",
                "max_concurrency",
                self.max_concurrency.map(|v| v.to_string()),
            ),
            (
                "--metrics-port",
                "metrics_port",
                self.metrics_port.map(|v| v.to_string()),
            ),
        ];
        flags
            .into_iter()
            .filter_map(|(flag, key, v)| v.map(|v| Override::flag(flag, key, v)))
            .collect()
    }
}

fn load(cli: &Cli) -> Result<Config, String> {
    let mut config: Config = file_or_default(cli.config.as_deref()).map_err(|e| e.to_string())?;
    // File, then the environment (`METRONOME_NATS_*`, `METRONOME_REDIS_*` and the keys of
    // `config::ENV`), then flags: the order every binary uses.
    config
        .apply_env(|k| std::env::var(k).ok())
        .map_err(|e| e.to_string())?;
    apply_overrides(&mut config, cli.overrides()).map_err(|e| e.to_string())?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every environment variable the configuration knows is a flag, so `--help` lists it,
    /// and the flag sets the same key.
    #[test]
    fn every_environment_variable_is_a_flag_for_its_key() {
        let command = Cli::command();
        for var in metronome_worker_agent::config::ENV {
            let arg = command
                .get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == var.var))
                .unwrap_or_else(|| panic!("{} is not declared on a flag", var.var));
            let flag = format!("--{}", arg.get_long().unwrap());
            let cli = Cli::try_parse_from(["metronome-worker-agent", &flag, "7"]).unwrap();
            let set = cli.overrides().into_iter().find(|o| o.origin == flag);
            assert_eq!(
                set.map(|o| (o.key, o.value)),
                Some((var.key.into(), "7".into()))
            );
        }
    }
}
