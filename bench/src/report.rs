//! The benchmark report: result rows, the goodput curves and capacity at SLO derived from
//! them, the issue's targets judged against least connections, and their rendering as
//! Markdown (`BENCHMARKS.md`).
//!
//! Pure: no I/O, no clock. Every figure printed comes from a [`Summary`] or a measured
//! value held in [`Report`], so the document is a function of the run's data. A ratio with
//! a zero denominator is rendered as `∞` (or `n/a` when both sides are zero) rather than
//! hidden; a target that the data cannot decide (e.g. both capacities only bounded) is
//! `n/a`, never `met`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::curve::{capacity_at_slo, CapacityRatio, CurvePoint, SloCapacity, ATTAINMENT_TARGET};
use super::idle::IdleStats;
use super::nominal::Nominal;
use super::prediction::PredictionErrors;
use metronome_loadgen::Summary;

/// The policy under test and the baseline the targets are judged against.
pub const METRONOME: &str = "metronome";
pub const BASELINE: &str = "least_connections";

/// One load point of one policy on one workload and cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRow {
    pub policy: String,
    /// `trace` or `chat`.
    pub workload: String,
    /// `equal` or `mixed`.
    pub cluster: String,
    /// Offered load as a share of the nominal capacity (0.7 = 70 %).
    pub load_frac: f64,
    /// Planned mean arrival rate, requests/s.
    pub rate_rps: f64,
    pub summary: Summary,
    /// Requests meeting the SLO per second of offered time (see `curve::goodput_rate`).
    pub goodput_rps: f64,
    /// `vllm:num_preemptions_total` summed over the simulated GPUs, after minus before.
    pub preemptions: f64,
    /// The simulated GPUs' `vllm:prefix_cache_hits_total` over
    /// `vllm:prefix_cache_queries_total` during the run (tokens); `None` without queries.
    #[serde(default)]
    pub prefix_hit_rate: Option<f64>,
    pub idle: IdleStats,
    /// Prediction errors, when the decisions carried predictions.
    #[serde(default)]
    pub prediction: Option<PredictionErrors>,
    /// Decisions read from the DECISIONS stream after the run (Metronome runs only).
    #[serde(default)]
    pub decisions_read: usize,
    /// Folder of the run's CSV, summary and plots, relative to the report.
    pub dir: String,
}

/// The nominal capacity of one workload on one cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NominalRow {
    pub workload: String,
    pub cluster: String,
    pub speeds: Vec<f64>,
    pub nominal: Nominal,
}

/// The burst case for one policy on one cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BurstRow {
    pub cluster: String,
    pub policy: String,
    pub rounds: usize,
    /// Rounds whose N jobs landed on N distinct workers.
    pub distinct_rounds: usize,
    /// Rounds with a failed request or a missing worker header.
    pub failed_rounds: usize,
    /// The workers of each round that did not land one job per worker.
    #[serde(default)]
    pub examples: Vec<String>,
}

/// Latency of one fixed-rate run, through the gateway and directly to the simulator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadRow {
    pub rate_rps: f64,
    pub direct: Summary,
    pub gateway: Summary,
}

/// One measured step of a capacity search (the overhead's zero-delay ramp).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RampStep {
    pub rate_rps: f64,
    pub kept_up: bool,
    pub completion_rps: f64,
    pub ok: usize,
    pub count: usize,
}

/// The goodput curve plot of one workload × cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlotRef {
    pub workload: String,
    pub cluster: String,
    /// Relative to the report.
    pub path: String,
}

/// Everything the report shows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub title_scale: String,
    pub command: String,
    pub date_utc: String,
    pub machine: Vec<(String, String)>,
    pub setup: Vec<String>,
    /// Workloads and clusters in run order (`trace`, `chat`; `equal`, `mixed`).
    pub workloads: Vec<String>,
    pub clusters: Vec<String>,
    pub nominal: Vec<NominalRow>,
    pub runs: Vec<RunRow>,
    pub plots: Vec<PlotRef>,
    pub burst: Vec<BurstRow>,
    pub overhead: Vec<OverheadRow>,
    pub max_sustained_rps: Option<f64>,
    pub ramp_overhead: Vec<RampStep>,
    pub dispatch_bench: Option<String>,
    /// Peak VmRSS (KiB) per process of the system under load, and the load it was under.
    pub rss_kib: Vec<(String, u64)>,
    pub rss_under: String,
    pub rss_overhead_kib: Vec<(String, u64)>,
    pub notes: Vec<String>,
    /// Free text: the analysis of targets met and missed.
    pub analysis: String,
    /// The one command that measures every point of this report in one run
    /// ([`reproduce_command`]); empty in reports written before it was kept.
    #[serde(default)]
    pub reproduce: String,
}

/// `a / b`, infinite when only `b` is zero, `None` when either is unknown or both are zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    let (a, b) = (a?, b?);
    if b == 0.0 {
        if a == 0.0 {
            None
        } else {
            Some(f64::INFINITY)
        }
    } else {
        Some(a / b)
    }
}

fn num(x: Option<f64>, digits: usize) -> String {
    match x {
        None => "–".into(),
        Some(v) if v.is_infinite() => "∞".into(),
        Some(v) => format!("{v:.digits$}"),
    }
}

fn ms(x: Option<f64>) -> String {
    match x {
        None => "–".into(),
        Some(v) if v >= 10_000.0 => format!("{:.1} s", v / 1000.0),
        Some(v) => format!("{v:.0}"),
    }
}

fn pct(x: Option<f64>) -> String {
    match x {
        None => "–".into(),
        Some(v) => format!("{:.0} %", v * 100.0),
    }
}

fn same(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

impl Report {
    /// Runs of one workload × cluster (× policy when given), by load.
    pub fn rows(&self, workload: &str, cluster: &str, policy: Option<&str>) -> Vec<&RunRow> {
        let mut v: Vec<&RunRow> = self
            .runs
            .iter()
            .filter(|r| r.workload == workload && r.cluster == cluster)
            .filter(|r| policy.is_none_or(|p| r.policy == p))
            .collect();
        v.sort_by(|a, b| a.load_frac.total_cmp(&b.load_frac));
        v
    }

    /// Policies that ran, in run order.
    pub fn policies(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.policy) {
                out.push(r.policy.clone());
            }
        }
        out
    }

    /// The nominal capacity of a workload × cluster.
    pub fn nominal_of(&self, workload: &str, cluster: &str) -> Option<&Nominal> {
        self.nominal
            .iter()
            .find(|n| n.workload == workload && n.cluster == cluster)
            .map(|n| &n.nominal)
    }

    /// Capacity at SLO of one policy on one workload × cluster.
    pub fn slo_capacity(&self, workload: &str, cluster: &str, policy: &str) -> Option<SloCapacity> {
        let pts: Vec<CurvePoint> = self
            .rows(workload, cluster, Some(policy))
            .iter()
            .map(|r| CurvePoint {
                rate_rps: r.rate_rps,
                attainment: r.summary.goodput_share,
            })
            .collect();
        capacity_at_slo(&pts, ATTAINMENT_TARGET)
    }
}

