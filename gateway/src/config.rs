//! Gateway configuration: typed, read from a TOML file, then overridden by environment
//! variables, then validated into field-level errors.
//!
//! Invariant: a `Config` that passed [`Config::validate`] can be served without further
//! checks (every duration is positive, every limit non-zero, the address parses).
//! Environment overrides are read through a caller-supplied lookup so tests never touch
//! the process environment.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Environment variable overriding [`Config::nats_url`].
pub const ENV_NATS_URL: &str = "NATS_URL";
/// Environment variable overriding [`Config::listen`].
pub const ENV_LISTEN: &str = "METRONOME_GATEWAY_LISTEN";

/// Storage of the JetStream streams the gateway creates when they are missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamStorage {
    File,
    Memory,
}

/// Everything the gateway needs to serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// HTTP listen address (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// NATS server URL (overridden by `NATS_URL`).
    pub nats_url: String,
    /// Largest accepted request body, in bytes; larger bodies get an OpenAI-shaped 413.
    pub body_limit_bytes: usize,
    /// `max_tokens` assumed when a request sets neither `max_tokens` nor
    /// `max_completion_tokens`.
    pub default_max_tokens: u32,
    /// Write `default_max_tokens` into the forwarded body when the request has no limit,
    /// so the model server cannot generate more than the dispatcher reserved for.
    pub inject_default_max_tokens: bool,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: u32,
    /// How long a job may wait for a GPU before its deadline (used when the request has
    /// no `x-metronome-deadline-ms` header).
    pub queue_timeout_ms: u64,
    /// Upper bound of a deadline asked for in `x-metronome-deadline-ms`.
    pub max_queue_timeout_ms: u64,
    /// How long a job may run after its deadline to start; past `deadline + this`
    /// without a final result the client gets a 504.
    pub max_generation_ms: u64,
    /// How long to wait for JetStream to acknowledge a submitted job.
    pub publish_timeout_ms: u64,
    /// `Retry-After` seconds sent with 503 (no capacity, NATS unavailable) and 429.
    pub retry_after_secs: u64,
    /// Send `x-metronome-worker` on responses.
    pub expose_worker_header: bool,
    /// A worker whose last heartbeat in the `workers` bucket is older than this no longer
    /// counts as serving its model.
    pub worker_stale_after_ms: u64,
    /// Storage type of streams created at start when they do not exist yet.
    pub stream_storage: StreamStorage,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:8080".into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            body_limit_bytes: 4 * 1024 * 1024,
            default_max_tokens: 256,
            inject_default_max_tokens: true,
            max_tokens_limit: 131_072,
            queue_timeout_ms: 30_000,
            max_queue_timeout_ms: 600_000,
            max_generation_ms: 600_000,
            publish_timeout_ms: 5_000,
            retry_after_secs: 2,
            expose_worker_header: true,
            worker_stale_after_ms: 15_000,
            stream_storage: StreamStorage::File,
        }
    }
}

/// One invalid configuration field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<FieldError>),
}

