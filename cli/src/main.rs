//! `metronome`: parse the command line, run one command, map its error to an exit code.

use std::process::ExitCode;

use clap::Parser;
use metronome_cli::Cli;

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    if let Err(e) = cli.apply_environment(&|k| std::env::var(k).ok()) {
        eprintln!("metronome: {e}");
        return ExitCode::from(e.exit_code());
    }
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
