//! What the model server's prefix cache holds, from its KV cache events: a decoder of
//! vLLM's event wire format, a bounded index of the worker's cached blocks, and a ZMQ
//! subscriber that keeps the index current.
//!
//! The wire format is vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`), enabled
//! with `--kv-events-config`: multipart `[topic, sequence (8 bytes, big-endian), payload]`,
//! the payload a msgspec MessagePack `KVEventBatch`. The decoder accepts both layouts vLLM
//! has shipped: the array layout (`[ts, events, data_parallel_rank]`, each event
//! `[tag, fields in declaration order...]`, vLLM 0.9 to 0.11) and the map layout of later
//! releases (`{"ts", "events", ...}`, each event a map tagged by `"type"`). Trailing
//! fields may be missing (older releases have fewer), unknown event tags are skipped.
//! Block hashes are integers (vLLM's integer form) or raw digests (bytes: the last 8 bytes,
//! big-endian, which is how vLLM turns a digest into its integer form).
//!
//! # The index
//!
//! A server's own hashes cannot be predicted outside it (vLLM seeds SHA-256 per process),
//! so the index names blocks by Metronome's chain ([`metronome_protocol::prefix`]),
//! recomputed from the token ids each `BlockStored` carries and its parent's chain hash.
//! A job's [`PrefixFingerprint`] then matches it directly. The server's hashes are kept
//! only to translate later `BlockRemoved` events and parents. Blocks whose parent is
//! unknown (stored before the subscription, or already dropped) cannot be chained and are
//! counted, not indexed; so are blocks of another block size or of a medium other than
//! the GPU (CPU offload tiers).
//!
//! Bounded: at most `capacity` blocks. When full, the block stored longest ago is dropped
//! first: the server evicts least recently used blocks, and the oldest stored are the
//! likeliest to be gone (the server's own `BlockRemoved` corrects the rest).
//!
//! Sequence numbers are checked: a batch already applied (seen again after a replay) is
//! ignored; a gap is reported, so the subscriber can ask the server's replay socket for
//! what it missed.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use metronome_protocol::prefix::{hash_block, BlockHash, PrefixFingerprint};
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's medium of blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV cache event, as vLLM defines it (the fields the index uses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvCacheEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        /// `None` in releases before tiers existed: the GPU.
        medium: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
    /// A tag this decoder does not know (a newer release's event).
    Unknown(String),
}

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// Unix time of the batch, in seconds.
    pub ts: f64,
    pub events: Vec<KvCacheEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload is not a KV event batch.
#[derive(Debug, thiserror::Error)]
pub enum KvEventError {
    #[error("payload is not MessagePack: {0}")]
    MessagePack(String),
    #[error("malformed KV event batch: {0}")]
    Malformed(String),
    #[error("message has {0} frames, a KV event message has 3 (topic, sequence, payload)")]
    Frames(usize),
    #[error("sequence frame is {0} bytes, not 8")]
    Sequence(usize),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("no reply from the replay socket within {0:?}")]
    ReplayTimeout(Duration),
}

fn malformed(what: impl Into<String>) -> KvEventError {
    KvEventError::Malformed(what.into())
}

/// A block hash: an integer (vLLM's integer form; a negative one is read as its 64-bit
/// two's complement) or a digest (its last 8 bytes, big-endian).
fn hash_of(v: &Value) -> Result<u64, KvEventError> {
    if let Some(u) = v.as_u64() {
        return Ok(u);
    }
    if let Some(i) = v.as_i64() {
        return Ok(i as u64);
    }
    if let Some(bytes) = v.as_slice() {
        if bytes.len() >= 8 {
            let tail: [u8; 8] = bytes[bytes.len() - 8..].try_into().expect("8 bytes");
            return Ok(u64::from_be_bytes(tail));
        }
    }
    Err(malformed(format!(
        "a block hash must be an integer or a digest, got {v}"
    )))
}

fn hashes_of(v: Option<&Value>) -> Result<Vec<u64>, KvEventError> {
    v.and_then(Value::as_array)
        .ok_or_else(|| malformed("block_hashes must be an array"))?
        .iter()
        .map(hash_of)
        .collect()
}

fn optional_text(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

/// The fields of an event by name, from either layout.
struct Fields<'a> {
    named: Vec<(&'a str, &'a Value)>,
}

