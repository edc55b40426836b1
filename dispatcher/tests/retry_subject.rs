//! The retry headers (`Metronome-Attempt`, `Metronome-Order`) are believed only on
//! `jobs.retry`, the subject only dispatchers may publish to: on `jobs.submit.<tenant>` a client could
//! otherwise claim a low queue place (jump its model's queue) or a later attempt. Against a
//! real nats-server; the worker is a heartbeat from the test.

mod common;

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
