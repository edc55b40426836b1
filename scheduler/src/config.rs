//! Scheduler configuration: the weights of the seven score terms and the limits of the
//! admission filters.
//!
//! Every field has a default, so a TOML section may set only what it changes; unknown keys
//! are refused so a typo never silently falls back to a default. [`SchedulerConfig::validate`]
//! returns every field error at once, each naming its field by its TOML path.

use serde::{Deserialize, Serialize};

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
    /// Chosen for predictability: the predicted service time of the job on the worker and
    /// the work already running there dominate; KV pressure comes next because a full KV
    /// cache causes preemption (the worst latency cliff); queue depth is work that has not
    /// even started; the raw EWMAs and GPU utilisation are partly redundant with `job_cost`
    /// and mostly break near-ties. Re-tune against the simulator with the load generator.
    fn default() -> Self {
        Weights {
            active_requests: 1.0,
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
}

/// Limits of the admission filters and the scoring weights.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub weights: Weights,
    /// A worker whose last heartbeat is older than this is ineligible.
    pub heartbeat_timeout_ms: u64,
    /// Concurrency cap for a worker that reports `max_concurrency = 0`.
    pub default_max_concurrency: u32,
    /// Share of a worker's KV capacity kept free (0.05 = admit only while 95 % would
    /// remain enough).
    pub kv_headroom_frac: f64,
    /// Floor on the predicted per-request tokens/s after admitting the job; `None` disables
    /// the SLO filter.
    pub slo_min_tok_s: Option<f64>,
    /// Batching slowdown: the per-request rate at `n` concurrent requests is
    /// `single_stream_rate / (1 + batch_slowdown * (n - 1))`.
    pub batch_slowdown: f64,
    /// A reservation that no heartbeat has confirmed for this long expires.
    pub reservation_ttl_ms: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            weights: Weights::default(),
            // Heartbeats come every ~1 s: three missed in a row means gone.
            heartbeat_timeout_ms: 3_000,
            default_max_concurrency: 8,
            kv_headroom_frac: 0.05,
            // Off by default. The benchmark's tuned values (BENCHMARKS.md) are
            // `slo_min_tok_s = Some(30.0)` with `batch_slowdown = 1.0` (one admission's
            // prefill halves a short generation's rate); they are not the default yet because
            // a busy-looking worker is then refused while its heartbeat still lists finished
            // jobs, which breaks back-to-back bursts (tests/full_chain.rs).
            slo_min_tok_s: None,
            // Decode step time grows ~10 % per extra sequence in the batch on a busy GPU.
            batch_slowdown: 0.1,
            // Several heartbeats' worth, so one late heartbeat never drops live work.
            reservation_ttl_ms: 10_000,
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
        if !(0.0..1.0).contains(&self.kv_headroom_frac) {
            errors.push(ConfigError::new(
                "kv_headroom_frac",
                format!("must be in [0, 1), got {}", self.kv_headroom_frac),
            ));
        }
        if let Some(floor) = self.slo_min_tok_s {
            if !floor.is_finite() || floor <= 0.0 {
                errors.push(ConfigError::new(
                    "slo_min_tok_s",
                    format!("must be a finite number > 0 when set, got {floor}"),
                ));
            }
        }
        if !self.batch_slowdown.is_finite() || self.batch_slowdown < 0.0 {
            errors.push(ConfigError::new(
                "batch_slowdown",
                format!("must be a finite number >= 0, got {}", self.batch_slowdown),
            ));
        }
        if self.reservation_ttl_ms == 0 {
            errors.push(ConfigError::new("reservation_ttl_ms", "must be > 0"));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
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
        c.slo_min_tok_s = Some(0.0);
        c.batch_slowdown = f64::INFINITY;
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
                "slo_min_tok_s",
                "batch_slowdown",
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
    fn zero_reported_concurrency_uses_the_default() {
        let c = SchedulerConfig::default();
        assert_eq!(c.max_concurrency(0), c.default_max_concurrency);
        assert_eq!(c.max_concurrency(3), 3);
    }
}
