//! The decision record in both of its forms: the compact one this crate writes (version 3)
//! round-trips exactly, and a record as a version-2 dispatcher wrote it (every term an
//! object with its weight and contribution) still reads, to the same values.

use metronome_protocol::decision::JobCostEstimate;
use metronome_protocol::*;
use serde_json::json;

fn prediction(ttft_ms: f64, tok_s: f64, streams_after: u32) -> Prediction {
    Prediction {
        ttft_ms,
        decode_tok_s: tok_s,
        step_tok_s: Some(tok_s + 1.0),
        worst_running_tok_s: (streams_after > 1).then_some(tok_s - 0.2),
        streams_after,
        model_samples: 0,
        stall_ms: None,
    }
}

/// A decision with every field set, numbers that need all their digits, and an
/// unavailable term.
fn full() -> Decision {
    Decision {
        v: DECISION_VERSION,
        job_id: "01a230a8-6ca7-764c-9558-b0584e7c9072".into(),
        model: Some("llama-3.1-8b".into()),
        outcome: Outcome::Assigned,
        attempt: 2,
        reason: Some("attempt 2 (assigned again)".into()),
        reason_code: Some("note".into()),
        worker_id: Some("local-gpu2".into()),
        cost: Some(JobCostEstimate {
            prompt_tokens: 9,
            max_tokens: 32,
            predicted_output_tokens: 31.7,
            kv_tokens: 41,
        }),
        scoring: Some(Scoring {
            weights: [2.0, 0.5, 0.25, 1.0, 0.25, 0.75, 1.0 / 3.0],
        }),
        candidates: vec![
            CandidateScore {
                worker_id: "local-gpu2".into(),
                total: 0.1 + 0.2,
                raw: [
                    Some(1.0),
                    Some(0.0),
                    None,
                    Some(696.123_456_789_012_3),
                    Some(58.9),
                    Some(1e-9),
                    None,
                ],
                normalised: [0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0 / 7.0],
                prediction: Some(prediction(52.3, 49.7, 2)),
                cached_prefix: Some(CachedPrefix {
                    tokens: 1_024,
                    source: PrefixSource::Placements,
                }),
                recent_placements: Some(7.4),
            },
            CandidateScore {
                worker_id: "local-gpu0".into(),
                total: 3.0,
                raw: [
                    Some(2.0),
                    Some(0.0),
                    None,
                    Some(702.0),
                    None,
                    Some(0.0),
                    None,
                ],
                normalised: [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0],
                prediction: None,
                cached_prefix: None,
                recent_placements: None,
            },
        ],
        rejected: vec![Rejection {
            worker_id: "local-gpu1".into(),
            code: RejectionCode::WrongModel,
            reason: "serves model 'qwen2.5-7b', job needs 'llama-3.1-8b'".into(),
            prediction: Some(prediction(40.0, 30.0, 1)),
        }],
        slo: Some(Slo {
            ttft_ms: 2000,
            min_tok_s: 30.0,
        }),
        retry_after_ms: Some(1500),
        affinity: Some(Affinity {
            worker_id: "n1-gpu1".into(),
            cached_tokens: 2_000,
            outcome: AffinityOutcome::Overridden,
            reason_code: Some("fair_share".into()),
            reason: Some("n1-gpu1 would have taken 5.0 of the last ~10 s's placements, above 1.5 times an even share".into()),
            max_share: 1.5,
        }),
        policy: "metronome".into(),
        queue_wait_ms: 7,
        decision_latency_us: 62,
        epoch: 3,
        dispatcher_id: "dispatcher-a".into(),
        decided_ms: 1_764_576_673_961,
        tenant: Some("acme".into()),
        priority: Some(Priority::Interactive),
        fair_counter: Some(1234.5),
    }
}

#[test]
fn the_compact_form_round_trips_exactly() {
    let d = full();
    let bytes = serde_json::to_vec(&d).unwrap();
    let back: Decision = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(back, d);
    // And again: what is read back writes the same bytes.
    assert_eq!(serde_json::to_vec(&back).unwrap(), bytes);
}

#[test]
fn the_compact_form_names_the_terms_once_and_lists_values_as_arrays() {
    let v = serde_json::to_value(full()).unwrap();
    assert_eq!(v["v"], 3);
    assert_eq!(
        v["scoring"]["terms"],
        json!([
            "active_requests",
            "queue_depth",
            "latency_ewma",
            "job_cost",
            "throughput_ewma",
            "kv_pressure",
            "gpu_utilisation"
        ])
    );
    assert_eq!(v["scoring"]["weights"][0], 2.0);
    let c = &v["candidates"][0];
    assert_eq!(
        c["raw"],
        json!([1.0, 0.0, null, 696.1234567890123, 58.9, 1e-9, null])
    );
    assert_eq!(c["normalised"][5], 1.0);
    assert_eq!(c["prediction"]["ttft_ms"], 52.3);
    assert_eq!(c["recent_placements"], 7.4);
    let keys: Vec<&str> = c.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys.len(),
        7,
        "worker_id, total, raw, normalised, prediction, cached_prefix, recent_placements: {keys:?}"
    );
    assert!(v["candidates"][1].get("prediction").is_none());
    // No per-term objects, no weight or contribution repeated per candidate.
    let text = v.to_string();
    assert!(!text.contains("\"contribution\"") && !text.contains("\"available\""));
}

