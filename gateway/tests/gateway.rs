//! The gateway against a real nats-server, with the test playing the dispatcher and a
//! worker over the NATS contract.

use crate::support;

use std::time::Duration;

use futures::StreamExt;
use metronome_protocol::names::{cancel_subject, SUBJECT_CANCEL_ALL, SUBJECT_JOBS_SUBMIT_ALL};
use metronome_protocol::{sse, ANONYMOUS_TENANT};
use metronome_testkit::wait_for;
use serde_json::{json, Value};
use support::*;

#[tokio::test]
async fn non_streaming_chat_and_completion_return_the_response_with_both_headers() {
    let h = Harness::start(|_| {}).await;
    for (path, body, text) in [
        (
            "/v1/chat/completions",
            chat_body("hello", false),
            "/choices/0/message/content",
        ),
        (
            "/v1/completions",
            completion_body("hello", false),
            "/choices/0/text",
        ),
    ] {
        let resp = h.post(path, &body).await;
        assert_eq!(resp.status(), 200, "{path}");
        let job_id = resp.headers()["x-metronome-job-id"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(metronome_protocol::names::is_subject_token(&job_id));
        assert_eq!(resp.headers()["x-metronome-worker"], WORKER);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body.pointer(text).unwrap(), "Hello", "{path}: {body}");
        assert_eq!(body["usage"]["total_tokens"], 5);
    }
}

#[tokio::test]
async fn the_job_carries_model_header_msg_id_cost_and_deadline() {
    let h = Harness::start(|c| c.default_max_tokens = 100).await;
    // A second subscriber on jobs.submit sees exactly what the gateway published.
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "abcdefgh"}],
        "temperature": 0.5});
    let resp = h
        .http
        .post(h.url("/v1/chat/completions"))
        .header("x-metronome-deadline-ms", "5000")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let (message, job) = next_job(&mut submitted).await;
    let headers = message.headers.clone().unwrap();
    assert_eq!(headers.get("Nats-Msg-Id").unwrap().as_str(), job_id);
    assert_eq!(headers.get("Metronome-Model").unwrap().as_str(), MODEL);
    assert_eq!(job.id, job_id);
    assert_eq!(job.max_tokens, 100, "the configured default");
    assert_eq!(
        job.prompt_tokens,
        3 + 4 + 2,
        "priming + message + ceil(8 / 4)"
    );
    assert_eq!(job.request["temperature"], 0.5, "the body is forwarded");
    assert_eq!(
        job.request["max_tokens"], 100,
        "the default is written into the body"
    );
    let deadline = job.deadline_ms.unwrap();
    assert!(deadline > job.submitted_ms && deadline <= job.submitted_ms + 5000);
    let prefix = job
        .prefix
        .clone()
        .expect("the gateway attaches a prefix fingerprint");
    assert_eq!(
        prefix.tokens,
        4 + 2,
        "template + ceil(8 / 4), as the simulator counts"
    );
    assert_eq!(
        Some(prefix),
        metronome_protocol::PrefixFingerprint::of_request(job.endpoint, &job.request),
        "computed from the body as forwarded"
    );
    job.validate(&Default::default()).expect("a valid job");
}

