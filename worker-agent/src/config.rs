//! Configuration of one worker-agent: which worker it is, which model server it fronts, and
//! the timings of its loops.
//!
//! Loaded from a TOML file, then overridden by the environment (`NATS_URL`, `REDIS_URL` and
//! `METRONOME_WORKER_*`), then validated into field-level errors. The environment is read
//! through a lookup function so tests never touch the process environment.
//! Invariant: a `Config` that passed [`Config::validate`] has a subject-safe `worker_id`,
//! a non-empty model, a parseable model-server URL, every interval above zero and a valid
//! performance-model prior.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use metronome_protocol::names::is_subject_token;
use metronome_scheduler::perf::PerfPrior;
use serde::{Deserialize, Serialize};

/// Which family of model server the agent talks to. It selects the Prometheus metric names
/// scraped for queue depth and KV usage; the OpenAI API is the same for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServerKind {
    Vllm,
    Sglang,
    /// The bundled GPU simulator, which exports vLLM-named metrics.
    Simulator,
    Llamacpp,
    Tgi,
}

impl ServerKind {
    /// Extras of the model server's request ([`crate::request_fields`]) allowed when the
    /// config names none: plain sampling parameters the server families share (they bound
    /// nothing and parse nothing), and for the simulator its exact prompt size (what the
    /// load generator replays traces with).
    pub fn default_extra_fields(self) -> &'static [&'static str] {
        match self {
            ServerKind::Vllm | ServerKind::Sglang => {
                &["top_k", "min_p", "repetition_penalty", "ignore_eos"]
            }
            ServerKind::Simulator => &["ignore_eos", "metronome_prompt_tokens"],
            ServerKind::Llamacpp | ServerKind::Tgi => &["top_k", "min_p", "repetition_penalty"],
        }
    }
}

impl fmt::Display for ServerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ServerKind::Vllm => "vllm",
            ServerKind::Sglang => "sglang",
            ServerKind::Simulator => "simulator",
            ServerKind::Llamacpp => "llamacpp",
            ServerKind::Tgi => "tgi",
        };
        f.write_str(s)
    }
}

