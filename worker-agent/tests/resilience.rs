//! The agent under pressure: a job longer than the consumer's ack wait is kept alive by
//! progress acks, a drain that outlasts its timeout ends the job with a clear error, and a
//! Redis outage costs only the EWMA updates.

use crate::common;

use std::sync::atomic::Ordering;

use common::*;
use metronome_protocol::names::{
    event_done_subject, results_subject_all, work_consumer, STREAM_WORK,
};
use metronome_protocol::{CompletionEvent, CompletionOutcome, Endpoint, ErrorCode, FinalResult};
use metronome_testkit::wait_for;
use tokio_util::sync::CancellationToken;

fn final_in(list: &std::sync::Mutex<Vec<async_nats::Message>>) -> Option<FinalResult> {
    list.lock()
        .unwrap()
        .iter()
        .find(|m| m.subject.ends_with(".final"))
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_acks_keep_a_long_job_from_being_redelivered() {
    let env = Env::start().await;
    let worker = "r-gpu0";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-slow"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.ack_wait_ms = 500;
    config.progress_ack_interval_ms = 100;
    let (agent, shutdown) = env.start_agent(config).await;

    // About 1.5 s of generation: three times the ack wait.
    env.assign(worker, &job("job-slow", Endpoint::Chat, 30, 50), 1)
        .await;
    let fin = wait_for("final result of the slow job", WAIT, || async {
        final_in(&results)
    })
    .await;
    assert_eq!(fin.error, None);
    assert_eq!(env.stub.stats.requests.load(Ordering::SeqCst), 1);
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(&work_consumer(worker)).await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_timeout_ends_the_job_with_an_error() {
    let env = Env::start().await;
    let worker = "r-gpu1";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-endless"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.drain_timeout_ms = 200;
    let (agent, shutdown) = env.start_agent(config).await;

    env.assign(worker, &job("job-endless", Endpoint::Chat, 10_000, 50), 1)
        .await;
    wait_for("first chunks", WAIT, || async {
        (results.lock().unwrap().len() >= 2).then_some(())
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();

    let fin = wait_for("a final result published before exit", WAIT, || async {
        final_in(&results)
    })
    .await;
    let err = fin.error.expect("an error");
    assert_eq!(err.code, ErrorCode::WorkerFailed);
    assert!(err.message.contains("shut down"), "{}", err.message);
    let ev: CompletionEvent = wait_for("the failed event", WAIT, || async {
        events
            .lock()
            .unwrap()
            .first()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Failed);
    assert!(
        ev.streamed,
        "tokens had reached the client: not to be rescued elsewhere"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_still_run_while_redis_is_down() {
    let mut env = Env::start().await;
    let worker = "r-gpu2";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-noredis"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    env.redis.stop();

    env.assign(worker, &job("job-noredis", Endpoint::Completion, 3, 0), 1)
        .await;
    let fin = wait_for("final result without redis", WAIT, || async {
        final_in(&results)
    })
    .await;
    assert_eq!(fin.error, None);
    let text = wait_for("the redis error to be counted", WAIT, || async {
        let m = Env::agent_metrics(&agent).await;
        (metric_value(&m, "metronome_worker_redis_errors_total", &[]) >= Some(1.0)).then_some(m)
    })
    .await;
    assert_eq!(
        metric_value(
            &text,
            "metronome_worker_jobs_total",
            &[("worker_id", "r-gpu2"), ("outcome", "done")]
        ),
        Some(1.0)
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_continues_the_heartbeat_sequence() {
    let env = Env::start().await;
    let worker = "r-gpu3";
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    let bucket = env.buckets.workers.clone();
    let seen = wait_for("a few heartbeats", WAIT, || {
        let bucket = bucket.clone();
        async move {
            let s: metronome_protocol::WorkerStatus =
                serde_json::from_slice(&bucket.get(worker).await.ok()??).ok()?;
            (s.seq >= 3).then_some(s.seq)
        }
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
    // As after a crash: the previous run's heartbeat is still in the bucket.
    let mut last = env.config(worker);
    last.max_concurrency = 2;
    let stale = metronome_protocol::WorkerStatus {
        v: 1,
        worker_id: worker.into(),
        model: MODEL.into(),
        node: None,
        gpu_index: None,
        healthy: true,
        draining: false,
        max_concurrency: 4,
        active: 0,
        queued: 0,
        in_flight: vec![],
        kv: None,
        gpu: None,
        prefill_pending_tokens: 0,
        perf: None,
        decoding: None,
        seq: seen + 1000,
        sent_ms: 0,
        max_epoch: 0,
    };
    bucket
        .put(worker, serde_json::to_vec(&stale).unwrap().into())
        .await
        .unwrap();
    let (agent, shutdown) = env.start_agent(last).await;
    let s: metronome_protocol::WorkerStatus =
        serde_json::from_slice(&bucket.get(worker).await.unwrap().unwrap()).unwrap();
    assert_eq!(
        s.max_concurrency, 2,
        "the new agent's first heartbeat is in the bucket"
    );
    assert!(
        s.seq > seen + 1000,
        "seq {} continues after {}",
        s.seq,
        seen + 1000
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// An assignment whose job has a CR/LF in its model (a hostile or buggy publisher on
/// `work.<id>`) used to run, then panic the job's task when its final result's model header
/// was built. It is refused with the reason, and the agent keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_with_a_cr_lf_model_fails_with_its_reason_and_the_agent_keeps_serving() {
    let env = Env::start().await;
    let worker = "r-gpu7";
    let bad_results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-crlf"))
            .await
            .unwrap(),
    );
    let ok_results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-fine"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    let mut bad = job("job-crlf", Endpoint::Chat, 3, 0);
    bad.model = "a\r\nb".into();
    env.assign(worker, &bad, 1).await;
    env.assign(worker, &job("job-fine", Endpoint::Completion, 3, 0), 1)
        .await;

    let fin = wait_for("final result of the bad job", WAIT, || async {
        final_in(&bad_results)
    })
    .await;
    let error = fin.error.expect("an error result");
    assert_eq!(error.code, ErrorCode::InvalidJob);
    assert!(error.message.contains("control character"), "{error:?}");
    let fin = wait_for("final result of the good job", WAIT, || async {
        final_in(&ok_results)
    })
    .await;
    assert!(fin.error.is_none(), "{fin:?}");
    assert_eq!(env.stub.stats.requests.load(Ordering::SeqCst), 1);
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// What a model server whose `/metrics` never answers has seen.
#[derive(Default)]
struct HangingStats {
    metrics_requests: std::sync::atomic::AtomicU64,
}

/// A model server that answers `/health` but never `/metrics` (as a server stuck in a long
/// prefill can). Dropped with the test.
async fn hanging_metrics_server() -> (String, std::sync::Arc<HangingStats>, CancellationToken) {
    use axum::routing::get;
    let stats = std::sync::Arc::new(HangingStats::default());
    let s = stats.clone();
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move || {
                let s = s.clone();
                async move {
                    s.metrics_requests.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<String>().await
                }
            }),
        );
    let (addr, stop) = serve(app).await;
    let url = format!("http://{addr}");
    (url, stats, stop)
}

/// Heartbeats used to wait for the metrics probe (up to its 2 s timeout) before each put,
/// against a 3 s death timeout. Now the probes run on their own and a heartbeat sends the
/// latest results at once: many heartbeats go out per (hanging) metrics request, where
/// before each heartbeat needed one request to time out first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_do_not_wait_for_a_hanging_metrics_endpoint() {
    let env = Env::start().await;
    let worker = "r-gpu8";
    let (url, stats, stop) = hanging_metrics_server().await;
    let beats = collect(
        env.client
            .subscribe(metronome_protocol::names::heartbeat_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.model_server_url = url;
    let (agent, shutdown) = env.start_agent(config).await;

    let heartbeats = 6;
    let seen: Vec<metronome_protocol::WorkerStatus> =
        wait_for("heartbeats while /metrics hangs", WAIT, || async {
            let list = beats.lock().unwrap();
            (list.len() >= heartbeats).then(|| {
                list.iter()
                    .map(|m| serde_json::from_slice(&m.payload).unwrap())
                    .collect()
            })
        })
        .await;
    let requests = stats.metrics_requests.load(Ordering::SeqCst);
    assert!(
        requests < heartbeats as u64,
        "{} heartbeats needed {requests} metrics requests: heartbeats waited for the probe",
        seen.len()
    );
    for s in &seen {
        assert!(s.healthy, "health answers, so the worker is healthy: {s:?}");
        assert_eq!(s.kv, None, "no metrics, no KV figure");
    }
    assert!(seen.windows(2).all(|w| w[0].seq < w[1].seq));
    shutdown.cancel();
    agent.wait().await.unwrap();
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_nats_is_gone_still_stops_when_asked() {
    let mut env = Env::start().await;
    let (agent, shutdown) = env.start_agent(env.config("gone-gpu0")).await;
    env.nats.kill();
    shutdown.cancel();
    // Not a speed check: the bound only tells a stop from a hang (the agent's own waits
    // on NATS are a few seconds each).
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(60), agent.wait()).await;
    assert!(
        stopped.is_ok(),
        "the agent did not stop within 60 s of SIGTERM with NATS gone"
    );
}

/// A model server that answers `/health` and dies in the middle of every generation: one
/// chunk, then its connection breaks (as when the process is killed). Dropped with the test.
async fn dying_model_server() -> (String, CancellationToken) {
    use axum::response::sse::{Event, Sse};
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "" }))
        .route(
            "/v1/chat/completions",
            post(|| async {
                let chunk = serde_json::json!({"id": "c", "object": "chat.completion.chunk",
                    "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]});
                let events = futures::stream::iter([
                    Ok(Event::default().data(chunk.to_string())),
                    Err(std::io::Error::other("killed")),
                ]);
                Sse::new(events)
            }),
        );
    let (addr, stop) = serve(app).await;
    let url = format!("http://{addr}");
    (url, stop)
}

/// A job whose model server dies under it ends at once with a reason naming the model
/// server (it does not wait for its deadline), and the worker reports itself unhealthy
/// right away, so the dispatcher stops sending it work before more jobs fail the same way.
/// The health probe runs once a minute here (the heartbeat interval): only the job's
/// failure can make the heartbeat say unhealthy within the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_server_that_dies_mid_job_fails_it_and_makes_the_worker_unhealthy_at_once() {
    let env = Env::start().await;
    let worker = "r-gpu9";
    let (url, stop) = dying_model_server().await;
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-dies"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.model_server_url = url;
    config.heartbeat_interval_ms = 60_000;
    config.fence_after_ms = 120_000;
    let (agent, shutdown) = env.start_agent(config).await;
    let status = |bytes: &[u8]| serde_json::from_slice::<metronome_protocol::WorkerStatus>(bytes);
    wait_for("a healthy first heartbeat", WAIT, || async {
        let entry = env.buckets.workers.get(worker).await.ok()??;
        status(&entry).ok()?.healthy.then_some(())
    })
    .await;

    env.assign(worker, &job("job-dies", Endpoint::Chat, 8, 0), 1)
        .await;
    let fin = wait_for("the job's final result", WAIT, || async {
        final_in(&results)
    })
    .await;
    let error = fin.error.expect("the job failed");
    assert_eq!(error.code, ErrorCode::WorkerFailed);
    assert!(error.message.contains("model server"), "{}", error.message);
    wait_for("a heartbeat saying unhealthy", WAIT, || async {
        let entry = env.buckets.workers.get(worker).await.ok()??;
        (!status(&entry).ok()?.healthy).then_some(())
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
    stop.cancel();
}
