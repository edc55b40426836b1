//! Cancels: a client's `cancel.<tenant>.<job_id>` applied to a waiting job, relayed to the
//! worker holding it, or remembered until the job arrives or its worker reports it.
//!
//! Invariant: a cancel applies only to a job of the tenant it names.

use std::sync::atomic::Ordering::Relaxed;

use metronome_protocol::ErrorCode;
use metronome_protocol::Outcome as DecisionOutcome;

use crate::engine::Engine;
use crate::engine::Outcome;
use crate::queue::tenant_of;

/// The key of a cancel of `job_id` naming `tenant` in [`Engine::cancelled`]: its subject.
pub(in crate::engine) fn cancel_key(tenant: Option<&str>, job_id: &str) -> String {
    metronome_protocol::names::cancel_subject(tenant, job_id)
}

impl Engine {
    /// A client's `cancel.<tenant>.<job_id>`. Its permissions let it name only its own
    /// tenant, but any job id: a cancel of a job this leader holds for another tenant is
    /// ignored and counted, and a remembered one matches only a job of its tenant.
    pub(in crate::engine) fn on_cancel(&mut self, tenant: Option<&str>, job_id: &str) {
        let key = cancel_key(tenant, job_id);
        if self.relayed.contains(&key) {
            // Our own relay coming back.
            return;
        }
        let holder = self
            .queues
            .tenant_of_waiting(job_id)
            .or_else(|| self.assigned.get(job_id).map(|a| tenant_of(&a.job)));
        if let Some(holder) = holder {
            if holder != tenant.unwrap_or("") {
                self.metrics
                    .cancels_of_another_tenant_total
                    .fetch_add(1, Relaxed);
                tracing::warn!(
                    job_id,
                    cancel_tenant = tenant.unwrap_or(""),
                    job_tenant = holder,
                    "ignoring a cancel that names another tenant than the job's"
                );
                return;
            }
        }
        if let Some(job) = self.queues.remove(job_id) {
            let now = self.now_ms;
            tracing::info!(job_id, "cancelled while queued");
            self.reject(
                &job.job,
                job.attempt,
                DecisionOutcome::Rejected,
                "cancelled",
                "cancelled by its client while queued",
                ErrorCode::Cancelled,
                job.acker,
                now.saturating_sub(job.enqueued_ms),
            );
            return;
        }
        if self.finished.contains(job_id) {
            return;
        }
        if let Some(worker) = self.ledger.worker_of(job_id) {
            // Held by a worker (assigned here, or adopted from its heartbeat): relayed to
            // that worker alone, which hears no other cancels. Remembered too, for the
            // relay once its worker reports it (the cancel may overtake the Assignment).
            tracing::info!(
                job_id,
                worker_id = worker,
                "relaying a cancel to the worker holding the job"
            );
            self.emit(Outcome::RelayCancel {
                worker_id: worker.to_string(),
                tenant: tenant.map(str::to_string),
                job_id: job_id.to_string(),
            });
        }
        // Not here yet (still in the intake), or assigned and not yet reported by its
        // worker (the Assignment may reach the worker after the client's cancel did):
        // remembered, applied when the job arrives, is refused or rescued, or relayed once
        // its worker reports it.
        tracing::info!(job_id, "cancel for a job not queued here: remembered");
        self.cancelled.insert(&key, self.now_ms);
    }

    /// Relay remembered cancels of jobs a worker now reports holding: the client's cancel
    /// may have reached the worker before the Assignment did. Only jobs this leader assigned
    /// (it knows their tenant, which the cancel must name); the agent checks it again.
    pub(in crate::engine) fn relay_cancels(&mut self, in_flight: &[String], now: u64) {
        if self.cancelled.is_empty() {
            return;
        }
        for job_id in in_flight {
            let Some(a) = self.assigned.get(job_id) else {
                continue;
            };
            let tenant = a.job.tenant.clone();
            let key = cancel_key(tenant.as_deref(), job_id);
            let Some(worker_id) = self.ledger.worker_of(job_id).map(str::to_string) else {
                continue;
            };
            if self.cancelled.remove(&key) {
                tracing::info!(job_id = %job_id, "relaying a cancel to the worker that reports the job");
                self.relayed.insert(&key, now);
                self.emit(Outcome::RelayCancel {
                    worker_id,
                    tenant,
                    job_id: job_id.clone(),
                });
            }
        }
    }
}