/// Every setting of the agent. Durations are in milliseconds so the TOML stays plain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Subject-safe id of this worker (`node1-gpu0`): names its WORK subject and consumer.
    pub worker_id: String,
    /// Model the model server has loaded, as clients name it.
    pub model: String,
    /// Host name, reported to operators in heartbeats.
    pub node: Option<String>,
    /// GPU index on the host; also the NVML device the agent probes.
    pub gpu_index: Option<u32>,
    /// Base URL of the OpenAI-compatible model server (`http://127.0.0.1:8001`; `https://`
    /// is verified against the system's CA certificates, and `model_server_ca_file`'s).
    pub model_server_url: String,
    /// PEM file of a CA the model server's certificate may also be signed by (a private
    /// CA), for an `https://` `model_server_url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_server_ca_file: Option<String>,
    pub model_server_kind: ServerKind,
    /// Request fields the model server gets besides OpenAI's own (see
    /// `request_fields`): `None`, the default extras of `model_server_kind` (plain
    /// sampling parameters, and the simulator's exact prompt size); a list, exactly those
    /// (empty: OpenAI's fields only). Every other field of a client's body stays behind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extra_request_fields: Option<Vec<String>>,
    /// Path of the model server's health endpoint.
    pub health_path: String,
    /// Path of the model server's Prometheus endpoint.
    pub metrics_path: String,
    /// Most jobs run at once; the agent never pulls more than the free slots. A safety
    /// ceiling (vLLM's default `max_num_seqs`): the dispatcher's predictions from the
    /// worker's performance model decide admission below it.
    pub max_concurrency: u32,
    pub heartbeat_interval_ms: u64,
    /// After this long without a stored heartbeat the agent fences itself: it stops
    /// pulling and starts no job until a heartbeat is stored again. Keep it a heartbeat
    /// interval or more below the dispatcher's `heartbeat_timeout_ms` (default 2000 against
    /// 3000): past that the dispatcher declares the worker dead and assigns its unreported
    /// jobs elsewhere, and a gap the two clocks judge a few ticks apart (equal settings) ran
    /// jobs twice in the SIGSTOP drill.
    pub fence_after_ms: u64,
    /// NATS server URL, or every node of a cluster separated by commas.
    pub nats_url: String,
    /// Copies of each stream and bucket the agent creates if it starts first (it may not
    /// with the permissions of docs/SECURITY.md: the dispatcher creates them): 1 on a
    /// single server, 3 on a three-node NATS cluster (1, 3 or 5).
    pub stream_replicas: usize,
    /// NATS credentials and TLS (`[nats_auth]`; `METRONOME_NATS_*` override them).
    pub nats_auth: metronome_runtime::nats::NatsAuth,
    /// `redis://[<user>:<password>@]host:port/` (the agent's own ACL user).
    pub redis_url: String,
    /// Redis TLS (`[redis_tls]`; `METRONOME_REDIS_*` override it); needs a `rediss://` URL.
    pub redis_tls: metronome_runtime::redis::RedisTls,
    pub redis_prefix: String,
    /// Weight of a new sample in the EWMAs when samples arrive back to back.
    pub ewma_alpha: f64,
    /// After this long without samples an old average counts half as much as it would
    /// have: the effective alpha rises towards 1 with the time since the last update.
    pub ewma_half_life_ms: u64,
    /// Interval of `+WPI` progress acks on a running job's WORK message; must stay well
    /// below the consumer's ack wait.
    pub progress_ack_interval_ms: u64,
    /// Ack wait of the agent's durable consumer (set when the consumer is created).
    pub ack_wait_ms: u64,
    /// Longest a single job may run on the model server.
    pub request_timeout_ms: u64,
    /// Longest a graceful shutdown waits for in-flight jobs.
    pub drain_timeout_ms: u64,
    /// Port of the agent's own `/metrics` endpoint; `None` disables it, 0 picks a free port.
    pub metrics_port: Option<u16>,
    /// Address the metrics endpoint binds to.
    pub metrics_bind: String,
    /// The model server's KV cache event publisher (`tcp://host:port`: vLLM's
    /// `--kv-events-config` `endpoint`, the simulator's `kv_events_endpoint`); `None`: the
    /// agent does not report the server's prefix cache, and the leader estimates it from
    /// its placements.
    pub kv_events_endpoint: Option<String>,
    /// The publisher's replay socket (vLLM's `replay_endpoint`), asked for the batches
    /// buffered before the agent subscribed and for any it missed. Optional.
    pub kv_events_replay_endpoint: Option<String>,
    /// The topic the server publishes on (vLLM's `topic`, empty by default).
    pub kv_events_topic: String,
    /// Tokens per KV block of the server (vLLM's `--block-size`, 16 by default on CUDA);
    /// events of another size are not indexed.
    pub kv_events_block_size: u32,
    /// How often the changes to the server's cache are published, when there are any.
    pub cache_delta_interval_ms: u64,
    /// How often the whole index is published as a snapshot (the leader believes a
    /// report for three of these intervals after the last message).
    pub cache_snapshot_interval_ms: u64,
    /// Where this worker's performance model starts (`[perf_prior]`); `None`: the
    /// scheduler's generic prior. Last, as TOML writes tables after plain values.
    pub perf_prior: Option<PerfPrior>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            worker_id: String::new(),
            model: String::new(),
            node: None,
            gpu_index: None,
            model_server_url: "http://127.0.0.1:8001".into(),
            model_server_ca_file: None,
            model_server_kind: ServerKind::Vllm,
            extra_request_fields: None,
            health_path: "/health".into(),
            metrics_path: "/metrics".into(),
            max_concurrency: 256,
            heartbeat_interval_ms: 1_000,
            fence_after_ms: 2_000,
            nats_url: "nats://127.0.0.1:4222".into(),
            stream_replicas: 1,
            nats_auth: Default::default(),
            redis_url: "redis://127.0.0.1:6379/".into(),
            redis_tls: Default::default(),
            redis_prefix: metronome_protocol::redis_keys::DEFAULT_PREFIX.into(),
            ewma_alpha: 0.2,
            ewma_half_life_ms: 60_000,
            progress_ack_interval_ms: 5_000,
            ack_wait_ms: 30_000,
            request_timeout_ms: 600_000,
            drain_timeout_ms: 60_000,
            metrics_port: None,
            metrics_bind: "127.0.0.1".into(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            kv_events_topic: String::new(),
            kv_events_block_size: metronome_protocol::prefix::DEFAULT_BLOCK_SIZE,
            cache_delta_interval_ms: 100,
            cache_snapshot_interval_ms: 10_000,
            perf_prior: None,
        }
    }
}

