//! Writing a run's outputs into a directory: `requests.csv` (one row per request),
//! `summary.json` (the [`crate::Summary`] plus the spec and start time, so a result file
//! says how it was produced) and three SVG plots.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::LoadError;
use crate::plots;
use crate::record::write_csv;
use crate::runner::RunResult;
use crate::spec::LoadSpec;
use crate::summary::Summary;

/// File names inside the output directory.
pub const REQUESTS_CSV: &str = "requests.csv";
pub const SUMMARY_JSON: &str = "summary.json";
pub const PLOT_LATENCY_CDF: &str = "latency_cdf.svg";
pub const PLOT_TOKENS_PER_S: &str = "tokens_per_s_cdf.svg";
pub const PLOT_LATENCY_OVER_TIME: &str = "latency_over_time.svg";

/// Paths of the files written.
#[derive(Debug, Clone)]
pub struct OutputFiles {
    pub requests_csv: PathBuf,
    pub summary_json: PathBuf,
    pub plots: Vec<PathBuf>,
}

#[derive(Serialize)]
struct SummaryFile<'a> {
    started_unix_ms: u64,
    cancelled: bool,
    spec: &'a LoadSpec,
    #[serde(flatten)]
    summary: &'a Summary,
}

/// Writes every output of `result` into `dir` (created if missing).
pub fn write_outputs(dir: &Path, result: &RunResult) -> Result<OutputFiles, LoadError> {
    let werr = |path: &Path| {
        let path = path.display().to_string();
        move |source| LoadError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(werr(dir))?;
    let requests_csv = dir.join(REQUESTS_CSV);
    write_csv(&requests_csv, &result.records)?;
    let summary_json = dir.join(SUMMARY_JSON);
    let file = SummaryFile {
        started_unix_ms: result.started_unix_ms,
        cancelled: result.cancelled,
        spec: &result.spec,
        summary: &result.summary,
    };
    let json = serde_json::to_string_pretty(&file).expect("summary serialises");
    std::fs::write(&summary_json, json + "\n").map_err(werr(&summary_json))?;
    let p1 = dir.join(PLOT_LATENCY_CDF);
    plots::latency_cdf(&p1, &result.records)?;
    let p2 = dir.join(PLOT_TOKENS_PER_S);
    plots::tokens_per_s_cdf(&p2, &result.records, &result.spec.slo)?;
    let p3 = dir.join(PLOT_LATENCY_OVER_TIME);
    plots::latency_over_time(&p3, &result.records)?;
    Ok(OutputFiles {
        requests_csv,
        summary_json,
        plots: vec![p1, p2, p3],
    })
}
