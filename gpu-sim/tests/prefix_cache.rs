//! The simulator's prefix cache over HTTP and its KV events over a real ZMQ SUB socket:
//! a prompt's events decode to the chained hashes a job's prefix fingerprint carries, a
//! repeated prompt is served from the cache (vLLM's metrics say so), and caching can be
//! switched off per GPU.

use std::time::Duration;

use metronome_gpu_sim::{SimGpu, SimGpuConfig};
use metronome_protocol::prefix::{request_token_ids, PrefixFingerprint};
use metronome_protocol::prometheus;
use metronome_protocol::Endpoint;
use rmpv::Value;
use serde_json::{json, Value as Json};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

const MODEL: &str = "llama-3.1-8b";
const WAIT: Duration = Duration::from_secs(20);

fn fast() -> SimGpuConfig {
    SimGpuConfig {
        base_step_ms: 1.0,
        prefill_ms_per_token: 0.0,
        kv_read_ms_per_token: 0.0,
        ..SimGpuConfig::new(MODEL)
    }
}

async fn complete(gpu: &SimGpu, path: &str, body: &Json) -> Json {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", gpu.base_url()))
        .json(body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON body")
}

async fn metric(gpu: &SimGpu, name: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", gpu.base_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    prometheus::value(&text, name, &[("model_name", MODEL)])
        .unwrap_or_else(|| panic!("{name} in {text}"))
}

fn chat(system: &str, user: &str) -> Json {
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]})
}

/// One received message: topic, sequence number, decoded payload.
async fn receive(sub: &mut zeromq::SubSocket) -> (Vec<u8>, u64, Value) {
    let message = sub.recv().await.expect("receive");
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte sequence"));
    let payload = rmpv::decode::read_value(&mut frames[2].as_ref()).expect("MessagePack");
    (frames[0].to_vec(), seq, payload)
}

/// A decoded BlockStored: hashes, parent, token ids, block size.
type Stored = (Vec<u64>, Option<u64>, Vec<u64>, u64);

/// The BlockStored events of a decoded batch.
fn stored(batch: &Value) -> Vec<Stored> {
    let events = batch.as_array().unwrap()[1].as_array().unwrap();
    events
        .iter()
        .map(|e| e.as_array().unwrap())
        .filter(|e| e[0].as_str() == Some("BlockStored"))
        .map(|e| {
            assert_eq!(e.len(), 10, "vLLM's BlockStored fields");
            assert_eq!(e[6].as_str(), Some("GPU"), "medium");
            (
                e[1].as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect(),
                e[2].as_u64(),
                e[3].as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap())
                    .collect(),
                e[4].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_prompt_publishes_its_chained_blocks_which_match_the_jobs_fingerprint() {
    let shutdown = CancellationToken::new();
    let gpu = SimGpu::spawn(
        SimGpuConfig {
            kv_events_endpoint: Some("tcp://127.0.0.1:0".into()),
            kv_events_topic: "kv".into(),
            ..fast()
        },
        shutdown.clone(),
    )
    .await
    .unwrap();
    let endpoint = gpu.kv_event_endpoints().unwrap().publish.clone();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&endpoint).await.unwrap();
    sub.subscribe("kv").await.unwrap();

    // A PUB socket drops what it sends before the subscription reaches it: send distinct
    // short prompts until one's batch arrives, then the subscription is live.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut probe = 0u32;
    let first_seq = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscription never went live"
        );
        probe += 1;
        let body = json!({"model": MODEL, "max_tokens": 1,
            "prompt": (0..17).map(|i| i + 1000 * probe).collect::<Vec<_>>()});
        complete(&gpu, "/v1/completions", &body).await;
        if let Ok((_, seq, _)) =
            tokio::time::timeout(Duration::from_millis(200), receive(&mut sub)).await
        {
            break seq;
        }
    };

    let system = "You are a careful assistant. ".repeat(12);
    let body = chat(&system, "Summarise the PagedAttention paper in one line.");
    complete(&gpu, "/v1/chat/completions", &body).await;
    let fingerprint = PrefixFingerprint::of_request(Endpoint::Chat, &body).unwrap();
    let tokens = request_token_ids(Endpoint::Chat, &body).unwrap();
    assert!(fingerprint.hashes.len() >= 6, "a prompt of several blocks");

    // Late probes' batches may still come first.
    let (topic, seq, batch) = tokio::time::timeout(WAIT, async {
        loop {
            let (topic, seq, batch) = receive(&mut sub).await;
            if stored(&batch)
                .iter()
                .any(|(h, _, _, _)| h.first() == fingerprint.hashes.first())
            {
                return (topic, seq, batch);
            }
        }
    })
    .await
    .expect("the chat's batch");
    assert_eq!(topic, b"kv");
    assert!(seq > first_seq, "sequence numbers grow");
    assert!(
        batch.as_array().unwrap()[0].as_f64().unwrap() > 1.7e9,
        "ts in Unix seconds"
    );
    let events = stored(&batch);
    assert_eq!(events.len(), 1, "one prefill step, one event: {batch}");
    let (hashes, parent, token_ids, block_size) = &events[0];
    assert_eq!(
        *hashes, fingerprint.hashes,
        "the simulator's blocks are the fingerprint's"
    );
    assert_eq!(*parent, None, "chained from the start of the prompt");
    assert_eq!(*block_size, 16);
    let expected: Vec<u64> = tokens[..hashes.len() * 16]
        .iter()
        .map(|t| u64::from(*t))
        .collect();
    assert_eq!(*token_ids, expected);
    assert_eq!(
        gpu.cached_prefix_tokens(&tokens),
        (hashes.len() as u32 * 16).min((tokens.len() as u32 - 1) / 16 * 16)
    );

    // The same prompt again: no new blocks to store, the cache serves it.
    let hits_before = metric(&gpu, "vllm:prefix_cache_hits_total").await;
    complete(&gpu, "/v1/chat/completions", &body).await;
    let hits = metric(&gpu, "vllm:prefix_cache_hits_total").await - hits_before;
    assert_eq!(hits, f64::from((tokens.len() as u32 - 1) / 16 * 16));
    assert!(
        metric(&gpu, "vllm:prefix_cache_queries_total").await >= f64::from(2 * tokens.len() as u32)
    );

    // Resetting the cache announces it.
    let reset = reqwest::Client::new()
        .post(format!("{}/reset_prefix_cache", gpu.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    tokio::time::timeout(WAIT, async {
        loop {
            let (_, _, batch) = receive(&mut sub).await;
            let events = batch.as_array().unwrap()[1].as_array().unwrap().clone();
            if events
                .iter()
                .any(|e| e.as_array().unwrap()[0].as_str() == Some("AllBlocksCleared"))
            {
                return;
            }
        }
    })
    .await
    .expect("AllBlocksCleared");
    assert_eq!(gpu.cached_prefix_tokens(&tokens), 0);
    shutdown.cancel();
}

#[tokio::test]
async fn caching_switched_off_serves_every_prompt_from_scratch() {
    let shutdown = CancellationToken::new();
    let gpu = SimGpu::spawn(
        SimGpuConfig {
            enable_prefix_caching: false,
            ..fast()
        },
        shutdown.clone(),
    )
    .await
    .unwrap();
    let body = chat(&"shared system prompt ".repeat(20), "hello");
    for _ in 0..2 {
        complete(&gpu, "/v1/chat/completions", &body).await;
    }
    assert_eq!(metric(&gpu, "vllm:prefix_cache_hits_total").await, 0.0);
    let text = reqwest::get(format!("{}/metrics", gpu.base_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("enable_prefix_caching=\"False\""));
    shutdown.cancel();
}
