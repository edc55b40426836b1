//! The hostile drill's generator: a seeded stream of messages a buggy or compromised client
//! could publish with the permissions of the identity that writes each subject (the admin
//! identity, which may write all of them), and the account of where each was rejected.
//!
//! Targets and what must happen to each message (issue 9: "no single message may stop a
//! component; a malformed message is rejected with a reason an operator can see"):
//! - `jobs.submit`: mutations of a valid job (truncated JSON, wrong types, huge and negative
//!   numbers, control characters and CR/LF in each string field, unicode oddities, bodies
//!   above the job size limit and above the server's payload limit, deep nesting, bogus
//!   versions, expired deadlines, unknown models, `max_tokens` and `n` extremes, bad
//!   tenants, priorities and SLOs, forged retry headers). Each gets a rejected (or expired)
//!   decision with a reason code when its id can be read, a `deadletter.jobs` record when it
//!   cannot, or the server's refusal at publish time.
//! - `cancel.<tenant>.<id>`: unknown and odd job ids and tenant tokens, any payload, and
//!   the drill's own running jobs (tenant `_anon`) named under other tenants: a no-op
//!   (nothing is cancelled; the drill fails if one of its jobs ends `cancelled`).
//! - `events.done.<worker>`: malformed events, events naming another worker or non-token
//!   ids: ignored and counted (`metronome_dispatcher_ignored_worker_messages_total`).
//!   Refusals carrying a job the worker was never given (a made-up id, another tenant):
//!   the copy is dropped and counted
//!   (`metronome_dispatcher_unvouched_refusal_jobs_total`), and the job is never decided.
//! - `$KV.workers.<key>` (heartbeats): malformed values, values under another worker's key,
//!   non-token ids, empty or control-character models: ignored and counted the same way.
//! - `work.<worker>` (assignments, to the real agents): malformed bodies, invalid jobs,
//!   assignments naming another worker, stale and impossible epochs: terminated, refused or
//!   dead-lettered by the agent and counted in its metrics.
//!
//! A few jobs are hostile but valid (CR/LF, NUL-free control characters and unicode in the
//! prompt, for the drill's real model): they must be served, and join the drill's per-job
//! account like every normal job.
//!
//! Generation is pure ([`message`]): the same seed and index give the same message, so a
//! finding can be replayed.

use std::collections::BTreeMap;

use bytes::Bytes;
use metronome_protocol::names::{
    self, event_done_subject, work_subject, BUCKET_WORKERS, HEADER_ATTEMPT, HEADER_MSG_ID,
    HEADER_ORDER,
};
use metronome_protocol::PROTOCOL_VERSION;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// Where the system must show that it rejected a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sink {
    /// A rejected or expired decision on `decisions.<id>` (with a reason code).
    Decision,
    /// A record on `deadletter.jobs` (no usable id).
    DeadLetter,
    /// Either a decision or a dead letter (the mutation may or may not leave an id).
    DecisionOrDeadLetter,
    /// The server refuses it at publish time (above its payload limit).
    ServerRefusal,
    /// Ignored and counted by the dispatcher (`ignored_worker_messages_total`).
    DispatcherIgnored,
    /// Terminated, refused or dead-lettered by the agent (its metrics).
    AgentRejected,
    /// A refusal's carried job dropped by the dispatcher (no decision vouches for it):
    /// counted, and never decided.
    CopyDropped,
    /// Nothing to reject: a cancel of a job nobody holds is a no-op.
    NoOp,
    /// Valid: must be served like a normal job (counted in the drill's account).
    Served,
}

/// One kind of hostile message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Truncated,
    WrongType,
    HugeNumber,
    NegativeNumber,
    ControlChars,
    CrLfInId,
    Unicode,
    NotUtf8,
    NotAnObject,
    DeepNesting,
    OverJobLimit,
    OverServerLimit,
    BogusVersion,
    ExpiredDeadline,
    UnknownModel,
    TokenExtremes,
    BadTenant,
    BadSlo,
    BadPriority,
    ForgedRetryHeaders,
    DuplicateId,
    ValidOddPrompt,
    Cancel,
    EventMalformed,
    EventForged,
    EventRefusalMadeUpJob,
    HeartbeatMalformed,
    HeartbeatForeignKey,
    HeartbeatBadFields,
    WorkMalformed,
    WorkInvalidJob,
    WorkOtherWorker,
    WorkStaleEpoch,
    WorkFutureEpoch,
}

