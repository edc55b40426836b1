//! The agent's KV event subscriber against the simulator's vLLM-format publisher: the
//! index it builds holds exactly the blocks a job's prefix fingerprint names, both from
//! live batches and from the replay socket, and follows evictions and resets.

use std::time::Duration;

use metronome_gpu_sim::{SimGpu, SimGpuConfig};
use metronome_protocol::prefix::{request_token_ids, PrefixFingerprint};
use metronome_protocol::Endpoint;
use metronome_worker_agent::kv_events::{BlockIndex, KvEventSubscriber};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "llama-3.1-8b";
const WAIT: Duration = Duration::from_secs(20);

async fn spawn(kv_capacity_tokens: u32) -> (SimGpu, CancellationToken) {
    let shutdown = CancellationToken::new();
    let gpu = SimGpu::spawn(
        SimGpuConfig {
            base_step_ms: 1.0,
            prefill_ms_per_token: 0.0,
            kv_read_ms_per_token: 0.0,
            kv_capacity_tokens,
            max_model_len: kv_capacity_tokens,
            kv_events_endpoint: Some("tcp://127.0.0.1:0".into()),
            kv_events_replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            ..SimGpuConfig::new(MODEL)
        },
        shutdown.clone(),
    )
    .await
    .unwrap();
    (gpu, shutdown)
}

fn body(user: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "Answer in one line. ".repeat(8)},
        {"role": "user", "content": user},
    ]})
}

async fn chat(gpu: &SimGpu, user: &str) -> PrefixFingerprint {
    let body = body(user);
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gpu.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let _: Value = response.json().await.unwrap();
    PrefixFingerprint::of_request(Endpoint::Chat, &body).unwrap()
}

fn full_blocks(fp: &PrefixFingerprint) -> u32 {
    fp.hashes.len() as u32 * fp.block_size
}

