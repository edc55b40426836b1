//! The OpenAI request as the gateway sees it: the few fields it needs to build a job
//! (model, prompt size, output bound, streaming), read from the body without consuming it.
//!
//! The body itself travels to the model server unchanged, with one documented exception:
//! when the request sets no output limit and `inject_default_max_tokens` is on, the
//! default `max_tokens` is written into it, so the model server can never generate more
//! than the dispatcher reserved KV cache and time for.
//!
//! Prompt size heuristic (no tokenizer in the gateway, the model is not known here):
//! every text counts `ceil(chars / 4)` tokens (OpenAI's rule of thumb for English BPE
//! vocabularies; it under-counts CJK text and over-counts long ASCII words), each chat
//! message adds 4 tokens of role and separators, and a chat adds 3 tokens of reply
//! priming. Token-id prompts (`prompt: [1, 2, 3]`) are counted exactly. The estimate
//! only orders and sizes jobs; the worker reports the true counts.

use metronome_protocol::Endpoint;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Tokens of role and separators around each chat message.
const TOKENS_PER_MESSAGE: u32 = 4;
/// Tokens priming the assistant's reply in a chat.
const TOKENS_REPLY_PRIMING: u32 = 3;
/// Characters per token of the heuristic.
const CHARS_PER_TOKEN: usize = 4;

/// Limits and defaults applied while reading a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestPolicy {
    pub default_max_tokens: u32,
    pub max_tokens_limit: u32,
    pub inject_default_max_tokens: bool,
}

/// A validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest {
    pub endpoint: Endpoint,
    pub model: String,
    /// Output bound of one choice.
    pub max_tokens: u32,
    /// Choices generated (`n`, times the number of prompts of a batched completion).
    pub choices: u32,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Estimated prompt tokens over every prompt and message.
    pub prompt_tokens: u32,
    /// The body to forward.
    pub body: Value,
}

impl InferenceRequest {
    /// Output tokens the job can produce at most: the job's `max_tokens`.
    pub fn total_max_tokens(&self) -> u32 {
        self.max_tokens.saturating_mul(self.choices)
    }
}

/// Read and validate `body` for `endpoint`.
pub fn parse_request(
    endpoint: Endpoint,
    body: Value,
    policy: &RequestPolicy,
) -> Result<InferenceRequest, ApiError> {
    let Value::Object(mut object) = body else {
        return Err(ApiError::invalid_request(
            "the request body must be a JSON object",
        ));
    };
    let model = match object.get("model") {
        Some(Value::String(m)) if !m.trim().is_empty() => {
            // Control characters or an unbounded length are refused here with the same
            // rule the dispatcher applies, before the name reaches a header or a log.
            metronome_protocol::check_model_name(m)
                .map_err(|e| ApiError::invalid_field("model", e.to_string()))?;
            m.clone()
        }
        Some(Value::String(_)) => {
            return Err(ApiError::invalid_field(
                "model",
                "`model` must not be empty",
            ))
        }
        Some(_) => return Err(ApiError::invalid_field("model", "`model` must be a string")),
        None => {
            return Err(ApiError::invalid_field(
                "model",
                "missing required field `model`",
            ))
        }
    };
    let (prompt_tokens, prompts) = match endpoint {
        Endpoint::Chat => (chat_prompt_tokens(&object)?, 1),
        Endpoint::Completion => completion_prompt_tokens(&object, "prompt")?,
        Endpoint::Embedding => {
            // A prefill and no decode: no output bound, no stream, nothing injected.
            let (prompt_tokens, _) = completion_prompt_tokens(&object, "input")?;
            return Ok(InferenceRequest {
                endpoint,
                model,
                max_tokens: 0,
                choices: 1,
                stream: false,
                include_usage: false,
                prompt_tokens: prompt_tokens.max(1),
                body: Value::Object(object),
            });
        }
    };
    let max_tokens = read_max_tokens(&object, policy)?;
    let n = match object.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=128).contains(&n) => n as u32,
            _ => {
                return Err(ApiError::invalid_field(
                    "n",
                    "`n` must be an integer from 1 to 128",
                ))
            }
        },
    };
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_field(
                "stream",
                "`stream` must be a boolean",
            ))
        }
    };
    let include_usage = match object.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid_field(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be a boolean",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::invalid_field(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    if max_tokens.is_none() && policy.inject_default_max_tokens {
        object.insert("max_tokens".into(), Value::from(policy.default_max_tokens));
    }
    Ok(InferenceRequest {
        endpoint,
        model,
        max_tokens: max_tokens.unwrap_or(policy.default_max_tokens),
        choices: n.saturating_mul(prompts),
        stream,
        include_usage: stream && include_usage,
        prompt_tokens,
        body: Value::Object(object),
    })
}

