//! Per-tenant admission limits: a token bucket of requests (`requests_per_second`, `burst`)
//! and one of tokens (`tokens_per_minute`), both charged when a job is admitted. The
//! gateway charges them before it publishes a request's job; the dispatcher charges its
//! own (`[tenant_limits]`) when it reads a job, so jobs submitted straight over NATS are
//! held to a tenant's limits too.
//!
//! A token bucket (the classic traffic-shaping meter, as in tower's `RateLimit` or Envoy's
//! local rate limit) holds at most `capacity` units and refills at a constant rate; a
//! request takes its units or is refused. Tokens are charged as the prompt estimate plus
//! `max_tokens`: the most the job can cost, known at admission (the true counts arrive only
//! with the final result; settling them is the dispatcher's fairness counter's job).
//!
//! Invariants: time is an argument (`now_ms`, monotonic milliseconds), never read here, so
//! every decision is reproducible in tests; admission is all or nothing (a request refused
//! by one bucket takes nothing from the other); a bucket never holds more than its
//! capacity nor less than zero; time going backwards refills nothing.

use serde::{Deserialize, Serialize};

/// A tenant's limits; each absent one is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimits {
    /// Sustained requests per second (token bucket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
    /// Requests that may arrive at once above the sustained rate (bucket size); defaults to
    /// the rate rounded up, at least 1. Needs `requests_per_second`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Tokens per minute, charged at admission as the input estimate + `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

impl RateLimits {
    /// What is wrong with these limits, as (field, message) pairs.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(rate) = self.requests_per_second {
            if !(rate.is_finite() && rate > 0.0) {
                out.push(("requests_per_second", format!("{rate} must be above 0")));
            }
        }
        if self.burst == Some(0) {
            out.push(("burst", "must be at least 1".into()));
        }
        if self.burst.is_some() && self.requests_per_second.is_none() {
            out.push(("burst", "needs requests_per_second".into()));
        }
        if self.tokens_per_minute == Some(0) {
            out.push(("tokens_per_minute", "must be at least 1".into()));
        }
        out
    }
}

/// A token bucket over integer milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBucket {
    capacity: f64,
    per_ms: f64,
    level: f64,
    updated_ms: u64,
}

impl TokenBucket {
    /// A full bucket of `capacity` units refilling `per_second` units each second.
    pub fn new(capacity: f64, per_second: f64, now_ms: u64) -> TokenBucket {
        TokenBucket {
            capacity,
            per_ms: per_second / 1000.0,
            level: capacity,
            updated_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: u64) {
        if now_ms > self.updated_ms {
            let elapsed = (now_ms - self.updated_ms) as f64;
            self.level = (self.level + elapsed * self.per_ms).min(self.capacity);
            self.updated_ms = now_ms;
        }
    }

    /// Milliseconds until `amount` units are available (0: now); `None` when the bucket
    /// can never hold that many.
    fn wait_ms(&self, amount: f64) -> Option<u64> {
        if amount > self.capacity {
            return None;
        }
        if self.level >= amount {
            return Some(0);
        }
        Some(((amount - self.level) / self.per_ms).ceil() as u64)
    }

    /// Units available at `now_ms`.
    pub fn level(&mut self, now_ms: u64) -> f64 {
        self.refill(now_ms);
        self.level
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Over `requests_per_second` (and its burst): retry after this long.
    Requests { retry_after_ms: u64 },
    /// Over `tokens_per_minute`: retry after this long.
    Tokens { retry_after_ms: u64, needed: u64 },
    /// The request alone needs more tokens than a whole minute's budget: retrying cannot
    /// help.
    TooLarge { needed: u64, tokens_per_minute: u64 },
}

impl Refusal {
    /// Label of the per-tenant rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Requests { .. } => "requests_per_second",
            Refusal::Tokens { .. } => "tokens_per_minute",
            Refusal::TooLarge { .. } => "request_too_large",
        }
    }

    /// Whole seconds for `Retry-After` (rounded up, at least 1), when retrying can help.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Refusal::Requests { retry_after_ms } | Refusal::Tokens { retry_after_ms, .. } => {
                Some(retry_after_ms.div_ceil(1000).max(1))
            }
            Refusal::TooLarge { .. } => None,
        }
    }
}

/// The buckets of one tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLimiter {
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
}

impl TenantLimiter {
    /// Full buckets for `tenant`'s limits (none when it sets none).
    pub fn new(tenant: &RateLimits, now_ms: u64) -> TenantLimiter {
        let requests = tenant.requests_per_second.map(|rate| {
            let burst = tenant
                .burst
                .map(f64::from)
                .unwrap_or_else(|| rate.ceil().max(1.0));
            TokenBucket::new(burst, rate, now_ms)
        });
        let tokens = tenant
            .tokens_per_minute
            .map(|tpm| TokenBucket::new(tpm as f64, tpm as f64 / 60.0, now_ms));
        TenantLimiter { requests, tokens }
    }

