//! Folding the streamed OpenAI chunks of one job into the non-streaming response a client
//! that did not stream expects (`chat.completion` or `text_completion`), and into the usage.
//!
//! Invariants: choices are kept by their `index`, so `n > 1` and interleaved chunks
//! assemble correctly; the text of each choice is the concatenation of its deltas in
//! arrival order; the usage is the server's own (the last chunk when
//! `stream_options.include_usage` is set), or, when the server sent none, the prompt
//! estimate of the job and one token per content chunk.

use std::collections::BTreeMap;

use metronome_protocol::{Endpoint, Usage};
use serde_json::{json, Map, Value};

#[derive(Debug, Default)]
struct Choice {
    text: String,
    reasoning: String,
    role: Option<String>,
    finish_reason: Option<Value>,
    tool_calls: Vec<Value>,
}

/// Accumulates the chunks of one completion.
#[derive(Debug)]
pub struct Assembler {
    endpoint: Endpoint,
    id: Option<String>,
    model: Option<String>,
    created: Option<Value>,
    system_fingerprint: Option<Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Usage>,
    content_chunks: u32,
}

impl Assembler {
    pub fn new(endpoint: Endpoint) -> Self {
        Assembler {
            endpoint,
            id: None,
            model: None,
            created: None,
            system_fingerprint: None,
            choices: BTreeMap::new(),
            usage: None,
            content_chunks: 0,
        }
    }

    /// Fold one chunk in. Returns true when it carried generated text (a token arrival,
    /// which is what time-to-first-token and time-per-token measure).
    pub fn push(&mut self, chunk: &Value) -> bool {
        if self.id.is_none() {
            self.id = chunk.get("id").and_then(Value::as_str).map(str::to_string);
        }
        if self.model.is_none() {
            self.model = chunk
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if self.created.is_none() {
            self.created = chunk.get("created").cloned();
        }
        if let Some(fp) = chunk.get("system_fingerprint").filter(|v| !v.is_null()) {
            self.system_fingerprint = Some(fp.clone());
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            let get = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0) as u32;
            let (p, c) = (get("prompt_tokens"), get("completion_tokens"));
            let t = u
                .get("total_tokens")
                .and_then(Value::as_u64)
                .map(|t| t as u32)
                .unwrap_or(p + c);
            self.usage = Some(Usage {
                prompt_tokens: p,
                completion_tokens: c,
                total_tokens: t,
            });
        }
        let mut produced = false;
        for (pos, c) in chunk
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(pos as u64);
            let acc = self.choices.entry(index).or_default();
            let piece = match self.endpoint {
                Endpoint::Chat => {
                    let delta = c.get("delta");
                    if let Some(role) = delta.and_then(|d| d.get("role")).and_then(Value::as_str) {
                        acc.role = Some(role.to_string());
                    }
                    if let Some(r) = delta
                        .and_then(|d| d.get("reasoning_content"))
                        .and_then(Value::as_str)
                    {
                        acc.reasoning.push_str(r);
                        produced |= !r.is_empty();
                    }
                    if let Some(calls) = delta
                        .and_then(|d| d.get("tool_calls"))
                        .and_then(Value::as_array)
                    {
                        acc.tool_calls.extend(calls.iter().cloned());
                        produced |= !calls.is_empty();
                    }
                    delta.and_then(|d| d.get("content")).and_then(Value::as_str)
                }
                Endpoint::Completion => c.get("text").and_then(Value::as_str),
            };
            if let Some(p) = piece {
                acc.text.push_str(p);
                produced |= !p.is_empty();
            }
            if let Some(fr) = c.get("finish_reason").filter(|v| !v.is_null()) {
                acc.finish_reason = Some(fr.clone());
            }
        }
        if produced {
            self.content_chunks += 1;
        }
        produced
    }

    /// The server's usage, if it sent one.
    pub fn server_usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Chunks that carried generated text.
    pub fn content_chunks(&self) -> u32 {
        self.content_chunks
    }

    /// The usage to report: the server's, else an estimate from `prompt_tokens` and the
    /// content chunks (one token each, as OpenAI-compatible servers stream them).
    pub fn usage(&self, prompt_tokens_estimate: u32) -> Usage {
        self.usage.unwrap_or(Usage {
            prompt_tokens: prompt_tokens_estimate,
            completion_tokens: self.content_chunks,
            total_tokens: prompt_tokens_estimate + self.content_chunks,
        })
    }

    /// The assembled non-streaming response.
    pub fn finish(&self, job_id: &str, model: &str, usage: Usage) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|(index, c)| {
                let finish = c.finish_reason.clone().unwrap_or(Value::Null);
                match self.endpoint {
                    Endpoint::Chat => {
                        let mut message = Map::new();
                        message.insert(
                            "role".into(),
                            json!(c.role.clone().unwrap_or_else(|| "assistant".into())),
                        );
                        message.insert("content".into(), json!(c.text));
                        if !c.reasoning.is_empty() {
                            message.insert("reasoning_content".into(), json!(c.reasoning));
                        }
                        if !c.tool_calls.is_empty() {
                            message.insert("tool_calls".into(), merge_tool_calls(&c.tool_calls));
                        }
                        json!({"index": index, "message": message, "logprobs": null, "finish_reason": finish})
                    }
                    Endpoint::Completion => {
                        json!({"index": index, "text": c.text, "logprobs": null, "finish_reason": finish})
                    }
                }
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        };
        let mut out = json!({
            "id": self.id.clone().unwrap_or_else(|| format!("cmpl-{job_id}")),
            "object": object,
            "created": self.created.clone().unwrap_or_else(|| json!(metronome_protocol::time::unix_ms() / 1000)),
            "model": self.model.clone().unwrap_or_else(|| model.to_string()),
            "choices": choices,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            },
        });
        if let Some(fp) = &self.system_fingerprint {
            out["system_fingerprint"] = fp.clone();
        }
        out
    }
}

