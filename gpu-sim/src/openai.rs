//! The OpenAI API shapes the simulator reads and writes: chat and text completion requests,
//! responses, stream chunks, usage and the error body.
//!
//! Readers are tolerant (unknown fields are ignored, as by vLLM) so any OpenAI client works.
//! Extension: `metronome_prompt_tokens` sets the prompt's token count exactly, overriding
//! the estimate from the text, so a load generator can replay a trace exactly.
//!
//! A prompt's token ids (what the prefix cache hashes) come from
//! [`metronome_protocol::prefix`]: exact for token-id prompts, else its approximate
//! tokenisation of the text (4 characters per token, 4 template tokens per chat message),
//! the same the gateway fingerprints jobs with, so a job's fingerprint names exactly the
//! blocks this simulator caches for it.

use metronome_protocol::prefix::EMPTY_PROMPT_TOKEN;
use metronome_protocol::prefix::{chat_token_ids, content_text, fit_to_count, text_token_ids};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::choice::{Choice, ForcedTool};
use crate::logprobs::{LogprobsRequest, MAX_TOP_LOGPROBS};
pub use crate::response_kind::Kind;

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: u32 = 16;

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
    /// Chat: a boolean; completions: how many alternatives per token
    /// ([`Common::logprobs_request`]).
    #[serde(default)]
    pub logprobs: Value,
    /// Chat: alternatives per token (needs `logprobs: true`).
    #[serde(default)]
    pub top_logprobs: Value,
    /// A stop sequence or a list of them ([`Common::stop_sequences`]).
    #[serde(default)]
    pub stop: Value,
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

    /// Choices to generate (`n`, 1 to [`MAX_CHOICES`]).
    pub fn choices(&self) -> Result<u32, (String, &'static str)> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES).contains(&n) => Ok(n),
            Some(_) => Err((format!("`n` must be from 1 to {MAX_CHOICES}"), "n")),
        }
    }

    /// The stop sequences: `stop` as a string or a list of up to 4 non-empty strings.
    pub fn stop_sequences(&self) -> Result<Vec<String>, (String, &'static str)> {
        let invalid = || {
            (
                "`stop` must be a string or a list of at most 4 non-empty strings".to_string(),
                "stop",
            )
        };
        match &self.stop {
            Value::Null => Ok(Vec::new()),
            Value::String(s) if !s.is_empty() => Ok(vec![s.clone()]),
            Value::Array(items) if items.len() <= 4 => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .ok_or_else(invalid)
                })
                .collect(),
            _ => Err(invalid()),
        }
    }

    /// The log-probabilities asked for, if any: `logprobs: true` with `top_logprobs: k` on
    /// the chat endpoint, `logprobs: k` on the completions endpoint. Anything else is
    /// refused with a message and the field at fault, as vLLM refuses it.
    pub fn logprobs_request(
        &self,
        kind: Kind,
    ) -> Result<Option<LogprobsRequest>, (String, &'static str)> {
        let count = |v: &Value, field: &'static str| match v {
            Value::Null => Ok(None),
            v => v
                .as_u64()
                .filter(|k| *k <= u64::from(MAX_TOP_LOGPROBS))
                .map(|k| Some(k as u32))
                .ok_or_else(|| {
                    (
                        format!("`{field}` must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                        field,
                    )
                }),
        };
        match kind {
            Kind::Chat => {
                let wanted = match &self.logprobs {
                    Value::Null => false,
                    Value::Bool(b) => *b,
                    _ => return Err(("`logprobs` must be a boolean".into(), "logprobs")),
                };
                let top = count(&self.top_logprobs, "top_logprobs")?;
                match (wanted, top) {
                    (true, top) => Ok(Some(LogprobsRequest {
                        top: top.unwrap_or(0),
                    })),
                    (false, Some(_)) => Err((
                        "`top_logprobs` needs `logprobs: true`".into(),
                        "top_logprobs",
                    )),
                    (false, None) => Ok(None),
                }
            }
            Kind::Completion => {
                Ok(count(&self.logprobs, "logprobs")?.map(|k| LogprobsRequest { top: k.max(1) }))
            }
        }
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
    /// Functions the model may call: `[{"type": "function", "function": {"name",
    /// "parameters"}}]`.
    #[serde(default)]
    pub tools: Value,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`.
    #[serde(default)]
    pub tool_choice: Value,
}

impl ChatRequest {
    /// The function the request makes the model call, if it makes it call one
    /// ([`crate::choice`]): `required` calls the first tool, a named choice that tool.
    pub fn forced_tool(&self) -> Result<Option<ForcedTool>, (String, &'static str)> {
        let tools: Vec<ForcedTool> = match &self.tools {
            Value::Null => Vec::new(),
            Value::Array(items) => items
                .iter()
                .map(|t| {
                    let f = &t["function"];
                    match f.get("name").and_then(Value::as_str) {
                        Some(name) if !name.is_empty() => Ok(ForcedTool {
                            name: name.to_string(),
                            parameters: f.get("parameters").cloned().unwrap_or(Value::Null),
                        }),
                        _ => Err(("each tool needs `function.name`".to_string(), "tools")),
                    }
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(("`tools` must be a list".into(), "tools")),
        };
        let named = |name: &str| {
            tools
                .iter()
                .find(|t| t.name == name)
                .cloned()
                .map(Some)
                .ok_or_else(|| {
                    (
                        format!("`tool_choice` names `{name}`, which is not among `tools`"),
                        "tool_choice",
                    )
                })
        };
        match &self.tool_choice {
            Value::Null => Ok(None),
            Value::String(c) if c == "none" || c == "auto" => Ok(None),
            Value::String(c) if c == "required" => match tools.first() {
                Some(t) => Ok(Some(t.clone())),
                None => Err((
                    "`tool_choice: required` needs `tools`".into(),
                    "tool_choice",
                )),
            },
            Value::Object(_) => match self.tool_choice["function"]["name"].as_str() {
                Some(name) => named(name),
                None => Err(("`tool_choice` needs `function.name`".into(), "tool_choice")),
            },
            _ => Err((
                "`tool_choice` must be `none`, `auto`, `required` or a named function".into(),
                "tool_choice",
            )),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    /// A string, a one-element array of strings, or an array of token ids.
    #[serde(default)]
    pub prompt: Value,
}

/// A prompt reduced to what the simulator needs: its token ids (their count is the
/// prompt's token count) and a key that seeds the generated text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: u32,
    pub token_ids: Vec<u32>,
    pub key: String,
}

impl Prompt {
    fn new(token_ids: Vec<u32>, count: Option<u32>, key: String) -> Prompt {
        let token_ids = match count {
            Some(n) => fit_to_count(token_ids, n),
            None => token_ids,
        };
        Prompt {
            tokens: u32::try_from(token_ids.len()).unwrap_or(u32::MAX),
            token_ids,
            key,
        }
    }
}

impl ChatRequest {
    pub fn prompt(&self) -> Prompt {
        let mut key = String::new();
        let mut rendered = Vec::with_capacity(self.messages.len());
        for m in &self.messages {
            let text = content_text(&m.content);
            key.push_str(&m.role);
            key.push('\n');
            key.push_str(&text);
            key.push('\n');
            rendered.push((m.role.as_str(), text));
        }
        // ceil(chars of all contents / 4) (at least 1) plus the template's 4 per message.
        let ids = chat_token_ids(rendered.iter().map(|(r, t)| (*r, t.as_str())));
        Prompt::new(ids, self.common.metronome_prompt_tokens, key)
    }
}

impl CompletionRequest {
    /// The prompt, or a message saying why it is not one the simulator serves.
    pub fn prompt(&self) -> Result<Prompt, String> {
        let (ids, key) = match &self.prompt {
            Value::String(s) => (text_token_ids(s), s.clone()),
            Value::Null => (vec![EMPTY_PROMPT_TOKEN], String::new()),
            Value::Array(items) if items.iter().all(Value::is_u64) => {
                let mut ids = Vec::with_capacity(items.len().max(1));
                for item in items {
                    let id = item.as_u64().unwrap_or_default();
                    ids.push(u32::try_from(id).map_err(|_| {
                        format!("token id {id} is larger than any vocabulary")
                    })?);
                }
                if ids.is_empty() {
                    ids.push(EMPTY_PROMPT_TOKEN);
                }
                (ids, Value::Array(items.clone()).to_string())
            }
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                let s = items[0].as_str().unwrap_or_default();
                (text_token_ids(s), s.to_string())
            }
            Value::Array(_) => {
                return Err("prompt must be a string, one string, or an array of token ids; batched prompts are not supported".into())
            }
            _ => return Err("prompt must be a string or an array of token ids".into()),
        };
        Ok(Prompt::new(ids, self.common.metronome_prompt_tokens, key))
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

    /// A stream chunk carrying token `token` of choice `index` (its first token adds the
    /// assistant role for chat, and a tool call's id and name), with its log-probabilities
    /// when asked for, `offset` characters into the choice's text.
    pub fn token_chunk(
        &self,
        index: u32,
        choice: &Choice,
        token: usize,
        offset: usize,
        include_usage: bool,
    ) -> Value {
        let piece = choice.pieces.get(token).map_or("", String::as_str);
        let logprobs = choice
            .logprobs
            .as_ref()
            .and_then(|l| l.get(token))
            .and_then(Option::as_ref)
            .map_or(Value::Null, |l| {
                crate::logprobs::render(self.kind, std::slice::from_ref(l), offset)
            });
        let first = token == 0;
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = match &choice.tool_call {
                    Some(call) if first => json!({"content": null, "tool_calls": [{
                        "index": 0, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": piece}}]}),
                    Some(_) => {
                        json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                    }
                    None => json!({"content": piece}),
                };
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null})
            }
            Kind::Completion => {
                json!({"index": index, "text": piece, "logprobs": logprobs, "finish_reason": null})
            }
        };
        self.chunk(vec![choice], include_usage)
    }

    /// The chunk that closes choice `index` with its finish reason (and the stop sequence
    /// that ended it).
    pub fn finish_chunk(&self, index: u32, choice: &Choice, include_usage: bool) -> Value {
        let mut c = match self.kind {
            Kind::Chat => json!({"index": index, "delta": {}, "logprobs": null}),
            Kind::Completion => json!({"index": index, "text": "", "logprobs": null}),
        };
        c["finish_reason"] = json!(choice.finish_reason);
        c["stop_reason"] = json!(choice.stop_reason);
        self.chunk(vec![c], include_usage)
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

    /// The whole (non-streaming) response: every choice, with its tokens'
    /// log-probabilities when asked for.
    pub fn response(&self, choices: &[Choice], usage: Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = c.logprobs.as_ref().map_or(Value::Null, |l| {
                    let kept: Vec<_> = l.iter().flatten().cloned().collect();
                    crate::logprobs::render(self.kind, &kept, 0)
                });
                let mut choice = match self.kind {
                    Kind::Chat => {
                        let message = match &c.tool_call {
                            Some(call) => json!({"role": "assistant", "content": null,
                                "tool_calls": [{"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": c.text()}}]}),
                            None => json!({"role": "assistant", "content": c.text()}),
                        };
                        json!({"index": index, "message": message})
                    }
                    Kind::Completion => json!({"index": index, "text": c.text()}),
                };
                choice["logprobs"] = logprobs;
                choice["finish_reason"] = json!(c.finish_reason);
                choice["stop_reason"] = json!(c.stop_reason);
                choice
            })
            .collect();
        let object = match self.kind {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.model, "choices": choices, "usage": usage,
        })
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

    /// The simulator's token ids are the ones the gateway fingerprints jobs with.
    #[test]
    fn token_ids_agree_with_the_protocols_fingerprint_tokenisation() {
        use metronome_protocol::prefix::request_token_ids;
        use metronome_protocol::Endpoint;
        let chats = [
            json!({"model": "m", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]},
                {"role": "assistant", "content": null},
            ]}),
            json!({"model": "m", "messages": []}),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "metronome_prompt_tokens": 300}),
        ];
        for body in chats {
            let r: ChatRequest = serde_json::from_value(body.clone()).unwrap();
            assert_eq!(
                r.prompt().token_ids,
                request_token_ids(Endpoint::Chat, &body).unwrap(),
                "{body}"
            );
        }
        let completions = [
            json!({"model": "m", "prompt": "Once upon a time"}),
            json!({"model": "m", "prompt": ["one string"]}),
            json!({"model": "m", "prompt": [1, 2, 3]}),
            json!({"model": "m", "prompt": []}),
            json!({"model": "m"}),
            json!({"model": "m", "prompt": "p", "metronome_prompt_tokens": 200}),
        ];
        for body in completions {
            let r: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
            assert_eq!(
                r.prompt().unwrap().token_ids,
                request_token_ids(Endpoint::Completion, &body).unwrap(),
                "{body}"
            );
        }
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
