//! A job's truth stays in JetStream until it is settled, across leader changes: retries go
//! back to JOBS, completion events wait in a durable consumer for the next leader, cancels
//! that overtake their job are not lost, and dead workers leave the registry.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use metronome_protocol::names;
use metronome_protocol::{CompletionOutcome, ErrorCode, Outcome};
use metronome_testkit::wait_for;

/// A refused job is retried from JOBS, not from the leader's memory: the leader that
/// re-queued it stops, the next one assigns it (attempt 2). It used to be lost: its JOBS
/// message was acknowledged at the first assignment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_requeued_after_a_refusal_survives_a_leader_change() {
    let env = Env::start().await;
    let mut w = worker("rq-0", "model-rq", 4);
    env.work_consumer("rq-0").await;
    env.heartbeat(&w).await;
    let (first, token) = env.dispatcher(env.config("first")).await;
    env.submit("rq-1", "model-rq", 10, 10).await;
    let work = wait_for("the first assignment", WAIT, || async {
        let w = env.take_work("rq-0").await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    assert_eq!(work[0].0.attempt, 1);
    // The worker drains, then refuses: no worker can take the retry now. The refusal must
    // reach the leader after the drain (they travel on different streams): a heartbeat of
    // another model's worker, put after the drain, is applied after it, so once the leader
    // knows two workers it has seen the drain.
    w.draining = true;
    w.seq += 1;
    env.heartbeat(&w).await;
    env.heartbeat(&worker("rq-marker", "model-other", 4)).await;
    wait_for("the leader to see the drain", WAIT, || async {
        (first.metrics.workers_known.load(Relaxed) == 2).then_some(())
    })
    .await;
    env.complete(&work[0].0, CompletionOutcome::Refused).await;
    wait_for("the retry put back on jobs.submit", WAIT, || async {
        let mut s = env.js.get_stream(names::STREAM_JOBS).await.unwrap();
        (s.info().await.unwrap().state.messages == 1).then_some(())
    })
    .await;
    token.cancel();
    first.join().await.unwrap();

    // The next leader finds the worker open again and the retry in JOBS.
    w.draining = false;
    w.seq += 1;
    env.heartbeat(&w).await;
    let (second, token) = env.dispatcher(env.config("second")).await;
    let work = wait_for("the retry assigned", WAIT, || async {
        let w = env.take_work("rq-0").await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].0.job.id, "rq-1");
    assert_eq!(work[0].0.attempt, 2, "{:?}", work[0].0);
    let d = wait_for("attempt 2 decided", WAIT, || async {
        env.decision("rq-1").await.filter(|d| d.attempt == 2)
    })
    .await;
    assert_eq!(d.outcome, Outcome::Assigned);
    assert_eq!(d.dispatcher_id, "second");
    token.cancel();
    second.join().await.unwrap();
}

/// A refusal published while no leader runs is seen by the next leader (the EVENTS reader
/// is durable). This one was assigned by a leader that is gone, so the next one cannot
/// retry it and tells its client; before, nobody ever answered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_published_while_no_leader_runs_is_seen_by_the_next_one() {
    let env = Env::start().await;
    env.workers("nl", 1, "model-nl", 4).await;
    let (first, token) = env.dispatcher(env.config("first")).await;
    env.submit("nl-1", "model-nl", 10, 10).await;
    let work = wait_for("the assignment", WAIT, || async {
        let w = env.take_work("nl-0").await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    token.cancel();
    first.join().await.unwrap();

    env.complete(&work[0].0, CompletionOutcome::Refused).await;
    let (second, token) = env.dispatcher(env.config("second")).await;
    let fin = wait_for("the client is told", WAIT, || env.final_result("nl-1")).await;
    assert_eq!(fin.error.expect("error").code, ErrorCode::WorkerFailed);
    token.cancel();
    second.join().await.unwrap();
}

/// A cancel that reaches the leader before its job does (the cancel is a core message, the
/// job waits in JOBS) is applied when the job arrives: it used to be dropped, and the job
/// ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_overtakes_its_job_is_applied_when_the_job_arrives() {
    let env = Env::start().await;
    env.workers("co", 1, "model-co", 4).await;
    let (running, token) = env.dispatcher(env.config("cancel")).await;
    // Cancels are plain NATS messages: one sent before a leader subscribes reaches no one.
    // A first decided job says the leader is subscribed.
    env.submit("co-leading", "model-co", 10, 10).await;
    env.decisions_for(&["co-leading".to_string()]).await;
    env.client
        .publish(names::cancel_subject(None, "co-1"), bytes::Bytes::new())
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    // Poll with a job that was not cancelled: once it is decided, so was the cancel read.
    env.submit("co-marker", "model-co", 10, 10).await;
    env.decisions_for(&["co-marker".to_string()]).await;
    env.submit("co-1", "model-co", 10, 10).await;
    let d = env.decisions_for(&["co-1".to_string()]).await;
    assert_eq!(d["co-1"].outcome, Outcome::Rejected, "{:?}", d["co-1"]);
    assert_eq!(d["co-1"].reason_code.as_deref(), Some("cancelled"));
    let fin = wait_for("final result", WAIT, || env.final_result("co-1")).await;
    assert_eq!(fin.error.expect("error").code, ErrorCode::Cancelled);
    let ids: Vec<String> = env
        .take_work("co-0")
        .await
        .into_iter()
        .map(|(a, _)| a.job.id)
        .collect();
    assert_eq!(ids, ["co-leading", "co-marker"]);
    token.cancel();
    running.join().await.unwrap();
}

/// A cancel for a job whose Assignment is on its way (not yet reported by the worker) is
/// relayed to that worker at once (`control.<worker>.cancel`, the only cancels a worker
/// hears), and may reach it before the Assignment and be lost there: the leader relays it
/// again once the worker's heartbeat reports the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_for_an_unreported_assignment_is_relayed_when_the_worker_reports_it() {
    let env = Env::start().await;
    let mut w = worker("cr-0", "model-cr", 4);
    env.work_consumer("cr-0").await;
    env.heartbeat(&w).await;
    let (running, token) = env.dispatcher(env.config("relay")).await;
    env.submit("cr-1", "model-cr", 10, 10).await;
    wait_for("the assignment", WAIT, || async {
        let w = env.take_work("cr-0").await;
        (!w.is_empty()).then_some(())
    })
    .await;
    let mut cancels = env
        .client
        .subscribe(names::control_subject("cr-0", names::CONTROL_CANCEL))
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    env.client
        .publish(names::cancel_subject(None, "cr-1"), bytes::Bytes::new())
        .await
        .unwrap();
    let first = tokio::time::timeout(WAIT, cancels.next())
        .await
        .expect("the leader relays the cancel to the job's worker at once")
        .unwrap();
    let first: metronome_protocol::RelayedCancel = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(
        (first.tenant.as_str(), first.job_id.as_str()),
        (names::tenant_token(None), "cr-1")
    );

    // The worker now reports the job, heartbeat after heartbeat, until the relay comes.
    w.in_flight = vec!["cr-1".into()];
    w.active = 1;
    w.seq += 1;
    env.heartbeat(&w).await;
    let beating = env.keep_beating(w, Duration::from_millis(100), 0);
    let relayed = tokio::time::timeout(WAIT, cancels.next()).await;
    assert!(
        matches!(relayed, Ok(Some(_))),
        "the leader did not relay the cancel"
    );
    beating.stop().await;
    token.cancel();
    running.join().await.unwrap();
}

