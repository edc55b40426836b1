//! Failure paths of the leader against real servers: heartbeats aged by this leader's
//! receipt (not the worker's clock), untrusted worker ids, publish failures that count as
//! attempts, and redelivered jobs that an earlier leader already decided.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::*;
use metronome_protocol::names;
use metronome_protocol::{CompletionEvent, CompletionOutcome, Decision, ErrorCode, Outcome};
use metronome_testkit::wait_for;

/// A worker whose clock lags 5 s behind (its `sent_ms` is 5 s old on arrival) but whose
/// heartbeats keep coming is alive: a leader taking over must not declare it dead (that
/// used to fail its running job with `worker_lost` and purge its work).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_clock_lags_stays_alive_across_a_takeover_and_gets_work() {
    let env = Env::start().await;
    let lag_ms = 5_000;
    let mut status = worker("lag-0", "model-l", 4);
    status.sent_ms = metronome_protocol::time::unix_ms() - lag_ms;
    status.in_flight = vec!["l-running".into()];
    status.active = 1;
    env.work_consumer("lag-0").await;
    env.heartbeat(&status).await;

    let mut config = env.config("lag");
    config.scheduler.heartbeat_timeout_ms = 3_000;
    let (running, token) = env.dispatcher(config).await;
    let metrics = running.metrics.clone();
    wait_for("the worker loaded", WAIT, || {
        let m = metrics.clone();
        async move { (m.workers_known.load(Relaxed) == 1).then_some(()) }
    })
    .await;

    // The worker keeps beating, every beat stamped by its lagging clock.
    let beating = env.keep_beating(status.clone(), Duration::from_millis(300), lag_ms);

    env.submit("l-new", "model-l", 10, 10).await;
    let d = env.decisions_for(&["l-new".to_string()]).await;
    assert_eq!(d["l-new"].outcome, Outcome::Assigned, "{:?}", d["l-new"]);
    assert_eq!(d["l-new"].worker_id.as_deref(), Some("lag-0"));
    let work = env.take_work("lag-0").await;
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].0.job.id, "l-new");
    assert_eq!(metrics.workers_lost_total.load(Relaxed), 0);
    assert!(
        env.final_result("l-running").await.is_none(),
        "the running job was failed as lost"
    );
    beating.stop().await;
    token.cancel();
    running.join().await.unwrap();
}

/// A heartbeat whose worker id is not a subject token would route work to `work.bad.id`,
/// which no stream captures: the job used to cycle forever with the same attempt. The
/// heartbeat is ignored (and counted), as is a completion event forged for another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_and_events_with_untrusted_ids_are_ignored() {
    let env = Env::start().await;
    // Valid as a KV key, not as a subject token.
    env.heartbeat(&worker("bad.id", "model-b", 4)).await;
    let (running, token) = env.dispatcher(env.config("ids")).await;
    let metrics = running.metrics.clone();
    wait_for("the bad heartbeat ignored", WAIT, || {
        let m = metrics.clone();
        async move { (m.ignored_worker_messages_total.load(Relaxed) == 1).then_some(()) }
    })
    .await;

    env.submit("b-1", "model-b", 10, 10).await;
    let d = env.decisions_for(&["b-1".to_string()]).await;
    assert_eq!(d["b-1"].outcome, Outcome::Rejected, "{:?}", d["b-1"]);
    assert_eq!(d["b-1"].reason_code.as_deref(), Some("unknown_model"));

    // A completion event on one worker's subject naming another worker.
    let forged = CompletionEvent {
        v: 1,
        job_id: "b-2".into(),
        worker_id: "victim-0".into(),
        model: "model-b".into(),
        epoch: 1,
        attempt: 1,
        outcome: CompletionOutcome::Done,
        streamed: true,
        error: None,
        prompt_tokens: 1,
        output_tokens: 1,
        ttft_ms: None,
        tpot_ms: None,
        e2e_ms: 1.0,
        finished_ms: 0,
        job: None,
    };
    env.store_json(names::event_done_subject("attacker-0"), &forged)
        .await;
    wait_for("the forged event ignored", WAIT, || {
        let m = metrics.clone();
        async move { (m.ignored_worker_messages_total.load(Relaxed) == 2).then_some(()) }
    })
    .await;
    token.cancel();
    running.join().await.unwrap();
}

