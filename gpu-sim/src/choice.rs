//! What one choice of a request writes, decided before it is queued (the simulator knows
//! its output up front): its tokens, where it stops, and whether it is a tool call.
//!
//! - **Text.** Choice `i` draws its words from the text generator seeded by the server's
//!   seed and the prompt (choice 0 exactly as a single-choice request; choice `i > 0` from
//!   the prompt with `i` folded in, so `n` choices differ from each other), and its length
//!   from `eos_probability` (`max_tokens` with `ignore_eos`).
//! - **Stop sequences** (`stop`: a string or up to 4): generation ends at the token that
//!   completes the earliest occurrence of any of them; the text ends before it (the stop
//!   string is not returned), `finish_reason` is `stop` and `stop_reason` names it, as vLLM
//!   answers. A token cut by the stop keeps only its part before it; tokens wholly after
//!   the cut write nothing but were generated (they count in the usage).
//! - **Tool calls** (chat with `tools` and a `tool_choice` of `required` or a named
//!   function): the answer is one call of that function (`required`: the first tool), its
//!   arguments a JSON object with one value per property of the function's parameters
//!   (strings are vocabulary words, numbers small integers, booleans `true`), written in
//!   fragments of up to 4 characters, one per token; `finish_reason` `tool_calls`.
//!   `tool_choice` `auto` or `none` answers with text, as a model that chose not to call.
//!
//! Every choice stops at `max_tokens` (`finish_reason` `length`).

use serde_json::{Map, Value};

use crate::logprobs::{LogprobSampler, LogprobsRequest, TokenLogprobs};
use crate::text::TextGenerator;

/// Characters of a tool call's arguments written per token.
const ARGUMENT_CHARS_PER_TOKEN: usize = 4;

/// The function a request makes the model call.
#[derive(Debug, Clone, PartialEq)]
pub struct ForcedTool {
    pub name: String,
    /// The function's JSON Schema `parameters` (its `properties` give the arguments).
    pub parameters: Value,
}

/// A tool call a choice writes.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
}

/// Everything that decides a request's choices.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    pub seed: u64,
    pub prompt_key: &'a str,
    pub max_tokens: u32,
    pub eos_probability: f64,
    pub ignore_eos: bool,
    pub stop: &'a [String],
    pub logprobs: Option<LogprobsRequest>,
    pub tool: Option<&'a ForcedTool>,
}

/// One planned choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// What each generated token writes (a tool call: its arguments' fragments); empty
    /// after a stop sequence's cut.
    pub pieces: Vec<String>,
    /// Each token's log-probabilities when asked for: `None` for a token the stop cut.
    pub logprobs: Option<Vec<Option<TokenLogprobs>>>,
    pub finish_reason: &'static str,
    /// The stop sequence that ended the choice.
    pub stop_reason: Option<String>,
    pub tool_call: Option<ToolCall>,
}

impl Choice {
    /// Tokens generated (what the GPU runs and the usage counts).
    pub fn tokens(&self) -> u32 {
        u32::try_from(self.pieces.len()).unwrap_or(u32::MAX)
    }

    /// Whether it ended before `max_tokens`.
    pub fn stopped_early(&self) -> bool {
        self.finish_reason != "length"
    }

    /// The whole text (a tool call: its arguments).
    pub fn text(&self) -> String {
        self.pieces.concat()
    }
}

