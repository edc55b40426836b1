//! Merging the load points of several bench runs into one report: a curve whose decisive
//! points take hours (a bursty trace at 5 % of nominal capacity is 550 s a point) is
//! measured in a run of its own, and its points join the full run's curves instead of
//! living in a second report; a point measured again with a newer build can replace the
//! earlier one. Every merged point keeps its own run's figures; the report
//! says which run (date, commit) each came from. Pure: reading and writing files is the
//! caller's.

use anyhow::bail;

use super::report::{Report, RunRow};

/// What a point measured twice (the same policy, workload, cluster and load) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Twice {
    /// Refused: two figures for one point, and no saying which the report shows.
    Refuse,
    /// The later run's point replaces the earlier (a point measured again with a newer
    /// build); the later run's note names the points it replaced.
    LaterReplaces,
}

/// `extras` merged into `base`, in order, each with the name errors cite it by (its
/// `report.json` path; the report itself cites a run by its date and commit). Refused: a point measured twice unless `twice` lets the later one
/// replace it, or a workload × cluster whose nominal capacity differs between runs (other
/// requests, other speeds: its loads would not be the same rates).
pub fn merge_reports(
    mut base: Report,
    extras: Vec<(String, Report)>,
    twice: Twice,
) -> anyhow::Result<Report> {
    for (name, extra) in extras {
        for row in &extra.nominal {
            match base
                .nominal
                .iter()
                .find(|n| n.workload == row.workload && n.cluster == row.cluster)
            {
                Some(n) if (n.nominal.capacity_rps - row.nominal.capacity_rps).abs() > 1e-9 => bail!(
                    "{name}: {} on {} has a nominal capacity of {:.4} req/s, {:.4} in the base run: not the same rates",
                    row.workload,
                    row.cluster,
                    row.nominal.capacity_rps,
                    n.nominal.capacity_rps
                ),
                Some(_) => {}
                None => base.nominal.push(row.clone()),
            }
        }
        let mut replaced = Vec::new();
        for run in &extra.runs {
            let same_point = |r: &RunRow| {
                r.policy == run.policy
                    && r.workload == run.workload
                    && r.cluster == run.cluster
                    && (r.load_frac - run.load_frac).abs() < 1e-9
            };
            let Some(i) = base.runs.iter().position(same_point) else {
                continue;
            };
            if twice == Twice::Refuse {
                bail!(
                    "{name}: {}/{}/{} at {:.0} % is already in the base run",
                    run.cluster,
                    run.workload,
                    run.policy,
                    run.load_frac * 100.0
                );
            }
            replaced.push(base.runs.remove(i));
        }
        for w in &extra.workloads {
            if !base.workloads.contains(w) {
                base.workloads.push(w.clone());
            }
        }
        for c in &extra.clusters {
            if !base.clusters.contains(c) {
                base.clusters.push(c.clone());
            }
        }
        let mut note = merged_note(&extra);
        if !replaced.is_empty() {
            note.push_str(&format!(
                " These replace the points measured before: {}.",
                point_list(&replaced)
            ));
        }
        base.notes.push(note);
        base.command.push_str(&format!(
            "\n# merged, a run of {} (commit {}):\n{}",
            extra.date_utc,
            commit_of(&extra),
            extra.command
        ));
        base.runs.extend(extra.runs);
    }
    Ok(base)
}

/// The commit a run was built from, as its machine table says.
fn commit_of(report: &Report) -> &str {
    report
        .machine
        .iter()
        .find(|(k, _)| k == "commit")
        .map_or("unknown", |(_, v)| v.as_str())
}

/// "Load points from a run of DATE, commit C (…): …" listing its points.
fn merged_note(extra: &Report) -> String {
    format!(
        "Load points from a run of {}, commit {} (its own system per policy and cluster): {}.",
        extra.date_utc,
        commit_of(extra),
        point_list(&extra.runs)
    )
}

