//! Folding the streamed OpenAI chunks of one job into the non-streaming response a client
//! that did not stream expects (`chat.completion` or `text_completion`), and into the usage.
//!
//! Invariants: choices are kept by their `index`, so `n > 1` and interleaved chunks
//! assemble correctly; the text of each choice is the concatenation of its deltas in
//! arrival order; the usage is the server's own (the last chunk when
//! `stream_options.include_usage` is set), or, when the server sent none, the prompt
//! estimate of the job and one token per content chunk.
//!
//! Nothing the server sends about a choice is dropped, whether or not this file knows it:
//! - `logprobs`: each chunk's arrays are appended (`content` and `refusal` of chat, and
//!   `tokens`, `token_logprobs`, `top_logprobs`, `text_offset` of completions, whose
//!   streamed offsets already count from the start of the choice), so the result is the
//!   object a non-streamed request gets; `null` only when no chunk carried any;
//! - the delta's text fields (`content`, `reasoning_content`, `reasoning`, `refusal`, any
//!   other string) are concatenated into the message, `tool_calls` and `function_call`
//!   fragments merged, any other delta field kept at its last non-null value;
//! - any other field of a choice (vLLM's `stop_reason`, SGLang's `matched_stop`) and of the
//!   chunk (`system_fingerprint`, `service_tier`, `prompt_logprobs`) keeps its last
//!   non-null value.
//!
//! An embedding is not streamed: its one "chunk" is the server's whole response, kept as
//! it came, with the usage it reports (prompt tokens, no output).

use std::collections::BTreeMap;

use metronome_protocol::{Endpoint, Usage};
use serde_json::{json, Map, Value};

/// Chunk fields the assembled response sets itself.
const CHUNK_FIELDS: [&str; 6] = ["id", "object", "created", "model", "choices", "usage"];
/// Choice fields the assembly reads itself.
const CHOICE_FIELDS: [&str; 5] = ["index", "delta", "text", "logprobs", "finish_reason"];

#[derive(Debug, Default)]
struct Choice {
    /// `content` (chat) or `text` (completions).
    text: String,
    role: Option<String>,
    finish_reason: Option<Value>,
    tool_calls: Vec<Value>,
    function_call: Option<Value>,
    /// Other text fields of the delta, concatenated (`reasoning_content`, `refusal`, …).
    delta_text: Map<String, Value>,
    /// Other fields of the delta, last non-null value.
    delta_other: Map<String, Value>,
    /// The merged `logprobs` object, once a chunk carried one.
    logprobs: Option<Map<String, Value>>,
    /// Other fields of the choice, last non-null value.
    extra: Map<String, Value>,
}

/// Accumulates the chunks of one completion.
#[derive(Debug)]
pub struct Assembler {
    endpoint: Endpoint,
    id: Option<String>,
    model: Option<String>,
    created: Option<Value>,
    /// Other fields of the chunks (`system_fingerprint`, …), last non-null value.
    extra: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Usage>,
    content_chunks: u32,
    /// An embedding's response, as the server answered it.
    whole: Option<Value>,
}

impl Assembler {
    pub fn new(endpoint: Endpoint) -> Self {
        Assembler {
            endpoint,
            id: None,
            model: None,
            created: None,
            extra: Map::new(),
            choices: BTreeMap::new(),
            usage: None,
            content_chunks: 0,
            whole: None,
        }
    }

