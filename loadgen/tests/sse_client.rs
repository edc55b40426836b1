//! The streaming client and the runner against a tiny in-test OpenAI-style server that
//! streams a known number of chunks, fails on request, hangs, or sends garbage — chosen by
//! the model name of the request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use metronome_loadgen::{
    run_load, run_plan, write_outputs, Endpoint, ErrorKind, LengthDist, LoadSpec, PlannedRequest,
    Workload,
};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Default)]
struct Seen {
    bodies: Arc<Mutex<Vec<Value>>>,
    requests: Arc<AtomicUsize>,
}

async fn handler(
    State(seen): State<Seen>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let n = seen.requests.fetch_add(1, Ordering::SeqCst);
    seen.bodies.lock().unwrap().push(body.clone());
    let model = body["model"].as_str().unwrap_or("").to_string();
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(1);
    let chat = body.get("messages").is_some();
    if headers
        .get("authorization")
        .is_some_and(|v| v != "Bearer secret")
    {
        return (StatusCode::UNAUTHORIZED, "wrong key").into_response();
    }
    let status = match model.as_str() {
        "fail-503" => Some(StatusCode::SERVICE_UNAVAILABLE),
        "fail-400" => Some(StatusCode::BAD_REQUEST),
        _ => None,
    };
    if let Some(status) = status {
        let err =
            json!({"error": {"message": format!("simulated {}", status.as_u16()), "type": "test"}});
        return (status, Json(err)).into_response();
    }
    let mut h = HeaderMap::new();
    h.insert(
        "x-metronome-job-id",
        HeaderValue::from_str(&format!("job-{n}")).unwrap(),
    );
    h.insert("x-metronome-worker", HeaderValue::from_static("test-gpu0"));
    let stream = async_stream::stream! {
        match model.as_str() {
            "hang" => {
                futures::future::pending::<()>().await;
            }
            "garbage" => {
                yield Ok::<Event, Infallible>(Event::default().data("{not json"));
            }
            "stream-error" => {
                yield Ok(Event::default().data(r#"{"choices":[{"delta":{"content":"a"}}]}"#));
                yield Ok(Event::default().data(r#"{"error":{"message":"engine died"}}"#));
            }
            _ => {
                if chat {
                    yield Ok(Event::default().data(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#));
                }
                for _ in 0..max_tokens {
                    // Server-side pacing so decode time is non-zero (not test synchronisation).
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let chunk = if chat {
                        json!({"choices": [{"delta": {"content": " tok"}}]})
                    } else {
                        json!({"choices": [{"text": " tok"}]})
                    };
                    yield Ok(Event::default().data(chunk.to_string()));
                }
                if model != "no-usage" {
                    let usage = json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": max_tokens}});
                    yield Ok(Event::default().data(usage.to_string()));
                }
                yield Ok(Event::default().data("[DONE]"));
            }
        }
    };
    (h, Sse::new(stream)).into_response()
}

async fn start_server() -> (SocketAddr, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(handler))
        .route("/v1/completions", post(handler))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, seen)
}

fn spec(addr: SocketAddr, model: &str, n: usize, output: u32) -> LoadSpec {
    LoadSpec {
        base_url: format!("http://{addr}/v1"),
        model: model.into(),
        limit: Some(n),
        workload: Workload::Poisson {
            rate_rps: 200.0,
            prompt_tokens: LengthDist::Fixed(12),
            output_tokens: LengthDist::Fixed(output),
        },
        ..LoadSpec::default()
    }
}

#[tokio::test]
async fn chat_stream_measures_known_token_counts() {
    let (addr, seen) = start_server().await;
    let result = run_load(spec(addr, "m", 6, 9), false).await.unwrap();
    assert_eq!(result.records.len(), 6);
    for r in &result.records {
        assert!(r.ok, "{r:?}");
        assert_eq!(r.status, Some(200));
        assert_eq!(r.output_tokens, 9);
        assert_eq!(r.chunks, 9);
        assert!(r.usage_reported);
        let (ttft, e2e) = (r.ttft_ms.unwrap(), r.e2e_ms.unwrap());
        assert!(ttft <= e2e, "ttft {ttft} > e2e {e2e}");
        assert!(r.tokens_per_s.unwrap() > 0.0);
        assert!(r.tpot_ms.unwrap() > 0.0);
        assert!(r.job_id.as_deref().unwrap().starts_with("job-"));
        assert_eq!(r.worker.as_deref(), Some("test-gpu0"));
        assert!(r.sent_s >= r.scheduled_s);
    }
    let s = &result.summary;
    assert_eq!((s.count, s.ok, s.errors), (6, 6, 0));
    assert_eq!(s.ttft_ms.n, 6);

    // What the server was sent.
    let bodies = seen.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 6);
    for b in &bodies {
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(b["max_tokens"], json!(9));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b["metronome_prompt_tokens"], json!(12));
        let text = b["messages"][0]["content"].as_str().unwrap();
        assert_eq!(text.split(' ').count(), 12);
    }
    // Unique prompts: no two share their first words.
    let mut starts: Vec<String> = bodies
        .iter()
        .map(|b| b["messages"][0]["content"].as_str().unwrap().to_string())
        .collect();
    starts.sort();
    starts.dedup();
    assert_eq!(starts.len(), 6);
}

#[tokio::test]
async fn completions_without_usage_counts_chunks_and_sends_the_key() {
    let (addr, seen) = start_server().await;
    let mut s = spec(addr, "no-usage", 3, 5);
    s.endpoint = Endpoint::Completions;
    s.api_key = Some("secret".into());
    s.extensions = false;
    let result = run_load(s, false).await.unwrap();
    for r in &result.records {
        assert!(r.ok, "{r:?}");
        assert_eq!(r.output_tokens, 5);
        assert!(!r.usage_reported);
        assert!(r.ttft_ms.unwrap() <= r.e2e_ms.unwrap());
    }
    let bodies = seen.bodies.lock().unwrap().clone();
    assert!(bodies
        .iter()
        .all(|b| b["prompt"].is_string() && b.get("ignore_eos").is_none()));
}

#[tokio::test]
async fn http_errors_are_recorded_with_their_status() {
    let (addr, _) = start_server().await;
    for (model, status) in [("fail-503", 503), ("fail-400", 400)] {
        let result = run_load(spec(addr, model, 3, 4), false).await.unwrap();
        for r in &result.records {
            assert!(!r.ok);
            assert_eq!(r.status, Some(status));
            assert_eq!(r.error_kind, Some(ErrorKind::Http));
            assert!(
                r.error
                    .as_deref()
                    .unwrap()
                    .contains(&format!("simulated {status}")),
                "{r:?}"
            );
        }
        let s = &result.summary;
        assert_eq!((s.count, s.ok, s.errors, s.good), (3, 0, 3, 0));
        assert_eq!(s.errors_by_status.get(&status.to_string()), Some(&3));
    }
}

#[tokio::test]
async fn connection_refused_is_an_error_not_a_crash() {
    let port = metronome_testkit::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let result = run_load(spec(addr, "m", 3, 4), false).await.unwrap();
    assert_eq!(result.records.len(), 3);
    for r in &result.records {
        assert!(!r.ok);
        assert_eq!(r.status, None);
        assert_eq!(r.error_kind, Some(ErrorKind::Connect), "{r:?}");
    }
    assert_eq!(result.summary.errors_by_kind.get("connect"), Some(&3));
}

#[tokio::test]
async fn malformed_and_error_streams_are_stream_errors() {
    let (addr, _) = start_server().await;
    let result = run_load(spec(addr, "garbage", 2, 4), false).await.unwrap();
    for r in &result.records {
        assert_eq!(r.error_kind, Some(ErrorKind::Stream));
        assert!(r.error.as_deref().unwrap().contains("malformed"), "{r:?}");
    }
    let result = run_load(spec(addr, "stream-error", 2, 4), false)
        .await
        .unwrap();
    for r in &result.records {
        assert_eq!(r.error_kind, Some(ErrorKind::Stream));
        assert!(r.error.as_deref().unwrap().contains("engine died"), "{r:?}");
        assert!(r.ttft_ms.is_some());
    }
}

fn burst(n: u64) -> Vec<PlannedRequest> {
    (0..n)
        .map(|id| PlannedRequest {
            id,
            at_s: 0.0,
            prompt_tokens: 4,
            output_tokens: 4,
            tenant: None,
            messages: Vec::new(),
        })
        .collect()
}

#[tokio::test]
async fn max_in_flight_drops_and_drain_cutoff_are_counted() {
    let (addr, _) = start_server().await;
    let mut s = spec(addr, "hang", 5, 4);
    s.max_in_flight = 2;
    s.drain_timeout_s = 0.2;
    let result = run_plan(s, burst(5), false, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(result.records.len(), 5);
    let kinds: Vec<Option<ErrorKind>> = result.records.iter().map(|r| r.error_kind).collect();
    assert_eq!(
        kinds,
        vec![
            Some(ErrorKind::Timeout),
            Some(ErrorKind::Timeout),
            Some(ErrorKind::Dropped),
            Some(ErrorKind::Dropped),
            Some(ErrorKind::Dropped)
        ]
    );
    assert_eq!(result.summary.errors, 5);
    assert_eq!(result.summary.errors_by_kind.get("dropped"), Some(&3));
}

#[tokio::test]
async fn request_timeout_is_recorded() {
    let (addr, _) = start_server().await;
    let mut s = spec(addr, "hang", 1, 4);
    s.request_timeout_s = 0.2;
    let result = run_load(s, false).await.unwrap();
    assert_eq!(result.records[0].error_kind, Some(ErrorKind::Timeout));
    assert!(result.records[0]
        .error
        .as_deref()
        .unwrap()
        .contains("timed out"));
}

#[tokio::test]
async fn cancel_returns_a_partial_result_with_every_request_accounted_for() {
    let (addr, seen) = start_server().await;
    let s = spec(addr, "hang", 5, 4);
    let mut plan = burst(3);
    plan.extend((3..5).map(|id| PlannedRequest {
        id,
        at_s: 3600.0,
        prompt_tokens: 4,
        output_tokens: 4,
        tenant: None,
        messages: Vec::new(),
    }));
    let cancel = CancellationToken::new();
    let run = tokio::spawn(run_plan(s, plan, false, cancel.clone()));
    metronome_testkit::wait_for("3 requests at the server", Duration::from_secs(10), || {
        let n = seen.requests.load(Ordering::SeqCst);
        async move { (n >= 3).then_some(()) }
    })
    .await;
    cancel.cancel();
    let result = run.await.unwrap().unwrap();
    assert!(result.cancelled);
    assert_eq!(result.records.len(), 5);
    assert!(result
        .records
        .iter()
        .all(|r| r.error_kind == Some(ErrorKind::Cancelled)));
}

#[tokio::test]
async fn trace_replay_sends_the_trace_lengths() {
    let (addr, seen) = start_server().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    std::fs::write(
        &path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.00,30,3\n2023-11-16 18:17:04.00,20,2\n2023-11-16 18:17:05.00,10,1\n",
    )
    .unwrap();
    let s = LoadSpec {
        base_url: format!("http://{addr}/v1"),
        model: "m".into(),
        workload: Workload::Trace {
            path,
            time_scale: Some(0.01),
            rate_rps: None,
            start_offset_s: 0.0,
        },
        ..LoadSpec::default()
    };
    let result = run_load(s, false).await.unwrap();
    let got: Vec<(u32, u32, u32)> = result
        .records
        .iter()
        .map(|r| (r.prompt_tokens, r.max_tokens, r.output_tokens))
        .collect();
    assert_eq!(got, vec![(30, 3, 3), (20, 2, 2), (10, 1, 1)]);
    let mut prompt_fields: Vec<u64> = seen
        .bodies
        .lock()
        .unwrap()
        .iter()
        .map(|b| b["metronome_prompt_tokens"].as_u64().unwrap())
        .collect();
    prompt_fields.sort();
    assert_eq!(prompt_fields, vec![10, 20, 30]);
}

#[tokio::test]
async fn outputs_are_written_and_plots_are_non_empty_svg() {
    let (addr, _) = start_server().await;
    let dir = tempfile::tempdir().unwrap();
    let result = run_load(spec(addr, "m", 4, 3), false).await.unwrap();
    let files = write_outputs(&dir.path().join("run"), &result).unwrap();
    let csv = std::fs::read_to_string(&files.requests_csv).unwrap();
    assert_eq!(csv.lines().count(), 5);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(&files.summary_json).unwrap()).unwrap();
    assert_eq!(summary["count"], json!(4));
    assert_eq!(summary["spec"]["model"], json!("m"));
    assert!(summary["ttft_ms"]["p99_9"].is_number());
    assert!(summary["tokens_per_s"]["cv"].is_number());
    assert!(summary["goodput_rps"].is_number());
    assert_eq!(files.plots.len(), 3);
    for p in &files.plots {
        let svg = std::fs::read_to_string(p).unwrap();
        assert!(svg.len() > 500 && svg.contains("<svg"), "{}", p.display());
    }

    // An all-failed run still writes valid, non-empty plots.
    let port = metronome_testkit::free_port();
    let refused: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let failed = run_load(spec(refused, "m", 2, 3), false).await.unwrap();
    let files = write_outputs(&dir.path().join("failed"), &failed).unwrap();
    for p in &files.plots {
        assert!(std::fs::metadata(p).unwrap().len() > 0);
    }
}
