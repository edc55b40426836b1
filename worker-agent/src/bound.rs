//! A job's declared size binds what runs: the request forwarded to the model server may
//! generate no more output tokens than the job's `max_tokens`, whatever its body says.
//!
//! The dispatcher reserved KV cache and predicted the run time from the job's
//! `max_tokens`, the output bound of the whole job: every choice of every prompt
//! (`n` × prompts, or `best_of` × prompts when a completion asks the server to generate
//! more candidates than it returns). A NATS client (or a compromised gateway) can declare a
//! small job and send a body asking for far more; the model server would honour the body.
//! So the agent rewrites the body's per-choice bound to `max_tokens / choices` (keeping a
//! smaller value the body already asks for), and refuses a body whose choices alone exceed
//! the job's bound (not one token each fits).
//!
//! Invariant: for a body this returns `Ok` for, `choices × per-choice bound ≤ max_tokens`.

use serde_json::{Map, Value};

/// The body asks for more choices than the job's output bound allows one token each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the request generates {choices} choices but the job allows {max_tokens} output tokens in all"
)]
pub struct TooManyChoices {
    pub choices: u64,
    pub max_tokens: u32,
}

/// Fields that bound one choice's output (vLLM and OpenAI honour the first when both are
/// set): each present one is bounded, and `max_tokens` is always set.
const BOUND_FIELDS: [&str; 2] = ["max_completion_tokens", "max_tokens"];

/// `request` with its output bounded by the job's `max_tokens` (see the module doc).
pub fn bound_request(mut request: Value, max_tokens: u32) -> Result<Value, TooManyChoices> {
    let Some(object) = request.as_object_mut() else {
        // Not an object: the server refuses it; nothing to bound.
        return Ok(request);
    };
    let choices = choices(object);
    let per_choice = u64::from(max_tokens) / choices;
    if per_choice == 0 {
        return Err(TooManyChoices {
            choices,
            max_tokens,
        });
    }
    for field in BOUND_FIELDS {
        let asked = object.get(field).and_then(Value::as_u64);
        let present = object.get(field).is_some_and(|v| !v.is_null());
        if field == "max_tokens" || present {
            let bound = asked
                .filter(|&a| a >= 1)
                .map_or(per_choice, |a| a.min(per_choice));
            object.insert(field.into(), Value::from(bound));
        }
    }
    Ok(request)
}

/// Sequences the body makes the server generate: `max(n, best_of)` per prompt, times the
/// prompts of a batched completion. A missing, null or unreadable count is 1 (the server
/// refuses what it cannot read).
fn choices(object: &Map<String, Value>) -> u64 {
    let count = |field: &str| {
        object
            .get(field)
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .max(1)
    };
    let per_prompt = count("n").max(count("best_of"));
    per_prompt.saturating_mul(prompts(object.get("prompt")))
}

/// Prompts of a completion body: a list of strings or a list of token lists is a batch; a
/// string, a token list or a chat body (no `prompt`) is one.
fn prompts(prompt: Option<&Value>) -> u64 {
    match prompt {
        Some(Value::Array(items))
            if !items.is_empty() && items.iter().all(|i| i.is_string() || i.is_array()) =>
        {
            items.len() as u64
        }
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_body_asking_for_more_is_cut_to_the_job_bound() {
        let r = bound_request(json!({"max_tokens": 5000, "messages": []}), 16).unwrap();
        assert_eq!(r["max_tokens"], 16);
        let r = bound_request(
            json!({"max_completion_tokens": 9000, "max_tokens": 10, "messages": []}),
            16,
        )
        .unwrap();
        assert_eq!(
            (r["max_completion_tokens"].clone(), r["max_tokens"].clone()),
            (json!(16), json!(10))
        );
    }

    #[test]
    fn a_missing_bound_is_added_and_a_smaller_one_kept() {
        let r = bound_request(json!({"messages": []}), 64).unwrap();
        assert_eq!(r["max_tokens"], 64);
        assert!(r.get("max_completion_tokens").is_none());
        let r = bound_request(json!({"max_tokens": 3}), 64).unwrap();
        assert_eq!(r["max_tokens"], 3);
    }

    #[test]
    fn choices_share_the_bound() {
        let r = bound_request(json!({"n": 4, "max_tokens": 100}), 100).unwrap();
        assert_eq!(r["max_tokens"], 25);
        let r = bound_request(json!({"prompt": ["a", "b"], "n": 2, "best_of": 5}), 100).unwrap();
        assert_eq!(r["max_tokens"], 10, "best_of 5 x 2 prompts");
        let r = bound_request(json!({"prompt": [1, 2, 3]}), 100).unwrap();
        assert_eq!(r["max_tokens"], 100, "one tokenised prompt");
        let r = bound_request(json!({"prompt": [[1], [2]]}), 100).unwrap();
        assert_eq!(r["max_tokens"], 50, "two tokenised prompts");
    }

    #[test]
    fn more_choices_than_tokens_is_refused() {
        assert_eq!(
            bound_request(json!({"n": 128}), 64),
            Err(TooManyChoices {
                choices: 128,
                max_tokens: 64
            })
        );
    }

    #[test]
    fn the_bound_holds_for_any_counts() {
        for n in 1..20u64 {
            for prompts in 1..5usize {
                for max in [1u32, 7, 64, 1000] {
                    let body = json!({"n": n, "prompt": vec!["p"; prompts], "max_tokens": 100_000});
                    if let Ok(r) = bound_request(body, max) {
                        let per = r["max_tokens"].as_u64().unwrap();
                        assert!(per >= 1 && per * n * prompts as u64 <= u64::from(max));
                    }
                }
            }
        }
    }
}
