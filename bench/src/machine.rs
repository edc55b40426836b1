//! Facts about the run that make a benchmark reproducible and comparable: the machine
//! (cores, memory, CPU model, kernel), the commit, the date; and the factual part of the
//! analysis (which target was met or missed, by how much), derived from the report.

use std::fmt::Write as _;
use std::path::Path;

use super::report::{cluster_title, sections, target_checks, workload_title, Report, METRONOME};

fn command_line(program: &str, args: &[&str], dir: &Path) -> Option<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The current UTC date and time, e.g. `2026-11-29 13:30 UTC`.
pub fn date_utc() -> String {
    command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"], Path::new("."))
        .unwrap_or_else(|| "unknown date".into())
}

/// Rows of the machine table.
pub fn describe(repo: &Path) -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0))
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let commit = command_line("git", &["rev-parse", "--short", "HEAD"], repo)
        .unwrap_or_else(|| "unknown".into());
    vec![
        ("CPU".into(), model),
        ("cores (nproc)".into(), cores),
        ("memory".into(), mem),
        ("kernel".into(), kernel),
        ("commit".into(), commit),
        (
            "note".into(),
            "every process (NATS, Redis, 2 dispatchers, gateway, 4 worker-agents, the simulator, the load generator) shares these cores".into(),
        ),
    ]
}

/// Which targets were met or missed and by how much, from the report's own figures.
pub fn auto_analysis(report: &Report) -> String {
    let mut o = String::new();
    for (w, c) in sections(report) {
        let checks = target_checks(report, &w, &c);
        let met = checks.iter().filter(|c| c.met == Some(true)).count();
        let missed: Vec<_> = checks.iter().filter(|c| c.met == Some(false)).collect();
        let undecided = checks.iter().filter(|c| c.met.is_none()).count();
        let _ = writeln!(
            o,
            "- {} on {}: {met} of {} targets met, {} missed, {undecided} not decidable from this run.",
            workload_title(&w),
            cluster_title(&c),
            checks.len(),
            missed.len()
        );
        for m in missed {
            let _ = writeln!(
                o,
                "  - missed: {} ({}; margin {}).",
                m.name, m.measured, m.margin
            );
        }
    }
    for b in report.burst.iter().filter(|b| b.policy == METRONOME) {
        let _ = writeln!(
            o,
            "- Burst on {}: {} of {} rounds one job per GPU ({}).",
            cluster_title(&b.cluster),
            b.distinct_rounds,
            b.rounds,
            if b.distinct_rounds == b.rounds {
                "met"
            } else {
                "**missed**"
            }
        );
    }
    if let Some(r) = report
        .overhead
        .iter()
        .find(|r| (r.rate_rps - 500.0).abs() < 1e-9)
    {
        if let (Some(g50), Some(d50), Some(g99), Some(d99)) = (
            r.gateway.e2e_ms.p50,
            r.direct.e2e_ms.p50,
            r.gateway.e2e_ms.p99,
            r.direct.e2e_ms.p99,
        ) {
            let _ = writeln!(
                o,
                "- Added latency at 500 req/s: p50 {:.2} ms (wanted ≤ 2), p99 {:.2} ms (wanted ≤ 5).",
                g50 - d50,
                g99 - d99
            );
        }
    }
    o
}
