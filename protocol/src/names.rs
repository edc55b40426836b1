//! Every NATS subject, stream, consumer, KV bucket and header name.
//!
//! Worker ids are single subject tokens (`node1-gpu0`). Model names never appear in
//! subjects (they contain dots and slashes); they travel in bodies and the
//! [`HEADER_MODEL`] header.

/// Stream of submitted jobs (work-queue retention).
pub const STREAM_JOBS: &str = "JOBS";
/// Stream of assignments, one subject per worker (work-queue retention).
pub const STREAM_WORK: &str = "WORK";
/// Audit stream: one record per job outcome, direct-get by subject.
pub const STREAM_DECISIONS: &str = "DECISIONS";
/// Final results, kept briefly so a NATS client can fetch them after the fact.
pub const STREAM_RESULTS: &str = "RESULTS";
/// Completion and failure events that release reservations.
pub const STREAM_EVENTS: &str = "EVENTS";
/// Changes to each worker's prefix cache ([`crate::cache_state`]), kept a short time.
pub const STREAM_CACHE_DELTAS: &str = "CACHE_DELTAS";
/// The latest snapshot of each worker's prefix cache, one per worker.
pub const STREAM_CACHE_SNAPSHOTS: &str = "CACHE_SNAPSHOTS";

/// Subject token of the jobs of no tenant: `jobs.submit._anon`, `results._anon.<job>.…`,
/// `decisions._anon.<job>`. No tenant may be called this ([`crate::check_tenant`]).
pub const NO_TENANT_TOKEN: &str = "_anon";

/// The subject token of `tenant` (`None`: [`NO_TENANT_TOKEN`]). Tenant names are checked
/// subject tokens ([`crate::check_tenant`]).
pub fn tenant_token(tenant: Option<&str>) -> &str {
    tenant.unwrap_or(NO_TENANT_TOKEN)
}

/// The tenant a subject token names: the inverse of [`tenant_token`].
pub fn tenant_of_token(token: &str) -> Option<&str> {
    (token != NO_TENANT_TOKEN).then_some(token)
}

/// Prefix of the submission subjects: a job of tenant `t` is submitted on
/// `jobs.submit.<t>` ([`submit_subject`]), and the dispatcher takes its tenant from there,
/// so the server's permissions (a client may publish only on its own tenant's subject)
/// decide whose job it is, not the body.
pub const SUBJECT_JOBS_SUBMIT_PREFIX: &str = "jobs.submit.";
/// Every tenant's submissions (a subject filter of the JOBS stream).
pub const SUBJECT_JOBS_SUBMIT_ALL: &str = "jobs.submit.*";
/// The submission subject of protocol version 1, which named no tenant. JOBS still
/// captures it so that an old publisher's job is rejected with a reason
/// (`unsupported_version`) rather than lost; no role may publish on it.
pub const SUBJECT_JOBS_SUBMIT_V1: &str = "jobs.submit";
/// Subject on which the leader puts a job back for another attempt (a retry), in the same
/// JOBS stream. Only dispatchers may publish here, so only here are the retry headers
/// ([`HEADER_ATTEMPT`], [`HEADER_ORDER`]) and the body's tenant believed: on
/// `jobs.submit.<tenant>` a client could use the headers to jump its model's queue.
pub const SUBJECT_JOBS_RETRY: &str = "jobs.retry";
/// Subject filter of the WORK stream.
pub const SUBJECT_WORK_ALL: &str = "work.*";
/// Subject filter of the DECISIONS stream (`decisions.<tenant>.<job_id>`); also what an
/// auditor subscribes to.
pub const SUBJECT_DECISIONS_ALL: &str = "decisions.>";
/// Subject filter of the RESULTS stream (`results.<tenant>.<job_id>.<publisher>.final`).
pub const SUBJECT_RESULTS_FINAL_ALL: &str = "results.*.*.*.final";
/// The RESULTS filter of protocol version 1 (`results.<job_id>.final`), replaced by
/// [`SUBJECT_RESULTS_FINAL_ALL`] when a dispatcher upgrades the stream.
pub const SUBJECT_RESULTS_FINAL_ALL_V1: &str = "results.*.final";
/// The RESULTS filter of protocol version 2 (`results.<tenant>.<job_id>.final`, no
/// publisher), replaced the same way.
pub const SUBJECT_RESULTS_FINAL_ALL_V2: &str = "results.*.*.final";
/// Subject filter of the CACHE_DELTAS stream (`kvcache.<worker_id>.delta`).
pub const SUBJECT_CACHE_DELTAS_ALL: &str = "kvcache.*.delta";
/// Subject filter of the CACHE_SNAPSHOTS stream (`kvcache.<worker_id>.snapshot`).
pub const SUBJECT_CACHE_SNAPSHOTS_ALL: &str = "kvcache.*.snapshot";
/// Subject filter of the EVENTS stream.
pub const SUBJECT_EVENTS_ALL: &str = "events.>";
/// Completion events of every worker.
pub const SUBJECT_EVENTS_DONE_ALL: &str = "events.done.*";
/// Heartbeats of every worker (core NATS; the KV bucket holds the latest one).
pub const SUBJECT_HEARTBEAT_ALL: &str = "workers.*.heartbeat";
/// Cancellation requests of every tenant's jobs (`cancel.<tenant>.<job_id>`, core NATS).
pub const SUBJECT_CANCEL_ALL: &str = "cancel.*.*";
/// Malformed messages that could not be attributed to a job id.
pub const SUBJECT_DEAD_LETTER: &str = "deadletter.jobs";

