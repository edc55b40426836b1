//! Prediction error: how far the dispatcher's per-decision predictions were from what the
//! client measured.
//!
//! A decision (the last record on `decisions.<job_id>`) lists its candidates; the winner's
//! (the one whose `worker_id` is the decision's) may carry
//! `prediction = {ttft_ms, decode_tok_s, worst_running_tok_s, streams_after, model_samples}`.
//! It is read as untyped JSON so this tool works with any build (the compact record of
//! version 3 and the per-term objects of version 2 carry the candidates' `worker_id` and
//! `prediction` alike): no prediction (baseline policies, older builds) means the job is
//! skipped. The TTFT the client sees includes the
//! admission queue, so predicted TTFT = `queue_wait_ms + prediction.ttft_ms`, against the
//! load generator's TTFT; predicted decode rate = `prediction.decode_tok_s`, against its
//! tokens/s. Error = `|predicted − actual| / actual`; p50 and p90 are nearest-rank. Pure.

use serde::{Deserialize, Serialize};

use metronome_loadgen::stats;

/// What the winner's candidate predicted for one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Predicted {
    /// Queue wait plus predicted TTFT on the worker, ms.
    pub ttft_ms: f64,
    pub decode_tok_s: Option<f64>,
}

/// The winner's prediction in a decision's JSON, if it carries one.
pub fn predicted(decision: &serde_json::Value) -> Option<Predicted> {
    let winner = decision.get("worker_id")?.as_str()?;
    let cand = decision
        .get("candidates")?
        .as_array()?
        .iter()
        .find(|c| c.get("worker_id").and_then(|w| w.as_str()) == Some(winner))?;
    let p = cand.get("prediction")?;
    let ttft = p.get("ttft_ms")?.as_f64()?;
    let wait = decision
        .get("queue_wait_ms")
        .and_then(|w| w.as_f64())
        .unwrap_or(0.0);
    Some(Predicted {
        ttft_ms: wait + ttft,
        decode_tok_s: p.get("decode_tok_s").and_then(|v| v.as_f64()),
    })
}

/// `|predicted − actual| / actual`, when both are finite and `actual > 0`.
pub fn relative_error(predicted: f64, actual: f64) -> Option<f64> {
    (predicted.is_finite() && actual.is_finite() && actual > 0.0)
        .then(|| (predicted - actual).abs() / actual)
}

/// p50 and p90 of a set of relative errors.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ErrorStats {
    pub n: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
}

impl ErrorStats {
    pub fn of(errors: &[f64]) -> ErrorStats {
        let s = stats::sorted_finite(errors);
        ErrorStats {
            n: s.len(),
            p50: stats::percentile_sorted(&s, 50.0),
            p90: stats::percentile_sorted(&s, 90.0),
        }
    }
}

/// Prediction errors of one run (the raw errors are kept so runs can be pooled).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PredictionErrors {
    /// Jobs with a decision that carried a prediction.
    pub predicted_jobs: usize,
    pub ttft: ErrorStats,
    pub decode: ErrorStats,
    #[serde(default)]
    pub ttft_errors: Vec<f64>,
    #[serde(default)]
    pub decode_errors: Vec<f64>,
}

impl PredictionErrors {
    /// From (prediction, measured TTFT ms, measured tokens/s) per successful job.
    pub fn of(pairs: &[(Predicted, Option<f64>, Option<f64>)]) -> PredictionErrors {
        let ttft_errors: Vec<f64> = pairs
            .iter()
            .filter_map(|(p, ttft, _)| relative_error(p.ttft_ms, (*ttft)?))
            .collect();
        let decode_errors: Vec<f64> = pairs
            .iter()
            .filter_map(|(p, _, tok_s)| relative_error(p.decode_tok_s?, (*tok_s)?))
            .collect();
        PredictionErrors {
            predicted_jobs: pairs.len(),
            ttft: ErrorStats::of(&ttft_errors),
            decode: ErrorStats::of(&decode_errors),
            ttft_errors,
            decode_errors,
        }
    }

    /// Pools several runs' errors.
    pub fn pooled<'a>(runs: impl IntoIterator<Item = &'a PredictionErrors>) -> PredictionErrors {
        let mut out = PredictionErrors::default();
        for r in runs {
            out.predicted_jobs += r.predicted_jobs;
            out.ttft_errors.extend_from_slice(&r.ttft_errors);
            out.decode_errors.extend_from_slice(&r.decode_errors);
        }
        out.ttft = ErrorStats::of(&out.ttft_errors);
        out.decode = ErrorStats::of(&out.decode_errors);
        out
    }
}

/// One job's prediction beside what the client measured, for `predictions.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct PredictedJob {
    /// The load generator's request id.
    pub id: u64,
    pub job_id: String,
    pub worker: Option<String>,
    pub predicted: Predicted,
    pub ttft_ms: Option<f64>,
    pub tokens_per_s: Option<f64>,
}

