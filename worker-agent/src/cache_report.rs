//! The model server's prefix cache, told to the leader: the agent subscribes to its
//! server's KV cache events ([`crate::kv_events`]), keeps the block index current, and
//! publishes what changed ([`CacheUpdate`] deltas on `kvcache.<worker_id>.delta`, every
//! `cache_delta_interval_ms` when something changed) and the whole index (a snapshot on
//! `kvcache.<worker_id>.snapshot`, at start and every `cache_snapshot_interval_ms`).
//!
//! Two tasks: a reader that receives the server's batches (asking the replay socket, when
//! there is one, for what it missed: everything buffered at start, any gap later) and hands
//! them over a channel, and the reporter that owns the index and publishes. A live batch
//! whose sequence number is below the last one means the server started again (vLLM's
//! events carry no epoch): the index is cleared and rebuilt from what follows. A server that
//! cannot be reached is retried; a failed publish loses that delta (the leader sees the gap
//! in `seq`, and the next snapshot closes it).

use std::time::Duration;

use async_nats::jetstream;
use metronome_protocol::cache_state::{
    CacheUpdate, CacheUpdateKind, CACHE_UPDATE_VERSION, MAX_DELTA_BLOCKS, MAX_SNAPSHOT_BLOCKS,
};
use metronome_protocol::names::{cache_delta_subject, cache_snapshot_subject};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::kv_events::{BlockIndex, EventBatch, KvEventSubscriber};

/// Where the events come from and how often the leader is told.
#[derive(Debug, Clone)]
pub struct ReportSettings {
    pub worker_id: String,
    /// The server's publisher (`tcp://host:port`).
    pub endpoint: String,
    /// Its replay socket, if any.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Tokens per KV block of the server.
    pub block_size: u32,
    pub delta_interval: Duration,
    pub snapshot_interval: Duration,
}

/// How long to wait before connecting again to a server that could not be reached.
const RECONNECT_AFTER: Duration = Duration::from_secs(2);
/// How long a publish may wait for the stream's acknowledgement.
const PUBLISH_WITHIN: Duration = Duration::from_secs(5);

/// What the reader hands the reporter.
enum Received {
    Batch(u64, EventBatch),
    /// The server's sequence starts again: at each (re)subscription, and when a live batch
    /// comes with a lower sequence number than the last one (the server restarted, and
    /// its cache with it).
    Restarted,
}

