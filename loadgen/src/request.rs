//! One planned request: when it is sent, its token counts, its tenant, and the chat it
//! sends. The arrival plans ([`crate::plan`], [`crate::prefixes`]) produce them, the
//! client ([`crate::client`]) sends them.

use serde::{Deserialize, Serialize};

/// One request to send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedRequest {
    pub id: u64,
    /// Seconds after the run's start at which it is sent.
    pub at_s: f64,
    pub prompt_tokens: u32,
    /// Requested output length (`max_tokens`).
    pub output_tokens: u32,
    /// Index of its tenant in the spec's `tenants`, when the spec has tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<usize>,
    /// The chat it sends, for the prefix-heavy workloads ([`crate::prefixes`]): messages
    /// whose texts later requests repeat, `prompt_tokens` long in all. Empty: one user
    /// message of `prompt_tokens` filler words ([`crate::prompt`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<Message>,
}

/// Who says a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// What a message is, which with its numbers names its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageKind {
    /// A group's system prompt (`a` = group).
    Group,
    /// One request's own user message (`a` = its index in the workload).
    Question,
    /// The system prompt every conversation shares.
    Preamble,
    /// A conversation's user message (`a` = conversation, `b` = turn).
    Turn,
    /// A conversation's assistant reply (`a` = conversation, `b` = turn).
    Reply,
}

/// One chat message of a planned prompt: its text is
/// [`message_text`](crate::prefixes::message_text) of these fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub kind: MessageKind,
    pub a: u32,
    pub b: u32,
    /// Content tokens (template tokens not included).
    pub tokens: u32,
}