impl<'a> Fields<'a> {
    /// `names`: the declaration order of the event's fields (array layout).
    fn of(event: &'a Value, names: &[&'a str]) -> Fields<'a> {
        let named = match event {
            Value::Array(items) => names.iter().copied().zip(items.iter().skip(1)).collect(),
            Value::Map(entries) => entries
                .iter()
                .filter_map(|(k, v)| k.as_str().map(|k| (k, v)))
                .collect(),
            _ => Vec::new(),
        };
        Fields { named }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.named
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .filter(|v| !v.is_nil())
    }
}

const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn decode_event(event: &Value) -> Result<KvCacheEvent, KvEventError> {
    let tag = match event {
        Value::Array(items) => items.first().and_then(Value::as_str),
        Value::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some("type"))
            .and_then(|(_, v)| v.as_str()),
        _ => None,
    }
    .ok_or_else(|| malformed("an event must be an array or a map led by its tag"))?;
    match tag {
        "BlockStored" => {
            let f = Fields::of(event, &STORED_FIELDS);
            let token_ids = f
                .get("token_ids")
                .and_then(Value::as_array)
                .ok_or_else(|| malformed("BlockStored.token_ids must be an array"))?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| malformed(format!("token id {t} is not a u32")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let block_size = f
                .get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| malformed("BlockStored.block_size must be an integer"))?;
            Ok(KvCacheEvent::BlockStored {
                block_hashes: hashes_of(f.get("block_hashes"))?,
                parent_block_hash: f.get("parent_block_hash").map(hash_of).transpose()?,
                token_ids,
                block_size,
                medium: optional_text(f.get("medium")),
            })
        }
        "BlockRemoved" => {
            let f = Fields::of(event, &REMOVED_FIELDS);
            Ok(KvCacheEvent::BlockRemoved {
                block_hashes: hashes_of(f.get("block_hashes"))?,
                medium: optional_text(f.get("medium")),
            })
        }
        "AllBlocksCleared" => Ok(KvCacheEvent::AllBlocksCleared),
        other => Ok(KvCacheEvent::Unknown(other.to_string())),
    }
}

/// Decode one payload (either of vLLM's layouts).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, KvEventError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader)
        .map_err(|e| KvEventError::MessagePack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(entries) => {
            let get = |name: &str| {
                entries
                    .iter()
                    .find(|(k, _)| k.as_str() == Some(name))
                    .map(|(_, v)| v)
            };
            (get("ts"), get("events"), get("data_parallel_rank"))
        }
        _ => return Err(malformed("a batch must be an array or a map")),
    };
    let ts = ts
        .and_then(Value::as_f64)
        .ok_or_else(|| malformed("the batch has no timestamp"))?;
    let events = events
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("the batch has no event list"))?
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank: rank.and_then(Value::as_i64),
    })
}

/// Split a ZMQ message into its sequence number and payload.
pub fn split_message(message: &ZmqMessage) -> Result<(u64, &Bytes), KvEventError> {
    if message.len() != 3 {
        return Err(KvEventError::Frames(message.len()));
    }
    let seq = message.get(1).expect("3 frames");
    let seq: [u8; 8] = seq
        .as_ref()
        .try_into()
        .map_err(|_| KvEventError::Sequence(seq.len()))?;
    Ok((u64::from_be_bytes(seq), message.get(2).expect("3 frames")))
}

/// What applying a batch found out about the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The next batch in sequence (or the first one seen).
    InOrder,
    /// Already applied (a replay overlapping what was received live): ignored.
    Duplicate,
    /// Applied, but batches `from..to` were missed: ask the replay socket for them.
    AfterGap { from: u64, to: u64 },
}

/// Counts of what the index applied and skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    /// Stored blocks whose parent is unknown: not chained, not indexed.
    pub orphaned: u64,
    /// Blocks of another block size or medium, and unknown events.
    pub skipped: u64,
    /// Blocks dropped to stay within the capacity.
    pub dropped_for_capacity: u64,
    /// Batches missed (sequence gaps).
    pub missed_batches: u64,
}

/// What changed in a [`BlockIndex`] since the changes were last taken, by chain hash:
/// apply `cleared`, then `removed`, then `stored` (the two lists never share a hash: the
/// latest change of a block wins).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub cleared: bool,
    pub stored: Vec<BlockHash>,
    pub removed: Vec<BlockHash>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        !self.cleared && self.stored.is_empty() && self.removed.is_empty()
    }
}

