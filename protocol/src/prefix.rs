//! Prompt prefixes as a model server's prefix cache sees them: the prompt's token ids, cut
//! into full KV blocks, each block named by a hash chained from the start of the prompt.
//!
//! The chain follows vLLM's automatic prefix caching (`vllm/v1/core/kv_cache_utils.py`,
//! `hash_block_tokens`): only *full* blocks of `block_size` tokens are hashed, and a block's
//! hash covers its parent's hash and its own token ids, so one hash names the whole prefix up
//! to the end of its block. Two prompts share a cached block exactly when they share every
//! token up to the end of that block.
//!
//! vLLM's own hash (SHA-256 of a pickled or CBOR-encoded tuple, seeded per process) cannot be
//! reproduced outside the server, so Metronome uses its own fixed, documented chain
//! ([`hash_block`]); a consumer of a server's KV events recomputes it from the token ids the
//! events carry. The simulator (`metronome-gpu-sim`) uses this same chain for its cache, so a
//! job's [`PrefixFingerprint`] matches the simulator's blocks exactly.
//!
//! # Token ids without a tokenizer
//!
//! Where a request gives token ids (a completion prompt as an array of ids) they are used as
//! they are. Otherwise the text is tokenised approximately, by the rule the simulator counts
//! prompt tokens with (OpenAI's rule of thumb of 4 characters per token):
//!
//! - A text is cut into runs of 4 characters (the last one may be shorter); each run is one
//!   token whose id is a hash of its characters ([`text_token_ids`]). Same text, same ids.
//! - A chat is rendered as a Llama-3-like template: each message opens with 4 header tokens
//!   (start-of-header, the role, end-of-header, separator), then its content. The 4-character
//!   runs continue across messages (a run may hold the end of one message and the start of
//!   the next), so the count is `ceil(chars of all contents / 4) + 4 per message`, exactly
//!   the simulator's prompt-token count. A chat that re-sends its history therefore
//!   reproduces the history's tokens up to its last partial run, as a real tokenizer does.
//! - Content given as parts counts the text parts, joined by one space.
//! - `metronome_prompt_tokens: N` (the load generator's exact count) cuts the ids to `N`,
//!   or extends them with padding tokens derived from the ids themselves, so two requests
//!   with the same text and the same `N` have the same tokens and different texts diverge.
//!
//! Against a real model server the approximation decides only which requests are *likely*
//! to share a cached prefix (same system prompt, same history); exact matching there comes
//! from the server's KV events.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::endpoint::Endpoint;

/// One KV block's hash, covering every token from the start of the prompt to its end.
pub type BlockHash = u64;

/// Tokens per KV block: vLLM's default `block_size` on CUDA GPUs.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Most blocks a fingerprint carries: 256 blocks of 16 tokens = the first 4,096 tokens. A
/// multi-turn conversation passes 2,000 tokens within a few turns; beyond 4,096 the shared
/// part is almost always a whole earlier prompt, whose first 4,096 tokens already identify
/// it. Bounded so a job stays small (≈ 4.6 KB of hashes at most).
pub const MAX_FINGERPRINT_BLOCKS: usize = 256;

/// Estimated characters per token (OpenAI's rule of thumb for English text).
pub const CHARS_PER_TOKEN: usize = 4;

/// Template tokens per chat message (header and separators).
pub const CHAT_TOKENS_PER_MESSAGE: u32 = 4;

/// Ids of ordinary text tokens are below this (Llama-3's 128,000 regular tokens); the
/// template's tokens use the special ids above it.
pub const TEXT_VOCABULARY: u32 = 128_000;
/// Stands in for an empty prompt (a server always prefills at least its start token).
pub const EMPTY_PROMPT_TOKEN: u32 = 128_000;
const START_HEADER_TOKEN: u32 = 128_006;
const END_HEADER_TOKEN: u32 = 128_007;
const HEADER_SEPARATOR_TOKEN: u32 = 128_008;

/// The parent "hash" of a prompt's first block (vLLM's `NONE_HASH` plays this role).
const ROOT_HASH: BlockHash = 0x6d65_7472_6f6e_6f6d; // "metronom"

fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    let mut h = state;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// SplitMix64's finaliser: spreads FNV's weak low bits over the whole word.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash of one full block: FNV-1a 64 over the parent's hash (8 bytes, little-endian;
/// the first block's parent is a fixed root) followed by the block's token ids (4 bytes
/// each, little-endian), then SplitMix64's finaliser.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = fnv1a(FNV_OFFSET, &parent.unwrap_or(ROOT_HASH).to_le_bytes());
    for t in tokens {
        h = fnv1a(h, &t.to_le_bytes());
    }
    mix(h)
}