impl Plan<'_> {
    /// Choice `index` of the request.
    pub fn choice(&self, index: u32) -> Choice {
        let key = if index == 0 {
            self.prompt_key.to_string()
        } else {
            format!("{}\u{1f}{index}", self.prompt_key)
        };
        let mut text = TextGenerator::new(self.seed, &key);
        if let Some(tool) = self.tool {
            return self.tool_call(tool, &mut text);
        }
        let length = if self.ignore_eos {
            self.max_tokens
        } else {
            text.sample_length(self.eos_probability, self.max_tokens)
        };
        let tokens: Vec<String> = (0..length).map(|_| text.next_token()).collect();
        let mut finish_reason = if length < self.max_tokens {
            "stop"
        } else {
            "length"
        };
        let mut stop_reason = None;
        let mut pieces = tokens.clone();
        if let Some((start, end, stop)) = earliest_stop(&tokens.concat(), self.stop) {
            let mut at = 0;
            let mut kept = Vec::new();
            for t in &tokens {
                let (from, to) = (at, at + t.len());
                at = to;
                kept.push(t[..start.clamp(from, to) - from].to_string());
                if to >= end {
                    break;
                }
            }
            pieces = kept;
            finish_reason = "stop";
            stop_reason = Some(stop.to_string());
        }
        let logprobs = self.logprobs.map(|asked| {
            let mut sampler = LogprobSampler::new(self.seed, self.prompt_key, index, asked.top);
            tokens
                .iter()
                .zip(&pieces)
                .map(|(t, p)| {
                    let entry = sampler.next(t);
                    (p == t).then_some(entry)
                })
                .collect()
        });
        Choice {
            pieces,
            logprobs,
            finish_reason,
            stop_reason,
            tool_call: None,
        }
    }

    fn tool_call(&self, tool: &ForcedTool, text: &mut TextGenerator) -> Choice {
        let mut arguments = Map::new();
        if let Some(properties) = tool.parameters.get("properties").and_then(Value::as_object) {
            for (name, schema) in properties {
                let value = match schema.get("type").and_then(Value::as_str) {
                    Some("integer") | Some("number") => Value::from(text.next_token().len()),
                    Some("boolean") => Value::Bool(true),
                    Some("array") => Value::Array(Vec::new()),
                    Some("object") => Value::Object(Map::new()),
                    _ => Value::from(text.next_token().trim()),
                };
                arguments.insert(name.clone(), value);
            }
        }
        let arguments = Value::Object(arguments).to_string();
        let chars: Vec<char> = arguments.chars().collect();
        let mut pieces: Vec<String> = chars
            .chunks(ARGUMENT_CHARS_PER_TOKEN)
            .map(|c| c.iter().collect())
            .collect();
        let finish_reason = if pieces.len() > self.max_tokens as usize {
            pieces.truncate(self.max_tokens as usize);
            "length"
        } else {
            "tool_calls"
        };
        Choice {
            logprobs: self.logprobs.map(|_| vec![None; pieces.len()]),
            pieces,
            finish_reason,
            stop_reason: None,
            tool_call: Some(ToolCall {
                id: format!("chatcmpl-tool-{}", uuid::Uuid::new_v4().simple()),
                name: tool.name.clone(),
            }),
        }
    }
}

/// The earliest occurrence of any stop sequence in `text`: its byte range and the sequence.
fn earliest_stop<'s>(text: &str, stops: &'s [String]) -> Option<(usize, usize, &'s str)> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            text.find(s.as_str())
                .map(|at| (at, at + s.len(), s.as_str()))
        })
        .min_by_key(|(start, end, _)| (*start, *end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan<'a>(stop: &'a [String], tool: Option<&'a ForcedTool>) -> Plan<'a> {
        Plan {
            seed: 42,
            prompt_key: "user\nhello\n",
            max_tokens: 40,
            eos_probability: 0.0,
            ignore_eos: false,
            stop,
            logprobs: Some(LogprobsRequest { top: 1 }),
            tool,
        }
    }

    #[test]
    fn choices_differ_and_the_first_is_the_single_choice_answer() {
        let p = plan(&[], None);
        let (a, b) = (p.choice(0), p.choice(1));
        assert_ne!(a.text(), b.text());
        assert_eq!(a, p.choice(0));
        let mut single = TextGenerator::new(42, "user\nhello\n");
        let words: String = (0..40).map(|_| single.next_token()).collect();
        assert_eq!(a.text(), words);
        assert_eq!((a.tokens(), a.finish_reason), (40, "length"));
    }

    #[test]
    fn a_stop_sequence_ends_the_text_before_it() {
        let full = plan(&[], None).choice(0);
        // Stop at the fourth word (without its leading space), found in the full text.
        let word = full.pieces[3].trim().to_string();
        let stops = vec!["never there".to_string(), word.clone()];
        let c = plan(&stops, None).choice(0);
        let text = c.text();
        assert_eq!(c.finish_reason, "stop");
        assert_eq!(c.stop_reason.as_deref(), Some(word.as_str()));
        assert!(!text.contains(&word), "{text}");
        assert!(full.text().starts_with(&text));
        let at = full.text().find(&word).unwrap();
        assert_eq!(text.len(), at, "cut right before the stop");
        assert!(
            c.tokens() <= 4,
            "generation ends at the token completing it"
        );
        let lp = c.logprobs.unwrap();
        assert_eq!(lp.len(), c.pieces.len());
        assert!(lp.last().unwrap().is_none(), "the cut token has no entry");
    }

    #[test]
    fn a_forced_tool_is_called_with_one_value_per_property() {
        let tool = ForcedTool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}),
        };
        let c = plan(&[], Some(&tool)).choice(0);
        assert_eq!(c.finish_reason, "tool_calls");
        assert_eq!(c.tool_call.as_ref().unwrap().name, "get_weather");
        let args: Value = serde_json::from_str(&c.text()).unwrap();
        assert!(args["city"].is_string() && args["days"].is_u64(), "{args}");
        assert_eq!(args["metric"], true);
        assert!(c.pieces.iter().all(|p| p.chars().count() <= 4));
    }
}
