//! The GPU's KV blocks with vLLM's automatic prefix caching: which physical blocks hold
//! which prefix, who references them, and which free block goes next.
//!
//! Follows vLLM v1's `BlockPool` (`vllm/v1/core/block_pool.py`) and its
//! `FreeKVCacheBlockQueue` (`vllm/v1/core/kv_cache_utils.py`):
//!
//! - Every block is either referenced by running sequences (`ref_cnt > 0`) or in the free
//!   queue. A free block may still hold a cached prefix block (its hash): it can be reused
//!   by a later request until it is allocated for something else.
//! - The free queue is LRU: allocation takes from its head; freeing appends to its tail. A
//!   sequence frees its blocks last block first (vLLM frees `reversed(blocks)`), so the tail
//!   of a prompt is evicted before its head, which more prompts share.
//! - Allocating a free block that holds a hash evicts that hash from the cache
//!   (`BlockRemoved`); registering a newly full block caches its hash (`BlockStored`).
//! - A cache hit on a free block takes it out of the free queue (`touch`); a hit on a block
//!   another sequence holds only adds a reference.
//! - A hash is cached by one block at a time: a block computed again while the same hash
//!   is cached (two requests prefilling the same prefix at once) stays private and is not
//!   announced. (vLLM keeps and announces both copies; the prefix is the same either way.)
//!
//! Invariants (checked by the engine's property test): `free + referenced = num_blocks`;
//! a hash maps to a block that holds that hash; the free queue holds exactly the blocks
//! with `ref_cnt == 0`.

use std::collections::HashMap;

use metronome_protocol::prefix::BlockHash;

/// Index of a physical KV block.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// What changed in the prefix cache: vLLM's KV cache events (`vllm/distributed/kv_events.py`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks of one sequence became cached: `block_hashes` in prompt order, chained
    /// to `parent_block_hash` (`None` for the prompt's first block), with the token ids
    /// they hold (`block_size` per block).
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    },
    /// Cached blocks were evicted (their physical block was reused).
    BlockRemoved { block_hashes: Vec<BlockHash> },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// The physical blocks, their references and cached hashes, and the LRU free queue.
#[derive(Debug)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, BlockId>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: u32,
    /// Recorded events, when someone will read them.
    events: Option<Vec<KvEvent>>,
}

impl BlockPool {
    /// `num_blocks` free, uncached blocks. `record_events`: keep [`KvEvent`]s for
    /// [`BlockPool::take_events`] (off, nothing accumulates).
    pub fn new(num_blocks: u32, record_events: bool) -> Self {
        let n = num_blocks as usize;
        let mut pool = BlockPool {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            cached: HashMap::new(),
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            num_free: 0,
            events: record_events.then(Vec::new),
        };
        for id in 0..num_blocks {
            pool.push_tail(id);
        }
        pool
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Free blocks, cached or not (vLLM's `get_num_free_blocks`, what `kv_cache_usage`
    /// is computed from).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Blocks referenced by running sequences.
    pub fn num_used(&self) -> u32 {
        self.num_blocks() - self.num_free
    }

    /// Blocks holding a cached prefix block, referenced or not.
    pub fn num_cached(&self) -> u32 {
        self.cached.len() as u32
    }

    fn push_tail(&mut self, id: BlockId) {
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.num_free -= 1;
    }

    fn record(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// The cached block holding `hash`, if any.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// The longest run of `hashes`, from the first, that is cached (a chain: stop at the
    /// first miss).
    pub fn longest_hit(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.cached_block(*h)).collect()
    }

    /// How many of `blocks` sit in the free queue (a hit on them costs a free block).
    pub fn free_among(&self, blocks: &[BlockId]) -> u32 {
        blocks
            .iter()
            .filter(|b| self.ref_cnt[**b as usize] == 0)
            .count() as u32
    }

    /// Reference cache-hit blocks for a sequence, taking free ones out of the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.ref_cnt[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// Take `n` blocks from the head of the free queue (least recently freed first),
    /// evicting the prefixes they held. `None`, and nothing taken, if fewer are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        let mut evicted = Vec::new();
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if let Some(h) = self.hash[id as usize].take() {
                if self.cached.get(&h) == Some(&id) {
                    self.cached.remove(&h);
                    evicted.push(h);
                }
            }
            self.ref_cnt[id as usize] = 1;
            out.push(id);
        }
        if !evicted.is_empty() {
            self.record(KvEvent::BlockRemoved {
                block_hashes: evicted,
            });
        }
        Some(out)
    }

