//! Properties of the parsers that read what model servers send: arbitrary input never
//! panics, scraped values stay in their domain, and SSE framing does not depend on how the
//! bytes were split into network reads.

use futures::StreamExt;
use metronome_worker_agent::metrics_scrape::{parse_prometheus, scrape};
use metronome_worker_agent::model_client::{parse_sse_line, sse_chunks};
use metronome_worker_agent::ServerKind;
use proptest::prelude::*;
use serde_json::{json, Value};

proptest! {
    #[test]
    fn prometheus_text_never_panics_and_kv_stays_a_fraction(text in "\\PC*") {
        let _ = parse_prometheus(&text);
        for kind in [ServerKind::Vllm, ServerKind::Sglang, ServerKind::Llamacpp, ServerKind::Tgi] {
            if let Some(kv) = scrape(kind, &text).kv {
                prop_assert!((0.0..=1.0).contains(&kv.used_frac));
            }
        }
    }

    #[test]
    fn scraped_gauges_are_read_back(running in 0u32..10_000, waiting in 0u32..10_000, used in 0.0f64..=1.0) {
        let text = format!(
            "vllm:num_requests_running{{model_name=\"m\"}} {running}\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}.0\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} {used}\n"
        );
        let load = scrape(ServerKind::Vllm, &text);
        prop_assert_eq!(load.running, Some(running));
        prop_assert_eq!(load.waiting, Some(waiting));
        prop_assert!((load.kv.unwrap().used_frac - used).abs() < 1e-12);
    }

    #[test]
    fn sse_lines_never_panic(line in "\\PC*") {
        let _ = parse_sse_line(&line);
    }

    #[test]
    fn sse_chunks_survive_any_split(texts in proptest::collection::vec("[a-zé😀 ]{0,12}", 1..8), cuts in proptest::collection::vec(any::<usize>(), 0..6)) {
        let mut body = String::new();
        for t in &texts {
            body.push_str(&format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": t}}]})));
        }
        body.push_str("data: [DONE]\n\n");
        let bytes = body.into_bytes();
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        points.dedup();
        let parts: Vec<Result<bytes::Bytes, std::io::Error>> = points
            .windows(2)
            .map(|w| Ok(bytes::Bytes::copy_from_slice(&bytes[w[0]..w[1]])))
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let got: Vec<Value> = rt.block_on(sse_chunks(futures::stream::iter(parts)).map(|r| r.unwrap()).collect());
        let contents: Vec<&str> = got.iter().map(|v| v["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
        prop_assert_eq!(contents, texts.iter().map(String::as_str).collect::<Vec<_>>());
    }
}
