//! The request to the model server is built from the job, not forwarded: only the fields
//! of an allowlist travel, and `model` is the job's.
//!
//! Why: the body is a client's (through the gateway, or straight over NATS), and model
//! servers read far more than OpenAI's fields. vLLM alone takes `chat_template` (a Jinja
//! template the server renders), `chat_template_kwargs`, `prompt_embeds` (tensors it
//! deserialises), `mm_processor_kwargs`, `guided_*` grammars and more; several have had
//! CVEs (code execution, memory corruption, denial of service). Forwarding a client's body
//! gives every tenant that surface on every GPU. The allowlist is OpenAI's own request
//! fields per endpoint ([`CHAT_FIELDS`], [`COMPLETION_FIELDS`], [`COMMON_FIELDS`]) plus the
//! extras an operator allows for the agent's model server (`extra_request_fields` in the
//! agent's config; by default [`ServerKind::default_extra_fields`](crate::config::ServerKind::default_extra_fields) of its kind: sampling parameters
//! that change nothing but the sampling, and the simulator's own fields). Each agent
//! serves one model, so the setting is per model.
//!
//! The fields kept are copied as they are: what they hold (message content parts, tools,
//! `response_format`) is counted against the tenant's token limits where the job is
//! admitted (`metronome_protocol::input_tokens`), not rewritten here.
//!
//! Invariant: every top-level key of a built body is in its endpoint's allowlist or the
//! configured extras, and its `model` is the job's model.

use metronome_protocol::Endpoint;
use serde_json::{Map, Value};

/// Fields of both OpenAI endpoints. `stream` and `stream_options` are forced by the model
/// client; the output bounds by [`crate::bound::bound_request`].
pub const COMMON_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "user",
];

/// Fields only of `/v1/chat/completions`.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Fields only of `/v1/completions`.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "best_of", "echo", "suffix"];

/// Fields of `/v1/embeddings` (none of the generation fields above apply to it).
pub const EMBEDDING_FIELDS: &[&str] = &["model", "input", "encoding_format", "dimensions", "user"];

/// Whether `field` may travel to the model server on `endpoint`.
pub fn allowed(endpoint: Endpoint, field: &str, extra: &[String]) -> bool {
    let (common, own) = match endpoint {
        Endpoint::Chat => (COMMON_FIELDS, CHAT_FIELDS),
        Endpoint::Completion => (COMMON_FIELDS, COMPLETION_FIELDS),
        Endpoint::Embedding => (&[][..], EMBEDDING_FIELDS),
    };
    common.contains(&field) || own.contains(&field) || extra.iter().any(|e| e == field)
}

/// A body built from a job's request.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub body: Value,
    /// The request's fields left out, in the request's order.
    pub dropped: Vec<String>,
}

/// The body for the model server: the allowed fields of `request`, with `model` set to
/// `model` (the job's). A request that is not an object builds an object holding only
/// `model` (the server refuses it with a readable error, which becomes the job's).
pub fn build(endpoint: Endpoint, model: &str, request: &Value, extra: &[String]) -> Built {
    let mut body = Map::new();
    let mut dropped = Vec::new();
    if let Some(object) = request.as_object() {
        for (field, value) in object {
            if allowed(endpoint, field, extra) {
                body.insert(field.clone(), value.clone());
            } else {
                dropped.push(field.clone());
            }
        }
    }
    body.insert("model".into(), Value::from(model));
    Built {
        body: Value::Object(body),
        dropped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_outside_the_allowlist_are_left_out_and_model_is_the_jobs() {
        let request = json!({
            "model": "someone-elses-model",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.2,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template": "{{ evil }}",
            "chat_template_kwargs": {"x": 1},
            "prompt_embeds": "AAAA",
            "top_k": 5,
        });
        let built = build(Endpoint::Chat, "llama", &request, &[]);
        assert_eq!(
            built.body,
            json!({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                   "temperature": 0.2,
                   "tools": [{"type": "function", "function": {"name": "f"}}]})
        );
        assert_eq!(
            built.dropped,
            [
                "chat_template",
                "chat_template_kwargs",
                "prompt_embeds",
                "top_k"
            ]
        );
    }

    #[test]
    fn extras_are_per_endpoint_and_per_config() {
        let extra = vec!["top_k".to_string()];
        let built = build(
            Endpoint::Completion,
            "m",
            &json!({"prompt": "x", "suffix": "y", "top_k": 3, "messages": []}),
            &extra,
        );
        assert_eq!(
            built.body,
            json!({"model": "m", "prompt": "x", "suffix": "y", "top_k": 3})
        );
        assert_eq!(built.dropped, ["messages"]);
        // A chat field is not a completion's, and the reverse.
        assert!(!allowed(Endpoint::Chat, "suffix", &[]));
        assert!(!allowed(Endpoint::Completion, "tools", &[]));
        assert!(allowed(Endpoint::Embedding, "encoding_format", &[]));
        assert!(!allowed(Endpoint::Embedding, "temperature", &[]));
    }

    #[test]
    fn a_request_that_is_not_an_object_builds_only_the_model() {
        let built = build(Endpoint::Chat, "m", &json!([1, 2]), &[]);
        assert_eq!(built.body, json!({"model": "m"}));
    }

    #[test]
    fn every_built_key_is_allowed() {
        let request = json!({"a": 1, "model": 2, "prompt": 3, "messages": 4, "ignore_eos": true});
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            for kind in [
                crate::config::ServerKind::Vllm,
                crate::config::ServerKind::Simulator,
                crate::config::ServerKind::Tgi,
            ] {
                let extra: Vec<String> = kind
                    .default_extra_fields()
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                let built = build(endpoint, "m", &request, &extra);
                for key in built.body.as_object().unwrap().keys() {
                    assert!(allowed(endpoint, key, &extra), "{key}");
                }
            }
        }
    }
}
