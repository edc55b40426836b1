//! `metronome-gpu-sim`: serve one or more simulated GPUs until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use metronome_gpu_sim::config::{parse_specs, Settings};
use metronome_gpu_sim::SimConfig;
use metronome_runtime::config::apply_overrides;
use metronome_runtime::settings::SettingFlags;

/// Simulated GPUs: OpenAI-compatible model servers that behave like vLLM on one GPU each.
///
/// Example: metronome-gpu-sim --gpu model=llama-3.1-8b,port=8001 --gpu model=llama-3.1-8b,port=8002,speed=0.5 --seed 42
///
/// GPU spec keys (same as a [[gpu]] table in the TOML config): model, host, port, speed,
/// seed, base_step_ms, alpha, prefill_ms_per_token, kv_read_ms_per_token,
/// kv_capacity_tokens, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
/// default_max_tokens, eos_probability. Each flag below can also be given by its environment
/// variable (METRONOME_SIM_GPUS: specs separated by ';'); RUST_LOG sets the log filter.
#[derive(Parser, Debug)]
#[command(name = "metronome-gpu-sim", version, verbatim_doc_comment)]
struct Cli {
    /// TOML config file with a [[gpu]] table per simulated GPU.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// A simulated GPU as key=value pairs; repeat for several. Replaces the config file's GPUs.
    #[arg(
        long = "gpu",
        value_name = "SPEC",
        env = metronome_gpu_sim::config::ENV_GPUS,
        value_delimiter = ';'
    )]
    gpus: Vec<String>,
    #[command(flatten)]
    settings: SettingFlags<Settings>,
    /// Validate the configuration, print the effective config and exit (2 on errors).
    #[arg(long)]
    check_config: bool,
}

fn load(cli: &Cli) -> anyhow::Result<SimConfig> {
    let mut config = match &cli.config {
        Some(path) => SimConfig::from_file(path)?,
        None => SimConfig::default(),
    };
    // The flags carry their environment variables (clap reads them).
    if !cli.gpus.is_empty() {
        config.gpu = parse_specs(cli.gpus.iter().map(String::as_str))?;
    }
    apply_overrides(&mut config, cli.settings.overrides.clone())?;
    Ok(config)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(errors) = config.validate() {
        for e in &errors {
            eprintln!("config error: {e}");
        }
        return ExitCode::from(2);
    }
    if cli.check_config {
        match toml::to_string_pretty(&config.effective()) {
            Ok(text) => {
                print!("{text}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("error: cannot print config: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let _tracing = metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);
    match serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "metronome-gpu-sim failed");
            ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn serve(config: SimConfig) -> anyhow::Result<()> {
    let shutdown = metronome_runtime::shutdown_on_signals(|| {
        tracing::info!("shutdown signal received, stopping simulated GPUs")
    });
    metronome_gpu_sim::run(config, shutdown)
        .await
        .context("simulated GPUs")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `--help` lists exactly the variables the configuration loader reads, each on the
    /// flag of its key.
    #[test]
    fn help_and_the_configuration_loader_agree() {
        metronome_runtime::settings::assert_help_and_loader_agree(
            &mut Cli::command(),
            &metronome_gpu_sim::config::SETTINGS,
            |lookup| {
                let _ = SimConfig::default().apply_env(lookup);
            },
        );
    }
}
