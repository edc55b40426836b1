//! Per-model admission queue snapshots: what the leading dispatcher holds waiting, one
//! [`QueueSnapshot`] per model in the `queues` KV bucket (key [`crate::names::queue_key`]),
//! so operators' tools (`metronome status`, the console) can show queue lengths and waits
//! without asking the dispatcher.
//!
//! Written by the leader at a bounded rate (when a model's queue changed, at most every
//! `queue_snapshot_ms`, and every [`QUEUE_REFRESH_MS`] even when nothing changed), never
//! per arrival. A model whose queue emptied is written with `waiting: 0`, so a reader
//! never keeps showing a queue that is gone. A reader calls a snapshot stale
//! ([`QueueSnapshot::freshness`]) when it is older than [`QUEUE_STALE_AFTER_MS`] (the
//! leader stopped writing: it died or was fenced) or when it comes from an epoch older than
//! the current leader's (written by a leader that has since lost the lease).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::job::{check_model_name, check_tenant, Priority};

/// The leader rewrites every model's snapshot at least this often, changed or not.
pub const QUEUE_REFRESH_MS: u64 = 1_000;
/// A snapshot written longer ago than this is stale: its leader stopped writing.
pub const QUEUE_STALE_AFTER_MS: u64 = 5_000;
/// Most flows (tenant, class) listed in one snapshot: the largest ones.
pub const MAX_FLOWS: usize = 32;

/// Jobs waiting for one tenant in one priority class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowCount {
    /// The fair-share tenant; empty for jobs submitted without one.
    pub tenant: String,
    pub priority: Priority,
    pub waiting: u32,
}

/// The admission queue of one model, as the leader held it at `written_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub v: u32,
    pub model: String,
    /// Jobs read from JOBS and not yet assigned or answered.
    pub waiting: u32,
    /// When the leader read the longest-waiting job (Unix ms, the leader's clock); `None`
    /// when nothing waits.
    #[serde(default)]
    pub oldest_enqueued_ms: Option<u64>,
    /// How long that job had waited at `written_ms` (0 when nothing waits).
    #[serde(default)]
    pub oldest_wait_ms: u64,
    /// Waiting jobs per priority class.
    #[serde(default)]
    pub by_priority: BTreeMap<Priority, u32>,
    /// Waiting jobs per (tenant, class), largest first, at most [`MAX_FLOWS`].
    #[serde(default)]
    pub flows: Vec<FlowCount>,
    /// Flows not listed in `flows`.
    #[serde(default)]
    pub flows_not_listed: u32,
    /// The queue's bound in jobs ([`refuses_arrival`]), so a gateway can refuse a job the
    /// leader would refuse without a round trip ([`QueueSnapshot::refuses`]). `None` from
    /// leaders that predate it (and it is left out of the JSON then): nobody can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<u32>,
    /// Epoch of the leader that wrote it.
    pub epoch: u64,
    pub dispatcher_id: String,
    /// When it was written (Unix ms, the leader's clock).
    pub written_ms: u64,
}

/// Whether a model's queue of `len` jobs with bound `bound` refuses a new job of a tenant
/// that holds `held` of them while `sharing` tenants (that one included) hold jobs there.
/// At the bound only a tenant holding less than its share of it (`bound / sharing`) is
/// admitted, so one tenant filling the queue cannot lock the others out, and nobody past
/// twice the bound. The leader's queue applies it; a gateway applies it to the snapshot.
pub fn refuses_arrival(len: usize, bound: usize, held: usize, sharing: usize) -> bool {
    len >= bound && (len >= bound.saturating_mul(2) || held >= bound / sharing.max(1))
}

/// Why bytes from the `queues` bucket are not a usable snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueSnapshotError {
    #[error("not a queue snapshot: {0}")]
    Json(String),
    #[error("unsupported version {0}")]
    Version(u32),
    #[error("invalid model name: {0}")]
    Model(String),
    #[error("invalid tenant in a flow: {0}")]
    Tenant(String),
    #[error("{what} ({count}) exceeds the jobs waiting ({waiting})")]
    Count {
        what: &'static str,
        count: u64,
        waiting: u32,
    },
    #[error("oldest_enqueued_ms must be set exactly when jobs wait")]
    Oldest,
}

/// How far a reader can trust a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Freshness {
    Fresh,
    /// Written `age_ms` ago, longer than [`QUEUE_STALE_AFTER_MS`].
    Old {
        age_ms: u64,
    },
    /// Written by the leader of `epoch`, older than the current leader's.
    OlderEpoch {
        epoch: u64,
        leader_epoch: u64,
    },
}

