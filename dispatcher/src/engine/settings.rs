//! The settings of one leadership term: what the engine is configured with.

use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::FairnessConfig;
use metronome_scheduler::SchedulerConfig;

use std::time::Duration;

/// Settings of one leadership term.
#[derive(Clone)]
pub struct EngineSettings {
    pub epoch: u64,
    pub dispatcher_id: String,
    pub policy: PolicyKind,
    pub policy_seed: u64,
    pub scheduler: SchedulerConfig,
    pub queue_bound_per_model: usize,
    pub max_attempts: u32,
    pub default_deadline_ms: u64,
    pub max_deadline_ms: u64,
    pub adopt_kv_tokens: u64,
    pub ack_wait_ms: u64,
    pub tick: Duration,
    pub decision_max_candidates: usize,
    pub decision_list_wrong_model: bool,
    /// A worker dead this long (no heartbeat) leaves the registry, and so the decisions.
    pub forget_dead_after_ms: u64,
    pub fairness: FairnessConfig,
    /// What each worker id was provisioned for; `None`: heartbeats are believed.
    pub provisioning: Option<std::sync::Arc<metronome_scheduler::Provisioning>>,
}

impl EngineSettings {
    /// The settings of a term led at `epoch` under configuration `c`.
    pub fn from_config(
        c: &crate::config::Config,
        epoch: u64,
        dispatcher_id: String,
    ) -> EngineSettings {
        EngineSettings {
            epoch,
            dispatcher_id,
            policy: c.policy,
            policy_seed: c.policy_seed,
            scheduler: c.scheduler.clone(),
            queue_bound_per_model: c.queue_bound_per_model,
            max_attempts: c.max_attempts,
            default_deadline_ms: c.default_deadline_ms,
            max_deadline_ms: c.max_deadline_ms,
            adopt_kv_tokens: c.adopt_kv_tokens,
            ack_wait_ms: c.ack_wait_ms,
            tick: Duration::from_millis(c.tick_ms),
            decision_max_candidates: c.decision_max_candidates,
            decision_list_wrong_model: c.decision_list_wrong_model,
            // Long enough for the worker to come back from a restart as the same entry,
            // short enough that decisions stop listing a dead worker within a minute by
            // default.
            forget_dead_after_ms: c.scheduler.heartbeat_timeout_ms.saturating_mul(5),
            fairness: c.fairness,
            // Read from `provisioning_file` once, when the dispatcher starts.
            provisioning: None,
        }
    }
}
