//! Tenants' rate and token limits, charged by the leader to every job it reads, so a
//! client that submits straight over NATS (no gateway in between) is held to them too.
//!
//! The buckets are the scheduling core's ([`metronome_scheduler::rate_limit`]), the
//! same the gateway charges at HTTP admission. A job costs one request and its input
//! (the larger of the `prompt_tokens` it declares and the estimate of its body,
//! [`metronome_protocol::input_tokens::estimate`]: a client cannot declare its way under
//! the limit) plus its `max_tokens`. It is charged at its `submitted_ms`, clamped to now
//! (a client's clock cannot refill a bucket early), so a job the gateway admitted at a
//! given moment is charged here at the same moment: with the dispatcher's limits at or
//! above the gateway's, gateway traffic is not refused twice, and a backlog read at once
//! after a takeover is charged at its submission times. Only first attempts are charged
//! (a retry was charged when it was submitted).
//!
//! Invariant: a tenant without an entry in `[tenant_limits]` falls under
//! `[default_tenant_limits]`; with neither, it has no limit. A refusal charges nothing.

use std::collections::{BTreeMap, HashMap};

use metronome_protocol::Job;
use metronome_scheduler::rate_limit::{RateLimits, Refusal, TenantLimiter};

/// Tenant key of jobs without a tenant.
const NO_TENANT: &str = "";

/// The leader's limiters, one per tenant seen.
#[derive(Debug)]
pub struct TenantLimits {
    per_tenant: BTreeMap<String, RateLimits>,
    default: Option<RateLimits>,
    limiters: HashMap<String, TenantLimiter>,
}

impl TenantLimits {
    pub fn new(per_tenant: BTreeMap<String, RateLimits>, default: Option<RateLimits>) -> Self {
        TenantLimits {
            per_tenant,
            default,
            limiters: HashMap::new(),
        }
    }

    /// Whether any tenant has a limit (otherwise nothing needs charging).
    pub fn is_active(&self) -> bool {
        self.default.is_some() || !self.per_tenant.is_empty()
    }

    /// Tokens `job` is charged: its input, declared or estimated, whichever is larger, and
    /// its output bound.
    pub fn cost(job: &Job) -> u64 {
        let estimate = metronome_protocol::input_tokens::estimate(job.endpoint, &job.request);
        u64::from(job.prompt_tokens.max(estimate)) + u64::from(job.max_tokens)
    }

    /// Charge `job` (attempt 1) to its tenant at `now_ms`, or refuse it.
    pub fn admit(&mut self, job: &Job, now_ms: u64) -> Result<(), Refusal> {
        let tenant = job.tenant.as_deref().unwrap_or(NO_TENANT);
        let limits = match self.per_tenant.get(tenant).or(self.default.as_ref()) {
            Some(limits) => *limits,
            None => return Ok(()),
        };
        let at_ms = job.submitted_ms.min(now_ms);
        let limiter = self
            .limiters
            .entry(tenant.to_string())
            .or_insert_with(|| TenantLimiter::new(&limits, at_ms));
        limiter.admit(at_ms, Self::cost(job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::{Endpoint, PROTOCOL_VERSION};
    use serde_json::json;

    fn job(tenant: Option<&str>, text_chars: usize, declared: u32, submitted_ms: u64) -> Job {
        Job {
            v: PROTOCOL_VERSION,
            id: "j".into(),
            model: "m".into(),
            endpoint: Endpoint::Chat,
            request: json!({"messages": [{"role": "user", "content": "x".repeat(text_chars)}]}),
            prompt_tokens: declared,
            max_tokens: 10,
            submitted_ms,
            deadline_ms: None,
            slo: None,
            tenant: tenant.map(str::to_string),
            priority: None,
            prefix: None,
            traceparent: None,
        }
    }

    fn tpm(tokens: u64) -> RateLimits {
        RateLimits {
            tokens_per_minute: Some(tokens),
            ..RateLimits::default()
        }
    }

    #[test]
    fn the_body_counts_when_the_declared_size_is_smaller() {
        // 400 characters: 3 + 4 + 100 tokens of input, whatever the job declares.
        let small_claim = job(Some("a"), 400, 1, 0);
        assert_eq!(TenantLimits::cost(&small_claim), 107 + 10);
        assert_eq!(TenantLimits::cost(&job(Some("a"), 4, 500, 0)), 500 + 10);
        let mut limits = TenantLimits::new([("a".to_string(), tpm(100))].into(), None);
        assert!(matches!(
            limits.admit(&small_claim, 0),
            Err(Refusal::TooLarge { needed: 117, .. })
        ));
    }

    #[test]
    fn tenants_have_their_own_buckets_and_the_default_covers_the_rest() {
        let mut limits = TenantLimits::new([("a".to_string(), tpm(60))].into(), Some(tpm(30)));
        // 20 declared (more than the body's 8) + 10 tokens each: a holds two, b and no
        // tenant one each.
        let j = |t: Option<&str>| job(t, 4, 20, 1_000);
        for _ in 0..2 {
            assert_eq!(limits.admit(&j(Some("a")), 1_000), Ok(()));
        }
        assert!(limits.admit(&j(Some("a")), 1_000).is_err());
        for t in [Some("b"), None] {
            assert_eq!(limits.admit(&j(t), 1_000), Ok(()));
            assert!(limits.admit(&j(t), 1_000).is_err(), "{t:?}");
        }
        let mut none = TenantLimits::new(BTreeMap::new(), None);
        assert!(!none.is_active());
        for _ in 0..1_000 {
            assert_eq!(none.admit(&j(Some("a")), 0), Ok(()));
        }
    }

    #[test]
    fn a_submission_time_in_the_future_refills_nothing_early() {
        let mut limits = TenantLimits::new(BTreeMap::new(), Some(tpm(60)));
        assert_eq!(limits.admit(&job(None, 4, 50, 0), 0), Ok(()));
        // An hour ahead of now: charged now, and the bucket is empty.
        assert!(limits.admit(&job(None, 4, 50, 3_600_000), 0).is_err());
        // A minute later, by the real clock, it fits again.
        assert_eq!(limits.admit(&job(None, 4, 50, 3_600_000), 60_000), Ok(()));
    }
}