impl Config {
    /// Parse a TOML document (missing keys take their defaults).
    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.to_string(),
            source: Box::new(source),
        })
    }

    /// Read `path` (or start from the defaults when `None`), then apply environment
    /// overrides from `env`. Does not validate.
    pub fn load(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
                Config::from_toml(&text, &path.display().to_string())?
            }
            None => Config::default(),
        };
        config.apply_env(env);
        Ok(config)
    }

    /// Environment overrides: `NATS_URL`, `METRONOME_GATEWAY_LISTEN`.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        if let Some(url) = env(ENV_NATS_URL).filter(|v| !v.trim().is_empty()) {
            self.nats_url = url;
        }
        if let Some(listen) = env(ENV_LISTEN).filter(|v| !v.trim().is_empty()) {
            self.listen = listen;
        }
    }

    /// Every invalid field, or `Ok` when the configuration can be served.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, field: &'static str, message: String| {
            if !ok {
                errors.push(FieldError { field, message });
            }
        };
        check(
            self.listen.parse::<SocketAddr>().is_ok(),
            "listen",
            format!("{:?} is not an IP:port address", self.listen),
        );
        check(
            !self.nats_url.trim().is_empty(),
            "nats_url",
            "must not be empty".into(),
        );
        check(
            self.body_limit_bytes >= 1024,
            "body_limit_bytes",
            format!("{} is below the minimum of 1024", self.body_limit_bytes),
        );
        check(
            self.default_max_tokens >= 1,
            "default_max_tokens",
            "must be at least 1".into(),
        );
        check(
            self.max_tokens_limit >= self.default_max_tokens,
            "max_tokens_limit",
            format!(
                "{} is below default_max_tokens ({})",
                self.max_tokens_limit, self.default_max_tokens
            ),
        );
        check(
            self.queue_timeout_ms >= 1,
            "queue_timeout_ms",
            "must be at least 1".into(),
        );
        check(
            self.max_queue_timeout_ms >= self.queue_timeout_ms,
            "max_queue_timeout_ms",
            format!(
                "{} is below queue_timeout_ms ({})",
                self.max_queue_timeout_ms, self.queue_timeout_ms
            ),
        );
        check(
            self.max_generation_ms >= 1,
            "max_generation_ms",
            "must be at least 1".into(),
        );
        check(
            self.publish_timeout_ms >= 1,
            "publish_timeout_ms",
            "must be at least 1".into(),
        );
        check(
            self.worker_stale_after_ms >= 1,
            "worker_stale_after_ms",
            "must be at least 1".into(),
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// [`Config::load`] then [`Config::validate`], as one error.
    pub fn load_valid(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let config = Config::load(path, env)?;
        config.validate().map_err(ConfigError::Invalid)?;
        Ok(config)
    }

    /// The effective configuration as TOML, for `--check-config`.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, FieldError> {
        self.listen.parse().map_err(|_| FieldError {
            field: "listen",
            message: format!("{:?} is not an IP:port address", self.listen),
        })
    }

    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.queue_timeout_ms)
    }

    pub fn max_generation(&self) -> Duration {
        Duration::from_millis(self.max_generation_ms)
    }

    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Config::default().validate(), Ok(()));
    }

    #[test]
    fn toml_keys_override_defaults_and_missing_keys_keep_them() {
        let c =
            Config::from_toml("listen = \"0.0.0.0:9000\"\ndefault_max_tokens = 64\n", "t").unwrap();
        assert_eq!(c.listen, "0.0.0.0:9000");
        assert_eq!(c.default_max_tokens, 64);
        assert_eq!(c.body_limit_bytes, Config::default().body_limit_bytes);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(matches!(
            Config::from_toml("listn = \"x\"", "t"),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn environment_overrides_the_file() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            ENV_NATS_URL => Some("nats://10.0.0.1:4333".into()),
            ENV_LISTEN => Some("127.0.0.1:0".into()),
            _ => None,
        });
        assert_eq!(c.nats_url, "nats://10.0.0.1:4333");
        assert_eq!(c.listen, "127.0.0.1:0");
        let mut d = Config::default();
        d.apply_env(no_env);
        assert_eq!(d, Config::default());
    }

    #[test]
    fn every_invalid_field_is_reported() {
        let c = Config {
            listen: "nowhere".into(),
            body_limit_bytes: 10,
            default_max_tokens: 0,
            queue_timeout_ms: 0,
            ..Config::default()
        };
        let fields: Vec<_> = c.validate().unwrap_err().iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            [
                "listen",
                "body_limit_bytes",
                "default_max_tokens",
                "queue_timeout_ms"
            ]
        );
    }

    #[test]
    fn effective_config_round_trips_through_toml() {
        let c = Config::default();
        assert_eq!(Config::from_toml(&c.to_toml(), "t").unwrap(), c);
    }
}