/// Durable consumer of the leader dispatcher on JOBS.
pub const CONSUMER_DISPATCHER: &str = "dispatcher";

/// KV bucket: key = worker id, value = latest [`crate::WorkerStatus`].
pub const BUCKET_WORKERS: &str = "workers";
/// KV bucket holding the dispatcher lease.
pub const BUCKET_LEADER: &str = "leader";
/// Key of the lease in [`BUCKET_LEADER`].
pub const LEADER_KEY: &str = "dispatcher";
/// KV bucket of the fair-share service counters, written by the leader and read by the
/// next one at takeover, so fairness survives a failover.
pub const BUCKET_FAIRNESS: &str = "fairness";
/// Key of the counters (all models, one JSON document) in [`BUCKET_FAIRNESS`].
pub const FAIRNESS_KEY: &str = "counters";
/// KV bucket of the leader's per-model admission queues: key = [`queue_key`] of the
/// model, value = its latest [`crate::QueueSnapshot`].
pub const BUCKET_QUEUES: &str = "queues";
/// KV bucket of the API keys managed live (`metronome keys`): key = the key's SHA-256 in
/// hex, value = an [`crate::api_keys::KeyRecord`]. Every gateway watches it.
pub const BUCKET_API_KEYS: &str = "api_keys";

/// De-duplication id understood by JetStream.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
/// Model name of a job, so tooling can route or filter without parsing the body.
pub const HEADER_MODEL: &str = "Metronome-Model";
/// Leader epoch that produced an assignment.
pub const HEADER_EPOCH: &str = "Metronome-Epoch";
/// On a job the dispatcher put back on `jobs.retry` (a retry): the attempt it will be
/// assigned as. Ignored on `jobs.submit.<tenant>` (a client's submission is attempt 1).
pub const HEADER_ATTEMPT: &str = "Metronome-Attempt";
/// On a retry put back on `jobs.retry`: the JOBS sequence of the client's submission, so
/// the job returns to its place in its model's queue. Ignored on `jobs.submit.<tenant>`.
pub const HEADER_ORDER: &str = "Metronome-Order";
/// On a retry put back on `jobs.retry`: the workers that refused the job and the attempt
/// each refused, `<worker_id>:<attempt>` comma-separated ([`refused_by_header`]), so a
/// leader that takes over does not give the retry back to a worker that refused it.
/// Ignored on `jobs.submit.<tenant>`.
pub const HEADER_REFUSED_BY: &str = "Metronome-Refused-By";
/// W3C trace context of the span a message comes from ([`crate::trace`]), on a job (the
/// gateway's request span), an assignment (the leader's decision span), a final result and
/// a completion event (the worker's run span): a NATS tool, or a consumer that traces, can
/// continue the trace without parsing the body. The same name as the HTTP header.
pub const HEADER_TRACEPARENT: &str = crate::trace::TRACEPARENT_HEADER;
/// Most refusals [`parse_refused_by`] reads from one header.
pub const REFUSED_BY_MAX: usize = 16;

