//! The gateway's bound on work it holds: requests in flight (in total and per tenant) and
//! the request bodies they hold, each admitted before its body is read and held until its
//! response ends (a stream's last byte, or its client gone).
//!
//! Why: every request in flight costs the gateway memory (its body, the job, two
//! subscriptions, the response being relayed), so a flood of requests, each answered 429
//! later by the dispatcher, still grew the gateway with the flood. A request beyond a bound
//! is answered 429 at once, before its body is read, so what the gateway holds is at most
//! `max_in_flight` requests and `max_in_flight_body_bytes` of bodies, whatever arrives.
//! A body is charged by its `Content-Length` (one without is charged `body_limit_bytes`,
//! the most it may turn out to be), and the per-tenant bound keeps one tenant's flood
//! from taking every slot.
//!
//! Invariant: the counters are the sum of the live [`Permit`]s; a refusal takes nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::error::ApiError;
use crate::AppState;

/// The bounds (`[config]`: `max_in_flight`, `max_in_flight_per_tenant`,
/// `max_in_flight_body_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub requests: usize,
    pub per_tenant: usize,
    pub body_bytes: u64,
}

/// Which bound refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    Requests { limit: usize },
    Tenant { limit: usize },
    BodyBytes { limit: u64 },
}

impl Full {
    /// The answer: 429 at once, the gateway holds as much as it may (requests in flight, in
    /// total or for the tenant, or their bodies' bytes); nothing was read or queued.
    pub fn to_api_error(&self, retry_after_secs: u64) -> ApiError {
        let what = match self {
            Full::Requests { limit } => format!("{limit} requests in flight"),
            Full::Tenant { limit } => format!("{limit} requests in flight for this tenant"),
            Full::BodyBytes { limit } => format!("{limit} bytes of request bodies in flight"),
        };
        ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the gateway holds its most ({what}); retry after the time in Retry-After"),
        )
        .with_code(self.reason())
        .with_retry_after(retry_after_secs)
    }

    /// Label of the shed counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Full::Requests { .. } => "in_flight",
            Full::Tenant { .. } => "in_flight_tenant",
            Full::BodyBytes { .. } => "in_flight_body_bytes",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    requests: usize,
    body_bytes: u64,
    per_tenant: HashMap<String, usize>,
}

/// The live counts against [`Bounds`].
#[derive(Debug)]
pub struct InFlight {
    bounds: Bounds,
    counts: Mutex<Counts>,
}

/// One admitted request; gives its place back when dropped.
#[derive(Debug)]
pub struct Permit {
    owner: Arc<InFlight>,
    tenant: Option<String>,
    body_bytes: u64,
}

impl InFlight {
    pub fn new(bounds: Bounds) -> Arc<InFlight> {
        Arc::new(InFlight {
            bounds,
            counts: Mutex::default(),
        })
    }

    /// Admit a request of `tenant` (`None`: not authenticated, counted in the total only)
    /// holding a body of `body_bytes`, or say which bound it would cross.
    pub fn try_acquire(
        self: &Arc<Self>,
        tenant: Option<&str>,
        body_bytes: u64,
    ) -> Result<Permit, Full> {
        let mut counts = self.counts.lock().expect("in-flight lock");
        if counts.requests >= self.bounds.requests {
            return Err(Full::Requests {
                limit: self.bounds.requests,
            });
        }
        if let Some(t) = tenant {
            if counts.per_tenant.get(t).copied().unwrap_or(0) >= self.bounds.per_tenant {
                return Err(Full::Tenant {
                    limit: self.bounds.per_tenant,
                });
            }
        }
        if counts.body_bytes.saturating_add(body_bytes) > self.bounds.body_bytes {
            return Err(Full::BodyBytes {
                limit: self.bounds.body_bytes,
            });
        }
        counts.requests += 1;
        counts.body_bytes += body_bytes;
        if let Some(t) = tenant {
            *counts.per_tenant.entry(t.to_string()).or_default() += 1;
        }
        Ok(Permit {
            owner: self.clone(),
            tenant: tenant.map(str::to_string),
            body_bytes,
        })
    }