/// One target of the issue, judged on one workload × cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetCheck {
    pub name: String,
    pub wanted: String,
    /// The measured figures, in words.
    pub measured: String,
    /// How far from the threshold, signed so that ≥ 0 is met.
    pub margin: String,
    pub met: Option<bool>,
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "n/a",
    }
}

/// Which of two ratios decides a "reach every baseline" target: a miss before an
/// undecided ratio before a met one, then the lower ratio.
fn deciding_first(a: CapacityRatio, b: CapacityRatio, want: f64) -> std::cmp::Ordering {
    let class = |r: CapacityRatio| match r.reaches(want) {
        Some(false) => 0,
        None => 1,
        Some(true) => 2,
    };
    class(a).cmp(&class(b)).then(a.low.total_cmp(&b.low))
}

/// `m / b ≥ want` for capacities that may only be bounded: decided only where the bounds
/// put every possible ratio on one side of `want`.
fn capacity_ratio_check(
    name: &str,
    m: Option<SloCapacity>,
    b: Option<(String, SloCapacity)>,
    want: f64,
) -> TargetCheck {
    let wanted = format!("≥ {want}×");
    let (Some(m), Some((bname, b))) = (m, b) else {
        return TargetCheck {
            name: name.into(),
            wanted,
            measured: "not measured".into(),
            margin: "–".into(),
            met: None,
        };
    };
    let r = m.ratio_to(b);
    // Where Metronome itself never reached 90 %, only lower loads can decide the ratio.
    let hint = if matches!(m, SloCapacity::Below(_)) && r.reaches(want).is_none() {
        " (Metronome under 90 % at the lowest load: lower `--loads` decide it)"
    } else {
        ""
    };
    TargetCheck {
        name: name.into(),
        wanted,
        measured: format!(
            "{} vs {} ({bname}) req/s: ratio {}{hint}",
            m.display(),
            b.display(),
            r.display()
        ),
        margin: r.margin(want),
        met: r.reaches(want),
    }
}

/// The issue's targets on one workload × cluster: Metronome against least connections
/// (and the best other baseline), same run.
pub fn target_checks(report: &Report, workload: &str, cluster: &str) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    let m_cap = report.slo_capacity(workload, cluster, METRONOME);
    let lc_cap = report
        .slo_capacity(workload, cluster, BASELINE)
        .map(|c| (BASELINE.to_string(), c));
    out.push(capacity_ratio_check(
        "capacity at SLO vs least connections",
        m_cap,
        lc_cap,
        1.3,
    ));
    // Metronome must reach every other baseline, so the one shown is the one that decides
    // (`deciding_first`). Ranking the baselines by one number would count a "below the
    // lowest point" bound as 0 and pass over a baseline that could be the best.
    let best_other = m_cap.and_then(|m| {
        report
            .policies()
            .into_iter()
            .filter(|p| p != METRONOME && p != BASELINE)
            .filter_map(|p| report.slo_capacity(workload, cluster, &p).map(|c| (p, c)))
            .min_by(|a, b| deciding_first(m.ratio_to(a.1), m.ratio_to(b.1), 1.0))
    });
    out.push(capacity_ratio_check(
        "capacity at SLO vs the best other baseline",
        m_cap,
        best_other,
        1.0,
    ));

    let m_rows = report.rows(workload, cluster, Some(METRONOME));
    let b_rows = report.rows(workload, cluster, Some(BASELINE));
    let pairs: Vec<(&RunRow, &RunRow)> = m_rows
        .iter()
        .filter_map(|m| {
            b_rows
                .iter()
                .find(|b| same(b.load_frac, m.load_frac))
                .map(|b| (*m, *b))
        })
        .collect();

    // Goodput share at every load: m ≥ b − 0.02.
    let worst = pairs
        .iter()
        .map(|(m, b)| {
            (
                m,
                b,
                m.summary.goodput_share - b.summary.goodput_share + 0.02,
            )
        })
        .min_by(|x, y| x.2.total_cmp(&y.2));
    out.push(match worst {
        Some((m, b, margin)) => TargetCheck {
            name: "goodput share at every load point".into(),
            wanted: "≥ least connections' − 0.02".into(),
            measured: format!(
                "worst at {:.0} %: {:.3} vs {:.3}",
                m.load_frac * 100.0,
                m.summary.goodput_share,
                b.summary.goodput_share
            ),
            margin: format!("{margin:+.3}"),
            met: Some(margin >= -1e-9),
        },
        None => not_measured(
            "goodput share at every load point",
            "≥ least connections' − 0.02",
        ),
    });

    // Goodput rate in the two highest loads: m ≥ 1.2 × b.
    let top: Vec<&(&RunRow, &RunRow)> = pairs.iter().rev().take(2).collect();
    let worst = top
        .iter()
        .map(|(m, b)| (m, b, ratio(Some(m.goodput_rps), Some(b.goodput_rps))))
        .min_by(|x, y| {
            x.2.unwrap_or(f64::NEG_INFINITY)
                .total_cmp(&y.2.unwrap_or(f64::NEG_INFINITY))
        });
    out.push(match worst {
        Some((m, b, r)) => TargetCheck {
            name: "goodput rate in the two highest load points".into(),
            wanted: "≥ 1.2× least connections'".into(),
            measured: format!(
                "worst at {:.0} %: {:.2} vs {:.2} req/s, ratio {}",
                m.load_frac * 100.0,
                m.goodput_rps,
                b.goodput_rps,
                num(r, 2)
            ),
            margin: r.map_or("–".into(), |r| {
                if r.is_infinite() {
                    "∞".into()
                } else {
                    format!("{:+.2}×", r - 1.2)
                }
            }),
            met: r.map(|r| r >= 1.2 - 1e-9),
        },
        None => not_measured(
            "goodput rate in the two highest load points",
            "≥ 1.2× least connections'",
        ),
    });

    // Idle GPU-seconds while jobs waited, at every load.
    let worst_idle = m_rows
        .iter()
        .filter(|r| r.idle.samples > 1)
        .max_by(|a, b| a.idle.share.total_cmp(&b.idle.share));
    out.push(match worst_idle {
        Some(r) => TargetCheck {
            name: "idle GPU-seconds while a job waited".into(),
            wanted: "< 1 % of GPU-seconds at every load".into(),
            measured: format!(
                "worst at {:.0} %: {:.1} of {:.0} GPU-s = {:.2} %",
                r.load_frac * 100.0,
                r.idle.idle_gpu_s,
                r.idle.total_gpu_s,
                r.idle.share * 100.0
            ),
            margin: format!("{:+.2} pp", 1.0 - r.idle.share * 100.0),
            met: Some(r.idle.share < 0.01),
        },
        None => not_measured("idle GPU-seconds while a job waited", "< 1 % at every load"),
    });

    // Prediction error up to capacity.
    let pooled = pooled_prediction(report, workload, cluster);
    for (name, stats) in [
        (
            "prediction error p50, TTFT (loads ≤ 100 %)",
            pooled.as_ref().map(|p| p.ttft),
        ),
        (
            "prediction error p50, decode rate (loads ≤ 100 %)",
            pooled.as_ref().map(|p| p.decode),
        ),
    ] {
        out.push(match stats.and_then(|s| s.p50.map(|p50| (s, p50))) {
            Some((s, p50)) => TargetCheck {
                name: name.into(),
                wanted: "≤ 15 %".into(),
                measured: format!(
                    "p50 {:.1} %, p90 {} over {} jobs",
                    p50 * 100.0,
                    s.p90.map_or("–".into(), |v| format!("{:.1} %", v * 100.0)),
                    s.n
                ),
                margin: format!("{:+.1} pp", 15.0 - p50 * 100.0),
                met: Some(p50 <= 0.15 + 1e-12),
            },
            None => TargetCheck {
                name: name.into(),
                wanted: "≤ 15 %".into(),
                measured: "no decision carried a prediction".into(),
                margin: "–".into(),
                met: None,
            },
        });
    }
    out
}

