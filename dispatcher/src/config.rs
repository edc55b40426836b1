//! The dispatcher's configuration: typed, read from a TOML file, overridden by environment
//! variables, and validated into field-level errors before anything starts.
//!
//! Invariants checked by [`Config::validate`]: the lease is renewed well inside its TTL and
//! the leader fences itself before the lease can expire (`renew < fence_after < ttl`);
//! every interval and bound is positive. Environment lookups are passed in as a function,
//! so tests never touch the process environment.

use std::collections::BTreeMap;
use std::path::Path;

use metronome_protocol::setup::StreamSettings;
use metronome_protocol::JobLimits;
use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::rate_limit::RateLimits;
use metronome_scheduler::{FairnessConfig, SchedulerConfig};
use serde::{Deserialize, Serialize};

/// Where JetStream keeps the contract's streams when this dispatcher creates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    #[default]
    File,
    Memory,
}

/// Every setting of one dispatcher instance. See `dispatcher/README.md` for each key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// NATS server URL, or every node of a cluster separated by commas (`NATS_URL`
    /// overrides it).
    pub nats_url: String,
    /// NATS credentials and TLS (`[nats_auth]`; `METRONOME_NATS_*` override them).
    pub nats_auth: metronome_runtime::nats::NatsAuth,
    /// Redis URL for the EWMAs (`REDIS_URL` overrides it), with the dispatcher's ACL user
    /// and password when Redis has them (`redis://<user>:<password>@host:port/`).
    pub redis_url: String,
    /// Redis TLS (`[redis_tls]`; `METRONOME_REDIS_*` override it); needs a `rediss://` URL.
    pub redis_tls: metronome_runtime::redis::RedisTls,
    /// Name of this instance in decisions and the lease; empty = generated at start.
    pub dispatcher_id: String,
    /// Lifetime of the leader lease (also the `leader` bucket's max age when this
    /// dispatcher creates it).
    pub lease_ttl_ms: u64,
    /// How often the leader renews its lease.
    pub lease_renew_ms: u64,
    /// The leader stops deciding when its last successful renewal is older than this.
    pub fence_after_ms: u64,
    /// How often a standby tries to take the lease.
    pub standby_poll_ms: u64,
    /// Most jobs waiting per model; beyond it a job is rejected with `queue_full`.
    pub queue_bound_per_model: usize,
    /// Ack wait of the JOBS consumer; queued jobs get progress acks well inside it.
    pub ack_wait_ms: u64,
    /// Most unacknowledged JOBS messages the consumer hands out (queued + publishing).
    pub max_ack_pending: i64,
    /// Longest a new leader waits, deciding nothing, to read the jobs an earlier leader
    /// left in JOBS, so that fair queuing sees every tenant's waiting jobs before the
    /// first placement (0 = decide from the first job read).
    pub backlog_read_wait_ms: u64,
    /// Start deadline given to jobs that carry none, counted from when the job is read.
    pub default_deadline_ms: u64,
    /// Latest start deadline any job may have, counted from when it is read: a job asking
    /// for more (or a direct NATS client asking for none) is held to this, so no job waits
    /// unboundedly.
    pub max_deadline_ms: u64,
    /// Most dispatch attempts of one job (refusals and rescues count); then rejected.
    pub max_attempts: u32,
    /// Scheduling policy: `metronome` (admission control) or a baseline.
    pub policy: PolicyKind,
    /// Seed of the baselines that draw random numbers.
    pub policy_seed: u64,
    /// KV tokens booked for an in-flight job adopted from a heartbeat (its size is unknown).
    pub adopt_kv_tokens: u64,
    /// Prefix of the Redis keys (`<prefix>:ewma:<worker_id>`).
    pub redis_prefix: String,
    /// How often the EWMAs are re-read from Redis.
    pub ewma_refresh_ms: u64,
    /// Period of the housekeeping tick: deadlines, dead workers, re-evaluation.
    pub tick_ms: u64,
    /// Address of the Prometheus `/metrics` endpoint (`127.0.0.1:0` picks a port); none = off.
    pub metrics_addr: Option<String>,
    /// Storage of the streams this dispatcher creates when they do not exist yet.
    pub storage: Storage,
    /// Copies of each stream and bucket this dispatcher creates: 1 on a single server, 3
    /// on a three-node NATS cluster (1, 3 or 5).
    pub stream_replicas: usize,
    /// Most candidates listed in a decision, best first (0 = every candidate). The
    /// record is the largest cost of a decision: 64 candidates with seven terms each is
    /// about 50 kB of JSON.
    pub decision_max_candidates: usize,
    /// List workers that serve another model among a decision's rejected workers
    /// (false = leave them out and count them in the decision's note).
    pub decision_list_wrong_model: bool,
    /// Size limits a job must respect.
    pub job_limits: JobLimits,
    /// Filters, weights and timeouts of the scheduling core.
    pub scheduler: SchedulerConfig,
    /// Fair sharing among tenants and priority classes (`[fairness]`: token weights and
    /// the starvation guard).
    pub fairness: FairnessConfig,
    /// Least time between two writes of the fair-share counters to the `fairness` bucket
    /// (they are written when they changed, so a new leader starts from recent ones).
    pub fairness_persist_ms: u64,
    /// Least time between two snapshots of the admission queues for the `queues` bucket
    /// (written when a queue changed, and every second regardless); at most 1000, so
    /// readers never see a live leader's snapshot as stale.
    pub queue_snapshot_ms: u64,
    /// The provisioning record (`workers.json`, written by `scripts/render-auth.py`): each
    /// worker id's model and concurrency ceiling. When set, a worker whose heartbeat
    /// claims another model, a higher cap, or an id without a record takes no work
    /// (`not_provisioned`); when unset, heartbeats are believed (logged once at start).
    /// Read when the dispatcher starts. `METRONOME_PROVISIONING_FILE` overrides it.
    pub provisioning_file: Option<String>,
    /// Most bytes the RESULTS stream keeps (oldest finals first); set on the stream at
    /// start.
    pub results_max_bytes: i64,
    /// Most bytes the EVENTS stream keeps (oldest events first); set at start.
    pub events_max_bytes: i64,
    /// Most events EVENTS keeps per worker subject (oldest first); set at start.
    pub events_max_per_worker: i64,
    /// Each tenant's limits (`[tenant_limits.<tenant>]`: `requests_per_second`, `burst`,
    /// `tokens_per_minute`), charged to every job the leader reads, however it was
    /// submitted: what holds direct NATS clients to a tenant's limits. Set them at or
    /// above the gateway's for the same tenant (the gateway's shape HTTP traffic and
    /// answer with `Retry-After` before a round trip).
    pub tenant_limits: BTreeMap<String, RateLimits>,
    /// Limits of every tenant without an entry in `tenant_limits` (and of jobs without a
    /// tenant); none: no limit.
    pub default_tenant_limits: Option<RateLimits>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_auth: Default::default(),
            redis_url: "redis://127.0.0.1:6379/".into(),
            redis_tls: Default::default(),
            dispatcher_id: String::new(),
            // Failover (a leader's death to the next decision) is at most the TTL plus a
            // standby's poll and the takeover: 2.5 s + 0.1 s keeps it under 3 s. The fence
            // stops a leader 0.7 s before its lease can lapse, three renewals after the last
            // that succeeded.
            lease_ttl_ms: 2500,
            lease_renew_ms: 500,
            fence_after_ms: 1800,
            standby_poll_ms: 100,
            queue_bound_per_model: 10_000,
            ack_wait_ms: 300_000,
            max_ack_pending: 200_000,
            backlog_read_wait_ms: 1000,
            default_deadline_ms: 60_000,
            max_deadline_ms: 600_000,
            max_attempts: 3,
            policy: PolicyKind::Metronome,
            policy_seed: 0,
            adopt_kv_tokens: 2048,
            redis_prefix: metronome_protocol::redis_keys::DEFAULT_PREFIX.into(),
            ewma_refresh_ms: 1000,
            tick_ms: 100,
            metrics_addr: None,
            storage: Storage::File,
            stream_replicas: 1,
            decision_max_candidates: 0,
            decision_list_wrong_model: true,
            job_limits: JobLimits::default(),
            scheduler: SchedulerConfig::default(),
            fairness: FairnessConfig::default(),
            fairness_persist_ms: 500,
            queue_snapshot_ms: 500,
            provisioning_file: None,
            results_max_bytes: StreamSettings::default().results_max_bytes,
            events_max_bytes: StreamSettings::default().events_max_bytes,
            events_max_per_worker: StreamSettings::default().events_max_per_worker,
            tenant_limits: BTreeMap::new(),
            default_tenant_limits: None,
        }
    }
}

