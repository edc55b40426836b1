//! Gateway configuration: typed, read from a TOML file, then overridden by environment
//! variables, then validated into field-level errors.
//!
//! Invariant: a `Config` that passed [`Config::validate`] can be served without further
//! checks (every duration is positive, every limit non-zero, the address parses, every
//! API key is a well-formed SHA-256 of a known tenant and no two keys share a hash).
//!
//! Tenants and API keys live here too (`[[tenants]]`, `[[keys]]`): a key is stored only as
//! the SHA-256 of its text, so the configuration file holds no secret.
//! Environment overrides are read through a caller-supplied lookup so tests never touch
//! the process environment.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use metronome_protocol::Priority;
use serde::{Deserialize, Serialize};

/// Environment variable overriding [`Config::nats_url`].
pub const ENV_NATS_URL: &str = "NATS_URL";
/// Environment variable overriding [`Config::redis_url`].
pub const ENV_REDIS_URL: &str = "REDIS_URL";
/// Environment variable overriding [`Config::listen`].
pub const ENV_LISTEN: &str = "METRONOME_GATEWAY_LISTEN";
/// Environment variable overriding [`Config::tls_cert`].
pub const ENV_TLS_CERT: &str = "METRONOME_GATEWAY_TLS_CERT";
/// Environment variable overriding [`Config::tls_key`].
pub const ENV_TLS_KEY: &str = "METRONOME_GATEWAY_TLS_KEY";

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
    /// PEM certificate chain (leaf first) to serve HTTPS with, on `listen` (which then
    /// speaks TLS only); needs `tls_key`. Absent: plain HTTP, for loopback or behind a
    /// TLS proxy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `tls_cert` (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<std::path::PathBuf>,
    /// NATS server URL, or every node of a cluster separated by commas (overridden by
    /// `NATS_URL`).
    pub nats_url: String,
    /// NATS credentials and TLS (`[nats_auth]`; `METRONOME_NATS_*` override them).
    pub nats_auth: metronome_runtime::nats::NatsAuth,
    /// Largest accepted request body, in bytes; larger bodies get an OpenAI-shaped 413.
    pub body_limit_bytes: usize,
    /// Most chat and completion requests held at once (read, queued, generating or
    /// streaming); beyond it a request is answered 429 at once, before its body is read.
    /// With `max_in_flight_body_bytes` it bounds the gateway's memory under a flood
    /// (docs/RUNBOOK.md: about 60 KB per request in flight besides its body).
    pub max_in_flight: usize,
    /// Most requests of one tenant held at once (429 beyond it), so one tenant's flood
    /// leaves room for the others.
    pub max_in_flight_per_tenant: usize,
    /// Most bytes of request bodies held at once, each charged its `Content-Length` (or
    /// `body_limit_bytes` without one); 429 beyond it.
    pub max_in_flight_body_bytes: u64,
    /// Most bytes of results a request holds from workers no decision has named yet
    /// (beyond it they are dropped and counted, as results of a worker that does not hold
    /// the job).
    pub held_results_max_bytes: usize,
    /// Most bytes of streamed chunks a request holds ahead of one that has not arrived
    /// (chunks are relayed in order); beyond it the stream ends with an error.
    pub reorder_max_bytes: usize,
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
    /// Origins of browser pages that may call the OpenAI endpoints (CORS), each
    /// `scheme://host[:port]`, or `["*"]` for any; empty (the default): no CORS headers, so
    /// browsers refuse cross-origin calls. The console is never opened to other origins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cors_allowed_origins: Vec<String>,
    /// A worker whose last heartbeat in the `workers` bucket is older than this no longer
    /// counts as serving its model.
    pub worker_stale_after_ms: u64,
    /// Storage type of streams created at start when they do not exist yet.
    pub stream_storage: StreamStorage,
    /// Copies of each stream and bucket created at start: 1 on a single server, 3 on a
    /// three-node NATS cluster (1, 3 or 5).
    pub stream_replicas: usize,
    /// Serve requests without a configured key (no `Authorization`, or a bearer token that
    /// is no configured key, as OpenAI clients always send one) as tenant `anonymous`, whose
    /// models and limits a `[[tenants]]` entry named `anonymous` may set. Off by default:
    /// then every OpenAI endpoint needs an API key. A revoked key is refused either way.
    pub allow_anonymous: bool,
    /// Accept `allow_anonymous` on a listen address other than loopback: only for a
    /// container whose port the host publishes on its own loopback (`compose.yaml`).
    /// Without it such a configuration is refused, since a setting left in an environment
    /// would serve anonymous inference and the console to the network.
    pub allow_anonymous_beyond_loopback: bool,
    /// Redis holding the workers' EWMAs, read only by the operator console (overridden by
    /// `REDIS_URL`); absent: the console shows the EWMA columns as n/a.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_url: Option<String>,
    /// Redis TLS for a `rediss://` `redis_url` (`[redis_tls]`; `METRONOME_REDIS_*`
    /// override it).
    pub redis_tls: metronome_runtime::redis::RedisTls,
    /// Tenants: the models each may use and its limits.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantConfig>,
    /// API keys, each mapped to a tenant, stored as the SHA-256 of the key.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<KeyConfig>,
}

