//! The benchmark report: result rows, the ratios against least connections that the
//! targets are judged by, and their rendering as Markdown (`BENCHMARKS.md`).
//!
//! Pure: no I/O, no clock. Every figure printed comes from a [`Summary`] or a measured
//! value held in [`Report`], so the document is a function of the run's data. A ratio with
//! a zero denominator is rendered as `∞` (or `n/a` when both sides are zero) rather than
//! hidden.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::Summary;

/// One load run of one policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRow {
    pub policy: String,
    /// e.g. `trace` or `poisson`.
    pub workload: String,
    /// Share of the measured capacity offered (0.7 = 70 %).
    pub load_frac: f64,
    /// Planned mean arrival rate, requests/s.
    pub rate_rps: f64,
    pub summary: Summary,
    /// `vllm:num_preemptions_total` summed over the simulated GPUs, after minus before.
    pub preemptions: f64,
    /// Folder of the run's CSV, summary and plots, relative to the report.
    pub dir: String,
}

/// The burst case for one policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BurstRow {
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

/// One measured step of a capacity search.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RampStep {
    pub rate_rps: f64,
    pub kept_up: bool,
    pub completion_rps: f64,
    pub ok: usize,
    pub count: usize,
}

/// Everything the report shows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub title_scale: String,
    pub command: String,
    pub date_utc: String,
    pub machine: Vec<(String, String)>,
    pub setup: Vec<String>,
    pub capacity_trace_rps: Option<f64>,
    pub capacity_poisson_rps: Option<f64>,
    pub ramp_trace: Vec<RampStep>,
    pub ramp_poisson: Vec<RampStep>,
    pub runs: Vec<RunRow>,
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
}

/// The four predictability targets, judged at one workload and load.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetCheck {
    pub name: &'static str,
    pub metronome: Option<f64>,
    pub baseline: Option<f64>,
    /// `metronome / baseline`.
    pub ratio: Option<f64>,
    /// `>= 1.5` or `<= 0.5` etc.
    pub target: &'static str,
    pub met: Option<bool>,
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

fn check(
    name: &'static str,
    m: Option<f64>,
    b: Option<f64>,
    target: &'static str,
    at_least: Option<f64>,
    at_most: Option<f64>,
) -> TargetCheck {
    let r = ratio(m, b);
    let met = r.map(|r| at_least.is_none_or(|x| r >= x) && at_most.is_none_or(|x| r <= x));
    TargetCheck {
        name,
        metronome: m,
        baseline: b,
        ratio: r,
        target,
        met,
    }
}

/// The issue's targets: Metronome against the baseline (least connections).
pub fn target_checks(m: &Summary, b: &Summary) -> Vec<TargetCheck> {
    vec![
        check(
            "goodput (share meeting the SLO)",
            Some(m.goodput_share),
            Some(b.goodput_share),
            ">= 1.5",
            Some(1.5),
            None,
        ),
        check(
            "CV of per-request tok/s",
            m.tokens_per_s.cv,
            b.tokens_per_s.cv,
            "<= 0.5",
            None,
            Some(0.5),
        ),
        check(
            "p1 tok/s",
            m.tokens_per_s.p1,
            b.tokens_per_s.p1,
            ">= 1.5",
            Some(1.5),
            None,
        ),
        check(
            "p99 e2e latency",
            m.e2e_ms.p99,
            b.e2e_ms.p99,
            "<= 0.7",
            None,
            Some(0.7),
        ),
    ]
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

/// The per-policy table of one workload.
pub fn runs_table(rows: &[&RunRow]) -> String {
    let mut out = String::from(
        "| policy | load | rate (req/s) | requests | goodput | tok/s p1 | p5 | p50 | CV | TTFT p50 (ms) | TTFT p99 | e2e p50 (ms) | e2e p99 | preemptions | errors | plots |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let s = &r.summary;
        let _ = writeln!(
            out,
            "| {} | {:.0} % | {:.2} | {} | {:.1} % | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | [cdf]({}/tokens_per_s_cdf.svg) [time]({}/latency_over_time.svg) |",
            r.policy,
            r.load_frac * 100.0,
            r.rate_rps,
            s.count,
            s.goodput_share * 100.0,
            num(s.tokens_per_s.p1, 1),
            num(s.tokens_per_s.p5, 1),
            num(s.tokens_per_s.p50, 1),
            num(s.tokens_per_s.cv, 2),
            ms(s.ttft_ms.p50),
            ms(s.ttft_ms.p99),
            ms(s.e2e_ms.p50),
            ms(s.e2e_ms.p99),
            r.preemptions,
            s.errors,
            r.dir,
            r.dir,
        );
    }
    out
}

/// The target table: Metronome against least connections.
pub fn targets_table(checks: &[TargetCheck]) -> String {
    let mut out = String::from(
        "| target | metronome | least connections | ratio | wanted | met |\n|---|---|---|---|---|---|\n",
    );
    for c in checks {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            c.name,
            num(c.metronome, 3),
            num(c.baseline, 3),
            num(c.ratio, 2),
            c.target,
            match c.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "n/a",
            }
        );
    }
    out
}