/// An Assignment that cannot be published is an attempt: after `max_attempts` the job gets
/// a rejected decision instead of cycling forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_assignment_publishes_count_as_attempts() {
    let env = Env::start().await;
    env.workers("p", 1, "model-p", 8).await;
    let mut config = env.config("attempts");
    config.max_attempts = 3;
    let (running, token) = env.dispatcher(config).await;
    // No stream captures work.* any more: every Assignment publish fails.
    env.js.delete_stream(names::STREAM_WORK).await.unwrap();

    env.submit("p-1", "model-p", 10, 10).await;
    let d = env.decisions_for(&["p-1".to_string()]).await;
    let d = &d["p-1"];
    assert_eq!(d.outcome, Outcome::Rejected, "{d:?}");
    assert_eq!(d.reason_code.as_deref(), Some("max_attempts"));
    assert!(
        d.reason
            .as_deref()
            .is_some_and(|r| r.contains("publishing")),
        "{:?}",
        d.reason
    );
    let fin = wait_for("final result", WAIT, || env.final_result("p-1")).await;
    assert_eq!(fin.error.expect("error").code, ErrorCode::WorkerFailed);
    assert_eq!(running.metrics.publish_failures_total.load(Relaxed), 3);
    token.cancel();
    running.join().await.unwrap();
}

fn stored_decision(job_id: &str, outcome: Outcome) -> Decision {
    Decision {
        v: 1,
        job_id: job_id.into(),
        model: Some("model-d".into()),
        outcome,
        attempt: 1,
        reason: None,
        reason_code: None,
        worker_id: (outcome == Outcome::Assigned).then(|| "d-0".to_string()),
        cost: None,
        scoring: None,
        candidates: Vec::new(),
        rejected: Vec::new(),
        slo: None,
        policy: "metronome".into(),
        queue_wait_ms: 0,
        retry_after_ms: None,
        affinity: None,
        decision_latency_us: 0,
        epoch: 1,
        dispatcher_id: "earlier".into(),
        decided_ms: metronome_protocol::time::unix_ms(),
        tenant: None,
        priority: None,
        fair_counter: None,
    }
}

/// JOBS redelivers after 300 s but de-duplicates for 120 s, so a lost ack (or a restart
/// after two minutes) brings back a job an earlier leader already decided. It is
/// acknowledged without a second assignment; other jobs flow as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_job_with_a_stored_decision_is_not_assigned_again() {
    let env = Env::start().await;
    env.workers("d", 1, "model-d", 8).await;
    // What an earlier leader left: its decisions stored, the JOBS messages not acknowledged.
    for (id, outcome) in [("d-done", Outcome::Assigned), ("d-rej", Outcome::Rejected)] {
        let decision = stored_decision(id, outcome);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(names::HEADER_MSG_ID, names::decision_msg_id(id, 1).as_str());
        env.js
            .publish_with_headers(
                names::decision_subject(None, id),
                headers,
                serde_json::to_vec(&decision).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        env.submit(id, "model-d", 10, 10).await;
    }
    // A job no one decided yet, stored before the takeover too.
    env.submit("d-pending", "model-d", 10, 10).await;

    let (running, token) = env.dispatcher(env.config("dedup")).await;
    env.submit("d-new", "model-d", 10, 10).await;
    let ids = ["d-pending".to_string(), "d-new".to_string()];
    let d = env.decisions_for(&ids).await;
    for id in &ids {
        assert_eq!(d[id].outcome, Outcome::Assigned, "{id}: {:?}", d[id]);
    }
    wait_for("JOBS drained", WAIT, || async {
        let mut s = env.js.get_stream(names::STREAM_JOBS).await.unwrap();
        (s.info().await.unwrap().state.messages == 0).then_some(())
    })
    .await;
    let mut assigned: Vec<String> = env
        .take_work("d-0")
        .await
        .into_iter()
        .map(|(a, _)| a.job.id)
        .collect();
    assigned.sort();
    assert_eq!(assigned, ["d-new", "d-pending"]);
    for id in ["d-done", "d-rej"] {
        let d = env.decision(id).await.expect("stored decision");
        assert_eq!(d.dispatcher_id, "earlier", "{id} was decided again: {d:?}");
    }
    assert_eq!(
        running
            .metrics
            .redelivered_already_decided_total
            .load(Relaxed),
        2
    );
    token.cancel();
    running.join().await.unwrap();
}

