//! Test support: real NATS and Redis from metronome-testkit, an OpenAI-shaped stub model
//! server (a fake of the model server only; NATS and Redis are always real), and helpers to
//! start an agent in-process and publish assignments.
//!
//! The stub streams `max_tokens` tokens `t0 t1 …` and honours two test-only request fields:
//! `stub_delay_ms` (pause before each token, so a job stays running long enough to be
//! observed) and `stub_fail` (`"status"`: HTTP 500 before any token).

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use metronome_protocol::names::{work_msg_id, work_subject, HEADER_MSG_ID};
use metronome_protocol::setup::{ensure_all, Buckets, StreamSettings};
use metronome_protocol::{Assignment, Endpoint, Job, PROTOCOL_VERSION};
use metronome_runtime::nats::NatsAuth;
use metronome_runtime::redis::RedisTls;
use metronome_testkit::{NatsServer, RedisServer, TestCa};
use metronome_worker_agent::{Config, Dependencies, NoGpu, RunningAgent, ServerKind};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub const WAIT: Duration = Duration::from_secs(15);
pub const MODEL: &str = "stub/llama-3.1-8b";

/// What the stub saw.
#[derive(Default)]
pub struct StubStats {
    pub requests: AtomicU64,
    /// Requests that arrived with `stream: true` and `stream_options.include_usage: true`.
    pub forced_streaming: AtomicU64,
    /// Streams whose client went away before the end (the connection was closed).
    pub aborted: AtomicU64,
    pub running: AtomicU64,
    /// Each completion request's `x-request-id` and `traceparent` headers, in arrival order.
    pub ids: std::sync::Mutex<Vec<(Option<String>, Option<String>)>>,
    /// Each completion request's body, in arrival order.
    pub bodies: std::sync::Mutex<Vec<Value>>,
}

/// Counts a stream as aborted unless it reached its end.
struct AbortGuard {
    stats: Arc<StubStats>,
    finished: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        self.stats.running.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.stats.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Serve `app` on a free port of 127.0.0.1 until the returned token is cancelled.
pub async fn serve(app: Router) -> (SocketAddr, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    // Without TCP_NODELAY small SSE writes wait for the client's delayed ACK (~40 ms),
    // which real servers (uvicorn) avoid: set it, as they do.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { s.cancelled().await })
            .await
            .unwrap();
    });
    (addr, stop)
}

pub struct Stub {
    pub addr: SocketAddr,
    pub stats: Arc<StubStats>,
    stop: CancellationToken,
}

