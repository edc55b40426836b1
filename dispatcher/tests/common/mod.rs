//! Shared helpers of the dispatcher's integration tests: real nats-server and
//! redis-server from metronome-testkit, a dispatcher run in-process (or as a process),
//! and test code that acts as workers over NATS (heartbeats in the `workers` bucket,
//! a durable consumer on `work.<id>`, completion events on `events.done.<id>`).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv};
use bytes::Bytes;
use futures::StreamExt;
use metronome_dispatcher::{Config, Running};
use metronome_protocol::names;
use metronome_protocol::{
    Assignment, CompletionEvent, CompletionOutcome, Decision, FinalResult, WorkerStatus,
};
use metronome_testkit::{wait_for, NatsServer, RedisServer};
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub const WAIT: Duration = Duration::from_secs(20);

/// Real servers plus a client.
pub struct Env {
    pub nats: NatsServer,
    pub redis: RedisServer,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub workers: kv::Store,
}

impl Env {
    /// The latest record stored on `subject` of `stream`, waited for.
    pub async fn stored<T: serde::de::DeserializeOwned>(&self, stream: &str, subject: String) -> T {
        let stream = self.js.get_stream(stream).await.unwrap();
        metronome_testkit::wait_for(&format!("a record on {subject}"), WAIT, || {
            let (stream, subject) = (stream.clone(), subject.clone());
            async move {
                let m = stream.direct_get_last_for_subject(subject).await.ok()?;
                Some(serde_json::from_slice(&m.payload).expect("decodes"))
            }
        })
        .await
    }

    pub async fn start() -> Env {
        Env::start_with(&test_stream_settings()).await
    }

    /// Real servers with the streams created by `settings` (a dispatcher leaves existing
    /// streams as it finds them, so a test can shorten, e.g., the de-duplication window).
    pub async fn start_with(settings: &metronome_protocol::setup::StreamSettings) -> Env {
        let nats = NatsServer::start().expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        let client = async_nats::connect(nats.url()).await.expect("connect");
        let js = jetstream::new(client.clone());
        let buckets = metronome_protocol::setup::ensure_all(&js, settings)
            .await
            .expect("streams");
        Env {
            nats,
            redis,
            client,
            js,
            workers: buckets.workers,
        }
    }

    /// A dispatcher configuration for this environment: short lease, fast tick.
    pub fn config(&self, id: &str) -> Config {
        let mut c = Config {
            nats_url: self.nats.url(),
            redis_url: self.redis.url(),
            dispatcher_id: id.into(),
            lease_ttl_ms: 1500,
            lease_renew_ms: 250,
            fence_after_ms: 1000,
            standby_poll_ms: 100,
            tick_ms: 50,
            ewma_refresh_ms: 200,
            storage: metronome_dispatcher::config::Storage::Memory,
            ..Config::default()
        };
        c.scheduler.heartbeat_timeout_ms = 60_000;
        c
    }

    /// Start a dispatcher in-process and wait until it leads.
    pub async fn dispatcher(&self, config: Config) -> (Running, CancellationToken) {
        let token = CancellationToken::new();
        let running = metronome_dispatcher::start(config, token.clone())
            .await
            .expect("dispatcher starts");
        let metrics = running.metrics.clone();
        wait_for("the dispatcher to lead", WAIT, || {
            let m = metrics.clone();
            async move { (m.is_leader.load(Relaxed) == 1).then_some(()) }
        })
        .await;
        (running, token)
    }

    /// Put a worker's heartbeat in the `workers` bucket.
    pub async fn heartbeat(&self, status: &WorkerStatus) {
        self.workers
            .put(
                status.worker_id.as_str(),
                Bytes::from(serde_json::to_vec(status).unwrap()),
            )
            .await
            .expect("put heartbeat");
    }

