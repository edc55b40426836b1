//! What the engine hands out for others to read: the queue-depth gauges, the queue
//! snapshots and the fair-share counters to persist.

use std::collections::BTreeSet;

use metronome_protocol::QueueSnapshot;

use crate::engine::Effect;
use crate::engine::Engine;

impl Engine {
    pub(super) fn publish_depths(&self) {
        if let Ok(mut depths) = self.metrics.queue_depth.lock() {
            self.queues.write_depths(&mut depths);
        }
    }

    /// Hand the counters out to be persisted ([`Effect::PersistFairness`]) when they
    /// changed since last handed out (on the tick, and once more when the term ends).
    pub(super) fn persist_fairness(&mut self) {
        let Some(last) = &mut self.fairness_persisted else {
            return;
        };
        let snapshot = self.queues.fairness_snapshot();
        if *last != snapshot {
            *last = snapshot.clone();
            self.effects.push(Effect::PersistFairness(snapshot));
        }
    }

    /// Hand out a snapshot of every known model's queue (those of live workers' models and
    /// those that held jobs this term, emptied ones included) to be published
    /// ([`Effect::PublishQueues`]) when one changed, at most every `min_interval_ms`; the
    /// per-model oldest-wait gauges follow.
    pub(super) fn publish_queues(&mut self, now: u64) {
        let Some(min_interval_ms) = self.queues_published.as_ref().map(|(_, ms)| *ms) else {
            return;
        };
        if self.queues_taken_ms != 0 && now < self.queues_taken_ms + min_interval_ms {
            return;
        }
        self.queues_taken_ms = now;
        let mut models: BTreeSet<&str> = self.queues.known_models().collect();
        models.extend(self.workers.iter().map(|w| w.status.model.as_str()));
        let snapshots: Vec<QueueSnapshot> = models
            .into_iter()
            .map(|m| {
                let mut s = self.queues.snapshot(m, now);
                s.epoch = self.s.epoch;
                s.dispatcher_id.clone_from(&self.s.dispatcher_id);
                s
            })
            .collect();
        if let Ok(mut waits) = self.metrics.queue_oldest_wait_ms.lock() {
            *waits = snapshots
                .iter()
                .map(|s| (s.model.clone(), s.oldest_wait_ms))
                .collect();
        }
        let Some((last, _)) = &mut self.queues_published else {
            return;
        };
        let changed = last.len() != snapshots.len()
            || last.iter().zip(&snapshots).any(|(a, b)| !a.same_queue(b));
        if changed {
            last.clone_from(&snapshots);
            self.effects.push(Effect::PublishQueues(snapshots));
        }
    }
}
