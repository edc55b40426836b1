//! A worker identity speaks only for what it was provisioned for. NATS lets a worker write
//! only its own key of the `workers` bucket (`tests/tests/permissions.rs`), so each
//! heartbeat here, written under the attacker's own key, is what that worker's stolen
//! credentials can do; the dispatcher reads the provisioning record (`provisioning_file`)
//! and gives no work to a worker whose heartbeat claims another model, a cap above its
//! ceiling, or an id never provisioned. Self-reported speed is bounded by the prior.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::{CompletionOutcome, PerfCoefficients, RejectionCode, WorkerStatus};
use metronome_testkit::wait_for;

/// The probe's figures: near-zero step and TTFT times, fitted on many jobs.
fn implausibly_fast() -> PerfCoefficients {
    PerfCoefficients {
        step_base_ms: 0.001,
        step_per_stream_ms: 0.0,
        step_per_ktok_ms: 0.0,
        stall_per_prefill_token_ms: 0.0,
        ttft_base_ms: 0.001,
        prefill_per_token_ms: 0.0,
        ttft_per_stream_ms: 0.0,
        step_error_ms: 0.0,
        samples: 1_000,
    }
}

fn claiming(id: &str, model: &str, cap: u32) -> WorkerStatus {
    let mut status = worker(id, model, cap);
    status.perf = Some(implausibly_fast());
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_claiming_another_model_or_more_capacity_than_provisioned_gets_no_jobs() {
    let env = Env::start().await;
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("workers.json");
    std::fs::write(
        &record,
        serde_json::json!({"v": 1, "workers": {
            "z-honest": {"model": "model-c", "max_concurrency": 1},
            "a-impostor": {"model": "model-q", "max_concurrency": 1},
            "b-inflated": {"model": "model-c", "max_concurrency": 1},
        }})
        .to_string(),
    )
    .unwrap();
    let mut config = env.config("provisioned");
    config.provisioning_file = Some(record.display().to_string());
    let (running, token) = env.dispatcher(config).await;

    // The honest worker holds one job at a time. The attackers (ids that sort first, so
    // they would also win every tie) claim model-c with room for 100,000 jobs: one is
    // provisioned for model-q, one for model-c with a ceiling of 1, one for nothing. All
    // four claim near-zero step times.
    let heartbeats = [
        claiming("z-honest", "model-c", 1),
        claiming("a-impostor", "model-c", 100_000),
        claiming("b-inflated", "model-c", 100_000),
        claiming("c-stranger", "model-c", 100_000),
    ];
    for status in &heartbeats {
        env.work_consumer(&status.worker_id).await;
        env.heartbeat(status).await;
    }
    let metrics = running.metrics.clone();
    wait_for("the workers registered", WAIT, || async {
        (metrics.workers_known.load(Relaxed) == 4).then_some(())
    })
    .await;

    // Three jobs: each one runs on the honest worker, after the one before it ended;
    // without the check the attackers take them at once.
    for job in ["j1", "j2", "j3"] {
        env.submit(job, "model-c", 10, 10).await;
    }
    for job in ["j1", "j2", "j3"] {
        let d = wait_for(&format!("{job} assigned"), WAIT, || async {
            env.decision(job).await.filter(|d| d.worker_id.is_some())
        })
        .await;
        assert_eq!(d.worker_id.as_deref(), Some("z-honest"), "{job}: {d:?}");
        let reason = |id: &str| {
            let r = d
                .rejected
                .iter()
                .find(|r| r.worker_id == id)
                .unwrap_or_else(|| panic!("{job}: {id} not among the rejected: {d:?}"));
            assert_eq!(r.code, RejectionCode::NotProvisioned, "{r:?}");
            r.reason.clone()
        };
        assert_eq!(
            reason("a-impostor"),
            "not provisioned: provisioned for model 'model-q', its heartbeat claims 'model-c'"
        );
        assert_eq!(
            reason("b-inflated"),
            "not provisioned: its heartbeat claims max_concurrency 100000, above its provisioned ceiling 1"
        );
        assert!(reason("c-stranger").contains("no provisioning record"));
        // The honest worker's claimed speed is believed only down to a twentieth of the
        // prior's figures: 2.5 ms to a first token, 1 ms a decode step (1,000 tokens/s).
        let p = d.candidates[0].prediction.expect("a prediction");
        assert!(p.ttft_ms >= 2.5, "{p:?}");
        assert!(p.step_tok_s.is_some_and(|r| r <= 1000.0), "{p:?}");
        let (assignment, _) = env.take_work("z-honest").await.remove(0);
        assert_eq!(assignment.job.id, job);
        env.complete(&assignment, CompletionOutcome::Done).await;
    }
    for id in ["a-impostor", "b-inflated", "c-stranger"] {
        assert!(
            env.decisions_for(&["j1".into(), "j2".into(), "j3".into()])
                .await
                .values()
                .all(|d| d.worker_id.as_deref() != Some(id)),
            "{id} was given a job"
        );
    }
    assert!(
        metrics.unprovisioned_heartbeats_total.load(Relaxed) >= 3,
        "each attacker's heartbeat counted"
    );

    // A heartbeat back within its provisioning makes the worker eligible again.
    let mut back = claiming("b-inflated", "model-c", 1);
    back.seq = 2;
    env.heartbeat(&back).await;
    env.heartbeat(&{
        let mut busy = claiming("z-honest", "model-c", 1);
        busy.seq = 2;
        busy.draining = true;
        busy
    })
    .await;
    env.submit("j4", "model-c", 10, 10).await;
    let d = wait_for("j4 assigned", WAIT, || async {
        env.decision("j4").await.filter(|d| d.worker_id.is_some())
    })
    .await;
    assert_eq!(d.worker_id.as_deref(), Some("b-inflated"), "{d:?}");

    token.cancel();
    running.join().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_or_malformed_provisioning_record_stops_the_dispatcher_at_start() {
    let env = Env::start().await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let malformed = dir.path().join("workers.json");
    std::fs::write(
        &malformed,
        r#"{"v": 1, "workers": {"w": {"model": "m", "max_concurrency": 0}}}"#,
    )
    .unwrap();
    for (path, needle) in [(&missing, "reading"), (&malformed, "at least 1")] {
        let mut config = env.config("bad-record");
        config.provisioning_file = Some(path.display().to_string());
        let error = match metronome_dispatcher::start(config, Default::default()).await {
            Ok(_) => panic!("started with {}", path.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains("provisioning_file") && error.contains(needle),
            "{error}"
        );
    }
}
