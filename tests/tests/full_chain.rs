//! Requests through the whole chain: gateway → JetStream → dispatcher → worker-agent →
//! simulated GPU, and back, streaming and not.

use std::collections::BTreeSet;

use metronome_e2e::{chat_body, Cluster, ClusterSpec};
use metronome_protocol::{sse, Outcome};

const MODEL: &str = "e2e-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_answer_streaming_and_not() {
    let cluster = Cluster::start(ClusterSpec::uniform(2, MODEL)).await;
    let http = reqwest::Client::new();

    // Non-streaming chat.
    let resp = http
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 12, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let worker = resp.headers()["x-metronome-worker"]
        .to_str()
        .unwrap()
        .to_string();
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert!(!body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    let decision = cluster.decision(&job_id).await;
    assert_eq!(decision.outcome, Outcome::Assigned);
    assert_eq!(decision.worker_id.as_deref(), Some(worker.as_str()));

    // Streaming chat with usage.
    let resp = http
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 9, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(resp.headers().contains_key("x-metronome-job-id"));
    let events = sse::data_payloads(&resp.text().await.unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    let usage: Vec<_> = chunks.iter().filter(|c| c["usage"].is_object()).collect();
    assert_eq!(usage.len(), 1, "exactly one usage chunk: {chunks:?}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 9);

    // Completions, non-streaming and streaming.
    let resp = http
        .post(format!("{}/v1/completions", cluster.gateway_url))
        .json(&serde_json::json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 7}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 7);

    let resp = http
        .post(format!("{}/v1/completions", cluster.gateway_url))
        .json(
            &serde_json::json!({"model": MODEL, "prompt": "Once", "max_tokens": 5, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let events = sse::data_payloads(&resp.text().await.unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<serde_json::Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert!(!text.is_empty());
}

/// The classic bug: four idle GPUs, four simultaneous requests, all on GPU 0. Several rounds,
/// each on an idle cluster; the winners are read from the response headers and the decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_simultaneous_requests_land_on_four_gpus() {
    four_simultaneous_requests_land_on_four_distinct_gpus(&[1.0, 1.0, 1.0, 1.0]).await;
}

/// The same on a mixed-speed cluster with the defaults: the fourth job goes to the idle
/// half-speed GPU, not beside a job on a full-speed one, in every round, also once every
/// worker's performance model has learnt that one GPU is slower.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_simultaneous_requests_land_on_four_gpus_of_mixed_speed() {
    four_simultaneous_requests_land_on_four_distinct_gpus(&[1.0, 1.0, 1.0, 0.5]).await;
}

async fn four_simultaneous_requests_land_on_four_distinct_gpus(speeds: &[f64]) {
    let mut spec = ClusterSpec::uniform(speeds.len(), MODEL);
    for (gpu, speed) in spec.gpus.iter_mut().zip(speeds) {
        gpu.speed = *speed;
    }
    let cluster = Cluster::start(spec).await;
    let http = reqwest::Client::new();
    for round in 0..5 {
        // Each round starts on a cluster the dispatcher sees idle (a client can get its
        // answer before the worker's completion reaches the dispatcher).
        cluster.wait_idle().await;
        let requests = (0..4).map(|_| {
            http.post(format!("{}/v1/chat/completions", cluster.gateway_url))
                .json(&chat_body(MODEL, 8, false))
                .send()
        });
        let responses = futures::future::join_all(requests).await;
        let mut header_workers = BTreeSet::new();
        let mut decision_workers = BTreeSet::new();
        for resp in responses {
            let resp = resp.unwrap();
            assert_eq!(resp.status(), 200, "{}", cluster.logs());
            let job = resp.headers()["x-metronome-job-id"]
                .to_str()
                .unwrap()
                .to_string();
            header_workers.insert(
                resp.headers()["x-metronome-worker"]
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
            let decision = cluster.decision(&job).await;
            decision_workers.insert(decision.worker_id.unwrap());
        }
        assert_eq!(header_workers.len(), 4, "round {round}: {header_workers:?}");
        assert_eq!(header_workers, decision_workers, "round {round}");
    }
}

/// Without HTTP: a client publishes a Job on its tenant's `jobs.submit.<tenant>` (no tenant
/// in the body) and reads the chunks and final result on `results.<tenant>.<job>.>`,
/// accepting them only from the worker the job's decision names (the subject's publisher
/// token, which the servers let only that worker write): results another worker published
/// for the job first are ignored. The dispatcher charged the job to the subject's tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_nats_client_submits_for_its_tenant_and_reads_its_results() {
    use futures::StreamExt;
    use metronome_protocol::names::{self, parse_result_subject, ResultKind};
    use metronome_protocol::{Decision, FinalResult, ResultChunk};

    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let client = cluster.nats_client().await;
    let id = "direct-acme-1";
    let tenant = Some("acme");
    let mut results = client
        .subscribe(names::results_subject_all(tenant, id))
        .await
        .unwrap();
    let mut decisions = client
        .subscribe(names::decision_subject(tenant, id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    // A worker that does not hold the job answers it first, under its own id.
    let forged = serde_json::json!({"v": 1, "job_id": id, "worker_id": "intruder", "seq": 0,
        "data": {"choices": [{"index": 0, "delta": {"content": "FORGED"}}]}});
    client
        .publish(
            names::result_chunk_subject(tenant, id, "intruder"),
            forged.to_string().into(),
        )
        .await
        .unwrap();
    let forged = serde_json::json!({"v": 1, "job_id": id, "worker_id": "intruder",
        "response": {"choices": [{"message": {"content": "FORGED"}}]}, "error": null,
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "chunks": 1});
    client
        .publish(
            names::result_final_subject(tenant, id, "intruder"),
            forged.to_string().into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();
    let now = metronome_protocol::time::unix_ms();
    let job = serde_json::json!({
        "v": metronome_protocol::PROTOCOL_VERSION, "id": id, "model": MODEL,
        "endpoint": "chat", "request": chat_body(MODEL, 8, true),
        "prompt_tokens": 8, "max_tokens": 8, "submitted_ms": now, "deadline_ms": now + 30_000,
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, id);
    async_nats::jetstream::new(client.clone())
        .publish_with_headers(
            names::submit_subject(tenant),
            headers,
            serde_json::to_vec(&job).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .expect("JOBS stores the job");

    // The reference client: results of a worker no decision has named wait; the
    // decision's worker's are read in order; the leader's (`_dispatcher`) always count.
    let mut assigned: Option<String> = None;
    let mut waiting: Vec<async_nats::Message> = Vec::new();
    let mut ignored = 0;
    let mut chunks = 0;
    let fin: FinalResult = 'read: loop {
        tokio::select! {
            m = results.next() => waiting.push(m.expect("subscription open")),
            d = decisions.next() => {
                let d: Decision = serde_json::from_slice(&d.expect("open").payload).unwrap();
                if let Some(w) = d.worker_id {
                    assigned = Some(w);
                }
            }
            _ = tokio::time::sleep(std::time::Duration::from_secs(30)) => {
                panic!("no result within 30 s: {}", cluster.logs())
            }
        }
        let Some(worker) = assigned.clone() else {
            continue;
        };
        for m in std::mem::take(&mut waiting) {
            let parts = parse_result_subject(m.subject.as_str()).expect("a result subject");
            if !parts.from_dispatcher() && parts.publisher != worker {
                ignored += 1;
                continue;
            }
            if parts.kind == ResultKind::Final {
                break 'read serde_json::from_slice(&m.payload).expect("final result decodes");
            }
            let c: ResultChunk = serde_json::from_slice(&m.payload).expect("chunk decodes");
            assert_eq!(c.seq, chunks, "chunks in order");
            assert_eq!(c.worker_id, worker);
            chunks += 1;
        }
    };
    assert_eq!(fin.error, None, "{}", cluster.logs());
    assert_eq!(ignored, 2, "the forged chunk and final result");
    assert!(
        chunks > 0 && fin.chunks == chunks,
        "{chunks} chunks, final says {}",
        fin.chunks
    );
    let decision = cluster.decision(id).await;
    assert_eq!(decision.outcome, Outcome::Assigned);
    assert_eq!(decision.tenant.as_deref(), Some("acme"));
    assert_eq!(fin.worker_id, decision.worker_id);
}

/// Through the gateway: while a job streams, another worker publishes a chunk and a final
/// result for it under its own id. The client gets only the assigned worker's output, to
/// its end, and the gateway counts the two it did not relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_relays_only_the_assigned_workers_results() {
    use futures::StreamExt;
    use metronome_protocol::names;

    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let client = cluster.nats_client().await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 200, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut body = resp.bytes_stream();
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    // The gateway's anonymous tenant.
    let tenant = Some(metronome_protocol::ANONYMOUS_TENANT);
    let chunk = serde_json::json!({"v": 1, "job_id": id, "worker_id": "intruder", "seq": 1,
        "data": {"choices": [{"index": 0, "delta": {"content": "FORGED"}}]}});
    client
        .publish(
            names::result_chunk_subject(tenant, &id, "intruder"),
            chunk.to_string().into(),
        )
        .await
        .unwrap();
    let fin = serde_json::json!({"v": 1, "job_id": id, "worker_id": "intruder",
        "response": null, "error": {"code": "worker_failed", "message": "FORGED"},
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "chunks": 1});
    client
        .publish(
            names::result_final_subject(tenant, &id, "intruder"),
            fin.to_string().into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();
    while let Some(part) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&part.unwrap()));
    }
    assert!(!text.contains("FORGED"), "{text}");
    let events = sse::data_payloads(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let usage: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<serde_json::Value>(e).unwrap())
        .filter(|c| c["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "{text}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 200);
    // Both forged messages reached the gateway and were held, then dropped.
    let http = reqwest::Client::new();
    metronome_testkit::wait_for(
        "the gateway to count the forged results",
        std::time::Duration::from_secs(30),
        || async {
            let m = http
                .get(format!("{}/metrics", cluster.gateway_url))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            m.lines()
                .any(|l| {
                    l == "metronome_gateway_unattributed_results_total{reason=\"not_assigned\"} 2"
                })
                .then_some(())
        },
    )
    .await;
}

/// A worker that learned a job's id stores a final result for it first, under its own id,
/// with the `Nats-Msg-Id` the job's finals once shared (`<job_id>:final`) and the one a
/// per-publisher id would give the real worker. The real worker's final is still stored,
/// and a late reader of RESULTS (`metronome explain`'s rule) finds it, not the forgery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_final_stored_first_does_not_keep_the_real_one_out() {
    use futures::StreamExt;
    use metronome_protocol::names;
    use metronome_protocol::{CompletionEvent, FinalResult};

    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let client = cluster.nats_client().await;
    let js = async_nats::jetstream::new(client.clone());
    let id = "forged-first-1";
    let tenant = Some("acme");
    let worker = metronome_e2e::worker_id(0);
    let mut done = client
        .subscribe(names::SUBJECT_EVENTS_DONE_ALL)
        .await
        .unwrap();
    client.flush().await.unwrap();
    let forged = serde_json::json!({"v": 1, "job_id": id, "worker_id": "intruder",
        "response": null, "error": {"code": "worker_failed", "message": "FORGED"},
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "chunks": 1});
    for msg_id in [format!("{id}:final"), format!("{id}:final:{worker}")] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(names::HEADER_MSG_ID, msg_id.as_str());
        js.publish_with_headers(
            names::result_final_subject(tenant, id, "intruder"),
            headers,
            forged.to_string().into(),
        )
        .await
        .unwrap()
        .await
        .expect("RESULTS stores the forgery");
    }
    let now = metronome_protocol::time::unix_ms();
    let job = serde_json::json!({
        "v": metronome_protocol::PROTOCOL_VERSION, "id": id, "model": MODEL,
        "endpoint": "chat", "request": chat_body(MODEL, 8, false),
        "prompt_tokens": 8, "max_tokens": 8, "submitted_ms": now, "deadline_ms": now + 30_000,
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, id);
    js.publish_with_headers(
        names::submit_subject(tenant),
        headers,
        serde_json::to_vec(&job).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .expect("JOBS stores the job");
    // The agent reports completion once its final result's publish was answered.
    loop {
        let m = done.next().await.expect("subscription open");
        let e: CompletionEvent = serde_json::from_slice(&m.payload).unwrap();
        if e.job_id == id {
            break;
        }
    }
    let decision = cluster.decision(id).await;
    assert_eq!(decision.worker_id.as_deref(), Some(worker.as_str()));
    let results = js.get_stream(names::STREAM_RESULTS).await.unwrap();
    let stored =
        metronome_protocol::stored::accepted_final(&results, id, decision.worker_id.as_deref())
            .await
            .unwrap()
            .unwrap_or_else(|| {
                panic!(
                    "the worker's final result was not stored: {}",
                    cluster.logs()
                )
            });
    assert_eq!(
        stored.subject.as_str(),
        names::result_final_subject(tenant, id, &worker)
    );
    let fin: FinalResult = serde_json::from_slice(&stored.payload).unwrap();
    assert_eq!(fin.error, None);
    assert_eq!(fin.worker_id.as_deref(), Some(worker.as_str()));
}

/// The completion event of `id` on `events.done.*` (the subscription made before the job).
async fn completion_of(
    done: &mut async_nats::Subscriber,
    id: &str,
) -> metronome_protocol::CompletionEvent {
    use futures::StreamExt;
    loop {
        let m = done.next().await.expect("subscription open");
        let e: metronome_protocol::CompletionEvent = serde_json::from_slice(&m.payload).unwrap();
        if e.job_id == id {
            return e;
        }
    }
}

/// Workers hear only the cancels the leader relays to them (`control.<worker>.cancel`):
/// an HTTP client that goes away mid-stream still stops its running job (the gateway
/// cancels on `cancel.<tenant>.<job>`, the leader relays it to the job's worker), which
/// ends `cancelled` long before its 20,000 tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_http_client_that_goes_away_stops_its_running_job() {
    use futures::StreamExt;
    use metronome_protocol::{names, CompletionOutcome};

    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let client = cluster.nats_client().await;
    let mut done = client
        .subscribe(names::SUBJECT_EVENTS_DONE_ALL)
        .await
        .unwrap();
    client.flush().await.unwrap();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&chat_body(MODEL, 20_000, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut body = resp.bytes_stream();
    // The job runs: its first tokens arrived.
    body.next().await.expect("a first chunk").unwrap();
    drop(body);
    let event = completion_of(&mut done, &id).await;
    assert_eq!(
        event.outcome,
        CompletionOutcome::Cancelled,
        "{event:?} {}",
        cluster.logs()
    );
    assert!(event.streamed);
}

/// The same over NATS: a direct client's `cancel.<tenant>.<job>` stops its running job,
/// whose final result (from the worker the decision names) says `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_nats_clients_cancel_stops_its_running_job() {
    use futures::StreamExt;
    use metronome_protocol::names::{self, parse_result_subject, ResultKind};
    use metronome_protocol::{CompletionOutcome, ErrorCode, FinalResult};

    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let client = cluster.nats_client().await;
    let id = "cancel-direct-1";
    let tenant = Some("acme");
    let mut results = client
        .subscribe(names::results_subject_all(tenant, id))
        .await
        .unwrap();
    let mut done = client
        .subscribe(names::SUBJECT_EVENTS_DONE_ALL)
        .await
        .unwrap();
    client.flush().await.unwrap();
    let now = metronome_protocol::time::unix_ms();
    let job = serde_json::json!({
        "v": metronome_protocol::PROTOCOL_VERSION, "id": id, "model": MODEL,
        "endpoint": "chat", "request": chat_body(MODEL, 20_000, true),
        "prompt_tokens": 8, "max_tokens": 20_000, "submitted_ms": now,
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(names::HEADER_MSG_ID, id);
    async_nats::jetstream::new(client.clone())
        .publish_with_headers(
            names::submit_subject(tenant),
            headers,
            serde_json::to_vec(&job).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .expect("JOBS stores the job");
    // Its first chunk: the job runs on its worker.
    let first = results.next().await.expect("subscription open");
    let parts = parse_result_subject(first.subject.as_str()).expect("a result subject");
    assert_eq!(parts.kind, ResultKind::Chunk, "{}", cluster.logs());
    client
        .publish(names::cancel_subject(tenant, id), "".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    let fin: FinalResult = loop {
        let m = results.next().await.expect("subscription open");
        let parts = parse_result_subject(m.subject.as_str()).expect("a result subject");
        if parts.kind == ResultKind::Final {
            break serde_json::from_slice(&m.payload).unwrap();
        }
    };
    assert_eq!(
        fin.error.map(|e| e.code),
        Some(ErrorCode::Cancelled),
        "{}",
        cluster.logs()
    );
    let decision = cluster.decision(id).await;
    assert_eq!(fin.worker_id, decision.worker_id);
    assert_eq!(
        completion_of(&mut done, id).await.outcome,
        CompletionOutcome::Cancelled
    );
}

/// A non-streamed request asking for log-probabilities gets them through the whole chain
/// (the worker assembles its answer from the stream), and they are the simulated GPU's:
/// the same request straight to a GPU (same seed, same prompt) answers the same numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_reach_a_client_that_does_not_stream() {
    let cluster = Cluster::start(ClusterSpec::uniform(1, MODEL)).await;
    let http = reqwest::Client::new();
    let mut body = chat_body(MODEL, 6, false);
    body["logprobs"] = serde_json::json!(true);
    body["top_logprobs"] = serde_json::json!(2);
    let through: serde_json::Value = http
        .post(format!("{}/v1/chat/completions", cluster.gateway_url))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let direct: serde_json::Value = http
        .post(format!("{}/v1/chat/completions", cluster.gpu_url(0)))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let content = &through["choices"][0]["logprobs"]["content"];
    assert_eq!(content.as_array().map(Vec::len), Some(6), "{through}");
    assert_eq!(content, &direct["choices"][0]["logprobs"]["content"]);
    assert_eq!(
        through["choices"][0]["message"]["content"],
        direct["choices"][0]["message"]["content"]
    );
}

/// `POST /v1/embeddings` is a job like any other (queued, decided, run by a worker, answered
/// by the model server), whose cost is its prompt alone: the decision reserves no output
/// and predicts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_routed_like_any_job_and_cost_their_prefill_only() {
    let cluster = Cluster::start(ClusterSpec::uniform(2, MODEL)).await;
    let http = reqwest::Client::new();
    let embed = |input: serde_json::Value| {
        let http = http.clone();
        let url = format!("{}/v1/embeddings", cluster.gateway_url);
        async move {
            http.post(url)
                .json(&serde_json::json!({"model": MODEL, "input": input}))
                .send()
                .await
                .unwrap()
        }
    };
    let resp = embed(serde_json::json!(["the first text", "a second one"])).await;
    assert_eq!(resp.status(), 200, "{}", cluster.logs());
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "list", "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    let first: Vec<f64> = serde_json::from_value(data[0]["embedding"].clone()).unwrap();
    let norm: f64 = first.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-3, "unit vectors: {norm}");
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    let decision = cluster.decision(&job_id).await;
    assert_eq!(decision.outcome, Outcome::Assigned, "{decision:?}");
    let cost = decision.cost.expect("the decision records the job's cost");
    assert_eq!(cost.max_tokens, 0);
    assert_eq!(cost.predicted_output_tokens, 0.0);
    assert_eq!(cost.kv_tokens, u64::from(cost.prompt_tokens));

    // The same input, the same vector; another input, another.
    let again: serde_json::Value = embed(serde_json::json!("the first text"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["data"][0]["embedding"], data[0]["embedding"]);
    assert_ne!(data[1]["embedding"], data[0]["embedding"]);

    // An input that is not one is refused by the gateway, naming the field.
    let bad = embed(serde_json::json!(5)).await;
    assert_eq!(bad.status(), 400);
    let error: serde_json::Value = bad.json().await.unwrap();
    assert_eq!(error["error"]["param"], "input", "{error}");
}
