//! `metronome`: parse the command line, run one command, map its error to an exit code.

use std::process::ExitCode;

use clap::Parser;
use metronome_cli::Cli;

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    cli.nats_auth = metronome_runtime::nats::NatsAuth::from_env(|k| std::env::var(k).ok());
    cli.redis_tls.apply_env(|k| std::env::var(k).ok());
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("metronome: cannot start the runtime: {e}");
            return ExitCode::from(3);
        }
    };
    let mut stdout = std::io::stdout();
    match runtime.block_on(metronome_cli::run(cli, &mut stdout)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(metronome_cli::CliError::OutputClosed) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metronome: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
