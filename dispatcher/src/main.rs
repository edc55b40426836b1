//! `metronome-dispatcher`: parse the command line, load the configuration, start tracing
//! and run the dispatcher until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_dispatcher::Config;

/// Metronome's dispatcher: admits, scores, reserves and assigns every job on
/// `jobs.submit` to one GPU worker, and publishes each decision on `decisions.<job_id>`.
/// Run several: one leads, the others stand by and take over when it dies.
#[derive(Parser, Debug)]
#[command(name = "metronome-dispatcher", version, about, long_about = None)]
struct Cli {
    /// TOML configuration file (every key is optional; see dispatcher/README.md).
    /// NATS_URL, REDIS_URL, METRONOME_DISPATCHER_ID, METRONOME_POLICY and
    /// METRONOME_METRICS_ADDR override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Validate the configuration, print the effective configuration and exit (0 when
    /// valid, 2 with every field error otherwise).
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let lookup = |k: &str| std::env::var(k).ok();
    let config = match cli.config.as_deref() {
        Some(p) => Config::from_file(p),
        None => Ok(Config::default()),
    }
    .and_then(|mut c| c.apply_env(lookup).map(|()| c));
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
