//! Which endpoint a response belongs to: the chat or the legacy completion shape of its
//! objects and choices, which the response, its logprobs and its chunks all follow.

/// Which endpoint a response belongs to: decides the object names and choice shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}
