//! A time-bounded set of job ids: "seen recently", for as long as a late message about the
//! same job may still arrive (a heartbeat sent before a completion, a job still in the
//! intake when its cancel came).
//!
//! Ids are kept in insertion order next to the lookup map, so expiry pops from the front
//! and costs O(expired), never a scan of the whole window: with thousands of completions a
//! second, a `retain` over the window on every insert is quadratic. The caller passes `now`
//! (no clock here), and the set also has a size bound so a flood of ids (cancels are
//! client-chosen) cannot grow it without limit; over the bound the oldest go first.
//!
//! Invariant: every id of `at` has an entry in `order` with the same time (its latest
//! insert), and `order` is sorted by time; entries of earlier inserts of a renewed id are
//! skipped when they reach the front.

use std::collections::{HashMap, VecDeque};

/// Job ids seen within the last `window_ms`, at most `max` of them.
#[derive(Debug)]
pub struct RecentIds {
    at: HashMap<String, u64>,
    order: VecDeque<(String, u64)>,
    window_ms: u64,
    max: usize,
}

impl RecentIds {
    pub fn new(window_ms: u64, max: usize) -> RecentIds {
        RecentIds {
            at: HashMap::new(),
            order: VecDeque::new(),
            window_ms,
            max: max.max(1),
        }
    }

    /// Remember `id` as seen at `now_ms`. Seen again, it is renewed: the entry in `order`
    /// with an older time is skipped when it reaches the front.
    pub fn insert(&mut self, id: &str, now_ms: u64) {
        self.expire(now_ms);
        self.at.insert(id.to_string(), now_ms);
        self.order.push_back((id.to_string(), now_ms));
        while self.at.len() > self.max {
            self.pop_front();
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        self.at.contains_key(id)
    }

    /// Forget `id` now (its late messages no longer matter).
    pub fn remove(&mut self, id: &str) -> bool {
        self.at.remove(id).is_some()
    }

    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Drop every id older than the window.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some((_, at)) = self.order.front() {
            if now_ms.saturating_sub(*at) < self.window_ms {
                break;
            }
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some((id, at)) = self.order.pop_front() {
            // Only the entry of the latest insert removes the id.
            if self.at.get(&id) == Some(&at) {
                self.at.remove(&id);
            }
        }
    }

    /// Entries in the order queue, stale ones included: what expiry walks.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_expire_after_the_window() {
        let mut r = RecentIds::new(1_000, 100);
        r.insert("a", 0);
        r.insert("b", 500);
        assert!(r.contains("a") && r.contains("b"));
        r.expire(999);
        assert!(r.contains("a"));
        r.expire(1_000);
        assert!(!r.contains("a"));
        assert!(r.contains("b"));
        r.expire(1_500);
        assert!(r.is_empty());
    }

    #[test]
    fn a_renewed_id_lives_a_window_past_its_last_insert() {
        let mut r = RecentIds::new(1_000, 100);
        r.insert("a", 0);
        r.insert("a", 800);
        r.expire(1_200);
        assert!(r.contains("a"), "renewed at 800");
        r.expire(1_800);
        assert!(!r.contains("a"));
        assert_eq!(r.queued(), 0, "stale entries are dropped too");
    }

    #[test]
    fn the_size_bound_drops_the_oldest() {
        let mut r = RecentIds::new(u64::MAX, 3);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            r.insert(id, i as u64);
        }
        assert_eq!(r.len(), 3);
        assert!(!r.contains("a"));
        assert!(r.contains("d"));
    }

    /// Expiry is amortised O(1) per insert: each insert walks only what expired since, so
    /// the queue never holds more than the ids inserted within one window (the old code
    /// walked the whole window on every completion).
    #[test]
    fn each_insert_walks_only_what_expired() {
        let mut r = RecentIds::new(100, usize::MAX);
        for t in 0..10_000u64 {
            r.insert(&format!("j{t}"), t);
            assert!(r.queued() <= 100, "at {t}: {}", r.queued());
        }
        assert_eq!(r.len(), 100);
    }
}
