//! The Job: what a client (the gateway or any NATS publisher) puts on
//! `jobs.submit.<tenant>`.
//!
//! The body of the OpenAI request travels unchanged in `request`; the fields around it are
//! what the dispatcher needs to decide without parsing the request: the model, the token
//! estimates that make up the job's cost, and the deadline.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::endpoint::Endpoint;
use crate::names::{is_subject_token, tenant_of_token, NO_TENANT_TOKEN};
use crate::perf::{SloField, MAX_SLO_TOK_S};

/// A job as submitted on `jobs.submit.<tenant>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Schema version ([`crate::PROTOCOL_VERSION`]).
    pub v: u32,
    /// Unique job id, a subject token (a UUID is the usual choice). Also the `Nats-Msg-Id`.
    pub id: String,
    /// Model name as the workers announce it.
    pub model: String,
    /// Which endpoint to call on the model server.
    pub endpoint: Endpoint,
    /// The OpenAI request body, forwarded to the model server as is (the worker forces
    /// `stream: true` so it can relay chunks and measure time to first token).
    pub request: Value,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// Upper bound of generated tokens (`max_tokens` of the request; 0 for an embedding).
    pub max_tokens: u32,
    /// When the client submitted the job (Unix ms).
    pub submitted_ms: u64,
    /// Absolute deadline to *start* the job (Unix ms). Past it a queued job is rejected.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// A tighter SLO than the model's, asked for by the client (bounded by the model's:
    /// a job can only ask for better service, never excuse itself from it).
    #[serde(default)]
    pub slo: Option<crate::SloRequest>,
    /// The tenant the job is submitted for (the gateway sets the tenant of the API key, or
    /// [`ANONYMOUS_TENANT`] when anonymous access is enabled). `None` for clients that
    /// submit on NATS directly without naming one. A short token (see [`check_tenant`]).
    #[serde(default)]
    pub tenant: Option<String>,
    /// The job's priority class within its tenant's share (the gateway sets the class its
    /// API key allows, or a lower one the request asked for). `None` is
    /// [`Priority::Interactive`], the class of every job before classes existed.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// The prompt's prefix as a model server's prefix cache names it (chained KV block
    /// hashes, see [`crate::prefix`]). The gateway attaches it; `None` for clients that send
    /// none, whose jobs are placed as if nothing were cached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<crate::prefix::PrefixFingerprint>,
    /// The request's W3C trace context (`traceparent`, version 00, see [`crate::trace`]):
    /// the gateway continues the client's or starts one; the worker-agent passes it to the
    /// model server, so the request's spans everywhere share one trace id. `None` for
    /// clients that send none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Priority class of a job. Within a model, a waiting interactive job goes before a
/// waiting batch job, and a starvation guard in the dispatcher still serves batch jobs
/// while interactive ones keep coming. An unknown class makes the job malformed, so a
/// typo cannot silently downgrade (or upgrade) a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Someone is waiting for the answer.
    Interactive,
    /// Throughput work: served when no interactive job waits, and by the starvation guard.
    Batch,
}

impl Priority {
    /// Every class, highest first.
    pub const ALL: [Priority; 2] = [Priority::Interactive, Priority::Batch];

    /// 0 for the highest class; a lower rank goes first.
    pub fn rank(self) -> usize {
        self as usize
    }

    /// snake_case name, as in JSON, configuration and the request header.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }

    /// Parse a class name (`interactive`, `batch`).
    pub fn parse(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Longest accepted tenant name, in bytes.
pub const MAX_TENANT_BYTES: usize = 64;

/// The tenant of requests the gateway accepts without an API key (only when its
/// `allow_anonymous` is on).
pub const ANONYMOUS_TENANT: &str = "anonymous";

/// A tenant name ends up in metric labels, logs, keys of the fairness counters and
/// subjects (`jobs.submit.<tenant>`, `results.<tenant>.…`): it must be a short token of
/// ASCII letters, digits, `-` and `_`, at most [`MAX_TENANT_BYTES`] bytes, and not
/// [`NO_TENANT_TOKEN`] (the subject token of jobs without a tenant).
pub fn check_tenant(tenant: &str) -> Result<(), JobError> {
    if tenant.is_empty() {
        return Err(JobError::BadTenant("the tenant is empty".into()));
    }
    if tenant == NO_TENANT_TOKEN {
        return Err(JobError::BadTenant(format!(
            "{NO_TENANT_TOKEN:?} is reserved: it is the subject token of jobs without a tenant"
        )));
    }
    if tenant.len() > MAX_TENANT_BYTES {
        return Err(JobError::BadTenant(format!(
            "the tenant is {} bytes, longer than the limit of {MAX_TENANT_BYTES} bytes",
            tenant.len()
        )));
    }
    if let Some((at, c)) = tenant.char_indices().find(|(_, c)| c.is_control()) {
        return Err(JobError::BadTenant(format!(
            "the tenant contains a control character (U+{:04X} at byte {at})",
            u32::from(c)
        )));
    }
    if !is_subject_token(tenant) {
        return Err(JobError::BadTenant(format!(
            "{tenant:?} is not a token of ASCII letters, digits, '-' and '_'"
        )));
    }
    Ok(())
}

/// Bounds a job must respect to be accepted. Values outside them are rejected with a
/// reason rather than clamped, so a client learns its request was wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobLimits {
    /// Largest accepted encoded job, in bytes.
    pub max_job_bytes: usize,
    /// Largest accepted `prompt_tokens + max_tokens`.
    pub max_total_tokens: u32,
}

impl Default for JobLimits {
    fn default() -> Self {
        JobLimits {
            max_job_bytes: 4 * 1024 * 1024,
            max_total_tokens: 1_000_000,
        }
    }
}

/// Why a message on `jobs.submit.<tenant>` is not a valid job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("job is {size} bytes, larger than the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("job is not valid JSON for the Job schema: {0}")]
    Malformed(String),
    #[error("unsupported job schema version {0} (this dispatcher reads version {current}: submit on jobs.submit.<tenant>; results arrive on results.<tenant>.<job_id>.<worker_id>.chunk|final, accept them only from the worker the decision on decisions.<tenant>.<job_id> names (or _dispatcher); cancel on cancel.<tenant>.<job_id>)", current = crate::PROTOCOL_VERSION)]
    UnsupportedVersion(u32),
    #[error("job submitted on {0}, the subject of protocol version 1; this dispatcher reads version {current}: submit on jobs.submit.<tenant> (jobs.submit.{anon} without a tenant)", current = crate::PROTOCOL_VERSION, anon = crate::names::NO_TENANT_TOKEN)]
    UnscopedSubject(String),
    #[error("job submitted on jobs.submit.{subject} names tenant {body:?} in its body: a client submits only for the tenant of its subject")]
    TenantMismatch { subject: String, body: String },
    #[error(
        "job id {0:?} is not a subject-safe token (letters, digits, '-' and '_', at most 128)"
    )]
    BadId(String),
    #[error("job has an empty model name")]
    EmptyModel,
    #[error("model name contains a control character (U+{code:04X} at byte {at}); model names are printable text")]
    ModelControlChar { code: u32, at: usize },
    #[error("model name is {len} bytes, longer than the limit of {limit} bytes")]
    ModelTooLong { len: usize, limit: usize },
    #[error("job asks for max_tokens = 0 (only an embedding job writes no tokens)")]
    ZeroMaxTokens,
    #[error("job needs {total} tokens (prompt + max_tokens), more than the limit of {limit}")]
    TooManyTokens { total: u64, limit: u32 },
    #[error("job request body must be a JSON object")]
    RequestNotObject,
    #[error("job slo: {0}")]
    BadSlo(String),
    #[error("job tenant: {0}")]
    BadTenant(String),
    #[error("job traceparent {0:?} is not a W3C trace context of version 00 (00-<32 hex>-<16 hex>-<2 hex>, lower case, ids not all zero)")]
    BadTraceparent(String),
}

