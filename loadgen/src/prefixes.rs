//! Prefix-heavy workloads: requests whose prompts repeat what earlier prompts said, as most
//! production traffic does, so a server with a prefix cache (vLLM's automatic prefix
//! caching, SGLang's radix cache) skips the prefill of what it already holds.
//!
//! - **Shared system prompts** ([`shared_prefix_plan`]): `groups` × `users_per_group`
//!   requests, each its group's system prompt (`prefix_tokens` long, the same text for every
//!   request of the group) followed by a user message of its own. The requests come in a
//!   seeded random order, at Poisson arrivals. Modelled on SGLang's `generated-shared-prefix`
//!   benchmark dataset (groups × prompts per group × system prompt length × question length).
//! - **Multi-turn conversations** ([`multi_turn_plan`]): each conversation has a number of
//!   turns; every turn re-sends the whole history (an optional system prompt every
//!   conversation shares, then each earlier user message and assistant reply) and one new
//!   user message. Conversations start at Poisson arrivals; turn `t + 1` is sent after turn
//!   `t`'s reply time at the SLO rate (`output / 30 tok/s`) and an exponential think time.
//!   With long "user" messages and short replies, a small think time and many turns, the
//!   same generator is an agent loop: a growing transcript of tool results and tool calls.
//!
//! Synthetic, not from a data set: no public conversation corpus is bundled, so lengths,
//! turn counts and think times come from the documented distributions, seeded. Both
//! generators are pure functions of their parameters and seed; the *set* of requests (their
//! lengths and messages) does not depend on the rate, only their send times do.
//!
//! The plan is open loop like every other workload: turn `t + 1` is sent at its planned
//! time whether or not turn `t`'s reply has arrived. The history re-sends a synthetic reply
//! of the turn's `max_tokens`, not the text the server generated, so the server can reuse
//! the previous turn's prompt from its cache but not its reply (a real client re-sending the
//! server's own reply can hit that too).
//!
//! # Text
//!
//! Each message's text is rendered by [`message_text`]: `tokens` three-letter words, each
//! followed by one space, so a message is exactly `4 × tokens` characters. That is one token
//! per word in common BPE vocabularies and exactly `tokens` tokens by the 4-characters-per-token
//! rule the gateway and the simulator tokenise with ([`metronome_protocol::prefix`]), with
//! every message starting on a token boundary: a re-sent history produces the same token ids
//! as when it was first sent, and a request's prompt is `Σ (tokens + 4)` tokens over its
//! messages (4 template tokens per message). The first words spell the run's nonce (so two
//! runs never share a cache), the message's kind and its identity (group, conversation,
//! turn); the rest is filler.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::dist::LengthDist;
use crate::request::{Message, MessageKind, PlannedRequest, Role};

/// Template tokens per chat message, as the gateway and the simulator count them.
pub const TOKENS_PER_MESSAGE: u32 = metronome_protocol::prefix::CHAT_TOKENS_PER_MESSAGE;

/// Decode rate a reply is assumed to stream at when planning the next turn (the SLO's
/// default rate).
pub const REPLY_TOK_S: f64 = 30.0;

/// Prompt tokens of a chat of `messages`: content plus template tokens.
pub fn prompt_tokens_of(messages: &[Message]) -> u32 {
    messages.iter().map(|m| m.tokens + TOKENS_PER_MESSAGE).sum()
}

const DIGITS: [&str; 10] = [
    "ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "yak",
];

const FILLER: [&str; 32] = [
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old",
    "see", "two", "way", "who", "boy", "did",
];

fn kind_word(kind: MessageKind) -> &'static str {
    match kind {
        MessageKind::Group => "sys",
        MessageKind::Question => "ask",
        MessageKind::Preamble => "pre",
        MessageKind::Turn => "usr",
        MessageKind::Reply => "bot",
    }
}

/// The text of one message: exactly `tokens` (at least 1) three-letter words, each followed
/// by a space. The words start with the nonce's digits (when `nonce` is given), the kind and
/// the message's numbers, then filler.
pub fn message_text(m: &Message, nonce: Option<u64>) -> String {
    let digits = |v: u64| -> Vec<&'static str> {
        v.to_string()
            .bytes()
            .map(|d| DIGITS[usize::from(d - b'0')])
            .collect()
    };
    let head = nonce
        .map(digits)
        .unwrap_or_default()
        .into_iter()
        .chain([kind_word(m.kind)])
        .chain(digits(u64::from(m.a)))
        .chain(digits(u64::from(m.b)));
    let n = m.tokens.max(1) as usize;
    let mut out = String::with_capacity(n * 4);
    for w in head.chain(FILLER.iter().copied().cycle()).take(n) {
        out.push_str(w);
        out.push(' ');
    }
    out
}

