//! The simulated GPU over HTTP, in-process on 127.0.0.1:0: OpenAI shapes, exact token
//! counts, vLLM metrics, batching under load, speed, preemption and disconnects. Small step
//! times keep every test to a few seconds; assertions use the simulator's own counters and
//! simulated clock, never wall-clock thresholds.

use std::time::Duration;

use futures::StreamExt;
use metronome_gpu_sim::{spawn_all, SimConfig, SimGpu, SimGpuConfig};
use metronome_protocol::{prometheus, sse};
use metronome_testkit::wait_for;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "llama-3.1-8b";
const WAIT: Duration = Duration::from_secs(20);

/// A GPU with 1 ms steps and no prefill cost: fast but still paced.
fn fast(model: &str) -> SimGpuConfig {
    SimGpuConfig {
        base_step_ms: 1.0,
        prefill_ms_per_token: 0.0,
        kv_read_ms_per_token: 0.0,
        ..SimGpuConfig::new(model)
    }
}

struct Harness {
    gpu: SimGpu,
    http: reqwest::Client,
    shutdown: CancellationToken,
}

impl Harness {
    async fn start(config: SimGpuConfig) -> Harness {
        let shutdown = CancellationToken::new();
        let gpu = SimGpu::spawn(config, shutdown.clone())
            .await
            .expect("spawn simulated GPU");
        Harness {
            gpu,
            http: reqwest::Client::new(),
            shutdown,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gpu.base_url())
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        (status, response.json().await.expect("JSON body"))
    }

    /// A streamed request's SSE `data:` payloads, in order.
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let response = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 200);
        assert!(response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        sse::data_payloads(&response.text().await.expect("stream body"))
    }

    async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics().await;
        prometheus::value(&text, name, &[("model_name", &self.gpu.config().model)])
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

#[tokio::test]
async fn chat_returns_exactly_max_tokens() {
    let h = Harness::start(fast(MODEL)).await;
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 17}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["model"], MODEL);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(words(choice["message"]["content"].as_str().unwrap()), 17);
    assert_eq!(body["usage"]["completion_tokens"], 17);
    // ceil(13 chars / 4) + 4 for the one message's template
    assert_eq!(body["usage"]["prompt_tokens"], 8);
    assert_eq!(body["usage"]["total_tokens"], 25);
}

#[tokio::test]
async fn completion_honours_exact_prompt_tokens() {
    let h = Harness::start(fast(MODEL)).await;
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 9, "metronome_prompt_tokens": 321}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(words(body["choices"][0]["text"].as_str().unwrap()), 9);
    assert_eq!(body["usage"]["prompt_tokens"], 321);
    assert_eq!(body["usage"]["completion_tokens"], 9);

    let (_, body) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}),
        )
        .await;
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(h.metric("vllm:prompt_tokens_total").await, 324.0);
    assert_eq!(h.metric("vllm:generation_tokens_total").await, 11.0);
}

