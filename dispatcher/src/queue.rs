//! Admission queues: one bounded FIFO per model, holding jobs that are read but not yet
//! assigned (their JOBS messages stay unacknowledged meanwhile).
//!
//! Within a model, the engine serves the oldest job that can still meet its TTFT target
//! first, and jobs past it ("late") only when none is waiting
//! ([`Queues::next_to_try`]).
//!
//! Invariants: each queue is ordered by the job's JOBS stream sequence, so a job that
//! comes back (failed publish, refusal, rescue) goes back to its place, ahead of later
//! jobs; the bound applies only to new arrivals (a returning job is never dropped);
//! head-of-line blocking exists only inside one model's queue, because each model is
//! dispatched independently.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use metronome_protocol::Job;

/// A job waiting for a worker.
pub struct QueuedJob {
    pub job: Arc<Job>,
    /// Dispatch attempt it will be assigned as (from 1).
    pub attempt: u32,
    /// The JOBS message, acknowledged once the job is assigned or rejected. `None` for a
    /// job whose JOBS message was already acknowledged (a retry after a refusal or rescue).
    pub acker: Option<Arc<Acker>>,
    /// JOBS stream sequence: the order key.
    pub seq: u64,
    /// When this dispatcher read it (Unix ms).
    pub enqueued_ms: u64,
    /// Absolute start deadline (Unix ms).
    pub deadline_ms: u64,
    /// Last time the JOBS message's ack wait was extended (Unix ms).
    pub progress_ms: u64,
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRefusal {
    Full { bound: usize },
}

/// All admission queues.
pub struct Queues {
    by_model: BTreeMap<String, VecDeque<QueuedJob>>,
    bound: usize,
    total: usize,
    /// Ids of every waiting job, so redelivery and cancellation checks are O(1).
    ids: HashSet<String>,
}

impl Queues {
    pub fn new(bound_per_model: usize) -> Queues {
        Queues {
            by_model: BTreeMap::new(),
            bound: bound_per_model,
            total: 0,
            ids: HashSet::new(),
        }
    }

    /// Queue a new arrival, refusing it when its model's queue is at the bound.
    pub fn push(&mut self, job: QueuedJob) -> Result<(), (QueuedJob, QueueRefusal)> {
        let bound = self.bound;
        let q = self.by_model.entry(job.job.model.clone()).or_default();
        if q.len() >= bound {
            return Err((job, QueueRefusal::Full { bound }));
        }
        self.ids.insert(job.job.id.clone());
        insert_by_seq(q, job);
        self.total += 1;
        Ok(())
    }

    /// Put a job back at its place (by sequence), whatever the bound.
    pub fn put_back(&mut self, job: QueuedJob) {
        let q = self.by_model.entry(job.job.model.clone()).or_default();
        self.ids.insert(job.job.id.clone());
        insert_by_seq(q, job);
        self.total += 1;
    }

    pub fn front(&self, model: &str) -> Option<&QueuedJob> {
        self.by_model.get(model).and_then(|q| q.front())
    }

    /// Position of the job to try next in the model's queue: the first one `late` says is
    /// not late, or else the head (then every job is late). Stops at the first job that is
    /// not late, so a long queue of fresh jobs costs one look, not a scan.
    pub fn next_to_try(&self, model: &str, late: impl Fn(&QueuedJob) -> bool) -> Option<usize> {
        let q = self.by_model.get(model).filter(|q| !q.is_empty())?;
        Some(q.iter().position(|j| !late(j)).unwrap_or(0))
    }

    /// The job at `pos` in the model's queue.
    pub fn get(&self, model: &str, pos: usize) -> Option<&QueuedJob> {
        self.by_model.get(model).and_then(|q| q.get(pos))
    }

    /// Remove and return the job at `pos` in the model's queue.
    pub fn take(&mut self, model: &str, pos: usize) -> Option<QueuedJob> {
        let job = self.by_model.get_mut(model)?.remove(pos)?;
        self.total -= 1;
        self.ids.remove(&job.job.id);
        Some(job)
    }

    pub fn pop_front(&mut self, model: &str) -> Option<QueuedJob> {
        let job = self.by_model.get_mut(model)?.pop_front()?;
        self.total -= 1;
        self.ids.remove(&job.job.id);
        Some(job)
    }

