//! `metronome-worker-agent`: parse the command line, load and check the configuration,
//! start tracing, run the agent until SIGINT/SIGTERM, then drain.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_runtime::config::{apply_overrides, file_or_default};
use metronome_runtime::settings::SettingFlags;
use metronome_worker_agent::config::Settings;
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
    #[command(flatten)]
    settings: SettingFlags<Settings>,
}

fn load(cli: &Cli) -> Result<Config, String> {
    let mut config: Config = file_or_default(cli.config.as_deref()).map_err(|e| e.to_string())?;
    // File, then the environment (`METRONOME_NATS_*`, `METRONOME_REDIS_*` and the
    // variables of `config::SETTINGS`), then flags: the order every binary uses.
    config
        .apply_env(|k| std::env::var(k).ok())
        .map_err(|e| e.to_string())?;
    apply_overrides(&mut config, cli.settings.overrides.clone()).map_err(|e| e.to_string())?;
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

    let _tracing = metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);

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

    /// `--help` lists exactly the variables the configuration loader reads, each on the
    /// flag of its key.
    #[test]
    fn help_and_the_configuration_loader_agree() {
        metronome_runtime::settings::assert_help_and_loader_agree(
            &mut Cli::command(),
            &metronome_worker_agent::config::SETTINGS,
            |lookup| {
                let _ = Config::default().apply_env(lookup);
            },
        );
    }

    /// A flag sets its key, and the override names the flag.
    #[test]
    fn a_flag_overrides_its_key() {
        let cli = Cli::try_parse_from(["metronome-worker-agent", "--gpu-index", "3"]).unwrap();
        let o = &cli.settings.overrides[0];
        assert_eq!(
            (o.origin.as_str(), o.key.as_str(), o.value.as_str()),
            ("--gpu-index", "gpu_index", "3")
        );
    }
}
