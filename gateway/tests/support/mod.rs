//! Test harness: a real nats-server (testkit), the gateway in-process on 127.0.0.1:0,
//! and a stand-in for the dispatcher and a worker that speaks the NATS contract: it
//! consumes `jobs.submit.*` from JOBS, and publishes a decision, chunks and a final result
//! chosen by a marker in the request text (`#queue_full`, `#hold`, …).

#![allow(dead_code)]

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use bytes::Bytes;
use futures::StreamExt;
use metronome_gateway::{bind, Config};
use metronome_protocol::names::{
    decision_subject, result_chunk_subject, result_final_subject, CONSUMER_DISPATCHER,
    DISPATCHER_PUBLISHER, LEADER_KEY, STREAM_JOBS,
};
use metronome_protocol::setup::{ensure_all, Buckets, StreamSettings};
use metronome_protocol::{
    Decision, Endpoint, ErrorCode, FinalResult, Job, Outcome, ResultChunk, ResultError, Usage,
    WorkerStatus,
};
use metronome_testkit::{wait_for, NatsServer};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub const MODEL: &str = "llama-3.1-8b";
pub const WORKER: &str = "node1-gpu0";
/// A worker the fake never assigns a job to, whose (forged) results the gateway must not
/// relay.
pub const INTRUDER: &str = "node9-gpu9";
/// The text of every forged result.
pub const FORGED: &str = "FORGED";
pub const WAIT: Duration = Duration::from_secs(15);

pub struct Harness {
    pub nats: NatsServer,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub buckets: Buckets,
    pub base: String,
    pub http: reqwest::Client,
    /// Sent as `Authorization: Bearer` by the helpers ([`Harness::post`], the model list).
    pub api_key: Option<String>,
    shutdown: CancellationToken,
    server: Option<tokio::task::JoinHandle<()>>,
    fake: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    /// NATS, the gateway (with `tweak` applied to its test configuration, which allows
    /// anonymous access unless `tweak` turns it off), the fake dispatcher+worker, and one
    /// registered worker serving [`MODEL`].
    pub async fn start(tweak: impl FnOnce(&mut Config)) -> Harness {
        Harness::start_with_key(tweak, None).await
    }

    /// [`Harness::start`], the helpers sending `api_key` as a bearer token.
    pub async fn start_with_key(tweak: impl FnOnce(&mut Config), api_key: Option<&str>) -> Harness {
        Harness::start_inner(tweak, api_key, None).await
    }

    /// [`Harness::start`] serving HTTPS with `ca`'s server certificate (for `127.0.0.1`),
    /// the helpers' client trusting `ca` alone.
    pub async fn start_tls(
        ca: &metronome_testkit::TestCa,
        tweak: impl FnOnce(&mut Config),
    ) -> Harness {
        let cert = ca.server_cert();
        let key = ca.server_key();
        Harness::start_inner(
            |c| {
                c.tls_cert = Some(cert);
                c.tls_key = Some(key);
                tweak(c);
            },
            None,
            Some(ca),
        )
        .await
    }

