//! Which workers refused which jobs: a job a worker refused is not given back to that
//! worker on its next attempts while another worker of its model could take it. Without
//! this a leader re-picks the worker that just refused (it is now the idlest), and one
//! worker that refuses everything (poisoned, misconfigured, out of memory) uses up every
//! job's attempts on its own.
//!
//! Kept in the leader's memory for this term, bounded ([`REFUSALS_MAX`] jobs, the oldest
//! forgotten first); a job's entry goes when the job is settled. A retry put back on
//! `jobs.retry` carries its job's refusals in a header (`Metronome-Refused-By`), so a
//! leader that takes over and reads the retry learns them with it.

use std::collections::{HashMap, VecDeque};

use metronome_protocol::{Rejection, RejectionCode};
use metronome_scheduler::WorkerView;

/// Most jobs whose refusals are remembered.
pub const REFUSALS_MAX: usize = 100_000;

/// Refusals per job, each with the attempt refused.
#[derive(Default)]
pub struct Refusals {
    by_job: HashMap<String, Vec<(String, u32)>>,
    /// Jobs in the order of their first refusal (may name jobs already forgotten).
    order: VecDeque<String>,
}

impl Refusals {
    /// `worker_id` refused `job_id`'s `attempt`.
    pub fn record(&mut self, job_id: &str, worker_id: &str, attempt: u32) {
        match self.by_job.get_mut(job_id) {
            Some(workers) => {
                if !workers.iter().any(|(w, _)| w == worker_id) {
                    workers.push((worker_id.to_string(), attempt));
                }
            }
            None => {
                while self.by_job.len() >= REFUSALS_MAX {
                    let Some(oldest) = self.order.pop_front() else {
                        break;
                    };
                    self.by_job.remove(&oldest);
                }
                if self.order.len() >= 2 * REFUSALS_MAX {
                    let by_job = &self.by_job;
                    self.order.retain(|j| by_job.contains_key(j));
                }
                self.by_job
                    .insert(job_id.to_string(), vec![(worker_id.to_string(), attempt)]);
                self.order.push_back(job_id.to_string());
            }
        }
    }

    /// Every refusal of `job_id`: (worker, attempt refused).
    pub fn of(&self, job_id: &str) -> Vec<(String, u32)> {
        self.by_job.get(job_id).cloned().unwrap_or_default()
    }

    /// The job is settled (finished, failed, rejected): its refusals no longer matter.
    pub fn forget(&mut self, job_id: &str) {
        if !self.by_job.is_empty() {
            self.by_job.remove(job_id);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_job.is_empty()
    }

    /// The pool to place `job_id` from when workers of `workers` refused it and another
    /// worker there is `open` (alive, healthy, not draining): `workers` without those that
    /// refused it, and a rejection for each of them to list in the decision. `None` to
    /// place it from `workers` as they are: nobody refused it, or only workers that
    /// refused it could take it (a single worker's refusal may be passing).
    pub fn narrow(
        &self,
        job_id: &str,
        workers: &[WorkerView],
        open: impl Fn(&WorkerView) -> bool,
    ) -> Option<(Vec<WorkerView>, Vec<Rejection>)> {
        if self.by_job.is_empty() {
            return None;
        }
        let refused = self.by_job.get(job_id)?;
        let refused_by = |w: &WorkerView| {
            refused
                .iter()
                .find(|(id, _)| *id == w.status.worker_id)
                .map(|(_, attempt)| *attempt)
        };
        if !workers.iter().any(|w| refused_by(w).is_none() && open(w)) {
            return None;
        }
        let mut pool = Vec::with_capacity(workers.len());
        let mut rejections = Vec::new();
        for w in workers {
            match refused_by(w) {
                Some(attempt) => rejections.push(Rejection {
                    worker_id: w.status.worker_id.clone(),
                    code: RejectionCode::RefusedJob,
                    reason: format!(
                        "refused this job (attempt {attempt}): not given it again while another worker can take it"
                    ),
                    prediction: None,
                }),
                None => pool.push(w.clone()),
            }
        }
        Some((pool, rejections))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str) -> WorkerView {
        let status: metronome_protocol::WorkerStatus = serde_json::from_value(serde_json::json!({
            "v": 1, "worker_id": id, "model": "m", "healthy": true, "draining": false,
            "max_concurrency": 4, "active": 0, "queued": 0, "in_flight": [], "seq": 1,
            "sent_ms": 1
        }))
        .unwrap();
        WorkerView {
            status,
            last_seen_ms: 1,
            ewma: None,
            not_provisioned: None,
        }
    }

    #[test]
    fn a_refusing_worker_is_left_out_only_while_another_is_open() {
        let workers = [view("w1"), view("w2")];
        let mut r = Refusals::default();
        assert!(r.narrow("j", &workers, |_| true).is_none());
        r.record("j", "w1", 1);
        let (pool, rejected) = r.narrow("j", &workers, |_| true).unwrap();
        assert_eq!(pool.len(), 1);
        assert_eq!(pool[0].status.worker_id, "w2");
        assert_eq!(rejected[0].worker_id, "w1");
        assert_eq!(rejected[0].code, RejectionCode::RefusedJob);
        assert!(
            r.narrow("j", &workers, |w| w.status.worker_id == "w1")
                .is_none(),
            "only the refusing worker is open: it may try again"
        );
        assert!(r.narrow("other", &workers, |_| true).is_none());
        r.forget("j");
        assert!(r.is_empty());
    }

    #[test]
    fn refusals_are_bounded_oldest_first() {
        let mut r = Refusals::default();
        for i in 0..REFUSALS_MAX + 10 {
            r.record(&format!("j{i}"), "w", 1);
        }
        assert_eq!(r.by_job.len(), REFUSALS_MAX);
        assert!(!r.by_job.contains_key("j0"));
        assert!(r.by_job.contains_key(&format!("j{}", REFUSALS_MAX + 9)));
    }
}