fn not_measured(name: &str, wanted: &str) -> TargetCheck {
    TargetCheck {
        name: name.into(),
        wanted: wanted.into(),
        measured: "not measured".into(),
        margin: "–".into(),
        met: None,
    }
}

/// Metronome's prediction errors pooled over its runs at loads ≤ 100 % of nominal.
pub fn pooled_prediction(
    report: &Report,
    workload: &str,
    cluster: &str,
) -> Option<PredictionErrors> {
    let runs: Vec<&PredictionErrors> = report
        .rows(workload, cluster, Some(METRONOME))
        .into_iter()
        .filter(|r| r.load_frac <= 1.0 + 1e-9)
        .filter_map(|r| r.prediction.as_ref())
        .collect();
    (!runs.is_empty()).then(|| PredictionErrors::pooled(runs))
}

/// The targets table.
pub fn targets_table(checks: &[TargetCheck]) -> String {
    let mut out = String::from(
        "| target | wanted | measured (metronome vs baseline) | margin | verdict |\n|---|---|---|---|---|\n",
    );
    for c in checks {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            c.name,
            c.wanted,
            c.measured,
            c.margin,
            verdict(c.met)
        );
    }
    out
}

fn pred_cell(p: &Option<PredictionErrors>, decode: bool) -> String {
    match p {
        Some(p) => {
            let s = if decode { p.decode } else { p.ttft };
            if s.n == 0 {
                "–".into()
            } else {
                format!("{} / {}", pct(s.p50), pct(s.p90))
            }
        }
        None => "–".into(),
    }
}

/// Every point × policy of one workload × cluster.
pub fn points_table(rows: &[&RunRow]) -> String {
    let mut out = String::from(
        "| load | rate (req/s) | policy | requests | SLO attainment | goodput (req/s) | output tok/s | TTFT p50 (ms) | TTFT p99 | tok/s p1 | tok/s CV | idle GPU-s (share) | max queue | pred. err TTFT p50/p90 | pred. err decode p50/p90 | preemptions | errors | plots |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let s = &r.summary;
        let _ = writeln!(
            out,
            "| {:.0} % | {:.2} | {} | {} | {:.1} % | {:.2} | {:.0} | {} | {} | {} | {} | {:.1} ({:.2} %) | {:.0} | {} | {} | {:.0} | {} | [cdf]({}/tokens_per_s_cdf.svg) [time]({}/latency_over_time.svg) |",
            r.load_frac * 100.0,
            r.rate_rps,
            r.policy,
            s.count,
            s.goodput_share * 100.0,
            r.goodput_rps,
            s.output_tokens_per_s,
            ms(s.ttft_ms.p50),
            ms(s.ttft_ms.p99),
            num(s.tokens_per_s.p1, 1),
            num(s.tokens_per_s.cv, 2),
            r.idle.idle_gpu_s,
            r.idle.share * 100.0,
            r.idle.max_queued,
            pred_cell(&r.prediction, false),
            pred_cell(&r.prediction, true),
            r.preemptions,
            s.errors,
            r.dir,
            r.dir,
        );
    }
    out
}

/// Capacity at SLO of every policy on one workload × cluster.
pub fn slo_capacity_table(report: &Report, workload: &str, cluster: &str) -> String {
    let nominal = report.nominal_of(workload, cluster).map(|n| n.capacity_rps);
    let mut out = String::from(
        "| policy | capacity at SLO (req/s) | share of nominal | how |\n|---|---|---|---|\n",
    );
    for p in report.policies() {
        let Some(c) = report.slo_capacity(workload, cluster, &p) else {
            continue;
        };
        let how = match c {
            SloCapacity::Interpolated(_) => "interpolated between the two points bracketing 90 %",
            SloCapacity::AtLeast(_) => "every point ≥ 90 %: at least the highest point",
            SloCapacity::Below(_) => "no point ≥ 90 %: below the lowest point",
        };
        let share = match (c, nominal) {
            (SloCapacity::Below(_), _) | (_, None) => "–".to_string(),
            (c, Some(n)) => format!("{:.0} %", c.interval().0 / n * 100.0),
        };
        let _ = writeln!(out, "| {p} | {} | {share} | {how} |", c.display());
    }
    out
}

/// The nominal capacities.
pub fn nominal_table(rows: &[NominalRow]) -> String {
    let mut out = String::from(
        "| workload | cluster (speeds) | mean prompt | mean output | batch b* | step at b* (ms) | t_req (GPU-s) | nominal capacity (req/s) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let n = &r.nominal;
        let _ = writeln!(
            out,
            "| {} | {} ({}) | {:.0} | {:.0} | {} | {:.2} | {:.3} | **{:.2}** |",
            r.workload,
            r.cluster,
            r.speeds
                .iter()
                .map(|s| format!("{s}"))
                .collect::<Vec<_>>()
                .join(", "),
            n.mean_prompt,
            n.mean_output,
            n.batch,
            n.step_ms,
            n.t_req_s,
            n.capacity_rps
        );
    }
    out
}

/// The burst table.
pub fn burst_table(rows: &[BurstRow]) -> String {
    let mut out = String::from(
        "| cluster | policy | rounds | one job per GPU | share | rounds with errors | workers of the first rounds that doubled up |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let share = if r.rounds == 0 {
            0.0
        } else {
            r.distinct_rounds as f64 / r.rounds as f64 * 100.0
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.0} % | {} | {} |",
            r.cluster,
            r.policy,
            r.rounds,
            r.distinct_rounds,
            share,
            r.failed_rounds,
            r.examples
                .iter()
                .take(3)
                .map(|e| format!("`{e}`"))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    out
}

/// Latency added by gateway → dispatcher → worker: gateway percentile minus direct.
pub fn overhead_table(rows: &[OverheadRow]) -> String {
    let mut out = String::from(
        "| rate (req/s) | direct e2e p50 (ms) | p99 | via Metronome e2e p50 (ms) | p99 | added p50 (ms) | added p99 (ms) | achieved via Metronome (req/s) | errors |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let added = |g: Option<f64>, d: Option<f64>| match (g, d) {
            (Some(g), Some(d)) => Some(g - d),
            _ => None,
        };
        let _ = writeln!(
            out,
            "| {:.0} | {} | {} | {} | {} | {} | {} | {:.0} | {} |",
            r.rate_rps,
            num(r.direct.e2e_ms.p50, 2),
            num(r.direct.e2e_ms.p99, 2),
            num(r.gateway.e2e_ms.p50, 2),
            num(r.gateway.e2e_ms.p99, 2),
            num(added(r.gateway.e2e_ms.p50, r.direct.e2e_ms.p50), 2),
            num(added(r.gateway.e2e_ms.p99, r.direct.e2e_ms.p99), 2),
            r.gateway.achieved_rate_rps,
            r.gateway.errors,
        );
    }
    out
}

