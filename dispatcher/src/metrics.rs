//! The dispatcher's metrics, exposed in the OpenMetrics text format on an optional HTTP
//! port.
//!
//! Every counter is an atomic the hot path bumps without locks; per-model gauges are
//! published by the engine on its tick. At each scrape a `prometheus-client` collector reads
//! them, so names, label escaping and the format are the maintained crate's. Names carry
//! their units (`_total`, `_seconds`); a counter is registered without `_total`, which the
//! format appends.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use axum::{extract::State, http::header, response::IntoResponse, routing::get, Router};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds (seconds) of the decision latency histogram.
const LATENCY_BUCKETS_S: [f64; 10] = [
    0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005, 0.025,
];

/// Upper bounds (seconds) of the queue wait histogram: from a free worker at once to the
/// default deadline (60 s) and the longest one allowed (600 s).
const QUEUE_WAIT_BUCKETS_S: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0,
];

/// How a job left its model's queue, as the queue wait histogram labels it.
pub type LeftAs = &'static str;

/// The decision latency histogram, with the buckets above.
#[derive(Debug)]
struct LatencyHistogram(Histogram);

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram(Histogram::new(LATENCY_BUCKETS_S))
    }
}

/// All metrics of one dispatcher process.
#[derive(Debug, Default)]
pub struct Metrics {
    pub decisions_assigned_total: AtomicU64,
    pub decisions_rejected_total: AtomicU64,
    pub decisions_expired_total: AtomicU64,
    pub malformed_jobs_total: AtomicU64,
    pub publish_failures_total: AtomicU64,
    pub duplicate_assignments_total: AtomicU64,
    pub rescued_jobs_total: AtomicU64,
    /// Jobs placed where they do least harm: no worker admitted them without a predicted
    /// SLO miss and their TTFT budget was running out.
    pub least_harm_placements_total: AtomicU64,
    /// Jobs answered at once (429) because the queue was predicted to reach them only
    /// after their deadline.
    pub deadline_unmeetable_total: AtomicU64,
    /// Workers' cache reports (`kvcache.<worker_id>.*`) applied.
    pub cache_updates_total: AtomicU64,
    /// Cache reports ignored: already covered by what was applied, of an older agent
    /// run, or not valid (malformed, a subject naming another worker).
    pub cache_updates_ignored_total: AtomicU64,
    /// Cache deltas applied after a gap in their sequence (deltas lost; the worker's next
    /// snapshot closes it).
    pub cache_update_gaps_total: AtomicU64,
    /// Internal tasks of a term (publisher, intake, watches) that died and ended the term.
    pub term_task_failures_total: AtomicU64,
    /// Heartbeats and completion events ignored because they could not be trusted
    /// (malformed, or an id that is not a subject token).
    pub ignored_worker_messages_total: AtomicU64,
    /// Cancellations ignored because they named another tenant than the job's (a client
    /// may name any job id under its own tenant's `cancel.<tenant>.*`).
    pub cancels_of_another_tenant_total: AtomicU64,
    /// Job ids a heartbeat listed as running that the leader did not adopt: not booked
    /// here, and no decision on record assigns them to that worker.
    pub unvouched_claims_total: AtomicU64,
    /// Refusals whose carried job no decision on record supports (another worker, attempt,
    /// tenant or model): the copy is dropped, never assigned.
    pub unvouched_refusal_jobs_total: AtomicU64,
    /// Completion events and refusals dropped because they came from another worker than
    /// the one holding the job ([`crate::worker_claims`]).
    pub worker_claims_dropped_total: AtomicU64,
    /// Heartbeats claiming more than their worker id was provisioned for (another model,
    /// a higher cap, no record): the worker takes no new work ([`metronome_scheduler::provisioning`]).
    pub unprovisioned_heartbeats_total: AtomicU64,
    /// Terms that found a heartbeat claiming an epoch above every epoch on record (not
    /// believed: [`crate::epoch_history`]).
    pub epoch_claims_above_record_total: AtomicU64,
    /// Workers declared dead (heartbeat timeout or key removed).
    pub workers_lost_total: AtomicU64,
    /// Redelivered jobs acknowledged without a new assignment because a decision for them
    /// was already stored.
    pub redelivered_already_decided_total: AtomicU64,
    /// Jobs whose id already had a decision, submitted again (a new JOBS message): answered
    /// with that decision, not run again.
    pub repeated_job_ids_total: AtomicU64,
    pub is_leader: AtomicU64,
    pub epoch: AtomicU64,
    pub ledger_reservations: AtomicU64,
    pub workers_known: AtomicU64,
    pub redis_up: AtomicU64,
    pub redis_errors_total: AtomicU64,
    decision_latency: LatencyHistogram,
    /// Queue depth per model, replaced by the engine on every tick.
    pub queue_depth: Mutex<BTreeMap<String, usize>>,
    /// Wait of the longest-waiting job per model (0 when none waits), replaced by the
    /// engine with each queue snapshot.
    pub queue_oldest_wait_ms: Mutex<BTreeMap<String, u64>>,
    /// Time jobs spent in the admission queue, per model and how they left it (assigned,
    /// rejected as unmeetable, expired).
    queue_wait: Mutex<BTreeMap<(String, LeftAs), Histogram>>,
    /// Per tenant: what fair sharing gave it.
    tenants: Mutex<BTreeMap<String, TenantStats>>,
    /// Why jobs waited: per model and rejection code, how many times a worker refused the
    /// job at the head of the model's queue when no worker admitted it.
    holds: Mutex<BTreeMap<String, BTreeMap<&'static str, u64>>>,
    /// Prefix affinity per model: how often the worker holding more of a prompt than the
    /// score's choice got the job (`chosen`), or why not (`cost`, `fair_share`, a
    /// rejection code).
    affinity: Mutex<BTreeMap<String, BTreeMap<String, u64>>>,
}