#[tokio::test]
async fn chat_stream_has_one_chunk_per_token_and_usage() {
    let h = Harness::start(fast(MODEL)).await;
    let data = h
        .stream(
            "/v1/chat/completions",
            json!({
                "model": MODEL, "stream": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            }),
        )
        .await;
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    // 12 token chunks, a finish chunk, a usage chunk.
    assert_eq!(chunks.len(), 14);
    let id = chunks[0]["id"].as_str().unwrap();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[..12]
        .iter()
        .map(|c| {
            assert!(c["choices"][0]["finish_reason"].is_null());
            assert!(c["usage"].is_null());
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(words(&text), 12);
    assert_eq!(chunks[12]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[13]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(chunks[13]["usage"]["completion_tokens"], 12);
    assert_eq!(chunks[13]["usage"]["prompt_tokens"], 5);
}

#[tokio::test]
async fn completion_stream_without_usage() {
    let h = Harness::start(fast(MODEL)).await;
    let data = h
        .stream(
            "/v1/completions",
            json!({"model": MODEL, "stream": true, "prompt": "x", "max_tokens": 5}),
        )
        .await;
    assert_eq!(data.len(), 7, "5 tokens, finish, [DONE]: {data:?}");
    assert_eq!(data[6], "[DONE]");
    for d in &data[..6] {
        let c: Value = serde_json::from_str(d).unwrap();
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none());
    }
    let last: Value = serde_json::from_str(&data[5]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn same_seed_and_prompt_give_the_same_text() {
    let a = Harness::start(SimGpuConfig {
        seed: 1,
        ..fast(MODEL)
    })
    .await;
    let b = Harness::start(SimGpuConfig {
        seed: 1,
        ..fast(MODEL)
    })
    .await;
    let c = Harness::start(SimGpuConfig {
        seed: 2,
        ..fast(MODEL)
    })
    .await;
    let request = json!({"model": MODEL, "prompt": "the same prompt", "max_tokens": 30});
    let text = |v: Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let ta = text(a.post("/v1/completions", request.clone()).await.1);
    let tb = text(b.post("/v1/completions", request.clone()).await.1);
    let tc = text(c.post("/v1/completions", request).await.1);
    assert_eq!(ta, tb);
    assert_ne!(ta, tc);
}

#[tokio::test]
async fn errors_use_openai_shape() {
    let h = Harness::start(SimGpuConfig {
        max_model_len: 100,
        ..fast(MODEL)
    })
    .await;
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "other", "messages": [], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(body["error"]["message"].as_str().unwrap().contains("other"));

    let response = h
        .http
        .post(h.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");

    let (status, _) = h
        .post("/v1/chat/completions", json!({"model": MODEL}))
        .await;
    assert_eq!(status, 400, "messages missing");
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100}),
        )
        .await;
    assert_eq!(status, 400, "longer than max_model_len: {body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    let (status, _) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 0}),
        )
        .await;
    assert_eq!(status, 400);

    let health = h.http.get(h.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let models: Value = h
        .http
        .get(h.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
}

#[tokio::test]
async fn metrics_expose_vllm_names_and_follow_the_load() {
    // Two sequences at a time, the rest wait; 20 ms steps keep each request busy ~1 s.
    let h = Harness::start(SimGpuConfig {
        base_step_ms: 20.0,
        max_num_seqs: 2,
        ..fast(MODEL)
    })
    .await;
    let text = h.metrics().await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
    ] {
        assert!(
            prometheus::value(&text, name, &[("model_name", MODEL)]).is_some(),
            "{name} missing:\n{text}"
        );
    }
    assert_eq!(
        prometheus::value(
            &text,
            "vllm:cache_config_info",
            &[("num_gpu_blocks", "2500"), ("block_size", "16")]
        ),
        Some(1.0)
    );
    assert_eq!(h.metric("vllm:num_requests_running").await, 0.0);

    let requests: Vec<_> = (0..4)
        .map(|_| {
            let http = h.http.clone();
            let url = h.url("/v1/completions");
            tokio::spawn(async move {
                let body = json!({"model": MODEL, "prompt": "load", "max_tokens": 50});
                http.post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            })
        })
        .collect();
    wait_for("2 running and 2 waiting", WAIT, || async {
        let text = h.metrics().await;
        let m = [("model_name", MODEL)];
        let running = prometheus::value(&text, "vllm:num_requests_running", &m)?;
        let waiting = prometheus::value(&text, "vllm:num_requests_waiting", &m)?;
        let kv = prometheus::value(&text, "vllm:kv_cache_usage_perc", &m)?;
        (running == 2.0 && waiting == 2.0 && kv > 0.0).then_some(())
    })
    .await;
    for r in requests {
        assert_eq!(r.await.unwrap()["usage"]["completion_tokens"], 50);
    }
    assert_eq!(h.metric("vllm:num_requests_running").await, 0.0);
    assert_eq!(h.metric("vllm:num_requests_waiting").await, 0.0);
    assert_eq!(h.metric("vllm:kv_cache_usage_perc").await, 0.0);
    assert_eq!(h.metric("vllm:generation_tokens_total").await, 200.0);
    assert_eq!(
        h.metric("vllm:time_to_first_token_seconds_count").await,
        4.0
    );
    let text = h.metrics().await;
    assert_eq!(
        prometheus::value(
            &text,
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        Some(4.0)
    );
}

#[tokio::test]
async fn half_speed_gpu_is_twice_as_slow_in_simulated_time() {
    let shutdown = CancellationToken::new();
    let config = SimConfig {
        seed: None,
        host: None,
        gpu: vec![
            SimGpuConfig {
                speed: 1.0,
                prefill_ms_per_token: 0.01,
                ..fast(MODEL)
            },
            SimGpuConfig {
                speed: 0.5,
                prefill_ms_per_token: 0.01,
                ..fast(MODEL)
            },
        ],
    };
    let gpus = spawn_all(&config, shutdown.clone()).await.unwrap();
    assert!(gpus.iter().all(|g| g.addr().port() != 0));
    assert_ne!(gpus[0].addr(), gpus[1].addr());
    let http = reqwest::Client::new();
    let mut busy = Vec::new();
    for gpu in &gpus {
        let body = json!({"model": MODEL, "prompt": "p", "max_tokens": 100, "metronome_prompt_tokens": 200});
        let response: Value = http
            .post(format!("{}/v1/completions", gpu.base_url()))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(response["usage"]["completion_tokens"], 100);
        let text = http
            .get(format!("{}/metrics", gpu.base_url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        busy.push(prometheus::value(&text, "metronome_sim_busy_seconds_total", &[]).unwrap());
        assert_eq!(
            gpu.stats().steps_total,
            100,
            "one prefill step, then 99 decodes"
        );
    }
    // 1 step of 1 ms + 200 * 0.01 ms, 99 steps of 1 ms: 0.102 s at full speed.
    assert!((busy[0] - 0.102).abs() < 1e-9, "{busy:?}");
    assert!((busy[1] / busy[0] - 2.0).abs() < 1e-9, "{busy:?}");
    shutdown.cancel();
    for gpu in gpus {
        gpu.join().await;
    }
}

#[tokio::test]
async fn kv_exhaustion_preempts_and_every_request_still_completes() {
    // 16 blocks = 256 tokens; each request peaks at 32 + 150 - 1 tokens, so any two that
    // overlap exhaust the cache.
    let h = Harness::start(SimGpuConfig {
        base_step_ms: 2.0,
        kv_capacity_tokens: 256,
        max_model_len: 256,
        ..fast(MODEL)
    })
    .await;
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let http = h.http.clone();
            let url = h.url("/v1/chat/completions");
            tokio::spawn(async move {
                let body = json!({
                    "model": MODEL, "max_tokens": 150, "metronome_prompt_tokens": 32,
                    "messages": [{"role": "user", "content": format!("request {i}")}],
                });
                http.post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            })
        })
        .collect();
    for r in requests {
        let body = r.await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 150, "{body}");
        assert_eq!(
            words(body["choices"][0]["message"]["content"].as_str().unwrap()),
            150
        );
    }
    assert!(h.metric("vllm:num_preemptions_total").await > 0.0);
    assert!(h.metric("metronome_sim_recomputed_tokens_total").await > 0.0);
    assert_eq!(h.metric("vllm:kv_cache_usage_perc").await, 0.0);
    assert_eq!(h.metric("vllm:generation_tokens_total").await, 900.0);
}

#[tokio::test]
async fn client_disconnect_aborts_the_sequence_and_frees_kv() {
    let h = Harness::start(SimGpuConfig {
        base_step_ms: 5.0,
        ..fast(MODEL)
    })
    .await;
    let body = json!({
        "model": MODEL, "stream": true, "max_tokens": 5000, "metronome_prompt_tokens": 1000,
        "messages": [{"role": "user", "content": "a long one"}],
    });
    let response = h
        .http
        .post(h.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    let first = stream.next().await.expect("a first chunk").unwrap();
    assert!(String::from_utf8_lossy(&first).contains("chat.completion.chunk"));
    assert_eq!(h.metric("vllm:num_requests_running").await, 1.0);
    assert!(h.metric("vllm:kv_cache_usage_perc").await > 0.0);
    drop(stream);
    wait_for("the aborted sequence to free its KV", WAIT, || async {
        let text = h.metrics().await;
        let m = [("model_name", MODEL)];
        let running = prometheus::value(&text, "vllm:num_requests_running", &m)?;
        let kv = prometheus::value(&text, "vllm:kv_cache_usage_perc", &m)?;
        (running == 0.0 && kv == 0.0).then_some(())
    })
    .await;
    let text = h.metrics().await;
    assert_eq!(
        prometheus::value(
            &text,
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        Some(1.0)
    );
    assert!(h.gpu.stats().generation_tokens_total < 5000);

    // A non-streaming client that goes away is noticed too: the server drops its handler.
    let http = h.http.clone();
    let url = h.url("/v1/completions");
    let pending = tokio::spawn(async move {
        let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 5000});
        http.post(url).json(&body).send().await
    });
    wait_for("the non-streaming request to run", WAIT, || async {
        (h.metric("vllm:num_requests_running").await == 1.0).then_some(())
    })
    .await;
    pending.abort();
    wait_for("the second abort", WAIT, || async {
        let text = h.metrics().await;
        let aborted = prometheus::value(
            &text,
            "vllm:request_success_total",
            &[("finished_reason", "abort")],
        )?;
        let kv = prometheus::value(&text, "vllm:kv_cache_usage_perc", &[("model_name", MODEL)])?;
        (aborted == 2.0 && kv == 0.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn zero_delay_mode_serves_many_requests_without_simulated_time() {
    let h = Harness::start(SimGpuConfig::zero_delay(MODEL)).await;
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let http = h.http.clone();
            let url = h.url("/v1/completions");
            tokio::spawn(async move {
                let body =
                    json!({"model": MODEL, "prompt": "fast", "max_tokens": 100, "stream": true});
                let text = http
                    .post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap();
                sse::data_payloads(&text)
            })
        })
        .collect();
    for r in requests {
        let data = r.await.unwrap();
        assert_eq!(data.len(), 102, "100 tokens, finish, [DONE]");
    }
    assert_eq!(h.metric("metronome_sim_busy_seconds_total").await, 0.0);
    assert_eq!(h.metric("vllm:generation_tokens_total").await, 2000.0);
}

#[tokio::test]
async fn early_stop_is_opt_in_and_ignore_eos_overrides_it() {
    let h = Harness::start(SimGpuConfig {
        eos_probability: 0.2,
        ..fast(MODEL)
    })
    .await;
    let mut stopped = 0;
    for i in 0..10 {
        let (_, body) = h
            .post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": format!("p{i}"), "max_tokens": 60}),
            )
            .await;
        let n = body["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(
            words(body["choices"][0]["text"].as_str().unwrap()) as u64,
            n
        );
        if body["choices"][0]["finish_reason"] == "stop" {
            assert!(n < 60);
            stopped += 1;
        }
        let (_, exact) = h
            .post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": format!("p{i}"), "max_tokens": 60, "ignore_eos": true}),
            )
            .await;
        assert_eq!(exact["usage"]["completion_tokens"], 60);
    }
    // P(no stop within 60 tokens) = 0.8^59 per request: all ten running to length is
    // practically impossible, and the seed makes it deterministic anyway.
    assert!(stopped > 0);
}

/// The streamed chunks' `choices[0]` objects, without the closing `[DONE]`.
fn streamed_choices(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"].get(0).cloned())
        .collect()
}

#[tokio::test]
async fn chat_logprobs_come_in_openais_shape_and_streamed_as_answered() {
    let h = Harness::start(fast(MODEL)).await;
    let request = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6, "logprobs": true, "top_logprobs": 3});
    let (status, body) = h.post("/v1/chat/completions", request.clone()).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "one entry per token");
    let tokens: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, choice["message"]["content"].as_str().unwrap());
    for t in content {
        let lp = t["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{t}");
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], t["token"]);
        let bytes: Vec<u8> = serde_json::from_value(t["bytes"].clone()).unwrap();
        assert_eq!(bytes, t["token"].as_str().unwrap().as_bytes());
    }

    // Streamed: each token's chunk carries its entry, and together they are the answer's.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let choices = streamed_choices(&h.stream("/v1/chat/completions", streamed).await);
    let entries: Vec<Value> = choices
        .iter()
        .filter_map(|c| c["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&entries, content);

    // Without `logprobs`, none.
    let (_, plain) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
        )
        .await;
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    assert_eq!(
        plain["choices"][0]["message"]["content"], choice["message"]["content"],
        "asking for logprobs does not change the text"
    );
}

