//! `metronome status`: the system on one screen: who leads (and since when), how many
//! jobs wait, per model in the leader's admission queues (with the oldest one's wait) and
//! in the JOBS stream, decisions per second and rejections over the last window per model,
//! and the workers by state.
//!
//! Pure: [`Report::from_parts`] aggregates what `source.rs` read; [`Report::render`]
//! writes it. The per-model queues come from the leader's snapshots in the `queues` bucket
//! (`metronome_protocol::queues`); one the leader stopped rewriting, or written by an
//! earlier leader, is shown as stale rather than as the queue now.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use metronome_protocol::{Decision, Freshness, Outcome, Priority, QueueSnapshot};

/// The part of a decision `status` counts; decoding only this keeps a busy minute (tens of
/// thousands of decisions, each with every candidate's terms) cheap to read.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Brief {
    #[serde(default)]
    pub model: Option<String>,
    pub outcome: Outcome,
    pub queue_wait_ms: u64,
    pub decided_ms: u64,
}

impl From<&Decision> for Brief {
    fn from(d: &Decision) -> Brief {
        Brief {
            model: d.model.clone(),
            outcome: d.outcome,
            queue_wait_ms: d.queue_wait_ms,
            decided_ms: d.decided_ms,
        }
    }
}

use crate::fmt::{self, Table};
use crate::workers::Counts;

/// The lease value the dispatcher writes (`dispatcher/src/leader.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseValue {
    pub dispatcher_id: String,
    pub acquired_ms: u64,
    pub renewed_ms: u64,
}

/// The `leader` bucket's view of leadership.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Leader {
    pub holder: String,
    pub acquired_ms: u64,
    pub renewed_ms: u64,
    /// Revision of the lease key now (grows with every renewal).
    pub lease_revision: u64,
    /// The holder's epoch (the lease's creation revision). The bucket keeps one revision,
    /// so it is read from the newest decision the holder published; `None` before its first.
    pub epoch: Option<u64>,
}

/// Decisions of one model over the window.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ModelStats {
    pub assigned: u64,
    pub rejected: u64,
    pub expired: u64,
    pub mean_queue_wait_ms: f64,
    pub max_queue_wait_ms: u64,
}

/// One model's admission queue as the leader last published it, and whether that is
/// still the queue now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueRow {
    #[serde(flatten)]
    pub snapshot: QueueSnapshot,
    pub freshness: Freshness,
    pub stale: bool,
}

impl QueueRow {
    /// Rows in model order, each judged at `now_ms` against the newest epoch known: the
    /// leader's, or else the newest any snapshot carries (an older one is an earlier
    /// leader's).
    pub fn rows(
        snapshots: Vec<QueueSnapshot>,
        leader_epoch: Option<u64>,
        now_ms: u64,
    ) -> Vec<QueueRow> {
        let newest = snapshots.iter().map(|s| s.epoch).max();
        let epoch = leader_epoch.max(newest);
        let mut rows: Vec<QueueRow> = snapshots
            .into_iter()
            .map(|snapshot| {
                let freshness = snapshot.freshness(now_ms, epoch);
                QueueRow {
                    snapshot,
                    freshness,
                    stale: !freshness.is_fresh(),
                }
            })
            .collect();
        rows.sort_by(|a, b| a.snapshot.model.cmp(&b.snapshot.model));
        rows
    }

    fn state(&self) -> String {
        match self.freshness {
            Freshness::Fresh => "fresh".into(),
            Freshness::Old { age_ms } => {
                format!("STALE: written {} ago", fmt::ms(age_ms as f64))
            }
            Freshness::OlderEpoch {
                epoch,
                leader_epoch,
            } => format!("STALE: from epoch {epoch}, the leader is at {leader_epoch}"),
        }
    }
}

/// Everything `status` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub leader: Option<Leader>,
    /// Jobs in the JOBS stream (submitted, not yet decided), all models together.
    pub jobs_waiting: Option<u64>,
    pub window_s: u64,
    pub decisions_per_s: f64,
    pub models: BTreeMap<String, ModelStats>,
    /// The leader's admission queues, per model (empty when none was ever published).
    pub queues: Vec<QueueRow>,
    pub workers: Counts,
}

