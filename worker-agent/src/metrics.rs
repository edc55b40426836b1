//! The agent's own Prometheus metrics: every name in one place, units in the names.
//!
//! Counters are lock-free atomics shared by the job runners, the heartbeat and the EWMA
//! store; [`AgentMetrics::render`] writes the text exposition format served on `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use metronome_protocol::CompletionOutcome;

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Every metric of one agent.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    pub jobs_done: Counter,
    pub jobs_failed: Counter,
    pub jobs_cancelled: Counter,
    pub jobs_refused: Counter,
    pub stale_epoch_refusals: Counter,
    /// Redelivered assignments refused because the agent did not hold them (it restarted
    /// or never started them): running them could run the job twice.
    pub redelivery_refusals: Counter,
    /// Held jobs the leader revoked after declaring this worker dead (stopped, no result).
    pub revoked_jobs: Counter,
    /// Times the agent fenced itself (no heartbeat stored for `fence_after_ms`).
    pub fence_episodes: Counter,
    pub malformed_assignments: Counter,
    pub output_tokens: Counter,
    pub prompt_tokens: Counter,
    pub redis_errors: Counter,
    pub nats_publish_errors: Counter,
    pub heartbeats: Counter,
    pub heartbeat_errors: Counter,
    pub metrics_scrape_errors: Counter,
    /// Completed jobs folded into the performance model.
    pub perf_samples: Counter,
    /// Sum of measured times to first token, in microseconds (with `ttft_count`, a mean).
    pub ttft_us_sum: Counter,
    pub ttft_count: Counter,
    pub running_jobs: Gauge,
    pub draining: Gauge,
    /// 1 while the agent is fenced (no heartbeat stored for `fence_after_ms`).
    pub fenced: Gauge,
}

impl AgentMetrics {
    /// Count a finished job by outcome.
    pub fn job_finished(&self, outcome: CompletionOutcome) {
        match outcome {
            CompletionOutcome::Done => self.jobs_done.inc(),
            CompletionOutcome::Failed => self.jobs_failed.inc(),
            CompletionOutcome::Cancelled => self.jobs_cancelled.inc(),
            CompletionOutcome::Refused => self.jobs_refused.inc(),
        }
    }

    /// The Prometheus text exposition of every metric, labelled with the worker id.
    pub fn render(&self, worker_id: &str) -> String {
        let mut out = String::new();
        let w = worker_id;
        let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (labels, v) in rows {
                let sep = if labels.is_empty() { "" } else { "," };
                let _ = writeln!(out, "{name}{{worker_id=\"{w}\"{sep}{labels}}} {v}");
            }
        };
        counter(
            "metronome_worker_jobs_total",
            "Jobs that ended on this worker, by outcome.",
            &[
                ("outcome=\"done\"", self.jobs_done.get()),
                ("outcome=\"failed\"", self.jobs_failed.get()),
                ("outcome=\"cancelled\"", self.jobs_cancelled.get()),
                ("outcome=\"refused\"", self.jobs_refused.get()),
            ],
        );
        counter(
            "metronome_worker_stale_epoch_refusals_total",
            "Assignments refused because a newer leader epoch had been seen.",
            &[("", self.stale_epoch_refusals.get())],
        );
        counter(
            "metronome_worker_redelivery_refusals_total",
            "Redelivered assignments refused because the agent did not hold them (restarted or never started).",
            &[("", self.redelivery_refusals.get())],
        );
        counter(
            "metronome_worker_revoked_jobs_total",
            "Held jobs stopped without a result because the leader declared this worker dead and revoked them.",
            &[("", self.revoked_jobs.get())],
        );
        counter(
            "metronome_worker_fence_episodes_total",
            "Times the agent fenced itself because no heartbeat was stored for fence_after_ms.",
            &[("", self.fence_episodes.get())],
        );
        counter(
            "metronome_worker_malformed_assignments_total",
            "Messages on the WORK subject that were not valid assignments (terminated).",
            &[("", self.malformed_assignments.get())],
        );
        counter(
            "metronome_worker_tokens_total",
            "Tokens processed, by kind.",
            &[
                ("kind=\"output\"", self.output_tokens.get()),
                ("kind=\"prompt\"", self.prompt_tokens.get()),
            ],
        );
        counter(
            "metronome_worker_redis_errors_total",
            "Redis reads and writes (EWMAs, performance model) that failed because Redis was unreachable or erred.",
            &[("", self.redis_errors.get())],
        );
        counter(
            "metronome_worker_perf_samples_total",
            "Completed jobs folded into the worker's performance model.",
            &[("", self.perf_samples.get())],
        );
        counter(
            "metronome_worker_nats_publish_errors_total",
            "Publishes of chunks, results or events that failed.",
            &[("", self.nats_publish_errors.get())],
        );
        counter(
            "metronome_worker_heartbeats_total",
            "Heartbeats written to the workers bucket.",
            &[("", self.heartbeats.get())],
        );
        counter(
            "metronome_worker_heartbeat_errors_total",
            "Heartbeats that could not be written.",
            &[("", self.heartbeat_errors.get())],
        );
        counter(
            "metronome_worker_metrics_scrape_errors_total",
            "Failed scrapes of the model server's metrics.",
            &[("", self.metrics_scrape_errors.get())],
        );
        let _ = writeln!(
            out,
            "# HELP metronome_worker_ttft_seconds Time to first token measured by the agent.\n# TYPE metronome_worker_ttft_seconds summary"
        );
        let _ = writeln!(
            out,
            "metronome_worker_ttft_seconds_sum{{worker_id=\"{w}\"}} {}",
            self.ttft_us_sum.get() as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "metronome_worker_ttft_seconds_count{{worker_id=\"{w}\"}} {}",
            self.ttft_count.get()
        );
        for (name, help, v) in [
            (
                "metronome_worker_running_jobs",
                "Jobs the agent holds right now.",
                self.running_jobs.get(),
            ),
            (
                "metronome_worker_draining",
                "1 while the agent takes no new work (operator drain or shutdown).",
                self.draining.get(),
            ),
            (
                "metronome_worker_fenced",
                "1 while the agent is fenced: no heartbeat stored for fence_after_ms, so it pulls and starts nothing.",
                self.fenced.get(),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            let _ = writeln!(out, "{name}{{worker_id=\"{w}\"}} {v}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_parseable_text_with_units_in_names() {
        let m = AgentMetrics::default();
        m.job_finished(CompletionOutcome::Done);
        m.job_finished(CompletionOutcome::Done);
        m.redis_errors.inc();
        let text = m.render("n1-gpu0");
        let samples = crate::metrics_scrape::parse_prometheus(&text);
        let done = samples
            .iter()
            .find(|s| s.name == "metronome_worker_jobs_total" && s.label("outcome") == Some("done"))
            .unwrap();
        assert_eq!(done.value, 2.0);
        assert_eq!(done.label("worker_id"), Some("n1-gpu0"));
        assert!(samples
            .iter()
            .any(|s| s.name == "metronome_worker_redis_errors_total" && s.value == 1.0));
    }
}
