//! `metronome-gateway`: parse the command line, load the configuration, start tracing,
//! serve until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use metronome_gateway::Config;

/// Metronome's OpenAI-compatible HTTP gateway.
///
/// Serves POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models,
/// /healthz, /readyz and /metrics, and turns each request into a job on NATS JetStream.
/// Environment: NATS_URL overrides nats_url, METRONOME_GATEWAY_LISTEN overrides listen,
/// RUST_LOG sets the log filter (default info).
#[derive(Debug, Parser)]
#[command(name = "metronome-gateway", version)]
struct Args {
    /// TOML configuration file (every key is optional; defaults otherwise).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration, print the effective configuration and exit (0 when
    /// valid, 2 with every field error otherwise).
    #[arg(long)]
    check_config: bool,
    /// Listen address, overriding the file and the environment (e.g. 0.0.0.0:8080).
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut config = match Config::load(args.config.as_deref(), |k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("metronome-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Err(errors) = config.validate() {
        return metronome_runtime::report_invalid_config("metronome-gateway: ", &errors);
    }
    if args.check_config {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    }
    metronome_runtime::init_tracing(metronome_runtime::LogOutput::Stdout);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("metronome-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shutdown = metronome_runtime::shutdown_on_signals(|| {
            tracing::info!("shutdown requested; finishing in-flight requests")
        });
        match metronome_gateway::run(config, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "gateway failed");
                ExitCode::FAILURE
            }
        }
    })
}
