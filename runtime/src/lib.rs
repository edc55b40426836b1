//! Process plumbing shared by Metronome's thin binaries (`metronome-dispatcher`,
//! `metronome-gateway`, `metronome-worker-agent`, `metronome-gpu-sim`,
//! `metronome-loadgen`):
//!
//! - [`init_tracing`]: the log subscriber, filtered by `RUST_LOG` (default `info`);
//! - [`shutdown_on_signals`] / [`cancel_on_signals`]: SIGINT (Ctrl-C) or SIGTERM cancels a
//!   [`CancellationToken`] that the binary's `run` watches;
//! - [`report_invalid_config`]: the `invalid configuration:` report, one indented line per
//!   field error, and exit code 2;
//! - [`nats`]: NATS credentials and TLS ([`nats::NatsAuth`]), read the same way by every
//!   binary and turned into `async_nats::ConnectOptions`.
//!
//! Nothing here reads configuration or decides policy; each binary keeps its own flags,
//! messages and exit codes and only calls these helpers.

pub mod nats;

use std::fmt::Display;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Where [`init_tracing`] writes log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogOutput {
    /// Standard output (tracing-subscriber's default).
    Stdout,
    /// Standard error, for binaries whose stdout carries results (the load generator's
    /// summary table).
    Stderr,
}

/// Installs the global `tracing` subscriber: human-readable lines on `output`, filtered by
/// `RUST_LOG` when it is set and valid, at `info` otherwise.
///
/// # Panics
///
/// When a global subscriber is already installed (call it once, from `main`).
pub fn init_tracing(output: LogOutput) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match output {
        LogOutput::Stdout => builder.init(),
        LogOutput::Stderr => builder.with_writer(std::io::stderr).init(),
    }
}

/// Returns a token that is cancelled on the first SIGINT (Ctrl-C) or SIGTERM, after calling
/// `on_signal` once (the binary logs its own "shutting down" line there, so the line keeps
/// the binary's target and level).
///
/// Spawns the listener with [`tokio::spawn`], so it must be called inside a Tokio runtime.
pub fn shutdown_on_signals(on_signal: impl FnOnce() + Send + 'static) -> CancellationToken {
    let token = CancellationToken::new();
    tokio::spawn(cancel_on_signals(token.clone(), on_signal));
    token
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM, calls `on_signal` once, then cancels `token`.
///
/// If SIGTERM cannot be listened for, logs a warning and waits for Ctrl-C alone.
pub async fn cancel_on_signals(token: CancellationToken, on_signal: impl FnOnce()) {
    wait_for_signal().await;
    on_signal();
    token.cancel();
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Prints `{prefix}invalid configuration:` and then every error on its own line, indented
/// by two spaces, to stderr; returns exit code 2, the binaries' code for a bad
/// configuration.
pub fn report_invalid_config<E: Display>(prefix: &str, errors: &[E]) -> ExitCode {
    eprintln!("{}", invalid_config_message(prefix, errors));
    ExitCode::from(2)
}

fn invalid_config_message<E: Display>(prefix: &str, errors: &[E]) -> String {
    let mut text = format!("{prefix}invalid configuration:");
    for e in errors {
        text.push_str("\n  ");
        text.push_str(&e.to_string());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_config_lists_every_error_indented() {
        assert_eq!(
            invalid_config_message("metronome-x: ", &["a: bad", "b: worse"]),
            "metronome-x: invalid configuration:\n  a: bad\n  b: worse"
        );
        assert_eq!(
            invalid_config_message::<&str>("", &[]),
            "invalid configuration:"
        );
    }

    #[tokio::test]
    async fn token_stays_live_without_a_signal() {
        // The listener only cancels on a signal; without one the token stays live.
        let token = shutdown_on_signals(|| {});
        tokio::task::yield_now().await;
        assert!(!token.is_cancelled());
    }
}