/// `predictions.csv`: per job, the winner's prediction beside the measured TTFT and tok/s,
/// in request-id order, so a run's errors can be broken down by worker, prompt or length
/// (joined with `requests.csv` on `id`).
pub fn predictions_csv(jobs: &[PredictedJob]) -> String {
    let num = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    let mut rows: Vec<&PredictedJob> = jobs.iter().collect();
    rows.sort_by_key(|j| j.id);
    let mut csv =
        String::from("id,job_id,worker,predicted_ttft_ms,ttft_ms,predicted_tok_s,tokens_per_s\n");
    for j in rows {
        csv.push_str(&format!(
            "{},{},{},{:.1},{},{},{}\n",
            j.id,
            j.job_id,
            j.worker.as_deref().unwrap_or(""),
            j.predicted.ttft_ms,
            num(j.ttft_ms),
            num(j.predicted.decode_tok_s),
            num(j.tokens_per_s),
        ));
    }
    csv
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decision(prediction: serde_json::Value) -> serde_json::Value {
        json!({
            "v": 1, "job_id": "j1", "worker_id": "gpu1", "queue_wait_ms": 250,
            "candidates": [
                {"worker_id": "gpu0", "total": 0.1, "terms": [],
                 "prediction": {"ttft_ms": 1.0, "decode_tok_s": 1.0}},
                {"worker_id": "gpu1", "total": 0.2, "terms": [], "prediction": prediction},
            ]
        })
    }

    #[test]
    fn reads_the_winners_prediction_and_adds_the_queue_wait() {
        let d = decision(json!({"ttft_ms": 150.0, "decode_tok_s": 42.5,
            "worst_running_tok_s": null, "streams_after": 3, "model_samples": 40}));
        let p = predicted(&d).unwrap();
        assert_eq!(p.ttft_ms, 400.0);
        assert_eq!(p.decode_tok_s, Some(42.5));
    }

    #[test]
    fn reads_the_prediction_of_a_compact_record_as_the_dispatcher_writes_it() {
        use metronome_protocol::*;
        let p = Prediction {
            ttft_ms: 80.0,
            decode_tok_s: 40.0,
            step_tok_s: Some(44.0),
            worst_running_tok_s: None,
            streams_after: 2,
            model_samples: 9,
            stall_ms: Some(3.0),
        };
        let candidate = |w: &str, prediction| CandidateScore {
            worker_id: w.into(),
            total: 0.5,
            raw: [Some(1.0); TERM_COUNT],
            normalised: [0.1; TERM_COUNT],
            prediction,
            cached_prefix: None,
            recent_placements: None,
        };
        let mut d = serde_json::to_value(Decision {
            v: DECISION_VERSION,
            job_id: "j2".into(),
            model: Some("m".into()),
            outcome: Outcome::Assigned,
            attempt: 1,
            reason: None,
            reason_code: None,
            worker_id: Some("gpu1".into()),
            cost: None,
            scoring: Some(Scoring::default()),
            candidates: vec![candidate("gpu0", None), candidate("gpu1", Some(p))],
            rejected: vec![],
            slo: None,
            retry_after_ms: None,
            affinity: None,
            policy: "metronome".into(),
            queue_wait_ms: 20,
            decision_latency_us: 1,
            epoch: 1,
            dispatcher_id: "d".into(),
            decided_ms: 0,
            tenant: None,
            priority: None,
            fair_counter: None,
        })
        .unwrap();
        assert!(d["candidates"][1].get("terms").is_none(), "{d}");
        let got = predicted(&d).unwrap();
        assert_eq!((got.ttft_ms, got.decode_tok_s), (100.0, Some(40.0)));
        d["worker_id"] = json!("gpu0");
        assert_eq!(predicted(&d), None, "a candidate without a prediction");
    }

    #[test]
    fn no_prediction_is_skipped() {
        assert_eq!(predicted(&decision(serde_json::Value::Null)), None);
        let mut d = decision(json!({"ttft_ms": 1.0}));
        d["candidates"][1]
            .as_object_mut()
            .unwrap()
            .remove("prediction");
        assert_eq!(predicted(&d), None);
        // Rejected decision: no winner.
        assert_eq!(predicted(&json!({"job_id": "x", "candidates": []})), None);
    }

    #[test]
    fn errors_are_relative_and_their_percentiles_nearest_rank() {
        assert_eq!(relative_error(110.0, 100.0), Some(0.1));
        assert_eq!(relative_error(90.0, 100.0), Some(0.1));
        assert_eq!(relative_error(1.0, 0.0), None);
        let p = |ttft: f64, tok: Option<f64>| Predicted {
            ttft_ms: ttft,
            decode_tok_s: tok,
        };
        let pairs: Vec<_> = (1..=10)
            .map(|i| {
                (
                    p(100.0 + f64::from(i) * 10.0, Some(50.0)),
                    Some(100.0),
                    Some(40.0),
                )
            })
            .chain([(p(100.0, None), None, Some(40.0))])
            .collect();
        let e = PredictionErrors::of(&pairs);
        assert_eq!(e.predicted_jobs, 11);
        assert_eq!(e.ttft.n, 10);
        assert!((e.ttft.p50.unwrap() - 0.5).abs() < 1e-9);
        assert!((e.ttft.p90.unwrap() - 0.9).abs() < 1e-9);
        assert_eq!(e.decode.n, 10);
        assert!((e.decode.p50.unwrap() - 0.25).abs() < 1e-9);
        let pooled = PredictionErrors::pooled([&e, &e]);
        assert_eq!(pooled.ttft.n, 20);
        assert_eq!(pooled.predicted_jobs, 22);
        assert_eq!(pooled.ttft.p50, e.ttft.p50);
    }

    #[test]
    fn the_predictions_csv_lists_each_job_in_request_order() {
        let job = |id: u64, worker: Option<&str>, tok_s: Option<f64>| PredictedJob {
            id,
            job_id: format!("j{id}"),
            worker: worker.map(str::to_string),
            predicted: Predicted {
                ttft_ms: 412.25,
                decode_tok_s: tok_s,
            },
            ttft_ms: Some(400.0),
            tokens_per_s: Some(41.5),
        };
        let csv = predictions_csv(&[job(7, Some("gpu1"), Some(40.0)), job(2, None, None)]);
        assert_eq!(
            csv,
            "id,job_id,worker,predicted_ttft_ms,ttft_ms,predicted_tok_s,tokens_per_s\n\
             2,j2,,412.2,400.000,,41.500\n\
             7,j7,gpu1,412.2,400.000,40.000,41.500\n"
        );
    }
}
