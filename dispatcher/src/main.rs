//! `metronome-dispatcher`: parse the command line, load the configuration, start tracing
//! and run the dispatcher until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_dispatcher::config::Settings;
use metronome_dispatcher::Config;
use metronome_runtime::config::{apply_overrides, file_or_default};
use metronome_runtime::settings::SettingFlags;

/// Metronome's dispatcher: admits, scores, reserves and assigns every job on
/// `jobs.submit` to one GPU worker, and publishes each decision on `decisions.<job_id>`.
/// Run several: one leads, the others stand by and take over when it dies.
#[derive(Parser, Debug)]
#[command(name = "metronome-dispatcher", version, about, long_about = None)]
struct Cli {
    /// TOML configuration file (every key is optional; see dispatcher/README.md). The
    /// flags below, or their environment variables, override its keys.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    #[command(flatten)]
    settings: SettingFlags<Settings>,

    /// Validate the configuration, print the effective configuration and exit (0 when
    /// valid, 2 with every field error otherwise).
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // File, then the environment (`METRONOME_NATS_*`, `METRONOME_REDIS_*` and the
    // variables of `config::SETTINGS`), then flags: the order every binary uses.
    let config = file_or_default::<Config>(cli.config.as_deref())
        .and_then(|mut c| c.apply_env(|k| std::env::var(k).ok()).map(|()| c))
        .and_then(|mut c| apply_overrides(&mut c, cli.settings.overrides.clone()).map(|()| c));
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("metronome-dispatcher: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(errors) = config.validate() {
        return metronome_runtime::report_invalid_config("metronome-dispatcher: ", &errors);
    }
    if let Err(error) = config.provisioning() {
        return metronome_runtime::report_invalid_config("metronome-dispatcher: ", &[error]);
    }
    if cli.check_config {
        // Secrets stay out of the output: the NATS password serialises masked, the Redis
        // URL's password is masked here.
        let shown = Config {
            redis_url: metronome_runtime::nats::redact_url(&config.redis_url),
            ..config.clone()
        };
        match toml::to_string_pretty(&shown) {
            Ok(text) => {
                println!("{text}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("metronome-dispatcher: cannot print the configuration: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let _tracing = metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("metronome-dispatcher: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shutdown = metronome_runtime::shutdown_on_signals(|| tracing::info!("shutting down"));
        match metronome_dispatcher::run(config, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "dispatcher failed");
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
            &metronome_dispatcher::config::SETTINGS,
            |lookup| {
                let _ = Config::default().apply_env(lookup);
            },
        );
    }

    /// A flag sets its key, and the override names the flag.
    #[test]
    fn a_flag_overrides_its_key() {
        let cli = Cli::try_parse_from(["metronome-dispatcher", "--policy", "random"]).unwrap();
        let o = &cli.settings.overrides[0];
        assert_eq!(
            (o.origin.as_str(), o.key.as_str(), o.value.as_str()),
            ("--policy", "policy", "random")
        );
    }
}