impl Class {
    pub const ALL: [Class; 34] = [
        Class::Truncated,
        Class::WrongType,
        Class::HugeNumber,
        Class::NegativeNumber,
        Class::ControlChars,
        Class::CrLfInId,
        Class::Unicode,
        Class::NotUtf8,
        Class::NotAnObject,
        Class::DeepNesting,
        Class::OverJobLimit,
        Class::OverServerLimit,
        Class::BogusVersion,
        Class::ExpiredDeadline,
        Class::UnknownModel,
        Class::TokenExtremes,
        Class::BadTenant,
        Class::BadSlo,
        Class::BadPriority,
        Class::ForgedRetryHeaders,
        Class::DuplicateId,
        Class::ValidOddPrompt,
        Class::Cancel,
        Class::EventMalformed,
        Class::EventForged,
        Class::EventRefusalMadeUpJob,
        Class::HeartbeatMalformed,
        Class::HeartbeatForeignKey,
        Class::HeartbeatBadFields,
        Class::WorkMalformed,
        Class::WorkInvalidJob,
        Class::WorkOtherWorker,
        Class::WorkStaleEpoch,
        Class::WorkFutureEpoch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Truncated => "submit: truncated JSON",
            Class::WrongType => "submit: wrong type",
            Class::HugeNumber => "submit: huge number",
            Class::NegativeNumber => "submit: negative number",
            Class::ControlChars => "submit: control chars / CR LF in a string field",
            Class::CrLfInId => "submit: CR LF in the id",
            Class::Unicode => "submit: unicode oddities",
            Class::NotUtf8 => "submit: not UTF-8",
            Class::NotAnObject => "submit: not an object / empty",
            Class::DeepNesting => "submit: deep nesting",
            Class::OverJobLimit => "submit: above the job size limit",
            Class::OverServerLimit => "submit: above the server payload limit",
            Class::BogusVersion => "submit: bogus version",
            Class::ExpiredDeadline => "submit: expired deadline",
            Class::UnknownModel => "submit: unknown model",
            Class::TokenExtremes => "submit: max_tokens / n extremes",
            Class::BadTenant => "submit: bad tenant",
            Class::BadSlo => "submit: bad SLO",
            Class::BadPriority => "submit: bad priority / endpoint",
            Class::ForgedRetryHeaders => "submit: forged retry headers",
            Class::DuplicateId => "submit: duplicate id (new msg id)",
            Class::ValidOddPrompt => "submit: valid, odd prompt (served)",
            Class::Cancel => "cancel: another tenant's / unknown / odd ids",
            Class::EventMalformed => "events: malformed",
            Class::EventForged => "events: foreign worker / non-token ids",
            Class::EventRefusalMadeUpJob => "events: refusal carrying a job never given",
            Class::HeartbeatMalformed => "heartbeat KV: malformed",
            Class::HeartbeatForeignKey => "heartbeat KV: id differs from key",
            Class::HeartbeatBadFields => "heartbeat KV: non-token id / bad model",
            Class::WorkMalformed => "work: malformed",
            Class::WorkInvalidJob => "work: invalid job",
            Class::WorkOtherWorker => "work: names another worker",
            Class::WorkStaleEpoch => "work: stale epoch",
            Class::WorkFutureEpoch => "work: impossible epoch (u64::MAX)",
        }
    }

    pub fn sink(self) -> Sink {
        match self {
            Class::Truncated | Class::CrLfInId | Class::NotAnObject | Class::DeepNesting => {
                Sink::DeadLetter
            }
            Class::WrongType | Class::Unicode | Class::NotUtf8 => Sink::DecisionOrDeadLetter,
            Class::OverServerLimit => Sink::ServerRefusal,
            Class::HugeNumber
            | Class::NegativeNumber
            | Class::ControlChars
            | Class::OverJobLimit
            | Class::BogusVersion
            | Class::ExpiredDeadline
            | Class::UnknownModel
            | Class::TokenExtremes
            | Class::BadTenant
            | Class::BadSlo
            | Class::BadPriority
            | Class::ForgedRetryHeaders
            | Class::DuplicateId => Sink::Decision,
            Class::ValidOddPrompt => Sink::Served,
            Class::Cancel => Sink::NoOp,
            Class::EventRefusalMadeUpJob => Sink::CopyDropped,
            Class::EventMalformed
            | Class::EventForged
            | Class::HeartbeatMalformed
            | Class::HeartbeatForeignKey
            | Class::HeartbeatBadFields => Sink::DispatcherIgnored,
            Class::WorkMalformed
            | Class::WorkInvalidJob
            | Class::WorkOtherWorker
            | Class::WorkStaleEpoch
            | Class::WorkFutureEpoch => Sink::AgentRejected,
        }
    }

    /// Relative share of the flood; the heavy classes get a fixed count instead
    /// ([`fixed_count`]).
    fn weight(self) -> u32 {
        match self {
            Class::Cancel => 8,
            Class::EventMalformed | Class::EventForged | Class::EventRefusalMadeUpJob => 4,
            Class::HeartbeatMalformed | Class::HeartbeatForeignKey | Class::HeartbeatBadFields => 3,
            Class::WorkMalformed | Class::WorkInvalidJob => 2,
            Class::WorkOtherWorker | Class::WorkStaleEpoch => 1,
            _ => 4,
        }
    }
}

/// Classes sent a fixed number of times whatever the flood's size: bodies of megabytes,
/// jobs that run, and the message that must not poison an agent (one is enough).
fn fixed_count(class: Class, total: usize) -> Option<usize> {
    let big = if total >= 50_000 { 12 } else { 3 };
    match class {
        Class::OverJobLimit | Class::OverServerLimit => Some(big),
        Class::ValidOddPrompt | Class::DuplicateId => Some(if total >= 50_000 { 30 } else { 6 }),
        Class::WorkFutureEpoch => Some(1),
        _ => None,
    }
}

