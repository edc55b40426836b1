//! The load spec (`LoadSpec`, this crate's `Config`): what to send, where, how fast, and
//! the SLO to judge it by. Loaded from TOML, then environment overrides, then command-line
//! flags; `validate()` reports every invalid field at once.
//!
//! Invariants after a successful `validate()`: a positive rate or time scale (never both
//! for a trace), a bounded run (a Poisson workload needs `limit` or `duration_s`; a trace
//! is bounded by its length), `max_in_flight >= 1`, positive timeouts.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use metronome_runtime::settings::{Setting, SettingTable};
use serde::{Deserialize, Serialize};

use crate::dist::LengthDist;
use crate::error::{FieldError, LoadError};

/// Which OpenAI API endpoint requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST {base_url}/chat/completions` with one user message.
    #[default]
    Chat,
    /// `POST {base_url}/completions` with a `prompt` string.
    Completions,
}

impl Endpoint {
    /// Path appended to the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/chat/completions",
            Endpoint::Completions => "/completions",
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "chat" => Ok(Endpoint::Chat),
            "completions" => Ok(Endpoint::Completions),
            other => Err(format!("{other:?}: expected chat or completions")),
        }
    }
}

/// Where arrivals and lengths come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Workload {
    /// Replay of a trace CSV (see [`crate::trace`]). Selection and scaling are applied in
    /// this order: skip requests before `start_offset_s` (trace seconds), keep the first
    /// `limit`, rescale time (`time_scale`, or `rate_rps` which multiplies every
    /// inter-arrival gap by `trace_mean_rate / rate_rps`, keeping the shape), then keep
    /// requests arriving before `duration_s` (run seconds).
    Trace {
        path: PathBuf,
        /// Multiplies every arrival offset: 0.5 replays twice as fast.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        time_scale: Option<f64>,
        /// Target mean arrival rate in requests/s.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rate_rps: Option<f64>,
        /// Seconds of trace skipped at its start.
        #[serde(default)]
        start_offset_s: f64,
    },
    /// Poisson arrivals (exponential inter-arrival gaps) at `rate_rps`, seeded.
    Poisson {
        rate_rps: f64,
        prompt_tokens: LengthDist,
        output_tokens: LengthDist,
    },
    /// Shared system prompts ([`crate::prefixes::shared_prefix_plan`]): `groups ×
    /// users_per_group` requests in a seeded random order at Poisson arrivals of
    /// `rate_rps`, each its group's system prompt of `prefix_tokens` and a user message of
    /// its own (`question_tokens`).
    #[serde(rename = "shared_prefix")]
    SharedPrefix {
        rate_rps: f64,
        groups: u32,
        users_per_group: u32,
        prefix_tokens: u32,
        question_tokens: LengthDist,
        output_tokens: LengthDist,
    },
    /// Multi-turn conversations or agent loops ([`crate::prefixes::multi_turn_plan`]):
    /// every turn re-sends the whole history and one new user message; `rate_rps` is the
    /// mean request rate over all turns, `think_s` the mean think time between a reply and
    /// the next turn; `system_tokens` (0: none) a system prompt every conversation shares.
    #[serde(rename = "multi_turn")]
    MultiTurn {
        rate_rps: f64,
        turns: LengthDist,
        #[serde(default)]
        system_tokens: u32,
        user_tokens: LengthDist,
        output_tokens: LengthDist,
        think_s: f64,
    },
}

impl Default for Workload {
    fn default() -> Self {
        Workload::Poisson {
            rate_rps: 1.0,
            prompt_tokens: LengthDist::Fixed(256),
            output_tokens: LengthDist::Fixed(128),
        }
    }
}

/// Service-level objective for goodput: a request is *good* when it succeeded, its TTFT is
/// at most `ttft_ms` and its tokens/s is at least `tok_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tok_s: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Slo {
            ttft_ms: 2000.0,
            tok_s: 30.0,
        }
    }
}

/// One tenant's share of a Poisson workload: its own arrival stream at `rate_rps`, sent
/// with its own API key, reported on its own (`Summary::per_tenant`). Lengths come from the
/// workload's distributions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLoad {
    /// Label of its requests in records and summaries (need not be the server's name).
    pub name: String,
    /// Sent as `Authorization: Bearer …` for this tenant's requests; absent: the spec's
    /// `api_key`. Never written to outputs.
    #[serde(default, skip_serializing)]
    pub api_key: Option<String>,
    /// Mean arrival rate of this tenant's requests, requests/s.
    pub rate_rps: f64,
}

