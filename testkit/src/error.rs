//! The crate's error: why a test server or tool could not be started.

use std::time::Duration;

/// Why a test server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error("`{binary}` was not found on PATH. Install it with `apt-get install -y {package}` (or run `./dev test`, which installs it).")]
    MissingBinary {
        binary: &'static str,
        package: &'static str,
    },
    #[error("starting {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} did not become ready within {timeout:?}; its log:\n{log}")]
    NotReady {
        what: String,
        timeout: Duration,
        log: String,
    },
}
