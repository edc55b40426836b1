//! The engine of one simulated GPU: continuous batching over a paged KV cache, as a pure
//! state machine (no clock, no I/O, no randomness). The async scheduler calls
//! [`Engine::step`] in a loop, sleeps the returned simulated duration and then delivers the
//! step's tokens, like vLLM's engine core loop.
//!
//! The policy follows vLLM's v1 scheduler (Kwon et al., "Efficient Memory Management for
//! Large Language Model Serving with PagedAttention", SOSP 2023; vLLM `v1/core/sched`):
//!
//! - Each step has a token budget (`max_num_batched_tokens`). Running sequences are served
//!   first, in admission order: a decoding sequence computes one token, a sequence still
//!   prefilling computes the next chunk of its prompt (chunked prefill).
//! - KV blocks are allocated as tokens are computed (`block_size` tokens per block). When a
//!   running sequence needs a block and none is free, the most recently admitted running
//!   sequence is preempted (recompute mode): its blocks are freed and it goes back to the
//!   front of the waiting queue, to redo the prefill of its prompt plus every token it had
//!   already generated when readmitted. Tokens already delivered are never repeated.
//! - If nothing was preempted, waiting sequences are admitted in FIFO order while the budget,
//!   `max_num_seqs` and free blocks allow; the head of the queue blocks the rest (FCFS).
//! - A sequence samples a token in the step where its KV catches up with its context; the
//!   step that finishes a prefill therefore yields the first token (TTFT = queue + prefill).
//! - A sequence that sampled its last token stays in the batch, holding its KV, until the
//!   step that sampled it has been delivered; it leaves before the next step is scheduled.
//!
//! Automatic prefix caching follows vLLM v1 (`vllm/v1/core/kv_cache_manager.py`,
//! `block_pool.py`; the pool itself is [`crate::block_pool`]): a prompt given as token ids
//! is cut into full blocks named by chained hashes ([`metronome_protocol::prefix`]); when
//! the sequence is admitted, the longest run of its blocks already cached is reused (at
//! most `context - 1` tokens, rounded down to whole blocks: vLLM always computes the last
//! token to get its logits) and only the rest is prefilled and charged; its own prompt
//! blocks are cached as soon as they are scheduled full. Freed blocks keep their prefix
//! until the LRU free queue hands them out again. Only prompt blocks are cached: generated
//! tokens have no ids here, so the blocks they fill are freed uncached. Prefix-cache
//! queries and hits are counted in tokens once per admission (vLLM counts them per
//! lookup, which repeats while a request at the queue's head waits for blocks).
//!
//! Invariants (checked by the property test below): referenced blocks + free blocks ==
//! `num_blocks`; a sequence holds exactly `ceil(kv_tokens / block_size)` blocks; each
//! sequence emits token indices 0, 1, .. in order, exactly `output_tokens` of them, and
//! finishes; any sequence whose KV need fits the cache makes progress (the oldest running
//! sequence is never preempted while a younger one runs).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use metronome_protocol::prefix::{chain_hashes, BlockHash};

use crate::block_pool::{BlockId, BlockPool, KvEvent};
use crate::cost::{StepCost, StepShape};

/// Identifies a sequence (one request) inside one engine.
pub type SeqId = u64;

/// Static parameters of the engine, already validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineParams {
    /// Tokens per KV block (vLLM's default: 16).
    pub block_size: u32,
    /// KV blocks on the GPU.
    pub num_blocks: u32,
    /// Most sequences running at once (vLLM's `max_num_seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step, prefill chunks and decodes together
    /// (vLLM's `max_num_batched_tokens`). At least `max_num_seqs`.
    pub max_num_batched_tokens: u32,
    /// Reuse cached prefix blocks (vLLM's `enable_prefix_caching`, on by default in v1).
    pub enable_prefix_caching: bool,
    pub cost: StepCost,
}

impl EngineParams {
    /// KV capacity in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.num_blocks) * u64::from(self.block_size)
    }
}

/// Why the engine refused a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("sequence {0} already exists")]
    Duplicate(SeqId),
    #[error("a sequence must generate at least one token")]
    NoOutput,
    #[error("prompt ({prompt_tokens}) plus output ({output_tokens}) tokens need more KV than the cache holds ({capacity_tokens} tokens)")]
    TooLong {
        prompt_tokens: u32,
        output_tokens: u32,
        capacity_tokens: u64,
    },
}

/// A token produced by a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emitted {
    pub id: SeqId,
    /// 0-based index of the token in the sequence's output.
    pub index: u32,
    /// This is the sequence's last token; the engine has already dropped it.
    pub finished: bool,
}

/// The result of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutcome {
    /// Simulated time this step takes on the GPU (zero when nothing was scheduled).
    pub duration: Duration,
    pub shape: StepShape,
    pub tokens: Vec<Emitted>,
    pub preempted: Vec<SeqId>,
}

