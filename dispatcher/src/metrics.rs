//! The dispatcher's metrics, rendered as Prometheus text on an optional HTTP port.
//!
//! Every counter is an atomic the hot path bumps without locks; per-model gauges are
//! published by the engine on its tick. Names carry their units (`_total`, `_seconds`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use axum::{extract::State, routing::get, Router};
use tokio_util::sync::CancellationToken;

/// Upper bounds (seconds) of the decision latency histogram.
const LATENCY_BUCKETS_S: [f64; 10] = [
    0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.005, 0.025,
];

/// All metrics of one dispatcher process.
#[derive(Default)]
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
    /// Internal tasks of a term (publisher, intake, watches) that died and ended the term.
    pub term_task_failures_total: AtomicU64,
    /// Heartbeats and completion events ignored because they could not be trusted
    /// (malformed, or an id that is not a subject token).
    pub ignored_worker_messages_total: AtomicU64,
    /// Workers declared dead (heartbeat timeout or key removed).
    pub workers_lost_total: AtomicU64,
    /// Redelivered jobs acknowledged without a new assignment because a decision for them
    /// was already stored.
    pub redelivered_already_decided_total: AtomicU64,
    pub is_leader: AtomicU64,
    pub epoch: AtomicU64,
    pub ledger_reservations: AtomicU64,
    pub workers_known: AtomicU64,
    pub redis_up: AtomicU64,
    pub redis_errors_total: AtomicU64,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    latency_count: AtomicU64,
    latency_sum_ns: AtomicU64,
    /// Queue depth per model, replaced by the engine on every tick.
    pub queue_depth: Mutex<BTreeMap<String, usize>>,
    /// Per tenant: what fair sharing gave it.
    tenants: Mutex<BTreeMap<String, TenantStats>>,
}

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
        let secs = nanos as f64 / 1e9;
        for (i, bound) in LATENCY_BUCKETS_S.iter().enumerate() {
            if secs <= *bound {
                self.latency_buckets[i].fetch_add(1, Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Relaxed);
        self.latency_sum_ns.fetch_add(nanos, Relaxed);
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

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(2048);
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP metronome_dispatcher_decisions_total Decisions published, by outcome.\n# TYPE metronome_dispatcher_decisions_total counter"
        );
        for (outcome, v) in [
            ("assigned", &self.decisions_assigned_total),
            ("rejected", &self.decisions_rejected_total),
            ("expired", &self.decisions_expired_total),
        ] {
            let _ = writeln!(
                out,
                "metronome_dispatcher_decisions_total{{outcome=\"{outcome}\"}} {}",
                v.load(Relaxed)
            );
        }
        counter(
            &mut out,
            "metronome_dispatcher_malformed_jobs_total",
            "Messages on jobs.submit that were not valid jobs.",
            self.malformed_jobs_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_publish_failures_total",
            "Assignments whose publish failed and were rolled back.",
            self.publish_failures_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_duplicate_assignments_total",
            "Assignments JetStream reported as duplicates (already sent by an earlier leader).",
            self.duplicate_assignments_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_rescued_jobs_total",
            "Jobs dispatched again after their worker died.",
            self.rescued_jobs_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_least_harm_placements_total",
            "Jobs placed where they do least harm because their TTFT budget ran out while no worker admitted them without a predicted SLO miss.",
            self.least_harm_placements_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_deadline_unmeetable_total",
            "Jobs answered at once with a Retry-After because the queue was predicted to reach them only after their deadline.",
            self.deadline_unmeetable_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_term_task_failures_total",
            "Internal tasks of a leadership term that died; each ends the term.",
            self.term_task_failures_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_ignored_worker_messages_total",
            "Heartbeats and completion events ignored as malformed or with a bad id.",
            self.ignored_worker_messages_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_workers_lost_total",
            "Workers declared dead.",
            self.workers_lost_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_redelivered_already_decided_total",
            "Redelivered jobs acknowledged without assigning them again (a decision existed).",
            self.redelivered_already_decided_total.load(Relaxed),
        );
        counter(
            &mut out,
            "metronome_dispatcher_redis_errors_total",
            "Failed EWMA refreshes from Redis.",
            self.redis_errors_total.load(Relaxed),
        );
        gauge(
            &mut out,
            "metronome_dispatcher_leader",
            "1 while this instance holds the lease and decides.",
            self.is_leader.load(Relaxed),
        );
        gauge(
            &mut out,
            "metronome_dispatcher_epoch",
            "Epoch of the lease this instance holds (0 as standby).",
            self.epoch.load(Relaxed),
        );
        gauge(
            &mut out,
            "metronome_dispatcher_ledger_reservations",
            "Reservations in the ledger.",
            self.ledger_reservations.load(Relaxed),
        );
        gauge(
            &mut out,
            "metronome_dispatcher_workers",
            "Workers in the registry.",
            self.workers_known.load(Relaxed),
        );
        gauge(
            &mut out,
            "metronome_dispatcher_redis_up",
            "1 when the last EWMA refresh from Redis succeeded.",
            self.redis_up.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP metronome_dispatcher_queue_depth Jobs waiting in the admission queue, per model.\n# TYPE metronome_dispatcher_queue_depth gauge"
        );
        if let Ok(depths) = self.queue_depth.lock() {
            for (model, depth) in depths.iter() {
                let model = model.replace('\\', "\\\\").replace('"', "\\\"");
                let _ = writeln!(
                    out,
                    "metronome_dispatcher_queue_depth{{model=\"{model}\"}} {depth}"
                );
            }
        }
        self.render_tenants(&mut out);
        let name = "metronome_dispatcher_decision_latency_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time to evaluate and commit one decision.\n# TYPE {name} histogram"
        );
        for (i, bound) in LATENCY_BUCKETS_S.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                self.latency_buckets[i].load(Relaxed)
            );
        }
        let count = self.latency_count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.latency_sum_ns.load(Relaxed) as f64 / 1e9
        );
        let _ = writeln!(out, "{name}_count {count}");
        out
    }
}

