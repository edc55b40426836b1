//! Following one job when the gateway did not see its decision live (published while its
//! connection was away, or dropped on the way): the results of a worker no decision has
//! named wait, the stored decision is read, and only the worker it names is relayed.
//! Against a real nats-server, with the submission driven directly: the decision is
//! stored before the submission subscribes, which no HTTP request can arrange.

use std::time::Duration;

use async_nats::jetstream;
use metronome_gateway::submit::{JobEvent, Submission};
use metronome_gateway::{AppState, Config};
use metronome_protocol::names::{decision_subject, result_chunk_subject, result_final_subject};
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_protocol::time::unix_ms;
use metronome_protocol::{
    Decision, Endpoint, FinalResult, Job, Outcome, ResultChunk, Usage, PROTOCOL_VERSION,
};
use metronome_testkit::NatsServer;
use serde_json::json;

const TENANT: Option<&str> = Some("acme");
const WORKER: &str = "node1-gpu0";
const WAIT: Duration = Duration::from_secs(20);

fn job(id: &str) -> Job {
    Job {
        v: PROTOCOL_VERSION,
        id: id.into(),
        model: "m".into(),
        endpoint: Endpoint::Chat,
        request: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        prompt_tokens: 3,
        max_tokens: 4,
        submitted_ms: unix_ms(),
        deadline_ms: Some(unix_ms() + 30_000),
        slo: None,
        tenant: TENANT.map(String::from),
        priority: None,
        prefix: None,
        traceparent: None,
    }
}

fn assigned(job_id: &str, worker: &str) -> Decision {
    Decision {
        v: 1,
        job_id: job_id.into(),
        model: Some("m".into()),
        outcome: Outcome::Assigned,
        attempt: 1,
        reason: None,
        reason_code: None,
        worker_id: Some(worker.into()),
        cost: None,
        scoring: None,
        candidates: vec![],
        rejected: vec![],
        slo: None,
        policy: "test".into(),
        queue_wait_ms: 0,
        retry_after_ms: None,
        affinity: None,
        decision_latency_us: 0,
        epoch: 1,
        dispatcher_id: "test".into(),
        decided_ms: 0,
        tenant: TENANT.map(String::from),
        priority: None,
        fair_counter: None,
    }
}

fn chunk(job_id: &str, worker: &str, text: &str) -> ResultChunk {
    ResultChunk {
        v: 1,
        job_id: job_id.into(),
        seq: 0,
        worker_id: worker.into(),
        attempt: Some(1),
        data: json!({"choices": [{"index": 0, "delta": {"content": text}}]}),
    }
}

fn final_result(job_id: &str, worker: &str) -> FinalResult {
    FinalResult {
        v: 1,
        job_id: job_id.into(),
        worker_id: Some(worker.into()),
        response: Some(json!({"choices": [{"message": {"content": worker}}]})),
        error: None,
        usage: Usage::default(),
        chunks: 1,
        ttft_ms: None,
        e2e_ms: None,
    }
}

#[tokio::test]
async fn results_wait_for_a_decision_read_from_the_stream_when_the_live_one_was_missed() {
    let nats = NatsServer::start().expect("nats-server");
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = jetstream::new(client.clone());
    let buckets = ensure_all(&js, &StreamSettings::default())
        .await
        .expect("streams");
    let config = Config {
        nats_url: nats.url(),
        ..Config::default()
    };
    let state = AppState::new(config, client.clone(), buckets);
    let id = "job-missed";

    // Stored before the submission subscribes: it never sees this decision live.
    js.publish(
        decision_subject(TENANT, id),
        serde_json::to_vec(&assigned(id, WORKER)).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .expect("decision stored");
    let mut submission = Submission::submit(&state, &job(id))
        .await
        .expect("submitted");
    // Another worker answers first, under its own id; then the assigned one.
    for (worker, text) in [("intruder", "FORGED"), (WORKER, "real")] {
        let c = chunk(id, worker, text);
        client
            .publish(
                result_chunk_subject(TENANT, id, worker),
                serde_json::to_vec(&c).unwrap().into(),
            )
            .await
            .unwrap();
        client
            .publish(
                result_final_subject(TENANT, id, worker),
                serde_json::to_vec(&final_result(id, worker))
                    .unwrap()
                    .into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();

    let mut events = Vec::new();
    while !matches!(events.last(), Some(JobEvent::Final(_))) {
        let event = tokio::time::timeout(WAIT, submission.next_event())
            .await
            .expect("an event in time")
            .expect("no error");
        events.push(event);
    }
    match events.as_slice() {
        [JobEvent::Assigned(w), JobEvent::Chunk(c), JobEvent::Final(f)] => {
            assert_eq!(w, WORKER);
            assert_eq!(c.worker_id, WORKER);
            assert_eq!(c.data["choices"][0]["delta"]["content"], "real");
            assert_eq!(f.worker_id.as_deref(), Some(WORKER));
        }
        other => panic!("unexpected events: {other:?}"),
    }
    assert_eq!(submission.worker_id.as_deref(), Some(WORKER));
    submission.finished();
}
