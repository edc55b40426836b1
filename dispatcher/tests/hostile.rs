//! Malformed and hostile inputs on `jobs.submit`: each is rejected with a reason (a
//! rejected Decision plus an `invalid_job` final result when an id can be salvaged, a
//! `deadletter.jobs` record otherwise, or a refusal by the server at publish time), and
//! the dispatcher keeps dispatching.

use crate::common;

use std::collections::HashMap;

use common::*;
use futures::StreamExt;
use metronome_protocol::{names, ErrorCode, Outcome};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_jobs_are_rejected_with_reasons_and_dispatching_continues() {
    let env = Env::start().await;
    let mut config = env.config("hostile");
    config.job_limits.max_job_bytes = 64 * 1024;
    let (running, token) = env.dispatcher(config).await;
    env.workers("h", 2, "model-h", 8).await;
    let mut dead_letters = env
        .client
        .subscribe(names::SUBJECT_DEAD_LETTER)
        .await
        .unwrap();
    env.client.flush().await.unwrap();

    let mut with_id: Vec<(&str, serde_json::Value, &str)> = Vec::new();
    let mut j = job_json("h-types", "model-h", 10, 10);
    j["max_tokens"] = json!("many");
    with_id.push(("h-types", j, "malformed_job"));
    let mut j = job_json("h-negative", "model-h", 10, 10);
    j["prompt_tokens"] = json!(-5);
    with_id.push(("h-negative", j, "malformed_job"));
    let mut j = job_json("h-huge", "model-h", 10, 10);
    j["max_tokens"] = json!(4_000_000_000u64);
    with_id.push(("h-huge", j, "too_many_tokens"));
    let mut j = job_json("h-zero", "model-h", 10, 10);
    j["max_tokens"] = json!(0);
    with_id.push(("h-zero", j, "zero_max_tokens"));
    let mut j = job_json("h-version", "model-h", 10, 10);
    j["v"] = json!(99);
    with_id.push(("h-version", j, "unsupported_version"));
    let mut j = job_json("h-request", "model-h", 10, 10);
    j["request"] = json!("not an object");
    with_id.push(("h-request", j, "request_not_object"));
    with_id.push((
        "h-unknown",
        job_json("h-unknown", "no-such-model", 10, 10),
        "unknown_model",
    ));
    for (id, body, _) in &with_id {
        env.submit_raw(id, body.clone()).await;
    }
    // Larger than the dispatcher's job limit but under the server's payload limit.
    let mut big = job_json("h-big", "model-h", 10, 10);
    big["request"] = json!({ "messages": [{ "role": "user", "content": "x".repeat(200 * 1024) }] });
    env.submit_raw("h-big", big).await;

    // Without a usable id: dead-lettered.
    env.submit_bytes("dl-1", b"this is not json".to_vec()).await;
    env.submit_bytes(
        "dl-2",
        serde_json::to_vec(&json!({"id": "bad.id", "model": "m"})).unwrap(),
    )
    .await;
    env.submit_bytes("dl-3", serde_json::to_vec(&json!([1, 2, 3])).unwrap())
        .await;

    // 10 MB: the server refuses it at publish time (its max payload / the stream's max
    // message size), which the publisher sees as an error with the reason.
    let huge = vec![b'{'; 10 * 1024 * 1024];
    let refused = match env
        .js
        .publish(names::submit_subject(None), huge.into())
        .await
    {
        Err(e) => Some(e.to_string()),
        Ok(ack) => ack.await.err().map(|e| e.to_string()),
    };
    assert!(refused.is_some(), "a 10 MB job must be refused");

    // And valid work still flows.
    let ok: Vec<String> = (0..5).map(|i| format!("h-ok-{i}")).collect();
    for id in &ok {
        env.submit(id, "model-h", 10, 10).await;
    }

    let mut ids: Vec<String> = with_id.iter().map(|(id, _, _)| id.to_string()).collect();
    ids.push("h-big".into());
    ids.extend(ok.iter().cloned());
    let decisions = env.decisions_for(&ids).await;
    let expected: HashMap<&str, &str> = with_id
        .iter()
        .map(|(id, _, code)| (*id, *code))
        .chain([("h-big", "job_too_large")])
        .collect();
    for (id, code) in &expected {
        let d = &decisions[*id];
        assert_eq!(d.outcome, Outcome::Rejected, "{id}");
        assert_eq!(
            d.reason_code.as_deref(),
            Some(*code),
            "{id}: {:?}",
            d.reason
        );
        assert!(d.reason.as_deref().is_some_and(|r| !r.is_empty()));
        let fin = metronome_testkit::wait_for("final result", WAIT, || env.final_result(id)).await;
        let want = if *code == "unknown_model" {
            ErrorCode::UnknownModel
        } else {
            ErrorCode::InvalidJob
        };
        assert_eq!(fin.error.expect("error").code, want, "{id}");
    }
    for id in &ok {
        assert_eq!(decisions[id].outcome, Outcome::Assigned, "{id}");
    }

    let mut reasons = Vec::new();
    for _ in 0..3 {
        let m = tokio::time::timeout(WAIT, dead_letters.next())
            .await
            .expect("dead letter")
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert!(v["reason"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
        reasons.push(v["reason_code"].as_str().unwrap().to_string());
    }
    assert_eq!(
        reasons,
        ["malformed_job", "malformed_job", "malformed_job"],
        "{reasons:?}"
    );
    assert!(
        running
            .metrics
            .malformed_jobs_total
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 10
    );
    // Every JOBS message was settled (work-queue stream: acknowledged = removed).
    metronome_testkit::wait_for("JOBS drained", WAIT, || async {
        let mut s = env.js.get_stream(names::STREAM_JOBS).await.unwrap();
        (s.info().await.unwrap().state.messages == 0).then_some(())
    })
    .await;
    token.cancel();
    running.join().await.unwrap();
}

/// A model name with CR/LF used to pass validation; the publisher then built a NATS header
/// from it, async-nats panicked, the publisher task died and every later outcome was
/// dropped while the leader kept its lease. Now it is rejected with its reason, and the
/// same leader goes on assigning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_with_cr_lf_is_rejected_and_the_same_leader_keeps_assigning() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("crlf")).await;
    let epoch = running
        .metrics
        .epoch
        .load(std::sync::atomic::Ordering::Relaxed);
    env.workers("c", 1, "model-c", 8).await;

    // Straight to NATS, as any client could.
    env.submit_raw("c-bad", job_json("c-bad", "a\r\nb", 10, 10))
        .await;
    let mut long = job_json("c-long", "model-c", 10, 10);
    long["model"] = json!("m".repeat(300));
    env.submit_raw("c-long", long).await;
    env.submit("c-ok", "model-c", 10, 10).await;

    let ids = [
        "c-bad".to_string(),
        "c-long".to_string(),
        "c-ok".to_string(),
    ];
    let decisions = env.decisions_for(&ids).await;
    let bad = &decisions["c-bad"];
    assert_eq!(bad.outcome, Outcome::Rejected, "{bad:?}");
    assert_eq!(bad.reason_code.as_deref(), Some("model_control_char"));
    assert!(
        bad.reason
            .as_deref()
            .is_some_and(|r| r.contains("control character")),
        "{:?}",
        bad.reason
    );
    let fin = metronome_testkit::wait_for("final result", WAIT, || env.final_result("c-bad")).await;
    assert_eq!(fin.error.expect("error").code, ErrorCode::InvalidJob);
    assert_eq!(
        decisions["c-long"].reason_code.as_deref(),
        Some("model_too_long")
    );

    let ok = &decisions["c-ok"];
    assert_eq!(ok.outcome, Outcome::Assigned, "{ok:?}");
    assert_eq!(ok.dispatcher_id, "crlf");
    assert_eq!(ok.epoch, epoch, "the same term assigned it");
    assert_eq!(env.take_work("c-0").await.len(), 1);
    let m = &running.metrics;
    assert_eq!(m.is_leader.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(
        m.term_task_failures_total
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    token.cancel();
    running.join().await.unwrap();
}

/// A job whose start deadline had already passed when it arrived (the hostile drill sent
/// deadlines of 0, 1 and an hour ago) used to be assigned and run whenever a worker was
/// free. It is expired with its reason instead, and the same leader goes on assigning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_start_deadline_on_arrival_is_expired_not_run() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("late")).await;
    env.workers("l", 1, "model-l", 8).await;

    let now = metronome_protocol::time::unix_ms();
    let mut ids = Vec::new();
    for (id, deadline) in [("late-zero", 0), ("late-hour", now - 3_600_000)] {
        let mut j = job_json(id, "model-l", 10, 10);
        j["deadline_ms"] = json!(deadline);
        env.submit_raw(id, j).await;
        ids.push(id.to_string());
    }
    env.submit("late-ok", "model-l", 10, 10).await;
    ids.push("late-ok".into());

    let decisions = env.decisions_for(&ids).await;
    for id in ["late-zero", "late-hour"] {
        let d = &decisions[id];
        assert_eq!(d.outcome, Outcome::Expired, "{id}: {d:?}");
        assert_eq!(d.reason_code.as_deref(), Some("deadline_exceeded"), "{id}");
        assert!(
            d.reason
                .as_deref()
                .is_some_and(|r| r.contains("had passed")),
            "{:?}",
            d.reason
        );
        let fin = metronome_testkit::wait_for("final result", WAIT, || env.final_result(id)).await;
        assert_eq!(fin.error.expect("error").code, ErrorCode::DeadlineExceeded);
    }
    assert_eq!(decisions["late-ok"].outcome, Outcome::Assigned);
    let work = env.take_work("l-0").await;
    assert_eq!(work.len(), 1, "only the job in time reaches the worker");
    assert_eq!(work[0].0.job.id, "late-ok");
    token.cancel();
    running.join().await.unwrap();
}