/// How many messages of each class a flood of `total` sends (summing to `total`).
pub fn plan(total: usize) -> BTreeMap<Class, usize> {
    let mut out = BTreeMap::new();
    let fixed: usize = Class::ALL
        .iter()
        .filter_map(|c| fixed_count(*c, total))
        .sum();
    let rest = total.saturating_sub(fixed);
    let weights: u32 = Class::ALL
        .iter()
        .filter(|c| fixed_count(**c, total).is_none())
        .map(|c| c.weight())
        .sum();
    let mut given = 0;
    for c in Class::ALL {
        let n = match fixed_count(c, total) {
            Some(n) => n,
            None => rest * c.weight() as usize / weights as usize,
        };
        given += n;
        out.insert(c, n);
    }
    // Rounding: the remainder goes to the largest job class.
    *out.entry(Class::UnknownModel).or_default() += total.saturating_sub(given);
    out
}

/// What the generator knows of the system it attacks.
#[derive(Debug, Clone)]
pub struct Context {
    /// Prefix of every hostile job id (so its decisions can be told apart).
    pub prefix: String,
    /// The model the real workers serve.
    pub model: String,
    /// The real workers' ids.
    pub workers: Vec<String>,
    /// The leader's epoch now (assignments below it are stale).
    pub epoch: u64,
    /// Id prefix of the drill's normal jobs (`<victims>-<n>`, tenant `_anon`), named in
    /// cancels under other tenants.
    pub victims: String,
    /// The dispatcher's job size limit, in bytes.
    pub max_job_bytes: usize,
    pub now_ms: u64,
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Hostile {
    pub class: Class,
    pub subject: String,
    pub headers: Option<async_nats::HeaderMap>,
    pub payload: Bytes,
    /// Stored by JetStream (publish and wait for the ack) or core NATS.
    pub jetstream: bool,
    /// The job id its decision will carry, when one can be read.
    pub job_id: Option<String>,
}

const STRING_FIELDS: [&str; 4] = ["id", "model", "tenant", "endpoint"];
/// The Job's integer fields.
const NUMBER_FIELDS: [&str; 5] = [
    "prompt_tokens",
    "max_tokens",
    "v",
    "submitted_ms",
    "deadline_ms",
];

fn valid_job(ctx: &Context, id: &str, model: &str) -> Value {
    json!({
        "v": PROTOCOL_VERSION,
        "id": id,
        "model": model,
        "endpoint": "chat",
        "request": {"model": model, "stream": true,
            "messages": [{"role": "user", "content": "hostile drill"}], "max_tokens": 8},
        "prompt_tokens": 4,
        "max_tokens": 8,
        "submitted_ms": ctx.now_ms,
        "deadline_ms": ctx.now_ms + 120_000,
    })
}

fn odd_char(rng: &mut ChaCha8Rng) -> char {
    const ODD: [char; 12] = [
        '\r', '\n', '\u{0}', '\u{7}', '\u{1b}', '\u{7f}', '\u{85}', '\u{2028}', '\u{202e}',
        '\u{200d}', '\u{feff}', '\u{fffd}',
    ];
    ODD[rng.random_range(0..ODD.len())]
}

fn headers(pairs: &[(&str, String)]) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, v.as_str());
    }
    h
}