/// The chained hashes of the first `max_blocks` full blocks of `tokens` (a partial last
/// block is never hashed: vLLM caches only full blocks).
pub fn chain_hashes(tokens: &[u32], block_size: u32, max_blocks: usize) -> Vec<BlockHash> {
    let block_size = block_size.max(1) as usize;
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .take(max_blocks)
        .map(|block| {
            let h = hash_block(parent, block);
            parent = Some(h);
            h
        })
        .collect()
}

/// The id of one text token (a run of at most 4 characters).
fn text_token_id(run: &str) -> u32 {
    (mix(fnv1a(FNV_OFFSET, run.as_bytes())) % u64::from(TEXT_VOCABULARY)) as u32
}

/// Cuts a character stream into 4-character runs, one token each.
#[derive(Default)]
struct RunTokenizer {
    run: String,
    chars: usize,
    seen_any: bool,
}

impl RunTokenizer {
    fn push_text(&mut self, text: &str, out: &mut Vec<u32>) {
        for c in text.chars() {
            self.run.push(c);
            self.chars += 1;
            self.seen_any = true;
            if self.chars == CHARS_PER_TOKEN {
                out.push(text_token_id(&self.run));
                self.run.clear();
                self.chars = 0;
            }
        }
    }

    fn finish(self, out: &mut Vec<u32>) {
        if self.chars > 0 {
            out.push(text_token_id(&self.run));
        }
        if !self.seen_any {
            out.push(EMPTY_PROMPT_TOKEN);
        }
    }
}

/// Approximate token ids of a text: one token per 4 characters, at least one.
pub fn text_token_ids(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / CHARS_PER_TOKEN + 1);
    let mut tokenizer = RunTokenizer::default();
    tokenizer.push_text(text, &mut out);
    tokenizer.finish(&mut out);
    out
}

/// Approximate token ids of a chat (role, content text) as the template renders it: 4 header
/// tokens per message, the contents' characters in 4-character runs across messages, at
/// least one content token.
pub fn chat_token_ids<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u32> {
    let mut out = Vec::new();
    let mut tokenizer = RunTokenizer::default();
    for (role, content) in messages {
        out.extend([
            START_HEADER_TOKEN,
            text_token_id(role),
            END_HEADER_TOKEN,
            HEADER_SEPARATOR_TOKEN,
        ]);
        tokenizer.push_text(content, &mut out);
    }
    tokenizer.finish(&mut out);
    out
}

/// The text of a chat message's `content`: a string, or the text parts joined by one
/// space; anything else is empty.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// Cut `tokens` to exactly `count` (at least 1), extending a shorter prompt with padding
/// tokens derived from the prompt's own ids (same prompt, same padding).
pub fn fit_to_count(mut tokens: Vec<u32>, count: u32) -> Vec<u32> {
    let count = count.max(1) as usize;
    if tokens.len() >= count {
        tokens.truncate(count);
        return tokens;
    }
    let mut seed = FNV_OFFSET;
    for t in &tokens {
        seed = fnv1a(seed, &t.to_le_bytes());
    }
    let mut i = tokens.len() as u64;
    tokens.resize_with(count, || {
        i += 1;
        (mix(seed ^ i) % u64::from(TEXT_VOCABULARY)) as u32
    });
    tokens
}

/// Why a request body has no token ids here (the request itself may still be valid: a
/// batched completion, say, has several prompts and no single prefix).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("`messages` must be an array")]
    Messages,
    #[error("prompt must be a string, one string, or an array of token ids; batched prompts have no single prefix")]
    Prompt,
    #[error("token id {0} is larger than any vocabulary (ids are unsigned 32-bit)")]
    TokenId(u64),
}