    /// Requests in flight now.
    pub fn requests(&self) -> usize {
        self.counts.lock().expect("in-flight lock").requests
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut counts = self.owner.counts.lock().expect("in-flight lock");
        counts.requests -= 1;
        counts.body_bytes -= self.body_bytes;
        if let Some(t) = &self.tenant {
            if let Some(n) = counts.per_tenant.get_mut(t) {
                *n -= 1;
                if *n == 0 {
                    counts.per_tenant.remove(t);
                }
            }
        }
    }
}

/// Middleware of the completion routes: admit the request before its body is read, or
/// answer 429 at once; the permit travels with the response body.
pub async fn bound(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let tenant = state
        .auth
        .authenticate(request.headers())
        .ok()
        .map(|caller| caller.tenant_name);
    let limit = state.config.body_limit_bytes as u64;
    let body_bytes = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map_or(limit, |n| n.min(limit));
    let permit = match state.in_flight.try_acquire(tenant.as_deref(), body_bytes) {
        Ok(permit) => permit,
        Err(full) => {
            state.metrics.shed(full.reason());
            // Like every answer of these routes, it names a job id (one no job will have),
            // so a client's report of it can be found in the gateway's log.
            let job_id = crate::submit::new_job_id();
            tracing::debug!(%job_id, tenant = ?tenant, reason = full.reason(), "request shed");
            let mut response = full
                .to_api_error(state.config.retry_after_secs)
                .into_response();
            if let Ok(value) = axum::http::HeaderValue::from_str(&job_id) {
                response
                    .headers_mut()
                    .insert(crate::headers::HEADER_JOB_ID, value);
            }
            return response;
        }
    };
    let response = next.run(request).await;
    let (parts, body) = response.into_parts();
    // The permit lives as long as the body is being sent.
    let held = body.into_data_stream().map(move |chunk| {
        let _ = &permit;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(held))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        requests: 3,
        per_tenant: 2,
        body_bytes: 100,
    };

    #[test]
    fn each_bound_refuses_and_a_dropped_permit_gives_its_place_back() {
        let f = InFlight::new(BOUNDS);
        let a1 = f.try_acquire(Some("a"), 10).unwrap();
        let _a2 = f.try_acquire(Some("a"), 10).unwrap();
        assert_eq!(
            f.try_acquire(Some("a"), 10).unwrap_err(),
            Full::Tenant { limit: 2 }
        );
        assert_eq!(
            f.try_acquire(Some("b"), 81).unwrap_err(),
            Full::BodyBytes { limit: 100 }
        );
        let _b = f.try_acquire(Some("b"), 80).unwrap();
        assert_eq!(
            f.try_acquire(None, 0).unwrap_err(),
            Full::Requests { limit: 3 }
        );
        drop(a1);
        assert_eq!(f.requests(), 2);
        let _a3 = f.try_acquire(Some("a"), 0).unwrap();
        assert_eq!(f.requests(), 3);
    }

    #[test]
    fn the_counts_are_the_sum_of_the_live_permits() {
        let f = InFlight::new(Bounds {
            requests: 1000,
            per_tenant: 1000,
            body_bytes: u64::MAX,
        });
        let mut live = Vec::new();
        for i in 0..500u64 {
            let tenant = ["a", "b", "c"][(i % 3) as usize];
            live.push(f.try_acquire(Some(tenant), i).unwrap());
            if i % 4 == 0 {
                live.remove((i as usize * 7) % live.len());
            }
        }
        let counts = f.counts.lock().unwrap();
        assert_eq!(counts.requests, live.len());
        assert_eq!(
            counts.body_bytes,
            live.iter().map(|p| p.body_bytes).sum::<u64>()
        );
        assert_eq!(counts.per_tenant.values().sum::<usize>(), live.len());
        drop(counts);
        drop(live);
        assert_eq!(f.requests(), 0);
        assert!(f.counts.lock().unwrap().per_tenant.is_empty());
    }
}
