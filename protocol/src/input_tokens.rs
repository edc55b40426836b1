//! What a request's input costs in tokens, estimated without a tokenizer (the model, and
//! so its tokenizer, is not known where jobs are admitted). Every input part counts:
//! message texts, content parts of any kind, the other fields of a message (`tool_calls`,
//! `name`, …), and the request fields a chat template renders into the prompt (`tools`,
//! `tool_choice`, `response_format`, the older `functions`), so a tenant cannot move its
//! input where its token limit does not look.
//!
//! Rules: a text counts `ceil(chars / 4)` tokens (OpenAI's rule of thumb for English BPE
//! vocabularies); each chat message adds [`TOKENS_PER_MESSAGE`] of role and separators,
//! a chat [`TOKENS_REPLY_PRIMING`]; an image part counts [`TOKENS_PER_IMAGE`] whatever
//! its size (vision encoders of ~7B models turn one image into hundreds to a few thousand
//! tokens; the bytes of a data URL say nothing about it); any other structured value
//! (a tool list, a schema, an audio part, a tool call) counts as its JSON text does.
//! Token-id prompts count exactly. The gateway charges the estimate against the tenant's
//! `tokens_per_minute`, and the dispatcher charges the larger of it and a job's declared
//! `prompt_tokens`, so a direct NATS client cannot declare its way under the limit.

use serde_json::{Map, Value};

use crate::Endpoint;

/// Tokens of role and separators around each chat message.
pub const TOKENS_PER_MESSAGE: u32 = 4;
/// Tokens priming the assistant's reply in a chat.
pub const TOKENS_REPLY_PRIMING: u32 = 3;
/// Characters per token of the text heuristic.
pub const CHARS_PER_TOKEN: usize = 4;
/// Tokens of one image part.
pub const TOKENS_PER_IMAGE: u32 = 1024;

/// Request fields a chat template renders into the prompt besides the messages.
pub const TEMPLATE_FIELDS: [&str; 5] = [
    "tools",
    "tool_choice",
    "response_format",
    "functions",
    "function_call",
];

/// Content-part types that are images.
const IMAGE_PARTS: [&str; 3] = ["image_url", "input_image", "image"];

/// Heuristic token count of a text.
pub fn text_tokens(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Tokens of a structured value: its JSON text's.
pub fn json_tokens(value: &Value) -> u32 {
    match value {
        Value::Null => 0,
        Value::String(s) => text_tokens(s),
        other => text_tokens(&other.to_string()),
    }
}

/// Tokens of one content part: a text part its text, an image part
/// [`TOKENS_PER_IMAGE`], anything else its JSON.
pub fn part_tokens(part: &Value) -> u32 {
    let kind = part.get("type").and_then(Value::as_str);
    if let Some(text) = part.get("text").and_then(Value::as_str) {
        if matches!(kind, None | Some("text") | Some("input_text")) {
            return text_tokens(text);
        }
    }
    if kind.is_some_and(|k| IMAGE_PARTS.contains(&k)) {
        return TOKENS_PER_IMAGE;
    }
    json_tokens(part)
}

/// Tokens of a message's content: a string, an array of parts, null, or (unreadable to
/// the model server, but still input) any other value's JSON.
pub fn content_tokens(content: &Value) -> u32 {
    match content {
        Value::Null => 0,
        Value::String(s) => text_tokens(s),
        Value::Array(parts) => parts
            .iter()
            .map(part_tokens)
            .fold(0u32, u32::saturating_add),
        other => json_tokens(other),
    }
}

/// Tokens of one chat message: separators, content, and every other field but `role`.
pub fn message_tokens(message: &Map<String, Value>) -> u32 {
    message
        .iter()
        .map(|(field, value)| match field.as_str() {
            "role" => 0,
            "content" => content_tokens(value),
            _ => json_tokens(value),
        })
        .fold(TOKENS_PER_MESSAGE, u32::saturating_add)
}

/// Tokens of the request fields besides the prompt that reach the prompt: the
/// [`TEMPLATE_FIELDS`] and a completion's `suffix`.
pub fn template_tokens(request: &Map<String, Value>) -> u32 {
    TEMPLATE_FIELDS
        .iter()
        .chain(&["suffix"])
        .filter_map(|field| request.get(*field))
        .map(json_tokens)
        .fold(0u32, u32::saturating_add)
}

/// Tokens of a completion's `prompt`: a string, strings, token ids or token-id arrays
/// (anything else: its JSON).
pub fn prompt_tokens(prompt: &Value) -> u32 {
    match prompt {
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Number(_) => 1,
                Value::Array(ids) if ids.iter().all(Value::is_number) => {
                    u32::try_from(ids.len()).unwrap_or(u32::MAX)
                }
                other => json_tokens(other),
            })
            .fold(0u32, u32::saturating_add),
        other => json_tokens(other),
    }
}

