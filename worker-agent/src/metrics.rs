//! The agent's own Prometheus metrics: every name in one place, units in the names.
//!
//! Counters are lock-free atomics shared by the job runners, the heartbeat and the EWMA
//! store; [`AgentMetrics::render`] reads them into a `prometheus-client` collector, whose
//! OpenMetrics text (format, label escaping, the `_total` suffix of counters) is served on
//! `/metrics`. Every sample carries the `worker_id` label.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use metronome_protocol::{CompletionOutcome, GpuStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

/// Content type of [`AgentMetrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds (seconds) of the time-to-first-token histogram: from a warm short prompt
/// to a long prefill behind a busy batch.
const TTFT_BUCKETS_S: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

/// Times to first token measured by the agent.
#[derive(Debug)]
pub struct TtftHistogram(Histogram);

impl Default for TtftHistogram {
    fn default() -> Self {
        TtftHistogram(Histogram::new(TTFT_BUCKETS_S))
    }
}

/// Upper bounds (seconds) of the histograms of the agent's own steps before a job starts:
/// a loopback JetStream put takes about a millisecond, and one that takes seconds is the
/// thing to see.
const STEP_BUCKETS_S: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Durations of one of the agent's own steps (a heartbeat's store, a job's wait to be
/// reported).
#[derive(Debug)]
pub struct StepHistogram(Histogram);

impl Default for StepHistogram {
    fn default() -> Self {
        StepHistogram(Histogram::new(STEP_BUCKETS_S))
    }
}

impl StepHistogram {
    pub fn observe(&self, elapsed: std::time::Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }
}

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
    /// Assignments refused because their epoch was above every epoch seen and the leader
    /// lease did not vouch for it (a buggy or hostile writer of `work.<worker_id>`).
    pub unvouched_epoch_refusals: Counter,
    /// Redelivered assignments refused because the agent did not hold them (it restarted
    /// or never started them): running them could run the job twice.
    pub redelivery_refusals: Counter,
    /// Held jobs the leader revoked after declaring this worker dead (stopped, no result).
    pub revoked_jobs: Counter,
    /// Times the agent fenced itself (no heartbeat stored for `fence_after_ms`).
    pub fence_episodes: Counter,
    pub malformed_assignments: Counter,
    /// Cancellations of a held job ignored because they named another tenant than the
    /// job's (a client may name any job id under its own tenant's subject).
    pub cancels_of_another_tenant: Counter,
    pub output_tokens: Counter,
    pub prompt_tokens: Counter,
    pub redis_errors: Counter,
    pub nats_publish_errors: Counter,
    pub heartbeats: Counter,
    pub heartbeat_errors: Counter,
    /// Pull requests on the WORK consumer that got no answer by their expiry (a server
    /// that dropped the answer): the next was sent at once.
    pub pulls_unanswered: Counter,
    pub metrics_scrape_errors: Counter,
    /// Completed jobs folded into the performance model.
    pub perf_samples: Counter,
    /// Measured times to first token.
    pub ttft: TtftHistogram,
    /// From a job's delivery to its start: the wait for a stored heartbeat that lists it
    /// (part of every TTFT the agent measures).
    pub report_wait: StepHistogram,
    /// How long storing one heartbeat in the workers bucket took (answered or not).
    pub heartbeat_store: StepHistogram,
    pub running_jobs: Gauge,
    pub draining: Gauge,
    /// 1 while the agent is fenced (no heartbeat stored for `fence_after_ms`).
    pub fenced: Gauge,
}

impl AgentMetrics {
    /// Record one measured time to first token.
    pub fn observe_ttft_ms(&self, ms: f64) {
        self.ttft.0.observe(ms / 1e3);
    }

    /// Count a finished job by outcome.
    pub fn job_finished(&self, outcome: CompletionOutcome) {
        match outcome {
            CompletionOutcome::Done => self.jobs_done.inc(),
            CompletionOutcome::Failed => self.jobs_failed.inc(),
            CompletionOutcome::Cancelled => self.jobs_cancelled.inc(),
            CompletionOutcome::Refused => self.jobs_refused.inc(),
        }
    }