pub use metronome_runtime::config::{ConfigError, FieldError};
use metronome_runtime::settings::{Setting, SettingTable};

/// The keys the command line and the environment set: each flag, its variable (where it
/// has one) and its help, declared once (the binary's flags and [`Config::apply_env`]
/// both read this).
pub const SETTINGS: [Setting; 9] = [
    Setting::new("nats_url", "nats-url", "URL", "NATS server URL").env("NATS_URL"),
    Setting::new(
        "redis_url",
        "redis-url",
        "URL",
        "Redis URL for the EWMAs and the performance-model state",
    )
    .env("REDIS_URL"),
    Setting::new(
        "worker_id",
        "worker-id",
        "WORKER_ID",
        "Worker id, a subject-safe token such as `node1-gpu0`",
    )
    .env("METRONOME_WORKER_ID"),
    Setting::new(
        "model",
        "model",
        "MODEL",
        "Model name the model server has loaded",
    )
    .env("METRONOME_WORKER_MODEL"),
    Setting::new(
        "model_server_url",
        "model-server-url",
        "MODEL_SERVER_URL",
        "Base URL of the model server, e.g. http://127.0.0.1:8001",
    )
    .env("METRONOME_WORKER_MODEL_SERVER_URL"),
    Setting::new(
        "model_server_kind",
        "model-server-kind",
        "MODEL_SERVER_KIND",
        "vllm | sglang | simulator | llamacpp | tgi",
    ),
    Setting::new(
        "gpu_index",
        "gpu-index",
        "GPU_INDEX",
        "GPU index on this host (NVML device)",
    ),
    Setting::new(
        "max_concurrency",
        "max-concurrency",
        "MAX_CONCURRENCY",
        "Most jobs run at once",
    )
    .env("METRONOME_WORKER_MAX_CONCURRENCY"),
    Setting::new(
        "metrics_port",
        "metrics-port",
        "METRICS_PORT",
        "Port of the agent's own /metrics endpoint (0 = any free port)",
    )
    .env("METRONOME_WORKER_METRICS_PORT"),
];

/// [`SETTINGS`] as the type the binary's flags are built from.
pub struct Settings;

impl SettingTable for Settings {
    const SETTINGS: &'static [Setting] = &SETTINGS;
}