/// One trace per request: the job carries the client's `traceparent` when it parses, a new
/// one when the client sent none or a broken one, in its body and its `traceparent` header
/// (trace export is off here, so the gateway hands the trace on unchanged), and the
/// response names its trace id.
#[tokio::test]
async fn the_job_carries_the_clients_trace_or_a_new_one() {
    const CLIENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let h = Harness::start(|_| {}).await;
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    for sent in [Some(CLIENT), None, Some("00-not-a-trace-01")] {
        let mut req = h.http.post(h.url("/v1/chat/completions")).json(&body);
        if let Some(tp) = sent {
            req = req.header("traceparent", tp);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let answered = resp.headers()["x-metronome-trace-id"]
            .to_str()
            .unwrap()
            .to_string();
        let (message, job) = next_job(&mut submitted).await;
        let carried = job.traceparent.clone().expect("every job carries a trace");
        let header = message
            .headers
            .as_ref()
            .and_then(|h| h.get(metronome_protocol::names::HEADER_TRACEPARENT))
            .map(|v| v.as_str().to_string());
        assert_eq!(
            header.as_deref(),
            Some(carried.as_str()),
            "the header names the trace too"
        );
        let trace = metronome_protocol::trace::TraceParent::parse(&carried)
            .unwrap_or_else(|| panic!("{carried:?} is a valid traceparent"));
        assert_eq!(trace.trace_id(), answered, "sent {sent:?}");
        match sent {
            Some(CLIENT) => assert_eq!(carried, CLIENT, "the client's trace is continued"),
            _ => assert_ne!(
                answered, "4bf92f3577b34da6a3ce929d0e0e4736",
                "a new trace for {sent:?}"
            ),
        }
        job.validate(&Default::default()).expect("a valid job");
    }
}

/// CORS: a page of an allowed origin gets its preflight answered and may read the
/// Metronome headers of the response; another origin gets no CORS headers, nor does any
/// origin when none is configured, and the console is never opened to other origins.
#[tokio::test]
async fn cors_opens_the_openai_endpoints_to_the_configured_origins_only() {
    const PAGE: &str = "https://app.example.com";
    let preflight = |h: &Harness, path: &str, origin: &str| {
        h.http
            .request(reqwest::Method::OPTIONS, h.url(path))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type,traceparent",
            )
            .send()
    };
    let allow = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_string())
    };
    let h = Harness::start(|c| c.cors_allowed_origins = vec![PAGE.into()]).await;
    let resp = preflight(&h, "/v1/chat/completions", PAGE).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    assert_eq!(allow(&resp).as_deref(), Some(PAGE));
    let allowed_headers = resp.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(
        allowed_headers.contains("authorization") && allowed_headers.contains("traceparent"),
        "{allowed_headers}"
    );
    let other = preflight(&h, "/v1/chat/completions", "https://evil.example")
        .await
        .unwrap();
    assert_eq!(allow(&other), None);
    let console = preflight(&h, "/console/api/workers", PAGE).await.unwrap();
    assert_eq!(allow(&console), None, "the console is not opened");

    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let resp = h
        .http
        .post(h.url("/v1/chat/completions"))
        .header("origin", PAGE)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(allow(&resp).as_deref(), Some(PAGE));
    let exposed = resp.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in ["x-metronome-job-id", "x-metronome-trace-id", "retry-after"] {
        assert!(exposed.contains(name), "{name} not in {exposed}");
    }

    let closed = Harness::start(|_| {}).await;
    let resp = preflight(&closed, "/v1/chat/completions", PAGE)
        .await
        .unwrap();
    assert_eq!(allow(&resp), None, "no CORS unless configured");
}

#[tokio::test]
async fn streaming_chat_relays_chunks_in_order_then_usage_then_done() {
    let h = Harness::start(|_| {}).await;
    let mut body = chat_body("hello", true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = h.post("/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(resp.headers().contains_key("x-metronome-job-id"));
    assert_eq!(resp.headers()["x-metronome-worker"], WORKER);
    let events = sse::data_payloads(&resp.text().await.unwrap());
    assert_eq!(events.len(), 4, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    let second: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], "Hel");
    assert_eq!(second["choices"][0]["delta"]["content"], "lo");
    let usage: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["total_tokens"], 5);
    assert_eq!(usage["object"], "chat.completion.chunk");
    assert_eq!(events[3], "[DONE]");
}

#[tokio::test]
async fn streaming_completion_without_include_usage_has_no_usage_chunk() {
    let h = Harness::start(|_| {}).await;
    let resp = h
        .post("/v1/completions", &completion_body("hello", true))
        .await;
    assert_eq!(resp.status(), 200);
    let events = sse::data_payloads(&resp.text().await.unwrap());
    let texts: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].clone())
        .collect();
    assert_eq!(texts, [json!("Hel"), json!("lo")]);
    assert_eq!(events.last().unwrap(), "[DONE]");
}

