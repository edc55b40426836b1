//! The gateway's per-tenant admission limits: each tenant's `requests_per_second`,
//! `burst` and `tokens_per_minute` (its `[[tenants]]` entry), charged when a request is
//! admitted, before its job is published. The buckets are the scheduling core's
//! ([`metronome_scheduler::rate_limit`]), which the dispatcher charges too.

pub use metronome_scheduler::rate_limit::{RateLimits, Refusal, TenantLimiter, TokenBucket};

use crate::config::TenantConfig;

impl TenantConfig {
    /// The limits of this tenant.
    pub fn rate_limits(&self) -> RateLimits {
        RateLimits {
            requests_per_second: self.requests_per_second,
            burst: self.burst,
            tokens_per_minute: self.tokens_per_minute,
        }
    }
}
