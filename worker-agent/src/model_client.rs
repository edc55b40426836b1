//! The model server as the agent sees it: a streaming OpenAI completion, its Prometheus
//! text and its health. One trait, one real implementation over HTTP (reqwest).
//!
//! Invariants: every request of an endpoint that generates goes out with `stream: true` and
//! `stream_options.include_usage: true`, whatever the client asked, so the agent can relay
//! chunks, time the first token and read the usage from the last chunk. An embedding
//! request goes out as it came and its whole JSON answer is the stream's one item. Dropping the chunk
//! stream drops the HTTP response, which closes the connection; OpenAI-compatible servers
//! (vLLM, SGLang) abort the generation when the client goes away, so dropping is how a job
//! is cancelled.

use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use metronome_protocol::sse::{self, SseDecoder};
use metronome_protocol::Endpoint;
use serde_json::{json, Value};

/// Parsed SSE chunks of one completion, in order. Ends after `data: [DONE]` (or when the
/// server closes the stream).
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Value, ModelError>> + Send>>;

/// Why a call to the model server failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model server unreachable: {0}")]
    Connect(String),
    #[error("model server answered HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error("model server stream broke: {0}")]
    Stream(String),
    #[error("model server sent an unreadable chunk ({reason}): {line}")]
    BadChunk { reason: String, line: String },
    #[error("model server reported an error in the stream: {0}")]
    InStream(String),
}

impl ModelError {
    /// Whether the server itself is gone: no connection, or the connection broke
    /// mid-stream (a crashed or killed server), rather than an answer it gave.
    pub fn server_lost(&self) -> bool {
        matches!(self, ModelError::Connect(_) | ModelError::Stream(_))
    }

    /// Whether asking again later could succeed (the server may come back); a 4xx never will.
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelError::Status { status, .. } => *status >= 500,
            ModelError::BadChunk { .. } => false,
            _ => true,
        }
    }
}

/// What the model server is told of a job besides its body, so its own logs and traces
/// join Metronome's: the job id as `X-Request-Id` (vLLM and SGLang take it as the request's
/// id) and the job's W3C `traceparent`, passed on as it came (vLLM's OpenTelemetry spans
/// continue it).
#[derive(Debug, Clone, Copy)]
pub struct RequestIds<'a> {
    pub request_id: &'a str,
    pub traceparent: Option<&'a str>,
}

/// Request header naming the request, as vLLM, SGLang and most proxies read it.
pub const HEADER_REQUEST_ID: &str = "x-request-id";

/// The CA certificates of a PEM file (at least one).
pub fn read_ca(path: &str) -> Result<Vec<reqwest::Certificate>, ModelError> {
    let pem = std::fs::read(path)
        .map_err(|e| ModelError::Connect(format!("reading the CA file {path}: {e}")))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| ModelError::Connect(format!("the CA file {path}: {e}")))?;
    if certs.is_empty() {
        return Err(ModelError::Connect(format!(
            "the CA file {path} holds no PEM certificate"
        )));
    }
    Ok(certs)
}

/// The narrow interface of a model server. Held as `Arc<dyn ModelClient>`.
pub trait ModelClient: Send + Sync {
    /// Start a streaming completion of `request` (the OpenAI body) on `endpoint`; for an
    /// endpoint that does not stream (embeddings), the stream's one item is the response.
    /// Connection and HTTP errors come out as the stream's first item.
    fn stream_completion(
        &self,
        endpoint: Endpoint,
        request: Value,
        ids: RequestIds<'_>,
    ) -> ChunkStream;
    /// The raw Prometheus exposition text of the server.
    fn metrics(&self) -> BoxFuture<'_, Result<String, ModelError>>;
    /// Ok when the server's health endpoint answers 2xx.
    fn health(&self) -> BoxFuture<'_, Result<(), ModelError>>;
}

