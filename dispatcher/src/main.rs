//! `metronome-dispatcher`: parse the command line, load the configuration, start tracing
//! and run the dispatcher until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_dispatcher::{Config, ConfigError};
use tokio_util::sync::CancellationToken;

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
        eprintln!("metronome-dispatcher: {}", ConfigError::Invalid(errors));
        return ExitCode::from(2);
    }
    if cli.check_config {
        match toml::to_string_pretty(&config) {
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
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
        let shutdown = CancellationToken::new();
        tokio::spawn(wait_for_signal(shutdown.clone()));
        match metronome_dispatcher::run(config, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "dispatcher failed");
                ExitCode::FAILURE
            }
        }
    })
}

async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            shutdown.cancel();
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
}
