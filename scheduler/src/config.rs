//! Scheduler configuration: the weights of the seven score terms and the limits of the
//! admission filters.
//!
//! Every field has a default, so a TOML section may set only what it changes; unknown keys
//! are refused so a typo never silently falls back to a default. [`SchedulerConfig::validate`]
//! returns every field error at once, each naming its field by its TOML path.

use std::collections::BTreeMap;

use metronome_protocol::{Slo, SloRequest};
use serde::{Deserialize, Serialize};

use crate::perf::PerfPrior;

/// Weight of each score term. Every term is normalised to [0, 1] before weighting, so a
/// weight is the term's relative importance: a term at weight 1 can move a worker's total
/// by at most 1.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    pub active_requests: f64,
    pub queue_depth: f64,
    pub latency_ewma: f64,
    pub job_cost: f64,
    pub throughput_ewma: f64,
    pub kv_pressure: f64,
    pub gpu_utilisation: f64,
}

impl Default for Weights {
    /// Chosen for predictability. Admission has already kept every candidate within the
    /// SLO, so the score chooses among safe places: a job alone on a GPU is slowed by
    /// nothing and slows nothing, so the running count weighs most (an idle GPU beats a
    /// busy one unless the busy one wins on job cost and both EWMAs); the predicted service
    /// time of the job on the worker comes next; KV pressure follows because a full KV
    /// cache causes preemption (the worst latency cliff); queue depth is work that has not
    /// even started; the raw EWMAs and GPU utilisation mostly break near-ties.
    fn default() -> Self {
        Weights {
            active_requests: 2.0,
            queue_depth: 0.5,
            latency_ewma: 0.25,
            job_cost: 1.0,
            throughput_ewma: 0.25,
            kv_pressure: 0.75,
            gpu_utilisation: 0.25,
        }
    }
}

impl Weights {
    /// Weight of one term.
    pub fn get(&self, term: metronome_protocol::TermName) -> f64 {
        use metronome_protocol::TermName as T;
        match term {
            T::ActiveRequests => self.active_requests,
            T::QueueDepth => self.queue_depth,
            T::LatencyEwma => self.latency_ewma,
            T::JobCost => self.job_cost,
            T::ThroughputEwma => self.throughput_ewma,
            T::KvPressure => self.kv_pressure,
            T::GpuUtilisation => self.gpu_utilisation,
        }
    }

    /// The weights in [`TermName::ALL`](metronome_protocol::TermName::ALL) order.
    pub fn as_array(&self) -> [f64; 7] {
        metronome_protocol::TermName::ALL.map(|t| self.get(t))
    }

    /// The weights given in [`TermName::ALL`](metronome_protocol::TermName::ALL) order, as
    /// a decision records them: the inverse of [`Weights::as_array`].
    pub fn from_array(w: [f64; 7]) -> Weights {
        Weights {
            active_requests: w[0],
            queue_depth: w[1],
            latency_ewma: w[2],
            job_cost: w[3],
            throughput_ewma: w[4],
            kv_pressure: w[5],
            gpu_utilisation: w[6],
        }
    }
}

/// A model's service level objective in configuration.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SloConfig {
    /// Longest acceptable time to first token, ms, counted from submission.
    pub ttft_ms: u64,
    /// Lowest acceptable decode rate per request, tokens/s.
    pub min_tok_s: f64,
}

impl Default for SloConfig {
    /// An interactive chat service: first token within 2 s, then at least 30 tokens/s
    /// (faster than people read), the SLO DistServe-style goodput studies use for chat.
    fn default() -> Self {
        SloConfig {
            ttft_ms: 2_000,
            min_tok_s: 30.0,
        }
    }
}

impl From<SloConfig> for Slo {
    fn from(c: SloConfig) -> Slo {
        Slo {
            ttft_ms: c.ttft_ms,
            min_tok_s: c.min_tok_s,
        }
    }
}

/// Largest [`SchedulerConfig::lookahead`]: each job looked at is a full evaluation.
pub const MAX_LOOKAHEAD: usize = 64;