/// `max_completion_tokens` wins over `max_tokens` (as in vLLM and OpenAI); `None` when
/// neither is set.
fn read_max_tokens(
    object: &Map<String, Value>,
    policy: &RequestPolicy,
) -> Result<Option<u32>, ApiError> {
    for field in ["max_completion_tokens", "max_tokens"] {
        match object.get(field) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return match v.as_u64() {
                    Some(t) if t >= 1 && t <= u64::from(policy.max_tokens_limit) => {
                        Ok(Some(t as u32))
                    }
                    _ => Err(ApiError::invalid_field(
                        field,
                        format!(
                            "`{field}` must be an integer from 1 to {}",
                            policy.max_tokens_limit
                        ),
                    )),
                };
            }
        }
    }
    Ok(None)
}

/// Heuristic token count of a text.
pub fn text_tokens(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
}

fn chat_prompt_tokens(object: &Map<String, Value>) -> Result<u32, ApiError> {
    let messages = match object.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_field(
                "messages",
                "`messages` must contain at least one message",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                "messages",
                "`messages` must be an array",
            ))
        }
        None => {
            return Err(ApiError::invalid_field(
                "messages",
                "missing required field `messages`",
            ))
        }
    };
    let mut total = TOKENS_REPLY_PRIMING;
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(m) = message else {
            return Err(ApiError::invalid_field(
                &format!("messages[{i}]"),
                "each message must be an object",
            ));
        };
        if !matches!(m.get("role"), Some(Value::String(_))) {
            return Err(ApiError::invalid_field(
                &format!("messages[{i}].role"),
                "each message needs a string `role`",
            ));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) => 0,
            Some(Value::String(s)) => text_tokens(s),
            // Content parts: only text parts have a size the gateway can estimate.
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(text_tokens)
                .fold(0u32, u32::saturating_add),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].content"),
                    "`content` must be a string, an array of parts or null",
                ))
            }
        };
        total = total
            .saturating_add(TOKENS_PER_MESSAGE)
            .saturating_add(content);
    }
    Ok(total)
}

