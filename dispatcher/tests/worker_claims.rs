//! One worker's credentials speak only for the jobs that worker holds: a refusal or a
//! completion it publishes (under its own id, as NATS permissions force it to) about a job
//! assigned to another worker is dropped and counted, and the job runs on where it was
//! placed (no second attempt, no early end).

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::{names, CompletionEvent, CompletionOutcome};
use metronome_testkit::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_refuse_or_finish_another_workers_job() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("claims")).await;
    // The victim serves model-c with room for a second attempt; the attacker serves
    // another model (the probe's case: a qwen identity against a llama job).
    env.heartbeat(&worker("victim", "model-c", 2)).await;
    env.work_consumer("victim").await;
    env.heartbeat(&worker("attacker", "model-q", 1)).await;
    env.work_consumer("attacker").await;

    env.submit("j1", "model-c", 10, 10).await;
    let placed = wait_for("j1 assigned", WAIT, || async {
        env.decision("j1").await.filter(|d| d.worker_id.is_some())
    })
    .await;
    assert_eq!(
        (placed.worker_id.as_deref(), placed.attempt),
        (Some("victim"), 1)
    );
    let (assignment, _) = env.take_work("victim").await.remove(0);

    // The attacker learned j1's id; it refuses it, then finishes it with made-up counts.
    for (outcome, output_tokens) in [
        (CompletionOutcome::Refused, 0),
        (CompletionOutcome::Done, 1_000_000_000),
    ] {
        let forged = CompletionEvent {
            v: 1,
            job_id: "j1".into(),
            worker_id: "attacker".into(),
            model: "model-c".into(),
            epoch: assignment.epoch,
            attempt: assignment.attempt,
            outcome,
            streamed: outcome == CompletionOutcome::Done,
            error: None,
            prompt_tokens: 10,
            output_tokens,
            ttft_ms: Some(1.0),
            tpot_ms: Some(1.0),
            e2e_ms: 2.0,
            finished_ms: metronome_protocol::time::unix_ms(),
            job: None,
        };
        env.store_json(names::event_done_subject("attacker"), &forged)
            .await;
    }

    // Either both forged events are dropped, or (the defect) the refusal made the leader
    // assign j1 a second time.
    let metrics = running.metrics.clone();
    wait_for("the forged events handled", WAIT, || async {
        let dropped = metrics.worker_claims_dropped_total.load(Relaxed) >= 2;
        let reassigned = env.decision("j1").await.is_some_and(|d| d.attempt > 1);
        (dropped || reassigned).then_some(())
    })
    .await;
    let latest = env.decision("j1").await.expect("j1's decision");
    assert_eq!(
        (latest.worker_id.as_deref(), latest.attempt),
        (Some("victim"), 1),
        "a forged refusal must not assign the job again"
    );
    assert_eq!(metrics.worker_claims_dropped_total.load(Relaxed), 2);

    // The victim's own completion still counts: its slot is free for the next job.
    env.complete(&assignment, CompletionOutcome::Done).await;
    env.submit("j2", "model-c", 10, 10).await;
    env.submit("j3", "model-c", 10, 10).await;
    let both = env.decisions_for(&["j2".into(), "j3".into()]).await;
    assert!(both
        .values()
        .all(|d| d.worker_id.as_deref() == Some("victim")));
    assert_eq!(metrics.worker_claims_dropped_total.load(Relaxed), 2);

    token.cancel();
    running.join().await.unwrap();
}
