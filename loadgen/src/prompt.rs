//! Request bodies: a prompt of about N tokens and the OpenAI-compatible JSON around it.
//!
//! The prompt is N space-separated common English words, each one token in typical BPE
//! tokenisers (GPT-2/cl100k/Llama/Qwen vocabularies all hold " the", " one", …), so a real
//! model server sees close to N prompt tokens. A chat template adds a few tokens of its own.
//! With `unique` set, the first words spell the run nonce and the request id as digit words
//! ("seven four …"), so two prompts never share a prefix and a prefix cache cannot turn one
//! request's prefill into a free hit for the next.
//!
//! Because token counts of text are only approximate, the body also carries the exact
//! intended count as `"metronome_prompt_tokens": N`. Real OpenAI-compatible servers ignore
//! unknown fields; Metronome's gateway and GPU simulator use it for exact replay. The output
//! length is fixed with `max_tokens = M` plus vLLM's `"ignore_eos": true`, so a real server
//! also generates exactly M tokens. Both extensions are dropped with `extensions = false`.

use serde_json::{json, Value};

use crate::prefixes::message_text;
use crate::request::Message;
use crate::spec::Endpoint;

/// Body field carrying the intended prompt length in tokens.
pub const FIELD_PROMPT_TOKENS: &str = "metronome_prompt_tokens";

const DIGITS: [&str; 10] = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
];

const FILLER: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their",
];

/// A prompt of exactly `tokens` words (at least one). Built straight into one string:
/// bursts of long prompts are built on the sending path.
pub fn prompt_text(tokens: u32, unique: bool, nonce: u64, id: u64) -> String {
    fn push(out: &mut String, words: &mut usize, w: &str) {
        if *words > 0 {
            out.push(' ');
        }
        out.push_str(w);
        *words += 1;
    }
    let n = tokens.max(1) as usize;
    let mut out = String::with_capacity(n * 5);
    let mut words = 0;
    if unique {
        for part in [nonce, id] {
            for d in part.to_string().bytes() {
                if words < n {
                    push(&mut out, &mut words, DIGITS[usize::from(d - b'0')]);
                }
            }
        }
    }
    let mut i = 0;
    while words < n {
        push(&mut out, &mut words, FILLER[i % FILLER.len()]);
        i += 1;
    }
    out
}

/// What one request asks for.
#[derive(Debug, Clone, Copy)]
pub struct BodyParams<'a> {
    pub endpoint: Endpoint,
    pub model: &'a str,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub extensions: bool,
    pub unique: bool,
    pub nonce: u64,
    pub id: u64,
    /// The chat of a prefix-heavy workload ([`crate::prefixes`]); empty: one user message
    /// of `prompt_tokens` filler words. Its texts start with the nonce when `unique` is
    /// set (so runs do not share a cache), never with the request id (so requests do).
    pub messages: &'a [Message],
}

/// The JSON body of one streaming request.
pub fn request_body(p: &BodyParams<'_>) -> Value {
    let mut body = if p.messages.is_empty() {
        let text = prompt_text(p.prompt_tokens, p.unique, p.nonce, p.id);
        match p.endpoint {
            Endpoint::Chat => json!({
                "model": p.model,
                "messages": [{"role": "user", "content": text}],
            }),
            Endpoint::Completions => json!({
                "model": p.model,
                "prompt": text,
            }),
        }
    } else {
        let nonce = p.unique.then_some(p.nonce);
        let texts = p
            .messages
            .iter()
            .map(|m| (m.role.as_str(), message_text(m, nonce)));
        match p.endpoint {
            Endpoint::Chat => json!({
                "model": p.model,
                "messages": texts
                    .map(|(role, content)| json!({"role": role, "content": content}))
                    .collect::<Vec<_>>(),
            }),
            // No chat template: the contents one after the other.
            Endpoint::Completions => json!({
                "model": p.model,
                "prompt": texts.map(|(_, t)| t).collect::<String>(),
            }),
        }
    };
    let obj = body.as_object_mut().expect("body is an object");
    obj.insert("max_tokens".into(), json!(p.max_tokens));
    obj.insert("stream".into(), json!(true));
    obj.insert("stream_options".into(), json!({"include_usage": true}));
    if p.extensions {
        obj.insert("ignore_eos".into(), json!(true));
        obj.insert(FIELD_PROMPT_TOKENS.into(), json!(p.prompt_tokens));
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_has_exactly_n_words() {
        for n in [1, 2, 5, 17, 1500] {
            assert_eq!(
                prompt_text(n, true, 123_456, 42).split(' ').count(),
                n as usize
            );
            assert_eq!(prompt_text(n, false, 0, 0).split(' ').count(), n as usize);
        }
        assert_eq!(prompt_text(0, false, 0, 0), "the");
    }

    #[test]
    fn unique_prompts_differ_at_the_start() {
        let a = prompt_text(100, true, 9, 1);
        let b = prompt_text(100, true, 9, 2);
        assert!(a.starts_with("nine one "));
        assert!(b.starts_with("nine two "));
        assert_eq!(prompt_text(100, false, 9, 1), prompt_text(100, false, 9, 2));
    }

    #[test]
    fn bodies_stream_and_carry_extensions() {
        let p = BodyParams {
            endpoint: Endpoint::Chat,
            model: "m",
            prompt_tokens: 10,
            max_tokens: 7,
            extensions: true,
            unique: false,
            nonce: 0,
            id: 0,
            messages: &[],
        };
        let b = request_body(&p);
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(b["max_tokens"], json!(7));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b[FIELD_PROMPT_TOKENS], json!(10));
        assert_eq!(b["messages"][0]["role"], json!("user"));
        let c = request_body(&BodyParams {
            endpoint: Endpoint::Completions,
            extensions: false,
            ..p
        });
        assert!(c["prompt"].is_string());
        assert!(c.get("ignore_eos").is_none());
        assert!(c.get(FIELD_PROMPT_TOKENS).is_none());
    }
}