/// Prompt tokens and the number of prompts of a completion request (`field` = `prompt`)
/// or of an embedding request (`field` = `input`, which takes the same shapes).
fn completion_prompt_tokens(
    object: &Map<String, Value>,
    field: &str,
) -> Result<(u32, u32), ApiError> {
    let invalid = || {
        ApiError::invalid_field(
            field,
            format!("`{field}` must be a string, an array of strings, an array of token ids or an array of token-id arrays"),
        )
    };
    match object.get(field) {
        None => Err(ApiError::invalid_field(
            field,
            format!("missing required field `{field}`"),
        )),
        Some(Value::String(s)) => Ok((text_tokens(s), 1)),
        Some(Value::Array(items)) if items.is_empty() => Err(invalid()),
        Some(Value::Array(items)) => {
            if items.iter().all(Value::is_string) {
                let tokens = items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(text_tokens)
                    .fold(0u32, u32::saturating_add);
                Ok((tokens, items.len() as u32))
            } else if items.iter().all(Value::is_u64) {
                Ok((items.len() as u32, 1))
            } else if items
                .iter()
                .all(|i| i.as_array().is_some_and(|a| a.iter().all(Value::is_u64)))
            {
                let tokens = items
                    .iter()
                    .filter_map(Value::as_array)
                    .map(|a| a.len() as u32)
                    .fold(0u32, u32::saturating_add);
                Ok((tokens, items.len() as u32))
            } else {
                Err(invalid())
            }
        }
        Some(_) => Err(invalid()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const POLICY: RequestPolicy = RequestPolicy {
        default_max_tokens: 256,
        max_tokens_limit: 4096,
        inject_default_max_tokens: true,
    };

    fn chat(body: Value) -> Result<InferenceRequest, ApiError> {
        parse_request(Endpoint::Chat, body, &POLICY)
    }

    fn completion(body: Value) -> Result<InferenceRequest, ApiError> {
        parse_request(Endpoint::Completion, body, &POLICY)
    }

    #[test]
    fn heuristic_is_a_quarter_of_the_characters_rounded_up() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        // Characters, not bytes: four two-byte characters are one token.
        assert_eq!(text_tokens("éééé"), 1);
    }

    #[test]
    fn a_model_name_with_control_characters_or_too_long_is_refused() {
        for model in ["a\r\nb".to_string(), "a\u{0}b".to_string(), "m".repeat(257)] {
            let err = chat(json!({"model": model, "messages": [{"role": "user", "content": "x"}]}))
                .expect_err("refused");
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST, "{model:?}");
            assert_eq!(err.param.as_deref(), Some("model"));
        }
    }

    #[test]
    fn chat_counts_messages_and_priming() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "system", "content": "abcdefgh"},
            {"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image_url"}]},
        ], "max_tokens": 10}))
        .unwrap();
        assert_eq!(r.prompt_tokens, 3 + (4 + 2) + (4 + 1));
        assert_eq!(r.max_tokens, 10);
        assert!(!r.stream);
    }

    #[test]
    fn max_completion_tokens_wins_and_default_is_injected() {
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 10, "max_completion_tokens": 20}),
        )
        .unwrap();
        assert_eq!(r.max_tokens, 20);
        assert!(r.body.get("max_tokens").is_some_and(|v| v == 10));
        let r =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(r.max_tokens, 256);
        assert_eq!(r.body["max_tokens"], 256);
        let keep = RequestPolicy {
            inject_default_max_tokens: false,
            ..POLICY
        };
        let r = parse_request(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            &keep,
        )
        .unwrap();
        assert!(r.body.get("max_tokens").is_none());
    }

    #[test]
    fn unknown_fields_are_forwarded_unchanged() {
        let body = json!({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.3,
            "logit_bias": {"50256": -100}});
        let r = completion(body.clone()).unwrap();
        assert_eq!(r.body, body);
    }

    #[test]
    fn completion_prompt_shapes() {
        assert_eq!(
            completion(json!({"model": "m", "prompt": "abcdefgh"}))
                .unwrap()
                .prompt_tokens,
            2
        );
        let r =
            completion(json!({"model": "m", "prompt": ["abcd", "abcd"], "max_tokens": 3})).unwrap();
        assert_eq!(
            (r.prompt_tokens, r.choices, r.total_max_tokens()),
            (2, 2, 6)
        );
        assert_eq!(
            completion(json!({"model": "m", "prompt": [1, 2, 3]}))
                .unwrap()
                .prompt_tokens,
            3
        );
        assert_eq!(
            completion(json!({"model": "m", "prompt": [[1, 2], [3]]}))
                .unwrap()
                .prompt_tokens,
            3
        );
        assert_eq!(
            completion(json!({"model": "m", "prompt": [1, "a"]}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn an_embedding_costs_its_input_and_writes_nothing() {
        let body = json!({"model": "m", "input": ["abcd", "abcdefgh"], "encoding_format": "float"});
        let r = parse_request(Endpoint::Embedding, body.clone(), &POLICY).unwrap();
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.total_max_tokens()),
            (3, 0, 0)
        );
        assert!(!r.stream);
        assert_eq!(r.body, body, "nothing injected");
        let r = parse_request(
            Endpoint::Embedding,
            json!({"model": "m", "input": [[1, 2, 3]]}),
            &POLICY,
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, 3);
        for bad in [
            json!({"model": "m"}),
            json!({"model": "m", "input": 5}),
            json!({"model": "m", "input": []}),
        ] {
            let e = parse_request(Endpoint::Embedding, bad.clone(), &POLICY).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("input"), "{bad}");
        }
    }

    #[test]
    fn stream_options_only_count_when_streaming() {
        let r = completion(json!({"model": "m", "prompt": "x", "stream": true,
            "stream_options": {"include_usage": true}}))
        .unwrap();
        assert!(r.stream && r.include_usage);
        let r = completion(json!({"model": "m", "prompt": "x",
            "stream_options": {"include_usage": true}}))
        .unwrap();
        assert!(!r.stream && !r.include_usage);
    }

    #[test]
    fn invalid_fields_name_their_param() {
        let cases = [
            (json!({"messages": []}), "model"),
            (json!({"model": 3, "messages": []}), "model"),
            (json!({"model": "m"}), "messages"),
            (json!({"model": "m", "messages": []}), "messages"),
            (
                json!({"model": "m", "messages": [{"content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "u"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "u"}], "max_tokens": 99999}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "u"}], "stream": "yes"}),
                "stream",
            ),
            (
                json!({"model": "m", "messages": [{"role": "u"}], "n": 0}),
                "n",
            ),
        ];
        assert_eq!(chat(json!([1])).unwrap_err().param, None);
        for (body, param) in cases {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }
}