/// Force streaming with usage on an OpenAI request body. A body that is not an object is
/// replaced by an object only holding those fields (the server will then refuse it with a
/// readable 400, which becomes the job's error).
pub fn force_streaming(mut request: Value) -> Value {
    if !request.is_object() {
        request = json!({});
    }
    let obj = request.as_object_mut().expect("object");
    obj.insert("stream".into(), Value::Bool(true));
    let opts = obj.entry("stream_options").or_insert_with(|| json!({}));
    if !opts.is_object() {
        *opts = json!({});
    }
    opts.as_object_mut()
        .expect("object")
        .insert("include_usage".into(), Value::Bool(true));
    request
}

/// What the data of one SSE event means for the chunk stream.
#[derive(Debug, PartialEq)]
pub enum StreamData {
    /// A JSON chunk.
    Chunk(Value),
    /// `[DONE]`: the stream is over.
    Done,
    /// Empty data: nothing to relay.
    Skip,
}

/// Interpret the data of one event of an OpenAI SSE stream.
pub fn interpret_data(data: &str) -> Result<StreamData, ModelError> {
    let data = data.trim_end();
    if data.is_empty() {
        return Ok(StreamData::Skip);
    }
    if data == sse::DONE {
        return Ok(StreamData::Done);
    }
    let value: Value = serde_json::from_str(data).map_err(|e| ModelError::BadChunk {
        reason: e.to_string(),
        line: truncate(data, 200),
    })?;
    // vLLM and SGLang report a failure mid-stream as a chunk holding only an error object.
    if let Some(err) = value.get("error") {
        if value.get("choices").is_none() {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(ModelError::InStream(msg));
        }
    }
    Ok(StreamData::Chunk(value))
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Decode a byte stream as server-sent events and parse each event's data. Events may be
/// cut anywhere between network reads, including inside a UTF-8 sequence.
pub fn sse_chunks<S, E>(bytes: S) -> ChunkStream
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    Box::pin(async_stream::stream! {
        let mut decoder = SseDecoder::new();
        let mut bytes = Box::pin(bytes);
        'read: loop {
            let events = match bytes.next().await {
                Some(Ok(b)) => decoder.push(&b),
                Some(Err(e)) => {
                    yield Err(ModelError::Stream(e.to_string()));
                    return;
                }
                None => break 'read,
            };
            for event in events {
                match interpret_data(&event.data) {
                    Ok(StreamData::Chunk(v)) => yield Ok(v),
                    Ok(StreamData::Done) => return,
                    Ok(StreamData::Skip) => {}
                    Err(e) => {
                        yield Err(e);
                        return;
                    }
                }
            }
        }
        // A last event without its blank line.
        if let Some(event) = decoder.finish() {
            match interpret_data(&event.data) {
                Ok(StreamData::Chunk(v)) => yield Ok(v),
                Ok(_) => {}
                Err(e) => yield Err(e),
            }
        }
    })
}

/// The real model server over HTTP.
#[derive(Clone)]
pub struct HttpModelClient {
    base: String,
    health_path: String,
    metrics_path: String,
    http: reqwest::Client,
}

impl HttpModelClient {
    /// `base` is the server root (`http://127.0.0.1:8001`), without `/v1`; an `https://`
    /// server's certificate is verified against the system's CAs and `ca_file`'s (PEM).
    pub fn new(
        base: &str,
        health_path: &str,
        metrics_path: &str,
        ca_file: Option<&str>,
    ) -> Result<Self, ModelError> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            // Only the small status calls get a short overall timeout (per request below);
            // a generation may legitimately stream for minutes.
            .pool_idle_timeout(Duration::from_secs(30));
        if let Some(path) = ca_file {
            for cert in read_ca(path)? {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .build()
            .map_err(|e| ModelError::Connect(e.to_string()))?;
        Ok(HttpModelClient {
            base: base.trim_end_matches('/').to_string(),
            health_path: health_path.to_string(),
            metrics_path: metrics_path.to_string(),
            http,
        })
    }

    async fn get_text(&self, path: &str) -> Result<String, ModelError> {
        let resp = self
            .http
            .get(format!("{}{}", self.base, path))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| ModelError::Connect(e.to_string()))?;
        let status = resp.status();
        let body = resp
            .text()
            .await
            .map_err(|e| ModelError::Stream(e.to_string()))?;
        if !status.is_success() {
            return Err(ModelError::Status {
                status: status.as_u16(),
                body: truncate(&body, 500),
            });
        }
        Ok(body)
    }
}