impl Stub {
    pub async fn start() -> Stub {
        let stats = Arc::new(StubStats::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/health", get(|| async { "ok" }))
            .route("/metrics", get(metrics))
            .with_state(stats.clone());
        let (addr, stop) = serve(app).await;
        Stub { addr, stats, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn metrics(State(stats): State<Arc<StubStats>>) -> String {
    let running = stats.running.load(Ordering::SeqCst);
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{MODEL}\"}} {running}\n\
         vllm:num_requests_waiting{{model_name=\"{MODEL}\"}} 0\n\
         vllm:kv_cache_usage_perc{{model_name=\"{MODEL}\"}} 0.125\n\
         vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"1000\"}} 1.0\n"
    )
}

async fn chat(
    State(stats): State<Arc<StubStats>>,
    headers: axum::http::HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    generate(stats, &headers, body, Endpoint::Chat)
}

async fn completions(
    State(stats): State<Arc<StubStats>>,
    headers: axum::http::HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    generate(stats, &headers, body, Endpoint::Completion)
}

fn generate(
    stats: Arc<StubStats>,
    headers: &axum::http::HeaderMap,
    body: Value,
    endpoint: Endpoint,
) -> Response {
    stats.requests.fetch_add(1, Ordering::SeqCst);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    stats
        .ids
        .lock()
        .unwrap()
        .push((header("x-request-id"), header("traceparent")));
    stats.bodies.lock().unwrap().push(body.clone());
    if body["stream"] == true && body["stream_options"]["include_usage"] == true {
        stats.forced_streaming.fetch_add(1, Ordering::SeqCst);
    }
    if body["stub_fail"] == "status" {
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": {"message": "stub: engine dead", "type": "internal"}})),
        )
            .into_response();
    }
    let n = body["max_tokens"].as_u64().unwrap_or(4);
    let delay = Duration::from_millis(body["stub_delay_ms"].as_u64().unwrap_or(0));
    let prompt_tokens = 7u64;
    stats.running.fetch_add(1, Ordering::SeqCst);
    let events = async_stream::stream! {
        let mut guard = AbortGuard { stats: stats.clone(), finished: false };
        let (object, id) = match endpoint {
            Endpoint::Chat => ("chat.completion.chunk", "chatcmpl-stub"),
            Endpoint::Completion | Endpoint::Embedding => ("text_completion", "cmpl-stub"),
        };
        let piece = |content: Value, finish: Value| match endpoint {
            Endpoint::Chat => json!({"id": id, "object": object, "created": 1, "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}),
            Endpoint::Completion | Endpoint::Embedding => json!({"id": id, "object": object, "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": content, "finish_reason": finish}]}),
        };
        if endpoint == Endpoint::Chat {
            yield Ok::<_, Infallible>(Event::default().data(json!({"id": id, "object": object, "created": 1, "model": MODEL,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}).to_string()));
        }
        for i in 0..n {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            yield Ok(Event::default().data(piece(json!(format!("t{i} ")), Value::Null).to_string()));
        }
        yield Ok(Event::default().data(piece(json!(""), json!("length")).to_string()));
        yield Ok(Event::default().data(json!({"id": id, "object": object, "created": 1, "model": MODEL, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}).to_string()));
        yield Ok(Event::default().data("[DONE]"));
        guard.finished = true;
    };
    Sse::new(events).into_response()
}

/// Real servers plus the stub.
pub struct Env {
    pub nats: NatsServer,
    pub redis: RedisServer,
    pub stub: Stub,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub buckets: Buckets,
    /// The CA of servers started by [`Env::start_tls`].
    pub ca: Option<TestCa>,
}

impl Env {
    pub async fn start() -> Env {
        let nats = NatsServer::start().expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        Env::with_servers(nats, redis, None).await
    }

    /// As [`Env::start`], with NATS requiring TLS and Redis serving TLS, both with
    /// certificates of a throwaway CA; [`Env::config`] then trusts it and uses `rediss://`.
    pub async fn start_tls() -> Env {
        let ca = TestCa::generate().expect("test CA");
        let nats = NatsServer::start_tls("", &ca, false).expect("nats-server with TLS");
        let redis = RedisServer::start_tls("", &ca).expect("redis-server with TLS");
        Env::with_servers(nats, redis, Some(ca)).await
    }

    async fn with_servers(nats: NatsServer, redis: RedisServer, ca: Option<TestCa>) -> Env {
        let stub = Stub::start().await;
        let auth = NatsAuth {
            ca_file: ca.as_ref().map(TestCa::ca_file),
            ..NatsAuth::default()
        };
        let client = auth
            .connect_options()
            .expect("options")
            .connect(nats.url())
            .await
            .expect("connect to nats");
        let js = jetstream::new(client.clone());
        let buckets = ensure_all(&js, &StreamSettings::default())
            .await
            .expect("streams");
        let env = Env {
            nats,
            redis,
            stub,
            client,
            js,
            buckets,
            ca,
        };
        let (url, tls) = env.redis_settings();
        load_ewma_function(tls.client(&url).expect("redis client")).await;
        env
    }

    /// The Redis URL and TLS settings a component uses here.
    pub fn redis_settings(&self) -> (String, RedisTls) {
        match &self.ca {
            Some(ca) => (
                self.redis.tls_url(),
                RedisTls {
                    ca_file: Some(ca.ca_file()),
                    ..RedisTls::default()
                },
            ),
            None => (self.redis.url(), RedisTls::default()),
        }
    }

    pub fn config(&self, worker_id: &str) -> Config {
        Config {
            worker_id: worker_id.into(),
            model: MODEL.into(),
            model_server_url: self.stub.url(),
            model_server_kind: ServerKind::Vllm,
            // The stub's own knobs travel like a model server's extra fields.
            extra_request_fields: Some(vec!["stub_delay_ms".into(), "stub_fail".into()]),
            nats_url: self.nats.url(),
            nats_auth: NatsAuth {
                ca_file: self.ca.as_ref().map(TestCa::ca_file),
                ..NatsAuth::default()
            },
            redis_url: self.redis_settings().0,
            redis_tls: self.redis_settings().1,
            heartbeat_interval_ms: 100,
            progress_ack_interval_ms: 200,
            ack_wait_ms: 5_000,
            drain_timeout_ms: 10_000,
            metrics_port: Some(0),
            ..Config::default()
        }
    }

    pub async fn start_agent(&self, config: Config) -> (RunningAgent, CancellationToken) {
        self.start_agent_with_gpu(config, Arc::new(NoGpu)).await
    }

    /// An agent whose GPU figures come from `gpu`.
    pub async fn start_agent_with_gpu(
        &self,
        config: Config,
        gpu: Arc<dyn metronome_worker_agent::GpuProbe>,
    ) -> (RunningAgent, CancellationToken) {
        config.validate().expect("valid test config");
        let shutdown = CancellationToken::new();
        let mut deps = Dependencies::from_config(&config).expect("deps");
        deps.gpu = gpu;
        let agent = metronome_worker_agent::start(config, deps, shutdown.clone())
            .await
            .expect("agent starts");
        (agent, shutdown)
    }

    /// Publish an assignment of `job` on `work.<worker>` through JetStream, as the leader
    /// of `epoch` would: the lease records that epoch, so the agent believes it.
    pub async fn assign(&self, worker: &str, job: &Job, epoch: u64) {
        self.lead(epoch).await;
        let a = Assignment {
            v: PROTOCOL_VERSION,
            job: job.clone(),
            worker_id: worker.into(),
            epoch,
            attempt: 1,
            assigned_ms: metronome_protocol::time::unix_ms(),
            cached_prefix: None,
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(HEADER_MSG_ID, work_msg_id(&job.id, 1).as_str());
        self.js
            .publish_with_headers(
                work_subject(worker),
                headers,
                serde_json::to_vec(&a).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .expect("WORK accepts the assignment");
    }

    /// Record `epoch` as the leading term's in the leader lease (what a dispatcher does on
    /// taking over), unless the lease already records a higher one.
    pub async fn lead(&self, epoch: u64) {
        let kv = self
            .js
            .get_key_value(metronome_protocol::names::BUCKET_LEADER)
            .await
            .expect("leader bucket");
        let current = kv
            .get(metronome_protocol::names::LEADER_KEY)
            .await
            .unwrap()
            .and_then(|v| serde_json::from_slice::<metronome_protocol::LeaseValue>(&v).ok())
            .and_then(|v| v.epoch)
            .unwrap_or(0);
        if current >= epoch {
            return;
        }
        let value = metronome_protocol::LeaseValue {
            dispatcher_id: "test-leader".into(),
            acquired_ms: 0,
            renewed_ms: 0,
            epoch: Some(epoch),
        };
        kv.put(
            metronome_protocol::names::LEADER_KEY,
            serde_json::to_vec(&value).unwrap().into(),
        )
        .await
        .expect("lease written");
    }

    /// Fetch the agent's own /metrics text.
    pub async fn agent_metrics(agent: &RunningAgent) -> String {
        let addr = agent.metrics_addr.expect("metrics enabled");
        reqwest::get(format!("http://{addr}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// A job for the stub: `max_tokens` tokens, `delay_ms` before each.
pub fn job(id: &str, endpoint: Endpoint, max_tokens: u32, delay_ms: u64) -> Job {
    let request = match endpoint {
        Endpoint::Chat => json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": max_tokens, "stub_delay_ms": delay_ms}),
        Endpoint::Completion => json!({"model": MODEL, "prompt": "once upon a time",
                                        "max_tokens": max_tokens, "stub_delay_ms": delay_ms}),
        Endpoint::Embedding => json!({"model": MODEL, "input": "once upon a time"}),
    };
    Job {
        v: PROTOCOL_VERSION,
        id: id.into(),
        model: MODEL.into(),
        endpoint,
        request,
        prompt_tokens: 5,
        max_tokens,
        submitted_ms: metronome_protocol::time::unix_ms(),
        deadline_ms: None,
        slo: None,
        tenant: None,
        priority: None,
        prefix: None,
        traceparent: None,
    }
}

/// The value of the first sample of `name` carrying every `key="value"` pair given.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metronome_protocol::prometheus::value(text, name, labels)
}

/// Collect messages of a subscription into a shared list, in arrival order.
pub fn collect(mut sub: async_nats::Subscriber) -> Arc<std::sync::Mutex<Vec<async_nats::Message>>> {
    let list = Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = list.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            l.lock().unwrap().push(m);
        }
    });
    list
}

/// Load the EWMA update function into Redis, as the leading dispatcher does: an agent only
/// calls it.
pub async fn load_ewma_function(client: redis::Client) {
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to redis");
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(metronome_protocol::redis_keys::EWMA_LIBRARY)
        .query_async::<String>(&mut conn)
        .await
        .expect("load the EWMA update function");
}
