//! Jobs that cannot be served in time are answered at once, with a reason the client can act
//! on, instead of holding their clients and their queue until a deadline: a job no worker
//! could ever hold (rejected `unplaceable`), and a job whose deadline falls before the queue
//! is predicted to reach it (rejected `deadline_unmeetable`, 429 with a `Retry-After`).
//! Against a real nats-server; workers are heartbeats and completion events from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::*;
use metronome_protocol::{CompletionOutcome, ErrorCode, KvUsage, Outcome};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_worker_can_ever_hold_is_rejected_at_once_and_blocks_nobody() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("unplaceable")).await;
    for i in 0..2 {
        let mut status = worker(&format!("small-{i}"), "model-s", 4);
        status.kv = Some(KvUsage {
            used_frac: 0.0,
            capacity_tokens: Some(4_000),
        });
        env.work_consumer(&status.worker_id).await;
        env.heartbeat(&status).await;
    }
    metronome_testkit::wait_for("workers registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 2).then_some(())
    })
    .await;

    // 100 + 8 000 KV tokens: more than 95 % of 4 000 on every worker, now and forever.
    env.submit("huge", "model-s", 100, 8_000).await;
    env.submit("small", "model-s", 100, 100).await;
    let d = env
        .decisions_for(&["huge".to_string(), "small".to_string()])
        .await;
    assert_eq!(d["huge"].outcome, Outcome::Rejected, "{:?}", d["huge"]);
    assert_eq!(d["huge"].reason_code.as_deref(), Some("unplaceable"));
    let reason = d["huge"].reason.clone().unwrap_or_default();
    assert!(
        reason.contains("8100 KV tokens") && reason.contains("4000 tokens"),
        "{reason}"
    );
    let fin = env.final_result("huge").await.expect("final result");
    assert_eq!(fin.error.unwrap().code, ErrorCode::InvalidJob);
    assert_eq!(d["small"].outcome, Outcome::Assigned, "{:?}", d["small"]);
    token.cancel();
    running.join().await.unwrap();
}

/// A queue drained by one worker that frees a slot every ~150 ms: a job with nine jobs
/// ahead of it needs about 1.5 s, so a deadline 600 ms away cannot be met. The dispatcher
/// answers it at once with a `Retry-After`, instead of expiring it after 600 ms; jobs with
/// time to wait keep waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_the_queue_cannot_reach_is_answered_at_once_with_retry_after() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("unmeetable")).await;
    env.workers("u", 1, "model-u", 1).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;

    let ids: Vec<String> = (0..20).map(|i| format!("q{i:02}")).collect();
    for id in &ids {
        env.submit(id, "model-u", 10, 10).await;
    }
    // Serve ten of them one at a time: the queue is seen draining.
    let mut served = 0;
    while served < 10 {
        for (a, _) in env.take_work("u-0").await {
            tokio::time::sleep(Duration::from_millis(150)).await;
            env.complete(&a, CompletionOutcome::Done).await;
            served += 1;
        }
    }
    // The eleventh runs, nine wait.
    metronome_testkit::wait_for("the next job assigned", WAIT, || async {
        env.decision(&ids[10]).await.map(|_| ())
    })
    .await;

    let deadline = metronome_protocol::time::unix_ms() + 600;
    let mut body = job_json("late", "model-u", 10, 10);
    body["deadline_ms"] = deadline.into();
    env.submit_raw("late", body).await;
    let d = env.decisions_for(&["late".to_string()]).await;
    let late = &d["late"];
    assert_eq!(late.outcome, Outcome::Rejected, "{late:?}");
    assert_eq!(late.reason_code.as_deref(), Some("deadline_unmeetable"));
    assert!(
        late.decided_ms < deadline,
        "answered at once, not at the deadline: {late:?}"
    );
    let retry = late.retry_after_ms.expect("a Retry-After");
    assert!(
        retry > 600,
        "the predicted wait exceeds the time left: {retry}"
    );
    let fin = env.final_result("late").await.expect("final result");
    assert_eq!(fin.error.unwrap().code, ErrorCode::QueueFull);
    assert_eq!(running.metrics.deadline_unmeetable_total.load(Relaxed), 1);
    // The jobs with a 60 s deadline still wait for their turn.
    for id in &ids[11..] {
        assert!(env.decision(id).await.is_none(), "{id} should still wait");
    }
    token.cancel();
    running.join().await.unwrap();
}

/// Whether a job can meet its deadline is judged by where fair sharing puts it, not by
/// arrival order: a light tenant's job behind a flood is served next, so it must not be
/// refused for the flood's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_behind_a_flood_is_not_refused_as_unmeetable() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("unmeetable-fair")).await;
    env.workers("f", 1, "model-f", 1).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    let flood = |i: usize| {
        let mut body = job_json(&format!("a{i:03}"), "model-f", 10, 10);
        body["tenant"] = "flood".into();
        body
    };
    for i in 0..20 {
        env.submit_raw(&format!("a{i:03}"), flood(i)).await;
    }
    // Serve ten one at a time: the queue is seen draining.
    let mut served = 0;
    while served < 10 {
        for (a, _) in env.take_work("f-0").await {
            tokio::time::sleep(Duration::from_millis(150)).await;
            env.complete(&a, CompletionOutcome::Done).await;
            served += 1;
        }
    }
    metronome_testkit::wait_for("the next job assigned", WAIT, || async {
        env.decision("a010").await.map(|_| ())
    })
    .await;
    // A long flood behind it: over a hundred placements, far beyond 5 s at this rate.
    for i in 20..130 {
        env.submit_raw(&format!("a{i:03}"), flood(i)).await;
    }
    let mut light = job_json("light", "model-f", 10, 10);
    light["tenant"] = "light".into();
    light["deadline_ms"] = (metronome_protocol::time::unix_ms() + 5_000).into();
    env.submit_raw("light", light).await;

    // Placements from here on, in order, until the light job's turn.
    let mut order = Vec::new();
    for _ in 0..50 {
        if env.decision("light").await.is_some() || order.len() >= 10 {
            break;
        }
        for (a, _) in env.take_work("f-0").await {
            order.push(a.job.id.clone());
            env.complete(&a, CompletionOutcome::Done).await;
        }
    }
    let d = env
        .decision("light")
        .await
        .expect("a decision for the light job");
    assert_eq!(
        d.outcome,
        Outcome::Assigned,
        "served, not refused: {:?} {:?}",
        d.reason_code,
        d.reason
    );
    assert_eq!(d.tenant.as_deref(), Some("light"));
    // a010 was already running. The light job is lifted to the flood's counter and wins
    // the tie, but each flood completion settles an over-estimated charge (10 output tokens
    // asked, 1 made), which can put the flood back under it for a job or two: a few
    // placements, not the 119 ahead of it in arrival order.
    assert!(order.len() <= 4, "placed before it: {order:?}");
    assert_eq!(running.metrics.deadline_unmeetable_total.load(Relaxed), 0);
    token.cancel();
    running.join().await.unwrap();
}