/// A job refused by one worker goes to another on its next attempt while another can take
/// it, and the decision lists the refusing worker with why it was left out. Before, the
/// leader gave the retry back to the worker that had just refused it (idle again, the best
/// score): one refusing worker could use up every attempt of a job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_job_is_not_given_back_to_the_worker_that_refused_it() {
    let env = Env::start().await;
    env.workers("rf", 2, "model-rf", 4).await;
    let (running, token) = env.dispatcher(env.config("refusals")).await;
    env.submit("rf-job", "model-rf", 10, 10).await;
    let (first, assignment) = wait_for("the first assignment", WAIT, || async {
        for w in ["rf-0", "rf-1"] {
            if let Some((a, _)) = env.take_work(w).await.pop() {
                return Some((w, a));
            }
        }
        None
    })
    .await;
    env.complete(&assignment, CompletionOutcome::Refused).await;
    let d = wait_for("attempt 2 decided", WAIT, || async {
        env.decision("rf-job").await.filter(|d| d.attempt == 2)
    })
    .await;
    assert_eq!(d.outcome, Outcome::Assigned, "{d:?}");
    assert_ne!(
        d.worker_id.as_deref(),
        Some(first),
        "given back to the worker that refused it: {d:?}"
    );
    let left_out = d
        .rejected
        .iter()
        .find(|r| r.worker_id == first)
        .unwrap_or_else(|| panic!("{first} not listed as refused: {d:?}"));
    assert_eq!(left_out.code, metronome_protocol::RejectionCode::RefusedJob);
    let other = if first == "rf-0" { "rf-1" } else { "rf-0" };
    let work = wait_for("the retry on the other worker", WAIT, || async {
        let w = env.take_work(other).await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    assert_eq!(
        (work[0].0.job.id.as_str(), work[0].0.attempt),
        ("rf-job", 2)
    );
    token.cancel();
    running.join().await.unwrap();
}

/// An earlier leader assigned a job to a worker that fell silent before it took it, and
/// then died itself: the Assignment on `work.<worker>` is the only copy of the job, and no
/// heartbeat ever listed it. When the next leader declares the worker dead, its purge
/// reads that Assignment and hands the job back through JOBS (the next attempt) to a
/// live worker. The purge used to run only for workers this leader had booked jobs on,
/// and to delete what it found unread: the job was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_workers_unreported_assignment_from_an_earlier_leader_is_assigned_again() {
    let env = Env::start().await;
    let silent = worker("silent-0", "model-p", 4);
    let live = worker("live-0", "model-p", 4);
    for s in [&silent, &live] {
        env.work_consumer(&s.worker_id).await;
        env.heartbeat(s).await;
    }
    // What an earlier leader wrote before it died.
    let job: metronome_protocol::Job =
        serde_json::from_value(job_json("p-orphan", "model-p", 10, 10)).unwrap();
    let earlier = metronome_protocol::Assignment {
        v: metronome_protocol::PROTOCOL_VERSION,
        job,
        worker_id: "silent-0".into(),
        epoch: 1,
        attempt: 1,
        assigned_ms: metronome_protocol::time::unix_ms(),
        cached_prefix: None,
    };
    env.store_json(names::work_subject("silent-0"), &earlier)
        .await;

    let mut config = env.config("purge");
    config.scheduler.heartbeat_timeout_ms = 1_500;
    let (running, token) = env.dispatcher(config).await;
    // Only the live worker keeps beating.
    let beating = env.keep_beating(live.clone(), Duration::from_millis(300), 0);

    let rescued = wait_for(
        "the orphaned assignment on the live worker",
        WAIT,
        || async {
            let work = env.take_work("live-0").await;
            work.into_iter()
                .find(|(a, _)| a.job.id == "p-orphan")
                .map(|(a, _)| a)
        },
    )
    .await;
    assert_eq!(rescued.attempt, 2, "a rescue is the next attempt");
    assert_eq!(
        env.take_work("silent-0").await.len(),
        0,
        "the dead worker's copy is removed"
    );
    assert_eq!(running.metrics.rescued_jobs_total.load(Relaxed), 1);
    beating.stop().await;
    token.cancel();
    running.join().await.unwrap();
}