impl Report {
    /// Aggregate the decisions of the last `window_s` seconds (those with
    /// `decided_ms >= now_ms - window_s * 1000`).
    pub fn from_parts(
        leader: Option<Leader>,
        jobs_waiting: Option<u64>,
        recent: &[Brief],
        window_s: u64,
        now_ms: u64,
        workers: Counts,
        queues: Vec<QueueSnapshot>,
    ) -> Report {
        let since = now_ms.saturating_sub(window_s * 1000);
        let mut models: BTreeMap<String, ModelStats> = BTreeMap::new();
        let mut waits: BTreeMap<String, u64> = BTreeMap::new();
        let mut n = 0u64;
        for d in recent.iter().filter(|d| d.decided_ms >= since) {
            n += 1;
            let model = d.model.clone().unwrap_or_else(|| "(unreadable)".into());
            let m = models.entry(model.clone()).or_default();
            match d.outcome {
                Outcome::Assigned => m.assigned += 1,
                Outcome::Rejected => m.rejected += 1,
                Outcome::Expired => m.expired += 1,
            }
            m.max_queue_wait_ms = m.max_queue_wait_ms.max(d.queue_wait_ms);
            *waits.entry(model).or_default() += d.queue_wait_ms;
        }
        for (model, m) in models.iter_mut() {
            let count = m.assigned + m.rejected + m.expired;
            m.mean_queue_wait_ms = waits[model] as f64 / count as f64;
        }
        let queues = QueueRow::rows(queues, leader.as_ref().and_then(|l| l.epoch), now_ms);
        Report {
            leader,
            jobs_waiting,
            window_s,
            decisions_per_s: if window_s == 0 {
                0.0
            } else {
                n as f64 / window_s as f64
            },
            models,
            queues,
            workers,
        }
    }

