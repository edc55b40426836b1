//! The streaming OpenAI-API client: sends one request, reads its server-sent events and
//! turns them into a [`RequestRecord`]. Works against any OpenAI-compatible server.
//!
//! Never fails: every outcome (connection refused, 4xx/5xx, broken stream, timeout,
//! cancellation) becomes a record with an [`ErrorKind`], so one bad request cannot crash a
//! run. Malformed SSE payloads are counted as stream errors, with the reason.

use std::time::Duration;

use futures::StreamExt;
use metronome_protocol::sse::SseDecoder;
use serde_json::Value;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::LoadError;
use crate::prompt::{request_body, BodyParams};
use crate::record::{ErrorKind, RequestRecord};
use crate::request::PlannedRequest;
use crate::spec::LoadSpec;

/// Response header carrying Metronome's job id.
pub const HEADER_JOB_ID: &str = "x-metronome-job-id";
/// Response header carrying the Metronome worker that served the request.
pub const HEADER_WORKER: &str = "x-metronome-worker";

/// Longest error body excerpt kept in a record.
const ERROR_EXCERPT: usize = 300;

/// What one SSE payload says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChunkInfo {
    /// The `[DONE]` sentinel.
    pub done: bool,
    /// Characters of generated text in the chunk (chat `delta.content` or completion `text`).
    pub text_chars: usize,
    /// `usage.completion_tokens`, when present.
    pub completion_tokens: Option<u32>,
    /// An `error` object or string carried in the stream.
    pub error: Option<String>,
}

/// Interprets one SSE payload; `Err` with the reason when it is not JSON.
pub fn interpret_chunk(data: &str) -> Result<ChunkInfo, String> {
    let data = data.trim();
    if data == metronome_protocol::sse::DONE {
        return Ok(ChunkInfo {
            done: true,
            ..Default::default()
        });
    }
    let v: Value =
        serde_json::from_str(data).map_err(|e| format!("malformed SSE JSON payload: {e}"))?;
    let mut info = ChunkInfo::default();
    if let Some(err) = v.get("error") {
        info.error = Some(
            err.get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string()),
        );
    }
    if let Some(choices) = v.get("choices").and_then(Value::as_array) {
        for c in choices {
            let text = c
                .get("delta")
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .or_else(|| c.get("text").and_then(Value::as_str))
                .unwrap_or("");
            info.text_chars += text.len();
        }
    }
    info.completion_tokens = v
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    Ok(info)
}

/// Sends requests of one spec. Cheap to clone (the HTTP pool is shared).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    url: String,
    spec: std::sync::Arc<LoadSpec>,
    nonce: u64,
    timeout: Duration,
}

/// Why an outstanding request is being stopped early.
#[derive(Clone, Default)]
pub struct Stops {
    /// The run was cancelled.
    pub cancel: CancellationToken,
    /// The drain period ended.
    pub cutoff: CancellationToken,
}