#[tokio::test]
async fn completion_logprobs_come_in_the_legacy_shape() {
    let h = Harness::start(fast(MODEL)).await;
    let request =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "logprobs": 2});
    let (status, body) = h.post("/v1/completions", request.clone()).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    let offsets: Vec<usize> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    let mut at = 0;
    for (offset, token) in offsets.iter().zip(&tokens) {
        assert_eq!(*offset, at);
        at += token.chars().count();
    }
    for top in lp["top_logprobs"].as_array().unwrap() {
        assert_eq!(top.as_object().unwrap().len(), 2);
    }

    let mut streamed = request;
    streamed["stream"] = json!(true);
    let choices = streamed_choices(&h.stream("/v1/completions", streamed).await);
    let streamed_offsets: Vec<u64> = choices
        .iter()
        .filter_map(|c| c["logprobs"]["text_offset"].as_array())
        .flatten()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(
        streamed_offsets,
        offsets.iter().map(|o| *o as u64).collect::<Vec<_>>(),
        "streamed offsets count from the start of the choice"
    );
}

#[tokio::test]
async fn logprobs_asked_for_wrongly_are_refused_naming_the_field() {
    let h = Harness::start(fast(MODEL)).await;
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (body, param) in [
        (chat(json!({"top_logprobs": 2})), "top_logprobs"),
        (
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (chat(json!({"logprobs": 3})), "logprobs"),
    ] {
        let (status, answer) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(answer["error"]["param"], param, "{answer}");
    }
    let (status, answer) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": true}),
        )
        .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "logprobs");
}