#[test]
fn a_record_read_as_version_2_is_written_as_version_3() {
    let mut d = full();
    d.v = 2;
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(
        v["v"], DECISION_VERSION,
        "the form written is the compact one"
    );
}

#[test]
fn the_expanded_terms_are_the_ones_the_dispatcher_derived() {
    let d = full();
    let terms = d.terms_of(&d.candidates[0]);
    let scoring = d.scoring.unwrap();
    for (i, t) in terms.iter().enumerate() {
        assert_eq!(t.term, TermName::ALL[i]);
        assert_eq!(t.raw, d.candidates[0].raw[i]);
        assert_eq!(t.normalised, d.candidates[0].normalised[i]);
        assert_eq!(t.weight, scoring.weights[i]);
        assert_eq!(
            t.contribution,
            d.candidates[0].normalised[i] * scoring.weights[i]
        );
        assert_eq!(t.available, d.candidates[0].raw[i].is_some());
    }
    assert!(!terms[TermName::LatencyEwma.index()].available);
}

/// A record exactly as a version-2 dispatcher wrote it (the README's example).
fn version_2() -> serde_json::Value {
    let term = |name: &str, raw: Option<f64>, normalised: f64, weight: f64| {
        json!({"term": name, "raw": raw, "normalised": normalised, "weight": weight,
               "contribution": normalised * weight, "available": raw.is_some()})
    };
    json!({
        "v": 2,
        "job_id": "01a230a8-6ca7-764c-9558-b0584e7c9072",
        "model": "llama-3.1-8b",
        "outcome": "assigned",
        "attempt": 1,
        "reason": null,
        "reason_code": null,
        "worker_id": "local-gpu2",
        "cost": {"prompt_tokens": 9, "max_tokens": 32, "predicted_output_tokens": 32.0,
                 "kv_tokens": 41},
        "candidates": [
            {"worker_id": "local-gpu2", "total": 0.75, "terms": [
                term("active_requests", Some(1.0), 0.0, 2.0),
                term("queue_depth", Some(0.0), 0.0, 0.5),
                term("latency_ewma", None, 0.0, 0.25),
                term("job_cost", Some(696.0), 0.0, 1.0),
                term("throughput_ewma", None, 0.0, 0.25),
                term("kv_pressure", Some(0.0), 1.0, 0.75),
                term("gpu_utilisation", None, 0.0, 0.25),
             ],
             "prediction": {"ttft_ms": 52.0, "decode_tok_s": 49.7, "worst_running_tok_s": 49.7,
                            "streams_after": 2, "model_samples": 0}},
            {"worker_id": "local-gpu0", "total": 3.0, "terms": [
                term("active_requests", Some(2.0), 1.0, 2.0),
                term("queue_depth", Some(0.0), 0.0, 0.5),
                term("latency_ewma", None, 0.0, 0.25),
                term("job_cost", Some(702.0), 1.0, 1.0),
                term("throughput_ewma", None, 0.0, 0.25),
                term("kv_pressure", Some(0.0), 0.0, 0.75),
                term("gpu_utilisation", None, 0.0, 0.25),
             ],
             "prediction": {"ttft_ms": 54.0, "decode_tok_s": 49.5, "worst_running_tok_s": 49.5,
                            "streams_after": 3, "model_samples": 0}}
        ],
        "rejected": [
            {"worker_id": "local-gpu1", "code": "wrong_model",
             "reason": "serves model 'qwen2.5-7b', job needs 'llama-3.1-8b'", "prediction": null}
        ],
        "slo": {"ttft_ms": 2000, "min_tok_s": 30.0},
        "policy": "metronome",
        "queue_wait_ms": 0,
        "decision_latency_us": 62,
        "epoch": 1,
        "dispatcher_id": "dispatcher-a",
        "decided_ms": 1_764_576_673_961u64,
        "tenant": null,
        "priority": "interactive",
        "fair_counter": 41.0
    })
}

