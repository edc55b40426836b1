//! The Metronome wire protocol: every message that crosses NATS, every subject, header,
//! stream, KV bucket and Redis key name, in one place.
//!
//! Messages are versioned JSON (`v` field). Readers are tolerant: unknown fields are
//! ignored so a newer writer never breaks an older reader; a reader rejects only what it
//! cannot interpret (missing required fields, wrong types, values out of range), with a
//! reason. The contract is documented in `docs/PROTOCOL.md`.
//!
//! Also the one reader of each text format the components exchange over HTTP: server-sent
//! events ([`sse`]) and the Prometheus exposition format ([`prometheus`]).

pub mod api_keys;
pub mod assignment;
pub mod cache_state;
pub mod control;
pub mod decision;
pub mod endpoint;
pub mod event;
#[cfg(feature = "nats")]
pub mod headers;
pub mod input_tokens;
pub mod job;
pub mod lease;
pub mod names;
pub mod perf;
pub mod permissions;
pub mod prefix;
pub mod prometheus;
pub mod queues;
pub mod redis_keys;
pub mod result;
#[cfg(feature = "nats")]
pub mod setup;
pub mod sse;
#[cfg(feature = "nats")]
pub mod stored;
pub mod time;
pub mod trace;
pub mod worker;

pub use assignment::Assignment;
pub use cache_state::{CacheUpdate, CacheUpdateKind};
pub use control::{ControlReply, RelayedCancel, Revoke, RevokedJob};
pub use decision::{
    Affinity, AffinityOutcome, CachedPrefix, CandidateScore, Decision, Outcome, PrefixSource,
    Rejection, RejectionCode, Scoring, TermName, TermScore, DECISION_VERSION, TERM_COUNT,
};
pub use endpoint::Endpoint;
pub use event::{CompletionEvent, CompletionOutcome};
pub use job::{
    check_model_name, check_tenant, Job, JobError, JobLimits, Priority, ANONYMOUS_TENANT,
    MAX_TENANT_BYTES,
};
pub use lease::{lease_vouches_for, LeaseValue};
pub use perf::{PerfCoefficients, Prediction, Slo, SloRequest};
pub use prefix::PrefixFingerprint;
pub use queues::{FlowCount, Freshness, QueueSnapshot, QueueSnapshotError};
pub use result::{ErrorCode, FinalResult, ResultChunk, ResultError, Usage};
pub use worker::{GpuStats, KvUsage, LiveDecode, WorkerStatus};

/// Current version of every message schema in this crate.
///
/// 2: subjects name the tenant (`jobs.submit.<tenant>`, `results.<tenant>.<job>.…`,
/// `decisions.<tenant>.<job>`), so the servers' permissions keep each tenant's results and
/// decisions to its own clients. A version-1 job (or one on the version-1 `jobs.submit`) is
/// rejected with `unsupported_version`.
///
/// 3: result subjects name their publisher (`results.<tenant>.<job>.<worker>.{chunk,final}`,
/// `…._dispatcher.final` for the leader's), so a worker can write results only under its
/// own id and a reader accepts a job's results only from the worker its decision names;
/// cancellations name the tenant (`cancel.<tenant>.<job>`), so a client can cancel only its
/// own tenant's jobs. A version-2 job is rejected with `unsupported_version`.
pub const PROTOCOL_VERSION: u32 = 3;