    /// Fold one chunk in. Returns true when it carried generated text (a token arrival,
    /// which is what time-to-first-token and time-per-token measure).
    pub fn push(&mut self, chunk: &Value) -> bool {
        if !self.endpoint.generates() {
            self.read_usage(chunk);
            self.whole = Some(chunk.clone());
            return true;
        }
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
        if let Some(fields) = chunk.as_object() {
            keep_last(&mut self.extra, fields, &CHUNK_FIELDS);
        }
        self.read_usage(chunk);
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
            match self.endpoint {
                Endpoint::Chat => {
                    if let Some(delta) = c.get("delta").and_then(Value::as_object) {
                        produced |= acc.push_delta(delta);
                    }
                }
                Endpoint::Completion | Endpoint::Embedding => {
                    if let Some(text) = c.get("text").and_then(Value::as_str) {
                        acc.text.push_str(text);
                        produced |= !text.is_empty();
                    }
                }
            }
            if let Some(fr) = c.get("finish_reason").filter(|v| !v.is_null()) {
                acc.finish_reason = Some(fr.clone());
            }
            if let Some(lp) = c.get("logprobs").and_then(Value::as_object) {
                merge_logprobs(acc.logprobs.get_or_insert_with(Map::new), lp);
            }
            if let Some(fields) = c.as_object() {
                keep_last(&mut acc.extra, fields, &CHOICE_FIELDS);
            }
        }
        if produced {
            self.content_chunks += 1;
        }
        produced
    }

    /// Take the chunk's usage, when it carries one.
    fn read_usage(&mut self, chunk: &Value) {
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
        if let Some(whole) = &self.whole {
            return whole.clone();
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .map(|(index, c)| {
                let mut choice = Map::new();
                choice.insert("index".into(), json!(index));
                match self.endpoint {
                    Endpoint::Chat => {
                        choice.insert("message".into(), Value::Object(c.message()));
                    }
                    Endpoint::Completion | Endpoint::Embedding => {
                        choice.insert("text".into(), json!(c.text));
                    }
                }
                choice.insert(
                    "logprobs".into(),
                    c.logprobs.clone().map_or(Value::Null, Value::Object),
                );
                choice.insert(
                    "finish_reason".into(),
                    c.finish_reason.clone().unwrap_or(Value::Null),
                );
                for (k, v) in &c.extra {
                    choice.entry(k.clone()).or_insert_with(|| v.clone());
                }
                Value::Object(choice)
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion | Endpoint::Embedding => "text_completion",
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
        if let Some(fields) = out.as_object_mut() {
            for (k, v) in &self.extra {
                fields.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        out
    }
}

impl Choice {
    /// Fold one chat delta in. Returns true when it carried generated output (text of any
    /// kind, or a tool call).
    fn push_delta(&mut self, delta: &Map<String, Value>) -> bool {
        let mut produced = false;
        for (key, value) in delta {
            match (key.as_str(), value) {
                (_, Value::Null) => {}
                ("role", Value::String(role)) => self.role = Some(role.clone()),
                ("content", Value::String(text)) => {
                    self.text.push_str(text);
                    produced |= !text.is_empty();
                }
                ("tool_calls", Value::Array(calls)) => {
                    self.tool_calls.extend(calls.iter().cloned());
                    produced |= !calls.is_empty();
                }
                ("function_call", Value::Object(fragment)) => {
                    merge_function(
                        self.function_call
                            .get_or_insert_with(|| json!({"name": null, "arguments": ""})),
                        fragment,
                    );
                    produced = true;
                }
                (_, Value::String(text)) => {
                    let acc = self
                        .delta_text
                        .entry(key.clone())
                        .or_insert_with(|| json!(""));
                    let joined = format!("{}{text}", acc.as_str().unwrap_or(""));
                    *acc = json!(joined);
                    produced |= !text.is_empty();
                }
                (_, other) => {
                    self.delta_other.insert(key.clone(), other.clone());
                }
            }
        }
        produced
    }

    /// The assembled chat message.
    fn message(&self) -> Map<String, Value> {
        let mut message = Map::new();
        message.insert(
            "role".into(),
            json!(self.role.clone().unwrap_or_else(|| "assistant".into())),
        );
        // A message that only calls tools has no content (`null`, as OpenAI answers it).
        let calls = !self.tool_calls.is_empty() || self.function_call.is_some();
        let content = if self.text.is_empty() && calls {
            Value::Null
        } else {
            json!(self.text)
        };
        message.insert("content".into(), content);
        for (k, v) in &self.delta_text {
            // An empty reasoning or refusal text is no such text.
            if v.as_str().is_some_and(|t| !t.is_empty()) {
                message.insert(k.clone(), v.clone());
            }
        }
        for (k, v) in &self.delta_other {
            message.entry(k.clone()).or_insert_with(|| v.clone());
        }
        if !self.tool_calls.is_empty() {
            message.insert("tool_calls".into(), merge_tool_calls(&self.tool_calls));
        }
        if let Some(f) = &self.function_call {
            message.insert("function_call".into(), f.clone());
        }
        message
    }
}

/// Copy every field of `from` outside `skip` into `into`, a null never overwriting a value.
fn keep_last(into: &mut Map<String, Value>, from: &Map<String, Value>, skip: &[&str]) {
    for (k, v) in from {
        if !v.is_null() && !skip.contains(&k.as_str()) {
            into.insert(k.clone(), v.clone());
        }
    }
}

/// Append one chunk's `logprobs` to the choice's: arrays are concatenated (each chunk holds
/// its tokens' entries), anything else keeps its last non-null value.
fn merge_logprobs(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Value::Array(acc)), Value::Array(more)) => acc.extend(more.iter().cloned()),
            (Some(_), Value::Null) => {}
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// A streamed legacy `function_call`: the name once, the arguments in fragments.
fn merge_function(call: &mut Value, fragment: &Map<String, Value>) {
    if let Some(name) = fragment.get("name").filter(|v| !v.is_null()) {
        call["name"] = name.clone();
    }
    if let Some(args) = fragment.get("arguments").and_then(Value::as_str) {
        let joined = format!("{}{args}", call["arguments"].as_str().unwrap_or(""));
        call["arguments"] = json!(joined);
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
    fn chat_logprobs_and_unknown_fields_are_kept() {
        let mut a = Assembler::new(Endpoint::Chat);
        let lp = |t: &str, p: f64| json!({"content": [{"token": t, "logprob": p, "bytes": [], "top_logprobs": []}]});
        a.push(&json!({"id": "c", "system_fingerprint": "fp", "service_tier": "default",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "A", "reasoning": "r1"},
                         "logprobs": lp("A", -0.5), "finish_reason": null}]}));
        a.push(&json!({"id": "c", "system_fingerprint": null,
            "choices": [{"index": 0, "delta": {"content": "B", "reasoning": "r2", "refusal": null},
                         "logprobs": lp("B", -1.0), "finish_reason": null}]}));
        a.push(
            &json!({"choices": [{"index": 0, "delta": {}, "logprobs": null,
            "finish_reason": "stop", "stop_reason": "\n"}]}),
        );
        let r = a.finish("j", "m", a.usage(0));
        let choice = &r["choices"][0];
        assert_eq!(choice["message"]["content"], "AB");
        assert_eq!(choice["message"]["reasoning"], "r1r2");
        assert!(choice["message"].get("refusal").is_none());
        assert_eq!(
            choice["logprobs"]["content"],
            json!([
                {"token": "A", "logprob": -0.5, "bytes": [], "top_logprobs": []},
                {"token": "B", "logprob": -1.0, "bytes": [], "top_logprobs": []},
            ])
        );
        assert_eq!(choice["stop_reason"], "\n");
        assert_eq!(choice["finish_reason"], "stop");
        assert_eq!(r["system_fingerprint"], "fp");
        assert_eq!(r["service_tier"], "default");
        assert_eq!(r["object"], "chat.completion");
    }

    #[test]
    fn completion_logprobs_arrays_are_concatenated() {
        let mut a = Assembler::new(Endpoint::Completion);
        for (i, t) in [" a", " bc"].iter().enumerate() {
            a.push(&json!({"choices": [{"index": 0, "text": t, "logprobs": {
                "tokens": [t], "token_logprobs": [-0.1 * (i as f64 + 1.0)],
                "top_logprobs": [{*t: -0.1}], "text_offset": [i * 2]}}]}));
        }
        a.push(&json!({"choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}]}));
        let r = a.finish("j", "m", a.usage(0));
        let lp = &r["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"], json!([" a", " bc"]));
        assert_eq!(lp["token_logprobs"], json!([-0.1, -0.2]));
        assert_eq!(lp["text_offset"], json!([0, 2]));
        assert_eq!(lp["top_logprobs"], json!([{" a": -0.1}, {" bc": -0.1}]));
        assert_eq!(r["choices"][0]["text"], " a bc");
    }

    #[test]
    fn without_logprobs_a_choice_says_null() {
        let mut a = Assembler::new(Endpoint::Chat);
        a.push(&chat_chunk(0, "x", Some("stop")));
        let r = a.finish("j", "m", a.usage(0));
        assert_eq!(r["choices"][0]["logprobs"], Value::Null);
        assert!(r.get("system_fingerprint").is_none());
    }

    #[test]
    fn an_embedding_is_kept_as_the_server_answered_it() {
        let mut a = Assembler::new(Endpoint::Embedding);
        let response = json!({"object": "list", "model": "m",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
            "usage": {"prompt_tokens": 4, "total_tokens": 4}});
        assert!(
            a.push(&response),
            "the answer is the job's first and only result"
        );
        let usage = a.usage(99);
        assert_eq!(
            usage,
            Usage {
                prompt_tokens: 4,
                completion_tokens: 0,
                total_tokens: 4
            }
        );
        assert_eq!(a.finish("j", "m", usage), response);
    }

    #[test]
    fn tool_call_fragments_are_merged() {
        let mut a = Assembler::new(Endpoint::Chat);
        a.push(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}}]}}]}));
        a.push(&json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}));
        let r = a.finish("j", "m", a.usage(0));
        assert_eq!(r["choices"][0]["message"]["content"], Value::Null);
        let call = &r["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["id"], "call_1");
        assert_eq!(call["function"]["arguments"], "{\"x\":1}");
    }
}
