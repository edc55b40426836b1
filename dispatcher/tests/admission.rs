//! Admission: with every worker at its cap, further jobs wait and start in FIFO order (per
//! model) as completions arrive; a full model never delays another model's jobs; beyond
//! the queue bound, past the deadline, for an unknown model or on cancellation a job gets
//! a rejected (or expired) decision and a final result that says why.

use crate::common;

use common::*;
use metronome_protocol::{names, CompletionOutcome, ErrorCode, Outcome};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_model_queues_fifo_and_never_blocks_another_model() {
    let env = Env::start().await;
    let mut config = env.config("admission");
    config.queue_bound_per_model = 3;
    let (running, token) = env.dispatcher(config).await;
    env.workers("a", 2, "model-a", 1).await;
    env.workers("b", 1, "model-b", 1).await;
    metronome_testkit::wait_for("workers registered", WAIT, || async {
        (running
            .metrics
            .workers_known
            .load(std::sync::atomic::Ordering::Relaxed)
            == 3)
            .then_some(())
    })
    .await;

    // Fill model-a (two workers, cap 1 each).
    let ids = |r: std::ops::Range<usize>| r.map(|i| format!("a{i}")).collect::<Vec<_>>();
    for id in ids(1..3) {
        env.submit(&id, "model-a", 10, 10).await;
    }
    let first = env.decisions_for(&ids(1..3)).await;
    assert!(first.values().all(|d| d.outcome == Outcome::Assigned));

    // Three more wait (the queue bound is 3); a fourth is refused; model-b goes at once.
    for id in ids(3..7) {
        env.submit(&id, "model-a", 10, 10).await;
    }
    env.submit("b1", "model-b", 10, 10).await;
    let b = env
        .decisions_for(&["b1".to_string(), "a6".to_string()])
        .await;
    assert_eq!(b["b1"].outcome, Outcome::Assigned);
    assert_eq!(b["b1"].worker_id.as_deref(), Some("b-0"));
    assert_eq!(b["a6"].outcome, Outcome::Rejected);
    assert_eq!(b["a6"].reason_code.as_deref(), Some("queue_full"));
    let fin = env
        .final_result("a6")
        .await
        .expect("queue_full final result");
    assert_eq!(fin.error.unwrap().code, ErrorCode::QueueFull);
    // b1 was read after a3..a5 and decided; they are still waiting.
    for id in ids(3..6) {
        assert!(env.decision(&id).await.is_none(), "{id} should wait");
    }

    // Each completion starts exactly the next job of model-a, in order.
    let mut running_jobs: Vec<_> = Vec::new();
    for w in ["a-0", "a-1"] {
        running_jobs.extend(env.take_work(w).await.into_iter().map(|(a, _)| a));
    }
    for next in ids(3..6) {
        let done = running_jobs.remove(0);
        env.complete(&done, CompletionOutcome::Done).await;
        let d = env.decisions_for(std::slice::from_ref(&next)).await;
        assert_eq!(d[&next].outcome, Outcome::Assigned);
        assert_eq!(
            d[&next].worker_id.as_deref(),
            Some(done.worker_id.as_str()),
            "{next} takes the freed slot"
        );
        let later: Vec<String> = ids(3..6).into_iter().filter(|i| i > &next).collect();
        for id in &later {
            assert!(
                env.decision(id).await.is_none(),
                "{id} started before {next}"
            );
        }
        running_jobs.extend(
            env.take_work(&done.worker_id)
                .await
                .into_iter()
                .map(|(a, _)| a),
        );
    }
    token.cancel();
    running.join().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_jobs_expire_cancel_and_unknown_models_are_rejected_with_reasons() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("admission-2")).await;
    env.workers("c", 1, "model-c", 1).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running
            .metrics
            .workers_known
            .load(std::sync::atomic::Ordering::Relaxed)
            == 1)
            .then_some(())
    })
    .await;
    env.submit("busy", "model-c", 10, 10).await;
    env.decisions_for(&["busy".to_string()]).await;

    // Waits past its deadline.
    let mut job = job_json("late", "model-c", 10, 10);
    job["deadline_ms"] = serde_json::json!(metronome_protocol::time::unix_ms() + 300);
    env.submit_raw("late", job).await;
    // Waits, then is cancelled.
    env.submit("cancel-me", "model-c", 10, 10).await;
    metronome_testkit::wait_for("cancel-me queued", WAIT, || async {
        let depth = running
            .metrics
            .queue_depth
            .lock()
            .unwrap()
            .get("model-c")
            .copied();
        (depth == Some(2)).then_some(())
    })
    .await;
    env.client
        .publish(names::cancel_subject(None, "cancel-me"), "".into())
        .await
        .unwrap();
    // Nobody serves this model.
    env.submit("nobody", "model-z", 10, 10).await;

    let d = env
        .decisions_for(&[
            "late".to_string(),
            "cancel-me".to_string(),
            "nobody".to_string(),
        ])
        .await;
    assert_eq!(d["late"].outcome, Outcome::Expired);
    assert_eq!(d["late"].reason_code.as_deref(), Some("deadline_exceeded"));
    assert_eq!(d["cancel-me"].outcome, Outcome::Rejected);
    assert_eq!(d["cancel-me"].reason_code.as_deref(), Some("cancelled"));
    assert_eq!(d["nobody"].outcome, Outcome::Rejected);
    assert_eq!(d["nobody"].reason_code.as_deref(), Some("unknown_model"));
    for (id, code) in [
        ("late", ErrorCode::DeadlineExceeded),
        ("cancel-me", ErrorCode::Cancelled),
        ("nobody", ErrorCode::UnknownModel),
    ] {
        let fin = metronome_testkit::wait_for("final result", WAIT, || env.final_result(id)).await;
        assert_eq!(fin.error.expect("an error").code, code, "{id}");
    }
    token.cancel();
    running.join().await.unwrap();
}