impl JobError {
    /// A stable machine-readable code for decisions and error bodies.
    pub fn code(&self) -> &'static str {
        match self {
            JobError::TooLarge { .. } => "job_too_large",
            JobError::Malformed(_) => "malformed_job",
            JobError::UnsupportedVersion(_) | JobError::UnscopedSubject(_) => "unsupported_version",
            JobError::TenantMismatch { .. } => "tenant_mismatch",
            JobError::BadId(_) => "bad_job_id",
            JobError::EmptyModel => "empty_model",
            JobError::ModelControlChar { .. } => "model_control_char",
            JobError::ModelTooLong { .. } => "model_too_long",
            JobError::ZeroMaxTokens => "zero_max_tokens",
            JobError::TooManyTokens { .. } => "too_many_tokens",
            JobError::RequestNotObject => "request_not_object",
            JobError::BadSlo(_) => "bad_slo",
            JobError::BadTenant(_) => "bad_tenant",
            JobError::BadTraceparent(_) => "bad_traceparent",
        }
    }
}

/// Longest accepted model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// A model name travels in a NATS header ([`crate::names::HEADER_MODEL`]) and in logs: it
/// must be non-empty printable text of bounded length. A CR or LF in a header value makes
/// the NATS client refuse the message (older clients panic), so one hostile job could
/// otherwise stop whoever builds that header.
pub fn check_model_name(model: &str) -> Result<(), JobError> {
    if model.trim().is_empty() {
        return Err(JobError::EmptyModel);
    }
    if model.len() > MAX_MODEL_NAME_BYTES {
        return Err(JobError::ModelTooLong {
            len: model.len(),
            limit: MAX_MODEL_NAME_BYTES,
        });
    }
    if let Some((at, c)) = model.char_indices().find(|(_, c)| c.is_control()) {
        return Err(JobError::ModelControlChar {
            code: u32::from(c),
            at,
        });
    }
    Ok(())
}

impl Job {
    /// The job's trace context, when it carries a valid one.
    pub fn trace(&self) -> Option<crate::trace::TraceParent> {
        self.traceparent
            .as_deref()
            .and_then(crate::trace::TraceParent::parse)
    }

    /// Make the job's tenant the one its submission subject names (`jobs.submit.<token>`):
    /// the server let the publisher use that subject, so it, not the body, says whose job
    /// it is. A body that names no tenant takes the subject's; one that names another
    /// tenant is refused ([`JobError::TenantMismatch`]) rather than silently moved: a
    /// client that believes it submits for another tenant has a bug it should see.
    pub fn bind_submit_token(&mut self, token: &str) -> Result<(), JobError> {
        let subject_tenant = tenant_of_token(token);
        if let Some(tenant) = subject_tenant {
            check_tenant(tenant)?;
        }
        match (&self.tenant, subject_tenant) {
            (Some(body), subject) if subject != Some(body.as_str()) => {
                Err(JobError::TenantMismatch {
                    subject: token.to_string(),
                    body: body.clone(),
                })
            }
            _ => {
                self.tenant = subject_tenant.map(str::to_string);
                Ok(())
            }
        }
    }

    /// Parse and validate a job from the bytes of a NATS message.
    pub fn parse(bytes: &[u8], limits: &JobLimits) -> Result<Job, JobError> {
        if bytes.len() > limits.max_job_bytes {
            return Err(JobError::TooLarge {
                size: bytes.len(),
                limit: limits.max_job_bytes,
            });
        }
        let job: Job =
            serde_json::from_slice(bytes).map_err(|e| JobError::Malformed(e.to_string()))?;
        job.validate(limits)?;
        Ok(job)
    }