/// The `reason` of `metronome_dispatcher_holds_total` when a job waited so that its model
/// keeps room for a lighter tenant (no worker refused it).
pub const HELD_FOR_LIGHTER_TENANT: &str = "room_for_lighter_tenant";

/// One tenant's share, as counted by the leader.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantStats {
    /// Jobs assigned.
    pub requests: u64,
    /// Tokens its completed jobs ran (prompt + output, measured).
    pub tokens: u64,
    /// Time its assigned jobs waited in the admission queue.
    pub queue_wait_ms_sum: u64,
    /// Jobs not assigned, by reason code.
    pub rejections: BTreeMap<String, u64>,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    /// Record the evaluate+commit time of one decision.
    pub fn observe_decision_latency(&self, nanos: u64) {
        self.decision_latency.0.observe(nanos as f64 / 1e9);
    }

    /// A job of `model` left its queue (`how`: assigned, rejected, expired) after
    /// `waited_ms` in it.
    pub fn observe_queue_wait(&self, model: &str, how: LeftAs, waited_ms: u64) {
        let mut m = self.queue_wait.lock().unwrap_or_else(|p| p.into_inner());
        let h = match m.get(&(model.to_string(), how)) {
            Some(h) => h,
            None => m
                .entry((model.to_string(), how))
                .or_insert_with(|| Histogram::new(QUEUE_WAIT_BUCKETS_S)),
        };
        h.observe(waited_ms as f64 / 1000.0);
    }

    /// No worker of `model` admitted the job tried: count each worker's refusal by code,
    /// so an operator sees what holds the queue (rate floor, KV, concurrency ceiling, ...).
    pub fn held(&self, model: &str, rejected: &[metronome_protocol::Rejection]) {
        self.count_holds(model, rejected.iter().map(|r| r.code.as_str()));
    }

    /// [`Metrics::held`] from the workers' rejection codes alone.
    pub fn held_codes(&self, model: &str, codes: &[metronome_protocol::RejectionCode]) {
        self.count_holds(model, codes.iter().map(|c| c.as_str()));
    }

    /// The head of `model`'s queue waited for a reason of the dispatcher's own (no
    /// worker refused it), counted under `reason` beside the workers' refusals.
    pub fn held_for(&self, model: &str, reason: &'static str) {
        self.count_holds(model, [reason]);
    }

    fn count_holds(&self, model: &str, reasons: impl IntoIterator<Item = &'static str>) {
        let mut m = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        // Called on every look at a held queue: the model's name is copied only once.
        let by_code = match m.get_mut(model) {
            Some(c) => c,
            None => m.entry(model.to_string()).or_default(),
        };
        for reason in reasons {
            *by_code.entry(reason).or_default() += 1;
        }
    }

    /// Refusals counted by [`Metrics::held`] for `model` and `code`.
    pub fn holds(&self, model: &str, code: &str) -> u64 {
        let m = self.holds.lock().unwrap_or_else(|p| p.into_inner());
        m.get(model).and_then(|c| c.get(code)).copied().unwrap_or(0)
    }

    /// A decision of `model` recorded prefix affinity (see [`Metrics::affinity`]).
    pub fn affinity_decided(&self, model: &str, affinity: &metronome_protocol::Affinity) {
        let key = match affinity.outcome {
            metronome_protocol::AffinityOutcome::Chosen => "chosen",
            metronome_protocol::AffinityOutcome::Overridden => {
                affinity.reason_code.as_deref().unwrap_or("overridden")
            }
        };
        let mut m = self.affinity.lock().unwrap_or_else(|p| p.into_inner());
        let by_key = match m.get_mut(model) {
            Some(c) => c,
            None => m.entry(model.to_string()).or_default(),
        };
        match by_key.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                by_key.insert(key.to_string(), 1);
            }
        }
    }

    /// Prefix-affinity decisions of `model` by outcome: `chosen`, or the reason it was
    /// overridden.
    pub fn affinity(&self, model: &str) -> BTreeMap<String, u64> {
        let m = self.affinity.lock().unwrap_or_else(|p| p.into_inner());
        m.get(model).cloned().unwrap_or_default()
    }

    /// A job of `tenant` was assigned after waiting `queue_wait_ms`.
    pub fn tenant_assigned(&self, tenant: &str, queue_wait_ms: u64) {
        self.with_tenant(tenant, |t| {
            t.requests += 1;
            t.queue_wait_ms_sum += queue_wait_ms;
        });
    }

    /// A job of `tenant` completed having run `tokens` tokens.
    pub fn tenant_tokens(&self, tenant: &str, tokens: u64) {
        self.with_tenant(tenant, |t| t.tokens += tokens);
    }

    /// A job of `tenant` was not assigned (`reason` is the decision's reason code).
    pub fn tenant_rejected(&self, tenant: &str, reason: &str) {
        self.with_tenant(tenant, |t| {
            *t.rejections.entry(reason.to_string()).or_default() += 1
        });
    }

    /// One tenant's figures so far.
    pub fn tenant(&self, tenant: &str) -> TenantStats {
        self.tenants
            .lock()
            .map(|m| m.get(tenant).cloned().unwrap_or_default())
            .unwrap_or_default()
    }

    fn with_tenant(&self, tenant: &str, f: impl FnOnce(&mut TenantStats)) {
        if let Ok(mut m) = self.tenants.lock() {
            match m.get_mut(tenant) {
                Some(t) => f(t),
                None => f(m.entry(tenant.to_string()).or_default()),
            }
        }
    }

    /// Total decisions published, all outcomes.
    pub fn decisions_total(&self) -> u64 {
        self.decisions_assigned_total.load(Relaxed)
            + self.decisions_rejected_total.load(Relaxed)
            + self.decisions_expired_total.load(Relaxed)
    }

    /// The OpenMetrics text exposition.
    pub fn render(self: &Arc<Self>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Exposition(self.clone())));
        registry.register(
            metronome_runtime::build_info::INFO_NAME,
            metronome_runtime::build_info::HELP,
            prometheus_client::metrics::info::Info::new(metronome_runtime::build_info::labels()),
        );
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// Reads [`Metrics`] at each scrape.
#[derive(Debug)]
struct Exposition(Arc<Metrics>);

fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: &AtomicU64) -> fmt::Result {
    let c = ConstCounter::new(v.load(Relaxed));
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: &AtomicU64) -> fmt::Result {
    let g = ConstGauge::new(v.load(Relaxed) as i64);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Metrics {
    /// What fair sharing gave each tenant.
    fn encode_tenants(&self, enc: &mut DescriptorEncoder) -> fmt::Result {
        let tenants = self
            .tenants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        type Field = fn(&TenantStats) -> u64;
        let families: [(&str, &str, Field); 2] = [
            (
                "metronome_dispatcher_tenant_requests",
                "Jobs assigned, per tenant.",
                |t| t.requests,
            ),
            (
                "metronome_dispatcher_tenant_tokens",
                "Tokens (prompt + output) of completed jobs, per tenant.",
                |t| t.tokens,
            ),
        ];
        for (name, help, field) in families {
            let mut family = enc.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (tenant, t) in &tenants {
                ConstCounter::new(field(t))
                    .encode(family.encode_family(&[("tenant", tenant.as_str())])?)?;
            }
        }
        let mut wait = enc.encode_descriptor(
            "metronome_dispatcher_tenant_queue_wait_seconds",
            "Time assigned jobs waited in the admission queue, summed per tenant (divide by the requests for the mean).",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (tenant, t) in &tenants {
            ConstCounter::new(t.queue_wait_ms_sum as f64 / 1000.0)
                .encode(wait.encode_family(&[("tenant", tenant.as_str())])?)?;
        }
        let mut rejections = enc.encode_descriptor(
            "metronome_dispatcher_tenant_rejections",
            "Jobs not assigned, per tenant and reason code.",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (tenant, t) in &tenants {
            for (reason, n) in &t.rejections {
                ConstCounter::new(*n).encode(rejections.encode_family(&[
                    ("tenant", tenant.as_str()),
                    ("reason", reason.as_str()),
                ])?)?;
            }
        }
        Ok(())
    }
}

impl Collector for Exposition {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let m = &self.0;
        let mut decisions = enc.encode_descriptor(
            "metronome_dispatcher_decisions",
            "Decisions published, by outcome.",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (outcome, v) in [
            ("assigned", &m.decisions_assigned_total),
            ("rejected", &m.decisions_rejected_total),
            ("expired", &m.decisions_expired_total),
        ] {
            ConstCounter::new(v.load(Relaxed))
                .encode(decisions.encode_family(&[("outcome", outcome)])?)?;
        }
        for (name, help, v) in [
            (
                "metronome_dispatcher_malformed_jobs",
                "Messages on jobs.submit that were not valid jobs.",
                &m.malformed_jobs_total,
            ),
            (
                "metronome_dispatcher_publish_failures",
                "Assignments whose publish failed and were rolled back.",
                &m.publish_failures_total,
            ),
            (
                "metronome_dispatcher_duplicate_assignments",
                "Assignments JetStream reported as duplicates (already sent by an earlier leader).",
                &m.duplicate_assignments_total,
            ),
            (
                "metronome_dispatcher_rescued_jobs",
                "Jobs dispatched again after their worker died.",
                &m.rescued_jobs_total,
            ),
            (
                "metronome_dispatcher_least_harm_placements",
                "Jobs placed where they do least harm because their TTFT budget ran out while no worker admitted them without a predicted SLO miss.",
                &m.least_harm_placements_total,
            ),
            (
                "metronome_dispatcher_deadline_unmeetable",
                "Jobs answered at once with a Retry-After because the queue was predicted to reach them only after their deadline.",
                &m.deadline_unmeetable_total,
            ),
            (
                "metronome_dispatcher_cache_updates",
                "Workers' prefix-cache reports (kvcache.<worker_id>.delta and .snapshot) read.",
                &m.cache_updates_total,
            ),
            (
                "metronome_dispatcher_cache_updates_ignored",
                "Workers' prefix-cache reports ignored: already applied, of an older agent run, malformed or naming another worker than their subject.",
                &m.cache_updates_ignored_total,
            ),
            (
                "metronome_dispatcher_cache_update_gaps",
                "Prefix-cache deltas applied after a gap in their sequence; the worker's next snapshot closes it.",
                &m.cache_update_gaps_total,
            ),
            (
                "metronome_dispatcher_term_task_failures",
                "Internal tasks of a leadership term that died; each ends the term.",
                &m.term_task_failures_total,
            ),
            (
                "metronome_dispatcher_ignored_worker_messages",
                "Heartbeats and completion events ignored as malformed or with a bad id.",
                &m.ignored_worker_messages_total,
            ),
            (
                "metronome_dispatcher_cancels_of_another_tenant",
                "Cancellations ignored because they named another tenant than the job's.",
                &m.cancels_of_another_tenant_total,
            ),
            (
                "metronome_dispatcher_unvouched_claims",
                "Jobs a heartbeat listed that no decision assigns to that worker; not adopted.",
                &m.unvouched_claims_total,
            ),
            (
                "metronome_dispatcher_unvouched_refusal_jobs",
                "Refusals whose carried job no decision on record supports; the copy is dropped.",
                &m.unvouched_refusal_jobs_total,
            ),
            (
                "metronome_dispatcher_worker_claims_dropped",
                "Completion events and refusals dropped: sent by another worker than the one holding the job.",
                &m.worker_claims_dropped_total,
            ),
            (
                "metronome_dispatcher_unprovisioned_heartbeats",
                "Heartbeats claiming another model, a higher cap than provisioned, or no provisioning record; the worker takes no work.",
                &m.unprovisioned_heartbeats_total,
            ),
            (
                "metronome_dispatcher_epoch_claims_above_record",
                "Terms that found a heartbeat claiming an epoch above every epoch on record; not believed.",
                &m.epoch_claims_above_record_total,
            ),
            (
                "metronome_dispatcher_workers_lost",
                "Workers declared dead.",
                &m.workers_lost_total,
            ),
            (
                "metronome_dispatcher_redelivered_already_decided",
                "Redelivered jobs acknowledged without assigning them again (a decision existed).",
                &m.redelivered_already_decided_total,
            ),
            (
                "metronome_dispatcher_repeated_job_ids",
                "Jobs submitted again under an id that already had a decision: answered with it, not run again.",
                &m.repeated_job_ids_total,
            ),
            (
                "metronome_dispatcher_redis_errors",
                "Failed EWMA refreshes from Redis.",
                &m.redis_errors_total,
            ),
        ] {
            counter(&mut enc, name, help, v)?;
        }
        for (name, help, v) in [
            (
                "metronome_dispatcher_leader",
                "1 while this instance holds the lease and decides.",
                &m.is_leader,
            ),
            (
                "metronome_dispatcher_epoch",
                "Epoch of the lease this instance holds (0 as standby).",
                &m.epoch,
            ),
            (
                "metronome_dispatcher_ledger_reservations",
                "Reservations in the ledger.",
                &m.ledger_reservations,
            ),
            (
                "metronome_dispatcher_workers",
                "Workers in the registry.",
                &m.workers_known,
            ),
            (
                "metronome_dispatcher_redis_up",
                "1 when the last EWMA refresh from Redis succeeded.",
                &m.redis_up,
            ),
        ] {
            gauge(&mut enc, name, help, v)?;
        }
        let mut depth = enc.encode_descriptor(
            "metronome_dispatcher_queue_depth",
            "Jobs waiting in the admission queue, per model.",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        let depths = m
            .queue_depth
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (model, n) in &depths {
            ConstGauge::new(*n as i64)
                .encode(depth.encode_family(&[("model", model.as_str())])?)?;
        }
        let mut oldest = enc.encode_descriptor(
            "metronome_dispatcher_queue_oldest_wait_seconds",
            "How long the longest-waiting job of each model has waited (0 when none waits).",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        let waits = m
            .queue_oldest_wait_ms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (model, ms) in &waits {
            ConstGauge::new(*ms as f64 / 1000.0)
                .encode(oldest.encode_family(&[("model", model.as_str())])?)?;
        }
        {
            let hists = m.queue_wait.lock().unwrap_or_else(|p| p.into_inner());
            let mut wait = enc.encode_descriptor(
                "metronome_dispatcher_queue_wait_seconds",
                "Time jobs spent in the admission queue, observed when they left it, per model and outcome (assigned, rejected, expired).",
                None,
                prometheus_client::metrics::MetricType::Histogram,
            )?;
            for ((model, how), h) in hists.iter() {
                h.encode(wait.encode_family(&[("model", model.as_str()), ("outcome", *how)])?)?;
            }
        }
        {
            let holds = m.holds.lock().unwrap_or_else(|p| p.into_inner());
            let mut held = enc.encode_descriptor(
                "metronome_dispatcher_holds",
                "Refusals of the job at the head of a model's queue while no worker admitted it, per model and rejection code: what made jobs wait.",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (model, by_code) in holds.iter() {
                for (code, n) in by_code {
                    ConstCounter::new(*n).encode(
                        held.encode_family(&[("model", model.as_str()), ("reason", *code)])?,
                    )?;
                }
            }
        }
        {
            let affinity = m.affinity.lock().unwrap_or_else(|p| p.into_inner());
            let mut family = enc.encode_descriptor(
                "metronome_dispatcher_prefix_affinity",
                "Decisions in which a worker held more of the job's prompt than the score's choice, per model and outcome: chosen, or the reason the holder was overridden (cost, fair_share, or its rejection code).",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (model, by_key) in affinity.iter() {
                for (key, n) in by_key {
                    let (outcome, reason) = if key == "chosen" {
                        ("chosen", "")
                    } else {
                        ("overridden", key.as_str())
                    };
                    ConstCounter::new(*n).encode(family.encode_family(&[
                        ("model", model.as_str()),
                        ("outcome", outcome),
                        ("reason", reason),
                    ])?)?;
                }
            }
        }
        m.encode_tenants(&mut enc)?;
        m.decision_latency.0.encode(enc.encode_descriptor(
            "metronome_dispatcher_decision_latency_seconds",
            "Time to evaluate and commit one decision.",
            None,
            prometheus_client::metrics::MetricType::Histogram,
        )?)
    }
}

/// Serve `/metrics` on `addr` until `shutdown`; returns the bound address.
pub async fn serve(
    addr: &str,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(metrics);
    tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(error) = result {
            tracing::warn!(%error, "metrics server stopped");
        }
    });
    Ok(bound)
}

async fn render(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_affinity_is_counted_per_model_and_outcome() {
        use metronome_protocol::{Affinity, AffinityOutcome};
        let record = |outcome, code: Option<&str>| Affinity {
            worker_id: "w1".into(),
            cached_tokens: 2_000,
            outcome,
            reason_code: code.map(String::from),
            reason: None,
            max_share: 1.5,
        };
        let m = Metrics::new();
        m.affinity_decided("m", &record(AffinityOutcome::Chosen, None));
        m.affinity_decided("m", &record(AffinityOutcome::Chosen, None));
        m.affinity_decided(
            "m",
            &record(AffinityOutcome::Overridden, Some("fair_share")),
        );
        let counts = m.affinity("m");
        assert_eq!(counts.get("chosen"), Some(&2));
        assert_eq!(counts.get("fair_share"), Some(&1));
        assert!(m.affinity("other").is_empty());
        let text = m.render();
        assert!(
            text.contains(
                "metronome_dispatcher_prefix_affinity_total{model=\"m\",outcome=\"chosen\",reason=\"\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains(
            "metronome_dispatcher_prefix_affinity_total{model=\"m\",outcome=\"overridden\",reason=\"fair_share\"} 1"
        ));
    }

    #[test]
    fn holds_are_counted_per_model_and_reason() {
        use metronome_protocol::{Rejection, RejectionCode};
        let refusal = |worker: &str, code| Rejection {
            worker_id: worker.into(),
            code,
            reason: String::new(),
            prediction: None,
        };
        let m = Metrics::new();
        m.held(
            "m",
            &[
                refusal("a", RejectionCode::BelowSloFloor),
                refusal("b", RejectionCode::InsufficientKv),
            ],
        );
        m.held("m", &[refusal("a", RejectionCode::BelowSloFloor)]);
        assert_eq!(m.holds("m", "below_slo_floor"), 2);
        assert_eq!(m.holds("m", "insufficient_kv"), 1);
        assert_eq!(m.holds("other", "below_slo_floor"), 0);
        let text = m.render();
        assert!(
            text.contains(&format!(
                "metronome_build_info{{version=\"{}\",commit=\"{}\"}} 1",
                metronome_runtime::build_info::VERSION,
                metronome_runtime::build_info::git_commit()
            )),
            "{text}"
        );
        assert!(
            text.contains(
                "metronome_dispatcher_holds_total{model=\"m\",reason=\"below_slo_floor\"} 2"
            ),
            "{text}"
        );
    }

    #[test]
    fn renders_counters_histogram_and_queue_depths() {
        let m = Metrics::new();
        m.decisions_assigned_total.fetch_add(3, Relaxed);
        m.observe_decision_latency(7_000);
        m.queue_depth
            .lock()
            .unwrap()
            .insert("llama-3.1-8b".into(), 4);
        m.queue_depth
            .lock()
            .unwrap()
            .insert("quote\"back\\slash\nline".into(), 1);
        let text = m.render();
        assert!(text.contains("metronome_dispatcher_decisions_total{outcome=\"assigned\"} 3"));
        assert!(text.contains("metronome_dispatcher_decisions_total{outcome=\"expired\"} 0"));
        assert!(text.contains("metronome_dispatcher_workers_lost_total 0"));
        assert!(text.contains("metronome_dispatcher_leader 0"));
        assert!(text.contains("metronome_dispatcher_queue_depth{model=\"llama-3.1-8b\"} 4"));
        // A label value is escaped, so one odd model name cannot break the exposition.
        assert!(text.contains(
            "metronome_dispatcher_queue_depth{model=\"quote\\\"back\\\\slash\\nline\"} 1"
        ));
        // 7 µs falls in the 10 µs bucket and every one above it.
        assert!(
            text.contains("metronome_dispatcher_decision_latency_seconds_bucket{le=\"0.00001\"} 1")
        );
        assert!(text
            .contains("metronome_dispatcher_decision_latency_seconds_bucket{le=\"0.000005\"} 0"));
        assert!(text.contains("metronome_dispatcher_decision_latency_seconds_count 1"));
        m.observe_queue_wait("llama-3.1-8b", "assigned", 300);
        m.observe_queue_wait("llama-3.1-8b", "expired", 61_000);
        m.queue_oldest_wait_ms
            .lock()
            .unwrap()
            .insert("llama-3.1-8b".into(), 1_500);
        let text = m.render();
        assert!(
            text.contains(
                "metronome_dispatcher_queue_oldest_wait_seconds{model=\"llama-3.1-8b\"} 1.5"
            ),
            "{text}"
        );
        assert!(text.contains(
            "metronome_dispatcher_queue_wait_seconds_bucket{le=\"0.5\",model=\"llama-3.1-8b\",outcome=\"assigned\"} 1"
        ) || text.contains(
            "metronome_dispatcher_queue_wait_seconds_bucket{model=\"llama-3.1-8b\",outcome=\"assigned\",le=\"0.5\"} 1"
        ), "{text}");
        assert!(text.contains(
            "metronome_dispatcher_queue_wait_seconds_count{model=\"llama-3.1-8b\",outcome=\"expired\"} 1"
        ), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn renders_per_tenant_figures() {
        let m = Metrics::new();
        m.tenant_assigned("acme", 1500);
        m.tenant_assigned("acme", 500);
        m.tenant_tokens("acme", 42);
        m.tenant_rejected("beta", "queue_full");
        let text = m.render();
        assert!(text.contains("metronome_dispatcher_tenant_requests_total{tenant=\"acme\"} 2"));
        assert!(text.contains("metronome_dispatcher_tenant_tokens_total{tenant=\"acme\"} 42"));
        assert!(
            text.contains(
                "metronome_dispatcher_tenant_queue_wait_seconds_total{tenant=\"acme\"} 2.0"
            ),
            "{text}"
        );
        assert!(text.contains(
            "metronome_dispatcher_tenant_rejections_total{tenant=\"beta\",reason=\"queue_full\"} 1"
        ));
        assert_eq!(m.tenant("acme").requests, 2);
    }
}
