//! The OpenAI API shapes the simulator reads and writes: chat and text completion requests,
//! responses, stream chunks, usage and the error body.
//!
//! Readers are tolerant (unknown fields are ignored, as by vLLM) so any OpenAI client works.
//! Extension: `metronome_prompt_tokens` sets the prompt's token count exactly, overriding
//! the estimate from the text, so a load generator can replay a trace exactly.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::text::{estimate_tokens, CHAT_TOKENS_PER_MESSAGE};

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints accept besides their prompt.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The chat API's newer name for `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub metronome_prompt_tokens: Option<u32>,
}

impl Common {
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    pub fn requested_max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    #[serde(default)]
    pub role: String,
    /// A string, an array of content parts, or null.
    #[serde(default)]
    pub content: Value,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Vec<ChatMessage>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    /// A string, a one-element array of strings, or an array of token ids.
    #[serde(default)]
    pub prompt: Value,
}

/// A prompt reduced to what the simulator needs: its token count and a key that seeds the
/// generated text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: u32,
    pub key: String,
}

/// Text of a chat message's content (string or text parts).
fn content_text(content: &Value) -> String {
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

impl ChatRequest {
    pub fn prompt(&self) -> Prompt {
        let mut key = String::new();
        let mut chars = 0u64;
        for m in &self.messages {
            let text = content_text(&m.content);
            chars += text.chars().count() as u64;
            key.push_str(&m.role);
            key.push('\n');
            key.push_str(&text);
            key.push('\n');
        }
        // Same rule as `estimate_tokens`, over all messages, plus the template's overhead.
        let estimated = chars.div_ceil(4).max(1)
            + u64::from(CHAT_TOKENS_PER_MESSAGE) * self.messages.len() as u64;
        Prompt {
            tokens: self
                .common
                .metronome_prompt_tokens
                .unwrap_or(estimated.min(u64::from(u32::MAX)) as u32),
            key,
        }
    }
}

impl CompletionRequest {
    /// The prompt, or a message saying why it is not one the simulator serves.
    pub fn prompt(&self) -> Result<Prompt, String> {
        let (estimated, key) = match &self.prompt {
            Value::String(s) => (estimate_tokens(s), s.clone()),
            Value::Null => (1, String::new()),
            Value::Array(items) if items.iter().all(Value::is_u64) => {
                (items.len().max(1) as u32, Value::Array(items.clone()).to_string())
            }
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                let s = items[0].as_str().unwrap_or_default();
                (estimate_tokens(s), s.to_string())
            }
            Value::Array(_) => {
                return Err("prompt must be a string, one string, or an array of token ids; batched prompts are not supported".into())
            }
            _ => return Err("prompt must be a string or an array of token ids".into()),
        };
        Ok(Prompt {
            tokens: self.common.metronome_prompt_tokens.unwrap_or(estimated),
            key,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// Which endpoint a response belongs to: decides the object names and choice shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// Identity shared by every chunk and the response of one request.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(kind: Kind, model: &str) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        ResponseMeta {
            kind,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            model: model.to_string(),
        }
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }

    /// A stream chunk carrying one token (`first` adds the assistant role for chat).
    pub fn token_chunk(&self, text: &str, first: bool, include_usage: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null})
            }
        };
        self.chunk(vec![choice], include_usage)
    }

    /// The chunk that closes the choice with its finish reason.
    pub fn finish_chunk(&self, finish_reason: &str, include_usage: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason})
            }
            Kind::Completion => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason})
            }
        };
        self.chunk(vec![choice], include_usage)
    }

    /// The final usage chunk of `stream_options.include_usage`: no choices, usage set.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id, "object": self.chunk_object(), "created": self.created,
            "model": self.model, "choices": [], "usage": usage,
        })
    }

    fn chunk(&self, choices: Vec<Value>, include_usage: bool) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.chunk_object(), "created": self.created,
            "model": self.model, "choices": choices,
        });
        if include_usage {
            // OpenAI sends `usage: null` on every chunk but the last when usage is asked for.
            v["usage"] = Value::Null;
        }
        v
    }

    /// The whole (non-streaming) response.
    pub fn response(&self, text: &str, finish_reason: &str, usage: Usage) -> Value {
        match self.kind {
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }],
                "usage": usage,
            }),
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}],
                "usage": usage,
            }),
        }
    }
}

/// `GET /v1/models` for a server with one model.
pub fn model_list(model: &str, created: u64, max_model_len: u32) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": model, "object": "model", "created": created, "owned_by": "metronome-gpu-sim",
            "root": model, "max_model_len": max_model_len,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_prompt_counts_content_and_template() {
        let r: ChatRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "abcdefgh"},
                {"role": "user", "content": [{"type": "text", "text": "abcd"}]},
            ],
        }))
        .unwrap();
        // ceil(12 / 4) + 2 * 4
        assert_eq!(r.prompt().tokens, 11);
    }

    #[test]
    fn extension_field_sets_prompt_tokens_exactly() {
        let r: CompletionRequest = serde_json::from_value(json!({
            "model": "m", "prompt": "hello", "metronome_prompt_tokens": 1234,
        }))
        .unwrap();
        assert_eq!(r.prompt().unwrap().tokens, 1234);
    }

    #[test]
    fn token_id_prompts_count_exactly() {
        let r: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": [1, 2, 3, 4, 5]})).unwrap();
        assert_eq!(r.prompt().unwrap().tokens, 5);
        let batched: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"]})).unwrap();
        assert!(batched.prompt().is_err());
    }

    #[test]
    fn max_completion_tokens_wins() {
        let r: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [], "max_tokens": 5, "max_completion_tokens": 7,
        }))
        .unwrap();
        assert_eq!(r.common.requested_max_tokens(), Some(7));
    }
}
