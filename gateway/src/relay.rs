//! Relaying a job's streamed chunks to its client as Server-Sent Events, in OpenAI's
//! streaming format: one `data: <chunk>` per chunk, the usage chunk when
//! `stream_options.include_usage` is set, then `data: [DONE]`.
//!
//! Invariants: chunks leave in `seq` order, each once. Out-of-order chunks wait in a
//! buffer of at most `reorder_max_bytes` (of their JSON): a chunk that would pass it ends
//! the stream with an error, counted (`metronome_gateway_reorder_overflows_total`), rather
//! than letting one stream's missing chunk hold unbounded memory; duplicates are dropped; chunks still missing when the final result arrives are
//! counted as gaps and the buffered ones are sent in order (the final result is
//! authoritative). Chunks all come from one run of the job (one worker, one attempt): the
//! first run to stream is the only one relayed, and output of any other ends the stream
//! with a `worker_lost` error rather than splicing two runs. Usage appears exactly once when asked for (the model server's own
//! usage chunk if it sent one, otherwise one built from the final result) and never when
//! not asked for. An error after the stream started is sent as `data: {"error": …}` and
//! ends the stream without `[DONE]`.

use std::collections::BTreeMap;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use metronome_protocol::time::unix_ms;
use metronome_protocol::{Endpoint, FinalResult};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::submit::{JobEvent, Submission};

/// Puts chunks back in `seq` order, holding at most `max_bytes` (of their JSON) that came
/// ahead of a missing one.
#[derive(Debug)]
pub struct Reorder {
    next: u64,
    pending: BTreeMap<u64, (Value, usize)>,
    held_bytes: usize,
    max_bytes: usize,
}

/// Chunks that came ahead of a missing one would hold more than the bound: the stream
/// cannot go on in order without holding more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldTooMuch {
    /// The chunk everything held waits for.
    pub waiting_for: u64,
    /// Bytes held, and those of the chunk that did not fit.
    pub held_bytes: usize,
    pub chunk_bytes: usize,
    pub max_bytes: usize,
}

impl HeldTooMuch {
    /// The error the client's stream ends with.
    pub fn error(&self) -> ApiError {
        ApiError::bad_upstream(format!(
            "the stream was ended: chunk {} did not arrive while {} bytes of the chunks after it were held (at most {} are, reorder_max_bytes)",
            self.waiting_for,
            self.held_bytes + self.chunk_bytes,
            self.max_bytes
        ))
        .with_code("reorder_overflow")
    }
}

impl Reorder {
    pub fn new(max_bytes: usize) -> Reorder {
        Reorder {
            next: 0,
            pending: BTreeMap::new(),
            held_bytes: 0,
            max_bytes,
        }
    }

    /// Accept chunk `seq`; returns the chunks now ready, in order, or [`HeldTooMuch`] when
    /// holding it would pass the bound (nothing is held then).
    pub fn push(&mut self, seq: u64, data: Value) -> Result<Vec<Value>, HeldTooMuch> {
        if seq < self.next || self.pending.contains_key(&seq) {
            return Ok(Vec::new());
        }
        let mut ready = Vec::new();
        if seq == self.next {
            ready.push(data);
            self.next += 1;
        } else {
            // Only chunks that must wait are measured: in order, nothing is held.
            let chunk_bytes = data.to_string().len();
            if self.held_bytes.saturating_add(chunk_bytes) > self.max_bytes {
                return Err(HeldTooMuch {
                    waiting_for: self.next,
                    held_bytes: self.held_bytes,
                    chunk_bytes,
                    max_bytes: self.max_bytes,
                });
            }
            self.held_bytes += chunk_bytes;
            self.pending.insert(seq, (data, chunk_bytes));
        }
        while let Some((data, bytes)) = self.pending.remove(&self.next) {
            self.held_bytes -= bytes;
            ready.push(data);
            self.next += 1;
        }
        Ok(ready)
    }

    /// Bytes of chunks held ahead of a missing one.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The stream is over: every buffered chunk in order, and how many `seq` numbers
    /// were never received (below the highest buffered one, or below `expected`).
    pub fn finish(&mut self, expected: u64) -> (Vec<Value>, u64) {
        let pending = std::mem::take(&mut self.pending);
        self.held_bytes = 0;
        let highest = pending.keys().next_back().map_or(self.next, |s| s + 1);
        let end = highest.max(expected);
        let gaps = end - self.next - pending.len() as u64;
        self.next = end;
        (pending.into_values().map(|(v, _)| v).collect(), gaps)
    }

    /// Chunks sent so far, counting gaps.
    pub fn sent(&self) -> u64 {
        self.next
    }
}