/// The value of [`HEADER_REFUSED_BY`] for `refusals` (worker id, attempt refused).
pub fn refused_by_header(refusals: &[(String, u32)]) -> String {
    refusals
        .iter()
        .map(|(worker, attempt)| format!("{worker}:{attempt}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The refusals a [`HEADER_REFUSED_BY`] value lists: entries that are not a subject token
/// and an attempt are skipped, and at most [`REFUSED_BY_MAX`] are read.
pub fn parse_refused_by(value: &str) -> Vec<(String, u32)> {
    value
        .split(',')
        .filter_map(|entry| {
            let (worker, attempt) = entry.trim().rsplit_once(':')?;
            let attempt = attempt.parse().ok()?;
            is_subject_token(worker).then(|| (worker.to_string(), attempt))
        })
        .take(REFUSED_BY_MAX)
        .collect()
}

/// Durable consumer of the dispatcher on EVENTS (`events.done.*`).
pub const CONSUMER_DISPATCHER_EVENTS: &str = "dispatcher-events";

/// `Nats-Msg-Id` of a retry put back on `jobs.retry`: one per attempt, distinct from the
/// client's own id (the job id).
pub fn retry_msg_id(job_id: &str, attempt: u32) -> String {
    format!("{job_id}:retry:{attempt}")
}

/// `kvcache.<worker_id>.delta`: changes to one worker's prefix cache.
pub fn cache_delta_subject(worker_id: &str) -> String {
    format!("kvcache.{worker_id}.delta")
}

/// `kvcache.<worker_id>.snapshot`: one worker's whole prefix cache.
pub fn cache_snapshot_subject(worker_id: &str) -> String {
    format!("kvcache.{worker_id}.snapshot")
}

/// The worker a `kvcache.<worker_id>.<kind>` subject names.
pub fn cache_subject_worker(subject: &str) -> Option<&str> {
    let mut parts = subject.split('.');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("kvcache"), Some(worker), Some("delta" | "snapshot"), None) => Some(worker),
        _ => None,
    }
}

/// `work.<worker_id>`: assignments for one worker.
pub fn work_subject(worker_id: &str) -> String {
    format!("work.{worker_id}")
}

/// Durable consumer name of one worker on WORK.
pub fn work_consumer(worker_id: &str) -> String {
    format!("worker-{worker_id}")
}

/// `jobs.submit.<tenant>`: where a job of `tenant` (`None`: no tenant) is submitted.
pub fn submit_subject(tenant: Option<&str>) -> String {
    format!("{SUBJECT_JOBS_SUBMIT_PREFIX}{}", tenant_token(tenant))
}

/// The tenant token of a submission subject (`jobs.submit.<token>`); `None` for any other
/// subject (`jobs.retry`, the version-1 `jobs.submit`).
pub fn submit_subject_token(subject: &str) -> Option<&str> {
    subject
        .strip_prefix(SUBJECT_JOBS_SUBMIT_PREFIX)
        .filter(|t| !t.is_empty() && !t.contains('.'))
}

/// `decisions.<tenant>.<job_id>`: the audit record(s) of one job of `tenant`.
pub fn decision_subject(tenant: Option<&str>, job_id: &str) -> String {
    format!("decisions.{}.{job_id}", tenant_token(tenant))
}

/// `decisions.*.<job_id>`: the decisions of a job whatever its tenant, for readers that
/// know only the job id (operators). A filter, not a subject: read it with a request that
/// carries it in the body (`next_by_subj` / `last_by_subj`), never in a direct-get URL.
pub fn decision_subject_any_tenant(job_id: &str) -> String {
    format!("decisions.*.{job_id}")
}

/// `decisions.<tenant>.>`: every decision of one tenant's jobs.
pub fn tenant_decisions_all(tenant: Option<&str>) -> String {
    format!("decisions.{}.>", tenant_token(tenant))
}

/// Publisher token of the results the leader writes itself (the final result of a job it
/// rejects, or of one lost with its worker): `results.<tenant>.<job_id>._dispatcher.final`.
/// Only dispatchers may publish there, and no worker may be called this
/// ([`is_worker_id`]), so a result under this token is the leader's.
pub const DISPATCHER_PUBLISHER: &str = "_dispatcher";

/// True when `s` may be a worker id: a subject token other than [`DISPATCHER_PUBLISHER`]
/// (a worker of that name could write results a reader takes for the leader's).
pub fn is_worker_id(s: &str) -> bool {
    is_subject_token(s) && s != DISPATCHER_PUBLISHER
}

/// `results.<tenant>.<job_id>.<worker_id>.chunk`: streamed deltas of a job run by
/// `worker_id` (core NATS, ordered per publisher). A worker may publish only under its own
/// id (the servers' permissions), so the subject, not the body, says whose output it is.
pub fn result_chunk_subject(tenant: Option<&str>, job_id: &str, worker_id: &str) -> String {
    format!(
        "results.{}.{job_id}.{worker_id}.chunk",
        tenant_token(tenant)
    )
}

/// `results.<tenant>.<job_id>.<publisher>.final`: the final result of a job, written by the
/// worker that ran it (its id) or the leader ([`DISPATCHER_PUBLISHER`]).
pub fn result_final_subject(tenant: Option<&str>, job_id: &str, publisher: &str) -> String {
    format!(
        "results.{}.{job_id}.{publisher}.final",
        tenant_token(tenant)
    )
}

/// `results.<tenant>.<job_id>._dispatcher.final`: a final result the leader writes.
pub fn dispatcher_final_subject(tenant: Option<&str>, job_id: &str) -> String {
    result_final_subject(tenant, job_id, DISPATCHER_PUBLISHER)
}

/// `results.*.<job_id>.*.final`: the final result of a job whatever its tenant and
/// publisher (a filter, see [`decision_subject_any_tenant`]).
pub fn result_final_subject_any_tenant(job_id: &str) -> String {
    format!("results.*.{job_id}.*.final")
}

/// `results.*.<job_id>.<publisher>.final`: the final result one publisher wrote for a job,
/// whatever its tenant (a filter; RESULTS keeps at most one per job and publisher).
pub fn result_final_subject_any_tenant_from(job_id: &str, publisher: &str) -> String {
    format!("results.*.{job_id}.{publisher}.final")
}

/// `results.<tenant>.<job_id>.>`: everything a client of one job subscribes to.
pub fn results_subject_all(tenant: Option<&str>, job_id: &str) -> String {
    format!("results.{}.{job_id}.>", tenant_token(tenant))
}

/// `results.<tenant>.>`: every result of one tenant's jobs.
pub fn tenant_results_all(tenant: Option<&str>) -> String {
    format!("results.{}.>", tenant_token(tenant))
}

/// Which kind of result a subject carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultKind {
    Chunk,
    Final,
}