/// A worker restarted while an earlier leader's Assignment waited for it refuses the
/// redelivery (it cannot know whether its killed process started it). The new leader holds
/// no body for that job; the refusal carries it, and since the decision on record assigned
/// that attempt to that worker, the job is assigned again (next attempt, another worker)
/// instead of failing with `worker_failed`. A copy no decision supports (another worker
/// handing back a job it was not given, or one of its own making) is dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_job_an_earlier_leader_assigned_is_assigned_again_from_the_refusal() {
    let env = Env::start().await;
    let (first, first_token) = env.dispatcher(env.config("refusal-first")).await;
    let refuser = env.workers("rj", 1, "model-r", 1).await.remove(0);
    wait_for("the worker registered", WAIT, || async {
        (first.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    env.submit("r-1", "model-r", 10, 10).await;
    let decided = env.decisions_for(&["r-1".to_string()]).await;
    assert_eq!(
        decided["r-1"].worker_id.as_deref(),
        Some(refuser.worker_id.as_str())
    );
    let (assignment, _) = env.take_work(&refuser.worker_id).await.remove(0);
    first_token.cancel();
    first.join().await.unwrap();

    let live = env.workers("rj-live", 1, "model-r", 4).await.remove(0);
    let (second, second_token) = env.dispatcher(env.config("refusal-second")).await;
    wait_for("both workers registered", WAIT, || async {
        (second.metrics.workers_known.load(Relaxed) == 2).then_some(())
    })
    .await;
    let refusal = |worker_id: &str, job: &metronome_protocol::Job| CompletionEvent {
        v: metronome_protocol::PROTOCOL_VERSION,
        job_id: job.id.clone(),
        worker_id: worker_id.into(),
        model: job.model.clone(),
        epoch: assignment.epoch,
        attempt: 1,
        outcome: CompletionOutcome::Refused,
        streamed: false,
        error: Some("redelivered assignment this worker does not hold".into()),
        prompt_tokens: job.prompt_tokens,
        output_tokens: 0,
        ttft_ms: None,
        tpot_ms: None,
        e2e_ms: 0.0,
        finished_ms: metronome_protocol::time::unix_ms(),
        job: Some(Box::new(job.clone())),
    };
    // A worker that was never given r-1 hands it back with its own prompt, and one of its
    // own making under another tenant: no decision supports either copy.
    let mut altered = assignment.job.clone();
    altered.request = serde_json::json!({"prompt": "not the client's"});
    let mut made_up = assignment.job.clone();
    made_up.id = "r-made-up".into();
    made_up.tenant = Some("victim".into());
    for job in [&altered, &made_up] {
        env.store_json(
            names::event_done_subject("rj-thief"),
            &refusal("rj-thief", job),
        )
        .await;
    }
    wait_for("both copies dropped", WAIT, || async {
        (second.metrics.unvouched_refusal_jobs_total.load(Relaxed) == 2).then_some(())
    })
    .await;
    // The worker it was assigned to refuses it, carrying the job as it received it.
    env.store_json(
        names::event_done_subject(&refuser.worker_id),
        &refusal(&refuser.worker_id, &assignment.job),
    )
    .await;
    let again = wait_for("the refused job on the other worker", WAIT, || async {
        let work = env.take_work(&live.worker_id).await;
        work.into_iter().map(|(a, _)| a).find(|a| a.job.id == "r-1")
    })
    .await;
    assert_eq!(again.attempt, 2, "a retry is the next attempt");
    assert_eq!(again.job, assignment.job, "the client's job, unchanged");
    wait_for("the retry's decision on record", WAIT, || async {
        env.decision("r-1")
            .await
            .filter(|d| d.attempt == 2 && d.worker_id == Some(live.worker_id.clone()))
    })
    .await;
    assert!(
        env.decision("r-made-up").await.is_none(),
        "a job a worker made up was decided"
    );
    assert!(env.take_work(&refuser.worker_id).await.is_empty());
    second_token.cancel();
    second.join().await.unwrap();
}