/// The changes of an index being recorded: each block's latest change (true: stored).
#[derive(Debug, Default)]
struct Recorder {
    cleared: bool,
    latest: HashMap<BlockHash, bool>,
    /// Blocks in the order of their latest change.
    order: Vec<BlockHash>,
}

impl Recorder {
    fn note(&mut self, hash: BlockHash, stored: bool) {
        if self.latest.insert(hash, stored).is_none() {
            self.order.push(hash);
        }
    }

    fn clear(&mut self) {
        *self = Recorder {
            cleared: true,
            ..Recorder::default()
        };
    }

    fn take(&mut self) -> Changes {
        let r = std::mem::take(self);
        let mut changes = Changes {
            cleared: r.cleared,
            ..Changes::default()
        };
        for hash in r.order {
            if r.latest[&hash] {
                changes.stored.push(hash);
            } else {
                changes.removed.push(hash);
            }
        }
        changes
    }
}

/// The blocks one worker's model server holds in its GPU prefix cache, by Metronome's
/// chain hash.
#[derive(Debug)]
pub struct BlockIndex {
    block_size: u32,
    capacity: usize,
    /// Server hash -> chain hash, for every indexed block.
    by_server_hash: HashMap<u64, BlockHash>,
    /// Chain hash -> server hash.
    blocks: HashMap<BlockHash, u64>,
    /// Server hashes in the order stored (may hold hashes already removed).
    stored_order: VecDeque<u64>,
    last_seq: Option<u64>,
    stats: IndexStats,
    /// Changes since they were last taken, when recorded ([`BlockIndex::recording`]).
    recorder: Option<Recorder>,
}

impl BlockIndex {
    /// An empty index for blocks of `block_size` tokens, holding at most `capacity`
    /// blocks (at least 1; the worker's KV capacity in blocks is the natural bound).
    pub fn new(block_size: u32, capacity: usize) -> Self {
        BlockIndex {
            block_size,
            capacity: capacity.max(1),
            by_server_hash: HashMap::new(),
            blocks: HashMap::new(),
            stored_order: VecDeque::new(),
            last_seq: None,
            stats: IndexStats::default(),
            recorder: None,
        }
    }

    /// The same index, recording its changes for [`BlockIndex::take_changes`] (what the
    /// agent forwards to the leader).
    pub fn recording(mut self) -> Self {
        self.recorder = Some(Recorder::default());
        self
    }

    /// The changes since the last call (empty when not recording).
    pub fn take_changes(&mut self) -> Changes {
        self.recorder
            .as_mut()
            .map_or_else(Changes::default, Recorder::take)
    }

    /// Up to `max` cached blocks, the most recently stored first, and whether some were
    /// left out.
    pub fn newest(&self, max: usize) -> (Vec<BlockHash>, bool) {
        let mut out = Vec::with_capacity(self.blocks.len().min(max));
        let mut seen = std::collections::HashSet::new();
        for server_hash in self.stored_order.iter().rev() {
            let Some(chain) = self.by_server_hash.get(server_hash) else {
                continue;
            };
            if self.blocks.get(chain) != Some(server_hash) || !seen.insert(*chain) {
                continue;
            }
            if out.len() == max {
                return (out, true);
            }
            out.push(*chain);
        }
        (out, false)
    }