/// The prompt's token ids as the model server would see them, from an OpenAI request body
/// (see the module documentation for the approximation). `metronome_prompt_tokens`, when
/// present, fixes the count.
pub fn request_token_ids(endpoint: Endpoint, body: &Value) -> Result<Vec<u32>, PromptError> {
    let tokens = match endpoint {
        Endpoint::Chat => {
            let messages = match body.get("messages") {
                Some(Value::Array(m)) => m,
                None | Some(Value::Null) => &Vec::new(),
                Some(_) => return Err(PromptError::Messages),
            };
            let rendered: Vec<(&str, String)> = messages
                .iter()
                .map(|m| {
                    (
                        m.get("role").and_then(Value::as_str).unwrap_or_default(),
                        content_text(m.get("content").unwrap_or(&Value::Null)),
                    )
                })
                .collect();
            chat_token_ids(rendered.iter().map(|(r, c)| (*r, c.as_str())))
        }
        // An embedding's `input` takes the shapes of a completion's `prompt`.
        Endpoint::Completion | Endpoint::Embedding => {
            match body.get(endpoint.prompt_field()).unwrap_or(&Value::Null) {
                Value::String(s) => text_token_ids(s),
                Value::Null => vec![EMPTY_PROMPT_TOKEN],
                Value::Array(items) if items.iter().all(Value::is_u64) => {
                    let mut ids = Vec::with_capacity(items.len());
                    for item in items {
                        let id = item.as_u64().unwrap_or_default();
                        ids.push(u32::try_from(id).map_err(|_| PromptError::TokenId(id))?);
                    }
                    if ids.is_empty() {
                        ids.push(EMPTY_PROMPT_TOKEN);
                    }
                    ids
                }
                Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                    text_token_ids(items[0].as_str().unwrap_or_default())
                }
                _ => return Err(PromptError::Prompt),
            }
        }
    };
    Ok(
        match body.get("metronome_prompt_tokens").and_then(Value::as_u64) {
            Some(n) => fit_to_count(tokens, u32::try_from(n).unwrap_or(u32::MAX)),
            None => tokens,
        },
    )
}

/// A job's prompt prefix: the chained hashes of its first full KV blocks, as a model
/// server with prefix caching would name them. A worker whose cache holds the first `k`
/// of these blocks skips the prefill of `k * block_size` tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixFingerprint {
    /// Tokens per block the hashes were computed with.
    pub block_size: u32,
    /// Prompt tokens the fingerprint was computed from (exact for token-id prompts,
    /// approximate for text): the hashes cover `min(tokens / block_size, 256)` blocks.
    pub tokens: u32,
    /// Block hashes in prompt order, each as 16 lower-case hex digits (JSON numbers above
    /// 2^53 lose precision in many JSON libraries).
    #[serde(
        serialize_with = "serialize_hashes",
        deserialize_with = "deserialize_hashes"
    )]
    pub hashes: Vec<BlockHash>,
}

impl PrefixFingerprint {
    /// The fingerprint of a prompt's token ids.
    pub fn of_tokens(tokens: &[u32], block_size: u32) -> Self {
        PrefixFingerprint {
            block_size,
            tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            hashes: chain_hashes(tokens, block_size, MAX_FINGERPRINT_BLOCKS),
        }
    }

    /// The fingerprint of an OpenAI request body with vLLM's default block size, or `None`
    /// when the body has no single prompt (see [`request_token_ids`]).
    pub fn of_request(endpoint: Endpoint, body: &Value) -> Option<Self> {
        request_token_ids(endpoint, body)
            .ok()
            .map(|tokens| Self::of_tokens(&tokens, DEFAULT_BLOCK_SIZE))
    }

    /// Leading blocks of this fingerprint found by `is_cached`, stopping at the first miss
    /// (a chain: a block is reusable only if every block before it is).
    pub fn matched_blocks(&self, mut is_cached: impl FnMut(BlockHash) -> bool) -> usize {
        self.hashes.iter().take_while(|h| is_cached(**h)).count()
    }
}

fn serialize_hashes<S: Serializer>(hashes: &[BlockHash], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(hashes.iter().map(|h| format!("{h:016x}")))
}