impl StepOutcome {
    /// Nothing was scheduled: the engine is idle until a sequence is added.
    pub fn is_idle(&self) -> bool {
        self.shape.is_empty()
    }
}

/// Counters and gauges of the engine, as exported in `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub running: u32,
    pub waiting: u32,
    pub used_blocks: u32,
    pub num_blocks: u32,
    pub block_size: u32,
    pub preemptions_total: u64,
    /// Prompt tokens of requests whose first token was produced.
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Tokens prefilled again after a preemption (the price of recompute).
    pub recomputed_tokens_total: u64,
    pub steps_total: u64,
    /// Sum of the simulated step durations: the GPU's busy time, in seconds.
    pub busy_seconds_total: f64,
    /// Tokens looked up in the prefix cache at admission (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries_total: u64,
    /// Of those, tokens found cached and not prefilled (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits_total: u64,
    /// Blocks holding a cached prefix block, referenced or free.
    pub cached_blocks: u32,
}

impl EngineStats {
    /// KV cache usage in 0..=1, vLLM's `kv_cache_usage_perc`.
    pub fn kv_usage(&self) -> f64 {
        if self.num_blocks == 0 {
            0.0
        } else {
            f64::from(self.used_blocks) / f64::from(self.num_blocks)
        }
    }
}

/// A prompt's identity for the prefix cache: its token ids and the chained hashes of its
/// full blocks.
#[derive(Debug)]
struct PromptBlocks {
    token_ids: Vec<u32>,
    hashes: Vec<BlockHash>,
}

#[derive(Clone, Debug)]
struct Seq {
    id: SeqId,
    prompt_tokens: u32,
    output_tokens: u32,
    generated: u32,
    /// Tokens whose KV is computed (or reused from the cache) and held in `blocks`.
    kv_tokens: u32,
    blocks: Vec<BlockId>,
    /// Leading prompt blocks of `blocks` that are registered in the prefix cache.
    cached_blocks: usize,
    /// `None`: a prompt known only by its length, which shares nothing.
    prompt: Option<Arc<PromptBlocks>>,
    preempted_once: bool,
}

impl Seq {
    fn context_len(&self) -> u32 {
        self.prompt_tokens + self.generated
    }

    /// Tokens to compute before the next token can be sampled.
    fn pending(&self) -> u32 {
        self.context_len() - self.kv_tokens
    }

    /// Decoding: only the last sampled token's KV is missing.
    fn is_decoding(&self) -> bool {
        self.generated > 0 && self.pending() == 1
    }

    /// Sampled its last token: it leaves the batch when the step that sampled it ends.
    fn is_finished(&self) -> bool {
        self.generated == self.output_tokens
    }
}

/// One simulated GPU's scheduler state.
#[derive(Debug)]
pub struct Engine {
    params: EngineParams,
    waiting: VecDeque<Seq>,
    /// Admission order: index 0 is the oldest, the last is the first to be preempted.
    running: Vec<Seq>,
    pool: BlockPool,
    stats: EngineStats,
    /// Each admitted prompt's tokens found cached, when recorded
    /// ([`Engine::record_prefix_hits`]).
    hits: Option<Vec<(SeqId, u32)>>,
}

impl Engine {
    pub fn new(params: EngineParams) -> Self {
        Engine::with_kv_events(params, false)
    }

    /// An engine that records its prefix cache's [`KvEvent`]s for
    /// [`Engine::take_kv_events`] when `record_events` (a publisher will read them).
    pub fn with_kv_events(params: EngineParams, record_events: bool) -> Self {
        Engine {
            params,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool: BlockPool::new(
                params.num_blocks,
                record_events && params.enable_prefix_caching,
            ),
            stats: EngineStats {
                num_blocks: params.num_blocks,
                block_size: params.block_size,
                ..EngineStats::default()
            },
            hits: None,
        }
    }

    /// Record, per admitted sequence with token ids, the prompt tokens found cached (what
    /// a prediction of its cached tokens is judged against), for
    /// [`Engine::take_prefix_hits`].
    pub fn record_prefix_hits(&mut self) {
        self.hits.get_or_insert_with(Vec::new);
    }