    /// Put `status` again every `every` (next `seq`, `sent_ms` now less `lag_ms`: a worker
    /// whose clock lags) until the returned [`Beating`] is stopped.
    pub fn keep_beating(&self, mut status: WorkerStatus, every: Duration, lag_ms: u64) -> Beating {
        let stop = CancellationToken::new();
        let (workers, until) = (self.workers.clone(), stop.clone());
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = until.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                status.seq += 1;
                status.sent_ms = metronome_protocol::time::unix_ms() - lag_ms;
                let body = serde_json::to_vec(&status).unwrap();
                workers
                    .put(status.worker_id.as_str(), body.into())
                    .await
                    .unwrap();
            }
        });
        Beating { stop, task }
    }

    /// Register `n` idle workers `<prefix>-<i>` serving `model`, each with a WORK consumer.
    pub async fn workers(
        &self,
        prefix: &str,
        n: usize,
        model: &str,
        cap: u32,
    ) -> Vec<WorkerStatus> {
        let mut out = Vec::new();
        for i in 0..n {
            let s = worker(&format!("{prefix}-{i}"), model, cap);
            self.work_consumer(&s.worker_id).await;
            self.heartbeat(&s).await;
            out.push(s);
        }
        out
    }

    /// The durable consumer a worker-agent would use on `work.<id>`.
    pub async fn work_consumer(&self, worker_id: &str) -> consumer::PullConsumer {
        let stream = self.js.get_stream(names::STREAM_WORK).await.unwrap();
        stream
            .get_or_create_consumer(
                &names::work_consumer(worker_id),
                consumer::pull::Config {
                    durable_name: Some(names::work_consumer(worker_id)),
                    filter_subject: names::work_subject(worker_id),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ..Default::default()
                },
            )
            .await
            .unwrap()
    }

    /// Fetch (and ack) what is waiting on `work.<id>` now.
    pub async fn take_work(&self, worker_id: &str) -> Vec<(Assignment, HashMap<String, String>)> {
        let c = self.work_consumer(worker_id).await;
        let mut batch = c
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .unwrap();
        let mut out = Vec::new();
        while let Some(Ok(m)) = batch.next().await {
            let headers = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| (k.to_string(), v[0].to_string()))
                        .collect()
                })
                .unwrap_or_default();
            out.push((serde_json::from_slice(&m.payload).unwrap(), headers));
            m.ack().await.unwrap();
        }
        out
    }

    /// Submit a job (with its id as `Nats-Msg-Id`).
    pub async fn submit(&self, id: &str, model: &str, prompt: u32, max_tokens: u32) {
        self.submit_raw(id, job_json(id, model, prompt, max_tokens))
            .await;
    }

    pub async fn submit_raw(&self, id: &str, body: serde_json::Value) {
        self.submit_bytes(id, serde_json::to_vec(&body).unwrap())
            .await;
    }

    /// Submit `body` as its tenant's client would: on `jobs.submit.<tenant>` of the tenant
    /// the body names (`_anon` for none, or for a body that is not a job).
    pub async fn submit_bytes(&self, id: &str, body: Vec<u8>) {
        let tenant = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("tenant").and_then(|t| t.as_str()).map(str::to_string));
        self.submit_on(&names::submit_subject(tenant.as_deref()), id, body)
            .await;
    }

    /// Submit `body` on `subject`.
    pub async fn submit_on(&self, subject: &str, id: &str, body: Vec<u8>) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(names::HEADER_MSG_ID, id);
        self.js
            .publish_with_headers(subject.to_string(), headers, body.into())
            .await
            .expect("publish job")
            .await
            .expect("job stored");
    }

    /// Publish `value` as JSON on `subject` and wait until its stream has stored it.
    pub async fn store_json(&self, subject: String, value: &impl serde::Serialize) {
        self.js
            .publish(subject, serde_json::to_vec(value).unwrap().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Publish a completion event as a worker-agent would.
    pub async fn complete(&self, a: &Assignment, outcome: CompletionOutcome) {
        let ev = CompletionEvent {
            v: 1,
            job_id: a.job.id.clone(),
            worker_id: a.worker_id.clone(),
            model: a.job.model.clone(),
            epoch: a.epoch,
            attempt: a.attempt,
            outcome,
            streamed: outcome == CompletionOutcome::Done,
            error: None,
            prompt_tokens: a.job.prompt_tokens,
            output_tokens: 1,
            ttft_ms: Some(1.0),
            tpot_ms: Some(1.0),
            e2e_ms: 2.0,
            finished_ms: metronome_protocol::time::unix_ms(),
            job: None,
        };
        self.store_json(names::event_done_subject(&a.worker_id), &ev)
            .await;
    }

    /// Every decision stored so far, in stream order.
    pub async fn all_decisions(&self) -> Vec<Decision> {
        self.read_stream(names::STREAM_DECISIONS).await
    }

    /// Every final result stored so far.
    pub async fn all_finals(&self) -> Vec<FinalResult> {
        self.read_stream(names::STREAM_RESULTS).await
    }

    async fn read_stream<T: serde::de::DeserializeOwned>(&self, name: &str) -> Vec<T> {
        let mut stream = self.js.get_stream(name).await.unwrap();
        let count = stream.info().await.unwrap().state.messages;
        if count == 0 {
            return Vec::new();
        }
        let c = stream
            .create_consumer(consumer::pull::OrderedConfig {
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut msgs = c.messages().await.unwrap();
        let mut out = Vec::new();
        while (out.len() as u64) < count {
            let m = tokio::time::timeout(WAIT, msgs.next())
                .await
                .expect("stream read")
                .unwrap()
                .unwrap();
            out.push(serde_json::from_slice(&m.payload).expect("decodes"));
        }
        out
    }

    /// The latest decision of one job, whatever its tenant, when there is one.
    pub async fn decision(&self, job_id: &str) -> Option<Decision> {
        let raw = self.decision_json(job_id).await?;
        Some(serde_json::from_value(raw).expect("decision decodes"))
    }

    /// The latest decision of one job as stored, untyped: the wire form itself.
    pub async fn decision_json(&self, job_id: &str) -> Option<serde_json::Value> {
        let stream = self.js.get_stream(names::STREAM_DECISIONS).await.unwrap();
        let m = stream
            .get_last_raw_message_by_subject(&names::decision_subject_any_tenant(job_id))
            .await
            .ok()?;
        Some(serde_json::from_slice(&m.payload).expect("decision is JSON"))
    }

    /// Wait until decisions exist for each of `ids`; return them by job id.
    pub async fn decisions_for(&self, ids: &[String]) -> HashMap<String, Decision> {
        let mut found: HashMap<String, Decision> = HashMap::new();
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            for id in ids {
                if !found.contains_key(id) {
                    if let Some(d) = self.decision(id).await {
                        found.insert(id.clone(), d);
                    }
                }
            }
            if found.len() == ids.len() {
                return found;
            }
            let missing: Vec<&String> = ids.iter().filter(|i| !found.contains_key(*i)).collect();
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for decisions of {missing:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The final result of one job, when there is one.
    pub async fn final_result(&self, job_id: &str) -> Option<FinalResult> {
        let stream = self.js.get_stream(names::STREAM_RESULTS).await.unwrap();
        let m = stream
            .get_last_raw_message_by_subject(&names::result_final_subject_any_tenant(job_id))
            .await
            .ok()?;
        Some(serde_json::from_slice(&m.payload).expect("final result decodes"))
    }

    /// The current configuration of stream `name`.
    pub async fn stream_config(&self, name: &str) -> jetstream::stream::Config {
        let mut s = self.js.get_stream(name).await.unwrap();
        s.info().await.unwrap().config.clone()
    }

    /// Number of messages on the WORK stream for one subject (i.e. one worker).
    pub async fn work_count(&self) -> u64 {
        let mut s = self.js.get_stream(names::STREAM_WORK).await.unwrap();
        s.info().await.unwrap().state.messages
    }

    /// Write a worker's EWMA hash as a worker-agent would.
    pub async fn seed_ewma(&self, worker_id: &str, ttft_ms: f64, tok_s: f64) {
        let client = redis::Client::open(self.redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let key = metronome_protocol::redis_keys::ewma_key("metronome", worker_id);
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("ttft_ms")
            .arg(ttft_ms)
            .arg("tpot_ms")
            .arg(1000.0 / tok_s)
            .arg("tok_s")
            .arg(tok_s)
            .arg("e2e_ms")
            .arg(ttft_ms + 100_000.0 / tok_s)
            .arg("samples")
            .arg(50)
            .arg("updated_ms")
            .arg(metronome_protocol::time::unix_ms())
            .arg("alpha")
            .arg(0.2)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// A worker's heartbeats going on in the background ([`Env::keep_beating`]).
pub struct Beating {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Beating {
    pub async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
    }
}

pub fn test_stream_settings() -> metronome_protocol::setup::StreamSettings {
    metronome_protocol::setup::StreamSettings {
        storage: jetstream::stream::StorageType::Memory,
        leader_ttl: Duration::from_millis(1500),
        ..Default::default()
    }
}

pub fn worker(id: &str, model: &str, cap: u32) -> WorkerStatus {
    WorkerStatus {
        v: 1,
        worker_id: id.into(),
        model: model.into(),
        node: Some("test".into()),
        gpu_index: None,
        healthy: true,
        draining: false,
        max_concurrency: cap,
        active: 0,
        queued: 0,
        in_flight: Vec::new(),
        kv: Some(metronome_protocol::KvUsage {
            used_frac: 0.0,
            capacity_tokens: Some(1_000_000),
        }),
        gpu: None,
        prefill_pending_tokens: 0,
        perf: None,
        decoding: None,
        seq: 1,
        sent_ms: metronome_protocol::time::unix_ms(),
        max_epoch: 0,
    }
}

pub fn job_json(id: &str, model: &str, prompt: u32, max_tokens: u32) -> serde_json::Value {
    json!({
        "v": metronome_protocol::PROTOCOL_VERSION, "id": id, "model": model, "endpoint": "chat",
        "request": {"messages": [{"role": "user", "content": "hello"}]},
        "prompt_tokens": prompt, "max_tokens": max_tokens,
        "submitted_ms": metronome_protocol::time::unix_ms(),
    })
}
