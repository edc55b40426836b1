//! The CLI's errors, each with the exit code a script can act on.

use metronome_readmodel::ReadError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CliError {
    #[error("cannot connect to NATS at {url}: {message} (set NATS_URL or --nats-url)")]
    Connect { url: String, message: String },
    #[error("NATS: {0}")]
    Nats(String),
    #[error("Redis: {0} (the EWMA columns need --redis-url / REDIS_URL)")]
    Redis(String),
    #[error("cannot decode {what}: {message}")]
    Decode { what: String, message: String },
    /// The thing asked about does not exist (an unknown job id, an unknown worker).
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Usage(String),
    /// A wait (`drain --wait`) ran out of time.
    #[error("{0}")]
    TimedOut(String),
}

impl CliError {
    /// 1: not found (a script's "no such job", "no such worker"); 2: bad usage; 3: the
    /// system could not be reached or read; 4: a wait ran out of time.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::NotFound(_) => 1,
            CliError::Usage(_) => 2,
            CliError::TimedOut(_) => 4,
            _ => 3,
        }
    }
}

/// A read's error as the CLI reports it: the same kind, with the CLI's hint where there is
/// one (the flag or variable to set).
impl From<ReadError> for CliError {
    fn from(e: ReadError) -> CliError {
        match e {
            ReadError::Connect { url, message } => CliError::Connect { url, message },
            ReadError::Nats(m) => CliError::Nats(m),
            ReadError::Redis(m) => CliError::Redis(m),
            ReadError::Decode { what, message } => CliError::Decode { what, message },
            ReadError::NotFound(m) => CliError::NotFound(m),
            ReadError::Usage(m) => CliError::Usage(m),
        }
    }
}