/// A worker that stopped beating is declared dead and, a bounded time later, leaves the
/// registry: decisions stop listing it. It used to stay for ever (the bucket's max age
/// removes its key without an event the watch sees).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_leaves_the_registry_and_the_decisions() {
    let env = Env::start().await;
    env.workers("gone", 1, "model-f", 4).await;
    let alive = worker("alive-0", "model-f", 4);
    env.work_consumer("alive-0").await;
    env.heartbeat(&alive).await;
    let mut config = env.config("forget");
    config.scheduler.heartbeat_timeout_ms = 1_000;
    let (running, token) = env.dispatcher(config).await;
    let metrics = running.metrics.clone();

    let beating = env.keep_beating(alive.clone(), Duration::from_millis(100), 0);
    wait_for("the silent worker forgotten", WAIT, || {
        let m = metrics.clone();
        async move {
            (m.workers_lost_total.load(Relaxed) >= 1 && m.workers_known.load(Relaxed) == 1)
                .then_some(())
        }
    })
    .await;
    env.submit("f-1", "model-f", 10, 10).await;
    let d = env.decisions_for(&["f-1".to_string()]).await;
    let d = &d["f-1"];
    assert_eq!(d.outcome, Outcome::Assigned, "{d:?}");
    assert_eq!(d.worker_id.as_deref(), Some("alive-0"));
    assert!(
        d.candidates.iter().all(|c| c.worker_id != "gone-0")
            && d.rejected.iter().all(|r| r.worker_id != "gone-0"),
        "the dead worker is still in the decision: {d:?}"
    );
    beating.stop().await;
    token.cancel();
    running.join().await.unwrap();
}