/// One random stream of `seed` per purpose, so changing one distribution never moves the
/// draws of another.
fn stream(seed: u64, id: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(id);
    r
}

fn exp_gap<R: Rng>(rng: &mut R, mean_s: f64) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln() * mean_s
}

/// The shared-system-prompt workload: `groups × users_per_group` requests (at most `limit`,
/// only those before `duration_s`), in a seeded random order at Poisson arrivals of
/// `rate_rps`. Request of group `g`: the group's system prompt of `prefix_tokens`, then a
/// user message of `question` tokens of its own; output from `output`.
#[allow(clippy::too_many_arguments)]
pub fn shared_prefix_plan(
    rate_rps: f64,
    groups: u32,
    users_per_group: u32,
    prefix_tokens: u32,
    question: &LengthDist,
    output: &LengthDist,
    seed: u64,
    limit: Option<usize>,
    duration_s: Option<f64>,
) -> Vec<PlannedRequest> {
    if !rate_rps.is_finite() || rate_rps <= 0.0 {
        return Vec::new();
    }
    let total = groups as usize * users_per_group as usize;
    // Group of each request: every group `users_per_group` times, shuffled (Fisher-Yates).
    let mut order: Vec<u32> = (0..total)
        .map(|i| (i / users_per_group as usize) as u32)
        .collect();
    let mut shuffle = stream(seed, 0);
    for i in (1..order.len()).rev() {
        let j = shuffle.random_range(0..=i);
        order.swap(i, j);
    }
    order.truncate(limit.unwrap_or(total));
    let (mut arrivals, mut questions, mut outputs) =
        (stream(seed, 1), stream(seed, 2), stream(seed, 3));
    let mut plan = Vec::with_capacity(order.len());
    let mut t = 0.0;
    for (i, group) in order.into_iter().enumerate() {
        t += exp_gap(&mut arrivals, 1.0 / rate_rps);
        let messages = vec![
            Message {
                role: Role::System,
                kind: MessageKind::Group,
                a: group,
                b: 0,
                tokens: prefix_tokens.max(1),
            },
            Message {
                role: Role::User,
                kind: MessageKind::Question,
                a: i as u32,
                b: 0,
                tokens: question.sample(&mut questions),
            },
        ];
        let output_tokens = output.sample(&mut outputs);
        if duration_s.is_some_and(|d| t >= d) {
            break;
        }
        plan.push(PlannedRequest {
            id: i as u64,
            at_s: t,
            prompt_tokens: prompt_tokens_of(&messages),
            output_tokens,
            tenant: None,
            messages,
        });
    }
    plan
}

/// Parameters of [`multi_turn_plan`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiTurn {
    /// Mean request rate over all turns, requests/s: conversations start at
    /// `rate_rps × conversations / requests`.
    pub rate_rps: f64,
    /// Turns per conversation.
    pub turns: LengthDist,
    /// A system prompt every conversation starts with; 0: none.
    pub system_tokens: u32,
    /// Each turn's new user message (an agent loop's tool result).
    pub user_tokens: LengthDist,
    /// Each turn's reply (`max_tokens`), re-sent in later turns' history.
    pub output_tokens: LengthDist,
    /// Mean think time between a reply and the next turn, seconds (exponential).
    pub think_s: f64,
}

