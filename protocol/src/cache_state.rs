//! What a worker's model server holds in its prefix cache, as its agent tells the leader:
//! [`CacheUpdate`] messages on `kvcache.<worker_id>.delta` and `kvcache.<worker_id>.snapshot`.
//!
//! The agent reads its model server's KV cache events (vLLM's `--kv-events-config`, the
//! simulator's publisher) into an index of the blocks the server holds, each named by
//! Metronome's chain hash ([`crate::prefix`]), the name a job's
//! [`crate::PrefixFingerprint`] uses. It forwards what changed as *deltas* (blocks stored,
//! blocks removed, everything cleared), a few times a second, and the whole index as a
//! *snapshot* every few seconds. Deltas go to stream `CACHE_DELTAS` (kept a short time),
//! snapshots to `CACHE_SNAPSHOTS` (one per worker: `max_msgs_per_subject = 1`), so a new
//! leader rebuilds every worker's cache from the latest snapshot plus the deltas after it
//! (`seq` orders them) instead of starting blind.
//!
//! A message names its agent's *run* (the agent's start, Unix ms): a newer run starts from
//! nothing, its first message a snapshot. Within a run `seq` counts deltas from 1; a
//! snapshot carries the `seq` of the last delta it includes.
//!
//! Bounded: a snapshot lists at most [`MAX_SNAPSHOT_BLOCKS`] blocks (the most recently
//! stored; `truncated` says some were left out), a delta at most [`MAX_DELTA_BLOCKS`]
//! stored plus removed (an agent splits larger changes), so a message stays under
//! nats-server's default 1 MiB payload.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::prefix::BlockHash;

/// Version of [`CacheUpdate`].
pub const CACHE_UPDATE_VERSION: u32 = 1;

/// Most blocks a snapshot lists: 32,768 blocks of 16 tokens, 524,288 tokens (the KV cache
/// of an 8B model on an 80 GB GPU), about 620 KB of JSON.
pub const MAX_SNAPSHOT_BLOCKS: usize = 32_768;

/// Most blocks (stored plus removed) one delta lists, about 80 KB of JSON.
pub const MAX_DELTA_BLOCKS: usize = 4_096;

/// Whether a message is a change or the whole state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheUpdateKind {
    /// What changed since the previous delta: apply `cleared`, then `removed`, then
    /// `stored`.
    Delta,
    /// Every block the agent's index holds (`stored`) after delta `seq`.
    Snapshot,
}

/// One message of a worker's cache state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheUpdate {
    pub v: u32,
    /// The worker, equal to the subject's token (readers drop a message that differs).
    pub worker_id: String,
    /// The agent's run (its start, Unix ms): a larger run replaces the worker's state.
    pub run: u64,
    /// Deltas of the run, from 1; a snapshot: the last delta it includes (0: none).
    pub seq: u64,
    pub kind: CacheUpdateKind,
    /// Tokens per block of the hashes.
    pub block_size: u32,
    /// Everything was dropped (the server cleared its cache) before `removed` and
    /// `stored` apply. Deltas only.
    #[serde(default)]
    pub cleared: bool,
    /// Blocks now cached (a snapshot: every block), chain hashes as 16 hex digits.
    #[serde(default, with = "hex_hashes")]
    pub stored: Vec<BlockHash>,
    /// Blocks no longer cached. Deltas only.
    #[serde(default, with = "hex_hashes")]
    pub removed: Vec<BlockHash>,
    /// A snapshot that left out blocks stored longest ago to stay within its bound.
    #[serde(default)]
    pub truncated: bool,
    /// When the agent sent it (its clock, Unix ms; informational).
    pub sent_ms: u64,
}

/// Why a [`CacheUpdate`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheUpdateError {
    #[error("unsupported cache update version {0}")]
    Version(u32),
    #[error("block_size must be positive")]
    BlockSize,
    #[error("a snapshot lists {0} blocks, at most {MAX_SNAPSHOT_BLOCKS}")]
    SnapshotTooLarge(usize),
    #[error("a delta lists {0} blocks, at most {MAX_DELTA_BLOCKS}")]
    DeltaTooLarge(usize),
    #[error("a snapshot carries no removals and no clear")]
    SnapshotWithChanges,
}

