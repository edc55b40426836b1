//! The fairness drill in simulated time: tenant B offers a steady share of the nominal
//! capacity, first alone, then beside tenant A flooding at a multiple of its fair share,
//! on one cluster kept from one phase to the next (as `metronome-bench --fairness` runs one
//! system for its phases). Same tenants, rates, lengths and seed as that drill, and every
//! job carries the gateway's deadline, so A's excess is refused as it is live.
//!
//! What it cannot show: the leader failover phase (the lab runs one engine, no failures).

use metronome_bench::fairness::{FairnessPlan, FLOOD, STEADY};
use metronome_loadgen::plan::tenants_plan;
use metronome_loadgen::stats::percentile;
use metronome_loadgen::{summarize, Slo};

use crate::world::{Cluster, LabConfig, LabRun};

/// One tenant's figures in one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TenantFigures {
    pub sent: usize,
    pub ok: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Wait in the dispatcher's queue, from its decisions (assigned jobs only).
    pub wait_p50_ms: f64,
    pub wait_p99_ms: f64,
    pub output_tok_s: f64,
}

/// The drill's two phases.
#[derive(Debug, Clone)]
pub struct FairnessRun {
    pub steady_rps: f64,
    pub flood_rps: f64,
    /// B alone.
    pub alone: TenantFigures,
    /// B beside A's flood.
    pub steady: TenantFigures,
    /// A.
    pub flood: TenantFigures,
    /// Share of GPU-time idle while a job waited, in the flood phase.
    pub flood_idle_share: f64,
    /// The phases' runs, request by request.
    pub alone_run: LabRun,
    pub flood_run: LabRun,
}

impl FairnessRun {
    /// B's TTFT p99 beside the flood over B's alone (the drill's target: ≤ 1.5).
    pub fn p99_ratio(&self) -> f64 {
        self.steady.ttft_p99_ms / self.alone.ttft_p99_ms.max(1.0)
    }
}

/// Each job's deadline after submission as the gateway sets it by default
/// (`queue_timeout_ms` in `gateway/src/config.rs`).
pub const GATEWAY_QUEUE_TIMEOUT_MS: u64 = 30_000;

/// Run the drill on `config`'s cluster (its `tenants` and `queue_timeout_ms` are set here)
/// with `capacity_rps` as the model's nominal capacity and `seed` for the arrivals.
pub fn run_fairness(
    config: &LabConfig,
    drill: &FairnessPlan,
    capacity_rps: f64,
    seed: u64,
) -> FairnessRun {
    let mut config = config.clone();
    config.tenants = vec![STEADY.to_string(), FLOOD.to_string()];
    config.queue_timeout_ms = Some(GATEWAY_QUEUE_TIMEOUT_MS);
    let steady_rps = drill.steady_share * capacity_rps;
    let flood_rps = drill.flood_factor * capacity_rps / 2.0;
    let plan = |rates: &[f64]| {
        tenants_plan(
            rates,
            seed,
            None,
            Some(drill.phase_s),
            &drill.prompt,
            &drill.output,
        )
    };
    let mut cluster = Cluster::new(&config);
    let alone = cluster.run(&plan(&[steady_rps]));
    let flood = cluster.run(&plan(&[steady_rps, flood_rps]));
    FairnessRun {
        steady_rps,
        flood_rps,
        alone: figures(&alone, STEADY),
        steady: figures(&flood, STEADY),
        flood: figures(&flood, FLOOD),
        flood_idle_share: flood.idle_ms / flood.sampled_ms.max(1.0),
        alone_run: alone,
        flood_run: flood,
    }
}

fn figures(run: &LabRun, tenant: &str) -> TenantFigures {
    let mine = |t: &Option<String>| t.as_deref() == Some(tenant);
    let records: Vec<_> = run
        .records
        .iter()
        .filter(|r| mine(&r.tenant))
        .cloned()
        .collect();
    let summary = summarize(&records, Slo::default());
    let waits: Vec<f64> = run
        .records
        .iter()
        .zip(&run.predicted)
        .filter(|(r, _)| mine(&r.tenant))
        .filter_map(|(_, p)| p.as_ref().map(|p| p.queue_wait_ms))
        .collect();
    TenantFigures {
        sent: summary.count,
        ok: summary.ok,
        ttft_p50_ms: summary.ttft_ms.p50.unwrap_or(0.0),
        ttft_p99_ms: summary.ttft_ms.p99.unwrap_or(0.0),
        wait_p50_ms: percentile(&waits, 50.0).unwrap_or(0.0),
        wait_p99_ms: percentile(&waits, 99.0).unwrap_or(0.0),
        output_tok_s: summary.output_tokens_per_s,
    }
}