/// Models a tenant may use: `"*"` (every model, the default) or a list of names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelList {
    /// A list of model names.
    Only(Vec<String>),
    /// `"*"`; any other text is a configuration error (a comma-separated string is the
    /// usual mistake).
    Text(String),
}

impl Default for ModelList {
    fn default() -> Self {
        ModelList::Text(ALL_MODELS.into())
    }
}

/// The [`ModelList`] text meaning every model.
pub const ALL_MODELS: &str = "*";

impl ModelList {
    /// Whether the list lets `model` through (only meaningful once validated).
    pub fn allows(&self, model: &str) -> bool {
        match self {
            ModelList::Only(names) => names.iter().any(|m| m == model),
            ModelList::Text(t) => t == ALL_MODELS,
        }
    }
}

/// One tenant (`[[tenants]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// A token of ASCII letters, digits, `-` and `_` (at most 64 bytes); it is written into
    /// each job (`Job.tenant`) and labels the per-tenant metrics.
    pub name: String,
    #[serde(default)]
    pub models: ModelList,
    /// Sustained requests per second (token bucket); absent: no request limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
    /// Requests that may arrive at once above the sustained rate (bucket size); defaults to
    /// the rate rounded up, at least 1. Needs `requests_per_second`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Tokens per minute, charged at admission as prompt estimate + `max_tokens`; absent:
    /// no token limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

impl TenantConfig {
    /// A tenant allowed every model, without limits.
    pub fn unlimited(name: &str) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            models: ModelList::default(),
            requests_per_second: None,
            burst: None,
            tokens_per_minute: None,
        }
    }
}

/// One API key (`[[keys]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// The tenant the key acts for; must have a `[[tenants]]` entry.
    pub tenant: String,
    /// SHA-256 of the key's text, 64 lowercase hex digits (`keys create` prints it).
    pub sha256: String,
    /// A note for operators (who holds the key, when it was made); never checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// A revoked key is refused with 401 like an unknown one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
    /// The highest priority class (`interactive`, `batch`) the key's requests may have, and
    /// the class they get unless a request asks for a lower one in `x-metronome-priority`.
    /// Absent: `interactive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The key also opens the operator console (`/console`), which shows every worker and
    /// every decision. Without anonymous access, only operator keys do.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub operator: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:8080".into(),
            tls_cert: None,
            tls_key: None,
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_auth: Default::default(),
            body_limit_bytes: 4 * 1024 * 1024,
            max_in_flight: 1024,
            max_in_flight_per_tenant: 512,
            max_in_flight_body_bytes: 64 * 1024 * 1024,
            held_results_max_bytes: 1024 * 1024,
            reorder_max_bytes: 4 * 1024 * 1024,
            default_max_tokens: 256,
            inject_default_max_tokens: true,
            max_tokens_limit: 131_072,
            queue_timeout_ms: 30_000,
            max_queue_timeout_ms: 600_000,
            max_generation_ms: 600_000,
            publish_timeout_ms: 5_000,
            retry_after_secs: 2,
            expose_worker_header: true,
            cors_allowed_origins: Vec::new(),
            worker_stale_after_ms: 15_000,
            stream_storage: StreamStorage::File,
            stream_replicas: 1,
            allow_anonymous: false,
            allow_anonymous_beyond_loopback: false,
            redis_url: None,
            redis_tls: Default::default(),
            tenants: Vec::new(),
            keys: Vec::new(),
        }
    }
}

pub use metronome_runtime::config::{ConfigError, FieldError};
use metronome_runtime::settings::{Setting, SettingTable};

