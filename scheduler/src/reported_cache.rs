//! What each worker's model server says its prefix cache holds: the blocks its agent
//! forwards from the server's KV cache events ([`metronome_protocol::cache_state`]).
//!
//! Where a worker reports its cache, this is what the leader believes of it, exact up to
//! the forwarding delay (a fraction of a second); [`crate::PrefixIndex`], the estimate from
//! the leader's own placements, is the fallback for the workers that do not.
//!
//! **Ordering.** Per worker: a newer agent *run* replaces the state; within a run a
//! snapshot replaces the blocks and the deltas after it (by `seq`) apply in order. Deltas
//! and snapshots come from two streams, so a delta may arrive before the snapshot it
//! follows: the last [`KEPT_DELTAS`] deltas are kept and applied again on top of a later
//! snapshot. A delta already covered (its `seq` at or below what was applied) is dropped;
//! a missing `seq` is counted as a gap (the next snapshot, seconds later, closes it).
//!
//! **Live.** A worker's report is used once a snapshot of its current run has been applied
//! and while its latest message is at most `stale_after_ms` old (the agent sends a
//! snapshot every few seconds, changed or not). A worker that stops reporting falls back
//! to the placement estimate.
//!
//! **Bound and memory.** At most [`MAX_SNAPSHOT_BLOCKS`] blocks per worker (a delta that
//! would exceed it has its extra blocks dropped and counted). One 8-byte hash per block in
//! a hash set (about 9 bytes a slot, at most 8/7 slots a block): about 10–20 bytes per
//! block, ~40 KB for a 40,000-token cache of 16-token blocks ([`ReportedCaches::memory_bytes`]
//! measures it), plus at most [`KEPT_DELTA_BLOCKS`] hashes of kept deltas. The set hashes
//! with [`BlockHashState`] (keyed, as block hashes come from clients).
//!
//! Pure: time is an argument, no I/O.

use std::collections::{HashMap, HashSet, VecDeque};

use metronome_protocol::cache_state::{CacheUpdate, CacheUpdateKind, MAX_SNAPSHOT_BLOCKS};
use metronome_protocol::prefix::{BlockHash, PrefixFingerprint};

use crate::block_hasher::BlockHashState;

/// Deltas kept per worker to apply again over a snapshot that arrives after them.
pub const KEPT_DELTAS: usize = 64;
/// Most block hashes those kept deltas may hold in all, per worker.
pub const KEPT_DELTA_BLOCKS: usize = 8_192;
/// A worker's report is believed while its latest message is at most this old: three of
/// the agents' default snapshot intervals (10 s).
pub const DEFAULT_STALE_AFTER_MS: u64 = 30_000;

/// What applying one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A snapshot replaced the worker's blocks.
    Snapshot,
    /// A delta was applied.
    Delta,
    /// A delta was applied after a gap in `seq` (some deltas were never seen).
    DeltaAfterGap,
    /// Already covered (a duplicate, or older than what was applied): ignored.
    Covered,
    /// From an older run of the worker's agent: ignored.
    OlderRun,
}

/// Counts of what was applied and dropped, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportedStats {
    pub snapshots: u64,
    pub deltas: u64,
    pub gaps: u64,
    pub ignored: u64,
    /// Blocks dropped to stay within [`MAX_SNAPSHOT_BLOCKS`].
    pub over_bound: u64,
}

#[derive(Debug, Clone)]
struct Reported {
    run: u64,
    /// The last delta applied (or the snapshot's `seq`).
    seq: u64,
    block_size: u32,
    /// A snapshot of this run has been applied: the blocks are the whole state.
    complete: bool,
    blocks: HashSet<BlockHash, BlockHashState>,
    received_ms: u64,
    kept: VecDeque<CacheUpdate>,
    kept_blocks: usize,
}

impl Reported {
    fn new(run: u64, block_size: u32) -> Self {
        Reported {
            run,
            seq: 0,
            block_size,
            complete: false,
            blocks: HashSet::default(),
            received_ms: 0,
            kept: VecDeque::new(),
            kept_blocks: 0,
        }
    }

    fn apply_delta(&mut self, d: &CacheUpdate, stats: &mut ReportedStats) {
        if d.cleared {
            self.blocks.clear();
        }
        for h in &d.removed {
            self.blocks.remove(h);
        }
        for h in &d.stored {
            if self.blocks.len() >= MAX_SNAPSHOT_BLOCKS && !self.blocks.contains(h) {
                stats.over_bound += 1;
                continue;
            }
            self.blocks.insert(*h);
        }
        self.seq = d.seq;
    }

    /// Whether the kept deltas after `seq` run without a hole up to the state's `seq`.
    fn kept_cover(&self, seq: u64) -> bool {
        let mut next = seq + 1;
        for d in self.kept.iter().filter(|d| d.seq > seq) {
            if d.seq != next {
                return false;
            }
            next += 1;
        }
        next == self.seq + 1
    }