    /// The admissions' cached tokens since the last call (a sequence admitted again after
    /// a preemption appears again).
    pub fn take_prefix_hits(&mut self) -> Vec<(SeqId, u32)> {
        self.hits.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    /// Queue a sequence of `prompt_tokens` anonymous prompt tokens (sharing no prefix
    /// with anything) that will generate exactly `output_tokens` tokens.
    pub fn add(
        &mut self,
        id: SeqId,
        prompt_tokens: u32,
        output_tokens: u32,
    ) -> Result<(), EngineError> {
        self.add_seq(id, prompt_tokens, None, output_tokens)
    }

    /// Queue a sequence whose prompt is `token_ids` (at least one; its full blocks can be
    /// reused from and added to the prefix cache) that will generate exactly
    /// `output_tokens` tokens.
    pub fn add_prompt(
        &mut self,
        id: SeqId,
        token_ids: Vec<u32>,
        output_tokens: u32,
    ) -> Result<(), EngineError> {
        let prompt_tokens = u32::try_from(token_ids.len()).unwrap_or(u32::MAX);
        let prompt = (self.params.enable_prefix_caching && !token_ids.is_empty()).then(|| {
            Arc::new(PromptBlocks {
                hashes: chain_hashes(&token_ids, self.params.block_size, usize::MAX),
                token_ids,
            })
        });
        self.add_seq(id, prompt_tokens, prompt, output_tokens)
    }

    fn add_seq(
        &mut self,
        id: SeqId,
        prompt_tokens: u32,
        prompt: Option<Arc<PromptBlocks>>,
        output_tokens: u32,
    ) -> Result<(), EngineError> {
        // Even an empty prompt has a start token to prefill.
        let prompt_tokens = prompt_tokens.max(1);
        if output_tokens == 0 {
            return Err(EngineError::NoOutput);
        }
        if self.contains(id) {
            return Err(EngineError::Duplicate(id));
        }
        // The last token is sampled but never cached, so the KV peak is prompt + output - 1.
        let peak = u64::from(prompt_tokens) + u64::from(output_tokens) - 1;
        if peak > self.params.capacity_tokens()
            || prompt_tokens.checked_add(output_tokens).is_none()
        {
            return Err(EngineError::TooLong {
                prompt_tokens,
                output_tokens,
                capacity_tokens: self.params.capacity_tokens(),
            });
        }
        self.waiting.push_back(Seq {
            id,
            prompt_tokens,
            output_tokens,
            generated: 0,
            kv_tokens: 0,
            blocks: Vec::new(),
            cached_blocks: 0,
            prompt,
            preempted_once: false,
        });
        self.refresh_gauges();
        Ok(())
    }

    /// Drop a sequence (client went away), freeing its KV. Returns whether it was known.
    pub fn abort(&mut self, id: SeqId) -> bool {
        let found = if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(pos);
            self.pool.free(&seq.blocks);
            true
        } else if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(pos).expect("position is in range");
            self.pool.free(&seq.blocks);
            true
        } else {
            false
        };
        self.refresh_gauges();
        found
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.running.iter().any(|s| s.id == id) || self.waiting.iter().any(|s| s.id == id)
    }

    /// Whether a step would schedule anything.
    pub fn has_work(&self) -> bool {
        self.running.iter().any(|s| !s.is_finished()) || !self.waiting.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// The prefix cache's events since the last call (empty unless the engine was made
    /// [`Engine::with_kv_events`] with prefix caching on).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Drop every cached prefix (vLLM's `POST /reset_prefix_cache`). Refused (`false`)
    /// while any sequence holds blocks, as in vLLM.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.pool.reset_prefix_cache();
        self.refresh_gauges();
        done
    }

    /// Prompt tokens a new request for `token_ids` would find cached right now, as the
    /// admission would count them (for tests and tools).
    pub fn cached_prefix_tokens(&self, token_ids: &[u32]) -> u32 {
        if !self.params.enable_prefix_caching || token_ids.is_empty() {
            return 0;
        }
        let hashes = chain_hashes(token_ids, self.params.block_size, usize::MAX);
        let max_blocks = (token_ids.len() - 1) / self.params.block_size as usize;
        self.pool
            .longest_hit(&hashes[..hashes.len().min(max_blocks)])
            .len() as u32
            * self.params.block_size
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.params.block_size)
    }

    /// Sequences the previous step finished leave the batch and free their KV, before the
    /// next step is scheduled: the caller delivers a step's tokens when its duration has
    /// passed, so until then a finishing sequence is still in the batch being computed.
    /// vLLM does the same: `Scheduler.update_from_output` (vLLM `v1/core/sched`) removes
    /// stopped requests from `running` and frees their blocks once the model runner's
    /// output is back, and the `num_requests_running` / KV-usage gauges are made from that
    /// state. (Retiring them when the step is planned made a GPU's only sequence vanish
    /// from `/metrics` for its whole last step, so a busy GPU read as idle.) Scheduling is
    /// unchanged: the next step sees the same free blocks either way. [`Engine::step`]
    /// calls it first; a caller that delivers a step's tokens without stepping again at
    /// once (the policy lab's event loop) calls it on delivery.
    pub fn retire_finished(&mut self) {
        let pool = &mut self.pool;
        self.running.retain(|s| {
            if s.is_finished() {
                pool.free(&s.blocks);
            }
            !s.is_finished()
        });
        self.refresh_gauges();
    }

    fn refresh_gauges(&mut self) {
        self.stats.running = self.running.len() as u32;
        self.stats.waiting = self.waiting.len() as u32;
        self.stats.used_blocks = self.pool.num_used();
        self.stats.cached_blocks = self.pool.num_cached();
    }

    /// The cached blocks a waiting sequence can reuse: the longest cached run of its
    /// prompt's blocks, leaving at least its last token to compute.
    fn prefix_hit(&self, seq: &Seq) -> Vec<BlockId> {
        let Some(prompt) = &seq.prompt else {
            return Vec::new();
        };
        let max_blocks = ((seq.context_len() - 1) / self.params.block_size) as usize;
        self.pool
            .longest_hit(&prompt.hashes[..prompt.hashes.len().min(max_blocks)])
    }

    /// Register the sequence's prompt blocks that are full once its KV reaches
    /// `computed` tokens (vLLM caches them when they are scheduled, `cache_blocks`).
    fn cache_full_prompt_blocks(
        pool: &mut BlockPool,
        seq: &mut Seq,
        computed: u32,
        block_size: u32,
    ) {
        let Some(prompt) = &seq.prompt else {
            return;
        };
        let full =
            ((computed.min(seq.prompt_tokens) / block_size) as usize).min(prompt.hashes.len());
        if full > seq.cached_blocks {
            pool.cache_full_blocks(
                &seq.blocks[..full],
                &prompt.hashes[..full],
                seq.cached_blocks,
                &prompt.token_ids,
                block_size,
            );
            seq.cached_blocks = full;
        }
    }

    /// Preempt the most recently admitted running sequence (recompute mode).
    fn preempt_last(&mut self, preempted: &mut Vec<SeqId>) {
        let mut victim = self
            .running
            .pop()
            .expect("caller checked running is non-empty");
        self.pool.free(&victim.blocks);
        victim.blocks.clear();
        victim.cached_blocks = 0;
        victim.kv_tokens = 0;
        victim.preempted_once = true;
        self.stats.preemptions_total += 1;
        preempted.push(victim.id);
        // Pushed to the front: victims are popped youngest first, so the queue's front ends
        // up in admission order and the oldest victim is readmitted first.
        self.waiting.push_front(victim);
    }

    /// Run one engine step: schedule, compute and sample. Pure: the caller applies the
    /// returned duration to its clock.
    pub fn step(&mut self) -> StepOutcome {
        self.retire_finished();
        let mut budget = self.params.max_num_batched_tokens;
        let mut preempted = Vec::new();
        // (index into running, tokens computed this step)
        let mut scheduled: Vec<(usize, u32)> = Vec::new();

        // 1. Running sequences, oldest first.
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let n = seq.pending().min(budget);
            let needed = self.blocks_for(seq.kv_tokens + n) - seq.blocks.len() as u32;
            while needed > self.pool.num_free() {
                let victim_is_self = self.running.len() - 1 == i;
                self.preempt_last(&mut preempted);
                if victim_is_self {
                    break 'running;
                }
            }
            let new_blocks = self.pool.allocate(needed).expect("enough blocks are free");
            let seq = &mut self.running[i];
            seq.blocks.extend(new_blocks);
            let computed = seq.kv_tokens + n;
            Self::cache_full_prompt_blocks(&mut self.pool, seq, computed, self.params.block_size);
            scheduled.push((i, n));
            budget -= n;
            i += 1;
        }

        // 2. Admissions, only when the cache did not just run out.
        if preempted.is_empty() {
            while budget > 0 && (self.running.len() as u32) < self.params.max_num_seqs {
                let Some(head) = self.waiting.front() else {
                    break;
                };
                let hit = self.prefix_hit(head);
                let hit_tokens = hit.len() as u32 * self.params.block_size;
                let n = (head.pending() - hit_tokens).min(budget);
                let needed = self.blocks_for(hit_tokens + n) - hit.len() as u32;
                if needed + self.pool.free_among(&hit) > self.pool.num_free() {
                    break;
                }
                let mut seq = self.waiting.pop_front().expect("front exists");
                if seq.prompt.is_some() {
                    self.stats.prefix_cache_queries_total += u64::from(seq.context_len());
                    self.stats.prefix_cache_hits_total += u64::from(hit_tokens);
                    if let Some(hits) = self.hits.as_mut() {
                        hits.push((seq.id, hit_tokens));
                    }
                }
                self.pool.touch(&hit);
                seq.cached_blocks = hit.len();
                seq.blocks = hit;
                seq.blocks
                    .extend(self.pool.allocate(needed).expect("enough blocks are free"));
                seq.kv_tokens = hit_tokens;
                Self::cache_full_prompt_blocks(
                    &mut self.pool,
                    &mut seq,
                    hit_tokens + n,
                    self.params.block_size,
                );
                self.running.push(seq);
                scheduled.push((self.running.len() - 1, n));
                budget -= n;
            }
        }

        // 3. Compute the scheduled tokens and sample where a sequence caught up.
        let mut shape = StepShape::default();
        let mut tokens = Vec::new();
        for &(idx, n) in &scheduled {
            let seq = &mut self.running[idx];
            if seq.is_decoding() {
                shape.decode_seqs += 1;
            } else {
                shape.prefill_tokens += n;
                if seq.preempted_once {
                    self.stats.recomputed_tokens_total += u64::from(n);
                }
            }
            seq.kv_tokens += n;
            shape.kv_tokens_read += u64::from(seq.kv_tokens);
            if seq.kv_tokens == seq.context_len() {
                if seq.generated == 0 {
                    self.stats.prompt_tokens_total += u64::from(seq.prompt_tokens);
                }
                seq.generated += 1;
                self.stats.generation_tokens_total += 1;
                tokens.push(Emitted {
                    id: seq.id,
                    index: seq.generated - 1,
                    finished: seq.generated == seq.output_tokens,
                });
            }
        }

        let duration = self.params.cost.step_duration(shape);
        if !shape.is_empty() {
            self.stats.steps_total += 1;
            self.stats.busy_seconds_total += duration.as_secs_f64();
        }
        self.refresh_gauges();
        StepOutcome {
            duration,
            shape,
            tokens,
            preempted,
        }
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        self.pool.check();
        let mut refs = std::collections::HashMap::<BlockId, u32>::new();
        for s in self.running.iter().chain(self.waiting.iter()) {
            for b in &s.blocks {
                *refs.entry(*b).or_default() += 1;
            }
        }
        for (b, n) in &refs {
            assert_eq!(self.pool.ref_count(*b), *n, "references of block {b}");
        }
        assert_eq!(
            refs.len() as u32 + self.pool.num_free(),
            self.params.num_blocks,
            "block accounting"
        );
        for s in &self.running {
            assert_eq!(
                s.blocks.len() as u32,
                self.blocks_for(s.kv_tokens),
                "blocks match kv of {}",
                s.id
            );
            // A finished one only until the next step retires it.
            assert!(s.generated <= s.output_tokens);
        }
        for s in &self.waiting {
            assert!(s.blocks.is_empty(), "waiting sequences hold no KV");
        }
        assert!(self.running.len() as u32 <= self.params.max_num_seqs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn params(num_blocks: u32) -> EngineParams {
        EngineParams {
            block_size: 16,
            num_blocks,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_prefix_caching: true,
            cost: StepCost {
                base_step_ms: 10.0,
                alpha: 0.01,
                prefill_ms_per_token: 0.1,
                kv_read_ms_per_token: 0.0,
                speed: 1.0,
            },
        }
    }

    /// Step until idle, returning every token per sequence and the steps taken.
    fn drain(engine: &mut Engine) -> (HashMap<SeqId, Vec<Emitted>>, Vec<StepOutcome>) {
        let mut tokens: HashMap<SeqId, Vec<Emitted>> = HashMap::new();
        let mut steps = Vec::new();
        for _ in 0..100_000 {
            if !engine.has_work() {
                // The step that retires the last finished sequences computes nothing.
                assert!(engine.step().is_idle());
                engine.check_invariants();
                return (tokens, steps);
            }
            let out = engine.step();
            engine.check_invariants();
            for t in &out.tokens {
                tokens.entry(t.id).or_default().push(*t);
            }
            steps.push(out);
        }
        panic!("engine did not drain");
    }

    #[test]
    fn prefill_step_yields_the_first_token() {
        let mut e = Engine::new(params(100));
        e.add(1, 100, 3).unwrap();
        let first = e.step();
        assert_eq!(
            first.tokens,
            vec![Emitted {
                id: 1,
                index: 0,
                finished: false
            }]
        );
        assert_eq!(first.shape.prefill_tokens, 100);
        assert_eq!(first.shape.decode_seqs, 0);
        // 10 ms base + 100 * 0.1 ms prefill
        assert_eq!(first.duration, Duration::from_millis(20));
        let second = e.step();
        assert_eq!(second.shape.decode_seqs, 1);
        assert_eq!(second.duration, Duration::from_millis(10));
        let third = e.step();
        assert!(third.tokens[0].finished);
        assert!(!e.has_work());
        // While the last step is computed (until its token is delivered) the sequence is
        // still in the batch and holds its KV, as in vLLM's gauges; the next step retires it.
        assert_eq!(e.stats().running, 1);
        assert!(e.stats().used_blocks > 0);
        assert!(e.step().is_idle());
        assert_eq!(e.stats().running, 0);
        assert_eq!(e.stats().used_blocks, 0);
        assert_eq!(e.stats().generation_tokens_total, 3);
        assert_eq!(e.stats().prompt_tokens_total, 100);
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks() {
        let mut p = params(1000);
        p.max_num_batched_tokens = 256;
        let mut e = Engine::new(p);
        e.add(1, 600, 1).unwrap();
        let a = e.step();
        let b = e.step();
        let c = e.step();
        assert_eq!(
            [
                a.shape.prefill_tokens,
                b.shape.prefill_tokens,
                c.shape.prefill_tokens
            ],
            [256, 256, 88]
        );
        assert!(a.tokens.is_empty() && b.tokens.is_empty());
        assert!(c.tokens[0].finished);
    }

    #[test]
    fn admission_stalls_decode_for_everyone_in_the_step() {
        let mut e = Engine::new(params(1000));
        e.add(1, 10, 50).unwrap();
        e.step();
        let plain = e.step();
        e.add(2, 500, 5).unwrap();
        let with_prefill = e.step();
        assert_eq!(with_prefill.shape.decode_seqs, 1);
        assert_eq!(with_prefill.shape.prefill_tokens, 500);
        assert!(with_prefill.duration > plain.duration * 5);
        // seq 1 still got its token in that (slow) step
        assert!(with_prefill.tokens.iter().any(|t| t.id == 1));
    }

    #[test]
    fn decode_step_grows_with_batch() {
        let mut e = Engine::new(params(1000));
        for id in 0..8 {
            e.add(id, 16, 10).unwrap();
        }
        e.step(); // all prefills
        let batch8 = e.step();
        assert_eq!(batch8.shape.decode_seqs, 8);
        // 10 * (1 + 0.01 * 7)
        assert!((batch8.duration.as_secs_f64() * 1000.0 - 10.7).abs() < 1e-6);
    }

    #[test]
    fn max_num_seqs_keeps_the_rest_waiting() {
        let mut p = params(1000);
        p.max_num_seqs = 2;
        let mut e = Engine::new(p);
        for id in 0..5 {
            e.add(id, 8, 4).unwrap();
        }
        e.step();
        assert_eq!(e.stats().running, 2);
        assert_eq!(e.stats().waiting, 3);
    }

    #[test]
    fn kv_exhaustion_preempts_the_youngest_and_everyone_finishes() {
        // 8 blocks = 128 tokens; three sequences of 16 + 60 tokens each need 76.
        let mut e = Engine::new(params(8));
        for id in 0..3 {
            e.add(id, 16, 60).unwrap();
        }
        let (tokens, steps) = drain(&mut e);
        let stats = e.stats();
        assert!(stats.preemptions_total > 0);
        assert!(stats.recomputed_tokens_total > 0);
        // The oldest is never the victim while younger ones run.
        assert!(steps.iter().all(|s| !s.preempted.contains(&0)));
        for id in 0..3 {
            let indices: Vec<u32> = tokens[&id].iter().map(|t| t.index).collect();
            assert_eq!(indices, (0..60).collect::<Vec<_>>(), "seq {id}");
        }
        assert_eq!(stats.used_blocks, 0);
        assert_eq!(stats.generation_tokens_total, 180);
    }

    #[test]
    fn recompute_prefills_prompt_and_generated_tokens() {
        // 4 blocks = 64 tokens. Seq 0 (prompt 16) reaches 48 tokens of KV, seq 1 then
        // cannot grow and is preempted with some tokens already generated.
        let mut e = Engine::new(params(4));
        e.add(0, 16, 40).unwrap();
        e.add(1, 16, 40).unwrap();
        let mut victim_generated = None;
        while e.has_work() {
            let before: Vec<(SeqId, u32)> = e.running.iter().map(|s| (s.id, s.generated)).collect();
            let out = e.step();
            e.check_invariants();
            if let Some(&v) = out.preempted.first() {
                victim_generated = before.iter().find(|(id, _)| *id == v).map(|(_, g)| *g);
                // Readmission recomputes prompt + generated tokens.
                let w = e.waiting.front().unwrap();
                assert_eq!(w.pending(), 16 + w.generated);
                break;
            }
        }
        assert!(victim_generated.unwrap() > 0);
    }

    #[test]
    fn abort_frees_kv_of_running_and_waiting() {
        let mut p = params(10);
        p.max_num_seqs = 1;
        let mut e = Engine::new(p);
        e.add(1, 100, 10).unwrap();
        e.add(2, 10, 10).unwrap();
        e.step();
        assert!(e.stats().used_blocks > 0);
        assert!(e.abort(1));
        assert_eq!(e.stats().used_blocks, 0);
        assert!(e.abort(2));
        assert!(!e.abort(2));
        assert!(!e.has_work());
        assert_eq!(e.stats().running + e.stats().waiting, 0);
    }

    #[test]
    fn refuses_what_can_never_fit() {
        let mut e = Engine::new(params(2));
        assert!(matches!(e.add(1, 30, 4), Err(EngineError::TooLong { .. })));
        assert_eq!(e.add(1, 30, 3), Ok(()));
        assert_eq!(e.add(1, 1, 1), Err(EngineError::Duplicate(1)));
        assert_eq!(e.add(2, 1, 0), Err(EngineError::NoOutput));
    }

    #[test]
    fn idle_engine_steps_are_free() {
        let mut e = Engine::new(params(2));
        let out = e.step();
        assert!(out.is_idle());
        assert_eq!(out.duration, Duration::ZERO);
        assert_eq!(e.stats().steps_total, 0);
    }

    fn prompt(len: u32, salt: u32) -> Vec<u32> {
        (0..len).map(|i| i * 7 + salt).collect()
    }

    /// Step until `id` produced its first token; returns the prefill tokens charged on
    /// the way (the whole engine's, so run it alone).
    fn prefill_until_first_token(e: &mut Engine, id: SeqId) -> u32 {
        let mut prefilled = 0;
        for _ in 0..1000 {
            let out = e.step();
            e.check_invariants();
            prefilled += out.shape.prefill_tokens;
            if out.tokens.iter().any(|t| t.id == id && t.index == 0) {
                return prefilled;
            }
        }
        panic!("no first token");
    }

    #[test]
    fn a_repeated_prompt_prefills_only_its_uncached_tail() {
        let mut e = Engine::new(params(1000));
        e.add_prompt(1, prompt(2000, 0), 2).unwrap();
        assert_eq!(prefill_until_first_token(&mut e, 1), 2000);
        drain(&mut e);
        // 125 full blocks are cached; vLLM reuses at most 1999 tokens = 124 whole blocks
        // and computes the rest so the last token yields logits.
        assert_eq!(e.cached_prefix_tokens(&prompt(2000, 0)), 1984);
        e.add_prompt(2, prompt(2000, 0), 2).unwrap();
        assert_eq!(prefill_until_first_token(&mut e, 2), 16);
        drain(&mut e);
        let stats = e.stats();
        assert_eq!(stats.prefix_cache_queries_total, 4000);
        assert_eq!(stats.prefix_cache_hits_total, 1984);
        assert_eq!(
            stats.prompt_tokens_total, 4000,
            "vLLM counts cached prompt tokens too"
        );
        assert_eq!(stats.used_blocks, 0);
        assert_eq!(stats.cached_blocks, 125);
    }

    #[test]
    fn prompts_share_their_common_full_blocks_only() {
        let mut e = Engine::new(params(1000));
        let a = prompt(100, 0);
        let mut b = a.clone();
        b[40] = 99_999; // inside block 2
        e.add_prompt(1, a, 1).unwrap();
        drain(&mut e);
        e.add_prompt(2, b, 1).unwrap();
        assert_eq!(prefill_until_first_token(&mut e, 2), 100 - 32);
        assert_eq!(e.stats().prefix_cache_hits_total, 32);
    }

    #[test]
    fn caching_off_reuses_nothing() {
        let mut p = params(1000);
        p.enable_prefix_caching = false;
        let mut e = Engine::with_kv_events(p, true);
        for id in 1..=2 {
            e.add_prompt(id, prompt(500, 0), 1).unwrap();
            assert_eq!(prefill_until_first_token(&mut e, id), 500);
        }
        assert_eq!(e.stats().prefix_cache_hits_total, 0);
        assert_eq!(e.stats().cached_blocks, 0);
        assert!(e.take_kv_events().is_empty());
    }

    #[test]
    fn running_sequences_share_blocks_by_reference() {
        let mut e = Engine::new(params(1000));
        e.add_prompt(1, prompt(64, 0), 50).unwrap();
        e.step();
        assert_eq!(e.stats().used_blocks, 4);
        e.add_prompt(2, prompt(64, 0), 50).unwrap();
        e.step();
        e.check_invariants();
        // The first grew by one block for its decode; the second holds the first's 3
        // reusable blocks by reference plus one block of its own.
        assert_eq!(e.stats().used_blocks, 4 + 1 + 1);
        assert_eq!(e.stats().prefix_cache_hits_total, 48);
        drain(&mut e);
    }

    #[test]
    fn memory_pressure_evicts_the_least_recently_used_prefix() {
        // 10 blocks; each prompt of 64 tokens + 1 output fills 4 full blocks + 1.
        let mut e = Engine::with_kv_events(params(10), true);
        e.add_prompt(1, prompt(64, 0), 1).unwrap();
        drain(&mut e);
        let stored = e.take_kv_events();
        assert!(
            matches!(&stored[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: None, token_ids, block_size: 16 }]
            if block_hashes.len() == 4 && token_ids.len() == 64)
        );
        e.add_prompt(2, prompt(64, 1), 1).unwrap();
        drain(&mut e);
        assert_eq!(
            e.cached_prefix_tokens(&prompt(64, 0)),
            48,
            "still cached while blocks are free"
        );
        e.add_prompt(3, prompt(64, 2), 1).unwrap();
        drain(&mut e);
        // The third needed blocks beyond the never-used ones: prompt 1's, tail first.
        let removed: Vec<u64> = e
            .take_kv_events()
            .into_iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockRemoved { block_hashes } => Some(block_hashes),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(!removed.is_empty());
        let hashes_1 = chain_hashes(&prompt(64, 0), 16, usize::MAX);
        assert!(
            removed.iter().all(|h| hashes_1.contains(h)),
            "prompt 2 and 3 are newer"
        );
        assert_eq!(removed[0], hashes_1[3], "the tail of a prompt goes first");
        assert!(e.cached_prefix_tokens(&prompt(64, 0)) < 48);
        assert_eq!(e.cached_prefix_tokens(&prompt(64, 2)), 48);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// With prompts that share prefixes, under any load and cache size: every sequence
        /// gets exactly its tokens, references and the free queue stay consistent, and
        /// the cache ends with nothing referenced.
        #[test]
        fn prefix_sharing_keeps_every_invariant(
            num_blocks in 4u32..40,
            max_num_seqs in 1u32..6,
            seqs in proptest::collection::vec((0u32..3, 1u32..70, 1u32..40, 0usize..6), 1..12),
        ) {
            let mut p = params(num_blocks);
            p.max_num_seqs = max_num_seqs;
            p.max_num_batched_tokens = max_num_seqs + 24;
            p.block_size = 4;
            let mut e = Engine::with_kv_events(p, true);
            let mut expected = HashMap::new();
            let mut pending: Vec<(SeqId, Vec<u32>, u32, usize)> = seqs
                .into_iter()
                .enumerate()
                .map(|(id, (family, len, out, delay))| (id as SeqId, prompt(len, family), out, delay))
                .collect();
            let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
            let mut step_no = 0usize;
            loop {
                pending.retain(|(id, tokens, out, delay)| {
                    if *delay > step_no {
                        return true;
                    }
                    if e.add_prompt(*id, tokens.clone(), *out).is_ok() {
                        expected.insert(*id, *out);
                    }
                    false
                });
                if pending.is_empty() && !e.has_work() {
                    break;
                }
                let out = e.step();
                e.check_invariants();
                for t in out.tokens {
                    got.entry(t.id).or_default().push(t.index);
                }
                step_no += 1;
                prop_assert!(step_no < 50_000, "engine livelocked");
            }
            for (id, out) in expected {
                prop_assert_eq!(&got[&id], &(0..out).collect::<Vec<_>>());
            }
            prop_assert!(e.step().is_idle());
            prop_assert_eq!(e.stats().used_blocks, 0);
            prop_assert!(e.stats().prefix_cache_hits_total <= e.stats().prefix_cache_queries_total);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the load and cache size, every sequence that fits gets exactly its
        /// tokens in order, block accounting holds at every step, and the cache drains.
        #[test]
        fn every_sequence_completes_exactly(
            num_blocks in 2u32..40,
            max_num_seqs in 1u32..8,
            budget_extra in 0u32..64,
            seqs in proptest::collection::vec((1u32..80, 1u32..60, 0usize..6), 1..12),
        ) {
            let mut p = params(num_blocks);
            p.max_num_seqs = max_num_seqs;
            p.max_num_batched_tokens = max_num_seqs + budget_extra;
            let mut e = Engine::new(p);
            let mut expected = HashMap::new();
            let mut pending: Vec<(SeqId, u32, u32, usize)> = Vec::new();
            for (id, (prompt, out, delay)) in seqs.into_iter().enumerate() {
                pending.push((id as SeqId, prompt, out, delay));
            }
            let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
            let mut step_no = 0usize;
            loop {
                // Staggered arrivals: a sequence arrives after `delay` steps.
                pending.retain(|&(id, prompt, out, delay)| {
                    if delay > step_no {
                        return true;
                    }
                    if e.add(id, prompt, out).is_ok() {
                        expected.insert(id, out);
                    }
                    false
                });
                if pending.is_empty() && !e.has_work() {
                    break;
                }
                let out = e.step();
                e.check_invariants();
                for t in out.tokens {
                    got.entry(t.id).or_default().push(t.index);
                    prop_assert_eq!(t.finished, t.index + 1 == expected[&t.id]);
                }
                step_no += 1;
                prop_assert!(step_no < 50_000, "engine livelocked");
            }
            for (id, out) in expected {
                prop_assert_eq!(&got[&id], &(0..out).collect::<Vec<_>>());
            }
            // The step after the last one retires its finished sequences.
            prop_assert!(e.step().is_idle());
            prop_assert_eq!(e.stats().used_blocks, 0);
            prop_assert_eq!(e.stats().running, 0);
        }
    }
}
