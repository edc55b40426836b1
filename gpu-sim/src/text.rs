//! Tokens without a tokenizer: how many tokens a prompt counts for, and which words a
//! simulated generation produces.
//!
//! - Prompt tokens are estimated as `ceil(chars / 4)` (OpenAI's rule of thumb for English),
//!   at least 1; a chat adds 4 tokens per message for the chat template's role headers.
//!   A prompt given as token ids counts exactly one token per id. Load generators that need
//!   an exact count send the extension field `metronome_prompt_tokens`, which wins. The
//!   rule lives in [`metronome_protocol::prefix`], which also gives the approximate token
//!   ids the prefix cache hashes, so the gateway's job fingerprints use the same tokens.
//! - Output is one vocabulary word per token, each with a leading space, drawn from a
//!   ChaCha8 stream seeded by the server's seed and the prompt: the same seed and prompt
//!   always give the same text, and the count of output tokens equals the count of words.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Chat-template overhead per message (role header and end-of-turn markers).
pub use metronome_protocol::prefix::CHAT_TOKENS_PER_MESSAGE;

/// Estimated tokens of a text: `ceil(chars / 4)`, at least 1 (the count of its approximate
/// token ids).
pub fn estimate_tokens(text: &str) -> u32 {
    u32::try_from(metronome_protocol::prefix::text_token_ids(text).len()).unwrap_or(u32::MAX)
}

/// The words a simulated generation draws from (each token is one, with a leading space).
pub const VOCABULARY: &[&str] = &[
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
    "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "token", "batch",
    "cache", "queue", "signal", "latency", "stream", "request", "worker", "steady", "tempo",
    "beat", "measure", "rhythm",
];

/// FNV-1a, to fold a prompt into the generator's seed without a hashing dependency whose
/// output could change between releases.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The deterministic word stream of one request.
pub struct TextGenerator {
    rng: ChaCha8Rng,
}

impl TextGenerator {
    pub fn new(seed: u64, prompt_key: &str) -> Self {
        TextGenerator {
            rng: ChaCha8Rng::seed_from_u64(seed ^ fnv1a(prompt_key.as_bytes())),
        }
    }

    /// The next token's text (a word with a leading space).
    pub fn next_token(&mut self) -> String {
        let word = VOCABULARY[self.rng.random_range(0..VOCABULARY.len())];
        format!(" {word}")
    }

    /// Number of tokens before an end-of-sequence when each token ends the sequence with
    /// probability `p` (geometric, at least 1), capped at `max_tokens`.
    pub fn sample_length(&mut self, p: f64, max_tokens: u32) -> u32 {
        if p <= 0.0 {
            return max_tokens;
        }
        for n in 1..max_tokens {
            if self.rng.random_bool(p.min(1.0)) {
                return n;
            }
        }
        max_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_four_chars_per_token() {
        assert_eq!(estimate_tokens(""), 1);
        assert_eq!(estimate_tokens("abc"), 1);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        assert_eq!(estimate_tokens(&"x".repeat(400)), 100);
    }

    #[test]
    fn same_seed_and_prompt_give_the_same_words() {
        let a: Vec<String> = {
            let mut g = TextGenerator::new(42, "hello");
            (0..20).map(|_| g.next_token()).collect()
        };
        let b: Vec<String> = {
            let mut g = TextGenerator::new(42, "hello");
            (0..20).map(|_| g.next_token()).collect()
        };
        let c: Vec<String> = {
            let mut g = TextGenerator::new(43, "hello");
            (0..20).map(|_| g.next_token()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|t| t.starts_with(' ') && t.len() > 1));
    }

    #[test]
    fn length_is_max_tokens_without_eos() {
        let mut g = TextGenerator::new(1, "");
        assert_eq!(g.sample_length(0.0, 77), 77);
        let n = g.sample_length(0.5, 77);
        assert!((1..=77).contains(&n));
        assert_eq!(g.sample_length(1.0, 77), 1);
    }
}