/// Streamed tool calls arrive as fragments keyed by `index`: the first carries id, type and
/// function name, later ones append to `function.arguments`.
fn merge_tool_calls(fragments: &[Value]) -> Value {
    let mut calls: BTreeMap<u64, Value> = BTreeMap::new();
    for (pos, f) in fragments.iter().enumerate() {
        let index = f.get("index").and_then(Value::as_u64).unwrap_or(pos as u64);
        let call = calls.entry(index).or_insert_with(
            || json!({"id": null, "type": "function", "function": {"name": null, "arguments": ""}}),
        );
        if let Some(id) = f.get("id").filter(|v| !v.is_null()) {
            call["id"] = id.clone();
        }
        if let Some(t) = f.get("type").filter(|v| !v.is_null()) {
            call["type"] = t.clone();
        }
        if let Some(func) = f.get("function") {
            if let Some(name) = func.get("name").filter(|v| !v.is_null()) {
                call["function"]["name"] = name.clone();
            }
            if let Some(args) = func.get("arguments").and_then(Value::as_str) {
                let joined = format!(
                    "{}{args}",
                    call["function"]["arguments"].as_str().unwrap_or("")
                );
                call["function"]["arguments"] = json!(joined);
            }
        }
    }
    Value::Array(calls.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_chunk(index: u64, content: &str, finish: Option<&str>) -> Value {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]})
    }

    #[test]
    fn chat_chunks_assemble_into_a_chat_completion() {
        let mut a = Assembler::new(Endpoint::Chat);
        assert!(
            !a.push(&json!({"id": "chatcmpl-1", "model": "m", "created": 7,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        );
        assert!(a.push(&chat_chunk(0, "Hel", None)));
        assert!(a.push(&chat_chunk(1, "B", None)));
        assert!(a.push(&chat_chunk(0, "lo", Some("stop"))));
        assert!(!a.push(&json!({"id": "chatcmpl-1", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})));
        let usage = a.usage(99);
        assert_eq!(
            usage,
            Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                total_tokens: 8
            }
        );
        let r = a.finish("job-1", "m", usage);
        assert_eq!(r["object"], "chat.completion");
        assert_eq!(r["id"], "chatcmpl-1");
        assert_eq!(r["choices"][0]["message"]["content"], "Hello");
        assert_eq!(r["choices"][0]["message"]["role"], "assistant");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        assert_eq!(r["choices"][1]["message"]["content"], "B");
        assert_eq!(r["usage"]["total_tokens"], 8);
    }

    #[test]
    fn completion_chunks_assemble_into_a_text_completion_with_estimated_usage() {
        let mut a = Assembler::new(Endpoint::Completion);
        for t in ["a", "b", "c"] {
            a.push(&json!({"id": "cmpl-9", "object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": null}]}));
        }
        a.push(&json!({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}));
        let usage = a.usage(4);
        assert_eq!(
            usage,
            Usage {
                prompt_tokens: 4,
                completion_tokens: 3,
                total_tokens: 7
            }
        );
        let r = a.finish("job-1", "m", usage);
        assert_eq!(r["object"], "text_completion");
        assert_eq!(r["choices"][0]["text"], "abc");
        assert_eq!(r["choices"][0]["finish_reason"], "length");
        assert_eq!(r["model"], "m");
    }

    #[test]
    fn tool_call_fragments_are_merged() {
        let mut a = Assembler::new(Endpoint::Chat);
        a.push(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}}]}}]}));
        a.push(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}));
        let r = a.finish("j", "m", a.usage(0));
        let call = &r["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["id"], "call_1");
        assert_eq!(call["function"]["arguments"], "{\"x\":1}");
    }
}