/// The multi-turn workload (see the module docs): conversations in order, each expanded
/// into its turns, until `limit` requests (the last conversation may be cut short); then
/// send times; then only those before `duration_s`. Ids follow send time.
pub fn multi_turn_plan(
    p: &MultiTurn,
    seed: u64,
    limit: Option<usize>,
    duration_s: Option<f64>,
) -> Vec<PlannedRequest> {
    if !p.rate_rps.is_finite() || p.rate_rps <= 0.0 || (limit.is_none() && duration_s.is_none()) {
        return Vec::new();
    }
    let (mut turns_rng, mut users, mut outputs) =
        (stream(seed, 0), stream(seed, 1), stream(seed, 2));
    // Lengths first, without times, so they do not depend on the rate. Without a limit,
    // enough conversations to fill `duration_s` at the rate.
    let wanted =
        limit.unwrap_or_else(|| (p.rate_rps * duration_s.unwrap_or(0.0) * 1.5).ceil() as usize + 1);
    let mut conversations: Vec<Vec<(u32, u32)>> = Vec::new();
    let mut count = 0usize;
    while count < wanted {
        let n = (p.turns.sample(&mut turns_rng) as usize).min(wanted - count);
        let turns = (0..n)
            .map(|_| {
                (
                    p.user_tokens.sample(&mut users),
                    p.output_tokens.sample(&mut outputs),
                )
            })
            .collect();
        count += n;
        conversations.push(turns);
    }
    let start_rate = p.rate_rps * conversations.len() as f64 / count.max(1) as f64;
    let (mut starts, mut thinks) = (stream(seed, 3), stream(seed, 4));
    let mut plan = Vec::with_capacity(count);
    let mut start = 0.0;
    for (c, turns) in conversations.iter().enumerate() {
        start += exp_gap(&mut starts, 1.0 / start_rate);
        let mut history: Vec<Message> = Vec::new();
        if p.system_tokens > 0 {
            history.push(Message {
                role: Role::System,
                kind: MessageKind::Preamble,
                a: 0,
                b: 0,
                tokens: p.system_tokens,
            });
        }
        let mut at = start;
        for (t, &(user, output)) in turns.iter().enumerate() {
            let (c, t) = (c as u32, t as u32);
            history.push(Message {
                role: Role::User,
                kind: MessageKind::Turn,
                a: c,
                b: t,
                tokens: user,
            });
            plan.push(PlannedRequest {
                id: 0,
                at_s: at,
                prompt_tokens: prompt_tokens_of(&history),
                output_tokens: output,
                tenant: None,
                messages: history.clone(),
            });
            history.push(Message {
                role: Role::Assistant,
                kind: MessageKind::Reply,
                a: c,
                b: t,
                tokens: output,
            });
            at += f64::from(output) / REPLY_TOK_S + exp_gap(&mut thinks, p.think_s.max(0.0));
        }
    }
    // Stable: equal times keep conversation order.
    plan.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    if let Some(d) = duration_s {
        plan.retain(|r| r.at_s < d);
    }
    for (i, r) in plan.iter_mut().enumerate() {
        r.id = i as u64;
    }
    plan
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use metronome_protocol::prefix::chat_token_ids;

    use super::*;

    fn lognormal(mean: f64) -> LengthDist {
        LengthDist::LogNormal {
            mean,
            sigma: 0.6,
            max: 4000,
        }
    }

    fn shared(seed: u64, rate: f64, limit: Option<usize>) -> Vec<PlannedRequest> {
        shared_prefix_plan(
            rate,
            8,
            5,
            1000,
            &lognormal(100.0),
            &lognormal(200.0),
            seed,
            limit,
            None,
        )
    }

    fn multi(seed: u64, rate: f64) -> Vec<PlannedRequest> {
        multi_turn_plan(
            &MultiTurn {
                rate_rps: rate,
                turns: LengthDist::Uniform { lo: 2, hi: 8 },
                system_tokens: 300,
                user_tokens: lognormal(80.0),
                output_tokens: lognormal(150.0),
                think_s: 3.0,
            },
            seed,
            Some(200),
            None,
        )
    }

    /// Token ids of a request's chat, as the gateway and the simulator see it.
    fn ids(r: &PlannedRequest, nonce: Option<u64>) -> Vec<u32> {
        let texts: Vec<(&str, String)> = r
            .messages
            .iter()
            .map(|m| (m.role.as_str(), message_text(m, nonce)))
            .collect();
        chat_token_ids(texts.iter().map(|(r, t)| (*r, t.as_str())))
    }

    #[test]
    fn message_text_is_four_characters_per_token() {
        for tokens in [1, 3, 7, 20, 1500] {
            let m = Message {
                role: Role::User,
                kind: MessageKind::Turn,
                a: 12_345,
                b: 67,
                tokens,
            };
            let text = message_text(&m, Some(987_654));
            assert_eq!(text.len(), 4 * tokens as usize, "{text:?}");
            assert_eq!(text.split_whitespace().count(), tokens as usize);
        }
    }

    #[test]
    fn prompt_tokens_match_the_gateways_token_count() {
        for r in shared(1, 5.0, None).iter().chain(multi(1, 5.0).iter()) {
            assert_eq!(ids(r, Some(4242)).len(), r.prompt_tokens as usize);
        }
    }

    #[test]
    fn same_seed_same_plan_other_seed_other_plan() {
        assert_eq!(shared(3, 5.0, None), shared(3, 5.0, None));
        assert_ne!(shared(3, 5.0, None), shared(4, 5.0, None));
        assert_eq!(multi(3, 5.0), multi(3, 5.0));
        assert_ne!(multi(3, 5.0), multi(4, 5.0));
    }

    #[test]
    fn the_set_of_requests_does_not_depend_on_the_rate() {
        let prompts = |p: Vec<PlannedRequest>| {
            let mut v: Vec<(Vec<Message>, u32)> = p
                .into_iter()
                .map(|r| (r.messages, r.output_tokens))
                .collect();
            v.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
            v
        };
        assert_eq!(prompts(shared(3, 1.0, None)), prompts(shared(3, 9.0, None)));
        assert_eq!(prompts(multi(3, 1.0)), prompts(multi(3, 9.0)));
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt_and_nothing_else() {
        let plan = shared(5, 5.0, None);
        assert_eq!(plan.len(), 40);
        let mut per_group: BTreeMap<u32, Vec<&PlannedRequest>> = BTreeMap::new();
        for r in &plan {
            assert_eq!(r.messages.len(), 2);
            assert_eq!(r.messages[0].kind, MessageKind::Group);
            assert_eq!(r.messages[0].tokens, 1000);
            per_group.entry(r.messages[0].a).or_default().push(r);
        }
        assert_eq!(per_group.len(), 8);
        assert!(per_group.values().all(|v| v.len() == 5));
        let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let nonce = Some(31_337);
        let (g0, g1) = (&per_group[&0], &per_group[&1]);
        let (a, b, c) = (ids(g0[0], nonce), ids(g0[1], nonce), ids(g1[0], nonce));
        // The whole system message (template and content) and the user header's start.
        assert!(common(&a, &b) >= 1004, "{}", common(&a, &b));
        assert!(common(&a, &b) < a.len().min(b.len()));
        // Other groups diverge within the first block (16 tokens).
        assert!(common(&a, &c) < 16, "{}", common(&a, &c));
        // Another run (nonce) shares nothing beyond the template's first tokens.
        assert!(common(&a, &ids(g0[0], Some(31_338))) < 16);
        // Arrivals in order, ids in plan order, and the order mixes the groups.
        assert!(plan.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(plan.iter().enumerate().all(|(i, r)| r.id == i as u64));
        assert_ne!(plan.iter().map(|r| r.messages[0].a).collect::<Vec<_>>(), {
            let mut s: Vec<u32> = plan.iter().map(|r| r.messages[0].a).collect();
            s.sort();
            s
        });
        assert_eq!(shared(5, 5.0, Some(7)).len(), 7);
    }

    #[test]
    fn every_turn_resends_the_whole_history() {
        let plan = multi(9, 5.0);
        assert_eq!(plan.len(), 200);
        let mut conversations: BTreeMap<u32, Vec<&PlannedRequest>> = BTreeMap::new();
        for r in &plan {
            let last = r.messages.last().unwrap();
            assert_eq!(last.kind, MessageKind::Turn);
            conversations.entry(last.a).or_default().push(r);
        }
        assert!(conversations.values().any(|v| v.len() >= 3));
        let nonce = Some(77);
        for turns in conversations.values() {
            for (t, pair) in turns.windows(2).enumerate() {
                let (prev, next) = (pair[0], pair[1]);
                assert_eq!(next.messages.last().unwrap().b, t as u32 + 1);
                // Next = previous prompt + its reply (of its max_tokens) + a new user message.
                assert_eq!(next.messages[..prev.messages.len()], prev.messages[..]);
                let reply = next.messages[prev.messages.len()];
                assert_eq!(reply.role, Role::Assistant);
                assert_eq!(reply.tokens, prev.output_tokens);
                assert_eq!(next.messages.len(), prev.messages.len() + 2);
                // As tokens: the previous prompt is a prefix of the next one.
                let (a, b) = (ids(prev, nonce), ids(next, nonce));
                assert_eq!(b[..a.len()], a[..]);
                // Sent after the previous turn's reply time.
                assert!(
                    next.at_s >= prev.at_s + f64::from(prev.output_tokens) / REPLY_TOK_S,
                    "{} then {}",
                    prev.at_s,
                    next.at_s
                );
            }
        }
        // Every conversation starts with the shared system prompt.
        assert!(plan
            .iter()
            .all(|r| r.messages[0].kind == MessageKind::Preamble && r.messages[0].tokens == 300));
        assert!(plan.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(plan.iter().enumerate().all(|(i, r)| r.id == i as u64));
    }

    #[test]
    fn multi_turn_mean_rate_is_about_the_target() {
        let plan = multi_turn_plan(
            &MultiTurn {
                rate_rps: 20.0,
                turns: LengthDist::Uniform { lo: 1, hi: 5 },
                system_tokens: 0,
                user_tokens: LengthDist::Fixed(10),
                output_tokens: LengthDist::Fixed(30),
                think_s: 1.0,
            },
            2,
            Some(20_000),
            None,
        );
        // Conversations start at 20/3 per second; over the run's span requests arrive at
        // about 20 per second (the last conversations' tails stretch it a little).
        let rate = plan.len() as f64 / plan.last().unwrap().at_s;
        assert!((rate / 20.0 - 1.0).abs() < 0.05, "{rate}");
        assert!(plan.iter().all(|r| r.messages[0].role == Role::User));
    }
}