impl Freshness {
    pub fn is_fresh(self) -> bool {
        self == Freshness::Fresh
    }
}

impl QueueSnapshot {
    /// Parse and validate a snapshot read from the bucket.
    pub fn parse(bytes: &[u8]) -> Result<QueueSnapshot, QueueSnapshotError> {
        let s: QueueSnapshot =
            serde_json::from_slice(bytes).map_err(|e| QueueSnapshotError::Json(e.to_string()))?;
        s.validate()?;
        Ok(s)
    }

    /// What a reader needs to hold: a version it knows, a valid model name, counts that
    /// add up, and an oldest job exactly when jobs wait.
    pub fn validate(&self) -> Result<(), QueueSnapshotError> {
        if self.v == 0 || self.v > crate::PROTOCOL_VERSION {
            return Err(QueueSnapshotError::Version(self.v));
        }
        check_model_name(&self.model).map_err(|e| QueueSnapshotError::Model(e.to_string()))?;
        for f in &self.flows {
            if !f.tenant.is_empty() {
                check_tenant(&f.tenant).map_err(|e| QueueSnapshotError::Tenant(e.to_string()))?;
            }
        }
        let sums: [(&'static str, u64); 2] = [
            (
                "the jobs per class",
                self.by_priority.values().map(|n| u64::from(*n)).sum(),
            ),
            (
                "the jobs of the listed flows",
                self.flows.iter().map(|f| u64::from(f.waiting)).sum(),
            ),
        ];
        for (what, count) in sums {
            if count > u64::from(self.waiting) {
                return Err(QueueSnapshotError::Count {
                    what,
                    count,
                    waiting: self.waiting,
                });
            }
        }
        if self.oldest_enqueued_ms.is_some() != (self.waiting > 0) {
            return Err(QueueSnapshotError::Oldest);
        }
        Ok(())
    }

    /// The same snapshot written at `now_ms`: the oldest job's wait is brought up to date.
    pub fn stamped(mut self, now_ms: u64) -> QueueSnapshot {
        self.written_ms = now_ms;
        self.oldest_wait_ms = self
            .oldest_enqueued_ms
            .map_or(0, |t| now_ms.saturating_sub(t));
        self
    }

    /// True when both describe the same queue (whatever the time they were taken at).
    pub fn same_queue(&self, other: &QueueSnapshot) -> bool {
        let at = |s: &QueueSnapshot| s.clone().stamped(0);
        at(self) == at(other)
    }

    /// Whether the queue, as this snapshot holds it, refuses a new job of `tenant` (`""`
    /// for jobs without one), by [`refuses_arrival`]. `None` when that cannot be told:
    /// no bound written, or the answer hangs on the tenants' shares and some flows are not
    /// listed.
    pub fn refuses(&self, tenant: &str) -> Option<bool> {
        let bound = self.bound? as usize;
        let len = self.waiting as usize;
        if len < bound {
            return Some(false);
        }
        if len >= bound.saturating_mul(2) {
            return Some(true);
        }
        if self.flows_not_listed > 0 {
            return None;
        }
        let held = self
            .flows
            .iter()
            .filter(|f| f.tenant == tenant)
            .map(|f| f.waiting as usize)
            .sum();
        let mut tenants: Vec<&str> = self.flows.iter().map(|f| f.tenant.as_str()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        let sharing = tenants.len() + usize::from(!tenants.contains(&tenant));
        Some(refuses_arrival(len, bound, held, sharing))
    }

    /// Fresh, or why not, at `now_ms` with the current leader's epoch (when known).
    pub fn freshness(&self, now_ms: u64, leader_epoch: Option<u64>) -> Freshness {
        if let Some(leader_epoch) = leader_epoch.filter(|e| *e > self.epoch) {
            return Freshness::OlderEpoch {
                epoch: self.epoch,
                leader_epoch,
            };
        }
        let age_ms = now_ms.saturating_sub(self.written_ms);
        if age_ms > QUEUE_STALE_AFTER_MS {
            return Freshness::Old { age_ms };
        }
        Freshness::Fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> QueueSnapshot {
        QueueSnapshot {
            v: 1,
            model: "llama-3.1-8b".into(),
            waiting: 3,
            oldest_enqueued_ms: Some(1_000),
            oldest_wait_ms: 500,
            by_priority: [(Priority::Interactive, 2), (Priority::Batch, 1)].into(),
            flows: vec![FlowCount {
                tenant: "acme".into(),
                priority: Priority::Interactive,
                waiting: 2,
            }],
            flows_not_listed: 1,
            bound: None,
            epoch: 7,
            dispatcher_id: "d1".into(),
            written_ms: 1_500,
        }
    }

    #[test]
    fn a_snapshot_without_a_bound_reads_and_says_nothing_about_refusals() {
        // What a leader that predates the bound writes.
        let old = r#"{"v":1,"model":"m","waiting":0,"epoch":1,"dispatcher_id":"d","written_ms":5}"#;
        let s = QueueSnapshot::parse(old.as_bytes()).unwrap();
        assert_eq!((s.bound, s.refuses("")), (None, None));
        let mut s = snapshot();
        s.bound = Some(3);
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains(r#""bound":3"#), "{text}");
        assert_eq!(
            QueueSnapshot::parse(text.as_bytes()).unwrap().bound,
            Some(3)
        );
    }

    #[test]
    fn refusals_follow_the_leaders_rule() {
        let flow = |tenant: &str, waiting| FlowCount {
            tenant: tenant.into(),
            priority: Priority::Interactive,
            waiting,
        };
        let mut s = snapshot();
        s.flows = vec![flow("acme", 3)];
        s.flows_not_listed = 0;
        s.bound = Some(4);
        // Under the bound: admitted.
        assert_eq!(s.refuses("acme"), Some(false));
        // At the bound: acme holds it all, a newcomer's share is 4 / 2 = 2 and it holds 0.
        s.waiting = 4;
        s.flows = vec![flow("acme", 4)];
        assert_eq!(s.refuses("acme"), Some(true));
        assert_eq!(s.refuses("globex"), Some(false));
        assert_eq!(s.refuses(""), Some(false));
        // Flows not all listed: the shares cannot be told.
        s.flows_not_listed = 1;
        assert_eq!(s.refuses("globex"), None);
        // Twice the bound refuses everyone, listed or not.
        s.waiting = 8;
        s.flows = vec![flow("acme", 8)];
        assert_eq!(s.refuses("globex"), Some(true));
        assert!(refuses_arrival(4, 4, 2, 2));
        assert!(!refuses_arrival(4, 4, 1, 2));
        assert!(!refuses_arrival(3, 4, 3, 1));
    }

    #[test]
    fn round_trips_and_validates() {
        let s = snapshot();
        let bytes = serde_json::to_vec(&s).unwrap();
        assert_eq!(QueueSnapshot::parse(&bytes).unwrap(), s);
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.contains(r#""by_priority":{"interactive":2,"batch":1}"#),
            "{text}"
        );
        // A newer writer's extra field does not break this reader.
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["later"] = 1.into();
        assert!(QueueSnapshot::parse(v.to_string().as_bytes()).is_ok());
    }

    #[test]
    fn rejects_what_a_reader_cannot_trust() {
        let mut s = snapshot();
        s.flows[0].waiting = 4;
        assert!(matches!(
            s.validate(),
            Err(QueueSnapshotError::Count { .. })
        ));
        let mut s = snapshot();
        s.waiting = 0;
        s.by_priority.clear();
        s.flows.clear();
        assert_eq!(s.validate(), Err(QueueSnapshotError::Oldest));
        s.oldest_enqueued_ms = None;
        assert_eq!(s.validate(), Ok(()));
        let mut s = snapshot();
        s.model = " ".into();
        assert!(matches!(s.validate(), Err(QueueSnapshotError::Model(_))));
        let mut s = snapshot();
        s.v = 99;
        assert_eq!(s.validate(), Err(QueueSnapshotError::Version(99)));
        assert!(matches!(
            QueueSnapshot::parse(b"{}"),
            Err(QueueSnapshotError::Json(_))
        ));
    }

    #[test]
    fn old_or_superseded_snapshots_are_stale() {
        let s = snapshot();
        assert_eq!(
            s.freshness(1_500 + QUEUE_STALE_AFTER_MS, Some(7)),
            Freshness::Fresh
        );
        assert_eq!(s.freshness(1_600, None), Freshness::Fresh);
        assert_eq!(
            s.freshness(1_501 + QUEUE_STALE_AFTER_MS, Some(7)),
            Freshness::Old {
                age_ms: QUEUE_STALE_AFTER_MS + 1
            }
        );
        assert_eq!(
            s.freshness(1_600, Some(9)),
            Freshness::OlderEpoch {
                epoch: 7,
                leader_epoch: 9
            }
        );
    }
}