#[tokio::test]
async fn an_error_after_the_stream_started_is_an_sse_error_event() {
    let h = Harness::start(|_| {}).await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("#lost", true))
        .await;
    assert_eq!(resp.status(), 200);
    let events = sse::data_payloads(&resp.text().await.unwrap());
    assert_eq!(events.len(), 2, "{events:?}");
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["code"], "worker_lost");
    assert!(!events.contains(&"[DONE]".to_string()));
    h.assert_serving().await;
}

#[tokio::test]
async fn chunks_held_ahead_of_a_missing_one_are_bounded_and_end_the_stream() {
    // Chunk 1 never comes; 39 chunks of about 1 KiB come after it, more than 8 KiB.
    let h = Harness::start(|c| c.reorder_max_bytes = 8 * 1024).await;
    let mut cancels = h.client.subscribe("cancel.>").await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("#chunk_missing", true))
        .await;
    assert_eq!(resp.status(), 200);
    let job = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let events = sse::data_payloads(&resp.text().await.unwrap());
    assert_eq!(events.len(), 2, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], "Hel");
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["code"], "reorder_overflow", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chunk 1 did not arrive"),
        "{error}"
    );
    // The job the stream gave up on is cancelled, and the overflow counted.
    let cancel = tokio::time::timeout(WAIT, cancels.next())
        .await
        .expect("a cancel")
        .unwrap();
    assert!(cancel.subject.ends_with(&job), "{}", cancel.subject);
    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metronome_protocol::prometheus::sum(&metrics, "metronome_gateway_reorder_overflows_total"),
        1.0,
        "{metrics}"
    );
    h.assert_serving().await;
}

#[tokio::test]
async fn a_second_run_of_the_job_on_the_same_worker_is_not_spliced_into_the_stream() {
    let h = Harness::start(|_| {}).await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("#rerun", true))
        .await;
    assert_eq!(resp.status(), 200);
    let events = sse::data_payloads(&resp.text().await.unwrap());
    // "Hel" of attempt 1, then the error: attempt 2's "now" (seq 1) would otherwise follow
    // attempt 1's seq 0 and make "Helnow".
    assert_eq!(events.len(), 2, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], "Hel");
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["code"], "worker_lost");
    assert!(!events.contains(&"[DONE]".to_string()));
    h.assert_serving().await;
}

#[tokio::test]
async fn models_lists_each_served_model_once() {
    let h = Harness::start(|_| {}).await;
    h.register_worker("node1-gpu1", MODEL).await;
    h.register_worker("node2-gpu0", "qwen2.5-7b").await;
    h.wait_model_listed("qwen2.5-7b").await;
    let body: Value = h
        .http
        .get(h.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["object"], "list");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{body}");
    let llama = data.iter().find(|m| m["id"] == MODEL).unwrap();
    assert_eq!(llama["object"], "model");
    assert_eq!(llama["owned_by"], "metronome");
    assert_eq!(llama["metronome"]["workers"], 2);
    // A worker that leaves the registry takes its model with it.
    h.buckets.workers.delete("node2-gpu0").await.unwrap();
    wait_for("qwen2.5-7b gone", WAIT, || async {
        (!h.listed_models().await.contains(&"qwen2.5-7b".to_string())).then_some(())
    })
    .await;
}

