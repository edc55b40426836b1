//! A drill's HTTP client: one streaming chat completion through the gateway, and what the
//! client could tell of it. The drill counts jobs by id; over HTTP the id is the gateway's
//! (`x-metronome-job-id`), known once the response headers arrive.
//!
//! A request the gateway never took (no connection, no response, or a 503 before the job
//! was queued) is tried again, as a client told to retry would, and is not a job. Once a
//! response with a job id came back, the client saw one of: the whole stream (`[DONE]`), a
//! clear error (an error status with its code, or an `error` event in the stream), or a
//! stream that broke without either, which leaves the client without an answer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use metronome_protocol::sse::{SseDecoder, DONE};
use serde_json::{json, Value};

/// What the client saw of one job.
#[derive(Debug, Clone, PartialEq)]
pub enum HttpOutcome {
    /// The stream ended with `[DONE]` and no error.
    Complete,
    /// An error status or an error event: the client knows the job failed, and why.
    ClearError(String),
    /// The connection or the stream ended without `[DONE]` or an error.
    Broken(String),
}

/// One request: its job id (when the gateway took it), what the client saw, and how many
/// tries the gateway refused before it took one.
#[derive(Debug)]
pub struct HttpJob {
    pub job_id: Option<String>,
    pub outcome: HttpOutcome,
    pub refused: usize,
}

/// How long a request is tried again while the gateway does not take it (a restart).
const TAKE_WITHIN: Duration = Duration::from_secs(60);

/// Send one streaming chat completion to `gateway` (its base URL) for `model`. `streaming`
/// counts the responses being read at any moment (a restart's notes say how many it met).
pub async fn stream_chat(
    http: &reqwest::Client,
    gateway: &str,
    model: &str,
    streaming: &AtomicUsize,
) -> HttpJob {
    let body = json!({"model": model, "stream": true, "max_tokens": 24,
        "messages": [{"role": "user", "content": "a fault drill over HTTP, tell me a story"}]});
    let url = format!("{}/v1/chat/completions", gateway.trim_end_matches('/'));
    let give_up = tokio::time::Instant::now() + TAKE_WITHIN;
    let mut refused = 0;
    loop {
        let response = http
            .post(&url)
            .json(&body)
            .timeout(Duration::from_secs(300))
            .send()
            .await;
        let retry = match response {
            Err(e) => format!("no response: {e}"),
            Ok(r) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => {
                format!("503 {}", r.text().await.unwrap_or_default())
            }
            Ok(r) => {
                streaming.fetch_add(1, Ordering::SeqCst);
                let job = read_response(r, refused).await;
                streaming.fetch_sub(1, Ordering::SeqCst);
                return job;
            }
        };
        refused += 1;
        if tokio::time::Instant::now() > give_up {
            return HttpJob {
                job_id: None,
                outcome: HttpOutcome::Broken(format!("not taken within 60 s: {retry}")),
                refused,
            };
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn read_response(r: reqwest::Response, refused: usize) -> HttpJob {
    let job_id = r
        .headers()
        .get("x-metronome-job-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let status = r.status();
    if !status.is_success() {
        let text = r.text().await.unwrap_or_default();
        let code = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| error_code(&v))
            .unwrap_or_else(|| format!("HTTP {}", status.as_u16()));
        return HttpJob {
            job_id,
            outcome: HttpOutcome::ClearError(code),
            refused,
        };
    }
    let mut bytes = r.bytes_stream();
    let mut decoder = SseDecoder::new();
    let outcome = 'read: loop {
        let events = match bytes.next().await {
            None => {
                let last = decoder.finish().and_then(|e| stream_end(&e.data));
                break last.unwrap_or_else(|| {
                    HttpOutcome::Broken("the stream ended without [DONE]".into())
                });
            }
            Some(Err(e)) => break HttpOutcome::Broken(format!("the stream broke: {e}")),
            Some(Ok(b)) => decoder.push(&b),
        };
        if let Some(outcome) = events.iter().find_map(|e| stream_end(&e.data)) {
            break 'read outcome;
        }
    };
    HttpJob {
        job_id,
        outcome,
        refused,
    }
}

/// The end of the stream an event's data announces, if any.
fn stream_end(data: &str) -> Option<HttpOutcome> {
    if data == DONE {
        return Some(HttpOutcome::Complete);
    }
    let value: Value = serde_json::from_str(data).ok()?;
    value
        .get("error")
        .map(|_| HttpOutcome::ClearError(error_code(&value).unwrap_or_else(|| "error".into())))
}

/// `error.code` (or `error.type`) of an OpenAI error body.
fn error_code(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    e.get("code")
        .and_then(Value::as_str)
        .or_else(|| e.get("type").and_then(Value::as_str))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_events_end_a_job_only_on_done_or_error() {
        assert_eq!(stream_end("[DONE]"), Some(HttpOutcome::Complete));
        assert_eq!(
            stream_end(r#"{"error": {"code": "worker_lost", "message": "x"}}"#),
            Some(HttpOutcome::ClearError("worker_lost".into()))
        );
        assert_eq!(
            stream_end(r#"{"choices": [{"delta": {"content": "a"}}]}"#),
            None
        );
        assert_eq!(stream_end("{not json"), None);
    }
}