/// What is wrong with `origins` as [`Config::cors_allowed_origins`], if anything: each must
/// be a browser origin (`http` or `https`, a host, an optional port, nothing after), or the
/// list must be `["*"]` alone.
fn check_cors_origins(origins: &[String]) -> Option<String> {
    if origins.iter().any(|o| o == "*") {
        return (origins.len() > 1)
            .then(|| "\"*\" allows every origin and cannot be listed with others".into());
    }
    origins.iter().find_map(|o| {
        let rest = o
            .strip_prefix("https://")
            .or_else(|| o.strip_prefix("http://"));
        let valid = rest.is_some_and(|host| {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-.:[]".contains(c))
        });
        (!valid).then(|| {
            format!("{o:?} is not an origin: scheme://host[:port] with http or https and no path")
        })
    })
}

/// The keys the command line and the environment set: each flag, its variable and its
/// help, declared once (the binary's flags and [`Config::apply_env`] both read this).
pub const SETTINGS: [Setting; 5] = [
    Setting::new(
        "listen",
        "listen",
        "ADDR",
        "Listen address, e.g. 0.0.0.0:8080 (key `listen`)",
    )
    .env(ENV_LISTEN),
    Setting::new(
        "tls_cert",
        "tls-cert",
        "FILE",
        "Serve HTTPS with this PEM certificate chain (key `tls_cert`; needs --tls-key)",
    )
    .env(ENV_TLS_CERT),
    Setting::new(
        "tls_key",
        "tls-key",
        "FILE",
        "The PEM private key of --tls-cert (key `tls_key`)",
    )
    .env(ENV_TLS_KEY),
    Setting::new(
        "nats_url",
        "nats-url",
        "URL",
        "NATS server URL (key `nats_url`)",
    )
    .env(ENV_NATS_URL),
    Setting::new(
        "redis_url",
        "redis-url",
        "URL",
        "Redis holding the workers' EWMAs, read only by the console (key `redis_url`)",
    )
    .env(ENV_REDIS_URL),
];

/// [`SETTINGS`] as the type the binary's flags are built from.
pub struct Settings;

impl SettingTable for Settings {
    const SETTINGS: &'static [Setting] = &SETTINGS;
}