#[tokio::test]
async fn request_errors_are_openai_shaped_and_the_gateway_keeps_serving() {
    let h = Harness::start(|_| {}).await;

    // Malformed JSON: 400.
    let resp = h
        .http
        .post(h.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    let e = assert_openai_error(resp, 400, "invalid_request_error").await;
    assert_eq!(e["code"], "malformed_json");
    h.assert_serving().await;

    // Missing field: 400 naming it.
    let resp = h
        .post("/v1/chat/completions", &json!({"model": MODEL}))
        .await;
    let e = assert_openai_error(resp, 400, "invalid_request_error").await;
    assert_eq!(e["param"], "messages");
    h.assert_serving().await;

    // Unknown model: 404 before anything is published.
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let mut body = chat_body("hello", false);
    body["model"] = json!("no-such-model");
    let resp = h.post("/v1/chat/completions", &body).await;
    let e = assert_openai_error(resp, 404, "invalid_request_error").await;
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["param"], "model");
    h.assert_serving().await;
    // Only the normal request reached jobs.submit.
    let first = submitted.next().await.unwrap();
    let job: metronome_protocol::Job = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(job.model, MODEL);

    // Body over the limit (64 KiB in these tests): 413.
    let big = "x".repeat(100 * 1024);
    let resp = h
        .post("/v1/chat/completions", &chat_body(&big, false))
        .await;
    let e = assert_openai_error(resp, 413, "invalid_request_error").await;
    assert_eq!(e["code"], "payload_too_large");
    h.assert_serving().await;

    // Bad deadline header: 400 naming it.
    let resp = h
        .http
        .post(h.url("/v1/completions"))
        .header("x-metronome-deadline-ms", "soon")
        .json(&completion_body("hi", false))
        .send()
        .await
        .unwrap();
    let e = assert_openai_error(resp, 400, "invalid_request_error").await;
    assert_eq!(e["param"], "x-metronome-deadline-ms");

    // Unknown path: OpenAI-shaped 404 too.
    let resp = h.http.get(h.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unknown_url");
    h.assert_serving().await;
}

#[tokio::test]
async fn dispatcher_and_worker_failures_map_to_their_statuses() {
    let h = Harness::start(|c| c.retry_after_secs = 3).await;
    for (marker, status, kind, code, retry_after) in [
        ("#queue_full", 429, "rate_limit_error", "queue_full", true),
        (
            "#reject_queue_full",
            429,
            "rate_limit_error",
            "queue_full",
            true,
        ),
        ("#deadline", 503, "service_unavailable", "no_capacity", true),
        (
            "#worker_failed",
            502,
            "upstream_error",
            "worker_failed",
            false,
        ),
    ] {
        for stream in [false, true] {
            let resp = h
                .post("/v1/chat/completions", &chat_body(marker, stream))
                .await;
            let retry = resp.headers().get("retry-after").cloned();
            assert_eq!(retry.is_some(), retry_after, "{marker} stream={stream}");
            if retry_after {
                assert_eq!(retry.unwrap(), "3");
            }
            if code == "worker_failed" {
                assert_eq!(resp.headers()["x-metronome-worker"], WORKER);
            }
            let e = assert_openai_error(resp, status, kind).await;
            assert_eq!(e["code"], code, "{marker} stream={stream}");
            h.assert_serving().await;
        }
    }
}

#[tokio::test]
async fn no_result_in_time_is_a_504_and_cancels_the_job() {
    let h = Harness::start(|c| {
        c.queue_timeout_ms = 200;
        c.max_generation_ms = 300;
    })
    .await;
    let mut cancels = h.client.subscribe(SUBJECT_CANCEL_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let resp = h
        .post("/v1/completions", &completion_body("#hold", false))
        .await;
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(resp.headers()["x-metronome-worker"], WORKER);
    let e = assert_openai_error(resp, 504, "timeout").await;
    assert_eq!(e["code"], "job_timeout");
    let cancel = tokio::time::timeout(WAIT, cancels.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        cancel.subject.as_str(),
        cancel_subject(Some(ANONYMOUS_TENANT), &job_id)
    );
    h.assert_serving().await;
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_job() {
    let h = Harness::start(|_| {}).await;
    let mut cancels = h.client.subscribe(SUBJECT_CANCEL_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;

    // Streaming: read the first chunk, then go away.
    let resp = h
        .post("/v1/chat/completions", &chat_body("#hold", true))
        .await;
    assert_eq!(resp.status(), 200);
    let job_id = resp.headers()["x-metronome-job-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("Hel"));
    drop(body);
    let cancel = tokio::time::timeout(WAIT, cancels.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        cancel.subject.as_str(),
        cancel_subject(Some(ANONYMOUS_TENANT), &job_id)
    );
    let payload: Value = serde_json::from_slice(&cancel.payload).unwrap();
    assert_eq!(payload["job_id"], job_id.as_str());

    // Not streaming: the client gives up while the job runs.
    let pending = h
        .http
        .post(h.url("/v1/completions"))
        .json(&completion_body("#hold", false))
        .send();
    assert!(tokio::time::timeout(Duration::from_millis(500), pending)
        .await
        .is_err());
    let cancel = tokio::time::timeout(WAIT, cancels.next())
        .await
        .unwrap()
        .unwrap();
    assert!(cancel
        .subject
        .as_str()
        .starts_with(&format!("cancel.{ANONYMOUS_TENANT}.")));
    assert_ne!(
        cancel.subject.as_str(),
        cancel_subject(Some(ANONYMOUS_TENANT), &job_id)
    );

    // Finished jobs are never cancelled.
    h.assert_serving().await;
    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("metronome_gateway_jobs_cancelled_total 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn nats_down_is_a_503_and_serving_resumes_after_it_returns() {
    let mut h = Harness::start(|c| {
        c.retry_after_secs = 1;
        c.publish_timeout_ms = 1000;
    })
    .await;
    h.assert_serving().await;
    h.nats.stop();
    let resp = h
        .post("/v1/chat/completions", &chat_body("hello", false))
        .await;
    assert_eq!(resp.headers()["retry-after"], "1");
    let e = assert_openai_error(resp, 503, "service_unavailable").await;
    assert_eq!(e["code"], "nats_unavailable");
    let ready = h.http.get(h.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let healthy = h.http.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(healthy.status(), 200);

    h.nats.restart().expect("nats restarts");
    wait_for("a request succeeds after NATS returns", WAIT, || async {
        let resp = h
            .post("/v1/chat/completions", &chat_body("hello", false))
            .await;
        (resp.status() == 200).then_some(())
    })
    .await;
    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains("metronome_gateway_nats_publish_errors_total 0"),
        "{metrics}"
    );
    // The registry follows the workers bucket again after the outage.
    h.register_worker("node3-gpu0", "mistral-7b").await;
    h.wait_model_listed("mistral-7b").await;
}

#[tokio::test]
async fn readyz_needs_a_dispatcher_leader() {
    let h = Harness::start(|_| {}).await;
    let resp = h.http.get(h.url("/readyz")).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["failed"], json!(["leader"]), "{body}");
    assert_eq!(body["checks"]["nats"]["ok"], true);
    assert_eq!(body["checks"]["streams"]["ok"], true);
    h.put_leader().await;
    let resp = h.http.get(h.url("/readyz")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let health = h.http.get(h.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn metrics_count_requests_by_route_and_status() {
    let h = Harness::start(|_| {}).await;
    h.assert_serving().await;
    let mut body = chat_body("hello", false);
    body["model"] = json!("nope");
    h.post("/v1/chat/completions", &body).await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("hello", true))
        .await;
    resp.text().await.unwrap();
    let resp = h.http.get(h.url("/metrics")).send().await.unwrap();
    // OpenMetrics text, as prometheus-client writes it (Prometheus asks for it first).
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text = resp.text().await.unwrap();
    for line in [
        "metronome_gateway_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2",
        "metronome_gateway_http_requests_total{route=\"/v1/chat/completions\",status=\"404\"} 1",
        "metronome_gateway_http_request_duration_seconds_count{route=\"/v1/chat/completions\"} 3",
        "metronome_gateway_http_time_to_first_byte_seconds_count{route=\"/v1/chat/completions\"} 3",
        "metronome_gateway_jobs_submitted_total 2",
    ] {
        assert!(text.contains(line), "missing {line}:\n{text}");
    }
    // The in-flight gauge counts only this request while it is being answered.
    assert!(
        text.contains("metronome_gateway_http_requests_in_flight 1"),
        "{text}"
    );
}

#[test]
fn check_config_prints_the_effective_config_or_every_field_error() {
    let bin = env!("CARGO_BIN_EXE_metronome-gateway");
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "listen = \"127.0.0.1:9999\"\n").unwrap();
    let out = std::process::Command::new(bin)
        .args(["--config", good.to_str().unwrap(), "--check-config"])
        .env("NATS_URL", "nats://127.0.0.1:4999")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("listen = \"127.0.0.1:9999\""), "{text}");
    assert!(
        text.contains("nats_url = \"nats://127.0.0.1:4999\""),
        "{text}"
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "listen = \"nowhere\"\ndefault_max_tokens = 0\n").unwrap();
    let out = std::process::Command::new(bin)
        .args(["--config", bad.to_str().unwrap(), "--check-config"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("listen:") && text.contains("default_max_tokens:"),
        "{text}"
    );
}

/// `METRONOME_NATS_*` and `METRONOME_REDIS_*` reach the gateway: the identity from the
/// environment is the one it connects as, and a TLS file named there is checked at start.
#[test]
fn nats_and_redis_settings_come_from_the_environment() {
    metronome_testkit::assert_nats_and_redis_settings_from_env(
        || {
            let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_metronome-gateway"));
            c.arg("--check-config");
            c
        },
        "gateway-env",
    );
}

#[tokio::test]
async fn a_job_larger_than_nats_accepts_is_a_413() {
    // The body limit is above the test server's 8 MiB max_payload.
    let h = Harness::start(|c| c.body_limit_bytes = 16 * 1024 * 1024).await;
    let big = "x".repeat(9 * 1024 * 1024);
    let resp = h
        .post("/v1/chat/completions", &chat_body(&big, false))
        .await;
    let e = assert_openai_error(resp, 413, "invalid_request_error").await;
    assert_eq!(e["code"], "payload_too_large");
    assert!(e["message"].as_str().unwrap().contains("job queue"), "{e}");
    h.assert_serving().await;
}

/// When JOBS is at its limits (an operator's `max_msgs`/`max_bytes`, or the server's
/// storage), the server refuses the publish and the gateway answers 503 with
/// `Retry-After` from that refusal, not after its publish timeout (set far beyond the
/// test's wait here) or the job's deadline; the jobs already queued stay queued.
#[tokio::test]
async fn a_full_jobs_stream_is_a_503_with_retry_after_and_keeps_the_queued_jobs() {
    let mut h = Harness::start(|c| {
        c.retry_after_secs = 2;
        c.publish_timeout_ms = 600_000;
    })
    .await;
    h.stop_fake();
    let mut stream =
        h.js.get_stream(metronome_protocol::names::STREAM_JOBS)
            .await
            .unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_messages = 2;
    h.js.update_stream(config).await.expect("JOBS limited to 2");

    // Two requests whose jobs wait in JOBS (nothing consumes it).
    let _waiting: Vec<_> = (0..2)
        .map(|_| {
            let request = h
                .authorized(h.http.post(h.url("/v1/chat/completions")))
                .json(&chat_body("hello", true))
                .send();
            tokio::spawn(request)
        })
        .collect();
    wait_for("two jobs queued in JOBS", WAIT, || {
        let mut stream = stream.clone();
        async move {
            let state = stream.info().await.ok()?.state.clone();
            (state.messages == 2).then_some(())
        }
    })
    .await;
    let before = stream.info().await.unwrap().state.clone();

    let resp = tokio::time::timeout(
        WAIT,
        h.post("/v1/chat/completions", &chat_body("one too many", false)),
    )
    .await
    .expect("the gateway answers from the server's refusal, not its publish timeout");
    assert_eq!(resp.headers()["retry-after"], "2");
    let e = assert_openai_error(resp, 503, "service_unavailable").await;
    assert_eq!(e["code"], "jobs_stream_full", "{e}");

    let after = stream.info().await.unwrap().state.clone();
    assert_eq!(
        (after.messages, after.first_sequence, after.last_sequence),
        (before.messages, before.first_sequence, before.last_sequence),
        "the queued jobs are kept, nothing was added"
    );
}

/// The value of a counter row of the gateway's `/metrics` whose line starts with `row`.
async fn counter(h: &Harness, row: &str) -> Option<f64> {
    let text = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(row))
        .and_then(|v| v.trim().parse().ok())
}

/// The text the client received: the message of a response, or the deltas of a stream
/// (which must end with `[DONE]`).
async fn answer_text(resp: reqwest::Response, stream: bool, what: &str) -> String {
    assert_eq!(resp.status(), 200, "{what}");
    assert_eq!(resp.headers()["x-metronome-worker"], WORKER, "{what}");
    let body = resp.text().await.unwrap();
    assert!(
        !body.contains(FORGED),
        "{what}: forged output relayed: {body}"
    );
    if !stream {
        let v: Value = serde_json::from_str(&body).unwrap();
        return v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
    }
    let events = sse::data_payloads(&body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{what}: {events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// Issue 10: results published under the id of a worker the job was not assigned to are
/// never relayed, streaming or not, whether they come before or after the decision, or
/// name the assigned worker in their body; the assigned worker's results come through, and
/// the ignored ones are counted.
#[tokio::test]
async fn results_from_a_worker_that_does_not_hold_the_job_are_not_relayed() {
    let h = Harness::start(|_| {}).await;
    for marker in ["#forged", "#forged_early", "#forged_body"] {
        for stream in [false, true] {
            let what = format!("{marker} stream={stream}");
            let resp = h
                .post("/v1/chat/completions", &chat_body(marker, stream))
                .await;
            assert_eq!(answer_text(resp, stream, &what).await, "Hello", "{what}");
        }
    }
    // A forged chunk and final result per request: held, then dropped at its end
    // (`not_assigned`), or dropped at once for a body naming another worker.
    let row = |reason: &str| {
        format!("metronome_gateway_unattributed_results_total{{reason=\"{reason}\"}}")
    };
    wait_for("the ignored results counted", WAIT, || async {
        let held = counter(&h, &row("not_assigned")).await;
        let mismatched = counter(&h, &row("body_mismatch")).await;
        (held == Some(8.0) && mismatched == Some(4.0)).then_some(())
    })
    .await;
    h.assert_serving().await;
}

/// The assigned worker may stream before its decision reaches the gateway (the dispatcher
/// publishes the Assignment first): its results wait for the decision and are then relayed
/// in order, the final result too.
#[tokio::test]
async fn the_assigned_workers_results_that_precede_its_decision_are_relayed() {
    let h = Harness::start(|_| {}).await;
    for marker in ["#early", "#early_final"] {
        for stream in [false, true] {
            let what = format!("{marker} stream={stream}");
            let resp = h
                .post("/v1/chat/completions", &chat_body(marker, stream))
                .await;
            assert_eq!(answer_text(resp, stream, &what).await, "Hello", "{what}");
        }
    }
}

/// Beyond `max_in_flight` a request is answered 429 at once, before its body is read, and
/// a request that ends gives its place back: a flood costs the gateway a bounded number
/// of requests, not one per request sent.
#[tokio::test]
async fn beyond_max_in_flight_a_request_is_answered_429_at_once() {
    let mut h = Harness::start(|c| c.max_in_flight = 2).await;
    // Nothing answers: the jobs wait, and their requests stay in flight.
    h.stop_fake();
    let mut submitted = h.client.subscribe(SUBJECT_JOBS_SUBMIT_ALL).await.unwrap();
    sync_subscriptions(&h.client).await;
    let hold = |h: &Harness| {
        let request = h
            .http
            .post(h.url("/v1/chat/completions"))
            .json(&chat_body("held", false));
        tokio::spawn(async move { request.send().await })
    };
    let first = hold(&h);
    let _second = hold(&h);
    next_job(&mut submitted).await;
    next_job(&mut submitted).await;
    let refused = h
        .http
        .post(h.url("/v1/chat/completions"))
        .json(&chat_body("one too many", false))
        .timeout(std::time::Duration::from_secs(5))
        .send()
        .await
        .expect("answered at once");
    assert!(refused.headers().contains_key("retry-after"));
    let error = assert_openai_error(refused, 429, "rate_limit_error").await;
    assert_eq!(error["code"], "in_flight", "{error}");
    // A client that leaves gives its place back.
    first.abort();
    let _ = first.await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let third = hold(&h);
        let got =
            tokio::time::timeout(std::time::Duration::from_millis(500), submitted.next()).await;
        if got.is_ok() {
            break;
        }
        third.abort();
        assert!(
            tokio::time::Instant::now() < deadline,
            "the place never came back"
        );
    }
    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("metronome_gateway_shed_total{reason=\"in_flight\"}"),
        "{metrics}"
    );
}