/// Receive the server's batches into `tx` until `stop`: the buffered history first (replay
/// from 0, where the server has a replay socket), then live, filling gaps from the replay.
async fn read_events(s: ReportSettings, tx: mpsc::Sender<Received>, stop: CancellationToken) {
    loop {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = KvEventSubscriber::connect(&s.endpoint, s.replay_endpoint.as_deref(), &s.topic) => c,
        };
        let mut sub = match connected {
            Ok(sub) => sub,
            Err(e) => {
                tracing::warn!(endpoint = %s.endpoint, error = %e, "KV events: cannot subscribe, retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(RECONNECT_AFTER) => continue,
                }
            }
        };
        tracing::info!(endpoint = %s.endpoint, "KV events: subscribed to the model server's cache events");
        if tx.send(Received::Restarted).await.is_err() {
            return;
        }
        let mut last: Option<u64> = None;
        if s.replay_endpoint.is_some() {
            match sub.replay_from(0).await {
                Ok(batches) => {
                    for (seq, batch) in batches {
                        last = Some(seq);
                        if tx.send(Received::Batch(seq, batch)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV events: the replay of the buffered history failed")
                }
            }
        }
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                n = sub.next() => n,
            };
            let (seq, batch) = match next {
                Ok(b) => b,
                Err(crate::kv_events::KvEventError::Zmq(e)) => {
                    tracing::warn!(error = %e, "KV events: the subscription failed, subscribing again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV events: a malformed batch was skipped");
                    continue;
                }
            };
            if last.is_some_and(|l| seq < l) {
                tracing::warn!(seq, last = ?last, "KV events: the model server's sequence started again (restarted?): its cache is rebuilt from its events");
                last = None;
                if tx.send(Received::Restarted).await.is_err() {
                    return;
                }
            }
            if let Some(l) = last.filter(|l| seq > l + 1) {
                match sub.replay_from(l + 1).await {
                    Ok(missed) => {
                        for (s, b) in missed.into_iter().filter(|(s, _)| *s < seq) {
                            if tx.send(Received::Batch(s, b)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "KV events: replaying a gap failed"),
                }
            }
            last = Some(last.map_or(seq, |l| l.max(seq)));
            if tx.send(Received::Batch(seq, batch)).await.is_err() {
                return;
            }
        }
    }
}

/// The publishing side: the index, the run and the sequence of its deltas.
struct Reporter {
    js: jetstream::Context,
    s: ReportSettings,
    index: BlockIndex,
    run: u64,
    seq: u64,
    /// When a failed publish was last logged (at most once a minute: a missing stream or
    /// permission fails every one).
    warned: Option<tokio::time::Instant>,
}

/// How often a failing publish is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);

impl Reporter {
    fn message(&self, kind: CacheUpdateKind) -> CacheUpdate {
        CacheUpdate {
            v: CACHE_UPDATE_VERSION,
            worker_id: self.s.worker_id.clone(),
            run: self.run,
            seq: self.seq,
            kind,
            block_size: self.s.block_size,
            cleared: false,
            stored: Vec::new(),
            removed: Vec::new(),
            truncated: false,
            sent_ms: metronome_protocol::time::unix_ms(),
        }
    }

    async fn publish(&mut self, subject: String, update: &CacheUpdate) {
        let body = serde_json::to_vec(update).expect("a cache update serialises");
        let stored = async {
            self.js
                .publish(subject.clone(), body.into())
                .await
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())
        };
        let error = match tokio::time::timeout(PUBLISH_WITHIN, stored).await {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e,
            Err(_) => "not acknowledged in time".to_string(),
        };
        let now = tokio::time::Instant::now();
        if self
            .warned
            .is_none_or(|at| now.duration_since(at) >= WARN_EVERY)
        {
            self.warned = Some(now);
            tracing::warn!(%subject, %error, "cache report not stored (the leader falls back to its placement estimate; logged once a minute)");
        }
    }

    /// Publish what changed, split into deltas of at most [`MAX_DELTA_BLOCKS`] blocks.
    async fn publish_changes(&mut self) {
        let changes = self.index.take_changes();
        if changes.is_empty() {
            return;
        }
        let mut cleared = changes.cleared;
        let mut removed = changes.removed.as_slice();
        let mut stored = changes.stored.as_slice();
        while cleared || !removed.is_empty() || !stored.is_empty() {
            let r = removed.len().min(MAX_DELTA_BLOCKS);
            let st = stored.len().min(MAX_DELTA_BLOCKS - r);
            self.seq += 1;
            let mut d = self.message(CacheUpdateKind::Delta);
            d.cleared = cleared;
            d.removed = removed[..r].to_vec();
            d.stored = stored[..st].to_vec();
            (removed, stored, cleared) = (&removed[r..], &stored[st..], false);
            self.publish(cache_delta_subject(&self.s.worker_id), &d)
                .await;
        }
    }

    async fn publish_snapshot(&mut self) {
        // Pending changes first: the snapshot then covers every delta up to its `seq`.
        self.publish_changes().await;
        let (blocks, truncated) = self.index.newest(MAX_SNAPSHOT_BLOCKS);
        let mut snap = self.message(CacheUpdateKind::Snapshot);
        snap.stored = blocks;
        snap.truncated = truncated;
        self.publish(cache_snapshot_subject(&self.s.worker_id), &snap)
            .await;
    }
}

/// Follow the model server's KV events and report them until `stop`.
pub fn spawn(
    js: jetstream::Context,
    s: ReportSettings,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let (tx, mut rx) = mpsc::channel(1_024);
    let reader = tokio::spawn(read_events(s.clone(), tx, stop.clone()));
    tokio::spawn(async move {
        let mut r = Reporter {
            js,
            index: BlockIndex::new(s.block_size, MAX_SNAPSHOT_BLOCKS).recording(),
            run: metronome_protocol::time::unix_ms(),
            seq: 0,
            warned: None,
            s,
        };
        let mut deltas = tokio::time::interval(r.s.delta_interval);
        let mut snapshots = tokio::time::interval(r.s.snapshot_interval);
        deltas.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        snapshots.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                received = rx.recv() => match received {
                    Some(Received::Batch(seq, batch)) => {
                        r.index.apply(seq, &batch);
                    }
                    Some(Received::Restarted) => r.index.restart(),
                    None => break,
                },
                _ = deltas.tick() => r.publish_changes().await,
                // The first tick is at once: a new run starts with a snapshot.
                _ = snapshots.tick() => r.publish_snapshot().await,
            }
        }
        reader.abort();
    })
}