#[tokio::test]
async fn n_choices_are_generated_as_n_sequences_streamed_and_not() {
    let h = Harness::start(fast(MODEL)).await;
    let request = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5, "n": 3});
    let (status, body) = h.post("/v1/chat/completions", request.clone()).await;
    assert_eq!(status, 200, "{body}");
    let texts: Vec<&str> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 3);
    assert!(texts[0] != texts[1] && texts[1] != texts[2], "{texts:?}");
    assert_eq!(body["usage"]["completion_tokens"], 15);
    let (_, single) = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}),
        )
        .await;
    assert_eq!(single["choices"][0]["message"]["content"], texts[0]);

    let mut streamed = request;
    streamed["stream"] = json!(true);
    let choices = streamed_choices(&h.stream("/v1/chat/completions", streamed).await);
    for (i, text) in texts.iter().enumerate() {
        let mine: Vec<&Value> = choices.iter().filter(|c| c["index"] == i).collect();
        let joined: String = mine
            .iter()
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(&joined, text, "choice {i}");
        assert_eq!(mine.last().unwrap()["finish_reason"], "length");
    }
    let (status, _) = h
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 17}),
        )
        .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn a_stop_sequence_ends_the_text_before_it() {
    let h = Harness::start(fast(MODEL)).await;
    let body = |stop: Value| json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "stop": stop});
    let (_, full) = h.post("/v1/completions", body(Value::Null)).await;
    let full_text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let word = full_text.split_whitespace().nth(5).unwrap().to_string();
    let (status, cut) = h
        .post(
            "/v1/completions",
            body(json!(["no such text", word.clone()])),
        )
        .await;
    assert_eq!(status, 200, "{cut}");
    let choice = &cut["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], word.as_str());
    assert_eq!(text, &full_text[..full_text.find(&word).unwrap()]);
    assert!(cut["usage"]["completion_tokens"].as_u64().unwrap() < 30);
    let (status, _) = h.post("/v1/completions", body(json!([1]))).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn a_forced_tool_choice_is_answered_with_a_tool_call() {
    let h = Harness::start(fast(MODEL)).await;
    let tools = json!([
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    ]);
    let request = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 50, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (status, body) = h.post("/v1/chat/completions", request.clone()).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], Value::Null);
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string() && args["days"].is_u64(), "{args}");

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let choices = streamed_choices(&h.stream("/v1/chat/completions", streamed).await);
    assert_eq!(
        choices[0]["delta"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let arguments: String = choices
        .iter()
        .filter_map(|c| c["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, call["function"]["arguments"].as_str().unwrap());

    // `auto` answers with text; a name not among the tools is refused.
    let mut auto = request.clone();
    auto["tool_choice"] = json!("auto");
    let (_, text) = h.post("/v1/chat/completions", auto).await;
    assert!(
        text["choices"][0]["message"]["content"].is_string(),
        "{text}"
    );
    let mut unknown = request;
    unknown["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
    let (status, error) = h.post("/v1/chat/completions", unknown).await;
    assert_eq!(status, 400);
    assert_eq!(error["error"]["param"], "tool_choice");
}