    async fn start_inner(
        tweak: impl FnOnce(&mut Config),
        api_key: Option<&str>,
        trust: Option<&metronome_testkit::TestCa>,
    ) -> Harness {
        let nats = NatsServer::start().expect("nats-server");
        let mut config = Config {
            listen: "127.0.0.1:0".into(),
            nats_url: nats.url(),
            body_limit_bytes: 64 * 1024,
            allow_anonymous: true,
            ..Config::default()
        };
        tweak(&mut config);
        let gateway = bind(config).await.expect("gateway binds");
        let scheme = if trust.is_some() { "https" } else { "http" };
        let base = format!("{scheme}://{}", gateway.local_addr());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { gateway.serve(shutdown).await.expect("gateway serves") }
        });
        let client = async_nats::ConnectOptions::new()
            .reconnect_delay_callback(|_| Duration::from_millis(100))
            .connect(nats.url())
            .await
            .expect("test connects to NATS");
        let js = jetstream::new(client.clone());
        let buckets = ensure_all(&js, &StreamSettings::default())
            .await
            .expect("streams");
        let http = match trust {
            Some(ca) => https_client(&ca.ca_file()),
            None => reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("http client"),
        };
        let mut h = Harness {
            nats,
            client,
            js,
            buckets,
            base,
            http,
            api_key: api_key.map(String::from),
            shutdown,
            server: Some(server),
            fake: None,
        };
        h.fake = Some(tokio::spawn(fake_dispatcher_and_worker(
            h.client.clone(),
            h.js.clone(),
            h.shutdown.clone(),
        )));
        h.register_worker(WORKER, MODEL).await;
        h.wait_model_listed(MODEL).await;
        h
    }

    /// Cancel the gateway's shutdown token and wait (up to [`WAIT`]) for `serve` to
    /// return; whether it did.
    pub async fn stop_gateway(&mut self) -> bool {
        self.shutdown.cancel();
        let Some(server) = self.server.take() else {
            return true;
        };
        tokio::time::timeout(WAIT, server).await.is_ok()
    }

    /// Stop the stand-in dispatcher and worker: nothing consumes JOBS any more.
    pub fn stop_fake(&mut self) {
        if let Some(f) = self.fake.take() {
            f.abort();
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn register_worker(&self, worker_id: &str, model: &str) {
        let status = WorkerStatus {
            v: 1,
            worker_id: worker_id.into(),
            model: model.into(),
            node: Some("node1".into()),
            gpu_index: Some(0),
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
            seq: 1,
            sent_ms: metronome_protocol::time::unix_ms(),
            max_epoch: 0,
        };
        self.buckets
            .workers
            .put(worker_id, serde_json::to_vec(&status).unwrap().into())
            .await
            .expect("worker status put");
    }

    /// `request` with the harness's API key, when it has one.
    pub fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    pub async fn listed_models(&self) -> Vec<String> {
        let body: Value = self
            .authorized(self.http.get(self.url("/v1/models")))
            .send()
            .await
            .expect("GET /v1/models")
            .json()
            .await
            .expect("models JSON");
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    }

    pub async fn wait_model_listed(&self, model: &str) {
        wait_for(&format!("{model} listed in /v1/models"), WAIT, || async {
            self.listed_models()
                .await
                .contains(&model.to_string())
                .then_some(())
        })
        .await;
    }

    pub async fn put_leader(&self) {
        self.buckets
            .leader
            .put(
                LEADER_KEY,
                Bytes::from_static(b"{\"dispatcher_id\":\"test\"}"),
            )
            .await
            .expect("leader put");
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.authorized(self.http.post(self.url(path)))
            .json(body)
            .send()
            .await
            .expect("request sent")
    }

    /// A normal chat request succeeds: the gateway keeps serving.
    pub async fn assert_serving(&self) {
        let resp = self
            .post("/v1/chat/completions", &chat_body("hello", false))
            .await;
        assert_eq!(resp.status(), 200, "a normal request after an error");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(s) = self.server.take() {
            s.abort();
        }
        if let Some(f) = self.fake.take() {
            f.abort();
        }
    }
}

/// An HTTP client that trusts the CA in `ca_file` and no other.
pub fn https_client(ca_file: &std::path::Path) -> reqwest::Client {
    let pem = std::fs::read(ca_file).expect("CA file");
    reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("CA certificate"))
        .https_only(true)
        .build()
        .expect("https client")
}

/// The next job published on `submitted` (within [`WAIT`]): the message, for its headers,
/// and its body as a Job.
pub async fn next_job(
    submitted: &mut async_nats::Subscriber,
) -> (async_nats::Message, metronome_protocol::Job) {
    let message = tokio::time::timeout(WAIT, submitted.next())
        .await
        .expect("a job within the wait")
        .expect("the subscription is open");
    let job = serde_json::from_slice(&message.payload).expect("the body is a Job");
    (message, job)
}

/// Returns once the server has processed every subscription `client` made before: a
/// message to a fresh subject on the same connection comes back only after them
/// (`flush` only empties the client's buffer).
pub async fn sync_subscriptions(client: &async_nats::Client) {
    let subject = client.new_inbox();
    let mut probe = client
        .subscribe(subject.clone())
        .await
        .expect("probe subscribe");
    client
        .publish(subject, Bytes::from_static(b"probe"))
        .await
        .expect("probe publish");
    tokio::time::timeout(WAIT, probe.next())
        .await
        .expect("the probe comes back")
        .expect("probe subscription open");
}