/// The parts of a result subject, `results.<tenant>.<job_id>.<publisher>.<chunk|final>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultSubject<'a> {
    /// The tenant token ([`tenant_of_token`] gives the tenant).
    pub tenant_token: &'a str,
    pub job_id: &'a str,
    /// The worker that published it, or [`DISPATCHER_PUBLISHER`]. The servers let a
    /// worker publish only under its own id, so this is who wrote the message (what the
    /// body's `worker_id` claims is not).
    pub publisher: &'a str,
    pub kind: ResultKind,
}

impl ResultSubject<'_> {
    /// Published by the leader.
    pub fn from_dispatcher(&self) -> bool {
        self.publisher == DISPATCHER_PUBLISHER
    }
}

/// Split a result subject; `None` for anything else (the subjects of protocol version 2,
/// which named no publisher, among them).
pub fn parse_result_subject(subject: &str) -> Option<ResultSubject<'_>> {
    let mut parts = subject.split('.');
    let (Some("results"), Some(tenant_token), Some(job_id), Some(publisher), Some(kind), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let kind = match kind {
        "chunk" => ResultKind::Chunk,
        "final" => ResultKind::Final,
        _ => return None,
    };
    [tenant_token, job_id, publisher]
        .iter()
        .all(|t| is_subject_token(t))
        .then_some(ResultSubject {
            tenant_token,
            job_id,
            publisher,
            kind,
        })
}

