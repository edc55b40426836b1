//! Errors of the load generator. Per-request failures are *not* errors of the run: they are
//! recorded in the request's [`crate::RequestRecord`] (with [`crate::ErrorKind`]) and
//! counted in the summary. These enums are for things that stop a run from starting or
//! its outputs from being written.

/// A trace file could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("trace line {line}: {reason} (line: {content:?})")]
    Line {
        line: usize,
        reason: String,
        content: String,
    },
    #[error("trace has no requests")]
    Empty,
}

pub use metronome_runtime::config::FieldError;

/// Why a load run could not start or finish writing its outputs.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid load spec: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw plot {path}: {reason}")]
    Plot { path: String, reason: String },
    #[error("cannot read config {path}: {reason}")]
    Config { path: String, reason: String },
}