pub use metronome_runtime::config::{ConfigError, FieldError};
use metronome_runtime::settings::{Setting, SettingTable};

/// The keys the command line and the environment set: each flag, its variable and its
/// help, declared once (the binary's flags and [`Config::apply_env`] both read this).
pub const SETTINGS: [Setting; 6] = [
    Setting::new("nats_url", "nats-url", "URL", "NATS server URL (key `nats_url`)")
        .env("NATS_URL"),
    Setting::new("redis_url", "redis-url", "URL", "Redis URL for the EWMAs (key `redis_url`)")
        .env("REDIS_URL"),
    Setting::new(
        "dispatcher_id",
        "dispatcher-id",
        "ID",
        "Name of this instance in decisions and the lease (key `dispatcher_id`)",
    )
    .env("METRONOME_DISPATCHER_ID"),
    Setting::new(
        "policy",
        "policy",
        "POLICY",
        "Scheduling policy: metronome, round_robin, least_connections, random, power_of_two or prefix_affinity (key `policy`)",
    )
    .env("METRONOME_POLICY"),
    Setting::new(
        "metrics_addr",
        "metrics-addr",
        "ADDR",
        "Address of the Prometheus /metrics endpoint, host:port (key `metrics_addr`)",
    )
    .env("METRONOME_METRICS_ADDR"),
    Setting::new(
        "provisioning_file",
        "provisioning-file",
        "FILE",
        "The provisioning record: each worker id's model and concurrency ceiling (key `provisioning_file`)",
    )
    .env("METRONOME_PROVISIONING_FILE"),
];