/// Message `index` of the flood of `seed`, of `class`.
pub fn message(seed: u64, index: u64, class: Class, ctx: &Context) -> Hostile {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let id = format!("{}-{index}", ctx.prefix);
    let unknown = format!("hostile-model-{}", rng.random_range(0..1_000_000u32));
    let mut job = valid_job(ctx, &id, &unknown);
    let worker = ctx.workers[rng.random_range(0..ctx.workers.len())].clone();
    // On the subject of the tenant the body names when that is a subject token (so a job
    // is judged on its own faults, not on a tenant mismatch), else the anonymous one.
    let submit = |payload: Vec<u8>, job_id: Option<&str>| Hostile {
        class,
        subject: names::submit_subject(
            serde_json::from_slice::<Value>(&payload)
                .ok()
                .and_then(|v| v["tenant"].as_str().map(str::to_string))
                .filter(|t| names::is_subject_token(t) && !t.starts_with('_'))
                .as_deref(),
        ),
        headers: None,
        payload: payload.into(),
        jetstream: true,
        job_id: job_id.map(str::to_string),
    };
    let enc = |v: &Value| serde_json::to_vec(v).expect("json");
    match class {
        Class::Truncated => {
            let full = enc(&job);
            // Cut before the closing brace, anywhere from the first byte.
            let cut = rng.random_range(0..full.len() - 1);
            submit(full[..cut].to_vec(), None)
        }
        Class::WrongType => {
            let fields = [
                "v",
                "model",
                "endpoint",
                "prompt_tokens",
                "max_tokens",
                "submitted_ms",
                "deadline_ms",
                "slo",
                "tenant",
                "priority",
            ];
            let f = fields[rng.random_range(0..fields.len())];
            let bad = [
                json!("many"),
                json!([1, 2]),
                json!({"x": 1}),
                json!(true),
                json!(1.5),
            ];
            job[f] = bad[rng.random_range(0..bad.len())].clone();
            submit(enc(&job), Some(&id))
        }
        Class::HugeNumber => {
            // `max_tokens` + `prompt_tokens` = 2 × u32::MAX: fits the fields, not the limit.
            if rng.random_bool(0.2) {
                job["max_tokens"] = json!(u32::MAX);
                job["prompt_tokens"] = json!(u32::MAX);
                return submit(enc(&job), Some(&id));
            }
            let f = NUMBER_FIELDS[rng.random_range(0..NUMBER_FIELDS.len())];
            // u32 and u64 overflow, floats, 1e300: each must be refused, not wrapped.
            let huge = [
                "4294967296",
                "18446744073709551616",
                "1e300",
                "340282366920938463463374607431768211456",
            ][rng.random_range(0..4)];
            job[f] = json!("__HUGE__");
            let text = String::from_utf8(enc(&job)).expect("utf8");
            submit(
                text.replacen("\"__HUGE__\"", huge, 1).into_bytes(),
                Some(&id),
            )
        }
        Class::NegativeNumber => {
            let f = NUMBER_FIELDS[rng.random_range(0..NUMBER_FIELDS.len())];
            job[f] = json!(-(rng.random_range(1..i64::MAX)));
            submit(enc(&job), Some(&id))
        }
        Class::ControlChars => {
            // The id cannot carry them (then nothing can be salvaged): `CrLfInId`.
            let f = STRING_FIELDS[1 + rng.random_range(0..STRING_FIELDS.len() - 1)];
            let base = if f == "model" {
                ctx.model.clone()
            } else {
                "x".into()
            };
            let mut s: String = base;
            let at = rng.random_range(0..=s.len());
            s.insert(at, odd_char(&mut rng));
            s.insert_str(at, "\r\n");
            job[f] = json!(s);
            submit(enc(&job), Some(&id))
        }
        Class::CrLfInId => {
            job["id"] = json!(format!("{id}\r\nNats-Msg-Id: x"));
            submit(enc(&job), None)
        }
        Class::Unicode => {
            let odd = [
                "mödel-ünï",
                "\u{202e}b8-1.3-amall",
                "llama\u{200d}-3.1-8b",
                "\u{1F600}",
                "\u{feff}llama-3.1-8b",
            ];
            job["model"] = json!(odd[rng.random_range(0..odd.len())]);
            if rng.random_bool(0.3) {
                // A lone surrogate: JSON-escaped, not valid UTF-16.
                let text = String::from_utf8(enc(&job)).expect("utf8");
                let text = text.replacen("hostile drill", "\\ud800 drill", 1);
                return submit(text.into_bytes(), Some(&id));
            }
            submit(enc(&job), Some(&id))
        }
        Class::NotUtf8 => {
            let mut body = enc(&job);
            let at = rng.random_range(0..body.len());
            body[at] = [0xff, 0xc0, 0x80, 0xfe][rng.random_range(0..4)];
            // Some bytes land in the id; most leave it readable. Either way: rejected.
            submit(body, Some(&id))
        }
        Class::NotAnObject => {
            let bodies: [&[u8]; 7] = [b"", b"null", b"[1,2,3]", b"42", b"\"job\"", b" ", b"{}"];
            submit(bodies[rng.random_range(0..bodies.len())].to_vec(), None)
        }
        Class::DeepNesting => {
            let depth = rng.random_range(200..20_000);
            let text = format!("{{\"id\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
            submit(text.into_bytes(), None)
        }
        Class::OverJobLimit | Class::OverServerLimit => {
            let size = if class == Class::OverJobLimit {
                ctx.max_job_bytes + 1024
            } else {
                // Above nats-server's max_payload (8 MB in `./dev up`).
                9 * 1024 * 1024
            };
            job["request"]["messages"][0]["content"] = json!("x".repeat(size));
            job["model"] = json!(ctx.model);
            submit(enc(&job), Some(&id))
        }
        Class::BogusVersion => {
            job["v"] = json!(
                [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, u32::MAX][rng.random_range(0..4)]
            );
            submit(enc(&job), Some(&id))
        }
        Class::ExpiredDeadline => {
            job["model"] = json!(ctx.model);
            job["request"]["model"] = json!(ctx.model);
            job["deadline_ms"] =
                json!([0, 1, ctx.now_ms.saturating_sub(3_600_000)][rng.random_range(0..3)]);
            submit(enc(&job), Some(&id))
        }
        Class::UnknownModel => submit(enc(&job), Some(&id)),
        Class::TokenExtremes => {
            match rng.random_range(0..3) {
                0 => job["max_tokens"] = json!(0),
                1 => {
                    job["max_tokens"] = json!(u32::MAX);
                }
                _ => {
                    // `n` is the model server's business; with an unknown model it is
                    // rejected before any server sees it.
                    job["request"]["n"] = json!(u32::MAX);
                    job["request"]["max_tokens"] = json!(-1);
                }
            }
            submit(enc(&job), Some(&id))
        }
        Class::BadTenant => {
            let long = "t".repeat(65);
            let bad = ["", "a.b", "acme\r\n", long.as_str(), "ünï", "*", ">"];
            job["tenant"] = json!(bad[rng.random_range(0..bad.len())]);
            submit(enc(&job), Some(&id))
        }
        Class::BadSlo => {
            let bad = [
                json!({"ttft_ms": 0}),
                json!({"min_tok_s": -1.0}),
                json!({"min_tok_s": 1e300}),
                json!({"min_tok_s": 0.0}),
            ];
            job["slo"] = bad[rng.random_range(0..bad.len())].clone();
            submit(enc(&job), Some(&id))
        }
        Class::BadPriority => {
            if rng.random_bool(0.5) {
                job["priority"] = json!(["urgent", "", "INTERACTIVE"][rng.random_range(0..3)]);
            } else {
                job["endpoint"] = json!(["embeddings", "", "chat\r\n"][rng.random_range(0..3)]);
            }
            submit(enc(&job), Some(&id))
        }
        Class::ForgedRetryHeaders => {
            let mut m = submit(enc(&job), Some(&id));
            m.headers = Some(headers(&[
                (HEADER_MSG_ID, id.clone()),
                (HEADER_ATTEMPT, "999".into()),
                (HEADER_ORDER, "0".into()),
            ]));
            m
        }
        Class::DuplicateId | Class::ValidOddPrompt => {
            // Valid, for the real model, with CR/LF, NUL, escapes and unicode in the prompt:
            // served once. A duplicate repeats an earlier valid id under a new msg id.
            job["model"] = json!(ctx.model);
            job["request"]["model"] = json!(ctx.model);
            let mut content = String::from("hostile\r\nprompt ");
            for _ in 0..8 {
                content.push(odd_char(&mut rng));
            }
            job["request"]["messages"][0]["content"] = json!(content);
            let mut m = submit(enc(&job), Some(&id));
            m.headers = Some(headers(&[(HEADER_MSG_ID, id.clone())]));
            m
        }
        Class::Cancel => {
            let odd = [
                format!("{}-unknown-{index}", ctx.prefix),
                "x".repeat(300),
                "%00".into(),
                "ünï".into(),
            ];
            // Another tenant's client naming one of the drill's own (running or queued)
            // jobs; the version-2 subject without a tenant; odd ids and tenants.
            let victim = format!("{}-{}", ctx.victims, rng.random_range(0..256u32));
            let subject = match rng.random_range(0..4) {
                0 | 1 => format!(
                    "cancel.{}.{victim}",
                    ["acme", "hostile-tenant", "anonymous"][rng.random_range(0..3)]
                ),
                2 => format!("cancel.{victim}"),
                _ => format!(
                    "cancel.{}.{}",
                    ["_anon", "x.y", "ünï", ""][rng.random_range(0..4)],
                    odd[rng.random_range(0..odd.len())]
                ),
            };
            Hostile {
                class,
                subject,
                headers: None,
                payload: Bytes::from_static(b"\x00\xff{not json"),
                jetstream: false,
                job_id: None,
            }
        }
        Class::EventRefusalMadeUpJob => {
            // A refusal on a real worker's own subject, as that worker could publish it,
            // handing "back" a job of the drill's model that nobody ever submitted: a
            // leader that believed it would have let a worker submit work of its own.
            let mut made_up = valid_job(ctx, &id, &ctx.model);
            if rng.random_range(0..2) == 0 {
                made_up["tenant"] = json!("victim-tenant");
            }
            let event = json!({
                "v": PROTOCOL_VERSION, "job_id": id, "worker_id": worker,
                "model": ctx.model, "epoch": ctx.epoch, "attempt": 1, "outcome": "refused",
                "streamed": false, "error": "hostile drill", "prompt_tokens": 4,
                "output_tokens": 0, "e2e_ms": 0.0, "finished_ms": ctx.now_ms,
                "job": made_up,
            });
            Hostile {
                class,
                subject: event_done_subject(&worker),
                headers: None,
                payload: enc(&event).into(),
                jetstream: true,
                job_id: Some(id),
            }
        }
        Class::EventMalformed | Class::EventForged => {
            let mut event = json!({
                "v": PROTOCOL_VERSION, "job_id": format!("{id}-ev"), "worker_id": worker,
                "model": ctx.model, "epoch": ctx.epoch, "attempt": 1, "outcome": "done",
                "streamed": true, "prompt_tokens": 1, "output_tokens": 1, "e2e_ms": 1.0,
                "finished_ms": ctx.now_ms,
            });
            let body = if class == Class::EventMalformed {
                match rng.random_range(0..3) {
                    0 => b"{\"v\":1,\"job_id\":".to_vec(),
                    1 => {
                        event["outcome"] = json!("exploded");
                        enc(&event)
                    }
                    _ => {
                        event["output_tokens"] = json!(-5);
                        enc(&event)
                    }
                }
            } else {
                match rng.random_range(0..3) {
                    0 => event["worker_id"] = json!("victim-worker"),
                    1 => event["job_id"] = json!("a.b\r\n"),
                    _ => event["worker_id"] = json!(format!("{worker}.x")),
                }
                enc(&event)
            };
            Hostile {
                class,
                subject: event_done_subject(&worker),
                headers: None,
                payload: body.into(),
                jetstream: true,
                job_id: None,
            }
        }
        Class::HeartbeatMalformed | Class::HeartbeatForeignKey | Class::HeartbeatBadFields => {
            // One key per message: a later put to the same key would replace an earlier
            // one before the dispatcher's watch reads it, and the count would not add up.
            let key = format!("{}-w{index}", ctx.prefix);
            let mut status = json!({
                "v": PROTOCOL_VERSION, "worker_id": key, "model": unknown, "healthy": true,
                "draining": false, "max_concurrency": u32::MAX, "active": 0, "queued": 0,
                "seq": 1, "sent_ms": ctx.now_ms,
            });
            let body = match class {
                Class::HeartbeatMalformed => match rng.random_range(0..3) {
                    0 => b"{\"v\":1,".to_vec(),
                    1 => {
                        status["max_concurrency"] = json!(-1);
                        enc(&status)
                    }
                    _ => {
                        status["in_flight"] = json!("not a list");
                        enc(&status)
                    }
                },
                Class::HeartbeatForeignKey => {
                    status["worker_id"] = json!(worker);
                    enc(&status)
                }
                _ => {
                    match rng.random_range(0..3) {
                        0 => status["worker_id"] = json!(format!("{key}\r\n")),
                        1 => status["model"] = json!(""),
                        _ => status["model"] = json!(format!("m\r\n{}", "x".repeat(300))),
                    }
                    enc(&status)
                }
            };
            Hostile {
                class,
                subject: format!("$KV.{BUCKET_WORKERS}.{key}"),
                headers: None,
                payload: body.into(),
                jetstream: true,
                job_id: None,
            }
        }
        Class::WorkMalformed
        | Class::WorkInvalidJob
        | Class::WorkOtherWorker
        | Class::WorkStaleEpoch
        | Class::WorkFutureEpoch => {
            let work_id = format!("{id}-work");
            let mut inner = valid_job(ctx, &work_id, &ctx.model);
            let mut assignment = json!({
                "v": PROTOCOL_VERSION, "job": inner, "worker_id": worker,
                "epoch": ctx.epoch, "attempt": 1, "assigned_ms": ctx.now_ms,
            });
            let body = match class {
                Class::WorkMalformed => match rng.random_range(0..3) {
                    0 => b"\x00\x01garbage".to_vec(),
                    1 => {
                        assignment["epoch"] = json!("high");
                        enc(&assignment)
                    }
                    _ => enc(&assignment)[..20].to_vec(),
                },
                Class::WorkInvalidJob => {
                    inner["model"] = json!("a\r\nb");
                    assignment["job"] = inner;
                    enc(&assignment)
                }
                Class::WorkOtherWorker => {
                    assignment["worker_id"] = json!("someone-else");
                    enc(&assignment)
                }
                Class::WorkStaleEpoch => {
                    assignment["epoch"] = json!(0);
                    enc(&assignment)
                }
                _ => {
                    assignment["epoch"] = json!(u64::MAX);
                    enc(&assignment)
                }
            };
            Hostile {
                class,
                subject: work_subject(&worker),
                headers: Some(headers(&[(HEADER_MSG_ID, names::work_msg_id(&work_id, 1))])),
                payload: body.into(),
                jetstream: true,
                job_id: None,
            }
        }
    }
}

/// The flood in sending order: classes interleaved by a seeded shuffle, so every target
/// is under fire for the whole flood. Duplicates come after the valid job they repeat.
pub fn schedule(seed: u64, total: usize) -> Vec<Class> {
    let mut order: Vec<Class> = plan(total)
        .into_iter()
        .flat_map(|(c, n)| std::iter::repeat_n(c, n))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Fisher-Yates.
    for i in (1..order.len()).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
    // Duplicates last, so each repeats a valid job already sent.
    order.sort_by_key(|c| *c == Class::DuplicateId);
    order
}

#[cfg(test)]
mod tests {
    use metronome_protocol::{Job, JobLimits};

    use super::*;

    fn ctx() -> Context {
        Context {
            prefix: "hostile-t".into(),
            model: "llama-3.1-8b".into(),
            workers: vec!["local-gpu0".into(), "local-gpu1".into()],
            epoch: 7,
            victims: "drill-t".into(),
            max_job_bytes: 64 * 1024,
            now_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn the_plan_sends_exactly_the_total_and_every_class() {
        for total in [5_000, 100_000] {
            let p = plan(total);
            assert_eq!(p.values().sum::<usize>(), total);
            assert!(p.values().all(|n| *n >= 1), "{p:?}");
            assert_eq!(schedule(1, total).len(), total);
        }
    }

    /// Same seed and index, same bytes: a finding can be replayed.
    #[test]
    fn generation_is_deterministic() {
        for c in Class::ALL {
            let a = message(9, 42, c, &ctx());
            let b = message(9, 42, c, &ctx());
            assert_eq!((a.subject, a.payload), (b.subject, b.payload), "{c:?}");
        }
    }

    /// Every hostile job the dispatcher should refuse fails `Job::parse`, and the valid
    /// ones pass it: the generator tests what it claims to.
    #[test]
    fn submit_classes_fail_or_pass_validation_as_their_sink_says() {
        let limits = JobLimits {
            max_job_bytes: 64 * 1024,
            ..Default::default()
        };
        for c in Class::ALL {
            for i in 0..200 {
                let m = message(3, i, c, &ctx());
                if !m.subject.starts_with(names::SUBJECT_JOBS_SUBMIT_PREFIX) {
                    continue;
                }
                let parsed = Job::parse(&m.payload, &limits);
                match c.sink() {
                    Sink::Served => assert!(parsed.is_ok(), "{c:?} {i}: {parsed:?}"),
                    // Jobs valid to the parser that the dispatcher itself must reject
                    // (deadline, model).
                    _ if matches!(
                        c,
                        Class::ExpiredDeadline
                            | Class::UnknownModel
                            | Class::ForgedRetryHeaders
                            | Class::TokenExtremes
                            | Class::Unicode
                            | Class::DuplicateId
                            // An unknown field in `slo`, 2^32 in a u64 field: valid,
                            // then rejected for the unknown model.
                            | Class::WrongType
                            | Class::HugeNumber
                    ) => {}
                    _ => assert!(parsed.is_err(), "{c:?} {i} parsed: {:?}", parsed),
                }
                if c.sink() == Sink::Decision && c != Class::DuplicateId {
                    assert_eq!(m.job_id.as_deref(), Some(format!("hostile-t-{i}").as_str()));
                }
            }
        }
    }
}

/// What the flood saw: per class, sent, refused by the server at publish time, and the
/// decisions (outcome: reason code) its jobs got; dead letters by source.
#[derive(Debug, Default, Clone)]
pub struct FloodAccount {
    pub sent: BTreeMap<Class, usize>,
    pub server_refused: BTreeMap<Class, usize>,
    pub decisions: BTreeMap<Class, BTreeMap<String, usize>>,
    /// Hostile jobs with a readable id that got no decision.
    pub undecided: BTreeMap<Class, usize>,
    /// Dead letters: from the dispatcher (`jobs.submit`) and from agents (`work.*`).
    pub dead_letters_dispatcher: usize,
    pub dead_letters_agents: usize,
    /// Ids of the valid hostile jobs (they join the drill's per-job account).
    pub served_ids: Vec<String>,
    pub elapsed: std::time::Duration,
}

impl FloodAccount {
    /// Submitted messages JetStream stored (sent minus refused) of the `jobs.submit` classes.
    pub fn stored_submits(&self, sink: impl Fn(Sink) -> bool) -> usize {
        self.sent
            .iter()
            .filter(|(c, _)| sink(c.sink()))
            .map(|(c, n)| n - self.server_refused.get(c).copied().unwrap_or(0))
            .sum()
    }
}

/// Publish the flood of `total` messages at up to `rate` per second; every JetStream
/// publish is acknowledged (or refused) before the flood ends. Decisions and dead letters
/// are collected until `settle` after the last message, or until every hostile job with a
/// readable id has its decision.
pub async fn flood(
    client: &async_nats::Client,
    seed: u64,
    total: usize,
    rate: f64,
    ctx: &Context,
    settle: std::time::Duration,
) -> anyhow::Result<FloodAccount> {
    use futures::stream::FuturesUnordered;
    use futures::StreamExt;
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    let js = async_nats::jetstream::new(client.clone());
    let mut decisions = client.subscribe(names::SUBJECT_DECISIONS_ALL).await?;
    let mut letters = client.subscribe(names::SUBJECT_DEAD_LETTER).await?;
    let mut finals = client.subscribe(names::SUBJECT_RESULTS_FINAL_ALL).await?;
    client.flush().await?;
    let finished = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let f = finished.clone();
    // `results.<tenant>.<job>.<publisher>.final`.
    let job_prefix = format!("{}-", ctx.prefix);
    let final_prefix = job_prefix.clone();
    let collect_finals = tokio::spawn(async move {
        while let Some(m) = finals.next().await {
            let job = names::parse_result_subject(m.subject.as_str()).map(|r| r.job_id);
            if let Some(job) = job.filter(|j| j.starts_with(&final_prefix)) {
                f.lock()
                    .unwrap()
                    .insert(job[final_prefix.len()..].to_string());
            }
        }
    });
    let seen_decisions = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let letters_seen = std::sync::Arc::new(std::sync::Mutex::new((0usize, 0usize)));
    let d = seen_decisions.clone();
    let collect_decisions = tokio::spawn(async move {
        while let Some(m) = decisions.next().await {
            // `decisions.<tenant>.<job>`: only the flood's own jobs.
            let ours = m
                .subject
                .as_str()
                .rsplit('.')
                .next()
                .is_some_and(|job| job.starts_with(&job_prefix));
            if !ours {
                continue;
            }
            if let Ok(v) = serde_json::from_slice::<Value>(&m.payload) {
                let id = v["job_id"].as_str().unwrap_or_default().to_string();
                let what = format!(
                    "{}: {}",
                    v["outcome"].as_str().unwrap_or("?"),
                    v["reason_code"].as_str().unwrap_or("-")
                );
                d.lock().unwrap().push((id, what));
            }
        }
    });
    let l = letters_seen.clone();
    let collect_letters = tokio::spawn(async move {
        while let Some(m) = letters.next().await {
            let v: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
            let mut l = l.lock().unwrap();
            if v["source"].as_str().is_some_and(|s| s.starts_with("work.")) {
                l.1 += 1;
            } else {
                l.0 += 1;
            }
        }
    });

    let mut account = FloodAccount::default();
    let mut ids: HashMap<String, Class> = HashMap::new();
    let mut valid_sent: Vec<u64> = Vec::new();
    let mut acks = FuturesUnordered::new();
    let start = Instant::now();
    let per = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let order = schedule(seed, total);
    let dups_from = order
        .iter()
        .position(|c| *c == Class::DuplicateId)
        .unwrap_or(order.len());
    for (i, class) in order.into_iter().enumerate() {
        let index = i as u64;
        if i == dups_from {
            // The duplicates go once the jobs they repeat have finished (or after
            // `settle`): a finished job's id must not run again.
            let deadline = Instant::now() + settle;
            while Instant::now() < deadline {
                let all_done = {
                    let done = finished.lock().unwrap();
                    valid_sent.iter().all(|i| done.contains(&i.to_string()))
                };
                if all_done {
                    // The leader releases a job on its completion event, which trails the
                    // final result by moments.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let m = if class == Class::DuplicateId {
            // The same job id again under a new msg id: it must not run a second time.
            let of = valid_sent
                .get(i % valid_sent.len().max(1))
                .copied()
                .unwrap_or(index);
            let mut m = message(seed, of, Class::ValidOddPrompt, ctx);
            m.class = Class::DuplicateId;
            let id = m.job_id.clone().unwrap_or_default();
            m.headers = Some(headers(&[(HEADER_MSG_ID, format!("{id}:dup:{index}"))]));
            m
        } else {
            message(seed, index, class, ctx)
        };
        *account.sent.entry(class).or_default() += 1;
        if let Some(id) = &m.job_id {
            if class == Class::ValidOddPrompt {
                valid_sent.push(index);
                account.served_ids.push(id.clone());
            }
            ids.entry(id.clone()).or_insert(class);
        }
        if m.jetstream {
            let published = match m.headers {
                Some(h) => js.publish_with_headers(m.subject, h, m.payload).await,
                None => js.publish(m.subject, m.payload).await,
            };
            match published {
                Ok(ack) => acks.push(async move { (class, ack.await.is_ok()) }),
                Err(_) => *account.server_refused.entry(class).or_default() += 1,
            }
        } else {
            let r = client.publish(m.subject, m.payload).await;
            if r.is_err() {
                *account.server_refused.entry(class).or_default() += 1;
            }
        }
        // Acks are awaited as they come; at most 512 outstanding.
        while acks.len() >= 512 {
            if let Some((c, false)) = acks.next().await {
                *account.server_refused.entry(c).or_default() += 1;
            }
        }
        if i % 64 == 63 {
            tokio::time::sleep_until((start + per.mul_f64((i + 1) as f64)).into()).await;
        }
    }
    while let Some((c, ok)) = acks.next().await {
        if !ok {
            *account.server_refused.entry(c).or_default() += 1;
        }
    }
    account.elapsed = start.elapsed();
    // Wait until every hostile job is answered: a decision for each whose id is surely
    // readable, and decisions plus dead letters for the rest (jobs refused by the server
    // at publish time have nothing to wait for).
    let must = |c: &Class| matches!(c.sink(), Sink::Decision | Sink::Served);
    let either = |c: &Class| matches!(c.sink(), Sink::DeadLetter | Sink::DecisionOrDeadLetter);
    let expected = ids.values().filter(|c| must(c)).count();
    let stored = |c: &Class| {
        account.sent.get(c).copied().unwrap_or(0)
            - account.server_refused.get(c).copied().unwrap_or(0)
    };
    let either_stored: usize = Class::ALL.iter().filter(|c| either(c)).map(stored).sum();
    let deadline = Instant::now() + settle;
    loop {
        let got: std::collections::HashSet<String> = seen_decisions
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        let have = ids
            .iter()
            .filter(|(id, c)| must(c) && got.contains(*id))
            .count();
        let answered = ids
            .iter()
            .filter(|(id, c)| either(c) && got.contains(*id))
            .count()
            + letters_seen.lock().unwrap().0;
        if (have >= expected && answered >= either_stored) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Agents' dead letters trail their WORK messages by moments.
    tokio::time::sleep(Duration::from_millis(500)).await;
    collect_decisions.abort();
    collect_letters.abort();
    collect_finals.abort();
    let mut decided: HashMap<String, Vec<String>> = HashMap::new();
    for (id, what) in seen_decisions.lock().unwrap().iter() {
        decided.entry(id.clone()).or_default().push(what.clone());
    }
    for (id, class) in &ids {
        if *class == Class::OverServerLimit {
            continue;
        }
        match decided.get(id) {
            Some(list) => {
                for what in list {
                    *account
                        .decisions
                        .entry(*class)
                        .or_default()
                        .entry(what.clone())
                        .or_default() += 1;
                }
            }
            None => *account.undecided.entry(*class).or_default() += 1,
        }
    }
    let (dl_dispatcher, dl_agents) = *letters_seen.lock().unwrap();
    account.dead_letters_dispatcher = dl_dispatcher;
    account.dead_letters_agents = dl_agents;
    Ok(account)
}