pub fn chat_body(text: &str, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "stream": stream,
    })
}

pub fn completion_body(text: &str, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": text, "max_tokens": 16, "stream": stream})
}

/// Asserts OpenAI's error shape and returns the `error` object.
pub async fn assert_openai_error(resp: reqwest::Response, status: u16, kind: &str) -> Value {
    assert_eq!(resp.status().as_u16(), status);
    assert!(
        resp.headers().contains_key("x-metronome-job-id"),
        "error responses carry the job id"
    );
    let body: Value = resp.json().await.expect("error body is JSON");
    let error = body["error"].clone();
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], kind, "{body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{body}"
    );
    error
}

/// What the fake does with a job, from the markers in its request text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Script {
    /// Assign, stream "Hel" "lo" (out of order on the wire), finish.
    Reply,
    /// The dispatcher's final result: queue full.
    QueueFull,
    /// The dispatcher's rejected decision with `queue_full` (no final result).
    RejectQueueFull,
    /// The dispatcher's final result: no capacity before the deadline.
    Deadline,
    /// Assigned, then the worker fails before any chunk.
    WorkerFailed,
    /// Assigned, one chunk, then the worker is lost.
    LostAfterChunk,
    /// Assigned, one chunk, then silence.
    Hold,
    /// Attempt 1 streams "Hel" and its worker restarts; attempt 2 runs on the same worker
    /// and streams "Bye" "now" with `seq` from 0, then finishes.
    Rerun,
    /// Assigned; a worker that does not hold the job streams and finishes [`FORGED`] under
    /// its own id, then the assigned worker answers "Hel" "lo".
    Forged,
    /// As [`Script::Forged`], the forged results sent before the decision.
    ForgedEarly,
    /// As [`Script::Forged`], the forged bodies naming the assigned worker.
    ForgedBody,
    /// The assigned worker's first chunk before its decision, the rest after.
    Early,
    /// The assigned worker's chunks and final result all before its decision.
    EarlyFinal,
    /// Assigned; chunk 0, then chunks 2 to 40 of 1 KiB each, never chunk 1, then silence.
    ChunkMissing,
}

fn script_for(job: &Job) -> Script {
    let text = job.request.to_string();
    for (marker, script) in [
        ("#reject_queue_full", Script::RejectQueueFull),
        ("#queue_full", Script::QueueFull),
        ("#deadline", Script::Deadline),
        ("#worker_failed", Script::WorkerFailed),
        ("#lost", Script::LostAfterChunk),
        ("#hold", Script::Hold),
        ("#rerun", Script::Rerun),
        ("#forged_early", Script::ForgedEarly),
        ("#forged_body", Script::ForgedBody),
        ("#forged", Script::Forged),
        ("#early_final", Script::EarlyFinal),
        ("#early", Script::Early),
        ("#chunk_missing", Script::ChunkMissing),
    ] {
        if text.contains(marker) {
            return script;
        }
    }
    Script::Reply
}

async fn fake_dispatcher_and_worker(
    client: async_nats::Client,
    js: jetstream::Context,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let consumer = async {
            js.get_stream(STREAM_JOBS)
                .await
                .ok()?
                .get_or_create_consumer(
                    CONSUMER_DISPATCHER,
                    pull::Config {
                        durable_name: Some(CONSUMER_DISPATCHER.into()),
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        ..Default::default()
                    },
                )
                .await
                .ok()?
                .messages()
                .await
                .ok()
        }
        .await;
        let Some(mut messages) = consumer else {
            // NATS is down (fault tests): try again shortly.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while let Some(message) = messages.next().await {
            let Ok(message) = message else { continue };
            let _ = message.ack().await;
            let Ok(job) = serde_json::from_slice::<Job>(&message.payload) else {
                continue;
            };
            tokio::spawn(play(client.clone(), js.clone(), job));
        }
    }
}

