//! Which worker may speak for a job: a completion, failure, cancellation or refusal counts
//! only from the worker this leader holds the job on. Anything else is dropped, counted
//! (`metronome_dispatcher_worker_claims_dropped_total`) and logged at most once per worker
//! per [`LOG_EVERY_MS`].
//!
//! The worker's identity is the subject its event came on (`events.done.<worker_id>`):
//! NATS permissions let each worker identity publish only under its own id, and the intake
//! drops an event whose body names another worker than its subject. What permissions cannot
//! say is which jobs a worker holds; without this check one worker's credentials could
//! refuse any other worker's job (the leader assigned it a second time while the first run
//! still streamed, and three forged refusals ended it `max_attempts`), finish it (its
//! client's cancel then did nothing, its tenant's fair-share counter took made-up token
//! counts), or feed made-up output lengths into its model's estimates.
//!
//! Who holds a job, in order of authority:
//! 1. the ledger's booking: placed by this leader on that worker, or adopted from that
//!    worker's heartbeat only where the decision on record names it (`registry::Vouching`);
//! 2. the worker this leader assigned the job to while it holds the job's body (the
//!    booking can lapse first: a reservation not listed by heartbeats expires);
//! 3. for a job this leader knows nothing of (an earlier leader assigned it, and no
//!    heartbeat reported it), only a refusal counts: it is assigned again only from a
//!    carried copy the intake kept because the decision on record assigns that attempt to
//!    that worker, and otherwise its client is told only if, after a grace period, no
//!    worker holds the job and this leader has not seen it queued, assigned or finished.
//!    What remains (docs/SECURITY.md): such a refusal can end, with `worker_failed`, a job
//!    no worker reports (one an earlier leader assigned, or one finished over a minute ago).
//!
//! Pure: no clock (time is an argument), no I/O beyond the metric and the log line.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

use metronome_protocol::{CompletionEvent, CompletionOutcome};

use crate::Metrics;

/// A worker's dropped claims are logged at most this often (the count is exact).
pub const LOG_EVERY_MS: u64 = 60_000;

/// At most this many workers' last log times are kept (worker ids are NATS identities, so
/// this bounds only a misconfiguration).
const LOGGED_MAX: usize = 10_000;

/// What this leader knows of who holds a job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holding<'a> {
    /// The worker the ledger books the job on.
    pub booked_on: Option<&'a str>,
    /// The worker this leader assigned the job to, while it holds the body (`None` also when
    /// the assignment stands on a worker it does not know: an earlier leader's).
    pub assigned_to: Option<&'a str>,
}

/// Whether a worker's event about a job counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Counts,
    Dropped(&'static str),
}

/// Whether `worker_id`'s event with `outcome` about a job held as `holding` counts.
pub fn judge(worker_id: &str, outcome: CompletionOutcome, holding: Holding<'_>) -> Verdict {
    if let Some(holder) = holding.booked_on.or(holding.assigned_to) {
        return if holder == worker_id {
            Verdict::Counts
        } else {
            Verdict::Dropped("the job is held on another worker")
        };
    }
    if outcome == CompletionOutcome::Refused {
        return Verdict::Counts;
    }
    Verdict::Dropped("the job is not held on any worker known here")
}

/// The check with its counter and its log limit, owned by the engine.
#[derive(Debug, Default)]
pub struct WorkerClaims {
    /// When each worker's dropped claims were last logged.
    logged_ms: HashMap<String, u64>,
}

impl WorkerClaims {
    /// Whether `event` counts given `holding`; a dropped one is counted and, at most once
    /// per worker per [`LOG_EVERY_MS`], logged.
    pub fn admit(
        &mut self,
        event: &CompletionEvent,
        holding: Holding<'_>,
        now_ms: u64,
        metrics: &Metrics,
    ) -> bool {
        let reason = match judge(&event.worker_id, event.outcome, holding) {
            Verdict::Counts => return true,
            Verdict::Dropped(reason) => reason,
        };
        metrics.worker_claims_dropped_total.fetch_add(1, Relaxed);
        if self.should_log(&event.worker_id, now_ms) {
            tracing::warn!(
                worker_id = %event.worker_id,
                job_id = %event.job_id,
                attempt = event.attempt,
                outcome = ?event.outcome,
                held_on = ?holding.booked_on.or(holding.assigned_to),
                reason,
                "a worker's event about a job it does not hold is dropped (further ones from this worker are only counted for a minute)"
            );
        }
        false
    }

