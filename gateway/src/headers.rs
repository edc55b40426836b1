//! The HTTP headers of Metronome's own that the OpenAI endpoints read and write: every name
//! in one place, so the routes, the error bodies that name a header (`param`), the API-key
//! checks and the CORS lists agree.

/// Response header: the job id.
pub const HEADER_JOB_ID: &str = "x-metronome-job-id";
/// Response header: the worker that ran the job.
pub const HEADER_WORKER: &str = "x-metronome-worker";
/// Response header: the trace id (32 hex digits) of the request's W3C trace context.
pub const HEADER_TRACE_ID: &str = "x-metronome-trace-id";
/// Request header: the job's queueing deadline, either a budget in milliseconds from now
/// (`5000`) or, from 10^12 on, an absolute Unix time in milliseconds.
pub const HEADER_DEADLINE_MS: &str = "x-metronome-deadline-ms";

/// Request header: a tighter time-to-first-token target than the model's, in ms.
pub const HEADER_SLO_TTFT_MS: &str = "x-metronome-slo-ttft-ms";
/// Request header: a higher decode-rate floor than the model's, in tokens/s.
pub const HEADER_SLO_MIN_TOK_S: &str = "x-metronome-slo-min-tok-s";
/// Request header asking for a priority class (`interactive`, `batch`) no higher than the
/// API key's.
pub const HEADER_PRIORITY: &str = "x-metronome-priority";