/// A ramp of a capacity search.
pub fn ramp_table(steps: &[RampStep]) -> String {
    let mut out = String::from(
        "| offered (req/s) | completion rate (req/s) | ok / sent | kept up |\n|---|---|---|---|\n",
    );
    for s in steps {
        let _ = writeln!(
            out,
            "| {:.2} | {:.2} | {} / {} | {} |",
            s.rate_rps,
            s.completion_rps,
            s.ok,
            s.count,
            if s.kept_up { "yes" } else { "no" }
        );
    }
    out
}

/// Peak RSS per process.
pub fn rss_table(rows: &[(String, u64)]) -> String {
    let mut out = String::from("| process | peak RSS (MiB) |\n|---|---|\n");
    for (name, kib) in rows {
        let _ = writeln!(out, "| {} | {:.1} |", name, *kib as f64 / 1024.0);
    }
    out
}

/// One policy's line of the headline: its capacity at SLO, Metronome's against it, its best
/// goodput, and its latency and decode-rate floor at the load Metronome still serves at SLO.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadlineRow {
    pub policy: String,
    pub capacity: Option<SloCapacity>,
    /// Metronome's capacity at SLO over this policy's (`None` for Metronome itself).
    pub ratio: Option<CapacityRatio>,
    /// The highest goodput of any load point, req/s, and that point's load share.
    pub peak_goodput: Option<(f64, f64)>,
    /// TTFT p90 (ms) and per-request tok/s p1 at [`headline_load`], when measured there.
    pub ttft_p90_ms: Option<f64>,
    pub tok_s_p1: Option<f64>,
}

/// The load the headline compares latency at: the highest load point at which Metronome
/// met the SLO for ≥ 90 % of requests, so every policy is seen at the same offered rate
/// and Metronome within its SLO. `None` when Metronome met it nowhere.
pub fn headline_load<'a>(report: &'a Report, workload: &str, cluster: &str) -> Option<&'a RunRow> {
    report
        .rows(workload, cluster, Some(METRONOME))
        .into_iter()
        .filter(|r| r.summary.goodput_share >= ATTAINMENT_TARGET - 1e-12)
        .max_by(|a, b| a.load_frac.total_cmp(&b.load_frac))
}

/// Every policy of one workload × cluster, Metronome first, then in run order.
pub fn headline_rows(report: &Report, workload: &str, cluster: &str) -> Vec<HeadlineRow> {
    let m_cap = report.slo_capacity(workload, cluster, METRONOME);
    let at = headline_load(report, workload, cluster).map(|r| r.load_frac);
    let mut policies = report.policies();
    policies.sort_by_key(|p| p != METRONOME);
    policies
        .into_iter()
        .filter(|p| !report.rows(workload, cluster, Some(p)).is_empty())
        .map(|p| {
            let rows = report.rows(workload, cluster, Some(&p));
            let capacity = report.slo_capacity(workload, cluster, &p);
            let ratio = match (m_cap, capacity) {
                (Some(m), Some(c)) if p != METRONOME => Some(m.ratio_to(c)),
                _ => None,
            };
            let peak_goodput = rows
                .iter()
                .max_by(|a, b| a.goodput_rps.total_cmp(&b.goodput_rps))
                .map(|r| (r.goodput_rps, r.load_frac));
            let there = at.and_then(|l| rows.iter().find(|r| same(r.load_frac, l)));
            HeadlineRow {
                ttft_p90_ms: there.and_then(|r| r.summary.ttft_ms.p90),
                tok_s_p1: there.and_then(|r| r.summary.tokens_per_s.p1),
                policy: p,
                capacity,
                ratio,
                peak_goodput,
            }
        })
        .collect()
}

/// The headline table: every workload × cluster, every policy.
pub fn headline_table(report: &Report) -> String {
    let mut out = String::from(
        "| workload, cluster | policy | capacity at SLO (req/s) | Metronome's ÷ this | peak goodput (req/s, at load) | same load as Metronome's last ≥ 90 % point | TTFT p90 (ms) | tok/s p1 |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (w, c) in sections(report) {
        let at = headline_load(report, &w, &c);
        for (i, h) in headline_rows(report, &w, &c).iter().enumerate() {
            let first = i == 0;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                if first {
                    format!("{w}, {c}")
                } else {
                    String::new()
                },
                if h.policy == METRONOME {
                    format!("**{}**", h.policy)
                } else {
                    h.policy.clone()
                },
                h.capacity.map_or("–".into(), |c| c.display()),
                h.ratio.map_or("–".into(), |r| r.display()),
                h.peak_goodput.map_or("–".into(), |(g, l)| format!(
                    "{g:.2} ({:.0} %)",
                    l * 100.0
                )),
                match (first, at) {
                    (true, Some(r)) =>
                        format!("{:.0} % ({:.2} req/s)", r.load_frac * 100.0, r.rate_rps),
                    (true, None) => "none".into(),
                    (false, _) => String::new(),
                },
                ms(h.ttft_p90_ms),
                num(h.tok_s_p1, 1),
            );
        }
    }
    out
}

/// One line per workload × cluster: how many of the targets were met.
pub fn targets_summary(report: &Report) -> String {
    sections(report)
        .iter()
        .map(|(w, c)| {
            let checks = target_checks(report, w, c);
            let met = checks.iter().filter(|c| c.met == Some(true)).count();
            let missed = checks.iter().filter(|c| c.met == Some(false)).count();
            let mut s = format!("{w}, {c}: {met} of {} met", checks.len());
            if missed > 0 {
                let _ = write!(s, ", **{missed} missed**");
            }
            let open = checks.len() - met - missed;
            if open > 0 {
                let _ = write!(s, ", {open} undecided");
            }
            s
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a full run measures when no flag is given: the values [`reproduce_command`] leaves
/// out.
#[derive(Debug, Clone)]
pub struct RunDefaults<'a> {
    pub policies: &'a [&'a str],
    pub workloads: &'a [&'a str],
    pub clusters: &'a [&'a str],
    pub loads: &'a [f64],
    pub requests: usize,
    pub burst_rounds: usize,
}