/// [`SETTINGS`] as the type the binary's flags are built from.
pub struct Settings;

impl SettingTable for Settings {
    const SETTINGS: &'static [Setting] = &SETTINGS;
}

impl Config {
    /// Parse TOML text (missing keys take their defaults).
    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        metronome_runtime::config::parse_toml(text, origin)
    }

    /// Read a TOML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        metronome_runtime::config::read_file(path)
    }

    /// Apply the variables of [`SETTINGS`], then the NATS and Redis credentials and TLS,
    /// found through `lookup` (`std::env::var(..).ok()` in a binary, a map in tests).
    pub fn apply_env(
        &mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        metronome_runtime::settings::apply_env(self, &SETTINGS, &lookup)?;
        self.nats_auth.apply_env(&lookup);
        self.redis_tls.apply_env(&lookup);
        Ok(())
    }

    /// Every invalid field, or `Ok` when the configuration can run.
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
        if let Some(why) = metronome_runtime::nats::check_server_urls(&self.nats_url) {
            err("nats_url", why);
        }
        for (tenant, limits) in &self.tenant_limits {
            if let Err(e) = metronome_protocol::check_tenant(tenant) {
                err("tenant_limits", format!("{tenant:?}: {e}"));
            }
            for (field, message) in limits.problems() {
                err(&format!("tenant_limits.{tenant}.{field}"), message);
            }
        }
        for (field, message) in self.default_tenant_limits.iter().flat_map(|l| l.problems()) {
            err(&format!("default_tenant_limits.{field}"), message);
        }
        if let Some(why) = metronome_protocol::setup::check_replicas(self.stream_replicas) {
            err("stream_replicas", why);
        }
        if !self.redis_url.starts_with("redis://") && !self.redis_url.starts_with("rediss://") {
            err(
                "redis_url",
                format!("{:?} must start with redis://", self.redis_url),
            );
        }
        if !self.dispatcher_id.is_empty() && self.dispatcher_id.chars().any(|c| c.is_whitespace()) {
            err("dispatcher_id", "must not contain whitespace".into());
        }
        for (field, v) in [
            ("lease_ttl_ms", self.lease_ttl_ms),
            ("lease_renew_ms", self.lease_renew_ms),
            ("fence_after_ms", self.fence_after_ms),
            ("standby_poll_ms", self.standby_poll_ms),
            ("ack_wait_ms", self.ack_wait_ms),
            ("default_deadline_ms", self.default_deadline_ms),
            ("max_deadline_ms", self.max_deadline_ms),
            ("ewma_refresh_ms", self.ewma_refresh_ms),
            ("tick_ms", self.tick_ms),
            ("fairness_persist_ms", self.fairness_persist_ms),
            ("queue_snapshot_ms", self.queue_snapshot_ms),
        ] {
            if v == 0 {
                err(field, "must be greater than 0".into());
            }
        }
        if self.queue_snapshot_ms > metronome_protocol::queues::QUEUE_REFRESH_MS {
            err(
                "queue_snapshot_ms",
                format!(
                    "{} must not exceed {} (the queue snapshots' refresh interval)",
                    self.queue_snapshot_ms,
                    metronome_protocol::queues::QUEUE_REFRESH_MS
                ),
            );
        }
        if self.default_deadline_ms > self.max_deadline_ms {
            err(
                "default_deadline_ms",
                format!(
                    "{} must not exceed max_deadline_ms ({})",
                    self.default_deadline_ms, self.max_deadline_ms
                ),
            );
        }
        if self.lease_renew_ms >= self.fence_after_ms {
            err(
                "lease_renew_ms",
                format!(
                    "{} must be below fence_after_ms ({}) so a renewal can succeed before fencing",
                    self.lease_renew_ms, self.fence_after_ms
                ),
            );
        }
        if self.fence_after_ms >= self.lease_ttl_ms {
            err(
                "fence_after_ms",
                format!(
                    "{} must be below lease_ttl_ms ({}) so the leader stops before its lease can expire",
                    self.fence_after_ms, self.lease_ttl_ms
                ),
            );
        }
        if self.lease_ttl_ms < 300 {
            err("lease_ttl_ms", "must be at least 300".into());
        }
        for (field, message) in self.fairness.problems() {
            err(&format!("fairness.{field}"), message);
        }
        if self.queue_bound_per_model == 0 {
            err("queue_bound_per_model", "must be greater than 0".into());
        }
        if self.max_ack_pending < 1 {
            err("max_ack_pending", "must be at least 1".into());
        }
        if self.max_attempts == 0 {
            err("max_attempts", "must be at least 1".into());
        }
        for (field, v) in [
            ("results_max_bytes", self.results_max_bytes),
            ("events_max_bytes", self.events_max_bytes),
            ("events_max_per_worker", self.events_max_per_worker),
        ] {
            if v < 1 {
                err(field, "must be at least 1".into());
            }
        }
        if self.redis_prefix.is_empty() {
            err("redis_prefix", "must not be empty".into());
        }
        if let Some(addr) = &self.metrics_addr {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                err("metrics_addr", format!("{addr:?} is not host:port"));
            }
        }
        if self.job_limits.max_job_bytes == 0 {
            err("job_limits.max_job_bytes", "must be greater than 0".into());
        }
        if self.job_limits.max_total_tokens == 0 {
            err(
                "job_limits.max_total_tokens",
                "must be greater than 0".into(),
            );
        }
        if let Err(scheduler_errors) = self.scheduler.validate() {
            for e in scheduler_errors {
                err(&format!("scheduler.{}", e.field), e.message);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// Load from an optional file, apply the environment, validate.
    pub fn load(
        path: Option<&Path>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut config: Config = metronome_runtime::config::file_or_default(path)?;
        config.apply_env(lookup)?;
        config.validate().map_err(ConfigError::Invalid)?;
        Ok(config)
    }

    /// The provisioning record of `provisioning_file`, read and checked; `None` when no
    /// file is set.
    pub fn provisioning(&self) -> Result<Option<metronome_scheduler::Provisioning>, FieldError> {
        let Some(path) = &self.provisioning_file else {
            return Ok(None);
        };
        let field = "provisioning_file";
        let text = std::fs::read_to_string(path)
            .map_err(|e| FieldError::new(field, format!("reading {path}: {e}")))?;
        serde_json::from_str::<metronome_scheduler::Provisioning>(&text)
            .map_err(|e| e.to_string())
            .and_then(metronome_scheduler::Provisioning::checked)
            .map(Some)
            .map_err(|e| FieldError::new(field, format!("{path}: {e}")))
    }

    /// The dispatcher id, generated when the configuration leaves it empty.
    pub fn effective_id(&self) -> String {
        if self.dispatcher_id.is_empty() {
            format!(
                "dispatcher-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        } else {
            self.dispatcher_id.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn toml_keys_override_defaults_and_unknown_keys_fail() {
        let c = Config::from_toml("queue_bound_per_model = 7\npolicy = \"round_robin\"\n", "t")
            .unwrap();
        assert_eq!(c.queue_bound_per_model, 7);
        assert_eq!(c.policy, PolicyKind::RoundRobin);
        assert!(Config::from_toml("no_such_key = 1", "t").is_err());
    }

    #[test]
    fn environment_overrides_urls() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            "NATS_URL" => Some("nats://10.0.0.1:4222".into()),
            "REDIS_URL" => Some("redis://r:1/".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.nats_url, "nats://10.0.0.1:4222");
        assert_eq!(c.redis_url, "redis://r:1/");
        let bad = c.apply_env(|k| (k == "METRONOME_POLICY").then(|| "fastest".into()));
        assert!(bad.is_err());
    }

    #[test]
    fn a_cluster_is_every_node_and_three_replicas() {
        let c = Config::from_toml(
            "nats_url = \"nats://10.0.0.1:4222,nats://10.0.0.2:4222,nats://10.0.0.3:4222\"\nstream_replicas = 3\n",
            "t",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.stream_replicas, 3);
    }

    #[test]
    fn every_bad_field_is_reported() {
        let c = Config {
            lease_ttl_ms: 1000,
            fence_after_ms: 1500,
            lease_renew_ms: 2000,
            queue_bound_per_model: 0,
            redis_url: "http://x".into(),
            metrics_addr: Some("nope".into()),
            nats_url: "nats://10.0.0.1:4222,http://10.0.0.2:4222".into(),
            stream_replicas: 2,
            ..Config::default()
        };
        let fields: Vec<String> = c
            .validate()
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        for f in [
            "lease_renew_ms",
            "fence_after_ms",
            "queue_bound_per_model",
            "redis_url",
            "metrics_addr",
            "nats_url",
            "stream_replicas",
        ] {
            assert!(fields.iter().any(|x| x == f), "{f} missing from {fields:?}");
        }
    }
}