/// The burst table.
pub fn burst_table(rows: &[BurstRow]) -> String {
    let mut out = String::from(
        "| policy | rounds | one job per GPU | share | rounds with errors | workers of the first rounds that doubled up |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let share = if r.rounds == 0 {
            0.0
        } else {
            r.distinct_rounds as f64 / r.rounds as f64 * 100.0
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} % | {} | {} |",
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

fn find<'a>(runs: &'a [RunRow], policy: &str, workload: &str, frac: f64) -> Option<&'a RunRow> {
    runs.iter()
        .find(|r| r.policy == policy && r.workload == workload && (r.load_frac - frac).abs() < 1e-9)
}

/// The target checks for one workload at one load, when both policies ran.
pub fn checks_for(report: &Report, workload: &str, frac: f64) -> Option<Vec<TargetCheck>> {
    let m = find(&report.runs, "metronome", workload, frac)?;
    let b = find(&report.runs, "least_connections", workload, frac)?;
    Some(target_checks(&m.summary, &b.summary))
}

/// The whole `BENCHMARKS.md`.
pub fn render(report: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Metronome benchmarks ({})\n", report.title_scale);
    let _ = writeln!(
        o,
        "Generated by `metronome-bench` on {}.\n",
        report.date_utc
    );
    let _ = writeln!(o, "Command:\n\n```sh\n{}\n```\n", report.command);
    o.push_str("How to run, what each figure means and how the simulator is calibrated: [docs/BENCHMARKING.md](docs/BENCHMARKING.md).\n\n");
    o.push_str("## Machine\n\n| | |\n|---|---|\n");
    for (k, v) in &report.machine {
        let _ = writeln!(o, "| {k} | {v} |");
    }
    o.push_str("\n## Setup\n\n");
    for s in &report.setup {
        let _ = writeln!(o, "- {s}");
    }
    o.push_str("\n## Targets (trace at 70 % of capacity, same run)\n\n");
    match checks_for(report, "trace", 0.7) {
        Some(c) => o.push_str(&targets_table(&c)),
        None => o.push_str(
            "Not measured in this run (needs metronome and least_connections at 70 %).\n",
        ),
    }
    if let Some(c) = checks_for(report, "poisson", 0.7) {
        o.push_str("\nThe same targets on the synthetic Poisson workload (70 %, different length distribution):\n\n");
        o.push_str(&targets_table(&c));
    }
    if let Some(b) = report.burst.iter().find(|b| b.policy == "metronome") {
        let _ = writeln!(
            o,
            "\nBurst: metronome put one job per GPU in {} of {} rounds (target: all).",
            b.distinct_rounds, b.rounds
        );
    }
    o.push_str("\n## Analysis\n\n");
    o.push_str(&report.analysis);
    o.push_str("\n\n## Capacity\n\n");
    let _ = writeln!(
        o,
        "Trace workload: **{} req/s**; Poisson workload: **{} req/s** (policy metronome; definition in docs/BENCHMARKING.md).\n",
        num(report.capacity_trace_rps, 2),
        num(report.capacity_poisson_rps, 2)
    );
    if !report.ramp_trace.is_empty() {
        o.push_str("Trace ramp:\n\n");
        o.push_str(&ramp_table(&report.ramp_trace));
    }
    if !report.ramp_poisson.is_empty() {
        o.push_str("\nPoisson ramp:\n\n");
        o.push_str(&ramp_table(&report.ramp_poisson));
    }
    for (workload, title) in [
        ("trace", "Trace replay (Azure LLM 2023, code)"),
        (
            "poisson",
            "Synthetic Poisson (different length distribution)",
        ),
    ] {
        let rows: Vec<&RunRow> = report
            .runs
            .iter()
            .filter(|r| r.workload == workload)
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(o, "\n## {title}\n");
        o.push_str("Goodput = share of all requests with TTFT ≤ 2 s and ≥ 30 tok/s. tok/s is per request (tokens after the first / time after the first). Latencies in ms.\n\n");
        o.push_str(&runs_table(&rows));
    }
    o.push_str("\n## Burst: N simultaneous jobs on N idle GPUs\n\n");
    o.push_str(&burst_table(&report.burst));
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
        "Dispatcher decisions/s with 64 workers: {}\n",
        report
            .dispatch_bench
            .clone()
            .unwrap_or_else(|| "not measured (see notes)".into())
    );
    let _ = writeln!(o, "## Memory\n\nPeak RSS ({}):\n", report.rss_under);
    o.push_str(&rss_table(&report.rss_kib));
    if !report.rss_overhead_kib.is_empty() {
        o.push_str("\nPeak RSS of the zero-delay system during the overhead runs:\n\n");
        o.push_str(&rss_table(&report.rss_overhead_kib));
    }
    if !report.notes.is_empty() {
        o.push_str("\n## Notes\n\n");
        for n in &report.notes {
            let _ = writeln!(o, "- {n}");
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::Dist;

    fn s(goodput: f64, cv: f64, p1: f64, p99: f64) -> Summary {
        Summary {
            count: 100,
            ok: 100,
            goodput_share: goodput,
            tokens_per_s: Dist {
                cv: Some(cv),
                p1: Some(p1),
                ..Dist::default()
            },
            e2e_ms: Dist {
                p99: Some(p99),
                ..Dist::default()
            },
            ..Summary::default()
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
    fn targets_are_judged_in_the_right_direction() {
        let m = s(0.9, 0.1, 45.0, 1000.0);
        let b = s(0.5, 0.4, 20.0, 2000.0);
        let c = target_checks(&m, &b);
        assert_eq!(c.len(), 4);
        assert!(c.iter().all(|c| c.met == Some(true)), "{c:?}");
        // Swapped: every target missed.
        let c = target_checks(&b, &m);
        assert!(c.iter().all(|c| c.met == Some(false)), "{c:?}");
        // Exactly on the boundary counts as met.
        let c = target_checks(&s(0.75, 0.2, 30.0, 700.0), &s(0.5, 0.4, 20.0, 1000.0));
        assert!(c.iter().all(|c| c.met == Some(true)), "{c:?}");
    }

    #[test]
    fn baseline_with_no_good_requests_is_an_infinite_ratio() {
        let c = target_checks(&s(0.5, 0.1, 10.0, 1.0), &s(0.0, 0.3, 0.0, 2.0));
        assert_eq!(c[0].ratio, Some(f64::INFINITY));
        assert_eq!(c[0].met, Some(true));
        assert!(targets_table(&c).contains("∞"));
    }

    #[test]
    fn report_renders_every_section_with_figures() {
        let row = |policy: &str, g: f64| RunRow {
            policy: policy.into(),
            workload: "trace".into(),
            load_frac: 0.7,
            rate_rps: 5.25,
            summary: s(g, 0.2, 40.0, 1500.0),
            preemptions: 3.0,
            dir: format!("bench-results/{policy}/trace-70"),
        };
        let report = Report {
            title_scale: "quick scale".into(),
            command: "metronome-bench --quick".into(),
            date_utc: "2026-01-01".into(),
            machine: vec![("cores".into(), "2".into())],
            capacity_trace_rps: Some(7.5),
            runs: vec![row("metronome", 0.9), row("least_connections", 0.5)],
            burst: vec![BurstRow {
                policy: "metronome".into(),
                rounds: 20,
                distinct_rounds: 20,
                failed_rounds: 0,
                examples: Vec::new(),
            }],
            overhead: vec![OverheadRow {
                rate_rps: 500.0,
                direct: Summary {
                    e2e_ms: Dist {
                        p50: Some(1.0),
                        p99: Some(2.0),
                        ..Dist::default()
                    },
                    ..Summary::default()
                },
                gateway: Summary {
                    e2e_ms: Dist {
                        p50: Some(2.5),
                        p99: Some(6.0),
                        ..Dist::default()
                    },
                    ..Summary::default()
                },
            }],
            rss_kib: vec![("gateway".into(), 20480)],
            ..Report::default()
        };
        let md = render(&report);
        assert!(md.contains("# Metronome benchmarks (quick scale)"));
        assert!(
            md.contains(
                "| goodput (share meeting the SLO) | 0.900 | 0.500 | 1.80 | >= 1.5 | yes |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| metronome | 70 % | 5.25 | 100 | 90.0 % |"),
            "{md}"
        );
        assert!(
            md.contains("| metronome | 20 | 20 | 100 % | 0 |  |"),
            "{md}"
        );
        assert!(
            md.contains("| 500 | 1.00 | 2.00 | 2.50 | 6.00 | 1.50 | 4.00 |"),
            "{md}"
        );
        assert!(md.contains("| gateway | 20.0 |"));
        assert!(md.contains("7.50 req/s"));
    }
}