/// Applies the client's usage choice to the model server's chunks.
#[derive(Debug)]
pub struct UsagePolicy {
    include_usage: bool,
    usage_seen: bool,
}

impl UsagePolicy {
    pub fn new(include_usage: bool) -> Self {
        UsagePolicy {
            include_usage,
            usage_seen: false,
        }
    }

    /// The chunk to send, if any. Without `include_usage`, usage-only chunks are dropped
    /// and usage fields removed (the worker may have asked the model server for them).
    pub fn filter(&mut self, mut chunk: Value) -> Option<Value> {
        let has_usage = chunk.get("usage").is_some_and(|u| !u.is_null());
        if !has_usage {
            return Some(chunk);
        }
        if self.include_usage {
            self.usage_seen = true;
            return Some(chunk);
        }
        let no_choices = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| c.is_empty());
        if no_choices {
            return None;
        }
        if let Some(object) = chunk.as_object_mut() {
            object.remove("usage");
        }
        Some(chunk)
    }

    /// The usage chunk to add at the end, when asked for and not yet sent.
    pub fn closing_chunk(
        &mut self,
        endpoint: Endpoint,
        model: &str,
        last: Option<&Value>,
        final_result: &FinalResult,
    ) -> Option<Value> {
        if !self.include_usage || self.usage_seen {
            return None;
        }
        self.usage_seen = true;
        let id = last
            .and_then(|c| c.get("id").cloned())
            .unwrap_or_else(|| Value::from(final_result.job_id.clone()));
        let created = last
            .and_then(|c| c.get("created").cloned())
            .unwrap_or_else(|| Value::from(unix_ms() / 1000));
        let object = chunk_object(endpoint);
        let model = last
            .and_then(|c| c.get("model").cloned())
            .unwrap_or_else(|| Value::from(model));
        Some(json!({
            "id": id,
            "object": object,
            "created": created,
            "model": model,
            "choices": [],
            "usage": final_result.usage,
        }))
    }
}

/// The `object` of a streamed chunk of `endpoint` (an embedding is never streamed: its
/// response is a `list`).
fn chunk_object(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completion => "text_completion",
        Endpoint::Embedding => "list",
    }
}

/// A whole response as one streaming chunk, for a final result that carries a response
/// but came without chunks (a model server that does not stream).
pub fn response_as_chunk(endpoint: Endpoint, response: &Value) -> Value {
    let mut chunk = response.clone();
    if let Some(object) = chunk.as_object_mut() {
        object.insert("object".into(), Value::from(chunk_object(endpoint)));
        // Usage goes out in its own chunk, when asked for.
        object.remove("usage");
        if let Some(Value::Array(choices)) = object.get_mut("choices") {
            for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
                if let Some(message) = choice.remove("message") {
                    choice.insert("delta".into(), message);
                }
            }
        }
    }
    chunk
}

/// Which run of a job produced some output: its worker, and its dispatch attempt when the
/// output says (chunks do; final results and older agents do not).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    worker: String,
    attempt: Option<u32>,
}