/// The tenant token of a stored decision's or result's subject (`decisions.<t>.<job>`,
/// `results.<t>.<job>.final`).
pub fn subject_tenant_token(subject: &str) -> Option<&str> {
    let mut parts = subject.split('.');
    match (parts.next(), parts.next()) {
        (Some("decisions" | "results"), Some(token)) if !token.is_empty() => Some(token),
        _ => None,
    }
}

/// `events.done.<worker_id>`: completions and failures of one worker.
pub fn event_done_subject(worker_id: &str) -> String {
    format!("events.done.{worker_id}")
}

/// `workers.<worker_id>.heartbeat`.
pub fn heartbeat_subject(worker_id: &str) -> String {
    format!("workers.{worker_id}.heartbeat")
}

/// `cancel.<tenant>.<job_id>`: ask the dispatcher (queued) and the worker (running) to drop
/// a job of `tenant`. A client may publish only under its own tenant (the servers'
/// permissions), and the dispatcher and the agent act only when the job is that tenant's,
/// so no tenant can cancel another's jobs.
pub fn cancel_subject(tenant: Option<&str>, job_id: &str) -> String {
    format!("cancel.{}.{job_id}", tenant_token(tenant))
}

/// `cancel.<tenant>.*`: every cancellation of one tenant's jobs (what its client may send).
pub fn tenant_cancel_all(tenant: Option<&str>) -> String {
    format!("cancel.{}.*", tenant_token(tenant))
}

/// The tenant token and job id of `cancel.<tenant>.<job_id>`; `None` for anything else
/// (the version-2 `cancel.<job_id>` among them).
pub fn parse_cancel_subject(subject: &str) -> Option<(&str, &str)> {
    let (tenant_token, job_id) = subject.strip_prefix("cancel.")?.split_once('.')?;
    (is_subject_token(tenant_token) && is_subject_token(job_id)).then_some((tenant_token, job_id))
}

/// Control action: stop taking new work, finish what runs (last token of a control subject).
pub const CONTROL_DRAIN: &str = "drain";
/// Control action: take new work again.
pub const CONTROL_UNDRAIN: &str = "undrain";
/// Control action of the leader, not an operator: a client's cancel of a job this worker
/// holds, relayed (a [`crate::RelayedCancel`] body). Workers hear cancels only this way,
/// so a worker learns no other worker's job ids; only dispatchers (and admins) may publish
/// it. The agent still acts only when the body's tenant is the job's.
pub const CONTROL_CANCEL: &str = "cancel";
/// Control action of the leader, not an operator: stop the listed jobs without a result,
/// the leader has declared this worker dead and settled them (a [`crate::Revoke`] body).
pub const CONTROL_REVOKE: &str = "revoke";

/// `control.<worker_id>.<action>`: an operator's request to one worker-agent (core NATS
/// request/reply; the agent answers with a [`crate::ControlReply`]).
pub fn control_subject(worker_id: &str, action: &str) -> String {
    format!("control.{worker_id}.{action}")
}

/// `control.<worker_id>.*`: every control request of one worker-agent.
pub fn control_subject_all(worker_id: &str) -> String {
    format!("control.{worker_id}.*")
}

/// `Nats-Msg-Id` of one dispatch attempt of a job on WORK.
pub fn work_msg_id(job_id: &str, attempt: u32) -> String {
    format!("{job_id}:{attempt}")
}