    pub fn len(&self, model: &str) -> usize {
        self.by_model.get(model).map_or(0, |q| q.len())
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Models with at least one waiting job, in name order.
    pub fn models(&self) -> Vec<String> {
        self.by_model
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// Remove a job by id (cancellation); linear in its queue, cancellations are rare.
    pub fn remove(&mut self, job_id: &str) -> Option<QueuedJob> {
        if !self.ids.remove(job_id) {
            return None;
        }
        for q in self.by_model.values_mut() {
            if let Some(pos) = q.iter().position(|j| j.job.id == job_id) {
                self.total -= 1;
                return q.remove(pos);
            }
        }
        None
    }

    /// True when a job with this id is waiting.
    pub fn contains(&self, job_id: &str) -> bool {
        self.ids.contains(job_id)
    }

    /// Remove and return every job whose deadline is before `now_ms`.
    pub fn take_expired(&mut self, now_ms: u64) -> Vec<QueuedJob> {
        let mut out = Vec::new();
        for q in self.by_model.values_mut() {
            if q.iter().all(|j| j.deadline_ms >= now_ms) {
                continue;
            }
            let (keep, gone): (VecDeque<_>, VecDeque<_>) =
                q.drain(..).partition(|j| j.deadline_ms >= now_ms);
            *q = keep;
            out.extend(gone);
        }
        self.total -= out.len();
        for j in &out {
            self.ids.remove(&j.job.id);
        }
        out
    }

    /// Jobs whose ack wait should be extended (last extension before `older_than_ms`);
    /// marks them as extended at `now_ms`.
    pub fn due_for_progress(&mut self, older_than_ms: u64, now_ms: u64) -> Vec<Arc<Acker>> {
        let mut out = Vec::new();
        for q in self.by_model.values_mut() {
            for j in q.iter_mut() {
                if j.progress_ms < older_than_ms {
                    if let Some(a) = &j.acker {
                        out.push(a.clone());
                    }
                    j.progress_ms = now_ms;
                }
            }
        }
        out
    }

    /// Depth per model, for the metrics.
    pub fn depths(&self) -> BTreeMap<String, usize> {
        self.by_model
            .iter()
            .map(|(m, q)| (m.clone(), q.len()))
            .collect()
    }
}

fn insert_by_seq(q: &mut VecDeque<QueuedJob>, job: QueuedJob) {
    if q.back().is_none_or(|b| b.seq <= job.seq) {
        q.push_back(job);
    } else {
        let pos = q.partition_point(|j| j.seq <= job.seq);
        q.insert(pos, job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn job(id: &str, model: &str, seq: u64) -> QueuedJob {
        QueuedJob {
            job: Arc::new(Job {
                v: 1,
                id: id.into(),
                model: model.into(),
                endpoint: metronome_protocol::Endpoint::Chat,
                request: json!({}),
                prompt_tokens: 1,
                max_tokens: 1,
                submitted_ms: 0,
                deadline_ms: None,
                slo: None,
                tenant: None,
            }),
            attempt: 1,
            acker: None,
            seq,
            enqueued_ms: 0,
            deadline_ms: seq * 10,
            progress_ms: 0,
        }
    }

    #[test]
    fn fifo_per_model_with_a_bound_for_new_arrivals_only() {
        let mut q = Queues::new(2);
        q.push(job("a", "m1", 1)).ok().unwrap();
        q.push(job("b", "m1", 2)).ok().unwrap();
        assert!(q.push(job("c", "m1", 3)).is_err());
        q.push(job("x", "m2", 4)).ok().unwrap();
        let a = q.pop_front("m1").unwrap();
        assert_eq!(a.job.id, "a");
        q.push(job("c", "m1", 3)).ok().unwrap();
        // A returning job goes back to its place even past the bound.
        q.put_back(a);
        assert_eq!(q.len("m1"), 3);
        let order: Vec<String> = std::iter::from_fn(|| q.pop_front("m1"))
            .map(|j| j.job.id.to_string())
            .collect();
        assert_eq!(order, ["a", "b", "c"]);
        assert_eq!(q.total(), 1);
    }

    #[test]
    fn tries_the_first_fresh_job_else_the_head() {
        let mut q = Queues::new(10);
        for (i, id) in ["late-a", "late-b", "fresh-c", "fresh-d"]
            .iter()
            .enumerate()
        {
            q.push(job(id, "m", i as u64 + 1)).ok().unwrap();
        }
        let late = |j: &QueuedJob| j.job.id.starts_with("late");
        assert_eq!(q.next_to_try("m", late), Some(2));
        assert_eq!(q.next_to_try("m", |_| true), Some(0));
        assert_eq!(q.take("m", 2).unwrap().job.id, "fresh-c");
        assert_eq!(q.get("m", 2).unwrap().job.id, "fresh-d");
        assert_eq!(q.total(), 3);
        assert!(!q.contains("fresh-c"));
        assert_eq!(q.next_to_try("other", late), None);
    }

    #[test]
    fn removes_cancelled_and_expired_jobs() {
        let mut q = Queues::new(10);
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            q.push(job(id, "m", i as u64 + 1)).ok().unwrap();
        }
        assert_eq!(q.remove("b").unwrap().job.id, "b");
        assert!(q.remove("b").is_none());
        let expired = q.take_expired(15);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].job.id, "a");
        assert_eq!(q.total(), 1);
        assert_eq!(q.front("m").unwrap().job.id, "c");
    }
}
