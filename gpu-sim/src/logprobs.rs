//! Log-probabilities of the simulated tokens, in the shapes vLLM and OpenAI answer with, so
//! a client (or the agent assembling a streamed response) can be tested against them.
//!
//! Asked for with `logprobs: true` and `top_logprobs: k` (0 to 20) on the chat endpoint, or
//! `logprobs: k` (0 to 20) on the completions endpoint. Each token gets a log-probability
//! in `(-1.5, 0]` and `k` alternatives (the sampled token first, then other vocabulary words,
//! strictly less likely), drawn from a stream of their own seeded by the server's seed and
//! the prompt: the same request always gets the same numbers, and asking for them never
//! changes the generated text.
//!
//! - Chat (OpenAI's shape): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
//!   [{"token", "logprob", "bytes"}]}]}`, `top_logprobs` holding `k` entries.
//! - Completions (the legacy shape): `{"tokens": [..], "token_logprobs": [..],
//!   "top_logprobs": [{token: logprob}], "text_offset": [..]}`, each `top_logprobs` entry
//!   holding `max(k, 1)` tokens (the sampled token always, as vLLM answers `logprobs: 0`),
//!   `text_offset` the characters of the choice's text before the token.
//!
//! A stream carries each token's entry on its own chunk, the arrays one element long and
//! `text_offset` counted from the start of the choice, so concatenating the chunks' arrays
//! gives the non-streamed response's.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};

use crate::response_kind::Kind;
use crate::text::VOCABULARY;

/// Most alternatives a request may ask for per token (vLLM's default `max_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Log-probabilities asked for: `top` alternatives per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobsRequest {
    pub top: u32,
}

/// One token's log-probability and its alternatives (the sampled token first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: String,
    pub logprob: f64,
    pub top: Vec<(String, f64)>,
}

/// The deterministic log-probability stream of one choice.
pub struct LogprobSampler {
    rng: ChaCha8Rng,
    alternatives: usize,
}

/// Folded into the seed so this stream never repeats the text generator's.
const STREAM_SALT: u64 = 0x6c6f_6770_726f_6273;

impl LogprobSampler {
    /// A sampler giving `alternatives` entries per token (the sampled one included).
    pub fn new(seed: u64, prompt_key: &str, choice: u32, alternatives: u32) -> Self {
        let key = crate::text::fnv1a(prompt_key.as_bytes());
        LogprobSampler {
            rng: ChaCha8Rng::seed_from_u64(
                seed ^ key ^ STREAM_SALT ^ u64::from(choice).rotate_left(32),
            ),
            alternatives: alternatives as usize,
        }
    }

    /// The log-probabilities of the next sampled `token`.
    pub fn next(&mut self, token: &str) -> TokenLogprobs {
        let logprob = -round(self.rng.random_range(0.0..1.5));
        let mut top = Vec::with_capacity(self.alternatives);
        if self.alternatives > 0 {
            top.push((token.to_string(), logprob));
        }
        let mut last = logprob;
        let mut word = self.rng.random_range(0..VOCABULARY.len());
        while top.len() < self.alternatives {
            word = (word + 1) % VOCABULARY.len();
            let text = format!(" {}", VOCABULARY[word]);
            if text == token {
                continue;
            }
            last = round(last - self.rng.random_range(0.25..1.25));
            top.push((text, last));
        }
        TokenLogprobs {
            token: token.to_string(),
            logprob,
            top,
        }
    }
}

/// Four decimals: readable numbers, still strictly ordered (each step is at least 0.25).
fn round(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn bytes(token: &str) -> Value {
    Value::from(token.as_bytes().to_vec())
}

/// The `logprobs` object of a choice holding `tokens`, the first starting `offset`
/// characters into the choice's text.
pub fn render(kind: Kind, tokens: &[TokenLogprobs], offset: usize) -> Value {
    match kind {
        Kind::Chat => {
            let content: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let top: Vec<Value> = t
                        .top
                        .iter()
                        .map(|(tok, lp)| json!({"token": tok, "logprob": lp, "bytes": bytes(tok)}))
                        .collect();
                    json!({"token": t.token, "logprob": t.logprob, "bytes": bytes(&t.token), "top_logprobs": top})
                })
                .collect();
            json!({"content": content})
        }
        Kind::Completion => {
            let mut offsets = Vec::with_capacity(tokens.len());
            let mut at = offset;
            for t in tokens {
                offsets.push(at);
                at += t.token.chars().count();
            }
            let top: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut m = Map::new();
                    for (tok, lp) in &t.top {
                        m.insert(tok.clone(), json!(lp));
                    }
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternatives_start_with_the_sampled_token_and_fall_strictly() {
        let mut s = LogprobSampler::new(7, "prompt", 0, 5);
        for token in [" the", " model", " rhythm"] {
            let t = s.next(token);
            assert!(t.logprob <= 0.0 && t.logprob > -1.5, "{t:?}");
            assert_eq!(t.top.len(), 5);
            assert_eq!(t.top[0], (token.to_string(), t.logprob));
            assert!(t.top.windows(2).all(|w| w[1].1 < w[0].1), "{t:?}");
            let mut names: Vec<&str> = t.top.iter().map(|(n, _)| n.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), 5, "distinct alternatives: {t:?}");
        }
    }

    #[test]
    fn the_same_request_gets_the_same_numbers() {
        let run = |choice| {
            let mut s = LogprobSampler::new(7, "prompt", choice, 2);
            (0..10).map(|_| s.next(" a")).collect::<Vec<_>>()
        };
        assert_eq!(run(0), run(0));
        assert_ne!(run(0), run(1));
    }

    #[test]
    fn completion_offsets_count_the_characters_before_each_token() {
        let mut s = LogprobSampler::new(1, "", 0, 1);
        let tokens = vec![s.next(" ab"), s.next(" c")];
        let v = render(Kind::Completion, &tokens, 4);
        assert_eq!(v["text_offset"], json!([4, 7]));
        assert_eq!(v["tokens"], json!([" ab", " c"]));
        assert_eq!(v["top_logprobs"][0].as_object().unwrap().len(), 1);
        let chat = render(Kind::Chat, &tokens, 0);
        assert_eq!(chat["content"][1]["token"], " c");
        assert_eq!(chat["content"][1]["bytes"], json!([32, 99]));
    }
}