/// Header that makes JetStream store a message only if its subject holds no message yet
/// (value [`FIRST_ON_SUBJECT`]); otherwise the publish fails with "wrong last sequence"
/// (JetStream error 10071), which the publisher takes as "already stored".
///
/// Final results carry it instead of a `Nats-Msg-Id`: RESULTS keeps at most one final
/// result per job *and publisher* (`results.<tenant>.<job_id>.<publisher>.final`), and
/// since only that publisher may write its subject (the servers' permissions), no one else
/// can block it. A msg id could not do that: JetStream de-duplicates ids stream-wide, and
/// the id is a header any publisher chooses, so a worker that learned a job id could have
/// stored a final under the job's id first and kept the real one out. Which stored final
/// counts is the reader's rule (`stored::accepted_final`, docs/PROTOCOL.md).
pub const HEADER_EXPECTED_LAST_SUBJECT_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";
/// Value of [`HEADER_EXPECTED_LAST_SUBJECT_SEQ`]: the subject must be empty.
pub const FIRST_ON_SUBJECT: &str = "0";

/// `Nats-Msg-Id` of a decision, so a leader that re-does a step after failover cannot
/// publish the same outcome twice.
pub fn decision_msg_id(job_id: &str, attempt: u32) -> String {
    format!("{job_id}:{attempt}")
}

/// Inbox prefix of a connection authenticated as `user`: its replies (every JetStream API
/// answer, every pulled message) arrive on `_INBOX.<user>.>`, which the server lets only
/// that user read. The shared `_INBOX.>` would let any identity read everyone's replies.
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX.{user}")
}

/// Key of `model` in [`BUCKET_QUEUES`]. Model names hold characters a KV key may not
/// (`:`, spaces, non-ASCII), so every byte outside `[A-Za-z0-9_-]` is written `=XX`
/// (hex): keys stay readable (`llama-3=2E1-8b`), and distinct models get distinct keys.
/// Readers take the model name from the value, never from the key.
pub fn queue_key(model: &str) -> String {
    let mut out = String::with_capacity(model.len());
    for b in model.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("={b:02X}"));
        }
    }
    out
}