fn decision(job: &Job, outcome: Outcome, reason_code: Option<&str>) -> Decision {
    Decision {
        v: 1,
        job_id: job.id.clone(),
        model: Some(job.model.clone()),
        outcome,
        attempt: 1,
        reason: reason_code.map(|c| format!("test dispatcher: {c}")),
        reason_code: reason_code.map(String::from),
        worker_id: (outcome == Outcome::Assigned).then(|| WORKER.to_string()),
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
        tenant: None,
        priority: None,
        fair_counter: None,
    }
}

fn chunk_data(job: &Job, text: &str) -> Value {
    match job.endpoint {
        Endpoint::Chat => json!({
            "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
            "model": job.model,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}],
        }),
        Endpoint::Completion => json!({
            "id": "cmpl-test", "object": "text_completion", "created": 1, "model": job.model,
            "choices": [{"index": 0, "text": text, "finish_reason": null}],
        }),
        Endpoint::Embedding => panic!("an embedding is not streamed"),
    }
}

fn response(job: &Job) -> Value {
    let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
    match job.endpoint {
        Endpoint::Chat => json!({
            "id": "chatcmpl-test", "object": "chat.completion", "created": 1, "model": job.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                         "finish_reason": "stop"}],
            "usage": usage,
        }),
        Endpoint::Completion => json!({
            "id": "cmpl-test", "object": "text_completion", "created": 1, "model": job.model,
            "choices": [{"index": 0, "text": "Hello", "finish_reason": "stop"}],
            "usage": usage,
        }),
        Endpoint::Embedding => json!({
            "object": "list", "model": job.model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
        }),
    }
}

fn final_result(job: &Job, error: Option<(ErrorCode, &str)>, chunks: u64) -> FinalResult {
    FinalResult {
        v: 1,
        job_id: job.id.clone(),
        worker_id: Some(WORKER.into()),
        response: error.is_none().then(|| response(job)),
        error: error.map(|(code, message)| ResultError {
            code,
            message: message.into(),
        }),
        usage: Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            total_tokens: 5,
        },
        chunks,
        ttft_ms: None,
        e2e_ms: None,
    }
}