/// The job id is an idempotency key for as long as its decision is kept: an id submitted
/// again after the de-duplication windows of JOBS and WORK (here 1 s; 2 min by default)
/// is answered with the decision it already has and is not run again. It used to be a new
/// job: the DECISIONS check ran only for redeliveries and jobs stored before a takeover,
/// and WORK's msg-id (`<job>:1`) had forgotten the first assignment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_id_submitted_again_after_the_duplicate_window_is_not_run_again() {
    let settings = metronome_protocol::setup::StreamSettings {
        duplicate_window: Duration::from_secs(1),
        ..test_stream_settings()
    };
    let env = Env::start_with(&settings).await;
    env.workers("rep", 1, "model-rep", 4).await;
    let (running, token) = env.dispatcher(env.config("rep")).await;
    env.submit("rep-1", "model-rep", 10, 10).await;
    let work = wait_for("the assignment", WAIT, || async {
        let w = env.take_work("rep-0").await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    env.complete(&work[0].0, CompletionOutcome::Done).await;
    let metrics = running.metrics.clone();
    wait_for("the completion handled", WAIT, || async {
        (metrics.ledger_reservations.load(Relaxed) == 0).then_some(())
    })
    .await;
    // The live decision feed, as a client reads it: DECISIONS drops a record whose msg-id
    // (`<job>:<attempt>`) it still remembers, the feed shows every answer.
    let mut feed = env
        .client
        .subscribe(names::decision_subject(None, "rep-1"))
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    // Submitted again, the same body and msg-id, until JOBS stores it: its window is over.
    let body = serde_json::to_vec(&job_json("rep-1", "model-rep", 10, 10)).unwrap();
    wait_for("JOBS to store the same id again", WAIT, || async {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(names::HEADER_MSG_ID, "rep-1");
        let ack = env
            .js
            .publish_with_headers(names::submit_subject(None), headers, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
        (!ack.duplicate).then_some(())
    })
    .await;
    let answer = tokio::time::timeout(WAIT, feed.next())
        .await
        .expect("the repeat answered")
        .unwrap();
    let again: metronome_protocol::Decision = serde_json::from_slice(&answer.payload).unwrap();
    wait_for("the repeat's JOBS message settled", WAIT, || async {
        let mut jobs = env.js.get_stream(names::STREAM_JOBS).await.unwrap();
        (jobs.info().await.unwrap().state.messages == 0).then_some(())
    })
    .await;
    assert_eq!(
        again.reason_code.as_deref(),
        Some("already_assigned"),
        "the repeat was decided as a new job: {again:?}"
    );
    assert_eq!(again.outcome, Outcome::Assigned);
    assert_eq!(again.attempt, 1);
    assert_eq!(
        again.worker_id.as_deref(),
        Some("rep-0"),
        "names the worker whose results stand"
    );
    let rerun: Vec<_> = env.take_work("rep-0").await;
    assert!(rerun.is_empty(), "the job ran again: {rerun:?}");
    token.cancel();
    running.join().await.unwrap();
}