/// True when `s` can be used as one NATS subject token (worker ids, job ids).
pub fn is_subject_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_by_round_trips_and_skips_what_is_no_refusal() {
        let refusals = vec![("gpu-0".to_string(), 1), ("node_b-gpu1".to_string(), 2)];
        let value = refused_by_header(&refusals);
        assert_eq!(value, "gpu-0:1,node_b-gpu1:2");
        assert_eq!(parse_refused_by(&value), refusals);
        assert_eq!(parse_refused_by(""), vec![]);
        assert_eq!(
            parse_refused_by("a.b:1, w:x ,:3,ok:4,w:-1"),
            vec![("ok".to_string(), 4)]
        );
        let many = (0..40)
            .map(|i| format!("w{i}:1"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(parse_refused_by(&many).len(), REFUSED_BY_MAX);
    }

    #[test]
    fn subject_tokens() {
        assert!(is_subject_token("node1-gpu0"));
        assert!(is_subject_token("0b6e0c1c-5d5b-4c8a-9a51-7f9f1b8d2f10"));
        assert!(!is_subject_token(""));
        assert!(!is_subject_token("a.b"));
        assert!(!is_subject_token("a*"));
        assert!(!is_subject_token("a b"));
        assert!(!is_subject_token(">"));
    }

    #[test]
    fn subjects_are_built_from_tokens() {
        assert_eq!(work_subject("n1-gpu0"), "work.n1-gpu0");
        assert_eq!(
            result_final_subject(Some("acme"), "j1", "w1"),
            "results.acme.j1.w1.final"
        );
        assert_eq!(
            dispatcher_final_subject(None, "j1"),
            "results._anon.j1._dispatcher.final"
        );
        assert_eq!(
            result_chunk_subject(Some("acme"), "j1", "w1"),
            "results.acme.j1.w1.chunk"
        );
        assert_eq!(
            result_final_subject_any_tenant("j1"),
            "results.*.j1.*.final"
        );
        assert_eq!(cancel_subject(Some("acme"), "j1"), "cancel.acme.j1");
        assert_eq!(cancel_subject(None, "j1"), "cancel._anon.j1");
        assert_eq!(tenant_cancel_all(Some("acme")), "cancel.acme.*");
        assert_eq!(results_subject_all(Some("acme"), "j1"), "results.acme.j1.>");
        assert_eq!(tenant_results_all(None), "results._anon.>");
        assert_eq!(decision_subject(Some("acme"), "j1"), "decisions.acme.j1");
        assert_eq!(decision_subject(None, "j1"), "decisions._anon.j1");
        assert_eq!(tenant_decisions_all(Some("acme")), "decisions.acme.>");
        assert_eq!(submit_subject(Some("acme")), "jobs.submit.acme");
        assert_eq!(submit_subject(None), "jobs.submit._anon");
        assert_eq!(work_msg_id("j1", 2), "j1:2");
        assert_eq!(
            control_subject("n1-gpu0", CONTROL_DRAIN),
            "control.n1-gpu0.drain"
        );
        assert_eq!(control_subject_all("n1-gpu0"), "control.n1-gpu0.*");
    }

    #[test]
    fn tenant_tokens_round_trip_through_subjects() {
        assert_eq!(submit_subject_token("jobs.submit.acme"), Some("acme"));
        assert_eq!(submit_subject_token("jobs.submit._anon"), Some("_anon"));
        assert_eq!(submit_subject_token("jobs.submit"), None);
        assert_eq!(submit_subject_token("jobs.retry"), None);
        assert_eq!(submit_subject_token("jobs.submit.a.b"), None);
        assert_eq!(tenant_of_token("_anon"), None);
        assert_eq!(tenant_of_token("acme"), Some("acme"));
        for tenant in [None, Some("acme")] {
            let subject = submit_subject(tenant);
            assert_eq!(
                submit_subject_token(&subject).map(tenant_of_token),
                Some(tenant)
            );
            assert_eq!(
                subject_tenant_token(&decision_subject(tenant, "j")).map(tenant_of_token),
                Some(tenant)
            );
            assert_eq!(
                subject_tenant_token(&result_final_subject(tenant, "j", "w")).map(tenant_of_token),
                Some(tenant)
            );
            assert_eq!(
                parse_cancel_subject(&cancel_subject(tenant, "j"))
                    .map(|(t, j)| (tenant_of_token(t), j)),
                Some((tenant, "j"))
            );
        }
    }

    #[test]
    fn result_subjects_name_their_publisher() {
        let chunk = result_chunk_subject(Some("acme"), "j1", "n1-gpu0");
        assert_eq!(
            parse_result_subject(&chunk),
            Some(ResultSubject {
                tenant_token: "acme",
                job_id: "j1",
                publisher: "n1-gpu0",
                kind: ResultKind::Chunk,
            })
        );
        let subject = dispatcher_final_subject(None, "j1");
        let leader = parse_result_subject(&subject).unwrap();
        assert!(leader.from_dispatcher());
        assert_eq!(leader.kind, ResultKind::Final);
        assert_eq!(leader.tenant_token, NO_TENANT_TOKEN);
        // Version 2 named no publisher; nothing else is a result either.
        for other in [
            "results.acme.j1.final",
            "results.acme.j1.w1.other",
            "results.acme.j1.w1.final.x",
            "results..j1.w1.final",
            "decisions.acme.j1",
        ] {
            assert_eq!(parse_result_subject(other), None, "{other}");
        }
        assert!(is_worker_id("n1-gpu0"));
        assert!(!is_worker_id(DISPATCHER_PUBLISHER));
        assert!(!is_worker_id("a.b"));
    }

    #[test]
    fn cancel_subjects_name_the_tenant() {
        assert_eq!(parse_cancel_subject("cancel.acme.j1"), Some(("acme", "j1")));
        for other in [
            "cancel.j1",
            "cancel.acme.j1.x",
            "cancel..j1",
            "cancel.acme.",
            "x.acme.j1",
        ] {
            assert_eq!(parse_cancel_subject(other), None, "{other}");
        }
    }

    #[test]
    fn queue_keys_are_valid_kv_keys_and_distinct() {
        assert_eq!(queue_key("llama-3.1-8b"), "llama-3=2E1-8b");
        assert_eq!(queue_key("org/m:7b q"), "org=2Fm=3A7b=20q");
        // `=` itself is escaped, so no two names share a key.
        assert_ne!(queue_key("a=2E"), queue_key("a."));
        let key = queue_key("ünï*>");
        assert!(key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b)));
    }
}