/// Limits of the admission filters and the scoring weights.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub weights: Weights,
    /// A worker whose last heartbeat is older than this is ineligible.
    pub heartbeat_timeout_ms: u64,
    /// Concurrency ceiling for a worker that reports `max_concurrency = 0`. A safety
    /// ceiling, not the admission mechanism: the SLO predictions decide how many jobs a
    /// worker takes.
    pub default_max_concurrency: u32,
    /// Share of a worker's KV capacity kept free (0.05 = admit only while 95 % would
    /// remain enough).
    pub kv_headroom_frac: f64,
    /// The SLO of every model without its own entry in `model_slo`.
    pub slo: SloConfig,
    /// Per-model SLOs, by model name.
    pub model_slo: BTreeMap<String, SloConfig>,
    /// The performance model a worker is predicted with until its agent reports a fitted
    /// one (an agent that fits none, or a leader that has not heard from it yet).
    pub perf_prior: PerfPrior,
    /// Least share of the prior's figures a worker's self-reported performance counts
    /// as: each fitted coefficient, and the latency EWMAs, are raised to at least this
    /// times the prior's ([`crate::provisioning::clamp_perf`]), so a worker cannot claim to
    /// be arbitrarily fast. In (0, 1].
    pub perf_claim_floor: f64,
    /// A reservation that no heartbeat has confirmed for this long expires.
    pub reservation_ttl_ms: u64,
    /// When no worker can take the job next in line without a predicted miss, how many
    /// younger jobs of its flow (same tenant and class) are tried in its place, oldest
    /// first (0: strict order). A large prompt that fits nowhere yet then does not hold
    /// back the small ones behind it that fit now; it keeps its place and goes first as
    /// soon as room opens.
    pub lookahead: usize,
    /// Prefix affinity ([`crate::affinity`]): the candidate holding the most of a job's
    /// prompt gets it over the score's choice when its predicted prefill cost (time to
    /// first token plus the stall on the streams running there) is no higher, while it
    /// would take at most this many times an even share of the candidates' placements of
    /// the last ~10 s. 0
    /// turns affinity off; otherwise at least 1.
    pub affinity_max_share: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            weights: Weights::default(),
            // Heartbeats come every ~1 s: three missed in a row means gone.
            heartbeat_timeout_ms: 3_000,
            // vLLM's default `max_num_seqs`: the batch the model server itself allows.
            default_max_concurrency: 256,
            kv_headroom_frac: 0.05,
            slo: SloConfig::default(),
            model_slo: BTreeMap::new(),
            perf_prior: PerfPrior::default(),
            // A twentieth: 1 ms a decode step (1,000 tokens/s for one stream) with the
            // default prior, beyond any single GPU serving an ~8B model.
            perf_claim_floor: 0.05,
            // Several heartbeats' worth, so one late heartbeat never drops live work.
            reservation_ttl_ms: 10_000,
            // Measured in the policy lab (metronome-lab, 3 seeds, both workloads, both
            // clusters, three ways of setting max_tokens): 4 to 8 gain 5-10 points of SLO
            // attainment from 90 % of nominal load on with no loss below it; longer
            // lookaheads gain more in overload and lose a little at moderate load on a
            // mixed-speed cluster.
            lookahead: 8,
            affinity_max_share: crate::affinity::DEFAULT_MAX_SHARE,
        }
    }
}

