//! `metronome workers` and the worker counts of `metronome status`: one row per worker
//! from its latest heartbeat in the `workers` bucket, with its EWMAs from Redis when asked.
//!
//! Pure: [`WorkerView`] pairs a heartbeat with how old it is and its EWMAs; [`table`] and
//! [`counts`] render them. A heartbeat's age comes from the time the NATS server stored it
//! (the KV entry's timestamp), not from the agent's `sent_ms`: hosts' clocks differ.

use serde::Serialize;

use metronome_protocol::WorkerStatus;

use crate::fmt::{self, Table};

/// A heartbeat older than this is shown as `stale` (the dispatcher's default heartbeat
/// timeout; the bucket drops it altogether after 15 s).
pub const DEFAULT_STALE_AFTER_MS: u64 = 3_000;

/// The per-worker EWMAs the agent keeps in Redis (`<prefix>:ewma:<worker_id>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Ewma {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub tok_s: Option<f64>,
    pub samples: Option<u64>,
}

/// Up, draining, unhealthy or stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Up,
    Draining,
    Unhealthy,
    Stale,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Up => "up",
            State::Draining => "draining",
            State::Unhealthy => "unhealthy",
            State::Stale => "stale",
        }
    }
}

/// One worker as the CLI shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerView {
    pub status: WorkerStatus,
    /// Milliseconds since the heartbeat was stored.
    pub heartbeat_age_ms: u64,
    pub state: State,
    /// `None` when Redis was not asked or has no samples for the worker.
    pub ewma: Option<Ewma>,
    /// `1000 / perf.step_base_ms`: the fitted single-stream decode rate.
    pub single_stream_tok_s: Option<f64>,
}

impl WorkerView {
    pub fn new(status: WorkerStatus, heartbeat_age_ms: u64, stale_after_ms: u64) -> WorkerView {
        let state = if heartbeat_age_ms > stale_after_ms {
            State::Stale
        } else if status.draining {
            State::Draining
        } else if !status.healthy {
            State::Unhealthy
        } else {
            State::Up
        };
        let single_stream_tok_s = status
            .perf
            .and_then(|p| fmt::tok_s_from_tpot(p.step_base_ms));
        WorkerView {
            status,
            heartbeat_age_ms,
            state,
            ewma: None,
            single_stream_tok_s,
        }
    }
}

/// Workers by state, for `status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub up: usize,
    pub draining: usize,
    pub unhealthy: usize,
    pub stale: usize,
}

pub fn counts(workers: &[WorkerView]) -> Counts {
    let mut c = Counts::default();
    for w in workers {
        match w.state {
            State::Up => c.up += 1,
            State::Draining => c.draining += 1,
            State::Unhealthy => c.unhealthy += 1,
            State::Stale => c.stale += 1,
        }
    }
    c
}

/// The `workers` table, sorted by worker id.
pub fn table(workers: &[WorkerView]) -> String {
    if workers.is_empty() {
        return "no workers in the `workers` bucket (none running, or all silent for 15 s)\n"
            .into();
    }
    let mut sorted: Vec<&WorkerView> = workers.iter().collect();
    sorted.sort_by(|a, b| a.status.worker_id.cmp(&b.status.worker_id));
    let mut t = Table::new([
        "WORKER",
        "MODEL",
        "ACTIVE/LIMIT",
        "QUEUED",
        "KV",
        "GPU",
        "TTFT EWMA",
        "TPOT EWMA",
        "1-STREAM",
        "PERF SAMPLES",
        "HEARTBEAT",
        "STATE",
    ]);
    for w in sorted {
        let s = &w.status;
        let ewma = w.ewma.unwrap_or_default();
        t.row([
            s.worker_id.clone(),
            s.model.clone(),
            format!("{}/{}", s.active, s.max_concurrency),
            s.queued.to_string(),
            fmt::pct(s.kv.map(|k| k.used_frac)),
            fmt::pct(s.gpu.map(|g| g.util_frac)),
            ewma.ttft_ms.map(fmt::ms).unwrap_or_else(|| "n/a".into()),
            ewma.tpot_ms.map(fmt::ms).unwrap_or_else(|| "n/a".into()),
            fmt::tok_s(w.single_stream_tok_s),
            s.perf
                .map(|p| p.samples.to_string())
                .unwrap_or_else(|| "n/a".into()),
            format!("{} ago", fmt::ms(w.heartbeat_age_ms as f64)),
            w.state.as_str().to_string(),
        ]);
    }
    t.render("")
}

#[cfg(test)]
pub(crate) mod fixtures {
    use metronome_protocol::*;

    pub fn status(id: &str) -> WorkerStatus {
        WorkerStatus {
            v: 1,
            worker_id: id.into(),
            model: "llama-3.1-8b".into(),
            node: Some("n1".into()),
            gpu_index: Some(0),
            healthy: true,
            draining: false,
            max_concurrency: 8,
            active: 3,
            queued: 1,
            in_flight: vec!["j1".into()],
            kv: Some(KvUsage {
                used_frac: 0.42,
                capacity_tokens: Some(100_000),
            }),
            gpu: None,
            prefill_pending_tokens: 0,
            perf: Some(PerfCoefficients {
                step_base_ms: 20.0,
                step_per_stream_ms: 0.5,
                step_per_ktok_ms: 0.1,
                stall_per_prefill_token_ms: 0.01,
                ttft_base_ms: 30.0,
                prefill_per_token_ms: 0.2,
                ttft_per_stream_ms: 1.0,
                step_error_ms: 0.0,
                samples: 240,
            }),
            decoding: None,
            seq: 9,
            sent_ms: 0,
            max_epoch: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::status;
    use super::*;

    #[test]
    fn state_prefers_stale_then_draining_then_unhealthy() {
        assert_eq!(WorkerView::new(status("a"), 100, 3000).state, State::Up);
        let mut s = status("a");
        s.draining = true;
        s.healthy = false;
        assert_eq!(WorkerView::new(s.clone(), 100, 3000).state, State::Draining);
        assert_eq!(WorkerView::new(s.clone(), 3001, 3000).state, State::Stale);
        s.draining = false;
        assert_eq!(WorkerView::new(s, 100, 3000).state, State::Unhealthy);
    }

    #[test]
    fn table_shows_load_signals_and_fitted_rate() {
        let mut a = WorkerView::new(status("n1-gpu1"), 400, 3000);
        a.ewma = Some(Ewma {
            ttft_ms: Some(130.0),
            tpot_ms: Some(22.4),
            tok_s: Some(44.0),
            samples: Some(12),
        });
        let mut s = status("n1-gpu0");
        s.draining = true;
        s.perf = None;
        s.kv = None;
        let b = WorkerView::new(s, 5000, 3000);
        let text = table(&[a, b]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("WORKER "), "{text}");
        // Sorted by id: gpu0 first.
        assert!(lines[1].starts_with("n1-gpu0"), "{text}");
        assert!(lines[1].ends_with("5000 ms ago  stale"), "{text}");
        for cell in [
            "3/8",
            "42%",
            "n/a",
            "130 ms",
            "22 ms",
            "50.0 tok/s",
            "240",
            "400 ms ago",
            "up",
        ] {
            assert!(lines[2].contains(cell), "{cell} missing: {}", lines[2]);
        }
        assert_eq!(
            counts(&[
                WorkerView::new(status("a"), 0, 3000),
                WorkerView::new(status("b"), 9000, 3000)
            ]),
            Counts {
                up: 1,
                stale: 1,
                ..Counts::default()
            }
        );
    }

    #[test]
    fn no_workers_says_so() {
        assert!(table(&[]).contains("no workers"));
    }
}