/// "equal/trace/metronome at 5 %, 10 %; …": the points, grouped by curve in first-seen order.
fn point_list(runs: &[RunRow]) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for r in runs {
        let key = format!("{}/{}/{}", r.cluster, r.workload, r.policy);
        let load = format!("{:.0} %", r.load_frac * 100.0);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, loads)) => loads.push(load),
            None => groups.push((key, vec![load])),
        }
    }
    groups
        .into_iter()
        .map(|(k, loads)| format!("{k} at {}", loads.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idle::IdleStats;
    use crate::nominal::Nominal;
    use crate::report::NominalRow;
    use metronome_loadgen::summary::Summary;

    fn run(policy: &str, load: f64) -> RunRow {
        RunRow {
            policy: policy.into(),
            workload: "trace".into(),
            cluster: "equal".into(),
            load_frac: load,
            rate_rps: load * 10.0,
            summary: Summary::default(),
            goodput_rps: 0.0,
            preemptions: 0.0,
            prefix_hit_rate: None,
            idle: IdleStats::default(),
            prediction: None,
            decisions_read: 0,
            dir: String::new(),
        }
    }

    fn report(loads: &[f64], capacity: f64, commit: &str) -> Report {
        Report {
            date_utc: format!("day of {commit}"),
            command: format!("bench at {commit}"),
            machine: vec![("commit".into(), commit.into())],
            workloads: vec!["trace".into()],
            clusters: vec!["equal".into()],
            nominal: vec![NominalRow {
                workload: "trace".into(),
                cluster: "equal".into(),
                speeds: vec![1.0; 4],
                nominal: Nominal {
                    mean_prompt: 2092.0,
                    mean_output: 24.0,
                    batch: 18,
                    step_ms: 24.46,
                    t_req_s: 0.367,
                    speed_sum: 4.0,
                    capacity_rps: capacity,
                },
            }],
            runs: loads
                .iter()
                .flat_map(|&l| [run("metronome", l), run("least_connections", l)])
                .collect(),
            ..Report::default()
        }
    }

    #[test]
    fn light_load_points_join_the_curves_and_say_where_they_came_from() {
        let merged = merge_reports(
            report(&[0.3, 0.5], 10.9, "aaa"),
            vec![(
                "light/report.json".into(),
                report(&[0.05, 0.1], 10.9, "bbb"),
            )],
            Twice::Refuse,
        )
        .unwrap();
        let loads: Vec<f64> = merged
            .rows("trace", "equal", Some("metronome"))
            .iter()
            .map(|r| r.load_frac)
            .collect();
        assert_eq!(loads, vec![0.05, 0.1, 0.3, 0.5]);
        assert_eq!(merged.nominal.len(), 1);
        assert_eq!(
            merged.notes,
            vec!["Load points from a run of day of bbb, commit bbb (its own system per policy and cluster): equal/trace/metronome at 5 %, 10 %; equal/trace/least_connections at 5 %, 10 %.".to_string()]
        );
        assert!(merged
            .command
            .ends_with("# merged, a run of day of bbb (commit bbb):\nbench at bbb"));
        assert!(
            !merged.notes[0].contains("light/report.json"),
            "no file path in the report"
        );
    }

    #[test]
    fn a_point_measured_twice_or_other_rates_are_refused() {
        let twice = merge_reports(
            report(&[0.3, 0.5], 10.9, "aaa"),
            vec![("again.json".into(), report(&[0.5], 10.9, "bbb"))],
            Twice::Refuse,
        );
        let e = twice.unwrap_err().to_string();
        assert!(
            e.contains("equal/trace/metronome at 50 % is already"),
            "{e}"
        );
        let other = merge_reports(
            report(&[0.3], 10.9, "aaa"),
            vec![("other.json".into(), report(&[0.05], 9.5, "bbb"))],
            Twice::LaterReplaces,
        );
        let e = other.unwrap_err().to_string();
        assert!(e.contains("not the same rates"), "{e}");
    }

    #[test]
    fn a_point_measured_again_replaces_the_earlier_one_and_the_note_says_so() {
        let mut again = report(&[0.05, 0.3], 10.9, "ccc");
        again.runs.retain(|r| r.policy == "metronome");
        for r in &mut again.runs {
            r.goodput_rps = 1.0;
        }
        let merged = merge_reports(
            report(&[0.05, 0.3, 0.5], 10.9, "aaa"),
            vec![("again/report.json".into(), again)],
            Twice::LaterReplaces,
        )
        .unwrap();
        let metronome: Vec<(f64, f64)> = merged
            .rows("trace", "equal", Some("metronome"))
            .iter()
            .map(|r| (r.load_frac, r.goodput_rps))
            .collect();
        assert_eq!(metronome, vec![(0.05, 1.0), (0.3, 1.0), (0.5, 0.0)]);
        assert_eq!(
            merged
                .rows("trace", "equal", Some("least_connections"))
                .len(),
            3,
            "the other policy's points stay"
        );
        assert_eq!(merged.runs.len(), 6);
        assert_eq!(
            merged.notes,
            vec!["Load points from a run of day of ccc, commit ccc (its own system per policy and cluster): equal/trace/metronome at 5 %, 30 %. These replace the points measured before: equal/trace/metronome at 5 %, 30 %.".to_string()]
        );
    }
}