fn deserialize_hashes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockHash>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    if texts.len() > MAX_FINGERPRINT_BLOCKS {
        return Err(serde::de::Error::custom(format!(
            "a prefix fingerprint has at most {MAX_FINGERPRINT_BLOCKS} hashes, this one {}",
            texts.len()
        )));
    }
    texts
        .iter()
        .map(|t| {
            if t.len() != 16 {
                return Err(serde::de::Error::custom(format!(
                    "block hash {t:?} is not 16 hex digits"
                )));
            }
            u64::from_str_radix(t, 16).map_err(|_| {
                serde::de::Error::custom(format!("block hash {t:?} is not 16 hex digits"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(messages: &[(&str, &str)]) -> Value {
        json!({"model": "m", "messages": messages.iter()
            .map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>()})
    }

    #[test]
    fn counts_follow_four_chars_per_token() {
        assert_eq!(text_token_ids("").len(), 1);
        assert_eq!(text_token_ids("abcd").len(), 1);
        assert_eq!(text_token_ids("abcde").len(), 2);
        assert_eq!(text_token_ids(&"x".repeat(400)).len(), 100);
        // ceil(12 / 4) + 2 * 4, runs crossing the message boundary.
        let ids = chat_token_ids([("system", "abcdef"), ("user", "ghijkl")]);
        assert_eq!(ids.len(), 11);
        assert_eq!(chat_token_ids([("user", "")]).len(), 5);
    }

    #[test]
    fn a_chat_that_resends_its_history_keeps_the_history_tokens() {
        let turn1 = [
            ("system", "You are terse."),
            ("user", "What is a KV cache, really?"),
        ];
        let turn2 = [
            turn1[0],
            turn1[1],
            ("assistant", "Attention keys and values."),
            ("user", "And a block?"),
        ];
        let a = chat_token_ids(turn1);
        let b = chat_token_ids(turn2);
        // Everything but the last (partial) run of the first turn is a prefix of the second.
        assert_eq!(a[..a.len() - 1], b[..a.len() - 1]);
    }

    #[test]
    fn the_chain_names_the_whole_prefix() {
        let tokens: Vec<u32> = (0..100).collect();
        let hashes = chain_hashes(&tokens, 16, 256);
        assert_eq!(hashes.len(), 6, "only full blocks");
        let mut other = tokens.clone();
        other[40] = 7; // inside block 2
        let changed = chain_hashes(&other, 16, 256);
        assert_eq!(hashes[..2], changed[..2]);
        assert!(hashes[2..].iter().zip(&changed[2..]).all(|(a, b)| a != b));
        assert_eq!(chain_hashes(&tokens, 16, 3), hashes[..3]);
        // The same block after a different parent is a different block.
        assert_ne!(hash_block(None, &tokens[16..32]), hashes[1]);
    }

    #[test]
    fn the_hash_is_fixed() {
        // Direct NATS clients compute this chain themselves (docs/PROTOCOL.md): it must
        // never change silently.
        // Reproduced independently (a 12-line Python script of the documented rule).
        assert_eq!(
            format!("{:016x}", hash_block(None, &[])),
            "cac9119623abbe9a"
        );
        let tokens: Vec<u32> = (0..32).collect();
        let chain: Vec<String> = chain_hashes(&tokens, 16, 2)
            .iter()
            .map(|h| format!("{h:016x}"))
            .collect();
        assert_eq!(chain, ["a8531d8ec4fbf5ac", "ba8c183dcde9bc05"]);
    }

    #[test]
    fn token_id_prompts_are_exact_and_the_count_override_pads_deterministically() {
        let body = json!({"prompt": [5, 6, 7]});
        assert_eq!(
            request_token_ids(Endpoint::Completion, &body).unwrap(),
            vec![5, 6, 7]
        );
        let padded = json!({"prompt": "hello world", "metronome_prompt_tokens": 40});
        let a = request_token_ids(Endpoint::Completion, &padded).unwrap();
        assert_eq!(a.len(), 40);
        assert_eq!(a, request_token_ids(Endpoint::Completion, &padded).unwrap());
        let other = json!({"prompt": "hello there", "metronome_prompt_tokens": 40});
        let b = request_token_ids(Endpoint::Completion, &other).unwrap();
        // "hell" is shared; "o wo" / "o th" and everything after differ.
        assert_eq!(a[0], b[0]);
        assert!(a[1..].iter().zip(&b[1..]).all(|(x, y)| x != y));
        let cut = json!({"prompt": "x".repeat(100), "metronome_prompt_tokens": 3});
        assert_eq!(
            request_token_ids(Endpoint::Completion, &cut).unwrap().len(),
            3
        );
        let batched = json!({"prompt": ["a", "b"]});
        assert_eq!(
            request_token_ids(Endpoint::Completion, &batched),
            Err(PromptError::Prompt)
        );
        let huge = json!({"prompt": [1, 5_000_000_000u64]});
        assert_eq!(
            request_token_ids(Endpoint::Completion, &huge),
            Err(PromptError::TokenId(5_000_000_000))
        );
    }

    #[test]
    fn fingerprints_are_bounded_and_round_trip_as_hex() {
        let long = chat(&[("user", &"y".repeat(4 * 16 * 300))]);
        let f = PrefixFingerprint::of_request(Endpoint::Chat, &long).unwrap();
        assert_eq!(f.hashes.len(), MAX_FINGERPRINT_BLOCKS);
        assert_eq!(f.tokens, 4 + 16 * 300);
        let text = serde_json::to_string(&f).unwrap();
        assert!(text.contains(&format!("\"{:016x}\"", f.hashes[0])));
        let back: PrefixFingerprint = serde_json::from_str(&text).unwrap();
        assert_eq!(back, f);
        let bad = json!({"block_size": 16, "tokens": 1, "hashes": ["xyz"]});
        assert!(serde_json::from_value::<PrefixFingerprint>(bad).is_err());
    }

    #[test]
    fn matching_stops_at_the_first_missing_block() {
        let f = PrefixFingerprint::of_tokens(&(0..64).collect::<Vec<_>>(), 16);
        let cached = [f.hashes[0], f.hashes[1], f.hashes[3]];
        assert_eq!(f.matched_blocks(|h| cached.contains(&h)), 2);
    }
}