    fn keep(&mut self, d: &CacheUpdate) {
        let n = d.stored.len() + d.removed.len();
        self.kept.push_back(d.clone());
        self.kept_blocks += n;
        while self.kept.len() > KEPT_DELTAS || self.kept_blocks > KEPT_DELTA_BLOCKS {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            self.kept_blocks -= old.stored.len() + old.removed.len();
        }
    }
}

/// Every reporting worker's cache, as its model server's events say.
#[derive(Debug, Clone)]
pub struct ReportedCaches {
    workers: HashMap<String, Reported>,
    stale_after_ms: u64,
    stats: ReportedStats,
}

impl Default for ReportedCaches {
    fn default() -> Self {
        ReportedCaches::new(DEFAULT_STALE_AFTER_MS)
    }
}

impl ReportedCaches {
    pub fn new(stale_after_ms: u64) -> Self {
        ReportedCaches {
            workers: HashMap::new(),
            stale_after_ms,
            stats: ReportedStats::default(),
        }
    }

    pub fn stats(&self) -> ReportedStats {
        self.stats
    }

    /// Apply one message received at `now_ms` (the caller checked that its subject names
    /// its worker and that it is valid, [`CacheUpdate::validate`]).
    pub fn apply(&mut self, u: &CacheUpdate, now_ms: u64) -> Applied {
        let stats = &mut self.stats;
        let state = self
            .workers
            .entry(u.worker_id.clone())
            .or_insert_with(|| Reported::new(u.run, u.block_size));
        if u.run < state.run {
            stats.ignored += 1;
            return Applied::OlderRun;
        }
        if u.run > state.run || u.block_size != state.block_size {
            *state = Reported::new(u.run, u.block_size);
        }
        state.received_ms = state.received_ms.max(now_ms);
        match u.kind {
            CacheUpdateKind::Snapshot => {
                // An older snapshot than the state is used only when the kept deltas
                // bring it up to the state without a hole (it then closes any gap the
                // state has); otherwise the state is at least as good.
                if state.complete && u.seq < state.seq && !state.kept_cover(u.seq) {
                    stats.ignored += 1;
                    return Applied::Covered;
                }
                state.blocks.clear();
                state
                    .blocks
                    .extend(u.stored.iter().take(MAX_SNAPSHOT_BLOCKS));
                state.seq = u.seq;
                state.complete = true;
                let later: Vec<CacheUpdate> = state
                    .kept
                    .iter()
                    .filter(|d| d.seq > u.seq)
                    .cloned()
                    .collect();
                for d in &later {
                    state.apply_delta(d, stats);
                }
                stats.snapshots += 1;
                Applied::Snapshot
            }
            CacheUpdateKind::Delta => {
                if u.seq <= state.seq {
                    stats.ignored += 1;
                    return Applied::Covered;
                }
                let gap = state.complete && u.seq > state.seq + 1;
                state.apply_delta(u, stats);
                state.keep(u);
                stats.deltas += 1;
                if gap {
                    stats.gaps += 1;
                    Applied::DeltaAfterGap
                } else {
                    Applied::Delta
                }
            }
        }
    }

    /// Whether `worker_id`'s report is used at `now_ms`: a snapshot of its current run was
    /// applied and its latest message is fresh.
    pub fn is_live(&self, worker_id: &str, now_ms: u64) -> bool {
        self.live(worker_id, now_ms).is_some()
    }

    /// `worker_id`'s report where [`ReportedCaches::is_live`].
    fn live(&self, worker_id: &str, now_ms: u64) -> Option<&Reported> {
        self.workers
            .get(worker_id)
            .filter(|r| r.complete && now_ms.saturating_sub(r.received_ms) <= self.stale_after_ms)
    }

    /// Tokens of a prompt of `prompt_tokens` tokens with `fingerprint` that `worker_id`'s
    /// server holds: its leading blocks found there times the block size, at most the
    /// whole blocks before the prompt's last token (the server always computes the last
    /// token, and reuses whole blocks only: vLLM's `max_cache_hit_length`). `None` when
    /// the worker's report is not live or is of another block size.
    pub fn cached(
        &self,
        worker_id: &str,
        fingerprint: &PrefixFingerprint,
        prompt_tokens: u32,
        now_ms: u64,
    ) -> Option<u32> {
        let r = self.live(worker_id, now_ms)?;
        if r.block_size != fingerprint.block_size {
            return None;
        }
        let matched = fingerprint.matched_blocks(|h| r.blocks.contains(&h)) as u32;
        let reusable = prompt_tokens.saturating_sub(1) / r.block_size;
        Some(matched.min(reusable).saturating_mul(r.block_size))
    }

    /// Blocks `worker_id` reports.
    pub fn blocks_on(&self, worker_id: &str) -> usize {
        self.workers.get(worker_id).map_or(0, |r| r.blocks.len())
    }

    /// Workers with a report.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The heap bytes `worker_id`'s report takes, by the hash set's allocated slots (8
    /// bytes and a control byte each) and the kept deltas' hashes.
    pub fn memory_bytes(&self, worker_id: &str) -> usize {
        self.workers.get(worker_id).map_or(0, |r| {
            r.blocks.capacity() * 9
                + r.kept_blocks * 8
                + r.kept.len() * std::mem::size_of::<CacheUpdate>()
        })
    }