async fn play(client: async_nats::Client, js: jetstream::Context, job: Job) {
    // The gateway names its key's tenant in both the subject and the body.
    let tenant = job.tenant.clone();
    let publish_decision = |d: Decision| {
        let js = js.clone();
        let subject = decision_subject(tenant.as_deref(), &d.job_id);
        async move {
            js.publish(subject, serde_json::to_vec(&d).unwrap().into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    let chunk = |seq: u64, text: &str| ResultChunk {
        v: 1,
        job_id: job.id.clone(),
        seq,
        worker_id: WORKER.into(),
        attempt: None,
        data: chunk_data(&job, text),
    };
    // Each result on its publisher's subject: a worker's own id (the body's), or the
    // leader's token for a final result that names no worker.
    let publish_chunk = |c: ResultChunk| {
        let client = client.clone();
        let subject = result_chunk_subject(tenant.as_deref(), &c.job_id, &c.worker_id);
        async move {
            client
                .publish(subject, serde_json::to_vec(&c).unwrap().into())
                .await
                .unwrap();
        }
    };
    let publish_final = |f: FinalResult| {
        let js = js.clone();
        let publisher = f.worker_id.as_deref().unwrap_or(DISPATCHER_PUBLISHER);
        let subject = result_final_subject(tenant.as_deref(), &f.job_id, publisher);
        async move {
            js.publish(subject, serde_json::to_vec(&f).unwrap().into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    match script_for(&job) {
        Script::Forged | Script::ForgedEarly | Script::ForgedBody => {
            // A worker that does not hold the job answers it first, under its own id
            // (what the servers allow it) or, for `ForgedBody`, under its own id with a
            // body naming the assigned worker; the real worker answers after it.
            let forged_chunk = ResultChunk {
                worker_id: INTRUDER.into(),
                data: chunk_data(&job, FORGED),
                ..chunk(0, FORGED)
            };
            let mut forged_final = final_result(&job, None, 1);
            forged_final.worker_id = Some(INTRUDER.into());
            forged_final.response = Some(json!({
                "id": "forged", "object": "chat.completion", "created": 1, "model": job.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": FORGED},
                             "text": FORGED, "finish_reason": "stop"}],
            }));
            let forge = || async {
                if script_for(&job) == Script::ForgedBody {
                    // The body claims the assigned worker; the subject is the intruder's.
                    let mut c = forged_chunk.clone();
                    c.worker_id = WORKER.into();
                    let subject = result_chunk_subject(tenant.as_deref(), &c.job_id, INTRUDER);
                    client
                        .publish(subject, serde_json::to_vec(&c).unwrap().into())
                        .await
                        .unwrap();
                    let mut f = forged_final.clone();
                    f.worker_id = Some(WORKER.into());
                    let subject = result_final_subject(tenant.as_deref(), &f.job_id, INTRUDER);
                    client
                        .publish(subject, serde_json::to_vec(&f).unwrap().into())
                        .await
                        .unwrap();
                } else {
                    publish_chunk(forged_chunk.clone()).await;
                    publish_final(forged_final.clone()).await;
                }
            };
            if script_for(&job) == Script::ForgedEarly {
                forge().await;
                publish_decision(decision(&job, Outcome::Assigned, None)).await;
            } else {
                publish_decision(decision(&job, Outcome::Assigned, None)).await;
                forge().await;
            }
            publish_chunk(chunk(0, "Hel")).await;
            publish_chunk(chunk(1, "lo")).await;
            publish_final(final_result(&job, None, 2)).await;
        }
        Script::Early => {
            // The assigned worker streams before its decision reaches the gateway (the
            // Assignment is published first): held, then relayed once the decision comes.
            publish_chunk(chunk(0, "Hel")).await;
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_chunk(chunk(1, "lo")).await;
            publish_final(final_result(&job, None, 2)).await;
        }
        Script::EarlyFinal => {
            // All of it before the decision: the final result too.
            publish_chunk(chunk(0, "Hel")).await;
            publish_chunk(chunk(1, "lo")).await;
            publish_final(final_result(&job, None, 2)).await;
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
        }
        Script::ChunkMissing => {
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_chunk(chunk(0, "Hel")).await;
            let text = "x".repeat(1024);
            for seq in 2..=40 {
                publish_chunk(chunk(seq, &text)).await;
            }
        }
        Script::Reply => {
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            // Out of order on the wire: the gateway must put them back in order.
            publish_chunk(chunk(1, "lo")).await;
            publish_chunk(chunk(0, "Hel")).await;
            publish_final(final_result(&job, None, 2)).await;
        }
        Script::QueueFull => {
            let mut f = final_result(&job, Some((ErrorCode::QueueFull, "queue full")), 0);
            f.worker_id = None;
            publish_final(f).await;
        }
        Script::RejectQueueFull => {
            publish_decision(decision(&job, Outcome::Rejected, Some("queue_full"))).await;
        }
        Script::Deadline => {
            publish_decision(decision(&job, Outcome::Expired, None)).await;
            let mut f = final_result(
                &job,
                Some((
                    ErrorCode::DeadlineExceeded,
                    "no capacity before the deadline",
                )),
                0,
            );
            f.worker_id = None;
            publish_final(f).await;
        }
        Script::WorkerFailed => {
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_final(final_result(
                &job,
                Some((ErrorCode::WorkerFailed, "model server returned 500")),
                0,
            ))
            .await;
        }
        Script::LostAfterChunk => {
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_chunk(chunk(0, "Hel")).await;
            publish_final(final_result(
                &job,
                Some((ErrorCode::WorkerLost, "worker died after streaming")),
                1,
            ))
            .await;
        }
        Script::Hold => {
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_chunk(chunk(0, "Hel")).await;
        }
        Script::Rerun => {
            let of_attempt = |attempt: u32, seq: u64, text: &str| ResultChunk {
                attempt: Some(attempt),
                ..chunk(seq, text)
            };
            publish_decision(decision(&job, Outcome::Assigned, None)).await;
            publish_chunk(of_attempt(1, 0, "Hel")).await;
            publish_chunk(of_attempt(2, 0, "Bye")).await;
            publish_chunk(of_attempt(2, 1, "now")).await;
            publish_final(final_result(&job, None, 2)).await;
        }
    }
}