impl Metrics {
    fn render_tenants(&self, out: &mut String) {
        let Ok(tenants) = self.tenants.lock() else {
            return;
        };
        let family = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let rows = |out: &mut String, name: &str, v: &dyn Fn(&TenantStats) -> String| {
            for (tenant, t) in tenants.iter() {
                let _ = writeln!(out, "{name}{{tenant=\"{tenant}\"}} {}", v(t));
            }
        };
        let name = "metronome_dispatcher_tenant_requests_total";
        family(out, name, "counter", "Jobs assigned, per tenant.");
        rows(out, name, &|t| t.requests.to_string());
        let name = "metronome_dispatcher_tenant_tokens_total";
        family(
            out,
            name,
            "counter",
            "Tokens (prompt + output) of completed jobs, per tenant.",
        );
        rows(out, name, &|t| t.tokens.to_string());
        let name = "metronome_dispatcher_tenant_queue_wait_seconds";
        family(
            out,
            name,
            "summary",
            "Time assigned jobs waited in the admission queue, per tenant.",
        );
        rows(out, &format!("{name}_sum"), &|t| {
            (t.queue_wait_ms_sum as f64 / 1000.0).to_string()
        });
        rows(out, &format!("{name}_count"), &|t| t.requests.to_string());
        let name = "metronome_dispatcher_tenant_rejections_total";
        family(
            out,
            name,
            "counter",
            "Jobs not assigned, per tenant and reason code.",
        );
        for (tenant, t) in tenants.iter() {
            for (reason, n) in &t.rejections {
                let _ = writeln!(out, "{name}{{tenant=\"{tenant}\",reason=\"{reason}\"}} {n}");
            }
        }
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

async fn render(State(metrics): State<Arc<Metrics>>) -> String {
    metrics.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histogram_and_queue_depths() {
        let m = Metrics::new();
        m.decisions_assigned_total.fetch_add(3, Relaxed);
        m.observe_decision_latency(7_000);
        m.queue_depth
            .lock()
            .unwrap()
            .insert("llama-3.1-8b".into(), 4);
        let text = m.render();
        assert!(text.contains("metronome_dispatcher_decisions_total{outcome=\"assigned\"} 3"));
        assert!(text.contains("metronome_dispatcher_queue_depth{model=\"llama-3.1-8b\"} 4"));
        assert!(
            text.contains("metronome_dispatcher_decision_latency_seconds_bucket{le=\"0.00001\"} 1")
        );
        assert!(text.contains("metronome_dispatcher_decision_latency_seconds_count 1"));
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
            text.contains("metronome_dispatcher_tenant_queue_wait_seconds_sum{tenant=\"acme\"} 2")
        );
        assert!(text.contains(
            "metronome_dispatcher_tenant_rejections_total{tenant=\"beta\",reason=\"queue_full\"} 1"
        ));
        assert_eq!(m.tenant("acme").requests, 2);
    }
}