#[test]
fn a_version_2_record_still_reads_to_the_same_values() {
    let old = version_2();
    let d: Decision = serde_json::from_value(old.clone()).unwrap();
    assert_eq!(d.v, 2);
    assert_eq!(d.worker_id.as_deref(), Some("local-gpu2"));
    assert_eq!(
        d.scoring.unwrap().weights,
        [2.0, 0.5, 0.25, 1.0, 0.25, 0.75, 0.25]
    );
    let c = &d.candidates[1];
    assert_eq!(c.worker_id, "local-gpu0");
    assert_eq!(c.total, 3.0);
    assert_eq!(
        c.raw,
        [
            Some(2.0),
            Some(0.0),
            None,
            Some(702.0),
            None,
            Some(0.0),
            None
        ]
    );
    assert_eq!(c.normalised, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
    assert_eq!(c.prediction.unwrap().streams_after, 3);
    assert_eq!(d.rejected[0].code, RejectionCode::WrongModel);
    // Every term as it was recorded, weight and contribution included.
    for (ci, cand) in d.candidates.iter().enumerate() {
        for (ti, t) in d.terms_of(cand).iter().enumerate() {
            let recorded: TermScore =
                serde_json::from_value(old["candidates"][ci]["terms"][ti].clone()).unwrap();
            assert_eq!(t, &recorded, "candidate {ci} term {ti}");
        }
        let sum: f64 = d.terms_of(cand).iter().map(|t| t.contribution).sum();
        assert_eq!(sum, cand.total);
    }
    // Written again, it is a compact record with the same content.
    let again: Decision = serde_json::from_slice(&serde_json::to_vec(&d).unwrap()).unwrap();
    assert_eq!(again.candidates, d.candidates);
    assert_eq!(again.scoring, d.scoring);
}

#[test]
fn a_version_2_record_without_terms_or_tenancy_reads() {
    // Version 1 had no tenant, priority or fair counter; a candidate may list no terms.
    let mut old = version_2();
    let map = old.as_object_mut().unwrap();
    for k in ["tenant", "priority", "fair_counter", "slo"] {
        map.remove(k);
    }
    map.insert("v".into(), 1.into());
    old["candidates"][1]["terms"] = json!([]);
    let d: Decision = serde_json::from_value(old).unwrap();
    assert_eq!((d.tenant, d.priority, d.fair_counter), (None, None, None));
    assert_eq!(d.candidates[1].raw, [None; TERM_COUNT]);
    assert_eq!(
        d.scoring.unwrap().weights[0],
        2.0,
        "from the first candidate"
    );
}

#[test]
fn a_compact_record_is_read_by_term_name_not_by_position() {
    // A writer that orders its terms differently, knows a term this build does not and
    // lacks one: values go by name, the unknown term is skipped, the missing one is
    // unavailable.
    let mut v = serde_json::to_value(full()).unwrap();
    v["scoring"] = json!({
        "terms": ["kv_pressure", "future_term", "active_requests"],
        "weights": [0.75, 9.0, 2.0]
    });
    v["candidates"][0]["raw"] = json!([0.4, 123.0, 3.0]);
    v["candidates"][0]["normalised"] = json!([0.6, 0.9, 1.0]);
    let d: Decision = serde_json::from_value(v).unwrap();
    let mut weights = [0.0; TERM_COUNT];
    weights[TermName::KvPressure.index()] = 0.75;
    weights[TermName::ActiveRequests.index()] = 2.0;
    assert_eq!(d.scoring.unwrap().weights, weights);
    let c = &d.candidates[0];
    assert_eq!(c.raw[TermName::KvPressure.index()], Some(0.4));
    assert_eq!(c.raw[TermName::ActiveRequests.index()], Some(3.0));
    assert_eq!(c.normalised[TermName::ActiveRequests.index()], 1.0);
    assert_eq!(c.raw[TermName::JobCost.index()], None);
}

#[test]
fn a_rejection_without_scores_has_no_scoring() {
    let mut d = full();
    d.outcome = Outcome::Rejected;
    d.worker_id = None;
    d.scoring = None;
    d.candidates.clear();
    let v = serde_json::to_value(&d).unwrap();
    assert!(v.get("scoring").is_none(), "{v}");
    assert_eq!(serde_json::from_value::<Decision>(v).unwrap(), d);
}

#[test]
fn a_candidates_cached_prefix_is_written_with_its_source_and_optional_to_read() {
    let d = full();
    let text = serde_json::to_value(&d).unwrap();
    assert_eq!(
        text["candidates"][0]["cached_prefix"],
        json!({"tokens": 1024, "source": "placements"})
    );
    assert!(text["candidates"][1].get("cached_prefix").is_none());
    // A record from a dispatcher that knew no prefixes reads without it.
    let mut old = text.clone();
    old["candidates"][0]
        .as_object_mut()
        .unwrap()
        .remove("cached_prefix");
    let read: Decision = serde_json::from_value(old).unwrap();
    assert_eq!(read.candidates[0].cached_prefix, None);
    let events = json!({"tokens": 16, "source": "events"});
    let c: CachedPrefix = serde_json::from_value(events).unwrap();
    assert_eq!(c.source, PrefixSource::Events);
}
