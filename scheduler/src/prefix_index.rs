//! What the leader believes each worker's prefix cache holds: the KV blocks of the jobs it
//! placed there, evicted as the model server would evict them.
//!
//! A model server with automatic prefix caching (vLLM) keeps a prompt's full KV blocks
//! after the request ends and reuses them for any later prompt whose block hash chain
//! starts the same way ([`metronome_protocol::prefix`]). This index estimates that cache
//! from the leader's own placements, where no KV events say what it holds:
//!
//! - **Insert.** Placing a job inserts its fingerprint's blocks on the chosen worker,
//!   *referenced* by the job while it runs (vLLM never evicts a block a running request
//!   uses). Its other KV tokens (the prompt past the fingerprint, its output) take room in
//!   the cache too, as anonymous blocks, without names to match.
//! - **Bound.** A worker holds at most its KV capacity in blocks (the heartbeat's
//!   `capacity_tokens / block_size`, [`DEFAULT_CAPACITY_TOKENS`] when it reports none, never
//!   more than [`MAX_BLOCKS_PER_WORKER`]). A block that does not fit, all others being
//!   referenced, is not inserted (the server would have preempted, not cached).
//! - **Evict.** To make room, the least recently used unreferenced block goes first, as in
//!   vLLM's free-block queue. When a job ends, its blocks join that queue last block first
//!   (vLLM frees a request's blocks in reverse order), so a chain loses its tail before its
//!   head and a shorter prefix of it stays matchable.
//! - **Forget.** A worker that dies or restarts loses its cache: [`PrefixIndex::forget_worker`].
//!
//! **Lookup** ([`PrefixIndex::cached`]): the tokens of a prompt a worker would not prefill
//! are its fingerprint's leading blocks found there (the chain is matched from its start and
//! stops at the first miss) times the block size, capped at the whole blocks before the
//! prompt's last token: vLLM always computes the last prompt token, even on a full hit,
//! and reuses whole blocks only (`max_cache_hit_length = num_tokens - 1`).
//!
//! **Memory.** Per worker and block held: one hash-map entry (8-byte hash, 4-byte node
//! index, 4-byte reference count: 16 bytes, plus the map's control byte and spare
//! capacity) and one node (8-byte hash, two 4-byte eviction-queue links: 16 bytes): about
//! 40 bytes per block, at most `capacity / block_size` blocks. A 40,000-token cache with
//! 16-token blocks is 2,500 blocks, about 100 KB. Beside it, per running job, the hashes of
//! its referenced blocks (at most 256 × 8 bytes). Nothing grows without a placement, and a
//! placement adds at most 256 blocks.
//!
//! The block tables hash with [`BlockHashState`] (keyed, as block hashes come from clients).
//!
//! Pure: no clock (the order of use is the eviction queue's order), no I/O.

use std::collections::HashMap;

use metronome_protocol::prefix::{BlockHash, PrefixFingerprint, DEFAULT_BLOCK_SIZE};

use crate::block_hasher::BlockHashState;

/// The KV capacity assumed for a worker that reports none in tokens.
pub const DEFAULT_CAPACITY_TOKENS: u64 = 32_768;

/// Most blocks indexed per worker, whatever capacity a heartbeat claims: 2^20 blocks
/// (16M tokens at 16 per block, far above any one GPU's cache), about 40 MB at most.
pub const MAX_BLOCKS_PER_WORKER: u64 = 1 << 20;

/// The part of one prompt a worker already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Cached {
    /// Prompt tokens the worker would not prefill.
    pub tokens: u32,
    /// Of those, the tokens in blocks a running job there also uses: they take no new KV.
    pub shared_tokens: u32,
}

/// No slot: the end of the eviction queue.
const NIL: u32 = u32::MAX;

/// One cached block, as the block table holds it.
#[derive(Debug, Clone, Copy)]
struct Block {
    /// Its node in `nodes`, for as long as it is held.
    node: u32,
    /// Running jobs using it; 0: cached only, evictable, queued in the eviction order.
    refs: u32,
}

/// A held block's node: its hash (to drop it from the table when evicted) and, while it is
/// unreferenced, its neighbours in the eviction queue; a vacant node links the vacant ones.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: BlockHash,
    prev: u32,
    next: u32,
}