/// The one `metronome-bench` command that measures every point of `report` in one run:
/// its policies, workloads, clusters and the union of its loads, each flag given only where
/// it differs from `defaults`. A merged report's points came from several runs of the same
/// method; this command takes them in one.
pub fn reproduce_command(report: &Report, defaults: &RunDefaults) -> String {
    let mut flags: Vec<String> = Vec::new();
    let list = |v: &[String], all: &[&str]| -> Option<String> {
        let mut sorted: Vec<&str> = all
            .iter()
            .copied()
            .filter(|a| v.iter().any(|x| x == a))
            .collect();
        sorted.extend(v.iter().map(String::as_str).filter(|x| !all.contains(x)));
        (sorted.len() != all.len()).then(|| sorted.join(","))
    };
    if let Some(p) = list(&report.policies(), defaults.policies) {
        flags.push(format!("--policies {p}"));
    }
    if let Some(w) = list(&report.workloads, defaults.workloads) {
        flags.push(format!("--workloads {w}"));
    }
    if let Some(c) = list(&report.clusters, defaults.clusters) {
        flags.push(format!("--clusters {c}"));
    }
    let mut loads: Vec<f64> = Vec::new();
    for r in &report.runs {
        if !loads.iter().any(|l| same(*l, r.load_frac)) {
            loads.push(r.load_frac);
        }
    }
    loads.sort_by(f64::total_cmp);
    let default_loads = loads.len() == defaults.loads.len()
        && loads.iter().zip(defaults.loads).all(|(a, b)| same(*a, *b));
    if !default_loads && !loads.is_empty() {
        flags.push(format!(
            "--loads {}",
            loads
                .iter()
                .map(|l| format!("{l}"))
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    let requests = report.runs.iter().map(|r| r.summary.count).max();
    if let Some(n) = requests.filter(|n| *n != defaults.requests) {
        flags.push(format!("--requests {n}"));
    }
    let rounds = report.burst.iter().map(|b| b.rounds).max().unwrap_or(0);
    if rounds != defaults.burst_rounds {
        flags.push(format!("--burst-rounds {rounds}"));
    }
    if report.overhead.is_empty() && report.max_sustained_rps.is_none() {
        flags.push("--skip-overhead".into());
    }
    let mut cmd = String::from("target/release/metronome-bench");
    for f in flags {
        cmd.push(' ');
        cmd.push_str(&f);
    }
    cmd
}

/// Human title of a workload.
pub fn workload_title(w: &str) -> &str {
    match w {
        "trace" => "trace (Azure LLM 2023, code)",
        "chat" => "chat-like Poisson",
        "shared_prefix" => "shared system prompts (16 groups × 2,000 tokens)",
        "multi_turn" => "multi-turn conversations",
        "agent" => "agent loop",
        other => other,
    }
}

/// Human title of a cluster.
pub fn cluster_title(c: &str) -> &str {
    match c {
        "equal" => "4 equal GPUs",
        "mixed" => "4 mixed GPUs (1, 1, 1, 0.5)",
        other => other,
    }
}

/// The file under a results folder that holds a section saved for the report (the
/// fairness drill's, the prefix-heavy workloads'): the rendered report ends with these.
pub const SECTION_FILE: &str = "section.md";

/// Workload × cluster pairs that have runs, in report order.
pub fn sections(report: &Report) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for c in &report.clusters {
        for w in &report.workloads {
            if !report.rows(w, c, None).is_empty() {
                out.push((w.clone(), c.clone()));
            }
        }
    }
    out
}

/// What every per-point table's columns mean (said once, above the first).
const POINT_COLUMNS: &str = "SLO attainment = share of all requests with TTFT ≤ 2 s and ≥ 30 tok/s (failures count as misses); goodput = requests meeting the SLO per second of offered time; output tok/s over first send → last completion; tok/s per request (tokens after the first / time after the first); idle = GPU-seconds a GPU had no running or waiting request while the dispatcher queued a job for its model; prediction error = |predicted − actual| / actual (Metronome decisions that carry predictions).";

/// The whole `BENCHMARKS.md`: the headline (one screen: every policy on every workload ×
/// cluster, the machine, the command), then the generated detail, then the sections saved
/// beside the results (`extra`: the prefix-heavy workloads' figures, the fairness drill's
/// section written by `--fairness`).
pub fn render(report: &Report, extra: Option<&str>) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Metronome benchmarks ({})\n", report.title_scale);
    o.push_str("Metronome against conventional balancers on simulated GPUs: every policy offered the same absolute request rates, every component at the defaults `./dev up` gives it. This file is generated by `metronome-bench` from `bench-results/report.json`; the method and what each figure means: [docs/BENCHMARKING.md](docs/BENCHMARKING.md).\n\n");
    o.push_str("## Headline\n\n");
    let secs = sections(report);
    if secs.is_empty() {
        o.push_str("No load points were measured.\n\n");
    } else {
        o.push_str(&headline_table(report));
        o.push_str("\nCapacity at SLO: the highest offered rate at which ≥ 90 % of requests meet the SLO (TTFT ≤ 2 s and ≥ 30 tok/s each), interpolated between the two load points that bracket 90 %; `< x` means under 90 % already at the lowest point measured, `≥ x` at or above it at the highest, and a ratio against a bound is itself a bound. Peak goodput: the most requests meeting the SLO per second at any load. TTFT p90 and tok/s p1 (the per-request decode-rate floor 99 % of requests beat) at the same offered rate for every policy.\n\n");
        let _ = writeln!(
            o,
            "Targets met ([docs/BENCHMARKING.md](docs/BENCHMARKING.md#targets)): {}.\n",
            targets_summary(report)
        );
    }
    let machine: Vec<String> = report
        .machine
        .iter()
        .filter(|(k, _)| k != "note" && k != "commit")
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let commit = report
        .machine
        .iter()
        .find(|(k, _)| k == "commit")
        .map_or(String::new(), |(_, c)| format!(", commit {c}"));
    let _ = writeln!(
        o,
        "Machine: {}; every process of the system and the load generator on these cores. Run {}{commit}{}.\n",
        machine.join(", "),
        report.date_utc,
        if report.notes.is_empty() {
            ""
        } else {
            "; the points of later runs, with their dates and commits, under Notes"
        }
    );
    if !report.reproduce.is_empty() {
        let _ = writeln!(
            o,
            "Reproduce (hours on 2 cores), or render this file again from the saved results (seconds):\n\n```sh\ncargo build --release --bins\n{}\ntarget/release/metronome-bench --render bench-results/report.json\n```\n",
            report.reproduce
        );
    }

    o.push_str("## Setup\n\n");
    for s in &report.setup {
        let _ = writeln!(o, "- {s}");
    }
    o.push_str("\n## Nominal capacity\n\n");
    o.push_str("What the GPUs could serve at the SLO's rate floor with perfect packing and no queueing, from the simulator's calibrated cost model. Every policy is offered the same absolute rates: multiples of this figure.\n\n");
    o.push_str(&nominal_table(&report.nominal));

    o.push_str(
        "\n## Targets (Metronome against least connections and the best other baseline)\n\n",
    );
    for (w, c) in &secs {
        let _ = writeln!(o, "### {} on {}\n", workload_title(w), cluster_title(c));
        o.push_str(&targets_table(&target_checks(report, w, c)));
        o.push('\n');
    }
    for b in report.burst.iter().filter(|b| b.policy == METRONOME) {
        let _ = writeln!(
            o,
            "Burst ({}): metronome put one job per GPU in {} of {} rounds (target: all).\n",
            cluster_title(&b.cluster),
            b.distinct_rounds,
            b.rounds
        );
    }
    if !report.analysis.trim().is_empty() {
        o.push_str("## Analysis\n\n");
        o.push_str(report.analysis.trim_end());
        o.push_str("\n\n");
    }

    o.push_str("## Every load point\n\n");
    o.push_str(POINT_COLUMNS);
    o.push_str("\n\n");
    for (w, c) in &secs {
        let _ = writeln!(o, "### {} on {}\n", workload_title(w), cluster_title(c));
        if let Some(n) = report.nominal_of(w, c) {
            let _ = write!(o, "Nominal capacity {:.2} req/s.", n.capacity_rps);
        }
        if let Some(p) = report
            .plots
            .iter()
            .find(|p| &p.workload == w && &p.cluster == c)
        {
            let _ = write!(o, "\n\n![goodput vs offered load]({})", p.path);
        }
        o.push_str("\n\n");
        o.push_str(&points_table(&report.rows(w, c, None)));
        let read: usize = report
            .rows(w, c, Some(METRONOME))
            .iter()
            .filter(|r| r.prediction.is_none())
            .map(|r| r.decisions_read)
            .sum();
        if read > 0 {
            let _ = writeln!(
                o,
                "\n{read} Metronome decisions were read from the DECISIONS stream whose winner carried no `prediction`: their error is not measured."
            );
        }
        if let Some(p) = pooled_prediction(report, w, c) {
            let _ = writeln!(
                o,
                "\nMetronome prediction error pooled over loads ≤ 100 %: TTFT p50 {} p90 {} (n = {}), decode rate p50 {} p90 {} (n = {}).",
                pct(p.ttft.p50),
                pct(p.ttft.p90),
                p.ttft.n,
                pct(p.decode.p50),
                pct(p.decode.p90),
                p.decode.n
            );
        }
        o.push('\n');
    }

    o.push_str("## Burst: N simultaneous jobs on N idle GPUs\n\n");
    if report.burst.is_empty() {
        o.push_str("Not run.\n");
    } else {
        o.push_str(&burst_table(&report.burst));
    }
    if !report.overhead.is_empty() || report.max_sustained_rps.is_some() {
        o.push_str("\n## Overhead (zero-delay simulator)\n\n");
        let _ = writeln!(
            o,
            "Maximum sustained jobs/s through gateway → dispatcher → worker: **{}** req/s.\n",
            num(report.max_sustained_rps, 0)
        );
        if !report.ramp_overhead.is_empty() {
            o.push_str(&ramp_table(&report.ramp_overhead));
            o.push('\n');
        }
        o.push_str(&overhead_table(&report.overhead));
        o.push_str("\nAdded = percentile via Metronome minus the same percentile directly to the simulator, same system, same run, one after the other.\n\n");
        let _ = writeln!(
            o,
            "Dispatcher decisions/s with 64 workers: {}",
            report
                .dispatch_bench
                .clone()
                .unwrap_or_else(|| "not measured (see notes)".into())
        );
    } else {
        o.push_str("\nOverhead runs skipped (`--skip-overhead`).\n");
    }
    if !report.rss_kib.is_empty() {
        let _ = writeln!(
            o,
            "\n## Memory\n\nPeak RSS ({}), MiB: {}.",
            report.rss_under,
            rss_line(&report.rss_kib)
        );
    }
    if !report.rss_overhead_kib.is_empty() {
        let _ = writeln!(
            o,
            "\nPeak RSS of the zero-delay system during the overhead runs, MiB: {}.",
            rss_line(&report.rss_overhead_kib)
        );
    }
    if !report.notes.is_empty() {
        o.push_str("\n## Notes\n\n");
        for n in &report.notes {
            let _ = writeln!(o, "- {n}");
        }
    }
    if let Some(f) = extra {
        o.push('\n');
        o.push_str(f.trim_end());
        o.push('\n');
    }
    o
}

/// Peak RSS per process on one line: `dispatcher-a 15.2, gateway 104.2, …`.
fn rss_line(rows: &[(String, u64)]) -> String {
    rows.iter()
        .map(|(name, kib)| format!("{name} {:.1}", *kib as f64 / 1024.0))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prediction::ErrorStats;

    fn row(policy: &str, frac: f64, rate: f64, share: f64) -> RunRow {
        RunRow {
            policy: policy.into(),
            workload: "chat".into(),
            cluster: "equal".into(),
            load_frac: frac,
            rate_rps: rate,
            summary: Summary {
                count: 100,
                ok: 100,
                goodput_share: share,
                ..Summary::default()
            },
            goodput_rps: share * rate,
            preemptions: 0.0,
            prefix_hit_rate: None,
            idle: IdleStats {
                samples: 100,
                idle_gpu_s: 0.1,
                total_gpu_s: 100.0,
                share: 0.001,
                max_queued: 3.0,
            },
            prediction: None,
            decisions_read: 0,
            dir: format!("bench-results/equal/chat/{policy}/{:.0}", frac * 100.0),
        }
    }

    /// One policy's curve at 50, 100 and 150 % of a 10 req/s nominal capacity.
    fn curve(policy: &str, shares: &[f64]) -> Vec<RunRow> {
        let loads = [0.5, 1.0, 1.5];
        shares
            .iter()
            .zip(loads)
            .map(|(s, l)| row(policy, l, l * 10.0, *s))
            .collect()
    }

    fn report(m: &[f64], lc: &[f64], rr: &[f64]) -> Report {
        let mut runs = curve("metronome", m);
        runs.extend(curve("least_connections", lc));
        runs.extend(curve("round_robin", rr));
        Report {
            title_scale: "quick scale".into(),
            command: "metronome-bench --quick".into(),
            workloads: vec!["chat".into()],
            clusters: vec!["equal".into()],
            runs,
            ..Report::default()
        }
    }

    #[test]
    fn ratios_handle_zero_denominators() {
        assert_eq!(ratio(Some(1.0), Some(2.0)), Some(0.5));
        assert_eq!(ratio(Some(1.0), Some(0.0)), Some(f64::INFINITY));
        assert_eq!(ratio(Some(0.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }

    #[test]
    fn capacity_at_slo_comes_from_the_curve() {
        let r = report(&[1.0, 0.95, 0.5], &[0.95, 0.5, 0.2], &[0.9, 0.6, 0.1]);
        // metronome: 0.95 at 10 → 0.5 at 15: 10 + 0.05/0.45 × 5.
        match r.slo_capacity("chat", "equal", "metronome") {
            Some(SloCapacity::Interpolated(c)) => assert!((c - (10.0 + 5.0 / 9.0)).abs() < 1e-9),
            other => panic!("{other:?}"),
        }
        // least connections: 0.95 at 5 → 0.5 at 10: 5 + 0.05/0.45 × 5.
        let checks = target_checks(&r, "chat", "equal");
        assert_eq!(checks[0].met, Some(true), "{checks:?}");
        assert_eq!(checks[1].met, Some(true), "{checks:?}");
        assert!(checks[1].measured.contains("round_robin"), "{checks:?}");
    }

    #[test]
    fn share_and_overload_targets_are_judged_per_point() {
        // Metronome loses 0.03 at 50 %: the no-regression target is missed by 0.01.
        let r = report(&[0.92, 0.95, 0.6], &[0.95, 0.9, 0.4], &[0.9, 0.5, 0.1]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[2].met, Some(false), "{c:?}");
        assert_eq!(c[2].margin, "-0.010");
        // Two highest loads: ratios 0.95/0.9 = 1.06 at 100 %, 1.5 at 150 %: missed at 100 %.
        assert_eq!(c[3].met, Some(false), "{c:?}");
        assert!(c[3].measured.starts_with("worst at 100 %"), "{c:?}");
        // Idle 0.1 % everywhere: met.
        assert_eq!(c[4].met, Some(true));
        // No predictions: n/a, never met.
        assert_eq!(c[5].met, None);
        assert_eq!(c[6].met, None);
    }

    #[test]
    fn bounded_capacities_do_not_decide_the_ratio() {
        // Both ≥ 90 % everywhere: both only bounded below: n/a.
        let r = report(&[1.0, 1.0, 0.95], &[1.0, 0.95, 0.92], &[1.0, 1.0, 1.0]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[0].met, None, "{c:?}");
        assert_eq!(c[1].met, None, "{c:?}");
    }

    #[test]
    fn a_capacity_below_the_lowest_point_bounds_the_ratio() {
        // Metronome 0.95 at 5 → 0.5 at 10: 5.56 req/s. Least connections under 90 % at
        // 5 req/s: its capacity is below 5, so the ratio is above 1.11, which neither
        // proves nor refutes 1.3.
        let r = report(&[0.95, 0.5, 0.2], &[0.8, 0.5, 0.2], &[0.8, 0.5, 0.2]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[0].met, None, "{c:?}");
        assert!(c[0].measured.ends_with("ratio > 1.11"), "{c:?}");
        assert_eq!(c[0].margin, "–");
        // Metronome at 10.56 req/s against the same bound: above 2.11, met.
        let r = report(&[1.0, 0.95, 0.5], &[0.8, 0.5, 0.2], &[0.8, 0.5, 0.2]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[0].met, Some(true), "{c:?}");
        assert!(c[0].measured.ends_with("ratio > 2.11"), "{c:?}");
        assert_eq!(c[0].margin, "≥ +0.81×");
        // Metronome below its lowest point, least connections at 5.56: under 0.90, missed,
        // and no hint (lower loads would not change the verdict).
        let r = report(&[0.8, 0.5, 0.2], &[0.95, 0.5, 0.2], &[0.8, 0.5, 0.2]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[0].met, Some(false), "{c:?}");
        assert!(c[0].measured.ends_with("ratio < 0.90"), "{c:?}");
        assert_eq!(c[0].margin, "< -0.40×");
        // Both below their lowest point: nothing decided, and the report says what would.
        let r = report(&[0.8, 0.5, 0.2], &[0.7, 0.5, 0.2], &[0.8, 0.5, 0.2]);
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[0].met, None, "{c:?}");
        assert!(
            c[0].measured.contains("ratio – (Metronome under 90 %"),
            "{c:?}"
        );
    }

    #[test]
    fn the_other_baseline_that_decides_is_shown_not_the_highest_number() {
        // Metronome and round robin both 5.56 req/s (ratio 1.00, met); random below its
        // lowest point (< 5: ratio > 1.11, met): the lower ratio, round robin's, is shown.
        // Then power of two, ≥ 90 % everywhere (≥ 15: ratio ≤ 0.37), a miss that decides.
        let mut r = report(&[0.95, 0.5, 0.2], &[0.8, 0.5, 0.2], &[0.95, 0.5, 0.2]);
        r.runs.extend(curve("random", &[0.8, 0.5, 0.2]));
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[1].met, Some(true), "{c:?}");
        assert!(c[1].measured.contains("(round_robin)"), "{c:?}");
        r.runs.extend(curve("power_of_two", &[1.0, 0.95, 0.91]));
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[1].met, Some(false), "{c:?}");
        assert!(c[1].measured.contains("≥ 15.00 (power_of_two)"), "{c:?}");
        // Random is the only other one: a bound, not 0, so the ratio is a bound (> 1.11).
        r.runs
            .retain(|x| x.policy != "round_robin" && x.policy != "power_of_two");
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[1].met, Some(true), "{c:?}");
        assert!(
            c[1].measured.ends_with("(random) req/s: ratio > 1.11"),
            "{c:?}"
        );
    }

    #[test]
    fn prediction_error_is_pooled_up_to_nominal_capacity() {
        let mut r = report(&[1.0, 0.95, 0.5], &[0.95, 0.5, 0.2], &[0.9, 0.6, 0.1]);
        for run in r.runs.iter_mut().filter(|x| x.policy == "metronome") {
            let e = if run.load_frac > 1.0 { 0.9 } else { 0.1 };
            run.prediction = Some(PredictionErrors {
                predicted_jobs: 2,
                ttft: ErrorStats::of(&[e, e]),
                decode: ErrorStats::of(&[e, e]),
                ttft_errors: vec![e, e],
                decode_errors: vec![e, e],
            });
        }
        let p = pooled_prediction(&r, "chat", "equal").unwrap();
        assert_eq!(p.ttft.n, 4);
        assert_eq!(p.ttft.p50, Some(0.1));
        let c = target_checks(&r, "chat", "equal");
        assert_eq!(c[5].met, Some(true), "{c:?}");
        assert_eq!(c[5].margin, "+5.0 pp");
    }

    #[test]
    fn report_renders_every_section_with_figures() {
        let mut r = report(&[1.0, 0.95, 0.5], &[0.95, 0.5, 0.2], &[0.9, 0.6, 0.1]);
        r.nominal = vec![NominalRow {
            workload: "chat".into(),
            cluster: "equal".into(),
            speeds: vec![1.0; 4],
            nominal: Nominal {
                mean_prompt: 1000.0,
                mean_output: 200.0,
                batch: 33,
                step_ms: 26.77,
                t_req_s: 0.322,
                speed_sum: 4.0,
                capacity_rps: 10.0,
            },
        }];
        r.plots = vec![PlotRef {
            workload: "chat".into(),
            cluster: "equal".into(),
            path: "bench-results/equal/chat/goodput.svg".into(),
        }];
        r.burst = vec![BurstRow {
            cluster: "mixed".into(),
            policy: "metronome".into(),
            rounds: 20,
            distinct_rounds: 19,
            failed_rounds: 0,
            examples: vec!["g0 g0 g1 g2".into()],
        }];
        let md = render(&r, Some("## Fairness\n\nsaved section\n"));
        assert!(md.contains("# Metronome benchmarks (quick scale)"));
        assert!(
            md.trim_end().ends_with("## Fairness\n\nsaved section"),
            "{md}"
        );
        assert!(
            md.contains(
                "| chat | equal (1, 1, 1, 1) | 1000 | 200 | 33 | 26.77 | 0.322 | **10.00** |"
            ),
            "{md}"
        );
        assert!(md.contains("### chat-like Poisson on 4 equal GPUs"), "{md}");
        assert!(
            md.contains("| capacity at SLO vs least connections | ≥ 1.3× |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| chat, equal | **metronome** | 10.56 | – | 9.50 (100 %) | 100 % (10.00 req/s) |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| 150 % | 15.00 | metronome | 100 | 50.0 % | 7.50 |"),
            "{md}"
        );
        assert!(md.contains("![goodput vs offered load](bench-results/equal/chat/goodput.svg)"));
        assert!(
            md.contains("| mixed | metronome | 20 | 19 | 95 % | 0 | `g0 g0 g1 g2` |"),
            "{md}"
        );
        assert!(md.contains(
            "Burst (4 mixed GPUs (1, 1, 1, 0.5)): metronome put one job per GPU in 19 of 20"
        ));
        assert!(md.contains("Overhead runs skipped"));
    }

    /// The headline's fixture: TTFT p90 and tok/s p1 per point, so the same-load columns
    /// have figures to show.
    fn with_latency(mut r: Report) -> Report {
        for run in &mut r.runs {
            let k = match run.policy.as_str() {
                "metronome" => 1.0,
                "least_connections" => 2.0,
                _ => 3.0,
            };
            run.summary.ttft_ms.p90 = Some(100.0 * k * run.load_frac * 10.0);
            run.summary.tokens_per_s.p1 = Some(60.0 / k);
        }
        r
    }

    #[test]
    fn the_headline_compares_every_policy_at_metronomes_last_point_within_the_slo() {
        // Metronome 1.0 / 0.95 / 0.5 at 5 / 10 / 15 req/s: its last point ≥ 90 % is 100 %.
        let r = with_latency(report(
            &[1.0, 0.95, 0.5],
            &[0.95, 0.5, 0.2],
            &[0.9, 0.6, 0.1],
        ));
        assert_eq!(
            headline_load(&r, "chat", "equal").map(|p| p.load_frac),
            Some(1.0)
        );
        let rows = headline_rows(&r, "chat", "equal");
        let names: Vec<&str> = rows.iter().map(|h| h.policy.as_str()).collect();
        assert_eq!(names, ["metronome", "least_connections", "round_robin"]);
        // Metronome 10.56 req/s against least connections' 5.56: 1.90; Metronome has no
        // ratio to itself.
        assert_eq!(rows[0].ratio, None);
        assert_eq!(rows[1].ratio.map(|x| x.display()), Some("1.90".into()));
        // Peak goodput: 0.95 × 10 = 9.50 at 100 % for Metronome; 0.5 × 10 = 5.00 at 100 %
        // for least connections (above its 0.95 × 5 at 50 %).
        let peak = |h: &HeadlineRow| h.peak_goodput.map(|(g, l)| format!("{g:.2} at {l}"));
        assert_eq!(peak(&rows[0]).as_deref(), Some("9.50 at 1"));
        assert_eq!(peak(&rows[1]).as_deref(), Some("5.00 at 1"));
        // The same offered rate for all: 100 %.
        assert_eq!(rows[1].ttft_p90_ms, Some(2000.0));
        assert_eq!(rows[2].tok_s_p1, Some(20.0));

        let table = headline_table(&r);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + 3, "{table}");
        assert_eq!(
            lines[2],
            "| chat, equal | **metronome** | 10.56 | – | 9.50 (100 %) | 100 % (10.00 req/s) | 1000 | 60.0 |"
        );
        assert_eq!(
            lines[3],
            "|  | least_connections | 5.56 | 1.90 | 5.00 (100 %) |  | 2000 | 30.0 |"
        );
    }

    #[test]
    fn the_headline_shows_bounds_and_gaps_as_such() {
        // Metronome never reaches 90 %: no common load, no latency columns, and a ratio
        // against least connections (also below its lowest point) that decides nothing.
        let mut r = with_latency(report(
            &[0.8, 0.5, 0.2],
            &[0.7, 0.5, 0.2],
            &[0.95, 0.9, 0.5],
        ));
        assert!(headline_load(&r, "chat", "equal").is_none());
        let table = headline_table(&r);
        assert!(
            table.contains(
                "| chat, equal | **metronome** | < 5.00 | – | 5.00 (100 %) | none | – | – |"
            ),
            "{table}"
        );
        assert!(
            table.contains("| least_connections | < 5.00 | – |"),
            "{table}"
        );
        // Round robin at ≥ 90 % up to 10 req/s, 0.5 at 15: 10 + 0 × 5 = 10.00; Metronome
        // below 5: the ratio is a bound, < 0.50.
        assert!(
            table.contains("| round_robin | 10.00 | < 0.50 |"),
            "{table}"
        );
        // A policy without the common load point shows no latency rather than another load's.
        r = with_latency(report(
            &[1.0, 0.95, 0.5],
            &[0.95, 0.5, 0.2],
            &[0.9, 0.6, 0.1],
        ));
        r.runs
            .retain(|x| !(x.policy == "round_robin" && same(x.load_frac, 1.0)));
        let rows = headline_rows(&r, "chat", "equal");
        assert_eq!((rows[2].ttft_p90_ms, rows[2].tok_s_p1), (None, None));
    }

    #[test]
    fn the_headline_opens_the_document_within_one_screen() {
        let mut r = with_latency(report(
            &[1.0, 0.95, 0.5],
            &[0.95, 0.5, 0.2],
            &[0.9, 0.6, 0.1],
        ));
        r.machine = vec![
            ("CPU".into(), "Some CPU".into()),
            ("cores (nproc)".into(), "2".into()),
            ("note".into(), "shared".into()),
        ];
        r.reproduce = "target/release/metronome-bench --quick".into();
        let md = render(&r, None);
        let headline = md.find("## Headline").expect("a headline");
        let setup = md.find("## Setup").expect("a setup section");
        assert!(headline < setup, "{md}");
        let screen: Vec<&str> = md.lines().take(50).collect();
        let screen = screen.join("\n");
        for must in [
            "| chat, equal | **metronome** |",
            "|  | round_robin |",
            "Targets met",
            "Machine: CPU Some CPU, cores (nproc) 2;",
            "target/release/metronome-bench --quick\n",
            "target/release/metronome-bench --render bench-results/report.json",
        ] {
            assert!(
                screen.contains(must),
                "{must:?} not in the first screen:\n{screen}"
            );
        }
        assert!(
            !md.contains("shared"),
            "the machine's note is said in words: {md}"
        );
    }

    #[test]
    fn the_reproducing_command_names_only_what_differs_from_a_full_run() {
        let defaults = RunDefaults {
            policies: &["metronome", "least_connections", "round_robin"],
            workloads: &["chat"],
            clusters: &["equal"],
            loads: &[0.5, 1.0, 1.5],
            requests: 100,
            burst_rounds: 0,
        };
        let mut r = report(&[1.0, 0.95, 0.5], &[0.95, 0.5, 0.2], &[0.9, 0.6, 0.1]);
        r.max_sustained_rps = Some(100.0);
        assert_eq!(
            reproduce_command(&r, &defaults),
            "target/release/metronome-bench"
        );
        // A merged light point, another request count, burst rounds, no overhead runs.
        r.runs.push(row("metronome", 0.05, 0.5, 1.0));
        r.runs.iter_mut().for_each(|x| x.summary.count = 300);
        r.burst = vec![BurstRow {
            cluster: "equal".into(),
            policy: "metronome".into(),
            rounds: 20,
            distinct_rounds: 20,
            failed_rounds: 0,
            examples: vec![],
        }];
        r.max_sustained_rps = None;
        r.runs.retain(|x| x.policy != "round_robin");
        assert_eq!(
            reproduce_command(&r, &defaults),
            "target/release/metronome-bench --policies metronome,least_connections --loads 0.05,0.5,1,1.5 --requests 300 --burst-rounds 20 --skip-overhead"
        );
    }
}