    fn note(&mut self, chain: BlockHash, stored: bool) {
        if let Some(r) = self.recorder.as_mut() {
            r.note(chain, stored);
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Whether the block named by this chain hash is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Tokens of the job's prefix the server holds: leading blocks of the fingerprint
    /// found in the index, times the block size (0 for a fingerprint of another size).
    pub fn cached_tokens(&self, fingerprint: &PrefixFingerprint) -> u32 {
        if fingerprint.block_size != self.block_size {
            return 0;
        }
        fingerprint.matched_blocks(|h| self.contains(h)) as u32 * self.block_size
    }

    /// The server's stream starts again (its process restarted, or the subscription was
    /// made again): everything indexed is dropped, as a clear, and any sequence number is
    /// accepted next.
    pub fn restart(&mut self) {
        self.last_seq = None;
        self.apply_event(&KvCacheEvent::AllBlocksCleared);
    }

    /// Apply batch `seq` (its sequence number from the message).
    pub fn apply(&mut self, seq: u64, batch: &EventBatch) -> Applied {
        let applied = match self.last_seq {
            Some(last) if seq <= last => return Applied::Duplicate,
            Some(last) if seq > last + 1 => {
                self.stats.missed_batches += seq - last - 1;
                Applied::AfterGap {
                    from: last + 1,
                    to: seq,
                }
            }
            _ => Applied::InOrder,
        };
        self.last_seq = Some(seq);
        for event in &batch.events {
            self.apply_event(event);
        }
        applied
    }

    fn on_gpu(medium: &Option<String>) -> bool {
        medium.as_deref().is_none_or(|m| m == MEDIUM_GPU)
    }

    fn apply_event(&mut self, event: &KvCacheEvent) {
        match event {
            KvCacheEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => {
                let n = block_hashes.len() as u64;
                let bs = *block_size as usize;
                if *block_size != self.block_size
                    || !Self::on_gpu(medium)
                    || token_ids.len() != block_hashes.len() * bs
                {
                    self.stats.skipped += n;
                    return;
                }
                let mut parent = match parent_block_hash {
                    None => None,
                    Some(p) => match self.by_server_hash.get(p) {
                        Some(chain) => Some(*chain),
                        None => {
                            self.stats.orphaned += n;
                            return;
                        }
                    },
                };
                for (server_hash, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(bs)) {
                    let chain = hash_block(parent, tokens);
                    parent = Some(chain);
                    if self.by_server_hash.insert(*server_hash, chain).is_none() {
                        self.stored_order.push_back(*server_hash);
                    }
                    self.blocks.insert(chain, *server_hash);
                    self.note(chain, true);
                    self.stats.stored += 1;
                }
                self.enforce_capacity();
            }
            KvCacheEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                if !Self::on_gpu(medium) {
                    self.stats.skipped += block_hashes.len() as u64;
                    return;
                }
                for h in block_hashes {
                    if let Some(chain) = self.by_server_hash.remove(h) {
                        if self.blocks.get(&chain) == Some(h) {
                            self.blocks.remove(&chain);
                            self.note(chain, false);
                        }
                        self.stats.removed += 1;
                    }
                }
                self.compact_order();
            }
            KvCacheEvent::AllBlocksCleared => {
                self.by_server_hash.clear();
                self.blocks.clear();
                self.stored_order.clear();
                if let Some(r) = self.recorder.as_mut() {
                    r.clear();
                }
                self.stats.cleared += 1;
            }
            KvCacheEvent::Unknown(_) => self.stats.skipped += 1,
        }
    }

    fn enforce_capacity(&mut self) {
        while self.by_server_hash.len() > self.capacity {
            let Some(oldest) = self.stored_order.pop_front() else {
                break;
            };
            if let Some(chain) = self.by_server_hash.remove(&oldest) {
                if self.blocks.get(&chain) == Some(&oldest) {
                    self.blocks.remove(&chain);
                    self.note(chain, false);
                }
                self.stats.dropped_for_capacity += 1;
            }
        }
    }

    /// Keep the order queue from growing past twice the live entries with removed hashes.
    fn compact_order(&mut self) {
        if self.stored_order.len() > 2 * self.by_server_hash.len() + 64 {
            let live = &self.by_server_hash;
            self.stored_order.retain(|h| live.contains_key(h));
        }
    }
}

/// A SUB socket on a model server's KV event publisher, and optionally a DEALER on its
/// replay socket.
pub struct KvEventSubscriber {
    sub: zeromq::SubSocket,
    replay: Option<zeromq::DealerSocket>,
}

/// How long a replay request may take before it is given up.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

impl KvEventSubscriber {
    /// Connect to `endpoint` (`tcp://host:port`), subscribing to `topic` (vLLM's default
    /// is the empty topic: everything), and to `replay_endpoint` when given.
    pub async fn connect(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
    ) -> Result<Self, KvEventError> {
        let mut sub = zeromq::SubSocket::new();
        sub.connect(endpoint).await?;
        sub.subscribe(topic).await?;
        let replay = match replay_endpoint {
            Some(r) => {
                let mut dealer = zeromq::DealerSocket::new();
                dealer.connect(r).await?;
                Some(dealer)
            }
            None => None,
        };
        Ok(KvEventSubscriber { sub, replay })
    }