    /// Whether a dropped claim of `worker_id` at `now_ms` is logged.
    fn should_log(&mut self, worker_id: &str, now_ms: u64) -> bool {
        if let Some(&at) = self.logged_ms.get(worker_id) {
            if now_ms.saturating_sub(at) < LOG_EVERY_MS {
                return false;
            }
        }
        if self.logged_ms.len() >= LOGGED_MAX {
            self.logged_ms
                .retain(|_, at| now_ms.saturating_sub(*at) < LOG_EVERY_MS);
        }
        self.logged_ms.insert(worker_id.to_string(), now_ms);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CompletionOutcome::*;

    const ALL: [CompletionOutcome; 4] = [Done, Failed, Cancelled, Refused];

    fn booked(w: &str) -> Holding<'_> {
        Holding {
            booked_on: Some(w),
            assigned_to: None,
        }
    }

    fn dropped(v: Verdict) -> bool {
        matches!(v, Verdict::Dropped(_))
    }

    #[test]
    fn only_the_booked_worker_speaks_for_a_job() {
        for outcome in ALL {
            assert_eq!(judge("w1", outcome, booked("w1")), Verdict::Counts);
            assert!(dropped(judge("w2", outcome, booked("w1"))), "{outcome:?}");
        }
    }

    #[test]
    fn a_lapsed_booking_falls_back_to_the_assignment() {
        let assigned = Holding {
            booked_on: None,
            assigned_to: Some("w1"),
        };
        assert_eq!(judge("w1", Done, assigned), Verdict::Counts);
        assert!(dropped(judge("w2", Refused, assigned)));
        // The booking wins over the assignment (it moves with adoption).
        let both = Holding {
            booked_on: Some("w2"),
            assigned_to: Some("w1"),
        };
        assert_eq!(judge("w2", Done, both), Verdict::Counts);
        assert!(dropped(judge("w1", Done, both)));
    }

    #[test]
    fn of_a_job_held_nowhere_known_only_a_refusal_counts() {
        let unknown = Holding::default();
        assert_eq!(judge("w1", Refused, unknown), Verdict::Counts);
        for outcome in [Done, Failed, Cancelled] {
            assert!(dropped(judge("w1", outcome, unknown)), "{outcome:?}");
        }
    }

    fn event(worker: &str, job: &str) -> CompletionEvent {
        CompletionEvent {
            v: 1,
            job_id: job.into(),
            worker_id: worker.into(),
            model: "m".into(),
            epoch: 1,
            attempt: 1,
            outcome: Refused,
            streamed: false,
            error: None,
            prompt_tokens: 1,
            output_tokens: 0,
            ttft_ms: None,
            tpot_ms: None,
            e2e_ms: 0.0,
            finished_ms: 0,
            job: None,
        }
    }

    #[test]
    fn dropped_claims_are_all_counted_and_logged_once_a_minute_per_worker() {
        let metrics = Metrics::default();
        let mut claims = WorkerClaims::default();
        let victim = booked("w1");
        assert!(claims.admit(&event("w1", "j"), victim, 0, &metrics));
        for (i, now) in [0, 1_000, LOG_EVERY_MS - 1].into_iter().enumerate() {
            assert!(!claims.admit(&event("w2", &format!("j{i}")), victim, now, &metrics));
        }
        assert_eq!(metrics.worker_claims_dropped_total.load(Relaxed), 3);
        // Logged at 0 only; a second worker has its own minute; the first's next minute.
        assert!(!claims.should_log("w2", LOG_EVERY_MS - 1));
        assert!(claims.should_log("w3", 5));
        assert!(claims.should_log("w2", LOG_EVERY_MS));
    }
}