    /// Check the fields serde cannot: ranges, token shapes, the version.
    pub fn validate(&self, limits: &JobLimits) -> Result<(), JobError> {
        if self.v != crate::PROTOCOL_VERSION {
            return Err(JobError::UnsupportedVersion(self.v));
        }
        if !is_subject_token(&self.id) {
            return Err(JobError::BadId(self.id.clone()));
        }
        check_model_name(&self.model)?;
        if self.max_tokens == 0 && self.endpoint.generates() {
            return Err(JobError::ZeroMaxTokens);
        }
        let total = u64::from(self.prompt_tokens) + u64::from(self.max_tokens);
        if total > u64::from(limits.max_total_tokens) {
            return Err(JobError::TooManyTokens {
                total,
                limit: limits.max_total_tokens,
            });
        }
        if !self.request.is_object() {
            return Err(JobError::RequestNotObject);
        }
        if let Some(tenant) = &self.tenant {
            check_tenant(tenant)?;
        }
        if let Some(tp) = &self.traceparent {
            if crate::trace::TraceParent::parse(tp).is_none() {
                return Err(JobError::BadTraceparent(tp.chars().take(80).collect()));
            }
        }
        if let Some(slo) = &self.slo {
            match slo.invalid_field() {
                Some(SloField::TtftMs) => {
                    return Err(JobError::BadSlo("ttft_ms must be at least 1".into()));
                }
                Some(SloField::MinTokS) => {
                    return Err(JobError::BadSlo(format!(
                        "min_tok_s must be a number in (0, {MAX_SLO_TOK_S}], got {}",
                        slo.min_tok_s.unwrap_or(f64::NAN)
                    )));
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The job's priority class ([`Priority::Interactive`] when it names none).
    pub fn priority(&self) -> Priority {
        self.priority.unwrap_or(Priority::Interactive)
    }

    /// KV-cache tokens the job can occupy at its largest: prompt plus every output token.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_tokens)
    }

    /// Best-effort job id of a message that failed to parse, so the rejection can still be
    /// published on `decisions.<job_id>` where its sender is listening.
    pub fn salvage_id(bytes: &[u8]) -> Option<String> {
        #[derive(Deserialize)]
        struct IdOnly {
            id: String,
        }
        let id = serde_json::from_slice::<IdOnly>(bytes).ok()?.id;
        is_subject_token(&id).then_some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn job_json() -> Value {
        json!({
            "v": 3, "id": "job-1", "model": "llama-3.1-8b", "endpoint": "chat",
            "request": {"messages": [{"role": "user", "content": "hi"}]},
            "prompt_tokens": 10, "max_tokens": 20, "submitted_ms": 1000
        })
    }

    fn parse(v: &Value) -> Result<Job, JobError> {
        Job::parse(&serde_json::to_vec(v).unwrap(), &JobLimits::default())
    }

    #[test]
    fn a_traceparent_is_optional_and_a_broken_one_is_a_malformed_job() {
        assert_eq!(parse(&job_json()).unwrap().traceparent, None);
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut v = job_json();
        v["traceparent"] = json!(tp);
        let job = parse(&v).unwrap();
        assert_eq!(job.traceparent.as_deref(), Some(tp));
        assert_eq!(serde_json::to_value(&job).unwrap()["traceparent"], tp);
        v["traceparent"] = json!("00-00000000000000000000000000000000-00f067aa0ba902b7-01");
        let err = parse(&v).unwrap_err();
        assert_eq!(err.code(), "bad_traceparent");
        assert!(err.to_string().contains("W3C trace context"), "{err}");
    }

    #[test]
    fn the_prefix_fingerprint_is_optional_and_round_trips() {
        let old = parse(&job_json()).unwrap();
        assert_eq!(old.prefix, None, "a job without a fingerprint is valid");
        assert!(
            !serde_json::to_string(&old).unwrap().contains("prefix"),
            "and is written without one"
        );
        let mut v = job_json();
        v["prefix"] = json!({"block_size": 16, "tokens": 40,
            "hashes": ["a8531d8ec4fbf5ac", "ba8c183dcde9bc05"]});
        let job = parse(&v).unwrap();
        let prefix = job.prefix.clone().unwrap();
        assert_eq!(
            prefix.hashes,
            [0xa853_1d8e_c4fb_f5ac, 0xba8c_183d_cde9_bc05]
        );
        assert_eq!(parse(&serde_json::to_value(&job).unwrap()).unwrap(), job);
        v["prefix"]["hashes"] = json!(["not hex"]);
        assert_eq!(parse(&v).unwrap_err().code(), "malformed_job");
    }

    #[test]
    fn parses_a_valid_job_and_ignores_unknown_fields() {
        let mut v = job_json();
        v["future_field"] = json!(true);
        let job = parse(&v).unwrap();
        assert_eq!(job.model, "llama-3.1-8b");
        assert_eq!(job.kv_tokens(), 30);
        assert_eq!(job.deadline_ms, None);
        assert_eq!(job.tenant, None, "a job without a tenant is valid");
        assert_eq!(
            job.priority(),
            Priority::Interactive,
            "no class is interactive"
        );
    }

    #[test]
    fn priority_is_a_known_class() {
        let mut v = job_json();
        v["priority"] = json!("batch");
        assert_eq!(parse(&v).unwrap().priority(), Priority::Batch);
        for bad in [json!("urgent"), json!(1), json!("Batch")] {
            v["priority"] = bad.clone();
            assert_eq!(parse(&v).unwrap_err().code(), "malformed_job", "for {bad}");
        }
        for p in Priority::ALL {
            assert_eq!(Priority::parse(p.as_str()), Some(p));
        }
        assert!(Priority::Interactive.rank() < Priority::Batch.rank());
    }

    #[test]
    fn tenant_is_a_short_token() {
        let mut v = job_json();
        v["tenant"] = json!("acme-prod_2");
        assert_eq!(parse(&v).unwrap().tenant.as_deref(), Some("acme-prod_2"));
        for bad in [
            "",
            "a\nb",
            "tab\there",
            "has space",
            "a.b",
            "_anon",
            &"t".repeat(MAX_TENANT_BYTES + 1),
        ] {
            v["tenant"] = json!(bad);
            assert_eq!(parse(&v).unwrap_err().code(), "bad_tenant", "for {bad:?}");
        }
        assert!(check_tenant("a\u{7f}b")
            .unwrap_err()
            .to_string()
            .contains("control character"));
    }

    #[test]
    fn an_older_job_is_refused_with_what_changed() {
        for old in [1, 2] {
            let mut v = job_json();
            v["v"] = json!(old);
            let error = parse(&v).unwrap_err();
            assert_eq!(error.code(), "unsupported_version");
            let text = error.to_string();
            for named in [
                "jobs.submit.<tenant>",
                "results.<tenant>.<job_id>.<worker_id>.chunk|final",
                "cancel.<tenant>.<job_id>",
            ] {
                assert!(text.contains(named), "{named} in {text}");
            }
        }
    }

    #[test]
    fn the_submission_subject_names_the_tenant() {
        let job = parse(&job_json()).unwrap();
        // No tenant in the body: the subject's.
        let mut j = job.clone();
        j.bind_submit_token("acme").unwrap();
        assert_eq!(j.tenant.as_deref(), Some("acme"));
        let mut j = job.clone();
        j.bind_submit_token("_anon").unwrap();
        assert_eq!(j.tenant, None);
        // The same tenant in both: fine.
        let mut j = job.clone();
        j.tenant = Some("acme".into());
        j.bind_submit_token("acme").unwrap();
        assert_eq!(j.tenant.as_deref(), Some("acme"));
        // Another tenant in the body: refused, never believed.
        for (body, token) in [("other", "acme"), ("other", "_anon")] {
            let mut j = job.clone();
            j.tenant = Some(body.into());
            let error = j.bind_submit_token(token).unwrap_err();
            assert_eq!(error.code(), "tenant_mismatch", "{error}");
            assert_eq!(j.tenant.as_deref(), Some(body), "unchanged");
        }
        // A token no tenant may have.
        let mut j = job.clone();
        assert_eq!(j.bind_submit_token("a:b").unwrap_err().code(), "bad_tenant");
    }

    #[test]
    fn rejects_each_bad_field_with_its_reason() {
        let cases: Vec<(Value, &str)> = vec![
            (json!("not an object"), "malformed_job"),
            (
                {
                    let mut v = job_json();
                    v["prompt_tokens"] = json!(-5);
                    v
                },
                "malformed_job",
            ),
            (
                {
                    let mut v = job_json();
                    v["max_tokens"] = json!("many");
                    v
                },
                "malformed_job",
            ),
            (
                {
                    let mut v = job_json();
                    v["v"] = json!(9);
                    v
                },
                "unsupported_version",
            ),
            (
                {
                    let mut v = job_json();
                    v["id"] = json!("a.b");
                    v
                },
                "bad_job_id",
            ),
            (
                {
                    let mut v = job_json();
                    v["model"] = json!(" ");
                    v
                },
                "empty_model",
            ),
            (
                {
                    let mut v = job_json();
                    v["model"] = json!("a\r\nb");
                    v
                },
                "model_control_char",
            ),
            (
                {
                    let mut v = job_json();
                    v["model"] = json!("tab\there");
                    v
                },
                "model_control_char",
            ),
            (
                {
                    let mut v = job_json();
                    v["model"] = json!("m".repeat(MAX_MODEL_NAME_BYTES + 1));
                    v
                },
                "model_too_long",
            ),
            (
                {
                    let mut v = job_json();
                    v["max_tokens"] = json!(0);
                    v
                },
                "zero_max_tokens",
            ),
            (
                {
                    let mut v = job_json();
                    v["max_tokens"] = json!(4_000_000_000u64);
                    v
                },
                "too_many_tokens",
            ),
            (
                {
                    let mut v = job_json();
                    v["request"] = json!([1]);
                    v
                },
                "request_not_object",
            ),
        ];
        for (v, code) in cases {
            assert_eq!(parse(&v).unwrap_err().code(), code, "for {v}");
        }
    }

    #[test]
    fn only_an_embedding_job_may_write_no_tokens() {
        let mut v = job_json();
        v["endpoint"] = json!("embedding");
        v["request"] = json!({"model": "m", "input": "hello"});
        v["max_tokens"] = json!(0);
        let job = parse(&v).unwrap();
        assert_eq!(job.endpoint, Endpoint::Embedding);
        assert!(!job.endpoint.generates());
        assert_eq!(job.endpoint.path(), "/v1/embeddings");
        assert_eq!(job.kv_tokens(), 10);
        v["endpoint"] = json!("completion");
        assert_eq!(parse(&v).unwrap_err().code(), "zero_max_tokens");
    }

    #[test]
    fn rejects_oversized_payload_before_parsing() {
        let bytes = vec![b' '; JobLimits::default().max_job_bytes + 1];
        let err = Job::parse(&bytes, &JobLimits::default()).unwrap_err();
        assert_eq!(err.code(), "job_too_large");
    }

    #[test]
    fn salvages_the_id_of_a_partly_valid_job() {
        assert_eq!(
            Job::salvage_id(br#"{"id":"j-9","max_tokens":"x"}"#),
            Some("j-9".into())
        );
        assert_eq!(Job::salvage_id(br#"{"id":"a.b"}"#), None);
        assert_eq!(Job::salvage_id(b"garbage"), None);
    }
}