    /// The next published batch and its sequence number. A malformed message is an
    /// error for this message only; the subscription goes on.
    pub async fn next(&mut self) -> Result<(u64, EventBatch), KvEventError> {
        let message = self.sub.recv().await?;
        let (seq, payload) = split_message(&message)?;
        Ok((seq, decode_batch(payload)?))
    }

    /// Every batch the server still buffers from `start_seq` on (vLLM's replay: send
    /// `["", start_seq]`, read `["", seq, payload]` until the sequence `-1`).
    pub async fn replay_from(
        &mut self,
        start_seq: u64,
    ) -> Result<Vec<(u64, EventBatch)>, KvEventError> {
        let Some(dealer) = self.replay.as_mut() else {
            return Ok(Vec::new());
        };
        let request = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ];
        dealer
            .send(ZmqMessage::try_from(request).expect("two frames"))
            .await?;
        let mut batches = Vec::new();
        loop {
            let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| KvEventError::ReplayTimeout(REPLAY_TIMEOUT))??;
            // [empty delimiter, seq, payload]
            let frames = reply.into_vec();
            let [_, seq, payload] = frames.as_slice() else {
                return Err(KvEventError::Frames(frames.len()));
            };
            let seq: [u8; 8] = seq
                .as_ref()
                .try_into()
                .map_err(|_| KvEventError::Sequence(seq.len()))?;
            let seq = i64::from_be_bytes(seq);
            if seq < 0 {
                return Ok(batches);
            }
            batches.push((seq as u64, decode_batch(payload)?));
        }
    }

    /// Receive the next batch into `index`, filling a gap from the replay socket first
    /// when one shows (and the server has one). Returns what the batch was.
    pub async fn apply_next(&mut self, index: &mut BlockIndex) -> Result<Applied, KvEventError> {
        let (seq, batch) = self.next().await?;
        if let (Some(last), true) = (index.last_seq(), self.replay.is_some()) {
            if seq > last + 1 {
                for (s, b) in self.replay_from(last + 1).await? {
                    if s < seq {
                        index.apply(s, &b);
                    }
                }
            }
        }
        Ok(index.apply(seq, &batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::prefix::chain_hashes;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn stored_array(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> Value {
        Value::Array(vec![
            "BlockStored".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
            Value::from(bs),
            Value::Nil,
            "GPU".into(),
            Value::Nil,
        ])
    }

    #[test]
    fn decodes_the_array_layout_and_indexes_by_the_chain() {
        let tokens: Vec<u32> = (0..8).collect();
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![stored_array(&[900, 901], None, &tokens, 4)]),
            Value::from(0),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(decoded.data_parallel_rank, Some(0));
        let mut index = BlockIndex::new(4, 100);
        assert_eq!(index.apply(0, &decoded), Applied::InOrder);
        let chain = chain_hashes(&tokens, 4, 10);
        assert!(chain.iter().all(|h| index.contains(*h)));
        let fp = PrefixFingerprint::of_tokens(&(0..12).collect::<Vec<_>>(), 4);
        assert_eq!(index.cached_tokens(&fp), 8);
        // A removal names the server's hash.
        let removed = Value::Array(vec![
            Value::F64(2.0),
            Value::Array(vec![Value::Array(vec![
                "BlockRemoved".into(),
                Value::Array(vec![Value::from(901u64)]),
                "GPU".into(),
            ])]),
        ]);
        index.apply(1, &decode_batch(&encode(&removed)).unwrap());
        assert_eq!(index.cached_tokens(&fp), 4);
        assert_eq!(index.stats().removed, 1);
    }

    #[test]
    fn decodes_the_map_layout_digests_and_unknown_events() {
        let digest: Vec<u8> = (0..32).collect();
        let map = |entries: Vec<(&str, Value)>| {
            Value::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
        };
        let batch = map(vec![
            ("ts", Value::F64(3.0)),
            (
                "events",
                Value::Array(vec![
                    map(vec![
                        ("type", "BlockStored".into()),
                        (
                            "block_hashes",
                            Value::Array(vec![Value::Binary(digest.clone())]),
                        ),
                        ("parent_block_hash", Value::Nil),
                        ("token_ids", Value::Array((0..4).map(Value::from).collect())),
                        ("block_size", Value::from(4)),
                        ("medium", "GPU".into()),
                    ]),
                    map(vec![("type", "BlockMigrated".into())]),
                    Value::Array(vec!["AllBlocksCleared".into()]),
                ]),
            ),
        ]);
        let decoded = decode_batch(&encode(&batch)).unwrap();
        let tail = u64::from_be_bytes(digest[24..].try_into().unwrap());
        assert_eq!(
            decoded.events[0],
            KvCacheEvent::BlockStored {
                block_hashes: vec![tail],
                parent_block_hash: None,
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                medium: Some("GPU".into()),
            }
        );
        assert_eq!(
            decoded.events[1],
            KvCacheEvent::Unknown("BlockMigrated".into())
        );
        let mut index = BlockIndex::new(4, 10);
        index.apply(0, &decoded);
        assert!(index.is_empty(), "cleared after the store");
        assert_eq!(index.stats().cleared, 1);
        assert_eq!(index.stats().skipped, 1);
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&encode(&Value::from(5))).is_err());
        let bad_hashes = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                "nope".into(),
                Value::Nil,
                Value::Array(vec![]),
                Value::from(4),
            ])]),
        ]);
        assert!(decode_batch(&encode(&bad_hashes)).is_err());
    }

    #[test]
    fn recorded_changes_keep_each_blocks_latest_and_a_clear_drops_the_rest() {
        let tokens: Vec<u32> = (0..12).collect();
        let chain = chain_hashes(&tokens, 4, 10);
        let stored = |hashes: Vec<u64>, parent: Option<u64>, tokens: &[u32]| EventBatch {
            ts: 0.0,
            events: vec![KvCacheEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size: 4,
                medium: None,
            }],
            data_parallel_rank: None,
        };
        let removed = |hashes: Vec<u64>| EventBatch {
            ts: 0.0,
            events: vec![KvCacheEvent::BlockRemoved {
                block_hashes: hashes,
                medium: None,
            }],
            data_parallel_rank: None,
        };
        let mut index = BlockIndex::new(4, 100).recording();
        index.apply(0, &stored(vec![10, 11, 12], None, &tokens));
        index.apply(1, &removed(vec![12]));
        let c = index.take_changes();
        assert_eq!((c.cleared, c.stored.clone()), (false, chain[..2].to_vec()));
        assert_eq!(c.removed, vec![chain[2]], "stored then removed: removed");
        assert!(index.take_changes().is_empty());
        assert_eq!(index.newest(10), (vec![chain[1], chain[0]], false));
        assert_eq!(index.newest(1), (vec![chain[1]], true));
        index.apply(
            2,
            &EventBatch {
                ts: 0.0,
                events: vec![KvCacheEvent::AllBlocksCleared],
                data_parallel_rank: None,
            },
        );
        index.apply(3, &stored(vec![20], None, &tokens[..4]));
        let c = index.take_changes();
        assert!(c.cleared);
        assert_eq!((c.stored, c.removed), (vec![chain[0]], vec![]));
    }

    #[test]
    fn sequence_gaps_duplicates_orphans_and_capacity() {
        let empty = EventBatch {
            ts: 0.0,
            events: vec![],
            data_parallel_rank: None,
        };
        let mut index = BlockIndex::new(2, 3);
        assert_eq!(index.apply(5, &empty), Applied::InOrder);
        assert_eq!(index.apply(5, &empty), Applied::Duplicate);
        assert_eq!(index.apply(8, &empty), Applied::AfterGap { from: 6, to: 8 });
        assert_eq!(index.stats().missed_batches, 2);
        let stored = |hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>| EventBatch {
            ts: 0.0,
            events: vec![KvCacheEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: 2,
                medium: None,
            }],
            data_parallel_rank: None,
        };
        index.apply(9, &stored(vec![1], Some(77), vec![1, 2]));
        assert_eq!(index.stats().orphaned, 1, "parent never seen");
        index.apply(10, &stored(vec![1, 2, 3, 4], None, (0..8).collect()));
        assert_eq!(index.len(), 3, "bounded");
        assert_eq!(index.stats().dropped_for_capacity, 1);
        let chain = chain_hashes(&(0..8).collect::<Vec<_>>(), 2, 10);
        assert!(!index.contains(chain[0]), "the oldest stored goes first");
        assert!(index.contains(chain[3]));
    }
}