/// One worker's estimated cache.
///
/// The eviction queue is a doubly linked list through `nodes`, oldest first: a block
/// joins it at the back when its last reference goes and leaves it from anywhere when a
/// job references it again, each in constant time.
#[derive(Debug, Clone)]
struct WorkerCache {
    capacity_blocks: u64,
    blocks: HashMap<BlockHash, Block, BlockHashState>,
    nodes: Vec<Node>,
    /// The first vacant node (`NIL`: none), the others linked by `next`.
    vacant: u32,
    /// The eviction queue's ends (`NIL` when it is empty).
    oldest: u32,
    newest: u32,
    /// Blocks running jobs hold beyond their fingerprints (no names to match).
    anonymous: u64,
}

impl WorkerCache {
    fn new(capacity_blocks: u64) -> Self {
        WorkerCache {
            capacity_blocks,
            blocks: HashMap::default(),
            nodes: Vec::new(),
            vacant: NIL,
            oldest: NIL,
            newest: NIL,
            anonymous: 0,
        }
    }

    fn held(&self) -> u64 {
        self.blocks.len() as u64 + self.anonymous
    }

    /// Put node `n` at the back of the eviction queue (the most recently used).
    fn enqueue(&mut self, n: u32) {
        self.nodes[n as usize].prev = self.newest;
        self.nodes[n as usize].next = NIL;
        match self.newest {
            NIL => self.oldest = n,
            last => self.nodes[last as usize].next = n,
        }
        self.newest = n;
    }

    /// Take node `n` out of the eviction queue.
    fn dequeue(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
        match prev {
            NIL => self.oldest = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.newest = prev,
            x => self.nodes[x as usize].prev = prev,
        }
    }

    /// A node for a new block.
    fn node_for(&mut self, hash: BlockHash) -> u32 {
        match self.vacant {
            NIL => {
                self.nodes.push(Node {
                    hash,
                    prev: NIL,
                    next: NIL,
                });
                (self.nodes.len() - 1) as u32
            }
            n => {
                self.vacant = self.nodes[n as usize].next;
                self.nodes[n as usize] = Node {
                    hash,
                    prev: NIL,
                    next: NIL,
                };
                n
            }
        }
    }

    /// Evict the least recently used unreferenced block; false when none is left.
    fn evict_one(&mut self) -> bool {
        let n = self.oldest;
        if n == NIL {
            return false;
        }
        self.dequeue(n);
        self.blocks.remove(&self.nodes[n as usize].hash);
        self.nodes[n as usize].next = self.vacant;
        self.vacant = n;
        true
    }

    /// Make room for one more block; false when every block held is referenced.
    fn room_for_one(&mut self) -> bool {
        while self.held() >= self.capacity_blocks {
            if !self.evict_one() {
                return false;
            }
        }
        true
    }

    /// Reference the leading `hashes` a job uses, inserting the missing ones while they
    /// fit; returns how many it holds (a prefix of `hashes`).
    fn reference(&mut self, hashes: &[BlockHash]) -> usize {
        for (i, hash) in hashes.iter().enumerate() {
            if let Some(block) = self.blocks.get_mut(hash) {
                block.refs += 1;
                if block.refs == 1 {
                    let n = block.node;
                    self.dequeue(n);
                }
                continue;
            }
            if !self.room_for_one() {
                return i;
            }
            let node = self.node_for(*hash);
            self.blocks.insert(*hash, Block { node, refs: 1 });
        }
        hashes.len()
    }

    /// Take room for up to `wanted` blocks without names (a job's KV past its fingerprint),
    /// evicting as needed; returns how many it took.
    fn take_anonymous(&mut self, wanted: u64) -> u64 {
        while self.held() + wanted > self.capacity_blocks && self.evict_one() {}
        let taken = wanted.min(self.capacity_blocks.saturating_sub(self.held()));
        self.anonymous += taken;
        taken
    }

    /// Release a job's blocks, last block first, each becoming the most recently used.
    fn unreference(&mut self, hashes: &[BlockHash]) {
        for hash in hashes.iter().rev() {
            let Some(block) = self.blocks.get_mut(hash) else {
                continue;
            };
            // A job references each block it holds, so a held block it releases has a
            // reference to drop.
            if block.refs == 0 {
                continue;
            }
            block.refs -= 1;
            if block.refs == 0 {
                let n = block.node;
                self.enqueue(n);
            }
        }
    }
}

