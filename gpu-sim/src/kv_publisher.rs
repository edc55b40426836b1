//! The prefix cache's KV events on the wire exactly as vLLM publishes them with
//! `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`
//! (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`), so a consumer written for vLLM
//! reads the simulator unchanged.
//!
//! - A ZMQ PUB socket sends one multipart message per engine step that changed the cache:
//!   `[topic, sequence (8 bytes, big-endian, from 0), payload]`.
//! - The payload is msgspec's MessagePack encoding of a `KVEventBatch` in its array layout
//!   (`array_like=True`, the layout of vLLM's releases before it moved to tagged maps):
//!   `[ts, events, data_parallel_rank]`, each event an array led by its tag, every field in
//!   declaration order: `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx]`,
//!   `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`. Hashes
//!   are unsigned 64-bit integers (vLLM's integer form of its block hashes); `medium` is
//!   `"GPU"`, the others nil. msgspec writes every field of an array-like struct (its
//!   `omit_defaults` does not shorten arrays) and ignores extra trailing elements when
//!   decoding, so consumers built for releases with fewer fields read these too. The bytes
//!   were checked against msgspec 0.23 encoding vLLM's struct definitions.
//! - With a replay endpoint, a ROUTER socket answers `[identity, "", start_seq (8 bytes)]`
//!   with every buffered batch from `start_seq` on, `[identity, "", seq, payload]` each,
//!   then `[identity, "", -1 (8 bytes), ""]`. The last 10,000 batches are kept (vLLM's
//!   `buffer_steps` default).
//!
//! The hashes are Metronome's chain ([`metronome_protocol::prefix`]), not vLLM's SHA-256:
//! a consumer keys blocks by the token ids the events carry, or by these hashes when it
//! knows the simulator.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::block_pool::KvEvent;

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BUFFER_BATCHES: usize = 10_000;

/// vLLM's medium of blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";

/// The sequence number that ends a replay (`-1` as 8 big-endian bytes).
pub const END_OF_REPLAY: [u8; 8] = (-1i64).to_be_bytes();

/// The address to bind for a vLLM-style endpoint: `tcp://*:P` binds every interface, as
/// in vLLM; anything but `tcp://host:port` is refused (the simulator speaks TCP only).
pub fn bind_address(endpoint: &str) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?} is not a tcp://host:port address"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint:?} has no port (tcp://host:port)"))?;
    port.parse::<u16>()
        .map_err(|_| format!("{endpoint:?} has no valid port"))?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    if host.is_empty() {
        return Err(format!("{endpoint:?} has no host (tcp://host:port)"));
    }
    Ok(format!("tcp://{host}:{port}"))
}

fn hash_value(h: u64) -> Value {
    Value::from(h)
}

fn event_value(event: &KvEvent) -> Value {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(block_hashes.iter().copied().map(hash_value).collect()),
            parent_block_hash.map_or(Value::Nil, hash_value),
            Value::Array(token_ids.iter().copied().map(Value::from).collect()),
            Value::from(*block_size),
            Value::Nil, // lora_id
            Value::from(MEDIUM_GPU),
            Value::Nil, // lora_name
            Value::Nil, // extra_keys
            Value::Nil, // group_idx
        ]),
        KvEvent::BlockRemoved { block_hashes } => Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(block_hashes.iter().copied().map(hash_value).collect()),
            Value::from(MEDIUM_GPU),
            Value::Nil, // group_idx
        ]),
        KvEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
    }
}

/// MessagePack of one `KVEventBatch` (array layout) at Unix time `ts` (seconds).
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(event_value).collect()),
        // One engine per GPU: data-parallel rank 0, which vLLM's publisher always fills in.
        Value::from(0),
    ]);
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Where a publisher listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventEndpoints {
    /// The PUB socket's bound address (`tcp://127.0.0.1:PORT`, the port resolved).
    pub publish: String,
    /// The replay ROUTER socket's bound address, when configured.
    pub replay: Option<String>,
}

/// Sends the engine's events to the publisher task (one call per engine step).
#[derive(Clone, Debug)]
pub struct KvEventSender {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
}

impl KvEventSender {
    /// Queue one step's events as one batch; empty steps publish nothing.
    pub fn send(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // The task ends only at shutdown; events after it are of no use to anyone.
            let _ = self.tx.send(events);
        }
    }
}

