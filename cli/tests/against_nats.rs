//! The CLI against a real nats-server (metronome-testkit): the streams and buckets come from
//! `metronome_protocol::setup::ensure_all`, the records are published on the documented
//! subjects, and every command reads them back through the contract alone.

use std::process::Command;

use async_nats::jetstream;
use bytes::Bytes;
use clap::Parser;
use metronome_cli::{Cli, CliError};
use metronome_protocol::decision::JobCostEstimate;
use metronome_protocol::names;
use metronome_protocol::time::unix_ms;
use metronome_protocol::*;
use metronome_testkit::NatsServer;

struct Env {
    nats: NatsServer,
    js: jetstream::Context,
    buckets: setup::Buckets,
}

async fn env() -> Env {
    let nats = NatsServer::start().expect("nats-server (apt-get install nats-server)");
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = jetstream::new(client);
    let buckets = setup::ensure_all(
        &js,
        &setup::StreamSettings {
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        },
    )
    .await
    .expect("streams and buckets");
    Env { nats, js, buckets }
}

impl Env {
    async fn publish<T: serde::Serialize>(&self, subject: String, msg_id: &str, body: &T) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(names::HEADER_MSG_ID, msg_id);
        self.js
            .publish_with_headers(
                subject,
                headers,
                Bytes::from(serde_json::to_vec(body).unwrap()),
            )
            .await
            .expect("publish")
            .await
            .expect("stored");
    }

    async fn cli(&self, args: &[&str]) -> Result<String, CliError> {
        let url = self.nats.url();
        let mut argv = vec!["metronome", "--nats-url", url.as_str()];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).expect("arguments parse");
        let mut out = Vec::new();
        metronome_cli::run(cli, &mut out).await?;
        Ok(String::from_utf8(out).expect("utf-8"))
    }
}

/// Every term at `scale` (raw `10 × scale`), GPU utilisation unavailable; weights all 1.
fn candidate(worker: &str, scale: f64, ttft_ms: f64, tok_s: f64) -> CandidateScore {
    let mut raw = [Some(10.0 * scale); TERM_COUNT];
    raw[TermName::GpuUtilisation.index()] = None;
    CandidateScore {
        worker_id: worker.into(),
        total: 7.0 * scale,
        raw,
        normalised: [scale; TERM_COUNT],
        prediction: Some(Prediction {
            ttft_ms,
            decode_tok_s: tok_s,
            step_tok_s: None,
            worst_running_tok_s: None,
            streams_after: 1,
            model_samples: 12,
            stall_ms: None,
        }),
        cached_prefix: None,
        recent_placements: None,
    }
}

fn decision(job_id: &str, attempt: u32, now: u64) -> Decision {
    Decision {
        v: 1,
        job_id: job_id.into(),
        model: Some("llama-3.1-8b".into()),
        outcome: Outcome::Assigned,
        attempt,
        reason: None,
        reason_code: None,
        worker_id: Some("n1-gpu1".into()),
        cost: Some(JobCostEstimate {
            prompt_tokens: 12,
            max_tokens: 64,
            predicted_output_tokens: 40.0,
            kv_tokens: 76,
        }),
        scoring: Some(Scoring {
            weights: [1.0; TERM_COUNT],
        }),
        candidates: vec![
            candidate("n1-gpu1", 0.1, 110.0, 48.0),
            candidate("n1-gpu0", 0.3, 160.0, 41.0),
        ],
        rejected: vec![Rejection {
            worker_id: "n1-gpu2".into(),
            code: RejectionCode::BelowSloFloor,
            reason: "a running job would fall to 21.0 tok/s, under the 30.0 tok/s floor".into(),
            prediction: None,
        }],
        slo: Some(Slo {
            ttft_ms: 2000,
            min_tok_s: 30.0,
        }),
        policy: "metronome".into(),
        queue_wait_ms: 25,
        retry_after_ms: None,
        affinity: None,
        decision_latency_us: 31,
        epoch: 4,
        dispatcher_id: "d1".into(),
        decided_ms: now,
        tenant: None,
        priority: None,
        fair_counter: None,
    }
}