/// A job whose blocks are referenced.
#[derive(Debug, Clone)]
struct Placed {
    worker_id: String,
    hashes: Vec<BlockHash>,
    anonymous: u64,
}

/// The leader's estimate of every worker's prefix cache (see the module documentation).
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    block_size: u32,
    workers: HashMap<String, WorkerCache>,
    jobs: HashMap<String, Placed>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new(DEFAULT_BLOCK_SIZE)
    }
}

impl PrefixIndex {
    /// An empty index of blocks of `block_size` tokens (fingerprints of another block size
    /// are neither indexed nor matched).
    pub fn new(block_size: u32) -> Self {
        PrefixIndex {
            block_size: block_size.max(1),
            workers: HashMap::new(),
            jobs: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// `job_id` now runs on `worker_id`, a worker of `capacity_tokens` KV tokens (`None`:
    /// not reported), with `fingerprint` and `kv_tokens` KV tokens in all (prompt and
    /// expected output). A job placed before (a retry) is released from its earlier worker
    /// first.
    pub fn place(
        &mut self,
        worker_id: &str,
        capacity_tokens: Option<u64>,
        job_id: &str,
        fingerprint: &PrefixFingerprint,
        kv_tokens: u64,
    ) {
        self.release(job_id);
        let bs = u64::from(self.block_size);
        let capacity_blocks =
            (capacity_tokens.unwrap_or(DEFAULT_CAPACITY_TOKENS) / bs).min(MAX_BLOCKS_PER_WORKER);
        // Looked up before inserting: a placement on a known worker allocates no key.
        if !self.workers.contains_key(worker_id) {
            self.workers
                .insert(worker_id.to_string(), WorkerCache::new(capacity_blocks));
        }
        let cache = self
            .workers
            .get_mut(worker_id)
            .expect("inserted above when missing");
        cache.capacity_blocks = capacity_blocks;
        let hashes: &[BlockHash] = if fingerprint.block_size == self.block_size {
            &fingerprint.hashes
        } else {
            &[]
        };
        let held = cache.reference(hashes);
        let anonymous = cache.take_anonymous(kv_tokens.div_ceil(bs).saturating_sub(held as u64));
        self.jobs.insert(
            job_id.to_string(),
            Placed {
                worker_id: worker_id.to_string(),
                hashes: hashes[..held].to_vec(),
                anonymous,
            },
        );
    }

    /// The job ended (or left the worker): its blocks stay cached, unreferenced.
    /// Idempotent.
    pub fn release(&mut self, job_id: &str) {
        let Some(placed) = self.jobs.remove(job_id) else {
            return;
        };
        if let Some(cache) = self.workers.get_mut(&placed.worker_id) {
            cache.unreference(&placed.hashes);
            cache.anonymous = cache.anonymous.saturating_sub(placed.anonymous);
        }
    }

    /// Release every job for which `runs(job_id, worker_id)` is false: the caller's record
    /// of what runs where (the ledger) is the truth, so every way a job ends is seen here.
    pub fn settle(&mut self, mut runs: impl FnMut(&str, &str) -> bool) {
        let ended: Vec<String> = self
            .jobs
            .iter()
            .filter(|(job, placed)| !runs(job, &placed.worker_id))
            .map(|(job, _)| job.clone())
            .collect();
        for job in ended {
            self.release(&job);
        }
    }

    /// The worker died or restarted: its cache is gone.
    pub fn forget_worker(&mut self, worker_id: &str) {
        self.workers.remove(worker_id);
        self.jobs.retain(|_, p| p.worker_id != worker_id);
    }

    /// What `worker_id` holds of a prompt of `prompt_tokens` tokens with `fingerprint`.
    pub fn cached(
        &self,
        worker_id: &str,
        fingerprint: &PrefixFingerprint,
        prompt_tokens: u32,
    ) -> Cached {
        let Some(cache) = self.workers.get(worker_id) else {
            return Cached::default();
        };
        if fingerprint.block_size != self.block_size {
            return Cached::default();
        }
        let mut shared_blocks = 0u32;
        let matched = fingerprint.matched_blocks(|h| match cache.blocks.get(&h) {
            Some(b) => {
                shared_blocks += u32::from(b.refs > 0);
                true
            }
            None => false,
        });
        // Whole blocks before the last token: the server always computes that token and
        // reuses whole blocks only (vLLM's `max_cache_hit_length`).
        let reusable = prompt_tokens.saturating_sub(1) / self.block_size;
        let tokens = (matched as u32)
            .min(reusable)
            .saturating_mul(self.block_size);
        Cached {
            tokens,
            shared_tokens: shared_blocks.saturating_mul(self.block_size).min(tokens),
        }
    }

    /// Named blocks indexed on `worker_id`.
    pub fn blocks_on(&self, worker_id: &str) -> usize {
        self.workers.get(worker_id).map_or(0, |c| c.blocks.len())
    }

    /// Blocks `worker_id` is assumed to hold in all (named and anonymous).
    pub fn held_on(&self, worker_id: &str) -> u64 {
        self.workers.get(worker_id).map_or(0, WorkerCache::held)
    }

    /// The capacity in blocks the index bounds `worker_id` by (0 when not indexed).
    pub fn capacity_of(&self, worker_id: &str) -> u64 {
        self.workers.get(worker_id).map_or(0, |c| c.capacity_blocks)
    }

    /// The heap bytes `worker_id`'s estimate takes, by its allocations: the block table's
    /// slots (hash, block and a control byte each) and the nodes (hash and queue links).
    pub fn memory_bytes(&self, worker_id: &str) -> usize {
        self.workers.get(worker_id).map_or(0, |c| {
            c.blocks.capacity() * (std::mem::size_of::<(BlockHash, Block)>() + 1)
                + c.nodes.capacity() * std::mem::size_of::<Node>()
        })
    }

    /// Jobs whose blocks are referenced.
    pub fn running_jobs(&self) -> usize {
        self.jobs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u32, len: u32) -> Vec<u32> {
        (0..len).map(|i| seed * 1_000_000 + i).collect()
    }

    fn fp(tokens: &[u32]) -> PrefixFingerprint {
        PrefixFingerprint::of_tokens(tokens, 16)
    }

    #[test]
    fn a_placed_prefix_is_found_on_its_worker_only() {
        let mut index = PrefixIndex::new(16);
        let p = prompt(1, 100); // 6 full blocks
        index.place("w1", Some(10_000), "a", &fp(&p), 150);
        let c = index.cached("w1", &fp(&p), 100);
        assert_eq!(c.tokens, 96);
        assert_eq!(c.shared_tokens, 96, "a runs there");
        assert_eq!(index.cached("w2", &fp(&p), 100), Cached::default());
        index.release("a");
        let c = index.cached("w1", &fp(&p), 100);
        assert_eq!((c.tokens, c.shared_tokens), (96, 0));
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        let mut index = PrefixIndex::new(16);
        let p = prompt(1, 64); // exactly 4 blocks
        index.place("w", Some(10_000), "a", &fp(&p), 64);
        assert_eq!(index.cached("w", &fp(&p), 64).tokens, 48, "3 whole blocks");
        assert_eq!(index.cached("w", &fp(&p), 65).tokens, 64);
        assert_eq!(index.cached("w", &fp(&p), 0).tokens, 0);
    }

    #[test]
    fn a_chain_is_matched_only_from_its_start() {
        let mut index = PrefixIndex::new(16);
        let a = prompt(1, 64);
        index.place("w", Some(10_000), "a", &fp(&a), 64);
        // Same tokens from block 1 on, a different first block: nothing matches.
        let mut b = a.clone();
        b[0] = 7;
        assert_eq!(index.cached("w", &fp(&b), 64).tokens, 0);
        // Same first two blocks, then different: two blocks.
        let mut c = a.clone();
        c[40] = 7;
        assert_eq!(index.cached("w", &fp(&c), 64).tokens, 32);
    }

    #[test]
    fn the_least_recently_used_unreferenced_blocks_go_first_tail_before_head() {
        let mut index = PrefixIndex::new(16);
        // 8 blocks of room; two 4-block prompts fill it.
        let (a, b, c) = (prompt(1, 64), prompt(2, 64), prompt(3, 32));
        index.place("w", Some(128), "a", &fp(&a), 64);
        index.place("w", Some(128), "b", &fp(&b), 64);
        index.release("a");
        index.release("b");
        // c needs 2 blocks: a's (used longest ago) lose their last two.
        index.place("w", Some(128), "c", &fp(&c), 32);
        assert_eq!(index.cached("w", &fp(&a), 65).tokens, 32);
        assert_eq!(index.cached("w", &fp(&b), 65).tokens, 64);
        assert_eq!(index.cached("w", &fp(&c), 33).tokens, 32);
        // a is used again: now b is the oldest.
        index.place("w", Some(128), "a2", &fp(&a), 64);
        index.release("a2");
        assert_eq!(index.cached("w", &fp(&a), 65).tokens, 64);
        assert_eq!(index.cached("w", &fp(&b), 65).tokens, 32);
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut index = PrefixIndex::new(16);
        let (a, b) = (prompt(1, 64), prompt(2, 64));
        index.place("w", Some(96), "a", &fp(&a), 64); // 4 of 6 blocks, running
        index.place("w", Some(96), "b", &fp(&b), 64); // only 2 fit
        assert_eq!(index.cached("w", &fp(&a), 65).tokens, 64);
        assert_eq!(index.cached("w", &fp(&b), 65).tokens, 32);
        assert_eq!(index.held_on("w"), 6);
    }

    #[test]
    fn a_running_jobs_other_tokens_take_room_until_it_ends() {
        let mut index = PrefixIndex::new(16);
        let (a, b) = (prompt(1, 64), prompt(2, 64));
        index.place("w", Some(160), "a", &fp(&a), 64);
        index.release("a");
        // b: 4 named blocks and 4 anonymous (its output) in 10: two of a's go, its tail.
        index.place("w", Some(160), "b", &fp(&b), 128);
        assert_eq!(index.held_on("w"), 10);
        assert_eq!(
            index.cached("w", &fp(&a), 65).tokens,
            32,
            "a's head is left"
        );
        index.release("b");
        assert_eq!(index.held_on("w"), 6, "b's named blocks stay cached");
        index.place("w", Some(160), "c", &fp(&prompt(3, 32)), 32);
        assert_eq!(index.cached("w", &fp(&a), 65).tokens, 32);
        assert_eq!(index.cached("w", &fp(&b), 65).tokens, 64);
    }

    #[test]
    fn a_worker_that_dies_is_forgotten_with_its_jobs() {
        let mut index = PrefixIndex::new(16);
        let a = prompt(1, 64);
        index.place("w", Some(10_000), "a", &fp(&a), 64);
        index.place("v", Some(10_000), "b", &fp(&a), 64);
        index.forget_worker("w");
        assert_eq!(index.cached("w", &fp(&a), 65).tokens, 0);
        assert_eq!(index.cached("v", &fp(&a), 65).tokens, 64);
        assert_eq!(index.running_jobs(), 1);
        index.release("a"); // nothing left to release: harmless
    }

    #[test]
    fn settle_releases_the_jobs_that_no_longer_run_and_a_retry_moves() {
        let mut index = PrefixIndex::new(16);
        let a = prompt(1, 64);
        index.place("w", Some(10_000), "a", &fp(&a), 64);
        index.place("w", Some(10_000), "b", &fp(&prompt(2, 32)), 32);
        index.settle(|job, _| job == "b");
        assert_eq!(index.running_jobs(), 1);
        assert_eq!(index.cached("w", &fp(&a), 65).shared_tokens, 0);
        // b is retried on v: released from w, referenced on v.
        index.place("v", Some(10_000), "b", &fp(&prompt(2, 32)), 32);
        assert_eq!(index.cached("w", &fp(&prompt(2, 32)), 33).shared_tokens, 0);
        assert_eq!(index.cached("v", &fp(&prompt(2, 32)), 33).shared_tokens, 32);
    }

    #[test]
    fn fingerprints_of_another_block_size_are_ignored() {
        let mut index = PrefixIndex::new(16);
        let a = prompt(1, 64);
        let other = PrefixFingerprint::of_tokens(&a, 32);
        index.place("w", Some(10_000), "a", &other, 64);
        assert_eq!(index.blocks_on("w"), 0);
        assert_eq!(index.held_on("w"), 4, "its KV still takes room");
        assert_eq!(index.cached("w", &other, 65).tokens, 0);
    }

    #[test]
    fn capacity_is_bounded_whatever_the_heartbeat_claims() {
        let mut index = PrefixIndex::new(16);
        index.place("w", Some(u64::MAX), "a", &fp(&prompt(1, 16)), 16);
        assert_eq!(index.capacity_of("w"), MAX_BLOCKS_PER_WORKER);
        index.place("v", None, "b", &fp(&prompt(1, 16)), 16);
        assert_eq!(index.capacity_of("v"), DEFAULT_CAPACITY_TOKENS / 16);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            /// Place a job on a worker: prompt family, its length in tokens, output tokens.
            Place(usize, u8, u32, u32),
            Release(u8),
            Forget(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0usize..3, 0u8..6, 1u32..600, 0u32..200)
                    .prop_map(|(w, f, len, out)| Op::Place(w, f, len, out)),
                3 => (0u8..40).prop_map(Op::Release),
                1 => (0usize..3).prop_map(Op::Forget),
            ]
        }

        const WORKERS: [(&str, u64); 3] = [("a", 320), ("b", 1_024), ("c", 4_000)];

        proptest! {
            #[test]
            fn a_worker_never_holds_more_than_its_capacity_and_hits_stay_below_the_prompt(
                ops in prop::collection::vec(op(), 1..120)
            ) {
                let mut index = PrefixIndex::new(16);
                let mut next = 0u32;
                for op in ops {
                    match op {
                        Op::Place(w, family, len, out) => {
                            let (id, capacity) = WORKERS[w];
                            // Families share their first 160 tokens in pairs.
                            let mut p = prompt(u32::from(family / 2) + 1, len);
                            for t in p.iter_mut().skip(160) {
                                *t += u32::from(family) * 100_000;
                            }
                            next += 1;
                            let job = format!("j{}", next % 40);
                            let fp = fp(&p);
                            index.place(id, Some(capacity), &job, &fp, u64::from(len + out));
                            let c = index.cached(id, &fp, len);
                            prop_assert!(c.tokens < len.max(1));
                            prop_assert!(c.shared_tokens <= c.tokens);
                        }
                        Op::Release(j) => index.release(&format!("j{j}")),
                        Op::Forget(w) => index.forget_worker(WORKERS[w].0),
                    }
                    for (id, capacity) in WORKERS {
                        prop_assert!(index.held_on(id) <= capacity / 16, "{id} over capacity");
                        let cache = index.workers.get(id);
                        if let Some(cache) = cache {
                            let free = cache.blocks.values().filter(|b| b.refs == 0).count();
                            // Walked both ways, the queue holds exactly the unreferenced blocks.
                            let mut forward = Vec::new();
                            let mut n = cache.oldest;
                            while n != NIL {
                                forward.push(n);
                                n = cache.nodes[n as usize].next;
                            }
                            let mut backward = Vec::new();
                            let mut n = cache.newest;
                            while n != NIL {
                                backward.push(n);
                                n = cache.nodes[n as usize].prev;
                            }
                            backward.reverse();
                            prop_assert_eq!(&forward, &backward);
                            prop_assert_eq!(forward.len(), free);
                            for n in forward {
                                let hash = cache.nodes[n as usize].hash;
                                prop_assert_eq!(cache.blocks[&hash].node, n);
                                prop_assert_eq!(cache.blocks[&hash].refs, 0);
                            }
                        }
                    }
                }
            }

            #[test]
            fn with_room_to_spare_a_placed_prompt_is_a_full_hit(len in 1u32..4_096) {
                let mut index = PrefixIndex::new(16);
                let p = prompt(9, len);
                index.place("w", Some(100_000), "j", &fp(&p), u64::from(len));
                let expected = (len - 1) / 16 * 16;
                prop_assert_eq!(index.cached("w", &fp(&p), len).tokens, expected);
            }
        }
    }
}