/// Bind the PUB (and replay) sockets and start the task that publishes each batch sent
/// through the returned sender, until `shutdown`.
pub async fn start(
    endpoint: &str,
    replay_endpoint: Option<&str>,
    topic: &str,
    shutdown: CancellationToken,
) -> Result<(KvEventSender, KvEventEndpoints), String> {
    let mut publisher = zeromq::PubSocket::new();
    let bound = publisher
        .bind(&bind_address(endpoint)?)
        .await
        .map_err(|e| format!("cannot bind the KV event publisher on {endpoint}: {e}"))?;
    let mut replay = None;
    let mut replay_bound = None;
    if let Some(r) = replay_endpoint {
        let mut router = zeromq::RouterSocket::new();
        let at = router
            .bind(&bind_address(r)?)
            .await
            .map_err(|e| format!("cannot bind the KV event replay socket on {r}: {e}"))?;
        replay_bound = Some(at.to_string());
        replay = Some(router);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let task = PublisherTask {
        publisher,
        replay,
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        next_seq: 0,
        buffer: VecDeque::new(),
    };
    tokio::spawn(task.run(rx, shutdown));
    Ok((
        KvEventSender { tx },
        KvEventEndpoints {
            publish: bound.to_string(),
            replay: replay_bound,
        },
    ))
}

struct PublisherTask {
    publisher: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    topic: Bytes,
    next_seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
}

impl PublisherTask {
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some(events) => self.publish(&events).await,
                    None => break,
                },
                request = recv_replay(&mut self.replay) => match request {
                    Ok(message) => self.serve_replay(message).await,
                    Err(e) => tracing::debug!(error = %e, "KV event replay socket receive failed"),
                },
                _ = shutdown.cancelled() => break,
            }
        }
    }

    async fn publish(&mut self, events: &[KvEvent]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_batch(unix_seconds(), events));
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        if let Err(e) = self.publisher.send(message).await {
            tracing::warn!(error = %e, seq, "publishing a KV event batch failed");
        }
        if self.buffer.len() == REPLAY_BUFFER_BATCHES {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    async fn serve_replay(&mut self, message: ZmqMessage) {
        let frames = message.into_vec();
        // [identity, empty delimiter, start sequence]
        let [identity, _, start] = frames.as_slice() else {
            tracing::warn!(frames = frames.len(), "invalid KV event replay request");
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!("KV event replay request without an 8-byte sequence");
            return;
        };
        let start = u64::from_be_bytes(start);
        let Some(router) = self.replay.as_mut() else {
            return;
        };
        let replies = self
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .map(|(seq, payload)| (Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()))
            .chain(std::iter::once((
                Bytes::copy_from_slice(&END_OF_REPLAY),
                Bytes::new(),
            )));
        for (seq, payload) in replies {
            let reply = vec![identity.clone(), Bytes::new(), seq, payload];
            let reply = ZmqMessage::try_from(reply).expect("four frames");
            if let Err(e) = router.send(reply).await {
                tracing::debug!(error = %e, "KV event replay reply failed (subscriber gone)");
                return;
            }
        }
    }
}

async fn recv_replay(replay: &mut Option<zeromq::RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_vllm_conventions() {
        assert_eq!(bind_address("tcp://*:5557").unwrap(), "tcp://0.0.0.0:5557");
        assert_eq!(
            bind_address("tcp://127.0.0.1:0").unwrap(),
            "tcp://127.0.0.1:0"
        );
        assert!(bind_address("ipc:///tmp/x").is_err());
        assert!(bind_address("tcp://host").is_err());
        assert!(bind_address("tcp://:5557").is_err());
    }

    #[test]
    fn a_batch_is_byte_for_byte_what_msgspec_writes() {
        let bytes = encode_batch(
            1.5,
            &[
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX, 2],
                    parent_block_hash: Some(5),
                    token_ids: vec![1, 300, 7, 8],
                    block_size: 2,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![7],
                },
                KvEvent::AllBlocksCleared,
            ],
        );
        // msgspec 0.23's `msgpack.encode` of the same KVEventBatch built from vLLM's
        // array-like struct definitions (data_parallel_rank 0).
        let expected = "93cb3ff8000000000000939aab426c6f636b53746f72656492cfffffffffffffffff02\
                        059401cd012c070802c0a3475055c0c0c094ac426c6f636b52656d6f7665649107a3\
                        475055c091b0416c6c426c6f636b73436c656172656400";
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);
    }
}