    /// Drop one reference to each of a sequence's blocks, freeing the last block first so
    /// the end of a prompt is evicted before its shared beginning.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            debug_assert!(self.ref_cnt[i] > 0, "double free of block {b}");
            self.ref_cnt[i] -= 1;
            if self.ref_cnt[i] == 0 {
                self.push_tail(b);
            }
        }
    }

    /// Cache a sequence's newly full blocks: `blocks[i]` now holds the block named
    /// `hashes[i]` for `i` in `from..hashes.len()`, with `tokens` the prompt's token ids.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        from: usize,
        tokens: &[u32],
        block_size: u32,
    ) {
        let mut stored = Vec::new();
        let mut first = None;
        for i in from..hashes.len() {
            let (block, h) = (blocks[i], hashes[i]);
            if self.cached.contains_key(&h) || self.hash[block as usize].is_some() {
                continue;
            }
            self.hash[block as usize] = Some(h);
            self.cached.insert(h, block);
            first.get_or_insert(i);
            stored.push(h);
        }
        let Some(first) = first else {
            return;
        };
        if self.events.is_none() {
            return;
        }
        // A run of stored blocks is one event when contiguous (the usual case: one
        // sequence's new blocks in one step); otherwise one event per block.
        let bs = block_size as usize;
        if stored.len() == hashes.len() - first {
            self.record(KvEvent::BlockStored {
                parent_block_hash: first.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens[first * bs..hashes.len() * bs].to_vec(),
                block_hashes: stored,
                block_size,
            });
        } else {
            for h in stored {
                let i = hashes
                    .iter()
                    .position(|x| *x == h)
                    .expect("stored from hashes");
                self.record(KvEvent::BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: i.checked_sub(1).map(|p| hashes[p]),
                    token_ids: tokens[i * bs..(i + 1) * bs].to_vec(),
                    block_size,
                });
            }
        }
    }

    /// Drop every cached hash (vLLM's `reset_prefix_cache`), only when no block is
    /// referenced; returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
        self.record(KvEvent::AllBlocksCleared);
        true
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// References of a block (for invariant checks).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt[block as usize]
    }

    /// Check the pool's own invariants (tests).
    pub fn check(&self) {
        let mut free = 0;
        let mut at = self.head;
        while at != NIL {
            assert_eq!(
                self.ref_cnt[at as usize], 0,
                "free block {at} is referenced"
            );
            free += 1;
            at = self.next[at as usize];
        }
        assert_eq!(free, self.num_free, "free queue length");
        let unreferenced = self.ref_cnt.iter().filter(|r| **r == 0).count() as u32;
        assert_eq!(unreferenced, self.num_free, "free = unreferenced");
        for (h, b) in &self.cached {
            assert_eq!(self.hash[*b as usize], Some(*h), "cached hash is held");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_takes_the_least_recently_freed_and_evicts_its_hash() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.allocate(2).unwrap();
        pool.cache_full_blocks(&a, &[11, 12], 0, &[0; 32], 16);
        pool.free(&a);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.longest_hit(&[11, 12, 13]), a);
        // Blocks 2 and 3 (never used) are older in the queue than a's blocks.
        let b = pool.allocate(2).unwrap();
        assert!(b.iter().all(|x| !a.contains(x)));
        assert_eq!(pool.num_cached(), 2);
        // Next come a's blocks, its last block first: hash 12 is evicted before 11.
        let c = pool.allocate(1).unwrap();
        assert_eq!(c, vec![a[1]]);
        assert_eq!(pool.longest_hit(&[11, 12]), vec![a[0]]);
        let events = pool.take_events();
        assert_eq!(
            events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![11, 12],
                    parent_block_hash: None,
                    token_ids: vec![0; 32],
                    block_size: 16
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![12]
                },
            ]
        );
        pool.check();
    }

    #[test]
    fn a_hit_on_a_free_block_takes_it_out_of_the_free_queue() {
        let mut pool = BlockPool::new(3, false);
        let a = pool.allocate(1).unwrap();
        pool.cache_full_blocks(&a, &[7], 0, &[1; 16], 16);
        pool.free(&a);
        let hit = pool.longest_hit(&[7]);
        assert_eq!(pool.free_among(&hit), 1);
        pool.touch(&hit);
        assert_eq!(pool.num_free(), 2);
        pool.touch(&hit); // a second sequence shares it
        assert_eq!(pool.ref_count(hit[0]), 2);
        assert_eq!(pool.num_free(), 2);
        pool.free(&hit);
        pool.free(&hit);
        assert_eq!(pool.num_free(), 3);
        assert!(pool.take_events().is_empty(), "not recording");
        pool.check();
    }

    #[test]
    fn reset_needs_an_idle_pool() {
        let mut pool = BlockPool::new(2, true);
        let a = pool.allocate(1).unwrap();
        pool.cache_full_blocks(&a, &[5], 0, &[0; 16], 16);
        assert!(!pool.reset_prefix_cache());
        pool.free(&a);
        assert!(pool.reset_prefix_cache());
        assert!(pool.longest_hit(&[5]).is_empty());
        assert_eq!(pool.take_events().last(), Some(&KvEvent::AllBlocksCleared));
        pool.check();
    }
}