#[tokio::test]
async fn the_index_follows_the_simulators_cache_live_and_through_replay() {
    let (gpu, shutdown) = spawn(40_000).await;
    let endpoints = gpu.kv_event_endpoints().unwrap().clone();
    let mut subscriber =
        KvEventSubscriber::connect(&endpoints.publish, endpoints.replay.as_deref(), "")
            .await
            .unwrap();
    let mut index = BlockIndex::new(16, 2_500);

    // Published before anyone could have subscribed: the replay socket has it.
    let first = chat(&gpu, &"What is a KV cache? ".repeat(5)).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while index.cached_tokens(&first) < full_blocks(&first) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "replay never had the first prompt"
        );
        for (seq, batch) in subscriber.replay_from(0).await.unwrap() {
            index.apply(seq, &batch);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(index.len(), first.hashes.len());

    // A PUB socket drops what it sends before the subscription reaches it: send distinct
    // prompts until one's batch arrives live.
    let deadline = tokio::time::Instant::now() + WAIT;
    for probe in 0.. {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscription never went live"
        );
        chat(&gpu, &format!("probe {probe} ").repeat(16)).await;
        let live = tokio::time::timeout(
            Duration::from_millis(200),
            subscriber.apply_next(&mut index),
        );
        if let Ok(applied) = live.await {
            applied.unwrap();
            break;
        }
    }

    // Live: a second prompt sharing the system prompt stores only its own blocks, chained
    // to the shared ones.
    let blocks_before = index.len();
    let second = chat(&gpu, &"And what is a block of it? ".repeat(5)).await;
    let shared = first
        .hashes
        .iter()
        .zip(&second.hashes)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared >= 3, "the system prompt spans blocks");
    tokio::time::timeout(WAIT, async {
        while index.cached_tokens(&second) < full_blocks(&second) {
            subscriber.apply_next(&mut index).await.unwrap();
        }
    })
    .await
    .expect("the second prompt's blocks arrive");
    assert!(
        second.hashes.len() > shared,
        "the second prompt has blocks of its own"
    );
    // Late probe batches may add their own blocks too.
    assert!(index.len() >= blocks_before + second.hashes.len() - shared);
    assert_eq!(index.stats().orphaned, 0);

    // A reset clears the index.
    let reset = reqwest::Client::new()
        .post(format!("{}/reset_prefix_cache", gpu.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    tokio::time::timeout(WAIT, async {
        while !index.is_empty() {
            subscriber.apply_next(&mut index).await.unwrap();
        }
    })
    .await
    .expect("AllBlocksCleared arrives");
    assert_eq!(index.stats().cleared, 1);
    shutdown.cancel();
}

#[tokio::test]
async fn evictions_under_memory_pressure_leave_the_index() {
    // 40 blocks of 16 tokens: three prompts of ~21 blocks (3 of them a shared system
    // prompt) cannot all stay cached.
    let (gpu, shutdown) = spawn(640).await;
    let endpoints = gpu.kv_event_endpoints().unwrap().clone();
    let mut subscriber =
        KvEventSubscriber::connect(&endpoints.publish, endpoints.replay.as_deref(), "")
            .await
            .unwrap();
    let mut index = BlockIndex::new(16, 40);
    let mut fingerprints = Vec::new();
    for topic in ["alpha", "bravo", "charlie"] {
        fingerprints.push(chat(&gpu, &format!("{topic} ").repeat(200)).await);
    }
    let removed_any = tokio::time::timeout(WAIT, async {
        loop {
            for (seq, batch) in subscriber
                .replay_from(index.last_seq().map_or(0, |s| s + 1))
                .await
                .unwrap()
            {
                index.apply(seq, &batch);
            }
            let last = fingerprints.last().unwrap();
            if index.cached_tokens(last) == full_blocks(last) && index.stats().removed > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        removed_any.is_ok(),
        "the newest prompt is indexed and older blocks were evicted"
    );
    // The index agrees with the simulator's own cache, prompt by prompt (the simulator
    // reuses at most the whole blocks before a prompt's last token).
    for topic in ["alpha", "bravo", "charlie"] {
        let request = body(&format!("{topic} ").repeat(200));
        let fp = PrefixFingerprint::of_request(Endpoint::Chat, &request).unwrap();
        let tokens = request_token_ids(Endpoint::Chat, &request).unwrap();
        let reusable = (tokens.len() as u32 - 1) / 16 * 16;
        assert_eq!(
            index.cached_tokens(&fp).min(reusable),
            gpu.cached_prefix_tokens(&tokens),
            "{topic}"
        );
    }
    assert!(index.len() <= 40);
    assert!(
        index.cached_tokens(&fingerprints[0]) < full_blocks(&fingerprints[0]),
        "the oldest prompt lost blocks"
    );
    shutdown.cancel();
}

/// What a new leader would rebuild from the cache streams now: the worker's latest
/// snapshot, then every retained delta.
async fn rebuilt_from_streams(
    js: &async_nats::jetstream::Context,
) -> metronome_scheduler::ReportedCaches {
    use async_nats::jetstream::consumer;
    use futures::StreamExt;
    use metronome_protocol::names;
    let mut caches = metronome_scheduler::ReportedCaches::default();
    let now = metronome_protocol::time::unix_ms();
    for (stream, filter, policy) in [
        (
            names::STREAM_CACHE_SNAPSHOTS,
            names::SUBJECT_CACHE_SNAPSHOTS_ALL,
            consumer::DeliverPolicy::LastPerSubject,
        ),
        (
            names::STREAM_CACHE_DELTAS,
            names::SUBJECT_CACHE_DELTAS_ALL,
            consumer::DeliverPolicy::All,
        ),
    ] {
        let c = js
            .get_stream(stream)
            .await
            .unwrap()
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: filter.into(),
                deliver_policy: policy,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut pending = c.cached_info().num_pending;
        let mut messages = c.messages().await.unwrap();
        while pending > 0 {
            let m = messages.next().await.unwrap().unwrap();
            pending = m.info().unwrap().pending;
            let update: metronome_protocol::CacheUpdate =
                serde_json::from_slice(&m.payload).unwrap();
            update.validate().unwrap();
            caches.apply(&update, now);
        }
    }
    caches
}

/// The agent's reports, as a new leader reads them back from the streams, say exactly
/// what the simulator's cache holds, prompt by prompt, evictions included.
#[tokio::test]
async fn the_reports_rebuild_exactly_what_the_servers_cache_holds() {
    use metronome_protocol::setup::{ensure_for_worker, StreamSettings};
    use metronome_worker_agent::cache_report::{self, ReportSettings};

    let nats = metronome_testkit::NatsServer::start().expect("nats-server");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    ensure_for_worker(
        &js,
        &StreamSettings {
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..StreamSettings::default()
        },
    )
    .await
    .unwrap();
    let (gpu, shutdown) = spawn(640).await;
    let endpoints = gpu.kv_event_endpoints().unwrap().clone();
    let stop = CancellationToken::new();
    let reporter = cache_report::spawn(
        js.clone(),
        ReportSettings {
            worker_id: "w1".into(),
            endpoint: endpoints.publish.clone(),
            replay_endpoint: endpoints.replay.clone(),
            topic: String::new(),
            block_size: 16,
            delta_interval: Duration::from_millis(20),
            snapshot_interval: Duration::from_millis(500),
        },
        stop.clone(),
    );
    for topic in ["alpha", "bravo", "charlie"] {
        chat(&gpu, &format!("{topic} ").repeat(200)).await;
    }
    let agrees = |caches: &metronome_scheduler::ReportedCaches| {
        let now = metronome_protocol::time::unix_ms();
        ["alpha", "bravo", "charlie"].iter().all(|topic| {
            let request = body(&format!("{topic} ").repeat(200));
            let fp = PrefixFingerprint::of_request(Endpoint::Chat, &request).unwrap();
            let tokens = request_token_ids(Endpoint::Chat, &request).unwrap();
            caches.cached("w1", &fp, tokens.len() as u32, now)
                == Some(gpu.cached_prefix_tokens(&tokens))
        })
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let caches = rebuilt_from_streams(&js).await;
        if agrees(&caches) {
            assert!(caches.blocks_on("w1") <= 40);
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            let now = metronome_protocol::time::unix_ms();
            let seen: Vec<_> = ["alpha", "bravo", "charlie"]
                .iter()
                .map(|topic| {
                    let request = body(&format!("{topic} ").repeat(200));
                    let fp = PrefixFingerprint::of_request(Endpoint::Chat, &request).unwrap();
                    let tokens = request_token_ids(Endpoint::Chat, &request).unwrap();
                    (
                        caches.cached("w1", &fp, tokens.len() as u32, now),
                        gpu.cached_prefix_tokens(&tokens),
                    )
                })
                .collect();
            panic!(
                "the streams never agreed with the simulator's cache: {seen:?}, {} blocks, {:?}",
                caches.blocks_on("w1"),
                caches.stats()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = body(&"alpha ".repeat(200));
    let tokens = request_token_ids(Endpoint::Chat, &first).unwrap();
    assert!(
        gpu.cached_prefix_tokens(&tokens) < (tokens.len() as u32 - 1) / 16 * 16,
        "the oldest prompt was evicted in part: the reports followed an eviction"
    );
    stop.cancel();
    reporter.await.unwrap();
    shutdown.cancel();
}
