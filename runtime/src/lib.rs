//! Process plumbing shared by Metronome's thin binaries (`metronome-dispatcher`,
//! `metronome-gateway`, `metronome-worker-agent`, `metronome-gpu-sim`,
//! `metronome-loadgen`, `metronome-bench`, `metronome-drill`):
//!
//! - [`init_tracing`]: the log subscriber, filtered by `RUST_LOG` (default `info`), human
//!   text or, with `METRONOME_LOG_FORMAT=json`, one JSON object per line ([`LogFormat`]),
//!   and the trace exporter when one is configured ([`otel`]);
//! - [`shutdown_on_signals`] / [`cancel_on_signals`]: SIGINT (Ctrl-C) or SIGTERM cancels a
//!   [`CancellationToken`] that the binary's `run` watches;
//! - [`config`]: loading configuration (TOML file, then environment variables and flags,
//!   each setting one key) and its field error type;
//! - [`retry`]: pauses between retries, exponential with jitter ([`retry::Pauses`]);
//! - [`settings`]: each binary's flags and environment variables, declared once in a table
//!   that both clap and the configuration loader read;
//! - [`report_invalid_config`]: the `invalid configuration:` report, one indented line per
//!   field error, and exit code 2;
//! - [`nats`]: NATS credentials and TLS ([`nats::NatsAuth`]), read the same way by every
//!   binary and turned into `async_nats::ConnectOptions`;
//! - [`redis`]: Redis TLS ([`redis::RedisTls`]) and the client every binary opens with it;
//! - [`tls`]: the CA, certificate and key files both read, checked at start-up;
//! - [`build_info`]: the version and git commit every binary reports on `/metrics`;
//! - [`otel`]: OpenTelemetry trace export (OTLP/HTTP), off unless
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the helpers that carry a `traceparent`
//!   from one process's span to the next one's.
//!
//! Nothing here decides policy; each binary keeps its own configuration struct, checks,
//! flags, messages and exit codes and only calls these helpers.

pub mod build_info;

pub mod config;

pub mod nats;

pub mod otel;

pub mod redis;

pub mod retry;

pub mod settings;

pub mod tls;

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

/// Environment variable choosing the log format: `text` (the default) or `json`.
pub const ENV_LOG_FORMAT: &str = "METRONOME_LOG_FORMAT";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (tracing-subscriber's default format).
    Text,
    /// One JSON object per line, for log shippers: `timestamp`, `level`, `target`, the
    /// event's fields flattened beside `message`, and the fields of every enclosing span
    /// under `spans` (the gateway's and the worker's per-job spans carry `job_id`, the
    /// worker's also `worker_id`), so a job's lines can be found by field, not by text.
    Json,
}

impl LogFormat {
    /// The format named by the value of [`ENV_LOG_FORMAT`] (`None`: unset); an unknown
    /// name is an error naming the accepted ones.
    pub fn parse(value: Option<&str>) -> Result<LogFormat, String> {
        match value.map(str::trim) {
            None | Some("") => Ok(LogFormat::Text),
            Some(v) if v.eq_ignore_ascii_case("text") => Ok(LogFormat::Text),
            Some(v) if v.eq_ignore_ascii_case("json") => Ok(LogFormat::Json),
            Some(v) => Err(format!(
                "{ENV_LOG_FORMAT}={v:?} is not a log format (text or json); writing text"
            )),
        }
    }
}

/// What [`init_tracing`] keeps running: the trace exporter, when one was started. Hold it
/// until the binary ends; dropping it flushes the last spans.
#[must_use = "dropping the guard shuts the trace exporter down"]
pub struct Tracing {
    _export: Option<otel::Export>,
}

/// Installs the global `tracing` subscriber: lines on `output` in the format
/// `METRONOME_LOG_FORMAT` names ([`LogFormat`], text by default), filtered by `RUST_LOG`
/// when it is set and valid, at `info` otherwise; and, when `OTEL_EXPORTER_OTLP_ENDPOINT`
/// is set, the export of Metronome's spans as OpenTelemetry traces ([`otel`]), whatever
/// `RUST_LOG` says.
///
/// # Panics
///
/// When a global subscriber is already installed (call it once, from `main`).
pub fn init_tracing(output: LogOutput) -> Tracing {
    init_tracing_at(output, "info")
}

/// [`init_tracing`] with another filter when `RUST_LOG` is unset (`"warn"` for a tool
/// whose output is its report).
pub fn init_tracing_at(output: LogOutput, default_filter: &str) -> Tracing {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let format = LogFormat::parse(std::env::var(ENV_LOG_FORMAT).ok().as_deref());
    let lines = tracing_subscriber::fmt::layer();
    let lines: Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync> =
        match (&format, output) {
            (Ok(LogFormat::Json), LogOutput::Stdout) => json(lines).boxed(),
            (Ok(LogFormat::Json), LogOutput::Stderr) => {
                json(lines).with_writer(std::io::stderr).boxed()
            }
            (_, LogOutput::Stdout) => lines.boxed(),
            (_, LogOutput::Stderr) => lines.with_writer(std::io::stderr).boxed(),
        };
    let (spans, export, export_error) = match otel::start(|k| std::env::var(k).ok()) {
        Ok(Some((layer, export))) => (Some(layer), Some(export), None),
        Ok(None) => (None, None, None),
        Err(e) => (None, None, Some(e)),
    };
    // Only spans (events stay in the log lines) of Metronome's own crates, from `info` up:
    // the per-request spans, not the dependencies' internals.
    let spans = spans.map(|layer| {
        layer.with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            meta.is_span()
                && *meta.level() <= tracing::Level::INFO
                && meta.target().starts_with("metronome")
        }))
    });
    tracing_subscriber::registry()
        .with(lines.with_filter(filter))
        .with(spans)
        .init();
    if let Err(message) = format {
        tracing::warn!("{message}");
    }
    if let Some(error) = export_error {
        tracing::warn!(%error, "traces are not exported");
    }
    Tracing { _export: export }
}

fn json<S>(
    layer: tracing_subscriber::fmt::Layer<S>,
) -> tracing_subscriber::fmt::Layer<
    S,
    tracing_subscriber::fmt::format::JsonFields,
    tracing_subscriber::fmt::format::Format<tracing_subscriber::fmt::format::Json>,
> {
    layer
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(true)
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

    #[test]
    fn log_format_is_text_unless_json_is_named() {
        assert_eq!(LogFormat::parse(None), Ok(LogFormat::Text));
        assert_eq!(LogFormat::parse(Some("")), Ok(LogFormat::Text));
        assert_eq!(LogFormat::parse(Some("text")), Ok(LogFormat::Text));
        assert_eq!(LogFormat::parse(Some("JSON")), Ok(LogFormat::Json));
        assert_eq!(LogFormat::parse(Some(" json ")), Ok(LogFormat::Json));
        let err = LogFormat::parse(Some("yaml")).unwrap_err();
        assert!(
            err.contains("METRONOME_LOG_FORMAT") && err.contains("json"),
            "{err}"
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
