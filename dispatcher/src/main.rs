//! `metronome-dispatcher`: parse the command line, load the configuration, start tracing
//! and run the dispatcher until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_dispatcher::Config;
use metronome_runtime::config::{apply_overrides, file_or_default, Override};

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

    /// NATS server URL (key `nats_url`).
    #[arg(long, env = "NATS_URL", value_name = "URL")]
    nats_url: Option<String>,

    /// Redis URL for the EWMAs (key `redis_url`).
    #[arg(long, env = "REDIS_URL", value_name = "URL")]
    redis_url: Option<String>,

    /// Name of this instance in decisions and the lease (key `dispatcher_id`).
    #[arg(long, env = "METRONOME_DISPATCHER_ID", value_name = "ID")]
    dispatcher_id: Option<String>,

    /// Scheduling policy: metronome, round_robin, least_connections, random,
    /// power_of_two or prefix_affinity (key `policy`).
    #[arg(long, env = "METRONOME_POLICY")]
    policy: Option<String>,

    /// Address of the Prometheus /metrics endpoint, host:port (key `metrics_addr`).
    #[arg(long, env = "METRONOME_METRICS_ADDR", value_name = "ADDR")]
    metrics_addr: Option<String>,

    /// The provisioning record: each worker id's model and concurrency ceiling (key
    /// `provisioning_file`).
    #[arg(long, env = "METRONOME_PROVISIONING_FILE", value_name = "FILE")]
    provisioning_file: Option<String>,

    /// Validate the configuration, print the effective configuration and exit (0 when
    /// valid, 2 with every field error otherwise).
    #[arg(long)]
    check_config: bool,
}

impl Cli {
    /// The flags given (or read from their environment variables), as overrides of the
    /// keys of [`metronome_dispatcher::config::ENV`].
    fn overrides(&self) -> Vec<Override> {
        let flags = [
            ("--nats-url", "nats_url", &self.nats_url),
            ("--redis-url", "redis_url", &self.redis_url),
            ("--dispatcher-id", "dispatcher_id", &self.dispatcher_id),
            ("--policy", "policy", &self.policy),
            ("--metrics-addr", "metrics_addr", &self.metrics_addr),
            (
                "--provisioning-file",
                "provisioning_file",
                &self.provisioning_file,
            ),
        ];
        flags
            .into_iter()
            .filter_map(|(flag, key, v)| v.as_ref().map(|v| Override::flag(flag, key, v)))
            .collect()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // File, then the environment (`METRONOME_NATS_*`, `METRONOME_REDIS_*` and the keys
    // of `config::ENV`), then flags: the order every binary uses.
    let config = file_or_default::<Config>(cli.config.as_deref())
        .and_then(|mut c| c.apply_env(|k| std::env::var(k).ok()).map(|()| c))
        .and_then(|mut c| apply_overrides(&mut c, cli.overrides()).map(|()| c));
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
    metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);
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

    /// Every environment variable the configuration knows is a flag, so `--help` lists it,
    /// and the flag sets the same key.
    #[test]
    fn every_environment_variable_is_a_flag_for_its_key() {
        let command = Cli::command();
        for var in metronome_dispatcher::config::ENV {
            let arg = command
                .get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == var.var))
                .unwrap_or_else(|| panic!("{} is not declared on a flag", var.var));
            let flag = format!("--{}", arg.get_long().unwrap());
            let cli = Cli::try_parse_from(["metronome-dispatcher", &flag, "x"]).unwrap();
            let set = cli.overrides().into_iter().find(|o| o.origin == flag);
            assert_eq!(
                set.map(|o| (o.key, o.value)),
                Some((var.key.into(), "x".into()))
            );
        }
    }
}