/// A complete description of one load run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadSpec {
    /// OpenAI-style base URL including the version prefix, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    pub model: String,
    pub endpoint: Endpoint,
    /// Sent as `Authorization: Bearer …` when set. Never written to outputs.
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    pub workload: Workload,
    /// At most this many requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// Only requests arriving within this many seconds of the start are sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
    /// Seeds Poisson arrivals and sampled lengths.
    pub seed: u64,
    /// Cap on outstanding requests; an arrival finding the cap reached is dropped and
    /// recorded as an error of kind `dropped` (open loop: never delayed).
    pub max_in_flight: usize,
    /// Per-request limit, from send to the end of the stream.
    pub request_timeout_s: f64,
    /// After the last arrival, outstanding requests get this long before being cut off
    /// and recorded as errors of kind `timeout`.
    pub drain_timeout_s: f64,
    /// Send the non-standard body fields `ignore_eos` (vLLM) and `metronome_prompt_tokens`.
    /// Turn off for servers that reject unknown fields.
    pub extensions: bool,
    /// Start each prompt with a random per-run nonce and the request id, so servers with
    /// prefix caching cannot reuse one request's prefill for another (nor a previous
    /// run's).
    pub unique_prompts: bool,
    /// Seconds between progress lines on stderr.
    pub progress_interval_s: f64,
    pub slo: Slo,
    /// Traffic per tenant (`[[tenants]]`, Poisson workloads only): each tenant's arrivals
    /// are drawn at its own rate, and the workload's `rate_rps` is unused. `limit` and
    /// `duration_s` bound the merged plan.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantLoad>,
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            base_url: "http://127.0.0.1:8080/v1".into(),
            model: String::new(),
            endpoint: Endpoint::Chat,
            api_key: None,
            workload: Workload::default(),
            limit: None,
            duration_s: None,
            seed: 42,
            max_in_flight: 1024,
            request_timeout_s: 600.0,
            drain_timeout_s: 120.0,
            extensions: true,
            unique_prompts: true,
            progress_interval_s: 5.0,
            slo: Slo::default(),
            tenants: Vec::new(),
        }
    }
}

/// The keys the command line and the environment set: each flag, its variable and its
/// help, declared once (the binary's flags and [`LoadSpec::apply_env`] both read this).
pub const SETTINGS: [Setting; 3] = [
    Setting::new(
        "base_url",
        "base-url",
        "URL",
        "OpenAI-style base URL including the version prefix [default: http://127.0.0.1:8080/v1]",
    )
    .env("OPENAI_BASE_URL"),
    Setting::new(
        "model",
        "model",
        "MODEL",
        "Model name sent in every request",
    )
    .env("METRONOME_LOADGEN_MODEL"),
    Setting::new(
        "api_key",
        "api-key",
        "KEY",
        "Bearer token, if the server wants one",
    )
    .env("OPENAI_API_KEY")
    .secret(),
];

/// [`SETTINGS`] as the type the binary's flags are built from.
pub struct Settings;

impl SettingTable for Settings {
    const SETTINGS: &'static [Setting] = &SETTINGS;
}