impl Config {
    /// Parse a TOML document.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        metronome_runtime::config::parse_toml(text, origin)
    }

    /// Read a TOML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        metronome_runtime::config::read_file(path)
    }

    /// Apply the variables of [`SETTINGS`], then the NATS and Redis credentials and TLS,
    /// found through `lookup` (`std::env::var(..).ok()` in the binary, a map in tests).
    pub fn apply_env(
        &mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        metronome_runtime::settings::apply_env(self, &SETTINGS, &lookup)?;
        self.nats_auth.apply_env(&lookup);
        self.redis_tls.apply_env(&lookup);
        Ok(())
    }

    /// Every field error at once, so an operator fixes the file in one go.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let mut err = |field: &str, message: String| errors.push(FieldError::new(field, message));
        for (field, message) in self
            .nats_auth
            .validate()
            .into_iter()
            .chain(self.redis_tls.validate(&self.redis_url))
        {
            err(field, message);
        }
        if !is_subject_token(&self.worker_id) {
            err(
                "worker_id",
                format!(
                    "{:?} is not a subject-safe token (letters, digits, '-' and '_', 1 to 128 characters)",
                    self.worker_id
                ),
            );
        } else if !metronome_protocol::names::is_worker_id(&self.worker_id) {
            err(
                "worker_id",
                format!(
                    "{:?} is reserved: it names the results the dispatcher writes",
                    self.worker_id
                ),
            );
        }
        if self.model.trim().is_empty() {
            err(
                "model",
                "must name the model the model server has loaded".into(),
            );
        } else if let Err(e) = metronome_protocol::check_model_name(&self.model) {
            err("model", e.to_string());
        }
        match reqwest::Url::parse(&self.model_server_url) {
            Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {}
            Ok(u) => err(
                "model_server_url",
                format!("scheme {:?} is not http or https", u.scheme()),
            ),
            Err(e) => err(
                "model_server_url",
                format!("{:?}: {e}", self.model_server_url),
            ),
        }
        if let Some(ca) = &self.model_server_ca_file {
            if let Err(e) = crate::model_client::read_ca(ca) {
                err("model_server_ca_file", e.to_string());
            }
        }
        for (field, path) in [
            ("health_path", &self.health_path),
            ("metrics_path", &self.metrics_path),
        ] {
            if !path.starts_with('/') {
                err(field, format!("{path:?} must start with '/'"));
            }
        }
        for field in self.extra_request_fields.iter().flatten() {
            if field.is_empty() || field.len() > 64 || field.contains(char::is_control) {
                err(
                    "extra_request_fields",
                    format!("{field:?} is not a request field name"),
                );
            }
        }
        if self.max_concurrency == 0 {
            err("max_concurrency", "must be at least 1".into());
        }
        if let Some(why) = metronome_runtime::nats::check_server_urls(&self.nats_url) {
            err("nats_url", why);
        }
        if let Some(why) = metronome_protocol::setup::check_replicas(self.stream_replicas) {
            err("stream_replicas", why);
        }
        if redis::Client::open(self.redis_url.as_str()).is_err() {
            err(
                "redis_url",
                format!("{:?} is not a redis:// URL", self.redis_url),
            );
        }
        if self.redis_prefix.is_empty() || self.redis_prefix.contains(char::is_whitespace) {
            err("redis_prefix", "must be non-empty without spaces".into());
        }
        if !(self.ewma_alpha > 0.0 && self.ewma_alpha <= 1.0) {
            err(
                "ewma_alpha",
                format!("{} is not in (0, 1]", self.ewma_alpha),
            );
        }
        for (field, ms) in [
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("fence_after_ms", self.fence_after_ms),
            ("ewma_half_life_ms", self.ewma_half_life_ms),
            ("progress_ack_interval_ms", self.progress_ack_interval_ms),
            ("ack_wait_ms", self.ack_wait_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("drain_timeout_ms", self.drain_timeout_ms),
            ("cache_delta_interval_ms", self.cache_delta_interval_ms),
            (
                "cache_snapshot_interval_ms",
                self.cache_snapshot_interval_ms,
            ),
        ] {
            if ms == 0 {
                err(field, "must be above 0".into());
            }
        }
        if self.fence_after_ms <= self.heartbeat_interval_ms {
            err(
                "fence_after_ms",
                format!(
                    "{} must be above heartbeat_interval_ms ({}), or the agent fences itself between two heartbeats",
                    self.fence_after_ms, self.heartbeat_interval_ms
                ),
            );
        }
        if self.progress_ack_interval_ms >= self.ack_wait_ms {
            err(
                "progress_ack_interval_ms",
                format!(
                    "{} must be below ack_wait_ms ({}), or a running job is redelivered",
                    self.progress_ack_interval_ms, self.ack_wait_ms
                ),
            );
        }
        for (field, endpoint) in [
            ("kv_events_endpoint", &self.kv_events_endpoint),
            ("kv_events_replay_endpoint", &self.kv_events_replay_endpoint),
        ] {
            if let Some(e) = endpoint {
                let ok = e
                    .strip_prefix("tcp://")
                    .and_then(|rest| rest.rsplit_once(':'))
                    .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
                if !ok {
                    err(field, format!("{e:?} is not a tcp://host:port address"));
                }
            }
        }
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            err(
                "kv_events_replay_endpoint",
                "needs kv_events_endpoint (the replay serves what is published there)".into(),
            );
        }
        if self.kv_events_block_size == 0 {
            err("kv_events_block_size", "must be at least 1".into());
        }
        if self.metrics_bind.parse::<std::net::IpAddr>().is_err() {
            err(
                "metrics_bind",
                format!("{:?} is not an IP address", self.metrics_bind),
            );
        }
        if let Some(prior) = &self.perf_prior {
            for e in prior.validate("perf_prior") {
                err(&e.field, e.message);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The prior of the performance model: the configured one, else the generic one.
    pub fn perf_prior(&self) -> PerfPrior {
        self.perf_prior.unwrap_or_default()
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }
    /// What the cache reporter needs, when the agent follows its server's KV events.
    pub fn cache_report(&self) -> Option<crate::cache_report::ReportSettings> {
        let endpoint = self.kv_events_endpoint.clone()?;
        Some(crate::cache_report::ReportSettings {
            worker_id: self.worker_id.clone(),
            endpoint,
            replay_endpoint: self.kv_events_replay_endpoint.clone(),
            topic: self.kv_events_topic.clone(),
            block_size: self.kv_events_block_size,
            delta_interval: Duration::from_millis(self.cache_delta_interval_ms),
            snapshot_interval: Duration::from_millis(self.cache_snapshot_interval_ms),
        })
    }

    pub fn fence_after(&self) -> Duration {
        Duration::from_millis(self.fence_after_ms)
    }
    pub fn progress_ack_interval(&self) -> Duration {
        Duration::from_millis(self.progress_ack_interval_ms)
    }
    pub fn ack_wait(&self) -> Duration {
        Duration::from_millis(self.ack_wait_ms)
    }
    /// The request fields allowed besides OpenAI's (`extra_request_fields`, or the server
    /// kind's defaults).
    pub fn request_extras(&self) -> Vec<String> {
        match &self.extra_request_fields {
            Some(fields) => fields.clone(),
            None => self
                .model_server_kind
                .default_extra_fields()
                .iter()
                .map(|f| f.to_string())
                .collect(),
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// The effective configuration as TOML, for `--check-config`.
    /// The effective configuration as TOML, without secrets (the Redis URL's password
    /// and the NATS password are masked).
    pub fn to_toml(&self) -> String {
        let shown = Config {
            redis_url: metronome_runtime::nats::redact_url(&self.redis_url),
            ..self.clone()
        };
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# not printable: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn valid() -> Config {
        Config {
            worker_id: "node1-gpu0".into(),
            model: "llama-3.1-8b".into(),
            ..Config::default()
        }
    }

    #[test]
    fn parses_toml_and_applies_environment_overrides() {
        let mut c = Config::from_toml_str(
            r#"
            worker_id = "n1-gpu2"
            model = "qwen/qwen2.5-7b"
            gpu_index = 2
            model_server_url = "http://127.0.0.1:9000"
            model_server_kind = "sglang"
            max_concurrency = 8
            nats_url = "nats://10.0.0.1:4222"
            "#,
            "test",
        )
        .unwrap();
        assert_eq!(c.model_server_kind, ServerKind::Sglang);
        assert_eq!(c.gpu_index, Some(2));
        let env: HashMap<&str, &str> = [
            ("NATS_URL", "nats://127.0.0.1:14222"),
            ("REDIS_URL", "redis://127.0.0.1:16379/"),
        ]
        .into();
        c.apply_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(c.nats_url, "nats://127.0.0.1:14222");
        assert_eq!(c.redis_url, "redis://127.0.0.1:16379/");
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(Config::from_toml_str("worker_idd = \"x\"", "test").is_err());
    }

    #[test]
    fn the_dispatchers_publisher_token_is_no_worker_id() {
        let c = Config {
            worker_id: metronome_protocol::names::DISPATCHER_PUBLISHER.into(),
            ..Config::default()
        };
        let errors = c.validate().unwrap_err();
        assert!(
            errors
                .iter()
                .any(|e| e.field == "worker_id" && e.message.contains("reserved")),
            "{errors:?}"
        );
    }

    #[test]
    fn reports_every_bad_field() {
        let c = Config {
            worker_id: "node1.gpu0".into(),
            model: " ".into(),
            model_server_url: "ftp://x".into(),
            max_concurrency: 0,
            ewma_alpha: 1.5,
            heartbeat_interval_ms: 0,
            progress_ack_interval_ms: 40_000,
            nats_url: "nats://10.0.0.1:4222,http://10.0.0.2:4222".into(),
            stream_replicas: 4,
            ..Config::default()
        };
        let errors = c.validate().unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        for f in [
            "worker_id",
            "model",
            "model_server_url",
            "max_concurrency",
            "ewma_alpha",
            "heartbeat_interval_ms",
            "progress_ack_interval_ms",
            "nats_url",
            "stream_replicas",
        ] {
            assert!(fields.contains(&f), "{f} missing from {fields:?}");
        }
        assert_eq!(valid().validate(), Ok(()));
    }

    #[test]
    fn a_perf_prior_table_is_read_validated_and_printed() {
        assert_eq!(valid().perf_prior(), PerfPrior::default());
        let c = Config::from_toml_str(
            r#"
            worker_id = "n1-gpu0"
            model = "m"
            [perf_prior]
            step_base_ms = 12.5
            forgetting = 0.95
            "#,
            "test",
        )
        .unwrap();
        let prior = c.perf_prior();
        assert_eq!((prior.step_base_ms, prior.forgetting), (12.5, 0.95));
        assert_eq!(prior.ttft_base_ms, PerfPrior::default().ttft_base_ms);
        assert_eq!(c.validate(), Ok(()));
        let printed = Config::from_toml_str(&c.to_toml(), "printed").unwrap();
        assert_eq!(printed, c);

        assert!(
            Config::from_toml_str("[perf_prior]\nstep_base = 1.0\n", "test").is_err(),
            "unknown prior keys are refused"
        );
        let bad = Config {
            perf_prior: Some(PerfPrior {
                forgetting: 2.0,
                step_base_ms: -1.0,
                ..PerfPrior::default()
            }),
            ..valid()
        };
        let errors = bad.validate().unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert!(fields.contains(&"perf_prior.forgetting"), "{fields:?}");
        assert!(fields.contains(&"perf_prior.step_base_ms"), "{fields:?}");
    }

    #[test]
    fn max_concurrency_defaults_to_a_safety_ceiling() {
        assert_eq!(Config::default().max_concurrency, 256);
    }

    #[test]
    fn bad_environment_value_is_an_error() {
        let mut c = valid();
        let r =
            c.apply_env(|k| (k == "METRONOME_WORKER_MAX_CONCURRENCY").then(|| "many".to_string()));
        assert!(r.is_err());
    }
}