impl ModelClient for HttpModelClient {
    fn stream_completion(
        &self,
        endpoint: Endpoint,
        request: Value,
        ids: RequestIds<'_>,
    ) -> ChunkStream {
        let url = format!("{}{}", self.base, endpoint.path());
        let streams = endpoint.generates();
        let (accept, body) = if streams {
            ("text/event-stream", force_streaming(request))
        } else {
            ("application/json", request)
        };
        let mut req = self
            .http
            .post(url)
            .header(reqwest::header::ACCEPT, accept)
            .header(HEADER_REQUEST_ID, ids.request_id)
            .json(&body);
        if let Some(tp) = ids.traceparent {
            req = req.header(metronome_protocol::trace::TRACEPARENT_HEADER, tp);
        }
        Box::pin(async_stream::stream! {
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    yield Err(ModelError::Connect(e.to_string()));
                    return;
                }
            };
            let status = resp.status();
            if !status.is_success() {
                let body = resp.text().await.unwrap_or_default();
                yield Err(ModelError::Status { status: status.as_u16(), body: truncate(&body, 500) });
                return;
            }
            if !streams {
                let body = match resp.bytes().await {
                    Ok(b) => b,
                    Err(e) => {
                        yield Err(ModelError::Stream(e.to_string()));
                        return;
                    }
                };
                yield serde_json::from_slice::<Value>(&body).map_err(|e| ModelError::BadChunk {
                    reason: e.to_string(),
                    line: truncate(&String::from_utf8_lossy(&body), 200),
                });
                return;
            }
            let mut chunks = sse_chunks(resp.bytes_stream());
            while let Some(item) = chunks.next().await {
                yield item;
            }
        })
    }

    fn metrics(&self) -> BoxFuture<'_, Result<String, ModelError>> {
        Box::pin(self.get_text(&self.metrics_path))
    }

    fn health(&self) -> BoxFuture<'_, Result<(), ModelError>> {
        Box::pin(async move { self.get_text(&self.health_path).await.map(|_| ()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forcing_streaming_keeps_the_rest_of_the_request() {
        let r = force_streaming(
            json!({"model": "m", "stream": false, "stream_options": {"x": 1}, "max_tokens": 5}),
        );
        assert_eq!(r["stream"], true);
        assert_eq!(r["stream_options"]["include_usage"], true);
        assert_eq!(r["stream_options"]["x"], 1);
        assert_eq!(r["max_tokens"], 5);
        let r = force_streaming(json!({"stream_options": null}));
        assert_eq!(r["stream_options"]["include_usage"], true);
    }

    #[test]
    fn event_data() {
        assert_eq!(interpret_data("[DONE]").unwrap(), StreamData::Done);
        assert_eq!(interpret_data("").unwrap(), StreamData::Skip);
        assert_eq!(
            interpret_data("{\"a\":1}").unwrap(),
            StreamData::Chunk(json!({"a": 1}))
        );
        assert!(matches!(
            interpret_data("{oops"),
            Err(ModelError::BadChunk { .. })
        ));
        assert!(matches!(
            interpret_data("{\"error\": {\"message\": \"out of memory\"}}"),
            Err(ModelError::InStream(m)) if m == "out of memory"
        ));
    }

    #[tokio::test]
    async fn chunks_split_across_reads_are_reassembled() {
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"é\"}}]}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\ndata: {\"after\":1}\n";
        let bytes = text.as_bytes();
        // Cut in the middle of the two-byte 'é' and of the second line.
        let parts: Vec<Result<bytes::Bytes, std::io::Error>> =
            [&bytes[..35], &bytes[35..60], &bytes[60..]]
                .iter()
                .map(|p| Ok(bytes::Bytes::copy_from_slice(p)))
                .collect();
        let got: Vec<Value> = sse_chunks(futures::stream::iter(parts))
            .map(|r| r.unwrap())
            .collect()
            .await;
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0]["choices"][0]["delta"]["content"], "é");
        assert_eq!(got[1]["n"], 2);
    }
}