/// The whole input of `request` on `endpoint`, read leniently (a malformed request still
/// costs what it holds).
pub fn estimate(endpoint: Endpoint, request: &Value) -> u32 {
    let Some(object) = request.as_object() else {
        return json_tokens(request);
    };
    let prompt = match endpoint {
        Endpoint::Chat => match object.get("messages") {
            Some(Value::Array(messages)) => messages
                .iter()
                .map(|m| m.as_object().map_or_else(|| json_tokens(m), message_tokens))
                .fold(TOKENS_REPLY_PRIMING, u32::saturating_add),
            Some(other) => json_tokens(other),
            None => 0,
        },
        Endpoint::Completion => object.get("prompt").map_or(0, prompt_tokens),
        // Embedding input has the shapes of a completion's prompt.
        Endpoint::Embedding => object.get("input").map_or(0, prompt_tokens),
    };
    prompt.saturating_add(template_tokens(object))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_quarter_of_the_characters_rounded_up() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        assert_eq!(text_tokens("éééé"), 1, "characters, not bytes");
    }

    #[test]
    fn an_embeddings_input_counts_like_a_prompt() {
        let strings = json!({"input": ["abcd", "abcdefgh"], "encoding_format": "float"});
        assert_eq!(estimate(Endpoint::Embedding, &strings), 1 + 2);
        let ids = json!({"input": [[1, 2, 3], [4, 5]]});
        assert_eq!(estimate(Endpoint::Embedding, &ids), 5);
    }

    #[test]
    fn every_part_of_a_chat_counts() {
        let text_only = json!({"messages": [{"role": "user", "content": "abcdefgh"}]});
        assert_eq!(estimate(Endpoint::Chat, &text_only), 3 + 4 + 2);
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let mut with_all = text_only.clone();
        with_all["tools"] = tools.clone();
        with_all["response_format"] = json!({"type": "json_schema", "json_schema": {"x": 1}});
        with_all["messages"][0]["content"] = json!([
            {"type": "text", "text": "abcdefgh"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]);
        let got = estimate(Endpoint::Chat, &with_all);
        let expected = 3
            + 4
            + 2
            + TOKENS_PER_IMAGE
            + json_tokens(&tools)
            + json_tokens(&with_all["response_format"]);
        assert_eq!(got, expected);
        assert!(json_tokens(&tools) > 20, "a tool list is not free");
    }

    #[test]
    fn a_messages_other_fields_count() {
        let call = json!([{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        let m = json!({"role": "assistant", "content": null, "tool_calls": call});
        assert_eq!(
            message_tokens(m.as_object().unwrap()),
            TOKENS_PER_MESSAGE + json_tokens(&call)
        );
    }

    #[test]
    fn completion_prompts_and_suffix() {
        let e = |v: Value| estimate(Endpoint::Completion, &v);
        assert_eq!(e(json!({"prompt": "abcdefgh"})), 2);
        assert_eq!(e(json!({"prompt": ["abcd", "abcd"]})), 2);
        assert_eq!(e(json!({"prompt": [1, 2, 3]})), 3);
        assert_eq!(e(json!({"prompt": [[1, 2], [3]]})), 3);
        assert_eq!(e(json!({"prompt": "abcd", "suffix": "abcdefgh"})), 3);
    }

    #[test]
    fn malformed_requests_still_cost_what_they_hold() {
        let long = "x".repeat(400);
        assert_eq!(estimate(Endpoint::Chat, &json!({"messages": long})), 100);
        assert_eq!(estimate(Endpoint::Chat, &json!(long)), 100);
        assert_eq!(
            estimate(Endpoint::Chat, &json!({"messages": [long]})),
            3 + 100
        );
    }
}