    /// Admit one request costing `tokens`, charging both buckets, or refuse it and charge
    /// neither. When both refuse, the longer wait is reported.
    pub fn admit(&mut self, now_ms: u64, tokens: u64) -> Result<(), Refusal> {
        let mut refusal: Option<Refusal> = None;
        if let Some(bucket) = &mut self.requests {
            bucket.refill(now_ms);
            match bucket.wait_ms(1.0) {
                Some(0) => {}
                // A bucket of at least one unit can always hold one request.
                wait => {
                    refusal = Some(Refusal::Requests {
                        retry_after_ms: wait.unwrap_or(u64::MAX),
                    })
                }
            }
        }
        if let Some(bucket) = &mut self.tokens {
            bucket.refill(now_ms);
            match bucket.wait_ms(tokens as f64) {
                Some(0) => {}
                Some(wait) => {
                    let longer = match &refusal {
                        Some(Refusal::Requests { retry_after_ms }) => *retry_after_ms > wait,
                        _ => false,
                    };
                    if !longer {
                        refusal = Some(Refusal::Tokens {
                            retry_after_ms: wait,
                            needed: tokens,
                        });
                    }
                }
                None => {
                    return Err(Refusal::TooLarge {
                        needed: tokens,
                        tokens_per_minute: bucket.capacity as u64,
                    })
                }
            }
        }
        if let Some(refusal) = refusal {
            return Err(refusal);
        }
        if let Some(bucket) = &mut self.requests {
            bucket.level -= 1.0;
        }
        if let Some(bucket) = &mut self.tokens {
            bucket.level -= tokens as f64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(rps: Option<f64>, burst: Option<u32>, tpm: Option<u64>) -> RateLimits {
        RateLimits {
            requests_per_second: rps,
            burst,
            tokens_per_minute: tpm,
        }
    }

    #[test]
    fn no_limits_admit_everything() {
        let mut l = TenantLimiter::new(&tenant(None, None, None), 0);
        for _ in 0..10_000 {
            assert_eq!(l.admit(0, 1_000_000), Ok(()));
        }
    }

    #[test]
    fn burst_then_the_sustained_rate() {
        let mut l = TenantLimiter::new(&tenant(Some(2.0), Some(3), None), 1_000);
        for _ in 0..3 {
            assert_eq!(l.admit(1_000, 1), Ok(()));
        }
        assert_eq!(
            l.admit(1_000, 1),
            Err(Refusal::Requests {
                retry_after_ms: 500
            })
        );
        // Half a unit refilled after 250 ms: still refused, the wait shrinks.
        assert_eq!(
            l.admit(1_250, 1),
            Err(Refusal::Requests {
                retry_after_ms: 250
            })
        );
        assert_eq!(l.admit(1_500, 1), Ok(()));
        assert!(l.admit(1_500, 1).is_err());
        // A long pause refills only up to the burst.
        for _ in 0..3 {
            assert_eq!(l.admit(100_000, 1), Ok(()));
        }
        assert!(l.admit(100_000, 1).is_err());
    }

    #[test]
    fn burst_defaults_to_the_rate_rounded_up() {
        let mut l = TenantLimiter::new(&tenant(Some(0.5), None, None), 0);
        assert_eq!(l.admit(0, 1), Ok(()));
        assert_eq!(
            l.admit(0, 1),
            Err(Refusal::Requests {
                retry_after_ms: 2_000
            })
        );
    }

    #[test]
    fn tokens_per_minute_charges_the_whole_cost_and_says_when_it_fits() {
        let mut l = TenantLimiter::new(&tenant(None, None, Some(600)), 0);
        assert_eq!(l.admit(0, 500), Ok(()));
        // 100 left; 300 needed: 200 more at 10 per second.
        let refusal = l.admit(0, 300).unwrap_err();
        assert_eq!(
            refusal,
            Refusal::Tokens {
                retry_after_ms: 20_000,
                needed: 300
            }
        );
        assert_eq!(refusal.retry_after_secs(), Some(20));
        assert_eq!(
            l.admit(19_999, 300).unwrap_err().reason(),
            "tokens_per_minute"
        );
        assert_eq!(l.admit(20_000, 300), Ok(()));
    }

    #[test]
    fn a_refusal_charges_neither_bucket() {
        let mut l = TenantLimiter::new(&tenant(Some(1.0), Some(1), Some(100)), 0);
        // Refused by tokens: the request budget stays whole.
        assert!(matches!(l.admit(0, 150), Err(Refusal::TooLarge { .. })));
        assert!(matches!(l.admit(0, 101), Err(Refusal::TooLarge { .. })));
        assert_eq!(l.admit(0, 100), Ok(()));
        // Refused by requests: the token budget is not charged either.
        let mut l = TenantLimiter::new(&tenant(Some(1.0), Some(1), Some(100)), 0);
        assert_eq!(l.admit(0, 10), Ok(()));
        assert!(matches!(l.admit(0, 10), Err(Refusal::Requests { .. })));
        assert_eq!(l.tokens.as_mut().unwrap().level(0), 90.0);
    }

    #[test]
    fn the_longer_wait_is_reported_when_both_refuse() {
        let mut l = TenantLimiter::new(&tenant(Some(1.0), Some(1), Some(60)), 0);
        assert_eq!(l.admit(0, 60), Ok(()));
        // Requests: 1 s; tokens: 60 s.
        assert_eq!(
            l.admit(0, 60),
            Err(Refusal::Tokens {
                retry_after_ms: 60_000,
                needed: 60
            })
        );
        // After 50 s the request bucket is full again and 50 tokens are back.
        assert_eq!(l.admit(50_000, 50), Ok(()));
    }

    #[test]
    fn too_large_has_no_retry_after_and_time_going_back_refills_nothing() {
        let r = Refusal::TooLarge {
            needed: 10,
            tokens_per_minute: 5,
        };
        assert_eq!(r.retry_after_secs(), None);
        assert_eq!(
            Refusal::Requests { retry_after_ms: 1 }.retry_after_secs(),
            Some(1)
        );
        let mut b = TokenBucket::new(10.0, 1.0, 1_000);
        b.level -= 10.0;
        assert_eq!(b.level(500), 0.0);
        assert_eq!(b.level(1_000), 0.0);
        assert_eq!(b.level(2_000), 1.0);
        assert_eq!(b.level(1_000_000), 10.0);
    }
}