impl LoadSpec {
    /// Parses a TOML spec; absent fields take their defaults.
    pub fn from_toml_str(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Reads a TOML spec file.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|e| LoadError::Config {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_toml_str(&text).map_err(|reason| LoadError::Config {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Applies the variables of [`SETTINGS`] through `lookup` (testable without touching
    /// the process environment); empty values are ignored.
    pub fn apply_env(
        &mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), metronome_runtime::config::ConfigError> {
        metronome_runtime::settings::apply_env(self, &SETTINGS, lookup)
    }

    /// Full URL requests are posted to.
    pub fn request_url(&self) -> String {
        format!(
            "{}{}",
            self.base_url.trim_end_matches('/'),
            self.endpoint.path()
        )
    }

    /// Every invalid field, or `Ok` when the spec can run.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut bad = |field: &str, message: &str| {
            errs.push(FieldError {
                field: field.to_string(),
                message: message.to_string(),
            })
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            bad("base_url", "must start with http:// or https://");
        }
        if self.base_url.starts_with("https://") {
            bad(
                "base_url",
                "https is not supported by this build (no TLS); use http://",
            );
        }
        if self.model.trim().is_empty() {
            bad("model", "required (the model name the server serves)");
        }
        if self.limit == Some(0) {
            bad("limit", "must be at least 1");
        }
        if let Some(d) = self.duration_s {
            if !positive(d) {
                bad("duration_s", "must be > 0");
            }
        }
        if self.max_in_flight == 0 {
            bad("max_in_flight", "must be at least 1");
        }
        if !positive(self.request_timeout_s) {
            bad("request_timeout_s", "must be > 0");
        }
        if !(self.drain_timeout_s.is_finite() && self.drain_timeout_s >= 0.0) {
            bad("drain_timeout_s", "must be >= 0");
        }
        if !positive(self.progress_interval_s) {
            bad("progress_interval_s", "must be > 0");
        }
        if !(self.slo.ttft_ms.is_finite() && self.slo.ttft_ms >= 0.0) {
            bad("slo.ttft_ms", "must be >= 0");
        }
        if !(self.slo.tok_s.is_finite() && self.slo.tok_s >= 0.0) {
            bad("slo.tok_s", "must be >= 0");
        }
        match &self.workload {
            Workload::Trace {
                path,
                time_scale,
                rate_rps,
                start_offset_s,
            } => {
                if !path.is_file() {
                    bad(
                        "workload.path",
                        &format!("no such file: {}", path.display()),
                    );
                }
                if time_scale.is_some() && rate_rps.is_some() {
                    bad(
                        "workload.rate_rps",
                        "give either time_scale or rate_rps, not both",
                    );
                }
                if let Some(t) = time_scale {
                    if !positive(*t) {
                        bad("workload.time_scale", "must be > 0");
                    }
                }
                if let Some(r) = rate_rps {
                    if !positive(*r) {
                        bad("workload.rate_rps", "must be > 0");
                    }
                }
                if !(start_offset_s.is_finite() && *start_offset_s >= 0.0) {
                    bad("workload.start_offset_s", "must be >= 0");
                }
            }
            Workload::Poisson { rate_rps, .. } => {
                if !positive(*rate_rps) {
                    bad("workload.rate_rps", "must be > 0");
                }
                if self.limit.is_none() && self.duration_s.is_none() {
                    bad(
                        "limit",
                        "a Poisson workload needs limit or duration_s (or both)",
                    );
                }
            }
            Workload::SharedPrefix {
                rate_rps,
                groups,
                users_per_group,
                prefix_tokens,
                ..
            } => {
                if !positive(*rate_rps) {
                    bad("workload.rate_rps", "must be > 0");
                }
                if *groups == 0 {
                    bad("workload.groups", "must be >= 1");
                }
                if *users_per_group == 0 {
                    bad("workload.users_per_group", "must be >= 1");
                }
                if *prefix_tokens == 0 {
                    bad("workload.prefix_tokens", "must be >= 1");
                }
            }
            Workload::MultiTurn {
                rate_rps, think_s, ..
            } => {
                if !positive(*rate_rps) {
                    bad("workload.rate_rps", "must be > 0");
                }
                if !(think_s.is_finite() && *think_s >= 0.0) {
                    bad("workload.think_s", "must be >= 0");
                }
                if self.limit.is_none() && self.duration_s.is_none() {
                    bad(
                        "limit",
                        "a multi-turn workload needs limit or duration_s (or both)",
                    );
                }
            }
        }
        if !self.tenants.is_empty() && !matches!(self.workload, Workload::Poisson { .. }) {
            bad(
                "tenants",
                "per-tenant traffic needs a Poisson workload (the others have one arrival stream)",
            );
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if t.name.trim().is_empty() {
                bad(&format!("tenants[{i}].name"), "required");
            } else if !names.insert(t.name.as_str()) {
                bad(
                    &format!("tenants[{i}].name"),
                    &format!("duplicate tenant {:?}", t.name),
                );
            }
            if !positive(t.rate_rps) {
                bad(&format!("tenants[{i}].rate_rps"), "must be > 0");
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }

    /// The API key a request of tenant `tenant` (an index into `tenants`) is sent with.
    pub fn api_key_for(&self, tenant: Option<usize>) -> Option<&str> {
        tenant
            .and_then(|i| self.tenants.get(i))
            .and_then(|t| t.api_key.as_deref())
            .or(self.api_key.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poisson_spec() -> LoadSpec {
        LoadSpec {
            model: "m".into(),
            limit: Some(10),
            ..LoadSpec::default()
        }
    }

    #[test]
    fn default_with_model_and_bound_is_valid() {
        assert_eq!(poisson_spec().validate(), Ok(()));
    }

    #[test]
    fn every_bad_field_is_reported() {
        let spec = LoadSpec {
            base_url: "ftp://x".into(),
            max_in_flight: 0,
            request_timeout_s: 0.0,
            workload: Workload::Poisson {
                rate_rps: -1.0,
                prompt_tokens: LengthDist::Fixed(1),
                output_tokens: LengthDist::Fixed(1),
            },
            ..LoadSpec::default()
        };
        let errs = spec.validate().unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        for f in [
            "base_url",
            "model",
            "max_in_flight",
            "request_timeout_s",
            "workload.rate_rps",
            "limit",
        ] {
            assert!(fields.contains(&f), "{f} missing from {fields:?}");
        }
    }

    #[test]
    fn prefix_workloads_parse_and_their_bad_fields_are_reported() {
        let shared = r#"
            model = "m"
            limit = 10
            [workload]
            kind = "shared_prefix"
            rate_rps = 2.0
            groups = 0
            users_per_group = 3
            prefix_tokens = 0
            question_tokens = "fixed:10"
            output_tokens = "fixed:5"
        "#;
        let spec = LoadSpec::from_toml_str(shared).unwrap();
        let fields = |spec: &LoadSpec| -> Vec<String> {
            spec.validate()
                .err()
                .unwrap_or_default()
                .into_iter()
                .map(|e| e.field)
                .collect()
        };
        assert_eq!(fields(&spec), ["workload.groups", "workload.prefix_tokens"]);
        let multi = r#"
            model = "m"
            [workload]
            kind = "multi_turn"
            rate_rps = 2.0
            turns = "uniform:2,4"
            user_tokens = "fixed:10"
            output_tokens = "fixed:5"
            think_s = -1.0
        "#;
        let spec = LoadSpec::from_toml_str(multi).unwrap();
        assert_eq!(fields(&spec), ["workload.think_s", "limit"]);
        let Workload::MultiTurn { system_tokens, .. } = spec.workload else {
            panic!("{:?}", spec.workload);
        };
        assert_eq!(system_tokens, 0, "no system prompt unless asked");
        let back = LoadSpec::from_toml_str(&toml::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn trace_rejects_both_scalings_and_missing_file() {
        let spec = LoadSpec {
            model: "m".into(),
            workload: Workload::Trace {
                path: "/nonexistent/trace.csv".into(),
                time_scale: Some(0.5),
                rate_rps: Some(3.0),
                start_offset_s: 0.0,
            },
            ..LoadSpec::default()
        };
        let fields: Vec<String> = spec
            .validate()
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert!(fields.contains(&"workload.path".to_string()));
        assert!(fields.contains(&"workload.rate_rps".to_string()));
    }

    #[test]
    fn toml_round_trip_and_defaults() {
        let text = r#"
            base_url = "http://10.0.0.1:9000/v1"
            model = "llama"
            endpoint = "completions"
            duration_s = 30.0
            [workload]
            kind = "poisson"
            rate_rps = 4.0
            prompt_tokens = "lognormal:mean=1500,sigma=0.8"
            output_tokens = "uniform:10,200"
            [slo]
            ttft_ms = 1000.0
        "#;
        let spec = LoadSpec::from_toml_str(text).unwrap();
        assert_eq!(spec.endpoint, Endpoint::Completions);
        assert_eq!(spec.slo.tok_s, 30.0);
        assert_eq!(spec.request_url(), "http://10.0.0.1:9000/v1/completions");
        assert_eq!(spec.validate(), Ok(()));
        let back = LoadSpec::from_toml_str(&toml::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
        assert!(LoadSpec::from_toml_str("modle = \"typo\"").is_err());
    }

    #[test]
    fn tenants_parse_keep_their_keys_out_of_outputs_and_are_checked() {
        let text = r#"
            model = "m"
            duration_s = 10.0
            api_key = "shared"
            [[tenants]]
            name = "flood"
            api_key = "mtk_a"
            rate_rps = 20.0
            [[tenants]]
            name = "steady"
            rate_rps = 2.0
        "#;
        let spec = LoadSpec::from_toml_str(text).unwrap();
        assert_eq!(spec.validate(), Ok(()));
        assert_eq!(spec.api_key_for(Some(0)), Some("mtk_a"));
        assert_eq!(spec.api_key_for(Some(1)), Some("shared"), "falls back");
        assert_eq!(spec.api_key_for(None), Some("shared"));
        let written = toml::to_string(&spec).unwrap();
        assert!(
            written.contains("steady") && !written.contains("mtk_a"),
            "{written}"
        );

        let mut bad = spec.clone();
        bad.tenants[1].name = "flood".into();
        bad.tenants[0].rate_rps = 0.0;
        bad.workload = Workload::Trace {
            path: "/nonexistent".into(),
            time_scale: None,
            rate_rps: None,
            start_offset_s: 0.0,
        };
        let fields: Vec<String> = bad
            .validate()
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        for f in ["tenants", "tenants[1].name", "tenants[0].rate_rps"] {
            assert!(fields.iter().any(|x| x == f), "{f} missing from {fields:?}");
        }
    }

    #[test]
    fn env_overrides_apply() {
        let mut spec = poisson_spec();
        spec.apply_env(|k| match k {
            "OPENAI_BASE_URL" => Some("http://gw:1/v1".into()),
            "OPENAI_API_KEY" => Some("1234".into()),
            "METRONOME_LOADGEN_MODEL" => Some(String::new()),
            _ => None,
        })
        .unwrap();
        assert_eq!(spec.base_url, "http://gw:1/v1");
        assert_eq!(
            spec.api_key.as_deref(),
            Some("1234"),
            "a numeric key stays text"
        );
        assert_eq!(spec.model, "m");
    }
}