fn completion(job_id: &str, worker: &str, attempt: u32, now: u64) -> CompletionEvent {
    CompletionEvent {
        v: 1,
        job_id: job_id.into(),
        worker_id: worker.into(),
        model: "llama-3.1-8b".into(),
        epoch: 4,
        attempt,
        outcome: CompletionOutcome::Done,
        streamed: true,
        error: None,
        prompt_tokens: 12,
        output_tokens: 40,
        ttft_ms: Some(130.0),
        tpot_ms: Some(25.0),
        e2e_ms: 1105.0,
        finished_ms: now + 1200,
        job: None,
    }
}

#[tokio::test]
async fn explain_tells_the_story_of_a_stored_decision() {
    let env = env().await;
    let now = unix_ms();
    // Noise first: another job's decision and completion on the same worker.
    env.publish(
        names::decision_subject(None, "other"),
        "other:1",
        &decision("other", 1, now),
    )
    .await;
    env.publish(
        names::event_done_subject("n1-gpu1"),
        "e-other",
        &completion("other", "n1-gpu1", 1, now),
    )
    .await;
    let mut first = decision("job-7", 1, now);
    first.tenant = Some("acme".into());
    first.priority = Some(metronome_protocol::Priority::Interactive);
    first.fair_counter = Some(900.0);
    env.publish(
        names::decision_subject(Some("acme"), "job-7"),
        "job-7:1",
        &first,
    )
    .await;
    let mut done = completion("job-7", "n1-gpu1", 1, now);
    done.ttft_ms = Some(140.0);
    env.publish(names::event_done_subject("n1-gpu1"), "e-job-7", &done)
        .await;
    env.publish(
        names::result_final_subject(Some("acme"), "job-7", "n1-gpu1"),
        "r-job-7",
        &FinalResult {
            v: 1,
            job_id: "job-7".into(),
            worker_id: Some("n1-gpu1".into()),
            response: None,
            error: None,
            usage: Usage {
                prompt_tokens: 12,
                completion_tokens: 40,
                total_tokens: 52,
            },
            chunks: 41,
            ttft_ms: Some(150.0),
            e2e_ms: Some(1120.0),
        },
    )
    .await;

    let text = env.cli(&["explain", "job-7"]).await.expect("explain");
    println!("{text}");
    for needle in [
        "Job job-7 (model llama-3.1-8b): assigned to n1-gpu1 on attempt 1",
        "waited in queue: 25 ms",
        "tenant acme, priority interactive, fair-share counter 900 weighted tokens (after this job's charge)",
        "SLO: first token within 2000 ms of submission, at least 30.0 tok/s",
        "#1 n1-gpu1  total 0.700  ← winner",
        "predicted: TTFT 110 ms, 48.0 tok/s for this job",
        "n1-gpu2  below_slo_floor  a running job would fall to 21.0 tok/s, under the 30.0 tok/s floor",
        "Winner: n1-gpu1 with total 0.700, 1.400 ahead of the runner-up n1-gpu0 (2.100)",
        "What happened on n1-gpu1 (attempt 1):",
        "40.0 tok/s (tpot 25 ms)",
        "SLO met",
        "Final result: ok from n1-gpu1, 12 prompt + 40 completion tokens in 41 chunks",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    for term in TermName::ALL {
        assert!(
            text.contains(term.as_str()),
            "term {} missing:\n{text}",
            term.as_str()
        );
    }
    // The job's own completion, not the other job's on the same worker.
    let ttft = text
        .lines()
        .find(|l| l.contains("TTFT on the worker"))
        .unwrap();
    assert!(ttft.contains("110 ms") && ttft.contains("140 ms"), "{ttft}");

    let json = env
        .cli(&["--json", "explain", "job-7"])
        .await
        .expect("explain --json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("explain --json parses");
    assert_eq!(v["summary"]["winner"], "n1-gpu1");
    assert_eq!(v["summary"]["runner_up"], "n1-gpu0");
    assert_eq!(v["summary"]["slo_met"], true);
    assert_eq!(v["summary"]["actual"]["ttft_ms"], 140.0);
    assert_eq!(v["decisions"][0]["rejected"][0]["code"], "below_slo_floor");
    assert_eq!(v["result"]["chunks"], 41);
    assert_eq!(v["decisions"][0]["tenant"], "acme");
    assert_eq!(v["decisions"][0]["fair_counter"], 900.0);

    // A second attempt on the same subject: both are told, the last one counts.
    let mut second = decision("job-7", 2, now + 10);
    second.reason = Some("rescued: n1-gpu1 stopped heartbeating".into());
    second.worker_id = Some("n1-gpu0".into());
    second.candidates = vec![candidate("n1-gpu0", 0.2, 150.0, 41.0)];
    env.publish(
        names::decision_subject(Some("acme"), "job-7"),
        "job-7:2",
        &second,
    )
    .await;
    let text = env.cli(&["explain", "job-7"]).await.expect("explain");
    assert!(
        text.contains("── decision 1 of 2 ──") && text.contains("── decision 2 of 2 ──"),
        "{text}"
    );
    assert!(
        text.contains("note: rescued: n1-gpu1 stopped heartbeating"),
        "{text}"
    );
    assert!(
        text.contains("Winner: n1-gpu0 with total 1.400, the only eligible worker"),
        "{text}"
    );
    // Attempt 1's completion is not passed off as attempt 2's.
    assert!(
        text.contains("Earlier attempt 1 on n1-gpu1: done"),
        "{text}"
    );
    assert!(
        text.contains("What happened: no completion event found yet"),
        "{text}"
    );
}

/// A record as a version-2 dispatcher wrote it: every candidate's terms as objects, each
/// with its weight and contribution, no `scoring`. `n1-gpu1` wins on active requests,
/// though its KV cache is fuller.
fn version_2_record(job_id: &str, now: u64) -> serde_json::Value {
    let terms = |active: f64, kv: f64| {
        let term = |name: &str, raw: Option<f64>, normalised: f64, weight: f64| {
            serde_json::json!({"term": name, "raw": raw, "normalised": normalised,
                "weight": weight, "contribution": normalised * weight,
                "available": raw.is_some()})
        };
        vec![
            term("active_requests", Some(active), active, 2.0),
            term("queue_depth", Some(0.0), 0.0, 0.5),
            term("latency_ewma", None, 0.0, 0.25),
            term("job_cost", Some(700.0), 0.0, 1.0),
            term("throughput_ewma", None, 0.0, 0.25),
            term("kv_pressure", Some(kv), kv * 10.0, 0.75),
            term("gpu_utilisation", None, 0.0, 0.25),
        ]
    };
    serde_json::json!({
        "v": 2, "job_id": job_id, "model": "llama-3.1-8b", "outcome": "assigned",
        "attempt": 1, "reason": null, "reason_code": null, "worker_id": "n1-gpu1",
        "cost": {"prompt_tokens": 12, "max_tokens": 64, "predicted_output_tokens": 40.0,
                 "kv_tokens": 76},
        "candidates": [
            {"worker_id": "n1-gpu1", "total": 0.75, "terms": terms(0.0, 0.1),
             "prediction": {"ttft_ms": 52.0, "decode_tok_s": 49.7, "worst_running_tok_s": null,
                            "streams_after": 1, "model_samples": 0}},
            {"worker_id": "n1-gpu0", "total": 2.0, "terms": terms(1.0, 0.0),
             "prediction": {"ttft_ms": 54.0, "decode_tok_s": 49.5,
                            "worst_running_tok_s": 49.5, "streams_after": 2,
                            "model_samples": 0}}
        ],
        "rejected": [], "slo": {"ttft_ms": 2000, "min_tok_s": 30.0},
        "policy": "metronome", "queue_wait_ms": 0, "decision_latency_us": 62, "epoch": 1,
        "dispatcher_id": "dispatcher-a", "decided_ms": now
    })
}

#[tokio::test]
async fn an_older_dispatchers_record_is_explained_and_replayed() {
    let env = env().await;
    let now = unix_ms();
    env.publish(
        names::decision_subject(None, "old-1"),
        "old-1:1",
        &version_2_record("old-1", now),
    )
    .await;
    let text = env.cli(&["explain", "old-1"]).await.expect("explain");
    for needle in [
        "assigned to n1-gpu1 on attempt 1",
        "#1 n1-gpu1  total 0.750  ← winner",
        "#2 n1-gpu0  total 2.000",
        "predicted: TTFT 52 ms, 49.7 tok/s for this job",
        "(signal unavailable)",
        "Winner: n1-gpu1 with total 0.750, 1.250 ahead of the runner-up n1-gpu0 (2.000)",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // The weights and contributions of the old terms are shown as they were recorded.
    let active = text
        .lines()
        .filter(|l| l.trim_start().starts_with("active_requests"))
        .nth(1)
        .expect("the runner-up's active_requests row");
    assert!(
        active.contains("1 req") && active.contains("2.00") && active.contains("2.000"),
        "{active}"
    );
    // --json gives the record in the current form.
    let json = env
        .cli(&["--json", "explain", "old-1"])
        .await
        .expect("json");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["decisions"][0]["v"], DECISION_VERSION);
    assert_eq!(
        v["decisions"][0]["scoring"]["weights"],
        serde_json::json!([2.0, 0.5, 0.25, 1.0, 0.25, 0.75, 0.25])
    );
    assert_eq!(
        v["decisions"][0]["candidates"][1]["raw"],
        serde_json::json!([1.0, 0.0, null, 700.0, null, 0.0, null])
    );
    // Replay re-decides it from the old record: it reproduces itself under the recorded
    // (default) weights, and moves with active requests weighing nothing.
    let same = env.cli(&["replay", "--since", "1h"]).await.expect("replay");
    assert!(same.contains("1 re-decided, 0 not replayable"), "{same}");
    assert!(
        same.contains("placements that would change: 0 of 1"),
        "{same}"
    );
    let other = std::env::temp_dir().join(format!("replay-old-{}.toml", std::process::id()));
    std::fs::write(&other, "[scheduler.weights]\nactive_requests = 0.0\n").unwrap();
    let moved = env
        .cli(&[
            "replay",
            "--since",
            "1h",
            "--config",
            other.to_str().unwrap(),
        ])
        .await
        .expect("replay with other weights");
    let _ = std::fs::remove_file(&other);
    assert!(
        moved.contains("placements that would change: 1 of 1"),
        "{moved}"
    );
}

#[tokio::test]
async fn explain_of_an_unknown_or_rejected_job() {
    let env = env().await;
    let err = env.cli(&["explain", "no-such-job"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert!(
        err.to_string()
            .contains("no decision recorded for job no-such-job"),
        "{err}"
    );
    let err = env.cli(&["explain", "a.b"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 2, "{err}");

    let mut d = decision("full-1", 1, unix_ms());
    d.outcome = Outcome::Rejected;
    d.worker_id = None;
    d.candidates.clear();
    d.reason = Some("the admission queue of llama-3.1-8b is full (512 jobs)".into());
    d.reason_code = Some("queue_full".into());
    env.publish(names::decision_subject(None, "full-1"), "full-1:1", &d)
        .await;
    let text = env.cli(&["explain", "full-1"]).await.expect("explain");
    assert!(text.contains("REJECTED on attempt 1"), "{text}");
    assert!(text.contains("[queue_full]"), "{text}");
    assert!(!text.contains("What happened"), "{text}");

    // The binary itself: exit 1 and a message for an unknown id.
    let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(["explain", "no-such-job"])
        .env("NATS_URL", env.nats.url())
        .output()
        .expect("run metronome");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no decision recorded for job no-such-job"),
        "{stderr}"
    );
}

#[tokio::test]
async fn decisions_workers_and_status_read_the_contract() {
    let env = env().await;
    let now = unix_ms();
    for (i, id) in ["j1", "j2", "j3"].iter().enumerate() {
        let mut d = decision(id, 1, now + i as u64);
        if *id == "j2" {
            d.outcome = Outcome::Expired;
            d.worker_id = None;
            d.reason = Some("no eligible worker before the deadline".into());
            d.reason_code = Some("deadline_exceeded".into());
        }
        env.publish(names::decision_subject(None, id), &format!("{id}:1"), &d)
            .await;
    }
    let text = env.cli(&["decisions", "-n", "2"]).await.expect("decisions");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].contains("j2  expired") && lines[0].contains("deadline_exceeded"),
        "{text}"
    );
    assert!(
        lines[1].contains("j3  assigned  n1-gpu1") && lines[1].contains("110 ms"),
        "{text}"
    );
    let text = env
        .cli(&["decisions", "--outcome", "assigned", "-n", "10"])
        .await
        .expect("decisions");
    assert_eq!(text.lines().count(), 2, "{text}");
    let json = env
        .cli(&["--json", "decisions"])
        .await
        .expect("decisions --json");
    let parsed: Vec<Decision> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("one decision per line"))
        .collect();
    assert_eq!(parsed.len(), 3);

    let mut status = WorkerStatus {
        v: 1,
        worker_id: "n1-gpu1".into(),
        model: "llama-3.1-8b".into(),
        node: None,
        gpu_index: None,
        healthy: true,
        draining: false,
        max_concurrency: 16,
        active: 5,
        queued: 0,
        in_flight: vec![],
        kv: Some(KvUsage {
            used_frac: 0.25,
            capacity_tokens: None,
        }),
        gpu: None,
        prefill_pending_tokens: 0,
        perf: Some(PerfCoefficients {
            step_base_ms: 25.0,
            step_per_stream_ms: 0.4,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.0,
            ttft_base_ms: 40.0,
            prefill_per_token_ms: 0.1,
            ttft_per_stream_ms: 1.0,
            step_error_ms: 0.0,
            samples: 77,
        }),
        decoding: None,
        seq: 1,
        sent_ms: now,
        max_epoch: 0,
    };
    env.buckets
        .workers
        .put("n1-gpu1", serde_json::to_vec(&status).unwrap().into())
        .await
        .unwrap();
    status.worker_id = "n1-gpu0".into();
    status.draining = true;
    env.buckets
        .workers
        .put("n1-gpu0", serde_json::to_vec(&status).unwrap().into())
        .await
        .unwrap();
    let text = env.cli(&["workers"]).await.expect("workers");
    println!("{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("n1-gpu1"))
        .expect("row");
    for cell in [
        "llama-3.1-8b",
        "5/16",
        "25%",
        "n/a",
        "40.0 tok/s",
        "77",
        "up",
    ] {
        assert!(row.contains(cell), "{cell} missing in {row}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("n1-gpu0") && l.ends_with("draining")),
        "{text}"
    );
    let json = env
        .cli(&["--json", "workers"])
        .await
        .expect("workers --json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("workers --json parses");
    assert_eq!(v.as_array().unwrap().len(), 2);

    let text = env.cli(&["status"]).await.expect("status");
    println!("{text}");
    assert!(text.contains("leader:    NONE"), "{text}");
    env.buckets
        .leader
        .put(
            names::LEADER_KEY,
            serde_json::to_vec(&serde_json::json!({
                "dispatcher_id": "d1", "acquired_ms": now - 5_000, "renewed_ms": now
            }))
            .unwrap()
            .into(),
        )
        .await
        .unwrap();
    let text = env.cli(&["status"]).await.expect("status");
    println!("{text}");
    assert!(text.contains("leader:    d1 (epoch 4)"), "{text}");
    assert!(text.contains("workers:   1 up, 1 draining"), "{text}");
    assert!(
        text.contains("llama-3.1-8b  2         0         1"),
        "{text}"
    );
    assert!(text.contains("queues:    n/a"), "{text}");
    let json = env.cli(&["--json", "status"]).await.expect("status --json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("status --json parses");
    assert_eq!(v["leader"]["holder"], "d1");
    assert_eq!(v["models"]["llama-3.1-8b"]["expired"], 1);

    // The leader's queue snapshots: one it keeps writing, one an earlier leader left.
    // Written just now: the CLI calls one older than 5 s stale.
    let now = metronome_protocol::time::unix_ms();
    let snapshot = |model: &str, waiting: u32, epoch: u64| metronome_protocol::QueueSnapshot {
        v: 1,
        model: model.into(),
        waiting,
        oldest_enqueued_ms: Some(now - 2_500),
        oldest_wait_ms: 2_500,
        by_priority: [(metronome_protocol::Priority::Interactive, waiting)].into(),
        flows: Vec::new(),
        flows_not_listed: 0,
        bound: None,
        epoch,
        dispatcher_id: "d1".into(),
        written_ms: now,
    };
    for s in [snapshot("llama-3.1-8b", 3, 4), snapshot("qwen2.5-7b", 2, 3)] {
        env.buckets
            .queues
            .put(
                names::queue_key(&s.model),
                serde_json::to_vec(&s).unwrap().into(),
            )
            .await
            .unwrap();
    }
    let text = env.cli(&["status"]).await.expect("status");
    println!("{text}");
    assert!(
        text.contains("queues:    3 jobs waiting for a worker in the leader's queues (1 models' snapshots are stale)"),
        "{text}"
    );
    assert!(
        text.contains("llama-3.1-8b  3        2500 ms      interactive 3  fresh"),
        "{text}"
    );
    assert!(
        text.contains("qwen2.5-7b    2        2500 ms      interactive 2  STALE: from epoch 3, the leader is at 4"),
        "{text}"
    );
    let json = env.cli(&["--json", "status"]).await.expect("status --json");
    let v: serde_json::Value = serde_json::from_str(&json).expect("status --json parses");
    assert_eq!(v["queues"][0]["model"], "llama-3.1-8b");
    assert_eq!(v["queues"][0]["waiting"], 3);
    assert_eq!(v["queues"][0]["oldest_wait_ms"], 2500);
    assert_eq!(v["queues"][0]["stale"], false);
    assert_eq!(v["queues"][1]["stale"], true);
}

#[test]
fn every_subcommand_has_help() {
    for sub in [
        "status",
        "workers",
        "decisions",
        "explain",
        "drain",
        "undrain",
        "replay",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
            .args([sub, "--help"])
            .output()
            .expect("run metronome");
        assert!(out.status.success(), "{sub} --help");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("--nats-url") && text.contains("--json"),
            "{sub}: {text}"
        );
        assert!(text.contains("[env: NATS_URL="), "{sub}: {text}");
    }
}

/// Drain and undrain speak the worker-agent's control contract; here the test answers as
/// the agent would (worker-agent/tests/control.rs covers the agent's side).
#[tokio::test]
async fn drain_waits_until_the_workers_jobs_have_finished() {
    use futures::StreamExt;
    let env = env().await;
    let client = async_nats::connect(env.nats.url()).await.unwrap();
    let mut sub = client
        .subscribe(names::control_subject_all("n1-gpu3"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let agent = client.clone();
    tokio::spawn(async move {
        // Two jobs finish one per request; then nothing runs.
        let mut running: Vec<String> = vec!["a".into(), "b".into()];
        let mut draining = false;
        while let Some(m) = sub.next().await {
            match m.subject.rsplit('.').next() {
                Some("drain") => draining = true,
                Some("undrain") => draining = false,
                _ => {}
            }
            let reply = ControlReply {
                v: 1,
                worker_id: "n1-gpu3".into(),
                draining,
                running: running.len() as u32,
                in_flight: running.clone(),
                error: None,
            };
            running.pop();
            agent
                .publish(m.reply.unwrap(), serde_json::to_vec(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });

    let text = env
        .cli(&["drain", "n1-gpu3", "--wait"])
        .await
        .expect("drain");
    assert_eq!(
        text,
        "n1-gpu3: draining, 2 job(s) still running: a, b\n\
         n1-gpu3: draining, 1 job(s) still running: a\n\
         n1-gpu3: drained, no job running\n"
    );
    let json = env
        .cli(&["--json", "undrain", "n1-gpu3"])
        .await
        .expect("undrain");
    let r: ControlReply = serde_json::from_str(&json).expect("undrain --json parses");
    assert!(!r.draining);

    let err = env.cli(&["drain", "nobody"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert!(
        err.to_string()
            .contains("no worker-agent answers on control.nobody.drain"),
        "{err}"
    );
}

/// A writer the test can read while `decisions --follow` keeps writing.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

#[tokio::test]
async fn decisions_follow_prints_past_then_live_decisions_that_match() {
    let env = env().await;
    let now = unix_ms();
    let mut rejected = decision("past-rejected", 1, now);
    rejected.outcome = Outcome::Rejected;
    rejected.worker_id = None;
    rejected.reason_code = Some("queue_full".into());
    rejected.reason = Some("queue full".into());
    env.publish(
        names::decision_subject(None, "past-rejected"),
        "p:1",
        &rejected,
    )
    .await;
    let out = Shared::default();
    let url = env.nats.url();
    let cli = Cli::try_parse_from([
        "metronome",
        "--nats-url",
        &url,
        "decisions",
        "--follow",
        "--outcome",
        "rejected",
    ])
    .unwrap();
    let mut writer = out.clone();
    let task = tokio::spawn(async move { metronome_cli::run(cli, &mut writer).await });
    // The past is read after the live subscription exists, so once it shows, nothing
    // published from now on can be missed.
    metronome_testkit::wait_for(
        "the stored rejection",
        std::time::Duration::from_secs(10),
        || {
            let text = out.text();
            async move { text.contains("past-rejected").then_some(()) }
        },
    )
    .await;
    env.publish(
        names::decision_subject(None, "live-assigned"),
        "l:1",
        &decision("live-assigned", 1, now),
    )
    .await;
    let mut live = rejected.clone();
    live.job_id = "live-rejected".into();
    env.publish(
        names::decision_subject(None, "live-rejected"),
        "l2:1",
        &live,
    )
    .await;
    metronome_testkit::wait_for(
        "the live rejection",
        std::time::Duration::from_secs(10),
        || {
            let text = out.text();
            async move { text.contains("live-rejected").then_some(()) }
        },
    )
    .await;
    task.abort();
    let text = out.text();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(
        !text.contains("live-assigned"),
        "the filter holds live: {text}"
    );
}

/// The binary's exit codes, each made to happen, as `metronome --help` documents them:
/// 0 ok, 1 not found, 2 bad usage, 3 NATS unreachable, 4 `drain --wait` out of time, and
/// 0 when the reader of the output goes away.
#[tokio::test]
async fn the_binary_exits_as_documented() {
    use futures::StreamExt;
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let env = env().await;
    let run = |args: &[&str], url: &str| {
        Command::new(env!("CARGO_BIN_EXE_metronome"))
            .args(args)
            .env("NATS_URL", url)
            .output()
            .expect("run metronome")
    };
    let url = env.nats.url();
    let help = run(&["--help"], &url);
    assert_eq!(help.status.code(), Some(0));
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    for documented in [
        "0 ok",
        "1 not found",
        "2 bad usage",
        "3 NATS",
        "4 `drain --wait`",
    ] {
        assert!(help.contains(documented), "{documented}: {help}");
    }
    assert_eq!(run(&["status"], &url).status.code(), Some(0));
    assert_eq!(
        run(&["explain", "no-such-job"], &url).status.code(),
        Some(1)
    );
    assert_eq!(
        run(&["explain", "--no-such-flag"], &url).status.code(),
        Some(2)
    );
    let closed = format!("nats://127.0.0.1:{}", metronome_testkit::free_port());
    let unreachable = run(&["status"], &closed);
    assert_eq!(unreachable.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&unreachable.stderr).contains("cannot connect to NATS"));

    // A worker whose job never finishes: drain --wait gives up after a second.
    let client = async_nats::connect(env.nats.url()).await.unwrap();
    let mut sub = client
        .subscribe(names::control_subject_all("n1-gpu5"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let agent = client.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let reply = ControlReply {
                v: 1,
                worker_id: "n1-gpu5".into(),
                draining: true,
                running: 1,
                in_flight: vec!["forever".into()],
                error: None,
            };
            agent
                .publish(m.reply.unwrap(), serde_json::to_vec(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
    let drain = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            Command::new(env!("CARGO_BIN_EXE_metronome"))
                .args(["drain", "n1-gpu5", "--wait", "--timeout-s", "1"])
                .env("NATS_URL", url)
                .output()
                .expect("run metronome")
        }
    })
    .await
    .unwrap();
    assert_eq!(drain.status.code(), Some(4), "{drain:?}");

    // `decisions --follow | head -1`: the reader leaves after one line; the next decision
    // finds the pipe closed and the command ends with 0, saying nothing.
    let now = unix_ms();
    env.publish(
        names::decision_subject(None, "p1"),
        "p1:1",
        &decision("p1", 1, now),
    )
    .await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(["decisions", "--follow"])
        .env("NATS_URL", &url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn metronome");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("p1"), "{first}");
    // The reader is gone (its end of the pipe dropped with the BufReader).
    for i in 2..50 {
        let id = format!("p{i}");
        env.publish(
            names::decision_subject(None, &id),
            &format!("{id}:1"),
            &decision(&id, 1, now + i),
        )
        .await;
        if child.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let out = child.wait_with_output().expect("metronome ends");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}
