//! The retry headers (`Metronome-Attempt`, `Metronome-Order`) are believed only on
//! `jobs.retry`, the subject only dispatchers may publish to: on `jobs.submit.<tenant>` a client could
//! otherwise claim a low queue place (jump its model's queue) or a later attempt. Against a
//! real nats-server; the worker is a heartbeat from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::names;

async fn publish(env: &Env, subject: &str, id: &str, attempt: &str, order: &str) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, format!("{id}:{subject}").as_str());
    headers.insert(names::HEADER_ATTEMPT, attempt);
    headers.insert(names::HEADER_ORDER, order);
    let body = serde_json::to_vec(&job_json(id, "model-r", 10, 10)).unwrap();
    env.js
        .publish_with_headers(subject.to_string(), headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_headers_count_on_jobs_retry_only() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("retry-subject")).await;
    let status = worker("r-0", "model-r", 8);
    env.work_consumer(&status.worker_id).await;
    env.heartbeat(&status).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;

    publish(&env, &names::submit_subject(None), "forged", "5", "1").await;
    publish(&env, names::SUBJECT_JOBS_RETRY, "retried", "2", "1").await;
    let ids = vec!["forged".to_string(), "retried".to_string()];
    let decisions = env.decisions_for(&ids).await;
    assert_eq!(
        decisions["forged"].attempt, 1,
        "a client's headers on jobs.submit are ignored"
    );
    assert_eq!(
        decisions["retried"].attempt, 2,
        "a dispatcher's retry keeps its attempt"
    );
    token.cancel();
}

/// Issue 9: a retry carries its job's refusals (`Metronome-Refused-By`), so a leader that
/// takes over while the retry waits in JOBS does not give it back to the worker that
/// refused it. Here no dispatcher ran when the retry was stored (as after a leader's death):
/// the one that starts knows the refusal only from the header. `r-0` is the better-scored
/// worker (`r-1` reports queued requests), so without the header the retry goes to `r-0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_learns_a_retrys_refusals_from_its_header() {
    let env = Env::start().await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, "refused:retry:2");
    headers.insert(names::HEADER_ATTEMPT, "2");
    headers.insert(names::HEADER_ORDER, "1");
    headers.insert(
        names::HEADER_REFUSED_BY,
        names::refused_by_header(&[("r-0".to_string(), 1)]).as_str(),
    );
    let body = serde_json::to_vec(&job_json("refused", "model-r", 10, 10)).unwrap();
    env.js
        .publish_with_headers(names::SUBJECT_JOBS_RETRY, headers, body.into())
        .await
        .expect("publish")
        .await
        .expect("stored");

    // Registered before the leader starts: it loads them before reading JOBS.
    let idle = worker("r-0", "model-r", 8);
    let mut busy = worker("r-1", "model-r", 8);
    busy.queued = 3;
    for status in [&idle, &busy] {
        env.work_consumer(&status.worker_id).await;
        env.heartbeat(status).await;
    }
    let (_running, token) = env.dispatcher(env.config("refused-by")).await;
    let d = env.decisions_for(&["refused".to_string()]).await["refused"].clone();
    assert_eq!(d.attempt, 2, "{d:?}");
    assert_eq!(
        d.worker_id.as_deref(),
        Some("r-1"),
        "given back to the worker that refused it: {d:?}"
    );
    let left_out = d
        .rejected
        .iter()
        .find(|r| r.worker_id == "r-0")
        .unwrap_or_else(|| panic!("r-0 not listed as refused: {d:?}"));
    assert_eq!(left_out.code, metronome_protocol::RejectionCode::RefusedJob);
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_stream_of_an_older_version_gains_jobs_retry_and_discard_new_when_a_dispatcher_starts(
) {
    let env = Env::start().await;
    // As an older version created it: jobs.submit only, and a full queue deleting its
    // oldest jobs (the server's default); RESULTS with the subjects of versions 1 (no
    // tenant token) and 2 (no publisher token).
    let mut config = env.stream_config(names::STREAM_JOBS).await;
    config.subjects = vec![names::SUBJECT_JOBS_SUBMIT_V1.to_string()];
    config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    env.js.update_stream(config).await.unwrap();
    let mut config = env.stream_config(names::STREAM_RESULTS).await;
    config.subjects = vec![
        names::SUBJECT_RESULTS_FINAL_ALL_V1.to_string(),
        names::SUBJECT_RESULTS_FINAL_ALL_V2.to_string(),
    ];
    env.js.update_stream(config).await.unwrap();

    let (_running, token) = env.dispatcher(env.config("upgrade")).await;
    metronome_testkit::wait_for(
        "jobs.submit.*, jobs.retry and discard new in JOBS; results.*.*.*.final in RESULTS",
        WAIT,
        || async {
            let jobs = env.stream_config(names::STREAM_JOBS).await;
            let results = env.stream_config(names::STREAM_RESULTS).await;
            let has = |c: &async_nats::jetstream::stream::Config, s: &str| {
                c.subjects.iter().any(|x| x == s)
            };
            (has(&jobs, names::SUBJECT_JOBS_RETRY)
                && has(&jobs, names::SUBJECT_JOBS_SUBMIT_ALL)
                && has(&jobs, names::SUBJECT_JOBS_SUBMIT_V1)
                && jobs.discard == async_nats::jetstream::stream::DiscardPolicy::New
                && results.subjects == vec![names::SUBJECT_RESULTS_FINAL_ALL.to_string()])
            .then_some(())
        },
    )
    .await;
    token.cancel();
}