/// One invalid configuration field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// TOML path of the field, e.g. `weights.job_cost`.
    pub field: String,
    pub message: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl SchedulerConfig {
    /// Check every field; returns all errors, not just the first.
    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errors = Vec::new();
        for term in metronome_protocol::TermName::ALL {
            let w = self.weights.get(term);
            if !w.is_finite() || w < 0.0 {
                errors.push(ConfigError::new(
                    format!("weights.{}", term.as_str()),
                    format!("must be a finite number >= 0, got {w}"),
                ));
            }
        }
        if self.heartbeat_timeout_ms == 0 {
            errors.push(ConfigError::new("heartbeat_timeout_ms", "must be > 0"));
        }
        if self.default_max_concurrency == 0 {
            errors.push(ConfigError::new("default_max_concurrency", "must be > 0"));
        }
        let share = self.affinity_max_share;
        if !(share == 0.0 || (share.is_finite() && share >= 1.0)) {
            errors.push(ConfigError::new(
                "affinity_max_share",
                format!("must be 0 (off) or a finite number >= 1, got {share}"),
            ));
        }
        if !(0.0..1.0).contains(&self.kv_headroom_frac) {
            errors.push(ConfigError::new(
                "kv_headroom_frac",
                format!("must be in [0, 1), got {}", self.kv_headroom_frac),
            ));
        }
        let slos = std::iter::once(("slo".to_string(), &self.slo)).chain(
            self.model_slo
                .iter()
                .map(|(m, s)| (format!("model_slo.{m:?}"), s)),
        );
        for (path, slo) in slos {
            if slo.ttft_ms == 0 {
                errors.push(ConfigError::new(format!("{path}.ttft_ms"), "must be > 0"));
            }
            if !(slo.min_tok_s.is_finite() && slo.min_tok_s > 0.0) {
                errors.push(ConfigError::new(
                    format!("{path}.min_tok_s"),
                    format!("must be a finite number > 0, got {}", slo.min_tok_s),
                ));
            }
        }
        for e in self.perf_prior.validate("perf_prior") {
            errors.push(ConfigError::new(e.field, e.message));
        }
        if !(self.perf_claim_floor > 0.0 && self.perf_claim_floor <= 1.0) {
            errors.push(ConfigError::new(
                "perf_claim_floor",
                format!("must be in (0, 1], got {}", self.perf_claim_floor),
            ));
        }
        if self.reservation_ttl_ms == 0 {
            errors.push(ConfigError::new("reservation_ttl_ms", "must be > 0"));
        }
        if self.lookahead > MAX_LOOKAHEAD {
            errors.push(ConfigError::new(
                "lookahead",
                format!(
                    "must be at most {MAX_LOOKAHEAD} (every look evaluates every worker), got {}",
                    self.lookahead
                ),
            ));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The SLO a job of `model` is held to: the model's (or the default), tightened field
    /// by field by the job's own request; a looser request is ignored.
    pub fn slo_for(&self, model: &str, request: Option<&SloRequest>) -> Slo {
        let base = self.model_slo.get(model).copied().unwrap_or(self.slo);
        let mut slo = Slo::from(base);
        if let Some(r) = request {
            if let Some(t) = r.ttft_ms.filter(|t| *t > 0) {
                slo.ttft_ms = slo.ttft_ms.min(t);
            }
            if let Some(f) = r.min_tok_s.filter(|f| f.is_finite() && *f > 0.0) {
                slo.min_tok_s = slo.min_tok_s.max(f);
            }
        }
        slo
    }

    /// Concurrency cap of a worker that reports `reported` (0 = not reported).
    pub fn max_concurrency(&self, reported: u32) -> u32 {
        if reported == 0 {
            self.default_max_concurrency
        } else {
            reported
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
    }

    #[test]
    fn reports_every_bad_field() {
        let mut c = SchedulerConfig::default();
        c.weights.job_cost = -1.0;
        c.weights.kv_pressure = f64::NAN;
        c.heartbeat_timeout_ms = 0;
        c.default_max_concurrency = 0;
        c.kv_headroom_frac = 1.0;
        c.slo.min_tok_s = 0.0;
        c.model_slo.insert(
            "m".into(),
            SloConfig {
                ttft_ms: 0,
                min_tok_s: 1.0,
            },
        );
        c.perf_prior.step_base_ms = f64::NAN;
        c.reservation_ttl_ms = 0;
        let errors = c.validate().unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "weights.job_cost",
                "weights.kv_pressure",
                "heartbeat_timeout_ms",
                "default_max_concurrency",
                "kv_headroom_frac",
                "slo.min_tok_s",
                "model_slo.\"m\".ttft_ms",
                "perf_prior.step_base_ms",
                "reservation_ttl_ms"
            ]
        );
        assert_eq!(
            errors[0].to_string(),
            "weights.job_cost: must be a finite number >= 0, got -1"
        );
    }

    #[test]
    fn partial_toml_keeps_defaults_and_refuses_typos() {
        let c: SchedulerConfig =
            toml::from_str("kv_headroom_frac = 0.1\n[weights]\njob_cost = 2.0\n").unwrap();
        assert_eq!(c.kv_headroom_frac, 0.1);
        assert_eq!(c.weights.job_cost, 2.0);
        assert_eq!(
            c.weights.active_requests,
            Weights::default().active_requests
        );
        assert!(toml::from_str::<SchedulerConfig>("kv_headroom = 0.1").is_err());
        assert!(toml::from_str::<SchedulerConfig>("[weights]\njobcost = 1.0").is_err());
    }

    #[test]
    fn a_job_can_tighten_its_slo_but_never_loosen_it() {
        let mut c = SchedulerConfig::default();
        c.model_slo.insert(
            "fast".into(),
            SloConfig {
                ttft_ms: 500,
                min_tok_s: 50.0,
            },
        );
        assert_eq!(
            c.slo_for("other", None),
            Slo {
                ttft_ms: 2_000,
                min_tok_s: 30.0
            }
        );
        assert_eq!(
            c.slo_for("fast", None),
            Slo {
                ttft_ms: 500,
                min_tok_s: 50.0
            }
        );
        let tighter = SloRequest {
            ttft_ms: Some(300),
            min_tok_s: Some(60.0),
        };
        assert_eq!(
            c.slo_for("fast", Some(&tighter)),
            Slo {
                ttft_ms: 300,
                min_tok_s: 60.0
            }
        );
        let looser = SloRequest {
            ttft_ms: Some(9_000),
            min_tok_s: Some(1.0),
        };
        assert_eq!(
            c.slo_for("fast", Some(&looser)),
            Slo {
                ttft_ms: 500,
                min_tok_s: 50.0
            }
        );
        let parsed: SchedulerConfig = toml::from_str(
            "[slo]\nttft_ms = 1000\n[model_slo.\"llama-3.1-8b\"]\nmin_tok_s = 40.0\n",
        )
        .unwrap();
        assert_eq!(
            parsed.slo_for("llama-3.1-8b", None),
            Slo {
                ttft_ms: 2_000,
                min_tok_s: 40.0
            }
        );
        assert_eq!(
            parsed.slo_for("x", None),
            Slo {
                ttft_ms: 1_000,
                min_tok_s: 30.0
            }
        );
    }

    #[test]
    fn zero_reported_concurrency_uses_the_default() {
        let c = SchedulerConfig::default();
        assert_eq!(c.max_concurrency(0), c.default_max_concurrency);
        assert_eq!(c.max_concurrency(3), 3);
    }
}
