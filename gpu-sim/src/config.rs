//! Configuration of the simulator: a list of simulated GPUs, each one model on one port with
//! its own speed and engine knobs.
//!
//! Sources, later wins: defaults, a TOML file (`[[gpu]]` tables), environment
//! (`METRONOME_SIM_SEED`, `METRONOME_SIM_HOST`, `METRONOME_SIM_GPUS` = `;`-separated GPU
//! specs), command line. A GPU spec is `key=value` pairs separated by commas, with the same
//! keys as a `[[gpu]]` table: `model=llama-3.1-8b,port=8001,speed=0.5`.
//!
//! Invariants after [`SimConfig::validate`]: at least one GPU; speeds finite and > 0;
//! non-zero ports unique; the KV cache holds at least one block and `max_model_len` tokens;
//! the step budget covers `max_num_seqs` decodes. Every violated rule is reported with its
//! field path (`gpu[1].speed`), not just the first.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use crate::cost::StepCost;
use crate::engine::EngineParams;

/// Default model name, the model the calibration is for.
pub const DEFAULT_MODEL: &str = "llama-3.1-8b";

/// One simulated GPU serving one model. Defaults are calibrated for an 8B model on one
/// 24 GB, ≈ 1 TB/s GPU (see `gpu-sim/README.md`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimGpuConfig {
    /// Model name served (requests for another name get 404).
    pub model: String,
    /// Address to listen on.
    pub host: IpAddr,
    /// Port to listen on; 0 picks a free one.
    pub port: u16,
    /// Speed factor: every step takes `1 / speed` as long (0.5 = a GPU half as fast).
    pub speed: f64,
    /// Seed of the generated text.
    pub seed: u64,
    /// Decode step time at batch 1 (reading the weights once), in ms. 16.7 ms ≈ 60 tokens/s.
    pub base_step_ms: f64,
    /// Relative step-time growth per additional decoding sequence.
    pub alpha: f64,
    /// Prefill (and recompute) cost per prompt token, in ms; stalls decode in that step.
    pub prefill_ms_per_token: f64,
    /// Attention cost per cached token read in a step, in ms.
    pub kv_read_ms_per_token: f64,
    /// KV cache capacity in tokens (rounded down to whole blocks).
    pub kv_capacity_tokens: u32,
    /// Tokens per KV block (vLLM's default is 16).
    pub block_size: u32,
    /// Most sequences running at once (vLLM's `max_num_seqs`).
    pub max_num_seqs: u32,
    /// Token budget per step for prefill chunks plus decodes (vLLM's `max_num_batched_tokens`).
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output a request may ask for; longer requests get 400.
    pub max_model_len: u32,
    /// Output length when a request gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Per-token probability of an early end-of-sequence for requests without
    /// `ignore_eos: true`. 0 (the default) always generates exactly `max_tokens`.
    pub eos_probability: f64,
    /// Reuse the KV blocks of prompt prefixes already computed (vLLM's automatic prefix
    /// caching, `enable_prefix_caching`, on by default in vLLM v1).
    pub enable_prefix_caching: bool,
    /// Publish the prefix cache's KV events in vLLM's wire format on this ZMQ PUB address
    /// (vLLM's `--kv-events-config` `endpoint`): `tcp://*:5557` or `tcp://127.0.0.1:5557`
    /// binds (port 0 picks a free one). Absent (the default): no events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER address where subscribers ask for missed event batches (vLLM's
    /// `replay_endpoint`). Needs `kv_events_endpoint`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic frame of every event message (vLLM's `topic`, empty by default).
    pub kv_events_topic: String,
}

impl Default for SimGpuConfig {
    fn default() -> Self {
        SimGpuConfig {
            model: DEFAULT_MODEL.to_string(),
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8001,
            speed: 1.0,
            seed: 42,
            base_step_ms: 16.7,
            alpha: 0.01,
            prefill_ms_per_token: 0.16,
            kv_read_ms_per_token: 0.00013,
            kv_capacity_tokens: 40_000,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 32_768,
            default_max_tokens: 256,
            eos_probability: 0.0,
            enable_prefix_caching: true,
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            kv_events_topic: String::new(),
        }
    }
}