    /// The worker left the registry: its report goes with it.
    pub fn forget_worker(&mut self, worker_id: &str) {
        self.workers.remove(worker_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::cache_state::CACHE_UPDATE_VERSION;

    fn msg(
        run: u64,
        seq: u64,
        kind: CacheUpdateKind,
        stored: &[u64],
        removed: &[u64],
    ) -> CacheUpdate {
        CacheUpdate {
            v: CACHE_UPDATE_VERSION,
            worker_id: "w".into(),
            run,
            seq,
            kind,
            block_size: 16,
            cleared: false,
            stored: stored.to_vec(),
            removed: removed.to_vec(),
            truncated: false,
            sent_ms: 0,
        }
    }
    use CacheUpdateKind::{Delta, Snapshot};

    fn fp(tokens: u32) -> PrefixFingerprint {
        PrefixFingerprint::of_tokens(&(0..tokens).collect::<Vec<_>>(), 16)
    }

    #[test]
    fn nothing_is_believed_before_a_snapshot_and_after_silence() {
        let mut r = ReportedCaches::new(1_000);
        let chain = fp(64).hashes;
        r.apply(&msg(1, 1, Delta, &chain, &[]), 0);
        assert_eq!(r.cached("w", &fp(64), 65, 0), None, "no snapshot yet");
        r.apply(&msg(1, 1, Snapshot, &chain, &[]), 10);
        assert_eq!(r.cached("w", &fp(64), 65, 10), Some(64));
        assert_eq!(
            r.cached("w", &fp(64), 64, 10),
            Some(48),
            "the last token is computed, in whole blocks"
        );
        assert_eq!(r.cached("w", &fp(64), 65, 1_011), None, "stale");
        assert_eq!(r.cached("v", &fp(64), 65, 10), None, "never reported");
    }

    #[test]
    fn deltas_apply_in_order_and_a_late_snapshot_keeps_the_deltas_after_it() {
        let mut r = ReportedCaches::default();
        let c = fp(64).hashes;
        r.apply(&msg(1, 0, Snapshot, &[], &[]), 0);
        assert_eq!(r.apply(&msg(1, 1, Delta, &c[..2], &[]), 0), Applied::Delta);
        assert_eq!(r.cached("w", &fp(64), 65, 0), Some(32));
        // Delta 3 comes before the snapshot of 2 (two streams).
        assert_eq!(
            r.apply(&msg(1, 3, Delta, &c[3..4], &[]), 0),
            Applied::DeltaAfterGap
        );
        assert_eq!(
            r.apply(&msg(1, 2, Snapshot, &c[..3], &[]), 0),
            Applied::Snapshot
        );
        assert_eq!(
            r.cached("w", &fp(64), 65, 0),
            Some(64),
            "delta 3 applied again"
        );
        assert_eq!(r.apply(&msg(1, 3, Delta, &[], &c), 0), Applied::Covered);
        assert_eq!(r.apply(&msg(1, 4, Delta, &[], &c[1..2]), 0), Applied::Delta);
        assert_eq!(
            r.cached("w", &fp(64), 65, 0),
            Some(16),
            "a chain stops at a hole"
        );
    }

    #[test]
    fn a_newer_run_replaces_an_older_one_and_an_older_run_is_ignored() {
        let mut r = ReportedCaches::default();
        let c = fp(64).hashes;
        r.apply(&msg(5, 7, Snapshot, &c, &[]), 0);
        assert_eq!(r.apply(&msg(4, 9, Delta, &[], &c), 0), Applied::OlderRun);
        assert_eq!(r.cached("w", &fp(64), 65, 0), Some(64));
        r.apply(&msg(6, 1, Delta, &c[..1], &[]), 0);
        assert_eq!(
            r.cached("w", &fp(64), 65, 0),
            None,
            "new run, no snapshot yet"
        );
        r.apply(&msg(6, 0, Snapshot, &[], &[]), 0);
        assert_eq!(r.cached("w", &fp(64), 65, 0), Some(16), "its delta 1 kept");
        let mut cleared = msg(6, 2, Delta, &c[..1], &[]);
        cleared.cleared = true;
        r.apply(&cleared, 0);
        assert_eq!(r.blocks_on("w"), 1);
    }

    #[test]
    fn a_worker_holds_at_most_the_bound() {
        let mut r = ReportedCaches::default();
        r.apply(&msg(1, 0, Snapshot, &[], &[]), 0);
        let mut seq = 0;
        for chunk in (0..MAX_SNAPSHOT_BLOCKS as u64 + 10)
            .collect::<Vec<_>>()
            .chunks(4_096)
        {
            seq += 1;
            r.apply(&msg(1, seq, Delta, chunk, &[]), 0);
        }
        assert_eq!(r.blocks_on("w"), MAX_SNAPSHOT_BLOCKS);
        assert_eq!(r.stats().over_bound, 10);
        assert!(r.memory_bytes("w") < 2 * 1024 * 1024);
    }
}
