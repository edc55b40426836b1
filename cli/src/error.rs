//! The CLI's errors, each with the exit code a script can act on.

use metronome_readmodel::ReadError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CliError {
    #[error("cannot connect to NATS at {url}: {message} (set --nats-url, NATS_URL or a context's server)")]
    Connect { url: String, message: String },
    #[error("NATS: {0}")]
    Nats(String),
    #[error("Redis: {0} (the EWMA columns need --redis-url / REDIS_URL)")]
    Redis(String),
    #[error("cannot decode {what}: {message}")]
    Decode { what: String, message: String },
    /// The thing asked about does not exist (an unknown job id, worker or context).
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Usage(String),
    /// A wait (`drain --wait`) ran out of time.
    #[error("{0}")]
    TimedOut(String),
    /// The reader of the output went away (`metronome decisions --follow | head`): it has
    /// what it wanted, so the command ends quietly, successfully.
    #[error("output closed")]
    OutputClosed,
    /// Writing the output failed otherwise (a full disk, a closed terminal).
    #[error("writing output: {0}")]
    Output(String),
}

impl CliError {
    /// The error of a failed write of the output.
    pub fn writing(e: std::io::Error) -> CliError {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            CliError::OutputClosed
        } else {
            CliError::Output(e.to_string())
        }
    }
}

impl CliError {
    /// 0: the output's reader went away; 1: not found (a script's "no such job", "no such
    /// worker"); 2: bad usage; 3: the system could not be reached or read, or the output
    /// could not be written; 4: a wait ran out of time.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::OutputClosed => 0,
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