impl SimGpuConfig {
    /// A GPU with the calibrated defaults, serving `model` on a free port of 127.0.0.1.
    pub fn new(model: impl Into<String>) -> Self {
        SimGpuConfig {
            model: model.into(),
            port: 0,
            ..SimGpuConfig::default()
        }
    }

    /// A GPU that answers as fast as it can (no simulated time): for overhead benchmarks.
    pub fn zero_delay(model: impl Into<String>) -> Self {
        SimGpuConfig {
            base_step_ms: 0.0,
            prefill_ms_per_token: 0.0,
            kv_read_ms_per_token: 0.0,
            ..SimGpuConfig::new(model)
        }
    }

    /// Parse a command-line GPU spec (`model=m,port=8001,speed=0.5`) over the defaults.
    pub fn from_spec(spec: &str) -> Result<Self, ConfigError> {
        let mut table = toml::Table::new();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| {
                ConfigError::Spec(format!("`{pair}` in `{spec}` is not key=value"))
            })?;
            table.insert(key.trim().to_string(), spec_value(value.trim()));
        }
        SimGpuConfig::deserialize(toml::Value::Table(table))
            .map_err(|e| ConfigError::Spec(format!("`{spec}`: {}", e.message())))
    }

    /// The engine parameters these knobs describe.
    pub fn engine_params(&self) -> EngineParams {
        EngineParams {
            block_size: self.block_size,
            num_blocks: self.num_blocks(),
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_prefix_caching: self.enable_prefix_caching,
            cost: StepCost {
                base_step_ms: self.base_step_ms,
                alpha: self.alpha,
                prefill_ms_per_token: self.prefill_ms_per_token,
                kv_read_ms_per_token: self.kv_read_ms_per_token,
                speed: self.speed,
            },
        }
    }

    /// KV blocks: the capacity rounded down to whole blocks.
    pub fn num_blocks(&self) -> u32 {
        self.kv_capacity_tokens
            .checked_div(self.block_size)
            .unwrap_or(0)
    }

    /// Field errors of this GPU, with paths under `prefix` (e.g. `gpu[0]`).
    pub fn validate_at(&self, prefix: &str) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let mut fail = |field: &str, message: String| {
            errors.push(FieldError {
                field: format!("{prefix}.{field}"),
                message,
            })
        };
        if self.model.trim().is_empty() {
            fail("model", "must not be empty".into());
        }
        if !(self.speed.is_finite() && self.speed > 0.0) {
            fail(
                "speed",
                format!("must be a finite number > 0, got {}", self.speed),
            );
        }
        for (name, value) in [
            ("base_step_ms", self.base_step_ms),
            ("alpha", self.alpha),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("kv_read_ms_per_token", self.kv_read_ms_per_token),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                fail(name, format!("must be a finite number >= 0, got {value}"));
            }
        }
        if !(self.eos_probability.is_finite() && (0.0..1.0).contains(&self.eos_probability)) {
            fail(
                "eos_probability",
                format!("must be in [0, 1), got {}", self.eos_probability),
            );
        }
        if self.block_size == 0 {
            fail("block_size", "must be at least 1".into());
        } else if self.kv_capacity_tokens < self.block_size {
            fail(
                "kv_capacity_tokens",
                format!(
                    "must hold at least one block of {} tokens, got {}",
                    self.block_size, self.kv_capacity_tokens
                ),
            );
        }
        if self.max_num_seqs == 0 {
            fail("max_num_seqs", "must be at least 1".into());
        }
        if self.max_num_batched_tokens < self.max_num_seqs.max(1) {
            fail(
                "max_num_batched_tokens",
                format!(
                    "must be at least max_num_seqs ({}) so every running sequence can decode each step, got {}",
                    self.max_num_seqs, self.max_num_batched_tokens
                ),
            );
        }
        if self.max_model_len < 2 {
            fail(
                "max_model_len",
                "must be at least 2 (one prompt and one output token)".into(),
            );
        } else if self.block_size > 0 {
            let capacity = u64::from(self.num_blocks()) * u64::from(self.block_size);
            if u64::from(self.max_model_len) > capacity + 1 {
                fail(
                    "max_model_len",
                    format!(
                        "must fit the KV cache ({capacity} tokens in whole blocks) or a long request could never finish, got {}",
                        self.max_model_len
                    ),
                );
            }
        }
        if self.default_max_tokens == 0 {
            fail("default_max_tokens", "must be at least 1".into());
        }
        for (name, endpoint) in [
            ("kv_events_endpoint", &self.kv_events_endpoint),
            ("kv_events_replay_endpoint", &self.kv_events_replay_endpoint),
        ] {
            if let Some(e) = endpoint {
                if let Err(why) = crate::kv_publisher::bind_address(e) {
                    fail(name, why);
                }
            }
        }
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            fail(
                "kv_events_replay_endpoint",
                "needs kv_events_endpoint (replay serves the batches published there)".into(),
            );
        }
        if self.kv_events_endpoint.is_some() && !self.enable_prefix_caching {
            fail(
                "kv_events_endpoint",
                "needs enable_prefix_caching (without a prefix cache there are no KV events)"
                    .into(),
            );
        }
        errors
    }
}

