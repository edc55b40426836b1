//! Why the system could not be read.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ReadError {
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("NATS: {0}")]
    Nats(String),
    #[error("Redis: {0}")]
    Redis(String),
    #[error("cannot decode {what}: {message}")]
    Decode { what: String, message: String },
    /// The thing asked about does not exist (an unknown job id).
    #[error("{0}")]
    NotFound(String),
    /// The question is malformed (a job id that cannot be one).
    #[error("{0}")]
    Usage(String),
}