    /// The OpenMetrics text exposition of every metric, labelled with the worker id; with
    /// the GPU's utilisation and memory when the probe has a sample (absent when it has
    /// none: no invented zero).
    pub fn render(&self, worker_id: &str, gpu: Option<GpuStats>) -> String {
        let c = |name, help, rows: Vec<(Option<(&'static str, &'static str)>, &Counter)>| Family {
            name,
            help,
            kind: MetricType::Counter,
            rows: rows.into_iter().map(|(l, v)| (l, v.get())).collect(),
        };
        let g = |name, help, v: &Gauge| Family {
            name,
            help,
            kind: MetricType::Gauge,
            rows: vec![(None, v.get())],
        };
        let families = vec![
            c(
                "metronome_worker_jobs",
                "Jobs that ended on this worker, by outcome.",
                vec![
                    (Some(("outcome", "done")), &self.jobs_done),
                    (Some(("outcome", "failed")), &self.jobs_failed),
                    (Some(("outcome", "cancelled")), &self.jobs_cancelled),
                    (Some(("outcome", "refused")), &self.jobs_refused),
                ],
            ),
            c(
                "metronome_worker_stale_epoch_refusals",
                "Assignments refused because a newer leader epoch had been seen.",
                vec![(None, &self.stale_epoch_refusals)],
            ),
            c(
                "metronome_worker_unvouched_epoch_refusals",
                "Assignments refused because the leader lease did not vouch for their new, higher epoch.",
                vec![(None, &self.unvouched_epoch_refusals)],
            ),
            c(
                "metronome_worker_redelivery_refusals",
                "Redelivered assignments refused because the agent did not hold them (restarted or never started).",
                vec![(None, &self.redelivery_refusals)],
            ),
            c(
                "metronome_worker_revoked_jobs",
                "Held jobs stopped without a result because the leader declared this worker dead and revoked them.",
                vec![(None, &self.revoked_jobs)],
            ),
            c(
                "metronome_worker_fence_episodes",
                "Times the agent fenced itself because no heartbeat was stored for fence_after_ms.",
                vec![(None, &self.fence_episodes)],
            ),
            c(
                "metronome_worker_malformed_assignments",
                "Messages on the WORK subject that were not valid assignments (terminated).",
                vec![(None, &self.malformed_assignments)],
            ),
            c(
                "metronome_worker_cancels_of_another_tenant",
                "Cancellations of a held job ignored because they named another tenant than the job's.",
                vec![(None, &self.cancels_of_another_tenant)],
            ),
            c(
                "metronome_worker_tokens",
                "Tokens processed, by kind.",
                vec![
                    (Some(("kind", "output")), &self.output_tokens),
                    (Some(("kind", "prompt")), &self.prompt_tokens),
                ],
            ),
            c(
                "metronome_worker_redis_errors",
                "Redis reads and writes (EWMAs, performance model) that failed because Redis was unreachable or erred.",
                vec![(None, &self.redis_errors)],
            ),
            c(
                "metronome_worker_perf_samples",
                "Completed jobs folded into the worker's performance model.",
                vec![(None, &self.perf_samples)],
            ),
            c(
                "metronome_worker_nats_publish_errors",
                "Publishes of chunks, results or events that failed.",
                vec![(None, &self.nats_publish_errors)],
            ),
            c(
                "metronome_worker_heartbeats",
                "Heartbeats written to the workers bucket.",
                vec![(None, &self.heartbeats)],
            ),
            c(
                "metronome_worker_heartbeat_errors",
                "Heartbeats that could not be written.",
                vec![(None, &self.heartbeat_errors)],
            ),
            c(
                "metronome_worker_pulls_unanswered",
                "Pull requests on the WORK consumer with no answer by their expiry (a server that dropped it); the next was sent at once.",
                vec![(None, &self.pulls_unanswered)],
            ),
            c(
                "metronome_worker_metrics_scrape_errors",
                "Failed scrapes of the model server's metrics.",
                vec![(None, &self.metrics_scrape_errors)],
            ),
            g(
                "metronome_worker_running_jobs",
                "Jobs the agent holds right now.",
                &self.running_jobs,
            ),
            g(
                "metronome_worker_draining",
                "1 while the agent takes no new work (operator drain or shutdown).",
                &self.draining,
            ),
            g(
                "metronome_worker_fenced",
                "1 while the agent is fenced: no heartbeat stored for fence_after_ms, so it pulls and starts nothing.",
                &self.fenced,
            ),
        ];
        let mut registry = Registry::with_labels(
            [(
                std::borrow::Cow::Borrowed("worker_id"),
                std::borrow::Cow::Owned(worker_id.to_string()),
            )]
            .into_iter(),
        );
        registry.register_collector(Box::new(Snapshot { families }));
        registry.register(
            metronome_runtime::build_info::INFO_NAME,
            metronome_runtime::build_info::HELP,
            prometheus_client::metrics::info::Info::new(metronome_runtime::build_info::labels()),
        );
        registry.register(
            "metronome_worker_ttft_seconds",
            "Time to first token measured by the agent",
            self.ttft.0.clone(),
        );
        registry.register(
            "metronome_worker_report_wait_seconds",
            "From a job's delivery to its start: the wait for a stored heartbeat that lists it",
            self.report_wait.0.clone(),
        );
        registry.register(
            "metronome_worker_heartbeat_store_seconds",
            "Time to store one heartbeat in the workers bucket, answered or not",
            self.heartbeat_store.0.clone(),
        );
        if let Some(gpu) = gpu {
            let gauge = ConstGauge::<f64>::new;
            registry.register(
                "metronome_worker_gpu_utilisation_ratio",
                "GPU utilisation from NVML (0..1), as the heartbeat reports it",
                gauge(gpu.util_frac),
            );
            registry.register_with_unit(
                "metronome_worker_gpu_memory_used",
                "GPU memory in use, from NVML",
                Unit::Bytes,
                gauge(gpu.mem_used_bytes as f64),
            );
            registry.register_with_unit(
                "metronome_worker_gpu_memory_total",
                "GPU memory in all, from NVML",
                Unit::Bytes,
                gauge(gpu.mem_total_bytes as f64),
            );
        }
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// One metric and its samples, read from the atomics at render time.
#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    rows: Vec<(Option<(&'static str, &'static str)>, u64)>,
}

#[derive(Debug)]
struct Snapshot {
    families: Vec<Family>,
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        for f in &self.families {
            let mut metric = enc.encode_descriptor(f.name, f.help, None, f.kind)?;
            for (label, v) in &f.rows {
                let labels: Vec<(&str, &str)> = label.iter().copied().collect();
                let sample = metric.encode_family(&labels)?;
                match f.kind {
                    MetricType::Gauge => ConstGauge::new(*v as i64).encode(sample)?,
                    _ => ConstCounter::new(*v).encode(sample)?,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_figures_are_rendered_only_when_sampled() {
        let m = AgentMetrics::default();
        assert!(!m.render("w", None).contains("metronome_worker_gpu_"));
        let gpu = GpuStats {
            util_frac: 0.5,
            mem_used_bytes: 3,
            mem_total_bytes: 4,
        };
        let text = m.render("w", Some(gpu));
        let value =
            |name| metronome_protocol::prometheus::value(&text, name, &[("worker_id", "w")]);
        assert_eq!(
            value("metronome_worker_gpu_utilisation_ratio"),
            Some(0.5),
            "{text}"
        );
        assert_eq!(value("metronome_worker_gpu_memory_used_bytes"), Some(3.0));
        assert_eq!(value("metronome_worker_gpu_memory_total_bytes"), Some(4.0));
    }

    #[test]
    fn renders_parseable_text_with_units_in_names() {
        let m = AgentMetrics::default();
        m.job_finished(CompletionOutcome::Done);
        m.job_finished(CompletionOutcome::Done);
        m.redis_errors.inc();
        let text = m.render("n1-gpu0", None);
        assert!(
            text.contains(&format!(
                "metronome_build_info{{worker_id=\"n1-gpu0\",version=\"{}\",commit=\"{}\"}} 1",
                metronome_runtime::build_info::VERSION,
                metronome_runtime::build_info::git_commit()
            )),
            "{text}"
        );
        let samples = metronome_protocol::prometheus::parse(&text);
        let done = samples
            .iter()
            .find(|s| s.name == "metronome_worker_jobs_total" && s.label("outcome") == Some("done"))
            .unwrap();
        assert_eq!(done.value, 2.0);
        assert_eq!(done.label("worker_id"), Some("n1-gpu0"));
        assert!(samples
            .iter()
            .any(|s| s.name == "metronome_worker_redis_errors_total" && s.value == 1.0));
        assert!(samples
            .iter()
            .any(|s| s.name == "metronome_worker_running_jobs"
                && s.label("worker_id") == Some("n1-gpu0")));
    }

    #[test]
    fn ttft_is_a_histogram_and_label_values_are_escaped() {
        let m = AgentMetrics::default();
        m.observe_ttft_ms(120.0);
        let text = m.render("odd\"id", None);
        let samples = metronome_protocol::prometheus::parse(&text);
        let count = samples
            .iter()
            .find(|s| s.name == "metronome_worker_ttft_seconds_count")
            .unwrap();
        assert_eq!(count.value, 1.0);
        let within_250ms = samples
            .iter()
            .find(|s| {
                s.name == "metronome_worker_ttft_seconds_bucket" && s.label("le") == Some("0.25")
            })
            .unwrap();
        assert_eq!(within_250ms.value, 1.0);
        assert!(text.contains(r#"worker_id="odd\"id""#), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn the_steps_before_a_start_are_histograms_in_seconds() {
        let m = AgentMetrics::default();
        m.report_wait.observe(std::time::Duration::from_millis(3));
        m.heartbeat_store
            .observe(std::time::Duration::from_millis(700));
        m.heartbeat_store
            .observe(std::time::Duration::from_millis(2));
        let samples = metronome_protocol::prometheus::parse(&m.render("n1-gpu0", None));
        let value = |name: &str, le: Option<&str>| {
            samples
                .iter()
                .find(|s| s.name == name && s.label("le") == le)
                .map(|s| s.value)
        };
        assert_eq!(
            value("metronome_worker_report_wait_seconds_count", None),
            Some(1.0)
        );
        assert_eq!(
            value("metronome_worker_report_wait_seconds_bucket", Some("0.005")),
            Some(1.0)
        );
        assert_eq!(
            value("metronome_worker_heartbeat_store_seconds_count", None),
            Some(2.0)
        );
        assert_eq!(
            value(
                "metronome_worker_heartbeat_store_seconds_bucket",
                Some("0.5")
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                "metronome_worker_heartbeat_store_seconds_bucket",
                Some("1.0")
            ),
            Some(2.0)
        );
    }
}