    pub fn render(&self, now_ms: u64) -> String {
        let mut out = String::new();
        match &self.leader {
            Some(l) => out.push_str(&format!(
                "leader:    {} (epoch {}), leading since {} ({}), lease renewed {}\n",
                l.holder,
                l.epoch
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "unknown: no decision yet".into()),
                fmt::utc(l.acquired_ms),
                fmt::age(now_ms, l.acquired_ms),
                fmt::age(now_ms, l.renewed_ms),
            )),
            None => out.push_str(
                "leader:    NONE: no dispatcher holds the lease, nothing is being decided\n",
            ),
        }
        out.push_str(&format!(
            "workers:   {} up, {} draining, {} unhealthy, {} stale\n",
            self.workers.up, self.workers.draining, self.workers.unhealthy, self.workers.stale
        ));
        match self.jobs_waiting {
            Some(n) => out.push_str(&format!(
                "queued:    {n} jobs submitted and not yet decided (all models)\n"
            )),
            None => out.push_str("queued:    n/a (no JOBS stream)\n"),
        }
        if self.queues.is_empty() {
            out.push_str("queues:    n/a: no leader has published its admission queues\n");
        } else {
            let waiting: u64 = self
                .queues
                .iter()
                .filter(|q| !q.stale)
                .map(|q| u64::from(q.snapshot.waiting))
                .sum();
            let stale = self.queues.iter().filter(|q| q.stale).count();
            out.push_str(&format!(
                "queues:    {waiting} jobs waiting for a worker in the leader's queues{}\n",
                if stale > 0 {
                    format!(" ({stale} models' snapshots are stale)")
                } else {
                    String::new()
                }
            ));
        }
        out.push_str(&format!(
            "decisions: {:.2}/s over the last {} s\n",
            self.decisions_per_s, self.window_s
        ));
        if !self.models.is_empty() {
            let mut t = Table::new([
                "MODEL",
                "ASSIGNED",
                "REJECTED",
                "EXPIRED",
                "MEAN WAIT",
                "MAX WAIT",
            ]);
            for (model, m) in &self.models {
                t.row([
                    model.clone(),
                    m.assigned.to_string(),
                    m.rejected.to_string(),
                    m.expired.to_string(),
                    fmt::ms(m.mean_queue_wait_ms),
                    fmt::ms(m.max_queue_wait_ms as f64),
                ]);
            }
            out.push('\n');
            out.push_str(&t.render(""));
        }
        if !self.queues.is_empty() {
            let mut t = Table::new(["MODEL", "WAITING", "OLDEST WAIT", "BY CLASS", "SNAPSHOT"]);
            for q in &self.queues {
                let s = &q.snapshot;
                let classes: Vec<String> = Priority::ALL
                    .iter()
                    .filter_map(|p| s.by_priority.get(p).map(|n| format!("{} {n}", p.as_str())))
                    .collect();
                t.row([
                    s.model.clone(),
                    s.waiting.to_string(),
                    if s.waiting == 0 {
                        "-".into()
                    } else {
                        fmt::ms(s.oldest_wait_ms as f64)
                    },
                    if classes.is_empty() {
                        "-".into()
                    } else {
                        classes.join(", ")
                    },
                    q.state(),
                ]);
            }
            out.push('\n');
            out.push_str(&t.render(""));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::fixtures::assigned;

    #[test]
    fn aggregates_the_window_per_model() {
        let now = 1_000_000;
        let mut a = assigned();
        a.decided_ms = now - 1_000;
        a.queue_wait_ms = 10;
        let mut b = a.clone();
        b.outcome = Outcome::Rejected;
        b.queue_wait_ms = 30;
        let mut old = a.clone();
        old.decided_ms = now - 61_000;
        let briefs: Vec<Brief> = [a, b, old].iter().map(Brief::from).collect();
        let r = Report::from_parts(
            None,
            Some(4),
            &briefs,
            60,
            now,
            Counts::default(),
            Vec::new(),
        );
        let m = &r.models["llama-3.1-8b"];
        assert_eq!((m.assigned, m.rejected, m.expired), (1, 1, 0));
        assert_eq!(m.mean_queue_wait_ms, 20.0);
        assert_eq!(m.max_queue_wait_ms, 30);
        assert!((r.decisions_per_s - 2.0 / 60.0).abs() < 1e-12);
        let text = r.render(now);
        assert!(text.contains("leader:    NONE"), "{text}");
        assert!(text.contains("queued:    4 jobs"), "{text}");
        assert!(
            text.contains("llama-3.1-8b  1         1         0        20 ms      30 ms"),
            "{text}"
        );
    }

    #[test]
    fn renders_the_leader_and_its_epoch() {
        let r = Report::from_parts(
            Some(Leader {
                holder: "d1".into(),
                acquired_ms: 1_709_210_096_789,
                renewed_ms: 1_709_210_100_000,
                lease_revision: 40,
                epoch: Some(7),
            }),
            None,
            &[],
            60,
            1_709_210_100_500,
            Counts {
                up: 2,
                draining: 1,
                ..Counts::default()
            },
            Vec::new(),
        );
        let text = r.render(1_709_210_100_500);
        assert!(text.contains("leader:    d1 (epoch 7), leading since 2024-02-29 12:34:56.789Z (3711 ms ago), lease renewed 500 ms ago"), "{text}");
        assert!(
            text.contains("workers:   2 up, 1 draining, 0 unhealthy, 0 stale"),
            "{text}"
        );
        assert!(
            text.contains("queues:    n/a: no leader has published"),
            "{text}"
        );
    }

    fn snapshot(model: &str, waiting: u32, epoch: u64, written_ms: u64) -> QueueSnapshot {
        QueueSnapshot {
            v: 1,
            model: model.into(),
            waiting,
            oldest_enqueued_ms: (waiting > 0).then_some(written_ms - 1_200),
            oldest_wait_ms: if waiting > 0 { 1_200 } else { 0 },
            by_priority: if waiting > 0 {
                [(Priority::Interactive, waiting - 1), (Priority::Batch, 1)].into()
            } else {
                BTreeMap::new()
            },
            flows: Vec::new(),
            flows_not_listed: 0,
            bound: None,
            epoch,
            dispatcher_id: "d1".into(),
            written_ms,
        }
    }

    #[test]
    fn shows_each_models_queue_and_marks_stale_snapshots() {
        let now = 1_000_000;
        let leader = Leader {
            holder: "d1".into(),
            acquired_ms: now - 60_000,
            renewed_ms: now,
            lease_revision: 9,
            epoch: None,
        };
        let r = Report::from_parts(
            Some(leader),
            Some(0),
            &[],
            60,
            now,
            Counts::default(),
            vec![
                snapshot("m-busy", 3, 7, now - 300),
                snapshot("m-idle", 0, 7, now - 300),
                // The leader stopped rewriting it.
                snapshot("m-silent", 2, 7, now - 9_000),
                // An earlier leader's: the newest epoch in the bucket is 7.
                snapshot("m-old", 4, 5, now - 100),
            ],
        );
        let text = r.render(now);
        println!("{text}");
        assert!(
            text.contains("queues:    3 jobs waiting for a worker in the leader's queues (2 models' snapshots are stale)"),
            "{text}"
        );
        for line in [
            "MODEL     WAITING  OLDEST WAIT  BY CLASS                SNAPSHOT",
            "m-busy    3        1200 ms      interactive 2, batch 1  fresh",
            "m-idle    0        -            -                       fresh",
            "m-old     4        1200 ms      interactive 3, batch 1  STALE: from epoch 5, the leader is at 7",
            "m-silent  2        1200 ms      interactive 1, batch 1  STALE: written 9000 ms ago",
        ] {
            assert!(text.contains(line), "{line:?} missing in\n{text}");
        }
        let json = serde_json::to_value(&r).unwrap();
        let busy = &json["queues"][0];
        assert_eq!(busy["model"], "m-busy");
        assert_eq!(busy["waiting"], 3);
        assert_eq!(busy["oldest_wait_ms"], 1200);
        assert_eq!(busy["stale"], false);
        assert_eq!(json["queues"][2]["freshness"]["state"], "older_epoch");
        assert_eq!(json["queues"][3]["stale"], true);
    }
}