/// Turn a spec value into the TOML value it most likely means.
fn spec_value(raw: &str) -> toml::Value {
    if let Ok(i) = raw.parse::<i64>() {
        toml::Value::Integer(i)
    } else if let Ok(f) = raw.parse::<f64>() {
        toml::Value::Float(f)
    } else if let Ok(b) = raw.parse::<bool>() {
        toml::Value::Boolean(b)
    } else {
        toml::Value::String(raw.to_string())
    }
}

/// The whole simulator: every GPU this process hosts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// When set, replaces every GPU's `seed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// When set, replaces every GPU's `host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<IpAddr>,
    #[serde(default = "default_gpus")]
    pub gpu: Vec<SimGpuConfig>,
}

fn default_gpus() -> Vec<SimGpuConfig> {
    vec![SimGpuConfig::default()]
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: None,
            host: None,
            gpu: default_gpus(),
        }
    }
}

impl SimConfig {
    /// Parse a TOML document.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        metronome_runtime::config::parse_toml(text, "config").map_err(ConfigError::from)
    }

    /// Read and parse a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        metronome_runtime::config::read_file(path).map_err(ConfigError::from)
    }

    /// Apply environment overrides read through `var` ([`SETTINGS`] and [`ENV_GPUS`]), so
    /// tests need not touch the process environment.
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        metronome_runtime::settings::apply_env(self, &SETTINGS, &var)
            .map_err(|e| ConfigError::Env(e.to_string()))?;
        if let Some(gpus) = var(ENV_GPUS) {
            self.gpu = parse_specs(gpus.split(';'))?;
        }
        Ok(())
    }

    /// The GPUs as they will run: top-level `seed` and `host` applied.
    pub fn effective_gpus(&self) -> Vec<SimGpuConfig> {
        self.gpu
            .iter()
            .cloned()
            .map(|mut g| {
                if let Some(seed) = self.seed {
                    g.seed = seed;
                }
                if let Some(host) = self.host {
                    g.host = host;
                }
                g
            })
            .collect()
    }

    /// The effective configuration with `seed` and `host` folded into each GPU.
    pub fn effective(&self) -> SimConfig {
        SimConfig {
            seed: None,
            host: None,
            gpu: self.effective_gpus(),
        }
    }

    /// Every field error; empty when the configuration is usable.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        if self.gpu.is_empty() {
            errors.push(FieldError {
                field: "gpu".into(),
                message: "at least one GPU is required".into(),
            });
        }
        let mut seen = HashSet::new();
        for (i, g) in self.effective_gpus().iter().enumerate() {
            errors.extend(g.validate_at(&format!("gpu[{i}]")));
            if g.port != 0 && !seen.insert((g.host, g.port)) {
                errors.push(FieldError {
                    field: format!("gpu[{i}].port"),
                    message: format!("port {} is already used by another GPU", g.port),
                });
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// Parse GPU specs, skipping empty ones.
pub fn parse_specs<'a>(
    specs: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<SimGpuConfig>, ConfigError> {
    specs
        .into_iter()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(SimGpuConfig::from_spec)
        .collect()
}

pub use metronome_runtime::config::FieldError;
use metronome_runtime::settings::{Setting, SettingTable};

/// The keys the command line and the environment set: each flag, its variable and its
/// help, declared once (the binary's flags and [`SimConfig::apply_env`] both read this).
/// `METRONOME_SIM_GPUS` ([`ENV_GPUS`], GPU specs separated by `;`, replacing the file's
/// GPUs) is not a key: the `--gpu` flag and [`SimConfig::apply_env`] read it besides these.
pub const SETTINGS: [Setting; 2] = [
    Setting::new(
        "seed",
        "seed",
        "SEED",
        "Seed of the generated text, for every GPU (key `seed`)",
    )
    .env("METRONOME_SIM_SEED"),
    Setting::new(
        "host",
        "host",
        "HOST",
        "Address every GPU listens on, e.g. 0.0.0.0 in a container (key `host`)",
    )
    .env("METRONOME_SIM_HOST"),
];

/// [`SETTINGS`] as the type the binary's flags are built from.
pub struct Settings;

impl SettingTable for Settings {
    const SETTINGS: &'static [Setting] = &SETTINGS;
}

/// The environment variable with the GPU specs.
pub const ENV_GPUS: &str = "METRONOME_SIM_GPUS";

/// Configuration that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config: {0}")]
    Io(String),
    #[error("invalid TOML config: {0}")]
    Toml(String),
    #[error("invalid GPU spec {0}")]
    Spec(String),
    #[error("invalid environment override {0}")]
    Env(String),
    #[error("invalid config: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

impl From<metronome_runtime::config::ConfigError> for ConfigError {
    fn from(e: metronome_runtime::config::ConfigError) -> Self {
        use metronome_runtime::config::ConfigError as Shared;
        match e {
            Shared::Read { .. } => ConfigError::Io(e.to_string()),
            Shared::Parse { .. } => ConfigError::Toml(e.to_string()),
            Shared::Override { .. } => ConfigError::Env(e.to_string()),
            Shared::Invalid(errors) => ConfigError::Invalid(errors),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn kv_event_settings_are_checked_and_parse_from_a_spec() {
        let g = SimGpuConfig::from_spec(
            "model=m,port=0,kv_events_endpoint=tcp://*:5557,kv_events_topic=kv",
        )
        .unwrap();
        assert_eq!(g.kv_events_endpoint.as_deref(), Some("tcp://*:5557"));
        assert!(g.enable_prefix_caching, "on by default");
        assert!(g.validate_at("gpu").is_empty());
        let bad = SimGpuConfig {
            kv_events_endpoint: Some("ipc:///tmp/kv".into()),
            kv_events_replay_endpoint: None,
            enable_prefix_caching: false,
            ..SimGpuConfig::new("m")
        };
        let fields: Vec<String> = bad
            .validate_at("gpu")
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(fields, ["gpu.kv_events_endpoint", "gpu.kv_events_endpoint"]);
        let orphan_replay = SimGpuConfig {
            kv_events_replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            ..SimGpuConfig::new("m")
        };
        let fields: Vec<String> = orphan_replay
            .validate_at("gpu")
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(fields, ["gpu.kv_events_replay_endpoint"]);
    }

    #[test]
    fn defaults_are_valid_and_calibrated() {
        let c = SimConfig::default();
        assert_eq!(c.validate(), Ok(()));
        let g = &c.gpu[0];
        assert_eq!(g.num_blocks(), 2500);
        assert!(
            (1000.0 / g.base_step_ms - 60.0).abs() < 1.0,
            "≈ 60 tokens/s single stream"
        );
    }

    #[test]
    fn spec_parses_every_knob() {
        let g = SimGpuConfig::from_spec("model=llama-3.1-8b, port=8002,speed=0.5,base_step_ms=1,kv_capacity_tokens=256,host=0.0.0.0").unwrap();
        assert_eq!(g.port, 8002);
        assert_eq!(g.speed, 0.5);
        assert_eq!(g.base_step_ms, 1.0);
        assert_eq!(g.kv_capacity_tokens, 256);
        assert_eq!(g.host.to_string(), "0.0.0.0");
        assert_eq!(g.model, "llama-3.1-8b");
    }

    #[test]
    fn spec_rejects_unknown_keys_and_bad_pairs() {
        assert!(matches!(
            SimGpuConfig::from_spec("model=m,sped=1"),
            Err(ConfigError::Spec(_))
        ));
        assert!(matches!(
            SimGpuConfig::from_spec("model"),
            Err(ConfigError::Spec(_))
        ));
        assert!(matches!(
            SimGpuConfig::from_spec("port=x"),
            Err(ConfigError::Spec(_))
        ));
    }

    #[test]
    fn toml_with_several_gpus() {
        let c = SimConfig::from_toml(
            r#"
            seed = 7
            [[gpu]]
            model = "a"
            port = 8001
            [[gpu]]
            model = "b"
            port = 8002
            speed = 0.5
            "#,
        )
        .unwrap();
        assert_eq!(c.validate(), Ok(()));
        let gpus = c.effective_gpus();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].speed, 0.5);
        assert!(gpus.iter().all(|g| g.seed == 7));
        // The effective config round-trips through TOML (what --check-config prints).
        let printed = toml::to_string_pretty(&c.effective()).unwrap();
        assert_eq!(SimConfig::from_toml(&printed).unwrap(), c.effective());
    }

    #[test]
    fn validation_reports_every_field() {
        let mut bad = SimGpuConfig::new("");
        bad.speed = 0.0;
        bad.kv_capacity_tokens = 8;
        bad.alpha = -1.0;
        bad.max_num_batched_tokens = 1;
        let mut dup = SimGpuConfig::new("m");
        dup.port = 9000;
        let c = SimConfig {
            seed: None,
            host: None,
            gpu: vec![bad, dup.clone(), dup],
        };
        let errors = c.validate().unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        for expected in [
            "gpu[0].model",
            "gpu[0].speed",
            "gpu[0].kv_capacity_tokens",
            "gpu[0].alpha",
            "gpu[0].max_num_batched_tokens",
            "gpu[2].port",
        ] {
            assert!(
                fields.contains(&expected),
                "{expected} missing from {fields:?}"
            );
        }
    }

    #[test]
    fn max_model_len_must_fit_the_cache() {
        let mut g = SimGpuConfig::new("m");
        g.kv_capacity_tokens = 1000;
        g.max_model_len = 2000;
        let errors = g.validate_at("gpu[0]");
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].field, "gpu[0].max_model_len");
    }

    #[test]
    fn zero_port_may_repeat() {
        let c = SimConfig {
            seed: None,
            host: None,
            gpu: vec![SimGpuConfig::new("a"), SimGpuConfig::new("b")],
        };
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn env_overrides() {
        let vars: HashMap<&str, &str> = [
            ("METRONOME_SIM_SEED", "9"),
            ("METRONOME_SIM_HOST", "0.0.0.0"),
            ("METRONOME_SIM_GPUS", "model=a,port=1; model=b,port=2"),
        ]
        .into();
        let mut c = SimConfig::default();
        c.apply_env(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        let gpus = c.effective_gpus();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].model, "b");
        assert!(gpus
            .iter()
            .all(|g| g.seed == 9 && g.host.to_string() == "0.0.0.0"));
        let mut c = SimConfig::default();
        assert!(c
            .apply_env(|k| (k == "METRONOME_SIM_SEED").then(|| "x".to_string()))
            .is_err());
    }
}