impl Client {
    pub fn new(spec: &LoadSpec) -> Result<Self, LoadError> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(spec.max_in_flight)
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(LoadError::Client)?;
        Ok(Client {
            http,
            url: spec.request_url(),
            spec: std::sync::Arc::new(spec.clone()),
            // Random per run, not derived from the seed: two runs with the same seed
            // against the same server must not hit each other's prefix cache.
            nonce: rand::random::<u64>() % 1_000_000,
            timeout: Duration::from_secs_f64(spec.request_timeout_s),
        })
    }

    /// Sends one request now and measures it. `run_start` dates `sent_s`.
    pub async fn send(
        &self,
        req: &PlannedRequest,
        run_start: Instant,
        stops: &Stops,
    ) -> RequestRecord {
        let body = request_body(&BodyParams {
            endpoint: self.spec.endpoint,
            model: &self.spec.model,
            prompt_tokens: req.prompt_tokens,
            max_tokens: req.output_tokens,
            extensions: self.spec.extensions,
            unique: self.spec.unique_prompts,
            nonce: self.nonce,
            id: req.id,
            messages: &req.messages,
        });
        let mut rec = RequestRecord {
            id: req.id,
            scheduled_s: req.at_s,
            prompt_tokens: req.prompt_tokens,
            max_tokens: req.output_tokens,
            tenant: req
                .tenant
                .and_then(|i| self.spec.tenants.get(i))
                .map(|t| t.name.clone()),
            ..Default::default()
        };
        let key = self.spec.api_key_for(req.tenant);
        let mut m = Measure::default();
        let t0 = Instant::now();
        rec.sent_s = (t0 - run_start).as_secs_f64();
        let outcome = tokio::select! {
            r = tokio::time::timeout(self.timeout, self.exchange(&body, key, &mut rec, &mut m)) => match r {
                Ok(r) => r,
                Err(_) => Err((ErrorKind::Timeout, format!("request timed out after {:?}", self.timeout))),
            },
            () = stops.cutoff.cancelled() => Err((ErrorKind::Timeout, "cut off at the end of the drain period".to_string())),
            () = stops.cancel.cancelled() => Err((ErrorKind::Cancelled, "run cancelled".to_string())),
        };
        let end = Instant::now();
        rec.ttft_ms = m.first_token.map(|t| ms(t - t0));
        rec.chunks = m.chunks;
        rec.output_tokens = m.usage_tokens.unwrap_or(m.chunks);
        rec.usage_reported = m.usage_tokens.is_some();
        match outcome {
            Ok(()) => {
                rec.ok = true;
                rec.e2e_ms = Some(ms(m.done_at.unwrap_or(end) - t0));
            }
            Err((kind, msg)) => {
                rec.ok = false;
                rec.error_kind = Some(kind);
                rec.error = Some(msg);
                rec.e2e_ms = Some(ms(end - t0));
            }
        }
        rec.derive_rates();
        if !rec.ok {
            tracing::debug!(id = rec.id, kind = ?rec.error_kind, error = ?rec.error, "request failed");
        }
        rec
    }

    async fn exchange(
        &self,
        body: &Value,
        api_key: Option<&str>,
        rec: &mut RequestRecord,
        m: &mut Measure,
    ) -> Result<(), (ErrorKind, String)> {
        let mut builder = self.http.post(&self.url).json(body);
        if let Some(key) = api_key {
            builder = builder.bearer_auth(key);
        }
        let resp = builder.send().await.map_err(|e| {
            let kind = if e.is_connect() {
                ErrorKind::Connect
            } else if e.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Stream
            };
            (kind, error_chain(&e))
        })?;
        let status = resp.status();
        rec.status = Some(status.as_u16());
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        rec.job_id = header(HEADER_JOB_ID);
        rec.worker = header(HEADER_WORKER);
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let msg = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| {
                    v.get("error")
                        .and_then(|e| e.get("message"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .unwrap_or(text);
            return Err((
                ErrorKind::Http,
                format!("HTTP {}: {}", status.as_u16(), excerpt(&msg)),
            ));
        }
        let mut decoder = SseDecoder::new();
        let mut stream = resp.bytes_stream();
        let mut done = false;
        while let Some(item) = stream.next().await {
            let bytes = item.map_err(|e| (ErrorKind::Stream, error_chain(&e)))?;
            let now = Instant::now();
            for event in decoder.push(&bytes) {
                m.handle(&event.data, now)?;
                if m.done {
                    done = true;
                }
            }
            if done {
                break;
            }
        }
        if !done {
            if let Some(event) = decoder.finish() {
                m.handle(&event.data, Instant::now())?;
            }
        }
        if !m.done && m.chunks == 0 && m.usage_tokens.is_none() {
            return Err((
                ErrorKind::Stream,
                "stream ended without any chunk or [DONE]".to_string(),
            ));
        }
        Ok(())
    }
}

/// Running measurements of one stream.
#[derive(Debug, Default)]
struct Measure {
    first_token: Option<Instant>,
    /// When `[DONE]` arrived.
    done_at: Option<Instant>,
    chunks: u32,
    usage_tokens: Option<u32>,
    done: bool,
}

impl Measure {
    fn handle(&mut self, data: &str, now: Instant) -> Result<(), (ErrorKind, String)> {
        let info = interpret_chunk(data).map_err(|e| (ErrorKind::Stream, e))?;
        if let Some(err) = info.error {
            return Err((ErrorKind::Stream, format!("error event: {}", excerpt(&err))));
        }
        if info.done {
            self.done = true;
            self.done_at.get_or_insert(now);
            return Ok(());
        }
        if info.text_chars > 0 {
            self.chunks += 1;
            self.first_token.get_or_insert(now);
        }
        if let Some(n) = info.completion_tokens {
            self.usage_tokens = Some(n);
        }
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn excerpt(s: &str) -> String {
    let s = s.trim();
    if s.chars().count() <= ERROR_EXCERPT {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(ERROR_EXCERPT).collect::<String>())
    }
}

/// An error with its sources, so "connection refused" is not hidden behind "error sending
/// request".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interprets_chat_completion_usage_error_and_done() {
        let chat = interpret_chunk(r#"{"choices":[{"delta":{"content":"hi"}}]}"#).unwrap();
        assert_eq!(chat.text_chars, 2);
        let role = interpret_chunk(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
            .unwrap();
        assert_eq!(role.text_chars, 0);
        let comp = interpret_chunk(r#"{"choices":[{"text":" the"}]}"#).unwrap();
        assert_eq!(comp.text_chars, 4);
        let usage =
            interpret_chunk(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}"#)
                .unwrap();
        assert_eq!(usage.completion_tokens, Some(9));
        let err = interpret_chunk(r#"{"error":{"message":"overloaded"}}"#).unwrap();
        assert_eq!(err.error.as_deref(), Some("overloaded"));
        assert!(interpret_chunk("[DONE]").unwrap().done);
        assert!(interpret_chunk("{not json")
            .unwrap_err()
            .contains("malformed"));
    }
}