impl CacheUpdate {
    /// Check what serde cannot: the version, the bounds, a snapshot's shape.
    pub fn validate(&self) -> Result<(), CacheUpdateError> {
        if self.v != CACHE_UPDATE_VERSION {
            return Err(CacheUpdateError::Version(self.v));
        }
        if self.block_size == 0 {
            return Err(CacheUpdateError::BlockSize);
        }
        match self.kind {
            CacheUpdateKind::Snapshot => {
                if self.stored.len() > MAX_SNAPSHOT_BLOCKS {
                    return Err(CacheUpdateError::SnapshotTooLarge(self.stored.len()));
                }
                if self.cleared || !self.removed.is_empty() {
                    return Err(CacheUpdateError::SnapshotWithChanges);
                }
            }
            CacheUpdateKind::Delta => {
                let n = self.stored.len() + self.removed.len();
                if n > MAX_DELTA_BLOCKS {
                    return Err(CacheUpdateError::DeltaTooLarge(n));
                }
            }
        }
        Ok(())
    }
}

mod hex_hashes {
    use super::*;

    pub fn serialize<S: Serializer>(hashes: &[BlockHash], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(hashes.iter().map(|h| format!("{h:016x}")))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockHash>, D::Error> {
        let texts = Vec::<String>::deserialize(d)?;
        if texts.len() > MAX_SNAPSHOT_BLOCKS {
            return Err(serde::de::Error::custom(format!(
                "at most {MAX_SNAPSHOT_BLOCKS} block hashes, got {}",
                texts.len()
            )));
        }
        texts
            .iter()
            .map(|t| {
                (t.len() == 16)
                    .then(|| u64::from_str_radix(t, 16).ok())
                    .flatten()
                    .ok_or_else(|| {
                        serde::de::Error::custom(format!("block hash {t:?} is not 16 hex digits"))
                    })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(stored: Vec<u64>, removed: Vec<u64>) -> CacheUpdate {
        CacheUpdate {
            v: CACHE_UPDATE_VERSION,
            worker_id: "w1".into(),
            run: 1,
            seq: 3,
            kind: CacheUpdateKind::Delta,
            block_size: 16,
            cleared: false,
            stored,
            removed,
            truncated: false,
            sent_ms: 0,
        }
    }

    #[test]
    fn round_trips_with_hex_hashes() {
        let d = delta(vec![0xa853_1d8e_c4fb_f5ac, 1], vec![u64::MAX]);
        let text = serde_json::to_string(&d).unwrap();
        assert!(text.contains("\"a8531d8ec4fbf5ac\""), "{text}");
        assert!(text.contains("\"0000000000000001\""), "{text}");
        assert!(text.contains("\"kind\":\"delta\""), "{text}");
        let back: CacheUpdate = serde_json::from_str(&text).unwrap();
        assert_eq!(back, d);
        assert!(back.validate().is_ok());
    }

    #[test]
    fn bad_hashes_and_shapes_are_refused() {
        let bad = serde_json::json!({"v": 1, "worker_id": "w", "run": 1, "seq": 0,
            "kind": "delta", "block_size": 16, "stored": ["xyz"], "sent_ms": 0});
        assert!(serde_json::from_value::<CacheUpdate>(bad).is_err());
        let big = delta((0..MAX_DELTA_BLOCKS as u64 + 1).collect(), vec![]);
        assert_eq!(
            big.validate(),
            Err(CacheUpdateError::DeltaTooLarge(MAX_DELTA_BLOCKS + 1))
        );
        let mut snap = delta(vec![1], vec![2]);
        snap.kind = CacheUpdateKind::Snapshot;
        assert_eq!(snap.validate(), Err(CacheUpdateError::SnapshotWithChanges));
        let mut v2 = delta(vec![], vec![]);
        v2.v = 2;
        assert_eq!(v2.validate(), Err(CacheUpdateError::Version(2)));
    }

    #[test]
    fn a_full_snapshot_fits_a_default_nats_payload() {
        let mut snap = delta(
            (0..MAX_SNAPSHOT_BLOCKS as u64)
                .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect(),
            vec![],
        );
        snap.kind = CacheUpdateKind::Snapshot;
        let bytes = serde_json::to_vec(&snap).unwrap();
        assert!(bytes.len() < 1024 * 1024, "{} bytes", bytes.len());
        assert!(snap.validate().is_ok());
    }
}