impl Config {
    /// Parse a TOML document (missing keys take their defaults).
    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        metronome_runtime::config::parse_toml(text, origin)
    }

    /// Read `path` (or start from the defaults when `None`), then apply environment
    /// overrides from `env`. Does not validate.
    pub fn load(
        path: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config: Config = metronome_runtime::config::file_or_default(path)?;
        config.apply_env(env)?;
        Ok(config)
    }

    /// Apply the variables of [`SETTINGS`], then the NATS credentials (`METRONOME_NATS_*`)
    /// and Redis TLS, found through `env` (empty values are ignored).
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        metronome_runtime::settings::apply_env(self, &SETTINGS, &env)?;
        self.nats_auth.apply_env(&env);
        self.redis_tls.apply_env(&env);
        Ok(())
    }

    /// Every invalid field, or `Ok` when the configuration can be served.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, field: &'static str, message: String| {
            if !ok {
                errors.push(FieldError::new(field, message));
            }
        };
        check(
            self.listen.parse::<SocketAddr>().is_ok(),
            "listen",
            format!("{:?} is not an IP:port address", self.listen),
        );
        let network = self
            .listen
            .parse::<SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback());
        check(
            !(self.allow_anonymous && network && !self.allow_anonymous_beyond_loopback),
            "allow_anonymous",
            format!(
                "serves requests without a key on {}, beyond loopback: listen on 127.0.0.1 (or put a TLS proxy with keys in front and set allow_anonymous_beyond_loopback)",
                self.listen
            ),
        );
        if let Some((field, message)) = self.check_tls() {
            check(false, field, message);
        }
        let bad_url = metronome_runtime::nats::check_server_urls(&self.nats_url);
        check(bad_url.is_none(), "nats_url", bad_url.unwrap_or_default());
        let bad_origin = check_cors_origins(&self.cors_allowed_origins);
        check(
            bad_origin.is_none(),
            "cors_allowed_origins",
            bad_origin.unwrap_or_default(),
        );
        let bad_replicas = metronome_protocol::setup::check_replicas(self.stream_replicas);
        check(
            bad_replicas.is_none(),
            "stream_replicas",
            bad_replicas.unwrap_or_default(),
        );
        check(
            self.body_limit_bytes >= 1024,
            "body_limit_bytes",
            format!("{} is below the minimum of 1024", self.body_limit_bytes),
        );
        for (field, value) in [
            ("max_in_flight", self.max_in_flight),
            ("max_in_flight_per_tenant", self.max_in_flight_per_tenant),
        ] {
            check(value >= 1, field, "must be at least 1".into());
        }
        check(
            self.max_in_flight_body_bytes >= self.body_limit_bytes as u64,
            "max_in_flight_body_bytes",
            format!(
                "{} is below body_limit_bytes ({}): a body of the largest size would never be admitted",
                self.max_in_flight_body_bytes, self.body_limit_bytes
            ),
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
        self.validate_tenants(&mut errors);
        let redis_tls_errors = match &self.redis_url {
            Some(url) => self.redis_tls.validate(url),
            None if self.redis_tls.is_set() => {
                vec![("redis_tls", "is set without a redis_url".to_string())]
            }
            None => Vec::new(),
        };
        for (field, message) in self
            .nats_auth
            .validate()
            .into_iter()
            .chain(redis_tls_errors)
        {
            errors.push(FieldError::new(field, message));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// What is wrong with `tls_cert` / `tls_key`, if anything: both or neither, and both
    /// files read and accepted by rustls (the key is the certificate's), so
    /// `--check-config` finds what would stop the gateway at start.
    fn check_tls(&self) -> Option<(&'static str, String)> {
        use crate::tls::TlsConfigError;
        use metronome_runtime::tls::TlsFileError;
        let either = "set both (HTTPS) or neither (plain HTTP)";
        let (cert, key) = match (&self.tls_cert, &self.tls_key) {
            (None, None) => return None,
            (Some(_), None) => {
                return Some(("tls_key", format!("missing: tls_cert is set; {either}")))
            }
            (None, Some(_)) => {
                return Some(("tls_cert", format!("missing: tls_key is set; {either}")))
            }
            (Some(cert), Some(key)) => (cert, key),
        };
        let error = crate::tls::server_config(cert, key).err()?;
        let field = match &error {
            TlsConfigError::File(
                TlsFileError::Read { setting, .. } | TlsFileError::Content { setting, .. },
            ) => *setting,
            TlsConfigError::Refused { .. } => "tls_key",
        };
        let text = error.to_string();
        let message = text
            .strip_prefix(field)
            .and_then(|t| t.strip_prefix(": ").or_else(|| t.strip_prefix(' ')))
            .unwrap_or(&text);
        Some((field, message.to_string()))
    }

    fn validate_tenants(&self, errors: &mut Vec<FieldError>) {
        let mut error = |field: &'static str, message: String| {
            errors.push(FieldError::new(field, message));
        };
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = format!("tenants[{i}] ({:?})", t.name);
            if let Err(e) = metronome_protocol::check_tenant(&t.name) {
                let message = match e {
                    metronome_protocol::JobError::BadTenant(m) => m,
                    e => e.to_string(),
                };
                error("tenants.name", format!("{at}: {message}"));
            }
            if !names.insert(t.name.as_str()) {
                error("tenants.name", format!("{at}: duplicate tenant"));
            }
            match &t.models {
                ModelList::Text(text) if text == ALL_MODELS => {}
                ModelList::Text(text) => error(
                    "tenants.models",
                    format!("{at}: {text:?} is not a model list: write a list such as [\"a\", \"b\"], or \"*\" for every model"),
                ),
                ModelList::Only(list) if list.is_empty() => error(
                    "tenants.models",
                    format!("{at}: the list is empty; name at least one model, or \"*\" for every model"),
                ),
                ModelList::Only(list) => {
                    for m in list {
                        if let Err(e) = metronome_protocol::check_model_name(m) {
                            error("tenants.models", format!("{at}: {m:?}: {e}"));
                        }
                    }
                }
            }
            if let Some(r) = t.requests_per_second {
                if !(r.is_finite() && r > 0.0) {
                    error(
                        "tenants.requests_per_second",
                        format!("{at}: must be a positive number, got {r}"),
                    );
                }
            }
            match (t.burst, t.requests_per_second) {
                (Some(0), _) => error("tenants.burst", format!("{at}: must be at least 1")),
                (Some(_), None) => {
                    error("tenants.burst", format!("{at}: needs requests_per_second"))
                }
                _ => {}
            }
            if t.tokens_per_minute == Some(0) {
                error(
                    "tenants.tokens_per_minute",
                    format!("{at}: must be at least 1"),
                );
            }
        }
        let mut hashes = std::collections::HashMap::new();
        for (i, k) in self.keys.iter().enumerate() {
            let at = format!("keys[{i}]");
            if !crate::api_key::is_sha256_hex(&k.sha256) {
                let hint = if k.sha256.starts_with(crate::api_key::KEY_PREFIX) {
                    "this looks like the key itself: store only its SHA-256 (`keys create` prints it)"
                } else {
                    "must be 64 lowercase hex digits, the SHA-256 of the key (`keys create` prints it)"
                };
                error("keys.sha256", format!("{at}: {hint}"));
            } else if let Some(first) = hashes.insert(k.sha256.as_str(), i) {
                error(
                    "keys.sha256",
                    format!("{at}: duplicate key (same hash as keys[{first}])"),
                );
            }
            if k.tenant == metronome_protocol::ANONYMOUS_TENANT {
                error(
                    "keys.tenant",
                    format!(
                        "{at}: tenant {:?} is reserved for requests without a key",
                        k.tenant
                    ),
                );
            } else if !names.contains(k.tenant.as_str()) {
                error(
                    "keys.tenant",
                    format!(
                        "{at}: unknown tenant {:?}: add a [[tenants]] entry for it",
                        k.tenant
                    ),
                );
            }
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
        self.listen.parse().map_err(|_| {
            FieldError::new(
                "listen",
                format!("{:?} is not an IP:port address", self.listen),
            )
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
        })
        .unwrap();
        assert_eq!(c.nats_url, "nats://10.0.0.1:4333");
        assert_eq!(c.listen, "127.0.0.1:0");
        let mut d = Config::default();
        d.apply_env(no_env).unwrap();
        assert_eq!(d, Config::default());
    }

    /// Issue 40: `allow_anonymous` left in an environment served anonymous inference and
    /// the console on whatever address the gateway listened on.
    #[test]
    fn anonymous_access_is_refused_beyond_loopback() {
        let on = |listen: &str| Config {
            listen: listen.into(),
            allow_anonymous: true,
            ..Config::default()
        };
        for loopback in ["127.0.0.1:8080", "[::1]:8080", "127.0.0.1:0"] {
            assert_eq!(on(loopback).validate(), Ok(()), "{loopback}");
        }
        for network in ["0.0.0.0:8080", "10.0.0.5:8080", "[::]:8080"] {
            let errors = on(network).validate().unwrap_err();
            assert_eq!(errors.len(), 1, "{network}: {errors:?}");
            assert_eq!(errors[0].field, "allow_anonymous");
            let mut published_on_loopback = on(network);
            published_on_loopback.allow_anonymous_beyond_loopback = true;
            assert_eq!(published_on_loopback.validate(), Ok(()), "{network}");
        }
    }

    #[test]
    fn every_invalid_field_is_reported() {
        let c = Config {
            listen: "nowhere".into(),
            body_limit_bytes: 10,
            default_max_tokens: 0,
            queue_timeout_ms: 0,
            nats_url: "nats://10.0.0.1:4222,http://10.0.0.2:4222".into(),
            stream_replicas: 0,
            ..Config::default()
        };
        let fields: Vec<_> = c
            .validate()
            .unwrap_err()
            .iter()
            .map(|e| e.field.clone())
            .collect();
        assert_eq!(
            fields,
            [
                "listen",
                "nats_url",
                "stream_replicas",
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
        let with_keys = Config::from_toml(TENANTS, "t").unwrap();
        assert_eq!(with_keys.validate(), Ok(()));
        assert_eq!(
            Config::from_toml(&with_keys.to_toml(), "t").unwrap(),
            with_keys
        );
    }

    const HASH_A: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    const HASH_B: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    const TENANTS: &str = r#"
allow_anonymous = false

[[tenants]]
name = "acme"
models = ["llama-3.1-8b", "qwen-7b"]
requests_per_second = 5.0
burst = 10
tokens_per_minute = 100000

[[tenants]]
name = "beta"

[[keys]]
tenant = "acme"
sha256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
note = "ci"

[[keys]]
tenant = "beta"
sha256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
revoked = true
"#;

    #[test]
    fn tenants_and_keys_parse_with_defaults() {
        let c = Config::from_toml(TENANTS, "t").unwrap();
        assert!(!c.allow_anonymous && !Config::default().allow_anonymous);
        assert_eq!(c.tenants.len(), 2);
        assert_eq!(c.tenants[1].models, ModelList::default());
        assert!(c.tenants[1].models.allows("anything"));
        assert!(c.tenants[0].models.allows("qwen-7b") && !c.tenants[0].models.allows("x"));
        assert!(c.keys[1].revoked && !c.keys[0].revoked);
        assert!(
            matches!(
                Config::from_toml(
                    "[[keys]]\ntenant = \"a\"\nsha256 = \"x\"\nkey = \"mtk_x\"\n",
                    "t"
                ),
                Err(ConfigError::Parse { .. })
            ),
            "unknown key fields are refused"
        );
    }

    fn fields(c: &Config) -> Vec<(String, String)> {
        c.validate()
            .unwrap_err()
            .into_iter()
            .map(|e| (e.field, e.message))
            .collect()
    }

    #[test]
    fn bad_hashes_and_duplicate_keys_are_field_errors() {
        let key = |tenant: &str, sha256: &str| KeyConfig {
            tenant: tenant.into(),
            sha256: sha256.into(),
            note: None,
            revoked: false,
            priority: None,
            operator: false,
        };
        let c = Config {
            tenants: vec![TenantConfig::unlimited("acme")],
            keys: vec![
                key("acme", HASH_A),
                key("acme", "abc"),
                key("acme", &HASH_B.to_uppercase()),
                key("acme", "mtk_0123"),
                key("acme", HASH_A),
                key("nobody", HASH_B),
                key("anonymous", &HASH_B.replace('2', "3")),
            ],
            ..Config::default()
        };
        let errors = fields(&c);
        let names: Vec<&str> = errors.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "keys.sha256",
                "keys.sha256",
                "keys.sha256",
                "keys.sha256",
                "keys.tenant",
                "keys.tenant"
            ],
            "{errors:?}"
        );
        assert!(errors[0].1.starts_with("keys[1]: must be 64 lowercase hex"));
        assert!(
            errors[2].1.contains("looks like the key itself"),
            "{errors:?}"
        );
        assert_eq!(errors[3].1, "keys[4]: duplicate key (same hash as keys[0])");
        assert!(errors[4].1.contains("unknown tenant \"nobody\""));
        assert!(errors[5].1.contains("reserved"));
    }

    #[test]
    fn cors_origins_are_origins_or_a_lone_star() {
        let errors_of = |origins: &[&str]| {
            let c = Config {
                cors_allowed_origins: origins.iter().map(|o| o.to_string()).collect(),
                ..Config::default()
            };
            match c.validate() {
                Ok(()) => Vec::new(),
                Err(_) => fields(&c),
            }
        };
        assert!(errors_of(&[]).is_empty());
        assert!(errors_of(&["*"]).is_empty());
        assert!(errors_of(&["https://app.example.com", "http://localhost:3000"]).is_empty());
        for bad in [
            &["*", "https://app.example.com"][..],
            &["app.example.com"],
            &["https://app.example.com/"],
            &["ftp://app.example.com"],
            &["https://"],
        ] {
            let errors = errors_of(bad);
            assert_eq!(errors.len(), 1, "{bad:?}: {errors:?}");
            assert_eq!(errors[0].0, "cors_allowed_origins", "{bad:?}");
        }
    }

    #[test]
    fn bad_tenants_are_field_errors() {
        let text = r#"
[[tenants]]
name = "acme"
models = "llama-3.1-8b,qwen-7b"
requests_per_second = 0.0

[[tenants]]
name = "acme"
models = []
burst = 5

[[tenants]]
name = "has space"
models = ["ok", "bad\nname"]
tokens_per_minute = 0
"#;
        let c = Config::from_toml(text, "t").unwrap();
        let errors = fields(&c);
        let names: Vec<&str> = errors.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "tenants.models",
                "tenants.requests_per_second",
                "tenants.name",
                "tenants.models",
                "tenants.burst",
                "tenants.name",
                "tenants.models",
                "tenants.tokens_per_minute",
            ],
            "{errors:?}"
        );
        assert!(
            errors[0]
                .1
                .contains("is not a model list: write a list such as [\"a\", \"b\"]"),
            "{errors:?}"
        );
        assert_eq!(errors[2].1, "tenants[1] (\"acme\"): duplicate tenant");
        assert!(errors[4].1.ends_with("needs requests_per_second"));
        assert!(errors[5].1.contains("not a token"), "{errors:?}");
        assert!(errors[6].1.contains("control character"), "{errors:?}");
    }
}