/// The error to end a stream with when output arrives from a run other than the one that
/// already streamed to the client (another worker, or another attempt on the same
/// worker: a job assigned again after its worker restarted); records the first run.
/// Relaying it would splice two runs' chunks, and the reorder buffer would take the second
/// run's `seq` numbers for the first's.
fn moved_run(
    streaming_from: &mut Option<Run>,
    worker: Option<&str>,
    attempt: Option<u32>,
) -> Option<ApiError> {
    let worker = worker?;
    let first = match streaming_from {
        None => {
            *streaming_from = Some(Run {
                worker: worker.to_string(),
                attempt,
            });
            return None;
        }
        Some(first) => first,
    };
    if first.worker == worker {
        match (first.attempt, attempt) {
            (Some(a), Some(b)) if a != b => {}
            (None, Some(b)) => {
                first.attempt = Some(b);
                return None;
            }
            _ => return None,
        }
    }
    let describe = |w: &str, a: Option<u32>| match a {
        Some(a) => format!("{w} (attempt {a})"),
        None => w.to_string(),
    };
    Some(ApiError::from_result_error(
        &metronome_protocol::ResultError {
            code: metronome_protocol::ErrorCode::WorkerLost,
            message: format!(
                "the run on {} was lost after streaming part of the output; the rest came \
                 from {} and was not relayed, so no output is duplicated",
                describe(&first.worker, first.attempt),
                describe(worker, attempt)
            ),
        },
        0,
    ))
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// The SSE response relaying `submission`, whose first chunk (or final result) is
/// waiting in its replay queue.
///
/// `span` (the request's) stays open, and is the current span while the stream is polled:
/// it ends when the stream ends or the client leaves, not when the headers go out.
pub fn sse_response(
    submission: Submission,
    endpoint: Endpoint,
    model: String,
    include_usage: bool,
    span: tracing::Span,
) -> Response {
    let mut events = Box::pin(events(submission, endpoint, model, include_usage));
    let events = futures::stream::poll_fn(move |cx| {
        let _entered = span.enter();
        events.as_mut().poll_next(cx)
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn events(
    mut submission: Submission,
    endpoint: Endpoint,
    model: String,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    async_stream::stream! {
        let mut order = Reorder::new(submission.reorder_max_bytes());
        let mut usage = UsagePolicy::new(include_usage);
        let mut last: Option<Value> = None;
        // The run whose tokens the client has. Output from any other run (another worker,
        // or another attempt) would be a second run of the job: the client would see its
        // text twice.
        let mut streaming_from: Option<Run> = None;
        loop {
            match submission.next_event().await {
                Ok(JobEvent::Assigned(_)) => {}
                Ok(JobEvent::Chunk(chunk)) => {
                    if let Some(moved) = moved_run(&mut streaming_from, Some(&chunk.worker_id), chunk.attempt) {
                        yield Ok(data(&moved.body()));
                        break;
                    }
                    let ready = match order.push(chunk.seq, chunk.data) {
                        Ok(ready) => ready,
                        Err(too_much) => {
                            // Ends the stream; dropping the submission cancels the job.
                            submission.reorder_overflow();
                            tracing::warn!(job_id = %submission.job_id, waiting_for = too_much.waiting_for, held_bytes = too_much.held_bytes, max_bytes = too_much.max_bytes, "stream ended: out-of-order chunks over reorder_max_bytes");
                            yield Ok(data(&too_much.error().body()));
                            break;
                        }
                    };
                    for ready in ready {
                        if let Some(out) = usage.filter(ready) {
                            yield Ok(data(&out));
                            last = Some(out);
                        }
                    }
                }
                Ok(JobEvent::Final(result)) => {
                    submission.finished();
                    tracing::Span::current().record("output_tokens", result.usage.completion_tokens);
                    if let Some(moved) = moved_run(&mut streaming_from, result.worker_id.as_deref(), None) {
                        yield Ok(data(&moved.body()));
                        break;
                    }
                    let (rest, gaps) = order.finish(result.chunks);
                    if gaps > 0 {
                        submission.stream_gap(gaps);
                    }
                    for ready in rest {
                        if let Some(out) = usage.filter(ready) {
                            yield Ok(data(&out));
                            last = Some(out);
                        }
                    }
                    if let Some(error) = &result.error {
                        let error = ApiError::from_result_error(error, 0);
                        yield Ok(data(&error.body()));
                        break;
                    }
                    if last.is_none() {
                        if let Some(response) = &result.response {
                            let whole = response_as_chunk(endpoint, response);
                            yield Ok(data(&whole));
                            last = Some(whole);
                        }
                    }
                    if let Some(closing) = usage.closing_chunk(endpoint, &model, last.as_ref(), &result) {
                        yield Ok(data(&closing));
                    }
                    yield Ok(Event::default().data("[DONE]"));
                    break;
                }
                Err(error) => {
                    yield Ok(data(&error.body()));
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod moved_run_tests {
    use super::*;

    #[test]
    fn output_from_a_second_worker_ends_the_stream() {
        let mut from = None;
        assert!(moved_run(&mut from, Some("a"), None).is_none());
        assert!(moved_run(&mut from, Some("a"), None).is_none());
        assert!(moved_run(&mut from, None, None).is_none());
        let err = moved_run(&mut from, Some("b"), None).expect("moved");
        assert_eq!(err.code, Some("worker_lost"));
    }

    #[test]
    fn a_second_attempt_on_the_same_worker_ends_the_stream() {
        let mut from = None;
        assert!(moved_run(&mut from, Some("a"), Some(1)).is_none());
        assert!(moved_run(&mut from, Some("a"), Some(1)).is_none());
        assert!(
            moved_run(&mut from, Some("a"), None).is_none(),
            "a final result names no attempt"
        );
        let err = moved_run(&mut from, Some("a"), Some(2)).expect("a second run");
        assert_eq!(err.code, Some("worker_lost"));
        assert!(err.body().to_string().contains("attempt 2"));
    }

    #[test]
    fn the_first_known_attempt_is_kept() {
        let mut from = None;
        assert!(moved_run(&mut from, Some("a"), None).is_none());
        assert!(moved_run(&mut from, Some("a"), Some(3)).is_none());
        assert!(moved_run(&mut from, Some("a"), Some(4)).is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::Usage;

    fn v(n: u64) -> Value {
        json!({ "n": n })
    }

    #[test]
    fn out_of_order_chunks_leave_in_order_once() {
        let mut r = Reorder::new(usize::MAX);
        assert!(r.push(1, v(1)).unwrap().is_empty());
        assert!(r.push(2, v(2)).unwrap().is_empty());
        assert_eq!(r.push(0, v(0)).unwrap(), vec![v(0), v(1), v(2)]);
        assert!(r.push(1, v(1)).unwrap().is_empty(), "duplicate dropped");
        assert_eq!(r.push(3, v(3)).unwrap(), vec![v(3)]);
        assert_eq!(r.finish(4), (vec![], 0));
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn gaps_are_counted_and_buffered_chunks_flushed() {
        let mut r = Reorder::new(usize::MAX);
        r.push(0, v(0)).unwrap();
        r.push(2, v(2)).unwrap();
        r.push(4, v(4)).unwrap();
        assert_eq!(r.finish(6), (vec![v(2), v(4)], 3));
        assert_eq!(r.sent(), 6);
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn chunks_held_ahead_of_a_missing_one_are_bounded_in_bytes() {
        let size = v(1).to_string().len();
        let mut r = Reorder::new(2 * size);
        // In order, nothing is held whatever the size.
        assert_eq!(r.push(0, v(0)).unwrap(), vec![v(0)]);
        assert!(r.push(2, v(2)).unwrap().is_empty());
        assert!(r.push(3, v(3)).unwrap().is_empty());
        assert_eq!(r.held_bytes(), 2 * size);
        // A duplicate of a held chunk costs nothing.
        assert!(r.push(3, v(3)).unwrap().is_empty());
        let err = r.push(4, v(4)).unwrap_err();
        assert_eq!(
            err,
            HeldTooMuch {
                waiting_for: 1,
                held_bytes: 2 * size,
                chunk_bytes: size,
                max_bytes: 2 * size
            }
        );
        assert!(err.error().body()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chunk 1 did not arrive"));
        // The missing one releases what was held.
        assert_eq!(r.push(1, v(1)).unwrap(), vec![v(1), v(2), v(3)]);
        assert_eq!(r.held_bytes(), 0);
        assert!(r.push(5, v(5)).unwrap().is_empty());
    }

    fn final_result() -> FinalResult {
        FinalResult {
            v: 1,
            job_id: "j".into(),
            worker_id: Some("w".into()),
            response: None,
            error: None,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
            },
            chunks: 2,
            ttft_ms: None,
            e2e_ms: None,
        }
    }

    #[test]
    fn usage_is_added_once_when_asked() {
        let mut u = UsagePolicy::new(true);
        let last = json!({"id": "c1", "created": 7, "model": "m", "choices": [{}]});
        let c = u
            .closing_chunk(Endpoint::Chat, "m", Some(&last), &final_result())
            .unwrap();
        assert_eq!(c["id"], "c1");
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["usage"]["total_tokens"], 5);
        assert_eq!(c["choices"], json!([]));
        assert!(u
            .closing_chunk(Endpoint::Chat, "m", None, &final_result())
            .is_none());
    }

    #[test]
    fn the_servers_own_usage_chunk_is_not_duplicated() {
        let mut u = UsagePolicy::new(true);
        let server_usage = json!({"choices": [], "usage": {"total_tokens": 5}});
        assert!(u.filter(server_usage).is_some());
        assert!(u
            .closing_chunk(Endpoint::Completion, "m", None, &final_result())
            .is_none());
    }

    #[test]
    fn a_whole_response_becomes_one_chunk() {
        let r = json!({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"total_tokens": 3}});
        let c = response_as_chunk(Endpoint::Chat, &r);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["delta"]["content"], "hi");
        assert!(c.get("usage").is_none());
    }

    #[test]
    fn usage_is_removed_when_not_asked() {
        let mut u = UsagePolicy::new(false);
        assert!(u
            .filter(json!({"choices": [], "usage": {"total_tokens": 5}}))
            .is_none());
        let c = u
            .filter(json!({"choices": [{"text": "a"}], "usage": {"total_tokens": 1}}))
            .unwrap();
        assert!(c.get("usage").is_none());
        assert!(u
            .filter(json!({"choices": [{"text": "b"}], "usage": null}))
            .is_some());
        assert!(u
            .closing_chunk(Endpoint::Chat, "m", None, &final_result())
            .is_none());
    }
}
